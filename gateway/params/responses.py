"""The Responses door's request, checked and turned into the core's terms: input items → chat messages,
function tools and `tool_choice` → a `ToolRequest`, `text.format` → an output constraint. Errors are
OpenAI's 400s, naming the field (`param`) at fault."""

from __future__ import annotations

import json
from typing import Any

import msgspec

from backends.base import ChatMessage, OutputConstraint, ToolCall, ToolChoice, ToolFunction
from gateway.errors import GatewayError
from gateway.params.constraints import schema_problem
from gateway.params.openai_constraints import AskedConstraint, json_schema
from gateway.protocol.openai import SamplingExtras
from gateway.protocol.responses import (
    ITEM_TYPES,
    FormatJsonObject,
    FormatJsonSchema,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    InputText,
    MessageItem,
    OutputTextIn,
    RefusalIn,
    ResponseCreateRequest,
)
from gateway.tools.request import ToolRequest

ROLES = {"developer": "system"}  # the chat roles the core knows; a developer message is a system one


def _invalid(message: str, param: str | None) -> GatewayError:
    return GatewayError(message, kind="validation", param=param)


def _text(content: str | list[Any], param: str) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        if isinstance(part, InputText | OutputTextIn):
            parts.append(part.text)
        elif isinstance(part, RefusalIn):
            parts.append(part.refusal)
        else:
            kind = part.__struct_config__.tag
            raise _invalid(f"content of type {kind!r} is not supported by this gateway; only text", f"{param}[{j}]")
    return "".join(parts)


def _item(raw: Any, param: str) -> MessageItem | FunctionCallItem | FunctionCallOutputItem:
    if not isinstance(raw, dict):
        raise _invalid("Invalid input item: expected an object", param)
    kind = raw.get("type", "message" if "role" in raw else None)
    if kind not in ITEM_TYPES:
        supported = ", ".join(repr(k) for k in ITEM_TYPES)
        raise _invalid(f"Invalid value for input item type: {kind!r}. Supported values are: {supported}.",
                       f"{param}.type")
    try:
        return msgspec.convert(raw, ITEM_TYPES[kind])
    except msgspec.ValidationError as exc:
        raise _invalid(f"Invalid input item: {exc}", param) from None


def input_messages(data: ResponseCreateRequest, earlier: list[ChatMessage]) -> list[ChatMessage]:
    """This turn's input as core messages, after the `earlier` conversation (previous_response_id).
    Function calls join the assistant turn they follow; each output is a `tool` message."""
    items = [MessageItem(role="user", content=data.input)] if isinstance(data.input, str) else \
        [_item(raw, f"input[{i}]") for i, raw in enumerate(data.input)]
    if not items:
        raise _invalid("`input` must not be empty", "input")
    messages: list[ChatMessage] = []
    calls = {c.id for m in earlier for c in m.tool_calls}
    for i, item in enumerate(items):
        param = f"input[{i}]"
        if isinstance(item, MessageItem):
            messages.append(ChatMessage(role=ROLES.get(item.role, item.role),
                                        content=_text(item.content, f"{param}.content")))
        elif isinstance(item, FunctionCallItem):
            call = ToolCall(id=item.call_id, name=item.name, arguments=item.arguments)
            calls.add(item.call_id)
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                messages[-1] = msgspec.structs.replace(last, tool_calls=[*last.tool_calls, call])
            else:
                messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        else:
            if item.call_id not in calls:
                raise _invalid(f"No tool call found for function call output with call_id {item.call_id}.",
                               f"{param}.call_id")
            messages.append(ChatMessage(role="tool", content=_text(item.output, f"{param}.output"),
                                        tool_call_id=item.call_id))
    return messages


def function_tools(data: ResponseCreateRequest) -> list[FunctionTool]:
    tools = []
    for i, raw in enumerate(data.tools or []):
        kind = raw.get("type") if isinstance(raw, dict) else None
        if kind != "function":
            raise _invalid(f"tools of type {kind!r} are not supported by this gateway; only 'function' tools",
                           f"tools[{i}].type")
        try:
            tool = msgspec.convert(raw, FunctionTool)
        except msgspec.ValidationError as exc:
            raise _invalid(f"Invalid tool: {exc}", f"tools[{i}]") from None
        if tool.parameters is not None and (problem := schema_problem(tool.parameters)) is not None:
            raise _invalid(f"`tools[{i}].parameters` is not a valid JSON Schema: {problem}", f"tools[{i}].parameters")
        tools.append(tool)
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise _invalid("tool names must be unique", "tools")
    return tools


def tool_request(data: ResponseCreateRequest, tools: list[FunctionTool]) -> ToolRequest | None:
    """`tool_choice` as OpenAI has it: `none`, `auto` (the default with tools), `required`, or
    `{"type": "function", "name": ...}`."""
    core = [ToolFunction(name=t.name, description=t.description, parameters=t.parameters, strict=t.strict)
            for t in tools]
    parallel = data.parallel_tool_calls is not False
    choice = data.tool_choice
    if choice is None or choice == "auto":
        return ToolRequest(core, ToolChoice(mode="auto"), parallel) if core else None
    if choice == "none":
        return ToolRequest(core, ToolChoice(mode="none"), parallel) if core else None
    if not core:
        raise _invalid("`tool_choice` needs `tools`", "tool_choice")
    if choice == "required":
        return ToolRequest(core, ToolChoice(mode="required"), parallel)
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        if not isinstance(name, str) or all(t.name != name for t in core):
            raise _invalid(f"Tool choice '{name}' not found in 'tools' parameter.", "tool_choice")
        return ToolRequest(core, ToolChoice(mode="function", function=name), parallel)
    raise _invalid(f"Invalid value for `tool_choice`: {json.dumps(choice)}. Supported: 'none', 'auto', 'required', "
                   f"or {{\"type\": \"function\", \"name\": ...}}", "tool_choice")


def asked_format(data: ResponseCreateRequest) -> AskedConstraint | None:
    fmt = data.text.format if data.text is not None else None
    if isinstance(fmt, FormatJsonSchema):
        return AskedConstraint(json_schema(fmt.schema, "text.format.schema", name=fmt.name, strict=fmt.strict),
                               "text.format")
    if isinstance(fmt, FormatJsonObject):
        return AskedConstraint(OutputConstraint(kind="json_object"), "text.format")
    return None


def check_request(data: ResponseCreateRequest) -> None:
    if data.background:
        raise _invalid("`background` responses are not supported by this gateway", "background")


def sampling(data: ResponseCreateRequest) -> SamplingExtras:
    """The sampling fields, in the form the core request builder takes (OpenAI's defaults: temperature 1)."""
    return SamplingExtras(model=data.model, temperature=data.temperature, top_p=data.top_p, stream=data.stream,
                          user=data.user)
