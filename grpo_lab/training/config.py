"""Every setting of a training run, in one dataclass with two profiles.

``TrainConfig.for_profile("cpu")`` trains a 2-layer character model to reverse
5-digit strings on a laptop CPU in about a minute;
``TrainConfig.for_profile("gpu")`` trains Qwen2.5-Math-1.5B on GSM8K with vLLM
rollouts. Command-line flags (``grpo-lab train --lr 3e-4``) and notebook
overrides (``for_profile("cpu", lr=3e-4)``) write to the same fields.
Taught in ``notebooks/`` on the training loop.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import torch

PROFILES = ("cpu", "gpu")


@dataclass
class TrainConfig:
    """One GRPO run. Sizes count responses unless the name says prompts."""

    # Which defaults this run started from: "cpu" (tiny model) or "gpu" (real model).
    profile: str = "cpu"
    # "tiny" builds a Qwen2-shaped character model locally; else a hub name or path.
    model: str = "tiny"
    # Hidden size of the "tiny" model.
    tiny_hidden_size: int = 128
    # Decoder layers of the "tiny" model.
    tiny_num_layers: int = 2
    # MLP width of the "tiny" model.
    tiny_intermediate_size: int = 512
    # Task name for grpo_lab.tasks.get_task ("reverse", "addition", "gsm8k", ...).
    task: str = "reverse"
    # Keyword options for the task, e.g. {"n_digits": 5} or {"path": "train.jsonl"}.
    task_options: dict[str, Any] = field(default_factory=dict)
    # Seed of the model weights, the prompt draws and every sampler.
    seed: int = 0
    # Number of GRPO steps (one rollout batch each).
    steps: int = 400
    # Responses sampled per step: prompts per step times group_size.
    rollout_batch_size: int = 256
    # Responses sampled per prompt (G); advantages are normalized within a group.
    group_size: int = 8
    # Responses per optimizer step; smaller than rollout_batch_size is off-policy.
    train_batch_size: int = 256
    # Passes over each rollout batch; more than one is off-policy.
    epochs_per_rollout_batch: int = 1
    # Microbatches per optimizer step (train_batch_size / microbatch size).
    gradient_accumulation_steps: int = 1
    # AdamW learning rate (after warm-up).
    lr: float = 3e-4
    # Steps over which the learning rate ramps linearly from lr / warm-up to lr:
    # Adam's first updates move every weight by ~lr whatever its gradient's noise.
    lr_warmup_steps: int = 0
    # AdamW weight decay.
    weight_decay: float = 0.0
    # AdamW beta2; lower values adapt faster to the noisy policy gradient.
    adam_beta2: float = 0.999
    # Gradient-norm clip before each optimizer step (None: no clipping).
    max_grad_norm: float | None = 1.0
    # Group baseline: "mean" (GRPO) or "none" (raw reward, RFT-like).
    baseline: str = "mean"
    # Advantage scale: "std" (GRPO), "none" (Dr. GRPO) or "mean" (MaxRL).
    advantage_normalizer: str = "std"
    # Added to the normalizer so a group with equal rewards does not divide by 0.
    advantage_eps: float = 1e-6
    # Importance weighting: "none" (on-policy), "noclip", "grpo" or "gspo".
    importance_reweighting_method: str = "none"
    # PPO clip range for "grpo" and "gspo" (None: no clipping).
    cliprange: float | None = None
    # Loss divisor: "sequence" (mean over each response) or "constant" (Dr. GRPO).
    loss_normalization: str = "sequence"
    # Divisor of the "constant" loss normalization (tokens).
    normalization_constant: int | None = None
    # Sampling temperature for rollouts; scoring uses logits / temperature too.
    temperature: float = 1.0
    # Nucleus mass for rollouts (1.0: the full distribution).
    top_p: float = 1.0
    # Longest response in tokens (None: the task's own max_new_tokens).
    max_new_tokens: int | None = None
    # Evaluate on held-out prompts every this many steps (0: never).
    eval_every: int = 10
    # Held-out prompts per evaluation.
    eval_size: int = 200
    # Save a checkpoint every this many steps (0: only at the end).
    checkpoint_every: int = 25
    # Supervised warm-up: stop once held-out accuracy reaches this.
    sft_target_accuracy: float = 0.25
    # Supervised warm-up: temperature of that accuracy check (0: greedy decoding).
    sft_eval_temperature: float = 1.0
    # Supervised warm-up: most optimizer steps (0 skips the warm-up).
    sft_max_steps: int = 400
    # Supervised warm-up: demonstrations per optimizer step.
    sft_batch_size: int = 32
    # Supervised warm-up: AdamW learning rate.
    sft_lr: float = 1e-3
    # Supervised warm-up: measure sampled accuracy every this many steps.
    sft_eval_every: int = 5
    # Supervised warm-up: held-out prompts per accuracy check.
    sft_eval_size: int = 64
    # Where config.json, metrics.jsonl and checkpoints go (None: runs/<task>-<time>).
    run_dir: str | None = None
    # Continue from the latest checkpoint in run_dir instead of starting over.
    resume: bool = False
    # Rollout backend: "hf" (generate on the policy) or "vllm" (GPU engine).
    backend: str = "hf"
    # Most sequences the hf backend generates at once (None: the whole batch).
    rollout_max_batch_size: int | None = None
    # Fraction of GPU memory the vllm engine may take.
    vllm_gpu_memory_utilization: float = 0.3
    # Torch device of the policy: "cpu", "cuda", "cuda:1", "mps".
    device: str = "cpu"
    # Parameter (and optimizer state) dtype; keep float32 for small learning rates:
    # a bfloat16 weight cannot register an update smaller than ~1/256 of itself.
    dtype: str = "float32"
    # Compute dtype for forward and backward under torch.autocast (None: dtype).
    autocast_dtype: str | None = None
    # Recompute activations in backward to save memory (real models).
    gradient_checkpointing: bool = False
    # Output-head chunk (positions) when scoring; 0 runs the model's forward.
    logits_chunk_size: int = 0
    # Run each prompt once per group, not once per response, when sampling and scoring.
    share_prompt_prefix: bool = True

    def __post_init__(self) -> None:
        _validate(self)

    @classmethod
    def for_profile(cls, profile: str, **overrides: Any) -> TrainConfig:
        """The ``profile`` defaults ("cpu" or "gpu") with ``overrides`` applied."""
        if profile not in PROFILES:
            raise ValueError(f"profile must be one of {PROFILES}, got {profile!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise ValueError(
                f"unknown TrainConfig field(s) {unknown}; expected some of "
                f"{sorted(names)}"
            )
        defaults = CPU_DEFAULTS if profile == "cpu" else GPU_DEFAULTS
        return cls(**{**defaults, "profile": profile, **overrides})

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

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy of every field."""
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        """The fields as indented JSON (what ``config.json`` holds)."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        """The inverse of :meth:`to_dict`; unknown keys raise ``ValueError``."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"unknown TrainConfig field(s) {unknown}")
        return cls(**values)


# A 0.5 M-parameter character model learns to reverse 5 digits on a laptop CPU:
# SFT until a quarter of sampled answers are right, then 400 GRPO steps. On two
# cores a run takes about 35 s, and held-out sampled accuracy climbs from ~0.3 to
# 0.94-0.99 (first >= 0.9 between steps 160 and 250 for seeds 0-2).
CPU_DEFAULTS: dict[str, Any] = {
    "model": "tiny",
    "task": "reverse",
    "task_options": {"n_digits": 5},
    "steps": 400,
    "rollout_batch_size": 32 * 8,
    "group_size": 8,
    "train_batch_size": 32 * 8,
    "epochs_per_rollout_batch": 1,
    "gradient_accumulation_steps": 1,
    # 1e-3 collapses within a few steps (reward -> 0, no signal left), with a
    # fresh AdamW and with the warm-up's AdamW carried over alike.
    "lr": 3e-4,
    "temperature": 1.0,
    "top_p": 1.0,
    "max_new_tokens": 7,
    "eval_every": 10,
    "eval_size": 200,
    "checkpoint_every": 25,
    "sft_target_accuracy": 0.25,
    "sft_eval_temperature": 1.0,
    "sft_eval_every": 5,
    "sft_max_steps": 400,
    "backend": "hf",
    "device": "cpu",
    "dtype": "float32",
    "logits_chunk_size": 0,
}

# Qwen2.5-Math-1.5B on GSM8K (r1-zero prompt, stop at </answer>) on one GPU:
# 32 prompts x 8 responses per rollout batch, two optimizer steps per batch
# (off-policy, so the ratio is clipped), float32 master weights with bfloat16
# compute, a chunked output head.
GPU_DEFAULTS: dict[str, Any] = {
    "model": "Qwen/Qwen2.5-Math-1.5B",
    "task": "gsm8k",
    "task_options": {},
    "steps": 200,
    "rollout_batch_size": 256,
    "group_size": 8,
    "train_batch_size": 128,
    "epochs_per_rollout_batch": 1,
    "gradient_accumulation_steps": 64,
    "lr": 1e-6,
    "weight_decay": 0.0,
    "adam_beta2": 0.95,
    "max_grad_norm": 1.0,
    "importance_reweighting_method": "grpo",
    "cliprange": 0.2,
    "loss_normalization": "sequence",
    "temperature": 1.0,
    "top_p": 1.0,
    "max_new_tokens": 1024,
    "eval_every": 10,
    "eval_size": 512,
    "checkpoint_every": 50,
    "sft_max_steps": 0,
    "backend": "vllm",
    "vllm_gpu_memory_utilization": 0.3,
    "device": "cuda",
    "dtype": "float32",
    "autocast_dtype": "bfloat16",
    "gradient_checkpointing": True,
    "logits_chunk_size": 256,
}

_CHOICES = {
    "profile": PROFILES,
    "baseline": ("mean", "none"),
    "advantage_normalizer": ("std", "none", "mean"),
    "importance_reweighting_method": ("none", "noclip", "grpo", "gspo"),
    "loss_normalization": ("sequence", "constant"),
    "backend": ("hf", "vllm"),
    "dtype": ("float32", "bfloat16", "float16"),
    "autocast_dtype": (None, "bfloat16", "float16"),
}


def default_profile() -> str:
    """ "gpu" when CUDA is available, else "cpu"."""
    return "gpu" if torch.cuda.is_available() else "cpu"


def _validate(config: TrainConfig) -> None:
    for name, choices in _CHOICES.items():
        value = getattr(config, name)
        if value not in choices:
            raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    _check_sizes(config)
    if config.lr <= 0:
        raise ValueError(f"lr must be positive, got {config.lr!r}")
    if config.temperature <= 0:
        raise ValueError(f"temperature must be positive, got {config.temperature!r}")
    if config.off_policy and config.importance_reweighting_method == "none":
        raise ValueError(
            "importance_reweighting_method must be 'noclip', 'grpo' or 'gspo' when "
            "training is off-policy (epochs_per_rollout_batch > 1 or "
            "train_batch_size < rollout_batch_size), got 'none'"
        )
    if config.loss_normalization == "constant" and not config.normalization_constant:
        raise ValueError(
            "normalization_constant must be positive with constant loss "
            f"normalization, got {config.normalization_constant!r}"
        )


def _check_sizes(config: TrainConfig) -> None:
    positive = (
        "steps",
        "rollout_batch_size",
        "group_size",
        "train_batch_size",
        "epochs_per_rollout_batch",
        "gradient_accumulation_steps",
    )
    for name in positive:
        if getattr(config, name) < 1:
            raise ValueError(f"{name} must be positive, got {getattr(config, name)!r}")
    divides = (
        ("group_size", "rollout_batch_size"),
        ("group_size", "train_batch_size"),
        ("train_batch_size", "rollout_batch_size"),
        ("gradient_accumulation_steps", "train_batch_size"),
    )
    for small, large in divides:
        if getattr(config, large) % getattr(config, small):
            raise ValueError(
                f"{small} must divide {large} ({getattr(config, large)}), "
                f"got {getattr(config, small)}"
            )
    for name in (
        "eval_every",
        "eval_size",
        "checkpoint_every",
        "sft_max_steps",
        "lr_warmup_steps",
    ):
        if getattr(config, name) < 0:
            raise ValueError(f"{name} must be >= 0, got {getattr(config, name)!r}")


def add_config_arguments(
    parser: argparse.ArgumentParser, exclude: tuple[str, ...] = ()
) -> None:
    """One ``--flag`` per TrainConfig field (underscores become dashes).

    Every flag defaults to "not given", so the chosen profile's defaults apply
    unless a flag overrides them. ``--task-options`` takes JSON.
    """
    hints = typing.get_type_hints(TrainConfig)
    comments = _read_field_comments()
    for config_field in dataclasses.fields(TrainConfig):
        if config_field.name in exclude:
            continue
        flag = "--" + config_field.name.replace("_", "-")
        kind = hints[config_field.name]
        options: dict[str, Any] = {
            "dest": config_field.name,
            "default": argparse.SUPPRESS,
            "help": comments.get(config_field.name, ""),
        }
        if kind is bool:
            options["action"] = argparse.BooleanOptionalAction
        else:
            options["type"] = _flag_parser(kind)
            options["metavar"] = config_field.name.upper()
        if config_field.name in _CHOICES:
            options["choices"] = _CHOICES[config_field.name]
        parser.add_argument(flag, **options)


def config_from_arguments(arguments: argparse.Namespace) -> TrainConfig:
    """The config a parsed command line asks for (profile defaults + flags)."""
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    given = {key: value for key, value in vars(arguments).items() if key in names}
    profile = given.pop("profile", None) or default_profile()
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


def _read_field_comments() -> dict[str, str]:
    """Each field's comment line in this file, as its flag's help text."""
    comments: dict[str, str] = {}
    pending = ""
    for line in inspect.getsource(TrainConfig).splitlines():
        stripped = line.strip()
        if stripped.startswith("# "):
            pending = stripped[2:]
        elif ":" in stripped and pending and not stripped.startswith(("def", "@")):
            comments[stripped.split(":")[0]] = pending
            pending = ""
        else:
            pending = ""
    return {key: value.replace("%", "%%") for key, value in comments.items()}
