"""Tools a policy may call in the middle of a response: a safe calculator.

A tool takes the text the model wrote between its call tags and returns the
text the environment writes back. Model text is untrusted: the calculator
parses it with the countdown grader's recursive-descent parser
(:func:`grpo_lab.rewards.parse_countdown_equation`: integers, + - * /,
parentheses, at most ``MAX_EQUATION_CHARS`` characters and
``MAX_EQUATION_DEPTH`` levels of nesting), never executes it, and answers
``"error"`` for anything it cannot value. Values are exact fractions; the reply
is capped at ``max_output_chars`` characters, so a call costs time linear in
its (capped) length and the reply never floods the context. Taught in
``notebooks/14_tools_and_turns.ipynb``.
"""

from __future__ import annotations

from dataclasses import dataclass

from grpo_lab.rewards import parse_countdown_equation

ERROR_REPLY = "error"


@dataclass(frozen=True)
class ToolReply:
    """What a tool wrote back, and whether the call failed."""

    # The text between the output tags.
    text: str
    # True when the call could not be answered (malformed, division by zero, ...).
    error: bool


@dataclass(frozen=True)
class CalculatorTool:
    """Exact arithmetic over integers with + - * / and parentheses.

    The model calls it as ``<calc>37*58</calc>``; the environment answers
    ``<out>2146</out>``. A non-integer value is written as a reduced fraction
    (``"7/2"``); a malformed expression, a division by zero, a negative value
    written with a unary minus (not in the grammar) or a reply longer than
    ``max_output_chars`` is ``"error"``.
    """

    # The tags around a call (written by the model).
    call_open: str = "<calc>"
    call_close: str = "</calc>"
    # The tags around a reply (written by the environment).
    output_open: str = "<out>"
    output_close: str = "</out>"
    # Longest reply; longer values are answered with "error".
    max_output_chars: int = 16

    def __post_init__(self) -> None:
        for name in ("call_open", "call_close", "output_open", "output_close"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        if (
            isinstance(self.max_output_chars, bool)
            or not isinstance(self.max_output_chars, int)
            or not 1 <= self.max_output_chars <= 1000
        ):
            raise ValueError(
                "max_output_chars must be an int in [1, 1000], "
                f"got {self.max_output_chars!r}"
            )

    def run(self, arguments: str) -> ToolReply:
        """The value of ``arguments`` as text, or ``"error"``."""
        if not isinstance(arguments, str):
            return ToolReply(ERROR_REPLY, error=True)
        parsed = parse_countdown_equation(arguments)
        if parsed is None or parsed[0] is None:
            return ToolReply(ERROR_REPLY, error=True)
        value = parsed[0]
        text = str(value.numerator)
        if value.denominator != 1:
            text = f"{value.numerator}/{value.denominator}"
        if len(text) > self.max_output_chars:
            return ToolReply(ERROR_REPLY, error=True)
        return ToolReply(text, error=False)

    def call_arguments(self, segment_text: str) -> str | None:
        """The text between the last call_open and a closing call_close.

        ``segment_text`` is one model turn, cut right after ``call_close``; None
        when the turn does not end with a call. A close tag without an open tag
        gives ``""`` (the call is answered with ``"error"``).
        """
        if not isinstance(segment_text, str):
            raise ValueError(
                "segment_text must be one model turn's text (a str), got "
                f"{type(segment_text).__name__}"
            )
        if not segment_text.endswith(self.call_close):
            return None
        body = segment_text[: -len(self.call_close)]
        start = body.rfind(self.call_open)
        if start < 0:
            return ""
        return body[start + len(self.call_open) :]
