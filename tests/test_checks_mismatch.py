"""The TIS-weight check of notebook 11: it accepts a hand-written answer, names
each usual slip, refuses the package's own function and reports a stub as not
attempted."""

from __future__ import annotations

import functools

import pytest
import torch

from grpo_lab.sampler_correction import correction_weights, sampler_correction_weights
from grpo_lab.teaching.checks import ExerciseFailed
from grpo_lab.teaching.checks.mismatch import check_tis_weights, reference_tis_weights


def tis(trainer_log_probs, sampler_log_probs, response_mask, cap):
    ratio = torch.exp(trainer_log_probs.detach() - sampler_log_probs)  # (B, T)
    return torch.where(response_mask.bool(), ratio.clamp(max=cap), 0.0)


def inverted(trainer_log_probs, sampler_log_probs, response_mask, cap):
    ratio = torch.exp(sampler_log_probs - trainer_log_probs.detach())  # (B, T)
    return torch.where(response_mask.bool(), ratio.clamp(max=cap), 0.0)


def uncapped(trainer_log_probs, sampler_log_probs, response_mask, cap):
    ratio = torch.exp(trainer_log_probs.detach() - sampler_log_probs)  # (B, T)
    return torch.where(response_mask.bool(), ratio, 0.0)


def padding_kept(trainer_log_probs, sampler_log_probs, response_mask, cap):
    return torch.exp(trainer_log_probs.detach() - sampler_log_probs).clamp(max=cap)


def fixed_cap(trainer_log_probs, sampler_log_probs, response_mask, cap):
    return tis(trainer_log_probs, sampler_log_probs, response_mask, 3.0)


def not_detached(trainer_log_probs, sampler_log_probs, response_mask, cap):
    ratio = torch.exp(trainer_log_probs - sampler_log_probs)  # (B, T)
    return ratio.clamp(max=cap) * response_mask


def stub(trainer_log_probs, sampler_log_probs, response_mask, cap):
    raise NotImplementedError()


def test_the_reference_is_hand_computed():
    # rho = exp(0.5), exp(-1.5), exp(1.5) = 4.48 -> 3; the pad position gets 0.
    trainer = torch.tensor([[-1.0, -2.0, -0.5, 0.0]])
    sampler = torch.tensor([[-1.5, -0.5, -2.0, -3.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    weights = reference_tis_weights(trainer, sampler, mask, 3.0)
    expected = torch.tensor([[0.5, -1.5, 1.5, 0.0]]).exp().clamp(max=3.0) * mask
    assert torch.allclose(weights, expected)


def test_a_hand_written_answer_passes(capsys):
    assert check_tis_weights(tis) is True
    assert "correct" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("wrong", "message"),
    [
        (inverted, "the ratio is upside down"),
        (uncapped, "was kept: truncate it"),
        (padding_kept, "response_mask 0) must get weight 0"),
        (fixed_cap, "the cap must be the argument cap"),
        (not_detached, "the weights carry a gradient"),
    ],
    ids=lambda value: getattr(value, "__name__", "message"),
)
def test_each_slip_fails_with_its_message(wrong, message):
    with pytest.raises(ExerciseFailed, match="For ") as failure:
        check_tis_weights(wrong)
    assert message in str(failure.value)


def test_a_wrong_answer_shows_a_counter_example():
    with pytest.raises(ExerciseFailed) as failure:
        check_tis_weights(inverted)
    text = str(failure.value)
    assert "rho = " in text and "expected" in text and "cap=3" in text


def test_an_unrecognised_wrong_answer_still_fails_without_a_hint():
    def halved(trainer_log_probs, sampler_log_probs, response_mask, cap):
        return tis(trainer_log_probs, sampler_log_probs, response_mask, cap) / 2

    with pytest.raises(ExerciseFailed) as failure:
        check_tis_weights(halved)
    assert "hint" not in str(failure.value)


@pytest.mark.parametrize("package", [sampler_correction_weights, correction_weights])
def test_the_package_function_is_refused(package):
    def calls_it(trainer_log_probs, sampler_log_probs, response_mask, cap):
        weights, _ = package(
            trainer_log_probs, sampler_log_probs, response_mask, mode="token_truncate"
        )
        return weights

    for student in (calls_it, functools.partial(calls_it)):
        with pytest.raises(ExerciseFailed, match="write it yourself"):
            check_tis_weights(student)


def test_a_stub_is_not_attempted(capsys):
    assert check_tis_weights(stub) is False
    assert "not attempted yet" in capsys.readouterr().out
