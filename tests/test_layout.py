"""The house's floors: imports flow down only, and the README draws the real floors.

Floor 1 (the core) imports torch, the standard library and itself; floor 2
(training, rollouts, tasks, rewards, models) imports floors 1-2; floor 3
(teaching, integrations) imports floors 1-3; the command line sits on top.
Imports under ``if TYPE_CHECKING:`` are for annotations only and do not count.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "grpo_lab"
CORE = {
    "masks",
    "logprobs",
    "prefix_sharing",
    "advantages",
    "objectives",
    "losses",
    "kl",
    "sampler_correction",
    "train_step",
}
FLOOR_2 = {
    "training",
    "rollouts",
    "tasks",
    "rewards",
    "models",
    "errors",
    "grading_worker",
}
FLOOR_3 = {"teaching", "integrations"}
FLOOR_4 = {"cli", "cli_flags", "hub", "__init__"}


def floor_of(part: str) -> int:
    """The floor of grpo_lab.<part> (its first dotted component)."""
    for floor, parts in ((1, CORE), (2, FLOOR_2), (3, FLOOR_3), (4, FLOOR_4)):
        if part in parts:
            return floor
    raise AssertionError(
        f"grpo_lab.{part} is on no floor: add it to tests/test_layout.py"
    )


def modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "notebooks" not in p.parts)


def runtime_imports(path: Path) -> set[str]:
    """Modules ``path`` imports when it runs (not under ``if TYPE_CHECKING``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for node in ast.walk(block)
    }
    names = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def own_part(path: Path) -> str:
    return path.relative_to(PACKAGE).parts[0].removesuffix(".py")


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_flow_down_only(path):
    part = own_part(path)
    floor = floor_of(part)
    for name in runtime_imports(path):
        if name.startswith("grpo_lab."):
            target = name.split(".")[1]
            assert floor_of(target) <= floor, (
                f"{path.name} (floor {floor}) imports {name}"
            )
        elif floor == 1:
            top = name.split(".")[0]
            allowed = top == "torch" or top in sys.stdlib_module_names
            assert allowed, f"core module {path.name} imports {name}"


def test_the_readme_draws_every_floor_and_module():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    layout = text.split("Imports flow down only:", 1)[1].split("```", 2)[1]
    for part in CORE | FLOOR_2 | FLOOR_3:
        suffix = "/" if (PACKAGE / part).is_dir() else ".py"
        assert f"grpo_lab/{part}{suffix}" in layout, part
    for path in PACKAGE.glob("*/*.py"):
        if path.parent.name in FLOOR_2 | FLOOR_3 and path.stem != "__init__":
            assert path.stem in layout, f"{path.parent.name}/{path.name}"


# An absolute path of the machine the project was built or run on: a home or
# work folder, the temp folder's pytest and runner folders. Spelled here with a
# class ([w]) so that this file does not match itself.
MACHINE_PATH = re.compile(
    r"(?<![\w.~-])(/[w]ork/|/[r]oot/|/[h]ome/\w|/[U]sers/\w|/[t]mp/|"
    r"/[p]rivate/var/|/var/[f]olders/|[A-Z]:\\[U]sers\\)"
)


def tracked_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode()
    return [ROOT / name for name in listed.split("\0") if name]


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="not a git checkout")
def test_no_tracked_file_holds_an_absolute_path_of_this_machine():
    found = []
    for path in tracked_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError):
            continue  # binary, or deleted in the work tree
        for number, line in enumerate(text.splitlines(), 1):
            if MACHINE_PATH.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}")
    assert found == [], "\n".join(found)


@pytest.mark.parametrize(
    "line",
    ['"--out", "/w' + 'ork/notes/x.json"', "cd /r" + "oot/repo", "C:\\" + "Users\\me"],
)
def test_the_absolute_path_check_catches(line):
    assert MACHINE_PATH.search(line)


def test_the_readme_counts_the_notebooks():
    opening = (ROOT / "README.md").read_text(encoding="utf-8").split("##", 1)[0]
    count = len(list((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")))
    assert f" {count} Jupyter notebooks" in opening, f"there are {count}"
