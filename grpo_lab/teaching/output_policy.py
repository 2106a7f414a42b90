"""Course notebooks are saved without outputs: the JupyterLab hook ``make lab`` sets.

The README's policy is that notebooks are committed without outputs or
execution counts (``tests/test_notebook_policy.py``). JupyterLab's autosave would
otherwise write every run's outputs into the tracked files, so ``make lab``
starts the server with
``--ContentsManager.pre_save_hook=grpo_lab.teaching.output_policy.strip_outputs_before_save``:
the file on disk keeps the code and text, the open tab keeps its outputs until
it is reloaded. Only course notebooks (``NN_name.ipynb``) are stripped; a
notebook of the student's own keeps what it shows. Imports nothing heavy: the
server imports it at start.
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath
from typing import Any

COURSE_NOTEBOOK = re.compile(r"\d\d_[a-z0-9_]+\.ipynb")
# Notebook metadata that only records a run (the saved state of its widgets).
RUN_METADATA = ("widgets",)


def is_course_notebook(path: str) -> bool:
    """True for a course notebook's file name (``03_rewards_and_advantages.ipynb``)."""
    return COURSE_NOTEBOOK.fullmatch(PurePosixPath(path).name) is not None


def strip_outputs(notebook: dict[str, Any]) -> bool:
    """Clear every code cell's outputs and count, and run-only metadata, in
    place; True when anything was cleared."""
    changed = False
    for cell in notebook.get("cells", []):
        if cell.get("cell_type") != "code":
            continue
        changed |= bool(cell.get("outputs")) or cell.get("execution_count") is not None
        cell["outputs"], cell["execution_count"] = [], None
    metadata = notebook.get("metadata", {})
    for key in RUN_METADATA:
        changed |= metadata.pop(key, None) is not None
    return changed


def strip_outputs_before_save(model: dict[str, Any], path: str, **_: Any) -> None:
    """jupyter_server's ``pre_save_hook``: a course notebook is written without
    outputs (the contents ``model`` is changed in place)."""
    if model.get("type") == "notebook" and is_course_notebook(path):
        strip_outputs(model["content"])
