"""A Text Generation Inference server: /generate_stream for prompts, /v1/chat/completions for chat.

TGI refuses `top_p >= 1`, `temperature <= 0` and `top_k <= 0`, so those are left out and greedy
decoding is asked for with `do_sample: false`. Its errors are `{"error", "error_type"}` JSON, or
plain text from its body parser; its stream errors arrive as events inside a 200 response.

Constraints become TGI's grammar (`parameters.grammar` on /generate, `response_format` on chat;
backends/constraints.py).
Tools are not passed on (`native_tools=False`): the gateway does tool calling over plain messages,
as for every backend that does not parse calls itself. TGI's own tool mode (a grammar-forced
`{"function": {"_name": ...}}` object) allows one call only, answers `auto` requests that pick no
tool with a second, tool-less generation, and streams without a finish chunk (README: "Output
constraints and tools on remote backends").
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any, ClassVar

import msgspec

from backends.base import (
    BackendInfo,
    ChatMessage,
    FinishReason,
    GenerationRequest,
    TokenEvent,
    TokenLogprob,
    TokenSpan,
    Usage,
    refuse_adapter,
)
from backends.constraints import TGI_KINDS, refuse_unenforceable, tgi_grammar
from backends.openai_stream import decode_chunk, relay_openai_stream
from backends.tool_calls import refuse_tools
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
from backends.upstream.text import UpstreamText

_VALIDATION_PREFIX = "Input validation error: "


class TgiSettings(HttpSettings, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`type = "tgi"`: a Text Generation Inference server."""

    type: str = "tgi"
    """Selects this backend type."""
    lora_adapters: dict[str, str] = {}
    """LoRA adapters the upstream was started with (LORA_ADAPTERS): the name clients use -> TGI's adapter_id.
    TGI itself runs an unknown adapter_id on the base model, silently; the gateway refuses it instead."""


class TgiBackend:
    type_name: ClassVar[str] = "tgi"
    Settings: ClassVar[type[msgspec.Struct]] = TgiSettings

    def __init__(self, name: str, settings: TgiSettings) -> None:
        self.name = name
        self.settings = settings
        self.client = make_client(settings)
        self.model_id = name
        self.max_total_tokens: int | None = None

    async def start(self) -> None:
        info = await get_json(self.client, "/info")
        if isinstance(info, dict):
            self.model_id = str(info.get("model_id") or self.name)
            self.max_total_tokens = info.get("max_total_tokens")

    async def health(self) -> bool:
        return await answers_ok(self.client, "/health", self.settings)

    def info(self) -> BackendInfo:
        return BackendInfo(backend_type=self.type_name, model_id=self.model_id, max_model_len=self.max_total_tokens,
                           accepts_chat_messages=True, can_tokenize=True, constraint_kinds=TGI_KINDS,
                           native_tools=False)

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[TokenSpan]:
        async with open_stream(self.client, self.name, "/tokenize", {"inputs": text}, {}) as response:
            payload = msgspec.json.decode(await read_body(response, self.settings, self.name))
        return [TokenSpan(id=t["id"], text=t["text"], start=t["start"], stop=t["stop"]) for t in payload]

    async def aclose(self) -> None:
        await self.client.aclose()

    def adapters(self) -> dict[str, str]:
        """The LoRA adapters it serves, by the clients' name (each maps to a TGI adapter_id)."""
        return dict(self.settings.lora_adapters)

    # requests

    def parameters(self, r: GenerationRequest) -> dict[str, Any]:
        sampling = not r.greedy
        return drop_none({
            "do_sample": sampling,
            "temperature": r.temperature if sampling and r.temperature != 1.0 else None,
            "top_k": r.top_k if r.top_k > 0 else None,
            "top_p": r.top_p if 0.0 < r.top_p < 1.0 else None,
            "typical_p": r.typical_p if 0.0 < r.typical_p < 1.0 else None,
            "repetition_penalty": r.repetition_penalty if r.repetition_penalty != 1.0 else None,
            "frequency_penalty": r.frequency_penalty or None,
            "seed": r.seed, "max_new_tokens": r.max_new_tokens, "stop": list(r.stop),
            "details": True, "top_n_tokens": r.top_logprobs or None,
            "decoder_input_details": r.prompt_logprobs or None,
            "grammar": tgi_grammar(r.constraint, self.name) if r.constraint is not None else None,
            "adapter_id": refuse_adapter(self.name, self.type_name, r, self.settings.lora_adapters),
        })

    def _chat_body(self, r: GenerationRequest) -> dict[str, Any]:
        return drop_none({
            "messages": [_message(m) for m in r.messages or []],
            "stream": True, "stream_options": {"include_usage": True}, "max_tokens": r.max_new_tokens,
            "temperature": r.temperature, "top_p": r.top_p if 0.0 < r.top_p < 1.0 else None, "seed": r.seed,
            "stop": list(r.stop) or None, "frequency_penalty": r.frequency_penalty or None,
            "presence_penalty": r.presence_penalty or None,
            "logprobs": True if (r.logprobs or r.top_logprobs) else None, "top_logprobs": r.top_logprobs or None,
            "response_format": tgi_grammar(r.constraint, self.name) if r.constraint is not None else None,
            # TGI's chat takes the adapter as `model` (any value but "tgi")
            "model": refuse_adapter(self.name, self.type_name, r, self.settings.lora_adapters),
        })

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        refuse_unenforceable(self.name, self.type_name, request.constraint, TGI_KINDS)
        refuse_tools(self.name, self.type_name, request)
        started = time.monotonic()
        if request.messages is not None:
            async for event in self._chat(request, started):
                yield event
            return
        body = {"inputs": request.prompt or "", "parameters": self.parameters(request)}
        if request.prompt_logprobs:  # decoder_input_details is refused on TGI's stream route
            async for event in self._generate_once(request, body):
                yield event
            return
        text = UpstreamText(request.stop)
        async with open_stream(self.client, self.name, "/generate_stream", body, trace_headers(request)) as response:
            async for sse in timed_events(response, self.settings, self.name, started):
                payload = decode_chunk(sse.data, self.name)
                if "error" in payload:
                    raise _tgi_error(payload, 424, self.name)
                event = _token_event(payload.get("token") or {}, payload.get("top_tokens"))
                if payload.get("generated_text") is None:
                    event.text = text.push(event.text)
                else:
                    details = payload.get("details") or {}
                    event.text = text.finish(event.text)
                    event.finish_reason = FinishReason(details.get("finish_reason", "length"))
                    event.stop_string = text.stop_string
                    event.seed = details.get("seed")
                    event.usage = Usage(int(details.get("input_length") or 0),
                                        int(details.get("generated_tokens") or payload.get("index") or 0))
                yield event

    async def _generate_once(self, request: GenerationRequest, body: dict[str, Any]) -> AsyncIterator[TokenEvent]:
        async with open_stream(self.client, self.name, "/generate", body, trace_headers(request)) as response:
            payload = msgspec.json.decode(await read_body(response, self.settings, self.name))
        details = payload.get("details") or {}
        tokens = details.get("tokens") or []
        tops = details.get("top_tokens") or []
        prefill = [TokenLogprob(t.get("id", 0), t.get("text", ""), t.get("logprob"))
                   for t in details.get("prefill") or []]
        text = UpstreamText(request.stop)
        for i, token in enumerate(tokens):
            event = _token_event(token, tops[i] if i < len(tops) else None)
            if i == 0:
                event.prompt_tokens = prefill
            if i < len(tokens) - 1:
                event.text = text.push(event.text)
            else:
                event.text = text.finish(event.text)
                event.finish_reason = FinishReason(details.get("finish_reason", "length"))
                event.stop_string = text.stop_string
                event.seed = details.get("seed")
                event.usage = Usage(len(prefill), len(tokens))
            yield event

    async def _chat(self, request: GenerationRequest, started: float) -> AsyncIterator[TokenEvent]:
        async with open_stream(self.client, self.name, "/v1/chat/completions", self._chat_body(request),
                               trace_headers(request)) as response:
            # TGI keeps a matched stop sequence in its chat text too
            async for event in relay_openai_stream(timed_events(response, self.settings, self.name, started),
                                                   self.name, chat=True, text=UpstreamText(request.stop)):
                yield event


def _message(m: ChatMessage) -> dict[str, Any]:
    # null content comes only with tool calls, which refuse_tools keeps away; chat templates need text
    return {"role": m.role, "content": m.content or ""}


def _top(tokens: Any) -> list[TokenLogprob]:
    return [TokenLogprob(t.get("id", 0), t.get("text", ""), t.get("logprob")) for t in tokens or []]


def _tgi_error(payload: dict[str, Any], status: int, backend: str) -> Exception:
    message = str(payload.get("error"))
    kind = payload.get("error_type")
    if kind == "validation":
        return error_for_status(422, message.removeprefix(_VALIDATION_PREFIX), backend)
    if kind == "overloaded":
        return error_for_status(429, message, backend)
    return error_for_status(status, message, backend)


def _token_event(token: dict[str, Any], top_tokens: Any) -> TokenEvent:
    special = bool(token.get("special"))
    return TokenEvent(token_id=token.get("id", 0), text="" if special else token.get("text", ""),
                      token_text=token.get("text", ""), special=special, logprob=token.get("logprob"),
                      top_logprobs=_top(top_tokens))
