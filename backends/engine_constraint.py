"""The core request's OutputConstraint as the engine's StructuredOutputsParams (its grammar library's input)."""

from __future__ import annotations

import importlib.util
from typing import get_args

from backends.base import BackendValidationError, ConstraintKind, OutputConstraint
from engine_core.structured import StructuredOutputsParams

# every kind, when the grammar library is installed (it is a dependency; a stripped install refuses them all)
ENGINE_CONSTRAINT_KINDS: frozenset[str] = (
    frozenset(get_args(ConstraintKind)) if importlib.util.find_spec("xgrammar") is not None else frozenset())


def structured_outputs(constraint: OutputConstraint | None) -> StructuredOutputsParams | None:
    """None for no constraint; BackendValidationError for one the engine cannot enforce, so nothing is
    generated unconstrained by mistake."""
    if constraint is None:
        return None
    kind = constraint.kind
    if kind not in ENGINE_CONSTRAINT_KINDS:
        raise BackendValidationError(f"the engine backend cannot enforce a {kind!r} constraint")
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema" and constraint.json_schema is not None:
        return StructuredOutputsParams(json=constraint.json_schema)
    if kind == "regex" and constraint.regex is not None:
        return StructuredOutputsParams(regex=constraint.regex)
    if kind == "choice" and constraint.choices is not None:
        return StructuredOutputsParams(choice=tuple(constraint.choices))
    if kind == "grammar" and constraint.grammar is not None:
        return StructuredOutputsParams(grammar=constraint.grammar)
    field = "choices" if kind == "choice" else kind
    raise BackendValidationError(f"a {kind} constraint needs its {field!r} field")
