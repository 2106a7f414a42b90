"""Every committed notebook follows the course's conventions.

Policy: notebooks are committed without outputs; correctness lives in assert and
check cells, which nbval executes in CI.
"""

from __future__ import annotations

import json
import re
import sys
import types
from pathlib import Path

import pytest
from IPython.core.inputtransformer2 import TransformerManager

from grpo_lab.teaching.colab import COLAB_CELL_ID, COLAB_INSTALL_CELL, source_url

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
FORBIDDEN = {
    "pip install": re.compile(r"^\s*[!%]\s*pip\s+install", re.M),
    # A CUDA device chosen without asking whether one is there.
    "a hard-coded CUDA device": re.compile(
        r"""^(?!.*is_available\(\)).*(\.to\(|device\s*=\s*|torch\.device\()["']cuda""",
        re.M,
    ),
    "a download from the hub": re.compile(r"\bload_dataset\(|snapshot_download\("),
}


def _cells(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def _source(cell: dict) -> str:
    source = cell["source"]
    return source if isinstance(source, str) else "".join(source)


def test_there_are_ten_numbered_notebooks():
    names = [path.name for path in NOTEBOOKS]
    assert len(names) >= 10, names
    numbers = [int(name[:2]) for name in names]
    assert numbers[:10] == list(range(10)), names
    assert all(re.fullmatch(r"\d\d_[a-z0-9_]+\.ipynb", name) for name in names)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_without_outputs(path):
    for index, cell in enumerate(_cells(path)):
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [], f"cell {index} has stored outputs"
            assert cell["execution_count"] is None, f"cell {index} has a count"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_one_parameters_cell(path):
    tagged = [
        cell
        for cell in _cells(path)
        if "parameters" in cell.get("metadata", {}).get("tags", [])
    ]
    assert len(tagged) == 1
    assert "sizes_for_profile" in _source(tagged[0])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_has_an_exercise_followed_by_a_check(path):
    cells = _cells(path)
    exercise_indices = [
        index
        for index, cell in enumerate(cells)
        if "### BEGIN SOLUTION" in _source(cell) and cell["cell_type"] == "code"
    ]
    assert exercise_indices, "no exercise"
    code_after = [
        _source(cell)
        for cell in cells[exercise_indices[0] + 1 :]
        if cell["cell_type"] == "code"
    ]
    assert code_after and "check" in code_after[0]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_forbidden_patterns(path):
    # The Colab install cell is the one place a notebook may pip install.
    code = "\n".join(
        _source(c)
        for c in _cells(path)
        if c["cell_type"] == "code" and c.get("id") != COLAB_CELL_ID
    )
    for what, pattern in FORBIDDEN.items():
        assert not pattern.search(code), f"{path.name} contains {what}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_the_first_code_cell_installs_on_colab_only(path):
    code_cells = [c for c in _cells(path) if c["cell_type"] == "code"]
    assert code_cells[0].get("id") == COLAB_CELL_ID
    assert _source(code_cells[0]) == COLAB_INSTALL_CELL
    assert sum(c.get("id") == COLAB_CELL_ID for c in code_cells) == 1


class RecordingShell:
    """Stands in for IPython: records the line magics a cell runs."""

    def __init__(self):
        self.magics: list[tuple[str, str]] = []

    def run_line_magic(self, name, line, _stack_depth=1):
        self.magics.append((name, line))


def _run_install_cell(source: str, on_colab: bool, monkeypatch) -> RecordingShell:
    shell = RecordingShell()
    if on_colab:
        monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("colab"))
    else:
        monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    python = TransformerManager().transform_cell(source)
    exec(python, {"get_ipython": lambda: shell})
    return shell


def test_the_install_cell_does_nothing_off_colab(monkeypatch):
    assert _run_install_cell(COLAB_INSTALL_CELL, False, monkeypatch).magics == []


def test_the_install_cell_installs_the_project_url_on_colab(monkeypatch):
    source = f'GRPO_LAB_SOURCE = "git+{source_url()}"'
    assert source in COLAB_INSTALL_CELL
    shell = _run_install_cell(COLAB_INSTALL_CELL, True, monkeypatch)
    assert shell.magics == [("pip", 'install --quiet "{GRPO_LAB_SOURCE}"')]
    emptied = COLAB_INSTALL_CELL.replace(source, 'GRPO_LAB_SOURCE = ""')
    with pytest.raises(ValueError, match="GRPO_LAB_SOURCE is empty"):
        _run_install_cell(emptied, True, monkeypatch)


def test_the_project_url_is_set_once_and_the_readme_uses_it():
    import tomllib

    root = NOTEBOOK_DIR.parent
    pyproject = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
    url = pyproject["project"]["urls"]["Source"]
    assert source_url() == url and url.startswith("https://github.com/")
    readme = (root / "README.md").read_text(encoding="utf-8")
    repository = url.removeprefix("https://github.com/")
    badge = f"https://colab.research.google.com/github/{repository}/blob/main/rendered/"
    assert badge + "00_welcome_and_setup.ipynb" in readme
    assert f"git+{url}" in readme


def test_ipython_expands_the_source_into_the_pip_line(monkeypatch):
    from IPython.core.interactiveshell import InteractiveShell

    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("colab"))
    shell = InteractiveShell.instance()
    lines = []
    shell.register_magic_function(lines.append, "line", "pip")
    chosen = COLAB_INSTALL_CELL.replace(
        f'GRPO_LAB_SOURCE = "git+{source_url()}"',
        'GRPO_LAB_SOURCE = "/content/grpo_lab-0.1.0.whl"',
    )
    result = shell.run_cell(chosen)
    assert result.success
    assert lines == ['install --quiet "/content/grpo_lab-0.1.0.whl"']


def _run_notebook() -> dict:
    """A notebook as JupyterLab saves it after a run: outputs, counts, widgets."""
    output = {"output_type": "stream", "name": "stdout", "text": "1\n"}
    return {
        "cells": [
            {"cell_type": "markdown", "metadata": {}, "source": "# title"},
            {
                "cell_type": "code",
                "execution_count": 4,
                "metadata": {},
                "outputs": [output],
                "source": "print(1)",
            },
        ],
        "metadata": {"widgets": {"state": {}}, "kernelspec": {"name": "python3"}},
    }


def test_the_lab_saves_course_notebooks_without_outputs():
    from grpo_lab.teaching.output_policy import strip_outputs_before_save

    model = {"type": "notebook", "content": _run_notebook()}
    strip_outputs_before_save(model=model, path="notebooks/08_training_loop.ipynb")
    code = model["content"]["cells"][1]
    assert (code["outputs"], code["execution_count"]) == ([], None)
    assert model["content"]["metadata"] == {"kernelspec": {"name": "python3"}}
    assert model["content"]["cells"][0]["source"] == "# title"
    # A notebook of the student's own keeps its outputs, and so does a file.
    mine = {"type": "notebook", "content": _run_notebook()}
    strip_outputs_before_save(model=mine, path="my_experiments.ipynb")
    assert mine["content"] == _run_notebook()
    text = {"type": "file", "content": "08_x.ipynb"}
    strip_outputs_before_save(model=text, path="08_x.ipynb")
    assert text["content"] == "08_x.ipynb"


def test_make_lab_instructor_sets_the_save_hook():
    # The course source is saved without outputs; a student's own folder keeps them.
    makefile = (NOTEBOOK_DIR.parent / "Makefile").read_text(encoding="utf-8")
    hook = "grpo_lab.teaching.output_policy.strip_outputs_before_save"
    assert f"LAB_SAVE_HOOK := --ContentsManager.pre_save_hook={hook}" in makefile
    line = makefile.split("LAB_INSTRUCTOR_COMMAND =", 1)[1].splitlines()[0]
    assert "notebooks/" in line and "$(LAB_SAVE_HOOK)" in line
    student = makefile.split("\nLAB_COMMAND =", 1)[1].splitlines()[0]
    assert "$(LAB_DIR)/" in student and "$(LAB_SAVE_HOOK)" not in student


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_training_cells_show_progress(path):
    # progress=False is for CI and tests; a student sees every run's bar.
    code = "\n".join(_source(c) for c in _cells(path) if c["cell_type"] == "code")
    assert not re.search(r"progress\s*=\s*False", code)


@pytest.mark.slow
def test_a_training_run_in_a_kernel_draws_notebook_bars():
    import nbclient
    import nbformat

    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_code_cell(
            "import tempfile\n"
            "from grpo_lab.training import TrainConfig, train\n"
            "run_dir = tempfile.mkdtemp() + '/run'\n"
            "train(TrainConfig.for_profile('smoke', run_dir=run_dir, steps=1))"
        )
    ]
    nbclient.NotebookClient(notebook, timeout=240, kernel_name="python3").execute()
    bars = [
        output["data"]["text/plain"]
        for output in notebook.cells[0].outputs
        if "application/vnd.jupyter.widget-view+json" in output.get("data", {})
    ]  # tqdm.auto's widget bars, one per bar
    assert [bar.split(":")[0] for bar in bars] == [
        "SFT warm-up",
        "evaluation at step 0",
        "GRPO",
        "evaluation at step 1",
    ]
