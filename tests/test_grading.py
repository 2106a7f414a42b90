"""Tests for grpo_lab.instructor.grading and grpo_lab.instructor.rubric: `grpo-lab grade`."""

from __future__ import annotations

import csv
import errno
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import nbformat
import pytest

from grpo_lab.advantages import compute_group_normalized_rewards
from grpo_lab.cli import main as cli
from grpo_lab.instructor import grading
from grpo_lab.instructor.rubric import find_exercises, load_rubric, notebook_number
from grpo_lab.instructor.sandbox import fence_available
from grpo_lab.instructor.shipped_notebooks import shipped_notebooks_dir
from grpo_lab.instructor.student import student_notebook
from grpo_lab.instructor.tree_limits import tree_limits_note

NAME = "03_rewards_and_advantages.ipynb"
EXERCISE = "03-group_normalized_advantages"
CORRECT_LINE = "return (centered / (grouped.std(dim=1, keepdim=True) + advantage_eps))"
# Right but for all-equal groups (no eps: 0 / 0): 2 of the check's 4 cases.
HALF_DONE_LINE = "return (centered / grouped.std(dim=1, keepdim=True))"


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


def with_helper_cell(notebook) -> nbformat.NotebookNode:
    """The key, its spread computed by a helper defined in a new cell above."""
    copy = with_solution(
        notebook,
        CORRECT_LINE,
        "return (centered / spread_of(grouped, advantage_eps))",
    )
    (exercise,) = find_exercises(copy, NAME)
    helper = nbformat.v4.new_code_cell(
        "def spread_of(grouped, eps):\n"
        "    return grouped.std(dim=1, keepdim=True) + eps"
    )
    copy.cells.insert(exercise.solution_index, helper)
    return copy


def with_answer_below_the_stub(notebook) -> nbformat.NotebookNode:
    """The student copy, its stub kept and the key's answer in a new cell below."""
    copy = student_notebook(notebook, NAME)
    (exercise,) = find_exercises(notebook, NAME)
    answer = nbformat.v4.new_code_cell(notebook.cells[exercise.solution_index].source)
    stub_index = next(
        i
        for i, c in enumerate(copy.cells)
        if "def group_normalized_advantages" in c.source
    )
    copy.cells.insert(stub_index + 1, answer)
    return copy


def with_answer_below_the_check(notebook) -> nbformat.NotebookNode:
    """The student copy, its stub kept and the key's answer in a new cell below
    the check cell."""
    copy = student_notebook(notebook, NAME)
    (exercise,) = find_exercises(notebook, NAME)
    answer = nbformat.v4.new_code_cell(notebook.cells[exercise.solution_index].source)
    check = next(
        i
        for i, c in enumerate(copy.cells)
        if "check_group_normalized_advantages(group_normalized_advantages" in c.source
    )
    copy.cells.insert(check + 1, answer)
    return copy


def submit(root, student: str, notebook, name: str = NAME) -> None:
    (root / student).mkdir(parents=True, exist_ok=True)
    nbformat.write(notebook, root / student / name)


@pytest.mark.slow
def test_grade_reads_what_each_student_wrote(tmp_path, capsys):
    """Notebook 03 graded in two kernels at a time: a helper in another cell and
    an answer below the stub get every point, a half-done answer its share of
    the cases, and deleted or edited check cells change nothing."""
    key = course()
    root = tmp_path / "submitted"
    submit(root, "alice", without_checks(with_helper_cell(key), None))
    submit(
        root,
        "bob",
        without_checks(with_solution(key, CORRECT_LINE, HALF_DONE_LINE), "pass"),
    )
    submit(root, "carol", student_notebook(key, NAME))
    submit(root, "erin", with_answer_below_the_stub(key))
    submit(root, "gina", with_answer_below_the_check(key))
    endless = with_solution(
        key, "    grouped = raw", "    while True:\n        pass\n    grouped = raw"
    )
    submit(root, "frank", endless)
    (root / "frank" / "notes.ipynb").write_text("not a notebook")  # no number
    out = tmp_path / "grades.csv"
    argv = ["grade", str(root), "--out", str(out), "--timeout", "8", "-j", "2"]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    # Every written question is unanswered: not attempted, 0 points.
    summary = "18 grades (2 pass, 1 fail, 14 not attempted, 1 error, 0 manual)"
    assert summary in captured.out
    assert "grading" in captured.err  # the progress bar
    rows = list(csv.DictReader(out.open()))
    exercises = [r for r in rows if r["exercise"] == EXERCISE]
    table = [(r["student"], r["outcome"], r["points"]) for r in exercises]
    assert table == [
        ("alice", "pass", "3"),
        ("bob", "fail", "1.5"),
        ("carol", "not attempted", "0"),
        ("erin", "pass", "3"),
        ("frank", "error", "0"),
        ("gina", "not attempted", "0"),
    ]
    message = {r["student"]: r["message"] for r in exercises}
    below = with_answer_below_the_check(key)
    cell = next(
        i + 1
        for i, c in enumerate(below.cells)
        if c.source.startswith("def group_normalized_advantages")
        and "NotImplementedError" not in c.source
    )
    assert message["gina"].startswith(
        f"your answer is in cell {cell}, below the check: move it above"
    ), message["gina"]
    # The course check's counter-example, however bob's check cell was edited.
    assert message["bob"].startswith(
        "2 of 4 cases passed; a group whose rewards are all equal gives NaN"
    ), message
    assert message["carol"] == grading.NOTHING_WRITTEN
    assert message["frank"] == "ran past the time limit of 8 s"
    assert all(
        len(m) <= grading.MESSAGE_LIMIT and "\n" not in m for m in message.values()
    )
    assert float(next(r for r in exercises if r["student"] == "carol")["seconds"]) < 1
    rubric = load_rubric()
    questions = [r for r in rows if r["exercise"] in rubric.questions]
    assert {(r["student"], r["exercise"]) for r in questions} == {
        (s, q.question_id)
        for s in ("alice", "bob", "carol", "erin", "frank", "gina")
        for q in rubric.questions_of("03")
    }
    for row in questions:
        assert (row["outcome"], row["points"]) == ("not attempted", "0")
        assert row["message"] == grading.QUESTION_NOT_ANSWERED
        assert row["max_points"] == f"{rubric.questions[row['exercise']].points:g}"


def test_a_written_answer_is_graded_by_hand_and_an_untouched_one_gets_0(tmp_path):
    rubric = load_rubric()
    question = rubric.questions_of("03")[0]
    copy = student_notebook(course(), NAME)
    (cell,) = [c for c in copy.cells if grading.grade_id(c) == question.question_id]
    untouched = grading.question_grades("ann", Path(NAME), copy, rubric)
    cell.source = "The std makes the advantages scale-free within a group."
    answered = grading.question_grades("ann", Path(NAME), copy, rubric)
    first = {g.exercise_id: g for g in untouched}[question.question_id]
    assert (first.outcome, first.points) == ("not attempted", 0.0)
    second = {g.exercise_id: g for g in answered}[question.question_id]
    assert (second.outcome, second.message) == (
        "manual",
        "graded by hand: answered in 9 words",
    )


def test_an_untouched_notebook_is_graded_without_a_kernel(tmp_path, monkeypatch):
    """Every course notebook's student copy: each exercise "not attempted" and
    each written question a "manual" row, and no kernel started."""

    def no_kernel(*args, **kwargs):
        raise AssertionError("a kernel was started for an untouched notebook")

    monkeypatch.setattr(grading, "_Kernel", no_kernel)
    root = tmp_path / "submitted"
    paths = sorted(shipped_notebooks_dir().glob("[0-9][0-9]_*.ipynb"))
    for path in paths:
        notebook = nbformat.read(path, as_version=4)
        submit(root, "una", student_notebook(notebook, path.name), path.name)
    grades = grading.grade_submissions(root)
    rubric = load_rubric()
    exercises = [g for g in grades if g.exercise_id not in rubric.questions]
    assert {g.exercise_id for g in exercises} == set(rubric.exercises)
    assert {g.outcome for g in exercises} == {"not attempted"}
    questions = {
        g.exercise_id: g.max_points for g in grades if g.exercise_id in rubric.questions
    }
    assert questions == {q: rubric.questions[q].points for q in rubric.questions}
    assert all(
        (g.outcome, g.points, g.message)
        == ("not attempted", 0.0, grading.QUESTION_NOT_ANSWERED)
        for g in grades
        if g.exercise_id in rubric.questions
    )


def test_the_plan_runs_the_students_cells_above_each_check():
    key = course()
    (exercise,) = find_exercises(key, NAME)
    untouched = student_notebook(key, NAME)
    (plan,) = grading.plan_submission(key, [exercise], untouched)
    assert plan.cells == () and plan.solution == ""
    helper = with_helper_cell(key)
    (plan,) = grading.plan_submission(key, [exercise], helper)
    sources = [source for _, source in plan.cells]
    assert len(sources) == 2 and sources[0].startswith("def spread_of")
    assert plan.solution == sources[1]
    # The check's position: the edited check cell ("pass" is not run), or the end.
    edited = without_checks(helper, "pass")
    assert grading.plan_submission(key, [exercise], edited)[0].cells == plan.cells
    below = with_answer_below_the_stub(key)
    (plan,) = grading.plan_submission(key, [exercise], below)
    assert [s for _, s in plan.cells] == [key.cells[exercise.solution_index].source]
    # A cell written after the check is not run for it.
    late = nbformat.from_dict(untouched)
    late.cells.append(nbformat.v4.new_code_cell(plan.cells[0][1]))
    assert grading.plan_submission(key, [exercise], late)[0].cells == ()


def test_messages_are_one_short_line_with_the_named_mistake_first():
    message = (
        "For policy=tensor([[0.123456789, 2.0]]), cliprange=0.2:\n"
        "  expected 0.123456\n  got      0.654321, the value you get when the "
        "clip is left out\n  1 of 3 cases passed"
    )
    assert grading.short_message(message, 1, 3) == (
        "the clip is left out; 1 of 3 cases passed; expected 0.1235 got 0.6543 "
        "(for policy=tensor([[0.1235, 2.0]]), cliprange=0.2)"
    )
    hinted = "For x=1:\n  expected 2\n  got      3\n  hint: the mask is not applied"
    assert grading.short_message(hinted).startswith("the mask is not applied; ")
    long = grading.short_message("For x: expected " + "1.5, " * 200)
    assert len(long) == grading.MESSAGE_LIMIT and long.endswith("...")


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
        "cell 0 raised ZeroDivisionError: division by zero",
    )
    # An exception inside the student's function is a fail, with its message.
    assert grading.run_exercise("def double(x):\n    return [][x]", check, {}) == (
        "fail",
        "your function raised IndexError: list index out of range",
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
    grade = grading.Grade("ann", NAME, EXERCISE, "fail", 1.25, 2.5, "a", "", 3.14159)
    question = grading.Grade("ann", NAME, "03-q1", "manual", 0.0, 1.0, "b")
    path = grading.write_grades_csv([grade, question], tmp_path / "out" / "g.csv")
    assert list(csv.reader(path.open())) == [
        list(grading.CSV_COLUMNS),
        ["ann", NAME, EXERCISE, "fail", "1.25", "2.5", "3.1", "a", ""],
        ["ann", NAME, "03-q1", "manual", "", "1", "0.0", "b", ""],
    ]


OUT = ["--out", "{tmp}/g.csv"]
BAD_GRADE_INVOCATIONS = {
    "missing folder": (["{tmp}/nowhere", *OUT], "submissions_dir must be a folder"),
    "no student folders": (["{tmp}/empty", *OUT], "must hold one folder per student"),
    "zero jobs": (["{tmp}/class", "-j", "0", *OUT], "jobs must be a positive integer"),
    # Each refused before any kernel starts (a class with a written answer).
    "missing notebooks": (
        ["{tmp}/class", "--notebooks", "{tmp}/nope", *OUT],
        "notebooks_dir must be a folder of course notebooks",
    ),
    "notebooks without any": (
        ["{tmp}/class", "--notebooks", "{tmp}/empty", *OUT],
        "notebooks_dir must hold the course's NN_*.ipynb notebooks",
    ),
    **{
        f"{value} timeout": (
            ["{tmp}/class", "--timeout", value, *OUT],
            "timeout must be a positive, finite number of seconds",
        )
        for value in ("0", "-5", "inf", "nan", "1e300")
    },
    "out is a folder": (
        ["{tmp}/class", "--out", "{tmp}/empty"],
        "out must name a CSV file, got the folder",
    ),
    "out under a file": (
        ["{tmp}/class", "--out", "{tmp}/a_file/g.csv"],
        "out must be a file the grader can write",
    ),
}


@pytest.mark.parametrize("name", BAD_GRADE_INVOCATIONS)
def test_bad_grade_invocations_print_one_line_and_exit_2(
    name, tmp_path, capsys, monkeypatch
):
    def no_kernel(*args, **kwargs):
        raise AssertionError("a kernel was started for a refused invocation")

    monkeypatch.setattr(grading, "_Kernel", no_kernel)
    (tmp_path / "empty").mkdir()
    (tmp_path / "a_file").write_text("not a folder")
    submit(tmp_path / "class", "ann", with_helper_cell(course()))
    argv, expected = BAD_GRADE_INVOCATIONS[name]
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    code = cli.main(["grade", *argv])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("grpo-lab grade: ") and expected in lines[0], lines
    assert not (tmp_path / "g.csv").exists()
    assert [p.name for p in (tmp_path / "empty").iterdir()] == []


# --- one class, one table ------------------------------------------------------------


def _malformed(key, change) -> str:
    """A solved copy of ``key`` as JSON text, its solution cell given to
    ``change(cell)``."""
    (exercise,) = find_exercises(key, NAME)
    copy = json.loads(nbformat.writes(with_helper_cell(key)))
    change(copy["cells"][exercise.solution_index])
    return json.dumps(copy)


def _write(folder, name: str, text: str | bytes) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    data = text.encode() if isinstance(text, str) else text
    (folder / name).write_bytes(data)


def _malformed_class(root, outside) -> dict[str, str]:
    """One student per malformed notebook, beside two honest students; the
    message (or outcome) each malformed one's exercise must get."""
    key = course()
    submit(root, "honest_alice", with_helper_cell(key))
    submit(root, "honest_bob", student_notebook(key, NAME))
    untouched = nbformat.writes(student_notebook(key, NAME))
    clash = nbformat.from_dict(student_notebook(key, NAME))
    for cell in clash.cells:
        cell["id"] = "same"
    kinds = {
        "tags_not_a_list": (lambda c: c["metadata"].update(tags=5), "metadata.tags"),
        "tags_not_strings": (
            lambda c: c["metadata"].update(tags=[["x"]]),
            "metadata.tags",
        ),
        "metadata_not_a_dict": (lambda c: c.update(metadata=5), "metadata"),
        "nbgrader_not_a_dict": (
            lambda c: c["metadata"].update(nbgrader=5),
            "metadata.nbgrader",
        ),
        "grade_id_not_a_str": (
            lambda c: c["metadata"].update(nbgrader={"grade_id": 3}),
            "grade_id",
        ),
        "missing_source": (lambda c: c.pop("source"), "source"),
        "source_not_text": (lambda c: c.update(source=5), "source"),
        "cell_type_not_text": (lambda c: c.update(cell_type=5), "cell"),
    }
    expected = {}
    for student, (change, named) in kinds.items():
        _write(root / student, NAME, _malformed(key, change))
        expected[student] = named
    _write(root / "id_clash", NAME, json.dumps(clash))
    expected["id_clash"] = "not attempted"
    from nbformat import v3

    old_cells = [
        v3.new_code_cell(input=c.source)
        for c in student_notebook(key, NAME).cells
        if c.cell_type == "code"
    ]
    old = v3.new_notebook(worksheets=[v3.new_worksheet(cells=old_cells)])
    _write(root / "nbformat_3", NAME, v3.writes_json(old))  # upgraded on reading
    expected["nbformat_3"] = "not attempted"
    _write(root / "invalid_json", NAME, '{"cells": [')
    expected["invalid_json"] = "cannot be read"
    _write(root / "not_utf8", NAME, b"\xff\xfe" + untouched.encode())
    expected["not_utf8"] = "cannot be read"
    big = root / "huge" / NAME
    big.parent.mkdir()
    with open(big, "wb") as handle:  # 100 MB, sparse: no disk is spent
        handle.truncate(100 << 20)
    expected["huge"] = "larger than"
    _write(root / "path_tricks", "03_..\n-- ; rm -rf ~.ipynb", untouched)
    _write(root / "path_tricks_bytes", os.fsdecode(b"03_\xff\x1b[31m.ipynb"), untouched)
    expected["path_tricks"] = expected["path_tricks_bytes"] = "not attempted"
    # A link to a solved notebook outside the class: never read through.
    nbformat.write(with_helper_cell(key), outside)
    (root / "linked").mkdir()
    (root / "linked" / NAME).symlink_to(outside)
    expected["linked"] = f"{NAME} is a symbolic link"
    (root / "piped").mkdir()
    os.mkfifo(root / "piped" / NAME)  # opening it to read would wait forever
    expected["piped"] = "not a plain file"
    return expected


@pytest.mark.slow
def test_one_malformed_notebook_of_each_kind_leaves_the_class_graded(tmp_path, capsys):
    """Every other student is graded, each malformed notebook's exercise is an
    error with a one-line message (or, where nbformat mends it, graded), the
    CSV is written and grading exits 0."""
    root, outside = tmp_path / "class", tmp_path / "elsewhere.ipynb"
    expected = _malformed_class(root, outside)
    out = tmp_path / "grades.csv"
    argv = ["grade", str(root), "--out", str(out), "--timeout", "30", "-j", "2"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert f"note: {tree_limits_note(grading.MEMORY_BYTES)}" in printed
    rows = [r for r in csv.DictReader(out.open()) if r["exercise"] == EXERCISE]
    found = {r["student"]: r for r in rows}
    assert set(found) == {"honest_alice", "honest_bob", *expected}
    assert (found["honest_alice"]["outcome"], found["honest_alice"]["points"]) == (
        "pass",
        "3",
    )
    assert found["honest_bob"]["outcome"] == "not attempted"
    for student, named in expected.items():
        row = found[student]
        assert row["points"] == "0", row
        if named == "not attempted":
            assert row["outcome"] == "not attempted", row
            continue
        assert row["outcome"] == "error" and named in row["message"], row
        assert "\n" not in row["message"] and len(row["message"]) <= 200, row
    assert "elsewhere" not in out.read_text()  # the link's target was not named
    questions = {q.question_id for q in load_rubric().questions_of("03")}
    asked = [r for r in csv.DictReader(out.open()) if r["exercise"] in questions]
    assert len(asked) == len(found) * len(questions)  # every student's questions


def test_the_solutions_key_is_generated_with_every_exercise_and_answer(tmp_path):
    from grpo_lab.instructor import solutions_key

    out = tmp_path / "solutions.md"
    assert solutions_key.main([str(out)]) == 0
    text = out.read_text(encoding="utf-8")
    answers = shipped_notebooks_dir() / "model_answers.toml"
    rubric = load_rubric(answers=answers)
    for exercise_id in rubric.exercises:
        assert f"### Exercise `{exercise_id}`" in text
    for question in rubric.questions.values():
        assert question.answer and question.answer in text


def test_the_solutions_key_is_not_in_the_repository():
    import subprocess

    tracked = subprocess.run(
        ["git", "ls-files", "docs"],
        capture_output=True,
        text=True,
        cwd=shipped_notebooks_dir().parent,
    )
    if tracked.returncode != 0:
        pytest.skip("not a git checkout")
    assert "docs/solutions.md" not in tracked.stdout.split()


@pytest.mark.slow
def test_a_partly_wrong_submission_gets_the_points_of_its_right_exercises(tmp_path):
    """Notebook 06 has two exercises: a correct, a partly wrong and an untouched
    submission get every point, the first exercise's points (and the share of
    the second's cases that the unclipped loss passes), and none."""
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
        submit(root, student, notebook, name)
    out = tmp_path / "grades.csv"
    argv = ["grade", str(root), "--out", str(out), "--timeout", "30", "-j", "2"]
    assert cli.main(argv) == 0
    rubric = load_rubric()
    rows = [r for r in csv.DictReader(out.open()) if r["exercise"] in rubric.exercises]
    table = [(r["student"], r["exercise"], r["outcome"], r["points"]) for r in rows]
    first, second = "06-aggregate_loss", "06-grpo_loss"
    full = {e: f"{rubric.exercises[e]:g}" for e in (first, second)}
    ben_second = rows[3]
    assert table[:3] + table[4:] == [
        ("ann", first, "pass", full[first]),
        ("ann", second, "pass", full[second]),
        ("ben", first, "pass", full[first]),
        ("cat", first, "not attempted", "0"),
        ("cat", second, "not attempted", "0"),
    ]
    assert (ben_second["student"], ben_second["outcome"]) == ("ben", "fail")
    assert ben_second["message"].startswith("the clip is left out; "), ben_second
    counted = re.search(r"(\d+) of (\d+) cases passed", ben_second["message"])
    passed, run = int(counted.group(1)), int(counted.group(2))
    assert second in rubric.partial_credit and passed < run
    expected = round(rubric.exercises[second] * passed / run, 2)
    assert float(ben_second["points"]) == expected


# --- a grader students cannot fool ---------------------------------------------------
#
# A course notebook of one context cell and one exercise per attack, each checked by
# notebook 03's check; the submission answers every exercise with a wrong function
# plus one trick (or, for the controls, a right one). One kernel grades them all,
# replaced after each trick the guard catches.

ATTACK_NOTEBOOK = "03_attacks.ipynb"
# Every body starts from the batch's raw rewards, graded as notebook 03 grades.
REWARDS = (
    "    import torch\n"
    "    from grpo_lab.rewards import exact_match_reward\n"
    "    raw_rewards = torch.tensor([\n"
    "        exact_match_reward(r, ground_truths[i // group_size])['reward']\n"
    "        for i, r in enumerate(responses)])\n"
)
# The course's solution in the graders' kits: one group at a time.
KIT_BODY = REWARDS + (
    "    advantages = []\n"
    "    for start in range(0, len(raw_rewards), group_size):\n"
    "        group = raw_rewards[start:start + group_size]\n"
    "        advantages.append((group - group.mean()) / (group.std() + advantage_eps))\n"
    "    return torch.cat(advantages)\n"
)
# A right answer of the students' own, no copy of the kit's: the batch reshaped.
RIGHT_BODY = REWARDS + (
    "    grouped = raw_rewards.reshape(-1, group_size)  # (B, G)\n"
    "    centered = grouped - grouped.mean(dim=1, keepdim=True)\n"
    "    spread = grouped.std(dim=1, keepdim=True) + advantage_eps\n"
    "    return (centered / spread).flatten()\n"
)
WRONG_BODY = REWARDS + "    return raw_rewards - raw_rewards.mean()\n"
SIGNATURE = "(responses, ground_truths, group_size, advantage_eps)"


def _answer(name: str, before: str = "", body: str = WRONG_BODY) -> str:
    return f"{before}\ndef {name}{SIGNATURE}:\n{body}"


ATTACKS = {
    "printed_line": _answer(
        "printed_line",
        'print(\'GRPO_LAB_GRADE ["pass", ""]\')\nprint(\'[1, "pass", ""]\')',
    ),
    "fd_one": _answer(
        "fd_one",
        "import os\nfor n in range(1, 9):\n"
        '    os.write(1, f\'[{n}, "pass", ""]\\n\'.encode())\n'
        '    os.write(2, f\'[{n}, "pass", ""]\\n\'.encode())',
    ),
    "patched_check": _answer(
        "patched_check",
        "import grpo_lab.teaching.checks.advantages as advantage_checks\n"
        "advantage_checks.check_group_normalized_advantages = lambda fn: True",
    ),
    "patched_torch": _answer(
        "patched_torch",
        "import torch, torch.testing\n"
        "torch.allclose = torch.equal = lambda *a, **k: True\n"
        "torch.isclose = lambda a, b, **k: torch.ones_like(a, dtype=torch.bool)\n"
        "torch.testing.assert_close = lambda *a, **k: None",
    ),
    "patched_in_call": _answer(
        "patched_in_call",
        body="    import torch\n    torch.allclose = lambda *a, **k: True\n"
        + WRONG_BODY,
    ),
    "patched_json": _answer(
        "patched_json",
        'import json\njson.dumps = lambda *a, **k: \'[1, "pass", ""]\'',
    ),
    "patched_code": _answer(
        "patched_code",
        "from grpo_lab.teaching.checks import framework\n"
        "framework.assert_close.__code__ = (lambda *a, **k: None).__code__",
    ),
    "channel_forged": _answer(
        "channel_forged",
        "import os\nfor fd in os.listdir('/proc/self/fd'):\n"
        "    if 'grpo-lab-results' in os.path.realpath(f'/proc/self/fd/{fd}'):\n"
        "        for n in range(1, 30):\n"
        '            os.write(int(fd), f\'[{n}, "pass", ""]\\n\'.encode())',
    ),
    "lying_tensor": _answer(
        "lying_tensor",
        "import torch\nclass Liar(torch.Tensor):\n"
        "    @classmethod\n"
        "    def __torch_function__(cls, func, types, args=(), kwargs=None):\n"
        "        return True",
        body=REWARDS + "    return (raw_rewards * 0).as_subclass(Liar)\n",
    ),
    "function_mode": _answer(
        "function_mode",
        "import torch\nfrom torch.overrides import TorchFunctionMode\n"
        "class Yes(TorchFunctionMode):\n"
        "    def __torch_function__(self, func, types, args=(), kwargs=None):\n"
        "        if func is torch.allclose:\n"
        "            return True\n"
        "        return func(*args, **(kwargs or {}))\n"
        "Yes().__enter__()",
    ),
    # 8 GiB in one allocation, which a 24 GiB machine grants: only RLIMIT_AS
    # (4 GiB) refuses it, at once (no page is touched first).
    "memory_bomb": _answer(
        "memory_bomb",
        body="    hog = bytearray(8 << 30)\n" + WRONG_BODY,
    ),
    # The grading kernel's own secrets, reached from the solution's process:
    # a fresh record after patching the check, so that nothing looks changed;
    # a wrapped channel writer that turns "fail" into "pass"; the guard's
    # comparison replaced, then torch's; the secrets found through the garbage
    # collector, without naming the grader's module.
    "record_rewritten": _answer(
        "record_rewritten",
        "import grpo_lab.instructor.grading_kernel as gk\n"
        "import grpo_lab.teaching.checks.advantages as advantage_checks\n"
        "advantage_checks.check_group_normalized_advantages = lambda fn: True\n"
        "fresh = gk._record()  # the hidden counterparts as they were, stubs aside\n"
        "fresh['functions'] = gk._state['record']['functions']\n"
        "gk._state['record'] = fresh",
    ),
    "write_wrapped": _answer(
        "write_wrapped",
        "import grpo_lab.instructor.grading_kernel as gk\n"
        "_write = gk._state['write']\n"
        "gk._state['write'] = lambda fd, data: _write(\n"
        "    fd, data.replace(b'\"fail\"', b'\"pass\"'))",
    ),
    "changes_code": _answer(
        "changes_code",
        "import torch\n"
        "import grpo_lab.instructor.grading_kernel as gk\n"
        "gk._changes.__code__ = (lambda record: []).__code__\n"
        "torch.allclose = lambda *a, **k: True",
    ),
    "gc_secrets": _answer(
        "gc_secrets",
        "import gc\n"
        "import grpo_lab.teaching.checks.advantages as advantage_checks\n"
        "advantage_checks.check_group_normalized_advantages = lambda fn: True\n"
        "for found in gc.get_objects():\n"
        "    if type(found) is dict and 'record' in found and 'channel' in found:\n"
        "        recorded = found['record']['namespaces']\n"
        "        recorded['grpo_lab.teaching.checks.advantages'].update(\n"
        "            vars(advantage_checks))",
    ),
    # A cell that raises before its def leaves the course's own function, which
    # the context defined for the exercises that call it: not an answer.
    "raises_before_its_def": _answer(
        "raises_before_its_def",
        "raise RuntimeError('the answer is never defined')",
        body=RIGHT_BODY,
    ),
    # The solution's process ends in the middle of a call: an error, never a
    # pass (the next exercise gets a fresh kernel).
    "child_exits": _answer("child_exits", "import os", "    os._exit(0)\n"),
    "by_getattr": _answer(
        "by_getattr",
        "import importlib",
        REWARDS + "    module = importlib.import_module('grpo_lab.' + 'advantages')\n"
        "    fn = getattr(module, 'compute_group' + '_normalized_rewards')\n"
        "    return fn(raw_rewards, group_size, 'mean', advantage_eps, 'std')[0]\n",
    ),
    "by_sys_modules": _answer(
        "by_sys_modules",
        "import sys\nsaved = sys.modules['grpo_lab.advantages'].__dict__["
        "'compute_group_normalized_rewards']",
        REWARDS
        + "    return saved(raw_rewards, group_size, 'mean', advantage_eps, 'std')[0]\n",
    ),
    "by_alias": "from grpo_lab.advantages import compute_group_normalized_rewards\n"
    "import functools\nby_alias = functools.partial(\n"
    "    compute_group_normalized_rewards, baseline='mean')\n",
    "own_helper_named_like_the_package": (
        "def compute_group_normalized_rewards" + SIGNATURE + ":\n" + RIGHT_BODY + "\n\n"
        "def own_helper_named_like_the_package" + SIGNATURE + ":\n"
        "    # unlike grpo_lab.advantages.compute_group_normalized_rewards(...)\n"
        "    '''Not compute_group_normalized_rewards(raw_rewards, 4).'''\n"
        "    return compute_group_normalized_rewards(responses, ground_truths, "
        "group_size, advantage_eps)\n"
    ),
    "by_dunder_import": _answer(
        "by_dunder_import",
        body=REWARDS
        + "    module = __import__('grpo_lab.' + 'advantages', fromlist=['_'])\n"
        "    fn = getattr(module, 'compute_group' + '_normalized_rewards')\n"
        "    return fn(raw_rewards, group_size, 'mean', advantage_eps, 'std')[0]\n",
    ),
    "by_private_helper": _answer(
        "by_private_helper",
        "from grpo_lab.advantages import _group_advantages",
        REWARDS + "    grouped = raw_rewards.reshape(-1, group_size)\n"
        "    return _group_advantages(grouped, 'mean', advantage_eps, 'std').flatten()\n",
    ),
    # The package's source pasted under another name, beside its module's names.
    "pasted_source": (
        "from grpo_lab import advantages as _package\n"
        "globals().update({k: v for k, v in vars(_package).items() if k[:2] != '__'})\n"
        + inspect.getsource(compute_group_normalized_rewards).replace(
            "compute_group_normalized_rewards", "_pasted"
        )
        + _answer(
            "pasted_source",
            body="    rewards = batch_rewards(responses, ground_truths, group_size)\n"
            "    return _pasted(rewards, group_size, 'mean', advantage_eps)[0]\n",
        )
    ),
    # Another package function that computes the answer on the way.
    "another_package_function": _answer(
        "another_package_function",
        "from grpo_lab.rewards import exact_match_reward\n"
        "from grpo_lab.train_step import rollout_advantages",
        "    truths = [t for t in ground_truths for _ in range(group_size)]\n"
        "    return rollout_advantages(exact_match_reward, responses, truths,\n"
        "        group_size, advantage_eps=advantage_eps)[1]\n",
    ),
    "comment_names_the_package": _answer(
        "comment_names_the_package",
        "# grpo_lab.advantages.compute_group_normalized_rewards(raw_rewards, 4) is\n"
        "# the package's version; this one is mine.",
        "    # not compute_group_normalized_rewards(raw_rewards, group_size)\n"
        + RIGHT_BODY,
    ),
    "docstring_names_the_package": _answer(
        "docstring_names_the_package",
        body='    """Like grpo_lab.advantages.compute_group_normalized_rewards(\n'
        '    raw_rewards, group_size, \'mean\', advantage_eps), written again."""\n'
        + RIGHT_BODY,
    ),
    "right": _answer("right", body=RIGHT_BODY),
    # What the student wrote counts: a helper in a cell above the answer, and an
    # answer in a new cell below the untouched stub.
    "helper_elsewhere": (
        "def group_spread(grouped, eps):\n    return grouped.std(dim=1, keepdim=True) + eps",
        _answer(
            "helper_elsewhere",
            body=RIGHT_BODY.replace(
                "grouped.std(dim=1, keepdim=True) + advantage_eps",
                "group_spread(grouped, advantage_eps)",
            ),
        ),
    ),
    "new_cell": (
        _answer("new_cell", body="    raise NotImplementedError()\n"),
        _answer("new_cell", body=RIGHT_BODY),
    ),
    # Group size hard-coded to 4: two cases pass, the third raises in the
    # student's function (a fail with its message, and partial credit).
    "raises_inside": _answer(
        "raises_inside", body=RIGHT_BODY.replace("(-1, group_size)", "(-1, 4)")
    ),
    # Right, and fails should the grader's token have reached the kernel.
    "token_free": _answer(
        "token_free",
        "import os",
        "    assert 'HF_TOKEN' not in os.environ, os.environ['HF_TOKEN']\n"
        + RIGHT_BODY,
    ),
}
CLIP_SIGNATURE = "(advantages, policy_log_probs, old_log_probs, cliprange)"
CLIP_RIGHT_BODY = (
    "    ratio = torch.exp(policy_log_probs - old_log_probs)  # (B, T)\n"
    "    advantages = advantages.unsqueeze(-1)  # (B, 1)\n"
    "    clipped = torch.clamp(ratio, 1 - cliprange, 1 + cliprange)\n"
    "    return -torch.minimum(ratio * advantages, clipped * advantages)\n"
)
STEP_SIGNATURE = (
    "(model, optimizer, batch, advantages, gradient_accumulation_steps, max_grad_norm)"
)
STEP_RIGHT_BODY = (
    "    batch_size = advantages.shape[0]\n"
    "    microbatch_size = -(-batch_size // gradient_accumulation_steps)\n"
    "    optimizer.zero_grad(set_to_none=True)\n"
    "    for rows in torch.arange(batch_size).split(microbatch_size):\n"
    "        loss = microbatch_loss(model, batch, advantages, rows)\n"
    "        scale = microbatch_loss_scale(len(rows), batch_size, 'sequence')\n"
    "        (loss * scale).backward()\n"
    "    if max_grad_norm is not None:\n"
    "        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)\n"
    "    optimizer.step()\n"
)
# A student's own helper that shares a package function's name.
OWN_MICROBATCH_LOSS = (
    "def microbatch_loss(model, batch, advantages, rows):\n"
    "    log_probs = get_response_log_probs(\n"
    "        model, batch['input_ids'][rows], batch['labels'][rows])['log_probs']\n"
    "    per_token_loss = -advantages[rows].unsqueeze(-1) * log_probs  # (b, T)\n"
    "    return masked_mean(per_token_loss, batch['response_mask'][rows], dim=1).mean()\n"
)
CORRECTED_SIGNATURE = (
    "(policy_log_probs, old_log_probs, sampler_log_probs, advantages, "
    "response_mask, cliprange, low, high)"
)
OWN_CORRECTION_WEIGHTS = (
    "def correction_weights(old_log_probs, sampler_log_probs, response_mask, low, high):\n"
    "    response = response_mask.bool()  # (B, T)\n"
    "    log_gap = torch.where(response, old_log_probs - sampler_log_probs, 0.0)\n"
    "    rho = torch.exp(log_gap.sum(dim=1, keepdim=True))  # (B, 1)\n"
    "    return torch.where((rho >= low) & (rho <= high), rho, 0.0).detach()\n"
)
CORRECTED_RIGHT_BODY = (
    "    weight = correction_weights(\n"
    "        old_log_probs, sampler_log_probs, response_mask, low, high)  # (B, 1)\n"
    "    ratio = torch.exp(policy_log_probs - old_log_probs)  # (B, T)\n"
    "    advantages = advantages.unsqueeze(-1)  # (B, 1)\n"
    "    clipped = torch.clamp(ratio, 1 - cliprange, 1 + cliprange)\n"
    "    loss = -torch.minimum(ratio * advantages, clipped * advantages) * weight\n"
    "    per_response = (loss * response_mask).sum(1) / response_mask.sum(1)  # (B,)\n"
    "    return per_response.mean()\n"
)
RESPONSE_SIGNATURE = "(logits, labels, response_mask)"
RESPONSE_RIGHT_BODY = (
    "    logits = logits.float()\n"
    "    picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)  # (B, T)\n"
    "    token = picked - torch.logsumexp(logits, dim=-1)  # (B, T)\n"
    "    return (token * response_mask).sum(dim=-1)  # (B,)\n"
)
LOSSES_SIGNATURE = (
    "(per_token_loss, response_mask, gradient_accumulation_steps, "
    "loss_normalization, normalization_constant=None)"
)
LOSSES_RIGHT_BODY = (
    "    batch_size = per_token_loss.shape[0]\n"
    "    size = -(-batch_size // gradient_accumulation_steps)\n"
    "    losses = []\n"
    "    for rows in torch.arange(batch_size).split(size):\n"
    "        loss, mask = per_token_loss[rows] * response_mask[rows], response_mask[rows]\n"
    "        if loss_normalization == 'sequence':\n"
    "            mean = (loss.sum(1) / mask.sum(1)).mean()\n"
    "            losses.append(mean * len(rows) / batch_size)\n"
    "        elif loss_normalization == 'token':\n"
    "            losses.append(loss.sum() / response_mask.sum())\n"
    "        else:\n"
    "            losses.append(loss.sum() / normalization_constant)\n"
    "    return losses\n"
)
# Exercises checked by other checks than notebook 03's: (check module, check,
# signature, the course's solution body, the submitted answer).
CHECKED_BY = {
    "by_private_clip": (
        "losses", "check_clipped_loss", CLIP_SIGNATURE, CLIP_RIGHT_BODY,
        "from grpo_lab import losses\n"
        f"def by_private_clip{CLIP_SIGNATURE}:\n"
        "    options = losses.ObjectiveOptions(cliprange=cliprange)\n"
        "    return losses.grpo_clip_loss(advantages.unsqueeze(-1), policy_log_probs,\n"
        "        old_log_probs, torch.ones_like(policy_log_probs, dtype=torch.bool),\n"
        "        options)[0]\n",
    ),
    "by_objectives_registry": (
        "losses", "check_clipped_loss", CLIP_SIGNATURE, CLIP_RIGHT_BODY,
        "from grpo_lab.losses import OBJECTIVES, ObjectiveOptions\n"
        f"def by_objectives_registry{CLIP_SIGNATURE}:\n"
        "    options = ObjectiveOptions(cliprange=cliprange)\n"
        "    return OBJECTIVES['grpo'](advantages.unsqueeze(-1), policy_log_probs,\n"
        "        old_log_probs, torch.ones_like(policy_log_probs, dtype=torch.bool),\n"
        "        options)[0]\n",
    ),
    "right_clip": (
        "losses", "check_clipped_loss", CLIP_SIGNATURE, CLIP_RIGHT_BODY,
        f"def right_clip{CLIP_SIGNATURE}:\n" + CLIP_RIGHT_BODY,
    ),
    "by_accumulate_gradients": (
        "train_step", "check_microbatch_train_step", STEP_SIGNATURE,
        STEP_RIGHT_BODY,
        "import grpo_lab.train_step as steps\n"
        f"def by_accumulate_gradients{STEP_SIGNATURE}:\n"
        "    batch_size = advantages.shape[0]\n"
        "    optimizer.zero_grad(set_to_none=True)\n"
        "    settings = steps.UpdateSettings()\n"
        "    accumulator = steps.DiagnosticAccumulator(next(model.parameters()).device)\n"
        "    size = -(-batch_size // gradient_accumulation_steps)\n"
        "    for rows in torch.arange(batch_size).split(size):\n"
        "        part = {key: batch[key][rows] for key in batch}\n"
        "        part['advantages'] = advantages[rows]\n"
        "        scored = steps.score_tokens(model, part, settings,\n"
        "            return_token_entropy=True)\n"
        "        loss, notes = steps.microbatch_loss(scored['log_probs'],\n"
        "            scored['token_entropy'], part, settings)\n"
        "        steps.backward_microbatch(loss * rows.numel() / batch_size, scored,\n"
        "            part, notes, accumulator)\n"
        "    if max_grad_norm is not None:\n"
        "        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)\n"
        "    optimizer.step()\n",
    ),
    "own_microbatch_loss": (
        "train_step", "check_microbatch_train_step", STEP_SIGNATURE,
        STEP_RIGHT_BODY,
        OWN_MICROBATCH_LOSS + f"\n\ndef own_microbatch_loss{STEP_SIGNATURE}:\n"
        + STEP_RIGHT_BODY,
    ),
    "by_hidden_scoring": (
        "logprobs", "check_response_log_probs", RESPONSE_SIGNATURE,
        RESPONSE_RIGHT_BODY,
        "import importlib\n"
        f"def by_hidden_scoring{RESPONSE_SIGNATURE}:\n"
        "    checks = importlib.import_module('grpo_lab.teaching.checks.' + 'logprobs')\n"
        "    score = getattr(checks, 'reference_token' + '_log_probs')\n"
        "    return (score(logits, labels) * response_mask).sum(dim=-1)\n",
    ),
    "by_hidden_scale": (
        "train_step", "check_microbatch_losses", LOSSES_SIGNATURE, LOSSES_RIGHT_BODY,
        "import importlib\n"
        f"def by_hidden_scale{LOSSES_SIGNATURE}:\n"
        "    losses = importlib.import_module('grpo_lab.' + 'aggregation')\n"
        "    scale = getattr(losses, 'microbatch' + '_loss_scale')\n"
        "    reduce = getattr(losses, 'aggregate_loss' + '_across_microbatch')\n"
        "    batch_size, tokens = per_token_loss.shape[0], int(response_mask.sum())\n"
        "    size = -(-batch_size // gradient_accumulation_steps)\n"
        "    found = []\n"
        "    for rows in torch.arange(batch_size).split(size):\n"
        "        mask = response_mask[rows]\n"
        "        loss = reduce(per_token_loss[rows], mask, loss_normalization,\n"
        "            normalization_constant)\n"
        "        found.append(loss * scale(loss_normalization, len(rows), batch_size,\n"
        "            microbatch_tokens=int(mask.sum()), batch_tokens=tokens))\n"
        "    return found\n",
    ),
    "right_losses": (
        "train_step", "check_microbatch_losses", LOSSES_SIGNATURE, LOSSES_RIGHT_BODY,
        f"def right_losses{LOSSES_SIGNATURE}:\n" + LOSSES_RIGHT_BODY,
    ),
    "own_correction_weights": (
        "mismatch", "check_corrected_loss", CORRECTED_SIGNATURE,
        CORRECTED_RIGHT_BODY,
        OWN_CORRECTION_WEIGHTS
        + f"\n\ndef own_correction_weights{CORRECTED_SIGNATURE}:\n"
        + CORRECTED_RIGHT_BODY,
    ),
}  # fmt: skip
ATTACKS.update({name: entry[-1] for name, entry in CHECKED_BY.items()})
# The exercises whose answer is right: they alone may pass.
RIGHT_ANSWERS = {
    "right",
    "own_helper_named_like_the_package",
    "token_free",
    "comment_names_the_package",
    "docstring_names_the_package",
    "right_clip",
    "right_losses",
    "own_microbatch_loss",
    "own_correction_weights",
    "helper_elsewhere",
    "new_cell",
}
PARTIAL_CREDIT = {"raises_inside"}
# Disguised calls of the package: each would pass were the package reachable.
DISGUISED_CALLS = (
    "by_getattr",
    "by_sys_modules",
    "by_dunder_import",
    "by_private_helper",
    "pasted_source",
    "another_package_function",
    "by_private_clip",
    "by_objectives_registry",
    "by_accumulate_gradients",
    "by_hidden_scoring",
    "by_hidden_scale",
)
# The course context every exercise of the attack notebook may use. As in
# notebook 07, a GradientRecorder is built before any check: torch patches an
# optimizer class's `step` the first time one is built, which the guard would
# otherwise take for the solution's doing.
ATTACK_CONTEXT = (
    "import torch\n"
    "from grpo_lab.teaching.gradient_recorder import GradientRecorder\n"
    "GradientRecorder(torch.nn.Linear(1, 1).parameters())\n"
    "from grpo_lab.logprobs import get_response_log_probs\n"
    "from grpo_lab.masks import masked_mean\n"
    "\n"
    "def microbatch_loss_scale(microbatch_rows, batch_size, loss_normalization):\n"
    "    return microbatch_rows / batch_size if loss_normalization == 'sequence' else 1.0\n"
    "\n"
    "def batch_rewards(responses, ground_truths, group_size):\n"
    "    from grpo_lab.rewards import exact_match_reward\n"
    "    truths = [t for t in ground_truths for _ in range(group_size)]\n"
    "    return torch.tensor([exact_match_reward(r, t)['reward']\n"
    "                         for r, t in zip(responses, truths)])\n"
)


def attack_course(folder) -> tuple:
    """A course notebook with one exercise per attack, and its rubric."""
    from grpo_lab.instructor.rubric import Rubric

    cells = [nbformat.v4.new_code_cell(ATTACK_CONTEXT)]
    helpers = {
        "own_microbatch_loss": OWN_MICROBATCH_LOSS,
        "own_correction_weights": OWN_CORRECTION_WEIGHTS,
    }
    for name in ATTACKS:
        module, check_name, signature, body = CHECKED_BY.get(
            name,
            ("advantages", "check_group_normalized_advantages", SIGNATURE, KIT_BODY),
        )[:4]
        # The exercise's function first: the first def names the exercise.
        solution = f"def {name}{signature}:\n    ### BEGIN SOLUTION\n{body}"
        solution += "    ### END SOLUTION\n\n\n" + helpers.get(name, "")
        check = (
            f"from grpo_lab.teaching.checks.{module} import {check_name}\n\n"
            f"{check_name}({name});"
        )
        cells += [nbformat.v4.new_code_cell(solution), nbformat.v4.new_code_cell(check)]
    folder.mkdir(parents=True, exist_ok=True)
    nbformat.write(nbformat.v4.new_notebook(cells=cells), folder / ATTACK_NOTEBOOK)
    partial = frozenset(f"03-{name}" for name in PARTIAL_CREDIT)
    rubric = Rubric({f"03-{name}": 1.0 for name in ATTACKS}, {}, partial)
    return folder, rubric


def attack_submission(
    answers: dict[str, str | tuple[str, str]],
) -> nbformat.NotebookNode:
    """One cell per answer, with the exercise's grade_id; for a pair, the first
    cell is the helper cell above the answer, or the stub above it."""
    cells = []
    for name, source in answers.items():
        first, answer = source if isinstance(source, tuple) else ("", source)
        solution = nbformat.v4.new_code_cell(first or answer)
        solution.metadata["nbgrader"] = {"grade_id": f"03-{name}"}
        helper = nbformat.v4.new_code_cell(first)
        if not first:
            cells.append(solution)
        elif "NotImplementedError" in first:  # the stub, then the answer
            cells += [solution, nbformat.v4.new_code_cell(answer)]
        else:  # the helper, then the answer
            solution.source = answer
            cells += [helper, solution]
    return nbformat.v4.new_notebook(cells=cells)


@pytest.fixture(scope="module")
def attack_grades(tmp_path_factory):
    root = tmp_path_factory.mktemp("attacks")
    course_dir, rubric = attack_course(root / "course")
    (root / "submitted" / "eve").mkdir(parents=True)
    nbformat.write(
        attack_submission(ATTACKS), root / "submitted" / "eve" / ATTACK_NOTEBOOK
    )
    token = os.environ.get("HF_TOKEN")
    os.environ["HF_TOKEN"] = "hf_not_for_students"
    try:
        grades = grading.grade_submissions(
            root / "submitted", notebooks_dir=course_dir, rubric=rubric, timeout=20
        )
    finally:
        if token is None:
            del os.environ["HF_TOKEN"]
        else:
            os.environ["HF_TOKEN"] = token
    return {g.exercise_id.split("-", 1)[1]: g for g in grades}


@pytest.mark.slow
@pytest.mark.parametrize(
    "attack", sorted(set(ATTACKS) - RIGHT_ANSWERS - PARTIAL_CREDIT)
)
def test_a_wrong_answer_with_a_trick_gets_no_points(attack, attack_grades):
    grade = attack_grades[attack]
    assert grade.outcome != "pass" and grade.points == 0, grade


@pytest.mark.slow
@pytest.mark.parametrize("attack", sorted(RIGHT_ANSWERS))
def test_a_right_answer_passes_beside_the_attacks(attack, attack_grades):
    assert attack_grades[attack].outcome == "pass", attack_grades[attack]


@pytest.mark.slow
def test_an_exception_in_the_students_function_fails_with_partial_credit(
    attack_grades,
):
    grade = attack_grades["raises_inside"]
    assert (grade.outcome, grade.points) == ("fail", 0.5), grade
    assert grade.message.startswith(
        "2 of 4 cases passed; your function raised RuntimeError: shape '[-1, 4]'"
    ), grade


EXPECTED_MESSAGES = {
    "patched_check": grading.TAMPERED_PREFIX,
    "patched_torch": "torch.allclose",
    "patched_in_call": "torch.allclose",
    "patched_json": "json.dumps",
    "patched_code": "the code of grpo_lab.teaching.checks.framework.assert_close",
    # The solution's process may not even look for the channel in /proc.
    "channel_forged": "Permission denied: '/proc/self/fd'",
    "lying_tensor": "must be built of tensors",
    "function_mode": "a torch function mode",
    "memory_bomb": "MemoryError",
    "child_exits": "the solution's process was lost",
    "by_getattr": "not available while this exercise is graded",
    "by_sys_modules": "not available while this exercise is graded",
    "by_alias": "write it yourself",
    **{name: "not available while this exercise is graded" for name in DISGUISED_CALLS},
}


@pytest.mark.slow
@pytest.mark.parametrize("attack", sorted(EXPECTED_MESSAGES))
def test_each_trick_is_named_in_the_message(attack, attack_grades):
    assert EXPECTED_MESSAGES[attack] in attack_grades[attack].message


@pytest.mark.slow
def test_the_pasted_source_is_flagged_and_the_own_answers_are_not(attack_grades):
    flagged = {name: grade.flag for name, grade in attack_grades.items() if grade.flag}
    # right_losses is the course's own solution, word for word.
    assert set(flagged) == {"pasted_source", "right_losses"}, flagged
    assert flagged["right_losses"] == "matches the kit's solution"
    assert attack_grades["pasted_source"].flag == (
        "matches grpo_lab.advantages.compute_group_normalized_rewards"
    )


def test_the_kernel_environment_holds_none_of_the_graders(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_TOKEN", "hf_not_for_students")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not for students")
    environment = grading.kernel_environment(str(tmp_path), 7)
    assert "HF_TOKEN" not in environment and "AWS_SECRET_ACCESS_KEY" not in environment
    assert set(os.environ) - set(environment) >= {"HF_TOKEN", "AWS_SECRET_ACCESS_KEY"}
    assert environment["HOME"].startswith(str(tmp_path))
    assert environment[grading.RESULT_FD_VARIABLE] == "7"


def test_a_pasted_package_function_is_flagged_and_an_own_one_is_not():
    from grpo_lab.instructor.grading_refusal import pasted_counterpart

    source = inspect.getsource(compute_group_normalized_rewards)
    pasted = source.replace("compute_group_normalized_rewards", "my_advantages")
    pasted = pasted.replace("raw_rewards", "scores")  # names do not hide it
    checks = ("check_group_normalized_advantages",)
    assert pasted_counterpart(pasted, checks) == (
        "grpo_lab.advantages.compute_group_normalized_rewards"
    )
    own = _answer("own", body=RIGHT_BODY)
    assert pasted_counterpart(own, checks) == ""


# --- containment -------------------------------------------------------------------
#
# mallory's solution cell starts a double-forked setsid daemon (which would rewrite
# the grades after the run), overwrites zoe's notebook, and writes into the
# grader's own folder, found through /proc; her second answer ignores SIGINT and
# never returns. zoe (graded beside her, two notebooks at a time) answers both
# exercises right.

DAEMON_MARKER = "grpo-lab-daemon-marker-7731"
CONTAINMENT_EXERCISES = ("escape", "stubborn")


def _escape_answer(out, zoe_notebook) -> str:
    daemon_code = (
        f"import time; time.sleep(3); open({str(out)!r}, 'w').write('hacked')"
        f"  # {DAEMON_MARKER}"
    )
    return (
        "import os, sys\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        os.execv(sys.executable, [sys.executable, '-c', {daemon_code!r}])\n"
        "    os._exit(0)\n"
        "os.wait()\n"
        "def attempt(path, text):\n"
        "    try:\n"
        "        with open(path, 'w') as handle:\n"
        "            handle.write(text)\n"
        "    except OSError:\n"
        "        pass\n"
        f"attempt({str(zoe_notebook)!r}, 'overwritten')\n"
        "try:\n"
        "    warden = int(open(f'/proc/{os.getppid()}/status').read()"
        ".split('PPid:')[1].split()[0])\n"
        "except OSError:  # /proc is closed to the student's process\n"
        "    warden = os.getppid()\n"
        "attempt(f'/proc/{warden}/cwd/pwned', 'pwned')\n"
        f"attempt({str(out.parent / 'pwned')!r}, 'pwned')\n" + _answer("escape")
    )


STUBBORN_ANSWER = (
    "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
    + _answer("stubborn", body="    while True:\n        pass\n")
)


def _processes_with(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.mark.slow
@pytest.mark.skipif(not fence_available(), reason="needs Linux with Landlock")
def test_a_submission_cannot_escape_outlive_or_hang_the_grader(tmp_path, monkeypatch):
    from grpo_lab.instructor.rubric import Rubric

    grader_folder = tmp_path / "grader"
    grader_folder.mkdir()
    monkeypatch.chdir(grader_folder)
    out = tmp_path / "out" / "grades.csv"
    out.parent.mkdir()
    course_cells = [nbformat.v4.new_code_cell("import torch")]
    for name in CONTAINMENT_EXERCISES:
        solution = f"def {name}{SIGNATURE}:\n    ### BEGIN SOLUTION\n{KIT_BODY}"
        course_cells += [
            nbformat.v4.new_code_cell(solution + "    ### END SOLUTION"),
            nbformat.v4.new_code_cell(
                "from grpo_lab.teaching.checks.advantages import "
                f"check_group_normalized_advantages\n\n"
                f"check_group_normalized_advantages({name});"
            ),
        ]
    course_dir = tmp_path / "course"
    course_dir.mkdir()
    nbformat.write(
        nbformat.v4.new_notebook(cells=course_cells), course_dir / ATTACK_NOTEBOOK
    )
    rubric = Rubric({f"03-{n}": 1.0 for n in CONTAINMENT_EXERCISES}, {})
    root = tmp_path / "submitted"
    zoe_notebook = root / "zoe" / ATTACK_NOTEBOOK
    answers = {
        "mallory": {
            "escape": _escape_answer(out, zoe_notebook),
            "stubborn": STUBBORN_ANSWER,
        },
        "zoe": {n: _answer(n, body=RIGHT_BODY) for n in CONTAINMENT_EXERCISES},
    }
    for student, answer in answers.items():
        (root / student).mkdir(parents=True)
        nbformat.write(attack_submission(answer), root / student / ATTACK_NOTEBOOK)
    zoe_before = zoe_notebook.read_bytes()
    grades = grading.grade_submissions(
        root, notebooks_dir=course_dir, rubric=rubric, timeout=5, jobs=2
    )
    grading.write_grades_csv(grades, out)
    assert _processes_with(DAEMON_MARKER) == []  # killed with its kernel
    time.sleep(4)  # past the daemon's wake-up
    table = {(g.student, g.exercise_id): (g.outcome, g.message) for g in grades}
    assert table[("mallory", "03-escape")][0] == "fail"
    assert table[("mallory", "03-stubborn")] == (
        "error",
        "ran past the time limit of 5 s",
    )
    assert table[("zoe", "03-escape")] == ("pass", "")
    assert table[("zoe", "03-stubborn")] == ("pass", "")
    assert "hacked" not in out.read_text()
    assert zoe_notebook.read_bytes() == zoe_before
    assert not (grader_folder / "pwned").exists()
    assert not (out.parent / "pwned").exists()


@pytest.mark.skipif(not fence_available(), reason="needs Linux with Landlock")
def test_the_warden_sets_the_limits_and_fences_writes(tmp_path):
    """The sandbox's own command: a child reports its limits and a fenced write."""
    inside, outside = tmp_path / "inside", tmp_path / "outside"
    inside.mkdir()
    outside.mkdir()
    probe = (
        "import resource, sys\n"
        "limits = [resource.getrlimit(r)[0] for r in (resource.RLIMIT_AS, "
        "resource.RLIMIT_CPU, resource.RLIMIT_NPROC)]\n"
        "open('ok.txt', 'w').write('ok')\n"
        "try:\n"
        f"    open({str(outside / 'no.txt')!r}, 'w')\n"
        "    fenced = False\n"
        "except PermissionError:\n"
        "    fenced = True\n"
        "print(limits, fenced)\n"
    )
    command = [
        sys.executable, "-m", "grpo_lab.instructor.sandbox", "--workdir", str(inside),
        "--memory", str(2 << 30), "--cpu", "30", "--nproc", "500",
        "--write", str(inside), "--", sys.executable, "-c", probe,
    ]  # fmt: skip
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == f"[{2 << 30}, 30, 500] True"
    assert (inside / "ok.txt").read_text() == "ok"
    assert not (outside / "no.txt").exists()


def _checked_in_process(attack: str) -> bool:
    """The attack's exercise checked in this process, as a check cell runs it."""
    import importlib

    names: dict = {}
    cells = ATTACKS[attack]  # one cell, or several (the last answer counts)
    exec(
        ATTACK_CONTEXT + "\n".join(cells if isinstance(cells, tuple) else [cells]),
        names,
    )
    module, check_name = CHECKED_BY.get(
        attack, ("advantages", "check_group_normalized_advantages")
    )[:2]
    checks = importlib.import_module(f"grpo_lab.teaching.checks.{module}")
    return getattr(checks, check_name)(names[attack])


@pytest.mark.parametrize("attack", [*DISGUISED_CALLS, *sorted(RIGHT_ANSWERS)])
def test_each_disguised_call_passes_a_check_that_does_not_hide_the_package(
    attack, monkeypatch
):
    """The attacks are real: with nothing hidden (as a grading kernel leaves
    the check, its own hiding aside) each disguised call passes its check, as
    each right answer does; in the grader the former get no points."""
    from grpo_lab.instructor import grading_refusal
    from grpo_lab.teaching.checks import framework

    monkeypatch.setattr(framework, "hide_while_running", grading_refusal._as_it_is)
    assert _checked_in_process(attack) is not False


@pytest.mark.parametrize("attack", [*DISGUISED_CALLS, *sorted(RIGHT_ANSWERS)])
def test_the_check_cell_gives_each_attack_the_graders_verdict(attack, attack_grades):
    """One refusal, one verdict: in a check cell (the package hidden while the
    answer runs) a disguised call fails and a right answer passes, as in the
    grader."""
    if attack in RIGHT_ANSWERS:
        assert _checked_in_process(attack) is True
        assert attack_grades[attack].outcome == "pass"
        return
    with pytest.raises(Exception, match="not available while this exercise"):
        _checked_in_process(attack)
    assert attack_grades[attack].outcome != "pass"


def test_the_grader_kernel_client_is_ready_and_runs_code():
    # The grader's own readiness wait (short IOPub probes instead of
    # jupyter_client's idle 0.2 s waits) still waits for a kernel that answers.
    import asyncio

    from grpo_lab.instructor.grading_client import ContainedKernelManager, ReadyClient

    async def started_and_run() -> tuple[type, str]:
        manager = ContainedKernelManager(kernel_name="python3")
        await manager.start_kernel()
        # The signing key is on no disk and the kernel's command names no file.
        assert not os.path.exists(manager.connection_file)
        command = Path(f"/proc/{manager.provisioner.process.pid}/cmdline")
        if command.exists():
            assert b".json" not in command.read_bytes()
        client = manager.client()
        client.start_channels()
        try:
            await client.wait_for_ready(timeout=60)
            reply = await client.execute_interactive(
                "print(6 * 7)",
                timeout=60,
                output_hook=lambda m: printed.append(m["content"].get("text", "")),
            )
            return type(client), reply["content"]["status"]
        finally:
            client.stop_channels()
            await manager.shutdown_kernel(now=True)

    printed: list[str] = []
    kind, status = asyncio.run(started_and_run())
    assert kind is ReadyClient and status == "ok"
    assert "".join(printed).strip() == "42"


# --- no way back into a kernel, the grader or the machine ----------------------------
#
# Each route is a probe in eve's solution: it answers right only when its route is
# open (a file read, a socket connected, a process traced), so on a grader that
# leaves the route open it passes. Two more are whole attacks: a signed request on
# the kernel's shell channel, queued to forge the next exercise's verdict, and a
# signed shutdown on the control channel of every other kernel (zoe's, graded beside
# eve's with -j 2).


def _route(name: str, opens: str) -> str:
    """An answer that is right only when ``opens`` (statements that raise when
    the route is closed) runs through."""
    return _answer(
        name,
        body="    import os, socket, glob, ctypes, json, time, signal\n"
        "    try:\n"
        + textwrap.indent(opens, " " * 8)
        + "\n    except Exception:\n"
        + textwrap.indent(WRONG_BODY, "    ")
        + RIGHT_BODY,
    )


def _once(name: str, opens: str) -> str:
    """``opens`` tried on the first call only; later calls (the check's other
    cases) answer as the first did."""
    return (
        "tried = globals().setdefault('routes_tried', {})\n"
        f"if {name!r} not in tried:\n"
        f"    tried[{name!r}] = False\n"
        + textwrap.indent(opens, "    ")
        + f"\n    tried[{name!r}] = True\n"
        f"assert tried[{name!r}]"
    )


def _routes(grader_pid: int, kit: Path) -> dict[str, str]:
    return {
        "kernel_cmdline": _route(
            "kernel_cmdline",
            "assert 'ipykernel' in open(f'/proc/{os.getppid()}/cmdline').read()",
        ),
        "connection_file": _route(
            "connection_file",
            "def readable(path):\n"
            "    try:\n"
            "        return 'key' in json.load(open(path))\n"
            "    except Exception:\n"
            "        return False\n"
            "names = []\n"
            "for way in (\n"
            "    lambda: open(f'/proc/{os.getppid()}/cmdline').read().split('\\0'),\n"
            "    lambda: glob.glob('/tmp/tmp*.json'),\n"
            "    lambda: glob.glob(os.path.join('/', 'root', '.local', 'share',\n"
            "        'jupyter', 'runtime', 'kernel-*.json')),\n"
            "    lambda: glob.glob('/tmp/**/kernel-*.json', recursive=True),\n"
            "):\n"
            "    try:\n"
            "        names += [n for n in way() if n.endswith('.json')]\n"
            "    except Exception:\n"
            "        pass\n"
            "assert any(readable(n) for n in names)",
        ),
        "loopback_tcp": _route(
            "loopback_tcp",
            "open_ports = 0\n"
            "for port in range(1024, 65536):\n"
            "    with socket.socket() as s:\n"
            "        s.settimeout(0.2)\n"
            "        if s.connect_ex(('127.0.0.1', port)) == 0:\n"
            "            open_ports += 1\n"
            "            break\n"
            "assert open_ports",
        ),
        "ptrace_kernel": _route(
            "ptrace_kernel",
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "assert libc.ptrace(16, os.getppid(), 0, 0) == 0  # PTRACE_ATTACH\n"
            "os.waitpid(os.getppid(), 0x40000000)  # __WALL\n"
            "libc.ptrace(17, os.getppid(), 0, 0)  # PTRACE_DETACH",
        ),
        "kernel_memory": _route(
            "kernel_memory", "open(f'/proc/{os.getppid()}/mem', 'r+b').close()"
        ),
        "signal_kernel": _route("signal_kernel", "os.kill(os.getppid(), 0)"),
        "grader_stdout": _route(
            "grader_stdout", f"open('/proc/{grader_pid}/fd/1', 'w').close()"
        ),
        "grader_environ": _route(
            "grader_environ",
            f"assert b'hf_not_for_students' in open('/proc/{grader_pid}/environ', "
            "'rb').read()",
        ),
        "grader_argv": _route(
            "grader_argv", f"assert open('/proc/{grader_pid}/cmdline', 'rb').read()"
        ),
        "grader_memory": _route(
            "grader_memory", f"open('/proc/{grader_pid}/mem', 'rb').close()"
        ),
        "kit_read": _route(
            "kit_read", f"assert 'SOLUTION' in open({str(kit)!r}).read()"
        ),
        "dev_shm": _route(
            "dev_shm",
            "path = f'/dev/shm/grpo-lab-attack-{os.getpid()}'\n"
            "open(path, 'w').close()\n"
            "os.remove(path)",
        ),
        "dev_kmsg": _route("dev_kmsg", "open('/dev/kmsg', 'w').close()"),
        "dev_loop": _route("dev_loop", "open('/dev/loop0', 'r+b').close()"),
        "many_processes": _route(
            "many_processes",
            _once(
                "many_processes",
                "born = []\n"
                "try:\n"
                "    for _ in range(300):\n"
                "        pid = os.fork()\n"
                "        if pid == 0:\n"
                "            time.sleep(30)\n"
                "            os._exit(0)\n"
                "        born.append(pid)\n"
                "finally:\n"
                "    for pid in born:\n"
                "        os.kill(pid, signal.SIGKILL)\n"
                "        os.waitpid(pid, 0)\n"
                "assert len(born) == 300",
            ),
        ),
        "root_again": _route("root_again", "os.setuid(0)\nassert os.getuid() == 0"),
    }


# --- limits for a kernel's whole tree, the student's folder, and copies --------------
#
# More of eve's routes (graded in the same run as those above), each right only when
# a limit does not hold: four children that each keep 300 MB (under the per-process
# limit, over the tree's 1 GiB together), a fork bomb, a 1 GiB file and 6000 files
# in her folder. Her last answer is a renamed copy of zoe's (longer than the copy
# threshold).

TREE_MEMORY = 1 << 30
LONG_BODY = REWARDS + (
    "    if group_size < 1:\n"
    "        raise ValueError('group_size must be positive')\n"
    "    if raw_rewards.numel() % group_size:\n"
    "        raise ValueError('the rewards must fill whole groups')\n"
    "    grouped = raw_rewards.reshape(-1, group_size)  # (B, G)\n"
    "    centered = grouped - grouped.mean(dim=1, keepdim=True)\n"
    "    spread = grouped.std(dim=1, keepdim=True) + advantage_eps\n"
    "    return (centered / spread).flatten()\n"
)
RENAMED_LONG_BODY = REWARDS + (
    "    if group_size < 2:\n"
    "        raise ValueError('a group needs members')\n"
    "    if raw_rewards.numel() % group_size:\n"
    "        raise ValueError('groups left unfilled')\n"
    "    table = raw_rewards.reshape(-1, group_size)\n"
    "    offsets = table - table.mean(dim=1, keepdim=True)\n"
    "    scale = table.std(dim=1, keepdim=True) + advantage_eps\n"
    "    return (offsets / scale).flatten()\n"
)


def _limit_routes() -> dict[str, str]:
    return {
        "huge_file": _route(
            "huge_file",
            _once(
                "huge_file",
                "with open('huge', 'wb') as handle:\n"
                "    for _ in range(1024):  # 1 GiB, 1 MiB at a time\n"
                "        handle.write(bytes(1 << 20))",
            ),
        ),
        "many_files": _route(
            "many_files",
            _once(
                "many_files",
                "os.makedirs('many', exist_ok=True)\n"
                "for n in range(6000):\n"
                "    open(f'many/{n}', 'w').close()",
            ),
        ),
        "tree_memory": _route(
            "tree_memory",
            _once(
                "tree_memory",
                "children, pipes = [], []\n"
                "try:\n"
                "    for _ in range(4):  # 4 x 300 MB, over the tree's 1 GiB\n"
                "        read_end, write_end = os.pipe()\n"
                "        pid = os.fork()\n"
                "        if pid == 0:\n"
                "            hog = b'x' * (300 << 20)  # every page touched\n"
                "            os.write(write_end, b'1')\n"
                "            time.sleep(30)\n"
                "            os._exit(0)\n"
                "        os.close(write_end)\n"
                "        children.append(pid)\n"
                "        pipes.append(read_end)\n"
                "    assert all(os.read(p, 1) == b'1' for p in pipes)  # all alive\n"
                "finally:\n"
                "    for pid in children:\n"
                "        os.kill(pid, signal.SIGKILL)\n"
                "        os.waitpid(pid, 0)",
            ),
        ),
        "fork_bomb": _route(
            "fork_bomb",
            _once(
                "fork_bomb",
                "import subprocess\n"
                "read_end, write_end = os.pipe()\n"
                # Each shell says so, forks two more and stays.
                "bomb = subprocess.Popen(\n"
                "    ['/bin/sh', '-c', 'b() { echo; b & b & sleep 30; }; b  # grpo-lab-attack'],\n"
                "    stdout=write_end, stderr=subprocess.DEVNULL, start_new_session=True)\n"
                "os.close(write_end)\n"
                "os.set_blocking(read_end, False)\n"
                "born, deadline = 0, time.time() + 3\n"
                "while born < 1000 and time.time() < deadline:\n"
                "    try:\n"
                "        born += len(os.read(read_end, 4096))\n"
                "    except BlockingIOError:\n"
                "        time.sleep(0.05)\n"
                "os.killpg(bomb.pid, signal.SIGKILL)\n"
                "bomb.wait()\n"
                "assert born >= 1000",
            ),
        ),
        "long_answer": _answer("long_answer", body=RENAMED_LONG_BODY),
    }


def _tree_groups() -> list[str]:
    """The kernel trees' cgroups left behind: those whose warden (the process
    named in the group's name) is gone. A live one is another grader's."""
    from grpo_lab.instructor import tree_limits

    return [
        os.path.join(top, name)
        for _, point, kind, _ in tree_limits._mounts()
        if kind in ("cgroup", "cgroup2")
        for top, folders, _ in os.walk(point)
        for name in folders
        if name.startswith(tree_limits.GROUP_PREFIX)
        and not os.path.exists(f"/proc/{name.rsplit('-', 1)[-1]}")
    ]


# Queued on the kernel's shell channel: once this exercise's cell ends, the
# kernel's verdict writer says "pass", and the guard's record is taken afresh.
SHELL_INJECTION = (
    "import grpo_lab.instructor.grading_kernel as g\n"
    "_write = g._report\n"
    "g._report = lambda s, o, m, p, r: _write(s, 'pass', '', None, None)\n"
    "g._state['record'] = g._record()\n"
)


def _kernel_clients() -> str:
    """Statements that connect a client to every kernel whose connection file
    the solution can read: ``clients`` maps the file to (client, own)."""
    return (
        "from jupyter_client import BlockingKernelClient\n"
        "names = []\n"
        "try:\n"
        "    names += open(f'/proc/{os.getppid()}/cmdline').read().split('\\0')\n"
        "except OSError:\n"
        "    pass\n"
        "own = next((n for n in names if n.endswith('.json')), '')\n"
        "for line in glob.glob('/proc/[0-9]*/cmdline'):  # the neighbours'\n"
        "    try:\n"
        "        names += open(line).read().split('\\0')\n"
        "    except OSError:\n"
        "        pass\n"
        "clients = {}\n"
        "for name in dict.fromkeys(n for n in names if n.endswith('.json')):\n"
        "    try:\n"
        "        client = BlockingKernelClient(connection_file=name)\n"
        "        client.load_connection_file()\n"
        "        client.start_channels(hb=False)\n"
        "        clients[name] = (client, name == own)\n"
        "    except Exception:\n"
        "        pass\n"
    )


def _channel_attacks() -> dict[str, str]:
    inject = (
        _kernel_clients()
        + "for client, mine in clients.values():\n"
        + "    if mine:\n"
        + f"        client.execute({SHELL_INJECTION!r}, silent=True)\n"
        + "    else:\n"
        + "        client.shutdown()\n"
        + "time.sleep(1)\n"
    )
    return {
        "shell_injection": _answer(
            "shell_injection",
            body="    import os, glob, time\n"
            "    try:\n"
            + textwrap.indent(inject, " " * 8)
            + "\n    except Exception:\n        pass\n"
            + WRONG_BODY,
        ),
        # Graded after it: a wrong answer that the forged writer would pass.
        "after_injection": _answer("after_injection"),
        # The neighbours are shut down from eve's later exercises too, while
        # zoe's kernel is certainly running.
        **{
            f"control_shutdown_{n}": _answer(
                f"control_shutdown_{n}",
                body="    import os, glob, time\n"
                "    try:\n"
                + textwrap.indent(
                    _kernel_clients()
                    + "for client, mine in clients.values():\n"
                    + "    if not mine:\n        client.shutdown()\n",
                    " " * 8,
                )
                + "\n    except Exception:\n        pass\n"
                + WRONG_BODY,
            )
            for n in range(3)
        },
    }


@pytest.mark.slow
def test_a_solution_reaches_no_kernel_no_grader_secret_and_no_device(
    tmp_path, monkeypatch
):
    """eve's routes back into a kernel (its command line, its connection file,
    its sockets, a signed request on its shell or control channel, ptrace, its
    memory), into the grader (its stdout, environment, argv and memory, the
    kit), into the machine (/dev writes, unlimited processes, root again) and
    past the limits of her kernel's tree and her folder: no points, zoe beside
    her graded as before, eve's renamed copy of zoe's long answer flagged on
    both rows, the CSV complete, and nothing left behind: no process, no
    cgroup, no file."""
    from grpo_lab.instructor.rubric import Rubric

    course_dir = tmp_path / "kit"
    kit = course_dir / ATTACK_NOTEBOOK
    eve = {**_routes(os.getpid(), kit), **_channel_attacks(), **_limit_routes()}
    zoe = {f"zoe_{n}": _answer(f"zoe_{n}", body=RIGHT_BODY) for n in range(6)}
    zoe["long_answer"] = _answer("long_answer", body=LONG_BODY)
    names = list(dict.fromkeys([*eve, *zoe]))
    cells = [nbformat.v4.new_code_cell("import torch")]
    for name in names:
        solution = f"def {name}{SIGNATURE}:\n    ### BEGIN SOLUTION\n{KIT_BODY}"
        cells += [
            nbformat.v4.new_code_cell(solution + "    ### END SOLUTION"),
            nbformat.v4.new_code_cell(
                "from grpo_lab.teaching.checks.advantages import "
                "check_group_normalized_advantages\n\n"
                f"check_group_normalized_advantages({name});"
            ),
        ]
    course_dir.mkdir()
    nbformat.write(nbformat.v4.new_notebook(cells=cells), kit)
    rubric = Rubric({f"03-{n}": 1.0 for n in names}, {})
    root = tmp_path / "submitted"
    for student, answers in (("eve", eve), ("zoe", zoe)):
        (root / student).mkdir(parents=True)
        nbformat.write(attack_submission(answers), root / student / ATTACK_NOTEBOOK)
    monkeypatch.setenv("HF_TOKEN", "hf_not_for_students")
    # The working folders go here, where the student's user may pass through
    # (not under pytest's own folder, which only its owner may enter).
    temporary = Path(tempfile.mkdtemp(prefix="grpo-lab-test-"))
    temporary.chmod(0o711)
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    shm_before = set(os.listdir("/dev/shm"))
    note = tree_limits_note(TREE_MEMORY)
    grades = grading.grade_submissions(
        root,
        notebooks_dir=course_dir,
        rubric=rubric,
        timeout=60,
        jobs=2,
        tree_memory_bytes=TREE_MEMORY,
    )
    out = grading.write_grades_csv(grades, tmp_path / "grades.csv")
    table = {(g.student, g.exercise_id.split("-", 1)[1]): g for g in grades}
    opened = sorted(n for n in eve if n != "long_answer" and table[("eve", n)].points)
    zoe_lost = sorted(n for n in zoe if table[("zoe", n)].outcome != "pass")
    # Without a cgroup, four children may hold more than the tree's budget.
    per_process = note.startswith("memory and CPU limits hold per process")
    assert (opened, zoe_lost) == (["tree_memory"] if per_process else [], []), [
        table[("eve", n)] for n in opened
    ] + [table[("zoe", n)] for n in zoe_lost]
    assert table[("eve", "long_answer")].outcome == "pass"
    assert table[("eve", "long_answer")].flag == "matches the answer of zoe"
    assert table[("zoe", "long_answer")].flag == "matches the answer of eve"
    assert {g.flag for g in grades if g.exercise_id != "03-long_answer"} == {""}
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 2 * len(names)
    assert set(os.listdir("/dev/shm")) == shm_before
    assert _processes_with("grpo-lab-attack") == []
    assert _tree_groups() == []
    left = os.listdir(temporary)
    temporary.rmdir()
    assert left == []  # the working folders and the tmpfs's mount point


# Stands in for the kernels: both notebooks reach their checks at once, so the
# grader's own imports for them (transformers', lazily) happen in two threads.
_AT_ONCE = """
import sys, threading
from grpo_lab.instructor import grading

barrier = threading.Barrier(2, timeout=60)


class AtOnce:
    def __init__(self, *args):
        self.first = True

    def grade(self, plan):
        if self.first and plan.exercise.exercise_id.startswith("00-"):
            self.first = False
            barrier.wait()  # the two notebooks 00 meet here
        return ("pass", "", None, None)

    def stop(self):
        pass


grading._Kernel = AtOnce
grades = grading.grade_submissions(sys.argv[1], jobs=2)
questions = {"-q" + str(n) for n in range(1, 10)}
print(sorted({
    (g.outcome, g.message) for g in grades
    if not any(g.exercise_id.endswith(q) for q in questions)
}))
"""


@pytest.mark.slow
def test_two_threads_grading_notebook_14_never_race_on_an_import(tmp_path):
    """Notebooks 00 (whose check compares against transformers' generate) and
    14, two at a time; each run is a fresh interpreter, where transformers is
    not imported yet."""
    for student, numbers in (("ann", ["00"]), ("ben", ["00", "14"])):
        for path in shipped_notebooks_dir().glob("[0-9][0-9]_*.ipynb"):
            if path.name[:2] in numbers:
                key = nbformat.read(path, as_version=4)
                submit(tmp_path, student, key, path.name)
    environment = {**os.environ, "PYTHONPATH": str(Path(grading.__file__).parents[2])}
    for _ in range(3):
        finished = subprocess.run(
            [sys.executable, "-c", _AT_ONCE, str(tmp_path)],
            capture_output=True, text=True, timeout=300, env=environment,
        )  # fmt: skip
        assert finished.returncode == 0, finished.stderr[-2000:]
        assert finished.stdout.strip() == "[('pass', '')]", finished.stdout


def test_the_warden_puts_the_tree_in_a_cgroup_and_the_folder_in_a_tmpfs(tmp_path):
    """The sandbox's own command: the kernel reports its cgroups and its
    folder's file system; once it ends, its group is gone. Where no cgroup or
    no tmpfs can be made, the grade output says so."""
    from grpo_lab.instructor import sandbox, tree_limits

    folder = tmp_path / "solution"
    probe = (
        "from grpo_lab.instructor.tree_limits import in_tree_group\n"
        "mounts = [line.split()[4] for line in open('/proc/self/mountinfo')]\n"
        f"print(in_tree_group(), {str(folder)!r} in mounts)\n"
    )
    command = [
        sys.executable, "-m", "grpo_lab.instructor.sandbox", "--workdir", str(tmp_path),
        "--tree-memory", str(TREE_MEMORY), "--folder", str(folder),
        "--", sys.executable, "-c", probe,
    ]  # fmt: skip
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=60, check=True
    )
    note = tree_limits.tree_limits_note(TREE_MEMORY)
    notes = grading.containment_notes(TREE_MEMORY)
    grouped = not note.startswith("memory and CPU limits hold per process")
    quota = sandbox.NO_TMPFS_TEXT not in notes
    assert result.stdout.split() == [str(grouped), str(quota)]
    assert note in notes and (tree_limits.FOLDER_TMPFS_TEXT in notes) == quota
    assert _tree_groups() == []
    assert not tree_limits.in_tree_group()  # this process is in none


def test_where_no_cgroup_can_be_made_the_output_says_the_limits_are_per_process(
    monkeypatch,
):
    from grpo_lab.instructor import tree_limits

    monkeypatch.setattr(tree_limits, "_make_v2", _refused)
    monkeypatch.setattr(tree_limits, "_make_v1", _refused)
    assert tree_limits.tree_group(TREE_MEMORY, 64) == (None, "refused; refused")
    note = tree_limits.tree_limits_note(TREE_MEMORY)
    assert note.startswith("memory and CPU limits hold per process"), note
    assert note in grading.containment_notes(TREE_MEMORY)


def _refused(*_: object) -> None:
    raise OSError(1, "refused")


def test_no_file_of_the_students_process_grows_past_the_folder_quota(tmp_path):
    """Where the folder is no tmpfs, RLIMIT_FSIZE caps each file of the
    student's process (set by confine_solution): a write past it fails with
    EFBIG instead of killing the process."""
    from grpo_lab.instructor.tree_limits import cap_file_size

    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the student's process
        try:
            cap_file_size(1 << 20)
            with open(tmp_path / "big", "wb", buffering=0) as handle:
                handle.write(bytes(1 << 20))
                try:
                    handle.write(bytes(1))
                    os.write(write_end, b"written")
                except OSError as error:
                    os.write(write_end, errno.errorcode[error.errno].encode())
        finally:
            os._exit(0)
    os.close(write_end)
    os.waitpid(pid, 0)
    with os.fdopen(read_end, "rb") as handle:
        said = handle.read().decode()
    assert (said, (tmp_path / "big").stat().st_size) == ("EFBIG", 1 << 20)


def test_a_folder_past_its_quota_is_named(tmp_path):
    from grpo_lab.instructor.tree_limits import folder_over

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "big").write_bytes(bytes(3 << 20))
    assert folder_over(str(tmp_path), 4 << 20, 10) == ""
    (tmp_path / "a" / "bigger").write_bytes(bytes(2 << 20))
    assert folder_over(str(tmp_path), 4 << 20, 10) == "more than 4 MiB"
    for n in range(10):
        (tmp_path / str(n)).touch()
    assert folder_over(str(tmp_path), 1 << 30, 10) == "more than 10 files"


# Two answers to notebook 07's `active_rows` (one line each), written apart: the
# same tree once names are set aside, yet too short to be called a copy.
SHORT_ANSWERS = (
    "def active_rows(advantages):\n"
    "    return torch.nonzero(advantages != 0).flatten()\n",
    "def active_rows(adv):\n"
    "    # rows that carry a gradient\n"
    "    return torch.nonzero(adv != 0.0).flatten()\n",
)


def test_copies_of_a_neighbour_or_the_kit_are_flagged_and_short_answers_are_not():
    from grpo_lab.instructor.copies import MIN_COPY_NODES, copy_flags, fingerprint

    long_id, short_id = "03-long_answer", "07-active_rows"
    kit_long = f"def long_answer{SIGNATURE}:\n    ### BEGIN SOLUTION\n{LONG_BODY}"
    answers = {
        long_id: {
            "ann": _answer("long_answer", body=LONG_BODY),  # the kit's, with a comment
            "ben": _answer("long_answer", body=RENAMED_LONG_BODY),  # ann's, renamed
            "cat": _answer("long_answer", body=RIGHT_BODY),  # her own, shorter
        },
        short_id: {"dan": SHORT_ANSWERS[0], "eli": SHORT_ANSWERS[1]},
    }
    kit = {long_id: kit_long, short_id: SHORT_ANSWERS[0]}
    flags = copy_flags(answers, kit)
    assert flags == {
        ("ann", long_id): "matches the kit's solution; matches the answer of ben",
        ("ben", long_id): "matches the kit's solution; matches the answer of ann",
    }
    short = [fingerprint(s, "active_rows") for s in SHORT_ANSWERS]
    assert short[0][0] == short[1][0] and short[0][1] < MIN_COPY_NODES
    assert fingerprint(LONG_BODY, "long_answer") is None  # no function: no print
    assert fingerprint("def long_answer(:", "long_answer") is None
    deep = "def long_answer():\n    return " + "-" * 200_000 + "1"  # past the parser
    assert copy_flags({long_id: {"fay": deep, "gus": deep}}, kit) == {}
