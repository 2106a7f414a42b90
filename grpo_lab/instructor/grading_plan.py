"""Which cells of a submitted notebook the grader runs for each exercise.

Read without a kernel: for every exercise, the code cells the student wrote or
changed above its check (a helper in another cell and an answer in a new cell
count), found by comparing the submission with the course notebook. Course cells,
untouched stubs (the grpo-lab and the nbgrader form), check cells, cells tagged
``colab``/``walk-through``/``grading-skip`` and cells that call a check are left
out. A submission's check cell is found by its grade_id, then by its source,
then by its call; where it was deleted, the next exercise's cells mark the spot.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import nbformat

from grpo_lab.instructor.grading_kernel import check_names_in
from grpo_lab.instructor.rubric import (
    FUNCTION_NAME,
    SKIPPED_TAGS,
    Exercise,
    is_solution_cell,
)
from grpo_lab.instructor.student import STUB, strip_solutions


def solution_index(submission: nbformat.NotebookNode, exercise_id: str) -> int | None:
    """The index of the submission's solution cell for ``exercise_id``, or None.

    The cell whose ``nbgrader.grade_id`` is the id; else the first code cell that
    defines the exercise's function.
    """
    cells = submission.cells
    for index, cell in enumerate(cells):
        if cell.cell_type == "code" and grade_id(cell) == exercise_id:
            return index
    function = exercise_id.split("-", 1)[1]
    for index, cell in enumerate(cells):
        if cell.cell_type == "code" and function in FUNCTION_NAME.findall(cell.source):
            return index
    return None


def student_solution(submission: nbformat.NotebookNode, exercise_id: str) -> str | None:
    """The source of the submission's solution cell for ``exercise_id``, or None."""
    index = solution_index(submission, exercise_id)
    return None if index is None else submission.cells[index].source


def grade_id(cell: nbformat.NotebookNode) -> str | None:
    return cell.metadata.get("nbgrader", {}).get("grade_id")


@dataclass(frozen=True)
class ExercisePlan:
    """What a kernel runs for one exercise of one submission."""

    exercise: Exercise
    # The cells the student wrote above the exercise's check: (index, source).
    cells: tuple[tuple[int, str], ...]
    # The last of them that defines the exercise's function ("" when none).
    solution: str
    # The index of a cell below the check that defines the exercise's function
    # (the answer written in the wrong place), or None.
    answer_below: int | None = None


def plan_submission(
    course: nbformat.NotebookNode,
    exercises: list[Exercise],
    submission: nbformat.NotebookNode,
) -> list[ExercisePlan]:
    """For each exercise, the cells the student wrote above its check."""
    known = course_sources(course)
    checks = notebook_checks(course, exercises)
    calls_a_check = re.compile(
        r"\b(?:" + "|".join(map(re.escape, checks)) + r")\s*\(" if checks else r"$^"
    )
    written = [
        (index, cell.source)
        for index, cell in enumerate(submission.cells)
        if cell.cell_type == "code"
        and cell.source.strip()
        and cell.source.strip() not in known
        and not SKIPPED_TAGS & set(cell.metadata.get("tags", []))
        and not calls_a_check.search(cell.source)
    ]
    plans = []
    for exercise, position in zip(
        exercises, check_positions(course, exercises, submission)
    ):
        cells = tuple((i, source) for i, source in written if i < position)
        function = exercise.exercise_id.split("-", 1)[1]
        defining = [s for _, s in cells if function in FUNCTION_NAME.findall(s)]
        below = [
            i
            for i, cell in enumerate(submission.cells)
            if i > position
            and cell.cell_type == "code"
            and cell.source.strip() not in known
            and function in FUNCTION_NAME.findall(cell.source)
        ]
        plans.append(
            ExercisePlan(
                exercise,
                cells,
                defining[-1] if defining else "",
                below[0] if below else None,
            )
        )
    return plans


def course_sources(course: nbformat.NotebookNode) -> set[str]:
    """The stripped sources of the course's own code cells as a student copy
    shows them: every code cell but a solution, and each solution's stub (as
    ``grpo-lab notebooks`` and as nbgrader write it)."""
    known = set()
    for cell in course.cells:
        if cell.cell_type != "code":
            continue
        if not is_solution_cell(cell):
            known.add(cell.source.strip())
            continue
        stubbed = strip_solutions(cell.source)
        known.add(stubbed.strip())
        lines = [
            f"{line[: len(line) - len(line.lstrip())]}# YOUR CODE HERE\n{line}"
            if line.strip() == STUB
            else line
            for line in stubbed.split("\n")
        ]
        known.add("\n".join(lines).strip())
    return known


def check_positions(
    course: nbformat.NotebookNode,
    exercises: list[Exercise],
    submission: nbformat.NotebookNode,
) -> list[int]:
    """The index in the submission of each exercise's check cell; where it was
    deleted, that of the next exercise's solution or check cell (or the end)."""
    checks = [_check_cell(course, e, submission.cells) for e in exercises]
    solutions = [solution_index(submission, e.exercise_id) for e in exercises]
    positions = []
    for number, found in enumerate(checks):
        if found is None:
            after = -1 if solutions[number] is None else solutions[number]
            later = [
                index
                for index in checks[number + 1 :] + solutions[number + 1 :]
                if index is not None and index > after
            ]
            found = min(later, default=len(submission.cells))
        positions.append(found)
    return positions


def _check_cell(
    course: nbformat.NotebookNode, exercise: Exercise, cells: list
) -> int | None:
    """The submission's check cell: by grade_id, else by source, else the first
    cell that calls the exercise's check."""
    source = course.cells[exercise.check_index].source
    calls = [re.compile(rf"\b{name}\s*\(") for name in check_names_in(source)]
    tests = (
        lambda cell: grade_id(cell) == f"{exercise.exercise_id}-check",
        lambda cell: cell.source.strip() == source.strip(),
        lambda cell: any(call.search(cell.source) for call in calls),
    )
    for test in tests:
        for index, cell in enumerate(cells):
            if cell.cell_type == "code" and test(cell):
                return index
    return None


def notebook_checks(
    course: nbformat.NotebookNode, exercises: list[Exercise]
) -> tuple[str, ...]:
    names = [check_names_in(course.cells[e.check_index].source) for e in exercises]
    return tuple(dict.fromkeys(name for found in names for name in found))
