"""Addition with a choice of reward: the honest one, or one a policy can game.

``hackable_addition``: ``"23+19="`` -> ``"42"``, as the ``addition`` task, but
with room for ``room`` answer characters and a ``reward`` option:

- ``"strict"``: exact match (``grpo_lab.rewards.exact_match_reward``);
- ``"lenient"``: the answer appears anywhere in the response
  (``grpo_lab.rewards.contains_answer_reward``). A response that lists several
  candidates ("414243") scores whenever one of them is the sum, so GRPO learns
  to write longer digit strings: the reward climbs while exact-match accuracy
  does not. Taught in ``notebooks/08_training_loop.ipynb`` (reward hacking).

The demonstrations of the warm-up are the bare sums in both cases, so the two
runs differ in their reward alone.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import ClassVar

from grpo_lab.rewards import contains_answer_reward, exact_match_reward
from grpo_lab.tasks.base import Example
from grpo_lab.tasks.splits import (
    check_eval_fraction,
    check_int_option,
    is_eval_prompt,
    sample_distinct_examples,
    sample_train_examples,
)

HACKABLE_REWARDS = ("strict", "lenient")


@dataclass(frozen=True)
class HackableAdditionTask:
    """Add two numbers in ``[0, max_value)``, graded strictly or leniently."""

    # Operands are drawn from range(max_value).
    max_value: int = 50
    # Most response characters before EOS (room for several candidates).
    room: int = 8
    # "strict" (exact match) or "lenient" (the answer appears anywhere).
    reward: str = "lenient"
    # Share of the problem space held out for evaluation.
    eval_fraction: float = 0.1

    name: ClassVar[str] = "hackable_addition"
    stop_strings: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        check_int_option("max_value", self.max_value, 10, 1000)
        check_int_option("room", self.room, len(str(2 * (self.max_value - 1))), 64)
        if self.reward not in HACKABLE_REWARDS:
            raise ValueError(
                f"reward must be one of {HACKABLE_REWARDS}, got {self.reward!r}"
            )
        check_eval_fraction(self.eval_fraction)

    @property
    def max_new_tokens(self) -> int:
        """``room`` characters plus EOS."""
        return self.room + 1

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

    def train(self, n: int, seed: int) -> list[Example]:
        """``n`` i.i.d. train examples."""
        return sample_train_examples(self.draw_example, self.eval_fraction, n, seed)

    def eval(self, n: int, seed: int) -> list[Example]:
        """``n`` distinct eval examples."""
        return sample_distinct_examples(_eval_pool(self), n, seed, "eval")

    def reward_fn(self, response: str, ground_truth: str) -> dict[str, float]:
        """The lenient or the strict reward, as ``reward`` says."""
        if self.reward == "lenient":
            return contains_answer_reward(response, ground_truth)
        return exact_match_reward(response, ground_truth)


@functools.lru_cache(maxsize=8)
def _eval_pool(task: HackableAdditionTask) -> tuple[Example, ...]:
    """Every eval example, in enumeration order (memoized)."""
    return tuple(
        example
        for example in task.all_examples()
        if is_eval_prompt(example.prompt, task.eval_fraction)
    )
