"""The grading kernel's side: the course's check out of the student's reach.

The grader (:mod:`grpo_lab.instructor.grading`) runs :func:`bootstrap` in each fresh
kernel before any student code. It takes the result channel (a file descriptor
the grader opened and named in ``GRPO_LAB_RESULT_FD``, which it removes from
the environment), and keeps its own references to ``os.write`` and to the JSON
string encoder.

Once the course's context cells have run (trusted, before any student code),
:func:`prepare` imports what the notebook's check cells import and records the
state of the modules a verdict depends on (``torch`` and the comparison
functions, ``json``, ``builtins``, every ``grpo_lab`` module, their functions'
code and their classes' attributes). The kernel is then the pristine parent:
for the first exercise :func:`grade` forks a child
(:class:`grpo_lab.instructor.grading_child.Child`) that holds none of the
parent's descriptors, secrets or memory access, and every student cell runs
there (:func:`student_part`: the cells not run yet, in the child's namespace,
so a helper in one cell is there for the next; a later exercise reuses the
child). The parent runs the course's check cell itself, in a copy of its own
namespace, with the student's function replaced by a
:class:`~grpo_lab.instructor.grading_child.RemoteFunction` that calls it in the
child (values, arguments' state and gradients come back as plain data), so a
patched check, torch comparison, ``json`` or private state of this module
changes the child only. What the child says can only lower a verdict: a cell
that raised, a missing or refused function, a change its guard saw.

The guard still runs inside the child, where it names the trick it sees: the
recorded state is compared, and put back, after each student cell and before
and after each call of the student's function; any change (a patched check,
``torch.allclose``, ``json``, a code object), a torch function or dispatch mode
left on, a trace function or a new thread makes the exercise an ``error`` whose
message starts with ``TAMPERED_PREFIX`` (the grader then starts a fresh kernel).
What the student's function returns must be built of plain types (tensors,
numbers, strings, containers). An exception raised inside the student's
function is a ``fail`` with its message; the cases the check counted come back
with the verdict, for partial credit. A child that died or sent what the parent
does not read makes the exercise an ``error`` (and the kernel is replaced),
and so does a student's folder grown past its quota (measured after each
exercise by :func:`grpo_lab.instructor.tree_limits.folder_over`, for where
the folder is not a size-capped tmpfs).

While the student's cells run, the package counterparts of every check of the
notebook, and while the student's function runs, the exercise's package
counterparts (``PACKAGE_COUNTERPARTS``) and the functions of their own module
they call (the private helpers, registries included) raise "not available while
this exercise is graded", whatever path reaches them: their code objects are
swapped in the child, so getattr, importlib, sys.modules and a saved reference
all meet the same stub. This hiding is in-process defence (inside the child);
the verdict is not.

Exactly one line per exercise is written to the channel by the parent,
``[sequence, outcome, message, cases passed, cases run]``. The grader counts a
verdict only when the line is the only one of its cell and carries the expected
sequence number, and the cell itself ended cleanly; printed text and writes to
file descriptors 1 and 2 are not read. :func:`run_exercise` and
:func:`exercise_verdict` grade in one process (no child), for tests and tools
outside a grading kernel. See docs/instructors.md for what this does
not defend against.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json.encoder
import os
import re
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

import torch

from grpo_lab.instructor.grading_child import (
    Child,
    ChildLost,
    RemoteFunction,
    SolutionRaised,
    serve_function,
    warm_up,
)
from grpo_lab.instructor.tampering import Tampered
from grpo_lab.instructor.tree_limits import FOLDER_BYTES, FOLDER_FILES, folder_over
from grpo_lab.teaching.checks import reach

RESULT_FD_VARIABLE = "GRPO_LAB_RESULT_FD"
TAMPERED_PREFIX = "the solution changed the grader's world: "
RESTART_TEXT = "(the kernel is replaced)"
UNAVAILABLE_TEXT = "is not available while this exercise is graded"
FOLDER_FULL = "the solution's folder grew past its quota"
NOT_ATTEMPTED_TEXT = "not attempted yet"
# Modules a verdict depends on, by exact name or by prefix ("grpo_lab.").
GUARDED_MODULES = (
    "builtins",
    "json",
    "json.encoder",
    "json.decoder",
    "torch",
    "torch.testing",
    "torch.testing._comparison",
    "torch.nn",
    "torch.nn.functional",
    "torch.autograd",
    "torch.functional",
    "torch.linalg",
    "functools",
    "inspect",
    "importlib",
    "copy",
    "math",
    "operator",
    "contextlib",
    "io",
    "ast",
    "re",
)
GUARDED_PREFIXES = ("grpo_lab.", "grpo_lab")
# The folder of the working folder where the student's process works (its
# HOME and TMPDIR, the only place it may write).
SCRATCH_FOLDER = "solution"
PLAIN_TYPES = (bool, int, float, complex, str, bytes, type(None), slice, range)

_state: dict[str, Any] = {}


# --- the recorded world ------------------------------------------------------------


def _guarded_modules() -> dict[str, types.ModuleType]:
    return {
        name: module
        for name, module in list(sys.modules.items())
        if isinstance(module, types.ModuleType)
        and (name in GUARDED_MODULES or name.startswith(GUARDED_PREFIXES))
    }


def _record() -> dict[str, Any]:
    """What the guard compares: module dicts, function internals, class dicts."""
    modules = _guarded_modules()
    owners: dict[str, Any] = {"torch.Tensor": torch.Tensor, **modules}
    functions: dict[int, tuple[Any, tuple[Any, ...]]] = {}
    for module in modules.values():
        for value in list(vars(module).values()):
            if isinstance(value, types.FunctionType):
                functions[id(value)] = (value, _internals(value))
            elif isinstance(value, type) and str(value.__module__).startswith(
                GUARDED_PREFIXES
            ):
                owners[f"class {value.__module__}.{value.__qualname__}"] = value
    for name, owner in owners.items():
        if name.startswith("class "):
            for member in list(vars(owner).values()):
                if isinstance(member, types.FunctionType):
                    functions[id(member)] = (member, _internals(member))
    return {
        "sys.modules": dict(modules),
        "namespaces": {name: dict(vars(owner)) for name, owner in owners.items()},
        "owners": owners,
        "functions": functions,
    }


def _internals(function: types.FunctionType) -> tuple[Any, ...]:
    return (function.__code__, function.__defaults__, function.__kwdefaults__)


# Names the shell itself rebinds in builtins, and the cache pickling keeps in
# a class it pickles (a call's arguments are pickled for the child).
_SHELL_NAMES = frozenset({"_", "__", "___", "__slotnames__"})
_MISSING = object()


def _changes(record: dict[str, Any]) -> list[str]:
    """Names of what differs from ``record``; each is put back as recorded."""
    changed = []
    for name, module in record["sys.modules"].items():
        if sys.modules.get(name) is not module:
            changed.append(f"sys.modules[{name!r}]")
            sys.modules[name] = module
    for name, recorded in record["namespaces"].items():
        owner = record["owners"][name]
        current = dict(vars(owner))
        for key in set(current) | set(recorded):
            value = current.get(key, _MISSING)
            if value is recorded.get(key, _MISSING) or key in _SHELL_NAMES:
                continue
            if key not in recorded and isinstance(value, types.ModuleType):
                continue  # a submodule imported since
            changed.append(f"{name}.{key}")
            _put_back(owner, key, recorded.get(key, _MISSING))
    for function, internals in record["functions"].values():
        if any(a is not b for a, b in zip(_internals(function), internals)):
            changed.append(f"the code of {function.__module__}.{function.__qualname__}")
            function.__code__, function.__defaults__, function.__kwdefaults__ = (
                internals
            )
    return changed


def _put_back(owner: Any, key: str, value: Any) -> None:
    with contextlib.suppress(AttributeError, TypeError):
        if value is _MISSING:
            delattr(owner, key)
        else:
            setattr(owner, key, value)


def _modes_and_threads() -> list[str]:
    found = []
    if torch._C._len_torch_function_stack() > 0:
        found.append("a torch function mode left on")
    if torch._C._len_torch_dispatch_stack() > 0:
        found.append("a torch dispatch mode left on")
    if sys.gettrace() is not None or sys.getprofile() is not None:
        sys.settrace(None)
        sys.setprofile(None)
        found.append("a trace or profile function")
    if threading.active_count() > _state["threads"]:
        found.append("a thread started by the solution")
    return found


def check_world(where: str) -> None:
    """Raise Tampered (after putting the recorded state back) on any change.

    A change that cannot be put back (a mode, a trace function, a thread) ends
    the message with RESTART_TEXT: the grader then replaces the kernel."""
    restored = _changes(_state["record"])
    lasting = _modes_and_threads()
    if restored or lasting:
        shown = ", ".join(sorted(set(restored + lasting))[:5])
        restart = f" {RESTART_TEXT}" if lasting else ""
        raise Tampered(f"{TAMPERED_PREFIX}{shown} ({where}){restart}")


# --- the reference out of reach --------------------------------------------------


def counterpart_functions(check_name: str) -> list[types.FunctionType]:
    """The functions hidden while ``check_name`` grades: the check cell's own
    reach (:func:`grpo_lab.teaching.checks.reach.reach_of`) of its row of
    ``PACKAGE_COUNTERPARTS``, so both hide the same functions."""
    from grpo_lab.teaching.checks.exercises import PACKAGE_COUNTERPARTS
    from grpo_lab.teaching.checks.framework import resolve

    paths = PACKAGE_COUNTERPARTS.get(check_name, ())
    return reach.reach_of([resolve(path) for path in paths])


def hidden(functions: list[types.FunctionType]) -> contextlib.AbstractContextManager:
    """:func:`grpo_lab.teaching.checks.reach.hidden`, saying "graded"."""
    return reach.hidden(functions, UNAVAILABLE_TEXT)


# --- results the student built ---------------------------------------------------


def plain(value: Any, where: str = "the result") -> Any:
    """``value`` if it is built of plain types; else ValueError naming what is not."""
    kind = type(value)
    if kind in PLAIN_TYPES or kind in (torch.Tensor, torch.nn.Parameter):
        return value
    if kind in (list, tuple):
        for index, item in enumerate(value):
            plain(item, f"{where}[{index}]")
        return value
    if kind is dict:
        for key, item in value.items():
            plain(key, f"a key of {where}")
            plain(item, f"{where}[{key!r}]")
        return value
    if kind.__module__ == "numpy" and not hasattr(kind, "__torch_function__"):
        return value
    raise ValueError(
        f"{where} must be built of tensors, numbers, strings, lists, tuples and "
        f"dicts, got an object of type {kind.__module__}.{kind.__qualname__}"
    )


def guarded(
    student_fn: Callable[..., Any], hide: list[types.FunctionType]
) -> Callable[..., Any]:
    """``student_fn`` called with the world checked before and after it, its
    counterparts hidden while it runs, and a plain result."""

    def call(*args: Any, **kwargs: Any) -> Any:
        check_world("before a call of the solution")
        try:
            with hidden(hide):
                result = student_fn(*args, **kwargs)
        except Exception as error:
            _state.setdefault("raised", []).append(error)  # the student's own
            raise
        finally:
            check_world("after a call of the solution")
        return plain(result)

    call.__wrapped__ = student_fn  # type: ignore[attr-defined]
    call.__name__ = getattr(student_fn, "__name__", "solution")
    return call


# --- one exercise ----------------------------------------------------------------


def bootstrap() -> None:
    """Take the result channel and record the world; run once per kernel, first."""
    from grpo_lab.instructor import grading_refusal

    if "channel" in _state:
        raise RuntimeError("bootstrap() runs once per kernel")
    descriptor = int(os.environ.pop(RESULT_FD_VARIABLE))
    grading_refusal.install(_scratch())
    _state["channel"] = (descriptor, os.fstat(descriptor).st_ino)
    _state["write"] = os.write
    _state["fstat"] = os.fstat
    _state["encode"] = json.encoder.c_encode_basestring_ascii or (
        json.encoder.py_encode_basestring_ascii
    )


def prepare(import_source: str) -> None:
    """Import what the check cells import, then record the world; run once per
    kernel, after the course's context cells and before any student code."""
    exec(compile(import_source, "<check imports>", "exec"), {})
    warm_up()
    _state["threads"] = threading.active_count()
    _state["record"] = _record()


def grade(
    sequence: int,
    cells: list[tuple[int, str]],
    check_source: str,
    function_name: str,
    check_names: tuple[str, ...],
    notebook_checks: tuple[str, ...],
    earlier_solutions: str,
    namespace: dict[str, Any],
) -> None:
    """Run the student's ``cells`` in the child, then grade one exercise here,
    the student's function called in the child; write its line.
    ``earlier_solutions`` (the course's) define the earlier exercises'
    functions, so this one is graded on its own code."""
    _take_the_cells_input()
    try:
        verdict = forked_verdict(
            cells,
            check_source,
            namespace,
            function_name,
            check_names,
            notebook_checks,
            earlier_solutions,
        )
    except Tampered as error:
        verdict = ("error", str(error), None, None)
    except ChildLost as error:
        verdict = ("error", f"{error} {RESTART_TEXT}", None, None)
    over = folder_over(_scratch(), FOLDER_BYTES, FOLDER_FILES)
    if over:
        message = f"{FOLDER_FULL} ({over}) {RESTART_TEXT}"
        verdict = ("error", message, None, None)
    _report(sequence, *verdict)


def forked_verdict(
    cells: list[tuple[int, str]],
    check_source: str,
    namespace: dict[str, Any],
    function_name: str,
    check_names: tuple[str, ...],
    notebook_checks: tuple[str, ...],
    earlier_solutions: str,
) -> Verdict:
    """The student's cells in the child, then the check here, on a
    RemoteFunction. What the child says can make the verdict worse (a cell
    that raised, a refused or missing function, a change its guard saw), never
    a pass. Raises Tampered and ChildLost."""
    child = _child(namespace)
    request = {
        "cells": list(cells),
        "function_name": function_name,
        "check_names": tuple(check_names),
        "notebook_checks": tuple(notebook_checks),
        "earlier_solutions": earlier_solutions,
    }
    reply = child.ask("cells", request)
    if reply.get("tampered"):
        raise Tampered(_child_text(reply["tampered"]))
    if reply.get("missing"):
        outcome = "error" if reply.get("missing") == "error" else "not attempted"
        return outcome, _child_text(reply.get("message")), None, None
    if reply.get("refused"):
        return "fail", _child_text(reply["refused"]), None, None
    check_world("before the check")
    raised: list[BaseException] = []
    _state["raised"] = raised
    names = dict(namespace)
    names[function_name] = RemoteFunction(child, function_name, raised)
    return run_check(check_source, names)


def _child_text(value: Any) -> str:
    return str(value)[:2000] if type(value) is str else "(no message)"


def _child(namespace: dict[str, Any]) -> Any:
    """The kernel's child, forked once, before the first exercise: the
    student's code runs there, never here."""
    if "child" not in _state:
        scratch = _scratch()
        _state["child"] = Child(
            {"cells": lambda request: student_part(request, namespace)},
            on_start=lambda: _in_the_child(namespace),
            scratch=scratch,
        )
        _drop_the_working_folder()
    return _state["child"]


def _scratch() -> str:
    """The student's own folder, in the working folder (made on first use)."""
    scratch = os.path.join(os.getcwd(), SCRATCH_FOLDER)
    os.makedirs(scratch, mode=0o700, exist_ok=True)
    return scratch


def _drop_the_working_folder() -> None:
    """Nothing the child can write (the working folder) stays on the parent's
    import path: a module it plants there is never imported here."""
    workdir = os.path.realpath(os.getcwd())
    sys.path[:] = [
        entry
        for entry in sys.path
        if entry
        and os.path.realpath(entry) != workdir
        and not os.path.realpath(entry).startswith(workdir + os.sep)
    ]


def _in_the_child(namespace: dict[str, Any]) -> None:
    """The child keeps none of the parent's secrets, counts its own threads, and
    notes what the course defined (the course's solutions of exercises that a
    later one calls are not the student's answer)."""
    for key in ("channel", "write", "fstat", "encode", "child"):
        _state.pop(key, None)
    _state["threads"] = threading.active_count()
    _state["course_names"] = dict(namespace)


def student_part(request: dict[str, Any], namespace: dict[str, Any]) -> dict[str, Any]:
    """In the child: run the student's cells, then serve the exercise's
    function (guarded, its counterparts hidden) for the calls to come."""
    serve_function(None)
    check_names = request["check_names"]
    hide = [f for name in check_names for f in counterpart_functions(name)]
    hide_in_cells = hide + [
        f for name in request["notebook_checks"] for f in counterpart_functions(name)
    ]
    _state["raised"] = []
    try:
        check_world("before the student's cells")
        cell_error, stubbed = run_student_cells(
            request["cells"], namespace, hide_in_cells
        )
    except Tampered as error:
        return {"tampered": str(error)}
    if request["earlier_solutions"]:
        run_cell(request["earlier_solutions"], namespace, "<earlier solutions>")
    function = namespace.get(request["function_name"])
    if function is _state["course_names"].get(request["function_name"], _MISSING):
        function = None  # the course's own, from the context: not an answer
    if not callable(function):
        missing = missing_verdict(cell_error, stubbed, request["function_name"])
        return {"missing": missing[0], "message": missing[1]}
    refused = refusal(function, check_names)
    if refused:
        return {"refused": refused}
    serve_function(guarded(function, hide))
    return {}


def refusal(function: Callable[..., Any], check_names: tuple[str, ...]) -> str:
    """The check's refusal of ``function`` (the package function itself), or ""."""
    from grpo_lab.teaching.checks import framework

    for name in check_names:
        try:
            framework.refuse_package_function(function, name)
        except framework.ExerciseFailed as error:
            return str(error)
    return ""


def missing_verdict(cell_error: str, stubbed: bool, function_name: str) -> Verdict:
    """The verdict when no cell defines the exercise's function."""
    if cell_error:
        return "error", cell_error, None, None
    if stubbed:
        return (
            "not attempted",
            "the solution cell raises NotImplementedError",
            None,
            None,
        )
    return (
        "not attempted",
        f"no cell above the check defines {function_name}",
        None,
        None,
    )


def _take_the_cells_input() -> None:
    """The shell binds ``builtins.input`` anew for each cell: record this one's."""
    import builtins

    recorded = _state["record"]["namespaces"].get("builtins")
    if recorded is not None and "input" in vars(builtins):
        recorded["input"] = builtins.input


def _report(
    sequence: int, outcome: str, message: str, passed: int | None, run: int | None
) -> None:
    descriptor, inode = _state["channel"]
    if _state["fstat"](descriptor).st_ino != inode:
        raise RuntimeError("the result channel was replaced")
    encode = _state["encode"]
    counts = ", ".join("null" if n is None else str(int(n)) for n in (passed, run))
    line = f"[{int(sequence)}, {encode(outcome)}, {encode(message)}, {counts}]\n"
    _state["write"](descriptor, line.encode("ascii"))


Verdict = tuple[str, str, int | None, int | None]


def run_exercise(
    solution_source: str,
    check_source: str,
    namespace: dict[str, Any],
    function_name: str | None = None,
    check_names: tuple[str, ...] | None = None,
) -> tuple[str, str]:
    """``(outcome, message)`` of one solution cell, then the check cell, in a
    copy of ``namespace`` (see :func:`exercise_verdict`). Raises Tampered."""
    verdict = exercise_verdict(
        [(0, solution_source)],
        check_source,
        dict(namespace),
        function_name,
        check_names,
        record=True,
    )
    return verdict[0], verdict[1]


def exercise_verdict(
    cells: list[tuple[int, str]],
    check_source: str,
    namespace: dict[str, Any],
    function_name: str | None = None,
    check_names: tuple[str, ...] | None = None,
    *,
    notebook_checks: tuple[str, ...] = (),
    earlier_solutions: str = "",
    record: bool = False,
) -> Verdict:
    """``(outcome, message, cases passed, cases run)`` of the student's
    ``cells`` (``(index, source)``, run in ``namespace``), then the check cell.

    The check passes when it raises nothing, prints no "not attempted yet" and
    its last expression is not ``False``. ``function_name`` (default: the first
    function the cells define) is the function guarded; ``check_names``
    (default: the checks the check cell names) say which counterparts to hide
    while it runs, and ``notebook_checks`` which more to hide while the cells
    run. ``record`` records the world first (outside a prepared kernel).
    Raises Tampered.
    """
    if function_name is None:
        sources = "\n".join(source for _, source in cells)
        found = re.search(r"^\s*def\s+([A-Za-z_]\w*)", sources, re.M)
        function_name = found.group(1) if found else ""
    if check_names is None:
        check_names = check_names_in(check_source)
    if record or "record" not in _state:
        prepare(import_statements(check_source))
    hide = [f for name in check_names for f in counterpart_functions(name)]
    hide_in_cells = hide + [
        f for name in notebook_checks for f in counterpart_functions(name)
    ]
    _state["raised"] = []
    check_world("before the student's cells")
    cell_error, stubbed = run_student_cells(cells, namespace, hide_in_cells)
    if earlier_solutions:
        run_cell(earlier_solutions, namespace, "<earlier solutions>")
    if not callable(namespace.get(function_name)):
        return missing_verdict(cell_error, stubbed, function_name)
    names = dict(namespace)
    names[function_name] = guarded(names[function_name], hide)
    return run_check(check_source, names)


def run_student_cells(
    cells: list[tuple[int, str]],
    namespace: dict[str, Any],
    hide: list[types.FunctionType],
) -> tuple[str, bool]:
    """Run each cell, as Jupyter would, whatever an earlier one raised:
    ``(the first exception, in one line, or "", whether a cell raised
    NotImplementedError)``. Raises Tampered after a cell that changed the world."""
    first_error, stubbed = "", False
    for index, source in cells:
        try:
            with hidden(hide):
                run_cell(source, namespace, f"<cell {index}>")
        except NotImplementedError:
            stubbed = True
        except Exception as error:
            first_error = first_error or f"cell {index} raised {one_line(error)}"
        check_world(f"after cell {index}")
    return first_error, stubbed


def run_check(check_source: str, names: dict[str, Any]) -> Verdict:
    """Run the course's check cell in ``names`` (the student's function guarded)."""
    from grpo_lab.teaching.checks.framework import ExerciseFailed

    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            value = run_cell(check_source, names, "<check cell>")
    except (Tampered, ChildLost):
        raise
    except ExerciseFailed as error:
        counts = case_counts(error)
        check_world("after the check")
        return "fail", str(error), *counts
    except NotImplementedError:
        check_world("after the check")
        return "not attempted", "the solution raises NotImplementedError", None, None
    except Exception as error:
        counts = case_counts(error)
        own = any(error is raised for raised in _state.get("raised", ()))
        check_world("after the check")
        if own:
            return "fail", f"your function raised {one_line(error)}", *counts
        return "error", f"the check raised {one_line(error)}", None, None
    check_world("after the check")
    if NOT_ATTEMPTED_TEXT in printed.getvalue() or value is False:
        return "not attempted", "the check found a stub", None, None
    return "pass", "", None, None


def case_counts(error: BaseException) -> tuple[int | None, int | None]:
    """``(cases passed, cases run)`` the check's CaseCount put on ``error``;
    ``(None, None)`` unless ``error`` is the check's ExerciseFailed or a
    built-in exception (a student's own class could fake its attributes)."""
    from grpo_lab.teaching.checks.framework import ExerciseFailed

    kind = type(error)
    made_here = kind in (ExerciseFailed, SolutionRaised)
    if not made_here and kind.__module__ != "builtins":
        return None, None
    passed = vars(error).get("cases_passed")
    run = vars(error).get("cases_run")
    if type(passed) is int and type(run) is int and 0 <= passed <= run and run > 0:
        return passed, run
    return None, None


def import_statements(source: str) -> str:
    """The top-level ``import`` and ``from ... import`` statements of a cell."""
    tree = ast.parse(python_source(source))
    kept = [
        ast.unparse(node)
        for node in tree.body
        if isinstance(node, (ast.Import, ast.ImportFrom))
    ]
    return "\n".join(kept)


def check_names_in(check_source: str) -> tuple[str, ...]:
    """The checks (rows of PACKAGE_COUNTERPARTS) a check cell names."""
    from grpo_lab.teaching.checks.exercises import PACKAGE_COUNTERPARTS

    named = re.findall(r"\bcheck_\w+", check_source)
    return tuple(dict.fromkeys(n for n in named if n in PACKAGE_COUNTERPARTS))


def run_cell(source: str, names: dict[str, Any], filename: str) -> Any:
    """Execute a cell's source in ``names``; the value of its last expression."""
    source = python_source(source)
    tree = ast.parse(source, filename)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    exec(compile(tree, filename, "exec"), names)
    return None if last is None else eval(compile(last, filename, "eval"), names)


def python_source(source: str) -> str:
    """The cell's Python (IPython syntax translated when a shell is running)."""
    try:
        from IPython import get_ipython
    except ModuleNotFoundError:
        return source
    shell = get_ipython()
    return source if shell is None else shell.transform_cell(source)


def one_line(error: BaseException) -> str:
    """``Type: message`` on one line."""
    text = " ".join(str(error).split())
    made = isinstance(error, SolutionRaised)
    name = error.type_name if made else type(error).__name__  # type: ignore[attr-defined]
    return f"{name}: {text}" if text else name
