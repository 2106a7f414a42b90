"""Shared fixtures: a character tokenizer and tiny random-weight models.

The models are small enough (hidden size 32, one layer) that a training step on
a batch of 8 short sequences takes milliseconds on a CPU.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

import pytest
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from grpo_lab.models import build_char_tokenizer, build_tiny_qwen2
from grpo_lab.rollouts.base import Rollouts

TINY_SIZES = {
    "hidden_size": 32,
    "num_layers": 1,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 64,
}


@pytest.fixture(scope="session")
def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character; ``<pad>`` is 0 and ``<eos>`` is 1."""
    return build_char_tokenizer()


@pytest.fixture
def make_tiny_qwen2(
    char_tokenizer: PreTrainedTokenizerFast,
) -> Callable[..., PreTrainedModel]:
    """A factory of fresh tiny Qwen2 models: ``make_tiny_qwen2(seed=0)``."""

    def make(seed: int = 0) -> PreTrainedModel:
        return build_tiny_qwen2(char_tokenizer, seed=seed, **TINY_SIZES)

    return make


@pytest.fixture
def tiny_qwen2(make_tiny_qwen2: Callable[..., PreTrainedModel]) -> PreTrainedModel:
    """A fresh tiny Qwen2 (hidden size 32) for tests that change its weights."""
    return make_tiny_qwen2(seed=0)


# The update's per-token settings: each one's check, by the module that calls it.
PER_TOKEN_CHECKS = (
    ("grpo_lab.kl", "check_kl_estimator"),
    ("grpo_lab.losses", "check_entropy_settings"),
    ("grpo_lab.sampler_correction", "check_sampler_correction"),
    ("grpo_lab.prefix_sharing", "check_share_prompt_prefix"),
)


@pytest.fixture
def count_checks(monkeypatch: pytest.MonkeyPatch) -> Callable[..., dict[str, int]]:
    """``count_checks(*extra)``: each of PER_TOKEN_CHECKS and of ``extra``
    ((module, name) pairs) still checks, and the returned dict counts its calls
    by name from then on, under every grpo_lab module that imported it."""

    def count(*extra: tuple[str, str]) -> dict[str, int]:
        checks = (*PER_TOKEN_CHECKS, *extra)
        counts = dict.fromkeys((name for _, name in checks), 0)
        for module_name, name in checks:
            check = getattr(importlib.import_module(module_name), name)

            def counted(*args, _check=check, _name=name, **kwargs):
                counts[_name] += 1
                return _check(*args, **kwargs)

            for loaded, module in list(sys.modules.items()):
                if loaded.startswith("grpo_lab") and vars(module).get(name) is check:
                    monkeypatch.setattr(module, name, counted)
        return counts

    return count


class EvenFirstDigit:
    """A stand-in task: reward 1 when the response starts with an even digit
    (a random model earns it about half the time, so groups disagree).

    ``prompts_of``: a task whose prompts, name and lengths it takes (only the
    reward is its own); without one it has no prompts of its own, named "even".
    """

    def __init__(self, max_new_tokens: int = 5, *, prompts_of: object = None):
        self.prompts_of = prompts_of
        if prompts_of is None:
            self.name, self.stop_strings = "even", ()
            self.max_new_tokens = max_new_tokens

    def reward_fn(self, response: str, ground_truth: str) -> dict[str, float]:
        value = float(response[:1] in set("02468"))
        return {"reward": value, "format_reward": value, "answer_reward": value}

    def __getattr__(self, name: str) -> object:
        prompts_of = self.__dict__.get("prompts_of")
        if prompts_of is None:
            raise AttributeError(name)
        return getattr(prompts_of, name)


@pytest.fixture
def even_digit_task() -> type[EvenFirstDigit]:
    """The class of the stand-in task: ``even_digit_task()``, or
    ``even_digit_task(3)`` for 3 new tokens, or ``prompts_of=task``."""
    return EvenFirstDigit


class AlternatingBackend:
    """A stand-in rollout backend: sample j of every group is the reversal of
    its prompt (the reverse task's answer) when j is even, else ``wrong``;
    ``sampling`` holds the settings of the last call."""

    def __init__(self, wrong: str = "x") -> None:
        self.wrong = wrong
        self.sampling = None

    def generate(self, prompts, group_size, sampling):
        self.sampling = sampling
        responses = [
            prompt[:-1][::-1] if j % 2 == 0 else self.wrong
            for prompt in prompts
            for j in range(group_size)
        ]
        return Rollouts(
            prompts=[p for p in prompts for _ in range(group_size)],
            responses=responses,
        )

    def sync(self, policy):
        pass


@pytest.fixture
def alternating_backend() -> type[AlternatingBackend]:
    """The class of the stand-in backend: ``alternating_backend(wrong="9|9")``."""
    return AlternatingBackend
