"""Stored responses (`store: true`) for `GET`/`DELETE /v1/responses/{id}` and `previous_response_id`.

In memory, per gateway process, bounded two ways: at most `capacity` responses (the oldest goes first)
and each for `ttl` seconds after it was stored. An entry keeps the response object as it was answered
and the conversation it ends (the earlier turns, this turn's input and its output, as core chat
messages; `instructions` are not carried over, as OpenAI does not carry them over either). An entry
belongs to the API key that made it; another key sees no such response. Without a state database a
restart forgets everything; with one (gateway/store/responses.py) this is its per-process cache.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from backends.base import ChatMessage
from gateway.protocol.responses import Response

DEFAULT_CAPACITY = 1000
DEFAULT_TTL = 3600.0  # seconds


@dataclass(frozen=True)
class StoredResponse:
    response: Response
    conversation: list[ChatMessage]  # everything a follow-up with previous_response_id continues from
    owner: str | None  # the API key's name; None when the gateway has no keys
    expires: float


class ResponsesStore:
    def __init__(self, capacity: int = DEFAULT_CAPACITY, ttl: float = DEFAULT_TTL,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity, self.ttl, self.clock = capacity, ttl, clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response: Response, conversation: list[ChatMessage], owner: str | None) -> None:
        self._expire()
        self._entries[response.id] = StoredResponse(response, conversation, owner, self.clock() + self.ttl)
        self._entries.move_to_end(response.id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str, owner: str | None) -> StoredResponse | None:
        self._expire()
        entry = self._entries.get(response_id)
        return entry if entry is not None and entry.owner == owner else None

    def delete(self, response_id: str, owner: str | None) -> bool:
        if self.get(response_id, owner) is None:
            return False
        del self._entries[response_id]
        return True

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def _expire(self) -> None:
        """Entries expire in the order they were stored (one TTL for all), so the oldest are checked first."""
        now = self.clock()
        while self._entries:
            first = next(iter(self._entries.values()))
            if first.expires > now:
                break
            self._entries.popitem(last=False)


class MemoryResponses:
    """The async interface the Responses routes use, over one process's ResponsesStore (no state database)."""

    def __init__(self, store: ResponsesStore | None = None) -> None:
        self.cache = store or ResponsesStore()

    async def put(self, response: Response, conversation: list[ChatMessage], owner: str | None) -> None:
        self.cache.put(response, conversation, owner)

    async def get(self, response_id: str, owner: str | None) -> StoredResponse | None:
        return self.cache.get(response_id, owner)

    async def delete(self, response_id: str, owner: str | None) -> bool:
        return self.cache.delete(response_id, owner)
