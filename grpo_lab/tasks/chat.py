"""A task's prompts in a tokenizer's chat template: one user turn each.

Instruct models are trained on chat turns, not on a bare continuation: the
r1-zero prompt ("A conversation between User and Assistant ... Assistant:
<think>") reads to them as a message to answer. ``ChatPromptTask`` wraps any
task so that each prompt becomes ``apply_chat_template([{"role": "user",
"content": prompt}], add_generation_prompt=True)``; answers, rewards and stop
strings are the task's own. Base models keep the plain prompt.

Thinking templates. Some templates open the reasoning block themselves: the
generation prompt of a Qwen3-style template with ``enable_thinking`` (and of
DeepSeek-R1's distilled models) already ends in ``<think>\n``, so the model's
response starts inside its reasoning and never writes the opening tag (as the
r1-zero prompt's "Assistant: <think>" does for a base model). The assistant's
turn is then the template's ``<think>\n`` plus the response, and that is what
``ChatPromptTask.reward_fn`` grades: a format reward that looks for
``<think> ... </think>`` sees the tag the template wrote, instead of scoring
every response 0. A response cut at max_new_tokens inside that block never
closed it (:meth:`ChatPromptTask.reasoning_unclosed`): it holds no answer, and
its format reward is 0 however good its reasoning. The loop logs the share of
such responses each step (``rollout/unclosed_reasoning_fraction``), beside the
share cut at max_new_tokens.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from grpo_lab.tasks.base import Example, Task

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


# The reasoning block's tags, as Qwen3, DeepSeek-R1 and the r1-zero prompt write them.
REASONING_OPEN, REASONING_CLOSE = "<think>", "</think>"


def chat_prompt(
    prompt: str,
    tokenizer: PreTrainedTokenizerBase,
    *,
    enable_thinking: bool | None = None,
) -> str:
    """``prompt`` as one user turn of the tokenizer's chat template, ready for the
    assistant's answer. ``enable_thinking``: the template variable of that name
    (Qwen3's switch), passed only when not None."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "chat_template is on, but the tokenizer has no chat template; "
            "turn chat_template off for a base model, or use an instruct model"
        )
    if enable_thinking is not None and not isinstance(enable_thinking, bool):
        raise ValueError(
            f"enable_thinking must be None, True or False, got {enable_thinking!r}"
        )
    variables = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}],
        tokenize=False,
        add_generation_prompt=True,
        **variables,
    )


def opened_reasoning(generation_prompt: str) -> str:
    """The tail of ``generation_prompt`` that opens a reasoning block it does
    not close (``"<think>\n"``), or "" when it opens none.

    A prompt whose last ``<think>`` is followed by nothing but whitespace
    leaves the response inside the block; one that closes it (Qwen3 with
    thinking off writes ``<think>\n\n</think>\n\n``) does not.
    """
    start = generation_prompt.rfind(REASONING_OPEN)
    if start < 0 or generation_prompt[start + len(REASONING_OPEN) :].strip():
        return ""
    return generation_prompt[start:]


@dataclass(frozen=True)
class ChatPromptTask:
    """``task`` with every prompt (and demonstration's prompt) in chat form."""

    task: Task
    tokenizer: PreTrainedTokenizerBase
    # The template's enable_thinking (None: the template's own default).
    enable_thinking: bool | None = None

    def __post_init__(self) -> None:
        chat_prompt("", self.tokenizer, enable_thinking=self.enable_thinking)

    @functools.cached_property
    def reasoning_prefix(self) -> str:
        """What the template writes of the assistant's turn before the response:
        ``"<think>\n"`` for a template that opens the reasoning block, else ""."""
        empty = chat_prompt("", self.tokenizer, enable_thinking=self.enable_thinking)
        return opened_reasoning(empty)

    def reasoning_unclosed(self, response: str) -> bool:
        """True when the template opened the reasoning block and ``response``
        never closed it (cut at max_new_tokens mid-thought, as a rule)."""
        return bool(self.reasoning_prefix) and REASONING_CLOSE not in response

    @property
    def name(self) -> str:
        return self.task.name

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self.task.stop_strings

    @property
    def max_new_tokens(self) -> int:
        return self.task.max_new_tokens

    def train(self, n: int, seed: int) -> list[Example]:
        return [self._chat(example) for example in self.task.train(n, seed)]

    def eval(self, n: int, seed: int) -> list[Example]:
        return [self._chat(example) for example in self.task.eval(n, seed)]

    def reward_fn(self, response: str, ground_truth: str) -> dict[str, float]:
        """The task's reward of the assistant's whole turn: the template's
        opening of the reasoning block (if any), then ``response``."""
        return self.task.reward_fn(self.reasoning_prefix + response, ground_truth)

    def _chat(self, example: Example) -> Example:
        prompt = chat_prompt(
            example.prompt, self.tokenizer, enable_thinking=self.enable_thinking
        )
        return dataclasses.replace(example, prompt=prompt)


def unclosed_reasoning_metrics(task: object, responses: list[str]) -> dict[str, float]:
    """``rollout/unclosed_reasoning_fraction``: the share of ``responses`` that
    end inside a reasoning block their chat template opened (no answer, format
    reward 0); {} for a task whose prompts open no block."""
    if not isinstance(task, ChatPromptTask) or not task.reasoning_prefix:
        return {}
    unclosed = sum(task.reasoning_unclosed(response) for response in responses)
    return {"rollout/unclosed_reasoning_fraction": unclosed / max(len(responses), 1)}
