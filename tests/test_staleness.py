"""Bounded staleness: the settings, the admission decision and its metrics."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_lab.errors import UserError
from grpo_lab.integrations.trl.translation import to_trl_config
from grpo_lab.integrations.verl.settings import EXPORTS
from grpo_lab.rollouts.base import Rollouts
from grpo_lab.tasks.base import Example
from grpo_lab.training.config import TrainConfig, inert_settings
from grpo_lab.training.staleness import (
    Admission,
    TaggedGroup,
    admission_metrics,
    admit,
    check_async_settings,
    gap_by_staleness,
    paced_version,
    staleness,
    within_bound,
)


def group(version: int, lengths: tuple[int, ...] = (2, 2), wait: float = 0.0):
    """A tagged group of len(lengths) responses of those token lengths."""
    return TaggedGroup(
        batch_index=1,
        version=version,
        example=Example(prompt="p", ground_truth="t"),
        rollouts=Rollouts(
            prompts=["p"] * len(lengths),
            responses=["r"] * len(lengths),
            prompt_token_ids=[[1]] * len(lengths),
            response_token_ids=[[5] * n for n in lengths],
        ),
        reward_results=[{"reward": 0.0}] * len(lengths),
        worker_wait_seconds=wait,
    )


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ((-1, "drop", 1, 1), "max_staleness must be an int >= 0"),
        ((1.0, "drop", 1, 1), "max_staleness must be an int >= 0"),
        ((True, "drop", 1, 1), "max_staleness must be an int >= 0"),
        ((1, "wait", 1, 1), r"async_admission must be one of \('drop', 'pace'\)"),
        ((1, "drop", 0, 1), "weight_sync_every must be a positive int"),
        ((1, "drop", 1, 0), "async_queue_size must be a positive int"),
        ((1, "pace", 3, 1), r"weight_sync_every must be at most max_staleness \+ 1"),
    ],
)
def test_bad_async_settings_are_refused_by_name(arguments, message):
    with pytest.raises(ValueError, match=message):
        check_async_settings(*arguments)


def test_the_config_refuses_bad_async_settings_when_built():
    with pytest.raises(ValueError, match=r"got 3$"):
        TrainConfig.for_profile("smoke", max_staleness=1, weight_sync_every=3)
    with pytest.raises(ValueError, match="async_admission must be one of"):
        TrainConfig.for_profile("smoke", max_staleness=1, async_admission="later")


@pytest.mark.parametrize(
    ("overrides", "name"),
    [
        ({"lora_rank": 2}, "lora_rank"),
        ({"dynamic_sampling": True}, "dynamic_sampling"),
        ({"task": "calculator"}, "task"),
    ],
)
def test_what_the_worker_cannot_run_is_refused_at_construction(overrides, name):
    with pytest.raises(ValueError, match=f"^{name} must be .* with max_staleness > 0"):
        TrainConfig.for_profile("smoke", max_staleness=1, **overrides)
    TrainConfig.for_profile("smoke", **overrides)  # fine in the synchronous loop


def test_the_worker_settings_are_inert_in_the_synchronous_loop():
    changed = {"async_admission": "pace", "weight_sync_every": 2, "async_queue_size": 4}
    synchronous = TrainConfig.for_profile("smoke", **changed)
    assert set(inert_settings(synchronous)) >= set(changed)
    asynchronous = TrainConfig.for_profile("smoke", max_staleness=1, **changed)
    assert not set(inert_settings(asynchronous)) & set(changed)


def test_staleness_counts_steps_behind_the_trainers_weights():
    # Step 6 trains at version 5: a group sampled by version 3 is 2 steps old.
    assert staleness(5, group(3)) == 2
    assert staleness(5, group(5)) == 0


def test_admission_keeps_groups_within_the_bound_and_drops_the_rest():
    groups = [group(5), group(3), group(4), group(2)]
    kept, dropped = admit(groups, trainer_version=5, max_staleness=1)
    assert [g.version for g in kept] == [5, 4]
    assert [g.version for g in dropped] == [3, 2]
    kept, dropped = admit(groups, trainer_version=5, max_staleness=3)
    assert len(kept) == 4 and dropped == []


def test_a_paced_worker_samples_batch_n_with_version_n_minus_1_minus_the_bound():
    # Batch 7 is trained on at step 7 (version 6): bound 2 allows version 4.
    assert paced_version(7, 2) == 4
    assert staleness(6, group(paced_version(7, 2))) == 2
    assert paced_version(1, 0) == 0  # staleness 0: the synchronous loop's order


def test_admission_metrics_by_hand():
    admission = Admission(
        kept=[group(5, (2, 4), wait=0.5), group(4, (2, 2))],
        dropped=[group(2, (8, 10), wait=0.25)],
        queue_depth=3,
        trainer_wait_seconds=1.5,
    )
    metrics = admission_metrics(admission, trainer_version=5)
    assert metrics["async/staleness_mean"] == 0.5  # (0 + 1) / 2
    assert metrics["async/staleness_max"] == 1.0
    assert metrics["async/dropped_groups_stale"] == 1.0
    assert metrics["async/queue_depth"] == 3.0
    assert metrics["async/trainer_wait_seconds"] == 1.5
    assert metrics["async/worker_wait_seconds"] == 0.75  # 0.5 + 0.25
    assert metrics["async/kept_response_length_mean"] == 2.5  # (2+4+2+2) / 4
    assert metrics["async/dropped_response_length_mean"] == 9.0  # (8+10) / 2
    del admission.dropped[:]
    assert "async/dropped_response_length_mean" not in admission_metrics(
        admission, trainer_version=5
    )


def test_gap_by_staleness_by_hand():
    trainer = torch.tensor([[-1.0, -2.0, 0.0], [-1.0, -1.0, -1.0], [-3.0, 0.0, 0.0]])
    sampler = torch.tensor([[-1.5, -1.0, 9.0], [-1.0, math.nan, -4.0], [-2.0, 0, 0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    gaps = gap_by_staleness(trainer, sampler, mask, torch.tensor([0, 2, 2]))
    # staleness 0: row 0, |0.5| and |1.0| (the masked 9.0 left out): 0.75.
    # staleness 2: row 1 |0|, NaN left out, |3|; row 2 |1|: (0 + 3 + 1) / 3.
    assert gaps == pytest.approx(
        {"async/sampler_gap_staleness_0": 0.75, "async/sampler_gap_staleness_2": 4 / 3}
    )


def test_trl_and_verl_exports_refuse_an_asynchronous_run_by_name():
    config = TrainConfig.for_profile("smoke", max_staleness=1, sft_max_steps=0)
    with pytest.raises(UserError, match="max_staleness 1 cannot run on TRL") as error:
        to_trl_config(config)
    assert "trl.experimental.async_grpo" in str(error.value)
    with pytest.raises(ValueError, match=r"^max_staleness must be 0 .*one_step_off"):
        EXPORTS["max_staleness"].convert(config, None)
    synchronous = TrainConfig.for_profile("smoke", sft_max_steps=0)
    assert EXPORTS["max_staleness"].convert(synchronous, None) == {}


def test_within_bound_keeps_a_group_at_the_bound_and_drops_one_past_it():
    versions = torch.tensor([7, 5, 4, 8])  # 0, 2, 3 and -1 steps old at version 7
    kept = within_bound(versions, 7, 2)
    assert kept.tolist() == [True, True, False, True]
