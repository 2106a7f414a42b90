"""Grade submitted notebooks against the checks of the shipped course notebooks.

``grpo-lab grade SUBMISSIONS_DIR --out grades.csv``. SUBMISSIONS_DIR holds one
folder per student, named after the student, with that student's notebooks in
it (``alice/03_rewards_and_advantages.ipynb``); a notebook is matched to the
course notebook with the same two-digit number, and files without one are
ignored. Only submitted notebooks are graded.

For each submitted notebook, one fresh kernel (``GRPO_LAB_PROFILE=smoke``, a
temporary working folder) runs the *course* notebook's context cells (see
:mod:`grpo_lab.teaching.rubric`), and for each exercise the student's solution
cell and the *course* check cell, in a copy of the kernel's namespace, so one
exercise's names do not leak into the next and edited or deleted check cells in
the submission change nothing. The student's solution cell is found by its
``nbgrader.grade_id`` metadata, else by the function it defines.

Each exercise gets one outcome: ``pass`` (all its points), ``fail`` (the check's
counter-example), ``not attempted`` (a stub, or no solution cell), ``error`` (an
exception, or more than the time limit, in one line). A kernel that died or ran
out of time is replaced by a fresh one for the next exercise.
"""

from __future__ import annotations

import ast
import contextlib
import csv
import io
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nbformat

from grpo_lab.teaching.rubric import (
    FUNCTION_NAME,
    Exercise,
    Rubric,
    find_exercises,
    load_rubric,
    notebook_number,
)
from grpo_lab.teaching.shipped_notebooks import PACKAGE_DIR, shipped_notebooks_dir

OUTCOMES = ("pass", "fail", "not attempted", "error")
CSV_COLUMNS = (
    "student",
    "notebook",
    "exercise",
    "outcome",
    "points",
    "max_points",
    "message",
)
RESULT_PREFIX = "GRPO_LAB_GRADE "
# Seconds the course's context cells of one notebook may take in all.
CONTEXT_TIMEOUT = 600.0
NOT_ATTEMPTED_TEXT = "not attempted yet"


@dataclass(frozen=True)
class Grade:
    """One student's outcome on one exercise."""

    student: str
    notebook: str
    exercise_id: str
    outcome: str
    points: float
    max_points: float
    message: str = ""


# --- inside the kernel ---------------------------------------------------------------


def run_exercise(
    solution_source: str, check_source: str, namespace: dict[str, Any]
) -> tuple[str, str]:
    """Run a solution cell, then a check cell, in a copy of ``namespace``.

    Returns ``(outcome, message)``. The check passes when it raises nothing,
    prints no "not attempted yet" and its last expression is not ``False``.
    IPython syntax (magics) is translated when an IPython shell is running.
    """
    from grpo_lab.teaching.checks.framework import ExerciseFailed

    names = dict(namespace)
    try:
        _run_cell(solution_source, names, "<solution cell>")
    except NotImplementedError:
        return "not attempted", "the solution cell raises NotImplementedError"
    except Exception as error:
        return "error", f"the solution cell raised {_one_line(error)}"
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            value = _run_cell(check_source, names, "<check cell>")
    except ExerciseFailed as error:
        return "fail", str(error)
    except NotImplementedError:
        return "not attempted", "the solution raises NotImplementedError"
    except Exception as error:
        return "error", f"the check raised {_one_line(error)}"
    if NOT_ATTEMPTED_TEXT in printed.getvalue() or value is False:
        return "not attempted", "the check found a stub"
    return "pass", ""


def _run_cell(source: str, names: dict[str, Any], filename: str) -> Any:
    """Execute a cell's source in ``names``; the value of its last expression."""
    source = _python_source(source)
    tree = ast.parse(source, filename)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    exec(compile(tree, filename, "exec"), names)
    return None if last is None else eval(compile(last, filename, "eval"), names)


def _python_source(source: str) -> str:
    try:
        from IPython import get_ipython
    except ModuleNotFoundError:
        return source
    shell = get_ipython()
    return source if shell is None else shell.transform_cell(source)


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def import_statements(source: str) -> str:
    """The top-level ``import`` and ``from ... import`` statements of a cell."""
    tree = ast.parse(_python_source(source))
    kept = [
        ast.unparse(node)
        for node in tree.body
        if isinstance(node, (ast.Import, ast.ImportFrom))
    ]
    return "\n".join(kept)


def grading_cell_source(solution_source: str, check_source: str) -> str:
    """The kernel code that grades one exercise and prints its JSON result."""
    return (
        "import json as _grade_json\n"
        "from grpo_lab.teaching.grading import run_exercise as _grade_run\n"
        f"print({RESULT_PREFIX!r} + _grade_json.dumps(_grade_run("
        f"{solution_source!r}, {check_source!r}, globals())))\n"
    )


# --- the submissions ---------------------------------------------------------------


def find_submissions(submissions_dir: str | Path) -> dict[str, dict[str, Path]]:
    """``{student: {number: notebook path}}`` of every student folder."""
    submissions_dir = Path(submissions_dir)
    if not submissions_dir.is_dir():
        raise ValueError(
            f"submissions_dir must be a folder, got {str(submissions_dir)!r}"
        )
    found: dict[str, dict[str, Path]] = {}
    for folder in sorted(p for p in submissions_dir.iterdir() if p.is_dir()):
        notebooks: dict[str, Path] = {}
        for path in sorted(folder.glob("*.ipynb")):
            with contextlib.suppress(ValueError):
                notebooks.setdefault(notebook_number(path.name), path)
        if notebooks:
            found[folder.name] = notebooks
    if not found:
        raise ValueError(
            "submissions_dir must hold one folder per student with NN_*.ipynb "
            f"notebooks in it, found none in {submissions_dir}"
        )
    return found


def course_notebooks(notebooks_dir: str | Path | None = None) -> dict[str, Path]:
    """``{number: path}`` of the course notebooks (default: the shipped ones)."""
    folder = shipped_notebooks_dir() if notebooks_dir is None else Path(notebooks_dir)
    return {
        notebook_number(p.name): p for p in sorted(folder.glob("[0-9][0-9]_*.ipynb"))
    }


def student_solution(submission: nbformat.NotebookNode, exercise_id: str) -> str | None:
    """The source of the submission's solution cell for ``exercise_id``, or None.

    The cell whose ``nbgrader.grade_id`` is the id; else the first code cell that
    defines the exercise's function.
    """
    code_cells = [c for c in submission.cells if c.cell_type == "code"]
    for cell in code_cells:
        if cell.metadata.get("nbgrader", {}).get("grade_id") == exercise_id:
            return cell.source
    function = exercise_id.split("-", 1)[1]
    for cell in code_cells:
        if function in FUNCTION_NAME.findall(cell.source):
            return cell.source
    return None


# --- grading -----------------------------------------------------------------------


def grade_submissions(
    submissions_dir: str | Path,
    *,
    notebooks_dir: str | Path | None = None,
    rubric: Rubric | None = None,
    timeout: float = 60.0,
) -> list[Grade]:
    """Grade every student's submitted notebooks; one Grade per student × exercise.

    ``timeout`` is the limit in seconds for one exercise (solution and check).
    """
    if not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout}")
    rubric = load_rubric() if rubric is None else rubric
    course = course_notebooks(notebooks_dir)
    grades = []
    for student, notebooks in find_submissions(submissions_dir).items():
        for number, path in notebooks.items():
            if number in course:
                grades += grade_notebook(student, path, course[number], rubric, timeout)
    return grades


def grade_notebook(
    student: str, submitted: Path, course_path: Path, rubric: Rubric, timeout: float
) -> list[Grade]:
    """Grade one submitted notebook against the course notebook ``course_path``."""
    course = nbformat.read(course_path, as_version=4)
    exercises = find_exercises(course, course_path.name)
    missing = [
        e.exercise_id for e in exercises if e.exercise_id not in rubric.exercises
    ]
    if missing:
        raise ValueError(f"rubric.toml must give points to {missing}, found none")
    try:
        submission = nbformat.read(submitted, as_version=4)
    except Exception as error:
        message = f"the notebook cannot be read: {_one_line(error)}"
        return [
            _grade(student, course_path, e, rubric, "error", message) for e in exercises
        ]
    results = _run_exercises(course, exercises, submission, timeout)
    return [
        _grade(student, course_path, exercise, rubric, *result)
        for exercise, result in zip(exercises, results)
    ]


def _grade(
    student: str,
    course_path: Path,
    exercise: Exercise,
    rubric: Rubric,
    outcome: str,
    message: str,
) -> Grade:
    max_points = rubric.exercises[exercise.exercise_id]
    points = max_points if outcome == "pass" else 0.0
    return Grade(
        student,
        course_path.name,
        exercise.exercise_id,
        outcome,
        points,
        max_points,
        message,
    )


def _run_exercises(
    course: nbformat.NotebookNode,
    exercises: list[Exercise],
    submission: nbformat.NotebookNode,
    timeout: float,
) -> list[tuple[str, str]]:
    """``(outcome, message)`` of each exercise, graded in one kernel when possible."""
    results = []
    with tempfile.TemporaryDirectory(prefix="grpo-lab-grade-") as workdir:
        kernel = _Kernel(course, workdir, exercises)
        try:
            for exercise in exercises:
                solution = student_solution(submission, exercise.exercise_id)
                if solution is None:
                    results.append(
                        ("not attempted", "no solution cell for this exercise")
                    )
                    continue
                results.append(kernel.grade(exercise, solution, timeout))
        finally:
            kernel.stop()
    return results


class _Kernel:
    """A kernel that has run some of the course notebook's context cells."""

    def __init__(
        self, course: nbformat.NotebookNode, workdir: str, exercises: list[Exercise]
    ) -> None:
        self.course = course
        # An earlier exercise's function, defined by the course's own solution:
        # a later exercise that calls it is graded on its own code alone.
        self.solution_of_check = {e.check_index: e.solution_index for e in exercises}
        self.workdir = workdir
        self.client: Any = None
        self.ran: set[int] = set()
        self.context_error = ""

    def grade(
        self, exercise: Exercise, solution: str, timeout: float
    ) -> tuple[str, str]:
        """Run the missing context cells, then grade the exercise."""
        from nbclient.exceptions import DeadKernelError

        try:
            self._run_context(exercise)
            if self.context_error:
                return "error", self.context_error
            cell = nbformat.v4.new_code_cell(
                grading_cell_source(
                    solution, self.course.cells[exercise.check_index].source
                )
            )
            outputs = self._execute(cell, timeout)
        except DeadKernelError:
            self.stop()
            return "error", "the kernel died while grading this exercise"
        if _timed_out(outputs):
            self.stop()
            return "error", f"ran past the time limit of {timeout:g} s"
        return _result(outputs)

    def _run_context(self, exercise: Exercise) -> None:
        if self.client is None:
            self._start()
        earlier = set(exercise.earlier_checks)
        for index in sorted(set(exercise.context_indices) | earlier):
            if index in self.ran or self.context_error:
                continue
            source = self.course.cells[index].source
            if index in earlier:
                solution = self.course.cells[self.solution_of_check[index]].source
                source = f"{import_statements(source)}\n{solution}"
            cell = nbformat.v4.new_code_cell(source)
            outputs = self._execute(cell, CONTEXT_TIMEOUT)
            self.ran.add(index)
            error = next((o for o in outputs if o.output_type == "error"), None)
            if error is not None:
                self.context_error = (
                    f"course cell {index} (context) raised {error.ename}: "
                    f"{error.evalue}"
                )

    def _start(self) -> None:
        from nbclient import NotebookClient

        self.client = NotebookClient(
            nbformat.v4.new_notebook(),
            kernel_name="python3",
            allow_errors=True,
            interrupt_on_timeout=True,
            resources={"metadata": {"path": self.workdir}},
        )
        self.client.km = self.client.create_kernel_manager()
        self.client.start_new_kernel(env=_kernel_environment())
        self.client.start_new_kernel_client()
        self.ran = set()
        self.context_error = ""

    def _execute(self, cell: nbformat.NotebookNode, timeout: float) -> list:
        self.client.timeout = int(max(1, round(timeout)))
        self.client.nb.cells.append(cell)
        self.client.execute_cell(cell, len(self.client.nb.cells) - 1)
        return cell.outputs

    def stop(self) -> None:
        """Shut the kernel down (a later grade starts a fresh one)."""
        if self.client is None:
            return
        with contextlib.suppress(Exception):
            self.client._cleanup_kernel()
        self.client = None


def _kernel_environment() -> dict[str, str]:
    """This environment, with the smoke profile and this grpo_lab importable."""
    environment = dict(os.environ)
    paths = [str(PACKAGE_DIR.parent), environment.get("PYTHONPATH", "")]
    environment["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    environment["GRPO_LAB_PROFILE"] = "smoke"
    environment.setdefault("OMP_NUM_THREADS", "1")
    environment.setdefault("MPLBACKEND", "agg")
    return environment


def _timed_out(outputs: list) -> bool:
    return any(
        o.output_type == "error"
        and o.ename in ("KeyboardInterrupt", "CellTimeoutError")
        for o in outputs
    )


def _result(outputs: list) -> tuple[str, str]:
    for output in outputs:
        if output.output_type == "stream" and output.name == "stdout":
            for line in output.text.splitlines():
                if line.startswith(RESULT_PREFIX):
                    outcome, message = json.loads(line[len(RESULT_PREFIX) :])
                    return outcome, message
        if output.output_type == "error":
            return "error", f"{output.ename}: {' '.join(output.evalue.split())}"
    return "error", "the grading cell printed no result"


# --- the table -----------------------------------------------------------------------


def write_grades_csv(grades: list[Grade], path: str | Path) -> Path:
    """Write one row per grade (columns CSV_COLUMNS); points without trailing .0."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(CSV_COLUMNS)
        for row in _rows(grades):
            writer.writerow(row)
    return path


def _rows(grades: list[Grade]) -> Iterator[list[str]]:
    for grade in grades:
        yield [
            grade.student,
            grade.notebook,
            grade.exercise_id,
            grade.outcome,
            f"{grade.points:g}",
            f"{grade.max_points:g}",
            grade.message,
        ]
