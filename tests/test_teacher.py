"""The distillation teacher of a run: refused by name, counted in memory, trained with."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo_lab.models import build_char_tokenizer, build_tiny_qwen2
from grpo_lab.training.config import TrainConfig, training_memory_bytes
from grpo_lab.training.loop import tiny_model, train
from grpo_lab.training.teacher import teacher_folder, teacher_parameter_count


def save_teacher(folder, characters=None, hidden_size=32):
    """A run folder whose final_model is a tiny model (wider than the smoke
    student's 16) with the character tokenizer."""
    tokenizer = (
        build_char_tokenizer()
        if characters is None
        else build_char_tokenizer(characters)
    )
    model = build_tiny_qwen2(
        tokenizer, hidden_size=hidden_size, num_layers=1, intermediate_size=64, seed=3
    )
    model.save_pretrained(folder / "final_model")
    tokenizer.save_pretrained(folder / "final_model")
    return folder


@pytest.fixture(scope="module")
def teacher_run(tmp_path_factory):
    return save_teacher(tmp_path_factory.mktemp("teacher"))


def test_a_run_folder_names_its_final_model(teacher_run):
    assert teacher_folder(str(teacher_run)) == str(teacher_run / "final_model")
    folder = str(teacher_run / "final_model")
    assert teacher_folder(folder) == folder


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"distillation": "loss"}, "teacher and distillation go together"),
        ({"teacher": "TEACHER"}, "teacher and distillation go together"),
    ],
)
def test_teacher_and_distillation_go_together(teacher_run, changes, named):
    changes = {k: str(teacher_run) if v == "TEACHER" else v for k, v in changes.items()}
    with pytest.raises(ValueError, match=named):
        TrainConfig.for_profile("smoke", **changes)


def test_a_teacher_with_another_tokenizer_is_refused_at_construction(tmp_path):
    other = save_teacher(tmp_path, characters="0123456789+-=")
    with pytest.raises(
        ValueError, match=r"teacher .* must share the student's tokenizer"
    ):
        TrainConfig.for_profile("smoke", teacher=str(other), distillation="loss")


def test_a_folder_without_a_model_is_refused(tmp_path):
    with pytest.raises(ValueError, match="holds no model"):
        TrainConfig.for_profile("smoke", teacher=str(tmp_path), distillation="loss")
    with pytest.raises(ValueError, match="is not a folder"):
        TrainConfig.for_profile(
            "smoke", teacher=str(tmp_path / "missing"), distillation="loss"
        )


def test_memory_counts_the_teacher(teacher_run):
    plain = TrainConfig.for_profile("smoke")
    distilled = TrainConfig.for_profile(
        "smoke", teacher=str(teacher_run), distillation="reward",
        distillation_estimator="k1",
    )  # fmt: skip
    count = teacher_parameter_count(str(teacher_run))
    saved = json.loads((teacher_run / "final_model" / "config.json").read_text())
    # Embedding and head (untied or tied) of a vocabulary of the saved size.
    assert count >= saved["vocab_size"] * saved["hidden_size"]
    extra = training_memory_bytes(distilled, 1000) - training_memory_bytes(plain, 1000)
    assert math.isclose(extra, count * 4)  # float32 weights, no gradient or moments
    assert training_memory_bytes(
        distilled, 1000, teacher_parameter_count=10
    ) == pytest.approx(training_memory_bytes(plain, 1000) + 40)


@pytest.mark.slow
@pytest.mark.parametrize("task_reward", [False, True])
def test_a_distilled_run_trains_the_student_on_the_teachers_kl(
    teacher_run, tmp_path, task_reward
):
    """A smoke run with the teacher (no warm-up, so the student starts from its
    seeded weights): every step steps the optimizer (the teacher's KL moves rows
    whose task rewards are all equal), logs the KL, and the student's weights
    move while the teacher's stay."""
    config = TrainConfig.for_profile(
        "smoke", teacher=str(teacher_run), distillation="reward",
        distillation_estimator="k1", distillation_task_reward=task_reward,
        run_dir=str(tmp_path / "run"), eval_every=0, sft_max_steps=0,
    )  # fmt: skip
    teacher_weights = (teacher_run / "final_model" / "model.safetensors").read_bytes()
    history = train(config, progress=False).history
    steps = [line for line in history if line.get("step", 0) >= 1]
    assert len(steps) == config.steps
    for line in steps:
        assert line["train/optimizer_steps"] == 1
        assert line["loss/gradient_norm"] > 0
        assert line["loss/distillation_kl_mean"] != 0
        assert line["loss/teacher_log_prob_mean"] < 0
    assert (teacher_run / "final_model" / "model.safetensors").read_bytes() == (
        teacher_weights
    )
    start, _ = tiny_model(config)
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final_model")
    moved = [
        name
        for name, value in final.state_dict().items()
        if not torch.equal(value, start.state_dict()[name])
    ]
    assert moved


def test_the_trl_export_refuses_a_teacher_by_name(teacher_run):
    """TRL's GRPOConfig has no teacher: its translation names the field (the
    export writes a DistillationTrainer folder instead,
    tests/test_trl_distillation_export.py)."""
    from grpo_lab.errors import UserError
    from grpo_lab.integrations.trl.translation import to_trl_config

    config = TrainConfig.for_profile(
        "smoke", teacher=str(teacher_run), distillation="reward",
        distillation_estimator="k1",
    )  # fmt: skip
    with pytest.raises(UserError, match="teacher"):
        to_trl_config(config)


def test_distillation_knobs_without_a_teacher_are_named_inert():
    from grpo_lab.training.config import inert_settings

    config = TrainConfig.for_profile("smoke", distillation_coef=0.5)
    assert inert_settings(config) == {
        "distillation_coef": "distillation is 'none': there is no teacher"
    }
