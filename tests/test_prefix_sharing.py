"""Tests for grpo_lab.prefix_sharing: dedupe, split, columns, cache copy, the
"auto" rule, and where float64 gradients of the two paths part."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from grpo_lab.logprobs import get_response_log_probs
from grpo_lab.models import build_char_tokenizer, build_tiny_qwen2
from grpo_lab.prefix_sharing import (
    can_share_prefix,
    distinct_rows,
    forward_with_shared_prefix,
    join_prefix_and_tail,
    prompt_only_columns,
    saved_positions,
    shared_prefix_length,
    split_at_prefix,
    worth_sharing,
)
from grpo_lab.train_step import UpdateSettings, score_tokens


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


# --- "auto": the rule, tested by its decisions ------------------------------------


def grouped_batch(prompts: int, group_size: int, prompt_len: int, response_len: int):
    """prompts x group_size rows: each group's first prompt_len - 1 ids and labels
    equal, then one response; the response mask as masks.py builds it."""
    generator = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(2, 90, (prompts, prompt_len), generator=generator)
    rows = prompts * group_size
    response = torch.randint(2, 90, (rows, response_len), generator=generator)
    tokens = torch.cat([prompt_ids.repeat_interleave(group_size, 0), response], 1)
    mask = torch.zeros(rows, tokens.shape[1] - 1, dtype=torch.long)
    mask[:, prompt_len - 1 :] = 1  # (B, T): labels of the response tokens
    return tokens[:, :-1], tokens[:, 1:], mask


@pytest.mark.parametrize(
    ("prompts", "group_size", "prompt_len", "saved", "shares"),
    [
        (1, 16, 8, 15 * 7, False),  # a short prompt: 105 positions saved
        (2, 4, 33, 6 * 32, False),  # small groups: 192
        (4, 4, 33, 12 * 32, True),  # the benchmark's default batch: 384
        (8, 2, 33, 8 * 32, True),  # exactly AUTO_MIN_SAVED_POSITIONS (256)
        (1, 2, 129, 128, False),  # one long prompt, a pair of responses
        (4, 8, 6, 28 * 5, False),  # the cpu profile's toy prompts, per 32 rows
        (32, 8, 6, 224 * 5, True),  # ... and its whole 256-row microbatch
    ],
)
def test_auto_shares_when_it_saves_enough_positions(
    prompts, group_size, prompt_len, saved, shares
):
    input_ids, labels, mask = grouped_batch(prompts, group_size, prompt_len, 9)
    prefix = prompt_only_columns(mask)
    assert prefix == prompt_len - 1
    assert saved_positions(input_ids, labels, prefix) == saved
    assert worth_sharing(input_ids, labels, prefix) is shares
    chosen = shared_prefix_length(mask, "auto", input_ids, labels)
    assert chosen == (prefix if shares else 0)
    assert shared_prefix_length(mask, True) == prefix  # True always shares
    assert shared_prefix_length(mask, False) == 0  # False never


def test_auto_runs_distinct_prompts_whole():
    input_ids, labels, mask = grouped_batch(64, 1, 33, 9)  # U = B: nothing saved
    assert saved_positions(input_ids, labels, 32) == 0
    assert shared_prefix_length(mask, "auto", input_ids, labels) == 0


@pytest.mark.parametrize("value", ["yes", 1, None, "Auto"])
def test_share_prompt_prefix_takes_false_true_or_auto(value):
    mask = torch.ones(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r'False, True or "auto" .*got'):
        shared_prefix_length(mask, value)
    with pytest.raises(ValueError, match=r"share_prompt_prefix must be"):
        UpdateSettings(share_prompt_prefix=value)


def test_auto_needs_the_batch_ids():
    mask = torch.ones(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r'"auto" needs the batch.s input_ids'):
        shared_prefix_length(mask, "auto")


@pytest.mark.parametrize(
    ("prompts", "group_size", "prompt_len", "shares"),
    [(1, 16, 8, False), (8, 2, 8, False), (16, 16, 33, True)],
)  # saved positions: 105, 56, 7680
def test_an_update_with_auto_runs_the_path_it_picks(
    model, prompts, group_size, prompt_len, shares
):
    input_ids, labels, mask = grouped_batch(prompts, group_size, prompt_len, 4)
    batch = {"input_ids": input_ids, "labels": labels, "response_mask": mask}
    shapes = []
    hook = model.model.embed_tokens.register_forward_hook(
        lambda module, args, output: shapes.append(tuple(args[0].shape))
    )
    score_tokens(model, batch, UpdateSettings(share_prompt_prefix="auto"))
    hook.remove()
    rows, width = input_ids.shape
    c = prompt_len - 1
    expected = [(prompts, c), (rows, width - c)] if shares else [(rows, width)]
    assert shapes == expected


# --- float64: where shared and plain gradients part -------------------------------


def float64_gradients(model_seed: int, prefix_length: int):
    """Log-probs and parameter gradients of a float64 tiny Qwen2, 3 prompts x 4."""
    tokenizer = build_char_tokenizer()
    model = build_tiny_qwen2(tokenizer, hidden_size=16, num_layers=2, seed=model_seed)
    model = model.double()
    input_ids, labels, mask = grouped_batch(3, 4, 5, 4)
    log_probs = get_response_log_probs(
        model, input_ids, labels, shared_prefix_length=prefix_length
    )["log_probs"]  # (B, T)
    (log_probs * mask).sum().backward()
    return log_probs.detach(), {n: p.grad for n, p in model.named_parameters()}


def relative_gradient_gap(plain, shared) -> float:
    return max(
        float((plain[n] - shared[n]).abs().max() / plain[n].abs().max()) for n in plain
    )


def test_float64_gradients_part_only_by_the_norms_float32_rounding(monkeypatch):
    # transformers' RMSNorm computes in float32 whatever the model's dtype: run
    # whole, each row's gradient is rounded to float32 there before the G rows
    # add up in the prompt's parameters; shared, they add up first.
    plain_log_probs, plain = float64_gradients(0, 0)
    shared_log_probs, shared = float64_gradients(0, 4)
    assert torch.equal(plain_log_probs, shared_log_probs)
    as_transformers_computes = relative_gradient_gap(plain, shared)
    assert 1e-12 < as_transformers_computes < 1e-6  # float32 rounding, not float64

    def rms_norm_in_the_input_dtype(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return (
            self.weight * hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        )

    monkeypatch.setattr(Qwen2RMSNorm, "forward", rms_norm_in_the_input_dtype)
    _, plain = float64_gradients(0, 0)
    _, shared = float64_gradients(0, 4)
    assert relative_gradient_gap(plain, shared) < 1e-13  # float64 rounding
