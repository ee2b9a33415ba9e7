"""One engine worker process and the two ZeroMQ sockets the gateway binds for it (a restarted worker
gets a new one, so no message of the old one reaches the new), and how the worker's errors and exit
read on the gateway's side."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
import signal
import tempfile
from collections.abc import Callable

import msgspec
import psutil
import zmq

import backends.base
from backends.base import (
    BackendError,
    BackendOverloadedError,
    BackendTimeoutError,
    BackendUnavailableError,
    BackendValidationError,
    UpstreamError,
)
from backends.engine_worker.messages import Ready, ToWorker, encode_hook

ERRORS: dict[str, type[BackendError]] = {
    "validation": BackendValidationError, "overloaded": BackendOverloadedError,
    "unavailable": BackendUnavailableError, "timeout": BackendTimeoutError, "upstream": UpstreamError}


def backend_error(kind: str, message: str, status: int | None = None, error_class: str | None = None) -> BackendError:
    """The worker's typed error, again: its own class where backends.base defines it, else by kind."""
    cls = getattr(backends.base, error_class or "", None)
    if not (isinstance(cls, type) and issubclass(cls, BackendError)):
        cls = ERRORS.get(kind, UpstreamError)
    return cls(message, status)


def worker_threads(replicas: int) -> int:
    """Each of `replicas` workers on this machine gets an equal share of the cores this process may use."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, replicas))


RUN_DIR_ENV = "LLMGW_ENGINE_RUN_DIR"  # set by the front supervisor (gateway/serving/fronts.py) for its engine workers


def attach_address(name: str) -> str | None:
    """Where the engine worker of backend `name` takes other fronts' Attach messages: a name under the front
    supervisor's run directory, the same in every front; None in a gateway of one process."""
    run_dir = os.environ.get(RUN_DIR_ENV)
    if not run_dir:
        return None
    return f"ipc://{run_dir}/{hashlib.sha1(name.encode()).hexdigest()[:16]}.attach"


def process_alive(pid: int) -> bool:
    """A process of this host still runs (a zombie its parent has not reaped yet counts as gone)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def describe_exit(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


class Connection:
    """One worker process and its two sockets."""

    def __init__(self, context: zmq.Context) -> None:
        self.dir = tempfile.mkdtemp(prefix="llmgw-worker-")
        self.to_worker = f"ipc://{self.dir}/in"
        self.from_worker = f"ipc://{self.dir}/out"
        self.push = zmq.Context.instance().socket(zmq.PUSH)  # a plain socket: a send is done when it returns
        self.push.setsockopt(zmq.SNDHWM, 0)
        self.push.bind(self.to_worker)
        self.pull = context.socket(zmq.PULL)
        self.pull.setsockopt(zmq.RCVHWM, 0)
        self.pull.bind(self.from_worker)
        self.encoder = msgspec.msgpack.Encoder(enc_hook=encode_hook)
        self.process: asyncio.subprocess.Process | None = None
        self.loop = asyncio.get_running_loop()
        self.ready: asyncio.Future[Ready] = self.loop.create_future()
        self.receiving = False
        self.open = True

    def receive(self, handle: Callable[[zmq.Frame], None]) -> None:
        """Call `handle` with each message from the worker, in order, from the event loop. A reader callback
        drains the socket: zmq.asyncio's recv made a future and a dozen option reads per message, and the
        gateway's CPU per streamed token fell from 0.56 to 0.42 ms without it (docs/benchmarks.md). ZeroMQ's
        descriptor is edge-triggered (it says that something changed, not that a message waits), so each
        wake-up reads until nothing is left."""
        pull = self.pull

        def drain() -> None:
            while self.open:
                try:
                    frame = pull.recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    return
                handle(frame)

        self.loop.add_reader(pull.getsockopt(zmq.FD), drain)
        self.receiving = True
        self.loop.call_soon(drain)  # messages queued before the reader was added raised no edge of their own

    def send(self, message: ToWorker) -> None:
        if self.open:  # a PUSH with no high-water mark queues at once: never waits, so safe in a finally
            with contextlib.suppress(zmq.Again):  # no worker connected: it just died, and nobody will read it
                self.push.send(self.encoder.encode(message), flags=zmq.NOBLOCK, copy=False)

    def close(self) -> None:
        self.open = False
        if self.receiving:
            self.loop.remove_reader(self.pull.getsockopt(zmq.FD))
            self.receiving = False
        self.push.close(linger=0)
        self.pull.close(linger=0)
        shutil.rmtree(self.dir, ignore_errors=True)
