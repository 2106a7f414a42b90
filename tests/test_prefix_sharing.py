"""Tests for grpo_lab.prefix_sharing: dedupe, split, columns, cache copy."""

from __future__ import annotations

import pytest
import torch

from grpo_lab.models import build_char_tokenizer, build_tiny_qwen2
from grpo_lab.prefix_sharing import (
    can_share_prefix,
    distinct_rows,
    forward_with_shared_prefix,
    join_prefix_and_tail,
    prompt_only_columns,
    split_at_prefix,
)


@pytest.fixture(scope="module")
def model():
    tokenizer = build_char_tokenizer()
    return build_tiny_qwen2(tokenizer, hidden_size=32, num_layers=2, seed=0).eval()


def test_distinct_rows_rebuild_the_input():
    rows = torch.tensor([[5, 6], [1, 2], [5, 6], [1, 2], [1, 3]])
    distinct, row_to_distinct = distinct_rows(rows)
    assert distinct.shape == (3, 2)  # [1, 2], [1, 3], [5, 6]
    assert torch.equal(distinct[row_to_distinct], rows)


def test_split_dedupes_prefixes_and_keeps_every_tail():
    # Rows 0 and 1 share ids and labels on the first 2 columns; row 2 shares the
    # ids but not the labels, so it keeps a prefix of its own.
    input_ids = torch.tensor([[7, 8, 1, 2], [7, 8, 3, 4], [7, 8, 5, 6]])
    labels = torch.tensor([[8, 9, 2, 0], [8, 9, 4, 0], [8, 4, 6, 0]])
    split = split_at_prefix(input_ids, labels, 2)
    assert split.distinct_count == 2
    assert torch.equal(split.prefix_ids[split.row_to_prefix], input_ids[:, :2])
    assert torch.equal(split.prefix_labels[split.row_to_prefix], labels[:, :2])
    assert torch.equal(split.tail_ids, input_ids[:, 2:])
    assert torch.equal(split.tail_labels, labels[:, 2:])
    rebuilt = join_prefix_and_tail(split, split.prefix_ids, split.tail_ids)
    assert torch.equal(rebuilt, input_ids)


@pytest.mark.parametrize("prefix_length", [0, 4, -1, True])
def test_split_needs_one_prefix_column_and_one_tail_column(prefix_length):
    ids = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"shared_prefix_length .*\[1, 3\].*got"):
        split_at_prefix(ids, ids, prefix_length)


def test_prompt_only_columns():
    # Row 0's response labels start at column 2, row 1's at column 1: only
    # column 0 is prompt in every row.
    mask = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 0]])
    assert prompt_only_columns(mask) == 1
    assert prompt_only_columns(torch.tensor([[1, 1, 0]])) == 0
    # No response at all: every column but the last (one must stay a tail).
    assert prompt_only_columns(torch.zeros(2, 5, dtype=torch.long)) == 4


def test_forward_with_shared_prefix_gives_the_plain_logits(model):
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, 90, (2, 4), generator=generator)
    input_ids = torch.cat(
        [
            prompts.repeat_interleave(3, 0),
            torch.randint(2, 90, (6, 5), generator=generator),
        ],
        dim=1,
    )  # (6, 9): 2 prompts x 3 responses
    split = split_at_prefix(input_ids, input_ids, 4)
    with torch.no_grad():
        prefix_output, tail_output = forward_with_shared_prefix(model, split)
        plain = model(input_ids).logits  # (6, 9, V)
    assert prefix_output.logits.shape[:2] == (2, 4)
    assert tail_output.logits.shape[:2] == (6, 5)
    joined = torch.cat(
        [prefix_output.logits[split.row_to_prefix], tail_output.logits], dim=1
    )
    torch.testing.assert_close(joined, plain, rtol=1e-5, atol=1e-5)


def test_can_share_prefix_unless_checkpointing_in_training():
    tokenizer = build_char_tokenizer()
    model = build_tiny_qwen2(tokenizer, hidden_size=32, num_layers=1, seed=0)
    model.train()
    assert can_share_prefix(model)
    model.gradient_checkpointing_enable()
    assert not can_share_prefix(model)
    model.eval()
    assert can_share_prefix(model)
