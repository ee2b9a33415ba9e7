"""Tool-call deltas → whole calls (for non-streaming answers), and the token-event stream with the
gateway's parser applied to its text."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec

from backends.base import TokenEvent, ToolCall, ToolCallDelta
from gateway.closing import close_detached
from gateway.tools.parser import ToolCallParser


class ToolCallAccumulator:
    """Calls by index: the first delta of each brings id and name, the others argument text."""

    def __init__(self) -> None:
        self._calls: dict[int, list[str]] = {}

    def add(self, deltas: list[ToolCallDelta]) -> None:
        for d in deltas:
            call = self._calls.setdefault(d.index, ["", "", ""])
            if d.id:
                call[0] = d.id
            if d.name:
                call[1] = d.name
            call[2] += d.arguments

    def calls(self) -> list[ToolCall]:
        return [ToolCall(id=i, name=n, arguments=a) for _, (i, n, a) in sorted(self._calls.items())]

    def __bool__(self) -> bool:
        return bool(self._calls)


async def parsed(events: AsyncIterator[TokenEvent], parser: ToolCallParser) -> AsyncIterator[TokenEvent]:
    """The same events, each with its text split into content (`text`) and `tool_calls`. Every event
    is passed on, emptied or not, so token counts and logprobs stay one per token."""
    try:
        async for event in events:
            content, deltas = parser.feed(event.text)
            if event.finished:
                content += parser.finish()
            yield msgspec.structs.replace(event, text=content, tool_calls=[*event.tool_calls, *deltas])
    finally:
        await close_detached(events)
