"""Checks for ``notebooks/03_rewards_and_advantages.ipynb``.

The exercise: GRPO's group-normalized advantages, (r - group mean) / (group
sample std + eps). The reference is
:func:`grpo_lab.advantages.compute_group_normalized_rewards` with
``baseline="mean"`` and ``advantage_normalizer="std"``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from grpo_lab.advantages import compute_group_normalized_rewards
from grpo_lab.teaching.checks.framework import (
    CaseCount,
    assert_close,
    exercise_check,
)

# (raw rewards, group_size): one group, two groups with different means (a
# batch-wide mean fails), an all-equal group (eps keeps it at 0, not NaN),
# and groups of two.
ADVANTAGE_CASES = (
    ([1.0, 0.0, 0.0, 1.0], 4),
    ([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0], 4),
    ([1.0, 1.0, 1.0, 0.0, 0.5, 1.0], 3),
    ([0.0, 1.0, 2.0, 2.0], 2),
)


@exercise_check(
    "Exercise 03-group_normalized_advantages (GRPO's group-normalized advantages)"
)
def check_group_normalized_advantages(
    student_fn: Callable[[torch.Tensor, int, float], torch.Tensor],
    cases: CaseCount,
    advantage_eps: float = 1e-6,
) -> None:
    """``student_fn(raw_rewards (B,), group_size, advantage_eps)`` -> (B,)."""
    for rewards, group_size in ADVANTAGE_CASES:
        with cases.case():
            raw_rewards = torch.tensor(rewards)  # (B,)
            expected, _ = compute_group_normalized_rewards(
                raw_rewards, group_size, "mean", advantage_eps, "std"
            )
            received = student_fn(raw_rewards.clone(), group_size, advantage_eps)
            inputs = (
                f"raw_rewards={rewards}, group_size={group_size}, "
                f"advantage_eps={advantage_eps}"
            )
            assert_close(received, expected, inputs, atol=1e-4)
