"""Drive an LLMEngine from asyncio: the step loop runs in its own thread, so the event loop
stays free while the model computes, and each request is an async stream of outputs.

Leaving the stream early (the consumer stopped iterating, or its task was cancelled) aborts the
request; its blocks are free before the next step starts.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from engine_core.engine import LLMEngine, RequestError
from engine_core.kv.transfer import KvExport, KvHandle, remove_transfer
from engine_core.outputs import RequestOutput
from engine_core.sampling.params import SamplingParams

SWITCH_INTERVAL = 0.0002  # seconds


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no request can be served."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine]) -> None:
        """`engine`, or a function that builds one: then it is built in the step thread itself (await
        `ready()`), so the torch ops of loading and of stepping share one thread and one OpenMP pool. Each
        thread that runs parallel torch ops gets a pool of its own, and with more pooled threads than cores
        libgomp stops spinning at barriers: built in another thread, served batch-16 decode steps on 2
        cores took 54 ms instead of 37 (docs/benchmarks.md, issue 17)."""
        self._built: concurrent.futures.Future[None] = concurrent.futures.Future()
        if isinstance(engine, LLMEngine):
            self.engine = engine
            self._built.set_result(None)
        else:
            self._factory = engine
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = {}
        self._stopping = False
        self.step_listeners: list[Callable[[LLMEngine], None]] = []  # called after each step, in the thread
        self.abort_listeners: list[Callable[[float], None]] = []  # seconds from abort() to blocks freed
        # Each torch op of a step releases the GIL and must take it back; with the default 5 ms switch
        # interval an event loop busy streaming tokens makes the step thread wait up to 5 ms a time.
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL))
        self._thread = threading.Thread(target=self._run, name="engine-step-loop", daemon=True)
        self._thread.start()

    async def ready(self) -> None:
        """Returns once the engine is built; raises what building it raised."""
        await asyncio.wrap_future(self._built)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                       kv: KvExport | KvHandle | None = None) -> AsyncIterator[RequestOutput]:
        """Stream one output per generated token; the last has `finish_reason` set (or, handed over with
        `kv` = KvExport, `kv_handle`)."""
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        request_id = request_id or uuid.uuid4().hex
        if params.structured_outputs is not None:
            await self._precompile(params)
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[Any] = asyncio.Queue()
        self._streams[request_id] = (loop, outputs)
        self._submit(lambda: self._add(request_id, prompt, params, kv))
        finished = False
        try:
            while True:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    async def _precompile(self, params: SamplingParams) -> None:
        """Compile the request's grammar in the compiler's thread before the step thread sees the request:
        a new schema then never stalls the sequences already running, and a bad one is refused here,
        before the request exists."""
        assert params.structured_outputs is not None
        try:
            params.structured_outputs.validate()
            await asyncio.wrap_future(self.engine.grammars.submit(params.structured_outputs))
        except ValueError as exc:  # a GrammarError, or validate()'s: either way the request is refused
            raise RequestError(str(exc)) from None

    def abort(self, request_id: str) -> None:
        asked = time.perf_counter()

        def run() -> None:
            self.engine.abort(request_id)
            waited = time.perf_counter() - asked
            for listener in self.abort_listeners:
                listener(waited)

        self._submit(run)

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run `fn(engine)` in the engine thread between steps and return its result."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()

        def run() -> None:
            try:
                result = fn(self.engine)
            except BaseException as exc:  # handed back to the caller
                loop.call_soon_threadsafe(_settle, future, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, future, result, None)

        self._submit(run)
        return await future

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout)

    # engine thread

    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wakeup.set()

    def _add(self, request_id: str, prompt: str | list[int], params: SamplingParams,
             kv: KvExport | KvHandle | None) -> None:
        if request_id not in self._streams:  # the caller already left
            if isinstance(kv, KvHandle):
                remove_transfer(kv.transfer_id)
            return
        try:
            self.engine.add_request(request_id, prompt, params, kv)
        except Exception as exc:
            self._deliver(request_id, exc)

    def _deliver(self, request_id: str, item: Any) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, outputs = stream
            try:
                loop.call_soon_threadsafe(outputs.put_nowait, item)
            except RuntimeError:  # its event loop is closed: nobody is listening
                self.engine.abort(request_id)

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs in one hand-off per event loop: one wake-up, not one per sequence (at batch
        128 the per-output wake-ups kept the event loop thread busy and fighting the step for the GIL)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Any], RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                by_loop.setdefault(stream[0], []).append((stream[1], out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # its event loop is closed: nobody is listening
                for _, out in items:
                    self.engine.abort(out.request_id)

    def _run(self) -> None:
        if not self._built.done():
            try:
                self.engine = self._factory()
            except BaseException as exc:
                self._built.set_exception(exc)
                return
            self._built.set_result(None)
        self._loop()

    def _loop(self) -> None:
        while not self._stopping:
            while True:
                try:
                    self._commands.get_nowait()()
                except queue.Empty:
                    break
            if not self.engine.has_unfinished():
                self._wakeup.wait(0.5)
                self._wakeup.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # fail every request in flight, free their blocks, keep serving
                for request_id in list(self.engine.seqs):
                    self.engine.abort(request_id)
                    self._deliver(request_id, exc)
                continue
            self._deliver_step(outputs)
            for listener in self.step_listeners:
                listener(self.engine)
        for request_id in list(self.engine.seqs):
            self.engine.abort(request_id)
            self._deliver(request_id, EngineDeadError("the engine shut down"))


def _put_all(items: list[tuple[asyncio.Queue[Any], Any]]) -> None:
    for outputs, item in items:
        outputs.put_nowait(item)


def _settle(future: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
