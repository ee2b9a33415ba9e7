"""Closing a token stream so that it really ends, even from a task that is being cancelled.

Closing the stream aborts the engine request or closes the upstream connection. When a client goes
away, the response task is cancelled under anyio's level-triggered cancellation: every await in it
fails at once, so an `await stream.aclose()` there stops at its first await and the backend stream
would only be finished later by the garbage collector. The close runs in a task of its own instead.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any


async def close_detached(stream: AsyncIterator[Any]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is None or getattr(stream, "ag_frame", True) is None:
        return  # nothing to close, or an async generator that has run to its end: no task for it
    closing = asyncio.ensure_future(aclose())
    with contextlib.suppress(BaseException):  # our caller being cancelled must not stop the close
        await asyncio.shield(closing)
