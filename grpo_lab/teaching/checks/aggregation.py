"""Checks for ``notebooks/06_loss_aggregation.ipynb``.

The exercise: reduce a (B, T) per-token loss to one scalar, either by the
per-response mean (GRPO, "sequence") or by one constant divisor (Dr. GRPO,
"constant"). The reference is :func:`grpo_lab.losses.aggregate_loss_across_microbatch`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from grpo_lab.losses import aggregate_loss_across_microbatch
from grpo_lab.teaching.checks.framework import assert_close, exercise_check


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


@exercise_check("Exercise 06 (sequence vs constant aggregation)")
def check_aggregate_loss(student_fn: Callable[..., torch.Tensor]) -> None:
    """``student_fn(per_token_loss, response_mask, loss_normalization, constant)``."""
    for loss, mask, normalization, constant in _cases():
        expected = aggregate_loss_across_microbatch(loss, mask, normalization, constant)
        received = student_fn(loss.clone(), mask.clone(), normalization, constant)
        assert_close(received, expected, _describe(loss, mask, normalization, constant))
