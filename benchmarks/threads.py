"""CPU threads under load: the cpu profile idle and beside one busy core.

Runs `grpo-lab train --profile cpu` four ways, one fresh process each, one at a
time: with torch's default thread count (one per core: `--num-threads N`) and
with the run's own choice (`num_threads` unset: one thread for the tiny model),
each on an otherwise idle machine and with another process keeping one core
busy (a pure-Python loop in a child process, started before the run and killed
after it). The ratio loaded / idle is the slowdown a student sees when a browser
or a Jupyter server shares the laptop; the target is at most 2x.

    .venv/bin/python benchmarks/threads.py                  # the full cpu profile
    .venv/bin/python benchmarks/threads.py --quick          # a few steps each
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import tempfile
from pathlib import Path

import harness
from cpu_profile import run_seed

FLAGS = {
    "seed": 0,
    "train_flags": harness.Flag("", help="more `grpo-lab train` flags, one string"),
}
QUICK = {"train_flags": "--steps 20 --eval-every 10 --eval-size 50"}
COLUMNS = [
    ("threads", "torch threads"), ("load", "other process"),
    ("wall_seconds", "wall s"), ("grpo_step_seconds", "GRPO step s (sum)"),
    ("slowdown", "loaded / idle"),
]  # fmt: skip


def busy_loop() -> None:
    """Keep one core busy until killed."""
    while True:
        pass


def timed_run(seed: int, train_flags: str, threads: int | None, busy: bool) -> dict:
    """One cpu-profile run: wall and GRPO-step seconds, beside a busy core or not."""
    flags = train_flags + ("" if threads is None else f" --num-threads {threads}")
    spinner = multiprocessing.Process(target=busy_loop, daemon=True) if busy else None
    if spinner is not None:
        spinner.start()
    try:
        with tempfile.TemporaryDirectory() as scratch:
            run = run_seed(seed, Path(scratch) / "run", flags, target=1.0)
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.join()
    return {
        "threads": f"{threads} (torch default)" if threads else "chosen: 1",
        "load": "one busy core" if busy else "none",
        "wall_seconds": run["wall_seconds"],
        "grpo_step_seconds": run["grpo_step_seconds"],
    }


def measure(arguments, save: harness.Save) -> dict:
    rows = []
    cores = os.cpu_count() or 1
    for threads in (cores, None):
        idle = timed_run(arguments.seed, arguments.train_flags, threads, busy=False)
        rows.append(idle)
        loaded = timed_run(arguments.seed, arguments.train_flags, threads, busy=True)
        loaded["slowdown"] = loaded["wall_seconds"] / idle["wall_seconds"]
        rows.append(loaded)
        save(report(rows, cores))
    return report(rows, cores)


def report(rows: list[dict], cores: int) -> dict:
    return {
        "title": "CPU threads: the cpu profile idle and beside one busy core",
        "description": (
            f"`grpo-lab train --profile cpu` on a {cores}-core machine, one fresh "
            "process per row, one at a time: with torch's default thread count "
            "(one per core) and with the run's choice (one thread for the tiny "
            "model), each idle and with a pure-Python busy loop on one core. The "
            "target is a loaded / idle ratio of at most 2."
        ),
        "tables": [harness.table(COLUMNS, rows)],
        "notes": "",
    }


def main(argv=None) -> dict | None:
    return harness.main(sys.modules[__name__], argv)


if __name__ == "__main__":
    main()
