"""Graceful shutdown: uvicorn's server, with SIGTERM starting a drain instead of an exit.

On SIGTERM the gateway stops being ready (/health 503) and refuses new requests with 503, while
requests in flight go on for up to `server.drain_timeout` seconds; then uvicorn shuts down as usual.
A second SIGTERM, or SIGINT, exits at once (uvicorn's own handling).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

if TYPE_CHECKING:
    from gateway.state import Gateway

log = logging.getLogger("llmgw")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, gateway: Gateway) -> None:
        super().__init__(config)
        self.gateway = gateway
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Future[None] | None = None

    async def serve(self, sockets: list | None = None) -> None:  # type: ignore[override]
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGTERM or self._drain is not None or self._loop is None or not self.started:
            return super().handle_exit(sig, frame)
        self.gateway.begin_drain()
        self._drain = asyncio.run_coroutine_threadsafe(self._drain_then_exit(), self._loop)  # type: ignore[assignment]

    async def _drain_then_exit(self) -> None:
        grace = self.gateway.config.server.drain_timeout
        idle = await self.gateway.wait_idle(grace)
        if idle:
            log.info("drained: every request finished; shutting down")
        else:
            log.warning("drain timeout (%g s) with %d request(s) in flight; shutting down", grace,
                        self.gateway.in_flight)
        self.should_exit = True  # exit code 0: the shutdown was asked for and done
