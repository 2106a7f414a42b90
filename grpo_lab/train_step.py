"""One GRPO optimizer step (one job): score, weight, accumulate, guard, step.

From texts (:func:`grpo_train_step`) or a tokenized batch
(:func:`policy_gradient_update`) to one optimizer step, with the settings that
reach it (:class:`UpdateSettings`) and the checks of its inputs. The clip is
three calls below ``grpo_train_step``: ``policy_gradient_update`` ->
``microbatch_loss`` -> the objective's record (``losses.grpo_clip_loss``).
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
    TOKEN_NORMALIZERS,
    check_rollout_lists,
    rollout_advantages,
)
from grpo_lab.aggregation import (
    DiagnosticAccumulator,
    check_loss_normalization,
    microbatch_loss_scale,
    reduce_masked_loss,
)
from grpo_lab.distillation import check_distillation_settings, distillation_token_loss
from grpo_lab.kl import check_kl_settings, kl_estimate, kl_importance_weights
from grpo_lab.logprobs import (
    check_logits_chunk_size,
    check_temperature,
    get_response_log_probs,
)
from grpo_lab.losses import (
    Method,
    ObjectiveOptions,
    check_entropy_settings,
    mask_off_policy_sequences,
    objective_inputs,
    top_entropy_mask,
)
from grpo_lab.masks import tokenize_prompt_and_output
from grpo_lab.prefix_sharing import check_share_prompt_prefix, prefix_to_share
from grpo_lab.sampler_correction import (
    DEFAULT_CAP,
    DEFAULT_HIGH,
    DEFAULT_LOW,
    check_sampler_correction,
    sampler_weights,
    sampler_weights_and_metrics,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

BATCH_KEYS = ("input_ids", "labels", "response_mask")

StepResult = tuple[torch.Tensor, dict[str, torch.Tensor | float]]


@dataclass(frozen=True, kw_only=True)
class UpdateSettings(ObjectiveOptions):
    """How each microbatch is scored and reduced; checked once, when built.

    The objective's options (:class:`grpo_lab.losses.ObjectiveOptions`, which
    this extends: the objective is handed this object as it is) plus the rest
    of an update's settings. ``TrainConfig.update_settings()`` builds it for a
    run, :func:`policy_gradient_update` from its keywords for a direct call:
    both pass one check. ``logits_chunk_size=None`` reads
    ``model.config.grpo_logits_chunk_size``, the reference design's channel (see
    :func:`grpo_lab.logprobs.get_response_log_probs`). Every default is the
    reference design's update.
    """

    loss_normalization: str = "sequence"
    normalization_constant: float | None = None
    temperature: float = 1.0
    logits_chunk_size: int | None = None
    share_prompt_prefix: bool | str = False  # or "auto"
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
    # On-policy distillation (grpo_lab.distillation): "none", "loss" (the
    # teacher KL d_t as a direct loss) or "reward" (-sg(d_t) as each token's
    # advantage), d_t by distillation_estimator, weighted by distillation_coef;
    # with distillation_task_reward GRPO's task objective is kept beside it.
    distillation: str = "none"
    distillation_estimator: str = "k3"
    distillation_coef: float = 1.0
    distillation_task_reward: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()  # the objective's options
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
        check_distillation_settings(
            self.distillation,
            self.distillation_estimator,
            self.distillation_coef,
            self.distillation_task_reward,
            self.importance_reweighting_method,
        )

    @property
    def distills(self) -> bool:
        """Whether a teacher's log-probs enter the loss."""
        return self.distillation != "none"

    @property
    def keeps_task_objective(self) -> bool:
        """The task objective is in the loss: always without distillation, and
        beside it only with ``distillation_task_reward``."""
        return not self.distills or self.distillation_task_reward

    @property
    def every_row_has_gradient(self) -> bool:
        """A KL penalty, an entropy bonus, a teacher or an objective that reads
        the whole microbatch (Clip-Cov, KL-Cov) moves even zero-advantage rows."""
        return (
            self.kl_coef > 0
            or self.entropy_coef > 0
            or self.distills
            or self.record.needs_every_row
        )

    @property
    def scores_every_row(self) -> bool:
        """Whether zero-advantage rows must be scored too: for their gradient, or
        because the high-entropy threshold is a quantile over every token."""
        return self.every_row_has_gradient or self.top_entropy_quantile < 1.0


def resolve_update_settings(
    settings: UpdateSettings | None, **options: Any
) -> UpdateSettings:
    """``settings`` as given (already checked), else built from ``options``.

    ``options``: the caller's keyword settings, of which those left at the
    reference defaults may accompany ``settings``; any other is a ValueError,
    since one of the two would be ignored.
    """
    if settings is None:
        return UpdateSettings.from_keywords(**options)
    if not isinstance(settings, UpdateSettings):
        raise ValueError(
            f"settings must be an UpdateSettings, got {type(settings).__name__}"
        )
    defaults = {field.name: field.default for field in dataclasses.fields(settings)}
    given = sorted(
        name
        for name, value in options.items()
        if name not in defaults or value != defaults[name]
    )
    if given:
        raise ValueError(
            f"pass the update's settings either as settings= or as keywords, "
            f"not both: got settings and {given}"
        )
    return settings


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
    advantage_normalizer: Literal[
        "std", "none", "mean", "batch_std", "token_whiten"
    ] = "std",
    importance_reweighting_method: Method = "none",
    old_log_probs: torch.Tensor | None = None,
    cliprange: float | None = None,
    loss_normalization: Literal["sequence", "constant", "token"] = "sequence",
    normalization_constant: int | None = None,
    *,
    nan_rewards: Literal["propagate", "ignore"] = "propagate",
    reference_log_probs: torch.Tensor | None = None,
    settings: UpdateSettings | None = None,
    **options: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
    """One GRPO step from texts: rewards -> group advantages -> tokens -> update.

    Rewards are scored once for the whole batch (:func:`rollout_advantages`), the
    texts are tokenized with :func:`tokenize_prompt_and_output`, and the step
    itself is :func:`policy_gradient_update`. When every advantage is zero nothing
    is tokenized or scored, the optimizer does not step, and the update's
    diagnostics read 0 under the keys a step with signal reports. Metadata
    holds the reward and advantage statistics and the update's diagnostics.

    Keyword-only extras (defaults: the reference design's step): ``nan_rewards``
    (:func:`grpo_lab.advantages.compute_group_normalized_rewards`),
    ``reference_log_probs`` (B, T) for a KL penalty (``kl_coef``,
    :mod:`grpo_lab.kl`), and the update's settings: ``settings`` (an
    :class:`UpdateSettings`) or ``options``, any of its fields by name
    (``cliprange_high``, ``kl_coef``, ``entropy_coef``, ``temperature``, ...).
    """
    check_rollout_lists(
        repeated_prompts, rollout_responses, repeated_ground_truths, group_size
    )
    settings = resolve_update_settings(
        settings,
        importance_reweighting_method=importance_reweighting_method,
        cliprange=cliprange,
        loss_normalization=loss_normalization,
        normalization_constant=normalization_constant,
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
    batch = None  # tokenized first only when the advantages weigh by tokens
    if advantage_normalizer in TOKEN_NORMALIZERS:
        batch = tokenize_prompt_and_output(
            repeated_prompts, rollout_responses, tokenizer
        )  # (B, T) each
    _, advantages, metadata = rollout_advantages(
        reward_fn,
        rollout_responses,
        repeated_ground_truths,
        group_size,
        baseline=baseline,
        advantage_eps=advantage_eps,
        advantage_normalizer=advantage_normalizer,
        nan_rewards=nan_rewards,
        response_lengths=None if batch is None else batch["response_mask"].sum(-1),
    )  # (B,)
    if not (advantages != 0).any() and not settings.every_row_has_gradient:
        optimizer.zero_grad(set_to_none=True)
        zero_loss, skipped = _zero_diagnostics(settings, _device_of(model))
        return zero_loss, {**metadata, **skipped}
    if batch is None:
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
        settings=settings,
    )
    return loss, {**metadata, **update_metadata}


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
    reference_log_probs: torch.Tensor | None = None,
    sampler_log_probs: torch.Tensor | None = None,
    teacher_log_probs: torch.Tensor | None = None,
    grad_scaler: torch.amp.GradScaler | None = None,
    settings: UpdateSettings | None = None,
    **options: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
    """One optimizer step on a tokenized batch with precomputed advantages.

    ``batch`` holds ``input_ids``, ``labels`` and ``response_mask``, each (B, T)
    (:func:`grpo_lab.masks.pad_prompt_and_response_ids`); ``advantages`` is
    (B,); ``old_log_probs``, ``reference_log_probs``, ``sampler_log_probs``
    (the rollout sampler's own, for a ``sampler_correction``) and
    ``teacher_log_probs`` (a frozen teacher's, for ``distillation``) are (B, T). The
    settings: ``settings`` (an :class:`UpdateSettings`, as the loop passes it),
    or the reference arguments and ``options``, any other UpdateSettings field
    by name (``cliprange_high``, ``kl_coef``, ``entropy_coef``, ...).

    The responses with nonzero advantage (every response, when a KL penalty, an
    entropy bonus or the entropy quantile needs them) are cut into microbatches
    of ceil(B / steps) rows; :func:`backward_microbatch` backpropagates each
    microbatch's :func:`microbatch_loss` times :func:`microbatch_loss_scale`, so
    the gradient is the full batch's for any ``gradient_accumulation_steps``:

        sequence: sum over microbatches m of  (|m| / B) * mean_{i in m} loss_i
        constant: sum over microbatches m of  sum_{i in m, t} loss_it / C
        token:    sum over microbatches m of  (n_m / N) * mean_{t in m} loss_t

    with n_m, N the response tokens of m and of the whole batch (skipped rows
    count in B and N). Then the gradient is clipped to ``max_grad_norm`` and the
    optimizer steps once.

    Raises ``RuntimeError`` before ``optimizer.step`` (parameters untouched) if a
    loss, a diagnostic mean or the gradient norm is not finite. When every
    advantage is zero nothing is scored, the optimizer does not step, and the
    metadata holds only ``optimizer_step`` 0 and ``active_response_count`` 0.
    ``grad_scaler`` (float16 autocast): a step whose scaled gradients
    overflowed is skipped by the scaler and reported as ``loss_scale_skipped``
    1, not raised. With ``sampler_log_probs`` the metadata adds the sampler's
    log-prob gap and correction diagnostics (:func:`_sampler_metrics`).
    """
    settings = resolve_update_settings(
        settings,
        importance_reweighting_method=importance_reweighting_method,
        cliprange=cliprange,
        loss_normalization=loss_normalization,
        normalization_constant=normalization_constant,
        **options,
    )
    log_probs = {
        "old_log_probs": old_log_probs,
        "reference_log_probs": reference_log_probs,
        "sampler_log_probs": sampler_log_probs,
        "teacher_log_probs": teacher_log_probs,
    }
    batch_size = _check_batch(batch, advantages, log_probs)
    check_update_inputs(
        settings,
        gradient_accumulation_steps,
        max_grad_norm,
        batch_size,
        old_log_probs,
        reference_log_probs,
        sampler_log_probs=sampler_log_probs,
        teacher_log_probs=teacher_log_probs,
    )
    device = _device_of(model)
    optimizer.zero_grad(set_to_none=True)
    active = _rows_to_score(batch, advantages, log_probs, settings)
    if active is None:  # every advantage is zero and nothing else needs a row
        zero_loss = torch.zeros((), dtype=torch.float32, device=device)
        return zero_loss, {"optimizer_step": 0.0, "active_response_count": 0.0}
    # Keep the configured microbatch size; fewer active rows mean fewer microbatches.
    microbatch_size = -(-batch_size // gradient_accumulation_steps)  # ceil
    batch_tokens = int(batch["response_mask"].sum())  # skipped rows count too
    accumulator = DiagnosticAccumulator(device)
    for rows in torch.arange(active["advantages"].shape[0]).split(microbatch_size):
        microbatch = {
            key: value.index_select(0, rows.to(value.device)).to(device)
            for key, value in active.items()
        }  # (b, ...) each
        scale = microbatch_loss_scale(
            settings.loss_normalization,
            rows.numel(),
            batch_size,
            microbatch_tokens=int(microbatch["response_mask"].sum()),
            batch_tokens=batch_tokens,
        )
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
        backward_microbatch(
            loss * scale, scored, microbatch, loss_metadata, accumulator, grad_scaler
        )
    gradient_norm, stepped = _optimizer_step(
        model, optimizer, max_grad_norm, grad_scaler, device
    )
    return _update_metadata(
        accumulator, active, settings, gradient_norm, stepped, grad_scaler
    )


def _rows_to_score(
    batch: Mapping[str, torch.Tensor],
    advantages: torch.Tensor,
    log_probs: dict[str, torch.Tensor | None],
    settings: UpdateSettings,
) -> dict[str, torch.Tensor] | None:
    """The rows the update scores: those with a nonzero advantage, or every row
    when a setting needs them all; None when there is none to score."""
    batch_size = advantages.shape[0]
    active_indices = torch.nonzero(advantages != 0, as_tuple=False).flatten()
    if active_indices.numel() == 0 and not settings.every_row_has_gradient:
        return None
    if settings.scores_every_row:
        active_indices = torch.arange(batch_size, device=advantages.device)
    return _select_rows(batch, advantages, log_probs, active_indices)


def _update_metadata(
    accumulator: DiagnosticAccumulator,
    active: Mapping[str, torch.Tensor],
    settings: UpdateSettings,
    gradient_norm: torch.Tensor,
    stepped: float,
    grad_scaler: torch.amp.GradScaler | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
    """The update's loss and metadata: the microbatches' diagnostics, the
    gradient norm, whether the optimizer stepped, the sampler metrics."""
    metadata = accumulator.summary()
    metadata.update(
        gradient_norm=gradient_norm.detach(),
        optimizer_step=stepped,
        active_response_count=float(active["advantages"].shape[0]),
    )
    if grad_scaler is not None:
        metadata.update(
            loss_scale_skipped=1.0 - stepped, loss_scale=grad_scaler.get_scale()
        )
    if "sampler_log_probs" in active:
        metadata.update(_sampler_metrics(active, accumulator, settings))
    return metadata["loss"], metadata


def _optimizer_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    max_grad_norm: float | None,
    grad_scaler: torch.amp.GradScaler | None,
    device: torch.device,
) -> tuple[torch.Tensor, float]:
    """Clip and step once (through ``grad_scaler`` when given), then clear the
    gradients: the gradient norm before clipping, and 1.0 if the step ran."""
    if grad_scaler is None:
        gradient_norm = _checked_gradient_norm(model, max_grad_norm, device)
        optimizer.step()
        stepped = 1.0
    else:
        gradient_norm, stepped = _scaled_step(
            model, optimizer, max_grad_norm, grad_scaler
        )
    optimizer.zero_grad(set_to_none=True)
    return gradient_norm, stepped


def _sampler_metrics(
    active: Mapping[str, torch.Tensor],
    accumulator: DiagnosticAccumulator,
    settings: UpdateSettings,
) -> dict[str, float]:
    """The sampler gap and correction diagnostics of the scored rows, computed
    once on all of them (min and max do not add up across microbatches)."""
    trainer_log_probs = torch.cat(accumulator.trainer_log_probs)  # (A, T)
    device = trainer_log_probs.device
    _, metrics = sampler_weights_and_metrics(
        trainer_log_probs,
        active["sampler_log_probs"].to(device),
        active["response_mask"].to(device),
        *_correction_settings(settings),
    )  # settings checked once, in UpdateSettings
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
        shared_prefix_length=prefix_to_share(
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

        loss_t = objective_t * e_t * s_t + kl_coef * w_t * KL_t
                 + distillation_coef * D_t - entropy_coef * H_t

    objective_t from :func:`grpo_lab.losses.compute_policy_gradient_loss`
    (with its off-policy sequence mask when ``off_policy_mask_threshold`` is set);
    e_t = 1, or the high-entropy mask when ``top_entropy_quantile`` < 1
    (:func:`grpo_lab.losses.high_entropy_mask`); s_t = 1, or the detached
    sampler-correction weight (:func:`grpo_lab.sampler_correction.correction_weights`
    of pi_old / pi_sampler, pi_old = ``old_log_probs`` or the current log-probs
    detached; on the objective only, as TRL weighs it); KL_t the ``kl_estimator`` of
    the policy against ``microbatch["reference_log_probs"]``
    (:func:`grpo_lab.kl.compute_kl_penalty`), and w_t = pi / pi_old when
    ``kl_importance_weighting`` (one ratio per response for gspo and gmpo; 1
    with its gradient on-policy), else 1; H_t the token's entropy, with its
    gradient when ``entropy_coef`` > 0; D_t the distillation term against
    ``microbatch["teacher_log_probs"]``
    (:func:`grpo_lab.distillation.distillation_token_loss`) when ``distillation``
    is on, and then objective_t is kept only with ``distillation_task_reward``.
    Then reduced by ``loss_normalization``
    (:func:`grpo_lab.aggregation.aggregate_loss_across_microbatch`): like
    DeepSeekMath, the KL joins each token's loss before averaging.
    ``microbatch`` holds ``response_mask`` and ``advantages`` (b,), and
    ``old_log_probs`` / ``reference_log_probs`` (b, T) when used. Diagnostics
    add ``kl_mean`` (the token mean of KL_t) and ``entropy_mask_mean`` (the
    fraction of tokens kept) when those are on.
    """
    mask = microbatch["response_mask"]  # (b, T)
    old_log_probs = microbatch.get("old_log_probs")
    per_token_loss, diagnostics = torch.zeros_like(log_probs), {}
    if settings.keeps_task_objective:
        inputs = objective_inputs(
            settings, microbatch["advantages"], log_probs, old_log_probs, mask
        )
        # (b, T): the record's loss (the clip: grpo_clip_loss) reads its options
        # from settings, unchecked; then the off-policy sequence mask, if set
        per_token_loss, diagnostics = settings.record.loss(*inputs, settings)
        per_token_loss, diagnostics = mask_off_policy_sequences(
            per_token_loss,
            diagnostics,
            inputs,
            settings,
            sampler_log_probs=microbatch.get("sampler_log_probs"),
        )
    if settings.top_entropy_quantile < 1.0:
        kept = top_entropy_mask(token_entropy, mask, settings.top_entropy_quantile)
        per_token_loss = per_token_loss * kept  # (b, T)
        diagnostics["entropy_mask_mean"] = _masked_mean(kept.float(), mask)
    if settings.sampler_correction != "none":
        per_token_loss = per_token_loss * _sampler_weights(
            log_probs, microbatch, settings
        )  # (b, T)
    if settings.kl_coef > 0:
        kl = kl_estimate(
            log_probs, microbatch["reference_log_probs"], settings.kl_estimator
        )  # (b, T)
        diagnostics["kl_mean"] = _masked_mean(kl, mask)
        weights = 1.0
        if settings.kl_importance_weighting:
            weights = kl_importance_weights(
                log_probs,
                old_log_probs,
                mask,
                per_sequence=settings.record.per_sequence,
            )  # (b, T) or (b, 1)
        per_token_loss = per_token_loss + settings.kl_coef * (kl * weights)
    if settings.distills:
        distilled, distillation_diagnostics = distillation_token_loss(
            log_probs,
            microbatch["teacher_log_probs"],
            mask,
            settings,
            distillation=settings.distillation,
            estimator=settings.distillation_estimator,
            old_log_probs=old_log_probs,
        )  # (b, T)
        per_token_loss = per_token_loss + settings.distillation_coef * distilled
        diagnostics.update(distillation_diagnostics)
    if settings.entropy_coef > 0:
        per_token_loss = per_token_loss - settings.entropy_coef * token_entropy
    loss = reduce_masked_loss(
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
    weights, _ = sampler_weights(
        log_probs.detach() if old_log_probs is None else old_log_probs,
        microbatch["sampler_log_probs"],
        microbatch["response_mask"],
        *_correction_settings(settings),
    )  # (b, T) each
    return weights


def _correction_settings(settings: UpdateSettings) -> tuple[str, float, float, float]:
    """Mode, cap, low and high of the sampler correction (checked once, when
    ``settings`` was built)."""
    return (
        settings.sampler_correction,
        settings.sampler_correction_cap,
        settings.sampler_correction_low,
        settings.sampler_correction_high,
    )


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
    teacher_log_probs: torch.Tensor | None = None,
) -> None:
    """What must hold before anything is scored, beyond ``settings`` themselves."""
    check_gradient_accumulation_steps(gradient_accumulation_steps, batch_size)
    check_max_grad_norm(max_grad_norm)
    method = settings.importance_reweighting_method
    if settings.record.uses_ratio and old_log_probs is None:
        raise ValueError(
            f"old_log_probs must be a tensor for {method!r} reweighting, got None"
        )
    if settings.kl_coef > 0 and reference_log_probs is None:
        raise ValueError(
            f"reference_log_probs must be a tensor when kl_coef > 0 "
            f"({settings.kl_coef}), got None"
        )
    if settings.distills and teacher_log_probs is None:
        raise ValueError(
            f"teacher_log_probs must be a tensor when distillation is "
            f"{settings.distillation!r}, got None"
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
    log_probs: Mapping[str, torch.Tensor | None],
    indices: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """The rows ``indices`` of every per-response tensor given, keyed by name."""
    tensors = {key: batch[key] for key in BATCH_KEYS}
    tensors["advantages"] = advantages
    tensors.update(
        {key: value for key, value in log_probs.items() if value is not None}
    )
    return {
        key: value.index_select(0, indices.to(value.device))
        for key, value in tensors.items()
    }


def backward_microbatch(
    loss: torch.Tensor,
    scored: Mapping[str, torch.Tensor],
    microbatch: Mapping[str, torch.Tensor],
    loss_metadata: dict[str, torch.Tensor],
    accumulator: DiagnosticAccumulator,
    grad_scaler: torch.amp.GradScaler | None = None,
) -> None:
    """Check one scored microbatch's scaled loss is finite, backpropagate it
    (times the loss scale of ``grad_scaler``, when given), and add its
    diagnostics to ``accumulator``."""
    mask = microbatch["response_mask"]  # (b, T)
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
    """A step with every advantage zero: 0 under every key a step with signal
    reports (the objective's record names its own), as the reference design."""
    zero = torch.zeros((), dtype=torch.float32, device=device)
    keys = set(settings.record.diagnostic_keys(settings))
    keys |= {"gradient_norm", "token_entropy", "entropy_count"}
    if settings.top_entropy_quantile < 1.0:
        keys.add("entropy_mask_mean")
    if settings.kl_coef > 0:
        keys.add("kl_mean")
    metadata: dict[str, torch.Tensor | float] = {
        key: zero.clone() for key in sorted(keys)
    }
    metadata.update(
        loss=zero,
        response_token_count=torch.zeros((), dtype=torch.long, device=device),
        optimizer_step=0.0,
        active_response_count=0.0,
    )
    return zero, metadata


def _check_batch(
    batch: Mapping[str, torch.Tensor],
    advantages: torch.Tensor,
    log_probs: Mapping[str, torch.Tensor | None],
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
    for name, value in log_probs.items():
        if value is not None and tuple(value.shape) != shape:
            raise ValueError(
                f"{name} must have the shape of batch['labels'] {shape}, "
                f"got {tuple(value.shape)}"
            )
    return shape[0]
