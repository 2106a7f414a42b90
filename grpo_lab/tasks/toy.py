"""Toy tasks a 2-layer character model learns on CPU: reverse digits, add numbers.

``reverse``: ``"12345>"`` -> ``"54321"``.  ``addition``: ``"23+19="`` -> ``"42"``.
Responses are the bare answer; the model then emits ``<eos>`` (no stop strings).
Prompts are split into train and eval by a fixed hash (``grpo_lab.tasks.splits``):
``train(n, seed)`` draws i.i.d. train prompts (repeats possible), ``eval(n, seed)``
returns ``n`` distinct eval prompts. Taught in
``notebooks/03_rewards_and_advantages.ipynb``.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import ClassVar

from grpo_lab.rewards import exact_match_reward
from grpo_lab.tasks.base import Example
from grpo_lab.tasks.splits import (
    check_eval_fraction,
    check_int_option,
    is_eval_prompt,
    sample_distinct_examples,
    sample_train_examples,
)

# Room after the answer: the EOS token plus one spare token.
ANSWER_SLACK_TOKENS = 2


class _ExactMatchToyTask:
    """What the toy tasks share: hashed splits over an enumerable problem space,
    i.i.d. train draws, distinct eval draws, exact-match reward. Subclasses give
    ``eval_fraction``, ``draw_example(rng)`` and ``all_examples()``."""

    eval_fraction: float

    def draw_example(self, rng: random.Random) -> Example:
        raise NotImplementedError

    def all_examples(self) -> list[Example]:
        raise NotImplementedError

    def eval_examples(self) -> list[Example]:
        """Every eval problem, in enumeration order."""
        return [
            example
            for example in self.all_examples()
            if is_eval_prompt(example.prompt, self.eval_fraction)
        ]

    def train(self, n: int, seed: int) -> list[Example]:
        """``n`` i.i.d. train examples."""
        return sample_train_examples(self.draw_example, self.eval_fraction, n, seed)

    def eval(self, n: int, seed: int) -> list[Example]:
        """``n`` distinct eval examples."""
        return sample_distinct_examples(eval_pool(self), n, seed, "eval")

    def reward_fn(self, response: str, ground_truth: str) -> dict[str, float]:
        """Exact match: see ``grpo_lab.rewards.exact_match_reward``."""
        return exact_match_reward(response, ground_truth)


@dataclass(frozen=True)
class ReverseTask(_ExactMatchToyTask):
    """Reverse a string of ``n_digits`` digits: ``"01234>"`` -> ``"43210"``."""

    # Digits per prompt; the problem space holds 10**n_digits prompts.
    n_digits: int = 5
    # Share of the problem space held out for evaluation.
    eval_fraction: float = 0.1

    name: ClassVar[str] = "reverse"
    stop_strings: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        check_int_option("n_digits", self.n_digits, 3, 6)
        check_eval_fraction(self.eval_fraction)

    @property
    def max_new_tokens(self) -> int:
        """The answer's length plus EOS and one spare token."""
        return self.n_digits + ANSWER_SLACK_TOKENS

    def example(self, digits: str) -> Example:
        """The example whose prompt is ``digits + ">"``."""
        answer = digits[::-1]
        return Example(prompt=f"{digits}>", ground_truth=answer, demonstration=answer)

    def draw_example(self, rng: random.Random) -> Example:
        """One example with uniformly random digits."""
        return self.example(f"{rng.randrange(10**self.n_digits):0{self.n_digits}d}")

    def all_examples(self) -> list[Example]:
        """Every problem, in numeric order."""
        return [self.example(digits) for digits in self._all_digit_strings()]

    def _all_digit_strings(self) -> list[str]:
        width = self.n_digits
        return [f"{value:0{width}d}" for value in range(10**width)]


@dataclass(frozen=True)
class AdditionTask(_ExactMatchToyTask):
    """Add two numbers in ``[0, max_value)``: ``"23+19="`` -> ``"42"``."""

    # Operands are drawn from range(max_value).
    max_value: int = 50
    # Share of the problem space held out for evaluation.
    eval_fraction: float = 0.1

    name: ClassVar[str] = "addition"
    stop_strings: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        check_int_option("max_value", self.max_value, 10, 1000)
        check_eval_fraction(self.eval_fraction)

    @property
    def max_new_tokens(self) -> int:
        """The longest answer's length plus EOS and one spare token."""
        return len(str(2 * (self.max_value - 1))) + ANSWER_SLACK_TOKENS

    def example(self, a: int, b: int) -> Example:
        """The example ``f"{a}+{b}="`` -> ``str(a + b)``."""
        answer = str(a + b)
        return Example(prompt=f"{a}+{b}=", ground_truth=answer, demonstration=answer)

    def draw_example(self, rng: random.Random) -> Example:
        """One example with uniformly random operands."""
        return self.example(
            rng.randrange(self.max_value), rng.randrange(self.max_value)
        )

    def all_examples(self) -> list[Example]:
        """Every problem, ordered by (a, b)."""
        values = range(self.max_value)
        return [self.example(a, b) for a in values for b in values]


@functools.lru_cache(maxsize=8)
def eval_pool(task: ReverseTask | AdditionTask) -> tuple[Example, ...]:
    """Every eval example of a toy task, in enumeration order (memoized)."""
    return tuple(task.eval_examples())
