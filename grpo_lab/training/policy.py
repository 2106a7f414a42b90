"""The policy a run trains, and what goes with it: tokenizer, optimizer, sampler."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from grpo_lab.rollouts.base import RolloutBackend


@dataclass
class Policy:
    """The model being trained and everything that moves with it."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    optimizer: torch.optim.Optimizer
    backend: RolloutBackend
    # The frozen policy of step 0 that a KL penalty pulls towards (None: no KL,
    # or LoRA, whose reference is the base model with the adapters off).
    reference_model: PreTrainedModel | None = None
    # The frozen teacher that scores the samples in on-policy distillation
    # (None: no teacher).
    teacher_model: PreTrainedModel | None = None
    # The peft wrapper when the policy trains LoRA adapters (``model`` is the
    # transformers model inside it), else None.
    adapters: Any = None
    # float16 autocast's dynamic loss scale (torch.amp.GradScaler), else None.
    grad_scaler: torch.amp.GradScaler | None = None
