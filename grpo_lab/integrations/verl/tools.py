"""A tool-using task on verl 0.9.1's agent loop: the tool config, the
overrides that turn the loop on, and the mask it trains with.

verl's ``ToolAgentLoop`` (``verl/experimental/agent_loop/tool_agent_loop.py``)
generates a turn, asks the tool parser named by
``actor_rollout_ref.rollout.multi_turn.format`` for the turn's calls, runs each
call's tool (the tools of ``multi_turn.tool_config_path``: ``BaseTool``
subclasses built by ``verl.tools.utils.tool_registry.initialize_tools_from_config``),
appends the replies, and generates again, up to ``multi_turn.max_assistant_turns``.
Its ``response_mask`` is 1 on the tokens the model generated and 0 on the
tokens the loop appended, which is grpo_lab's model-only mask
(:func:`verl_response_mask`; :mod:`grpo_lab.rollouts.multiturn`).

``grpo-lab export verl`` on a tool-using task writes ``tool_config.yaml``
(:func:`tool_config`) naming
:class:`grpo_lab.integrations.verl.calculator.CalculatorVerlTool` (the same
exact calculator, :class:`grpo_lab.rollouts.tools.CalculatorTool`)
and adds :func:`tool_overrides`: the multi-turn switch, the tool config, the
turn limit and grpo_lab's call-tag parser (``grpo_lab_calculator``, registered
in verl's ``ToolParser`` registry when the plugin module is imported), with
every prompt routed to ``tool_agent``. In verl the turns are chat messages: the
tool's reply comes back through the model's chat template as a ``tool``
message, so the reply's tokens are the template's, not ``<out>...</out>``; the
mask rule is the same.

Nothing here imports verl: the folder is written without it.
"""

from __future__ import annotations

import json
from typing import Any

from grpo_lab.rollouts.multiturn import MultiTurnRollouts, segment_model_flags
from grpo_lab.rollouts.tools import CalculatorTool
from grpo_lab.tasks import get_task, uses_tools

TOOL_NAME = "calculator"
TOOL_CLASS = "grpo_lab.integrations.verl.calculator.CalculatorVerlTool"
PARSER_NAME = "grpo_lab_calculator"
TOOL_CONFIG_FILE = "tool_config.yaml"
MULTI_TURN = "actor_rollout_ref.rollout.multi_turn"
TOOL_CONFIG_PATH = f"{MULTI_TURN}.tool_config_path"
AGENT_LOOP = "tool_agent"


def tool_schema() -> dict[str, Any]:
    """The calculator as an OpenAI function schema (verl's ``tool_schema``)."""
    return {
        "type": "function",
        "function": {
            "name": TOOL_NAME,
            "description": "The exact value of an arithmetic expression over "
            "integers with + - * / and parentheses; 'error' when it has none.",
            "parameters": {
                "type": "object",
                "properties": {
                    "expression": {
                        "type": "string",
                        "description": "for example 37*58",
                    }
                },
                "required": ["expression"],
            },
        },
    }


def tool_config(task: Any) -> dict[str, Any]:
    """``tool_config.yaml`` of verl's ``multi_turn.tool_config_path``."""
    tool = task.tool
    return {
        "tools": [
            {
                "class_name": TOOL_CLASS,
                "config": {
                    "type": "native",
                    "max_output_chars": tool.max_output_chars,
                },
                "tool_schema": tool_schema(),
            }
        ]
    }


def tool_overrides(config: Any) -> dict[str, Any]:
    """The Hydra overrides of a tool-using task's verl run ({} otherwise).

    max_assistant_turns is the task's max_turns; max_user_turns (tool
    replies) one less, so a call in the last allowed turn is not run, as in
    grpo_lab's rollout.
    """
    if not uses_tools(config.task):
        return {}
    task = get_task(config.task, **config.task_options)
    return {
        f"{MULTI_TURN}.enable": True,
        TOOL_CONFIG_PATH: TOOL_CONFIG_FILE,
        f"{MULTI_TURN}.max_assistant_turns": task.max_turns,
        f"{MULTI_TURN}.max_user_turns": task.max_turns - 1,
        f"{MULTI_TURN}.format": PARSER_NAME,
        "actor_rollout_ref.rollout.agent.default_agent_loop": AGENT_LOOP,
    }


def tool_config_text(config: Any) -> str | None:
    """The YAML text of ``tool_config.yaml`` for ``config``'s task, or None."""
    if not uses_tools(config.task):
        return None
    import yaml

    task = get_task(config.task, **config.task_options)
    return yaml.safe_dump(tool_config(task), sort_keys=False)


def calculator_calls(text: str) -> list[dict[str, str]]:
    """The calls of one model turn, as verl's ``FunctionCall`` fields.

    A turn that ends in ``<calc>expression</calc>`` is one call with
    arguments ``{"expression": expression}`` (grpo_lab's
    :meth:`~grpo_lab.rollouts.tools.CalculatorTool.call_arguments`); any other
    turn has none.
    """
    arguments = CalculatorTool().call_arguments(text)
    if arguments is None:
        return []
    return [{"name": TOOL_NAME, "arguments": json.dumps({"expression": arguments})}]


def verl_response_mask(rollouts: MultiTurnRollouts) -> list[list[int]]:
    """The agent loop's ``response_mask`` of each episode: 1 on the tokens the
    model generated, 0 on what the loop appended (tool replies, separators)."""
    return [segment_model_flags(row) for row in rollouts.segments]
