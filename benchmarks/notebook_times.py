"""Each notebook's wall time on the cpu profile, as CI executes it.

Runs the course notebooks (solutions in, as `make notebooks` runs them) one at a
time, each in a fresh kernel started in a temporary folder, with
``GRPO_LAB_PROFILE=cpu`` and the runs it writes thrown away afterwards. Per
notebook: the wall seconds from the kernel's start to the last cell's reply,
the slowest cell (from the execution timestamps nbclient records in each cell)
and the load average when it started, against the bound notebooks 15 and 16
were given: three minutes on two cores.

    .venv/bin/python benchmarks/notebook_times.py                    # all of them
    .venv/bin/python benchmarks/notebook_times.py --notebooks 15 16
    .venv/bin/python benchmarks/notebook_times.py --quick            # notebook 00
"""

from __future__ import annotations

import os
import sys
import time
from datetime import datetime
from pathlib import Path

import harness

from grpo_lab.instructor.rendered import execute_on_cpu_profile

NOTEBOOK_DIR = harness.REPO_ROOT / "notebooks"
LIMIT_SECONDS = 180.0
FLAGS = {
    "notebooks": harness.Flag(
        ["all"], help="notebook numbers (00 ... 16), or all of them"
    ),
}
QUICK = {"notebooks": ["00"]}
COLUMNS = [
    ("notebook", "notebook"), ("cells", "code cells"), ("wall_seconds", "wall s"),
    ("slowest_cell_seconds", "slowest cell s"), ("slowest_cell", "slowest cell"),
    ("under_limit", f"under {LIMIT_SECONDS:.0f} s"), ("load_at_start", "load at start"),
]  # fmt: skip


def chosen(numbers: list[str]) -> list[Path]:
    """The notebooks named by number (``all``: every one), in order."""
    every = sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"))
    if numbers == ["all"]:
        return every
    found = [path for path in every if path.name[:2] in {n.zfill(2) for n in numbers}]
    missing = {n.zfill(2) for n in numbers} - {path.name[:2] for path in found}
    if missing:
        raise SystemExit(f"--notebooks: no notebook numbered {sorted(missing)}")
    return found


def execute(path: Path) -> tuple[object, float]:
    """Run ``path`` in a fresh kernel on the cpu profile; it and its wall seconds."""
    import nbformat

    notebook = nbformat.read(path, as_version=4)
    started = time.perf_counter()
    execute_on_cpu_profile(notebook)
    return notebook, time.perf_counter() - started


def cell_seconds(cell) -> float:
    """A cell's seconds from its execution timestamps (0 when it has none)."""
    stamps = cell.get("metadata", {}).get("execution", {})
    begun, ended = stamps.get("iopub.execute_input"), stamps.get("shell.execute_reply")
    if not (begun and ended):
        return 0.0
    begun, ended = (
        datetime.fromisoformat(s.replace("Z", "+00:00")) for s in (begun, ended)
    )
    return (ended - begun).total_seconds()


def timed(path: Path) -> dict:
    """One notebook's row."""
    load = round(os.getloadavg()[0], 2)
    notebook, seconds = execute(path)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    slowest = max(code, key=cell_seconds)
    first_line = next((line for line in slowest.source.splitlines() if line), "")
    return {
        "notebook": path.stem,
        "cells": len(code),
        "wall_seconds": seconds,
        "slowest_cell_seconds": cell_seconds(slowest),
        "slowest_cell": f"#{code.index(slowest) + 1}: `{first_line[:50]}`",
        "under_limit": seconds < LIMIT_SECONDS,
        "load_at_start": load,
    }


def report(rows: list[dict]) -> dict:
    total = sum(row["wall_seconds"] for row in rows)
    return {
        "title": "Notebooks on the cpu profile: wall time each",
        "description": (
            "The course notebooks as `make notebooks` runs them (solutions in), "
            "one at a time, each in a fresh kernel with GRPO_LAB_PROFILE=cpu; wall "
            "seconds include the kernel's start. The column under "
            f"{LIMIT_SECONDS:.0f} s checks the bound notebooks 15 and 16 were "
            f"given (three minutes on two cores). Total: {total:.0f} s one after "
            "another (CI runs two at a time)."
        ),
        "tables": [harness.table(COLUMNS, rows)],
        "notes": "",
    }


def measure(arguments, save: harness.Save) -> dict:
    rows: list[dict] = []
    for path in chosen(arguments.notebooks):
        rows.append(timed(path))
        save(report(rows))
        print(f"{path.stem}: {rows[-1]['wall_seconds']:.0f} s", flush=True)
    return report(rows)


def main(argv=None) -> dict | None:
    return harness.main(sys.modules[__name__], argv)


if __name__ == "__main__":
    main()
