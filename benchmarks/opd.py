"""Steps, samples and seconds to a target accuracy: GRPO, OPD and GRPO + OPD.

Task: the CPU toy task (reverse 5 digits, the "cpu" profile of TrainConfig).

1. The teacher, once: the cpu profile's own run (supervised warm-up, then GRPO
   for --teacher-steps steps) from --teacher-seed; its final sampled held-out
   accuracy is measured on the same prompts as the students'. 800 steps: a
   teacher at the profile's 400 can end below 0.9 (seed 100: 0.855), and a
   student distilled from it stalls at its teacher's level, below the target.
2. The student's warm start, once, shared by every method and seed: the cpu
   profile's tiny model from --warm-seed after the same supervised warm-up
   (grpo_lab.training.sft), saved with save_pretrained.
Then per seed (the seed drives the prompt draws and the samplers), from that
warm start (sft_max_steps 0), each method trains with train():
   GRPO              the cpu profile as it is (task reward only);
   OPD               distillation "reward", estimator k1, no task reward: each
                     token's advantage is -(log pi - log pi_teacher)
                     (grpo_lab.distillation);
   GRPO + OPD        the task objective plus the same term, distillation_coef 1;
   OPD, no groups    OPD on a quarter of the samples per step: twice the
                     prompts, one response each (group_size 1; a dense
                     per-token signal needs no group baseline, so baseline and
                     normalizer are none).
The first three sample the profile's 32 prompts x 8 responses per step, the
fourth 64 x 1; samples = steps x samples per step. The target is min(the
teacher's sampled accuracy, --target); a method reaches it at the first
evaluation (every --eval-every steps) whose sampled held-out accuracy is at or
above it. Seconds are training wall time (sampling, rewards, the teacher's
scoring, the update), evaluation excluded.

    .venv/bin/python benchmarks/opd.py
    .venv/bin/python benchmarks/opd.py --quick
"""

from __future__ import annotations

import re
import statistics
import sys
import tempfile
from pathlib import Path

import harness
from cpu_profile import curve_line, evaluation, first_reaching
from time_to_accuracy import warm_start

from grpo_lab.training.config import TrainConfig
from grpo_lab.training.loop import train

FLAGS = {
    "seeds": [0, 1, 2],
    "warm_seed": 0,
    "teacher_seed": 100,
    "teacher_steps": 800,
    "target": 0.9,
    "max_steps": 400,
    "eval_every": 10,
    "config_overrides": harness.Flag({}, help="TrainConfig fields to set, as JSON"),
}
QUICK = {
    "seeds": [0],
    "teacher_steps": 2,
    "max_steps": 2,
    "eval_every": 1,
    "config_overrides": {
        "rollout_batch_size": 8, "train_batch_size": 8, "group_size": 4,
        "eval_size": 4, "sft_max_steps": 2, "sft_eval_every": 1,
        "sft_eval_size": 4, "sft_batch_size": 4,
    },
}  # fmt: skip
METHODS = {
    "GRPO": {},
    "OPD": {"distillation": "reward", "distillation_estimator": "k1"},
    "GRPO + OPD": {
        "distillation": "reward",
        "distillation_estimator": "k1",
        "distillation_task_reward": True,
    },
    "OPD, no groups": {
        "distillation": "reward",
        "distillation_estimator": "k1",
        "group_size": 1,
        "baseline": "none",
        "advantage_normalizer": "none",
    },
}
# Samples per step of a method, as a fraction of the profile's (the same prompts
# twice over, one response each: a quarter of 32 x 8).
SAMPLES_PER_STEP = {"OPD, no groups": 4}


def base_config(arguments, seed: int, run_dir: str, **changes) -> TrainConfig:
    """The cpu profile at this run's steps and evaluation interval."""
    values = {
        "seed": seed,
        "steps": arguments.max_steps,
        "eval_every": arguments.eval_every,
        "checkpoint_every": 0,
        "run_dir": run_dir,
        **arguments.config_overrides,
        **changes,
    }
    return TrainConfig.for_profile("cpu", **values)


def train_teacher(arguments, folder: Path) -> dict:
    """The cpu profile's GRPO run from --teacher-seed; its last evaluation."""
    steps = arguments.teacher_steps
    config = base_config(
        arguments, arguments.teacher_seed, str(folder), steps=steps, eval_every=steps
    )
    history = train(config, progress=False).history
    last = [record for record in history if "eval/accuracy_sampled" in record][-1]
    return evaluation(last)


def batch_sizes(arguments, method: str) -> dict:
    """The rollout and train batch of ``method``: the profile's, or a fraction."""
    fraction = SAMPLES_PER_STEP.get(method)
    if fraction is None:
        return {}
    samples = base_config(arguments, 0, "run").rollout_batch_size // fraction
    return {"rollout_batch_size": samples, "train_batch_size": samples}


def run_method(arguments, method: str, seed: int, paths: dict) -> dict:
    """One method from the warm start; its evaluations and the first at target."""
    teacher = {} if method == "GRPO" else {"teacher": str(paths["teacher"])}
    folder = re.sub(r"[ ,+]+", "-", f"{method}-{seed}")  # "OPD-no-groups-0"
    config = base_config(
        arguments,
        seed,
        str(paths["scratch"] / folder),
        model=str(paths["warm"]),
        sft_max_steps=0,
        **METHODS[method],
        **batch_sizes(arguments, method),
        **teacher,
    )
    elapsed, evaluations = 0.0, []
    for record in train(config, progress=False).history:
        if "step" in record:
            elapsed += record.get("time/step_seconds", 0.0)
            if "eval/accuracy_sampled" in record:
                evaluations.append(evaluation(record, seconds=elapsed))
    reached = first_reaching(evaluations, "sampled", paths["target"]) or {}
    steps = reached.get("step")
    return {
        "method": method,
        "seed": seed,
        "samples_per_step": config.rollout_batch_size,
        "reached": bool(reached),
        "steps_to_target": steps,
        "samples_to_target": None
        if steps is None
        else steps * config.rollout_batch_size,
        "seconds_to_target": reached.get("seconds"),
        "last_step": evaluations[-1]["step"],
        "last_accuracy_sampled": evaluations[-1]["accuracy_sampled"],
        "evaluations": evaluations,
    }


def summary_rows(runs: list[dict]) -> list[dict]:
    """Per method: seeds at target and the means; samples over GRPO's."""
    rows = []
    for method in METHODS:
        mine = [run for run in runs if run["method"] == method]
        if not mine:
            continue
        row = {"method": method, "seeds": len(mine)}
        row["reached"] = sum(run["reached"] for run in mine)
        for key in ("steps_to_target", "samples_to_target", "seconds_to_target"):
            values = [run[key] for run in mine if run[key] is not None]
            row[f"mean_{key}"] = statistics.mean(values) if values else None
        rows.append(row)
    grpo = next((row for row in rows if row["method"] == "GRPO"), None)
    for row in rows:
        ours, theirs = (
            row["mean_samples_to_target"],
            grpo and grpo["mean_samples_to_target"],
        )
        row["samples_over_grpo"] = ours / theirs if ours and theirs else None
    return rows


COLUMNS = [
    ("method", "method"), ("seed", "seed"), ("samples_per_step", "samples / step"),
    ("reached", "reached target"),
    ("steps_to_target", "steps"), ("samples_to_target", "samples"),
    ("seconds_to_target", "seconds"), ("last_step", "last eval step"),
    ("last_accuracy_sampled", "last sampled acc."),
]  # fmt: skip
SUMMARY_COLUMNS = [
    ("method", "method"), ("seeds", "seeds"), ("reached", "reached"),
    ("mean_steps_to_target", "mean steps"),
    ("mean_samples_to_target", "mean samples"),
    ("mean_seconds_to_target", "mean seconds"),
    ("samples_over_grpo", "samples / GRPO's"),
]  # fmt: skip
NOTES = """Notes:
- Means are over the seeds that reached the target; "reached" counts them.
- OPD's signal is dense: every token of every response gets its own
  advantage, and a group whose task rewards are all equal (no GRPO signal)
  still trains. Its cost per step is one more forward of the teacher on the
  sampled tokens, without gradient.
- Every method trains at the profile's learning rate (3e-4); AdamW makes
  the step's size independent of the advantage's scale.
- The teacher is the same architecture as the student; on this task it is
  the cpu profile's own GRPO run, so OPD's target is the teacher's accuracy
  (or the --target, whichever is lower)."""


def report(arguments, teacher: dict | None, target: float | None, runs) -> dict:
    config, seeds = base_config(arguments, 0, "run"), arguments.seeds
    teacher_text = (
        f"The teacher reached {teacher['accuracy_sampled']:.3f} sampled "
        f"({teacher['accuracy_greedy']:.3f} greedy) after "
        f"{arguments.teacher_steps} GRPO steps; target {target:.3f}. "
        if teacher
        else ""
    )
    return {
        "title": "On-policy distillation against GRPO (CPU toy task), "
        f"seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}",
        "description": (
            teacher_text + f"Target: sampled held-out accuracy on {config.eval_size} "
            f"prompts, checked every {arguments.eval_every} steps, at most "
            f"{arguments.max_steps} steps; {config.rollout_batch_size} samples per "
            "step (OPD, no groups: a quarter of them); seconds exclude evaluation, "
            "the shared warm-up and the teacher's training."
        ),
        "tables": [
            harness.table(COLUMNS, runs),
            harness.table(
                SUMMARY_COLUMNS,
                summary_rows(runs),
                notes="\n".join(
                    ["Held-out accuracy by step (step: sampled / greedy):", ""]
                    + [
                        curve_line(
                            f"{run['method']}, seed {run['seed']}", run["evaluations"]
                        )
                        for run in runs
                    ]
                ),
            ),
        ],
        "notes": NOTES,
        "teacher": teacher,
        "target": target,
        "config": config.to_dict(),
    }


def measure(arguments, save: harness.Save) -> dict:
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        teacher = train_teacher(arguments, scratch / "teacher")
        target = min(teacher["accuracy_sampled"], arguments.target)
        warm = scratch / "warm"
        warm_start(
            base_config(arguments, arguments.warm_seed, str(scratch / "warm-run")), warm
        )
        paths = {"scratch": scratch, "teacher": scratch / "teacher", "warm": warm}
        paths["target"] = target
        for seed in arguments.seeds:
            for method in METHODS:
                runs.append(run_method(arguments, method, seed, paths))
                save(report(arguments, teacher, target, runs))
                print(f"{method}, seed {seed}: {runs[-1]['last_step']} steps")
    return report(arguments, teacher, target, runs)


def main(argv=None) -> dict | None:
    return harness.main(sys.modules[__name__], argv)


if __name__ == "__main__":
    main()
