"""The calculator inside verl's agent loop (needs verl 0.9.1).

``CalculatorVerlTool`` is the ``BaseTool`` that ``tool_config.yaml`` names
(:mod:`grpo_lab.integrations.verl.tools`): ``execute`` answers
``{"expression": ...}`` with :class:`grpo_lab.rollouts.tools.CalculatorTool`,
the same parser-only, bounded calculator grpo_lab's rollout calls (never
``eval``). ``CalculatorCallParser``, registered in verl's ``ToolParser``
registry as ``grpo_lab_calculator``, reads a turn that ends in
``<calc>...</calc>`` as one call (``verl_tools.calculator_calls``), as
grpo_lab's rollout does. verl imports this module when it builds the tools
of ``tool_config.yaml`` (``initialize_tools_from_config``), before it looks up
the parser. The parser needs verl's agent loop, which imports PIL, datasets and
the rollout server; without them only the tool is defined.
"""

from __future__ import annotations

from typing import Any

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

from grpo_lab.integrations.verl import tools as verl_tools
from grpo_lab.rollouts.tools import CalculatorTool

try:  # verl's agent loop: a full verl install
    from verl.experimental.agent_loop.tool_parser import FunctionCall, ToolParser
except ImportError:  # verl without the agent loop's dependencies
    FunctionCall = ToolParser = None


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
        expression = None
        if isinstance(parameters, dict):
            expression = parameters.get("expression")
        reply = self.calculator.run(expression)
        return ToolResponse(text=reply.text), 0.0, {"error": reply.error}


if ToolParser is not None:

    @ToolParser.register(verl_tools.PARSER_NAME)
    class CalculatorCallParser(ToolParser):
        """A turn that ends in ``<calc>expression</calc>`` is one call."""

        async def extract_tool_calls(
            self, responses_ids: list[int], tools: Any = None
        ) -> tuple[str, list[Any]]:
            text = self.tokenizer.decode(responses_ids, skip_special_tokens=True)
            calls = verl_tools.calculator_calls(text)
            return text, [FunctionCall(**call) for call in calls]
