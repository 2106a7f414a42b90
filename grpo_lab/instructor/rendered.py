"""Rendered copies for readers: each notebook's student copy, executed on the cpu
profile, with its outputs, in ``rendered/`` beside the course source.

A reader on the web sees the plots and numbers the text describes, and no
solution: a rendered copy is a student copy (:mod:`grpo_lab.instructor.student`),
so its exercises are stubs and its checks say "not attempted yet". Each records
the hash of the course cells it was made from (``metadata.grpo_lab``), so
``tests/test_rendered.py`` fails as soon as a course notebook changes and its
rendered copy is not made again. The Colab badge opens these copies too.

    python -m grpo_lab.instructor.rendered [NN ...]   # or: make rendered

executes every notebook (or those whose number is given) one at a time in a
fresh kernel, in a temporary folder (runs written there are thrown away), with
``GRPO_LAB_PROFILE=cpu``; on two cores all of them take about ten minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from grpo_lab.instructor.student import notebook_text, student_copy

ROOT = Path(__file__).resolve().parents[2]
SOURCE_DIR = ROOT / "notebooks"
RENDERED_DIR = ROOT / "rendered"
# Seconds one cell may run; notebook 08's longest run takes about 70.
CELL_TIMEOUT = 900


def render(source: Path, out_dir: Path = RENDERED_DIR) -> Path:
    """Execute the student copy of ``source`` on the cpu profile and write it,
    with its outputs, to ``out_dir``; its path."""
    import nbformat

    notebook = json.loads(source.read_text(encoding="utf-8"))
    copy = nbformat.reads(notebook_text(student_copy(notebook, source.name)), 4)
    work = execute_on_cpu_profile(copy)
    without_local_paths(copy, (work,))
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / source.name
    nbformat.write(copy, target)
    return target


def execute_on_cpu_profile(notebook: Any) -> str:
    """Execute ``notebook`` (nbformat) in place, in a fresh kernel started in a
    temporary folder with ``GRPO_LAB_PROFILE=cpu`` and its runs written there;
    the folder's path (gone once this returns)."""
    import nbclient

    with tempfile.TemporaryDirectory(prefix="grpo-lab-render-") as work:
        environment = {
            "GRPO_LAB_PROFILE": "cpu",
            "GRPO_LAB_RUNS_DIR": work,
            "MPLBACKEND": "agg",
        }
        saved = {name: os.environ.get(name) for name in environment}
        os.environ.update(environment)  # the kernel inherits this environment
        try:
            nbclient.NotebookClient(
                notebook,
                timeout=CELL_TIMEOUT,
                kernel_name="python3",
                resources={"metadata": {"path": work}},
            ).execute()
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
    return work


def without_local_paths(notebook: Any, folders: tuple[str, ...] = ()) -> None:
    """Drop this machine's folders (the checkout, the run's temporary folder)
    from the text outputs of ``notebook``, in place: a reader sees
    ``grpo_lab/teaching/explorer.py``, not where it was rendered."""
    prefixes = [os.path.join(str(folder), "") for folder in (ROOT, *folders)]

    def relative(text: str) -> str:
        for prefix in prefixes:
            text = text.replace(prefix, "")
        return text

    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            if "text" in output:
                output["text"] = relative(output["text"])
            if "text/plain" in output.get("data", {}):
                output["data"]["text/plain"] = relative(output["data"]["text/plain"])
            if "traceback" in output:
                output["traceback"] = [relative(line) for line in output["traceback"]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m grpo_lab.instructor.rendered",
        description="Execute the student copy of each course notebook on the cpu "
        "profile into rendered/.",
    )
    parser.add_argument(
        "numbers", nargs="*", metavar="NN", help="only these notebooks (e.g. 03 09)"
    )
    arguments = parser.parse_args(argv)
    sources = sorted(SOURCE_DIR.glob("[0-9][0-9]_*.ipynb"))
    if arguments.numbers:
        sources = [path for path in sources if path.name[:2] in arguments.numbers]
        if not sources:
            parser.error(f"no notebook numbered {' '.join(arguments.numbers)}")
    for source in sources:
        print(f"rendered {render(source).relative_to(ROOT)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
