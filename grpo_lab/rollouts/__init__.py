"""Rollout backends: sample groups of responses from the policy.

``hf`` samples with the live model's ``generate`` (any device, exact policy
distribution); ``vllm`` serves a copy of the weights with vLLM on a GPU and is
imported only when asked for; ``mismatch`` samples from a controlled
perturbation of the policy, to study sampler/trainer mismatch on any device.
Taught in ``notebooks/`` on rollouts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo_lab.rollouts.base import RolloutBackend, Rollouts, SamplingSettings
from grpo_lab.rollouts.hf import HFRolloutBackend
from grpo_lab.rollouts.mismatch import MismatchRolloutBackend


@dataclass(frozen=True)
class BackendRecord:
    """Everything the rest of grpo_lab knows of one rollout backend.

    ``make(model, tokenizer, model_name_or_path, **options)`` builds it, and
    ``options(config)`` reads a run's settings (a ``TrainConfig``) into those
    options. ``fields`` are the run's settings only this backend reads (the
    config reports them as inert under any other). ``trl`` and ``verl`` are the
    engines' settings it becomes, or the sentence that refuses it there.
    """

    make: Callable[..., RolloutBackend]
    options: Callable[[Any], dict[str, Any]]
    # The run's settings that only this backend reads.
    fields: tuple[str, ...] = ()
    # Its Rollouts carry the sampler's own log-probs (a sampler correction needs them).
    sampler_log_probs: bool = True
    # It samples from the live policy itself, so its ratio to the policy is 1.
    samples_the_policy: bool = False
    # It loads its own copy of the weights: synced after each optimizer step.
    syncs: bool = False
    # It can run a tool-using task's multi-turn episodes.
    multi_turn: bool = True
    # GRPOConfig arguments in TRL, or why TRL cannot express it.
    trl: dict[str, Any] | str = ""
    # verl's rollout overrides, or why verl cannot express it.
    verl: dict[str, Any] | str = ""


def _make_vllm_backend(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    model_name_or_path: str | None = None,
    **options: Any,
) -> RolloutBackend:
    if model_name_or_path is None:
        raise ValueError(
            "model_name_or_path must name the checkpoint vLLM loads, got None"
        )
    if not torch.cuda.is_available():
        raise RuntimeError(
            "The vllm backend needs a CUDA GPU and none is visible; use backend='hf'"
        )
    try:
        from grpo_lab.rollouts.vllm import VLLMRolloutBackend
    except ImportError as error:
        raise RuntimeError(
            "The vllm backend needs vLLM: pip install 'grpo-lab[vllm]' "
            f"(import failed: {error}); or use backend='hf'"
        ) from error
    return VLLMRolloutBackend(model_name_or_path, **options)


def _without_path(backend: type[RolloutBackend]) -> Callable[..., RolloutBackend]:
    """A backend that wraps the live model: no checkpoint path to load."""

    def make(model, tokenizer, model_name_or_path=None, **options):
        return backend(model, tokenizer, **options)

    return make


BACKEND_RECORDS: dict[str, BackendRecord] = {
    "hf": BackendRecord(
        make=_without_path(HFRolloutBackend),
        options=lambda config: {
            "max_batch_size": config.rollout_max_batch_size,
            # auto samples as true does
            "share_prompt_prefix": bool(config.share_prompt_prefix),
        },
        fields=("rollout_max_batch_size",),
        samples_the_policy=True,
        trl={"use_vllm": False},
        verl={"actor_rollout_ref.rollout.name": "vllm"},
    ),
    "vllm": BackendRecord(
        make=_make_vllm_backend,
        options=lambda config: {
            "dtype": config.autocast_dtype or config.dtype,
            "gpu_memory_utilization": config.vllm_gpu_memory_utilization,
            "seed": config.seed,
        },
        fields=("vllm_gpu_memory_utilization",),
        syncs=True,
        # grpo_lab's vllm engine shares the policy's GPU.
        trl={"use_vllm": True, "vllm_mode": "colocate"},
        verl={"actor_rollout_ref.rollout.name": "vllm"},
    ),
    "mismatch": BackendRecord(
        make=_without_path(MismatchRolloutBackend),
        options=lambda config: {
            "mismatch": config.mismatch,
            "scale": config.mismatch_scale,
            "sync_every": config.mismatch_sync_every,
            "max_batch_size": config.rollout_max_batch_size,
        },
        fields=("rollout_max_batch_size", "mismatch_scale", "mismatch_sync_every"),
        multi_turn=False,
        trl="the mismatch backend is a teaching simulator of a sampler that is not "
        "the policy; TRL samples with transformers or vLLM: use hf or vllm",
        verl="the mismatch backend is grpo_lab's CPU simulator; verl samples with "
        "its own engine: use hf or vllm",
    ),
}
BACKENDS = tuple(BACKEND_RECORDS)


def make_backend(
    name: str,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    model_name_or_path: str | None = None,
    **options: Any,
) -> RolloutBackend:
    """The rollout backend called ``name`` (a key of ``BACKEND_RECORDS``).

    ``hf`` wraps ``model`` and ``tokenizer`` (``options``: ``max_batch_size``).
    ``mismatch`` wraps them too (``options``: ``mismatch``, ``scale``,
    ``sync_every``; see ``MismatchRolloutBackend``).
    ``vllm`` loads ``model_name_or_path`` into a vLLM engine (``options`` go to
    ``VLLMRolloutBackend``); ``sync(model)`` then copies the policy's weights in.
    """
    if name not in BACKEND_RECORDS:
        raise ValueError(f"name must be one of {tuple(BACKEND_RECORDS)}, got {name!r}")
    return BACKEND_RECORDS[name].make(model, tokenizer, model_name_or_path, **options)


def build_backend(
    config: Any, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
) -> RolloutBackend:
    """The backend a run's settings (a ``TrainConfig``) name, built from its
    record and, for a backend with its own copy of the weights, synced."""
    record = BACKEND_RECORDS[config.backend]
    backend = record.make(model, tokenizer, config.model, **record.options(config))
    if record.syncs:
        backend.sync(model)
    return backend


__all__ = [
    "BACKENDS",
    "BACKEND_RECORDS",
    "BackendRecord",
    "HFRolloutBackend",
    "MismatchRolloutBackend",
    "RolloutBackend",
    "Rollouts",
    "SamplingSettings",
    "build_backend",
    "make_backend",
]
