"""Student copies of the notebooks: solutions replaced by stubs, outputs cleared.

Every line from ``### BEGIN SOLUTION`` to ``### END SOLUTION`` (markers
included) becomes one ``raise NotImplementedError()`` at the indentation of the
BEGIN marker; the code before and after the markers stays. The check cell that
follows then reports "not attempted yet". Cells tagged ``walk-through`` (they
show the package function an exercise asks for, after its check) are left out
of the student copy, and so are the lines from ``### BEGIN HIDDEN TESTS`` to
``### END HIDDEN TESTS`` of a check cell (cases only the grader runs, as in
nbgrader). Every student copy records in its metadata the hash of the course
cells it was made from (:func:`course_cells_hash`), so a student's folder can be
brought up to date without overwriting the student's work
(:func:`update_student_folder`, ``grpo-lab notebooks`` and ``make lab``) and a
rendered copy can be checked against the current course. Used by ``grpo-lab
notebooks`` and when the wheel is built (:mod:`grpo_lab.instructor.wheel_build`):
this module needs no third-party package, and works on a notebook's JSON.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BEGIN_MARKER = "### BEGIN SOLUTION"
END_MARKER = "### END SOLUTION"
BEGIN_HIDDEN = "### BEGIN HIDDEN TESTS"
END_HIDDEN = "### END HIDDEN TESTS"
STUB = "raise NotImplementedError()"
WALK_THROUGH_TAG = "walk-through"
# A student copy's ``metadata[METADATA_KEY][COURSE_HASH_KEY]``: the hash of the
# course cells it was made from.
METADATA_KEY = "grpo_lab"
COURSE_HASH_KEY = "course_cells_sha256"


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
    copy.setdefault("metadata", {})[METADATA_KEY] = {
        COURSE_HASH_KEY: course_cells_hash(notebook)
    }
    return copy


def course_cells_hash(notebook: dict[str, Any]) -> str:
    """sha256 of a notebook's cells as they shape its student copy: each cell's
    type, tags and source (outputs, counts and ids left out)."""
    cells = [
        [cell["cell_type"], cell.get("metadata", {}).get("tags", []), _joined(cell)]
        for cell in notebook["cells"]
    ]
    text = json.dumps(cells, ensure_ascii=False, sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def made_from(notebook: dict[str, Any]) -> str | None:
    """The course-cells hash a student copy records (None when it has none)."""
    return notebook.get("metadata", {}).get(METADATA_KEY, {}).get(COURSE_HASH_KEY)


def _joined(cell: dict[str, Any]) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else source


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


@dataclass
class StudentFolderUpdate:
    """What :func:`update_student_folder` did: notebooks it ``added``, course
    updates it wrote ``beside`` a notebook already there (``{existing: new}``),
    and notebooks already made from the current course (``current``)."""

    added: list[Path] = field(default_factory=list)
    beside: dict[Path, Path] = field(default_factory=dict)
    current: list[Path] = field(default_factory=list)

    def lines(self) -> list[str]:
        """One line per notebook written, for the person who asked."""
        lines = [f"added {path.name}" for path in self.added]
        lines += [
            f"{old.name} is kept as it is; the course changed it, and its new "
            f"version is {new.name}"
            for old, new in self.beside.items()
        ]
        return lines


def update_student_folder(
    source_dir: str | Path, out_dir: str | Path
) -> StudentFolderUpdate:
    """Bring ``out_dir`` (a student's own folder) up to the course in ``source_dir``
    without overwriting anything in it.

    A course notebook missing from ``out_dir`` gets its student copy there. One
    already there is never touched: when it was made from other course cells
    than the current ones (the course changed since, or the file is not a
    student copy), the new student copy is written beside it as
    ``NAME.update-HASH.ipynb`` (HASH: the first 8 hex digits of the course-cells
    hash), once. All notebooks are converted before any is written, so an
    unbalanced marker leaves ``out_dir`` untouched.
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
    update = StudentFolderUpdate()
    for name, notebook in converted:
        target = out_dir / name
        if not target.exists():
            _write_new(target, notebook)
            update.added.append(target)
        elif _recorded_hash(target) == made_from(notebook):
            update.current.append(target)
        else:
            beside = target.with_name(
                f"{target.stem}.update-{made_from(notebook)[:8]}.ipynb"
            )
            if not beside.exists():
                _write_new(beside, notebook)
                update.beside[target] = beside
    return update


def _recorded_hash(path: Path) -> str | None:
    """The course-cells hash a notebook file records; None when it records none
    or is not a notebook's JSON."""
    try:
        notebook = json.loads(path.read_text("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return made_from(notebook) if isinstance(notebook, dict) else None


def _write_new(target: Path, notebook: dict[str, Any]) -> None:
    """Write ``notebook`` to ``target`` through a temporary file beside it."""
    temporary = target.with_suffix(".ipynb.tmp")
    temporary.write_text(notebook_text(notebook), encoding="utf-8")
    temporary.replace(target)
