"""A tool-using task on TRL's GRPOTrainer: a ``rollout_func`` that runs
grpo_lab's multi-turn episodes and hands TRL the model-only mask.

TRL 1.16's ``GRPOTrainer(rollout_func=...)`` calls ``rollout_func(prompts,
trainer)`` with the process's prompts (already repeated ``num_generations``
times by its sampler) and expects one completion per prompt::

    {"prompt_ids": [[...]], "completion_ids": [[...]], "logprobs": [[...]],
     "env_mask": [[...]]}

``env_mask`` is TRL's name for "who wrote this token": 1 for the model's own
tokens, 0 for what the environment appended (``trl/trainer/grpo_trainer.py``,
``_generate``: ``tool_mask = extra_fields.pop("env_mask", None)``); TRL's loss
mask is then ``completion_mask * tool_mask``, the same mask as
:func:`grpo_lab.rollouts.multiturn.pad_prompt_and_segment_ids` over the labels.
``logprobs`` holds the sampler's log-prob of each model token and 0.0 at tool
tokens, as TRL's own tool loop pads them. The reward function is the task's
(:func:`grpo_lab.integrations.trl.translation.trl_reward_function`), on the decoded
completion, tool replies included, as grpo_lab grades it.

TRL's ``environment_factory`` is not used: it renders tools through the
tokenizer's chat template (tool-calling templates only), and the calculator's
protocol is plain text tags, as the tiny character model is trained on.
The episodes are sampled by grpo_lab's hf backend on the trainer's own model
(``trainer.model``), so the launch folder trains with TRL's accelerate setup and
grpo_lab's rollout; TRL's vLLM is not used for a tool-using task.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from grpo_lab.rollouts.base import SamplingSettings
from grpo_lab.rollouts.hf import HFRolloutBackend
from grpo_lab.rollouts.multiturn import (
    MultiTurnRolloutBackend,
    MultiTurnRollouts,
    segment_model_flags,
)
from grpo_lab.tasks import get_task, uses_tools

# What the exported rollout_func needs besides the trainer: the episode sampler.
EpisodeSampler = Callable[[list[str], Any], MultiTurnRollouts]


def rollout_func_output(rollouts: MultiTurnRollouts) -> dict[str, list]:
    """Multi-turn rollouts in the dict TRL's ``rollout_func`` returns.

    Row k: ``completion_ids`` = its segments' ids; ``env_mask`` = 1 at model
    tokens, 0 at tool and separator tokens; ``logprobs`` = the sampler's value
    at model tokens, 0.0 elsewhere (one per completion token).
    """
    if not isinstance(rollouts, MultiTurnRollouts):
        raise ValueError(
            f"rollouts must be MultiTurnRollouts, got {type(rollouts).__name__}"
        )
    env_masks, log_probs = [], []
    for row, values in zip(rollouts.segments, rollouts.sampler_log_probs):
        flags = segment_model_flags(row)
        given = iter(values)
        log_probs.append([next(given) if flag else 0.0 for flag in flags])
        env_masks.append(flags)
    return {
        "prompt_ids": [list(ids) for ids in rollouts.prompt_token_ids],
        "completion_ids": [list(ids) for ids in rollouts.response_token_ids],
        "logprobs": log_probs,
        "env_mask": env_masks,
    }


def make_rollout_func(
    sample: EpisodeSampler,
) -> Callable[[list, Any], dict[str, list]]:
    """``rollout_func(prompts, trainer)`` for GRPOTrainer around ``sample``.

    ``sample(prompt_texts, trainer)`` returns one episode per prompt, in order
    (:func:`trainer_episode_sampler` samples them on the trainer's model).
    """

    def rollout_func(prompts: list, trainer: Any) -> dict[str, list]:
        texts = [p["prompt"] if isinstance(p, dict) else p for p in prompts]
        rollouts = sample(texts, trainer)
        if len(rollouts.segments) != len(texts):
            raise RuntimeError(
                f"the episode sampler returned {len(rollouts.segments)} episodes "
                f"for {len(texts)} prompts"
            )
        return rollout_func_output(rollouts)

    return rollout_func


def trainer_episode_sampler(task: Any, seed: int | None = None) -> EpisodeSampler:
    """Episodes of ``task`` sampled on ``trainer.model`` with TRL's settings.

    Temperature, top-p and the episode's token budget
    (``max_completion_length``) are the trainer's arguments; the turn limit,
    per-turn cap and tool are the task's. One episode per prompt (TRL has
    already repeated each prompt ``num_generations`` times).
    """

    def sample(prompts: list[str], trainer: Any) -> MultiTurnRollouts:
        model = trainer.accelerator.unwrap_model(trainer.model)
        backend = MultiTurnRolloutBackend(
            HFRolloutBackend(model, trainer.processing_class),
            task.tool,
            max_turns=task.max_turns,
            max_turn_tokens=task.max_turn_tokens,
        )
        args = trainer.args
        sampling = SamplingSettings(
            temperature=args.temperature,
            top_p=args.top_p,
            max_new_tokens=args.max_completion_length,
            stop_strings=tuple(task.stop_strings),
            seed=None if seed is None else seed + trainer.state.global_step,
        )
        return backend.generate(prompts, 1, sampling)

    return sample


def tool_trainer_keywords(config: Any) -> dict[str, Any]:
    """Extra GRPOTrainer keywords for ``config``'s task: ``rollout_func`` for a
    tool-using task, nothing otherwise (the launch folder's train.py)."""
    if not uses_tools(config.task):
        return {}
    task = get_task(config.task, **config.task_options)
    sampler = trainer_episode_sampler(task, seed=config.seed)
    return {"rollout_func": make_rollout_func(sampler)}
