"""What the KL term's frozen reference model costs: the cpu profile with and without it.

Each case trains the cpu profile's run in a fresh process (`train()` in-process,
so the process's own peak resident memory is the run's): once with
`kl_coef=0` (no reference model: nothing is built or scored) and once with
`kl_coef > 0` (a frozen copy of the policy, scored once per rollout batch
without gradient through the update's scorer). Time per GRPO step is the mean
of the steps' `time/step_seconds`; the ratio is with / without.

    .venv/bin/python benchmarks/kl_reference.py            # 100 steps each
    .venv/bin/python benchmarks/kl_reference.py --quick    # 3 smoke-profile steps
"""

from __future__ import annotations

import resource
import sys
import tempfile
from pathlib import Path

import harness

FLAGS = {"steps": 100, "kl_coef": 0.04, "seed": 0, "profile": "cpu"}
QUICK = {"steps": 3, "profile": "smoke"}
COLUMNS = [
    ("kl_coef", "kl_coef"), ("step_seconds", "s / GRPO step"),
    ("peak_rss_mib", "peak RSS MiB"), ("time_ratio", "time vs kl_coef 0"),
    ("memory_ratio", "peak vs kl_coef 0"), ("kl_mean", "loss/kl_mean (last)"),
]  # fmt: skip


def worker(spec: dict) -> dict:
    """One cpu-profile run in this process: mean step time, peak RSS, last KL."""
    from grpo_lab.training import TrainConfig, train

    with tempfile.TemporaryDirectory() as scratch:
        config = TrainConfig.for_profile(
            spec["profile"],
            seed=spec["seed"],
            steps=spec["steps"],
            kl_coef=spec["kl_coef"],
            checkpoint_every=0,
            eval_every=0,
            run_dir=str(Path(scratch) / "run"),
        )
        history = train(config, progress=False).history
    steps = [r for r in history if "time/step_seconds" in r]
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {
        "kl_coef": spec["kl_coef"],
        "step_seconds": sum(r["time/step_seconds"] for r in steps) / len(steps),
        "peak_rss_mib": peak_kib / 1024,
        "kl_mean": steps[-1].get("loss/kl_mean"),
    }


def measure(arguments, save: harness.Save) -> dict:
    rows = []
    for kl_coef in (0.0, arguments.kl_coef):
        spec = {
            "seed": arguments.seed,
            "steps": arguments.steps,
            "kl_coef": kl_coef,
            "profile": arguments.profile,
        }
        rows.append(harness.run_worker(__file__, spec))
        save(report(rows, arguments))
    baseline = rows[0]
    for row in rows:
        row["time_ratio"] = row["step_seconds"] / baseline["step_seconds"]
        row["memory_ratio"] = row["peak_rss_mib"] / baseline["peak_rss_mib"]
    return report(rows, arguments)


def report(rows: list[dict], arguments) -> dict:
    return {
        "title": "The KL term's reference model: cost per step on the cpu profile",
        "description": (
            f"`TrainConfig.for_profile({arguments.profile!r}, steps={arguments.steps}, "
            "eval_every=0, "
            "checkpoint_every=0)` in a fresh process per row, with kl_coef 0 (no "
            f"reference model) and {arguments.kl_coef} (a frozen copy, scored once "
            "per rollout batch without gradient). Peak RSS is the process's own "
            "maximum resident memory (warm-up included)."
        ),
        "tables": [harness.table(COLUMNS, rows)],
        "notes": "",
    }


def main(argv=None) -> dict | None:
    return harness.main(sys.modules[__name__], argv)


if __name__ == "__main__":
    main()
