"""The cpu profile end to end: `grpo-lab train --profile cpu`, one fresh process per seed.

For each seed this runs exactly what a user types, times the whole command (model
build, supervised warm-up, every GRPO step, evaluations, checkpoints, final save),
and reads the run's metrics.jsonl: held-out accuracy (200 prompts; sampled at
temperature 1, and greedy) at step 0, just after the warm-up, and at the end,
and the first evaluated step at which each reaches --target.

    .venv/bin/python benchmarks/cpu_profile.py                 # seeds 0 1 2
    .venv/bin/python benchmarks/cpu_profile.py --smoke         # 2 tiny steps
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_utils import (
    DEFAULT_OUT_DIR,
    REPO_ROOT,
    command_line,
    format_table,
    machine_info,
    write_json,
)

SMOKE_FLAGS = [
    "--steps", "2", "--rollout-batch-size", "8", "--train-batch-size", "8",
    "--group-size", "4", "--eval-every", "1", "--eval-size", "4",
    "--sft-max-steps", "2", "--sft-eval-every", "1", "--sft-eval-size", "4",
]  # fmt: skip


def run_seed(seed: int, run_dir: Path, extra_flags: list[str]) -> dict:
    """One `grpo-lab train` process; its wall time and its accuracy curve."""
    command = [
        sys.executable, "-m", "grpo_lab.cli", "train", "--profile", "cpu",
        "--seed", str(seed), "--run-dir", str(run_dir), "--no-progress",
        *extra_flags,
    ]  # fmt: skip
    started = time.perf_counter()
    subprocess.run(command, check=True, cwd=REPO_ROOT, stdout=subprocess.DEVNULL)
    wall_seconds = time.perf_counter() - started
    records = [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    return {"seed": seed, "wall_seconds": wall_seconds, **curve_summary(records)}


def curve_summary(records: list[dict]) -> dict:
    evaluations = [r for r in records if "step" in r and "eval/accuracy_sampled" in r]
    grpo_steps = [r for r in records if "step" in r and "time/step_seconds" in r]
    first, last = evaluations[0], evaluations[-1]
    return {
        "sft_steps": sum(1 for r in records if "sft/step" in r),
        "grpo_steps": len(grpo_steps),
        "grpo_step_seconds": sum(r["time/step_seconds"] for r in grpo_steps),
        "sampled_start": first["eval/accuracy_sampled"],
        "sampled_end": last["eval/accuracy_sampled"],
        "greedy_start": first["eval/accuracy_greedy"],
        "greedy_end": last["eval/accuracy_greedy"],
        "evaluations": [
            {
                "step": r["step"],
                "accuracy_sampled": r["eval/accuracy_sampled"],
                "accuracy_greedy": r["eval/accuracy_greedy"],
            }
            for r in evaluations
        ],
    }


def first_step_reaching(run: dict, measure: str, target: float) -> int | None:
    return next(
        (e["step"] for e in run["evaluations"] if e[f"accuracy_{measure}"] >= target),
        None,
    )


COLUMNS = [
    ("seed", "seed"), ("sft_steps", "warm-up steps"), ("grpo_steps", "GRPO steps"),
    ("sampled_start", "sampled acc. step 0"), ("sampled_end", "sampled acc. end"),
    ("first_sampled_at_target", "first sampled ≥ target"),
    ("greedy_start", "greedy acc. step 0"), ("greedy_end", "greedy acc. end"),
    ("first_greedy_at_target", "first greedy ≥ target"),
    ("grpo_step_seconds", "GRPO step s (sum)"), ("wall_seconds", "wall s"),
]  # fmt: skip


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT_DIR / "cpu_profile.json"
    )
    parser.add_argument("--smoke", action="store_true", help="2 tiny steps per seed")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    arguments = parse_arguments(argv)
    machine = machine_info()
    extra_flags = SMOKE_FLAGS if arguments.smoke else []
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        for seed in arguments.seeds:
            run = run_seed(seed, Path(scratch) / f"seed-{seed}", extra_flags)
            for measure in ("sampled", "greedy"):
                run[f"first_{measure}_at_target"] = first_step_reaching(
                    run, measure, arguments.target
                )
            runs.append(run)
            print(format_table(runs[-1:], COLUMNS), flush=True)
    write_json(
        arguments.out,
        {
            "benchmark": "cpu_profile",
            "command": command_line(__file__, argv),
            "machine": machine,
            "settings": {
                "seeds": arguments.seeds,
                "target": arguments.target,
                "extra_flags": extra_flags,
            },
            "runs": runs,
        },
    )
    print(format_table(runs, COLUMNS))
    print(f"wrote {arguments.out}")


if __name__ == "__main__":
    sys.exit(main())
