"""grpo_lab's objectives and advantage estimators inside verl 0.9.1, and a verl launch.

verl (the distributed RL engine) looks policy losses and advantage estimators up
by name in two registries (``verl.trainer.ppo.core_algos``). :func:`register`
adds grpo_lab's to them:

- policy losses ``grpo_lab_<method>`` for every method of
  ``grpo_lab.losses.OBJECTIVES`` (none, noclip, grpo, gspo, cispo, sapo, gmpo),
  with verl's signature ``(old_log_prob, log_prob, advantages, response_mask,
  loss_agg_mode, config, rollout_is_weights) -> (loss, metrics)``;
- advantage estimators ``grpo_lab_<baseline>_<normalizer>`` for every baseline
  (mean, none, leave_one_out) and normalizer (std, none, mean, batch_std) of
  ``grpo_lab.advantages``, and ``grpo_lab_maxrl`` (mean / mean, MaxRL).

verl imports every entry point of the group ``verl.plugins`` when ``verl`` is
first imported (``VERL_USE_EXTERNAL_PLUGINS``: ``auto``, ``none`` or a list of
names); pyproject.toml declares ``grpo_lab = grpo_lab.integrations.verl``
there, and importing this module registers everything. verl logs a plugin
that fails to import at debug level only, so the exported run.sh also names the
module in ``VERL_USE_EXTERNAL_MODULES`` (imported without a guard). Registering
again is a no-op. Without verl installed the import raises ``ImportError`` saying how to
install it (``pip install verl==0.9.1``, or ``make .venv-verl``).

Hyperparameters verl carries (its config classes are frozen dataclasses with a
fixed set of fields, so a loss reads only those):

- cliprange: ``actor.clip_ratio_low`` (``clip_ratio`` when unset); for gmpo a
  bound on log pi / pi_old, as in grpo_lab;
- cliprange_high: ``actor.clip_ratio_high``;
- ratio_cap (grpo, gspo): ``actor.clip_ratio_c``, verl's dual-clip constant.
  verl's default 3.0 is a cap; ``inf`` is no cap, and the export writes
  ``inf`` when ratio_cap is None;
- sapo_temperature_pos / _neg: ``actor.tau_pos`` / ``actor.tau_neg``;
- the loss normalization: ``actor.loss_agg_mode`` (below);
- the advantage's baseline and normalizer: the estimator's name.

Aggregation. verl hands each loss a micro-batch and, in
``config.global_batch_info``, the data-parallel size D, the global token count
N and the global batch size B (responses per optimizer step). Each mode is one
of grpo_lab's three normalizations, weighted so that the gradients of every
micro-batch on every rank (averaged over D by the data-parallel reduce) add up
to the full batch's:

- ``token-mean``: token (each micro-batch's token mean x n / N x D);
- ``seq-mean-token-mean``: sequence (each micro-batch's mean x b / B x D);
- ``seq-mean-token-sum``: constant with normalization_constant = B;
- ``seq-mean-token-sum-norm``: constant with normalization_constant =
  B x ``loss_scale_factor`` (the response length when that is None);
- ``token-sum``: constant with normalization_constant = 1.

Without global counts (one process, D = 1) N and B are the micro-batch's own.
Rows with no response token count in B (grpo_lab's rule; verl's built-ins drop
them when they count B themselves), and sequence mode divides by max(length, 1)
(verl's built-ins by length + 1e-8). verl's ``rollout_is_weights`` multiply the
per-token loss before aggregation, as verl's built-ins do.

What verl cannot carry, refused by :func:`write_launch_folder` with a
``ValueError`` naming the setting: advantage_eps other than 1e-6 (verl passes
no epsilon to a registered estimator, and AlgoConfig has no field for it),
nan_rewards "ignore", kl_importance_weighting, top_entropy_quantile < 1, a
supervised warm-up (sft_max_steps > 0), the locally built "tiny" model, a
device that is not CUDA, a constant normalization whose constant is not a
multiple of train_batch_size, and micro-batches that do not split evenly over
the GPUs. Approximations, written in the launch README: verl's k3 KL
(``low_var_kl``) clamps each token's value to [-10, 10], and its learning-rate
warm-up starts from 0 (grpo_lab's from lr / warm-up steps); verl stops a
response at EOS only, not at a task's stop strings. Settings that are not
training settings (memory and speed knobs that leave the result unchanged, the
shape of the tiny model, the warm-up's own knobs) are listed with a reason in
``NOT_TRAINING_SETTINGS``.
"""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from grpo_lab.advantages import (
    ADVANTAGE_NORMALIZERS,
    BASELINES,
    compute_group_normalized_rewards,
)
from grpo_lab.losses import (
    CAPPED_METHODS,
    OBJECTIVES,
    SEQUENCE_METHODS,
    ObjectiveOptions,
    aggregate_loss_across_microbatch,
    check_objective_settings,
    microbatch_loss_scale,
)

try:
    from verl.trainer.ppo import core_algos
except ImportError:  # the main venv has no verl: export works, registering does not
    core_algos = None

VERL_MISSING = (
    "grpo_lab's verl losses and estimators need verl 0.9.1: pip install "
    "verl==0.9.1 (it needs transformers>=5.5.3,<5.11), or build the checkout's "
    "verl environment with `make .venv-verl`"
)

LOSS_PREFIX = "grpo_lab_"
VERL_VERSION = "0.9.1"
VERL_AGG_MODES = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "token-sum",
)
# The estimator names that are not <baseline>_<normalizer>.
ESTIMATOR_ALIASES = {"grpo_lab_maxrl": ("mean", "mean")}
DEFAULT_ADVANTAGE_EPS = 1e-6

# --- policy losses ---------------------------------------------------------------


def objective_options(method: str, config: Any) -> ObjectiveOptions:
    """The grpo_lab options a verl ActorConfig (or DictConfig) carries for ``method``.

    cliprange = clip_ratio_low (clip_ratio when None), cliprange_high =
    clip_ratio_high, ratio_cap = clip_ratio_c for grpo and gspo (inf: none),
    SAPO temperatures = tau_pos / tau_neg. Checked by grpo_lab's own validator.
    """
    if config is None:
        raise ValueError(
            f"config must be verl's actor config for {LOSS_PREFIX}{method}, got None"
        )
    low = _get(config, "clip_ratio_low")
    cliprange = _get(config, "clip_ratio") if low is None else low
    high = _get(config, "clip_ratio_high")
    cap = _get(config, "clip_ratio_c") if method in CAPPED_METHODS else None
    ratio_cap = None if cap is None or cap == math.inf else float(cap)
    options = ObjectiveOptions(
        cliprange=None if cliprange is None else float(cliprange),
        cliprange_high=None if high is None else float(high),
        ratio_cap=ratio_cap,
        sapo_temperature_pos=float(_get(config, "tau_pos", 1.0)),
        sapo_temperature_neg=float(_get(config, "tau_neg", 1.05)),
    )
    check_objective_settings(
        method,
        options.cliprange,
        cliprange_high=options.cliprange_high,
        ratio_cap=options.ratio_cap,
        sapo_temperature_pos=options.sapo_temperature_pos,
        sapo_temperature_neg=options.sapo_temperature_neg,
    )
    return options


def _get(config: Any, name: str, default: Any = None) -> Any:
    value = config.get(name, default) if hasattr(config, "get") else None
    return default if value is None and default is not None else value


def aggregate_like_verl(
    per_token_loss: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    global_batch_info: Mapping[str, Any] | None = None,
) -> torch.Tensor:
    """One micro-batch's scalar loss for verl's ``loss_agg_mode``, by grpo_lab's rules.

    token-mean: token mean x n / N x D; seq-mean-token-mean: sequence mean x
    b / B x D; seq-mean-token-sum(-norm) and token-sum: constant normalization
    with B (x loss_scale_factor, or x the response length), or 1, times D. D, N
    and B come from ``global_batch_info`` (dp_size, batch_num_tokens,
    global_batch_size); without them D = 1 and N, B are this micro-batch's.
    """
    info = dict(global_batch_info or {})
    dp_size = int(info.get("dp_size") or 1)
    mask = response_mask.to(per_token_loss.dtype)  # (B, T)
    rows, tokens = mask.shape[0], int(mask.sum().item())
    batch_rows = info.get("global_batch_size")
    batch_tokens = info.get("batch_num_tokens")
    if dp_size > 1 and (batch_rows is None or batch_tokens is None):
        raise ValueError(
            "global_batch_info must give global_batch_size and batch_num_tokens "
            f"when dp_size > 1, got {sorted(info)}"
        )
    batch_rows = rows if batch_rows is None else int(batch_rows)
    batch_tokens = tokens if batch_tokens is None else int(batch_tokens)
    if loss_agg_mode == "token-mean":
        loss = aggregate_loss_across_microbatch(per_token_loss, mask, "token")
        scale = microbatch_loss_scale(
            "token",
            rows,
            batch_rows,
            microbatch_tokens=tokens,
            batch_tokens=batch_tokens,
        )
    elif loss_agg_mode == "seq-mean-token-mean":
        loss = aggregate_loss_across_microbatch(per_token_loss, mask, "sequence")
        scale = microbatch_loss_scale("sequence", rows, batch_rows)
    elif loss_agg_mode in VERL_AGG_MODES:
        constant = _verl_constant(loss_agg_mode, batch_rows, mask.shape[1], info)
        loss = aggregate_loss_across_microbatch(
            per_token_loss, mask, "constant", normalization_constant=constant
        )
        scale = 1.0
    else:
        raise ValueError(
            f"loss_agg_mode must be one of {VERL_AGG_MODES}, got {loss_agg_mode!r}"
        )
    return loss * (scale * dp_size)


def _verl_constant(
    loss_agg_mode: str, batch_rows: int, horizon: int, info: Mapping[str, Any]
) -> float:
    """grpo_lab's normalization_constant for verl's token-sum modes."""
    if loss_agg_mode == "token-sum":
        return 1.0
    if loss_agg_mode == "seq-mean-token-sum":
        return float(batch_rows)
    factor = info.get("loss_scale_factor")
    return float(batch_rows * (horizon if factor is None else factor))


def _row_advantages(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One advantage per response (B, 1) for the sequence objectives.

    verl gives advantages per token (B, T); GSPO and GMPO weigh whole responses,
    so every response token must carry the same value.
    """
    counts = mask.sum(dim=1, keepdim=True).clamp_min(1)  # (B, 1)
    row = advantages.masked_fill(~mask, 0.0).sum(dim=1, keepdim=True) / counts
    spread = (advantages - row).abs().masked_fill(~mask, 0.0)  # (B, T)
    tolerance = 1e-6 * (1 + row.abs().max().item())
    if spread.max().item() > tolerance:
        raise ValueError(
            "advantages must be constant over each response's tokens for the "
            "sequence-level objectives (gspo, gmpo): use an outcome-reward "
            f"estimator such as grpo_lab_mean_std; got a spread of {spread.max():.3g}"
        )
    return row


def make_policy_loss(method: str) -> Callable[..., tuple[torch.Tensor, dict]]:
    """verl's policy-loss function for grpo_lab's objective ``method``.

    loss = aggregate_like_verl(objective(A, log pi, log pi_old, mask, options)
    x rollout_is_weights); metrics are the objective's diagnostics under
    ``actor/grpo_lab/``, plus ``actor/pg_clipfrac`` and ``actor/ppo_kl`` as
    verl names them.
    """
    if method not in OBJECTIVES:
        raise ValueError(f"method must be one of {tuple(OBJECTIVES)}, got {method!r}")
    objective = OBJECTIVES[method]

    def policy_loss(
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = "token-mean",
        config: Any = None,
        rollout_is_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        options = objective_options(method, config)
        mask = response_mask.bool()  # (B, T)
        if log_prob.dtype in (torch.float16, torch.bfloat16):
            log_prob = log_prob.float()
        old = torch.where(mask, old_log_prob.to(log_prob.dtype), log_prob.detach())
        adv = advantages.to(log_prob.dtype)  # (B, T)
        if method in SEQUENCE_METHODS:
            adv = _row_advantages(adv, mask)  # (B, 1)
        per_token_loss, diagnostics = objective(adv, log_prob, old, mask, options)
        per_token_loss = per_token_loss.expand_as(log_prob)  # (B, T)
        if rollout_is_weights is not None:
            per_token_loss = per_token_loss * rollout_is_weights.detach()
        info = _get(config, "global_batch_info") or {}
        loss = aggregate_like_verl(per_token_loss, mask, loss_agg_mode, info)
        return loss, _loss_metrics(diagnostics, log_prob, old, mask)

    policy_loss.__name__ = f"{LOSS_PREFIX}{method}"
    policy_loss.__qualname__ = policy_loss.__name__
    policy_loss.__doc__ = f"grpo_lab's {method!r} objective with verl's signature."
    return policy_loss


def _loss_metrics(
    diagnostics: Mapping[str, torch.Tensor],
    log_prob: torch.Tensor,
    old: torch.Tensor,
    mask: torch.Tensor,
) -> dict[str, float]:
    count = mask.sum().clamp_min(1)
    ppo_kl = ((old - log_prob).detach().masked_fill(~mask, 0.0).sum() / count).item()
    metrics = {f"actor/grpo_lab/{k}": float(v) for k, v in diagnostics.items()}
    metrics["actor/ppo_kl"] = ppo_kl
    metrics["actor/pg_clipfrac"] = float(diagnostics.get("clip_fraction", 0.0))
    return metrics


# --- advantage estimators ----------------------------------------------------------


def estimator_name(baseline: str, normalizer: str) -> str:
    """The registered name of grpo_lab's (baseline, normalizer) estimator."""
    for alias, pair in ESTIMATOR_ALIASES.items():
        if pair == (baseline, normalizer):
            return alias
    return f"{LOSS_PREFIX}{baseline}_{normalizer}"


def make_advantage_estimator(baseline: str, normalizer: str) -> Callable[..., Any]:
    """verl's estimator for grpo_lab's group-normalized advantages.

    score_i = sum_t token_level_rewards[i, t]; responses are grouped by
    ``index`` (verl's prompt uid, in any order) and A_i =
    compute_group_normalized_rewards(...) with eps 1e-6; each group size is
    one call (batch_std needs one size). Returns (A_i x mask, A_i x mask).
    """
    if baseline not in BASELINES or normalizer not in ADVANTAGE_NORMALIZERS:
        raise ValueError(
            f"baseline and normalizer must be in {BASELINES} and "
            f"{ADVANTAGE_NORMALIZERS}, got {baseline!r} and {normalizer!r}"
        )

    def estimator(
        token_level_rewards: torch.Tensor,
        response_mask: torch.Tensor,
        index: np.ndarray | None = None,
        config: Any = None,
        epsilon: float = DEFAULT_ADVANTAGE_EPS,
        **unused: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if index is None:
            raise ValueError("index must give each response's prompt uid, got None")
        with torch.no_grad():
            scores = token_level_rewards.sum(dim=-1)  # (B,)
            advantages = _grouped_advantages(
                scores, np.asarray(index), baseline, normalizer, epsilon
            )  # (B,)
            advantages = advantages.unsqueeze(-1) * response_mask  # (B, T)
        return advantages, advantages

    estimator.__name__ = estimator_name(baseline, normalizer)
    estimator.__qualname__ = estimator.__name__
    estimator.__doc__ = f"grpo_lab's advantages: baseline {baseline!r}, {normalizer!r}."
    return estimator


def _grouped_advantages(
    scores: torch.Tensor,
    index: np.ndarray,
    baseline: str,
    normalizer: str,
    epsilon: float,
) -> torch.Tensor:
    """compute_group_normalized_rewards over groups given by ``index``."""
    if len(index) != scores.shape[0]:
        raise ValueError(
            f"index must have one uid per response ({scores.shape[0]}), "
            f"got {len(index)}"
        )
    _, group_ids, sizes = np.unique(index, return_inverse=True, return_counts=True)
    if normalizer == "batch_std" and len(set(sizes.tolist())) > 1:
        raise ValueError(
            "every group must have the same size with advantage_normalizer "
            f"'batch_std', got sizes {sorted(set(sizes.tolist()))}"
        )
    advantages = torch.empty_like(scores)
    for size in sorted(set(sizes.tolist())):
        rows = np.flatnonzero(sizes[group_ids] == size)
        rows = rows[np.argsort(group_ids[rows], kind="stable")]  # groups contiguous
        picked = torch.as_tensor(rows, device=scores.device)
        values, _ = compute_group_normalized_rewards(
            scores[picked], int(size), baseline, epsilon, normalizer
        )
        advantages[picked] = values.to(scores.dtype)
    return advantages


# --- registration ---------------------------------------------------------------------


def policy_loss_names() -> tuple[str, ...]:
    """Every policy-loss name this module registers."""
    return tuple(f"{LOSS_PREFIX}{method}" for method in OBJECTIVES)


def estimator_pairs() -> dict[str, tuple[str, str]]:
    """Every registered estimator name and its (baseline, normalizer)."""
    pairs = {
        f"{LOSS_PREFIX}{b}_{n}": (b, n)
        for b in BASELINES
        for n in ADVANTAGE_NORMALIZERS
    }
    return {**pairs, **ESTIMATOR_ALIASES}


def register() -> None:
    """Add grpo_lab's losses and estimators to verl's registries (idempotent).

    A name already registered is left as it is when it is grpo_lab's (a second
    import or a module reload), so verl's "already registered" check never fires.
    Without verl installed it raises ImportError saying how to install it; the
    launch folder (:func:`write_launch_folder`) needs no verl.
    """
    if core_algos is None:
        raise ImportError(VERL_MISSING)
    for method in OBJECTIVES:
        name = f"{LOSS_PREFIX}{method}"
        if name not in core_algos.POLICY_LOSS_REGISTRY:
            core_algos.register_policy_loss(name)(make_policy_loss(method))
    registry = core_algos.ADV_ESTIMATOR_REGISTRY
    for name, (baseline, normalizer) in estimator_pairs().items():
        if name not in registry:
            core_algos.register_adv_est(name)(
                make_advantage_estimator(baseline, normalizer)
            )


if core_algos is not None:  # loaded by verl's plugin loader: register at import
    register()

# --- the launch folder ----------------------------------------------------------

# Fields with no counterpart in a verl run, and why nothing is lost.
NOT_TRAINING_SETTINGS = {
    "profile": "the name of the defaults the config started from; every value "
    "is exported field by field",
    "tiny_hidden_size": "shape of the locally built 'tiny' model, which verl "
    "cannot load (model 'tiny' is refused)",
    "tiny_num_layers": "shape of the 'tiny' model (refused, see tiny_hidden_size)",
    "tiny_intermediate_size": "shape of the 'tiny' model (refused, see "
    "tiny_hidden_size)",
    "rollout_max_batch_size": "memory knob of grpo_lab's hf sampler; verl's "
    "engine batches generation itself",
    "share_prompt_prefix": "speed-up of grpo_lab's sampling and scoring with "
    "identical results",
    "logits_chunk_size": "memory knob of grpo_lab's scoring with identical results",
    "num_threads": "CPU threads of grpo_lab's own process",
    "sft_target_accuracy": "read by the supervised warm-up only, which must be "
    "off (sft_max_steps 0) to export",
    "sft_eval_temperature": "warm-up only (see sft_target_accuracy)",
    "sft_batch_size": "warm-up only (see sft_target_accuracy)",
    "sft_lr": "warm-up only (see sft_target_accuracy)",
    "sft_eval_every": "warm-up only (see sft_target_accuracy)",
    "sft_eval_size": "warm-up only (see sft_target_accuracy)",
    "mismatch_scale": "read only by grpo_lab's mismatch backend (mismatch must "
    "be none)",
    "mismatch_sync_every": "read only by the mismatch backend (see mismatch_scale)",
    "sampler_correction_cap": "read only with sampler_correction, which must be "
    "none to export",
    "sampler_correction_low": "see sampler_correction_cap",
    "sampler_correction_high": "see sampler_correction_cap",
    "dynamic_sampling_max_rounds": "read only with dynamic_sampling, which must "
    "be False to export",
    "overlong_penalty": "read only with overlong_buffer, which must be None",
}
# report_to names and verl's trainer.logger backends (verl 0.9.1 has all four).
TRACKERS = {
    "tensorboard": "tensorboard",
    "wandb": "wandb",
    "mlflow": "mlflow",
    "trackio": "trackio",
}
PLAIN_PROMPT_TEMPLATE = "{% for message in messages %}{{ message.content }}{% endfor %}"
_TORCH_TO_VERL_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
ACTOR = "actor_rollout_ref.actor"
ROLLOUT = "actor_rollout_ref.rollout"


def _refuse(name: str, expected: str, value: object) -> ValueError:
    return ValueError(f"{name} must be {expected} to export to verl, got {value!r}")


def _check_exportable(config: Any) -> None:
    """Refuse every setting verl cannot carry, naming it."""
    refusals = (
        (
            "model",
            config.model != "tiny",
            "a hub name or a local path (not 'tiny', which grpo_lab builds locally)",
        ),
        (
            "advantage_eps",
            config.advantage_eps == DEFAULT_ADVANTAGE_EPS,
            f"{DEFAULT_ADVANTAGE_EPS} (verl passes no epsilon to a registered "
            "estimator)",
        ),
        ("nan_rewards", config.nan_rewards == "propagate", "'propagate'"),
        (
            "kl_importance_weighting",
            not config.kl_importance_weighting,
            "False (verl's KL loss has no importance weight)",
        ),
        (
            "top_entropy_quantile",
            config.top_entropy_quantile == 1.0,
            "1.0 (verl trains on every token)",
        ),
        (
            "sft_max_steps",
            config.sft_max_steps == 0,
            "0 (verl has no supervised "
            "warm-up: run it with grpo_lab and export the warmed-up model's path)",
        ),
        (
            "device",
            str(config.device).startswith("cuda"),
            "a CUDA device (verl trains on GPUs)",
        ),
        (
            "mismatch",
            config.mismatch == "none",
            "'none' (the mismatch backend is grpo_lab's CPU simulator)",
        ),
        (
            "sampler_correction",
            config.sampler_correction == "none",
            "'none' (verl's own algorithm.rollout_correction is not mapped; set it "
            "in overrides.txt by hand)",
        ),
        (
            "dynamic_sampling",
            not config.dynamic_sampling,
            "False (verl's algorithm.filter_groups is not mapped)",
        ),
        (
            "mask_truncated_completions",
            not config.mask_truncated_completions,
            "False (not mapped to verl)",
        ),
        (
            "overlong_buffer",
            config.overlong_buffer is None,
            "None (verl's overlong reward shaping is not mapped)",
        ),
    )
    for name, ok, expected in refusals:
        if not ok:
            raise _refuse(name, expected, getattr(config, name))


def _loss_aggregation(config: Any) -> dict[str, Any]:
    if config.loss_normalization == "token":
        return {f"{ACTOR}.loss_agg_mode": "token-mean"}
    if config.loss_normalization == "sequence":
        return {f"{ACTOR}.loss_agg_mode": "seq-mean-token-mean"}
    constant, rows = config.normalization_constant, config.train_batch_size
    if constant % rows:
        raise _refuse(
            "normalization_constant",
            f"a multiple of train_batch_size ({rows}) (verl divides by its batch "
            "size times an integer loss_scale_factor)",
            constant,
        )
    return {
        f"{ACTOR}.loss_agg_mode": "seq-mean-token-sum-norm",
        f"{ACTOR}.loss_scale_factor": int(constant // rows),
    }


def _objective_overrides(config: Any) -> dict[str, Any]:
    method = config.importance_reweighting_method
    values: dict[str, Any] = {
        f"{ACTOR}.policy_loss.loss_mode": f"{LOSS_PREFIX}{method}",
        "algorithm.adv_estimator": estimator_name(
            config.baseline, config.advantage_normalizer
        ),
        f"{ACTOR}.clip_ratio_c": math.inf
        if config.ratio_cap is None
        else config.ratio_cap,
        f"{ACTOR}.tau_pos": config.sapo_temperature_pos,
        f"{ACTOR}.tau_neg": config.sapo_temperature_neg,
        **_loss_aggregation(config),
    }
    if config.cliprange is not None:
        high = (
            config.cliprange if config.cliprange_high is None else config.cliprange_high
        )
        values[f"{ACTOR}.clip_ratio"] = config.cliprange
        values[f"{ACTOR}.clip_ratio_low"] = config.cliprange
        values[f"{ACTOR}.clip_ratio_high"] = high
    kl = config.kl_coef > 0
    values.update(
        {
            "algorithm.use_kl_in_reward": False,
            f"{ACTOR}.use_kl_loss": kl,
            f"{ACTOR}.kl_loss_coef": config.kl_coef,
            f"{ACTOR}.kl_loss_type": {"k1": "kl", "k2": "mse", "k3": "low_var_kl"}[
                config.kl_estimator
            ],
            f"{ACTOR}.entropy_coeff": config.entropy_coef,
        }
    )
    return values


def _batch_overrides(config: Any, n_gpus: int) -> dict[str, Any]:
    micro = config.train_batch_size // config.gradient_accumulation_steps
    if micro % n_gpus:
        raise _refuse(
            "gradient_accumulation_steps",
            f"a divisor that leaves micro-batches of a multiple of n_gpus ({n_gpus}) "
            "responses",
            config.gradient_accumulation_steps,
        )
    per_gpu = micro // n_gpus
    return {
        "data.train_batch_size": config.prompts_per_step,
        f"{ROLLOUT}.n": config.group_size,
        f"{ACTOR}.ppo_mini_batch_size": config.train_batch_size // config.group_size,
        f"{ACTOR}.ppo_epochs": config.epochs_per_rollout_batch,
        f"{ACTOR}.ppo_micro_batch_size_per_gpu": per_gpu,
        f"{ACTOR}.use_dynamic_bsz": False,
        f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu": per_gpu,
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": per_gpu,
        "trainer.total_training_steps": config.steps,
        "trainer.n_gpus_per_node": n_gpus,
        "trainer.nnodes": 1,
    }


def _optimizer_overrides(config: Any) -> dict[str, Any]:
    clip = math.inf if config.max_grad_norm is None else config.max_grad_norm
    return {
        f"{ACTOR}.optim.lr": config.lr,
        f"{ACTOR}.optim.lr_warmup_steps": config.lr_warmup_steps,
        f"{ACTOR}.optim.weight_decay": config.weight_decay,
        f"{ACTOR}.optim.betas": [0.9, config.adam_beta2],
        f"{ACTOR}.optim.clip_grad": clip,
    }


def _run_overrides(config: Any, data_dir: Path, max_prompt: int) -> dict[str, Any]:
    compute = config.autocast_dtype or config.dtype
    report = (
        config.report_to
        if isinstance(config.report_to, list)
        else [name.strip() for name in str(config.report_to).split(",") if name.strip()]
    )
    loggers = ["console"] + [TRACKERS[name] for name in report if name != "none"]
    values: dict[str, Any] = {
        "actor_rollout_ref.model.path": config.model,
        "actor_rollout_ref.model.enable_gradient_checkpointing": (
            config.gradient_checkpointing
        ),
        f"{ACTOR}.fsdp_config.model_dtype": _TORCH_TO_VERL_DTYPE[config.dtype],
        f"{ACTOR}.fsdp_config.dtype": compute,
        f"{ROLLOUT}.name": "vllm",
        f"{ROLLOUT}.temperature": config.temperature,
        f"{ROLLOUT}.top_p": config.top_p,
        f"{ROLLOUT}.gpu_memory_utilization": config.vllm_gpu_memory_utilization,
        f"{ROLLOUT}.seed": config.seed,
        f"{ACTOR}.data_loader_seed": config.seed,
        "data.seed": config.seed,
        "data.train_files": str(data_dir / "train.jsonl"),
        "data.val_files": str(data_dir / "val.jsonl"),
        "data.max_prompt_length": max_prompt,
        "data.max_response_length": _max_new_tokens(config),
        "reward.custom_reward_function.path": str(data_dir / "reward.py"),
        "reward.custom_reward_function.name": "compute_score",
        "trainer.test_freq": config.eval_every if config.eval_every else -1,
        "trainer.val_before_train": bool(config.eval_every),
        "trainer.save_freq": config.checkpoint_every or config.steps,
        "trainer.max_actor_ckpt_to_keep": config.keep_checkpoints,
        "trainer.resume_mode": "auto" if config.resume else "disable",
        "trainer.logger": loggers,
    }
    if not config.chat_template:
        values["actor_rollout_ref.model.custom_chat_template"] = PLAIN_PROMPT_TEMPLATE
    if config.run_dir is not None:
        values["trainer.default_local_dir"] = str(Path(config.run_dir) / "verl")
    return values


def _max_new_tokens(config: Any) -> int:
    if config.max_new_tokens is not None:
        return config.max_new_tokens
    from grpo_lab.tasks import get_task

    return get_task(config.task, **config.task_options).max_new_tokens


# Every TrainConfig field exported, and where (the test walks them all).
EXPORTED_SETTINGS = {
    "seed": "data.seed, actor.data_loader_seed, rollout.seed, the data files' draws",
    "run_dir": "trainer.default_local_dir (<run_dir>/verl; None: verl's default)",
    "resume": "trainer.resume_mode (auto / disable)",
    "model": "actor_rollout_ref.model.path",
    "task": "data/train.jsonl, data/val.jsonl and data/reward.py",
    "task_options": "the task the data files and reward.py build",
    "chat_template": "off: model.custom_chat_template passes the prompt as is",
    "steps": "trainer.total_training_steps",
    "rollout_batch_size": "data.train_batch_size (prompts) x rollout.n",
    "group_size": "rollout.n",
    "train_batch_size": "actor.ppo_mini_batch_size (prompts) x rollout.n",
    "epochs_per_rollout_batch": "actor.ppo_epochs",
    "gradient_accumulation_steps": "actor.ppo_micro_batch_size_per_gpu",
    "lr": "actor.optim.lr",
    "lr_warmup_steps": "actor.optim.lr_warmup_steps",
    "weight_decay": "actor.optim.weight_decay",
    "adam_beta2": "actor.optim.betas[1]",
    "max_grad_norm": "actor.optim.clip_grad (None: inf)",
    "baseline": "algorithm.adv_estimator",
    "advantage_normalizer": "algorithm.adv_estimator",
    "advantage_eps": "refused unless 1e-6 (the estimators' epsilon)",
    "nan_rewards": "refused unless 'propagate'",
    "importance_reweighting_method": "actor.policy_loss.loss_mode",
    "cliprange": "actor.clip_ratio, actor.clip_ratio_low",
    "cliprange_high": "actor.clip_ratio_high",
    "ratio_cap": "actor.clip_ratio_c (None: inf)",
    "sapo_temperature_pos": "actor.tau_pos",
    "sapo_temperature_neg": "actor.tau_neg",
    "loss_normalization": "actor.loss_agg_mode",
    "normalization_constant": "actor.loss_scale_factor (x train_batch_size)",
    "kl_coef": "actor.use_kl_loss, actor.kl_loss_coef",
    "kl_estimator": "actor.kl_loss_type (kl, mse, low_var_kl)",
    "kl_importance_weighting": "refused unless False",
    "entropy_coef": "actor.entropy_coeff",
    "top_entropy_quantile": "refused unless 1.0",
    "temperature": "rollout.temperature",
    "top_p": "rollout.top_p",
    "max_new_tokens": "data.max_response_length (None: the task's)",
    "backend": "rollout.name vllm (verl samples with its own engine)",
    "vllm_gpu_memory_utilization": "rollout.gpu_memory_utilization",
    "eval_every": "trainer.test_freq (0: -1), trainer.val_before_train",
    "eval_size": "data/val.jsonl's prompts",
    "checkpoint_every": "trainer.save_freq (0: steps, the end only)",
    "keep_checkpoints": "trainer.max_actor_ckpt_to_keep",
    "report_to": "trainer.logger",
    "sft_max_steps": "refused unless 0",
    "device": "refused unless CUDA; trainer.n_gpus_per_node",
    "dtype": "actor.fsdp_config.model_dtype",
    "autocast_dtype": "actor.fsdp_config.dtype (None: dtype)",
    "gradient_checkpointing": "actor_rollout_ref.model.enable_gradient_checkpointing",
    "mismatch": "refused unless 'none'",
    "sampler_correction": "refused unless 'none'",
    "dynamic_sampling": "refused unless False",
    "mask_truncated_completions": "refused unless False",
    "overlong_buffer": "refused unless None",
}


def launch_overrides(
    config: Any, data_dir: Path, *, n_gpus: int = 1, max_prompt_length: int = 512
) -> dict[str, Any]:
    """Every Hydra override of verl's ppo_trainer a run of ``config`` needs."""
    _check_exportable(config)
    if not isinstance(n_gpus, int) or isinstance(n_gpus, bool) or n_gpus < 1:
        raise ValueError(f"n_gpus must be a positive int, got {n_gpus!r}")
    return {
        **_run_overrides(config, Path(data_dir), max_prompt_length),
        **_batch_overrides(config, n_gpus),
        **_optimizer_overrides(config),
        **_objective_overrides(config),
        **lora_overrides(config),
    }


def format_override(key: str, value: Any) -> str:
    """One Hydra command-line override: key=value in Hydra's grammar."""
    return f"{key}={_hydra_value(value)}"


def _hydra_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ",".join(_hydra_value(v) for v in value) + "]"
    text = str(value)
    if text and all(c.isalnum() or c in "/._-~" for c in text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def write_launch_folder(
    config: Any, out_dir: str | Path, *, n_gpus: int = 1
) -> list[Path]:
    """Write a verl 0.9.1 launch of ``config`` to ``out_dir``; return the files.

    overrides.txt (one Hydra override per line), run.sh (``python -m
    verl.trainer.main_ppo`` with them), README.md (what maps where and what is
    approximate), data/train.jsonl and data/val.jsonl (the task's prompts:
    steps x prompts_per_step and eval_size, drawn with the seed) and
    data/reward.py (the task's reward for verl's reward manager). A setting
    verl cannot carry raises ValueError naming it before anything is written.
    """
    _check_exportable(config)
    out = Path(out_dir)
    data_dir = (out / "data").resolve()
    train, evaluation = _task_examples(config)
    longest = max(len(e.prompt) for e in train + evaluation)
    max_prompt = longest + (256 if config.chat_template else 16)
    overrides = launch_overrides(
        config, data_dir, n_gpus=n_gpus, max_prompt_length=max_prompt
    )
    lines = [format_override(k, v) for k, v in overrides.items()]
    data_dir.mkdir(parents=True, exist_ok=True)
    files = {
        out / "overrides.txt": "\n".join(lines) + "\n",
        out / "run.sh": _run_script(lines),
        out / "README.md": _readme(config, overrides),
        data_dir / "train.jsonl": _jsonl(train, config.task, "train"),
        data_dir / "val.jsonl": _jsonl(evaluation, config.task, "val"),
        data_dir / "reward.py": _reward_module(config),
    }
    for path, text in files.items():
        path.write_text(text)
    (out / "run.sh").chmod(0o755)
    return list(files)


def _task_examples(config: Any) -> tuple[list, list]:
    from grpo_lab.tasks import get_task

    task = get_task(config.task, **config.task_options)
    train = task.train(config.steps * config.prompts_per_step, config.seed)
    evaluation = task.eval(max(config.eval_size, 1), config.seed)
    return train, evaluation


def _jsonl(examples: list, task: str, split: str) -> str:
    rows = [
        {
            "data_source": f"grpo_lab/{task}",
            "prompt": [{"role": "user", "content": example.prompt}],
            "ability": task,
            "reward_model": {"style": "rule", "ground_truth": example.ground_truth},
            "extra_info": {"split": split, "index": i},
        }
        for i, example in enumerate(examples)
    ]
    return "".join(json.dumps(row) + "\n" for row in rows)


def _reward_module(config: Any) -> str:
    return (
        '"""The grpo_lab task reward for verl\'s reward manager."""\n\n'
        "from grpo_lab.tasks import get_task\n\n"
        f"TASK = get_task({config.task!r}, **{config.task_options!r})\n\n\n"
        "def compute_score(data_source, solution_str, ground_truth, "
        "extra_info=None, **kwargs):\n"
        '    """reward_fn(response, ground_truth)["reward"] of the task."""\n'
        '    return float(TASK.reward_fn(solution_str, ground_truth)["reward"])\n'
    )


def _run_script(lines: list[str]) -> str:
    arguments = " \\\n    ".join(shlex.quote(line) for line in lines)
    return (
        "#!/usr/bin/env bash\n"
        f"# A verl {VERL_VERSION} run of a grpo_lab config; needs verl "
        f"{VERL_VERSION} and grpo-lab installed\n"
        "# in one environment (grpo_lab's losses load through verl's plugins).\n"
        "set -euo pipefail\n"
        'cd "$(dirname "$0")"\n'
        "# verl logs a plugin that fails to import at debug level only; importing\n"
        "# it here as an external module makes a broken install fail loudly.\n"
        'export VERL_USE_EXTERNAL_MODULES="${VERL_USE_EXTERNAL_MODULES:-'
        'grpo_lab.integrations.verl}"\n'
        "python -m verl.trainer.main_ppo \\\n"
        f"    {arguments} \\\n"
        '    "$@"\n'
    )


def _readme(config: Any, overrides: Mapping[str, Any]) -> str:
    method = config.importance_reweighting_method
    return (
        f"# verl {VERL_VERSION} launch\n\n"
        f"`./run.sh` trains `{config.model}` on the task `{config.task}` with "
        f"verl's PPO trainer, grpo_lab's objective `{method}` "
        f"(`{overrides[f'{ACTOR}.policy_loss.loss_mode']}`) and advantages "
        f"`{overrides['algorithm.adv_estimator']}`. Extra Hydra overrides may "
        "follow: `./run.sh trainer.n_gpus_per_node=8`.\n\n"
        "Install: `pip install verl==0.9.1 grpo-lab` in one environment; verl "
        "imports grpo_lab's plugin from its `verl.plugins` entry point.\n\n"
        "Files: `overrides.txt` (one Hydra override per line), `data/train.jsonl` "
        "and `data/val.jsonl` (the prompts), `data/reward.py` (the reward).\n\n"
        "Approximate in verl: the k3 KL (`low_var_kl`) clamps each token's value "
        "to [-10, 10]; the learning-rate warm-up starts from 0; responses stop at "
        "EOS only, not at the task's stop strings; `data.max_prompt_length` is the "
        "longest prompt in characters plus a margin, and verl refuses a longer "
        "tokenized prompt.\n"
    )


def exported_fields() -> dict[str, str]:
    """Every TrainConfig field with where it goes (or why it has no place)."""
    return {**EXPORTED_SETTINGS, **NOT_TRAINING_SETTINGS}


# --- LoRA -------------------------------------------------------------------------

MODEL = "actor_rollout_ref.model"
EXPORTED_SETTINGS.update(
    {
        "lora_rank": "actor_rollout_ref.model.lora_rank (0: full fine-tuning)",
        "lora_alpha": "actor_rollout_ref.model.lora_alpha",
        "lora_target_modules": "actor_rollout_ref.model.target_modules",
        "lora_dropout": "refused unless 0 (not exported)",
        "lora_lr": "actor.optim.lr when lora_rank > 0",
    }
)


def lora_overrides(config: Any) -> dict[str, Any]:
    """verl's LoRA settings for ``config``'s adapters (none at rank 0)."""
    if config.lora_rank == 0:
        return {}
    if config.lora_dropout != 0:
        raise _refuse(
            "lora_dropout", "0 (dropout is not exported)", config.lora_dropout
        )
    targets = config.lora_settings().target_modules
    return {
        f"{MODEL}.lora_rank": config.lora_rank,
        f"{MODEL}.lora_alpha": config.lora_alpha,
        f"{MODEL}.target_modules": targets
        if isinstance(targets, str)
        else list(targets),
        f"{ACTOR}.optim.lr": config.lora_lr,
    }
