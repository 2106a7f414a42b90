"""Exercise checks of notebooks 06-10 accept the reference, reject plausible wrong
answers with a counter-example, and report a stub as not attempted."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from grpo_lab.losses import aggregate_loss_across_microbatch
from grpo_lab.masks import masked_mean, masked_normalize
from grpo_lab.teaching.checks.aggregation import check_aggregate_loss
from grpo_lab.teaching.checks.family import check_clip_higher_loss
from grpo_lab.teaching.checks.framework import ExerciseFailed
from grpo_lab.teaching.checks.loop import (
    check_cache_key,
    check_needs_old_log_probs,
    check_train_batch_slices,
)
from grpo_lab.teaching.checks.train_step import (
    check_active_rows,
    check_microbatch_loss_scale,
)
from grpo_lab.teaching.explorer import config_cache_key
from grpo_lab.training.config import TrainConfig


def stub(*args, **kwargs):
    raise NotImplementedError()


ALL_CHECKS = [
    check_aggregate_loss,
    check_microbatch_loss_scale,
    check_active_rows,
    check_needs_old_log_probs,
    check_train_batch_slices,
    check_cache_key,
    check_clip_higher_loss,
]


@pytest.mark.parametrize("check", ALL_CHECKS, ids=lambda c: c.__name__)
def test_a_stub_is_not_attempted(check, capsys):
    assert check(stub) is False
    assert "not attempted yet" in capsys.readouterr().out


# --- 06: aggregation ---------------------------------------------------------------


def test_aggregate_accepts_the_package_and_masked_helpers(capsys):
    assert check_aggregate_loss(aggregate_loss_across_microbatch) is True
    assert "correct" in capsys.readouterr().out

    def with_helpers(loss, mask, normalization, constant=None):
        if normalization == "sequence":
            return masked_mean(loss, mask, dim=1).mean()
        return masked_normalize(loss, mask, constant)

    assert check_aggregate_loss(with_helpers) is True


def token_mean_for_sequence(loss, mask, normalization, constant=None):
    # DAPO's token mean where GRPO's per-response mean is asked for.
    if normalization == "sequence":
        return masked_mean(loss, mask)
    return masked_normalize(loss, mask, constant)


def constant_without_mask(loss, mask, normalization, constant=None):
    if normalization == "sequence":
        return masked_mean(loss, mask, dim=1).mean()
    return loss.sum() / constant  # padding counted


def constant_by_token_count(loss, mask, normalization, constant=None):
    if normalization == "sequence":
        return masked_mean(loss, mask, dim=1).mean()
    return masked_normalize(loss, mask, mask.sum())


def per_response_vector(loss, mask, normalization, constant=None):
    return masked_mean(loss, mask, dim=1)  # forgot the mean over responses


@pytest.mark.parametrize(
    "wrong",
    [
        token_mean_for_sequence,
        constant_without_mask,
        constant_by_token_count,
        per_response_vector,
    ],
)
def test_aggregate_rejects_plausible_mistakes(wrong):
    with pytest.raises(ExerciseFailed, match="For per_token_loss="):
        check_aggregate_loss(wrong)


def test_aggregate_counter_example_names_expected_value():
    # Hand case from the check: sequence (2/1 + 3/3) / 2 = 1.5; token mean 5/4 = 1.25.
    with pytest.raises(ExerciseFailed) as failure:
        check_aggregate_loss(token_mean_for_sequence)
    assert "expected 1.5" in str(failure.value) and "1.25" in str(failure.value)


# --- 07: microbatch scale and active rows --------------------------------------------


def reference_scale(rows, batch_size, normalization):
    return rows / batch_size if normalization == "sequence" else 1.0


def test_scale_accepts_the_reference():
    assert check_microbatch_loss_scale(reference_scale) is True


@pytest.mark.parametrize(
    "wrong",
    [
        lambda rows, b, n: 1 / -(-b // rows),  # 1 / number of microbatches
        lambda rows, b, n: rows / b,  # also scales the constant normalization
        lambda rows, b, n: 1.0,  # no scale: sums microbatch means
        lambda rows, b, n: b / rows if n == "sequence" else 1.0,  # inverted
    ],
    ids=["one_over_k", "scales_constant", "no_scale", "inverted"],
)
def test_scale_rejects_plausible_mistakes(wrong):
    with pytest.raises(ExerciseFailed, match="microbatch_rows="):
        check_microbatch_loss_scale(wrong)


def test_active_rows_accepts_the_reference():
    assert check_active_rows(lambda a: torch.nonzero(a != 0).flatten()) is True
    assert check_active_rows(lambda a: torch.where(a != 0)[0]) is True


@pytest.mark.parametrize(
    "wrong",
    [
        lambda a: torch.nonzero(a > 0).flatten(),  # drops negative advantages
        lambda a: a != 0,  # a boolean mask, not indices
        lambda a: torch.nonzero(a.abs() > 1e-6).flatten(),  # a threshold
        lambda a: [i for i, v in enumerate(a.tolist()) if v != 0],  # a list
    ],
    ids=["positive_only", "bool_mask", "threshold", "list"],
)
def test_active_rows_rejects_plausible_mistakes(wrong):
    with pytest.raises(ExerciseFailed, match="advantages="):
        check_active_rows(wrong)


# --- 08: off-policy decision and train batch slices ----------------------------------


def test_needs_old_log_probs_accepts_the_reference():
    def reference(epochs, train_batch_size, rollout_batch_size):
        return epochs > 1 or train_batch_size < rollout_batch_size

    assert check_needs_old_log_probs(reference) is True


@pytest.mark.parametrize(
    "wrong",
    [
        lambda e, t, r: e > 1,  # forgets smaller train batches
        lambda e, t, r: t < r,  # forgets extra epochs
        lambda e, t, r: e > 1 and t < r,
    ],
    ids=["epochs_only", "batches_only", "and"],
)
def test_needs_old_log_probs_rejects_plausible_mistakes(wrong):
    with pytest.raises(ExerciseFailed, match="epochs_per_rollout_batch="):
        check_needs_old_log_probs(wrong)


def reference_slices(rollout_batch_size, train_batch_size, group_size):
    if train_batch_size % group_size:
        raise ValueError("group_size must divide train_batch_size")
    return [
        slice(start, start + train_batch_size)
        for start in range(0, rollout_batch_size, train_batch_size)
    ]


def test_slices_accept_the_reference():
    assert check_train_batch_slices(reference_slices) is True


def strided(rollout_batch_size, train_batch_size, group_size):
    reference_slices(rollout_batch_size, train_batch_size, group_size)
    count = rollout_batch_size // train_batch_size
    return [slice(i, None, count) for i in range(count)]  # splits every group


def no_alignment_check(rollout_batch_size, train_batch_size, group_size):
    return [
        slice(start, start + train_batch_size)
        for start in range(0, rollout_batch_size, train_batch_size)
    ]


def off_by_one(rollout_batch_size, train_batch_size, group_size):
    reference_slices(rollout_batch_size, train_batch_size, group_size)
    return [
        slice(start, start + train_batch_size - 1)
        for start in range(0, rollout_batch_size, train_batch_size)
    ]


@pytest.mark.parametrize("wrong", [strided, no_alignment_check, off_by_one])
def test_slices_reject_plausible_mistakes(wrong):
    with pytest.raises(ExerciseFailed, match="rollout_batch_size="):
        check_train_batch_slices(wrong)


# --- 09: cache key --------------------------------------------------------------------


def reference_key(config):
    kept = {k: v for k, v in config.items() if k not in ("run_dir", "resume")}
    text = json.dumps(kept, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def test_cache_key_accepts_the_reference_and_the_package_key():
    assert check_cache_key(reference_key) is True
    # The package's own key, applied to a real config with these values.
    # (an off-policy noclip run, so every variant the check makes is valid: with
    # or without a clip range, one epoch or two)
    config = TrainConfig.for_profile(
        "cpu", importance_reweighting_method="noclip", train_batch_size=128
    )

    def package_key(values):
        return config_cache_key(TrainConfig.from_dict({**config.to_dict(), **values}))

    assert check_cache_key(package_key) is True


@pytest.mark.parametrize(
    "wrong",
    [
        # Key order leaks into the hash.
        lambda c: hashlib.sha256(
            json.dumps(
                {k: v for k, v in c.items() if k not in ("run_dir", "resume")}
            ).encode()
        ).hexdigest(),
        # The run folder is part of the key: nothing is ever found again.
        lambda c: hashlib.sha256(json.dumps(c, sort_keys=True).encode()).hexdigest(),
        # Only the swept fields: different runs collide.
        lambda c: hashlib.sha256(f"{c['lr']}-{c['group_size']}".encode()).hexdigest(),
        # Python's hash(): an int, and different in every process.
        lambda c: hash(json.dumps(c, sort_keys=True)),
    ],
    ids=["unsorted", "with_run_dir", "subset", "python_hash"],
)
def test_cache_key_rejects_plausible_mistakes(wrong):
    with pytest.raises(ExerciseFailed, match="config"):
        check_cache_key(wrong)


# --- 10: clip-higher -------------------------------------------------------------


def clip_higher_reference(advantages, policy_log_probs, old_log_probs, low, high):
    ratio = torch.exp(policy_log_probs - old_log_probs)  # (B, T)
    advantages = advantages.unsqueeze(-1)  # (B, 1)
    clipped = torch.clamp(ratio, 1 - low, 1 + high)
    return -torch.minimum(ratio * advantages, clipped * advantages)


def clip_higher_symmetric(advantages, policy_log_probs, old_log_probs, low, high):
    return clip_higher_reference(advantages, policy_log_probs, old_log_probs, low, low)


def clip_higher_swapped(advantages, policy_log_probs, old_log_probs, low, high):
    return clip_higher_reference(advantages, policy_log_probs, old_log_probs, high, low)


def clip_higher_on_the_log_ratio(
    advantages, policy_log_probs, old_log_probs, low, high
):
    log_ratio = policy_log_probs - old_log_probs  # (B, T)
    advantages = advantages.unsqueeze(-1)
    clipped = torch.clamp(log_ratio, -low, high).exp()  # bounds e^-low, e^high
    return -torch.minimum(log_ratio.exp() * advantages, clipped * advantages)


def clip_higher_with_max(advantages, policy_log_probs, old_log_probs, low, high):
    ratio = torch.exp(policy_log_probs - old_log_probs)
    advantages = advantages.unsqueeze(-1)
    clipped = torch.clamp(ratio, 1 - low, 1 + high)
    return -torch.maximum(ratio * advantages, clipped * advantages)


def clip_higher_detached(advantages, policy_log_probs, old_log_probs, low, high):
    return clip_higher_reference(
        advantages, policy_log_probs.detach(), old_log_probs, low, high
    )


def test_clip_higher_check(capsys):
    assert check_clip_higher_loss(clip_higher_reference) is True
    assert "correct" in capsys.readouterr().out
    for wrong in (
        clip_higher_symmetric,
        clip_higher_swapped,
        clip_higher_on_the_log_ratio,
        clip_higher_with_max,
        clip_higher_detached,
    ):
        with pytest.raises(ExerciseFailed, match="For advantages=") as error:
            check_clip_higher_loss(wrong)
        assert "expected" in str(error.value) or "gradient" in str(error.value)
