"""Importance-sampling correction for a sampler that is not the trainer.

A fast inference engine (vLLM) samples responses from pi_sampler, which is meant
to equal the trainer's pi_theta_old but differs by kernels, precision and
fused ops. The policy gradient is an expectation under pi_theta_old, so each
token's loss is reweighted by

    rho_t = pi_trainer(y_t) / pi_sampler(y_t) = exp(log pi_trainer - log pi_sampler)

and, because rho has unbounded variance, the weight is truncated (TIS) or the
token is masked out (MIS / IcePop) when rho leaves a trusted range. The weight
is detached: it rescales each token's gradient, it is not differentiated.

    none:               w_t = 1
    token_truncate:     w_t = min(rho_t, cap)
    token_mask:         w_t = rho_t if low <= rho_t <= high else 0
    sequence_truncate:  w_t = min(rho_seq, cap)              for every t of the row
    sequence_mask:      w_t = rho_seq if low <= rho_seq <= high else 0

    rho_seq = prod_t rho_t = exp(sum_t (log pi_trainer - log pi_sampler))

The sequence ratio is the product of the token ratios (exp of the summed
log-ratio differences), not their geometric mean exp(mean): a response's
probability is the product of its tokens' probabilities, so the product is the
exact likelihood ratio of the whole response under the two distributions, the
one that makes a sequence-level estimator unbiased. TRL's sequence modes use
the same sum. The geometric mean (GSPO's length-normalized ratio) would give a
length-independent but biased weight.

Semantics follow TRL's ``vllm_importance_sampling_mode`` (``token_truncate``,
``token_mask``, ``sequence_truncate``, ``sequence_mask``): truncation is
``clamp(rho, max=cap)`` with TRL's default ``vllm_importance_sampling_clip_max``
3.0 (TRL's optional lower clamp ``clip_min`` defaults to none and has no
counterpart here); masking zeroes rho outside [low, high], TRL's
[clip_min, clip_max] with clip_min None read as no lower bound (here low = 0,
the same thing for ratios >= 0) and clip_max 3.0, so bounds themselves are kept.
Like TRL, the train step reads a token whose sampler log-prob is NaN (not
reported) as a zero log-ratio difference, rho = 1; the door a direct caller
meets (:func:`sampler_correction_weights`) refuses NaN instead, so that a
missing log-prob is never read as agreement by accident. The weight multiplies
the policy-gradient part of each token's loss, before aggregation and before a
KL penalty is added (:func:`grpo_lab.train_step.microbatch_loss`).

Taught in ``notebooks/11_when_the_sampler_is_not_the_policy.ipynb``.
"""

from __future__ import annotations

import math

import torch

from grpo_lab.logprobs import check_log_prob_values
from grpo_lab.masks import check_binary_mask

CORRECTION_MODES = (
    "none",
    "token_truncate",
    "token_mask",
    "sequence_truncate",
    "sequence_mask",
)
TRUNCATE_MODES = frozenset({"token_truncate", "sequence_truncate"})
SEQUENCE_MODES = frozenset({"sequence_truncate", "sequence_mask"})
# TRL's defaults: vllm_importance_sampling_clip_max = 3.0, clip_min = None.
DEFAULT_CAP = 3.0
DEFAULT_LOW = 0.0
DEFAULT_HIGH = 3.0
GAP_KEYS = ("sampler_log_prob_diff_mean", "sampler_log_prob_diff_max")
CORRECTION_KEYS = (
    "is_ratio_min",
    "is_ratio_mean",
    "is_ratio_max",
    "is_token_corrected_fraction",
    "is_sequence_corrected_fraction",
)


def check_sampler_correction(
    mode: str, cap: float, low: float, high: float, *, caller: str | None = None
) -> None:
    """The one check of a correction mode and its bounds (config and callers).

    mode in ``CORRECTION_MODES``; cap > 0 (inf: plain, untruncated IS);
    0 <= low < high, low finite, high may be inf (no upper bound). NaN is
    refused everywhere. Like TRL (clip_min >= clip_max is refused), an empty
    or single-point range is refused. Bounds a mode does not read are still
    range-checked. ``caller``: a function whose arguments are named mode, cap,
    low and high; its messages name them beside the settings.
    """

    def named(argument: str) -> str:
        return f" ({caller}'s {argument})" if caller else ""

    if mode not in CORRECTION_MODES:
        raise ValueError(
            f"sampler_correction must be one of {CORRECTION_MODES}, got {mode!r}"
            + named("mode")
        )
    if not _is_number(cap) or not cap > 0:
        raise ValueError(
            f"sampler_correction_cap must be a number > 0 (inf: no cap), got {cap!r}"
            + named("cap")
        )
    if not _is_number(low) or not (math.isfinite(low) and low >= 0):
        raise ValueError(
            f"sampler_correction_low must be a finite number >= 0, got {low!r}"
            + named("low")
        )
    if not _is_number(high) or not high > 0:
        raise ValueError(
            f"sampler_correction_high must be a number > 0 (inf: no upper bound), "
            f"got {high!r}" + named("high")
        )
    if not low < high:
        raise ValueError(
            f"sampler_correction_low must be below sampler_correction_high "
            f"({high!r}), got {low!r}" + named("low")
        )


def _is_number(value: object) -> bool:
    """An int or float that is not a bool and not NaN."""
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and not math.isnan(value)
    )


def sampler_correction_weights(
    trainer_log_probs: torch.Tensor,
    sampler_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    mode: str,
    cap: float = DEFAULT_CAP,
    low: float = DEFAULT_LOW,
    high: float = DEFAULT_HIGH,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token weights w (B, T) and their diagnostics.

    ``trainer_log_probs``: log pi_trainer(y_t) at theta_old, (B, T);
    ``sampler_log_probs``: the sampler's log-probs of the same tokens, (B, T),
    aligned with ``response_mask`` (B, T). w is detached, float32 (float64 for
    float64 inputs), 0 wherever the mask is 0 or the mode masked the token
    out; ``mode="none"`` gives w = the mask. Masked positions are ignored
    whatever they hold (NaN, inf, padding).

    Diagnostics (plain floats, 0 when there is nothing to measure):
    ``sampler_log_prob_diff_mean`` / ``_max``: |log pi_trainer - log pi_sampler|
    over response tokens (NaN sampler values left out); and, unless the mode is
    "none", ``is_ratio_min`` / ``_mean`` / ``_max``: the weights after
    truncation or masking (as TRL logs them), over response tokens for token
    modes and over responses for sequence modes; ``is_token_corrected_fraction``:
    response tokens whose weight was truncated or masked (rho > cap; rho
    outside [low, high]); ``is_sequence_corrected_fraction``: responses with at
    least one such token, among responses with a response token.

    This door also checks the values once: the mask holds only 0 and 1, and
    inside it every log-prob is <= 0 and not NaN. A sampler that did not
    report a token's log-prob must say so by its value: give that token the
    trainer's log-prob (rho = 1, what TRL's ``nan_to_num`` makes of a NaN),
    or mask it out. The train step's call (:func:`sampler_weights_and_metrics`)
    checks none of the values, and reads a NaN as TRL does.
    """
    check_sampler_correction(mode, cap, low, high, caller="sampler_correction_weights")
    _check_shapes(trainer_log_probs, sampler_log_probs, response_mask)
    check_binary_mask(response_mask)
    for name, log_probs in (
        ("trainer_log_probs", trainer_log_probs),
        ("sampler_log_probs", sampler_log_probs),
    ):
        check_log_prob_values(log_probs, name, response_mask)
    return sampler_weights_and_metrics(
        trainer_log_probs, sampler_log_probs, response_mask, mode, cap, low, high
    )


def sampler_weights_and_metrics(
    trainer_log_probs: torch.Tensor,
    sampler_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    mode: str,
    cap: float,
    low: float,
    high: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """:func:`sampler_correction_weights` with the mode and bounds already
    checked (by ``UpdateSettings``, once; the train step's call per update)."""
    weights, corrected = sampler_weights(
        trainer_log_probs, sampler_log_probs, response_mask, mode, cap, low, high
    )  # (B, T) each
    metrics = sampler_log_prob_gap(trainer_log_probs, sampler_log_probs, response_mask)
    if mode != "none":
        metrics.update(_correction_metrics(weights, corrected, response_mask, mode))
    return weights, metrics


def correction_weights(
    trainer_log_probs: torch.Tensor,
    sampler_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    mode: str,
    cap: float = DEFAULT_CAP,
    low: float = DEFAULT_LOW,
    high: float = DEFAULT_HIGH,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights w (B, T) of :func:`sampler_correction_weights` and a (B, T)
    bool of the response tokens whose weight was truncated or masked.

    No diagnostics and no host synchronization: the form to call once per
    microbatch.
    """
    check_sampler_correction(mode, cap, low, high, caller="correction_weights")
    return sampler_weights(
        trainer_log_probs, sampler_log_probs, response_mask, mode, cap, low, high
    )


def sampler_weights(
    trainer_log_probs: torch.Tensor,
    sampler_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    mode: str,
    cap: float,
    low: float,
    high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`correction_weights` with the mode and bounds already checked (by
    ``UpdateSettings``, once; the train step's per-microbatch call): the tensors
    are checked, the settings are read as they are."""
    _check_shapes(trainer_log_probs, sampler_log_probs, response_mask)
    mask = response_mask.bool()  # (B, T)
    if mode == "none":
        weights = mask.to(_float_dtype(trainer_log_probs, sampler_log_probs))
        return weights, torch.zeros_like(mask)
    log_ratio = _masked_log_ratio(trainer_log_probs, sampler_log_probs, mask)  # (B, T)
    if mode in SEQUENCE_MODES:
        log_ratio = log_ratio.sum(dim=-1, keepdim=True)  # (B, 1)
    ratio = torch.exp(log_ratio)  # (B, T) or (B, 1)
    if mode in TRUNCATE_MODES:
        outside = ratio > cap  # (B, T) or (B, 1)
        weights = torch.clamp(ratio, max=cap)
    else:
        outside = (ratio < low) | (ratio > high)  # (B, T) or (B, 1)
        weights = ratio.masked_fill(outside, 0.0)
    weights = torch.where(mask, weights, torch.zeros_like(weights))  # (B, T)
    return weights.detach(), outside & mask


def sampler_log_prob_gap(
    trainer_log_probs: torch.Tensor,
    sampler_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
) -> dict[str, float]:
    """Mean and max of |log pi_trainer - log pi_sampler| over response tokens.

    Tokens with a NaN sampler (or trainer) log-prob are left out, as TRL does:
    counting them as 0 would understate the gap. 0.0 for both when no token
    is left.
    """
    _check_shapes(trainer_log_probs, sampler_log_probs, response_mask)
    dtype = _float_dtype(trainer_log_probs, sampler_log_probs)
    gap = (
        trainer_log_probs.detach().to(dtype) - sampler_log_probs.detach().to(dtype)
    ).abs()  # (B, T)
    gap = gap[response_mask.bool() & ~torch.isnan(gap)]  # (N,)
    if gap.numel() == 0:
        return {key: 0.0 for key in GAP_KEYS}
    return {
        "sampler_log_prob_diff_mean": gap.mean().item(),
        "sampler_log_prob_diff_max": gap.max().item(),
    }


def _masked_log_ratio(
    trainer_log_probs: torch.Tensor,
    sampler_log_probs: torch.Tensor,
    mask: torch.Tensor,
) -> torch.Tensor:
    """log pi_trainer - log pi_sampler on response tokens, 0 elsewhere. (B, T)

    NaN (a log-prob the sampler did not report) becomes 0 and +-inf the
    largest finite value, as in TRL (``torch.nan_to_num``).
    """
    dtype = _float_dtype(trainer_log_probs, sampler_log_probs)
    difference = trainer_log_probs.detach().to(dtype) - sampler_log_probs.detach().to(
        dtype
    )  # (B, T)
    difference = torch.where(mask, difference, torch.zeros_like(difference))
    return torch.nan_to_num(difference, nan=0.0)


def _correction_metrics(
    weights: torch.Tensor,
    corrected: torch.Tensor,
    response_mask: torch.Tensor,
    mode: str,
) -> dict[str, float]:
    """is_ratio_min/mean/max and the corrected fractions (floats)."""
    mask = response_mask.bool()  # (B, T)
    has_tokens = mask.any(dim=-1)  # (B,)
    if mode in SEQUENCE_MODES:
        # Every token of a row holds the row's weight; read it where the row has one.
        first = mask.to(torch.int8).argmax(dim=-1, keepdim=True)  # (B, 1)
        values = weights.gather(-1, first).squeeze(-1)[has_tokens]  # (R,)
    else:
        values = weights[mask]  # (N,)
    if values.numel() == 0:
        return {key: 0.0 for key in CORRECTION_KEYS}
    token_count = mask.sum().clamp_min(1)
    return {
        "is_ratio_min": values.min().item(),
        "is_ratio_mean": values.mean().item(),
        "is_ratio_max": values.max().item(),
        "is_token_corrected_fraction": (corrected.sum() / token_count).item(),
        "is_sequence_corrected_fraction": (
            corrected.any(dim=-1).sum() / has_tokens.sum().clamp_min(1)
        ).item(),
    }


def _float_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float32 for half inputs (and integers), float64 kept."""
    dtype = torch.float32
    for tensor in tensors:
        if tensor.dtype.is_floating_point:
            dtype = torch.promote_types(dtype, tensor.dtype)
    return dtype


def _check_shapes(
    trainer_log_probs: torch.Tensor,
    sampler_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
) -> None:
    """All three (B, T) tensors of one shape."""
    for name, value in (
        ("trainer_log_probs", trainer_log_probs),
        ("sampler_log_probs", sampler_log_probs),
        ("response_mask", response_mask),
    ):
        if not isinstance(value, torch.Tensor) or value.ndim != 2:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else None
            raise ValueError(
                f"{name} must be a 2-D (B, T) tensor, got "
                f"{shape if shape is not None else type(value).__name__}"
            )
    shape = tuple(response_mask.shape)
    for name, value in (
        ("trainer_log_probs", trainer_log_probs),
        ("sampler_log_probs", sampler_log_probs),
    ):
        if tuple(value.shape) != shape:
            raise ValueError(
                f"{name} must have the shape of response_mask {shape}, "
                f"got {tuple(value.shape)}"
            )
