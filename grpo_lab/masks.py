"""Tokenization of prompt/response pairs and masked reductions.

Taught in ``notebooks/01_tokenization_and_masks.ipynb``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def tokenize_prompt_and_output(
    prompt: list[str], output: list[str], tokenizer: PreTrainedTokenizerBase
) -> dict[str, torch.Tensor]:
    """Tokenize each prompt and response separately, then concatenate and shift.

    Each text is encoded without special tokens, so the response ids are exactly
    the ids of the response text. Padding and shifting are those of
    :func:`pad_prompt_and_response_ids`. Returns (B, T - 1) tensors.

    A response sampled as token ids may not re-encode to the same ids after
    decoding; for sampled rollouts use :func:`pad_prompt_and_response_ids`.
    """
    if len(prompt) != len(output):
        raise ValueError(
            f"prompt and output must have the same length, got {len(prompt)} "
            f"prompts and {len(output)} outputs"
        )
    prompt_ids = [tokenizer.encode(text, add_special_tokens=False) for text in prompt]
    output_ids = [tokenizer.encode(text, add_special_tokens=False) for text in output]
    return pad_prompt_and_response_ids(prompt_ids, output_ids, tokenizer.pad_token_id)


def pad_prompt_and_response_ids(
    prompt_ids: list[list[int]], response_ids: list[list[int]], pad_token_id: int
) -> dict[str, torch.Tensor]:
    """Concatenate prompt and response ids, right-pad, shift by one token.

    ids = prompt_ids + response_ids, right-padded with ``pad_token_id`` to length T;
    input_ids = ids[:, :-1], labels = ids[:, 1:], and response_mask[b, t] = 1
    exactly when labels[b, t] is a response token (never a prompt or pad token).
    The ids are used as given: no decoding and no re-tokenization.
    Returns ``input_ids``, ``labels`` and ``response_mask``, each (B, T - 1).
    """
    _check_id_lists(prompt_ids, response_ids)
    sequences = [p + r for p, r in zip(prompt_ids, response_ids)]
    masks = [[0] * len(p) + [1] * len(r) for p, r in zip(prompt_ids, response_ids)]
    max_length = max(len(sequence) for sequence in sequences)
    if max_length < 2:
        raise ValueError(
            "prompt_ids + response_ids must give at least one sequence of 2 or more "
            f"tokens (one input and one label), got a longest sequence of {max_length}"
        )
    if pad_token_id is None and any(len(s) < max_length for s in sequences):
        raise ValueError(
            "pad_token_id must be an integer when sequences need padding, got None"
        )
    padded = [s + [pad_token_id] * (max_length - len(s)) for s in sequences]
    padded_masks = [m + [0] * (max_length - len(m)) for m in masks]
    token_ids = torch.tensor(padded, dtype=torch.long)  # (B, T)
    token_mask = torch.tensor(padded_masks, dtype=torch.long)  # (B, T)
    return {
        "input_ids": token_ids[:, :-1],  # (B, T-1)
        "labels": token_ids[:, 1:],  # (B, T-1)
        "response_mask": token_mask[:, 1:],  # (B, T-1)
    }


def _check_id_lists(prompt_ids: list[list[int]], response_ids: list[list[int]]) -> None:
    if len(prompt_ids) != len(response_ids):
        raise ValueError(
            "prompt_ids and response_ids must have the same length, got "
            f"{len(prompt_ids)} and {len(response_ids)}"
        )
    if not prompt_ids:
        raise ValueError("prompt_ids must hold at least one sequence, got 0")


def masked_mean(
    tensor: torch.Tensor, mask: torch.Tensor, dim: int | None = None
) -> torch.Tensor:
    """sum(tensor * mask, dim) / sum(mask, dim): the mean over masked-in entries.

    ``dim=None`` reduces every entry. A slice with no masked-in entry is 0 / 0 =
    NaN, on purpose: an empty mean has no value.
    """
    _check_same_shape(tensor, mask)
    mask = mask.to(tensor.dtype)
    return (tensor * mask).sum(dim=dim) / mask.sum(dim=dim)


def masked_normalize(
    tensor: torch.Tensor,
    mask: torch.Tensor,
    normalize_constant: float,
    dim: int | None = None,
) -> torch.Tensor:
    """sum(tensor * mask, dim) / normalize_constant (Dr. GRPO's constant divisor).

    Unlike :func:`masked_mean` the divisor does not depend on how many entries are
    masked in, so a long response weighs no less per token than a short one.
    """
    _check_same_shape(tensor, mask)
    if normalize_constant == 0:
        raise ValueError("normalize_constant must be nonzero, got 0")
    return (tensor * mask.to(tensor.dtype)).sum(dim=dim) / normalize_constant


def _check_same_shape(tensor: torch.Tensor, mask: torch.Tensor) -> None:
    if tensor.shape != mask.shape:
        raise ValueError(
            f"mask must have the shape of tensor {tuple(tensor.shape)}, "
            f"got {tuple(mask.shape)}"
        )
