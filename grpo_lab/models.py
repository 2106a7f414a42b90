"""Tiny offline tokenizers and causal LMs, and the real-model loading path.

Nothing here downloads: tests, CI and the CPU profile build everything locally.
The character tokenizer makes every string one token per character, so text and
token ids convert both ways without surprises; the byte-level BPE tokenizer
behaves like a real one (several characters per token, and decode -> encode need
not give back the sampled ids). Taught in ``notebooks/00_welcome_and_setup.ipynb``.
"""

from __future__ import annotations

import random
import re
import string
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Olmo2Config,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
)
from transformers.models.auto.tokenization_auto import get_tokenizer_config

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
DEFAULT_CHARACTERS = string.digits + string.ascii_letters + string.punctuation + " \n"
BYTE_LEVEL_ALPHABET_SIZE = 256
GENERIC_TOKENIZER_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
_CORPUS_WORDS = (
    "the answer is a number sum of and plus minus times equals reverse digits "
    "what let then so we get first add subtract multiply divide total each "
    "step think check result question problem solve find value"
)
TOKENIZER_FILE = "tokenizer.json"
# Qwen2's pre-tokenizer split (transformers' Qwen2Tokenizer uses this pattern).
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# A hub model name: "name" or "owner/name" (letters, digits, "-", "_", ".").
_HUB_MODEL_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


class CharTokenizer(PreTrainedTokenizerFast):
    """The character tokenizer: text outside its alphabet gets a clear error.

    The backend has no unknown token, so it would drop or refuse such text
    without naming the character; this checks first and names both. Everything
    else is ``PreTrainedTokenizerFast``. Saved, it records ``CharTokenizer`` as its
    class, which :func:`load_tokenizer` reads back as this class, and an ASCII
    alphabet is written in the byte-level form (:func:`byte_level_char_backend`)
    that ``AutoTokenizer`` rebuilds as a Qwen2 tokenizer with the same ids.
    """

    def _encode_plus(self, text, text_pair=None, *args, **kwargs):
        unknown = self._unknown_characters([text, text_pair])
        if unknown:
            raise ValueError(
                f"text must use only this character tokenizer's alphabet "
                f"{self.alphabet()!r}, got {unknown!r} outside it"
            )
        return super()._encode_plus(text, text_pair, *args, **kwargs)

    def alphabet(self) -> str:
        """The characters with a token, in id order (special tokens left out)."""
        special = set(self.all_special_tokens)
        vocab = sorted(self.get_vocab().items(), key=lambda item: item[1])
        decoder = self.backend_tokenizer.decoder
        return "".join(decoder.decode([t]) for t, _ in vocab if t not in special)

    def _unknown_characters(self, texts) -> str:
        """The characters of ``texts`` (str, or lists of them) without a token."""
        known = self._alphabet_set()
        characters = _characters(texts, tuple(self.all_special_tokens))
        return "".join(dict.fromkeys(c for c in characters if c not in known))

    def _alphabet_set(self) -> frozenset[str]:
        cached = getattr(self, "_cached_alphabet", None)
        if cached is None or cached[0] != len(self):
            cached = (len(self), frozenset(self.alphabet()))
            self._cached_alphabet = cached
        return cached[1]

    def save_pretrained(self, save_directory, *args, **kwargs):
        """``save_pretrained``; an ASCII alphabet's tokenizer.json is byte-level."""
        written = super().save_pretrained(save_directory, *args, **kwargs)
        if self.alphabet().isascii():
            backend = byte_level_char_backend(self)
            backend.save(str(Path(save_directory) / TOKENIZER_FILE))
        return written


def byte_level_char_backend(tokenizer: CharTokenizer) -> Tokenizer:
    """The character tokenizer as a byte-level BPE without merges, Qwen2's pipeline.

    ``AutoTokenizer`` opens any folder whose config is a Qwen2 model as
    ``Qwen2Tokenizer``, which keeps a tokenizer.json's vocabulary and merges but
    puts its own normalizer (NFC), pre-tokenizer (Qwen2's split, then byte-level)
    and decoder in front. This backend is that pipeline over the alphabet's
    byte-level symbols (" " is "Ġ", "\\n" is "Ċ") with the same ids and no merges,
    so every ASCII character stays one token with its id under both classes.
    """
    special = list(tokenizer.all_special_tokens)
    decoder = tokenizer.backend_tokenizer.decoder
    to_symbol = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    vocab = {}
    for token, token_id in tokenizer.get_vocab().items():
        if token not in special:
            ((token, _),) = to_symbol.pre_tokenize_str(decoder.decode([token]))
        vocab[token] = token_id
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(special)
    return backend


def _characters(texts, special_tokens: tuple[str, ...] = ()) -> Iterator[str]:
    """The characters of ``texts`` (str, or lists of them), special tokens cut."""
    if isinstance(texts, str):
        for token in special_tokens:
            texts = texts.replace(token, "")
        yield from texts
    elif isinstance(texts, (list, tuple)):
        for text in texts:
            yield from _characters(text, special_tokens)


def build_char_tokenizer(characters: str = DEFAULT_CHARACTERS) -> CharTokenizer:
    """One token per character, plus ``<pad>`` (id 0) and ``<eos>`` (id 1).

    Encoding a character outside ``characters`` raises a ValueError that names it.
    """
    if not isinstance(characters, str):
        raise ValueError(
            "characters must be a str (one token per character), "
            f"got {type(characters).__name__}"
        )
    unique = list(dict.fromkeys(characters))
    if not unique:
        raise ValueError("characters must contain at least one character, got ''")
    vocab = {PAD_TOKEN: 0, EOS_TOKEN: 1}
    vocab.update({char: index + 2 for index, char in enumerate(unique)})
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return _wrap_tokenizer(backend, CharTokenizer)


def build_bpe_tokenizer(
    vocab_size: int = 512,
    corpus: Iterable[str] | None = None,
    seed: int = 0,
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained here, in well under a second.

    Byte-level: any text encodes (unknown characters fall back to their UTF-8
    bytes), like GPT-2, Qwen2 or OLMo2 tokenizers. ``<pad>`` is id 0, ``<eos>`` id
    1, then the 256 byte tokens, then merges learnt from ``corpus`` (default:
    :func:`tokenizer_training_corpus` with ``seed``: numbers, arithmetic, words
    and math text). The same arguments always give the same tokenizer.
    """
    minimum = 2 + BYTE_LEVEL_ALPHABET_SIZE
    if not _is_int(vocab_size) or vocab_size < minimum:
        raise ValueError(
            f"vocab_size must be an int of at least {minimum} (2 special tokens + "
            f"256 bytes), got {vocab_size!r}"
        )
    texts = list(corpus) if corpus is not None else tokenizer_training_corpus(seed)
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return _wrap_tokenizer(backend)


def tokenizer_training_corpus(seed: int = 0, num_lines: int = 2000) -> list[str]:
    """Deterministic lines of numbers, arithmetic, words and math text."""
    if not _is_int(num_lines) or num_lines < 1:
        raise ValueError(f"num_lines must be a positive integer, got {num_lines!r}")
    rng = random.Random(seed)
    makers = (_arithmetic_line, _digits_line, _words_line, _math_line)
    return [makers[index % len(makers)](rng) for index in range(num_lines)]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _arithmetic_line(rng: random.Random) -> str:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return f"What is {a} + {b}? {a} + {b} = {a + b}"


def _digits_line(rng: random.Random) -> str:
    digits = "".join(rng.choice(string.digits) for _ in range(5))
    return f"Reverse {digits}: {digits[::-1]}"


def _words_line(rng: random.Random) -> str:
    return " ".join(rng.choices(_CORPUS_WORDS.split(), k=8)).capitalize() + "."


def _math_line(rng: random.Random) -> str:
    x, y = rng.randint(1, 20), rng.randint(1, 20)
    return (
        f"<think> Let x = {x}, so {y}x = {x * y}. </think> "
        f"<answer> \\boxed{{{x * y}}} </answer>"
    )


def _wrap_tokenizer(
    backend: Tokenizer, wrapper: type[PreTrainedTokenizerFast] = PreTrainedTokenizerFast
) -> PreTrainedTokenizerFast:
    return wrapper(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )


# The tiny Qwen2's attention heads and key/value heads (the loop's tiny model).
TINY_ATTENTION_HEADS = (4, 2)


def build_tiny_qwen2(
    tokenizer: PreTrainedTokenizerBase,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = TINY_ATTENTION_HEADS[0],
    num_kv_heads: int = TINY_ATTENTION_HEADS[1],
    intermediate_size: int = 256,
    max_position_embeddings: int = 256,
    seed: int = 0,
    tie_word_embeddings: bool = True,
) -> PreTrainedModel:
    """A Qwen2-shaped causal LM with random weights, identical for a given seed.

    The vocabulary is the tokenizer's; the global torch RNG is left untouched.
    """
    _check_sizes(hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    return _seeded_model(config, seed)


def build_tiny_olmo2(
    tokenizer: PreTrainedTokenizerBase,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int = 256,
    max_position_embeddings: int = 256,
    seed: int = 0,
) -> PreTrainedModel:
    """An OLMo2-shaped causal LM with random weights, identical for a given seed.

    OLMo2 normalizes queries and keys and places its norms after each block; its
    logits are exactly lm_head(hidden), so chunked scoring applies to it.
    """
    _check_sizes(hidden_size, num_layers, num_heads, num_heads, intermediate_size)
    config = Olmo2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    return _seeded_model(config, seed)


TINY_MODEL_BUILDERS: dict[str, Callable[..., PreTrainedModel]] = {
    "qwen2": build_tiny_qwen2,
    "olmo2": build_tiny_olmo2,
}


def build_tiny_model(
    architecture: str, tokenizer: PreTrainedTokenizerBase, **sizes: int
) -> PreTrainedModel:
    """``build_tiny_qwen2`` or ``build_tiny_olmo2`` by name; ``sizes`` go through."""
    if architecture not in TINY_MODEL_BUILDERS:
        raise ValueError(
            f"architecture must be one of {tuple(TINY_MODEL_BUILDERS)}, "
            f"got {architecture!r}"
        )
    return TINY_MODEL_BUILDERS[architecture](tokenizer, **sizes)


def _check_sizes(
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
) -> None:
    sizes = {
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "intermediate_size": intermediate_size,
    }
    for name, value in sizes.items():
        if value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value}")
    if hidden_size % num_heads or (hidden_size // num_heads) % 2:
        raise ValueError(
            "hidden_size must be num_heads times an even head size (rotary "
            f"embeddings rotate pairs), got hidden_size={hidden_size} and "
            f"num_heads={num_heads}"
        )
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads must be a multiple of num_kv_heads, got num_heads="
            f"{num_heads} and num_kv_heads={num_kv_heads}"
        )


def _seeded_model(config, seed: int) -> PreTrainedModel:
    # Fork only the CPU generator: weights are created on the CPU.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config).eval()


def load_pretrained(
    name_or_path: str, dtype: torch.dtype | str = "auto", **kwargs
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The real-model path: ``from_pretrained`` on a hub name or a local directory.

    Returns (model, tokenizer from :func:`load_tokenizer`). ``dtype="auto"`` keeps
    the checkpoint's dtype; other keyword arguments go to
    ``AutoModelForCausalLM.from_pretrained``.
    """
    check_model_path(name_or_path)
    tokenizer = load_tokenizer(name_or_path)
    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype, **kwargs)
    return model, tokenizer


def check_model_path(name_or_path: str) -> None:
    """FileNotFoundError when ``name_or_path`` is a path that does not exist.

    Anything that is not shaped like a hub name (``owner/name``), such as
    ``./model``, ``/data/model`` or ``a/b/c``, is a local path.
    """
    if Path(name_or_path).exists() or _HUB_MODEL_NAME.match(name_or_path):
        return
    raise FileNotFoundError(
        f"model path {name_or_path!r} does not exist; a hub model is named "
        "owner/name, e.g. Qwen/Qwen2.5-Math-1.5B"
    )


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """``AutoTokenizer.from_pretrained``, except for generic saved tokenizers.

    A directory whose tokenizer was saved as :class:`CharTokenizer` or as the
    generic ``tokenizers`` wrapper (the tokenizers of this module) is loaded as
    exactly that: next to a Qwen2 config, ``AutoTokenizer`` would rebuild it as a
    Qwen2 tokenizer with Qwen2's pre-tokenizer, which changes its ids. A tokenizer
    without a pad token pads with its eos token.
    """
    tokenizer_class = get_tokenizer_config(name_or_path).get("tokenizer_class")
    if tokenizer_class == CharTokenizer.__name__:
        tokenizer = CharTokenizer.from_pretrained(name_or_path)
    elif tokenizer_class in GENERIC_TOKENIZER_CLASSES:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(name_or_path)
    else:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
