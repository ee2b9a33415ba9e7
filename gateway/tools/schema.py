"""The JSON schema that forces `required` and named tool choices: a list of calls in the prompt's own
format, `[{"name": ..., "arguments": {...}}]`, each call's `arguments` held to its tool's
`parameters`. Like vLLM's (tool_parsers/utils.py), with `arguments` for vLLM's `parameters` (the
key SmolLM2 was trained on), and with the tools' `$defs` moved to the root, where `#/$defs/...`
references resolve."""

from __future__ import annotations

import copy
from typing import Any

from backends.base import OutputConstraint, ToolFunction
from gateway.errors import GatewayError

NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def _call_schema(tool: ToolFunction, defs: dict[str, Any]) -> dict[str, Any]:
    params = copy.deepcopy(tool.parameters) if tool.parameters is not None else dict(NO_PARAMETERS)
    for name, schema in (params.pop("$defs", None) or {}).items():
        if name in defs and defs[name] != schema:
            raise GatewayError(f"Tool definition '{name}' has multiple schemas, which is not supported.",
                               kind="validation", param="tools")
        defs[name] = schema
    return {"type": "object", "properties": {"name": {"type": "string", "enum": [tool.name]}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def forced_calls_schema(tools: list[ToolFunction], parallel: bool) -> dict[str, Any]:
    """`tools` are those the answer may call: all of them for `required`, the one named otherwise."""
    defs: dict[str, Any] = {}
    calls = [_call_schema(t, defs) for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else
                              {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def forced_calls_constraint(tools: list[ToolFunction], parallel: bool) -> OutputConstraint:
    return OutputConstraint(kind="json_schema", json_schema=forced_calls_schema(tools, parallel), name="tool_calls",
                            strict=True)
