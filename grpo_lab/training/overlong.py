"""Responses cut at ``max_new_tokens``: detect them, mask them, or shape their reward.

A response is *truncated* when generation stopped because it ran out of length:
it does not end with an end-of-sequence token, its text does not end with one of
the task's stop strings, and it holds ``max_new_tokens`` tokens. Every other
response *terminated* on its own. Three uses, each off by default except the
diagnostics:

- diagnostics every step: the fraction of truncated responses and the mean
  length of each class (:func:`truncation_metrics`);
- ``mask_truncated_completions``: truncated responses get response_mask 0, so
  they leave the loss (TRL's option of that name): a cut-off answer is never
  rewarded or punished for tokens it did not get to finish;
- DAPO's soft overlong punishment (arXiv:2503.14476, eq. 13), added to the
  reward with L_max = max_new_tokens and L_cache = ``overlong_buffer``::

      R_length(|y|) = 0                                 if |y| <= L_max - L_cache
                      ((L_max - L_cache) - |y|) / L_cache  if inside the buffer
                      -1                                 if |y| > L_max

      reward += overlong_penalty * R_length(|y|)

  |y| counts response tokens, a sampled end-of-sequence token included (as TRL's
  ``get_soft_overlong_punishment`` counts completion ids).

Used by the training loop (``notebooks/08_training_loop.ipynb``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

TRUNCATION_PREFIX = "rollout"


def is_truncated(
    response_token_ids: Sequence[int] | None,
    response: str,
    length: int,
    *,
    eos_token_ids: Sequence[int],
    stop_strings: Sequence[str],
    max_new_tokens: int,
) -> bool:
    """True when the response ran out of tokens instead of ending on its own.

    Ended on its own: the last sampled id is an end-of-sequence id, or the text
    ends with a stop string (both backends keep the stop string and cut the text
    right after it). ``length`` is the response's token count; a backend that
    returns text only (``response_token_ids`` None) is judged by its stop
    strings and length alone. ``max_new_tokens`` is a positive int.
    """
    check_max_new_tokens(max_new_tokens)
    if response_token_ids and response_token_ids[-1] in eos_token_ids:
        return False
    if any(stop and response.endswith(stop) for stop in stop_strings):
        return False
    return length >= max_new_tokens


def check_max_new_tokens(max_new_tokens: object) -> None:
    """The response length limit truncation is judged by: a positive int."""
    if (
        isinstance(max_new_tokens, bool)
        or not isinstance(max_new_tokens, int)
        or max_new_tokens < 1
    ):
        raise ValueError(
            f"max_new_tokens must be a positive int, got {max_new_tokens!r}"
        )


def truncated_rows(
    responses: Sequence[str],
    response_token_ids: Sequence[Sequence[int]] | None,
    lengths: Sequence[int],
    *,
    eos_token_ids: Sequence[int],
    stop_strings: Sequence[str],
    max_new_tokens: int,
) -> torch.Tensor:
    """(B,) bool: which of B responses were cut at ``max_new_tokens``."""
    if len(lengths) != len(responses) or (
        response_token_ids is not None and len(response_token_ids) != len(responses)
    ):
        raise ValueError(
            "responses, response_token_ids and lengths must have one entry per "
            f"response, got {len(responses)}, "
            f"{None if response_token_ids is None else len(response_token_ids)} "
            f"and {len(lengths)}"
        )
    flags = [
        is_truncated(
            None if response_token_ids is None else response_token_ids[index],
            response,
            lengths[index],
            eos_token_ids=eos_token_ids,
            stop_strings=stop_strings,
            max_new_tokens=max_new_tokens,
        )
        for index, response in enumerate(responses)
    ]
    return torch.tensor(flags, dtype=torch.bool)  # (B,)


def end_of_sequence_ids(tokenizer: Any, generation_config: Any = None) -> list[int]:
    """The tokenizer's EOS id plus any end id a model's generation config names."""
    configured = getattr(generation_config, "eos_token_id", None)
    if configured is None:
        configured = []
    elif isinstance(configured, int):
        configured = [configured]
    ids = [tokenizer.eos_token_id, *configured]
    return [i for i in dict.fromkeys(ids) if i is not None]


def mask_truncated(
    response_mask: torch.Tensor, truncated: torch.Tensor
) -> torch.Tensor:
    """``response_mask`` (B, T) with every truncated row set to 0 (a new tensor)."""
    if not isinstance(truncated, torch.Tensor) or truncated.dtype != torch.bool:
        received = truncated.dtype if isinstance(truncated, torch.Tensor) else truncated
        raise ValueError(f"truncated must be a (B,) bool tensor, got {received!r}")
    if truncated.shape != response_mask.shape[:1]:
        raise ValueError(
            f"truncated must have shape ({response_mask.shape[0]},), one per row, "
            f"got {tuple(truncated.shape)}"
        )
    keep = (~truncated).to(response_mask.dtype).unsqueeze(1)  # (B, 1)
    return response_mask * keep  # (B, T)


def soft_overlong_punishment(
    lengths: torch.Tensor, max_length: int, buffer: int
) -> torch.Tensor:
    """DAPO's R_length(|y|) for each length (eq. 13 above), in ``lengths``' dtype.

    ``lengths`` (B,) holds |y| >= 0, finite (integers are scored in float64);
    the result (B,) lies in [-1, 0]. ``max_length`` >= ``buffer`` >= 1 (both
    ints).
    """
    check_punishment_lengths(max_length, buffer)
    if not isinstance(lengths, torch.Tensor) or lengths.ndim != 1:
        shape = tuple(lengths.shape) if isinstance(lengths, torch.Tensor) else None
        raise ValueError(
            "lengths must be a (B,) tensor of response lengths, got "
            f"{shape if shape is not None else type(lengths).__name__}"
        )
    if not lengths.is_floating_point():
        lengths = lengths.to(torch.float64)  # (B,)
    bad = ~torch.isfinite(lengths) | (lengths < 0)  # (B,)
    if bool(bad.any()):
        raise ValueError(
            f"lengths must be finite token counts >= 0, got {lengths[bad][0].item()!r}"
        )
    start = max_length - buffer
    inside = (start - lengths) / buffer  # (B,)
    shaped = torch.where(lengths <= start, torch.zeros_like(lengths), inside)
    return torch.where(lengths > max_length, torch.full_like(lengths, -1.0), shaped)


def shape_reward_results(
    results: list[dict[str, float]],
    lengths: Sequence[int],
    *,
    max_length: int,
    buffer: int,
    penalty: float,
) -> list[dict[str, float]]:
    """Each reward dict with ``penalty * R_length(|y|)`` added to its "reward".

    The added term is also kept under "overlong_penalty" (0 for short responses);
    "format_reward" and "answer_reward" are left as graded. ``penalty`` >= 0
    (a negative one would pay a bonus for length).
    """
    _check_penalty(penalty, "penalty")
    if len(results) != len(lengths):
        raise ValueError(
            f"lengths must have one entry per result ({len(results)}), "
            f"got {len(lengths)}"
        )
    terms = soft_overlong_punishment(
        torch.tensor(list(lengths), dtype=torch.float64), max_length, buffer
    )  # (B,)
    shaped = []
    for result, term in zip(results, terms.tolist(), strict=True):
        added = penalty * term
        shaped.append(
            {**result, "reward": result["reward"] + added, "overlong_penalty": added}
        )
    return shaped


def truncation_metrics(
    lengths: Sequence[int], truncated: torch.Tensor
) -> dict[str, float]:
    """``rollout/clipped_fraction`` and the mean length of each class.

    ``rollout/terminated_length_mean`` and ``rollout/truncated_length_mean`` are
    left out (not written as None or NaN) when no response is in that class.
    """
    if not isinstance(truncated, torch.Tensor) or truncated.dtype != torch.bool:
        received = truncated.dtype if isinstance(truncated, torch.Tensor) else truncated
        raise ValueError(f"truncated must be a (B,) bool tensor, got {received!r}")
    if truncated.shape != (len(lengths),) or not len(lengths):
        raise ValueError(
            f"truncated must have one flag per length ({len(lengths)}, at least "
            f"one), got shape {tuple(truncated.shape)}"
        )
    length = torch.tensor(list(lengths), dtype=torch.float64)  # (B,)
    metrics = {
        f"{TRUNCATION_PREFIX}/clipped_fraction": truncated.double().mean().item()
    }
    for name, rows in (("terminated", ~truncated), ("truncated", truncated)):
        if rows.any():
            metrics[f"{TRUNCATION_PREFIX}/{name}_length_mean"] = (
                length[rows].mean().item()
            )
    return metrics


# --- settings ----------------------------------------------------------------------


def check_overlong_settings(
    mask_truncated_completions: object,
    overlong_buffer: object,
    overlong_penalty: object,
    max_new_tokens: int | None,
) -> None:
    """The one check of the overlong settings (``max_new_tokens``: the resolved
    response length when known, else None to skip the comparison)."""
    if not isinstance(mask_truncated_completions, bool):
        raise ValueError(
            "mask_truncated_completions must be True or False, "
            f"got {mask_truncated_completions!r}"
        )
    if overlong_buffer is not None and (
        not isinstance(overlong_buffer, int)
        or isinstance(overlong_buffer, bool)
        or overlong_buffer < 1
    ):
        raise ValueError(
            f"overlong_buffer must be None or a positive int, got {overlong_buffer!r}"
        )
    if (
        overlong_buffer is not None
        and max_new_tokens is not None
        and overlong_buffer > max_new_tokens
    ):
        raise ValueError(
            f"overlong_buffer must be at most max_new_tokens ({max_new_tokens}): "
            "the punishment starts max_new_tokens - overlong_buffer tokens in, "
            f"got {overlong_buffer}"
        )
    _check_penalty(overlong_penalty, "overlong_penalty")


def _check_penalty(penalty: object, name: str) -> None:
    """The one check of the punishment's scale: a finite number >= 0."""
    number = isinstance(penalty, (int, float)) and not isinstance(penalty, bool)
    if not (number and math.isfinite(penalty) and penalty >= 0):
        raise ValueError(
            f"{name} must be a finite number >= 0 (a negative one pays a bonus for "
            f"length), got {penalty!r}"
        )


def check_punishment_lengths(max_length: object, buffer: object) -> None:
    """L_max and L_cache of the punishment: ints with max_length >= buffer >= 1."""
    for name, value in (("max_length", max_length), ("buffer", buffer)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if buffer > max_length:
        raise ValueError(
            f"buffer must be at most max_length ({max_length}), got {buffer}"
        )
