"""The doctor's rules on a run's course: a loss at 0, KL spikes, groups of mixed
prompts, a late reward collapse, lengths that run away or collapse, a reward
flat while groups carry signal, steps logged out of order.

Each rule cites the public thread where users met the problem; the thresholds
are named constants with the reason for their value.
"""

from __future__ import annotations

import itertools

from grpo_lab.training.doctor.findings import (
    PERSISTENT_SHARE,
    REWARD_FLAT_CHANGE,
    Finding,
    Run,
    evidence,
    first_series,
    mean,
    median,
    reward_change,
    series,
    values,
    window,
)

# |loss| under 1e-3 is "0" as logs show it (TRL prints 4 decimals).
LOSS_NEAR_ZERO = 1e-3
# A gradient norm under 1e-6 is no gradient: every advantage was 0.
GRADIENT_NORM_ZERO = 1e-6
# A KL (per token, nats) ten times the largest of the five steps before it,
# once above 0.01: the policy jumped, it did not drift (a steady KL grows by a
# few percent a step, and 0.01 is above the KL of early, healthy steps).
KL_SPIKE_FACTOR = 10.0
KL_SPIKE_FLOOR = 0.01
KL_BASELINE_STEPS = 5
# verl's GRPO gives a group of one response advantage = its raw score (mean 0,
# std 1): the batch's advantage mean within 10% of its score mean, a score mean
# above 0.05, marks groups of one (correct groups centre advantages near 0).
SINGLETON_ADVANTAGE_TOLERANCE = 0.1
SINGLETON_MIN_SCORE = 0.05
# A late collapse: the smoothed reward rose by 0.1 or more (ten points of
# accuracy), then the last window lost half of that gain or more.
COLLAPSE_MIN_GAIN = 0.1
COLLAPSE_LOST_SHARE = 0.5
# Lengths that run away: the last window's mean 1.5x the first window's, with
# half of the responses cut at max_new_tokens; without truncation logged, 3x.
RUNAWAY_RATIO = 1.5
RUNAWAY_CLIPPED = 0.5
RUNAWAY_RATIO_UNCLIPPED = 3.0
# Lengths that collapse: the last window's mean at half the first's or below.
COLLAPSE_LENGTH_RATIO = 0.5
MIN_COURSE_STEPS = 6  # the course rules need a start and an end window

LENGTH_KEYS = ("train/response_length",)
KL_KEYS = ("loss/kl_mean", "loss/ppo_kl")


def rule_loss_near_zero(run: Run) -> Finding | str | None:
    """The loss is ~0: normal when the gradient norm is not, an error when it
    is 0 too.

    With one optimizer step per batch the ratio pi / pi_old is exactly 1 when
    the loss is computed and the advantages are centred per group, so the loss
    averages to ~0 while its gradient does not: TRL's maintainers answer this
    in huggingface/trl#2703 and huggingface/trl#3452 (and huggingface/open-r1#239).
    With grad_norm 0 too, nothing trains (huggingface/trl#3857: loss 0,
    grad_norm 0, frac_reward_zero_std 1).
    """
    losses = series(run, "loss/loss")
    if not losses:
        return "no loss/loss logged"
    near = [(s, v) for s, v in losses if abs(v) < LOSS_NEAR_ZERO]
    if len(near) < max(1, PERSISTENT_SHARE * len(losses)):
        return None
    norms = dict(series(run, "loss/gradient_norm"))
    logged = [(s, norms[s]) for s, _ in near if s in norms]
    if not logged:
        return "the loss is ~0 but no loss/gradient_norm was logged to judge it"
    dead = [(s, g) for s, g in logged if g < GRADIENT_NORM_ZERO]
    if len(dead) >= PERSISTENT_SHARE * len(logged):
        return Finding(
            "loss-near-zero",
            "error",
            "loss/gradient_norm",
            evidence(dead),
            f"the loss was ~0 in {len(near)} of {len(losses)} steps and so was "
            f"the gradient norm in {len(dead)} of them: nothing trained",
            "every advantage was 0: each group's rewards were equal (a task "
            "too hard or too easy, a reward that never varies), or every "
            "response was masked out",
            "see no-signal and responses-truncated; check the reward on a few "
            "responses, warm up first, raise group_size or turn on "
            "dynamic_sampling",
        )
    return Finding(
        "loss-near-zero",
        "info",
        "loss/loss",
        evidence(near),
        f"the loss was ~0 in {len(near)} of {len(losses)} steps while the "
        f"gradient norm was not (median {median(values(logged)):.3g}): this is "
        "expected",
        "with one update per batch the ratio is 1 and the advantages are "
        "centred per group, so the loss averages to ~0; its gradient does not",
        "nothing to fix: watch the reward, not the loss (kl_coef > 0 adds the "
        "KL term back to the value)",
    )


def rule_kl_spike(run: Run) -> Finding | str | None:
    """The KL jumps to ten times its recent level: the policy leapt in one step.

    Reported as early loss and gradient spikes under GRPO's KL penalty in
    natolambert/rlhf-book#489, as a KL in the thousands from the first step in
    huggingface/trl#3500 (dropout left on), and as kl_loss rising "crazily"
    before an off-policy collapse in zhangxy-2019/critique-GRPO#6.
    """
    logged = [(key, series(run, key)) for key in KL_KEYS]
    logged = [(key, points) for key, points in logged if len(points) > 3]
    if not logged:
        return "fewer than 4 steps logged loss/kl_mean or loss/ppo_kl"
    found = [(key, spikes) for key, points in logged if (spikes := _spikes(points))]
    if not found:
        return None
    key, spikes = found[0]
    return Finding(
        "kl-spike",
        "warning",
        key,
        evidence(spikes),
        f"the KL jumped above {KL_SPIKE_FACTOR:g}x the largest of the "
        f"{KL_BASELINE_STEPS} steps before at {len(spikes)} steps",
        "one update moved the policy far: a learning rate too high (or a "
        "warm-up too short), a batch of very unlikely tokens, a ratio left "
        "unclipped, or dropout making scoring random",
        "lower lr or add lr_warmup_steps, keep max_grad_norm set, clip the "
        "ratio; look at the responses of those steps",
    )


def _spikes(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """The points above KL_SPIKE_FLOOR and KL_SPIKE_FACTOR x the largest of the
    KL_BASELINE_STEPS before them (three at least)."""
    spikes = []
    for index in range(3, len(points)):
        recent = values(points[max(0, index - KL_BASELINE_STEPS) : index])
        step, value = points[index]
        if value > KL_SPIKE_FLOOR and value > KL_SPIKE_FACTOR * max(recent):
            spikes.append((step, value))
    return spikes


def rule_group_sanity(run: Run) -> Finding | str | None:
    """A group's responses answer different prompts: GRPO's group statistics
    then compare unrelated answers, and the advantage is batch normalisation.

    PeterGriffinJin/Search-R1#88: the same prompts were not given the same id,
    so GRPO "degrades" to batch normalisation (and later collapsed, #89);
    StarsfieldAI/R1-V#67 shows the interleaved layout (P1_G1, P2_G1, ...) that
    ``view(-1, G)`` then groups wrongly.
    """
    mixed = series(run, "train/mixed_prompt_group_fraction")
    if mixed:
        bad = [(s, v) for s, v in mixed if v > 0]
        if not bad:
            return None
        return _mixed_groups_finding(
            "train/mixed_prompt_group_fraction",
            bad,
            f"{len(bad)} of {len(mixed)} steps had groups whose responses "
            "answer different prompts",
        )
    if run.kind == "verl":
        return _verl_singleton_groups(run)
    return "no train/mixed_prompt_group_fraction logged"


def _verl_singleton_groups(run: Run) -> Finding | str | None:
    scores = dict(series(run, "train/reward_mean"))
    pairs = [
        (s, a, scores[s]) for s, a in series(run, "train/advantage_mean") if s in scores
    ]
    if len(pairs) < 3:
        return "fewer than 3 steps logged critic/score/mean and critic/advantages"
    raw = [
        (s, a)
        for s, a, score in pairs
        if abs(score) > SINGLETON_MIN_SCORE
        and abs(a - score) <= SINGLETON_ADVANTAGE_TOLERANCE * abs(score)
    ]
    if len(raw) < PERSISTENT_SHARE * len(pairs):
        return None
    return _mixed_groups_finding(
        "train/advantage_mean",
        raw,
        f"in {len(raw)} of {len(pairs)} steps the mean advantage equalled the "
        "mean score: each response was its own group",
    )


def _mixed_groups_finding(metric: str, points: list, summary: str) -> Finding:
    return Finding(
        "group-sanity",
        "error",
        metric,
        evidence(points),
        summary,
        "the responses are not grouped by prompt: a layout that interleaves "
        "prompts (P1_G1, P2_G1, ...) reshaped as if prompt-major, or ids that "
        "differ for copies of one prompt (verl groups by uid)",
        "keep the G responses of a prompt together (repeat_interleave, not "
        "repeat) or give every copy of a prompt the same id",
    )


def rule_late_reward_collapse(run: Run) -> Finding | str | None:
    """The reward rose, then fell back late in the run.

    PeterGriffinJin/Search-R1#89 (normal up to step 600, then a collapse),
    BeastyZ/ConvSearch-R1#6 (the reward drops to zero after ~270 steps) and
    AMAP-ML/Tree-GRPO#5 (critic/score/mean falls sharply near the end).
    """
    points = series(run, "train/reward_mean")
    if len(points) < MIN_COURSE_STEPS:
        return f"fewer than {MIN_COURSE_STEPS} steps logged train/reward_mean"
    size = window(len(points))
    smoothed = [
        (points[i + size - 1][0], mean(values(points[i : i + size])))
        for i in range(len(points) - size + 1)
    ]
    start, end = smoothed[0][1], smoothed[-1][1]
    peak_step, peak = max(smoothed[:-size] or smoothed[:1], key=lambda p: p[1])
    gain = peak - start
    if gain < COLLAPSE_MIN_GAIN or peak - end < COLLAPSE_LOST_SHARE * gain:
        return None
    return Finding(
        "late-reward-collapse",
        "error",
        "train/reward_mean",
        [(peak_step, peak), *evidence(points[-size:])],
        f"the reward (mean of {size} steps) rose from {start:.3g} to {peak:.3g} "
        f"by step {peak_step}, then fell to {end:.3g}",
        "the policy left the region where it learned: too high a learning "
        "rate for late training, an entropy collapse or explosion, a reward "
        "the policy learned to break, or a sampler that drifted from the trainer",
        "resume from the checkpoint before the peak with a lower lr; look at "
        "entropy, KL and lengths near the peak; a small kl_coef or "
        "sampler_correction keeps the policy near what it knew",
    )


def rule_length_runaway(run: Run) -> Finding | str | None:
    """Responses grow until max_new_tokens cuts them.

    verl-project/verl#2736 (GRPO runs that repeatedly crash once the length hits
    the ceiling), verl-project/verl#1224 (response length exceptionally high
    after 1k steps) and facebookresearch/SPG#2 (a collapse into "!!!!" up to
    the length limit).
    """
    _, lengths = first_series(run, LENGTH_KEYS)
    if len(lengths) < MIN_COURSE_STEPS:
        return f"fewer than {MIN_COURSE_STEPS} steps logged train/response_length"
    size = window(len(lengths))
    first, last = mean(values(lengths[:size])), mean(values(lengths[-size:]))
    clipped = values(series(run, "rollout/clipped_fraction"))
    if clipped:
        cut = mean(clipped[-size:])
        runaway = last >= RUNAWAY_RATIO * first and cut >= RUNAWAY_CLIPPED
    else:
        cut = None
        runaway = last >= RUNAWAY_RATIO_UNCLIPPED * first
    if not runaway:
        return None
    change = reward_change(run)
    fell = change is not None and change <= -REWARD_FLAT_CHANGE
    return Finding(
        "length-runaway",
        "error" if fell else "warning",
        "train/response_length",
        evidence(lengths[:1] + lengths[-size:]),
        f"the mean response length grew from {first:.3g} to {last:.3g} tokens"
        + (f", with {cut:.0%} of the last responses cut" if cut is not None else "")
        + (" while the reward fell" if fell else ""),
        "the policy stopped ending its answers (its end token lost "
        "probability: a high learning rate, repetition loops) or the loss "
        "favours long responses (sequence-mean normalization dilutes each "
        "token of a long wrong answer)",
        "lower lr; use overlong_buffer or mask_truncated_completions so cut "
        "responses stop steering the loss; loss_normalization 'token' or "
        "'constant' removes the length bias",
    )


def rule_length_collapse(run: Run) -> Finding | str | None:
    """Responses shrink to a fraction of their first length.

    hiyouga/EasyR1#40 (response length declining over GRPO training),
    LLM360/Reasoning360#141 (training significantly decreases the response
    length) and huggingface/trl#522 (responses shorter and shorter, down to
    EOS, with the reward at its lowest).
    """
    _, lengths = first_series(run, LENGTH_KEYS)
    if len(lengths) < MIN_COURSE_STEPS:
        return f"fewer than {MIN_COURSE_STEPS} steps logged train/response_length"
    size = window(len(lengths))
    first, last = mean(values(lengths[:size])), mean(values(lengths[-size:]))
    if first <= 0 or last > COLLAPSE_LENGTH_RATIO * first:
        return None
    change = reward_change(run)
    improved = change is not None and change >= REWARD_FLAT_CHANGE
    return Finding(
        "length-collapse",
        "warning" if improved else "error",
        "train/response_length",
        evidence(lengths[:1] + lengths[-size:]),
        f"the mean response length fell from {first:.3g} to {last:.3g} tokens"
        + (" as the reward rose" if improved else " and the reward did not improve"),
        "short responses are paid more (a length penalty, a format reward met "
        "by an empty answer, truncation that only punishes long answers) or "
        "the end token became the likeliest token",
        "check what the reward pays for a short or empty response; raise "
        "max_new_tokens if cut answers score 0; lower lr",
    )


# A reward flat over this many steps while at least half of the groups carry
# signal (rewards that differ within a group, so advantages that are not 0):
# each such step pushes the policy towards its better responses, and fifty of
# them that leave the mean reward where it was mean the updates do not reach
# what is sampled. Shorter runs are left to the other flat-reward rules.
FLAT_WITH_SIGNAL_STEPS = 50
SIGNAL_SHARE = 0.5


def rule_reward_flat_with_signal(run: Run) -> Finding | str | None:
    """The last FLAT_WITH_SIGNAL_STEPS steps: reward flat, groups with signal."""
    equal = dict(series(run, "train/equal_reward_group_fraction"))
    if not equal:
        return "no train/equal_reward_group_fraction logged"
    rewards = series(run, "train/reward_mean")
    if len(rewards) < FLAT_WITH_SIGNAL_STEPS:
        return f"fewer than {FLAT_WITH_SIGNAL_STEPS} steps logged train/reward_mean"
    last = rewards[-FLAT_WITH_SIGNAL_STEPS:]
    third = FLAT_WITH_SIGNAL_STEPS // 3
    change = mean(values(last[-third:])) - mean(values(last[:third]))
    signal = [1 - equal[step] for step, _ in last if step in equal]
    if abs(change) >= REWARD_FLAT_CHANGE or not signal or mean(signal) < SIGNAL_SHARE:
        return None
    return Finding(
        "reward-flat-with-signal",
        "warning",
        "train/reward_mean",
        evidence(last),
        f"the reward changed by {change:+.3f} over the last {len(last)} steps "
        f"while {mean(signal):.0%} of groups carried signal (rewards that differ)",
        "the updates do not change what is sampled: a learning rate too low to "
        "show (LoRA at full fine-tuning's rate), weights not synced to the "
        "sampler, or a reward the policy's changes cannot reach",
        "check the learning rate (lora_lr about 10x full fine-tuning's lr), that "
        "the sampler gets each step's weights, and a few responses against the "
        "reward function",
    )


def rule_steps_out_of_order(run: Run) -> Finding | str | None:
    """A log whose steps go back: two runs in one file, a resume, a reversal."""
    steps = run.logged_steps
    if len(steps) < 2:
        return "fewer than 2 steps logged"
    back = [
        (later, float(earlier))
        for earlier, later in itertools.pairwise(steps)
        if later < earlier
    ]
    if not back:
        return None
    first_later, first_earlier = back[0]
    return Finding(
        "steps-out-of-order",
        "warning",
        "step",
        evidence(back),
        f"the log goes back {len(back)} time(s) (step {first_later} right after "
        f"step {first_earlier:.0f}); the evidence pairs each step with the one "
        "logged before it",
        "two runs appended to one log, a resume that logged its steps again, or "
        "a log written in reverse; the doctor reads the steps sorted, and a "
        "repeated step keeps its later line",
        "give each run its own folder (or log file), or cut the log where it goes back",
    )
