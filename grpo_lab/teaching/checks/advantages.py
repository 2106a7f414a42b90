"""Checks for ``notebooks/03_rewards_and_advantages.ipynb``.

The exercise composes the notebook's sections: a rollout batch's responses are
graded with ``exact_match_reward`` against their prompt's answer (the batch is
laid out group by group), and each group's rewards become GRPO's advantages,
(r - group mean) / (group sample std + eps). The reference is
:func:`grpo_lab.advantages.compute_rollout_rewards` then
:func:`grpo_lab.advantages.compute_group_normalized_rewards` with
``baseline="mean"`` and ``advantage_normalizer="std"``. Advantages carry no
gradient: they are constants of the update that notebook 04 builds on them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from grpo_lab.advantages import (
    compute_group_normalized_rewards,
    compute_rollout_rewards,
)
from grpo_lab.rewards import exact_match_reward
from grpo_lab.teaching.checks.framework import (
    CaseCount,
    ExerciseFailed,
    assert_close,
    exercise_check,
)

# (responses, the prompts' answers, group_size): one group with a right answer
# written with spaces around it; a group whose rewards are all equal beside a
# mixed one (eps keeps it at 0, not NaN); groups of three, one all right; and
# three groups of two, where reading the answers as interleaved (truth i % B)
# grades other responses.
ADVANTAGE_CASES = (
    (["19", " 19\n", "18", "no idea"], ["19"], 4),
    (["7", "7", " 7", "7", "12", "21", "12", "1 2"], ["7", "12"], 4),
    (["5", "5", "6", "9", "9", "9"], ["5", "9"], 3),
    (["1", "2", "3", "4", "2", "1"], ["1", "3", "2"], 2),
)


def reference_batch_advantages(
    responses: list[str], ground_truths: list[str], group_size: int, eps: float
) -> torch.Tensor:
    """GRPO's advantages of a rollout batch laid out group by group (B·G,)."""
    repeated = [truth for truth in ground_truths for _ in range(group_size)]
    rewards, _ = compute_rollout_rewards(exact_match_reward, responses, repeated)
    return compute_group_normalized_rewards(rewards, group_size, "mean", eps, "std")[0]


@exercise_check(
    "Exercise 03-group_normalized_advantages (a rollout batch's GRPO advantages)"
)
def check_group_normalized_advantages(
    student_fn: Callable[[list[str], list[str], int, float], torch.Tensor],
    cases: CaseCount,
    advantage_eps: float = 1e-6,
) -> None:
    """``student_fn(responses (B·G strings), ground_truths (B strings),
    group_size, advantage_eps)`` -> the advantages (B·G,)."""
    for responses, truths, group_size in ADVANTAGE_CASES:
        with cases.case():
            expected = reference_batch_advantages(
                responses, truths, group_size, advantage_eps
            )
            received = student_fn(
                list(responses), list(truths), group_size, advantage_eps
            )
            inputs = (
                f"responses={responses}, ground_truths={truths}, "
                f"group_size={group_size}, advantage_eps={advantage_eps}"
            )
            slip = _slip(received, responses, truths, group_size, advantage_eps)
            if slip:
                raise ExerciseFailed(f"{slip}. For {inputs}")
            assert_close(received, expected, inputs, atol=1e-4)


def _slip(
    received: object,
    responses: list[str],
    truths: list[str],
    group_size: int,
    eps: float,
) -> str:
    """The classic mistake a wrong ``received`` matches, or "" when none does."""
    if not isinstance(received, torch.Tensor) or received.shape != (len(responses),):
        return ""
    if received.isnan().any():
        return (
            "a group whose rewards are all equal gives NaN: its spread is 0, and "
            "advantage_eps is what keeps the division finite"
        )
    repeated = [truth for truth in truths for _ in range(group_size)]
    interleaved = [truths[i % len(truths)] for i in range(len(responses))]

    def graded(answers: list[str], key: str = "reward") -> torch.Tensor:
        scores = [exact_match_reward(r, t)[key] for r, t in zip(responses, answers)]
        return torch.tensor(scores)

    def normalized(rewards: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
        grouped = rewards.reshape(-1, group_size)  # (B, G)
        spread = grouped.std(dim=1, unbiased=unbiased, keepdim=True) + eps
        return ((grouped - grouped.mean(dim=1, keepdim=True)) / spread).flatten()

    rewards = graded(repeated)
    if _close(received, normalized(rewards)):
        return ""
    grouped = rewards.reshape(-1, group_size)
    slips = {
        "each response is graded against the answer of another prompt: the "
        "batch is laid out group by group, the G responses of prompt 0 first": (
            normalized(graded(interleaved))
        ),
        "the format reward is used: the reward is the dict's 'reward'": normalized(
            graded(repeated, "format_reward")
        ),
        "the population std is used: GRPO divides by the sample std": normalized(
            rewards, unbiased=False
        ),
        "the mean of the whole batch is subtracted: each response is compared "
        "with its own group": (
            (grouped - rewards.mean()) / (grouped.std(dim=1, keepdim=True) + eps)
        ).flatten(),
        "the raw rewards are returned: GRPO subtracts the group's mean and divides "
        "by its spread": rewards,
    }
    return next((slip for slip, value in slips.items() if _close(received, value)), "")


def _close(received: torch.Tensor, value: torch.Tensor) -> bool:
    return torch.allclose(received.detach().double(), value.double(), atol=1e-4)
