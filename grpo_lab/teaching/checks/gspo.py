"""Checks for ``notebooks/05_gspo.ipynb``.

Exercise 1: GSPO's sequence-level ratio, the geometric mean of the token
ratios over the response, s_i = exp(mean_{t in o_i} (log pi - log pi_old)).
The reference is :func:`grpo_lab.losses.compute_policy_gradient_loss` with
``importance_reweighting_method="gspo"``: with advantage 1 and an infinite
clip range its per-token loss is -s_i on every token of response i. The
ratio is trained through, so its gradient with respect to ``policy_log_probs``
is compared too: a detached ratio fails.

Exercise 2: GSPO's scalar loss of a batch, composed from Exercise 1's ratio, the
clipped surrogate of notebook 04 and the per-response mean of notebook 06; the
reference is the package's GSPO loss reduced by
:func:`grpo_lab.aggregation.aggregate_loss_across_microbatch`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from grpo_lab.aggregation import aggregate_loss_across_microbatch
from grpo_lab.losses import compute_policy_gradient_loss
from grpo_lab.teaching.checks.aggregation import reference_grpo_loss
from grpo_lab.teaching.checks.framework import (
    CaseCount,
    ExerciseFailed,
    assert_value_and_gradient,
    exercise_check,
)


def reference_sequence_ratio(
    policy_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
) -> torch.Tensor:
    """s_i read off the package's GSPO loss, with its gradient. (B, T) x 3 -> (B,)."""
    advantages = torch.ones(policy_log_probs.shape[0])  # (B,)
    per_token_loss, _ = compute_policy_gradient_loss(
        advantages,
        policy_log_probs,
        "gspo",
        old_log_probs,
        float("inf"),
        response_mask,
    )
    return -per_token_loss[:, 0]  # (B,)


def _ratio_cases() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    # Token ratios 2 and 0.5 around one prompt token and one pad: geometric mean
    # 1, arithmetic mean 1.25; the prompt and pad positions must not count.
    old = torch.full((1, 4), -1.0)  # (B, T)
    policy = old + torch.tensor([[3.0, 2.0, 0.5, 7.0]]).log()
    mask = torch.tensor([[0, 1, 1, 0]])
    generator = torch.Generator().manual_seed(0)
    random_old = -torch.rand(3, 6, generator=generator) * 3  # (B, T)
    random_policy = random_old + 0.3 * torch.randn(3, 6, generator=generator)
    ragged_mask = torch.tensor(
        [[0, 0, 1, 1, 1, 1], [0, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 1]]
    )
    return [(policy, old, mask), (random_policy, random_old, ragged_mask)]


@exercise_check("Exercise 05-sequence_ratio (GSPO's sequence-level ratio)")
def check_sequence_ratio(
    student_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    cases: CaseCount,
) -> None:
    """``student_fn(policy_log_probs, old_log_probs, response_mask)`` -> (B,)."""
    for policy_log_probs, old_log_probs, response_mask in _ratio_cases():
        with cases.case():
            reference_input = policy_log_probs.clone().requires_grad_(True)
            expected = reference_sequence_ratio(
                reference_input, old_log_probs, response_mask
            )
            student_input = policy_log_probs.clone().requires_grad_(True)
            received = student_fn(
                student_input, old_log_probs.clone(), response_mask.clone()
            )
            token_ratios = (policy_log_probs - old_log_probs).exp().round(decimals=3)
            inputs = (
                f"token ratios={token_ratios.tolist()}, "
                f"response_mask={response_mask.tolist()}"
            )
            assert_value_and_gradient(
                received, expected, student_input, reference_input, inputs
            )


# --- Exercise 05-gspo_loss: GSPO's scalar loss, composed ---------------------------
#
# The student composes Exercise 05-sequence_ratio, notebook 04's clipped surrogate
# (on one ratio per response) and notebook 06's per-response mean. The reference
# is the package's own pieces: compute_policy_gradient_loss("gspo"), whose
# per-token loss repeats l_i on every token, reduced by the per-response mean.

GspoLoss = Callable[..., torch.Tensor]


def reference_gspo_loss(
    policy_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float,
) -> torch.Tensor:
    """mean_i -min(s_i A_i, clip(s_i, 1 - eps, 1 + eps) A_i), with its gradient."""
    per_token_loss, _ = compute_policy_gradient_loss(
        advantages, policy_log_probs, "gspo", old_log_probs, cliprange, response_mask
    )  # (B, T): l_i on every token of response i
    return aggregate_loss_across_microbatch(per_token_loss, response_mask, "sequence")


def _gspo_cases() -> list[tuple[torch.Tensor, ...]]:
    # Four responses of 1, 4, 2 and 3 tokens after a prompt column; padding holds
    # log-prob 0 (token ratios up to e^2.5) and must not count. Mean log-ratios
    # 0.3, 0.05, -0.25 and -0.02: with eps = 0.1 the sequence ratios 1.35 and
    # 0.78 are outside [0.9, 1.1], 1.05 and 0.98 inside; advantages of both
    # signs, so that the clip removes some gradients and keeps others. The token
    # ratios are spread around their means, so that a token-level clip, an
    # arithmetic mean and a product of the ratios all give other values.
    generator = torch.Generator().manual_seed(5)
    old = -torch.rand(4, 6, generator=generator) * 2 - 0.5  # (B, T)
    log_ratio = torch.tensor(
        [
            [0.0, 0.3, 0.0, 0.0, 0.0, 0.0],
            [0.0, 0.4, -0.3, 0.25, -0.15, 0.0],
            [0.0, -0.6, 0.1, 0.0, 0.0, 0.0],
            [0.0, 0.2, -0.35, 0.09, 0.0, 0.0],
        ]
    )  # (B, T)
    mask = torch.tensor(
        [[0, 1, 0, 0, 0, 0], [0, 1, 1, 1, 1, 0], [0, 1, 1, 0, 0, 0], [0, 1, 1, 1, 0, 0]]
    )  # (B, T)
    padding = torch.zeros_like(mask, dtype=torch.bool)
    padding[:, 1:] = mask[:, 1:] == 0
    policy = torch.where(padding, 0.0, old + log_ratio).double()  # (B, T)
    advantages = torch.tensor([1.0, -0.5, -2.0, 1.5], dtype=torch.float64)  # (B,)
    return [
        (policy, old.double(), advantages, mask, 0.1),
        (policy, old.double(), -advantages, mask, 0.2),
    ]


def _gspo_slips(policy, old, advantages, mask, cliprange) -> dict[str, torch.Tensor]:
    """The loss each usual slip gives, and what to say about it."""
    keep = mask.bool()
    log_ratio = torch.where(keep, policy - old, 0.0)  # (B, T)
    lengths = mask.sum(dim=1)  # (B,)

    def surrogate(ratio: torch.Tensor, eps: float) -> torch.Tensor:  # (B,) -> ()
        clipped = torch.clamp(ratio, 1 - eps, 1 + eps)
        return -torch.minimum(ratio * advantages, clipped * advantages).mean()

    geometric = torch.exp(log_ratio.sum(dim=1) / lengths)  # (B,)
    per_token_loss, _ = compute_policy_gradient_loss(
        advantages, policy, "gspo", old, cliprange, mask
    )  # (B, T)
    arithmetic = torch.where(keep, (policy - old).exp(), 0.0).sum(dim=1) / lengths
    return {
        "the ratio is per token (GRPO's loss), not one ratio per sequence": (
            reference_grpo_loss(policy, old, advantages, mask, cliprange, "sequence")
        ),
        "the sequence ratio is the arithmetic mean of the token ratios, not the "
        "geometric mean": surrogate(arithmetic, cliprange),
        "the sequence ratio is the product of the token ratios (the log-ratios "
        "summed, not averaged)": surrogate(torch.exp(log_ratio.sum(dim=1)), cliprange),
        "the clip is left out": surrogate(geometric, float("inf")),
        "padding and prompt positions count in the sequence ratio": surrogate(
            torch.exp((policy - old).mean(dim=1)), cliprange
        ),
        "the sign is flipped (the loss is minus the objective)": -surrogate(
            geometric, cliprange
        ),
        "the responses are weighted by their length (a token mean), not equally": (
            aggregate_loss_across_microbatch(per_token_loss, mask, "token")
        ),
    }


@exercise_check("Exercise 05-gspo_loss (GSPO's loss of a batch)")
def check_gspo_loss(student_fn: GspoLoss, cases: CaseCount) -> None:
    """``student_fn(policy_log_probs, old_log_probs, advantages, response_mask,
    cliprange)`` -> scalar; its gradient w.r.t. ``policy_log_probs`` too."""
    for policy, old, advantages, mask, cliprange in _gspo_cases():
        with cases.case():
            reference_input = policy.clone().requires_grad_(True)
            expected = reference_gspo_loss(
                reference_input, old, advantages, mask, cliprange
            )
            student_input = policy.clone().requires_grad_(True)
            received = student_fn(
                student_input, old.clone(), advantages.clone(), mask.clone(), cliprange
            )
            ratios = (policy - old).exp().round(decimals=3)  # (B, T)
            inputs = (
                f"token ratios={ratios.tolist()}, advantages={advantages.tolist()}, "
                f"response_mask={mask.tolist()}, cliprange={cliprange}"
            )
            case = (policy, old, advantages, mask, cliprange)
            _name_a_gspo_slip(received, expected, case, inputs)
            assert_value_and_gradient(
                received, expected, student_input, reference_input, inputs, atol=1e-9
            )


def _name_a_gspo_slip(received, expected, case, inputs: str) -> None:
    if not isinstance(received, torch.Tensor) or received.shape != expected.shape:
        return  # assert_close reports the type or shape
    value = received.detach().double()
    if torch.allclose(value, expected.detach(), atol=1e-9):
        return
    for slip, wrong in _gspo_slips(*case).items():
        if torch.allclose(value, wrong.detach(), atol=1e-9):
            raise ExerciseFailed(
                f"For {inputs}:\n  expected {expected.item():.6f}\n  got      "
                f"{value.item():.6f}: {slip}"
            )


# --- end of Exercise 05-gspo_loss -------------------------------------------------
