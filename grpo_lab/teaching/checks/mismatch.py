"""Checks for ``notebooks/11_when_the_sampler_is_not_the_policy.ipynb``.

The exercise: the loss of one off-policy train batch whose responses a
mismatched sampler drew, corrected by sequence-level masked importance sampling
(MIS). Two ratios meet in it and the student decides where each goes: the
policy's ratio pi / pi_old, clipped and differentiated (notebook 04), and the
sampler correction's rho_seq = prod_t pi_old / pi_sampler over the response's
tokens, detached, kept where it lies in [low, high] and 0 elsewhere, as a
weight on each token's policy-gradient term; then the per-response mean
(notebook 06). The reference is :func:`grpo_lab.train_step.microbatch_loss` with
``importance_reweighting_method="grpo"`` and ``sampler_correction=
"sequence_mask"``. A wrong answer that matches one of the usual slips (the
ratios swapped or upside down, a token-level mask, a geometric mean, padding
counted, a weight that carries a gradient) is told which slip it is.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from grpo_lab.teaching.checks.framework import (
    CaseCount,
    ExerciseFailed,
    assert_value_and_gradient,
    exercise_check,
)
from grpo_lab.train_step import UpdateSettings, microbatch_loss

CorrectedLoss = Callable[..., torch.Tensor]
_Case = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def reference_corrected_loss(
    policy_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    sampler_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float,
    low: float,
    high: float,
) -> torch.Tensor:
    """The package's loss. (B, T) x 3, (B,), (B, T) -> scalar."""
    settings = UpdateSettings(
        importance_reweighting_method="grpo",
        cliprange=cliprange,
        loss_normalization="sequence",
        sampler_correction="sequence_mask",
        sampler_correction_low=low,
        sampler_correction_high=high,
    )
    microbatch = {
        "response_mask": response_mask,
        "advantages": advantages,
        "old_log_probs": old_log_probs,
        "sampler_log_probs": sampler_log_probs,
    }
    loss, _ = microbatch_loss(
        policy_log_probs, torch.zeros_like(policy_log_probs), microbatch, settings
    )
    return loss


def _corrected_cases() -> list[tuple[_Case, float, float, float]]:
    # Four responses after one prompt token, three of them padded. log(pi_old /
    # pi_sampler) per response token sums to 0.9 (rho_seq 2.46: kept in [0, 3]),
    # 1.5 (4.48: masked out, although no token's own ratio exceeds 2.2), -0.4
    # (0.67, kept; its geometric mean would be 0.82) and 0.5 (1.65, kept; the
    # padding holds log-ratios of +3 that would push it out). pi / pi_old spans
    # the clip. The prompt position holds log-probs too: weight 0 there.
    old = torch.full((4, 5), -1.2, dtype=torch.float64)  # (B, T)
    sampler_gap = torch.tensor(
        [
            [2.0, 0.3, 0.3, 0.3, 0.0],
            [-1.0, 0.8, 0.7, 0.0, 0.0],
            [0.5, -0.2, -0.2, 0.0, 0.0],
            [0.0, 0.5, 3.0, 3.0, 3.0],
        ]
    ).double()  # log pi_old - log pi_sampler
    sampler = old - sampler_gap  # (B, T)
    policy_gap = torch.tensor(
        [
            [0.0, 0.3, -0.4, 0.1, 0.0],
            [0.0, -0.1, 0.25, 0.0, 0.0],
            [0.0, 0.5, -0.05, 0.0, 0.0],
            [0.0, -0.3, 0.0, 0.0, 0.0],
        ]
    ).double()  # log pi - log pi_old
    mask = torch.tensor(
        [[0, 1, 1, 1, 1], [0, 1, 1, 0, 0], [0, 1, 1, 0, 0], [0, 1, 0, 0, 0]]
    )
    advantages = torch.tensor([1.0, -0.5, 0.8, -1.2]).double()
    generator = torch.Generator().manual_seed(0)
    random_old = -torch.rand(3, 6, generator=generator).double() * 3  # (B, T)
    random_sampler = random_old + 0.5 * torch.randn(3, 6, generator=generator).double()
    random_policy = random_old + 0.3 * torch.randn(3, 6, generator=generator).double()
    ragged = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 1, 1, 0, 0, 0], [0, 0, 0, 1, 1, 1]])
    random_advantages = torch.tensor([0.7, -1.5, 1.1]).double()
    return [
        ((old + policy_gap, old, sampler, advantages, mask), 0.2, 0.0, 3.0),
        (
            (random_policy, random_old, random_sampler, random_advantages, ragged),
            0.2,
            0.5,
            2.0,
        ),
    ]


def _describe(case: _Case, cliprange: float, low: float, high: float) -> str:
    policy, old, sampler, advantages, mask = case
    token_gap = ((old - sampler) * mask).round(decimals=3)  # (B, T)
    return (
        f"advantages={advantages.tolist()}, log pi - log pi_old="
        f"{(policy - old).round(decimals=3).tolist()}, log pi_old - log pi_sampler="
        f"{token_gap.tolist()} (0 shown where the mask is 0), response_mask="
        f"{mask.tolist()}, cliprange={cliprange}, low={low}, high={high}"
    )


@exercise_check("Exercise 11-corrected_loss (the sampler-corrected loss, sequence MIS)")
def check_corrected_loss(student_fn: CorrectedLoss, cases: CaseCount) -> None:
    """``student_fn(policy_log_probs, old_log_probs, sampler_log_probs,
    advantages, response_mask, cliprange, low, high)`` -> scalar; its gradient
    by ``policy_log_probs`` must match too."""
    for case, cliprange, low, high in _corrected_cases():
        with cases.case():
            policy, old, sampler, advantages, mask = case
            reference_input = policy.clone().requires_grad_(True)
            expected = reference_corrected_loss(
                reference_input, old, sampler, advantages, mask, cliprange, low, high
            )
            student_input = policy.clone().requires_grad_(True)
            inputs = _describe(case, cliprange, low, high)
            try:
                received = student_fn(
                    student_input,
                    old.clone(),
                    sampler.clone(),
                    advantages.clone(),
                    mask.clone(),
                    cliprange,
                    low,
                    high,
                )
            except ValueError as error:
                if low != 0 or "math domain error" not in str(error):
                    raise
                raise ExerciseFailed(
                    f"For {inputs}: math.log(low) fails at low = 0, a bound the "
                    "notebook allows (keep every response above 0): compare "
                    "rho_seq itself with low and high, or take torch.log, whose "
                    "log(0) is -inf"
                ) from None
            try:
                assert_value_and_gradient(
                    received, expected, student_input, reference_input, inputs
                )
            except ExerciseFailed as failure:
                hint = _which_slip(received, expected, case, cliprange, low, high)
                if hint is None:
                    raise
                raise ExerciseFailed(f"{hint}: {failure}") from None


def _slip_values(
    case: _Case, cliprange: float, low: float, high: float
) -> dict[str, float]:
    """The loss each usual slip would give, and what to say about it."""
    policy, old, sampler, advantages, mask = case
    keep = mask.bool()
    values = {}

    def loss_with(weight: torch.Tensor) -> float:
        ratio = torch.exp(policy - old)  # (B, T)
        a = advantages.unsqueeze(-1)  # (B, 1)
        per_token = -torch.minimum(
            ratio * a, ratio.clamp(1 - cliprange, 1 + cliprange) * a
        )
        per_token = per_token * weight * mask
        return (per_token.sum(1) / mask.sum(1)).mean().item()

    log_gap = torch.where(keep, old - sampler, 0.0)  # (B, T)

    def sequence_mask(log_ratio: torch.Tensor) -> torch.Tensor:
        rho = log_ratio.exp()  # (B, 1)
        return torch.where((rho >= low) & (rho <= high), rho, 0.0)

    values["the sampler weight is pi_old / pi_sampler, upside down here"] = loss_with(
        sequence_mask(-log_gap.sum(1, keepdim=True))
    )
    values["mask each response by its sequence ratio rho_seq, not token by token"] = (
        loss_with(
            torch.where(
                (log_gap.exp() >= low) & (log_gap.exp() <= high), log_gap.exp(), 0.0
            )
        )
    )
    values["rho_seq is the product of the token ratios, not their geometric mean"] = (
        loss_with(
            sequence_mask(log_gap.sum(1, keepdim=True) / mask.sum(1, keepdim=True))
        )
    )
    values["padding and prompt positions must not enter rho_seq"] = loss_with(
        sequence_mask((old - sampler).sum(1, keepdim=True))
    )
    values["no correction: the sampler's log-probs were not used"] = loss_with(
        torch.ones_like(policy)
    )
    return values


def _which_slip(
    received: object,
    expected: torch.Tensor,
    case: _Case,
    cliprange: float,
    low: float,
    high: float,
) -> str | None:
    if not isinstance(received, torch.Tensor) or received.numel() != 1:
        return None
    value = received.detach().double().item()
    if abs(value - expected.item()) <= 1e-6 + 1e-5 * abs(expected.item()):
        return (
            "the value is right, its gradient is not: the sampler weight rescales "
            "each token's gradient and is detached; pi / pi_old carries the gradient"
        )
    for message, slip in _slip_values(case, cliprange, low, high).items():
        if abs(value - slip) <= 1e-6 + 1e-5 * abs(slip):
            return message
    return None
