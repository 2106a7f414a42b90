"""Held-out scores: one response per prompt, graded by the task's reward.

The supervised warm-up's accuracy check and the training loop's evaluation both
call :func:`held_out_scores`, so "accuracy" means one thing in every metric.
:func:`pass_at_k` is the unbiased pass@k estimator, and :func:`correct_counts`
samples the n responses per prompt it reads.
Taught in ``notebooks/08_training_loop.ipynb``.
"""

from __future__ import annotations

import collections
import math
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
    _check_examples(examples)
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


def _check_examples(examples: object) -> None:
    """At least one example: a mean over none would read as a score of 0."""
    if not isinstance(examples, list | tuple) or not examples:
        raise ValueError(f"examples must hold at least one example, got {examples!r}")


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


# Up to this many factors, pass@k is the plain product; beyond, a closed form.
EXACT_PRODUCT_TERMS = 1000
# The longest pass@k curve (one point per k = 1..n).
MAX_CURVE_SAMPLES = 4096


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate from ``n`` samples of which ``c`` are correct.

    pass@k = 1 - C(n - c, k) / C(n, k)    (Chen et al. 2021, arXiv:2107.03374)

    the chance that ``k`` of the ``n`` samples, drawn without replacement, hold at
    least one correct one. pass@1 = c / n; pass@n = 1 if c > 0 else 0. The ratio
    is the product 1 - prod_{i = n-c+1}^{n} (1 - k / i) (c factors), or the same
    ratio as prod_{j=0}^{k-1} (1 - c / (n - j)) (k factors), which never form
    the huge binomials. When both c and k exceed ``EXACT_PRODUCT_TERMS`` its
    log is computed in closed form from Stirling's series (its error about
    2e-16 x min(c, k)), so the time does not grow with n
    (``pass_at_k(10**9, ...)`` is instant).
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
    if c <= EXACT_PRODUCT_TERMS:
        none_correct = 1.0
        for i in range(n - c + 1, n + 1):
            none_correct *= 1.0 - k / i
        return 1.0 - none_correct
    if k <= EXACT_PRODUCT_TERMS:
        none_correct = 1.0
        for j in range(k):
            none_correct *= 1.0 - c / (n - j)
        return 1.0 - none_correct
    return -math.expm1(_log_none_correct(n, c, k))


def _log_none_correct(n: int, c: int, k: int) -> float:
    """log C(n-c, k) / C(n, k) = log G(x + m) - log G(x) - (log G(x + M + m) -
    log G(x + M)), with m = min(c, k), M = max(c, k), x = n - c - k + 1 and G
    the Gamma function. For x >= 10 each difference is Stirling's series, with
    the m log(.) terms joined into one log1p, so the error is ~1e-16 x m
    instead of ~1e-16 x n log n."""
    m, big = min(c, k), max(c, k)
    x = n - c - k + 1
    if x < 10:
        low = math.lgamma(x + m) - math.lgamma(x)
        return low - (math.lgamma(x + big + m) - math.lgamma(x + big))
    far = x + big

    def shape(y: int) -> float:  # (y - 1/2) log(1 + m / y) + the series terms
        return (y - 0.5) * math.log1p(m / y) + _series(y + m) - _series(y)

    return shape(x) - shape(far) + m * math.log1p(-big / (far + m))


def _series(y: float) -> float:
    """Stirling's series of log Gamma(y) beyond its leading terms."""
    return 1 / (12 * y) - 1 / (360 * y**3) + 1 / (1260 * y**5)


def pass_at_k_curve(correct_counts: list[int], n: int) -> list[float]:
    """Mean pass@k over prompts for k = 1..n; ``correct_counts[j]`` of prompt j.

    Each prompt has ``n`` samples (at most ``MAX_CURVE_SAMPLES``: the curve
    has n points); the curve's first point is the mean accuracy (pass@1) and
    its last the share of prompts solved at least once. Each distinct count
    costs n steps of the recurrence C(n-c, k+1) / C(n, k+1) = C(n-c, k) /
    C(n, k) x (n-c-k) / (n-k).
    """
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CURVE_SAMPLES:
        raise ValueError(
            f"n must be an int in [1, {MAX_CURVE_SAMPLES}] (samples per prompt), "
            f"got {n!r}"
        )
    if not isinstance(correct_counts, list | tuple) or not correct_counts:
        raise ValueError(
            f"correct_counts must hold at least one prompt, got {correct_counts!r}"
        )
    for count in correct_counts:
        if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= n:
            raise ValueError(
                f"correct_counts must hold ints in [0, n={n}], got {count!r}"
            )
    curve = [0.0] * n
    for count, prompts in collections.Counter(correct_counts).items():
        for index, value in enumerate(_pass_at_every_k(n, count)):
            curve[index] += prompts * value
    return [total / len(correct_counts) for total in curve]


def _pass_at_every_k(n: int, c: int) -> list[float]:
    """pass@k for k = 1..n of one prompt with ``c`` correct of ``n``."""
    values, none_correct = [], 1.0
    for k in range(1, n + 1):
        none_correct *= max(n - c - k + 1, 0) / (n - k + 1)
        values.append(1.0 - none_correct)
    return values


def correct_counts(
    backend: RolloutBackend,
    task: Task,
    examples: list[Example],
    n: int,
    sampling: SamplingSettings,
) -> list[int]:
    """Sample ``n`` responses per example; count the correct ones of each."""
    _check_examples(examples)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int (samples per prompt), got {n!r}")
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
