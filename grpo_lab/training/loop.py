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
10. On-policy distillation, off by default (``teacher`` and ``distillation``):
   a frozen teacher scores each rollout batch's tokens once, as the KL
   reference is scored, and its per-token KL joins the loss as a loss or as a
   per-token reward, with or without the task objective
   (:mod:`grpo_lab.distillation`).
11. Synchronous by default. With ``max_staleness > 0`` a rollout worker
   process samples and grades while the trainer trains, and a step may train
   on groups sampled by weights up to that many steps old
   (:mod:`grpo_lab.training.rollout_worker`, ``docs/asynchronous.md``).
   Which weights sample which batch then depends on timing, so such a run
   is not repeated exactly.

Every random draw (prompts, samples, evaluation samples) is seeded from
``(config.seed, purpose, step)``, so a resumed run repeats an uninterrupted
one exactly on CPU. Taught in ``notebooks/`` on the training loop.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel
from transformers.utils import logging as transformers_logging

from grpo_lab import lora
from grpo_lab.advantages import TOKEN_NORMALIZERS
from grpo_lab.models import load_pretrained
from grpo_lab.rollouts import build_backend
from grpo_lab.rollouts.base import (
    RolloutBackend,
    Rollouts,
    load_current_weights,
)
from grpo_lab.rollouts.multiturn import (
    MultiTurnRolloutBackend,
    trained_tool_token_metrics,
)
from grpo_lab.sampler_correction import GAP_KEYS
from grpo_lab.tasks import get_task, uses_tools
from grpo_lab.tasks.base import Example, Task
from grpo_lab.tasks.chat import unclosed_reasoning_metrics
from grpo_lab.train_step import (
    UpdateSettings,
    policy_gradient_update,
    rollout_advantages,
    score_tokens,
)
from grpo_lab.training import checkpoint as checkpoints
from grpo_lab.training import run_dir as run_dirs
from grpo_lab.training.config import TrainConfig, inert_settings
from grpo_lab.training.dynamic_sampling import (
    collect_groups_with_signal,
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
from grpo_lab.training.model_card import CARD_FILE, model_card
from grpo_lab.training.overlong import (
    mask_truncated,
    truncation_metrics,
)
from grpo_lab.training.parsers import check_device_available
from grpo_lab.training.policy import Policy
from grpo_lab.training.rollout_batch import (
    counting_grading_timeouts,
    grade_rollouts,
    length_shaping_metrics,
    refusing_non_finite_rewards,
    response_statistics,
    response_token_lengths,
    rollout_reward_fn,
    rollout_sampler_metrics,
    rollout_token_batch,
    sampler_log_prob_batch,
    train_batch_rows,
    truncated_responses,
)
from grpo_lab.training.rollout_worker import (
    RolloutWorker,
    RolloutWorkerDied,
    TaggedRollouts,
    rollout_worker,
)
from grpo_lab.training.run_parts import (
    autocast,
    build_task,
    derived_seed,
    sampling_settings,
    tiny_model,
)
from grpo_lab.training.sft import WarmUpSettings, warm_up
from grpo_lab.training.staleness import gap_by_staleness
from grpo_lab.training.teacher import FINAL_MODEL_DIR, load_teacher
from grpo_lab.training.trackers import open_trackers

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
        with rollout_source(config, run_dir, task, policy, start_step) as source:
            for step in steps:
                started = time.perf_counter()
                set_learning_rate(policy.optimizer, learning_rate_at(config, step))
                rollouts, examples = source.take(step)
                taken = time.perf_counter()
                weights_match_completed_step = False
                record = grpo_update(config, task, policy, rollouts, examples)
                source.updated(step)
                record["time/step_seconds"] = time.perf_counter() - started
                # Sampling and grading (synchronous), or waiting on the queue
                # (asynchronous): the part of the step the trainer did not train.
                record["time/sample_seconds"] = taken - started
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
    except (KeyboardInterrupt, RolloutWorkerDied):
        if weights_match_completed_step:
            save_checkpoint(config, run_dir, policy, completed_step)
        raise
    finally:
        bar.close()
        trackers.close()
    if not _has_checkpoint(run_dir, completed_step):
        save_checkpoint(config, run_dir, policy, completed_step)
    save_run_model(policy, run_dir, config)
    return RunResult(run_dir=run_dir, history=read_metrics(run_dir))


# --- setting up -------------------------------------------------------------


def thread_count(config: TrainConfig) -> int:
    """Torch CPU threads for this run: ``num_threads``, else 1 for the tiny model.

    The tiny model's matrices are too small to split: extra threads only spin,
    and beside any other busy process (a browser, a Jupyter server) they slow a
    run several-fold. Real models keep torch's default, less the one thread of
    an asynchronous run's rollout worker.
    """
    if config.num_threads is not None:
        return config.num_threads
    if config.model == "tiny":
        return 1
    cores = torch.get_num_threads()
    return max(1, cores - 1) if config.max_staleness > 0 else cores


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
        teacher_model=None
        if config.teacher is None
        else load_teacher(config, tokenizer),
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


# --- one GRPO step ------------------------------------------------------------


class SynchronousRollouts:
    """The synchronous loop's rollouts: each step samples its own batch with the
    policy as it is (max_staleness 0: no worker, no queue)."""

    def __init__(self, config: TrainConfig, task: Task, policy: Policy) -> None:
        self.config, self.task, self.policy = config, task, policy

    def take(self, step: int) -> tuple[Rollouts, list[Example]]:
        return sample_rollout_batch(self.config, self.task, self.policy, step)

    def updated(self, step: int) -> None:
        """Nothing to send: the next step samples with the updated policy."""


@contextlib.contextmanager
def rollout_source(
    config: TrainConfig, run_dir: Path, task: Task, policy: Policy, start_step: int
) -> Iterator[SynchronousRollouts | RolloutWorker]:
    """Where each step's rollouts come from: the step itself (max_staleness 0,
    the synchronous loop), or the asynchronous rollout worker
    (:mod:`grpo_lab.training.rollout_worker`), started here and stopped on exit."""
    if config.max_staleness == 0:
        yield SynchronousRollouts(config, task, policy)
        return
    with rollout_worker(config, run_dir, policy.model, start_step) as worker:
        yield worker


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


def token_counts(
    config: TrainConfig, response_mask: torch.Tensor
) -> torch.Tensor | None:
    """Each response's token count (B·G,) where the advantages weigh by tokens."""
    by_tokens = config.advantage_normalizer in TOKEN_NORMALIZERS or (
        config.reward_aggregation == "normalize_then_sum_tokens"
    )
    return response_mask.sum(dim=-1) if by_tokens else None


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
    batch = rollout_token_batch(rollouts, policy.tokenizer)
    raw_rewards, advantages, advantage_metadata = rollout_advantages(
        reward_fn,
        rollouts.responses,
        repeated_truths,
        config.group_size,
        baseline=config.baseline,
        advantage_eps=config.advantage_eps,
        advantage_normalizer=config.advantage_normalizer,
        nan_rewards=config.nan_rewards,
        reward_aggregation=config.reward_aggregation,
        response_lengths=token_counts(config, batch["response_mask"]),
    )  # (B·G,) each
    settings = config.update_settings()  # built and checked once per step
    old_log_probs = None
    if config.off_policy:
        old_log_probs = score_old_log_probs(config, policy.model, batch, settings)
    reference_log_probs = None
    if config.kl_coef > 0:
        reference_log_probs = score_reference_log_probs(config, policy, batch, settings)
    teacher_log_probs = None
    if settings.distills:  # the teacher scores as the reference model does
        teacher_log_probs = score_old_log_probs(
            config, policy.teacher_model, batch, settings
        )
    sampler_log_probs = sampler_log_prob_batch(rollouts, batch["response_mask"])
    staleness_gaps = staleness_gap_metrics(
        config, policy, rollouts, batch, old_log_probs, sampler_log_probs, settings
    )
    lengths = response_token_lengths(rollouts, policy.tokenizer)
    truncated = truncated_responses(config, task, policy, rollouts, lengths)  # (B·G,)
    if config.mask_truncated_completions:  # out of the loss, still in the divisor
        batch["response_mask"] = mask_truncated(batch["response_mask"], truncated)
        advantages = advantages.masked_fill(truncated, 0.0)  # (B·G,)
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
                teacher_log_probs=(
                    None if teacher_log_probs is None else teacher_log_probs[rows]
                ),
                grad_scaler=policy.grad_scaler,
                settings=settings,
            )
            update_records.append(metadata)
    policy.backend.sync(policy.model)
    if sampler_log_probs is not None and old_log_probs is None:
        old_log_probs = unchanged_policy_log_probs(
            config, policy, batch, update_records
        )
    sampler_metrics = rollout_sampler_metrics(
        config, batch, old_log_probs, sampler_log_probs, update_records
    )
    return {
        **sampler_metrics,
        **flatten_metrics("train", advantage_metadata),
        **response_statistics(rollouts, raw_rewards, config.group_size),
        **flatten_metrics("loss", mean_metrics(update_records)),
        "train/optimizer_steps": sum(r["optimizer_step"] for r in update_records),
        **flatten_metrics("train", grading_timeouts),
        **truncation_metrics(lengths, truncated),
        **unclosed_reasoning_metrics(task, rollouts.responses),
        **length_shaping_metrics(config, task, lengths),
        **getattr(rollouts, "sampling_metrics", {}),
        **staleness_gaps,
        **trained_tool_token_metrics(rollouts, batch["response_mask"]),
    }


def unchanged_policy_log_probs(
    config: TrainConfig,
    policy: Policy,
    batch: dict[str, torch.Tensor],
    update_records: list[dict[str, Any]],
) -> torch.Tensor | None:
    """log pi_old (B, T) when no update scored a row, else None.

    On-policy, each update reports the sampler gap of the rows it scored. When
    every advantage is zero (every reward equal, e.g. all 0) no row is scored,
    no optimizer step runs, and the policy still is pi_old: it is scored once
    here, so that the sampler gap is logged at every step all the same.
    """
    if any(GAP_KEYS[0] in record for record in update_records):
        return None
    return score_old_log_probs(config, policy.model, batch, config.update_settings())


def staleness_gap_metrics(
    config: TrainConfig,
    policy: Policy,
    rollouts: Rollouts,
    batch: dict[str, torch.Tensor],
    old_log_probs: torch.Tensor | None,
    sampler_log_probs: torch.Tensor | None,
    settings: UpdateSettings,
) -> dict[str, float]:
    """An asynchronous batch's sampler/trainer log-prob gap per staleness, the
    trainer's log-probs taken before the update (scored once more on-policy)."""
    if not isinstance(rollouts, TaggedRollouts) or sampler_log_probs is None:
        return {}
    trainer = old_log_probs
    if trainer is None:
        trainer = score_old_log_probs(config, policy.model, batch, settings)
    return gap_by_staleness(
        trainer.cpu(),
        sampler_log_probs,
        batch["response_mask"].cpu(),
        torch.tensor(rollouts.row_staleness),
    )


def score_old_log_probs(
    config: TrainConfig,
    model: PreTrainedModel,
    batch: dict[str, torch.Tensor],
    settings: UpdateSettings | None = None,
) -> torch.Tensor:
    """log pi_old(token) of every sampled token, once, before any update. (B, T)

    Scored as the update scores (:func:`grpo_lab.train_step.score_tokens`), in
    microbatches of the update's size, without gradient. The reference model's
    log-probs for a KL penalty, and a distillation teacher's, are scored by
    this same call. ``settings``: the
    step's ``config.update_settings()`` when the caller built it already.
    """
    device = next(model.parameters()).device
    settings = config.update_settings() if settings is None else settings
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
    config: TrainConfig,
    policy: Policy,
    batch: dict[str, torch.Tensor],
    settings: UpdateSettings | None = None,
) -> torch.Tensor:
    """log pi_ref of every sampled token (B, T): the frozen step-0 copy, or under
    LoRA the same model with its adapters off (the frozen base: no copy)."""
    if policy.adapters is not None:
        with lora.adapters_disabled(policy.adapters):
            return score_old_log_probs(config, policy.model, batch, settings)
    if policy.reference_model is None:  # a direct caller: freeze it now
        policy.reference_model = frozen_copy(policy.model)
    return score_old_log_probs(config, policy.reference_model, batch, settings)


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
        total=2,
        desc=f"evaluation at step {step}",
        unit="pass",
        leave=False,
        disable=not progress,
    )
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


def save_run_model(policy: Policy, run_dir: Path, config: TrainConfig) -> None:
    """A finished run's ``final_model/``: :func:`save_final_model`, with
    grpo_lab's model card as its README.md (in place of peft's blank one).

    An adapter names its base in ``adapter_config.json``
    (``base_model_name_or_path``), so ``AutoPeftModelForCausalLM`` opens the
    folder alone: the Hub model or local folder the run started from, or, for
    the tiny model or after a warm-up, the run's ``base_model/`` folder (saved
    here when a warm-up has not saved it).
    """
    if policy.adapters is not None:
        base = adapter_base(config, run_dir)
        if (
            base == str((run_dir / BASE_MODEL_DIR).resolve())
            and not Path(base).is_dir()
        ):
            save_base_model(policy, Path(base))
        for adapter in policy.adapters.peft_config.values():
            adapter.base_model_name_or_path = base
    folder = run_dir / FINAL_MODEL_DIR
    save_final_model(policy, folder)
    card = model_card(
        run_dirs.read_saved_config(run_dir),
        read_metrics(run_dir),
        str(folder.resolve()),
        curve_file=None,
        title=run_dir.resolve().name,
    )
    (folder / CARD_FILE).write_text(card, encoding="utf-8")


def adapter_base(config: TrainConfig, run_dir: Path) -> str:
    """What a LoRA run's adapter applies to: ``config.model`` (a Hub name, or a
    local folder as an absolute path) when the run trained on it as loaded,
    else the run's ``base_model/`` folder (the tiny model, or weights after a
    warm-up)."""
    if config.model == "tiny" or config.sft_max_steps > 0:
        return str((run_dir / BASE_MODEL_DIR).resolve())
    local = Path(config.model)
    return str(local.resolve()) if local.exists() else config.model


def save_base_model(policy: Policy, folder: Path) -> None:
    """The frozen base weights of a LoRA policy as a plain ``save_pretrained``
    model and its tokenizer: what the adapters apply to after a warm-up."""
    transformers_logging.disable_progress_bar()
    with torch.device("meta"):
        base = type(policy.model)(policy.model.config)
    base.load_state_dict(lora.base_state_dict(policy.model), assign=True)
    base.save_pretrained(folder)
    policy.tokenizer.save_pretrained(folder)


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
