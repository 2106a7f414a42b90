"""The cpu profile end to end: `grpo-lab train --profile cpu`, one fresh process per seed.

For each seed this runs exactly what a user types, times the whole command (model
build, supervised warm-up, every GRPO step, evaluations, checkpoints, final save),
and reads the run's metrics.jsonl: held-out accuracy (200 prompts; sampled at
temperature 1, and greedy) at step 0, just after the warm-up, and at the end,
and the first evaluated step at which each reaches --target.

    .venv/bin/python benchmarks/cpu_profile.py                 # seeds 0 1 2
    .venv/bin/python benchmarks/cpu_profile.py --quick         # 2 tiny steps
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness

FLAGS = {
    "seeds": [0, 1, 2],
    "target": 0.9,
    "train_flags": harness.Flag("", help="more `grpo-lab train` flags, one string"),
}
QUICK = {
    "train_flags": "--steps 2 --rollout-batch-size 8 --train-batch-size 8 "
    "--group-size 4 --eval-every 1 --eval-size 4 --sft-max-steps 2 "
    "--sft-eval-every 1 --sft-eval-size 4",
}
KINDS = ("sampled", "greedy")  # held-out accuracy: temperature 1, and greedy
COLUMNS = [
    ("seed", "seed"), ("sft_steps", "warm-up steps"), ("grpo_steps", "GRPO steps"),
    ("sampled_start", "sampled acc. step 0"), ("sampled_end", "sampled acc. end"),
    ("first_sampled_at_target", "first sampled ≥ target"),
    ("greedy_start", "greedy acc. step 0"), ("greedy_end", "greedy acc. end"),
    ("first_greedy_at_target", "first greedy ≥ target"),
    ("grpo_step_seconds", "GRPO step s (sum)"), ("wall_seconds", "wall s"),
]  # fmt: skip


def run_seed(seed: int, run_dir: Path, train_flags: str, target: float) -> dict:
    """One `grpo-lab train` process; its wall time and its accuracy curve."""
    command = [
        sys.executable, "-m", "grpo_lab.cli", "train", "--profile", "cpu",
        "--seed", str(seed), "--run-dir", str(run_dir), "--no-progress",
        *shlex.split(train_flags),
    ]  # fmt: skip
    started = time.perf_counter()
    subprocess.run(
        command, check=True, cwd=harness.REPO_ROOT, stdout=subprocess.DEVNULL
    )
    wall_seconds = time.perf_counter() - started
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    every_record = [json.loads(line) for line in lines]
    records = [record for record in every_record if "step" in record]  # GRPO steps
    evaluations = [evaluation(r) for r in records if "eval/accuracy_sampled" in r]
    step_seconds = [r["time/step_seconds"] for r in records if "time/step_seconds" in r]
    run = {
        "seed": seed,
        "wall_seconds": wall_seconds,
        "sft_steps": sum("sft/step" in r for r in every_record),
        "grpo_steps": len(step_seconds),
        "grpo_step_seconds": sum(step_seconds),
        "evaluations": evaluations,
    }
    for kind in KINDS:
        run[f"{kind}_start"] = evaluations[0][f"accuracy_{kind}"]
        run[f"{kind}_end"] = evaluations[-1][f"accuracy_{kind}"]
        reached = first_reaching(evaluations, kind, target)
        run[f"first_{kind}_at_target"] = reached["step"] if reached else None
    return run


def evaluation(record: dict, **extra) -> dict:
    """One held-out evaluation of a metrics record: its step and both accuracies."""
    accuracies = {f"accuracy_{kind}": record[f"eval/accuracy_{kind}"] for kind in KINDS}
    return {"step": record["step"], **extra, **accuracies}


def first_reaching(evaluations: list[dict], kind: str, target: float) -> dict | None:
    """The first evaluation whose ``kind`` accuracy is at least ``target``."""
    return next((e for e in evaluations if e[f"accuracy_{kind}"] >= target), None)


def curve_line(label: str, evaluations: list[dict]) -> str:
    """'- label: step: sampled / greedy [(seconds s)], ...', one list item."""
    points = [
        f"{e['step']}: {e['accuracy_sampled']:.2f} / {e['accuracy_greedy']:.2f}"
        + (f" ({e['seconds']:.0f} s)" if "seconds" in e else "")
        for e in evaluations
    ]
    return f"- {label}: " + ", ".join(points)


def report(arguments, runs: list[dict]) -> dict:
    curves = ["Held-out accuracy by step (step: sampled / greedy):", ""]
    for run in runs:
        last = run["evaluations"][-1]
        every_50 = [e for e in run["evaluations"] if e["step"] % 50 == 0 or e is last]
        curves.append(curve_line(f"seed {run['seed']}", every_50))
    return {
        "title": "The cpu training profile end to end (`grpo-lab train --profile cpu`)",
        "description": (
            "One fresh `grpo-lab train --profile cpu --seed S` process per seed, "
            "with the profile's defaults; wall time covers the whole command "
            "(model build, supervised warm-up, GRPO steps, evaluations every 10 "
            "steps, checkpoints, final save). Accuracy is on 200 held-out prompts: "
            "one answer sampled at temperature 1 (the distribution being trained), "
            'and greedy decoding. Step 0 is right after the warm-up; "first ≥ '
            'target" is the first evaluated step at or above '
            f"{arguments.target}."
        ),
        "tables": [harness.table(COLUMNS, runs, notes="\n".join(curves))],
        "notes": "",
    }


def measure(arguments, save: harness.Save) -> dict:
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        for seed in arguments.seeds:
            run_dir = Path(scratch) / f"seed-{seed}"
            runs.append(
                run_seed(seed, run_dir, arguments.train_flags, arguments.target)
            )
            save(report(arguments, runs))
            print(f"seed {seed}: {runs[-1]['wall_seconds']:.1f} s", flush=True)
    return report(arguments, runs)


def main(argv=None) -> dict | None:
    return harness.main(sys.modules[__name__], argv)


if __name__ == "__main__":
    main()
