"""Tools and tool-call history for a model that takes neither natively: as text its chat template
can render.

When the model's chat template uses `tools`, the template renders them (and the calls and results
in the history, in its own format; see `ModelRoute.render_chat`). Otherwise, and for chat backends
that take only plain messages, this module rewrites the messages:
- the tools go in a system prompt in SmolLM2's trained format (below), after any system prompt given;
- an assistant turn's calls become `<tool_call>[{"name": ..., "arguments": {...}}]</tool_call>` text;
- `tool` results become a user turn of `<tool_response>` blocks (consecutive results share one turn),
  which every template renders (SmolLM2's breaks on content None, and has no `tool` role).
"""

from __future__ import annotations

import json
from typing import Any

from backends.base import ChatMessage, ToolCall, ToolFunction

# SmolLM2's tool prompt (its model card; Ollama's smollm2 template), with one change: a question
# no tool fits is answered in plain text (auto), instead of with an empty list of calls.
TOOL_PROMPT = """You are an expert in composing functions. You are given a question and a set of possible functions.
Based on the question, you will need to make one or more function/tool calls to achieve the purpose.
If none of the functions can be used, answer the question directly, in plain text, without a tool call.
If the given question lacks the parameters required by the function, also point it out.

You have access to the following tools:
<tools>{tools}</tools>

To call tools, answer with the calls only, in exactly this format; make sure each parameter has the right type.
<tool_call>[
{{"name": "func_name1", "arguments": {{"argument1": "value1", "argument2": "value2"}}}},
... (more tool calls as required)
]</tool_call>"""


def tool_definitions(tools: list[ToolFunction]) -> str:
    listed = []
    for t in tools:
        entry: dict[str, Any] = {"name": t.name}
        if t.description:
            entry["description"] = t.description
        entry["parameters"] = t.parameters if t.parameters is not None else {"type": "object", "properties": {}}
        listed.append(entry)
    return json.dumps(listed, ensure_ascii=False)


def arguments_value(arguments: str) -> Any:
    """A call's arguments as JSON, where they parse; else the text as it was sent."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def call_markup(calls: list[ToolCall]) -> str:
    listed = [{"name": c.name, "arguments": arguments_value(c.arguments)} for c in calls]
    return f"<tool_call>{json.dumps(listed, ensure_ascii=False)}</tool_call>"


def plain_messages(messages: list[ChatMessage], offered: list[ToolFunction]) -> list[ChatMessage]:
    """`messages` with tools, calls and results as text; `offered`: the tools to describe (none: none)."""
    out: list[ChatMessage] = []
    results = False  # whether the last message out is a turn of tool results
    for m in messages:
        if m.role == "tool":
            block = f"<tool_response>\n{m.content or ''}\n</tool_response>"
            if results:
                out[-1] = ChatMessage(role="user", content=f"{out[-1].content}\n{block}")
            else:
                out.append(ChatMessage(role="user", content=block))
            results = True
            continue
        results = False
        if m.tool_calls:
            text = f"{m.content}\n{call_markup(m.tool_calls)}" if m.content else call_markup(m.tool_calls)
            out.append(ChatMessage(role=m.role, content=text, name=m.name))
        else:
            out.append(ChatMessage(role=m.role, content=m.content or "", name=m.name))
    if offered:
        prompt = TOOL_PROMPT.format(tools=tool_definitions(offered))
        if out and out[0].role == "system":
            out[0] = ChatMessage(role="system", content=f"{out[0].content}\n\n{prompt}", name=out[0].name)
        else:
            out.insert(0, ChatMessage(role="system", content=prompt))
    return out


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages in the shape Hugging Face chat templates that know tools expect (transformers' docs):
    calls with `arguments` as objects, results with role `tool` and their `tool_call_id`."""
    out = []
    for m in messages:
        entry: dict[str, Any] = {"role": m.role, "content": m.content or ""}
        if m.tool_calls:
            entry["tool_calls"] = [{"id": c.id, "type": "function",
                                    "function": {"name": c.name, "arguments": arguments_value(c.arguments)}}
                                   for c in m.tool_calls]
        if m.tool_call_id is not None:
            entry["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            entry["name"] = m.name
        out.append(entry)
    return out


def template_tools(tools: list[ToolFunction]) -> list[dict[str, Any]]:
    out = []
    for t in tools:
        function: dict[str, Any] = {"name": t.name, "description": t.description or "",
                                    "parameters": t.parameters or {"type": "object", "properties": {}}}
        out.append({"type": "function", "function": function})
    return out
