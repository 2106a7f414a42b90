"""Held-out scores: one response per prompt, graded by the task's reward.

The supervised warm-up's accuracy check and the training loop's evaluation both
call :func:`held_out_scores`, so "accuracy" means one thing in every metric.
:func:`pass_at_k` is the unbiased pass@k estimator, and :func:`correct_counts`
samples the n responses per prompt it reads.
Taught in ``notebooks/08_training_loop.ipynb``.
"""

from __future__ import annotations

from dataclasses import dataclass

from grpo_lab.rollouts.base import RolloutBackend, SamplingSettings
from grpo_lab.tasks.base import Example, Task


@dataclass(frozen=True)
class HeldOutScores:
    """Means over held-out prompts of one response each."""

    # Mean answer reward (1 for a correct answer).
    accuracy: float
    # Mean format reward (1 for a well-formed response).
    format_rate: float
    # Mean response length in tokens (characters when the backend gives no ids).
    response_length: float


def held_out_scores(
    backend: RolloutBackend,
    task: Task,
    examples: list[Example],
    sampling: SamplingSettings,
) -> HeldOutScores:
    """Sample one response per example (greedy at temperature 0) and grade it."""
    rollouts = backend.generate([e.prompt for e in examples], 1, sampling)
    scores = [
        task.reward_fn(response, example.ground_truth)
        for response, example in zip(rollouts.responses, examples)
    ]
    if rollouts.response_token_ids is not None:
        lengths = [len(ids) for ids in rollouts.response_token_ids]
    else:
        lengths = [len(text) for text in rollouts.responses]
    return HeldOutScores(
        accuracy=_mean(s["answer_reward"] for s in scores),
        format_rate=_mean(s["format_reward"] for s in scores),
        response_length=_mean(lengths),
    )


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate from ``n`` samples of which ``c`` are correct.

    pass@k = 1 - C(n - c, k) / C(n, k)    (Chen et al. 2021, arXiv:2107.03374)

    the chance that ``k`` of the ``n`` samples, drawn without replacement, hold at
    least one correct one. pass@1 = c / n; pass@n = 1 if c > 0 else 0. Computed as
    the product 1 - prod_{i = n-c+1}^{n} (1 - k / i), which never forms the huge
    binomials.
    """
    for name, value in (("n", n), ("c", c), ("k", k)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an int, got {value!r}")
    if n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    if not 0 <= c <= n:
        raise ValueError(f"c must be an int in [0, n={n}], got {c!r}")
    if not 1 <= k <= n:
        raise ValueError(f"k must be an int in [1, n={n}], got {k!r}")
    if n - c < k:
        return 1.0
    none_correct = 1.0
    for i in range(n - c + 1, n + 1):
        none_correct *= 1.0 - k / i
    return 1.0 - none_correct


def pass_at_k_curve(correct_counts: list[int], n: int) -> list[float]:
    """Mean pass@k over prompts for k = 1..n; ``correct_counts[j]`` of prompt j.

    Each prompt has ``n`` samples; the curve's first point is the mean accuracy
    (pass@1) and its last the share of prompts solved at least once.
    """
    if not correct_counts:
        raise ValueError("correct_counts must hold at least one prompt, got []")
    return [
        sum(pass_at_k(n, c, k) for c in correct_counts) / len(correct_counts)
        for k in range(1, n + 1)
    ]


def correct_counts(
    backend: RolloutBackend,
    task: Task,
    examples: list[Example],
    n: int,
    sampling: SamplingSettings,
) -> list[int]:
    """Sample ``n`` responses per example; count the correct ones of each."""
    rollouts = backend.generate([e.prompt for e in examples], n, sampling)
    counts = []
    for index, example in enumerate(examples):
        group = rollouts.responses[index * n : (index + 1) * n]
        counts.append(
            int(
                sum(
                    task.reward_fn(response, example.ground_truth)["answer_reward"]
                    for response in group
                )
            )
        )
    return counts
