"""Shared fixtures: a character tokenizer and tiny random-weight models.

The models are small enough (hidden size 32, one layer) that a training step on
a batch of 8 short sequences takes milliseconds on a CPU.
"""

from __future__ import annotations

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
