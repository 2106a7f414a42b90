"""Tests for grpo_lab.rewards: hand-graded cases, hostile inputs, time bounds."""

from __future__ import annotations

import contextlib
import gc
import math
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_lab import rewards
from grpo_lab.rewards import (
    countdown_reward,
    estimate_digits,
    exact_match_reward,
    extract_r1_zero_answer,
    is_safe_math_answer,
    last_boxed_content,
    normalize_math_answer,
    parse_countdown_equation,
    r1_zero_reward,
    run_with_deadline,
)

# A hostile call must return within this many seconds, even on a loaded machine.
WALL_BOUND_SECONDS = 2.0
REWARD_KEYS = {"reward", "format_reward", "answer_reward"}


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
    assert set(scores) == REWARD_KEYS
    for value in scores.values():
        assert isinstance(value, float)
        assert not math.isnan(value)
        assert 0.0 <= value <= 1.0
    assert scores["reward"] == scores["answer_reward"]


@pytest.fixture(scope="module", autouse=True)
def warm_math_verify() -> None:
    """Import math-verify and sympy once, so timed calls measure grading only."""
    r1_zero_reward(r1("0.5"), "\\frac{1}{2}")


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
    assert results == [{"reward": 1.0, "format_reward": 1.0, "answer_reward": 1.0}]


# ---------------------------------------------------------------- screening


@pytest.mark.parametrize(
    ("text", "digits"),
    [
        ("12+345", 5),  # 2 + 3 digit runs
        ("2^{10}", 10),  # max(1, 1) * 10
        ("(9^{99})^{2}", 198),  # (1 * 99) * 2
        ("x^2+1", 3),  # x^2: 1 * 2, plus 1
        ("\\frac{1}{2}", 2),  # {1} + {2}
    ],
)
def test_estimate_digits_hand_cases(text: str, digits: float) -> None:
    assert estimate_digits(text) == digits


@pytest.mark.parametrize(
    "text", ["9^{9^{9}}", "9**9**9", "10^10^10", "2^{1234567}", "2^{(3^{4})}"]
)
def test_estimate_digits_flags_towers_and_huge_exponents(text: str) -> None:
    assert estimate_digits(text) == float("inf")


@pytest.mark.parametrize(
    ("text", "safe"),
    [
        ("\\frac{\\sqrt{3}}{2}", True),
        ("\\left( 3, \\frac{\\pi}{2} \\right)", True),
        ("x^2 - x - 6", True),
        ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", True),
        ("(10^6)!", False),  # factorial
        ("\\binom{1000000}{500000}", False),  # command outside the whitelist
        ("\\sum_{i=1}^{10} i", False),
        ("\\Gamma(10)", False),
        ("(((1)))" + "(((((2)))))", False),  # ( nested 5 deep
        ("{" * 9 + "1" + "}" * 9, False),  # any bracket nested 9 deep
        ("(9^{999})^{999}", False),  # about 10^6 digits
        ("4\x002", False),  # control character
        ("\u0661\u0662", False),  # non-ASCII digits
        ("1" * (rewards.MAX_ANSWER_CHARS + 1), False),
    ],
)
def test_is_safe_math_answer(text: str, safe: bool) -> None:
    assert is_safe_math_answer(text) is safe


# ---------------------------------------------------------------- deadline


def spin_forever() -> bool:
    while True:
        pass


def test_run_with_deadline_returns_value_or_default() -> None:
    assert run_with_deadline(lambda: 7, 1.0, 0) == 7
    assert run_with_deadline(lambda: 1 / 0, 1.0, -1) == -1


def test_run_with_deadline_interrupts_python_code_in_main_thread() -> None:
    start = time.perf_counter()
    assert run_with_deadline(spin_forever, 0.2, False) is False
    assert time.perf_counter() - start < WALL_BOUND_SECONDS
    # No interrupt is left pending: later Python code runs undisturbed.
    assert sum(range(200_000)) == 19_999_900_000


def test_run_with_deadline_interrupts_a_worker_thread() -> None:
    results: list[tuple[bool, float]] = []

    def grade() -> None:
        start = time.perf_counter()
        verdict = run_with_deadline(spin_forever, 0.2, False)
        results.append((verdict, time.perf_counter() - start))

    worker = threading.Thread(target=grade)
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive()
    assert results and results[0][0] is False
    assert results[0][1] < WALL_BOUND_SECONDS


def test_run_with_deadline_survives_code_that_swallows_the_interrupt() -> None:
    def stubborn() -> bool:
        for _ in range(3):  # swallows the first interrupts, then gives in
            with contextlib.suppress(BaseException):
                spin_forever()
        return spin_forever()

    start = time.perf_counter()
    assert run_with_deadline(stubborn, 0.2, False) is False
    assert time.perf_counter() - start < WALL_BOUND_SECONDS


def test_r1_zero_reward_is_bounded_when_math_verify_hangs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(rewards, "_math_verify_equal", lambda a, b: spin_forever())
    with collector_paused():
        start = time.perf_counter()
        scores = r1_zero_reward(r1("0.5"), "\\frac{1}{2}")
        elapsed = time.perf_counter() - start
    assert elapsed < WALL_BOUND_SECONDS
    assert scores == {"reward": 0.0, "format_reward": 1.0, "answer_reward": 0.0}


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
@pytest.mark.parametrize(
    "reward_fn", [exact_match_reward, r1_zero_reward, countdown_reward]
)
def test_hostile_inputs_give_bounded_valid_scores(name: str, reward_fn) -> None:
    for response in hostile_responses(HOSTILE_TEXTS[name]).values():
        for ground_truth in ("42", "3 5 7 -> 22", HOSTILE_TEXTS[name]):
            with collector_paused():
                start = time.perf_counter()
                scores = reward_fn(response, ground_truth)
                elapsed = time.perf_counter() - start
            assert_valid_scores(scores)
            assert elapsed < WALL_BOUND_SECONDS, (name, elapsed)


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=200), st.text(max_size=20))
def test_toy_rewards_never_fail_on_random_text(response: str, truth: str) -> None:
    assert_valid_scores(exact_match_reward(response, truth))
    assert_valid_scores(countdown_reward(response, truth))


@settings(max_examples=25, deadline=None)
@given(st.text(alphabet="0123456789+-*/^(){}\\ xsqrtfrac!.,", max_size=60))
def test_r1_zero_reward_never_fails_on_random_math(answer: str) -> None:
    with collector_paused():
        start = time.perf_counter()
        scores = r1_zero_reward(r1(answer), "\\frac{1}{2}")
        elapsed = time.perf_counter() - start
    assert_valid_scores(scores)
    assert elapsed < WALL_BOUND_SECONDS


def test_last_boxed_content_stops_scanning_after_max_chars() -> None:
    assert last_boxed_content("\\boxed{12345}", max_chars=5) == "12345"
    assert last_boxed_content("\\boxed{123456}", max_chars=5) is None
    assert last_boxed_content("\\boxed{" + "1" * 10**6 + "}", max_chars=300) is None
