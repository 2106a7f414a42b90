"""Render benchmarks/RESULTS.md from the JSON the benchmark scripts wrote.

    .venv/bin/python benchmarks/render_results.py                 # CPU JSON in benchmarks/out
    .venv/bin/python benchmarks/render_results.py --gpu-dir DIR   # plus a GPU run's JSON
    python benchmarks/render_results.py --gpu-dir DIR --gpu-only --out DIR/GPU_RESULTS.md

Every table states the command that produced it and the machine it ran on.
Nothing here measures: a missing JSON file renders as "not run".
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from bench_utils import BENCHMARK_DIR, DEFAULT_OUT_DIR, REPO_ROOT, format_table
from cpu_profile import COLUMNS as CPU_PROFILE_COLUMNS
from gpu_throughput import ROLLOUT_COLUMNS, TRAIN_COLUMNS
from logprob_memory import COLUMNS as LOGPROB_COLUMNS
from logprob_memory import add_ratios
from time_to_accuracy import COLUMNS as ACCURACY_COLUMNS
from time_to_accuracy import SUMMARY_COLUMNS as ACCURACY_SUMMARY_COLUMNS
from trl_train_step import AGREEMENT_COLUMNS, TIMING_COLUMNS

HEADER = """# Benchmarks

Scripts, not timed tests: each prints a table and writes JSON to `benchmarks/out/`
(gitignored). This file is rendered from that JSON by
`benchmarks/render_results.py`; every figure below comes with the command that
produced it and the machine it ran on. Ratios are measured side by side in one
run. CPU timings on a shared machine are noisy: the load average at the start of
each run is shown with it.

How to rerun:

| what | command |
| --- | --- |
| every CPU benchmark, then this file | `make bench` (runs `benchmarks/run_cpu.py`) |
| the cpu profile, 3 seeds, end to end | `.venv/bin/python benchmarks/cpu_profile.py` |
| log-prob memory and time | `.venv/bin/python benchmarks/logprob_memory.py` |
| one train step against TRL | `.venv/bin/python benchmarks/trl_train_step.py` |
| time to accuracy against TRL | `.venv/bin/python benchmarks/time_to_accuracy.py` |
| one-shot GPU run (one H200, < 8 min) | `PYTHONPATH=. bash benchmarks/gpu.sh` (writes to `$OUT` or `benchmarks/out/gpu`) |
| GPU script on CPU, tiny sizes | `bash benchmarks/gpu.sh --cpu-smoke` |
| this file | `.venv/bin/python benchmarks/render_results.py [--gpu-dir DIR]` |

The comparison trainer is TRL 1.16.0 (`pip install -e ".[bench]"`).
"""


def load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def machine_line(payload: dict) -> str:
    machine = payload["machine"]
    parts = [
        f"nproc {machine['nproc']}",
        f"CPU {machine['cpu_model']}",
        f"torch {machine['torch']}",
        f"transformers {machine['transformers']}",
    ]
    if machine.get("trl"):
        parts.append(f"trl {machine['trl']}")
    if machine.get("gpu"):
        parts.append(f"GPU {machine['gpu']}")
    load_average = ", ".join(f"{value:.2f}" for value in machine["load_average"])
    parts.append(f"load average at start {load_average}")
    parts.append(f"{machine['utc']}")
    return "; ".join(parts)


def not_run(title: str) -> str:
    """The section of a benchmark whose JSON is missing: said, not invented."""
    return f"## {title}\n\nNot run.\n"


def heading(title: str, payload: dict) -> list[str]:
    """A section's first lines: its title, then the command and machine."""
    return [f"## {title}", "", provenance(payload)]


def provenance(payload: dict) -> str:
    command = payload["command"].replace(f"{REPO_ROOT}/", "")  # as typed at the root
    return f"Command: `{command}`  \nMachine: {machine_line(payload)}\n"


def logprob_section(payload: dict | None, title: str) -> str:
    if payload is None:
        return not_run(title)
    rows = payload["rows"]
    settings = payload["settings"]
    lines = [
        *heading(title, payload),
        f"Batch {settings['batch_size']}, hidden {settings['hidden_size']}, dtype "
        f"{settings['dtype']}, one-layer Qwen2 with tied embeddings; backward "
        "through sum(w * log p). Peak: " + payload["memory_measure"] + ". "
        "Head `frozen`: the tied head/embedding weight takes no gradient, so the "
        "peak is the logits' own cost; `trainable`: it trains, and its (V, H) "
        "weight-gradient temporaries (the same for every method) count too.",
        "`naive peak / peak` above 1 means less memory than naive; "
        "`time / naive` below 1 means faster. Differences are against naive.",
        "",
        format_table(rows, LOGPROB_COLUMNS),
        "",
        *logprob_verdicts(rows),
    ]
    return "\n".join(lines) + "\n"


LOGPROB_NOTES = """Reading the log-prob tables:

- naive keeps the (B, T, V) logits, their log-softmax and, in backward, the
  gradients of both; the default path (chunk 0) still materializes the model's
  (B, T, V) logits and their gradient, but no log-softmax table; the chunked
  path holds one (B, c, V) chunk at a time and recomputes it in backward, so
  its time includes a second head forward per chunk.
- What no method removes sets a floor under every peak: the decoder layer's
  activations, the (B, T, H) hidden states and their gradient, and allocator
  slack (resident memory counts it). Chunks above ~256 positions raise the peak
  again at V = 151,936 (a float32 (1, 512, V) chunk is 297 MiB, and its
  backward holds a few).
- With the head trainable, its (V, H) weight gradient and the embedding's
  (0.87 GiB each at V = 151,936) are allocated by every method, which is why
  the ratios there are smaller than with the head frozen.
- Times come from 2 cores; with other jobs running they vary by tens of
  percent between identical cases, so compare times within one table only.
"""


TRAINABLE_NOTES = """Reading the trainable-head tables:

- Every method ends backward holding the head's (V, H) weight gradient, and
  with tied embeddings the embedding's backward builds a second dense (V, H)
  gradient that is added into it: 0.87 GiB each at V = 151,936, H = 1536 in
  float32, whatever B and T are. Naive's (B, T, V) tables grow with B * T, so
  the chunked path's ratio grows with the batch.
- The chunked path sums the head's weight gradient chunk by chunk into one
  buffer (a hand-written checkpoint); `torch.utils.checkpoint` around the head
  would allocate a fresh (V, H) gradient per chunk and add it to `.grad`.
"""


STOPPED_GRID_LOG = "logprob_memory_grid_stopped.log"
LOG_LINE = re.compile(
    r"^\s*(?P<method>\S+) (?P<head>frozen|trainable) V=(?P<vocab_size>\d+) "
    r"T=(?P<seq_len>\d+):\s+(?P<peak_mib>[\d.]+) MiB\s+(?P<seconds>[\d.]+) s$"
)


def stopped_grid_section(out_dir: Path) -> str:
    """The cases a stopped full-grid run printed before it was stopped."""
    path = out_dir / STOPPED_GRID_LOG
    if not path.exists():
        return ""
    rows = []
    for line in path.read_text().splitlines():
        match = LOG_LINE.match(line)
        if match:
            row = match.groupdict()
            rows.append(
                {
                    "method": row["method"],
                    "head": row["head"],
                    "vocab_size": int(row["vocab_size"]),
                    "seq_len": int(row["seq_len"]),
                    "peak_bytes": float(row["peak_mib"]) * 2**20,
                    "seconds": float(row["seconds"]),
                }
            )
    add_ratios(rows)
    columns = [c for c in LOGPROB_COLUMNS if not c[0].startswith("max_abs")]
    return "\n".join(
        [
            "## Log-prob memory and time, full grid (CPU, stopped run)",
            "",
            "Command: `.venv/bin/python benchmarks/logprob_memory.py` (defaults: "
            "batch 1, hidden 1536, float32, frozen head, fresh process per case), "
            f"started 21:47 UTC on the same machine; its printed lines, kept in "
            f"`benchmarks/out/{STOPPED_GRID_LOG}`. It was stopped before its last "
            "four cases (chunk 64-512 at vocabulary 151,936 and T=2048); the "
            "table above is a separate run of that length (naive, default, chunk "
            "128; stopped at the deadline before chunk 256). Only peak and time were "
            "printed, so the agreement columns are missing here. Ratios are "
            "against naive from the same run.",
            "",
            format_table(rows, columns),
            "",
        ]
    )


def logprob_verdicts(rows: list[dict]) -> list[str]:
    """The two targets, checked at the largest vocabulary in the table."""
    largest = max(row["vocab_size"] for row in rows)
    lines = [f"Targets at vocabulary {largest}:", ""]
    for head, seq_len in sorted({(row["head"], row["seq_len"]) for row in rows}):
        case = [
            r
            for r in rows
            if (r["head"], r["vocab_size"], r["seq_len"]) == (head, largest, seq_len)
        ]
        chunked = [r for r in case if r["method"].startswith("chunk=")]
        default = next(r for r in case if r["method"] == "default")
        best = max(chunked, key=_reduction)
        worst = min(chunked, key=_reduction)
        meeting = [r["method"] for r in chunked if _reduction(r) >= 4]
        chunk_verdict = f"met by {', '.join(meeting)}" if meeting else "not met"
        lines.append(
            f"- {head} head, T={seq_len}: chunked head {_reduction(worst):.2f}× "
            f"({worst['method']}) to {_reduction(best):.2f}× ({best['method']}) "
            f"lower peak than naive (target ≥ 4×: {chunk_verdict}); default path "
            f"{_reduction(default):.2f}× (target > 1×: "
            f"{'met' if _reduction(default) > 1 else 'not met'})."
        )
    return lines


def _reduction(row: dict) -> float:
    """naive peak / peak; a peak of 0 bytes (nothing measurable) reads as inf."""
    ratio = row.get("memory_reduction_vs_naive")
    return float("inf") if ratio is None else ratio


def trl_step_section(payload: dict | None) -> str:
    title = "One GRPO step against TRL GRPOTrainer (CPU)"
    if payload is None:
        return not_run(title)
    lines = [
        *heading(title, payload),
        "Same weights, token ids and advantages on both sides; generation and "
        "rewards outside the timed region. grpo_lab: `policy_gradient_update` "
        '(on-policy), as is and with `share_prompt_prefix=True` ("shared-prompt" '
        "columns: each of the batch's prompts runs once for its group, as in the "
        "training loop). TRL: `GRPOTrainer.training_step` on the prepared batch "
        "(its `_prepare_inputs` bypassed) + `clip_grad_norm_` + `optimizer.step`. "
        "Group size "
        f"{payload['settings']['group_size']}, epsilon 0.2, beta 0, one iteration, "
        "fused AdamW on both sides (TRL's default), float32. Seconds: median over "
        f"{payload['settings']['steps']} alternating steps after a warm-up; peak: "
        "fresh process per side, one step after a warm-up step.",
        "",
        format_table(payload["timing"], TIMING_COLUMNS),
        "",
        "Loss and gradient agreement, one step from the same weights "
        "(gradients read before the update):",
        "",
        format_table(payload["agreement"], AGREEMENT_COLUMNS),
        "",
        TRL_LOSS_NOTES,
    ]
    return "\n".join(lines) + "\n"


TRL_LOSS_NOTES = """Reading: the ratio columns compare the two on the same batch in one
process. Both run the same model forward and backward; what differs is the
scoring around it. TRL 1.16 scores with its own chunked head
(`add_fused_lm_head`); off Triton devices it scores every position, prompt
included, and computes the entropy at each. grpo_lab scores the (B, T)
response positions it needs with the lean default path, which keeps no
(B, T, V) log-softmax table. Both sides' times include the AdamW step.

Where the definitions coincide and where they differ:

- TRL `loss_type="grpo"` is `mean_i( sum_t -min(r A_i, clip(r) A_i) / |o_i| )`;
  with one iteration per batch its old log-probs are the detached current ones,
  so `r = 1` and the value is `-mean(A)`. grpo_lab's `"grpo"` reweighting with
  `old_log_probs` = the current log-probs and `loss_normalization="sequence"` is
  the same expression: same value, same gradient.
- TRL `loss_type="dr_grpo"` divides the masked token sum by
  `B * max_completion_length`; grpo_lab's `"constant"` normalization divides by
  `normalization_constant`, so they coincide for
  `normalization_constant = B * max_completion_length`.
- grpo_lab's on-policy default `"none"` uses `-A * log p` (REINFORCE form): its
  value differs from TRL's (`-A * 1`), its gradient `-A * grad log p` is the same.
- TRL's default `loss_type="dapo"` (divide by the number of tokens in the
  accumulated generation batch) has no exact grpo_lab counterpart with variable
  token counts across microbatches; with one microbatch it equals
  `"constant"` with `normalization_constant` = that token count.
- Advantages: TRL's `scale_rewards="group"` divides by the unbiased group
  standard deviation plus 1e-4; grpo_lab's `"std"` normalizer uses its own
  epsilon. Here both sides receive the same precomputed advantages.
"""


def accuracy_section(payload: dict | None) -> str:
    title = "Time to accuracy against TRL GRPOTrainer (CPU toy task)"
    if payload is not None:
        seeds = sorted({run["seed"] for run in payload["runs"]})
        title += f", seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}"
    if payload is None:
        return not_run(title)
    lines = [
        *heading(title, payload),
        payload.get("description", ""),
        "",
        format_table(payload["runs"], ACCURACY_COLUMNS),
        "",
        format_table(payload["summary"], ACCURACY_SUMMARY_COLUMNS),
        "",
        "Held-out accuracy by step (step: sampled / greedy accuracy; seconds "
        "exclude evaluation):",
        "",
        *[accuracy_curve(run) for run in payload["runs"]],
    ]
    return "\n".join(lines) + "\n"


def accuracy_sections(out_dir: Path) -> list[str]:
    """One section per time_to_accuracy*.json (e.g. seeds run as separate jobs)."""
    paths = sorted(out_dir.glob("time_to_accuracy*.json"))
    if not paths:
        return [accuracy_section(None)]
    return [*(accuracy_section(load(path)) for path in paths), ACCURACY_NOTES]


def accuracy_curve(run: dict) -> str:
    points = ", ".join(
        f"{e['step']}: {_accuracy_pair(e)} ({e['seconds']:.0f} s)"
        for e in run["evaluations"]
    )
    return f"- {run['framework']}, seed {run['seed']}: {points}"


def _accuracy_pair(evaluation: dict) -> str:
    sampled = evaluation.get("accuracy_sampled")
    greedy = f"{evaluation['accuracy_greedy']:.2f}"
    return greedy if sampled is None else f"{sampled:.2f} / {greedy}"


ACCURACY_NOTES = """Notes:

- Both sides start from the same warmed-up weights; the warm-up (grpo_lab's
  supervised warm-up, until a quarter of sampled held-out answers are right) is
  shared and not counted.
- Seconds per step include sampling, rewards and the update on both sides.
  TRL's generation goes through its own `generate` call and bookkeeping;
  grpo_lab's through `grpo_lab.rollouts.hf`.
- grpo_lab runs each prompt once for its group of 8, both when sampling (one
  prefill per distinct prompt, its key/value cache copied to the 8 rows) and
  in the update (`share_prompt_prefix`, the cpu profile's default); TRL runs
  every prompt 8 times. With 6-token prompts and responses of 5 digits plus
  EOS, a group's update runs 5 + 8 × 7 = 61 positions instead of 8 × 12 = 96.
- Both sides run every step. Later steps cost grpo_lab less (more groups are
  all correct, and it does not score groups whose rewards are all equal), so
  time per step is given over two identical step ranges: all steps ("shared
  steps"), and the steps until both runs had reached the target.
- At lr 1e-3 both sides collapse from the same warm start (an earlier run:
  greedy accuracy 0.74 at step 0, 0 by step 5 for grpo_lab and 0 at step 40
  for TRL; seed 0); the cpu profile uses 3e-4.
"""


def gpu_sections(gpu_dir: Path | None) -> str:
    if gpu_dir is None or not (gpu_dir / "gpu_throughput.json").exists():
        return (
            "## GPU (one H200)\n\n"
            "Not run yet: no GPU was available when this file was rendered. "
            "`benchmarks/gpu.sh` is ready and was validated end to end on CPU "
            "with `bash benchmarks/gpu.sh --cpu-smoke` (tiny sizes, every code "
            "path). Run `PYTHONPATH=. bash benchmarks/gpu.sh` on the GPU machine, "
            "then `benchmarks/render_results.py --gpu-dir $OUT` to add its tables.\n"
        )
    throughput = load(gpu_dir / "gpu_throughput.json")
    settings = throughput["settings"]
    lines = [
        "## GPU: train-step and rollout throughput, Qwen2.5-1.5B shape",
        "",
        provenance(throughput),
        f"Random weights, {settings['dtype']}, shape {settings['shape']}. "
        f"MFU = 6·N·tokens / time / {throughput['peak_flops']:.3g} FLOP/s (dense "
        "bf16 peak of H100/H200 SXM); attention-score FLOPs and the chunked "
        "head's recomputation are not counted.",
        "",
        format_table(throughput["train_step"], TRAIN_COLUMNS),
        "",
        "HF `generate` rollouts (sampling, temperature 1, no top-k):",
        "",
        format_table(throughput["rollout"], ROLLOUT_COLUMNS),
        "",
    ]
    memory = load(gpu_dir / "logprob_memory_gpu.json")
    lines.append(logprob_section(memory, "GPU: log-prob memory and time"))
    return "\n".join(lines) + "\n"


def cpu_profile_section(payload: dict | None) -> str:
    title = "The cpu training profile end to end (`grpo-lab train --profile cpu`)"
    if payload is None:
        return not_run(title)
    target = payload["settings"]["target"]
    lines = [
        *heading(title, payload),
        "One fresh `grpo-lab train --profile cpu --seed S` process per seed, with "
        "the profile's defaults; wall time covers the whole command (model build, "
        "supervised warm-up, GRPO steps, evaluations every 10 steps, checkpoints, "
        "final save). Accuracy is on 200 held-out prompts: one answer sampled at "
        "temperature 1 (the distribution being trained), and greedy decoding. Step "
        f'0 is right after the warm-up; "first ≥ target" is the first evaluated '
        f"step at or above {target}.",
        "",
        format_table(payload["runs"], CPU_PROFILE_COLUMNS),
        "",
        "Held-out accuracy by step (step: sampled / greedy):",
        "",
        *[
            f"- seed {run['seed']}: "
            + ", ".join(
                f"{e['step']}: {_accuracy_pair(e)}"
                for e in run["evaluations"]
                if e["step"] % 50 == 0 or e is run["evaluations"][-1]
            )
            for run in payload["runs"]
        ],
    ]
    return "\n".join(lines) + "\n"


def trainable_head_sections(out_dir: Path) -> list[str]:
    """One section per logprob_memory_trainable*.json (batch 1, batch 2, ...)."""
    paths = sorted(out_dir.glob("logprob_memory_trainable*.json"))
    if not paths:
        return [logprob_section(None, "Log-prob memory and time, trainable head")]
    sections = []
    for path in paths:
        payload = load(path)
        batch = payload["settings"]["batch_size"]
        title = f"Log-prob memory and time, trainable head, batch {batch} (CPU)"
        sections.append(logprob_section(payload, title))
    return [*sections, TRAINABLE_NOTES]


def render(out_dir: Path, gpu_dir: Path | None, gpu_only: bool) -> str:
    if gpu_only:
        return gpu_sections(gpu_dir)
    sections = [
        HEADER,
        logprob_section(
            load(out_dir / "logprob_memory.json"), "Log-prob memory and time (CPU)"
        ),
        stopped_grid_section(out_dir),
        LOGPROB_NOTES,
        *trainable_head_sections(out_dir),
        cpu_profile_section(load(out_dir / "cpu_profile.json")),
        trl_step_section(load(out_dir / "trl_train_step.json")),
        *accuracy_sections(out_dir),
        gpu_sections(gpu_dir),
    ]
    return "\n".join(sections)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    parser.add_argument("--gpu-dir", type=Path, default=None)
    parser.add_argument("--gpu-only", action="store_true")
    parser.add_argument("--out", type=Path, default=BENCHMARK_DIR / "RESULTS.md")
    arguments = parser.parse_args(argv)
    text = render(arguments.out_dir, arguments.gpu_dir, arguments.gpu_only)
    arguments.out.parent.mkdir(parents=True, exist_ok=True)
    arguments.out.write_text(text)
    print(f"wrote {arguments.out}")


if __name__ == "__main__":
    sys.exit(main())
