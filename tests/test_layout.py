"""The house: a textbook shelf and its wings; imports flow down only.

The top of ``grpo_lab/`` is the course, one module per notebook (the shelf);
every other job lives in a named wing. Floors, by a module's first dotted part:

1. the shelf: the lessons' modules, ``models`` and ``errors``; the math modules
   import torch, the standard library and the shelf only;
2. ``tasks``, ``rollouts``, ``rewards``, ``training``;
3. ``teaching``, ``integrations``;
4. ``instructor`` (course administration: teaching never imports it);
5. ``cli`` and the package's ``__init__`` on top.

Every import counts: at module level, inside functions, and under
``if TYPE_CHECKING:`` (an annotation's import is an arrow too). No module may
import a higher floor, and no chain of imports may close a circle.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "grpo_lab"
# The shelf, in the course's order; each module names the notebooks it serves.
SHELF = {
    "masks": "01",
    "logprobs": "02",
    "prefix_sharing": "07",
    "advantages": "03",
    "losses": "04 05 10",
    "aggregation": "06",
    "train_step": "07",
    "kl": "10",
    "sampler_correction": "11",
    "lora": "13",
}
SHELF_SUPPORT = {"models", "errors"}  # the tiny models and the one exception type
WINGS = {
    2: {"tasks", "rollouts", "rewards", "training"},
    3: {"teaching", "integrations"},
    4: {"instructor"},
    5: {"cli", "__init__"},
}
# Shelf modules that may import a library beside torch (models builds tokenizers
# and loads transformers' models).
THIRD_PARTY_ALLOWED = {
    "models": {"tokenizers", "transformers"},
    "lora": {"peft"},  # peft's LoraConfig for a run handed to TRL, when asked
}


def floor_of(part: str) -> int:
    """The floor of grpo_lab.<part> (its first dotted component)."""
    if part in SHELF or part in SHELF_SUPPORT:
        return 1
    for floor, parts in WINGS.items():
        if part in parts:
            return floor
    raise AssertionError(
        f"grpo_lab.{part} is on no floor: add it to tests/test_layout.py"
    )


def modules(package: Path = PACKAGE) -> list[Path]:
    return sorted(package.rglob("*.py"))


def all_imports(path: Path) -> set[str]:
    """Every module ``path`` imports anywhere: module level, functions,
    ``TYPE_CHECKING`` blocks. ``from a import b`` names ``a`` and ``a.b``."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return names


def runtime_imports(path: Path) -> set[str]:
    """:func:`all_imports` less those under ``if TYPE_CHECKING:`` (for the
    shelf's rule on libraries: an annotation loads nothing)."""
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
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def own_part(path: Path, package: Path = PACKAGE) -> str:
    return path.relative_to(package).parts[0].removesuffix(".py")


def test_the_top_level_lists_the_shelf_and_the_wings_only():
    entries = {
        p.name.removesuffix(".py")
        for p in PACKAGE.iterdir()
        if p.name != "__pycache__" and not p.name.startswith(".")
    }
    expected = set(SHELF) | SHELF_SUPPORT | set().union(*WINGS.values())
    assert entries == expected


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_flow_down_only(path):
    part = own_part(path)
    floor = floor_of(part)
    for name in all_imports(path):
        if name.startswith("grpo_lab."):
            target = name.split(".")[1]
            assert floor_of(target) <= floor, (
                f"{path.relative_to(ROOT)} (floor {floor}) imports {name}"
            )
    if floor > 1:
        return
    for name in runtime_imports(path):
        if not name.startswith("grpo_lab"):
            top = name.split(".")[0]
            allowed = (
                top == "torch"
                or top in sys.stdlib_module_names
                or top in THIRD_PARTY_ALLOWED.get(part, ())
            )
            assert allowed, f"shelf module {path.name} imports {name}"


def test_each_shelf_module_names_its_notebook():
    notebooks = {p.name[:2]: p.name for p in (ROOT / "notebooks").glob("*.ipynb")}
    for module, numbers in SHELF.items():
        text = (PACKAGE / f"{module}.py").read_text(encoding="utf-8")
        docstring = ast.get_docstring(ast.parse(text)) or ""
        for number in numbers.split():
            assert notebooks[number].removesuffix(".ipynb") in docstring, (
                f"grpo_lab/{module}.py's docstring does not name {notebooks[number]}"
            )


def test_the_layout_page_draws_the_shelf_and_every_wing():
    text = (ROOT / "docs" / "layout.md").read_text(encoding="utf-8")
    for module in set(SHELF) | SHELF_SUPPORT:
        assert f"{module}.py" in text, module
    for part in set().union(*WINGS.values()) - {"__init__"}:
        assert f"{part}/" in text, part
        for path in (PACKAGE / part).iterdir():
            if path.suffix == ".py" and path.stem not in {"__init__", "__main__"}:
                assert path.stem in text, f"{part}/{path.name} is not drawn"
            elif path.is_dir() and path.name != "__pycache__":
                assert f"{path.name}/" in text, f"{part}/{path.name}/ is not drawn"


# --- no import circle -----------------------------------------------------------------


def module_name(path: Path, root: Path = ROOT) -> str:
    """grpo_lab/training/config/fields.py -> grpo_lab.training.config.fields."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The package modules ``path`` imports anywhere (functions and
    ``TYPE_CHECKING`` blocks included). ``from grpo_lab.a import b`` names the
    module ``grpo_lab.a.b`` when there is one, else ``grpo_lab.a``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                whole = f"{node.module}.{alias.name}"
                found.add(whole if whole in known else node.module)
    return found & known


def import_graph(package: Path, root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, anywhere in it."""
    paths = {module_name(p, root): p for p in package.rglob("*.py")}
    known = set(paths)
    return {name: imported_modules(p, known) - {name} for name, p in paths.items()}


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every circle a depth-first walk of ``graph`` closes, as module names."""
    state: dict[str, str] = {}
    path: list[str] = []
    circles: list[list[str]] = []

    def walk(name: str) -> None:
        state[name] = "open"
        path.append(name)
        for target in sorted(graph[name]):
            if state.get(target) == "open":
                circles.append([*path[path.index(target) :], target])
            elif target not in state:
                walk(target)
        path.pop()
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            walk(name)
    return circles


def test_no_module_imports_itself_through_others():
    circles = import_circles(import_graph(PACKAGE))
    assert circles == [], "\n".join(" -> ".join(circle) for circle in circles)


def small_package(tmp_path: Path, files: dict[str, str]) -> Path:
    package = tmp_path / "grpo_lab"
    for name, text in {"__init__.py": "", **files}.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text)
    return package


def test_the_circle_check_finds_a_circle_through_a_function_level_import(tmp_path):
    package = small_package(
        tmp_path,
        {
            "training/__init__.py": "",
            "training/config.py": "from grpo_lab.training.trackers import check\n",
            "training/trackers.py": (
                "def check():\n    from grpo_lab.training.config import TrainConfig\n"
            ),
        },
    )
    assert import_circles(import_graph(package, root=tmp_path)) == [
        [
            "grpo_lab.training.config",
            "grpo_lab.training.trackers",
            "grpo_lab.training.config",
        ]
    ]


def test_the_circle_check_finds_a_circle_through_an_annotation_import(tmp_path):
    package = small_package(
        tmp_path,
        {
            "a.py": "from grpo_lab.b import f\n",
            "b.py": (
                "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                "    from grpo_lab.a import A\n"
            ),
        },
    )
    circles = import_circles(import_graph(package, root=tmp_path))
    assert circles == [["grpo_lab.a", "grpo_lab.b", "grpo_lab.a"]]


def test_the_floor_check_sees_an_upward_import_inside_a_function(tmp_path):
    module = tmp_path / "losses.py"
    module.write_text("def f():\n    from grpo_lab.training import loop\n")
    assert "grpo_lab.training.loop" in all_imports(module)
    assert floor_of("training") > floor_of("losses")


def test_teaching_never_imports_the_instructor_package():
    teaching = [p for p in modules() if own_part(p) == "teaching"]
    assert len(teaching) > 10, "too few teaching modules: the check reads elsewhere"
    for path in teaching:
        for name in all_imports(path):
            assert not name.startswith("grpo_lab.instructor"), (path.name, name)


# --- walls at seams: no formatter escapes but on data tables ----------------------------


def format_escapes_outside_tables(path: Path) -> list[int]:
    """Lines of ``path`` with ``fmt: skip`` that do not end an assignment of a
    literal table (a dict, list, tuple or set display)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    marked = {i + 1 for i, line in enumerate(lines) if "fmt: skip" in line}
    if not marked:
        return []
    tables = {
        node.end_lineno
        for node in ast.walk(ast.parse("\n".join(lines)))
        if isinstance(node, ast.Assign | ast.AnnAssign)
        and isinstance(node.value, ast.Dict | ast.List | ast.Tuple | ast.Set)
    }
    return sorted(marked - tables)


def test_format_escapes_only_on_data_tables():
    found = {
        str(p.relative_to(ROOT)): lines
        for p in modules()
        if (lines := format_escapes_outside_tables(p))
    }
    assert found == {}


def test_the_escape_check_refuses_an_escape_on_code(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        "TABLE = [\n    1,  2,\n]  # fmt: skip\nx = f(\n    1,  2)  # fmt: skip\n"
    )
    assert format_escapes_outside_tables(module) == [5]


def test_no_module_redirects_names_it_does_not_hold():
    """A moved name has one home: no module-level ``__getattr__`` but in a
    package's ``__init__`` (which loads its public names on first use)."""
    for path in modules():
        if path.name == "__init__.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        names = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]
        assert "__getattr__" not in names, path
