"""The one backend interface and the core types that cross it.

Every front door turns its request into a `GenerationRequest`; every backend turns that into an
async stream of `TokenEvent`s, the last of which carries the finish reason and usage.
Non-streaming responses are the same stream, aggregated.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

import msgspec


class FinishReason(enum.StrEnum):
    LENGTH = "length"
    EOS_TOKEN = "eos_token"
    STOP_SEQUENCE = "stop_sequence"
    TOOL_CALLS = "tool_calls"  # a remote backend that parses tool calls said so (OpenAI's `tool_calls`)


ConstraintKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]


class OutputConstraint(msgspec.Struct, frozen=True, kw_only=True):
    """What the output must match, whichever door asked for it (OpenAI `response_format`, vLLM
    `structured_outputs` / `guided_*`, TGI `grammar`, a forced tool call). Exactly one of the value
    fields is set, the one `kind` names; `json_object` needs none."""

    kind: ConstraintKind
    json_schema: dict[str, Any] | None = None
    regex: str | None = None
    choices: list[str] | None = None
    grammar: str | None = None  # EBNF, in the engine's grammar library's dialect
    name: str | None = None  # OpenAI json_schema.name, passed on where the upstream wants it
    strict: bool | None = None


class ToolFunction(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema object; None means no parameters
    strict: bool | None = None


class ToolChoice(msgspec.Struct, frozen=True, kw_only=True):
    mode: Literal["none", "auto", "required", "function"]
    function: str | None = None  # the forced function's name, when mode is "function"


class ToolCall(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    name: str
    arguments: str  # a JSON text, as OpenAI sends it


class ToolCallDelta(msgspec.Struct, frozen=True, kw_only=True):
    """A piece of a streamed tool call: the first for an index has id and name, the rest argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class ChatMessage(msgspec.Struct, frozen=True, kw_only=True):
    role: str
    content: str | None
    tool_calls: list[ToolCall] = []  # on assistant messages
    tool_call_id: str | None = None  # on tool messages
    name: str | None = None


class KvTransfer(msgspec.Struct, frozen=True, kw_only=True):
    """This request is one leg of a disaggregated request (prefill/decode, backends/pool/disaggregated.py)."""

    role: Literal["prefill", "decode"]
    transfer_id: str  # one id for both legs (vLLM: the X-Request-Id of both)
    params: Any = None  # decode leg: the prefill leg's `KvHandoff.params`, relayed as it came (opaque here)


class KvHandoff(msgspec.Struct, frozen=True, kw_only=True):
    """A prefill leg's last event says what the decode leg needs; a decode leg's first says how it took it."""

    params: Any = None  # prefill leg: for the decode leg (engine: its KV handle; vLLM: kv_transfer_params)
    token_is_output: bool = True  # prefill leg: its event's token is the client's first (False: vLLM's is not)
    imported: bool | None = None  # decode leg: it took the KV (False: it prefilled locally, `reason` says why)
    reason: str | None = None
    num_bytes: int = 0  # the KV handed over
    seconds: float = 0.0  # to write it (prefill leg) or to read it in (decode leg)


class GenerationRequest(msgspec.Struct, kw_only=True):
    request_id: str
    model: str  # the model name the client used (after alias resolution)
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None  # set when the gateway already tokenized the prompt
    messages: list[ChatMessage] | None = None  # only for backends that take chat natively
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    max_new_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: bool = False
    deadline: float | None = None  # time.monotonic() after which the request times out
    traceparent: str | None = None  # W3C trace context, forwarded to remote backends
    stream: bool = True  # whether the client streams; a remote backend may then skip upstream streaming
    constraint: OutputConstraint | None = None  # enforced by the backend, or refused before generation
    tools: list[ToolFunction] = []  # only for backends that take chat natively; else rendered by the gateway
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    adapter: str | None = None  # a LoRA adapter by the name clients use (TGI adapter_id, OpenAI model); None: base
    speculative: bool = True  # False: the engine drafts nothing for this request (where it speculates)
    kv_transfer: KvTransfer | None = None  # a leg of a prefill/decode disaggregated request; None: the whole

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


class TokenLogprob(msgspec.Struct, frozen=True):
    token_id: int
    text: str
    logprob: float | None


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # of the prompt tokens, how many came from a prefix cache (when the backend says)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class TokenEvent(msgspec.Struct, kw_only=True):
    token_id: int
    text: str  # output text released with this token; never part of a stop string
    token_text: str  # the token's own text (TGI's `token.text`)
    special: bool = False
    logprob: float | None = None
    top_logprobs: list[TokenLogprob] = []
    finish_reason: FinishReason | None = None
    stop_string: str | None = None
    usage: Usage | None = None  # on the last event
    seed: int | None = None
    prompt_tokens: list[TokenLogprob] | None = None  # on the first event, when prompt_logprobs was asked
    queue_seconds: float | None = None  # on the first event, where the backend knows it
    tool_calls: list[ToolCallDelta] = []  # from a backend that parses tool calls itself (a remote OpenAI server)
    kv_handoff: KvHandoff | None = None  # a disaggregated request's leg: its handover (see KvHandoff)

    @property
    def handed_over(self) -> bool:
        """A prefill leg's last event: the request goes on on a decode replica."""
        return self.kv_handoff is not None and self.kv_handoff.params is not None

    @property
    def finished(self) -> bool:
        """The last event of this stream: the request finished, or (a prefill leg) was handed over."""
        return self.finish_reason is not None or self.handed_over

    def usage_or_count(self, events: int) -> Usage:
        """A final event's usage: the backend's own count (an upstream event may carry several tokens), or from
        a backend that reports none, one token for each of the `events` its stream sent."""
        return self.usage or Usage(0, events)


class TokenSpan(msgspec.Struct, frozen=True):
    id: int
    text: str
    start: int  # byte offsets into the input
    stop: int


class BackendInfo(msgspec.Struct, frozen=True, kw_only=True):
    backend_type: str
    model_id: str
    max_model_len: int | None = None
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    accepts_chat_messages: bool = False  # True: send messages; False: the gateway renders the template
    can_tokenize: bool = True
    constraint_kinds: frozenset[str] = frozenset()  # the OutputConstraint kinds it enforces; others are refused
    native_tools: bool = False  # takes `tools` itself and answers with tool_calls; else the gateway handles them


# typed errors; each front door maps them to its own wire shape and status code


class BackendError(Exception):
    kind: ClassVar[str] = "upstream"

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status  # the upstream's HTTP status, where there was one

    @property
    def retriable(self) -> bool:
        """Worth trying another backend: it could not answer, not "the request is wrong"."""
        return self.kind in ("unavailable", "overloaded", "timeout") or \
            (self.kind == "upstream" and (self.status is None or self.status >= 500))


class BackendValidationError(BackendError):
    kind = "validation"


class BackendOverloadedError(BackendError):
    kind = "overloaded"


class BackendUnavailableError(BackendError):
    kind = "unavailable"


class BackendTimeoutError(BackendError):
    kind = "timeout"


class UpstreamError(BackendError):
    kind = "upstream"


class AdapterInUseError(BackendValidationError):
    """A LoRA adapter cannot be unloaded while requests in flight use it (the admin routes answer 409)."""


@runtime_checkable
class Backend(Protocol):
    """What every backend provides. `Settings` is the msgspec Struct of its config table."""

    type_name: ClassVar[str]
    Settings: ClassVar[type[msgspec.Struct]]
    name: str

    async def start(self) -> None:
        """Connect or load; may take long. `health()` is False until it has finished."""

    def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """Stream the request's tokens; the last event has `finish_reason` and `usage` set."""
        ...

    async def tokenize(self, text: str) -> list[TokenSpan]: ...

    async def health(self) -> bool: ...

    def info(self) -> BackendInfo: ...

    async def aclose(self) -> None: ...


def refuse_adapter(name: str, type_name: str, request: GenerationRequest, adapters: dict[str, str]) -> str | None:
    """The upstream's name for the request's adapter; a backend that does not serve it refuses (a 422: the
    gateway routes adapters only to backends that list them, so this is a misrouted or stale request)."""
    if request.adapter is None:
        return None
    upstream = adapters.get(request.adapter)
    if upstream is None:
        raise BackendValidationError(f"backend {name!r} ({type_name}) has no LoRA adapter {request.adapter!r}"
                                     + (f" (it has: {sorted(adapters)})" if adapters else ""))
    return upstream


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__



