"""The gateway processes one engine worker serves: the one that started it, and, in a gateway of several
front processes (`[server] workers` > 1), every front that attached. Each has its own pair of sockets,
bound on its side, and its own streams; the worker's figures go to all of them."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from backends.engine_worker.connection import process_alive
from backends.engine_worker.messages import Emitted


class Peer:
    """One gateway process: where its requests come from, where its events go, and its streams here."""

    def __init__(self, context: zmq.asyncio.Context, pid: int, to_worker: str, from_worker: str,
                 spawner: bool) -> None:
        self.pid = pid
        self.spawner = spawner  # the process that started the worker: its Shutdown stops the worker
        self.inbox = context.socket(zmq.PULL)
        self.inbox.connect(to_worker)
        self.outbox = zmq.Context.instance().socket(zmq.PUSH)  # sends never wait: no high-water mark
        self.outbox.setsockopt(zmq.SNDHWM, 0)
        self.outbox.connect(from_worker)
        self.pending: list[Emitted] = []  # events not sent yet
        self.streams: dict[int, asyncio.Task[None]] = {}
        self.receiver: asyncio.Task[None] | None = None

    def send(self, data: bytes | memoryview) -> None:
        self.outbox.send(data, copy=False)

    def alive(self) -> bool:
        """Its process still runs (a front killed with SIGKILL says nothing: the worker looks)."""
        return process_alive(self.pid)

    def close(self, linger: int = 0) -> None:
        """Its streams aborted (the engine frees their blocks) and its sockets closed."""
        for task in self.streams.values():
            task.cancel()
        self.streams.clear()
        if self.receiver is not None:
            self.receiver.cancel()
        self.outbox.close(linger=linger)
        self.inbox.close(linger=0)
