"""Per-token KL penalty to a frozen reference policy (Schulman's k1, k2, k3).

The KL divergence KL(pi || pi_ref) = E_{x ~ pi}[log pi(x) - log pi_ref(x)] is
estimated on the sampled tokens themselves, one number per token, from
r = pi_ref(x) / pi(x):

    k1 = -log r                    unbiased, high variance, can be negative
    k2 = (log r)^2 / 2             biased, low variance, >= 0
    k3 = (r - 1) - log r           unbiased, low variance, >= 0 (DeepSeekMath)

(J. Schulman, "Approximating KL divergence", 2020.) DeepSeekMath's GRPO adds
beta * k3 to every token's loss before aggregation. Taught in
``notebooks/10_the_grpo_family.ipynb``.
"""

from __future__ import annotations

import math

import torch

from grpo_lab.logprobs import check_log_prob_values

KL_ESTIMATORS = ("k1", "k2", "k3")


def compute_kl_penalty(
    policy_log_probs: torch.Tensor,
    reference_log_probs: torch.Tensor,
    estimator: str = "k3",
) -> torch.Tensor:
    """Per-token KL estimate (B, T) of the policy from the reference.

    With log r = log pi_ref - log pi: k1 = -log r, k2 = (log r)^2 / 2,
    k3 = exp(log r) - log r - 1. The gradient flows through the policy only
    (the reference is detached): d k1 / d log pi = 1, d k2 / d log pi = -log r,
    d k3 / d log pi = 1 - pi_ref / pi. Half-precision inputs are computed in
    float32 (bfloat16 rounds a log-ratio of 1e-3 to nothing); float64 stays
    float64. Masked positions hold whatever their inputs give: aggregate with
    the response mask.

    This door checks every value once: a log-prob must be <= 0 and not NaN
    (fill padding with 0, not NaN), the tensors must hold data (not the meta
    device), and with k3 the log-ratio must stay below log of the dtype's
    largest number (88.7 in float32), where exp(log r) overflows to inf; pass
    float64 log-probs for larger ones. The train step calls
    :func:`kl_estimate`, which checks none of the values.
    """
    check_kl_estimator(estimator, argument="compute_kl_penalty's estimator")
    check_log_prob_values(policy_log_probs, "policy_log_probs")
    check_log_prob_values(reference_log_probs, "reference_log_probs")
    penalty = kl_estimate(policy_log_probs, reference_log_probs, estimator)
    if estimator == "k3":
        _check_k3_range(policy_log_probs, reference_log_probs, penalty.dtype)
    return penalty


def _check_k3_range(
    policy_log_probs: torch.Tensor,
    reference_log_probs: torch.Tensor,
    dtype: torch.dtype,
) -> None:
    """k3's exp(log r) is finite in ``dtype``: log r below log(largest)."""
    log_ratio = reference_log_probs.detach().to(dtype) - policy_log_probs.detach().to(
        dtype
    )  # (B, T)
    largest = math.log(torch.finfo(dtype).max)
    if bool((log_ratio > largest).any()):
        raise ValueError(
            f"reference_log_probs - policy_log_probs must be below {largest:.1f} for "
            f"k3 in {dtype} (exp of it overflows to inf; pass float64 log-probs), "
            f"got {log_ratio.max().item()!r}"
        )


def kl_estimate(
    policy_log_probs: torch.Tensor,
    reference_log_probs: torch.Tensor,
    estimator: str,
) -> torch.Tensor:
    """:func:`compute_kl_penalty` with the estimator already checked (by
    ``UpdateSettings``, once; the train step's per-microbatch call): the tensors
    are checked, the estimator is read as it is. (B, T)"""
    for name, value in (
        ("policy_log_probs", policy_log_probs),
        ("reference_log_probs", reference_log_probs),
    ):
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            received = value.dtype if isinstance(value, torch.Tensor) else type(value)
            raise ValueError(
                f"{name} must be a floating-point tensor of log-probs, got {received}"
            )
    if policy_log_probs.shape != reference_log_probs.shape:
        raise ValueError(
            f"reference_log_probs must have shape {tuple(policy_log_probs.shape)} "
            f"like policy_log_probs, got {tuple(reference_log_probs.shape)}"
        )
    dtype = torch.promote_types(
        torch.promote_types(policy_log_probs.dtype, reference_log_probs.dtype),
        torch.float32,
    )
    log_ratio = reference_log_probs.detach().to(dtype) - policy_log_probs.to(
        dtype
    )  # (B, T): log pi_ref - log pi
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    return torch.exp(log_ratio) - log_ratio - 1


def check_kl_estimator(estimator: str, *, argument: str | None = None) -> None:
    """The one check of a KL estimator's name (``argument``: how a direct
    caller's argument is named in the message, beside the setting)."""
    if estimator not in KL_ESTIMATORS:
        where = f" ({argument})" if argument else ""
        raise ValueError(
            f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}{where}"
        )


def check_kl_settings(kl_coef: float, kl_estimator: str) -> None:
    """kl_coef is a finite number >= 0 (0: no penalty); the estimator is known."""
    if not (
        isinstance(kl_coef, (int, float))
        and not isinstance(kl_coef, bool)
        and math.isfinite(kl_coef)
        and kl_coef >= 0
    ):
        raise ValueError(
            f"kl_coef must be a finite number >= 0 (0: no KL penalty), got {kl_coef!r}"
        )
    check_kl_estimator(kl_estimator)


def kl_importance_weights(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor | None,
    mask: torch.Tensor,
    *,
    per_sequence: bool = False,
) -> torch.Tensor:
    """pi / pi_old per token (b, T), or per response (b, 1) when ``per_sequence``
    (gspo, gmpo: exp of the mean log ratio over the response's tokens).

    The weight of each token's KL under ``kl_importance_weighting`` (TRL's
    ``use_bias_correction_kl``). On-policy (no old log-probs) the ratio is
    exp(log pi - sg(log pi)): 1, whose gradient d/d log pi is 1.
    """
    old = log_probs if old_log_probs is None else old_log_probs
    dtype = torch.promote_types(log_probs.dtype, torch.float32)
    log_ratio = log_probs.to(dtype) - old.detach().to(dtype)  # (b, T)
    if per_sequence:
        weights = mask.to(dtype)  # (b, T)
        log_ratio = (log_ratio * weights).sum(dim=1, keepdim=True) / weights.sum(
            dim=1, keepdim=True
        ).clamp_min(1)  # (b, 1)
    return torch.exp(log_ratio)
