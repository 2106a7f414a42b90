"""An on-policy distillation run on TRL's ``DistillationTrainer``: settings and folder.

TRL 1.16's ``DistillationTrainer`` (``trl/trainer/distillation_trainer.py``) is
a trainer of its own, not a ``GRPOConfig`` setting: the student samples, the
teacher scores, and the loss is a divergence of the two full next-token
distributions chosen by ``beta`` (1: KL(student || teacher), 0: KL(teacher ||
student), between: a generalized JSD). grpo_lab scores the sampled token; the
two agree in expectation over that token (``tests/test_distillation.py``):

    distillation "reward", k1  ->  beta 1 (the same expected gradient)
    distillation "loss",   k2  ->  beta 1 (the same expected gradient)
    distillation "loss",   k3  ->  beta 0 (the same expected gradient)

Everything else is refused by name: another estimator or form, the task reward
beside the teacher (the trainer has no reward function), a coefficient other
than 1, and every GRPO-only setting away from its default (:data:`NO_COUNTERPART`).
:func:`write_launch_folder` writes ``distillation_config.json`` (the
``DistillationConfig`` arguments), ``train_config.json``, ``train.py`` and
README.md, for one process; the tiny model and a local teacher are copied in.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from grpo_lab.errors import UserError
from grpo_lab.integrations.cluster import portable_config
from grpo_lab.integrations.trl.translation import TESTED_TRL_VERSION
from grpo_lab.integrations.unrowed import field_defaults
from grpo_lab.tasks import get_task
from grpo_lab.training.config import TrainConfig
from grpo_lab.training.teacher import teacher_folder

# (distillation, estimator) -> DistillationConfig.beta, where the two agree.
BETAS = {("reward", "k1"): 1.0, ("loss", "k2"): 1.0, ("loss", "k3"): 0.0}
# Settings of a GRPO run the DistillationTrainer has no counterpart for.
NO_COUNTERPART = (
    "importance_reweighting_method",
    "cliprange",
    "cliprange_high",
    "ratio_cap",
    "epochs_per_rollout_batch",
    "kl_coef",
    "entropy_coef",
    "top_entropy_quantile",
    "sampler_correction",
    "dynamic_sampling",
    "overlong_buffer",
    "mask_truncated_completions",
    "lora_rank",
    "backend",
    "autocast_dtype",
    "chat_template",
    "loss_normalization",
)

TRAIN_SCRIPT = '''"""Train train_config.json's run on TRL's DistillationTrainer.

Written for TRL {version}.

    python train.py                                   # see README.md
    python train.py --max-steps 1 --use-cpu           # a dry run
"""

import argparse
import json
from pathlib import Path

from trl import DistillationConfig, DistillationTrainer

from grpo_lab.integrations.cluster import resolve_task_options
from grpo_lab.integrations.trl.trainer import task_dataset
from grpo_lab.models import load_tokenizer
from grpo_lab.tasks import get_task
from grpo_lab.training.config import TrainConfig

HERE = Path(__file__).resolve().parent


def local_or_name(name: str) -> str:
    """The folder's own copy (tiny_model/, model/, teacher/), else the name."""
    local = HERE / ("tiny_model" if name == "tiny" else name)
    return str(local) if local.is_dir() else name


def main() -> None:
    parser = argparse.ArgumentParser(description="Train on TRL's DistillationTrainer.")
    parser.add_argument("--max-steps", type=int, help="stop after N optimizer steps")
    parser.add_argument("--use-cpu", action="store_true", help="run on the CPU")
    parser.add_argument("--output-dir", default=str(HERE / "output"))
    options = parser.parse_args()
    config = TrainConfig.from_dict(json.loads((HERE / "train_config.json").read_text()))
    arguments = json.loads((HERE / "distillation_config.json").read_text())
    if options.max_steps is not None:
        arguments["max_steps"] = options.max_steps
    if options.use_cpu:
        arguments.update(use_cpu=True, bf16=False, fp16=False)
    task = get_task(config.task, **resolve_task_options(config.task_options, HERE))
    model = local_or_name(config.model)
    prompts = config.steps * config.prompts_per_step
    dataset = task_dataset(task, "train", prompts, config.seed)
    # Each prompt group_size times in a row: a step samples as grpo_lab's does.
    rows = [row for row in range(len(dataset)) for _ in range(config.group_size)]
    trainer = DistillationTrainer(
        model=model,
        teacher_model=local_or_name(config.teacher),
        args=DistillationConfig(output_dir=options.output_dir, **arguments),
        train_dataset=dataset.select(rows),
        processing_class=load_tokenizer(model),
    )
    trainer.train()
    trainer.save_model(str(Path(options.output_dir) / "final_model"))


if __name__ == "__main__":
    main()
'''


def _refuse(field: str, value: Any, why: str) -> UserError:
    return UserError(
        f"{field} {value!r} cannot run on TRL's DistillationTrainer: {why}",
        "change it, export to verl, or train with grpo_lab",
    )


def check_distillation_run(config: TrainConfig) -> float:
    """The run's beta; a setting the trainer cannot express raises ``UserError``
    naming it."""
    pair = (config.distillation, config.distillation_estimator)
    if pair not in BETAS:
        raise _refuse(
            "distillation_estimator",
            config.distillation_estimator,
            f"with distillation {config.distillation!r} its loss equals no beta of "
            f"TRL's (in expectation: {sorted(BETAS)})",
        )
    if config.distillation_task_reward:
        raise _refuse("distillation_task_reward", True, "it has no reward function")
    if config.distillation_coef != 1.0:
        raise _refuse(
            "distillation_coef", config.distillation_coef, "its loss has no weight"
        )
    defaults = field_defaults(TrainConfig)
    for name in NO_COUNTERPART:
        if getattr(config, name) != defaults[name]:
            raise _refuse(name, getattr(config, name), "it has no counterpart")
    return BETAS[pair]


def to_distillation_config(config: TrainConfig) -> dict[str, Any]:
    """``DistillationConfig`` keyword arguments (without ``output_dir``) for one
    process: ``train_batch_size`` responses per optimizer step (each prompt
    ``group_size`` times in the dataset, one completion each) in
    ``gradient_accumulation_steps`` microbatches."""
    beta = check_distillation_run(config)
    task = get_task(config.task, **config.task_options)
    return {
        "beta": beta,
        "max_steps": config.steps,
        "learning_rate": config.lr,
        "lr_scheduler_type": "constant_with_warmup",
        "warmup_steps": config.lr_warmup_steps,
        "weight_decay": config.weight_decay,
        "adam_beta2": config.adam_beta2,
        "max_grad_norm": config.max_grad_norm,
        "per_device_train_batch_size": (
            config.train_batch_size // config.gradient_accumulation_steps
        ),
        "gradient_accumulation_steps": config.gradient_accumulation_steps,
        "temperature": config.temperature,
        "top_p": config.top_p,
        "max_completion_length": config.max_new_tokens or task.max_new_tokens,
        "seed": config.seed,
        "logging_steps": 1,
        "report_to": "none",
    }


def write_launch_folder(config: TrainConfig, out_dir: str | Path) -> list[Path]:
    """Write ``out_dir`` for one process: train.py, distillation_config.json,
    train_config.json, README.md (tiny_model/ for the tiny model; teacher/ and
    model/ for local folders). Refuses before writing anything."""
    arguments = to_distillation_config(config)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    portable, written = portable_config(config, out_dir)
    teacher = portable.teacher if portable.teacher == "teacher" else None
    if teacher is None:
        portable = TrainConfig.from_dict(
            {**portable.to_dict(), "teacher": teacher_folder(config.teacher)}
        )
    files = {
        out_dir / "distillation_config.json": json.dumps(
            arguments, indent=2, sort_keys=True
        ),
        out_dir / "train_config.json": portable.to_json(),
        out_dir / "train.py": TRAIN_SCRIPT.format(version=TESTED_TRL_VERSION),
        out_dir / "README.md": _readme(config, arguments),
    }
    for path, text in files.items():
        path.write_text(text if text.endswith("\n") else text + "\n")
    written = [*files, *written]
    if config.model == "tiny":
        written.append(_save_tiny_model(config, out_dir / "tiny_model"))
    return written


def _save_tiny_model(config: TrainConfig, folder: Path) -> Path:
    from grpo_lab.training.loop import tiny_model

    model, tokenizer = tiny_model(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _readme(config: TrainConfig, arguments: dict[str, Any]) -> str:
    return (
        "# On-policy distillation on TRL's DistillationTrainer "
        f"(TRL {TESTED_TRL_VERSION})\n\n"
        f"Written by `grpo-lab export trl` from a run with teacher "
        f"`{config.teacher}`, distillation `{config.distillation}` and estimator "
        f"`{config.distillation_estimator}`: TRL's beta {arguments['beta']:g}, "
        "whose full-vocabulary loss has the same expected gradient as grpo_lab's "
        "sampled-token one (docs/translation_table.md).\n\n"
        "```\npip install trl==" + TESTED_TRL_VERSION + " grpo-lab\n"
        "python train.py                           # one process\n"
        "python train.py --max-steps 1 --use-cpu   # a dry run\n```\n"
    )
