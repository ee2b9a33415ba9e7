"""Every rollout this gateway routes by: read from the store each tick (so replicas agree on the weights),
observed (each finished request and mirrored pair lands in this replica's window of the current step, which
is stored), and decided by the one replica holding the lease, which merges every replica's window."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

from gateway.config import ConfigError, GatewayConfig, ModelConfig, WeightedRoute, primary_routes, state_directory
from gateway.rollout.config_file import promote_in_file
from gateway.rollout.pairs import add_pair
from gateway.rollout.rollout import Rollout, RolloutConflict
from gateway.rollout.spec import RolloutSpec
from gateway.rollout.store import RolloutStore
from gateway.rollout.window import Window
from gateway.store.database import check_schema, connect, migrate
from gateway.telemetry.metrics import counter, gauge
from gateway.telemetry.record import RequestRecord

log = logging.getLogger("llmgw")
TICK = 0.5  # seconds between reads of the store: how soon a follower takes the leader's new weights
LEASE_TTL = 5.0  # a leader that stops renewing is replaced after this long


class RolloutError(Exception):
    """A request the rollout API refuses (a 4xx): `status` 400, 404 or 409."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def database_url(config: GatewayConfig) -> str:
    """The state database with [state]; else a SQLite file of its own in the state directory."""
    if config.state is not None:
        return config.state.resolved_database()
    return f"sqlite:///{state_directory() / 'rollouts.db'}"


class RolloutManager:
    def __init__(self, config: GatewayConfig, config_path: Path | None = None,
                 reload: Callable[[], Awaitable[Any]] | None = None, replica: str | None = None) -> None:
        self.config = config
        self.config_path = config_path
        self.reload = reload  # applies the config file once a promotion was written into it
        self.url = database_url(config)
        self.replica = replica or f"{socket.gethostname()}:{os.getpid()}:{random.getrandbits(24):06x}"
        self.store: RolloutStore | None = None
        self.rollouts: dict[str, Rollout] = {}
        self.versions: dict[str, int] = {}
        self.windows: dict[str, tuple[int, Window]] = {}  # this replica's, by model: (epoch, window)
        self.changed: set[str] = set()  # models whose window has news to store
        self.leading = False
        self.decided: list[tuple[str, str]] = []  # (model, action) of each decision this replica made
        self.promoted: list[tuple[str, str]] = []  # (model, candidate) to write into the config file
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    # lifecycle

    async def open(self) -> None:
        """Read the rollouts in progress (another replica may start one at any time) and start those the
        config declares. A store that cannot be opened stops the start only if the config declares one."""
        try:
            await self._connect()
        except Exception as exc:
            if any(m.rollout is not None for m in self.config.models.values()):
                raise
            log.warning("rollouts: %s cannot be opened (%s); rollouts are off until it can", self.url, exc)
            return
        await self._seed_from_config()

    async def _connect(self) -> RolloutStore:
        if self.store is None:
            engine = connect(self.url)
            if self.config.state is None or self.config.state.auto_migrate:
                await migrate(engine)
            else:
                await check_schema(engine)
            self.store = RolloutStore(engine)
            await self.tick()
            self._task = asyncio.create_task(self._loop())
        return self.store

    async def _seed_from_config(self) -> None:
        """A rollout declared in config starts unless this model already had one to that candidate."""
        for name, model in self.config.models.items():
            if model.rollout is None:
                continue
            current = self.rollouts.get(name)
            if model.backend == model.rollout.candidate:
                continue  # promoted already
            if current is not None and current.spec.candidate == model.rollout.candidate:
                continue
            with contextlib.suppress(RolloutError):
                await self.start(name, model.rollout, by="config")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.store is not None:
            with contextlib.suppress(Exception):
                await self._save_windows()
                if self.leading:
                    await self.store.resign(self.replica)
            await self.store.engine.dispose()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(TICK)
            try:
                await self.tick()
            except Exception as exc:  # the store is down: keep routing by the last weights read
                log.warning("rollouts: the store did not answer (%s); routing by the last weights read", exc)

    async def tick(self) -> None:
        assert self.store is not None
        async with self._lock:
            self._take(await self.store.load())
            await self._save_windows()
            await self._write_promotions()
            active = [r for r in self.rollouts.values() if r.active]
            self.leading = bool(active) and await self.store.lead(self.replica, LEASE_TTL)
            if self.leading:
                now = time.time()
                for rollout in active:
                    if rollout.due(now):
                        await self._look(rollout, now)

    async def _write_promotions(self) -> None:
        while self.promoted:
            model, candidate = self.promoted.pop()
            current = self.config.models.get(model)
            if current is None or current.backend == candidate or self.config_path is None:
                continue
            if promote_in_file(self.config_path, model, candidate) and self.reload is not None:
                try:
                    await self.reload()
                except ConfigError as exc:
                    log.warning("rollout of %s: the promoted config did not load: %s", model, exc)

    def _take(self, stored: dict[str, tuple[int, dict[str, Any]]]) -> None:
        for model, (version, doc) in stored.items():
            if model not in self.config.models:  # another gateway's model, sharing the database
                continue
            if self.versions.get(model) != version:
                self.rollouts[model], self.versions[model] = Rollout.from_doc(doc), version
                if self.rollouts[model].state == "promoted":
                    self.promoted.append((model, self.rollouts[model].spec.candidate))

    async def _save_windows(self) -> None:
        assert self.store is not None
        for model in list(self.changed):
            self.changed.discard(model)
            epoch, window = self.windows[model]
            await self.store.save_window(model, self.replica, epoch, window.to_json())

    async def _look(self, rollout: Rollout, now: float) -> None:
        assert self.store is not None
        merged = Window()
        for doc in (await self.store.windows(rollout.model, rollout.epoch)).values():
            merged.merge(Window.from_json(doc))
        if not rollout.worth_a_look(merged, now):
            rollout.last_look = now
            return
        decision = rollout.look(merged, now)
        if decision is None:
            await self._write(rollout)
            return
        action, reason = decision
        gates = rollout.gates  # the figures it is taken on (a new step starts with none)
        rollout.apply(action, now)
        if await self._write(rollout):
            await self._log(rollout, action, reason, f"leader {self.replica}", now, gates)
            log.warning("rollout of %s: %s (%s)", rollout.model, action, reason)

    async def _write(self, rollout: Rollout) -> bool:
        """Store it unless someone else wrote first (an operator's action): then take theirs next tick."""
        assert self.store is not None
        version = await self.store.put(rollout.model, rollout.to_doc(), self.versions.get(rollout.model))
        if version is None:
            self.versions.pop(rollout.model, None)  # re-read it
            return False
        self.versions[rollout.model] = version
        if rollout.state == "promoted":
            self.promoted.append((rollout.model, rollout.spec.candidate))
        return True

    async def _log(self, rollout: Rollout, action: str, reason: str, by: str, now: float,
                   gates: list[dict[str, Any]]) -> None:
        assert self.store is not None
        self.decided.append((rollout.model, action))
        await self.store.log(rollout.model, rollout.decision(action, reason, by, now, gates))

    # routing reads these once per request

    def routes_for(self, name: str, model: ModelConfig) -> list[WeightedRoute] | None:
        rollout = self.rollouts.get(name)
        if rollout is None or not (rollout.active or rollout.state == "promoted"):
            return None
        if rollout.state == "promoted":
            return None if model.backend == rollout.spec.candidate else [WeightedRoute(rollout.spec.candidate)]
        w = rollout.weight
        return [WeightedRoute(rollout.baseline, 100 - w), WeightedRoute(rollout.spec.candidate, w)] if w else None

    def mirror_for(self, name: str, chosen: str) -> tuple[str, float] | None:
        """(candidate, share of requests to mirror) for a request the baseline serves."""
        rollout = self.rollouts.get(name)
        if rollout is None or rollout.state not in ("shadow", "running") or chosen != rollout.baseline:
            return None
        return rollout.spec.candidate, 1.0 if rollout.state == "shadow" else rollout.spec.mirror_sample

    # observations

    def _window(self, model: str) -> tuple[Rollout, Window] | None:
        rollout = self.rollouts.get(model)
        if rollout is None or rollout.state not in ("shadow", "running"):
            return None
        epoch, window = self.windows.get(model, (-1, None))  # type: ignore[arg-type]
        if epoch != rollout.epoch or window is None:
            window = Window()
            self.windows[model] = (rollout.epoch, window)
        self.changed.add(model)
        return rollout, window

    def observe(self, rec: RequestRecord) -> None:
        """A finished request, counted for its side if it was routed to either."""
        if rec.model not in self.rollouts or not rec.routed_backend:
            return
        found = self._window(rec.model)
        if found is None:
            return
        rollout, window = found
        if rec.routed_backend == rollout.baseline:
            window.baseline.observe(rec)
        elif rec.routed_backend == rollout.spec.candidate:
            window.candidate.observe(rec)

    def observe_pair(self, model: str, primary: str, candidate: str, pair: Any) -> None:
        """A mirrored request answered by both (gateway/routing/shadow.py's ShadowPair)."""
        found = self._window(model) if model in self.rollouts else None
        if found is None or (primary, candidate) != (found[0].baseline, found[0].spec.candidate):
            return
        add_pair(found[1], pair)

    # the operator's API

    def get(self, model: str) -> Rollout:
        rollout = self.rollouts.get(model)
        if rollout is None:
            raise RolloutError(f"model `{model}` has no rollout", status=404)
        return rollout

    async def decisions(self, model: str) -> list[dict[str, Any]]:
        self.get(model)
        assert self.store is not None
        return await self.store.decisions(model)

    async def start(self, model: str, spec: RolloutSpec, by: str) -> Rollout:
        store = await self._connect()
        found = self.config.resolve_model(model)
        if found is None:
            raise RolloutError(f"unknown model `{model}`", status=404)
        name, config = found
        routes = primary_routes(config)
        if len(routes) != 1:
            raise RolloutError(f"model `{name}` is split across {len(routes)} backends; a rollout moves a model "
                               "from one backend (`backend = ...`) to another")
        baseline = routes[0].backend
        if spec.candidate not in self.config.backends:
            raise RolloutError(f"candidate: no backend `{spec.candidate}` in [backends]")
        if spec.candidate == baseline:
            raise RolloutError(f"candidate: `{spec.candidate}` already serves `{name}`")
        if problems := spec.problems():
            raise RolloutError("; ".join(problems))
        if not self.config.server.telemetry:
            raise RolloutError("rollouts read each request's figures: turn [server] telemetry back on")
        async with self._lock:
            self._take(await store.load())
            current = self.rollouts.get(name)
            if current is not None and current.active:
                raise RolloutError(f"model `{name}` is already rolling out to `{current.spec.candidate}` "
                                   f"({current.state}); abort it first", status=409)
            rollout = Rollout.begin(name, baseline, spec)
            if current is not None:
                rollout.epoch = current.epoch + 1  # windows of the earlier rollout are not this one's
            if not await self._write(rollout):
                raise RolloutError(f"model `{name}`: another replica changed its rollout just now; retry", 409)
            self.rollouts[name] = rollout
            await self._log(rollout, "start", f"to {spec.candidate} in steps {spec.steps}", by, time.time(), [])
        return rollout

    async def act(self, model: str, action: str, by: str) -> Rollout:
        """pause | resume | promote | abort | step_back, as an operator asks (on any replica)."""
        store = await self._connect()
        async with self._lock:
            for _ in range(5):  # compare and swap against the leader's writes
                self._take(await store.load())
                rollout = self.get(model)
                gates = rollout.gates
                try:
                    rollout.apply(action, time.time())
                except RolloutConflict as exc:
                    raise RolloutError(str(exc), status=409) from None
                if await self._write(rollout):
                    await self._log(rollout, action, f"asked by {by}", by, time.time(), gates)
                    return rollout
            raise RolloutError("the rollout kept changing under this request; retry", status=409)

    def status(self) -> list[Rollout]:
        return list(self.rollouts.values())

    def metrics(self) -> Iterator[Any]:
        """Prometheus families: each rollout's weight, step and gates; the decisions this replica made."""
        rollouts = list(self.rollouts.values())
        yield gauge("llmgw_rollout_weight", "The candidate's share of live traffic, percent", ["model", "candidate"],
                    [([r.model, r.spec.candidate], r.weight) for r in rollouts])
        yield gauge("llmgw_rollout_step", "The rollout's step (0-based; -1 shadow phase)", ["model", "state"],
                    [([r.model, r.state], float(r.step)) for r in rollouts])
        status = {"pass": 0.0, "no_data": 0.0, "inconclusive": 0.5, "fail": 1.0}
        yield gauge("llmgw_rollout_gate", "Each gate at the last look: 0 pass, 0.5 inconclusive, 1 fail",
                    ["model", "gate"], [([r.model, g["name"]], status[g["status"]]) for r in rollouts for g in r.gates])
        yield gauge("llmgw_rollout_leader", "1 on the replica that holds the rollouts' lease", [],
                    [([], float(self.leading))])
        counts: dict[tuple[str, str], int] = {}
        for key in self.decided:
            counts[key] = counts.get(key, 0) + 1
        yield counter("llmgw_rollout_decisions", "Rollout decisions this replica made or was asked for",
                      ["model", "action"], [([m, a], float(n)) for (m, a), n in counts.items()])
