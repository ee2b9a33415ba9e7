"""The Messages door's request, checked and turned into the core's terms: `system` and content blocks →
chat messages (`tool_use` → an assistant turn's calls, `tool_result` → `tool` messages), tools and
`tool_choice` → a `ToolRequest`. Errors are Anthropic's `invalid_request_error`s."""

from __future__ import annotations

import json
import re
from typing import Any

from backends.base import ChatMessage, ToolCall, ToolChoice, ToolFunction
from gateway.config import ServerConfig
from gateway.errors import GatewayError
from gateway.params.constraints import schema_problem
from gateway.params.openai import stop_list
from gateway.params.openai_constraints import AskedConstraint, json_schema
from gateway.protocol.anthropic import (
    CountTokensRequest,
    MessagesRequest,
    TextBlockIn,
    ToolResultBlockIn,
    ToolUseBlockIn,
)
from gateway.protocol.openai import SamplingExtras
from gateway.tools.request import ToolRequest

_VERSION = re.compile(r"\d{4}-\d{2}-\d{2}")
# Anthropic's own tools (bash, text editor, web search, ...) run on Anthropic's side: nothing here runs them
_CLIENT_TOOL_TYPES = (None, "custom")


def _invalid(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(message, kind="validation", param=param)


def check_version(header: str | None) -> None:
    """`anthropic-version` is read: a date such as 2023-06-01. Absent, the current API is meant."""
    if header is not None and not _VERSION.fullmatch(header.strip()):
        raise _invalid(f"anthropic-version: invalid version {header!r}; expected a date such as 2023-06-01")


def _result_text(blocks: str | list[dict[str, Any]] | None, where: str) -> str:
    """A `tool_result`'s content: a string, or text blocks (images and documents are refused)."""
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    texts = []
    for j, block in enumerate(blocks):
        kind = block.get("type")
        if kind != "text" or not isinstance(block.get("text"), str):
            raise _invalid(f"{where}.{j}: content blocks of type {kind!r} are not supported here; only text")
        texts.append(block["text"])
    return "\n".join(texts)


def _system(req: CountTokensRequest) -> list[ChatMessage]:
    if req.system is None:
        return []
    text = req.system if isinstance(req.system, str) else "\n".join(b.text for b in req.system)
    return [ChatMessage(role="system", content=text)] if text else []


def chat_messages(req: CountTokensRequest) -> list[ChatMessage]:
    """Core messages. A user turn's `tool_result` blocks become `tool` messages (before its text, as
    they answer the calls of the turn before); an assistant turn's `tool_use` blocks become its calls."""
    messages = _system(req)
    calls: set[str] = set()
    for i, m in enumerate(req.messages):
        where = f"messages.{i}.content"
        if isinstance(m.content, str):
            messages.append(ChatMessage(role=m.role, content=m.content))
            continue
        texts: list[str] = []
        turn_calls: list[ToolCall] = []
        results: list[ChatMessage] = []
        for j, block in enumerate(m.content):
            if isinstance(block, TextBlockIn):
                texts.append(block.text)
            elif isinstance(block, ToolUseBlockIn):
                if m.role != "assistant":
                    raise _invalid(f"{where}.{j}: `tool_use` blocks may only be in assistant messages")
                turn_calls.append(ToolCall(id=block.id, name=block.name,
                                           arguments=json.dumps(block.input, ensure_ascii=False)))
                calls.add(block.id)
            elif isinstance(block, ToolResultBlockIn):
                if m.role != "user":
                    raise _invalid(f"{where}.{j}: `tool_result` blocks may only be in user messages")
                if block.tool_use_id not in calls:
                    raise _invalid(f"{where}.{j}: unexpected `tool_use_id` found in `tool_result` blocks: "
                                   f"{block.tool_use_id}. Each `tool_result` block must have a corresponding "
                                   f"`tool_use` block in the previous message.")
                text = _result_text(block.content, f"{where}.{j}.content")
                results.append(ChatMessage(role="tool", content=f"Error: {text}" if block.is_error else text,
                                           tool_call_id=block.tool_use_id))
            else:
                kind = block.__struct_config__.tag
                raise _invalid(f"{where}.{j}: content blocks of type {kind!r} are not supported by this gateway")
        text = "\n".join(texts)
        messages += results
        if turn_calls or text or not results:
            messages.append(ChatMessage(role=m.role, content=text if text or not turn_calls else None,
                                        tool_calls=turn_calls))
    return messages


def tool_request(req: CountTokensRequest) -> ToolRequest | None:
    tools = []
    for i, tool in enumerate(req.tools or []):
        if tool.type not in _CLIENT_TOOL_TYPES:
            raise _invalid(f"tools.{i}.type: tools of type {tool.type!r} are not supported by this gateway; only "
                           f"client tools with an `input_schema`")
        if (problem := schema_problem(tool.input_schema)) is not None or tool.input_schema.get("type") != "object":
            raise _invalid(f"tools.{i}.input_schema: must be a JSON Schema of type object"
                           f"{f' ({problem})' if problem else ''}")
        tools.append(ToolFunction(name=tool.name, description=tool.description, parameters=tool.input_schema,
                                  strict=tool.strict))
    if len({t.name for t in tools}) != len(tools):
        raise _invalid("tools: tool names must be unique")
    choice = req.tool_choice
    parallel = not (choice is not None and choice.disable_parallel_tool_use)
    if choice is None or choice.type == "auto":
        return ToolRequest(tools, ToolChoice(mode="auto"), parallel) if tools else None
    if choice.type == "none":
        return ToolRequest(tools, ToolChoice(mode="none"), parallel) if tools else None
    if not tools:
        raise _invalid(f"tool_choice: `{choice.type}` needs `tools`")
    if choice.type == "any":
        return ToolRequest(tools, ToolChoice(mode="required"), parallel)
    if choice.name is None or all(t.name != choice.name for t in tools):
        raise _invalid(f"tool_choice.name: tool {choice.name!r} is not among the `tools`")
    return ToolRequest(tools, ToolChoice(mode="function", function=choice.name), parallel)


def check_request(req: CountTokensRequest) -> None:
    if req.thinking is not None and req.thinking.type != "disabled":
        raise _invalid("thinking: extended thinking is not supported by this gateway's models")


def asked_format(req: MessagesRequest) -> AskedConstraint | None:
    """`output_config.format`: the answer follows a JSON schema."""
    fmt = req.output_config.format if req.output_config is not None else None
    if fmt is None:
        return None
    return AskedConstraint(json_schema(fmt.schema, "output_config.format.schema"), "output_config.format")


def user_key(req: MessagesRequest) -> str | None:
    """`metadata.user_id`: the key a split routes one user by, as OpenAI's `user` is."""
    user = (req.metadata or {}).get("user_id")
    return user if isinstance(user, str) else None


def sampling(req: MessagesRequest, server: ServerConfig) -> SamplingExtras:
    """The sampling fields, in the form the core request builder takes (Anthropic's default temperature is 1)."""
    if any(not s for s in req.stop_sequences or []):
        raise _invalid("stop_sequences: each stop sequence must contain non-whitespace text")
    stops = stop_list(req.stop_sequences, server) if req.stop_sequences else None
    return SamplingExtras(model=req.model, temperature=1.0 if req.temperature is None else req.temperature,
                          top_p=req.top_p if req.top_p else None, top_k=req.top_k or None, stop=stops,
                          stream=req.stream)
