"""Truncated responses: detection, the loss mask, DAPO's soft overlong punishment."""

from __future__ import annotations

import copy
import dataclasses
import types

import pytest
import torch
from trl.rewards import get_soft_overlong_punishment

from grpo_lab.models import build_char_tokenizer, build_tiny_qwen2
from grpo_lab.rollouts.base import Rollouts
from grpo_lab.tasks.base import Example
from grpo_lab.train_step import policy_gradient_update
from grpo_lab.training import loop
from grpo_lab.training.config import TrainConfig
from grpo_lab.training.metrics import step_records
from grpo_lab.training.overlong import (
    check_overlong_settings,
    end_of_sequence_ids,
    is_truncated,
    mask_truncated,
    shape_reward_results,
    soft_overlong_punishment,
    truncated_rows,
    truncation_metrics,
)

EOS = 1
DETECT = {"eos_token_ids": [EOS], "stop_strings": ("</answer>",), "max_new_tokens": 4}


# --- detection -----------------------------------------------------------------------


def test_a_response_ending_in_eos_terminated_even_at_full_length():
    assert not is_truncated([5, 6, 7, EOS], "abc", 4, **DETECT)
    assert not is_truncated([5, EOS], "a", 2, **DETECT)


def test_a_response_ending_in_a_stop_string_terminated():
    assert not is_truncated([5, 6, 7, 8], "x</answer>", 4, **DETECT)
    # A stop string inside the text, not at its end, ends nothing.
    assert is_truncated([5, 6, 7, 8], "</answer>x", 4, **DETECT)


def test_a_full_length_response_without_an_end_is_truncated():
    assert is_truncated([5, 6, 7, 8], "abcd", 4, **DETECT)
    # Shorter than max_new_tokens: generation did not run out of length.
    assert not is_truncated([5, 6, 7], "abc", 3, **DETECT)


def test_text_only_responses_are_judged_by_stop_strings_and_length():
    assert is_truncated(None, "abcd", 4, **DETECT)
    assert not is_truncated(None, "ab</answer>", 4, **DETECT)
    flags = truncated_rows(
        ["abcd", "ab", "x</answer>"], None, [4, 2, 4], **DETECT
    )  # (3,)
    assert flags.tolist() == [True, False, False]


def test_truncated_rows_checks_lengths():
    with pytest.raises(ValueError, match="one entry per response"):
        truncated_rows(["a", "b"], None, [1], **DETECT)


def test_end_of_sequence_ids_add_the_generation_configs():
    tokenizer = types.SimpleNamespace(eos_token_id=1)
    assert end_of_sequence_ids(tokenizer) == [1]
    config = types.SimpleNamespace(eos_token_id=[7, 1])
    assert end_of_sequence_ids(tokenizer, config) == [1, 7]
    assert end_of_sequence_ids(tokenizer, types.SimpleNamespace(eos_token_id=9)) == [
        1,
        9,
    ]


def test_truncation_metrics_leave_out_an_empty_class():
    truncated = torch.tensor([True, False, False, True])
    metrics = truncation_metrics([4, 2, 3, 4], truncated)
    assert metrics == {
        "rollout/clipped_fraction": 0.5,
        "rollout/terminated_length_mean": 2.5,
        "rollout/truncated_length_mean": 4.0,
    }
    none_cut = truncation_metrics([2, 3], torch.tensor([False, False]))
    assert none_cut == {
        "rollout/clipped_fraction": 0.0,
        "rollout/terminated_length_mean": 2.5,
    }


# --- the mask ------------------------------------------------------------------------


def test_mask_truncated_zeroes_exactly_the_truncated_rows():
    mask = torch.tensor([[0, 1, 1], [0, 1, 0], [1, 1, 1]])  # (3, 3)
    masked = mask_truncated(mask, torch.tensor([False, True, False]))
    assert masked.tolist() == [[0, 1, 1], [0, 0, 0], [1, 1, 1]]
    assert mask.tolist()[1] == [0, 1, 0]  # the input is left alone
    with pytest.raises(ValueError, match=r"truncated must have shape \(3,\)"):
        mask_truncated(mask, torch.tensor([True]))


def crafted_rollouts(tokenizer) -> tuple[Rollouts, list[Example]]:
    """2 prompts x 4 responses; the responses without EOS at 3 tokens are cut."""
    texts = ["2", "13", "456", "789", "8", "135", "24", "97"]
    ended = [True, True, False, False, True, False, True, True]
    ids = [
        tokenizer.encode(t, add_special_tokens=False) + ([EOS] if end else [])
        for t, end in zip(texts, ended)
    ]
    prompts = ["12>"] * 4 + ["34>"] * 4
    prompt_ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    rollouts = Rollouts(prompts, texts, prompt_ids, ids)
    return rollouts, [Example("12>", "21"), Example("34>", "43")]


def tiny_policy(config: TrainConfig) -> loop.Policy:
    policy = loop.build_policy(config)
    policy.optimizer = torch.optim.SGD(policy.model.parameters(), lr=1.0)
    return policy


def test_masking_removes_exactly_the_truncated_rows_from_the_gradient(
    tmp_path, even_digit_task
):
    settings = {
        "run_dir": str(tmp_path / "run"),
        "tiny_hidden_size": 16,
        "tiny_intermediate_size": 32,
        "tiny_num_layers": 1,
        "rollout_batch_size": 8,
        "group_size": 4,
        "train_batch_size": 8,
        "max_new_tokens": 3,
        "max_grad_norm": None,
        "sft_max_steps": 0,
    }
    config = TrainConfig.for_profile("cpu", mask_truncated_completions=True, **settings)
    policy = tiny_policy(config)
    start = copy.deepcopy(policy.model.state_dict())
    rollouts, examples = crafted_rollouts(policy.tokenizer)
    record = loop.grpo_update(config, even_digit_task(3), policy, rollouts, examples)
    masked_step = {k: v - start[k] for k, v in policy.model.state_dict().items()}
    assert record["rollout/clipped_fraction"] == 3 / 8

    # The same step by hand: advantages from every response, the gradient from
    # the five that ended (sequence normalization still divides by all 8).
    policy.model.load_state_dict(start)
    unmasked = TrainConfig.for_profile("cpu", **settings)
    batch = loop.rollout_token_batch(rollouts, policy.tokenizer)
    rewards = torch.tensor([float(t[0] in "02468") for t in rollouts.responses])
    grouped = rewards.reshape(2, 4)  # (2, 4)
    advantages = (grouped - grouped.mean(1, keepdim=True)) / (
        grouped.std(1, keepdim=True) + 1e-6
    )
    kept = torch.tensor([1, 1, 0, 0, 1, 0, 1, 1], dtype=torch.bool)
    advantages = advantages.flatten() * kept  # (8,)
    policy_gradient_update(
        policy.model,
        policy.optimizer,
        1,
        None,
        batch,
        advantages,
        **dataclasses.asdict(unmasked.update_settings()),
    )
    by_hand = {k: v - start[k] for k, v in policy.model.state_dict().items()}
    for name in start:
        torch.testing.assert_close(masked_step[name], by_hand[name])
    # And masking did change the step: the unmasked update differs.
    policy.model.load_state_dict(start)
    loop.grpo_update(unmasked, even_digit_task(3), policy, rollouts, examples)
    moved = {k: v - start[k] for k, v in policy.model.state_dict().items()}
    assert any(not torch.allclose(moved[k], masked_step[k]) for k in start)


# --- the shaping ---------------------------------------------------------------------


def test_soft_overlong_punishment_by_hand():
    # L_max 10, L_cache 4: free up to 6, then -1/4 per token, -1 past 10.
    lengths = torch.tensor([0, 6, 7, 8, 10, 11])
    assert soft_overlong_punishment(lengths, 10, 4).tolist() == [
        0.0,
        0.0,
        -0.25,
        -0.5,
        -1.0,
        -1.0,
    ]


@pytest.mark.parametrize(("max_length", "buffer"), [(10, 4), (7, 7), (64, 1), (33, 5)])
def test_soft_overlong_punishment_matches_trl_in_float64(max_length, buffer):
    lengths = list(range(0, max_length + 4))
    trl = get_soft_overlong_punishment(max_length, buffer)([[0] * n for n in lengths])
    ours = soft_overlong_punishment(
        torch.tensor(lengths, dtype=torch.float64), max_length, buffer
    )  # (n,)
    assert ours.dtype == torch.float64
    torch.testing.assert_close(ours, torch.tensor(trl, dtype=torch.float64))


def test_shaping_adds_the_scaled_punishment_to_the_reward_only():
    results = [{"reward": 1.0, "format_reward": 1.0, "answer_reward": 1.0}] * 3
    shaped = shape_reward_results(
        results, [2, 9, 10], max_length=10, buffer=4, penalty=0.5
    )
    assert [r["reward"] for r in shaped] == [1.0, 1.0 - 0.5 * 0.75, 0.5]
    assert [r["overlong_penalty"] for r in shaped] == [0.0, -0.375, -0.5]
    assert all(r["answer_reward"] == 1.0 for r in shaped)
    assert results[0] == {"reward": 1.0, "format_reward": 1.0, "answer_reward": 1.0}


def test_the_loop_grades_once_and_trains_on_shaped_rewards(tmp_path, even_digit_task):
    config = TrainConfig.for_profile(
        "smoke", run_dir=str(tmp_path / "r"), max_new_tokens=3, overlong_buffer=2
    )
    policy = tiny_policy(config)
    rollouts, examples = crafted_rollouts(policy.tokenizer)
    task = even_digit_task(3)
    calls = []
    original = task.reward_fn
    task.reward_fn = lambda r, t: calls.append(r) or original(r, t)
    rollouts.prompts = rollouts.prompts + rollouts.prompts  # 4 prompts x 4
    rollouts.responses = rollouts.responses * 2
    rollouts.prompt_token_ids = rollouts.prompt_token_ids * 2
    rollouts.response_token_ids = rollouts.response_token_ids * 2
    record = loop.grpo_update(config, task, policy, rollouts, examples * 2)
    assert len(calls) == 16  # each response graded once
    # Lengths count the EOS; free up to 1 token, then -1/2 per token.
    lengths = torch.tensor([len(i) for i in rollouts.response_token_ids])
    terms = soft_overlong_punishment(lengths, 3, 2)
    raw = torch.tensor([float(t[0] in "02468") for t in rollouts.responses])
    assert record["train/reward_mean"] == pytest.approx((raw + terms).mean().item())
    assert record["train/overlong_penalty_mean"] == pytest.approx(terms.mean().item())


# --- the loop on smoke runs ------------------------------------------------------------


@pytest.mark.parametrize(
    "option",
    [{"mask_truncated_completions": True}, {"overlong_buffer": 3}],
    ids=["mask", "overlong"],
)
def test_a_two_step_smoke_run_with_each_option(tmp_path, option):
    config = TrainConfig.for_profile("smoke", run_dir=str(tmp_path / "r"), **option)
    records = step_records(loop.train(config, progress=False).history)
    trained = [r for r in records if r["step"] > 0]
    assert len(trained) == 2
    for record in trained:
        assert 0.0 <= record["rollout/clipped_fraction"] <= 1.0
        if "overlong_buffer" in option:
            assert record["train/overlong_penalty_mean"] <= 0.0
            assert record["train/reward_mean"] == pytest.approx(
                record["train/answer_reward_mean"]
                + record["train/overlong_penalty_mean"],
                abs=1e-6,
            )


def test_masking_every_response_skips_the_step(tmp_path):
    # 1 new token for a 3-digit reversal: every response is cut, none trains.
    config = TrainConfig.for_profile(
        "smoke",
        run_dir=str(tmp_path / "r"),
        steps=1,
        max_new_tokens=1,
        overlong_buffer=1,
        mask_truncated_completions=True,
    )
    (record,) = [r for r in step_records(loop.train(config, progress=False).history)
                 if r["step"] == 1]  # fmt: skip
    assert record["rollout/clipped_fraction"] == 1.0
    assert "rollout/terminated_length_mean" not in record
    assert record["train/optimizer_steps"] == 0.0


# --- settings ----------------------------------------------------------------------


def test_check_overlong_settings_refuses_bad_values():
    check_overlong_settings(False, None, 1.0, None)
    check_overlong_settings(True, 4, 0.0, 4)
    with pytest.raises(ValueError, match="overlong_buffer must be at most"):
        check_overlong_settings(False, 5, 1.0, 4)
    with pytest.raises(ValueError, match="overlong_buffer must be None or a positive"):
        check_overlong_settings(False, 0, 1.0, None)
    with pytest.raises(ValueError, match="overlong_penalty must be a finite number"):
        check_overlong_settings(False, None, float("nan"), None)
    with pytest.raises(ValueError, match="mask_truncated_completions must be True"):
        check_overlong_settings(1, None, 1.0, None)


def test_the_buffer_is_checked_against_the_tasks_own_length():
    # reverse with 5 digits: max_new_tokens None means the task's 7 tokens.
    TrainConfig.for_profile("cpu", overlong_buffer=7)
    with pytest.raises(ValueError, match=r"at most max_new_tokens \(7\)"):
        TrainConfig.for_profile("cpu", overlong_buffer=8)


def test_the_tiny_models_end_token_is_the_tokenizers_eos():
    tokenizer = build_char_tokenizer()
    model = build_tiny_qwen2(tokenizer, hidden_size=16, num_layers=1)
    assert EOS in end_of_sequence_ids(tokenizer, model.generation_config)


def test_lengths_and_the_limit_no_response_can_have_are_refused():
    with pytest.raises(
        ValueError, match=r"^lengths must be finite token counts >= 0, got -5\.0$"
    ):
        soft_overlong_punishment(torch.tensor([-5, 3]), 10, 4)
    with pytest.raises(ValueError, match=r"^lengths must be finite .*got nan$"):
        soft_overlong_punishment(torch.tensor([3.0, float("nan")]), 10, 4)
    assert soft_overlong_punishment(torch.tensor([0]), 10, 4).tolist() == [0.0]
    # max_new_tokens 0: every response (length >= 0) would count as cut off.
    with pytest.raises(
        ValueError, match=r"^max_new_tokens must be a positive int, got 0$"
    ):
        is_truncated([2, 3], "ab", 2, **{**DETECT, "max_new_tokens": 0})
