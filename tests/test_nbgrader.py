"""Tests for grpo_lab.teaching.nbgrader_metadata: the notebooks under real nbgrader."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_lab.teaching import nbgrader_metadata
from grpo_lab.teaching.rubric import load_rubric
from grpo_lab.teaching.shipped_notebooks import PACKAGE_DIR, shipped_notebooks_dir

NAME = "03_rewards_and_advantages.ipynb"
ASSIGNMENT = "ps03"
CHECK_ID = "03-group_normalized_advantages-check"

CONFIG = """
from grpo_lab.teaching.nbgrader_metadata import autograde_preprocessors

c = get_config()
c.CourseDirectory.root = {root!r}
c.CourseDirectory.db_assignments = [dict(name="ps03")]
c.CourseDirectory.db_students = [dict(id="alice"), dict(id="carol")]
c.Autograde.autograde_preprocessors = autograde_preprocessors()
"""


def test_the_notebooks_carry_the_metadata_the_script_writes():
    stale = nbgrader_metadata.stale_notebooks(
        shipped_notebooks_dir(), load_rubric(), write=False
    )
    assert stale == [], (
        "run `python -m grpo_lab.teaching.nbgrader_metadata` to update "
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


@pytest.mark.slow
def test_generate_assignment_and_autograde_score_the_check_cells(tmp_path):
    pytest.importorskip("nbgrader")
    from nbgrader.api import Gradebook

    root = tmp_path / "course"
    (root / "source" / ASSIGNMENT).mkdir(parents=True)
    (root / "nbgrader_config.py").write_text(CONFIG.format(root=str(root)))
    shutil.copyfile(shipped_notebooks_dir() / NAME, root / "source" / ASSIGNMENT / NAME)
    nbgrader(root, "generate_assignment", ASSIGNMENT)
    released = root / "release" / ASSIGNMENT / NAME
    assert "raise NotImplementedError()" in released.read_text()
    for student, notebook in [
        ("alice", root / "source" / ASSIGNMENT / NAME),  # the solutions
        ("carol", released),  # untouched student copy
    ]:
        folder = root / "submitted" / student / ASSIGNMENT
        folder.mkdir(parents=True)
        shutil.copyfile(notebook, folder / NAME)
    nbgrader(root, "autograde", ASSIGNMENT)
    notebook_id = NAME.removesuffix(".ipynb")
    with Gradebook(f"sqlite:///{root / 'gradebook.db'}") as gradebook:
        scores = {
            student: gradebook.find_grade(CHECK_ID, notebook_id, ASSIGNMENT, student)
            for student in ("alice", "carol")
        }
        assert {s: g.score for s, g in scores.items()} == {"alice": 3, "carol": 0}
        assert scores["alice"].max_score == 3
        questions = gradebook.find_submission_notebook(notebook_id, ASSIGNMENT, "alice")
        # 3 points of checks and 2 hand-graded questions of 1 point each.
        assert questions.max_score == 5


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
