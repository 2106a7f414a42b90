"""Checks for ``notebooks/12_scaling_out.ipynb``.

The exercise: one device's share of a data-parallel token-mean loss. Each of D
devices holds some rows of the global batch; the all-reduce averages their
gradients, so device d must return

    loss_d = D x (sum of its masked per-token losses) / N

with N the response tokens of the whole global batch, for the average over
devices to be the global token mean (verl's ``token-mean`` with
``global_batch_info``). The reference is grpo_lab's accumulation rule,
:func:`grpo_lab.aggregation.aggregate_loss_across_microbatch` (``"token"``) times
:func:`grpo_lab.aggregation.microbatch_loss_scale`, times D. The cases have
devices of unequal token counts, where a plain local token mean (or a missing
factor D) answers differently, and global token counts N that D does not
divide, where an integer division N // D does; values and gradients are
compared.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from grpo_lab.aggregation import aggregate_loss_across_microbatch, microbatch_loss_scale
from grpo_lab.teaching.checks.framework import (
    CaseCount,
    assert_value_and_gradient,
    exercise_check,
)

DeviceLoss = Callable[[torch.Tensor, torch.Tensor, int, int], torch.Tensor]


def reference_device_token_loss(
    per_token_loss: torch.Tensor,
    response_mask: torch.Tensor,
    global_tokens: int,
    num_devices: int,
) -> torch.Tensor:
    """D x this device's token mean x n / N (n: its response tokens)."""
    rows = per_token_loss.shape[0]
    tokens = int(response_mask.sum().item())
    local = aggregate_loss_across_microbatch(per_token_loss, response_mask, "token")
    share = microbatch_loss_scale(
        "token", rows, rows, microbatch_tokens=tokens, batch_tokens=global_tokens
    )
    return local * share * num_devices


def _cases() -> list[tuple[torch.Tensor, torch.Tensor, int, int]]:
    # Device 0 of 2 holds 2 + 1 = 3 tokens of a global 3 + 9 = 12: its share is
    # 2 x (2 + 4 + 6) / 12 = 2.0, where a local token mean would give 12 / 3 = 4.
    loss = torch.tensor([[2.0, 4.0, 9.0], [6.0, 9.0, 9.0]])  # (2, 3), 9: padding
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])  # (2, 3)
    generator = torch.Generator().manual_seed(3)
    random_loss = torch.randn(3, 5, generator=generator, dtype=torch.float64)
    random_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]])
    # N not divisible by D: 13 tokens over 2 devices and 11 over 3, where a
    # divisor N // D (6 and 3) differs from N / D (6.5 and 3.67).
    return [
        (loss, mask, 12, 2),
        (random_loss, random_mask, 40, 4),
        (loss, mask, 3, 1),
        (loss, mask, 13, 2),
        (random_loss, random_mask, 11, 3),
    ]


@exercise_check("Exercise 12 (one device's share of a global token mean)")
def check_device_token_loss(student_fn: DeviceLoss, cases: CaseCount) -> None:
    """``student_fn(per_token_loss, response_mask, global_tokens, num_devices)``
    -> a scalar; its gradient w.r.t. ``per_token_loss`` must match too."""
    for loss, mask, global_tokens, devices in _cases():
        with cases.case():
            reference_input = loss.clone().requires_grad_(True)
            expected = reference_device_token_loss(
                reference_input, mask, global_tokens, devices
            )
            student_input = loss.clone().requires_grad_(True)
            received = student_fn(student_input, mask.clone(), global_tokens, devices)
            assert_value_and_gradient(
                received,
                expected,
                student_input,
                reference_input,
                f"per_token_loss={loss.tolist()}, response_mask={mask.tolist()}, "
                f"global_tokens={global_tokens}, num_devices={devices}",
                "per_token_loss",
            )
