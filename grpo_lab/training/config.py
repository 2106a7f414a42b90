"""Every setting of a training run: one dataclass, read like a manual.

Fields are grouped in sections (run · model · task · batches and schedule ·
optimizer · advantages and loss · sampling · evaluation and checkpoints ·
warm-up · device and memory · dynamic sampling and length). Each field's help
text is stored with it and is what ``grpo-lab train --help`` prints. The
dataclass defaults are the ``cpu`` profile; the others list only what they
change:

- ``cpu``: a 2-layer character model learns to reverse 5-digit strings on a
  laptop CPU in about a minute;
- ``gpu``: Qwen2.5-Math-1.5B on GSM8K with vLLM rollouts;
- ``small-gpu``: Qwen2.5-0.5B-Instruct on GSM8K on one 16 GB GPU (a T4);
- ``smoke``: the cpu run at the smallest sizes that still execute every line
  (tests, notebook checks).

Command-line flags (``grpo-lab train --lr 3e-4``) and notebook overrides
(``for_profile("cpu", lr=3e-4)``) write to the same fields, and every setting is
checked once, when the config is built (:func:`validate_config`), by the same
validator functions the core calls for direct callers: a run that cannot work
is refused here, not at step 1. Taught in ``notebooks/08_training_loop.ipynb``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import torch

from grpo_lab.advantages import (
    ADVANTAGE_NORMALIZERS,
    BASELINES,
    NAN_REWARD_POLICIES,
    check_advantage_settings,
)
from grpo_lab.kl import KL_ESTIMATORS
from grpo_lab.logprobs import check_temperature
from grpo_lab.losses import (
    CAPPED_METHODS,
    CLIPPED_METHODS,
    LOSS_NORMALIZATIONS,
    REWEIGHTING_METHODS,
)
from grpo_lab.rollouts import BACKENDS
from grpo_lab.rollouts.base import SAMPLER_LOG_PROB_BACKENDS, check_sampling_settings
from grpo_lab.rollouts.mismatch import PERTURBATIONS, check_mismatch_settings
from grpo_lab.sampler_correction import (
    CORRECTION_MODES,
    DEFAULT_CAP,
    DEFAULT_HIGH,
    DEFAULT_LOW,
    check_sampler_correction,
)
from grpo_lab.tasks import check_task_name_and_options, get_task, uses_tools
from grpo_lab.train_step import (
    UpdateSettings,
    check_gradient_accumulation_steps,
    check_max_grad_norm,
)
from grpo_lab.training.dynamic_sampling import check_dynamic_sampling_settings
from grpo_lab.training.lora import (
    ADAPTER_TRAINING_BYTES,
    ALL_LINEAR,
    LoraSettings,
    check_lora_settings,
    lora_parameter_count,
    qwen2_linear_shapes,
    target_names,
)
from grpo_lab.training.overlong import check_overlong_settings
from grpo_lab.training.parsers import check_report_to, parse_device

PROFILES = ("cpu", "gpu", "small-gpu", "smoke")
PROFILE_VARIABLE = "GRPO_LAB_PROFILE"
DTYPES = ("float32", "bfloat16", "float16")
INERT_SETTINGS_KEY = "inert_settings"

SECTIONS = (
    "run",
    "model",
    "task",
    "batches and schedule",
    "optimizer",
    "advantages and loss",
    "sampling",
    "sampler mismatch",
    "evaluation and checkpoints",
    "warm-up",
    "device and memory",
    "dynamic sampling and length",
)


def setting(default: Any, section: str, help: str, choices: tuple = ()) -> Any:
    """A dataclass field with its section, help text and allowed values."""
    metadata = {"section": section, "help": help, "choices": choices}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class TrainConfig:
    """One GRPO run. Sizes count responses unless the name says prompts."""

    # --- run -------------------------------------------------------------------
    profile: str = setting(
        "cpu",
        "run",
        "Which defaults this run started from: cpu (tiny model), gpu (a 1.5B "
        "model with vLLM), small-gpu (a 0.5B instruct model on a 16 GB GPU) or "
        "smoke (the cpu run at its smallest).",
        PROFILES,
    )
    seed: int = setting(
        0, "run", "Seed of the model weights, the prompt draws and every sampler."
    )
    run_dir: str | None = setting(
        None,
        "run",
        "Where config.json, metrics.jsonl and checkpoints go "
        "(None: runs/<task>-<time>).",
    )
    resume: bool = setting(
        False,
        "run",
        "Continue from the latest checkpoint in run_dir instead of starting over.",
    )
    # --- model -----------------------------------------------------------------
    model: str = setting(
        "tiny",
        "model",
        'A hub name or a local path; "tiny" builds a Qwen2-shaped character model '
        "locally.",
    )
    tiny_hidden_size: int = setting(128, "model", 'Hidden size of the "tiny" model.')
    tiny_num_layers: int = setting(2, "model", 'Decoder layers of the "tiny" model.')
    tiny_intermediate_size: int = setting(
        512, "model", 'MLP width of the "tiny" model.'
    )
    lora_rank: int = setting(
        0,
        "model",
        "Rank r of LoRA adapters on the policy (peft; arXiv:2106.09685): only the "
        "adapters train, the base weights stay frozen (0: full fine-tuning).",
    )
    lora_alpha: float = setting(
        32.0,
        "model",
        "LoRA alpha: each update B A is scaled by lora_alpha / lora_rank (32 at "
        "every rank, as in TRL's 'LoRA Without Regret' recipe).",
    )
    lora_dropout: float = setting(
        0.0, "model", "Dropout on each adapter's input, in [0, 1) (0: none)."
    )
    lora_target_modules: str | list[str] = setting(  # noqa: RUF009 (a str default)
        "all-linear",
        "model",
        "Layers that get adapters: all-linear (every linear layer but the output "
        "head) or module names, a list or comma-separated (q_proj,v_proj).",
    )
    lora_lr: float = setting(
        3e-3,
        "model",
        "AdamW learning rate of the adapters when lora_rank > 0, in place of lr "
        "(LoRA wants about 10x full fine-tuning's rate; the warm-up, which "
        "trains the full model, keeps sft_lr).",
    )
    # --- task ------------------------------------------------------------------
    task: str = setting(
        "reverse",
        "task",
        "Task name for grpo_lab.tasks.get_task (reverse, addition, countdown, "
        "gsm8k, math).",
    )
    # setting() returns a field with a default_factory: each config gets a copy.
    task_options: dict[str, Any] = setting(  # noqa: RUF009
        {"n_digits": 5},
        "task",
        'Keyword options for the task, as JSON: {"n_digits": 5} or '
        '{"train_path": "train.jsonl", "eval_path": "test.jsonl"}.',
    )
    chat_template: bool = setting(
        False,
        "task",
        "Wrap each prompt in the tokenizer's chat template as a user turn "
        "(instruct models); off: the task's plain prompt (base models).",
    )
    # --- batches and schedule --------------------------------------------------
    steps: int = setting(
        400, "batches and schedule", "GRPO steps (one rollout batch each)."
    )
    rollout_batch_size: int = setting(
        256,
        "batches and schedule",
        "Responses sampled per step: prompts per step times group_size.",
    )
    group_size: int = setting(
        8,
        "batches and schedule",
        "Responses sampled per prompt (G); advantages are normalized within a group.",
    )
    train_batch_size: int = setting(
        256,
        "batches and schedule",
        "Responses per optimizer step; smaller than rollout_batch_size is "
        "off-policy (every step after the first sees an older policy's samples).",
    )
    epochs_per_rollout_batch: int = setting(
        1,
        "batches and schedule",
        "Passes over each rollout batch; more than one is off-policy.",
    )
    gradient_accumulation_steps: int = setting(
        1,
        "batches and schedule",
        "Microbatches per optimizer step (train_batch_size / microbatch size); "
        "the gradient is the full batch's whatever the split.",
    )
    # --- optimizer -------------------------------------------------------------
    lr: float = setting(3e-4, "optimizer", "AdamW learning rate (after warm-up).")
    lr_warmup_steps: int = setting(
        0,
        "optimizer",
        "Steps over which the learning rate ramps linearly from lr / warm-up to "
        "lr: Adam's first updates move every weight by about lr whatever its "
        "gradient's noise.",
    )
    weight_decay: float = setting(0.0, "optimizer", "AdamW weight decay.")
    adam_beta2: float = setting(
        0.999,
        "optimizer",
        "AdamW beta2; lower values adapt faster to the noisy policy gradient.",
    )
    max_grad_norm: float | None = setting(
        1.0,
        "optimizer",
        "Clip the gradient to this L2 norm before each optimizer step "
        "(None: no clipping; must be > 0).",
    )
    # --- advantages and loss ---------------------------------------------------
    baseline: str = setting(
        "mean",
        "advantages and loss",
        "Group baseline: mean (GRPO), none (raw reward, RFT-like) or "
        "leave_one_out (the mean of the other G - 1 rewards, RLOO).",
        BASELINES,
    )
    advantage_normalizer: str = setting(
        "std",
        "advantages and loss",
        "Advantage scale: std (GRPO), none (Dr. GRPO, arXiv:2503.20783), mean "
        "(MaxRL, arXiv:2602.02710) or batch_std (the whole rollout batch's std, "
        "TRL's scale_rewards='batch').",
        ADVANTAGE_NORMALIZERS,
    )
    advantage_eps: float = setting(
        1e-6,
        "advantages and loss",
        "Added to the normalizer so a group with equal rewards does not divide by 0.",
    )
    nan_rewards: str = setting(
        "propagate",
        "advantages and loss",
        "A NaN reward (an unscorable response): propagate (the step refuses a "
        "non-finite loss) or ignore (left out of its group's statistics, "
        "advantage 0, as TRL does with None rewards).",
        NAN_REWARD_POLICIES,
    )
    importance_reweighting_method: str = setting(
        "none",
        "advantages and loss",
        "Objective: none (on-policy REINFORCE); noclip, grpo (PPO clip), gspo "
        "(sequence ratio, arXiv:2507.18071), cispo (clipped, detached weights, "
        "arXiv:2506.13585), sapo (soft gate, arXiv:2511.20347) or gmpo "
        "(geometric mean, arXiv:2507.20673) weigh by pi / pi_old and need an "
        "off-policy schedule.",
        REWEIGHTING_METHODS,
    )
    cliprange: float | None = setting(
        None,
        "advantages and loss",
        "Clip range eps (the lower one when cliprange_high is set) for grpo (0.2 "
        "is usual), gspo (3e-4 in its paper), cispo and gmpo (on log pi / pi_old: "
        "0.4 in its paper).",
    )
    cliprange_high: float | None = setting(
        None,
        "advantages and loss",
        "Upper clip range (DAPO's clip-higher, 0.28 in its paper, "
        "arXiv:2503.14476); None: the same as cliprange.",
    )
    ratio_cap: float | None = setting(
        None,
        "advantages and loss",
        "Dual clip for grpo and gspo: cap the unclipped ratio term at this value, "
        "above 1 + the upper clip range (INTELLECT-2, arXiv:2505.07291; TRL's "
        "delta); None: no cap.",
    )
    sapo_temperature_pos: float = setting(
        1.0,
        "advantages and loss",
        "SAPO gate temperature for tokens with a positive advantage.",
    )
    sapo_temperature_neg: float = setting(
        1.05,
        "advantages and loss",
        "SAPO gate temperature for tokens with a zero or negative advantage.",
    )
    loss_normalization: str = setting(
        "sequence",
        "advantages and loss",
        "Loss divisor: sequence (mean over each response, GRPO), constant "
        "(sum over tokens / normalization_constant, Dr. GRPO) or token (the mean "
        "over every response token of the train batch, DAPO).",
        LOSS_NORMALIZATIONS,
    )
    normalization_constant: int | None = setting(
        None,
        "advantages and loss",
        "Divisor of the constant loss normalization (tokens).",
    )
    kl_coef: float = setting(
        0.0,
        "advantages and loss",
        "beta of a per-token KL penalty to a frozen copy of the policy taken at "
        "step 0 (DeepSeekMath, arXiv:2402.03300; 0: no penalty, no reference "
        "model).",
    )
    kl_estimator: str = setting(
        "k3",
        "advantages and loss",
        "KL estimator per sampled token: k1 (log ratio), k2 (half its square) or "
        "k3 (r - 1 - log r, DeepSeekMath's).",
        KL_ESTIMATORS,
    )
    kl_importance_weighting: bool = setting(
        False,
        "advantages and loss",
        "Weigh each token's KL by pi / pi_old (TRL's use_bias_correction_kl, "
        "DeepSeek-V3.2, arXiv:2512.02556).",
    )
    entropy_coef: float = setting(
        0.0,
        "advantages and loss",
        "Entropy bonus: subtract this times each token's entropy (with its "
        "gradient) from the loss (0: none).",
    )
    top_entropy_quantile: float = setting(
        1.0,
        "advantages and loss",
        "Only tokens in this top fraction of each microbatch's entropies get the "
        "policy gradient (0.2 in arXiv:2506.01939; 1.0: every token).",
    )
    # --- sampling --------------------------------------------------------------
    temperature: float = setting(
        1.0,
        "sampling",
        "Sampling temperature for rollouts; scoring uses logits / temperature too.",
    )
    top_p: float = setting(
        1.0,
        "sampling",
        "Nucleus mass for rollouts in (0, 1] (1.0: the full distribution).",
    )
    max_new_tokens: int | None = setting(
        None,
        "sampling",
        "Longest response in tokens (None: the task's own max_new_tokens).",
    )
    backend: str = setting(
        "hf",
        "sampling",
        "Rollout backend: hf (generate on the policy), vllm (GPU engine) or "
        "mismatch (a deliberately perturbed sampler, see 'sampler mismatch').",
        BACKENDS,
    )
    rollout_max_batch_size: int | None = setting(
        None,
        "sampling",
        "Most sequences the hf backend generates at once (None: the whole batch).",
    )
    vllm_gpu_memory_utilization: float = setting(
        0.3, "sampling", "Fraction of GPU memory the vllm engine may take, in (0, 1]."
    )
    share_prompt_prefix: bool = setting(
        True,
        "sampling",
        "Run each prompt once per group, not once per response, when sampling "
        "(hf backend) and scoring (without gradient checkpointing).",
    )
    # --- sampler mismatch ------------------------------------------------------
    mismatch: str = setting(
        "none",
        "sampler mismatch",
        "Perturbation the mismatch backend samples from (needs backend mismatch): "
        "bf16 logits, top_p nucleus, temperature at sampling only, stale weights, "
        "or Gaussian logit noise; none samples the policy itself.",
        PERTURBATIONS,
    )
    mismatch_scale: float | None = setting(
        None,
        "sampler mismatch",
        "Size of the perturbation: top_p's nucleus mass, temperature's sampling "
        "temperature, noise's standard deviation (None: 0.9, 0.7, 0.5).",
    )
    mismatch_sync_every: int = setting(
        1,
        "sampler mismatch",
        "stale only: the sampler's weights are refreshed on every k-th sync (1: "
        "every step, no staleness).",
    )
    sampler_correction: str = setting(
        "none",
        "sampler mismatch",
        "Importance-sampling correction by pi_trainer / pi_sampler per token or "
        "per response (product of token ratios): token_/sequence_truncate "
        "(TIS: min(ratio, cap)) or token_/sequence_mask (MIS, IcePop: 0 outside "
        "[low, high]); TRL's vllm_importance_sampling_mode. none: no correction.",
        CORRECTION_MODES,
    )
    sampler_correction_cap: float = setting(
        DEFAULT_CAP,
        "sampler mismatch",
        "Truncate modes: the weight is min(ratio, cap), cap > 0 "
        "(TRL's vllm_importance_sampling_clip_max).",
    )
    sampler_correction_low: float = setting(
        DEFAULT_LOW,
        "sampler mismatch",
        "Mask modes: ratios below this get weight 0, >= 0 "
        "(TRL's vllm_importance_sampling_clip_min; 0: no lower bound).",
    )
    sampler_correction_high: float = setting(
        DEFAULT_HIGH,
        "sampler mismatch",
        "Mask modes: ratios above this get weight 0, > low "
        "(TRL's vllm_importance_sampling_clip_max).",
    )
    # --- evaluation and checkpoints ---------------------------------------------
    eval_every: int = setting(
        10,
        "evaluation and checkpoints",
        "Evaluate on held-out prompts every this many steps (0: never).",
    )
    eval_size: int = setting(
        200, "evaluation and checkpoints", "Held-out prompts per evaluation."
    )
    checkpoint_every: int = setting(
        25,
        "evaluation and checkpoints",
        "Save a checkpoint every this many steps (0: only at the end).",
    )
    keep_checkpoints: int = setting(
        2,
        "evaluation and checkpoints",
        "Checkpoints kept on disk, the newest ones; older ones are deleted once a "
        "new one loads back.",
    )
    report_to: str | list[str] = setting(  # noqa: RUF009 (a str default)
        "none",
        "evaluation and checkpoints",
        "Experiment trackers sent every metrics.jsonl line: none, or tensorboard, "
        "wandb, trackio, mlflow (a list or comma-separated); each is an extra: "
        "pip install 'grpo-lab[tensorboard]'.",
    )
    # --- warm-up ---------------------------------------------------------------
    sft_max_steps: int = setting(
        400,
        "warm-up",
        "Supervised warm-up: most optimizer steps (0 skips the warm-up).",
    )
    sft_target_accuracy: float = setting(
        0.25,
        "warm-up",
        "Supervised warm-up: stop once held-out accuracy reaches this.",
    )
    sft_eval_temperature: float = setting(
        1.0,
        "warm-up",
        "Supervised warm-up: temperature of that accuracy check (0: greedy decoding).",
    )
    sft_batch_size: int = setting(
        32, "warm-up", "Supervised warm-up: demonstrations per optimizer step."
    )
    sft_lr: float = setting(1e-3, "warm-up", "Supervised warm-up: AdamW learning rate.")
    sft_eval_every: int = setting(
        5, "warm-up", "Supervised warm-up: measure accuracy every this many steps."
    )
    sft_eval_size: int = setting(
        64, "warm-up", "Supervised warm-up: held-out prompts per accuracy check."
    )
    # --- device and memory -----------------------------------------------------
    device: str = setting(
        "cpu",
        "device and memory",
        'Torch device of the policy: "cpu", "cuda", "cuda:1".',
    )
    dtype: str = setting(
        "float32",
        "device and memory",
        "Parameter (and optimizer state) dtype; keep float32 for small learning "
        "rates: a bfloat16 weight cannot register an update smaller than about "
        "1/256 of itself.",
        DTYPES,
    )
    autocast_dtype: str | None = setting(
        None,
        "device and memory",
        "Compute dtype for forward and backward under torch.autocast (None: dtype).",
        (None, *DTYPES[1:]),
    )
    gradient_checkpointing: bool = setting(
        False,
        "device and memory",
        "Recompute activations in backward to save memory (real models).",
    )
    logits_chunk_size: int = setting(
        0,
        "device and memory",
        "Output-head chunk (positions) when scoring; 0 runs the model's forward.",
    )
    num_threads: int | None = setting(
        None,
        "device and memory",
        "Torch CPU threads (None: 1 for the tiny model, where more threads only "
        "contend, else torch's default).",
    )
    # --- dynamic sampling and length -------------------------------------------
    dynamic_sampling: bool = setting(
        False,
        "dynamic sampling and length",
        "Drop groups whose rewards are all equal (no signal) and sample more "
        "prompts until the rollout batch is full of groups with signal (DAPO, "
        "arXiv:2503.14476).",
    )
    dynamic_sampling_max_rounds: int = setting(
        10,
        "dynamic sampling and length",
        "Most sampling rounds per step with dynamic_sampling, the first included; "
        "when reached, the step tops the batch up with equal-reward groups.",
    )
    mask_truncated_completions: bool = setting(
        False,
        "dynamic sampling and length",
        "Responses cut at max_new_tokens (no EOS, no stop string) get response "
        "mask 0 and leave the loss (TRL's option of that name).",
    )
    overlong_buffer: int | None = setting(
        None,
        "dynamic sampling and length",
        "DAPO's soft overlong punishment: the last this many tokens before "
        "max_new_tokens lower the reward linearly to -overlong_penalty "
        "(None: no punishment).",
    )
    overlong_penalty: float = setting(
        1.0,
        "dynamic sampling and length",
        "Scale of the soft overlong punishment (>= 0; DAPO uses 1).",
    )

    def __post_init__(self) -> None:
        validate_config(self)

    @classmethod
    def for_profile(cls, profile: str, **overrides: Any) -> TrainConfig:
        """The ``profile`` defaults (cpu, gpu or smoke) with ``overrides`` applied."""
        if profile not in PROFILES:
            raise ValueError(f"profile must be one of {PROFILES}, got {profile!r}")
        _check_field_names(overrides)
        changes = PROFILE_CHANGES[profile]
        if "task" in overrides and "task_options" not in overrides:
            changes = {**changes, "task_options": {}}  # the profile's are its task's
        if profile == "cpu":
            changes = {**changes, **CPU_TASK_CHANGES.get(overrides.get("task"), {})}
        return cls(**{**changes, "profile": profile, **overrides})

    @property
    def prompts_per_step(self) -> int:
        """Distinct prompts per rollout batch: rollout_batch_size / group_size."""
        return self.rollout_batch_size // self.group_size

    @property
    def off_policy(self) -> bool:
        """True when some optimizer steps see responses from an older policy."""
        return (
            self.epochs_per_rollout_batch > 1
            or self.train_batch_size < self.rollout_batch_size
        )

    def lora_settings(self) -> LoraSettings | None:
        """The adapters' shape, or None for full fine-tuning (lora_rank 0)."""
        if self.lora_rank == 0:
            return None
        return LoraSettings(
            rank=self.lora_rank,
            alpha=self.lora_alpha,
            dropout=self.lora_dropout,
            target_modules=target_names(self.lora_target_modules),
        )

    @property
    def learning_rate(self) -> float:
        """The GRPO optimizer's rate: lora_lr with adapters, else lr."""
        return self.lora_lr if self.lora_rank > 0 else self.lr

    def update_settings(self) -> UpdateSettings:
        """How the update scores and reduces each microbatch."""
        return UpdateSettings(
            importance_reweighting_method=self.importance_reweighting_method,
            cliprange=self.cliprange,
            loss_normalization=self.loss_normalization,
            normalization_constant=self.normalization_constant,
            temperature=self.temperature,
            logits_chunk_size=self.logits_chunk_size,
            share_prompt_prefix=self.share_prompt_prefix,
            cliprange_high=self.cliprange_high,
            ratio_cap=self.ratio_cap,
            sapo_temperature_pos=self.sapo_temperature_pos,
            sapo_temperature_neg=self.sapo_temperature_neg,
            kl_coef=self.kl_coef,
            kl_estimator=self.kl_estimator,
            kl_importance_weighting=self.kl_importance_weighting,
            entropy_coef=self.entropy_coef,
            top_entropy_quantile=self.top_entropy_quantile,
            sampler_correction=self.sampler_correction,
            sampler_correction_cap=self.sampler_correction_cap,
            sampler_correction_low=self.sampler_correction_low,
            sampler_correction_high=self.sampler_correction_high,
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy of every field."""
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        """Every field, plus the settings that do nothing here (``config.json``)."""
        record = {**self.to_dict(), INERT_SETTINGS_KEY: inert_settings(self)}
        return json.dumps(record, indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        """The inverse of :meth:`to_dict` (and of a config.json); unknown keys
        raise ``ValueError``."""
        values = {k: v for k, v in values.items() if k != INERT_SETTINGS_KEY}
        _check_field_names(values)
        return cls(**values)


# The cpu profile is the dataclass defaults: a 0.5 M-parameter character model
# learns to reverse 5 digits on a laptop CPU, SFT until a quarter of sampled
# answers are right, then 400 GRPO steps. On two cores a run takes about 35 s,
# and held-out sampled accuracy climbs from ~0.3 to 0.94-0.99. lr 1e-3 collapses
# within a few steps (reward -> 0, no signal left).
CPU_CHANGES: dict[str, Any] = {}

# What the cpu profile changes for a task whose run is not reversal's, applied by
# for_profile("cpu", task=...) under the caller's overrides. calculator: each
# episode is two turns of up to 20 tokens around a 15-token tool reply, about
# six times reversal's sampling per response, so half the rollout batch, fewer
# steps and a warm-up checked less often.
CPU_TASK_CHANGES: dict[str, dict[str, Any]] = {
    "calculator": {
        "steps": 150,
        "rollout_batch_size": 128,
        "train_batch_size": 128,
        "lr": 5e-4,
        "eval_size": 100,
        "checkpoint_every": 50,
        "sft_eval_every": 10,
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
# Regret" GRPO recipe), so only the adapters carry gradients and AdamW moments;
# float16 autocast with a dynamic loss scale over float32 weights; hf rollouts
# on the policy itself (no vLLM copy), its chat template, gradient checkpointing
# and a chunked head; 8 prompts x 8 responses, two optimizer steps per rollout
# batch. Its memory is estimated by training_memory_bytes (about 3 GiB); its
# speed on a T4 has not been measured.
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
    "autocast_dtype": "float16",
}

PROFILE_CHANGES = {
    "cpu": CPU_CHANGES,
    "gpu": GPU_CHANGES,
    "small-gpu": SMALL_GPU_CHANGES,
    "smoke": SMOKE_CHANGES,
}

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
    but the output head, or the named ones): r x (in + out) per layer."""
    hidden, mlp, layers, heads, kv_heads, _ = KNOWN_ARCHITECTURES[config.model]
    shapes = qwen2_linear_shapes(hidden, mlp, layers, heads, kv_heads)
    targets = config.lora_settings().target_modules
    if targets != ALL_LINEAR:
        names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj")
        names += ("down_proj",)
        shapes = [s for s, n in zip(shapes, names * layers) if n in targets]
    return lora_parameter_count(shapes, config.lora_rank)


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


def field_help(name: str) -> str:
    """The help text stored with a field."""
    return _field(name).metadata["help"]


# --- validation: one door ---------------------------------------------------------


def validate_config(config: TrainConfig) -> None:
    """Refuse every setting, and every combination, that ``train`` cannot run.

    Each message names the setting, what it must be, and what it got. Settings
    the core also takes from direct callers are checked by the core's own
    validators, so both doors say the same thing.
    """
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


def _check_choices(config: TrainConfig) -> None:
    for config_field in dataclasses.fields(config):
        choices = config_field.metadata["choices"]
        value = getattr(config, config_field.name)
        if choices and value not in choices:
            raise ValueError(
                f"{config_field.name} must be one of {choices}, got {value!r}"
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


def _check_counts(config: TrainConfig) -> None:
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
    if config.eval_every and config.eval_size < 1:
        raise ValueError(
            f"eval_size must be positive when eval_every > 0 ({config.eval_every}), "
            f"got {config.eval_size!r}"
        )


def _check_batches(config: TrainConfig) -> None:
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


def _check_numbers(config: TrainConfig) -> None:
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
        config.baseline, config.advantage_normalizer, config.advantage_eps
    )


def _check_objective(config: TrainConfig) -> None:
    for name in ("cliprange", "cliprange_high", "normalization_constant"):
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


def _check_sampling(config: TrainConfig) -> None:
    check_temperature(config.temperature)  # scoring divides by it: > 0
    check_sampling_settings(config.temperature, config.top_p, config.max_new_tokens)
    check_temperature(
        config.sft_eval_temperature, name="sft_eval_temperature", allow_greedy=True
    )


def _check_dynamic_sampling_and_length(config: TrainConfig) -> None:
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


def _check_tool_task(config: TrainConfig) -> None:
    """A tool-using task: its options (turn limit included) and the hf backend.

    Its episodes are sampled by the multi-turn rollout
    (:mod:`grpo_lab.rollouts.multiturn`), which resumes the hf backend from token
    ids; dynamic sampling would rebuild the rollouts without their segments.
    """
    if not uses_tools(config.task):
        return
    get_task(config.task, **config.task_options)  # its options' own ValueErrors
    if config.backend != "hf":
        raise ValueError(
            f"backend must be 'hf' for the tool-using task {config.task!r} "
            f"(multi-turn rollouts resume the hf backend), got {config.backend!r}"
        )
    if config.dynamic_sampling:
        raise ValueError(
            f"dynamic_sampling must be False for the tool-using task {config.task!r}, "
            "got True"
        )


def _check_sampler_correction(config: TrainConfig) -> None:
    check_sampler_correction(
        config.sampler_correction,
        config.sampler_correction_cap,
        config.sampler_correction_low,
        config.sampler_correction_high,
    )
    if (
        config.sampler_correction != "none"
        and config.backend not in SAMPLER_LOG_PROB_BACKENDS
    ):
        raise ValueError(
            f"sampler_correction {config.sampler_correction!r} needs the sampler's "
            f"log-probs, but backend {config.backend!r} returns none; use a backend "
            f"in {SAMPLER_LOG_PROB_BACKENDS} or sampler_correction 'none'"
        )


def _check_device(config: TrainConfig) -> None:
    device = parse_device(config.device)
    if config.backend == "vllm" and device.type != "cuda":
        raise ValueError(
            f"backend 'vllm' needs a CUDA device, got device {config.device!r}; "
            "use backend 'hf' on this device"
        )


def _check_lora_and_precision(config: TrainConfig) -> None:
    check_lora_settings(
        config.lora_rank,
        config.lora_alpha,
        config.lora_dropout,
        config.lora_target_modules,
    )
    _check_range("lora_lr", config.lora_lr, low=0.0, low_open=True)
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


def _check_field_names(values: dict[str, Any]) -> None:
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(
            f"unknown TrainConfig field(s) {unknown}; expected some of {sorted(names)}"
        )


def _field(name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(TrainConfig) if f.name == name)


# --- settings that do nothing in a configuration ------------------------------------


def inert_settings(config: TrainConfig) -> dict[str, str]:
    """Each setting that has no effect in ``config``, and why (said once at start)."""
    notes: dict[str, str] = {}
    method = config.importance_reweighting_method
    if config.cliprange is not None and method not in CLIPPED_METHODS:
        notes["cliprange"] = f"importance_reweighting_method {method!r} does not clip"
    if (
        config.normalization_constant is not None
        and config.loss_normalization != "constant"
    ):
        notes["normalization_constant"] = (
            f"loss_normalization {config.loss_normalization!r} does not use it"
        )
    notes.update(_inert_family_settings(config))
    notes.update(_inert_sampler_bounds(config))
    if config.backend == "vllm" and config.rollout_max_batch_size is not None:
        notes["rollout_max_batch_size"] = "only the hf backend batches generation"
    sharing = _inert_prompt_sharing(config)
    if sharing:
        notes["share_prompt_prefix"] = sharing
    notes.update(_inert_length_settings(config))
    notes.update(_inert_lora_settings(config))
    return notes


def _inert_lora_settings(config: TrainConfig) -> dict[str, str]:
    """The LoRA options a full fine-tuning run (lora_rank 0) does not read."""
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    names = ("lora_alpha", "lora_dropout", "lora_target_modules", "lora_lr")
    if config.lora_rank > 0:
        return {}
    return {
        name: "lora_rank is 0: full fine-tuning, no adapters"
        for name in names
        if getattr(config, name) != defaults[name]
    }


def _inert_length_settings(config: TrainConfig) -> dict[str, str]:
    """The dynamic-sampling and overlong options this configuration does not read."""
    notes: dict[str, str] = {}
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    changed = {
        name for name, default in defaults.items() if getattr(config, name) != default
    }
    if not config.dynamic_sampling and "dynamic_sampling_max_rounds" in changed:
        notes["dynamic_sampling_max_rounds"] = "dynamic_sampling is off"
    if config.overlong_buffer is None and "overlong_penalty" in changed:
        notes["overlong_penalty"] = "overlong_buffer is None: no overlong punishment"
    return notes


def _inert_sampler_bounds(config: TrainConfig) -> dict[str, str]:
    """The sampler-correction bounds the chosen mode does not read."""
    mode = config.sampler_correction
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    used = {"cap"} if mode.endswith("_truncate") else {"low", "high"}
    if mode == "none":
        used = set()
    return {
        f"sampler_correction_{bound}": f"sampler_correction {mode!r} does not use it"
        for bound in ("cap", "low", "high")
        if bound not in used
        and getattr(config, f"sampler_correction_{bound}")
        != defaults[f"sampler_correction_{bound}"]
    }


def _inert_family_settings(config: TrainConfig) -> dict[str, str]:
    """The objective, KL and entropy options this configuration does not read."""
    notes: dict[str, str] = {}
    method = config.importance_reweighting_method
    if config.cliprange_high is not None and method not in CLIPPED_METHODS:
        notes["cliprange_high"] = (
            f"importance_reweighting_method {method!r} does not clip"
        )
    if config.ratio_cap is not None and method not in CAPPED_METHODS:
        notes["ratio_cap"] = f"importance_reweighting_method {method!r} has no cap"
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
        if method != "sapo" and getattr(config, name) != defaults[name]:
            notes[name] = f"importance_reweighting_method {method!r} is not sapo"
    if config.kl_coef == 0:
        for name in ("kl_estimator", "kl_importance_weighting"):
            if getattr(config, name) != defaults[name]:
                notes[name] = "kl_coef is 0: there is no KL penalty"
    return notes


def _inert_prompt_sharing(config: TrainConfig) -> str | None:
    if not config.share_prompt_prefix:
        return None
    vllm = config.backend == "vllm"
    checkpointing = config.gradient_checkpointing
    if vllm and checkpointing:
        return (
            "inert: vLLM samples (with its own prefix caching), and gradient "
            "checkpointing drops the cache that shared scoring needs"
        )
    if vllm:
        return "scoring only: vLLM samples, with its own prefix caching"
    if checkpointing:
        return (
            "sampling only: gradient checkpointing drops the cache that shared "
            "scoring needs"
        )
    return None


# --- the command line ----------------------------------------------------------------


def add_config_arguments(
    parser: argparse.ArgumentParser, exclude: tuple[str, ...] = ()
) -> None:
    """One ``--flag`` per TrainConfig field (underscores become dashes), grouped
    by section, with the field's help text and its choices.

    Every flag defaults to "not given", so the chosen profile's defaults apply
    unless a flag overrides them. ``--task-options`` takes JSON; an optional
    value is cleared with ``none``.
    """
    hints = typing.get_type_hints(TrainConfig)
    groups = {name: parser.add_argument_group(name) for name in SECTIONS}
    for config_field in dataclasses.fields(TrainConfig):
        if config_field.name in exclude:
            continue
        kind = hints[config_field.name]
        options: dict[str, Any] = {
            "dest": config_field.name,
            "default": argparse.SUPPRESS,
            "help": config_field.metadata["help"].replace("%", "%%"),
        }
        if kind is bool:
            options["action"] = argparse.BooleanOptionalAction
        else:
            options["type"] = _flag_parser(kind)
        choices = config_field.metadata["choices"]
        if choices:
            options["choices"] = choices
            options["metavar"] = "{" + ",".join(str(c).lower() for c in choices) + "}"
        elif kind is not bool:
            options["metavar"] = config_field.name.upper()
        flag = "--" + config_field.name.replace("_", "-")
        groups[config_field.metadata["section"]].add_argument(flag, **options)


def config_from_arguments(arguments: argparse.Namespace) -> TrainConfig:
    """The config a parsed command line asks for (profile defaults + flags)."""
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    given = {key: value for key, value in vars(arguments).items() if key in names}
    profile = given.pop("profile", None) or chosen_profile()
    return TrainConfig.for_profile(profile, **given)


def _flag_parser(kind: Any):
    """A string -> value converter for a field's type (``None`` spelled "none")."""
    if typing.get_origin(kind) is dict:
        return _json_object
    arguments = typing.get_args(kind)
    optional = typing.get_origin(kind) in (typing.Union, types.UnionType)
    base = next((a for a in arguments if a is not type(None)), kind)

    def parse(text: str):
        if optional and text.lower() == "none":
            return None
        return base(text)

    parse.__name__ = getattr(base, "__name__", "value")
    return parse


def _json_object(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value
