"""The doctor's rules for an asynchronous run: staleness, dropped groups, and a
sampler correction that truncates most tokens.

They read grpo_lab's ``async/`` metrics (:mod:`grpo_lab.training.staleness`)
and the staleness metrics of TRL's async trainer and verl's replay buffer,
mapped onto the same names (:data:`~grpo_lab.training.doctor.reading.TRL_KEYS`,
:data:`~grpo_lab.training.doctor.reading.VERL_KEYS`). A synchronous run logs
none of them and each rule says so.
"""

from __future__ import annotations

from grpo_lab.training.doctor.findings import (
    PERSISTENT_SHARE,
    Finding,
    Run,
    config_number,
    evidence,
    persistent,
    series,
)

# "Many" dropped groups: a fifth of all the groups sampled.
DROPPED_SHARE = 0.2
# Dropped responses this much longer than the kept ones, on most steps that drop.
LENGTH_BIAS_RATIO = 1.2
LENGTH_BIAS_MIN_STEPS = 3
# A correction that truncates or masks more than half the response tokens.
CORRECTED_SHARE = 0.5


def rule_staleness_at_bound(run: Run) -> Finding | str | None:
    """The consumed groups are as old as the bound allows on most steps: the
    worker runs ahead as far as it may, and the trainer is the bottleneck."""
    points = series(run, "async/staleness_max")
    if not points:
        return "no async/staleness_max logged (a synchronous run)"
    bound = config_number(run, "max_staleness")
    if bound is None:
        return "the run's config gives no max_staleness to compare with"
    at_bound = persistent(points, above=bound)
    if not at_bound or bound == 0:
        return None
    return Finding(
        "staleness-at-bound",
        "warning",
        "async/staleness_max",
        evidence(at_bound),
        f"groups {bound:g} steps old (the bound) were trained on in "
        f"{len(at_bound)} of {len(points)} steps",
        "the rollout worker fills the queue faster than the trainer empties it, "
        "so every group waits until it is as stale as allowed: each step's "
        "gradient is as off-policy as the bound lets it be",
        "set sampler_correction (token_truncate) to reweight stale tokens, "
        "shrink async_queue_size, or lower max_staleness",
    )


def rule_many_dropped_groups(run: Run) -> Finding | str | None:
    """More than a fifth of the sampled groups were dropped as too stale."""
    points = series(run, "async/dropped_groups_stale")
    if not points:
        return "no async/dropped_groups_stale logged (a synchronous run)"
    kept = _groups_per_step(run)
    if kept is None:
        return "the run's config gives no groups per step to compare with"
    dropped = sum(value for _, value in points)
    share = dropped / (dropped + kept * len(points))
    if share <= DROPPED_SHARE:
        return None
    return Finding(
        "many-dropped-groups",
        "warning",
        "async/dropped_groups_stale",
        evidence([(s, v) for s, v in points if v > 0]),
        f"{share:.0%} of the sampled groups ({dropped:g}) were dropped as older "
        "than the bound",
        "the worker samples far ahead of the trainer (a long queue, or weights "
        "synced rarely), so its groups age past max_staleness before their turn",
        "set async_admission pace (the worker waits instead of sampling groups "
        "that will be dropped), shrink async_queue_size or sync weights more often",
    )


def rule_dropped_groups_long(run: Run) -> Finding | str | None:
    """The dropped groups' responses are longer than the kept ones' on most
    steps that drop: dropping by age biases training towards short responses."""
    dropped = dict(series(run, "async/dropped_response_length_mean"))
    kept = dict(series(run, "async/kept_response_length_mean"))
    both = sorted(set(dropped) & set(kept))
    if not both:
        return "no step logged the lengths of both dropped and kept groups"
    ratios = [(s, dropped[s] / kept[s]) for s in both if kept[s] > 0]
    long = [(s, r) for s, r in ratios if r >= LENGTH_BIAS_RATIO]
    if len(long) < max(LENGTH_BIAS_MIN_STEPS, PERSISTENT_SHARE * len(ratios)):
        return None
    return Finding(
        "dropped-groups-long",
        "warning",
        "async/dropped_response_length_mean / async/kept_response_length_mean",
        evidence(long),
        f"the dropped groups' responses were at least {LENGTH_BIAS_RATIO:g}x "
        f"as long as the kept ones' in {len(long)} of {len(ratios)} steps that "
        "dropped",
        "long responses take longest to sample, so they are the ones that age "
        "past the bound: dropping them trains on a sample biased towards short "
        "responses",
        "set async_admission pace: the worker waits for fresh weights instead, "
        "and no group is dropped",
    )


def rule_correction_mostly_clipped(run: Run) -> Finding | str | None:
    """The sampler correction truncated or masked most response tokens."""
    points = series(run, "rollout/is_token_corrected_fraction")
    if not points:
        return "no rollout/is_token_corrected_fraction logged (no sampler_correction)"
    high = persistent(points, above=CORRECTED_SHARE)
    if not high:
        return None
    return Finding(
        "correction-mostly-clipped",
        "warning",
        "rollout/is_token_corrected_fraction",
        evidence(high),
        f"the sampler correction truncated or masked more than "
        f"{CORRECTED_SHARE:.0%} of the response tokens in {len(high)} of "
        f"{len(points)} steps",
        "the sampler's distribution is far from the trainer's (stale weights, "
        "or a mismatched engine): most tokens' ratios leave the trusted range, "
        "so the update mostly follows the cap, not the samples",
        "lower max_staleness or sync weights more often; raise the cap "
        "(sampler_correction_cap / _high) only if the ratios are trustworthy",
    )


def _groups_per_step(run: Run) -> float | None:
    """Groups trained on per step: rollout_batch_size / group_size."""
    batch = config_number(run, "rollout_batch_size")
    group = config_number(run, "group_size")
    return batch / group if batch and group else None
