"""Per-token policy-gradient losses (the GRPO family) and their aggregation.

REINFORCE, PPO/GRPO clip (with DAPO's clip-higher and a dual-clip cap), GSPO,
CISPO, SAPO and GMPO share one signature; each is a record of
``OBJECTIVE_RECORDS`` (:mod:`grpo_lab.objectives`, re-exported here), reached by
:func:`compute_policy_gradient_loss`. Three aggregations reduce their (B, T)
losses (``LOSS_NORMALIZATIONS``). Taught in
``notebooks/04_policy_gradient_and_clipping.ipynb``, ``notebooks/05_gspo.ipynb``,
``notebooks/06_loss_aggregation.ipynb`` and ``notebooks/10_the_grpo_family.ipynb``.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch

from grpo_lab.objectives import (
    CAPPED_METHODS,
    CLIP_SIDE_KEYS,
    CLIPPED_METHODS,
    COUNT_KEYS,
    OBJECTIVE_RECORDS,
    OBJECTIVES,
    RATIO_METHODS,
    REWEIGHTING_METHODS,
    SEQUENCE_METHODS,
    SPLIT_CLIP_METHODS,
    DiagnosticAccumulator,
    Method,
    Objective,
    ObjectiveOptions,
    ObjectiveRecord,
    check_objective_settings,
    effective_cliprange_high,
    is_positive_number,
    objective_loss,
)

__all__ = [
    "CAPPED_METHODS",
    "CLIPPED_METHODS",
    "CLIP_SIDE_KEYS",
    "COUNT_KEYS",
    "LOSS_NORMALIZATIONS",
    "OBJECTIVES",
    "OBJECTIVE_RECORDS",
    "RATIO_METHODS",
    "REWEIGHTING_METHODS",
    "SEQUENCE_METHODS",
    "SPLIT_CLIP_METHODS",
    "DiagnosticAccumulator",
    "Method",
    "Objective",
    "ObjectiveOptions",
    "ObjectiveRecord",
    "aggregate_loss_across_microbatch",
    "check_aggregation_inputs",
    "check_entropy_settings",
    "check_loss_normalization",
    "check_objective_settings",
    "compute_policy_gradient_loss",
    "effective_cliprange_high",
    "high_entropy_mask",
    "microbatch_loss_scale",
    "objective_loss",
    "reduce_masked_loss",
]


def compute_policy_gradient_loss(
    raw_rewards_or_advantages: torch.Tensor,
    policy_log_probs: torch.Tensor,
    importance_reweighting_method: Method = "none",
    old_log_probs: torch.Tensor | None = None,
    cliprange: float | None = None,
    response_mask: torch.Tensor | None = None,
    **options: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss (B, T) to minimise, and detached diagnostics.

    With w = exp(log pi - log pi_old) (old log-probs get no gradient), sg() a
    stop-gradient, [lo, hi] = [1 - eps_low, 1 + eps_high]:

    none:   -A * log pi                                  (on-policy REINFORCE)
    noclip: -A * w                                       (importance weighted)
    grpo:   -min(A * min(w, cap), A * clip(w, lo, hi))   (PPO clip; DAPO
            clip-higher when eps_high > eps_low; cap = ``ratio_cap``, the dual
            clip, else no cap)
    gspo:   the grpo formula with one ratio per response,
            s = exp(mean over response tokens of log w), repeated on every token
    cispo:  -sg(clip(w, lo, hi)) * A * log pi            (MiniMax-M1: the weight
            is clipped, never the gradient)
    sapo:   -(4 / tau) * sigmoid(tau * (w - 1)) * A, tau = tau_pos if A > 0 else
            tau_neg                                      (soft gate, no hard clip)
    gmpo:   -A * exp(mean_t log w~_t), repeated on every token, where
            sign(A) log w~_t = min(sign(A) log w_t, sign(A) clip(log w_t, -eps_low,
            eps_high))                                   (geometric mean, clipped
            per token in log space)

    A is (B,) or (B, 1); eps_low is ``cliprange``, eps_high the keyword option
    ``cliprange_high`` (None: eps_low). For gmpo the bounds apply to log w (the
    paper's 0.4 means w in [e^-0.4, e^0.4]). ``options``: the other
    :class:`ObjectiveOptions` fields by name (``cliprange_high``, ``ratio_cap``,
    ``sapo_temperature_pos``, ``sapo_temperature_neg``), checked once here; the
    loss itself is :func:`objective_loss`, one record of ``OBJECTIVE_RECORDS``.

    Diagnostics are means over ``response_mask`` tokens (every token when the
    mask is None). ``clip_count`` counts only the clips that remove a gradient:
    A > 0 with the ratio above its upper bound, A < 0 below its lower bound, and
    A < 0 above ``ratio_cap``; elsewhere min() keeps the unclipped term (cispo
    counts every clipped weight: its gradient is scaled, not removed).
    ``clip_low_*`` and ``clip_high_*`` split that count by the side of the
    ratio. They are reported for cispo and gmpo, and for grpo and gspo once
    ``cliprange_high`` or ``ratio_cap`` is set: the reference design's symmetric
    clip keeps exactly its own keys (set ``cliprange_high = cliprange`` to see
    the split of a symmetric clip). Half-precision log-probs are computed in
    float32, because bfloat16 cannot represent GSPO's 1 +/- 3e-4 bounds.
    """
    settings = ObjectiveOptions.from_keywords(
        importance_reweighting_method=importance_reweighting_method,
        cliprange=cliprange,
        **options,
    )
    return objective_loss(
        settings,
        raw_rewards_or_advantages,
        policy_log_probs,
        old_log_probs,
        response_mask,
    )


LOSS_NORMALIZATIONS = ("sequence", "constant", "token")


def check_loss_normalization(
    loss_normalization: str, normalization_constant: float | None
) -> None:
    """The one check of a loss normalization and its constant."""
    if loss_normalization not in LOSS_NORMALIZATIONS:
        raise ValueError(
            f"loss_normalization must be one of {LOSS_NORMALIZATIONS}, "
            f"got {loss_normalization!r}"
        )
    if loss_normalization == "constant" and not is_positive_number(
        normalization_constant
    ):
        raise ValueError(
            "normalization_constant must be positive for constant normalization, "
            f"got {normalization_constant!r}"
        )


def microbatch_loss_scale(
    loss_normalization: str,
    microbatch_rows: int,
    batch_rows: int,
    *,
    microbatch_tokens: int | None = None,
    batch_tokens: int | None = None,
) -> float:
    """What one microbatch's aggregated loss is multiplied by before backward.

    sequence: a mean over b rows, weighted b / B, sums over microbatches to the
              mean over all B rows;
    constant: each microbatch already divides by the same constant: weight 1;
    token:    a mean over the microbatch's n response tokens, weighted n / N with
              N the response tokens of the whole batch, sums to the batch's
              token mean (DAPO), however unevenly the tokens split.
    Either way the accumulated gradient equals the full batch's. Rows skipped
    by the caller still count in B and N. A batch with no response token
    (N = 0) scales by 0: there is no token to average. Taught in
    ``notebooks/07_training_step.ipynb``.
    """
    if loss_normalization == "sequence":
        if not _is_count(batch_rows) or batch_rows < 1:
            raise ValueError(
                f"batch_rows must be a positive int (rows per batch), got "
                f"{batch_rows!r}"
            )
        return microbatch_rows / batch_rows
    if loss_normalization == "token":
        if not (_is_count(microbatch_tokens) and _is_count(batch_tokens)):
            raise ValueError(
                "microbatch_tokens and batch_tokens must be token counts for token "
                f"normalization, got {microbatch_tokens!r} and {batch_tokens!r}"
            )
        if batch_tokens < 0 or not 0 <= microbatch_tokens <= batch_tokens:
            raise ValueError(
                f"batch_tokens must be >= microbatch_tokens ({microbatch_tokens}) "
                f"and >= 0, got {batch_tokens!r}"
            )
        return microbatch_tokens / max(batch_tokens, 1)
    if loss_normalization != "constant":
        raise ValueError(
            f"loss_normalization must be one of {LOSS_NORMALIZATIONS}, "
            f"got {loss_normalization!r}"
        )
    return 1.0


def _is_count(value: object) -> bool:
    """A plain int (or an int-like 0-dim integer tensor is not accepted)."""
    return isinstance(value, int) and not isinstance(value, bool)


def high_entropy_mask(
    token_entropy: torch.Tensor, response_mask: torch.Tensor, quantile: float
) -> torch.Tensor:
    """Response tokens whose entropy is in the top ``quantile`` of the batch. (B, T)

    The 80/20 rule (Wang et al., "Beyond the 80/20 Rule", arXiv:2506.01939):
    only the forking, high-entropy tokens get the policy gradient. As in TRL's
    ``top_entropy_quantile``: the threshold is torch.quantile (linear
    interpolation) of the masked-in entropies at 1 - quantile, and a token is
    kept when its entropy is >= the threshold. quantile = 1 keeps every token.
    The entropy is read without gradient.

    A NaN entropy (a token whose logits were NaN) is never kept and is left out
    of the threshold (``torch.nanquantile``), so one NaN does not empty the
    mask; every entropy NaN keeps no token. The loss of such a token is NaN
    anyway, which the train step refuses.
    """
    check_entropy_settings(0.0, quantile, quantile_name="quantile")
    return top_entropy_mask(token_entropy, response_mask, quantile)


def top_entropy_mask(
    token_entropy: torch.Tensor, response_mask: torch.Tensor, quantile: float
) -> torch.Tensor:
    """:func:`high_entropy_mask` with ``quantile`` already checked (by
    ``UpdateSettings``, once; the train step's per-microbatch call): the tensors
    are checked, the quantile is read as it is. (B, T)"""
    if not isinstance(token_entropy, torch.Tensor) or not isinstance(
        response_mask, torch.Tensor
    ):
        raise ValueError(
            "token_entropy and response_mask must be (B, T) tensors, got "
            f"{type(token_entropy).__name__} and {type(response_mask).__name__}"
        )
    if token_entropy.shape != response_mask.shape:
        raise ValueError(
            f"token_entropy must have the shape of response_mask "
            f"{tuple(response_mask.shape)}, got {tuple(token_entropy.shape)}"
        )
    token_mask = response_mask.bool()  # (B, T)
    entropy = token_entropy.detach()  # (B, T)
    values = entropy[token_mask]  # (n,)
    if quantile == 1.0 or values.numel() == 0:
        return token_mask
    threshold = torch.nanquantile(values, 1 - quantile)
    return (entropy >= threshold) & token_mask  # NaN >= t is False


def check_entropy_settings(
    entropy_coef: float,
    top_entropy_quantile: float,
    *,
    quantile_name: str | None = None,
) -> None:
    """entropy_coef is a finite number >= 0; top_entropy_quantile is in (0, 1]
    (``quantile_name``: a direct caller's name for it, named beside it)."""
    if not (
        isinstance(entropy_coef, (int, float))
        and not isinstance(entropy_coef, bool)
        and math.isfinite(entropy_coef)
        and entropy_coef >= 0
    ):
        raise ValueError(
            "entropy_coef must be a finite number >= 0 (0: no entropy bonus), "
            f"got {entropy_coef!r}"
        )
    if not (is_positive_number(top_entropy_quantile) and top_entropy_quantile <= 1):
        raise ValueError(
            "top_entropy_quantile must be a number in (0, 1] (1: every token), "
            f"got {top_entropy_quantile!r}"
            + (f" (argument {quantile_name})" if quantile_name else "")
        )


def aggregate_loss_across_microbatch(
    per_token_policy_gradient_loss: torch.Tensor,
    mask: torch.Tensor,
    loss_normalization: Literal["sequence", "constant", "token"] = "sequence",
    normalization_constant: int | None = None,
) -> torch.Tensor:
    """Reduce a (B, T) per-token loss to a scalar: its inputs checked, then
    :func:`reduce_masked_loss` (the formulas)."""
    check_aggregation_inputs(
        per_token_policy_gradient_loss, mask, loss_normalization, normalization_constant
    )
    return reduce_masked_loss(
        per_token_policy_gradient_loss, mask, loss_normalization, normalization_constant
    )


def reduce_masked_loss(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    loss_normalization: str,
    normalization_constant: float | None,
) -> torch.Tensor:
    """Reduce a (B, T) per-token loss to a scalar (inputs already checked).

    sequence: mean over responses of (sum_t loss * mask / max(|o_i|, 1))   (GRPO)
    constant: sum over all tokens of loss * mask / normalization_constant
              (Dr. GRPO: no per-response length divisor, hence no length bias)
    token:    sum over all tokens of loss * mask / max(sum of mask, 1)
              (DAPO's token mean: every token weighs the same, whatever its
              response's length; TRL's bnpo on one batch). Across microbatches
              the train step rescales by the batch's token count
              (:func:`microbatch_loss_scale`), so the result stays the full
              batch's token mean.
    ``normalization_constant`` is read by constant only.
    """
    # A masked-out position adds 0 whatever it holds (even inf or NaN).
    masked_loss = torch.where(mask != 0, per_token_loss * mask, 0.0)  # (B, T)
    if loss_normalization == "sequence":
        response_lengths = mask.sum(dim=1).clamp_min(1)  # (B,)
        return (masked_loss.sum(dim=1) / response_lengths).mean()
    if loss_normalization == "token":
        return masked_loss.sum() / mask.sum().clamp_min(1)
    return masked_loss.sum() / normalization_constant


def check_aggregation_inputs(
    per_token_policy_gradient_loss: torch.Tensor,
    mask: torch.Tensor,
    loss_normalization: str,
    normalization_constant: float | None,
) -> None:
    """A (B, T) loss with B >= 1, a mask of its shape, a known normalization."""
    for name, value in (
        ("per_token_policy_gradient_loss", per_token_policy_gradient_loss),
        ("mask", mask),
    ):
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(value).__name__}")
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
    if per_token_policy_gradient_loss.shape[0] == 0:
        raise ValueError(
            "per_token_policy_gradient_loss must hold at least one response, got 0 rows"
        )
    check_loss_normalization(loss_normalization, normalization_constant)
