"""Asynchronous GRPO on the CPU: staleness bound, admission policy, correction.

Each case is one fresh `grpo-lab train --profile cpu --seed S` process on the
toy task. Staleness 0 is the synchronous loop (run once per seed, without a
correction: on-policy its ratios are 1). Every other case starts the rollout
worker (`grpo_lab.training.rollout_worker`) with `--max-staleness` 1, 2 or 4,
`--async-admission` drop or pace, and `--sampler-correction` none or
token_truncate (TIS against the sampler's own log-probs, cap 3); weights are
sent every step and the queue holds the profile's 2 rollout batches.

Read from each run's metrics.jsonl: the training wall time (the sum of
time/step_seconds: sampling or waiting, grading and the update, evaluation
excluded) and the responses sampled until the first evaluation whose sampled
held-out accuracy reaches --target, the final sampled and greedy accuracy, the
share of sampled groups dropped as too stale, and the mean staleness of the
groups trained on. The whole process's wall time (start, warm-up and
evaluations included) is reported beside it.

    .venv/bin/python benchmarks/async_grpo.py           # the cpu profile, 3 seeds
    .venv/bin/python benchmarks/async_grpo.py --quick   # seconds
"""

from __future__ import annotations

import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness

ADMISSIONS = ("drop", "pace")
CORRECTIONS = ("none", "token_truncate")
FLAGS = {
    "seeds": [0, 1, 2],
    "staleness": [0, 1, 2, 4],
    "admissions": harness.Flag(list(ADMISSIONS), ADMISSIONS),
    "corrections": harness.Flag(list(CORRECTIONS), CORRECTIONS),
    "target": harness.Flag(0.9, help="sampled held-out accuracy to reach"),
    "steps": harness.Flag(0, help="GRPO steps (0: the cpu profile's 400)"),
    "train_flags": harness.Flag("", help="more `grpo-lab train` flags, one string"),
}
QUICK = {
    "seeds": [0],
    "staleness": [0, 1],
    "admissions": ["pace"],
    "corrections": ["token_truncate"],
    "steps": 2,
    "train_flags": "--rollout-batch-size 8 --train-batch-size 8 --group-size 4 "
    "--eval-every 1 --eval-size 4 --sft-max-steps 2 --sft-eval-every 1 "
    "--sft-eval-size 4",
}
COLUMNS = [
    ("seed", "seed"), ("staleness", "max staleness"), ("admission", "admission"),
    ("correction", "correction"), ("train_seconds", "train s"),
    ("seconds_to_target", "train s to target"),
    ("samples_to_target", "responses to target"),
    ("sampled_end", "sampled acc. end"), ("greedy_end", "greedy acc. end"),
    ("dropped_share", "groups dropped"), ("staleness_mean", "mean staleness"),
    ("wall_seconds", "process wall s"),
]  # fmt: skip


SUMMARY_COLUMNS = [
    ("staleness", "max staleness"), ("admission", "admission"),
    ("correction", "correction"), ("reached", "seeds at target"),
    ("train_seconds", "mean train s"),
    ("seconds_to_target", "mean train s to target"),
    ("samples_to_target", "mean responses to target"),
    ("sampled_end", "mean sampled acc. end"), ("dropped_share", "mean groups dropped"),
    ("staleness_mean", "mean staleness"),
]  # fmt: skip
# Summary means over every seed, and over the seeds that reached the target.
EVERY_SEED = ("train_seconds", "sampled_end", "dropped_share", "staleness_mean")
TO_TARGET = ("seconds_to_target", "samples_to_target")
NOTES = """Notes:
- Means to the target are over the seeds that reached it ("seeds at target").
- The queue holds 2 rollout batches and the trainer sends its weights every
  step, so no group is more than 2 versions old: a bound of 2 or more never
  drops a group, and the rows with bound 4 sample like those with bound 2."""


def cases(arguments) -> list[tuple[int, str, str]]:
    """(staleness, admission, correction); staleness 0 once, uncorrected."""
    found = []
    for bound in arguments.staleness:
        if bound == 0:
            found.append((0, "-", "none"))
            continue
        found += [
            (bound, admission, correction)
            for admission in arguments.admissions
            for correction in arguments.corrections
        ]
    return found


def case_flags(bound: int, admission: str, correction: str) -> list[str]:
    """The `grpo-lab train` flags of one case (0: the profile as it is)."""
    if bound == 0:
        return []
    return [
        "--max-staleness", str(bound), "--async-admission", admission,
        "--sampler-correction", correction,
    ]  # fmt: skip


def run_case(seed: int, run_dir: Path, flags: list[str]) -> tuple[list[dict], float]:
    """One `grpo-lab train` process: its metrics records and wall seconds."""
    command = [
        sys.executable, "-m", "grpo_lab.cli", "train", "--profile", "cpu",
        "--seed", str(seed), "--run-dir", str(run_dir), "--no-progress", *flags,
    ]  # fmt: skip
    started = time.perf_counter()
    subprocess.run(
        command, check=True, cwd=harness.REPO_ROOT, stdout=subprocess.DEVNULL
    )
    seconds = time.perf_counter() - started
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines], seconds


def summarize(records: list[dict], target: float, config: dict) -> dict:
    """Time and responses to the target, end accuracies, drops and staleness.

    Responses sampled by step k: (k x B + groups dropped up to k) x G.
    """
    groups, size = (
        config["rollout_batch_size"] // config["group_size"],
        config["group_size"],
    )
    steps = [r for r in records if r.get("step", 0) > 0 and "train/reward_mean" in r]
    evaluations = {r["step"]: r for r in records if "eval/accuracy_sampled" in r}
    elapsed, dropped, reached = 0.0, 0.0, None
    for record in steps:
        elapsed += record["time/step_seconds"]
        dropped += record.get("async/dropped_groups_stale", 0.0)
        scores = evaluations.get(record["step"])
        if reached is None and scores and scores["eval/accuracy_sampled"] >= target:
            reached = (elapsed, (record["step"] * groups + dropped) * size)
    ages = [r["async/staleness_mean"] for r in steps if "async/staleness_mean" in r]
    last = evaluations[max(evaluations)]
    return {
        "train_seconds": elapsed,
        "seconds_to_target": None if reached is None else reached[0],
        "samples_to_target": None if reached is None else reached[1],
        "sampled_end": last["eval/accuracy_sampled"],
        "greedy_end": last["eval/accuracy_greedy"],
        "dropped_share": dropped / (dropped + groups * len(steps)),
        "staleness_mean": sum(ages) / len(ages) if ages else 0.0,
    }


def summary_rows(rows: list[dict]) -> list[dict]:
    """One row per case: seeds at target and the means over seeds."""
    found: dict[tuple, list[dict]] = {}
    for row in rows:
        case = (row["staleness"], row["admission"], row["correction"])
        found.setdefault(case, []).append(row)
    summary = []
    for (bound, admission, correction), mine in found.items():
        reached = [row for row in mine if row["samples_to_target"] is not None]
        summary.append(
            {
                "staleness": bound,
                "admission": admission,
                "correction": correction,
                "reached": f"{len(reached)} of {len(mine)}",
                **{key: _mean(mine, key) for key in EVERY_SEED},
                **{key: _mean(reached, key) for key in TO_TARGET},
            }
        )
    return summary


def _mean(rows: list[dict], key: str) -> float | None:
    return statistics.mean(row[key] for row in rows) if rows else None


def report(arguments, rows: list[dict]) -> dict:
    return {
        "title": "Asynchronous GRPO on the CPU: staleness, admission, correction",
        "description": (
            "One fresh `grpo-lab train --profile cpu` process per seed and case; "
            "max staleness 0 is the synchronous loop, the others run the rollout "
            "worker beside the trainer (weights sent every step, a queue of 2 "
            "rollout batches). Train s: the sum of time/step_seconds (sampling or "
            "waiting for groups, grading, the update; evaluation excluded); to "
            f"target: up to the first evaluation with sampled accuracy >= "
            f"{arguments.target}; responses to target count the dropped groups' "
            "responses too. Groups dropped: the share of sampled groups over "
            "the bound. An asynchronous run's first step includes the wait for "
            "its worker to start (a spawned interpreter imports torch: seconds)."
        ),
        "tables": [
            harness.table(COLUMNS, rows),
            harness.table(SUMMARY_COLUMNS, summary_rows(rows), title="By case"),
        ],
        "notes": NOTES,
    }


def measure(arguments, save: harness.Save) -> dict:
    rows: list[dict] = []
    extra = shlex.split(arguments.train_flags)
    if arguments.steps:
        extra += ["--steps", str(arguments.steps)]
    with tempfile.TemporaryDirectory() as scratch:
        for seed in arguments.seeds:
            for bound, admission, correction in cases(arguments):
                run_dir = Path(scratch) / f"{seed}-{bound}-{admission}-{correction}"
                flags = [*case_flags(bound, admission, correction), *extra]
                records, seconds = run_case(seed, run_dir, flags)
                config = json.loads((run_dir / "config.json").read_text())
                rows.append(
                    {
                        "seed": seed,
                        "staleness": bound,
                        "admission": admission,
                        "correction": correction,
                        "flags": shlex.join(flags),
                        "wall_seconds": seconds,
                        **summarize(records, arguments.target, config),
                    }
                )
                save(report(arguments, rows))
                print(f"{seed} {bound} {admission} {correction}: {seconds:.0f} s")
    return report(arguments, rows)


def main(argv=None) -> dict | None:
    return harness.main(sys.modules[__name__], argv)


if __name__ == "__main__":
    main()
