"""Server-sent events framing, shared by both front doors."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from gateway.closing import close_detached

KEEPALIVE = b":\n\n"  # a comment line, as axum's KeepAlive sends
DONE = b"data: [DONE]\n\n"

_encoder = msgspec.json.Encoder()


def sse_event(payload: Any) -> bytes:
    """`data: <compact JSON>\\n\\n`, exactly as TGI (axum) and vLLM frame an event."""
    return b"data: " + _encoder.encode(payload) + b"\n\n"


async def with_keepalive(events: AsyncIterator[bytes], interval: float = 15.0) -> AsyncIterator[bytes]:
    """Pass events through; send a keep-alive comment whenever `interval` seconds pass without one. Events
    that are ready together are written together (never held back for company).

    One producer task per stream feeds a queue; waiting on the queue can time out without
    disturbing the producer (cancelling a pending `__anext__` would close the stream).
    """
    queue: asyncio.Queue[tuple[bytes | None, BaseException | None]] = asyncio.Queue(maxsize=64)

    async def produce() -> None:
        try:
            async for item in events:
                await queue.put((item, None))
            await queue.put((None, None))
        except Exception as exc:
            await queue.put((None, exc))
        finally:  # cancelled (the client left): `events` must still run its cleanup
            await close_detached(events)

    producer = asyncio.create_task(produce())
    try:
        while True:
            try:
                item, error = queue.get_nowait()  # the producer is ahead: no timer to arm
            except asyncio.QueueEmpty:
                try:
                    async with asyncio.timeout(interval):
                        item, error = await queue.get()
                except TimeoutError:
                    yield KEEPALIVE
                    continue
            if error is not None:
                raise error
            if item is None:
                return
            # what else is queued already goes in the same write: one send to the client, not one per event
            batch, end = [item], None
            while not queue.empty():
                more = queue.get_nowait()
                if more[0] is None:
                    end = more
                    break
                batch.append(more[0])
            yield batch[0] if len(batch) == 1 else b"".join(batch)
            if end is not None:
                if end[1] is not None:
                    raise end[1]
                return
    finally:
        producer.cancel()
        with contextlib.suppress(BaseException):
            await producer
