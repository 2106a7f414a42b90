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
