"""``grpo-lab train --backend vllm --device cpu``: a short run on vLLM's CPU
engine, killed with SIGKILL after a checkpoint, resumed with ``--resume``.

The random tiny model earns no reward on reversal: every group's rewards are
all 0, no update runs, and the sampler gap must still be logged at every step
(the policy and vLLM agree: float32 on both sides).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from grpo_lab.training.metrics import read_metrics, step_records

# benchmarks/gpu.sh sets cuda: the same run with the policy and vLLM on a GPU.
DEVICE = os.environ.get("GRPO_LAB_VLLM_DEVICE", "cpu")
FLAGS = [
    "--profile", "cpu", "--backend", "vllm", "--device", DEVICE,
    "--tiny-num-layers", "1", "--tiny-intermediate-size", "64",
    "--task-options", '{"n_digits": 3}',
    "--rollout-batch-size", "16", "--group-size", "4", "--train-batch-size", "16",
    "--max-new-tokens", "5", "--eval-every", "2", "--eval-size", "8",
    "--checkpoint-every", "2", "--sft-max-steps", "0", "--no-progress",
]  # fmt: skip
GAP_KEYS = ("rollout/sampler_log_prob_diff_mean", "rollout/sampler_log_prob_diff_max")


def train(arguments: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "grpo_lab.cli", "train", *arguments],
        cwd=cwd,
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_a_vllm_run_killed_with_sigkill_resumes_and_logs_the_gap_every_step(
    tmp_path,
):
    run_dir = tmp_path / "run"
    process = train([*FLAGS, "--run-dir", str(run_dir), "--steps", "400"], tmp_path)
    checkpoint = run_dir / "checkpoints" / "step_000002.pt"
    deadline = time.monotonic() + 240
    while not checkpoint.exists() and process.poll() is None:
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    output, _ = process.communicate(timeout=60)
    assert process.returncode == -signal.SIGKILL, output
    lines_at_kill = len(read_metrics(run_dir))

    resumed = train(
        ["--resume", str(run_dir), "--steps", "4", "--no-progress"], tmp_path
    )
    output, _ = resumed.communicate(timeout=240)
    assert resumed.returncode == 0, output
    records = read_metrics(run_dir)
    assert json.loads((run_dir / "config.json").read_text())["backend"] == "vllm"
    assert 1 <= lines_at_kill < len(records)
    steps = step_records(records)
    assert [r["step"] for r in steps] == [0, 1, 2, 3, 4]
    updates = [r for r in steps if "train/reward_mean" in r]
    assert [r["step"] for r in updates] == [1, 2, 3, 4]
    assert any(r["train/reward_mean"] == 0 for r in updates)
    for record in updates:
        assert record["rollout/sampler_log_prob_diff_max"] < 1e-4, record
        assert set(GAP_KEYS) <= set(record)
