"""An engine backend in one front of a multi-process gateway (`[server] workers` > 1): the front supervisor
started the engine worker and restarts it; each front attaches to it, as vLLM's API servers share one
engine core. Requests, events and calls go over a socket pair of the front's own, so a front serves its
streams exactly as the single process does; what differs is how the worker is found and how its end is seen.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import ClassVar

import msgspec
import zmq

from backends.engine_worker.client import EngineWorkerBackend
from backends.engine_worker.connection import Connection, attach_address, process_alive
from backends.engine_worker.messages import Attach, Shutdown

log = logging.getLogger("llmgw")
ATTACH_ENV = "LLMGW_ENGINE_ATTACH"  # set in each front by the supervisor: engine backends attach, never spawn
SILENT_AFTER = 3.0  # seconds without a word from the worker (it beats every 0.5 s) before attaching again
GONE_POLL = 0.2  # seconds between looks at whether the worker's process is still there


def attaching() -> bool:
    return bool(os.environ.get(ATTACH_ENV))


class AttachedEngineWorker(EngineWorkerBackend):
    attached: ClassVar[bool] = True

    async def _spawn(self) -> None:
        """Attach to the worker (starting, serving or restarted) and wait for its Ready; raise its StartFailed."""
        address = attach_address(self.name)
        if address is None:
            raise RuntimeError(f"{ATTACH_ENV} is set but the supervisor's run directory is not")
        while True:
            conn = Connection(self._context)
            self._inbox.listen(conn)
            try:
                if await self._attach(conn, address):
                    break
            except BaseException:
                conn.close()
                raise
            conn.close()  # no answer: the worker is gone or never got it; a fresh pair, and again
        self._conn = conn
        self._serving(conn.ready.result())

    async def _attach(self, conn: Connection, address: str) -> bool:
        """Send Attach until the worker takes it, then wait for Ready while the worker is heard from."""
        attach = zmq.Context.instance().socket(zmq.PUSH)
        attach.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing for a worker not there: a send fails, and is tried again
        attach.connect(address)
        message = msgspec.msgpack.encode(Attach(pid=os.getpid(), to_worker=conn.to_worker,
                                                from_worker=conn.from_worker))
        try:
            while True:
                try:
                    attach.send(message, flags=zmq.NOBLOCK)
                    break
                except zmq.Again:
                    await asyncio.sleep(GONE_POLL)
        finally:
            attach.close(linger=1000)
        sent_at = time.monotonic()
        while True:  # a worker still loading its model answers Ready only then; it beats meanwhile
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(SILENT_AFTER):
                    await asyncio.shield(conn.ready)
                return True
            if time.monotonic() - max(sent_at, self._inbox.heard_at) > SILENT_AFTER:
                return False

    async def _wait_for_end(self, conn: Connection) -> str:
        """The supervisor restarts a worker that died or hung; this front sees its process gone."""
        load = self._inbox.load
        pid = load.pid if load is not None else None
        while pid is None or process_alive(pid):
            await asyncio.sleep(GONE_POLL)
            if pid is None and self._inbox.load is not None:
                pid = self._inbox.load.pid
        return f"the worker process {pid} is gone"

    async def _stop_process(self, conn: Connection, kill: bool = False) -> None:
        conn.send(Shutdown())  # from a front: detach; the worker serves the others on
        await asyncio.sleep(0.1)  # the socket closes without linger next: let the message leave first

