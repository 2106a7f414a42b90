"""Checks for ``notebooks/00_welcome_and_setup.ipynb``.

The exercise: a prompt's greedy continuation, as text. It composes the
notebook's pieces: the tokenizer (a prompt's ids, ``<eos>``, decoding), the
model's logits at the last position scoring the next token, greedy decoding,
and sampling without autograd. The reference is the check's own loop
(:func:`reference_continuation`); library routes (``generate``) are hidden
while the answer runs.

The check's models are tiny Qwen2s. Two of them follow a script: a forward
hook raises the logit of the token the script wants after a given prefix (its
answer, then ``<eos>``, then more text), so that a continuation stops at
``<eos>`` only if the answer stops there, and depends on the whole prefix, not
on the last token alone. The hook reads the whole prefix with or without a
key-value cache (``generate``'s, or the student's own), and it records whether
autograd was recording while the model ran: generation trains nothing.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo_lab.models import build_char_tokenizer, build_tiny_qwen2
from grpo_lab.teaching.checks.framework import (
    CaseCount,
    ExerciseFailed,
    assert_close,
    exercise_check,
)

# The buffer that says whether autograd recorded while the model ran.
_RECORDED = "autograd_recorded_while_generating"
# The logit added to the token a script wants after a prefix.
_SCRIPT_LOGIT = 100.0
# (prompt, what the scripted model writes after it; "|" is <eos>, max_new_tokens):
# an answer, then <eos>, then more text that only a continuation past <eos> shows.
_SCRIPTED_CASES = (
    ("12+7=", "19|zz", 4),
    ("9*9=", "81|zz", 1),
)


def reference_continuation(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompt: str,
    max_new_tokens: int,
) -> str:
    """The greedy continuation of ``prompt``: at most ``max_new_tokens``
    tokens, each the argmax of the logits at the last position, stopping at
    (and leaving out) ``<eos>``; decoded without the prompt."""
    return tokenizer.decode(_greedy_ids(model, tokenizer, prompt, max_new_tokens))


def _greedy_ids(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompt: str,
    max_new_tokens: int,
    stop: bool = True,
) -> list[int]:
    """The greedy tokens after ``prompt``; with ``stop``, up to ``<eos>``."""
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    new: list[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([ids + new])).logits  # (1, T, V)
            token = int(logits[0, -1].argmax())
            if stop and token == tokenizer.eos_token_id:
                break
            new.append(token)
    return new


class _Watch:
    """Forward hooks on a model: the script's logit (when there is a script)
    and whether autograd recorded while the model ran."""

    def __init__(
        self,
        model: PreTrainedModel,
        script: dict[tuple[int, ...], int],
    ) -> None:
        self.script = script
        self.history: torch.Tensor | None = None
        self.past_length = 0
        # A buffer, not an attribute: a grader that runs the answer in another
        # process sends a module's buffers back.
        model.register_buffer(_RECORDED, torch.zeros((), dtype=torch.bool), False)
        model.register_forward_pre_hook(self.before, with_kwargs=True)
        model.register_forward_hook(self.after, with_kwargs=True)

    def before(self, module: Any, args: tuple, kwargs: dict) -> None:
        if torch.is_grad_enabled():
            module.get_buffer(_RECORDED).fill_(True)
        past = kwargs.get("past_key_values")
        length = past.get_seq_length() if hasattr(past, "get_seq_length") else 0
        self.past_length = int(length or 0)

    def after(self, module: Any, args: tuple, kwargs: dict, output: Any) -> Any:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if not self.script or not isinstance(ids, torch.Tensor):
            return output
        ids = ids.detach().cpu()
        earlier = self.history
        if earlier is not None and 0 < self.past_length == earlier.shape[1]:
            ids = torch.cat([earlier, ids], dim=1)  # the cache holds what we saw
        self.history = ids
        start = ids.shape[1] - output.logits.shape[1]
        boost = torch.zeros(output.logits.shape[0], output.logits.shape[1], 1)
        wanted = torch.zeros(output.logits.shape[:2], dtype=torch.long)
        for row in range(ids.shape[0]):
            for column in range(output.logits.shape[1]):
                prefix = tuple(ids[row, : start + column + 1].tolist())
                if prefix in self.script:
                    wanted[row, column] = self.script[prefix]
                    boost[row, column] = _SCRIPT_LOGIT
        logits = output.logits
        vocabulary = torch.arange(logits.shape[-1])
        bonus = boost * (vocabulary == wanted.unsqueeze(-1))  # (B, T, V)
        output.logits = logits + bonus.to(logits.device, logits.dtype)
        return output


def _script(
    tokenizer: PreTrainedTokenizerBase, prompt: str, written: str
) -> dict[tuple[int, ...], int]:
    """prefix ids -> the next token id, along ``prompt`` + ``written``."""
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    script = {}
    for piece in written:
        if piece == "|":
            token = tokenizer.eos_token_id
        else:
            (token,) = tokenizer.encode(piece, add_special_tokens=False)
        script[tuple(ids)] = token
        ids = [*ids, token]
    return script


@functools.cache
def _tiny_model() -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model every case copies (a copy per case: an answer that changes
    its model changes no other case)."""
    tokenizer = build_char_tokenizer()
    return build_tiny_qwen2(tokenizer, hidden_size=32, num_layers=1, seed=0), tokenizer


def _models() -> list[tuple[str, PreTrainedModel, Any, str, int, _Watch]]:
    """(name, model, tokenizer, prompt, max_new_tokens, watch) per case."""
    base, tokenizer = _tiny_model()
    plain = copy.deepcopy(base)
    cases = [("the tiny model", plain, "12+7=", 4, _Watch(plain, {}))]
    for prompt, written, max_new_tokens in _SCRIPTED_CASES:
        model = copy.deepcopy(base)
        shown = written.replace("|", "<eos>")
        name = f"a model that writes {shown!r} after {prompt!r}"
        watch = _Watch(model, _script(tokenizer, prompt, written))
        cases.append((name, model, prompt, max_new_tokens, watch))
    return [(n, m, tokenizer, p, k, w) for n, m, p, k, w in cases]


@exercise_check("Exercise 00-greedy_continuation (a prompt's greedy continuation)")
def check_greedy_continuation(
    student_fn: Callable[[PreTrainedModel, Any, str, int], str],
    cases: CaseCount,
) -> None:
    """``student_fn(model, tokenizer, prompt, max_new_tokens)`` -> the text
    greedy decoding appends to ``prompt`` (without the prompt and without
    ``<eos>``), with autograd off while the model runs."""
    for name, model, tokenizer, prompt, max_new_tokens, _ in _models():
        with cases.case():
            expected = reference_continuation(model, tokenizer, prompt, max_new_tokens)
            model.get_buffer(_RECORDED).fill_(False)
            received = student_fn(model, tokenizer, prompt, max_new_tokens)
            inputs = f"{name}, prompt={prompt!r}, max_new_tokens={max_new_tokens}"
            if not isinstance(received, str):
                raise ExerciseFailed(
                    f"For {inputs}: expected the continuation as text (a str), "
                    f"got {type(received).__name__}"
                )
            slips = (
                _slips(model, tokenizer, prompt, max_new_tokens)
                if received != expected
                else {}
            )
            slip = next((k for k, v in slips.items() if v == received), "")
            if slip:
                raise ExerciseFailed(
                    f"{slip}. For {inputs}: expected {expected!r}, got {received!r}"
                )
            assert_close(received, expected, inputs)
            if model.get_buffer(_RECORDED):
                raise ExerciseFailed(
                    f"For {inputs}: the text is right, but autograd recorded while "
                    "the model ran: generating trains nothing, so nothing should "
                    "be kept for a backward pass"
                )


def _slips(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompt: str,
    max_new_tokens: int,
) -> dict[str, str]:
    """The text of each classic mistake, keyed by its message."""
    past_eos = _greedy_ids(model, tokenizer, prompt, max_new_tokens, stop=False)
    stopped = _greedy_ids(model, tokenizer, prompt, max_new_tokens)
    one_more = _greedy_ids(model, tokenizer, prompt, max_new_tokens + 1)
    return {
        "the prompt is part of the text: return only what was appended": prompt
        + tokenizer.decode(stopped),
        "<eos> ends the response, and is left out of its text": tokenizer.decode(
            stopped + past_eos[len(stopped) : len(stopped) + 1]
        ),
        "the continuation goes on past <eos>: greedy decoding stops there": (
            tokenizer.decode(past_eos, skip_special_tokens=True)
        ),
        "the continuation goes on past <eos> and keeps it in the text": (
            tokenizer.decode(past_eos)
        ),
        "one token too many: max_new_tokens counts the new tokens": tokenizer.decode(
            one_more
        ),
    }
