"""Checks for ``notebooks/07_training_step.ipynb``.

Exercise 1: the factor that scales one microbatch's loss so that the gradients
accumulated over all microbatches equal the gradient of the whole batch, as
:func:`grpo_lab.train_step.policy_gradient_update` does it.

Exercise 2: which responses need a forward and backward pass at all (the ones
whose advantage is not exactly zero).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from grpo_lab.teaching.checks.framework import (
    ExerciseFailed,
    assert_close,
    exercise_check,
)


def _reference_scale(
    microbatch_rows: int, batch_size: int, loss_normalization: str
) -> float:
    # sequence: each microbatch returns a mean over its own rows, so weight it by
    # its share of the batch. constant: each returns sum / c already.
    return microbatch_rows / batch_size if loss_normalization == "sequence" else 1.0


@exercise_check("Exercise 07a (microbatch loss scale)")
def check_microbatch_loss_scale(student_fn: Callable[[int, int, str], float]) -> None:
    """``student_fn(microbatch_rows, batch_size, loss_normalization) -> float``."""
    # A batch of 5 split into microbatches of 3 and 2: the shares are 3/5 and 2/5,
    # not 1/2 each (1/2 would weight the two rows of the short microbatch more).
    cases = [(3, 5, "sequence"), (2, 5, "sequence"), (4, 4, "sequence")]
    cases += [(2, 8, "sequence"), (3, 5, "constant"), (1, 4, "constant")]
    for rows, batch_size, normalization in cases:
        received = student_fn(rows, batch_size, normalization)
        if isinstance(received, torch.Tensor):
            received = received.item()
        assert_close(
            received,
            _reference_scale(rows, batch_size, normalization),
            f"microbatch_rows={rows}, batch_size={batch_size}, "
            f"loss_normalization={normalization!r}",
        )


@exercise_check("Exercise 07b (responses that need a backward pass)")
def check_active_rows(student_fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """``student_fn(advantages) -> indices`` (1-D long tensor, ascending)."""
    cases = [
        torch.tensor([0.0, 1.2, 0.0, -0.7]),  # negative advantages count too
        torch.tensor([0.0, 0.0, 0.0]),  # a group where every reward is equal
        torch.tensor([0.5, -0.5, 1e-7, 2.0]),  # tiny but nonzero is still active
    ]
    for advantages in cases:
        expected = torch.nonzero(advantages != 0, as_tuple=False).flatten()
        received = student_fn(advantages.clone())
        if not isinstance(received, torch.Tensor):
            raise ExerciseFailed(
                f"For advantages={advantages.tolist()}: expected a tensor of indices, "
                f"got {type(received).__name__}"
            )
        if received.dtype.is_floating_point or received.dtype == torch.bool:
            raise ExerciseFailed(
                f"For advantages={advantages.tolist()}: expected integer indices "
                f"{expected.tolist()}, got a {received.dtype} tensor "
                f"{received.tolist()}"
            )
        assert_close(
            received.flatten(), expected, f"advantages={advantages.tolist()}", atol=0
        )
