"""Admission control: the server-wide limit (TGI's semaphore: 429 at once), a per-model concurrency
limit with an optional bounded wait queue, and refusal while the server drains for shutdown."""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass

from gateway.errors import GatewayError


class ModelGate:
    """At most `limit` requests at once; up to `max_queued` more wait, first come first served, for at
    most `max_wait` seconds. A released slot is handed straight to the oldest waiter."""

    def __init__(self, limit: int | None, max_queued: int = 0, max_wait: float = 30.0) -> None:
        self.limit, self.max_queued, self.max_wait = limit, max_queued, max_wait
        self.active = 0
        self.waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    def same_settings(self, limit: int | None, max_queued: int, max_wait: float) -> bool:
        return (self.limit, self.max_queued, self.max_wait) == (limit, max_queued, max_wait)

    async def acquire(self) -> None:
        if self.limit is None or (self.active < self.limit and not self.waiters):
            self.active += 1
            return
        if len(self.waiters) >= self.max_queued:
            raise GatewayError("Model is overloaded", kind="overloaded")
        slot: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiters.append(slot)
        try:
            async with asyncio.timeout(self.max_wait):
                await slot
        except BaseException as exc:
            if slot.done() and not slot.cancelled():
                self.release()  # the slot arrived as we gave up: pass it on
            else:
                slot.cancel()
                self.waiters.remove(slot)
            if isinstance(exc, TimeoutError):
                raise GatewayError("Model is overloaded", kind="overloaded",
                                   code="queue_timeout") from None
            raise

    def release(self) -> None:
        while self.waiters:
            slot = self.waiters.popleft()
            if not slot.done():
                slot.set_result(None)  # the slot changes hands: `active` stays the same
                return
        self.active -= 1


@dataclass
class Admission:
    """One admitted request; `release` is idempotent so every exit path may call it."""

    counter: list[int]  # the server-wide in-flight count, shared
    gate: ModelGate | None
    released: bool = False

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self.counter[0] -= 1
        if self.gate is not None:
            self.gate.release()
