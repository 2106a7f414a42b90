"""Checks for ``notebooks/06_loss_aggregation.ipynb``.

Exercise 1: reduce a (B, T) per-token loss to one scalar, either by the
per-response mean (GRPO, "sequence") or by one constant divisor (Dr. GRPO,
"constant"). The reference is
:func:`grpo_lab.aggregation.aggregate_loss_across_microbatch`.

Exercise 2: the whole scalar GRPO loss of a batch, from log-probs to the
aggregated clipped surrogate. The reference is the train step's own pieces:
:func:`grpo_lab.losses.compute_policy_gradient_loss` (``"grpo"``) reduced by
:func:`grpo_lab.aggregation.aggregate_loss_across_microbatch`.

Both are trained through, so values and gradients are compared.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from grpo_lab.aggregation import aggregate_loss_across_microbatch
from grpo_lab.losses import compute_policy_gradient_loss
from grpo_lab.teaching.checks.framework import (
    CaseCount,
    ExerciseFailed,
    assert_value_and_gradient,
    exercise_check,
)


def _cases() -> list[tuple[torch.Tensor, torch.Tensor, str, int | None]]:
    # A 1-token and a 3-token response, with loss on the padding that must be ignored.
    # sequence: (2/1 + (1+1+1)/3) / 2 = 1.5; constant 4: (2 + 3) / 4 = 1.25
    # (a plain token mean would give 5/4 = 1.25 for sequence, 1.5 for constant 4)
    loss = torch.tensor([[2.0, 7.0, 7.0], [1.0, 1.0, 1.0]])  # (2, 3)
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])  # (2, 3)
    uneven = torch.tensor([[1.0, -3.0, 5.0, 0.5], [4.0, 2.0, 9.0, 9.0]])  # (2, 4)
    uneven_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])  # (2, 4)
    return [
        (loss, mask, "sequence", None),
        (loss, mask, "constant", 4),
        (uneven, uneven_mask, "sequence", None),
        (uneven, uneven_mask, "constant", 10),
    ]


def _describe(loss, mask, normalization, constant) -> str:
    return (
        f"per_token_loss={loss.tolist()}, response_mask={mask.tolist()}, "
        f"loss_normalization={normalization!r}, normalization_constant={constant}"
    )


@exercise_check("Exercise 06-aggregate_loss (sequence vs constant aggregation)")
def check_aggregate_loss(
    student_fn: Callable[..., torch.Tensor], cases: CaseCount
) -> None:
    """``student_fn(per_token_loss, response_mask, loss_normalization, constant)``;
    its gradient w.r.t. ``per_token_loss`` (each token's weight) must match too."""
    for loss, mask, normalization, constant in _cases():
        with cases.case():
            reference_loss = loss.clone().requires_grad_(True)
            expected = aggregate_loss_across_microbatch(
                reference_loss, mask, normalization, constant
            )
            student_loss = loss.clone().requires_grad_(True)
            received = student_fn(student_loss, mask.clone(), normalization, constant)
            inputs = _describe(loss, mask, normalization, constant)
            _name_an_aggregation_slip(
                received, expected, (loss, mask, normalization, constant), inputs
            )
            assert_value_and_gradient(
                received,
                expected,
                student_loss,
                reference_loss,
                inputs,
                "per_token_loss",
            )


# --- 06-aggregate_loss: the slips it names ------------------------------------------


def _aggregation_slips(loss, mask, normalization, constant) -> dict[str, torch.Tensor]:
    """The value each usual slip gives, and what to say about it."""
    masked = loss * mask  # (B, T)
    tokens = mask.sum()
    if normalization == "sequence":
        per_response = masked.sum(dim=1) / mask.sum(dim=1)  # (B,)
        return {
            "the batch's token mean (DAPO's), not the mean of per-response means": (
                masked.sum() / tokens
            ),
            "padding counts: each response is averaged over all T positions": (
                masked.sum(dim=1) / mask.shape[1]
            ).mean(),
            "padding counts: the per-token loss is averaged unmasked": loss.mean(),
            "the per-response means are summed, not averaged over the B responses": (
                per_response.sum()
            ),
            "each response's loss is summed over its tokens, not averaged": (
                masked.sum(dim=1).mean()
            ),
        }
    return {
        "the divisor is the number of response tokens, not normalization_constant": (
            masked.sum() / tokens
        ),
        "padding counts: every position's loss is summed": loss.sum() / constant,
        "the per-response means are used, not the masked sum over a constant": (
            masked.sum(dim=1) / mask.sum(dim=1)
        ).mean(),
        "the masked sum is divided by normalization_constant times B": (
            masked.sum() / (constant * mask.shape[0])
        ),
    }


def _name_an_aggregation_slip(received, expected, case, inputs: str) -> None:
    if not isinstance(received, torch.Tensor) or received.shape != expected.shape:
        return  # assert_close reports the type or shape
    value = received.detach().double()
    if torch.allclose(value, expected.detach().double(), atol=1e-6):
        return
    for slip, wrong in _aggregation_slips(*case).items():
        if torch.allclose(value, wrong.detach().double(), atol=1e-6):
            raise ExerciseFailed(
                f"For {inputs}:\n  expected {expected.item():.6f}\n  got      "
                f"{value.item():.6f}: {slip}"
            )


# --- end of 06-aggregate_loss's slips -----------------------------------------------


GrpoLoss = Callable[..., torch.Tensor]


def reference_grpo_loss(
    policy_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float,
    loss_normalization: str,
    normalization_constant: int | None = None,
) -> torch.Tensor:
    """The package's scalar GRPO loss: clipped per-token loss, then aggregated."""
    per_token_loss, _ = compute_policy_gradient_loss(
        advantages, policy_log_probs, "grpo", old_log_probs, cliprange, response_mask
    )  # (B, T)
    return aggregate_loss_across_microbatch(
        per_token_loss, response_mask, loss_normalization, normalization_constant
    )


def _grpo_cases() -> list[tuple[torch.Tensor, ...]]:
    # Three responses of 1, 4 and 2 tokens after a 1-token prompt column. Log
    # ratios from -0.69 to 0.47 (ratios 0.5 to 1.6, inside and outside
    # [0.8, 1.2]); advantages of both signs. Padding holds log-prob 0 (ratio up
    # to e^2.5), which must not count.
    generator = torch.Generator().manual_seed(3)
    old = -torch.rand(3, 6, generator=generator) * 2 - 0.5  # (B, T)
    log_ratio = torch.tensor(
        [
            [0.0, 0.47, 0.0, 0.0, 0.0, 0.0],
            [0.0, -0.69, 0.1, 0.3, -0.15, 0.0],
            [0.0, 0.05, -0.4, 0.0, 0.0, 0.0],
        ]
    )  # (B, T)
    mask = torch.tensor(
        [[0, 1, 0, 0, 0, 0], [0, 1, 1, 1, 1, 0], [0, 1, 1, 0, 0, 0]]
    )  # (B, T)
    padding = torch.zeros_like(mask, dtype=torch.bool)
    padding[:, 1:] = mask[:, 1:] == 0
    policy = torch.where(padding, 0.0, old + log_ratio)  # (B, T)
    advantages = torch.tensor([1.0, -0.5, 2.0])  # (B,)
    return [(policy, old, advantages, mask)]


# (loss_normalization, normalization_constant, cliprange)
_SETTINGS = (("sequence", None, 0.2), ("constant", 12, 0.2), ("token", None, 0.1))


@exercise_check("Exercise 06-grpo_loss (the scalar GRPO loss)")
def check_grpo_loss(student_fn: GrpoLoss, cases: CaseCount) -> None:
    """``student_fn(policy_log_probs, old_log_probs, advantages, response_mask,
    cliprange, loss_normalization, normalization_constant)`` -> scalar; its
    gradient w.r.t. ``policy_log_probs`` must match too."""
    for policy, old, advantages, mask in _grpo_cases():
        for normalization, constant, cliprange in _SETTINGS:
            with cases.case():
                settings = (cliprange, normalization, constant)
                reference_input = policy.clone().requires_grad_(True)
                expected = reference_grpo_loss(
                    reference_input, old, advantages, mask, *settings
                )
                student_input = policy.clone().requires_grad_(True)
                received = student_fn(
                    student_input,
                    old.clone(),
                    advantages.clone(),
                    mask.clone(),
                    *settings,
                )
                ratios = (policy - old).exp().round(decimals=3)  # (B, T)
                inputs = (
                    f"token ratios={ratios.tolist()}, "
                    f"advantages={advantages.tolist()}, "
                    f"response_mask={mask.tolist()}, cliprange={cliprange}, "
                    f"loss_normalization={normalization!r}, "
                    f"normalization_constant={constant}"
                )
                _name_a_classic_mistake(
                    received,
                    expected,
                    (policy, old, advantages, mask),
                    settings,
                    inputs,
                )
                assert_value_and_gradient(
                    received, expected, student_input, reference_input, inputs
                )


def _name_a_classic_mistake(
    received: object,
    expected: torch.Tensor,
    tensors: tuple[torch.Tensor, ...],
    settings: tuple[float, str, int | None],
    inputs: str,
) -> None:
    """Raise naming the mistake when ``received`` is exactly a classic wrong value."""
    if not isinstance(received, torch.Tensor) or received.shape != expected.shape:
        return  # assert_close reports the type or shape
    value = received.detach()
    if torch.allclose(value, expected.detach(), atol=1e-5):
        return
    policy, old, advantages, mask = tensors
    cliprange, normalization, constant = settings
    ones = torch.ones_like(mask)
    mistakes = {
        "the clip is left out": reference_grpo_loss(
            policy, old, advantages, mask, float("inf"), normalization, constant
        ),
        "padding and prompt positions are counted (the response_mask is not "
        "applied)": reference_grpo_loss(
            policy, old, advantages, ones, cliprange, normalization, constant
        ),
        "the advantage's sign is flipped (the loss is minus the objective)": (
            -reference_grpo_loss(policy, old, advantages, mask, *settings)
        ),
    }
    if normalization == "sequence":
        mistakes["the batch's token mean is taken instead of the per-response mean"] = (
            reference_grpo_loss(policy, old, advantages, mask, cliprange, "token")
        )
    for mistake, wrong in mistakes.items():
        if torch.allclose(value, wrong.detach(), atol=1e-6):
            raise ExerciseFailed(
                f"For {inputs}:\n  expected {expected.item():.6f}\n  got      "
                f"{value.item():.6f}, the value you get when {mistake}"
            )
