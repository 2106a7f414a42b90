"""The course notebooks that ship with the package, and copying them out.

A wheel carries the notebooks as ``grpo_lab/notebooks/*.ipynb`` (pyproject.toml
maps the repository's ``notebooks/`` folder there at build time); a source
checkout, and an editable install of one, has them in ``notebooks/`` beside the
package. ``grpo-lab notebooks DIR`` copies them into DIR, and ``grpo-lab
student-notebooks`` reads them when it is given no ``--source``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

# The grpo_lab package folder (this file is grpo_lab/teaching/shipped_notebooks.py).
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


def copy_notebooks(out_dir: str | Path, overwrite: bool = False) -> list[Path]:
    """Copy every shipped ``*.ipynb`` into ``out_dir`` (created); the copies' paths.

    Only the contents are copied, so the copies are writable even when the
    installation is not. A notebook already in ``out_dir`` (perhaps a student's
    work) is kept unless ``overwrite``: then nothing is copied and
    FileExistsError names the notebooks in the way.
    """
    sources = sorted(shipped_notebooks_dir().glob("*.ipynb"))
    out_dir = Path(out_dir)
    in_the_way = [path.name for path in sources if (out_dir / path.name).exists()]
    if in_the_way and not overwrite:
        raise FileExistsError(
            f"{out_dir} already holds {', '.join(in_the_way)}; "
            "pass --force to overwrite them"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    copied = []
    for source in sources:
        target = out_dir / source.name
        shutil.copyfile(source, target)
        copied.append(target)
    return copied
