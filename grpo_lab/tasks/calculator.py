"""Calculator: multiply two numbers with a tool the model calls mid-response.

Prompt ``"37*58="``; the episode the model learns to write, with the
environment's reply in the middle::

    <calc>37*58</calc><out>2146</out>2146<eos>

The tiny character model cannot multiply two-digit numbers in its head; it can
learn to copy the operands into a call and the tool's reply into its answer.
The reward grades the final answer only: the text after the last
``output_close`` (the whole response when no tool was called), exact match,
minus an optional ``call_cost`` per call. Episodes are sampled by
:class:`grpo_lab.rollouts.multiturn.MultiTurnRolloutBackend`. Taught in
``notebooks/14_tools_and_turns.ipynb``.
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass
from typing import ClassVar

from grpo_lab.rewards import MAX_RESPONSE_CHARS, exact_match_reward
from grpo_lab.rollouts.multiturn import check_max_turns
from grpo_lab.rollouts.tools import CalculatorTool
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


@dataclass(frozen=True)
class CalculatorTask:
    """``a*b=`` with a and b in [min_operand, max_operand], answered with a tool.

    The default range, 32..99, keeps every product at four digits (1024 to
    9801): with 3-digit products mixed in (min_operand=10), a cpu run whose
    warm-up also trained on the tool's replies wrote 4 digits to those too
    ("<out>600</out>16000") and its greedy accuracy stalled near 0.8. (Since
    the warm-up masks the replies, that range has not been measured again.)
    """

    # Operands are drawn from min_operand..max_operand.
    min_operand: int = 32
    max_operand: int = 99
    # Model turns per episode (2: call, then answer).
    max_turns: int = 2
    # Subtracted from the reward for each tool call (0: calls are free).
    call_cost: float = 0.0
    # Share of the problem space held out for evaluation.
    eval_fraction: float = 0.1

    name: ClassVar[str] = "calculator"
    stop_strings: ClassVar[tuple[str, ...]] = ()
    # Sampled with a multi-turn rollout around ``tool``.
    uses_tools: ClassVar[bool] = True

    def __post_init__(self) -> None:
        check_int_option("min_operand", self.min_operand, 0, 9999)
        check_int_option("max_operand", self.max_operand, 1, 9999)
        if self.max_operand <= self.min_operand:
            raise ValueError(
                f"max_operand must exceed min_operand ({self.min_operand}), "
                f"got {self.max_operand!r}"
            )
        check_max_turns(self.max_turns)
        if (
            isinstance(self.call_cost, bool)
            or not isinstance(self.call_cost, (int, float))
            or not math.isfinite(self.call_cost)
            or not 0 <= self.call_cost <= 1
        ):
            raise ValueError(f"call_cost must be in [0, 1], got {self.call_cost!r}")
        check_eval_fraction(self.eval_fraction)

    @property
    def tool(self) -> CalculatorTool:
        """The calculator the episodes call."""
        return CalculatorTool()

    @property
    def max_new_tokens(self) -> int:
        """Budget of a whole episode: the call, the reply, the answer, slack."""
        tool = self.tool
        product = len(str(self.max_operand**2))
        reply = len(tool.output_open) + product + len(tool.output_close)
        return self._call_length() + reply + product + ANSWER_SLACK_TOKENS

    @property
    def max_turn_tokens(self) -> int:
        """Longest model turn: the longest call plus slack (the answer is shorter).

        A turn that rambles on without a call is cut here, so one such episode
        does not keep the whole batch sampling up to the episode's budget.
        """
        return self._call_length() + ANSWER_SLACK_TOKENS

    def _call_length(self) -> int:
        tool, operand = self.tool, len(str(self.max_operand))
        return len(tool.call_open) + 2 * operand + 1 + len(tool.call_close)

    def example(self, a: int, b: int) -> Example:
        """``f"{a}*{b}="`` -> ``str(a * b)``, with the tool-using demonstration."""
        tool, answer = self.tool, str(a * b)
        demonstration = (
            f"{tool.call_open}{a}*{b}{tool.call_close}"
            f"{tool.output_open}{answer}{tool.output_close}{answer}"
        )
        return Example(
            prompt=f"{a}*{b}=", ground_truth=answer, demonstration=demonstration
        )

    def draw_example(self, rng: random.Random) -> Example:
        """One example with uniformly random operands."""
        low, high = self.min_operand, self.max_operand
        return self.example(rng.randint(low, high), rng.randint(low, high))

    def all_examples(self) -> list[Example]:
        """Every problem, ordered by (a, b)."""
        values = range(self.min_operand, self.max_operand + 1)
        return [self.example(a, b) for a in values for b in values]

    def train(self, n: int, seed: int) -> list[Example]:
        """``n`` i.i.d. train examples."""
        return sample_train_examples(self.draw_example, self.eval_fraction, n, seed)

    def eval(self, n: int, seed: int) -> list[Example]:
        """``n`` distinct eval examples."""
        return sample_distinct_examples(_eval_pool(self), n, seed, "eval")

    def reward_fn(self, response: str, ground_truth: str) -> dict[str, float]:
        """See :func:`calculator_reward`."""
        return calculator_reward(response, ground_truth, self.tool, self.call_cost)


def calculator_reward(
    response: str,
    ground_truth: str,
    tool: CalculatorTool,
    call_cost: float = 0.0,
) -> dict[str, float]:
    """The final answer's exact match, minus ``call_cost`` per tool call.

    final answer = the text after the last ``tool.output_close`` (the whole
                   response when there is none)
    format_reward, answer_reward = :func:`grpo_lab.rewards.exact_match_reward`
                   of the final answer
    reward = answer_reward - call_cost * (number of ``tool.call_close``)

    A response over ``MAX_RESPONSE_CHARS`` scores 0. Time is linear in the
    (capped) length: only ``str.count`` and ``str.rfind``.
    """
    if not isinstance(response, str) or not isinstance(ground_truth, str):
        return {"reward": 0.0, "format_reward": 0.0, "answer_reward": 0.0}
    if len(response) > MAX_RESPONSE_CHARS:
        return {"reward": 0.0, "format_reward": 0.0, "answer_reward": 0.0}
    end = response.rfind(tool.output_close)
    final = response if end < 0 else response[end + len(tool.output_close) :]
    scores = exact_match_reward(final, ground_truth)
    calls = response.count(tool.call_close)
    return {**scores, "reward": scores["answer_reward"] - call_cost * calls}


@functools.lru_cache(maxsize=8)
def _eval_pool(task: CalculatorTask) -> tuple[Example, ...]:
    """Every eval example, in enumeration order (memoized)."""
    return tuple(
        example
        for example in task.all_examples()
        if is_eval_prompt(example.prompt, task.eval_fraction)
    )
