"""Every benchmark script runs at its smallest sizes and writes the expected JSON.

Not timing tests: they check that each code path runs, that the JSON carries
its fields, and that the agreement checks inside the benchmarks hold (the
optimized log-prob paths match naive; TRL's loss matches grpo_lab's where the
definitions coincide). The TRL comparisons need the ``bench`` extra.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
BENCHMARK_DIR = REPO_ROOT / "benchmarks"
sys.path.insert(0, str(BENCHMARK_DIR))

import gpu_throughput  # noqa: E402
import logprob_memory  # noqa: E402
import render_results  # noqa: E402

MACHINE_FIELDS = {"nproc", "cpu_model", "load_average", "torch", "transformers"}


@pytest.fixture(scope="module")
def smoke_dir(tmp_path_factory) -> Path:
    """logprob_memory (in-process) and gpu_throughput at smoke sizes, run once."""
    out_dir = tmp_path_factory.mktemp("bench")
    logprob_memory.main(
        ["--smoke", "--in-process", "--out", str(out_dir / "logprob_memory.json")]
    )
    gpu_throughput.main(["--smoke", "--out", str(out_dir / "gpu_throughput.json")])
    return out_dir


def read(path: Path) -> dict:
    return json.loads(path.read_text())


def assert_log_probs_agree(rows: list[dict], tolerance: float) -> None:
    for row in rows:
        for key in (
            "max_abs_diff_log_probs",
            "max_abs_diff_token_entropy",
            "max_abs_diff_head_grad",
            "max_abs_diff_decoder_grad",
        ):
            assert row[key] < tolerance, (row["method"], key, row[key])


def test_logprob_memory_rows_cover_every_method_and_agree(smoke_dir):
    payload = read(smoke_dir / "logprob_memory.json")
    assert set(payload["machine"]) >= MACHINE_FIELDS
    assert payload["command"].startswith(".venv/bin/python")
    rows = payload["rows"]
    methods = ["naive", "default", "chunk=16", "chunk=64"]
    assert [(row["head"], row["method"]) for row in rows] == [
        (head, method) for head in ("frozen", "trainable") for method in methods
    ]
    for row in rows:
        assert row["seconds"] > 0
        assert row["peak_bytes"] >= 0
        assert {"memory_reduction_vs_naive", "time_vs_naive", "peak_mib"} <= set(row)
    assert rows[0]["time_vs_naive"] == rows[4]["time_vs_naive"] == 1.0
    # The default and chunked paths compute the same log-probs, entropies and
    # gradients as log_softmax + gather (float32: rounding only).
    assert_log_probs_agree(rows, 1e-4)


@pytest.mark.slow
def test_logprob_memory_fresh_process_per_case(tmp_path):
    out = tmp_path / "logprob_memory.json"
    logprob_memory.main(["--smoke", "--heads", "frozen", "--out", str(out)])
    rows = read(out)["rows"]
    assert [row["method"] for row in rows] == [
        "naive",
        "default",
        "chunk=16",
        "chunk=64",
    ]
    assert all(row["peak_bytes"] > 0 for row in rows)
    assert_log_probs_agree(rows, 1e-4)
    assert "fresh process" in read(out)["memory_measure"]


def test_gpu_throughput_smoke_reports_both_head_paths_and_rollouts(smoke_dir):
    payload = read(smoke_dir / "gpu_throughput.json")
    assert payload["peak_flops"] == 989e12
    train_rows = payload["train_step"]
    assert [row["logits_chunk_size"] for row in train_rows] == [0, 8]
    for row in train_rows:
        # tokens/s is B * T / seconds per step: 4 * 32 tokens here.
        assert row["tokens_per_second"] == pytest.approx(
            4 * 32 / row["seconds_per_step"]
        )
        assert 0 < row["mfu"] < 1
    (rollout,) = payload["rollout"]
    # 2 rows x 4 new tokens each, every row forced to full length.
    assert rollout["tokens_per_second"] == pytest.approx(2 * 4 / rollout["seconds"])


def test_render_results_writes_every_table_with_its_command(smoke_dir, tmp_path):
    out = tmp_path / "RESULTS.md"
    render_results.main(
        ["--out-dir", str(smoke_dir), "--gpu-dir", str(smoke_dir), "--out", str(out)]
    )
    text = out.read_text()
    assert "## Log-prob memory and time (CPU)" in text
    assert "benchmarks/logprob_memory.py --smoke" in text
    assert "| frozen | 512 | 64 | chunk=16 |" in text
    assert "trainable head, T=64: chunked head" in text
    assert "Qwen2.5-1.5B shape" in text and "tokens/s" in text
    # Files absent from these folders are said to be missing, not invented: the
    # trainable-head CPU run, the cpu profile, both TRL benchmarks and the GPU
    # log-prob run.
    assert text.count("Not run.") == 5


@pytest.mark.slow
def test_gpu_script_cpu_smoke_runs_every_step(tmp_path):
    completed = subprocess.run(
        ["bash", str(BENCHMARK_DIR / "gpu.sh"), "--cpu-smoke"],
        cwd=REPO_ROOT,
        env={**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    for name in ("logprob_memory_gpu.json", "gpu_throughput.json", "machine.txt"):
        assert (tmp_path / name).exists(), name
    results = (tmp_path / "GPU_RESULTS.md").read_text()
    assert "GPU: log-prob memory and time" in results


@pytest.mark.slow
def test_trl_train_step_losses_and_gradients_agree(tmp_path):
    pytest.importorskip("trl")
    import trl_train_step

    out = tmp_path / "trl_train_step.json"
    trl_train_step.main(["--smoke", "--out", str(out)])
    payload = read(out)
    (timing,) = payload["timing"]
    assert timing["ours_seconds"] > 0 and timing["trl_seconds"] > 0
    assert timing["trl_time_over_ours"] == pytest.approx(
        timing["trl_seconds"] / timing["ours_seconds"]
    )
    assert timing["ours_peak_mib"] > 0 and timing["trl_peak_mib"] > 0
    assert timing["shared_seconds"] > 0 and timing["shared_peak_mib"] > 0
    assert timing["trl_time_over_shared"] == pytest.approx(
        timing["trl_seconds"] / timing["shared_seconds"]
    )
    rows = {
        (r["trl_loss_type"], r["ours"].split(",")[0]): r for r in payload["agreement"]
    }
    assert set(rows) == {
        ("grpo", "grpo"),
        ("grpo", "none"),
        ("dr_grpo", "grpo"),
        ("dr_grpo", "none"),
    }
    for row in rows.values():
        assert row["max_abs_grad"] > 0
        assert row["max_abs_grad_diff"] < 1e-5 * max(1.0, row["max_abs_grad"])
    # Ratio 1 on both sides: the values coincide exactly where definitions do.
    assert rows[("grpo", "grpo")]["loss_abs_diff"] < 1e-6
    assert rows[("dr_grpo", "grpo")]["loss_abs_diff"] < 1e-6


@pytest.mark.slow
def test_time_to_accuracy_smoke_runs_both_trainers(tmp_path):
    pytest.importorskip("trl")
    import time_to_accuracy

    out = tmp_path / "time_to_accuracy.json"
    time_to_accuracy.main(["--smoke", "--out", str(out)])
    payload = read(out)
    assert [run["framework"] for run in payload["runs"]] == ["grpo_lab", "TRL"]
    for run in payload["runs"]:
        # Smoke: 2 steps, evaluated before the first and after each.
        assert [e["step"] for e in run["evaluations"]] == [0, 1, 2]
        assert run["seconds_per_step"] > 0
    assert [row["framework"] for row in payload["summary"]] == ["grpo_lab", "TRL"]


def test_cpu_profile_smoke_runs_the_real_command(tmp_path):
    import cpu_profile

    out = tmp_path / "cpu_profile.json"
    cpu_profile.main(["--smoke", "--seeds", "0", "--out", str(out)])
    (run,) = read(out)["runs"]
    assert run["seed"] == 0 and run["wall_seconds"] > 0
    assert run["grpo_steps"] == 2 and 1 <= run["sft_steps"] <= 2
    assert [e["step"] for e in run["evaluations"]] == [0, 1, 2]
    for key in ("sampled_start", "sampled_end", "greedy_start", "greedy_end"):
        assert 0.0 <= run[key] <= 1.0
