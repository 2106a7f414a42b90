"""Checks for ``notebooks/15_on_policy_distillation.ipynb``.

The exercise: the distillation loss of a batch from the two models' log-probs
on the student's sampled tokens and the response mask. With
log r = log pi_teacher - log pi_student per token,

    k1 = -log r,   k2 = (log r)^2 / 2,   k3 = e^(log r) - 1 - log r,

and the loss is the mean of the chosen estimator over the response tokens of
the batch (one token mean, as a token-normalized run takes it), with no
gradient into the teacher. The reference is
:func:`grpo_lab.distillation.distillation_token_loss` (form "loss") reduced by
:func:`grpo_lab.aggregation.reduce_masked_loss` (token normalization); value
and gradient are compared, and the hidden cases hold padding whose log-probs
are far apart, a teacher above the student on some tokens and below on others,
and rows of different lengths.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from grpo_lab.aggregation import reduce_masked_loss
from grpo_lab.distillation import distillation_token_loss
from grpo_lab.losses import ObjectiveOptions
from grpo_lab.teaching.checks.framework import (
    CaseCount,
    ExerciseFailed,
    assert_value_and_gradient,
    exercise_check,
)

DistillationLoss = Callable[..., torch.Tensor]


def reference_distillation_loss(
    student_log_probs: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    estimator: str,
) -> torch.Tensor:
    """The package's token-mean distillation loss. (B, T) x 3 -> scalar."""
    per_token, _ = distillation_token_loss(
        student_log_probs,
        teacher_log_probs,
        response_mask,
        ObjectiveOptions(),
        distillation="loss",
        estimator=estimator,
    )  # (B, T)
    return reduce_masked_loss(per_token, response_mask, "token", None)


def _cases() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]]:
    # Rows of 4, 2 and 1 tokens (a per-row mean weighs them otherwise); the
    # teacher 0.7 above, 0.4 below and equal to the student; the padding far
    # apart (a gap of 6 nats) so that any term counted there shows.
    student = torch.tensor(
        [[-0.5, -1.0, -2.0, -0.3], [-1.2, -0.1, -3.0, -3.0], [-0.9, -3.0, -3.0, -3.0]],
        dtype=torch.float64,
    )  # (B, T)
    gaps = torch.tensor(
        [[0.7, -0.4, 0.0, 0.3], [-0.8, 0.5, 6.0, 6.0], [0.2, 6.0, 6.0, 6.0]],
        dtype=torch.float64,
    )  # log pi_teacher - log pi_student
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    generator = torch.Generator().manual_seed(15)
    random_student = -torch.rand(4, 6, generator=generator).double() * 3
    random_teacher = random_student + torch.randn(4, 6, generator=generator).double()
    random_mask = (torch.arange(6)[None, :] < torch.tensor([6, 3, 5, 2])[:, None]).int()
    fixed = (student, student + gaps, mask)
    random = (random_student, random_teacher, random_mask)
    return [
        (*data, estimator)
        for data in (fixed, random)
        for estimator in ("k1", "k2", "k3")
    ]


def _describe(student, teacher, mask, estimator) -> str:
    gaps = (teacher - student).round(decimals=3)
    return (
        f"estimator={estimator!r}, log pi_teacher - log pi_student={gaps.tolist()}, "
        f"response_mask={mask.tolist()}"
    )


@exercise_check("the distillation loss")
def check_distillation_loss(student_fn: DistillationLoss, cases: CaseCount) -> None:
    """``student_fn(student_log_probs, teacher_log_probs, response_mask,
    estimator)`` -> scalar; its gradient by ``student_log_probs`` must match,
    and none may reach ``teacher_log_probs``."""
    for student, teacher, mask, estimator in _cases():
        with cases.case():
            reference_input = student.clone().requires_grad_(True)
            expected = reference_distillation_loss(
                reference_input, teacher, mask, estimator
            )
            student_input = student.clone().requires_grad_(True)
            teacher_input = teacher.clone().requires_grad_(True)
            received = student_fn(student_input, teacher_input, mask.clone(), estimator)
            description = _describe(student, teacher, mask, estimator)
            _check_teacher_detached(received, teacher_input, description)
            assert_value_and_gradient(
                received,
                expected,
                student_input,
                reference_input,
                description,
                wrt="student_log_probs",
            )


def _check_teacher_detached(
    received: torch.Tensor, teacher_input: torch.Tensor, description: str
) -> None:
    """The teacher is frozen: no gradient may flow into its log-probs."""
    if not isinstance(received, torch.Tensor) or not received.requires_grad:
        return
    (gradient,) = torch.autograd.grad(
        received.sum(), teacher_input, retain_graph=True, allow_unused=True
    )
    if gradient is not None and gradient.abs().max() > 0:
        raise ExerciseFailed(
            "the teacher's log-probs receive a gradient: the teacher is frozen, so "
            f"detach them (teacher_log_probs.detach()); case: {description}"
        )
