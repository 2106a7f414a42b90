"""Learning under a mismatched sampler, with and without the sampler correction.

Each case is one fresh `grpo-lab train --profile cpu --seed S` process on the
toy task with `--backend mismatch`: the rollouts come from a deliberately
perturbed sampler (`grpo_lab.rollouts.mismatch`) and the trainer scores them
with the policy. Per perturbation the runs differ only in
`--sampler-correction`: none, token_truncate (TIS, weight min(rho, cap), cap
3) and sequence_mask (MIS, weight 0 for a response whose product of token
ratios lies outside [0, 3]); the unperturbed hf run is the reference. The
supervised warm-up samples its evaluations through the same backend, so it is
shared by the runs of one perturbation, not across perturbations; evaluation
does too (a stale sampler answers held-out prompts with its lagging weights).

Read from each run's metrics.jsonl: held-out greedy and sampled accuracy at
the end, the reward (mean of train/reward_mean over the last 10 steps, and
per step for the curves), and the means over all steps of the gap
(rollout/sampler_log_prob_diff_mean, _max) and of the correction's
rollout/is_ratio_* and corrected fractions.

    .venv/bin/python benchmarks/mismatch_learning.py           # the cpu profile
    .venv/bin/python benchmarks/mismatch_learning.py --quick   # seconds
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

SCALES = {"stale": None, "temperature": 0.7, "noise": 1.0}
SYNC_EVERY = {"stale": 4}
CORRECTIONS = ("none", "token_truncate", "sequence_mask")
CORRECTION_FLAGS = {
    "none": [],
    "token_truncate": ["--sampler-correction-cap", "3"],
    "sequence_mask": [
        "--sampler-correction-low",
        "0",
        "--sampler-correction-high",
        "3",
    ],
}
LAST_STEPS = 10
GAP_KEYS = ("sampler_log_prob_diff_mean", "sampler_log_prob_diff_max")
CORRECTION_KEYS = (
    "is_ratio_min", "is_ratio_mean", "is_ratio_max",
    "is_token_corrected_fraction", "is_sequence_corrected_fraction",
)  # fmt: skip
FLAGS = {
    "seeds": [0],
    "perturbations": harness.Flag(["hf", "stale", "temperature"], ("hf", *SCALES)),
    "corrections": harness.Flag(list(CORRECTIONS), CORRECTIONS),
    "steps": harness.Flag(0, help="GRPO steps (0: the cpu profile's 400)"),
    "train_flags": harness.Flag("", help="more `grpo-lab train` flags, one string"),
}
QUICK = {
    "perturbations": ["stale"],
    "corrections": ["token_truncate"],
    "steps": 2,
    # Two updates per rollout batch: the gap is logged even when no group has signal.
    "train_flags": "--rollout-batch-size 8 --train-batch-size 4 --group-size 4 "
    "--importance-reweighting-method grpo --cliprange 0.2 "
    "--eval-every 1 --eval-size 4 --sft-max-steps 2 --sft-eval-every 1 "
    "--sft-eval-size 4",
}
COLUMNS = [
    ("seed", "seed"), ("perturbation", "perturbation"),
    ("correction", "correction"), ("sft_steps", "warm-up steps"),
    ("sft_accuracy_sampled", "warm-up last sampled acc."),
    ("sampled_start", "sampled acc. step 0"), ("sampled_end", "sampled acc. end"),
    ("greedy_start", "greedy acc. step 0"), ("greedy_end", "greedy acc. end"),
    ("reward_last", f"reward, last {LAST_STEPS} steps"),
    ("sampler_log_prob_diff_mean", "mean abs gap"),
    ("sampler_log_prob_diff_max", "max abs gap"),
    ("is_ratio_min", "rho min"), ("is_ratio_mean", "rho mean"),
    ("is_ratio_max", "rho max"),
    ("is_token_corrected_fraction", "tokens corrected"),
    ("is_sequence_corrected_fraction", "responses corrected"),
    ("wall_seconds", "wall s"),
]  # fmt: skip


def cases(arguments) -> list[tuple[str, str]]:
    """(perturbation, correction) pairs; hf, the reference, runs once, uncorrected."""
    pairs = []
    for name in arguments.perturbations:
        modes = ["none"] if name == "hf" else arguments.corrections
        pairs += [(name, mode) for mode in modes]
    return pairs


def case_flags(perturbation: str, correction: str) -> list[str]:
    """The `grpo-lab train` flags of one case (hf: the profile as it is)."""
    if perturbation == "hf":
        return []
    flags = ["--backend", "mismatch", "--mismatch", perturbation]
    if SCALES.get(perturbation) is not None:
        flags += ["--mismatch-scale", str(SCALES[perturbation])]
    if perturbation in SYNC_EVERY:
        flags += ["--mismatch-sync-every", str(SYNC_EVERY[perturbation])]
    return [*flags, "--sampler-correction", correction, *CORRECTION_FLAGS[correction]]


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


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize(records: list[dict]) -> dict:
    """End accuracies, the reward curve and the step-mean rollout metrics."""
    steps = [r for r in records if "step" in r]
    evaluations = [r for r in steps if "eval/accuracy_greedy" in r]
    rewards = [r["train/reward_mean"] for r in steps if "train/reward_mean" in r]
    sft = [r for r in records if "sft/step" in r]
    row = {
        "sft_steps": len(sft),
        "sft_accuracy_sampled": next(
            (
                r["sft/accuracy_sampled"]
                for r in reversed(sft)
                if "sft/accuracy_sampled" in r
            ),
            None,
        ),
        "sampled_start": evaluations[0]["eval/accuracy_sampled"],
        "greedy_start": evaluations[0]["eval/accuracy_greedy"],
        "greedy_end": evaluations[-1]["eval/accuracy_greedy"],
        "sampled_end": evaluations[-1]["eval/accuracy_sampled"],
        "reward_last": mean(rewards[-LAST_STEPS:]),
        "reward_curve": rewards,
        "evaluations": [
            {
                "step": r["step"],
                "greedy": r["eval/accuracy_greedy"],
                "sampled": r["eval/accuracy_sampled"],
            }
            for r in evaluations
        ],
    }
    for key in (*GAP_KEYS, *CORRECTION_KEYS):
        row[key] = mean([r[f"rollout/{key}"] for r in steps if f"rollout/{key}" in r])
    return row


def report(arguments, rows: list[dict]) -> dict:
    warm_up = sorted({(r["perturbation"], r["sft_steps"]) for r in rows})
    sft_note = "Warm-up (supervised steps until sampled accuracy reached the "
    sft_note += "profile's threshold, or its cap): " + ", ".join(
        f"{name} {steps} steps" for name, steps in warm_up
    )
    return {
        "title": "Learning under a mismatched sampler, with and without correction",
        "description": (
            "One fresh `grpo-lab train --profile cpu --backend mismatch` process "
            "per seed, perturbation and correction (stale: sampler weights "
            f"refreshed every {SYNC_EVERY['stale']}th step; temperature: sampling "
            f"at {SCALES['temperature']}; noise: logit noise of standard deviation "
            f"{SCALES['noise']}); hf is the unperturbed reference. token_truncate "
            "weighs each token by min(rho, 3), sequence_mask drops responses whose "
            "ratio lies outside [0, 3]. Accuracy is on the profile's held-out "
            "prompts, sampled and greedy, through the run's own backend; the "
            f"reward is train/reward_mean over the last {LAST_STEPS} steps; gap "
            "and rho columns are means over steps of the logged rollout/ metrics. "
            "Compare a correction with the uncorrected run of the same "
            "perturbation: they share the warm-up."
        ),
        "tables": [harness.table(COLUMNS, rows, notes=sft_note)],
        "notes": "",
    }


def measure(arguments, save: harness.Save) -> dict:
    rows: list[dict] = []
    extra = shlex.split(arguments.train_flags)
    if arguments.steps:
        extra += ["--steps", str(arguments.steps)]
    with tempfile.TemporaryDirectory() as scratch:
        for seed in arguments.seeds:
            for perturbation, correction in cases(arguments):
                run_dir = Path(scratch) / f"{seed}-{perturbation}-{correction}"
                flags = [*case_flags(perturbation, correction), *extra]
                records, seconds = run_case(seed, run_dir, flags)
                rows.append(
                    {
                        "seed": seed,
                        "perturbation": perturbation,
                        "correction": correction,
                        "flags": shlex.join(flags),
                        "wall_seconds": seconds,
                        **summarize(records),
                    }
                )
                save(report(arguments, rows))
                print(f"{seed} {perturbation} {correction}: {seconds:.0f} s")
    return report(arguments, rows)


def main(argv=None) -> dict | None:
    return harness.main(sys.modules[__name__], argv)


if __name__ == "__main__":
    main()
