"""What crosses between the gateway and an engine worker process: msgspec Structs, msgpack-encoded, one
ZeroMQ message each. Tagged unions, so each side decodes a message with one typed decoder."""

from __future__ import annotations

from pathlib import PurePath
from typing import Any

import msgspec

from backends.base import BackendInfo, GenerationRequest, TokenEvent


def encode_hook(obj: Any) -> Any:
    """What msgpack cannot encode itself but a forwarded call may pass or return."""
    if isinstance(obj, PurePath):
        return str(obj)
    raise NotImplementedError(f"cannot send {type(obj).__name__}")


class StepFigures(msgspec.Struct, frozen=True, array_like=True):
    """One engine step, as the gateway's step metrics observe it (engine_core's StepStats)."""

    num_seqs: int
    num_tokens: int
    seconds: float


class SpecFigures(msgspec.Struct, frozen=True, kw_only=True):
    """Speculative decoding's cumulative counters (engine_core's `SpecCounters`) and its method."""

    method: str  # "ngram", "suffix", "draft_model"
    num_drafts: int = 0  # verify passes that had drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0  # accepted + one per verify pass
    accepted_per_pos: list[int] = []  # [i]: verify passes that accepted at least i + 1 drafts


class WorkerLoad(msgspec.Struct, frozen=True, kw_only=True):
    """A worker's figures, sent with each step's tokens, after aborts and as a heartbeat; what the
    gateway's engine metrics read and what a replica balancer weighs."""

    pid: int
    sent_at: float  # time.monotonic() in the worker (the clock is system-wide): how fresh the figures are
    ready: bool = False  # the engine is loaded and serving
    startup_step: str | None = None  # what a starting engine is doing now (for /health)
    running: int = 0  # sequences in the running batch
    waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    all_blocks_free: bool = True  # every block free with no reference held (the leak check)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    preemptions: int = 0
    total_steps: int = 0
    steps: list[StepFigures] = []  # the steps since the last load message, in order
    adapters: Any = None  # the backend's `adapters()`, where it has that method; None: unchanged (a step's)
    spec: SpecFigures | None = None  # speculative decoding's counters; None: off

    @property
    def kv_usage(self) -> float:
        return (self.kv_blocks_total - self.kv_blocks_free) / self.kv_blocks_total if self.kv_blocks_total else 0.0


# gateway -> worker


class Generate(msgspec.Struct, frozen=True, tag=True):
    stream: int  # the client's id for this request's stream (request ids need not be unique)
    request: GenerationRequest


class Abort(msgspec.Struct, frozen=True, tag=True):
    stream: int


class Call(msgspec.Struct, frozen=True, tag=True):
    """A method of the worker's backend by name (tokenize, load_adapter, ...): the command channel."""

    call: int
    method: str
    args: list[Any] = []


class Shutdown(msgspec.Struct, frozen=True, tag=True):
    pass


ToWorker = Generate | Abort | Call | Shutdown


class Attach(msgspec.Struct, frozen=True, kw_only=True):
    """A gateway front joining a running worker (`[server] workers` > 1), sent to the worker's attach address:
    the worker connects to the two addresses the front bound, answers Ready there and serves the front's
    streams until it says Shutdown or its process is gone (then its streams are aborted)."""

    pid: int
    to_worker: str
    from_worker: str


# worker -> gateway


class Emitted(msgspec.Struct, frozen=True, array_like=True):
    stream: int
    event: TokenEvent


class Tokens(msgspec.Struct, frozen=True, tag=True):
    """Every event produced since the last send (one engine step's worth for all its streams), with the
    figures after that step: read before the events, so a finished stream's blocks show as free."""

    events: list[Emitted]
    load: WorkerLoad | None = None


class Failed(msgspec.Struct, frozen=True, tag=True):
    """A stream ended with a typed backend error (kind as in backends.base: validation, unavailable, ...)."""

    stream: int
    kind: str
    message: str
    status: int | None = None
    error_class: str | None = None  # the BackendError subclass's name (e.g. AdapterInUseError), raised again


class Reply(msgspec.Struct, frozen=True, tag=True):
    call: int
    result: msgspec.Raw = msgspec.Raw(b"\xc0")  # msgpack of the method's return value (nil), decoded by the caller
    error_kind: str | None = None
    error: str | None = None
    error_class: str | None = None


class Ready(msgspec.Struct, frozen=True, tag=True):
    info: BackendInfo
    dtype: tuple[str, str] | None
    load: WorkerLoad


class StartFailed(msgspec.Struct, frozen=True, tag=True):
    error: str  # the start's exception, described


class Load(msgspec.Struct, frozen=True, tag=True):
    load: WorkerLoad


FromWorker = Tokens | Failed | Reply | Ready | StartFailed | Load


class Launch(msgspec.Struct, frozen=True, kw_only=True):
    """The worker's command-line argument: where to connect and what to run."""

    name: str
    settings: Any  # the EngineSettings table, as builtins (the worker decodes it into EngineSettings)
    to_worker: str  # ZeroMQ address the gateway binds and pushes requests to
    from_worker: str  # ZeroMQ address the gateway binds and pulls token streams from
    parent_pid: int  # the worker exits when this process is gone
    attach: str | None = None  # a ZeroMQ address the worker binds for other fronts' Attach messages
