"""The GPU memory a run needs, and the profile this machine can run.

Taught in ``notebooks/12_scaling_out.ipynb``.
"""

from __future__ import annotations

import os

import torch

from grpo_lab.lora import (
    ADAPTER_TRAINING_BYTES,
    ALL_LINEAR,
    lora_parameter_count,
    qwen2_linear_shapes,
)
from grpo_lab.training.config.fields import PROFILE_VARIABLE, PROFILES
from grpo_lab.training.config.train_config import TrainConfig

# Parameters of the profiles' hub models, so the memory they need is known before
# anything is downloaded: counted from their published architectures (Qwen2,
# tied embeddings; tests/test_config.py rebuilds both on the meta device).
KNOWN_PARAMETER_COUNTS = {
    "Qwen/Qwen2.5-Math-1.5B": 1_543_714_304,
    "Qwen/Qwen2.5-0.5B-Instruct": 494_032_768,
}
# Their published shapes: hidden, MLP width, layers, attention heads, key/value
# heads, vocabulary (the LoRA count and the activation estimate need them).
KNOWN_ARCHITECTURES = {
    "Qwen/Qwen2.5-Math-1.5B": (1536, 8960, 28, 12, 2, 151936),
    "Qwen/Qwen2.5-0.5B-Instruct": (896, 4864, 24, 14, 2, 151936),
}
# Prompt tokens budgeted per sequence (a GSM8K question in a chat template).
_PROMPT_TOKENS = 256
# Bytes per parameter while training with AdamW: the weight, its gradient and
# two moments, each in the parameter dtype (float32: 4 + 4 + 8 = 16).
_TRAINING_COPIES = 4
# The same copies by name, as ZeRO shards them: stage 1 the moments, stage 2 the
# gradients too, stage 3 (FSDP's full sharding) the weights as well.
SHARDABLE_COPIES = {"weight": 1, "gradient": 1, "moments": 2}
# Activations, the chunked head's scratch and the allocator's slack, as a share
# of the above (with gradient checkpointing; measured runs stay inside it).
_WORKING_MEMORY_SHARE = 0.25


def training_memory_bytes(
    config: TrainConfig,
    parameter_count: int,
    *,
    sharded: tuple[str, ...] = (),
    gpus: int = 1,
) -> float:
    """GPU bytes a run of ``config`` needs for a model of ``parameter_count``.

    Full fine-tuning: params x 4 copies (weight, gradient, two AdamW moments) x
    bytes per parameter x (1 + working share). LoRA (``lora_rank > 0``): the
    frozen weights once, the adapters' 16 bytes each (float32 weight, gradient,
    two moments; :func:`lora_parameter_count_of`), and :func:`activation_bytes`.
    Either is divided by the share of the GPU left to training when a vLLM
    engine takes ``vllm_gpu_memory_utilization`` of it. An estimate to choose
    a profile by, not a guarantee.

    ``sharded`` names the copies (of ``SHARDABLE_COPIES``) that ZeRO divides
    over ``gpus`` data-parallel GPUs; the result is then one GPU's bytes. The
    working share (activations above all) is not sharded: each GPU keeps the
    activations of its own rows, so it stays a quarter of the unsharded copies.
    Sharding applies to full fine-tuning. Taught in
    ``notebooks/12_scaling_out.ipynb``.
    """
    _check_sharding(sharded, gpus)
    bytes_per_weight = torch.finfo(getattr(torch, config.dtype)).bits / 8
    per_parameter = _TRAINING_COPIES * bytes_per_weight
    copies = sum(
        count / gpus if name in sharded else count
        for name, count in SHARDABLE_COPIES.items()
    )
    training = (
        parameter_count
        * per_parameter
        * (copies / _TRAINING_COPIES + _WORKING_MEMORY_SHARE)
    )
    if config.lora_rank > 0:
        training = (
            parameter_count * bytes_per_weight
            + lora_parameter_count_of(config) * ADAPTER_TRAINING_BYTES
            + activation_bytes(config)
        )
    if config.backend == "vllm":
        return training / (1 - config.vllm_gpu_memory_utilization)
    return training


def _check_sharding(sharded: tuple[str, ...], gpus: int) -> None:
    unknown = set(sharded) - set(SHARDABLE_COPIES)
    if isinstance(sharded, str) or unknown:
        raise ValueError(
            f"sharded must be a tuple of names from {tuple(SHARDABLE_COPIES)}, "
            f"got {sharded!r}"
        )
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus must be an integer >= 1, got {gpus!r}")


def lora_parameter_count_of(config: TrainConfig) -> int:
    """Adapter parameters of ``config`` on a known hub model (every linear layer
    but the output head, or the named ones): r x (in + out) per layer, and with
    ``lora_train_norms`` the copies of the 2 L + 1 RMSNorm gains."""
    hidden, mlp, layers, heads, kv_heads, _ = KNOWN_ARCHITECTURES[config.model]
    shapes = qwen2_linear_shapes(hidden, mlp, layers, heads, kv_heads)
    targets = config.lora_settings().target_modules
    if targets != ALL_LINEAR:
        names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj")
        names += ("down_proj",)
        shapes = [s for s, n in zip(shapes, names * layers) if n in targets]
    norms = hidden * (2 * layers + 1) if config.lora_train_norms else 0
    return lora_parameter_count(shapes, config.lora_rank) + norms


def activation_bytes(config: TrainConfig) -> float:
    """Working memory of a gradient-checkpointed LoRA step on a known hub model.

    The sum of: each layer's saved input for one microbatch (rows x tokens x
    hidden, float32); one layer recomputed in backward (its MLP and attention
    tensors, about 4 x MLP width + 10 x hidden per token, and the heads x
    tokens^2 scores); the chunked head's (chunk x vocabulary) scratch, three
    float32 copies; and the hf sampler's key/value cache (rollout_max_batch_size
    rows, float16). Tokens = a 256-token prompt + max_new_tokens.
    """
    hidden, mlp, layers, heads, kv_heads, vocab = KNOWN_ARCHITECTURES[config.model]
    rows = config.train_batch_size // config.gradient_accumulation_steps
    tokens = _PROMPT_TOKENS + (config.max_new_tokens or 0)
    saved_inputs = layers * rows * tokens * hidden * 4
    one_layer = rows * tokens * (4 * mlp + 10 * hidden) * 4
    scores = rows * heads * tokens**2 * 4
    head = 3 * (config.logits_chunk_size or tokens) * vocab * 4
    kv_size = hidden // heads * kv_heads
    cache_rows = config.rollout_max_batch_size or config.rollout_batch_size
    cache = cache_rows * tokens * layers * 2 * kv_size * 2
    return float(saved_inputs + one_layer + scores + head + cache)


def profile_fits(profile: str, gpu_bytes: float) -> bool:
    """True when the profile's model is known and its run fits in ``gpu_bytes``."""
    config = TrainConfig.for_profile(profile)
    count = KNOWN_PARAMETER_COUNTS.get(config.model)
    return count is not None and training_memory_bytes(config, count) <= gpu_bytes


def default_profile() -> str:
    """The profile this machine can run: gpu when its GPU holds the gpu profile's
    run (:func:`training_memory_bytes`), small-gpu on a smaller GPU, else cpu."""
    if not torch.cuda.is_available():
        return "cpu"
    gpu_bytes = torch.cuda.get_device_properties(0).total_memory
    return "gpu" if profile_fits("gpu", gpu_bytes) else "small-gpu"


def chosen_profile() -> str:
    """``$GRPO_LAB_PROFILE`` if set (cpu, gpu or smoke), else :func:`default_profile`.

    The one choice of profile for notebooks and the command line. Asking for
    ``gpu`` on a machine without CUDA is refused here, before any model loads.
    """
    chosen = os.environ.get(PROFILE_VARIABLE)
    if chosen is None:
        return default_profile()
    if chosen not in PROFILES:
        raise ValueError(
            f"{PROFILE_VARIABLE} must be one of {PROFILES}, got {chosen!r}"
        )
    if chosen in ("gpu", "small-gpu") and not torch.cuda.is_available():
        raise ValueError(
            f"{PROFILE_VARIABLE}={chosen} needs a CUDA GPU, and torch sees none "
            "(torch.cuda.is_available() is False); use cpu or smoke"
        )
    return chosen
