"""Tests for grpo_lab.aggregation: a (B, T) loss reduced by sequence, constant
or token normalization, and the microbatch scale that makes accumulation exact."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_lab.aggregation import aggregate_loss_across_microbatch, microbatch_loss_scale


def test_aggregation_by_hand():
    per_token_loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    # sequence: row means [(1 + 2) / 2, 4 / 1, 0 / max(0, 1)] -> (1.5 + 4 + 0) / 3
    sequence = aggregate_loss_across_microbatch(per_token_loss, mask, "sequence")
    assert sequence.item() == pytest.approx(5.5 / 3)
    # constant: (1 + 2 + 4) / 4 -- a long response weighs as much per token
    constant = aggregate_loss_across_microbatch(per_token_loss, mask, "constant", 4)
    assert constant.item() == pytest.approx(7 / 4)


@settings(max_examples=40, deadline=None)
@given(
    batch_size=st.integers(1, 4),
    length=st.integers(1, 5),
    seed=st.integers(0, 1000),
)
def test_sequence_equals_constant_when_every_response_has_the_same_length(
    batch_size, length, seed
):
    generator = torch.Generator().manual_seed(seed)
    per_token_loss = torch.randn(batch_size, length + 2, generator=generator)
    mask = torch.zeros(batch_size, length + 2)
    mask[:, 1 : length + 1] = 1  # every response has `length` tokens
    sequence = aggregate_loss_across_microbatch(per_token_loss, mask, "sequence")
    constant = aggregate_loss_across_microbatch(
        per_token_loss, mask, "constant", batch_size * length
    )
    assert sequence.item() == pytest.approx(constant.item(), abs=1e-6)


def test_aggregation_errors():
    per_token_loss, mask = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(
        ValueError,
        match=r"per_token_policy_gradient_loss must have shape \(batch_size, sequence_length\), got \(3,\)",
    ):
        aggregate_loss_across_microbatch(torch.zeros(3), torch.ones(3))
    with pytest.raises(
        ValueError, match=r"mask must have shape \(2, 3\), got \(3, 2\)"
    ):
        aggregate_loss_across_microbatch(per_token_loss, torch.ones(3, 2))
    with pytest.raises(
        ValueError,
        match=r"loss_normalization must be one of \('sequence', 'constant', 'token'\), got 'tokens'",
    ):
        aggregate_loss_across_microbatch(per_token_loss, mask, "tokens")
    for constant in (None, 0, -2):
        with pytest.raises(
            ValueError,
            match=rf"normalization_constant must be positive for constant normalization, got {constant}",
        ):
            aggregate_loss_across_microbatch(per_token_loss, mask, "constant", constant)


def test_token_aggregation_by_hand():
    per_token_loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    # (1 + 2 + 4) / 3 tokens: every token weighs the same, whatever its row.
    token = aggregate_loss_across_microbatch(per_token_loss, mask, "token")
    assert token.item() == pytest.approx(7 / 3)
    empty = aggregate_loss_across_microbatch(per_token_loss, torch.zeros(3, 3), "token")
    assert empty.item() == 0.0  # no tokens: 0, not 0 / 0


def test_microbatch_scale_for_token_normalization():
    # Microbatches with 7 and 3 of the batch's 10 tokens: weights 0.7 and 0.3,
    # so their token means add up to the batch's token mean.
    scale = microbatch_loss_scale
    assert scale("token", 2, 4, microbatch_tokens=7, batch_tokens=10) == 0.7
    assert scale("token", 2, 4, microbatch_tokens=3, batch_tokens=10) == 0.3
    assert scale("sequence", 2, 4) == 0.5 and scale("constant", 2, 4) == 1.0
    with pytest.raises(ValueError, match="microbatch_tokens and batch_tokens must be"):
        scale("token", 2, 4)


def test_a_microbatch_larger_than_its_batch_is_refused():
    # 8 of 4 rows would weigh the microbatch 2.0: more than the whole batch.
    with pytest.raises(
        ValueError,
        match=r"^microbatch_rows must be an int in \[0, batch_rows \(4\)\].*got 8$",
    ):
        microbatch_loss_scale("sequence", 8, 4)
    with pytest.raises(ValueError, match=r"^microbatch_rows .*got -1$"):
        microbatch_loss_scale("sequence", -1, 4)
    assert microbatch_loss_scale("sequence", 0, 4) == 0.0
