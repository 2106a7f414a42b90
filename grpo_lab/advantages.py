"""Rewards for a rollout batch and group-normalized advantages.

:func:`rollout_advantages` is the one call from responses to advantages (the
train step's and the loop's).

Taught in ``notebooks/03_rewards_and_advantages.ipynb``; REINFORCE++'s whitening
over tokens, the aggregations of a reward's parts (GDPO) and the optimal token
baseline in ``notebooks/10_the_grpo_family.ipynb``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import torch

BASELINES = ("mean", "none", "leave_one_out")
ADVANTAGE_NORMALIZERS = ("std", "none", "mean", "batch_std", "token_whiten")
# The normalizers that need each response's token count (``response_lengths``).
TOKEN_NORMALIZERS = ("token_whiten",)
NAN_REWARD_POLICIES = ("propagate", "ignore")
REWARD_KEYS = ("reward", "format_reward", "answer_reward")
# The parts of a reward that a multi-reward aggregation combines.
REWARD_COMPONENTS = ("format_reward", "answer_reward")
# "reward": the reward function's own total. The others combine REWARD_COMPONENTS:
# sum them, then normalize (TRL's sum_then_normalize); normalize each within its
# group, sum, then whiten over the batch's responses (GDPO as TRL computes it) or
# over its tokens (GDPO as verl computes it).
REWARD_AGGREGATIONS = (
    "reward",
    "sum_then_normalize",
    "normalize_then_sum",
    "normalize_then_sum_tokens",
)
# verl's masked_whiten adds 1e-8 to the variance (and to the token count).
WHITEN_EPS = 1e-8


def compute_rollout_rewards(
    reward_fn: Callable[[str, str], dict[str, float]],
    rollout_responses: list[str],
    repeated_ground_truths: list[str],
) -> tuple[torch.Tensor, dict[str, float]]:
    """Score each response once: rewards[i] = reward_fn(response_i, truth_i)["reward"].

    Returns the (B,) float32 rewards and the batch means of "reward",
    "format_reward" and "answer_reward".
    """
    columns = reward_columns(reward_fn, rollout_responses, repeated_ground_truths)
    metadata = {
        "reward_mean": columns["reward"].mean().item(),
        "format_reward_mean": columns["format_reward"].mean().item(),
        "answer_reward_mean": columns["answer_reward"].mean().item(),
    }
    return columns["reward"], metadata


def reward_columns(
    reward_fn: Callable[[str, str], dict[str, float]],
    rollout_responses: list[str],
    repeated_ground_truths: list[str],
) -> dict[str, torch.Tensor]:
    """Each of REWARD_KEYS as a (B,) float32 column, every response scored once."""
    _check_rollout_texts(reward_fn, rollout_responses, repeated_ground_truths)
    results = [
        reward_fn(response, truth)
        for response, truth in zip(rollout_responses, repeated_ground_truths)
    ]
    for index, result in enumerate(results):
        _check_reward_result(result, index)
    return {
        key: torch.tensor([r[key] for r in results], dtype=torch.float32)  # (B,)
        for key in REWARD_KEYS
    }


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
    advantage_normalizer: Literal[
        "std", "none", "mean", "batch_std", "token_whiten"
    ] = "std",
    *,
    nan_rewards: Literal["propagate", "ignore"] = "propagate",
    response_lengths: torch.Tensor | None = None,
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
      (the baseline stays per group; TRL's ``scale_rewards="batch"``);
    - "token_whiten": REINFORCE++'s global whitening (arXiv:2501.03262): each
      response's r_i - baseline_i counted once per response token
      (``response_lengths``, (B,)), shifted by the token-weighted mean and
      divided by sqrt(token-weighted sample variance + 1e-8)
      (:func:`whiten_over_tokens`; ``advantage_eps`` is not used). With
      baseline "none" it is verl's ``reinforce_plus_plus`` for outcome rewards
      (gamma 1), with "mean" its ``reinforce_plus_plus_baseline``.

    ``nan_rewards="ignore"`` leaves NaN rewards (an unscorable response) out of
    their group's mean and std and out of the batch std, and gives them
    advantage 0; a group left with too few rewards for its baseline or
    normalizer (none for a mean, one for a std or a leave-one-out mean) gives
    every response 0 too, as TRL does with None rewards. "propagate" (the
    default) lets a NaN spread to its group (to the whole batch with
    "batch_std" or "token_whiten").

    A statistic that needs two rewards refuses one: ``group_size`` 1 with "std"
    or "leave_one_out", and a single reward with "batch_std", raise
    ``ValueError`` instead of returning NaN; so do "token_whiten" over fewer
    than 2 tokens, and ``response_lengths`` given to any other normalizer (it
    would be unused). (B,) -> (B,), plus the mean and sample std of all
    advantages.
    """
    _check_group_inputs(
        raw_rewards, group_size, baseline, advantage_normalizer, advantage_eps
    )
    if not raw_rewards.is_floating_point():
        raw_rewards = raw_rewards.float()  # int or bool rewards: counts of 0/1
    _check_enough_rewards(raw_rewards, group_size, baseline, advantage_normalizer)
    check_nan_rewards(nan_rewards)
    check_response_lengths(response_lengths, raw_rewards, advantage_normalizer)
    grouped = raw_rewards.reshape(-1, group_size)  # (n_groups, G)
    ignoring = nan_rewards == "ignore" and bool(torch.isnan(grouped).any())
    if ignoring:
        advantages = _advantages_ignoring_nan(
            grouped, baseline, advantage_eps, advantage_normalizer
        )  # (n_groups, G)
    else:
        advantages = _group_advantages(
            grouped, baseline, advantage_eps, advantage_normalizer
        )  # (n_groups, G)
    advantages = advantages.flatten()  # (B,)
    if advantage_normalizer in TOKEN_NORMALIZERS:
        scored = ~torch.isnan(raw_rewards) if ignoring else None  # (B,)
        advantages = whiten_over_tokens(advantages, response_lengths, rows=scored)
    return advantages, _advantage_statistics(advantages)


def _advantage_statistics(advantages: torch.Tensor) -> dict[str, float]:
    # The sample std of one advantage is undefined: NaN, without torch's warning.
    advantage_std = advantages.std().item() if advantages.numel() > 1 else math.nan
    return {"advantage_mean": advantages.mean().item(), "advantage_std": advantage_std}


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


def whiten_over_tokens(
    values: torch.Tensor,
    response_lengths: torch.Tensor,
    *,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """(v_i - mean) / sqrt(var + 1e-8), each response counted once per token.

    With n_i = response_lengths[i] and N = sum_i n_i: mean = sum_i n_i v_i /
    (N + 1e-8), var = sum_i n_i (v_i - mean)^2 / (N + 1e-8) * N / (N - 1) (a
    sample variance over tokens). This is verl's ``masked_whiten`` of v_i
    broadcast over each response's tokens (verl/utils/torch_functional.py),
    computed per response instead of per token. ``rows`` (B,) bool keeps
    only those responses in the statistics and gives the others 0.
    (B,) -> (B,).
    """
    weights = response_lengths.to(values.dtype)  # (B,)
    if rows is not None:
        weights = weights * rows
        values = values.masked_fill(~rows, 0.0)
    total = weights.sum()
    if total.item() < 2:
        raise ValueError(
            "response_lengths must count at least 2 scored response tokens to "
            f"whiten over tokens (a sample variance), got {total.item():g}"
        )
    mean = (weights * values).sum() / (total + WHITEN_EPS)
    variance = (weights * (values - mean).pow(2)).sum() / (total + WHITEN_EPS)
    variance = variance * total / (total - 1)  # Bessel's correction over tokens
    whitened = (values - mean) * torch.rsqrt(variance + WHITEN_EPS)  # (B,)
    return whitened if rows is None else whitened.masked_fill(~rows, 0.0)


def check_response_lengths(
    response_lengths: object, raw_rewards: torch.Tensor, advantage_normalizer: str
) -> None:
    """Token counts (B,) of whole numbers >= 0, given exactly when the
    normalizer reads them."""
    needed = advantage_normalizer in TOKEN_NORMALIZERS
    if response_lengths is None:
        if needed:
            raise ValueError(
                f"response_lengths must be given with advantage_normalizer "
                f"{advantage_normalizer!r} (each response's token count, (B,)), "
                "got None"
            )
        return
    if not needed:
        raise ValueError(
            f"response_lengths is read only by advantage_normalizer in "
            f"{TOKEN_NORMALIZERS}, got it with {advantage_normalizer!r}"
        )
    if not isinstance(response_lengths, torch.Tensor):
        raise ValueError(
            "response_lengths must be a (B,) tensor of token counts, got "
            f"{type(response_lengths).__name__}"
        )
    if tuple(response_lengths.shape) != tuple(raw_rewards.shape):
        raise ValueError(
            f"response_lengths must have the rewards' shape {tuple(raw_rewards.shape)},"
            f" got {tuple(response_lengths.shape)}"
        )
    counts = response_lengths.double()
    if not bool(torch.all((counts >= 0) & (counts == counts.round()))):
        raise ValueError(
            "response_lengths must hold whole token counts >= 0, got "
            f"{response_lengths.tolist()}"
        )


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
    baseline: str,
    advantage_normalizer: str,
    advantage_eps: float = 0.0,
    *,
    reward_aggregation: str = "reward",
    nan_rewards: str = "propagate",
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
    _check_reward_aggregation(reward_aggregation, advantage_normalizer, nan_rewards)


def _check_reward_aggregation(
    reward_aggregation: str, advantage_normalizer: str, nan_rewards: str
) -> None:
    if reward_aggregation not in REWARD_AGGREGATIONS:
        raise ValueError(
            f"reward_aggregation must be one of {REWARD_AGGREGATIONS}, "
            f"got {reward_aggregation!r}"
        )
    if not reward_aggregation.startswith("normalize_then_sum"):
        return
    if advantage_normalizer in TOKEN_NORMALIZERS:
        raise ValueError(
            f"advantage_normalizer must be a group normalizer with reward_aggregation "
            f"{reward_aggregation!r} (each component is normalized in its group, "
            f"then the sum is whitened), got {advantage_normalizer!r}"
        )
    if nan_rewards != "propagate":
        raise ValueError(
            f"nan_rewards must be 'propagate' with reward_aggregation "
            f"{reward_aggregation!r} (a NaN component has no defined share of "
            f"the sum), got {nan_rewards!r}"
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
    reward_aggregation: str = "reward",
    response_lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Raw rewards (B,), group-normalized advantages (B,) and their statistics.

    Each response is scored once (:func:`compute_rollout_rewards`), then
    normalized within its group of ``group_size``
    (:func:`compute_group_normalized_rewards`). With ``reward_aggregation``
    other than "reward" the advantages combine the reward's parts
    (REWARD_COMPONENTS, weight 1 each) by
    :func:`compute_multi_reward_advantages`; the raw rewards returned stay the
    reward function's "reward". ``response_lengths`` (B,): each response's
    token count, for the token-weighted normalizations. The one place both the
    step and the training loop turn responses into advantages.
    """
    check_advantage_settings(
        baseline,
        advantage_normalizer,
        advantage_eps,
        reward_aggregation=reward_aggregation,
        nan_rewards=nan_rewards,
    )
    columns = reward_columns(reward_fn, rollout_responses, repeated_ground_truths)
    raw_rewards = columns["reward"]  # (B,)
    reward_metadata = {f"{key}_mean": columns[key].mean().item() for key in REWARD_KEYS}
    if reward_aggregation == "reward":
        advantages, advantage_metadata = compute_group_normalized_rewards(
            raw_rewards,
            group_size,
            baseline,
            advantage_eps,
            advantage_normalizer,
            nan_rewards=nan_rewards,
            response_lengths=response_lengths,
        )  # (B,)
    else:
        components = torch.stack([columns[key] for key in REWARD_COMPONENTS], dim=1)
        advantages, advantage_metadata = compute_multi_reward_advantages(
            components,  # (B, K)
            group_size,
            baseline,
            advantage_eps,
            advantage_normalizer,
            reward_aggregation=reward_aggregation,
            nan_rewards=nan_rewards,
            response_lengths=response_lengths,
        )  # (B,)
    return raw_rewards, advantages, {**reward_metadata, **advantage_metadata}


def compute_multi_reward_advantages(
    reward_components: torch.Tensor,
    group_size: int,
    baseline: str = "mean",
    advantage_eps: float = 1e-6,
    advantage_normalizer: str = "std",
    *,
    reward_aggregation: str = "normalize_then_sum",
    reward_weights: Sequence[float] | None = None,
    nan_rewards: str = "propagate",
    response_lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Advantages (B,) from K reward components (B, K) with weights w (K,).

    reward_aggregation:

    - "sum_then_normalize": A = normalize(sum_k w_k r_k), the usual baseline
      and normalizer on the weighted total (TRL's default
      ``multi_objective_aggregation``);
    - "normalize_then_sum": GDPO (arXiv:2601.05242): each component is
      normalized within its group, A_k = normalize(r_k), then s = sum_k w_k
      A_k is whitened over the batch's responses, (s - mean(s)) / (std(s) +
      advantage_eps) with the sample std (TRL's "normalize_then_sum");
    - "normalize_then_sum_tokens": the same s whitened over the batch's tokens
      (:func:`whiten_over_tokens`, ``response_lengths``), as verl's ``gdpo``
      estimator does.

    Normalizing each component first keeps a component with a large spread
    from drowning out the others' signal. ``normalize`` is
    :func:`compute_group_normalized_rewards` with ``baseline``,
    ``advantage_eps`` and ``advantage_normalizer``; weights default to 1 each.
    Taught in ``notebooks/10_the_grpo_family.ipynb``.
    """
    weights = _check_components(reward_components, reward_weights)  # (K,)
    check_advantage_settings(
        baseline,
        advantage_normalizer,
        advantage_eps,
        reward_aggregation=reward_aggregation,
        nan_rewards=nan_rewards,
    )
    if reward_aggregation == "reward":
        raise ValueError(
            "reward_aggregation must be one of "
            f"{REWARD_AGGREGATIONS[1:]} to combine reward components, got 'reward'"
        )
    components = reward_components.to(weights.dtype)  # (B, K)
    if reward_aggregation == "sum_then_normalize":
        return compute_group_normalized_rewards(
            components @ weights,  # (B,)
            group_size,
            baseline,
            advantage_eps,
            advantage_normalizer,
            nan_rewards=nan_rewards,
            response_lengths=response_lengths,
        )
    summed = torch.zeros_like(components[:, 0])  # (B,)
    for k in range(components.shape[1]):
        normalized, _ = compute_group_normalized_rewards(
            components[:, k], group_size, baseline, advantage_eps, advantage_normalizer
        )  # (B,)
        summed = summed + weights[k] * normalized
    if reward_aggregation == "normalize_then_sum_tokens":
        check_response_lengths(response_lengths, summed, "token_whiten")
        advantages = whiten_over_tokens(summed, response_lengths)  # (B,)
    else:
        if response_lengths is not None:
            raise ValueError(
                "response_lengths is not read by reward_aggregation "
                "'normalize_then_sum' (it whitens over responses), got a tensor"
            )
        if summed.numel() < 2:
            raise ValueError(
                "reward_components must hold at least 2 responses to whiten over "
                f"the batch, got {summed.numel()}"
            )
        advantages = (summed - summed.mean()) / (summed.std() + advantage_eps)
    return advantages, _advantage_statistics(advantages)


def _check_components(
    reward_components: object, reward_weights: Sequence[float] | None
) -> torch.Tensor:
    """The (K,) weights for (B, K) finite-or-NaN components (1 each by default)."""
    if not isinstance(reward_components, torch.Tensor) or reward_components.ndim != 2:
        received = (
            f"shape {tuple(reward_components.shape)}"
            if isinstance(reward_components, torch.Tensor)
            else type(reward_components).__name__
        )
        raise ValueError(f"reward_components must be a (B, K) tensor, got {received}")
    batch, count = reward_components.shape
    if batch == 0 or count == 0:
        raise ValueError(
            "reward_components must hold at least one response and one component, "
            f"got shape {(batch, count)}"
        )
    dtype = (
        reward_components.dtype
        if reward_components.is_floating_point()
        else torch.float32
    )
    if reward_weights is None:
        return torch.ones(count, dtype=dtype)
    weights = list(reward_weights)
    if len(weights) != count or not all(
        isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w)
        for w in weights
    ):
        raise ValueError(
            f"reward_weights must be {count} finite numbers (one per component), "
            f"got {reward_weights!r}"
        )
    return torch.tensor(weights, dtype=dtype)


def sum_of_squared_probabilities(logits: torch.Tensor) -> torch.Tensor:
    """sum_v pi(v)^2 at each position: (B, T, V) logits -> (B, T).

    The optimal token baseline's per-token variance proxy needs it
    (:func:`optimal_token_baseline_advantages`).
    """
    return torch.softmax(logits, dim=-1).pow(2).sum(dim=-1)


def optimal_token_baseline_advantages(
    raw_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_size: int,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    *,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token advantages A_t = G_t - B_t with the optimal token baseline.

    G_t is the return: the response's outcome reward r_i at every token up to
    its last response token (0 after). Each token's variance proxy is w_t = 1 -
    2 pi_t + sum_v pi(v)^2 (pi_t = exp(old_log_probs), the sampled token's
    probability), times rho_t^2 with ``rollout_is_weights``; W_t = sum_{j<=t}
    w_j m_j is its running sum. Within each group of ``group_size`` the
    baseline at position t is B_t = sum_i G_t W_t m_t / (sum_i W_t m_t +
    epsilon): returns weighted by how much variance their path carried. With
    ``handle_zero_tail``, where one response is strictly the longest of its
    group its baseline is 0 past the second-longest length (no other response
    estimates it). A group of one gets baseline 0. verl 0.9.1's
    ``optimal_token_baseline`` (verl/trainer/ppo/core_algos.py) for outcome
    rewards, with groups given as consecutive rows.

    Returns (advantages, returns), both (B, T); advantages are 0 off the mask,
    returns 0 after each response's last token. Taught in
    ``notebooks/10_the_grpo_family.ipynb``.
    """
    _check_token_baseline_inputs(
        raw_rewards, response_mask, group_size, old_log_probs, sum_pi_squared
    )
    mask = response_mask.to(old_log_probs.dtype)  # (B, T)
    positions = torch.arange(mask.shape[1], device=mask.device)  # (T,)
    last = torch.where(mask > 0, positions, -1).amax(dim=1, keepdim=True)  # (B, 1)
    returns = raw_rewards.to(mask.dtype)[:, None] * (positions <= last)  # (B, T)
    per_token = 1 - 2 * old_log_probs.exp() + sum_pi_squared  # (B, T)
    if rollout_is_weights is not None:
        per_token = per_token * rollout_is_weights.pow(2)
    path_variance = (per_token * mask).cumsum(dim=1)  # (B, T): W_t
    baselines = torch.zeros_like(returns)  # (B, T)
    if group_size > 1:
        shape = (-1, group_size, mask.shape[1])  # (n_groups, G, T)
        weighted = (path_variance * mask).reshape(shape)
        numerator = (returns.reshape(shape) * weighted).sum(dim=1, keepdim=True)
        baseline = numerator / (weighted.sum(dim=1, keepdim=True) + epsilon)
        baselines = baseline.expand(shape).reshape(returns.shape).clone()
        if handle_zero_tail:
            _zero_unshared_tails(baselines, mask, group_size)
    return (returns - baselines) * mask, returns


def _zero_unshared_tails(
    baselines: torch.Tensor, mask: torch.Tensor, size: int
) -> None:
    """Baseline 0 past the second-longest length for a strictly longest response."""
    lengths = mask.sum(dim=1).reshape(-1, size)  # (n_groups, G)
    ordered = lengths.sort(dim=1).values
    for group, (second, longest) in enumerate(ordered[:, -2:].tolist()):
        holders = (lengths[group] == longest).nonzero().flatten()
        if longest > second and holders.numel() == 1:
            row = group * size + int(holders[0])
            baselines[row, int(second) :] = 0.0


def _check_token_baseline_inputs(
    raw_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_size: int,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
) -> None:
    _check_group_inputs(raw_rewards, group_size, "mean", "none", 0.0)
    for name, tensor in (
        ("response_mask", response_mask),
        ("old_log_probs", old_log_probs),
        ("sum_pi_squared", sum_pi_squared),
    ):
        if not isinstance(tensor, torch.Tensor) or tensor.ndim != 2:
            raise ValueError(f"{name} must be a (B, T) tensor, got {tensor!r:.80}")
        if (
            tensor.shape[0] != raw_rewards.shape[0]
            or tensor.shape != response_mask.shape
        ):
            raise ValueError(
                f"{name} must have shape ({raw_rewards.shape[0]}, T) like "
                f"response_mask {tuple(response_mask.shape)}, got {tuple(tensor.shape)}"
            )
    if bool((old_log_probs > 0).any()):
        raise ValueError(
            "old_log_probs must be <= 0 (log-probabilities), got a positive value"
        )
    if bool(((sum_pi_squared < 0) | (sum_pi_squared > 1)).any()):
        raise ValueError(
            "sum_pi_squared must lie in [0, 1] (a sum of squared probabilities)"
        )


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
