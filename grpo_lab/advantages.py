"""Rewards for a rollout batch and group-normalized advantages.

Taught in ``notebooks/03_rewards_and_advantages.ipynb``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Literal

import torch

BASELINES = ("mean", "none")
ADVANTAGE_NORMALIZERS = ("std", "none", "mean")
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
    if len(rollout_responses) != len(repeated_ground_truths):
        raise ValueError(
            "rollout_responses and repeated_ground_truths must have the same length, "
            f"got {len(rollout_responses)} and {len(repeated_ground_truths)}"
        )
    results = [
        reward_fn(response, truth)
        for response, truth in zip(rollout_responses, repeated_ground_truths)
    ]
    for result in results:
        _check_reward_result(result)
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


def _check_reward_result(result: object) -> None:
    if not isinstance(result, Mapping) or any(key not in result for key in REWARD_KEYS):
        received = (
            sorted(result) if isinstance(result, Mapping) else type(result).__name__
        )
        raise ValueError(
            f"reward_fn must return a dict with keys {REWARD_KEYS}, got {received}"
        )


def compute_group_normalized_rewards(
    raw_rewards: torch.Tensor,
    group_size: int,
    baseline: Literal["mean", "none"] = "mean",
    advantage_eps: float = 1e-6,
    advantage_normalizer: Literal["std", "none", "mean"] = "std",
) -> tuple[torch.Tensor, dict[str, float]]:
    """A_i = (r_i - baseline_g) / (normalizer_g + advantage_eps) within each group g.

    Rewards are grouped as consecutive runs of ``group_size`` (the G responses to
    one prompt). baseline "mean" subtracts the group mean; "none" keeps the raw
    reward (RFT). advantage_normalizer "std" divides by the sample standard
    deviation, sqrt(sum (r - mean)^2 / (G - 1)) (GRPO; NaN when G = 1); "none"
    does not divide (Dr. GRPO); "mean" divides by the group mean reward (MaxRL
    upweights prompts the policy rarely solves). (B,) -> (B,), plus the mean and
    sample std of all advantages.
    """
    _check_group_inputs(raw_rewards, group_size, baseline, advantage_normalizer)
    grouped = raw_rewards.reshape(-1, group_size)  # (n_groups, G)
    group_mean = grouped.mean(dim=1, keepdim=True)  # (n_groups, 1)
    advantages = grouped - group_mean if baseline == "mean" else grouped  # (n, G)
    if advantage_normalizer == "std":
        group_std = grouped.std(dim=1, keepdim=True)  # (n_groups, 1), sample std
        advantages = advantages / (group_std + advantage_eps)
    elif advantage_normalizer == "mean":
        advantages = advantages / (group_mean + advantage_eps)
    advantages = advantages.flatten()  # (B,)
    # The sample std of one advantage is undefined: NaN, without torch's warning.
    advantage_std = advantages.std().item() if advantages.numel() > 1 else math.nan
    metadata = {
        "advantage_mean": advantages.mean().item(),
        "advantage_std": advantage_std,
    }
    return advantages, metadata


def _check_group_inputs(
    raw_rewards: torch.Tensor,
    group_size: int,
    baseline: str,
    advantage_normalizer: str,
) -> None:
    if raw_rewards.ndim != 1:
        raise ValueError(
            f"raw_rewards must be one-dimensional, got shape {tuple(raw_rewards.shape)}"
        )
    if group_size <= 0:
        raise ValueError(f"group_size must be positive, got {group_size}")
    if raw_rewards.numel() % group_size != 0:
        raise ValueError(
            f"the number of rewards ({raw_rewards.numel()}) must be divisible by "
            f"group_size ({group_size})"
        )
    check_advantage_settings(baseline, advantage_normalizer)


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
