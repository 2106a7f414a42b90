"""Checks for the sampling side of ``notebooks/08_training_loop.ipynb``.

The exercise: a reward for ``hackable_addition`` that the hacks of notebook 08
cannot game. ``robust_reward(response, ground_truth)`` returns 1.0 for a
response that is the sum as the task writes it (``ground_truth``, surrounding
whitespace aside) and 0.0 for anything else; it never raises and never runs
the text. :func:`check_robust_reward` holds the cases a student sees (the hacks
the notebook shows); :func:`check_hidden_reward_hacks` runs hacks the grader
keeps to itself: they live in the course notebook's check cell, between
``### BEGIN HIDDEN TESTS`` and ``### END HIDDEN TESTS``, which neither the
student copy nor the wheel carries. The package's counterpart is
:func:`grpo_lab.rewards.exact_match_reward` (its ``"reward"``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from grpo_lab.teaching.checks.framework import (
    CaseCount,
    ExerciseFailed,
    exercise_check,
    hide_while_running,
    refuse_package_function,
)

RewardFunction = Callable[[object, object], object]

# (response, ground_truth, the reward it must get, what the case is)
VISIBLE_CASES: tuple[tuple[object, str, float, str], ...] = (
    ("42", "42", 1.0, "the sum itself"),
    (" 42\n", "42", 1.0, "the sum with whitespace around it"),
    ("0", "0", 1.0, "a sum of 0"),
    ("414243", "42", 0.0, "candidates listed one after another (notebook 08's hack)"),
    (
        "42186121219182988",
        "42",
        0.0,
        "the digit dump notebook 08's lenient run wrote, starting with the sum",
    ),
    ("43", "42", 0.0, "a wrong sum"),
    ("42abc", "42", 0.0, "the sum followed by other text"),
    ("", "42", 0.0, "an empty response"),
    (None, "42", 0.0, "a response that is not a string"),
)


def _paid(
    student_fn: RewardFunction, response: object, ground_truth: str, what: str
) -> float:
    """The reward as a float; ExerciseFailed when it is not a number or when
    the reward raised (a hidden counterpart's stub keeps its own message)."""
    try:
        value = student_fn(response, ground_truth)
    except (ExerciseFailed, NotImplementedError):
        raise
    except Exception as error:
        if "is not available while this exercise is" in str(error):
            raise ExerciseFailed(str(error)) from None
        raise ExerciseFailed(
            f"For response={response!r} ({what}): the reward raised "
            f"{type(error).__name__}; a reward never raises"
        ) from None
    if isinstance(value, bool):
        value = float(value)
    if not isinstance(value, (int, float)):
        raise ExerciseFailed(
            f"For response={response!r}, ground_truth={ground_truth!r}: the reward "
            f"must be a number (0.0 or 1.0), got {type(value).__name__}"
        )
    return float(value)


@exercise_check("Exercise 08-robust_reward (a reward the hacks cannot game)")
def check_robust_reward(student_fn: RewardFunction, cases: CaseCount) -> None:
    """``student_fn(response, ground_truth)`` -> 1.0 or 0.0, on the hacks the
    notebook shows and on the answers it must still pay."""
    for response, ground_truth, expected, what in VISIBLE_CASES:
        with cases.case():
            received = _paid(student_fn, response, ground_truth, what)
            if received != expected:
                raise ExerciseFailed(
                    f"For response={response!r}, ground_truth={ground_truth!r} "
                    f"({what}):\n  expected {expected}\n  got      {received}"
                )


def check_hidden_reward_hacks(
    student_fn: RewardFunction,
    hacks: Sequence[tuple[object, str, float, str]],
) -> bool:
    """Run ``hacks`` (response, ground_truth, reward, what) against
    ``student_fn`` with what the exercise's check hides out of reach: True when
    every one gets its reward, False on a stub (the check above already said
    "not attempted yet"); else ExerciseFailed naming the kind of hack, not the
    hack itself."""
    refuse_package_function(student_fn, "check_robust_reward")
    hiding = hide_while_running(student_fn, "check_robust_reward")
    for response, ground_truth, expected, what in hacks:
        try:
            received = _paid(hiding, response, ground_truth, f"hidden: {what}")
        except NotImplementedError:
            return False
        except ExerciseFailed as failure:
            if "For response=" in str(failure):  # keep the hidden response unsaid
                raise ExerciseFailed(
                    f"a case the grader keeps hidden ({what}): the reward raised "
                    "or returned no number; a reward never raises"
                ) from None
            raise
        if received != expected:
            raise ExerciseFailed(
                f"a case the grader keeps hidden ({what}) got {received}, "
                f"expected {expected}"
            )
    return True
