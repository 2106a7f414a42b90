"""Checks for ``notebooks/10_the_grpo_family.ipynb``.

The exercise: DAPO's loss of a batch with a KL penalty to a reference model,
the scalar a train step back-propagates. The student composes what the
notebook took apart: the clip-higher surrogate, the KL estimator whose value
is k3's and whose expected gradient is the reverse KL's (k3 weighted by the
differentiable ratio pi / pi_old), and DAPO's token-mean aggregation. The
reference is :func:`grpo_lab.train_step.microbatch_loss` with
``importance_reweighting_method="grpo"``, ``cliprange_high``, ``kl_coef``,
``kl_estimator="k3"``, ``kl_importance_weighting=True`` and
``loss_normalization="token"``; value and gradient are compared on ratios
between the two clip bounds and on padding that holds log-probs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from grpo_lab.teaching.checks.framework import (
    CaseCount,
    ExerciseFailed,
    _backward_weights,
    assert_value_and_gradient,
    exercise_check,
)
from grpo_lab.train_step import UpdateSettings, microbatch_loss

DapoKlLoss = Callable[..., torch.Tensor]


def reference_dapo_kl_loss(
    policy_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    reference_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_low: float,
    cliprange_high: float,
    kl_coef: float,
) -> torch.Tensor:
    """The package's loss of the batch. (B, T) x 3, (B,), (B, T) -> scalar."""
    settings = UpdateSettings(
        importance_reweighting_method="grpo",
        cliprange=cliprange_low,
        cliprange_high=cliprange_high,
        kl_coef=kl_coef,
        kl_estimator="k3",
        kl_importance_weighting=True,
        loss_normalization="token",
    )
    microbatch = {
        "response_mask": response_mask,
        "advantages": advantages,
        "old_log_probs": old_log_probs,
        "reference_log_probs": reference_log_probs,
    }
    loss, _ = microbatch_loss(
        policy_log_probs, torch.zeros_like(policy_log_probs), microbatch, settings
    )
    return loss


_Case = tuple[torch.Tensor, ...]


def _dapo_kl_cases() -> list[tuple[_Case, float, float, float]]:
    # Ratios 0.75, 0.78 (below 1 - eps_low, above 1 - eps_high) and 1.25
    # (between 1 + eps_low and 1 + eps_high): a symmetric or swapped clip answers
    # differently there. Rows of 7, 3 and 1 tokens: a per-response mean weighs
    # them unlike DAPO's token mean; the padding holds log-probs (ratio e^1.5,
    # a reference far away) that must count nowhere.
    ratios = torch.tensor([0.5, 0.75, 0.78, 1.0, 1.25, 1.3, 1.6]).double()
    old = torch.full((3, 7), -1.5, dtype=torch.float64)  # (B, T)
    policy = old + ratios.log().repeat(3, 1)  # (B, T)
    mask = torch.tensor([[1] * 7, [1, 1, 1, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0]])
    policy = torch.where(mask.bool(), policy, old + 1.5)
    reference = policy.detach() - 0.3 * torch.arange(7).double().repeat(3, 1)
    reference = torch.where(mask.bool(), reference, torch.tensor(-9.0).double())
    advantages = torch.tensor([1.0, -1.0, 0.5]).double()
    generator = torch.Generator().manual_seed(1)
    random_old = -torch.rand(4, 5, generator=generator).double() * 3  # (B, T)
    random_policy = random_old + 0.4 * torch.randn(4, 5, generator=generator).double()
    random_reference = (
        random_old + 0.6 * torch.randn(4, 5, generator=generator).double()
    ).clamp(max=0.0)  # log-probs: <= 0 (compute_kl_penalty refuses others)
    random_mask = torch.tensor(
        [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [1, 0, 0, 0, 0]]
    )
    random_advantages = torch.tensor([-0.5, 2.0, 0.0, 1.2]).double()
    random_case = (
        random_policy,
        random_old,
        random_reference,
        random_advantages,
        random_mask,
    )
    return [
        ((policy, old, reference, advantages, mask), 0.2, 0.28, 0.1),
        (random_case, 0.1, 0.3, 0.05),
        (random_case, 0.25, 0.25, 0.5),  # DAPO's bounds equal: GRPO's clip
    ]


def _describe(case: _Case, low: float, high: float, beta: float) -> str:
    policy, old, _reference, advantages, mask = case
    ratios = (policy - old).exp().round(decimals=3)  # (B, T)
    return (
        f"advantages={advantages.tolist()}, ratios pi/pi_old={ratios.tolist()}, "
        f"response_mask={mask.tolist()}, cliprange_low={low}, cliprange_high="
        f"{high}, kl_coef={beta}"
    )


@exercise_check("Exercise 10-dapo_kl_loss (DAPO's loss with a KL penalty)")
def check_dapo_kl_loss(student_fn: DapoKlLoss, cases: CaseCount) -> None:
    """``student_fn(policy_log_probs, old_log_probs, reference_log_probs,
    advantages, response_mask, cliprange_low, cliprange_high, kl_coef)`` ->
    scalar; its gradient by ``policy_log_probs`` must match too."""
    for case, low, high, beta in _dapo_kl_cases():
        with cases.case():
            policy, old, reference, advantages, mask = case
            reference_input = policy.clone().requires_grad_(True)
            expected = reference_dapo_kl_loss(
                reference_input, old, reference, advantages, mask, low, high, beta
            )
            student_input = policy.clone().requires_grad_(True)
            received = student_fn(
                student_input,
                old.clone(),
                reference.clone(),
                advantages.clone(),
                mask.clone(),
                low,
                high,
                beta,
            )
            inputs = _describe(case, low, high, beta)
            try:
                assert_value_and_gradient(
                    received, expected, student_input, reference_input, inputs
                )
            except ExerciseFailed as failure:
                slip = _which_slip(received, student_input, case, low, high, beta)
                if slip is None:
                    raise
                raise ExerciseFailed(f"{slip}: {failure}") from None


def _slip_losses(
    policy: torch.Tensor, case: _Case, low: float, high: float, beta: float
) -> dict[str, torch.Tensor]:
    """The loss each usual slip gives on ``policy`` (a leaf with a gradient)."""
    _, old, reference, advantages, mask = case
    ratio = torch.exp(policy - old)  # (B, T)
    a = advantages.unsqueeze(-1)  # (B, 1)

    def surrogate(high_bound: float) -> torch.Tensor:
        clipped = ratio.clamp(1 - low, 1 + high_bound)
        return -torch.minimum(ratio * a, clipped * a)  # (B, T)

    log_r = reference - policy  # log(pi_ref / pi), (B, T)
    k3 = torch.exp(log_r) - log_r - 1  # (B, T)
    mask = mask.to(policy.dtype)

    def token_mean(per_token: torch.Tensor) -> torch.Tensor:
        return (per_token * mask).sum() / mask.sum()

    return {
        "plain k3, not weighted by the ratio pi / pi_old: its gradient is the "
        "forward KL's (the mistake the notebook's estimator table warns about); "
        "multiply k3 by the differentiable ratio": token_mean(
            surrogate(high) + beta * k3
        ),
        "the ratio weighting k3 is detached: k3's value, but its gradient is "
        "still the forward KL's; the ratio must carry the gradient": token_mean(
            surrogate(high) + beta * ratio.detach() * k3
        ),
        "the clip is symmetric, 1 +/- cliprange_low: DAPO's clip-higher bounds "
        "the ratio by 1 + cliprange_high above": token_mean(
            surrogate(low) + beta * ratio * k3
        ),
        "the per-response mean (GRPO's), not DAPO's token mean over the batch": (
            ((surrogate(high) + beta * ratio * k3) * mask).sum(1) / mask.sum(1)
        ).mean(),
    }


def _which_slip(
    received: object,
    student_input: torch.Tensor,
    case: _Case,
    low: float,
    high: float,
    beta: float,
) -> str | None:
    """The slip whose value (and, once the value is right, gradient as the
    check weighed it) ``received`` matches, or None."""
    if not isinstance(received, torch.Tensor) or received.numel() != 1:
        return None
    leaf = case[0].clone().requires_grad_(True)
    for message, loss in _slip_losses(leaf, case, low, high, beta).items():
        if abs(received.detach().double().item() - loss.item()) > 1e-8:
            continue
        if student_input.grad is None:  # the value was already wrong
            return message
        weight = _backward_weights(loss.shape)
        (wrong,) = torch.autograd.grad(loss * weight, leaf)
        if torch.allclose(student_input.grad.double(), wrong.double(), atol=1e-8):
            return message
    return None
