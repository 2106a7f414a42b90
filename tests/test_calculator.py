"""The calculator tool (model text is hostile) and the calculator task."""

from __future__ import annotations

import time

import pytest

from grpo_lab.models import build_char_tokenizer
from grpo_lab.rewards import MAX_EQUATION_CHARS, MAX_RESPONSE_CHARS
from grpo_lab.rollouts.tools import ERROR_REPLY, CalculatorTool
from grpo_lab.tasks import get_task
from grpo_lab.tasks.calculator import CalculatorTask, calculator_reward

TOOL = CalculatorTool()


# --- the tool -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "reply"),
    [
        ("37*58", "2146"),  # 37 * 58 = 2146
        ("(1+2)*3", "9"),
        (" 7 / 2 ", "7/2"),  # exact fraction, reduced
        ("8/4", "2"),
        ("3-5", "-2"),  # a negative value is fine; a unary minus is not
        ("6/(3-3)", ERROR_REPLY),  # division by zero
    ],
)
def test_calculator_values(expression, reply):
    result = TOOL.run(expression)
    assert result.text == reply
    assert result.error == (reply == ERROR_REPLY)


@pytest.mark.parametrize(
    "hostile",
    [
        "__import__('os').system('true')",
        "2**10",  # no power operator
        "-3+4",  # no unary minus
        "1e9",
        "0x10",
        "",
        "(" * 21 + "1" + ")" * 21,  # deeper than MAX_EQUATION_DEPTH
        "1+" * (MAX_EQUATION_CHARS // 2) + "1",  # longer than MAX_EQUATION_CHARS
        "1234567",  # a number of more than 6 digits
        "999999*999999*999999",  # a value longer than max_output_chars
        "3 5",
        "((1+2)",
        "1+2)",
        None,
    ],
)
def test_calculator_answers_hostile_text_with_error(hostile):
    result = TOOL.run(hostile)
    assert result == type(result)(ERROR_REPLY, error=True)


def test_calculator_is_fast_on_its_worst_input():
    # The longest accepted expression multiplies 14 six-digit numbers.
    worst = "*".join(["999999"] * 14)
    assert len(worst) <= MAX_EQUATION_CHARS
    started = time.perf_counter()
    for _ in range(100):
        TOOL.run(worst)
        TOOL.run("(" * 20 + "1" + ")" * 20)
    assert time.perf_counter() - started < 2.0


@pytest.mark.parametrize(
    ("turn", "arguments"),
    [
        ("<calc>12*3</calc>", "12*3"),
        ("so <calc>1</calc> then <calc>2+2</calc>", "2+2"),  # the last call
        ("</calc>", ""),  # a close without an open: answered "error"
        ("<calc>12*3", None),  # no close: not a call
        ("2146", None),
    ],
)
def test_call_arguments(turn, arguments):
    assert TOOL.call_arguments(turn) == arguments


def test_tool_settings_are_checked():
    with pytest.raises(ValueError, match="call_open"):
        CalculatorTool(call_open="")
    with pytest.raises(ValueError, match="max_output_chars"):
        CalculatorTool(max_output_chars=0)


# --- the reward ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "answer_reward", "format_reward"),
    [
        ("<calc>37*58</calc><out>2146</out>2146", 1.0, 1.0),
        ("2146", 1.0, 1.0),  # no call: the whole response is the answer
        ("<calc>37*58</calc><out>2146</out>2147", 0.0, 1.0),
        ("<calc>37*58</calc><out>2146</out>", 0.0, 0.0),  # no final answer
        ("<calc>37*58</calc>", 0.0, 0.0),  # a call never answered
        ("2146<calc>1</calc><out>1</out>x", 0.0, 0.0),  # only the final part counts
        ("<out>2146</out>2146", 1.0, 1.0),
    ],
)
def test_reward_grades_the_final_answer(response, answer_reward, format_reward):
    scores = calculator_reward(response, "2146", TOOL)
    assert scores["answer_reward"] == answer_reward
    assert scores["format_reward"] == format_reward
    assert scores["reward"] == answer_reward


def test_reward_charges_each_call():
    response = "<calc>1</calc><out>1</out><calc>37*58</calc><out>2146</out>2146"
    scores = calculator_reward(response, "2146", TOOL, call_cost=0.1)
    assert scores["reward"] == pytest.approx(1.0 - 2 * 0.1)
    assert scores["answer_reward"] == 1.0


def test_reward_refuses_oversized_and_non_text_input():
    huge = "1" * (MAX_RESPONSE_CHARS + 1)
    assert calculator_reward(huge, "1" * len(huge), TOOL)["reward"] == 0.0
    assert calculator_reward(None, "1", TOOL)["reward"] == 0.0
    assert calculator_reward("1", None, TOOL)["reward"] == 0.0


# --- the task -----------------------------------------------------------------------


def test_demonstrations_earn_full_reward_and_fit_the_budget():
    task = get_task("calculator")
    tokenizer = build_char_tokenizer()
    for example in task.train(50, seed=0):
        a, b = example.prompt[:-1].split("*")
        assert example.ground_truth == str(int(a) * int(b))
        assert task.reward_fn(example.demonstration, example.ground_truth) == {
            "reward": 1.0,
            "format_reward": 1.0,
            "answer_reward": 1.0,
        }
        ids = tokenizer.encode(example.demonstration, add_special_tokens=False)
        assert len(ids) + 1 <= task.max_new_tokens  # and the EOS
    longest = task.example(99, 99).demonstration
    assert len(longest) + 1 == task.max_new_tokens - 1  # one spare token
    call = "<calc>99*99</calc>"
    assert longest.startswith(call) and len(call) + 2 == task.max_turn_tokens


def test_eval_prompts_are_distinct_and_never_drawn_for_training():
    task = CalculatorTask()
    held_out = {e.prompt for e in task.eval(100, seed=1)}
    assert len(held_out) == 100
    assert not held_out & {e.prompt for e in task.train(2000, seed=2)}


@pytest.mark.parametrize(
    ("options", "name"),
    [
        ({"min_operand": -1}, "min_operand"),
        ({"min_operand": 50, "max_operand": 50}, "max_operand"),
        ({"max_turns": 0}, "max_turns"),
        ({"max_turns": True}, "max_turns"),
        ({"call_cost": -0.1}, "call_cost"),
        ({"call_cost": float("nan")}, "call_cost"),
        ({"eval_fraction": 0.0}, "eval_fraction"),
    ],
)
def test_bad_task_options(options, name):
    with pytest.raises(ValueError, match=name):
        get_task("calculator", **options)


def test_the_tool_reads_ascii_digits_only_and_names_a_missing_turn():
    # int() reads Arabic-Indic and mathematical-bold digits as numbers: not here.
    tool = CalculatorTool()
    for text in ("\u0663+\u0664", "\U0001d7d1+\U0001d7d2", "3+\u0664"):
        assert tool.run(text).error, text
    assert (tool.run("3+4").text, tool.run("3+4").error) == ("7", False)
    with pytest.raises(ValueError, match=r"^segment_text must be .* got NoneType$"):
        tool.call_arguments(None)
