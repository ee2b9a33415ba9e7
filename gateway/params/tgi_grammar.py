"""TGI's `parameters.grammar`, checked as TGI's router checks it (router/src/validation.rs), with its
messages word for word, and turned into a core `OutputConstraint`.

- `json` (alias `json_object`): the value is a schema object, or a string that is re-parsed as JSON;
  any other JSON value is "grammar is not supported".
- `json_schema`: `{"name"?, "schema"}`; the schema is not re-parsed from a string.
- Both JSON forms: the Draft 2020-12 meta-schema check, then TGI's requirement of a top-level
  `properties` key (its outlines regex compiler needs one).
- `regex`: passed on unchecked, as TGI does; a backend whose grammar library refuses it refuses the
  request before its first token.
"""

from __future__ import annotations

import json
from typing import Any

from backends.base import OutputConstraint
from gateway.errors import GatewayError
from gateway.params.constraints import describe_backend, route_for, schema_problem
from gateway.protocol.tgi import GrammarType, JsonGrammar, JsonObjectGrammar, JsonSchemaGrammar, RegexGrammar
from gateway.routing.router import ModelRoute


def _invalid(message: str) -> GatewayError:
    return GatewayError(message, kind="validation", param="grammar")


def _checked_schema(schema: Any, name: str | None = None) -> OutputConstraint:
    problem = schema_problem(schema)
    if problem is not None:
        raise _invalid(f"grammar is not valid: {problem}")
    if not isinstance(schema, dict) or "properties" not in schema:
        raise _invalid("grammar is not valid: Grammar must have a 'properties' field")
    return OutputConstraint(kind="json_schema", json_schema=schema, name=name)


def tgi_constraint(grammar: GrammarType) -> OutputConstraint:
    if isinstance(grammar, JsonGrammar | JsonObjectGrammar):
        value = grammar.value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise _invalid(f"grammar is not valid: {exc}") from None
        elif not isinstance(value, dict):
            raise _invalid("grammar is not supported")
        return _checked_schema(value)
    if isinstance(grammar, JsonSchemaGrammar):
        return _checked_schema(grammar.value.schema, grammar.value.name)
    assert isinstance(grammar, RegexGrammar)
    return OutputConstraint(kind="regex", regex=grammar.value)


def tgi_route(route: ModelRoute, constraint: OutputConstraint | None) -> ModelRoute:
    """The route narrowed to backends that enforce the grammar; TGI's own refusal when its primary cannot."""
    narrowed = route_for(route, constraint)
    if narrowed is None:
        assert constraint is not None
        raise _invalid(f"grammar is not supported: a {constraint.kind} grammar cannot be enforced by "
                       f"{describe_backend(route)}")
    return narrowed
