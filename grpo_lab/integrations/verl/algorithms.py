"""grpo_lab's objectives and advantage estimators inside verl 0.9.1, and a verl launch.

verl (the distributed RL engine) looks policy losses and advantage estimators up
by name in two registries (``verl.trainer.ppo.core_algos``). :func:`register`
adds grpo_lab's to them:

- policy losses ``grpo_lab_<method>`` for every method of
  ``grpo_lab.losses.OBJECTIVES`` (none, noclip, grpo, gspo, cispo, sapo, gmpo,
  luspo, vespo, dppo_tv, dppo_kl, clip_cov, kl_cov),
  with verl's signature ``(old_log_prob, log_prob, advantages, response_mask,
  loss_agg_mode, config, rollout_is_weights) -> (loss, metrics)``;
- advantage estimators ``grpo_lab_<baseline>_<normalizer>`` for every baseline
  (mean, none, leave_one_out) and normalizer (std, none, mean, batch_std) of
  ``grpo_lab.advantages``, and ``grpo_lab_maxrl`` (mean / mean, MaxRL).

verl imports every entry point of the group ``verl.plugins`` when ``verl`` is
first imported (``VERL_USE_EXTERNAL_PLUGINS``: ``auto``, ``none`` or a list of
names); pyproject.toml declares ``grpo_lab = grpo_lab.integrations.verl.algorithms``
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
- ratio_cap (grpo, gspo, luspo): ``actor.clip_ratio_c``, verl's dual-clip
  constant; for dppo_tv / dppo_kl the same field truncates the detached weight,
  as verl's own dppo losses read it. verl's default 3.0 is a cap; ``inf`` is no
  cap, and the export writes ``inf`` when ratio_cap is None;
- sapo_temperature_pos / _neg: ``actor.tau_pos`` / ``actor.tau_neg``;
- covariance_fraction, clip_cov_low / _high (clip_cov) and kl_cov_coef
  (kl_cov): ``actor.policy_loss.clip_cov_ratio``, ``clip_cov_lb``,
  ``clip_cov_ub``, ``kl_cov_ratio`` and ``ppo_kl_coef``
  (:data:`VERL_COVARIANCE_FIELDS`);
- off_policy_mask_threshold and VESPO's shape: verl's config has no field for
  them, so the export refuses them unless default (VESPO runs with TRL's
  default shape);
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

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from grpo_lab.advantages import (
    ADVANTAGE_NORMALIZERS,
    BASELINES,
    TOKEN_NORMALIZERS,
    compute_group_normalized_rewards,
)
from grpo_lab.aggregation import aggregate_loss_across_microbatch, microbatch_loss_scale
from grpo_lab.losses import (
    CAPPED_METHODS,
    OBJECTIVES,
    SEQUENCE_METHODS,
    TRUNCATED_METHODS,
    ObjectiveOptions,
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
    capped = method in CAPPED_METHODS | TRUNCATED_METHODS
    cap = _get(config, "clip_ratio_c") if capped else None
    ratio_cap = None if cap is None or cap == math.inf else float(cap)
    return ObjectiveOptions(  # checked as it is built, for this method
        importance_reweighting_method=method,
        cliprange=None if cliprange is None else float(cliprange),
        cliprange_high=None if high is None else float(high),
        ratio_cap=ratio_cap,
        sapo_temperature_pos=float(_get(config, "tau_pos", 1.0)),
        sapo_temperature_neg=float(_get(config, "tau_neg", 1.05)),
        **_covariance_options(method, _get(config, "policy_loss")),
    )


# grpo_lab's covariance options -> verl's policy_loss fields, and verl's
# fallbacks when a field is None (core_algos' compute_policy_loss_clip_cov /
# _kl_cov).
VERL_COVARIANCE_FIELDS = {
    "clip_cov": {
        "covariance_fraction": ("clip_cov_ratio", 0.0002),
        "clip_cov_low": ("clip_cov_lb", 1.0),
        "clip_cov_high": ("clip_cov_ub", 5.0),
    },
    "kl_cov": {
        "covariance_fraction": ("kl_cov_ratio", 0.0002),
        "kl_cov_coef": ("ppo_kl_coef", 1.0),
    },
}


def _covariance_options(method: str, policy_loss: Any) -> dict[str, float]:
    """Clip-Cov's and KL-Cov's options from verl's ``actor.policy_loss``."""
    fields = VERL_COVARIANCE_FIELDS.get(method, {})
    return {
        name: float(_get(policy_loss, verl_name, fallback))
        for name, (verl_name, fallback) in fields.items()
    }


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
    _check_loss_inputs(per_token_loss, response_mask)
    dp_size = _global_count(info, "dp_size", 1)
    mask = response_mask.to(per_token_loss.dtype)  # (B, T)
    rows, tokens = mask.shape[0], int(mask.sum().item())
    batch_rows = _global_count(info, "global_batch_size", rows)
    batch_tokens = _global_count(info, "batch_num_tokens", tokens)
    if dp_size > 1 and not {"global_batch_size", "batch_num_tokens"} <= set(info):
        raise ValueError(
            "global_batch_info must give global_batch_size and batch_num_tokens "
            f"when dp_size > 1, got {sorted(info)}"
        )
    if batch_rows < rows or batch_tokens < tokens:
        raise ValueError(
            f"global_batch_info's global_batch_size and batch_num_tokens must count "
            f"at least this micro-batch's {rows} rows and {tokens} tokens, got "
            f"{batch_rows} and {batch_tokens}"
        )
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


def _check_loss_inputs(per_token_loss: object, response_mask: object) -> None:
    for name, value in (
        ("per_token_loss", per_token_loss),
        ("response_mask", response_mask),
    ):
        if not isinstance(value, torch.Tensor) or value.ndim != 2:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else None
            raise ValueError(
                f"{name} must be a (B, T) tensor, got "
                f"{shape if shape is not None else type(value).__name__}"
            )
    if per_token_loss.shape != response_mask.shape:
        raise ValueError(
            f"response_mask must have the shape of per_token_loss "
            f"{tuple(per_token_loss.shape)}, got {tuple(response_mask.shape)}"
        )


def _global_count(info: Mapping[str, Any], name: str, default: int) -> int:
    """A positive int of ``global_batch_info`` (``default`` when absent or None);
    ValueError naming it otherwise (0 would divide by nothing or scale to 0)."""
    value = info.get(name)
    if value is None:
        return default
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{name} in global_batch_info must be a positive int, got {value!r}"
        )
    return value


def _verl_constant(
    loss_agg_mode: str, batch_rows: int, horizon: int, info: Mapping[str, Any]
) -> float:
    """grpo_lab's normalization_constant for verl's token-sum modes."""
    if loss_agg_mode == "token-sum":
        return 1.0
    if loss_agg_mode == "seq-mean-token-sum":
        return float(batch_rows)
    factor = info.get("loss_scale_factor")
    if factor is not None and not (
        isinstance(factor, int | float)
        and not isinstance(factor, bool)
        and math.isfinite(factor)
        and factor > 0
    ):
        raise ValueError(
            f"loss_scale_factor must be None (the response length) or a finite "
            f"number > 0, got {factor!r}"
        )
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
            lengths = (
                response_mask.sum(dim=-1) if normalizer in TOKEN_NORMALIZERS else None
            )
            advantages = _grouped_advantages(
                scores, np.asarray(index), baseline, normalizer, epsilon, lengths
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
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """compute_group_normalized_rewards over groups given by ``index``
    (``lengths``: each response's token count, for token_whiten)."""
    if len(index) != scores.shape[0]:
        raise ValueError(
            f"index must have one uid per response ({scores.shape[0]}), "
            f"got {len(index)}"
        )
    _, group_ids, sizes = np.unique(index, return_inverse=True, return_counts=True)
    batch_wide = normalizer == "batch_std" or normalizer in TOKEN_NORMALIZERS
    if batch_wide and len(set(sizes.tolist())) > 1:
        raise ValueError(
            "every group must have the same size with advantage_normalizer "
            f"{normalizer!r}, got sizes {sorted(set(sizes.tolist()))}"
        )
    advantages = torch.empty_like(scores)
    for size in sorted(set(sizes.tolist())):
        rows = np.flatnonzero(sizes[group_ids] == size)
        rows = rows[np.argsort(group_ids[rows], kind="stable")]  # groups contiguous
        picked = torch.as_tensor(rows, device=scores.device)
        values, _ = compute_group_normalized_rewards(
            scores[picked],
            int(size),
            baseline,
            epsilon,
            normalizer,
            response_lengths=None if lengths is None else lengths[picked],
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
