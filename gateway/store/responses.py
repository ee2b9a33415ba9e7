"""Stored Responses in the state database: `previous_response_id` works across restarts and replicas.

Write-through: an answer is inserted before the response completes, so a follow-up sent to another
replica finds it. Reads go to the database; this process's cache of what it stored answers only while
the database cannot be reached. Rows expire
after `ttl` (OpenAI keeps them 30 days); expired rows are deleted by a periodic sweep. If the database is
down, the cache still serves this replica and the failure is logged and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import msgspec
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from backends.base import ChatMessage
from gateway.errors import GatewayError
from gateway.protocol.responses import Response
from gateway.responses_store import ResponsesStore, StoredResponse
from gateway.store.schema import responses

log = logging.getLogger("llmgw")
DEFAULT_TTL = 30 * 86400.0
SWEEP_INTERVAL = 600.0


def _unavailable(exc: Exception) -> GatewayError:
    log.warning("stored responses: the state database failed (%s: %s)", type(exc).__name__, exc)
    return GatewayError("stored responses are unavailable: the state database cannot be reached", kind="unavailable")


class _Body(msgspec.Struct):
    response: Response
    conversation: list[ChatMessage]


class PersistedResponses:
    def __init__(self, engine: AsyncEngine, ttl: float = DEFAULT_TTL, cache_capacity: int = 1000) -> None:
        self.engine, self.ttl = engine, ttl
        self.cache = ResponsesStore(capacity=cache_capacity, ttl=min(ttl, 3600.0))
        self.failures = 0

    async def put(self, response: Response, conversation: list[ChatMessage], owner: str | None) -> None:
        self.cache.put(response, conversation, owner)
        now = time.time()
        body = msgspec.json.encode(_Body(response, conversation))
        try:
            async with self.engine.begin() as conn:
                await conn.execute(responses.insert().values(id=response.id, owner=owner, created_at=now,
                                                             expires_at=now + self.ttl, body=body))
        except Exception as exc:
            self.failures += 1
            log.warning("stored response %s kept on this replica only: the state database failed (%s: %s)",
                        response.id, type(exc).__name__, exc)

    async def get(self, response_id: str, owner: str | None) -> StoredResponse | None:
        """From the database (another replica may have stored or deleted it); this replica's cache only
        while the database cannot be reached."""
        query = responses.select().where(responses.c.id == response_id, responses.c.expires_at > time.time())
        try:
            async with self.engine.connect() as conn:
                row = (await conn.execute(query)).first()
        except Exception as exc:
            found = self.cache.get(response_id, owner)
            if found is None:
                raise _unavailable(exc) from None
            return found
        if row is None or row.owner != owner:
            return None
        body = msgspec.json.decode(row.body, type=_Body)
        return StoredResponse(body.response, body.conversation, owner, time.monotonic() + row.expires_at - time.time())

    async def delete(self, response_id: str, owner: str | None) -> bool:
        cached = self.cache.delete(response_id, owner)
        owned = responses.c.owner.is_(None) if owner is None else responses.c.owner == owner
        try:
            async with self.engine.begin() as conn:
                result = await conn.execute(responses.delete().where(responses.c.id == response_id, owned))
        except Exception as exc:
            raise _unavailable(exc) from None
        return cached or result.rowcount > 0

    async def sweep(self) -> None:
        """Delete expired rows, every SWEEP_INTERVAL seconds."""
        while True:
            with contextlib.suppress(Exception):
                async with self.engine.begin() as conn:
                    await conn.execute(sa.delete(responses).where(responses.c.expires_at <= time.time()))
            await asyncio.sleep(SWEEP_INTERVAL)
