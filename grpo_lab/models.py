"""Tiny offline tokenizers and causal LMs, and the real-model loading path.

Nothing here downloads: tests, CI and the CPU profile build everything locally.
Taught in ``notebooks/00_welcome_and_setup.ipynb``.
"""

from __future__ import annotations

import string

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Olmo2Config,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
DEFAULT_CHARACTERS = string.digits + string.ascii_letters + string.punctuation + " \n"


def build_char_tokenizer(
    characters: str = DEFAULT_CHARACTERS,
) -> PreTrainedTokenizerFast:
    """One token per character, plus ``<pad>`` (id 0) and ``<eos>`` (id 1)."""
    unique = list(dict.fromkeys(characters))
    if not unique:
        raise ValueError("characters must contain at least one character, got ''")
    vocab = {PAD_TOKEN: 0, EOS_TOKEN: 1}
    vocab.update({char: index + 2 for index, char in enumerate(unique)})
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        padding_side="left",
    )


def build_tiny_qwen2(
    tokenizer: PreTrainedTokenizerBase,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    max_position_embeddings: int = 256,
    seed: int = 0,
    tie_word_embeddings: bool = True,
) -> PreTrainedModel:
    """A Qwen2-shaped causal LM with random weights, identical for a given seed."""
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    return _seeded_model(config, seed)


def build_tiny_olmo2(
    tokenizer: PreTrainedTokenizerBase,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int = 256,
    max_position_embeddings: int = 256,
    seed: int = 0,
) -> PreTrainedModel:
    """An OLMo2-shaped causal LM with random weights, identical for a given seed."""
    config = Olmo2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    return _seeded_model(config, seed)


def _seeded_model(config, seed: int) -> PreTrainedModel:
    # Fork only the CPU generator: weights are created on the CPU.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config).eval()


def load_pretrained(
    name_or_path: str, dtype: torch.dtype | str = "auto", **kwargs
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The real-model path: ``AutoModelForCausalLM.from_pretrained`` unchanged."""
    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype, **kwargs)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer
