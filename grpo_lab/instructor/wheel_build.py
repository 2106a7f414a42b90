"""The wheel's build step: the notebooks it carries are student copies.

``pyproject.toml`` names :class:`StudentNotebooksBuildPy` as setuptools'
``build_py``. After the usual copy of the packages into the build folder, every
``grpo_lab/notebooks/*.ipynb`` there (the repository's course notebooks) is
replaced by its student copy (:func:`grpo_lab.instructor.student.student_copy`):
no solution, hidden test, walk-through cell or output reaches the wheel. The
course source stays in the repository's ``notebooks/``; the model answers
(``notebooks/model_answers.toml``) are not package data at all.

setuptools loads this file by its path, with no parent package imported and in
a build environment that may hold setuptools alone, so it reads
:mod:`grpo_lab.instructor.student` (standard library only) by path too.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

from setuptools.command.build_py import build_py

STUDENT_MODULE = Path(__file__).with_name("student.py")


def _student_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_grpo_lab_student", STUDENT_MODULE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def write_student_copies(folder: Path) -> list[Path]:
    """Replace every ``*.ipynb`` in ``folder`` by its student copy; their paths."""
    student = _student_module()
    replaced = []
    for path in sorted(folder.glob("*.ipynb")):
        notebook = json.loads(path.read_text(encoding="utf-8"))
        copy = student.student_copy(notebook, path.name)
        path.write_text(student.notebook_text(copy), encoding="utf-8")
        replaced.append(path)
    return replaced


class StudentNotebooksBuildPy(build_py):
    """setuptools' build_py, then the notebooks in the build folder stubbed."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install reads the checkout's notebooks/
        write_student_copies(Path(self.build_lib) / "grpo_lab" / "notebooks")
