"""Chat-template prompts for instruct models; plain prompts for base models."""

from __future__ import annotations

import pytest

from grpo_lab.models import build_char_tokenizer
from grpo_lab.tasks import get_task
from grpo_lab.tasks.chat import ChatPromptTask, chat_prompt

# A ChatML-like template (the shape Qwen instruct tokenizers use), local.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)


@pytest.fixture
def instruct_tokenizer():
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = CHATML
    return tokenizer


def test_a_prompt_becomes_one_user_turn_ready_for_the_answer(instruct_tokenizer):
    assert chat_prompt("12>", instruct_tokenizer) == (
        "<|im_start|>user\n12><|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_base_tokenizer_without_a_template_is_refused():
    with pytest.raises(ValueError, match="chat_template is on, but the tokenizer"):
        ChatPromptTask(get_task("reverse", n_digits=3), build_char_tokenizer())


def test_the_wrapped_task_keeps_answers_rewards_and_stops(instruct_tokenizer):
    task = get_task("reverse", n_digits=3)
    chat = ChatPromptTask(task, instruct_tokenizer)
    for plain, wrapped in zip(task.train(4, seed=1), chat.train(4, seed=1)):
        assert wrapped.prompt == chat_prompt(plain.prompt, instruct_tokenizer)
        assert (wrapped.ground_truth, wrapped.demonstration) == (
            plain.ground_truth,
            plain.demonstration,
        )
    assert [e.ground_truth for e in chat.eval(3, seed=0)] == [
        e.ground_truth for e in task.eval(3, seed=0)
    ]
    assert chat.reward_fn("321", "321") == task.reward_fn("321", "321")
    assert (chat.name, chat.stop_strings, chat.max_new_tokens) == (
        task.name,
        task.stop_strings,
        task.max_new_tokens,
    )


def test_the_r1_zero_math_prompt_is_wrapped_whole(instruct_tokenizer, tmp_path):
    from pathlib import Path

    data = Path(__file__).parent / "data"
    task = get_task(
        "gsm8k",
        train_path=str(data / "gsm8k_train.jsonl"),
        eval_path=str(data / "gsm8k_test.jsonl"),
    )
    (plain,) = task.eval(1, seed=0)
    (wrapped,) = ChatPromptTask(task, instruct_tokenizer).eval(1, seed=0)
    assert wrapped.prompt.startswith("<|im_start|>user\n" + plain.prompt)
    assert wrapped.prompt.endswith("<|im_start|>assistant\n")


# A Qwen3-style template: with thinking on (its default) the generation prompt
# opens the reasoning block; with enable_thinking false it writes an empty,
# closed block. Local, the shape of Qwen3's tokenizer_config.json template.
THINKING = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}"
)


@pytest.fixture
def thinking_tokenizer():
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = THINKING
    return tokenizer


def think_format_reward(response: str, ground_truth: str) -> dict[str, float]:
    """A reward that wants the whole block, "<think> ... </think>", then the answer."""
    opened, _, rest = response.partition("<think>")
    _thought, closed, answer = rest.partition("</think>")
    well_formed = not opened.strip() and bool(closed)
    right = well_formed and answer.strip() == ground_truth
    return {"reward": float(right), "format_reward": float(well_formed),
            "answer_reward": float(right)}  # fmt: skip


class ThinkTask:
    """A task graded by think_format_reward, for the wrapper to wrap."""

    name, stop_strings, max_new_tokens = "think", (), 8

    def reward_fn(self, response: str, ground_truth: str) -> dict[str, float]:
        return think_format_reward(response, ground_truth)


def test_a_template_that_opens_the_reasoning_block_is_known(
    thinking_tokenizer, instruct_tokenizer
):
    from grpo_lab.tasks.chat import opened_reasoning

    thinking = chat_prompt("2+2?", thinking_tokenizer)
    assert thinking.endswith("<|im_start|>assistant\n<think>\n")
    assert opened_reasoning(thinking) == "<think>\n"
    off = chat_prompt("2+2?", thinking_tokenizer, enable_thinking=False)
    assert off.endswith("<think>\n\n</think>\n\n") and opened_reasoning(off) == ""
    assert opened_reasoning(chat_prompt("2+2?", instruct_tokenizer)) == ""
    assert ChatPromptTask(ThinkTask(), thinking_tokenizer).reasoning_prefix == (
        "<think>\n"
    )
    closed = ChatPromptTask(ThinkTask(), thinking_tokenizer, enable_thinking=False)
    assert closed.reasoning_prefix == ""
    with pytest.raises(ValueError, match=r"^enable_thinking must be None, True or"):
        chat_prompt("x", thinking_tokenizer, enable_thinking="yes")


def test_the_format_reward_sees_the_tag_the_template_wrote(thinking_tokenizer):
    """The model's response starts inside the block: graded alone it has no
    "<think>" and scores 0; graded as the assistant's turn it scores 1."""
    response = "2 and 2 make 4</think>4"
    assert think_format_reward(response, "4")["reward"] == 0.0  # the 2026 bug
    task = ChatPromptTask(ThinkTask(), thinking_tokenizer)
    assert task.reward_fn(response, "4") == {
        "reward": 1.0, "format_reward": 1.0, "answer_reward": 1.0
    }  # fmt: skip
    # Thinking off: the template closed the block, the response is the answer.
    off = ChatPromptTask(ThinkTask(), thinking_tokenizer, enable_thinking=False)
    assert off.reward_fn("4", "4")["format_reward"] == 0.0  # no block of its own


def test_a_response_cut_inside_the_opened_block_is_named(thinking_tokenizer):
    task = ChatPromptTask(ThinkTask(), thinking_tokenizer)
    cut = "2 and 2 make"  # max_new_tokens ran out mid-thought
    assert task.reasoning_unclosed(cut)
    assert task.reward_fn(cut, "4")["format_reward"] == 0.0
    assert not task.reasoning_unclosed("2 and 2 make 4</think>4")
    off = ChatPromptTask(ThinkTask(), thinking_tokenizer, enable_thinking=False)
    assert not off.reasoning_unclosed(cut)


def test_the_loop_s_share_of_responses_left_inside_the_block(
    thinking_tokenizer, instruct_tokenizer
):
    from grpo_lab.tasks.chat import unclosed_reasoning_metrics

    responses = ["2 and 2 make 4</think>4", "2 and 2 ma", "so</think>5", "hmm"]
    thinking = ChatPromptTask(ThinkTask(), thinking_tokenizer)
    assert unclosed_reasoning_metrics(thinking, responses) == {
        "rollout/unclosed_reasoning_fraction": 0.5
    }
    off = ChatPromptTask(ThinkTask(), thinking_tokenizer, enable_thinking=False)
    assert unclosed_reasoning_metrics(off, responses) == {}
    assert (
        unclosed_reasoning_metrics(
            ChatPromptTask(ThinkTask(), instruct_tokenizer), responses
        )
        == {}
    )
    assert unclosed_reasoning_metrics(ThinkTask(), responses) == {}  # no template
