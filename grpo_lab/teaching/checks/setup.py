"""Checks for ``notebooks/00_welcome_and_setup.ipynb``.

The exercise: the greedy next token, the argmax of the logits at the last
position. The reference is ``model.generate(..., max_new_tokens=1,
do_sample=False)``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo_lab.teaching.checks.framework import (
    CaseCount,
    assert_close,
    exercise_check,
)


def reference_next_token(
    model: PreTrainedModel, input_ids: torch.Tensor, pad_token_id: int
) -> torch.Tensor:
    """The token greedy decoding appends to each row. (B, T) -> (B,)."""
    with torch.no_grad():
        generated = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=1,
            do_sample=False,
            pad_token_id=pad_token_id,
        )  # (B, T + 1)
    return generated[:, -1]


@exercise_check("Exercise 00-greedy_next_token (the greedy next token)")
def check_greedy_next_token(
    student_fn: Callable[[PreTrainedModel, torch.Tensor], torch.Tensor],
    cases: CaseCount,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    """``student_fn(model, input_ids (B, T))`` -> next token ids (B,)."""
    for prompts in (["12+7="], ["hello", "world"], ["a", "b", "c"]):
        with cases.case():
            input_ids = torch.tensor(
                [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
            )  # (B, T)
            expected = reference_next_token(model, input_ids, tokenizer.pad_token_id)
            with torch.no_grad():
                received = student_fn(model, input_ids.clone())
            assert_close(
                received, expected, f"prompts={prompts}, input_ids={input_ids.tolist()}"
            )
