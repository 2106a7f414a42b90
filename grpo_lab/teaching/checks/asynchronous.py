"""Checks for ``notebooks/16_asynchronous_grpo.ipynb``.

The exercise: what an asynchronous trainer does with one batch of groups, each
tagged with the policy version that sampled it. Two decisions compose in it:

* admission: a group sampled by version v is ``trainer_version - v`` steps
  old, and is trained on only when that is at most ``max_staleness`` (a group
  at the bound is kept); a dropped group leaves the loss entirely, its
  responses out of the mean as well as out of the sum;
* the correction: each kept token's policy-gradient term is weighted by the
  truncated importance weight w_t = min(pi_trainer(y_t) / pi_sampler(y_t),
  cap) (TIS, token level), detached, with pi_trainer the policy's own
  log-probs (one update per batch: pi_old is the policy as it is).

Per token the loss is -A * (pi / pi_old) * w_t, with pi / pi_old = 1 in value
and the gradient of log pi; then the mean over each kept response's tokens
and over the kept responses (sequence normalization, notebook 06). The
reference is :func:`grpo_lab.training.staleness.within_bound` for the
admission and :func:`grpo_lab.train_step.microbatch_loss` (``grpo``,
``sampler_correction="token_truncate"``) on the kept rows; values, the kept
groups and the gradient by ``policy_log_probs`` are compared.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from grpo_lab.teaching.checks.framework import (
    CaseCount,
    ExerciseFailed,
    assert_close,
    assert_value_and_gradient,
    exercise_check,
)
from grpo_lab.train_step import UpdateSettings, microbatch_loss
from grpo_lab.training.staleness import within_bound

AdmittedLoss = Callable[..., tuple[torch.Tensor, torch.Tensor]]
Tensor = torch.Tensor
_Case = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, int, int, float]


def reference_admitted_loss(
    policy_log_probs: torch.Tensor,
    sampler_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    group_versions: torch.Tensor,
    trainer_version: int,
    max_staleness: int,
    cap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The package's admission and corrected loss.

    (B, T) x 2, (B,), (B, T), (N,) ints with B = N * G -> (kept (N,) bool,
    scalar loss over the kept groups' responses)."""
    kept = within_bound(group_versions, trainer_version, max_staleness)  # (N,)
    group_size = policy_log_probs.shape[0] // group_versions.shape[0]
    rows = kept.repeat_interleave(group_size)  # (B,)
    settings = UpdateSettings(
        importance_reweighting_method="grpo",
        cliprange=0.2,  # inactive: pi / pi_old is 1 on the batch's one update
        loss_normalization="sequence",
        sampler_correction="token_truncate",
        sampler_correction_cap=cap,
    )
    microbatch = {
        "response_mask": response_mask[rows],
        "advantages": advantages[rows],
        "old_log_probs": policy_log_probs[rows].detach(),
        "sampler_log_probs": sampler_log_probs[rows],
    }
    policy = policy_log_probs[rows]
    loss, _ = microbatch_loss(policy, torch.zeros_like(policy), microbatch, settings)
    return kept, loss


def _cases() -> list[_Case]:
    # Four groups of two responses after no prompt token, trained at version 6
    # with a bound of 2: versions 6, 4 (at the bound: kept), 3 (one over it:
    # dropped) and 5. Responses of 4, 2, 3, 1, 4, 4, 2 and 3 tokens (a token
    # mean weighs them otherwise). log pi - log pi_sampler: some tokens above
    # log 2 (truncated at cap 2), some below 0; the padding holds gaps of 5
    # nats, so that any term counted there shows; the dropped group holds the
    # largest advantages, so that keeping it or counting its rows shows.
    policy = torch.tensor(
        [
            [-0.5, -1.0, -2.0, -0.3],
            [-1.2, -0.1, -3.0, -3.0],
            [-0.9, -0.4, -1.5, -3.0],
            [-0.2, -3.0, -3.0, -3.0],
            [-1.1, -0.6, -0.8, -2.2],
            [-0.7, -1.9, -0.4, -0.5],
            [-2.5, -0.3, -3.0, -3.0],
            [-0.6, -1.4, -0.9, -3.0],
        ],
        dtype=torch.float64,
    )  # (B, T)
    gaps = torch.tensor(
        [
            [0.2, 1.1, -0.3, 0.0],
            [-0.6, 0.9, 5.0, 5.0],
            [1.4, -0.2, 0.3, 5.0],
            [0.5, 5.0, 5.0, 5.0],
            [2.0, 1.0, -1.0, 0.4],
            [0.1, 0.1, 0.1, 0.1],
            [-0.4, 1.3, 5.0, 5.0],
            [0.8, -0.5, 0.9, 5.0],
        ],
        dtype=torch.float64,
    )  # log pi - log pi_sampler
    lengths = torch.tensor([4, 2, 3, 1, 4, 4, 2, 3])
    mask = (torch.arange(4)[None, :] < lengths[:, None]).int()  # (B, T)
    advantages = torch.tensor(
        [1.0, -1.0, 0.7, -0.7, 3.0, -2.5, -0.9, 0.9], dtype=torch.float64
    )
    versions = torch.tensor([6, 4, 3, 5])
    fixed = (policy, policy - gaps, advantages, mask, versions, 6, 2, 2.0)
    # Random: five groups of three, versions 0..9 at trainer version 9, bound 4.
    generator = torch.Generator().manual_seed(16)
    random_policy = -torch.rand(15, 6, generator=generator).double() * 3
    random_sampler = random_policy - torch.randn(15, 6, generator=generator).double()
    random_lengths = torch.randint(1, 7, (15,), generator=generator)
    random_mask = (torch.arange(6)[None, :] < random_lengths[:, None]).int()
    random_advantages = torch.randn(15, generator=generator).double()
    random_versions = torch.tensor([9, 2, 5, 7, 4])
    random = (
        random_policy,
        random_sampler,
        random_advantages,
        random_mask,
        random_versions,
        9,
        4,
        1.5,
    )
    return [fixed, random]


def _describe(case: _Case) -> str:
    policy, sampler, advantages, mask, versions, trainer, bound, cap = case
    gaps = (policy - sampler).round(decimals=3)
    return (
        f"group_versions={versions.tolist()}, trainer_version={trainer}, "
        f"max_staleness={bound}, cap={cap}, advantages={advantages.tolist()}, "
        f"log pi - log pi_sampler={gaps.tolist()}, response_mask={mask.tolist()}"
    )


@exercise_check("the admitted, corrected loss")
def check_admitted_loss(student_fn: AdmittedLoss, cases: CaseCount) -> None:
    """``student_fn(policy_log_probs, sampler_log_probs, advantages,
    response_mask, group_versions, trainer_version, max_staleness, cap)`` ->
    ``(kept, loss)``: the groups kept (N,) bool, and the scalar loss, whose
    gradient by ``policy_log_probs`` must match."""
    for case in _cases():
        with cases.case():
            policy, sampler, advantages, mask, versions, trainer, bound, cap = case
            description = _describe(case)
            reference_input = policy.clone().requires_grad_(True)
            expected_kept, expected = reference_admitted_loss(
                reference_input, *case[1:]
            )
            student_input = policy.clone().requires_grad_(True)
            received = student_fn(
                student_input,
                sampler.clone(),
                advantages.clone(),
                mask.clone(),
                versions.clone(),
                trainer,
                bound,
                cap,
            )
            if not isinstance(received, tuple) or len(received) != 2:
                raise ExerciseFailed(
                    f"For {description}: expected a pair (kept, loss), got "
                    f"{type(received).__name__}"
                )
            kept, loss = received
            if not isinstance(kept, torch.Tensor):
                raise ExerciseFailed(
                    f"For {description}: kept must be a tensor of N booleans, got "
                    f"{type(kept).__name__}"
                )
            assert_close(
                kept.bool(), expected_kept, f"{description} (the groups kept)", atol=0
            )
            assert_value_and_gradient(
                loss, expected, student_input, reference_input, description
            )
