"""Grade math answers with math-verify in killable worker processes.

math-verify turns LaTeX into sympy objects and compares them. A few short strings
make sympy build an enormous number inside one C call (``1000000!``,
``10^{99 \\cdot 99 \\cdot 99 \\cdot 99}``, ``\\sqrt[\\frac{1}{999999999}]{10}``);
no thread can interrupt that call, and it holds the GIL, so every thread of the
process would stop with it. Grading therefore runs in other processes:

    callers -> MathGrader --pipe--> template process --fork--> worker processes

* The template is a fresh interpreter (``python -P -B this_file``): it inherits
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

import collections
import contextlib
import functools
import itertools
import json
import math
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import asdict, dataclass
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
# Most simultaneous grades (worker processes) of one grader, by default.
DEFAULT_MAX_WORKERS = min(8, os.cpu_count() or 1)
# Grades one worker serves before a fresh fork of the template replaces it.
GRADES_PER_WORKER = 1000
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
        return [sys.executable, "-P", "-B", __file__, limits]

    def _reset_locks(self) -> None:
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(self.limits.max_workers)


@functools.cache
def default_math_grader() -> MathGrader:
    """The grader ``r1_zero_reward`` uses unless given one: default limits,
    shared by every caller of this process (one template process)."""
    return MathGrader()


@dataclass(frozen=True)
class GraderLimits:
    """The limits of a ``MathGrader`` (see its arguments); ValueError naming the
    first one that is not usable."""

    cpu_seconds: float
    wall_seconds: float
    memory_bytes: int
    max_workers: int
    grades_per_worker: int

    def __post_init__(self) -> None:
        cpu, wall = self.cpu_seconds, self.wall_seconds
        if not _is_number(cpu) or not 0 < cpu <= 3600:
            raise ValueError(f"cpu_seconds must be a number in (0, 3600], got {cpu!r}")
        if not _is_number(wall) or not wall >= cpu:
            raise ValueError(
                f"wall_seconds must be a number >= cpu_seconds ({cpu}), got {wall!r}"
            )
        if not _is_count(self.memory_bytes) or self.memory_bytes < 1 << 24:
            raise ValueError(
                f"memory_bytes must be an int >= 2**24, got {self.memory_bytes!r}"
            )
        for name in ("max_workers", "grades_per_worker"):
            value = getattr(self, name)
            if not _is_count(value) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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


# ----------------------------------------------------------------------------------
# The template process: run as a script by MathGrader; imports no grpo_lab module.


def serve(limits: GraderLimits) -> None:
    """Load math-verify, warm up, then relay requests to forked workers until
    stdin ends.

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
            verdict_in_this_process(answer, ground_truth)
    except BaseException as error:
        _send(replies, {"error": f"{type(error).__name__}: {error}"})
        return
    _forbid_file_writes()
    gc.collect()
    gc.freeze()
    _send(replies, {"ready": True, "pid": os.getpid()})
    _TemplateLoop(replies, devnull, limits).run()


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


# Relations that let one answer name two values (math-verify grades "4 \\approx 5"
# as 4): an answer may use one only where its ground truth uses it too.
HEDGING_RELATIONS = {
    "approximately": (
        "approx",
        "approxeq",
        "thickapprox",
        "sim",
        "simeq",
        "thicksim",
        "backsim",
        "backsimeq",
        "eqsim",
        "cong",
        "doteq",
        "doteqdot",
        "fallingdotseq",
        "risingdotseq",
    ),
    "plus or minus": ("pm", "mp"),
    "congruent": ("equiv",),
    "proportional": ("propto",),
}
_HEDGING_SYMBOLS = {
    "approximately": "\u2248\u2243\u2245\u223c\u2242",
    "plus or minus": "\u00b1\u2213",
    "congruent": "\u2261",
    "proportional": "\u221d",
}
_HEDGING_PATTERNS = {
    family: re.compile(r"\\(?:" + "|".join(names) + r")(?![A-Za-z])")
    for family, names in HEDGING_RELATIONS.items()
}
_PERCENT_PATTERN = re.compile(r"%|\uff05|percent", re.IGNORECASE)


def answer_rule_broken(answer: str, ground_truth: str) -> str | None:
    """The grading rule ``answer`` breaks against ``ground_truth``, or None.

    Rules (applied before math-verify, in time linear in the input; an answer
    that breaks one is not equal):

    * percent: an answer with a percent sign ("%", "\\%", "percent") matches
      only a ground truth with one, and a ground truth with one only such an
      answer. math-verify reads "4\\%" as both 4 and 0.04, so a percent sign
      would hedge a factor of 100 ("400\\%" would match 4 and 400);
    * relations: an answer may use an approximate relation (\\approx, \\sim,
      \\simeq, \\cong, ...), \\pm / \\mp, \\equiv or \\propto (or their
      Unicode signs) only when its ground truth uses the same family; math-verify
      keeps one side of "4 \\approx 5", so the other side would be a free guess.

    Units in ``\\text{...}`` are left to math-verify: they do not change a
    number's value, as a percent sign does.
    """
    if _has_percent(answer) != _has_percent(ground_truth):
        return "percent"
    for family in HEDGING_RELATIONS:
        if _uses_relation(answer, family) and not _uses_relation(ground_truth, family):
            return family
    return None


def _has_percent(text: str) -> bool:
    return _PERCENT_PATTERN.search(text) is not None


def _uses_relation(text: str, family: str) -> bool:
    if any(symbol in text for symbol in _HEDGING_SYMBOLS[family]):
        return True
    return _HEDGING_PATTERNS[family].search(text) is not None


def verdict_in_this_process(answer: str, ground_truth: str) -> bool:
    """The verdict a worker computes, unbounded: call it only under a CPU limit.

    Not equal when :func:`answer_rule_broken` names a rule; else math-verify on
    \\boxed{answer} against \\boxed{ground_truth}, LaTeX extraction only, with
    its own signal-based timeouts off (the worker's CPU budget bounds the time).
    When math-verify says not equal and both sides are plain expressions (no
    relation, set or matrix), they are still equal when sympy simplifies their
    difference to 0: math-verify compares a bare symbol by name only, so
    "\\frac{x}{2}+\\frac{x}{2}" would not equal "x".
    """
    if answer_rule_broken(answer, ground_truth) is not None:
        return False
    from math_verify import LatexExtractionConfig, parse, verify

    config = [LatexExtractionConfig()]
    gold = parse("\\boxed{" + ground_truth + "}", config, parsing_timeout=None)
    predicted = parse("\\boxed{" + answer + "}", config, parsing_timeout=None)
    if not gold or not predicted:
        return False
    if verify(gold, predicted, timeout_seconds=None):
        return True
    return _simplify_to_equal(gold[0], predicted[0])


def _simplify_to_equal(gold: object, predicted: object) -> bool:
    """Both plain sympy expressions whose difference simplifies to 0."""
    import sympy

    plain = all(
        isinstance(value, sympy.Expr) and not isinstance(value, sympy.MatrixBase)
        for value in (gold, predicted)
    )
    if not plain:
        return False
    try:
        return bool(sympy.simplify(gold - predicted).is_zero)
    except Exception:
        return False


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
class _Worker:
    """A forked worker as the template sees it: pipes, current request, clocks."""

    pid: int
    requests: int  # write end: request lines to the worker
    replies: int  # read end: verdict lines from the worker
    request_id: int | None = None
    deadline: float = math.inf
    process_cpu: float = 0.0  # the worker's CPU seconds when it took the request
    buffer: bytes = b""
    overdue: bool = False  # past its wall deadline: killed
    retiring: bool = False  # said it exits after its last verdict


class _TemplateLoop:
    """Reads requests on stdin, hands each to an idle worker (forking one when
    fewer than ``max_workers`` exist), and relays verdicts to stdout."""

    def __init__(self, replies: int, devnull: int, limits: GraderLimits) -> None:
        self.replies = replies
        self.devnull = devnull
        self.limits = limits
        self.workers: dict[int, _Worker] = {}  # by the worker's replies fd
        self.queue: collections.deque[dict] = collections.deque()
        self.buffer = b""

    def run(self) -> None:
        while True:
            fds = [0, *self.workers]
            readable, _, _ = select.select(fds, [], [], self.wait())
            for fd in readable:
                if fd == 0 and not self.read_requests():
                    self.kill_workers()
                    return
                if fd != 0:
                    self.read_worker(fd)
            self.stop_overdue()
            self.dispatch()

    def wait(self) -> float | None:
        """Seconds until the nearest wall deadline (None: no grade running)."""
        deadlines = [w.deadline for w in self.workers.values() if not w.overdue]
        nearest = min(deadlines, default=math.inf)
        return None if nearest == math.inf else max(nearest - time.monotonic(), 0.0)

    def read_requests(self) -> bool:
        """Queue every complete request line; False at end of input."""
        data = os.read(0, 1 << 16)
        if not data:
            return False
        self.buffer += data
        while b"\n" in self.buffer:
            line, self.buffer = self.buffer.split(b"\n", 1)
            self.queue.append(json.loads(line))
        return True

    def dispatch(self) -> None:
        """Hand queued requests to idle workers, forking workers as needed."""
        while self.queue:
            worker = self.idle_worker()
            if worker is None:
                return
            request = self.queue.popleft()
            line = {k: request[k] for k in ("answer", "ground_truth")}
            try:
                os.write(worker.requests, json.dumps(line).encode("ascii") + b"\n")
            except OSError:  # it just died: its end of file arrives next
                self.queue.appendleft(request)
                worker.retiring = True
                continue
            worker.request_id = request["id"]
            worker.deadline = time.monotonic() + self.limits.wall_seconds

    def idle_worker(self) -> _Worker | None:
        """An idle worker, a new one, or None when all ``max_workers`` are busy
        (or no process can be forked: the first queued grade is then lost)."""
        for worker in self.workers.values():
            if worker.request_id is None and not worker.retiring:
                return worker
        if len(self.workers) >= self.limits.max_workers:
            return None
        try:
            return self.fork_worker()
        except OSError:
            request = self.queue.popleft()
            _send(self.replies, {"id": request["id"], "status": "lost", "equal": False})
            return None

    def fork_worker(self) -> _Worker:
        down_read, down_write = os.pipe()
        up_read, up_write = os.pipe()
        try:
            pid = os.fork()
        except OSError:
            for fd in (down_read, down_write, up_read, up_write):
                os.close(fd)
            raise
        if pid == 0:
            inherited = [self.replies, down_write, up_read]
            for worker in self.workers.values():
                inherited += [worker.requests, worker.replies]
            for fd in inherited:
                os.close(fd)
            os.dup2(self.devnull, 0)
            _serve_as_worker(down_read, up_write, self.limits)
        os.close(down_read)
        os.close(up_write)
        worker = _Worker(pid, requests=down_write, replies=up_read)
        self.workers[up_read] = worker
        return worker

    def read_worker(self, fd: int) -> None:
        """Relay a worker's verdicts; at its end of file, reap it, and when it
        died holding a grade, report how (timeout or lost)."""
        worker = self.workers[fd]
        data = os.read(fd, 1 << 12)
        if data:
            worker.buffer += data
            while b"\n" in worker.buffer and worker.request_id is not None:
                line, worker.buffer = worker.buffer.split(b"\n", 1)
                self.relay(worker, json.loads(line))
            return
        os.close(fd)
        os.close(worker.requests)
        del self.workers[fd]
        _, status, resources = os.wait4(worker.pid, 0)
        if worker.request_id is not None:
            total = resources.ru_utime + resources.ru_stime
            reply = {"id": worker.request_id, **_stopped(worker, status)}
            usage = {"cpu_seconds": max(total - worker.process_cpu, 0.0)}
            _send(self.replies, {**reply, **usage, "worker": worker.pid})

    def relay(self, worker: _Worker, verdict: dict) -> None:
        reply = {"id": worker.request_id, "status": "graded", "equal": verdict["equal"]}
        usage = {"cpu_seconds": verdict["cpu_seconds"], "worker": worker.pid}
        _send(self.replies, {**reply, **usage})
        worker.request_id, worker.deadline = None, math.inf
        worker.process_cpu = verdict["process_cpu"]
        worker.retiring = verdict["retire"]

    def stop_overdue(self) -> None:
        now = time.monotonic()
        for worker in self.workers.values():
            if now >= worker.deadline and not worker.overdue:
                worker.overdue = True
                os.kill(worker.pid, signal.SIGKILL)

    def kill_workers(self) -> None:
        for worker in self.workers.values():
            os.kill(worker.pid, signal.SIGKILL)


def _stopped(worker: _Worker, status: int) -> dict:
    """Status and verdict of a grade whose worker died while holding it."""
    stopped_by = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    timed_out = worker.overdue or stopped_by in (signal.SIGPROF, signal.SIGXCPU)
    return {"status": "timeout" if timed_out else "lost", "equal": False}


def _serve_as_worker(requests: int, replies: int, limits: GraderLimits) -> None:
    """In a forked worker: grade request lines until end of input, each under a
    fresh ``ITIMER_PROF`` of ``cpu_seconds``; exit after ``grades_per_worker``
    grades or once the address space has grown by half of ``memory_bytes``."""
    try:
        signal.signal(signal.SIGPROF, signal.SIG_DFL)
        start_size = _address_space_bytes()
        if start_size is not None:
            _cap_address_space(start_size + limits.memory_bytes)
        lines = os.fdopen(requests, "rb")
        graded, retire = 0, False
        while not retire and (line := lines.readline()):
            verdict = _grade_one(json.loads(line), limits.cpu_seconds)
            graded += 1
            size = _address_space_bytes()
            grown = size is not None and size > start_size + limits.memory_bytes // 2
            retire = graded >= limits.grades_per_worker or grown
            _send(replies, {**verdict, "retire": retire})
    finally:
        os._exit(0)


def _grade_one(request: dict, cpu_seconds: float) -> dict:
    """One verdict under the CPU timer; SIGPROF ends the process if it fires."""
    start = time.process_time()
    signal.setitimer(signal.ITIMER_PROF, cpu_seconds)
    try:
        verdict = verdict_in_this_process(request["answer"], request["ground_truth"])
    except Exception:
        verdict = False
    signal.setitimer(signal.ITIMER_PROF, 0)
    end = time.process_time()
    return {"equal": verdict, "cpu_seconds": end - start, "process_cpu": end}


def _address_space_bytes() -> int | None:
    """This process's address-space size (Linux; None where /proc is missing)."""
    try:
        with open("/proc/self/statm") as statm:
            pages = int(statm.read().split()[0])
    except OSError:
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


def _cap_address_space(limit: int) -> None:
    """Allocations that would grow the address space past ``limit`` fail."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


if __name__ == "__main__":
    serve(GraderLimits(**json.loads(sys.argv[1])))
