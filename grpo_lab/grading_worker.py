"""Grade math answers with math-verify in killable worker processes.

math-verify turns LaTeX into sympy objects and compares them. A few short strings
make sympy build an enormous number inside one C call (``1000000!``,
``10^{99 \\cdot 99 \\cdot 99 \\cdot 99}``, ``\\sqrt[\\frac{1}{999999999}]{10}``);
no thread can interrupt that call, and it holds the GIL, so every thread of the
process would stop with it. Grading therefore runs in other processes:

    callers -> MathGrader --pipe--> template process --fork--> one child per grade

* The template is a fresh interpreter (``python -P -B this_file``): it inherits
  neither torch's threads nor the caller's ``__main__``, and it never imports torch.
  It imports math-verify, grades ``WARM_UP_PAIRS`` once, freezes its heap
  (``gc.freeze``) and waits for requests. Started on the first grade, reused for
  every later one.
* Each grade runs in a fresh ``fork`` of the template (a single-threaded process,
  so the fork is safe). Every grade starts from the same warmed state: the verdict
  depends on the two strings only, never on earlier calls.
* CPU budget: the child arms ``setitimer(ITIMER_PROF, cpu_seconds)``. When it has
  used ``cpu_seconds`` of CPU (user + system), the kernel sends SIGPROF, whose
  default action ends the process at once, even in the middle of a C call. Time
  spent waiting for a core does not count, so a loaded machine grades like an
  idle one.
* Wall ceiling: a child still running ``wall_seconds`` after its start is killed
  (a backstop for a child that stops using CPU; far above any legitimate grade,
  which needs 0.005-0.15 s of CPU). The caller also gives up on the template
  ``wall_seconds + REPLY_GRACE_SECONDS`` after sending a request, and the
  template is then replaced.
* Memory: a child's address space may grow by ``memory_bytes``; past that,
  allocations fail (a ``MemoryError``, graded not equal).
* Nothing is written and nothing is executed: the template and its children may
  not write regular files (``RLIMIT_FSIZE`` 0, no core dumps, no bytecode files),
  and the text only ever goes through math-verify's LaTeX grammar (never ``eval``
  or ``exec``; math-verify's Python-expression parser is not used).
* Up to ``max_workers`` children run at once; more callers wait for a free slot.

A grade's ``status`` is "graded" (math-verify's verdict), "timeout" (the CPU
budget or the wall ceiling ran out) or "lost" (the child or the template died
another way, e.g. killed by the system). Anything but "graded" is not equal, and
``MathGrader.timeouts`` counts it. POSIX only (``fork``, ``setitimer``). Used by
``grpo_lab.rewards.r1_zero_reward``; taught in
``notebooks/03_rewards_and_advantages.ipynb``.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import IO

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
# Most simultaneous grades of one grader, by default.
DEFAULT_MAX_WORKERS = min(8, os.cpu_count() or 1)
# Graded once in the template so that each child inherits loaded grammars, imports
# and caches: numbers, fractions, radicals, polynomials, equations, percentages,
# intervals, sets, tuples, matrices, trigonometry, logarithms, inequalities.
WARM_UP_PAIRS = (
    ("0.25", "\\frac{1}{4}"),
    ("\\sqrt{12}", "2\\sqrt{3}"),
    ("(y+2)^2", "y^2+4y+4"),
    ("y^3-8", "(y-2)(y^2+2y+4)"),
    ("y=5", "5"),
    ("20\\%", "0.2"),
    ("\\binom{6}{3}", "20"),
    ("4!", "24"),
    ("\\sum_{j=1}^{4} j", "10"),
    ("(1,2]", "(1, 2]"),
    ("[1,2] \\cup [3,4]", "[3,4]\\cup[1,2]"),
    ("\\{3,4\\}", "\\{4,3\\}"),
    ("(3, \\frac{\\pi}{2})", "\\left( 3, \\frac{\\pi}{2} \\right)"),
    (
        "\\begin{pmatrix} 5 \\\\ 6 \\end{pmatrix}",
        "\\begin{pmatrix} 5 \\\\ 6 \\end{pmatrix}",
    ),
    ("\\frac{1}{2}", "\\cos(\\pi/3)"),
    ("\\log_2 8", "3"),
    ("a \\le 3", "a \\leq 3"),
    ("\\text{(B)}", "B"),
    ("\\pi", "3.14159"),
)


@dataclass(frozen=True)
class MathGrade:
    """One grade: the verdict, how it ended, and the worker CPU seconds it used."""

    equal: bool
    # "graded", "timeout" or "lost" (see the module docstring).
    status: str
    cpu_seconds: float = 0.0

    @property
    def timed_out(self) -> bool:
        """True when grading stopped before math-verify gave a verdict."""
        return self.status != "graded"


class MathGrader:
    """Grades answer/ground-truth pairs with math-verify in worker processes.

    ``grade(answer, ground_truth)`` returns a ``MathGrade``; it never raises for
    any pair of strings, uses at most ``cpu_seconds`` of worker CPU per call, and
    is safe to call from many threads. ``timeouts`` counts the grades that did not
    finish. The template process starts on the first grade (about 2 s of CPU)
    and ends with ``close()``, when the grader is garbage-collected, or at exit.
    A fork of the calling process starts its own template on first use.
    """

    def __init__(
        self,
        *,
        cpu_seconds: float = MATH_GRADING_CPU_SECONDS,
        wall_seconds: float = MATH_GRADING_WALL_SECONDS,
        memory_bytes: int = MATH_GRADING_MEMORY_BYTES,
        max_workers: int = DEFAULT_MAX_WORKERS,
    ) -> None:
        check_grader_limits(cpu_seconds, wall_seconds, memory_bytes, max_workers)
        if not hasattr(os, "fork"):
            raise RuntimeError("math grading needs os.fork (Linux or macOS)")
        self.cpu_seconds = float(cpu_seconds)
        self.wall_seconds = float(wall_seconds)
        self.memory_bytes = int(memory_bytes)
        self.max_workers = max_workers
        self.timeouts = 0
        self._holder: list[_Template | None] = [None]
        self._reset_locks()
        self._finalizer = weakref.finalize(self, _stop_held, self._holder)
        reference = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _forget_after_fork(reference))

    def grade(self, answer: str, ground_truth: str) -> MathGrade:
        """math-verify's verdict on ``\\boxed{answer}`` against
        ``\\boxed{ground_truth}``, computed in a fresh worker process.

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
        if not request.done.wait(self.wall_seconds + REPLY_GRACE_SECONDS):
            request.finish(MathGrade(False, "timeout"))
            self._replace(template)
        return request.grade

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
        limits = (self.cpu_seconds, self.wall_seconds, self.memory_bytes)
        return [sys.executable, "-P", "-B", __file__, *map(repr, limits)]

    def _reset_locks(self) -> None:
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(self.max_workers)


@functools.cache
def default_math_grader() -> MathGrader:
    """The grader ``r1_zero_reward`` uses unless given one: default limits,
    shared by every caller of this process (one template process)."""
    return MathGrader()


def check_grader_limits(
    cpu_seconds: float, wall_seconds: float, memory_bytes: int, max_workers: int
) -> None:
    """ValueError naming the first limit that is not usable."""
    if not isinstance(cpu_seconds, int | float) or not 0 < cpu_seconds <= 3600:
        raise ValueError(
            f"cpu_seconds must be a number in (0, 3600], got {cpu_seconds!r}"
        )
    if not isinstance(wall_seconds, int | float) or not wall_seconds >= cpu_seconds:
        raise ValueError(
            f"wall_seconds must be a number >= cpu_seconds ({cpu_seconds}), "
            f"got {wall_seconds!r}"
        )
    if not isinstance(memory_bytes, int) or memory_bytes < 1 << 24:
        raise ValueError(f"memory_bytes must be an int >= 2**24, got {memory_bytes!r}")
    if not isinstance(max_workers, int) or max_workers < 1:
        raise ValueError(f"max_workers must be a positive int, got {max_workers!r}")


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
            grade = MathGrade(reply["equal"], reply["status"], cpu_seconds)
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


# ----------------------------------------------------------------------------------
# The template process: run as a script by MathGrader; imports no grpo_lab module.


def serve(cpu_seconds: float, wall_seconds: float, memory_bytes: int) -> None:
    """Load math-verify, warm up, then fork one child per request until stdin ends.

    Replies on the original stdout (one JSON line each); stdout and stderr
    themselves go to /dev/null, so that nothing a library prints can mix in.
    """
    import gc

    replies = os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    for stream in (1, 2):
        os.dup2(devnull, stream)
    try:
        _quiet_math_verify()
        for answer, ground_truth in WARM_UP_PAIRS:
            math_verify_equal(answer, ground_truth)
    except BaseException as error:
        _send(replies, {"error": f"{type(error).__name__}: {error}"})
        return
    _forbid_file_writes()
    gc.collect()
    gc.freeze()
    _send(replies, {"ready": True, "pid": os.getpid()})
    _TemplateLoop(replies, devnull, (cpu_seconds, wall_seconds, memory_bytes)).run()


def math_verify_equal(answer: str, ground_truth: str) -> bool:
    """math-verify's verdict on \\boxed{answer} against \\boxed{ground_truth},
    LaTeX extraction only; its own signal-based timeouts are off (the CPU budget
    bounds the time instead)."""
    from math_verify import LatexExtractionConfig, parse, verify

    config = [LatexExtractionConfig()]
    gold = parse("\\boxed{" + ground_truth + "}", config, parsing_timeout=None)
    predicted = parse("\\boxed{" + answer + "}", config, parsing_timeout=None)
    if not gold or not predicted:
        return False
    return bool(verify(gold, predicted, timeout_seconds=None))


def _quiet_math_verify() -> None:
    """Import math-verify and keep its per-call warnings (timeouts off) unlogged."""
    import logging

    import math_verify  # noqa: F401

    logging.getLogger("math_verify").setLevel(logging.ERROR)


def _forbid_file_writes() -> None:
    """No regular file may be written (or grown) and no core file dumped."""
    import resource

    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _send(fd: int, message: dict) -> None:
    os.write(fd, json.dumps(message).encode("ascii") + b"\n")


@dataclass
class _Child:
    """One forked grade: its process, result pipe, request id and deadline."""

    pid: int
    request_id: int
    deadline: float
    output: bytes = b""
    overdue: bool = False


class _TemplateLoop:
    """Reads requests from stdin, forks children, reports their results."""

    def __init__(self, replies: int, devnull: int, limits: tuple) -> None:
        self.replies = replies
        self.devnull = devnull
        self.cpu_seconds, self.wall_seconds, self.memory_bytes = limits
        self.children: dict[int, _Child] = {}
        self.buffer = b""

    def run(self) -> None:
        while True:
            readable, _, _ = select.select([0, *self.children], [], [], self.wait())
            for fd in readable:
                if fd == 0 and not self.read_requests():
                    self.kill_children()
                    return
                if fd != 0:
                    self.read_child(fd)
            self.stop_overdue()

    def wait(self) -> float | None:
        """Seconds until the nearest wall deadline (None: no child running)."""
        deadlines = [c.deadline for c in self.children.values() if not c.overdue]
        return max(min(deadlines) - time.monotonic(), 0.0) if deadlines else None

    def read_requests(self) -> bool:
        """Start a child per complete request line; False at end of input."""
        data = os.read(0, 1 << 16)
        if not data:
            return False
        self.buffer += data
        while b"\n" in self.buffer:
            line, self.buffer = self.buffer.split(b"\n", 1)
            request = json.loads(line)
            self.fork(request["id"], request["answer"], request["ground_truth"])
        return True

    def fork(self, request_id: int, answer: str, ground_truth: str) -> None:
        try:
            read_end, write_end = os.pipe()
        except OSError:  # out of descriptors: this grade is lost
            _send(self.replies, {"id": request_id, "status": "lost", "equal": False})
            return
        try:
            pid = os.fork()
        except OSError:  # out of processes: this grade is lost
            os.close(read_end)
            os.close(write_end)
            _send(self.replies, {"id": request_id, "status": "lost", "equal": False})
            return
        if pid == 0:
            os.close(read_end)
            os.close(self.replies)
            self.grade_in_child(write_end, answer, ground_truth)
        os.close(write_end)
        deadline = time.monotonic() + self.wall_seconds
        self.children[read_end] = _Child(pid, request_id, deadline)

    def grade_in_child(self, write_end: int, answer: str, ground_truth: str) -> None:
        """In the child: arm the CPU timer, cap memory, grade, report, exit."""
        try:
            os.dup2(self.devnull, 0)
            signal.signal(signal.SIGPROF, signal.SIG_DFL)
            _cap_address_space(self.memory_bytes)
            signal.setitimer(signal.ITIMER_PROF, self.cpu_seconds)
            try:
                verdict = math_verify_equal(answer, ground_truth)
            except Exception:
                verdict = False
            os.write(write_end, b"1" if verdict else b"0")
        finally:
            os._exit(0)

    def read_child(self, fd: int) -> None:
        """Collect a child's output; at end of file, reap it and reply."""
        data = os.read(fd, 64)
        child = self.children[fd]
        if data:
            child.output += data
            return
        os.close(fd)
        del self.children[fd]
        _, status, usage = os.wait4(child.pid, 0)
        cpu = usage.ru_utime + usage.ru_stime
        _send(
            self.replies,
            {"id": child.request_id, **_verdict(child, status), "cpu_seconds": cpu},
        )

    def stop_overdue(self) -> None:
        now = time.monotonic()
        for child in self.children.values():
            if now >= child.deadline and not child.overdue:
                child.overdue = True
                os.kill(child.pid, signal.SIGKILL)

    def kill_children(self) -> None:
        for child in self.children.values():
            os.kill(child.pid, signal.SIGKILL)


def _verdict(child: _Child, status: int) -> dict:
    """The reply fields for a finished child: status and equality."""
    if os.WIFEXITED(status) and child.output in (b"0", b"1"):
        return {"status": "graded", "equal": child.output == b"1"}
    stopped_by = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    timed_out = child.overdue or stopped_by in (signal.SIGPROF, signal.SIGXCPU)
    return {"status": "timeout" if timed_out else "lost", "equal": False}


def _cap_address_space(extra_bytes: int) -> None:
    """Let the address space grow by at most ``extra_bytes`` (Linux; elsewhere a
    no-op, since only Linux reports the current size cheaply)."""
    import resource

    try:
        with open("/proc/self/statm") as statm:
            pages = int(statm.read().split()[0])
    except OSError:
        return
    limit = pages * os.sysconf("SC_PAGE_SIZE") + extra_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


if __name__ == "__main__":
    serve(float(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]))
