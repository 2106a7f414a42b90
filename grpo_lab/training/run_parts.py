"""What a run builds from its settings alone: the tiny model, the task, the seed
of each draw, the sampling settings, autocast.

The training loop and the asynchronous rollout worker
(:mod:`grpo_lab.training.async_rollouts`) each build their own from the same
``TrainConfig``, so both sides of an asynchronous run sample the same prompts
with the same seeds as the synchronous loop. Taught with the loop in
``notebooks/08_training_loop.ipynb``.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo_lab.models import build_char_tokenizer, build_tiny_qwen2
from grpo_lab.rollouts.base import SamplingSettings
from grpo_lab.tasks import get_task
from grpo_lab.tasks.base import Task
from grpo_lab.tasks.chat import ChatPromptTask
from grpo_lab.training.config import TrainConfig


def build_task(config: TrainConfig, tokenizer: PreTrainedTokenizerBase) -> Task:
    """The task, its prompts in the tokenizer's chat template when asked."""
    task = get_task(config.task, **config.task_options)
    return ChatPromptTask(task, tokenizer) if config.chat_template else task


def tiny_model(
    config: TrainConfig,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The "tiny" model of ``config``'s sizes and seed, and its character tokenizer."""
    tokenizer = build_char_tokenizer()
    model = build_tiny_qwen2(
        tokenizer,
        hidden_size=config.tiny_hidden_size,
        num_layers=config.tiny_num_layers,
        intermediate_size=config.tiny_intermediate_size,
        seed=config.seed,
    )
    return model, tokenizer


def derived_seed(config: TrainConfig, purpose: str, step: int) -> int:
    """A seed for one purpose at one step, fixed by ``config.seed`` alone."""
    return random.Random(f"{config.seed}/{purpose}/{step}").randrange(2**31)


def sampling_settings(
    config: TrainConfig, task: Task, seed: int | None, temperature: float | None = None
) -> SamplingSettings:
    """Rollout sampling: config temperature/top-p, the task's stop strings."""
    return SamplingSettings(
        temperature=config.temperature if temperature is None else temperature,
        top_p=config.top_p,
        max_new_tokens=config.max_new_tokens or task.max_new_tokens,
        stop_strings=tuple(task.stop_strings),
        seed=seed,
    )


@contextlib.contextmanager
def autocast(config: TrainConfig) -> Iterator[None]:
    """``torch.autocast`` to ``config.autocast_dtype``, or nothing when unset."""
    if config.autocast_dtype is None:
        yield
        return
    device_type = torch.device(config.device).type
    with torch.autocast(device_type, dtype=getattr(torch, config.autocast_dtype)):
        yield
