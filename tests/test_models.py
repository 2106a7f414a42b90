"""Tests for grpo_lab.models: offline tokenizers, tiny models, the loading path."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from grpo_lab.models import (
    DEFAULT_CHARACTERS,
    CharTokenizer,
    build_bpe_tokenizer,
    build_char_tokenizer,
    build_tiny_model,
    build_tiny_olmo2,
    build_tiny_qwen2,
    load_pretrained,
    load_tokenizer,
    tokenizer_training_corpus,
)

SIZES = {"hidden_size": 32, "num_layers": 1, "num_heads": 4, "intermediate_size": 64}
SAMPLE_TEXTS = ["What is 12 + 35?", "<think> 7 </think> <answer> 42 </answer>", "a\nb"]


@pytest.fixture(scope="module")
def bpe_tokenizer():
    return build_bpe_tokenizer()


def test_char_tokenizer_layout_by_hand(char_tokenizer):
    # <pad> = 0, <eos> = 1, then DEFAULT_CHARACTERS in order: "0" = 2, "9" = 11,
    # "a" = 12. One token per character, no special tokens added.
    assert char_tokenizer.pad_token_id == 0 and char_tokenizer.eos_token_id == 1
    assert char_tokenizer.encode("09a", add_special_tokens=False) == [2, 11, 12]
    assert char_tokenizer.padding_side == "left"
    assert len(char_tokenizer) == 2 + len(DEFAULT_CHARACTERS)


@settings(max_examples=50, deadline=None)
@given(text=st.text(alphabet=DEFAULT_CHARACTERS, max_size=30))
def test_char_tokenizer_round_trips_one_token_per_character(char_tokenizer, text):
    ids = char_tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == len(text)
    assert char_tokenizer.decode(ids) == text


def test_char_tokenizer_custom_characters_and_errors():
    tokenizer = build_char_tokenizer("ab ab")  # duplicates are dropped
    assert len(tokenizer) == 5  # <pad>, <eos>, "a", "b", " "
    assert tokenizer.encode("b a", add_special_tokens=False) == [3, 4, 2]
    with pytest.raises(
        ValueError, match=r"characters must contain at least one character, got ''"
    ):
        build_char_tokenizer("")


def test_char_tokenizer_names_a_character_outside_its_alphabet():
    tokenizer = build_char_tokenizer("ab ")
    expected = "text must use only this character tokenizer's alphabet 'ab ', got "
    with pytest.raises(ValueError) as error:
        tokenizer.encode("a b\u00e9c", add_special_tokens=False)
    assert str(error.value) == expected + "'\u00e9c' outside it"
    with pytest.raises(ValueError) as error:
        tokenizer(["ab", "ba", "xx"])  # a batch: the unknown characters once
    assert str(error.value) == expected + "'x' outside it"
    assert tokenizer.alphabet() == "ab "


def test_char_tokenizer_keeps_its_class_and_errors_after_save_and_load(tmp_path):
    tokenizer = build_char_tokenizer("abc")
    tokenizer.save_pretrained(tmp_path)
    loaded = load_tokenizer(str(tmp_path))
    assert isinstance(loaded, CharTokenizer)
    assert loaded.encode("cab", add_special_tokens=False) == [4, 2, 3]
    with pytest.raises(ValueError, match=r"alphabet 'abc', got 'z' outside it"):
        loaded.encode("z")


@pytest.mark.parametrize("characters", [123, ["ab", "c"], None])
def test_char_tokenizer_characters_must_be_a_str(characters):
    with pytest.raises(
        ValueError,
        match=rf"characters must be a str .*got {type(characters).__name__}",
    ):
        build_char_tokenizer(characters)


def test_bpe_tokenizer_is_deterministic_and_depends_on_its_corpus(bpe_tokenizer):
    again = build_bpe_tokenizer()
    assert again.backend_tokenizer.to_str() == bpe_tokenizer.backend_tokenizer.to_str()
    assert build_bpe_tokenizer(seed=1).get_vocab() != bpe_tokenizer.get_vocab()
    assert tokenizer_training_corpus(3) == tokenizer_training_corpus(3)
    assert tokenizer_training_corpus(3) != tokenizer_training_corpus(4)


def test_bpe_tokenizer_layout_and_merges(bpe_tokenizer):
    assert bpe_tokenizer.pad_token_id == 0 and bpe_tokenizer.eos_token_id == 1
    assert len(bpe_tokenizer) == 512
    assert len(build_bpe_tokenizer(vocab_size=300)) == 300
    # Learnt merges: a corpus line takes far fewer tokens than characters.
    line = "What is 12 + 35? 12 + 35 = 47"
    assert len(bpe_tokenizer.encode(line, add_special_tokens=False)) < len(line) / 2
    assert bpe_tokenizer.tokenize(" answer") == ["Ġanswer"]


@settings(max_examples=50, deadline=None)
@given(text=st.text(max_size=30))
def test_bpe_tokenizer_round_trips_any_text(bpe_tokenizer, text):
    # Byte-level: characters never seen in training fall back to their bytes.
    ids = bpe_tokenizer.encode(text, add_special_tokens=False)
    assert bpe_tokenizer.decode(ids) == text


def test_bpe_tokenizer_errors():
    with pytest.raises(
        ValueError, match=r"vocab_size must be an int of at least 258 .*got 100"
    ):
        build_bpe_tokenizer(vocab_size=100)
    with pytest.raises(
        ValueError, match=r"num_lines must be a positive integer, got 0"
    ):
        tokenizer_training_corpus(num_lines=0)
    with pytest.raises(ValueError, match=r"vocab_size must be an int .*got '512'"):
        build_bpe_tokenizer(vocab_size="512")
    with pytest.raises(ValueError, match=r"num_lines must be a positive .*got 2\.5"):
        tokenizer_training_corpus(num_lines=2.5)


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_tokenizers_survive_save_and_load(
    kind, char_tokenizer, bpe_tokenizer, tmp_path
):
    tokenizer = char_tokenizer if kind == "char" else bpe_tokenizer
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    for text in SAMPLE_TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert loaded.encode(text, add_special_tokens=False) == ids
        assert loaded.decode(ids) == text
    assert (loaded.pad_token_id, loaded.eos_token_id) == (0, 1)
    assert loaded.padding_side == "left"
    assert len(loaded) == len(tokenizer)


@settings(max_examples=30, deadline=None)
@given(text=st.text(alphabet=DEFAULT_CHARACTERS, max_size=40))
def test_autotokenizer_reads_a_tiny_checkpoint_with_load_tokenizers_ids(
    tiny_checkpoint, text
):
    # A Qwen2 config makes AutoTokenizer build Qwen2Tokenizer (its own split,
    # byte-level symbols, NFC), whatever the saved class; the saved byte-level
    # form gives it the run's ids, runs of spaces and newlines included.
    folder, run_tokenizer = tiny_checkpoint
    auto, ours = AutoTokenizer.from_pretrained(folder), load_tokenizer(str(folder))
    assert type(auto).__name__ == "Qwen2Tokenizer" and isinstance(ours, CharTokenizer)
    text = f"Reverse 12345:  \n\n{text} <eos>"
    ids = run_tokenizer.encode(text, add_special_tokens=False)
    assert auto.encode(text, add_special_tokens=False) == ids
    assert ours.encode(text, add_special_tokens=False) == ids
    assert auto.decode(ids) == ours.decode(ids) == run_tokenizer.decode(ids) == text


def test_a_reloaded_char_tokenizer_keeps_its_alphabet_and_errors(tiny_checkpoint):
    folder, run_tokenizer = tiny_checkpoint
    loaded = load_tokenizer(str(folder))
    assert loaded.alphabet() == run_tokenizer.alphabet() == DEFAULT_CHARACTERS
    assert (loaded.pad_token_id, loaded.eos_token_id) == (0, 1)
    with pytest.raises(ValueError, match=r"got '\u00e9' outside it"):
        loaded.encode("caf\u00e9")  # the byte-level backend alone would drop it


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A checkpoint folder as the loop writes it (tiny Qwen2 + char tokenizer)."""
    from grpo_lab.training.checkpoint import save_pretrained_atomically

    tokenizer = build_char_tokenizer()
    model = build_tiny_qwen2(tokenizer, **SIZES)
    folder = tmp_path_factory.mktemp("checkpoint") / "step_000001"
    save_pretrained_atomically(model, tokenizer, folder)
    return folder, tokenizer


@pytest.mark.parametrize("builder", [build_tiny_qwen2, build_tiny_olmo2])
def test_model_builders_are_seeded(builder, char_tokenizer):
    first = builder(char_tokenizer, seed=0, **SIZES).state_dict()
    same = builder(char_tokenizer, seed=0, **SIZES).state_dict()
    other = builder(char_tokenizer, seed=1, **SIZES).state_dict()
    assert all(torch.equal(first[key], same[key]) for key in first)
    assert not torch.equal(
        first["model.embed_tokens.weight"], other["model.embed_tokens.weight"]
    )


def test_model_builders_leave_the_global_generator_alone(char_tokenizer):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_qwen2(char_tokenizer, seed=7, **SIZES)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize(
    ("architecture", "model_type"), [("qwen2", "qwen2"), ("olmo2", "olmo2")]
)
def test_build_tiny_model_by_name(architecture, model_type, bpe_tokenizer):
    model = build_tiny_model(architecture, bpe_tokenizer, seed=3, **SIZES)
    assert model.config.model_type == model_type
    assert model.config.vocab_size == len(bpe_tokenizer)
    assert model.config.pad_token_id == 0 and model.config.eos_token_id == 1
    logits = model(torch.tensor([[5, 6, 7], [8, 9, 10]])).logits  # (2, 3, V)
    assert logits.shape == (2, 3, len(bpe_tokenizer))
    builder = build_tiny_qwen2 if architecture == "qwen2" else build_tiny_olmo2
    direct = builder(bpe_tokenizer, seed=3, **SIZES).state_dict()
    assert all(
        torch.equal(value, direct[key]) for key, value in model.state_dict().items()
    )


def test_model_builder_errors(char_tokenizer):
    with pytest.raises(
        ValueError,
        match=r"architecture must be one of \('qwen2', 'olmo2'\), got 'gpt2'",
    ):
        build_tiny_model("gpt2", char_tokenizer)
    with pytest.raises(
        ValueError,
        match=r"hidden_size must be num_heads times an even head size.*hidden_size=30 and num_heads=4",
    ):
        build_tiny_qwen2(char_tokenizer, hidden_size=30, num_heads=4)
    with pytest.raises(
        ValueError,
        match=r"hidden_size must be num_heads times an even head size.*hidden_size=12 and num_heads=4",
    ):
        build_tiny_olmo2(char_tokenizer, hidden_size=12, num_heads=4)  # head size 3
    with pytest.raises(
        ValueError,
        match=r"num_heads must be a multiple of num_kv_heads, got num_heads=4 and num_kv_heads=3",
    ):
        build_tiny_qwen2(char_tokenizer, hidden_size=32, num_heads=4, num_kv_heads=3)
    with pytest.raises(
        ValueError, match=r"num_layers must be a positive integer, got 0"
    ):
        build_tiny_olmo2(char_tokenizer, num_layers=0)


@pytest.mark.parametrize(
    ("architecture", "kind"), [("qwen2", "char"), ("qwen2", "bpe"), ("olmo2", "bpe")]
)
def test_load_pretrained_reads_a_local_directory(
    architecture, kind, char_tokenizer, bpe_tokenizer, tmp_path
):
    # Next to a Qwen2 config, AutoTokenizer would rebuild these tokenizers with
    # Qwen2's pre-tokenizer (spaces dropped, digits split): the ids must not move.
    tokenizer = char_tokenizer if kind == "char" else bpe_tokenizer
    model = build_tiny_model(architecture, tokenizer, seed=5, **SIZES)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded_model, loaded_tokenizer = load_pretrained(str(tmp_path))
    assert loaded_model.config.model_type == architecture
    assert next(loaded_model.parameters()).dtype == torch.float32  # dtype="auto"
    expected = model.state_dict()
    assert all(
        torch.equal(value, expected[key])
        for key, value in loaded_model.state_dict().items()
    )
    for text in SAMPLE_TEXTS:
        ids = loaded_tokenizer.encode(text, add_special_tokens=False)
        assert ids == tokenizer.encode(text, add_special_tokens=False)
        assert loaded_tokenizer.decode(ids) == text
    assert loaded_tokenizer.padding_side == "left"
    with torch.no_grad():
        torch.testing.assert_close(
            loaded_model.eval()(torch.tensor([ids])).logits,
            model.eval()(torch.tensor([ids])).logits,
        )


def test_load_pretrained_pads_with_eos_when_there_is_no_pad_token(
    char_tokenizer, tmp_path
):
    build_tiny_qwen2(char_tokenizer, **SIZES).save_pretrained(tmp_path)
    tokenizer = build_char_tokenizer()
    tokenizer.pad_token = None
    tokenizer.save_pretrained(tmp_path)
    model, loaded = load_pretrained(str(tmp_path), dtype=torch.bfloat16)
    assert loaded.pad_token_id == loaded.eos_token_id == 1
    assert load_tokenizer(str(tmp_path)).pad_token_id == 1
    assert next(model.parameters()).dtype == torch.bfloat16
