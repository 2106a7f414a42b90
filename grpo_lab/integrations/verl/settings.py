"""Every ``TrainConfig`` field in a verl run: one row each, its overrides and note.

:data:`EXPORTS` is the one table of which field becomes which Hydra override
of verl 0.9.1's ``ppo_trainer``, as TRL's ``Translation`` rows are for
``GRPOConfig``: each :class:`Export` row holds the converter that writes the
field's overrides (or refuses, naming the field, a value verl cannot carry)
and the note the launch README and the tests read. :data:`NOT_TRAINING_SETTINGS`
holds the fields with no counterpart in a verl run, and why nothing is lost;
a field is in at most one of the two, and one in neither is refused unless it
has no effect (:mod:`~grpo_lab.integrations.unrowed`). :func:`launch_overrides`
applies the rows in order (a later row's key wins: with adapters, ``lora_lr``
replaces ``lr``'s rate).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from grpo_lab.advantages import REWARD_COMPONENTS
from grpo_lab.integrations.cluster import Cluster, refusal_counts, split_rows
from grpo_lab.integrations.unrowed import (
    DEFAULT_ONLY_NOTE,
    check_unrowed,
    unrowed_fields,
)
from grpo_lab.integrations.verl.algorithms import (
    DEFAULT_ADVANTAGE_EPS,
    LOSS_PREFIX,
    estimator_name,
)
from grpo_lab.losses import effective_cliprange_high
from grpo_lab.rollouts import BACKEND_RECORDS
from grpo_lab.training.config import TrainConfig
from grpo_lab.training.parsers import parse_report_to
from grpo_lab.training.teacher import teacher_folder

ACTOR = "actor_rollout_ref.actor"
POLICY_LOSS = f"{ACTOR}.policy_loss"
ROLLOUT = "actor_rollout_ref.rollout"
MODEL = "actor_rollout_ref.model"
MODEL_PATH = f"{MODEL}.path"
PLAIN_PROMPT_TEMPLATE = "{% for message in messages %}{{ message.content }}{% endfor %}"
_TORCH_TO_VERL_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
# report_to names and verl's trainer.logger backends (verl 0.9.1 has all four).
TRACKERS = {
    "tensorboard": "tensorboard",
    "wandb": "wandb",
    "mlflow": "mlflow",
    "trackio": "trackio",
}
_KL_LOSS_TYPES = {"k1": "kl", "k2": "mse", "k3": "low_var_kl"}


@dataclass(frozen=True)
class Target:
    """Where the run goes: the GPUs and nodes, and the longest prompt allowed."""

    cluster: Cluster = field(default_factory=Cluster)
    max_prompt_length: int = 512


Converter = Callable[[Any, Target], dict[str, Any]]


@dataclass(frozen=True)
class Export:
    """One field's Hydra overrides (``convert``) and where they go (``note``)."""

    convert: Converter
    note: str


def _refuse(name: str, expected: str, value: object) -> ValueError:
    return ValueError(f"{name} must be {expected} to export to verl, got {value!r}")


def _refused_unless(name: str, allowed: Callable[[Any], bool], expected: str):
    """A converter that writes nothing and refuses ``name`` unless ``allowed``."""

    def convert(config: Any, target: Target) -> dict[str, Any]:
        if not allowed(config):
            raise _refuse(name, expected, getattr(config, name))
        return {}

    return convert


def _no_counterpart(name: str, value: object, default: object) -> ValueError:
    expected = f"its default {default!r} (verl has no counterpart for {name}: "
    return _refuse(name, expected + "train with grpo_lab otherwise)", value)


def _nothing(config: Any, target: Target) -> dict[str, Any]:
    return {}


# --- run, model, task -----------------------------------------------------------------


def _backend(config: Any, target: Target) -> dict[str, Any]:
    """The backend record's verl overrides, or its refusal."""
    overrides = BACKEND_RECORDS[config.backend].verl
    if isinstance(overrides, str):
        raise _refuse("backend", "hf or vllm", f"{config.backend} ({overrides})")
    return {**overrides, f"{ROLLOUT}.tensor_model_parallel_size": 1}


def _seed(config: Any, target: Target) -> dict[str, Any]:
    seed = config.seed
    return {
        f"{ROLLOUT}.seed": seed,
        f"{ACTOR}.data_loader_seed": seed,
        "data.seed": seed,
    }


def _model(config: Any, target: Target) -> dict[str, Any]:
    if config.model == "tiny":
        raise _refuse(
            "model",
            "a hub name or a local path (not 'tiny', which grpo_lab builds locally)",
            config.model,
        )
    return {MODEL_PATH: config.model}


def _task(config: Any, target: Target) -> dict[str, Any]:
    return {
        "data.train_files": "data/train.jsonl",
        "data.val_files": "data/val.jsonl",
        "data.max_prompt_length": target.max_prompt_length,
        "reward.custom_reward_function.path": "data/reward.py",
        "reward.custom_reward_function.name": "compute_score",
    }


def _chat_template(config: Any, target: Target) -> dict[str, Any]:
    if config.chat_template:
        return {}
    return {f"{MODEL}.custom_chat_template": PLAIN_PROMPT_TEMPLATE}


# --- batches and schedule -------------------------------------------------------------


def _fits(config: Any, processes: int) -> bool:
    """verl 0.9.1's batch rules on ``processes`` GPUs: the rollout batch and the
    train batch (responses) divide by them (``validate_config`` and its engine
    workers' mini-batch split)."""
    return (
        config.rollout_batch_size % processes == 0
        and config.train_batch_size % processes == 0
    )


def _train_batch(config: Any, target: Target) -> dict[str, Any]:
    processes = target.cluster.world_size
    if not _fits(config, processes):
        raise _refuse(
            "train_batch_size",
            f"a batch whose rollout_batch_size ({config.rollout_batch_size}) and "
            f"train_batch_size divide by the {processes} GPUs; "
            + refusal_counts(lambda n: _fits(config, n)),
            config.train_batch_size,
        )
    return {
        f"{ACTOR}.ppo_mini_batch_size": config.train_batch_size // config.group_size
    }


def _micro_batch(config: Any, target: Target) -> dict[str, Any]:
    micro = config.train_batch_size // config.gradient_accumulation_steps
    per_gpu, _ = split_rows(config.train_batch_size, target.cluster.world_size, micro)
    return {
        f"{ACTOR}.ppo_micro_batch_size_per_gpu": per_gpu,
        f"{ACTOR}.use_dynamic_bsz": False,
        f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu": per_gpu,
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": per_gpu,
    }


# --- advantages and loss --------------------------------------------------------------


def _estimator(config: Any, target: Target) -> dict[str, Any]:
    """grpo_lab's estimator by name; GDPO as verl's own ``gdpo`` over the
    reward's parts (data/reward.py returns them)."""
    aggregation = config.reward_aggregation
    if aggregation == "normalize_then_sum":
        raise _refuse(
            "reward_aggregation",
            "'reward', 'sum_then_normalize' or 'normalize_then_sum_tokens' (verl's "
            "gdpo whitens the summed parts over tokens, not responses)",
            aggregation,
        )
    if aggregation != "normalize_then_sum_tokens":
        name = estimator_name(config.baseline, config.advantage_normalizer)
        return {"algorithm.adv_estimator": name}
    if config.baseline != "mean" or config.advantage_normalizer not in ("std", "none"):
        raise _refuse(
            "advantage_normalizer",
            "'std' or 'none' with baseline 'mean' for reward_aggregation "
            "'normalize_then_sum_tokens' (verl's gdpo normalizes each part as its "
            "grpo estimator does)",
            f"{config.advantage_normalizer} with baseline {config.baseline}",
        )
    return {
        "algorithm.adv_estimator": "gdpo",
        "algorithm.norm_adv_by_std_in_grpo": config.advantage_normalizer == "std",
        # not in ppo_trainer.yaml (AlgoConfig has it): Hydra adds it with "++"
        "++algorithm.gdpo_reward_keys": list(REWARD_COMPONENTS),
    }


def _cliprange(config: Any, target: Target) -> dict[str, Any]:
    if config.cliprange is None:
        return {}
    return {
        f"{ACTOR}.clip_ratio": config.cliprange,
        f"{ACTOR}.clip_ratio_low": config.cliprange,
    }


def _cliprange_high(config: Any, target: Target) -> dict[str, Any]:
    if config.cliprange is None:
        return {}
    high = effective_cliprange_high(config.cliprange, config.cliprange_high)
    return {f"{ACTOR}.clip_ratio_high": high}


_AGGREGATION = {
    "token": "token-mean",
    "sequence": "seq-mean-token-mean",
    "constant": "seq-mean-token-sum-norm",
}


def _normalization_constant(config: Any, target: Target) -> dict[str, Any]:
    if config.loss_normalization != "constant":
        return {}
    constant, rows = config.normalization_constant, config.train_batch_size
    if constant % rows:
        raise _refuse(
            "normalization_constant",
            f"a multiple of train_batch_size ({rows}) (verl divides by its batch "
            "size times an integer loss_scale_factor)",
            constant,
        )
    return {f"{ACTOR}.loss_scale_factor": int(constant // rows)}


def _kl_coef(config: Any, target: Target) -> dict[str, Any]:
    return {
        "algorithm.use_kl_in_reward": False,
        f"{ACTOR}.use_kl_loss": config.kl_coef > 0,
        f"{ACTOR}.kl_loss_coef": config.kl_coef,
    }


# --- sampling, evaluation, device -----------------------------------------------------


def _max_new_tokens(config: Any, target: Target) -> dict[str, Any]:
    return {"data.max_response_length": max_new_tokens(config)}


def max_new_tokens(config: Any) -> int:
    """The response length: ``max_new_tokens``, else the task's own."""
    if config.max_new_tokens is not None:
        return config.max_new_tokens
    from grpo_lab.tasks import get_task

    return get_task(config.task, **config.task_options).max_new_tokens


def _eval_every(config: Any, target: Target) -> dict[str, Any]:
    return {
        "trainer.test_freq": config.eval_every if config.eval_every else -1,
        "trainer.val_before_train": bool(config.eval_every),
    }


def _report_to(config: Any, target: Target) -> dict[str, Any]:
    trackers = [TRACKERS[name] for name in parse_report_to(config.report_to)]
    return {"trainer.logger": ["console", *trackers]}


def _device(config: Any, target: Target) -> dict[str, Any]:
    if not str(config.device).startswith("cuda"):
        raise _refuse("device", "a CUDA device (verl trains on GPUs)", config.device)
    return {
        "trainer.n_gpus_per_node": target.cluster.gpus,
        "trainer.nnodes": target.cluster.nodes,
    }


# --- LoRA -----------------------------------------------------------------------------


def _with_adapters(key: str, read: Callable[[Any], Any]) -> Converter:
    """``{key: read(config)}`` when the run trains adapters (lora_rank > 0)."""

    def convert(config: Any, target: Target) -> dict[str, Any]:
        return {key: read(config)} if config.lora_rank > 0 else {}

    return convert


def _lora_targets(config: Any) -> str | list[str]:
    targets = config.lora_settings().target_modules
    return targets if isinstance(targets, str) else list(targets)


def _lora_dropout(config: Any, target: Target) -> dict[str, Any]:
    if config.lora_rank > 0 and config.lora_dropout != 0:
        raise _refuse(
            "lora_dropout", "0 (dropout is not exported)", config.lora_dropout
        )
    return {}


def _lora_train_norms(config: Any, target: Target) -> dict[str, Any]:
    # verl's FSDP workers build peft's LoraConfig from lora_rank, lora_alpha,
    # target_modules and exclude_modules alone (verl/workers/fsdp_workers.py):
    # no modules_to_save, so trained norm gains have no verl setting.
    if config.lora_rank > 0 and config.lora_train_norms:
        raise _refuse(
            "lora_train_norms",
            "False (verl's LoRA has no modules_to_save)",
            config.lora_train_norms,
        )
    return {}


# --- the table ------------------------------------------------------------------------


# --- on-policy distillation -------------------------------------------------------

DISTILLATION = "distillation"
DISTILLATION_LOSS = f"{DISTILLATION}.distillation_loss"
TEACHER = f"{DISTILLATION}.teacher_models.teacher_model"
TEACHER_PATH = f"{TEACHER}.model_path"
# verl's distillation policy gradient is its vanilla PPO loss, whose dual clip
# reads clip_ratio_c from DistillationLossConfig, a field it does not have: 3.
VERL_DISTILLATION_RATIO_CAP = 3.0


def _teacher(config: Any, target: Target) -> dict[str, Any]:
    """verl's teacher: the model path (a run folder's final_model), on a pool
    of one GPU of its own (one replica, tensor parallel 1)."""
    if config.teacher is None:
        return {}
    path = teacher_folder(config.teacher)  # a local one: copied in, see launch
    return {
        f"{DISTILLATION}.enabled": True,
        f"{DISTILLATION}.n_gpus_per_node": 1,
        f"{DISTILLATION}.nnodes": 1,
        TEACHER_PATH: path,
        f"{TEACHER}.inference.tensor_model_parallel_size": 1,
    }


def _distillation(config: Any, target: Target) -> dict[str, Any]:
    """The form: a direct loss (use_policy_gradient False) or a reward (True),
    the clamps off (grpo_lab has none), the policy gradient's clip range."""
    if config.distillation == "none":
        return {}
    reward = config.distillation == "reward"
    if reward and config.off_policy and config.ratio_cap != VERL_DISTILLATION_RATIO_CAP:
        raise _refuse(
            "ratio_cap",
            f"{VERL_DISTILLATION_RATIO_CAP} with distillation 'reward' off-policy "
            "(verl's distillation policy gradient caps ratios at 3)",
            config.ratio_cap,
        )
    low = config.cliprange if config.cliprange is not None else 0.2
    high = effective_cliprange_high(config.cliprange, config.cliprange_high)
    return {
        f"{DISTILLATION_LOSS}.use_policy_gradient": reward,
        f"{DISTILLATION_LOSS}.loss_max_clamp": None,
        f"{DISTILLATION_LOSS}.log_prob_min_clamp": None,
        f"{DISTILLATION_LOSS}.clip_ratio": low,
        f"{DISTILLATION_LOSS}.clip_ratio_low": low,
        f"{DISTILLATION_LOSS}.clip_ratio_high": high if high is not None else low,
    }


def _distillation_coef(config: Any, target: Target) -> dict[str, Any]:
    if config.distillation == "none":
        return {}
    if not config.distillation_task_reward and config.distillation_coef != 1.0:
        raise _refuse(
            "distillation_coef",
            "1.0 without distillation_task_reward (verl weighs the distillation "
            "term only beside the task reward)",
            config.distillation_coef,
        )
    return {f"{DISTILLATION_LOSS}.distillation_loss_coef": config.distillation_coef}


def _only_distilling(key: str, read: Callable[[Any], Any]) -> Converter:
    """``{key: read(config)}`` when the run has a teacher, else nothing."""

    def convert(config: Any, target: Target) -> dict[str, Any]:
        return {} if config.distillation == "none" else {key: read(config)}

    return convert


def _one(key: str, read: Callable[[Any], Any]) -> Converter:
    """``{key: read(config)}``: a field that becomes one override."""
    return lambda config, target: {key: read(config)}


E = Export
EXPORTS: dict[str, Export] = {
    # What verl cannot carry, refused (by name) before any other row runs.
    "model": E(_model, "actor_rollout_ref.model.path"),
    "advantage_eps": E(
        _refused_unless(
            "advantage_eps",
            lambda c: c.advantage_eps == DEFAULT_ADVANTAGE_EPS,
            f"{DEFAULT_ADVANTAGE_EPS} (verl passes no epsilon to a registered "
            "estimator)",
        ),
        "refused unless 1e-6 (the estimators' epsilon)",
    ),
    "nan_rewards": E(
        _refused_unless(
            "nan_rewards", lambda c: c.nan_rewards == "propagate", "'propagate'"
        ),
        "refused unless 'propagate'",
    ),
    "kl_importance_weighting": E(
        _refused_unless(
            "kl_importance_weighting",
            lambda c: not c.kl_importance_weighting,
            "False (verl's KL loss has no importance weight)",
        ),
        "refused unless False",
    ),
    "top_entropy_quantile": E(
        _refused_unless(
            "top_entropy_quantile",
            lambda c: c.top_entropy_quantile == 1.0,
            "1.0 (verl trains on every token)",
        ),
        "refused unless 1.0",
    ),
    "sft_max_steps": E(
        _refused_unless(
            "sft_max_steps",
            lambda c: c.sft_max_steps == 0,
            "0 (verl has no supervised warm-up: run it with grpo_lab and export the "
            "warmed-up model's path)",
        ),
        "refused unless 0",
    ),
    "device": E(
        _device,
        "refused unless CUDA; --gpus and --nodes give trainer.n_gpus_per_node and "
        "trainer.nnodes",
    ),
    "mismatch": E(
        _refused_unless(
            "mismatch",
            lambda c: c.mismatch == "none",
            "'none' (the mismatch backend is grpo_lab's CPU simulator)",
        ),
        "refused unless 'none'",
    ),
    "sampler_correction": E(
        _refused_unless(
            "sampler_correction",
            lambda c: c.sampler_correction == "none",
            "'none' (verl's own algorithm.rollout_correction is not mapped; set it "
            "in overrides.txt by hand)",
        ),
        "refused unless 'none'",
    ),
    "max_staleness": E(
        _refused_unless(
            "max_staleness",
            lambda c: c.max_staleness == 0,
            "0 (this export writes the synchronous main_ppo; verl's "
            "asynchronous trainers are other entry points that train another "
            "run: one_step_off_policy samples every batch exactly one step "
            "behind and by default takes the sampler's log-probs as pi_old "
            "(algorithm.rollout_correction.bypass_mode), with neither "
            "async_admission nor async_queue_size; fully_async_policy bounds "
            "the share of stale samples (async_training.staleness_threshold, a "
            "fraction, not steps), syncs every "
            "async_training.trigger_parameter_sync_step and resumes interrupted "
            "responses under new weights (partial_rollout))",
        ),
        "refused unless 0",
    ),
    "dynamic_sampling": E(
        _refused_unless(
            "dynamic_sampling",
            lambda c: not c.dynamic_sampling,
            "False (verl's algorithm.filter_groups is not mapped)",
        ),
        "refused unless False",
    ),
    "mask_truncated_completions": E(
        _refused_unless(
            "mask_truncated_completions",
            lambda c: not c.mask_truncated_completions,
            "False (not mapped to verl)",
        ),
        "refused unless False",
    ),
    "overlong_buffer": E(
        _refused_unless(
            "overlong_buffer",
            lambda c: c.overlong_buffer is None,
            "None (verl's overlong reward shaping is not mapped)",
        ),
        "refused unless None",
    ),
    # Then every other field, in TrainConfig order.
    "seed": E(
        _seed, "data.seed, actor.data_loader_seed, rollout.seed, the data files' draws"
    ),
    "run_dir": E(
        _one("trainer.default_local_dir", lambda c: "checkpoints"),
        "not written (a path of this machine): trainer.default_local_dir is the "
        "folder's checkpoints/",
    ),
    "resume": E(
        _one("trainer.resume_mode", lambda c: "auto" if c.resume else "disable"),
        "trainer.resume_mode (auto / disable)",
    ),
    "task": E(_task, "data/train.jsonl, data/val.jsonl and data/reward.py"),
    "task_options": E(_nothing, "the task the data files and reward.py build"),
    "chat_template": E(
        _chat_template, "off: model.custom_chat_template passes the prompt as is"
    ),
    "steps": E(
        _one("trainer.total_training_steps", lambda c: c.steps),
        "trainer.total_training_steps",
    ),
    "rollout_batch_size": E(
        _one("data.train_batch_size", lambda c: c.prompts_per_step),
        "data.train_batch_size (prompts) x rollout.n",
    ),
    "group_size": E(_one(f"{ROLLOUT}.n", lambda c: c.group_size), "rollout.n"),
    "train_batch_size": E(
        _train_batch, "actor.ppo_mini_batch_size (prompts) x rollout.n"
    ),
    "epochs_per_rollout_batch": E(
        _one(f"{ACTOR}.ppo_epochs", lambda c: c.epochs_per_rollout_batch),
        "actor.ppo_epochs",
    ),
    "gradient_accumulation_steps": E(
        _micro_batch, "actor.ppo_micro_batch_size_per_gpu"
    ),
    "lr": E(_one(f"{ACTOR}.optim.lr", lambda c: c.lr), "actor.optim.lr"),
    "lr_warmup_steps": E(
        _one(f"{ACTOR}.optim.lr_warmup_steps", lambda c: c.lr_warmup_steps),
        "actor.optim.lr_warmup_steps",
    ),
    "weight_decay": E(
        _one(f"{ACTOR}.optim.weight_decay", lambda c: c.weight_decay),
        "actor.optim.weight_decay",
    ),
    "adam_beta2": E(
        _one(f"{ACTOR}.optim.betas", lambda c: [0.9, c.adam_beta2]),
        "actor.optim.betas[1]",
    ),
    "max_grad_norm": E(
        _one(
            f"{ACTOR}.optim.clip_grad",
            lambda c: math.inf if c.max_grad_norm is None else c.max_grad_norm,
        ),
        "actor.optim.clip_grad (None: inf)",
    ),
    "baseline": E(_estimator, "algorithm.adv_estimator"),
    "advantage_normalizer": E(_estimator, "algorithm.adv_estimator"),
    "reward_aggregation": E(
        _estimator,
        "sum_then_normalize: data/reward.py scores the parts' sum; "
        "normalize_then_sum_tokens: algorithm.adv_estimator=gdpo with "
        "gdpo_reward_keys; normalize_then_sum refused (verl whitens over tokens)",
    ),
    "importance_reweighting_method": E(
        _one(
            f"{ACTOR}.policy_loss.loss_mode",
            lambda c: f"{LOSS_PREFIX}{c.importance_reweighting_method}",
        ),
        "actor.policy_loss.loss_mode",
    ),
    "cliprange": E(_cliprange, "actor.clip_ratio, actor.clip_ratio_low"),
    "cliprange_high": E(_cliprange_high, "actor.clip_ratio_high"),
    "ratio_cap": E(
        _one(
            f"{ACTOR}.clip_ratio_c",
            lambda c: math.inf if c.ratio_cap is None else c.ratio_cap,
        ),
        "actor.clip_ratio_c (None: inf), for dppo the truncation of its weight",
    ),
    "sapo_temperature_pos": E(
        _one(f"{ACTOR}.tau_pos", lambda c: c.sapo_temperature_pos), "actor.tau_pos"
    ),
    "sapo_temperature_neg": E(
        _one(f"{ACTOR}.tau_neg", lambda c: c.sapo_temperature_neg), "actor.tau_neg"
    ),
    "covariance_fraction": E(
        lambda c, target: {
            f"{POLICY_LOSS}.clip_cov_ratio": c.covariance_fraction,
            f"{POLICY_LOSS}.kl_cov_ratio": c.covariance_fraction,
        },
        "actor.policy_loss.clip_cov_ratio and kl_cov_ratio",
    ),
    "clip_cov_low": E(
        _one(f"{POLICY_LOSS}.clip_cov_lb", lambda c: c.clip_cov_low),
        "actor.policy_loss.clip_cov_lb",
    ),
    "clip_cov_high": E(
        _one(f"{POLICY_LOSS}.clip_cov_ub", lambda c: c.clip_cov_high),
        "actor.policy_loss.clip_cov_ub",
    ),
    "kl_cov_coef": E(
        _one(f"{POLICY_LOSS}.ppo_kl_coef", lambda c: c.kl_cov_coef),
        "actor.policy_loss.ppo_kl_coef",
    ),
    "loss_normalization": E(
        _one(f"{ACTOR}.loss_agg_mode", lambda c: _AGGREGATION[c.loss_normalization]),
        "actor.loss_agg_mode",
    ),
    "normalization_constant": E(
        _normalization_constant, "actor.loss_scale_factor (x train_batch_size)"
    ),
    "kl_coef": E(_kl_coef, "actor.use_kl_loss, actor.kl_loss_coef"),
    "teacher": E(
        _teacher,
        "distillation.enabled, teacher_models.teacher_model.model_path (a run "
        "folder's final_model), a pool of 1 GPU for the teacher",
    ),
    "distillation": E(
        _distillation,
        "distillation_loss.use_policy_gradient (loss: False, reward: True), its "
        "clamps off, its clip_ratio_low/high from cliprange(_high); reward "
        "off-policy refused unless ratio_cap 3 (verl's fixed dual clip)",
    ),
    "distillation_estimator": E(
        _only_distilling(
            f"{DISTILLATION_LOSS}.loss_mode", lambda c: c.distillation_estimator
        ),
        "distillation_loss.loss_mode (k1, k2, k3)",
    ),
    "distillation_coef": E(
        _distillation_coef,
        "distillation_loss.distillation_loss_coef; refused unless 1 without "
        "distillation_task_reward",
    ),
    "distillation_task_reward": E(
        _only_distilling(
            f"{DISTILLATION_LOSS}.use_task_rewards",
            lambda c: c.distillation_task_reward,
        ),
        "distillation_loss.use_task_rewards",
    ),
    "kl_estimator": E(
        _one(f"{ACTOR}.kl_loss_type", lambda c: _KL_LOSS_TYPES[c.kl_estimator]),
        "actor.kl_loss_type (kl, mse, low_var_kl)",
    ),
    "entropy_coef": E(
        _one(f"{ACTOR}.entropy_coeff", lambda c: c.entropy_coef), "actor.entropy_coeff"
    ),
    "temperature": E(
        _one(f"{ROLLOUT}.temperature", lambda c: c.temperature), "rollout.temperature"
    ),
    "top_p": E(_one(f"{ROLLOUT}.top_p", lambda c: c.top_p), "rollout.top_p"),
    "max_new_tokens": E(_max_new_tokens, "data.max_response_length (None: the task's)"),
    "backend": E(
        _backend,
        "rollout.name vllm (verl samples with its own engine); the backend "
        "record's refusal otherwise",
    ),
    "vllm_gpu_memory_utilization": E(
        _one(
            f"{ROLLOUT}.gpu_memory_utilization", lambda c: c.vllm_gpu_memory_utilization
        ),
        "rollout.gpu_memory_utilization",
    ),
    "eval_every": E(_eval_every, "trainer.test_freq (0: -1), trainer.val_before_train"),
    "eval_size": E(_nothing, "data/val.jsonl's prompts"),
    "checkpoint_every": E(
        _one("trainer.save_freq", lambda c: c.checkpoint_every or c.steps),
        "trainer.save_freq (0: steps, the end only)",
    ),
    "keep_checkpoints": E(
        _one("trainer.max_actor_ckpt_to_keep", lambda c: c.keep_checkpoints),
        "trainer.max_actor_ckpt_to_keep",
    ),
    "report_to": E(_report_to, "trainer.logger"),
    "dtype": E(
        _one(
            f"{ACTOR}.fsdp_config.model_dtype", lambda c: _TORCH_TO_VERL_DTYPE[c.dtype]
        ),
        "actor.fsdp_config.model_dtype",
    ),
    "autocast_dtype": E(
        _one(f"{ACTOR}.fsdp_config.dtype", lambda c: c.autocast_dtype or c.dtype),
        "actor.fsdp_config.dtype (None: dtype)",
    ),
    "gradient_checkpointing": E(
        _one(
            f"{MODEL}.enable_gradient_checkpointing", lambda c: c.gradient_checkpointing
        ),
        "actor_rollout_ref.model.enable_gradient_checkpointing",
    ),
    # LoRA, after "lr": with adapters, their rate replaces it.
    "lora_rank": E(
        _with_adapters(f"{MODEL}.lora_rank", lambda c: c.lora_rank),
        "actor_rollout_ref.model.lora_rank (0: full fine-tuning)",
    ),
    "lora_alpha": E(
        _with_adapters(f"{MODEL}.lora_alpha", lambda c: c.lora_alpha),
        "actor_rollout_ref.model.lora_alpha",
    ),
    "lora_target_modules": E(
        _with_adapters(f"{MODEL}.target_modules", _lora_targets),
        "actor_rollout_ref.model.target_modules",
    ),
    "lora_dropout": E(_lora_dropout, "refused unless 0 (not exported)"),
    "lora_train_norms": E(
        _lora_train_norms, "refused unless False (verl's LoRA has no modules_to_save)"
    ),
    "lora_lr": E(
        _with_adapters(f"{ACTOR}.optim.lr", lambda c: c.lora_lr),
        "actor.optim.lr when lora_rank > 0",
    ),
}
# Every exported field with its note (the launch README, the tests).
EXPORTED_SETTINGS = {name: row.note for name, row in EXPORTS.items()}

# Fields with no counterpart in a verl run, and why nothing is lost.
NOT_TRAINING_SETTINGS = {
    "profile": "the name of the defaults the config started from; every value "
    "is exported field by field",
    "tiny_hidden_size": "shape of the locally built 'tiny' model, which verl "
    "cannot load (model 'tiny' is refused)",
    "tiny_num_layers": "shape of the 'tiny' model (refused, see tiny_hidden_size)",
    "tiny_intermediate_size": "shape of the 'tiny' model (refused, see "
    "tiny_hidden_size)",
    "rollout_max_batch_size": "memory knob of grpo_lab's hf sampler; verl's "
    "engine batches generation itself",
    "share_prompt_prefix": "speed-up of grpo_lab's sampling and scoring: the same "
    "log-probs, gradients equal up to float32 rounding in transformers' RMSNorm",
    "logits_chunk_size": "memory knob of grpo_lab's scoring with identical results",
    "num_threads": "CPU threads of grpo_lab's own process",
    "sft_target_accuracy": "read by the supervised warm-up only, which must be "
    "off (sft_max_steps 0) to export",
    "sft_eval_temperature": "warm-up only (see sft_target_accuracy)",
    "sft_batch_size": "warm-up only (see sft_target_accuracy)",
    "sft_lr": "warm-up only (see sft_target_accuracy)",
    "sft_eval_every": "warm-up only (see sft_target_accuracy)",
    "sft_eval_size": "warm-up only (see sft_target_accuracy)",
    "mismatch_scale": "read only by grpo_lab's mismatch backend (mismatch must "
    "be none)",
    "mismatch_sync_every": "read only by the mismatch backend (see mismatch_scale)",
    "async_admission": "read only with max_staleness > 0, which must be 0 to export",
    "weight_sync_every": "see async_admission",
    "async_queue_size": "see async_admission",
    "sampler_correction_cap": "read only with sampler_correction, which must be "
    "none to export",
    "sampler_correction_low": "see sampler_correction_cap",
    "sampler_correction_high": "see sampler_correction_cap",
    "dynamic_sampling_max_rounds": "read only with dynamic_sampling, which must "
    "be False to export",
    "overlong_penalty": "read only with overlong_buffer, which must be None",
}


def launch_overrides(
    config: Any, *, cluster: Cluster | None = None, max_prompt_length: int = 512
) -> dict[str, Any]:
    """Every Hydra override of verl's ppo_trainer a run of ``config`` on
    ``cluster`` (default: one GPU) needs, row by row of :data:`EXPORTS`; paths
    are relative to the folder. A value verl cannot carry (or a field with no
    row, away from its default and not inert) raises ``ValueError`` naming its
    field."""
    check_unrowed(config, (EXPORTS, NOT_TRAINING_SETTINGS), _no_counterpart)
    target = Target(cluster or Cluster(), max_prompt_length)
    overrides: dict[str, Any] = {}
    for row in EXPORTS.values():
        overrides.update(row.convert(config, target))
    return overrides


def exported_fields(*, config_class: type = TrainConfig) -> dict[str, str]:
    """Every field of ``config_class`` with where it goes (or why it has no
    place; a field with no row: refused unless default)."""
    tables = (EXPORTS, NOT_TRAINING_SETTINGS)
    unrowed = dict.fromkeys(unrowed_fields(config_class, tables), DEFAULT_ONLY_NOTE)
    return {**EXPORTED_SETTINGS, **NOT_TRAINING_SETTINGS, **unrowed}


def lora_overrides(config: Any) -> dict[str, Any]:
    """verl's LoRA settings for ``config``'s adapters (none at rank 0): the
    overrides of the ``lora_`` rows."""
    overrides: dict[str, Any] = {}
    for name, row in EXPORTS.items():
        if name.startswith("lora_"):
            overrides.update(row.convert(config, Target()))
    return overrides
