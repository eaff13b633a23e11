"""The coordinator's settings, every one with its unit and default.

Each field's metadata carries its help text and unit; the configuration loader,
``--print-config`` and the README's reference are generated from it, so they
cannot drift apart. Scheduler settings live in ``scheduler.config``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CoordinatorConfig", "LIVE_RELOADABLE"]


def _opt(default, help: str, unit: str = "", choices: tuple[str, ...] | None = None, **kw):
    metadata = {"help": help, "unit": unit}
    if choices:
        metadata["choices"] = choices
    return field(default=default, metadata=metadata, **kw)


@dataclass
class CoordinatorConfig:
    listen: str = _opt("127.0.0.1:50051", "HOST:PORT of the gRPC server; port 0 picks a free one (logged)")
    metrics_listen: str = _opt("", "HOST:PORT of the Prometheus endpoint (GET /metrics); empty = off")
    state_dir: str = _opt("", "directory for durable state (SQLite); empty = in memory only")
    heartbeat_interval_s: float = _opt(10.0, "a node silent this long is UNREACHABLE (no new tasks)", "s")
    remove_after_intervals: int = _opt(3, "heartbeat intervals of silence before a node is REMOVED", "intervals")
    keyframe_interval_s: float = _opt(30.0, "agents send a full keyframe at least this often", "s")
    staleness_s: float = _opt(10.0, "readings older than this are stale; stale nodes are scored by free GPUs only", "s")
    max_message_bytes: int = _opt(4 * 1024 * 1024, "largest gRPC message accepted", "bytes")
    grace_s: float = _opt(5.0, "bound on a graceful stop: in-flight calls get this long", "s")
    signal_window: int = _opt(30, "readings in each signal's rolling anomaly window", "readings")
    ewma_alpha: float = _opt(0.3, "EWMA smoothing factor (weight of the newest reading)")
    iqr_k: float = _opt(1.5, "IQR fence multiplier for the anomaly filter")
    z_max: float = _opt(3.0, "|z| above which a reading is an anomaly")
    persist: int = _opt(3, "anomalies in a row on one side accepted as a real level change", "readings")
    smoothing_tick_s: float = _opt(0.02, "period of the vectorised smoothing pass over rows with new readings", "s")
    dispatch_interval_s: float = _opt(0.5, "period of the dispatch pass besides enqueue/completion/view triggers", "s")
    agent_listen: str = _opt("", "HOST:PORT of a separate mutual-TLS port for agents; empty = agents use listen")
    tls_cert_file: str = _opt("", "PEM server certificate; with tls_key_file turns TLS on for every listener")
    tls_key_file: str = _opt("", "PEM private key of tls_cert_file")
    tls_client_ca_file: str = _opt("", "PEM CA that signs agent client certificates (mutual TLS; CN or SAN = node id)")
    token_file: str = _opt("", "TOML/JSON of bearer-token digests -> role (admin, tenant, agent) and tenant")
    insecure: bool = _opt(False, "run without TLS and/or tokens (lab use); refused unless set, and logged loudly")
    rpc_rate_per_s: float = _opt(0.0, "per-client RPC rate limit; 0 = off", "requests/s")
    rpc_burst: float = _opt(200.0, "per-client RPC burst above rpc_rate_per_s", "requests")
    stream_message_rate_per_s: float = _opt(0.0, "per-stream agent message rate limit; 0 = off", "messages/s")
    stream_message_burst: float = _opt(500.0, "per-stream agent message burst", "messages")
    max_queued_per_tenant: int = _opt(0, "queued tasks a tenant may have at once; 0 = unlimited", "tasks")
    state_synchronous: str = _opt("NORMAL", "SQLite synchronous mode: NORMAL survives process crashes, FULL also power loss")
    finished_retention_s: float = _opt(86400.0, "finished tasks are kept this long for GetTask and idempotent resubmission", "s")
    advisor_interval_s: float = _opt(30.0, "period of the rebalance advisor's evaluation", "s")
    advisor_hook: str = _opt("", "command run with each rebalance plan as JSON on stdin (the operator's executor, e.g. gpulb --coordinator 127.0.0.1:50051 advisor execute --stdin); empty = none")
    advisor_hook_timeout_s: float = _opt(60.0, "the advisor hook is killed after this long", "s")
    event_loop: str = _opt(
        "auto",
        "asyncio event loop: uvloop (libuv; ~15 % less CPU per agent envelope here), asyncio, or auto (uvloop when installed)",
        choices=("auto", "uvloop", "asyncio"),
    )
    gc_gen0_threshold: int = _opt(
        50_000,
        "allocations between young-generation garbage collections; Python's 700 made the collector walk the "
        "coordinator's large long-lived heap ~50 times a second at 2,500 streams, with full passes of ~300 ms; 0 = Python's default",
        "allocations",
    )
    log_level: str = _opt("info", "debug, info, warning or error")
    log_format: str = _opt("auto", "json, console, or auto (console on a terminal)")


#: settings a SIGHUP may change without a restart
LIVE_RELOADABLE = frozenset(
    {"log_level", "staleness_s", "dispatch_interval_s", "heartbeat_interval_s", "remove_after_intervals", "max_queued_per_tenant"}
)
