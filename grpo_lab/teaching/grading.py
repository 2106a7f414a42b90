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

import contextlib
import csv
import json
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import nbformat
from jupyter_client.manager import AsyncKernelManager

from grpo_lab.teaching import grading_kernel
from grpo_lab.teaching.grading_kernel import (
    RESTART_TEXT,
    RESULT_FD_VARIABLE,
    check_names_in,
)
from grpo_lab.teaching.grading_refusal import pasted_counterpart
from grpo_lab.teaching.rubric import (
    FUNCTION_NAME,
    Exercise,
    Rubric,
    find_exercises,
    load_rubric,
    notebook_number,
)
from grpo_lab.teaching.shipped_notebooks import PACKAGE_DIR, course_notebooks_dir

OUTCOMES = ("pass", "fail", "not attempted", "error")
CSV_COLUMNS = (
    "student",
    "notebook",
    "exercise",
    "outcome",
    "points",
    "max_points",
    "message",
    "flag",
)
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
    "import grpo_lab.teaching.grading_kernel as _grade_kernel\n"
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
    # syntax tree is the package function's (see grading_refusal).
    flag: str = ""


# --- inside the kernel (grpo_lab.teaching.grading_kernel) ------------------------

run_exercise = grading_kernel.run_exercise
import_statements = grading_kernel.import_statements
NOT_ATTEMPTED_TEXT = grading_kernel.NOT_ATTEMPTED_TEXT
_one_line = grading_kernel.one_line
_python_source = grading_kernel.python_source
TAMPERED_PREFIX = grading_kernel.TAMPERED_PREFIX


def grading_cell_source(
    sequence: int,
    solution_source: str,
    check_source: str,
    function_name: str,
    check_names: tuple[str, ...],
) -> str:
    """The kernel code that grades one exercise and writes its line to the channel."""
    return (
        "import grpo_lab.teaching.grading_kernel as _grade_kernel\n"
        f"_grade_kernel.grade({sequence}, {solution_source!r}, {check_source!r}, "
        f"{function_name!r}, {check_names!r}, globals())\n"
        "del _grade_kernel\n"
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
    """``{number: path}`` of the course notebooks (default: a checkout's)."""
    folder = course_notebooks_dir() if notebooks_dir is None else Path(notebooks_dir)
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


@dataclass(frozen=True)
class Limits:
    """What one grading kernel may use (see :mod:`grpo_lab.teaching.sandbox`)."""

    # Seconds one exercise (solution and check) may take; then the kernel is killed.
    timeout: float = 60.0
    # Address space of the kernel and of each process it starts (RLIMIT_AS).
    memory_bytes: int = MEMORY_BYTES
    # Processes and threads of the kernel's user (RLIMIT_NPROC; root is exempt).
    processes: int = PROCESSES


def grade_submissions(
    submissions_dir: str | Path,
    *,
    notebooks_dir: str | Path | None = None,
    rubric: Rubric | None = None,
    timeout: float = 60.0,
    memory_bytes: int = MEMORY_BYTES,
) -> list[Grade]:
    """Grade every student's submitted notebooks; one Grade per student × exercise.

    ``timeout`` is the limit in seconds for one exercise (solution and check);
    ``memory_bytes`` the address space of each kernel. Every submission is read
    before the first kernel starts, and every kernel (with whatever it started)
    is dead when this returns.
    """
    if not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout}")
    if not (isinstance(memory_bytes, int) and memory_bytes >= 1 << 28):
        raise ValueError(
            f"memory_bytes must be an integer of at least 2**28, got {memory_bytes!r}"
        )
    limits = Limits(timeout, memory_bytes, PROCESSES)
    rubric = load_rubric() if rubric is None else rubric
    course = course_notebooks(notebooks_dir)
    submitted = [
        (student, path.name, _read_bytes(path), course[number])
        for student, notebooks in find_submissions(submissions_dir).items()
        for number, path in notebooks.items()
        if number in course
    ]
    grades = []
    for student, name, content, course_path in submitted:
        grades += grade_notebook(student, name, content, course_path, rubric, limits)
    return grades


def _read_bytes(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def grade_notebook(
    student: str,
    name: str,
    content: bytes | None,
    course_path: Path,
    rubric: Rubric,
    limits: Limits,
) -> list[Grade]:
    """Grade one submitted notebook (its bytes) against ``course_path``."""
    course = nbformat.read(course_path, as_version=4)
    exercises = find_exercises(course, course_path.name)
    missing = [
        e.exercise_id for e in exercises if e.exercise_id not in rubric.exercises
    ]
    if missing:
        raise ValueError(f"rubric.toml must give points to {missing}, found none")
    try:
        if content is None:
            raise ValueError("the file could not be read")
        submission = nbformat.reads(content.decode("utf-8"), as_version=4)
    except Exception as error:
        message = f"the notebook cannot be read: {_one_line(error)}"
        return [
            _grade(student, course_path, e, rubric, "error", message) for e in exercises
        ]
    results = _run_exercises(course, exercises, submission, name, content, limits)
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
    flag: str = "",
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
        flag,
    )


def _run_exercises(
    course: nbformat.NotebookNode,
    exercises: list[Exercise],
    submission: nbformat.NotebookNode,
    name: str,
    content: bytes,
    limits: Limits,
) -> list[tuple[str, str, str]]:
    """``(outcome, message, flag)`` of each exercise, in one kernel when possible."""
    results = []
    with tempfile.TemporaryDirectory(prefix="grpo-lab-grade-") as workdir:
        (Path(workdir) / name).write_bytes(content)  # the folder holds this copy only
        kernel = _Kernel(course, workdir, exercises, limits)
        try:
            for exercise in exercises:
                solution = student_solution(submission, exercise.exercise_id)
                if solution is None:
                    results.append(
                        ("not attempted", "no solution cell for this exercise", "")
                    )
                    continue
                checks = check_names_in(course.cells[exercise.check_index].source)
                flag = pasted_counterpart(solution, checks)
                flag = f"matches {flag}" if flag else ""
                results.append((*kernel.grade(exercise, solution), flag))
        finally:
            kernel.stop()
    return results


class _ContainedKernelManager(AsyncKernelManager):
    """A kernel manager whose kernel command runs under the sandbox's warden."""

    sandbox_prefix: ClassVar[list[str]] = []

    def format_kernel_cmd(self, extra_arguments: list[str] | None = None) -> list[str]:
        return self.sandbox_prefix + super().format_kernel_cmd(extra_arguments)


class _Kernel:
    """A contained kernel that has run some of the course notebook's context cells."""

    def __init__(
        self,
        course: nbformat.NotebookNode,
        workdir: str,
        exercises: list[Exercise],
        limits: Limits,
    ) -> None:
        self.course = course
        # An earlier exercise's function, defined by the course's own solution:
        # a later exercise that calls it is graded on its own code alone.
        self.solution_of_check = {e.check_index: e.solution_index for e in exercises}
        self.workdir = workdir
        self.limits = limits
        self.cpu_seconds = int(CONTEXT_TIMEOUT + limits.timeout * (len(exercises) + 1))
        self.client: Any = None
        self.channel: Any = None
        self.ran: set[int] = set()
        self.context_error = ""
        self.sequence = 0

    def grade(self, exercise: Exercise, solution: str) -> tuple[str, str]:
        """Run the missing context cells, then grade the exercise."""
        from nbclient.exceptions import CellTimeoutError, DeadKernelError

        timeout = self.limits.timeout
        try:
            self._run_context(exercise)
            if self.context_error:
                return "error", self.context_error
            self.sequence += 1
            check_source = self.course.cells[exercise.check_index].source
            source = grading_cell_source(
                self.sequence,
                solution,
                check_source,
                exercise.exercise_id.split("-", 1)[1],
                check_names_in(check_source),
            )
            outputs = self._execute(source, timeout, store_history=False)
        except CellTimeoutError:
            self.stop()
            return "error", f"ran past the time limit of {timeout:g} s"
        except DeadKernelError:
            self.stop()
            return "error", "the kernel died while grading this exercise"
        outcome, message = self._verdict(outputs)
        if message.endswith(RESTART_TEXT):
            self.stop()  # the next exercise gets a fresh kernel
        return outcome, message

    def _verdict(self, outputs: list) -> tuple[str, str]:
        """The cell's one line on the channel, if the cell ended cleanly."""
        lines = self.channel.read().decode("ascii", "replace").splitlines()
        error = next((o for o in outputs if o.output_type == "error"), None)
        if error is not None:
            return "error", f"{error.ename}: {' '.join(error.evalue.split())}"
        if len(lines) != 1:
            return "error", (
                f"{CHANNEL_TAMPERED} ({len(lines)} result lines) {RESTART_TEXT}"
            )
        try:
            sequence, outcome, message = json.loads(lines[0])
        except ValueError:
            return "error", f"{CHANNEL_TAMPERED} (a malformed result line)"
        if sequence != self.sequence or outcome not in OUTCOMES:
            return "error", f"{CHANNEL_TAMPERED} (a result line not of this cell)"
        return outcome, str(message)

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
            outputs = self._execute(source, CONTEXT_TIMEOUT)
            self.ran.add(index)
            error = next((o for o in outputs if o.output_type == "error"), None)
            if error is not None:
                self.context_error = (
                    f"course cell {index} (context) raised {error.ename}: "
                    f"{error.evalue}"
                )

    def _start(self) -> None:
        from nbclient import NotebookClient

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
        manager = _ContainedKernelManager(kernel_name="python3")
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
        self.ran = set()
        self.context_error = ""
        outputs = self._execute(BOOTSTRAP_SOURCE, CONTEXT_TIMEOUT, store_history=False)
        error = next((o for o in outputs if o.output_type == "error"), None)
        if error is not None:
            self.context_error = f"the grader's kernel set-up raised {error.evalue}"

    def _sandbox_command(self, write_end: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "grpo_lab.teaching.sandbox",
            "--workdir",
            self.workdir,
            "--memory",
            str(self.limits.memory_bytes),
            "--cpu",
            str(self.cpu_seconds),
            "--nproc",
            str(self.limits.processes),
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
        Path(folder).mkdir(parents=True, exist_ok=True)
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
            grade.flag,
        ]
