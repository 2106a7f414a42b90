"""Per-token policy-gradient losses (REINFORCE, PPO/GRPO clip, GSPO) and aggregation.

Taught in ``notebooks/04_policy_gradient_and_clipping.ipynb``,
``notebooks/05_gspo.ipynb`` and ``notebooks/06_loss_aggregation.ipynb``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

LossAndDiagnostics = tuple[torch.Tensor, dict[str, torch.Tensor]]


@dataclass(frozen=True)
class ObjectiveOptions:
    """The knobs an objective reads besides its tensors (one door: validated here)."""

    # PPO clip range eps: the ratio is clipped to [1 - eps, 1 + eps].
    cliprange: float | None = None


Objective = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, ObjectiveOptions],
    LossAndDiagnostics,
]


def compute_policy_gradient_loss(
    raw_rewards_or_advantages: torch.Tensor,
    policy_log_probs: torch.Tensor,
    importance_reweighting_method: Literal["none", "noclip", "grpo", "gspo"] = "none",
    old_log_probs: torch.Tensor | None = None,
    cliprange: float | None = None,
    response_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss (B, T) to minimise, and detached diagnostics.

    none:   -A * log pi                      (on-policy REINFORCE)
    noclip: -A * w,  w = exp(log pi - log pi_old)   (per-token importance weight)
    grpo:   -min(A * w, A * clip(w, 1 - eps, 1 + eps))   (PPO's clipped objective)
    gspo:   the grpo formula with one ratio per response,
            s = exp(mean over response tokens of log w), repeated on every token.

    A is (B,) or (B, 1); eps is ``cliprange``; old log-probs get no gradient.
    Each method is one entry of ``OBJECTIVES`` (name -> function).
    Diagnostics are means over ``response_mask`` tokens (every token when the mask
    is None). ``clip_count`` counts only the clips that remove a gradient: A > 0
    with ratio > 1 + eps, or A < 0 with ratio < 1 - eps; elsewhere min() keeps the
    unclipped term. Half-precision log-probs are computed in float32, because
    bfloat16 cannot represent GSPO's 1 +/- 3e-4 bounds.
    """
    _check_loss_shapes(raw_rewards_or_advantages, policy_log_probs, response_mask)
    check_objective_settings(importance_reweighting_method, cliprange)
    _check_objective_tensors(
        importance_reweighting_method, policy_log_probs, old_log_probs, response_mask
    )
    if policy_log_probs.dtype in {torch.float16, torch.bfloat16}:
        policy_log_probs = policy_log_probs.float()
    advantages = raw_rewards_or_advantages
    if advantages.ndim == 1:
        advantages = advantages.unsqueeze(-1)  # (B, 1)
    token_mask = (
        response_mask.bool()
        if response_mask is not None
        else torch.ones_like(policy_log_probs, dtype=torch.bool)
    )  # (B, T)
    objective = OBJECTIVES[importance_reweighting_method]
    options = ObjectiveOptions(cliprange=cliprange)
    return objective(advantages, policy_log_probs, old_log_probs, token_mask, options)


def _token_mean(values: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
    """Detached mean of values over masked-in tokens (0 when there are none)."""
    count = token_mask.sum().detach()
    return values.detach().masked_fill(~token_mask, 0.0).sum() / count.clamp_min(1)


def _log_ratio(
    policy_log_probs: torch.Tensor, old_log_probs: torch.Tensor
) -> torch.Tensor:
    """log pi - log pi_old, with no gradient through the old policy. (B, T)"""
    return policy_log_probs - old_log_probs.detach()


def _reinforce_loss(
    advantages: torch.Tensor,
    policy_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor | None,
    token_mask: torch.Tensor,
    options: ObjectiveOptions,
) -> LossAndDiagnostics:
    per_token_loss = -advantages * policy_log_probs  # (B, T)
    return per_token_loss, {
        "on_policy_loss_mean": _token_mean(per_token_loss, token_mask)
    }


def _noclip_loss(
    advantages: torch.Tensor,
    policy_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    token_mask: torch.Tensor,
    options: ObjectiveOptions,
) -> LossAndDiagnostics:
    weights = torch.exp(_log_ratio(policy_log_probs, old_log_probs))  # (B, T)
    per_token_loss = -advantages * weights  # (B, T)
    return per_token_loss, {
        "importance_ratio_mean": _token_mean(weights, token_mask),
        "importance_ratio_count": token_mask.sum().detach(),
        "off_policy_loss_mean": _token_mean(per_token_loss, token_mask),
    }


def _clip_removes_gradient(
    advantages: torch.Tensor, ratio: torch.Tensor, cliprange: float
) -> torch.Tensor:
    # A clip only matters when it removes the gradient: A > 0 above 1 + eps,
    # or A < 0 below 1 - eps. Elsewhere min() keeps the unclipped term.
    return ((advantages > 0) & (ratio > 1 + cliprange)) | (
        (advantages < 0) & (ratio < 1 - cliprange)
    )


def _grpo_clip_loss(
    advantages: torch.Tensor,
    policy_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    token_mask: torch.Tensor,
    options: ObjectiveOptions,
) -> LossAndDiagnostics:
    cliprange = options.cliprange
    ratio = torch.exp(_log_ratio(policy_log_probs, old_log_probs))  # (B, T)
    clipped_ratio = torch.clamp(ratio, min=1 - cliprange, max=1 + cliprange)  # (B, T)
    per_token_loss = -torch.minimum(advantages * ratio, advantages * clipped_ratio)
    token_count = token_mask.sum().detach()
    clip_count = (
        token_mask & _clip_removes_gradient(advantages, ratio, cliprange)
    ).sum()
    return per_token_loss, {
        "clip_fraction": (clip_count / token_count.clamp_min(1)).detach(),
        "clip_count": clip_count.detach(),
        "clip_total": token_count,
        "importance_ratio_mean": _token_mean(ratio, token_mask),
        "importance_ratio_count": token_count,
        "off_policy_loss_mean": _token_mean(per_token_loss, token_mask),
    }


def _gspo_clip_loss(
    advantages: torch.Tensor,
    policy_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    token_mask: torch.Tensor,
    options: ObjectiveOptions,
) -> LossAndDiagnostics:
    cliprange = options.cliprange
    log_ratio = _log_ratio(policy_log_probs, old_log_probs)  # (B, T)
    lengths = token_mask.sum(dim=1, keepdim=True)  # (B, 1)
    mean_log_ratio = log_ratio.masked_fill(~token_mask, 0.0).sum(
        dim=1, keepdim=True
    ) / lengths.clamp_min(1)  # (B, 1)
    ratio = torch.exp(mean_log_ratio)  # (B, 1): geometric mean of token ratios
    clipped_ratio = torch.clamp(ratio, min=1 - cliprange, max=1 + cliprange)  # (B, 1)
    sequence_loss = -torch.minimum(advantages * ratio, advantages * clipped_ratio)
    # Sequence aggregation averages these repeated values: no second length divide.
    per_token_loss = sequence_loss.expand_as(log_ratio)  # (B, T)
    valid = lengths > 0  # (B, 1): responses with at least one token
    sequence_count = valid.sum()
    clip_count = (_clip_removes_gradient(advantages, ratio, cliprange) & valid).sum()

    def sequence_mean(values: torch.Tensor) -> torch.Tensor:
        masked = values.detach().masked_fill(~valid, 0.0)
        return masked.sum() / sequence_count.clamp_min(1)

    return per_token_loss, {
        "importance_ratio_mean": sequence_mean(ratio),
        "clipped_importance_ratio_mean": sequence_mean(clipped_ratio),
        "importance_ratio_count": sequence_count.detach(),
        "clip_fraction": (clip_count / sequence_count.clamp_min(1)).detach(),
        "clip_count": clip_count.detach(),
        "clip_total": sequence_count.detach(),
        "off_policy_loss_mean": _token_mean(per_token_loss, token_mask),
    }


# Every objective, by name: one signature, (A (B, 1), log pi (B, T),
# log pi_old (B, T) or None, token mask (B, T), options) -> (loss (B, T), diagnostics).
OBJECTIVES: dict[str, Objective] = {
    "none": _reinforce_loss,
    "noclip": _noclip_loss,
    "grpo": _grpo_clip_loss,
    "gspo": _gspo_clip_loss,
}
REWEIGHTING_METHODS = tuple(OBJECTIVES)
# Methods that weigh by pi / pi_old, and those that also clip that ratio.
RATIO_METHODS = frozenset({"noclip", "grpo", "gspo"})
CLIPPED_METHODS = frozenset({"grpo", "gspo"})
LOSS_NORMALIZATIONS = ("sequence", "constant")


def check_objective_settings(method: str, cliprange: float | None) -> None:
    """The one check of an objective's name and clip range (config and callers)."""
    if method not in REWEIGHTING_METHODS:
        raise ValueError(
            f"importance_reweighting_method must be one of {REWEIGHTING_METHODS}, "
            f"got {method!r}"
        )
    if method in CLIPPED_METHODS and not _is_positive_number(
        cliprange, allow_infinity=True
    ):
        raise ValueError(
            f"cliprange must be positive for {method!r}, got {cliprange!r}"
        )


def check_loss_normalization(
    loss_normalization: str, normalization_constant: float | None
) -> None:
    """The one check of a loss normalization and its constant."""
    if loss_normalization not in LOSS_NORMALIZATIONS:
        raise ValueError(
            f"loss_normalization must be one of {LOSS_NORMALIZATIONS}, "
            f"got {loss_normalization!r}"
        )
    if loss_normalization == "constant" and not _is_positive_number(
        normalization_constant
    ):
        raise ValueError(
            "normalization_constant must be positive for constant normalization, "
            f"got {normalization_constant!r}"
        )


def _is_positive_number(value: object, allow_infinity: bool = False) -> bool:
    """A number > 0 (not a bool, not NaN; infinite only if allowed: an infinite
    clip range means no clipping, an infinite divisor means no loss)."""
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and (math.isfinite(value) or (allow_infinity and value == math.inf))
        and value > 0
    )


def microbatch_loss_scale(
    loss_normalization: str, microbatch_rows: int, batch_rows: int
) -> float:
    """What one microbatch's aggregated loss is multiplied by before backward.

    sequence: a mean over b rows, weighted b / B, sums over microbatches to the
              mean over all B rows;
    constant: each microbatch already divides by the same constant: weight 1.
    Either way the accumulated gradient equals the full batch's.
    Taught in ``notebooks/07_training_step.ipynb``.
    """
    if loss_normalization == "sequence":
        return microbatch_rows / batch_rows
    return 1.0


def _check_loss_shapes(
    advantages: torch.Tensor,
    policy_log_probs: torch.Tensor,
    response_mask: torch.Tensor | None,
) -> None:
    if policy_log_probs.ndim != 2:
        raise ValueError(
            "policy_log_probs must have shape (batch_size, sequence_length), got "
            f"{tuple(policy_log_probs.shape)}"
        )
    if response_mask is not None and response_mask.shape != policy_log_probs.shape:
        raise ValueError(
            f"response_mask must have shape {tuple(policy_log_probs.shape)} like "
            f"policy_log_probs, got {tuple(response_mask.shape)}"
        )
    if not (
        advantages.ndim == 1 or (advantages.ndim == 2 and advantages.shape[1] == 1)
    ):
        raise ValueError(
            "raw_rewards_or_advantages must have shape (batch_size,) or "
            f"(batch_size, 1), got {tuple(advantages.shape)}"
        )
    if advantages.shape[0] != policy_log_probs.shape[0]:
        raise ValueError(
            f"raw_rewards_or_advantages must have batch size "
            f"{policy_log_probs.shape[0]} like policy_log_probs, "
            f"got {advantages.shape[0]}"
        )


def _check_objective_tensors(
    method: str,
    policy_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor | None,
    response_mask: torch.Tensor | None,
) -> None:
    if method not in RATIO_METHODS:
        return
    if old_log_probs is None:
        raise ValueError(
            f"old_log_probs must be a tensor for {method!r} reweighting, got None"
        )
    if old_log_probs.shape != policy_log_probs.shape:
        raise ValueError(
            f"old_log_probs must have shape {tuple(policy_log_probs.shape)} like "
            f"policy_log_probs, got {tuple(old_log_probs.shape)}"
        )
    if method == "gspo" and response_mask is None:
        raise ValueError(
            "response_mask must be a tensor for 'gspo' reweighting, got None"
        )


def aggregate_loss_across_microbatch(
    per_token_policy_gradient_loss: torch.Tensor,
    mask: torch.Tensor,
    loss_normalization: Literal["sequence", "constant"] = "sequence",
    normalization_constant: int | None = None,
) -> torch.Tensor:
    """Reduce a (B, T) per-token loss to a scalar.

    sequence: mean over responses of (sum_t loss * mask / max(|o_i|, 1))   (GRPO)
    constant: sum over all tokens of loss * mask / normalization_constant
              (Dr. GRPO: no per-response length divisor, hence no length bias)
    """
    if per_token_policy_gradient_loss.ndim != 2:
        raise ValueError(
            "per_token_policy_gradient_loss must have shape (batch_size, "
            f"sequence_length), got {tuple(per_token_policy_gradient_loss.shape)}"
        )
    if mask.shape != per_token_policy_gradient_loss.shape:
        raise ValueError(
            f"mask must have shape {tuple(per_token_policy_gradient_loss.shape)}, "
            f"got {tuple(mask.shape)}"
        )
    check_loss_normalization(loss_normalization, normalization_constant)
    # A masked-out position adds 0 whatever it holds (even inf or NaN).
    masked_loss = torch.where(
        mask != 0, per_token_policy_gradient_loss * mask, 0.0
    )  # (B, T)
    if loss_normalization == "sequence":
        response_lengths = mask.sum(dim=1).clamp_min(1)  # (B,)
        return (masked_loss.sum(dim=1) / response_lengths).mean()
    return masked_loss.sum() / normalization_constant
