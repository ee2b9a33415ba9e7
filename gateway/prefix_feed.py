"""Prefix-aware routing across the fronts of one gateway (`[server] workers` > 1).

A prefix-aware pool remembers which replica it sent each prompt prefix to (backends/pool/prefix_index.py),
but a front sees only the requests the kernel handed to it: a conversation's next turn, on another front,
would find nothing and go wherever the load is lowest, away from its cached prefix. So each front publishes
every choice its pools make (pool, replica, the prompt's block hashes) and applies every other front's:
each index then holds what all fronts routed, as one process's would, a few hundred microseconds late.

ZeroMQ PUB/SUB over ipc in the supervisor's run directory: front k binds `prefix-k`, subscribes to the
others (which may start later or start again: ZeroMQ reconnects). A message lost to a front that was down
only costs that front a cache miss.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from backends.engine_worker.connection import RUN_DIR_ENV
from backends.pool.balance import PrefixAware
from gateway.fronts import front

log = logging.getLogger("llmgw")


def prefix_feed(backends: Callable[[], dict[str, Any]]) -> PrefixFeed | None:
    """The feed of this front; None in a gateway of one process."""
    here, run_dir = front(), os.environ.get(RUN_DIR_ENV)
    if here is None or here[1] < 2 or not run_dir:
        return None
    return PrefixFeed(run_dir, here[0], here[1], backends)


class PrefixFeed:
    def __init__(self, run_dir: str, index: int, count: int, backends: Callable[[], dict[str, Any]]) -> None:
        self.backends = backends  # the gateway's backends now (a reload may replace a pool)
        self.context = zmq.asyncio.Context()
        self.pub = zmq.Context.instance().socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, 100_000)  # past it a slow front misses choices, never blocks this one
        self.pub.bind(f"ipc://{run_dir}/prefix-{index}")
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        for other in range(count):
            if other != index:
                self.sub.connect(f"ipc://{run_dir}/prefix-{other}")
        self.encoder = msgspec.msgpack.Encoder()
        self.receiver: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.receiver = asyncio.create_task(self._receive())

    def watch(self, name: str, backend: Any) -> None:
        """Publish the choices of `backend`'s prefix-aware policy (a pool started, or started again by a reload)."""
        policy = getattr(backend, "policy", None)
        if isinstance(policy, PrefixAware):
            policy.listeners.append(lambda replica, hashes: self._publish(name, replica, hashes))

    def _publish(self, pool: str, replica: str, hashes: list[int]) -> None:
        if hashes:
            with contextlib.suppress(zmq.Again):
                self.pub.send(self.encoder.encode((pool, replica, hashes)), flags=zmq.NOBLOCK, copy=False)

    async def _receive(self) -> None:
        decoder = msgspec.msgpack.Decoder(tuple[str, str, list[int]])
        while True:
            data = await self.sub.recv(copy=False)
            try:
                pool, replica, hashes = decoder.decode(data)
            except msgspec.DecodeError:
                log.error("prefix feed: a message it cannot read")
                continue
            policy = getattr(self.backends().get(pool), "policy", None)
            if isinstance(policy, PrefixAware):
                policy.index.insert(replica, hashes)

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.cancel()
        self.pub.close(linger=0)
        self.sub.close(linger=0)
        self.context.term()
