"""GrpoLabTrainer: TRL's GRPOTrainer with what TRL lacks, and its data and reward.

Imports trl (and torch): the translation table
(``grpo_lab.integrations.trl.translation``) does not, so a config can be
translated without them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from trl import GRPOTrainer

from grpo_lab.advantages import (
    REWARD_COMPONENTS,
    compute_group_normalized_rewards,
    compute_multi_reward_advantages,
)
from grpo_lab.integrations.trl.translation import (
    grpo_lab_trainer_reasons,
    optimizer_steps_per_grpo_step,
)
from grpo_lab.tasks import Task
from grpo_lab.training.config import TrainConfig

if TYPE_CHECKING:
    from datasets import Dataset


# --- data and reward ----------------------------------------------------------------


def task_dataset(
    task: Task, split: str, size: int, seed: int, *, chat_template: bool = False
) -> Dataset:
    """``size`` examples of ``task``'s ``split`` as a ``datasets.Dataset`` with a
    ``prompt`` column (a string, or one user message with ``chat_template``) and
    a ``ground_truth`` column, which TRL hands the reward function."""
    from datasets import Dataset

    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    examples = task.train(size, seed) if split == "train" else task.eval(size, seed)
    prompts: list[Any] = [e.prompt for e in examples]
    if chat_template:
        prompts = [[{"role": "user", "content": p}] for p in prompts]
    truths = [e.ground_truth for e in examples]
    return Dataset.from_dict({"prompt": prompts, "ground_truth": truths})


def trl_reward_function(task: Task, key: str = "reward") -> Callable[..., list[float]]:
    """``task.reward_fn``'s ``key`` with TRL's reward_funcs signature: (prompts,
    completions, ground_truth=..., **kwargs) -> one float per completion."""

    def reward(prompts: list, completions: list, **columns: Any) -> list[float]:
        truths = columns["ground_truth"]
        texts = [_completion_text(c) for c in completions]
        return [float(task.reward_fn(t, g)[key]) for t, g in zip(texts, truths)]

    reward.__name__ = f"{task.name}_{key}"
    return reward


def trl_reward_functions(task: Task, config: TrainConfig) -> list[Callable[..., Any]]:
    """The task's reward, or one function per part when ``reward_aggregation``
    combines them (TRL's ``multi_objective_aggregation``)."""
    if config.reward_aggregation == "reward":
        return [trl_reward_function(task)]
    return [trl_reward_function(task, key) for key in REWARD_COMPONENTS]


def _completion_text(completion: Any) -> str:
    """A plain completion, or the content of a conversational one."""
    if isinstance(completion, str):
        return completion
    return "".join(message["content"] for message in completion)


# --- what TRL lacks -----------------------------------------------------------------


class GrpoLabTrainer(GRPOTrainer):
    """GRPOTrainer with grpo_lab's advantages, constant divisor, warm-up and
    weight decay on every parameter.

    ``train_config`` is the run's TrainConfig. Advantages are recomputed
    from TRL's gathered rewards by
    :func:`grpo_lab.advantages.compute_group_normalized_rewards`; the
    dr_grpo loss is rescaled to sum / normalization_constant over the
    global train batch; the learning rate is lr * min(1, s / warm-up) in
    GRPO step s = optimizer step // optimizer steps per GRPO step + 1.
    """

    def __init__(self, *args: Any, train_config: TrainConfig, **kwargs: Any):
        self.train_config = train_config
        self._rewards_per_func: torch.Tensor | None = None
        super().__init__(*args, **kwargs)

    def _calculate_rewards(self, inputs, prompts, completions, ids):
        rewards = super()._calculate_rewards(inputs, prompts, completions, ids)
        self._rewards_per_func = rewards  # (B_global, n_funcs), NaN: None
        return rewards

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        local = output["advantages"]  # (B_local,)
        rewards = self._gathered_rewards()  # (B_global,)
        group = self.num_generations if self.model.training else None
        advantages = grpo_lab_advantages(
            rewards,
            group or self.num_generations_eval,
            self.train_config,
            per_function=self._rewards_per_func,
        )
        start = self.accelerator.process_index * local.shape[0]
        output["advantages"] = advantages[start : start + local.shape[0]].to(
            device=local.device, dtype=local.dtype
        )
        return output

    def _gathered_rewards(self) -> torch.Tensor:
        per_func = self._rewards_per_func  # (B, n_funcs)
        weights = self.reward_weights.to(per_func.device)
        rewards = (per_func * weights.unsqueeze(0)).nansum(dim=1)  # (B,)
        rewards[torch.isnan(per_func).all(dim=1)] = math.nan
        return rewards

    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        if self.train_config.loss_normalization != "constant":
            return loss
        rows = inputs["completion_ids"].shape[0] * self.accelerator.num_processes
        steps = self.current_gradient_accumulation_steps if model.training else 1
        # dr_grpo divided by rows x length x steps; grpo_lab divides by C.
        scale = rows * steps * self.max_completion_length
        return loss * (scale / self.train_config.normalization_constant)

    def get_decay_parameter_names(self, model) -> list[str]:
        # grpo_lab's AdamW decays every parameter; HF's Trainer would skip
        # biases and norm weights.
        return [name for name, _ in model.named_parameters()]

    def create_scheduler(self, num_training_steps, optimizer=None):
        warmup = self.train_config.lr_warmup_steps
        if warmup == 0 or self.lr_scheduler is not None:
            return super().create_scheduler(num_training_steps, optimizer)
        per_step = optimizer_steps_per_grpo_step(self.train_config)
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer if optimizer is None else optimizer,
            lambda step: min(1.0, (step // per_step + 1) / warmup),
        )
        self._created_lr_scheduler = True
        return self.lr_scheduler


def grpo_lab_advantages(
    rewards: torch.Tensor,
    group_size: int,
    config: TrainConfig,
    *,
    per_function: torch.Tensor | None = None,
) -> torch.Tensor:
    """The run's advantages of TRL's (B,) rewards (NaN: unscorable).

    With ``nan_rewards`` propagate a NaN reward is refused (``RuntimeError``),
    as grpo_lab's step refuses a non-finite loss; TRL would have skipped it.
    ``reward_aggregation`` "normalize_then_sum" reads ``per_function`` (B, K),
    each reward function's rewards (the reward's parts).
    """
    if config.nan_rewards == "propagate" and torch.isnan(rewards).any():
        raise RuntimeError(
            "a reward is NaN (unscorable) and nan_rewards is 'propagate'; set "
            "nan_rewards 'ignore' to give it advantage 0"
        )
    if config.reward_aggregation == "normalize_then_sum":
        advantages, _ = compute_multi_reward_advantages(
            per_function.float(),
            group_size,
            config.baseline,
            config.advantage_eps,
            config.advantage_normalizer,
            reward_aggregation="normalize_then_sum",
        )
        return advantages  # (B,)
    advantages, _ = compute_group_normalized_rewards(
        rewards.float(),
        group_size,
        config.baseline,
        config.advantage_eps,
        config.advantage_normalizer,
        nan_rewards=config.nan_rewards,
    )
    return advantages  # (B,)


def trainer_class_for(config: TrainConfig, *, num_processes: int = 1) -> type:
    """``trl.GRPOTrainer`` when it runs ``config`` exactly, else GrpoLabTrainer.

    GrpoLabTrainer takes one more keyword, ``train_config``.
    """
    if grpo_lab_trainer_reasons(config, num_processes=num_processes):
        return GrpoLabTrainer
    return GRPOTrainer


def peft_config_for(config: TrainConfig) -> Any:
    """The ``peft.LoraConfig`` GRPOTrainer's ``peft_config`` takes for
    ``config``'s adapters (the one grpo_lab trains with), None without."""
    from grpo_lab.lora import peft_lora_config

    settings = config.lora_settings()
    return None if settings is None else peft_lora_config(settings)


def hand_generate_the_tokenizer(trainer: GRPOTrainer) -> None:
    """Make the model's ``generate`` receive the trainer's tokenizer.

    transformers stops at a string (``generation_kwargs`` ``stop_strings``, the
    hf backend's export) only when ``generate`` gets ``tokenizer=``, and
    GRPOTrainer calls ``generate(**inputs, generation_config=...)`` without it.
    The wrapper adds it; nothing changes when no stop string is asked for.
    """
    kwargs = trainer.args.generation_kwargs or {}
    if trainer.use_vllm or not kwargs.get("stop_strings"):
        return
    model = trainer.accelerator.unwrap_model(trainer.model)
    generate = model.generate

    def generate_with_tokenizer(*args: Any, **keywords: Any) -> Any:
        keywords.setdefault("tokenizer", trainer.processing_class)
        return generate(*args, **keywords)

    model.generate = generate_with_tokenizer
