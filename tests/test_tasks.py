"""Tests for grpo_lab.tasks: toy tasks, countdown, GSM8K and MATH loaders."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from grpo_lab.models import build_char_tokenizer
from grpo_lab.rewards.math_verify_workers import default_math_grader
from grpo_lab.tasks import Example, get_task, task_options
from grpo_lab.tasks.math_data import (
    R1_ZERO_PROMPT,
    extract_gsm8k_answer,
    extract_math_answer,
    load_hub_records,
    load_jsonl,
    math_record_answer,
)
from grpo_lab.tasks.splits import is_eval_prompt

DATA = Path(__file__).parent / "data"
GSM8K_TRAIN = str(DATA / "gsm8k_train.jsonl")
GSM8K_TEST = str(DATA / "gsm8k_test.jsonl")
MATH_SAMPLE = str(DATA / "math_sample.jsonl")
TOY_TASKS = ["reverse", "addition", "countdown"]


def prompts(examples: list[Example]) -> set[str]:
    return {example.prompt for example in examples}


# ---------------------------------------------------------------- get_task


def test_get_task_rejects_unknown_name() -> None:
    with pytest.raises(ValueError, match=r"name must be one of .*'reverze'"):
        get_task("reverze")


def test_get_task_rejects_unknown_option_by_name() -> None:
    with pytest.raises(ValueError, match=r"\['n_digitz'\].*'reverse'"):
        get_task("reverse", n_digitz=5)
    # name is fixed by the class, not an option
    with pytest.raises(ValueError, match="'name'"):
        get_task("addition", name="other")


@pytest.mark.parametrize(
    ("name", "options", "option_name"),
    [
        ("reverse", {"n_digits": 2}, "n_digits"),
        ("reverse", {"n_digits": "5"}, "n_digits"),
        ("addition", {"max_value": 5}, "max_value"),
        ("addition", {"eval_fraction": 0.9}, "eval_fraction"),
        ("countdown", {"n_numbers": 1}, "n_numbers"),
        ("countdown", {"max_target": 0}, "max_target"),
        ("gsm8k", {"path": GSM8K_TRAIN, "max_new_tokens": 0}, "max_new_tokens"),
        ("math", {"path": str(DATA / "missing.jsonl")}, "path must name"),
        ("gsm8k", {"eval_path": str(DATA / "missing.jsonl")}, "eval_path must name"),
    ],
)
def test_get_task_rejects_bad_option_values(
    name: str, options: dict, option_name: str
) -> None:
    with pytest.raises(ValueError, match=option_name):
        get_task(name, **options)


def test_task_options_lists_constructor_fields() -> None:
    assert task_options("reverse") == ["n_digits", "eval_fraction"]
    assert "splits" not in task_options("gsm8k")


# ---------------------------------------------------------------- toy tasks


def test_reverse_examples_match_the_documented_format() -> None:
    task = get_task("reverse")
    assert (task.name, task.stop_strings, task.max_new_tokens) == ("reverse", (), 7)
    for example in task.train(50, seed=0) + task.eval(50, seed=0):
        digits = example.prompt[:-1]
        assert example.prompt == digits + ">" and len(digits) == 5 and digits.isdigit()
        assert example.ground_truth == digits[::-1] == example.demonstration


def test_addition_examples_match_the_documented_format() -> None:
    task = get_task("addition", max_value=50)
    # largest answer 49 + 49 = 98: 2 digits + EOS + 1 spare
    assert task.max_new_tokens == 4
    for example in task.train(100, seed=1):
        left, right = example.prompt.removesuffix("=").split("+")
        assert 0 <= int(left) < 50 and 0 <= int(right) < 50
        assert example.ground_truth == str(int(left) + int(right))


@pytest.mark.parametrize("name", TOY_TASKS)
def test_toy_tasks_are_deterministic_in_the_seed(name: str) -> None:
    task = get_task(name)
    assert task.train(30, seed=3) == task.train(30, seed=3)
    assert task.eval(30, seed=3) == task.eval(30, seed=3)
    assert task.train(30, seed=3) != task.train(30, seed=4)


@pytest.mark.parametrize("name", TOY_TASKS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_toy_eval_prompts_never_appear_in_train(name: str, seed: int) -> None:
    task = get_task(name)
    train, evaluation = task.train(2000, seed=seed), task.eval(100, seed=seed + 7)
    assert not prompts(train) & prompts(evaluation)
    fraction = task.eval_fraction
    assert all(is_eval_prompt(e.prompt, fraction) for e in evaluation)
    assert not any(is_eval_prompt(e.prompt, fraction) for e in train)


def test_addition_eval_split_is_the_hashed_share_of_all_problems() -> None:
    task = get_task("addition", max_value=20, eval_fraction=0.2)
    everything = task.all_examples()
    held_out = [e for e in everything if is_eval_prompt(e.prompt, 0.2)]
    # every eval problem, in any seed's order, is the same set
    assert prompts(task.eval(len(held_out), seed=5)) == prompts(held_out)
    assert 0.1 < len(held_out) / len(everything) < 0.3  # 400 problems, ~20 %
    with pytest.raises(
        ValueError, match=f"at most the eval split size {len(held_out)}"
    ):
        task.eval(len(held_out) + 1, seed=0)


@pytest.mark.parametrize("name", TOY_TASKS)
def test_toy_demonstrations_earn_full_reward(name: str) -> None:
    task = get_task(name)
    for example in task.train(200, seed=0):
        scores = task.reward_fn(example.demonstration, example.ground_truth)
        assert scores == {"reward": 1.0, "format_reward": 1.0, "answer_reward": 1.0}


@pytest.mark.parametrize("name", TOY_TASKS)
def test_toy_prompts_fit_the_character_tokenizer(name: str) -> None:
    tokenizer = build_char_tokenizer()
    task = get_task(name)
    for example in task.train(100, seed=0):
        text = example.prompt + example.demonstration
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert len(ids) == len(text)  # one token per character, none unknown
        assert len(example.demonstration) + 1 <= task.max_new_tokens  # + EOS


@pytest.mark.parametrize(("n", "seed"), [(-1, 0), (2.5, 0), (3, "0"), (True, 0)])
def test_toy_tasks_reject_bad_n_and_seed(n: object, seed: object) -> None:
    task = get_task("reverse")
    with pytest.raises(ValueError, match=r"n must|seed must"):
        task.train(n, seed)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"n must|seed must"):
        task.eval(n, seed)  # type: ignore[arg-type]


# ---------------------------------------------------------------- countdown


def test_countdown_examples_have_a_solution_with_given_numbers() -> None:
    task = get_task("countdown", n_numbers=4, max_number=20, max_target=200)
    for example in task.train(100, seed=0):
        numbers_text, target_text = example.ground_truth.split(" -> ")
        numbers = [int(number) for number in numbers_text.split()]
        assert example.prompt == example.ground_truth + ":"
        assert len(numbers) == 4 and numbers == sorted(numbers)
        assert all(1 <= number <= 20 for number in numbers)
        assert 0 <= int(target_text) <= 200
        assert len(example.demonstration) + 1 <= task.max_new_tokens


def test_countdown_eval_rejects_more_problems_than_exist() -> None:
    task = get_task("countdown", n_numbers=2, max_number=3)
    with pytest.raises(ValueError, match="distinct eval problems"):
        task.eval(500, seed=0)


# ---------------------------------------------------------------- math data


def test_extract_gsm8k_answer() -> None:
    assert extract_gsm8k_answer("5+18 = <<5+18=23>>23 apples.\n#### 23") == "23"
    assert extract_gsm8k_answer("... #### 40,000") == "40000"
    with pytest.raises(ValueError, match="####"):
        extract_gsm8k_answer("no marker 12")


def test_extract_math_answer() -> None:
    solution = "so $\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}.$"
    assert extract_math_answer(solution) == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert extract_math_answer("first \\boxed{1}, final \\boxed{2}") == "2"
    assert extract_math_answer("no box") is None


def test_load_jsonl_reads_the_published_gsm8k_format() -> None:
    records = load_jsonl(GSM8K_TRAIN)
    assert len(records) == 6
    assert set(records[0]) == {"question", "answer"}


def test_load_jsonl_names_the_bad_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "#### 1"}\n\n{oops\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:3"):
        load_jsonl(bad)


def test_gsm8k_task_with_separate_train_and_test_files() -> None:
    task = get_task("gsm8k", train_path=GSM8K_TRAIN, eval_path=GSM8K_TEST)
    assert task.stop_strings == ("</answer>",)
    evaluation = task.eval(4, seed=0)
    assert sorted(e.ground_truth for e in evaluation) == ["150", "23", "40000", "46"]
    example = next(e for e in evaluation if e.ground_truth == "23")
    question = "Tom has 5 apples. He buys 3 bags with 6 apples each. How many apples does Tom have now?"
    assert example.prompt == R1_ZERO_PROMPT.format(question=question)
    assert example.prompt.endswith("\nAssistant: <think>")
    assert "<<" not in example.demonstration  # calculator notes dropped
    assert example.demonstration.endswith("</think> <answer> 23 </answer>")


def test_r1_zero_demonstrations_earn_full_reward() -> None:
    gsm8k = get_task("gsm8k", train_path=GSM8K_TRAIN, eval_path=GSM8K_TEST)
    math_task = get_task("math", path=MATH_SAMPLE, eval_fraction=0.5)
    examples = gsm8k.train(6, seed=0) + math_task.train(3, seed=0)
    for example in examples:
        scores = gsm8k.reward_fn(example.demonstration, example.ground_truth)
        assert scores["reward"] == 1.0, example.ground_truth


def test_gsm8k_train_cycles_through_every_example_before_repeating() -> None:
    task = get_task("gsm8k", train_path=GSM8K_TRAIN)
    first_epoch = task.train(6, seed=0)
    assert len(prompts(first_epoch)) == 6
    two_epochs = task.train(12, seed=0)
    assert two_epochs[:6] == first_epoch
    assert prompts(two_epochs[6:]) == prompts(first_epoch)
    with pytest.raises(ValueError, match="eval_path was not given"):
        task.eval(1, seed=0)


def test_math_task_from_one_file_splits_by_question_hash() -> None:
    task = get_task("math", path=MATH_SAMPLE, eval_fraction=0.5)
    train, evaluation = task.splits["train"], task.splits["eval"]
    assert len(train) + len(evaluation) == 8
    assert not prompts(train) & prompts(evaluation)
    assert all(is_eval_prompt(e.prompt, 0.5) for e in evaluation)
    answers = {e.ground_truth for e in train + evaluation}
    assert {"12", "\\frac{7}{12}", "3\\sqrt{5}", "x^2 - x - 6"} <= answers


def test_math_record_answer_field_wins_over_the_box(tmp_path: Path) -> None:
    record = {"problem": "p", "solution": "\\boxed{2}", "answer": "3", "level": 1}
    path = tmp_path / "math500.jsonl"
    path.write_text(json.dumps(record) + "\n")
    task = get_task("math", train_path=str(path))
    assert task.train(1, seed=0)[0].ground_truth == "3"


def write_math_records(tmp_path: Path, records: list[dict]) -> str:
    path = tmp_path / "math.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


@pytest.mark.parametrize(
    ("answer", "ground_truth", "correct"),
    [
        (4, "4", "4"),
        (0, "0", "0"),
        (-3, "-3", "-3"),
        (0.5, "0.5", "\\frac{1}{2}"),
        (4.0, "4", "4.0"),
        (1e-05, "0.00001", "10^{-5}"),
    ],
)
def test_math_record_numeric_answer_becomes_a_string_that_grades(
    tmp_path: Path, answer: float, ground_truth: str, correct: str
) -> None:
    record = {"problem": "p", "solution": "\\boxed{999}", "answer": answer}
    assert math_record_answer(record) == ground_truth
    task = get_task("math", train_path=write_math_records(tmp_path, [record]))
    example = task.train(1, seed=0)[0]
    assert example.ground_truth == ground_truth
    response = f" so </think> <answer>{correct}</answer>"
    assert task.reward_fn(response, example.ground_truth)["reward"] == 1.0
    assert task.reward_fn(example.demonstration, example.ground_truth)["reward"] == 1.0


@pytest.mark.parametrize("answer", [True, [4], {"value": 4}, float("nan")])
def test_math_record_answer_of_another_type_is_rejected(
    tmp_path: Path, answer: object
) -> None:
    record = {"problem": "p", "solution": "\\boxed{4}", "answer": answer}
    task = get_task("math", train_path=write_math_records(tmp_path, [record]))
    with pytest.raises(ValueError, match=r"record 0: answer must be a"):
        task.train(1, seed=0)


@pytest.mark.slow
def test_hostile_ground_truths_in_a_math_file_are_bounded(tmp_path: Path) -> None:
    # Both strings make sympy compute a huge number in one C call.
    records = [
        {
            "problem": "p1",
            "solution": "s",
            "answer": "\\sqrt[\\frac{1}{999999999}]{10}",
        },
        {"problem": "p2", "solution": "\\boxed{10^{99 \\cdot 99 \\cdot 99 \\cdot 99}}"},
    ]
    task = get_task("math", train_path=write_math_records(tmp_path, records))
    budget = default_math_grader().cpu_seconds
    for example in task.splits["train"]:
        start = time.perf_counter()
        scores = task.reward_fn(
            " so </think> <answer>10</answer>", example.ground_truth
        )
        elapsed = time.perf_counter() - start
        assert (scores["reward"], scores["grading_timeout"]) == (0.0, 1.0)
        assert budget <= elapsed < 20.0
        # The same string as the answer matches without sympy (string equality).
        scores = task.reward_fn(example.demonstration, example.ground_truth)
        assert (scores["reward"], scores["grading_timeout"]) == (1.0, 0.0)


def test_math_record_without_box_is_rejected_with_its_index(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"problem": "p", "solution": "none"}) + "\n")
    task = get_task("math", train_path=str(path))
    with pytest.raises(ValueError, match=r"record 0: solution must contain"):
        task.train(1, seed=0)


def test_gsm8k_record_missing_a_field_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"question": "q"}) + "\n")
    with pytest.raises(ValueError, match=r"missing \['answer'\]"):
        get_task("gsm8k", train_path=str(path)).train(1, seed=0)


def test_hub_loading_without_datasets_raises_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(__import__("sys").modules, "datasets", None)
    with pytest.raises(ImportError, match=r"grpo-lab\[data\].*path="):
        load_hub_records("openai/gsm8k", "main", "train")
    task = get_task("gsm8k")  # no file: the hub, read on first use
    assert task.max_new_tokens == 1024  # building the task loads nothing
    with pytest.raises(ImportError, match="datasets"):
        task.train(1, seed=0)


@pytest.mark.parametrize(
    ("name", "options"), [("reverse", {"n_digits": 3}), ("addition", {})]
)
def test_toy_eval_examples_are_the_hashed_share_of_all_examples(
    name: str, options: dict
) -> None:
    task = get_task(name, **options)
    expected = [e for e in task.all_examples() if is_eval_prompt(e.prompt, 0.1)]
    assert task.eval_examples() == expected


def test_samples_are_pinned_across_processes_and_versions() -> None:
    # The split rule (BLAKE2b of the prompt) and random.Random(seed) are stable
    # across processes and platforms; a change to either shows up here.
    assert [e.prompt for e in get_task("addition").eval(3, seed=0)] == [
        "37+48=",
        "41+12=",
        "4+7=",
    ]
    assert [e.prompt for e in get_task("reverse").train(3, seed=0)] == [
        "50494>",
        "99346>",
        "55125>",
    ]
    first = get_task("countdown").train(1, seed=0)[0]
    assert (first.prompt, first.demonstration) == ("1 7 7 -> 0:", "7*1-7")


# ---------------------------------------------------------------- scratchpad


def test_scratchpad_demonstrations_restate_the_input_then_answer() -> None:
    task = get_task("scratchpad", n_digits=5, max_restated=10)
    assert task.max_new_tokens == 10 + 1 + 5 + 2  # scratch, ":", answer, EOS, spare
    assert task.response("12345", 7) == "1234512:54321"
    assert task.response("12345", 0) == ":54321"
    for example in task.train(200, seed=0):
        digits = example.prompt.removesuffix(">")
        scratch, answer = example.demonstration.split(":")
        assert answer == example.ground_truth == digits[::-1]
        assert scratch == (digits * 3)[: len(scratch)]
        assert len(example.demonstration) + 1 <= task.max_new_tokens


def test_scratchpad_lengths_vary_and_all_earn_full_reward() -> None:
    task = get_task("scratchpad", n_digits=4, max_restated=6)
    examples = task.train(300, seed=1)
    lengths = {len(example.demonstration) for example in examples}
    assert lengths == set(range(5, 5 + 7))  # 0..6 restated digits, all drawn
    for example in examples:
        scores = task.reward_fn(example.demonstration, example.ground_truth)
        assert scores == {"reward": 1.0, "format_reward": 1.0, "answer_reward": 1.0}


def test_scratchpad_splits_are_disjoint_and_seeded() -> None:
    task = get_task("scratchpad", n_digits=3)
    assert task.train(20, seed=2) == task.train(20, seed=2)
    train, evaluation = task.train(500, seed=0), task.eval(50, seed=0)
    assert not prompts(train) & prompts(evaluation)
    with pytest.raises(ValueError, match="max_restated"):
        get_task("scratchpad", max_restated=-1)


def test_grade_scratchpad_makes_a_wrong_restatement_wrong() -> None:
    lenient = get_task("scratchpad", n_digits=3)
    graded = get_task("scratchpad", n_digits=3, grade_scratchpad=True)
    for example in graded.train(50, seed=3):  # every demonstration stays right
        assert graded.reward_fn(example.demonstration, example.ground_truth)["reward"]
    assert lenient.reward_fn("9:321", "321")["reward"] == 1.0
    assert graded.reward_fn("9:321", "321")["reward"] == 0.0
    with pytest.raises(ValueError, match="grade_scratchpad must be True or False"):
        get_task("scratchpad", grade_scratchpad="yes")


# ---------------------------------------------------------------- hackable addition


def test_hackable_addition_grades_by_its_reward_option() -> None:
    lenient = get_task("hackable_addition", max_value=50, room=8)
    strict = get_task("hackable_addition", reward="strict")
    assert lenient.max_new_tokens == 9
    example = lenient.train(1, seed=0)[0]
    dump = "9" + example.ground_truth + "0"
    assert lenient.reward_fn(dump, example.ground_truth)["reward"] == 1.0
    assert strict.reward_fn(dump, example.ground_truth)["reward"] == 0.0
    assert strict.reward_fn(example.demonstration, example.ground_truth)["reward"] == 1
    with pytest.raises(ValueError, match="reward must be one of"):
        get_task("hackable_addition", reward="loose")
    with pytest.raises(ValueError, match="room"):
        get_task("hackable_addition", room=1)
