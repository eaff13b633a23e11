"""The coordinator: one grpc.aio server on one event loop that owns the cluster
view (and, through the scheduler, the queue and leases).

``Coordinator`` wires the servicers to the shared state and runs the
background loops, each with an explicit start and stop.
"""

from __future__ import annotations

import asyncio
import ipaddress
import math
import os
import re
import shlex
import socket
import ssl
import time
from dataclasses import replace
from typing import Callable

import grpc
import numpy as np
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from coordinator.advisor import ADVISOR_SERVICE_NAME, AdvisorRuntime, AdvisorService, CommandHook
from coordinator.advisor import add_to_server as add_advisor_to_server
from coordinator.certwatch import ExpiryReminder
from coordinator.config import CoordinatorConfig
from coordinator.convert import gpu_messages, node_message
from coordinator.gateway import AgentGateway, AgentSession, StreamRefused
from coordinator.ingest import TelemetryIngest
from coordinator.liveness import Admin, Liveness, LivenessEvent, LivenessSweeper, NodeLiveness, UnknownNode
from coordinator.metrics import CoordinatorMetrics, MetricsServer
from coordinator.operator import ClusterOperatorService
from coordinator.scheduling import Dispatcher, SchedulerService
from coordinator.security import AuthError, Security, SecurityConfigError, TenantRefusal
from coordinator.state import GroupCommitter, StateError, TaskStore, restore_into
from coordinator.view import SIGNALS, ClusterView, NodeRecord, SignalSettings
from protos import cluster_pb2 as cpb
from protos import cluster_pb2_grpc as cpb_grpc
from protos import tasks_pb2 as tpb
from protos import tasks_pb2_grpc as tpb_grpc
from protos import telemetry_pb2 as pb
from protos import telemetry_pb2_grpc as pb_grpc
from protos.codec import DecodeResult
from scheduler import setsearch
from scheduler.advisor import AdvisorConfig
from scheduler.config import SchedulerConfig
from scheduler.memgrowth import MemoryGrowthConfig
from scheduler.predictor import PredictorConfig
from scheduler.task import TaskState

__all__ = ["Coordinator", "ListenError", "bind_problem", "observe_many"]

log = structlog.get_logger("gpulb.coordinator")


def observe_many(histogram, values: np.ndarray) -> None:
    """``histogram.observe`` for every value, counted per bucket with numpy
    (12,500 separate observes a second cost the event loop ~3 %). Uses the
    unlabelled prometheus_client Histogram's bucket counters; anything else
    gets one observe per value."""
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for v in values:
            histogram.observe(float(v))
        return
    # observe counts a value in the first bucket whose bound is >= it
    counts = np.bincount(np.searchsorted(np.asarray(bounds, dtype=np.float64), values, side="left"), minlength=len(bounds))
    for i in np.flatnonzero(counts[: len(bounds)]):
        buckets[i].inc(float(counts[i]))
    total.inc(float(values.sum()))

SERVICE_NAMES = (
    pb.DESCRIPTOR.services_by_name["AgentGateway"].full_name,
    cpb.DESCRIPTOR.services_by_name["ClusterOperator"].full_name,
    tpb.DESCRIPTOR.services_by_name["Scheduler"].full_name,
)


class ListenError(Exception):
    """A listener of the coordinator could not bind its address: ``option``
    (``listen``, ``agent_listen``, ``metrics_listen``), the ``address`` as
    configured, and ``reason`` as the operating system gives it."""

    def __init__(self, option: str, address: str, reason: str) -> None:
        self.option = option
        self.address = address
        self.reason = reason
        super().__init__(f"{option} {address}: cannot listen: {reason}")


def bind_problem(address: str) -> str:
    """Why ``address`` (HOST:PORT) cannot be bound, as the operating system
    says it: gRPC's bind error names only the address. Probed with a plain
    socket, with gRPC's SO_REUSEADDR and without SO_REUSEPORT."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(host or None, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, ValueError) as exc:
        return os_problem(exc, host)
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind(sockaddr)
        except OSError as exc:
            return os_problem(exc, host)
    return "gRPC could not bind it (GRPC_VERBOSITY=debug says why)"


def os_problem(exc: BaseException, host: str) -> str:
    """A bind or lookup error in a few words: "address already in use",
    "cannot resolve 'h': Name or service not known"."""
    if isinstance(exc, socket.gaierror) or not isinstance(exc, OSError):
        return f"cannot resolve {host!r}: {getattr(exc, 'strerror', None) or exc}"
    if isinstance(exc.errno, int) and exc.errno > 0:
        return os.strerror(exc.errno).lower()  # uvloop's strerror is a whole sentence
    return exc.strerror or str(exc)


#: task ids (and tenants) a log line lists at most; its count says how many in all
_LOGGED_TASKS = 50

#: the liveness lever that puts a node back in each operator state
_ADMIN_ACTION = {Admin.ACTIVE: "uncordon", Admin.CORDONED: "cordon", Admin.DRAINING: "drain"}


def _is_loopback(host: str) -> bool:
    """Whether ``host`` (a metrics_listen host) is reached only from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: whatever it resolves to may be reached


class Coordinator:
    def __init__(
        self,
        config: CoordinatorConfig | None = None,
        scheduler_config: SchedulerConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        security: Security | None = None,
        store: TaskStore | None = None,
        advisor_config: AdvisorConfig | None = None,
        predictor_config: PredictorConfig | None = None,
        growth_config: MemoryGrowthConfig | None = None,
    ) -> None:
        """``advisor_config``, ``predictor_config`` and ``growth_config`` are the
        ``[advisor]``, ``[predictor]`` and ``[memory_growth]`` tables (defaults
        when None). ``security`` defaults to insecure mode (tests, embedding;
        logged); the daemon builds it from the configuration. ``store`` (durable task
        state) is optional: without it tasks live in memory only."""
        self.config = cfg = config or CoordinatorConfig()
        self.clock = clock
        self.view = ClusterView(
            signals=SignalSettings(window=cfg.signal_window, alpha=cfg.ewma_alpha, iqr_k=cfg.iqr_k, z_max=cfg.z_max, persist=cfg.persist)
        )
        self.liveness = NodeLiveness(clock, heartbeat_interval_s=cfg.heartbeat_interval_s, remove_after_intervals=cfg.remove_after_intervals)
        self.ingest = TelemetryIngest(self.view)
        self._arrivals: list[float] = []
        self._envelopes_applied = 0
        self._bytes_received = 0
        self.gateway = AgentGateway(self, clock=clock)
        self.operator = ClusterOperatorService(self)
        self.metrics = CoordinatorMetrics(self)
        self.dispatcher = Dispatcher(self, scheduler_config or SchedulerConfig(), clock)
        self.scheduler_service = SchedulerService(self)
        engine = self.dispatcher.engine
        self.advisor = AdvisorRuntime(
            snapshot=self.dispatcher.snapshots.snapshot,
            tasks=engine.leased,  # read in place: the advisor changes nothing and never awaits
            clock=clock,
            reservations=lambda: engine.reservations,
            queued=engine.queued,  # no moves while tasks wait: they need the room more
            workload_mix=lambda: engine.workload_mix,  # sizes the large task the advisor keeps room for
            scheduler_config=engine.config,
            advisor_config=advisor_config,
            predictor_config=predictor_config,
            growth_config=growth_config,
            interval_s=cfg.advisor_interval_s,
            hook=CommandHook(shlex.split(cfg.advisor_hook), timeout_s=cfg.advisor_hook_timeout_s) if cfg.advisor_hook else None,
            unix_ns=self.dispatcher.wall.ns,
            # no plan after a restart until the nodes holding restored leases report,
            # at most until the coordinator would give such a node up
            reconnect_grace_s=cfg.heartbeat_interval_s * cfg.remove_after_intervals,
        )
        engine.add_listener(self.advisor.on_task_change)
        self.dispatcher.annotate = self.advisor.annotate
        # set when stop() begins: waiting and streaming calls end at once (coordinator.shutdown)
        self.stopping = asyncio.Event()
        self.security = security or Security(insecure=True)
        # WatchPlans counts against the same watch-stream limits as WatchTask and WatchView
        self.advisor_service = AdvisorService(self.advisor, authorize=lambda context, admin: self.authorize(context, admin=admin),
                                              stopping=self.stopping,
                                              admit_watch=lambda context: self.security.admit_watch(context, self.config))
        if self.security.quota is not None:
            self.dispatcher.engine.add_listener(self.security.quota.changed)
        # per-tenant queued and leased tasks and GPUs, counted as they change (/metrics)
        self.dispatcher.engine.add_listener(self.metrics.tenants.changed)
        self.store = store
        self._learned_versions: dict[str, int] = {}  # learner name -> version last saved or restored
        self.state_writer: GroupCommitter | None = None
        self._background: list[asyncio.Task] = []
        self.agent_port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._metrics_server: MetricsServer | None = None
        self._health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        self._sweeper = LivenessSweeper(self.liveness, self._on_liveness_events, interval_s=min(1.0, cfg.heartbeat_interval_s / 4))
        self._smoother: asyncio.Task | None = None
        # shorter agent deadlines of a reload, waiting for agents to adapt (_hold_agents_to)
        self._deadline_changes: dict[str, asyncio.TimerHandle] = {}
        self._anomalies_seen = self.view.signals.anomaly_counts.copy()
        self._shifts_seen = self.view.signals.shift_counts.copy()
        self.port: int | None = None
        self.metrics_port: int | None = None
        self.rejected_envelopes = 0
        self.resync_requests = 0
        self._expiry_reminder = ExpiryReminder()

    # ---- lifecycle ----------------------------------------------------------
    async def start(self) -> int:
        cfg = self.config
        options = [
            ("grpc.max_receive_message_length", cfg.max_message_bytes),
            ("grpc.max_send_message_length", cfg.max_message_bytes),
            # agents keep one stream open for days; let their keepalives through
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
            ("grpc.keepalive_permit_without_calls", 1),
            # gRPC sets SO_REUSEPORT by default: a second coordinator on the
            # port then binds too and the kernel splits agents and clients
            # between the two; one per port, so that bind fails instead
            ("grpc.so_reuseport", 0),
        ]
        if self.store is not None:
            self._restore()
        # compile (or load) the multi-GPU set search before the first decision waits on it
        jit_s = setsearch.warm()
        if jit_s is not None:
            log.info("set_search_compiled", mode=setsearch.mode, seconds=round(jit_s, 3))
        elif setsearch.failure is not None:  # e.g. W^X and no ahead-of-time build: numpy places alike, slower
            log.warning("set_search_not_compiled", reason=setsearch.failure,
                        hint="gpulb set-search build (systemd/install.sh runs it)")
        server = grpc.aio.server(options=options, interceptors=[self.security.interceptor()])
        pb_grpc.add_AgentGatewayServicer_to_server(self.gateway, server)
        cpb_grpc.add_ClusterOperatorServicer_to_server(self.operator, server)
        self._add_services(server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            self.service_names() + (health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            server,
        )
        try:
            if cfg.metrics_listen:
                # bound before the gRPC ports: a start that fails here bound nothing else
                host, _, mport = cfg.metrics_listen.rpartition(":")
                host = host.strip("[]") or "127.0.0.1"  # [::1]:9400: asyncio wants the bare address
                https = None
                if cfg.metrics_tls:
                    from coordinator.certwatch import HttpsContext

                    if self.security.tls is None:
                        raise SecurityConfigError("metrics_tls: needs tls_cert_file and tls_key_file")

                    try:
                        https = HttpsContext(self.security.server_tls_files())
                    except (ssl.SSLError, OSError) as exc:
                        raise SecurityConfigError(f"metrics_tls: cannot serve {cfg.tls_cert_file}: {exc}") from None
                by_token = cfg.metrics_auth.lower() == "token"
                metrics_server = MetricsServer(self.metrics, host, int(mport), max_connections=cfg.metrics_max_connections,
                                               timeout_s=cfg.metrics_timeout_s,
                                               authorize=self.security.authorize_scrape if by_token else None, https=https)
                try:
                    self.metrics_port = await metrics_server.start()
                except OSError as exc:  # in use, not an address of this host, unresolvable (gaierror)
                    raise ListenError("metrics_listen", cfg.metrics_listen, os_problem(exc, host)) from None
                self._metrics_server = metrics_server
                log.info("metrics_listening", address=f"[{host}]:{self.metrics_port}" if ":" in host else f"{host}:{self.metrics_port}",
                         scheme="https" if https is not None else "http", auth="token" if by_token else "none")
                if not by_token and not _is_loopback(host):
                    log.warning("metrics_unauthenticated", address=cfg.metrics_listen,
                                detail="anyone who reaches this address reads every node, GPU and tenant in /metrics",
                                hint="metrics_auth = \"token\" (a token of role metrics for Prometheus), or bind "
                                     "metrics_listen where only Prometheus reaches it")
            try:
                ports = self.security.add_ports(server, cfg.listen, cfg.agent_listen or None)
            except (RuntimeError, OSError) as exc:
                # grpc: RuntimeError "Failed to bind to address ...; set
                # GRPC_VERBOSITY=..."; it says neither which option nor why
                named = re.search(r"address (\S+?);?(\s|$)", str(exc))
                option = "agent_listen" if cfg.agent_listen and named and named.group(1) == cfg.agent_listen else "listen"
                address = getattr(cfg, option)
                raise ListenError(option, address, bind_problem(address)) from None
            port = ports["listen"]
            self.agent_port = ports.get("agent_listen")
            await server.start()
        except BaseException:
            await self._abort_start(server)
            raise
        self._server = server
        self.port = port
        self._sweeper.start()
        self._smoother = asyncio.create_task(self._smoothing_loop(), name="gpulb-smoothing")
        self.dispatcher.start()
        self.advisor.start()
        # finished tasks are kept finished_retention_s in memory too, state_dir or not
        self._background.append(asyncio.create_task(self._prune_loop(), name="gpulb-prune"))
        if self.store is not None:
            self._background.append(asyncio.create_task(self._save_learned_loop(), name="gpulb-save-learned"))
        if self.security.tls is not None:
            self._background.append(asyncio.create_task(self._certificate_loop(), name="gpulb-certificates"))
        for name in ("",) + self.service_names():
            await self._set_health(name, health_pb2.HealthCheckResponse.SERVING)
        host = cfg.listen.rsplit(":", 1)[0]
        log.info("coordinator_listening", address=f"{host}:{port}", port=port)
        return port

    async def _abort_start(self, server: grpc.aio.Server) -> None:
        """Undo a start that failed part-way (a listener that could not bind,
        TLS files that could not be read): no port stays bound, no loop runs,
        the state directory is closed and unlocked; the error is the caller's."""
        if self._metrics_server is not None:
            await self._metrics_server.stop()
            self._metrics_server = None
        self.metrics_port = self.agent_port = None
        # A grpc.aio server keeps the ports it bound until it has run (stop
        # or garbage collection of one never started leaves them bound), and
        # one left to the collector stops itself on a loop closed by then
        # ("Event loop is closed"): run it, and stop it cancelling any call.
        try:
            await server.start()
        except Exception:  # pragma: no cover - nothing to release then
            pass
        await server.stop(None)
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        self._background.clear()
        if self.state_writer is not None:
            try:
                await self.state_writer.flush()  # whatever the restore staged, before the store closes
            except StateError:
                pass  # the start failed anyway; the store's close commits what it still can
            self.state_writer = None
        if self.store is not None:
            self.store.close()

    async def stop(self, grace_s: float | None = None) -> None:
        if self._server is None:
            return
        self.stopping.set()
        self.dispatcher.release_waiters()
        for name in ("",) + self.service_names():
            await self._set_health(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        for session in list(self.gateway.sessions.values()):
            session.close(grpc.StatusCode.UNAVAILABLE, "coordinator is shutting down")
        await self._server.stop(self.config.grace_s if grace_s is None else grace_s)
        self._server = None
        await self._sweeper.stop()
        await self.dispatcher.stop()
        await self.advisor.stop()
        if self._smoother is not None:
            self._smoother.cancel()
            try:
                await self._smoother
            except asyncio.CancelledError:
                pass
            self._smoother = None
        if self._metrics_server is not None:
            await self._metrics_server.stop()
            self._metrics_server = None
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        self._background.clear()
        if self.state_writer is not None:
            await self.state_writer.flush()
            self.state_writer = None
        if self.store is not None:
            self._save_learned()
            self.store.close()
        log.info("coordinator_stopped")

    # ---- durable state --------------------------------------------------------
    def _restore(self) -> None:
        """Load the task state of the previous run before serving anything."""
        try:
            # what finished_retention_s let go while the coordinator was down:
            # else a job's id resubmitted just after the restart got its last
            # run's COMPLETED back (not run) until the first prune
            self.store.prune_finished(self.config.finished_retention_s)
        except StateError as exc:  # a read-only or full disk: the load below says so, or works
            log.warning("state_prune_failed", error=str(exc))
        restored = self.store.load()
        report = restore_into(self.dispatcher.engine, restored)
        self.dispatcher.restored(restored.tasks)
        if self.security.quota is not None:
            self.security.quota.rebuild(self.dispatcher.engine.tasks(limit=10**9))
        self.metrics.tenants.rebuild(self.dispatcher.engine.tasks(limit=10**9))
        self.state_writer = self.store.writer()
        self.state_writer.on_failure = self.metrics.state_write_failures.labels("commit").inc
        self.dispatcher.engine.add_listener(self.state_writer.stage)
        self._restore_learned()
        try:
            admin = self.store.load_node_admin()
        except StateError as exc:  # a damaged page costs the cordons (said loudly), not the start
            log.error("node_admin_unreadable", error=str(exc), kept="every node ACTIVE: cordon again what was cordoned")
            admin = {}
        if admin:
            unreadable = self.liveness.restore_admin(admin)
            log.info("node_admin_restored", nodes={k: v for k, v in sorted(admin.items()) if k not in unreadable})
            if unreadable:
                log.warning("node_admin_unreadable", nodes=unreadable, kept="ACTIVE")
        leased_nodes = sorted({t.assignment.node_id for t in restored.tasks if t.state.name == "LEASED" and t.assignment})
        log.info("state_restored", **report.as_dict(), leased_on=leased_nodes)
        if leased_nodes:
            # Reservations wait for their nodes to reconnect for as long as a
            # silent node would stay in the pool; the rest are lost.
            grace = self.config.heartbeat_interval_s * self.config.remove_after_intervals
            self._background.append(asyncio.get_event_loop().create_task(self._expire_absent_nodes(leased_nodes, grace)))

    async def _expire_absent_nodes(self, node_ids: list[str], grace_s: float) -> None:
        await asyncio.sleep(grace_s)
        for node_id in node_ids:
            if node_id not in self.view.nodes:
                log.warning("restored_node_absent", node_id=node_id, grace_s=grace_s)
                self.dispatcher.node_removed(node_id)

    # What the learners learned survives restarts: a coordinator that forgot
    # every GPU's measured speed would place latency-sensitive work by the
    # cluster file's priors again until enough tasks completed, and one that
    # forgot how far tasks outgrow their asks would risk OOM kills it had
    # learned to avoid.
    _LEARNED_SAVE_S = 10.0

    def _learners(self) -> tuple[tuple[str, object], ...]:
        """(name in the state store, learner): each has version, samples,
        to_state and load_state."""
        return (("predictor", self.advisor.predictor), ("memory_growth", self.advisor.growth))

    def _restore_learned(self) -> None:
        for name, learner in self._learners():
            try:
                state = self.store.load_learned(name)
                if state is not None:
                    learner.load_state(state)
                    log.info(f"{name}_restored", samples=learner.samples)
            except (ValueError, StateError) as exc:  # a bad copy costs the learning, not the start
                log.warning(f"{name}_state_unreadable", error=str(exc), kept="priors")
            self._learned_versions[name] = learner.version

    def _save_learned(self) -> None:
        """Store each learner's state if it learned since its last save."""
        for name, learner in self._learners():
            version = learner.version
            if version == self._learned_versions.get(name):
                continue
            try:
                self.store.save_learned(name, learner.to_state())
                self._learned_versions[name] = version
            except StateError as exc:  # a full disk: tried again next time
                self.metrics.state_write_failures.labels("learned").inc()
                log.error(f"{name}_save_failed", error=str(exc))
            except Exception:
                log.exception(f"{name}_save_failed")

    async def _save_learned_loop(self) -> None:
        # at most _LEARNED_SAVE_S of completions are relearned after a crash
        while True:
            await asyncio.sleep(self._LEARNED_SAVE_S)
            self._save_learned()

    #: how often (s) certificates are checked for renewal and for their last days
    CERTIFICATE_CHECK_S = 3600.0

    async def _certificate_loop(self) -> None:
        while True:
            await asyncio.sleep(self.CERTIFICATE_CHECK_S)
            try:
                self.check_certificates()
            except Exception:
                log.exception("certificate_check_failed")

    def check_certificates(self, now_s: float | None = None) -> list[tuple[str, str]]:
        """Take renewed TLS files (even with no handshake to ask for them), and
        log the certificates in their last days, each once a day: the
        coordinator's own (started with them, it would otherwise say nothing
        until a handshake failed) and each connected agent's, whose stream
        outlives it but whose next connection does not. Returns (what, warning)
        pairs, what being a ``tls_*`` option or ``agent:NODE``."""
        now_s = time.time() if now_s is None else now_s
        said: list[tuple[str, str]] = []
        files = self.security.tls_files
        if files is not None:
            files.refresh(force=True)
            paths = files.files()
            for option, not_after in sorted(files.not_after.items()):
                warning = self._expiry_reminder.due(option, not_after, now_s)
                if warning is not None:
                    log.warning("tls_certificate_expires_soon", option=option, file=str(paths[option]), detail=warning)
                    said.append((option, warning))
        connected = set()
        for node_id, session in sorted(self.gateway.sessions.items()):
            if session.certificate_not_after is None:
                continue
            key = f"agent:{node_id}"
            connected.add(key)
            warning = self._expiry_reminder.due(key, session.certificate_not_after, now_s)
            if warning is not None:
                log.warning("agent_certificate_expires_soon", node_id=node_id, detail=warning,
                            consequence="its stream goes on; its next connection is refused until the agent has a renewed --cert-file")
                said.append((key, warning))
        for key in self._expiry_reminder.keys():
            if key.startswith("agent:") and key not in connected:
                self._expiry_reminder.forget(key)  # said afresh if it comes back unrenewed
        return said

    #: finished tasks the prune loop forgets in one turn of the event loop
    #: (5,000: ~2 ms); a backlog goes in slices, other work in between
    PRUNE_SLICE = 5_000

    async def _prune_loop(self) -> None:
        """Forget finished tasks older than finished_retention_s, by their
        finish time, in the engine (GetTask, idempotent resubmission) and in
        the store alike: a restart then changes neither answer. Every minute,
        or as often as a shorter retention (at most once a second)."""
        while True:
            await asyncio.sleep(min(60.0, max(1.0, self.config.finished_retention_s)))
            retention = self.config.finished_retention_s  # live: a reload may change it
            try:
                now = self.clock()
                engine = self.dispatcher.engine
                while engine.prune_finished(retention, now=now, limit=self.PRUNE_SLICE) == self.PRUNE_SLICE:
                    await asyncio.sleep(0)
                if self.store is not None:
                    await asyncio.to_thread(self.store.prune_finished, retention)
            except Exception:
                log.exception("prune_failed")

    def _add_services(self, server: grpc.aio.Server) -> None:
        tpb_grpc.add_SchedulerServicer_to_server(self.scheduler_service, server)
        add_advisor_to_server(self.advisor_service, server)

    def service_names(self) -> tuple[str, ...]:
        return SERVICE_NAMES + (ADVISOR_SERVICE_NAME,)

    async def wait(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

    async def _set_health(self, name: str, status) -> None:
        result = self._health.set(name, status)
        if asyncio.iscoroutine(result):
            await result

    def apply_settings(
        self,
        config: CoordinatorConfig,
        scheduler_config: SchedulerConfig,
        changed: list[str],
        advisor_config: AdvisorConfig | None = None,
    ) -> None:
        """Apply a reloaded configuration's live settings (SIGHUP). The
        scheduler's and the advisor's are validated first, so a bad one
        changes nothing."""
        advisor_changed = advisor_config is not None and any(name.startswith("advisor.") for name in changed)
        if advisor_changed:
            advisor_config.validate()
        if any(name.startswith("scheduler.") for name in changed):
            engine = self.dispatcher.engine
            running = engine.get_policy()
            from_file = "scheduler.policy" in changed or "scheduler.weights" in changed
            if not from_file:
                # Reloading other [scheduler] options keeps the running policy:
                # an operator's SetPolicy (stored, and kept over restarts) must
                # not be undone by a threshold edit in the file. A change of the
                # file's own policy or weights is a newer operator decision.
                scheduler_config = replace(scheduler_config, policy=running.name, weights=dict(running.weights))
            # a lowered tenant_memory_reject_pct can leave queued tasks that no
            # node can ever take: reconfigure rejects them, and the reload says which
            rejected: list = []
            stop_hearing = engine.add_listener(
                lambda task: rejected.append(task) if task.state == TaskState.REJECTED else None)
            try:
                info = engine.reconfigure(scheduler_config)
            finally:
                stop_hearing()
            if rejected:
                log.warning("queued_tasks_rejected", count=len(rejected),
                            tasks=[t.task_id for t in rejected[:_LOGGED_TASKS]],
                            tenants=sorted({t.spec.tenant for t in rejected})[:_LOGGED_TASKS],
                            reason=rejected[0].reason,
                            detail="the reloaded memory thresholds leave no node that could ever take them")
            if from_file and (info.name, info.weights) != (running.name, running.weights):
                log.info("policy_changed", source="configuration", old=running.name, policy=info.name,
                         weights=info.weights)
                if self.state_writer is not None:
                    self.state_writer.stage_policy(info.name, info.weights)  # a restart keeps it
            # the advisor filters destinations with the scheduler's rules
            self.advisor.reconfigure(scheduler_config=self.dispatcher.engine.config)
        if advisor_changed:
            self.advisor.reconfigure(advisor_config)
        live = {name.partition(".")[2] for name in changed if name.startswith("coordinator.")}
        for option in live:
            setattr(self.config, option, getattr(config, option))
        if "staleness_s" in live:
            # the scheduler's bound; agents refresh at half of it (RegisterAck below)
            snapshots = self.dispatcher.snapshots
            self._hold_agents_to("staleness_s", snapshots.staleness_s, config.staleness_s,
                                 wait_s=snapshots.staleness_s, apply=lambda value: setattr(snapshots, "staleness_s", value))
        if "dispatch_interval_s" in live:
            self.dispatcher.interval_s = config.dispatch_interval_s
        if "heartbeat_interval_s" in live:
            liveness = self.liveness
            self._hold_agents_to("heartbeat_interval_s", liveness.heartbeat_interval_s, config.heartbeat_interval_s,
                                 wait_s=liveness.heartbeat_interval_s + liveness.grace_s,
                                 apply=lambda value: setattr(liveness, "heartbeat_interval_s", value))
        if live & {"heartbeat_interval_s", "staleness_s", "keyframe_interval_s"}:
            # Connected agents learn these intervals only from a RegisterAck:
            # without a new one they keep the old heartbeat and refresh
            # periods, and an idle node flaps UNREACHABLE and stale against
            # shorter deadlines.
            told = self.gateway.send_register_acks()
            log.info("agents_told_intervals", streams=told, of=len(self.gateway.sessions),
                     heartbeat_interval_s=self.config.heartbeat_interval_s, staleness_s=self.config.staleness_s)
        if "remove_after_intervals" in live:
            self.liveness.remove_after_intervals = config.remove_after_intervals
        if "max_queued_per_tenant" in live and self.security.quota is not None:
            self.security.quota.limit = config.max_queued_per_tenant or None
        self.dispatcher.snapshots.liveness_changed()
        self.dispatcher.request()

    def _hold_agents_to(self, name: str, current: float, new: float, *, wait_s: float, apply: Callable[[float], None]) -> None:
        """Change a deadline the coordinator holds agents to (``apply(new)``).

        A longer one applies at once, before the agents are told to slow down.
        A shorter one applies only after ``wait_s``, one old interval: an agent
        learns the new interval from the RegisterAck sent with the reload, but
        the one that had just spoken may wait out its old period before its
        next message, and a shorter deadline at once would count that ordinary
        silence against it (UNREACHABLE or stale, then back, on every reload
        that shortens). Another reload before then replaces the pending
        change. Timed in real time, as the agents are."""
        pending = self._deadline_changes.pop(name, None)
        if pending is not None:
            pending.cancel()
        if new >= current:
            apply(new)
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not serving (embedded, a test): no agent to wait for
            apply(new)
            return

        def due() -> None:
            self._deadline_changes.pop(name, None)
            apply(new)
            self.dispatcher.snapshots.liveness_changed()
            log.info("agent_deadline_applied", option=name, value=new)

        self._deadline_changes[name] = loop.call_later(wait_s, due)

    # ---- security and durability hooks ---------------------------------------
    def authorize(self, context, *, admin: bool):
        """The caller's identity; AuthError (turned into its status by the
        security interceptor) when the token is missing or lacks the role."""
        return self.security.authorize(context, admin=admin)

    def authorize_node(self, node_id: str, context) -> tuple[float | None, object | None]:
        """Accept an agent stream registering as ``node_id`` or refuse it
        (``StreamRefused``); returns the notAfter (epoch s) of the client
        certificate the agent presented (None without one), and the token
        entry it registered with (None: it used a certificate)."""
        try:
            identity = self.security.authorize_node(node_id, context)
        except AuthError as exc:
            raise StreamRefused(exc.code, exc.message) from None
        credential = self.security.credential(context) if identity is not None else None
        return self.security.peer_certificate_not_after(context), credential

    def reload_tokens(self, tokens) -> dict:
        """SIGHUP read the token file again (``tokens``, a ``TokenAuth``): new
        calls are checked against it, and streams opened with a token it no
        longer grants (removed, or its role, tenant or nodes changed) end
        UNAUTHENTICATED: watches at their next wait, agent streams now (a
        revoked agent reconnects and is refused). What was revoked, for the
        reload's log line."""
        revoked, watches = self.security.reload_tokens(tokens)
        agents = []
        for node_id, session in list(self.gateway.sessions.items()):
            if session.credential is not None and not tokens.holds(session.credential):
                session.close(grpc.StatusCode.UNAUTHENTICATED, f"node {node_id}: its agent token was revoked "
                              "(the token file was reloaded)")
                agents.append(node_id)
        return {"tokens": len(tokens), "revoked": revoked, "watch_streams_ended": watches,
                "agent_streams_ended": sorted(agents)}

    def tenant_spec(self, identity, spec):
        """A tenant's token fixes the task's tenant."""
        return self.security.tenant_spec(identity, spec)

    def admit_submission(self, identity, spec) -> None:
        """The per-tenant limits (tenant_max_priority, max_queued_per_tenant)
        on a submission; each refusal counts for its tenant in /metrics."""
        self._admit(self.security.admit_submission, identity, spec)

    def admit_submissions(self, identity, specs) -> None:
        self._admit(self.security.admit_submissions, identity, specs)

    def _admit(self, check, identity, what) -> None:
        engine = self.dispatcher.engine
        try:
            check(identity, what, max_priority=engine.config.max_priority_for, known=engine.held_spec)
        except TenantRefusal as exc:
            self.metrics.tenants.refused(exc.tenant, exc.limit)
            raise


    async def check_owner(self, identity, task, context) -> None:
        try:
            self.security.check_owner(identity, task)
        except AuthError as exc:
            await context.abort(exc.code, exc.message)

    def visible_tenant(self, identity, requested: str) -> str:
        return self.security.visible_tenant(identity, requested)

    async def task_accepted(self, task) -> None:
        """Return once the task's record is durable (before the client's ack)."""
        if self.state_writer is not None:
            await self.state_writer.durable()

    task_changed_durably = task_accepted

    async def policy_changed(self, info) -> None:
        if self.state_writer is not None:
            self.state_writer.stage_policy(info.name, info.weights)
            await self.state_writer.durable()

    # ---- agent stream hooks -------------------------------------------------
    def node_registered(self, reg: pb.Register, session: AgentSession) -> NodeRecord:
        now = self.clock()
        self.ingest.forget_node(reg.node_id)  # deltas of the old stream are void
        node = self.view.register(reg, now)
        self.liveness.register(reg.node_id)
        self.dispatcher.snapshots.liveness_changed()
        log.info("node_registered", node_id=reg.node_id, gpus=len(reg.gpus), backend=reg.backend, peer=session.peer)
        return node

    def node_seen(self, node_id: str) -> bool:
        """Any message from a node. False when the node was removed for silence
        while its stream stayed open: it must register again."""
        try:
            return self.liveness.seen(node_id) is not Liveness.REMOVED
        except UnknownNode:
            return False

    def node_disconnected(self, node_id: str) -> None:
        try:
            self.liveness.disconnected(node_id)
        except UnknownNode:
            pass
        self.dispatcher.snapshots.liveness_changed()
        log.info("node_disconnected", node_id=node_id)

    def batch_applied(self, node: NodeRecord, result: DecodeResult, batch: pb.MetricBatch, now_s: float) -> None:
        """An admitted envelope: keyframes apply now, deltas at the next tick."""
        sampled_s = self._replayed_round(node, batch, now_s) if node.replaying else None
        if batch.keyframe:
            outcome = self.ingest.apply_keyframe(node, result.rows, batch, now_s, sampled_s)
            self._after_ingest(outcome)
            if any(r.node_id == node.node_id for r in outcome.rejected):
                return
            before = self.liveness.state(node.node_id).liveness
            if self.liveness.keyframe_applied(node.node_id).liveness is not before:
                # The node became HEALTHY: its room may take queued work now. A
                # periodic keyframe of a healthy node (one per node every 30 s)
                # changes nothing the scheduler sees beyond the values, and a
                # pass per keyframe kept the dispatcher busy back to back at
                # 2,500 nodes; nor is a pass of any use while nothing waits.
                self.dispatcher.snapshots.liveness_changed()
                if self.dispatcher.engine.queued() > 0:
                    self.dispatcher.request()
        else:
            self.ingest.add_delta(node, result.rows, batch, now_s, result.columns, sampled_s)
        if batch.HasField("host_io"):
            io = batch.host_io
            node.disk_await_ms = io.disk_await_us / 1000 if io.HasField("disk_await_us") else None
            node.disk_util_pct = io.disk_util_permille / 10 if io.HasField("disk_util_permille") else None
            self.view.set_disk_await(node, node.disk_await_ms, now_s)
        for entry in batch.processes:
            node.processes[entry.gpu_index] = [(p.pid, p.used_memory_mib) for p in entry.processes]
        if batch.sample_interval_ms != node.sample_interval_ms:
            node.sample_interval_ms = batch.sample_interval_ms
            self.view.set_sample_interval(node, batch.sample_interval_ms)
        self._envelopes_applied += 1
        # the dispatcher hears of the new readings once per tick, after they
        # are in the view (smooth_now), not once per envelope

    def _replayed_round(self, node: NodeRecord, batch: pb.MetricBatch, now_s: float) -> float | None:
        """Until a stream's first live batch: a batch that says no sampling
        period but its sample time is a round the agent sampled while no
        stream was open, replayed from its outage buffer; returns that time
        (s, agent wall clock). The first live batch (a period said; the agent
        sends one right after the replay) fixes the stream's clock offset
        from its own arrival, and so the replay's times on this coordinator's
        clock, whatever the agent's clock is set to. Returns None for it. A
        batch without a sample time is timed by its arrival."""
        if not batch.sample_interval_ms and batch.sampled_at_ns > 0:
            sampled_s = batch.sampled_at_ns * 1e-9
            self.view.replay_batch(node, sampled_s, now_s)
            return sampled_s
        offset_s = now_s - batch.sampled_at_ns * 1e-9 if batch.sampled_at_ns > 0 else None
        self.view.settle_replay(node, offset_s)
        if node.clock_offset_s is not None and node.clock_offset_s != offset_s:
            log.info("replay_timed_by_its_newest_round", node_id=node.node_id,
                     detail="the first live batch says no sample time: the replay is timed as if its newest round were live")
        return None

    def task_event(self, node_id: str, event: pb.TaskEvent) -> None:
        # an end is logged once, by the dispatcher (task_ended_on_node, with
        # its lease): here at debug, where it would be a second line per task
        started = event.kind == pb.TASK_EVENT_KIND_STARTED
        (log.info if started else log.debug)("task_event", node_id=node_id, task_id=event.task_id,
                                             kind=pb.TaskEventKind.Name(event.kind))
        self.dispatcher.task_event(node_id, event)

    def node_admin(self, node_id: str, action: str, reason: str = "") -> None:
        """Operator levers: cordon (no new tasks), drain (no new tasks, running
        ones finish), uncordon."""
        before = self.liveness.state(node_id).admin
        state = getattr(self.liveness, action)(node_id)
        if self.store is not None:
            # at once, not with the next group commit: the operator is told
            # it is done, and a restart must find the node still cordoned
            try:
                self.store.save_node_admin(node_id, state.admin.value)
            except StateError:
                # not stored, so not done: a cordon told "failed" must not
                # hold until the next restart silently drops it
                getattr(self.liveness, _ADMIN_ACTION[before])(node_id)
                self.metrics.state_write_failures.labels("node_admin").inc()
                raise
        self.dispatcher.snapshots.liveness_changed()
        self.view.version += 1
        if action == "uncordon":
            self.dispatcher.request()
        log.info("node_admin", node_id=node_id, action=action, reason=reason)

    def forget_removed_node(self, node_id: str, reason: str = "") -> bool:
        """Uncordon of a node not in the view: forget a REMOVED node's record
        (and its stored cordon or drain). False when no such node is known."""
        try:
            if self.liveness.state(node_id).liveness is not Liveness.REMOVED:
                return False
        except UnknownNode:
            return False
        if self.store is not None:
            try:
                self.store.save_node_admin(node_id, "ACTIVE")
            except StateError:
                self.metrics.state_write_failures.labels("node_admin").inc()
                raise
        self.liveness.forget(node_id)
        log.info("node_forgotten", node_id=node_id, reason=reason)
        return True

    def envelope_bytes(self, size: int) -> None:
        # counted here, published per tick: a locked counter per envelope is
        # measurable at 10k envelopes/s
        self._bytes_received += size

    async def _on_liveness_events(self, events: list[LivenessEvent]) -> None:
        self.dispatcher.snapshots.liveness_changed()
        for event in events:
            self.metrics.node_transitions.labels(event.new.name.lower()).inc()
            # a node lost is on-call news; its coming back or joining is not
            lost = event.new in (Liveness.UNREACHABLE, Liveness.REMOVED)
            extra = {"hint": f"gpulb nodes --removed lists it; gpulb uncordon {event.node_id} forgets it"} \
                if event.new is Liveness.REMOVED else {}
            (log.warning if lost else log.info)("node_state", node_id=event.node_id,
                                                old=event.old.name if event.old else None, new=event.new.name, **extra)
            if event.new is Liveness.REMOVED:
                self.node_removed(event.node_id)

    def node_removed(self, node_id: str) -> None:
        """Three missed heartbeat intervals: the node leaves the pool and the view."""
        self.ingest.forget_node(node_id)
        self.view.remove(node_id)
        self.dispatcher.node_removed(node_id)
        session = self.gateway.sessions.get(node_id)
        if session is not None:
            session.close(grpc.StatusCode.FAILED_PRECONDITION, f"node {node_id} was removed after missing heartbeats; register again")

    async def _smoothing_loop(self) -> None:
        """Applies queued readings to the anomaly filter and EWMA in one
        vectorised pass per tick, and records the ingest delay."""
        tick = self.config.smoothing_tick_s
        histogram = self.metrics.ingest_latency
        while True:
            await asyncio.sleep(tick)
            try:
                self.smooth_now(histogram)
            except Exception:  # one bad tick must not stop smoothing for good
                log.exception("smoothing_failed")

    def _after_ingest(self, outcome) -> None:
        """Close the streams whose telemetry was out of range; remember when
        applied envelopes arrived, for the ingest delay."""
        for rejection in outcome.rejected:
            self.metrics_envelope_rejected(rejection.node_id, rejection.field)
            session = self.gateway.sessions.get(rejection.node_id)
            if session is not None:
                session.close(grpc.StatusCode.INVALID_ARGUMENT, f"telemetry.{rejection.field}: {rejection.message}")
        self._arrivals.extend(outcome.arrivals)

    def smooth_now(self, histogram=None) -> None:
        """Apply pending deltas to the view, then smooth every new reading."""
        self._after_ingest(self.ingest.flush())
        self.view.flush_signals(self.clock())
        if self._envelopes_applied:
            self.metrics.envelopes.inc(self._envelopes_applied)
            self._envelopes_applied = 0
            self.dispatcher.view_changed()  # new readings may have freed room
        if self._bytes_received:
            self.metrics.envelope_bytes.inc(self._bytes_received)
            self._bytes_received = 0
        arrived, self._arrivals = self._arrivals, []
        if not arrived:
            return
        now = self.clock()
        if histogram is not None:
            observe_many(histogram, np.maximum(0.0, now - np.asarray(arrived)))
        counts = self.view.signals.anomaly_counts
        delta = counts - self._anomalies_seen
        for i in np.flatnonzero(delta):
            self.metrics.anomalies.labels(SIGNALS[i]).inc(float(delta[i]))
        self._anomalies_seen = counts.copy()
        shifts = self.view.signals.shift_counts
        delta = shifts - self._shifts_seen
        for i in np.flatnonzero(delta):
            self.metrics.level_shifts.labels(SIGNALS[i]).inc(float(delta[i]))
        self._shifts_seen = shifts.copy()

    def metrics_envelope_rejected(self, node_id: str, field: str) -> None:
        self.rejected_envelopes += 1
        self.metrics.rejected.labels(field.split("[")[0]).inc()

    def metrics_resync(self, node_id: str) -> None:
        self.resync_requests += 1
        self.metrics.resyncs.inc()

    # ---- views for the operator API -----------------------------------------
    def node_state(self, node_id: str) -> int:
        try:
            effective = self.liveness.state(node_id).effective
        except UnknownNode:
            return cpb.NODE_STATE_REMOVED
        return cpb.NodeState.Value("NODE_STATE_" + effective.name)

    def node_message(self, node: NodeRecord) -> cpb.Node:
        return node_message(
            self.view,
            node,
            now_s=self.clock(),
            # the bound placement holds readings to (a shortened one waits an
            # interval after a reload: _hold_agents_to), so the stale flag agrees
            staleness_s=self.dispatcher.snapshots.staleness_s,
            state=self.node_state(node.node_id),
            extras=self.node_extras,
        )

    def node_extras(self, node: NodeRecord, msg: cpb.Node) -> None:
        facts = self.gpu_scheduler_facts()
        msg.active_tasks = sum(facts[g.uuid][1] for g in node.gpus if g.uuid in facts)

    def smoothed_columns(self) -> dict[str, np.ndarray]:
        return {name: self.view.smoothed(name) for name in ("util_gpu_pct", "memory_used_mib", "temperature_c", "power_w")}

    def gpu_scheduler_facts(self) -> dict[str, tuple[float, int]]:
        """GPU uuid -> (reserved MiB, tasks leased on it)."""
        return self.dispatcher.gpu_facts()

    def scheduler_metric_families(self):
        return list(self.dispatcher.metric_families()) + list(self.advisor.collector().collect())

    def gpu_flags(self, msg: cpb.Gpu, flagged: list[bool]) -> None:
        """``flagged``: the GPU's row of the signal bank's anomaly flags, as a list."""
        for flag, name in zip(flagged, SIGNALS):
            if flag:
                msg.flags.append(f"{name.split('_')[0]}_anomaly")
        if msg.HasField("xid_last") and msg.xid_last > 0:
            msg.flags.append(f"xid_{int(msg.xid_last)}")
        if msg.health == pb.GPU_HEALTH_FROZEN:
            msg.flags.append("frozen")
        elif msg.health == pb.GPU_HEALTH_READ_FAILED:
            msg.flags.append("read_failed")
        elif msg.health == pb.GPU_HEALTH_LOST:
            msg.flags.append("lost")
        if msg.stale:
            msg.flags.append("stale")

    def gpu_messages(self, *, node_id: str = "", model: str = "", node_state: int = 0, smoothed: bool = False, metrics,
                     into=None):
        """Gpu messages for the operator API: into the repeated field ``into``
        (a response's ``gpus``), or a list when it is None."""
        nodes = sorted(self.view.nodes.values(), key=lambda n: n.node_id)
        if node_id:
            nodes = [n for n in nodes if n.node_id == node_id]
        if node_state:
            nodes = [n for n in nodes if self.node_state(n.node_id) == node_state]
        columns = self.smoothed_columns() if smoothed else None
        # Whole columns read once, as Python values: per-row numpy scalars
        # cost more than the messages at cluster scale (see convert.gpu_messages).
        signals = self.view.signals
        trend = signals.trend_per_min[:, 0].tolist()
        forecast = signals.forecast[:, 0].tolist()
        flagged = signals.flagged
        anomalous = set(np.flatnonzero(flagged.any(axis=1)).tolist())
        facts = self.gpu_scheduler_facts()
        unhealthy = (pb.GPU_HEALTH_READ_FAILED, pb.GPU_HEALTH_FROZEN, pb.GPU_HEALTH_LOST)

        def extras(node: NodeRecord, row: int, msg: cpb.Gpu) -> None:
            if smoothed:
                if not math.isnan(forecast[row]):
                    msg.util_forecast_pct = forecast[row]
                if not math.isnan(trend[row]):
                    msg.util_trend_pct_per_min = trend[row]
            if row in anomalous or msg.stale or msg.health in unhealthy or msg.xid_last > 0:
                self.gpu_flags(msg, flagged[row].tolist())
            held = facts.get(msg.uuid)
            if held is not None:
                msg.reserved_vram_mib = int(held[0])
                msg.active_tasks = held[1]
            listed = node.processes.get(msg.index)
            for pid, mib in sorted(listed or (), key=lambda p: (-p[1], p[0])):  # most memory first
                msg.processes.add(pid=pid, used_memory_mib=mib)

        return gpu_messages(
            self.view,
            nodes,
            now_s=self.clock(),
            staleness_s=self.dispatcher.snapshots.staleness_s,  # as node_message's
            node_state=self.node_state,
            metrics=metrics,
            smoothed=columns,
            extras=extras,
            model=model,
            into=into,
        )
