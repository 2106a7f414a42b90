"""How the grader refuses the package's own answer, and flags a pasted one.

In a grading kernel :func:`install` puts :func:`refuse_package_object` in the
place of :func:`grpo_lab.teaching.checks.framework.refuse_package_function`:
the exercise's counterparts are hidden while the student's code runs (see
:mod:`grpo_lab.instructor.grading_kernel`), so a call of one of them, by any path,
already fails with "not available while this exercise is graded"; what is left
to refuse is a solution that *is* the package function (an alias, a partial, a
wrapper). Names in comments, docstrings and strings, and a student's own
function that happens to share a package function's name, are not refused.

:func:`pasted_counterpart` runs in the grader: it says which package function
a solution's syntax tree matches once names, docstrings and comments are set
aside, for the instructor's eye (the CSV's ``flag`` column).
"""

from __future__ import annotations

import ast
import difflib
import inspect
import sys
import textwrap
from collections.abc import Callable
from typing import Any

# The share of the normalised syntax tree two functions must have in common to
# be flagged as one pasted from the other.
SIMILARITY_FLAG = 0.9


def refuse_package_object(student_fn: Callable[..., Any], check_name: str) -> None:
    """Raise ExerciseFailed when ``student_fn`` is, or wraps, a counterpart."""
    from grpo_lab.teaching.checks.exercises import PACKAGE_COUNTERPARTS
    from grpo_lab.teaching.checks.framework import ExerciseFailed, _unwrapped, resolve

    for path in PACKAGE_COUNTERPARTS[check_name]:
        target = resolve(path)
        targets = (target, getattr(target, "fget", target))
        if any(c is t for c in _unwrapped(student_fn) for t in targets):
            name = getattr(student_fn, "__name__", type(student_fn).__name__)
            raise ExerciseFailed(
                f"write it yourself: this check compares against {path}, and "
                f"{name} is that function"
            )


def install(scratch: str) -> None:
    """Use :func:`refuse_package_object` in the checks, and a fresh Python
    process confined as the student's own is (working in ``scratch``) for a
    check that calls the student's function in one (a grading kernel only)."""
    from grpo_lab.teaching.checks import framework

    framework.refuse_package_function = refuse_package_object
    confined = [sys.executable, "-m", "grpo_lab.instructor.sandbox"]
    confined += ["--solution", scratch, "--", sys.executable]
    framework.fresh_python = lambda: list(confined)


class _Normalise(ast.NodeTransformer):
    """Names become their order of first appearance; docstrings are dropped."""

    def __init__(self) -> None:
        self.names: dict[str, str] = {}

    def _name(self, name: str) -> str:
        return self.names.setdefault(name, f"n{len(self.names)}")

    def visit_Name(self, node: ast.Name) -> ast.AST:
        return ast.copy_location(ast.Name(self._name(node.id), node.ctx), node)

    def visit_arg(self, node: ast.arg) -> ast.AST:
        return ast.arg(self._name(node.arg))

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.AST:
        node.name = self._name(node.name)
        node.returns = None
        body = node.body
        if (
            body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            body = body[1:] or [ast.Pass()]
        node.body = body
        self.generic_visit(node)
        return node

    def visit_AnnAssign(self, node: ast.AnnAssign) -> ast.AST:
        if node.value is None:
            return ast.Pass()
        return self.visit(ast.Assign([node.target], node.value))


def normalised_body(source: str) -> list[str]:
    """One normalised line per statement of the function(s) defined in source."""
    tree = ast.parse(textwrap.dedent(source))
    functions = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    lines = []
    for function in functions:
        normal = _Normalise().visit(function)
        for statement in ast.walk(normal):
            if isinstance(statement, ast.stmt) and not isinstance(
                statement, ast.FunctionDef
            ):
                lines.append(ast.dump(statement, annotate_fields=False))
    return lines


def import_counterparts(check_names: tuple[str, ...]) -> None:
    """Import every counterpart of ``check_names`` now, in this thread: a
    lazy module (transformers') imported for the first time from two threads
    at once can fail in one of them."""
    from grpo_lab.teaching.checks.exercises import PACKAGE_COUNTERPARTS
    from grpo_lab.teaching.checks.framework import resolve

    for check_name in check_names:
        for path in PACKAGE_COUNTERPARTS.get(check_name, ()):
            resolve(path)


def pasted_counterpart(solution_source: str, check_names: tuple[str, ...]) -> str:
    """The dotted path of the counterpart the solution's statements match, or ""."""
    from grpo_lab.teaching.checks.exercises import PACKAGE_COUNTERPARTS
    from grpo_lab.teaching.checks.framework import resolve

    try:
        student = normalised_body(solution_source)
    except SyntaxError:
        return ""
    if not student:
        return ""
    for check_name in check_names:
        for path in PACKAGE_COUNTERPARTS.get(check_name, ()):
            target = resolve(path)
            target = getattr(target, "fget", target)
            try:
                reference = normalised_body(inspect.getsource(target))
            except (OSError, TypeError, SyntaxError):
                continue
            ratio = difflib.SequenceMatcher(None, student, reference).ratio()
            if reference and ratio >= SIMILARITY_FLAG:
                return path
    return ""
