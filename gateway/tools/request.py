"""`tools`, `tool_choice` and `parallel_tool_calls` checked as vLLM checks them
(entrypoints/openai/chat_completion/protocol.py `check_tool_usage`), with its 400 messages."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from backends.base import ToolChoice, ToolFunction
from gateway.errors import GatewayError
from gateway.params.constraints import schema_problem
from gateway.protocol.openai import ChatCompletionRequest, CustomTool

_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


@dataclass(frozen=True)
class ToolRequest:
    tools: list[ToolFunction]
    choice: ToolChoice
    parallel: bool

    @property
    def forced(self) -> bool:
        """The answer must be calls: `required`, or a named function."""
        return self.choice.mode in ("required", "function")

    @property
    def offered(self) -> list[ToolFunction]:
        """The tools the model is told about: none for `none`, only the named one when one is forced."""
        if self.choice.mode == "none":
            return []
        if self.choice.mode == "function":
            return [t for t in self.tools if t.name == self.choice.function]
        return self.tools


def _invalid(message: str, param: str) -> GatewayError:
    return GatewayError(message, kind="validation", param=param)


def _tools(req: ChatCompletionRequest) -> list[ToolFunction]:
    if req.tools is not None and not req.tools:
        raise _invalid("`tools` must not be an empty array. Either provide at least one tool or omit the field "
                       "entirely.", "tools")
    tools = []
    for i, tool in enumerate(req.tools or []):
        if isinstance(tool, CustomTool):
            raise _invalid("custom tools (`type: custom`) are not supported by this gateway; only `function` tools",
                           f"tools[{i}].type")
        f = tool.function
        if f.parameters is not None:
            problem = schema_problem(f.parameters)
            if problem is not None:
                raise _invalid(f"`tools[{i}].function.parameters` is not a valid JSON Schema: {problem}",
                               f"tools[{i}].function.parameters")
        tools.append(ToolFunction(name=f.name, description=f.description, parameters=f.parameters,
                                  strict=f.strict))
    return tools


def _named(choice: dict[str, Any], tools: list[ToolFunction]) -> str:
    function = choice.get("function")
    if not isinstance(function, dict):
        raise _invalid(f"Invalid value for `function`: `{function}` in `tool_choice`! {_USAGE}",
                       "tool_choice.function")
    if "name" not in function:
        raise _invalid(f"Expected field `name` in `function` in `tool_choice`! {_USAGE}", "tool_choice.function.name")
    name = function["name"]
    if not isinstance(name, str) or not name:
        raise _invalid(f"Invalid `name` in `function`: `{name}` in `tool_choice`! {_USAGE}",
                       "tool_choice.function.name")
    if all(t.name != name for t in tools):
        raise _invalid("The tool specified in `tool_choice` does not match any of the specified `tools`",
                       "tool_choice")
    return name


def tool_request(req: ChatCompletionRequest) -> ToolRequest | None:
    """The request's tools and choice; None when it has neither. `tool_choice` defaults to `auto`
    with tools and `none` without, as in OpenAI and vLLM; `null` counts as not given."""
    if req.functions or req.function_call is not None:
        param = "functions" if req.functions else "function_call"
        raise _invalid(f"`{param}` (deprecated function calling) is not supported by this gateway; use `tools`",
                       param)
    tools = _tools(req)
    choice = req.tool_choice
    parallel = req.parallel_tool_calls is not False
    if choice is None:
        return ToolRequest(tools, ToolChoice(mode="auto"), parallel) if tools else None
    if choice == "none":
        return ToolRequest(tools, ToolChoice(mode="none"), parallel) if tools else None
    if not tools:
        raise _invalid("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if isinstance(choice, dict):
        return ToolRequest(tools, ToolChoice(mode="function", function=_named(choice, tools)), parallel)
    if choice not in ("auto", "required"):
        raise _invalid(f"Invalid value for `tool_choice`: {choice}! Only named tools, \"none\", \"auto\" or "
                       f"\"required\" are supported.", "tool_choice")
    return ToolRequest(tools, ToolChoice(mode=choice), parallel)
