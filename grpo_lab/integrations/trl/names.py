"""The translation table read backwards: TRL's GRPOConfig names in a grpo_lab
config file (``grpo-lab train --config FILE --from-trl``), and the hint a TRL
name gets where a grpo_lab field is expected.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from grpo_lab.errors import UserError
from grpo_lab.integrations.trl.translation import (
    FIX,
    TRANSLATIONS,
    TRL_EPSILON,
    optimizer_steps_per_grpo_step,
)
from grpo_lab.training.config import TrainConfig

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
    "off_policy_mask_threshold",
    "vespo_k_pos",
    "vespo_lambda_pos",
    "vespo_k_neg",
    "vespo_lambda_neg",
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
    "luspo": {
        "loss_normalization": "sequence",
        "importance_reweighting_method": "luspo",
    },
    "vespo": {"loss_normalization": "token", "importance_reweighting_method": "vespo"},
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
            # gspo, unless loss_type named luspo (in either order)
            fields.setdefault("importance_reweighting_method", "gspo")
        elif name in field_names and name not in trl_names:
            fields[name] = value
        elif name not in trl_names and name not in ("max_steps", "loss_type"):
            raise UserError(
                f"TRL's `{name}` has no grpo_lab counterpart",
                "the TRL names grpo_lab reads are those of the table in "
                "docs/scaling_out.md",
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
