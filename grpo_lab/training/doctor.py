"""The run doctor: read a finished (or running) run's metrics and name its problems.

``diagnose(path)`` reads a grpo_lab run folder (``metrics.jsonl`` and
``config.json``) or a TRL ``GRPOTrainer`` output (``trainer_state.json``, its
``log_history`` mapped onto this package's metric names: :data:`TRL_KEYS`) and
applies each rule of :data:`RULES` to the per-step series. A finding names its
rule, a severity (``error``: the run cannot learn as it is; ``warning``: it may
learn, badly), the evidence (the steps and values that tripped it), a one-line
likely cause and what to try. A rule whose metrics the run did not log is
skipped, and the report says so. ``grpo-lab doctor RUN_DIR`` prints the report.

The thresholds are named constants below, each with the reason for its value;
they are rules of thumb for spotting a run worth a second look, not proofs.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from grpo_lab.training.metrics import METRICS_FILE, read_metrics, step_records

TRL_STATE_FILE = "trainer_state.json"
CONFIG_FILE = "config.json"

# TRL 1.16's GRPOTrainer log keys (trl/trainer/grpo_trainer.py) -> ours.
TRL_KEYS = {
    "reward": "train/reward_mean",
    "frac_reward_zero_std": "train/equal_reward_group_fraction",
    "completions/mean_length": "train/response_length",
    "completions/clipped_ratio": "rollout/clipped_fraction",
    "completions/mean_terminated_length": "rollout/terminated_length_mean",
    "entropy": "loss/token_entropy",
    "clip_ratio/region_mean": "loss/clip_fraction",
    "loss": "loss/loss",
    "grad_norm": "loss/gradient_norm",
    "learning_rate": "train/learning_rate",
    "sampling/sampling_logp_difference/mean": "rollout/sampler_log_prob_diff_mean",
    "sampling/sampling_logp_difference/max": "rollout/sampler_log_prob_diff_max",
    "sampling/importance_sampling_ratio/min": "rollout/is_ratio_min",
    "sampling/importance_sampling_ratio/mean": "rollout/is_ratio_mean",
    "sampling/importance_sampling_ratio/max": "rollout/is_ratio_max",
}

# --- thresholds -----------------------------------------------------------------------

# Most responses cut at max_new_tokens: at 0.9 almost every reward scores a
# cut-off answer, so the reward says more about the length limit than the policy.
TRUNCATED_FRACTION = 0.9
# Equal-reward groups at 0.9: nine in ten groups have advantage 0 and add no
# gradient, so each step rests on a handful of prompts (or on none).
NO_SIGNAL_FRACTION = 0.9
# A change of the mean reward from the first to the last third of the run below
# 0.05 counts as flat: this package's rewards lie in [0, 1], and 0.05 is five
# points of accuracy, above the step-to-step noise of a batch of a few hundred.
REWARD_FLAT_CHANGE = 0.05
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
# "Persistently": in at least half of the steps that log the metric.
PERSISTENT_SHARE = 0.5
# The loss moving by 0.1 or more while the reward is flat: the optimizer steps,
# but nothing it does shows in the reward (the GRPO loss is not a progress bar).
LOSS_MOVING_RANGE = 0.1
# A trend needs a few points: below four steps the flat-reward rules stay quiet.
MIN_TREND_STEPS = 4
# lr >= 1e-3 on the tiny model collapses the cpu profile within a few steps
# (training/config.py); a pretrained model fine-tuned by RL wants 1e-7 to 1e-5,
# so above 1e-4 it is out of range; below 1e-8 AdamW barely moves any weight.
LEARNING_RATE_HIGH_TINY = 1e-3
LEARNING_RATE_HIGH_PRETRAINED = 1e-4
LEARNING_RATE_LOW = 1e-8
# A gradient norm ten times the run's median is an outlier (a bad batch, or the
# start of a divergence), not noise ...
GRADIENT_NORM_SPIKE = 10.0
# ... and a median norm ten times max_grad_norm means every step is clipped: the
# clip, not the gradient, sets the size of each update.
GRADIENT_NORM_CLIPPED = 10.0
# Evidence lists at most this many (step, value) pairs.
MAX_EVIDENCE = 6

SEVERITIES = ("error", "warning")


@dataclass(frozen=True)
class Finding:
    """One problem: which rule, how bad, the evidence, its likely cause, a fix."""

    rule: str
    severity: str
    metric: str
    # (step, value) pairs that tripped the rule (value None: not finite).
    evidence: list[tuple[int, float | None]]
    summary: str
    cause: str
    advice: str


@dataclass
class Run:
    """A run's per-step metrics under this package's names, and what produced it."""

    source: Path
    kind: str  # "grpo_lab" or "trl"
    history: list[dict[str, Any]]
    config: dict[str, Any] | None = None


@dataclass
class Diagnosis:
    """Every finding on a run, and the rules that could not be checked."""

    source: str
    kind: str
    steps: int
    findings: list[Finding] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy (evidence pairs as lists)."""
        return asdict(self)


# --- reading a run --------------------------------------------------------------------


def load_run(path: str | Path) -> Run:
    """The run at ``path``: a grpo_lab run folder or its metrics.jsonl, a TRL
    output folder, one of its ``checkpoint-*`` folders, or a trainer_state.json.

    Raises ValueError naming the path when it holds neither.
    """
    path = Path(path)
    if path.is_file():
        if path.name == TRL_STATE_FILE:
            return _load_trl(path)
        if path.name == METRICS_FILE:
            return _load_grpo_lab(path.parent)
        raise ValueError(
            f"RUN_DIR must be a run folder, {METRICS_FILE} or {TRL_STATE_FILE}, "
            f"got the file {str(path)!r}"
        )
    if not path.is_dir():
        raise ValueError(f"RUN_DIR must be an existing folder, got {str(path)!r}")
    if (path / METRICS_FILE).is_file():
        return _load_grpo_lab(path)
    if (path / TRL_STATE_FILE).is_file():
        return _load_trl(path / TRL_STATE_FILE)
    checkpoints = sorted(
        path.glob(f"checkpoint-*/{TRL_STATE_FILE}"), key=_checkpoint_number
    )
    if checkpoints:  # the latest checkpoint's state holds the whole log
        return _load_trl(checkpoints[-1])
    raise ValueError(
        f"RUN_DIR must hold {METRICS_FILE} (grpo-lab train) or {TRL_STATE_FILE} "
        f"(TRL, also in a checkpoint-* folder), and {str(path)!r} holds neither"
    )


def _checkpoint_number(state: Path) -> int:
    digits = state.parent.name.removeprefix("checkpoint-")
    return int(digits) if digits.isdigit() else -1


def _load_grpo_lab(run_dir: Path) -> Run:
    history = step_records(read_metrics(run_dir))
    history = [r for r in history if r["step"] > 0]  # step 0: evaluation only
    if not history:
        raise ValueError(
            f"RUN_DIR must hold at least one GRPO step, and "
            f"{str(run_dir / METRICS_FILE)!r} has none"
        )
    config = None
    config_path = run_dir / CONFIG_FILE
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            config = None
    return Run(run_dir / METRICS_FILE, "grpo_lab", history, config)


def _load_trl(state_path: Path) -> Run:
    try:
        state = json.loads(state_path.read_text(encoding="utf-8"))
        log = state["log_history"]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise ValueError(
            f"RUN_DIR's {TRL_STATE_FILE} must be TRL's JSON with a log_history, "
            f"and {str(state_path)!r} is not ({error})"
        ) from error
    history = [mapped for entry in log if (mapped := trl_record(entry))]
    if not history:
        raise ValueError(
            f"RUN_DIR must hold at least one logged training step, and "
            f"{str(state_path)!r} has none"
        )
    return Run(state_path, "trl", history)


def trl_record(entry: dict[str, Any]) -> dict[str, Any] | None:
    """One TRL log_history entry under our names (None: no training metrics)."""
    if not isinstance(entry, dict) or "step" not in entry:
        return None
    record = {TRL_KEYS[k]: v for k, v in entry.items() if k in TRL_KEYS}
    return {"step": entry["step"], **record} if record else None


# --- series ---------------------------------------------------------------------------


def series(run: Run, key: str) -> list[tuple[int, float]]:
    """(step, value) of every step that logged ``key`` with a finite number."""
    return [
        (record["step"], float(record[key]))
        for record in run.history
        if _is_finite_number(record.get(key))
    ]


def _is_finite_number(value: Any) -> bool:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return number and math.isfinite(value)


def _values(points: list[tuple[int, float]]) -> list[float]:
    return [value for _, value in points]


def _evidence(points: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
    """At most MAX_EVIDENCE pairs: the first ones and the last one."""
    if len(points) <= MAX_EVIDENCE:
        return list(points)
    return [*points[: MAX_EVIDENCE - 1], points[-1]]


def reward_change(run: Run) -> float | None:
    """Mean reward of the last third of steps minus that of the first third."""
    rewards = _values(series(run, "train/reward_mean"))
    if len(rewards) < 2:
        return None
    third = max(1, len(rewards) // 3)
    return statistics.fmean(rewards[-third:]) - statistics.fmean(rewards[:third])


def reward_is_flat(run: Run, min_steps: int = 2) -> bool:
    """True when the reward moved less than REWARD_FLAT_CHANGE over the run."""
    change = reward_change(run)
    steps = len(series(run, "train/reward_mean"))
    return (
        change is not None and steps >= min_steps and abs(change) < REWARD_FLAT_CHANGE
    )


def _persistent(
    points: list[tuple[int, float]], above: float
) -> list[tuple[int, float]]:
    """The points above ``above`` when they are at least PERSISTENT_SHARE of all."""
    high = [(s, v) for s, v in points if v >= above]
    return high if points and len(high) >= PERSISTENT_SHARE * len(points) else []


# --- the rules ------------------------------------------------------------------------

Rule = Callable[[Run], "Finding | str | None"]


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
    if config.get("backend", "hf") == "hf":  # the sampler is the policy itself
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
        baseline = statistics.median(_values(points[:index]))
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


def rule_learning_rate(run: Run) -> Finding | str | None:
    points = series(run, "train/learning_rate")
    config = run.config or {}
    if not points and "lr" in config:
        points = [(run.history[-1]["step"], float(config["lr"]))]
    if not points:
        return "no learning rate logged and no config.json"
    peak = max(_values(points))
    tiny = config.get("model") == "tiny"
    high = LEARNING_RATE_HIGH_TINY if tiny else LEARNING_RATE_HIGH_PRETRAINED
    if LEARNING_RATE_LOW <= peak < high:
        return None
    too_high = peak >= high
    return Finding(
        "learning-rate-out-of-range",
        "error" if too_high else "warning",
        "train/learning_rate" if "lr" not in config else "lr",
        _evidence([p for p in points if p[1] == peak]),
        f"the peak learning rate {peak:g} is "
        + (f"at or above {high:g}" if too_high else f"below {LEARNING_RATE_LOW:g}")
        + (" for the tiny model" if tiny else " for a pretrained model"),
        "a learning rate this "
        + (
            "high moves the policy off everything it knew in a few steps"
            if too_high
            else "low leaves the weights where they were"
        ),
        "try lr 3e-4 for the tiny model, 1e-6 for a 1.5B model, with lr_warmup_steps",
    )


def rule_gradient_norm(run: Run) -> Finding | str | None:
    points = series(run, "loss/gradient_norm")
    if len(points) < 2:
        return "fewer than 2 steps logged loss/gradient_norm"
    median = statistics.median(_values(points))
    spikes = [(s, v) for s, v in points if v > GRADIENT_NORM_SPIKE * median]
    clip = (run.config or {}).get("max_grad_norm")
    if clip and median > GRADIENT_NORM_CLIPPED * clip:
        return Finding(
            "gradient-norm-out-of-range",
            "warning",
            "loss/gradient_norm",
            _evidence(points),
            f"the median gradient norm {median:.3g} is over "
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
        f"the run's median ({median:.3g})",
        "an outlier batch (a few very long or very unlikely responses) or the "
        "start of a divergence",
        "keep max_grad_norm set, lower lr; look at the responses of those steps",
    )


RULES: dict[str, Rule] = {
    "responses-truncated": rule_responses_truncated,
    "no-signal": rule_no_signal,
    "ratio-not-one-on-policy": rule_ratio_on_policy,
    "sampler-gap-jump": rule_sampler_gap_jump,
    "entropy-collapse": rule_entropy_collapse,
    "entropy-explosion": rule_entropy_explosion,
    "clip-fraction-high": rule_clip_fraction_high,
    "reward-flat-loss-moves": rule_reward_flat_loss_moves,
    "non-finite": rule_non_finite,
    "learning-rate-out-of-range": rule_learning_rate,
    "gradient-norm-out-of-range": rule_gradient_norm,
}


# --- the report -----------------------------------------------------------------------


def diagnose(path: str | Path | Run) -> Diagnosis:
    """Every rule applied to the run at ``path`` (see :func:`load_run`)."""
    run = path if isinstance(path, Run) else load_run(path)
    diagnosis = Diagnosis(str(run.source), run.kind, len(run.history))
    for name, rule in RULES.items():
        outcome = rule(run)
        if isinstance(outcome, Finding):
            diagnosis.findings.append(outcome)
        elif isinstance(outcome, str):
            diagnosis.skipped[name] = outcome
    diagnosis.findings.sort(key=lambda f: SEVERITIES.index(f.severity))
    return diagnosis


def format_report(diagnosis: Diagnosis) -> str:
    """The diagnosis as plain text: one block per finding, then skipped rules."""
    lines = [
        f"{diagnosis.source} ({diagnosis.kind}, {diagnosis.steps} steps): "
        + (
            f"{len(diagnosis.findings)} finding(s)"
            if diagnosis.findings
            else "no findings"
        )
    ]
    for finding in diagnosis.findings:
        evidence = ", ".join(
            f"step {step}: {'non-finite' if value is None else f'{value:.4g}'}"
            for step, value in finding.evidence
        )
        lines += [
            "",
            f"[{finding.severity}] {finding.rule}: {finding.summary}",
            f"  evidence ({finding.metric}): {evidence}",
            f"  likely cause: {finding.cause}",
            f"  try: {finding.advice}",
        ]
    if diagnosis.skipped:
        lines += ["", "not checked:"]
        lines += [f"  {name}: {why}" for name, why in diagnosis.skipped.items()]
    return "\n".join(lines)
