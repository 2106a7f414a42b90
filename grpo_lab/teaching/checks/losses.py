"""Checks for ``notebooks/04_policy_gradient_and_clipping.ipynb``.

The exercise: the PPO/GRPO clipped per-token loss
-min(A w, A clip(w, 1 - eps, 1 + eps)), w = exp(log pi - log pi_old). The
reference is :func:`grpo_lab.losses.compute_policy_gradient_loss` with
``importance_reweighting_method="grpo"``; values and gradients are compared.
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


def _loss_cases() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]]:
    # Ratios exp(log pi - log pi_old) of 0.5, 0.9, 1.0, 1.1, 1.5: inside and
    # outside [0.8, 1.2], under a positive and a negative advantage.
    ratios = torch.tensor([[0.5, 0.9, 1.0, 1.1, 1.5], [0.5, 0.9, 1.0, 1.1, 1.5]])
    old_log_probs = torch.full((2, 5), -1.0)  # (B, T)
    policy_log_probs = old_log_probs + ratios.log()  # (B, T)
    generator = torch.Generator().manual_seed(0)
    random_old = -torch.rand(3, 4, generator=generator) * 3  # (B, T)
    random_policy = random_old + 0.5 * torch.randn(3, 4, generator=generator)
    return [
        (torch.tensor([1.0, -1.0]), policy_log_probs, old_log_probs, 0.2),
        (torch.tensor([0.7, -2.0, 0.0]), random_policy, random_old, 0.1),
        (torch.tensor([2.0, -0.5, 1.0]), random_policy, random_old, 0.3),
    ]


@exercise_check("Exercise 04-clipped_loss (the clipped per-token loss)")
def check_clipped_loss(
    student_fn: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor
    ],
    cases: CaseCount,
) -> None:
    """``student_fn(advantages (B,), policy_log_probs, old_log_probs, cliprange)``
    -> per-token loss (B, T); its gradient must match too."""
    for advantages, policy_log_probs, old_log_probs, cliprange in _loss_cases():
        with cases.case():
            reference_input = policy_log_probs.clone().requires_grad_(True)
            expected, _ = compute_policy_gradient_loss(
                advantages, reference_input, "grpo", old_log_probs, cliprange
            )
            student_input = policy_log_probs.clone().requires_grad_(True)
            received = student_fn(
                advantages.clone(), student_input, old_log_probs.clone(), cliprange
            )
            ratios = [
                round(r, 3)
                for r in (policy_log_probs - old_log_probs).exp().flatten().tolist()
            ]
            inputs = (
                f"advantages={advantages.tolist()}, ratios={ratios}, "
                f"cliprange={cliprange}"
            )
            assert_value_and_gradient(
                received, expected, student_input, reference_input, inputs
            )
