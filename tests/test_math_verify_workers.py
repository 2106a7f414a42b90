"""Tests for grpo_lab.rewards.math_verify_workers: CPU budget, wall ceiling, process hygiene."""

from __future__ import annotations

import gc
import itertools
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from grpo_lab.rewards import math_verify_workers
from grpo_lab.rewards.math_verify_workers import MathGrade, MathGrader

BUDGET = 0.3
WALL = 1.0
# A killed grade may show a little more CPU than its budget (the kill itself).
CPU_SLACK = 0.1
# No single call may take longer than this, even on a loaded machine.
HANG_SECONDS = 20.0
HUGE = "1000000!"  # sympy computes the factorial in one C call

linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /proc and uses prlimit"
)


@pytest.fixture(scope="module")
def grader():
    limits = {"cpu_seconds": BUDGET, "wall_seconds": WALL, "grades_per_worker": 3}
    with MathGrader(**limits) as shared:
        shared.start()
        yield shared


# A stand-in template that starts in milliseconds: it speaks the protocol and
# calls two strings equal when they are identical. For the lifecycle tests.
ECHO_TEMPLATE = """
import json, sys
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    request = json.loads(line)
    equal = request["answer"] == request["ground_truth"]
    reply = {"id": request["id"], "status": "graded", "equal": equal}
    print(json.dumps(reply), flush=True)
"""


def echo_grader(**limits: float) -> MathGrader:
    grader = MathGrader(**limits)
    command = [sys.executable, "-c", ECHO_TEMPLATE]
    grader._command = lambda: command  # holds no reference to the grader
    return grader


def process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def children_of(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(child) for child in text.split()]


@pytest.mark.parametrize(
    ("options", "setting"),
    [
        ({"cpu_seconds": 0}, "cpu_seconds"),
        ({"cpu_seconds": "1"}, "cpu_seconds"),
        ({"cpu_seconds": 2.0, "wall_seconds": 1.0}, "wall_seconds"),
        ({"memory_bytes": 1000}, "memory_bytes"),
        ({"max_workers": 0}, "max_workers"),
        ({"max_workers": 2.0}, "max_workers"),
        ({"grades_per_worker": True}, "grades_per_worker"),
    ],
)
def test_grader_rejects_unusable_limits(options: dict, setting: str) -> None:
    with pytest.raises(ValueError, match=f"{setting} must be"):
        MathGrader(**options)


def test_grade_is_math_verify_verdict_with_its_cpu_time(grader: MathGrader) -> None:
    right = grader.grade("0.5", "\\frac{1}{2}")
    wrong = grader.grade("\\frac{1}{3}", "\\frac{1}{2}")
    assert (right.equal, right.status) == (True, "graded")
    assert (wrong.equal, wrong.status) == (False, "graded")
    assert 0.0 < right.cpu_seconds < BUDGET
    assert grader.grade(None, "1").equal is False  # type: ignore[arg-type]


def test_cpu_budget_stops_one_long_c_call_and_the_template_survives(
    grader: MathGrader,
) -> None:
    template, timeouts = grader.pid, grader.timeouts
    start = time.perf_counter()
    grade = grader.grade(HUGE, "1")
    elapsed = time.perf_counter() - start
    assert (grade.equal, grade.status, grade.timed_out) == (False, "timeout", True)
    # The kernel ended it when its CPU time reached the budget, not before.
    assert 0.8 * BUDGET <= grade.cpu_seconds <= BUDGET + CPU_SLACK
    assert elapsed < HANG_SECONDS
    assert grader.timeouts == timeouts + 1
    # Only the forked child was killed: the same template grades the next answer.
    assert grader.pid == template
    assert grader.grade("2", "\\sqrt{4}").equal is True


def test_workers_are_reused_then_replaced_after_their_quota_or_a_kill(
    grader: MathGrader,
) -> None:
    pairs = [(f"\\frac{{{k}}}{{7}}", f"\\frac{{{2 * k}}}{{14}}") for k in range(1, 8)]
    grades = [grader.grade(*pair) for pair in pairs]
    assert all((grade.equal, grade.status) == (True, "graded") for grade in grades)
    workers = [grade.worker_pid for grade in grades]
    # Sequential grades go to one worker until its quota of 3, then to a new one.
    runs = [len(list(run)) for _, run in itertools.groupby(workers)]
    assert max(runs) == 3 and len(runs) >= 3 and len(set(workers)) == len(runs)
    killed = grader.grade(HUGE, "1")
    assert killed.status == "timeout"
    after = grader.grade("0.5", "\\frac{1}{2}")
    assert after.equal is True and after.worker_pid != killed.worker_pid
    assert not process_exists(killed.worker_pid)


@linux_only
@pytest.mark.slow
def test_workers_retiring_under_16_threads_lose_no_grade(grader: MathGrader) -> None:
    pairs = [(f"\\frac{{{k}}}{{2}}", f"{k / 2}") for k in range(1, 33)]
    grades: list[MathGrade | None] = [None] * len(pairs)

    def work(first: int) -> None:
        for index in range(first, len(pairs), 16):
            grades[index] = grader.grade(*pairs[index])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(HANG_SECONDS)
    assert all((grade.equal, grade.status) == (True, "graded") for grade in grades)
    assert len({grade.worker_pid for grade in grades}) >= 11  # 3 grades each, at most


@linux_only
def test_template_may_not_write_files_and_never_loads_torch(
    grader: MathGrader,
) -> None:
    import resource

    pid = grader.pid
    assert resource.prlimit(pid, resource.RLIMIT_FSIZE) == (0, 0)
    assert resource.prlimit(pid, resource.RLIMIT_CORE) == (0, 0)
    maps = Path(f"/proc/{pid}/maps").read_text()
    assert "sympy" not in maps  # a pure Python library: no mapped files
    assert "libtorch" not in maps
    assert "libtorch" in Path(f"/proc/{os.getpid()}/maps").read_text()


def test_the_template_script_imports_no_grpo_lab_module() -> None:
    import ast

    tree = ast.parse(math_verify_workers.TEMPLATE_SCRIPT.read_text(encoding="utf-8"))
    top_level = set()
    for node in ast.walk(tree):  # function-level imports too
        if isinstance(node, ast.Import):
            top_level |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            top_level.add((node.module or "").split(".")[0])
    assert top_level, "no import found: the check reads the wrong file"
    graders = {"math_verify", "sympy", "__future__"}  # imported by the workers
    assert top_level <= set(sys.stdlib_module_names) | graders, top_level


def test_a_lone_copy_of_the_template_script_grades(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Copied where no grpo_lab is beside it: the script stands on its own.
    lone = tmp_path / "template.py"
    lone.write_bytes(math_verify_workers.TEMPLATE_SCRIPT.read_bytes())
    monkeypatch.setattr(math_verify_workers, "TEMPLATE_SCRIPT", lone)
    with MathGrader(cpu_seconds=BUDGET, wall_seconds=WALL, max_workers=1) as grader:
        right, wrong = grader.grade("0.5", "\\frac{1}{2}"), grader.grade("1", "2")
    assert (right.equal, right.status) == (True, "graded")
    assert (wrong.equal, wrong.status) == (False, "graded")


@linux_only
def test_wall_ceiling_stops_a_worker_that_stops_using_cpu() -> None:
    # A CPU budget as long as the wall ceiling (not BUDGET): even when this thread
    # is late to stop the worker on a loaded machine, the worker is far from its
    # CPU budget when it stops, so only the wall ceiling can end the grade.
    with MathGrader(cpu_seconds=WALL, wall_seconds=WALL) as grader:
        grader.start()
        _stop_the_worker_and_wait(grader)


def _stop_the_worker_and_wait(grader: MathGrader) -> None:
    timeouts, grades = grader.timeouts, []
    caller = threading.Thread(target=lambda: grades.append(grader.grade(HUGE, "1")))
    caller.start()
    deadline = time.monotonic() + HANG_SECONDS
    while not children_of(grader.pid) and time.monotonic() < deadline:
        time.sleep(0.001)
    workers = children_of(grader.pid)
    for worker in workers:
        os.kill(worker, signal.SIGSTOP)  # no CPU used: only the wall ceiling ends it
    caller.join(HANG_SECONDS)
    for worker in workers:
        if process_exists(worker):  # an idle one
            os.kill(worker, signal.SIGCONT)
    assert grades[0].status == "timeout"
    assert grades[0].cpu_seconds < 0.8 * WALL  # stopped well before its CPU budget
    assert grader.timeouts == timeouts + 1


def test_stopped_or_killed_template_is_replaced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(math_verify_workers, "REPLY_GRACE_SECONDS", 0.2)
    grader = echo_grader(cpu_seconds=BUDGET, wall_seconds=BUDGET)
    grader.start()
    stopped = grader.pid
    os.kill(stopped, signal.SIGSTOP)  # it never replies: the caller gives up
    start = time.perf_counter()
    assert grader.grade("1", "1").status == "timeout"
    assert time.perf_counter() - start < BUDGET + 0.2 + 5.0
    assert grader.timeouts == 1
    assert not process_exists(stopped)
    assert grader.grade("1", "1") == MathGrade(True, "graded")
    killed = grader.pid
    assert killed != stopped
    os.kill(killed, signal.SIGKILL)
    # The grade in flight when the template dies is retried on a new one.
    assert grader.grade("1", "1") == MathGrade(True, "graded")
    replacement = grader.pid
    assert replacement != killed
    grader.close()
    assert grader.pid is None and not process_exists(replacement)
    grader.start()
    collected = grader.pid
    del grader
    gc.collect()
    assert not process_exists(collected)  # the finalizer stopped it


def test_template_that_cannot_start_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    grader = MathGrader()
    monkeypatch.setattr(grader, "_command", lambda: [sys.executable, "-c", "pass"])
    with pytest.raises(RuntimeError, match="could not start"):
        grader.grade("0.5", "\\frac{1}{2}")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_process_grades_with_its_own_template_and_closes_it() -> None:
    grader = echo_grader()
    grader.start()
    parent_template = grader.pid
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: must never return into pytest
        try:
            grade = grader.grade("x", "x")
            template = grader.pid
            grader.close()
            report = {
                "equal": grade.equal,
                "template": template,
                "closed": grader.pid is None and not process_exists(template),
            }
            os.write(write_end, json.dumps(report).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        report = json.loads(pipe.read() or "{}")
    os.waitpid(pid, 0)
    assert report["equal"] is True
    assert report["template"] not in (None, parent_template)
    assert report["closed"] is True  # close() stopped the child's template
    assert grader.pid == parent_template and process_exists(parent_template)
    assert grader.grade("y", "y").equal is True
    grader.close()


# Deep nesting and power towers of the kinds that kept an unbounded
# math_verify_equal running past 5 s.
NESTED_AND_TOWERS = [
    "\\sqrt[\\frac{1}{999999999}]{10}",
    "10^{99 \\cdot 99 \\cdot 99 \\cdot 99}",
    "9^{9^{9^{9}}}",
    "10^10^10^10",
    "2^{2^{2^{2^{2^{2}}}}}",
    "(9^{9999})^{9999}",
    "1000000!",
    "\\frac{1}{" * 25 + "2" + "}" * 25,
    "\\sqrt{" * 40 + "2" + "}" * 40,
    "{" * 140 + "1" + "}" * 140,
    "(" * 140 + "1" + ")" * 140,
]


@pytest.mark.slow
def test_math_verify_equal_called_directly_returns_within_its_budget(
    grader: MathGrader,
) -> None:
    for text in NESTED_AND_TOWERS:
        for answer, ground_truth in ((text, "42"), ("42", text)):
            start = time.perf_counter()
            equal = math_verify_workers.math_verify_equal(
                answer, ground_truth, grader=grader
            )
            elapsed = time.perf_counter() - start
            assert equal is False, text
            assert elapsed < WALL + math_verify_workers.REPLY_GRACE_SECONDS, text


def test_math_verify_equal_defaults_to_the_shared_bounded_grader(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = []

    class Recording:
        def grade(self, answer: str, ground_truth: str) -> MathGrade:
            calls.append((answer, ground_truth))
            return MathGrade(True, "graded")

    monkeypatch.setattr(math_verify_workers, "default_math_grader", Recording)
    assert math_verify_workers.math_verify_equal("0.5", "\\frac{1}{2}") is True
    assert calls == [("0.5", "\\frac{1}{2}")]


def test_math_verify_equal_is_the_worker_verdict(grader: MathGrader) -> None:
    assert math_verify_workers.math_verify_equal("0.5", "\\frac{1}{2}", grader=grader)
    assert math_verify_workers.math_verify_equal(
        "\\frac{x}{2}+\\frac{x}{2}", "x", grader=grader
    )
    assert not math_verify_workers.math_verify_equal("4 \\approx 5", "4", grader=grader)
    assert not math_verify_workers.math_verify_equal("400\\%", "4", grader=grader)
