"""Tasks: prompts with verifiable answers, and ``get_task(name, **options)``.

Names: ``"reverse"``, ``"addition"`` (toy tasks for a tiny character model),
``"scratchpad"`` (reversal after an optional restatement: responses of
several lengths earn the same reward), ``"calculator"`` (multiply two numbers
by calling a calculator tool mid-response, multi-turn),
``"hackable_addition"`` (addition with a strict or a deliberately lenient
reward), ``"countdown"`` (reach a target with + - * /), ``"gsm8k"`` and ``"math"``
(r1-zero prompt; ``path=`` a local JSONL file in the published format).
Taught in
``notebooks/03_rewards_and_advantages.ipynb``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from grpo_lab.tasks.base import Example, Task
from grpo_lab.tasks.calculator import CalculatorTask
from grpo_lab.tasks.countdown import CountdownTask
from grpo_lab.tasks.hackable import HackableAdditionTask
from grpo_lab.tasks.math_data import GSM8KTask, MathTask
from grpo_lab.tasks.scratchpad import ScratchpadReverseTask
from grpo_lab.tasks.toy import AdditionTask, ReverseTask

TASK_CLASSES = {
    "reverse": ReverseTask,
    "addition": AdditionTask,
    "countdown": CountdownTask,
    "gsm8k": GSM8KTask,
    "math": MathTask,
    "scratchpad": ScratchpadReverseTask,
    "hackable_addition": HackableAdditionTask,
    "calculator": CalculatorTask,
}


def task_options(name: str) -> list[str]:
    """The option names ``get_task(name, ...)`` accepts."""
    task_class = TASK_CLASSES[name]
    return [field.name for field in dataclasses.fields(task_class) if field.init]


def get_task(name: str, /, **options: object) -> Task:
    """The task called ``name``, built with ``options`` (see each task's fields).

    Example: ``get_task("reverse", n_digits=4)``, ``get_task("gsm8k", path=...)``.
    """
    check_task_name_and_options(name, options, name_setting="name", options_setting="")
    return TASK_CLASSES[name](**options)


def uses_tools(name: str) -> bool:
    """Whether the task called ``name`` is sampled as multi-turn tool episodes."""
    return bool(getattr(TASK_CLASSES.get(name), "uses_tools", False))


def check_task_name_and_options(
    name: str,
    options: Mapping[str, object],
    name_setting: str = "task",
    options_setting: str = "task_options",
) -> None:
    """A known task name, and option names that task accepts (values: the task's).

    ``name_setting`` and ``options_setting`` are what the message calls them.
    """
    if name not in TASK_CLASSES:
        raise ValueError(
            f"{name_setting} must be one of {sorted(TASK_CLASSES)}, got {name!r}"
        )
    allowed = task_options(name)
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        holds = f"{options_setting} holds unknown" if options_setting else "unknown"
        raise ValueError(
            f"{holds} option(s) {unknown} for task {name!r}; expected some of {allowed}"
        )


__all__ = [
    "AdditionTask",
    "CalculatorTask",
    "CountdownTask",
    "Example",
    "GSM8KTask",
    "HackableAdditionTask",
    "MathTask",
    "ReverseTask",
    "ScratchpadReverseTask",
    "Task",
    "check_task_name_and_options",
    "get_task",
    "task_options",
    "uses_tools",
]
