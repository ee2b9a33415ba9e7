"""Server-sent events framing, shared by both front doors."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import msgspec

KEEPALIVE = b":\n\n"  # a comment line, as axum's KeepAlive sends
DONE = b"data: [DONE]\n\n"

_encoder = msgspec.json.Encoder()


def sse_event(payload: Any) -> bytes:
    """`data: <compact JSON>\\n\\n`, exactly as TGI (axum) and vLLM frame an event."""
    return b"data: " + _encoder.encode(payload) + b"\n\n"


async def with_keepalive(events: AsyncIterator[bytes], interval: float = 15.0) -> AsyncIterator[bytes]:
    """Pass events through; send a keep-alive comment whenever `interval` seconds pass without one."""
    iterator = events.__aiter__()
    pending: asyncio.Task[bytes] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(iterator.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield KEEPALIVE
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            finally:
                pending = None
            yield item
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
        aclose = getattr(iterator, "aclose", None)
        if aclose is not None:
            await aclose()
