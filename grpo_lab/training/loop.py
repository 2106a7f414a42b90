"""The GRPO training loop: ``train(config)``, readable top to bottom.

One step: sample G responses for each of B prompts, score each response once,
normalize rewards within each group into advantages, then take policy-gradient
steps on the very tokens that were sampled. Metrics go to ``metrics.jsonl``
(one flat line per step, also sent to the trackers ``report_to`` names),
held-out accuracy is measured every ``eval_every`` steps, and checkpoints let
an interrupted run continue exactly.

How this departs from textbook GRPO (DeepSeekMath), and why:

1. No KL penalty and no reference model by default (``kl_coef = 0``).
   Recent recipes (DAPO, Dr. GRPO, nanochat) drop it; it costs a second model
   and rarely helps on verifiable rewards. With ``kl_coef > 0`` a frozen copy
   of the policy at step 0 (after the warm-up) is kept, scored once per rollout
   batch without gradient, and beta * KL joins each token's loss.
2. On-policy by default: one optimizer step per rollout batch, so the
   importance ratio is exactly 1 and clipping does nothing. The ratio and the
   PPO clip are used only when training goes off-policy
   (``epochs_per_rollout_batch > 1`` or ``train_batch_size <
   rollout_batch_size``); old log-probs are then scored once, without grad,
   before the first update.
3. Log-probs are scored from logits / temperature, the distribution the
   rollouts were sampled from (as TRL does), not from the raw logits.
4. Training scores the sampled token ids themselves; decoding to text and
   re-tokenizing can change the tokens (only a backend that returns no ids
   falls back to re-tokenizing strings).
5. Groups whose rewards are all equal have zero advantage and contribute no
   policy gradient; they are skipped in the update but still count in the
   divisor (a KL penalty or an entropy bonus moves them too: then they are
   scored).
6. Advantages can drop the std normalization (Dr. GRPO), leave one out (RLOO)
   or drop the baseline; the loss can be averaged per sequence, per token
   (DAPO) or divided by a constant, and the objective is any of
   :data:`grpo_lab.losses.OBJECTIVES` (``notebooks/10_the_grpo_family.ipynb``).
7. The CPU profile starts with a short supervised warm-up (``training/sft.py``):
   a random model never samples a correct answer, and GRPO cannot learn from
   groups that all score 0.
8. Each prompt runs once per group, not once per response, both when sampling
   (its key/value cache is computed once and copied G times) and when scoring
   (``share_prompt_prefix``, :mod:`grpo_lab.prefix_sharing`). The numbers are
   the same; the work on prompt tokens drops G-fold.
9. DAPO's data-side options, off by default (section "dynamic sampling and
   length"): groups with equal rewards dropped and more prompts sampled
   (:mod:`grpo_lab.training.dynamic_sampling`), responses cut at
   ``max_new_tokens`` masked out of the loss or their reward shaped
   (:mod:`grpo_lab.training.overlong`). Each response is still graded once.

Every random draw (prompts, samples, evaluation samples) is seeded from
``(config.seed, purpose, step)``, so a resumed run repeats an uninterrupted
one exactly on CPU. Taught in ``notebooks/`` on the training loop.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import random
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as transformers_logging

from grpo_lab.errors import UserError
from grpo_lab.masks import pad_prompt_and_response_ids, tokenize_prompt_and_output
from grpo_lab.models import build_char_tokenizer, build_tiny_qwen2, load_pretrained
from grpo_lab.rollouts import make_backend
from grpo_lab.rollouts.base import (
    RolloutBackend,
    Rollouts,
    SamplingSettings,
    load_current_weights,
)
from grpo_lab.rollouts.multiturn import (
    MultiTurnRolloutBackend,
    MultiTurnRollouts,
    multi_turn_token_batch,
)
from grpo_lab.sampler_correction import (
    CORRECTION_KEYS,
    GAP_KEYS,
    sampler_correction_weights,
)
from grpo_lab.tasks import get_task, uses_tools
from grpo_lab.tasks.base import Example, Task
from grpo_lab.tasks.chat import ChatPromptTask
from grpo_lab.train_step import (
    policy_gradient_update,
    rollout_advantages,
    score_tokens,
)
from grpo_lab.training import checkpoint as checkpoints
from grpo_lab.training import lora
from grpo_lab.training import run_dir as run_dirs
from grpo_lab.training.config import TrainConfig, inert_settings
from grpo_lab.training.dynamic_sampling import (
    GradedRollouts,
    collect_groups_with_signal,
    replay_reward_fn,
)
from grpo_lab.training.evaluation import held_out_scores
from grpo_lab.training.metrics import (
    append_metrics,
    count_metric_lines,
    flatten_metrics,
    mean_metrics,
    read_metrics,
    truncate_metrics,
)
from grpo_lab.training.overlong import (
    end_of_sequence_ids,
    mask_truncated,
    shape_reward_results,
    soft_overlong_punishment,
    truncated_rows,
    truncation_metrics,
)
from grpo_lab.training.parsers import check_device_available
from grpo_lab.training.sft import WarmUpSettings, warm_up
from grpo_lab.training.trackers import open_trackers

FINAL_MODEL_DIR = "final_model"
# A LoRA run's warmed-up base model, the one its adapters apply to.
BASE_MODEL_DIR = "base_model"
REFERENCE_MODEL_FILE = "reference_model.pt"


@dataclass
class RunResult:
    """Where a run wrote its files, and every metrics line it logged."""

    # The run folder: config.json, metrics.jsonl, checkpoints/, final_model/.
    run_dir: Path
    # The lines of metrics.jsonl (SFT lines carry sft/..., GRPO lines a step).
    history: list[dict[str, Any]]


@dataclass
class Policy:
    """The model being trained and everything that moves with it."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    optimizer: torch.optim.Optimizer
    backend: RolloutBackend
    # The frozen policy of step 0 that a KL penalty pulls towards (None: no KL,
    # or LoRA, whose reference is the base model with the adapters off).
    reference_model: PreTrainedModel | None = None
    # The peft wrapper when the policy trains LoRA adapters (``model`` is the
    # transformers model inside it), else None.
    adapters: Any = None
    # float16 autocast's dynamic loss scale (torch.amp.GradScaler), else None.
    grad_scaler: torch.amp.GradScaler | None = None


def train(config: TrainConfig, progress: bool = True) -> RunResult:
    """Run GRPO as ``config`` says; return the run folder and its metrics."""
    check_device_available(config.device)
    say_inert_settings(config)
    with torch_threads(thread_count(config)):
        return _train(config, progress)


def _train(config: TrainConfig, progress: bool) -> RunResult:
    run_dir = prepare_run_dir(config)
    try:
        return _train_in(dataclasses.replace(config, run_dir=str(run_dir)), progress)
    finally:
        run_dirs.release_run_dir(run_dir)  # the folder is free once train returns


def _train_in(config: TrainConfig, progress: bool) -> RunResult:
    """The run itself, in the locked folder ``config.run_dir``."""
    run_dir = Path(config.run_dir)
    checkpoints.remove_leftover_temporaries(run_dir)  # a killed write's
    policy = build_policy(config)
    task = build_task(config, policy.tokenizer)
    eval_examples = task.eval(config.eval_size, seed=config.seed)
    resuming = config.resume and bool(checkpoints.list_checkpoints(run_dir))
    start_step = resume_or_start(
        config, run_dir, policy, task, eval_examples, progress=progress
    )
    if config.kl_coef > 0 and policy.adapters is None:
        policy.reference_model = reference_model(run_dir, policy, start_step)
    trackers = open_trackers(config, run_dir, start_step if resuming else None)
    completed_step, weights_match_completed_step = start_step, True
    steps = range(start_step + 1, config.steps + 1)
    bar = tqdm(
        total=config.steps, initial=start_step, desc="GRPO", disable=not progress
    )
    try:
        for step in steps:
            started = time.perf_counter()
            set_learning_rate(policy.optimizer, learning_rate_at(config, step))
            rollouts, examples = sample_rollout_batch(config, task, policy, step)
            weights_match_completed_step = False
            record = grpo_update(config, task, policy, rollouts, examples)
            record["time/step_seconds"] = time.perf_counter() - started
            if _evaluation_due(config, step):
                record.update(
                    evaluate(config, task, policy, eval_examples, step, progress)
                )
            append_metrics(run_dir, {"step": step, **record})
            trackers.sync()
            completed_step, weights_match_completed_step = step, True
            if config.checkpoint_every and step % config.checkpoint_every == 0:
                save_checkpoint(config, run_dir, policy, step)
            bar.update(1)
            bar.set_postfix(_progress_summary(record), refresh=False)
    except KeyboardInterrupt:
        if weights_match_completed_step:
            save_checkpoint(config, run_dir, policy, completed_step)
        raise
    finally:
        bar.close()
        trackers.close()
    if not _has_checkpoint(run_dir, completed_step):
        save_checkpoint(config, run_dir, policy, completed_step)
    save_final_model(policy, run_dir / FINAL_MODEL_DIR)
    return RunResult(run_dir=run_dir, history=read_metrics(run_dir))


# --- setting up -------------------------------------------------------------


def thread_count(config: TrainConfig) -> int:
    """Torch CPU threads for this run: ``num_threads``, else 1 for the tiny model.

    The tiny model's matrices are too small to split: extra threads only spin,
    and beside any other busy process (a browser, a Jupyter server) they slow a
    run several-fold. Real models keep torch's default.
    """
    if config.num_threads is not None:
        return config.num_threads
    return 1 if config.model == "tiny" else torch.get_num_threads()


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Torch's intra-op thread count set to ``count`` inside, restored after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def say_inert_settings(config: TrainConfig) -> None:
    """Warn once, at start, about each setting that does nothing in this run."""
    for name, reason in inert_settings(config).items():
        warnings.warn(f"{name} has no effect here: {reason}", stacklevel=3)


def prepare_run_dir(config: TrainConfig) -> Path:
    """Create and lock the run folder, write config.json; refuse to overwrite a run.

    See :mod:`grpo_lab.training.run_dir`: one process per folder, and a resume
    may change only the fields that do not change what a step computes.
    """
    return run_dirs.open_run_dir(config)


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


def build_policy(config: TrainConfig) -> Policy:
    """Model, tokenizer, AdamW and rollout backend, as ``config`` describes."""
    if config.model == "tiny":
        model, tokenizer = tiny_model(config)
    else:
        transformers_logging.disable_progress_bar()
        model, tokenizer = load_pretrained(config.model, dtype=config.dtype)
    model.to(device=config.device, dtype=getattr(torch, config.dtype))
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    model.train()
    adapters = None
    if config.lora_settings() is not None:
        adapters = lora.add_adapters(model, config.lora_settings(), config.seed)
        model = lora.inner_model(adapters)  # the same object, LoRA layers inside
    optimizer = torch.optim.AdamW(
        lora.trainable_parameters(model),  # the adapters only, under LoRA
        lr=config.learning_rate,
        weight_decay=config.weight_decay,
        betas=(0.9, config.adam_beta2),
    )
    backend = with_task_tool(config, build_backend(config, model, tokenizer))
    return Policy(
        model,
        tokenizer,
        optimizer,
        backend,
        adapters=adapters,
        grad_scaler=build_grad_scaler(config),
    )


def build_grad_scaler(config: TrainConfig) -> torch.amp.GradScaler | None:
    """A dynamic loss scale for float16 autocast (float16 gradients underflow
    without one); None for every other precision."""
    if config.autocast_dtype != "float16":
        return None
    return torch.amp.GradScaler(torch.device(config.device).type)


def with_task_tool(config: TrainConfig, backend: RolloutBackend) -> RolloutBackend:
    """``backend`` itself, or for a tool-using task the multi-turn rollout around
    it (the task's tool and turn limit; :mod:`grpo_lab.rollouts.multiturn`)."""
    if not uses_tools(config.task):
        return backend
    task = get_task(config.task, **config.task_options)
    return MultiTurnRolloutBackend(
        backend,
        task.tool,
        max_turns=task.max_turns,
        max_turn_tokens=task.max_turn_tokens,
    )


def build_backend(
    config: TrainConfig, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
) -> RolloutBackend:
    """hf and mismatch wrap the live model; vllm loads its own copy, then syncs."""
    if config.backend == "mismatch":
        return make_backend(
            "mismatch",
            model,
            tokenizer,
            mismatch=config.mismatch,
            scale=config.mismatch_scale,
            sync_every=config.mismatch_sync_every,
            max_batch_size=config.rollout_max_batch_size,
        )
    if config.backend == "hf":
        return make_backend(
            "hf",
            model,
            tokenizer,
            max_batch_size=config.rollout_max_batch_size,
            share_prompt_prefix=config.share_prompt_prefix,
        )
    backend = make_backend(
        "vllm",
        model,
        tokenizer,
        model_name_or_path=config.model,
        dtype=config.autocast_dtype or config.dtype,
        gpu_memory_utilization=config.vllm_gpu_memory_utilization,
        seed=config.seed,
    )
    backend.sync(model)
    return backend


def resume_or_start(
    config: TrainConfig,
    run_dir: Path,
    policy: Policy,
    task: Task,
    eval_examples: list[Example],
    *,
    progress: bool = False,
) -> int:
    """The last completed step: a checkpoint's when resuming, else 0 after warm-up.

    A fresh start runs the supervised warm-up (if configured) and logs a step-0
    evaluation, the accuracy GRPO starts from. A resume never starts over on top
    of logged metrics (:func:`grpo_lab.training.run_dir.checkpoint_to_resume`).
    """
    if config.resume:
        found = run_dirs.checkpoint_to_resume(run_dir, config)
        if found is not None:
            path, payload = found
            state = checkpoints.restore_checkpoint(
                payload,
                path,
                policy.model,
                policy.optimizer,
                grad_scaler=policy.grad_scaler,
            )
            run_dirs.resume_run_dir(run_dir, config, state)
            load_current_weights(policy.backend, policy.model)
            return state.step
        truncate_metrics(run_dir, 0)  # nothing saved or logged yet: start over
    if config.sft_max_steps > 0:
        bar = tqdm(total=config.sft_max_steps, desc="SFT warm-up", disable=not progress)
        # the full model warms up; adapters start after it
        with bar, lora.training_base_weights(policy.adapters):
            warm_up(
                policy.model,
                policy.tokenizer,
                policy.backend,
                task,
                warm_up_settings(config, task),
                log=lambda record: _log_warm_up(run_dir, record, bar),
            )
        load_current_weights(policy.backend, policy.model)
        if policy.adapters is not None:
            save_base_model(policy, run_dir / BASE_MODEL_DIR)
    if config.eval_every:
        scores = evaluate(config, task, policy, eval_examples, 0, progress)
        append_metrics(run_dir, {"step": 0, **scores})
    if config.sft_max_steps > 0 and config.checkpoint_every:
        save_checkpoint(config, run_dir, policy, 0)
    return 0


def _log_warm_up(run_dir: Path, record: dict[str, Any], bar: Any) -> None:
    """A warm-up step's record to metrics.jsonl and to its progress bar."""
    append_metrics(run_dir, record)
    bar.update(1)
    shown = {"loss": f"{record['sft/loss']:.3f}"}
    shown |= {
        key.removeprefix("sft/"): f"{value:.2f}"
        for key, value in record.items()
        if key.startswith("sft/accuracy")
    }
    bar.set_postfix(shown, refresh=False)


def reference_model(run_dir: Path, policy: Policy, start_step: int) -> PreTrainedModel:
    """The KL penalty's frozen reference: the policy at step 0, after the warm-up.

    A fresh run copies the policy and saves the copy's weights to
    ``reference_model.pt``; a run resumed after step 0 reloads them, so the
    penalty keeps pulling towards the same model.
    """
    path = run_dir / REFERENCE_MODEL_FILE
    if start_step == 0:
        frozen = frozen_copy(policy.model)
        checkpoints.atomic_torch_save(frozen.state_dict(), path)
        return frozen
    if not path.exists():
        raise ValueError(
            f"kl_coef > 0 needs the step-0 reference model {str(path)!r} to resume "
            f"this run at step {start_step}, and it is missing (did the run start "
            "with kl_coef 0?)"
        )
    frozen = frozen_copy(policy.model)
    frozen.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    return frozen


def frozen_copy(model: PreTrainedModel) -> PreTrainedModel:
    """A copy of ``model`` in eval mode that takes no gradient."""
    frozen = copy.deepcopy(model)
    frozen.eval()
    frozen.requires_grad_(False)
    return frozen


def warm_up_settings(config: TrainConfig, task: Task) -> WarmUpSettings:
    """The SFT fields of ``config`` as :class:`WarmUpSettings`."""
    return WarmUpSettings(
        max_steps=config.sft_max_steps,
        batch_size=config.sft_batch_size,
        lr=config.sft_lr,
        eval_every=config.sft_eval_every,
        target_accuracy=config.sft_target_accuracy,
        held_out=task.eval(config.sft_eval_size, seed=derived_seed(config, "sft", 0)),
        sampling=sampling_settings(
            config,
            task,
            derived_seed(config, "sft", 1),
            temperature=config.sft_eval_temperature,
        ),
        train_seed=derived_seed(config, "sft", 2),
    )


def learning_rate_at(config: TrainConfig, step: int) -> float:
    """lr * min(1, step / lr_warmup_steps): a linear warm-up, then constant
    (lora_lr in place of lr when training adapters)."""
    if config.lr_warmup_steps == 0:
        return config.learning_rate
    return config.learning_rate * min(1.0, step / config.lr_warmup_steps)


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Write ``lr`` into every parameter group."""
    for group in optimizer.param_groups:
        group["lr"] = lr


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


# --- one GRPO step ------------------------------------------------------------


def sample_rollout_batch(
    config: TrainConfig, task: Task, policy: Policy, step: int
) -> tuple[Rollouts, list[Example]]:
    """B prompts from the train split, G sampled responses each (B·G rollouts).

    With ``dynamic_sampling``, rounds of B prompts (fresh seeds each round) until
    B groups whose rewards differ are kept; the rollouts come back graded
    (:mod:`grpo_lab.training.dynamic_sampling`).
    """
    if config.dynamic_sampling:
        return collect_groups_with_signal(
            lambda round_: sample_round(config, task, policy, step, round_),
            lambda rollouts, examples: grade_rollouts(
                config, task, policy, rollouts, examples
            ),
            config.group_size,
            config.dynamic_sampling_max_rounds,
        )
    return sample_round(config, task, policy, step, 0)


def sample_round(
    config: TrainConfig, task: Task, policy: Policy, step: int, round_: int
) -> tuple[Rollouts, list[Example]]:
    """One draw of B prompts and their B·G rollouts; round 0 is the step's own."""
    suffix = f"/round{round_}" if round_ else ""
    examples = task.train(
        config.prompts_per_step, derived_seed(config, "prompts" + suffix, step)
    )
    sampling = sampling_settings(
        config, task, derived_seed(config, "rollouts" + suffix, step)
    )
    with autocast(config):
        rollouts = policy.backend.generate(
            [example.prompt for example in examples], config.group_size, sampling
        )
    return rollouts, examples


def grpo_update(
    config: TrainConfig,
    task: Task,
    policy: Policy,
    rollouts: Rollouts,
    examples: list[Example],
) -> dict[str, Any]:
    """Rewards -> advantages -> tokens -> (old log-probs) -> optimizer steps."""
    repeated_truths = [
        e.ground_truth for e in examples for _ in range(config.group_size)
    ]
    reward_fn, grading_timeouts = counting_grading_timeouts(
        refusing_non_finite_rewards(
            rollout_reward_fn(config, task, policy, rollouts, examples),
            config,
            task,
            rollouts,
        )
    )
    raw_rewards, advantages, advantage_metadata = rollout_advantages(
        reward_fn,
        rollouts.responses,
        repeated_truths,
        config.group_size,
        baseline=config.baseline,
        advantage_eps=config.advantage_eps,
        advantage_normalizer=config.advantage_normalizer,
        nan_rewards=config.nan_rewards,
    )  # (B·G,) each
    batch = rollout_token_batch(rollouts, policy.tokenizer)
    old_log_probs = (
        score_old_log_probs(config, policy.model, batch) if config.off_policy else None
    )
    reference_log_probs = None
    if config.kl_coef > 0:
        reference_log_probs = score_reference_log_probs(config, policy, batch)
    sampler_log_probs = sampler_log_prob_batch(rollouts, batch["response_mask"])
    lengths = response_token_lengths(rollouts, policy.tokenizer)
    truncated = truncated_responses(config, task, policy, rollouts, lengths)  # (B·G,)
    if config.mask_truncated_completions:  # out of the loss, still in the divisor
        batch["response_mask"] = mask_truncated(batch["response_mask"], truncated)
        advantages = advantages.masked_fill(truncated, 0.0)  # (B·G,)
    settings = dataclasses.asdict(config.update_settings())
    update_records = []
    for _epoch in range(config.epochs_per_rollout_batch):
        for rows in train_batch_rows(config):
            _, metadata = policy_gradient_update(
                policy.model,
                policy.optimizer,
                config.gradient_accumulation_steps,
                config.max_grad_norm,
                {key: value[rows] for key, value in batch.items()},
                advantages[rows],
                old_log_probs=None if old_log_probs is None else old_log_probs[rows],
                reference_log_probs=(
                    None if reference_log_probs is None else reference_log_probs[rows]
                ),
                sampler_log_probs=(
                    None if sampler_log_probs is None else sampler_log_probs[rows]
                ),
                grad_scaler=policy.grad_scaler,
                **settings,
            )
            update_records.append(metadata)
    policy.backend.sync(policy.model)
    sampler_metrics = rollout_sampler_metrics(
        config, batch, old_log_probs, sampler_log_probs, update_records
    )
    return {
        **sampler_metrics,
        **flatten_metrics("train", advantage_metadata),
        **_response_statistics(rollouts, raw_rewards, config.group_size),
        **flatten_metrics("loss", mean_metrics(update_records)),
        "train/optimizer_steps": sum(r["optimizer_step"] for r in update_records),
        **flatten_metrics("train", grading_timeouts),
        **truncation_metrics(lengths, truncated),
        **length_shaping_metrics(config, task, lengths),
        **getattr(rollouts, "sampling_metrics", {}),
    }


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
    _, metrics = sampler_correction_weights(
        old_log_probs,
        sampler_log_probs.to(old_log_probs.device),
        batch["response_mask"].to(old_log_probs.device),
        mode=config.sampler_correction,
        cap=config.sampler_correction_cap,
        low=config.sampler_correction_low,
        high=config.sampler_correction_high,
    )
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


def score_old_log_probs(
    config: TrainConfig, model: PreTrainedModel, batch: dict[str, torch.Tensor]
) -> torch.Tensor:
    """log pi_old(token) of every sampled token, once, before any update. (B, T)

    Scored as the update scores (:func:`grpo_lab.train_step.score_tokens`), in
    microbatches of the update's size, without gradient. The reference model's
    log-probs for a KL penalty are scored by this same call.
    """
    device = next(model.parameters()).device
    settings = config.update_settings()
    microbatch_size = config.train_batch_size // config.gradient_accumulation_steps
    chunks = []
    with torch.no_grad(), autocast(config):
        for start in range(0, batch["input_ids"].shape[0], microbatch_size):
            rows = slice(start, start + microbatch_size)
            microbatch = {key: value[rows].to(device) for key, value in batch.items()}
            scored = score_tokens(model, microbatch, settings)
            chunks.append(scored["log_probs"].float())  # (b, T)
    return torch.cat(chunks, dim=0)  # (B, T)


def score_reference_log_probs(
    config: TrainConfig, policy: Policy, batch: dict[str, torch.Tensor]
) -> torch.Tensor:
    """log pi_ref of every sampled token (B, T): the frozen step-0 copy, or under
    LoRA the same model with its adapters off (the frozen base: no copy)."""
    if policy.adapters is not None:
        with lora.adapters_disabled(policy.adapters):
            return score_old_log_probs(config, policy.model, batch)
    if policy.reference_model is None:  # a direct caller: freeze it now
        policy.reference_model = frozen_copy(policy.model)
    return score_old_log_probs(config, policy.reference_model, batch)


def train_batch_rows(config: TrainConfig) -> list[slice]:
    """Consecutive train batches; whole groups each (group_size divides them).

    Prompts are drawn i.i.d., so consecutive slices are already in random order.
    """
    size = config.train_batch_size
    return [
        slice(start, start + size)
        for start in range(0, config.rollout_batch_size, size)
    ]


def _response_statistics(
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


# --- evaluation, checkpoints, output -------------------------------------------


def evaluate(
    config: TrainConfig,
    task: Task,
    policy: Policy,
    examples: list[Example],
    step: int,
    progress: bool = False,
) -> dict[str, float]:
    """Held-out accuracy, greedy and sampled; format rate and length (greedy).

    ``progress`` shows a bar over the two passes (it closes when they are done).
    """
    bar = tqdm(
        total=2, desc=f"evaluation at step {step}", unit="pass", leave=False,
        disable=not progress,
    )  # fmt: skip
    with autocast(config), bar:
        greedy = held_out_scores(
            policy.backend,
            task,
            examples,
            sampling_settings(config, task, None, temperature=0.0),
        )
        bar.update(1)
        sampled = held_out_scores(
            policy.backend,
            task,
            examples,
            sampling_settings(config, task, derived_seed(config, "eval", step)),
        )
        bar.update(1)
    return {
        "eval/accuracy_greedy": greedy.accuracy,
        "eval/accuracy_sampled": sampled.accuracy,
        "eval/format_rate": greedy.format_rate,
        "eval/response_length": greedy.response_length,
    }


def save_checkpoint(
    config: TrainConfig, run_dir: Path, policy: Policy, step: int
) -> Path:
    """A checkpoint after ``step`` (metrics offset: lines written so far)."""
    return checkpoints.save_checkpoint(
        run_dir,
        step,
        policy.model,
        policy.optimizer,
        config.to_dict(),
        metrics_offset=count_metric_lines(run_dir),
        keep_last=config.keep_checkpoints,
        tokenizer=policy.tokenizer,  # and a save_pretrained folder beside it
        pretrained=policy.adapters,  # under LoRA that folder holds the adapter
        grad_scaler=policy.grad_scaler,
    )


def save_final_model(policy: Policy, folder: Path) -> None:
    """``save_pretrained`` the model and tokenizer (loadable by transformers);
    under LoRA the adapter (``PeftModel.from_pretrained`` opens it)."""
    transformers_logging.disable_progress_bar()
    (policy.adapters or policy.model).save_pretrained(folder)
    policy.tokenizer.save_pretrained(folder)


def save_base_model(policy: Policy, folder: Path) -> None:
    """The frozen base weights of a LoRA policy as a plain ``save_pretrained``
    model and its tokenizer: what the adapters apply to after a warm-up."""
    transformers_logging.disable_progress_bar()
    with torch.device("meta"):
        base = type(policy.model)(policy.model.config)
    base.load_state_dict(lora.base_state_dict(policy.model), assign=True)
    base.save_pretrained(folder)
    policy.tokenizer.save_pretrained(folder)


@contextlib.contextmanager
def autocast(config: TrainConfig) -> Iterator[None]:
    """``torch.autocast`` to ``config.autocast_dtype``, or nothing when unset."""
    if config.autocast_dtype is None:
        yield
        return
    device_type = torch.device(config.device).type
    with torch.autocast(device_type, dtype=getattr(torch, config.autocast_dtype)):
        yield


def _evaluation_due(config: TrainConfig, step: int) -> bool:
    """Every ``eval_every`` steps, and after the last step."""
    return bool(config.eval_every) and (
        step % config.eval_every == 0 or step == config.steps
    )


def _has_checkpoint(run_dir: Path, step: int) -> bool:
    return any(
        checkpoints.checkpoint_step(path) == step
        for path in checkpoints.list_checkpoints(run_dir)
    )


def _progress_summary(record: dict[str, Any]) -> dict[str, str]:
    # None: a NaN mean (a NaN reward under nan_rewards "ignore").
    reward = record.get("train/reward_mean", 0.0)
    summary = {"reward": "nan" if reward is None else f"{reward:.2f}"}
    if "eval/accuracy_greedy" in record:
        summary["eval"] = f"{record['eval/accuracy_greedy']:.2f}"
    return summary
