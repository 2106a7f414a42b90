"""Tests for grpo_lab.advantages: rollout rewards and group-normalized advantages."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_lab.advantages import (
    compute_group_normalized_rewards,
    compute_multi_reward_advantages,
    compute_rollout_rewards,
    optimal_token_baseline_advantages,
    rollout_advantages,
    sum_of_squared_probabilities,
)

# Two groups of G = 4:
#   group 1: [1, 0, 0, 1]  mean 0.5   deviations +-0.5, sum of squares 1.0,
#            sample std sqrt(1.0 / 3) = 0.57735
#   group 2: [1, 1, 1, 0]  mean 0.75  deviations [.25, .25, .25, -.75],
#            sum of squares 0.75, sample std sqrt(0.75 / 3) = 0.5
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0])
SQRT_THIRD = math.sqrt(1 / 3)


def normalize(baseline, normalizer, rewards=REWARDS, group_size=4, eps=0.0):
    return compute_group_normalized_rewards(
        rewards, group_size, baseline, eps, normalizer
    )


def test_std_normalizer_with_mean_baseline_by_hand():
    advantages, metadata = normalize("mean", "std")
    half = 0.5 / SQRT_THIRD  # 0.866025
    expected = [half, -half, -half, half, 0.5, 0.5, 0.5, -1.5]  # 0.25/0.5, -0.75/0.5
    assert advantages.tolist() == pytest.approx(expected, abs=1e-6)
    assert metadata["advantage_mean"] == pytest.approx(0.0, abs=1e-6)
    assert metadata["advantage_std"] == pytest.approx(
        torch.tensor(expected).std().item(), abs=1e-6
    )


def test_none_normalizer_with_mean_baseline_by_hand():
    advantages, _ = normalize("mean", "none")
    assert advantages.tolist() == [0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75]


def test_mean_normalizer_with_mean_baseline_by_hand():
    # group 1: [.5, -.5, -.5, .5] / 0.5;  group 2: [.25, .25, .25, -.75] / 0.75
    advantages, _ = normalize("mean", "mean")
    expected = [1.0, -1.0, -1.0, 1.0, 1 / 3, 1 / 3, 1 / 3, -1.0]
    assert advantages.tolist() == pytest.approx(expected, abs=1e-6)


def test_no_baseline_keeps_raw_rewards_and_still_normalizes():
    advantages, _ = normalize("none", "none")
    assert advantages.tolist() == REWARDS.tolist()
    advantages, _ = normalize("none", "std")
    # group 1: [1, 0, 0, 1] / 0.57735; group 2: [1, 1, 1, 0] / 0.5
    expected = [1 / SQRT_THIRD, 0, 0, 1 / SQRT_THIRD, 2.0, 2.0, 2.0, 0.0]
    assert advantages.tolist() == pytest.approx(expected, abs=1e-6)


def test_eps_is_added_to_the_divisor():
    # A group of equal rewards has std 0: the advantages are 0 / eps = 0, not NaN.
    advantages, _ = normalize("mean", "std", torch.tensor([1.0, 1.0]), 2, eps=1e-6)
    assert advantages.tolist() == [0.0, 0.0]
    # [0, 2]: mean 1, sample std sqrt(2) -> +-1 / (sqrt(2) + 0.1)
    advantages, _ = normalize("mean", "std", torch.tensor([0.0, 2.0]), 2, eps=0.1)
    assert advantages.tolist() == pytest.approx(
        [-1 / (2**0.5 + 0.1), 1 / (2**0.5 + 0.1)]
    )


reward_lists = st.integers(1, 4).flatmap(
    lambda group_size: st.tuples(
        st.just(group_size),
        st.lists(
            st.floats(-10, 10), min_size=group_size, max_size=4 * group_size
        ).filter(lambda rewards: len(rewards) % group_size == 0),
    )
)


@settings(max_examples=60, deadline=None)
@given(case=reward_lists, normalizer=st.sampled_from(["none", "std"]))
def test_mean_baseline_gives_zero_mean_per_group(case, normalizer):
    group_size, rewards = case
    if normalizer == "std" and group_size == 1:
        return  # the sample std of one reward is undefined
    advantages, _ = normalize(
        "mean", normalizer, torch.tensor(rewards, dtype=torch.float64), group_size, 1e-6
    )
    group_means = advantages.reshape(-1, group_size).mean(dim=1)
    assert torch.allclose(group_means, torch.zeros_like(group_means), atol=1e-6)


@settings(max_examples=60, deadline=None)
@given(
    case=reward_lists,
    scale=st.floats(0.1, 10),
    shift=st.floats(-5, 5),
)
def test_std_normalized_advantages_ignore_reward_scale_and_shift(case, scale, shift):
    group_size, rewards = case
    rewards = torch.tensor(rewards, dtype=torch.float64)
    if group_size == 1 or (rewards.reshape(-1, group_size).std(dim=1) < 1e-3).any():
        return  # undefined (G = 1) or eps-dominated groups
    plain, _ = normalize("mean", "std", rewards, group_size)
    moved, _ = normalize("mean", "std", rewards * scale + shift, group_size)
    assert torch.allclose(plain, moved, atol=1e-6)
    group_stds = plain.reshape(-1, group_size).std(dim=1)
    assert torch.allclose(group_stds, torch.ones_like(group_stds), atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(case=reward_lists, data=st.data())
def test_groups_are_independent_and_permutation_equivariant(case, data):
    group_size, rewards = case
    rewards = torch.tensor(rewards, dtype=torch.float64)
    permutation = torch.tensor(data.draw(st.permutations(range(group_size))))
    for normalizer in ("none", "mean"):
        advantages, _ = normalize("mean", normalizer, rewards, group_size, 1e-6)
        permuted = rewards.reshape(-1, group_size)[:, permutation].flatten()
        advantages_of_permuted, _ = normalize(
            "mean", normalizer, permuted, group_size, 1e-6
        )
        expected = advantages.reshape(-1, group_size)[:, permutation].flatten()
        assert torch.allclose(advantages_of_permuted, expected, atol=1e-9)


def shifted_per_group(rewards, group_size, shifts):
    """rewards with shifts[g] added to every reward of group g."""
    grouped = rewards.reshape(-1, group_size)  # (n_groups, G)
    return (grouped + torch.tensor(shifts, dtype=rewards.dtype)[:, None]).flatten()


@settings(max_examples=60, deadline=None)
@given(case=reward_lists, data=st.data())
def test_a_constant_added_to_one_group_changes_no_advantage(case, data):
    # The mean baseline removes any per-group offset; the std does not see it.
    group_size, rewards = case
    rewards = torch.tensor(rewards, dtype=torch.float64)
    group_count = len(rewards) // group_size
    shifts = data.draw(
        st.lists(st.floats(-100, 100), min_size=group_count, max_size=group_count)
    )
    moved = shifted_per_group(rewards, group_size, shifts)
    normalizers = ("std", "none") if group_size > 1 else ("none",)
    for normalizer in normalizers:
        plain, _ = normalize("mean", normalizer, rewards, group_size, 1e-6)
        shifted, _ = normalize("mean", normalizer, moved, group_size, 1e-6)
        torch.testing.assert_close(shifted, plain, rtol=1e-6, atol=1e-6)


@settings(max_examples=60, deadline=None)
@given(
    case=st.integers(1, 4).flatmap(
        lambda group_size: st.tuples(
            st.just(group_size),
            st.lists(
                st.floats(0, 10), min_size=group_size, max_size=4 * group_size
            ).filter(lambda rewards: len(rewards) % group_size == 0),
        )
    )
)
def test_mean_normalizer_keeps_zero_mean_groups_for_nonnegative_rewards(case):
    # Rewards >= 0 (MaxRL's setting): each group's deviations are divided by
    # one positive number, so the group mean stays 0.
    group_size, rewards = case
    advantages, _ = normalize(
        "mean", "mean", torch.tensor(rewards, dtype=torch.float64), group_size, 1e-6
    )
    scale = 1 + advantages.abs().max()  # a near-zero mean reward magnifies rounding
    group_means = advantages.reshape(-1, group_size).mean(dim=1)
    assert torch.all(group_means.abs() <= 1e-9 * scale)


@settings(max_examples=40, deadline=None)
@given(case=reward_lists, data=st.data())
def test_std_normalizer_is_permutation_equivariant_within_and_across_groups(case, data):
    group_size, rewards = case
    if group_size == 1:
        return  # the sample std of one reward is undefined
    rewards = torch.tensor(rewards, dtype=torch.float64)
    group_count = len(rewards) // group_size
    within = torch.tensor(data.draw(st.permutations(range(group_size))))
    across = torch.tensor(data.draw(st.permutations(range(group_count))))
    advantages, _ = normalize("mean", "std", rewards, group_size, 1e-6)
    permuted = rewards.reshape(-1, group_size)[across][:, within].flatten()
    advantages_of_permuted, _ = normalize("mean", "std", permuted, group_size, 1e-6)
    expected = advantages.reshape(-1, group_size)[across][:, within].flatten()
    torch.testing.assert_close(advantages_of_permuted, expected, rtol=1e-9, atol=1e-9)


def exact_match(response: str, truth: str) -> dict[str, float]:
    correct = float(response == truth)
    return {"reward": correct, "format_reward": 1.0, "answer_reward": correct}


def test_rollout_rewards_by_hand():
    calls = []

    def reward_fn(response, truth):
        calls.append((response, truth))
        return exact_match(response, truth)

    rewards, metadata = compute_rollout_rewards(
        reward_fn, ["1", "2", "3", "3"], ["1", "1", "3", "4"]
    )
    assert rewards.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert rewards.dtype == torch.float32
    assert calls == [("1", "1"), ("2", "1"), ("3", "3"), ("3", "4")]  # once each
    assert metadata == {
        "reward_mean": 0.5,
        "format_reward_mean": 1.0,
        "answer_reward_mean": 0.5,
    }


def test_advantage_errors():
    with pytest.raises(
        ValueError, match=r"raw_rewards must be one-dimensional, got shape \(2, 2\)"
    ):
        compute_group_normalized_rewards(torch.zeros(2, 2), 2)
    with pytest.raises(ValueError, match=r"group_size must be positive, got 0"):
        compute_group_normalized_rewards(torch.zeros(4), 0)
    with pytest.raises(
        ValueError,
        match=r"group_size must divide the number of rewards \(5\), got 2",
    ):
        compute_group_normalized_rewards(torch.zeros(5), 2)
    with pytest.raises(ValueError, match=r"baseline must be one of .*got 'median'"):
        compute_group_normalized_rewards(torch.zeros(4), 2, baseline="median")
    with pytest.raises(
        ValueError, match=r"advantage_normalizer must be one of .*got 'max'"
    ):
        compute_group_normalized_rewards(torch.zeros(4), 2, advantage_normalizer="max")


def test_rollout_reward_errors():
    with pytest.raises(ValueError, match=r"must have the same length, got 2 and 1"):
        compute_rollout_rewards(exact_match, ["a", "b"], ["a"])
    with pytest.raises(
        ValueError, match=r"reward_fn must return a dict with keys .*got \['reward'\]"
    ):
        compute_rollout_rewards(lambda r, t: {"reward": 1.0}, ["a"], ["a"])
    with pytest.raises(ValueError, match=r"reward_fn must return a dict .*got float"):
        compute_rollout_rewards(lambda r, t: 1.0, ["a"], ["a"])


# --- RLOO, batch std, NaN rewards, groups of one --------------------------------


def test_leave_one_out_baseline_by_hand():
    # group 1 [1, 0, 0, 1]: a 1 is compared with the mean of (0, 0, 1) = 1/3 ->
    #   2/3; a 0 with (1, 0, 1) -> -2/3. group 2 [1, 1, 1, 0]: a 1 with
    #   (1, 1, 0) -> 1/3; the 0 with (1, 1, 1) -> -1.
    advantages, _ = normalize("leave_one_out", "none")
    expected = [2 / 3, -2 / 3, -2 / 3, 2 / 3, 1 / 3, 1 / 3, 1 / 3, -1.0]
    assert advantages.tolist() == pytest.approx(expected, abs=1e-6)


@settings(max_examples=40, deadline=None)
@given(case=reward_lists.filter(lambda case: case[0] > 1))
def test_leave_one_out_is_the_mean_baseline_scaled_by_g_over_g_minus_1(case):
    group_size, rewards = case
    rewards = torch.tensor(rewards, dtype=torch.float64)
    loo, _ = normalize("leave_one_out", "none", rewards, group_size)
    mean, _ = normalize("mean", "none", rewards, group_size)
    assert torch.allclose(loo, mean * group_size / (group_size - 1), atol=1e-9)


def test_batch_std_normalizer_by_hand():
    # Group means stay the baselines; the divisor is the sample std of all 8
    # rewards [1 0 0 1 1 1 1 0]: mean 5/8, sum of squares 5 * (3/8)^2 +
    # 3 * (5/8)^2 = 1.875, std sqrt(1.875 / 7).
    advantages, _ = normalize("mean", "batch_std")
    std = math.sqrt(1.875 / 7)
    centred = [0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75]
    assert advantages.tolist() == pytest.approx([c / std for c in centred], abs=1e-6)


def test_nan_rewards_are_ignored_by_hand():
    rewards = torch.tensor([1.0, math.nan, 0.0, 1.0, 2.0, math.nan, math.nan, math.nan])
    advantages, _ = compute_group_normalized_rewards(
        rewards, 4, "mean", 0.0, "std", nan_rewards="ignore"
    )
    # group 1 keeps [1, 0, 1]: mean 2/3, sample std sqrt((2/9 + 4/9) / 2) =
    # sqrt(1/3) -> (1/3) / sqrt(1/3) = sqrt(1/3); the NaN gets 0. Group 2 keeps
    # one reward: its std is undefined, so the whole group gets 0 (never NaN).
    root = math.sqrt(1 / 3)
    expected = [root, 0.0, -2 * root, root, 0.0, 0.0, 0.0, 0.0]
    assert advantages.tolist() == pytest.approx(expected, abs=1e-6)
    propagated, _ = compute_group_normalized_rewards(rewards, 4)
    assert torch.isnan(propagated[:4]).all()  # the default lets NaN spread


def test_ignoring_nan_without_nan_is_the_default_bit_for_bit():
    for baseline in ("mean", "leave_one_out", "none"):
        for normalizer in ("std", "batch_std", "mean", "none"):
            plain, _ = normalize(baseline, normalizer, eps=1e-6)
            ignoring, _ = compute_group_normalized_rewards(
                REWARDS, 4, baseline, 1e-6, normalizer, nan_rewards="ignore"
            )
            assert torch.equal(plain, ignoring), (baseline, normalizer)


def test_nan_rewards_under_every_baseline_and_normalizer_stay_finite():
    rewards = torch.tensor([1.0, math.nan, 0.0, 1.0, 3.0, 1.0, math.nan, 2.0])
    for baseline in ("mean", "leave_one_out", "none"):
        for normalizer in ("std", "batch_std", "mean", "none"):
            advantages, _ = compute_group_normalized_rewards(
                rewards, 4, baseline, 1e-6, normalizer, nan_rewards="ignore"
            )
            assert torch.isfinite(advantages).all(), (baseline, normalizer)
            assert advantages[1] == 0 and advantages[6] == 0


def test_groups_of_one_get_an_error_or_a_defined_value():
    rewards = torch.tensor([1.0, 0.0, 2.0])
    with pytest.raises(
        ValueError,
        match="group_size must be at least 2 with advantage_normalizer 'std'",
    ):
        compute_group_normalized_rewards(rewards, 1)
    with pytest.raises(
        ValueError, match="group_size must be at least 2 with baseline 'leave_one_out'"
    ):
        compute_group_normalized_rewards(rewards, 1, "leave_one_out", 1e-6, "none")
    with pytest.raises(
        ValueError,
        match="raw_rewards must hold at least 2 rewards with advantage_normalizer 'batch_std'",
    ):
        compute_group_normalized_rewards(
            torch.tensor([1.0]), 1, "none", 1e-6, "batch_std"
        )
    zero, _ = compute_group_normalized_rewards(rewards, 1, "mean", 1e-6, "none")
    assert zero.tolist() == [0.0, 0.0, 0.0]  # a group of one is its own mean
    raw, _ = compute_group_normalized_rewards(rewards, 1, "none", 0.0, "batch_std")
    assert raw.tolist() == pytest.approx([1.0, 0.0, 2.0])  # std of [1, 0, 2] is 1
    with pytest.raises(
        ValueError,
        match=r"nan_rewards must be one of \('propagate', 'ignore'\), got 'drop'",
    ):
        compute_group_normalized_rewards(
            rewards, 1, "mean", 1e-6, "none", nan_rewards="drop"
        )


# --- REINFORCE++ whitening, multi-reward aggregation, the optimal token baseline ---


def test_token_whitening_by_hand():
    # rewards [1, 0] with 1 and 3 tokens: N = 4 tokens, mean (1 + 0) / 4 = 0.25;
    # squared deviations 1 x 0.75^2 + 3 x 0.25^2 = 0.75, / 4 = 0.1875, x 4 / 3
    # (sample) = 0.25, std 0.5 -> [0.75, -0.25] / 0.5.
    advantages, _ = compute_group_normalized_rewards(
        torch.tensor([1.0, 0.0], dtype=torch.float64), 2, "none", 0.0,
        "token_whiten", response_lengths=torch.tensor([1, 3]),
    )  # fmt: skip
    assert advantages.tolist() == pytest.approx([1.5, -0.5], abs=1e-7)
    # With the group mean as baseline ([0.5, -0.5]) and equal lengths it is the
    # batch-wide sample whitening of the centred rewards: +-0.5 / sqrt(1/3).
    centred, _ = compute_group_normalized_rewards(
        torch.tensor([1.0, 0.0, 2.0, 2.0], dtype=torch.float64), 2, "mean", 0.0,
        "token_whiten", response_lengths=torch.tensor([2, 2, 2, 2]),
    )  # fmt: skip
    # tokens [.5, .5, -.5, -.5, 0, 0, 0, 0]: mean 0, squares sum to 1, sample
    # variance 1 / 7.
    scale = math.sqrt(1 / 7)
    assert centred.tolist() == pytest.approx([0.5 / scale, -0.5 / scale, 0, 0])


def test_token_whitening_ignores_nan_rewards_when_asked():
    rewards = torch.tensor([1.0, math.nan, 0.0, 1.0], dtype=torch.float64)
    lengths = torch.tensor([1, 5, 3, 1])
    advantages, _ = compute_group_normalized_rewards(
        rewards, 2, "none", 0.0, "token_whiten",
        nan_rewards="ignore", response_lengths=lengths,
    )  # fmt: skip
    kept = torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)
    expected, _ = compute_group_normalized_rewards(
        kept, 1, "none", 0.0, "token_whiten", response_lengths=torch.tensor([1, 3, 1])
    )
    assert advantages[1] == 0.0
    assert advantages[[0, 2, 3]].tolist() == pytest.approx(expected.tolist())


def test_token_whitening_errors():
    rewards = torch.tensor([1.0, 0.0])
    with pytest.raises(
        ValueError, match=r"response_lengths must be given with .*got None"
    ):
        compute_group_normalized_rewards(rewards, 2, "none", 0.0, "token_whiten")
    with pytest.raises(ValueError, match=r"response_lengths is read only by .*'std'"):
        compute_group_normalized_rewards(
            rewards, 2, response_lengths=torch.tensor([1, 2])
        )
    with pytest.raises(
        ValueError, match=r"must have the rewards' shape \(2,\), got \(3,\)"
    ):
        compute_group_normalized_rewards(
            rewards, 2, "none", 0.0, "token_whiten", response_lengths=torch.ones(3)
        )
    with pytest.raises(ValueError, match=r"whole token counts >= 0, got \[-1, 2\]"):
        compute_group_normalized_rewards(
            rewards, 2, "none", 0.0, "token_whiten",
            response_lengths=torch.tensor([-1, 2]),
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"at least 2 scored response tokens .*got 1"):
        compute_group_normalized_rewards(
            rewards, 2, "none", 0.0, "token_whiten",
            response_lengths=torch.tensor([1, 0]),
        )  # fmt: skip


# Two groups of G = 2, two parts: part 1 [1, 0 | 1, 1], part 2 [0, 1 | 1, 0].
PARTS = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [1.0, 0.0]])


def test_multi_reward_aggregations_by_hand():
    # sum_then_normalize: totals [1, 1 | 2, 1] -> group 1 ties (0 / eps = 0);
    # group 2 +-0.5 / sqrt(0.5).
    summed, _ = compute_multi_reward_advantages(
        PARTS, 2, "mean", 1e-6, "std", reward_aggregation="sum_then_normalize"
    )
    root = math.sqrt(0.5)
    assert summed.tolist() == pytest.approx([0, 0, 0.5 / root, -0.5 / root], abs=1e-5)
    # normalize_then_sum (eps 1e-6: a tied group gives 0): part 1 -> [r, -r, 0, 0], part 2 -> [-r, r, r, -r]
    # (r = 0.5 / sqrt(0.5)); sum [0, 0, r, -r]: mean 0, sample std
    # sqrt(2 r^2 / 3) -> [0, 0, sqrt(1.5), -sqrt(1.5)].
    decoupled, _ = compute_multi_reward_advantages(
        PARTS, 2, "mean", 1e-6, "std", reward_aggregation="normalize_then_sum"
    )
    assert decoupled.tolist() == pytest.approx([0, 0, 1.5**0.5, -(1.5**0.5)], abs=1e-5)
    # The first pair's two parts cancel once each is normalized: GDPO sees
    # that neither response is better, and a sum first sees it too here, but
    # with part 2 weighed 3x the first response loses to the second.
    weighted, _ = compute_multi_reward_advantages(
        PARTS, 2, "mean", 1e-6, "std",
        reward_aggregation="normalize_then_sum", reward_weights=[1.0, 3.0],
    )  # fmt: skip
    assert weighted[0] < 0 < weighted[1]
    # Over tokens with equal lengths (3 each) the whitening differs only by
    # Bessel's correction: squares x 3 / (12 - 1) instead of / (4 - 1), so the
    # advantages scale by sqrt(11 / 9).
    tokens, _ = compute_multi_reward_advantages(
        PARTS, 2, "mean", 1e-6, "std",
        reward_aggregation="normalize_then_sum_tokens",
        response_lengths=torch.tensor([3, 3, 3, 3]),
    )  # fmt: skip
    scaled = (decoupled * math.sqrt(11 / 9)).tolist()
    assert tokens.tolist() == pytest.approx(scaled, abs=1e-5)


def test_multi_reward_aggregation_errors():
    with pytest.raises(
        ValueError, match=r"reward_components must be a \(B, K\) tensor"
    ):
        compute_multi_reward_advantages(torch.zeros(4), 2)
    with pytest.raises(ValueError, match=r"reward_weights must be 2 finite numbers"):
        compute_multi_reward_advantages(PARTS, 2, reward_weights=[1.0])
    with pytest.raises(ValueError, match=r"reward_aggregation must be one of .*'max'"):
        compute_multi_reward_advantages(PARTS, 2, reward_aggregation="max")
    with pytest.raises(ValueError, match="to combine reward components, got 'reward'"):
        compute_multi_reward_advantages(PARTS, 2, reward_aggregation="reward")
    with pytest.raises(
        ValueError, match=r"must be a group normalizer .*'token_whiten'"
    ):
        compute_multi_reward_advantages(PARTS, 2, "mean", 1e-6, "token_whiten")
    with pytest.raises(ValueError, match="nan_rewards must be 'propagate' with"):
        compute_multi_reward_advantages(PARTS, 2, nan_rewards="ignore")
    with pytest.raises(ValueError, match="response_lengths must be given"):
        compute_multi_reward_advantages(
            PARTS, 2, reward_aggregation="normalize_then_sum_tokens"
        )


def test_rollout_advantages_default_is_the_reward_column_bit_for_bit():
    def reward_fn(response, truth):
        answer = float(response == truth)
        return {"reward": 0.1 + answer, "format_reward": 1.0, "answer_reward": answer}

    responses, truths = ["1", "2", "3", "3"], ["1", "1", "3", "4"]
    raw, advantages, metadata = rollout_advantages(reward_fn, responses, truths, 2)
    expected, _ = compute_group_normalized_rewards(raw, 2)
    assert torch.equal(advantages, expected) and raw.tolist()[0] == pytest.approx(1.1)
    _, parts, _ = rollout_advantages(
        reward_fn, responses, truths, 2, reward_aggregation="normalize_then_sum"
    )
    components = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 0.0]])
    expected, _ = compute_multi_reward_advantages(components, 2)
    assert torch.equal(parts, expected)
    assert metadata["format_reward_mean"] == 1.0


def test_optimal_token_baseline_by_hand():
    # pi = 0.5 and sum pi^2 = 0.5 at every token: w = 1 - 1 + 0.5 = 0.5.
    # Lengths 1 and 2, rewards [0, 1]: W = [0.5, 0.5] and [0.5, 1.0].
    # t = 0: B = (0 x 0.5 + 1 x 0.5) / (0.5 + 0.5) = 0.5; t = 1: only the
    # second response: B = 1 x 1.0 / 1.0 = 1, but it is the strictly longest,
    # so past the other's length its baseline is 0 (zero tail).
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0]], dtype=torch.float64)
    log_half = torch.full((2, 2), math.log(0.5), dtype=torch.float64)
    half = torch.full((2, 2), 0.5, dtype=torch.float64)
    rewards = torch.tensor([0.0, 1.0], dtype=torch.float64)
    advantages, returns = optimal_token_baseline_advantages(
        rewards, mask, 2, log_half, half
    )
    assert advantages.flatten().tolist() == pytest.approx([-0.5, 0.0, 0.5, 1.0])
    assert returns.tolist() == [[0.0, 0.0], [1.0, 1.0]]
    kept, _ = optimal_token_baseline_advantages(
        rewards, mask, 2, log_half, half, handle_zero_tail=False
    )
    assert kept.flatten().tolist() == pytest.approx([-0.5, 0.0, 0.5, 0.0], abs=1e-7)
    alone, _ = optimal_token_baseline_advantages(rewards, mask, 1, log_half, half)
    assert torch.equal(alone, returns * mask)  # a group of one: no baseline


def test_optimal_token_baseline_errors():
    mask = torch.ones(2, 3)
    good = {
        "old_log_probs": torch.full((2, 3), -0.5),
        "sum_pi_squared": torch.full((2, 3), 0.5),
    }
    rewards = torch.tensor([1.0, 0.0])
    with pytest.raises(ValueError, match=r"old_log_probs must have shape \(2, T\)"):
        optimal_token_baseline_advantages(
            rewards, mask, 2, torch.zeros(2, 4), good["sum_pi_squared"]
        )
    with pytest.raises(ValueError, match="old_log_probs must be <= 0"):
        optimal_token_baseline_advantages(
            rewards, mask, 2, torch.full((2, 3), 0.1), good["sum_pi_squared"]
        )
    with pytest.raises(ValueError, match=r"sum_pi_squared must lie in \[0, 1\]"):
        optimal_token_baseline_advantages(
            rewards, mask, 2, good["old_log_probs"], torch.full((2, 3), 1.5)
        )
    with pytest.raises(ValueError, match="group_size must divide"):
        optimal_token_baseline_advantages(rewards, mask, 3, **good)
    logits = torch.tensor([[[0.0, 0.0]]])
    assert sum_of_squared_probabilities(logits).item() == pytest.approx(0.5)
