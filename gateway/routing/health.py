"""Backend health: the results of active checks (run by the gateway), and passive ejection (a
circuit opens after N consecutive failures, for a cool-down; then requests may try it again)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

log = logging.getLogger("llmgw")


@dataclass
class BackendState:
    consecutive_failures: int = 0
    open_until: float = 0.0  # circuit open (ejected) until this monotonic time
    check_failed: bool = False  # the last active health check failed


class HealthTracker:
    def __init__(self, eject_after: int, cooldown: float) -> None:
        self.eject_after = max(1, eject_after)
        self.cooldown = cooldown
        self.states: dict[str, BackendState] = {}

    def _state(self, name: str) -> BackendState:
        return self.states.setdefault(name, BackendState())

    def available(self, name: str) -> bool:
        state = self._state(name)
        return not state.check_failed and time.monotonic() >= state.open_until

    def record_success(self, name: str) -> None:
        state = self._state(name)
        state.consecutive_failures = 0
        state.open_until = 0.0

    def record_failure(self, name: str) -> None:
        state = self._state(name)
        state.consecutive_failures += 1
        if state.consecutive_failures >= self.eject_after:
            state.open_until = time.monotonic() + self.cooldown
            log.warning("backend %s ejected for %.0f s after %d consecutive failures", name, self.cooldown,
                        state.consecutive_failures)

    def record_check(self, name: str, healthy: bool) -> None:
        state = self._state(name)
        if healthy and state.check_failed:
            log.info("backend %s passes its health check again", name)
        state.check_failed = not healthy

    def describe(self, name: str) -> str:
        state = self._state(name)
        if state.check_failed:
            return "unhealthy"
        return "ejected" if time.monotonic() < state.open_until else "healthy"
