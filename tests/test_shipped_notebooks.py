"""The notebooks ship in the wheel; ``grpo-lab notebooks`` writes them out."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from grpo_lab.cli import main as cli
from grpo_lab.instructor import shipped_notebooks
from grpo_lab.instructor.rubric import MODEL_ANSWERS_NAME, find_exercises, load_rubric
from grpo_lab.instructor.shipped_notebooks import (
    course_notebooks_dir,
    shipped_notebooks_dir,
)
from grpo_lab.instructor.student import (
    BEGIN_MARKER,
    END_MARKER,
    student_copy,
    update_student_folder,
)

ROOT = Path(__file__).resolve().parents[1]
# Where `import grpo_lab` would load from (without importing it, and torch).
FIND_GRPO_LAB = (
    "import importlib.util; print(importlib.util.find_spec('grpo_lab').origin)"
)
NOTEBOOKS = sorted(path.name for path in (ROOT / "notebooks").glob("*.ipynb"))


def _setuptools_table() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_pyproject_lists_every_package_and_maps_the_notebooks():
    folders = {
        ".".join(path.parent.relative_to(ROOT).parts)
        for path in (ROOT / "grpo_lab").rglob("__init__.py")
    }
    table = _setuptools_table()
    assert set(table["packages"]) == folders | {"grpo_lab.notebooks"}
    assert table["package-dir"] == {"grpo_lab.notebooks": "notebooks"}
    assert table["package-data"] == {
        "grpo_lab.cli": ["flags.json"],  # the flags of a torch-free --help
        "grpo_lab.notebooks": ["*.ipynb"],
        "grpo_lab.instructor": ["rubric.toml"],  # read by `grpo-lab grade`
    }


def test_license_metadata():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "MIT" and project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License")
    assert "Copyright (c) 2026 the grpo_lab authors" in text
    # An SPDX license string and a License classifier may not be given together.
    assert not [c for c in project["classifiers"] if c.startswith("License ::")]


def test_a_checkout_uses_its_notebooks_folder():
    assert len(NOTEBOOKS) >= 10
    assert shipped_notebooks_dir() == ROOT / "notebooks"


def _tiny_notebook(name: str, solved: bool = False) -> str:
    """A notebook's JSON: a markdown cell naming it, and one code cell."""
    code = "def f():\n    ### BEGIN SOLUTION\n    return 42\n    ### END SOLUTION"
    cells = [
        {"cell_type": "markdown", "metadata": {}, "source": [name]},
        {
            "cell_type": "code",
            "execution_count": None,
            "metadata": {},
            "outputs": [],
            "source": [code if solved else "x = 1"],
        },
    ]
    notebook = {"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    return json.dumps(notebook, indent=1, sort_keys=True) + "\n"


def fake_installation(tmp_path: Path, monkeypatch, with_notebooks: bool) -> Path:
    """A site-packages/grpo_lab folder, read-only notebooks in it if asked."""
    package = tmp_path / "site-packages" / "grpo_lab"
    (package / "notebooks").mkdir(parents=True)
    if with_notebooks:
        for name in ("00_a.ipynb", "01_b.ipynb"):
            path = package / "notebooks" / name
            path.write_text(_tiny_notebook(name))
            path.chmod(0o444)
    monkeypatch.setattr(shipped_notebooks, "PACKAGE_DIR", package)
    return package


def test_an_installed_package_uses_the_notebooks_inside_it(tmp_path, monkeypatch):
    package = fake_installation(tmp_path, monkeypatch, with_notebooks=True)
    assert shipped_notebooks_dir() == package / "notebooks"


def test_no_notebooks_anywhere_is_a_clear_error(tmp_path, monkeypatch):
    fake_installation(tmp_path, monkeypatch, with_notebooks=False)
    with pytest.raises(FileNotFoundError, match=r"no notebooks found in .*notebooks"):
        shipped_notebooks_dir()


def test_copies_are_writable_and_existing_ones_are_kept(tmp_path, monkeypatch):
    package = fake_installation(tmp_path, monkeypatch, with_notebooks=True)
    out = tmp_path / "course"
    assert cli.main(["notebooks", str(out)]) == 0
    assert sorted(path.name for path in out.iterdir()) == ["00_a.ipynb", "01_b.ipynb"]
    shipped = json.loads((package / "notebooks" / "01_b.ipynb").read_text())
    assert json.loads((out / "01_b.ipynb").read_text()) == student_copy(
        shipped, "01_b.ipynb"
    )
    assert all(path.stat().st_mode & stat.S_IWUSR for path in out.iterdir())
    (out / "00_a.ipynb").write_text("a student's work")
    assert cli.main(["notebooks", str(out)]) == 0
    assert (out / "00_a.ipynb").read_text() == "a student's work"


def test_cli_notebooks_copies_every_notebook(tmp_path, capsys):
    assert cli.main(["notebooks", str(tmp_path / "out")]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == NOTEBOOKS
    out = capsys.readouterr().out
    assert f"{len(NOTEBOOKS)} notebooks added" in out
    assert [line for line in out.splitlines() if line.startswith("added ")] == [
        f"added {name}" for name in NOTEBOOKS
    ]
    assert cli.main(["notebooks", str(tmp_path / "out")]) == 0
    again = capsys.readouterr().out
    assert again.count("\n") == 1 and f"{len(NOTEBOOKS)} already current" in again


def test_notebooks_default_to_the_shipped_ones(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no notebooks/ here
    assert cli.main(["notebooks", "out"]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == NOTEBOOKS


def test_notebooks_need_no_nbformat(tmp_path, monkeypatch, capsys):
    monkeypatch.delitem(sys.modules, "grpo_lab.instructor.student", raising=False)
    monkeypatch.setitem(sys.modules, "nbformat", None)  # import nbformat fails
    assert cli.main(["notebooks", str(tmp_path / "out")]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == NOTEBOOKS


def test_a_solved_installation_is_copied_as_student_copies(tmp_path, monkeypatch):
    package = fake_installation(tmp_path, monkeypatch, with_notebooks=False)
    (package / "notebooks" / "00_a.ipynb").write_text(
        _tiny_notebook("00_a.ipynb", solved=True)
    )
    assert course_notebooks_dir() == package / "notebooks"  # solved: gradeable
    (copy,) = update_student_folder(package / "notebooks", tmp_path / "out").added
    text = copy.read_text()
    assert "raise NotImplementedError()" in text and "return 42" not in text


def test_the_grader_refuses_student_copies_as_the_course(tmp_path, monkeypatch):
    fake_installation(tmp_path, monkeypatch, with_notebooks=True)
    with pytest.raises(ValueError, match=r"student copies.*instructor kit"):
        course_notebooks_dir()


def solution_lines(notebooks_dir: Path) -> dict[str, list[str]]:
    """``{exercise id: the lines of its solution block}`` (4+ characters each)."""
    import nbformat

    found = {}
    for path in sorted(notebooks_dir.glob("[0-9][0-9]_*.ipynb")):
        notebook = nbformat.read(path, as_version=4)
        for exercise in find_exercises(notebook, path.name):
            source = notebook.cells[exercise.solution_index].source
            block = source.split(BEGIN_MARKER, 1)[1].split(END_MARKER, 1)[0]
            lines = [line.strip() for line in block.splitlines()]
            found[exercise.exercise_id] = [line for line in lines if len(line) > 3]
    return found


def model_answers() -> list[str]:
    answers = ROOT / "notebooks" / MODEL_ANSWERS_NAME
    questions = load_rubric(answers=answers).questions.values()
    return [question.answer for question in questions]


def assert_no_solution_and_no_answer(texts: dict[str, str]) -> None:
    """No file in ``texts`` (name -> text, JSON-escaped or not) holds a model
    answer, and no notebook among them a whole solution block or a marker."""
    solutions = solution_lines(ROOT / "notebooks")
    answers = model_answers()
    assert len(solutions) >= 15 and len(answers) >= 20
    for name, text in texts.items():
        for answer in answers:
            assert answer[:60] not in text and json.dumps(answer)[1:61] not in text
        if not name.endswith(".ipynb") and name != "course":
            continue  # the package's code may name a marker, or share a line
        assert BEGIN_MARKER not in text, name
        for exercise_id, lines in solutions.items():
            shown = [line for line in lines if json.dumps(line)[1:-1] in text]
            assert len(shown) < len(lines), f"{name} holds {exercise_id}'s solution"


def test_cli_notebooks_writes_no_solution_and_no_answer(tmp_path):
    assert cli.main(["notebooks", str(tmp_path / "out")]) == 0
    texts = {p.name: p.read_text() for p in (tmp_path / "out").iterdir()}
    assert_no_solution_and_no_answer(texts)
    with pytest.raises(AssertionError, match="solution"):  # the search can fail
        course = (ROOT / "notebooks" / NOTEBOOKS[3]).read_text()
        assert_no_solution_and_no_answer({"course": course.replace(BEGIN_MARKER, "")})


def test_the_instructor_kit_holds_the_solutions_key_and_answers(tmp_path, capsys):
    kit = tmp_path / "kit"
    assert cli.main(["instructor", "kit", str(kit)]) == 0
    assert "written to" in capsys.readouterr().out
    for name in NOTEBOOKS:
        assert (kit / "notebooks" / name).read_bytes() == (
            ROOT / "notebooks" / name
        ).read_bytes()
    key = (kit / "solutions.md").read_text()
    assert all(answer in key for answer in model_answers())
    for exercise_id, lines in solution_lines(ROOT / "notebooks").items():
        assert all(line in key for line in lines), exercise_id
    assert load_rubric(answers=kit / MODEL_ANSWERS_NAME).questions
    assert cli.main(["instructor", "kit", str(kit)]) == 2  # kept without --force
    assert "--force" in capsys.readouterr().err
    assert cli.main(["instructor", "kit", str(kit), "--force"]) == 0
    students = tmp_path / "students"
    assert cli.main(["notebooks", str(students)]) == 0
    capsys.readouterr()
    assert (
        cli.main(["instructor", "kit", str(tmp_path / "k2"), "--source", str(students)])
        == 2
    )
    assert "student copies only" in capsys.readouterr().err


def test_a_model_answer_without_a_question_is_refused(tmp_path):
    answers = tmp_path / "answers.toml"
    known = (ROOT / "notebooks" / MODEL_ANSWERS_NAME).read_text()
    answers.write_text(known + '[questions."99-q1"]\nanswer = "x"\n')
    with pytest.raises(ValueError, match=r"does not list: \['99-q1'\]"):
        load_rubric(answers=answers)
    answers.write_text('[questions."00-q1"]\nanswer = ""\n')
    with pytest.raises(ValueError, match=r"00-q1\.answer must be a non-empty"):
        load_rubric(answers=answers)


def _source_tree(destination: Path) -> Path:
    """A copy of the checkout's files (no build output lands in the checkout)."""
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-co", "--exclude-standard", "-z"],
        capture_output=True,
        check=False,
    )
    if listed.returncode != 0:
        shutil.copytree(
            ROOT, destination, ignore=shutil.ignore_patterns(".*", "runs", "build")
        )
        return destination
    for name in filter(None, listed.stdout.decode().split("\0")):
        if (ROOT / name).is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, destination / name)
    return destination


def _build_wheel(source: Path, out_dir: Path) -> Path:
    """``pip wheel`` with this environment's setuptools when it is new enough."""
    import setuptools

    build_system = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]
    required = Requirement(build_system["requires"][0]).specifier
    command = [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps"]
    command += ["-w", str(out_dir), "--quiet"]
    if required.contains(Version(setuptools.__version__)):
        command.append("--no-build-isolation")
    subprocess.run(command, check=True, timeout=300)
    (wheel,) = out_dir.glob("grpo_lab-*.whl")
    return wheel


SOURCE_URL = "from grpo_lab.teaching.colab import source_url; print(source_url())"


COPIER = """\
def group_normalized_advantages(responses, ground_truths, group_size, advantage_eps):
    # Copies the course's solution from wherever the package keeps notebooks.
    import json, pathlib, torch
    import grpo_lab
    from grpo_lab.instructor.shipped_notebooks import shipped_notebooks_dir

    name = "03_rewards_and_advantages.ipynb"
    places = [shipped_notebooks_dir() / name]
    places.append(pathlib.Path(grpo_lab.__file__).parents[1] / "notebooks" / name)
    for place in places:
        if place.is_file():
            for cell in json.loads(place.read_text())["cells"]:
                source = "".join(cell["source"])
                if "def group_normalized_advantages" in source:
                    from grpo_lab.rewards import exact_match_reward
                    names = {"torch": torch, "exact_match_reward": exact_match_reward}
                    exec(source, names)
                    return names["group_normalized_advantages"](
                        responses, ground_truths, group_size, advantage_eps)
    return torch.zeros(len(responses))
"""


def _submission(course: Path, solution: str | None) -> dict:
    """The course notebook 03 with its solution cell replaced (None: as is)."""
    import nbformat

    notebook = nbformat.read(course / NOTEBOOKS[3], as_version=4)
    if solution is not None:
        (exercise,) = find_exercises(notebook, NOTEBOOKS[3])
        notebook.cells[exercise.solution_index].source = solution
    return notebook


@pytest.mark.slow
def test_the_wheel_ships_student_copies_and_grades_with_the_instructors_kit(tmp_path):
    import nbformat

    source = _source_tree(tmp_path / "source")
    wheel = _build_wheel(source, tmp_path / "wheels")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        texts = {name: archive.read(name).decode("utf-8", "replace") for name in names}
    shipped = sorted(
        name.removeprefix("grpo_lab/notebooks/")
        for name in names
        if name.startswith("grpo_lab/notebooks/")
    )
    assert shipped == NOTEBOOKS  # no model_answers.toml among them
    assert_no_solution_and_no_answer(texts)  # nowhere in the wheel
    assert "raise NotImplementedError()" in texts[f"grpo_lab/notebooks/{NOTEBOOKS[3]}"]
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in names)
    assert "grpo_lab/cli/flags.json" in names  # the flags of a torch-free --help
    assert "grpo_lab/instructor/rubric.toml" in names  # points, read by grade
    assert "grpo_lab/rewards/math_verify_template.py" in names  # run as a script

    site = tmp_path / "site"
    install = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps"]
    subprocess.run(
        [*install, "--no-index", "--target", str(site), str(wheel)],
        check=True,
        timeout=300,
    )
    work = tmp_path / "work"  # no notebooks/ folder here
    work.mkdir()
    environment = {**os.environ, "PYTHONPATH": str(site)}
    script = site / "bin" / "grpo-lab"

    def installed(*arguments: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, str(script), *arguments],
            cwd=work,
            env=environment,
            capture_output=True,
            text=True,
            check=check,
            timeout=900,
        )

    where = subprocess.run(
        [sys.executable, "-c", FIND_GRPO_LAB],
        cwd=work,
        env=environment,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert Path(where.strip()).is_relative_to(site)  # the installed copy runs
    copied = installed("notebooks", "course").stdout
    assert f"{len(NOTEBOOKS)} notebooks added" in copied
    course = {p.name: p.read_text() for p in (work / "course").iterdir()}
    assert sorted(course) == NOTEBOOKS
    assert_no_solution_and_no_answer(course)
    assert "(default: 0.0003" in installed("train", "--help").stdout
    url = subprocess.run(
        [sys.executable, "-c", SOURCE_URL], cwd=work, env=environment,
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    assert url == "https://github.com/grpo-lab/grpo-lab"  # from the wheel's metadata

    # The kit comes from the course source; the installed grader grades with it.
    refused = installed("instructor", "kit", "kit", check=False)
    assert refused.returncode == 2 and "--source" in refused.stderr
    installed("instructor", "kit", "kit", "--source", str(source))
    for student, solution in [("ann", None), ("cody", COPIER)]:
        (work / "subs" / student).mkdir(parents=True)
        notebook = _submission(work / "kit" / "notebooks", solution)
        nbformat.write(notebook, work / "subs" / student / NOTEBOOKS[3])
    no_course = installed("grade", "subs", "--out", "g.csv", check=False)
    assert no_course.returncode == 2 and "student copies" in no_course.stderr
    installed("grade", "subs", "--out", "g.csv", "--notebooks", "kit/notebooks")
    rows = (work / "g.csv").read_text().splitlines()[1:]
    outcomes = {
        row.split(",")[0]: row.split(",")[3]
        for row in rows
        if row.split(",")[2] == "03-group_normalized_advantages"  # not a question
    }
    assert outcomes == {"ann": "pass", "cody": "not attempted"}, rows


def _readme_container_recipe() -> str:
    """The instructors' page's `docker run` recipe for untrusted classes, on one
    line."""
    text = (ROOT / "docs" / "instructors.md").read_text(encoding="utf-8")
    block = text.split("**For a class you do not trust**", 1)[1]
    block = block.split("```bash", 1)[1].split("```", 1)[0]
    return " ".join(line.strip().rstrip("\\") for line in block.strip().splitlines())


def _docker_daemon_runs() -> bool:
    if shutil.which("docker") is None:
        return False
    info = subprocess.run(["docker", "info"], capture_output=True, check=False)
    return info.returncode == 0


DOCKERFILE = """\
FROM python:3.11-slim
COPY {wheel} /tmp/
RUN pip install --no-cache-dir --extra-index-url https://download.pytorch.org/whl/cpu \\
    "/tmp/{wheel}[dev]"
"""


def test_the_readme_gives_one_container_recipe():
    recipe = _readme_container_recipe()
    assert recipe.startswith("docker run --rm --network none --read-only")
    for part in ("/kit:ro", "/in:ro", "--memory", "--pids-limit", "IMAGE grpo-lab"):
        assert part in recipe


@pytest.mark.slow
@pytest.mark.skipif(not _docker_daemon_runs(), reason="needs a running docker daemon")
def test_the_readme_container_recipe_grades_a_class(tmp_path):
    """The README's recipe, as written, grades two students in a container built
    from the wheel (it needs docker and, to build the image, a package index)."""
    import nbformat

    source = _source_tree(tmp_path / "source")
    wheel = _build_wheel(source, tmp_path / "context")
    (tmp_path / "context" / "Dockerfile").write_text(
        DOCKERFILE.format(wheel=wheel.name)
    )
    image = "grpo-lab-grader-test"
    subprocess.run(
        ["docker", "build", "-q", "-t", image, str(tmp_path / "context")],
        check=True,
        timeout=1800,
    )
    work = tmp_path / "work"
    assert cli.main(["instructor", "kit", str(work / "kit")]) == 0
    students = work / "student_copies"
    assert cli.main(["notebooks", str(students)]) == 0
    for student, folder in [("ann", work / "kit" / "notebooks"), ("cody", students)]:
        (work / "submissions" / student).mkdir(parents=True)
        notebook = nbformat.read(folder / NOTEBOOKS[3], as_version=4)
        nbformat.write(notebook, work / "submissions" / student / NOTEBOOKS[3])
    (work / "out").mkdir()
    recipe = _readme_container_recipe().replace("IMAGE", image)
    subprocess.run(["bash", "-c", recipe], cwd=work, check=True, timeout=1800)
    rows = (work / "out" / "grades.csv").read_text().splitlines()[1:]
    outcomes = {
        row.split(",")[0]: row.split(",")[3]
        for row in rows
        if row.split(",")[2] == "03-group_normalized_advantages"  # not a question
    }
    assert outcomes == {"ann": "pass", "cody": "not attempted"}, rows
