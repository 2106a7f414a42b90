"""A grpo_lab run on TRL's ``GRPOTrainer``: the settings, the data, the reward.

Tested against TRL 1.16.0 (:data:`TESTED_TRL_VERSION`). :data:`TRANSLATIONS`
is the one table of which ``TrainConfig`` field becomes which ``GRPOConfig``
argument, and how; :func:`to_trl_config` applies it. A setting TRL has no
equal for is refused with a ``UserError`` that names it, unless
:class:`GrpoLabTrainer` (a ``GRPOTrainer`` subclass) supplies it:

- advantages TRL does not compute: ``baseline`` leave_one_out or none,
  ``advantage_normalizer`` mean (MaxRL), an ``advantage_eps`` other than TRL's
  fixed 1e-4, and ``nan_rewards`` propagate (TRL always ignores None rewards);
- ``loss_normalization`` constant with a divisor other than TRL dr_grpo's
  (global batch rows x max_completion_length);
- the learning-rate warm-up, counted in GRPO steps from lr / lr_warmup_steps.

Every field is in exactly one of :data:`TRANSLATIONS`,
:data:`LAUNCH_SETTINGS` (read by the launch folder's ``train.py``) and
:data:`NOT_TRAINING_SETTINGS` (no effect on the numbers). What changes at scale
(several processes) is in the README's "When you outgrow one GPU".
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from grpo_lab.advantages import compute_group_normalized_rewards
from grpo_lab.errors import UserError
from grpo_lab.integrations.cluster import refusal_counts, split_rows
from grpo_lab.tasks import Task, get_task
from grpo_lab.training.config import TrainConfig, inert_settings
from grpo_lab.training.parsers import parse_report_to

if TYPE_CHECKING:
    from datasets import Dataset

TESTED_TRL_VERSION = "1.16.0"
TRL_ADVANTAGE_EPS = 1e-4  # TRL divides by std + 1e-4, a constant
TRL_EPSILON = 0.2  # GRPOConfig's default epsilon
FIX = "see the README's 'When you outgrow one GPU'"


def _refuse(field: str, value: Any, why: str, fix: str = FIX) -> UserError:
    return UserError(f"{field} {value!r} cannot run on TRL's GRPOTrainer: {why}", fix)


# --- batches and schedule -------------------------------------------------------


def optimizer_steps_per_grpo_step(config: TrainConfig) -> int:
    """Optimizer steps per rollout batch: rollout / train batch x epochs."""
    per_pass = config.rollout_batch_size // config.train_batch_size
    return per_pass * config.epochs_per_rollout_batch


def _steps(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    return {"max_steps": config.steps * optimizer_steps_per_grpo_step(config)}


def _group_size(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    if config.group_size < 2:
        raise _refuse("group_size", config.group_size, "TRL needs at least 2")
    return {"num_generations": config.group_size}


def data_parallel_batch(config: TrainConfig, num_processes: int) -> dict[str, int]:
    """per_device_train_batch_size and gradient_accumulation_steps that keep
    the global train batch: rows x processes x steps = train_batch_size.

    The microbatch (memory per device) is kept and the accumulation shrinks
    when ``num_processes`` divides it; else the microbatch is split; else the
    largest per-device batch up to the microbatch that divides the process's
    share. TRL's own rule then holds (:func:`trl_batch_problem`).
    """
    rows = config.train_batch_size // config.gradient_accumulation_steps
    steps = config.gradient_accumulation_steps
    if steps % num_processes == 0:
        per_device, steps = rows, steps // num_processes
    elif rows % num_processes == 0:
        per_device = rows // num_processes
    else:
        split = split_rows(config.train_batch_size, num_processes, rows)
        if split is None:
            raise _refuse(
                "train_batch_size",
                config.train_batch_size,
                f"its rows do not split over {num_processes} processes; "
                + refusal_counts(lambda n: config.train_batch_size % n == 0),
            )
        per_device, steps = split
    return {
        "per_device_train_batch_size": per_device,
        "gradient_accumulation_steps": steps,
    }


def trl_batch_problem(arguments: dict[str, Any], num_processes: int) -> str | None:
    """What TRL 1.16's ``GRPOConfig`` would refuse in ``arguments`` on
    ``num_processes`` processes (None: nothing), by its own rules: the
    generation batch divides by per_device_train_batch_size x processes and
    by num_generations, and the global eval batch by num_generations."""
    global_batch = arguments["per_device_train_batch_size"] * num_processes
    generations = arguments["num_generations"]
    if arguments["generation_batch_size"] % global_batch:
        return (
            f"generation_batch_size ({arguments['generation_batch_size']}) must be "
            f"divisible by the global batch size ({global_batch})"
        )
    if arguments["generation_batch_size"] % generations:
        return "generation_batch_size must be divisible by num_generations"
    evaluates = arguments.get("eval_strategy", "no") != "no"
    eval_batch = arguments.get("per_device_eval_batch_size", 8) * num_processes
    if evaluates and eval_batch % generations:
        return f"the global eval batch ({eval_batch}) must divide by {generations}"
    return None


def _train_batch(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    name = "per_device_train_batch_size"
    return {name: data_parallel_batch(config, num_processes)[name]}


def _accumulation(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    name = "gradient_accumulation_steps"
    return {name: data_parallel_batch(config, num_processes)[name]}


def _rollout_batch(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    return {"generation_batch_size": config.rollout_batch_size}


def _epochs(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    return {"num_iterations": config.epochs_per_rollout_batch}


# --- optimizer ----------------------------------------------------------------------


def _lr(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    return {"learning_rate": config.lr, "optim": "adamw_torch"}


def _warmup(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    # GrpoLabTrainer.create_scheduler ramps the warm-up in GRPO steps.
    return {"lr_scheduler_type": "constant", "warmup_steps": 0}


def _adam_beta2(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    return {"adam_beta1": 0.9, "adam_beta2": config.adam_beta2, "adam_epsilon": 1e-8}


def _max_grad_norm(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    return {
        "max_grad_norm": 0.0 if config.max_grad_norm is None else config.max_grad_norm
    }


# --- advantages and loss -----------------------------------------------------------

_SCALE_REWARDS = {"std": "group", "batch_std": "batch", "none": "none", "mean": "group"}


def _advantages(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    return {"scale_rewards": _SCALE_REWARDS[config.advantage_normalizer]}


def _objective(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    method = config.importance_reweighting_method
    if method in ("noclip", "gmpo"):
        raise _refuse(
            "importance_reweighting_method", method, "TRL 1.16 has no such loss_type"
        )
    level = "sequence" if method == "gspo" else "token"
    return {"importance_sampling_level": level}


def _cliprange(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    if config.importance_reweighting_method == "cispo":
        low = 1.0 if config.cliprange is None else config.cliprange
        if low < 1.0:
            raise _refuse(
                "cliprange",
                config.cliprange,
                "TRL's cispo has no lower clip; use 1.0 or more (a lower bound "
                "of 0 never binds)",
            )
        return {}
    return {"epsilon": 0.2 if config.cliprange is None else config.cliprange}


def _cliprange_high(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    high = config.cliprange_high
    if config.importance_reweighting_method == "cispo":
        # TRL's cispo epsilon_high is the absolute cap of the ratio.
        high = config.cliprange if high is None else high
        return {"epsilon_high": 1.0 + (1.0 if high is None else high)}
    return {} if high is None else {"epsilon_high": high}


def _ratio_cap(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    return {"delta": config.ratio_cap}


def _sapo_pos(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    return {"sapo_temperature_pos": config.sapo_temperature_pos}


def _sapo_neg(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    return {"sapo_temperature_neg": config.sapo_temperature_neg}


_LOSS_TYPES = {"sequence": "grpo", "token": "dapo", "constant": "dr_grpo"}
_OWN_AGGREGATION = {"cispo": "token", "sapo": "sequence"}


def _loss_type(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    method = config.importance_reweighting_method
    normalization = config.loss_normalization
    if method in _OWN_AGGREGATION:
        if normalization != _OWN_AGGREGATION[method]:
            raise _refuse(
                "loss_normalization",
                normalization,
                f"TRL's {method} always uses {_OWN_AGGREGATION[method]!r}",
            )
        return {"loss_type": method}
    return {"loss_type": _LOSS_TYPES[normalization]}


def _normalization_constant(config: TrainConfig, num_processes: int) -> dict:
    # max_completion_length comes from max_new_tokens; GrpoLabTrainer rescales
    # dr_grpo's divisor to this constant when the two differ.
    return {}


def _kl_coef(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    return {"beta": config.kl_coef}


def _kl_estimator(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    if config.kl_coef > 0 and config.kl_estimator != "k3":
        raise _refuse("kl_estimator", config.kl_estimator, "TRL's KL is always k3")
    return {}


def _kl_weighting(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    return {"use_bias_correction_kl": config.kl_importance_weighting}


def _entropy(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    if config.entropy_coef > 0 and config.loss_normalization != "token":
        raise _refuse(
            "entropy_coef",
            config.entropy_coef,
            "TRL takes the token mean of the entropy whatever the loss type; "
            "grpo_lab aggregates it like the loss, so only loss_normalization "
            "'token' agrees",
        )
    return {"entropy_coef": config.entropy_coef}


def _top_entropy(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    return {"top_entropy_quantile": config.top_entropy_quantile}


# --- sampling -----------------------------------------------------------------------


def _temperature(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    return {"temperature": config.temperature}


def _top_p(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    # grpo_lab samples with top_k 0 and no other filter.
    return {"top_p": config.top_p, "top_k": 0, "min_p": None, "repetition_penalty": 1.0}


def _max_new_tokens(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    task = get_task(config.task, **config.task_options)
    length = config.max_new_tokens or task.max_new_tokens
    return {"max_completion_length": length}


def _backend(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    if config.backend == "hf":
        return {"use_vllm": False}
    if config.backend == "mismatch":
        raise _refuse(
            "backend",
            config.backend,
            "the mismatch backend is a teaching simulator of a sampler that is not "
            "the policy; TRL samples with transformers or vLLM: use hf or vllm",
        )
    # grpo_lab's vllm engine shares the policy's GPU; sampler_correction says
    # whether TRL corrects for the mismatch.
    return {"use_vllm": True, "vllm_mode": "colocate"}


def _mismatch(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    if config.mismatch != "none":
        raise _refuse(
            "mismatch",
            config.mismatch,
            "a simulated sampler perturbation exists only in grpo_lab's mismatch "
            "backend; use none",
        )
    return {}


def _sampler_correction(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    """TRL's vllm_importance_sampling_*: the same four modes, the same bounds.

    TRL computes sampler log-probs only with vLLM, so a correction needs the
    vllm backend. Truncate modes read ``cap`` (TRL's clip_max, no clip_min);
    mask modes keep ratios in [low, high] (clip_min, clip_max; low 0 is TRL's
    None: no lower bound).
    """
    mode = config.sampler_correction
    if mode == "none":
        return {"vllm_importance_sampling_correction": False}
    if config.backend != "vllm":
        raise _refuse(
            "sampler_correction",
            mode,
            "TRL reports the sampler's log-probs only when vLLM samples: use "
            "backend vllm, or sampler_correction none",
        )
    truncate = mode.endswith("truncate")
    low = config.sampler_correction_low
    return {
        "vllm_importance_sampling_correction": True,
        "vllm_importance_sampling_mode": mode,
        "vllm_importance_sampling_clip_max": config.sampler_correction_cap
        if truncate
        else config.sampler_correction_high,
        "vllm_importance_sampling_clip_min": None if truncate or low == 0 else low,
    }


def _dynamic_sampling(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    if config.dynamic_sampling:
        raise _refuse(
            "dynamic_sampling",
            True,
            "GRPOTrainer has no dynamic sampling (it logs frac_reward_zero_std, "
            "the share of groups it would drop); use False",
        )
    return {}


def _mask_truncated(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    """TRL masks every completion whose last id is not EOS (or pad); grpo_lab
    masks those cut at max_new_tokens. They agree unless the task stops at a
    string: a completion ending in "</answer>" is truncated for TRL only."""
    stops = get_task(config.task, **config.task_options).stop_strings
    if config.mask_truncated_completions and stops:
        raise _refuse(
            "mask_truncated_completions",
            True,
            f"TRL counts a completion that stops at {list(stops)} (no EOS) as "
            "truncated and masks it, where grpo_lab keeps it; use False, or "
            "overlong_buffer, for this task",
        )
    return {"mask_truncated_completions": config.mask_truncated_completions}


def _overlong(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    if config.overlong_buffer is not None:
        raise _refuse(
            "overlong_buffer",
            config.overlong_buffer,
            "TRL ships the soft overlong punishment as a reward function "
            "(trl.rewards.get_soft_overlong_punishment), not a GRPOConfig "
            "setting; add it to train.py's reward_funcs by hand, or use None",
        )
    return {}


def _task(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    stops = get_task(config.task, **config.task_options).stop_strings
    if not stops:
        return {}
    if config.backend == "hf":
        raise _refuse(
            "task",
            config.task,
            f"it stops sampling at {list(stops)}, and TRL's transformers "
            "generation cannot stop at a string; use backend vllm",
        )
    # vLLM's SamplingParams: stop there, and keep the stop string, as grpo_lab does.
    return {
        "generation_kwargs": {"stop": list(stops), "include_stop_str_in_output": True}
    }


def _vllm_memory(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    return {"vllm_gpu_memory_utilization": config.vllm_gpu_memory_utilization}


def _rollout_chunk(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    if config.backend == "hf" and config.rollout_max_batch_size is not None:
        raise _refuse(
            "rollout_max_batch_size",
            config.rollout_max_batch_size,
            "TRL generates each process's share of generation_batch_size at once; "
            "use none",
        )
    return {}


# --- evaluation, checkpoints, logging ---------------------------------------------


def _eval_every(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    if config.eval_every == 0:
        return {"eval_strategy": "no"}
    return {
        "eval_strategy": "steps",
        "eval_steps": config.eval_every * optimizer_steps_per_grpo_step(config),
        "per_device_eval_batch_size": config.group_size,
    }


def _checkpoint_every(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    if config.checkpoint_every == 0:
        return {"save_strategy": "no"}
    steps = config.checkpoint_every * optimizer_steps_per_grpo_step(config)
    return {"save_strategy": "steps", "save_steps": steps}


def _report_to(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    names = list(parse_report_to(config.report_to))  # TRL's names are lower case
    return {"report_to": names or "none", "logging_steps": 1}


def _sft(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    if config.sft_max_steps > 0:
        raise _refuse(
            "sft_max_steps",
            config.sft_max_steps,
            "GRPOTrainer has no supervised warm-up; warm up first (TRL's "
            "SFTTrainer, or a grpo-lab run) and set sft_max_steps 0",
        )
    return {}


# --- device and memory --------------------------------------------------------------


def _device(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    # accelerate places each process on its own GPU; an index is not kept.
    return {"use_cpu": torch.device(config.device).type == "cpu"}


def _dtype(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    return {"model_init_kwargs": {"dtype": config.dtype}}


def _autocast(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    # GRPOConfig's own default is bf16=True, so both are always given.
    return {
        "bf16": config.autocast_dtype == "bfloat16",
        "fp16": config.autocast_dtype == "float16",
    }


def _checkpointing(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    return {"gradient_checkpointing": config.gradient_checkpointing}


# --- the table ---------------------------------------------------------------------

Converter = Callable[[TrainConfig, int], dict[str, Any]]


@dataclass(frozen=True)
class Translation:
    """One row: the GRPOConfig arguments a field sets, how, and what differs."""

    trl_names: tuple[str, ...]
    convert: Converter
    note: str


T = Translation
TRANSLATIONS: dict[str, Translation] = {
    "seed": T(("seed",), lambda c, n: {"seed": c.seed}, "prompt order differs"),
    "steps": T(("max_steps",), _steps, "x optimizer steps per rollout batch"),
    "rollout_batch_size": T(("generation_batch_size",), _rollout_batch, "global"),
    "group_size": T(("num_generations",), _group_size, "at least 2 in TRL"),
    "train_batch_size": T(
        ("per_device_train_batch_size",),
        _train_batch,
        "train_batch_size / gradient_accumulation_steps (/ processes if the "
        "steps do not split); refused, naming the process counts that work, "
        "where TRL's batch rules fail",
    ),
    "epochs_per_rollout_batch": T(("num_iterations",), _epochs, "exact"),
    "gradient_accumulation_steps": T(
        ("gradient_accumulation_steps",), _accumulation, "/ processes if they split"
    ),
    "lr": T(("learning_rate", "optim"), _lr, "AdamW (torch)"),
    "lr_warmup_steps": T(
        ("lr_scheduler_type", "warmup_steps"),
        _warmup,
        "constant; a warm-up is GrpoLabTrainer's, in GRPO steps",
    ),
    "weight_decay": T(
        ("weight_decay",),
        lambda c, n: {"weight_decay": c.weight_decay},
        "exact: > 0 decays every parameter, as grpo_lab does, through "
        "GrpoLabTrainer (HF's Trainer skips biases and norm weights)",
    ),
    "adam_beta2": T(
        ("adam_beta1", "adam_beta2", "adam_epsilon"),
        _adam_beta2,
        "beta1 0.9 and eps 1e-8, as grpo_lab's AdamW",
    ),
    "max_grad_norm": T(("max_grad_norm",), _max_grad_norm, "None -> 0 (no clip)"),
    "baseline": T(
        ("scale_rewards",), _advantages, "mean in TRL; others by GrpoLabTrainer"
    ),
    "advantage_normalizer": T(
        ("scale_rewards",),
        _advantages,
        "std -> group, batch_std -> batch, none -> none; mean by GrpoLabTrainer",
    ),
    "advantage_eps": T((), lambda c, n: {}, "1e-4 in TRL; others by GrpoLabTrainer"),
    "nan_rewards": T((), lambda c, n: {}, "ignore in TRL; propagate by GrpoLabTrainer"),
    "importance_reweighting_method": T(
        ("importance_sampling_level",),
        _objective,
        "gspo -> sequence; none, grpo, cispo, sapo -> token; noclip, gmpo refused",
    ),
    "cliprange": T(("epsilon",), _cliprange, "cispo: must be >= 1 (no lower clip)"),
    "cliprange_high": T(
        ("epsilon_high",), _cliprange_high, "cispo: 1 + cliprange_high (a cap)"
    ),
    "ratio_cap": T(("delta",), _ratio_cap, "exact"),
    "sapo_temperature_pos": T(("sapo_temperature_pos",), _sapo_pos, "float32"),
    "sapo_temperature_neg": T(("sapo_temperature_neg",), _sapo_neg, "float32"),
    "loss_normalization": T(
        ("loss_type",),
        _loss_type,
        "sequence -> grpo, token -> dapo (its divisor is the rollout batch's mean "
        "tokens per optimizer step: exact when train_batch_size == "
        "rollout_batch_size), constant -> dr_grpo; cispo, sapo keep their own",
    ),
    "normalization_constant": T(
        (), _normalization_constant, "dr_grpo's rows x length, else GrpoLabTrainer"
    ),
    "kl_coef": T(("beta",), _kl_coef, "reference: the step-0 model"),
    "kl_estimator": T((), _kl_estimator, "k3 only"),
    "kl_importance_weighting": T(
        ("use_bias_correction_kl",), _kl_weighting, "always given (TRL's default: on)"
    ),
    "entropy_coef": T(
        ("entropy_coef",),
        _entropy,
        "loss_normalization token only; exact on one microbatch, differs under "
        "accumulation (TRL: each microbatch's own token mean)",
    ),
    "top_entropy_quantile": T(
        ("top_entropy_quantile",),
        _top_entropy,
        "exact on one process; differs on several (TRL's quantile spans every "
        "process's microbatch)",
    ),
    "temperature": T(("temperature",), _temperature, "exact"),
    "top_p": T(
        ("top_p", "top_k", "min_p", "repetition_penalty"),
        _top_p,
        "and no other filter (top_k 0), as grpo_lab samples",
    ),
    "max_new_tokens": T(
        ("max_completion_length",), _max_new_tokens, "None -> the task's"
    ),
    "backend": T(("use_vllm", "vllm_mode"), _backend, "vllm -> colocate"),
    "task": T(
        ("generation_kwargs",),
        _task,
        "its stop strings -> vLLM's stop (train.py builds the task's data)",
    ),
    "vllm_gpu_memory_utilization": T(
        ("vllm_gpu_memory_utilization",), _vllm_memory, "exact"
    ),
    "rollout_max_batch_size": T((), _rollout_chunk, "none only (hf)"),
    "mismatch": T((), _mismatch, "none only (a CPU simulator)"),
    "mismatch_scale": T((), lambda c, n: {}, "read only by the mismatch backend"),
    "mismatch_sync_every": T((), lambda c, n: {}, "read only by the mismatch backend"),
    "sampler_correction": T(
        (
            "vllm_importance_sampling_correction",
            "vllm_importance_sampling_mode",
            "vllm_importance_sampling_clip_max",
            "vllm_importance_sampling_clip_min",
        ),
        _sampler_correction,
        "the same four modes; needs backend vllm; none -> correction off",
    ),
    "sampler_correction_cap": T((), lambda c, n: {}, "truncate: clip_max"),
    "sampler_correction_low": T((), lambda c, n: {}, "mask: clip_min (0 -> None)"),
    "sampler_correction_high": T((), lambda c, n: {}, "mask: clip_max"),
    "dynamic_sampling": T((), _dynamic_sampling, "False only: TRL has none"),
    "dynamic_sampling_max_rounds": T(
        (), lambda c, n: {}, "read only with dynamic_sampling"
    ),
    "mask_truncated_completions": T(
        ("mask_truncated_completions",),
        _mask_truncated,
        "exact without stop strings; refused with them (TRL masks what ends "
        "without EOS)",
    ),
    "overlong_buffer": T((), _overlong, "None only: a reward function in TRL"),
    "overlong_penalty": T((), lambda c, n: {}, "read only with overlong_buffer"),
    "eval_every": T(
        ("eval_strategy", "eval_steps", "per_device_eval_batch_size"),
        _eval_every,
        "TRL evaluates the sampled reward, not greedy accuracy",
    ),
    "checkpoint_every": T(
        ("save_strategy", "save_steps"), _checkpoint_every, "0 -> final model only"
    ),
    "keep_checkpoints": T(
        ("save_total_limit",),
        lambda c, n: {"save_total_limit": c.keep_checkpoints},
        "exact",
    ),
    "report_to": T(("report_to", "logging_steps"), _report_to, "every step"),
    "sft_max_steps": T((), _sft, "0 only: GRPOTrainer has no warm-up"),
    "device": T(("use_cpu",), _device, "accelerate picks each process's GPU"),
    "dtype": T(("model_init_kwargs",), _dtype, "model_init_kwargs.dtype"),
    "autocast_dtype": T(("bf16", "fp16"), _autocast, "always given"),
    "gradient_checkpointing": T(("gradient_checkpointing",), _checkpointing, "exact"),
}
del T

LAUNCH_SETTINGS: dict[str, str] = {
    "model": "train.py loads it (tiny: built and saved next to train.py)",
    "tiny_hidden_size": "train.py builds the tiny model with it",
    "tiny_num_layers": "train.py builds the tiny model with it",
    "tiny_intermediate_size": "train.py builds the tiny model with it",
    "task_options": "train.py builds the task with them",
    "chat_template": "train.py writes prompts as user messages (TRL applies it)",
    "eval_size": "train.py's eval dataset size",
    "resume": "train.py passes resume_from_checkpoint",
}

NOT_TRAINING_SETTINGS: dict[str, str] = {
    "profile": "which defaults the config started from",
    "run_dir": "grpo_lab's run folder; TRL writes to output_dir",
    "share_prompt_prefix": "speed only: the same numbers without it",
    "logits_chunk_size": "memory only: TRL chunks its own scorer",
    "num_threads": "CPU threads; set OMP_NUM_THREADS at launch",
    "sft_target_accuracy": "read only by the warm-up (sft_max_steps 0)",
    "sft_eval_temperature": "read only by the warm-up (sft_max_steps 0)",
    "sft_batch_size": "read only by the warm-up (sft_max_steps 0)",
    "sft_lr": "read only by the warm-up (sft_max_steps 0)",
    "sft_eval_every": "read only by the warm-up (sft_max_steps 0)",
    "sft_eval_size": "read only by the warm-up (sft_max_steps 0)",
}


def to_trl_config(config: TrainConfig, *, num_processes: int = 1) -> dict[str, Any]:
    """GRPOConfig keyword arguments for ``config`` (without ``output_dir``).

    Applies every row of :data:`TRANSLATIONS`; a setting TRL cannot run raises
    ``UserError`` naming it, unless it has no effect in ``config``
    (:func:`grpo_lab.training.config.inert_settings`). ``num_processes`` is the
    number of data-parallel processes: the global batch sizes stay the
    config's, the per-device one shrinks.
    """
    if not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes must be a positive int, got {num_processes!r}")
    inert = inert_settings(config)
    arguments: dict[str, Any] = {}
    for name, translation in TRANSLATIONS.items():
        if name in inert:
            continue
        arguments.update(translation.convert(config, num_processes))
    arguments.setdefault("epsilon", 0.2)
    problem = trl_batch_problem(arguments, num_processes)
    if problem is not None:
        raise _refuse(
            "rollout_batch_size",
            config.rollout_batch_size,
            f"TRL refuses it on {num_processes} processes ({problem}); "
            + refusal_counts(lambda n: _fits_trl(config, n)),
        )
    return arguments


def _fits_trl(config: TrainConfig, num_processes: int) -> bool:
    """Whether TRL's batch rules hold for ``config`` on ``num_processes``."""
    try:
        batch = data_parallel_batch(config, num_processes)
    except UserError:
        return False
    arguments = {
        **batch,
        "generation_batch_size": config.rollout_batch_size,
        "num_generations": config.group_size,
        **_eval_every(config, num_processes),
    }
    return trl_batch_problem(arguments, num_processes) is None


def grpo_lab_trainer_reasons(
    config: TrainConfig, *, num_processes: int = 1
) -> list[str]:
    """Why ``config`` needs :class:`GrpoLabTrainer` (empty: GRPOTrainer is exact)."""
    reasons = []
    if config.baseline != "mean":
        reasons.append(f"baseline {config.baseline!r}")
    if config.advantage_normalizer == "mean":
        reasons.append("advantage_normalizer 'mean'")
    uses_eps = config.advantage_normalizer != "none"
    if uses_eps and config.advantage_eps != TRL_ADVANTAGE_EPS:
        reasons.append(f"advantage_eps {config.advantage_eps!r}")
    if config.nan_rewards == "propagate":
        reasons.append("nan_rewards 'propagate'")
    if constant_loss_scale(config) != 1.0:
        reasons.append(f"normalization_constant {config.normalization_constant!r}")
    if config.lr_warmup_steps > 0:
        reasons.append(f"lr_warmup_steps {config.lr_warmup_steps}")
    if config.weight_decay > 0:
        reasons.append(f"weight_decay {config.weight_decay!r} on every parameter")
    return reasons


def constant_loss_scale(config: TrainConfig) -> float:
    """dr_grpo's divisor over grpo_lab's constant, global rows x length / C (1:
    the same); 1 for the other normalizations."""
    if config.loss_normalization != "constant":
        return 1.0
    length = _max_new_tokens(config, 1)["max_completion_length"]
    return config.train_batch_size * length / config.normalization_constant


# --- data and reward ----------------------------------------------------------------


def task_dataset(
    task: Task, split: str, size: int, seed: int, *, chat_template: bool = False
) -> Dataset:
    """``size`` examples of ``task``'s ``split`` as a ``datasets.Dataset`` with a
    ``prompt`` column (a string, or one user message with ``chat_template``) and
    a ``ground_truth`` column, which TRL hands the reward function."""
    from datasets import Dataset

    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    examples = task.train(size, seed) if split == "train" else task.eval(size, seed)
    prompts: list[Any] = [e.prompt for e in examples]
    if chat_template:
        prompts = [[{"role": "user", "content": p}] for p in prompts]
    truths = [e.ground_truth for e in examples]
    return Dataset.from_dict({"prompt": prompts, "ground_truth": truths})


def trl_reward_function(task: Task) -> Callable[..., list[float]]:
    """``task.reward_fn`` with TRL's reward_funcs signature: (prompts,
    completions, ground_truth=..., **kwargs) -> one float per completion."""

    def reward(prompts: list, completions: list, **columns: Any) -> list[float]:
        truths = columns["ground_truth"]
        texts = [_completion_text(c) for c in completions]
        return [float(task.reward_fn(t, g)["reward"]) for t, g in zip(texts, truths)]

    reward.__name__ = f"{task.name}_reward"
    return reward


def _completion_text(completion: Any) -> str:
    """A plain completion, or the content of a conversational one."""
    if isinstance(completion, str):
        return completion
    return "".join(message["content"] for message in completion)


# --- what TRL lacks -----------------------------------------------------------------


def _trainer_base() -> type:
    from trl import GRPOTrainer

    return GRPOTrainer


@functools.cache
def make_grpo_lab_trainer_class() -> type:
    """``GrpoLabTrainer``, a subclass of the installed ``trl.GRPOTrainer`` (built
    on first use, so that importing this module does not import trl)."""
    return _grpo_lab_trainer(_trainer_base())


def __getattr__(name: str) -> Any:
    if name == "GrpoLabTrainer":
        return make_grpo_lab_trainer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _grpo_lab_trainer(base: type) -> type:
    class GrpoLabTrainer(base):
        """GRPOTrainer with grpo_lab's advantages, constant divisor, warm-up and
        weight decay on every parameter.

        ``train_config`` is the run's TrainConfig. Advantages are recomputed
        from TRL's gathered rewards by
        :func:`grpo_lab.advantages.compute_group_normalized_rewards`; the
        dr_grpo loss is rescaled to sum / normalization_constant over the
        global train batch; the learning rate is lr * min(1, s / warm-up) in
        GRPO step s = optimizer step // optimizer steps per GRPO step + 1.
        """

        def __init__(self, *args: Any, train_config: TrainConfig, **kwargs: Any):
            self.train_config = train_config
            self._rewards_per_func: torch.Tensor | None = None
            super().__init__(*args, **kwargs)

        def _calculate_rewards(self, inputs, prompts, completions, ids):
            rewards = super()._calculate_rewards(inputs, prompts, completions, ids)
            self._rewards_per_func = rewards  # (B_global, n_funcs), NaN: None
            return rewards

        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            local = output["advantages"]  # (B_local,)
            rewards = self._gathered_rewards()  # (B_global,)
            group = self.num_generations if self.model.training else None
            advantages = grpo_lab_advantages(
                rewards, group or self.num_generations_eval, self.train_config
            )
            start = self.accelerator.process_index * local.shape[0]
            output["advantages"] = advantages[start : start + local.shape[0]].to(
                device=local.device, dtype=local.dtype
            )
            return output

        def _gathered_rewards(self) -> torch.Tensor:
            per_func = self._rewards_per_func  # (B, n_funcs)
            weights = self.reward_weights.to(per_func.device)
            rewards = (per_func * weights.unsqueeze(0)).nansum(dim=1)  # (B,)
            rewards[torch.isnan(per_func).all(dim=1)] = math.nan
            return rewards

        def _compute_loss(self, model, inputs):
            loss = super()._compute_loss(model, inputs)
            if self.train_config.loss_normalization != "constant":
                return loss
            rows = inputs["completion_ids"].shape[0] * self.accelerator.num_processes
            steps = self.current_gradient_accumulation_steps if model.training else 1
            # dr_grpo divided by rows x length x steps; grpo_lab divides by C.
            scale = rows * steps * self.max_completion_length
            return loss * (scale / self.train_config.normalization_constant)

        def get_decay_parameter_names(self, model) -> list[str]:
            # grpo_lab's AdamW decays every parameter; HF's Trainer would skip
            # biases and norm weights.
            return [name for name, _ in model.named_parameters()]

        def create_scheduler(self, num_training_steps, optimizer=None):
            warmup = self.train_config.lr_warmup_steps
            if warmup == 0 or self.lr_scheduler is not None:
                return super().create_scheduler(num_training_steps, optimizer)
            per_step = optimizer_steps_per_grpo_step(self.train_config)
            self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
                self.optimizer if optimizer is None else optimizer,
                lambda step: min(1.0, (step // per_step + 1) / warmup),
            )
            self._created_lr_scheduler = True
            return self.lr_scheduler

    return GrpoLabTrainer


def grpo_lab_advantages(
    rewards: torch.Tensor, group_size: int, config: TrainConfig
) -> torch.Tensor:
    """The run's advantages of TRL's (B,) rewards (NaN: unscorable).

    With ``nan_rewards`` propagate a NaN reward is refused (``RuntimeError``),
    as grpo_lab's step refuses a non-finite loss; TRL would have skipped it.
    """
    if config.nan_rewards == "propagate" and torch.isnan(rewards).any():
        raise RuntimeError(
            "a reward is NaN (unscorable) and nan_rewards is 'propagate'; set "
            "nan_rewards 'ignore' to give it advantage 0"
        )
    advantages, _ = compute_group_normalized_rewards(
        rewards.float(),
        group_size,
        config.baseline,
        config.advantage_eps,
        config.advantage_normalizer,
        nan_rewards=config.nan_rewards,
    )
    return advantages  # (B,)


def trainer_class_for(config: TrainConfig, *, num_processes: int = 1) -> type:
    """``trl.GRPOTrainer`` when it runs ``config`` exactly, else GrpoLabTrainer.

    GrpoLabTrainer takes one more keyword, ``train_config``.
    """
    if grpo_lab_trainer_reasons(config, num_processes=num_processes):
        return make_grpo_lab_trainer_class()
    return _trainer_base()


def translation_table() -> str:
    """:data:`TRANSLATIONS` as a markdown table (field | TRL | how)."""
    rows = ["| grpo_lab field | GRPOConfig | how |", "|---|---|---|"]
    for name, translation in TRANSLATIONS.items():
        trl_names = ", ".join(f"`{n}`" for n in translation.trl_names) or "—"
        rows.append(f"| `{name}` | {trl_names} | {translation.note} |")
    return "\n".join(rows)


# --- one step of TRL on fixed completions ------------------------------------------

# The GRPOConfig arguments that decide the first step's loss and gradients.
TRL_LOSS_ARGUMENTS = (
    "loss_type",
    "importance_sampling_level",
    "epsilon",
    "epsilon_high",
    "delta",
    "sapo_temperature_pos",
    "sapo_temperature_neg",
    "beta",
    "use_bias_correction_kl",
    "entropy_coef",
    "top_entropy_quantile",
    "temperature",
    "scale_rewards",
)


@dataclass
class TrlFirstStep:
    """TRL's first optimizer step on fixed completions.

    ``inputs`` is TRL's batch (advantages, masks, old and reference log-probs,
    in its (B, C) completion layout), ``losses`` its loss of each accumulation
    microbatch (their sum is the step's loss), ``log_prob_gradients`` the
    gradient of that sum by each completion token's log-prob (B, C), and
    ``parameter_gradients`` the model's gradients, zeros where there are none;
    ``trainer`` is the trainer that computed them.
    """

    trainer: Any
    inputs: dict[str, Any]
    losses: list[torch.Tensor]
    log_prob_gradients: torch.Tensor
    parameter_gradients: list[torch.Tensor]

    @property
    def loss(self) -> torch.Tensor:
        """The step's loss: the sum over accumulation microbatches."""
        return torch.stack(self.losses).sum()


def fixed_completions_trainer(
    arguments: dict[str, Any],
    model: Any,
    tokenizer: Any,
    prompts: list[str],
    completion_ids: list[list[int]],
    rewards: list[float | None],
    output_dir: str | Path,
    *,
    trainer_class: type | None = None,
    **trainer_keywords: Any,
) -> Any:
    """A CPU ``GRPOTrainer`` (or ``trainer_class``) whose rollouts are given.

    ``arguments`` are GRPOConfig fields (``gradient_accumulation_steps``
    defaults to 1); ``prompts`` has one entry per completion, grouped, and the
    whole batch is one rollout batch, split into that many microbatches. TRL's
    ``rollout_func`` returns ``completion_ids`` and the reward function
    ``rewards``: nothing is generated, and TRL computes the advantages.
    """
    from datasets import Dataset
    from trl import GRPOConfig

    if len(prompts) != len(completion_ids) or len(rewards) != len(completion_ids):
        raise ValueError(
            "prompts, completion_ids and rewards must have one entry per "
            f"completion, got {len(prompts)}, {len(completion_ids)}, {len(rewards)}"
        )
    prompt_ids = {p: tokenizer.encode(p, add_special_tokens=False) for p in prompts}

    def rollout(batch_prompts: list, trainer: Any) -> dict[str, list]:
        return {
            "prompt_ids": [prompt_ids[_prompt_text(p)] for p in batch_prompts],
            "completion_ids": [list(ids) for ids in completion_ids],
            "logprobs": [[0.0] * len(ids) for ids in completion_ids],
        }

    def reward(prompts: list, completions: list, **kwargs: Any) -> list:
        return list(rewards)

    fields = {"gradient_accumulation_steps": 1, **arguments}
    accumulation = fields["gradient_accumulation_steps"]
    defaults = {
        "per_device_train_batch_size": len(completion_ids) // accumulation,
        "use_cpu": True,
        "report_to": [],
        "save_strategy": "no",
        "bf16": False,  # GRPOConfig's default autocasts to bfloat16, even on CPU
    }
    args = GRPOConfig(output_dir=str(output_dir), **{**defaults, **fields})
    dataset = Dataset.from_dict({"prompt": sorted(set(prompts))})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = (trainer_class or _trainer_base())(
            model=model,
            reward_funcs=reward,
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            rollout_func=rollout,
            **trainer_keywords,
        )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = accumulation
    return trainer


def _prompt_text(prompt: Any) -> str:
    return prompt["prompt"] if isinstance(prompt, dict) else prompt


OffPolicyLogProbs = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def trl_first_step(
    trainer: Any,
    prompts: list[str],
    *,
    old_log_probs: OffPolicyLogProbs | None = None,
    reference_log_probs: OffPolicyLogProbs | None = None,
    beta: float = 0.0,
) -> TrlFirstStep:
    """TRL's advantages and loss for ``trainer``'s fixed completions, backpropagated.

    TRL's scorer is replaced by the naive one, log_softmax(logits / T) of the
    completion tokens, so that a float64 model stays float64 (TRL's fused head
    keeps float32 statistics). ``old_log_probs(current, completion_mask)``
    gives the old policy's (B, C) log-probs from the current ones (None: TRL's
    own, the current ones detached); ``reference_log_probs`` likewise the
    reference model's, read when ``beta`` (TRL's KL coefficient) is not 0.
    """
    from trl.trainer.utils import split_tensor_dict

    captured: list[torch.Tensor] = []
    trainer._get_per_token_logps_and_entropies = _naive_scorer(trainer, captured)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inputs = trainer._generate_and_score_completions(
            [{"prompt": p} for p in prompts]
        )
    mask = inputs["completion_mask"].double()  # (B, C)
    if old_log_probs is not None or reference_log_probs is not None:
        current = _current_log_probs(trainer, inputs)  # (B, C)
        if old_log_probs is not None:
            inputs["old_per_token_logps"] = old_log_probs(current, mask) * mask
        if reference_log_probs is not None:
            inputs["ref_per_token_logps"] = reference_log_probs(current, mask) * mask
    inputs["advantages"] = inputs["advantages"].double()
    trainer.beta = beta  # TRL only loads a reference model by name; given here
    losses = []
    for chunk in split_tensor_dict(inputs, trainer.current_gradient_accumulation_steps):
        loss = trainer._compute_loss(trainer.model, chunk)
        loss.backward()
        losses.append(loss.detach())
    gradients = torch.cat([c.grad for c in captured], dim=0)  # (B, C)
    parameters = [
        torch.zeros_like(p) if p.grad is None else p.grad.clone()
        for p in trainer.model.parameters()
    ]
    return TrlFirstStep(trainer, inputs, losses, gradients, parameters)


def _naive_scorer(trainer: Any, captured: list[torch.Tensor]) -> Callable[..., tuple]:
    """TRL's scorer in the model's dtype; keeps each differentiable result."""

    def score(model, input_ids, attention_mask, logits_to_keep, **kwargs):
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        logits = logits[:, -logits_to_keep - 1 : -1] / trainer.temperature  # (B, C, V)
        log_softmax = torch.log_softmax(logits, dim=-1)  # (B, C, V)
        labels = input_ids[:, -logits_to_keep:]  # (B, C)
        log_probs = log_softmax.gather(-1, labels.unsqueeze(-1)).squeeze(-1)  # (B, C)
        if log_probs.requires_grad:
            log_probs.retain_grad()
            captured.append(log_probs)
        entropy = -(log_softmax.exp() * log_softmax).sum(-1)  # (B, C)
        return log_probs, entropy, None

    return score


def _current_log_probs(trainer: Any, inputs: dict[str, Any]) -> torch.Tensor:
    with torch.no_grad():
        return trainer._get_per_token_logps_and_entropies(
            trainer.model,
            torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1),
            inputs["completion_ids"].shape[1],
        )[0]  # (B, C)


def trl_first_step_loss(
    config: TrainConfig,
    model: Any,
    tokenizer: Any,
    prompts: list[str],
    completion_ids: list[list[int]],
    rewards: list[float | None],
    output_dir: str | Path,
    *,
    old_log_probs: OffPolicyLogProbs | None = None,
    reference_log_probs: OffPolicyLogProbs | None = None,
) -> TrlFirstStep:
    """TRL's first step of ``config``'s loss on fixed completions and rewards.

    The loss settings are ``to_trl_config(config)``'s (:data:`TRL_LOSS_ARGUMENTS`,
    with its group size and completion length), on the trainer class
    :func:`trainer_class_for` picks; the batch is one optimizer step
    (``gradient_accumulation_steps`` microbatches). See :func:`trl_first_step`
    for the rest. It is the TRL side of the parity tests and of notebook 12.
    """
    arguments = to_trl_config(config)
    fields = {k: arguments[k] for k in TRL_LOSS_ARGUMENTS if k in arguments}
    beta = fields.pop("beta")
    for name in ("num_generations", "max_completion_length"):
        fields[name] = arguments[name]
    fields["gradient_accumulation_steps"] = config.gradient_accumulation_steps
    trainer_class = trainer_class_for(config)
    keywords = {} if trainer_class is _trainer_base() else {"train_config": config}
    trainer = fixed_completions_trainer(
        fields,
        model,
        tokenizer,
        prompts,
        completion_ids,
        rewards,
        output_dir,
        trainer_class=trainer_class,
        **keywords,
    )
    return trl_first_step(
        trainer,
        prompts,
        old_log_probs=old_log_probs,
        reference_log_probs=reference_log_probs,
        beta=beta,
    )


def save_frozen_config(config: TrainConfig, out_dir: Path) -> list[Path]:
    """``grpo_config.json`` (the mapped arguments) and ``train_config.json``."""
    mapped = to_trl_config(config)
    grpo_path = out_dir / "grpo_config.json"
    grpo_path.write_text(json.dumps(mapped, indent=2, sort_keys=True) + "\n")
    train_path = out_dir / "train_config.json"
    train_path.write_text(config.to_json() + "\n")
    return [grpo_path, train_path]


# --- the launch folder (grpo_lab.integrations.trl_launch) ---------------------------


def write_launch_folder(config: TrainConfig, out_dir: str | Path, **options: Any):
    """:func:`grpo_lab.integrations.trl_launch.write_launch_folder`."""
    from grpo_lab.integrations.trl_launch import write_launch_folder as write

    return write(config, out_dir, **options)


# --- the table read backwards: TRL's names in a grpo_lab config -------------------


def trl_name_hint(name: str) -> str | None:
    """ "TRL's `learning_rate` is grpo_lab's `lr`" for a GRPOConfig name the
    table translates (None for any other name). Fields whose first TRL name it
    is come first; each with its note."""
    rows = [
        (field, row) for field, row in TRANSLATIONS.items() if name in row.trl_names
    ]
    if not rows:
        return None
    first = [(field, row) for field, row in rows if row.trl_names[0] == name]
    fields = " and ".join(f"`{field}` ({row.note})" for field, row in first or rows)
    if first:
        return f"TRL's `{name}` is grpo_lab's {fields}"
    return f"TRL's `{name}` is set by the translation of grpo_lab's {fields}"


_SAME_VALUE = (
    "seed",
    "gradient_accumulation_steps",
    "weight_decay",
    "adam_beta2",
    "temperature",
    "top_p",
    "sapo_temperature_pos",
    "sapo_temperature_neg",
    "entropy_coef",
    "top_entropy_quantile",
    "mask_truncated_completions",
    "vllm_gpu_memory_utilization",
    "gradient_checkpointing",
)
# TRL name -> (grpo_lab field, how a TRL value becomes the field's value).
FROM_TRL: dict[str, tuple[str, Callable[[Any], Any]]] = {
    **{name: (name, lambda value: value) for name in _SAME_VALUE},
    "learning_rate": ("lr", lambda value: value),
    "num_generations": ("group_size", lambda value: value),
    "generation_batch_size": ("rollout_batch_size", lambda value: value),
    "num_iterations": ("epochs_per_rollout_batch", lambda value: value),
    "max_grad_norm": ("max_grad_norm", lambda value: None if value == 0 else value),
    "epsilon": ("cliprange", lambda value: value),
    "epsilon_high": ("cliprange_high", lambda value: value),
    "delta": ("ratio_cap", lambda value: value),
    "beta": ("kl_coef", lambda value: value),
    "use_bias_correction_kl": ("kl_importance_weighting", lambda value: value),
    "max_completion_length": ("max_new_tokens", lambda value: value),
    "save_total_limit": ("keep_checkpoints", lambda value: value),
    "scale_rewards": (
        "advantage_normalizer",
        lambda value: {"group": "std", "batch": "batch_std", True: "std"}.get(
            value, "none" if value in ("none", False) else value
        ),
    ),
    "use_vllm": ("backend", lambda value: "vllm" if value is True else "hf"),
}
_LOSS_TYPES_BACK = {
    "grpo": {"loss_normalization": "sequence"},
    "dapo": {"loss_normalization": "token"},
    "bnpo": {"loss_normalization": "token"},
    "dr_grpo": {"loss_normalization": "constant"},
    "cispo": {"loss_normalization": "token", "importance_reweighting_method": "cispo"},
    "sapo": {"loss_normalization": "sequence", "importance_reweighting_method": "sapo"},
}


def from_trl_values(values: dict[str, Any]) -> dict[str, Any]:
    """TrainConfig fields for a mapping of TRL ``GRPOConfig`` names (TRL's own
    values), through :data:`TRANSLATIONS` read backwards.

    A TrainConfig field that is no TRL name passes through unchanged (a file may
    name ``profile`` or ``task`` as well). ``max_steps`` becomes ``steps`` once
    the optimizer steps per rollout batch are known, and
    ``per_device_train_batch_size`` x ``gradient_accumulation_steps`` becomes
    ``train_batch_size`` (one process). The result is checked forwards: the
    config it builds must translate back to every TRL value given, or a
    ``UserError`` names the TRL setting that has no grpo_lab counterpart.
    """
    field_names = {f.name for f in dataclasses.fields(TrainConfig)}
    trl_names = {name for row in TRANSLATIONS.values() for name in row.trl_names}
    fields: dict[str, Any] = {}
    for name, value in values.items():
        if name in FROM_TRL:
            field, convert = FROM_TRL[name]
            fields[field] = convert(value)
        elif name == "loss_type" and value in _LOSS_TYPES_BACK:
            fields.update(_LOSS_TYPES_BACK[value])
        elif name == "importance_sampling_level" and value == "sequence":
            fields["importance_reweighting_method"] = "gspo"
        elif name in field_names and name not in trl_names:
            fields[name] = value
        elif name not in trl_names and name not in ("max_steps", "loss_type"):
            raise UserError(
                f"TRL's `{name}` has no grpo_lab counterpart",
                "the TRL names grpo_lab reads are those of the table in the "
                "README's 'When you outgrow one GPU'",
            )
    fields = _batch_and_steps(fields, values)
    _check_translates_back(_built(fields), values)
    return fields


def _built(fields: dict[str, Any]) -> TrainConfig:
    from grpo_lab.training.config import chosen_profile

    fields = dict(fields)
    profile = fields.pop("profile", None) or chosen_profile()
    try:
        return TrainConfig.for_profile(profile, **fields)
    except ValueError as error:
        raise UserError(
            f"the translated TRL settings are refused: {error}", FIX
        ) from error


def _batch_and_steps(fields: dict[str, Any], values: dict[str, Any]) -> dict:
    """``fields`` plus train_batch_size (the per-device batch x accumulation
    steps, one process) and steps (max_steps / optimizer steps per rollout
    batch), which need the other settings."""
    fields = dict(fields)
    if "per_device_train_batch_size" in values:
        steps = fields.get("gradient_accumulation_steps")
        if steps is None:
            steps = _built(
                {"profile": fields.get("profile")}
            ).gradient_accumulation_steps
        fields["train_batch_size"] = values["per_device_train_batch_size"] * steps
        if "generation_batch_size" not in values:  # TRL's default
            fields["rollout_batch_size"] = fields["train_batch_size"]
    if "importance_reweighting_method" not in fields:
        # TRL always clips the ratio; on-policy (ratio 1) that is REINFORCE.
        fields["importance_reweighting_method"] = (
            "grpo" if _off_policy(fields) else "none"
        )
    if fields["importance_reweighting_method"] == "grpo":
        fields.setdefault("cliprange", TRL_EPSILON)
    if "max_steps" in values:
        per_step = optimizer_steps_per_grpo_step(_built(fields))
        max_steps = values["max_steps"]
        if (
            isinstance(max_steps, bool)
            or not isinstance(max_steps, int)
            or (max_steps % per_step)
        ):
            raise UserError(
                f"TRL's `max_steps` {max_steps!r} is not a whole number of GRPO "
                f"steps of {per_step} optimizer steps each",
                "give a multiple of it, or grpo_lab's steps",
            )
        fields["steps"] = max_steps // per_step
    return fields


def _off_policy(fields: dict[str, Any]) -> bool:
    defaults = _built({"profile": fields.get("profile")})

    def value(name: str) -> Any:
        return fields.get(name, getattr(defaults, name))

    return value("epochs_per_rollout_batch") > 1 or value("train_batch_size") < value(
        "rollout_batch_size"
    )


def _check_translates_back(config: TrainConfig, values: dict[str, Any]) -> None:
    """Every TRL value given is what ``config`` translates to."""
    field_names = {f.name for f in dataclasses.fields(TrainConfig)}
    for name, value in values.items():
        rows = [row for row in TRANSLATIONS.values() if name in row.trl_names]
        if not rows or (name in field_names and name not in FROM_TRL):
            continue
        back = {}
        for row in rows:
            back.update(row.convert(config, 1))
        if name in back and back[name] != value:
            raise UserError(
                f"TRL's `{name}` {value!r} has no grpo_lab counterpart here: "
                f"{trl_name_hint(name)}, whose value in TRL is {back[name]!r}",
                FIX,
            )


# --- LoRA -------------------------------------------------------------------------

LAUNCH_SETTINGS.update(
    {
        "lora_rank": "train.py passes peft_config (peft_config_for) to GRPOTrainer",
        "lora_alpha": "peft_config's lora_alpha",
        "lora_dropout": "peft_config's lora_dropout",
        "lora_target_modules": "peft_config's target_modules",
    }
)


def _lora_lr(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    return {"learning_rate": config.lora_lr} if config.lora_rank > 0 else {}


# After "lr": with adapters, their rate replaces it.
TRANSLATIONS["lora_lr"] = Translation(
    ("learning_rate",), _lora_lr, "lora_rank > 0: learning_rate"
)


def peft_config_for(config: TrainConfig) -> Any:
    """The ``peft.LoraConfig`` GRPOTrainer's ``peft_config`` takes for
    ``config``'s adapters (the one grpo_lab trains with), None without."""
    from grpo_lab.training.lora import peft_lora_config

    settings = config.lora_settings()
    return None if settings is None else peft_lora_config(settings)
