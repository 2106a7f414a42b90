"""Rewards for a rollout batch and group-normalized advantages.

:func:`rollout_advantages` is the one call from responses to advantages (the
train step's and the loop's).

Taught in ``notebooks/03_rewards_and_advantages.ipynb``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import torch

BASELINES = ("mean", "none", "leave_one_out")
ADVANTAGE_NORMALIZERS = ("std", "none", "mean", "batch_std")
NAN_REWARD_POLICIES = ("propagate", "ignore")
REWARD_KEYS = ("reward", "format_reward", "answer_reward")


def compute_rollout_rewards(
    reward_fn: Callable[[str, str], dict[str, float]],
    rollout_responses: list[str],
    repeated_ground_truths: list[str],
) -> tuple[torch.Tensor, dict[str, float]]:
    """Score each response once: rewards[i] = reward_fn(response_i, truth_i)["reward"].

    Returns the (B,) float32 rewards and the batch means of "reward",
    "format_reward" and "answer_reward".
    """
    _check_rollout_texts(reward_fn, rollout_responses, repeated_ground_truths)
    results = [
        reward_fn(response, truth)
        for response, truth in zip(rollout_responses, repeated_ground_truths)
    ]
    for index, result in enumerate(results):
        _check_reward_result(result, index)
    columns = {
        key: torch.tensor([r[key] for r in results], dtype=torch.float32)  # (B,)
        for key in REWARD_KEYS
    }
    metadata = {
        "reward_mean": columns["reward"].mean().item(),
        "format_reward_mean": columns["format_reward"].mean().item(),
        "answer_reward_mean": columns["answer_reward"].mean().item(),
    }
    return columns["reward"], metadata


def _check_rollout_texts(reward_fn: object, responses: object, truths: object) -> None:
    if not callable(reward_fn):
        raise ValueError(f"reward_fn must be callable, got {reward_fn!r}")
    for name, texts in (
        ("rollout_responses", responses),
        ("repeated_ground_truths", truths),
    ):
        if isinstance(texts, str) or not isinstance(texts, Sequence):
            raise ValueError(
                f"{name} must be a list of strings, got {type(texts).__name__}"
            )
    if len(responses) != len(truths):
        raise ValueError(
            "rollout_responses and repeated_ground_truths must have the same length, "
            f"got {len(responses)} and {len(truths)}"
        )
    if not responses:
        raise ValueError("rollout_responses must hold at least one response, got 0")


def _check_reward_result(result: object, index: int) -> None:
    """A dict of the reward keys, each a number (NaN allowed: an unscorable
    response, see ``nan_rewards`` in :func:`compute_group_normalized_rewards`)."""
    if not isinstance(result, Mapping) or any(key not in result for key in REWARD_KEYS):
        received = (
            sorted(result) if isinstance(result, Mapping) else type(result).__name__
        )
        raise ValueError(
            f"reward_fn must return a dict with keys {REWARD_KEYS}, got {received}"
        )
    for key in REWARD_KEYS:
        value = result[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(
                f"reward_fn must return numbers, got {key}={value!r} for response "
                f"{index}"
            )


def compute_group_normalized_rewards(
    raw_rewards: torch.Tensor,
    group_size: int,
    baseline: Literal["mean", "none", "leave_one_out"] = "mean",
    advantage_eps: float = 1e-6,
    advantage_normalizer: Literal["std", "none", "mean", "batch_std"] = "std",
    *,
    nan_rewards: Literal["propagate", "ignore"] = "propagate",
) -> tuple[torch.Tensor, dict[str, float]]:
    """A_i = (r_i - baseline_i) / (normalizer_g + advantage_eps) within each group g.

    Rewards are grouped as consecutive runs of ``group_size`` (the G responses to
    one prompt). baseline:

    - "mean": the group mean (GRPO);
    - "none": keep the raw reward (RFT);
    - "leave_one_out": the mean of the *other* G - 1 rewards of the group
      (RLOO), r_i - baseline_i = G / (G - 1) * (r_i - mean).

    advantage_normalizer:

    - "std": the group's sample standard deviation,
      sqrt(sum (r - mean)^2 / (G - 1)) (GRPO);
    - "none": no division (Dr. GRPO);
    - "mean": the group mean reward (MaxRL upweights prompts the policy rarely
      solves);
    - "batch_std": the sample standard deviation of every reward of the call
      (the baseline stays per group; TRL's ``scale_rewards="batch"``).

    ``nan_rewards="ignore"`` leaves NaN rewards (an unscorable response) out of
    their group's mean and std and out of the batch std, and gives them
    advantage 0; a group left with too few rewards for its baseline or
    normalizer (none for a mean, one for a std or a leave-one-out mean) gives
    every response 0 too, as TRL does with None rewards. "propagate" (the
    default) lets a NaN spread to its group.

    A statistic that needs two rewards refuses one: ``group_size`` 1 with "std"
    or "leave_one_out", and a single reward with "batch_std", raise
    ``ValueError`` instead of returning NaN. (B,) -> (B,), plus the mean and
    sample std of all advantages.
    """
    _check_group_inputs(
        raw_rewards, group_size, baseline, advantage_normalizer, advantage_eps
    )
    if not raw_rewards.is_floating_point():
        raw_rewards = raw_rewards.float()  # int or bool rewards: counts of 0/1
    _check_enough_rewards(raw_rewards, group_size, baseline, advantage_normalizer)
    check_nan_rewards(nan_rewards)
    grouped = raw_rewards.reshape(-1, group_size)  # (n_groups, G)
    if nan_rewards == "ignore" and torch.isnan(grouped).any():
        advantages = _advantages_ignoring_nan(
            grouped, baseline, advantage_eps, advantage_normalizer
        )  # (n_groups, G)
    else:
        advantages = _group_advantages(
            grouped, baseline, advantage_eps, advantage_normalizer
        )  # (n_groups, G)
    advantages = advantages.flatten()  # (B,)
    # The sample std of one advantage is undefined: NaN, without torch's warning.
    advantage_std = advantages.std().item() if advantages.numel() > 1 else math.nan
    metadata = {
        "advantage_mean": advantages.mean().item(),
        "advantage_std": advantage_std,
    }
    return advantages, metadata


def _group_advantages(
    grouped: torch.Tensor, baseline: str, advantage_eps: float, normalizer: str
) -> torch.Tensor:
    """(r - baseline) / (normalizer + eps) for (n_groups, G) rewards."""
    group_mean = grouped.mean(dim=1, keepdim=True)  # (n_groups, 1)
    if baseline == "mean":
        advantages = grouped - group_mean  # (n, G)
    elif baseline == "leave_one_out":
        group_size = grouped.shape[1]
        others_mean = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
        advantages = grouped - others_mean  # (n, G)
    else:
        advantages = grouped
    if normalizer == "std":
        group_std = grouped.std(dim=1, keepdim=True)  # (n_groups, 1), sample std
        advantages = advantages / (group_std + advantage_eps)
    elif normalizer == "mean":
        advantages = advantages / (group_mean + advantage_eps)
    elif normalizer == "batch_std":
        advantages = advantages / (grouped.std() + advantage_eps)
    return advantages


def _advantages_ignoring_nan(
    grouped: torch.Tensor, baseline: str, advantage_eps: float, normalizer: str
) -> torch.Tensor:
    """:func:`_group_advantages` over the non-NaN rewards only; NaN rows get 0.

    Statistics use the valid count n_g of each group: mean = sum / n_g, sample
    std with n_g - 1, leave-one-out mean (sum - r_i) / (n_g - 1). Wherever one
    is undefined (too few rewards) the advantage is 0.
    """
    valid = ~torch.isnan(grouped)  # (n_groups, G)
    rewards = grouped.masked_fill(~valid, 0.0)  # (n, G)
    counts = valid.sum(dim=1, keepdim=True).to(grouped.dtype)  # (n, 1)
    sums = rewards.sum(dim=1, keepdim=True)  # (n, 1)
    group_mean = sums / counts  # (n, 1): NaN for an empty group
    if baseline == "mean":
        advantages = grouped - group_mean
    elif baseline == "leave_one_out":
        advantages = grouped - (sums - rewards) / (counts - 1)
    else:
        advantages = grouped
    if normalizer == "std":
        advantages = advantages / (_nan_std(grouped, dim=1) + advantage_eps)
    elif normalizer == "mean":
        advantages = advantages / (group_mean + advantage_eps)
    elif normalizer == "batch_std":
        advantages = advantages / (_nan_std(grouped.flatten(), dim=0) + advantage_eps)
    defined = valid & torch.isfinite(advantages)
    return torch.where(defined, advantages, torch.zeros_like(advantages))


def _nan_std(values: torch.Tensor, dim: int) -> torch.Tensor:
    """Sample std over ``dim`` of the non-NaN values (NaN when fewer than 2)."""
    valid = ~torch.isnan(values)
    count = valid.sum(dim=dim, keepdim=True).to(values.dtype)
    mean = values.masked_fill(~valid, 0.0).sum(dim=dim, keepdim=True) / count
    squares = (values - mean).pow(2).masked_fill(~valid, 0.0)
    variance = squares.sum(dim=dim, keepdim=True) / (count - 1)
    return torch.where(count > 1, variance.sqrt(), torch.full_like(mean, math.nan))


def _check_group_inputs(
    raw_rewards: torch.Tensor,
    group_size: int,
    baseline: str,
    advantage_normalizer: str,
    advantage_eps: float,
) -> None:
    if not isinstance(raw_rewards, torch.Tensor):
        raise ValueError(
            f"raw_rewards must be a (B,) tensor, got {type(raw_rewards).__name__}"
        )
    if raw_rewards.ndim != 1:
        raise ValueError(
            f"raw_rewards must be one-dimensional, got shape {tuple(raw_rewards.shape)}"
        )
    if raw_rewards.numel() == 0:
        raise ValueError("raw_rewards must hold at least one reward, got 0")
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if group_size <= 0:
        raise ValueError(f"group_size must be positive, got {group_size}")
    if raw_rewards.numel() % group_size != 0:
        raise ValueError(
            f"group_size must divide the number of rewards ({raw_rewards.numel()}), "
            f"got {group_size}"
        )
    check_advantage_settings(baseline, advantage_normalizer, advantage_eps)


def _check_enough_rewards(
    raw_rewards: torch.Tensor, group_size: int, baseline: str, normalizer: str
) -> None:
    """Refuse a statistic of one reward (it would be NaN, silently)."""
    if group_size == 1 and normalizer == "std":
        raise ValueError(
            "group_size must be at least 2 with advantage_normalizer 'std': the "
            "sample std of one reward is undefined; got 1 (use 'batch_std' or "
            "'none')"
        )
    if group_size == 1 and baseline == "leave_one_out":
        raise ValueError(
            "group_size must be at least 2 with baseline 'leave_one_out': a "
            "group of one has no other rewards to average; got 1"
        )
    if normalizer == "batch_std" and raw_rewards.numel() < 2:
        raise ValueError(
            "raw_rewards must hold at least 2 rewards with advantage_normalizer "
            f"'batch_std' (a sample std), got {raw_rewards.numel()}"
        )


def check_nan_rewards(nan_rewards: str) -> None:
    """The one check of the NaN-reward policy."""
    if nan_rewards not in NAN_REWARD_POLICIES:
        raise ValueError(
            f"nan_rewards must be one of {NAN_REWARD_POLICIES}, got {nan_rewards!r}"
        )


def check_advantage_settings(
    baseline: str, advantage_normalizer: str, advantage_eps: float = 0.0
) -> None:
    """The one check of the advantage settings (config and direct callers)."""
    if baseline not in BASELINES:
        raise ValueError(f"baseline must be one of {BASELINES}, got {baseline!r}")
    if advantage_normalizer not in ADVANTAGE_NORMALIZERS:
        raise ValueError(
            f"advantage_normalizer must be one of {ADVANTAGE_NORMALIZERS}, "
            f"got {advantage_normalizer!r}"
        )
    if not (
        isinstance(advantage_eps, (int, float))
        and not isinstance(advantage_eps, bool)
        and math.isfinite(advantage_eps)
        and advantage_eps >= 0
    ):
        raise ValueError(
            f"advantage_eps must be a finite number >= 0, got {advantage_eps!r}"
        )


def rollout_advantages(
    reward_fn: Callable[[str, str], dict[str, float]],
    rollout_responses: list[str],
    repeated_ground_truths: list[str],
    group_size: int,
    *,
    baseline: str = "mean",
    advantage_eps: float = 1e-6,
    advantage_normalizer: str = "std",
    nan_rewards: str = "propagate",
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Raw rewards (B,), group-normalized advantages (B,) and their statistics.

    Each response is scored once (:func:`compute_rollout_rewards`), then
    normalized within its group of ``group_size``
    (:func:`compute_group_normalized_rewards`). The one place both the step and
    the training loop turn responses into advantages.
    """
    raw_rewards, reward_metadata = compute_rollout_rewards(
        reward_fn, rollout_responses, repeated_ground_truths
    )  # (B,)
    advantages, advantage_metadata = compute_group_normalized_rewards(
        raw_rewards,
        group_size,
        baseline,
        advantage_eps,
        advantage_normalizer,
        nan_rewards=nan_rewards,
    )  # (B,)
    return raw_rewards, advantages, {**reward_metadata, **advantage_metadata}


def check_rollout_lists(
    repeated_prompts: list[str],
    rollout_responses: list[str],
    repeated_ground_truths: list[str],
    group_size: int,
) -> None:
    """Prompts, responses and truths: lists of one length B > 0, which
    ``group_size`` divides."""
    # Responses and truths are checked where they are scored
    # (compute_rollout_rewards); the prompts only reach the tokenizer.
    if isinstance(repeated_prompts, str) or not isinstance(
        repeated_prompts, (list, tuple)
    ):
        raise ValueError(
            "repeated_prompts must be a list of strings, "
            f"got {type(repeated_prompts).__name__}"
        )
    batch_size = len(rollout_responses)
    if batch_size == 0:
        raise ValueError("rollout_responses must hold at least one response, got 0")
    if len(repeated_prompts) != batch_size or len(repeated_ground_truths) != batch_size:
        raise ValueError(
            "repeated_prompts, rollout_responses and repeated_ground_truths must have "
            f"the same length, got {len(repeated_prompts)}, {batch_size} and "
            f"{len(repeated_ground_truths)}"
        )
    if group_size <= 0 or batch_size % group_size != 0:
        raise ValueError(
            f"group_size must be positive and divide the batch size {batch_size}, "
            f"got {group_size}"
        )
