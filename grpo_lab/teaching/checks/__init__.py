"""Exercise checks, one module per notebook topic, on a shared framework.

``PACKAGE_COUNTERPARTS`` maps each check to the package function(s) it compares
against; a check refuses a student function that is or calls one of them.
"""

from grpo_lab.teaching.checks.exercises import PACKAGE_COUNTERPARTS
from grpo_lab.teaching.checks.framework import (
    ExerciseFailed,
    assert_close,
    assert_value_and_gradient,
    exercise_check,
    refuse_package_function,
)

__all__ = [
    "PACKAGE_COUNTERPARTS",
    "ExerciseFailed",
    "assert_close",
    "assert_value_and_gradient",
    "exercise_check",
    "refuse_package_function",
]
