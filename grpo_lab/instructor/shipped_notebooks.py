"""The course notebooks that ship with the package, and copying them out.

A wheel carries the *student copies* of the notebooks as
``grpo_lab/notebooks/*.ipynb`` (pyproject.toml maps the repository's
``notebooks/`` folder there, and :mod:`grpo_lab.instructor.wheel_build` stubs
their solutions at build time); a source checkout, and an editable install of
one, has the course source itself in ``notebooks/`` beside the package, solutions
included. ``grpo-lab notebooks DIR`` writes student copies into DIR from either
(:func:`grpo_lab.instructor.student.update_student_folder`).
The solved notebooks reach an instructor through ``grpo-lab instructor kit``
(:mod:`grpo_lab.instructor.instructor_kit`), from a checkout.
"""

from __future__ import annotations

import json
from pathlib import Path

from grpo_lab.instructor.student import is_solution_source

# The grpo_lab package folder (this file is grpo_lab/instructor/shipped_notebooks.py).
PACKAGE_DIR = Path(__file__).resolve().parents[1]


def shipped_notebooks_dir() -> Path:
    """The folder of this installation's notebooks.

    ``grpo_lab/notebooks/`` in an installed wheel; otherwise ``notebooks/`` of the
    source checkout the package is imported from (the folder beside
    ``pyproject.toml``). Raises FileNotFoundError when neither holds a notebook.
    """
    installed = PACKAGE_DIR / "notebooks"
    checkout = PACKAGE_DIR.parent / "notebooks"
    if any(installed.glob("*.ipynb")):
        return installed
    if (PACKAGE_DIR.parent / "pyproject.toml").is_file() and any(
        checkout.glob("*.ipynb")
    ):
        return checkout
    raise FileNotFoundError(
        f"no notebooks found in {installed} (an installed wheel) or {checkout} "
        "(a source checkout); reinstall grpo-lab from a wheel or a checkout"
    )


def course_notebooks_dir() -> Path:
    """The solved course notebooks the grader reads when given no folder: the
    checkout's ``notebooks/``. An installed wheel ships student copies only, so
    there ValueError says where the solved ones come from."""
    folder = shipped_notebooks_dir()
    if any(
        is_solution_source(_joined(cell.get("source", "")))
        for path in folder.glob("[0-9][0-9]_*.ipynb")
        for cell in json.loads(path.read_text("utf-8"))["cells"]
        if cell.get("cell_type") == "code"
    ):
        return folder
    raise ValueError(
        f"the notebooks in {folder} are student copies (no solution cell); grade "
        "against the instructor's kit: `grpo-lab instructor kit KIT` in a "
        "checkout of the course, then `grpo-lab grade ... --notebooks KIT/notebooks`"
    )


def _joined(source: str | list[str]) -> str:
    return "".join(source) if isinstance(source, list) else source
