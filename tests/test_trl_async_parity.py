"""grpo_lab against TRL 1.16's experimental asynchronous GRPO, in float64.

TRL's own code computes its side: ``RolloutQueueDataset.__iter__`` takes fixed
version-tagged samples from a queue and drops those older than
``max_staleness`` (versions behind the trainer's), and
``AsyncGRPOTrainer.compute_loss`` computes the loss of the samples it kept from
their packed log-probs, backpropagated to those log-probs. Only the model is
replaced, by a module that returns fixed float64 log-probs (TRL's forward runs
its own packed attention). grpo_lab's side is
:func:`grpo_lab.training.staleness.within_bound` for the admission and
:func:`grpo_lab.train_step.microbatch_loss` for the loss, with TRL's async
reading of pi_old: the sampler's own log-probs (TRL clips pi / pi_sampler; no
second correction), ``grpo`` with eps_low / eps_high and token normalization.
Each side's admission, loss and gradient must agree; a mutant of grpo_lab's
side (the per-response mean, or a bound off by one) must not.
"""

from __future__ import annotations

import queue
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from accelerate import PartialState
from trl.experimental.async_grpo import async_grpo_trainer as trainer_module

from grpo_lab.train_step import UpdateSettings, microbatch_loss
from grpo_lab.training.staleness import within_bound

EPSILON_LOW, EPSILON_HIGH = 0.2, 0.28
GROUP_SIZE = 2
# Four groups of two completions, each tagged with the version that sampled it;
# the trainer is at version 7 with max_staleness 2: version 5 sits at the bound
# (kept), version 4 is one over it (dropped).
VERSIONS = [7, 5, 4, 6]
TRAINER_VERSION, MAX_STALENESS = 7, 2
PROMPT_LENGTH = 2
COMPLETION_LENGTHS = [3, 1, 4, 2, 2, 3, 1, 4]
ADVANTAGES = [1.0, -1.0, 0.6, -0.6, 2.0, -2.0, -0.8, 0.8]


class _Stop(Exception):
    """Raised by the health check when the queue runs dry: the end of the step."""


def _fixed_log_probs() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per completion: the policy's and the sampler's token log-probs. Some
    ratios pi / pi_sampler sit inside [1 - eps_low, 1 + eps_high], others out
    of it on either side, with advantages of both signs."""
    generator = torch.Generator().manual_seed(39)
    policy, sampler = [], []
    for length in COMPLETION_LENGTHS:
        log_pi = -torch.rand(length, generator=generator, dtype=torch.float64) * 2
        gap = (torch.rand(length, generator=generator, dtype=torch.float64) - 0.5) * 0.9
        policy.append(log_pi)
        sampler.append(log_pi - gap)
    return policy, sampler


def _samples(sampler: list[torch.Tensor]) -> list[SimpleNamespace]:
    """TRL's RolloutSample fields the queue dataset reads, per completion."""
    samples = []
    for row, (length, advantage) in enumerate(
        zip(COMPLETION_LENGTHS, ADVANTAGES, strict=True)
    ):
        group = row // GROUP_SIZE
        samples.append(
            SimpleNamespace(
                input_ids=list(range(PROMPT_LENGTH + length)),
                completion_mask=[0] * PROMPT_LENGTH + [1] * length,
                old_log_probs=[0.0] * PROMPT_LENGTH + sampler[row].tolist(),
                advantage=advantage,
                group_id=group,
                row=row,
                model_version=VERSIONS[group],
                metrics={},
                enqueued_at=None,
            )
        )
    return samples


def trl_admitted(max_staleness: int) -> tuple[list[int], dict[str, list[float]]]:
    """The rows TRL's RolloutQueueDataset yields from the fixed queue, and its
    metrics."""
    PartialState(cpu=True)  # TRL's logger needs accelerate's state
    rollout_queue: queue.Queue = queue.Queue()
    _, sampler = _fixed_log_probs()
    for sample in _samples(sampler):
        rollout_queue.put(sample)
    metrics: dict[str, list[float]] = defaultdict(list)

    def dry(_stale_after_s: float) -> None:
        raise _Stop

    dataset = trainer_module.RolloutQueueDataset(
        rollout_queue,
        model_version_fn=lambda: TRAINER_VERSION,
        check_health_fn=dry,
        stale_after_s=1.0,
        metrics=metrics,
        max_staleness=max_staleness,
        poll_interval_s=0.01,
    )
    kept = []
    with pytest.raises(_Stop):
        for item in dataset:
            kept.append(_row_of(item))
    return kept, metrics


def _row_of(item: dict) -> int:
    """The row a yielded sample came from (its old log-probs are unique)."""
    _, sampler = _fixed_log_probs()
    tail = torch.tensor(item["old_log_probs"][PROMPT_LENGTH:], dtype=torch.float64)
    return next(
        row
        for row, values in enumerate(sampler)
        if values.shape == tail.shape and torch.equal(values, tail)
    )


class _FixedLogProbs(torch.nn.Module):
    """Stands in for TRL's packed forward: the given per-position log-probs."""

    def __init__(self, log_probs: torch.Tensor) -> None:
        super().__init__()
        self.log_probs = log_probs  # (N,) with gradient

    def forward(self, **_kwargs):
        return SimpleNamespace(
            log_probs=self.log_probs[None],
            entropy=torch.zeros_like(self.log_probs)[None],
        )


def trl_loss(rows: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """TRL's async loss of ``rows`` packed in one row, and its gradient by each
    completion token's log-prob."""
    policy, sampler = _fixed_log_probs()
    positions, old, advantages, segments, index = [], [], [], [], []
    cursor = 0
    for segment, row in enumerate(rows):
        length = COMPLETION_LENGTHS[row]
        index += [-1] * PROMPT_LENGTH + list(
            range(cursor + PROMPT_LENGTH, cursor + PROMPT_LENGTH + length)
        )
        positions += list(range(PROMPT_LENGTH + length))
        old += [0.0] * PROMPT_LENGTH + sampler[row].tolist()
        advantages += [ADVANTAGES[row]] * (PROMPT_LENGTH + length)
        segments += [segment] * (PROMPT_LENGTH + length)
        cursor += PROMPT_LENGTH + length
    flat = torch.zeros(cursor, dtype=torch.float64)
    for row, start in zip(rows, _starts(rows), strict=True):
        flat[
            start + PROMPT_LENGTH : start + PROMPT_LENGTH + COMPLETION_LENGTHS[row]
        ] = policy[row]
    flat.requires_grad_(True)
    tokens = sum(COMPLETION_LENGTHS[row] for row in rows)
    inputs = {
        "attention_mask": torch.ones(1, cursor, dtype=torch.long),
        "token_index": torch.tensor([index]),
        "input_ids": torch.zeros(1, cursor, dtype=torch.long),
        "position_ids": torch.tensor([positions]),
        "shift_labels": torch.zeros(1, cursor, dtype=torch.long),
        "old_log_probs": torch.tensor([old], dtype=torch.float64),
        "advantages": torch.tensor([advantages], dtype=torch.float64),
        "segment_id": torch.tensor([segments]),
        "tree_kv_index": torch.tensor([[-1]]),
        "tree_cu_seqlens_q": torch.tensor([[-1]]),
        "tree_cu_seqlens_k": torch.tensor([[-1]]),
        "tree_max_seqlens": torch.tensor([[cursor, cursor]]),
        "global_n_tokens": torch.tensor([float(tokens)]),
        "global_n_forward_tokens": torch.tensor([float(cursor)]),
        "mean_seq_len": torch.tensor([cursor / len(rows)]),
    }
    accelerator = SimpleNamespace(
        num_processes=1, reduce=lambda t, reduction: t, gather=lambda t: t
    )
    trainer = SimpleNamespace(
        epsilon_low=EPSILON_LOW,
        epsilon_high=EPSILON_HIGH,
        accelerator=accelerator,
        current_gradient_accumulation_steps=1,
        aux_loss_enabled=False,
        _metrics={"train": defaultdict(list)},
        _step_forward_tokens=0.0,
        _step_trained_tokens=0.0,
        _step_seq_len_weighted=0.0,
        _step_samples=0.0,
        _step_forward_s=0.0,
    )
    loss = trainer_module.AsyncGRPOTrainer.compute_loss(
        trainer, _FixedLogProbs(flat), inputs
    )
    loss.backward()
    gradients = [
        flat.grad[
            start + PROMPT_LENGTH : start + PROMPT_LENGTH + COMPLETION_LENGTHS[row]
        ]
        for row, start in zip(rows, _starts(rows), strict=True)
    ]
    return loss.detach(), gradients


def _starts(rows: list[int]) -> list[int]:
    starts, cursor = [], 0
    for row in rows:
        starts.append(cursor)
        cursor += PROMPT_LENGTH + COMPLETION_LENGTHS[row]
    return starts


def grpo_lab_step(
    max_staleness: int = MAX_STALENESS, normalization: str = "token"
) -> tuple[list[int], torch.Tensor, list[torch.Tensor]]:
    """grpo_lab's admitted rows, loss and gradient by each token's log-prob."""
    kept = within_bound(torch.tensor(VERSIONS), TRAINER_VERSION, max_staleness)
    rows = [r for r in range(len(ADVANTAGES)) if kept[r // GROUP_SIZE]]
    policy, sampler = _fixed_log_probs()
    width = max(COMPLETION_LENGTHS)
    log_probs = torch.zeros(len(rows), width, dtype=torch.float64)
    sampler_log_probs = torch.zeros(len(rows), width, dtype=torch.float64)
    mask = torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        length = COMPLETION_LENGTHS[row]
        log_probs[i, :length] = policy[row]
        sampler_log_probs[i, :length] = sampler[row]
        mask[i, :length] = 1
    log_probs.requires_grad_(True)
    settings = UpdateSettings(
        importance_reweighting_method="grpo",
        cliprange=EPSILON_LOW,
        cliprange_high=EPSILON_HIGH,
        loss_normalization=normalization,
    )
    microbatch = {
        "response_mask": mask,
        "advantages": torch.tensor([ADVANTAGES[r] for r in rows], dtype=torch.float64),
        "old_log_probs": sampler_log_probs,  # TRL's async pi_old: the sampler's
    }
    loss, _ = microbatch_loss(
        log_probs, torch.zeros_like(log_probs), microbatch, settings
    )
    loss.backward()
    gradients = [
        log_probs.grad[i, : COMPLETION_LENGTHS[row]] for i, row in enumerate(rows)
    ]
    return rows, loss.detach(), gradients


def test_the_fixed_completions_reach_both_sides_of_the_clip():
    policy, sampler = _fixed_log_probs()
    ratios = torch.cat([(p - s).exp() for p, s in zip(policy, sampler, strict=True)])
    assert (ratios < 1 - EPSILON_LOW).any() and (ratios > 1 + EPSILON_HIGH).any()
    assert ((ratios > 1 - EPSILON_LOW) & (ratios < 1 + EPSILON_HIGH)).any()


def test_trl_drops_what_grpo_lab_drops():
    trl_rows, metrics = trl_admitted(MAX_STALENESS)
    rows, _, _ = grpo_lab_step()
    assert trl_rows == rows == [0, 1, 2, 3, 6, 7]
    assert sum(metrics["sample/dropped_stale_total"]) == 2.0  # the version-4 group
    assert max(metrics["sample/staleness_max"]) == MAX_STALENESS  # at the bound: kept


def test_one_async_step_matches_trl_in_float64():
    rows, loss, gradients = grpo_lab_step()
    trl_value, trl_gradients = trl_loss(rows)
    assert loss.dtype == trl_value.dtype == torch.float64
    torch.testing.assert_close(loss, trl_value, rtol=1e-12, atol=1e-12)
    for ours, theirs in zip(gradients, trl_gradients, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    every = torch.cat(gradients)
    # Some tokens are clipped (no gradient), others not: the clip is exercised.
    assert (every == 0).any() and (every != 0).any()


def test_a_mutant_of_grpo_lab_side_is_caught():
    rows, _, _ = grpo_lab_step()
    trl_value, trl_gradients = trl_loss(rows)
    # The per-response mean in place of TRL's token mean.
    _, mutant, mutant_gradients = grpo_lab_step(normalization="sequence")
    assert abs(mutant - trl_value) > 1e-3
    gap = (torch.cat(mutant_gradients) - torch.cat(trl_gradients)).abs().max()
    assert gap > 1e-3
    # A bound one lower admits other rows than TRL at max_staleness 2.
    fewer, _, _ = grpo_lab_step(max_staleness=MAX_STALENESS - 1)
    assert fewer != trl_admitted(MAX_STALENESS)[0]
