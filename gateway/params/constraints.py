"""Output constraints at the doors: the checks both doors share, and what the chosen backend can enforce.

A constraint the route's primary backend cannot enforce is refused before anything is generated (each
door words the refusal its own way); fallback tiers and the shadow that cannot enforce it are left out
of that request's route, so a fallback can never answer it unconstrained.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jsonschema

from backends.base import Backend, OutputConstraint
from gateway.routing.router import ModelRoute


def schema_problem(schema: Any) -> str | None:
    """Why `schema` is not a JSON Schema, or None. Checked against the Draft 2020-12 meta-schema, as TGI
    checks grammars; a schema that passes may still use features a backend's grammar library lacks,
    which that backend then refuses."""
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = exc.json_path
        return exc.message if where == "$" else f"{exc.message} (at {where})"
    return None


def regex_problem(pattern: str) -> str | None:
    """Why `pattern` does not compile, or None. Python's `re` catches what every regex dialect refuses
    (unbalanced groups, bad repeats); the engine's grammar library may still refuse a feature `re` has."""
    try:
        re.compile(pattern)
    except re.error as exc:
        return str(exc)
    return None


def enforces(backend: Backend, kind: str) -> bool:
    return kind in backend.info().constraint_kinds


def describe_backend(route: ModelRoute) -> str:
    info = route.backend.info()
    kinds = ", ".join(sorted(info.constraint_kinds)) or "none"
    return f"backend {route.backend_name!r} ({info.backend_type}) of model {route.name!r} (it enforces: {kinds})"


def route_for(route: ModelRoute, constraint: OutputConstraint | None) -> ModelRoute | None:
    """The route narrowed to the tiers that enforce `constraint`; None when its primary backend cannot."""
    if constraint is None:
        return route
    if not enforces(route.backend, constraint.kind):
        return None
    tiers = [(name, b) for name, b in route.tiers if enforces(b, constraint.kind)]
    shadow = route.shadow if route.shadow is not None and enforces(route.shadow[1], constraint.kind) else None
    if len(tiers) == len(route.tiers) and shadow is route.shadow:
        return route
    return dataclasses.replace(route, tiers=tiers, shadow=shadow)
