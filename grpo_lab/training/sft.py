"""Supervised warm-up: teach a random model the answer format before GRPO.

A freshly initialised model almost never samples a correct answer, and GRPO
learns nothing from a group whose rewards are all zero. A few hundred steps of
cross-entropy on demonstrations (the correct response followed by EOS) lift
sampled accuracy to a modest threshold; GRPO does the rest.

    loss = -mean over response tokens of log p(token | prompt, earlier tokens)

Taught in ``notebooks/`` on the training loop.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo_lab.logprobs import get_response_log_probs
from grpo_lab.masks import masked_mean, pad_prompt_and_response_ids
from grpo_lab.rollouts.base import (
    RolloutBackend,
    SamplingSettings,
    load_current_weights,
)
from grpo_lab.rollouts.multiturn import (
    demonstration_segments,
    pad_prompt_and_segment_ids,
)
from grpo_lab.rollouts.tools import CalculatorTool
from grpo_lab.tasks.base import Example, Task
from grpo_lab.training.evaluation import held_out_scores


class WarmUpWarning(UserWarning):
    """The warm-up reached its step cap below its target accuracy."""


@dataclass(frozen=True)
class WarmUpSettings:
    """How long and how hard the supervised warm-up trains."""

    # Most optimizer steps.
    max_steps: int
    # Demonstrations per optimizer step.
    batch_size: int
    # AdamW learning rate.
    lr: float
    # Check sampled accuracy every this many steps.
    eval_every: int
    # Stop once sampled accuracy on ``held_out`` reaches this.
    target_accuracy: float
    # Held-out examples for the accuracy check.
    held_out: list[Example]
    # How the check samples (temperature 0: greedy); a seed is offset by the step.
    sampling: SamplingSettings
    # Step k trains on task.train(batch_size, seed=train_seed + k).
    train_seed: int


def demonstration_batch(
    examples: list[Example],
    tokenizer: PreTrainedTokenizerBase,
    tool: CalculatorTool | None = None,
) -> dict[str, torch.Tensor]:
    """Prompt ids + demonstration ids + EOS, shifted and padded: (B, T) tensors.

    With a ``tool`` (a tool-using task), the tool's replies in the
    demonstration and the tags around them are masked out, as in GRPO
    (:func:`grpo_lab.rollouts.multiturn.demonstration_segments`).
    """
    missing = [example.prompt for example in examples if example.demonstration is None]
    if missing:
        raise ValueError(
            f"examples must carry a demonstration for SFT, got none for {missing[:3]}"
        )
    prompt_ids = [
        tokenizer.encode(example.prompt, add_special_tokens=False)
        for example in examples
    ]
    if tool is not None:
        segments = [
            demonstration_segments(tokenizer, tool, example.demonstration)
            for example in examples
        ]
        return pad_prompt_and_segment_ids(prompt_ids, segments, tokenizer.pad_token_id)
    response_ids = [
        [
            *tokenizer.encode(example.demonstration, add_special_tokens=False),
            tokenizer.eos_token_id,
        ]
        for example in examples
    ]
    return pad_prompt_and_response_ids(prompt_ids, response_ids, tokenizer.pad_token_id)


def sft_step(
    model: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    batch: dict[str, torch.Tensor],
    max_grad_norm: float | None = 1.0,
) -> float:
    """One cross-entropy step on response tokens; returns the loss."""
    device = next(model.parameters()).device
    batch = {key: value.to(device) for key, value in batch.items()}
    model.train()
    optimizer.zero_grad(set_to_none=True)
    log_probs = get_response_log_probs(model, batch["input_ids"], batch["labels"])[
        "log_probs"
    ]  # (B, T)
    loss = -masked_mean(log_probs, batch["response_mask"])
    if not torch.isfinite(loss):
        raise RuntimeError("Non-finite SFT loss; optimizer step aborted")
    loss.backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def warm_up(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    backend: RolloutBackend,
    task: Task,
    settings: WarmUpSettings,
    log: Callable[[dict[str, Any]], None],
) -> list[dict[str, Any]]:
    """SFT until sampled held-out accuracy reaches the target or the step cap.

    Uses its own AdamW (the GRPO optimizer starts fresh afterwards). Each step's
    record (``sft/step``, ``sft/loss``, and on check steps
    ``sft/accuracy_sampled``, or ``sft/accuracy_greedy`` when the check samples
    at temperature 0) goes to ``log`` and is returned. Ending at the step cap
    below the target warns (:class:`WarmUpWarning`): GRPO then starts with few
    right answers, so most groups carry no signal.
    """
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr)
    greedy = settings.sampling.temperature == 0
    accuracy_key = "sft/accuracy_greedy" if greedy else "sft/accuracy_sampled"
    records = []
    for step in range(1, settings.max_steps + 1):
        examples = task.train(settings.batch_size, settings.train_seed + step)
        tool = task.tool if getattr(task, "uses_tools", False) else None
        batch = demonstration_batch(examples, tokenizer, tool)
        loss = sft_step(model, optimizer, batch)
        record: dict[str, Any] = {"sft/step": step, "sft/loss": loss}
        if step % settings.eval_every == 0 or step == settings.max_steps:
            load_current_weights(backend, model)  # vLLM/stale copies lag behind
            record[accuracy_key] = held_out_scores(
                backend, task, settings.held_out, _reseeded(settings.sampling, step)
            ).accuracy
        log(record)
        records.append(record)
        if record.get(accuracy_key, -1.0) >= settings.target_accuracy:
            break
    else:
        if records:  # the last step always checks
            _warn_below_target(records[-1][accuracy_key], settings)
    return records


def _warn_below_target(accuracy: float, settings: WarmUpSettings) -> None:
    warnings.warn(
        f"the warm-up ran all sft_max_steps ({settings.max_steps}) steps and ended "
        f"at held-out accuracy {accuracy:.3f}, below "
        f"sft_target_accuracy ({settings.target_accuracy}); GRPO starts with few "
        "right answers, so most groups carry no signal: raise sft_max_steps or "
        "sft_lr",
        WarmUpWarning,
        stacklevel=3,
    )


def _reseeded(sampling: SamplingSettings, step: int) -> SamplingSettings:
    seed = None if sampling.seed is None else sampling.seed + step
    return dataclasses.replace(sampling, seed=seed)
