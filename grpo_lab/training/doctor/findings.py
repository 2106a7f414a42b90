"""The doctor's data: a run's per-step series, a finding, a diagnosis, and the
small helpers every rule shares (series, evidence, the reward's trend)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# "error": the run cannot learn as it is; "warning": it may learn, badly;
# "info": it looks wrong and is not (said so, with the reason).
SEVERITIES = ("error", "warning", "info")
# Evidence lists at most this many (step, value) pairs.
MAX_EVIDENCE = 6
# A change of the mean reward from the first to the last third of the run below
# 0.05 counts as flat: this package's rewards lie in [0, 1], and 0.05 is five
# points of accuracy, above the step-to-step noise of a batch of a few hundred.
REWARD_FLAT_CHANGE = 0.05
# "Persistently": in at least half of the steps that log the metric.
PERSISTENT_SHARE = 0.5


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
    kind: str  # "grpo_lab", "trl" or "verl"
    history: list[dict[str, Any]]
    config: dict[str, Any] | None = None
    # One line per part of the files that could not be read ("metrics.jsonl
    # line 7: not JSON (...)"): left out of every rule.
    unreadable: list[str] = field(default_factory=list)
    # The steps in the order the file logged them (``history`` is sorted).
    logged_steps: list[int] = field(default_factory=list)
    # peft's adapter_config.json beside a TRL run's state (None: none found).
    adapter_config: dict[str, Any] | None = None


@dataclass
class Diagnosis:
    """Every finding on a run, the rules that could not be checked, and the
    lines of its files that could not be read."""

    source: str
    kind: str
    steps: int
    findings: list[Finding] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    unreadable: list[str] = field(default_factory=list)

    @property
    def has_errors(self) -> bool:
        """True when any finding is an ``error`` (``grpo-lab doctor`` exits 1)."""
        return any(finding.severity == "error" for finding in self.findings)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy (evidence pairs as lists, non-finite values None)."""
        plain = asdict(self)
        for finding in plain["findings"]:
            finding["evidence"] = [
                [step, finite_or_none(value)] for step, value in finding["evidence"]
            ]
        return plain


Rule = Callable[[Run], "Finding | str | None"]


def finite_or_none(value: Any) -> float | None:
    """``value`` as a finite float, or None."""
    if is_finite_number(value):
        return float(value)
    return None


def is_finite_number(value: Any) -> bool:
    """An int or float (not a bool) that is finite as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int past the float range
        return False


def series(run: Run, key: str) -> list[tuple[int, float]]:
    """(step, value) of every step that logged ``key`` with a finite number."""
    return [
        (record["step"], float(record[key]))
        for record in run.history
        if is_finite_number(record.get(key))
    ]


def first_series(run: Run, keys: tuple[str, ...]) -> tuple[str, list]:
    """The first of ``keys`` the run logged, and its series ("", [] if none)."""
    for key in keys:
        points = series(run, key)
        if points:
            return key, points
    return "", []


def values(points: list[tuple[int, float]]) -> list[float]:
    return [value for _, value in points]


def mean(numbers: list[float]) -> float:
    """The mean without overflow errors: huge values give inf, not an exception."""
    total = 0.0
    for number in numbers:
        total += number / len(numbers)
    return total


def median(numbers: list[float]) -> float:
    return statistics.median(numbers)


def evidence(points: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
    """At most MAX_EVIDENCE pairs: the first ones and the last one."""
    if len(points) <= MAX_EVIDENCE:
        return list(points)
    return [*points[: MAX_EVIDENCE - 1], points[-1]]


def window(count: int) -> int:
    """Steps in a start or end window: a tenth of the run, at least 3."""
    return max(3, count // 10)


def reward_change(run: Run) -> float | None:
    """Mean reward of the last third of steps minus that of the first third."""
    rewards = values(series(run, "train/reward_mean"))
    if len(rewards) < 2:
        return None
    third = max(1, len(rewards) // 3)
    return mean(rewards[-third:]) - mean(rewards[:third])


def reward_is_flat(run: Run, min_steps: int = 2) -> bool:
    """True when the reward moved less than REWARD_FLAT_CHANGE over the run."""
    change = reward_change(run)
    steps = len(series(run, "train/reward_mean"))
    return (
        change is not None and steps >= min_steps and abs(change) < REWARD_FLAT_CHANGE
    )


def persistent(points: list[tuple[int, float]], above: float) -> list:
    """The points at or above ``above`` when they are at least PERSISTENT_SHARE
    of all."""
    high = [(s, v) for s, v in points if v >= above]
    return high if points and len(high) >= PERSISTENT_SHARE * len(points) else []


def config_number(run: Run, name: str) -> float | None:
    """The config's ``name`` when it is a finite number (None otherwise)."""
    value = (run.config or {}).get(name)
    return float(value) if is_finite_number(value) else None


def adapter_rank(run: Run) -> int:
    """The run's LoRA rank: config.json's lora_rank, else the r of peft's
    adapter_config.json beside a TRL run; 0 for full fine-tuning (or unknown)."""
    for source, key in ((run.config, "lora_rank"), (run.adapter_config, "r")):
        rank = (source or {}).get(key)
        if is_finite_number(rank) and rank > 0:
            return int(rank)
    return 0


def config_text(run: Run, name: str, default: str | None = None) -> str | None:
    """The config's ``name`` when it is a string (``default`` when absent)."""
    config = run.config or {}
    if name not in config:
        return default
    value = config[name]
    return value if isinstance(value, str) else None
