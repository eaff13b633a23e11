"""Prometheus metrics of the coordinator, served over HTTP from its event loop.

Per-GPU and per-node gauges are read from the view at scrape time (nothing is
updated per sample): the per-GPU families written straight into the text
format column by column (``_ViewCollector.per_gpu_text``), the rest by a
custom collector through prometheus-client; counters and histograms on the
ingest and scheduling paths are ordinary prometheus-client instruments in a
registry of the coordinator's own, so several coordinators in one process
(tests) do not collide. Names follow Prometheus conventions: the ``gpulb_``
prefix and base units (bytes, seconds, ratios, watts, celsius).

The HTTP endpoint is a few lines of asyncio rather than prometheus-client's
threaded server: the collector then runs on the loop that owns the view, so a
scrape never sees a half-applied batch.
"""

from __future__ import annotations

import asyncio
import collections
import gzip
import itertools
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

import grpc
import numpy as np
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.utils import floatToGoString

from coordinator.advisor import ADVISOR_METRIC_NAMES
from coordinator.config import CoordinatorConfig
from coordinator.security import AuthError
from protos.runtime import release
from protos import cluster_pb2 as cpb
from protos.fields import BY_NAME
from scheduler.task import Task, TaskState

if TYPE_CHECKING:
    from coordinator.server import Coordinator

__all__ = ["CoordinatorMetrics", "MetricsServer", "TenantUsage", "TENANT_SERIES", "OTHER_TENANTS", "EXPORTED_METRIC_NAMES"]

_MIB = 1024.0 * 1024.0


def _label(value: str) -> str:
    """A label value escaped as the text format wants it."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


# The *_created series double the exposition for no alerting or dashboard use.
disable_created_metrics()


class _ViewCollector:
    """Reads the view's columns when Prometheus scrapes."""

    def __init__(self, coordinator: "Coordinator") -> None:
        self.c = coordinator
        self._labels_key: tuple | None = None
        self._labels_held: list = []
        self._rows = np.zeros(0, dtype=np.intp)
        self._labels: list[str] = []
        self._uuids: list[str] = []

    def describe(self):
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        # the per-GPU families are written by per_gpu_text (CoordinatorMetrics.exposition)
        yield from self._cluster_families()

    def per_gpu_text(self) -> bytes:
        """The per-GPU families in the text exposition format, written column by
        column: one sample object per GPU and family (prometheus-client's way)
        took 650 ms a scrape at 8,000 GPUs, all of it on the event loop."""
        c = self.c
        view = c.view
        rows, labels = self._gpu_labels(view)
        now = c.clock()
        raw = view.raw[rows] if rows.size else np.zeros((0, view.raw.shape[1]))
        smoothed = c.smoothed_columns()
        facts = c.gpu_scheduler_facts()
        nan = np.full(rows.size, np.nan)
        reserved = nan.copy()
        tasks = nan.copy()
        uuids = self._uuids
        for i, uuid in enumerate(uuids):
            held = facts.get(uuid)
            if held is not None:
                reserved[i] = held[0] * _MIB
                tasks[i] = held[1]
        read_at = view.reading_at_s[rows]
        with np.errstate(invalid="ignore"):
            age = np.where(np.isnan(read_at), np.nan, np.maximum(0.0, now - read_at))

        def column(name: str) -> np.ndarray:
            return raw[:, BY_NAME[name]] if rows.size else nan

        def kept(name: str) -> np.ndarray:
            return smoothed[name][rows] if name in smoothed and rows.size else nan

        out: list[str] = []
        # "/ 100.0", not "* 0.01": 0.01 is not exact in binary, so 57 * 0.01
        # wrote 0.5700000000000001; a division is rounded once, to the double
        # nearest util/100, which repr writes as 0.57 (whole percents on the
        # wire). Same cost per column.
        for metric, doc, values in (
            ("gpulb_gpu_utilization_ratio", "GPU busy share from the last reading (0-1)", column("util_gpu_pct") / 100.0),
            ("gpulb_gpu_utilization_smoothed_ratio", "Anomaly-filtered EWMA of GPU busy share (0-1)",
             kept("util_gpu_pct") / 100.0),
            ("gpulb_gpu_memory_used_bytes", "Device memory in use, last reading", column("memory_used_mib") * _MIB),
            ("gpulb_gpu_memory_used_smoothed_bytes", "Anomaly-filtered EWMA of device memory in use",
             kept("memory_used_mib") * _MIB),
            ("gpulb_gpu_memory_total_bytes", "Device memory in all", column("memory_total_mib") * _MIB),
            ("gpulb_gpu_temperature_celsius", "GPU die temperature, last reading", column("temperature_c")),
            ("gpulb_gpu_power_watts", "Board power draw, last reading", column("power_w")),
            ("gpulb_gpu_reading_age_seconds", "Seconds since the GPU's last reading reached the coordinator", age),
            ("gpulb_gpu_reserved_memory_bytes", "Device memory reserved by placements not yet seen in readings", reserved),
            ("gpulb_gpu_active_tasks", "Tasks leased on the GPU", tasks),
            ("gpulb_gpu_xid_last", "Code of the last Xid error the agent saw on the GPU (0: none since the agent started)",
             column("xid_last")),
        ):
            out.append(f"# HELP {metric} {_help(doc)}\n# TYPE {metric} gauge\n")
            present = ~np.isnan(values)
            # Python's repr of a finite float is a number the text format takes
            # (Go's ParseFloat): prometheus-client's Go-style rewrite of each one
            # was half the scrape at 8,000 GPUs; it stays for +Inf
            write = repr if np.isfinite(values[present]).all() else floatToGoString
            out.extend(f"{metric}{{{lab}}} {write(v)}\n"
                       for lab, v in zip(itertools.compress(labels, present.tolist()), values[present].tolist()))
        return "".join(out).encode()

    def _gpu_labels(self, view) -> tuple[np.ndarray, list[str]]:
        """Every GPU's view row and label set (node, gpu, uuid, model), in node
        order; kept while the nodes and their GPUs are the same objects (a
        node that registers again is a new record). The cache holds those
        objects, so their ids in its key cannot pass to new ones."""
        nodes = list(view.nodes.values())
        key = tuple((id(n), id(n.gpus), id(n.rows)) for n in nodes)
        if key != self._labels_key:
            self._labels_held = [(n, n.gpus, n.rows) for n in nodes]
            rows: list[int] = []
            labels: list[str] = []
            uuids: list[str] = []
            for node in nodes:
                for gpu, row in zip(node.gpus, node.rows):
                    rows.append(int(row))
                    labels.append(f'node="{_label(node.node_id)}",gpu="{gpu.index}",uuid="{_label(gpu.uuid)}",'
                                  f'model="{_label(gpu.model)}"')
                    uuids.append(gpu.uuid)
            self._labels_key = key
            self._rows = np.asarray(rows, dtype=np.intp)
            self._labels = labels
            self._uuids = uuids
        return self._rows, self._labels

    def _cluster_families(self) -> Iterator[GaugeMetricFamily]:
        c = self.c
        view = c.view
        states = GaugeMetricFamily(
            "gpulb_nodes", "Nodes by state: those in the view, and as removed those that left the pool and have "
            "not registered again since the coordinator started (or, cordoned, before a restart)", labels=["state"])
        counts = {name: 0 for name in cpb.NodeState.keys() if name != "NODE_STATE_UNSPECIFIED"}
        for node_id in list(view.nodes):
            counts[cpb.NodeState.Name(c.node_state(node_id))] += 1
        # a removed node leaves the view, not the liveness records: without
        # these a dead agent showed as nothing at all once removed (30 s)
        counts["NODE_STATE_REMOVED"] += sum(1 for node_id in c.liveness.removed() if node_id not in view.nodes)
        for name, count in counts.items():
            states.add_metric([name.removeprefix("NODE_STATE_").lower()], count)
        yield states
        # the info-metric pattern (node_exporter's node_uname_info): 1 per
        # node, the facts in labels, so a dashboard or an alert can group the
        # fleet by driver or agent release ("which hosts still run 535?")
        info = GaugeMetricFamily(
            "gpulb_node_info", "Registered node facts as labels (value 1): host name, backend, agent release, NVIDIA driver",
            labels=["node", "hostname", "backend", "agent_version", "driver"],
        )
        for node in list(view.nodes.values()):
            info.add_metric([node.node_id, node.hostname, node.backend, node.agent_version, node.driver_version], 1)
        yield info
        streams = GaugeMetricFamily("gpulb_agent_streams", "Open agent telemetry streams")
        streams.add_metric([], len(c.gateway.sessions))
        yield streams
        dropped = CounterMetricFamily(
            "gpulb_agent_messages_dropped", "Messages to agents dropped because their stream was backed up, by kind "
            "(acks, resync requests, sampling hints only: placements and releases are never dropped)", labels=["kind"])
        for kind, count in sorted(c.gateway.dropped_counts().items()):
            dropped.add_metric([kind], count)
        yield dropped
        unread = CounterMetricFamily(
            "gpulb_agent_streams_closed_not_reading", "Agent streams closed because the agent left a message unread "
            "past the heartbeat timeout (it reconnects, and its registration sets its tasks right)")
        unread.add_metric([], c.gateway.closed_not_reading)
        yield unread
        yield from self._certificate_families()
        yield from c.scheduler_metric_families()
        yield from c.metrics.tenants.families()


    def _certificate_families(self) -> Iterator:
        """Expiry dates (the blackbox exporter's probe_ssl_earliest_cert_expiry
        pattern: a timestamp, so an alert says `- time() < 14 days`) of the
        certificates served, and of each connected agent's client certificate,
        which its open stream outlives but its next connection does not."""
        c = self.c
        files = c.security.tls_files
        if files is not None:
            own = GaugeMetricFamily(
                "gpulb_tls_certificate_expiry_timestamp_seconds",
                "notAfter (Unix time) of the certificates the coordinator serves (tls_cert_file) and trusts for agents "
                "(tls_client_ca_file), as loaded: renewed files are taken at the next handshake", labels=["option"])
            for option, when in sorted(files.not_after.items()):
                own.add_metric([option], when)
            yield own
            reloads = CounterMetricFamily(
                "gpulb_tls_reloads", "Renewed TLS files taken (loaded) or refused (a key not the certificate's, "
                "expired, unreadable: the certificate served before stays)", labels=["result"])
            reloads.add_metric(["loaded"], files.reloads)
            reloads.add_metric(["refused"], files.refusals)
            yield reloads
        agents = GaugeMetricFamily(
            "gpulb_agent_certificate_expiry_timestamp_seconds",
            "notAfter (Unix time) of the client certificate each connected agent presented (mTLS); its stream "
            "goes on past it, its next connection is refused", labels=["node"])
        for node_id, session in sorted(c.gateway.sessions.items()):
            if session.certificate_not_after is not None:
                agents.add_metric([node_id], session.certificate_not_after)
        yield agents


#: tenants the per-tenant families name one by one; the rest are summed under OTHER_TENANTS
TENANT_SERIES = 20
#: the tenant label of what the tenants not named add up to (a tenant of that name counts there too)
OTHER_TENANTS = "other"
#: the refusals counted per tenant, by the option that refused them
TENANT_LIMITS = ("max_queued_per_tenant", "tenant_max_priority")


class TenantUsage:
    """What each tenant holds, for ``/metrics``: its queued and leased tasks
    and leased GPUs, kept current as a scheduler listener (``changed``) so
    that a scrape reads counts, not every task; and the submissions refused
    by a per-tenant limit (``refused``).

    Tenants are free text an admin token may invent, so the series are
    bounded: the gauges name the ``named`` tenants that hold the most (GPUs
    leased, then tasks leased, then queued) at each scrape and sum the rest
    as ``tenant="other"``; the refusal counters name the first ``named``
    tenants refused since start and count the rest under ``other``, so that
    no counter ever goes down (a tenant never moves between series).
    """

    def __init__(self, named: int = TENANT_SERIES) -> None:
        self.named = named
        # queued or leased task id -> (tenant, state, the GPU uuids it leases)
        self._tasks: dict[str, tuple[str, TaskState, tuple[str, ...]]] = {}
        self.queued: collections.Counter[str] = collections.Counter()
        self.leased: collections.Counter[str] = collections.Counter()
        # tenant -> GPU uuid -> its leases there: a GPU two of a tenant's
        # half-GPU tasks share is one GPU (QA pass 25 read 9 of 4 GPUs leased)
        self._on: dict[str, collections.Counter[str]] = {}
        self.gpus: collections.Counter[str] = collections.Counter()  # tenant -> GPUs holding its leases
        self._refusals: dict[tuple[str, str], int] = {}  # (tenant or OTHER_TENANTS, limit) -> count
        self._refused_tenants: set[str] = set()  # the tenants with series of their own

    def changed(self, task: Task) -> None:
        was = self._tasks.pop(task.task_id, None)
        if was is not None:
            self._count(was, -1)
        if task.state in (TaskState.QUEUED, TaskState.LEASED):
            uuids = tuple(task.assignment.gpu_uuids) if task.state == TaskState.LEASED and task.assignment else ()
            now = (task.spec.tenant, task.state, uuids)
            self._tasks[task.task_id] = now
            self._count(now, +1)

    def _count(self, entry: tuple[str, TaskState, tuple[str, ...]], sign: int) -> None:
        tenant, state, uuids = entry
        counter = self.queued if state == TaskState.QUEUED else self.leased
        left = counter[tenant] + sign
        if left > 0:
            counter[tenant] = left
        else:
            counter.pop(tenant, None)  # a tenant that holds nothing leaves no entry behind
        if not uuids:
            return
        on = self._on.setdefault(tenant, collections.Counter())
        for uuid in uuids:
            on[uuid] += sign
            if on[uuid] <= 0:
                del on[uuid]
        if on:
            self.gpus[tenant] = len(on)
        else:
            del self._on[tenant]
            self.gpus.pop(tenant, None)

    def rebuild(self, tasks: Iterable[Task]) -> None:
        """Start over from ``tasks`` (after a restore)."""
        self._tasks.clear()
        self.queued.clear()
        self.leased.clear()
        self._on.clear()
        self.gpus.clear()
        for task in tasks:
            self.changed(task)

    def refused(self, tenant: str, limit: str) -> None:
        if tenant not in self._refused_tenants and tenant != OTHER_TENANTS and len(self._refused_tenants) < self.named:
            self._refused_tenants.add(tenant)
        key = (tenant if tenant in self._refused_tenants else OTHER_TENANTS, limit)
        self._refusals[key] = self._refusals.get(key, 0) + 1

    def holding(self) -> list[tuple[str, int, int, int]]:
        """(tenant, queued, leased, GPUs leased) of every tenant with a queued
        or leased task, the most GPUs first (then leased, queued, name)."""
        tenants = set(self.queued) | set(self.leased)
        rows = [(t, self.queued[t], self.leased[t], self.gpus[t]) for t in tenants]
        rows.sort(key=lambda r: (-r[3], -r[2], -r[1], r[0]))
        return rows

    def families(self) -> Iterator:
        rows = self.holding()
        own = [r for r in rows if r[0] != OTHER_TENANTS]
        named, rest = own[: self.named], own[self.named:] + [r for r in rows if r[0] == OTHER_TENANTS]
        other = (OTHER_TENANTS, sum(r[1] for r in rest), sum(r[2] for r in rest), sum(r[3] for r in rest))
        tasks = GaugeMetricFamily(
            "gpulb_tenant_tasks",
            f"Queued and leased tasks per tenant: the {self.named} tenants that hold the most GPUs (then tasks), "
            f"the rest summed as tenant {OTHER_TENANTS}", labels=["tenant", "state"])
        gpus = GaugeMetricFamily(
            "gpulb_tenant_gpus_leased",
            f"GPUs holding a tenant's leases (a GPU its tasks share counts once): the {self.named} tenants that hold "
            f"the most, the rest summed as tenant {OTHER_TENANTS}", labels=["tenant"])
        for tenant, queued, leased, held in (*named, other):
            tasks.add_metric([tenant, "queued"], queued)
            tasks.add_metric([tenant, "leased"], leased)
            gpus.add_metric([tenant], held)
        yield tasks
        yield gpus
        refusals = CounterMetricFamily(
            "gpulb_tenant_quota_refusals",
            "Submissions (ScheduleTask or ScheduleTasks calls) refused by a per-tenant limit, by tenant and the "
            f"option that refused them: the first {self.named} tenants refused since start, the rest counted as "
            f"tenant {OTHER_TENANTS}", labels=["tenant", "limit"])
        for tenant in sorted(self._refused_tenants) + [OTHER_TENANTS]:
            for limit in TENANT_LIMITS:
                refusals.add_metric([tenant, limit], self._refusals.get((tenant, limit), 0))
        yield refusals


class CoordinatorMetrics:
    """The coordinator's instruments, in a registry of its own."""

    def __init__(self, coordinator: "Coordinator") -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        #: per-tenant figures, fed by the coordinator (a scheduler listener, its submission checks)
        self.tenants = TenantUsage()
        self.envelopes = Counter("gpulb_envelopes_received_total", "Telemetry envelopes applied", registry=r)
        self.state_write_failures = Counter(
            "gpulb_state_write_failures_total",
            "Writes to state_dir that failed (a full or read-only disk), by write: commit (the calls waiting on it "
            "got UNAVAILABLE), node_admin (the cordon or drain was not made), learned", ["write"], registry=r)
        for write in ("commit", "node_admin", "learned"):  # at 0 from the start, so the first failure is an increase
            self.state_write_failures.labels(write)
        self.envelope_bytes = Counter("gpulb_telemetry_received_bytes_total", "Telemetry bytes received (serialized envelopes)", registry=r)
        self.rejected = Counter("gpulb_envelopes_rejected_total", "Envelopes refused as malformed, by offending field", ["field"], registry=r)
        self.resyncs = Counter("gpulb_resyncs_total", "Keyframes requested after sequence gaps", registry=r)
        self.anomalies = Counter("gpulb_anomalies_total", "Readings rejected by the anomaly filter, by signal", ["signal"], registry=r)
        self.level_shifts = Counter("gpulb_level_shifts_total", "Persistent level changes accepted by the anomaly filter, by signal", ["signal"], registry=r)
        self.ingest_latency = Histogram(
            "gpulb_ingest_latency_seconds",
            "Delay from an envelope's arrival to its readings being in the smoothed view",
            # 10 ms steps around the 50 ms target, so a p99 near it is resolved, not a bucket edge
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.075, 0.1, 0.25, 0.5, 1.0),
            registry=r,
        )
        self.node_transitions = Counter("gpulb_node_transitions_total", "Node liveness transitions, by new state", ["state"], registry=r)
        self.tasks_placed = Counter("gpulb_tasks_placed_total", "Tasks placed, by policy and priority class", ["policy", "priority"], registry=r)
        self.tasks_finished = Counter("gpulb_tasks_finished_total", "Tasks that reached a final state, by state", ["state"], registry=r)
        self.tasks_migrated = Counter("gpulb_tasks_migrated_total", "Leases moved to other GPUs by MigrateTask (a rebalance plan's move)", registry=r)
        self.sla_misses = Counter("gpulb_p0_sla_misses_total", "P0 tasks that waited past the SLA bound", registry=r)
        self.decision_seconds = Histogram(
            "gpulb_schedule_decision_seconds",
            "Time of one dispatch pass (filter, score, reserve) over the whole queue",
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1),
            registry=r,
        )
        self.queue_wait = Histogram(
            "gpulb_task_wait_seconds",
            "Time from submission to placement, by priority class",
            ["priority"],
            buckets=(0.01, 0.05, 0.1, 0.5, 1, 5, 30, 60, 300, 1800),
            registry=r,
        )
        self._view_collector = _ViewCollector(coordinator)
        r.register(self._view_collector)
        # the process itself, for a month of uptime: memory growth, open file
        # descriptors against LimitNOFILE, restarts (start time), the collector
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        Gauge("gpulb_coordinator_info", "The coordinator's release (always 1): the package version, and its commit "
              "when run from a checkout", ["version"], registry=r).labels(release()).set(1)
        # Prometheus' own names for its configuration reloads
        self.reload_successful = Gauge(
            "gpulb_config_last_reload_successful",
            "Whether the last SIGHUP reload was applied (1) or rejected (0: the running configuration was kept)",
            registry=r)
        self.reload_successful.set(1)
        self.reload_success_time = Gauge(
            "gpulb_config_last_reload_success_timestamp_seconds",
            "Unix time of the last reload applied (the start, until one)", registry=r)
        self.reload_success_time.set_to_current_time()

    def exposition(self, per_gpu: bool = True) -> bytes:
        """The text exposition; ``per_gpu=False`` (``/metrics?per_gpu=0``) leaves
        out the per-GPU families, most of a scrape's size on large clusters."""
        rest = generate_latest(self.registry)
        return self._view_collector.per_gpu_text() + rest if per_gpu else rest


class MetricsServer:
    """A minimal HTTP/1.1 server for ``GET /metrics`` (and ``/healthz``).

    It answers anyone who reaches it, and a reply is the whole exposition
    (MiBs on a large cluster), so it is bounded: at most ``max_connections``
    are served at once, and more are answered 503 and closed without being
    read; each has ``timeout_s`` to send its request, then ``timeout_s`` again
    to take the whole reply, and is then aborted, which frees its file
    descriptor and drops the part of the reply still buffered. Without that
    (QA pass 23), 150 clients that sent GET /metrics and never read held
    1.4 GiB, and 1,000 idle ones used up the process's 1,024 descriptors so
    that new gRPC clients and agents waited up to 14 s. A Prometheus server
    holds one connection per scrape, every scrape interval.

    ``max_connections`` and ``timeout_s``: the coordinator's
    ``metrics_max_connections`` and ``metrics_timeout_s`` (their defaults when
    not given). ``authorize`` (``metrics_auth = "token"``): called with a
    ``GET /metrics``' ``Authorization`` header (None without one); an
    ``AuthError`` it raises is answered 401 or 403 (``/healthz`` is not
    asked: a liveness probe has no token). ``https`` (``metrics_tls``): the
    ``certwatch.HttpsContext`` to serve with; its handshake has
    ``timeout_s`` too.
    """

    def __init__(self, metrics: CoordinatorMetrics, host: str, port: int, *,
                 max_connections: int | None = None, timeout_s: float | None = None,
                 authorize: Callable[[str | None], None] | None = None, https=None) -> None:
        self.metrics = metrics
        self.host = host
        self.port = port
        defaults = CoordinatorConfig()  # the coordinator passes its own
        self.max_connections = defaults.metrics_max_connections if max_connections is None else max_connections
        self.timeout_s = defaults.metrics_timeout_s if timeout_s is None else timeout_s
        self.authorize = authorize
        self.https = https
        self._server: asyncio.base_events.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()  # connections being served
        self.refused = 0  # connections answered 503: max_connections were being served
        self.timed_out = 0  # connections aborted at timeout_s (a request not sent, a reply not read)
        self.unauthorized = 0  # scrapes answered 401 / 403 (metrics_auth = "token")

    @property
    def connections(self) -> int:
        """Connections being served now."""
        return len(self._open)

    async def start(self) -> int:
        if self.https is None:
            self._server = await asyncio.start_server(self._handle, self.host, self.port)
        else:
            self._server = await asyncio.start_server(self._handle, self.host, self.port, ssl=self.https.context,
                                                      ssl_handshake_timeout=self.timeout_s)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for writer in list(self._open):
                writer.transport.abort()  # a slow reader does not hold the stop
            await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        transport = writer.transport
        if len(self._open) >= self.max_connections:
            self.refused += 1
            # not read: the request would cost a wait. The reply fits the
            # socket's buffer at once, so abort frees the descriptor now
            # (it drops only what is still in this process, nothing here)
            body = f"{self.max_connections} metrics connections are being served (metrics_max_connections)\n".encode()
            transport.write(
                b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nRetry-After: 1\r\n"
                + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body
            )
            transport.abort()
            return
        self._open.add(writer)
        # drain() then waits until the whole reply is in the kernel, not only
        # below the default 64 KiB mark: a close() with bytes still buffered
        # here waits for the peer to read them, for ever if it never does
        transport.set_write_buffer_limits(high=0)
        done = False
        encoding = ""
        try:
            request = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=self.timeout_s)
            line = request.split(b"\r\n", 1)[0].decode("latin-1")
            parts = line.split()
            path, _, query = (parts[1] if len(parts) >= 2 else "").partition("?")
            if len(parts) < 2 or parts[0] not in ("GET", "HEAD"):
                status, body, ctype = "405 Method Not Allowed", b"only GET\n", "text/plain"
            elif path == "/metrics" and (denied := self._denied(request)) is not None:
                self.unauthorized += 1
                status, body, ctype = denied
            elif path == "/metrics":
                per_gpu = "per_gpu=0" not in query.split("&")
                status, body, ctype = "200 OK", self.metrics.exposition(per_gpu), CONTENT_TYPE_LATEST
                if "gzip" in (_header(request, b"accept-encoding") or "").lower() and len(body) > GZIP_ABOVE_BYTES:
                    # Prometheus asks for it: ~12x smaller (475 KB -> ~40 KB at 380
                    # GPUs); in a thread, as zlib lets go of the GIL, not on the loop
                    body = await asyncio.to_thread(gzip.compress, body, 1, mtime=0)
                    encoding = "gzip"
            elif path in ("/healthz", "/"):
                status, body, ctype = "200 OK", b"ok\n", "text/plain"
            else:
                status, body, ctype = "404 Not Found", b"see /metrics\n", "text/plain"
            extra = 'WWW-Authenticate: Bearer realm="gpulb metrics"\r\n' if status.startswith("401") else ""
            if encoding:
                extra += f"Content-Encoding: {encoding}\r\n"
            head = f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n{extra}Connection: close\r\n\r\n"
            writer.write(head.encode())
            if parts and parts[0] != "HEAD":
                writer.write(body)  # two writes: head + body would copy the exposition once more
            del body  # what the socket did not take is in the transport's buffer now
            await asyncio.wait_for(writer.drain(), timeout=self.timeout_s)
            done = True
        except asyncio.TimeoutError:
            self.timed_out += 1
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            self._open.discard(writer)
            if done:
                writer.close()
            else:
                transport.abort()  # drops a reply not taken; close() would wait for the reader


    def _denied(self, request: bytes) -> tuple[str, bytes, str] | None:
        """The reply to a scrape ``authorize`` refuses, else None."""
        if self.authorize is None:
            return None
        try:
            self.authorize(_header(request, b"authorization"))
        except AuthError as exc:
            status = "403 Forbidden" if exc.code == grpc.StatusCode.PERMISSION_DENIED else "401 Unauthorized"
            return status, f"{exc.message}\n".encode(), "text/plain"
        return None


def _header(request: bytes, name: bytes) -> str | None:
    """The value of header ``name`` (lower case) in an HTTP request head, or None."""
    for line in request.split(b"\r\n")[1:]:
        key, sep, value = line.partition(b":")
        if sep and key.strip().lower() == name:
            return value.strip().decode("latin-1")
    return None


#: a /metrics reply is gzip-compressed when asked for and larger than this
GZIP_ABOVE_BYTES = 4096

#: every metric family name the coordinator exports (for rules/dashboard checks)
EXPORTED_METRIC_NAMES = (
    "gpulb_gpu_utilization_ratio",
    "gpulb_gpu_utilization_smoothed_ratio",
    "gpulb_gpu_memory_used_bytes",
    "gpulb_gpu_memory_used_smoothed_bytes",
    "gpulb_gpu_memory_total_bytes",
    "gpulb_gpu_temperature_celsius",
    "gpulb_gpu_power_watts",
    "gpulb_gpu_reading_age_seconds",
    "gpulb_gpu_reserved_memory_bytes",
    "gpulb_gpu_active_tasks",
    "gpulb_gpu_xid_last",
    "gpulb_nodes",
    "gpulb_node_info",
    "gpulb_agent_streams",
    "gpulb_agent_messages_dropped_total",
    "gpulb_agent_streams_closed_not_reading_total",
    "gpulb_envelopes_received_total",
    "gpulb_telemetry_received_bytes_total",
    "gpulb_envelopes_rejected_total",
    "gpulb_resyncs_total",
    "gpulb_anomalies_total",
    "gpulb_level_shifts_total",
    "gpulb_ingest_latency_seconds",
    "gpulb_node_transitions_total",
    "gpulb_tasks_placed_total",
    "gpulb_tasks_finished_total",
    "gpulb_tasks_requeued_total",
    "gpulb_tasks_migrated_total",
    "gpulb_p0_sla_misses_total",
    "gpulb_schedule_decision_seconds",
    "gpulb_task_wait_seconds",
    "gpulb_queue_depth",
    "gpulb_queue_oldest_wait_seconds",
    "gpulb_tasks",
    "gpulb_workload_mix_share",
    "gpulb_growth_room_waits_total",
    "gpulb_preemptions_total",
    "gpulb_oom_kills_total",
    "gpulb_big_cards",
    "gpulb_big_cards_need_limit_bytes",
    "gpulb_tls_certificate_expiry_timestamp_seconds",
    "gpulb_tls_reloads_total",
    "gpulb_state_write_failures_total",
    "gpulb_coordinator_info",
    "gpulb_config_last_reload_successful",
    "gpulb_config_last_reload_success_timestamp_seconds",
    # prometheus-client's process, platform and garbage-collector collectors
    "process_virtual_memory_bytes",
    "process_resident_memory_bytes",
    "process_start_time_seconds",
    "process_cpu_seconds_total",
    "process_open_fds",
    "process_max_fds",
    "python_info",
    "python_gc_objects_collected_total",
    "python_gc_objects_uncollectable_total",
    "python_gc_collections_total",
    "gpulb_agent_certificate_expiry_timestamp_seconds",
    "gpulb_tenant_tasks",
    "gpulb_tenant_gpus_leased",
    "gpulb_tenant_quota_refusals_total",
    *ADVISOR_METRIC_NAMES,  # the rebalance advisor's and the speed predictor's
)
