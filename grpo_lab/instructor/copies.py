"""Which answers are copies: of the kit's solution, or of a neighbour's.

The grader (:mod:`grpo_lab.instructor.grading`) compares each student's answer
to an exercise (the cell that defines its function) with the course's own
solution and with every other student's answer to it, by a normalised syntax
tree (:func:`fingerprint`): the functions the cell defines, with every name
(variables, arguments, the functions' own) replaced by its order of first
appearance, every constant by one placeholder, and docstrings, annotations
and comments gone. Attribute and keyword names stay (``.std(dim=1)`` is what
the code does). Two answers whose normalised trees are the same are flagged
in the CSV's ``flag`` column, naming what they match, when the student's code
(the functions' bodies) holds at least MIN_COPY_NODES nodes: an exercise whose
right answer is a line or two is answered alike by students who never met,
and is never flagged.

A match of the package's own source (the function an exercise re-implements)
is :func:`grpo_lab.instructor.grading_refusal.pasted_counterpart`'s. A copy
with its statements reordered, or a line added, is not the same tree, and is
not flagged: the flag is for the instructor's eye, never a grade.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping

# Nodes of the student's own code (the functions' bodies, docstrings and
# expression contexts aside) below which two equal answers are not flagged.
MIN_COPY_NODES = 50
KIT_MATCH = "matches the kit's solution"
_PLACEHOLDER = "constant"


class _Normalise(ast.NodeTransformer):
    """Names by order of first appearance, constants one placeholder,
    docstrings and annotations dropped."""

    def __init__(self) -> None:
        self.names: dict[str, str] = {}

    def _name(self, name: str) -> str:
        return self.names.setdefault(name, f"n{len(self.names)}")

    def visit_Name(self, node: ast.Name) -> ast.AST:
        return ast.Name(self._name(node.id), node.ctx)

    def visit_arg(self, node: ast.arg) -> ast.AST:
        return ast.arg(self._name(node.arg))

    def visit_Constant(self, node: ast.Constant) -> ast.AST:
        return ast.Constant(_PLACEHOLDER)

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> ast.AST:
        node.name = self._name(node.name)
        node.returns = None
        node.decorator_list = [self.visit(d) for d in node.decorator_list]
        node.body = _without_docstring(node.body)
        node.args = self.visit(node.args)
        node.body = [self.visit(statement) for statement in node.body]
        return node

    visit_FunctionDef = _function
    visit_AsyncFunctionDef = _function

    def visit_AnnAssign(self, node: ast.AnnAssign) -> ast.AST:
        if node.value is None:
            return ast.Pass()
        return self.visit(ast.Assign([node.target], node.value))


def _without_docstring(body: list[ast.stmt]) -> list[ast.stmt]:
    first = body[0] if body else None
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        return body[1:] or [ast.Pass()]
    return body


def _size(statements: list[ast.stmt]) -> int:
    """Nodes under ``statements``, expression contexts aside."""
    return sum(
        not isinstance(node, ast.expr_context)
        for statement in statements
        for node in ast.walk(statement)
    )


def fingerprint(source: str, function_name: str) -> tuple[str, int] | None:
    """``(normalised tree, size)`` of the functions ``source`` defines at
    its top level, the exercise's ``function_name`` among them; None when it
    does not parse or does not define it. The size counts the functions'
    bodies only (the signature is the course's)."""
    try:
        return _fingerprint(ast.parse(source), function_name)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None  # not Python, or nested past what the parser follows


def _fingerprint(tree: ast.Module, function_name: str) -> tuple[str, int] | None:
    functions = [
        node
        for node in tree.body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]
    if function_name not in {f.name for f in functions}:
        return None
    normaliser = _Normalise()
    normalised = [normaliser.visit(function) for function in functions]
    size = sum(_size(function.body) for function in normalised)
    dumped = "\n".join(ast.dump(f, annotate_fields=False) for f in normalised)
    return dumped, size


def copy_flags(
    answers: Mapping[str, Mapping[str, str]], kit: Mapping[str, str]
) -> dict[tuple[str, str], str]:
    """``{(student, exercise id): flag}`` for each answer (``answers``:
    exercise id -> student -> the source of the cell defining its function)
    that is the same tree as the kit's solution (``kit``: exercise id ->
    source) or as other students' answers, at least MIN_COPY_NODES big."""
    flags: dict[tuple[str, str], str] = {}
    for exercise_id, by_student in answers.items():
        function_name = exercise_id.split("-", 1)[1]
        prints = {
            student: fingerprint(source, function_name)
            for student, source in by_student.items()
        }
        alike: dict[str, list[str]] = {}
        for student, found in prints.items():
            if found is not None and found[1] >= MIN_COPY_NODES:
                alike.setdefault(found[0], []).append(student)
        kit_print = fingerprint(kit.get(exercise_id, ""), function_name)
        for tree, students in alike.items():
            for student in students:
                same = sorted(other for other in students if other != student)
                named = [KIT_MATCH] if kit_print and kit_print[0] == tree else []
                if same:
                    whose = "answer of" if len(same) == 1 else "answers of"
                    named.append(f"matches the {whose} {', '.join(same)}")
                if named:
                    flags[(student, exercise_id)] = "; ".join(named)
    return flags
