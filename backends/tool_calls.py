"""Tools and tool calls in the OpenAI wire form, both ways, for upstreams that parse calls themselves."""

from __future__ import annotations

import json
import uuid
from typing import Any

from backends.base import (
    BackendValidationError,
    ChatMessage,
    GenerationRequest,
    ToolCallDelta,
    ToolChoice,
    ToolFunction,
    UpstreamError,
)


def wire_message(m: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:  # content may stay null: OpenAI's form of an assistant turn that only called tools
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in m.tool_calls]
    elif m.content is None:
        out["content"] = ""
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        out["name"] = m.name
    return out


def wire_tool(t: ToolFunction) -> dict[str, Any]:
    function: dict[str, Any] = {"name": t.name}
    for key in ("description", "parameters", "strict"):
        if getattr(t, key) is not None:
            function[key] = getattr(t, key)
    return {"type": "function", "function": function}


def wire_tool_choice(choice: ToolChoice) -> str | dict[str, Any]:
    if choice.mode == "function":
        return {"type": "function", "function": {"name": choice.function}}
    return choice.mode


def tool_fields(r: GenerationRequest, backend: str, send_parallel: bool) -> dict[str, Any]:
    """`tools`, `tool_choice`, `parallel_tool_calls` for a chat body. `send_parallel` False sends the
    flag only when it is false (trtllm-serve releases that do not know it refuse it; the default, true,
    is what they do anyway)."""
    if not r.tools:
        if r.tool_choice is not None and r.tool_choice.mode in ("required", "function"):
            raise BackendValidationError(f"backend {backend!r}: tool_choice {r.tool_choice.mode!r} without tools")
        return {}  # OpenAI servers refuse `tools: []`, and `tool_choice` without tools
    fields: dict[str, Any] = {"tools": [wire_tool(t) for t in r.tools]}
    if r.tool_choice is not None:
        fields["tool_choice"] = wire_tool_choice(r.tool_choice)
    if send_parallel or not r.parallel_tool_calls:
        fields["parallel_tool_calls"] = r.parallel_tool_calls
    return fields


def refuse_tools(backend: str, type_name: str, r: GenerationRequest) -> None:
    """For a backend with `native_tools=False`: the gateway renders tools and calls into the prompt or
    the messages' text, so any that reach the backend would otherwise be lost."""
    forced = r.tool_choice is not None and r.tool_choice.mode in ("required", "function")
    if r.tools or forced or any(m.tool_calls for m in r.messages or []):
        raise BackendValidationError(f"backend {backend!r} ({type_name}) does not take tools or tool calls; "
                                     f"the gateway renders them into the prompt")


class ToolCallRelay:
    """An upstream's tool-call pieces as normalised deltas: the first for an index carries id and
    name (an id is made up where the upstream sent none or ""), later ones only argument text.
    `parallel=False` keeps only the first call, as OpenAI and vLLM do, for upstreams that do not."""

    def __init__(self, backend: str, parallel: bool = True) -> None:
        self.backend = backend
        self.parallel = parallel
        self.ids: dict[int, str] = {}
        self.pending: dict[int, str] = {}  # argument text that came before the call's name

    def feed(self, calls: Any) -> list[ToolCallDelta]:
        out: list[ToolCallDelta] = []
        for position, call in enumerate(calls if isinstance(calls, list) else []):
            index = call.get("index")
            index = index if isinstance(index, int) else position  # a whole message's calls carry no index
            if index > 0 and not self.parallel:
                continue
            function = call.get("function") or {}
            arguments = function.get("arguments") or ""
            if not isinstance(arguments, str):  # an object where OpenAI has a JSON text
                arguments = json.dumps(arguments, ensure_ascii=False)
            if index in self.ids:
                if arguments:
                    out.append(ToolCallDelta(index=index, arguments=arguments))
                continue
            name = function.get("name")
            if not name:
                self.pending[index] = self.pending.get(index, "") + arguments
                continue
            self.ids[index] = call.get("id") or f"call_{uuid.uuid4().hex[:24]}"
            out.append(ToolCallDelta(index=index, id=self.ids[index], name=name,
                                     arguments=self.pending.pop(index, "") + arguments))
        return out

    def finish(self) -> None:
        if self.pending:
            raise UpstreamError(f"{self.backend}: the upstream sent tool-call arguments without a function name")
