"""The course's graded items: the exercises found in a notebook, and their points.

An exercise is a code cell holding a ``### BEGIN SOLUTION`` block (its solution
cell) followed by the code cell that checks it (its check cell). Its id is the
notebook's two-digit number and the name of the first function the solution cell
defines, ``"03-group_normalized_advantages"``; nbgrader's ``grade_id`` and the
rubric use the same id. The cells an exercise needs are the notebook's other code
cells before it, except cells tagged ``colab`` (installs), ``walk-through``
(explanations that follow a check) or ``grading-skip``, and except other
exercises' solution and check cells; of an earlier check cell, only its import
statements are context (a later check may use a name it imports).

``rubric.toml`` beside this module gives each exercise its points, the
exercises that earn partial credit (their points times the share of their
check's cases passed), and each written question (``"NN-qK"``) its prompt and
points; it ships in the wheel. The model answers are on the instructor's side
only: ``model_answers.toml`` in the course source (the repository's
``notebooks/``, :data:`MODEL_ANSWERS_NAME`), read with ``load_rubric(answers=...)``.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import nbformat

from grpo_lab.instructor.student import BEGIN_MARKER

RUBRIC_PATH = Path(__file__).with_name("rubric.toml")
# The model answers' file, in the course source's notebooks folder.
MODEL_ANSWERS_NAME = "model_answers.toml"
SKIPPED_TAGS = frozenset({"colab", "walk-through", "grading-skip"})
FUNCTION_NAME = re.compile(r"^\s*def\s+([A-Za-z_]\w*)\s*\(", re.MULTILINE)
NOTEBOOK_NUMBER = re.compile(r"^(\d\d)_")


@dataclass(frozen=True)
class Exercise:
    """One exercise of a notebook: its id and the indices of its cells."""

    exercise_id: str
    solution_index: int
    check_index: int
    context_indices: tuple[int, ...]
    earlier_checks: tuple[int, ...] = ()


@dataclass(frozen=True)
class Question:
    """A written question, graded by hand."""

    question_id: str
    points: float
    prompt: str
    # The model answer: "" unless the rubric was loaded with its answers.
    answer: str = ""


@dataclass(frozen=True)
class Rubric:
    """Points per exercise id, the written questions by id, and the exercises
    whose failing answer earns the share of its check's cases it passed."""

    exercises: dict[str, float]
    questions: dict[str, Question]
    partial_credit: frozenset[str] = frozenset()

    def questions_of(self, number: str) -> list[Question]:
        """The questions of notebook ``number`` ("03"), in id order."""
        return [
            question
            for question_id, question in sorted(self.questions.items())
            if question_id.startswith(f"{number}-")
        ]


def notebook_number(name: str) -> str:
    """The two-digit number of a notebook file name: ``"03_x.ipynb"`` -> ``"03"``."""
    match = NOTEBOOK_NUMBER.match(Path(name).name)
    if match is None:
        raise ValueError(
            f"notebook name must start with two digits and '_', got {name!r}"
        )
    return match.group(1)


def is_solution_cell(cell: nbformat.NotebookNode) -> bool:
    """A code cell holding a solution block."""
    return cell.cell_type == "code" and any(
        line.strip() == BEGIN_MARKER for line in cell.source.split("\n")
    )


def exercise_id(number: str, solution_source: str, where: str = "cell") -> str:
    """``"NN-name"``, ``name`` being the first function the solution defines."""
    match = FUNCTION_NAME.search(solution_source)
    if match is None:
        raise ValueError(
            f"{where}: a solution cell must define a function (its name is the "
            "exercise id), found no 'def'"
        )
    return f"{number}-{match.group(1)}"


def find_exercises(notebook: nbformat.NotebookNode, name: str) -> list[Exercise]:
    """The exercises of ``notebook`` (file name ``name``), in cell order."""
    number = notebook_number(name)
    cells = notebook.cells
    solutions = [i for i, cell in enumerate(cells) if is_solution_cell(cell)]
    checks = [_check_index(cells, i, name) for i in solutions]
    exercise_cells = set(solutions) | set(checks)
    exercises = []
    for solution, check in zip(solutions, checks):
        context = tuple(
            i
            for i in range(solution)
            if cells[i].cell_type == "code"
            and i not in exercise_cells
            and not SKIPPED_TAGS & set(cells[i].metadata.get("tags", []))
        )
        where = f"{name}, cell {solution}"
        exercises.append(
            Exercise(
                exercise_id(number, cells[solution].source, where),
                solution,
                check,
                context,
                tuple(i for i in checks if i < solution),
            )
        )
    return exercises


def _check_index(cells: list, solution: int, name: str) -> int:
    """The code cell right after the solution cell (markdown may sit between)."""
    for index in range(solution + 1, len(cells)):
        if cells[index].cell_type == "code":
            return index
    raise ValueError(
        f"{name}, cell {solution}: a solution cell must be followed by a check "
        "cell, found no code cell after it"
    )


def load_rubric(
    path: str | Path = RUBRIC_PATH, answers: str | Path | None = None
) -> Rubric:
    """Read ``rubric.toml`` (and, given ``answers``, the model answers' file);
    ValueError names a missing or non-positive entry, or an answer missing or
    without a question."""
    with open(path, "rb") as handle:
        data = tomllib.load(handle)
    exercises = {
        str(k): _points(v, f"exercises.{k}") for k, v in data["exercises"].items()
    }
    model_answers = {} if answers is None else _model_answers(Path(answers))
    questions = {}
    for question_id, entry in data.get("questions", {}).items():
        missing = {"points", "prompt"} - set(entry)
        if missing:
            raise ValueError(
                f"questions.{question_id} must have points and prompt; "
                f"missing {sorted(missing)}"
            )
        if answers is not None and question_id not in model_answers:
            raise ValueError(
                f"{answers} must give questions.{question_id} an answer, found none"
            )
        questions[question_id] = Question(
            question_id,
            _points(entry["points"], f"questions.{question_id}.points"),
            entry["prompt"],
            model_answers.get(question_id, ""),
        )
    extra = sorted(set(model_answers) - set(questions))
    if extra:
        raise ValueError(
            f"{answers} answers questions that {path} does not list: {extra}"
        )
    partial = data.get("partial_credit", {}).get("exercises", [])
    unknown = sorted(set(partial) - set(exercises))
    if unknown:
        raise ValueError(
            f"partial_credit.exercises must name [exercises] entries, got {unknown}"
        )
    return Rubric(exercises, questions, frozenset(partial))


def _model_answers(path: Path) -> dict[str, str]:
    with open(path, "rb") as handle:
        data = tomllib.load(handle)
    found = {}
    for question_id, entry in data.get("questions", {}).items():
        answer = entry.get("answer")
        if not isinstance(answer, str) or not answer.strip():
            raise ValueError(
                f"{path}: questions.{question_id}.answer must be a non-empty "
                f"string, got {answer!r}"
            )
        found[question_id] = answer
    return found


def _points(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{where} must be a positive number of points, got {value!r}")
    return float(value)
