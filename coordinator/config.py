"""The coordinator's settings, every one with its unit and default.

Each field's metadata carries its help text, unit and allowed values (``ge``,
``gt``, ``le``, ``lt`` bounds, ``choices``); the configuration loader checks
them, and ``--print-config`` and the README's reference are generated from
them, so they cannot drift apart. Rules across options are in
``CoordinatorConfig.validate()``. Scheduler settings live in ``scheduler.config``.
"""

from __future__ import annotations

import os
import shlex
import shutil
from dataclasses import dataclass, field

__all__ = ["CoordinatorConfig", "LIVE_RELOADABLE"]

#: the largest value gRPC takes for a message size (a C int)
_INT32_MAX = 2**31 - 1


def _opt(
    default,
    help: str,
    unit: str = "",
    choices: tuple[str, ...] | None = None,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    ignore_case: bool = False,
    **kw,
):
    """A field with its help, unit and allowed values: ``ge``/``gt`` (at least /
    above) and ``le``/``lt`` (at most / below) bounds for numbers, ``choices``
    for strings (``ignore_case``: any spelling, stored as the choice's)."""
    metadata = {"help": help, "unit": unit}
    if choices:
        metadata["choices"] = choices
    if ignore_case:
        metadata["ignore_case"] = True
    for name, bound in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)):
        if bound is not None:
            metadata[name] = bound
    return field(default=default, metadata=metadata, **kw)


@dataclass
class CoordinatorConfig:
    listen: str = _opt("127.0.0.1:50051", "HOST:PORT of the gRPC server; port 0 picks a free one (logged)")
    metrics_listen: str = _opt("", "HOST:PORT of the Prometheus endpoint (GET /metrics); empty = off")
    metrics_max_connections: int = _opt(
        8,
        "metrics connections served at once (a Prometheus server holds one per scrape); more are answered 503 and "
        "closed at once, so unauthenticated clients cannot hold the coordinator's memory or file descriptors",
        "connections",
        ge=1,
        le=10_000,
    )
    metrics_timeout_s: float = _opt(
        10.0,
        "a metrics client has this long to send its request, then this long again to read the whole reply "
        "(Prometheus' default scrape_timeout); past it the connection is closed and its unsent reply dropped",
        "s",
        gt=0,
        le=3600,
    )
    metrics_tls: bool = _opt(
        False,
        "serve metrics_listen over HTTPS with tls_cert_file and tls_key_file (renewed files are served at the next "
        "handshake, as on the gRPC ports); Prometheus then scrapes with scheme https and tls_config.ca_file",
    )
    metrics_auth: str = _opt(
        "none",
        "token: GET /metrics needs 'Authorization: Bearer <token>' with a token_file token of role metrics "
        "(python -m coordinator.security new-token --role metrics) or admin, else 401 / 403; /healthz stays open. "
        "none: anyone who reaches metrics_listen may read it",
        choices=("none", "token"),
        ignore_case=True,
    )
    state_dir: str = _opt("", "directory for durable state (SQLite); empty = in memory only")
    heartbeat_interval_s: float = _opt(10.0, "a node silent this long is UNREACHABLE (no new tasks)", "s", ge=0.1, le=1e6)
    remove_after_intervals: int = _opt(3, "heartbeat intervals of silence before a node is REMOVED", "intervals", ge=1)
    keyframe_interval_s: float = _opt(30.0, "agents send a full keyframe at least this often", "s", ge=0.1, le=1e6)
    staleness_s: float = _opt(10.0, "readings older than this are stale; stale nodes are scored by free GPUs only", "s", gt=0, le=1e6)
    max_message_bytes: int = _opt(4 * 1024 * 1024, "largest gRPC message accepted", "bytes", ge=64 * 1024, le=_INT32_MAX)
    grace_s: float = _opt(5.0, "bound on a graceful stop: in-flight calls get this long", "s", ge=0)
    signal_window: int = _opt(30, "readings in each signal's rolling anomaly window", "readings", ge=5, le=1000)
    ewma_alpha: float = _opt(0.3, "EWMA smoothing factor (weight of the newest reading)", gt=0, le=1)
    iqr_k: float = _opt(1.5, "IQR fence multiplier for the anomaly filter", gt=0)
    z_max: float = _opt(3.0, "|z| above which a reading is an anomaly", gt=0)
    persist: int = _opt(3, "anomalies in a row on one side accepted as a real level change (at most signal_window)", "readings", ge=2)
    smoothing_tick_s: float = _opt(0.02, "period of the vectorised smoothing pass over rows with new readings", "s", ge=0.001, le=1)
    dispatch_interval_s: float = _opt(0.5, "period of the dispatch pass besides enqueue/completion/view triggers", "s", ge=0.001, le=60)
    agent_listen: str = _opt("", "HOST:PORT of a separate mutual-TLS port for agents; empty = agents use listen")
    tls_cert_file: str = _opt("", "PEM server certificate; with tls_key_file turns TLS on for listen and agent_listen (and metrics_listen with metrics_tls)")
    tls_key_file: str = _opt("", "PEM private key of tls_cert_file")
    tls_client_ca_file: str = _opt("", "PEM CA that signs agent client certificates (mutual TLS; CN or SAN = node id)")
    token_file: str = _opt("", "TOML/JSON of bearer-token digests -> role (admin, tenant, agent, metrics) and tenant")
    insecure: bool = _opt(False, "run without TLS and/or tokens (lab use); refused unless set, and logged loudly")
    rpc_rate_per_s: float = _opt(0.0, "per-client RPC rate limit; 0 = off", "requests/s", ge=0)
    rpc_burst: float = _opt(200.0, "per-client RPC burst above rpc_rate_per_s", "requests", ge=1)
    stream_message_rate_per_s: float = _opt(0.0, "per-stream agent message rate limit; 0 = off", "messages/s", ge=0)
    stream_message_burst: float = _opt(500.0, "per-stream agent message burst", "messages", ge=1)
    max_queued_per_tenant: int = _opt(
        0,
        "queued tasks a tenant may have at once; 0 = unlimited. A ScheduleTasks call counts as a whole, and its "
        "refusal gives the tenant's queued tasks and the call's new ones apart: split a job array larger than this "
        "into calls of at most this many, each once the earlier ones' tasks have left the queue. A repeat of a task "
        "the coordinator holds (queued, leased or ended) queues nothing and is answered with it at the limit too",
        "tasks",
        ge=0,
    )
    max_watch_streams_per_client: int = _opt(
        256,
        "WatchTask, WatchView and WatchPlans streams one client (its token, else its certificate name, else its "
        "host) may have open at once; more are refused with RESOURCE_EXHAUSTED",
        "streams",
        ge=1,
        le=1_000_000,
    )
    max_watch_streams: int = _opt(
        4096,
        "WatchTask, WatchView and WatchPlans streams open at once from all clients together (~27 KiB of "
        "coordinator memory each); more are refused with RESOURCE_EXHAUSTED",
        "streams",
        ge=1,
        le=1_000_000,
    )
    state_synchronous: str = _opt(
        "NORMAL",
        "SQLite synchronous mode: NORMAL survives process crashes, FULL also power loss",
        choices=("NORMAL", "FULL"),
        ignore_case=True,
    )
    finished_retention_s: float = _opt(86400.0, "finished tasks are kept this long (by finish time) for GetTask and idempotent resubmission, in memory and in state_dir alike (pruned every minute, or as often as a shorter retention, at most once a second); [scheduler] retain_finished bounds their number besides", "s", ge=0)
    advisor_interval_s: float = _opt(30.0, "period of the rebalance advisor's evaluation", "s", ge=0.1)
    advisor_hook: str = _opt("", "command run with each rebalance plan as JSON on stdin (the operator's executor, e.g. gpulb --coordinator 127.0.0.1:50051 advisor execute --stdin); empty = none")
    advisor_hook_timeout_s: float = _opt(60.0, "the advisor hook's process group gets SIGTERM after this long and SIGKILL 1 s later (gpulb advisor execute then ends the checkpoint or restart command still running, with what it started in its process group; a workload a restart command started and left, or started with setsid, runs on); its moves not made leave the cool-down", "s", gt=0)
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
        ge=0,
        le=_INT32_MAX,
    )
    log_level: str = _opt("info", "debug, info, warning or error")
    log_format: str = _opt("auto", "json, console, or auto (console on a terminal)")

    def validate(self) -> "CoordinatorConfig":
        """Rules across options (each option's own range is in its metadata and
        checked by the loader). ValueError opening with the field's name."""
        if self.persist > self.signal_window:
            # the anomaly window could never hold that many anomalies in a row
            raise ValueError(f"persist: must be <= signal_window ({self.signal_window}), got {self.persist!r}")
        listeners = [(name, getattr(self, name)) for name in ("listen", "agent_listen", "metrics_listen")]
        for i, (name, address) in enumerate(listeners):
            for other, taken in listeners[:i]:
                if address and address == taken and not address.endswith(":0"):
                    raise ValueError(f"{name}: {address!r} is {other}'s address; each listener needs its own port")
        if self.tls_key_file and not self.tls_cert_file or self.tls_cert_file and not self.tls_key_file:
            missing = "tls_key_file" if self.tls_cert_file else "tls_cert_file"
            given = "tls_cert_file" if self.tls_cert_file else "tls_key_file"
            raise ValueError(f"{missing}: needed with {given} (TLS takes both: the certificate and its key)")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ValueError("tls_client_ca_file: needs tls_cert_file and tls_key_file (mutual TLS is TLS first)")
        if self.metrics_tls and not self.tls_cert_file:
            raise ValueError("metrics_tls: needs tls_cert_file and tls_key_file (the certificate /metrics is served with)")
        if self.metrics_auth.lower() == "token" and not self.token_file:
            raise ValueError("metrics_auth: 'token' needs token_file (the tokens /metrics takes: role metrics or admin)")
        if self.advisor_hook:
            try:
                argv = shlex.split(self.advisor_hook)
            except ValueError as exc:
                raise ValueError(f"advisor_hook: not a command line ({exc}): {self.advisor_hook!r}") from None
            if not argv:
                raise ValueError(f"advisor_hook: no command in {self.advisor_hook!r}; empty = none")
            # as gpulb advisor execute checks --checkpoint and --restart: found
            # only at the first plan (days later, perhaps), it was an "error"
            # outcome that did not even name the file
            if shutil.which(argv[0]) is None:
                if os.sep in argv[0]:
                    why = "is not an executable file (missing, or without its x bit: chmod +x)"
                else:
                    why = (f"is not an executable on PATH (the hook runs without a shell: give its path, e.g. "
                           f"/usr/local/lib/gpulb/{argv[0]}, or 'sh -c \"...\"' for shell syntax)")
                raise ValueError(f"advisor_hook: {argv[0]!r} {why}")
        return self


#: settings a SIGHUP may change without a restart
LIVE_RELOADABLE = frozenset(
    {"log_level", "staleness_s", "dispatch_interval_s", "heartbeat_interval_s", "remove_after_intervals", "max_queued_per_tenant"}
)
