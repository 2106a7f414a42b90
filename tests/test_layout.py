"""The house's floors: imports flow down only, and the README draws the real floors.

Floor 1 (the core) imports torch, the standard library and itself; floor 2
(training, rollouts, tasks, rewards, models) imports floors 1-2; floor 3
(teaching, integrations) imports floors 1-3; floor 4 (instructor: course
administration) imports floors 1-4, so teaching never imports it; the
command line sits on top.
Imports under ``if TYPE_CHECKING:`` are for annotations only and do not count.
"""

from __future__ import annotations

import ast
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
    "distillation",
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
    "math_verify_workers",
    "math_verify_template",
}
FLOOR_3 = {"teaching", "integrations"}
FLOOR_4 = {"instructor"}
FLOOR_5 = {"cli", "cli_config_file", "cli_course", "cli_flags", "hub", "__init__"}
# Packages inside a floor-2 or floor-3 folder whose modules the README names.
DRAWN_PACKAGES = (PACKAGE / "training" / "config",)


def floor_of(part: str) -> int:
    """The floor of grpo_lab.<part> (its first dotted component)."""
    floors = ((1, CORE), (2, FLOOR_2), (3, FLOOR_3), (4, FLOOR_4), (5, FLOOR_5))
    for floor, parts in floors:
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
    for part in CORE | FLOOR_2 | FLOOR_3 | FLOOR_4:
        suffix = "/" if (PACKAGE / part).is_dir() else ".py"
        assert f"grpo_lab/{part}{suffix}" in layout, part
    for path in PACKAGE.glob("*/*.py"):
        drawn = FLOOR_2 | FLOOR_3 | FLOOR_4
        if path.parent.name in drawn and path.stem != "__init__":
            assert path.stem in layout, f"{path.parent.name}/{path.name}"
    for package in DRAWN_PACKAGES:  # a package whose modules are drawn too
        assert f"{package.name}/" in layout, package.name
        for path in package.glob("*.py"):
            assert path.stem in layout or path.stem == "__init__", path.name


# --- no import circle -----------------------------------------------------------------


def module_name(path: Path, root: Path = ROOT) -> str:
    """grpo_lab/training/config/fields.py -> grpo_lab.training.config.fields."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_level_imports(path: Path, known: set[str]) -> set[str]:
    """The grpo_lab modules ``path`` imports at module level, those under
    ``if TYPE_CHECKING:`` included (an annotation's import is an edge too);
    imports inside functions are not (they run when called, once all is loaded).
    ``from grpo_lab.a import b`` names the module ``grpo_lab.a.b`` when there
    is one, else ``grpo_lab.a``."""
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    whole = f"{node.module}.{alias.name}"
                    found.add(whole if whole in known else node.module)
            elif isinstance(node, ast.If | ast.Try):
                visit(node.body)
                visit(node.orelse)
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(ast.parse(path.read_text(encoding="utf-8")).body)
    return found & known


def import_graph(package: Path, root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the package's modules it imports at module level."""
    paths = {module_name(p, root): p for p in package.rglob("*.py")}
    return {name: module_level_imports(p, set(paths)) for name, p in paths.items()}


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


def test_the_circle_check_finds_a_circle_through_an_annotation_import(tmp_path):
    package = tmp_path / "grpo_lab"
    (package / "training").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "training" / "__init__.py").write_text("")
    (package / "training" / "config.py").write_text(
        "from grpo_lab.training.trackers import check_report_to\n"
    )
    (package / "training" / "trackers.py").write_text(
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
        "    from grpo_lab.training.config import TrainConfig\n"
    )
    (package / "training" / "loop.py").write_text(
        "def train():\n    from grpo_lab.training import config\n"
    )
    graph = import_graph(package, root=tmp_path)
    assert graph["grpo_lab.training.loop"] == set()  # a call-time import
    assert import_circles(graph) == [
        ["grpo_lab.training.config", "grpo_lab.training.trackers",
         "grpo_lab.training.config"]
    ]  # fmt: skip


def imported_names(path: Path) -> set[str]:
    """Every module ``path`` imports anywhere (functions, TYPE_CHECKING too);
    ``from a import b`` names both ``a`` and ``a.b``."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return names


def test_teaching_never_imports_the_instructor_package():
    teaching = [p for p in modules() if own_part(p) == "teaching"]
    assert len(teaching) > 10, "too few teaching modules: the check reads elsewhere"
    for path in teaching:
        for name in imported_names(path):
            assert not name.startswith("grpo_lab.instructor"), (path.name, name)


def test_the_instructor_check_sees_an_import_inside_a_function(tmp_path):
    module = tmp_path / "explorer.py"
    module.write_text("def f():\n    from grpo_lab import instructor\n")
    assert "grpo_lab.instructor" in imported_names(module)
