"""TrainConfig: profiles, one door for every setting, help text, inert flags."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import re
import warnings

import pytest
import torch

from grpo_lab.rollouts import BACKEND_RECORDS
from grpo_lab.training import config as config_module
from grpo_lab.training.config import (
    PROFILE_CHANGES,
    SECTIONS,
    TrainConfig,
    add_config_arguments,
    chosen_profile,
    config_from_arguments,
    default_profile,
    field_help,
    field_value,
    inert_settings,
)
from grpo_lab.training.config import profiles as config_profiles


def parse(flags: list[str]) -> TrainConfig:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    return config_from_arguments(parser.parse_args(flags))


# --- profiles ---------------------------------------------------------------------


def test_cpu_profile_is_the_tiny_reverse_run():
    config = TrainConfig.for_profile("cpu")
    assert config == TrainConfig()  # the dataclass defaults are the cpu profile
    assert (config.profile, config.model, config.task) == ("cpu", "tiny", "reverse")
    assert config.rollout_batch_size == 32 * 8 and config.group_size == 8
    assert config.prompts_per_step == 32 and config.task_options == {"n_digits": 5}
    assert config.backend == "hf" and config.device == "cpu"
    # None: the task's own length, 5 digits + EOS + 1 of slack.
    assert config.temperature == 1.0 and config.max_new_tokens is None
    assert not config.off_policy and config.sft_max_steps > 0


def test_gpu_profile_is_an_off_policy_clipped_real_model_run():
    config = TrainConfig.for_profile("gpu")
    assert config.model == "Qwen/Qwen2.5-Math-1.5B" and config.task == "gsm8k"
    assert (config.backend, config.device) == ("vllm", "cuda")
    assert config.autocast_dtype == "bfloat16" and config.logits_chunk_size > 0
    # 256 responses, 128 per optimizer step: the second step is off-policy.
    assert config.off_policy and config.train_batch_size < config.rollout_batch_size
    assert config.importance_reweighting_method == "grpo" and config.cliprange == 0.2
    assert config.lr == 1e-6 and config.max_new_tokens == 1024


def test_smoke_profile_is_the_cpu_run_at_its_smallest():
    smoke, cpu = TrainConfig.for_profile("smoke"), TrainConfig.for_profile("cpu")
    assert (smoke.model, smoke.task, smoke.device) == (cpu.model, cpu.task, "cpu")
    assert smoke.steps < 5 and smoke.rollout_batch_size <= 16
    assert smoke.tiny_hidden_size < cpu.tiny_hidden_size
    assert 0 < smoke.sft_max_steps < 5


def test_profiles_list_only_what_they_change():
    defaults = TrainConfig()
    for profile, changes in PROFILE_CHANGES.items():
        for name, value in changes.items():
            assert getattr(defaults, name) != value, (profile, name)


def test_overrides_apply_and_unknown_ones_are_named():
    config = TrainConfig.for_profile("cpu", lr=3e-4, steps=5)
    assert (config.lr, config.steps) == (3e-4, 5)
    with pytest.raises(ValueError, match="learning_rate"):
        TrainConfig.for_profile("cpu", learning_rate=3e-4)
    with pytest.raises(ValueError, match="profile must be one of"):
        TrainConfig.for_profile("tpu")


def test_profile_choice_reads_the_environment(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("GRPO_LAB_PROFILE", raising=False)
    assert default_profile() == chosen_profile() == "cpu"
    assert parse([]).profile == "cpu"
    monkeypatch.setenv("GRPO_LAB_PROFILE", "smoke")
    assert chosen_profile() == "smoke" and parse([]).steps == 2
    monkeypatch.setenv("GRPO_LAB_PROFILE", "tpu")
    with pytest.raises(ValueError, match="GRPO_LAB_PROFILE must be one of"):
        chosen_profile()
    # A gpu profile on a machine without CUDA is refused before anything loads.
    monkeypatch.setenv("GRPO_LAB_PROFILE", "gpu")
    with pytest.raises(ValueError, match="GRPO_LAB_PROFILE=gpu needs a CUDA GPU"):
        chosen_profile()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert chosen_profile() == "gpu"


# --- one door: every bad setting refused at construction ----------------------------


BAD_SETTINGS = [
    (
        {"sampler_correction_low": 2.0, "sampler_correction_high": 1.0},
        "sampler_correction_low must be below sampler_correction_high",
    ),
    ({"sampler_correction_cap": 0.0}, "sampler_correction_cap must be a number > 0"),
    ({"sampler_correction": "tis"}, "sampler_correction must be one of"),
    ({"group_size": 3}, "group_size must divide rollout_batch_size"),
    ({"group_size": 1}, "group_size must be at least 2 with baseline 'mean'"),
    ({"group_size": 0}, "group_size must be a positive int, got 0"),
    ({"train_batch_size": 96}, "train_batch_size must divide rollout_batch_size"),
    ({"gradient_accumulation_steps": 3}, "gradient_accumulation_steps must divide"),
    (
        {"gradient_accumulation_steps": 512},
        "gradient_accumulation_steps must be between 1",
    ),
    ({"train_batch_size": 128}, "importance_reweighting_method must be one of"),
    ({"epochs_per_rollout_batch": 2}, "importance_reweighting_method must be one of"),
    (
        {"importance_reweighting_method": "grpo", "cliprange": 0.2},
        "importance_reweighting_method 'grpo' needs an off-policy schedule",
    ),
    (
        {"importance_reweighting_method": "ppo"},
        "importance_reweighting_method must be one of",
    ),
    (
        {"train_batch_size": 128, "importance_reweighting_method": "grpo"},
        "cliprange must be positive for 'grpo', got None",
    ),
    (
        {
            "train_batch_size": 128,
            "importance_reweighting_method": "gspo",
            "cliprange": -0.1,
        },
        "cliprange must be None or a positive number, got -0.1",
    ),
    ({"cliprange": float("nan")}, "cliprange must be None or a positive number"),
    ({"baseline": "median"}, "baseline must be one of"),
    ({"advantage_normalizer": "max"}, "advantage_normalizer must be one of"),
    ({"advantage_eps": -1e-6}, "advantage_eps must be a finite number >= 0"),
    ({"loss_normalization": "tokens"}, "loss_normalization must be one of"),
    ({"loss_normalization": "constant"}, "normalization_constant must be positive"),
    (
        {"normalization_constant": 0},
        "normalization_constant must be None or a positive",
    ),
    ({"temperature": 0.0}, "temperature must be a finite number > 0, got 0.0"),
    ({"temperature": float("nan")}, "temperature must be a finite number > 0, got nan"),
    ({"temperature": -1.0}, "temperature must be a finite number > 0"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
    ({"max_new_tokens": 0}, "max_new_tokens must be None or a positive int, got 0"),
    ({"lr": 0.0}, r"lr must be a finite number in \(0.0, inf\), got 0.0"),
    ({"lr": float("nan")}, "lr must be a finite number in"),
    ({"lr": -3e-4}, "lr must be a finite number in"),
    ({"sft_lr": float("inf")}, "sft_lr must be a finite number in"),
    ({"weight_decay": -0.1}, "weight_decay must be a finite number in"),
    ({"adam_beta2": 1.0}, r"adam_beta2 must be a finite number in \[0.0, 1.0\)"),
    (
        {"max_grad_norm": -1.0},
        r"max_grad_norm must be None \(no clipping\) or a finite",
    ),
    ({"max_grad_norm": 0.0}, "max_grad_norm must be None"),
    ({"steps": 0}, "steps must be a positive int, got 0"),
    ({"steps": 2.5}, "steps must be a positive int, got 2.5"),
    ({"steps": True}, "steps must be a positive int, got True"),
    ({"eval_every": -1}, "eval_every must be an int >= 0"),
    ({"eval_size": 0}, "eval_size must be positive when eval_every > 0"),
    ({"checkpoint_every": -5}, "checkpoint_every must be an int >= 0"),
    ({"keep_checkpoints": 0}, "keep_checkpoints must be a positive int, got 0"),
    ({"logits_chunk_size": -3}, "logits_chunk_size must be a nonnegative int .*got -3"),
    ({"num_threads": 0}, "num_threads must be None or a positive int, got 0"),
    ({"seed": -1}, "seed must be an int >= 0"),
    ({"sft_target_accuracy": 1.5}, "sft_target_accuracy must be a finite number in"),
    (
        {"sft_eval_temperature": -1.0},
        "sft_eval_temperature must be a finite number >= 0",
    ),
    ({"sft_batch_size": 0}, "sft_batch_size must be a positive int"),
    ({"tiny_hidden_size": 0}, "tiny_hidden_size must be a positive int"),
    (
        {"rollout_max_batch_size": 0},
        "rollout_max_batch_size must be None or a positive",
    ),
    ({"vllm_gpu_memory_utilization": 0.0}, "vllm_gpu_memory_utilization must be"),
    ({"mismatch": "bf16"}, "mismatch 'bf16' needs backend 'mismatch'"),
    ({"backend": "mismatch", "mismatch": "drift"}, "mismatch must be one of"),
    (
        {"backend": "mismatch", "mismatch": "top_p", "mismatch_scale": 1.5},
        "mismatch_scale for mismatch 'top_p' is the nucleus mass",
    ),
    (
        {"backend": "mismatch", "mismatch": "temperature", "mismatch_scale": 0.0},
        "mismatch_scale for mismatch 'temperature' .* must be > 0",
    ),
    (
        {"backend": "mismatch", "mismatch": "noise", "mismatch_scale": -0.1},
        "mismatch_scale for mismatch 'noise' .* must be >= 0",
    ),
    (
        {"backend": "mismatch", "mismatch": "bf16", "mismatch_scale": 0.5},
        "mismatch_scale must be None for mismatch 'bf16'",
    ),
    (
        {"backend": "mismatch", "mismatch": "stale", "mismatch_sync_every": 0},
        "mismatch_sync_every must be a positive int",
    ),
    (
        {"backend": "mismatch", "mismatch": "noise", "mismatch_sync_every": 3},
        "mismatch_sync_every applies to mismatch 'stale' only",
    ),
    ({"task": "reversal"}, "task must be one of"),
    (
        {"task_options": {"digits": 5}},
        r"task_options holds unknown option\(s\) \['digits'\] for task 'reverse'",
    ),
    ({"task_options": [5]}, "task_options must be a dict"),
    ({"model": ""}, "model must be a non-empty string"),
    ({"dtype": "float64"}, "dtype must be one of"),
    ({"autocast_dtype": "float32"}, "autocast_dtype must be one of"),
    ({"backend": "sglang"}, "backend must be one of"),
    (
        {"backend": "vllm", "device": "mps"},
        "backend 'vllm' needs a CUDA device or the CPU .* got device 'mps'",
    ),
    # vLLM's CPU attention has no kernel for head size 16 / 4 = 4.
    (
        {"backend": "vllm", "tiny_hidden_size": 16},
        "model 'tiny' with tiny_hidden_size 16 has attention head size 4",
    ),
    ({"device": "gpu0"}, "device must be a torch device"),
    # The GRPO family's options: each refused where it enters.
    (
        {"group_size": 1, "baseline": "leave_one_out"},
        "group_size must be at least 2 with baseline 'leave_one_out'",
    ),
    (
        {"group_size": 1, "baseline": "none"},
        "group_size must be at least 2 with advantage_normalizer 'std'",
    ),
    (
        {
            "rollout_batch_size": 1,
            "train_batch_size": 1,
            "group_size": 1,
            "baseline": "none",
            "advantage_normalizer": "batch_std",
        },
        "rollout_batch_size must be at least 2 with advantage_normalizer 'batch_std'",
    ),
    ({"nan_rewards": "drop"}, "nan_rewards must be one of"),
    ({"cliprange_high": -0.1}, r"cliprange_high must be None .*or a positive number"),
    (
        {
            "train_batch_size": 128,
            "importance_reweighting_method": "grpo",
            "cliprange": 0.2,
            "ratio_cap": 1.1,
        },
        r"ratio_cap must be None \(no cap\) or a finite number above the upper clip "
        r"bound 1.2, got 1.1",
    ),
    (
        {
            "train_batch_size": 128,
            "importance_reweighting_method": "cispo",
        },
        "cliprange must be positive for 'cispo', got None",
    ),
    ({"sapo_temperature_neg": 0.0}, "sapo_temperature_neg must be a finite number > 0"),
    ({"kl_coef": -0.1}, "kl_coef must be a finite number >= 0"),
    ({"kl_coef": float("nan")}, "kl_coef must be a finite number >= 0"),
    ({"kl_estimator": "k4"}, "kl_estimator must be one of"),
    ({"entropy_coef": -0.01}, "entropy_coef must be a finite number >= 0"),
    (
        {"top_entropy_quantile": 0.0},
        r"top_entropy_quantile must be a number in \(0, 1\]",
    ),
    (
        {"top_entropy_quantile": 1.2},
        r"top_entropy_quantile must be a number in \(0, 1\]",
    ),
    # dynamic sampling and length
    ({"dynamic_sampling_max_rounds": 0}, "dynamic_sampling_max_rounds must be a"),
    ({"dynamic_sampling": 1}, "dynamic_sampling must be True or False"),
    (
        {"dynamic_sampling": True, "baseline": "none", "advantage_normalizer": "none"},
        "dynamic_sampling needs a group baseline",
    ),
    ({"mask_truncated_completions": "yes"}, "mask_truncated_completions must be"),
    ({"overlong_buffer": 0}, "overlong_buffer must be None or a positive int"),
    (
        {"overlong_buffer": 9, "max_new_tokens": 8},
        r"overlong_buffer must be at most max_new_tokens \(8\)",
    ),
    # max_new_tokens None: the reverse task's own 7 tokens.
    ({"overlong_buffer": 8}, r"overlong_buffer must be at most max_new_tokens \(7\)"),
    ({"overlong_penalty": -0.5}, "overlong_penalty must be a finite number >= 0"),
]


@pytest.mark.parametrize(("overrides", "message"), BAD_SETTINGS)
def test_bad_settings_are_refused_at_construction_naming_the_setting(
    overrides, message
):
    with pytest.raises(ValueError, match=message) as error:
        TrainConfig.for_profile("cpu", **overrides)
    # Every message starts with the setting it is about.
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    assert str(error.value).split()[0] in names


def test_off_policy_settings_are_accepted_with_importance_weights():
    config = TrainConfig.for_profile(
        "cpu", train_batch_size=128, importance_reweighting_method="grpo", cliprange=0.2
    )
    assert config.off_policy and config.update_settings().cliprange == 0.2


def test_config_and_core_give_the_same_message():
    from grpo_lab.train_step import UpdateSettings

    for overrides in ({"temperature": 0.0}, {"logits_chunk_size": -3}):
        with pytest.raises(ValueError) as from_config:
            TrainConfig.for_profile("cpu", **overrides)
        with pytest.raises(ValueError) as from_core:
            UpdateSettings(**overrides)
        assert str(from_config.value) == str(from_core.value)


# method x schedule x cliprange x normalization x constant x chunk x temperature:
# every combination is either refused by TrainConfig or runs one update.
METHODS = ("none", "noclip", "grpo", "gspo")
SCHEDULES = {"on": {}, "off": {"train_batch_size": 8}}
CLIPRANGES = (None, 0.2, -0.1)
NORMALIZATIONS = ("sequence", "constant")
CONSTANTS = (None, 16, 0)
CHUNK_SIZES = (0, 4, -3)
TEMPERATURES = (1.0, 0.7, 0.0, float("nan"))


def _combinations():
    return itertools.product(
        METHODS,
        SCHEDULES,
        CLIPRANGES,
        NORMALIZATIONS,
        CONSTANTS,
        CHUNK_SIZES,
        TEMPERATURES,
    )


def _expected_refusal(method, schedule, cliprange, normalization, constant, chunk, t):
    """The reason a combination cannot run, or None (the rule the test checks)."""
    invalid_number = (cliprange is not None and cliprange <= 0) or constant == 0
    if invalid_number or chunk < 0 or not (t > 0):
        return "a value out of range"
    if method in ("grpo", "gspo") and cliprange is None:
        return "clipping without a clip range"
    if normalization == "constant" and constant is None:
        return "constant normalization without a constant"
    if (schedule == "off") != (method != "none"):
        return "an objective that does not match the schedule"
    return None


def _digit_share_task():
    """The reverse task rewarded by the share of digits in a response: a random
    model's groups then differ, so every update has a signal to step on."""
    from grpo_lab.tasks import ReverseTask

    class DigitShare(ReverseTask):
        def reward_fn(self, response: str, ground_truth: str) -> dict[str, float]:
            share = sum(c.isdigit() for c in response) / max(len(response), 1)
            return {"reward": share, "format_reward": 1.0, "answer_reward": share}

    return DigitShare(n_digits=5)


@pytest.mark.slow
def test_every_combination_is_refused_or_runs_one_step():
    from grpo_lab.training.loop import build_policy, grpo_update, sample_rollout_batch

    base = {"steps": 1, "sft_max_steps": 0, "rollout_batch_size": 16}
    task = _digit_share_task()
    policy = build_policy(TrainConfig.for_profile("smoke", **base))
    accepted = refused = 0
    for combination in _combinations():
        method, schedule, cliprange, normalization, constant, chunk, t = combination
        overrides = {
            **base,
            **SCHEDULES[schedule],
            "importance_reweighting_method": method,
            "cliprange": cliprange,
            "loss_normalization": normalization,
            "normalization_constant": constant,
            "logits_chunk_size": chunk,
            "temperature": t,
        }
        reason = _expected_refusal(*combination)
        if reason is not None:
            with pytest.raises(ValueError):
                TrainConfig.for_profile("smoke", **overrides)
            refused += 1
            continue
        config = TrainConfig.for_profile("smoke", **overrides)
        rollouts, examples = sample_rollout_batch(config, task, policy, 1)
        before = [p.detach().clone() for p in policy.model.parameters()]
        record = grpo_update(config, task, policy, rollouts, examples)
        assert any(
            not torch.equal(a, b) for a, b in zip(before, policy.model.parameters())
        ), combination
        assert record["train/optimizer_steps"] == config.rollout_batch_size // (
            config.train_batch_size
        ), combination
        assert all(math.isfinite(v) for v in record.values() if isinstance(v, float)), (
            combination
        )
        accepted += 1
    # 4 x 2 x 3 x 2 x 3 x 3 x 4 = 1728 combinations; 72 can run.
    assert (accepted, refused) == (72, 1656)


# --- the manual: sections, help text, choices --------------------------------------


def test_every_field_has_a_section_and_whole_help_text():
    fields = dataclasses.fields(TrainConfig)
    sections = [f.metadata["section"] for f in fields]
    assert set(sections) == set(SECTIONS)
    # Fields appear section by section, in the order SECTIONS lists them.
    order = [SECTIONS.index(s) for s in sections]
    assert order == sorted(order)
    for config_field in fields:
        text = config_field.metadata["help"]
        assert len(text) > 15 and text.rstrip().endswith((".", ")")), config_field.name


def test_help_prints_every_field_with_its_whole_text_and_choices():
    parser = argparse.ArgumentParser(
        prog="grpo-lab train",
        # Wide enough that no help line is wrapped (wrapping splits at hyphens).
        formatter_class=lambda prog: argparse.HelpFormatter(prog, width=100_000),
    )
    add_config_arguments(parser)
    text = " ".join(parser.format_help().split())
    for config_field in dataclasses.fields(TrainConfig):
        flag = "--" + config_field.name.replace("_", "-")
        assert flag in text, flag
        assert " ".join(field_help(config_field.name).split()) in text, flag
        for choice in config_field.metadata["choices"]:
            assert str(choice).lower() in text
    # Two-line help texts are printed whole (a reader once kept only the last line).
    assert "Adam's first updates move every weight" in text
    assert "a bfloat16 weight cannot register an update" in text
    assert (
        "{none,noclip,grpo,gspo,cispo,sapo,gmpo,luspo,vespo,dppo_tv,dppo_kl,"
        "clip_cov,kl_cov}" in text
    )
    for section in SECTIONS:
        assert f"{section}:" in text


def test_flags_write_the_same_fields_as_overrides():
    config = parse(
        [
            "--profile", "cpu",
            "--lr", "3e-4",
            "--max-grad-norm", "none",
            "--task-options", '{"n_digits": 4}',
            "--rollout-max-batch-size", "64",
            "--resume",
        ]
    )  # fmt: skip
    expected = TrainConfig.for_profile(
        "cpu",
        lr=3e-4,
        max_grad_norm=None,
        task_options={"n_digits": 4},
        rollout_max_batch_size=64,
        resume=True,
    )
    assert config == expected


def test_flag_values_are_checked():
    with pytest.raises(SystemExit):
        parse(["--baseline", "median"])
    with pytest.raises(SystemExit):
        parse(["--task-options", "[1, 2]"])


# --- honest flags -------------------------------------------------------------------


def test_inert_settings_are_named_with_their_reason():
    assert inert_settings(TrainConfig.for_profile("cpu")) == {}
    gpu = inert_settings(TrainConfig.for_profile("gpu"))
    assert set(gpu) == {"share_prompt_prefix"}
    assert gpu["share_prompt_prefix"].startswith("inert: vLLM samples")
    notes = inert_settings(
        TrainConfig.for_profile(
            "cpu",
            cliprange=0.2,
            normalization_constant=64,
            gradient_checkpointing=True,
        )
    )
    assert notes["cliprange"] == "importance_reweighting_method 'none' does not clip"
    assert "does not use it" in notes["normalization_constant"]
    assert notes["share_prompt_prefix"].startswith("sampling only")
    family = inert_settings(
        TrainConfig.for_profile(
            "cpu",
            cliprange_high=0.28,
            ratio_cap=3.0,
            sapo_temperature_neg=2.0,
            kl_estimator="k1",
            kl_importance_weighting=True,
            loss_normalization="token",
            normalization_constant=64,
        )
    )
    assert family == {
        "cliprange_high": "importance_reweighting_method 'none' does not clip",
        "ratio_cap": "importance_reweighting_method 'none' has no cap",
        "sapo_temperature_neg": "importance_reweighting_method 'none' is not sapo",
        "kl_estimator": "kl_coef is 0: there is no KL penalty",
        "kl_importance_weighting": "kl_coef is 0: there is no KL penalty",
        # token normalization reads no constant: inert, said once, not refused.
        "normalization_constant": "loss_normalization 'token' does not use it",
    }
    members = inert_settings(
        TrainConfig.for_profile(
            "cpu",
            vespo_lambda_pos=2.0,
            covariance_fraction=0.01,
            kl_cov_coef=1.0,
            clip_cov_high=4.0,
            off_policy_mask_threshold=0.5,
        )
    )
    assert members == {
        "vespo_lambda_pos": "importance_reweighting_method 'none' is not vespo",
        "covariance_fraction": (
            "importance_reweighting_method 'none' is not clip_cov or kl_cov"
        ),
        "kl_cov_coef": "importance_reweighting_method 'none' is not kl_cov",
        "clip_cov_high": "importance_reweighting_method 'none' is not clip_cov",
        "off_policy_mask_threshold": (
            "importance_reweighting_method 'none' has no old policy: pi_old is pi, "
            "and every response is kept"
        ),
    }
    dppo = TrainConfig.for_profile(
        "gpu", importance_reweighting_method="dppo_tv", ratio_cap=3.0
    )
    assert "ratio_cap" not in inert_settings(dppo)  # DPPO truncates its weight
    with pytest.raises(ValueError, match=r"vespo_lambda_neg must be a finite number"):
        TrainConfig.for_profile("cpu", vespo_lambda_neg=0.0)  # checked at construction


def test_config_json_records_the_inert_settings_and_reads_back():
    config = TrainConfig.for_profile("gpu", task_options={"path": "train.jsonl"})
    saved = json.loads(config.to_json())
    assert saved["inert_settings"] == inert_settings(config)
    assert TrainConfig.from_dict(saved) == config
    assert TrainConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="unknown TrainConfig field"):
        TrainConfig.from_dict({**config.to_dict(), "learning_rate": 1.0})


def test_training_says_each_inert_setting_once(tmp_path, monkeypatch):
    from grpo_lab.training import loop

    config = TrainConfig.for_profile(
        "smoke", cliprange=0.2, run_dir=str(tmp_path / "run"), steps=1
    )
    monkeypatch.setattr(loop, "_train", lambda config, progress: None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop.train(config, progress=False)
    messages = [str(w.message) for w in caught]
    assert messages == [
        "cliprange has no effect here: importance_reweighting_method 'none' "
        "does not clip"
    ]


def test_choice_lists_are_the_core_registries():
    from grpo_lab import advantages, aggregation, kl, losses, rollouts

    choices = {f.name: f.metadata["choices"] for f in dataclasses.fields(TrainConfig)}
    assert choices["importance_reweighting_method"] is losses.OBJECTIVE_RECORDS
    assert choices["loss_normalization"] is aggregation.LOSS_NORMALIZATIONS
    assert choices["baseline"] is advantages.BASELINES
    assert choices["advantage_normalizer"] is advantages.ADVANTAGE_NORMALIZERS
    assert choices["backend"] is rollouts.BACKEND_RECORDS
    assert choices["nan_rewards"] is advantages.NAN_REWARD_POLICIES
    assert choices["kl_estimator"] is kl.KL_ESTIMATORS
    assert config_module.PROFILES == ("cpu", "gpu", "small-gpu", "smoke")


def test_reward_aggregation_is_a_flag_checked_at_construction_by_the_core():
    from grpo_lab.advantages import REWARD_AGGREGATIONS, check_advantage_settings

    choices = {f.name: f.metadata["choices"] for f in dataclasses.fields(TrainConfig)}
    assert choices["reward_aggregation"] is REWARD_AGGREGATIONS
    assert TrainConfig.for_profile("cpu").reward_aggregation == "reward"
    config = parse(["--profile", "cpu", "--reward-aggregation",
                    "normalize_then_sum_tokens"])  # fmt: skip
    assert config.reward_aggregation == "normalize_then_sum_tokens"
    for overrides in (
        {"reward_aggregation": "max"},
        {"reward_aggregation": "normalize_then_sum", "nan_rewards": "ignore"},
        {"reward_aggregation": "normalize_then_sum_tokens",
         "advantage_normalizer": "token_whiten"},
    ):  # fmt: skip
        with pytest.raises(ValueError) as from_config:
            TrainConfig.for_profile("cpu", **overrides)
        with pytest.raises(ValueError) as from_core:
            check_advantage_settings(
                "mean",
                overrides.get("advantage_normalizer", "std"),
                reward_aggregation=overrides["reward_aggregation"],
                nan_rewards=overrides.get("nan_rewards", "propagate"),
            )
        assert str(from_config.value) == str(from_core.value)


def test_family_settings_are_flags_and_reach_the_update():
    config = parse(
        [
            "--profile", "cpu", "--train-batch-size", "128",
            "--importance-reweighting-method", "grpo", "--cliprange", "0.2",
            "--cliprange-high", "0.28", "--ratio-cap", "3", "--loss-normalization",
            "token", "--kl-coef", "0.01", "--kl-estimator", "k2",
            "--kl-importance-weighting", "--entropy-coef", "0.001",
            "--top-entropy-quantile", "0.2", "--baseline", "leave_one_out",
            "--advantage-normalizer", "batch_std", "--nan-rewards", "ignore",
        ]
    )  # fmt: skip
    settings = config.update_settings()
    assert (settings.cliprange_high, settings.ratio_cap) == (0.28, 3.0)
    assert (settings.kl_coef, settings.kl_estimator) == (0.01, "k2")
    assert settings.kl_importance_weighting and settings.loss_normalization == "token"
    assert (settings.entropy_coef, settings.top_entropy_quantile) == (0.001, 0.2)
    assert (config.baseline, config.advantage_normalizer) == (
        "leave_one_out",
        "batch_std",
    )
    assert config.nan_rewards == "ignore" and inert_settings(config) == {}
    for overrides in ({"kl_coef": -1.0}, {"top_entropy_quantile": 0.0}):
        with pytest.raises(ValueError) as from_config:
            TrainConfig.for_profile("cpu", **overrides)
        from grpo_lab.train_step import UpdateSettings

        with pytest.raises(ValueError) as from_core:
            UpdateSettings(**overrides)
        assert str(from_config.value) == str(from_core.value)


# --- the small-gpu profile and the memory estimate ---------------------------------


def _meta_qwen2_parameters(**sizes) -> int:
    """Parameters of a Qwen2 architecture, built on the meta device (no memory)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            Qwen2Config(vocab_size=151936, tie_word_embeddings=True, **sizes)
        )
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("name", "sizes"),
    [
        (
            "Qwen/Qwen2.5-0.5B-Instruct",
            {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
             "num_attention_heads": 14, "num_key_value_heads": 2},
        ),
        (
            "Qwen/Qwen2.5-Math-1.5B",
            {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
             "num_attention_heads": 12, "num_key_value_heads": 2},
        ),
    ],
)  # fmt: skip
def test_known_parameter_counts_are_the_architectures_counts(name, sizes):
    assert config_module.KNOWN_PARAMETER_COUNTS[name] == _meta_qwen2_parameters(**sizes)


def test_the_memory_estimate_is_the_training_copies_plus_working_share():
    from grpo_lab.models import build_char_tokenizer, build_tiny_qwen2

    model = build_tiny_qwen2(build_char_tokenizer(), hidden_size=32, num_layers=1)
    count = sum(p.numel() for p in model.parameters())
    cpu = TrainConfig.for_profile("cpu")
    # float32 AdamW: weight + gradient + two moments = 16 bytes, plus a quarter.
    assert config_module.training_memory_bytes(cpu, count) == count * 16 * 1.25
    gpu = TrainConfig.for_profile("gpu")  # vLLM takes 30% of the card
    assert config_module.training_memory_bytes(gpu, count) == pytest.approx(
        count * 16 * 1.25 / 0.7
    )
    gib = 2**30
    small = TrainConfig.for_profile("small-gpu")
    small_need = config_module.training_memory_bytes(
        small, config_module.KNOWN_PARAMETER_COUNTS[small.model]
    )
    gpu_need = config_module.training_memory_bytes(
        gpu, config_module.KNOWN_PARAMETER_COUNTS[gpu.model]
    )
    assert 2 * gib < small_need < 4 * gib  # LoRA: fits a 16 GB T4 with room to spare
    assert 40 * gib < gpu_need < 42 * gib  # needs an 80 GB card (or 48 GB)


def test_zero_shards_the_copies_but_not_the_working_share():
    cpu = TrainConfig.for_profile("cpu")
    count = 1_000_000
    estimate = config_module.training_memory_bytes
    assert estimate(cpu, count, sharded=(), gpus=8) == estimate(cpu, count)
    # ZeRO-3 on 8 GPUs, float32: (4 + 4 + 8) / 8 = 2 bytes of copies per
    # parameter, plus the unsharded working share, a quarter of 16 bytes: 4.
    zero3 = ("moments", "gradient", "weight")
    assert estimate(cpu, count, sharded=zero3, gpus=8) == count * (2 + 4)
    # ZeRO-1: 4 + 4 + 8 / 8 = 9 bytes, plus 4.
    assert estimate(cpu, count, sharded=("moments",), gpus=8) == count * (9 + 4)
    # Qwen2.5-Math-1.5B, the gpu profile (vLLM keeps 30% of each GPU): about 13 GB.
    gpu = TrainConfig.for_profile("gpu")
    big = config_module.KNOWN_PARAMETER_COUNTS["Qwen/Qwen2.5-Math-1.5B"]
    per_gpu = estimate(gpu, big, sharded=zero3, gpus=8)
    assert per_gpu == pytest.approx(big * 6 / 0.7)
    assert 13.2e9 < per_gpu < 13.3e9


@pytest.mark.parametrize(
    ("sharded", "gpus", "message"),
    [
        (("optimizer",), 8, "sharded must be a tuple of names"),
        ("moments", 8, "sharded must be a tuple of names"),
        ((), 0, "gpus must be an integer >= 1, got 0"),
        ((), 2.0, "gpus must be an integer >= 1, got 2.0"),
    ],
)
def test_bad_sharding_is_refused_by_name(sharded, gpus, message):
    with pytest.raises(ValueError, match=message):
        config_module.training_memory_bytes(
            TrainConfig.for_profile("cpu"), 10, sharded=sharded, gpus=gpus
        )


@pytest.mark.parametrize(
    ("gigabytes", "profile"), [(15, "small-gpu"), (24, "small-gpu"), (80, "gpu")]
)
def test_the_machine_profile_follows_the_gpu_memory(monkeypatch, gigabytes, profile):
    class Properties:
        total_memory = gigabytes * 10**9

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Properties())
    monkeypatch.delenv("GRPO_LAB_PROFILE", raising=False)
    assert default_profile() == chosen_profile() == profile


def test_small_gpu_profile_is_an_instruct_model_without_vllm_or_bfloat16(
    monkeypatch,
):
    monkeypatch.setattr(config_profiles, "vllm_installed", lambda: False)
    config = TrainConfig.for_profile("small-gpu")
    assert config.model == "Qwen/Qwen2.5-0.5B-Instruct" and config.chat_template
    assert (config.backend, config.dtype, config.autocast_dtype) == (
        "hf",
        "float32",
        "float16",  # with a dynamic loss scale: a T4 has no bfloat16
    )
    assert config.lora_rank == 1 and config.lora_target_modules == "all-linear"
    assert config.gradient_checkpointing and config.logits_chunk_size > 0
    assert config.off_policy and config.importance_reweighting_method == "grpo"


def test_small_gpu_samples_with_vllm_where_it_is_installed(monkeypatch):
    gib = 2**30
    monkeypatch.setattr(config_profiles, "vllm_installed", lambda: False)
    with_hf = TrainConfig.for_profile("small-gpu")
    count = config_module.KNOWN_PARAMETER_COUNTS[with_hf.model]
    hf_need = config_module.training_memory_bytes(with_hf, count)
    monkeypatch.setattr(config_profiles, "vllm_installed", lambda: True)
    config = TrainConfig.for_profile("small-gpu")
    assert (config.backend, config.autocast_dtype) == ("vllm", "float16")
    # vLLM's share: what the hf run's estimate leaves of a 15 GiB T4, in 0.05s.
    share = math.floor((1 - hf_need / (15 * gib)) * 20) / 20
    assert config.vllm_gpu_memory_utilization == share == 0.75
    assert config_module.training_memory_bytes(config, count) <= 15 * gib
    assert "rollout_max_batch_size" not in inert_settings(config)
    assert dataclasses.replace(
        config, backend="hf", vllm_gpu_memory_utilization=0.3,
        rollout_max_batch_size=with_hf.rollout_max_batch_size,
    ) == with_hf  # only the sampler differs  # fmt: skip
    assert TrainConfig.for_profile("small-gpu", backend="hf").backend == "hf"
    assert TrainConfig.for_profile("gpu").vllm_gpu_memory_utilization == 0.3


def test_the_run_says_which_sampler_small_gpu_uses(monkeypatch):
    note = config_profiles.sampler_note
    assert note("gpu", "vllm") is None and note("cpu", "hf") is None
    assert note("small-gpu", "vllm").startswith("small-gpu samples with vllm")
    monkeypatch.setattr(config_profiles, "vllm_installed", lambda: False)
    assert "vLLM is not installed" in note("small-gpu", "hf")
    monkeypatch.setattr(config_profiles, "vllm_installed", lambda: True)
    assert "as asked" in note("small-gpu", "hf")


def test_sampler_correction_needs_a_backend_with_sampler_log_probs(monkeypatch):

    # Every backend today reports sampler log-probs; one that did not is refused.
    hf = dataclasses.replace(BACKEND_RECORDS["hf"], sampler_log_probs=False)
    monkeypatch.setitem(BACKEND_RECORDS, "hf", hf)
    with pytest.raises(ValueError, match=r"^sampler_correction 'token_mask' needs"):
        TrainConfig.for_profile("cpu", sampler_correction="token_mask")
    TrainConfig.for_profile("cpu")  # off: any backend
    config = TrainConfig.for_profile(
        "cpu", sampler_correction_cap=2.0, sampler_correction_high=2.5
    )
    assert config.update_settings().sampler_correction_cap == 2.0
    assert set(inert_settings(config)) == {
        "sampler_correction_cap",
        "sampler_correction_high",
    }


# --- config files, parsed strictly ------------------------------------------------


def read_file(tmp_path, text: str, suffix: str = ".yaml", **options):
    from grpo_lab.cli import main as cli

    path = tmp_path / f"run{suffix}"
    path.write_text(text)
    return cli.read_config_file(path, **options)


def refusal(tmp_path, text: str, suffix: str = ".yaml", **options) -> str:
    from grpo_lab.errors import UserError

    with pytest.raises(UserError) as raised:
        read_file(tmp_path, text, suffix, **options)
    message = str(raised.value)
    assert "\n" not in message
    return message


# Each line parses under PyYAML (YAML 1.1) to something other than what it says
# in YAML 1.2 / JSON, or to what a reader would not expect.
YAML_SURPRISES = [
    ("lr: 0x10\n", "'0x10' is read by YAML 1.1 as the int 16"),
    ("steps: 010\n", "'010' is read by YAML 1.1 as the int 8"),
    ("steps: 0o17\n", "'0o17'"),
    ("steps: 0b101\n", "'0b101' is read by YAML 1.1 as the int 5"),
    ("steps: 1_000\n", "'1_000' is read by YAML 1.1 as the int 1000"),
    ("steps: 1:30\n", "'1:30' is read by YAML 1.1 as the int 90"),
    ("lr: 1_0.5\n", "'1_0.5' is read by YAML 1.1 as the float 10.5"),
    ("chat_template: yes\n", "'yes' is read by YAML 1.1 as the bool True"),
    ("chat_template: no\n", "'no' is read by YAML 1.1 as the bool False"),
    ("gradient_checkpointing: on\n", "'on' is read by YAML 1.1 as the bool True"),
    ("gradient_checkpointing: OFF\n", "'OFF' is read by YAML 1.1 as the bool False"),
    ("task_options:\n  n_digits: 0x5\n", "line 2: '0x5'"),
]


@pytest.mark.parametrize(("text", "message"), YAML_SURPRISES)
def test_yaml_1_1_surprises_are_refused_with_their_line(tmp_path, text, message):
    assert message in refusal(tmp_path, text)


def test_yaml_1_2_spellings_and_quoted_strings_are_read(tmp_path):
    text = (
        "lr: 3e-4\nadam_beta2: 0.95\nsteps: 16\nseed: -0\ngradient_checkpointing: "
        "true\nchat_template: False\nrun_dir: 'yes'\nmax_grad_norm: .inf\n"
    )
    assert read_file(tmp_path, text) == {
        "lr": 3e-4,
        "adam_beta2": 0.95,
        "steps": 16,
        "seed": 0,
        "gradient_checkpointing": True,
        "chat_template": False,
        "run_dir": "yes",
        "max_grad_norm": math.inf,
    }


@pytest.mark.parametrize("value", ["'1_0'", "'0x10'", "'nan'", "' 3'", "'infinity'"])
def test_a_float_string_must_be_decimal_or_scientific(tmp_path, value):
    assert f"lr in config file {tmp_path / 'run.yaml'} must be float" in refusal(
        tmp_path, f"lr: {value}\n"
    )


@pytest.mark.parametrize(
    ("text", "suffix", "message"),
    [
        ("lr: 1.0e-3\nsteps: 4\nlr: 2.0e-3\n", ".yaml", "line 3: key 'lr' is given "
         "twice (lines 1 and 3)"),
        ("task_options:\n  n_digits: 3\n  n_digits: 4\n", ".yaml", "key 'n_digits' "
         "is given twice"),
        ('{"lr": 0.001, "lr": 0.002}', ".json", "key 'lr' is given twice"),
        ('{"task_options": {"a": 1, "a": 2}}', ".json", "key 'a' is given twice"),
    ],
)  # fmt: skip
def test_a_key_given_twice_is_refused(tmp_path, text, suffix, message):
    assert message in refusal(tmp_path, text, suffix)


@pytest.mark.parametrize(
    ("key", "hint"),
    [
        ("learning_rate", "TRL's `learning_rate` is grpo_lab's `lr`"),
        ("num_generations", "TRL's `num_generations` is grpo_lab's `group_size`"),
        ("max_steps", "TRL's `max_steps` is grpo_lab's `steps`"),
        ("beta", "TRL's `beta` is grpo_lab's `kl_coef`"),
        ("epsilon", "TRL's `epsilon` is grpo_lab's `cliprange`"),
        ("group-sise", "did you mean 'group_size'?"),
    ],
)
def test_an_unknown_key_names_the_nearest_field_or_its_trl_translation(
    tmp_path, key, hint
):
    message = refusal(tmp_path, f"{key}: 1\n")
    assert f"unknown key {key!r}" in message and hint in message
    if key in ("learning_rate", "max_steps"):
        assert "--from-trl" in message


def test_trl_names_as_flags_get_their_grpo_lab_flag(capsys):
    from grpo_lab.cli import main as cli

    with pytest.raises(SystemExit) as raised:
        cli.main(["train", "--learning-rate", "1e-4", "--num_generations=4"])
    assert raised.value.code == 2
    error = capsys.readouterr().err
    # learning_rate is lr, or lora_lr for a run that trains adapters.
    assert "TRL's `learning_rate` is grpo_lab's `lr` (AdamW (torch)) and " in error
    assert "`lora_lr` (lora_rank > 0: learning_rate): use --lr" in error
    assert "TRL's `num_generations` is grpo_lab's `group_size`" in error
    assert "use --group-size" in error


TRL_FILE = """\
learning_rate: 1.0e-4
num_generations: 4
per_device_train_batch_size: 16
gradient_accumulation_steps: 2
generation_batch_size: 64
num_iterations: 1
max_steps: 20
beta: 0.04
epsilon: 0.2
epsilon_high: 0.28
loss_type: dapo
scale_rewards: group
max_grad_norm: 0
temperature: 1.0
"""


def test_from_trl_translates_a_trl_style_file_through_the_table(tmp_path):
    from grpo_lab.integrations.trl.translation import to_trl_config

    values = read_file(tmp_path, TRL_FILE, from_trl=True)
    assert values == {
        "lr": 1e-4,
        "group_size": 4,
        "train_batch_size": 32,  # 16 per device x 2 accumulation steps
        "gradient_accumulation_steps": 2,
        "rollout_batch_size": 64,
        "epochs_per_rollout_batch": 1,
        "steps": 10,  # 20 optimizer steps / (64 / 32 x 1) per rollout batch
        "kl_coef": 0.04,
        "cliprange": 0.2,
        "cliprange_high": 0.28,
        "loss_normalization": "token",
        "advantage_normalizer": "std",
        "max_grad_norm": None,
        "temperature": 1.0,
        "importance_reweighting_method": "grpo",  # off-policy: TRL's clip
    }
    config = TrainConfig.for_profile("cpu", **values, sft_max_steps=0)
    back = to_trl_config(config)
    for name, value in _trl_values().items():
        assert back[name] == value, name


def _trl_values() -> dict:
    import yaml

    values = yaml.safe_load(TRL_FILE)
    values["max_grad_norm"] = 0.0
    return values


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("output_dir: out\n", "TRL's `output_dir` has no grpo_lab counterpart"),
        ("optim: sgd\n", "TRL's `optim` 'sgd' has no grpo_lab counterpart here"),
        ("top_k: 50\n", "TRL's `top_k` 50 has no grpo_lab counterpart here"),
        ("max_steps: 7\nper_device_train_batch_size: 8\ngeneration_batch_size: 16\n",
         "TRL's `max_steps` 7 is not a whole number of GRPO steps of 2"),
        ("learning_rate: 0x10\n", "'0x10' is read by YAML 1.1"),
    ],
)  # fmt: skip
def test_from_trl_refuses_what_the_table_cannot_carry(tmp_path, text, message):
    assert message in refusal(tmp_path, text, from_trl=True)


def test_from_trl_reaches_train_and_export(tmp_path):
    from grpo_lab.cli import main as cli

    path = tmp_path / "trl.yaml"
    path.write_text("learning_rate: 2.0e-4\nnum_generations: 4\nmax_steps: 3\n")
    for command in (["train"], ["export", "trl", "--out", str(tmp_path / "out")]):
        arguments = cli.build_parser().parse_args(
            [*command, "--config", str(path), "--from-trl", "--profile", "cpu"]
        )
        config = cli.train_config(arguments)
        assert (config.lr, config.group_size, config.steps) == (2e-4, 4, 3)


# --- one parser per setting ------------------------------------------------------------


def test_a_flag_and_a_config_file_value_go_through_one_parser():
    assert field_value("lr", "3e-4", from_text=True) == 3e-4  # a flag's text
    assert field_value("lr", "3e-4") == 3e-4  # a YAML 1.1 string in a file
    assert field_value("lr", 3e-4) == 3e-4
    assert field_value("max_grad_norm", "none", from_text=True) is None
    assert field_value("report_to", "none", from_text=True) is None  # str | list
    assert field_value("task_options", '{"n": 1}', from_text=True) == {"n": 1}
    assert field_value("steps", 16) == 16
    with pytest.raises(ValueError, match="invalid literal for int"):
        field_value("steps", "sixteen", from_text=True)
    with pytest.raises(ValueError, match=r"^steps in run\.yaml must be int, got True$"):
        field_value("steps", True, where=" in run.yaml")  # a bool is no number
    with pytest.raises(ValueError, match=r"^steps must be int, got '16'$"):
        field_value("steps", "16")  # a file's quoted string stays a string


def test_every_door_refuses_a_device_in_the_same_words(monkeypatch):
    from grpo_lab.training import loop, parsers

    unknown = "device must be a torch device such as 'cpu' or 'cuda:0', got 'gpu'"
    with pytest.raises(ValueError, match=f"^{re.escape(unknown)}$"):
        TrainConfig(device="gpu")
    with pytest.raises(ValueError, match=f"^{re.escape(unknown)}$"):
        parsers.check_device_available("gpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    missing = "device 'cuda:1' is not available: 0 CUDA devices are visible"
    with pytest.raises(ValueError, match=f"^{re.escape(missing)}$"):
        loop.train(TrainConfig.for_profile("smoke", device="cuda:1"), progress=False)
    assert loop.check_device_available is parsers.check_device_available


def test_share_prompt_prefix_takes_auto_from_every_door():
    from grpo_lab.cli.main import build_parser

    assert (
        TrainConfig(share_prompt_prefix="auto").update_settings().share_prompt_prefix
        == "auto"
    )
    for text, value in (("auto", "auto"), ("false", False), ("True", True)):
        arguments = build_parser().parse_args(["train", "--share-prompt-prefix", text])
        assert arguments.share_prompt_prefix == value
    assert field_value("share_prompt_prefix", "auto") == "auto"  # a config file
    assert field_value("share_prompt_prefix", False) is False
    for bad in (1, "yes"):  # 1 == True would pass a plain choices test
        with pytest.raises(
            ValueError, match=r'^share_prompt_prefix must be False, True or "auto"'
        ):
            TrainConfig(share_prompt_prefix=bad)


@pytest.mark.parametrize(
    ("name", "value", "largest"),
    [
        ("seed", 10**23, 2**32 - 1),
        ("steps", 10**9, 10**6),
        ("sft_max_steps", 10**9, 10**6),
    ],
)
def test_counts_past_their_ceiling_are_refused(name, value, largest):
    with pytest.raises(
        ValueError, match=rf"^{name} must be at most {largest} .*got {value}$"
    ):
        TrainConfig(**{name: value})
    assert getattr(TrainConfig(**{name: largest}), name) == largest
