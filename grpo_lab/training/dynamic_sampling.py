"""DAPO's dynamic sampling: train only on groups whose rewards differ.

A group whose G rewards are all equal has advantage 0 for every response
(with a group baseline), so it adds nothing to the policy gradient while it
still counts in the loss divisor and costs a forward pass. Dynamic sampling
(DAPO, arXiv:2503.14476, section 3.2) drops such groups and samples more
prompts until the rollout batch is full of groups with signal:

    round r = 0, 1, ...: sample B prompts x G responses (fresh prompt and
    sampler seeds each round), grade each response once, keep the groups with
    0 < spread; stop once B groups are kept or ``max_rounds`` rounds are spent.

When the bound is hit (``gave_up``), the step still trains on a full batch:
the groups with signal first, then no-signal groups in the order they were
drawn. Those have advantage 0, so they add no gradient and only keep the batch
at ``rollout_batch_size`` -- every train-batch and gradient-accumulation
invariant holds, exactly as in a run without dynamic sampling. A warning naming
``dynamic_sampling_max_rounds`` is shown once (Python's default filter shows one
warning per place it is raised).

Rewards are computed once per response: the collected rollouts carry their
reward dicts (:class:`GradedRollouts`), and the update reads those.
Used by the training loop (``notebooks/08_training_loop.ipynb``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from grpo_lab.rollouts.base import Rollouts

GROUP_BASELINES = ("mean", "leave_one_out")


class DynamicSamplingWarning(UserWarning):
    """The round bound was reached before the batch filled with groups with signal."""


@dataclass
class GradedRollouts(Rollouts):
    """Rollouts whose responses were already graded, with how they were collected."""

    # reward_fn's dict for each response, in the order of ``responses``.
    reward_results: list[dict[str, float]] = field(default_factory=list)
    # rollout/dynamic_sampling_rounds, rollout/kept_group_fraction, ... of the step.
    sampling_metrics: dict[str, float] = field(default_factory=dict)


def groups_with_signal(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Indices of the groups whose rewards are not all equal. (K,) int64

    ``rewards`` (B·G,) is prompt-major. NaN rewards are left out of the
    comparison (as ``nan_rewards='ignore'`` leaves them out of the group's
    statistics): a group needs two finite rewards that differ.
    """
    if not isinstance(rewards, torch.Tensor):
        raise ValueError(
            f"rewards must be a (B*G,) tensor, got {type(rewards).__name__}"
        )
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if rewards.ndim != 1 or group_size < 1 or rewards.shape[0] % group_size:
        raise ValueError(
            f"rewards must be a (B*G,) tensor with G = group_size ({group_size}) "
            f"dividing its length, got shape {tuple(rewards.shape)}"
        )
    grouped = rewards.reshape(-1, group_size).double()  # (B, G)
    finite = torch.isfinite(grouped)  # (B, G)
    high = torch.where(finite, grouped, -torch.inf).amax(dim=1)  # (B,)
    low = torch.where(finite, grouped, torch.inf).amin(dim=1)  # (B,)
    return torch.nonzero(high > low, as_tuple=False).flatten()  # (K,)


def collect_groups_with_signal(
    sample: Callable[[int], tuple[Rollouts, list[Any]]],
    grade: Callable[[Rollouts, list[Any]], list[dict[str, float]]],
    group_size: int,
    max_rounds: int,
) -> tuple[GradedRollouts, list[Any]]:
    """Sample rounds until B groups with signal are kept (B: the first round's).

    ``sample(round)`` returns B prompts' examples and their B·G rollouts (round
    0 is what a run without dynamic sampling would train on); ``grade`` returns
    one reward dict per response. Returns the B kept groups (padded as the
    module says when ``max_rounds`` is reached) and their examples.
    """
    check_dynamic_sampling_settings(
        True, max_rounds, caller="collect_groups_with_signal"
    )
    if (
        isinstance(group_size, bool)
        or not isinstance(group_size, int)
        or group_size < 1
    ):
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    kept: list[tuple[Rollouts, list[dict[str, float]], Any, int]] = []
    dropped: list[tuple[Rollouts, list[dict[str, float]], Any, int]] = []
    wanted, rounds, sampled = None, 0, 0
    while rounds < max_rounds and (wanted is None or len(kept) < wanted):
        rollouts, examples = sample(rounds)
        results = grade(rollouts, examples)
        _check_round(examples, results, group_size)
        wanted = len(examples) if wanted is None else wanted
        rewards = torch.tensor([r["reward"] for r in results], dtype=torch.float64)
        signal = set(groups_with_signal(rewards, group_size).tolist())
        for index, example in enumerate(examples):
            entry = (rollouts, results, example, index)
            (kept if index in signal else dropped).append(entry)
        rounds, sampled = rounds + 1, sampled + len(examples)
    gave_up = len(kept) < wanted
    if gave_up:
        _warn_gave_up(max_rounds)
    chosen = (kept + dropped)[:wanted]
    graded, examples = assemble_groups(chosen, group_size)
    graded.sampling_metrics = {
        "rollout/dynamic_sampling_rounds": float(rounds),
        "rollout/kept_group_fraction": len(kept) / sampled,
        "rollout/dynamic_sampling_gave_up": float(gave_up),
    }
    return graded, examples


def _check_round(examples: list[Any], results: object, group_size: int) -> None:
    """A round of at least one example and one reward dict per response."""
    if not examples:
        raise ValueError("sample must return at least one example, got 0")
    wanted = len(examples) * group_size
    if not isinstance(results, list) or len(results) != wanted:
        count = len(results) if isinstance(results, list) else type(results).__name__
        raise ValueError(
            f"grade must return one reward dict per response ({wanted}), got {count}"
        )
    for index, result in enumerate(results):
        reward = result.get("reward") if isinstance(result, dict) else None
        if isinstance(reward, bool) or not isinstance(reward, int | float):
            raise ValueError(
                f"grade must return dicts with a numeric 'reward', got {result!r} "
                f"for response {index}"
            )


def assemble_groups(
    chosen: Sequence[tuple[Rollouts, list[dict[str, float]], Any, int]],
    group_size: int,
) -> tuple[GradedRollouts, list[Any]]:
    """One prompt-major GradedRollouts from whole groups of several rounds."""
    columns: dict[str, list | None] = {
        "prompts": [],
        "responses": [],
        "prompt_token_ids": [],
        "response_token_ids": [],
        "sampler_log_probs": [],
    }
    results: list[dict[str, float]] = []
    for rollouts, round_results, _example, index in chosen:
        rows = slice(index * group_size, (index + 1) * group_size)
        for name in columns:
            values = getattr(rollouts, name)
            if values is None or columns[name] is None:
                columns[name] = None
            else:
                columns[name] += values[rows]
        results += round_results[rows]
    graded = GradedRollouts(**columns, reward_results=results)
    return graded, [example for _r, _g, example, _i in chosen]


def _warn_gave_up(max_rounds: int) -> None:
    warnings.warn(
        f"dynamic_sampling_max_rounds ({max_rounds}) was reached before the "
        "rollout batch filled with groups whose rewards differ; such steps train "
        "on the groups with signal found so far, topped up with equal-reward "
        "groups (advantage 0), and log rollout/dynamic_sampling_gave_up = 1; "
        "raise it, or make the task's rewards vary within a group",
        DynamicSamplingWarning,
        stacklevel=1,
    )


def replay_reward_fn(
    results: Sequence[dict[str, float]], responses: Sequence[str]
) -> Callable[[str, str], dict[str, float]]:
    """A reward_fn that hands back ``results`` in order, without grading again.

    For :func:`grpo_lab.train_step.rollout_advantages`, which calls reward_fn
    once per response in order; a call for another response raises. ``results``
    and ``responses`` must have one entry each per graded response.
    """
    if len(results) != len(responses):
        raise ValueError(
            f"responses must have one entry per result ({len(results)}), "
            f"got {len(responses)}"
        )
    position = iter(range(len(results)))

    def replay(response: str, ground_truth: str) -> dict[str, float]:
        index = next(position, None)
        if index is None:
            raise ValueError(
                f"response must be one of the {len(results)} graded ones, got one "
                f"more call: {response!r}"
            )
        if responses[index] != response:
            raise ValueError(
                f"response {index} must be the graded one {responses[index]!r}, "
                f"got {response!r}"
            )
        return results[index]

    return replay


# --- settings ----------------------------------------------------------------------


def check_dynamic_sampling_settings(
    dynamic_sampling: object,
    max_rounds: object,
    baseline: str = "mean",
    *,
    caller: str | None = None,
) -> None:
    """The one check of the dynamic-sampling settings (``caller``: a function
    whose argument is named max_rounds, named beside the setting)."""
    if not isinstance(dynamic_sampling, bool):
        raise ValueError(
            f"dynamic_sampling must be True or False, got {dynamic_sampling!r}"
        )
    if (
        not isinstance(max_rounds, int)
        or isinstance(max_rounds, bool)
        or (max_rounds < 1)
    ):
        raise ValueError(
            "dynamic_sampling_max_rounds must be a positive int (sampling rounds "
            f"per step, the first included), got {max_rounds!r}"
            + (f" ({caller}'s max_rounds)" if caller else "")
        )
    if dynamic_sampling and baseline not in GROUP_BASELINES:
        raise ValueError(
            f"dynamic_sampling needs a group baseline {GROUP_BASELINES}: with "
            f"baseline {baseline!r} a group of equal rewards still has a non-zero "
            "advantage, so dropping it drops signal; got dynamic_sampling True"
        )
