"""Reward functions: grade one response against its ground truth.

Every reward has the signature ``(response, ground_truth) -> {"reward",
"format_reward", "answer_reward"}`` with float values in [0, 1], and
reward = answer_reward. A response that cannot be scored gets 0 with
``format_reward`` 0: never NaN, None or an exception. Model text is untrusted: it is
parsed, never executed, and every call is bounded in time and memory (see each
docstring for the bound). Taught in
``notebooks/03_rewards_and_advantages.ipynb``.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import re
import threading
from collections import Counter
from collections.abc import Callable
from fractions import Fraction
from typing import TypeVar

# Responses longer than this are not graded by the toy-task rewards (reward 0).
MAX_RESPONSE_CHARS = 10_000
# r1-zero answers longer than this are not graded (answer reward 0).
MAX_ANSWER_CHARS = 300
# Deepest bracket nesting a math answer may have before math-verify sees it, for
# all brackets and for ( and [ alone (its LaTeX parser slows down with each level).
MAX_NESTING_DEPTH = 8
MAX_PAREN_DEPTH = 3
# Rough upper bound on the digits any evaluation of a math answer may produce.
MAX_DIGIT_ESTIMATE = 5_000
# Wall-clock budget for math-verify (parse both sides and compare), in seconds.
MATH_VERIFY_SECONDS = 1.0
# Countdown equations longer than this, or nested deeper, are malformed.
MAX_EQUATION_CHARS = 100
MAX_EQUATION_DEPTH = 20

_INTEGER_PATTERN = re.compile(r"-?[0-9]+")
_THOUSANDS_PATTERN = re.compile(r"-?[0-9]{1,3}(,[0-9]{3})+(\.[0-9]+)?")
_LATEX_COMMAND_PATTERN = re.compile(r"\\([A-Za-z]+)")
_POWER_PATTERN = re.compile(r"\^|\*\*")
_OPENING, _CLOSING = "([{", ")]}"
# Spacing and sizing commands that never change an answer's value.
_IGNORED_LATEX = ("\\left", "\\right", "\\displaystyle", "\\!", "\\,", "\\;", "\\:")
# LaTeX commands math-verify may see. Sums, products, integrals, limits, binomials,
# Gamma, determinants and \operatorname are left out: they can run without bound.
_SAFE_COMMAND_LINES = (
    "frac dfrac tfrac cfrac sqrt cdot times div pm mp pi infty circ degree",
    "text textbf textit textrm mbox mathbf le leq ge geq lt gt ne neq approx",
    "cup cap emptyset varnothing in notin subset subseteq setminus mathbb",
    "sin cos tan cot sec csc arcsin arccos arctan sinh cosh tanh log ln exp",
    "lfloor rfloor lceil rceil vert lvert rvert mid begin end pmatrix bmatrix",
    "matrix dots ldots cdots quad qquad overline angle prime",
    "alpha beta delta epsilon varepsilon zeta eta theta vartheta iota kappa",
    "lambda mu nu xi rho sigma tau upsilon phi varphi chi psi omega",
    "Delta Theta Lambda Xi Pi Sigma Phi Psi Omega",
)
SAFE_LATEX_COMMANDS = frozenset(" ".join(_SAFE_COMMAND_LINES).split())

T = TypeVar("T")


def _scores(format_reward: float, answer_reward: float) -> dict[str, float]:
    """The reward dict; the reward is the answer reward."""
    return {
        "reward": float(answer_reward),
        "format_reward": float(format_reward),
        "answer_reward": float(answer_reward),
    }


def exact_match_reward(response: str, ground_truth: str) -> dict[str, float]:
    """Exact match of an integer answer, for the toy tasks.

    format_reward = 1 if response.strip() is a digit string (optional leading "-")
    answer_reward = 1 if response.strip() == ground_truth.strip()
    reward = answer_reward

    Surrounding whitespace is ignored; anything else counts. Time is linear in the
    response length, which is capped at ``MAX_RESPONSE_CHARS``.
    """
    if not isinstance(response, str) or not isinstance(ground_truth, str):
        return _scores(0.0, 0.0)
    if len(response) > MAX_RESPONSE_CHARS:
        return _scores(0.0, 0.0)
    answer = response.strip()
    well_formed = _INTEGER_PATTERN.fullmatch(answer) is not None
    correct = well_formed and answer == ground_truth.strip()
    return _scores(float(well_formed), float(correct))


# ----------------------------------------------------------------------------------
# r1-zero: "<think> ... </think> <answer> ... </answer>", graded with math-verify


def r1_zero_reward(response: str, ground_truth: str) -> dict[str, float]:
    """The r1-zero reward: format from the tags, answer graded by math-verify.

    format_reward = 1 if the response contains "</think> <answer>" and, after the
                    last "<answer>", a closing "</answer>"
    answer_reward = 1 if format_reward and the answer (the text between the last
                    "<answer>" and the next "</answer>"; the last \\boxed{...} in it
                    when there is one) equals ``ground_truth`` mathematically
    reward = answer_reward

    Equality is tried first as normalized string equality; otherwise both sides go
    to math-verify (``parse`` and ``verify``). Bound: the response is only searched
    with ``str.find`` (linear time, any length). math-verify sees at most
    ``MAX_ANSWER_CHARS`` printable ASCII characters, nested at most
    ``MAX_NESTING_DEPTH`` deep, using only ``SAFE_LATEX_COMMANDS``, no "!", no
    power towers, and numbers of at most ~``MAX_DIGIT_ESTIMATE`` digits (see
    ``is_safe_math_answer``); answers outside these limits get answer reward 0.
    math-verify then runs under a watchdog that interrupts it after
    ``MATH_VERIFY_SECONDS`` in any thread (main or not): it raises an exception in
    the grading thread, which counts as a wrong answer. math-verify's own
    signal-based timeouts are off, since they only work in the main thread.
    """
    if not isinstance(response, str) or not isinstance(ground_truth, str):
        return _scores(0.0, 0.0)
    answer = extract_r1_zero_answer(response)
    if answer is None:
        return _scores(0.0, 0.0)
    if "\\boxed" in answer:
        answer = last_boxed_content(answer, max_chars=MAX_ANSWER_CHARS)
        if answer is None:
            return _scores(1.0, 0.0)
    return _scores(1.0, float(math_answers_match(answer, ground_truth)))


def extract_r1_zero_answer(response: str) -> str | None:
    """The text between the last "<answer>" and the next "</answer>", or None.

    None when the response lacks "</think> <answer>" or the closing tag.
    """
    if "</think> <answer>" not in response:
        return None
    start = response.rfind("<answer>") + len("<answer>")
    end = response.find("</answer>", start)
    return None if end < 0 else response[start:end]


def last_boxed_content(text: str, max_chars: int | None = None) -> str | None:
    """The content of the last ``\\boxed{...}`` (balanced braces), or None.

    None when the braces never close, or close only after ``max_chars``
    characters of content (no limit when None). Time is linear in the length of
    ``text`` (``str.rfind``) plus the content scanned.
    """
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    brace = start + len("\\boxed")
    while brace < len(text) and text[brace] == " ":
        brace += 1
    if brace >= len(text) or text[brace] != "{":
        return None
    end = len(text) if max_chars is None else brace + max_chars + 2
    close = _matching_close(text[:end], brace, "{", "}")
    return None if close is None else text[brace + 1 : close]


def _matching_close(
    text: str, open_index: int, opening: str = _OPENING, closing: str = _CLOSING
) -> int | None:
    """Index of the bracket closing the one at ``open_index``, or None.

    Brackets in ``opening`` / ``closing`` count alike (all kinds by default).
    """
    depth = 0
    for index in range(open_index, len(text)):
        if text[index] in opening:
            depth += 1
        elif text[index] in closing:
            depth -= 1
            if depth == 0:
                return index
    return None


def normalize_math_answer(text: str) -> str:
    """A canonical spelling for the string-equality fast path.

    Drops "$", "\\$", spaces, \\left, \\right and spacing commands, turns \\dfrac and
    \\tfrac into \\frac, drops a trailing ".", and drops thousands separators
    from plain numbers ("1,234" -> "1234").
    """
    for ignored in (*_IGNORED_LATEX, "\\$", "$", " ", "\n", "\t"):
        text = text.replace(ignored, "")
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = text.rstrip(".")
    if _THOUSANDS_PATTERN.fullmatch(text):
        text = text.replace(",", "")
    return text


def math_answers_match(answer: str, ground_truth: str) -> bool:
    """True when ``answer`` equals ``ground_truth`` (fast path, then math-verify)."""
    answer, ground_truth = answer.strip(), ground_truth.strip()
    if len(answer) > MAX_ANSWER_CHARS:
        return False
    normalized = normalize_math_answer(answer)
    if normalized and normalized == normalize_math_answer(ground_truth):
        return True
    if not (is_safe_math_answer(answer) and is_safe_math_answer(ground_truth)):
        return False
    _prepare_math_verify()
    return run_with_deadline(
        lambda: _math_verify_equal(answer, ground_truth), MATH_VERIFY_SECONDS, False
    )


def is_safe_math_answer(text: str) -> bool:
    """True when math-verify may parse ``text`` without unbounded work.

    Requires: at most ``MAX_ANSWER_CHARS`` printable ASCII characters; bracket
    nesting at most ``MAX_NESTING_DEPTH``, and ( and [ at most ``MAX_PAREN_DEPTH``;
    LaTeX commands from ``SAFE_LATEX_COMMANDS`` only; no "!" (factorial); no power
    inside an exponent and no chained powers (towers such as 9^{9^9} or 9**9**9); and
    ``estimate_digits(text) <= MAX_DIGIT_ESTIMATE``.
    """
    if len(text) > MAX_ANSWER_CHARS or not text.isascii():
        return False
    for ignored in (*_IGNORED_LATEX, "\n", "\t"):
        text = text.replace(ignored, " ")
    if "!" in text or not all(char.isprintable() for char in text):
        return False
    if _nesting_depth(text, _OPENING) > MAX_NESTING_DEPTH:
        return False
    if _nesting_depth(text, "([") > MAX_PAREN_DEPTH:
        return False
    commands = set(_LATEX_COMMAND_PATTERN.findall(text))
    if not commands <= SAFE_LATEX_COMMANDS:
        return False
    return estimate_digits(text) <= MAX_DIGIT_ESTIMATE


def _nesting_depth(text: str, opening: str) -> int:
    """Deepest nesting of the brackets in ``opening`` (kinds counted alike)."""
    closing = "".join(_CLOSING[_OPENING.index(char)] for char in opening)
    depth = deepest = 0
    for char in text:
        if char in opening:
            depth += 1
            deepest = max(deepest, depth)
        elif char in closing:
            depth = max(depth - 1, 0)
    return deepest


def estimate_digits(text: str) -> float:
    """A rough upper bound on the digits of numbers that evaluating ``text`` makes.

    digits(text) = sum over atoms: a digit run counts its length, a bracket group
    counts digits(group), and ``base ^ exponent`` counts
    max(digits(base), 1) * max(exponent, 1), where exponent is the largest integer
    written in the exponent. A power inside an exponent, a chained power, or an
    exponent over 6 digits gives infinity. Bracket nesting must already be bounded
    (recursion depth = nesting depth).
    """
    atoms: list[float] = []
    index = 0
    while index < len(text):
        char = text[index]
        if char in _OPENING:
            close = _matching_close(text, index)
            close = len(text) if close is None else close
            atoms.append(estimate_digits(text[index + 1 : close]))
            index = close + 1
        elif char.isdigit():
            run = re.match(r"[0-9]+", text[index:]).group()
            atoms.append(len(run))
            index += len(run)
        elif char == "^" or text.startswith("**", index):
            index += 1 if char == "^" else 2
            exponent_text, index = _read_exponent(text, index)
            exponent = _largest_integer(exponent_text)
            if exponent is None or _POWER_PATTERN.match(text[index:].lstrip()):
                return float("inf")
            base = atoms.pop() if atoms else 1.0
            atoms.append(max(base, 1.0) * max(exponent, 1))
        else:
            index += 1
    return float(sum(atoms))


def _read_exponent(text: str, index: int) -> tuple[str, int]:
    """The exponent starting at ``index`` and the index just after it.

    A bracket group, a LaTeX command, a signed number, or one character.
    """
    while index < len(text) and text[index] == " ":
        index += 1
    if index >= len(text):
        return "", index
    if text[index] in _OPENING:
        close = _matching_close(text, index)
        close = len(text) - 1 if close is None else close
        return text[index : close + 1], close + 1
    match = re.match(r"\\[A-Za-z]+|-?[0-9.]+", text[index:])
    length = len(match.group()) if match else 1
    return text[index : index + length], index + length


def _largest_integer(exponent_text: str) -> int | None:
    """The largest integer written in an exponent (1 if none); None when unsafe."""
    if _POWER_PATTERN.search(exponent_text):
        return None
    runs = re.findall(r"[0-9]+", exponent_text)
    if any(len(run) > 6 for run in runs):
        return None
    return max((int(run) for run in runs), default=1)


def _math_verify_equal(answer: str, ground_truth: str) -> bool:
    """math-verify's verdict on \\boxed{answer} against \\boxed{ground_truth}.

    math-verify's own signal-based timeouts are off (they fail outside the main
    thread); ``run_with_deadline`` bounds the time instead. math-verify's log
    records go to a ``NullHandler`` unless the application configures logging.
    """
    from math_verify import LatexExtractionConfig, parse, verify

    config = [LatexExtractionConfig()]
    gold = parse("\\boxed{" + ground_truth + "}", config, parsing_timeout=None)
    predicted = parse("\\boxed{" + answer + "}", config, parsing_timeout=None)
    if not gold or not predicted:
        return False
    return bool(verify(gold, predicted, timeout_seconds=None))


def _prepare_math_verify() -> None:
    """Import math-verify outside any deadline, so an interrupt never lands inside
    an import, and give its logger a ``NullHandler`` (once), as libraries should.
    """
    import math_verify  # noqa: F401

    logger = logging.getLogger("math_verify")
    if not any(isinstance(handler, logging.NullHandler) for handler in logger.handlers):
        logger.addHandler(logging.NullHandler())
    _warm_up_math_verify()


@functools.cache
def _warm_up_math_verify() -> None:
    """Pay math-verify's one-off costs (grammar loading, sympy caches) once, on a
    fixed harmless input and outside any deadline, so that a loaded machine does
    not turn the first real answer's grading into a timeout."""
    _math_verify_equal("\\frac{1}{2}", "0.5")


class GradingTimeout(BaseException):
    """Raised inside a grading thread when its wall-clock budget runs out.

    A ``BaseException`` so that libraries' ``except Exception`` blocks let it pass.
    """


def run_with_deadline(function: Callable[[], T], seconds: float, default: T) -> T:
    """``function()``, or ``default`` once ``seconds`` of wall time have passed.

    A watchdog thread raises ``GradingTimeout`` in the calling thread (CPython's
    ``PyThreadState_SetAsyncExc``) when the budget runs out, and again every 50 ms
    in case the code swallowed it. This works in the main thread and in any other
    thread. It interrupts Python code, not one long C call: callers must bound the
    size of the work (as ``is_safe_math_answer`` does). Exceptions raised by
    ``function`` itself also give ``default``.
    """
    state = _DeadlineState(threading.get_ident())
    watchdog = threading.Thread(target=state.watch, args=(seconds,), daemon=True)
    watchdog.start()
    try:
        try:
            return function()
        finally:
            state.finish()
    except GradingTimeout:
        return default
    except Exception:
        return default


class _DeadlineState:
    """Shared flags between a grading thread and its watchdog."""

    def __init__(self, thread_id: int) -> None:
        self.thread_id = thread_id
        self.lock = threading.Lock()
        self.finished = threading.Event()
        self.done = False
        self.fired = False

    def watch(self, seconds: float) -> None:
        """Interrupt the grading thread after ``seconds``, then every 50 ms."""
        delay = seconds
        while not self.finished.wait(delay):
            with self.lock:
                if self.done:
                    return
                self.fired = True
                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(self.thread_id), ctypes.py_object(GradingTimeout)
                )
            delay = 0.05

    def finish(self) -> None:
        """Stop the watchdog; deliver here any interrupt it already sent."""
        while True:
            try:
                with self.lock:
                    self.done = True
                break
            except GradingTimeout:
                continue
        self.finished.set()
        if self.fired:
            _deliver_pending_interrupt()


def _deliver_pending_interrupt() -> None:
    """Run a few bytecodes so that a pending async exception is raised here."""
    for _ in range(100):
        _no_operation()


def _no_operation() -> None:
    """A Python call: the interpreter checks for pending async exceptions on entry."""


# ----------------------------------------------------------------------------------
# Countdown: an arithmetic equation over given numbers that hits a target


def format_countdown_ground_truth(numbers: list[int], target: int) -> str:
    """The ground-truth string of a countdown problem: ``"3 5 7 -> 22"``."""
    return " ".join(str(number) for number in numbers) + f" -> {target}"


def parse_countdown_ground_truth(ground_truth: str) -> tuple[list[int], int] | None:
    """``(numbers, target)`` from ``"3 5 7 -> 22"``, or None when malformed."""
    if len(ground_truth) > MAX_EQUATION_CHARS:
        return None
    match = re.fullmatch(
        r"\s*([0-9]{1,6}(?: [0-9]{1,6})*) -> ([0-9]{1,9})\s*", ground_truth
    )
    if match is None:
        return None
    numbers = [int(number) for number in match.group(1).split()]
    return numbers, int(match.group(2))


def countdown_reward(response: str, ground_truth: str) -> dict[str, float]:
    """Countdown: the response is an equation over the given numbers.

    format_reward = 1 if response.strip() is an arithmetic expression: integers,
                    + - * /, parentheses (no unary minus), at most
                    ``MAX_EQUATION_CHARS`` characters and ``MAX_EQUATION_DEPTH``
                    nested parentheses
    answer_reward = 1 if format_reward, the numbers used form a sub-multiset of the
                    given numbers (each used at most as often as given), and the
                    exact rational value equals the target (division by zero: 0)
    reward = answer_reward

    ``ground_truth`` is ``"3 5 7 -> 22"`` (``format_countdown_ground_truth``). The
    text is parsed by a small recursive-descent parser into ``Fraction`` values,
    never executed. Bound: linear in the (capped) length.
    """
    if not isinstance(response, str) or not isinstance(ground_truth, str):
        return _scores(0.0, 0.0)
    problem = parse_countdown_ground_truth(ground_truth)
    parsed = parse_countdown_equation(response)
    if parsed is None:
        return _scores(0.0, 0.0)
    if problem is None:
        return _scores(1.0, 0.0)
    value, used_numbers = parsed
    numbers, target = problem
    allowed = not Counter(used_numbers) - Counter(numbers)
    return _scores(1.0, float(allowed and value == target))


def parse_countdown_equation(text: str) -> tuple[Fraction | None, list[int]] | None:
    """``(value, numbers used)`` of an equation, or None when it is malformed.

    value is None on division by zero. Grammar (spaces ignored):
    expr = term (("+" | "-") term)*;  term = factor (("*" | "/") factor)*;
    factor = integer | "(" expr ")".
    """
    if len(text) > MAX_EQUATION_CHARS:
        return None
    tokens = re.findall(r"[0-9]+|[-+*/()]|\S", text)
    if not tokens or any(not _is_equation_token(token) for token in tokens):
        return None
    parser = _EquationParser(tokens)
    try:
        value = parser.expression(depth=0)
    except ValueError:
        return None
    if parser.position != len(tokens):
        return None
    return value, parser.numbers


def _is_equation_token(token: str) -> bool:
    """An integer (at most 6 digits), an operator or a parenthesis."""
    return token in "+-*/()" or (token.isdigit() and len(token) <= 6)


class _EquationParser:
    """Recursive descent over equation tokens with exact ``Fraction`` values."""

    def __init__(self, tokens: list[str]) -> None:
        self.tokens = tokens
        self.position = 0
        self.numbers: list[int] = []

    def peek(self) -> str | None:
        return self.tokens[self.position] if self.position < len(self.tokens) else None

    def take(self) -> str:
        token = self.peek()
        if token is None:
            raise ValueError("equation ended early")
        self.position += 1
        return token

    def expression(self, depth: int) -> Fraction | None:
        value = self.term(depth)
        while self.peek() in ("+", "-"):
            operator, right = self.take(), self.term(depth)
            value = _apply(operator, value, right)
        return value

    def term(self, depth: int) -> Fraction | None:
        value = self.factor(depth)
        while self.peek() in ("*", "/"):
            operator, right = self.take(), self.factor(depth)
            value = _apply(operator, value, right)
        return value

    def factor(self, depth: int) -> Fraction | None:
        token = self.take()
        if token == "(":
            if depth >= MAX_EQUATION_DEPTH:
                raise ValueError("equation nested too deeply")
            value = self.expression(depth + 1)
            if self.take() != ")":
                raise ValueError("unbalanced parenthesis")
            return value
        if not token.isdigit():
            raise ValueError(f"expected a number, got {token!r}")
        self.numbers.append(int(token))
        return Fraction(int(token))


def _apply(
    operator: str, left: Fraction | None, right: Fraction | None
) -> Fraction | None:
    """``left operator right``; None propagates a division by zero."""
    if left is None or right is None:
        return None
    if operator == "+":
        return left + right
    if operator == "-":
        return left - right
    if operator == "*":
        return left * right
    return None if right == 0 else left / right
