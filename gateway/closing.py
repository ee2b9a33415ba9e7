"""Closing a token stream so that it really ends, even from a task that is being cancelled.

Closing the stream aborts the engine request or closes the upstream connection. When a client goes
away, the response task is cancelled under anyio's level-triggered cancellation: every await in it
fails at once, so an `await stream.aclose()` there stops at its first await and the backend stream
would only be finished later by the garbage collector. The close runs in a task of its own instead.

`detached` starts a task nobody awaits or cancels (a client watcher that ends once the response is complete),
held here until it ends: the event loop keeps only a weak reference to a task.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine
from typing import Any

_running: set[asyncio.Task[Any]] = set()


async def close_detached(stream: AsyncIterator[Any]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is None or getattr(stream, "ag_frame", True) is None:
        return  # nothing to close, or an async generator that has run to its end: no task for it
    closing = asyncio.ensure_future(aclose())
    with contextlib.suppress(BaseException):  # our caller being cancelled must not stop the close
        await asyncio.shield(closing)


def detached(coro: Coroutine[Any, Any, None]) -> None:
    task = asyncio.ensure_future(coro)
    _running.add(task)
    task.add_done_callback(_running.discard)
