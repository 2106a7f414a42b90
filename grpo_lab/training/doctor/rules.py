"""The doctor's first rules: truncation, no signal, the ratio on-policy, the
sampler gap, entropy, clipping, a flat reward under a moving loss, non-finite
values, the learning rate and the gradient norm.

The thresholds are named constants, each with the reason for its value; they are
rules of thumb for spotting a run worth a second look, not proofs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from grpo_lab.training.doctor.findings import (
    REWARD_FLAT_CHANGE,
    Finding,
    Run,
    adapter_rank,
    config_number,
    config_text,
    median,
    reward_change,
    reward_is_flat,
    series,
)
from grpo_lab.training.doctor.findings import evidence as _evidence
from grpo_lab.training.doctor.findings import persistent as _persistent
from grpo_lab.training.doctor.findings import values as _values

# --- thresholds -----------------------------------------------------------------------

# Most responses cut at max_new_tokens: at 0.9 almost every reward scores a
# cut-off answer, so the reward says more about the length limit than the policy.
TRUNCATED_FRACTION = 0.9
# Equal-reward groups at 0.9: nine in ten groups have advantage 0 and add no
# gradient, so each step rests on a handful of prompts (or on none).
NO_SIGNAL_FRACTION = 0.9
# On-policy, the trainer scores the very weights that sampled: even bfloat16
# vLLM sampling against float32 scoring keeps the mean token ratio within about
# 1% of 1, so a mean further away means another distribution is being scored
# (temperature, top-p, dropout, a dtype or weights that were not synced).
RATIO_TOLERANCE = 0.01
# The sampler-trainer log-prob gap is steady while nothing changes; a step five
# times the median of the steps before it marks a change (a weight sync that
# failed, a new dtype path, an engine restart) ...
SAMPLER_GAP_JUMP = 5.0
# ... once it is above 0.01 nats per token, below which the gap is rounding.
SAMPLER_GAP_FLOOR = 0.01
# Entropy below a tenth of its first value while the reward did not improve: the
# policy stopped exploring before it learned (with reward rising, a falling
# entropy is the policy becoming sure of right answers, which is fine).
ENTROPY_COLLAPSE_RATIO = 0.1
# Entropy at twice its first value and up by half a nat: the policy is drifting
# towards uniform noise, the usual sign of a learning rate or a ratio gone wild.
ENTROPY_EXPLOSION_RATIO = 2.0
ENTROPY_EXPLOSION_RISE = 0.5
# PPO's clip touching one token in five: the policy moves so far per update that
# the clip, not the advantage, decides most steps (typical runs clip under 5%).
CLIP_FRACTION_HIGH = 0.2
# The loss moving by 0.1 or more while the reward is flat: the optimizer steps,
# but nothing it does shows in the reward (the GRPO loss is not a progress bar).
LOSS_MOVING_RANGE = 0.1
# A trend needs a few points: below four steps the flat-reward rules stay quiet.
MIN_TREND_STEPS = 4
# lr >= 1e-3 on the tiny model collapses the cpu profile within a few steps
# (training/config/profiles.py); a pretrained model fine-tuned by RL wants 1e-7 to 1e-5,
# so above 1e-4 it is out of range; below 1e-8 AdamW barely moves any weight.
LEARNING_RATE_HIGH_TINY = 1e-3
LEARNING_RATE_HIGH_PRETRAINED = 1e-4
LEARNING_RATE_LOW = 1e-8
# LoRA's best learning rate is about ten times full fine-tuning's, at every rank
# and in RL as in supervised training (J. Schulman and Thinking Machines Lab,
# "LoRA Without Regret", 2025), so a run with adapters has its band ten times
# higher. Its low end is ten times full fine-tuning's usual RL floor (1e-7):
# below 1e-6 the adapters, whose B starts at 0, barely leave the base model.
LORA_RATE_FACTOR = 10.0
LORA_LEARNING_RATE_LOW = 1e-6
# A gradient norm ten times the run's median is an outlier (a bad batch, or the
# start of a divergence), not noise ...
GRADIENT_NORM_SPIKE = 10.0
# ... and a median norm ten times max_grad_norm means every step is clipped: the
# clip, not the gradient, sets the size of each update.
GRADIENT_NORM_CLIPPED = 10.0

# --- the rules ------------------------------------------------------------------------


def rule_responses_truncated(run: Run) -> Finding | str | None:
    points = series(run, "rollout/clipped_fraction")
    if not points:
        return "no rollout/clipped_fraction logged"
    high = _persistent(points, TRUNCATED_FRACTION)
    if not high:
        return None
    flat = reward_is_flat(run)
    return Finding(
        "responses-truncated",
        "error" if flat else "warning",
        "rollout/clipped_fraction",
        _evidence(high),
        f"{len(high)} of {len(points)} steps cut at least {TRUNCATED_FRACTION:.0%} "
        f"of responses at max_new_tokens" + (", with the reward flat" if flat else ""),
        "max_new_tokens is shorter than the answers the task needs (or the model "
        "never emits its end token or stop string)",
        "raise max_new_tokens (or leave it None for the task's own); check the "
        "stop strings; mask_truncated_completions or overlong_buffer keep cut "
        "responses from steering the loss",
    )


def rule_no_signal(run: Run) -> Finding | str | None:
    points = series(run, "train/equal_reward_group_fraction")
    if not points:
        return "no train/equal_reward_group_fraction logged"
    high = _persistent(points, NO_SIGNAL_FRACTION)
    if not high or not reward_is_flat(run, min_steps=1):
        return None  # with the reward rising, equal groups mean solved prompts
    never = all(value >= 1.0 for _, value in points)
    return Finding(
        "no-signal",
        "error" if never else "warning",
        "train/equal_reward_group_fraction",
        _evidence(high),
        f"{len(high)} of {len(points)} steps had at least {NO_SIGNAL_FRACTION:.0%} "
        "of groups with equal rewards (advantage 0), and the reward stayed flat",
        "the task is too hard (or too easy) for the model, the group is too small "
        "to hold a success and a failure, or the reward function never varies",
        "warm up first (sft_max_steps), use an easier task or a larger "
        "group_size, check the reward function on a few responses, or turn on "
        "dynamic_sampling",
    )


def rule_ratio_on_policy(run: Run) -> Finding | str | None:
    config = run.config
    if config is None:
        return "the schedule is unknown (no grpo_lab config.json)"
    on_policy = config.get("epochs_per_rollout_batch", 1) == 1 and config.get(
        "train_batch_size"
    ) == config.get("rollout_batch_size")
    if not on_policy:
        return "the run is off-policy: a ratio away from 1 is expected"
    keys = ["loss/importance_ratio_mean", "loss/ratio_mean"]
    if config_text(run, "backend", "hf") == "hf":  # the sampler is the policy itself
        keys.append("rollout/is_ratio_mean")
    for key in keys:
        away = [(s, v) for s, v in series(run, key) if abs(v - 1) > RATIO_TOLERANCE]
        if away:
            return Finding(
                "ratio-not-one-on-policy",
                "error",
                key,
                _evidence(away),
                f"{len(away)} steps of an on-policy run logged a mean ratio more "
                f"than {RATIO_TOLERANCE} away from 1",
                "the trainer scores a different distribution than the sampler drew "
                "from: a scoring temperature or top-p unlike sampling's, dropout "
                "left on, another dtype, or weights not synced to the sampler",
                "score at the sampling temperature, keep the model in eval-like "
                "determinism (dropout 0), and check that the backend syncs after "
                "every optimizer step",
            )
    return None


def rule_sampler_gap_jump(run: Run) -> Finding | str | None:
    points = series(run, "rollout/sampler_log_prob_diff_mean")
    if not points:
        return "no rollout/sampler_log_prob_diff_mean logged"
    jumps = []
    for index in range(3, len(points)):
        baseline = median(_values(points[:index]))
        step, value = points[index]
        if value > SAMPLER_GAP_FLOOR and value > SAMPLER_GAP_JUMP * baseline:
            jumps.append((step, value))
    if not jumps:
        return None
    return Finding(
        "sampler-gap-jump",
        "warning",
        "rollout/sampler_log_prob_diff_mean",
        _evidence(jumps),
        f"the sampler-trainer log-prob gap jumped above {SAMPLER_GAP_JUMP:g}x its "
        f"earlier median at {len(jumps)} steps",
        "the sampler no longer runs the trainer's weights or numerics (a failed "
        "weight sync, a changed dtype or kernel path, an engine restart)",
        "check the weight sync after each optimizer step and the sampler's dtype; "
        "importance-sampling correction bounds the damage while you look",
    )


def rule_entropy_collapse(run: Run) -> Finding | str | None:
    points = series(run, "loss/token_entropy")
    if len(points) < 2:
        return "fewer than 2 steps logged loss/token_entropy"
    first = points[0][1]
    low = [(s, v) for s, v in points[1:] if v < ENTROPY_COLLAPSE_RATIO * first]
    change = reward_change(run)
    if not low or (change is not None and change >= REWARD_FLAT_CHANGE):
        return None
    return Finding(
        "entropy-collapse",
        "warning",
        "loss/token_entropy",
        _evidence([points[0], *low]),
        f"token entropy fell below {ENTROPY_COLLAPSE_RATIO:g}x its first value "
        f"({first:.3g}) while the reward did not improve",
        "the policy turned deterministic before it learned: too high a learning "
        "rate, or rewards that push one answer regardless",
        "lower lr, add lr_warmup_steps, raise the temperature, or try "
        "cliprange_high (clip-higher) or a small entropy_coef",
    )


def rule_entropy_explosion(run: Run) -> Finding | str | None:
    points = series(run, "loss/token_entropy")
    if len(points) < 2:
        return "fewer than 2 steps logged loss/token_entropy"
    first = points[0][1]
    high = [
        (s, v)
        for s, v in points[1:]
        if v >= ENTROPY_EXPLOSION_RATIO * first and v - first >= ENTROPY_EXPLOSION_RISE
    ]
    if not high:
        return None
    return Finding(
        "entropy-explosion",
        "error",
        "loss/token_entropy",
        _evidence([points[0], *high]),
        f"token entropy rose to {ENTROPY_EXPLOSION_RATIO:g}x its first value "
        f"({first:.3g}) or more",
        "updates are too large: the policy drifts towards uniform noise (a "
        "learning rate too high, an unclipped ratio, an entropy bonus too big)",
        "lower lr, keep max_grad_norm set, clip the ratio, or lower entropy_coef",
    )


def rule_clip_fraction_high(run: Run) -> Finding | str | None:
    points = series(run, "loss/clip_fraction")
    if not points:
        return "no loss/clip_fraction logged (an on-policy run clips nothing)"
    high = _persistent(points, CLIP_FRACTION_HIGH)
    if not high:
        return None
    return Finding(
        "clip-fraction-high",
        "warning",
        "loss/clip_fraction",
        _evidence(high),
        f"{len(high)} of {len(points)} steps clipped at least "
        f"{CLIP_FRACTION_HIGH:.0%} of tokens",
        "each update moves the policy too far from the one that sampled: a high "
        "learning rate, many epochs per rollout batch, or small train batches",
        "lower lr, fewer epochs_per_rollout_batch, a larger train_batch_size",
    )


def rule_reward_flat_loss_moves(run: Run) -> Finding | str | None:
    rewards = series(run, "train/reward_mean")
    losses = series(run, "loss/loss")
    if len(rewards) < MIN_TREND_STEPS or len(losses) < 2:
        return f"fewer than {MIN_TREND_STEPS} steps logged reward and loss"
    spread = max(_values(losses)) - min(_values(losses))
    if not reward_is_flat(run, MIN_TREND_STEPS) or spread < LOSS_MOVING_RANGE:
        return None
    return Finding(
        "reward-flat-loss-moves",
        "warning",
        "loss/loss",
        _evidence(losses),
        f"the loss moved by {spread:.3g} while the reward changed by less than "
        f"{REWARD_FLAT_CHANGE}",
        "the optimizer steps on noise: GRPO's loss is not a progress measure, "
        "and with advantages that carry little signal it moves while nothing "
        "is learned",
        "watch the reward, not the loss; look for no-signal groups, a learning "
        "rate too low to show, or a reward that ignores what the policy changes",
    )


def rule_non_finite(run: Run) -> Finding | str | None:
    bad = []
    for record in run.history:
        for key, value in record.items():
            if _non_finite(key, value):
                bad.append((record["step"], key))
    if not bad:
        return None
    keys = sorted({key for _, key in bad})
    return Finding(
        "non-finite",
        "error",
        keys[0],
        _evidence([(step, None) for step, _ in bad]),
        f"{len(bad)} values were NaN or infinite (null in metrics.jsonl): "
        f"{', '.join(keys[:5])}",
        "a reward that returned NaN, a log-prob of an impossible token, or an "
        "overflow in low precision",
        "check the reward function's output (nan_rewards='ignore' leaves NaN "
        "rewards out), keep float32 for scoring, lower lr",
    )


def _non_finite(key: str, value: Any) -> bool:
    """NaN or inf anywhere; null where metrics.jsonl writes a non-finite number."""
    if isinstance(value, float) and not math.isfinite(value):
        return True
    return value is None and key.startswith(("loss/", "train/", "eval/"))


# A local model folder whose config.json is this narrow is a saved tiny model (a
# run started from another run's checkpoint): the tiny model's range applies.
TINY_HIDDEN_SIZE = 256


def _is_tiny_model(model: str | None) -> bool:
    """ "tiny", or a local folder holding a saved model that narrow."""
    if model == "tiny":
        return True
    if not model:
        return False
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    size = config.get("hidden_size") if isinstance(config, dict) else None
    return isinstance(size, int) and size <= TINY_HIDDEN_SIZE


def rule_learning_rate(run: Run) -> Finding | str | None:
    rank = adapter_rank(run)
    rate_name = "lora_lr" if rank and "lora_lr" in (run.config or {}) else "lr"
    points = series(run, "train/learning_rate")
    configured = config_number(run, rate_name)
    if not points and configured is not None:
        points = [(run.history[-1]["step"], configured)]
    if not points:
        return "no learning rate logged and no readable lr in config.json"
    peak = max(_values(points))
    tiny = _is_tiny_model(config_text(run, "model"))
    high = LEARNING_RATE_HIGH_TINY if tiny else LEARNING_RATE_HIGH_PRETRAINED
    low = LEARNING_RATE_LOW
    if rank:
        high, low = high * LORA_RATE_FACTOR, LORA_LEARNING_RATE_LOW
    if low <= peak < high:
        return None
    too_high = peak >= high
    model = "the tiny model" if tiny else "a pretrained model"
    return Finding(
        "learning-rate-out-of-range",
        "error" if too_high else "warning",
        rate_name if configured is not None else "train/learning_rate",
        _evidence([p for p in points if p[1] == peak]),
        f"the peak learning rate {peak:g} is "
        + (f"at or above {high:g}" if too_high else f"below {low:g}")
        + (f" for LoRA (rank {rank}) on {model}" if rank else f" for {model}"),
        "a learning rate this "
        + (
            "high moves the policy off everything it knew in a few steps"
            if too_high
            else "low leaves the weights where they were"
        )
        + (
            "; LoRA's good rate is about 10x full fine-tuning's (Schulman et al., "
            "'LoRA Without Regret', Thinking Machines Lab, 2025)"
            if rank
            else ""
        ),
        "try lora_lr 2e-3 for the tiny model, 1e-5 to 1e-4 for a pretrained one"
        if rank
        else "try lr 3e-4 for the tiny model, 1e-6 for a 1.5B model, with "
        "lr_warmup_steps",
    )


def rule_gradient_norm(run: Run) -> Finding | str | None:
    points = series(run, "loss/gradient_norm")
    if len(points) < 2:
        return "fewer than 2 steps logged loss/gradient_norm"
    middle = median(_values(points))
    spikes = [(s, v) for s, v in points if v > GRADIENT_NORM_SPIKE * middle]
    clip = config_number(run, "max_grad_norm")
    if clip and middle > GRADIENT_NORM_CLIPPED * clip:
        return Finding(
            "gradient-norm-out-of-range",
            "warning",
            "loss/gradient_norm",
            _evidence(points),
            f"the median gradient norm {middle:.3g} is over "
            f"{GRADIENT_NORM_CLIPPED:g}x max_grad_norm ({clip:g}): every step is "
            "clipped",
            "the loss is scaled up (a constant normalization with a small "
            "constant, a large entropy or KL coefficient) or the policy diverges",
            "check loss_normalization and its constant, lower lr or the "
            "coefficients; the clip then stops deciding every step",
        )
    if not spikes:
        return None
    return Finding(
        "gradient-norm-out-of-range",
        "warning",
        "loss/gradient_norm",
        _evidence(spikes),
        f"{len(spikes)} steps had a gradient norm over {GRADIENT_NORM_SPIKE:g}x "
        f"the run's median ({middle:.3g})",
        "an outlier batch (a few very long or very unlikely responses) or the "
        "start of a divergence",
        "keep max_grad_norm set, lower lr; look at the responses of those steps",
    )
