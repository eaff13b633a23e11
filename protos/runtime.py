"""Process plumbing shared by both daemons and the CLI: structured logging.

Services log JSON lines (one event per line, for journald and log shippers);
a terminal gets structlog's readable console renderer.
"""

from __future__ import annotations

import logging
import sys

import structlog

__all__ = ["configure_logging", "LOG_LEVELS"]

LOG_LEVELS = ("debug", "info", "warning", "error")


def configure_logging(level: str = "info", fmt: str = "auto", stream=None) -> None:
    """Configure structlog once per process.

    ``fmt`` is ``json``, ``console`` or ``auto`` (console when ``stream`` is a
    terminal, JSON otherwise, which is what systemd gives a service).
    """
    stream = stream or sys.stderr
    if level not in LOG_LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LOG_LEVELS)}, not {level!r}")
    if fmt == "auto":
        fmt = "console" if getattr(stream, "isatty", lambda: False)() else "json"
    renderer = (
        structlog.dev.ConsoleRenderer(colors=False)
        if fmt == "console"
        else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
