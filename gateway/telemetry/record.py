"""What one HTTP request did, filled in as it goes and read when its response ends (metrics,
access log, trace). It travels in a context variable: the stream tasks a request spawns inherit it."""

from __future__ import annotations

import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestRecord:
    request_id: str
    method: str
    path: str
    started: float = field(default_factory=time.perf_counter)
    route: str = ""  # the route template, e.g. /v1/chat/completions
    model: str = ""
    adapter: str = ""  # the LoRA adapter, when one was asked for
    backend: str = ""
    routed_backend: str = ""  # the backend the weighted choice picked (a fallback tier may have served instead)
    replica: str = ""  # in a pool: the replica that served it...
    balance: str = ""  # ...and why the balancer chose it (prefix_hit, cold, imbalanced, least_load, round_robin)
    handover: Any = None  # prefill/decode: backends/pool/disaggregated.py's Handover (replicas, KV bytes, fallback)
    status: int = 0
    finish_reason: str = ""
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cached_tokens: int = 0  # of the prompt tokens, how many a prefix cache held
    key_name: str | None = None  # the API key's name
    ttft: float | None = None
    queue: float | None = None
    validation: float | None = None  # seconds spent validating (TGI routes)
    error: str = ""
    error_kind: str = ""  # the GatewayError kind that ended it (gateway/errors.py)
    tool_calls_valid: bool | None = None  # an answer with tool calls: each names a declared tool, arguments match
    structured_valid: bool | None = None  # an answer held to a JSON schema: it parses and matches
    prompt_text: str | None = None
    output_text: str = ""
    ended: float | None = None
    span: Any = None  # the request's trace span, when tracing is on


current_record: ContextVar[RequestRecord | None] = ContextVar("current_record", default=None)
