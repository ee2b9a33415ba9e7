"""Triton Inference Server's generate extension, for TensorRT-LLM models.

Two input-name dialects, chosen in config: `ensemble` (the ensemble / tensorrt_llm_bls models:
`text_input`, `max_tokens`, `stop_words`, ...) and `llmapi` (the LLM-API model:
`sampling_param_*`, `streaming`, `return_finish_reason`). Triton refuses null values, streams
`text_output` deltas with no `[DONE]`, may put an error inside a 200 stream, and (ensemble) reports
no finish reason: `length` is inferred when the output reached `max_tokens`.

It cannot constrain output here (no constraint kinds: the gateway refuses them before generation,
and so does `generate`), and it takes no tools: the gateway renders them into the prompt.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any, ClassVar, Literal

import msgspec

from backends.base import (
    BackendInfo,
    BackendValidationError,
    FinishReason,
    GenerationRequest,
    TokenEvent,
    TokenSpan,
    Usage,
)
from backends.constraints import refuse_unenforceable
from backends.openai_stream import decode_chunk
from backends.tool_calls import refuse_tools
from backends.upstream.http import (
    HttpSettings,
    answers_ok,
    drop_none,
    error_for_status,
    make_client,
    open_stream,
    timed_events,
    trace_headers,
)
from backends.upstream.text import UpstreamText


class TritonSettings(HttpSettings, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`type = "triton"`: Triton Inference Server's generate extension, for TensorRT-LLM models."""

    type: str = "triton"
    """Selects this backend type."""
    model: str = "ensemble"
    """The Triton model name."""
    dialect: Literal["ensemble", "llmapi"] = "ensemble"
    """The model's input names: "ensemble" (the ensemble / tensorrt_llm_bls models: `text_input`, `max_tokens`,
    `stop_words`, ...) or "llmapi" (the LLM-API model: `sampling_param_*`, `streaming`)."""
    model_version: str | None = None
    """A version of the Triton model (`/v2/models/<model>/versions/<version>`); None: Triton's choice."""
    max_model_len: int | None = None
    """Context length; None: unknown (the model's max_total_tokens, else 4096, bounds requests)."""
    chat_template: str | None = None
    """Triton applies none; the gateway renders this one for chat."""
    end_id: int | None = None
    """The end-of-sequence token id sent as `end_id` (ensemble dialect); None: the model's own."""
    pad_id: int | None = None
    """The padding token id sent as `pad_id` (ensemble dialect); None: the model's own."""


class TritonBackend:
    type_name: ClassVar[str] = "triton"
    Settings: ClassVar[type[msgspec.Struct]] = TritonSettings

    def __init__(self, name: str, settings: TritonSettings) -> None:
        self.name = name
        self.settings = settings
        self.client = make_client(settings)
        version = f"/versions/{settings.model_version}" if settings.model_version else ""
        self.model_path = f"/v2/models/{settings.model}{version}"

    async def start(self) -> None:
        return None

    async def health(self) -> bool:
        return await answers_ok(self.client, f"{self.model_path}/ready", self.settings)

    def info(self) -> BackendInfo:
        return BackendInfo(backend_type=self.type_name, model_id=self.settings.model,
                           max_model_len=self.settings.max_model_len, chat_template=self.settings.chat_template,
                           accepts_chat_messages=False, can_tokenize=False, constraint_kinds=frozenset(),
                           native_tools=False)

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[TokenSpan]:
        raise BackendValidationError(f"backend {self.name!r} (triton) cannot tokenize")

    async def aclose(self) -> None:
        await self.client.aclose()

    def body(self, r: GenerationRequest) -> dict[str, Any]:
        greedy = r.greedy
        if self.settings.dialect == "llmapi":
            return drop_none({
                "text_input": r.prompt or "", "streaming": True, "sampling_param_max_tokens": r.max_new_tokens,
                "sampling_param_temperature": None if greedy else r.temperature,
                "sampling_param_top_k": 1 if greedy else (r.top_k or None),
                "sampling_param_top_p": r.top_p if r.top_p < 1.0 else None,
                "sampling_param_frequency_penalty": r.frequency_penalty or None,
                "sampling_param_presence_penalty": r.presence_penalty or None,
                "sampling_param_stop": list(r.stop) or None, "sampling_param_seed": r.seed,
                "sampling_param_exclude_input_from_output": True,
                "return_finish_reason": True, "return_stop_reason": True,
            })
        return drop_none({
            "text_input": r.prompt or "", "max_tokens": r.max_new_tokens, "stream": True,
            "exclude_input_in_output": True, "temperature": None if greedy else r.temperature,
            "top_k": 1 if greedy else (r.top_k or None), "top_p": r.top_p if r.top_p < 1.0 else None,
            "repetition_penalty": r.repetition_penalty if r.repetition_penalty != 1.0 else None,
            "presence_penalty": r.presence_penalty or None, "frequency_penalty": r.frequency_penalty or None,
            "min_tokens": r.min_tokens or None, "seed": r.seed, "stop_words": list(r.stop) or None,
            "end_id": self.settings.end_id, "pad_id": self.settings.pad_id,
            "return_num_input_tokens": True, "return_num_output_tokens": True,
        })

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        refuse_unenforceable(self.name, self.type_name, request.constraint, frozenset())
        refuse_tools(self.name, self.type_name, request)
        if request.adapter is not None:  # Triton's generate extension has no per-request adapter field
            raise BackendValidationError(f"backend {self.name!r} (triton) cannot serve LoRA adapter "
                                         f"{request.adapter!r}: serve the adapter through an openai backend "
                                         "(trtllm-serve) or the engine")
        if request.prompt is None:
            raise BackendValidationError("the triton backend takes a prompt; chat is rendered by the gateway")
        started = time.monotonic()
        text = UpstreamText(request.stop)
        held: tuple[TokenEvent, dict[str, Any]] | None = None  # the finish is known only when the stream ends
        count = 0
        async with open_stream(self.client, self.name, f"{self.model_path}/generate_stream", self.body(request),
                               trace_headers(request)) as response:
            async for sse in timed_events(response, self.settings, self.name, started):
                payload = decode_chunk(sse.data, self.name)
                if "error" in payload:  # an error inside a 200 stream
                    raise error_for_status(500, str(payload["error"]), self.name)
                if held is not None:
                    event, previous = held
                    event.text = text.push(event.text)
                    if text.stop_string is not None:  # our stop string matched: end here
                        yield self._finished(event, previous, request, text, count)
                        return
                    yield event
                count += 1
                output = _scalar(payload.get("text_output")) or ""
                held = (TokenEvent(token_id=0, text=output, token_text=output), payload)
        if held is None:
            raise error_for_status(502, "the stream ended without any output", self.name)
        event, payload = held
        event.text = text.finish(event.text)
        yield self._finished(event, payload, request, text, count)

    def _finished(self, event: TokenEvent, payload: dict[str, Any], request: GenerationRequest, text: UpstreamText,
                  count: int) -> TokenEvent:
        event.stop_string = text.stop_string
        event.finish_reason = self._finish(payload, request, text.stop_string)
        prompt_tokens = _scalar(payload.get("num_input_tokens"))
        output_tokens = _scalar(payload.get("num_output_tokens"))
        event.usage = Usage(int(prompt_tokens or 0), int(output_tokens or count))
        return event

    def _finish(self, payload: dict[str, Any], request: GenerationRequest, stop_string: str | None) -> FinishReason:
        if stop_string is not None:
            return FinishReason.STOP_SEQUENCE
        reason = _scalar(payload.get("finish_reason"))
        if reason == "length":
            return FinishReason.LENGTH
        if reason == "stop":
            return FinishReason.STOP_SEQUENCE if _scalar(payload.get("stop_reason")) else FinishReason.EOS_TOKEN
        produced = _scalar(payload.get("num_output_tokens"))
        # inferred, not documented: the ensemble reports no reason, so a full budget means `length`
        if produced is not None and int(produced) >= request.max_new_tokens:
            return FinishReason.LENGTH
        return FinishReason.EOS_TOKEN


def _scalar(value: Any) -> Any:
    """Triton unwraps one-element tensors, but not always: take the first element of a list."""
    while isinstance(value, list):
        value = value[0] if value else None
    return value
