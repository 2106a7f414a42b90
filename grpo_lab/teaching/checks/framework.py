"""How every exercise check behaves.

A check takes the student's function and returns True on success. A stub (the
body still raises ``NotImplementedError``) prints "not attempted yet" and returns
False, so a student copy still runs to the end. A wrong answer raises
:class:`ExerciseFailed` with a concrete counter-example: the inputs, the expected
value and the value received.

A check runs each of its cases in ``with cases.case():`` (:class:`CaseCount`):
a case that fails is kept and the next one still runs, so the verdict says how
many of the cases passed ("3 of 4 cases passed"), in its message and in the
raised error's ``cases_passed`` and ``cases_run``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from grpo_lab.teaching.checks.exercises import PACKAGE_COUNTERPARTS


class ExerciseFailed(AssertionError):
    """The student's answer disagrees with the reference on a concrete input.

    ``cases_passed`` and ``cases_run`` count the check's cases when the error
    is a check's verdict (None when it was raised before any case ran).
    """

    cases_passed: int | None = None
    cases_run: int | None = None


class CaseCount:
    """The cases of one check: each runs in ``with cases.case():``.

    A case passes when its block raises nothing. A failure (any exception) is
    kept and the next case still runs; a ``NotImplementedError`` marks the case
    as a stub.
    """

    def __init__(self) -> None:
        self.passed = 0
        self.stubbed = 0
        self.failures: list[Exception] = []

    @contextlib.contextmanager
    def case(self) -> Iterator[None]:
        try:
            yield
        except NotImplementedError:
            self.stubbed += 1
        except Exception as error:  # the verdict raises it again
            self.failures.append(error)
        else:
            self.passed += 1

    @property
    def run(self) -> int:
        return self.passed + self.stubbed + len(self.failures)

    def tally(self) -> str:
        return f"{self.passed} of {self.run} cases passed"

    def verdict(self, title: str) -> bool:
        """True (all passed), False (a stub: nothing passed), or raise."""
        if self.failures:
            raise self._counted(self.failures[0])
        if self.stubbed and not self.passed:
            print(f"{title}: not attempted yet (the stub raises NotImplementedError)")
            return False
        if self.stubbed:
            raise self._counted(
                ExerciseFailed(
                    f"part of the answer still raises NotImplementedError "
                    f"({self.stubbed} of {self.run} cases reached it)"
                )
            )
        print(f"{title}: correct ✔ ({self.tally()})")
        return True

    def _counted(self, first: Exception) -> Exception:
        if isinstance(first, ExerciseFailed):
            counted = ExerciseFailed(f"{first}\n  {self.tally()}")
            counted.__cause__ = first.__cause__
        else:  # the student's own exception keeps its type and traceback
            counted = first
            counted.add_note(self.tally())
        counted.cases_passed, counted.cases_run = self.passed, self.run
        return counted


def exercise_check(title: str) -> Callable[[Callable[..., None]], Callable[..., bool]]:
    """Decorate ``checker(student_fn, cases, ...)``, which runs each case in
    ``with cases.case():`` (see :class:`CaseCount`); the decorated check is
    called ``check(student_fn, ...)``.

    Before the checker runs, a student function that is the package function
    the check compares against is refused (:func:`refuse_package_function`);
    while it runs, what computes its answer is out of reach
    (:func:`hide_while_running`). The checker's name must be a row of
    PACKAGE_COUNTERPARTS. An ExerciseFailed raised outside a case counts as one
    failed case and ends the check.
    """

    def decorate(checker: Callable[..., None]) -> Callable[..., bool]:
        if checker.__name__ not in PACKAGE_COUNTERPARTS:
            raise ValueError(
                f"checker must be listed in PACKAGE_COUNTERPARTS, got "
                f"{checker.__name__!r}"
            )

        @functools.wraps(checker)
        def run(student_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
            refuse_package_function(student_fn, checker.__name__)
            cases = CaseCount()
            hiding = hide_while_running(student_fn, checker.__name__)
            try:
                checker(hiding, cases, *args, **kwargs)
            except NotImplementedError:
                cases.stubbed += 1
            except ExerciseFailed as error:
                cases.failures.append(error)
            return cases.verdict(title)

        signature = inspect.signature(checker)
        parameters = list(signature.parameters.values())
        run.__signature__ = signature.replace(  # type: ignore[attr-defined]
            parameters=parameters[:1] + parameters[2:]
        )
        return run

    return decorate


def assert_close(
    received: Any,
    expected: Any,
    inputs: str,
    atol: float = 1e-5,
    rtol: float = 1e-4,
) -> None:
    """Raise ExerciseFailed naming the inputs unless received ≈ expected."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(received, torch.Tensor):
            raise ExerciseFailed(
                f"For {inputs}: expected a tensor, got {type(received).__name__}"
            )
        if received.shape != expected.shape:
            raise ExerciseFailed(
                f"For {inputs}: expected shape {tuple(expected.shape)}, "
                f"got {tuple(received.shape)}"
            )
        if torch.allclose(
            received.double(), expected.double(), atol=atol, rtol=rtol, equal_nan=True
        ):
            return
    elif received == expected or (
        isinstance(expected, float)
        and isinstance(received, (int, float))
        and abs(received - expected) <= atol + rtol * abs(expected)
    ):
        return
    raise ExerciseFailed(f"For {inputs}:\n  expected {expected}\n  got      {received}")


def resolve(path: str) -> Any:
    """The object a dotted path names: a module attribute, or a class's."""
    parts = path.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:]:
            found = (
                inspect.getattr_static(found, name)
                if inspect.isclass(found)
                else getattr(found, name)
            )
        return found
    raise ValueError(f"path must name an importable object, got {path!r}")


def fresh_python() -> list[str]:
    """The command that starts a fresh Python process for a check (a grading
    kernel puts a confined one in its place, see grpo_lab.instructor)."""
    return [sys.executable]


def refuse_package_function(student_fn: Callable[..., Any], check_name: str) -> None:
    """Raise ExerciseFailed when ``student_fn`` is, or wraps, a function the
    check compares against (the PACKAGE_COUNTERPARTS table): itself, under
    another name, in a functools.partial, behind ``__wrapped__``, as a bound
    method or as a callable object's ``__call__``.

    The refusal is by object, never by name: a student's own helper that
    shares a package function's name, or a comment or docstring that names
    one, is not refused. A *call* of a counterpart, by any path, meets the
    stub the check puts in its place while the student's function runs
    (:mod:`grpo_lab.teaching.checks.reach`); the grader refuses and hides the
    same way.
    """
    for path in PACKAGE_COUNTERPARTS[check_name]:
        target = resolve(path)
        targets = (target, getattr(target, "fget", target))
        if any(c is t for c in _unwrapped(student_fn) for t in targets):
            name = getattr(student_fn, "__name__", type(student_fn).__name__)
            raise ExerciseFailed(
                f"write it yourself: this check compares against {path}, and "
                f"{name} is that function"
            )


# hide_while_running's wrapper -> the student's function it wraps.
_AS_WRITTEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def as_written(student_fn: Callable[..., Any]) -> Callable[..., Any]:
    """The student's function without :func:`hide_while_running`'s wrapper: what
    a check sends to a fresh process, which hides by :func:`hidden_places`."""
    return _AS_WRITTEN.get(student_fn, student_fn)


def hidden_places(check_name: str) -> list[str]:
    """Each counterpart of the check as ``"module:attribute.path"``, for
    :func:`grpo_lab.teaching.checks.reach.hide_in_this_process`."""
    places = []
    for path in PACKAGE_COUNTERPARTS[check_name]:
        parts = path.split(".")
        for split in range(len(parts) - 1, 0, -1):
            module_name = ".".join(parts[:split])
            try:
                importlib.import_module(module_name)
            except ImportError:
                continue
            places.append(f"{module_name}:{'.'.join(parts[split:])}")
            break
    return places


def hide_while_running(
    student_fn: Callable[..., Any], check_name: str
) -> Callable[..., Any]:
    """``student_fn``, called with what computes the check's answer out of
    reach (:mod:`grpo_lab.teaching.checks.reach`); a call that met a hidden
    function fails the case with its message. A grading kernel puts the
    identity here: it hides the same functions itself, in the process where
    the student's code runs."""
    from grpo_lab.teaching.checks import reach

    hide = reach.reach_of([resolve(p) for p in PACKAGE_COUNTERPARTS[check_name]])

    @functools.wraps(student_fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            with reach.hidden(hide):
                return student_fn(*args, **kwargs)
        except RuntimeError as error:
            if reach.UNAVAILABLE_TEXT not in str(error):
                raise
            raise ExerciseFailed(str(error)) from None

    _AS_WRITTEN[call] = student_fn
    return call


def _unwrapped(fn: Any) -> list[Any]:
    chain = [fn]
    while True:
        inner = (
            fn.func
            if isinstance(fn, functools.partial)
            else getattr(fn, "__wrapped__", None) or getattr(fn, "__func__", None)
        )
        if inner is None and not inspect.isroutine(fn) and callable(fn):
            call = inspect.getattr_static(type(fn), "__call__", None)
            inner = call if inspect.isfunction(call) else None
        if inner is None or any(inner is known for known in chain):
            return chain
        chain.append(inner)
        fn = inner


def assert_value_and_gradient(
    received: Any,
    expected: torch.Tensor,
    student_input: torch.Tensor,
    reference_input: torch.Tensor,
    inputs: str,
    wrt: str = "policy_log_probs",
    atol: float = 1e-5,
) -> None:
    """``received`` equals ``expected`` and so does its gradient w.r.t.
    ``student_input``, against the reference's autograd gradient w.r.t.
    ``reference_input``.

    Both are backpropagated from the same fixed weighting of their entries (a
    plain sum could hide a wrong sign pattern). A result without a gradient
    (computed under no_grad, or detached) fails with its own message.
    """
    assert_close(received, expected.detach(), inputs, atol=atol)
    if not received.requires_grad:
        raise ExerciseFailed(
            f"For {inputs}: the result carries no gradient to {wrt} (was "
            "something detached, or computed under torch.no_grad()?)"
        )
    weights = _backward_weights(expected.shape)
    (expected * weights).sum().backward()
    (received * weights).sum().backward()
    if student_input.grad is None:
        raise ExerciseFailed(
            f"For {inputs}: the result's gradient does not reach {wrt} (was "
            "something detached?)"
        )
    assert_close(
        student_input.grad,
        reference_input.grad,
        f"{inputs} (gradient w.r.t. {wrt})",
        atol=atol,
    )


def _backward_weights(shape: torch.Size) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return 0.5 + torch.rand(shape, generator=generator)  # in [0.5, 1.5)
