"""Run a prompt once for its whole group: shared prefixes in causal models.

GRPO samples G responses per prompt, so a rollout batch holds every prompt G
times. In a causal model the keys and values at a position depend only on the
tokens up to it, so rows that start with the same tokens compute the same
prefix G times. Running each distinct prefix once and copying its key/value
cache to every row that starts with it gives the same numbers with less work:

    plain:   model(input_ids)                         # B rows x T positions
    shared:  cache = model(distinct_prefixes).cache   # U rows x c positions
             model(input_ids[:, c:], cache[row_to_prefix])  # B rows x (T - c)

The copy is an ``index_select``, so in backward the G rows' gradients add up in
their prefix's keys and values, exactly as the plain forward's would. It is
exact up to float rounding (the same sums, in batches of another shape).

The model is only asked for ``use_cache=True`` and ``past_key_values``, and the
cache it returns only for ``batch_select_indices`` (a transformers
``DynamicCache``); nothing here imports transformers. Gradient checkpointing
in transformers turns the cache off while training, so callers fall back to
the plain forward then (:func:`can_share_prefix`).

When it pays: a step costs about a * passes + b * positions. Sharing saves
the (B - U) * c positions that repeated prefixes no longer run, and adds a
second pass through every layer (each kernel launches twice, on smaller
inputs; the tail's attention needs an explicit mask, so grouped-query keys are
copied per head). It pays when the saved positions cost more than that pass,
whatever their share of the batch: on a 2-core CPU the pass costs what about
256 positions cost on the 0.3M-parameter tiny model, and fewer on a larger
model, whose positions cost more (the sharing table of
``benchmarks/trl_train_step.py`` measures it). A loaded
CPU makes the pass dearer: with two threads each kernel waits for both, so
doubling the kernels doubles the waits. ``share_prompt_prefix="auto"`` shares
only when (B - U) * c >= :data:`AUTO_MIN_SAVED_POSITIONS`
(:func:`worth_sharing`, decided per microbatch): full groups save
prompts * (G - 1) * (prompt length - 1) positions, so long prompts and large
groups share, and short prompts, small groups and microbatches of distinct
prompts run whole. ``True`` always shares, ``False`` never.

Exact in float64? Not bit for bit in transformers' models: their RMSNorm
computes in float32 whatever the model's dtype, and its backward rounds each
row's gradient to float32. Run whole, each of the G rows is rounded before
the rows' gradients add up in the prompt's parameters; shared, they add up
first (in the copied keys and values) and are rounded once. Gradients that
flow back through the prompt differ by float32 rounding (about 1e-8 of their
size, seen in the tied embedding); the log-probs are equal, and with a norm
that keeps the input dtype the gradients agree to float64 rounding
(tests/test_prefix_sharing.py measures both).
Taught in ``notebooks/07_training_step.ipynb``.

A helper of :mod:`grpo_lab.logprobs` (notebook 02); its columns are shown in
``notebooks/07_training_step.ipynb``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class PrefixSplit:
    """A batch cut after column c: distinct prefixes, and every row's tail."""

    # Each distinct first-c tokens once. (U, c)
    prefix_ids: torch.Tensor
    # The labels of those c positions (equal for every row of the prefix). (U, c)
    prefix_labels: torch.Tensor
    # The prefix each row starts with: prefix_ids[row_to_prefix] == input_ids[:, :c].
    row_to_prefix: torch.Tensor  # (B,)
    # The remaining columns of every row. (B, T - c)
    tail_ids: torch.Tensor
    # Their labels. (B, T - c)
    tail_labels: torch.Tensor

    @property
    def distinct_count(self) -> int:
        return self.prefix_ids.shape[0]


def distinct_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each distinct row once, and where each row went: (N, K) -> (U, K), (N,).

    ``distinct[row_to_distinct]`` rebuilds ``rows``.
    """
    distinct, row_to_distinct = torch.unique(rows, dim=0, return_inverse=True)
    return distinct, row_to_distinct


def split_at_prefix(
    input_ids: torch.Tensor, labels: torch.Tensor, prefix_length: int
) -> PrefixSplit:
    """Cut (B, T) ids and labels after ``prefix_length`` columns; dedupe prefixes.

    Rows count as sharing a prefix when their first ``prefix_length`` input ids
    and labels are all equal (labels too, so the prefix's log-probs are every
    such row's log-probs).
    """
    check_token_batch(input_ids, labels)
    check_shared_prefix_length(prefix_length, input_ids.shape[1], minimum=1)
    keys = torch.cat([input_ids[:, :prefix_length], labels[:, :prefix_length]], 1)
    distinct, row_to_prefix = distinct_rows(keys)  # (U, 2c), (B,)
    return PrefixSplit(
        prefix_ids=distinct[:, :prefix_length],
        prefix_labels=distinct[:, prefix_length:],
        row_to_prefix=row_to_prefix,
        tail_ids=input_ids[:, prefix_length:],
        tail_labels=labels[:, prefix_length:],
    )


def forward_with_shared_prefix(
    model: torch.nn.Module, split: PrefixSplit
) -> tuple[Any, Any]:
    """model on each distinct prefix once, then on every row's tail after it.

    Returns both outputs: the prefix's (U rows, c positions) and the tails'
    (B rows, T - c positions), whose keys and values include their row's prefix.
    """
    prefix_output = model(input_ids=split.prefix_ids, use_cache=True)
    cache = prefix_output.past_key_values
    cache.batch_select_indices(split.row_to_prefix.to(split.prefix_ids.device))
    tail_output = model(input_ids=split.tail_ids, past_key_values=cache, use_cache=True)
    return prefix_output, tail_output


def join_prefix_and_tail(
    split: PrefixSplit, prefix_values: torch.Tensor, tail_values: torch.Tensor
) -> torch.Tensor:
    """Per-position values back in the batch's layout: (U, c), (B, T - c) -> (B, T)."""
    rows = split.row_to_prefix.to(prefix_values.device)
    return torch.cat([prefix_values.index_select(0, rows), tail_values], dim=1)


def prompt_only_columns(response_mask: torch.Tensor) -> int:
    """Leading columns where no row has a response label: (B, T) -> c < T.

    Every row is still inside its prompt there, so the G rows of a group agree
    on them: the longest prefix worth sharing. At most T - 1 (one column must
    remain for the tail).
    """
    if not isinstance(response_mask, torch.Tensor) or response_mask.ndim != 2:
        raise ValueError(
            "response_mask must be a (B, T) tensor, got "
            + _shape_or_type(response_mask)
        )
    if response_mask.shape[1] == 0:
        raise ValueError(
            "response_mask must have at least one column, got shape "
            f"{tuple(response_mask.shape)}"
        )
    has_response = response_mask.bool().any(dim=0)  # (T,)
    width = response_mask.shape[1]
    first_response_column = (
        int(has_response.to(torch.int8).argmax()) if has_response.any() else width
    )
    return min(first_response_column, width - 1)


# "auto" shares when it saves at least this many positions (B - U) * c: what
# the second pass costs on the tiny model on a 2-core CPU (a larger model's
# positions cost more, so this errs towards the plain path there).
AUTO_MIN_SAVED_POSITIONS = 256


def check_share_prompt_prefix(share_prompt_prefix: object) -> None:
    """The one check of ``share_prompt_prefix``: False, True or "auto"."""
    if not (
        isinstance(share_prompt_prefix, bool)
        or (isinstance(share_prompt_prefix, str) and share_prompt_prefix == "auto")
    ):
        raise ValueError(
            'share_prompt_prefix must be False, True or "auto" (share when it '
            f"saves at least {AUTO_MIN_SAVED_POSITIONS} positions), "
            f"got {share_prompt_prefix!r}"
        )


def saved_positions(
    input_ids: torch.Tensor, labels: torch.Tensor, prefix_length: int
) -> int:
    """The positions that sharing ``prefix_length`` columns saves: (B - U) * c,
    with U the distinct first-c (ids, labels) rows of the (B, T) batch."""
    if prefix_length == 0:
        return 0
    keys = torch.cat([input_ids[:, :prefix_length], labels[:, :prefix_length]], 1)
    distinct = distinct_rows(keys)[0].shape[0]  # U
    return (input_ids.shape[0] - distinct) * prefix_length


def worth_sharing(
    input_ids: torch.Tensor, labels: torch.Tensor, prefix_length: int
) -> bool:
    """The rule of "auto": sharing saves at least AUTO_MIN_SAVED_POSITIONS."""
    saved = saved_positions(input_ids, labels, prefix_length)
    return saved >= AUTO_MIN_SAVED_POSITIONS


def shared_prefix_length(
    response_mask: torch.Tensor,
    share_prompt_prefix: bool | str,
    input_ids: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
) -> int:
    """The prefix length to score once per prompt: :func:`prompt_only_columns`
    when ``share_prompt_prefix`` is True, 0 (every row runs whole) when False,
    and for "auto" the former when :func:`worth_sharing` on ``input_ids`` and
    ``labels`` (B, T), else 0."""
    check_share_prompt_prefix(share_prompt_prefix)
    return prefix_to_share(response_mask, share_prompt_prefix, input_ids, labels)


def prefix_to_share(
    response_mask: torch.Tensor,
    share_prompt_prefix: bool | str,
    input_ids: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
) -> int:
    """:func:`shared_prefix_length` with ``share_prompt_prefix`` already checked
    (by ``UpdateSettings``, once; the train step's per-microbatch call)."""
    if share_prompt_prefix is False:
        return 0
    prefix_length = prompt_only_columns(response_mask)
    if share_prompt_prefix is True:
        return prefix_length
    if input_ids is None or labels is None:
        raise ValueError(
            'share_prompt_prefix "auto" needs the batch\'s input_ids and labels '
            "to count its distinct prompts, got None"
        )
    check_token_batch(input_ids, labels)
    return prefix_length if worth_sharing(input_ids, labels, prefix_length) else 0


def check_token_batch(input_ids: torch.Tensor, labels: torch.Tensor) -> None:
    """A ValueError unless ``input_ids`` and ``labels`` are (B, T) tensors alike."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
        raise ValueError(
            "input_ids must be a (B, T) tensor of token ids, got "
            + _shape_or_type(input_ids)
        )
    if not isinstance(labels, torch.Tensor) or labels.shape != input_ids.shape:
        raise ValueError(
            f"labels must have the shape of input_ids {tuple(input_ids.shape)}, "
            "got " + _shape_or_type(labels)
        )


def _shape_or_type(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"shape {tuple(value.shape)}"
    return type(value).__name__


def can_share_prefix(model: torch.nn.Module) -> bool:
    """False while transformers' gradient checkpointing drops the cache."""
    return not (model.training and getattr(model, "is_gradient_checkpointing", False))


def check_shared_prefix_length(prefix_length, width: int, minimum: int = 0) -> None:
    """A ValueError unless ``prefix_length`` is an int in [minimum, width - 1]."""
    if (
        not isinstance(prefix_length, int)
        or isinstance(prefix_length, bool)
        or not minimum <= prefix_length < width
    ):
        raise ValueError(
            f"shared_prefix_length must be an int in [{minimum}, {width - 1}] for "
            f"sequences of {width} positions (0: no sharing; one position must "
            f"remain after the prefix), got {prefix_length!r}"
        )
