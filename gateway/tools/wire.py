"""Tool calls in OpenAI's response shapes: whole calls on a message, and stream chunks."""

from __future__ import annotations

from backends.base import ToolCall, ToolCallDelta
from gateway.protocol.openai import FunctionCallOut, FunctionChunk, ToolCallChunk, ToolCallOut


def calls_out(calls: list[ToolCall]) -> list[ToolCallOut]:
    return [ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments)) for c in calls]


def call_chunks(deltas: list[ToolCallDelta]) -> list[ToolCallChunk]:
    """One chunk per piece, OpenAI's way: a call's first chunk has `index`, `id`, `type`, the name and
    `arguments: ""`; the chunks after it only `index` and an argument fragment."""
    chunks = []
    for d in deltas:
        if d.id is not None:
            chunks.append(ToolCallChunk(index=d.index, id=d.id, type="function",
                                        function=FunctionChunk(name=d.name or "", arguments="")))
        if d.arguments:
            chunks.append(ToolCallChunk(index=d.index, function=FunctionChunk(arguments=d.arguments)))
    return chunks
