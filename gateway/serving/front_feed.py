"""What the fronts of one gateway (`[server] workers` > 1) tell each other about their pools.

Each front sees only the requests the kernel handed to it, so on its own it would route and judge replicas
from a part of the traffic:
- **Prefix choices**: a prefix-aware pool remembers which replica it sent each prompt prefix to
  (backends/pool/prefix_index.py). A conversation's next turn, on another front, would find nothing and go
  wherever the load is lowest, away from its cached prefix. So every choice (pool, replica, the prompt's block
  hashes) goes to the other fronts, and each index holds what all fronts routed, a few hundred microseconds late.
- **Health**: a replica one front ejected after failed requests, or found failing (or passing again) in an
  active check, is ejected or marked so on every front at once, instead of each front paying its own failed
  requests before it learns (backends/pool/replica.py HealthNews).

ZeroMQ PUB/SUB over ipc in the supervisor's run directory: front k binds `front-k`, subscribes to the others
(which may start later or start again: ZeroMQ reconnects). A message lost to a front that was down costs that
front a cache miss, or a failed request of its own before it ejects the replica itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from backends.engine_worker.connection import RUN_DIR_ENV
from backends.pool.balance import PrefixAware
from backends.pool.replica import HealthNews
from gateway.serving.fronts import front

log = logging.getLogger("llmgw")


class PrefixChoice(msgspec.Struct, tag="prefix", array_like=True):
    pool: str
    replica: str
    hashes: list[int]


class HealthChange(msgspec.Struct, tag="health", array_like=True):
    pool: str
    news: HealthNews


Message = PrefixChoice | HealthChange


def front_feed(backends: Callable[[], dict[str, Any]]) -> FrontFeed | None:
    """The feed of this front; None in a gateway of one process."""
    here, run_dir = front(), os.environ.get(RUN_DIR_ENV)
    if here is None or here[1] < 2 or not run_dir:
        return None
    return FrontFeed(run_dir, here[0], here[1], backends)


def pools_of(name: str, backend: Any) -> Iterator[tuple[str, Any]]:
    """(key, pool) of each replica pool a backend is made of: itself, or a P/D pool's prefill and decode pools."""
    if hasattr(backend, "health_listeners"):
        yield name, backend
    for role in ("prefill", "decode"):
        part = getattr(backend, role, None)
        if hasattr(part, "health_listeners"):
            yield f"{name}/{role}", part


class FrontFeed:
    def __init__(self, run_dir: str, index: int, count: int, backends: Callable[[], dict[str, Any]]) -> None:
        self.backends = backends  # the gateway's backends now (a reload may replace a pool)
        self.context = zmq.asyncio.Context()
        self.pub = zmq.Context.instance().socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, 100_000)  # past it a slow front misses news, never blocks this one
        self.pub.bind(f"ipc://{run_dir}/front-{index}")
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        for other in range(count):
            if other != index:
                self.sub.connect(f"ipc://{run_dir}/front-{other}")
        self.encoder = msgspec.msgpack.Encoder()
        self.receiver: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.receiver = asyncio.create_task(self._receive())

    def watch(self, name: str, backend: Any) -> None:
        """Publish what `backend`'s pools see (a pool started, or started again by a reload)."""
        for key, pool in pools_of(name, backend):
            pool.health_listeners.append(lambda news, k=key: self._publish(HealthChange(k, news)))
            if isinstance(pool.policy, PrefixAware):
                pool.policy.listeners.append(lambda replica, hashes, k=key: self._publish_choice(k, replica, hashes))

    def _publish_choice(self, pool: str, replica: str, hashes: list[int]) -> None:
        if hashes:
            self._publish(PrefixChoice(pool, replica, hashes))

    def _publish(self, message: Message) -> None:
        with contextlib.suppress(zmq.Again):
            self.pub.send(self.encoder.encode(message), flags=zmq.NOBLOCK, copy=False)

    def _pool(self, key: str) -> Any:
        name, _, role = key.partition("/")
        backend = self.backends().get(name)
        return getattr(backend, role, None) if role else backend

    async def _receive(self) -> None:
        decoder = msgspec.msgpack.Decoder(Message)
        while True:
            data = await self.sub.recv(copy=False)
            try:
                message = decoder.decode(data)
            except msgspec.DecodeError:
                log.error("front feed: a message it cannot read")
                continue
            pool = self._pool(message.pool)
            if isinstance(message, HealthChange):
                if hasattr(pool, "hear"):
                    pool.hear(message.news)
            elif isinstance(getattr(pool, "policy", None), PrefixAware):
                pool.policy.index.insert(message.replica, message.hashes)

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.cancel()
        self.pub.close(linger=0)
        self.sub.close(linger=0)
        self.context.term()
