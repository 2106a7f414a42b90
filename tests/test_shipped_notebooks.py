"""The notebooks ship in the wheel; ``grpo-lab notebooks`` copies them out."""

from __future__ import annotations

import os
import re
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

from grpo_lab import cli
from grpo_lab.teaching import shipped_notebooks
from grpo_lab.teaching.shipped_notebooks import copy_notebooks, shipped_notebooks_dir

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
        "grpo_lab": ["cli_flags.json"],  # the flags of a torch-free --help
        "grpo_lab.notebooks": ["*.ipynb"],
        "grpo_lab.teaching": ["rubric.toml"],  # read by `grpo-lab grade`
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


def fake_installation(tmp_path: Path, monkeypatch, with_notebooks: bool) -> Path:
    """A site-packages/grpo_lab folder, read-only notebooks in it if asked."""
    package = tmp_path / "site-packages" / "grpo_lab"
    (package / "notebooks").mkdir(parents=True)
    if with_notebooks:
        for name in ("00_a.ipynb", "01_b.ipynb"):
            path = package / "notebooks" / name
            path.write_text(f'{{"name": "{name}"}}')
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
    fake_installation(tmp_path, monkeypatch, with_notebooks=True)
    out = tmp_path / "course"
    copied = copy_notebooks(out)
    assert [path.name for path in copied] == ["00_a.ipynb", "01_b.ipynb"]
    assert (out / "01_b.ipynb").read_text() == '{"name": "01_b.ipynb"}'
    assert all(path.stat().st_mode & stat.S_IWUSR for path in copied)
    (out / "00_a.ipynb").write_text("a student's work")
    with pytest.raises(FileExistsError, match=r"00_a\.ipynb, 01_b\.ipynb.*--force"):
        copy_notebooks(out)
    assert (out / "00_a.ipynb").read_text() == "a student's work"
    copy_notebooks(out, overwrite=True)
    assert (out / "00_a.ipynb").read_text() == '{"name": "00_a.ipynb"}'


def test_cli_notebooks_copies_every_notebook(tmp_path, capsys):
    assert cli.main(["notebooks", str(tmp_path / "out")]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == NOTEBOOKS
    assert f"{len(NOTEBOOKS)} notebooks copied" in capsys.readouterr().out
    capsys.readouterr()
    assert cli.main(["notebooks", str(tmp_path / "out")]) == 2
    assert re.fullmatch(r"grpo-lab notebooks: .* --force.*\n", capsys.readouterr().err)
    assert cli.main(["notebooks", str(tmp_path / "out"), "--force"]) == 0


def test_student_notebooks_default_to_the_shipped_ones(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no notebooks/ here
    assert cli.main(["student-notebooks", "out"]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == NOTEBOOKS


def test_student_notebooks_without_nbformat_is_a_clear_error(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.delitem(sys.modules, "grpo_lab.teaching.student", raising=False)
    monkeypatch.setitem(sys.modules, "nbformat", None)  # import nbformat fails
    assert cli.main(["student-notebooks", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert re.fullmatch(
        r"grpo-lab student-notebooks: .*needs nbformat.*pip install nbformat.*\n", error
    )
    assert not (tmp_path / "out").exists()


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


@pytest.mark.slow
def test_the_wheel_ships_the_notebooks_and_the_installed_cli_copies_them(tmp_path):
    source = _source_tree(tmp_path / "source")
    wheel = _build_wheel(source, tmp_path / "wheels")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    shipped = sorted(
        name.removeprefix("grpo_lab/notebooks/")
        for name in names
        if name.startswith("grpo_lab/notebooks/")
    )
    assert shipped == NOTEBOOKS
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in names)
    assert "grpo_lab/cli_flags.json" in names  # the flags of a torch-free --help

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

    def installed(*arguments: str) -> str:
        return subprocess.run(
            [sys.executable, str(script), *arguments],
            cwd=work,
            env=environment,
            capture_output=True,
            text=True,
            check=True,
            timeout=300,
        ).stdout

    where = subprocess.run(
        [sys.executable, "-c", FIND_GRPO_LAB],
        cwd=work,
        env=environment,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert Path(where.strip()).is_relative_to(site)  # the installed copy runs
    assert f"{len(NOTEBOOKS)} notebooks copied" in installed("notebooks", "course")
    copied = sorted(path.name for path in (work / "course").iterdir())
    assert copied == NOTEBOOKS
    assert (work / "course" / NOTEBOOKS[0]).read_bytes() == (
        ROOT / "notebooks" / NOTEBOOKS[0]
    ).read_bytes()
    assert "(default: 0.0003" in installed("train", "--help")  # the table's values
    url = subprocess.run(
        [sys.executable, "-c", SOURCE_URL], cwd=work, env=environment,
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    assert url == "https://github.com/grpo-lab/grpo-lab"  # from the wheel's metadata
    installed("student-notebooks", "students")
    assert sorted(path.name for path in (work / "students").iterdir()) == NOTEBOOKS
