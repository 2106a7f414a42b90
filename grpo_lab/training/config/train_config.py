"""``TrainConfig``: the fields of a run, built from a profile, validated, saved.

The fields themselves, with their sections and help texts, are
:class:`~grpo_lab.training.config.fields.TrainFields`; building a
``TrainConfig`` validates them
(:func:`~grpo_lab.training.config.validation.validate_config`).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from grpo_lab.lora import ADAPTER_OPTIONS, LoraSettings, target_names
from grpo_lab.train_step import UpdateSettings
from grpo_lab.training.config.fields import (
    INERT_SETTINGS_KEY,
    PROFILES,
    TrainFields,
    check_field_names,
)
from grpo_lab.training.config.inert import inert_settings
from grpo_lab.training.config.profiles import CPU_TASK_CHANGES, profile_changes
from grpo_lab.training.config.validation import validate_config


class TrainConfig(TrainFields):
    """One GRPO run. Sizes count responses unless the name says prompts."""

    def __post_init__(self) -> None:
        validate_config(self)

    @classmethod
    def for_profile(cls, profile: str, **overrides: Any) -> TrainConfig:
        """The ``profile`` defaults (cpu, gpu or smoke) with ``overrides`` applied;
        ``lora_rank=0`` drops the profile's own adapter settings (``lora_lr``,
        ...), which full fine-tuning would refuse."""
        if profile not in PROFILES:
            raise ValueError(f"profile must be one of {PROFILES}, got {profile!r}")
        check_field_names(overrides)
        changes = profile_changes(profile)
        if "task" in overrides and "task_options" not in overrides:
            changes = {**changes, "task_options": {}}  # the profile's are its task's
        if profile == "cpu":
            changes = {**changes, **CPU_TASK_CHANGES.get(overrides.get("task"), {})}
        if overrides.get("lora_rank") == 0:  # the profile's adapter settings go too
            changes = {k: v for k, v in changes.items() if k not in ADAPTER_OPTIONS}
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
            train_norms=self.lora_train_norms,
        )

    @property
    def learning_rate(self) -> float:
        """The GRPO optimizer's rate: lora_lr with adapters, else lr."""
        return self.lora_lr if self.lora_rank > 0 else self.lr

    def update_settings(self) -> UpdateSettings:
        """How the update scores and reduces each microbatch: every
        ``UpdateSettings`` field, read from the config field of the same name
        (checked once, as the object is built)."""
        names = [field.name for field in dataclasses.fields(UpdateSettings)]
        return UpdateSettings(**{name: getattr(self, name) for name in names})

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
        check_field_names(values)
        return cls(**values)
