"""Grade math answers with math-verify in killable worker processes.

math-verify turns LaTeX into sympy objects and compares them. A few short strings
make sympy build an enormous number inside one C call (``1000000!``,
``10^{99 \\cdot 99 \\cdot 99 \\cdot 99}``, ``\\sqrt[\\frac{1}{999999999}]{10}``);
no thread can interrupt that call, and it holds the GIL, so every thread of the
process would stop with it. Grading therefore runs in other processes:

    callers -> MathGrader --pipe--> template process --fork--> worker processes

* The template is a fresh interpreter running the script
  ``math_verify_template.py`` beside this file (``python -P -B``): it inherits
  neither torch's threads nor the caller's ``__main__``, and it never imports torch.
  It imports math-verify, grades ``WARM_UP_PAIRS`` once, freezes its heap
  (``gc.freeze``) and relays requests. It is started on the first grade (about
  2 s of CPU) and never runs a grade itself, so a hostile answer never kills it.
* Workers are ``fork``s of the template (single-threaded, so the fork is safe;
  a few milliseconds). Up to ``max_workers`` of them grade at once, each one
  request at a time, and each is reused across calls: its caches stay warm. A
  worker killed by a limit is replaced by a new fork; so is one that has served
  ``grades_per_worker`` grades or whose memory grew by half of ``memory_bytes``.
  More callers than workers wait for a free one.
* CPU budget: before each grade the worker arms ``setitimer(ITIMER_PROF,
  cpu_seconds)``. When the grade has used ``cpu_seconds`` of CPU (user + system),
  the kernel sends SIGPROF, whose default action ends the process at once, even
  in the middle of a C call. Time spent waiting for a core does not count, so a
  loaded machine grades like an idle one.
* Wall ceiling: a worker still on one grade ``wall_seconds`` after receiving it is
  killed (a backstop for a process that stops using CPU; far above any
  legitimate grade, which needs 0.001-0.15 s of CPU). The caller also gives up on
  the template ``wall_seconds + REPLY_GRACE_SECONDS`` after sending a request,
  and the template is then replaced.
* Memory: a worker's address space may grow by ``memory_bytes``; past that,
  allocations fail (a ``MemoryError``, graded not equal).
* Nothing is written and nothing is executed: the template and its workers may
  not write regular files (``RLIMIT_FSIZE`` 0, no core dumps, no bytecode files),
  and the text only ever goes through math-verify's LaTeX grammar (never ``eval``
  or ``exec``; math-verify's Python-expression parser is not used).

Warm caches make a grade's CPU time depend a little on what its worker graded
before, never beyond the budget; a verdict can only depend on it for an answer
whose grading needs almost exactly the budget.

A grade's ``status`` is "graded" (math-verify's verdict), "timeout" (the CPU
budget or the wall ceiling ran out) or "lost" (the worker died another way, e.g.
killed by the system; a grade whose template dies is retried once). Anything
but "graded" is not equal, and ``MathGrader.timeouts`` counts it. POSIX only
(``fork``, ``setitimer``). Used by ``grpo_lab.rewards.r1_zero_reward``; taught
in ``notebooks/03_rewards_and_advantages.ipynb``.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

from grpo_lab.rewards.math_verify_template import (
    HEDGING_RELATIONS,
    WARM_UP_PAIRS,
    GraderLimits,
    answer_rule_broken,
    verdict_in_this_process,
)

__all__ = [
    "HEDGING_RELATIONS",
    "WARM_UP_PAIRS",
    "GraderLimits",
    "MathGrade",
    "MathGrader",
    "answer_rule_broken",
    "default_math_grader",
    "math_verify_equal",
    "verdict_in_this_process",
]

# The script the template process runs (standard library only, no grpo_lab).
TEMPLATE_SCRIPT = Path(__file__).with_name("math_verify_template.py")
# CPU seconds one grade may use (both parses and the comparison).
MATH_GRADING_CPU_SECONDS = 1.0
# Wall seconds after which a grade is stopped whatever its CPU use.
MATH_GRADING_WALL_SECONDS = 30.0
# Extra address space one grade may allocate.
MATH_GRADING_MEMORY_BYTES = 1 << 30
# Longest wait for a new template to import math-verify and warm up.
START_SECONDS = 120.0
# Extra wait for the template's reply beyond the wall ceiling.
REPLY_GRACE_SECONDS = 10.0
# Most simultaneous grades (worker processes) of one grader, by default.
DEFAULT_MAX_WORKERS = min(8, os.cpu_count() or 1)
# Grades one worker serves before a fresh fork of the template replaces it.
GRADES_PER_WORKER = 1000


@dataclass(frozen=True)
class MathGrade:
    """One grade: the verdict, how it ended, and where and with how much CPU."""

    equal: bool
    # "graded", "timeout" or "lost" (see the module docstring).
    status: str
    # CPU seconds the grade used in its worker.
    cpu_seconds: float = 0.0
    # Process id of the worker that graded it (None: graded without a worker).
    worker_pid: int | None = None

    @property
    def timed_out(self) -> bool:
        """True when grading stopped before math-verify gave a verdict."""
        return self.status != "graded"


class MathGrader:
    """Grades answer/ground-truth pairs with math-verify in worker processes.

    ``grade(answer, ground_truth)`` returns a ``MathGrade``; it never raises for
    any pair of strings, uses at most ``cpu_seconds`` of worker CPU per call, and
    is safe to call from many threads. ``timeouts`` counts the grades that did not
    finish (status "timeout" or "lost"). The template process starts on the first
    grade (about 2 s of CPU) and ends with ``close()``, when the grader is
    garbage-collected, or at exit. A fork of the calling process starts its own
    template on first use.

    cpu_seconds:       CPU budget of one grade (both parses and the comparison)
    wall_seconds:      wall-clock ceiling of one grade, >= cpu_seconds (a backstop)
    memory_bytes:      how far a worker's address space may grow
    max_workers:       grades running at once (worker processes)
    grades_per_worker: grades a worker serves before a fresh fork replaces it
    """

    def __init__(
        self,
        *,
        cpu_seconds: float = MATH_GRADING_CPU_SECONDS,
        wall_seconds: float = MATH_GRADING_WALL_SECONDS,
        memory_bytes: int = MATH_GRADING_MEMORY_BYTES,
        max_workers: int = DEFAULT_MAX_WORKERS,
        grades_per_worker: int = GRADES_PER_WORKER,
    ) -> None:
        self.limits = GraderLimits(
            cpu_seconds, wall_seconds, memory_bytes, max_workers, grades_per_worker
        )
        if not hasattr(os, "fork"):
            raise RuntimeError("math grading needs os.fork (Linux or macOS)")
        self.timeouts = 0
        self._holder: list[_Template | None] = [None]
        self._reset_locks()
        self._finalizer = weakref.finalize(self, _stop_held, self._holder)
        reference = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _forget_after_fork(reference))

    def grade(self, answer: str, ground_truth: str) -> MathGrade:
        """math-verify's verdict on ``\\boxed{answer}`` against
        ``\\boxed{ground_truth}``, computed in a worker process.

        When the template itself dies during the call (killed from outside), the
        grade is tried once more on a new template.
        """
        if not isinstance(answer, str) or not isinstance(ground_truth, str):
            return MathGrade(False, "graded")
        with self._slots:
            grade = self._grade_once(answer, ground_truth)
            if grade is None:
                grade = self._grade_once(answer, ground_truth)
        grade = grade or MathGrade(False, "lost")
        if grade.timed_out:
            with self._lock:
                self.timeouts += 1
        return grade

    def _grade_once(self, answer: str, ground_truth: str) -> MathGrade | None:
        """One request to the live template; None when the template died."""
        template = self._running_template()
        request = template.submit(answer, ground_truth)
        if not request.done.wait(self.limits.wall_seconds + REPLY_GRACE_SECONDS):
            request.finish(MathGrade(False, "timeout"))
            self._replace(template)
        return request.grade

    @property
    def cpu_seconds(self) -> float:
        """The CPU budget of one grade."""
        return self.limits.cpu_seconds

    @property
    def pid(self) -> int | None:
        """The template process's id, or None before the first grade."""
        template = self._holder[0]
        return None if template is None else template.process.pid

    def start(self) -> None:
        """Start the template now instead of on the first grade."""
        with self._slots:
            self._running_template()

    def close(self) -> None:
        """Stop the template and its children (a later grade starts a new one)."""
        with self._lock:
            template, self._holder[0] = self._holder[0], None
        if template is not None:
            template.stop()

    def __enter__(self) -> MathGrader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _running_template(self) -> _Template:
        """The live template, started (or replaced) when there is none."""
        with self._lock:
            template = self._holder[0]
            if template is None or not template.alive():
                if template is not None:
                    template.stop()
                template = _Template.start(self._command())
                self._holder[0] = template
            return template

    def _replace(self, template: _Template) -> None:
        """Stop ``template``; the next grade starts a new one."""
        with self._lock:
            if self._holder[0] is template:
                self._holder[0] = None
        template.stop()

    def _command(self) -> list[str]:
        limits = json.dumps(asdict(self.limits))
        return [sys.executable, "-P", "-B", str(TEMPLATE_SCRIPT), limits]

    def _reset_locks(self) -> None:
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(self.limits.max_workers)


@functools.cache
def default_math_grader() -> MathGrader:
    """The grader ``r1_zero_reward`` uses unless given one: default limits,
    shared by every caller of this process (one template process)."""
    return MathGrader()


def _stop_held(holder: list[_Template | None]) -> None:
    """Finalizer: stop the template a collected grader held."""
    template, holder[0] = holder[0], None
    if template is not None:
        template.stop()


def _forget_after_fork(reference: weakref.ref[MathGrader]) -> None:
    """In a forked child: drop the parent's template (without stopping it, since
    it serves the parent) and its locks, which another thread may have held."""
    grader = reference()
    if grader is not None:
        grader._holder[0] = None
        grader._reset_locks()


@dataclass
class _Request:
    """A grade in flight, finished once: by the reader thread with the reply (or
    None when the template died), or by the caller on a timeout."""

    done: threading.Event
    grade: MathGrade | None = None

    def finish(self, grade: MathGrade | None) -> None:
        if not self.done.is_set():
            self.grade = grade
            self.done.set()


class _Template:
    """The template process, its request pipe and a thread reading its replies."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.process = process
        self.lock = threading.Lock()
        self.pending: dict[int, _Request] = {}
        self.ids = itertools.count()
        self.ready = threading.Event()
        self.started = False
        self.start_error: str | None = None
        self.reader = threading.Thread(target=self.read_replies, daemon=True)

    @classmethod
    def start(cls, command: list[str]) -> _Template:
        """Start the process and wait until it reports ready.

        RuntimeError when it cannot start (math-verify missing, or no reply in
        ``START_SECONDS``): a broken installation, not a wrong answer.
        """
        process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        template = cls(process)
        template.reader.start()
        template.ready.wait(START_SECONDS)
        if not template.started:
            template.stop()
            reason = template.start_error or (
                f"no ready message within {START_SECONDS:g} s or before it exited"
            )
            raise RuntimeError(f"the math grading worker could not start: {reason}")
        return template

    def submit(self, answer: str, ground_truth: str) -> _Request:
        """Send one request; its ``done`` event is set when the reply arrives."""
        request = _Request(threading.Event())
        line = {"answer": answer, "ground_truth": ground_truth}
        with self.lock:
            request_id = next(self.ids)
            self.pending[request_id] = request
            try:
                _write_line(self.process.stdin, {"id": request_id, **line})
            except OSError:  # the template is gone
                self.pending.pop(request_id)
                request.finish(None)
        return request

    def read_replies(self) -> None:
        """Reader thread: finish requests as replies arrive; at end of file
        (the template died), finish every pending request with None."""
        for line in self.process.stdout:
            self.handle(json.loads(line))
        self.ready.set()
        with self.lock:
            pending, self.pending = self.pending, {}
        for request in pending.values():
            request.finish(None)

    def handle(self, reply: dict) -> None:
        if "id" not in reply:
            self.started = bool(reply.get("ready"))
            self.start_error = reply.get("error")
            self.ready.set()
            return
        with self.lock:
            request = self.pending.pop(reply["id"], None)
        if request is not None:
            cpu_seconds = reply.get("cpu_seconds", 0.0)
            worker = reply.get("worker")
            grade = MathGrade(reply["equal"], reply["status"], cpu_seconds, worker)
            request.finish(grade)

    def alive(self) -> bool:
        return self.process.poll() is None and self.reader.is_alive()

    def stop(self) -> None:
        """End the template and its children; it is not restarted."""
        with contextlib.suppress(OSError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        if self.reader is not threading.current_thread():
            self.reader.join(timeout=REPLY_GRACE_SECONDS)
        for stream in (self.process.stdin, self.process.stdout):
            with contextlib.suppress(OSError):
                stream.close()


def _write_line(stream: IO[bytes], message: dict) -> None:
    stream.write(json.dumps(message).encode("ascii") + b"\n")
    stream.flush()


def math_verify_equal(
    answer: str, ground_truth: str, *, grader: MathGrader | None = None
) -> bool:
    """Whether ``answer`` equals ``ground_truth`` (math-verify's verdict under the
    rules of :func:`answer_rule_broken`, with the symbolic fallback of
    :func:`verdict_in_this_process`), computed by ``grader`` (default
    ``default_math_grader()``) in a worker process.

    Bounded whoever calls it: at most the grader's ``cpu_seconds`` of worker CPU
    and its wall ceiling, like every grade; a grade that runs out is not equal.
    """
    return (grader or default_math_grader()).grade(answer, ground_truth).equal
