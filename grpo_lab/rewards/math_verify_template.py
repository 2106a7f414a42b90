"""The template process of ``math_verify_workers``: run as a script, it grades.

``MathGrader`` (in :mod:`grpo_lab.rewards.math_verify_workers`) starts this file as
``python -P -B math_verify_template.py LIMITS_JSON``. Run that way it imports
math-verify, grades ``WARM_UP_PAIRS`` once, freezes its heap and then relays
request lines from stdin to forked workers, each grading under a CPU timer, an
address-space cap and no file writes; verdicts go back on stdout, one JSON line
each. The protocol and the limits are described in ``math_verify_workers``.

It imports the standard library only, never ``grpo_lab`` (``-P`` keeps the
caller's folder off ``sys.path``, and a package import would bring the caller's
dependencies into a process that forks). The grading rules
(:func:`answer_rule_broken`) and the verdict (:func:`verdict_in_this_process`)
live here because the workers compute them; ``math_verify_workers`` re-exports
them for callers.
"""

from __future__ import annotations

import collections
import json
import math
import os
import re
import select
import signal
import sys
import time
from dataclasses import dataclass

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


# Relations that let one answer name two values (math-verify grades "4 \\approx 5"
# as 4): an answer uses one exactly where its ground truth uses it too.
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
    * relations: an answer uses an approximate relation (\\approx, \\sim,
      \\simeq, \\cong, ...), \\pm / \\mp, \\equiv or \\propto (or their
      Unicode signs) exactly when its ground truth uses the same family;
      math-verify keeps one side of "4 \\approx 5", so the other side would be
      a free guess, and a ground truth written that way would accept either
      side alone ("4" against "4 \\approx 5").

    Units in ``\\text{...}`` are left to math-verify: they do not change a
    number's value, as a percent sign does.
    """
    if _has_percent(answer) != _has_percent(ground_truth):
        return "percent"
    for family in HEDGING_RELATIONS:
        if _uses_relation(answer, family) != _uses_relation(ground_truth, family):
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
