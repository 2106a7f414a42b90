"""Exercise checks of notebooks 06-10 and 12 accept the reference, reject plausible wrong
answers with a counter-example, and report a stub as not attempted."""

from __future__ import annotations

import functools

import pytest
import torch

from grpo_lab.aggregation import aggregate_loss_across_microbatch
from grpo_lab.kl import compute_kl_penalty
from grpo_lab.logprobs import get_response_log_probs
from grpo_lab.masks import masked_mean, masked_normalize
from grpo_lab.teaching.checks.aggregation import check_aggregate_loss, check_grpo_loss
from grpo_lab.teaching.checks.family import check_dapo_kl_loss
from grpo_lab.teaching.checks.framework import ExerciseFailed
from grpo_lab.teaching.checks.loop import (
    check_cache_key,
    check_rollout_batch_update,
    check_train_batch_slices,
)
from grpo_lab.teaching.checks.scaling import check_device_token_loss
from grpo_lab.teaching.checks.train_step import (
    check_active_rows,
    check_microbatch_losses,
    check_microbatch_train_step,
)
from grpo_lab.teaching.explorer import config_cache_key
from grpo_lab.training.config import TrainConfig


def stub(*args, **kwargs):
    raise NotImplementedError()


ALL_CHECKS = [
    check_aggregate_loss,
    check_grpo_loss,
    check_microbatch_train_step,
    check_microbatch_losses,
    check_active_rows,
    check_rollout_batch_update,
    check_train_batch_slices,
    check_cache_key,
    check_dapo_kl_loss,
    check_device_token_loss,
]


@pytest.mark.parametrize("check", ALL_CHECKS, ids=lambda c: c.__name__)
def test_a_stub_is_not_attempted(check, capsys):
    assert check(stub) is False
    assert "not attempted yet" in capsys.readouterr().out


# --- 06: aggregation ---------------------------------------------------------------


def aggregate_with_helpers(loss, mask, normalization, constant=None):
    if normalization == "sequence":
        return masked_mean(loss, mask, dim=1).mean()
    if normalization == "token":
        return masked_mean(loss, mask)
    return masked_normalize(loss, mask, constant)


def test_aggregate_accepts_masked_helpers_and_refuses_the_package(capsys):
    assert check_aggregate_loss(aggregate_with_helpers) is True
    assert "correct" in capsys.readouterr().out
    with pytest.raises(ExerciseFailed, match="write it yourself: this check compares"):
        check_aggregate_loss(aggregate_loss_across_microbatch)


def test_aggregate_compares_each_tokens_weight():
    def right_value_wrong_weights(loss, mask, normalization, constant=None):
        value = aggregate_with_helpers(loss, mask, normalization, constant)
        return value.detach() + 0.0 * loss.sum()  # a gradient, but all zero

    with pytest.raises(ExerciseFailed, match=r"gradient w\.r\.t\. per_token_loss"):
        check_aggregate_loss(right_value_wrong_weights)


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


# --- 06b: the scalar GRPO loss ------------------------------------------------------


def grpo_loss_reference(policy, old, advantages, mask, eps, normalization, c=None):
    ratio = torch.exp(policy - old)  # (B, T)
    a = advantages.unsqueeze(-1)  # (B, 1)
    per_token = -torch.minimum(ratio * a, ratio.clamp(1 - eps, 1 + eps) * a)
    return aggregate_with_helpers(per_token, mask, normalization, c)


def test_grpo_loss_accepts_the_reference(capsys):
    assert check_grpo_loss(grpo_loss_reference) is True
    assert "correct" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("wrong", "message"),
    [
        (
            lambda p, o, a, m, eps, n, c=None: grpo_loss_reference(
                p, o, a, m, float("inf"), n, c
            ),
            "the clip is left out",
        ),
        (
            lambda p, o, a, m, eps, n, c=None: grpo_loss_reference(
                p, o, a, torch.ones_like(m), eps, n, c
            ),
            "response_mask is not",
        ),
        (
            lambda p, o, a, m, eps, n, c=None: (
                -grpo_loss_reference(p, o, a, m, eps, n, c)
            ),
            "sign is flipped",
        ),
        (
            lambda p, o, a, m, eps, n, c=None: grpo_loss_reference(
                p, o, a, m, eps, "token" if n == "sequence" else n, c
            ),
            "token mean is taken instead",
        ),
        (
            lambda p, o, a, m, eps, n, c=None: grpo_loss_reference(
                p.detach(), o, a, m, eps, n, c
            ),
            "carries no gradient",
        ),
        (
            lambda p, o, a, m, eps, n, c=None: grpo_loss_reference(
                p, o, a.abs(), m, eps, n, c
            ),
            "expected",
        ),
    ],
    ids=["no_clip", "no_mask", "sign", "token_mean", "detached", "abs_advantage"],
)
def test_grpo_loss_names_the_classic_mistakes(wrong, message):
    with pytest.raises(ExerciseFailed, match=message) as failure:
        check_grpo_loss(wrong)
    assert "For token ratios=" in str(failure.value)


# --- 07c: the microbatch train step ---------------------------------------------------


def make_train_step(
    scale="share",
    step_each=False,
    clip_each=False,
    zero_each=False,
    clip=True,
    split="ceil",
    sign=1.0,
):
    def train_step(model, optimizer, batch, advantages, steps, max_grad_norm):
        optimizer.zero_grad(set_to_none=True)
        batch_size = advantages.shape[0]
        size = {"ceil": -(-batch_size // steps), "k_as_size": steps}[split]
        microbatches = torch.arange(batch_size).split(size)
        for rows in microbatches:
            if zero_each:
                optimizer.zero_grad()
            log_probs = get_response_log_probs(
                model, batch["input_ids"][rows], batch["labels"][rows]
            )["log_probs"]  # (b, T)
            per_token = -sign * advantages[rows].unsqueeze(-1) * log_probs
            loss = masked_mean(per_token, batch["response_mask"][rows], dim=1).mean()
            factor = {
                "share": len(rows) / batch_size,
                "none": 1.0,
                "configured": len(microbatches[0]) / batch_size,
            }.get(scale, 1 / len(microbatches))
            (loss * factor).backward()
            if clip_each and max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            if step_each:
                optimizer.step()
        if clip and max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        if not step_each:
            optimizer.step()

    return train_step


def train_step_by_token_sums(model, optimizer, batch, advantages, steps, norm):
    # Written another way: each response's token sum over its own length, over
    # B, summed by slicing ranges; the clip and the step once at the end.
    optimizer.zero_grad()
    batch_size = advantages.shape[0]
    size = (batch_size + steps - 1) // steps
    for start in range(0, batch_size, size):
        stop = min(start + size, batch_size)
        log_probs = get_response_log_probs(
            model, batch["input_ids"][start:stop], batch["labels"][start:stop]
        )["log_probs"]  # (b, T)
        mask = batch["response_mask"][start:stop].float()  # (b, T)
        per_response = (log_probs * mask).sum(dim=1) / mask.sum(dim=1)  # (b,)
        (-(advantages[start:stop] * per_response).sum() / batch_size).backward()
    if norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), norm)
    optimizer.step()


def test_train_step_accepts_the_reference(capsys):
    assert check_microbatch_train_step(make_train_step()) is True
    assert "correct ✔ (6 of 6 cases passed)" in capsys.readouterr().out
    assert check_microbatch_train_step(train_step_by_token_sums) is True


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"scale": "none"}, "no scale: each microbatch's mean loss"),
        ({"scale": "one_over_k"}, "scaled by 1/K = 1/2 instead of its share"),
        ({"step_each": True}, "optimizer.step\\(\\) was called 2 times"),
        ({"clip_each": True}, "clipped before every microbatch"),
        ({"zero_each": True}, "zero the gradients once, before the loop"),
        ({"clip": False}, "clip the accumulated gradient once"),
        ({"scale": "configured"}, "scaled by the configured size"),
        ({"split": "k_as_size"}, "K is how many microbatches, not how many rows"),
        ({"sign": -1.0}, "the sign is flipped"),
    ],
    ids=[
        "no_scale",
        "one_over_k",
        "step_each",
        "clip_each",
        "zero_each",
        "no_clip",
        "configured_size",
        "k_as_size",
        "sign",
    ],
)
def test_train_step_names_the_classic_mistakes(options, message):
    with pytest.raises(ExerciseFailed, match=message) as failure:
        check_microbatch_train_step(make_train_step(**options))
    assert failure.value.cases_run == 6
    assert f"{failure.value.cases_passed} of 6 cases passed" in str(failure.value)


def test_the_configured_size_passes_only_the_even_and_zero_advantage_splits():
    # Even splits (B=4 in 2 or 1) and rows (0, 1, 2), whose short microbatch holds
    # the zero advantage, cannot tell the configured size from each row's share;
    # rows (1, 2, 3) and (3, 0, 1) put a nonzero advantage alone in the short one.
    with pytest.raises(ExerciseFailed, match="B=3 responses") as failure:
        check_microbatch_train_step(make_train_step(scale="configured"))
    assert failure.value.cases_passed == 4


def test_train_step_refuses_a_loss_without_gradient():
    def scored_without_gradient(model, optimizer, batch, advantages, steps, norm):
        with torch.no_grad():
            make_train_step()(model, optimizer, batch, advantages, steps, norm)

    with pytest.raises(ExerciseFailed, match="carries no gradient to the model"):
        check_microbatch_train_step(scored_without_gradient)


def test_train_step_refuses_the_whole_batch_in_one_forward():
    # The right gradient from one forward of every row: the memory K is for.
    def one_forward(model, optimizer, batch, advantages, steps, max_grad_norm):
        make_train_step()(model, optimizer, batch, advantages, 1, max_grad_norm)

    with pytest.raises(ExerciseFailed, match="a forward pass of 4 rows, where"):
        check_microbatch_train_step(one_forward)


def test_train_step_refuses_the_package_step():
    from grpo_lab.train_step import policy_gradient_update

    def wrapper(model, optimizer, batch, advantages, steps, max_grad_norm):
        return policy_gradient_update(
            model, optimizer, steps, max_grad_norm, batch, advantages
        )

    with pytest.raises(ExerciseFailed, match="policy_gradient_update"):
        check_microbatch_train_step(wrapper)


# --- 07a: the losses of gradient accumulation --------------------------------------


def make_microbatch_losses(
    split="ceil", scale="share", token_scale="tokens", constant_scale="one"
):
    def microbatch_losses(per_token_loss, mask, steps, normalization, constant=None):
        batch_size = per_token_loss.shape[0]
        size = -(-batch_size // steps) if split == "ceil" else batch_size // steps
        microbatches = torch.arange(batch_size).split(size)
        if split == "tensor_split":
            microbatches = torch.arange(batch_size).tensor_split(steps)
        losses = []
        for rows in microbatches:
            loss, m = per_token_loss[rows], mask[rows]
            if normalization == "sequence":
                mean = masked_mean(loss, m, dim=1).mean()
                factor = {"share": len(rows) / batch_size, "none": 1.0}.get(
                    scale, 1 / len(microbatches)
                )
            elif normalization == "token":
                mean = masked_mean(loss, m)
                factor = {
                    "tokens": m.sum() / mask.sum(),
                    "rows": len(rows) / batch_size,
                }[token_scale]
            else:
                mean = masked_normalize(loss, m, constant)
                factor = 1.0 if constant_scale == "one" else len(rows) / batch_size
            losses.append(mean * factor)
        return losses

    return microbatch_losses


def microbatch_losses_by_weights(per_token_loss, mask, steps, normalization, c=None):
    # Written another way: notebook 06's effective weight of every token in the
    # full-batch loss, then each microbatch sums its own rows' weighted losses.
    mask = mask.float()  # (B, T)
    if normalization == "sequence":
        weight = mask / (mask.sum(dim=1, keepdim=True) * mask.shape[0])  # (B, T)
    elif normalization == "token":
        weight = mask / mask.sum()
    else:
        weight = mask / c
    size = (mask.shape[0] + steps - 1) // steps
    return [
        (per_token_loss[start : start + size] * weight[start : start + size]).sum()
        for start in range(0, mask.shape[0], size)
    ]


def test_microbatch_losses_accepts_two_ways_of_writing_it(capsys):
    assert check_microbatch_losses(make_microbatch_losses()) is True
    assert "correct ✔ (7 of 7 cases passed)" in capsys.readouterr().out
    assert check_microbatch_losses(microbatch_losses_by_weights) is True


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"scale": "one_over_k"}, "scaled by 1/K = 1/2 instead of each microbatch"),
        ({"scale": "none"}, "no scale: each microbatch's own loss"),
        ({"token_scale": "rows"}, "under the token mean a microbatch counts for"),
        ({"constant_scale": "rows"}, "under the constant normalization each"),
        ({"split": "floor"}, "expected 2 losses, one per microbatch of ceil"),
        ({"split": "tensor_split"}, r"microbatches of \[3, 2, 2\] rows"),
    ],
    ids=[
        "one_over_k",
        "no_scale",
        "token_by_rows",
        "constant_by_rows",
        "floor",
        "tensor_split",
    ],
)
def test_microbatch_losses_names_the_classic_mistakes(options, message):
    with pytest.raises(ExerciseFailed, match=message) as failure:
        check_microbatch_losses(make_microbatch_losses(**options))
    assert failure.value.cases_run == 7


def test_microbatch_losses_refuses_a_gradient_from_other_rows():
    # Right values, but every microbatch's loss is the full batch's loss times
    # its share: backward would need the whole batch in memory at once.
    def from_the_whole_batch(per_token_loss, mask, steps, normalization, c=None):
        right = make_microbatch_losses()(per_token_loss, mask, steps, normalization, c)
        total = sum(right)
        return [total * (x.detach() / total.detach()) for x in right]

    with pytest.raises(ExerciseFailed, match=r"gradient w\.r\.t\. per_token_loss"):
        check_microbatch_losses(from_the_whole_batch)


def test_microbatch_losses_refuses_detached_losses():
    def detached(per_token_loss, mask, steps, normalization, c=None):
        losses = make_microbatch_losses()(per_token_loss, mask, steps, normalization, c)
        return [loss.detach() for loss in losses]

    with pytest.raises(ExerciseFailed, match="carries no gradient"):
        check_microbatch_losses(detached)


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


# --- 08: train batch slices and the update of one rollout batch -------------------


def group_slices(rollout_batch_size, train_batch_size):
    return [
        slice(start, start + train_batch_size)
        for start in range(0, rollout_batch_size, train_batch_size)
    ]


def make_update(
    *,
    old_when="off_policy",
    on_policy_loss="plain",
    epochs_outside=True,
    normalization="sequence",
    whole_batch=False,
):
    """An update of one rollout batch, right by default, with one slip chosen."""

    def update(score, step, advantages, mask, group_size, train_size, epochs, eps):
        size = advantages.shape[0]
        batches = group_slices(size, size if whole_batch else train_size)
        off_policy = epochs > 1 or len(batches) > 1
        old = None
        if old_when == "always" or (old_when == "off_policy" and off_policy):
            with torch.no_grad():
                old = score(slice(0, size))

        def one_step(rows, epoch):
            nonlocal old
            if old_when == "each_epoch" and off_policy and rows == batches[0]:
                with torch.no_grad():
                    old = score(slice(0, size))  # scored again every epoch
            log_probs = score(rows)  # (b, T)
            a = advantages[rows].unsqueeze(-1)  # (b, 1)
            if old_when == "each_batch" and off_policy:
                reference = log_probs.detach()  # scored again after each update
            elif on_policy_loss == "trl" and old is None:
                reference = log_probs.detach()  # TRL: old = log_probs.detach()
            else:
                reference = None if old is None else old[rows]
            plain = not off_policy and on_policy_loss == "plain"
            if reference is None or plain:
                per_token = -a * log_probs
            else:
                reference = log_probs.detach() if reference is None else reference
                ratio = torch.exp(log_probs - reference)
                clipped = ratio.clamp(1 - eps, 1 + eps)
                per_token = -torch.minimum(ratio * a, clipped * a)
            m = mask[rows]
            if normalization == "token":
                step((per_token * m).sum() / m.sum())
            else:
                step(masked_mean(per_token, m, dim=1).mean())

        schedule = (
            [(rows, epoch) for epoch in range(epochs) for rows in batches]
            if epochs_outside
            else [(rows, epoch) for rows in batches for epoch in range(epochs)]
        )
        for rows, epoch in schedule:
            one_step(rows, epoch)

    return update


def update_per_batch_old(
    score, step, advantages, mask, group_size, train_size, epochs, eps, *, package=False
):
    # Written another way: the slices of Exercise 1, old log-probs scored per
    # train batch but all before the first update, the clip by torch.where, the
    # per-response mean by masked_mean. With ``package``, the package's loss
    # pieces (Exercises 04 and 06, which this one composes) instead.
    from grpo_lab.aggregation import aggregate_loss_across_microbatch
    from grpo_lab.losses import compute_policy_gradient_loss

    batches = reference_slices(advantages.shape[0], train_size, group_size)
    off_policy = epochs * len(batches) > 1
    with torch.no_grad():
        old = [score(rows) for rows in batches] if off_policy else None
    for _ in range(epochs):
        for index, rows in enumerate(batches):
            log_probs = score(rows)  # (b, T)
            if package:
                per_token, _ = compute_policy_gradient_loss(
                    advantages[rows],
                    log_probs,
                    "grpo" if off_policy else "none",
                    None if old is None else old[index],
                    eps,
                    mask[rows],
                )
                step(
                    aggregate_loss_across_microbatch(per_token, mask[rows], "sequence")
                )
                continue
            a = advantages[rows][:, None]  # (b, 1)
            ratio = torch.exp(
                log_probs - (log_probs if old is None else old[index]).detach()
            )
            kept = torch.where(
                a > 0, ratio.clamp(max=1 + eps), ratio.clamp(min=1 - eps)
            )
            per_token = -torch.minimum(ratio * a, kept * a)  # (b, T)
            step(masked_mean(per_token, mask[rows], dim=1).mean())


def test_the_update_accepts_two_written_answers(capsys):
    assert check_rollout_batch_update(make_update()) is True
    assert "correct ✔ (4 of 4 cases passed)" in capsys.readouterr().out
    assert check_rollout_batch_update(update_per_batch_old) is True


def test_the_update_refuses_the_package_pieces_it_composes():
    composed = functools.partial(update_per_batch_old, package=True)
    with pytest.raises(ExerciseFailed, match="is not available while this exercise"):
        check_rollout_batch_update(composed)


def test_the_update_accepts_the_clipped_form_on_policy_as_trl_writes_it():
    # On-policy, old = log_probs.detach(): the loss's value is A-free of log pi,
    # its gradient and the parameters after the step are the plain one's.
    assert check_rollout_batch_update(make_update(on_policy_loss="trl")) is True


@pytest.mark.parametrize(
    ("slip", "passed", "message"),
    [
        # Never off-policy: the ratio is 1 at every step.
        ({"old_when": "never"}, 1, "the ratio is 1 at every step"),
        # Old log-probs scored again before each train batch: the ratio is 1.
        ({"old_when": "each_batch"}, 1, "the ratio is 1 at every step"),
        # Old log-probs scored again at the start of each epoch.
        ({"old_when": "each_epoch"}, 2, "scored again at the start of each epoch"),
        # Old log-probs on a one-step batch: the right steps, a wasted pass.
        ({"old_when": "always"}, 3, "rows were scored where"),
        # On-policy as a clipped ratio against a scored copy: a wasted pass.
        ({"old_when": "always", "on_policy_loss": "ratio"}, 3, "rows were scored"),
        # Each train batch's epochs run back to back.
        ({"epochs_outside": False}, 3, "epochs ran back to back"),
        # DAPO's token mean instead of GRPO's per-response mean.
        ({"normalization": "token"}, 0, "the gradient of optimizer step 1"),
        # One optimizer step per epoch on the whole rollout batch.
        ({"whole_batch": True}, 2, "optimizer steps (one per train batch"),
    ],
    ids=[
        "never_old",
        "old_each_batch",
        "old_each_epoch",
        "old_on_policy",
        "ratio_on_policy",
        "epochs_inside",
        "token_mean",
        "whole_batch",
    ],
)
def test_the_update_rejects_plausible_mistakes(slip, passed, message):
    with pytest.raises(ExerciseFailed, match="For rollout_batch_size=") as failure:
        check_rollout_batch_update(make_update(**slip))
    assert message in str(failure.value)
    assert (failure.value.cases_passed, failure.value.cases_run) == (passed, 4)


def test_the_update_refuses_a_loss_without_gradient():
    def detached(score, step, advantages, mask, *rest):
        with torch.no_grad():
            loss = -(advantages.unsqueeze(-1) * score(slice(None)) * mask).mean()
        step(loss)

    with pytest.raises(ExerciseFailed, match="carries no gradient"):
        check_rollout_batch_update(detached)


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


def notebook_functions(source):
    """The functions a notebook cell defines (module ``__main__``, as in a kernel)."""
    names = {"__name__": "__main__"}
    exec(source, names)
    return names


KEYS = notebook_functions(
    """
import hashlib
import json


def _kept(config):
    return {k: v for k, v in config.items() if k not in ("run_dir", "resume")}


def reference_key(config):
    text = json.dumps(_kept(config), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def canonical(value):
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{canonical(value[k])}" for k in sorted(value)) + "}"
    return repr(value)


def md5_of_sorted_items(config):
    # Written another way: a hand-made canonical text and another digest.
    return hashlib.md5(canonical(_kept(config)).encode()).hexdigest()


def unsorted(config):
    # Key order leaks into the hash.
    return hashlib.sha256(json.dumps(_kept(config)).encode()).hexdigest()


def with_run_dir(config):
    # The run folder is part of the key: nothing is ever found again.
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


def subset(config):
    # Only the swept fields: different runs collide.
    return hashlib.sha256(f"{config['lr']}-{config['group_size']}".encode()).hexdigest()


def python_hash(config):
    # Python's hash() as hex digits: right in one process, different in the next.
    return format(hash(json.dumps(_kept(config), sort_keys=True)) % 2**64, "016x")


def python_hash_int(config):
    return hash(json.dumps(_kept(config), sort_keys=True))


def package_key_in_the_fresh_process(config):
    # Its own key here; the package's key in the check's fresh process.
    import os

    if os.environ.get("PYTHONHASHSEED") not in ("1", "2"):
        return reference_key(config)
    import importlib

    from grpo_lab.training.config import TrainConfig

    explorer = importlib.import_module("grpo_lab.teaching.explorer")
    return explorer.config_cache_key(TrainConfig.from_dict(dict(config)))
"""
)


def test_cache_key_accepts_two_written_answers(capsys):
    assert check_cache_key(KEYS["reference_key"]) is True
    assert "correct ✔ (10 of 10 cases passed)" in capsys.readouterr().out
    assert check_cache_key(KEYS["md5_of_sorted_items"]) is True


def test_cache_key_refuses_the_package_key():
    # The package's own key, applied to a real config with these values.
    # (an off-policy noclip run, so every variant the check makes is valid: with
    # or without a clip range, one epoch or two)
    config = TrainConfig.for_profile(
        "cpu", importance_reweighting_method="noclip", train_batch_size=128
    )

    def package_key(values):
        return config_cache_key(TrainConfig.from_dict({**config.to_dict(), **values}))

    with pytest.raises(ExerciseFailed, match=r"grpo_lab\.teaching\.explorer"):
        check_cache_key(package_key)


@pytest.mark.parametrize(
    ("wrong", "message"),
    [
        ("unsorted", "keys in another order"),
        ("with_run_dir", "expected the same key"),
        ("subset", "expected a different key"),
        ("python_hash", "fresh Python process \\(PYTHONHASHSEED=1\\)"),
        ("python_hash_int", "expected a hexadecimal string"),
    ],
)
def test_cache_key_rejects_plausible_mistakes(wrong, message):
    with pytest.raises(ExerciseFailed, match=message) as failure:
        check_cache_key(KEYS[wrong])
    assert failure.value.cases_run == 10


def test_the_fresh_process_hides_the_package_key_too():
    # The fresh process imports the package's key only when the student's
    # function does, and then meets the stub.
    with pytest.raises(ExerciseFailed, match="config_cache_key is not available"):
        check_cache_key(KEYS["package_key_in_the_fresh_process"])


def test_the_built_in_hash_passes_every_case_but_the_fresh_process():
    with pytest.raises(ExerciseFailed, match="9 of 10 cases passed"):
        check_cache_key(KEYS["python_hash"])


# --- 10: DAPO's loss with a KL penalty ---------------------------------------------


def dapo_surrogate(policy, old, advantages, low, high):
    ratio = torch.exp(policy - old)  # (B, T)
    a = advantages.unsqueeze(-1)  # (B, 1)
    return -torch.minimum(ratio * a, ratio.clamp(1 - low, 1 + high) * a), ratio


def dapo_kl_by_hand(policy, old, reference, advantages, mask, low, high, beta):
    surrogate, ratio = dapo_surrogate(policy, old, advantages, low, high)
    log_r = reference - policy
    k3 = log_r.exp() - log_r - 1
    return ((surrogate + beta * ratio * k3) * mask).sum() / mask.sum()


def dapo_kl_with_pieces(policy, old, reference, advantages, mask, low, high, beta):
    # Written another way: the package's k3, a torch.where clip, the token mean
    # of the surrogate and of the weighted penalty taken apart.
    ratio = (policy - old).exp()
    a = advantages[:, None]
    clipped = torch.where(ratio > 1 + high, 1 + high, ratio)
    clipped = torch.where(clipped < 1 - low, 1 - low, clipped)
    surrogate = torch.maximum(-ratio * a, -clipped * a)
    penalty = compute_kl_penalty(policy, reference, "k3") * ratio
    keep = mask.bool()
    return surrogate[keep].mean() + beta * penalty[keep].mean()


def _dapo_variant(**change):
    def loss(policy, old, reference, advantages, mask, low, high, beta):
        surrogate, ratio = dapo_surrogate(
            policy, old, advantages, low, low if change.get("symmetric") else high
        )
        estimator = change.get("estimator", "k3")
        kl = compute_kl_penalty(policy, reference, estimator)
        weight = 1.0 if change.get("unweighted") or estimator == "k2" else ratio
        weight = ratio.detach() if change.get("detached_ratio") else weight
        sign = -1.0 if change.get("flipped") else 1.0
        per_token = surrogate + sign * beta * weight * kl
        if change.get("sequence_mean"):
            return masked_mean(per_token, mask, dim=1).mean()
        if change.get("kl_unmasked"):
            return (surrogate * mask).sum() / mask.sum() + beta * (weight * kl).mean()
        return (per_token * mask).sum() / mask.sum()

    return loss


def test_the_dapo_kl_loss_accepts_two_written_answers(capsys):
    assert check_dapo_kl_loss(dapo_kl_by_hand) is True
    assert "correct ✔ (3 of 3 cases passed)" in capsys.readouterr().out
    assert check_dapo_kl_loss(dapo_kl_with_pieces) is True


@pytest.mark.parametrize(
    ("change", "passed", "named"),
    [
        # right only where DAPO's bounds are equal
        ({"symmetric": True}, 1, "the clip is symmetric"),
        # plain k3: the forward KL's gradient
        ({"unweighted": True}, 0, "plain k3, not weighted by the ratio"),
        ({"detached_ratio": True}, 0, "the ratio weighting k3 is detached"),
        ({"estimator": "k2"}, 0, ""),  # the reverse KL's gradient, not k3's value
        # GRPO's aggregation, not DAPO's
        ({"sequence_mean": True}, 0, "the per-response mean (GRPO's)"),
        ({"kl_unmasked": True}, 0, ""),  # the penalty counted on padding
        ({"flipped": True}, 0, ""),  # the penalty as a bonus
    ],
    ids=[
        "symmetric",
        "unweighted_k3",
        "detached_ratio",
        "k2",
        "sequence_mean",
        "kl_unmasked",
        "flipped",
    ],
)
def test_the_dapo_kl_loss_rejects_plausible_mistakes(change, passed, named):
    with pytest.raises(ExerciseFailed, match="For advantages=") as failure:
        check_dapo_kl_loss(_dapo_variant(**change))
    assert (failure.value.cases_passed, failure.value.cases_run) == (passed, 3)
    assert str(failure.value).startswith(named)


def test_the_dapo_kl_loss_refuses_a_detached_penalty():
    def detached_kl(policy, old, reference, advantages, mask, low, high, beta):
        surrogate, ratio = dapo_surrogate(policy, old, advantages, low, high)
        penalty = compute_kl_penalty(policy, reference, "k3") * ratio
        return ((surrogate + beta * penalty.detach()) * mask).sum() / mask.sum()

    with pytest.raises(ExerciseFailed, match=r"gradient w\.r\.t\. policy_log_probs"):
        check_dapo_kl_loss(detached_kl)


# --- 12: one device's share of a global token mean ----------------------------------


def device_loss_reference(per_token_loss, response_mask, global_tokens, num_devices):
    token_sum = (per_token_loss * response_mask).sum()
    return num_devices * token_sum / global_tokens


def device_loss_by_local_mean(per_token_loss, response_mask, global_tokens, devices):
    # Written another way: the local token mean, times this device's share of
    # the global tokens, times D.
    local_tokens = response_mask.sum()
    local_mean = per_token_loss[response_mask.bool()].sum() / local_tokens
    return local_mean * (local_tokens / global_tokens) * devices


def test_device_loss_accepts_two_written_answers(capsys):
    assert check_device_token_loss(device_loss_reference) is True
    assert "correct ✔ (5 of 5 cases passed)" in capsys.readouterr().out
    assert check_device_token_loss(device_loss_by_local_mean) is True


@pytest.mark.parametrize(
    ("wrong", "passed"),
    [
        # The integer division N // D agrees only where D divides N.
        (lambda loss, mask, n, d: (loss * mask).sum() / (n // d), 3),
        # A local token mean: right only on one device holding every token.
        (lambda loss, mask, n, d: (loss * mask).sum() / mask.sum(), 1),
        # The factor D forgotten: the all-reduce's average divides by D again.
        (lambda loss, mask, n, d: (loss * mask).sum() / n, 1),
        # Padding counted.
        (lambda loss, mask, n, d: d * loss.sum() / n, 0),
    ],
    ids=["integer_division", "local_mean", "no_factor_d", "padding"],
)
def test_device_loss_rejects_plausible_mistakes(wrong, passed):
    with pytest.raises(ExerciseFailed, match="global_tokens=") as failure:
        check_device_token_loss(wrong)
    assert (failure.value.cases_passed, failure.value.cases_run) == (passed, 5)
