"""Checks for ``notebooks/02_logprobs_and_entropy.ipynb``.

Exercises: per-token log-probabilities from logits (gather minus logsumexp) and
per-token entropy. The references are the package functions
:func:`grpo_lab.logprobs.get_response_log_probs` (run on fixed logits) and
:func:`grpo_lab.logprobs.compute_entropy`; values and gradients with respect to
the logits are compared (both quantities are trained through).
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import torch

from grpo_lab.logprobs import compute_entropy, get_response_log_probs
from grpo_lab.teaching.checks.framework import (
    CaseCount,
    assert_value_and_gradient,
    exercise_check,
)


class _FixedLogits(torch.nn.Module):
    """A stand-in model whose forward returns given logits, whatever the input."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = logits

    def forward(self, input_ids: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(logits=self.logits)


def reference_token_log_probs(
    logits: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """The package's log p(label) for given logits (B, T, V) and labels (B, T)."""
    model = _FixedLogits(logits)
    return get_response_log_probs(model, labels, labels, logits_chunk_size=0)[
        "log_probs"
    ]


def _logit_cases() -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    random_logits = torch.randn(2, 3, 5, generator=generator)  # (B, T, V)
    random_labels = torch.randint(0, 5, (2, 3), generator=generator)  # (B, T)
    # Logits in the thousands: exp() overflows, a stable logsumexp does not.
    large_logits = torch.tensor([[[1000.0, 999.0, 990.0], [-5.0, 0.0, 2000.0]]])
    large_labels = torch.tensor([[1, 0]])
    uniform_logits = torch.zeros(1, 2, 4)  # log p = -log 4 everywhere
    uniform_labels = torch.tensor([[0, 3]])
    return [
        ("random logits of shape (2, 3, 5)", random_logits, random_labels),
        ("logits around 1000 (overflow test)", large_logits, large_labels),
        ("uniform logits over 4 tokens", uniform_logits, uniform_labels),
    ]


@exercise_check("Per-token log-probabilities")
def check_token_log_probs(
    student_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    cases: CaseCount,
) -> None:
    """``student_fn(logits (B, T, V), labels (B, T))`` -> log-probs (B, T)."""
    for name, logits, labels in _logit_cases():
        with cases.case():
            reference_logits = logits.clone().requires_grad_(True)
            expected = reference_token_log_probs(reference_logits, labels)
            student_logits = logits.clone().requires_grad_(True)
            received = student_fn(student_logits, labels.clone())
            inputs = f"{name}, logits={logits.tolist()}, labels={labels.tolist()}"
            assert_value_and_gradient(
                received,
                expected,
                student_logits,
                reference_logits,
                inputs,
                "logits",
                1e-4,
            )


@exercise_check("Per-token entropy")
def check_token_entropy(
    student_fn: Callable[[torch.Tensor], torch.Tensor],
    cases: CaseCount,
) -> None:
    """``student_fn(logits (..., V))`` -> entropy in nats (...), with its
    gradient (an entropy bonus trains through it)."""
    generator = torch.Generator().manual_seed(1)
    settings = [
        ("uniform logits over 4 tokens (entropy log 4)", torch.zeros(2, 4)),
        ("one certain token (entropy ~0)", torch.tensor([[200.0, 0.0, 0.0]])),
        ("random logits of shape (2, 3, 5)", torch.randn(2, 3, 5, generator=generator)),
        ("logits around 1000 (overflow test)", torch.tensor([[1000.0, 999.0]])),
    ]
    for name, logits in settings:
        with cases.case():
            reference_logits = logits.clone().requires_grad_(True)
            expected = compute_entropy(reference_logits)
            student_logits = logits.clone().requires_grad_(True)
            received = student_fn(student_logits)
            assert_value_and_gradient(
                received,
                expected,
                student_logits,
                reference_logits,
                f"{name}, logits={logits.tolist()}",
                "logits",
                1e-4,
            )
