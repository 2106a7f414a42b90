"""Rollout backends: sample groups of responses from the policy.

``hf`` samples with the live model's ``generate`` (any device, exact policy
distribution); ``vllm`` serves a copy of the weights with vLLM on a GPU (or
its CPU build) and is imported only when asked for; ``mismatch`` samples from a
controlled perturbation of the policy, to study sampler/trainer mismatch on any
device.
Taught in ``notebooks/`` on rollouts.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo_lab.rollouts.base import RolloutBackend, Rollouts, SamplingSettings
from grpo_lab.rollouts.hf import HFRolloutBackend
from grpo_lab.rollouts.mismatch import MismatchRolloutBackend

BACKENDS = ("hf", "vllm", "mismatch")


def make_backend(
    name: str,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    model_name_or_path: str | None = None,
    **options: Any,
) -> RolloutBackend:
    """The rollout backend called ``name`` ("hf", "vllm" or "mismatch").

    ``hf`` wraps ``model`` and ``tokenizer`` (``options``: ``max_batch_size``).
    ``mismatch`` wraps them too (``options``: ``mismatch``, ``scale``,
    ``sync_every``; see ``MismatchRolloutBackend``).
    ``vllm`` loads ``model_name_or_path`` into a vLLM engine (``options`` go to
    ``VLLMRolloutBackend``) that encodes prompts with ``tokenizer``;
    ``sync(model)`` then copies the policy's weights in.
    """
    if name == "hf":
        return HFRolloutBackend(model, tokenizer, **options)
    if name == "mismatch":
        return MismatchRolloutBackend(model, tokenizer, **options)
    if name == "vllm":
        return _make_vllm_backend(model_name_or_path, tokenizer, **options)
    raise ValueError(f"name must be one of {BACKENDS}, got {name!r}")


def _make_vllm_backend(
    model_name_or_path: str | None,
    tokenizer: PreTrainedTokenizerBase,
    **options: Any,
):
    if model_name_or_path is None:
        raise ValueError(
            "model_name_or_path must name the checkpoint vLLM loads, got None"
        )
    try:
        from grpo_lab.rollouts.vllm import VLLMRolloutBackend
    except ImportError as error:
        raise RuntimeError(
            "The vllm backend needs vLLM: pip install 'grpo-lab[vllm]' "
            f"(import failed: {error}); or use backend='hf'"
        ) from error
    return VLLMRolloutBackend(model_name_or_path, tokenizer=tokenizer, **options)


__all__ = [
    "BACKENDS",
    "HFRolloutBackend",
    "MismatchRolloutBackend",
    "RolloutBackend",
    "Rollouts",
    "SamplingSettings",
    "make_backend",
]
