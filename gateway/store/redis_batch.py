"""Lua script calls to Redis, batched: calls made while a batch is on its way go together in the next
one pipeline (one write, one read). At saturation redis-py's own cost per command, not Redis, is what a
limiter adds to a request; a pipeline pays it once for many calls. A call alone still goes at once.
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

Call = tuple[str, list[str], list[str], "asyncio.Future[Any]"]  # script sha, keys, args, its answer


class ScriptBatcher:
    def __init__(self, redis: aioredis.Redis, timeout: float, delay: float = 0.0) -> None:
        self.redis, self.timeout, self.delay = redis, timeout, delay  # delay: how long a batch waits for company
        self._pending: list[Call] = []
        self._sending = False
        self._scripts: dict[str, str] = {}  # sha1 -> source, loaded again after NOSCRIPT (a Redis restart)

    def register(self, source: str) -> str:
        sha = hashlib.sha1(source.encode()).hexdigest()
        self._scripts[sha] = source
        return sha

    def call(self, sha: str, keys: list[str], args: list[str]) -> asyncio.Future[Any]:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending.append((sha, keys, args, future))
        if not self._sending:
            self._sending = True
            asyncio.get_running_loop().create_task(self._send_all())
        return future

    async def _send_all(self) -> None:
        try:
            if self.delay:
                await asyncio.sleep(self.delay)
            while self._pending:
                batch, self._pending = self._pending, []
                await self._send(batch)
        finally:
            self._sending = False

    async def _send(self, batch: list[Call]) -> None:
        try:
            async with asyncio.timeout(self.timeout * 4 + 1):  # socket timeouts bound each step; this the whole
                results = await self._pipeline(batch)
                if any(isinstance(r, NoScriptError) for r in results):  # Redis restarted: load them, once more
                    for sha, source in self._scripts.items():
                        assert await self.redis.script_load(source) == sha
                    results = await self._pipeline(batch)
        except BaseException as exc:  # noqa: BLE001 - every caller gets the failure as its own
            for *_, future in batch:
                if not future.done():
                    future.set_exception(exc if isinstance(exc, Exception) else ConnectionError(repr(exc)))
            return
        for (*_, future), result in zip(batch, results):
            if not future.done():
                if isinstance(result, Exception):
                    future.set_exception(result)
                else:
                    future.set_result(result)

    async def _pipeline(self, batch: list[Call]) -> list[Any]:
        pipe = self.redis.pipeline(transaction=False)
        for sha, keys, args, _future in batch:
            pipe.evalsha(sha, len(keys), *keys, *args)
        return await pipe.execute(raise_on_error=False)
