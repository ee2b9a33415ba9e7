"""The gateway's running state: config snapshot, backends, router and the concurrency limit."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator

from backends.base import Backend
from backends.registry import get_backend_class
from gateway.config import GatewayConfig
from gateway.errors import GatewayError
from gateway.router import Router

log = logging.getLogger("llmgw")


class Gateway:
    def __init__(self, config: GatewayConfig, backends: dict[str, Backend] | None = None) -> None:
        self.config = config
        self.backends = backends if backends is not None else build_backends(config)
        self.router = Router(config, self.backends)
        self.in_flight = 0
        self._started: dict[str, bool] = {name: False for name in self.backends}
        self._start_tasks: list[asyncio.Task[None]] = []

    def start_backends(self) -> None:
        """Start every backend in the background; the server answers (503 on /health) meanwhile."""
        for name, backend in self.backends.items():
            self._start_tasks.append(asyncio.create_task(self._start(name, backend)))

    async def _start(self, name: str, backend: Backend) -> None:
        try:
            await backend.start()
            self._started[name] = True
            log.info("backend %s (%s) is ready", name, backend.type_name)
        except Exception as exc:
            log.error("backend %s failed to start: %s: %s", name, type(exc).__name__, exc)

    async def wait_started(self) -> None:
        await asyncio.gather(*self._start_tasks, return_exceptions=True)

    async def healthy(self) -> bool:
        for name, backend in self.backends.items():
            if not self._started[name] or not await backend.health():
                return False
        return True

    async def aclose(self) -> None:
        for task in self._start_tasks:
            task.cancel()
        for backend in self.backends.values():
            with contextlib.suppress(Exception):
                await backend.aclose()

    @contextlib.contextmanager
    def admit(self) -> Iterator[None]:
        """TGI's semaphore: over `max_concurrent_requests` a request fails at once with 429."""
        if self.in_flight >= self.config.server.max_concurrent_requests:
            raise GatewayError("Model is overloaded", kind="overloaded")
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1


def build_backends(config: GatewayConfig) -> dict[str, Backend]:
    return {name: get_backend_class(entry.type)(name, entry.settings) for name, entry in config.backends.items()}
