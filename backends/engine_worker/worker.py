"""The engine worker process: one ordinary in-process `EngineBackend` behind two ZeroMQ sockets.

Requests come in on a PULL socket, token events go out on a PUSH socket (both bound by the gateway,
which starts this process with `python -m backends.engine_worker LAUNCH_JSON`); in a gateway of several
front processes, each front attaches with a pair of its own (peers.py). The events of one
engine step leave in one message; the worker's figures (`WorkerLoad`) follow steps and aborts and
serve as a heartbeat. The process ends when told to, or when the gateway's process is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
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
    Attach,
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
from backends.engine_worker.peers import Peer
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
        self.peers = [Peer(self.context, launch.parent_pid, launch.to_worker, launch.from_worker, spawner=True)]
        self.encoder = msgspec.msgpack.Encoder(enc_hook=encode_hook)
        self.ready: Ready | None = None  # once the engine serves: what an attaching front is told first
        self.steps: list[StepFigures] = []
        self.total_steps = 0
        self.changed = False  # steps ran or blocks were freed since the last figures sent
        self.flush_due = False
        self.stopping = asyncio.Event()

    # sending

    def send(self, peer: Peer, message: FromWorker) -> None:
        peer.send(self.encoder.encode(message))

    def broadcast(self, message: FromWorker) -> None:
        data = self.encoder.encode(message)
        for peer in self.peers:
            peer.send(data)

    def emit(self, peer: Peer, stream: int, event: Any) -> None:
        peer.pending.append(Emitted(stream, event))
        self.flush_soon()

    def flush_soon(self) -> None:
        """Send on the next loop pass: every stream woken by the same engine step has run by then (their
        wake-ups were queued before the step's figures were)."""
        if not self.flush_due:
            self.flush_due = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self.flush_due = False
        if not self.changed and not any(peer.pending for peer in self.peers):
            return
        # a stream that finished freed its blocks in the step that made its last event: the figures read
        # now show that, and reach the gateway before the event does
        finished = any(e.event.finish_reason is not None for peer in self.peers for e in peer.pending)
        load = self.figures(with_adapters=False) if self.changed or finished else None
        for peer in self.peers:
            if peer.pending or load is not None:
                events, peer.pending = peer.pending, []
                self.send(peer, Tokens(events, load))

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
        self.broadcast(Load(self.figures()))

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

    async def serve_stream(self, peer: Peer, stream: int, request: GenerationRequest) -> None:
        try:
            async for event in self.backend.generate(request):
                self.emit(peer, stream, event)
        except asyncio.CancelledError:  # aborted: the engine freed its blocks; nobody waits for an answer
            pass
        except BackendError as exc:
            self.flush()
            self.send(peer, Failed(stream, exc.kind, exc.message, exc.status, type(exc).__name__))
        except Exception as exc:  # the backend maps engine errors itself; anything else is still an answer
            self.flush()
            self.send(peer, Failed(stream, "upstream", f"{self.backend.name}: {describe(exc)}"))
        finally:
            peer.streams.pop(stream, None)

    async def call(self, peer: Peer, message: Call) -> None:
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
        self.send(peer, reply)

    # the loops

    async def receive(self, peer: Peer) -> None:
        decoder = msgspec.msgpack.Decoder(ToWorker)
        tasks: set[asyncio.Task[None]] = set()
        while True:
            data = await peer.inbox.recv(copy=False)
            try:
                message = decoder.decode(data)
            except msgspec.DecodeError as exc:  # a gateway of another version: say so, serve the rest
                log.error("engine worker: a message it cannot read: %s", exc)
                continue
            if isinstance(message, Generate):
                peer.streams[message.stream] = asyncio.create_task(
                    self.serve_stream(peer, message.stream, message.request))
            elif isinstance(message, Abort):
                task = peer.streams.pop(message.stream, None)
                if task is not None:
                    task.cancel()
            elif isinstance(message, Call):
                task = asyncio.create_task(self.call(peer, message))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            elif isinstance(message, Shutdown):
                if peer.spawner:
                    self.stopping.set()
                else:  # a front leaving: the worker serves on
                    asyncio.get_running_loop().call_soon(self.detach, peer)
                return

    async def accept(self, address: str) -> None:
        """Fronts of a multi-process gateway attach here: each gets its own pair of sockets, and Ready."""
        listener = self.context.socket(zmq.PULL)
        listener.bind(address)
        decoder = msgspec.msgpack.Decoder(Attach)
        try:
            while True:
                try:
                    attach = decoder.decode(await listener.recv(copy=False))
                except msgspec.DecodeError as exc:
                    log.error("engine worker: an attach message it cannot read: %s", exc)
                    continue
                for old in [p for p in self.peers if not p.spawner and p.pid == attach.pid]:
                    self.detach(old)  # the same front again (it lost this worker's Ready): its old pair goes
                peer = Peer(self.context, attach.pid, attach.to_worker, attach.from_worker, spawner=False)
                peer.receiver = asyncio.create_task(self.receive(peer))
                self.peers.append(peer)
                log.info("front pid %d attached (%d gateway process(es))", attach.pid, len(self.peers))
                if self.ready is not None:
                    self.send(peer, msgspec.structs.replace(self.ready, load=self.figures()))
        finally:
            listener.close(linger=0)

    def detach(self, peer: Peer) -> None:
        if peer in self.peers:
            self.peers.remove(peer)
            if peer.streams:
                log.warning("front pid %d is gone; its %d request(s) aborted", peer.pid, len(peer.streams))
            peer.close()
            self.note_change()  # the aborts freed blocks: every other front hears of it

    async def heartbeat(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT)
            if os.getppid() != self.launch.parent_pid:  # the gateway is gone: so is the reason to run
                log.warning("the gateway (pid %d) is gone; the engine worker exits", self.launch.parent_pid)
                self.stopping.set()
                return
            for peer in [p for p in self.peers if not p.spawner and not p.alive()]:
                self.detach(peer)
            self.send_load()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        spawner = self.peers[0]
        spawner.receiver = asyncio.create_task(self.receive(spawner))
        beating = asyncio.create_task(self.heartbeat())
        accepting = asyncio.create_task(self.accept(self.launch.attach)) if self.launch.attach else None
        starting = asyncio.create_task(self.backend.start())
        stopping = asyncio.create_task(self.stopping.wait())
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        code = 0
        if starting.done() and starting.exception() is not None:
            self.broadcast(StartFailed(describe(starting.exception())))  # type: ignore[arg-type]
            code = 1
        elif starting.done():
            gc.collect()
            gc.freeze()  # the loaded model's objects: never walked again by a full collection (as vLLM's core)
            self.watch_engine(loop)
            self.ready = Ready(self.backend.info(), self.backend.dtype(), self.figures())
            self.broadcast(self.ready)
            receiving = spawner.receiver
            await asyncio.wait({stopping, receiving}, return_when=asyncio.FIRST_COMPLETED)  # told to, or broken
            if receiving.done() and not receiving.cancelled() and receiving.exception() is not None:
                log.error("engine worker: its receive loop failed: %s", describe(receiving.exception()))  # type: ignore[arg-type]
                code = 1
        for task in (beating, starting, accepting):
            if task is not None:
                task.cancel()
        for peer in self.peers:
            for task in peer.streams.values():
                task.cancel()
        with contextlib.suppress(Exception):
            await self.backend.aclose()
        self.flush()
        for peer in self.peers:
            peer.close(linger=2000)  # what is queued (a StartFailed, the last events) still goes out
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
