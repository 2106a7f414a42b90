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
import importlib.abc
import inspect
import sys
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


def _swap_for_stubs(
    functions: list[types.FunctionType], unavailable: str
) -> list[tuple[types.FunctionType, types.CodeType]]:
    """Each function's code swapped for a stub; (function, its own code)."""
    swapped = []
    for function in dict.fromkeys(functions):  # each once, in order
        if function.__code__.co_freevars:
            continue
        path = f"{function.__module__}.{function.__qualname__}"
        swapped.append((function, function.__code__))
        function.__code__ = _stub_code(path, unavailable)
    return swapped


@contextlib.contextmanager
def hidden(
    functions: list[types.FunctionType], unavailable: str = UNAVAILABLE_TEXT
) -> Iterator[None]:
    """Swap each function's code for a stub that raises (its message says the
    function ``unavailable``), then put it back. A closure keeps its code (a
    stub cannot take its place); what it wraps is hidden instead (see
    :func:`_layers`). The grading kernel hides the same way."""
    swapped = _swap_for_stubs(functions, unavailable)
    try:
        yield
    finally:
        for function, code in reversed(swapped):
            function.__code__ = code


def hide_in_this_process(
    places: list[str], unavailable: str = UNAVAILABLE_TEXT
) -> None:
    """In a fresh process that runs a student's function for a check: hide for
    good the reach of each place (``"module:attribute.path"``), now where its
    module is loaded, else the moment it is imported, so that the fresh
    process imports nothing the student's function does not.

    This module is loaded there on its own, from its file, with the standard
    library alone (see :func:`grpo_lab.teaching.checks.framework.fresh_python`)."""
    waiting: dict[str, list[str]] = {}
    for place in places:
        module_name, _, attribute = place.partition(":")
        waiting.setdefault(module_name, []).append(attribute)

    def hide_module(name: str) -> None:
        module = sys.modules[name]
        targets = []
        for attribute in waiting.pop(name):
            found: Any = module
            for part in attribute.split("."):
                found = (
                    inspect.getattr_static(found, part)
                    if inspect.isclass(found)
                    else getattr(found, part)
                )
            targets.append(found)
        _swap_for_stubs(reach_of(targets), unavailable)  # never put back

    for name in [name for name in waiting if name in sys.modules]:
        hide_module(name)
    if waiting:
        sys.meta_path.insert(0, _HideOnImport(waiting, hide_module))


class _HideOnImport(importlib.abc.MetaPathFinder):
    """Finds a waiting module through the other finders and hides its
    functions once the module has run."""

    def __init__(self, waiting: dict[str, list[str]], hide_module) -> None:
        self.waiting = waiting
        self.hide_module = hide_module

    def find_spec(self, name, path, target=None):
        if name not in self.waiting:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = None if finder is self or find is None else find(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _HidingLoader(spec.loader, lambda: self.hide_module(name))
                return spec
        return None


class _HidingLoader(importlib.abc.Loader):
    def __init__(self, loader, after) -> None:
        self.loader = loader
        self.after = after

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        self.after()
