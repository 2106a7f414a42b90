"""Tests for grpo_lab.losses: per-token losses (the GRPO family), clip counts,
and each record against its own loss (the records are the one list of facts
about the objectives: the name lists, the zero-step diagnostics and the
accumulator's counts derive from them)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from grpo_lab.aggregation import (
    COUNT_KEYS,
    aggregate_loss_across_microbatch,
)
from grpo_lab.losses import (
    CAPPED_METHODS,
    CLIP_SIDE_KEYS,
    CLIPPED_METHODS,
    EVERY_ROW_METHODS,
    OBJECTIVE_RECORDS,
    OBJECTIVES,
    RATIO_METHODS,
    SEQUENCE_METHODS,
    SPLIT_CLIP_METHODS,
    TRUNCATED_METHODS,
    ObjectiveOptions,
    check_entropy_settings,
    compute_policy_gradient_loss,
    effective_cliprange_high,
    high_entropy_mask,
    objective_loss,
    off_policy_sequence_mask,
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


# --- the GRPO family: clip-higher, dual clip, CISPO, SAPO, GMPO -----------------


def test_clip_higher_by_hand():
    # eps_low 0.2, eps_high 0.28 -> ratios clipped to [0.8, 1.28].
    # A = +1, ratios [1.25, 1.3]: 1.25 is inside (gradient -w), 1.3 clips at 1.28.
    # A = -1, ratios [0.75, 1.3]: 0.75 clips at 0.8 (low side), 1.3 keeps -(-1.3).
    policy, old = log_ratio_inputs([[1.25, 1.3], [0.75, 1.3]])
    advantages = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, metadata = compute_policy_gradient_loss(
        advantages, policy, "grpo", old, 0.2, cliprange_high=0.28
    )
    assert_close(loss, [[-1.25, -1.28], [0.8, 1.3]])
    loss.sum().backward()
    assert_close(policy.grad, [[-1.25, 0.0], [0.0, 1.3]])
    assert metadata["clip_low_count"].item() == 1  # the A < 0 token below 0.8
    assert metadata["clip_high_count"].item() == 1  # the A > 0 token above 1.28
    assert metadata["clip_count"].item() == 2
    assert metadata["clip_low_fraction"].item() == metadata["clip_high_fraction"]
    assert metadata["clip_high_fraction"].item() == pytest.approx(0.25)


def test_dual_clip_caps_a_negative_advantage_token_by_hand():
    # A = -1, eps 0.2, cap 2: ratio 3 -> -min(-min(3, 2), -1.2) = 2, no gradient
    # (counted on the high side); ratio 1.5 -> -min(-1.5, -1.2) = 1.5, gradient
    # d/dlogp = w = 1.5. A = +1 never reaches the cap: min already keeps 1.2.
    policy, old = log_ratio_inputs([[3.0, 1.5], [3.0, 1.1]])
    advantages = torch.tensor([-1.0, 1.0], dtype=torch.float64)
    loss, metadata = compute_policy_gradient_loss(
        advantages, policy, "grpo", old, 0.2, ratio_cap=2.0
    )
    assert_close(loss, [[2.0, 1.5], [-1.2, -1.1]])
    loss.sum().backward()
    assert_close(policy.grad, [[0.0, 1.5], [0.0, -1.1]])
    assert metadata["clip_high_count"].item() == 2  # the cap and the +A clip
    assert metadata["clip_low_count"].item() == 0
    uncapped, _ = compute_policy_gradient_loss(advantages, policy, "grpo", old, 0.2)
    assert uncapped[0, 0].item() == pytest.approx(3.0)  # unbounded without a cap


def test_the_reference_clip_keeps_its_keys_and_splits_on_request():
    policy, old = log_ratio_inputs([[1.5, 0.9, 0.7], [1.5, 0.7, 1.1]])
    advantages = torch.tensor([1.0, -1.0], dtype=torch.float64)
    mask = torch.ones(2, 3)
    for method in ("grpo", "gspo"):
        plain_loss, plain = compute_policy_gradient_loss(
            advantages, policy, method, old, 0.2, mask
        )
        assert not set(plain) & {"clip_low_count", "clip_high_count"}
        split_loss, split = compute_policy_gradient_loss(
            advantages, policy, method, old, 0.2, mask, cliprange_high=0.2
        )
        assert torch.equal(plain_loss, split_loss)
        assert {k: v for k, v in split.items() if k in plain} == plain
        assert split["clip_low_count"] + split["clip_high_count"] == split["clip_count"]


def test_cispo_clips_the_weight_not_the_gradient_by_hand():
    # eps_low 0.2, eps_high 0.3 -> weights clip(w, 0.8, 1.3), detached.
    # loss = -sg(clip(w)) * A * log pi; d/dlogp = -clip(w) * A, never 0.
    policy, old = log_ratio_inputs([[2.0, 1.0], [0.5, 1.2]])
    advantages = torch.tensor([1.0, -2.0], dtype=torch.float64)
    loss, metadata = compute_policy_gradient_loss(
        advantages, policy, "cispo", old, 0.2, cliprange_high=0.3
    )
    weights = torch.tensor([[1.3, 1.0], [0.8, 1.2]], dtype=torch.float64)
    expected = -weights * advantages[:, None] * policy.detach()
    torch.testing.assert_close(loss.detach(), expected)
    loss.sum().backward()
    assert_close(policy.grad, [[-1.3, -1.0], [1.6, 2.4]])
    # Both clipped weights are counted (A's sign does not matter here).
    assert metadata["clip_high_count"].item() == 1
    assert metadata["clip_low_count"].item() == 1
    assert metadata["clip_fraction"].item() == 0.5


def test_sapo_soft_gate_by_hand():
    # loss = -(4 / tau) * sigmoid(tau (w - 1)) * A, tau = 1 (A > 0) or 2 (A <= 0).
    # d/dlogp = -A * 4 sigmoid (1 - sigmoid) * w: -A at w = 1, smaller far away.
    policy, old = log_ratio_inputs([[1.0, 3.0], [1.0, 0.5]])
    advantages = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, _ = compute_policy_gradient_loss(
        advantages,
        policy,
        "sapo",
        old,
        sapo_temperature_pos=1.0,
        sapo_temperature_neg=2.0,
    )
    sigmoid = torch.sigmoid
    expected = [
        [-4 * 0.5, -4 * sigmoid(torch.tensor(2.0)).item()],
        [2 * 0.5, 2 * sigmoid(torch.tensor(-1.0)).item()],
    ]
    assert_close(loss, expected)
    loss.sum().backward()
    s_far = sigmoid(torch.tensor(2.0)).item()
    s_low = sigmoid(torch.tensor(-1.0)).item()
    assert_close(
        policy.grad,
        [[-1.0, -4 * s_far * (1 - s_far) * 3.0], [1.0, 4 * s_low * (1 - s_low) * 0.5]],
    )


def test_gmpo_closed_form_by_hand():
    # eps 0.4 on log w. Row 0, A = +1, log w [0.1, 0.6]: the second clips to 0.4,
    #   R = exp((0.1 + 0.4) / 2) = e^0.25, loss -R; gradient R / 2 on token 0 only.
    # Row 1, A = -1, log w [-0.1, -0.6]: the second clips to -0.4 (pessimistic
    #   for A < 0), R = e^-0.25, loss R; gradient R / 2 on token 0 only.
    # Row 2, A = -1, log w [0.1, 0.6]: min keeps the unclipped (worse) ratio,
    #   R = e^0.35, loss R; gradient R / 2 on both tokens.
    log_ratio = torch.tensor(
        [[0.1, 0.6], [-0.1, -0.6], [0.1, 0.6]], dtype=torch.float64
    )
    old = torch.full_like(log_ratio, -1.0)
    policy = (log_ratio + old).requires_grad_()
    advantages = torch.tensor([1.0, -1.0, -1.0], dtype=torch.float64)
    mask = torch.ones(3, 2)
    loss, metadata = compute_policy_gradient_loss(
        advantages, policy, "gmpo", old, 0.4, mask
    )
    r0, r1, r2 = math.exp(0.25), math.exp(-0.25), math.exp(0.35)
    assert_close(loss, [[-r0, -r0], [r1, r1], [r2, r2]])
    aggregate_loss_across_microbatch(loss, mask).backward()  # mean over 3 rows
    assert_close(
        policy.grad,
        [[-r0 / 6, 0.0], [r1 / 6, 0.0], [r2 / 6, r2 / 6]],
    )
    assert metadata["clip_high_count"].item() == 1  # row 0, token 1
    assert metadata["clip_low_count"].item() == 1  # row 1, token 1
    assert metadata["clip_total"].item() == 6  # tokens


@settings(max_examples=40, deadline=None)
@given(inputs=loss_inputs())
def test_gmpo_without_clipping_is_gspo_without_clipping(inputs):
    advantages, policy, old, mask, _ = inputs
    results = []
    for method in ("gmpo", "gspo"):
        scored = policy.clone().requires_grad_()
        loss, _ = compute_policy_gradient_loss(
            advantages, scored, method, old, 50.0, mask
        )  # bounds far outside the drawn log ratios
        aggregate_loss_across_microbatch(loss, mask).backward()
        results.append((loss.detach(), scored.grad))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-12, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(inputs=loss_inputs(), normalization=st.sampled_from(["sequence", "token"]))
def test_every_objective_at_ratio_one_is_the_plain_policy_gradient(
    inputs, normalization
):
    advantages, policy, _, mask, cliprange = inputs
    reinforce = gradient_of(advantages, policy, "none", None, None, mask, normalization)
    for method in ("cispo", "sapo", "gmpo", "gspo"):
        gradient = gradient_of(
            advantages, policy, method, policy.detach(), cliprange, mask, normalization
        )
        assert torch.allclose(gradient, reinforce, atol=1e-12), method


def test_luspo_is_gspo_times_each_response_length_by_hand():
    # Lengths 3 and 1: each token carries L x the GSPO sequence loss, so the
    # sequence normalization's mean over a response is L x that loss.
    policy, old = log_ratio_inputs([[1.1, 1.0, 0.9], [1.3, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    advantages = torch.tensor([1.0, -2.0], dtype=torch.float64)
    luspo, _ = compute_policy_gradient_loss(advantages, policy, "luspo", old, 0.2, mask)
    gspo, _ = compute_policy_gradient_loss(advantages, policy, "gspo", old, 0.2, mask)
    torch.testing.assert_close(
        luspo.detach(), gspo.detach() * torch.tensor([[3.0], [1.0]])
    )
    # Row 0: s = (1.1 * 1.0 * 0.9)^(1/3), inside the clip: loss -3 s, mean -3 s.
    s0 = (1.1 * 0.9) ** (1 / 3)
    aggregated = aggregate_loss_across_microbatch(luspo, mask)
    # Row 1: w = 1.3 clipped to 1.2 for A < 0? min(-2 x 1.3, -2 x 1.2) = -2.6:
    # unclipped (pessimistic), loss 2.6 x 1 token.
    assert aggregated.item() == pytest.approx((-3 * s0 + 2.6) / 2)


def test_vespo_gamma_weight_by_hand():
    # phi(W) = e^lam W^k e^(-lam W), W = exp(sum_t log w_t); A >= 0: (k, lam) =
    # (2, 3). Row 0: W = 2 x 0.5 = 1, phi = 1: the plain policy gradient -A.
    # Row 1 (A < 0, (3, 2)): W = 1.5 x 1 = 1.5, phi = e^2 1.5^3 e^-3 = 1.2418.
    policy, old = log_ratio_inputs([[2.0, 0.5], [1.5, 1.0]])
    advantages = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, metadata = compute_policy_gradient_loss(
        advantages, policy, "vespo", old, None, torch.ones(2, 2)
    )
    phi = math.exp(2) * 1.5**3 * math.exp(-3)
    torch.testing.assert_close(
        loss.detach(), -torch.tensor([[1.0], [-phi]]).double() * policy.detach()
    )
    loss.sum().backward()  # phi is detached: d/dlogp = -phi A
    assert_close(policy.grad, [[-1.0, -1.0], [phi, phi]])
    assert metadata["importance_ratio_mean"].item() == pytest.approx(1.25)
    assert metadata["gamma_weight_mean"].item() == pytest.approx((1 + phi) / 2)


def test_dppo_trust_regions_by_hand():
    # p_old 0.5 on every token; p = 0.5 x w. eps_low 0.1, eps_high 0.2 bound
    # the shift p - p_old (TV): A > 0 keeps p - 0.5 <= 0.2, A <= 0 keeps >= -0.1.
    policy, old = log_ratio_inputs([[1.2, 1.6], [0.9, 0.7]])  # p .6 .8 / .45 .35
    advantages = torch.tensor([1.0, -1.0], dtype=torch.float64)
    options = {"cliprange": 0.1, "cliprange_high": 0.2}
    loss, metadata = compute_policy_gradient_loss(
        advantages, policy, "dppo_tv", old, **options
    )
    loss.sum().backward()  # -A sg(w) log pi on kept tokens: gradient -A w
    assert_close(policy.grad, [[-1.2, 0.0], [0.9, 0.0]])
    assert (metadata["clip_high_count"].item(), metadata["clip_low_count"].item()) == (
        1,
        1,
    )
    # Binary KL of (0.5, 0.8) = 0.5 log(0.5/0.8) + 0.5 log(0.5/0.2) = 0.2231 > 0.2:
    # dropped; of (0.5, 0.6): 0.0204, kept. A falling p for A > 0 is always kept.
    policy, old = log_ratio_inputs([[1.2, 1.6, 0.5]])
    loss, _ = compute_policy_gradient_loss(
        torch.tensor([1.0], dtype=torch.float64), policy, "dppo_kl", old, **options
    )
    loss.sum().backward()
    assert_close(policy.grad, [[-1.2, 0.0, -0.5]])
    # ratio_cap truncates the detached weight: w 1.6 -> 1.5 (A < 0, kept by TV).
    policy, old = log_ratio_inputs([[1.6]])
    loss, _ = compute_policy_gradient_loss(
        torch.tensor([-1.0], dtype=torch.float64), policy, "dppo_tv", old,
        ratio_cap=1.5, **options,
    )  # fmt: skip
    loss.sum().backward()
    assert_close(policy.grad, [[1.5]])


def test_kl_cov_penalizes_the_tokens_of_largest_covariance_by_hand():
    # Four tokens, A = [1, 1, -1, -1] per token, log pi = [-1, -3, -1, -3]:
    # cov = (A - 0)(log pi + 2) = [1, -1, -1, 1]; fraction 0.5 -> 2 tokens, the
    # two of cov 1 (tokens 0 and 3), get + coef |log w| with log w = log 2.
    old = torch.tensor([[-1.0, -3.0], [-1.0, -3.0]], dtype=torch.float64) - math.log(2)
    policy = torch.tensor([[-1.0, -3.0], [-1.0, -3.0]], dtype=torch.float64)
    advantages = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, metadata = compute_policy_gradient_loss(
        advantages, policy, "kl_cov", old, None, torch.ones(2, 2),
        covariance_fraction=0.5, kl_cov_coef=0.5,
    )  # fmt: skip
    penalty = 0.5 * math.log(2)
    assert_close(loss, [[-2.0 + penalty, -2.0], [2.0, 2.0 + penalty]])
    assert metadata["covariance_selected_mean"].item() == 0.5


def test_clip_cov_drops_one_drawn_token_among_its_band_by_hand():
    # Same covariances [1, -1, -1, 1]; band (0.5, 5): tokens 0 and 3; fraction
    # 0.25 -> one of them, drawn: its loss and gradient are 0, the rest grpo's.
    old = torch.tensor([[-1.0, -3.0], [-1.0, -3.0]], dtype=torch.float64)
    policy = old.clone().requires_grad_()  # w = 1: no PPO clip binds
    advantages = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, metadata = compute_policy_gradient_loss(
        advantages, policy, "clip_cov", old, 0.2, torch.ones(2, 2),
        covariance_fraction=0.25, clip_cov_low=0.5,
    )  # fmt: skip
    dropped = loss.detach() == 0
    assert dropped.sum() == 1 and (dropped[0, 0] or dropped[1, 1])
    assert metadata["covariance_selected_mean"].item() == 0.25


def test_off_policy_sequence_mask_by_hand():
    # Mean log(pi_old / pi) per response: row 0 (A < 0) log 2 > 0.5: dropped;
    # row 1 (A < 0) 0.1 <= 0.5: kept; row 2 (A > 0) log 2: kept.
    old = torch.tensor([[-1.0], [-1.0], [-1.0]], dtype=torch.float64)
    policy = old - torch.tensor([[math.log(2)], [0.1], [math.log(2)]])
    advantages = torch.tensor([-1.0, -1.0, 1.0], dtype=torch.float64)
    kept = off_policy_sequence_mask(
        advantages[:, None], policy, old, torch.ones(3, 1, dtype=torch.bool), 0.5
    )
    assert kept.flatten().tolist() == [False, True, True]
    loss, metadata = compute_policy_gradient_loss(
        advantages, policy, "noclip", old, off_policy_mask_threshold=0.5
    )
    assert loss[0].item() == 0 and loss[1].item() != 0
    assert metadata["off_policy_kept_mean"].item() == pytest.approx(2 / 3)
    # Without old log-probs (none) pi_old is pi: every response is kept.
    plain, _ = compute_policy_gradient_loss(advantages, policy, "none")
    masked, _ = compute_policy_gradient_loss(
        advantages, policy, "none", off_policy_mask_threshold=0.0
    )
    assert torch.equal(plain, masked)


def test_new_member_option_errors():
    def options(method="vespo", **fields):
        return ObjectiveOptions(importance_reweighting_method=method, **fields)

    cases = [
        ({"off_policy_mask_threshold": -0.1}, r"off_policy_mask_threshold must be None \(no mask\) or a finite number >= 0 .*got -0.1"),
        ({"off_policy_mask_threshold": math.nan}, r"off_policy_mask_threshold must be"),
        ({"vespo_k_pos": -1.0}, r"vespo_k_pos must be a finite number >= 0 .*got -1.0"),
        ({"vespo_lambda_neg": 0.0}, r"vespo_lambda_neg must be a finite number >= 1e-4 .*got 0.0"),
        ({"vespo_lambda_pos": math.inf}, r"vespo_lambda_pos must be"),
        ({"covariance_fraction": 0.0}, r"covariance_fraction must be a number in \(0, 1\] .*got 0.0"),
        ({"covariance_fraction": 1.5}, r"covariance_fraction must be"),
        ({"clip_cov_low": 5.0}, r"clip_cov_low must be below clip_cov_high \(5.0\), got 5.0"),
        ({"clip_cov_high": math.nan}, r"clip_cov_high must be a finite number, got nan"),
        ({"kl_cov_coef": -0.1}, r"kl_cov_coef must be a finite number >= 0, got -0.1"),
        ({"method": "dppo_tv"}, r"cliprange must be positive for 'dppo_tv'"),
        ({"method": "dppo_kl", "cliprange": 0.1, "ratio_cap": 1.0}, r"ratio_cap .*above the upper clip bound 1, got 1.0"),
        ({"method": "luspo", "cliprange": 0.1, "ratio_cap": 1.05}, r"ratio_cap .*bound 1.1, got 1.05"),
    ]  # fmt: skip
    for fields, message in cases:
        with pytest.raises(ValueError, match=message):
            options(**fields)
    # A DPPO cap only needs to be above 1 (its eps bound a divergence, not w).
    assert options("dppo_tv", cliprange=0.2, ratio_cap=1.1).ratio_cap == 1.1


def test_high_entropy_mask_by_hand():
    entropy = torch.tensor([[0.1, 0.9, 0.5, 7.0], [0.3, 0.7, 0.2, 0.8]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    # 7 masked-in entropies, sorted [.1 .2 .3 .5 .7 .8 .9]; the 1 - 0.3 = 0.7
    # quantile sits at index 0.7 * 6 = 4.2: 0.7 + 0.2 * (0.8 - 0.7) = 0.72.
    # Kept: 0.9, 0.8 (the padded 7.0 never counts).
    kept = high_entropy_mask(entropy, mask, 0.3)
    assert kept.tolist() == [[False, True, False, False], [False, False, False, True]]
    assert high_entropy_mask(entropy, mask, 1.0).tolist() == mask.bool().tolist()


def test_family_option_errors():
    policy, old, mask = torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3)
    advantages = torch.zeros(2)

    def loss(method="grpo", cliprange=0.2, response_mask=mask, **options):
        return compute_policy_gradient_loss(
            advantages, policy, method, old, cliprange, response_mask, **options
        )

    cases = [
        ({"cliprange_high": -0.1}, r"cliprange_high must be None .*got -0.1"),
        ({"cliprange_high": 0.0}, r"cliprange_high must be None .*got 0.0"),
        (
            {"ratio_cap": 1.1},
            r"ratio_cap must be None \(no cap\) or a finite number above the upper "
            r"clip bound 1.2, got 1.1",
        ),
        (
            {"ratio_cap": 1.3, "cliprange_high": 0.3},
            r"ratio_cap .*above the upper clip bound 1.3, got 1.3",
        ),
        ({"ratio_cap": float("inf")}, r"ratio_cap must be None"),
        ({"method": "cispo", "cliprange": None}, r"cliprange must be positive for 'cispo'"),
        ({"method": "gmpo", "response_mask": None}, r"response_mask must be a tensor for 'gmpo'"),
        ({"method": "sapo", "sapo_temperature_neg": 0.0}, r"sapo_temperature_neg must be a finite number > 0, got 0.0"),
        ({"method": "sapo", "sapo_temperature_pos": -1.0}, r"sapo_temperature_pos must be"),
    ]  # fmt: skip
    for overrides, message in cases:
        with pytest.raises(ValueError, match=message):
            loss(**overrides)
    with pytest.raises(
        ValueError, match=r"top_entropy_quantile must be a number in \(0, 1\]"
    ):
        high_entropy_mask(torch.zeros(2, 3), mask, 0.0)
    for bad in (-0.1, float("nan")):
        with pytest.raises(
            ValueError, match="entropy_coef must be a finite number >= 0"
        ):
            check_entropy_settings(bad, 1.0)


# --- the records ---------------------------------------------------------------------

MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0]])
ADVANTAGES = torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64)
# Without split sides, and with them (cliprange_high set; ratio_cap set).
OPTION_SETS = (
    {"cliprange": 0.2},
    {"cliprange": 0.2, "cliprange_high": 0.28},
    {"cliprange": 0.2, "ratio_cap": 3.0},
    {"cliprange": 0.2, "off_policy_mask_threshold": 0.1},
)


@pytest.fixture
def log_probs() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    policy = -torch.rand(MASK.shape, generator=generator, dtype=torch.float64)
    old = policy + 0.6 * torch.randn(
        MASK.shape, generator=generator, dtype=torch.float64
    )
    return policy.requires_grad_(), old


@pytest.mark.parametrize("method", tuple(OBJECTIVE_RECORDS))
@pytest.mark.parametrize(
    "fields", OPTION_SETS, ids=("symmetric", "high", "cap", "off-policy mask")
)
def test_each_record_names_exactly_the_keys_its_loss_returns(method, fields, log_probs):
    record = OBJECTIVE_RECORDS[method]
    if "ratio_cap" in fields and not (record.capped or record.truncates):
        fields = {"cliprange": 0.2}  # a cap is refused where it does nothing
    options = ObjectiveOptions(importance_reweighting_method=method, **fields)
    policy, old = log_probs
    _, diagnostics = objective_loss(
        options, ADVANTAGES, policy, old if record.uses_ratio else None, MASK
    )
    assert set(diagnostics) == record.diagnostic_keys(options)


def test_the_name_lists_derive_from_the_records():
    # The lists the rest of the package reads, written out once more by hand.
    new = {"luspo", "vespo", "dppo_tv", "dppo_kl", "clip_cov", "kl_cov"}
    assert {"noclip", "grpo", "gspo", "cispo", "sapo", "gmpo", *new} == RATIO_METHODS
    assert {
        "grpo", "gspo", "cispo", "gmpo", "luspo", "dppo_tv", "dppo_kl", "clip_cov"
    } == CLIPPED_METHODS  # fmt: skip
    assert {"gspo", "gmpo", "luspo"} == SEQUENCE_METHODS
    assert {"cispo", "gmpo", "dppo_tv", "dppo_kl", "clip_cov"} == SPLIT_CLIP_METHODS
    assert {"grpo", "gspo", "luspo"} == CAPPED_METHODS
    assert {"dppo_tv", "dppo_kl"} == TRUNCATED_METHODS
    assert {"clip_cov", "kl_cov"} == EVERY_ROW_METHODS
    assert {name: r.loss for name, r in OBJECTIVE_RECORDS.items()} == OBJECTIVES
    assert {
        "clip_count", "clip_total", "importance_ratio_count", *CLIP_SIDE_KEYS[:2]
    } == COUNT_KEYS  # fmt: skip


def test_a_per_sequence_record_needs_the_mask_and_a_ratio_record_old_log_probs(
    log_probs,
):
    policy, old = log_probs
    gspo = ObjectiveOptions(importance_reweighting_method="gspo", cliprange=0.2)
    with pytest.raises(ValueError, match=r"response_mask must be a tensor for 'gspo'"):
        objective_loss(gspo, ADVANTAGES, policy, old, None)
    sapo = ObjectiveOptions(importance_reweighting_method="sapo")
    with pytest.raises(ValueError, match=r"old_log_probs must be a tensor for 'sapo'"):
        objective_loss(sapo, ADVANTAGES, policy, None, MASK)


def test_options_are_checked_once_when_built():
    with pytest.raises(ValueError, match=r"cliprange must be positive for 'grpo'"):
        ObjectiveOptions(importance_reweighting_method="grpo")
    with pytest.raises(ValueError, match=r"importance_reweighting_method must be one"):
        ObjectiveOptions(importance_reweighting_method="ppo")
    with pytest.raises(ValueError, match=r"unknown objective option\(s\) \['eps'\]"):
        ObjectiveOptions.from_keywords(eps=0.2)
    with pytest.raises(TypeError):  # keywords only: no field can shift
        ObjectiveOptions("grpo", 0.2)  # type: ignore[misc]


def test_the_upper_clip_range_defaults_to_the_lower_one():
    assert effective_cliprange_high(0.2, None) == 0.2
    assert effective_cliprange_high(0.2, 0.28) == 0.28
    assert effective_cliprange_high(None, None) is None
    options = ObjectiveOptions(importance_reweighting_method="grpo", cliprange=0.2)
    assert options.high_bound == pytest.approx(1.2)
