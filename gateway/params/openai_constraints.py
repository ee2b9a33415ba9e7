"""The OpenAI door's output constraints: `response_format`, vLLM's `structured_outputs`, and the
`guided_*` fields vLLM removed in 0.12 (it now ignores them silently; this door honours them).

All of them become one `OutputConstraint`. Asking for two at once is refused with vLLM's message,
never resolved by picking one: the other would be dropped without a word.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from msgspec import UNSET

from backends.base import OutputConstraint
from gateway.errors import GatewayError
from gateway.params.constraints import describe_backend, regex_problem, route_for, schema_problem
from gateway.protocol.openai import (
    JsonObjectFormat,
    JsonSchemaFormat,
    SamplingExtras,
    StructuredOutputs,
    TextFormat,
    TgiJsonFormat,
    TgiRegexFormat,
)
from gateway.routing.router import ModelRoute

_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")  # vLLM's, in its order


@dataclass(frozen=True)
class AskedConstraint:
    constraint: OutputConstraint
    param: str  # the request field that asked for it, for errors about it


def _invalid(message: str, param: str) -> GatewayError:
    return GatewayError(message, kind="validation", param=param)


def json_schema(value: Any, param: str, *, name: str | None = None, strict: bool | None = None) -> OutputConstraint:
    """A schema object, or a JSON text of one (vLLM's `json` and `guided_json` take both)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise _invalid(f"`{param}` is not valid JSON: {exc}", param) from None
    if not isinstance(value, dict):
        raise _invalid(f"`{param}` must be a JSON Schema object", param)
    problem = schema_problem(value)
    if problem is not None:
        raise _invalid(f"`{param}` is not a valid JSON Schema: {problem}", param)
    return OutputConstraint(kind="json_schema", json_schema=value, name=name, strict=strict)


def regex(value: str, param: str) -> OutputConstraint:
    problem = regex_problem(value)
    if problem is not None:
        raise _invalid(f"`{param}` is not a valid regular expression: {problem}", param)
    return OutputConstraint(kind="regex", regex=value)


def choice(value: list[str], param: str) -> OutputConstraint:
    if not value:
        raise _invalid(f"`{param}` must list at least one choice", param)
    return OutputConstraint(kind="choice", choices=list(value))


def grammar(value: str, param: str) -> OutputConstraint:
    if not value.strip():
        raise _invalid(f"`{param}` must not be empty", param)
    return OutputConstraint(kind="grammar", grammar=value)


def _from_response_format(fmt: Any) -> OutputConstraint | None:
    if isinstance(fmt, TextFormat):
        return None
    if isinstance(fmt, JsonObjectFormat):
        if fmt.value is not UNSET:
            return json_schema(fmt.value, "response_format.value")
        return OutputConstraint(kind="json_object")
    if isinstance(fmt, JsonSchemaFormat):
        spec = fmt.json_schema
        if spec is UNSET:
            if fmt.value is UNSET:
                raise _invalid("`response_format.json_schema` must be set", "response_format.json_schema")
            return json_schema(fmt.value.schema, "response_format.value.schema", name=fmt.value.name)
        if spec.schema is None:
            raise _invalid("`response_format.json_schema.schema` must be set: a JSON Schema the output follows",
                           "response_format.json_schema.schema")
        return json_schema(spec.schema, "response_format.json_schema.schema", name=spec.name, strict=spec.strict)
    if isinstance(fmt, TgiJsonFormat):
        return json_schema(fmt.value, "response_format.value")
    assert isinstance(fmt, TgiRegexFormat)
    return regex(fmt.value, "response_format.value")


def _from_structured_outputs(so: StructuredOutputs) -> AskedConstraint:
    given = {k: getattr(so, k) for k in _KINDS if getattr(so, k) is not None}
    if len(given) > 1:
        raise _invalid(f"You can only use one kind of structured outputs constraint but multiple are specified: "
                       f"{given}", "structured_outputs")
    if not given:
        raise _invalid("You must use one kind of structured outputs constraint but none are specified",
                       "structured_outputs")
    for option in ("disable_any_whitespace", "disable_additional_properties"):
        if getattr(so, option):  # they would tighten the constraint: refused rather than not honoured
            raise _invalid(f"`structured_outputs.{option}` is not supported by this gateway",
                           f"structured_outputs.{option}")
    if so.whitespace_pattern is not None:
        raise _invalid("`structured_outputs.whitespace_pattern` is not supported by this gateway",
                       "structured_outputs.whitespace_pattern")
    [(kind, value)] = given.items()
    param = f"structured_outputs.{kind}"
    if kind == "json_object" and value is not True:
        raise _invalid("`structured_outputs.json_object` asks for nothing unless it is true", param)
    if kind == "structural_tag":
        raise _invalid("`structured_outputs.structural_tag` is not supported by this gateway", param)
    build = {"json": json_schema, "regex": regex, "choice": choice, "grammar": grammar,
             "json_object": lambda _, __: OutputConstraint(kind="json_object")}[kind]
    return AskedConstraint(build(value, param), param)


def _guided(req: SamplingExtras) -> list[AskedConstraint]:
    asked = []
    if req.guided_json is not None:
        asked.append(AskedConstraint(json_schema(req.guided_json, "guided_json"), "guided_json"))
    if req.guided_regex is not None:
        asked.append(AskedConstraint(regex(req.guided_regex, "guided_regex"), "guided_regex"))
    if req.guided_choice is not None:
        asked.append(AskedConstraint(choice(req.guided_choice, "guided_choice"), "guided_choice"))
    if req.guided_grammar is not None:
        asked.append(AskedConstraint(grammar(req.guided_grammar, "guided_grammar"), "guided_grammar"))
    return asked


def asked_constraint(req: SamplingExtras) -> AskedConstraint | None:
    """The one constraint a chat or completions request asks for, if any."""
    asked: list[AskedConstraint] = []
    if req.response_format is not None:
        c = _from_response_format(req.response_format)
        if c is not None:
            asked.append(AskedConstraint(c, "response_format"))
    if req.structured_outputs is not None:
        asked.append(_from_structured_outputs(req.structured_outputs))
    asked += _guided(req)
    if len(asked) > 1:
        fields = {a.param: a.constraint.kind for a in asked}
        raise _invalid(f"You can only use one kind of structured outputs constraint but multiple are specified: "
                       f"{fields}", asked[1].param)
    if req.guided_whitespace_pattern is not None:
        raise _invalid("`guided_whitespace_pattern` is not supported by this gateway", "guided_whitespace_pattern")
    return asked[0] if asked else None


def openai_route(route: ModelRoute, asked: AskedConstraint | None) -> ModelRoute:
    """The route narrowed to the backends that enforce the constraint; a 400 when its primary cannot."""
    constraint = asked.constraint if asked is not None else None
    narrowed = route_for(route, constraint)
    if narrowed is None:
        assert asked is not None
        raise _invalid(f"`{asked.param}` asks for a {asked.constraint.kind} constraint, which "
                       f"{describe_backend(route)} cannot enforce", asked.param)
    return narrowed
