"""Errors raised by route logic, and their TGI, OpenAI and Anthropic wire forms."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from backends.base import BackendError
from gateway.protocol.anthropic import ErrorDetail
from gateway.protocol.anthropic import ErrorResponse as AnthropicErrorResponse
from gateway.protocol.openai import OpenAIError, OpenAIErrorResponse
from gateway.protocol.tgi import ErrorResponse

# kind → (HTTP status, TGI error_type, OpenAI type)
_KINDS: dict[str, tuple[int, str, str]] = {
    "validation": (422, "validation", "invalid_request_error"),
    "template": (422, "template_error", "invalid_request_error"),
    "config": (400, "config", "invalid_request_error"),
    "model_not_found": (404, "model_not_found", "invalid_request_error"),
    "unauthorized": (401, "unauthorized", "authentication_error"),
    "forbidden": (403, "forbidden", "permission_error"),
    "overloaded": (429, "overloaded", "rate_limit_error"),
    "rate_limited": (429, "rate_limited", "rate_limit_error"),
    "unavailable": (503, "unavailable", "service_unavailable_error"),
    "healthcheck": (503, "healthcheck", "service_unavailable_error"),
    "timeout": (504, "timeout", "timeout_error"),
    "request_timeout": (408, "request_timeout", "invalid_request_error"),
    "payload_too_large": (413, "payload_too_large", "invalid_request_error"),
    "upstream": (424, "generation", "server_error"),
    "internal": (500, "internal", "server_error"),
}

# Anthropic's error types by status (docs.anthropic.com/en/api/errors); kinds whose status Anthropic lacks
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                    504: "timeout_error", 529: "overloaded_error"}
_ANTHROPIC_STATUS = {"overloaded": 529, "unavailable": 529, "healthcheck": 529, "upstream": 500,
                     "request_timeout": 400}
ANTHROPIC_PATHS = ("/v1/messages",)


def is_anthropic_path(path: str) -> bool:
    return path.startswith(ANTHROPIC_PATHS)


@dataclass
class GatewayError(Exception):
    message: str
    kind: str = "validation"
    param: str | None = None  # the request field at fault (OpenAI's `param`)
    code: str | None = None  # OpenAI's `code`
    status: int | None = None  # overrides the kind's status
    headers: dict[str, str] | None = None  # e.g. retry-after

    def __str__(self) -> str:
        return self.message

    @classmethod
    def from_backend(cls, exc: BackendError) -> GatewayError:
        return cls(exc.message, kind=exc.kind if exc.kind in _KINDS else "upstream")

    def tgi_status(self) -> int:
        return self.status or _KINDS[self.kind][0]

    def tgi_body(self) -> ErrorResponse:
        _, error_type, _ = _KINDS[self.kind]
        text = {
            "validation": f"Input validation error: {self.message}",
            "template": f"Template error: {self.message}",
            "overloaded": "Model is overloaded",
            "upstream": f"Request failed during generation: {self.message}",
        }.get(self.kind, self.message)
        return ErrorResponse(error=text, error_type=error_type)

    def openai_status(self) -> int:
        if self.status:
            return self.status
        status = _KINDS[self.kind][0]
        return 400 if status == 422 else 502 if self.kind == "upstream" else status

    def response_args(self, openai: bool) -> dict[str, Any]:
        """Body, status and headers for a response in either protocol's shape."""
        if openai:
            return {"content": self.openai_body(), "status_code": self.openai_status(), "headers": self.headers}
        return {"content": self.tgi_body(), "status_code": self.tgi_status(), "headers": self.headers}

    def anthropic_status(self) -> int:
        status = self.status or _ANTHROPIC_STATUS.get(self.kind) or _KINDS[self.kind][0]
        return 400 if status == 422 else status

    def anthropic_body(self) -> AnthropicErrorResponse:
        status = self.anthropic_status()
        kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
        return AnthropicErrorResponse(error=ErrorDetail(type=kind, message=self.message))

    def response_args_for(self, path: str) -> dict[str, Any]:
        """Body, status and headers in the shape of the door `path` belongs to."""
        if is_anthropic_path(path):
            return {"content": self.anthropic_body(), "status_code": self.anthropic_status(), "headers": self.headers}
        return self.response_args(path.startswith("/v1/"))

    def openai_body(self) -> OpenAIErrorResponse:
        code = self.code or (self.kind if self.kind not in ("validation", "template") else None)
        return OpenAIErrorResponse(OpenAIError(message=self.message, type=_KINDS[self.kind][2], param=self.param,
                                               code=code))
