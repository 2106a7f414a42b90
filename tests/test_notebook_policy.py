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

from grpo_lab.teaching.colab import COLAB_CELL_ID, COLAB_INSTALL_CELL

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


def test_the_install_cell_asks_for_a_source_then_pip_installs_it(monkeypatch):
    with pytest.raises(ValueError, match="GRPO_LAB_SOURCE is empty"):
        _run_install_cell(COLAB_INSTALL_CELL, True, monkeypatch)
    chosen = COLAB_INSTALL_CELL.replace(
        'GRPO_LAB_SOURCE = ""', 'GRPO_LAB_SOURCE = "git+https://example.org/lab.git"'
    )
    shell = _run_install_cell(chosen, True, monkeypatch)
    assert shell.magics == [("pip", 'install --quiet "{GRPO_LAB_SOURCE}"')]


def test_ipython_expands_the_source_into_the_pip_line(monkeypatch):
    from IPython.core.interactiveshell import InteractiveShell

    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("colab"))
    shell = InteractiveShell.instance()
    lines = []
    shell.register_magic_function(lines.append, "line", "pip")
    chosen = COLAB_INSTALL_CELL.replace(
        'GRPO_LAB_SOURCE = ""', 'GRPO_LAB_SOURCE = "/content/grpo_lab-0.1.0.whl"'
    )
    result = shell.run_cell(chosen)
    assert result.success
    assert lines == ['install --quiet "/content/grpo_lab-0.1.0.whl"']
