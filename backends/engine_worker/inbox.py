"""What the gateway awaits from one engine worker: each stream's token events and each call's reply, by id, and
the worker's latest figures (`WorkerLoad`), which its messages carry. `EngineWorkerBackend` owns one for the worker
serving now; `fail_all` ends whatever is in flight when that worker goes."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from backends.base import BackendUnavailableError, TokenEvent, UpstreamError
from backends.engine_worker.connection import Connection, backend_error
from backends.engine_worker.figures import EngineFigures, engine_figures
from backends.engine_worker.messages import Failed, FromWorker, Load, Ready, Reply, StartFailed, Tokens, WorkerLoad

log = logging.getLogger("llmgw")


class Inbox:
    def __init__(self, name: str) -> None:
        self.name = name
        self.streams: dict[int, asyncio.Queue[TokenEvent | BaseException]] = {}
        self.calls: dict[int, tuple[asyncio.Future[Any], Any]] = {}  # the future and the type its result decodes to
        self.ids = itertools.count()
        self.load: WorkerLoad | None = None
        self.heard_at = 0.0  # time.monotonic() of the worker's latest figures, here
        self.adapters: dict[str, Any] | None = None  # as the worker last reported them
        self.step_listeners: list[Callable[[EngineFigures], None]] = []  # called once per engine step

    def listen(self, conn: Connection) -> None:
        """Handle every message `conn` brings from its worker."""
        decoder = msgspec.msgpack.Decoder(FromWorker)

        def handle(data: zmq.Frame) -> None:
            try:
                self.dispatch(conn, decoder.decode(data))
            except Exception:  # one bad message must not stop every stream's deliveries
                log.exception("backend %s: engine worker message not handled", self.name)

        conn.receive(handle)

    def dispatch(self, conn: Connection, message: FromWorker) -> None:
        if isinstance(message, Tokens):
            if message.load is not None:
                self.loaded(message.load)
            streams = self.streams
            for emitted in message.events:
                events = streams.get(emitted.stream)
                if events is not None:
                    events.put_nowait(emitted.event)
        elif isinstance(message, Load):
            self.loaded(message.load)
        elif isinstance(message, Failed):
            events = self.streams.get(message.stream)
            if events is not None:
                events.put_nowait(backend_error(message.kind, message.message, message.status, message.error_class))
        elif isinstance(message, Reply):
            self.replied(message)
        elif isinstance(message, Ready):
            self.loaded(message.load)
            if not conn.ready.done():
                conn.ready.set_result(message)
        elif isinstance(message, StartFailed) and not conn.ready.done():
            conn.ready.set_exception(RuntimeError(message.error))

    def loaded(self, load: WorkerLoad) -> None:
        self.load = load
        self.heard_at = time.monotonic()
        if isinstance(load.adapters, dict):
            self.adapters = load.adapters
        if load.steps and self.step_listeners:
            for step in load.steps:
                figures = engine_figures(load, step)
                for listener in self.step_listeners:
                    listener(figures)

    def replied(self, reply: Reply) -> None:
        pending = self.calls.get(reply.call)
        if pending is None or pending[0].done():
            return
        future, returns = pending
        if reply.error_kind is not None:
            future.set_exception(backend_error(reply.error_kind, reply.error or reply.error_kind,
                                               error_class=reply.error_class))
            return
        try:
            future.set_result(msgspec.msgpack.decode(reply.result, type=returns))
        except msgspec.ValidationError as exc:
            future.set_exception(UpstreamError(f"{self.name}: the engine worker's reply: {exc}"))

    def fail_all(self, message: str) -> None:
        """Every stream and call in flight ends with its own (typed) error: the worker will not answer them."""
        for events in self.streams.values():
            events.put_nowait(BackendUnavailableError(message))
        for future, _ in self.calls.values():
            if not future.done():
                future.set_exception(BackendUnavailableError(message))
