"""Deterministic train/eval splits (a fixed hash of the prompt decides its split),
and the argument checks the tasks share.

A prompt belongs to the eval split when the first 8 bytes of its BLAKE2b digest,
read as a number in [0, 1), fall below ``eval_fraction``. The rule does not depend
on any seed, so no eval prompt ever appears in a train sample, whatever the seeds.
Taught in
``notebooks/03_rewards_and_advantages.ipynb``.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Sequence

from grpo_lab.tasks.base import Example

# Give up on a train sample after this many draws per requested example.
MAX_DRAWS_PER_EXAMPLE = 1_000


def is_eval_prompt(prompt: str, eval_fraction: float) -> bool:
    """True when ``prompt`` belongs to the eval split.

    split(prompt) = eval  if  int(blake2b(prompt)[:8]) / 2**64 < eval_fraction
    """
    digest = hashlib.blake2b(prompt.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < eval_fraction


def check_count_and_seed(n: int, seed: int) -> None:
    """Raise ``ValueError`` unless ``n`` is a non-negative int and ``seed`` an int."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")


def check_int_option(name: str, value: int, low: int, high: int) -> None:
    """Raise ``ValueError`` unless ``low <= value <= high`` and value is an int."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or not low <= value <= high
    ):
        raise ValueError(f"{name} must be an int in [{low}, {high}], got {value!r}")


def check_eval_fraction(eval_fraction: float) -> None:
    """Raise ``ValueError`` unless ``0.01 <= eval_fraction <= 0.5``."""
    if not isinstance(eval_fraction, (int, float)) or not (
        0.01 <= eval_fraction <= 0.5
    ):
        raise ValueError(
            f"eval_fraction must be a number in [0.01, 0.5], got {eval_fraction!r}"
        )


def sample_train_examples(
    draw_example: Callable[[random.Random], Example],
    eval_fraction: float,
    n: int,
    seed: int,
) -> list[Example]:
    """Draw ``n`` train examples i.i.d. (repeats possible), skipping eval prompts."""
    check_count_and_seed(n, seed)
    rng = random.Random(seed)
    examples: list[Example] = []
    for _ in range(MAX_DRAWS_PER_EXAMPLE * max(n, 1)):
        if len(examples) == n:
            return examples
        example = draw_example(rng)
        if not is_eval_prompt(example.prompt, eval_fraction):
            examples.append(example)
    if len(examples) == n:
        return examples
    raise ValueError(f"could not draw n={n} train examples; the train split is empty")


def sample_distinct_examples(
    pool: Sequence[Example], n: int, seed: int, split: str
) -> list[Example]:
    """``n`` distinct examples of ``pool`` in a seed-dependent order."""
    check_count_and_seed(n, seed)
    if n > len(pool):
        raise ValueError(
            f"n must be at most the {split} split size {len(pool)}, got {n}"
        )
    return random.Random(seed).sample(list(pool), n)
