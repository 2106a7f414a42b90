"""On-policy distillation: a frozen teacher's log-probs on the student's samples.

The student samples a response; a frozen teacher scores the very same tokens
(one forward, no gradient, as the KL reference model is scored), and each
token t gets a divergence d_t of the student pi from the teacher pi_T:

    reverse KL by a sampled-token estimator (grpo_lab.kl, log r = log pi_T - log pi)
        k1 = -log r    k2 = (log r)^2 / 2    k3 = r - 1 - log r
    forward KL on the teacher's top k tokens v (needs both models' full logits)
        d_t = sum_v pi_T(v) (log pi_T(v) - log pi(v)), clamped at 0

Three ways to train on d_t, each a setting (``distillation``):

    "loss"    d_t is added to the token's loss with its gradient (the KL as a
              direct loss: arXiv:2306.13649; TRL's DistillationTrainer, verl's
              use_policy_gradient=False);
    "reward"  -sg(d_t) is the token's advantage in the run's own objective
              (the negative KL as a dense reward, verl's use_policy_gradient=True;
              Thinking Machines, "On-Policy Distillation", 2025);

and with ``distillation_task_reward`` GRPO's own task objective is kept and
``distillation_coef * term`` is added to it (verl's use_task_rewards): GRPO + OPD.

Why the estimator matters as a loss. Averaged over the student's own next
token y ~ pi, the gradients are (pi detached where it weighs):

    E[grad k2]                = E[(log pi - log pi_T) grad log pi] = grad KL(pi || pi_T)
    E[grad k3]                = -sum_y pi_T(y) grad log pi(y)      = grad KL(pi_T || pi)
    E[grad (-sg(-k1) log pi)] = grad KL(pi || pi_T)
    E[grad k1]                = E[grad log pi] = 0: k1 as a loss ignores the teacher

and as a reward only k1 gives grad KL(pi || pi_T): k3's value is unbiased, but
E[k3 grad log pi] differs from it by sum_y pi_T(y) grad log pi(y) (verl, too,
recommends k1 there).

So k2 as a loss and k1 as a reward follow the reverse KL (TRL's beta = 1), k3
as a loss the forward KL (TRL's beta = 0), and k1 as a loss is refused. Taught
in ``notebooks/15_on_policy_distillation.ipynb``.
"""

from __future__ import annotations

import math

import torch

from grpo_lab.kl import KL_ESTIMATORS, kl_estimate
from grpo_lab.losses import SEQUENCE_METHODS, ObjectiveOptions

DISTILLATION_FORMS = ("none", "loss", "reward")
# A run scores the sampled tokens only, so its estimators are the sampled-token
# ones; the forward KL on the teacher's top k is :func:`forward_kl_topk`, from
# both models' full logits.
DISTILLATION_ESTIMATORS = KL_ESTIMATORS


def check_distillation_settings(
    distillation: str,
    estimator: str,
    coef: float,
    task_reward: bool,
    method: str = "none",
) -> None:
    """The one check of the distillation settings (config and direct callers).

    ``distillation`` is none, loss or reward; the estimator is k1, k2 or k3;
    ``coef`` is a finite number > 0;
    k1 as a loss is refused (its gradient does not depend on the teacher); the
    reward form needs a token objective (not gspo or gmpo).
    """
    if distillation not in DISTILLATION_FORMS:
        raise ValueError(
            f"distillation must be one of {DISTILLATION_FORMS}, got {distillation!r}"
        )
    if estimator not in DISTILLATION_ESTIMATORS:
        raise ValueError(
            f"distillation_estimator must be one of {DISTILLATION_ESTIMATORS}, "
            f"got {estimator!r}"
        )
    if not (
        isinstance(coef, (int, float))
        and not isinstance(coef, bool)
        and math.isfinite(coef)
        and coef > 0
    ):
        raise ValueError(f"distillation_coef must be a finite number > 0, got {coef!r}")
    if not isinstance(task_reward, bool):
        raise ValueError(
            f"distillation_task_reward must be True or False, got {task_reward!r}"
        )
    if distillation == "none":
        return
    _check_combination(distillation, estimator, method)


def _check_combination(distillation: str, estimator: str, method: str) -> None:
    if distillation == "loss" and estimator == "k1":
        raise ValueError(
            "distillation_estimator 'k1' cannot be a direct loss (distillation "
            "'loss'): its gradient, grad log pi, does not depend on the teacher; "
            "use k2 or k3 as a loss, or k1 with distillation 'reward'"
        )
    # One ratio per response (gspo, gmpo) cannot weigh a per-token advantage.
    if distillation == "reward" and method in SEQUENCE_METHODS:
        raise ValueError(
            f"distillation 'reward' gives each token its own advantage, and "
            f"importance_reweighting_method {method!r} takes one per response; "
            "use a token objective (none, noclip, grpo, cispo, sapo)"
        )


def reverse_kl_per_token(
    student_log_probs: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    estimator: str,
) -> torch.Tensor:
    """d_t (B, T): the ``estimator`` of KL(student || teacher) on each sampled
    token, the teacher detached (:func:`grpo_lab.kl.kl_estimate` with the
    teacher in the reference's place)."""
    return kl_estimate(student_log_probs, teacher_log_probs, estimator)


def forward_kl_topk(
    student_topk_log_probs: torch.Tensor,
    teacher_topk_log_probs: torch.Tensor,
) -> torch.Tensor:
    """sum_k pi_T(v_k) (log pi_T(v_k) - log pi(v_k)) over the teacher's top k
    tokens v_k of each position, clamped at 0. (B, T) from (B, T, K) each.

    Both inputs are log-probs of the full vocabulary's softmax, gathered at the
    teacher's top-k ids. With k the whole vocabulary this is KL(pi_T || pi);
    with fewer, the two masses do not sum to 1 and the truncated sum can go
    below 0, where it is clamped (as verl's forward_kl_topk does).
    """
    if student_topk_log_probs.shape != teacher_topk_log_probs.shape:
        raise ValueError(
            f"teacher_topk_log_probs must have shape "
            f"{tuple(student_topk_log_probs.shape)} like student_topk_log_probs, "
            f"got {tuple(teacher_topk_log_probs.shape)}"
        )
    dtype = torch.promote_types(student_topk_log_probs.dtype, torch.float32)
    teacher = teacher_topk_log_probs.detach().to(dtype)  # (B, T, K)
    student = student_topk_log_probs.to(dtype)  # (B, T, K)
    divergence = (teacher.exp() * (teacher - student)).sum(dim=-1)  # (B, T)
    return divergence.clamp_min(0.0)


def distillation_token_loss(
    student_log_probs: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    options: ObjectiveOptions,
    *,
    distillation: str,
    estimator: str,
    old_log_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The distillation term per token (B, T), before ``distillation_coef``,
    and its diagnostics. Settings are read unchecked (checked once, by
    :func:`check_distillation_settings`, where they entered).

    "loss": d_t itself. "reward": the run's objective (``options``) with the
    per-token advantage a_t = -sg(d_t): for grpo -min(w a_t, clip(w) a_t),
    w = pi / pi_old (pi_old = ``old_log_probs``, or pi detached on-policy: w = 1
    with gradient grad log pi); for none (REINFORCE) -a_t log pi.

    Diagnostics: ``distillation_kl_mean`` (the token mean of d_t),
    ``teacher_log_prob_mean`` and ``student_log_prob_mean`` (token means of the
    sampled tokens' log-probs under each model; a teacher far below the
    student is scoring states it never visits).
    """
    if student_log_probs.dtype in {torch.float16, torch.bfloat16}:
        student_log_probs = student_log_probs.float()
    token_mask = response_mask.bool()  # (B, T)
    divergence = reverse_kl_per_token(
        student_log_probs, teacher_log_probs, estimator
    )  # (B, T)
    if distillation == "loss":
        per_token = divergence
    else:
        old = student_log_probs.detach() if old_log_probs is None else old_log_probs
        if not options.record.uses_ratio:
            old = None
        per_token, _ = options.record.loss(
            -divergence.detach(), student_log_probs, old, token_mask, options
        )  # (B, T)
    diagnostics = {
        "distillation_kl_mean": _token_mean(divergence, token_mask),
        "teacher_log_prob_mean": _token_mean(teacher_log_probs, token_mask),
        "student_log_prob_mean": _token_mean(student_log_probs, token_mask),
    }
    return per_token, diagnostics


def _token_mean(values: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
    """Detached mean over masked-in tokens (0 when there are none)."""
    total = values.detach().float().masked_fill(~token_mask, 0.0).sum()
    return total / token_mask.sum().clamp_min(1)
