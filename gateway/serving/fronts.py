"""`[server] workers = N`: one port served by N front processes, as vLLM's `--api-server-count`.

`llmgw serve` becomes a supervisor: it holds the port, starts the engine workers of every engine backend
(each also takes Attach messages at an address under its run directory), and starts N fronts, each an
ordinary gateway process listening on the port with SO_REUSEPORT (the kernel spreads connections evenly).
In a front, engine backends attach to the supervisor's workers instead of starting their own
(backends/engine_worker/attached.py), so the model is loaded once and every front feeds the same batch.

What the fronts share, and how:
- the engine workers (above); a worker that dies is restarted by the supervisor, and every front fails its
  own requests in flight on it and attaches again;
- keys, usage, limits and stored Responses through the `[state]` store, which N > 1 requires; without
  Redis, each front enforces 1/N of every limit and budget (gateway/store/limits.py `share`);
- /metrics: prometheus_client's multiprocess mode (files under the run directory), so any front answers
  with the sum over all fronts, and the engine's figures once;
- reloads (SIGHUP, `/admin/reload` on any front, `watch_config`) go through the supervisor: it starts the
  engine workers the new config adds or changes, then every front reloads; SIGTERM (drain, then exit) is
  passed to every front; a front that dies is started again, and only its requests in flight end in error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

from gateway.config import GatewayConfig

log = logging.getLogger("llmgw")
FRONT_ENV = "LLMGW_FRONT"  # "k/N" in front k of N
RESTARTED_ENV = "LLMGW_FRONT_RESTARTED"  # "1" in a front started again after it died
LISTEN_WAIT = 600.0  # seconds a front waits for its backends (a model loading) before it listens regardless
RESTART_DELAY = 1.0  # seconds before a front that died is started again
STOP_TIMEOUT = 10.0  # seconds past the drain timeout before a front that ignores SIGTERM is killed


def resolved_workers(config: GatewayConfig) -> int:
    workers = config.server.workers
    if workers == "auto":
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return int(workers)


def front() -> tuple[int, int] | None:
    """(k, N) in front k of N; None in a gateway of one process."""
    value = os.environ.get(FRONT_ENV)
    if not value:
        return None
    index, count = value.split("/")
    return int(index), int(count)


def front_count() -> int:
    here = front()
    return here[1] if here is not None else 1


def listens_once_started() -> bool:
    """A front takes connections only once its backends have started (attached to the engine workers), or the
    kernel would hand it clients it answers 503 while another front serves. All but the first start of front 0,
    which listens at once, so that /health says what is loading."""
    here = front()
    return here is not None and (here[0] != 0 or os.environ.get(RESTARTED_ENV) == "1")


def first_front() -> bool:
    """This process reports what every front sees alike once (the engine's step figures)."""
    here = front()
    return here is None or here[0] == 0


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A socket on host:port with SO_REUSEPORT: each front listens on one of its own and the kernel spreads new
    connections over them evenly (one shared socket let whichever front woke first take a whole burst);
    the supervisor's holds the port and never listens, so it takes none. It is returned bound, not listening:
    a front's server listens on it once the app's start-up is done, so no client waits on a front still
    starting."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


class FrontSupervisor:
    def __init__(self, config: GatewayConfig, config_path: str, host: str, port: int, log_level: str) -> None:
        self.config = config
        self.config_path = config_path
        self.count = resolved_workers(config)
        self.log_level = log_level
        self.sock = reuse_port_socket(host, port)
        self.run_dir = Path(tempfile.mkdtemp(prefix="llmgw-fronts-"))
        self.metrics_dir = self.run_dir / "metrics"
        self.metrics_dir.mkdir()
        self.fronts: dict[int, asyncio.subprocess.Process] = {}
        self.engines: dict[str, tuple[Any, asyncio.Task[None]]] = {}  # worker name: its backend, its start
        self.stopping = False

    def run(self) -> int:
        try:
            return asyncio.run(self._main())
        finally:
            self.sock.close()
            shutil.rmtree(self.run_dir, ignore_errors=True)

    async def _main(self) -> int:
        from backends.engine_worker.connection import RUN_DIR_ENV

        os.environ[RUN_DIR_ENV] = str(self.run_dir)  # this process's engine workers take Attach messages there
        await self._migrate()
        await self._adopt(self.config)  # their start goes on in the background: the fronts answer 503 meanwhile
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop, sig, stop)
        loop.add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(self._reload()))
        watching = asyncio.create_task(self._watch()) if self.config.server.watch_config else None
        host, port = self.sock.getsockname()[:2]
        log.info("serving http://%s:%d from %d front processes (pid %d supervises)", host, port, self.count,
                 os.getpid())
        keepers = [asyncio.create_task(self._keep(index)) for index in range(self.count)]
        await stop.wait()
        if watching is not None:
            watching.cancel()
        _, late = await asyncio.wait(keepers, timeout=self.config.server.drain_timeout + STOP_TIMEOUT)
        if late:  # a front that did not end within its drain: killed
            self._signal_fronts(signal.SIGKILL)
            await asyncio.gather(*late, return_exceptions=True)
        await self._adopt(None)
        return 0

    async def _migrate(self) -> None:
        """The state schema upgraded once, here, rather than by N fronts at once; a failure is theirs to report."""
        state = self.config.state
        if state is None or not state.auto_migrate:
            return
        from gateway.store.database import connect, migrate

        engine = connect(state.resolved_database())
        try:
            before, now = await migrate(engine)
            if before != now:
                log.info("state database migrated: %s -> %s", before, now)
        except Exception as exc:  # down, or a schema from the future: each front says so on /health
            log.warning("state database not migrated by the supervisor: %s: %s", type(exc).__name__, exc)
        finally:
            await engine.dispose()

    async def _adopt(self, config: GatewayConfig | None) -> None:
        """Run the engine workers `config` needs: start the new ones, stop those gone or changed (None: all)."""
        wanted = {worker.name: worker for worker in _engine_workers(config)} if config is not None else {}
        for name, (running, starting) in list(self.engines.items()):
            new = wanted.get(name)
            if new is None or new.settings != running.settings:
                del self.engines[name]
                starting.cancel()
                await running.aclose()
        for name, worker in wanted.items():
            if name not in self.engines:
                self.engines[name] = (worker, asyncio.create_task(worker.start()))

    async def _reload(self) -> None:
        """SIGHUP (or `/admin/reload` on any front): new engine workers first, then every front reloads."""
        from gateway.config import ConfigError, load_config

        try:
            config = load_config(self.config_path)
        except ConfigError as exc:
            log.error("reload refused, nothing changed: %s", exc)
            return
        await self._adopt(config)
        self._signal_fronts(signal.SIGHUP)

    async def _watch(self) -> None:
        """`watch_config`: the supervisor looks at the file (a front's own reload could not start a worker)."""
        path = Path(self.config_path)
        last = path.stat().st_mtime_ns
        while True:
            await asyncio.sleep(1.0)
            with contextlib.suppress(OSError):
                if (mtime := path.stat().st_mtime_ns) != last:
                    last = mtime
                    await self._reload()

    def _stop(self, sig: int, stop: asyncio.Event) -> None:
        """SIGTERM: every front drains and exits (a second SIGTERM or SIGINT: at once, as one process)."""
        self.stopping = True
        self._signal_fronts(sig)
        stop.set()

    def _signal_fronts(self, sig: int) -> None:
        for process in self.fronts.values():
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(sig)

    async def _keep(self, index: int) -> None:
        """Front `index`, run and started again whenever it ends, until the gateway stops."""
        from prometheus_client import multiprocess

        restarted = False
        while True:
            process = await self._spawn(index, restarted)
            restarted = True
            self.fronts[index] = process
            code = await process.wait()
            multiprocess.mark_process_dead(process.pid, str(self.metrics_dir))  # its in-flight gauge goes
            if self.stopping:
                return
            log.error("front %d (pid %d) ended with code %d; starting it again", index, process.pid, code)
            await asyncio.sleep(RESTART_DELAY)
            if self.stopping:
                return

    async def _spawn(self, index: int, restarted: bool) -> asyncio.subprocess.Process:
        from backends.engine_worker.attached import ATTACH_ENV
        from backends.engine_worker.connection import RUN_DIR_ENV

        host, port = self.sock.getsockname()[:2]
        env = {**os.environ, FRONT_ENV: f"{index}/{self.count}", ATTACH_ENV: "1", RUN_DIR_ENV: str(self.run_dir),
               "PROMETHEUS_MULTIPROC_DIR": str(self.metrics_dir), RESTARTED_ENV: "1" if restarted else ""}
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway", "serve", "--config", self.config_path, "--host", host, "--port", str(port),
            "--log-level", self.log_level, env=env)


def _engine_workers(config: GatewayConfig) -> list[Any]:
    """The engine worker processes the config's backends run (one per engine backend or pool replica)."""
    from backends.pool.build import engine_workers_of
    from gateway.state import build_backends

    return [worker for backend in build_backends(config).values() for worker in engine_workers_of(backend)]
