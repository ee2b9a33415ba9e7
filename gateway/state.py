"""The gateway's running state: the active config snapshot (config, backends, router), health,
shadow statistics, the concurrency limit, and hot reload.

A reload validates a whole new config, starts and health-checks new backends, then swaps the
snapshot in one assignment; requests in flight keep the backends they started on, backends left
out are closed once idle, and a backend whose settings did not change is kept (no model reload).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backends.base import Backend
from backends.pool.build import make_backend
from gateway.config import ConfigError, GatewayConfig, parse_config, primary_routes
from gateway.errors import GatewayError
from gateway.policy.accounts import Accounts
from gateway.policy.auth import KeyRing
from gateway.rollout.manager import RolloutManager
from gateway.routing.admission import Admission, ModelGate
from gateway.routing.health import HealthTracker
from gateway.routing.router import ModelRoute, Router
from gateway.routing.shadow import ShadowRecorder
from gateway.serving.front_feed import front_feed
from gateway.serving.fronts import front
from gateway.telemetry.backend_metrics import BackendTelemetry
from gateway.telemetry.key_metrics import store_state
from gateway.telemetry.metrics import GatewayMetrics
from gateway.telemetry.pool_metrics import PoolTelemetry, pool_state
from gateway.telemetry.record import RequestRecord
from gateway.telemetry.tracing import Tracing

log = logging.getLogger("llmgw")
START_TIMEOUT = 600.0  # a new backend must be up within this long for a reload to go ahead
RETIRE_GRACE = 5.0  # requests routed just before a swap may still be validating: wait before closing


@dataclass(frozen=True)
class Snapshot:
    config: GatewayConfig
    backends: dict[str, Backend]
    router: Router


class Gateway:
    def __init__(self, config: GatewayConfig, backends: dict[str, Backend] | None = None,
                 config_path: str | Path | None = None, tracer_provider: Any = None) -> None:
        server = config.server
        self.health = HealthTracker(server.eject_after_failures, server.eject_cooldown)
        self.started: dict[int, bool] = {}  # by id(backend): start() has finished
        self.failed: dict[int, str] = {}  # by id(backend): start() raised this (the reason /health gives)
        backends = backends if backends is not None else build_backends(config)
        self.config_path = Path(config_path) if config_path else None
        self.rollouts = RolloutManager(config, self.config_path, self.reload)
        self.snapshot = Snapshot(config, backends, Router(config, backends, self.health, failed=self.failed,
                                                          rollouts=self.rollouts))
        self.metrics = GatewayMetrics(tgi_compatible=server.tgi_metrics,
                                      per_key_series=server.max_key_series if server.metrics_per_key else 0)
        self.backend_telemetry = BackendTelemetry(self.metrics, lambda: self.backends, self.started, self.failed,
                                                  self.health)
        self.pool_telemetry = PoolTelemetry(self.metrics)
        self.front_feed = front_feed(lambda: self.backends)  # one front of several: pools share choices and health
        self.metrics.add_state_source(pool_state(lambda: self.backends))
        self.tracing = Tracing(server.traces, tracer_provider)
        self.shadows = ShadowRecorder(self.metrics)
        self.request_observers: list[Callable[[RequestRecord], None]] = [self.rollouts.observe]  # telemetry on
        self.shadows.pair_observers.append(self.rollouts.observe_pair)
        self.metrics.add_state_source(self.rollouts.metrics)
        self._in_flight = [0]  # shared with each Admission, which gives its place back
        self.gates: dict[str, ModelGate] = {}
        self.draining = False
        self.accounts = Accounts(config)
        self.metrics.add_state_source(store_state(self.accounts.status, self.accounts.quota.limiter.status))
        self.users: dict[int, int] = {}  # by id(backend): requests generating on it now
        self._tasks: list[asyncio.Task[None]] = []
        self._starting: list[asyncio.Task[bool]] = []
        self._reload_lock: asyncio.Lock | None = None

    # the active snapshot; read once per request

    @property
    def config(self) -> GatewayConfig:
        return self.snapshot.config

    @property
    def router(self) -> Router:
        return self.snapshot.router

    @property
    def backends(self) -> dict[str, Backend]:
        return self.snapshot.backends

    @property
    def keys(self) -> KeyRing:
        return self.accounts.keys

    # lifecycle

    def start_backends(self) -> None:
        """Start every backend in the background; the server answers (503 on /health) meanwhile."""
        if self.front_feed is not None:
            self.front_feed.start()
        self._starting = [asyncio.create_task(self._start(name, backend)) for name, backend in self.backends.items()]
        self._tasks.extend(self._starting)
        interval = self.config.server.health_check_interval
        self._tasks.append(asyncio.create_task(self._check_health(interval)))
        if self.config.server.watch_config and self.config_path and front() is None:  # else the supervisor's
            self._tasks.append(asyncio.create_task(self._watch_file()))

    async def backends_started(self, timeout: float) -> None:
        """Until every backend has started or failed, `timeout` s at most."""
        if self._starting:
            await asyncio.wait(self._starting, timeout=timeout)

    async def _start(self, name: str, backend: Backend) -> bool:
        observers = getattr(backend, "observers", None)
        if observers is not None:  # a pool: per-replica metrics and the balancer's choice in the access log
            observers.append(self.pool_telemetry)
            if self.front_feed is not None:  # its choices and replica health shared with the other fronts
                self.front_feed.watch(name, backend)
        try:
            await backend.start()
        except Exception as exc:
            log.error("backend %s failed to start: %s: %s", name, type(exc).__name__, exc)
            # it is not retried: /health, /admin/backends, the metrics and its requests say why until a reload
            # replaces it (a worker's reason already names the engine's exception: "ModelLoadError: ...")
            self.failed[id(backend)] = str(exc) or type(exc).__name__
            return False
        self.started[id(backend)] = True
        self.backend_telemetry.watch_steps(name, backend)
        healthy = False
        with contextlib.suppress(Exception):
            healthy = await backend.health()
        self.health.record_check(name, healthy)
        log.info("backend %s (%s) started; healthy: %s", name, backend.type_name, healthy)
        return healthy

    async def _check_health(self, interval: float) -> None:
        """Active health checks: every started backend of the active snapshot, every `interval` s."""
        while True:
            await asyncio.sleep(interval)
            for name, backend in self.snapshot.backends.items():
                if not self.started.get(id(backend)):
                    continue
                healthy = False
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(max(1.0, interval / 2)):
                        healthy = await backend.health()
                self.health.record_check(name, healthy)

    def healthy(self) -> bool:
        """Ready when every model has at least one started backend that is not ejected, and not draining
        (a backend whose start failed never started: a model served only by failed ones keeps this False)."""
        if self.draining:
            return False
        snapshot = self.snapshot
        for model in snapshot.config.models.values():
            names = [r.backend for r in primary_routes(model)] + list(model.fallback)
            if not any(self.started.get(id(snapshot.backends[n])) and self.health.available(n) for n in names):
                return False
        return True

    def backend_states(self) -> dict[str, str]:
        """Each backend's state in words, for /health's 503 body: a starting one says which step it is in,
        a failed one why ("failed: ModelLoadError: ...")."""
        states = {}
        for name, backend in self.snapshot.backends.items():
            if (reason := self.failed.get(id(backend))) is not None:
                states[name] = f"failed: {reason}"
            elif not self.started.get(id(backend)):
                step = getattr(backend, "startup_step", lambda: None)()
                states[name] = f"starting: {step}" if step else "starting"
            else:
                states[name] = self.health.describe(name)
                if (worker := _worker_note(backend)) is not None:
                    states[name] += f"; {worker}"
                replicas = getattr(backend, "replica_states", None)
                if replicas is not None:  # a pool: how many of its replicas serve, and what the others do
                    serving = [r for r in replicas() if r.state() == "healthy"]
                    others = [f"{r.id} {_replica_state(r)}" for r in replicas() if r not in serving]
                    states[name] += f" ({len(serving)}/{len(replicas())} replicas healthy" + \
                        "".join(f"; {o}" for o in others) + ")"
                if (role_of := getattr(backend, "role_of", None)) is not None:  # prefill/decode: who does what
                    states[name] += "; roles: " + ", ".join(f"{r.id} {role_of(r.id)}" for r in replicas())
        return states

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in list(self.shadows.tasks):
            task.cancel()
        for backend in self.backends.values():
            with contextlib.suppress(Exception):
                await backend.aclose()
        await self.rollouts.aclose()
        await self.accounts.aclose()
        if self.front_feed is not None:
            self.front_feed.close()

    # requests

    @property
    def in_flight(self) -> int:
        return self._in_flight[0]

    async def enter(self, route: ModelRoute) -> Admission:
        """Refused with 503 while draining; over the server's `max_concurrent_requests`, 429 at once (as
        TGI); then the model's own limit, where a request may wait in a bounded queue."""
        if self.draining:
            raise GatewayError("the server is shutting down", kind="unavailable", code="shutting_down")
        if self._in_flight[0] >= self.config.server.max_concurrent_requests:
            raise GatewayError("Model is overloaded", kind="overloaded")
        self._in_flight[0] += 1
        gate = self._gate(route)
        admission = Admission(self._in_flight, None)
        try:
            if gate is not None:
                await gate.acquire()
                admission.gate = gate
        except BaseException:
            admission.release()
            raise
        return admission

    def _gate(self, route: ModelRoute) -> ModelGate | None:
        model = route.config
        if model.max_concurrent_requests is None:
            return None
        settings = (model.max_concurrent_requests, model.max_queued_requests, model.max_queue_wait)
        gate = self.gates.get(route.name)
        if gate is None or not gate.same_settings(*settings):  # new after a reload; the old one drains
            gate = self.gates[route.name] = ModelGate(*settings)
        return gate

    @contextlib.asynccontextmanager
    async def admit(self, route: ModelRoute) -> AsyncIterator[None]:
        admission = await self.enter(route)
        try:
            yield
        finally:
            admission.release()

    # graceful shutdown

    def begin_drain(self) -> None:
        """From now on /health says 503 and new requests get 503; those in flight go on."""
        self.draining = True
        log.info("draining: %d request(s) in flight", self.in_flight)

    async def wait_idle(self, timeout: float) -> bool:
        """True when every request in flight finished within `timeout` seconds."""
        deadline = asyncio.get_running_loop().time() + timeout
        while self.in_flight > 0 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        return self.in_flight == 0

    def acquire(self, backend: Backend) -> None:
        self.users[id(backend)] = self.users.get(id(backend), 0) + 1

    def release(self, backend: Backend) -> None:
        self.users[id(backend)] -= 1

    # hot reload

    async def reload(self, text: str | None = None) -> GatewayConfig:
        """Validate and apply a new config (the file's, unless `text` is given). Raises ConfigError,
        changing nothing, when the config is bad or a new backend does not come up healthy."""
        if self._reload_lock is None:
            self._reload_lock = asyncio.Lock()
        async with self._reload_lock:
            if text is None:
                if self.config_path is None:
                    raise ConfigError("no config file to reload from")
                try:
                    text = self.config_path.read_text()
                except OSError as exc:
                    raise ConfigError(f"{self.config_path}: cannot read: {exc.strerror or exc}") from None
            new = parse_config(text, str(self.config_path or "<reload>"))
            old = self.snapshot
            if new.version == old.config.version:
                return old.config
            if new.state != old.config.state:
                raise ConfigError("state: the [state] table changes only with a restart; "
                                  "the active config is unchanged")
            backends: dict[str, Backend] = {}
            fresh: dict[str, Backend] = {}
            for name, entry in new.backends.items():
                if old.config.backends.get(name) == entry and name in old.backends:
                    backends[name] = old.backends[name]  # unchanged: keep it (an engine stays loaded)
                else:
                    backends[name] = fresh[name] = make_backend(name, entry.type, entry.settings)
                    carry_over = getattr(backends[name], "carry_over", None)
                    if carry_over is not None and name in old.backends:  # a pool keeps its unchanged replicas
                        carry_over(old.backends[name])
            await self._start_fresh(fresh)
            self.health.eject_after = max(1, new.server.eject_after_failures)
            self.health.cooldown = new.server.eject_cooldown
            self.accounts.reconfigure(new)
            self.rollouts.config = new
            self.snapshot = Snapshot(new, backends, Router(new, backends, self.health, failed=self.failed,
                                                           rollouts=self.rollouts))
            kept = {id(b) for b in backends.values()}
            for backend in old.backends.values():
                if id(backend) not in kept:
                    self._tasks.append(asyncio.create_task(self._retire(backend)))
            log.info("config %s is active (was %s)", new.version, old.config.version)
            return new

    async def _start_fresh(self, fresh: dict[str, Backend]) -> None:
        try:
            async with asyncio.timeout(START_TIMEOUT):
                results = await asyncio.gather(*(self._start(n, b) for n, b in fresh.items()))
        except TimeoutError:
            results = [False] * len(fresh)
        failed = [name for name, ok in zip(fresh, results) if not ok]
        if failed:
            reason = self.failed.get(id(fresh[failed[0]]))
            for backend in fresh.values():
                self.failed.pop(id(backend), None)  # never active: nothing to report (and its id may be reused)
                with contextlib.suppress(Exception):
                    await backend.aclose()
            why = f"failed to start: {reason}" if reason else "did not start healthy"
            raise ConfigError(f"backends.{failed[0]}: {why}; the active config is unchanged")

    async def _retire(self, backend: Backend) -> None:
        await asyncio.sleep(RETIRE_GRACE)
        while self.users.get(id(backend), 0) > 0:
            await asyncio.sleep(0.1)
        with contextlib.suppress(Exception):
            await backend.aclose()
        self.started.pop(id(backend), None)
        self.failed.pop(id(backend), None)

    async def _watch_file(self) -> None:
        assert self.config_path is not None
        last = self.config_path.stat().st_mtime_ns if self.config_path.exists() else 0
        while True:
            await asyncio.sleep(1.0)
            with contextlib.suppress(OSError):
                mtime = self.config_path.stat().st_mtime_ns
                if mtime != last:
                    last = mtime
                    try:
                        await self.reload()
                    except ConfigError as exc:
                        log.error("config reload refused: %s", exc)


def build_backends(config: GatewayConfig) -> dict[str, Backend]:
    return {name: make_backend(name, entry.type, entry.settings) for name, entry in config.backends.items()}


def _worker_note(backend: Any) -> str | None:
    """An engine worker that is not ready, in words ("engine worker restarting (restart 1; ...)"); else None."""
    worker = getattr(backend, "describe_state", None)
    return f"engine worker {worker()}" if worker is not None and worker() != "ready" else None


def _replica_state(replica: Any) -> str:
    """A replica that is not serving, in words: its health, and an engine worker's own state."""
    if (worker := _worker_note(replica.backend)) is not None:
        return f"{replica.state()}, {worker}"
    step = getattr(replica.backend, "startup_step", lambda: None)()
    return f"{replica.state()}, starting: {step}" if step else replica.state()
