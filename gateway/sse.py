"""Server-sent events framing, shared by both front doors."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from litestar.response import Stream
from litestar.response.streaming import ASGIStreamingResponse
from litestar.types import Receive, Send

from gateway.closing import close_detached, detached

KEEPALIVE = b":\n\n"  # a comment line, as axum's KeepAlive sends
KEEPALIVE_SECONDS = 15.0  # axum's KeepAlive default (TGI)
keepalive_seconds = KEEPALIVE_SECONDS  # this process's: `[server] sse_keepalive`, set when the app is made
DONE = b"data: [DONE]\n\n"

_encoder = msgspec.json.Encoder()


def sse_event(payload: Any) -> bytes:
    """`data: <compact JSON>\\n\\n`, exactly as TGI (axum) and vLLM frame an event."""
    return b"data: " + _encoder.encode(payload) + b"\n\n"


class SSEStream(Stream):
    """`text/event-stream` written from the request's own task (Litestar's Stream runs a task group with the
    iterator in a second task, and a keep-alive wrapper would add a third and a queue: about 0.1 ms on every
    first token). One watcher task per response waits for the client's disconnect, which cancels the
    writing task and so closes the event stream (aborting the engine request or the upstream one), and
    sends a keep-alive comment whenever `keepalive_seconds` pass without a write, as axum's KeepAlive."""

    def __init__(self, events: AsyncIterator[bytes], *, headers: dict[str, str] | None = None,
                 status_code: int = 200) -> None:
        super().__init__(events, media_type="text/event-stream", headers=headers, status_code=status_code)

    def to_asgi_response(self, app: Any, request: Any, **kwargs: Any) -> Any:
        response = super().to_asgi_response(app, request, **kwargs)
        response.__class__ = _SSEBody  # the same response, its body sent by the method below
        return response


class _SSEBody(ASGIStreamingResponse):
    __slots__ = ()

    async def send_body(self, send: Send, receive: Receive) -> None:
        events = self.iterator
        writer = _Writer(send)
        task = asyncio.current_task()
        assert task is not None
        # the watcher ends by itself once the response is complete (see unless_disconnected: not cancelled, so no
        # CancelledError and traceback cycle per stream for the garbage collector)
        detached(_watch(receive, task, writer, keepalive_seconds))
        try:
            async for chunk in events:  # type: ignore[union-attr]
                await writer.write(chunk if isinstance(chunk, bytes) else chunk.encode())
            writer.finished = True  # before the last send: the watcher may run while it is awaited
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if writer.gone and task.uncancel() == 0:
                return  # the client left (the watcher's cancel, nobody else's): nobody to answer
            raise
        finally:
            writer.finished = True
            await close_detached(events)  # type: ignore[arg-type]


class _Writer:
    def __init__(self, send: Send) -> None:
        self.send = send
        self.loop = asyncio.get_running_loop()
        self.last = self.loop.time()  # of the last write
        self.sending = False
        self.gone = False  # the client disconnected
        self.finished = False  # the stream ended (its last write sent, or it failed): the watcher stops

    async def write(self, chunk: bytes) -> None:
        self.sending = True
        try:
            await self.send({"type": "http.response.body", "body": chunk, "more_body": True})
        finally:
            self.sending = False
            self.last = self.loop.time()


async def _watch(receive: Receive, task: asyncio.Task[Any], writer: _Writer, interval: float) -> None:
    """Until the client disconnects (then cancel the writing task): a keep-alive comment after each
    `interval` seconds without a write. The request body has been read: the next message is a disconnect."""
    while not writer.finished:
        try:
            async with asyncio.timeout(max(0.0, writer.last + interval - writer.loop.time())):
                message = await receive()
        except TimeoutError:
            if not writer.finished and not writer.sending and writer.loop.time() - writer.last >= interval:
                await writer.write(KEEPALIVE)
            continue
        if message["type"] == "http.disconnect":
            if not writer.finished:
                writer.gone = True
                task.cancel()
            return
