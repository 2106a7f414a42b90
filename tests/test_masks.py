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
    for constant in (0, math.nan, math.inf, None):
        with pytest.raises(
            ValueError,
            match=rf"normalize_constant must be a finite nonzero number, got {constant}",
        ):
            masked_normalize(torch.zeros(3), torch.ones(3), constant)


def test_a_str_is_not_a_list_of_texts(char_tokenizer):
    # Before this check, "ab" became two prompts, "a" and "b".
    with pytest.raises(ValueError, match=r"prompt must be a list of str .*got str"):
        tokenize_prompt_and_output("ab", "cd", char_tokenizer)
    with pytest.raises(ValueError, match=r"output must be a list of str .*got str"):
        tokenize_prompt_and_output(["a", "b"], "cd", char_tokenizer)
    with pytest.raises(ValueError, match=r"output\[1\] must be a str, got NoneType"):
        tokenize_prompt_and_output(["a", "b"], ["c", None], char_tokenizer)


def test_text_the_tokenizer_cannot_encode_is_named_by_argument_and_index(
    char_tokenizer,
):
    with pytest.raises(ValueError) as error:
        tokenize_prompt_and_output(["ab", "cd"], ["e", "f\u00e9"], char_tokenizer)
    message = str(error.value)
    assert message.startswith("output[1] must be text the tokenizer can encode")
    assert "got 'f\u00e9'" in message and "got '\u00e9' outside it" in message


def test_token_ids_must_be_ints_in_lists():
    with pytest.raises(ValueError, match=r"prompt_ids\[0\]\[1\] must be an int .*2\.0"):
        pad_prompt_and_response_ids([[1, 2.0]], [[3]], 0)  # not truncated to 2
    with pytest.raises(ValueError, match=r"response_ids\[0\] must be a list .*Tensor"):
        pad_prompt_and_response_ids([[1]], [torch.tensor([2, 3])], 0)  # not 1 + [2, 3]
    with pytest.raises(ValueError, match=r"prompt_ids must be a list .*got Tensor"):
        pad_prompt_and_response_ids(torch.ones(2, 2, dtype=torch.long), [[1], [2]], 0)
    with pytest.raises(ValueError, match=r"pad_token_id must be an int .*got 0\.5"):
        pad_prompt_and_response_ids([[1, 2], [3]], [[4], [5]], 0.5)


def test_tuples_of_ids_pad_like_lists():
    as_lists = pad_prompt_and_response_ids([[5], [8, 9]], [[6, 7], [3]], 0)
    as_tuples = pad_prompt_and_response_ids([(5,), (8, 9)], ([6, 7], (3,)), 0)
    for key in as_lists:
        assert torch.equal(as_tuples[key], as_lists[key])


def test_pad_without_pad_token_is_fine_when_nothing_needs_padding():
    batch = pad_prompt_and_response_ids([[1, 2], [3, 4]], [[5], [6]], None)
    assert batch["labels"].tolist() == [[2, 5], [4, 6]]


# ------------------------------------------------- masked reductions: invariants

MASK_DTYPES = [torch.bool, torch.long, torch.float32]
VALUE_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
INT_VIEW = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
}


def reference_masked_mean(tensor, mask, dim=None):
    """The reduction as the reference design writes it: sum(x * m) / sum(m)."""
    mask = mask.to(tensor.dtype)
    return (tensor * mask).sum(dim=dim) / mask.sum(dim=dim)


def reference_masked_normalize(tensor, mask, normalize_constant, dim=None):
    return (tensor * mask.to(tensor.dtype)).sum(dim=dim) / normalize_constant


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bit pattern: tells -0.0 from 0.0 and compares NaN to NaN."""
    return tensor.contiguous().view(INT_VIEW[tensor.dtype])


def random_masked_case(seed, shape, dtype, mask_dtype):
    """Values with negatives, zeros and -0.0; a random mask, some rows all out."""
    generator = torch.Generator().manual_seed(seed)
    tensor = (100 * torch.randn(shape, generator=generator, dtype=torch.float64)).to(
        dtype
    )
    tensor.view(-1)[::5] = 0.0
    tensor.view(-1)[1::7] = -0.0
    mask = torch.rand(shape, generator=generator) < 0.6
    if len(shape) == 2:
        mask[0] = False  # an empty row: NaN in masked_mean, 0 in masked_normalize
    return tensor, mask.to(mask_dtype)


shapes = st.sampled_from([(1,), (7,), (1, 1), (3, 5), (4, 1), (1, 9), (6, 33)])
dims_for = {1: [None, 0, -1], 2: [None, 0, 1, -1, (0, 1)]}


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    shape=shapes,
    dtype=st.sampled_from(VALUE_DTYPES),
    mask_dtype=st.sampled_from(MASK_DTYPES),
    data=st.data(),
)
def test_finite_inputs_give_the_reference_bits(seed, shape, dtype, mask_dtype, data):
    dim = data.draw(st.sampled_from(dims_for[len(shape)]))
    tensor, mask = random_masked_case(seed, shape, dtype, mask_dtype)
    assert torch.equal(
        bits(masked_mean(tensor, mask, dim)),
        bits(reference_masked_mean(tensor, mask, dim)),
    )
    for constant in (1, 3.0, -0.5):
        assert torch.equal(
            bits(masked_normalize(tensor, mask, constant, dim)),
            bits(reference_masked_normalize(tensor, mask, constant, dim)),
        )


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    shape=shapes,
    dtype=st.sampled_from(VALUE_DTYPES),
    mask_dtype=st.sampled_from(MASK_DTYPES),
    fill=st.one_of(
        st.sampled_from([math.inf, -math.inf, math.nan]), st.floats(-1e4, 1e4)
    ),
    data=st.data(),
)
def test_masked_out_entries_never_change_the_result(
    seed, shape, dtype, mask_dtype, fill, data
):
    dim = data.draw(st.sampled_from(dims_for[len(shape)]))
    tensor, mask = random_masked_case(seed, shape, dtype, mask_dtype)
    zeroed = tensor.masked_fill(mask == 0, 0.0)
    filled = tensor.masked_fill(mask == 0, fill)
    assert torch.equal(
        bits(masked_mean(filled, mask, dim)), bits(masked_mean(zeroed, mask, dim))
    )
    assert torch.equal(
        bits(masked_normalize(filled, mask, 2.0, dim)),
        bits(masked_normalize(zeroed, mask, 2.0, dim)),
    )


def test_inf_and_nan_where_masked_out_by_hand():
    # Masked in: 1, 3 and 6. Mean 10 / 3, row means [2, 6]; sum / 2 = 5.
    mask = torch.tensor([[1, 0, 1], [0, 0, 1]])
    tensor = torch.tensor([[1.0, math.inf, 3.0], [math.nan, -math.inf, 6.0]])
    assert masked_mean(tensor, mask).item() == pytest.approx(10 / 3)
    assert masked_mean(tensor, mask.bool(), dim=1).tolist() == [2.0, 6.0]
    assert masked_normalize(tensor, mask.float(), 2.0).item() == 5.0
    # dim=0: [1 / 2, nothing masked in (0), (3 + 6) / 2]
    assert masked_normalize(tensor, mask, 2.0, dim=0).tolist() == [0.5, 0.0, 4.5]


def test_gradients_ignore_masked_out_entries():
    mask = torch.tensor([[1, 0, 1], [0, 0, 1]])
    tensor = torch.tensor(
        [[1.0, math.inf, 3.0], [math.nan, -math.inf, 6.0]], requires_grad=True
    )
    (masked_mean(tensor, mask) + masked_normalize(tensor, mask, 2.0)).backward()
    # d/dx of mean = 1/3 and of sum / 2 = 1/2 on masked-in entries; 0 elsewhere.
    expected = mask * (1 / 3 + 1 / 2)
    torch.testing.assert_close(tensor.grad, expected.float())


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(
        st.lists(
            st.tuples(st.floats(-100, 100), st.booleans()), min_size=3, max_size=3
        ),
        min_size=1,
        max_size=5,
    )
)
def test_row_means_are_the_means_of_the_selected_entries(rows):
    tensor = torch.tensor([[v for v, _ in row] for row in rows], dtype=torch.float64)
    mask = torch.tensor([[m for _, m in row] for row in rows])
    means = masked_mean(tensor, mask, dim=1)
    for row, mean in zip(rows, means.tolist()):
        kept = [v for v, m in row if m]
        if kept:
            assert mean == pytest.approx(sum(kept) / len(kept), abs=1e-9)
        else:
            assert math.isnan(mean)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    scale=st.floats(-10, 10),
    constant=st.one_of(st.floats(-10, -0.1), st.floats(0.1, 10)),
    dim=st.sampled_from([None, 0, 1]),
)
def test_masked_normalize_is_linear(seed, scale, constant, dim):
    # f(a x + y) = a f(x) + f(y), and f with constant c is f with 1, over c.
    generator = torch.Generator().manual_seed(seed)
    x, y = torch.randn(2, 4, 6, generator=generator, dtype=torch.float64)
    mask = torch.rand(4, 6, generator=generator) < 0.5
    combined = masked_normalize(scale * x + y, mask, constant, dim)
    separate = scale * masked_normalize(x, mask, constant, dim) + masked_normalize(
        y, mask, constant, dim
    )
    torch.testing.assert_close(combined, separate, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(
        masked_normalize(x, mask, constant, dim),
        masked_normalize(x, mask, 1.0, dim) / constant,
    )


@pytest.mark.parametrize("dtype", VALUE_DTYPES)
def test_bool_int_and_float_masks_agree(dtype):
    tensor, mask = random_masked_case(3, (5, 8), dtype, torch.bool)
    for other in (mask.long(), mask.float(), mask.to(dtype)):
        assert torch.equal(
            bits(masked_mean(tensor, other, 1)), bits(masked_mean(tensor, mask, 1))
        )
        assert torch.equal(
            bits(masked_normalize(tensor, other, 4.0)),
            bits(masked_normalize(tensor, mask, 4.0)),
        )
