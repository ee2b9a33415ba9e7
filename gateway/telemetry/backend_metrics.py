"""Backends and engines on /metrics: each backend's health, ejection and failed start; each started engine's
scheduler and KV figures (the in-process engine, or an engine worker's latest report) and its worker's restarts,
read at scrape time; and the step histograms, fed by each engine step."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from gateway.serving.fronts import first_front
from gateway.telemetry.metrics import GatewayMetrics, counter, engine_state, gauge

if TYPE_CHECKING:
    from backends.base import Backend
    from gateway.routing.health import HealthTracker


def engines_of(name: str, backend: Any) -> list[tuple[str, Any]]:
    """An engine backend as itself; a pool as its engine workers, each labelled by its replica id
    ("local-worker-0"), so that their step figures and restarts show one by one; others: none."""
    replicas = getattr(backend, "replica_states", None)
    members = [(r.id, r.backend) for r in replicas()] if replicas is not None else [(name, backend)]
    return [(label, b) for label, b in members if hasattr(b, "step_listeners") or hasattr(b, "engine")]


class BackendTelemetry:
    """The gateway's backends (as `backends()` gives them now) on its metrics. `started` and `failed` are the
    gateway's, by id(backend): start() finished, or raised this."""

    def __init__(self, metrics: GatewayMetrics, backends: Callable[[], dict[str, Backend]],
                 started: dict[int, bool], failed: dict[int, str], health: HealthTracker) -> None:
        self.metrics = metrics
        self.backends = backends
        self.started = started
        self.failed = failed
        self.health = health
        metrics.add_state_source(engine_state(self._engines))
        metrics.add_state_source(self._backend_state)
        metrics.add_state_source(self._engine_workers)

    def watch_steps(self, name: str, backend: Backend) -> None:
        """A backend just started: each of its engines' steps feeds the step histograms from now on."""
        for label, member in engines_of(name, backend):
            engine = getattr(member, "engine", None)
            if engine is not None and hasattr(engine, "step_listeners"):
                engine.step_listeners.append(self._step_observer(label))
                engine.abort_listeners.append(self.metrics.abort_seconds.labels(label).observe)
            elif hasattr(member, "step_listeners") and first_front():  # a worker: its steps' figures over IPC,
                member.step_listeners.append(self._step_observer(label))  # counted by one front of several

    def _engine_members(self, started_only: bool = False) -> list[tuple[str, Any]]:
        """Every engine backend and every engine worker of a pool, by its metrics label."""
        return [member for name, b in self.backends().items() if not started_only or self.started.get(id(b))
                for member in engines_of(name, b)]

    def _engines(self) -> dict[str, Any]:
        """Each started engine's figures: the in-process LLMEngine, or an engine worker's latest report."""
        return {label: b.figures() if hasattr(b, "figures") else getattr(getattr(b, "engine", None), "engine", None)
                for label, b in self._engine_members(started_only=True)}

    def _engine_workers(self) -> Iterator[Any]:
        workers = [(n, b) for n, b in self._engine_members() if hasattr(b, "restarts")]
        yield counter("llmgw_engine_worker_restarts", "Engine worker processes that died and were started again",
                      ["backend"], [([n], b.restarts) for n, b in workers])
        yield gauge("llmgw_engine_worker_up", "1 while the engine worker process serves", ["backend"],
                    [([n], float(b.state == "ready")) for n, b in workers])
        yield gauge("llmgw_engine_worker_pid", "The process id of the engine worker serving now", ["backend"],
                    [([n], b.pid) for n, b in workers if b.pid is not None])

    def _step_observer(self, name: str) -> Callable[[Any], None]:
        batch = self.metrics.engine_batch.labels(name)
        tokens = self.metrics.engine_tokens.labels(name)
        seconds = self.metrics.engine_step.labels(name)

        def observe(llm: Any) -> None:  # runs in the engine thread, after each step
            step = llm.last_step
            if step is not None:
                batch.observe(step.num_seqs)
                tokens.observe(step.num_tokens)
                seconds.observe(step.seconds)
            if self.metrics.tgi is not None:
                self.metrics.tgi.batch_size = len(llm.scheduler.running)
                self.metrics.tgi.queue_size = len(llm.scheduler.waiting)

        return observe

    def _backend_state(self) -> Iterator[Any]:
        backends = self.backends().items()
        yield gauge("llmgw_backend_healthy", "1 when the backend passes its health checks and is not ejected",
                    ["backend"], [([n], float(bool(self.started.get(id(b))) and self.health.describe(n) == "healthy"))
                                  for n, b in backends])
        yield gauge("llmgw_backend_circuit_open", "1 while passive ejection keeps the backend out", ["backend"],
                    [([n], float(self.health.describe(n) == "ejected")) for n, _ in backends])
        yield gauge("llmgw_backend_failed", "1 when the backend failed to start (/health says why)", ["backend"],
                    [([n], float(id(b) in self.failed)) for n, b in backends])
