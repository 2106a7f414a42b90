"""The instructor's kit: solved notebooks, solutions key and model answers.

``grpo-lab instructor kit KIT`` writes, from the course source (a checkout of
the repository: its ``notebooks/`` hold the solutions, as nbgrader's
``source/`` does)::

    KIT/notebooks/NN_*.ipynb   the solved course notebooks, as they are
    KIT/model_answers.toml     the written questions' model answers
    KIT/solutions.md           the solutions key (every solution cell, every answer)

The wheel and ``grpo-lab notebooks`` carry the student copies only, so this is
the one way the solutions leave the source tree. An instructor who installed
the wheel grades with the kit: ``grpo-lab grade SUBMISSIONS --out grades.csv
--notebooks KIT/notebooks``. Keep KIT where students cannot read it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from grpo_lab.instructor.rubric import MODEL_ANSWERS_NAME, load_rubric
from grpo_lab.instructor.shipped_notebooks import PACKAGE_DIR
from grpo_lab.instructor.student import is_solution_source

KIT_NOTEBOOKS = "notebooks"
KIT_KEY = "solutions.md"


def course_source(source: str | Path | None = None) -> Path:
    """The course source's ``notebooks/`` folder (default: the checkout this
    package is imported from); ValueError when it holds no solution cell or no
    model answers (an installed wheel has neither)."""
    root = PACKAGE_DIR.parent if source is None else Path(source)
    folder = root / "notebooks" if (root / "notebooks").is_dir() else root
    notebooks = sorted(folder.glob("[0-9][0-9]_*.ipynb"))
    solved = any(
        is_solution_source(_source_text(cell))
        for path in notebooks
        for cell in json.loads(path.read_text("utf-8"))["cells"]
        if cell.get("cell_type") == "code"
    )
    if not solved or not (folder / MODEL_ANSWERS_NAME).is_file():
        raise ValueError(
            f"source must be a checkout of the course (notebooks/ with solution "
            f"cells and {MODEL_ANSWERS_NAME}), got {str(root)!r}; an installed "
            "wheel carries student copies only: pass --source CHECKOUT"
        )
    return folder


def _source_text(cell: dict) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else source


def write_kit(
    out_dir: str | Path, source: str | Path | None = None, overwrite: bool = False
) -> list[Path]:
    """Write the kit into ``out_dir``; the paths written. A kit already there is
    kept unless ``overwrite`` (FileExistsError)."""
    from grpo_lab.instructor.solutions_key import solutions_key

    folder = course_source(source)
    out_dir = Path(out_dir)
    if (out_dir / KIT_KEY).exists() and not overwrite:
        raise FileExistsError(f"{out_dir} already holds a kit; pass --force")
    rubric = load_rubric(answers=folder / MODEL_ANSWERS_NAME)
    key = solutions_key(folder, rubric)
    (out_dir / KIT_NOTEBOOKS).mkdir(parents=True, exist_ok=True)
    written = []
    for path in sorted(folder.glob("[0-9][0-9]_*.ipynb")):
        target = out_dir / KIT_NOTEBOOKS / path.name
        shutil.copyfile(path, target)  # saved without outputs (the README's policy)
        written.append(target)
    answers = out_dir / MODEL_ANSWERS_NAME
    shutil.copyfile(folder / MODEL_ANSWERS_NAME, answers)
    (out_dir / KIT_KEY).write_text(key, encoding="utf-8")
    return [*written, answers, out_dir / KIT_KEY]
