"""Rerun every CPU benchmark, then render benchmarks/RESULTS.md (``make bench``).

    .venv/bin/python benchmarks/run_cpu.py          # full sizes, into benchmarks/results/
    .venv/bin/python benchmarks/run_cpu.py --quick  # tiny sizes, into benchmarks/out/quick
    .venv/bin/python benchmarks/run_cpu.py --only logprob_memory trl_train_step

A full run replaces the committed result files it reruns; RESULTS.md is then
rendered from benchmarks/results/, GPU result files copied there included.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from harness import BENCHMARK_DIR, OUT_DIR, REPO_ROOT
from render_results import RESULTS_DIR

# name: (script, extra arguments at full size). The trainable-head runs take the
# largest case only, at batch 1 and 2: the (V, H) gradients every method holds
# weigh less against (B, T, V) logits as the batch grows.
TRAINABLE_HEAD = [
    "--heads", "trainable", "--vocab-sizes", "151936", "--seq-lens", "2048",
    "--chunk-sizes", "128", "256",
]  # fmt: skip
BENCHMARKS = {
    "cpu_profile": ("cpu_profile.py", []),
    "logprob_memory": ("logprob_memory.py", []),
    "logprob_memory_trainable": ("logprob_memory.py", TRAINABLE_HEAD),
    "logprob_memory_trainable_b2": (
        "logprob_memory.py", [*TRAINABLE_HEAD, "--batch-size", "2"],
    ),
    "trl_train_step": ("trl_train_step.py", []),
    "time_to_accuracy": ("time_to_accuracy.py", []),
    "threads": ("threads.py", []),
    "kl_reference": ("kl_reference.py", []),
    "lora": ("lora.py", []),
}  # fmt: skip


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", "--smoke", action="store_true")
    parser.add_argument(
        "--only", nargs="+", choices=list(BENCHMARKS), default=list(BENCHMARKS)
    )
    arguments = parser.parse_args(argv)
    out_dir = OUT_DIR / "quick" if arguments.quick else RESULTS_DIR
    for name in arguments.only:
        script, extra = BENCHMARKS[name]
        command = [
            sys.executable,
            str(BENCHMARK_DIR / script),
            "--out",
            str((out_dir / f"{name}.json").relative_to(REPO_ROOT)),
            *(["--quick"] if arguments.quick else extra),
        ]
        print(f"== {' '.join(command)}", flush=True)
        started = time.perf_counter()
        subprocess.run(command, check=True, cwd=REPO_ROOT)
        print(f"== {name}: {time.perf_counter() - started:.0f} s", flush=True)
    render = [sys.executable, str(BENCHMARK_DIR / "render_results.py"), str(out_dir)]
    if arguments.quick:
        render += ["--out", str(out_dir / "RESULTS.md")]
    subprocess.run(render, check=True, cwd=REPO_ROOT)


if __name__ == "__main__":
    main()
