"""Each remote upstream's wire form of an `OutputConstraint`, and the refusal of those it cannot enforce.

Nothing is dropped silently: a backend refuses (before any upstream call) every constraint kind it
has no wire form for. vLLM >= 0.12 ignores the old `guided_*` fields without an error, so they are
never sent; its `structured_outputs` and `response_format` are.
"""

from __future__ import annotations

import json
from typing import Any

from backends.base import BackendValidationError, OutputConstraint

ALL_KINDS = frozenset({"json_schema", "json_object", "regex", "choice", "grammar"})
JSON_KINDS = frozenset({"json_schema", "json_object"})
TGI_KINDS = frozenset({"json_schema", "regex", "choice"})  # TGI has no EBNF and no schema-free JSON mode

_REGEX_SPECIAL = frozenset("\\.^$*+?{}[]|()")


def refuse_unenforceable(backend: str, type_name: str, constraint: OutputConstraint | None,
                         kinds: frozenset[str]) -> None:
    if constraint is not None and constraint.kind not in kinds:
        can = ", ".join(sorted(kinds)) or "no constraint kinds"
        raise BackendValidationError(f"backend {backend!r} ({type_name}) cannot enforce a {constraint.kind!r} "
                                     f"output constraint; it enforces {can}")


def escape_regex(text: str) -> str:
    """Only the metacharacters: `re.escape` also escapes spaces and `#`, which not every regex
    engine upstream (interegular in TGI, xgrammar, llguidance) reads as plain characters."""
    return "".join("\\" + c if c in _REGEX_SPECIAL else c for c in text)


def choice_regex(choices: list[str]) -> str:
    return "(?:" + "|".join(escape_regex(c) for c in choices) + ")"


def _value(c: OutputConstraint, backend: str) -> Any:
    value = {"json_schema": c.json_schema, "regex": c.regex, "choice": c.choices, "grammar": c.grammar,
             "json_object": True}[c.kind]
    if not value:
        raise BackendValidationError(f"backend {backend!r}: a {c.kind!r} constraint without its value")
    return value


def openai_response_format(c: OutputConstraint, backend: str) -> dict[str, Any]:
    """OpenAI's own `response_format`, for the two JSON kinds."""
    if c.kind == "json_object":
        return {"type": "json_object"}
    spec: dict[str, Any] = {"name": c.name or "output", "schema": _value(c, backend)}  # `name` is required
    if c.strict is not None:
        spec["strict"] = c.strict
    return {"type": "json_schema", "json_schema": spec}


def vllm_fields(c: OutputConstraint, backend: str) -> dict[str, Any]:
    """vLLM: `response_format` for JSON, `structured_outputs` for the rest (chat and completions alike)."""
    if c.kind in JSON_KINDS:
        return {"response_format": openai_response_format(c, backend)}
    key = {"regex": "regex", "choice": "choice", "grammar": "grammar"}[c.kind]  # `choice`, not the docs' `choices`
    return {"structured_outputs": {key: _value(c, backend)}}


def trtllm_fields(c: OutputConstraint, backend: str) -> dict[str, Any]:
    """trtllm-serve's own `response_format` types. JSON schemas go as its `json` type: older
    releases took the whole `json_schema` wrapper (name and all) for the schema."""
    value = _value(c, backend)
    form = {"json_schema": lambda: {"type": "json", "schema": value},
            "json_object": lambda: {"type": "json_object"},
            "regex": lambda: {"type": "regex", "regex": value},
            "choice": lambda: {"type": "regex", "regex": choice_regex(value)},
            "grammar": lambda: {"type": "ebnf", "ebnf": value}}[c.kind]()
    return {"response_format": form}


def generic_fields(c: OutputConstraint, backend: str) -> dict[str, Any]:
    """Any other OpenAI-compatible server: only what OpenAI itself defines."""
    return {"response_format": openai_response_format(c, backend)}


def tgi_grammar(c: OutputConstraint, backend: str) -> dict[str, Any]:
    """TGI's `{"type", "value"}` grammar (`parameters.grammar` on /generate, `response_format` on chat)."""
    value = _value(c, backend)
    if c.kind == "json_schema":
        if isinstance(value.get("properties"), dict):
            return {"type": "json", "value": value}
        return {"type": "regex", "value": _schema_regex(value, backend)}
    return {"type": "regex", "value": choice_regex(value) if c.kind == "choice" else value}


def _schema_regex(schema: dict[str, Any], backend: str) -> str:
    """TGI's router turns every JSON schema into a regex with outlines-core, but first answers 422 to
    one without a top-level `properties` (an array, an `anyOf`, the gateway's list of forced tool
    calls). The same compiler here makes the regex TGI would have made; TGI takes regexes as they are."""
    try:
        from outlines_core.json_schema import build_regex_from_schema
    except ImportError:
        raise BackendValidationError(f"backend {backend!r} (tgi): TGI enforces only JSON schemas with a top-level "
                                     f"`properties` object, and outlines-core, which compiles others for it, is "
                                     f"not installed") from None
    try:
        return build_regex_from_schema(json.dumps(schema))
    except ValueError as exc:
        raise BackendValidationError(f"backend {backend!r} (tgi): this JSON schema cannot be compiled to the "
                                     f"regex TGI needs: {exc}") from None
