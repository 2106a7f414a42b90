"""The frozen teacher of on-policy distillation: where it is, its tokenizer, its model.

``TrainConfig.teacher`` names a run folder (its ``final_model``), a
``save_pretrained`` folder or a hub name. The teacher scores the student's own
sampled token ids, so both must read the same ids as the same strings: their
vocabularies must be equal. A local teacher is checked when the config is built
(:func:`check_teacher`); a hub teacher, whose files may not be here yet, when
its tokenizer loads at the start of the run, before any step. Taught in
``notebooks/15_on_policy_distillation.ipynb``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from grpo_lab.models import build_char_tokenizer, load_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from grpo_lab.training.config.fields import TrainFields

FINAL_MODEL_DIR = "final_model"


def teacher_folder(teacher: str) -> str:
    """The loadable folder of ``teacher``: a run folder's ``final_model``, else
    ``teacher`` itself (a ``save_pretrained`` folder or a hub name)."""
    final = Path(teacher) / FINAL_MODEL_DIR
    return str(final) if (final / "config.json").exists() else teacher


def is_local(teacher: str) -> bool:
    """Whether ``teacher`` is a folder on this machine."""
    return Path(teacher).is_dir()


def student_tokenizer(config: TrainFields) -> PreTrainedTokenizerBase:
    """The tokenizer the student of ``config`` will have."""
    if config.model == "tiny":
        return build_char_tokenizer()
    return load_tokenizer(config.model)


def check_teacher(config: TrainFields) -> None:
    """``teacher`` and ``distillation`` go together; a local teacher exists,
    holds a model, and shares the student's vocabulary (a hub teacher is
    checked when it loads, :func:`load_teacher`)."""
    if (config.teacher is None) != (config.distillation == "none"):
        raise ValueError(
            "teacher and distillation go together: a teacher needs distillation "
            "'loss' or 'reward', and distillation needs a teacher; got teacher "
            f"{config.teacher!r} and distillation {config.distillation!r}"
        )
    if config.teacher is None:
        return
    if not isinstance(config.teacher, str) or not config.teacher:
        raise ValueError(
            f"teacher must be a run folder, a model folder or a hub name, got "
            f"{config.teacher!r}"
        )
    if not is_local(config.teacher):
        if Path(config.teacher).exists() or config.teacher.startswith((".", "/")):
            raise ValueError(
                f"teacher must be a run folder, a model folder or a hub name; "
                f"{config.teacher!r} is not a folder"
            )
        return
    folder = teacher_folder(config.teacher)
    if not (Path(folder) / "config.json").exists():
        raise ValueError(
            f"teacher {config.teacher!r} holds no model: expected a run folder "
            f"with {FINAL_MODEL_DIR}/config.json or a save_pretrained folder"
        )
    check_same_vocabulary(load_tokenizer(folder), student_tokenizer(config), folder)


def check_same_vocabulary(
    teacher: PreTrainedTokenizerBase, student: PreTrainedTokenizerBase, name: str
) -> None:
    """The teacher reads every id as the student does: the same number of ids,
    each decoding to the same text (a saved tokenizer may spell its tokens in
    another alphabet, such as byte-level, and still read the same)."""
    teacher_texts, student_texts = _id_texts(teacher), _id_texts(student)
    if teacher_texts == student_texts:
        return
    differ = [
        (index, theirs, ours)
        for index, (theirs, ours) in enumerate(zip(teacher_texts, student_texts))
        if theirs != ours
    ][:3]
    raise ValueError(
        f"teacher {name!r} must share the student's tokenizer: it has "
        f"{len(teacher_texts)} token ids, the student {len(student_texts)}, and "
        f"(id, teacher's text, student's text) differ at {differ}"
    )


def _id_texts(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """The text of each token id, in id order."""
    return tokenizer.batch_decode([[index] for index in range(len(tokenizer))])


def load_teacher(
    config: TrainFields, student: PreTrainedTokenizerBase
) -> PreTrainedModel:
    """The teacher of ``config`` on the run's device and dtype, in eval mode,
    without gradient; its vocabulary checked against the ``student``'s."""
    from transformers import AutoModelForCausalLM

    folder = teacher_folder(config.teacher)
    check_same_vocabulary(load_tokenizer(folder), student, folder)
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=getattr(torch, config.dtype)
    )
    model.to(config.device)
    model.eval()
    model.requires_grad_(False)
    return model


def teacher_parameter_count(teacher: str | None) -> int | None:
    """Parameters of a local teacher, from its config on the meta device (None:
    no teacher, or a hub teacher not on this machine)."""
    if teacher is None or not is_local(teacher):
        return None
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = teacher_folder(teacher)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    return sum(parameter.numel() for parameter in model.parameters())
