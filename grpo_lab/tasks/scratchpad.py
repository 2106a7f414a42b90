"""A task whose responses may legitimately differ in length: reversal with a
scratchpad.

``scratchpad``: ``"12345>"`` -> ``"1234512:54321"``. Before the answer the model
may restate the input, digit by digit and starting over at its end, for 0 to
``max_restated`` digits (``""``, ``"1"``, ..., ``"1234512345"``), then writes
``":"`` and the reversed digits. Only the text after the ``":"`` is graded
(``grpo_lab.rewards.scratchpad_reward``), so every restated length is equally
right (with ``grade_scratchpad`` the restatement must be right too, so a longer
response has more room to be wrong), and a correct response is ``n_digits + 1`` to
``n_digits + 1 + max_restated`` characters long. The supervised warm-up's
demonstrations draw the restated length uniformly, so the model starts with
every length in reach; what GRPO then does to the length is up to the loss
(``benchmarks/length_bias.py`` compares the ``loss_normalization`` choices on
it). Train and eval prompts are split by a
fixed hash, as for the other toy tasks.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import ClassVar

from grpo_lab.rewards import (
    SCRATCHPAD_SEPARATOR,
    graded_scratchpad_reward,
    scratchpad_reward,
)
from grpo_lab.tasks.base import Example
from grpo_lab.tasks.splits import (
    check_eval_fraction,
    check_int_option,
    is_eval_prompt,
    sample_distinct_examples,
    sample_train_examples,
)

# Room after the longest correct response: the EOS token plus one spare token.
SCRATCHPAD_SLACK_TOKENS = 2


@dataclass(frozen=True)
class ScratchpadReverseTask:
    """Reverse ``n_digits`` digits after an optional restatement of the input."""

    # Digits per prompt; the problem space holds 10**n_digits prompts.
    n_digits: int = 5
    # Longest restatement in the demonstrations (digits before the ":").
    max_restated: int = 10
    # Share of the problem space held out for evaluation.
    eval_fraction: float = 0.1
    # Grade the restatement too (rewards.graded_scratchpad_reward): then a longer
    # response has more room to be wrong.
    grade_scratchpad: bool = False

    name: ClassVar[str] = "scratchpad"
    stop_strings: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        check_int_option("n_digits", self.n_digits, 3, 6)
        check_int_option("max_restated", self.max_restated, 0, 30)
        check_eval_fraction(self.eval_fraction)
        if not isinstance(self.grade_scratchpad, bool):
            raise ValueError(
                f"grade_scratchpad must be True or False, got {self.grade_scratchpad!r}"
            )

    @property
    def max_new_tokens(self) -> int:
        """The longest demonstrated response, EOS and one spare token."""
        return self.max_restated + 1 + self.n_digits + SCRATCHPAD_SLACK_TOKENS

    def response(self, digits: str, restated: int) -> str:
        """The correct response restating ``restated`` digits of the input."""
        repeats = restated // len(digits) + 1
        scratch = (digits * repeats)[:restated]
        return f"{scratch}{SCRATCHPAD_SEPARATOR}{digits[::-1]}"

    def example(self, digits: str, restated: int = 0) -> Example:
        """The example ``digits + ">"``; its demonstration restates ``restated``."""
        return Example(
            prompt=f"{digits}>",
            ground_truth=digits[::-1],
            demonstration=self.response(digits, restated),
        )

    def draw_example(self, rng: random.Random) -> Example:
        """Random digits; the demonstration restates a uniform 0..max_restated."""
        digits = f"{rng.randrange(10**self.n_digits):0{self.n_digits}d}"
        return self.example(digits, rng.randrange(self.max_restated + 1))

    def all_examples(self) -> list[Example]:
        """Every problem, in numeric order (demonstrations restate nothing)."""
        width = self.n_digits
        return [self.example(f"{value:0{width}d}") for value in range(10**width)]

    def train(self, n: int, seed: int) -> list[Example]:
        """``n`` i.i.d. train examples."""
        return sample_train_examples(self.draw_example, self.eval_fraction, n, seed)

    def eval(self, n: int, seed: int) -> list[Example]:
        """``n`` distinct eval examples."""
        return sample_distinct_examples(_eval_pool(self), n, seed, "eval")

    def reward_fn(self, response: str, ground_truth: str) -> dict[str, float]:
        """``rewards.graded_scratchpad_reward`` with grade_scratchpad, else
        ``rewards.scratchpad_reward``."""
        if self.grade_scratchpad:
            return graded_scratchpad_reward(response, ground_truth)
        return scratchpad_reward(response, ground_truth)


@functools.lru_cache(maxsize=8)
def _eval_pool(task: ScratchpadReverseTask) -> tuple[Example, ...]:
    """Every eval example, in enumeration order (memoized)."""
    return tuple(
        example
        for example in task.all_examples()
        if is_eval_prompt(example.prompt, task.eval_fraction)
    )
