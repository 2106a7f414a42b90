"""Every exercise is honest: its check refuses the package's own function (and
wrappers of it), a detached answer where a gradient is trained through, and a
stub as not attempted, while the notebook's own solution passes; and no cell
above an exercise's check shows the package function it asks for."""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest
import torch
from IPython.core.inputtransformer2 import TransformerManager

from grpo_lab.instructor.student import (
    BEGIN_MARKER,
    is_walk_through,
    strip_solutions,
    student_notebook,
)
from grpo_lab.teaching.checks import PACKAGE_COUNTERPARTS, ExerciseFailed
from grpo_lab.teaching.checks.framework import resolve

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))

# Checks whose answer is trained through: a detached answer must fail.
DIFFERENTIABLE = {
    "check_response_log_probs",
    "check_token_entropy",
    "check_clipped_loss",
    "check_sequence_ratio",
    "check_gspo_loss",  # 05-gspo_loss
    "check_aggregate_loss",
    "check_grpo_loss",
    "check_dapo_kl_loss",
    "check_corrected_loss",
    "check_device_token_loss",
    "check_lora_linear",
}


@dataclass(frozen=True)
class Exercise:
    notebook: str
    check_name: str
    function_name: str
    solution_cell: int
    check_cell: int

    def __str__(self) -> str:
        return f"{self.notebook[:2]}-{self.function_name}"


def python_of(source: str) -> str:
    """A cell's source as plain Python (IPython magics turned into calls)."""
    return TransformerManager().transform_cell(source)


def find_exercises(cells: list, notebook: str) -> list[Exercise]:
    """Each call ``check_x(function, ...)`` of a listed check, with the cell
    above it that defines ``function`` inside a solution block."""
    found = []
    for index, cell in enumerate(cells):
        if cell.cell_type != "code":
            continue
        for node in ast.walk(ast.parse(python_of(cell.source))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in PACKAGE_COUNTERPARTS
            ):
                name = node.args[0].id
                solution = _solution_cell(cells[:index], name)
                found.append(Exercise(notebook, node.func.id, name, solution, index))
    return found


def _solution_cell(cells: list, function_name: str) -> int:
    for index in reversed(range(len(cells))):
        source = cells[index].source
        if f"def {function_name}(" in source and (
            BEGIN_MARKER in source or "raise NotImplementedError()" in source
        ):
            return index
    raise AssertionError(f"no solution cell defines {function_name}")


def _read(path: Path) -> nbformat.NotebookNode:
    return nbformat.read(path, as_version=4)


EXERCISES = [
    exercise
    for path in NOTEBOOKS
    for exercise in find_exercises(_read(path).cells, path.name)
]


def test_every_listed_check_is_an_exercise_exactly_once():
    names = sorted(exercise.check_name for exercise in EXERCISES)
    assert names == sorted(PACKAGE_COUNTERPARTS)


def test_every_solution_block_belongs_to_a_checked_exercise():
    for path in NOTEBOOKS:
        cells = _read(path).cells
        solutions = {e.solution_cell for e in EXERCISES if e.notebook == path.name}
        for index, cell in enumerate(cells):
            if cell.cell_type == "code" and BEGIN_MARKER in cell.source:
                assert index in solutions, f"{path.name}, cell {index}: no check"


def _check(exercise: Exercise):
    module = {
        "check_greedy_continuation": "setup",
        "check_response_mask": "masks",
        "check_response_log_probs": "logprobs",
        "check_token_entropy": "logprobs",
        "check_group_normalized_advantages": "advantages",
        "check_clipped_loss": "losses",
        "check_sequence_ratio": "gspo",
        "check_gspo_loss": "gspo",  # 05-gspo_loss
        "check_aggregate_loss": "aggregation",
        "check_grpo_loss": "aggregation",
        "check_microbatch_losses": "train_step",
        "check_active_rows": "train_step",
        "check_microbatch_train_step": "train_step",
        "check_train_batch_slices": "loop",
        "check_rollout_batch_update": "loop",
        "check_robust_reward": "rewards",  # 08-robust_reward
        "check_cache_key": "loop",
        "check_dapo_kl_loss": "family",
        "check_device_token_loss": "scaling",
        "check_corrected_loss": "mismatch",
        "check_multi_turn_mask": "turns",
        "check_lora_linear": "lora",
        "check_distillation_loss": "distillation",
        "check_admitted_loss": "asynchronous",
    }[exercise.check_name]
    return resolve(f"grpo_lab.teaching.checks.{module}.{exercise.check_name}")


def _solution(exercise: Exercise, stubbed: bool = False):
    """The notebook's function, from its solution cell, run after the notebook's
    imports and earlier solution cells (which it may build on)."""
    cells = _read(NOTEBOOK_DIR / exercise.notebook).cells
    namespace: dict = {"__name__": "notebook_solution"}
    for cell in cells[: exercise.solution_cell]:
        if cell.cell_type == "code" and cell.get("id") != "colab-install":
            tree = ast.parse(python_of(cell.source))
            imports = [
                n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)
            ]
            exec(compile(ast.Module(imports, []), "imports", "exec"), namespace)
    for earlier in EXERCISES:
        if earlier.notebook == exercise.notebook and (
            earlier.solution_cell < exercise.solution_cell
        ):
            exec(cells[earlier.solution_cell].source, namespace)
    source = cells[exercise.solution_cell].source
    exec(strip_solutions(source) if stubbed else source, namespace)
    return namespace[exercise.function_name]


@pytest.mark.parametrize("exercise", EXERCISES, ids=str)
def test_the_notebook_solution_passes(exercise, capsys):
    assert _check(exercise)(_solution(exercise)) is True
    assert "correct" in capsys.readouterr().out


@pytest.mark.parametrize("exercise", EXERCISES, ids=str)
def test_a_stub_is_not_attempted(exercise, capsys):
    stub = _solution(exercise, stubbed=True)
    assert _check(exercise)(stub) is False
    assert "not attempted yet" in capsys.readouterr().out


def _package_wrappers(target):
    function = getattr(target, "fget", target)

    def calls_it(*args, **kwargs):
        return function(*args, **kwargs)

    return {
        "itself": function,
        "partial": functools.partial(function),
        "lambda": lambda *args, **kwargs: function(*args, **kwargs),
        "def": calls_it,
    }


@pytest.mark.parametrize("exercise", EXERCISES, ids=str)
def test_the_package_function_is_refused(exercise):
    """The function itself (or a partial of it) is refused by object; a call
    of it meets the stub the check puts in its place."""
    check = _check(exercise)
    for path in PACKAGE_COUNTERPARTS[exercise.check_name]:
        for how, wrapper in _package_wrappers(resolve(path)).items():
            with pytest.raises(ExerciseFailed) as failure:
                check(wrapper)
            message = (
                f"write it yourself: this check compares against {path}"
                if how in ("itself", "partial")
                else "is not available while this exercise is checked"
            )
            assert message in str(failure.value), (how, str(failure.value))


@pytest.mark.parametrize(
    "exercise", [e for e in EXERCISES if e.check_name in DIFFERENTIABLE], ids=str
)
def test_a_detached_answer_is_refused(exercise):
    solution = _solution(exercise)

    def detached(*args):
        return solution(*args).detach()

    with pytest.raises(ExerciseFailed, match="carries no gradient"):
        _check(exercise)(detached)


# --- answers above the check -------------------------------------------------------


SOURCE_VIEWERS = ("getsource", "getsourcelines", "getfile", "psource", "pinfo2")


def revealing_mentions(source: str, names: tuple[str, ...]) -> list[str]:
    """Where a cell shows the source of one of ``names``: inspect.getsource (or
    getsourcelines), a printed ``__code__``, IPython's ``name??`` / ``%psource``."""
    found = []
    for node in ast.walk(ast.parse(python_of(source))):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        called = func.attr if isinstance(func, ast.Attribute) else None
        called = func.id if isinstance(func, ast.Name) else called
        words = {
            n.id if isinstance(n, ast.Name) else n.attr
            for argument in node.args
            for n in ast.walk(argument)
            if isinstance(n, ast.Name | ast.Attribute)
        } | {
            word
            for argument in node.args
            if isinstance(argument, ast.Constant) and isinstance(argument.value, str)
            for word in re.findall(r"\w+", argument.value)
        }
        shows_source = called in SOURCE_VIEWERS or (
            called == "run_line_magic" and words & set(SOURCE_VIEWERS)
        )
        if called in ("print", "display") and "__code__" in words:
            shows_source = True
        if shows_source:
            found += [f"{called} of {name}" for name in sorted(words & set(names))]
    return found


def answers_above(cells: list, notebook: str) -> list[str]:
    """Cells above an exercise's check (the solution cell aside) that show the
    source of its package counterpart, and walk-through cells above every check."""
    problems = []
    exercises = find_exercises(cells, notebook)
    for exercise in exercises:
        names = tuple(
            path.rsplit(".", 1)[1] for path in PACKAGE_COUNTERPARTS[exercise.check_name]
        )
        for index, cell in enumerate(cells[: exercise.check_cell]):
            if cell.cell_type != "code" or index == exercise.solution_cell:
                continue
            for mention in revealing_mentions(cell.source, names):
                problems.append(
                    f"{notebook}, cell {index} ({cell.get('id')}): {mention}, above "
                    f"the check of {exercise.function_name} (cell {exercise.check_cell})"
                )
    first_check = min((e.check_cell for e in exercises), default=len(cells))
    for index, cell in enumerate(cells[:first_check]):
        if is_walk_through(cell):
            problems.append(
                f"{notebook}, cell {index} ({cell.get('id')}): a walk-through cell "
                "above every exercise's check"
            )
    return problems


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_answer_stands_above_its_check(path):
    notebook = _read(path)
    copy = student_notebook(notebook, path.name)
    problems = answers_above(notebook.cells, path.name)
    problems += answers_above(copy.cells, f"{path.name} (student copy)")
    assert not problems, "\n".join(problems)


def test_the_scan_finds_a_source_view_and_a_walk_through_above_a_check():
    cells = [
        nbformat.v4.new_code_cell(
            "print(inspect.getsource(masks.pad_prompt_and_response_ids))"
        ),
        nbformat.v4.new_code_cell(
            "batch = pad_prompt_and_response_ids([[1]], [[2]], 0)"
        ),
        nbformat.v4.new_code_cell(
            "def build(prompt_ids, response_ids, pad_token_id):\n"
            "    ### BEGIN SOLUTION\n    return None\n    ### END SOLUTION"
        ),
        nbformat.v4.new_code_cell("check_response_mask(build)"),
    ]
    cells[1].metadata["tags"] = ["walk-through"]
    problems = answers_above(cells, "demo.ipynb")
    assert len(problems) == 2
    assert "demo.ipynb, cell 0" in problems[0] and "getsource" in problems[0]
    assert "cell 1" in problems[1] and "walk-through" in problems[1]
    moved = cells[2:] + cells[:2]
    assert answers_above(moved, "demo.ipynb") == []
    for viewer in (
        "pad_prompt_and_response_ids??",
        "%psource pad_prompt_and_response_ids",
    ):
        cells[0].source = viewer
        assert "cell 0" in answers_above(cells, "demo.ipynb")[0]


def test_a_detached_gradient_check_is_not_fooled_by_a_constant():
    from grpo_lab.teaching.checks.gspo import check_sequence_ratio

    def geometric(policy_log_probs, old_log_probs, response_mask):
        log_ratio = (policy_log_probs - old_log_probs) * response_mask  # (B, T)
        return torch.exp(log_ratio.sum(1) / response_mask.sum(1).clamp_min(1))

    assert check_sequence_ratio(geometric) is True
    with pytest.raises(ExerciseFailed, match="carries no gradient"):
        check_sequence_ratio(lambda p, o, m: geometric(p.detach(), o, m))
