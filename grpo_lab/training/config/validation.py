"""Validation, one door: every setting a run cannot work with is refused here.

:func:`validate_config` runs when a ``TrainConfig`` is built. Settings the core
also takes from direct callers are checked by the core's own validators.
"""

from __future__ import annotations

import dataclasses
import math

from grpo_lab.advantages import (
    check_advantage_settings,
)
from grpo_lab.logprobs import check_temperature
from grpo_lab.lora import (
    ADAPTER_OPTIONS,
    check_adapter_fit,
    check_adapter_options_need_rank,
    check_lora_settings,
    qwen2_linear_layers,
    target_names,
)
from grpo_lab.losses import (
    REWEIGHTING_METHODS,
)
from grpo_lab.models import TINY_ATTENTION_HEADS
from grpo_lab.prefix_sharing import check_share_prompt_prefix
from grpo_lab.rollouts import BACKEND_RECORDS
from grpo_lab.rollouts.base import check_sampling_settings
from grpo_lab.rollouts.mismatch import check_mismatch_settings
from grpo_lab.rollouts.vllm import CPU_ATTENTION_HEAD_SIZES
from grpo_lab.sampler_correction import (
    check_sampler_correction,
)
from grpo_lab.tasks import check_task_name_and_options, get_task, uses_tools
from grpo_lab.train_step import (
    check_gradient_accumulation_steps,
    check_max_grad_norm,
)
from grpo_lab.training.config.fields import TrainFields
from grpo_lab.training.dynamic_sampling import check_dynamic_sampling_settings
from grpo_lab.training.overlong import check_overlong_settings
from grpo_lab.training.parsers import check_report_to, parse_device
from grpo_lab.training.staleness import check_async_settings
from grpo_lab.training.teacher import check_teacher


def validate_config(config: TrainFields) -> None:
    """Refuse every setting, and every combination, that ``train`` cannot run.

    Each message names the setting, what it must be, and what it got. Settings
    the core also takes from direct callers are checked by the core's own
    validators, so both doors say the same thing.
    """
    check_share_prompt_prefix(config.share_prompt_prefix)  # 1 == True passes choices
    _check_choices(config)
    _check_counts(config)
    _check_batches(config)
    _check_numbers(config)
    _check_objective(config)
    _check_sampling(config)
    check_mismatch_settings(
        config.mismatch,
        config.mismatch_scale,
        config.mismatch_sync_every,
        backend=config.backend,
    )
    _check_sampler_correction(config)
    _check_device(config)
    _check_lora_and_precision(config)
    check_task_name_and_options(config.task, config.task_options)
    _check_tool_task(config)
    check_report_to(config.report_to)
    _check_dynamic_sampling_and_length(config)
    check_teacher(config)
    _check_asynchronous(config)


def _check_choices(config: TrainFields) -> None:
    for config_field in dataclasses.fields(config):
        choices = config_field.metadata["choices"]
        value = getattr(config, config_field.name)
        if choices and value not in choices:
            raise ValueError(
                f"{config_field.name} must be one of {tuple(choices)}, got {value!r}"
            )
    for name in ("model", "task", "device"):
        if not isinstance(getattr(config, name), str) or not getattr(config, name):
            raise ValueError(
                f"{name} must be a non-empty string, got {getattr(config, name)!r}"
            )
    if not isinstance(config.task_options, dict):
        raise ValueError(
            "task_options must be a dict of keyword options, "
            f"got {config.task_options!r}"
        )


_POSITIVE_COUNTS = (
    "steps",
    "rollout_batch_size",
    "group_size",
    "train_batch_size",
    "epochs_per_rollout_batch",
    "gradient_accumulation_steps",
    "tiny_hidden_size",
    "tiny_num_layers",
    "tiny_intermediate_size",
    "sft_batch_size",
    "sft_eval_every",
    "sft_eval_size",
    "keep_checkpoints",
)
_NONNEGATIVE_COUNTS = (
    "seed",
    "eval_every",
    "eval_size",
    "checkpoint_every",
    "sft_max_steps",
    "lr_warmup_steps",
)
_OPTIONAL_POSITIVE_COUNTS = ("max_new_tokens", "rollout_max_batch_size", "num_threads")
# Counts with a ceiling, and why: a seed seeds numpy, torch and vLLM, whose common
# range is 32 bits; a million steps is far past any published GRPO run (DeepSeek-R1's
# are thousands), so more is a typo, not a plan.
_LARGEST_COUNTS = {
    "seed": (2**32 - 1, "the seed range numpy, torch and vLLM share"),
    "steps": (1_000_000, "a million GRPO steps is already far past any real run"),
    "sft_max_steps": (1_000_000, "a million warm-up steps is far past any real run"),
}


def _check_counts(config: TrainFields) -> None:
    for name in _POSITIVE_COUNTS + _NONNEGATIVE_COUNTS + _OPTIONAL_POSITIVE_COUNTS:
        value = getattr(config, name)
        if value is None and name in _OPTIONAL_POSITIVE_COUNTS:
            continue
        smallest = 0 if name in _NONNEGATIVE_COUNTS else 1
        if not _is_int(value) or value < smallest:
            expected = "an int >= 0" if smallest == 0 else "a positive int"
            if name in _OPTIONAL_POSITIVE_COUNTS:
                expected = "None or a positive int"
            raise ValueError(f"{name} must be {expected}, got {value!r}")
    for name, (largest, reason) in _LARGEST_COUNTS.items():
        if getattr(config, name) > largest:
            raise ValueError(
                f"{name} must be at most {largest} ({reason}), "
                f"got {getattr(config, name)!r}"
            )
    if config.eval_every and config.eval_size < 1:
        raise ValueError(
            f"eval_size must be positive when eval_every > 0 ({config.eval_every}), "
            f"got {config.eval_size!r}"
        )


def _check_batches(config: TrainFields) -> None:
    divides = (
        ("group_size", "rollout_batch_size"),
        ("group_size", "train_batch_size"),
        ("train_batch_size", "rollout_batch_size"),
    )
    for small, large in divides:
        if getattr(config, large) % getattr(config, small):
            raise ValueError(
                f"{small} must divide {large} ({getattr(config, large)}), "
                f"got {getattr(config, small)}"
            )
    check_gradient_accumulation_steps(
        config.gradient_accumulation_steps, config.train_batch_size
    )
    if config.train_batch_size % config.gradient_accumulation_steps:
        raise ValueError(
            "gradient_accumulation_steps must divide train_batch_size "
            f"({config.train_batch_size}), got {config.gradient_accumulation_steps}"
        )
    if config.group_size == 1 and config.baseline in ("mean", "leave_one_out"):
        reason = {
            "mean": "a group of one is its own mean, so every advantage would be 0",
            "leave_one_out": "a group of one has no other rewards to average",
        }[config.baseline]
        raise ValueError(
            f"group_size must be at least 2 with baseline {config.baseline!r}: "
            f"{reason}; got 1"
        )
    if config.group_size == 1 and config.advantage_normalizer == "std":
        raise ValueError(
            "group_size must be at least 2 with advantage_normalizer 'std': the "
            "sample std of one reward is undefined; got 1"
        )
    if config.advantage_normalizer == "batch_std" and config.rollout_batch_size < 2:
        raise ValueError(
            "rollout_batch_size must be at least 2 with advantage_normalizer "
            f"'batch_std' (a sample std), got {config.rollout_batch_size}"
        )


def _check_numbers(config: TrainFields) -> None:
    _check_range("lr", config.lr, low=0.0, low_open=True)
    _check_range("sft_lr", config.sft_lr, low=0.0, low_open=True)
    _check_range("weight_decay", config.weight_decay, low=0.0)
    _check_range("adam_beta2", config.adam_beta2, low=0.0, high=1.0, high_open=True)
    _check_range("sft_target_accuracy", config.sft_target_accuracy, low=0.0, high=1.0)
    _check_range(
        "vllm_gpu_memory_utilization",
        config.vllm_gpu_memory_utilization,
        low=0.0,
        high=1.0,
        low_open=True,
    )
    check_max_grad_norm(config.max_grad_norm)
    check_advantage_settings(
        config.baseline,
        config.advantage_normalizer,
        config.advantage_eps,
        reward_aggregation=config.reward_aggregation,
        nan_rewards=config.nan_rewards,
    )


def _check_objective(config: TrainFields) -> None:
    # cliprange_high: by check_objective_settings, through update_settings() below.
    for name in ("cliprange", "normalization_constant"):
        value = getattr(config, name)
        if value is not None and not _is_positive(value):
            raise ValueError(f"{name} must be None or a positive number, got {value!r}")
    config.update_settings()  # the core's own checks of method, clip, loss, scoring
    method = config.importance_reweighting_method
    if config.off_policy and method == "none":
        raise ValueError(
            "importance_reweighting_method must be one of "
            f"{REWEIGHTING_METHODS[1:]} when training is off-policy "
            "(epochs_per_rollout_batch > 1 or train_batch_size < "
            "rollout_batch_size), got 'none'"
        )
    if not config.off_policy and method != "none":
        raise ValueError(
            f"importance_reweighting_method {method!r} needs an off-policy "
            "schedule (epochs_per_rollout_batch > 1 or train_batch_size < "
            "rollout_batch_size): on-policy the ratio pi / pi_old is exactly 1, so "
            "its gradient is the on-policy one; use 'none', or make the schedule "
            "off-policy"
        )


def _check_sampling(config: TrainFields) -> None:
    check_temperature(config.temperature)  # scoring divides by it: > 0
    check_sampling_settings(config.temperature, config.top_p, config.max_new_tokens)
    check_temperature(
        config.sft_eval_temperature, name="sft_eval_temperature", allow_greedy=True
    )


def _check_dynamic_sampling_and_length(config: TrainFields) -> None:
    check_dynamic_sampling_settings(
        config.dynamic_sampling, config.dynamic_sampling_max_rounds, config.baseline
    )
    max_new_tokens = config.max_new_tokens
    if max_new_tokens is None and config.overlong_buffer is not None:
        try:  # the task's own length; a task that cannot be built is refused later
            max_new_tokens = get_task(config.task, **config.task_options).max_new_tokens
        except (ValueError, TypeError, OSError):
            max_new_tokens = None
    check_overlong_settings(
        config.mask_truncated_completions,
        config.overlong_buffer,
        config.overlong_penalty,
        max_new_tokens,
    )


def _check_tool_task(config: TrainFields) -> None:
    """A tool-using task: its options (turn limit included) and its backend.

    Its episodes are sampled by the multi-turn rollout
    (:mod:`grpo_lab.rollouts.multiturn`), which resumes the hf or vllm backend
    from token ids; dynamic sampling would rebuild the rollouts without their
    segments.
    """
    if not uses_tools(config.task):
        return
    get_task(config.task, **config.task_options)  # its options' own ValueErrors
    if not BACKEND_RECORDS[config.backend].multi_turn:
        multi_turn = " or ".join(map(repr, _backends_where("multi_turn")))
        raise ValueError(
            f"backend must be {multi_turn} for the tool-using task {config.task!r} "
            "(multi-turn rollouts resume a backend from token ids), "
            f"got {config.backend!r}"
        )
    if config.dynamic_sampling:
        raise ValueError(
            f"dynamic_sampling must be False for the tool-using task {config.task!r}, "
            "got True"
        )


def _check_sampler_correction(config: TrainFields) -> None:
    check_sampler_correction(
        config.sampler_correction,
        config.sampler_correction_cap,
        config.sampler_correction_low,
        config.sampler_correction_high,
    )
    if (
        config.sampler_correction != "none"
        and not BACKEND_RECORDS[config.backend].sampler_log_probs
    ):
        reporting = _backends_where("sampler_log_probs")
        raise ValueError(
            f"sampler_correction {config.sampler_correction!r} needs the sampler's "
            f"log-probs, but backend {config.backend!r} returns none; use a backend "
            f"in {reporting} or sampler_correction 'none'"
        )


def _check_asynchronous(config: TrainFields) -> None:
    """The async settings, and what the rollout worker cannot run (yet)."""
    check_async_settings(
        config.max_staleness,
        config.async_admission,
        config.weight_sync_every,
        config.async_queue_size,
    )
    if config.max_staleness == 0:
        return
    refused = {
        "device": (config.device != "cpu", "'cpu' (the worker samples on the CPU)"),
        "lora_rank": (config.lora_rank > 0, "0 (the worker loads full weights)"),
        "dynamic_sampling": (config.dynamic_sampling, "False"),
        "task": (uses_tools(config.task), "a single-turn task"),
    }
    for name, (wrong, expected) in refused.items():
        if wrong:
            raise ValueError(
                f"{name} must be {expected} with max_staleness > 0 (the "
                f"asynchronous rollout worker), got {getattr(config, name)!r}"
            )


def _backends_where(fact: str) -> tuple[str, ...]:
    """The rollout backends whose record has ``fact`` set."""
    return tuple(name for name, r in BACKEND_RECORDS.items() if getattr(r, fact))


def _check_device(config: TrainFields) -> None:
    device = parse_device(config.device)
    if config.backend == "vllm" and device.type not in ("cuda", "cpu"):
        raise ValueError(
            "backend 'vllm' needs a CUDA device or the CPU (vLLM's CPU build), "
            f"got device {config.device!r}; use backend 'hf' on this device"
        )
    if config.backend == "vllm" and device.type == "cpu" and config.model == "tiny":
        head_size = config.tiny_hidden_size // TINY_ATTENTION_HEADS[0]
        if head_size not in CPU_ATTENTION_HEAD_SIZES:
            raise ValueError(
                f"model 'tiny' with tiny_hidden_size {config.tiny_hidden_size} has "
                f"attention head size {head_size} (tiny_hidden_size / "
                f"{TINY_ATTENTION_HEADS[0]} heads), which vLLM's CPU attention does "
                f"not support: backend 'vllm' on device 'cpu' needs a head size in "
                f"{CPU_ATTENTION_HEAD_SIZES}, e.g. tiny_hidden_size 128; or use "
                "backend 'hf'"
            )


def _check_lora_and_precision(config: TrainFields) -> None:
    check_lora_settings(
        config.lora_rank,
        config.lora_alpha,
        config.lora_dropout,
        config.lora_target_modules,
        train_norms=config.lora_train_norms,
    )
    _check_range("lora_lr", config.lora_lr, low=0.0, low_open=True)
    defaults = {f.name: f.default for f in dataclasses.fields(TrainFields)}
    check_adapter_options_need_rank(
        config.lora_rank,
        {
            name: getattr(config, name)
            for name in ADAPTER_OPTIONS
            if getattr(config, name) != defaults[name]
        },
    )
    if config.lora_rank > 0 and config.model == "tiny":  # a hub model's at load
        layers = qwen2_linear_layers(
            config.tiny_hidden_size,
            config.tiny_intermediate_size,
            config.tiny_num_layers,
            *TINY_ATTENTION_HEADS,
        )
        targets = target_names(config.lora_target_modules)
        check_adapter_fit(config.lora_rank, targets, layers)
    if config.autocast_dtype == "float16" and config.dtype != "float32":
        raise ValueError(
            "dtype must be 'float32' with autocast_dtype 'float16': the dynamic "
            "loss scale (torch.amp.GradScaler) unscales float32 master weights "
            f"and adapters, got dtype {config.dtype!r}"
        )


def _check_range(
    name: str,
    value: object,
    low: float,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    inside = (
        number
        and math.isfinite(value)
        and (value > low if low_open else value >= low)
        and (value < high if high_open else value <= high)
    )
    if not inside:
        left = "(" if low_open else "["
        right = ")" if high_open or high == math.inf else "]"
        raise ValueError(
            f"{name} must be a finite number in {left}{low}, {high}{right}, "
            f"got {value!r}"
        )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_positive(value: object) -> bool:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return number and math.isfinite(value) and value > 0
