"""structlog setup: JSON lines (the default) or a console format for development."""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(fmt: str = "json", level: int = logging.INFO) -> None:
    renderer = structlog.dev.ConsoleRenderer() if fmt == "console" else structlog.processors.JSONRenderer()
    structlog.configure(
        processors=[structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso", utc=True),
                    renderer],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(sys.stdout),
        cache_logger_on_first_use=True)
