"""The GRPO family, one job: every per-token objective beside its formula and record.

REINFORCE, PPO/GRPO clip (with DAPO's clip-higher and a dual-clip cap), GSPO,
CISPO, SAPO, GMPO, LUSPO, VESPO, DPPO (TV and KL), Clip-Cov and KL-Cov share
one signature, and DeepSeek-V3.2's off-policy sequence mask applies to each;
``OBJECTIVE_RECORDS`` holds each one's loss, what it needs (the ratio, a clip
range, the response mask) and the diagnostics it reports, and every name list
derives from it.
:class:`ObjectiveOptions` is checked once, when built.
:func:`compute_policy_gradient_loss` is the entry point of direct callers; the
train step's ``microbatch_loss`` prepares the tensors once
(:func:`objective_inputs`) and calls the record's loss itself (the clip:
:func:`grpo_clip_loss`, three calls below ``grpo_train_step``). The 80/20
rule's entropy mask is here too.
Taught in ``notebooks/04_policy_gradient_and_clipping.ipynb``,
``notebooks/05_gspo.ipynb`` and ``notebooks/10_the_grpo_family.ipynb``; the
reduction of the (B, T) losses to a scalar is :mod:`grpo_lab.aggregation`
(notebook 06).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Self

import torch

LossAndDiagnostics = tuple[torch.Tensor, dict[str, torch.Tensor]]
CLIP_SIDE_KEYS = (
    "clip_low_count",
    "clip_high_count",
    "clip_low_fraction",
    "clip_high_fraction",
)


def effective_cliprange_high(
    cliprange: float | None, cliprange_high: float | None
) -> float | None:
    """eps_high: ``cliprange_high``, or ``cliprange`` when that is None.

    The one place this default is derived (the objectives, the ratio-cap check
    and the TRL and verl exports all call it).
    """
    return cliprange if cliprange_high is None else cliprange_high


@dataclass(frozen=True, kw_only=True)
class ObjectiveOptions:
    """Which objective, and the knobs it reads besides its tensors.

    One door: the options are checked once, when the object is built
    (:func:`check_objective_settings`); the loss reads them unchecked.
    :class:`grpo_lab.train_step.UpdateSettings` extends it with the update's
    other settings, and ``TrainConfig.update_settings()`` builds that.
    """

    # The objective's name, a key of OBJECTIVE_RECORDS.
    importance_reweighting_method: str = "none"
    # Lower clip range eps_low: the ratio is clipped below at 1 - eps_low (gmpo:
    # log ratio at -eps_low).
    cliprange: float | None = None
    # Upper clip range eps_high (DAPO's clip-higher): clipped above at
    # 1 + eps_high (gmpo: log ratio at +eps_high). None: eps_high = eps_low.
    cliprange_high: float | None = None
    # Dual clip (INTELLECT-2; TRL's delta): the unclipped ratio term is capped at
    # this value, bounding the loss of a negative-advantage token whose ratio
    # explodes. None: no cap.
    ratio_cap: float | None = None
    # SAPO gate temperatures for tokens with A > 0 and with A <= 0.
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    # DeepSeek-V3.2's off-policy sequence mask (TRL's off_policy_mask_threshold):
    # a response with A < 0 whose mean log(pi_old / pi) is above this gets no
    # loss, whatever the objective. None: no mask.
    off_policy_mask_threshold: float | None = None
    # VESPO's gamma weight phi(w) = exp(lam) w^k exp(-lam w) of the sequence
    # ratio w: (k, lam) for A >= 0 and for A < 0 (TRL's vespo_* defaults).
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    # Clip-Cov and KL-Cov: the fraction of a microbatch's tokens they select by
    # covariance (verl's clip_cov_ratio and kl_cov_ratio).
    covariance_fraction: float = 2e-4
    # Clip-Cov's band: a token with clip_cov_low < cov < clip_cov_high may be
    # drawn (verl's clip_cov_lb and clip_cov_ub).
    clip_cov_low: float = 1.0
    clip_cov_high: float = 5.0
    # KL-Cov's coefficient of |log w| on its selected tokens (verl's ppo_kl_coef).
    kl_cov_coef: float = 0.1

    def __post_init__(self) -> None:
        # Every option by its own name: a new option is one field and its check.
        options = {
            f.name: getattr(self, f.name) for f in dataclasses.fields(ObjectiveOptions)
        }
        method = options.pop("importance_reweighting_method")
        check_objective_settings(method, **options)

    @classmethod
    def from_keywords(cls, **fields: Any) -> Self:
        """The options from keywords; an unknown name is a ValueError naming it."""
        known = [field.name for field in dataclasses.fields(cls)]
        unknown = sorted(set(fields) - set(known))
        if unknown:
            kind = "update" if cls is not ObjectiveOptions else "objective"
            raise ValueError(
                f"unknown {kind} option(s) {unknown}; expected some of {sorted(known)}"
            )
        return cls(**fields)

    @property
    def record(self) -> ObjectiveRecord:
        """The objective's record: its loss and what it needs and reports."""
        return OBJECTIVE_RECORDS[self.importance_reweighting_method]

    @property
    def low_bound(self) -> float:
        """1 - eps_low (gmpo: -eps_low on the log ratio)."""
        return 1 - self.cliprange

    @property
    def upper_cliprange(self) -> float:
        """eps_high (:func:`effective_cliprange_high`)."""
        return effective_cliprange_high(self.cliprange, self.cliprange_high)

    @property
    def high_bound(self) -> float:
        """1 + eps_high."""
        return 1 + self.upper_cliprange

    @property
    def splits_clip_sides(self) -> bool:
        """Whether grpo/gspo report clip_low_* and clip_high_* (see
        :func:`compute_policy_gradient_loss`)."""
        return self.cliprange_high is not None or self.ratio_cap is not None


Objective = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, ObjectiveOptions],
    LossAndDiagnostics,
]
Method = Literal[
    "none",
    "noclip",
    "grpo",
    "gspo",
    "cispo",
    "sapo",
    "gmpo",
    "luspo",
    "vespo",
    "dppo_tv",
    "dppo_kl",
    "clip_cov",
    "kl_cov",
]


def objective_loss(
    options: ObjectiveOptions,
    advantages: torch.Tensor,
    policy_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor | None,
    response_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`compute_policy_gradient_loss` with options already checked: the
    tensors are checked (:func:`objective_inputs`), the options are read as they
    are, and the record's loss computes."""
    inputs = objective_inputs(
        options, advantages, policy_log_probs, old_log_probs, response_mask
    )
    per_token_loss, diagnostics = options.record.loss(*inputs, options)
    return mask_off_policy_sequences(per_token_loss, diagnostics, inputs, options)


def objective_inputs(
    options: ObjectiveOptions,
    advantages: torch.Tensor,
    policy_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor | None,
    response_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The tensors every record's loss reads, checked and prepared once:
    advantages (B, 1); log-probs in float32 when they came in half precision;
    old log-probs finite where masked out; the token mask (B, T) as booleans."""
    _check_loss_shapes(advantages, policy_log_probs, response_mask)
    _check_objective_tensors(options, policy_log_probs, old_log_probs, response_mask)
    if policy_log_probs.dtype in {torch.float16, torch.bfloat16}:
        policy_log_probs = policy_log_probs.float()
    if advantages.ndim == 1:
        advantages = advantages.unsqueeze(-1)  # (B, 1)
    token_mask = (
        response_mask.bool()
        if response_mask is not None
        else torch.ones_like(policy_log_probs, dtype=torch.bool)
    )  # (B, T)
    if old_log_probs is not None:
        old_log_probs = _finite_where_masked_out(
            old_log_probs, policy_log_probs, token_mask
        )
    return advantages, policy_log_probs, old_log_probs, token_mask


def _finite_where_masked_out(
    old_log_probs: torch.Tensor,
    policy_log_probs: torch.Tensor,
    token_mask: torch.Tensor,
) -> torch.Tensor:
    """old log-probs with each non-finite masked-out entry replaced by log pi there.

    A masked-out position must not matter, but a NaN or -inf old log-prob there
    would still send NaN through exp() into the gradient (0 * exp(NaN) is NaN).
    Finite values, masked or not, are kept as they are. (B, T)
    """
    unusable = ~token_mask & ~torch.isfinite(old_log_probs)  # (B, T)
    if not unusable.any():
        return old_log_probs
    return torch.where(unusable, policy_log_probs.detach(), old_log_probs)


def _token_mean(values: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
    """Detached mean of values over masked-in tokens (0 when there are none)."""
    count = token_mask.sum().detach()
    return values.detach().masked_fill(~token_mask, 0.0).sum() / count.clamp_min(1)


def _token_ratio_diagnostics(
    ratio: torch.Tensor, per_token_loss: torch.Tensor, token_mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Mean token ratio (and its token count) and mean loss of a token objective."""
    return {
        "importance_ratio_mean": _token_mean(ratio, token_mask),
        "importance_ratio_count": token_mask.sum().detach(),
        "off_policy_loss_mean": _token_mean(per_token_loss, token_mask),
    }


def _log_ratio(
    policy_log_probs: torch.Tensor, old_log_probs: torch.Tensor
) -> torch.Tensor:
    """log pi - log pi_old, with no gradient through the old policy. (B, T)"""
    return policy_log_probs - old_log_probs.detach()


def reinforce_loss(
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


def noclip_loss(
    advantages: torch.Tensor,
    policy_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    token_mask: torch.Tensor,
    options: ObjectiveOptions,
) -> LossAndDiagnostics:
    weights = torch.exp(_log_ratio(policy_log_probs, old_log_probs))  # (B, T)
    per_token_loss = -advantages * weights  # (B, T)
    return per_token_loss, _token_ratio_diagnostics(weights, per_token_loss, token_mask)


def _clipped_sides(
    advantages: torch.Tensor,
    ratio: torch.Tensor,
    options: ObjectiveOptions,
    low: float,
    high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where a clip removes the gradient, split by the ratio's side.

    A clip only matters when it removes the gradient: A < 0 below ``low``
    (low side); A > 0 above ``high``, or A < 0 above ``ratio_cap`` (high side).
    Elsewhere min() keeps the unclipped term.
    """
    low_side = (advantages < 0) & (ratio < low)
    high_side = (advantages > 0) & (ratio > high)
    if options.ratio_cap is not None:
        high_side = high_side | ((advantages < 0) & (ratio > options.ratio_cap))
    return low_side, high_side


def _clip_diagnostics(
    low_side: torch.Tensor,
    high_side: torch.Tensor,
    valid: torch.Tensor,
    total: torch.Tensor,
    split: bool,
) -> dict[str, torch.Tensor]:
    """clip_fraction, clip_count, clip_total (and the low/high split)."""
    clip_count = (valid & (high_side | low_side)).sum()
    diagnostics = {
        "clip_fraction": (clip_count / total.clamp_min(1)).detach(),
        "clip_count": clip_count.detach(),
        "clip_total": total.detach(),
    }
    if split:
        low_count = (valid & low_side).sum().detach()
        high_count = (valid & high_side).sum().detach()
        diagnostics.update(
            clip_low_count=low_count,
            clip_high_count=high_count,
            clip_low_fraction=low_count / total.clamp_min(1),
            clip_high_fraction=high_count / total.clamp_min(1),
        )
    return diagnostics


def _capped(ratio: torch.Tensor, options: ObjectiveOptions) -> torch.Tensor:
    """min(ratio, ratio_cap): the unclipped term under the dual clip."""
    if options.ratio_cap is None:
        return ratio
    return torch.clamp(ratio, max=options.ratio_cap)


def grpo_clip_loss(
    advantages: torch.Tensor,
    policy_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    token_mask: torch.Tensor,
    options: ObjectiveOptions,
) -> LossAndDiagnostics:
    low, high = options.low_bound, options.high_bound
    ratio = torch.exp(_log_ratio(policy_log_probs, old_log_probs))  # (B, T)
    clipped_ratio = torch.clamp(ratio, min=low, max=high)  # (B, T)
    per_token_loss = -torch.minimum(
        advantages * _capped(ratio, options), advantages * clipped_ratio
    )  # (B, T)
    token_count = token_mask.sum().detach()
    low_side, high_side = _clipped_sides(advantages, ratio, options, low, high)
    return per_token_loss, {
        **_clip_diagnostics(
            low_side, high_side, token_mask, token_count, options.splits_clip_sides
        ),
        **_token_ratio_diagnostics(ratio, per_token_loss, token_mask),
    }


def _sequence_mean_log_ratio(
    log_ratio: torch.Tensor, token_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean over each response's tokens of the log ratio (B, 1), and lengths."""
    lengths = token_mask.sum(dim=1, keepdim=True)  # (B, 1)
    mean_log_ratio = log_ratio.masked_fill(~token_mask, 0.0).sum(
        dim=1, keepdim=True
    ) / lengths.clamp_min(1)  # (B, 1)
    return mean_log_ratio, lengths


def _sequence_diagnostics(
    ratio: torch.Tensor, clipped_ratio: torch.Tensor, valid: torch.Tensor
) -> dict[str, torch.Tensor]:
    sequence_count = valid.sum()

    def sequence_mean(values: torch.Tensor) -> torch.Tensor:
        masked = values.detach().masked_fill(~valid, 0.0)
        return masked.sum() / sequence_count.clamp_min(1)

    return {
        "importance_ratio_mean": sequence_mean(ratio),
        "clipped_importance_ratio_mean": sequence_mean(clipped_ratio),
        "importance_ratio_count": sequence_count.detach(),
    }


def gspo_clip_loss(
    advantages: torch.Tensor,
    policy_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    token_mask: torch.Tensor,
    options: ObjectiveOptions,
) -> LossAndDiagnostics:
    low, high = options.low_bound, options.high_bound
    log_ratio = _log_ratio(policy_log_probs, old_log_probs)  # (B, T)
    mean_log_ratio, lengths = _sequence_mean_log_ratio(log_ratio, token_mask)
    ratio = torch.exp(mean_log_ratio)  # (B, 1): geometric mean of token ratios
    clipped_ratio = torch.clamp(ratio, min=low, max=high)  # (B, 1)
    sequence_loss = -torch.minimum(
        advantages * _capped(ratio, options), advantages * clipped_ratio
    )  # (B, 1)
    # Sequence aggregation averages these repeated values: no second length divide.
    per_token_loss = sequence_loss.expand_as(log_ratio)  # (B, T)
    valid = lengths > 0  # (B, 1): responses with at least one token
    low_side, high_side = _clipped_sides(advantages, ratio, options, low, high)
    clips = _clip_diagnostics(
        low_side, high_side, valid, valid.sum(), options.splits_clip_sides
    )
    return per_token_loss, {
        **_sequence_diagnostics(ratio, clipped_ratio, valid),
        **clips,
        "off_policy_loss_mean": _token_mean(per_token_loss, token_mask),
    }


def cispo_loss(
    advantages: torch.Tensor,
    policy_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    token_mask: torch.Tensor,
    options: ObjectiveOptions,
) -> LossAndDiagnostics:
    low, high = options.low_bound, options.high_bound
    ratio = torch.exp(_log_ratio(policy_log_probs, old_log_probs))  # (B, T)
    weights = torch.clamp(ratio, min=low, max=high).detach()  # (B, T), sg(clip(w))
    per_token_loss = -weights * advantages * policy_log_probs  # (B, T)
    token_count = token_mask.sum().detach()
    return per_token_loss, {
        **_clip_diagnostics(ratio < low, ratio > high, token_mask, token_count, True),
        **_token_ratio_diagnostics(ratio, per_token_loss, token_mask),
    }


def sapo_loss(
    advantages: torch.Tensor,
    policy_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    token_mask: torch.Tensor,
    options: ObjectiveOptions,
) -> LossAndDiagnostics:
    ratio = torch.exp(_log_ratio(policy_log_probs, old_log_probs))  # (B, T)
    positive = torch.full_like(advantages, options.sapo_temperature_pos)  # (B, 1)
    negative = torch.full_like(advantages, options.sapo_temperature_neg)  # (B, 1)
    temperature = torch.where(advantages > 0, positive, negative)  # (B, 1)
    gate = torch.sigmoid(temperature * (ratio - 1)) * 4 / temperature  # (B, T)
    per_token_loss = -gate * advantages  # (B, T)
    return per_token_loss, _token_ratio_diagnostics(ratio, per_token_loss, token_mask)


def gmpo_loss(
    advantages: torch.Tensor,
    policy_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    token_mask: torch.Tensor,
    options: ObjectiveOptions,
) -> LossAndDiagnostics:
    low, high = -options.cliprange, options.upper_cliprange  # bounds on log w
    log_ratio = _log_ratio(policy_log_probs, old_log_probs)  # (B, T)
    sign = torch.sign(advantages)  # (B, 1)
    clipped_log_ratio = torch.clamp(log_ratio, min=low, max=high)  # (B, T)
    kept_log_ratio = sign * torch.minimum(
        sign * log_ratio, sign * clipped_log_ratio
    )  # (B, T): the pessimistic side, as PPO's min
    mean_log_ratio, lengths = _sequence_mean_log_ratio(kept_log_ratio, token_mask)
    ratio = torch.exp(mean_log_ratio)  # (B, 1): geometric mean of clipped ratios
    per_token_loss = (-advantages * ratio).expand_as(log_ratio)  # (B, T)
    valid = lengths > 0  # (B, 1)
    unclipped_ratio = torch.exp(_sequence_mean_log_ratio(log_ratio, token_mask)[0])
    low_side = (advantages < 0) & (log_ratio < low)  # (B, T)
    high_side = (advantages > 0) & (log_ratio > high)  # (B, T)
    clips = _clip_diagnostics(
        low_side, high_side, token_mask, token_mask.sum(), split=True
    )
    return per_token_loss, {
        **_sequence_diagnostics(unclipped_ratio, ratio, valid),
        **clips,
        "off_policy_loss_mean": _token_mean(per_token_loss, token_mask),
    }


def luspo_loss(
    advantages: torch.Tensor,
    policy_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    token_mask: torch.Tensor,
    options: ObjectiveOptions,
) -> LossAndDiagnostics:
    # GSPO's clipped sequence loss times the response's length, on every token:
    # the sequence normalization's mean over a response then leaves L * loss,
    # the paper's sum over the response's tokens. (B, T)
    per_token_loss, diagnostics = gspo_clip_loss(
        advantages, policy_log_probs, old_log_probs, token_mask, options
    )
    lengths = token_mask.sum(dim=1, keepdim=True)  # (B, 1)
    per_token_loss = per_token_loss * lengths  # (B, T)
    diagnostics["off_policy_loss_mean"] = _token_mean(per_token_loss, token_mask)
    return per_token_loss, diagnostics


VESPO_LOG_FLOOR = math.log(1e-8)  # TRL's lower clamp of log w


def vespo_weights(
    advantages: torch.Tensor,
    log_ratio: torch.Tensor,
    token_mask: torch.Tensor,
    options: ObjectiveOptions,
) -> tuple[torch.Tensor, torch.Tensor]:
    """VESPO's detached gamma weight phi(w) (B, 1) or (B, T) and log w (B, 1).

    log w = clamp(sum_t clamp(log w_t, -20, 20), log 1e-8, 20): the sequence
    ratio is the product of the token ratios, not GSPO's geometric mean.
    log phi = lam + k log w - lam w, with (k, lam) by A's sign (A >= 0: pos);
    phi = 1 at w = 1, its peak is at w = k / lam. A non-finite phi is 0.
    """
    token_log_ratio = torch.clamp(log_ratio.detach(), -20.0, 20.0)  # (B, T)
    summed = (token_log_ratio * token_mask).sum(dim=-1, keepdim=True)  # (B, 1)
    log_w = torch.clamp(summed, VESPO_LOG_FLOOR, 20.0)  # (B, 1)
    nonnegative = advantages >= 0  # (B, 1) or (B, T)

    def by_sign(positive: float, negative: float) -> torch.Tensor:
        return torch.where(
            nonnegative,
            torch.full_like(advantages, positive),
            torch.full_like(advantages, negative),
        )

    k = by_sign(options.vespo_k_pos, options.vespo_k_neg)
    lam = by_sign(options.vespo_lambda_pos, options.vespo_lambda_neg)
    log_phi = lam + k * log_w - lam * torch.exp(log_w)
    phi = torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    return phi, log_w


def vespo_loss(
    advantages: torch.Tensor,
    policy_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    token_mask: torch.Tensor,
    options: ObjectiveOptions,
) -> LossAndDiagnostics:
    log_ratio = _log_ratio(policy_log_probs, old_log_probs)  # (B, T)
    phi, log_w = vespo_weights(advantages, log_ratio, token_mask, options)
    per_token_loss = -phi * advantages * policy_log_probs  # (B, T)
    valid = token_mask.any(dim=1, keepdim=True)  # (B, 1)
    count = valid.sum()
    ratio_mean = torch.exp(log_w).masked_fill(~valid, 0.0).sum() / count.clamp_min(1)
    return per_token_loss, {
        "importance_ratio_mean": ratio_mean,
        "importance_ratio_count": count.detach(),
        "gamma_weight_mean": _token_mean(phi.expand_as(log_ratio), token_mask),
        "off_policy_loss_mean": _token_mean(per_token_loss, token_mask),
    }


def _dppo_loss(
    advantages: torch.Tensor,
    policy_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    token_mask: torch.Tensor,
    options: ObjectiveOptions,
    kept: torch.Tensor,
) -> LossAndDiagnostics:
    """-A * sg(min(w, ratio_cap)) * log pi on the ``kept`` tokens (B, T)."""
    ratio = torch.exp(_log_ratio(policy_log_probs, old_log_probs))  # (B, T)
    weight = _capped(ratio, options).detach()  # (B, T): truncated IS weight
    kept = kept.detach()
    per_token_loss = -advantages * weight * policy_log_probs * kept  # (B, T)
    dropped = ~kept
    token_count = token_mask.sum().detach()
    low_side, high_side = dropped & (advantages <= 0), dropped & (advantages > 0)
    return per_token_loss, {
        **_clip_diagnostics(low_side, high_side, token_mask, token_count, True),
        **_token_ratio_diagnostics(ratio, per_token_loss, token_mask),
    }


def dppo_tv_loss(
    advantages: torch.Tensor,
    policy_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    token_mask: torch.Tensor,
    options: ObjectiveOptions,
) -> LossAndDiagnostics:
    # The token's probability may move by at most eps_high up (A > 0) or
    # eps_low down (A <= 0): its total variation, not its ratio, is bounded.
    shift = torch.exp(policy_log_probs) - torch.exp(old_log_probs.detach())  # (B, T)
    kept = torch.where(
        advantages > 0, shift <= options.upper_cliprange, shift >= -options.cliprange
    )  # (B, T)
    return _dppo_loss(
        advantages, policy_log_probs, old_log_probs, token_mask, options, kept
    )


def dppo_kl_loss(
    advantages: torch.Tensor,
    policy_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    token_mask: torch.Tensor,
    options: ObjectiveOptions,
) -> LossAndDiagnostics:
    # The binary KL between Bernoulli(p_old) and Bernoulli(p) of the sampled
    # token, bounded by eps_high when p rises (A > 0), eps_low when it falls.
    old = old_log_probs.detach()
    p, p_old = torch.exp(policy_log_probs), torch.exp(old)  # (B, T)
    binary_kl = p_old * (old - policy_log_probs) + (1 - p_old) * torch.log(
        (1.0 - p_old + 1e-8) / (1.0 - p + 1e-8)
    )  # (B, T); the 1e-8 is verl's
    kept = torch.where(
        advantages > 0,
        (binary_kl <= options.upper_cliprange) | (p <= p_old),
        (binary_kl <= options.cliprange) | (p >= p_old),
    )  # (B, T)
    return _dppo_loss(
        advantages, policy_log_probs, old_log_probs, token_mask, options, kept
    )


def _token_advantages(
    advantages: torch.Tensor, policy_log_probs: torch.Tensor
) -> torch.Tensor:
    """A on every token (B, T), a fresh tensor (A may come as (B, 1))."""
    return advantages.expand_as(policy_log_probs).contiguous()


def _masked_mean_like_verl(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum over masked-in values / (count + 1e-8), as verl's masked_mean."""
    weights = mask.to(values.dtype)
    return (torch.where(mask, values, 0.0) * weights).sum() / (weights.sum() + 1e-8)


def clip_cov_loss(
    advantages: torch.Tensor,
    policy_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    token_mask: torch.Tensor,
    options: ObjectiveOptions,
) -> LossAndDiagnostics:
    low, high = options.low_bound, options.high_bound
    ratio = torch.exp(_log_ratio(policy_log_probs, old_log_probs))  # (B, T)
    unclipped = -advantages * ratio  # (B, T)
    clipped = -advantages * torch.clamp(ratio, min=low, max=high)  # (B, T)
    clipped_out = (clipped > unclipped) & token_mask  # the PPO clip binds
    token_advantages = _token_advantages(advantages, policy_log_probs)
    log_probs = policy_log_probs.detach()
    covariance = (
        token_advantages - _masked_mean_like_verl(token_advantages, token_mask)
    ) * (log_probs - _masked_mean_like_verl(log_probs, token_mask))  # (B, T)
    candidates = (
        token_mask
        & ~clipped_out
        & (covariance > options.clip_cov_low)
        & (covariance < options.clip_cov_high)
    )  # (B, T)
    positions = torch.nonzero(candidates)  # (n, 2), row-major
    count = max(int(options.covariance_fraction * token_mask.sum().item()), 1)
    selected = torch.zeros_like(token_mask)
    if len(positions) > 0:
        # torch's global generator, as verl draws: seed torch to repeat a draw.
        drawn = positions[torch.randperm(len(positions))[:count]]
        selected[drawn[:, 0], drawn[:, 1]] = True
    per_token_loss = torch.maximum(unclipped, clipped) * ~selected  # (B, T)
    token_count = token_mask.sum().detach()
    low_side = (advantages < 0) & (ratio < low)
    high_side = (advantages > 0) & (ratio > high)
    return per_token_loss, {
        **_clip_diagnostics(low_side, high_side, token_mask, token_count, True),
        **_token_ratio_diagnostics(ratio, per_token_loss, token_mask),
        "covariance_selected_mean": _token_mean(selected.float(), token_mask),
    }


def kl_cov_loss(
    advantages: torch.Tensor,
    policy_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    token_mask: torch.Tensor,
    options: ObjectiveOptions,
) -> LossAndDiagnostics:
    log_ratio = _log_ratio(policy_log_probs, old_log_probs)  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)
    token_advantages = _token_advantages(advantages, policy_log_probs)[token_mask]
    log_probs = policy_log_probs.detach()[token_mask]  # (n,), row-major
    selected = torch.zeros_like(token_mask)
    if log_probs.numel() > 0:
        covariance = (token_advantages - token_advantages.mean()) * (
            log_probs - log_probs.mean()
        )  # (n,)
        count = max(1, int(log_probs.numel() * options.covariance_fraction))
        top = torch.topk(covariance, count, largest=True).indices  # (count,)
        flat = torch.zeros_like(covariance, dtype=torch.bool)
        flat[top] = True
        selected[token_mask] = flat
    penalty = options.kl_cov_coef * log_ratio.abs()  # (B, T)
    per_token_loss = torch.where(
        selected, -advantages * ratio + penalty, -advantages * ratio
    )  # (B, T)
    return per_token_loss, {
        **_token_ratio_diagnostics(ratio, per_token_loss, token_mask),
        "covariance_selected_mean": _token_mean(selected.float(), token_mask),
    }


def off_policy_sequence_mask(
    advantages: torch.Tensor,
    policy_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    token_mask: torch.Tensor,
    threshold: float,
) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (arXiv:2512.02556, eq. 9). (B, 1)

    A response is kept when A >= 0 or when the mean over its tokens of
    log pi_old - log pi (a sampled estimate of KL(pi_old || pi), read without
    gradient; a NaN token counts 0, as in TRL) is at most ``threshold``.
    """
    kl = torch.nan_to_num(old_log_probs - policy_log_probs.detach(), nan=0.0)
    kl = torch.where(token_mask, kl, 0.0)  # (B, T): padding never counts
    lengths = token_mask.sum(dim=1, keepdim=True).to(kl.dtype)  # (B, 1)
    mean_kl = kl.sum(dim=1, keepdim=True) / lengths.clamp(min=1.0)  # (B, 1)
    return (advantages >= 0) | (mean_kl <= threshold)  # (B, 1)


def mask_off_policy_sequences(
    per_token_loss: torch.Tensor,
    diagnostics: dict[str, torch.Tensor],
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor],
    options: ObjectiveOptions,
    sampler_log_probs: torch.Tensor | None = None,
) -> LossAndDiagnostics:
    """The record's loss with :func:`off_policy_sequence_mask` applied when
    ``off_policy_mask_threshold`` is set; ``off_policy_kept_mean`` reports the
    fraction of tokens kept. The mask measures the policy against the
    sampler's log-probs when given (both drifts, the update's and the
    sampler's, as DeepSeek-V3.2 and TRL do), else against pi_old; without old
    log-probs (``none``) pi_old = pi, and every response is kept, as in TRL."""
    threshold = options.off_policy_mask_threshold
    if threshold is None:
        return per_token_loss, diagnostics
    advantages, policy_log_probs, old_log_probs, token_mask = inputs
    behaviour = sampler_log_probs if sampler_log_probs is not None else old_log_probs
    if behaviour is None:
        behaviour = policy_log_probs.detach()
    kept = off_policy_sequence_mask(
        advantages, policy_log_probs, behaviour, token_mask, threshold
    )  # (B, 1)
    diagnostics = {
        **diagnostics,
        "off_policy_kept_mean": _token_mean(
            kept.expand_as(token_mask).float(), token_mask
        ),
    }
    return per_token_loss * kept, diagnostics


RATIO_KEYS = frozenset(
    {"importance_ratio_mean", "importance_ratio_count", "off_policy_loss_mean"}
)
CLIP_KEYS = frozenset({"clip_fraction", "clip_count", "clip_total"})
SEQUENCE_KEYS = frozenset({"clipped_importance_ratio_mean"})


@dataclass(frozen=True, kw_only=True)
class ObjectiveRecord:
    """One objective: its loss and the facts the rest of the package reads.

    ``loss`` has the one signature of every objective: (A (B, 1), log pi (B, T),
    log pi_old (B, T) or None, token mask (B, T), options) -> (loss (B, T),
    diagnostics). A test checks ``diagnostic_keys`` against what it returns.
    """

    loss: Objective
    # Weighs by pi / pi_old: needs old log-probs.
    uses_ratio: bool
    # Clips that ratio: needs cliprange > 0, reports clip_count and friends.
    clips: bool
    # One ratio per response: needs the response mask.
    per_sequence: bool
    # Its unclipped term is bounded by the dual-clip ratio_cap.
    capped: bool
    # The diagnostics it always returns.
    keys: frozenset[str]
    # Reports clip_low_* and clip_high_* always; else (if it clips) only once
    # cliprange_high or ratio_cap is set.
    always_splits_clip_sides: bool = False
    # Its detached weight is truncated at ratio_cap (a cap above 1, not a dual
    # clip above 1 + eps_high).
    truncates: bool = False
    # A token's loss depends on the other rows of its microbatch (a covariance
    # over them): every row is scored, zero-advantage ones too.
    needs_every_row: bool = False
    # The ObjectiveOptions fields only this objective (and its kin) reads.
    own_options: tuple[str, ...] = ()

    def diagnostic_keys(self, options: ObjectiveOptions) -> frozenset[str]:
        """The keys its loss returns under ``options``."""
        keys = self.keys
        if self.clips and (self.always_splits_clip_sides or options.splits_clip_sides):
            keys = keys | frozenset(CLIP_SIDE_KEYS)
        if options.off_policy_mask_threshold is not None:
            keys = keys | {"off_policy_kept_mean"}
        return keys


def _record(
    loss: Objective,
    *,
    keys: frozenset[str],
    own_options: tuple[str, ...] = (),
    **facts: bool,
) -> ObjectiveRecord:
    defaults = {"uses_ratio": True, "clips": False, "per_sequence": False}
    return ObjectiveRecord(
        loss=loss,
        keys=keys,
        own_options=own_options,
        **{"capped": False, **defaults, **facts},
    )


VESPO_OPTIONS = ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")


# Every objective, by name. The name lists below derive from these records.
OBJECTIVE_RECORDS: dict[str, ObjectiveRecord] = {
    "none": _record(
        reinforce_loss, uses_ratio=False, keys=frozenset({"on_policy_loss_mean"})
    ),
    "noclip": _record(noclip_loss, keys=RATIO_KEYS),
    "grpo": _record(
        grpo_clip_loss, clips=True, capped=True, keys=RATIO_KEYS | CLIP_KEYS
    ),
    "gspo": _record(
        gspo_clip_loss,
        clips=True,
        capped=True,
        per_sequence=True,
        keys=RATIO_KEYS | CLIP_KEYS | SEQUENCE_KEYS,
    ),
    "cispo": _record(
        cispo_loss,
        clips=True,
        always_splits_clip_sides=True,
        keys=RATIO_KEYS | CLIP_KEYS,
    ),
    "sapo": _record(
        sapo_loss,
        keys=RATIO_KEYS,
        own_options=("sapo_temperature_pos", "sapo_temperature_neg"),
    ),
    "gmpo": _record(
        gmpo_loss,
        clips=True,
        per_sequence=True,
        always_splits_clip_sides=True,
        keys=RATIO_KEYS | CLIP_KEYS | SEQUENCE_KEYS,
    ),
    "luspo": _record(
        luspo_loss,
        clips=True,
        capped=True,
        per_sequence=True,
        keys=RATIO_KEYS | CLIP_KEYS | SEQUENCE_KEYS,
    ),
    "vespo": _record(
        vespo_loss,
        keys=RATIO_KEYS | {"gamma_weight_mean"},
        own_options=VESPO_OPTIONS,
    ),
    "dppo_tv": _record(
        dppo_tv_loss,
        clips=True,
        truncates=True,
        always_splits_clip_sides=True,
        keys=RATIO_KEYS | CLIP_KEYS,
    ),
    "dppo_kl": _record(
        dppo_kl_loss,
        clips=True,
        truncates=True,
        always_splits_clip_sides=True,
        keys=RATIO_KEYS | CLIP_KEYS,
    ),
    "clip_cov": _record(
        clip_cov_loss,
        clips=True,
        always_splits_clip_sides=True,
        needs_every_row=True,
        keys=RATIO_KEYS | CLIP_KEYS | {"covariance_selected_mean"},
        own_options=("covariance_fraction", "clip_cov_low", "clip_cov_high"),
    ),
    "kl_cov": _record(
        kl_cov_loss,
        needs_every_row=True,
        keys=RATIO_KEYS | {"covariance_selected_mean"},
        own_options=("covariance_fraction", "kl_cov_coef"),
    ),
}
OBJECTIVES: dict[str, Objective] = {
    name: record.loss for name, record in OBJECTIVE_RECORDS.items()
}
REWEIGHTING_METHODS = tuple(OBJECTIVE_RECORDS)


def _methods_where(fact: str) -> frozenset[str]:
    return frozenset(
        name for name, record in OBJECTIVE_RECORDS.items() if getattr(record, fact)
    )


# Methods that weigh by pi / pi_old, those that also clip that ratio, and those
# with one ratio per response (they need the response mask).
RATIO_METHODS = _methods_where("uses_ratio")
CLIPPED_METHODS = _methods_where("clips")
SEQUENCE_METHODS = _methods_where("per_sequence")
# Methods that always report clip_low_* and clip_high_* (grpo and gspo do once
# cliprange_high or ratio_cap is set).
SPLIT_CLIP_METHODS = _methods_where("always_splits_clip_sides")
# Methods whose unclipped term the dual-clip cap bounds, and those whose
# detached weight ratio_cap truncates (DPPO).
CAPPED_METHODS = _methods_where("capped")
TRUNCATED_METHODS = _methods_where("truncates")
# Methods whose loss reads every row of the microbatch.
EVERY_ROW_METHODS = _methods_where("needs_every_row")


def option_readers() -> dict[str, tuple[str, ...]]:
    """Each objective-specific option (a record's ``own_options``) and the
    methods that read it."""
    readers: dict[str, list[str]] = {}
    for name, record in OBJECTIVE_RECORDS.items():
        for option in record.own_options:
            readers.setdefault(option, []).append(name)
    return {option: tuple(methods) for option, methods in readers.items()}


def check_objective_settings(
    method: str,
    cliprange: float | None,
    *,
    cliprange_high: float | None = None,
    ratio_cap: float | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    off_policy_mask_threshold: float | None = None,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
    covariance_fraction: float = 2e-4,
    clip_cov_low: float = 1.0,
    clip_cov_high: float = 5.0,
    kl_cov_coef: float = 0.1,
) -> None:
    """The one check of an objective's name and options (config and callers).

    A clipped method needs cliprange > 0; cliprange_high is None or > 0;
    ratio_cap is None or above the upper clip bound 1 + eps_high (at or below
    it, the cap would remove gradients the clip keeps: another objective, not a
    dual clip; above 1 for DPPO's truncated weight); SAPO temperatures are > 0;
    off_policy_mask_threshold is None or a finite number >= 0; VESPO's k are
    finite >= 0 and its lambda finite >= 1e-4 (TRL floors lambda there);
    covariance_fraction is in (0, 1]; clip_cov_low < clip_cov_high, both
    finite; kl_cov_coef is finite >= 0. Options a method does not read are
    still range-checked, and named by ``TrainConfig``'s inert settings.
    """
    if method not in OBJECTIVE_RECORDS:
        raise ValueError(
            "importance_reweighting_method must be one of "
            f"{tuple(OBJECTIVE_RECORDS)}, got {method!r}"
        )
    if method in CLIPPED_METHODS and not is_positive_number(
        cliprange, allow_infinity=True
    ):
        raise ValueError(
            f"cliprange must be positive for {method!r}, got {cliprange!r}"
        )
    if cliprange_high is not None and not is_positive_number(cliprange_high):
        raise ValueError(
            "cliprange_high must be None (the same as cliprange) or a positive "
            f"number, got {cliprange_high!r}"
        )
    _check_ratio_cap(method, cliprange, cliprange_high, ratio_cap)
    for name, value in (
        ("sapo_temperature_pos", sapo_temperature_pos),
        ("sapo_temperature_neg", sapo_temperature_neg),
    ):
        if not is_positive_number(value):
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    if off_policy_mask_threshold is not None and not _is_at_least(
        off_policy_mask_threshold, 0.0
    ):
        raise ValueError(
            "off_policy_mask_threshold must be None (no mask) or a finite number "
            f">= 0 (a mean log(pi_old / pi)), got {off_policy_mask_threshold!r}"
        )
    _check_vespo(vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg)
    _check_covariance(covariance_fraction, clip_cov_low, clip_cov_high, kl_cov_coef)


def _is_at_least(value: object, floor: float) -> bool:
    """A finite number (not a bool) >= floor."""
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= floor
    )


def _check_vespo(
    k_pos: float, lambda_pos: float, k_neg: float, lambda_neg: float
) -> None:
    for name, value in (("vespo_k_pos", k_pos), ("vespo_k_neg", k_neg)):
        if not _is_at_least(value, 0.0):
            raise ValueError(
                f"{name} must be a finite number >= 0 (the gamma weight's power), "
                f"got {value!r}"
            )
    for name, value in (
        ("vespo_lambda_pos", lambda_pos),
        ("vespo_lambda_neg", lambda_neg),
    ):
        if not _is_at_least(value, 1e-4):
            raise ValueError(
                f"{name} must be a finite number >= 1e-4 (the gamma weight's rate; "
                f"TRL floors it at 1e-4), got {value!r}"
            )


def _check_covariance(
    fraction: float, clip_cov_low: float, clip_cov_high: float, kl_cov_coef: float
) -> None:
    if not (is_positive_number(fraction) and fraction <= 1):
        raise ValueError(
            "covariance_fraction must be a number in (0, 1] (the share of a "
            f"microbatch's tokens Clip-Cov or KL-Cov selects), got {fraction!r}"
        )
    for name, value in (
        ("clip_cov_low", clip_cov_low),
        ("clip_cov_high", clip_cov_high),
    ):
        if not _is_at_least(value, -math.inf):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
    if clip_cov_low >= clip_cov_high:
        raise ValueError(
            f"clip_cov_low must be below clip_cov_high ({clip_cov_high!r}), "
            f"got {clip_cov_low!r}"
        )
    if not _is_at_least(kl_cov_coef, 0.0):
        raise ValueError(
            f"kl_cov_coef must be a finite number >= 0, got {kl_cov_coef!r}"
        )


def _check_ratio_cap(
    method: str,
    cliprange: float | None,
    cliprange_high: float | None,
    ratio_cap: float | None,
) -> None:
    if ratio_cap is None:
        return
    bound = 1.0  # none, a truncated weight (DPPO) or a cap that does nothing
    if method in CAPPED_METHODS:
        bound = 1 + effective_cliprange_high(cliprange, cliprange_high)
    if not is_positive_number(ratio_cap) or ratio_cap <= bound:
        raise ValueError(
            f"ratio_cap must be None (no cap) or a finite number above the upper "
            f"clip bound {bound:g}, got {ratio_cap!r}"
        )


def is_positive_number(value: object, allow_infinity: bool = False) -> bool:
    """A number > 0 (not a bool, not NaN; infinite only if allowed: an infinite
    clip range means no clipping, an infinite divisor means no loss)."""
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and (math.isfinite(value) or (allow_infinity and value == math.inf))
        and value > 0
    )


def _check_loss_shapes(
    advantages: torch.Tensor,
    policy_log_probs: torch.Tensor,
    response_mask: torch.Tensor | None,
) -> None:
    for name, value in (
        ("raw_rewards_or_advantages", advantages),
        ("policy_log_probs", policy_log_probs),
    ):
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(value).__name__}")
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
    options: ObjectiveOptions,
    policy_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor | None,
    response_mask: torch.Tensor | None,
) -> None:
    method, record = options.importance_reweighting_method, options.record
    if not record.uses_ratio:
        return
    if not isinstance(old_log_probs, torch.Tensor):
        raise ValueError(
            f"old_log_probs must be a tensor for {method!r} reweighting, got "
            f"{type(old_log_probs).__name__ if old_log_probs is not None else None}"
        )
    if old_log_probs.shape != policy_log_probs.shape:
        raise ValueError(
            f"old_log_probs must have shape {tuple(policy_log_probs.shape)} like "
            f"policy_log_probs, got {tuple(old_log_probs.shape)}"
        )
    if record.per_sequence and response_mask is None:
        raise ValueError(
            f"response_mask must be a tensor for {method!r} reweighting, got None"
        )


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
    luspo:  the gspo loss times the response's length L, on every token
            (LUSPO, arXiv:2602.05261: with the sequence normalization, the
            mean over responses of L * the GSPO term, TRL's luspo)
    vespo:  -sg(phi(W)) * A * log pi, W = exp(sum_t log w_t) the sequence's
            ratio, phi(W) = exp(lam) W^k exp(-lam W), (k, lam) by A's sign
            (VESPO, arXiv:2602.10693; TRL's clamps kept: :func:`vespo_weights`)
    dppo_tv, dppo_kl: -A * sg(min(w, ratio_cap)) * log pi on the tokens whose
            probability moved within the trust region, 0 elsewhere: p - p_old
            <= eps_high for A > 0, >= -eps_low for A <= 0 (TV), or the binary
            KL of (p_old, p) <= eps_high / eps_low on the side the token moved
            (KL); eps are divergences, not ratio ranges (DPPO,
            arXiv:2602.04879, verl's dppo_tv / dppo_kl)
    clip_cov: the grpo clip (no dual clip), except that
            max(1, floor(covariance_fraction * n)) tokens, drawn at random (torch's
            global generator, as verl draws) among the unclipped tokens whose
            cov = (A - mean A)(log pi - mean log pi) lies in (clip_cov_low,
            clip_cov_high), get no loss and no gradient (Clip-Cov,
            arXiv:2505.22617, verl's clip_cov)
    kl_cov: -A * w, plus kl_cov_coef * |log w| on the max(1, floor(
            covariance_fraction * n)) tokens of largest cov (KL-Cov, the same
            paper, verl's kl_cov; no clip)

    Any of them with ``off_policy_mask_threshold``: a response with A < 0 whose
    mean log(pi_old / pi) is above it gets loss 0 (DeepSeek-V3.2,
    :func:`off_policy_sequence_mask`). clip_cov and kl_cov select among the
    tokens of the call: the train step calls once per microbatch, as verl
    selects per micro-batch.

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
