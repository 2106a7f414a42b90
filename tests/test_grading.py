"""Tests for grpo_lab.teaching.grading and grpo_lab.teaching.rubric: `grpo-lab grade`."""

from __future__ import annotations

import csv

import nbformat
import pytest

from grpo_lab import cli
from grpo_lab.teaching import grading
from grpo_lab.teaching.rubric import find_exercises, load_rubric, notebook_number
from grpo_lab.teaching.shipped_notebooks import shipped_notebooks_dir
from grpo_lab.teaching.student import student_notebook

NAME = "03_rewards_and_advantages.ipynb"
EXERCISE = "03-group_normalized_advantages"
CORRECT_LINE = "return (centered / (grouped.std(dim=1, keepdim=True) + advantage_eps))"


def course() -> nbformat.NotebookNode:
    return nbformat.read(shipped_notebooks_dir() / NAME, as_version=4)


def with_solution(notebook, old: str, new: str) -> nbformat.NotebookNode:
    """A copy whose solution cell has ``old`` replaced by ``new``."""
    copy = nbformat.from_dict(notebook)
    (exercise,) = find_exercises(copy, NAME)
    cell = copy.cells[exercise.solution_index]
    assert old in cell.source
    cell.source = cell.source.replace(old, new)
    return copy


def without_checks(notebook, replacement: str | None) -> nbformat.NotebookNode:
    """A copy whose check cells are deleted (None) or replaced by ``replacement``."""
    copy = nbformat.from_dict(notebook)
    checks = {e.check_index for e in find_exercises(copy, NAME)}
    if replacement is None:
        copy.cells = [c for i, c in enumerate(copy.cells) if i not in checks]
    else:
        for index in checks:
            copy.cells[index].source = replacement
    return copy


def submit(root, student: str, notebook) -> None:
    (root / student).mkdir(parents=True)
    nbformat.write(notebook, root / student / NAME)


@pytest.mark.slow
def test_grade_writes_one_row_per_student_and_exercise(tmp_path, capsys):
    key = course()
    broken = with_solution(key, CORRECT_LINE, "return (centered)")
    endless = with_solution(
        key, "    grouped = raw", "    while True:\n        pass\n    grouped = raw"
    )
    root = tmp_path / "submitted"
    submit(root, "alice", without_checks(key, None))
    submit(root, "bob", broken)
    submit(root, "carol", student_notebook(key, NAME))
    submit(root, "dave", without_checks(broken, "pass"))
    submit(root, "frank", endless)
    (root / "frank" / "notes.ipynb").write_text("not a notebook")  # no number
    out = tmp_path / "grades.csv"
    code = cli.main(["grade", str(root), "--out", str(out), "--timeout", "8"])
    assert code == 0
    summary = "5 grades (1 pass, 2 fail, 1 not attempted, 1 error) written to"
    assert summary in capsys.readouterr().out
    rows = list(csv.DictReader(out.open()))
    table = [(r["student"], r["outcome"], r["points"], r["max_points"]) for r in rows]
    assert table == [
        ("alice", "pass", "3", "3"),
        ("bob", "fail", "0", "3"),
        ("carol", "not attempted", "0", "3"),
        ("dave", "fail", "0", "3"),
        ("frank", "error", "0", "3"),
    ]
    assert {(r["notebook"], r["exercise"]) for r in rows} == {(NAME, EXERCISE)}
    by_student = {r["student"]: r["message"] for r in rows}
    assert by_student["alice"] == ""  # its check cells deleted change nothing
    # The fail message is the course check's counter-example, however the
    # submission's own check cell was edited.
    assert "expected" in by_student["bob"] and by_student["dave"] == by_student["bob"]
    assert by_student["carol"] == "the check found a stub"
    assert by_student["frank"] == "ran past the time limit of 8 s"


def test_run_exercise_outcomes_without_a_kernel():
    check = (
        "from grpo_lab.teaching.checks.framework import ExerciseFailed\n"
        "def check(fn):\n"
        "    if fn(2) != 4:\n"
        "        raise ExerciseFailed('For x=2: expected 4, got ' + str(fn(2)))\n"
        "    return True\n"
        "check(double)"
    )
    good, wrong = "def double(x):\n    return 2 * x", "def double(x):\n    return x"
    stub = "def double(x):\n    raise NotImplementedError()"
    assert grading.run_exercise(good, check, {}) == ("pass", "")
    assert grading.run_exercise(wrong, check, {}) == (
        "fail",
        "For x=2: expected 4, got 2",
    )
    assert grading.run_exercise(stub, check, {})[0] == "not attempted"
    assert grading.run_exercise("1/0", check, {}) == (
        "error",
        "the solution cell raised ZeroDivisionError: division by zero",
    )
    assert grading.run_exercise("raise NotImplementedError()", check, {})[0] == (
        "not attempted"
    )
    names = {"kept": 1}
    grading.run_exercise("kept = 2\ndef double(x):\n    return 2 * x", check, names)
    assert names == {"kept": 1}  # the exercise ran in a copy


def test_import_statements_keeps_only_imports():
    source = "from a import b\nimport c\n\nb(c)\nx = 1"
    assert grading.import_statements(source) == "from a import b\nimport c"


def test_every_exercise_has_a_rubric_entry_and_every_entry_an_exercise():
    rubric = load_rubric()
    found, numbers = set(), set()
    for path in sorted(shipped_notebooks_dir().glob("[0-9][0-9]_*.ipynb")):
        notebook = nbformat.read(path, as_version=4)
        found |= {e.exercise_id for e in find_exercises(notebook, path.name)}
        numbers.add(notebook_number(path.name))
    assert found == set(rubric.exercises), (
        "rubric.toml [exercises] must list exactly the notebooks' exercises"
    )
    for number in numbers:
        assert 2 <= len(rubric.questions_of(number)) <= 3, number
    assert {q.split("-")[0] for q in rubric.questions} <= numbers


def test_student_solution_by_grade_id_or_function_name():
    cell = nbformat.v4.new_code_cell("def other():\n    pass")
    cell.metadata["nbgrader"] = {"grade_id": EXERCISE}
    named = nbformat.v4.new_code_cell("def group_normalized_advantages(r):\n    pass")
    notebook = nbformat.v4.new_notebook(cells=[named, cell])
    assert grading.student_solution(notebook, EXERCISE) == cell.source
    notebook.cells = [named]
    assert grading.student_solution(notebook, EXERCISE) == named.source
    assert grading.student_solution(notebook, "03-missing") is None


def test_csv_columns_and_points(tmp_path):
    grade = grading.Grade("ann", NAME, EXERCISE, "fail", 0.0, 2.5, "a\nb")
    path = grading.write_grades_csv([grade], tmp_path / "out" / "g.csv")
    assert list(csv.reader(path.open())) == [
        list(grading.CSV_COLUMNS),
        ["ann", NAME, EXERCISE, "fail", "0", "2.5", "a\nb"],
    ]


BAD_GRADE_INVOCATIONS = {
    "missing folder": (["{tmp}/nowhere"], "submissions_dir must be a folder"),
    "no student folders": (["{tmp}/empty"], "must hold one folder per student"),
    "zero timeout": (["{tmp}/empty", "--timeout", "0"], "timeout must be a positive"),
}


@pytest.mark.parametrize("name", BAD_GRADE_INVOCATIONS)
def test_bad_grade_invocations_print_one_line_and_exit_2(name, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    argv, expected = BAD_GRADE_INVOCATIONS[name]
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    code = cli.main(["grade", *argv, "--out", str(tmp_path / "g.csv")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1
    assert lines[0].startswith("grpo-lab grade: ") and expected in lines[0]
    assert not (tmp_path / "g.csv").exists()


def test_the_solutions_key_is_current():
    from grpo_lab.teaching import solutions_key

    wanted = solutions_key.solutions_key(shipped_notebooks_dir(), load_rubric())
    assert solutions_key.KEY_PATH.read_text(encoding="utf-8") == wanted, (
        "run `python -m grpo_lab.teaching.solutions_key` to update docs/solutions.md"
    )


@pytest.mark.slow
def test_a_partly_wrong_submission_gets_the_points_of_its_right_exercises(tmp_path):
    """Notebook 06 has two exercises: a correct, a partly wrong and an untouched
    submission get every point, the first exercise's points, and none."""
    name = "06_loss_aggregation.ipynb"
    key = nbformat.read(shipped_notebooks_dir() / name, as_version=4)
    partly = nbformat.from_dict(key)
    loss_exercise = find_exercises(partly, name)[1]
    cell = partly.cells[loss_exercise.solution_index]
    clip = "torch.clamp(ratio, 1 - cliprange, 1 + cliprange)"
    assert clip in cell.source
    cell.source = cell.source.replace(clip, "ratio")  # forgets the clip
    root = tmp_path / "submitted"
    for student, notebook in (
        ("ann", key),
        ("ben", partly),
        ("cat", student_notebook(key, name)),
    ):
        (root / student).mkdir(parents=True)
        nbformat.write(notebook, root / student / name)
    out = tmp_path / "grades.csv"
    assert cli.main(["grade", str(root), "--out", str(out), "--timeout", "30"]) == 0
    rubric = load_rubric().exercises
    rows = [
        (r["student"], r["exercise"], r["outcome"], r["points"])
        for r in csv.DictReader(out.open())
    ]
    first, second = "06-aggregate_loss", "06-grpo_loss"
    assert rows == [
        ("ann", first, "pass", f"{rubric[first]:g}"),
        ("ann", second, "pass", f"{rubric[second]:g}"),
        ("ben", first, "pass", f"{rubric[first]:g}"),
        ("ben", second, "fail", "0"),
        ("cat", first, "not attempted", "0"),
        ("cat", second, "not attempted", "0"),
    ]
