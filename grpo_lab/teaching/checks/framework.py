"""How every exercise check behaves.

A check takes the student's function and returns True on success. A stub (the
body still raises ``NotImplementedError``) prints "not attempted yet" and returns
False, so a student copy still runs to the end. A wrong answer raises
:class:`ExerciseFailed` with a concrete counter-example: the inputs, the expected
value and the value received.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch


class ExerciseFailed(AssertionError):
    """The student's answer disagrees with the reference on a concrete input."""


def exercise_check(title: str) -> Callable[[Callable[..., None]], Callable[..., bool]]:
    """Decorate ``checker(student_fn, ...)``, which raises ExerciseFailed or returns."""

    def decorate(checker: Callable[..., None]) -> Callable[..., bool]:
        @functools.wraps(checker)
        def run(student_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
            try:
                checker(student_fn, *args, **kwargs)
            except NotImplementedError:
                print(
                    f"{title}: not attempted yet (the stub raises NotImplementedError)"
                )
                return False
            print(f"{title}: correct ✔")
            return True

        return run

    return decorate


def assert_close(
    received: Any,
    expected: Any,
    inputs: str,
    atol: float = 1e-5,
    rtol: float = 1e-4,
) -> None:
    """Raise ExerciseFailed naming the inputs unless received ≈ expected."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(received, torch.Tensor):
            raise ExerciseFailed(
                f"For {inputs}: expected a tensor, got {type(received).__name__}"
            )
        if received.shape != expected.shape:
            raise ExerciseFailed(
                f"For {inputs}: expected shape {tuple(expected.shape)}, "
                f"got {tuple(received.shape)}"
            )
        if torch.allclose(
            received.double(), expected.double(), atol=atol, rtol=rtol, equal_nan=True
        ):
            return
    elif received == expected or (
        isinstance(expected, float)
        and isinstance(received, (int, float))
        and abs(received - expected) <= atol + rtol * abs(expected)
    ):
        return
    raise ExerciseFailed(f"For {inputs}:\n  expected {expected}\n  got      {received}")


def assert_loss_and_gradient(
    received: Any,
    expected: torch.Tensor,
    student_input: torch.Tensor,
    reference_input: torch.Tensor,
    inputs: str,
    atol: float = 1e-5,
) -> None:
    """A per-token loss equal to ``expected``, whose summed gradient w.r.t.
    ``student_input`` equals the reference's w.r.t. ``reference_input`` (whose
    backward has already run). A detached loss fails with its own message."""
    assert_close(received, expected.detach(), inputs, atol=atol)
    if not received.requires_grad:
        raise ExerciseFailed(
            f"For {inputs}: the loss carries no gradient to policy_log_probs "
            "(was something detached?)"
        )
    received.sum().backward()
    assert_close(
        student_input.grad,
        reference_input.grad,
        f"{inputs} (gradient of the summed loss w.r.t. policy_log_probs)",
        atol=atol,
    )
