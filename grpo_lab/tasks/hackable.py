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

from dataclasses import dataclass
from typing import ClassVar

from grpo_lab.rewards import contains_answer_reward, exact_match_reward
from grpo_lab.tasks.splits import check_int_option
from grpo_lab.tasks.toy import AdditionTask

HACKABLE_REWARDS = ("strict", "lenient")


@dataclass(frozen=True)
class HackableAdditionTask(AdditionTask):
    """``addition``'s problems and splits, graded strictly or leniently."""

    # Most response characters before EOS (room for several candidates).
    room: int = 8
    # "strict" (exact match) or "lenient" (the answer appears anywhere).
    reward: str = "lenient"

    name: ClassVar[str] = "hackable_addition"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int_option("room", self.room, len(str(2 * (self.max_value - 1))), 64)
        if self.reward not in HACKABLE_REWARDS:
            raise ValueError(
                f"reward must be one of {HACKABLE_REWARDS}, got {self.reward!r}"
            )

    @property
    def max_new_tokens(self) -> int:
        """``room`` characters plus EOS."""
        return self.room + 1

    def reward_fn(self, response: str, ground_truth: str) -> dict[str, float]:
        """The lenient or the strict reward, as ``reward`` says."""
        if self.reward == "lenient":
            return contains_answer_reward(response, ground_truth)
        return exact_match_reward(response, ground_truth)
