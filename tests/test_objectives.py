"""Tests for grpo_lab.objectives: each record says what its loss does and reports.

The records are the one list of facts about the objectives: the name lists,
the zero-step diagnostics and the accumulator's counts derive from them, so
here each record is checked against its own loss.
"""

from __future__ import annotations

import pytest
import torch

from grpo_lab.objectives import (
    CAPPED_METHODS,
    CLIP_SIDE_KEYS,
    CLIPPED_METHODS,
    COUNT_KEYS,
    OBJECTIVE_RECORDS,
    OBJECTIVES,
    RATIO_METHODS,
    SEQUENCE_METHODS,
    SPLIT_CLIP_METHODS,
    ObjectiveOptions,
    effective_cliprange_high,
    objective_loss,
)

# (B, T) = (3, 4); row 2 has one response token. Ratios far enough from 1 that
# every clip side binds somewhere.
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0]])
ADVANTAGES = torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64)
# Without split sides, and with them (cliprange_high set; ratio_cap set).
OPTION_SETS = (
    {"cliprange": 0.2},
    {"cliprange": 0.2, "cliprange_high": 0.28},
    {"cliprange": 0.2, "ratio_cap": 3.0},
)


@pytest.fixture
def log_probs() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    policy = -torch.rand(MASK.shape, generator=generator, dtype=torch.float64)
    old = policy + 0.6 * torch.randn(
        MASK.shape, generator=generator, dtype=torch.float64
    )
    return policy.requires_grad_(), old


@pytest.mark.parametrize("method", tuple(OBJECTIVE_RECORDS))
@pytest.mark.parametrize("fields", OPTION_SETS, ids=("symmetric", "high", "cap"))
def test_each_record_names_exactly_the_keys_its_loss_returns(method, fields, log_probs):
    record = OBJECTIVE_RECORDS[method]
    if "ratio_cap" in fields and not record.capped:
        fields = {"cliprange": 0.2}  # a cap is refused where it does nothing
    options = ObjectiveOptions(importance_reweighting_method=method, **fields)
    policy, old = log_probs
    _, diagnostics = objective_loss(
        options, ADVANTAGES, policy, old if record.uses_ratio else None, MASK
    )
    assert set(diagnostics) == record.diagnostic_keys(options)


def test_the_name_lists_derive_from_the_records():
    # The lists the rest of the package reads, written out once more by hand.
    assert {"noclip", "grpo", "gspo", "cispo", "sapo", "gmpo"} == RATIO_METHODS
    assert {"grpo", "gspo", "cispo", "gmpo"} == CLIPPED_METHODS
    assert {"gspo", "gmpo"} == SEQUENCE_METHODS
    assert {"cispo", "gmpo"} == SPLIT_CLIP_METHODS
    assert {"grpo", "gspo"} == CAPPED_METHODS
    assert {name: r.loss for name, r in OBJECTIVE_RECORDS.items()} == OBJECTIVES
    assert {
        "clip_count", "clip_total", "importance_ratio_count", *CLIP_SIDE_KEYS[:2]
    } == COUNT_KEYS  # fmt: skip


def test_a_per_sequence_record_needs_the_mask_and_a_ratio_record_old_log_probs(
    log_probs,
):
    policy, old = log_probs
    gspo = ObjectiveOptions(importance_reweighting_method="gspo", cliprange=0.2)
    with pytest.raises(ValueError, match=r"response_mask must be a tensor for 'gspo'"):
        objective_loss(gspo, ADVANTAGES, policy, old, None)
    sapo = ObjectiveOptions(importance_reweighting_method="sapo")
    with pytest.raises(ValueError, match=r"old_log_probs must be a tensor for 'sapo'"):
        objective_loss(sapo, ADVANTAGES, policy, None, MASK)


def test_options_are_checked_once_when_built():
    with pytest.raises(ValueError, match=r"cliprange must be positive for 'grpo'"):
        ObjectiveOptions(importance_reweighting_method="grpo")
    with pytest.raises(ValueError, match=r"importance_reweighting_method must be one"):
        ObjectiveOptions(importance_reweighting_method="ppo")
    with pytest.raises(ValueError, match=r"unknown objective option\(s\) \['eps'\]"):
        ObjectiveOptions.from_keywords(eps=0.2)
    with pytest.raises(TypeError):  # keywords only: no field can shift
        ObjectiveOptions("grpo", 0.2)  # type: ignore[misc]


def test_the_upper_clip_range_defaults_to_the_lower_one():
    assert effective_cliprange_high(0.2, None) == 0.2
    assert effective_cliprange_high(0.2, 0.28) == 0.28
    assert effective_cliprange_high(None, None) is None
    options = ObjectiveOptions(importance_reweighting_method="grpo", cliprange=0.2)
    assert options.high_bound == pytest.approx(1.2)
