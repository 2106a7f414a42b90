"""Tests for grpo_lab.rewards: hand-graded cases, hostile inputs, time bounds."""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import math_verify
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_lab import rewards
from grpo_lab.rewards import (
    contains_answer_reward,
    countdown_reward,
    exact_match_reward,
    extract_r1_zero_answer,
    grade_math_answer,
    graded_scratchpad_reward,
    last_boxed_content,
    normalize_math_answer,
    parse_countdown_equation,
    r1_zero_reward,
    scratchpad_reward,
)
from grpo_lab.rewards.math_verify_workers import (
    MathGrade,
    MathGrader,
    answer_rule_broken,
    default_math_grader,
)

# A toy-reward call must return within this many seconds, even on a loaded machine.
WALL_BOUND_SECONDS = 2.0
# No math grade may take longer than this (a "hang"), even on a loaded machine.
HANG_SECONDS = 20.0
# CPU budget of the grader used for hostile inputs (the default is 1 s).
FAST_BUDGET = 0.1
# A killed grade may show a little more CPU than its budget (the kill itself).
CPU_SLACK = 0.1
REWARD_KEYS = {"reward", "format_reward", "answer_reward"}
R1_ZERO_KEYS = {*REWARD_KEYS, "grading_timeout"}


def r1(answer: str) -> str:
    """A well-formed r1-zero response around ``answer``."""
    return f" I add the numbers. </think> <answer>{answer}</answer>"


@contextlib.contextmanager
def collector_paused():
    """Time the reward, not a full garbage collection of the test process's heap
    (torch + sympy), which alone took ~1 s on a loaded 2-core machine."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def assert_valid_scores(scores: dict[str, float]) -> None:
    assert set(scores) in (REWARD_KEYS, R1_ZERO_KEYS)
    for value in scores.values():
        assert isinstance(value, float)
        assert not math.isnan(value)
        assert 0.0 <= value <= 1.0
    assert scores["reward"] == scores["answer_reward"]


@pytest.fixture(scope="module", autouse=True)
def warm_math_verify() -> None:
    """Start the default grader's worker once, so timed calls measure grading."""
    default_math_grader().start()


@pytest.fixture(scope="module")
def fast_grader() -> Iterator[MathGrader]:
    """A grader with a small CPU budget, so hostile inputs cost little time."""
    with MathGrader(cpu_seconds=FAST_BUDGET) as grader:
        grader.start()
        yield grader


# ---------------------------------------------------------------- exact match


@pytest.mark.parametrize(
    ("response", "ground_truth", "format_reward", "answer_reward"),
    [
        ("54321", "54321", 1.0, 1.0),
        (" 42\n", "42", 1.0, 1.0),  # surrounding whitespace is ignored
        ("-7", "-7", 1.0, 1.0),
        ("54312", "54321", 1.0, 0.0),  # well-formed, wrong
        ("042", "42", 1.0, 0.0),  # exact: a leading zero is a different string
        ("4 2", "42", 0.0, 0.0),  # inner space: not a digit string
        ("42<eos>", "42", 0.0, 0.0),
        ("", "42", 0.0, 0.0),
        ("forty-two", "42", 0.0, 0.0),
    ],
)
def test_exact_match_reward_hand_cases(
    response: str, ground_truth: str, format_reward: float, answer_reward: float
) -> None:
    scores = exact_match_reward(response, ground_truth)
    assert scores == {
        "reward": answer_reward,
        "format_reward": format_reward,
        "answer_reward": answer_reward,
    }


def test_exact_match_reward_rejects_non_strings_and_huge_responses() -> None:
    assert exact_match_reward(None, "1")["format_reward"] == 0.0  # type: ignore[arg-type]
    assert exact_match_reward("1", None)["reward"] == 0.0  # type: ignore[arg-type]
    huge = "1" * (rewards.MAX_RESPONSE_CHARS + 1)
    assert exact_match_reward(huge, huge)["format_reward"] == 0.0


# ---------------------------------------------------------------- r1-zero format


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        (" x </think> <answer> 42 </answer>", " 42 "),
        (" <answer>1</answer> x </think> <answer>2</answer>", "2"),  # last <answer>
        (" x </think> <answer>7</answer> trailing", "7"),
        (" x </think><answer>7</answer>", None),  # no space between the tags
        (" x </think> <answer>7", None),  # never closed
        (" x <answer>7</answer>", None),  # no </think>
    ],
)
def test_extract_r1_zero_answer(response: str, answer: str | None) -> None:
    assert extract_r1_zero_answer(response) == answer


@pytest.mark.parametrize(
    ("text", "content"),
    [
        ("so \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),  # nested braces
        ("\\boxed{1} then \\boxed{2}", "2"),  # the last one
        ("\\boxed {3}", "3"),
        ("\\boxed{[0, 1)}", "[0, 1)"),  # only braces count
        ("\\boxed{1)}", "1)"),
        ("\\boxed{\\frac{1}{2}", None),  # unbalanced
        ("\\boxed 3", None),
        ("no box", None),
    ],
)
def test_last_boxed_content(text: str, content: str | None) -> None:
    assert last_boxed_content(text) == content


def test_normalize_math_answer() -> None:
    assert normalize_math_answer(" $\\dfrac{7}{12}$. ") == "\\frac{7}{12}"
    assert normalize_math_answer("\\left( 3, \\pi \\right)") == "(3,\\pi)"
    assert normalize_math_answer("1,625") == "1625"
    assert normalize_math_answer("\\$1,625") == "1625"
    assert normalize_math_answer("(1,625)") == "(1,625)"  # not a plain number


@pytest.mark.parametrize(
    ("response", "ground_truth", "format_reward", "answer_reward"),
    [
        (r1("42"), "42", 1.0, 1.0),
        (r1(" 1,625 "), "1625", 1.0, 1.0),  # fast path: separators dropped
        (r1("\\dfrac{7}{12}"), "\\frac{7}{12}", 1.0, 1.0),  # fast path
        (r1("0.5"), "\\frac{1}{2}", 1.0, 1.0),  # math-verify
        (r1("\\sqrt{45}"), "3\\sqrt{5}", 1.0, 1.0),  # math-verify
        (r1("(3, \\frac{\\pi}{2})"), "\\left( 3, \\frac{\\pi}{2} \\right)", 1.0, 1.0),
        (r1("the answer is \\boxed{28}"), "28", 1.0, 1.0),  # boxed inside answer
        (r1("\\binom{5}{2}"), "10", 1.0, 1.0),  # binomial, factorial, sum: graded
        (r1("5!"), "120", 1.0, 1.0),
        (r1("\\sum_{k=1}^3 k"), "6", 1.0, 1.0),
        (r1("7"), "-7", 1.0, 0.0),  # two integers: compared without a worker
        (r1("41"), "42", 1.0, 0.0),
        (r1("\\frac{1}{3}"), "\\frac{1}{2}", 1.0, 0.0),
        (r1("\\boxed{28"), "28", 1.0, 0.0),  # unbalanced box: format only
        (r1(""), "42", 1.0, 0.0),
        (" 42 </think><answer>42</answer>", "42", 0.0, 0.0),  # format broken
        ("42", "42", 0.0, 0.0),
    ],
)
def test_r1_zero_reward_hand_cases(
    response: str, ground_truth: str, format_reward: float, answer_reward: float
) -> None:
    scores = r1_zero_reward(response, ground_truth)
    assert scores["format_reward"] == format_reward
    assert scores["answer_reward"] == answer_reward
    assert scores["reward"] == answer_reward


def test_r1_zero_reward_grades_in_a_worker_thread() -> None:
    # math-verify's signal timeouts fail outside the main thread; ours must not.
    results: list[dict[str, float]] = []
    worker = threading.Thread(
        target=lambda: results.append(r1_zero_reward(r1("0.5"), "\\frac{1}{2}"))
    )
    worker.start()
    worker.join(timeout=30)
    assert results == [
        {
            "reward": 1.0,
            "format_reward": 1.0,
            "answer_reward": 1.0,
            "grading_timeout": 0.0,
        }
    ]


# ---------------------------------------------------------------- math-verify in a worker

# Legitimate answers, graded exactly as plain math-verify grades them (the oracle).
LEGITIMATE_PAIRS = [
    ("\\binom{5}{2}", "10"),
    ("\\binom{5}{2}", "11"),
    ("\\dbinom{6}{2}", "15"),
    ("5!", "120"),
    ("5!", "100"),
    ("3! \\cdot 2", "12"),
    ("\\sum_{k=1}^3 k", "6"),
    ("\\sum_{k=1}^{4} k^2", "30"),
    ("\\sum_{k=1}^{4} k^2", "31"),
    ("[0,1)", "[0, 1)"),
    ("[0,1)", "[0, 1]"),
    ("(-\\infty, 2]", "(-\\infty,2]"),
    ("[1,2] \\cup [5,6]", "[5,6] \\cup [1,2]"),
    ("\\{1,2,3\\}", "\\{3,2,1\\}"),
    ("\\{1,2\\}", "\\{1,3\\}"),
    (
        "\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}",
        "\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}",
    ),
    (
        "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}",
        "\\begin{pmatrix} 2 \\\\ 1 \\end{pmatrix}",
    ),
    ("(x+1)^2", "x^2+2x+1"),
    ("x^3-1", "(x-1)(x^2+x+1)"),
    ("x^2+1", "x^2-1"),
    ("0.5", "\\frac{1}{2}"),
    ("\\frac{14}{24}", "\\frac{7}{12}"),
    ("\\sqrt{45}", "3\\sqrt{5}"),
    ("\\frac{\\sqrt{3}}{2}", "\\sin(\\pi/3)"),
    ("(3, \\frac{\\pi}{2})", "\\left( 3, \\frac{\\pi}{2} \\right)"),
    ("x=3", "3"),
    ("10\\%", "10\\%"),
    ("\\pi", "3.14159"),
]

# Answers that name two values at once, or a value off by a factor of 100, which
# plain math-verify calls equal: the written rules of math_verify_workers's
# answer_rule_broken make each one 0 (answer, ground truth, the rule broken).
HEDGED_PAIRS = [
    ("4 \\approx 5", "4", "approximately"),
    ("4\\approx 4", "4", "approximately"),
    ("4 \\simeq 5", "4", "approximately"),
    ("4 \u2248 5", "4", "approximately"),
    ("4\\%", "4", "percent"),
    ("400\\%", "4", "percent"),
    ("4 percent", "4", "percent"),
    ("4", "4\\%", "percent"),
    ("4", "400\\%", "percent"),
    ("0.04", "4\\%", "percent"),
    ("10\\%", "0.1", "percent"),
    ("4 \\pm 1", "4", "plus or minus"),
    ("4 \\equiv 1", "4", "congruent"),
    # A ground truth that hedges accepts neither side alone.
    ("4", "4 \\approx 5", "approximately"),
    ("5", "4 \u2248 5", "approximately"),
    ("4", "4 \\pm 1", "plus or minus"),
]
# Equal after simplification, which plain math-verify misses (a bare symbol is
# compared by name), and pairs the rules leave alone.
SIMPLIFIED_PAIRS = [
    ("\\frac{x}{2}+\\frac{x}{2}", "x", True),
    ("x/2 + x/2", "x", True),
    ("x + 1 - 1", "x", True),
    ("\\frac{x}{2}+\\frac{x}{2}", "y", False),
    ("\\frac{x}{2}+\\frac{x}{3}", "x", False),
    ("4\\%", "4\\%", True),
    ("a \\le 3", "a \\leq 3", True),
    ("2 \\pm 1", "2\\pm 1", True),
]

# Each of these once stalled or could stall grading in-process. The first two pass
# any syntax screen; sympy computes them inside one C call.
HOSTILE_MATH = {
    "root of index 1/999999999": "\\sqrt[\\frac{1}{999999999}]{10}",
    "cdot chain exponent": "10^{99 \\cdot 99 \\cdot 99 \\cdot 99}",
    "long cdot chain exponent": "10^{" + " \\cdot ".join(["9"] * 9) + "}",
    "times chain exponent": "10^{999999 \\times 999999}",
    "braced tower": "9^{9^{9^{9}}}",
    "bare tower": "10^10^10^10",
    "star tower": "9**9**9**9",
    "star tower in parentheses": "2**(3**(4**5))",
    "tower of twos": "2^{2^{2^{2^{2^{2}}}}}",
    "tower of e": "e^{e^{e^{e^{100}}}}",
    "power of a power": "(9^{9999})^{9999}",
    "double exponent": "10^{10^{10}}",
    "negative double exponent": "10^{-10^{10}}",
    "factorial": "1000000!",
    "factorial of a power": "(10^{6})!",
    "factorial of a factorial": "(10!)!",
    "double factorial": "(10^{7})!!",
    "binomial of powers": "\\binom{10^9}{5*10^8}",
    "binomial": "\\binom{1000000}{500000}",
    "root of index 10^-9": "\\sqrt[10^{-9}]{2}",
    "nested radicals": "\\sqrt{" * 40 + "2" + "}" * 40,
    "nested indexed radicals": "".join(f"\\sqrt[{k}]{{" for k in range(3, 30))
    + "2"
    + "}" * 27,
    "radical of a tower": "\\sqrt{9^{9^{9^{9}}}}",
    "nested fractions": "\\frac{1}{" * 25 + "2" + "}" * 25,
    "deep braces": "{" * 140 + "1" + "}" * 140,
    "deep parentheses": "(" * 140 + "1" + ")" * 140,
    "huge sum": "\\sum_{i=1}^{10^{9}} i^{i}",
    "huge product": "\\prod_{k=1}^{10^{6}} k",
    "gamma": "\\Gamma(10^{9})",
    "symbolic tower": "x^{x^{x^{x^{x^{x}}}}}",
    "equation with a tower": "x = 9^{9^{9}}",
    "gcd of a power": "\\gcd(10^{99999999}, 3)",
    "many terms": "+".join(f"x^{{{k}}}" for k in range(40)),
    "very long": "1+" * 5_000 + "1",
}
REPORTED_HOSTILE = ("root of index 1/999999999", "cdot chain exponent")


def math_verify_oracle(answer: str, ground_truth: str) -> bool:
    """Plain math-verify, in this process, with its default settings."""
    gold = math_verify.parse("\\boxed{" + ground_truth + "}")
    predicted = math_verify.parse("\\boxed{" + answer + "}")
    return bool(math_verify.verify(gold, predicted))


def timed_grade(
    answer: str, ground_truth: str, grader: MathGrader
) -> tuple[MathGrade, float]:
    start = time.perf_counter()
    grade = grade_math_answer(answer, ground_truth, grader=grader)
    return grade, time.perf_counter() - start


def grade_from_threads(
    pairs: list[tuple[str, str]], grader: MathGrader, n_threads: int = 16
) -> list[tuple[MathGrade, float]]:
    """Grade ``pairs`` from ``n_threads`` threads started together; results in
    the order of ``pairs``. Fails when a thread is still running after
    ``HANG_SECONDS`` per pair (callers queue for the grader's worker slots)."""
    results: list[tuple[MathGrade, float] | None] = [None] * len(pairs)
    barrier = threading.Barrier(n_threads)

    def work(first: int) -> None:
        barrier.wait()
        for index in range(first, len(pairs), n_threads):
            results[index] = timed_grade(*pairs[index], grader)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + HANG_SECONDS * len(pairs)
    for thread in threads:
        thread.join(max(deadline - time.monotonic(), 0.0))
    assert not any(thread.is_alive() for thread in threads), "a grading thread hung"
    return results  # type: ignore[return-value]


@contextlib.contextmanager
def busy_cores(count: int = 1) -> Iterator[None]:
    """``count`` processes spinning for at most 60 s, all spinning before the
    body runs, and killed on exit."""
    spin = (
        "import time\nprint(flush=True)\nend = time.monotonic() + 60\n"
        "while time.monotonic() < end:\n    pass"
    )
    processes = [
        subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE)
        for _ in range(count)
    ]
    try:
        for process in processes:
            process.stdout.readline()  # started: the loop follows
        yield
    finally:
        for process in processes:
            process.kill()
            process.wait()
            process.stdout.close()


def assert_bounded_failures(
    names: list[str], results: list[tuple[MathGrade, float]], budget: float
) -> None:
    for name, (grade, elapsed) in zip(names, results):
        assert grade.equal is False, name
        assert grade.cpu_seconds <= budget + CPU_SLACK, (name, grade)
        assert elapsed < HANG_SECONDS, (name, elapsed)


def test_grade_math_answer_caps_and_shortcuts_use_no_worker() -> None:
    # MathGrade(..., cpu_seconds=0.0, worker_pid=None): decided in this process.
    long = "x+" * 200 + "1"  # 401 characters
    assert grade_math_answer(long, long) == MathGrade(False, "graded")  # answer cap
    assert grade_math_answer("x", long) == MathGrade(False, "graded")  # truth cap
    assert grade_math_answer(" \\dfrac{1}{2}. ", "\\frac{1}{2}") == MathGrade(
        True, "graded"
    )
    assert grade_math_answer("0042", "42") == MathGrade(True, "graded")  # integers
    assert grade_math_answer("1,000", "999") == MathGrade(False, "graded")


@pytest.mark.parametrize(("answer", "ground_truth"), LEGITIMATE_PAIRS)
def test_math_grades_equal_plain_math_verify(answer: str, ground_truth: str) -> None:
    expected = math_verify_oracle(answer, ground_truth)
    grade = grade_math_answer(answer, ground_truth)
    assert (grade.equal, grade.status) == (expected, "graded")
    scores = r1_zero_reward(r1(answer), ground_truth)
    assert scores["answer_reward"] == float(expected)
    assert scores["grading_timeout"] == 0.0


@pytest.mark.parametrize(("answer", "ground_truth", "rule"), HEDGED_PAIRS)
def test_hedged_answers_score_zero_by_a_written_rule(
    answer: str, ground_truth: str, rule: str
) -> None:
    assert answer_rule_broken(answer, ground_truth) == rule
    assert grade_math_answer(answer, ground_truth) == MathGrade(False, "graded")
    scores = r1_zero_reward(r1(answer), ground_truth)
    assert (scores["format_reward"], scores["answer_reward"]) == (1.0, 0.0)


def test_plain_math_verify_would_have_paid_the_hedges() -> None:
    # The attack is real: without the rules each of these scores 1.
    paid = [a for a, t, _ in HEDGED_PAIRS[:2] + HEDGED_PAIRS[4:6]]
    assert all(math_verify_oracle(a, "4") for a in paid)
    assert math_verify_oracle("4", "4 \\approx 5")  # and a hedging ground truth


def test_the_worker_applies_the_rules_to_direct_callers(fast_grader) -> None:
    for answer, ground_truth, _ in HEDGED_PAIRS:
        assert fast_grader.grade(answer, ground_truth).equal is False, answer
    assert fast_grader.grade("4", "4").equal is True


@pytest.mark.parametrize(("answer", "ground_truth", "equal"), SIMPLIFIED_PAIRS)
def test_expressions_equal_after_simplification_score_one(
    answer: str, ground_truth: str, equal: bool
) -> None:
    grade = grade_math_answer(answer, ground_truth)
    assert (grade.equal, grade.status) == (equal, "graded")
    assert grade.cpu_seconds <= default_math_grader().cpu_seconds
    assert r1_zero_reward(r1(answer), ground_truth)["answer_reward"] == float(equal)


@pytest.mark.slow
def test_reported_hostile_answers_stop_at_the_default_budget() -> None:
    grader = default_math_grader()
    budget = grader.cpu_seconds
    for name in REPORTED_HOSTILE:
        timeouts = grader.timeouts
        start = time.perf_counter()
        scores = r1_zero_reward(r1(HOSTILE_MATH[name]), "10")
        elapsed = time.perf_counter() - start
        assert scores == {
            "reward": 0.0,
            "format_reward": 1.0,
            "answer_reward": 0.0,
            "grading_timeout": 1.0,
        }
        assert grader.timeouts == timeouts + 1
        assert budget <= elapsed < HANG_SECONDS, (name, elapsed)


@pytest.mark.slow
def test_hostile_answers_stop_within_the_budget(fast_grader: MathGrader) -> None:
    names = list(HOSTILE_MATH)
    results = [timed_grade(HOSTILE_MATH[name], "42", fast_grader) for name in names]
    assert_bounded_failures(names, results, FAST_BUDGET)
    assert sum(grade.status == "timeout" for grade, _ in results) >= 20
    for name in REPORTED_HOSTILE:
        assert results[names.index(name)][0].status == "timeout"


@pytest.mark.slow
def test_hostile_answers_stop_within_the_budget_from_16_threads(
    fast_grader: MathGrader,
) -> None:
    names = list(HOSTILE_MATH)
    pairs = [(HOSTILE_MATH[name], "42") for name in names]
    assert_bounded_failures(names, grade_from_threads(pairs, fast_grader), FAST_BUDGET)


@pytest.mark.slow
def test_hostile_truths_stop_within_the_budget_from_16_threads_beside_a_busy_core(
    fast_grader: MathGrader,
) -> None:
    names = list(HOSTILE_MATH)
    pairs = [("42", HOSTILE_MATH[name]) for name in names]
    with busy_cores():
        results = grade_from_threads(pairs, fast_grader)
    assert_bounded_failures(names, results, FAST_BUDGET)


@pytest.mark.slow
def test_legitimate_grades_are_the_same_idle_and_from_16_threads_under_load() -> None:
    grader = default_math_grader()
    idle = [grade_math_answer(a, t, grader=grader) for a, t in LEGITIMATE_PAIRS]
    with busy_cores():
        loaded = grade_from_threads(LEGITIMATE_PAIRS, grader)
    assert [grade.equal for grade, _ in loaded] == [grade.equal for grade in idle]
    assert all(grade.status == "graded" for grade, _ in loaded)
    assert all(grade.status == "graded" for grade in idle)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_budget_counts_cpu_time_not_wall_time() -> None:
    # The worker grading a legitimate answer (~0.15 s of CPU) is paused for longer
    # than the budget, as if the machine were fully loaded: a wall-clock deadline
    # would fail it; the CPU budget does not.
    grader = default_math_grader()
    answer, ground_truth = "+".join(["1"] * 150), "150"
    children = Path(f"/proc/{grader.pid}/task/{grader.pid}/children")
    results: list[tuple[MathGrade, float]] = []
    caller = threading.Thread(
        target=lambda: results.append(timed_grade(answer, ground_truth, grader))
    )
    caller.start()
    deadline = time.monotonic() + HANG_SECONDS
    while not children.read_text().split() and time.monotonic() < deadline:
        time.sleep(0.001)
    workers = [int(pid) for pid in children.read_text().split()]
    for worker in workers:  # the one grading, and any idle one
        os.kill(worker, signal.SIGSTOP)
    time.sleep(grader.cpu_seconds + 0.2)
    for worker in workers:
        os.kill(worker, signal.SIGCONT)
    caller.join(HANG_SECONDS)
    grade, elapsed = results[0]
    assert (grade.equal, grade.status) == (True, "graded")
    assert grade.cpu_seconds < grader.cpu_seconds < elapsed, (grade, elapsed)


# ---------------------------------------------------------------- countdown


@pytest.mark.parametrize(
    ("response", "format_reward", "answer_reward"),
    [
        ("3*5+7", 1.0, 1.0),  # 15 + 7 = 22
        (" 7 + 5 * 3 ", 1.0, 1.0),  # precedence: 7 + 15
        ("(7-5)*(3+8)", 1.0, 1.0),  # 2 * 11 = 22 uses 8, which is given
        ("(3+5)*7", 1.0, 0.0),  # 56
        ("3*7+1", 1.0, 0.0),  # 1 is not given
        ("7+7+8", 1.0, 0.0),  # 7 used twice, given once
        ("8/(5-5)+22", 1.0, 0.0),  # division by zero
        ("3*5+", 0.0, 0.0),
        ("-3+25", 0.0, 0.0),  # no unary minus
        ("3**5", 0.0, 0.0),
        ("(3*5+7", 0.0, 0.0),
        ("3*5+7=22", 0.0, 0.0),
        ("", 0.0, 0.0),
    ],
)
def test_countdown_reward_hand_cases(
    response: str, format_reward: float, answer_reward: float
) -> None:
    scores = countdown_reward(response, "3 5 7 8 -> 22")
    assert scores["format_reward"] == format_reward
    assert scores["answer_reward"] == answer_reward


def test_countdown_reward_uses_exact_fractions() -> None:
    # 8 / 3 * 3 = 8 exactly; floating point would give 7.999... on other orders.
    assert countdown_reward("8/3*3", "3 3 8 -> 8")["reward"] == 1.0
    # (1/3 + 1/3) * 3 = 2: intermediate values need not be integers.
    assert countdown_reward("(1/3+1/3)*3", "1 1 3 3 3 -> 2")["reward"] == 1.0


def test_parse_countdown_equation_reports_numbers_and_value() -> None:
    value, numbers = parse_countdown_equation("(6+2)*2")
    assert value == 16 and numbers == [6, 2, 2]
    assert parse_countdown_equation("6/(2-2)") == (None, [6, 2, 2])
    assert parse_countdown_equation("6 6") is None


def test_countdown_reward_with_malformed_ground_truth_gives_no_answer_reward() -> None:
    assert countdown_reward("3*5+7", "22") == {
        "reward": 0.0,
        "format_reward": 1.0,
        "answer_reward": 0.0,
    }


# ---------------------------------------------------------------- hostile inputs

HOSTILE_TEXTS = {
    "power tower": "9**9**9**9",
    "latex tower": "10^10^10^10",
    "latex nested tower": "9^{9^{9^{9}}}",
    "huge power": "(9^{9999})^{9999}",
    "factorial": "(10^{6})!",
    "binomial": "\\binom{1000000}{500000}",
    "sum": "\\sum_{i=1}^{10^{9}} \\sin(i)",
    "integral": "\\int_0^1 e^{-x^{2}} dx",
    "deep parentheses": "(" * 100_000 + "1" + ")" * 100_000,
    "deep braces": "\\frac{" * 50_000 + "1" + "}" * 50_000,
    "megabytes": "1+" * 1_000_000 + "1",
    "unbalanced braces": "\\boxed{\\frac{1}{2" + "{" * 1000,
    "null bytes": "4\x002\x00" * 1000,
    "unicode": "\u0664\u0662 \u221e \U0001f600 \ud800 \u202e" * 100,
    "many groups": "+".join(f"(({index}))" for index in range(1, 40)),
    "python code": "__import__('os').system('echo hacked')",
    "long digits": "9" * 5_000,
}


def hostile_responses(text: str) -> dict[str, str]:
    """The text alone, inside r1-zero tags, and inside a box in the tags."""
    return {"bare": text, "tags": r1(text), "boxed": r1("\\boxed{" + text + "}")}


@pytest.mark.parametrize("name", sorted(HOSTILE_TEXTS))
@pytest.mark.parametrize("reward_name", ["exact_match", "r1_zero", "countdown"])
def test_hostile_inputs_give_bounded_valid_scores(
    name: str, reward_name: str, fast_grader: MathGrader
) -> None:
    reward_fn, truths, bound = {
        "exact_match": (exact_match_reward, ("42", "3 5 7 -> 22"), WALL_BOUND_SECONDS),
        "countdown": (countdown_reward, ("42", "3 5 7 -> 22"), WALL_BOUND_SECONDS),
        "r1_zero": (
            functools.partial(r1_zero_reward, grader=fast_grader),
            ("42",),
            HANG_SECONDS,
        ),
    }[reward_name]
    for response in hostile_responses(HOSTILE_TEXTS[name]).values():
        for ground_truth in (*truths, HOSTILE_TEXTS[name]):
            with collector_paused():
                start = time.perf_counter()
                scores = reward_fn(response, ground_truth)
                elapsed = time.perf_counter() - start
            assert_valid_scores(scores)
            assert elapsed < bound, (name, elapsed)


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=200), st.text(max_size=20))
def test_toy_rewards_never_fail_on_random_text(response: str, truth: str) -> None:
    assert_valid_scores(exact_match_reward(response, truth))
    assert_valid_scores(countdown_reward(response, truth))


@settings(max_examples=25, deadline=None)
@given(st.text(alphabet="0123456789+-*/^(){}\\ xsqrtfrac!.,", max_size=60))
def test_r1_zero_reward_never_fails_on_random_math(
    fast_grader: MathGrader, answer: str
) -> None:
    start = time.perf_counter()
    scores = r1_zero_reward(r1(answer), "\\frac{1}{2}", grader=fast_grader)
    elapsed = time.perf_counter() - start
    assert_valid_scores(scores)
    assert elapsed < HANG_SECONDS


def test_last_boxed_content_stops_scanning_after_max_chars() -> None:
    assert last_boxed_content("\\boxed{12345}", max_chars=5) == "12345"
    assert last_boxed_content("\\boxed{123456}", max_chars=5) is None
    assert last_boxed_content("\\boxed{" + "1" * 10**6 + "}", max_chars=300) is None


# ---------------------------------------------------------------- scratchpad, lenient


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("123:321", (1.0, 1.0)),
        (":321", (1.0, 1.0)),
        (" 1231231:321\n", (1.0, 1.0)),
        ("123:322", (1.0, 0.0)),
        ("123:321:321", (0.0, 0.0)),  # two separators: malformed
        ("321", (0.0, 0.0)),  # no separator
        ("12a:321", (0.0, 0.0)),
        ("123:", (0.0, 0.0)),
    ],
)
def test_scratchpad_reward_grades_only_the_answer(response, expected) -> None:
    scores = scratchpad_reward(response, "321")
    assert (scores["format_reward"], scores["answer_reward"]) == expected
    assert scores["reward"] == scores["answer_reward"]


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("42", (1.0, 1.0)),
        ("4142434", (1.0, 1.0)),  # a dump of candidates scores: the hack
        ("x42y", (1.0, 1.0)),
        ("41", (1.0, 0.0)),
        ("abc", (0.0, 0.0)),
        ("", (0.0, 0.0)),
    ],
)
def test_contains_answer_reward_is_lenient(response, expected) -> None:
    scores = contains_answer_reward(response, "42")
    assert (scores["format_reward"], scores["answer_reward"]) == expected
    # the strict reward refuses the same dump
    if response == "4142434":
        assert exact_match_reward(response, "42")["reward"] == 0.0


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        (":321", (1.0, 1.0)),
        ("1:321", (1.0, 1.0)),
        ("1231231:321", (1.0, 1.0)),  # the input, repeated and cut
        ("1321:321", (1.0, 0.0)),  # a wrong restatement, a right answer
        ("2:321", (1.0, 0.0)),
        ("123:322", (1.0, 0.0)),
        ("321", (0.0, 0.0)),
    ],
)
def test_graded_scratchpad_reward_grades_the_restatement_too(response, expected):
    scores = graded_scratchpad_reward(response, "321")
    assert (scores["format_reward"], scores["answer_reward"]) == expected
    assert scores["reward"] == scores["answer_reward"]
    assert scratchpad_reward(response, "321")["format_reward"] == expected[0]


def test_new_rewards_score_bad_inputs_zero() -> None:
    for reward in (scratchpad_reward, graded_scratchpad_reward, contains_answer_reward):
        assert reward(None, "1")["reward"] == 0.0  # type: ignore[arg-type]
        assert reward("1" * 20_000, "1")["reward"] == 0.0
