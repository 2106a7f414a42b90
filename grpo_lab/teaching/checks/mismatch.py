"""Checks for ``notebooks/11_when_the_sampler_is_not_the_policy.ipynb``.

The exercise: the truncated importance-sampling (TIS) weight of every token,

    w_t = min(exp(log pi_trainer(y_t) - log pi_sampler(y_t)), cap)

on response tokens and 0 wherever ``response_mask`` is 0 (prompt, padding),
detached from the graph. The reference is
:func:`grpo_lab.sampler_correction.sampler_correction_weights` with
``mode="token_truncate"``. A wrong answer that matches one of the usual slips
(the ratio upside down, no cap, padding left in, a weight that carries a
gradient) is told which slip it is.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from grpo_lab.sampler_correction import sampler_correction_weights
from grpo_lab.teaching.checks.framework import (
    CaseCount,
    ExerciseFailed,
    assert_close,
    exercise_check,
)

TisFunction = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def reference_tis_weights(
    trainer_log_probs: torch.Tensor,
    sampler_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    cap: float,
) -> torch.Tensor:
    """The package's token_truncate weights. (B, T) x 3 -> (B, T), detached."""
    weights, _ = sampler_correction_weights(
        trainer_log_probs,
        sampler_log_probs,
        response_mask,
        mode="token_truncate",
        cap=cap,
    )
    return weights  # (B, T)


def _tis_cases() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]]:
    # One response of three tokens after a prompt token, then a pad:
    # rho = exp(0.5) = 1.649, exp(-1.5) = 0.223, exp(1.5) = 4.48 -> cap 3.
    # The prompt and pad positions hold log-probs too (rho 20.1 and 0.37):
    # their weight must still be 0.
    trainer = torch.tensor([[-2.0, -1.0, -2.0, -0.5, 0.0]])  # (B, T)
    sampler = torch.tensor([[-5.0, -1.5, -0.5, -2.0, 1.0]])  # (B, T)
    mask = torch.tensor([[0, 1, 1, 1, 0]])
    # Ragged rows, ratios spread over [e^-2, e^2], cap 2 (not the default 3).
    generator = torch.Generator().manual_seed(0)
    random_trainer = -torch.rand(3, 6, generator=generator) * 3  # (B, T)
    random_sampler = random_trainer + 1.4 * torch.randn(3, 6, generator=generator)
    ragged = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 1]])
    return [
        (trainer, sampler, mask, 3.0),
        (random_trainer, random_sampler, ragged, 2.0),
    ]


def _slips(
    trainer: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor, cap: float
) -> dict[str, torch.Tensor]:
    """The weights each usual slip would give, and what to say about it."""
    ratio = torch.exp(trainer - sampler)  # (B, T)
    inverted = torch.exp(sampler - trainer)  # (B, T)
    return {
        "the ratio is upside down: w = pi_trainer / pi_sampler = "
        "exp(trainer_log_probs - sampler_log_probs)": inverted.clamp(max=cap) * mask,
        "the ratio is upside down (and not capped)": inverted * mask,
        # Before "no cap": on a case whose ratios stay below 3 the two agree.
        "the cap must be the argument cap, not a fixed number": (
            ratio.clamp(max=3.0 if cap != 3.0 else 2.0) * mask
        ),
        f"a ratio above cap = {cap:g} was kept: truncate it, w = min(rho, cap)": (
            ratio * mask
        ),
        "prompt and padding positions (response_mask 0) must get weight 0": (
            ratio.clamp(max=cap)
        ),
    }


def _which_slip(
    received: object,
    trainer: torch.Tensor,
    sampler: torch.Tensor,
    mask: torch.Tensor,
    cap: float,
) -> str | None:
    if not isinstance(received, torch.Tensor) or received.shape != mask.shape:
        return None
    for message, weights in _slips(trainer, sampler, mask, cap).items():
        if torch.allclose(received.detach().double(), weights.double(), atol=1e-5):
            return message
    return None


def _describe(
    trainer: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor, cap: float
) -> str:
    rho = torch.exp(trainer - sampler).round(decimals=3)  # (B, T)
    return (
        f"trainer_log_probs={trainer.round(decimals=3).tolist()}, "
        f"sampler_log_probs={sampler.round(decimals=3).tolist()} "
        f"(rho = {rho.tolist()}), response_mask={mask.tolist()}, cap={cap:g}"
    )


@exercise_check("Truncated importance-sampling weights")
def check_tis_weights(student_fn: TisFunction, cases: CaseCount) -> None:
    """``student_fn(trainer_log_probs, sampler_log_probs, response_mask, cap)``
    -> (B, T) weights."""
    for trainer, sampler, mask, cap in _tis_cases():
        with cases.case():
            expected = reference_tis_weights(trainer, sampler, mask, cap)
            student_trainer = trainer.clone().requires_grad_(True)
            received = student_fn(student_trainer, sampler.clone(), mask.clone(), cap)
            inputs = _describe(trainer, sampler, mask, cap)
            slip = _which_slip(received, trainer, sampler, mask, cap)
            try:
                assert_close(received, expected, inputs, atol=1e-5)
            except ExerciseFailed as failure:
                if slip is None:
                    raise
                raise ExerciseFailed(f"{failure}\n  hint: {slip}") from None
            if received.requires_grad:
                raise ExerciseFailed(
                    f"For {inputs}: the weights carry a gradient to trainer_log_probs. "
                    "Detach them: a TIS weight rescales each token's gradient, it is "
                    "not differentiated."
                )
