"""The GRPO loop: sampled ids trained, group-aligned batches, old log-probs, learning."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from grpo_lab.advantages import (
    compute_group_normalized_rewards,
    compute_multi_reward_advantages,
)
from grpo_lab.logprobs import get_response_log_probs
from grpo_lab.models import build_char_tokenizer
from grpo_lab.rollouts.base import Rollouts
from grpo_lab.tasks import get_task
from grpo_lab.training import loop, run_parts
from grpo_lab.training.config import TrainConfig
from grpo_lab.training.metrics import read_metrics, step_records


def tiny_config(tmp_path, **overrides) -> TrainConfig:
    settings = {
        "run_dir": str(tmp_path / "run"),
        "tiny_hidden_size": 32,
        "tiny_num_layers": 1,
        "tiny_intermediate_size": 64,
        "task_options": {"n_digits": 3},
        "max_new_tokens": 5,
        "rollout_batch_size": 32,
        "group_size": 4,
        "train_batch_size": 32,
        "steps": 2,
        "eval_every": 1,
        "eval_size": 8,
        "checkpoint_every": 1,
        "sft_max_steps": 0,
    }
    return TrainConfig.for_profile("cpu", **{**settings, **overrides})


def test_training_uses_the_sampled_ids_not_a_re_tokenization():
    tokenizer = build_char_tokenizer()
    rollouts = Rollouts(
        prompts=["1>"],
        responses=["2"],
        # Ids a re-tokenization of "2" could not give (an EOS the text hides).
        prompt_token_ids=[[3, 83]],
        response_token_ids=[[4, 1]],
    )
    batch = loop.rollout_token_batch(rollouts, tokenizer)
    assert batch["input_ids"].tolist() == [[3, 83, 4]]
    assert batch["labels"].tolist() == [[83, 4, 1]]
    assert batch["response_mask"].tolist() == [[0, 1, 1]]
    text_only = dataclasses.replace(
        rollouts, prompt_token_ids=None, response_token_ids=None
    )
    assert loop.rollout_token_batch(text_only, tokenizer)["labels"].tolist() == [
        [83, 4]
    ]


def test_train_batches_hold_whole_groups(tmp_path):
    config = tiny_config(
        tmp_path,
        train_batch_size=8,
        importance_reweighting_method="grpo",
        cliprange=0.2,
    )
    rows = loop.train_batch_rows(config)
    assert rows == [slice(0, 8), slice(8, 16), slice(16, 24), slice(24, 32)]


def test_seeds_depend_on_seed_purpose_and_step(tmp_path):
    config = tiny_config(tmp_path)
    assert loop.derived_seed(config, "rollouts", 3) == loop.derived_seed(
        config, "rollouts", 3
    )
    seeds = {
        loop.derived_seed(config, "rollouts", 3),
        loop.derived_seed(config, "rollouts", 4),
        loop.derived_seed(config, "prompts", 3),
        loop.derived_seed(dataclasses.replace(config, seed=1), "rollouts", 3),
    }
    assert len(seeds) == 4


def test_learning_rate_warms_up_linearly(tmp_path):
    config = tiny_config(tmp_path, lr=1e-3, lr_warmup_steps=4)
    # step / 4 of the full rate until step 4, then constant.
    assert [loop.learning_rate_at(config, s) for s in (1, 2, 4, 9)] == pytest.approx(
        [2.5e-4, 5e-4, 1e-3, 1e-3]
    )


def test_old_log_probs_are_scored_at_the_sampling_temperature(tmp_path):
    config = tiny_config(
        tmp_path,
        temperature=0.7,
        train_batch_size=8,
        gradient_accumulation_steps=2,
        importance_reweighting_method="grpo",
        cliprange=0.2,
    )
    policy = loop.build_policy(config)
    task = get_task("reverse", n_digits=3)
    rollouts, _ = loop.sample_rollout_batch(config, task, policy, step=1)
    batch = loop.rollout_token_batch(rollouts, policy.tokenizer)
    old_log_probs = loop.score_old_log_probs(config, policy.model, batch)  # (32, T)
    with torch.no_grad():
        whole = get_response_log_probs(
            policy.model, batch["input_ids"], batch["labels"], temperature=0.7
        )["log_probs"]
        plain = get_response_log_probs(
            policy.model, batch["input_ids"], batch["labels"]
        )
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(old_log_probs[mask], whole[mask], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(old_log_probs[mask], plain["log_probs"][mask])


def test_one_update_moves_log_probs_along_the_advantages(tmp_path, even_digit_task):
    config = tiny_config(tmp_path)
    policy = loop.build_policy(config)
    policy.optimizer = torch.optim.SGD(policy.model.parameters(), lr=0.5)
    task = even_digit_task()
    examples = get_task("reverse", n_digits=3).train(8, seed=0)
    rollouts = policy.backend.generate(
        [e.prompt for e in examples], 4, loop.sampling_settings(config, task, seed=1)
    )
    batch = loop.rollout_token_batch(rollouts, policy.tokenizer)

    def response_log_probs():  # (B,)
        with torch.no_grad():
            scored = get_response_log_probs(
                policy.model, batch["input_ids"], batch["labels"]
            )["log_probs"]
        return (scored * batch["response_mask"]).sum(dim=1)

    before = response_log_probs()
    record = loop.grpo_update(config, task, policy, rollouts, examples)
    change = response_log_probs() - before
    rewards = torch.tensor(
        [task.reward_fn(r, "")["reward"] for r in rollouts.responses]
    )
    advantages, _ = compute_group_normalized_rewards(rewards, 4)
    assert change[advantages > 0].mean() > 0 > change[advantages < 0].mean()
    assert record["train/optimizer_steps"] == 1.0
    assert record["train/reward_mean"] == pytest.approx(rewards.mean().item())
    for key in ("loss/loss", "loss/token_entropy", "loss/gradient_norm"):
        assert key in record, key
    assert record["loss/token_entropy"] > 0


def test_a_skipped_update_logs_no_loss_diagnostics(tmp_path):
    # A random model gets every reversal wrong: every group has equal rewards, the
    # update is skipped, and the entropy, loss and gradient norm it never measured
    # are left out of the line instead of being logged as 0.
    result = loop.train(tiny_config(tmp_path, steps=1), progress=False)
    (record,) = [r for r in step_records(result.history) if r["step"] == 1]
    assert record["train/equal_reward_group_fraction"] == 1.0
    assert record["train/optimizer_steps"] == 0.0
    assert record["loss/active_response_count"] == 0.0
    for key in ("loss/loss", "loss/token_entropy", "loss/gradient_norm"):
        assert key not in record, key
    # The sampler gap is about the rollouts, not the update: it is logged all
    # the same, scored on the unchanged policy (hf samples from it: gap ~0).
    assert 0 <= record["rollout/sampler_log_prob_diff_max"] < 1e-4
    assert 0 <= record["rollout/sampler_log_prob_diff_mean"] < 1e-5


def test_train_writes_the_run_folder_and_refuses_to_overwrite(tmp_path):
    config = tiny_config(tmp_path)
    result = loop.train(config, progress=False)
    steps = step_records(result.history)
    assert [record["step"] for record in steps] == [0, 1, 2]
    for key in ("train/reward_mean", "train/format_reward_mean", "train/response_length",
                "train/optimizer_steps", "time/step_seconds", "eval/accuracy_greedy",
                "eval/accuracy_sampled", "eval/format_rate", "eval/response_length",
                ):  # fmt: skip
        assert key in steps[1], key
    assert result.history == read_metrics(result.run_dir)
    assert (result.run_dir / "config.json").exists()
    assert (result.run_dir / "final_model" / "config.json").exists()
    assert (result.run_dir / "checkpoints" / "step_000002.pt").exists()
    with pytest.raises(ValueError, match="already holds a run"):
        loop.train(config, progress=False)


def test_off_policy_run_logs_clip_fraction(tmp_path, monkeypatch, even_digit_task):
    # A reward a random model earns about half the time, so groups disagree.
    monkeypatch.setattr(
        run_parts,  # build_task's home
        "get_task",
        lambda name, **options: even_digit_task(
            prompts_of=get_task("reverse", **options)
        ),
    )
    config = tiny_config(
        tmp_path,
        steps=1,
        train_batch_size=16,
        epochs_per_rollout_batch=2,
        importance_reweighting_method="grpo",
        cliprange=0.2,
        checkpoint_every=0,
    )
    record = step_records(loop.train(config, progress=False).history)[-1]
    assert 0.0 <= record["loss/clip_fraction"] <= 1.0
    assert 0 < record["train/optimizer_steps"] <= 4  # 2 epochs x 2 train batches


def test_a_kl_run_keeps_a_frozen_step_0_reference_and_logs_its_kl(
    tmp_path, monkeypatch, even_digit_task
):
    monkeypatch.setattr(
        run_parts,  # build_task's home
        "get_task",
        lambda name, **options: even_digit_task(
            prompts_of=get_task("reverse", **options)
        ),
    )
    config = tiny_config(tmp_path, steps=2, kl_coef=0.1, checkpoint_every=1)
    result = loop.train(config, progress=False)
    records = step_records(result.history)[1:]
    assert records[0]["loss/kl_mean"] == pytest.approx(0.0, abs=1e-6)  # step 1: pi_ref
    assert records[1]["loss/kl_mean"] > 0  # the policy has moved away from it
    saved = torch.load(result.run_dir / loop.REFERENCE_MODEL_FILE, weights_only=True)
    initial = loop.build_policy(config).model.state_dict()  # the seed's model, step 0
    assert all(torch.equal(saved[key], initial[key]) for key in initial)
    # Resuming after step 1 reloads the same reference instead of copying the
    # step-1 policy: the resumed step 2 repeats the uninterrupted one.
    checkpoint = result.run_dir / "checkpoints" / "step_000002.pt"
    checkpoint.unlink()
    resumed = loop.train(dataclasses.replace(config, resume=True), progress=False)
    assert step_records(resumed.history)[-1]["loss/kl_mean"] == pytest.approx(
        records[1]["loss/kl_mean"], rel=1e-5
    )


def test_keyboard_interrupt_saves_a_checkpoint_and_resume_matches(
    tmp_path, monkeypatch
):
    reference = loop.train(tiny_config(tmp_path / "a", steps=3), progress=False)
    original_sample = loop.sample_rollout_batch
    calls = {"count": 0}

    def interrupted_sampling(*arguments, **keywords):
        calls["count"] += 1
        if calls["count"] == 3:  # Ctrl-C while step 3 samples: weights are step 2's
            raise KeyboardInterrupt
        return original_sample(*arguments, **keywords)

    monkeypatch.setattr(loop, "sample_rollout_batch", interrupted_sampling)
    config = tiny_config(tmp_path / "b", steps=3, checkpoint_every=0)
    with pytest.raises(KeyboardInterrupt):
        loop.train(config, progress=False)
    assert (tmp_path / "b" / "run" / "checkpoints" / "step_000002.pt").exists()
    monkeypatch.setattr(loop, "sample_rollout_batch", original_sample)
    resumed = loop.train(dataclasses.replace(config, resume=True), progress=False)

    def without_time(history):
        return [
            {k: v for k, v in r.items() if not k.startswith("time/")} for r in history
        ]

    assert without_time(resumed.history) == without_time(reference.history)


@pytest.mark.slow
def test_a_short_cpu_run_learns(tmp_path):
    # The cpu profile, cut to 20 GRPO steps (about a minute on two cores).
    config = TrainConfig.for_profile(
        "cpu",
        run_dir=str(tmp_path / "run"),
        steps=20,
        eval_every=20,
        eval_size=100,
        checkpoint_every=0,
    )
    policy_before = loop.build_policy(config).model.state_dict()
    result = loop.train(config, progress=False)
    steps = step_records(result.history)
    start, end = steps[0], steps[-1]
    assert (start["step"], end["step"]) == (0, 20)
    # Seen over seeds 0-1: sampled accuracy ~0.3 -> ~0.5 after 20 steps.
    assert end["eval/accuracy_sampled"] >= start["eval/accuracy_sampled"] + 0.1
    first_rewards = [r["train/reward_mean"] for r in steps[1:6]]
    last_rewards = [r["train/reward_mean"] for r in steps[-5:]]
    assert sum(last_rewards) / 5 >= sum(first_rewards) / 5 + 0.08
    trained = torch.load(
        result.run_dir / "checkpoints" / "step_000020.pt", weights_only=True
    )["model"]
    assert any(not torch.equal(trained[k], v) for k, v in policy_before.items())


def test_grading_timeouts_are_counted_only_for_rewards_that_report_them():
    from grpo_lab.training.loop import counting_grading_timeouts

    def math_like(response, truth):
        timed_out = float(response == "hang")
        return {"reward": 0.0, "format_reward": 1.0, "answer_reward": 0.0,
                "grading_timeout": timed_out}  # fmt: skip

    counted, counts = counting_grading_timeouts(math_like)
    for response in ["hang", "4", "hang"]:
        assert counted(response, "4")["grading_timeout"] == float(response == "hang")
    assert counts == {"grading_timeouts": 2.0}
    toy, toy_counts = counting_grading_timeouts(
        lambda r, t: {"reward": 1.0, "format_reward": 1.0, "answer_reward": 1.0}
    )
    toy("1", "1")
    assert toy_counts == {}


@pytest.mark.slow
def test_the_small_gpu_profile_runs_two_steps_with_a_tiny_stand_in(tmp_path):
    """The small-gpu profile as is (chat template, gradient checkpointing, a
    chunked head, hf rollouts, GSM8K), with a tiny Qwen2 of the same family on
    the CPU in place of Qwen2.5-0.5B-Instruct."""
    from pathlib import Path

    from grpo_lab.models import build_char_tokenizer, build_tiny_qwen2

    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}"
        "<|im_start|>assistant\n{% endif %}"
    )
    model_dir = tmp_path / "stand-in"
    build_tiny_qwen2(tokenizer, hidden_size=32, num_layers=1, seed=0).save_pretrained(
        model_dir
    )
    tokenizer.save_pretrained(model_dir)
    data = Path(__file__).parent / "data"
    config = TrainConfig.for_profile(
        "small-gpu",
        model=str(model_dir),
        device="cpu",
        task_options={
            "train_path": str(data / "gsm8k_train.jsonl"),
            "eval_path": str(data / "gsm8k_test.jsonl"),
        },
        steps=2,
        rollout_batch_size=8,
        group_size=4,
        train_batch_size=4,
        gradient_accumulation_steps=2,
        max_new_tokens=12,
        rollout_max_batch_size=4,
        logits_chunk_size=8,
        eval_every=1,
        eval_size=2,
        checkpoint_every=0,
        run_dir=str(tmp_path / "run"),
    )
    assert config.chat_template and config.gradient_checkpointing
    from grpo_lab.training.loop import train

    result = train(config, progress=False)
    steps = [r for r in result.history if r.get("step", 0) > 0]
    assert [r["step"] for r in steps] == [1, 2]
    # Two train batches per rollout batch: off-policy, old log-probs scored.
    assert all(r["train/optimizer_steps"] <= 2 for r in steps)
    assert all("eval/accuracy_greedy" in r for r in steps)


def test_keep_checkpoints_keeps_that_many_of_the_newest(tmp_path):
    from grpo_lab.training import checkpoint

    config = tiny_config(tmp_path, steps=4, eval_every=0, keep_checkpoints=3)
    loop.train(config, progress=False)
    kept = checkpoint.list_checkpoints(config.run_dir)
    assert [checkpoint.checkpoint_step(path) for path in kept] == [2, 3, 4]
    folders = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert [name for name in folders if not name.endswith(".pt")] == [
        "step_000002", "step_000003", "step_000004",
    ]  # fmt: skip


def test_a_step_checks_the_update_settings_once(
    tmp_path, count_checks, even_digit_task
):
    config = tiny_config(
        tmp_path, epochs_per_rollout_batch=2, gradient_accumulation_steps=4,
        importance_reweighting_method="grpo", cliprange=0.2, kl_coef=0.1,
        top_entropy_quantile=0.5, sampler_correction="token_truncate",
        share_prompt_prefix=True,
    )  # fmt: skip
    policy = loop.build_policy(config)
    task = even_digit_task()
    examples = get_task("reverse", n_digits=3).train(8, seed=0)
    rollouts = policy.backend.generate(
        [e.prompt for e in examples], 4, loop.sampling_settings(config, task, seed=1)
    )
    counts = count_checks(("grpo_lab.losses", "check_objective_settings"))
    record = loop.grpo_update(config, task, policy, rollouts, examples)
    assert record["train/optimizer_steps"] == 2.0 and "loss/kl_mean" in record
    assert "rollout/is_ratio_mean" in record  # the correction ran
    # Old and reference log-probs, 2 updates of 4 microbatches: one check each.
    assert counts == dict.fromkeys(counts, 1)


def test_a_step_builds_advantages_from_the_reward_parts_over_tokens(
    tmp_path, monkeypatch, even_digit_task
):
    # reward_aggregation and token_whiten reach the step: the advantages it
    # trains on are grpo_lab's aggregation of the two parts, weighted by each
    # response's token count in the batch the step trains on.
    class TwoParts(even_digit_task):
        def reward_fn(self, response, ground_truth):
            answer = float(response[:1] in set("02468"))
            shape = float(len(response) > 2)
            return {"reward": answer, "format_reward": shape, "answer_reward": answer}

    seen = {}

    def recording(model, optimizer, steps, norm, batch, advantages, **kwargs):
        seen["advantages"], seen["mask"] = advantages.clone(), batch["response_mask"]
        return torch.zeros(()), {"optimizer_step": 1.0}

    monkeypatch.setattr(loop, "policy_gradient_update", recording)
    examples = get_task("reverse", n_digits=3).train(8, seed=0)
    for aggregation, normalizer in (
        ("normalize_then_sum_tokens", "std"),
        ("sum_then_normalize", "token_whiten"),
    ):
        config = tiny_config(tmp_path, reward_aggregation=aggregation,
                             advantage_normalizer=normalizer)  # fmt: skip
        policy = loop.build_policy(config)
        task = TwoParts()
        responses = ["2", "13", "4xx", "0123", "7", "88", "x", "9999"] * 4
        rollouts = Rollouts(
            prompts=[e.prompt for e in examples for _ in range(4)],
            responses=responses,
        )  # strings only: tokenized, each its own length
        loop.grpo_update(config, task, policy, rollouts, examples)
        scores = [task.reward_fn(r, "") for r in rollouts.responses]
        parts = torch.tensor([[s["format_reward"], s["answer_reward"]] for s in scores])
        expected, _ = compute_multi_reward_advantages(
            parts, 4, "mean", config.advantage_eps, normalizer,
            reward_aggregation=aggregation,
            response_lengths=seen["mask"].sum(dim=1),
        )  # fmt: skip
        assert torch.equal(seen["advantages"], expected), aggregation
        assert len(set(seen["mask"].sum(dim=1).tolist())) > 1  # lengths differ
