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
