"""One GRPO optimizer step: score, weight, accumulate, guard, step.

Taught in ``notebooks/07_training_step.ipynb``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from transformers import PreTrainedTokenizerBase

from grpo_lab.advantages import (
    compute_group_normalized_rewards,
    compute_rollout_rewards,
)
from grpo_lab.logprobs import get_response_log_probs
from grpo_lab.losses import (
    LOSS_NORMALIZATIONS,
    aggregate_loss_across_microbatch,
    compute_policy_gradient_loss,
)
from grpo_lab.masks import tokenize_prompt_and_output

_COUNT_KEYS = ("clip_count", "clip_total", "importance_ratio_count")


def grpo_train_step(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    optimizer: torch.optim.Optimizer,
    gradient_accumulation_steps: int,
    max_grad_norm: float | None,
    reward_fn: Callable[[str, str], dict[str, float]],
    repeated_prompts: list[str],
    rollout_responses: list[str],
    repeated_ground_truths: list[str],
    group_size: int,
    baseline: Literal["mean", "none"] = "mean",
    advantage_eps: float = 1e-6,
    advantage_normalizer: Literal["std", "none", "mean"] = "std",
    importance_reweighting_method: Literal["none", "noclip", "grpo", "gspo"] = "none",
    old_log_probs: torch.Tensor | None = None,
    cliprange: float | None = None,
    loss_normalization: Literal["sequence", "constant"] = "sequence",
    normalization_constant: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
    """Rewards -> group advantages -> tokens -> :func:`policy_gradient_update`."""
    batch_size = len(rollout_responses)
    if batch_size == 0:
        raise ValueError("rollout_responses must not be empty")
    if len(repeated_prompts) != batch_size or len(repeated_ground_truths) != batch_size:
        raise ValueError(
            "repeated_prompts, rollout_responses and repeated_ground_truths must have "
            f"the same length, got {len(repeated_prompts)}, {batch_size} and "
            f"{len(repeated_ground_truths)}"
        )
    if group_size <= 0 or batch_size % group_size != 0:
        raise ValueError(
            f"group_size must be positive and divide the batch size {batch_size}, "
            f"got {group_size}"
        )
    _check_update_settings(
        gradient_accumulation_steps,
        batch_size,
        loss_normalization,
        normalization_constant,
    )
    raw_rewards, reward_metadata = compute_rollout_rewards(
        reward_fn, rollout_responses, repeated_ground_truths
    )
    advantages, advantage_metadata = compute_group_normalized_rewards(
        raw_rewards, group_size, baseline, advantage_eps, advantage_normalizer
    )
    batch = tokenize_prompt_and_output(repeated_prompts, rollout_responses, tokenizer)
    loss, update_metadata = policy_gradient_update(
        model,
        optimizer,
        gradient_accumulation_steps,
        max_grad_norm,
        batch,
        advantages,
        importance_reweighting_method=importance_reweighting_method,
        old_log_probs=old_log_probs,
        cliprange=cliprange,
        loss_normalization=loss_normalization,
        normalization_constant=normalization_constant,
    )
    return loss, {**reward_metadata, **advantage_metadata, **update_metadata}


def _check_update_settings(
    gradient_accumulation_steps, batch_size, loss_normalization, normalization_constant
):
    if not 1 <= gradient_accumulation_steps <= batch_size:
        raise ValueError(
            f"gradient_accumulation_steps must be between 1 and the batch size "
            f"{batch_size}, got {gradient_accumulation_steps}"
        )
    if loss_normalization not in LOSS_NORMALIZATIONS:
        raise ValueError(
            f"loss_normalization must be one of {LOSS_NORMALIZATIONS}, "
            f"got {loss_normalization!r}"
        )
    if loss_normalization == "constant" and (
        normalization_constant is None or normalization_constant <= 0
    ):
        raise ValueError(
            "normalization_constant must be positive for constant normalization, "
            f"got {normalization_constant!r}"
        )


def policy_gradient_update(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    gradient_accumulation_steps: int,
    max_grad_norm: float | None,
    batch: dict[str, torch.Tensor],
    advantages: torch.Tensor,
    importance_reweighting_method: Literal["none", "noclip", "grpo", "gspo"] = "none",
    old_log_probs: torch.Tensor | None = None,
    cliprange: float | None = None,
    loss_normalization: Literal["sequence", "constant"] = "sequence",
    normalization_constant: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
    """One optimizer step on a tokenized batch with precomputed advantages.

    ``batch`` holds ``input_ids``, ``labels`` and ``response_mask``, each (B, T).
    Responses with zero advantage are not scored (their gradient is exactly zero)
    but still count in the divisor. Raises before ``optimizer.step`` if a loss,
    diagnostic or gradient norm is non-finite.
    """
    batch_size = advantages.shape[0]
    _check_update_settings(
        gradient_accumulation_steps,
        batch_size,
        loss_normalization,
        normalization_constant,
    )
    device = next(model.parameters()).device
    optimizer.zero_grad(set_to_none=True)
    active_indices = torch.nonzero(advantages != 0, as_tuple=False).flatten()
    if active_indices.numel() == 0:
        return _skipped_step(importance_reweighting_method, device)
    active = {
        key: value.index_select(0, active_indices) for key, value in batch.items()
    }
    active["advantages"] = advantages.index_select(0, active_indices)
    if old_log_probs is not None:
        if old_log_probs.ndim != 2 or old_log_probs.shape[0] != batch_size:
            raise ValueError(
                "old_log_probs must have shape (batch_size, sequence_length) with "
                f"batch_size {batch_size}, got {tuple(old_log_probs.shape)}"
            )
        active["old_log_probs"] = old_log_probs.index_select(
            0, active_indices.to(old_log_probs.device)
        )
    # Keep the configured microbatch size; fewer active rows mean fewer microbatches.
    microbatch_size = -(-batch_size // gradient_accumulation_steps)
    accumulator = _DiagnosticAccumulator(device)
    for rows in torch.arange(active_indices.numel()).split(microbatch_size):
        microbatch = {key: value[rows].to(device) for key, value in active.items()}
        scale = rows.numel() / batch_size if loss_normalization == "sequence" else 1.0
        _backward_microbatch(
            model,
            microbatch,
            scale,
            accumulator,
            importance_reweighting_method,
            cliprange,
            loss_normalization,
            normalization_constant,
        )
    gradient_norm = _checked_gradient_norm(model, max_grad_norm, device)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    metadata = accumulator.summary()
    metadata.update(
        gradient_norm=gradient_norm.detach(),
        optimizer_step=1.0,
        active_response_count=float(active_indices.numel()),
    )
    return metadata["loss"], metadata


def _backward_microbatch(
    model,
    microbatch,
    scale,
    accumulator,
    method,
    cliprange,
    loss_normalization,
    normalization_constant,
):
    scored = get_response_log_probs(
        model, microbatch["input_ids"], microbatch["labels"], return_token_entropy=True
    )
    mask = microbatch["response_mask"]  # (b, T)
    per_token_loss, loss_metadata = compute_policy_gradient_loss(
        microbatch["advantages"],
        scored["log_probs"],
        method,
        microbatch.get("old_log_probs"),
        cliprange,
        mask,
    )
    loss = (
        aggregate_loss_across_microbatch(
            per_token_loss, mask, loss_normalization, normalization_constant
        )
        * scale
    )
    if not torch.isfinite(loss):
        raise RuntimeError("Non-finite GRPO loss; optimizer step aborted")
    entropy_sum = (scored["token_entropy"] * mask).sum().detach()
    if not torch.isfinite(entropy_sum):
        raise RuntimeError("Non-finite token entropy; optimizer step aborted")
    # Clipping can hide an overflowing ratio in the loss while backward still
    # produces NaNs, so check the reduced diagnostics too.
    for key, value in loss_metadata.items():
        if key.endswith("_mean") and not torch.isfinite(value):
            raise RuntimeError(f"Non-finite {key}; optimizer step aborted")
    loss.backward()
    accumulator.add(loss.detach(), entropy_sum, mask.sum().detach(), loss_metadata)


class _DiagnosticAccumulator:
    """Weights each microbatch's means by its token (or ratio) count."""

    def __init__(self, device: torch.device):
        zero = torch.zeros((), dtype=torch.float32, device=device)
        self.loss, self.entropy_sum = zero, zero.clone()
        self.token_count = torch.zeros((), dtype=torch.long, device=device)
        self.sums: dict[str, torch.Tensor] = {}
        self.weights: dict[str, torch.Tensor] = {}
        self.counts: dict[str, torch.Tensor] = {}

    def add(self, loss, entropy_sum, token_count, loss_metadata):
        self.loss = self.loss + loss
        self.entropy_sum = self.entropy_sum + entropy_sum
        self.token_count = self.token_count + token_count
        for key, value in loss_metadata.items():
            if key in _COUNT_KEYS:
                self.counts[key] = self.counts.get(key, torch.zeros_like(value)) + value
            elif key.endswith("_mean"):
                weight = (
                    loss_metadata["importance_ratio_count"]
                    if "importance_ratio" in key
                    else token_count
                )
                self.sums[key] = (
                    self.sums.get(key, torch.zeros_like(value)) + value * weight
                )
                self.weights[key] = (
                    self.weights.get(key, torch.zeros_like(weight)) + weight
                )

    def summary(self) -> dict[str, torch.Tensor | float]:
        metadata: dict[str, torch.Tensor | float] = {
            key: value / self.weights[key].clamp_min(1)
            for key, value in self.sums.items()
        }
        metadata.update(self.counts)
        if "clip_total" in self.counts:
            metadata["clip_fraction"] = self.counts["clip_count"] / self.counts[
                "clip_total"
            ].clamp_min(1)
        metadata.update(
            loss=self.loss.detach(),
            token_entropy=(self.entropy_sum / self.token_count.clamp_min(1)).detach(),
            response_token_count=self.token_count.detach(),
            entropy_count=self.token_count.detach(),
        )
        return metadata


def _checked_gradient_norm(model, max_grad_norm, device) -> torch.Tensor:
    if max_grad_norm is not None:
        return torch.nn.utils.clip_grad_norm_(
            model.parameters(), max_grad_norm, error_if_nonfinite=True
        )
    norms = [p.grad.detach().norm(2) for p in model.parameters() if p.grad is not None]
    gradient_norm = (
        torch.stack(norms).norm(2) if norms else torch.zeros((), device=device)
    )
    if not torch.isfinite(gradient_norm):
        raise RuntimeError("Non-finite gradient norm; optimizer step aborted")
    return gradient_norm


def _skipped_step(
    method, device
) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
    """Every advantage is zero: no scoring, no optimizer step."""
    zero = torch.zeros((), dtype=torch.float32, device=device)
    loss_key = "on_policy_loss_mean" if method == "none" else "off_policy_loss_mean"
    metadata: dict[str, torch.Tensor | float] = {
        loss_key: zero.clone(),
        "loss": zero,
        "gradient_norm": zero.clone(),
        "token_entropy": zero.clone(),
        "response_token_count": torch.zeros((), dtype=torch.long, device=device),
        "entropy_count": zero.clone(),
        "optimizer_step": 0.0,
        "active_response_count": 0.0,
    }
    if method != "none":
        metadata.update(
            importance_ratio_mean=zero.clone(), importance_ratio_count=zero.clone()
        )
    if method in {"grpo", "gspo"}:
        metadata.update(
            clip_count=zero.clone(), clip_total=zero.clone(), clip_fraction=zero.clone()
        )
    return zero, metadata
