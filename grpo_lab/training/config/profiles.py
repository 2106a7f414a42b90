"""What each profile changes from the dataclass defaults (the cpu profile)."""

from __future__ import annotations

import importlib.util
from typing import Any

# The cpu profile is the dataclass defaults: a 0.5 M-parameter character model
# learns to reverse 5 digits on a laptop CPU, SFT until a quarter of sampled
# answers are right, then 400 GRPO steps. On two cores a run takes about 35 s,
# and held-out sampled accuracy climbs from ~0.3 to 0.94-0.99. lr 1e-3 collapses
# within a few steps (reward -> 0, no signal left).
CPU_CHANGES: dict[str, Any] = {}

# What the cpu profile changes for a task whose run is not reversal's, applied by
# for_profile("cpu", task=...) under the caller's overrides. calculator: each
# episode is two turns of up to 20 tokens around a 15-token tool reply, about
# six times reversal's sampling per response, so half the rollout batch. Its
# warm-up stops on greedy accuracy (0.7, checked every 5 steps: about 85 steps),
# which leaves sampled held-out accuracy near 0.1 for GRPO to raise; on two
# cores the run takes about 4 minutes and ends near 0.9 (0.8 by step ~80).
CPU_TASK_CHANGES: dict[str, dict[str, Any]] = {
    "calculator": {
        "steps": 200,
        "rollout_batch_size": 128,
        "train_batch_size": 128,
        "lr": 5e-4,
        "eval_size": 100,
        "checkpoint_every": 50,
        "sft_eval_every": 5,
        "sft_eval_temperature": 0.0,
        "sft_target_accuracy": 0.7,
    },
}

# Qwen2.5-Math-1.5B on GSM8K (r1-zero prompt, stop at </answer>) on one GPU:
# 32 prompts x 8 responses per rollout batch, two optimizer steps per batch
# (off-policy, so the ratio is clipped), float32 master weights with bfloat16
# compute, a chunked output head, vLLM rollouts.
GPU_CHANGES: dict[str, Any] = {
    "model": "Qwen/Qwen2.5-Math-1.5B",
    "task": "gsm8k",
    "task_options": {},
    "steps": 200,
    "train_batch_size": 128,
    "gradient_accumulation_steps": 64,
    "lr": 1e-6,
    "adam_beta2": 0.95,
    "importance_reweighting_method": "grpo",
    "cliprange": 0.2,
    "max_new_tokens": 1024,
    "eval_size": 512,
    "checkpoint_every": 50,
    "sft_max_steps": 0,
    "backend": "vllm",
    "device": "cuda",
    "autocast_dtype": "bfloat16",
    "gradient_checkpointing": True,
    "logits_chunk_size": 256,
}

# The cpu run at its smallest: 2 steps of 4 prompts x 4 responses on a 16-wide
# model after 2 warm-up steps, evaluating every step on 8 prompts. Every line of
# the loop runs; nothing is expected to learn.
SMOKE_CHANGES: dict[str, Any] = {
    "steps": 2,
    "rollout_batch_size": 16,
    "group_size": 4,
    "train_batch_size": 16,
    "tiny_hidden_size": 16,
    "tiny_intermediate_size": 64,
    "eval_every": 1,
    "eval_size": 8,
    "checkpoint_every": 0,
    "sft_max_steps": 2,
    "sft_batch_size": 8,
    "sft_eval_every": 1,
    "sft_eval_size": 8,
}

# A 0.5B instruct model on GSM8K on one 16 GB GPU without bfloat16 (a T4) or
# an L4: rank-1 LoRA on every linear layer at lr 5e-5 (TRL's "LoRA Without
# Regret" GRPO recipe, which trains no norm gains), so only the adapters carry
# gradients and AdamW moments; float16 autocast with a dynamic loss scale over
# float32 weights; its chat template, gradient checkpointing and a chunked head;
# 8 prompts x 8 responses, two optimizer steps per rollout batch. It samples with
# vLLM where vLLM is installed (SMALL_GPU_VLLM_CHANGES), else with hf on the
# policy itself. Its memory is estimated by training_memory_bytes (about 3 GiB
# with hf); its speed on a T4 has not been measured.
SMALL_GPU_CHANGES: dict[str, Any] = {
    **{k: v for k, v in GPU_CHANGES.items() if k not in ("backend", "autocast_dtype")},
    "model": "Qwen/Qwen2.5-0.5B-Instruct",
    "chat_template": True,
    "rollout_batch_size": 64,
    "train_batch_size": 32,
    "gradient_accumulation_steps": 16,
    "max_new_tokens": 384,
    "eval_size": 128,
    "rollout_max_batch_size": 64,
    "lora_rank": 1,
    "lora_lr": 5e-5,
    "lora_train_norms": False,
    "autocast_dtype": "float16",
}

# small-gpu where vLLM is installed: vLLM samples in the training process
# (colocated) in float16 (autocast_dtype: a T4 has no bfloat16), taking the share
# of a 15 GiB T4 that the hf run's estimate (training_memory_bytes, 3.03 GiB)
# leaves, rounded down to 0.05: 1 - 3.03 / 15 = 0.798 -> 0.75
# (tests/test_config.py recomputes it). vLLM batches its own generation.
SMALL_GPU_VLLM_CHANGES: dict[str, Any] = {
    "backend": "vllm",
    "vllm_gpu_memory_utilization": 0.75,
    "rollout_max_batch_size": None,
}


def vllm_installed() -> bool:
    """Whether ``import vllm`` would find the package (without importing it)."""
    return importlib.util.find_spec("vllm") is not None


PROFILE_CHANGES = {
    "cpu": CPU_CHANGES,
    "gpu": GPU_CHANGES,
    "small-gpu": SMALL_GPU_CHANGES,
    "smoke": SMOKE_CHANGES,
}


def profile_changes(profile: str) -> dict[str, Any]:
    """What ``profile`` changes from the defaults on this machine: small-gpu
    samples with vLLM where it is installed."""
    if profile == "small-gpu" and vllm_installed():
        return {**SMALL_GPU_CHANGES, **SMALL_GPU_VLLM_CHANGES}
    return PROFILE_CHANGES[profile]


def sampler_note(profile: str, backend: str) -> str | None:
    """The line that says which sampler small-gpu runs with here, and why."""
    if profile != "small-gpu":
        return None
    if backend == "vllm":
        return "small-gpu samples with vllm (installed): float16, colocated"
    if vllm_installed():
        return "small-gpu samples with hf (as asked; vLLM is installed)"
    return (
        "small-gpu samples with hf: vLLM is not installed "
        "(pip install 'grpo-lab[vllm]' to sample with it)"
    )
