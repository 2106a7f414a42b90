"""Held-out scores: one response per prompt, graded by the task's reward.

The supervised warm-up's accuracy check and the training loop's evaluation both
call :func:`held_out_scores`, so "accuracy" means one thing in every metric.
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
