"""Checks for ``notebooks/05_gspo.ipynb``.

The exercise: GSPO's sequence-level ratio, the geometric mean of the token
ratios over the response, s_i = exp(mean_{t in o_i} (log pi - log pi_old)).
The reference is :func:`grpo_lab.losses.compute_policy_gradient_loss` with
``importance_reweighting_method="gspo"``: with advantage 1 and an infinite
clip range its per-token loss is -s_i on every token of response i. The
ratio is trained through, so its gradient with respect to ``policy_log_probs``
is compared too: a detached ratio fails.
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


def reference_sequence_ratio(
    policy_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
) -> torch.Tensor:
    """s_i read off the package's GSPO loss, with its gradient. (B, T) x 3 -> (B,)."""
    advantages = torch.ones(policy_log_probs.shape[0])  # (B,)
    per_token_loss, _ = compute_policy_gradient_loss(
        advantages,
        policy_log_probs,
        "gspo",
        old_log_probs,
        float("inf"),
        response_mask,
    )
    return -per_token_loss[:, 0]  # (B,)


def _ratio_cases() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    # Token ratios 2 and 0.5 around one prompt token and one pad: geometric mean
    # 1, arithmetic mean 1.25; the prompt and pad positions must not count.
    old = torch.full((1, 4), -1.0)  # (B, T)
    policy = old + torch.tensor([[3.0, 2.0, 0.5, 7.0]]).log()
    mask = torch.tensor([[0, 1, 1, 0]])
    generator = torch.Generator().manual_seed(0)
    random_old = -torch.rand(3, 6, generator=generator) * 3  # (B, T)
    random_policy = random_old + 0.3 * torch.randn(3, 6, generator=generator)
    ragged_mask = torch.tensor(
        [[0, 0, 1, 1, 1, 1], [0, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 1]]
    )
    return [(policy, old, mask), (random_policy, random_old, ragged_mask)]


@exercise_check("Exercise 05-sequence_ratio (GSPO's sequence-level ratio)")
def check_sequence_ratio(
    student_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    cases: CaseCount,
) -> None:
    """``student_fn(policy_log_probs, old_log_probs, response_mask)`` -> (B,)."""
    for policy_log_probs, old_log_probs, response_mask in _ratio_cases():
        with cases.case():
            reference_input = policy_log_probs.clone().requires_grad_(True)
            expected = reference_sequence_ratio(
                reference_input, old_log_probs, response_mask
            )
            student_input = policy_log_probs.clone().requires_grad_(True)
            received = student_fn(
                student_input, old_log_probs.clone(), response_mask.clone()
            )
            token_ratios = (policy_log_probs - old_log_probs).exp().round(decimals=3)
            inputs = (
                f"token ratios={token_ratios.tolist()}, "
                f"response_mask={response_mask.tolist()}"
            )
            assert_value_and_gradient(
                received, expected, student_input, reference_input, inputs
            )
