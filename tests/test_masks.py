"""Tests for grpo_lab.masks: tokenize + shift + mask, the token-id path, masked means."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_lab.masks import (
    masked_mean,
    masked_normalize,
    pad_prompt_and_response_ids,
    tokenize_prompt_and_output,
)
from grpo_lab.models import build_bpe_tokenizer

# Character tokenizer ids: <pad>=0, <eos>=1, "0".."9" = 2..11, "a"=12, "b"=13,
# "c"=14, "d"=15.


def test_tokenize_shift_and_mask_by_hand(char_tokenizer):
    # "ab"+"c"  -> ids [12, 13, 14],     mask [0, 0, 1]
    # "a"+"bcd" -> ids [12, 13, 14, 15], mask [0, 1, 1, 1]
    # Right-pad to 4: [12, 13, 14, 0] with mask [0, 0, 1, 0].
    # input_ids = ids[:, :-1], labels = ids[:, 1:], response_mask = mask[:, 1:].
    batch = tokenize_prompt_and_output(["ab", "a"], ["c", "bcd"], char_tokenizer)
    assert batch["input_ids"].tolist() == [[12, 13, 14], [12, 13, 14]]
    assert batch["labels"].tolist() == [[13, 14, 0], [13, 14, 15]]
    assert batch["response_mask"].tolist() == [[0, 1, 0], [1, 1, 1]]
    assert all(value.dtype == torch.long for value in batch.values())


def test_response_mask_marks_exactly_the_response_labels(char_tokenizer):
    prompts, responses = ["12+3=", "7+", "99"], ["15", "0", "abc"]
    batch = tokenize_prompt_and_output(prompts, responses, char_tokenizer)
    for row, response in enumerate(responses):
        masked = batch["labels"][row][batch["response_mask"][row].bool()]
        assert char_tokenizer.decode(masked.tolist()) == response


def test_pad_ids_by_hand():
    # [5] + [6, 7] -> [5, 6, 7] mask [0, 1, 1]; [8, 9] + [3] -> [8, 9, 3] mask [0, 0, 1]
    # [4] + [] -> [4, pad, pad] mask [0, 0, 0] (pad = -1 here, to be visible).
    batch = pad_prompt_and_response_ids([[5], [8, 9], [4]], [[6, 7], [3], []], -1)
    assert batch["input_ids"].tolist() == [[5, 6], [8, 9], [4, -1]]
    assert batch["labels"].tolist() == [[6, 7], [9, 3], [-1, -1]]
    assert batch["response_mask"].tolist() == [[1, 1], [0, 1], [0, 0]]


def test_pad_ids_keeps_sampled_ids_that_bpe_would_re_encode_differently():
    tokenizer = build_bpe_tokenizer()
    prompt_ids = tokenizer.encode("What is 12 + 35?", add_special_tokens=False)
    # A sampler can emit "4" then "7" as two tokens; the text "47" re-encodes as
    # one merged token when the tokenizer has learnt that merge.
    merged = [
        token
        for token, token_id in tokenizer.get_vocab().items()
        if len(token) == 3 and token.startswith("Ġ") and token[1:].isdigit()
    ]
    changed = 0
    for token in merged:
        sampled = tokenizer.convert_tokens_to_ids([token[:2], token[2]])
        assert None not in sampled
        reencoded = tokenizer.encode(
            tokenizer.decode(sampled), add_special_tokens=False
        )
        changed += reencoded != sampled
        batch = pad_prompt_and_response_ids(
            [prompt_ids], [sampled], tokenizer.pad_token_id
        )
        response = batch["labels"][0][batch["response_mask"][0].bool()]
        assert response.tolist() == sampled
    assert len(merged) > 5
    assert changed == len(merged)


def test_tokenize_text_path_equals_id_path(char_tokenizer):
    prompts, responses = ["3+4=", "10+"], ["7", "xyz"]
    from_text = tokenize_prompt_and_output(prompts, responses, char_tokenizer)
    from_ids = pad_prompt_and_response_ids(
        [char_tokenizer.encode(p, add_special_tokens=False) for p in prompts],
        [char_tokenizer.encode(r, add_special_tokens=False) for r in responses],
        char_tokenizer.pad_token_id,
    )
    for key in from_text:
        assert torch.equal(from_text[key], from_ids[key])


def test_masked_mean_by_hand():
    tensor = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 0, 1], [0, 0, 1]])
    # all: (1 + 3 + 6) / 3 = 10 / 3
    assert masked_mean(tensor, mask).item() == pytest.approx(10 / 3)
    # dim=1: [(1 + 3) / 2, 6 / 1] = [2, 6]
    assert masked_mean(tensor, mask, dim=1).tolist() == [2.0, 6.0]
    # dim=0: [1 / 1, 0 / 0 = nan, (3 + 6) / 2 = 4.5]
    column_means = masked_mean(tensor, mask.bool(), dim=0)
    assert column_means[0] == 1.0 and column_means[2] == 4.5
    assert math.isnan(column_means[1])


def test_masked_normalize_by_hand():
    tensor = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 0, 1], [0, 0, 1]])
    # all: (1 + 3 + 6) / 2 = 5
    assert masked_normalize(tensor, mask, 2.0).item() == 5.0
    # dim=1: [(1 + 3) / 2, 6 / 2] = [2, 3]; dim=0: [1 / 2, 0 / 2, (3 + 6) / 2]
    assert masked_normalize(tensor, mask, 2.0, dim=1).tolist() == [2.0, 3.0]
    assert masked_normalize(tensor, mask, 2.0, dim=0).tolist() == [0.5, 0.0, 4.5]


@settings(max_examples=50, deadline=None)
@given(
    values=st.lists(
        st.tuples(st.floats(-100, 100), st.booleans()), min_size=1, max_size=12
    )
)
def test_masked_mean_and_normalize_match_python(values):
    tensor = torch.tensor([v for v, _ in values], dtype=torch.float64)
    mask = torch.tensor([m for _, m in values])
    kept = [v for v, m in values if m]
    if kept:
        expected = sum(kept) / len(kept)
        assert masked_mean(tensor, mask).item() == pytest.approx(expected, abs=1e-9)
    else:
        assert math.isnan(masked_mean(tensor, mask).item())
    assert masked_normalize(tensor, mask, 3.0).item() == pytest.approx(
        sum(kept) / 3.0, abs=1e-9
    )


def test_mask_errors(char_tokenizer):
    with pytest.raises(
        ValueError,
        match=r"prompt and output must have the same length.*2 prompts and 1",
    ):
        tokenize_prompt_and_output(["a", "b"], ["c"], char_tokenizer)
    with pytest.raises(ValueError, match=r"prompt_ids and response_ids.*got 1 and 2"):
        pad_prompt_and_response_ids([[1]], [[2], [3]], 0)
    with pytest.raises(
        ValueError, match=r"prompt_ids must hold at least one sequence, got 0"
    ):
        pad_prompt_and_response_ids([], [], 0)
    with pytest.raises(
        ValueError,
        match=r"at least one sequence of 2 or more.*got a longest sequence of 1",
    ):
        pad_prompt_and_response_ids([[1], [2]], [[], []], 0)
    with pytest.raises(ValueError, match=r"pad_token_id must be an integer.*got None"):
        pad_prompt_and_response_ids([[1, 2], [3]], [[4], [5]], None)
    with pytest.raises(
        ValueError, match=r"mask must have the shape of tensor \(2, 3\), got \(2, 2\)"
    ):
        masked_mean(torch.zeros(2, 3), torch.ones(2, 2))
    with pytest.raises(
        ValueError, match=r"mask must have the shape of tensor \(3,\), got \(1, 3\)"
    ):
        masked_normalize(torch.zeros(3), torch.ones(1, 3), 1.0)
    with pytest.raises(ValueError, match=r"normalize_constant must be nonzero, got 0"):
        masked_normalize(torch.zeros(3), torch.ones(3), 0)


def test_pad_without_pad_token_is_fine_when_nothing_needs_padding():
    batch = pad_prompt_and_response_ids([[1, 2], [3, 4]], [[5], [6]], None)
    assert batch["labels"].tolist() == [[2, 5], [4, 6]]
