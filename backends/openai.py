"""Any OpenAI-compatible server: vLLM, trtllm-serve, SGLang, llama.cpp server.

Chat requests pass through as messages (the upstream applies its own template); prompt requests
(the TGI door, /v1/completions) go to /v1/completions. The upstream is always asked to stream,
so TTFT is real and non-streaming responses are the same stream, aggregated by the gateway.
Tools pass through (the upstream's own parser makes the calls; they come back as tool-call deltas);
output constraints go in the flavor's own fields (backends/constraints.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any, ClassVar, Literal

import msgspec

from backends.base import (
    BackendInfo,
    BackendValidationError,
    ConstraintKind,
    GenerationRequest,
    KvHandoff,
    TokenEvent,
    TokenSpan,
    UpstreamError,
    Usage,
    describe,
    refuse_adapter,
)
from backends.constraints import (
    ALL_KINDS,
    JSON_KINDS,
    generic_fields,
    refuse_unenforceable,
    trtllm_fields,
    vllm_fields,
)
from backends.openai_stream import cached_tokens, chunk_events, decode_chunk, relay_openai_stream, stream_error
from backends.tool_calls import ToolCallRelay, refuse_tools, tool_fields, wire_message
from backends.upstream.http import (
    HttpSettings,
    answers_ok,
    drop_none,
    error_for_status,
    get_json,
    make_client,
    open_stream,
    read_body,
    timed_events,
    trace_headers,
)

log = logging.getLogger("llmgw")
# per flavor: the constraint kinds it has a wire form for, and that form
CONSTRAINT_FORMS = {"vllm": (ALL_KINDS, vllm_fields), "trtllm": (ALL_KINDS, trtllm_fields),
                    "generic": (JSON_KINDS, generic_fields)}
# vLLM's prefill leg (its disaggregated serving proxy's request): compute the prompt's KV and keep it for a
# decode replica to pull; the remote_* fields are filled in by the prefill replica's answer
PREFILL_KV_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                     "remote_block_ids": None, "remote_host": None, "remote_port": None}


class OpenAISettings(HttpSettings, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`type = "openai"`: any OpenAI-compatible server (vLLM, trtllm-serve, SGLang, llama.cpp server)."""

    type: str = "openai"
    """Selects this backend type."""
    model: str
    """The upstream's model name; clients may call it by another."""
    flavor: Literal["vllm", "trtllm", "generic"] = "generic"
    """Which server it is, for what goes beyond OpenAI's fields: the wire form of output constraints
    (backends/constraints.py; "generic": JSON kinds only); "vllm": token ids returned, prefill/decode legs;
    "trtllm": `parallel_tool_calls` sent only when false."""
    max_model_len: int | None = None
    """Context length; default: what the upstream's /v1/models says, if it says."""
    constraint_kinds: list[ConstraintKind] | None = None
    """The constraint kinds to let through; default: every kind the flavor has a wire form for (trtllm-serve
    enforces them only when started with a guided_decoding_backend)."""
    native_tools: bool = True
    """False: the gateway does tool calling over plain messages."""
    lora_adapters: dict[str, str] = {}
    """LoRA adapters the upstream serves: the name clients use -> the upstream's model name for it (vLLM's
    --lora-modules name), so a migration keeps the clients' names."""

    def __post_init__(self) -> None:
        super().__post_init__()
        forms = CONSTRAINT_FORMS[self.flavor][0]
        extra = set(self.constraint_kinds or ()) - forms
        if extra:  # msgspec reports this as a config error at the field's table
            raise ValueError(f"constraint_kinds {sorted(extra)} have no wire form for flavor {self.flavor!r} "
                             f"(it has {sorted(forms)})")

    def kinds(self) -> frozenset[str]:
        forms = CONSTRAINT_FORMS[self.flavor][0]
        return forms if self.constraint_kinds is None else frozenset(self.constraint_kinds)

    def pd_refusal(self) -> str | None:
        if self.flavor == "vllm":
            return None
        return (f"prefill/decode legs (`prefill_endpoints`) are vLLM's kv_transfer_params flow: they need flavor "
                f"\"vllm\", not {self.flavor!r}")


class OpenAIBackend:
    type_name: ClassVar[str] = "openai"
    Settings: ClassVar[type[msgspec.Struct]] = OpenAISettings

    def __init__(self, name: str, settings: OpenAISettings) -> None:
        self.name = name
        self.settings = settings
        self.client = make_client(settings)
        self.max_model_len = settings.max_model_len

    async def start(self) -> None:
        if self.max_model_len is None:
            cards = await get_json(self.client, "/v1/models")  # vLLM reports the context length in its model card
            try:  # None (down now; it may come up later, health says so) or an odd shape: no length then
                for card in cards.get("data", []):
                    if card.get("id") == self.settings.model and card.get("max_model_len"):
                        self.max_model_len = int(card["max_model_len"])
            except (ValueError, AttributeError, TypeError):
                pass

    async def health(self) -> bool:
        return await answers_ok(self.client, "/v1/models", self.settings)

    def info(self) -> BackendInfo:
        return BackendInfo(backend_type=self.type_name, model_id=self.settings.model, max_model_len=self.max_model_len,
                           accepts_chat_messages=True, can_tokenize=False, constraint_kinds=self.settings.kinds(),
                           native_tools=self.settings.native_tools)

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[TokenSpan]:
        raise BackendValidationError(f"backend {self.name!r} ({self.type_name}) cannot tokenize")

    async def aclose(self) -> None:
        await self.client.aclose()

    def adapters(self) -> dict[str, str]:
        """The LoRA adapters it serves, by the clients' name (each maps to an upstream model name)."""
        return dict(self.settings.lora_adapters)

    # requests

    def _sampling(self, r: GenerationRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": refuse_adapter(self.name, self.type_name, r, self.settings.lora_adapters) or self.settings.model,
            "stream": True, "stream_options": {"include_usage": True},
            "temperature": r.temperature, "top_p": r.top_p if r.top_p < 1.0 else None, "seed": r.seed,
            "stop": list(r.stop) or None, "presence_penalty": r.presence_penalty or None,
            "frequency_penalty": r.frequency_penalty or None,
            # vLLM's extras, also understood by trtllm-serve, SGLang and llama.cpp; sent only when used
            "top_k": r.top_k or None, "min_p": r.min_p or None,
            "repetition_penalty": r.repetition_penalty if r.repetition_penalty != 1.0 else None,
            "min_tokens": r.min_tokens or None, "ignore_eos": r.ignore_eos or None,
            "stop_token_ids": list(r.stop_token_ids) or None,
        }
        if self.settings.flavor == "vllm":
            body["return_token_ids"] = True  # so TGI-door details carry real token ids
        if r.constraint is not None:  # the same fields on the chat and the completions route
            body.update(CONSTRAINT_FORMS[self.settings.flavor][1](r.constraint, self.name))
        return body

    def _chat_body(self, r: GenerationRequest) -> dict[str, Any]:
        body = self._sampling(r)
        body["messages"] = [wire_message(m) for m in r.messages or []]
        body.update(tool_fields(r, self.name, send_parallel=self.settings.flavor != "trtllm"))
        body["max_tokens"] = r.max_new_tokens
        if r.logprobs or r.top_logprobs:
            body["logprobs"] = True
            body["top_logprobs"] = r.top_logprobs or None
        return drop_none(body)

    def _completion_body(self, r: GenerationRequest) -> dict[str, Any]:
        body = self._sampling(r)
        body["prompt"] = r.prompt if r.prompt is not None else r.prompt_token_ids
        body["max_tokens"] = r.max_new_tokens
        if r.logprobs or r.top_logprobs:
            body["logprobs"] = r.top_logprobs
        return drop_none(body)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        chat = request.messages is not None
        refuse_unenforceable(self.name, self.type_name, request.constraint, self.settings.kinds())
        if not chat or not self.settings.native_tools:  # /v1/completions takes no tools
            refuse_tools(self.name, self.type_name, request)
        # parallel_tool_calls=false is enforced here too: some trtllm-serve releases accept it and ignore it
        tools = ToolCallRelay(self.name, parallel=request.parallel_tool_calls)
        path, body = ("/v1/chat/completions", self._chat_body(request)) if chat else \
            ("/v1/completions", self._completion_body(request))
        if not request.stream:  # nobody sees tokens before the end: one JSON answer costs less than a stream
            body["stream"] = False
            body.pop("stream_options", None)
        headers = trace_headers(request)
        leg = request.kv_transfer
        if leg is not None:  # vLLM pairs the two legs by one request id
            leg_headers = {**headers, "X-Request-Id": leg.transfer_id}
            if leg.role == "prefill":
                yield await self._prefill_leg(path, body, leg_headers)
                return
            async for event in self._decode_leg(path, body, leg_headers, headers, leg.params, request):
                yield event
            return
        async for event in self._send(path, body, headers, chat, tools):
            yield event

    async def _send(self, path: str, body: dict[str, Any], headers: dict[str, str], chat: bool,
                    tools: ToolCallRelay) -> AsyncIterator[TokenEvent]:
        if not body["stream"]:
            async for event in self._whole(path, body, headers, chat, tools):
                yield event
            return
        started = time.monotonic()
        async with open_stream(self.client, self.name, path, body, headers) as response:
            async for event in relay_openai_stream(timed_events(response, self.settings, self.name, started),
                                                   self.name, chat, tools=tools):
                yield event

    async def _decode_leg(self, path: str, body: dict[str, Any], leg_headers: dict[str, str],
                          headers: dict[str, str], params: Any, request: GenerationRequest
                          ) -> AsyncIterator[TokenEvent]:
        """vLLM's decode leg: the request as it came, with the prefill replica's kv_transfer_params. vLLM answers
        500 when it cannot pull the KV (the prefill replica died or dropped it): then, before any token, this
        replica serves the request whole, as if it had never been split (the first event says so)."""
        chat = request.messages is not None

        def relay() -> ToolCallRelay:
            return ToolCallRelay(self.name, parallel=request.parallel_tool_calls)

        stream = self._send(path, {**body, "kv_transfer_params": params}, leg_headers, chat, relay()).__aiter__()
        try:
            first = await stream.__anext__()
        except StopAsyncIteration:
            return
        except UpstreamError as exc:  # an unreachable or overloaded replica is the pool's to move away from
            if not exc.retriable:
                raise
            log.warning("backend %s: the decode leg of request %s failed before its first token (%s); serving "
                        "it whole", self.name, request.request_id, exc.message)
            took: KvHandoff | None = KvHandoff(imported=False, reason=describe(exc))
            async for event in self._send(path, body, headers, chat, relay()):
                event.kv_handoff, took = took, None  # the first event says the KV did not come over
                yield event
            return
        try:
            yield first
            async for event in stream:
                yield event
        finally:
            await stream.aclose()

    async def _prefill_leg(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> TokenEvent:
        """vLLM's prefill leg: one token, not streamed; its answer's kv_transfer_params (relayed untouched:
        connectors add fields of their own) tell the decode replica where to pull the KV from. The token is
        not the client's: the decode replica samples the first token again."""
        payload = await self._answer(path, prefill_body(body), headers)
        params = payload.get("kv_transfer_params")
        if not isinstance(params, dict) or not params:  # the decode replica will prefill the request itself
            raise UpstreamError(f"{self.name}: the prefill leg's answer has no kv_transfer_params (is vLLM started "
                                "with --kv-transfer-config, kv_role kv_producer or kv_both?)")
        return TokenEvent(token_id=0, text="", token_text="", kv_handoff=KvHandoff(params=params,
                                                                                   token_is_output=False))

    async def _answer(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
        async with open_stream(self.client, self.name, path, body, headers) as response:
            payload = decode_chunk((await read_body(response, self.settings, self.name)).decode(), self.name)
        if payload.get("error") is not None or payload.get("object") == "error":
            raise stream_error(payload, self.name)
        return payload

    async def _whole(self, path: str, body: dict[str, Any], headers: dict[str, str],
                     chat: bool, tools: ToolCallRelay) -> AsyncIterator[TokenEvent]:
        payload = await self._answer(path, body, headers)
        choices = payload.get("choices") or []
        if not choices:
            raise error_for_status(502, "the answer has no choices", self.name)
        choice = dict(choices[0])
        if chat:  # a whole message reads like one big delta
            choice["delta"] = choice.pop("message", None) or {}
        events = chunk_events(choice, chat, tools)
        tools.finish()
        if not events or not events[-1].finished:
            raise error_for_status(502, "the answer has no finish_reason", self.name)
        usage = payload.get("usage") or {}
        events[-1].usage = Usage(int(usage.get("prompt_tokens") or 0),
                                 int(usage.get("completion_tokens") or len(events)), cached_tokens(usage))
        for event in events:
            yield event


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request's body as vLLM's disaggregation proxy rewrites it for the prefill replica: one token, not
    streamed (a minimum of tokens could not be met), asking it to keep the KV for a remote decode."""
    leg = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens", "min_completion_tokens")}
    leg.update(stream=False, max_tokens=1, kv_transfer_params=dict(PREFILL_KV_PARAMS))
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    return leg
