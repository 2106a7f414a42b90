"""Rerun every CPU benchmark, then render benchmarks/RESULTS.md (``make bench``).

    .venv/bin/python benchmarks/run_cpu.py            # full sizes (tens of minutes)
    .venv/bin/python benchmarks/run_cpu.py --smoke    # tiny sizes, into benchmarks/out/smoke
    .venv/bin/python benchmarks/run_cpu.py --only logprob_memory trl_train_step

A GPU run's JSON directory (from benchmarks/gpu.sh) can be passed with --gpu-dir
so that RESULTS.md keeps its GPU tables.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from bench_utils import BENCHMARK_DIR, DEFAULT_OUT_DIR, REPO_ROOT

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
}  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument(
        "--only", nargs="+", choices=list(BENCHMARKS), default=list(BENCHMARKS)
    )
    parser.add_argument("--gpu-dir", default=None)
    arguments = parser.parse_args(argv)
    out_dir = DEFAULT_OUT_DIR / "smoke" if arguments.smoke else DEFAULT_OUT_DIR
    for name in arguments.only:
        script, extra = BENCHMARKS[name]
        command = [
            sys.executable,
            str(BENCHMARK_DIR / script),
            "--out",
            str(out_dir / f"{name}.json"),
            *(["--smoke"] if arguments.smoke else extra),
        ]
        print(f"== {' '.join(command)}", flush=True)
        started = time.perf_counter()
        subprocess.run(command, check=True, cwd=REPO_ROOT)
        print(f"== {name}: {time.perf_counter() - started:.0f} s", flush=True)
    render = [sys.executable, str(BENCHMARK_DIR / "render_results.py")]
    render += ["--out-dir", str(out_dir)]
    if arguments.gpu_dir:
        render += ["--gpu-dir", arguments.gpu_dir]
    if arguments.smoke:
        render += ["--out", str(out_dir / "RESULTS.md")]
    subprocess.run(render, check=True, cwd=REPO_ROOT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
