"""Length bias: the response length GRPO learns under `sequence` vs `constant`.

The `scratchpad` task (reversal after an optional restatement of 0 to
`max_restated` input digits; only the answer after ":" is graded) lets correct
responses differ in length. Each case trains the cpu profile on it in a fresh
process with the same seed, once with `loss_normalization="sequence"` (each
response's mean: weight 1 / |o_i| per token) and once with `"constant"` (sum /
`normalization_constant` = train_batch_size x the task's `max_new_tokens`, so
a response of the longest length weighs as under `sequence` and the gradient
keeps its scale under the norm clip). Reported per run: the
mean sampled response length (tokens, EOS included) over all steps, over the
first and the last tenth of the steps, that mean over the wrong (reward 0) and
the right responses alone, and the last held-out greedy accuracy. The wrong
responses are where the two losses differ: under `sequence` a long wrong
response's tokens are each pushed down by less than a short one's. A paired
table gives, per metric, sequence - constant for each seed, its mean and
standard error across seeds.

``--grade-scratchpad`` grades the restatement too, so each restated digit is
one more chance to be wrong and length and correctness are tied, as they are
for long reasoning. Without it the reward ignores the restatement, and with
group-centred advantages (they sum to 0 in each group) neither loss has a
first-order pull on the length unless right and wrong responses already
differ in length.

    .venv/bin/python benchmarks/length_bias.py                # 2 seeds, 150 steps
    .venv/bin/python benchmarks/length_bias.py --quick        # smoke profile, 2 steps
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

import harness

FLAGS = {
    "steps": 150, "seeds": [0, 1], "profile": "cpu", "n_digits": 5,
    "max_restated": 10, "sft_target_accuracy": 0.25, "grade_scratchpad": False,
    "max_new_tokens": 0,
}  # fmt: skip
QUICK = {"steps": 2, "seeds": [0], "profile": "smoke"}
NORMALIZATIONS = ("sequence", "constant")
COLUMNS = [
    ("loss_normalization", "loss_normalization"), ("seed", "seed"),
    ("length_mean", "length, all steps"), ("length_first", "length, first tenth"),
    ("length_last", "length, last tenth"), ("length_wrong", "length, wrong"),
    ("length_right", "length, right"), ("wrong_fraction", "wrong fraction"),
    ("accuracy", "greedy accuracy (last)"),
]  # fmt: skip


def count_by_reward(tally: dict) -> None:
    """Make the loop's rollout statistics also add up the lengths of the wrong
    (reward 0) and the right responses into ``tally`` (this process only)."""
    from grpo_lab.training import loop

    original = loop._response_statistics

    def counting(rollouts, raw_rewards, group_size):
        lengths = [len(ids) for ids in rollouts.response_token_ids]
        for length, reward in zip(lengths, raw_rewards.tolist(), strict=True):
            key = "right" if reward > 0 else "wrong"
            tally[key + "_tokens"] += length
            tally[key] += 1
        return original(rollouts, raw_rewards, group_size)

    loop._response_statistics = counting


def worker(spec: dict) -> dict:
    """One run in this process: its per-step lengths and final accuracy."""
    from grpo_lab.tasks import get_task
    from grpo_lab.training import TrainConfig, train

    tally = {"right": 0, "wrong": 0, "right_tokens": 0, "wrong_tokens": 0}
    count_by_reward(tally)
    options = {
        "n_digits": spec["n_digits"],
        "max_restated": spec["max_restated"],
        "grade_scratchpad": spec["grade_scratchpad"],
    }
    longest = spec["max_new_tokens"] or get_task("scratchpad", **options).max_new_tokens
    batch = TrainConfig.for_profile(spec["profile"]).train_batch_size
    with tempfile.TemporaryDirectory() as scratch:
        config = TrainConfig.for_profile(
            spec["profile"],
            seed=spec["seed"],
            steps=spec["steps"],
            task="scratchpad",
            task_options=options,
            loss_normalization=spec["loss_normalization"],
            sft_target_accuracy=spec["sft_target_accuracy"],
            max_new_tokens=longest,
            normalization_constant=(
                batch * longest if spec["loss_normalization"] == "constant" else None
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
        "length_wrong": tally["wrong_tokens"] / max(1, tally["wrong"]),
        "length_right": tally["right_tokens"] / max(1, tally["right"]),
        "wrong_fraction": tally["wrong"] / max(1, tally["wrong"] + tally["right"]),
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
                "n_digits": arguments.n_digits,
                "max_restated": arguments.max_restated,
                "sft_target_accuracy": arguments.sft_target_accuracy,
                "grade_scratchpad": arguments.grade_scratchpad,
                "max_new_tokens": arguments.max_new_tokens,
                "loss_normalization": normalization,
            }
            rows.append(harness.run_worker(__file__, spec))
            save(report(rows, arguments))
    return report(rows, arguments)


PAIRED = [
    ("length_mean", "length, all steps"), ("length_last", "length, last tenth"),
    ("length_wrong", "length, wrong"), ("length_right", "length, right"),
]  # fmt: skip


def paired_differences(rows: list[dict]) -> list[dict]:
    """Per metric: sequence - constant for each seed that has both runs, their
    mean, its standard error across seeds, and how many differences are > 0."""
    by_seed = {}
    for row in rows:
        by_seed.setdefault(row["seed"], {})[row["loss_normalization"]] = row
    pairs = [runs for runs in by_seed.values() if len(runs) == len(NORMALIZATIONS)]
    summary = []
    for key, header in PAIRED:
        differences = [runs["sequence"][key] - runs["constant"][key] for runs in pairs]
        n = len(differences)
        summary.append({
            "metric": header, "seeds": n,
            "mean": statistics.fmean(differences) if n else None,
            "standard_error": statistics.stdev(differences) / n**0.5 if n > 1 else None,
            "positive": sum(d > 0 for d in differences),
            "differences": [round(d, 3) for d in differences],
        })  # fmt: skip
    return summary


PAIRED_COLUMNS = [
    ("metric", "metric"), ("seeds", "seeds"), ("mean", "mean sequence - constant"),
    ("standard_error", "standard error"), ("positive", "seeds with sequence longer"),
    ("differences", "per seed"),
]  # fmt: skip


def report(rows: list[dict], arguments) -> dict:
    shown = [{k: v for k, v in row.items() if k != "lengths"} for row in rows]
    return {
        "title": "Length bias: sequence vs constant loss normalization (scratchpad"
        + (
            f", max_new_tokens {arguments.max_new_tokens})"
            if arguments.max_new_tokens
            else ")"
        ),
        "description": (
            f"`TrainConfig.for_profile({arguments.profile!r}, task='scratchpad', "
            f"task_options={{'n_digits': {arguments.n_digits}, "
            f"'max_restated': {arguments.max_restated}, "
            f"'grade_scratchpad': {arguments.grade_scratchpad}}}, "
            f"sft_target_accuracy={arguments.sft_target_accuracy}, "
            f"max_new_tokens={arguments.max_new_tokens or None}, "
            f"steps={arguments.steps}, checkpoint_every=0)` in a fresh process per "
            "row, with loss_normalization sequence and constant (normalization_"
            "constant = train_batch_size x max_new_tokens, the task's when None), "
            "same seeds. "
            "Lengths are the mean sampled response length in tokens (EOS included) "
            "of the training "
            "rollouts; the wrong and right columns average over every training "
            "response with reward 0 and 1; wrong fraction is the share of reward 0."
        ),
        "tables": [
            harness.table(COLUMNS, shown),
            harness.table(
                PAIRED_COLUMNS,
                paired_differences(rows),
                title="Paired differences, sequence - constant (tokens)",
            ),
        ],
        "notes": "",
        "lengths": {
            f"{r['loss_normalization']}/{r['seed']}": r["lengths"] for r in rows
        },
    }


def main(argv=None) -> dict | None:
    return harness.main(sys.modules[__name__], argv)


if __name__ == "__main__":
    main()
