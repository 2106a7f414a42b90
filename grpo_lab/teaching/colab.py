"""The first code cell of every notebook: install grpo_lab when on Colab.

Colab starts each notebook in a bare runtime, so the notebook must install the
package itself; everywhere else the environment is already built (``make lab``)
and the cell does nothing. The cell cannot import grpo_lab (it is not there yet),
so its text is kept here and copied verbatim into each notebook;
``tests/test_notebook_policy.py`` checks every notebook carries it unchanged.
"""

from __future__ import annotations

import json
import tomllib
from importlib import metadata
from pathlib import Path

# [project.urls] in pyproject.toml is the one place the project's address is set;
# the README's badge and this cell use it (tests/test_notebook_policy.py).
SOURCE_LABEL = "Source"
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def source_url() -> str:
    """The project's repository, ``[project.urls] Source``: from the checkout's
    pyproject.toml when there is one (it is the truth there), else from the
    installed package's metadata (``Project-URL: Source, ...``)."""
    if PYPROJECT.is_file():
        project = tomllib.loads(PYPROJECT.read_text(encoding="utf-8")).get("project")
        if project and project.get("name") == "grpo-lab":
            return project["urls"][SOURCE_LABEL]
    for entry in metadata.metadata("grpo-lab").get_all("Project-URL") or []:
        label, _, url = entry.partition(",")
        if label.strip() == SOURCE_LABEL:
            return url.strip()
    raise LookupError(f"grpo-lab's metadata names no {SOURCE_LABEL} Project-URL")


COLAB_INSTALL_CELL = f'''\
# On Colab only: install grpo_lab into this runtime (elsewhere this cell does
# nothing). GRPO_LAB_SOURCE is what pip installs: this project's repository, or
# the path of a wheel or a folder you uploaded (e.g. /content/grpo_lab-*.whl).
import sys

GRPO_LAB_SOURCE = "git+{source_url()}"
if "google.colab" in sys.modules:
    if not GRPO_LAB_SOURCE:
        raise ValueError(
            "GRPO_LAB_SOURCE is empty: set it to this project's git URL or an "
            "uploaded wheel, then run this cell again"
        )
    %pip install --quiet "{{GRPO_LAB_SOURCE}}"'''

COLAB_CELL_ID = "colab-install"


def colab_cell() -> dict:
    """The install cell as an nbformat 4 code cell (no outputs, no count)."""
    return {
        "cell_type": "code",
        "execution_count": None,
        "id": COLAB_CELL_ID,
        "metadata": {"tags": ["colab"]},
        "outputs": [],
        "source": COLAB_INSTALL_CELL.splitlines(keepends=True),
    }


def add_colab_cell(path: str | Path) -> bool:
    """Put the install cell before the first code cell of the notebook at
    ``path`` (or refresh it there); True when the file changed."""
    path = Path(path)
    notebook = json.loads(path.read_text(encoding="utf-8"))
    cells = [c for c in notebook["cells"] if c.get("id") != COLAB_CELL_ID]
    first_code = next(i for i, c in enumerate(cells) if c["cell_type"] == "code")
    cells.insert(first_code, colab_cell())
    if cells == notebook["cells"]:
        return False
    notebook["cells"] = cells
    text = json.dumps(notebook, indent=1, ensure_ascii=False) + "\n"
    path.write_text(text, encoding="utf-8")
    return True
