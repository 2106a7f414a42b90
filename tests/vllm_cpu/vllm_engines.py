"""Tiny local Qwen2 models in a folder vLLM loads, and the backend on them."""

from __future__ import annotations

from pathlib import Path

import torch

from grpo_lab.models import build_tiny_qwen2
from grpo_lab.rollouts.vllm import VLLMRolloutBackend

# Head size 128 / 4 = 32, the smallest vLLM's CPU attention supports.
HIDDEN_SIZE = 128
KV_CACHE_BYTES = 1 << 28


def tiny_policy(tokenizer, *, tied: bool = True, seed: int = 0):
    """A float32 tiny Qwen2 in train mode (every grpo_lab tiny model is tied)."""
    model = build_tiny_qwen2(
        tokenizer,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=256,
        seed=seed,
        tie_word_embeddings=tied,
    )
    return model.to(torch.float32).train()


def backend_for(policy, tokenizer, folder: Path, **options) -> VLLMRolloutBackend:
    """Save ``policy`` and ``tokenizer`` to ``folder``; vLLM on CPU, float32."""
    policy.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return VLLMRolloutBackend(
        str(folder),
        dtype="float32",
        # several engines share one GPU when benchmarks/gpu.sh runs these on CUDA
        gpu_memory_utilization=0.1,
        enforce_eager=True,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        tokenizer=tokenizer,
        **options,
    )
