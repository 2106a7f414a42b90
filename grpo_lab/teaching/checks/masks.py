"""Checks for ``notebooks/01_tokenization_and_masks.ipynb``.

The exercise: build ``input_ids``, ``labels`` and ``response_mask`` from prompt
and response token ids (concatenate, right-pad, shift by one). The reference is
:func:`grpo_lab.masks.pad_prompt_and_response_ids`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from grpo_lab.masks import pad_prompt_and_response_ids
from grpo_lab.teaching.checks.framework import (
    CaseCount,
    ExerciseFailed,
    assert_close,
    exercise_check,
)

# (prompt_ids, response_ids, pad_token_id): equal lengths, ragged lengths, a
# one-token prompt, a one-token response, and a pad id that is not 0.
MASK_CASES = (
    ([[5, 6]], [[7, 8, 1]], 0),
    ([[5, 6, 7], [5]], [[8, 1], [9, 9, 9, 1]], 0),
    ([[3], [4, 4]], [[1], [2, 2, 1]], 0),
    ([[10, 11, 12, 13]], [[14]], 99),
)


@exercise_check(
    "Exercise 01-build_training_tensors (the response mask and one-token shift)"
)
def check_response_mask(
    student_fn: Callable[..., dict[str, torch.Tensor]], cases: CaseCount
) -> None:
    """``student_fn(prompt_ids, response_ids, pad_token_id)`` -> the three tensors."""
    for prompt_ids, response_ids, pad_token_id in MASK_CASES:
        with cases.case():
            expected = pad_prompt_and_response_ids(
                prompt_ids, response_ids, pad_token_id
            )
            received = student_fn(prompt_ids, response_ids, pad_token_id)
            inputs = (
                f"prompt_ids={prompt_ids}, response_ids={response_ids}, "
                f"pad_token_id={pad_token_id}"
            )
            if not isinstance(received, dict):
                raise ExerciseFailed(
                    f"For {inputs}: expected a dict with input_ids, labels and "
                    f"response_mask, got {type(received).__name__}"
                )
            for key in ("input_ids", "labels", "response_mask"):
                if key not in received:
                    raise ExerciseFailed(f"For {inputs}: the result has no {key!r} key")
                assert_close(received[key], expected[key], f"{inputs} ({key})", atol=0)
