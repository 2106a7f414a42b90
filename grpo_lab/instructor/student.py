"""Student copies of the notebooks: solutions replaced by stubs, outputs cleared.

Every line from ``### BEGIN SOLUTION`` to ``### END SOLUTION`` (markers
included) becomes one ``raise NotImplementedError()`` at the indentation of the
BEGIN marker; the code before and after the markers stays. The check cell that
follows then reports "not attempted yet". Cells tagged ``walk-through`` (they
show the package function an exercise asks for, after its check) are left out
of the student copy, and so are the lines from ``### BEGIN HIDDEN TESTS`` to
``### END HIDDEN TESTS`` of a check cell (cases only the grader runs, as in
nbgrader). Used by ``grpo-lab student-notebooks``, by ``grpo-lab notebooks`` and
when the wheel is built (:mod:`grpo_lab.instructor.wheel_build`): this module
needs no third-party package, and works on a notebook's JSON.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

BEGIN_MARKER = "### BEGIN SOLUTION"
END_MARKER = "### END SOLUTION"
BEGIN_HIDDEN = "### BEGIN HIDDEN TESTS"
END_HIDDEN = "### END HIDDEN TESTS"
STUB = "raise NotImplementedError()"
WALK_THROUGH_TAG = "walk-through"


def strip_solutions(source: str, where: str = "cell") -> str:
    """The source with each solution block replaced by an indented stub.

    ``where`` names the cell in error messages. Raises ValueError on an END
    without BEGIN, a BEGIN inside a block, or a BEGIN never closed.
    """
    kept: list[str] = []
    open_line: int | None = None
    for number, line in enumerate(source.split("\n"), start=1):
        marker = line.strip()
        if marker == BEGIN_MARKER:
            if open_line is not None:
                raise ValueError(
                    f"{where}: line {number} opens a solution block inside the one "
                    f"opened at line {open_line}; expected {END_MARKER!r} first"
                )
            open_line = number
            indent = line[: len(line) - len(line.lstrip())]
            kept.append(f"{indent}{STUB}")
        elif marker == END_MARKER:
            if open_line is None:
                raise ValueError(
                    f"{where}: line {number} has {END_MARKER!r} with no "
                    f"{BEGIN_MARKER!r} before it"
                )
            open_line = None
        elif open_line is None:
            kept.append(line)
    if open_line is not None:
        raise ValueError(
            f"{where}: the solution block opened at line {open_line} has no "
            f"{END_MARKER!r}"
        )
    return "\n".join(kept)


def strip_hidden_tests(source: str, where: str = "cell") -> str:
    """The source without its hidden-test blocks (markers included)."""
    kept: list[str] = []
    open_line: int | None = None
    for number, line in enumerate(source.split("\n"), start=1):
        marker = line.strip()
        if marker == BEGIN_HIDDEN and open_line is None:
            open_line = number
        elif marker == END_HIDDEN:
            if open_line is None:
                raise ValueError(
                    f"{where}: line {number} has {END_HIDDEN!r} with no "
                    f"{BEGIN_HIDDEN!r} before it"
                )
            open_line = None
        elif open_line is None:
            kept.append(line)
    if open_line is not None:
        raise ValueError(
            f"{where}: the hidden tests opened at line {open_line} have no "
            f"{END_HIDDEN!r}"
        )
    return "\n".join(kept)


def student_copy(notebook: dict[str, Any], name: str) -> dict[str, Any]:
    """A copy of a notebook's JSON with solutions stubbed, hidden tests and
    walk-through cells left out and every output cleared. Error messages
    count cells as in ``notebook``."""
    copy = json.loads(json.dumps(notebook))
    kept = []
    for index, cell in enumerate(copy["cells"]):
        if is_walk_through(cell):
            continue
        kept.append(cell)
        if cell["cell_type"] != "code":
            continue
        where = f"{name}, cell {index}"
        source = cell["source"]
        source = "".join(source) if isinstance(source, list) else source
        source = strip_hidden_tests(strip_solutions(source, where), where)
        cell["source"] = source.splitlines(keepends=True)
        cell["outputs"] = []
        cell["execution_count"] = None
    copy["cells"] = kept
    return copy


def notebook_text(notebook: dict[str, Any]) -> str:
    """A notebook's JSON as nbformat writes it (one-space indent, sorted keys)."""
    return json.dumps(notebook, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def student_notebook(notebook: Any, name: str) -> Any:
    """:func:`student_copy` of an ``nbformat`` notebook, as one."""
    import nbformat

    return nbformat.reads(notebook_text(student_copy(notebook, name)), as_version=4)


def is_solution_source(source: str) -> bool:
    """Whether a code cell's source holds a solution block."""
    return any(line.strip() == BEGIN_MARKER for line in source.split("\n"))


def is_walk_through(cell: dict[str, Any]) -> bool:
    """Whether ``cell`` carries the ``walk-through`` tag in its metadata."""
    return WALK_THROUGH_TAG in cell.get("metadata", {}).get("tags", [])


def write_student_notebooks(source_dir: str | Path, out_dir: str | Path) -> list[Path]:
    """Write a student copy of every ``*.ipynb`` in ``source_dir`` to ``out_dir``.

    Returns the written paths in name order. All notebooks are converted before
    any is written, so an unbalanced marker leaves ``out_dir`` untouched.
    """
    source_dir, out_dir = Path(source_dir), Path(out_dir)
    if not source_dir.is_dir():
        raise ValueError(f"source_dir must be a directory, got {str(source_dir)!r}")
    sources = sorted(source_dir.glob("*.ipynb"))
    if not sources:
        raise ValueError(
            f"source_dir must hold .ipynb files, found none in {source_dir}"
        )
    converted = [
        (path.name, student_copy(json.loads(path.read_text("utf-8")), path.name))
        for path in sources
    ]
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, notebook in converted:
        target = out_dir / name
        temporary = target.with_suffix(".ipynb.tmp")
        temporary.write_text(notebook_text(notebook), encoding="utf-8")
        temporary.replace(target)
        written.append(target)
    return written
