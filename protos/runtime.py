"""Process plumbing shared by both daemons and the CLI: structured logging.

Services log JSON lines (one event per line, for journald and log shippers);
a terminal gets structlog's readable console renderer.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import sys
from pathlib import Path

import structlog

__all__ = ["configure_logging", "LOG_LEVELS", "release"]

LOG_LEVELS = ("debug", "info", "warning", "error")


def configure_logging(level: str = "info", fmt: str = "auto", stream=None) -> None:
    """Configure structlog once per process.

    ``fmt`` is ``json``, ``console`` or ``auto`` (console when ``stream`` is a
    terminal, JSON otherwise, which is what systemd gives a service).
    """
    explicit = stream is not None
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
    _route_stdlib_logging(level, renderer, stream if explicit else None)


class _StdlibToStructlog(logging.StreamHandler):
    """The root logger's handler: what libraries and modules log through the
    standard library (asyncio's "Task exception was never retrieved", grpc's
    Python side, sqlite3 helpers) is rendered as the daemon's own lines are,
    one JSON object per line in a service, instead of Python's bare-message
    fallback (no level, no time: QA pass 24 found such lines inside JSON
    logs). Without a stream of its own it writes to ``sys.stderr`` as it is at
    each record, so a replaced stderr (pytest's capture) is followed."""

    def __init__(self, stream=None) -> None:
        super().__init__(stream)
        self._own_stream = stream is not None

    def emit(self, record: logging.LogRecord) -> None:
        if not self._own_stream:
            self.stream = sys.stderr
        super().emit(record)


def _route_stdlib_logging(level: str, renderer, stream) -> None:
    handler = _StdlibToStructlog(stream)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[
            structlog.stdlib.add_log_level,
            structlog.stdlib.add_logger_name,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
        ],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            renderer,
        ],
    ))
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _StdlibToStructlog)]:
        root.removeHandler(old)  # configured again (a reload's log level): one handler
    root.addHandler(handler)
    # libraries at warning and above (their info is not the operator's); the
    # project's own modules that log through the standard library at the level asked
    wanted = getattr(logging, level.upper())
    root.setLevel(max(wanted, logging.WARNING))
    for package in ("scheduler", "coordinator", "agent", "protos"):
        logging.getLogger(package).setLevel(wanted)


@functools.cache
def release() -> str:
    """This gpulb's release, as agents register it (``agent_version``, in
    ``gpulb nodes`` and ``gpulb_node_info``) and the coordinator exports it
    (``gpulb_coordinator_info``): the package version, and, run from a git
    checkout, its commit (``0.24.0+g1a2b3c4d5e``, a PEP 440 local version),
    so that a rolling upgrade shows which hosts run what even between two
    version bumps (QA pass 24: every commit said 0.1.0)."""
    try:
        version = importlib.metadata.version("gpulb")
    except importlib.metadata.PackageNotFoundError:  # run from a tree not installed
        version = "0+unknown"
    commit = _checkout_commit(Path(__file__).resolve().parents[1] / ".git")
    return f"{version}+g{commit[:10]}" if commit and "+" not in version else version


def _checkout_commit(git: Path) -> str | None:
    """The commit a git checkout's HEAD names, read from its files (no git
    binary on a GPU host, say); None when there is no checkout or it cannot
    be read."""
    try:
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head if len(head) >= 40 else None  # a detached HEAD
        ref = head[5:]
        loose = git / ref
        if loose.is_file():
            return loose.read_text().strip()
        for line in (git / "packed-refs").read_text().splitlines():
            sha, _, name = line.partition(" ")
            if name == ref:
                return sha
    except (OSError, UnicodeDecodeError):
        return None
    return None
