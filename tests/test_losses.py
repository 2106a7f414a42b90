"""Tests for grpo_lab.losses: per-token losses, clip counts, aggregation."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from grpo_lab.losses import (
    aggregate_loss_across_microbatch,
    compute_policy_gradient_loss,
)


def assert_close(actual: torch.Tensor, expected: list) -> None:
    expected = torch.tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual.detach(), expected, rtol=1e-6, atol=1e-9)


def log_ratio_inputs(ratios: list[list[float]]):
    """policy_log_probs = log(ratio) + old, with old = log(0.5) everywhere."""
    old = torch.full((len(ratios), len(ratios[0])), math.log(0.5), dtype=torch.float64)
    policy = (torch.tensor(ratios, dtype=torch.float64).log() + old).requires_grad_()
    return policy, old


def test_none_is_reinforce_by_hand():
    advantages = torch.tensor([2.0, -1.0])
    log_probs = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], requires_grad=True)
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, metadata = compute_policy_gradient_loss(
        advantages, log_probs, "none", response_mask=mask
    )
    # -A * log pi: [[-2 * -1, -2 * -2], [1 * -0.5, 1 * -3]]
    assert loss.tolist() == [[2.0, 4.0], [-0.5, -3.0]]
    # mean over the 3 masked-in tokens: (2 + 4 - 0.5) / 3
    assert metadata["on_policy_loss_mean"].item() == pytest.approx(5.5 / 3)
    loss.sum().backward()
    assert log_probs.grad.tolist() == [[-2.0, -2.0], [1.0, 1.0]]  # d/dlogp = -A


def test_noclip_is_importance_weighted_by_hand():
    policy, old = log_ratio_inputs([[2.0, 0.5], [1.0, 1.5]])
    advantages = torch.tensor([1.0, -2.0], dtype=torch.float64)
    loss, metadata = compute_policy_gradient_loss(advantages, policy, "noclip", old)
    # -A * w: [[-2, -0.5], [2 * 1, 2 * 1.5]]
    assert_close(loss, [[-2.0, -0.5], [2.0, 3.0]])
    assert metadata["importance_ratio_mean"].item() == pytest.approx(1.25)  # 5 / 4
    assert metadata["importance_ratio_count"].item() == 4
    assert metadata["off_policy_loss_mean"].item() == pytest.approx(0.625)  # 2.5 / 4
    loss.sum().backward()
    # d(-A w)/dlogp = -A w: the gradient equals the loss here.
    assert_close(policy.grad, [[-2.0, -0.5], [2.0, 3.0]])
    assert old.grad is None


def test_grpo_clip_by_hand():
    # cliprange 0.2 -> ratios clipped to [0.8, 1.2].
    # row 0, A = +1, ratios [1.5, 0.9, 0.7]:
    #   min(1.5, 1.2) = 1.2 (clipped: counted, no gradient), min(.9, .9) = .9,
    #   min(.7, .8) = .7 (min keeps the unclipped term: not counted)
    # row 1, A = -1, ratios [1.5, 0.7, 1.1]:
    #   min(-1.5, -1.2) = -1.5 (unclipped: not counted), min(-.7, -.8) = -.8
    #   (clipped: counted, no gradient), min(-1.1, -1.1) = -1.1
    policy, old = log_ratio_inputs([[1.5, 0.9, 0.7], [1.5, 0.7, 1.1]])
    advantages = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, metadata = compute_policy_gradient_loss(advantages, policy, "grpo", old, 0.2)
    assert_close(loss, [[-1.2, -0.9, -0.7], [1.5, 0.8, 1.1]])
    assert metadata["clip_count"].item() == 2
    assert metadata["clip_total"].item() == 6
    assert metadata["clip_fraction"].item() == pytest.approx(2 / 6)
    assert metadata["importance_ratio_mean"].item() == pytest.approx(6.4 / 6)
    assert metadata["off_policy_loss_mean"].item() == pytest.approx(0.6 / 6)
    loss.sum().backward()
    # Unclipped tokens: d(-A w)/dlogp = -A w; counted clips: 0.
    assert_close(policy.grad, [[0.0, -0.9, -0.7], [1.5, 0.0, 1.1]])


def test_grpo_clip_counts_only_masked_in_tokens():
    policy, old = log_ratio_inputs([[1.5, 0.9, 0.7], [1.5, 0.7, 1.1]])
    advantages = torch.tensor([1.0, -1.0], dtype=torch.float64)
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])  # hides the row-0 clip
    _, metadata = compute_policy_gradient_loss(
        advantages, policy, "grpo", old, 0.2, mask
    )
    assert metadata["clip_count"].item() == 1
    assert metadata["clip_total"].item() == 5
    assert metadata["clip_fraction"].item() == pytest.approx(0.2)


def test_gspo_one_ratio_per_response_by_hand():
    # row 0: mask [1, 1, 0], log ratios [ln 2, ln 0.5, masked] -> mean 0 -> s = 1
    # row 1: mask [1, 1, 1], log ratios [ln 1.1] * 3          -> s = 1.1
    # cliprange 0.05, A = [1, 1]: min(1, 1) = 1; min(1.1, 1.05) = 1.05 (counted)
    log_ratio = torch.tensor(
        [[math.log(2), math.log(0.5), 5.0], [math.log(1.1)] * 3], dtype=torch.float64
    )
    old = torch.full_like(log_ratio, -1.0)
    policy = (log_ratio + old).requires_grad_()
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    advantages = torch.tensor([1.0, 1.0], dtype=torch.float64)
    loss, metadata = compute_policy_gradient_loss(
        advantages, policy, "gspo", old, 0.05, mask
    )
    assert_close(loss, [[-1.0] * 3, [-1.05] * 3])
    assert metadata["importance_ratio_mean"].item() == pytest.approx(1.05)  # (1+1.1)/2
    assert metadata["clipped_importance_ratio_mean"].item() == pytest.approx(1.025)
    assert metadata["clip_count"].item() == 1
    assert metadata["clip_total"].item() == 2
    assert metadata["clip_fraction"].item() == pytest.approx(0.5)
    # token mean over 5 masked-in tokens: (2 * -1 + 3 * -1.05) / 5
    assert metadata["off_policy_loss_mean"].item() == pytest.approx(-1.03)
    aggregate_loss_across_microbatch(loss, mask).backward()
    # sequence loss = mean_i (-s_i or -clipped s_i). Row 0: d(-s/2)/dlogp_t =
    # -s / (2 L) = -1/4 on its 2 tokens; row 1 is clipped: zero gradient.
    assert_close(policy.grad, [[-0.25, -0.25, 0.0], [0.0] * 3])


def test_gspo_counts_only_clips_that_remove_gradient():
    # A < 0: s = 0.5 < 1 - 0.2 is counted; s = 2 > 1 + 0.2 is not (min keeps -2 A).
    log_ratio = torch.tensor([[math.log(0.5)], [math.log(2.0)]])
    _, metadata = compute_policy_gradient_loss(
        torch.tensor([-1.0, -1.0]),
        log_ratio,
        "gspo",
        torch.zeros_like(log_ratio),
        0.2,
        torch.ones_like(log_ratio),
    )
    assert metadata["clip_count"].item() == 1
    assert metadata["clip_fraction"].item() == 0.5


def test_aggregation_by_hand():
    per_token_loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    # sequence: row means [(1 + 2) / 2, 4 / 1, 0 / max(0, 1)] -> (1.5 + 4 + 0) / 3
    sequence = aggregate_loss_across_microbatch(per_token_loss, mask, "sequence")
    assert sequence.item() == pytest.approx(5.5 / 3)
    # constant: (1 + 2 + 4) / 4 -- a long response weighs as much per token
    constant = aggregate_loss_across_microbatch(per_token_loss, mask, "constant", 4)
    assert constant.item() == pytest.approx(7 / 4)


def test_half_precision_log_probs_are_computed_in_float32():
    advantages = torch.tensor([1.0])
    policy = torch.tensor([[-0.5, -1.0]], dtype=torch.bfloat16)
    old = policy.float() - 1e-4  # ratio 1.0001: inside 1 +/- 3e-4 only in float32
    loss, metadata = compute_policy_gradient_loss(
        advantages, policy, "gspo", old, 3e-4, torch.ones(1, 2)
    )
    assert loss.dtype == torch.float32
    assert metadata["clip_count"].item() == 0
    assert loss[0, 0].item() == pytest.approx(-math.exp(1e-4), rel=1e-6)


def random_inputs(draw, batch_size, length, log_ratio_scale):
    def floats(low, high):
        return st.floats(low, high, allow_nan=False, allow_infinity=False)

    advantages = torch.tensor(
        draw(st.lists(floats(-3, 3), min_size=batch_size, max_size=batch_size)),
        dtype=torch.float64,
    )
    values = st.lists(floats(-6, -0.01), min_size=length, max_size=length)
    policy = torch.tensor(
        draw(st.lists(values, min_size=batch_size, max_size=batch_size)),
        dtype=torch.float64,
    )
    shifts = st.lists(
        floats(-log_ratio_scale, log_ratio_scale), min_size=length, max_size=length
    )
    old = policy + torch.tensor(
        draw(st.lists(shifts, min_size=batch_size, max_size=batch_size)),
        dtype=torch.float64,
    )
    return advantages, policy, old


@st.composite
def loss_inputs(draw, length=None):
    batch_size = draw(st.integers(1, 4))
    length = length or draw(st.integers(1, 5))
    advantages, policy, old = random_inputs(draw, batch_size, length, 0.5)
    mask_rows = st.lists(st.booleans(), min_size=length, max_size=length)
    mask = torch.tensor(
        draw(st.lists(mask_rows, min_size=batch_size, max_size=batch_size))
    )
    cliprange = draw(st.sampled_from([0.05, 0.2]))
    return advantages, policy, old, mask, cliprange


def gradient_of(advantages, policy, method, old, cliprange, mask, normalization):
    policy = policy.clone().requires_grad_()
    loss, _ = compute_policy_gradient_loss(
        advantages, policy, method, old, cliprange, mask
    )
    aggregate_loss_across_microbatch(loss, mask, normalization, 3).backward()
    return policy.grad


@settings(max_examples=60, deadline=None)
@given(inputs=loss_inputs(), normalization=st.sampled_from(["sequence", "constant"]))
def test_ratio_one_gives_the_plain_policy_gradient(inputs, normalization):
    advantages, policy, _, mask, cliprange = inputs
    reinforce = gradient_of(advantages, policy, "none", None, None, mask, normalization)
    for method in ("noclip", "grpo"):
        old = policy.detach()  # ratio exactly 1
        gradient = gradient_of(
            advantages, policy, method, old, cliprange, mask, normalization
        )
        assert torch.allclose(gradient, reinforce, atol=1e-12)


@settings(max_examples=60, deadline=None)
@given(inputs=loss_inputs())
def test_clipping_never_raises_the_objective(inputs):
    advantages, policy, old, mask, cliprange = inputs
    unclipped, _ = compute_policy_gradient_loss(advantages, policy, "noclip", old)
    clipped, _ = compute_policy_gradient_loss(
        advantages, policy, "grpo", old, cliprange, mask
    )
    assert (clipped >= unclipped).all()  # loss = -objective, token by token
    sequence_clipped, _ = compute_policy_gradient_loss(
        advantages, policy, "gspo", old, cliprange, mask
    )
    lengths = mask.sum(dim=1).clamp_min(1)  # (B,)
    mean_log_ratio = ((policy - old) * mask).sum(dim=1) / lengths  # (B,)
    sequence_unclipped = -advantages * mean_log_ratio.exp()  # (B,)
    assert (sequence_clipped[:, 0] >= sequence_unclipped - 1e-12).all()


@settings(max_examples=60, deadline=None)
@given(inputs=loss_inputs(length=1))
def test_gspo_equals_grpo_for_one_token_responses(inputs):
    advantages, policy, old, _, cliprange = inputs
    mask = torch.ones_like(policy, dtype=torch.long)
    results = {}
    for method in ("grpo", "gspo"):
        scored = policy.clone().requires_grad_()
        loss, metadata = compute_policy_gradient_loss(
            advantages, scored, method, old, cliprange, mask
        )
        aggregate_loss_across_microbatch(loss, mask).backward()
        results[method] = (loss.detach(), scored.grad, metadata)
    (grpo_loss, grpo_grad, grpo_md), (gspo_loss, gspo_grad, gspo_md) = results.values()
    assert torch.allclose(grpo_loss, gspo_loss, atol=1e-12)
    assert torch.allclose(grpo_grad, gspo_grad, atol=1e-12)
    for key in ("clip_count", "clip_total", "clip_fraction", "importance_ratio_mean"):
        assert torch.allclose(grpo_md[key].double(), gspo_md[key].double()), key


@settings(max_examples=60, deadline=None)
@given(inputs=loss_inputs())
def test_grpo_clip_count_is_the_tokens_whose_gradient_was_removed(inputs):
    advantages, policy, old, mask, cliprange = inputs
    ratio = (policy - old).exp()
    assume(((ratio - (1 + cliprange)).abs() > 1e-6).all())
    assume(((ratio - (1 - cliprange)).abs() > 1e-6).all())
    assume((advantages.abs() > 1e-3).all())  # a tiny A underflows the gradient
    scored = policy.clone().requires_grad_()
    loss, metadata = compute_policy_gradient_loss(
        advantages, scored, "grpo", old, cliprange, mask
    )
    loss.sum().backward()
    no_gradient = scored.grad == 0  # (B, T)
    assert metadata["clip_count"].item() == (no_gradient & mask).sum().item()


@settings(max_examples=40, deadline=None)
@given(
    batch_size=st.integers(1, 4),
    length=st.integers(1, 5),
    seed=st.integers(0, 1000),
)
def test_sequence_equals_constant_when_every_response_has_the_same_length(
    batch_size, length, seed
):
    generator = torch.Generator().manual_seed(seed)
    per_token_loss = torch.randn(batch_size, length + 2, generator=generator)
    mask = torch.zeros(batch_size, length + 2)
    mask[:, 1 : length + 1] = 1  # every response has `length` tokens
    sequence = aggregate_loss_across_microbatch(per_token_loss, mask, "sequence")
    constant = aggregate_loss_across_microbatch(
        per_token_loss, mask, "constant", batch_size * length
    )
    assert sequence.item() == pytest.approx(constant.item(), abs=1e-6)


def test_loss_errors():
    log_probs = torch.zeros(2, 3)
    advantages = torch.zeros(2)
    old = torch.zeros(2, 3)
    mask = torch.ones(2, 3)

    def loss(**overrides):
        arguments = {
            "raw_rewards_or_advantages": advantages,
            "policy_log_probs": log_probs,
            "importance_reweighting_method": "grpo",
            "old_log_probs": old,
            "cliprange": 0.2,
            "response_mask": mask,
        } | overrides
        return compute_policy_gradient_loss(**arguments)

    cases = [
        (
            {"importance_reweighting_method": "ppo"},
            r"importance_reweighting_method must be one of .*got 'ppo'",
        ),
        (
            {"policy_log_probs": torch.zeros(6)},
            r"policy_log_probs must have shape \(batch_size, sequence_length\), got \(6,\)",
        ),
        (
            {"response_mask": torch.ones(2, 2)},
            r"response_mask must have shape \(2, 3\) like policy_log_probs, got \(2, 2\)",
        ),
        (
            {"raw_rewards_or_advantages": torch.zeros(2, 3)},
            r"raw_rewards_or_advantages must have shape \(batch_size,\) or \(batch_size, 1\), got \(2, 3\)",
        ),
        (
            {"raw_rewards_or_advantages": torch.zeros(3)},
            r"raw_rewards_or_advantages must have batch size 2 like policy_log_probs, got 3",
        ),
        (
            {"old_log_probs": None},
            r"old_log_probs must be a tensor for 'grpo' reweighting, got None",
        ),
        (
            {"old_log_probs": torch.zeros(2, 4)},
            r"old_log_probs must have shape \(2, 3\) like policy_log_probs, got \(2, 4\)",
        ),
        ({"cliprange": None}, r"cliprange must be positive for 'grpo', got None"),
        (
            {"cliprange": 0.0, "importance_reweighting_method": "gspo"},
            r"cliprange must be positive for 'gspo', got 0.0",
        ),
        (
            {"response_mask": None, "importance_reweighting_method": "gspo"},
            r"response_mask must be a tensor for 'gspo' reweighting, got None",
        ),
        (
            {"old_log_probs": None, "importance_reweighting_method": "noclip"},
            r"old_log_probs must be a tensor for 'noclip'",
        ),
    ]
    for overrides, message in cases:
        with pytest.raises(ValueError, match=message):
            loss(**overrides)


def test_aggregation_errors():
    per_token_loss, mask = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(
        ValueError,
        match=r"per_token_policy_gradient_loss must have shape \(batch_size, sequence_length\), got \(3,\)",
    ):
        aggregate_loss_across_microbatch(torch.zeros(3), torch.ones(3))
    with pytest.raises(
        ValueError, match=r"mask must have shape \(2, 3\), got \(3, 2\)"
    ):
        aggregate_loss_across_microbatch(per_token_loss, torch.ones(3, 2))
    with pytest.raises(
        ValueError,
        match=r"loss_normalization must be one of \('sequence', 'constant'\), got 'token'",
    ):
        aggregate_loss_across_microbatch(per_token_loss, mask, "token")
    for constant in (None, 0, -2):
        with pytest.raises(
            ValueError,
            match=rf"normalization_constant must be positive for constant normalization, got {constant}",
        ):
            aggregate_loss_across_microbatch(per_token_loss, mask, "constant", constant)
