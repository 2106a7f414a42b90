"""One GRPO optimizer step: score, weight, accumulate, guard, step.

Taught in ``notebooks/07_training_step.ipynb``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from grpo_lab.advantages import (
    compute_group_normalized_rewards,
    compute_rollout_rewards,
)
from grpo_lab.kl import check_kl_settings, compute_kl_penalty
from grpo_lab.logprobs import (
    check_logits_chunk_size,
    check_temperature,
    get_response_log_probs,
)
from grpo_lab.losses import (
    CLIP_SIDE_KEYS,
    CLIPPED_METHODS,
    RATIO_METHODS,
    SEQUENCE_METHODS,
    SPLIT_CLIP_METHODS,
    Method,
    ObjectiveOptions,
    aggregate_loss_across_microbatch,
    check_entropy_settings,
    check_loss_normalization,
    check_objective_settings,
    compute_policy_gradient_loss,
    high_entropy_mask,
    microbatch_loss_scale,
)
from grpo_lab.masks import tokenize_prompt_and_output
from grpo_lab.prefix_sharing import check_share_prompt_prefix, shared_prefix_length
from grpo_lab.sampler_correction import (
    DEFAULT_CAP,
    DEFAULT_HIGH,
    DEFAULT_LOW,
    check_sampler_correction,
    correction_weights,
    sampler_correction_weights,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

BATCH_KEYS = ("input_ids", "labels", "response_mask")
_COUNT_KEYS = (
    "clip_count",
    "clip_total",
    "importance_ratio_count",
    "clip_low_count",
    "clip_high_count",
)

StepResult = tuple[torch.Tensor, dict[str, torch.Tensor | float]]


@dataclass(frozen=True)
class UpdateSettings:
    """How each microbatch is scored and reduced; checked when constructed.

    The loss-side arguments of :func:`policy_gradient_update`, in one object that
    ``TrainConfig`` builds too, so a run and a direct call share one check.
    ``logits_chunk_size=None`` reads ``model.config.grpo_logits_chunk_size``, the
    reference design's channel (see :func:`grpo_lab.logprobs.get_response_log_probs`).
    Every default is the reference design's update.
    """

    importance_reweighting_method: str = "none"
    cliprange: float | None = None
    loss_normalization: str = "sequence"
    normalization_constant: float | None = None
    temperature: float = 1.0
    logits_chunk_size: int | None = None
    share_prompt_prefix: bool | str = False  # or "auto"
    # Objective options (see grpo_lab.losses.compute_policy_gradient_loss).
    cliprange_high: float | None = None
    ratio_cap: float | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    # beta * KL(pi || pi_ref) per token (grpo_lab.kl); 0: no penalty.
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    # Weigh each token's KL by pi / pi_old (TRL's use_bias_correction_kl).
    kl_importance_weighting: bool = False
    # - entropy_coef * H per token (an entropy bonus, with its gradient).
    entropy_coef: float = 0.0
    # Only tokens in this top fraction of the microbatch's entropies get the
    # policy gradient (1: every token).
    top_entropy_quantile: float = 1.0
    # Importance-sampling correction against the sampler's own log-probs
    # (grpo_lab.sampler_correction; TRL's vllm_importance_sampling_*): "none",
    # token_/sequence_ truncate (at cap) or mask (outside [low, high]).
    sampler_correction: str = "none"
    sampler_correction_cap: float = DEFAULT_CAP
    sampler_correction_low: float = DEFAULT_LOW
    sampler_correction_high: float = DEFAULT_HIGH

    def __post_init__(self) -> None:
        check_objective_settings(
            self.importance_reweighting_method,
            self.cliprange,
            cliprange_high=self.cliprange_high,
            ratio_cap=self.ratio_cap,
            sapo_temperature_pos=self.sapo_temperature_pos,
            sapo_temperature_neg=self.sapo_temperature_neg,
        )
        check_loss_normalization(self.loss_normalization, self.normalization_constant)
        check_kl_settings(self.kl_coef, self.kl_estimator)
        check_entropy_settings(self.entropy_coef, self.top_entropy_quantile)
        check_temperature(self.temperature)
        check_share_prompt_prefix(self.share_prompt_prefix)
        if self.logits_chunk_size is not None:
            check_logits_chunk_size(self.logits_chunk_size)
        check_sampler_correction(
            self.sampler_correction,
            self.sampler_correction_cap,
            self.sampler_correction_low,
            self.sampler_correction_high,
        )

    @property
    def every_row_has_gradient(self) -> bool:
        """A KL penalty or an entropy bonus moves even zero-advantage rows."""
        return self.kl_coef > 0 or self.entropy_coef > 0

    @property
    def scores_every_row(self) -> bool:
        """Whether zero-advantage rows must be scored too: for their gradient, or
        because the high-entropy threshold is a quantile over every token."""
        return self.every_row_has_gradient or self.top_entropy_quantile < 1.0

    @property
    def objective_options(self) -> ObjectiveOptions:
        """The options the objective reads."""
        return ObjectiveOptions(
            cliprange=self.cliprange,
            cliprange_high=self.cliprange_high,
            ratio_cap=self.ratio_cap,
            sapo_temperature_pos=self.sapo_temperature_pos,
            sapo_temperature_neg=self.sapo_temperature_neg,
        )


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
    baseline: Literal["mean", "none", "leave_one_out"] = "mean",
    advantage_eps: float = 1e-6,
    advantage_normalizer: Literal["std", "none", "mean", "batch_std"] = "std",
    importance_reweighting_method: Method = "none",
    old_log_probs: torch.Tensor | None = None,
    cliprange: float | None = None,
    loss_normalization: Literal["sequence", "constant", "token"] = "sequence",
    normalization_constant: int | None = None,
    *,
    nan_rewards: Literal["propagate", "ignore"] = "propagate",
    reference_log_probs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    **options: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
    """One GRPO step from texts: rewards -> group advantages -> tokens -> update.

    Rewards are scored once for the whole batch (:func:`rollout_advantages`), the
    texts are tokenized with :func:`tokenize_prompt_and_output`, and the step
    itself is :func:`policy_gradient_update`. When every advantage is zero nothing
    is tokenized or scored, the optimizer does not step, and the update's
    diagnostics read 0 (the reference design's keys). Metadata holds the reward
    and advantage statistics and the update's diagnostics.

    Keyword-only extras (defaults: the reference design's step): ``nan_rewards``
    (:func:`grpo_lab.advantages.compute_group_normalized_rewards`),
    ``reference_log_probs`` (B, T) with ``kl_coef`` and ``kl_estimator`` (a KL
    penalty to a reference policy, :mod:`grpo_lab.kl`), and ``options``: any
    other :class:`UpdateSettings` field (``cliprange_high``, ``ratio_cap``,
    ``entropy_coef``, ``top_entropy_quantile``, ``temperature``, ...).
    """
    _check_rollout_lists(
        repeated_prompts, rollout_responses, repeated_ground_truths, group_size
    )
    settings = _update_settings(
        importance_reweighting_method=importance_reweighting_method,
        cliprange=cliprange,
        loss_normalization=loss_normalization,
        normalization_constant=normalization_constant,
        kl_coef=kl_coef,
        kl_estimator=kl_estimator,
        **options,
    )
    check_update_inputs(
        settings,
        gradient_accumulation_steps,
        max_grad_norm,
        len(rollout_responses),
        old_log_probs,
        reference_log_probs,
    )
    _, advantages, metadata = rollout_advantages(
        reward_fn,
        rollout_responses,
        repeated_ground_truths,
        group_size,
        baseline=baseline,
        advantage_eps=advantage_eps,
        advantage_normalizer=advantage_normalizer,
        nan_rewards=nan_rewards,
    )  # (B,)
    if not (advantages != 0).any() and not settings.every_row_has_gradient:
        optimizer.zero_grad(set_to_none=True)
        zero_loss, skipped = _zero_diagnostics(settings, _device_of(model))
        return zero_loss, {**metadata, **skipped}
    batch = tokenize_prompt_and_output(
        repeated_prompts, rollout_responses, tokenizer
    )  # (B, T) each
    loss, update_metadata = policy_gradient_update(
        model,
        optimizer,
        gradient_accumulation_steps,
        max_grad_norm,
        batch,
        advantages,
        old_log_probs=old_log_probs,
        reference_log_probs=reference_log_probs,
        **dataclasses.asdict(settings),
    )
    return loss, {**metadata, **update_metadata}


def _update_settings(**fields: Any) -> UpdateSettings:
    """UpdateSettings from keywords; an unknown name is a ValueError naming it."""
    known = {f.name for f in dataclasses.fields(UpdateSettings)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(
            f"unknown update option(s) {unknown}; expected some of {sorted(known)}"
        )
    return UpdateSettings(**fields)


def rollout_advantages(
    reward_fn: Callable[[str, str], dict[str, float]],
    rollout_responses: list[str],
    repeated_ground_truths: list[str],
    group_size: int,
    *,
    baseline: str = "mean",
    advantage_eps: float = 1e-6,
    advantage_normalizer: str = "std",
    nan_rewards: str = "propagate",
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Raw rewards (B,), group-normalized advantages (B,) and their statistics.

    Each response is scored once (:func:`compute_rollout_rewards`), then
    normalized within its group of ``group_size``
    (:func:`compute_group_normalized_rewards`). The one place both the step and
    the training loop turn responses into advantages.
    """
    raw_rewards, reward_metadata = compute_rollout_rewards(
        reward_fn, rollout_responses, repeated_ground_truths
    )  # (B,)
    advantages, advantage_metadata = compute_group_normalized_rewards(
        raw_rewards,
        group_size,
        baseline,
        advantage_eps,
        advantage_normalizer,
        nan_rewards=nan_rewards,
    )  # (B,)
    return raw_rewards, advantages, {**reward_metadata, **advantage_metadata}


def policy_gradient_update(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    gradient_accumulation_steps: int,
    max_grad_norm: float | None,
    batch: Mapping[str, torch.Tensor],
    advantages: torch.Tensor,
    importance_reweighting_method: Method = "none",
    old_log_probs: torch.Tensor | None = None,
    cliprange: float | None = None,
    loss_normalization: Literal["sequence", "constant", "token"] = "sequence",
    normalization_constant: int | None = None,
    *,
    temperature: float = 1.0,
    logits_chunk_size: int | None = None,
    share_prompt_prefix: bool | Literal["auto"] = False,
    cliprange_high: float | None = None,
    ratio_cap: float | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    reference_log_probs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    kl_importance_weighting: bool = False,
    entropy_coef: float = 0.0,
    top_entropy_quantile: float = 1.0,
    sampler_log_probs: torch.Tensor | None = None,
    sampler_correction: str = "none",
    sampler_correction_cap: float = DEFAULT_CAP,
    sampler_correction_low: float = DEFAULT_LOW,
    sampler_correction_high: float = DEFAULT_HIGH,
    grad_scaler: torch.amp.GradScaler | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
    """One optimizer step on a tokenized batch with precomputed advantages.

    ``batch`` holds ``input_ids``, ``labels`` and ``response_mask``, each (B, T),
    as made by :func:`grpo_lab.masks.pad_prompt_and_response_ids`; ``advantages``
    is (B,), ``old_log_probs`` and ``reference_log_probs`` (B, T). The loss is

        sequence: sum over microbatches m of  (|m| / B) * mean_{i in m} loss_i
        constant: sum over microbatches m of  sum_{i in m, t} loss_it / C
        token:    sum over microbatches m of  (n_m / N) * mean_{t in m} loss_t

    with n_m, N the response tokens of m and of the whole batch
    (:func:`grpo_lab.losses.microbatch_loss_scale`), which equals the full-batch
    loss for any ``gradient_accumulation_steps`` (microbatches of
    ceil(B / steps) rows). Each token's loss is :func:`microbatch_loss`'s:
    the objective (only on high-entropy tokens when ``top_entropy_quantile`` <
    1; that quantile is taken per microbatch, as TRL does), plus ``kl_coef``
    times the KL estimate to the reference, minus ``entropy_coef`` times the
    token's entropy. Responses with zero advantage are not scored, since
    their gradient is exactly zero, but still count in B (and in N) -- unless
    a KL penalty or an entropy bonus gives them a gradient, or the entropy
    quantile must see their tokens: then every row is scored. Tokens are scored by
    :func:`score_tokens`: from ``logits / temperature``, the distribution
    rollouts sampled at that temperature come from, with ``logits_chunk_size``,
    and with ``share_prompt_prefix`` running the prompt columns every row of a
    microbatch is still in once per distinct prompt instead of once per
    response: the same gradient, with less work.

    ``sampler_log_probs`` (B, T): the rollout sampler's log-probs of the response
    tokens. With a ``sampler_correction`` mode each token's objective is weighted
    by :func:`grpo_lab.sampler_correction.correction_weights` of pi_trainer /
    pi_sampler, pi_trainer being ``old_log_probs`` when given, else the current
    log-probs detached (pi_old = pi_theta at the first update). Whenever
    ``sampler_log_probs`` is given the metadata adds the log-prob gap
    (``sampler_log_prob_diff_mean`` / ``_max``), and with a mode on the
    ``is_*`` diagnostics, over the scored responses.

    Raises ``RuntimeError`` before ``optimizer.step`` (parameters untouched) if a
    loss, a diagnostic mean or the gradient norm is not finite. When every
    advantage is zero nothing is scored, the optimizer does not step, and the
    metadata holds only what is true of such a step: ``optimizer_step`` 0 and
    ``active_response_count`` 0 (no loss, entropy or gradient norm to report).

    ``grad_scaler`` (float16 autocast): each microbatch backpropagates
    ``loss * scale``, the gradients are unscaled before clipping, and a step
    whose gradients overflowed is skipped by the scaler (parameters untouched,
    the scale lowered) and reported as ``loss_scale_skipped`` 1, not raised:
    overflow is how a dynamic loss scale finds its size. A non-finite loss is
    still refused as above.
    """
    settings = UpdateSettings(
        importance_reweighting_method,
        cliprange,
        loss_normalization,
        normalization_constant,
        temperature,
        logits_chunk_size,
        share_prompt_prefix,
        cliprange_high,
        ratio_cap,
        sapo_temperature_pos,
        sapo_temperature_neg,
        kl_coef,
        kl_estimator,
        kl_importance_weighting,
        entropy_coef,
        top_entropy_quantile,
        sampler_correction=sampler_correction,
        sampler_correction_cap=sampler_correction_cap,
        sampler_correction_low=sampler_correction_low,
        sampler_correction_high=sampler_correction_high,
    )
    batch_size = _check_batch(
        batch, advantages, old_log_probs, reference_log_probs, sampler_log_probs
    )
    check_update_inputs(
        settings,
        gradient_accumulation_steps,
        max_grad_norm,
        batch_size,
        old_log_probs,
        reference_log_probs,
        sampler_log_probs=sampler_log_probs,
    )
    device = _device_of(model)
    optimizer.zero_grad(set_to_none=True)
    active_indices = torch.nonzero(advantages != 0, as_tuple=False).flatten()
    if active_indices.numel() == 0 and not settings.every_row_has_gradient:
        zero_loss = torch.zeros((), dtype=torch.float32, device=device)
        return zero_loss, {"optimizer_step": 0.0, "active_response_count": 0.0}
    if settings.scores_every_row:
        active_indices = torch.arange(batch_size, device=advantages.device)
    active = _select_rows(
        batch,
        advantages,
        old_log_probs,
        reference_log_probs,
        active_indices,
        sampler_log_probs=sampler_log_probs,
    )
    # Keep the configured microbatch size; fewer active rows mean fewer microbatches.
    microbatch_size = -(-batch_size // gradient_accumulation_steps)
    batch_tokens = int(batch["response_mask"].sum())  # skipped rows count too
    accumulator = _accumulate_gradients(
        model,
        active,
        microbatch_size,
        (batch_size, batch_tokens),
        settings,
        device,
        grad_scaler,
    )
    if grad_scaler is None:
        gradient_norm = _checked_gradient_norm(model, max_grad_norm, device)
        optimizer.step()
        stepped = 1.0
    else:
        gradient_norm, stepped = _scaled_step(
            model, optimizer, max_grad_norm, grad_scaler
        )
    optimizer.zero_grad(set_to_none=True)
    metadata = accumulator.summary()
    metadata.update(
        gradient_norm=gradient_norm.detach(),
        optimizer_step=stepped,
        active_response_count=float(active_indices.numel()),
    )
    if grad_scaler is not None:
        metadata.update(
            loss_scale_skipped=1.0 - stepped, loss_scale=grad_scaler.get_scale()
        )
    if sampler_log_probs is not None:
        metadata.update(_sampler_metrics(active, accumulator, settings))
    return metadata["loss"], metadata


def _sampler_metrics(
    active: Mapping[str, torch.Tensor],
    accumulator: _DiagnosticAccumulator,
    settings: UpdateSettings,
) -> dict[str, float]:
    """The sampler gap and correction diagnostics of the scored rows, computed
    once on all of them (min and max do not add up across microbatches)."""
    trainer_log_probs = torch.cat(accumulator.trainer_log_probs)  # (A, T)
    device = trainer_log_probs.device
    _, metrics = sampler_correction_weights(
        trainer_log_probs,
        active["sampler_log_probs"].to(device),
        active["response_mask"].to(device),
        mode=settings.sampler_correction,
        cap=settings.sampler_correction_cap,
        low=settings.sampler_correction_low,
        high=settings.sampler_correction_high,
    )
    return metrics


def score_tokens(
    model: torch.nn.Module,
    batch: Mapping[str, torch.Tensor],
    settings: UpdateSettings,
    *,
    return_token_entropy: bool = False,
    entropy_gradient: bool = False,
) -> dict[str, torch.Tensor]:
    """log pi(label) (B, T) of a tokenized batch, scored as ``settings`` say.

    The one scoring call of an update and of the loop's old and reference
    log-probs: the sampling temperature, the output-head chunk, and (with
    ``share_prompt_prefix``) the prompt columns run once per distinct prompt.
    ``entropy_gradient``: the entropy keeps its gradient (an entropy bonus).
    """
    mask = batch["response_mask"]  # (B, T)
    return get_response_log_probs(
        model,
        batch["input_ids"],
        batch["labels"],
        return_token_entropy,
        settings.logits_chunk_size,
        temperature=settings.temperature,
        shared_prefix_length=shared_prefix_length(
            mask, settings.share_prompt_prefix, batch["input_ids"], batch["labels"]
        ),
        entropy_gradient=entropy_gradient,
    )


def microbatch_loss(
    log_probs: torch.Tensor,
    token_entropy: torch.Tensor,
    microbatch: Mapping[str, torch.Tensor],
    settings: UpdateSettings,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One microbatch's aggregated loss (before its microbatch scale) and
    diagnostics.

    Per token t of a response:

        loss_t = objective_t * e_t * s_t + kl_coef * w_t * KL_t - entropy_coef * H_t

    objective_t from :func:`grpo_lab.losses.compute_policy_gradient_loss`;
    e_t = 1, or the high-entropy mask when ``top_entropy_quantile`` < 1
    (:func:`grpo_lab.losses.high_entropy_mask`); s_t = 1, or the detached
    sampler-correction weight (:func:`grpo_lab.sampler_correction.correction_weights`
    of pi_old / pi_sampler, pi_old = ``old_log_probs`` or the current log-probs
    detached; on the objective only, as TRL weighs it); KL_t the ``kl_estimator`` of
    the policy against ``microbatch["reference_log_probs"]``
    (:func:`grpo_lab.kl.compute_kl_penalty`), and w_t = pi / pi_old when
    ``kl_importance_weighting`` (one ratio per response for gspo and gmpo; 1
    with its gradient on-policy), else 1; H_t the token's entropy, with its
    gradient when ``entropy_coef`` > 0. Then reduced by ``loss_normalization``
    (:func:`grpo_lab.losses.aggregate_loss_across_microbatch`): like
    DeepSeekMath, the KL joins each token's loss before averaging.
    ``microbatch`` holds ``response_mask`` and ``advantages`` (b,), and
    ``old_log_probs`` / ``reference_log_probs`` (b, T) when used. Diagnostics
    add ``kl_mean`` (the token mean of KL_t) and ``entropy_mask_mean`` (the
    fraction of tokens kept) when those are on.
    """
    mask = microbatch["response_mask"]  # (b, T)
    old_log_probs = microbatch.get("old_log_probs")
    per_token_loss, diagnostics = compute_policy_gradient_loss(
        microbatch["advantages"],
        log_probs,
        settings.importance_reweighting_method,
        old_log_probs,
        settings.cliprange,
        mask,
        cliprange_high=settings.cliprange_high,
        ratio_cap=settings.ratio_cap,
        sapo_temperature_pos=settings.sapo_temperature_pos,
        sapo_temperature_neg=settings.sapo_temperature_neg,
    )  # (b, T)
    if settings.top_entropy_quantile < 1.0:
        kept = high_entropy_mask(token_entropy, mask, settings.top_entropy_quantile)
        per_token_loss = per_token_loss * kept  # (b, T)
        diagnostics["entropy_mask_mean"] = _masked_mean(kept.float(), mask)
    if settings.sampler_correction != "none":
        per_token_loss = per_token_loss * _sampler_weights(
            log_probs, microbatch, settings
        )  # (b, T)
    if settings.kl_coef > 0:
        kl = compute_kl_penalty(
            log_probs, microbatch["reference_log_probs"], settings.kl_estimator
        )  # (b, T)
        diagnostics["kl_mean"] = _masked_mean(kl, mask)
        weights = _kl_weights(log_probs, old_log_probs, mask, settings)
        per_token_loss = per_token_loss + settings.kl_coef * (kl * weights)
    if settings.entropy_coef > 0:
        per_token_loss = per_token_loss - settings.entropy_coef * token_entropy
    loss = aggregate_loss_across_microbatch(
        per_token_loss,
        mask,
        settings.loss_normalization,
        settings.normalization_constant,
    )
    return loss, diagnostics


def _sampler_weights(
    log_probs: torch.Tensor,
    microbatch: Mapping[str, torch.Tensor],
    settings: UpdateSettings,
) -> torch.Tensor:
    """Detached weights (b, T) of pi_old / pi_sampler, truncated or masked."""
    old_log_probs = microbatch.get("old_log_probs")
    weights, _ = correction_weights(
        log_probs.detach() if old_log_probs is None else old_log_probs,
        microbatch["sampler_log_probs"],
        microbatch["response_mask"],
        mode=settings.sampler_correction,
        cap=settings.sampler_correction_cap,
        low=settings.sampler_correction_low,
        high=settings.sampler_correction_high,
    )
    return weights


def _kl_weights(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor | None,
    mask: torch.Tensor,
    settings: UpdateSettings,
) -> torch.Tensor | float:
    """pi / pi_old per token (per response for gspo, gmpo), or 1. (b, T) or (b, 1)

    On-policy (no old log-probs) the ratio is exp(log pi - sg(log pi)): 1, whose
    gradient d/d log pi is 1 (TRL's bias-corrected KL).
    """
    if not settings.kl_importance_weighting:
        return 1.0
    old = log_probs if old_log_probs is None else old_log_probs
    dtype = torch.promote_types(log_probs.dtype, torch.float32)
    log_ratio = log_probs.to(dtype) - old.detach().to(dtype)  # (b, T)
    if settings.importance_reweighting_method in SEQUENCE_METHODS:
        weights = mask.to(dtype)  # (b, T)
        log_ratio = (log_ratio * weights).sum(dim=1, keepdim=True) / weights.sum(
            dim=1, keepdim=True
        ).clamp_min(1)  # (b, 1)
    return torch.exp(log_ratio)


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Detached mean of values over the response tokens (0 when there are none)."""
    token_mask = mask.bool()  # (b, T)
    total = values.detach().masked_fill(~token_mask, 0.0).sum()
    return total / token_mask.sum().clamp_min(1)


def check_update_inputs(
    settings: UpdateSettings,
    gradient_accumulation_steps: int,
    max_grad_norm: float | None,
    batch_size: int,
    old_log_probs: torch.Tensor | None,
    reference_log_probs: torch.Tensor | None = None,
    *,
    sampler_log_probs: torch.Tensor | None = None,
) -> None:
    """What must hold before anything is scored, beyond ``settings`` themselves."""
    check_gradient_accumulation_steps(gradient_accumulation_steps, batch_size)
    check_max_grad_norm(max_grad_norm)
    method = settings.importance_reweighting_method
    if method in RATIO_METHODS and old_log_probs is None:
        raise ValueError(
            f"old_log_probs must be a tensor for {method!r} reweighting, got None"
        )
    if settings.kl_coef > 0 and reference_log_probs is None:
        raise ValueError(
            f"reference_log_probs must be a tensor when kl_coef > 0 "
            f"({settings.kl_coef}), got None"
        )
    if settings.sampler_correction != "none" and sampler_log_probs is None:
        raise ValueError(
            f"sampler_correction is {settings.sampler_correction!r} but "
            "sampler_log_probs is None: the rollout backend returned no sampler "
            "log-probs (use one that reports them, or sampler_correction='none')"
        )


def check_gradient_accumulation_steps(steps: int, batch_size: int) -> None:
    """1 <= steps <= batch size (each microbatch holds at least one row)."""
    if (
        not (isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1)
        or steps > batch_size
    ):
        raise ValueError(
            f"gradient_accumulation_steps must be between 1 and the batch size "
            f"{batch_size}, got {steps!r}"
        )


def check_max_grad_norm(max_grad_norm: float | None) -> None:
    """None (no clipping) or a finite number > 0.

    A negative norm would flip every gradient (train backwards) and 0 would
    zero them, so both are refused.
    """
    if max_grad_norm is None:
        return
    if not (
        isinstance(max_grad_norm, (int, float))
        and not isinstance(max_grad_norm, bool)
        and math.isfinite(max_grad_norm)
        and max_grad_norm > 0
    ):
        raise ValueError(
            "max_grad_norm must be None (no clipping) or a finite number > 0, "
            f"got {max_grad_norm!r}"
        )


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _select_rows(
    batch: Mapping[str, torch.Tensor],
    advantages: torch.Tensor,
    old_log_probs: torch.Tensor | None,
    reference_log_probs: torch.Tensor | None,
    indices: torch.Tensor,
    *,
    sampler_log_probs: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The rows ``indices`` of every per-response tensor, keyed by name."""
    tensors = {key: batch[key] for key in BATCH_KEYS}
    tensors["advantages"] = advantages
    if old_log_probs is not None:
        tensors["old_log_probs"] = old_log_probs
    if reference_log_probs is not None:
        tensors["reference_log_probs"] = reference_log_probs
    if sampler_log_probs is not None:
        tensors["sampler_log_probs"] = sampler_log_probs
    return {
        key: value.index_select(0, indices.to(value.device))
        for key, value in tensors.items()
    }


def _accumulate_gradients(
    model: torch.nn.Module,
    active: dict[str, torch.Tensor],
    microbatch_size: int,
    batch_counts: tuple[int, int],
    settings: UpdateSettings,
    device: torch.device,
    grad_scaler: torch.amp.GradScaler | None = None,
) -> _DiagnosticAccumulator:
    """Backpropagate every microbatch of the active rows; gradients add up.

    ``batch_counts``: the whole batch's rows and response tokens (the divisors
    of sequence and token normalization).
    """
    accumulator = _DiagnosticAccumulator(device)
    active_count = active["advantages"].shape[0]
    batch_size, batch_tokens = batch_counts
    for rows in torch.arange(active_count).split(microbatch_size):
        microbatch = {
            key: value.index_select(0, rows.to(value.device)).to(device)
            for key, value in active.items()
        }
        scale = microbatch_loss_scale(
            settings.loss_normalization,
            rows.numel(),
            batch_size,
            microbatch_tokens=int(microbatch["response_mask"].sum()),
            batch_tokens=batch_tokens,
        )
        _backward_microbatch(
            model, microbatch, scale, accumulator, settings, grad_scaler
        )
    return accumulator


def _backward_microbatch(
    model: torch.nn.Module,
    microbatch: dict[str, torch.Tensor],
    scale: float,
    accumulator: _DiagnosticAccumulator,
    settings: UpdateSettings,
    grad_scaler: torch.amp.GradScaler | None = None,
) -> None:
    """Score one microbatch, check it is finite, backpropagate loss * scale
    (times the loss scale of ``grad_scaler``, when given)."""
    mask = microbatch["response_mask"]  # (b, T)
    scored = score_tokens(
        model,
        microbatch,
        settings,
        return_token_entropy=True,
        entropy_gradient=settings.entropy_coef > 0,
    )
    loss, loss_metadata = microbatch_loss(
        scored["log_probs"], scored["token_entropy"], microbatch, settings
    )
    loss = loss * scale
    if "sampler_log_probs" in microbatch:
        old_log_probs = microbatch.get("old_log_probs")
        accumulator.trainer_log_probs.append(
            scored["log_probs"].detach() if old_log_probs is None else old_log_probs
        )
    entropy_sum = (scored["token_entropy"].detach() * mask).sum()
    _check_finite(loss, entropy_sum, loss_metadata)
    (loss if grad_scaler is None else grad_scaler.scale(loss)).backward()
    accumulator.add(loss.detach(), entropy_sum, mask.sum().detach(), loss_metadata)


def _check_finite(
    loss: torch.Tensor,
    entropy_sum: torch.Tensor,
    loss_metadata: dict[str, torch.Tensor],
) -> None:
    if not torch.isfinite(loss):
        raise RuntimeError("Non-finite GRPO loss; optimizer step aborted")
    if not torch.isfinite(entropy_sum):
        raise RuntimeError("Non-finite token entropy; optimizer step aborted")
    # Clipping can hide an overflowing ratio in the loss while backward still
    # produces NaNs, so check the reduced diagnostics too.
    for key, value in loss_metadata.items():
        if key.endswith("_mean") and not torch.isfinite(value):
            raise RuntimeError(f"Non-finite {key}; optimizer step aborted")


class _DiagnosticAccumulator:
    """Weights each microbatch's means by its token (or ratio) count.

    The result is the mean over every scored token of the batch, whatever the
    split into microbatches; counts (clip_count, ...) are summed.
    """

    def __init__(self, device: torch.device):
        zero = torch.zeros((), dtype=torch.float32, device=device)
        self.loss, self.entropy_sum = zero, zero.clone()
        self.token_count = torch.zeros((), dtype=torch.long, device=device)
        self.sums: dict[str, torch.Tensor] = {}
        self.weights: dict[str, torch.Tensor] = {}
        self.counts: dict[str, torch.Tensor] = {}
        # pi_old of the scored rows, in order, when sampler log-probs are given.
        self.trainer_log_probs: list[torch.Tensor] = []

    def add(
        self,
        loss: torch.Tensor,
        entropy_sum: torch.Tensor,
        token_count: torch.Tensor,
        loss_metadata: dict[str, torch.Tensor],
    ) -> None:
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
                self._add_weighted(key, value, weight)

    def _add_weighted(
        self, key: str, value: torch.Tensor, weight: torch.Tensor
    ) -> None:
        self.sums[key] = self.sums.get(key, torch.zeros_like(value)) + value * weight
        self.weights[key] = self.weights.get(key, torch.zeros_like(weight)) + weight

    def summary(self) -> dict[str, torch.Tensor | float]:
        metadata: dict[str, torch.Tensor | float] = {
            key: value / self.weights[key].clamp_min(1)
            for key, value in self.sums.items()
        }
        metadata.update(self.counts)
        if "clip_total" in self.counts:
            total = self.counts["clip_total"].clamp_min(1)
            for side in ("", "_low", "_high"):
                if f"clip{side}_count" in self.counts:
                    metadata[f"clip{side}_fraction"] = (
                        self.counts[f"clip{side}_count"] / total
                    )
        metadata.update(
            loss=self.loss.detach(),
            token_entropy=(self.entropy_sum / self.token_count.clamp_min(1)).detach(),
            response_token_count=self.token_count.detach(),
            entropy_count=self.token_count.detach(),
        )
        return metadata


def _checked_gradient_norm(
    model: torch.nn.Module, max_grad_norm: float | None, device: torch.device
) -> torch.Tensor:
    """Total L2 gradient norm (before clipping to ``max_grad_norm``, if given)."""
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


def _scaled_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    max_grad_norm: float | None,
    grad_scaler: torch.amp.GradScaler,
) -> tuple[torch.Tensor, float]:
    """Unscale, clip, step unless the gradients overflowed; update the scale.

    Returns the unscaled gradient norm and 1.0 when the optimizer stepped, 0.0
    when the scaler skipped the step (an inf or NaN gradient at this scale).
    """
    grad_scaler.unscale_(optimizer)
    parameters = [p for p in model.parameters() if p.grad is not None]
    gradient_norm = torch.nn.utils.clip_grad_norm_(
        parameters, math.inf if max_grad_norm is None else max_grad_norm
    )
    scale_before = grad_scaler.get_scale()
    grad_scaler.step(optimizer)  # skipped when unscale_ found inf or NaN
    grad_scaler.update()
    overflowed = not torch.isfinite(gradient_norm)
    # update() lowers the scale exactly when the step was skipped.
    skipped = overflowed or grad_scaler.get_scale() < scale_before
    return gradient_norm, 0.0 if skipped else 1.0


def _zero_diagnostics(settings: UpdateSettings, device: torch.device) -> StepResult:
    """The reference design's diagnostics of a step with every advantage zero."""
    method = settings.importance_reweighting_method
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
    if method in RATIO_METHODS:
        metadata.update(
            importance_ratio_mean=zero.clone(), importance_ratio_count=zero.clone()
        )
    if method in CLIPPED_METHODS:
        metadata.update(
            clip_count=zero.clone(), clip_total=zero.clone(), clip_fraction=zero.clone()
        )
    if method in SPLIT_CLIP_METHODS or (
        method in CLIPPED_METHODS and settings.objective_options.splits_clip_sides
    ):
        metadata.update({key: zero.clone() for key in CLIP_SIDE_KEYS})
    if settings.top_entropy_quantile < 1.0:
        metadata["entropy_mask_mean"] = zero.clone()
    if settings.kl_coef > 0:
        metadata["kl_mean"] = zero.clone()
    return zero, metadata


def _check_rollout_lists(
    repeated_prompts: list[str],
    rollout_responses: list[str],
    repeated_ground_truths: list[str],
    group_size: int,
) -> None:
    # Responses and truths are checked where they are scored
    # (compute_rollout_rewards); the prompts only reach the tokenizer.
    if isinstance(repeated_prompts, str) or not isinstance(
        repeated_prompts, (list, tuple)
    ):
        raise ValueError(
            "repeated_prompts must be a list of strings, "
            f"got {type(repeated_prompts).__name__}"
        )
    batch_size = len(rollout_responses)
    if batch_size == 0:
        raise ValueError("rollout_responses must hold at least one response, got 0")
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


def _check_batch(
    batch: Mapping[str, torch.Tensor],
    advantages: torch.Tensor,
    old_log_probs: torch.Tensor | None,
    reference_log_probs: torch.Tensor | None = None,
    sampler_log_probs: torch.Tensor | None = None,
) -> int:
    """Check the (B, T) batch against (B,) advantages; return B."""
    if not isinstance(advantages, torch.Tensor):
        raise ValueError(
            f"advantages must be a (B,) tensor, got {type(advantages).__name__}"
        )
    missing = [key for key in BATCH_KEYS if key not in batch]
    if missing:
        raise ValueError(
            f"batch must hold {BATCH_KEYS}, got keys {sorted(batch)} "
            f"(missing {missing})"
        )
    shape = tuple(batch["labels"].shape)
    for key in BATCH_KEYS:
        if batch[key].ndim != 2 or tuple(batch[key].shape) != shape:
            raise ValueError(
                f"batch[{key!r}] must be 2-D with the shape of batch['labels'] "
                f"{shape}, got {tuple(batch[key].shape)}"
            )
    if advantages.ndim != 1 or advantages.shape[0] != shape[0]:
        raise ValueError(
            f"advantages must have shape ({shape[0]},), one per batch row, "
            f"got {tuple(advantages.shape)}"
        )
    if shape[0] == 0:
        raise ValueError("batch must hold at least one row, got 0")
    for name, value in (
        ("old_log_probs", old_log_probs),
        ("reference_log_probs", reference_log_probs),
        ("sampler_log_probs", sampler_log_probs),
    ):
        if value is not None and tuple(value.shape) != shape:
            raise ValueError(
                f"{name} must have the shape of batch['labels'] {shape}, "
                f"got {tuple(value.shape)}"
            )
    return shape[0]
