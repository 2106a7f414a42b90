"""Checks for ``notebooks/13_lora_for_rl.ipynb``.

The exercise: the forward of a LoRA-adapted linear layer,

    y = x W^T + (alpha / r) x A^T B^T,   A (r, in), B (out, r),

value and gradients to A and B. The reference is
:func:`grpo_lab.lora.lora_linear` (what peft's layer computes). The
cases are built so that each plausible slip gives a different answer, and the
message names the slip it recognises: the alpha / r scale forgotten (or
written alpha, or r / alpha), A and B swapped, the frozen W x left out. Any
correct form passes: two thin matmuls, or the merged weight W + (alpha/r) B A.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from grpo_lab.lora import lora_linear
from grpo_lab.teaching.checks.framework import (
    CaseCount,
    ExerciseFailed,
    assert_close,
    assert_value_and_gradient,
    exercise_check,
)

LoraFunction = Callable[..., torch.Tensor]
TOLERANCE = 1e-10  # float64 throughout


def _case(batch_shape, fan_in, fan_out, rank, alpha, seed):
    """x, W, A, B (float64, B non-zero so that the adapter shows), alpha, r."""
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    return (
        draw(*batch_shape, fan_in),  # x (..., in)
        draw(fan_out, fan_in),  # W (out, in)
        draw(rank, fan_in),  # A (r, in)
        draw(fan_out, rank),  # B (out, r)
        alpha,
        rank,
    )


# Square layers (in = out, so A and B swapped still multiply) and a rectangular
# one; scales alpha / r of 3, 2 and 0.25, never 1 nor alpha nor r / alpha.
CASES = (
    _case((3,), 4, 4, 2, 6.0, seed=0),
    _case((2, 3), 6, 6, 4, 1.0, seed=1),
    _case((5,), 5, 3, 1, 2.0, seed=2),
)


def _slips(x, weight, lora_A, lora_B, alpha, rank) -> dict[str, torch.Tensor]:
    """The answer each usual slip gives, and what to say about it."""
    base = x @ weight.T  # (..., out)
    update = x @ lora_A.T @ lora_B.T  # (..., out)
    slips = {
        "the alpha / r scale is missing: the update is (alpha / r) B A x": base
        + update,
        "the scale is alpha, not alpha / r": base + alpha * update,
        "the scale is upside down: alpha / r, not r / alpha": base
        + (rank / alpha) * update,
        "the frozen base output (x through W) is missing": (alpha / rank) * update,
    }
    if weight.shape[0] == weight.shape[1]:  # x B A only multiplies when in = out
        swapped = base + (alpha / rank) * (x @ lora_B @ lora_A)
        slips[
            "A and B are swapped: A (r, in) maps each input down to r numbers, "
            "then B (out, r) maps them up"
        ] = swapped
    return slips


def _which_slip(received: object, case) -> str | None:
    if not isinstance(received, torch.Tensor):
        return None
    for message, wrong in _slips(*case).items():
        if received.shape == wrong.shape and torch.allclose(
            received.detach().double(), wrong, atol=1e-8
        ):
            return message
    return None


def _describe(x, weight, lora_A, lora_B, alpha, rank) -> str:
    return (
        f"x of shape {tuple(x.shape)}, W {tuple(weight.shape)}, A "
        f"{tuple(lora_A.shape)}, B {tuple(lora_B.shape)}, alpha={alpha:g}, r={rank}"
    )


@exercise_check("Exercise 13-lora_linear (the LoRA forward)")
def check_lora_linear(student_fn: LoraFunction, cases: CaseCount) -> None:
    """``student_fn(x, weight, lora_A, lora_B, alpha, rank)`` -> (..., out)."""
    for case in CASES:
        with cases.case():
            x, weight, lora_A, lora_B, alpha, rank = case
            inputs = _describe(*case)
            reference_A = lora_A.clone().requires_grad_(True)
            reference_B = lora_B.clone().requires_grad_(True)
            expected = lora_linear(x, weight, reference_A, reference_B, alpha, rank)
            student_A = lora_A.clone().requires_grad_(True)
            student_B = lora_B.clone().requires_grad_(True)
            received = student_fn(
                x.clone(), weight.clone(), student_A, student_B, alpha, rank
            )
            try:
                assert_value_and_gradient(
                    received,
                    expected,
                    student_B,
                    reference_B,
                    inputs,
                    wrt="lora_B",
                    atol=TOLERANCE,
                )
            except ExerciseFailed as failure:
                slip = _which_slip(received, case)
                if slip is None:
                    raise
                raise ExerciseFailed(f"{failure}\n  hint: {slip}") from None
            if student_A.grad is None:
                raise ExerciseFailed(
                    f"For {inputs}: the result's gradient does not reach lora_A"
                )
            assert_close(
                student_A.grad,
                reference_A.grad,
                f"{inputs} (gradient w.r.t. lora_A)",
                atol=TOLERANCE,
            )
