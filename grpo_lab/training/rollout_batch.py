"""A rollout batch made ready for the update: graded, tokenized, scored.

The steps of :func:`grpo_lab.training.loop.train` between sampling and the
policy-gradient update: each response's reward (graded once, timeouts counted,
a non-finite reward refused), its token ids and lengths, the old and reference
log-probs scored without gradient, the sampler's log-probs, and the metrics of
the batch. Taught with the loop in ``notebooks/08_training_loop.ipynb``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from grpo_lab.errors import UserError
from grpo_lab.masks import pad_prompt_and_response_ids, tokenize_prompt_and_output
from grpo_lab.rollouts.base import (
    Rollouts,
)
from grpo_lab.rollouts.multiturn import (
    MultiTurnRollouts,
    multi_turn_token_batch,
)
from grpo_lab.sampler_correction import (
    CORRECTION_KEYS,
    GAP_KEYS,
    sampler_weights_and_metrics,
)
from grpo_lab.tasks.base import Example, Task
from grpo_lab.training.config import TrainConfig
from grpo_lab.training.dynamic_sampling import (
    GradedRollouts,
    replay_reward_fn,
)
from grpo_lab.training.metrics import (
    flatten_metrics,
    mean_metrics,
)
from grpo_lab.training.overlong import (
    end_of_sequence_ids,
    shape_reward_results,
    soft_overlong_punishment,
    truncated_rows,
)
from grpo_lab.training.policy import Policy


def rollout_reward_fn(
    config: TrainConfig,
    task: Task,
    policy: Policy,
    rollouts: Rollouts,
    examples: list[Example],
) -> Callable[[str, str], dict[str, float]]:
    """The task's reward_fn, or a replay of grades already made (graded once).

    Rollouts collected by dynamic sampling carry their grades; with an overlong
    buffer the responses are graded and shaped here, then replayed. Grading
    timeouts are then counted over the kept responses only.
    """
    if isinstance(rollouts, GradedRollouts):
        return replay_reward_fn(rollouts.reward_results, rollouts.responses)
    if config.overlong_buffer is None:
        return task.reward_fn
    results = grade_rollouts(config, task, policy, rollouts, examples)
    return replay_reward_fn(results, rollouts.responses)


def grade_rollouts(
    config: TrainConfig,
    task: Task,
    policy: Policy,
    rollouts: Rollouts,
    examples: list[Example],
) -> list[dict[str, float]]:
    """reward_fn's dict for every response, with DAPO's overlong shaping if set."""
    truths = [e.ground_truth for e in examples for _ in range(config.group_size)]
    results = [
        task.reward_fn(response, truth)
        for response, truth in zip(rollouts.responses, truths, strict=True)
    ]
    if config.overlong_buffer is None:
        return results
    return shape_reward_results(
        results,
        response_token_lengths(rollouts, policy.tokenizer),
        max_length=config.max_new_tokens or task.max_new_tokens,
        buffer=config.overlong_buffer,
        penalty=config.overlong_penalty,
    )


def response_token_lengths(
    rollouts: Rollouts, tokenizer: PreTrainedTokenizerBase
) -> list[int]:
    """Tokens in each response: the sampled ids, else the text re-tokenized."""
    if rollouts.response_token_ids is not None:
        return [len(ids) for ids in rollouts.response_token_ids]
    return [
        len(tokenizer.encode(text, add_special_tokens=False))
        for text in rollouts.responses
    ]


def truncated_responses(
    config: TrainConfig,
    task: Task,
    policy: Policy,
    rollouts: Rollouts,
    lengths: list[int],
) -> torch.Tensor:
    """(B·G,) bool: the responses cut at max_new_tokens (:mod:`.overlong`)."""
    return truncated_rows(
        rollouts.responses,
        rollouts.response_token_ids,
        lengths,
        eos_token_ids=end_of_sequence_ids(
            policy.tokenizer, getattr(policy.model, "generation_config", None)
        ),
        stop_strings=tuple(task.stop_strings),
        max_new_tokens=config.max_new_tokens or task.max_new_tokens,
    )


def length_shaping_metrics(
    config: TrainConfig, task: Task, lengths: list[int]
) -> dict[str, float]:
    """``train/overlong_penalty_mean``: the mean reward added by the shaping."""
    if config.overlong_buffer is None:
        return {}
    terms = soft_overlong_punishment(
        torch.tensor(lengths, dtype=torch.float64),
        config.max_new_tokens or task.max_new_tokens,
        config.overlong_buffer,
    )  # (B·G,)
    return {
        "train/overlong_penalty_mean": config.overlong_penalty * terms.mean().item()
    }


def sampler_log_prob_batch(
    rollouts: Rollouts, response_mask: torch.Tensor
) -> torch.Tensor | None:
    """``rollouts.sampler_log_probs`` as a (B·G, T) tensor aligned with
    ``response_mask`` (0 elsewhere), or None when the backend reported none.

    Row k holds one value per response token of response k, in order (a None
    value, a token the sampler did not score, becomes NaN: weight 1).
    """
    rows = rollouts.sampler_log_probs
    if rows is None:
        return None
    mask = response_mask.bool()  # (B·G, T)
    lengths = mask.sum(dim=1).tolist()
    if len(rows) != len(lengths) or any(
        len(row) != length for row, length in zip(rows, lengths)
    ):
        raise ValueError(
            "rollouts.sampler_log_probs must hold one row per response with one "
            f"value per response token ({lengths}), got rows of "
            f"{[len(row) for row in rows]}"
        )
    values = [math.nan if v is None else v for row in rows for v in row]  # (N,)
    padded = torch.zeros(mask.shape, dtype=torch.float32)  # (B·G, T)
    padded[mask] = torch.tensor(values, dtype=torch.float32)
    return padded


def rollout_sampler_metrics(
    config: TrainConfig,
    batch: dict[str, torch.Tensor],
    old_log_probs: torch.Tensor | None,
    sampler_log_probs: torch.Tensor | None,
    update_records: list[dict[str, Any]],
) -> dict[str, float]:
    """``rollout/`` sampler gap and correction metrics, moved out of the
    update records (they are about the rollout batch, not the loss).

    Off-policy: from ``old_log_probs`` over the whole batch, once. On-policy
    (one update): the update's own, from pi_old = the policy before its step,
    over the responses it scored.
    """
    keys = (*GAP_KEYS, *CORRECTION_KEYS)
    per_update = [{k: r.pop(k) for k in keys if k in r} for r in update_records]
    if sampler_log_probs is None:
        return {}
    if old_log_probs is None:
        return flatten_metrics("rollout", mean_metrics(per_update))
    _, metrics = sampler_weights_and_metrics(
        old_log_probs,
        sampler_log_probs.to(old_log_probs.device),
        batch["response_mask"].to(old_log_probs.device),
        config.sampler_correction,
        config.sampler_correction_cap,
        config.sampler_correction_low,
        config.sampler_correction_high,
    )  # the config checked these once
    return flatten_metrics("rollout", metrics)


def refusing_non_finite_rewards(
    reward_fn: Callable[[str, str], dict[str, float]],
    config: TrainConfig,
    task: Task,
    rollouts: Rollouts,
) -> Callable[[str, str], dict[str, float]]:
    """``reward_fn``, stopping the run at the first reward that is not finite.

    A NaN reward (an unscorable response) is let through when ``nan_rewards`` is
    "ignore" (its group's statistics leave it out); any other NaN, and every
    +-inf, raises a :class:`UserError` naming the task's reward function and the
    sample (its index in the rollout batch, prompt and response), and saying how
    to ignore NaN rewards. Calls are counted in rollout order, as
    ``compute_rollout_rewards`` makes them.
    """
    position = iter(range(len(rollouts.responses)))

    def checked(response: str, ground_truth: str) -> dict[str, float]:
        index = next(position)
        scores = reward_fn(response, ground_truth)
        reward = scores.get("reward") if isinstance(scores, dict) else None
        number = isinstance(reward, (int, float)) and not isinstance(reward, bool)
        if not number or math.isfinite(reward):
            return scores
        if math.isnan(reward) and config.nan_rewards == "ignore":
            return scores
        raise UserError(
            f"task {task.name!r}'s reward function "
            f"({getattr(task.reward_fn, '__qualname__', 'reward_fn')}) returned "
            f"reward {reward!r} for sample {index} of the rollout batch (prompt "
            f"{_clipped(rollouts.prompts[index])}, response {_clipped(response)})",
            _non_finite_reward_fix(reward),
        )

    return checked


def _clipped(text: str, limit: int = 60) -> str:
    """``repr(text)``, cut to about ``limit`` characters (one line)."""
    shown = repr(text)
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


def _non_finite_reward_fix(reward: float) -> str:
    if math.isnan(reward):
        return (
            "set nan_rewards: ignore (--nan-rewards ignore) to leave NaN rewards "
            "out of their group, or make the reward function return a number"
        )
    return (
        "a reward must be finite; nan_rewards: ignore skips only NaN rewards, so "
        "make the reward function return a finite number"
    )


def counting_grading_timeouts(
    reward_fn: Callable[[str, str], dict[str, float]],
) -> tuple[Callable[[str, str], dict[str, float]], dict[str, float]]:
    """``reward_fn``, counting the answers whose grading ran out of time.

    Math rewards report ``"grading_timeout"`` (1.0 when the grading worker was
    stopped before a verdict; such an answer scores 0). The returned dict fills
    with ``{"grading_timeouts": count}`` as the wrapped function is called, and
    stays empty for rewards that never report it (toy tasks log no such key).
    """
    counts: dict[str, float] = {}

    def counted(response: str, ground_truth: str) -> dict[str, float]:
        scores = reward_fn(response, ground_truth)
        if "grading_timeout" in scores:
            counts["grading_timeouts"] = (
                counts.get("grading_timeouts", 0.0) + scores["grading_timeout"]
            )
        return scores

    return counted, counts


def rollout_token_batch(
    rollouts: Rollouts, tokenizer: PreTrainedTokenizerBase
) -> dict[str, torch.Tensor]:
    """input_ids, labels, response_mask (B·G, T) from the sampled token ids.

    Falls back to tokenizing the strings only when the backend gave no ids.
    Multi-turn rollouts mask out what the tools wrote (model tokens only).
    """
    if isinstance(rollouts, MultiTurnRollouts):
        return multi_turn_token_batch(rollouts, tokenizer.pad_token_id)
    if rollouts.prompt_token_ids is None or rollouts.response_token_ids is None:
        return tokenize_prompt_and_output(
            rollouts.prompts, rollouts.responses, tokenizer
        )
    return pad_prompt_and_response_ids(
        rollouts.prompt_token_ids, rollouts.response_token_ids, tokenizer.pad_token_id
    )


def train_batch_rows(config: TrainConfig) -> list[slice]:
    """Consecutive train batches; whole groups each (group_size divides them).

    Prompts are drawn i.i.d., so consecutive slices are already in random order.
    """
    size = config.train_batch_size
    return [
        slice(start, start + size)
        for start in range(0, config.rollout_batch_size, size)
    ]


def response_statistics(
    rollouts: Rollouts, raw_rewards: torch.Tensor, group_size: int
) -> dict[str, float]:
    if rollouts.response_token_ids is not None:
        lengths = [len(ids) for ids in rollouts.response_token_ids]
    else:
        lengths = [len(text) for text in rollouts.responses]
    grouped = raw_rewards.reshape(-1, group_size)  # (n_groups, G)
    all_equal = (grouped == grouped[:, :1]).all(dim=1)  # (n_groups,)
    return {
        "train/response_length": sum(lengths) / len(lengths),
        "train/response_length_max": float(max(lengths)),
        "train/equal_reward_group_fraction": all_equal.float().mean().item(),
        "train/mixed_prompt_group_fraction": _mixed_prompt_groups(
            rollouts.prompts, group_size
        ),
    }


def _mixed_prompt_groups(prompts: list[str], group_size: int) -> float:
    """Share of groups whose G rows do not all carry one prompt (0 when the
    rollouts are prompt-major, as the group statistics assume)."""
    starts = range(0, len(prompts), group_size)
    mixed = [len(set(prompts[i : i + group_size])) > 1 for i in starts]
    return sum(mixed) / len(mixed) if mixed else 0.0
