"""Tokenization of prompt/response pairs and masked reductions.

Taught in ``notebooks/01_tokenization_and_masks.ipynb``.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase


def tokenize_prompt_and_output(
    prompt: list[str], output: list[str], tokenizer: PreTrainedTokenizerBase
) -> dict[str, torch.Tensor]:
    """Concatenate prompt and response ids, right-pad, shift by one token.

    input_ids = ids[:, :-1], labels = ids[:, 1:], and response_mask[i, t] = 1 when
    labels[i, t] is a response token. Returns tensors of shape (B, T - 1).
    """
    if len(prompt) != len(output):
        raise ValueError(
            f"prompt and output must have the same length, got {len(prompt)} "
            f"prompts and {len(output)} outputs"
        )
    prompt_ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompt]
    output_ids = [tokenizer.encode(o, add_special_tokens=False) for o in output]
    return pad_prompt_and_response_ids(prompt_ids, output_ids, tokenizer.pad_token_id)


def pad_prompt_and_response_ids(
    prompt_ids: list[list[int]], response_ids: list[list[int]], pad_token_id: int
) -> dict[str, torch.Tensor]:
    """Token-id form of :func:`tokenize_prompt_and_output` (no re-tokenization)."""
    if len(prompt_ids) != len(response_ids):
        raise ValueError(
            f"prompt_ids and response_ids must have the same length, got "
            f"{len(prompt_ids)} and {len(response_ids)}"
        )
    if not prompt_ids:
        raise ValueError("prompt_ids must not be empty")
    sequences = [p + r for p, r in zip(prompt_ids, response_ids)]
    masks = [[0] * len(p) + [1] * len(r) for p, r in zip(prompt_ids, response_ids)]
    max_length = max(len(s) for s in sequences)
    if max_length < 2:
        raise ValueError("every batch needs at least one sequence of two tokens")
    padded = [s + [pad_token_id] * (max_length - len(s)) for s in sequences]
    padded_masks = [m + [0] * (max_length - len(m)) for m in masks]
    token_ids = torch.tensor(padded, dtype=torch.long)  # (B, T)
    token_mask = torch.tensor(padded_masks, dtype=torch.long)  # (B, T)
    return {
        "input_ids": token_ids[:, :-1],  # (B, T-1)
        "labels": token_ids[:, 1:],  # (B, T-1)
        "response_mask": token_mask[:, 1:],  # (B, T-1)
    }


def masked_mean(
    tensor: torch.Tensor, mask: torch.Tensor, dim: int | None = None
) -> torch.Tensor:
    """sum(tensor * mask, dim) / sum(mask, dim): the mean over masked-in entries."""
    _check_same_shape(tensor, mask)
    mask = mask.to(tensor.dtype)
    return (tensor * mask).sum(dim=dim) / mask.sum(dim=dim)


def masked_normalize(
    tensor: torch.Tensor,
    mask: torch.Tensor,
    normalize_constant: float,
    dim: int | None = None,
) -> torch.Tensor:
    """sum(tensor * mask, dim) / normalize_constant (Dr. GRPO's constant divisor)."""
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
