"""Checks for ``notebooks/10_the_grpo_family.ipynb``.

The exercise: DAPO's clip-higher per-token loss
-min(A w, A clip(w, 1 - eps_low, 1 + eps_high)), w = exp(log pi - log pi_old).
The reference is :func:`grpo_lab.losses.compute_policy_gradient_loss` with
``importance_reweighting_method="grpo"`` and ``cliprange_high``; values and
gradients are compared on ratios chosen to sit between the two bounds, where a
symmetric or a swapped clip gives a different answer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from grpo_lab.losses import compute_policy_gradient_loss
from grpo_lab.teaching.checks.framework import (
    CaseCount,
    assert_value_and_gradient,
    exercise_check,
)

ClipHigherLoss = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, float, float], torch.Tensor
]


def _clip_higher_cases() -> list[
    tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, float]
]:
    # With eps_low 0.2 and eps_high 0.28 the bounds are [0.8, 1.28]. Ratios 0.75
    # and 0.78 sit below 1 - eps_low but above 1 - eps_high; 1.25 and 1.3 sit
    # between 1 + eps_low and 1 + eps_high or just above it: a clip that mixes
    # the two ranges up, or clips the log ratio, answers differently there.
    ratios = torch.tensor([[0.5, 0.75, 0.78, 1.0, 1.25, 1.3, 1.6]] * 2)  # (2, 7)
    old_log_probs = torch.full((2, 7), -1.5)  # (B, T)
    policy_log_probs = old_log_probs + ratios.log()  # (B, T)
    generator = torch.Generator().manual_seed(1)
    random_old = -torch.rand(3, 5, generator=generator) * 3  # (B, T)
    random_policy = random_old + 0.4 * torch.randn(3, 5, generator=generator)
    return [
        (torch.tensor([1.0, -1.0]), policy_log_probs, old_log_probs, 0.2, 0.28),
        (torch.tensor([-0.5, 2.0, 0.0]), random_policy, random_old, 0.1, 0.3),
        (torch.tensor([1.5, -1.0, 0.7]), random_policy, random_old, 0.25, 0.25),
    ]


@exercise_check("Clip-higher per-token loss (DAPO)")
def check_clip_higher_loss(student_fn: ClipHigherLoss, cases: CaseCount) -> None:
    """``student_fn(advantages (B,), policy_log_probs, old_log_probs, cliprange_low,
    cliprange_high)`` -> per-token loss (B, T); its gradient must match too."""
    for advantages, policy, old, low, high in _clip_higher_cases():
        with cases.case():
            reference_input = policy.clone().requires_grad_(True)
            expected, _ = compute_policy_gradient_loss(
                advantages, reference_input, "grpo", old, low, cliprange_high=high
            )
            student_input = policy.clone().requires_grad_(True)
            received = student_fn(
                advantages.clone(), student_input, old.clone(), low, high
            )
            ratios = [round(r, 3) for r in (policy - old).exp().flatten().tolist()]
            inputs = (
                f"advantages={advantages.tolist()}, ratios={ratios}, "
                f"cliprange_low={low}, cliprange_high={high}"
            )
            assert_value_and_gradient(
                received, expected, student_input, reference_input, inputs
            )
