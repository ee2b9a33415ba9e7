"""Whether an answer's tool calls and structured output are valid, noted on the request record: what a
rollout's validity gates compare between backends (gateway/rollout/gates.py). The events pass unchanged."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import jsonschema

from backends.base import OutputConstraint, TokenEvent, ToolCall, ToolFunction
from gateway.closing import close_detached
from gateway.telemetry.record import current_record
from gateway.tools.calls import ToolCallAccumulator


def calls_valid(calls: list[ToolCall], tools: list[ToolFunction]) -> bool:
    """Each call names a declared tool, and its arguments parse as a JSON object its schema accepts."""
    declared = {t.name: t for t in tools}
    for call in calls:
        tool = declared.get(call.name)
        if tool is None:
            return False
        try:
            arguments = json.loads(call.arguments or "{}")
        except ValueError:
            return False
        if not isinstance(arguments, dict) or not _matches(arguments, tool.parameters):
            return False
    return True


def _matches(value: Any, schema: dict[str, Any] | None) -> bool:
    if schema is None:
        return True
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return False
    except jsonschema.SchemaError:  # the client's own schema is broken: nothing to hold the answer to
        return True
    return True


def structured_valid(text: str, constraint: OutputConstraint) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return constraint.kind == "json_object" and isinstance(value, dict) or _matches(value, constraint.json_schema)


async def checked(events: AsyncIterator[TokenEvent], tools: list[ToolFunction],
                  constraint: OutputConstraint | None) -> AsyncIterator[TokenEvent]:
    """The same events; at the finish, the record notes whether the calls (if any were made) and the JSON
    (if a schema held the answer) are valid."""
    rec = current_record.get()
    calls = ToolCallAccumulator()
    text: list[str] = []
    try:
        async for event in events:
            if event.tool_calls:
                calls.add(event.tool_calls)
            text.append(event.text)
            if event.finish_reason is not None and rec is not None:
                if calls:
                    rec.tool_calls_valid = calls_valid(calls.calls(), tools)
                elif constraint is not None and constraint.kind in ("json_schema", "json_object"):
                    rec.structured_valid = structured_valid("".join(text), constraint)
            yield event
    finally:
        await close_detached(events)
