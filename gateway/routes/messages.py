"""Anthropic's Messages door: `POST /v1/messages` (whole, or streamed as Anthropic's named events) and
`POST /v1/messages/count_tokens`. A turn reaches every backend as one core chat request
(gateway/routes/chat_turn.py), exactly as a Chat Completions request does; errors take Anthropic's
shape `{"type": "error", "error": {"type", "message"}}` (gateway/errors.py)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from litestar import Controller, Request, Response, post
from litestar.response import Stream

from backends.base import TokenEvent, ToolCall
from gateway.closing import close_detached
from gateway.errors import GatewayError
from gateway.generation import Served
from gateway.params.anthropic import (
    asked_format,
    chat_messages,
    check_request,
    check_version,
    sampling,
    tool_request,
    user_key,
)
from gateway.protocol.anthropic import (
    Block,
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    CountTokensRequest,
    DeltaUsage,
    InputJsonDelta,
    Message,
    MessageDelta,
    MessagesRequest,
    MessageStart,
    MessageStop,
    MessageUsage,
    Ping,
    StopDelta,
    StopReason,
    StreamEvent,
    TextBlock,
    TextDelta,
    TokensCount,
    ToolUseBlock,
    event_name,
)
from gateway.routes.chat_turn import (
    count_prompt_tokens,
    generate_turn,
    named_sse,
    plan_turn,
    sse_stream,
    start_turn,
)
from gateway.routing.admission import Admission
from gateway.state import Gateway

_encoder = msgspec.json.Encoder()


def stop_reason(finish: str, made_calls: bool) -> StopReason:
    """vLLM's mapping (entrypoints/anthropic/serving.py): a length cut is `max_tokens` even mid-call."""
    if finish == "length":
        return "max_tokens"
    if made_calls:
        return "tool_use"
    return "stop_sequence" if finish == "stop_sequence" else "end_turn"


def _input(call: ToolCall) -> dict[str, Any]:
    """A call's arguments as the object Anthropic's `input` is."""
    try:
        value = json.loads(call.arguments or "{}")
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise GatewayError(f"the model's call of {call.name!r} has arguments that are not a JSON object: "
                           f"{call.arguments[:200]!r}", kind="upstream")
    return value


def _message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


class MessagesController(Controller):
    path = "/v1/messages"
    tags = ["Anthropic Messages"]

    @post("", summary="Create a message (Anthropic Messages)", operation_id="create_message", status_code=200)
    async def create(self, data: MessagesRequest, gateway: Gateway, request: Request) -> Response | Stream:
        check_version(request.headers.get("anthropic-version"))
        check_request(data)
        turn = await plan_turn(gateway, request, model=data.model, user=user_key(data), messages=chat_messages(data),
                               tools=tool_request(data), asked=asked_format(data),
                               sampling=sampling(data, gateway.config.server),
                               max_tokens=data.max_tokens, max_tokens_param="max_tokens", messages_param="messages")
        model = data.model or turn.route.name
        if data.stream:
            admission, served = await start_turn(gateway, turn)
            return await sse_stream(self._stream(admission, served, model, turn.input_tokens), served, turn.route)
        result = await generate_turn(gateway, request, turn)
        calls = result.tool_calls
        content: list[Block] = []
        if result.text.strip() or (result.text and not calls):
            content.append(TextBlock(text=result.text))
        content += [ToolUseBlock(id=c.id, name=c.name, input=_input(c)) for c in calls]
        last = result.last
        reason = stop_reason(str(last.finish_reason), bool(calls))
        body = Message(id=_message_id(), model=model, content=content, stop_reason=reason,
                       stop_sequence=last.stop_string if reason == "stop_sequence" else None,
                       usage=MessageUsage(input_tokens=result.usage.prompt_tokens,
                                          output_tokens=result.usage.completion_tokens))
        return Response(body, status_code=200, headers=turn.route.served_headers(result.backend))

    @post("/count_tokens", summary="Count a message's input tokens (Anthropic Messages)",
          operation_id="count_message_tokens", status_code=200)
    async def count_tokens(self, data: CountTokensRequest, gateway: Gateway, request: Request) -> TokensCount:
        check_version(request.headers.get("anthropic-version"))
        check_request(data)
        return TokensCount(input_tokens=await count_prompt_tokens(
            gateway, request, model=data.model, messages=chat_messages(data), tools=tool_request(data)))

    @staticmethod
    async def _stream(admission: Admission, served: Served, model: str,
                      input_tokens: int | None) -> AsyncIterator[bytes]:
        """message_start, ping; per content block: start, deltas, stop; message_delta (stop reason,
        usage), message_stop. A failure after the start is an `error` event."""

        def emit(event: StreamEvent) -> bytes:
            return named_sse(event_name(event), _encoder.encode(event))

        blocks = 0  # content blocks started so far
        open_kind: str | None = None  # "text" or "tool_use": the block now open
        made_calls = False

        def close() -> list[bytes]:
            nonlocal open_kind
            if open_kind is None:
                return []
            open_kind = None
            return [emit(ContentBlockStop(index=blocks - 1))]

        def start(block: Block) -> list[bytes]:
            nonlocal blocks, open_kind
            out = [*close(), emit(ContentBlockStart(index=blocks, content_block=block))]
            open_kind = "text" if isinstance(block, TextBlock) else "tool_use"
            blocks += 1
            return out

        def render(e: TokenEvent) -> list[bytes]:
            nonlocal made_calls
            out: list[bytes] = []
            if e.text and (open_kind == "text" or e.text.strip()):
                if open_kind != "text":
                    out += start(TextBlock(text=""))
                out.append(emit(ContentBlockDelta(index=blocks - 1, delta=TextDelta(text=e.text))))
            for d in e.tool_calls:
                if d.id is not None:
                    made_calls = True
                    out += start(ToolUseBlock(id=d.id, name=d.name or "", input={}))
                if d.arguments:
                    delta = InputJsonDelta(partial_json=d.arguments)
                    out.append(emit(ContentBlockDelta(index=blocks - 1, delta=delta)))
            if e.finished:
                out += close()
                reason = stop_reason(str(e.finish_reason), made_calls)
                usage = e.usage
                out += [emit(MessageDelta(
                            delta=StopDelta(stop_reason=reason,
                                            stop_sequence=e.stop_string if reason == "stop_sequence" else None),
                            usage=DeltaUsage(output_tokens=usage.completion_tokens if usage else 0,
                                             input_tokens=usage.prompt_tokens if usage else None))),
                        emit(MessageStop())]
            return out

        try:
            yield b""
            yield emit(MessageStart(message=Message(
                id=_message_id(), model=model, content=[], stop_reason=None, stop_sequence=None,
                usage=MessageUsage(input_tokens=input_tokens or 0, output_tokens=0))))
            yield emit(Ping())
            async for e in served.events:
                for chunk in render(e):
                    yield chunk
        except GatewayError as err:
            yield emit(err.anthropic_body())
        finally:
            admission.release()
            await close_detached(served.events)
