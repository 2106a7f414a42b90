"""Reward functions: grade one response against its ground truth.

Every reward has the signature ``(response, ground_truth) -> {"reward",
"format_reward", "answer_reward"}`` with float values in [0, 1], and
reward = answer_reward; ``r1_zero_reward`` adds ``"grading_timeout"`` (1.0 when
the math grader was stopped before a verdict). A response that cannot be scored
gets 0 with ``format_reward`` 0: never NaN, None or an exception. Model text is
untrusted: it is parsed, never executed, and every call is bounded in time and
memory (see each docstring for the bound). Taught in
``notebooks/03_rewards_and_advantages.ipynb``.
"""

from __future__ import annotations

import re
from collections import Counter
from fractions import Fraction

from grpo_lab.rewards.math_verify_workers import (
    MathGrade,
    MathGrader,
    answer_rule_broken,
    default_math_grader,
)

# Responses longer than this are not graded by the toy-task rewards (reward 0).
MAX_RESPONSE_CHARS = 10_000
# Longest r1-zero answer graded (longer: answer reward 0), and longest ground truth
# sent to math-verify (longer: compared as a string only).
MAX_ANSWER_CHARS = 300
# Countdown equations longer than this, or nested deeper, are malformed.
MAX_EQUATION_CHARS = 100
MAX_EQUATION_DEPTH = 20

_INTEGER_PATTERN = re.compile(r"-?[0-9]+")
_THOUSANDS_PATTERN = re.compile(r"-?[0-9]{1,3}(,[0-9]{3})+(\.[0-9]+)?")
# Spacing and sizing commands that never change an answer's value.
_IGNORED_LATEX = ("\\left", "\\right", "\\displaystyle", "\\!", "\\,", "\\;", "\\:")


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
# The scratchpad task: "<restated digits>:<answer>"

SCRATCHPAD_SEPARATOR = ":"
_SCRATCHPAD_PATTERN = re.compile(r"([0-9]*):(-?[0-9]+)")


def scratchpad_reward(response: str, ground_truth: str) -> dict[str, float]:
    """Exact match of the answer after a scratchpad of digits.

    format_reward = 1 if response.strip() is "<digits>:<integer>": any number of
                    digits (the scratchpad, possibly empty), one ":", the answer
    answer_reward = 1 if format_reward and the answer == ground_truth.strip()
    reward = answer_reward

    The scratchpad is not graded, so responses of different lengths can earn the
    same reward. Time is linear in the response length, capped at
    ``MAX_RESPONSE_CHARS``.
    """
    if not isinstance(response, str) or not isinstance(ground_truth, str):
        return _scores(0.0, 0.0)
    if len(response) > MAX_RESPONSE_CHARS:
        return _scores(0.0, 0.0)
    match = _SCRATCHPAD_PATTERN.fullmatch(response.strip())
    if match is None:
        return _scores(0.0, 0.0)
    return _scores(1.0, float(match.group(2) == ground_truth.strip()))


def graded_scratchpad_reward(response: str, ground_truth: str) -> dict[str, float]:
    """:func:`scratchpad_reward`, where the scratchpad must be right too.

    The input is ``ground_truth`` reversed; a correct scratchpad of ``k`` digits is
    the input repeated and cut to ``k`` ("12345" -> "", "1", ..., "1234512").
    format_reward is scratchpad_reward's; answer_reward = 1 if format_reward, the
    answer == ground_truth.strip() and the scratchpad is correct; reward =
    answer_reward. Every restated digit is one more chance to be wrong (on the
    tiny cpu model restating still helps the reversal more than it adds errors).
    """
    scores = scratchpad_reward(response, ground_truth)
    if not scores["answer_reward"]:
        return scores
    scratch = response.strip().split(SCRATCHPAD_SEPARATOR, 1)[0]
    digits = ground_truth.strip()[::-1]
    restated = (digits * (len(scratch) // len(digits) + 1))[: len(scratch)]
    return _scores(1.0, float(scratch == restated))


# ----------------------------------------------------------------------------------
# A deliberately lenient reward, to watch a policy exploit it


def contains_answer_reward(response: str, ground_truth: str) -> dict[str, float]:
    """A lenient (hackable) check: the answer appears anywhere in the response.

    format_reward = 1 if the response contains at least one digit
    answer_reward = 1 if ground_truth.strip() is a substring of the response
    reward = answer_reward

    Wrong on purpose: a response that lists many candidate numbers ("4142434")
    scores whenever one of them is right, so a policy trained on it learns to
    dump digits rather than to add. ``exact_match_reward`` is the fix. Time is
    linear in the response length, capped at ``MAX_RESPONSE_CHARS``.
    """
    if not isinstance(response, str) or not isinstance(ground_truth, str):
        return _scores(0.0, 0.0)
    if len(response) > MAX_RESPONSE_CHARS:
        return _scores(0.0, 0.0)
    truth = ground_truth.strip()
    has_digit = re.search(r"[0-9]", response) is not None
    return _scores(float(has_digit), float(bool(truth) and truth in response))


# ----------------------------------------------------------------------------------
# r1-zero: "<think> ... </think> <answer> ... </answer>", graded with math-verify


def r1_zero_reward(
    response: str, ground_truth: str, *, grader: MathGrader | None = None
) -> dict[str, float]:
    """The r1-zero reward: format from the tags, answer graded by math-verify.

    format_reward   = 1 if the response contains "</think> <answer>" and, after
                      the last "<answer>", a closing "</answer>"
    answer_reward   = 1 if format_reward and the answer (the text between the last
                      "<answer>" and the next "</answer>"; the last \\boxed{...} in
                      it when there is one) equals ``ground_truth`` mathematically
                      (``grade_math_answer``)
    reward          = answer_reward
    grading_timeout = 1 if math-verify was stopped before a verdict (its CPU
                      budget or wall ceiling ran out, or its worker died), else 0;
                      such an answer gets answer_reward 0

    Bound: the response is only searched with ``str.find`` (linear time, any
    length); math-verify runs in a worker process with a CPU budget
    (``grpo_lab.rewards.math_verify_workers``), so the caller waits at most about
    ``grader.cpu_seconds`` plus process overhead once a worker slot is free.
    ``grader`` defaults to ``default_math_grader()``.
    """
    if not isinstance(response, str) or not isinstance(ground_truth, str):
        return _r1_zero_scores(0.0, MathGrade(False, "graded"))
    answer = extract_r1_zero_answer(response)
    if answer is None:
        return _r1_zero_scores(0.0, MathGrade(False, "graded"))
    if "\\boxed" in answer:
        answer = last_boxed_content(answer, max_chars=MAX_ANSWER_CHARS)
        if answer is None:
            return _r1_zero_scores(1.0, MathGrade(False, "graded"))
    return _r1_zero_scores(1.0, grade_math_answer(answer, ground_truth, grader=grader))


def _r1_zero_scores(format_reward: float, grade: MathGrade) -> dict[str, float]:
    """The reward dict plus ``grading_timeout``."""
    scores = _scores(format_reward, float(format_reward and grade.equal))
    return {**scores, "grading_timeout": float(grade.timed_out)}


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
    close = _matching_brace(text[:end], brace)
    return None if close is None else text[brace + 1 : close]


def _matching_brace(text: str, open_index: int) -> int | None:
    """Index of the "}" closing the "{" at ``open_index``, or None."""
    depth = 0
    for index in range(open_index, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
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


def grade_math_answer(
    answer: str, ground_truth: str, *, grader: MathGrader | None = None
) -> MathGrade:
    """Whether ``answer`` equals ``ground_truth``, as a ``MathGrade``.

    In order, after stripping both:
      1. an answer longer than ``MAX_ANSWER_CHARS`` is not equal;
      2. equal ``normalize_math_answer`` spellings are equal;
      3. two plain integers ("-?[0-9]+" after normalizing) are equal when their
         values are (math-verify's verdict on two integers, without a worker);
      4. a ground truth longer than ``MAX_ANSWER_CHARS`` is not equal;
      5. an answer that hedges is not equal (``answer_rule_broken``): a percent
         sign on one side only ("4\\%" or "400\\%" against 4, and 4 against
         "4\\%"), or an approximate relation, \\pm, \\equiv or \\propto on
         one side only ("4 \\approx 5" against 4, and 4 against "4 \\approx 5");
      6. otherwise ``grader.grade`` (default ``default_math_grader()``):
         math-verify in a worker process under a CPU budget, where two plain
         expressions whose difference sympy simplifies to 0 are equal too
         ("\\frac{x}{2}+\\frac{x}{2}" and "x").
    Steps 1-5 run in the calling process in time linear in the input.
    """
    answer, ground_truth = answer.strip(), ground_truth.strip()
    if len(answer) > MAX_ANSWER_CHARS:
        return MathGrade(False, "graded")
    normalized_answer = normalize_math_answer(answer)
    normalized_truth = normalize_math_answer(ground_truth)
    if normalized_answer and normalized_answer == normalized_truth:
        return MathGrade(True, "graded")
    if _both_integers(normalized_answer, normalized_truth):
        return MathGrade(int(normalized_answer) == int(normalized_truth), "graded")
    if len(ground_truth) > MAX_ANSWER_CHARS:
        return MathGrade(False, "graded")
    if answer_rule_broken(answer, ground_truth) is not None:
        return MathGrade(False, "graded")
    return (grader or default_math_grader()).grade(answer, ground_truth)


def _both_integers(first: str, second: str) -> bool:
    """True when both strings are plain integers short enough for ``int``."""
    return all(
        len(text) <= MAX_ANSWER_CHARS and _INTEGER_PATTERN.fullmatch(text) is not None
        for text in (first, second)
    )


# ----------------------------------------------------------------------------------
# Countdown: an arithmetic equation over given numbers that hits a target

# The four operators and their precedence. The reward's parser reads them, and
# so does the task that writes the problems (grpo_lab.tasks.countdown), so that
# both do the same arithmetic.
COUNTDOWN_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}
COUNTDOWN_OPERATORS = "".join(COUNTDOWN_PRECEDENCE)
_SUM_OPERATORS = tuple(o for o, level in COUNTDOWN_PRECEDENCE.items() if level == 1)
_PRODUCT_OPERATORS = tuple(o for o, level in COUNTDOWN_PRECEDENCE.items() if level == 2)


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
    """An integer (at most 6 ASCII digits), an operator or a parenthesis.

    ``str.isdigit`` alone also takes other scripts' digits ("\u0663", Arabic-Indic
    3) and styled ones ("\U0001d7d1", mathematical bold 3), which ``int`` reads
    as numbers: neither is a digit of the answer's format."""
    return token in "+-*/()" or (
        token.isascii() and token.isdigit() and len(token) <= 6
    )


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
        while self.peek() in _SUM_OPERATORS:
            operator, right = self.take(), self.term(depth)
            value = apply_countdown_operator(operator, value, right)
        return value

    def term(self, depth: int) -> Fraction | None:
        value = self.factor(depth)
        while self.peek() in _PRODUCT_OPERATORS:
            operator, right = self.take(), self.factor(depth)
            value = apply_countdown_operator(operator, value, right)
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


def apply_countdown_operator(
    operator: str, left: Fraction | None, right: Fraction | None
) -> Fraction | None:
    """``left operator right``, exactly; None for (and after) a division by zero."""
    if left is None or right is None:
        return None
    if operator == "+":
        return left + right
    if operator == "-":
        return left - right
    if operator == "*":
        return left * right
    return None if right == 0 else left / right
