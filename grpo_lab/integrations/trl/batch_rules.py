"""TRL 1.16's own batch rules, as ``GRPOConfig`` checks them when it is built.

:func:`trl_batch_problem` says what TRL would refuse in a set of ``GRPOConfig``
arguments, so that
:func:`grpo_lab.integrations.trl.translation.to_trl_config` refuses it
first, naming the grpo_lab field (``tests/test_integrations_trl.py`` holds it
to ``GRPOConfig``'s own validation on a grid).
"""

from __future__ import annotations

from typing import Any


def trl_batch_problem(arguments: dict[str, Any], num_processes: int) -> str | None:
    """What TRL 1.16's ``GRPOConfig`` would refuse in ``arguments`` on
    ``num_processes`` processes (None: nothing), by its own rules: the
    generation batch divides by per_device_train_batch_size x processes and
    by num_generations, and the global eval batch by num_generations."""
    global_batch = arguments["per_device_train_batch_size"] * num_processes
    generations = arguments["num_generations"]
    if arguments["generation_batch_size"] % global_batch:
        return (
            f"generation_batch_size ({arguments['generation_batch_size']}) must be "
            f"divisible by the global batch size ({global_batch})"
        )
    if arguments["generation_batch_size"] % generations:
        return "generation_batch_size must be divisible by num_generations"
    evaluates = arguments.get("eval_strategy", "no") != "no"
    eval_batch = arguments.get("per_device_eval_batch_size", 8) * num_processes
    if evaluates and eval_batch % generations:
        return f"the global eval batch ({eval_batch}) must divide by {generations}"
    return None
