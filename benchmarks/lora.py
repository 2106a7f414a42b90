"""LoRA against full fine-tuning: seconds per step and peak memory, on the CPU.

A randomly initialised 27.7 M-parameter Qwen2 (hidden 512, 4 layers, 8 heads,
2 key/value heads, MLP 1408, vocabulary 32000, tied embeddings) takes GRPO
optimizer steps (``policy_gradient_update``: on-policy, sequence
normalization, AdamW) on a fixed batch of random token ids with random
advantages, four ways, each in a fresh process: full fine-tuning, and LoRA of
rank 1, 8 and 64 on every linear layer (``grpo_lab.lora``, the
loop's own adapters). Each case runs ``--warmup`` steps, then times
``--steps`` steps; peak memory is the resident-set high-water mark above what
the process held before its first step (model built), so it counts gradients,
AdamW moments and activations. Ratios are to full fine-tuning in the same run.

Then time to accuracy on the toy task: `grpo-lab train --profile cpu --lora-rank
R` for each R of ``--accuracy-ranks`` (0: full fine-tuning), one fresh process
each (``cpu_profile.run_seed``): the whole command's wall time, the summed GRPO
step time, held-out sampled accuracy at step 0 and at the end, and the first
evaluated step at or above ``--target`` (None: never within the run's steps).

    .venv/bin/python benchmarks/lora.py            # the figures in RESULTS.md
    .venv/bin/python benchmarks/lora.py --quick    # seconds
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import cpu_profile
import harness
import torch

FLAGS = {
    "ranks": [0, 1, 8, 64],
    "batch_size": 8,
    "seq_len": 256,
    "steps": 3,
    "warmup": 1,
    "hidden_size": 512,
    "num_layers": 4,
    "intermediate_size": 1408,
    "vocab_size": 32000,
    "threads": 1,
    "accuracy_ranks": [0, 8],
    "target": 0.9,
    "train_flags": harness.Flag("", help="more `grpo-lab train` flags, one string"),
}
QUICK = {
    "accuracy_ranks": [0, 8],
    "train_flags": cpu_profile.QUICK["train_flags"],
    "batch_size": 2,
    "seq_len": 32,
    "steps": 2,
    "warmup": 1,
    "hidden_size": 64,
    "intermediate_size": 128,
    "vocab_size": 512,
}
COLUMNS = [
    ("method", "method"), ("trainable_parameters", "trainable params"),
    ("step_seconds", "s / step (median)"), ("time_ratio", "time / full FT"),
    ("peak_mib", "peak MiB"), ("memory_ratio", "memory / full FT"),
]  # fmt: skip


def build(spec: dict):
    """The model (LoRA layers in place when rank > 0) and AdamW on what trains."""
    from grpo_lab import lora

    model = harness.random_qwen2(
        seed=spec["seed"],
        vocab_size=spec["vocab_size"],
        hidden_size=spec["hidden_size"],
        num_hidden_layers=spec["num_layers"],
        num_attention_heads=8 if spec["hidden_size"] % 8 == 0 else 4,
        num_key_value_heads=2,
        intermediate_size=spec["intermediate_size"],
        max_position_embeddings=max(spec["seq_len"], 64),
    )
    if spec["rank"] > 0:
        settings = lora.LoraSettings(spec["rank"], 32.0, 0.0, lora.ALL_LINEAR)
        model = lora.inner_model(lora.add_adapters(model, settings, spec["seed"]))
    model.train()
    optimizer = torch.optim.AdamW(lora.trainable_parameters(model), lr=1e-5)
    return model, optimizer


def random_batch(spec: dict) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    generator = torch.Generator().manual_seed(spec["seed"])
    shape = (spec["batch_size"], spec["seq_len"])
    ids = torch.randint(1, spec["vocab_size"], shape, generator=generator)  # (B, T)
    response_mask = torch.zeros(shape, dtype=torch.long)  # (B, T)
    response_mask[:, shape[1] // 4 :] = 1  # the last three quarters: the response
    batch = {
        "input_ids": ids,
        "labels": ids.roll(-1, 1),
        "response_mask": response_mask,
    }
    advantages = torch.randn(shape[0], generator=generator)  # (B,)
    return batch, advantages


def worker(spec: dict) -> dict:
    from grpo_lab import lora
    from grpo_lab.train_step import policy_gradient_update

    torch.set_num_threads(spec["threads"])
    model, optimizer = build(spec)
    batch, advantages = random_batch(spec)

    def step():
        policy_gradient_update(model, optimizer, 1, 1.0, batch, advantages)

    times = []
    with harness.PeakMemory(torch.device("cpu")) as peak:
        for index in range(spec["warmup"] + spec["steps"]):
            started = time.perf_counter()
            step()
            if index >= spec["warmup"]:
                times.append(time.perf_counter() - started)
    return {
        "method": "full fine-tuning" if spec["rank"] == 0 else f"LoRA r={spec['rank']}",
        "rank": spec["rank"],
        "parameters": sum(p.numel() for p in model.parameters()),
        "trainable_parameters": lora.trainable_parameter_count(model),
        "step_seconds": statistics.median(times),
        "step_seconds_all": times,
        "peak_mib": peak.peak_bytes / 2**20,
    }


def add_ratios(rows: list[dict]) -> None:
    full = next(row for row in rows if row["rank"] == 0)
    for row in rows:
        row["time_ratio"] = row["step_seconds"] / full["step_seconds"]
        row["memory_ratio"] = row["peak_mib"] / full["peak_mib"]


ACCURACY_COLUMNS = [
    ("method", "method"), ("sampled_start", "sampled acc. step 0"),
    ("sampled_end", "sampled acc. end"),
    ("first_sampled_at_target", "first sampled ≥ target"),
    ("seconds_to_target", "GRPO s to target"), ("grpo_steps", "GRPO steps"),
    ("grpo_step_seconds", "GRPO step s (sum)"), ("wall_seconds", "wall s"),
]  # fmt: skip
TRAIN_ONLY = {"accuracy_ranks", "target", "train_flags", "ranks"}


def accuracy_runs(arguments) -> list[dict]:
    """One `grpo-lab train --profile cpu --lora-rank R` per rank, and its curve."""
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for rank in arguments.accuracy_ranks:
            flags = f"--lora-rank {rank} {arguments.train_flags}".strip()
            run_dir = Path(scratch) / f"rank-{rank}"
            run = cpu_profile.run_seed(arguments.seed, run_dir, flags, arguments.target)
            run["method"] = "full fine-tuning" if rank == 0 else f"LoRA r={rank}"
            run["seconds_to_target"] = seconds_to(
                run_dir, run["first_sampled_at_target"]
            )
            rows.append(run)
            print(f"{run['method']}: {run['wall_seconds']:.1f} s", flush=True)
    return rows


def seconds_to(run_dir: Path, step: int | None) -> float | None:
    """Summed GRPO step seconds of steps 1..step (None: the target never came)."""
    if step is None:
        return None
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    return sum(
        r["time/step_seconds"]
        for r in records
        if "time/step_seconds" in r and r.get("step", 0) <= step
    )


def measure(arguments, save: harness.Save) -> dict:
    shared = {k: getattr(arguments, k) for k in FLAGS if k not in TRAIN_ONLY}
    rows = []
    for rank in arguments.ranks:
        spec = {**shared, "seed": arguments.seed, "rank": rank}
        rows.append(harness.run_worker(__file__, spec))
    if 0 in arguments.ranks:
        add_ratios(rows)
    parameters = rows[0]["parameters"]
    accuracy = accuracy_runs(arguments)
    return {
        "title": "LoRA vs full fine-tuning (CPU)",
        "description": __doc__.split("\n\n")[1].replace("\n", " "),
        "tables": [
            harness.table(
                COLUMNS,
                rows,
                title=f"{parameters / 1e6:.1f} M parameters, batch "
                f"{arguments.batch_size} x {arguments.seq_len} tokens, "
                f"{arguments.threads} torch thread(s)",
            ),
            harness.table(
                ACCURACY_COLUMNS,
                accuracy,
                title="Time to held-out sampled accuracy "
                f"{arguments.target} on the toy task (`grpo-lab train --profile cpu "
                "--lora-rank R`, seed "
                f"{arguments.seed})",
                notes="\n".join(
                    cpu_profile.curve_line(run["method"], run["evaluations"][::5])
                    for run in accuracy
                ),
            ),
        ],
        "notes": "",
        "rows": rows,
    }


def main(argv=None) -> dict | None:
    return harness.main(sys.modules[__name__], argv)


if __name__ == "__main__":
    main()
