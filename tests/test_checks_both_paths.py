"""One refusal, one verdict: the same answers run through the check cell (the
check called in this process, as Jupyter calls it) and through `grpo-lab
grade` (a contained kernel), and get the same verdict.

The answers: the right ones that name a package function in a helper, a
comment or a docstring (neither path refuses them), and, for each exercise
whose check changed, two differently written right answers and at least five
plausible wrong ones. Each answer is source text, as a student writes it; a
wrong one is its exercise's body with one slip chosen by ``slip``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from grpo_lab.teaching.checks import ExerciseFailed

NOTEBOOK = "07_both_paths.ipynb"
CONTEXT = (
    "import math\n"
    "import torch\n"
    "from grpo_lab.teaching.gradient_recorder import GradientRecorder\n"
    "GradientRecorder(torch.nn.Linear(1, 1).parameters())\n"
    "from grpo_lab.logprobs import get_response_log_probs\n"
    "from grpo_lab.masks import masked_mean\n"
)

# --- the five right answers that name a package function ---------------------------

CORRECTION_WEIGHTS = """
def correction_weights(old_log_probs, sampler_log_probs, response_mask, low, high):
    response = response_mask.bool()  # (B, T)
    log_gap = torch.where(response, old_log_probs - sampler_log_probs, 0.0)
    rho = torch.exp(log_gap.sum(dim=1, keepdim=True))  # (B, 1)
    return torch.where((rho >= low) & (rho <= high), rho, 0.0).detach()


def corrected_own_helper(policy_log_probs, old_log_probs, sampler_log_probs,
                         advantages, response_mask, cliprange, low, high):
    weight = correction_weights(
        old_log_probs, sampler_log_probs, response_mask, low, high)  # (B, 1)
    ratio = torch.exp(policy_log_probs - old_log_probs)  # (B, T)
    advantages = advantages.unsqueeze(-1)  # (B, 1)
    clipped = torch.clamp(ratio, 1 - cliprange, 1 + cliprange)
    loss = -torch.minimum(ratio * advantages, clipped * advantages) * weight
    return ((loss * response_mask).sum(1) / response_mask.sum(1)).mean()
"""

MICROBATCH_LOSS_07 = """
def microbatch_loss(model, batch, advantages, rows):
    log_probs = get_response_log_probs(
        model, batch["input_ids"][rows], batch["labels"][rows])["log_probs"]
    per_token_loss = -advantages[rows].unsqueeze(-1) * log_probs  # (b, T)
    return masked_mean(per_token_loss, batch["response_mask"][rows], dim=1).mean()


def train_step_own_helper(model, optimizer, batch, advantages,
                          gradient_accumulation_steps, max_grad_norm):
    batch_size = advantages.shape[0]
    size = -(-batch_size // gradient_accumulation_steps)
    optimizer.zero_grad(set_to_none=True)
    for rows in torch.arange(batch_size).split(size):
        (microbatch_loss(model, batch, advantages, rows) * len(rows) / batch_size
         ).backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
"""

MICROBATCH_LOSS_10 = """
def microbatch_loss(policy, old, reference, advantages, low, high, beta):
    ratio = torch.exp(policy - old)  # (B, T)
    a = advantages.unsqueeze(-1)  # (B, 1)
    clipped = torch.clamp(ratio, 1 - low, 1 + high)
    log_r = reference - policy
    k3 = torch.exp(log_r) - log_r - 1
    return -torch.minimum(ratio * a, clipped * a) + beta * ratio * k3  # (B, T)


def dapo_own_helper(policy_log_probs, old_log_probs, reference_log_probs,
                    advantages, response_mask, cliprange_low, cliprange_high,
                    kl_coef):
    per_token = microbatch_loss(policy_log_probs, old_log_probs,
        reference_log_probs, advantages, cliprange_low, cliprange_high, kl_coef)
    return (per_token * response_mask).sum() / response_mask.sum()
"""

DOCSTRING_06 = '''
def grpo_loss_docstring(policy_log_probs, old_log_probs, advantages,
                        response_mask, cliprange, loss_normalization,
                        normalization_constant=None):
    """What grpo_lab.losses.compute_policy_gradient_loss(advantages,
    policy_log_probs, "grpo", old_log_probs, cliprange) computes per token,
    then reduced; written again."""
    ratio = torch.exp(policy_log_probs - old_log_probs)  # (B, T)
    a = advantages.unsqueeze(-1)  # (B, 1)
    clipped = torch.clamp(ratio, 1 - cliprange, 1 + cliprange)
    per_token = -torch.minimum(ratio * a, clipped * a)
    if loss_normalization == "sequence":
        return masked_mean(per_token, response_mask, dim=1).mean()
    if loss_normalization == "token":
        return masked_mean(per_token, response_mask)
    return (per_token * response_mask).sum() / normalization_constant
'''

COMMENT_12 = """
def device_loss_comment(per_token_loss, response_mask, global_tokens, num_devices):
    # Not aggregate_loss_across_microbatch(per_token_loss, response_mask, "token"):
    # that divides by this device's tokens, not the global count.
    token_sum = (per_token_loss * response_mask).sum()
    return num_devices * token_sum / global_tokens
"""

# Routes to the answer that the check hides (tests/test_checks_reach.py): wrong
# answers in both paths.
ROUTES = {
    "mask_by_written": (
        "turns",
        "check_multi_turn_mask",
        "from grpo_lab.teaching.checks.turns import _written\n\n"
        "def mask_by_written(prompt_ids, segments):\n"
        "    return _written(prompt_ids, segments, ('model',))[:, 1:]\n",
    ),
    "lora_by_slips": (
        "lora",
        "check_lora_linear",
        "from grpo_lab.teaching.checks import lora as _lora_checks\n\n"
        "def lora_by_slips(x, weight, lora_A, lora_B, alpha, rank):\n"
        "    slips = _lora_checks._slips(x, weight, lora_A, lora_B, rank, alpha)\n"
        "    return next(v for k, v in slips.items() if 'upside down' in k)\n",
    ),
    "dapo_by_grpo_clip_loss": (
        "family",
        "check_dapo_kl_loss",
        "import grpo_lab.losses as _losses\n\n"
        "def dapo_by_grpo_clip_loss(policy, old, reference, advantages, mask, low,\n"
        "                           high, beta):\n"
        "    options = _losses.ObjectiveOptions(cliprange=low, cliprange_high=high)\n"
        "    surrogate = _losses.grpo_clip_loss(\n"
        "        advantages.unsqueeze(-1), policy, old, mask.bool(), options)[0]\n"
        "    log_r = reference - policy\n"
        "    kl = torch.exp(policy - old) * (log_r.exp() - log_r - 1)\n"
        "    return ((surrogate + beta * kl) * mask).sum() / mask.sum()\n",
    ),
    "slices_by_reference": (
        "loop",
        "check_train_batch_slices",
        "import importlib\n\n"
        "def slices_by_reference(rollout_batch_size, train_batch_size, group_size):\n"
        "    loop = importlib.import_module('grpo_lab.teaching.checks.loop')\n"
        "    if train_batch_size % group_size:\n"
        "        raise ValueError('group_size must divide train_batch_size')\n"
        "    return loop._reference_slices(rollout_batch_size, train_batch_size)\n",
    ),
}

NAMED_HELPERS = {
    "corrected_own_helper": ("mismatch", "check_corrected_loss", CORRECTION_WEIGHTS),
    "train_step_own_helper": (
        "train_step",
        "check_microbatch_train_step",
        MICROBATCH_LOSS_07,
    ),
    "dapo_own_helper": ("family", "check_dapo_kl_loss", MICROBATCH_LOSS_10),
    "grpo_loss_docstring": ("aggregation", "check_grpo_loss", DOCSTRING_06),
    "device_loss_comment": ("scaling", "check_device_token_loss", COMMENT_12),
}

# --- the changed exercises: one body each, a slip chosen by name ---------------------

UPDATE = """
def {name}(score, optimizer_step, advantages, response_mask, group_size,
           train_batch_size, epochs_per_rollout_batch, cliprange, slip={slip!r}):
    size = advantages.shape[0]
    step_rows = size if slip == "whole_batch" else train_batch_size
    batches = [slice(s, s + step_rows) for s in range(0, size, step_rows)]
    off_policy = epochs_per_rollout_batch * len(batches) > 1
    old = None
    if off_policy and slip not in ("never_old", "fresh_old"):
        with torch.no_grad():
            old = score(slice(0, size))  # (B, T)
    schedule = [(e, rows) for e in range(epochs_per_rollout_batch) for rows in batches]
    if slip == "epochs_inside":
        schedule = [(e, rows) for rows in batches
                    for e in range(epochs_per_rollout_batch)]
    for epoch, rows in schedule:
        if slip == "old_per_epoch" and off_policy and rows == batches[0]:
            with torch.no_grad():
                old = score(slice(0, size))
        log_probs = score(rows)  # (b, T)
        a = advantages[rows].unsqueeze(-1)  # (b, 1)
        if old is None and slip in ("trl", "fresh_old"):
            reference = log_probs.detach()  # TRL's on-policy old log-probs
        else:
            reference = None if old is None else old[rows]
        if reference is None:
            per_token = -a * log_probs
        else:
            ratio = torch.exp(log_probs - reference)
            clipped = torch.clamp(ratio, 1 - cliprange, 1 + cliprange)
            per_token = -torch.minimum(ratio * a, clipped * a)
        mask = response_mask[rows]
        if slip == "token_mean":
            optimizer_step((per_token * mask).sum() / mask.sum())
        else:
            optimizer_step(((per_token * mask).sum(1) / mask.sum(1)).mean())
"""

LOSSES = """
def {name}(per_token_loss, response_mask, gradient_accumulation_steps,
           loss_normalization, normalization_constant=None, slip={slip!r}):
    batch_size = per_token_loss.shape[0]
    size = -(-batch_size // gradient_accumulation_steps)
    if slip == "floor":
        size = batch_size // gradient_accumulation_steps
    microbatches = torch.arange(batch_size).split(size)
    if slip == "tensor_split":
        microbatches = torch.arange(batch_size).tensor_split(gradient_accumulation_steps)
    losses = []
    for rows in microbatches:
        loss, mask = per_token_loss[rows] * response_mask[rows], response_mask[rows]
        if loss_normalization == "sequence":
            mean = (loss.sum(1) / mask.sum(1)).mean()
            share = {{"one_over_k": 1 / len(microbatches), "no_scale": 1.0}}.get(
                slip, len(rows) / batch_size)
            losses.append(mean * share)
        elif loss_normalization == "token":
            if slip == "token_by_rows":
                losses.append(loss.sum() / mask.sum() * len(rows) / batch_size)
            else:
                losses.append(loss.sum() / response_mask.sum())
        else:
            losses.append(loss.sum() / normalization_constant)
    return losses
"""

LOSSES_BY_WEIGHTS = """
def {name}(per_token_loss, response_mask, steps, normalization, constant=None):
    # Each token's weight in the whole batch's loss, then a sum per microbatch.
    mask = response_mask.float()  # (B, T)
    if normalization == "sequence":
        weight = mask / (mask.sum(dim=1, keepdim=True) * mask.shape[0])
    elif normalization == "token":
        weight = mask / mask.sum()
    else:
        weight = mask / constant
    size = (mask.shape[0] + steps - 1) // steps
    return [(per_token_loss[s:s + size] * weight[s:s + size]).sum()
            for s in range(0, mask.shape[0], size)]
"""

STEP = """
def {name}(model, optimizer, batch, advantages, gradient_accumulation_steps,
           max_grad_norm, slip={slip!r}):
    batch_size = advantages.shape[0]
    size = -(-batch_size // gradient_accumulation_steps)
    if slip == "k_as_size":
        size = gradient_accumulation_steps
    if slip == "one_forward":
        size = batch_size
    microbatches = torch.arange(batch_size).split(size)
    optimizer.zero_grad(set_to_none=True)
    for rows in microbatches:
        log_probs = get_response_log_probs(
            model, batch["input_ids"][rows], batch["labels"][rows])["log_probs"]
        sign = -1.0 if slip == "sign" else 1.0
        per_token = -sign * advantages[rows].unsqueeze(-1) * log_probs
        loss = masked_mean(per_token, batch["response_mask"][rows], dim=1).mean()
        share = {{"no_scale": 1.0, "one_over_k": 1 / len(microbatches)}}.get(
            slip, len(rows) / batch_size)
        (loss * share).backward()
        if slip == "step_each":
            optimizer.step()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    if slip != "step_each":
        optimizer.step()
"""

STEP_BY_SUMS = """
def {name}(model, optimizer, batch, advantages, steps, norm):
    # Each response's token sum over its length, over B, by slicing ranges.
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
"""

DAPO = """
def {name}(policy_log_probs, old_log_probs, reference_log_probs, advantages,
           response_mask, cliprange_low, cliprange_high, kl_coef, slip={slip!r}):
    ratio = torch.exp(policy_log_probs - old_log_probs)  # (B, T)
    a = advantages.unsqueeze(-1)  # (B, 1)
    high = cliprange_low if slip == "symmetric" else cliprange_high
    clipped = torch.clamp(ratio, 1 - cliprange_low, 1 + high)
    surrogate = -torch.minimum(ratio * a, clipped * a)  # (B, T)
    log_r = reference_log_probs - policy_log_probs
    if slip == "k2":
        kl = 0.5 * log_r**2
    else:
        kl = torch.exp(log_r) - log_r - 1  # k3
        weight = {{"plain_k3": 1.0, "detached_ratio": ratio.detach()}}.get(slip, ratio)
        kl = weight * kl
    sign = -1.0 if slip == "flipped" else 1.0
    per_token = surrogate + sign * kl_coef * kl
    if slip == "sequence_mean":
        return masked_mean(per_token, response_mask, dim=1).mean()
    return (per_token * response_mask).sum() / response_mask.sum()
"""

DAPO_BY_WHERE = """
def {name}(policy, old, reference, advantages, mask, low, high, beta):
    # torch.where for the clip, and the two token means taken apart.
    ratio = (policy - old).exp()
    a = advantages[:, None]
    clipped = torch.where(ratio > 1 + high, 1 + high, ratio)
    clipped = torch.where(clipped < 1 - low, 1 - low, clipped)
    surrogate = torch.maximum(-ratio * a, -clipped * a)
    log_r = reference - policy
    penalty = (log_r.exp() - log_r - 1) * ratio
    keep = mask.bool()
    return surrogate[keep].mean() + beta * penalty[keep].mean()
"""

CORRECTED = """
def {name}(policy_log_probs, old_log_probs, sampler_log_probs, advantages,
           response_mask, cliprange, low, high, slip={slip!r}):
    keep = response_mask.bool()
    gap = old_log_probs - sampler_log_probs  # log pi_old - log pi_sampler
    if slip == "upside_down":
        gap = -gap
    if slip == "padding":
        log_rho = gap.sum(1, keepdim=True)
    else:
        log_rho = torch.where(keep, gap, 0.0).sum(1, keepdim=True)  # (B, 1)
    if slip == "token_level":
        log_rho = torch.where(keep, gap, 0.0)  # (B, T)
    if slip == "geometric_mean":
        log_rho = log_rho / response_mask.sum(1, keepdim=True)
    rho = log_rho.exp()
    if slip == "math_log":
        inside = (log_rho >= math.log(low)) & (log_rho <= math.log(high))
    else:
        inside = (rho >= low) & (rho <= high)
    weight = torch.where(inside, rho, 0.0).detach()
    if slip == "uncorrected":
        weight = torch.ones_like(weight)
    ratio = torch.exp(policy_log_probs - old_log_probs)  # (B, T)
    a = advantages.unsqueeze(-1)  # (B, 1)
    clipped = torch.clamp(ratio, 1 - cliprange, 1 + cliprange)
    loss = -torch.minimum(ratio * a, clipped * a) * weight
    return ((loss * response_mask).sum(1) / response_mask.sum(1)).mean()
"""

CORRECTED_BY_PRODUCT = """
def {name}(policy, old, sampler, advantages, mask, cliprange, low, high):
    # A product of the token ratios (1 off the response), a row mask, and the
    # per-row mean by boolean indexing.
    token_ratio = torch.exp(old - sampler)
    rho = torch.where(mask == 1, token_ratio, torch.ones_like(token_ratio)).prod(1)
    kept = ((rho >= low) & (rho <= high)).double()  # (B,)
    weight = (rho * kept).unsqueeze(1)
    ratio = torch.exp(policy - old)
    a = advantages.unsqueeze(-1)
    terms = -torch.minimum(ratio * a, ratio.clamp(1 - cliprange, 1 + cliprange) * a)
    terms = terms * weight
    rows = [terms[i][mask[i].bool()].mean() for i in range(mask.shape[0])]
    return torch.stack(rows).mean()
"""

RESPONSE = """
def {name}(logits, labels, response_mask, slip={slip!r}):
    wide = logits if slip == "bfloat16" else logits.float()
    picked = wide.gather(-1, labels.unsqueeze(-1)).squeeze(-1)  # (B, T)
    if slip == "exp":
        total = wide.exp().sum(-1).log()  # no max shift
    else:
        total = torch.logsumexp(wide, dim=-1)
    token = (picked - total).float()  # (B, T)
    mask = torch.ones_like(response_mask) if slip == "unmasked" else response_mask
    summed = (token * mask).sum(dim=-1)  # (B,)
    if slip == "mean":
        return summed / mask.sum(-1)
    if slip == "half_gradient":
        return 0.5 * summed + 0.5 * summed.detach()
    return summed
"""

RESPONSE_BY_LOG_SOFTMAX = """
def {name}(logits, labels, response_mask):
    # log_softmax, then take the labels' entries where the mask is 1.
    table = torch.log_softmax(logits.float(), dim=-1)  # (B, T, V)
    token = torch.take_along_dim(table, labels[..., None], dim=-1)[..., 0]
    return torch.where(response_mask.bool(), token, 0.0).sum(-1)
"""

ADMITTED = """
def {name}(policy_log_probs, sampler_log_probs, advantages, response_mask,
           group_versions, trainer_version, max_staleness, cap, slip={slip!r}):
    age = trainer_version - group_versions  # (N,)
    if slip == "age_reversed":
        age = -age
    kept = age < max_staleness if slip == "strict_bound" else age <= max_staleness
    rows = kept.repeat_interleave(policy_log_probs.shape[0] // kept.shape[0])
    gap = policy_log_probs.detach() - sampler_log_probs  # log pi - log pi_sampler
    if slip == "upside_down":
        gap = -gap
    if slip == "weight_with_gradient":
        gap = policy_log_probs - sampler_log_probs
    rho = gap.exp()  # (B, T)
    weight = rho if slip == "untruncated" else rho.clamp(max=cap)
    ratio = torch.exp(policy_log_probs - policy_log_probs.detach())
    per_token = -advantages.unsqueeze(-1) * ratio * weight  # (B, T)
    mask = response_mask * rows.unsqueeze(-1)
    if slip == "token_mean":
        return kept, (per_token * mask).sum() / mask.sum()
    per_response = (per_token * mask).sum(1) / response_mask.sum(1)  # (B,)
    if slip == "dropped_in_divisor":
        return kept, per_response.mean()
    return kept, per_response[rows].mean()
"""

ADMITTED_BY_GROUPS = """
def {name}(policy, sampler, advantages, mask, versions, trainer, bound, cap):
    # One group at a time: skip the stale ones, then one mean of the kept
    # responses' means.
    size = policy.shape[0] // versions.shape[0]
    kept, means = [], []
    for group, version in enumerate(versions.tolist()):
        keep = trainer - version <= bound
        kept.append(keep)
        if not keep:
            continue
        for row in range(group * size, (group + 1) * size):
            tokens = mask[row].bool()
            log_pi = policy[row][tokens]
            weight = torch.minimum((log_pi.detach() - sampler[row][tokens]).exp(),
                                   torch.tensor(cap, dtype=log_pi.dtype))
            means.append((-advantages[row] * weight * (log_pi - log_pi.detach()).exp()).mean())
    return torch.tensor(kept), torch.stack(means).mean()
"""

CHANGED = {
    ("loop", "check_rollout_batch_update"): (
        UPDATE,
        ["right", "trl"],
        [
            "never_old",
            "fresh_old",
            "old_per_epoch",
            "epochs_inside",
            "token_mean",
            "whole_batch",
        ],
        None,
    ),
    ("train_step", "check_microbatch_losses"): (
        LOSSES,
        ["right"],
        ["floor", "tensor_split", "one_over_k", "no_scale", "token_by_rows"],
        LOSSES_BY_WEIGHTS,
    ),
    ("train_step", "check_microbatch_train_step"): (
        STEP,
        ["right"],
        ["k_as_size", "one_forward", "sign", "no_scale", "one_over_k", "step_each"],
        STEP_BY_SUMS,
    ),
    ("family", "check_dapo_kl_loss"): (
        DAPO,
        ["right"],
        [
            "plain_k3",
            "detached_ratio",
            "symmetric",
            "k2",
            "flipped",
            "sequence_mean",
        ],
        DAPO_BY_WHERE,
    ),
    ("mismatch", "check_corrected_loss"): (
        CORRECTED,
        ["right"],
        [
            "math_log",
            "upside_down",
            "token_level",
            "geometric_mean",
            "padding",
            "uncorrected",
        ],
        CORRECTED_BY_PRODUCT,
    ),
    ("asynchronous", "check_admitted_loss"): (
        ADMITTED,
        ["right"],
        [
            "age_reversed",
            "strict_bound",
            "upside_down",
            "weight_with_gradient",
            "untruncated",
            "token_mean",
            "dropped_in_divisor",
        ],
        ADMITTED_BY_GROUPS,
    ),
    ("logprobs", "check_response_log_probs"): (
        RESPONSE,
        ["right"],
        ["exp", "bfloat16", "mean", "unmasked", "half_gradient"],
        RESPONSE_BY_LOG_SOFTMAX,
    ),
}


# --- 05-gspo_loss, 06-aggregate_loss, 13-lora_linear, 08-robust_reward -------------

GSPO = """
def {name}(policy_log_probs, old_log_probs, advantages, response_mask, cliprange,
           slip={slip!r}):
    mask = torch.ones_like(response_mask) if slip == "padding" else response_mask
    log_ratio = (policy_log_probs - old_log_probs) * mask  # (B, T)
    if slip == "token_ratio":
        ratio = torch.exp(policy_log_probs - old_log_probs)  # (B, T)
        a = advantages.unsqueeze(-1)
        clipped = torch.clamp(ratio, 1 - cliprange, 1 + cliprange)
        return masked_mean(-torch.minimum(ratio * a, clipped * a), mask, dim=1).mean()
    if slip == "arithmetic":
        ratio = (torch.exp(policy_log_probs - old_log_probs) * mask).sum(1) / mask.sum(1)
    elif slip == "product":
        ratio = torch.exp(log_ratio.sum(1))
    else:
        ratio = torch.exp(log_ratio.sum(1) / mask.sum(1))  # (B,)
    high = float("inf") if slip == "no_clip" else cliprange
    clipped = torch.clamp(ratio, 1 - high, 1 + high)
    if slip == "detached_clip":
        clipped = torch.clamp(ratio.detach(), 1 - cliprange, 1 + cliprange)
    loss = -torch.minimum(ratio * advantages, clipped * advantages)  # (B,)
    if slip == "flipped":
        loss = -loss
    if slip == "token_mean":
        return (loss * mask.sum(1)).sum() / mask.sum()
    return loss.mean()
"""

GSPO_BY_WHERE = """
def {name}(policy, old, advantages, mask, eps):
    # The geometric mean as a masked mean of log-ratios, the clip by torch.where.
    keep = mask.bool()
    log_s = torch.stack([(policy[i] - old[i])[keep[i]].mean() for i in range(len(keep))])
    s = log_s.exp()  # (B,)
    bounded = torch.where(s > 1 + eps, 1 + eps, torch.where(s < 1 - eps, 1 - eps, s))
    return torch.maximum(-s * advantages, -bounded * advantages).sum() / len(s)
"""

CHANGED.update(
    {
        ("gspo", "check_gspo_loss"): (
            GSPO,
            ["right"],
            [
                "token_ratio",
                "arithmetic",
                "product",
                "no_clip",
                "padding",
                "flipped",
                "token_mean",
                "detached_clip",
            ],
            GSPO_BY_WHERE,
        ),
    }
)

AGGREGATE = """
def {name}(per_token_loss, response_mask, loss_normalization,
           normalization_constant=None, slip={slip!r}):
    mask = torch.ones_like(response_mask) if slip == "unmasked" else response_mask
    masked = per_token_loss * mask  # (B, T)
    if loss_normalization == "sequence":
        if slip == "token_mean":
            return masked.sum() / mask.sum()
        lengths = mask.shape[1] if slip == "over_t" else mask.sum(dim=1)
        per_response = masked.sum(dim=1) / lengths  # (B,)
        if slip == "summed_rows":
            return per_response.sum()
        if slip == "row_sums":
            return masked.sum(dim=1).mean()
        return per_response.mean()
    divisor = mask.sum() if slip == "token_count" else normalization_constant
    return masked.sum() / divisor
"""

AGGREGATE_BY_WEIGHTS = """
def {name}(loss, mask, how, constant=None):
    # Each token's weight first, as in the picture; then one weighted sum.
    m = mask.to(loss.dtype)
    if how == "sequence":
        weight = m / m.sum(dim=1, keepdim=True) / m.shape[0]
    else:
        weight = m / constant
    return torch.einsum("bt,bt->", loss, weight)
"""

CHANGED.update(
    {
        ("aggregation", "check_aggregate_loss"): (
            AGGREGATE,
            ["right"],
            [
                "token_mean",
                "over_t",
                "summed_rows",
                "row_sums",
                "unmasked",
                "token_count",
            ],
            AGGREGATE_BY_WEIGHTS,
        ),
    }
)

LORA = """
def {name}(x, weight, lora_A, lora_B, alpha, rank, slip={slip!r}):
    scale = {{"no_scale": 1.0, "alpha": alpha, "upside_down": rank / alpha}}.get(
        slip, alpha / rank)
    base = x @ (weight if slip == "untransposed" else weight.T)  # (..., out)
    B = lora_B.detach() if slip == "detached_B" else lora_B
    if slip == "swapped":
        update = x @ B @ lora_A  # (..., out) only when in = out
    else:
        update = x @ lora_A.T @ B.T  # (..., out)
    if slip == "no_base":
        return scale * update
    return base + scale * update
"""

LORA_MERGED = """
def {name}(x, weight, lora_A, lora_B, alpha, rank):
    # One matmul with the merged weight W + (alpha / r) B A.
    merged = torch.addmm(weight, lora_B, lora_A, alpha=alpha / rank)  # (out, in)
    return torch.nn.functional.linear(x, merged)
"""

CHANGED.update(
    {
        ("lora", "check_lora_linear"): (
            LORA,
            ["right"],
            [
                "no_scale",
                "alpha",
                "upside_down",
                "untransposed",
                "swapped",
                "no_base",
                "detached_B",
            ],
            LORA_MERGED,
        ),
    }
)

REWARD = """
def {name}(response, ground_truth, slip={slip!r}):
    if not isinstance(response, str) or not isinstance(ground_truth, str):
        return 0.0
    text, truth = response.strip(), ground_truth.strip()
    if slip == "contains":  # notebook 08's lenient reward
        return float(truth in response)
    if slip == "startswith":
        return float(text.startswith(truth))
    if slip in ("int_parse", "float_parse"):
        number = int if slip == "int_parse" else float
        try:
            return float(number(text) == number(truth))
        except ValueError:
            return 0.0
    if slip == "first_word":
        return float(text.split()[:1] == [truth])
    if slip == "first_line":
        return float(text.splitlines()[:1] == [truth])
    if slip == "zeros_stripped":
        return float(text.isdigit() and (text.lstrip("0") or "0") == truth)
    return float(text == truth)
"""

REWARD_BY_PATTERN = """
import re


def {name}(response, truth):
    # The whole response, whitespace aside, must be one ASCII integer: the sum.
    if type(response) is not str or type(truth) is not str:
        return 0
    found = re.fullmatch(r"\\s*(-?[0-9]+)\\s*", response)
    return 1.0 if found is not None and found.group(1) == truth.strip() else 0.0
"""

CHANGED.update(
    {
        ("rewards", "check_robust_reward"): (
            REWARD,
            ["right"],
            [
                "contains",
                "startswith",
                "int_parse",
                "float_parse",
                "first_word",
                "first_line",
                "zeros_stripped",
            ],
            REWARD_BY_PATTERN,
        ),
    }
)


def _notebook_check_cell(notebook: str, grade_id: str, function: str) -> str:
    """A course check cell, hidden tests included, calling ``{name}``."""
    path = Path(__file__).resolve().parents[1] / "notebooks" / notebook
    for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
        if cell["metadata"].get("nbgrader", {}).get("grade_id") == grade_id:
            source = "".join(cell["source"]).replace("{", "{{").replace("}", "}}")
            return re.sub(rf"\b{function}\b", "{name}", source)
    raise AssertionError(f"{notebook} has no cell {grade_id}")


# Checks whose course cell runs hidden tests after the check: both paths run it.
CHECK_CELLS = {
    "check_robust_reward": _notebook_check_cell(
        "08_training_loop.ipynb", "08-robust_reward-check", "robust_reward"
    ),
}


def test_the_hidden_hacks_reach_neither_the_student_copy_nor_the_package():
    """The course cell runs them; the student copy and the package hold none."""
    import nbformat

    from grpo_lab.instructor.student import student_notebook

    cell = CHECK_CELLS["check_robust_reward"]
    hacks = re.findall(r'\(\s*"([^"]+)", "(?:42|7|0)", 0\.0', cell)
    assert len(hacks) >= 5, cell
    root = Path(__file__).resolve().parents[1]
    course = nbformat.read(root / "notebooks" / "08_training_loop.ipynb", 4)
    copy = json.dumps(student_notebook(course, "08_training_loop.ipynb"))
    assert "check_robust_reward(robust_reward)" in copy
    assert "check_hidden_reward_hacks" not in copy
    package = "".join(
        p.read_text(encoding="utf-8") for p in (root / "grpo_lab").rglob("*.py")
    )
    assert not [hack for hack in hacks if json.dumps(hack) in copy + package]


# --- end of 05-gspo_loss, 06-aggregate_loss, 13-lora_linear, 08-robust_reward -------


# --- composition exercises of notebooks 00, 02 (token entropy) and 03 -------------

CONTINUATION = """
def {name}(model, tokenizer, prompt, max_new_tokens, slip={slip!r}):
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    new = []
    recording = torch.enable_grad() if slip == "autograd" else torch.no_grad()
    with recording:
        for _ in range(max_new_tokens + (slip == "one_more")):
            seen = [(ids + new)[-1]] if slip == "last_token" else ids + new
            next_id = int(model(torch.tensor([seen])).logits[0, -1].argmax())
            if next_id == tokenizer.eos_token_id and slip != "past_eos":
                if slip == "eos_kept":
                    new.append(next_id)
                break
            new.append(next_id)
    text = tokenizer.decode(new, skip_special_tokens=slip == "past_eos")
    return prompt + text if slip == "with_prompt" else text
"""

CONTINUATION_BY_CACHE = """
def {name}(model, tokenizer, prompt, max_new_tokens):
    # A key-value cache: after the prompt, only the newest token goes in.
    step = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
    pieces, cache = [], None
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            output = model(input_ids=step, past_key_values=cache, use_cache=True)
            cache = output.past_key_values
            token = output.logits[0, -1].argmax().item()
            if token == tokenizer.eos_token_id:
                break
            pieces.append(tokenizer.convert_ids_to_tokens(token))
            step = torch.tensor([[token]])
    return "".join(pieces)
"""

ENTROPY = """
def {name}(logits, response_mask, slip={slip!r}):
    wide = logits if slip == "bfloat16" else logits.float()
    probabilities = torch.softmax(wide, dim=-1)  # (B, T, V)
    if slip == "log_of_softmax":
        entropy = -(probabilities * probabilities.log()).sum(-1)
    else:
        weights = probabilities.detach() if slip == "detached" else probabilities
        entropy = torch.logsumexp(wide, dim=-1) - (weights * wide).sum(-1)
    if slip == "bits":
        entropy = entropy / math.log(2)
    mask = torch.ones_like(response_mask) if slip == "unmasked" else response_mask
    mask = mask.to(entropy.dtype)
    if slip == "per_response":
        return ((entropy * mask).sum(-1) / mask.sum(-1)).mean()
    return ((entropy * mask).sum() / mask.sum()).float()
"""

ENTROPY_BY_LOG_SOFTMAX = """
def {name}(logits, response_mask):
    # log_softmax (finite where a probability underflows), boolean indexing.
    log_p = torch.log_softmax(logits.to(torch.float32), dim=-1)
    entropy = -(log_p.exp() * log_p).sum(dim=-1)  # (B, T)
    return entropy[response_mask.bool()].mean()
"""

CHANGED.update(
    {
        ("setup", "check_greedy_continuation"): (
            CONTINUATION,
            ["right"],
            [
                "autograd",
                "one_more",
                "last_token",
                "past_eos",
                "eos_kept",
                "with_prompt",
            ],
            CONTINUATION_BY_CACHE,
        ),
        ("logprobs", "check_token_entropy"): (
            ENTROPY,
            ["right"],
            [
                "bfloat16",
                "log_of_softmax",
                "detached",
                "bits",
                "unmasked",
                "per_response",
            ],
            ENTROPY_BY_LOG_SOFTMAX,
        ),
    }
)

ADVANTAGES = """
def {name}(responses, ground_truths, group_size, advantage_eps, slip={slip!r}):
    from grpo_lab.rewards import exact_match_reward

    count = len(ground_truths)
    if slip == "interleaved":
        truths = [ground_truths[i % count] for i in range(len(responses))]
    else:
        truths = [t for t in ground_truths for _ in range(group_size)]
    key = "format_reward" if slip == "format_reward" else "reward"
    rewards = torch.tensor([exact_match_reward(r, t)[key] for r, t in zip(responses, truths)])
    if slip == "raw_rewards":
        return rewards
    grouped = rewards.reshape(-1, group_size)  # (B, G)
    mean = rewards.mean() if slip == "batch_mean" else grouped.mean(1, keepdim=True)
    std = grouped.std(1, unbiased=slip != "population_std", keepdim=True)
    eps = 0.0 if slip == "no_eps" else advantage_eps
    return ((grouped - mean) / (std + eps)).flatten()
"""

ADVANTAGES_BY_GROUP = """
def {name}(responses, ground_truths, group_size, advantage_eps):
    # One group at a time, in float64, the spread as the root of the variance.
    from grpo_lab.rewards import exact_match_reward

    advantages = []
    for g, truth in enumerate(ground_truths):
        group = responses[g * group_size : (g + 1) * group_size]
        r = torch.tensor([exact_match_reward(x, truth)["reward"] for x in group],
                         dtype=torch.float64)
        advantages.append((r - r.mean()) / (r.var().sqrt() + advantage_eps))
    return torch.cat(advantages).float()
"""

CHANGED[("advantages", "check_group_normalized_advantages")] = (
    ADVANTAGES,
    ["right"],
    [
        "interleaved",
        "format_reward",
        "raw_rewards",
        "batch_mean",
        "population_std",
        "no_eps",
    ],
    ADVANTAGES_BY_GROUP,
)

# Routes to these answers that the check hides: wrong in both paths.
ROUTES.update(
    {
        "continuation_by_generate": (
            "setup",
            "check_greedy_continuation",
            "def continuation_by_generate(model, tokenizer, prompt, max_new_tokens):\n"
            "    ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])\n"
            "    out = model.generate(ids, attention_mask=torch.ones_like(ids),\n"
            "        max_new_tokens=max_new_tokens, do_sample=False,\n"
            "        eos_token_id=tokenizer.eos_token_id, pad_token_id=0)\n"
            "    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)\n",
        ),
        "entropy_by_fixed_logits": (
            "logprobs",
            "check_token_entropy",
            "from grpo_lab.teaching.checks.logprobs import _FixedLogits\n\n"
            "def entropy_by_fixed_logits(logits, response_mask):\n"
            "    labels = torch.zeros(response_mask.shape, dtype=torch.long)\n"
            "    scored = get_response_log_probs(_FixedLogits(logits.float()), labels,\n"
            "        labels, return_token_entropy=True, entropy_gradient=True,\n"
            "        logits_chunk_size=0)\n"
            "    return scored['token_entropy'][response_mask.bool()].mean()\n",
        ),
        "advantages_by_package": (
            "advantages",
            "check_group_normalized_advantages",
            "from grpo_lab.advantages import compute_group_normalized_rewards\n"
            "from grpo_lab.rewards import exact_match_reward\n\n"
            "def advantages_by_package(responses, ground_truths, group_size, eps):\n"
            "    truths = [t for t in ground_truths for _ in range(group_size)]\n"
            "    rewards = torch.tensor([exact_match_reward(r, t)['reward']\n"
            "                            for r, t in zip(responses, truths)])\n"
            "    return compute_group_normalized_rewards(\n"
            "        rewards, group_size, 'mean', eps, 'std')[0]\n",
        ),
    }
)

# --- end of the composition exercises of notebooks 00, 02 and 03 -----------------


def _answers() -> dict[str, tuple[str, str, str, bool]]:
    """name -> (check module, check, source, right?)."""
    answers = {
        name: (module, check, source, True)
        for name, (module, check, source) in NAMED_HELPERS.items()
    }
    answers.update(
        {
            name: (module, check, source, False)
            for name, (module, check, source) in ROUTES.items()
        }
    )
    for (module, check), (template, rights, wrongs, other) in CHANGED.items():
        short = check.removeprefix("check_")
        for slip in rights + wrongs:
            name = f"{short}_{slip}"
            source = template.format(name=name, slip=slip)
            answers[name] = (module, check, source, slip in rights)
        if other is not None:
            name = f"{short}_written_another_way"
            answers[name] = (module, check, other.format(name=name), True)
    return answers


ANSWERS = _answers()
RIGHT = sorted(name for name, entry in ANSWERS.items() if entry[3])
WRONG = sorted(name for name, entry in ANSWERS.items() if not entry[3])


def test_each_changed_exercise_has_two_right_and_five_wrong_answers():
    for _module, check in CHANGED:
        answers = [entry for entry in ANSWERS.values() if entry[1] == check]
        assert sum(entry[3] for entry in answers) >= 2, check
        assert sum(not entry[3] for entry in answers) >= 5, check


def _in_the_check_cell(name: str) -> bool:
    import importlib

    module, check, source, _ = ANSWERS[name]
    names: dict = {}
    exec(CONTEXT + source, names)
    if check in CHECK_CELLS:  # the course's cell, hidden tests and all
        exec(CHECK_CELLS[check].format(name=name), names)
        return True  # it raised on a wrong answer
    checks = importlib.import_module(f"grpo_lab.teaching.checks.{module}")
    return getattr(checks, check)(names[name])


@pytest.mark.parametrize("name", RIGHT)
def test_a_right_answer_passes_the_check_cell(name, capsys):
    assert _in_the_check_cell(name) is True
    assert "correct ✔" in capsys.readouterr().out


@pytest.mark.parametrize("name", WRONG)
def test_a_wrong_answer_fails_the_check_cell(name):
    with pytest.raises(Exception) as failure:
        _in_the_check_cell(name)
    assert not isinstance(failure.value, NotImplementedError)
    if not isinstance(failure.value, ExerciseFailed):  # the student's own error
        assert failure.value.__notes__, failure.value  # with the cases counted


@pytest.fixture(scope="module")
def grades(tmp_path_factory):
    """Every answer graded by `grpo-lab grade`, in one submitted notebook."""
    import nbformat

    from grpo_lab.instructor import grading
    from grpo_lab.instructor.rubric import Rubric

    root = tmp_path_factory.mktemp("both_paths")
    course = [nbformat.v4.new_code_cell(CONTEXT)]
    submitted = []
    for name, (module, check, source, _) in ANSWERS.items():
        stub = (
            f"def {name}(*args):\n    ### BEGIN SOLUTION\n"
            "    raise NotImplementedError()\n    ### END SOLUTION\n"
        )
        call = CHECK_CELLS.get(check, "").format(name=name) or (
            f"from grpo_lab.teaching.checks.{module} import {check}\n\n{check}({name});"
        )
        course += [nbformat.v4.new_code_cell(stub), nbformat.v4.new_code_cell(call)]
        answer = nbformat.v4.new_code_cell(source.strip())
        answer.metadata["nbgrader"] = {"grade_id": f"07-{name}"}
        submitted.append(answer)
    (root / "course").mkdir()
    nbformat.write(nbformat.v4.new_notebook(cells=course), root / "course" / NOTEBOOK)
    (root / "submitted" / "sam").mkdir(parents=True)
    nbformat.write(
        nbformat.v4.new_notebook(cells=submitted),
        root / "submitted" / "sam" / NOTEBOOK,
    )
    rubric = Rubric({f"07-{name}": 1.0 for name in ANSWERS}, {})
    found = grading.grade_submissions(
        root / "submitted", notebooks_dir=root / "course", rubric=rubric, timeout=60
    )
    return {g.exercise_id.split("-", 1)[1]: g for g in found}


@pytest.mark.slow
@pytest.mark.parametrize("name", RIGHT)
def test_a_right_answer_passes_the_grader(name, grades):
    assert grades[name].outcome == "pass", grades[name]


@pytest.mark.slow
@pytest.mark.parametrize("name", WRONG)
def test_a_wrong_answer_gets_no_points_from_the_grader(name, grades):
    assert grades[name].outcome == "fail" and grades[name].points == 0, grades[name]
