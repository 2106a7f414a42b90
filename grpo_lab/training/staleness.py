"""Bounded staleness: which sampled groups an asynchronous trainer may use.

In asynchronous GRPO a rollout worker samples while the trainer trains
(:mod:`grpo_lab.training.rollout_worker`). Each group is tagged with the
version of the weights that sampled it: version v is the policy after v
optimizer steps (GRPO steps; the warm-up's end is version 0). The trainer's
step t computes its gradient at version t - 1, so a group sampled by version v
and trained on at step t has

    staleness = (t - 1) - v        (0: on-policy, the synchronous loop)

A run bounds it by ``max_staleness``. A group over the bound is either dropped
(never trained on: ``drop``) or never sampled, because the worker waits for
newer weights before sampling the batch that would be too old (``pace``).
With the worker's batch n trained on at step n (pacing drops nothing, and the
queue is first in, first out), pacing asks the worker for

    v >= n - 1 - max_staleness

before it samples batch n. Weights reach the worker every ``weight_sync_every``
steps, so the newest version it can get before step n is the last multiple of
k at or below n - 1, at least n - k: pacing can always proceed when
k <= max_staleness + 1, and the config refuses a larger k.

What staleness does to the gradient is notebook 11's sampler mismatch with the
sampler an older policy: a sampler correction (``sampler_correction``: TIS or
MIS weights against the sampler's own log-probs) reweights it. Described in
``docs/asynchronous.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from grpo_lab.rollouts.base import Rollouts
from grpo_lab.tasks.base import Example

ADMISSION_POLICIES = ("drop", "pace")


def check_async_settings(
    max_staleness: object,
    admission: object,
    weight_sync_every: object,
    queue_size: object,
) -> None:
    """The one check of the asynchronous settings (``TrainConfig`` calls it)."""
    if not _is_int(max_staleness) or max_staleness < 0:
        raise ValueError(
            "max_staleness must be an int >= 0 (optimizer steps; 0: the "
            f"synchronous loop), got {max_staleness!r}"
        )
    if admission not in ADMISSION_POLICIES:
        raise ValueError(
            f"async_admission must be one of {ADMISSION_POLICIES}, got {admission!r}"
        )
    if not _is_int(weight_sync_every) or weight_sync_every < 1:
        raise ValueError(
            f"weight_sync_every must be a positive int, got {weight_sync_every!r}"
        )
    if not _is_int(queue_size) or queue_size < 1:
        raise ValueError(
            "async_queue_size must be a positive int (rollout batches), got "
            f"{queue_size!r}"
        )
    if max_staleness > 0 and weight_sync_every > max_staleness + 1:
        raise ValueError(
            f"weight_sync_every must be at most max_staleness + 1 "
            f"({max_staleness + 1}): weights that reach the worker only every "
            f"{weight_sync_every} steps leave it sampling groups older than the "
            f"bound (dropped, or a paced worker waiting forever); got "
            f"{weight_sync_every}"
        )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class TaggedGroup:
    """One prompt's G sampled, graded responses, tagged with who sampled them."""

    # The worker's rollout batch (its prompts and samples are seeded by it).
    batch_index: int
    # The policy version that sampled it: optimizer steps behind its weights.
    version: int
    example: Example
    # The group's G rollouts, with the sampler's own log-probs.
    rollouts: Rollouts
    # reward_fn's dict for each of the G responses (graded by the worker).
    reward_results: list[dict[str, float]]
    # Seconds the worker waited (queue full, or pacing) before this group's
    # batch; counted on the batch's first group only.
    worker_wait_seconds: float = 0.0


def staleness(trainer_version: int, group: TaggedGroup) -> int:
    """Optimizer steps between the weights that sampled ``group`` and the
    weights the trainer's gradient is taken at (``trainer_version``)."""
    return trainer_version - group.version


def paced_version(batch_index: int, max_staleness: int) -> int:
    """The oldest policy version a paced worker may sample batch ``batch_index``
    with: n - 1 - max_staleness (batch n is trained on at step n)."""
    return batch_index - 1 - max_staleness


def admit(
    groups: Sequence[TaggedGroup], trainer_version: int, max_staleness: int
) -> tuple[list[TaggedGroup], list[TaggedGroup]]:
    """``groups`` split into those within the bound (kept) and those over it."""
    versions = torch.tensor([g.version for g in groups], dtype=torch.long)  # (N,)
    inside = within_bound(versions, trainer_version, max_staleness).tolist()
    kept = [g for g, keep in zip(groups, inside, strict=True) if keep]
    dropped = [g for g, keep in zip(groups, inside, strict=True) if not keep]
    return kept, dropped


def within_bound(
    group_versions: torch.Tensor, trainer_version: int, max_staleness: int
) -> torch.Tensor:
    """Which groups a trainer at ``trainer_version`` may train on. (N,) -> (N,) bool

    A group sampled by version v is (trainer_version - v) steps old; it is
    kept when that is at most ``max_staleness`` (a group exactly at the bound
    is kept).
    """
    return (trainer_version - group_versions) <= max_staleness


@dataclass
class Admission:
    """What the trainer took from the queue for one step."""

    kept: list[TaggedGroup] = field(default_factory=list)
    dropped: list[TaggedGroup] = field(default_factory=list)
    # Groups in the queue when the step began taking.
    queue_depth: int = 0
    # Seconds the trainer waited for groups.
    trainer_wait_seconds: float = 0.0


def admission_metrics(admission: Admission, trainer_version: int) -> dict[str, float]:
    """``async/`` metrics of one step's admission.

    staleness_mean / _max over the kept groups; dropped_groups_stale: groups
    over the bound (the only reason a group is dropped); queue_depth; the
    seconds the trainer and the worker waited; response lengths (tokens) of
    the kept groups and, when any was dropped, of the dropped ones: dropping
    the slowest groups drops the longest responses (a length bias).
    """
    ages = [float(staleness(trainer_version, g)) for g in admission.kept]
    every = admission.kept + admission.dropped
    metrics = {
        "async/staleness_mean": sum(ages) / len(ages),
        "async/staleness_max": max(ages),
        "async/dropped_groups_stale": float(len(admission.dropped)),
        "async/queue_depth": float(admission.queue_depth),
        "async/trainer_wait_seconds": admission.trainer_wait_seconds,
        "async/worker_wait_seconds": sum(g.worker_wait_seconds for g in every),
        "async/kept_response_length_mean": mean_response_length(admission.kept),
    }
    if admission.dropped:
        metrics["async/dropped_response_length_mean"] = mean_response_length(
            admission.dropped
        )
    return metrics


def mean_response_length(groups: Sequence[TaggedGroup]) -> float:
    """Mean response length in sampled tokens over every response of ``groups``."""
    lengths = [
        len(ids) for g in groups for ids in (g.rollouts.response_token_ids or [])
    ]
    return sum(lengths) / len(lengths) if lengths else 0.0


def gap_by_staleness(
    trainer_log_probs: torch.Tensor,
    sampler_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    row_staleness: torch.Tensor,
) -> dict[str, float]:
    """Mean |log pi_trainer - log pi_sampler| over response tokens, per staleness.

    trainer_log_probs, sampler_log_probs, response_mask: (B·G, T);
    row_staleness: (B·G,) ints. Keys ``async/sampler_gap_staleness_<s>`` for
    each staleness s present; NaN sampler values (unscored tokens) left out.
    """
    mask = response_mask.bool() & ~torch.isnan(sampler_log_probs)  # (B·G, T)
    gap = (trainer_log_probs.double() - sampler_log_probs.double()).abs()  # (B·G, T)
    metrics = {}
    for age in sorted(set(row_staleness.tolist())):
        rows = mask & (row_staleness == age)[:, None]  # (B·G, T)
        if rows.any():
            metrics[f"async/sampler_gap_staleness_{age}"] = gap[rows].mean().item()
    return metrics
