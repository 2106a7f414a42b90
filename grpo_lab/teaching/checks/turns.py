"""Checks for ``notebooks/14_tools_and_turns.ipynb``.

The exercise: the multi-turn response mask. Given each row's prompt ids and
its response as segments (who wrote each run of tokens: ``"model"``,
``"tool"`` or ``"separator"``), return the (B, T - 1) mask that is 1 exactly
where ``labels`` (the padded ids shifted by one) holds a token the model
sampled. The reference is
:func:`grpo_lab.rollouts.multiturn.pad_prompt_and_segment_ids`. The cases are
built so that each plausible slip gives a different mask, and the message
names the slip it recognises: tool tokens kept, separators kept, the mask
aligned with ``input_ids`` instead of ``labels`` (off by one at every turn
boundary), or the whole response kept.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from grpo_lab.rollouts.multiturn import (
    MODEL,
    SEPARATOR,
    TOOL,
    Segment,
    pad_prompt_and_segment_ids,
)
from grpo_lab.teaching.checks.framework import (
    CaseCount,
    ExerciseFailed,
    exercise_check,
)

MaskFunction = Callable[[list[list[int]], list[list[Segment]]], torch.Tensor]
PAD_TOKEN_ID = 0


def _segments(*pieces: tuple[str, list[int]]) -> list[Segment]:
    return [Segment(role, tuple(ids), "") for role, ids in pieces]


# (prompt_ids, segments): one call then an answer; two rows of different
# lengths, one without a call; two calls in a row, the second one token long.
MASK_CASES = (
    (
        [[5, 6]],
        [
            _segments(
                (MODEL, [7, 8]),
                (SEPARATOR, [9]),
                (TOOL, [10]),
                (SEPARATOR, [11]),
                (MODEL, [12, 1]),
            )
        ],
    ),
    (
        [[5, 6, 7], [5]],
        [
            _segments((MODEL, [8, 9, 1])),
            _segments(
                (MODEL, [20, 21, 22]),
                (SEPARATOR, [30, 31]),
                (TOOL, [40, 41, 42]),
                (SEPARATOR, [32]),
                (MODEL, [23, 1]),
            ),
        ],
    ),
    (
        [[4]],
        [
            _segments(
                (MODEL, [7]),
                (SEPARATOR, [9]),
                (TOOL, [10, 10]),
                (SEPARATOR, [11]),
                (MODEL, [8]),
                (SEPARATOR, [9]),
                (TOOL, [3]),
                (SEPARATOR, [11]),
                (MODEL, [2, 1]),
            )
        ],
    ),
)


def _written(prompt_ids, segments, roles) -> torch.Tensor:
    """1 on response tokens whose role is in ``roles``, padded, NOT shifted."""
    rows = [
        [0] * len(prompt) + [int(s.role in roles) for s in row for _ in s.token_ids]
        for prompt, row in zip(prompt_ids, segments)
    ]
    width = max(len(row) for row in rows)
    return torch.tensor([row + [0] * (width - len(row)) for row in rows])  # (B, T)


# The slips the check names when it recognises one.
SLIPS: dict[str, Callable[..., torch.Tensor]] = {
    "tool tokens are kept in the mask (only the model's own tokens are trained)": (
        lambda p, s: _written(p, s, (MODEL, TOOL))[:, 1:]
    ),
    "separator tokens are kept in the mask (the environment wrote them)": (
        lambda p, s: _written(p, s, (MODEL, SEPARATOR))[:, 1:]
    ),
    "the mask is off by one at each turn boundary: it follows input_ids, but "
    "position t must say whether labels[t] (token t + 1) was sampled": (
        lambda p, s: _written(p, s, (MODEL,))[:, :-1]
    ),
    "every response token is kept: that is the single-turn mask": (
        lambda p, s: _written(p, s, (MODEL, TOOL, SEPARATOR))[:, 1:]
    ),
}


def _diagnosis(received: torch.Tensor, prompt_ids, segments) -> str:
    for slip, wrong in SLIPS.items():
        mask = wrong(prompt_ids, segments)
        if received.shape == mask.shape and torch.equal(received.long(), mask):
            return f"\n  this looks like a slip: {slip}"
    return ""


@exercise_check("Exercise 14-multi_turn_response_mask (the multi-turn response mask)")
def check_multi_turn_mask(student_fn: MaskFunction, cases: CaseCount) -> None:
    """``student_fn(prompt_ids, segments)`` -> response_mask (B, T - 1)."""
    for prompt_ids, segments in MASK_CASES:
        with cases.case():
            expected = pad_prompt_and_segment_ids(prompt_ids, segments, PAD_TOKEN_ID)[
                "response_mask"
            ]
            received = student_fn(prompt_ids, segments)
            roles = [[(s.role, list(s.token_ids)) for s in row] for row in segments]
            inputs = f"prompt_ids={prompt_ids}, segments={roles}"
            if not isinstance(received, torch.Tensor):
                raise ExerciseFailed(
                    f"For {inputs}: expected a tensor, got {type(received).__name__}"
                )
            if received.shape != expected.shape:
                raise ExerciseFailed(
                    f"For {inputs}: expected shape {tuple(expected.shape)} (B, T - 1), "
                    f"got {tuple(received.shape)}"
                )
            if not torch.equal(received.long(), expected):
                raise ExerciseFailed(
                    f"For {inputs}:\n  expected {expected.tolist()}\n"
                    f"  got      {received.long().tolist()}"
                    f"{_diagnosis(received, prompt_ids, segments)}"
                )
