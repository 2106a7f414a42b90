"""Length bias: the response length GRPO learns under `sequence` vs `constant`.

The `scratchpad` task (reversal after an optional restatement of 0 to
`max_restated` input digits; only the answer after ":" is graded) lets correct
responses differ in length. Each case trains the cpu profile on it in a fresh
process with the same seed, once with `loss_normalization="sequence"` (each
response's mean: weight 1 / |o_i| per token) and once with `"constant"` (sum /
`normalization_constant`, the task's `max_new_tokens`). Reported per run: the
mean sampled response length (tokens, EOS included) over all steps, over the
first and the last tenth of the steps, and the last held-out greedy accuracy.

    .venv/bin/python benchmarks/length_bias.py                # 2 seeds, 150 steps
    .venv/bin/python benchmarks/length_bias.py --quick        # smoke profile, 2 steps
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import harness

FLAGS = {"steps": 150, "seeds": [0, 1], "profile": "cpu", "max_restated": 10}
QUICK = {"steps": 2, "seeds": [0], "profile": "smoke"}
NORMALIZATIONS = ("sequence", "constant")
COLUMNS = [
    ("loss_normalization", "loss_normalization"), ("seed", "seed"),
    ("length_mean", "length, all steps"), ("length_first", "length, first tenth"),
    ("length_last", "length, last tenth"), ("accuracy", "greedy accuracy (last)"),
]  # fmt: skip


def worker(spec: dict) -> dict:
    """One run in this process: its per-step lengths and final accuracy."""
    from grpo_lab.tasks import get_task
    from grpo_lab.training import TrainConfig, train

    options = {"n_digits": 5, "max_restated": spec["max_restated"]}
    constant = get_task("scratchpad", **options).max_new_tokens
    with tempfile.TemporaryDirectory() as scratch:
        config = TrainConfig.for_profile(
            spec["profile"],
            seed=spec["seed"],
            steps=spec["steps"],
            task="scratchpad",
            task_options=options,
            loss_normalization=spec["loss_normalization"],
            normalization_constant=(
                constant if spec["loss_normalization"] == "constant" else None
            ),
            checkpoint_every=0,
            run_dir=str(Path(scratch) / "run"),
        )
        history = train(config, progress=False).history
    lengths = [r["train/response_length"] for r in history if r.get("step")]
    tenth = max(1, len(lengths) // 10)
    evaluations = [r for r in history if "eval/accuracy_greedy" in r]
    return {
        "loss_normalization": spec["loss_normalization"],
        "seed": spec["seed"],
        "length_mean": sum(lengths) / len(lengths),
        "length_first": sum(lengths[:tenth]) / tenth,
        "length_last": sum(lengths[-tenth:]) / tenth,
        "accuracy": evaluations[-1]["eval/accuracy_greedy"] if evaluations else None,
        "lengths": lengths,
    }


def measure(arguments, save: harness.Save) -> dict:
    rows = []
    for seed in arguments.seeds:
        for normalization in NORMALIZATIONS:
            spec = {
                "seed": seed,
                "steps": arguments.steps,
                "profile": arguments.profile,
                "max_restated": arguments.max_restated,
                "loss_normalization": normalization,
            }
            rows.append(harness.run_worker(__file__, spec))
            save(report(rows, arguments))
    return report(rows, arguments)


def report(rows: list[dict], arguments) -> dict:
    shown = [{k: v for k, v in row.items() if k != "lengths"} for row in rows]
    return {
        "title": "Length bias: sequence vs constant loss normalization (scratchpad)",
        "description": (
            f"`TrainConfig.for_profile({arguments.profile!r}, task='scratchpad', "
            f"task_options={{'n_digits': 5, 'max_restated': {arguments.max_restated}}}, "
            f"steps={arguments.steps}, checkpoint_every=0)` in a fresh process per "
            "row, with loss_normalization sequence and constant (normalization_"
            "constant = the task's max_new_tokens), same seeds. Lengths are the mean "
            "sampled response length in tokens (EOS included) of the training "
            "rollouts."
        ),
        "tables": [harness.table(COLUMNS, shown)],
        "notes": "",
        "lengths": {
            f"{r['loss_normalization']}/{r['seed']}": r["lengths"] for r in rows
        },
    }


def main(argv=None) -> dict | None:
    return harness.main(sys.modules[__name__], argv)


if __name__ == "__main__":
    main()
