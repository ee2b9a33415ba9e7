"""The gateway's side of an engine worker: a `Backend` that runs one `EngineBackend` in a process of its own
(as vLLM's engine core) and reaches it over ZeroMQ, so the gateway's event loop never shares a GIL with
the step loop.

It starts the worker, streams each request's events back, aborts a stream whose consumer left, forwards
method calls (tokenize, adapters), and keeps the worker's latest figures (`load()`). A worker that dies
ends its requests in flight with `BackendUnavailableError` and is started again; `state`, `restarts` and
`last_exit` say so.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, ClassVar, Literal

import msgspec
import zmq

from backends.base import (
    BackendError,
    BackendInfo,
    BackendUnavailableError,
    BackendValidationError,
    GenerationRequest,
    TokenEvent,
    TokenSpan,
)
from backends.engine import EngineSettings
from backends.engine_constraint import ENGINE_CONSTRAINT_KINDS
from backends.engine_worker.connection import (
    Connection,
    attach_address,
    describe_exit,
    worker_threads,
)
from backends.engine_worker.figures import EngineFigures, engine_figures
from backends.engine_worker.inbox import Inbox
from backends.engine_worker.messages import (
    Abort,
    Call,
    Generate,
    Launch,
    Ready,
    Shutdown,
    WorkerLoad,
)
from engine_core.kv.transfer import remove_transfer

log = logging.getLogger("llmgw")
STALE_AFTER = 30.0  # seconds without a heartbeat before health() says no (a step may take seconds; not 30)
HUNG_AFTER = 60.0  # seconds without a message from a serving worker (it beats every 0.5 s) before it is killed
STOP_TIMEOUT = 15.0  # seconds for a worker told to shut down before it is killed
RESTART_BACKOFF = (0.0, 1.0, 2.0, 5.0, 10.0, 30.0)  # seconds before each further try of a failing restart
WorkerState = Literal["not started", "starting", "ready", "restarting", "failed", "closed"]
PROJECT_ROOT = str(Path(__file__).resolve().parents[2])  # where `backends` imports from


class EngineWorkerBackend:
    type_name: ClassVar[str] = "engine"
    Settings: ClassVar[type[msgspec.Struct]] = EngineSettings

    def __init__(self, name: str, settings: EngineSettings, replicas: int | None = None) -> None:
        self.name = name
        self.settings = settings
        replicas = replicas if replicas is not None else int(getattr(settings, "replicas", 1) or 1)
        self.threads = settings.num_threads or worker_threads(replicas)
        self.state: WorkerState = "not started"
        self.restarts = 0  # times the worker died and was started again
        self.last_exit: str | None = None  # how the last worker that died ended
        self.load_error: str | None = None
        self._info: BackendInfo | None = None
        self._dtype: tuple[str, str] | None = None
        self._inbox = Inbox(name)
        self.step_listeners: list[Callable[[EngineFigures], None]] = self._inbox.step_listeners  # once per step
        self._context = zmq.Context()  # the sockets from the workers: closed together at the end
        self._conn: Connection | None = None
        self._supervisor: asyncio.Task[None] | None = None
        self._loaded_at_runtime: dict[str, str] = {}  # LoRA adapters by name: path, loaded through load_adapter

    # lifecycle

    async def start(self) -> None:
        self.state = "starting"
        try:
            await self._spawn()
        except Exception as exc:
            self.state = "failed"
            self.load_error = str(exc)
            raise
        self.state = "ready"
        self._supervisor = asyncio.create_task(self._supervise())

    async def _spawn(self) -> None:
        """Start a worker and wait until its engine is loaded; raise (with the worker's reason) if it is not."""
        conn = Connection(self._context)
        self._inbox.listen(conn)
        settings = msgspec.to_builtins(msgspec.structs.replace(self.settings, num_threads=self.threads))
        launch = Launch(name=self.name, settings=settings, to_worker=conn.to_worker, from_worker=conn.from_worker,
                        parent_pid=os.getpid(), attach=attach_address(self.name))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [PROJECT_ROOT, os.environ.get("PYTHONPATH")]))}
        try:
            conn.process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "backends.engine_worker", msgspec.json.encode(launch).decode(),
                env=env, start_new_session=True)  # its own session: a terminal's Ctrl-C is the gateway's to handle
            self._conn = conn
            exited = asyncio.create_task(conn.process.wait())
            await asyncio.wait({conn.ready, exited}, return_when=asyncio.FIRST_COMPLETED)
            if not conn.ready.done():  # its StartFailed may still be on the way: the reason is worth a moment
                await asyncio.wait({conn.ready}, timeout=1.0)
            if not conn.ready.done():
                conn.ready.cancel()
                raise RuntimeError(f"the engine worker ended while starting ({describe_exit(exited.result())})")
            exited.cancel()
            ready = conn.ready.result()  # raises the worker's StartFailed reason
        except BaseException:
            await self._stop_process(conn, kill=True)
            self._conn = None
            conn.close()
            raise
        self._serving(ready)

    def _serving(self, ready: Ready) -> None:
        self._info, self._dtype, self._inbox.load = ready.info, ready.dtype, ready.load
        self.load_error = None
        log.info("backend %s: engine worker pid %d is serving", self.name, ready.load.pid)

    async def _supervise(self) -> None:
        """Wait for the worker to end; unless it was told to, fail its requests and start another."""
        while True:
            conn = self._conn
            assert conn is not None
            ended = await self._wait_for_end(conn)
            if self.state == "closed":
                return
            self.restarts += 1
            self.last_exit = ended
            self.state = "restarting"
            log.error("backend %s: engine worker pid %s ended (%s); %d request(s) failed; restarting",
                      self.name, self._inbox.load.pid if self._inbox.load else "?", self.last_exit,
                      len(self._inbox.streams))
            self._conn = None
            conn.close()
            self._inbox.fail_all(f"{self.name}: the engine worker ended ({self.last_exit}) and is restarting")
            for attempt in itertools.count():
                await asyncio.sleep(RESTART_BACKOFF[min(attempt, len(RESTART_BACKOFF) - 1)])
                try:
                    await self._spawn()
                    break
                except Exception as exc:
                    self.load_error = str(exc)
                    log.error("backend %s: engine worker restart failed: %s", self.name, exc)
            await self._reload_adapters()  # before it takes requests, so none finds its adapter missing
            self.state = "ready"

    async def _wait_for_end(self, conn: Connection) -> str:
        """How the worker ended; a worker that stopped answering (a wedged step loop) is killed first."""
        assert conn.process is not None
        exited = asyncio.ensure_future(conn.process.wait())
        while True:
            done, _ = await asyncio.wait({exited}, timeout=HUNG_AFTER / 4)
            if done:
                return describe_exit(exited.result())
            load = self._inbox.load
            if load is not None and time.monotonic() - self._inbox.heard_at > HUNG_AFTER:
                log.error("backend %s: engine worker pid %d sent nothing for %.0f s; killing it", self.name,
                          conn.process.pid, HUNG_AFTER)
                with contextlib.suppress(ProcessLookupError):
                    conn.process.kill()

    async def _stop_process(self, conn: Connection, kill: bool = False) -> None:
        process = conn.process
        if process is None or process.returncode is not None:
            return
        if not kill:
            conn.send(Shutdown())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(STOP_TIMEOUT):
                    await process.wait()
                    return
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()

    async def aclose(self) -> None:
        self.state = "closed"
        if self._supervisor is not None:
            self._supervisor.cancel()
        conn, self._conn = self._conn, None
        if conn is not None:
            await self._stop_process(conn)
            conn.close()
        self._inbox.fail_all(f"{self.name}: the engine is shutting down")
        self._context.destroy(linger=0)  # closes any socket a cancelled start left, never blocks

    # what the gateway reads

    @property
    def pid(self) -> int | None:
        """The worker process serving now."""
        load = self._inbox.load
        return load.pid if self._conn is not None and load is not None and self.state == "ready" else None

    def load(self) -> WorkerLoad | None:
        """The worker's latest figures (running, waiting, KV blocks, steps), or None before it reports."""
        return self._inbox.load

    def figures(self) -> EngineFigures | None:
        """The latest figures as the gateway's engine metrics read them; None until the engine is loaded."""
        load = self._inbox.load  # a dead worker's last figures are no one's: none while it restarts
        return engine_figures(load) if load is not None and load.kv_blocks_total and self.state == "ready" else None

    def describe_state(self) -> str:
        """The worker's state in words, for /health: "ready", or "restarting (restart 2; the last ended: ...)"."""
        if self.state in ("restarting", "failed") or self.restarts:
            parts = [f"restart {self.restarts}; the last worker ended: {self.last_exit}"] if self.restarts else []
            if self.load_error and self.state != "ready":
                parts.append(self.load_error)
            return f"{self.state} ({'; '.join(parts)})" if parts else self.state
        return self.state

    def startup_step(self) -> str | None:
        """What a starting engine is doing now (for /health), or None once it is up or has failed."""
        if self.state not in ("not started", "starting"):
            return None
        load = self._inbox.load
        return load.startup_step if load is not None and load.startup_step else "starting the engine worker process"

    def dtype(self) -> tuple[str, str] | None:
        return self._dtype

    def speculative(self) -> str | None:
        spec = self.settings.speculative_config()
        return spec.describe() if spec is not None else None

    async def health(self) -> bool:
        load = self._inbox.load
        return (self.state == "ready" and load is not None and load.ready
                and time.monotonic() - load.sent_at < STALE_AFTER)

    def info(self) -> BackendInfo:
        if self._info is None:
            return BackendInfo(backend_type=self.type_name, model_id=self.settings.model,
                               constraint_kinds=ENGINE_CONSTRAINT_KINDS)
        return self._info

    # requests

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        conn = self._conn
        if conn is None or self.state != "ready":
            raise BackendUnavailableError(self.load_error or f"{self.name}: the engine worker is {self.state}")
        stream = next(self._inbox.ids)
        events: asyncio.Queue[TokenEvent | BaseException] = asyncio.Queue()
        self._inbox.streams[stream] = events
        finished = False
        try:
            try:
                conn.send(Generate(stream, request))
            except (OverflowError, msgspec.EncodeError) as exc:  # e.g. a token id past 64 bits: never sent
                finished = True
                raise BackendValidationError(f"the request holds a value the engine cannot take ({exc}); prompt "
                                             "token ids must be in the model's vocabulary") from None
            while True:
                item = await events.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._inbox.streams.pop(stream, None)
            if not finished and conn.open:  # the consumer left: the worker frees the request's blocks at once
                conn.send(Abort(stream))

    async def call(self, method: str, *args: Any, returns: Any = Any) -> Any:
        """Call the worker's backend method `method(*args)` (awaited there if it is async); its result is
        decoded as `returns`. The command channel: whatever EngineBackend gains works through the worker."""
        if self._conn is None or self.state != "ready":
            raise BackendUnavailableError(self.load_error or f"{self.name}: the engine worker is {self.state}")
        return await self._call(self._conn, method, args, returns)

    async def _call(self, conn: Connection, method: str, args: tuple[Any, ...], returns: Any) -> Any:
        call = next(self._inbox.ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._inbox.calls[call] = (future, returns)
        try:
            conn.send(Call(call, method, list(args)))
            return await future
        finally:
            self._inbox.calls.pop(call, None)

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[TokenSpan]:
        return await self.call("tokenize", text, add_special_tokens, returns=list[TokenSpan])

    async def release_kv(self, transfer_id: str) -> bool:
        """Free a prefill leg's parked blocks; its handover file goes even when the worker cannot answer (it
        died mid-transfer): the file is on this host, and nobody else will remove it."""
        try:
            return bool(await self.call("release_kv", transfer_id, returns=bool))
        except BackendError:
            return False
        finally:
            remove_transfer(transfer_id)

    async def load_adapter(self, name: str, path: str | Path) -> Any:
        result = await self.call("load_adapter", name, str(path))
        self._loaded_at_runtime[name] = str(path)  # a restarted worker loads it again
        return result

    async def unload_adapter(self, name: str) -> Any:
        result = await self.call("unload_adapter", name)
        self._loaded_at_runtime.pop(name, None)
        return result

    def adapters(self) -> dict[str, Any]:
        """The worker's adapters as of its latest figures (refreshed before each call's reply); the
        configured ones until it reports."""
        if self._inbox.adapters is not None:
            return dict(self._inbox.adapters)
        return dict(getattr(self.settings, "lora_adapters", {}) or {})

    async def _reload_adapters(self) -> None:
        """After a restart: the adapters loaded at run time, loaded again (the config's load at start)."""
        for name, path in list(self._loaded_at_runtime.items()):
            try:
                assert self._conn is not None
                await self._call(self._conn, "load_adapter", (name, path), Any)
            except BackendError as exc:
                log.error("backend %s: adapter %s not loaded again after the restart: %s", self.name, name, exc)
