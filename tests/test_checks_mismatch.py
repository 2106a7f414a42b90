"""The sampler-corrected loss check of notebook 11: it accepts two differently
written answers, rejects the usual slips naming each, refuses the package's own
functions and reports a stub as not attempted."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from grpo_lab.sampler_correction import (
    correction_weights,
    sampler_correction_weights,
    sampler_weights,
    sampler_weights_and_metrics,
)
from grpo_lab.teaching.checks import ExerciseFailed
from grpo_lab.teaching.checks.mismatch import (
    check_corrected_loss,
    reference_corrected_loss,
)


def clipped_terms(policy, old, advantages, cliprange):
    ratio = torch.exp(policy - old)  # (B, T)
    a = advantages.unsqueeze(-1)  # (B, 1)
    return -torch.minimum(ratio * a, ratio.clamp(1 - cliprange, 1 + cliprange) * a)


def per_response_mean(per_token, mask):
    return ((per_token * mask).sum(1) / mask.sum(1)).mean()


def by_log_sum(policy, old, sampler, advantages, mask, cliprange, low, high):
    log_rho = torch.where(mask.bool(), old - sampler, 0.0).sum(1, keepdim=True)
    rho = log_rho.exp()  # (B, 1)
    weight = torch.where((rho >= low) & (rho <= high), rho, 0.0).detach()
    terms = clipped_terms(policy, old, advantages, cliprange) * weight
    return per_response_mean(terms, mask)


def by_product(policy, old, sampler, advantages, mask, cliprange, low, high):
    # Written another way: a product of the token ratios, 1 off the response,
    # a boolean mask of the kept rows, and the per-row mean taken by masked_select.
    token_ratio = torch.exp(old.detach() - sampler)
    rho = torch.where(mask == 1, token_ratio, torch.ones_like(token_ratio)).prod(1)
    kept = ((rho >= low) & (rho <= high)).double()  # (B,)
    weight = (rho * kept).unsqueeze(1)
    terms = clipped_terms(policy, old, advantages, cliprange) * weight
    rows = [terms[i][mask[i].bool()].mean() for i in range(mask.shape[0])]
    return torch.stack(rows).mean()


def _with_rho(rho_of):
    def loss(policy, old, sampler, advantages, mask, cliprange, low, high):
        rho = rho_of(old, sampler, mask)
        weight = torch.where((rho >= low) & (rho <= high), rho, 0.0).detach()
        terms = clipped_terms(policy, old, advantages, cliprange) * weight
        return per_response_mean(terms, mask)

    return loss


def _masked_gap(old, sampler, mask):
    return torch.where(mask.bool(), old - sampler, 0.0)


upside_down = _with_rho(lambda o, s, m: (-_masked_gap(o, s, m)).sum(1, True).exp())
token_level = _with_rho(lambda o, s, m: _masked_gap(o, s, m).exp())
geometric_mean = _with_rho(
    lambda o, s, m: (_masked_gap(o, s, m).sum(1, True) / m.sum(1, True)).exp()
)
padding_counted = _with_rho(lambda o, s, m: (o - s).sum(1, True).exp())


def uncorrected(policy, old, sampler, advantages, mask, cliprange, low, high):
    return per_response_mean(clipped_terms(policy, old, advantages, cliprange), mask)


def weight_not_detached(policy, old, sampler, advantages, mask, cliprange, low, high):
    # rho_seq taken from the policy itself (pi / pi_sampler): the same value at
    # pi = pi_old would still differ, and its gradient flows through the weight.
    log_rho = torch.where(mask.bool(), policy - sampler, 0.0).sum(1, keepdim=True)
    rho = log_rho.exp()
    weight = torch.where((rho >= low) & (rho <= high), rho, 0.0)
    terms = clipped_terms(policy, old, advantages, cliprange) * weight
    return per_response_mean(terms, mask)


def weight_with_gradient(policy, old, sampler, advantages, mask, cliprange, low, high):
    # The right value, but the weight carries a gradient to policy_log_probs.
    log_rho = torch.where(mask.bool(), old - sampler, 0.0).sum(1, keepdim=True)
    rho = log_rho.exp() * torch.exp(policy - policy.detach())[:, :1]
    weight = torch.where((rho >= low) & (rho <= high), rho, 0.0)
    terms = clipped_terms(policy, old, advantages, cliprange) * weight
    return per_response_mean(terms, mask)


def test_two_written_answers_pass(capsys):
    assert check_corrected_loss(by_log_sum) is True
    assert "correct ✔ (2 of 2 cases passed)" in capsys.readouterr().out
    assert check_corrected_loss(by_product) is True


def test_the_reference_masks_the_response_whose_product_leaves_the_range():
    # One response: log-ratios 0.8 and 0.7 (each token's ratio below 3), rho_seq
    # e^1.5 = 4.48 > 3: masked out, so its loss is 0 and so is its gradient.
    old = torch.full((1, 2), -1.0, dtype=torch.float64)
    sampler = old - torch.tensor([[0.8, 0.7]]).double()
    policy = (old + 0.1).requires_grad_(True)
    mask = torch.ones(1, 2)
    loss = reference_corrected_loss(
        policy, old, sampler, torch.tensor([1.0]).double(), mask, 0.2, 0.0, 3.0
    )
    loss.backward()
    assert loss.item() == 0.0 and policy.grad.abs().max().item() == 0.0


@pytest.mark.parametrize(
    ("wrong", "message"),
    [
        (upside_down, "upside down"),
        (token_level, "not token by token"),
        (geometric_mean, "not their geometric mean"),
        (padding_counted, "must not enter rho_seq"),
        (uncorrected, "no correction"),
        (weight_with_gradient, "the sampler weight rescales each token's gradient"),
        (weight_not_detached, "For advantages="),
    ],
    ids=[
        "upside_down",
        "token_level",
        "geometric_mean",
        "padding",
        "uncorrected",
        "weight_with_gradient",
        "weight_from_the_policy",
    ],
)
def test_each_slip_fails_with_its_message(wrong, message):
    with pytest.raises(ExerciseFailed, match="cases passed") as failure:
        check_corrected_loss(wrong)
    assert message in str(failure.value)
    assert failure.value.cases_run == 2 and failure.value.cases_passed < 2


def by_math_log(policy, old, sampler, advantages, mask, cliprange, low, high):
    # The range compared in log space: math.log(0) raises at low = 0.
    log_rho = torch.where(mask.bool(), old - sampler, 0.0).sum(1, keepdim=True)
    kept = (log_rho >= math.log(low)) & (log_rho <= math.log(high))
    weight = torch.where(kept, log_rho.exp(), 0.0).detach()
    terms = clipped_terms(policy, old, advantages, cliprange) * weight
    return per_response_mean(terms, mask)


def test_math_log_of_a_zero_bound_is_named():
    with pytest.raises(ExerciseFailed, match=r"math\.log\(low\) fails at low = 0"):
        check_corrected_loss(by_math_log)


def test_an_unrecognised_wrong_answer_still_fails_with_a_counter_example():
    def halved(*args):
        return 0.5 * by_log_sum(*args)

    with pytest.raises(ExerciseFailed, match="For advantages=") as failure:
        check_corrected_loss(halved)
    assert "expected" in str(failure.value)


@pytest.mark.parametrize("package", [sampler_correction_weights, correction_weights])
def test_the_package_weights_are_refused(package):
    def calls_it(policy, old, sampler, advantages, mask, cliprange, low, high):
        weights, _ = package(
            old, sampler, mask, mode="sequence_mask", low=low, high=high
        )
        terms = clipped_terms(policy, old, advantages, cliprange) * weights
        return per_response_mean(terms, mask)

    for student in (calls_it, functools.partial(calls_it)):
        with pytest.raises(ExerciseFailed, match="write it yourself"):
            check_corrected_loss(student)


@pytest.mark.parametrize("package", [sampler_weights, sampler_weights_and_metrics])
def test_the_unchecked_forms_of_the_weights_are_refused(package):
    def calls_it(policy, old, sampler, advantages, mask, cliprange, low, high):
        weights, _ = package(old, sampler, mask, "sequence_mask", 1.0, low, high)
        terms = clipped_terms(policy, old, advantages, cliprange) * weights
        return per_response_mean(terms, mask)

    with pytest.raises(ExerciseFailed, match="write it yourself"):
        check_corrected_loss(calls_it)


def test_a_stub_is_not_attempted(capsys):
    def stub(*args):
        raise NotImplementedError()

    assert check_corrected_loss(stub) is False
    assert "not attempted yet" in capsys.readouterr().out
