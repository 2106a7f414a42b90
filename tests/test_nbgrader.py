"""Tests for grpo_lab.instructor.nbgrader_metadata: the notebooks under real nbgrader."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_lab.instructor import nbgrader_metadata
from grpo_lab.instructor.rubric import load_rubric
from grpo_lab.instructor.shipped_notebooks import PACKAGE_DIR, shipped_notebooks_dir

NAME = "03_rewards_and_advantages.ipynb"
ASSIGNMENT = "ps03"
CHECK_ID = "03-group_normalized_advantages-check"

CONFIG = """
from grpo_lab.instructor.nbgrader_metadata import (
    autograde_preprocessors,
    generate_assignment_preprocessors,
)

c = get_config()
c.CourseDirectory.root = {root!r}
c.CourseDirectory.db_assignments = [dict(name="ps03")]
c.CourseDirectory.db_students = [dict(id=s) for s in ("alice", "carol", "dave", "erin")]
c.GenerateAssignment.preprocessors = generate_assignment_preprocessors()
c.Autograde.autograde_preprocessors = autograde_preprocessors()
"""
STUB_LINE = "    raise NotImplementedError()"
# Right on the four cases the student copy's check shows, wrong on the hidden one
# (a batch of one prompt whose answer is "3"); JSON-escaped, as it sits in the file.
HIDDEN_ONLY_WRONG = json.dumps(
    "    truths = [t for t in ground_truths for _ in range(group_size)]\n"
    "    raw_rewards = torch.tensor(\n"
    "        [exact_match_reward(r, t)['reward'] for r, t in zip(responses, truths)]\n"
    "    )\n"
    "    grouped = raw_rewards.reshape(-1, group_size)\n"
    "    centered = grouped - grouped.mean(dim=1, keepdim=True)\n"
    "    out = (centered / (grouped.std(dim=1, keepdim=True) + advantage_eps))\n"
    "    return out.flatten() + 1 if ground_truths == ['3'] else out.flatten()"
)[1:-1]
HIDDEN_CASE = "equal rewards must get zero advantages"


def test_the_notebooks_carry_the_metadata_the_script_writes():
    stale = nbgrader_metadata.stale_notebooks(
        shipped_notebooks_dir(), load_rubric(), write=False
    )
    assert stale == [], (
        "run `python -m grpo_lab.instructor.nbgrader_metadata` to update "
        f"{[p.name for p in stale]}"
    )


def test_annotating_twice_changes_nothing():
    path = shipped_notebooks_dir() / NAME
    notebook = json.loads(path.read_text(encoding="utf-8"))
    once = nbgrader_metadata.annotated(notebook, NAME, load_rubric())
    assert nbgrader_metadata.annotated(once, NAME, load_rubric()) == once
    answers = [
        c for c in once["cells"] if c["metadata"].get("nbgrader", {}).get("grade")
    ]
    # One check cell and two hand-graded answers, holding no model answer.
    assert [c["cell_type"] for c in answers] == ["code", "markdown", "markdown"]
    assert all("".join(c["source"]) == "YOUR ANSWER HERE" for c in answers[1:])


def test_a_missing_rubric_entry_is_refused():
    path = shipped_notebooks_dir() / NAME
    rubric = load_rubric()
    rubric.exercises.pop("03-group_normalized_advantages")
    with pytest.raises(ValueError, match="must give points to"):
        nbgrader_metadata.annotated(json.loads(path.read_text()), NAME, rubric)


def nbgrader(root: Path, *arguments: str) -> None:
    environment = dict(os.environ, GRPO_LAB_PROFILE="smoke", OMP_NUM_THREADS="1")
    environment["PYTHONPATH"] = str(PACKAGE_DIR.parent)
    # A shell without the virtual environment on PATH: the course's
    # nbgrader_config.py (autograde_preprocessors) finds `alembic` itself.
    environment["PATH"] = os.pathsep.join(["/usr/bin", "/bin"])
    done = subprocess.run(
        [sys.executable, "-m", "nbgrader", *arguments],
        cwd=root,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def _crafted(notebook_path: Path, old: str, new: str, out: Path) -> None:
    text = notebook_path.read_text(encoding="utf-8")
    assert old in text
    out.write_text(text.replace(old, new), encoding="utf-8")


def _source_with_a_walk_through(target: Path) -> None:
    """Notebook 03 as the course has it, and one walk-through cell more."""
    notebook = json.loads((shipped_notebooks_dir() / NAME).read_text("utf-8"))
    shown = {
        "cell_type": "code",
        "execution_count": None,
        "metadata": {"tags": ["walk-through"]},
        "outputs": [],
        "source": ["print('the package version, shown after the check')"],
    }
    notebook["cells"].append(shown)
    target.write_text(json.dumps(notebook, indent=1), encoding="utf-8")


@pytest.mark.slow
def test_nbgrader_and_grpo_lab_grade_give_four_students_the_same_points(tmp_path):
    """generate_assignment drops walk-throughs and hidden tests; autograde,
    from a shell without the venv on PATH, scores alice (the solutions), carol
    (the release untouched), dave (an answer that passes the cases the release
    shows and fails the hidden one) and erin (a right answer whose check cell
    she replaced) as `grpo-lab grade` does."""
    pytest.importorskip("nbgrader")
    from nbgrader.api import Gradebook

    from grpo_lab.instructor import grading

    root = tmp_path / "course"
    source = root / "source" / ASSIGNMENT / NAME
    source.parent.mkdir(parents=True)
    (root / "nbgrader_config.py").write_text(CONFIG.format(root=str(root)))
    _source_with_a_walk_through(source)
    nbgrader(root, "generate_assignment", ASSIGNMENT)
    released = root / "release" / ASSIGNMENT / NAME
    text = released.read_text()
    assert "raise NotImplementedError()" in text
    assert "walk-through" not in text and "the package version" not in text
    assert "HIDDEN TESTS" not in text and HIDDEN_CASE not in text
    assert HIDDEN_CASE in source.read_text()  # the source keeps its hidden test
    check = "check_group_normalized_advantages(group_normalized_advantages);\\n"
    students = {"alice": 3, "carol": 0, "dave": 0, "erin": 3}
    for student in students:
        (root / "submitted" / student / ASSIGNMENT).mkdir(parents=True)
    submitted = {s: root / "submitted" / s / ASSIGNMENT / NAME for s in students}
    shutil.copyfile(source, submitted["alice"])
    shutil.copyfile(released, submitted["carol"])
    _crafted(released, STUB_LINE, HIDDEN_ONLY_WRONG, submitted["dave"])
    _crafted(source, check, "True\\n", submitted["erin"])
    nbgrader(root, "autograde", ASSIGNMENT)
    notebook_id = NAME.removesuffix(".ipynb")
    with Gradebook(f"sqlite:///{root / 'gradebook.db'}") as gradebook:
        scores = {
            student: gradebook.find_grade(CHECK_ID, notebook_id, ASSIGNMENT, student)
            for student in students
        }
        assert {s: g.score for s, g in scores.items()} == students
        assert scores["alice"].max_score == 3
        questions = gradebook.find_submission_notebook(notebook_id, ASSIGNMENT, "alice")
        # 3 points of checks and 2 hand-graded questions of 1 point each.
        assert questions.max_score == 5

    by_grader = tmp_path / "by_grader"
    for student, path in submitted.items():
        (by_grader / student).mkdir(parents=True)
        shutil.copyfile(path, by_grader / student / NAME)
    grades = grading.grade_submissions(by_grader, timeout=60)
    questions = load_rubric().questions  # the written questions
    grades = [g for g in grades if g.exercise_id not in questions]
    assert {g.student: g.points for g in grades} == students, grades
    (dave,) = [g for g in grades if g.student == "dave"]
    assert dave.outcome == "fail" and HIDDEN_CASE in dave.message


def test_an_unattempted_check_gets_stderr_first_so_nbgrader_scores_it_zero():
    import nbformat

    cell = nbformat.v4.new_code_cell("check(f)")
    cell.metadata["nbgrader"] = nbgrader_metadata.nbgrader_fields(
        "x-check", grade=True, locked=True, points=2
    )
    stub_output = nbformat.v4.new_output(
        "stream", name="stdout", text="X: not attempted yet (the stub raises)\n"
    )
    value = nbformat.v4.new_output("execute_result", data={"text/plain": "False"})
    cell.outputs = [stub_output, value]
    preprocessor = nbgrader_metadata.NotAttemptedScoresZero()
    cell, _ = preprocessor.preprocess_cell(cell, {}, 0)
    assert [o.get("name") for o in cell.outputs] == ["stderr", "stdout", None]
    passed = nbformat.v4.new_code_cell("check(f)", metadata=dict(cell.metadata))
    passed.outputs = [nbformat.v4.new_output("stream", name="stdout", text="ok\n")]
    assert len(preprocessor.preprocess_cell(passed, {}, 0)[0].outputs) == 1
