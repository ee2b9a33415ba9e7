"""Engine workers in processes of their own (issue 18).

- `EngineWorkerBackend(name, settings, replicas=None)`: one worker process running an ordinary in-process
  `EngineBackend`, reached over ZeroMQ with msgspec; implements the `Backend` protocol, plus `load()` (the
  latest `WorkerLoad`: running, waiting, KV blocks, steps), `pid`, `state`, `restarts`, `call(method, *args)`.
  A replica pool builds N of these with `worker_replica(replica_id, settings, index)` (`replicas` on the
  settings sizes each one's CPU thread share).
- `ConfiguredEngine`: what a `type = "engine"` table builds: a worker (`workers = "process"`) or the
  in-process engine (`workers = "thread"`).
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

from backends.engine import EngineBackend, EngineSettings
from backends.engine_worker.attached import AttachedEngineWorker, attaching
from backends.engine_worker.client import EngineWorkerBackend
from backends.engine_worker.messages import StepFigures, WorkerLoad

__all__ = ["ConfiguredEngine", "EngineWorkerBackend", "StepFigures", "WorkerLoad", "worker_replica"]


class ConfiguredEngine:
    """The registry's `engine` type: the settings' `workers` decides which backend class is built."""

    type_name: ClassVar[str] = "engine"
    Settings: ClassVar[type[msgspec.Struct]] = EngineSettings

    def __new__(cls, name: str, settings: EngineSettings) -> Any:  # type: ignore[misc]
        if settings.workers == "process":
            return engine_worker(name, settings)
        return EngineBackend(name, settings)


def worker_replica(replica_id: str, settings: EngineSettings, index: int) -> EngineWorkerBackend:
    """Replica `index` of an engine pool: a worker process with its share of the cores (always a process:
    replicas in one process would share one GIL, the thing the pool's workers are there to avoid)."""
    return engine_worker(replica_id, msgspec.structs.replace(settings, workers="process"))


def engine_worker(name: str, settings: EngineSettings) -> EngineWorkerBackend:
    """A worker this process starts, or, in a front of a multi-process gateway, the supervisor's worker."""
    return AttachedEngineWorker(name, settings) if attaching() else EngineWorkerBackend(name, settings)
