"""Exercise checks, one module per notebook topic, on a shared framework."""

from grpo_lab.teaching.checks.framework import (
    ExerciseFailed,
    assert_close,
    exercise_check,
)

__all__ = ["ExerciseFailed", "assert_close", "exercise_check"]
