"""What a task is: prompts with verifiable answers, and the reward that checks them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Example:
    """One prompt, its ground-truth answer, and optionally a correct response."""

    prompt: str
    ground_truth: str
    # A correct response text, used by the SFT warm-up when the task can write one.
    demonstration: str | None = None


class Task(Protocol):
    """A source of prompts with a reward function that grades responses."""

    name: str
    # Sampling stops after any of these strings (empty: stop at EOS only).
    stop_strings: tuple[str, ...]
    # Room for a correct response, EOS included.
    max_new_tokens: int

    def train(self, n: int, seed: int) -> list[Example]: ...

    def eval(self, n: int, seed: int) -> list[Example]: ...

    def reward_fn(self, response: str, ground_truth: str) -> dict[str, float]: ...
