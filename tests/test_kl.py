"""Tests for grpo_lab.kl: Schulman's k1, k2, k3 estimators of KL(pi || pi_ref)."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_lab.kl import KL_ESTIMATORS, check_kl_settings, compute_kl_penalty


def test_estimators_by_hand():
    # pi = 0.5, pi_ref = 0.25 on the sampled token: log r = log(0.25 / 0.5) = -ln 2.
    # k1 = ln 2; k2 = (ln 2)^2 / 2; k3 = 0.5 - 1 + ln 2 = ln 2 - 0.5.
    policy = torch.tensor([[math.log(0.5)]], dtype=torch.float64)
    reference = torch.tensor([[math.log(0.25)]], dtype=torch.float64)
    ln2 = math.log(2)
    expected = {"k1": ln2, "k2": ln2**2 / 2, "k3": ln2 - 0.5}
    for estimator, value in expected.items():
        kl = compute_kl_penalty(policy, reference, estimator)
        assert kl.item() == pytest.approx(value, rel=1e-12), estimator


def test_gradients_flow_through_the_policy_only():
    # d k1 / d log pi = 1; d k2 / d log pi = -log r; d k3 / d log pi = 1 - r.
    policy = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    reference = torch.tensor([[-1.5, -1.0]], dtype=torch.float64, requires_grad=True)
    log_r = (reference - policy).detach()
    expected = {"k1": torch.ones_like(log_r), "k2": -log_r, "k3": 1 - log_r.exp()}
    for estimator, gradient in expected.items():
        (grad,) = torch.autograd.grad(
            compute_kl_penalty(policy, reference, estimator).sum(), policy
        )
        torch.testing.assert_close(grad, gradient)
    kl = compute_kl_penalty(policy, reference, "k3").sum()
    assert torch.autograd.grad(kl, reference, allow_unused=True) == (None,)


def test_k2_and_k3_are_nonnegative_and_zero_at_the_reference():
    generator = torch.Generator().manual_seed(0)
    policy = torch.randn(4, 8, generator=generator).log_softmax(-1)  # <= 0
    reference = torch.randn(4, 8, generator=generator).log_softmax(-1)
    for estimator in ("k2", "k3"):
        assert (compute_kl_penalty(policy, reference, estimator) >= 0).all()
    for estimator in KL_ESTIMATORS:
        assert compute_kl_penalty(policy, policy, estimator).abs().max() == 0


def test_bfloat16_inputs_are_computed_in_float32():
    policy = torch.tensor([[-1.0]], dtype=torch.bfloat16)
    reference = policy.float() - 1e-3  # a difference bfloat16 cannot hold
    kl = compute_kl_penalty(policy, reference, "k1")
    assert kl.dtype == torch.float32
    assert kl.item() == pytest.approx(1e-3, rel=1e-3)
    both_half = compute_kl_penalty(policy, policy.clone(), "k3")
    assert both_half.dtype == torch.float32
    assert compute_kl_penalty(policy.double(), policy.double(), "k3").dtype == (
        torch.float64
    )


def test_k1_and_k3_are_unbiased_and_k3_has_the_smaller_variance():
    # Tokens sampled from pi: the mean of k1 and of k3 estimates KL(pi || pi_ref);
    # k2 is biased (its mean is not the KL); k3 varies less than k1.
    generator = torch.Generator().manual_seed(0)
    pi = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    pi_ref = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    true_kl = (pi * (pi / pi_ref).log()).sum().item()
    tokens = torch.multinomial(pi, 200_000, replacement=True, generator=generator)
    policy, reference = pi.log()[tokens][None], pi_ref.log()[tokens][None]
    estimates = {e: compute_kl_penalty(policy, reference, e) for e in KL_ESTIMATORS}
    assert estimates["k1"].mean().item() == pytest.approx(true_kl, rel=0.05)
    assert estimates["k3"].mean().item() == pytest.approx(true_kl, rel=0.05)
    assert estimates["k3"].var() < estimates["k1"].var()


def test_kl_errors():
    policy = torch.zeros(2, 3)
    with pytest.raises(
        ValueError, match=r"kl_estimator must be one of \('k1', 'k2', 'k3'\), got 'k4'"
    ):
        compute_kl_penalty(policy, policy, "k4")
    with pytest.raises(
        ValueError,
        match=r"reference_log_probs must have shape \(2, 3\) like policy_log_probs, "
        r"got \(2, 4\)",
    ):
        compute_kl_penalty(policy, torch.zeros(2, 4))
    for bad in (-0.1, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="kl_coef must be a finite number >= 0"):
            check_kl_settings(bad, "k3")
    check_kl_settings(0.0, "k1")  # no penalty is a valid setting


def test_the_door_refuses_values_no_log_prob_takes():
    """compute_kl_penalty reads every value once: a log-prob is <= 0 and not
    NaN, held in a real tensor, and k3's exp(log r) must not overflow the dtype;
    the train step's kl_estimate checks none of them."""
    from grpo_lab.kl import kl_estimate

    policy = torch.tensor([[-1.0, -2.0]])
    for name, bad in (("policy_log_probs", 0), ("reference_log_probs", 1)):
        for value in (0.5, math.inf, math.nan):
            tensors = [policy, policy.clone()]
            tensors[bad] = tensors[bad].clone()
            tensors[bad][0, 1] = value
            with pytest.raises(ValueError, match=rf"^{name} must be log-prob") as error:
                compute_kl_penalty(*tensors)
            assert f"got {value!r} at 1 of 2 positions" in str(error.value)
    assert compute_kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1)).item() == 0
    # log r = 100 - 0.0 overflows float32 (its largest is e^88.72), not float64
    low, high = torch.tensor([[-101.0]]), torch.tensor([[-1.0]])
    with pytest.raises(ValueError, match=r"must be below 88\.7 for k3 .* got 100\.0"):
        compute_kl_penalty(low, high)
    assert math.isinf(kl_estimate(low, high, "k3").item())  # what the door prevents
    assert compute_kl_penalty(low, high, "k1").item() == -100.0  # only k3 exponentiates
    wide = compute_kl_penalty(low.double(), high.double())
    assert wide.item() == pytest.approx(math.exp(100) - 101, rel=1e-12)
    with pytest.raises(ValueError, match=r"^policy_log_probs must hold values"):
        compute_kl_penalty(policy.to("meta"), policy.to("meta"))
