"""Tokenization of prompt/response pairs and masked reductions.

Taught in ``notebooks/01_tokenization_and_masks.ipynb``.
"""

from __future__ import annotations

import math
import numbers
import operator
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
    _check_texts("prompt", prompt)
    _check_texts("output", output)
    if len(prompt) != len(output):
        raise ValueError(
            f"prompt and output must have the same length, got {len(prompt)} "
            f"prompts and {len(output)} outputs"
        )
    if not prompt:
        raise ValueError("prompt and output must hold at least one text each, got 0")
    if not callable(getattr(tokenizer, "encode", None)):
        raise ValueError(
            "tokenizer must be a tokenizer with encode() and pad_token_id, "
            f"got {type(tokenizer).__name__}"
        )
    prompt_ids = _encode_texts("prompt", prompt, tokenizer)
    output_ids = _encode_texts("output", output, tokenizer)
    return _pad_and_shift(
        prompt_ids,
        output_ids,
        tokenizer.pad_token_id,
        ("prompt", "output", "tokenizer.pad_token_id"),
    )


def _check_texts(name: str, texts: list[str]) -> None:
    if not isinstance(texts, (list, tuple)):
        raise ValueError(
            f"{name} must be a list of str (one text per row), "
            f"got {type(texts).__name__}"
        )
    for index, text in enumerate(texts):
        if not isinstance(text, str):
            raise ValueError(
                f"{name}[{index}] must be a str, got {type(text).__name__}"
            )


def _encode_texts(
    name: str, texts: list[str], tokenizer: PreTrainedTokenizerBase
) -> list[list[int]]:
    """tokenizer.encode of each text; a text it cannot encode is named by index."""
    encoded = []
    for index, text in enumerate(texts):
        try:
            encoded.append(tokenizer.encode(text, add_special_tokens=False))
        except Exception as error:
            raise ValueError(
                f"{name}[{index}] must be text the tokenizer can encode, got "
                f"{_shortened(text)}: {error}"
            ) from error
    return encoded


def _shortened(text: str, limit: int = 60) -> str:
    return repr(text) if len(text) <= limit else repr(text[:limit]) + "..."


def pad_prompt_and_response_ids(
    prompt_ids: list[list[int]], response_ids: list[list[int]], pad_token_id: int
) -> dict[str, torch.Tensor]:
    """Concatenate prompt and response ids, right-pad, shift by one token.

    ids = prompt_ids + response_ids, right-padded with ``pad_token_id`` to length T;
    input_ids = ids[:, :-1], labels = ids[:, 1:], and response_mask[b, t] = 1
    exactly when labels[b, t] is a response token (never a prompt or pad token).
    The ids are used as given: no decoding and no re-tokenization. Each row is a
    list (or tuple) of int token ids.
    Returns ``input_ids``, ``labels`` and ``response_mask``, each (B, T - 1).
    """
    _check_id_lists(prompt_ids, response_ids)
    if pad_token_id is not None and not _is_int(pad_token_id):
        raise ValueError(
            f"pad_token_id must be an int token id or None, got {pad_token_id!r}"
        )
    return _pad_and_shift(
        prompt_ids,
        response_ids,
        pad_token_id,
        ("prompt_ids", "response_ids", "pad_token_id"),
    )


def _pad_and_shift(
    prompt_ids: list[list[int]],
    response_ids: list[list[int]],
    pad_token_id: int | None,
    names: tuple[str, ...],
) -> dict[str, torch.Tensor]:
    """The body of :func:`pad_prompt_and_response_ids`.

    ``names``: how the caller calls the prompt ids, the response ids and the pad
    token id, for error messages.
    """
    sequences = [[*p, *r] for p, r in zip(prompt_ids, response_ids)]
    masks = [[0] * len(p) + [1] * len(r) for p, r in zip(prompt_ids, response_ids)]
    max_length = max(len(sequence) for sequence in sequences)
    if max_length < 2:
        raise ValueError(
            f"{names[0]} + {names[1]} must give at least one sequence of 2 or more "
            f"tokens (one input and one label), got a longest sequence of {max_length}"
        )
    if pad_token_id is None and any(len(s) < max_length for s in sequences):
        raise ValueError(
            f"{names[2]} must be an integer when sequences need padding, got None"
        )
    padded = [s + [pad_token_id] * (max_length - len(s)) for s in sequences]
    padded_masks = [m + [0] * (max_length - len(m)) for m in masks]
    token_ids = _token_id_tensor(padded, prompt_ids, response_ids, names)  # (B, T)
    token_mask = torch.tensor(padded_masks, dtype=torch.long)  # (B, T)
    return {
        "input_ids": token_ids[:, :-1],  # (B, T-1)
        "labels": token_ids[:, 1:],  # (B, T-1)
        "response_mask": token_mask[:, 1:],  # (B, T-1)
    }


def _token_id_tensor(
    padded: list[list[int]],
    prompt_ids: list[list[int]],
    response_ids: list[list[int]],
    names: tuple[str, ...],
) -> torch.Tensor:
    """torch.long (B, T) ids; a float, str or None id is an error, not truncated."""
    try:
        token_ids = torch.tensor(padded)  # (B, T), dtype inferred from the ids
    except (TypeError, ValueError, RuntimeError, OverflowError):
        token_ids = None
    if token_ids is None or token_ids.is_floating_point() or token_ids.is_complex():
        raise _bad_token_id(prompt_ids, response_ids, names)
    return token_ids.long()


def _bad_token_id(
    prompt_ids: list[list[int]],
    response_ids: list[list[int]],
    names: tuple[str, ...],
) -> ValueError:
    for name, rows in zip(names, (prompt_ids, response_ids)):
        for row_index, row in enumerate(rows):
            for position, token in enumerate(row):
                if not _is_int(token):
                    return ValueError(
                        f"{name}[{row_index}][{position}] must be an int token id, "
                        f"got {token!r}"
                    )
    return ValueError(
        f"{names[0]} and {names[1]} must hold int64 token ids, got a value outside "
        "the int64 range"
    )


def _is_int(value: object) -> bool:
    """An int (or an integer scalar such as numpy's), but not a bool."""
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _check_id_lists(prompt_ids: list[list[int]], response_ids: list[list[int]]) -> None:
    for name, rows in (("prompt_ids", prompt_ids), ("response_ids", response_ids)):
        if not isinstance(rows, (list, tuple)):
            raise ValueError(
                f"{name} must be a list of token-id lists (one per row), "
                f"got {type(rows).__name__}"
            )
    if len(prompt_ids) != len(response_ids):
        raise ValueError(
            "prompt_ids and response_ids must have the same length, got "
            f"{len(prompt_ids)} and {len(response_ids)}"
        )
    if not prompt_ids:
        raise ValueError("prompt_ids must hold at least one sequence, got 0")
    for name, rows in (("prompt_ids", prompt_ids), ("response_ids", response_ids)):
        for index, row in enumerate(rows):
            if not isinstance(row, (list, tuple)):
                raise ValueError(
                    f"{name}[{index}] must be a list of int token ids, "
                    f"got {type(row).__name__}"
                )


def check_binary_mask(mask: object, name: str = "response_mask") -> None:
    """A door's check that a mask tensor holds values, each 0 or 1 (or bool).

    A function that reads a mask as "which tokens count" (``mask.bool()``)
    would take 0.5 as 1; this refuses it. Non-tensors pass through to the
    caller's own checks.
    """
    if not isinstance(mask, torch.Tensor):
        return
    if mask.device.type == "meta":
        raise ValueError(
            f"{name} must hold values (a cpu or cuda tensor), got a tensor on the "
            "meta device"
        )
    if mask.dtype == torch.bool:
        return
    other = (mask != 0) & (mask != 1)  # (B, T)
    if bool(other.any()):
        raise ValueError(
            f"{name} must hold only 0 and 1 (or bool), got {mask[other][0].item()!r}"
        )


def masked_mean(
    tensor: torch.Tensor, mask: torch.Tensor, dim: int | None = None
) -> torch.Tensor:
    """sum(tensor * mask, dim) / sum(mask, dim): the mean over masked-in entries.

    ``mask`` is bool or 0/1 numbers (other values weigh their entries). A
    masked-out entry (mask 0) adds exactly 0, whatever it holds: inf or NaN
    there does not reach the result. ``dim=None`` reduces every entry. A slice
    with no masked-in entry is 0 / 0 = NaN, on purpose: an empty mean has no
    value.
    """
    _check_reduction_inputs(tensor, mask, dim)
    weights = mask.to(tensor.dtype)
    return _masked_sum(tensor, weights, dim) / weights.sum(dim=dim)


def masked_normalize(
    tensor: torch.Tensor,
    mask: torch.Tensor,
    normalize_constant: float,
    dim: int | None = None,
) -> torch.Tensor:
    """sum(tensor * mask, dim) / normalize_constant (Dr. GRPO's constant divisor).

    Unlike :func:`masked_mean` the divisor does not depend on how many entries are
    masked in, so a long response weighs no less per token than a short one. As
    there, a masked-out entry adds exactly 0, whatever it holds.
    """
    _check_reduction_inputs(tensor, mask, dim)
    if isinstance(normalize_constant, torch.Tensor) and normalize_constant.ndim == 0:
        normalize_constant = normalize_constant.item()  # a count such as mask.sum()
    if (
        isinstance(normalize_constant, bool)
        or not isinstance(normalize_constant, numbers.Real)
        or not math.isfinite(normalize_constant)
        or normalize_constant == 0
    ):
        raise ValueError(
            "normalize_constant must be a finite nonzero number, "
            f"got {normalize_constant!r}"
        )
    weights = mask.to(tensor.dtype)
    return _masked_sum(tensor, weights, dim) / normalize_constant


def _masked_sum(
    tensor: torch.Tensor, weights: torch.Tensor, dim: int | None
) -> torch.Tensor:
    """sum(tensor * weights, dim), where a weight-0 entry adds 0 (not 0 * inf).

    For finite inputs the sum is bit for bit that of (tensor * weights).sum(dim):
    the same terms, except that a masked-out term is +0 instead of -0.
    """
    selected = torch.where(weights != 0, tensor * weights, 0)  # tensor's shape
    return selected.sum(dim=dim)


def _check_reduction_inputs(
    tensor: torch.Tensor, mask: torch.Tensor, dim: int | None
) -> None:
    for name, value in (("tensor", tensor), ("mask", mask)):
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                f"{name} must be a torch.Tensor, got {type(value).__name__}"
            )
    if tensor.shape != mask.shape:
        raise ValueError(
            f"mask must have the shape of tensor {tuple(tensor.shape)}, "
            f"got {tuple(mask.shape)}"
        )
    _check_dim(dim, tensor.ndim)


def _check_dim(dim: int | tuple[int, ...] | None, ndim: int) -> None:
    """None, or dims in [-ndim, ndim) (a 0-d tensor takes 0 and -1)."""
    if dim is None:
        return
    dims = dim if isinstance(dim, (tuple, list)) else (dim,)
    limit = max(ndim, 1)
    if not all(
        isinstance(d, int) and not isinstance(d, bool) and -limit <= d < limit
        for d in dims
    ):
        raise ValueError(
            f"dim must be None or an int in [{-limit}, {limit - 1}] for a "
            f"{ndim}-D tensor, got {dim!r}"
        )
