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

A field is in at most one of :data:`TRANSLATIONS`, :data:`LAUNCH_SETTINGS`
(read by the launch folder's ``train.py``) and :data:`NOT_TRAINING_SETTINGS`
(no effect on the numbers); one in none is refused unless it has no effect
(:mod:`~grpo_lab.integrations.unrowed`). Scale: the README's "When you outgrow
one GPU".

This module is the table only (it imports neither trl nor datasets); the
package docstring lists the other jobs' modules, and :data:`MOVED` the names
still read from here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from grpo_lab.errors import UserError
from grpo_lab.integrations.cluster import refusal_counts, split_rows
from grpo_lab.integrations.trl.batch_rules import trl_batch_problem
from grpo_lab.integrations.unrowed import DEFAULT_ONLY_NOTE, check_unrowed
from grpo_lab.integrations.unrowed import unrowed_fields as _unrowed
from grpo_lab.losses import VESPO_OPTIONS, effective_cliprange_high
from grpo_lab.rollouts import BACKEND_RECORDS
from grpo_lab.tasks import get_task
from grpo_lab.training.config import TrainConfig, inert_settings
from grpo_lab.training.parsers import parse_report_to

TESTED_TRL_VERSION = "1.16.0"
TRL_ADVANTAGE_EPS = 1e-4  # TRL divides by std + 1e-4, a constant
TRL_EPSILON = 0.2  # GRPOConfig's default epsilon
FIX = "see docs/scaling_out.md"


def _refuse(field: str, value: Any, why: str, fix: str = FIX) -> UserError:
    return UserError(f"{field} {value!r} cannot run on TRL's GRPOTrainer: {why}", fix)


def _no_counterpart(field: str, value: Any, default: Any) -> UserError:
    problem = f"{field} {value!r}: TRL's GRPOTrainer has no counterpart for {field}"
    fix = f"set it to its default {default!r} or train with grpo_lab"
    return UserError(problem, fix)


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
    if config.advantage_normalizer not in _SCALE_REWARDS:
        raise _refuse(
            "advantage_normalizer",
            config.advantage_normalizer,
            "TRL 1.16 has no REINFORCE++ whitening over tokens (use one of "
            f"{tuple(_SCALE_REWARDS)})",
        )
    return {"scale_rewards": _SCALE_REWARDS[config.advantage_normalizer]}


def _reward_aggregation(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    """TRL's multi_objective_aggregation over the reward's parts (the launch
    hands TRL one reward function per part)."""
    aggregation = config.reward_aggregation
    if aggregation == "normalize_then_sum_tokens":
        raise _refuse(
            "reward_aggregation",
            aggregation,
            "TRL whitens the summed parts over responses, not tokens (use "
            "'normalize_then_sum')",
        )
    if aggregation == "reward":
        return {}
    return {"multi_objective_aggregation": aggregation}


# The objectives TRL 1.16 computes, and its importance_sampling_level for each;
# any other (noclip, gmpo, or one added to the family later) is refused by name.
TRL_OBJECTIVES = {
    "none": "token",
    "grpo": "token",
    "gspo": "sequence",
    "cispo": "token",
    "sapo": "token",
    "luspo": "sequence",  # the paper's setup, grpo_lab's luspo
    "vespo": "token",  # VESPO computes its sequence weight itself
}


def _objective(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    method = config.importance_reweighting_method
    if method not in TRL_OBJECTIVES:
        raise _refuse(
            "importance_reweighting_method",
            method,
            f"TRL 1.16 has no such loss_type (it computes {tuple(TRL_OBJECTIVES)})",
        )
    return {"importance_sampling_level": TRL_OBJECTIVES[method]}


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
        high = effective_cliprange_high(config.cliprange, high)
        return {"epsilon_high": 1.0 + (1.0 if high is None else high)}
    return {} if high is None else {"epsilon_high": high}


def _ratio_cap(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    return {"delta": config.ratio_cap}


def _sapo_pos(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    return {"sapo_temperature_pos": config.sapo_temperature_pos}


def _sapo_neg(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    return {"sapo_temperature_neg": config.sapo_temperature_neg}


def _off_policy_mask(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    return {"off_policy_mask_threshold": config.off_policy_mask_threshold}


def _vespo_option(name: str) -> Callable[[TrainConfig, int], dict[str, Any]]:
    def translate(config: TrainConfig, num_processes: int) -> dict[str, Any]:
        return {name: getattr(config, name)}

    return translate


_LOSS_TYPES = {"sequence": "grpo", "token": "dapo", "constant": "dr_grpo"}
_OWN_AGGREGATION = {
    "cispo": "token",
    "sapo": "sequence",
    "luspo": "sequence",
    "vespo": "token",
}


def _loss_type(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    method = config.importance_reweighting_method
    normalization = config.loss_normalization
    if method == "luspo" and config.kl_coef > 0:
        raise _refuse(
            "kl_coef",
            config.kl_coef,
            "TRL's luspo sums the KL over each response's tokens, grpo_lab "
            "averages it like the loss; use kl_coef 0 with luspo",
        )
    if method == "vespo" and config.sampler_correction != "none":
        raise _refuse(
            "sampler_correction",
            config.sampler_correction,
            "TRL's vespo folds the sampler's ratio into its gamma weight, "
            "grpo_lab multiplies the loss by it; use none with vespo",
        )
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
    """The backend record's TRL arguments (sampler_correction says whether TRL
    corrects for a sampler that is not the policy), or its refusal."""
    arguments = BACKEND_RECORDS[config.backend].trl
    if isinstance(arguments, str):
        raise _refuse("backend", config.backend, arguments)
    return dict(arguments)


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


def _max_staleness(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    if config.max_staleness:
        raise _refuse(
            "max_staleness",
            config.max_staleness,
            "GRPOTrainer is synchronous, and TRL's asynchronous trainer "
            "(trl.experimental.async_grpo) cannot hold this run: "
            + "; ".join(trl_async_differences(config)),
        )
    return {}


def trl_async_differences(config: TrainConfig) -> list[str]:
    """Why TRL's asynchronous trainer (``AsyncGRPOTrainer``, its
    ``max_staleness`` and ``weight_sync_steps``) would train another run than
    ``config``'s asynchronous one, each naming the setting it is about."""
    found = [
        "the loss: TRL's async loss clips pi / pi_sampler (the sampler's own "
        "log-probs are its pi_old, tests/test_trl_async_parity.py), where "
        "grpo_lab's asynchronous loop takes pi_old from the trainer and weighs "
        "the sampler's gap with sampler_correction"
    ]
    if config.async_admission == "pace":
        found.append(
            "async_admission 'pace': TRL drops stale samples and never paces its "
            "worker (max_inflight_tasks bounds the samples in flight, not their age)"
        )
    if config.weight_sync_every > 1:
        found.append(
            f"weight_sync_every {config.weight_sync_every}: TRL's staleness counts "
            "weight syncs (its model version moves at each weight_sync_steps), "
            "grpo_lab's counts optimizer steps; they agree only at 1"
        )
    if config.sampler_correction != "none":
        found.append(
            f"sampler_correction {config.sampler_correction!r}: TRL's async loss "
            "has no importance-sampling correction"
        )
    return found


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
    # hf: transformers' generate, to which train.py hands the tokenizer.
    if config.backend == "hf":
        return {"generation_kwargs": {"stop_strings": list(stops)}}
    # vLLM's SamplingParams: stop there, and keep the stop string, as grpo_lab does.
    return {
        "generation_kwargs": {"stop": list(stops), "include_stop_str_in_output": True}
    }


def _vllm_memory(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    return {"vllm_gpu_memory_utilization": config.vllm_gpu_memory_utilization}


def _rollout_chunk(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    chunk, share = config.rollout_max_batch_size, config.rollout_batch_size
    if config.backend == "hf" and chunk is not None and chunk * num_processes < share:
        raise _refuse(
            "rollout_max_batch_size",
            config.rollout_max_batch_size,
            "TRL generates each process's share of generation_batch_size at once; "
            "use none (or at least that share)",
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


def _lora_lr(config: TrainConfig, num_processes: int) -> dict[str, Any]:
    return {"learning_rate": config.lora_lr} if config.lora_rank > 0 else {}


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
    # After "lr": with adapters, their rate replaces it.
    "lora_lr": T(("learning_rate",), _lora_lr, "lora_rank > 0: learning_rate"),
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
    "reward_aggregation": T(
        ("multi_objective_aggregation",),
        _reward_aggregation,
        "one reward function per part (format, answer) when not reward; "
        "normalize_then_sum_tokens refused",
    ),
    "nan_rewards": T((), lambda c, n: {}, "ignore in TRL; propagate by GrpoLabTrainer"),
    "importance_reweighting_method": T(
        ("importance_sampling_level",),
        _objective,
        "gspo, luspo -> sequence; none, grpo, cispo, sapo, vespo -> token; "
        "noclip, gmpo, dppo_tv, dppo_kl, clip_cov, kl_cov refused",
    ),
    "cliprange": T(("epsilon",), _cliprange, "cispo: must be >= 1 (no lower clip)"),
    "cliprange_high": T(
        ("epsilon_high",), _cliprange_high, "cispo: 1 + cliprange_high (a cap)"
    ),
    "ratio_cap": T(("delta",), _ratio_cap, "exact"),
    "sapo_temperature_pos": T(("sapo_temperature_pos",), _sapo_pos, "float32"),
    "sapo_temperature_neg": T(("sapo_temperature_neg",), _sapo_neg, "float32"),
    "off_policy_mask_threshold": T(
        ("off_policy_mask_threshold",),
        _off_policy_mask,
        "exact; both measure against the sampler's log-probs where it reports "
        "them, else pi_old (TRL has them from vLLM only; grpo_lab's hf backend's "
        "are the policy's own, in float32)",
    ),
    **{
        name: T((name,), _vespo_option(name), "exact (values float32 holds)")
        for name in VESPO_OPTIONS
    },
    "loss_normalization": T(
        ("loss_type",),
        _loss_type,
        "sequence -> grpo, token -> dapo (its divisor is the rollout batch's mean "
        "tokens per optimizer step: exact when train_batch_size == "
        "rollout_batch_size), constant -> dr_grpo; cispo, sapo, luspo, vespo "
        "keep their own (luspo: no KL)",
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
        "its stop strings -> vLLM's stop, or (hf) transformers' stop_strings",
    ),
    "vllm_gpu_memory_utilization": T(
        ("vllm_gpu_memory_utilization",), _vllm_memory, "exact"
    ),
    "rollout_max_batch_size": T(
        (), _rollout_chunk, "none or >= a process's share (hf)"
    ),
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
    "max_staleness": T(
        (), _max_staleness, "0 only: the async trainer is another trainer"
    ),
    "async_admission": T((), lambda c, n: {}, "read only with max_staleness > 0"),
    "weight_sync_every": T((), lambda c, n: {}, "read only with max_staleness > 0"),
    "async_queue_size": T((), lambda c, n: {}, "read only with max_staleness > 0"),
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
    "device": T(
        ("use_cpu",),
        _device,
        "accelerate picks each process's GPU; not in a launch folder",
    ),
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
    "lora_rank": "train.py passes peft_config (peft_config_for) to GRPOTrainer",
    "lora_alpha": "peft_config's lora_alpha",
    "lora_dropout": "peft_config's lora_dropout",
    "lora_target_modules": "peft_config's target_modules",
    "lora_train_norms": "peft_config's modules_to_save (the RMSNorm modules)",
}

NOT_TRAINING_SETTINGS: dict[str, str] = {
    "profile": "which defaults the config started from",
    "run_dir": "grpo_lab's run folder; TRL writes to output_dir",
    "share_prompt_prefix": "speed only: the same log-probs; gradients equal up to "
    "float32 rounding (transformers' RMSNorm rounds each row's gradient to float32 "
    "before a group's rows add up: about 1e-8 of their size in a float64 model, "
    "tests/test_prefix_sharing.py)",
    "logits_chunk_size": "memory only: TRL chunks its own scorer",
    "num_threads": "CPU threads; set OMP_NUM_THREADS at launch",
    "sft_target_accuracy": "read only by the warm-up (sft_max_steps 0)",
    "sft_eval_temperature": "read only by the warm-up (sft_max_steps 0)",
    "sft_batch_size": "read only by the warm-up (sft_max_steps 0)",
    "sft_lr": "read only by the warm-up (sft_max_steps 0)",
    "sft_eval_every": "read only by the warm-up (sft_max_steps 0)",
    "sft_eval_size": "read only by the warm-up (sft_max_steps 0)",
}


# Which fields have a row (a field in none falls under check_unrowed).
_TABLES = (TRANSLATIONS, LAUNCH_SETTINGS, NOT_TRAINING_SETTINGS)


def to_trl_config(config: TrainConfig, *, num_processes: int = 1) -> dict[str, Any]:
    """GRPOConfig keyword arguments for ``config`` (without ``output_dir``).

    Applies every row of :data:`TRANSLATIONS`; a setting TRL cannot run (or a
    field with no row, away from its default) raises ``UserError`` naming it,
    unless it has no effect in ``config``
    (:func:`grpo_lab.training.config.inert_settings`). ``num_processes`` is the
    number of data-parallel processes: the global batch sizes stay the
    config's, the per-device one shrinks.
    """
    if not isinstance(config, TrainConfig):
        raise ValueError(
            "config must be a TrainConfig (TrainConfig.from_dict builds one from a "
            f"dict), got {type(config).__name__}"
        )
    if not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes must be a positive int, got {num_processes!r}")
    check_unrowed(config, _TABLES, _no_counterpart)
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
    if config.reward_aggregation == "normalize_then_sum" and (
        config.advantage_normalizer != "std"
    ):  # TRL normalizes each part by its group std whatever scale_rewards says
        reasons.append(f"advantage_normalizer {config.advantage_normalizer!r}")
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


def translation_table(*, config_class: type = TrainConfig) -> str:
    """:data:`TRANSLATIONS` as a markdown table (field | TRL | how), then each
    field of ``config_class`` in no table, refused unless default."""
    rows = ["| grpo_lab field | GRPOConfig | how |", "|---|---|---|"]
    for name, translation in TRANSLATIONS.items():
        trl_names = ", ".join(f"`{n}`" for n in translation.trl_names) or "—"
        rows.append(f"| `{name}` | {trl_names} | {translation.note} |")
    rows += [
        f"| `{n}` | — | {DEFAULT_ONLY_NOTE} |" for n in _unrowed(config_class, _TABLES)
    ]
    return "\n".join(rows)
