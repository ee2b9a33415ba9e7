"""structlog setup: JSON lines (the default) or a console format for development."""

from __future__ import annotations

import logging
import sys

import msgspec
import structlog

_encoder = msgspec.json.Encoder(enc_hook=repr)  # anything msgspec does not know is logged as its repr


def _dumps(event: dict, **_: object) -> str:
    return _encoder.encode(event).decode()


def configure_logging(fmt: str = "json", level: int = logging.INFO) -> None:
    renderer = (structlog.dev.ConsoleRenderer() if fmt == "console"
                else structlog.processors.JSONRenderer(serializer=_dumps))
    structlog.configure(
        processors=[structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso", utc=True),
                    renderer],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(sys.stdout),
        cache_logger_on_first_use=True)
