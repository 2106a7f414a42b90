"""nbgrader's view of the course: cell metadata, written questions, autograding.

``python -m grpo_lab.instructor.nbgrader_metadata [NOTEBOOKS_DIR] [--check]``
derives every notebook's nbgrader metadata from its solution markers and
``rubric.toml``, so ``nbgrader generate_assignment`` and ``nbgrader autograde``
work on the notebooks as they are:

- a solution cell (``### BEGIN SOLUTION``) is an autograded answer:
  ``solution: true``, ``grade_id`` the exercise id;
- the check cell after it is an autograder test: ``grade: true``, ``locked:
  true``, the exercise's points, ``grade_id`` the exercise id + ``"-check"``;
- the notebook ends with a "Questions" section (cells tagged ``questions``,
  rewritten each time): per written question of the rubric, a read-only prompt
  cell and a markdown answer cell graded by hand (``solution: true, grade:
  true``, its points). Model answers stay in the rubric and the solutions key.

``--check`` writes nothing and exits 1 naming the notebooks that differ.

A check meeting a stub prints "not attempted yet" and raises nothing, which
nbgrader would score as full marks; :func:`autograde_preprocessors` adds
:class:`NotAttemptedScoresZero` to nbgrader's list (``c.Autograde.
autograde_preprocessors = autograde_preprocessors()`` in nbgrader_config.py).
:func:`generate_assignment_preprocessors` adds :class:`DropWalkThroughs`, so
the release copies leave out the ``walk-through`` cells (the package's own
version of an exercise) as ``grpo-lab notebooks`` does; the lines of a
check cell between ``### BEGIN HIDDEN TESTS`` and ``### END HIDDEN TESTS`` are
nbgrader's hidden tests: cut from the release, run by ``autograde`` (and by
``grpo-lab grade``, which reads the course's check cells).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import nbformat
from nbconvert.preprocessors import Preprocessor
from traitlets import Bool

from grpo_lab.instructor.grading import ANSWER_STUB, NOT_ATTEMPTED_TEXT
from grpo_lab.instructor.rubric import (
    Question,
    Rubric,
    find_exercises,
    load_rubric,
    notebook_number,
)
from grpo_lab.instructor.shipped_notebooks import PACKAGE_DIR
from grpo_lab.instructor.student import is_walk_through

QUESTIONS_TAG = "questions"
QUESTIONS_HEADING = (
    "## Questions\n\n"
    "Answer each question in the cell below it, in a few sentences. "
    "Everything you need is in this notebook."
)


def nbgrader_fields(
    grade_id: str,
    *,
    solution: bool = False,
    grade: bool = False,
    locked: bool = False,
    points: float | None = None,
) -> dict[str, Any]:
    """One cell's ``nbgrader`` metadata (schema version 3)."""
    fields: dict[str, Any] = {
        "grade": grade,
        "grade_id": grade_id,
        "locked": locked,
        "schema_version": 3,
        "solution": solution,
        "task": False,
    }
    if points is not None:
        fields["points"] = int(points) if float(points).is_integer() else points
    return fields


def annotated(notebook: dict[str, Any], name: str, rubric: Rubric) -> dict[str, Any]:
    """``notebook`` (its JSON) with nbgrader metadata and its Questions section."""
    result = json.loads(json.dumps(notebook))
    cells = [c for c in result["cells"] if QUESTIONS_TAG not in _tags(c)]
    result["cells"] = cells
    parsed = nbformat.reads(json.dumps(result), as_version=4)
    for exercise in find_exercises(parsed, name):
        identifier = exercise.exercise_id
        if identifier not in rubric.exercises:
            raise ValueError(
                f"{name}: rubric.toml [exercises] must give points to "
                f"{identifier!r}, found none"
            )
        cells[exercise.solution_index]["metadata"]["nbgrader"] = nbgrader_fields(
            identifier, solution=True
        )
        cells[exercise.check_index]["metadata"]["nbgrader"] = nbgrader_fields(
            f"{identifier}-check",
            grade=True,
            locked=True,
            points=rubric.exercises[identifier],
        )
    questions = rubric.questions_of(notebook_number(name))
    if questions:
        heading_id = f"{notebook_number(name)}-questions"
        cells.append(_markdown(heading_id, QUESTIONS_HEADING, None))
        for question in questions:
            cells += _question_cells(question)
    return result


def _question_cells(question: Question) -> list[dict[str, Any]]:
    number = question.question_id.split("-q")[-1]
    points = f"{question.points:g} point{'s' * (question.points != 1)}"
    prompt = f"**Question {number}** ({points}). {question.prompt}"
    prompt_id = f"{question.question_id}-prompt"
    return [
        _markdown(prompt_id, prompt, nbgrader_fields(prompt_id, locked=True)),
        _markdown(
            question.question_id,
            ANSWER_STUB,
            nbgrader_fields(
                question.question_id,
                solution=True,
                grade=True,
                points=question.points,
            ),
        ),
    ]


def _markdown(cell_id: str, text: str, fields: dict | None) -> dict[str, Any]:
    metadata: dict[str, Any] = {"tags": [QUESTIONS_TAG]}
    if fields is not None:
        metadata["nbgrader"] = fields
    lines = text.splitlines(keepends=True)
    return {
        "cell_type": "markdown",
        "id": cell_id,
        "metadata": metadata,
        "source": lines,
    }


def _tags(cell: dict[str, Any]) -> list[str]:
    return cell.get("metadata", {}).get("tags", [])


def notebook_text(notebook: dict[str, Any]) -> str:
    """The file text the course notebooks are saved as (indent 1, UTF-8)."""
    return json.dumps(notebook, indent=1, ensure_ascii=False) + "\n"


def stale_notebooks(notebooks_dir: Path, rubric: Rubric, write: bool) -> list[Path]:
    """The notebooks whose text differs from the annotated one (rewritten if write)."""
    stale = []
    for path in sorted(notebooks_dir.glob("[0-9][0-9]_*.ipynb")):
        text = path.read_text(encoding="utf-8")
        wanted = notebook_text(annotated(json.loads(text), path.name, rubric))
        if wanted != text:
            stale.append(path)
            if write:
                path.write_text(wanted, encoding="utf-8")
    return stale


class NotAttemptedScoresZero(Preprocessor):
    """A graded cell that printed "not attempted yet" gets a stderr line.

    nbgrader scores a test cell 0 when its output holds an error or stderr, and
    full marks otherwise; our checks print "not attempted yet" for a stub.
    """

    enabled = Bool(True)

    def preprocess_cell(self, cell: Any, resources: dict, index: int) -> tuple:
        if cell.cell_type == "code" and cell.metadata.get("nbgrader", {}).get("grade"):
            printed = "".join(
                o.get("text", "")
                for o in cell.outputs
                if o.get("output_type") == "stream" and o.get("name") == "stdout"
            )
            if NOT_ATTEMPTED_TEXT in printed:
                # First: nbgrader reads the outputs in order and stops at an
                # execute_result (a check's True or False) or at stderr.
                cell.outputs.insert(
                    0,
                    nbformat.v4.new_output(
                        "stream", name="stderr", text="not attempted: 0 points\n"
                    ),
                )
        return cell, resources


class DropWalkThroughs(Preprocessor):
    """generate_assignment: the release copy has no ``walk-through`` cell."""

    enabled = Bool(True)

    def preprocess(self, nb: Any, resources: dict) -> tuple[Any, dict]:
        nb.cells = [cell for cell in nb.cells if not is_walk_through(cell)]
        return nb, resources


def generate_assignment_preprocessors() -> list[type]:
    """nbgrader's generate_assignment preprocessors, DropWalkThroughs first
    (``c.GenerateAssignment.preprocessors = generate_assignment_preprocessors()``)."""
    from nbgrader.converters.generate_assignment import GenerateAssignment

    defaults = list(GenerateAssignment.class_traits()["preprocessors"].default())
    return [DropWalkThroughs, *defaults]


def autograde_preprocessors() -> list[type]:
    """nbgrader's autograde preprocessors with NotAttemptedScoresZero before the
    grades are saved.

    Also puts this Python's scripts folder first on ``PATH``: nbgrader upgrades
    its gradebook by running the ``alembic`` script by name, which a shell
    without the virtual environment on ``PATH`` would not find.
    """
    from nbgrader.converters.autograde import Autograde

    scripts = os.path.dirname(sys.executable)
    if scripts not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join(
            p for p in (scripts, os.environ.get("PATH", "")) if p
        )

    defaults = list(Autograde.class_traits()["autograde_preprocessors"].default())
    names = [p.__name__ for p in defaults]
    at = names.index("SaveAutoGrades")
    return [*defaults[:at], NotAttemptedScoresZero, *defaults[at:]]


def main(argv: list[str] | None = None) -> int:
    """Write (or with --check, compare) every notebook's nbgrader metadata."""
    parser = argparse.ArgumentParser(
        prog="python -m grpo_lab.instructor.nbgrader_metadata"
    )
    parser.add_argument(
        "notebooks_dir", nargs="?", default=PACKAGE_DIR.parent / "notebooks"
    )
    parser.add_argument("--check", action="store_true", help="write nothing")
    arguments = parser.parse_args(argv)
    stale = stale_notebooks(
        Path(arguments.notebooks_dir), load_rubric(), not arguments.check
    )
    verb = "differ from their nbgrader metadata" if arguments.check else "updated"
    for path in stale:
        print(f"{path.name}: {verb}")
    return 1 if stale and arguments.check else 0


if __name__ == "__main__":
    sys.exit(main())
