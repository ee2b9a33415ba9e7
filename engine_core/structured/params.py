"""What a request's output must match: vLLM's `StructuredOutputsParams`, one kind per request."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    json: dict[str, Any] | str | None = None  # a JSON Schema, as a dict or its JSON text
    json_object: bool = False  # any JSON object
    regex: str | None = None  # the whole output must match it
    choice: tuple[str, ...] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # EBNF in xgrammar's dialect (GBNF-like: `root ::= ...`)

    @property
    def kind(self) -> str:
        kinds = self._set_kinds()
        return kinds[0] if kinds else ""

    def _set_kinds(self) -> list[str]:
        return [k for k in KINDS if (self.json_object if k == "json_object" else getattr(self, k) is not None)]

    def validate(self) -> None:
        kinds = self._set_kinds()
        if not kinds:  # vLLM's wording
            raise ValueError("You must use one kind of structured outputs constraint but none are specified")
        if len(kinds) > 1:
            raise ValueError(f"You can only use one kind of structured outputs constraint but got {kinds}")
        if self.choice is not None:
            if not self.choice:
                raise ValueError("a choice constraint needs at least one string")
            if any(not isinstance(c, str) for c in self.choice):
                raise ValueError("every choice must be a string")
        if self.json is not None and not isinstance(self.json, dict | str):
            raise ValueError("a JSON schema must be an object or its JSON text")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string")

    def cache_key(self) -> tuple[str, str]:
        """Equal constraints share one compiled grammar. Keys are not sorted: xgrammar emits a schema's
        properties in their declared order, so two orders are two grammars."""
        kind = self.kind
        if kind == "json":
            text = self.json if isinstance(self.json, str) else json.dumps(self.json, separators=(",", ":"))
            return kind, text
        if kind == "choice":
            return kind, json.dumps(list(self.choice or ()))
        if kind == "json_object":
            return kind, ""
        return kind, str(getattr(self, kind))
