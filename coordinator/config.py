"""The coordinator's settings, every one with its unit and default."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CoordinatorConfig"]


@dataclass
class CoordinatorConfig:
    listen: str = "127.0.0.1:50051"  # HOST:PORT of the gRPC server; port 0 picks a free one
    metrics_listen: str = ""  # HOST:PORT of the Prometheus endpoint; empty = off
    heartbeat_interval_s: float = 10.0  # s; a node silent this long is UNREACHABLE
    remove_after_intervals: int = 3  # heartbeat intervals of silence before REMOVED
    keyframe_interval_s: float = 30.0  # s; agents send a keyframe at least this often
    staleness_s: float = 10.0  # s; readings older than this are stale
    max_message_bytes: int = 4 * 1024 * 1024  # bytes; largest gRPC message accepted
    grace_s: float = 5.0  # s; graceful stop bound
