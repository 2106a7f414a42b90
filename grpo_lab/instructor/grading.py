"""Grade submitted notebooks against the checks of the shipped course notebooks.

``grpo-lab grade SUBMISSIONS_DIR --out grades.csv [-j N]``. SUBMISSIONS_DIR holds
one folder per student, named after the student, with that student's notebooks
in it (``alice/03_rewards_and_advantages.ipynb``); a notebook is matched to the
course notebook with the same two-digit number, and files without one are
ignored. Only submitted notebooks are graded, ``-j N`` of them at a time, each
in its own contained kernel.

What counts is what the student wrote: the submission's code cells that are
not the course's own (a cell the student added or changed; an untouched stub,
a check cell or a cell tagged ``colab``, ``walk-through`` or ``grading-skip``
is not). For each submitted notebook, one fresh kernel (``GRPO_LAB_PROFILE=
smoke``, a temporary working folder) runs the *course* notebook's context
cells (see :mod:`grpo_lab.instructor.rubric`) before any student code, then for
each exercise the student's cells above its check (in a child process forked
from the kernel, in its namespace, so a helper in another cell, or an answer
in a new cell below the stub, counts), then the *course* check cell, in the
kernel, in a copy of its namespace, calling the student's function in the
child (see :mod:`grpo_lab.instructor.grading_kernel`): edited or deleted check
cells in the submission change nothing. Where a submission has
no check cell for an exercise, its check stands before the next exercise's
cells. A notebook in which the student wrote nothing starts no kernel.

Each exercise gets one outcome: ``pass`` (all its points), ``fail`` (the
check's counter-example, or what the student's function raised; where the
rubric allows partial credit, the points times the share of the check's cases
passed), ``not attempted`` (a stub, or nothing written; an answer written
below its check is named, with its cell), ``error`` (an exception outside the
student's function, or more than the time limit). Each written question gets a
``manual`` row with its points, to grade by hand, or ``not attempted`` with 0
points when its answer cell is unchanged.
Messages are one line of at most MESSAGE_LIMIT characters, the named mistake
first. A kernel that died or ran out of time is replaced by a fresh one for the
next exercise, which does not run again the cells that brought it down.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import re
import shutil
import signal
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import nbformat

from grpo_lab.instructor import grading_kernel
from grpo_lab.instructor.copies import copy_flags
from grpo_lab.instructor.grading_client import ContainedKernelManager
from grpo_lab.instructor.grading_kernel import (
    RESTART_TEXT,
    RESULT_FD_VARIABLE,
    SCRATCH_FOLDER,
    check_names_in,
)
from grpo_lab.instructor.grading_plan import (  # noqa: F401 (read from here too)
    ExercisePlan,
    course_sources,
    grade_id,
    notebook_checks,
    plan_submission,
    solution_index,
    student_solution,
)
from grpo_lab.instructor.grading_refusal import import_counterparts, pasted_counterpart
from grpo_lab.instructor.rubric import (
    Exercise,
    Rubric,
    find_exercises,
    load_rubric,
    notebook_number,
)
from grpo_lab.instructor.sandbox import NO_TMPFS_TEXT, confinement_gaps
from grpo_lab.instructor.shipped_notebooks import PACKAGE_DIR, course_notebooks_dir
from grpo_lab.instructor.tree_limits import (
    FOLDER_TMPFS_TEXT,
    TREE_PROCESSES,
    tree_limits_note,
)

# What the kernel reports for an exercise; "manual" is a written question's.
KERNEL_OUTCOMES = ("pass", "fail", "not attempted", "error")
OUTCOMES = (*KERNEL_OUTCOMES, "manual")
CSV_COLUMNS = (
    "student",
    "notebook",
    "exercise",
    "outcome",
    "points",
    "max_points",
    "seconds",
    "message",
    "flag",
)
# Characters of a message in the table.
MESSAGE_LIMIT = 200
# The text of an unanswered written question's cell (nbgrader's answer stub).
ANSWER_STUB = "YOUR ANSWER HERE"
NOTHING_WRITTEN = "nothing written above the check (the stub is unchanged)"
# The largest submitted notebook read, in bytes.
SUBMISSION_BYTES = 32 << 20
# The longest time limit of one exercise, in seconds.
TIMEOUT_LIMIT = 86400.0
ANSWER_BELOW = (
    "your answer is in cell {cell}, below the check: move it above the check "
    "(and run the check again)"
)
QUESTION_NOT_ANSWERED = "not answered (the answer cell is unchanged)"
# Seconds the course's context cells of one notebook may take in all.
CONTEXT_TIMEOUT = 600.0
# Address space of one grading kernel, and of each process it starts (a kernel
# with torch and transformers imported maps about 0.8 GB).
MEMORY_BYTES = 4 << 30
# Processes and threads of the kernel's user (not enforced for root).
PROCESSES = 4096
# Seconds past a cell's time limit after which its kernel is killed outright.
KILL_GRACE = 3.0
# Seconds the kernel's warden has to kill what the kernel started.
STOP_TIMEOUT = 10.0
CHANNEL_TAMPERED = "the result channel held something the grader did not write"
BOOTSTRAP_SOURCE = (
    "import grpo_lab.instructor.grading_kernel as _grade_kernel\n"
    "_grade_kernel.bootstrap()\n"
    "del _grade_kernel\n"
)


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
    # For the instructor: "matches <package function>" when the solution's
    # syntax tree is the package function's (see grading_refusal), "matches
    # the kit's solution" or "matches the answer of <student>" (see copies).
    flag: str = ""
    # Seconds spent grading it (its share of the kernel's start included).
    seconds: float = 0.0


# --- inside the kernel (grpo_lab.instructor.grading_kernel) ------------------------

run_exercise = grading_kernel.run_exercise
import_statements = grading_kernel.import_statements
NOT_ATTEMPTED_TEXT = grading_kernel.NOT_ATTEMPTED_TEXT
_one_line = grading_kernel.one_line
_python_source = grading_kernel.python_source
TAMPERED_PREFIX = grading_kernel.TAMPERED_PREFIX


def grading_cell_source(
    sequence: int,
    cells: list[tuple[int, str]],
    check_source: str,
    function_name: str,
    check_names: tuple[str, ...],
    notebook_checks: tuple[str, ...] = (),
    earlier_solutions: str = "",
) -> str:
    """The kernel code that runs the student's ``cells``, grades one exercise
    and writes its line to the channel."""
    return (
        "import grpo_lab.instructor.grading_kernel as _grade_kernel\n"
        f"_grade_kernel.grade({sequence}, {cells!r}, {check_source!r}, "
        f"{function_name!r}, {check_names!r}, {notebook_checks!r}, "
        f"{earlier_solutions!r}, globals())\n"
        "del _grade_kernel\n"
    )


# --- the submissions ---------------------------------------------------------------


def find_submissions(submissions_dir: str | Path) -> dict[str, dict[str, Path]]:
    """``{student: {number: notebook path}}`` of every student folder (a
    symbolic link to a folder is not one: links are never followed)."""
    submissions_dir = Path(submissions_dir)
    if not submissions_dir.is_dir():
        raise ValueError(
            f"submissions_dir must be a folder, got {str(submissions_dir)!r}"
        )
    found: dict[str, dict[str, Path]] = {}
    folders = (
        p for p in submissions_dir.iterdir() if p.is_dir() and not p.is_symlink()
    )
    for folder in sorted(folders):
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
    """``{number: path}`` of the course notebooks (default: a checkout's);
    ValueError when ``notebooks_dir`` is not a folder holding some."""
    folder = course_notebooks_dir() if notebooks_dir is None else Path(notebooks_dir)
    if not folder.is_dir():
        raise ValueError(
            f"notebooks_dir must be a folder of course notebooks, got {str(folder)!r}"
        )
    found = {
        notebook_number(p.name): p for p in sorted(folder.glob("[0-9][0-9]_*.ipynb"))
    }
    if not found:
        raise ValueError(
            "notebooks_dir must hold the course's NN_*.ipynb notebooks, found none "
            f"in {folder}"
        )
    return found


def containment_notes(tree_memory_bytes: int = MEMORY_BYTES) -> list[str]:
    """What the grader cannot fence on this system, and how the kernels'
    trees are limited (a cgroup, or per process), for the grade output."""
    gaps = confinement_gaps()
    folder = [] if NO_TMPFS_TEXT in gaps else [FOLDER_TMPFS_TEXT]
    return [*gaps, tree_limits_note(tree_memory_bytes), *folder]


def check_timeout(timeout: float) -> None:
    """ValueError unless ``timeout`` is a number of seconds in (0, TIMEOUT_LIMIT]."""
    number = isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
    if not (number and math.isfinite(timeout) and 0 < timeout <= TIMEOUT_LIMIT):
        raise ValueError(
            "timeout must be a positive, finite number of seconds, at most "
            f"{TIMEOUT_LIMIT:g}, got {timeout!r}"
        )


def check_output(path: str | Path) -> None:
    """ValueError unless ``path`` names a file the grader can write (checked
    by opening it; a file made for the check is removed again)."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"out must name a CSV file, got the folder {str(path)!r}")
    existed = path.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as error:
        raise ValueError(
            f"out must be a file the grader can write, got {str(path)!r} "
            f"({error.strerror or type(error).__name__})"
        ) from None
    if not existed:
        path.unlink()


# --- grading -----------------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    """What one grading kernel may use (see :mod:`grpo_lab.instructor.sandbox`)."""

    # Seconds one exercise (the student's cells and the check) may take; then
    # the kernel is killed.
    timeout: float = 60.0
    # Address space of the kernel and of each process it starts (RLIMIT_AS).
    memory_bytes: int = MEMORY_BYTES
    # Processes and threads of the kernel's user (RLIMIT_NPROC; root is exempt).
    processes: int = PROCESSES
    # Memory and processes of the kernel's whole tree, where a cgroup can be
    # made (see grpo_lab.instructor.tree_limits).
    tree_memory_bytes: int = MEMORY_BYTES
    tree_processes: int = TREE_PROCESSES


def grade_submissions(
    submissions_dir: str | Path,
    *,
    notebooks_dir: str | Path | None = None,
    rubric: Rubric | None = None,
    timeout: float = 60.0,
    memory_bytes: int = MEMORY_BYTES,
    jobs: int = 1,
    progress: bool = False,
    tree_memory_bytes: int | None = None,
) -> list[Grade]:
    """Grade every student's submitted notebooks: one Grade per student ×
    exercise, and one ``manual`` Grade per written question.

    ``timeout`` is the limit in seconds for one exercise (the student's cells
    and the check); ``memory_bytes`` the address space of each kernel and of
    each process it starts, ``tree_memory_bytes`` (default: ``memory_bytes``)
    the memory of a kernel's whole process tree where a cgroup can be made
    (:func:`containment_notes` says whether); ``jobs``
    how many notebooks are graded at a time (each in its own kernel);
    ``progress`` shows a bar over the notebooks. Every submission is read
    before the first kernel starts, and every kernel (with whatever it started)
    is dead when this returns.
    """
    check_timeout(timeout)
    if not (isinstance(memory_bytes, int) and memory_bytes >= 1 << 28):
        raise ValueError(
            f"memory_bytes must be an integer of at least 2**28, got {memory_bytes!r}"
        )
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be a positive integer, got {jobs!r}")
    tree_memory_bytes = memory_bytes if tree_memory_bytes is None else tree_memory_bytes
    if not (isinstance(tree_memory_bytes, int) and tree_memory_bytes >= 1 << 28):
        raise ValueError(
            "tree_memory_bytes must be an integer of at least 2**28, got "
            f"{tree_memory_bytes!r}"
        )
    limits = Limits(timeout, memory_bytes, PROCESSES, tree_memory_bytes)
    rubric = load_rubric() if rubric is None else rubric
    course = course_notebooks(notebooks_dir)
    submitted = [
        (student, path.name, read_submission(path), course[number])
        for student, notebooks in find_submissions(submissions_dir).items()
        for number, path in notebooks.items()
        if number in course
    ]
    for course_path in dict.fromkeys(entry[3] for entry in submitted):
        course, exercises = course_exercises(course_path, rubric)  # faults up front
        import_counterparts(notebook_checks(course, exercises))  # before any thread
    grades = _grade_all(submitted, rubric, limits, jobs, progress)
    return _with_copy_flags(grades, submitted, rubric)


def _with_copy_flags(
    grades: list[Grade],
    submitted: list[tuple[str, str, bytes | str, Path]],
    rubric: Rubric,
) -> list[Grade]:
    """``grades`` with each copy of the kit's solution or of a neighbour's
    answer flagged (see :mod:`grpo_lab.instructor.copies`)."""
    answers: dict[str, dict[str, str]] = {}
    kit: dict[str, str] = {}
    courses = {path: course_exercises(path, rubric) for _, _, _, path in submitted}
    for student, _, content, course_path in submitted:
        course, exercises = courses[course_path]
        for exercise in exercises:
            kit[exercise.exercise_id] = course.cells[exercise.solution_index].source
        try:
            plans = plan_submission(course, exercises, read_notebook(content))
        except Exception:
            continue  # graded as an error already
        for plan in plans:
            if plan.solution:
                answers.setdefault(plan.exercise.exercise_id, {})[student] = (
                    plan.solution
                )
    flags = copy_flags(answers, kit)
    return [
        replace(
            grade,
            flag="; ".join(
                f
                for f in (grade.flag, flags.get((grade.student, grade.exercise_id)))
                if f
            ),
        )
        for grade in grades
    ]


def course_exercises(
    course_path: Path, rubric: Rubric
) -> tuple[nbformat.NotebookNode, list[Exercise]]:
    """A course notebook and its exercises; ValueError when the rubric gives
    one of them no points."""
    course = nbformat.read(course_path, as_version=4)
    exercises = find_exercises(course, course_path.name)
    missing = [
        e.exercise_id for e in exercises if e.exercise_id not in rubric.exercises
    ]
    if missing:
        raise ValueError(f"rubric.toml must give points to {missing}, found none")
    return course, exercises


def _grade_all(
    submitted: list[tuple[str, str, bytes | str, Path]],
    rubric: Rubric,
    limits: Limits,
    jobs: int,
    progress: bool,
) -> list[Grade]:
    """Each submission's grades, in submission order, ``jobs`` at a time."""
    import nbclient  # noqa: F401 (imported here once, not first in two threads)
    from tqdm.auto import tqdm

    results: list[list[Grade]] = [[] for _ in submitted]
    bar = tqdm(
        total=len(submitted), desc="grading", unit="notebook", disable=not progress
    )
    with bar, ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {
            pool.submit(_grade_or_error, *submission, rubric, limits): number
            for number, submission in enumerate(submitted)
        }
        for future in as_completed(futures):
            results[futures[future]] = future.result()
            bar.update(1)
    return [grade for grades in results for grade in grades]


def read_submission(path: Path) -> bytes | str:
    """A submitted notebook's bytes, or (a ``str``) why it is not read: a
    symbolic link (never followed), not a plain file, past SUBMISSION_BYTES,
    or unreadable."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0)
    try:
        if path.is_symlink():
            return f"{path.name} is a symbolic link, which the grader does not follow"
        descriptor = os.open(path, flags)
    except OSError as error:
        return f"{path.name} could not be opened ({error.strerror})"
    with os.fdopen(descriptor, "rb") as handle:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            return f"{path.name} is not a plain file"
        try:
            content = handle.read(SUBMISSION_BYTES + 1)
        except OSError as error:
            return f"{path.name} could not be read ({error.strerror})"
    if len(content) > SUBMISSION_BYTES:
        return f"{path.name} is larger than {SUBMISSION_BYTES >> 20} MiB"
    return content


def _grade_or_error(
    student: str,
    name: str,
    content: bytes | str,
    course_path: Path,
    rubric: Rubric,
    limits: Limits,
) -> list[Grade]:
    """:func:`grade_notebook`; whatever it raises (a submission the grader
    did not foresee) makes each exercise an ``error`` with its message."""
    try:
        return grade_notebook(student, name, content, course_path, rubric, limits)
    except Exception as error:
        message = f"the grader could not grade this notebook: {_one_line(error)}"
        return _error_grades(student, course_path, rubric, message)


def _error_grades(
    student: str, course_path: Path, rubric: Rubric, message: str
) -> list[Grade]:
    """Each exercise an ``error`` with ``message``; each question unanswered."""
    _, exercises = course_exercises(course_path, rubric)
    grades = [
        _grade(student, course_path, e, rubric, ("error", message, None, None))
        for e in exercises
    ]
    return grades + question_grades(student, course_path, None, rubric)


def grade_notebook(
    student: str,
    name: str,
    content: bytes | str,
    course_path: Path,
    rubric: Rubric,
    limits: Limits,
) -> list[Grade]:
    """Grade one submitted notebook (its bytes, or why it was not read)
    against ``course_path``: its exercises, then a ``manual`` row per written
    question."""
    course, exercises = course_exercises(course_path, rubric)
    try:
        submission = read_notebook(content)
    except Exception as error:
        message = f"the notebook cannot be read: {_one_line(error)}"
        return _error_grades(student, course_path, rubric, message)
    plans = plan_submission(course, exercises, submission)
    results = _run_exercises(course, plans, name, content, limits)
    grades = [
        _grade(student, course_path, plan.exercise, rubric, *result)
        for plan, result in zip(plans, results)
    ]
    return grades + question_grades(student, course_path, submission, rubric)


def read_notebook(content: bytes | str) -> nbformat.NotebookNode:
    """A submission's notebook from its bytes; ValueError (and whatever
    nbformat raises) when it is not read (``content``: why), not JSON, or its
    cells are not as nbformat 4 writes them."""
    if isinstance(content, str):
        raise ValueError(content)
    text = content.decode("utf-8")
    raw = json.loads(text)
    if isinstance(raw, dict) and raw.get("nbformat") == 4:  # before nbformat
        _refuse_malformed(raw)
    submission = nbformat.reads(text, as_version=4)
    _refuse_malformed(submission)  # an older format, upgraded
    return submission


def _refuse_malformed(notebook: dict) -> None:
    fault = malformed_cell(notebook)
    if fault:
        raise ValueError(fault)


def malformed_cell(submission: dict) -> str:
    """What in ``submission`` (a notebook, or its JSON) is not a cell as
    nbformat 4 writes it (the first fault, naming the cell), or "" when
    nothing is."""
    cells = submission.get("cells")
    if not isinstance(cells, list):
        return f"cells must be a list, got {type(cells).__name__}"
    for index, cell in enumerate(cells):
        fault = _cell_fault(cell)
        if fault:
            return f"cell {index}: {fault}"
    return ""


def _cell_fault(cell: Any) -> str:
    if not isinstance(cell, dict):
        return f"a cell must be a mapping, got {type(cell).__name__}"
    for name, kind in (("cell_type", str), ("metadata", dict)):
        value = cell.get(name, {} if name == "metadata" else None)
        if not isinstance(value, kind):
            return f"{name} must be a {kind.__name__}, got {type(value).__name__}"
    source = cell.get("source")
    lines = source if isinstance(source, list) else [source]
    if not all(isinstance(line, str) for line in lines):
        return f"source must be text, got {type(source).__name__}"
    metadata = cell.get("metadata", {})
    tags, nbgrader = metadata.get("tags", []), metadata.get("nbgrader", {})
    if not (isinstance(tags, list) and all(isinstance(t, str) for t in tags)):
        return f"metadata.tags must be a list of strings, got {tags!r:.40}"
    if not isinstance(nbgrader, dict):
        return f"metadata.nbgrader must be a dict, got {type(nbgrader).__name__}"
    if not isinstance(nbgrader.get("grade_id", ""), str):
        return "metadata.nbgrader.grade_id must be a str"
    return ""


def question_grades(
    student: str,
    course_path: Path,
    submission: nbformat.NotebookNode | None,
    rubric: Rubric,
) -> list[Grade]:
    """One row per written question of the notebook: ``manual`` (its points to
    be given by hand) when the answer cell was written in, else ``not
    attempted`` with 0 points."""
    cells = [] if submission is None else submission.cells
    grades = []
    for question in rubric.questions_of(notebook_number(course_path.name)):
        answers = [
            c.source.strip() for c in cells if grade_id(c) == question.question_id
        ]
        text = answers[0] if answers else ""
        answered = bool(text) and text != ANSWER_STUB
        grades.append(
            Grade(
                student,
                course_path.name,
                question.question_id,
                "manual" if answered else "not attempted",
                0.0,
                question.points,
                f"graded by hand: answered in {len(text.split())} words"
                if answered
                else QUESTION_NOT_ANSWERED,
            )
        )
    return grades


KernelResult = tuple[str, str, int | None, int | None]


def _grade(
    student: str,
    course_path: Path,
    exercise: Exercise,
    rubric: Rubric,
    result: KernelResult,
    flag: str = "",
    seconds: float = 0.0,
) -> Grade:
    outcome, message, passed, run = result
    max_points = rubric.exercises[exercise.exercise_id]
    points = 0.0
    if outcome == "pass":
        points = max_points
    elif outcome == "fail" and run and exercise.exercise_id in rubric.partial_credit:
        points = round(max_points * passed / run, 2)
    return Grade(
        student,
        course_path.name,
        exercise.exercise_id,
        outcome,
        points,
        max_points,
        short_message(message, passed, run),
        flag,
        round(seconds, 2),
    )


def _run_exercises(
    course: nbformat.NotebookNode,
    plans: list[ExercisePlan],
    name: str,
    content: bytes,
    limits: Limits,
) -> list[tuple[KernelResult, str, float]]:
    """``(result, flag, seconds)`` of each exercise; one kernel, started only
    when the student wrote something, serves them all when it can."""
    if not any(plan.cells for plan in plans):
        return [(_not_written(plan), "", 0.0) for plan in plans]
    results = []
    with tempfile.TemporaryDirectory(prefix="grpo-lab-grade-") as workdir:
        # Another user (the student's process, see sandbox.confine_solution) may
        # pass through to its own folder; it may not list, nor read the rest.
        os.chmod(workdir, 0o711)
        (Path(workdir) / name).write_bytes(content)  # the folder holds this copy only
        kernel = _Kernel(course, workdir, [p.exercise for p in plans], limits)
        try:
            for plan in plans:
                started = time.perf_counter()
                if not plan.cells:
                    result = _not_written(plan)
                else:
                    result = _kernel_grade(kernel, plan)
                    if result[0] == "not attempted" and plan.answer_below is not None:
                        result = _not_written(plan)
                checks = check_names_in(course.cells[plan.exercise.check_index].source)
                pasted = pasted_counterpart(plan.solution, checks)
                flag = f"matches {pasted}" if pasted else ""
                results.append((result, flag, time.perf_counter() - started))
        finally:
            kernel.stop()
    return results


def _kernel_grade(kernel: _Kernel, plan: ExercisePlan) -> KernelResult:
    """The kernel's verdict; anything the grader did not foresee is this
    exercise's ``error``, and the next one gets a fresh kernel."""
    try:
        return kernel.grade(plan)
    except Exception as error:
        kernel.stop()
        return "error", f"the grader failed on it: {_one_line(error)}", None, None


def _not_written(plan: ExercisePlan) -> KernelResult:
    """The verdict on an exercise with no answer above its check: one written
    below it is named, with its cell's number (counting every cell from 1)."""
    if plan.answer_below is None:
        return ("not attempted", NOTHING_WRITTEN, None, None)
    message = ANSWER_BELOW.format(cell=plan.answer_below + 1)
    return ("not attempted", message, None, None)


class _Kernel:
    """A contained kernel that has run the course notebook's context cells and
    some of the student's cells."""

    def __init__(
        self,
        course: nbformat.NotebookNode,
        workdir: str,
        exercises: list[Exercise],
        limits: Limits,
    ) -> None:
        self.course = course
        self.exercises = exercises
        # An earlier exercise's function, defined by the course's own solution:
        # a later exercise that calls it is graded on its own code alone.
        self.solution_of_check = {e.check_index: e.solution_index for e in exercises}
        self.notebook_checks = notebook_checks(course, exercises)
        self.workdir = workdir
        self.limits = limits
        self.cpu_seconds = int(CONTEXT_TIMEOUT + limits.timeout * (len(exercises) + 1))
        self.client: Any = None
        self.channel: Any = None
        # The student's cells this kernel has run, and those that brought an
        # earlier kernel down (never run again).
        self.ran_cells: set[int] = set()
        self.skipped: set[int] = set()
        # The first course cell that raised, and its message.
        self.failed_at: int | None = None
        self.context_error = ""
        self.sequence = 0

    def grade(self, plan: ExercisePlan) -> KernelResult:
        """Run the student's cells not run yet, then grade the exercise."""
        from nbclient.exceptions import CellTimeoutError, DeadKernelError

        exercise = plan.exercise
        timeout = self.limits.timeout
        new: list[tuple[int, str]] = []
        try:
            if self.client is None:
                self._start()
            failure = self._context_failure(exercise)
            if failure:
                return "error", failure, None, None
            new = [
                (index, source)
                for index, source in plan.cells
                if index not in self.ran_cells | self.skipped
            ]
            self.ran_cells |= {index for index, _ in new}
            self.sequence += 1
            check_source = self.course.cells[exercise.check_index].source
            source = grading_cell_source(
                self.sequence,
                new,
                check_source,
                exercise.exercise_id.split("-", 1)[1],
                check_names_in(check_source),
                self.notebook_checks,
                self._earlier_solutions(exercise),
            )
            outputs = self._execute(source, timeout, store_history=False)
        except CellTimeoutError:
            self._replace(new)
            return "error", f"ran past the time limit of {timeout:g} s", None, None
        except DeadKernelError:
            self._replace(new)
            return "error", "the kernel died while grading this exercise", None, None
        result = self._verdict(outputs)
        if result[1].endswith(RESTART_TEXT):
            self._replace(new)  # the next exercise gets a fresh kernel
        elif result[1].startswith((TAMPERED_PREFIX, CHANNEL_TAMPERED)):
            self.skipped |= {index for index, _ in new}  # in a later kernel too
        return result

    def _replace(self, new: list[tuple[int, str]]) -> None:
        """Stop this kernel; the next one skips the cells run just now."""
        self.stop()
        self.skipped |= {index for index, _ in new}

    def _verdict(self, outputs: list) -> KernelResult:
        """The cell's one line on the channel, if the cell ended cleanly."""
        lines = self.channel.read().decode("ascii", "replace").splitlines()
        error = next((o for o in outputs if o.output_type == "error"), None)
        if error is not None:
            return (
                "error",
                f"{error.ename}: {' '.join(error.evalue.split())}",
                None,
                None,
            )
        if len(lines) != 1:
            message = f"{CHANNEL_TAMPERED} ({len(lines)} result lines) {RESTART_TEXT}"
            return "error", message, None, None
        try:
            sequence, outcome, message, passed, run = json.loads(lines[0])
        except ValueError:
            return "error", f"{CHANNEL_TAMPERED} (a malformed result line)", None, None
        counted = all(n is None or type(n) is int for n in (passed, run))
        if sequence != self.sequence or outcome not in KERNEL_OUTCOMES or not counted:
            message = f"{CHANNEL_TAMPERED} (a result line not of this cell)"
            return "error", message, None, None
        return outcome, str(message), passed, run

    def _needed(self, exercise: Exercise) -> list[int]:
        return sorted(set(exercise.context_indices) | set(exercise.earlier_checks))

    def _context_failure(self, exercise: Exercise) -> str:
        if self.failed_at is None:
            return ""
        if any(index >= self.failed_at for index in self._needed(exercise)):
            return self.context_error
        return ""

    def _course_source(self, index: int) -> str:
        """A context cell; an earlier check cell: its imports and the course's
        solution of its exercise."""
        source = self.course.cells[index].source
        if index in self.solution_of_check:
            solution = self.course.cells[self.solution_of_check[index]].source
            source = f"{import_statements(source)}\n{solution}"
        return source

    def _earlier_solutions(self, exercise: Exercise) -> str:
        return "\n".join(self._course_source(i) for i in exercise.earlier_checks)

    def _run_context(self) -> None:
        """Every exercise's context cells, in course order, before any student
        code; then the checks' imports and the recorded world."""
        needed = sorted({i for e in self.exercises for i in self._needed(e)})
        for index in needed:
            outputs = self._execute(self._course_source(index), CONTEXT_TIMEOUT)
            error = next((o for o in outputs if o.output_type == "error"), None)
            if error is not None:
                self.failed_at = index
                self.context_error = (
                    f"course cell {index} (context) raised {error.ename}: "
                    f"{error.evalue}"
                )
                return
        imports = "\n".join(
            import_statements(self.course.cells[e.check_index].source)
            for e in self.exercises
        )
        source = (
            "import grpo_lab.instructor.grading_kernel as _grade_kernel\n"
            f"_grade_kernel.prepare({imports!r})\n"
            "del _grade_kernel\n"
        )
        outputs = self._execute(source, CONTEXT_TIMEOUT, store_history=False)
        error = next((o for o in outputs if o.output_type == "error"), None)
        if error is not None:
            self.failed_at = -1
            self.context_error = f"the checks' imports raised {error.evalue}"

    def _start(self) -> None:
        from nbclient import NotebookClient

        # The student's folder starts empty in each kernel (where it is not a
        # tmpfs of the kernel's own, an earlier kernel's files are still there).
        shutil.rmtree(Path(self.workdir) / SCRATCH_FOLDER, ignore_errors=True)
        handle, path = tempfile.mkstemp(prefix="grpo-lab-results-")
        os.close(handle)
        write_end = os.open(path, os.O_WRONLY | os.O_APPEND)
        self.channel = open(path, "rb")  # noqa: SIM115 (closed in stop)
        os.unlink(path)  # reachable through the two descriptors only
        self.client = NotebookClient(
            nbformat.v4.new_notebook(),
            kernel_name="python3",
            allow_errors=True,
            interrupt_on_timeout=False,
            resources={"metadata": {"path": self.workdir}},
        )
        manager = ContainedKernelManager(kernel_name="python3")
        manager.sandbox_prefix = self._sandbox_command(write_end)
        self.client.km = manager
        try:
            os.set_inheritable(write_end, True)
            self.client.start_new_kernel(
                env=kernel_environment(self.workdir, write_end),
                cwd=self.workdir,
                pass_fds=(write_end,),
            )
        finally:
            os.close(write_end)
        self.client.start_new_kernel_client()
        self.ran_cells = set()
        self.failed_at, self.context_error = None, ""
        outputs = self._execute(BOOTSTRAP_SOURCE, CONTEXT_TIMEOUT, store_history=False)
        error = next((o for o in outputs if o.output_type == "error"), None)
        if error is not None:
            self.failed_at = -1
            self.context_error = f"the grader's kernel set-up raised {error.evalue}"
            return
        self._run_context()

    def _sandbox_command(self, write_end: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "grpo_lab.instructor.sandbox",
            "--workdir",
            self.workdir,
            "--memory",
            str(self.limits.memory_bytes),
            "--cpu",
            str(self.cpu_seconds),
            "--nproc",
            str(self.limits.processes),
            "--tree-memory",
            str(self.limits.tree_memory_bytes),
            "--tree-processes",
            str(self.limits.tree_processes),
            "--folder",
            str(Path(self.workdir) / SCRATCH_FOLDER),
            "--write",
            self.workdir,
            "--write",
            "/dev",
            "--keep-fd",
            str(write_end),
            "--",
        ]

    def _execute(self, source: str, timeout: float, store_history: bool = True) -> list:
        """Run a cell; CellTimeoutError past ``timeout``. A kernel that ignores
        the clock (and SIGINT) is killed KILL_GRACE seconds later."""
        from nbclient.exceptions import CellTimeoutError, DeadKernelError

        cell = nbformat.v4.new_code_cell(source)
        self.client.timeout = int(max(1, round(timeout)))
        self.client.nb.cells.append(cell)
        watchdog = threading.Timer(timeout + KILL_GRACE, self._kill)
        watchdog.start()
        try:
            self.client.execute_cell(
                cell, len(self.client.nb.cells) - 1, store_history=store_history
            )
        except DeadKernelError:
            if watchdog.finished.is_set() and not watchdog.is_alive():
                raise CellTimeoutError(f"killed after {timeout:g} s") from None
            raise
        finally:
            watchdog.cancel()
        return cell.outputs

    def _kill(self) -> None:
        """SIGTERM to the warden, which kills the kernel and all it started."""
        process = getattr(getattr(self.client.km, "provisioner", None), "process", None)
        if process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        """Kill the kernel and everything it started (a later grade starts afresh)."""
        if self.client is None:
            return
        self._kill()
        process = getattr(getattr(self.client.km, "provisioner", None), "process", None)
        with contextlib.suppress(Exception):
            process.wait(timeout=STOP_TIMEOUT)
        with contextlib.suppress(Exception):
            self.client._cleanup_kernel()
        with contextlib.suppress(Exception):
            self.channel.close()
        self.client = None


def kernel_environment(workdir: str, result_fd: int) -> dict[str, str]:
    """A kernel's whole environment: nothing of the grader's (no tokens, no
    credentials), the smoke profile, this grpo_lab importable, every cache and
    configuration folder inside ``workdir``."""
    folders = {
        "HOME": "home",
        "TMPDIR": "tmp",
        "IPYTHONDIR": "home/.ipython",
        "MPLCONFIGDIR": "home/.matplotlib",
        "XDG_CACHE_HOME": "home/.cache",
        "HF_HOME": "home/.cache/huggingface",
    }
    environment = {key: str(Path(workdir) / sub) for key, sub in folders.items()}
    for folder in environment.values():
        Path(folder).mkdir(mode=0o700, parents=True, exist_ok=True)
    executable_dir = str(Path(sys.executable).parent)
    environment.update(
        {
            "PATH": os.pathsep.join(
                [executable_dir, "/usr/local/bin", "/usr/bin", "/bin"]
            ),
            "LANG": "C.UTF-8",
            "PYTHONPATH": str(PACKAGE_DIR.parent),
            "PYTHONDONTWRITEBYTECODE": "1",
            "GRPO_LAB_PROFILE": "smoke",
            "OMP_NUM_THREADS": "1",
            "MPLBACKEND": "agg",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "JUPYTER_PLATFORM_DIRS": "1",
            RESULT_FD_VARIABLE: str(result_fd),
        }
    )
    return environment


# --- the table -----------------------------------------------------------------------


def write_grades_csv(grades: list[Grade], path: str | Path) -> Path:
    """Write one row per grade (columns CSV_COLUMNS); points without trailing .0,
    a written question's points left blank (they are given by hand)."""
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
            "" if grade.outcome == "manual" else f"{grade.points:g}",
            f"{grade.max_points:g}",
            f"{grade.seconds:.1f}",
            grade.message,
            grade.flag,
        ]


# --- messages ------------------------------------------------------------------------

# The checks' ways of naming a mistake, each put first in the message.
_NAMED_MISTAKES = (
    re.compile(r",?\s*the value you get when (?P<mistake>[^\n]+)"),
    re.compile(r"\s*hint: (?P<mistake>[^\n]+)"),
    re.compile(r"\s*this looks like a slip: (?P<mistake>[^\n]+)"),
)
_TALLY = re.compile(r"\s*\(?\b\d+ of \d+ cases passed\)?")
# "For <inputs>: <finding>": the finding comes first, the inputs after it.
_FOR_INPUTS = re.compile(
    r"^For (?P<inputs>.+?):\s+(?P<finding>(?:expected|got|the|a|an|each|it|this)\b.*)$",
    re.DOTALL,
)
_LONG_NUMBER = re.compile(r"(?<![\w.])-?\d+\.\d{5,}(?:e[+-]?\d+)?(?![\w.])")


def short_message(
    message: str, passed: int | None = None, run: int | None = None
) -> str:
    """One line of at most MESSAGE_LIMIT characters: the named mistake, the
    cases passed, then the finding and its inputs, numbers to 4 digits."""
    mistake = ""
    for pattern in _NAMED_MISTAKES:
        found = pattern.search(message)
        if found:
            mistake = found.group("mistake").strip()
            message = message[: found.start()] + message[found.end() :]
            break
    message = " ".join(_TALLY.sub("", message).split())
    split = _FOR_INPUTS.match(message)
    if split:
        message = f"{split.group('finding')} (for {split.group('inputs')})"
    tally = f"{passed} of {run} cases passed" if run else ""
    text = "; ".join(part for part in (mistake, tally, message) if part)
    text = _LONG_NUMBER.sub(lambda m: f"{float(m.group()):.4g}", text)
    if len(text) > MESSAGE_LIMIT:
        text = text[: MESSAGE_LIMIT - 3].rstrip() + "..."
    return text
