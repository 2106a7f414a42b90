"""A task's prompts in a tokenizer's chat template: one user turn each.

Instruct models are trained on chat turns, not on a bare continuation: the
r1-zero prompt ("A conversation between User and Assistant ... Assistant:
<think>") reads to them as a message to answer. ``ChatPromptTask`` wraps any
task so that each prompt becomes ``apply_chat_template([{"role": "user",
"content": prompt}], add_generation_prompt=True)``; answers, rewards and stop
strings are the task's own. Base models keep the plain prompt.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from grpo_lab.tasks.base import Example, Task

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def chat_prompt(prompt: str, tokenizer: PreTrainedTokenizerBase) -> str:
    """``prompt`` as one user turn of the tokenizer's chat template, ready for the
    assistant's answer."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "chat_template is on, but the tokenizer has no chat template; "
            "turn chat_template off for a base model, or use an instruct model"
        )
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}],
        tokenize=False,
        add_generation_prompt=True,
    )


@dataclass(frozen=True)
class ChatPromptTask:
    """``task`` with every prompt (and demonstration's prompt) in chat form."""

    task: Task
    tokenizer: PreTrainedTokenizerBase

    def __post_init__(self) -> None:
        chat_prompt("", self.tokenizer)  # refuse a tokenizer without a template now

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
        return self.task.reward_fn(response, ground_truth)

    def _chat(self, example: Example) -> Example:
        prompt = chat_prompt(example.prompt, self.tokenizer)
        return dataclasses.replace(example, prompt=prompt)
