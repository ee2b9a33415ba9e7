"""The engine's start, step by step: each long step is logged before and after (with its duration),
and the step running now is readable from another thread, so that /health can say what a starting
server is doing instead of a bare 503."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger("llmgw.engine")


class StartupProgress:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._current: tuple[str, float] | None = None
        self.done: list[tuple[str, float]] = []  # (step, seconds), in order

    @contextmanager
    def step(self, name: str) -> Iterator[list[str]]:
        """Log `name ...`, run the block, log `name: done in N s` plus whatever the block appended."""
        log.info("%s ...", name)
        started = time.perf_counter()
        with self._lock:
            self._current = (name, started)
        details: list[str] = []
        try:
            yield details
        finally:
            seconds = time.perf_counter() - started
            with self._lock:
                self._current = None
                self.done.append((name, seconds))
        log.info("%s: done in %.1f s%s", name, seconds, "".join(f"; {d}" for d in details))

    def current(self) -> tuple[str, float] | None:
        """The step running now and for how many seconds, or None."""
        with self._lock:
            if self._current is None:
                return None
            name, started = self._current
        return name, time.perf_counter() - started
