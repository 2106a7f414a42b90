"""TrainConfig: profiles, overrides, validation, and the generated command line."""

from __future__ import annotations

import argparse
import dataclasses
import inspect

import pytest
import torch

from grpo_lab.training import config as config_module
from grpo_lab.training.config import (
    TrainConfig,
    add_config_arguments,
    config_from_arguments,
    default_profile,
)


def parse(flags: list[str]) -> TrainConfig:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    return config_from_arguments(parser.parse_args(flags))


def test_cpu_profile_is_the_tiny_reverse_run():
    config = TrainConfig.for_profile("cpu")
    assert (config.profile, config.model, config.task) == ("cpu", "tiny", "reverse")
    assert config.rollout_batch_size == 32 * 8 and config.group_size == 8
    assert config.prompts_per_step == 32
    assert config.backend == "hf" and config.device == "cpu"
    assert config.temperature == 1.0 and config.max_new_tokens == 7
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


def test_overrides_apply_and_unknown_ones_are_named():
    config = TrainConfig.for_profile("cpu", lr=3e-4, steps=5)
    assert (config.lr, config.steps) == (3e-4, 5)
    with pytest.raises(ValueError, match="learning_rate"):
        TrainConfig.for_profile("cpu", learning_rate=3e-4)
    with pytest.raises(ValueError, match="profile must be one of"):
        TrainConfig.for_profile("tpu")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"group_size": 3}, "group_size must divide rollout_batch_size"),
        ({"train_batch_size": 96}, "train_batch_size must divide rollout_batch_size"),
        ({"gradient_accumulation_steps": 3}, "gradient_accumulation_steps must divide"),
        ({"train_batch_size": 128}, "importance_reweighting_method must be"),
        ({"epochs_per_rollout_batch": 2}, "importance_reweighting_method must be"),
        ({"baseline": "median"}, "baseline must be one of"),
        ({"loss_normalization": "constant"}, "normalization_constant must be positive"),
        ({"temperature": 0.0}, "temperature must be positive"),
        ({"steps": 0}, "steps must be positive"),
        ({"eval_every": -1}, "eval_every must be >= 0"),
    ],
)
def test_bad_settings_raise(overrides, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig.for_profile("cpu", **overrides)


def test_off_policy_settings_are_accepted_with_importance_weights():
    config = TrainConfig.for_profile(
        "cpu", train_batch_size=128, importance_reweighting_method="grpo", cliprange=0.2
    )
    assert config.off_policy


def test_every_field_has_a_comment_line_above_it():
    lines = inspect.getsource(TrainConfig).splitlines()
    names = {field.name for field in dataclasses.fields(TrainConfig)}
    for index, line in enumerate(lines):
        name = line.strip().split(":")[0]
        if name in names and line.startswith("    ") and not line.startswith("     "):
            assert lines[index - 1].strip().startswith("# "), name


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


def test_profile_flag_defaults_to_the_machine(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_profile() == "cpu"
    assert parse([]).profile == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert default_profile() == "gpu"


def test_json_round_trip():
    config = TrainConfig.for_profile("gpu", task_options={"path": "train.jsonl"})
    assert TrainConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="unknown TrainConfig field"):
        TrainConfig.from_dict({**config.to_dict(), "learning_rate": 1.0})


def test_profiles_only_name_real_fields():
    names = {field.name for field in dataclasses.fields(TrainConfig)}
    assert set(config_module.CPU_DEFAULTS) <= names
    assert set(config_module.GPU_DEFAULTS) <= names
