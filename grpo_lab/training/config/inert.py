"""Settings that do nothing in a configuration, each said once at the start."""

from __future__ import annotations

import dataclasses

from grpo_lab.losses import (
    CAPPED_METHODS,
    CLIPPED_METHODS,
    RATIO_METHODS,
    TRUNCATED_METHODS,
    option_readers,
)
from grpo_lab.rollouts import BACKEND_RECORDS
from grpo_lab.training.config.fields import TrainFields


def inert_settings(config: TrainFields) -> dict[str, str]:
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
    notes.update(_inert_backend_settings(config))
    sharing = _inert_prompt_sharing(config)
    if sharing:
        notes["share_prompt_prefix"] = sharing
    notes.update(_inert_length_settings(config))
    notes.update(_inert_async_settings(config))
    return notes


def _inert_async_settings(config: TrainFields) -> dict[str, str]:
    """The worker's settings a synchronous run (max_staleness 0) does not read."""
    if config.max_staleness > 0:
        return {}
    defaults = {f.name: f.default for f in dataclasses.fields(TrainFields)}
    names = ("async_admission", "weight_sync_every", "async_queue_size")
    return {
        name: "max_staleness is 0: the synchronous loop, no rollout worker"
        for name in names
        if getattr(config, name) != defaults[name]
    }


def _inert_backend_settings(config: TrainFields) -> dict[str, str]:
    """Set fields that only other rollout backends read (their records' fields)."""
    own = BACKEND_RECORDS[config.backend].fields
    readers: dict[str, list[str]] = {}
    for name, record in BACKEND_RECORDS.items():
        for field_name in record.fields:
            readers.setdefault(field_name, []).append(name)
    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    return {
        name: f"only the {' and '.join(backends)} backend reads it"
        for name, backends in readers.items()
        if name not in own and getattr(config, name) != defaults[name]
    }


def _inert_length_settings(config: TrainFields) -> dict[str, str]:
    """The dynamic-sampling and overlong options this configuration does not read."""
    notes: dict[str, str] = {}
    defaults = {f.name: f.default for f in dataclasses.fields(TrainFields)}
    changed = {
        name for name, default in defaults.items() if getattr(config, name) != default
    }
    if not config.dynamic_sampling and "dynamic_sampling_max_rounds" in changed:
        notes["dynamic_sampling_max_rounds"] = "dynamic_sampling is off"
    if config.overlong_buffer is None and "overlong_penalty" in changed:
        notes["overlong_penalty"] = "overlong_buffer is None: no overlong punishment"
    return notes


def _inert_sampler_bounds(config: TrainFields) -> dict[str, str]:
    """The sampler-correction bounds the chosen mode does not read."""
    mode = config.sampler_correction
    defaults = {f.name: f.default for f in dataclasses.fields(TrainFields)}
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


def _inert_family_settings(config: TrainFields) -> dict[str, str]:
    """The objective, KL and entropy options this configuration does not read."""
    notes: dict[str, str] = {}
    method = config.importance_reweighting_method
    if config.cliprange_high is not None and method not in CLIPPED_METHODS:
        notes["cliprange_high"] = (
            f"importance_reweighting_method {method!r} does not clip"
        )
    if config.ratio_cap is not None and method not in (
        CAPPED_METHODS | TRUNCATED_METHODS
    ):
        notes["ratio_cap"] = f"importance_reweighting_method {method!r} has no cap"
    defaults = {f.name: f.default for f in dataclasses.fields(TrainFields)}
    for name, readers in option_readers().items():
        if method not in readers and getattr(config, name) != defaults[name]:
            notes[name] = (
                f"importance_reweighting_method {method!r} is not "
                + " or ".join(readers)
            )
    if config.off_policy_mask_threshold is not None and method not in RATIO_METHODS:
        notes["off_policy_mask_threshold"] = (
            f"importance_reweighting_method {method!r} has no old policy: pi_old "
            "is pi, and every response is kept"
        )
    if config.kl_coef == 0:
        for name in ("kl_estimator", "kl_importance_weighting"):
            if getattr(config, name) != defaults[name]:
                notes[name] = "kl_coef is 0: there is no KL penalty"
    if config.distillation == "none":
        for name in (
            "distillation_estimator",
            "distillation_coef",
            "distillation_task_reward",
        ):
            if getattr(config, name) != defaults[name]:
                notes[name] = "distillation is 'none': there is no teacher"
    return notes


def _inert_prompt_sharing(config: TrainFields) -> str | None:
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
