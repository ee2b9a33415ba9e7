"""The engine worker process: one ordinary in-process `EngineBackend` behind two ZeroMQ sockets.

Requests come in on a PULL socket, token events go out on a PUSH socket (both bound by the gateway,
which starts this process with `python -m backends.engine_worker LAUNCH_JSON`). The events of one
engine step leave in one message; the worker's figures (`WorkerLoad`) follow steps and aborts and
serve as a heartbeat. The process ends when told to, or when the gateway's process is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import inspect
import logging
import os
import signal
import time
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from backends.base import BackendError, GenerationRequest, describe
from backends.engine import EngineBackend, EngineSettings
from backends.engine_worker.messages import (
    Abort,
    Call,
    Emitted,
    Failed,
    FromWorker,
    Generate,
    Launch,
    Load,
    Ready,
    Reply,
    Shutdown,
    SpecFigures,
    StartFailed,
    StepFigures,
    Tokens,
    ToWorker,
    WorkerLoad,
    encode_hook,
)
from engine_core import LLMEngine

log = logging.getLogger("llmgw.engine_worker")
HEARTBEAT = 0.5  # seconds between load messages when nothing happens
NOT_CALLABLE = frozenset({"start", "generate", "aclose"})  # the worker's own business, not the command channel
READ_ONLY = frozenset({"tokenize", "info", "health", "dtype", "startup_step", "adapters"})  # change no figures


class Worker:
    def __init__(self, launch: Launch) -> None:
        settings = msgspec.convert(launch.settings, EngineSettings)
        # the one engine of this process: in its thread here, one replica of whatever pool launched it
        self.backend = EngineBackend(launch.name, msgspec.structs.replace(settings, workers="thread", replicas=1,
                                                                          prefill_replicas=0))
        self.launch = launch
        self.context = zmq.asyncio.Context()
        self.inbox = self.context.socket(zmq.PULL)
        self.inbox.connect(launch.to_worker)
        self.outbox = zmq.Context.instance().socket(zmq.PUSH)  # sends never wait: no high-water mark
        self.outbox.setsockopt(zmq.SNDHWM, 0)
        self.outbox.connect(launch.from_worker)
        self.encoder = msgspec.msgpack.Encoder(enc_hook=encode_hook)
        self.streams: dict[int, asyncio.Task[None]] = {}
        self.pending: list[Emitted] = []
        self.steps: list[StepFigures] = []
        self.total_steps = 0
        self.changed = False  # steps ran or blocks were freed since the last figures sent
        self.flush_due = False
        self.stopping = asyncio.Event()

    # sending

    def send(self, message: FromWorker) -> None:
        self.outbox.send(self.encoder.encode(message), copy=False)

    def emit(self, stream: int, event: Any) -> None:
        self.pending.append(Emitted(stream, event))
        self.flush_soon()

    def flush_soon(self) -> None:
        """Send on the next loop pass: every stream woken by the same engine step has run by then (their
        wake-ups were queued before the step's figures were)."""
        if not self.flush_due:
            self.flush_due = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self.flush_due = False
        if self.pending or self.changed:
            events, self.pending = self.pending, []
            # a stream that finished freed its blocks in the step that made its last event: the figures read
            # now show that, and reach the gateway before the event does
            finished = any(e.event.finish_reason is not None for e in events)
            self.send(Tokens(events, self.figures(with_adapters=False) if self.changed or finished else None))

    def figures(self, with_adapters: bool = True) -> WorkerLoad:
        """The figures now; a step's leave the adapters out (they change only by a call, never by a step)."""
        steps, self.steps = self.steps, []
        self.changed = False
        backend = self.backend
        base = dict(pid=os.getpid(), sent_at=time.monotonic(), total_steps=self.total_steps, steps=steps,
                    adapters=_adapters(backend) if with_adapters else None)
        if backend.engine is None:
            return WorkerLoad(startup_step=backend.startup_step(), **base)
        llm = backend.engine.engine
        bm, scheduler = llm.block_manager, llm.scheduler
        return WorkerLoad(ready=backend.engine.alive, running=len(scheduler.running), waiting=len(scheduler.waiting),
                          kv_blocks_total=bm.num_blocks, kv_blocks_free=bm.num_free_blocks,
                          all_blocks_free=bm.check_all_free(), prefix_cache_queries=bm.prefix_queries,
                          prefix_cache_hits=bm.prefix_hits, preemptions=scheduler.num_preemptions,
                          spec=_spec_figures(llm), **base)

    def send_load(self) -> None:
        self.flush()  # the events first, and the figures that go with them
        self.send(Load(self.figures()))

    def note_change(self) -> None:
        """Steps ran or blocks were freed: the figures go with the next send."""
        self.changed = True
        self.flush_soon()

    def stepped(self, step: StepFigures) -> None:
        self.steps.append(step)
        self.total_steps += 1
        self.note_change()

    # the engine

    def watch_engine(self, loop: asyncio.AbstractEventLoop) -> None:
        assert self.backend.engine is not None

        def after_step(llm: LLMEngine) -> None:  # in the engine thread
            step = llm.last_step
            if step is not None:
                loop.call_soon_threadsafe(self.stepped, StepFigures(step.num_seqs, step.num_tokens, step.seconds))

        self.backend.engine.step_listeners.append(after_step)
        self.backend.engine.abort_listeners.append(lambda _seconds: loop.call_soon_threadsafe(self.note_change))

    async def serve_stream(self, stream: int, request: GenerationRequest) -> None:
        try:
            async for event in self.backend.generate(request):
                self.emit(stream, event)
        except asyncio.CancelledError:  # aborted: the engine freed its blocks; nobody waits for an answer
            pass
        except BackendError as exc:
            self.flush()
            self.send(Failed(stream, exc.kind, exc.message, exc.status, type(exc).__name__))
        except Exception as exc:  # the backend maps engine errors itself; anything else is still an answer
            self.flush()
            self.send(Failed(stream, "upstream", f"{self.backend.name}: {describe(exc)}"))
        finally:
            self.streams.pop(stream, None)

    async def call(self, message: Call) -> None:
        try:
            if message.method.startswith("_") or message.method in NOT_CALLABLE:
                raise AttributeError(message.method)
            method = getattr(self.backend, message.method)
            result = method(*message.args)
            if inspect.isawaitable(result):
                result = await result
            reply = Reply(message.call, result=msgspec.Raw(self.encoder.encode(result)))
        except BackendError as exc:
            reply = Reply(message.call, error_kind=exc.kind, error=exc.message, error_class=type(exc).__name__)
        except AttributeError:
            reply = Reply(message.call, error_kind="validation", error=f"the engine has no method {message.method}")
        except Exception as exc:
            reply = Reply(message.call, error_kind="upstream", error=describe(exc))
        if message.method not in READ_ONLY:
            self.send_load()  # a call may change the figures (adapters): they arrive before its reply
        self.send(reply)

    # the loops

    async def receive(self) -> None:
        decoder = msgspec.msgpack.Decoder(ToWorker)
        tasks: set[asyncio.Task[None]] = set()
        while True:
            data = await self.inbox.recv(copy=False)
            try:
                message = decoder.decode(data)
            except msgspec.DecodeError as exc:  # a gateway of another version: say so, serve the rest
                log.error("engine worker: a message it cannot read: %s", exc)
                continue
            if isinstance(message, Generate):
                self.streams[message.stream] = asyncio.create_task(self.serve_stream(message.stream, message.request))
            elif isinstance(message, Abort):
                task = self.streams.pop(message.stream, None)
                if task is not None:
                    task.cancel()
            elif isinstance(message, Call):
                task = asyncio.create_task(self.call(message))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            elif isinstance(message, Shutdown):
                self.stopping.set()
                return

    async def heartbeat(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT)
            if os.getppid() != self.launch.parent_pid:  # the gateway is gone: so is the reason to run
                log.warning("the gateway (pid %d) is gone; the engine worker exits", self.launch.parent_pid)
                self.stopping.set()
                return
            self.send_load()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        receiving = asyncio.create_task(self.receive())
        beating = asyncio.create_task(self.heartbeat())
        starting = asyncio.create_task(self.backend.start())
        stopping = asyncio.create_task(self.stopping.wait())
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        code = 0
        if starting.done() and starting.exception() is not None:
            self.send(StartFailed(describe(starting.exception())))  # type: ignore[arg-type]
            code = 1
        elif starting.done():
            self.watch_engine(loop)
            self.send(Ready(self.backend.info(), self.backend.dtype(), self.figures()))
            await asyncio.wait({stopping, receiving}, return_when=asyncio.FIRST_COMPLETED)  # told to, or broken
            if receiving.done() and not receiving.cancelled() and receiving.exception() is not None:
                log.error("engine worker: its receive loop failed: %s", describe(receiving.exception()))  # type: ignore[arg-type]
                code = 1
        for task in (receiving, beating, starting, *self.streams.values()):
            task.cancel()
        with contextlib.suppress(Exception):
            await self.backend.aclose()
        self.flush()
        self.outbox.close(linger=2000)  # what is queued (a StartFailed, the last events) still goes out
        self.inbox.close(linger=0)
        self.context.term()
        return code


def _spec_figures(llm: LLMEngine) -> SpecFigures | None:
    spec = llm.spec
    if spec is None:
        return None
    c = spec.counters
    return SpecFigures(method=spec.config.method, num_drafts=c.num_drafts, num_draft_tokens=c.num_draft_tokens,
                       num_accepted_tokens=c.num_accepted_tokens, num_emitted_tokens=c.num_emitted_tokens,
                       accepted_per_pos=list(c.accepted_per_pos))


def _adapters(backend: EngineBackend) -> Any:
    adapters = getattr(backend, "adapters", None)
    if adapters is None:
        return None
    with contextlib.suppress(Exception):
        return adapters()
    return None


def _die_with_parent() -> None:
    """Linux: the kernel sends SIGKILL when the gateway's process dies, even when it could not say so."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def main(argv: list[str]) -> int:
    launch = msgspec.json.decode(argv[0], type=Launch)
    _die_with_parent()
    if os.getppid() != launch.parent_pid:  # the gateway died before the line above took effect
        return 1
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the gateway decides when the worker stops
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s [worker %(process)d]: %(message)s")
    return asyncio.run(Worker(launch).run())
