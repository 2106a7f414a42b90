"""The calculator inside verl's agent loop (needs verl 0.9.1).

``CalculatorVerlTool`` is the ``BaseTool`` that ``tool_config.yaml`` names
(:mod:`grpo_lab.integrations.verl_tools`): ``execute`` answers
``{"expression": ...}`` with :class:`grpo_lab.rollouts.tools.CalculatorTool`,
the same parser-only, bounded calculator grpo_lab's rollout calls (never
``eval``). ``CalculatorCallParser``, registered as ``grpo_lab_calculator``,
reads the turn's last ``<calc>...</calc>`` as one call, as grpo_lab's rollout
does. Imported by verl through the plugin module
(``VERL_USE_EXTERNAL_MODULES``) and by ``initialize_tools_from_config``.
"""

from __future__ import annotations

import json
from typing import Any

from verl.experimental.agent_loop.tool_parser import FunctionCall, ToolParser
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

from grpo_lab.integrations import verl_tools
from grpo_lab.integrations.verl_tools import PARSER_NAME, TOOL_NAME
from grpo_lab.rollouts.tools import CalculatorTool


class CalculatorVerlTool(BaseTool):
    """grpo_lab's calculator as a verl tool: no state, no tool reward."""

    def __init__(
        self, config: dict, tool_schema: OpenAIFunctionToolSchema | None = None
    ) -> None:
        schema = tool_schema or OpenAIFunctionToolSchema.model_validate(
            verl_tools.tool_schema()
        )
        super().__init__(config, schema)
        self.calculator = CalculatorTool(
            max_output_chars=int(config.get("max_output_chars", 16))
        )

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict]:
        """The reply to ``parameters["expression"]``; metrics say whether it
        failed."""
        expression = (
            parameters.get("expression") if isinstance(parameters, dict) else None
        )
        reply = self.calculator.run(expression)
        return ToolResponse(text=reply.text), 0.0, {"error": reply.error}


@ToolParser.register(PARSER_NAME)
class CalculatorCallParser(ToolParser):
    """A turn that ends in ``<calc>expression</calc>`` is one calculator call."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self.calculator = CalculatorTool()

    async def extract_tool_calls(
        self, responses_ids: list[int], tools: Any = None
    ) -> tuple[str, list[FunctionCall]]:
        text = self.tokenizer.decode(responses_ids, skip_special_tokens=True)
        arguments = self.calculator.call_arguments(text)
        if arguments is None:
            return text, []
        call = FunctionCall(
            name=TOOL_NAME, arguments=json.dumps({"expression": arguments})
        )
        return text, [call]
