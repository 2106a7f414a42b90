"""Every committed notebook follows the course's conventions.

Policy: notebooks are committed without outputs; correctness lives in assert and
check cells, which nbval executes in CI.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

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
    code = "\n".join(_source(c) for c in _cells(path) if c["cell_type"] == "code")
    for what, pattern in FORBIDDEN.items():
        assert not pattern.search(code), f"{path.name} contains {what}"
