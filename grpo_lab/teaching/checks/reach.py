"""What computes an exercise's answer is out of reach while the answer runs.

While a check calls the student's function, every function listed for the
check in ``PACKAGE_COUNTERPARTS`` (the package's counterparts, the check
module's own helpers that compute the expected value, and library routes such
as ``generate``), the functions they wrap, and the functions of their own
module that they reach (directly, or through a dict, list or record they read)
raise "... is not available while this exercise is checked", whatever path
reaches them: their code objects are swapped, so an alias, ``getattr``,
``importlib`` and ``sys.modules`` all meet the same stub. Their code is put
back when the student's function returns. The grading kernel hides the same
table's functions in the process where the student's code runs
(:mod:`grpo_lab.instructor.grading_kernel`).
"""

from __future__ import annotations

import contextlib
import inspect
import types
from collections.abc import Iterator
from typing import Any

UNAVAILABLE_TEXT = "is not available while this exercise is checked"
_OWN_PREFIX = "grpo_lab"


def reach_of(targets: list[Any]) -> list[types.FunctionType]:
    """The functions hidden for ``targets`` (the resolved paths of one check's
    row of ``PACKAGE_COUNTERPARTS``): each, what it wraps, and the functions
    of its own module it reaches."""
    found: dict[int, types.FunctionType] = {}
    for target in targets:
        target = getattr(target, "fget", target)
        for layer in _layers(target):
            if isinstance(layer, types.FunctionType):
                _reach(layer, found)
    return list(found.values())


def _layers(target: Any) -> list[Any]:
    """``target`` and what it wraps (``__wrapped__``, as decorators set it)."""
    chain = [target]
    while (inner := getattr(chain[-1], "__wrapped__", None)) is not None:
        if any(inner is known for known in chain):
            break
        chain.append(inner)
    return chain


def _reach(function: types.FunctionType, found: dict[int, types.FunctionType]) -> None:
    if id(function) in found:
        return
    found[id(function)] = function
    if not function.__module__.startswith(_OWN_PREFIX):
        return  # another library's function: itself only
    for value in _referenced(function):
        if (
            isinstance(value, types.FunctionType)
            and value.__module__ == function.__module__
        ):
            _reach(value, found)


def _referenced(function: types.FunctionType) -> Iterator[Any]:
    names = set()
    stack = [function.__code__]
    while stack:
        code = stack.pop()
        names |= set(code.co_names)
        stack += [c for c in code.co_consts if inspect.iscode(c)]
    for name in names:
        value = function.__globals__.get(name)
        yield value
        members: list[Any] = []
        if isinstance(value, dict):
            members = list(value.values())
        elif isinstance(value, (list, tuple)):
            members = list(value)
        for member in members:
            yield member
            yield from vars(member).values() if hasattr(member, "__dict__") else ()


def _stub_code(path: str, unavailable: str) -> types.CodeType:
    namespace: dict[str, Any] = {}
    message = f"{path} {unavailable}: write it yourself"
    exec(f"def stub(*args, **kwargs):\n    raise RuntimeError({message!r})", namespace)
    return namespace["stub"].__code__


@contextlib.contextmanager
def hidden(
    functions: list[types.FunctionType], unavailable: str = UNAVAILABLE_TEXT
) -> Iterator[None]:
    """Swap each function's code for a stub that raises (its message says the
    function ``unavailable``), then put it back. A closure keeps its code (a
    stub cannot take its place); what it wraps is hidden instead (see
    :func:`_layers`). The grading kernel hides the same way."""
    swapped = []
    for function in dict.fromkeys(functions):  # each once, in order
        if function.__code__.co_freevars:
            continue
        path = f"{function.__module__}.{function.__qualname__}"
        swapped.append((function, function.__code__))
        function.__code__ = _stub_code(path, unavailable)
    try:
        yield
    finally:
        for function, code in reversed(swapped):
            function.__code__ = code
