"""The rendered copies in rendered/ are the student copies of the current course
notebooks, executed: made from the current cells (their recorded hash), with
outputs, with no solution, hidden test or model answer, and linked from the
README. After a notebook changes: ``make rendered NOTEBOOKS=NN``."""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook
from test_shipped_notebooks import assert_no_solution_and_no_answer

from grpo_lab.instructor.rendered import RENDERED_DIR, SOURCE_DIR, render
from grpo_lab.instructor.student import (
    BEGIN_HIDDEN,
    STUB,
    course_cells_hash,
    made_from,
)

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(SOURCE_DIR.glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.parametrize("source", SOURCES, ids=lambda path: path.name[:2])
def test_each_rendered_copy_was_made_from_the_current_cells(source):
    rendered = RENDERED_DIR / source.name
    again = f"make rendered NOTEBOOKS={source.name[:2]}"
    assert rendered.is_file(), f"{rendered.name} is not rendered: {again}"
    copy = json.loads(rendered.read_text(encoding="utf-8"))
    current = course_cells_hash(json.loads(source.read_text(encoding="utf-8")))
    assert made_from(copy) == current, f"{source.name} changed since: {again}"
    code = [cell for cell in copy["cells"] if cell["cell_type"] == "code"]
    assert all(cell["execution_count"] for cell in code), "not executed to the end"
    assert any(cell["outputs"] for cell in code)
    text = rendered.read_text(encoding="utf-8")
    assert BEGIN_HIDDEN not in text
    assert_no_solution_and_no_answer({source.name: text})


def test_no_rendered_copy_is_left_from_a_notebook_that_is_gone():
    names = {path.name for path in RENDERED_DIR.glob("*.ipynb")}
    assert names == {path.name for path in SOURCES}


def test_the_readme_links_each_rendered_copy():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for source in SOURCES:
        assert f"(rendered/{source.name})" in readme, source.name


@pytest.mark.slow
def test_render_executes_the_student_copy_on_the_cpu_profile(tmp_path):
    solved = "def f():\n    ### BEGIN SOLUTION\n    return 42\n    ### END SOLUTION"
    cells = [
        new_code_cell(solved),
        new_code_cell("import os\nprint(os.environ['GRPO_LAB_PROFILE'])"),
    ]
    source = tmp_path / "00_demo.ipynb"
    nbformat.write(new_notebook(cells=cells), source)
    rendered = nbformat.read(render(source, tmp_path / "out"), as_version=4)
    assert STUB in rendered.cells[0].source and "42" not in rendered.cells[0].source
    assert rendered.cells[1].outputs[0]["text"] == "cpu\n"
    assert made_from(rendered) == course_cells_hash(
        json.loads(source.read_text(encoding="utf-8"))
    )
