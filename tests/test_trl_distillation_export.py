"""``grpo-lab export trl`` of an on-policy distillation run: TRL's DistillationTrainer.

The folder's arguments are built by TRL's own ``DistillationConfig`` and the
written ``train.py`` runs one step of TRL's ``DistillationTrainer`` on the CPU;
what the trainer cannot express is refused by name.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from grpo_lab.errors import UserError
from grpo_lab.models import build_char_tokenizer, build_tiny_qwen2
from grpo_lab.training.config import TrainConfig

trl = pytest.importorskip("trl")


@pytest.fixture(scope="module")
def teacher_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("teacher")
    tokenizer = build_char_tokenizer()
    model = build_tiny_qwen2(tokenizer, hidden_size=32, num_layers=1, seed=3)
    model.save_pretrained(folder / "final_model")
    tokenizer.save_pretrained(folder / "final_model")
    return folder


def opd(teacher_run, **changes) -> TrainConfig:
    values = {"distillation": "reward", "distillation_estimator": "k1", **changes}
    return TrainConfig.for_profile("smoke", teacher=str(teacher_run), **values)


@pytest.mark.parametrize(
    ("form", "estimator", "beta"),
    [("reward", "k1", 1.0), ("loss", "k2", 1.0), ("loss", "k3", 0.0)],
)
def test_the_folder_holds_trls_own_distillation_config(
    teacher_run, tmp_path, form, estimator, beta
):
    from grpo_lab.integrations.trl.launch import write_launch_folder

    config = opd(teacher_run, distillation=form, distillation_estimator=estimator)
    write_launch_folder(config, tmp_path)
    arguments = json.loads((tmp_path / "distillation_config.json").read_text())
    # As train.py --use-cpu builds it (TRL defaults to bf16, which a CPU refuses).
    cpu = {"use_cpu": True, "bf16": False}
    built = trl.DistillationConfig(output_dir=str(tmp_path / "out"), **arguments, **cpu)
    assert built.beta == beta
    assert built.max_steps == config.steps and built.learning_rate == config.lr
    assert (tmp_path / "teacher" / "config.json").exists()  # copied in
    saved = json.loads((tmp_path / "train_config.json").read_text())
    assert saved["teacher"] == "teacher"


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"distillation_estimator": "k3"}, "distillation_estimator 'k3'"),
        ({"distillation_task_reward": True}, "distillation_task_reward True"),
        ({"distillation_coef": 0.5}, "distillation_coef 0.5"),
        ({"kl_coef": 0.1}, "kl_coef 0.1"),
        ({"entropy_coef": 0.01}, "entropy_coef 0.01"),
    ],
)
def test_what_the_trainer_cannot_express_is_refused_by_name(
    teacher_run, tmp_path, changes, named
):
    from grpo_lab.integrations.trl.launch import write_launch_folder

    with pytest.raises(UserError, match=named):
        write_launch_folder(opd(teacher_run, **changes), tmp_path)
    assert not any(tmp_path.iterdir())  # refused before anything is written


def test_several_processes_are_refused(teacher_run, tmp_path):
    from grpo_lab.integrations.trl.launch import write_launch_folder

    with pytest.raises(ValueError, match="--gpus and --nodes must be 1"):
        write_launch_folder(opd(teacher_run), tmp_path, gpus=2)


@pytest.mark.slow
def test_the_written_train_py_runs_a_step_of_trls_distillation_trainer(
    teacher_run, tmp_path
):
    from grpo_lab.integrations.trl.launch import write_launch_folder

    write_launch_folder(opd(teacher_run), tmp_path)
    environment = {**os.environ, "PYTHONPATH": os.getcwd()}
    finished = subprocess.run(
        [sys.executable, "train.py", "--max-steps", "1", "--use-cpu"],
        cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert "'loss'" in finished.stdout + finished.stderr
    assert (tmp_path / "output" / "final_model" / "config.json").exists()
