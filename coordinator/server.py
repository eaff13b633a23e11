"""The coordinator: one grpc.aio server on one event loop that owns the cluster
view (and, through the scheduler, the queue and leases).

``Coordinator`` wires the servicers to the shared state and runs the
background loops, each with an explicit start and stop.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from coordinator.config import CoordinatorConfig
from coordinator.convert import gpu_messages, node_message
from coordinator.gateway import AgentGateway, AgentSession
from coordinator.operator import ClusterOperatorService
from coordinator.view import ClusterView, NodeRecord
from protos import cluster_pb2 as cpb
from protos import cluster_pb2_grpc as cpb_grpc
from protos import tasks_pb2 as tpb
from protos import telemetry_pb2 as pb
from protos import telemetry_pb2_grpc as pb_grpc
from protos.codec import DecodeResult

__all__ = ["Coordinator"]

log = structlog.get_logger("gpulb.coordinator")

SERVICE_NAMES = (
    pb.DESCRIPTOR.services_by_name["AgentGateway"].full_name,
    cpb.DESCRIPTOR.services_by_name["ClusterOperator"].full_name,
    tpb.DESCRIPTOR.services_by_name["Scheduler"].full_name,
)


class Coordinator:
    def __init__(self, config: CoordinatorConfig | None = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or CoordinatorConfig()
        self.clock = clock
        self.view = ClusterView()
        self.gateway = AgentGateway(self, clock=clock)
        self.operator = ClusterOperatorService(self)
        self._keyframed: set[str] = set()
        self._server: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        self.port: int | None = None
        self.rejected_envelopes = 0
        self.resync_requests = 0

    # ---- lifecycle ----------------------------------------------------------
    async def start(self) -> int:
        cfg = self.config
        options = [
            ("grpc.max_receive_message_length", cfg.max_message_bytes),
            ("grpc.max_send_message_length", cfg.max_message_bytes),
            # agents keep one stream open for days; let their keepalives through
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
            ("grpc.keepalive_permit_without_calls", 1),
        ]
        server = grpc.aio.server(options=options)
        pb_grpc.add_AgentGatewayServicer_to_server(self.gateway, server)
        cpb_grpc.add_ClusterOperatorServicer_to_server(self.operator, server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            SERVICE_NAMES[:2] + (health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            server,
        )
        port = server.add_insecure_port(cfg.listen)
        if port == 0:
            raise OSError(f"listen: cannot bind {cfg.listen}")
        await server.start()
        self._server = server
        self.port = port
        for name in ("",) + SERVICE_NAMES[:2]:
            await self._set_health(name, health_pb2.HealthCheckResponse.SERVING)
        host = cfg.listen.rsplit(":", 1)[0]
        log.info("coordinator_listening", address=f"{host}:{port}", port=port)
        return port

    async def stop(self, grace_s: float | None = None) -> None:
        if self._server is None:
            return
        for name in ("",) + SERVICE_NAMES[:2]:
            await self._set_health(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        for session in list(self.gateway.sessions.values()):
            session.closing.set()
        await self._server.stop(self.config.grace_s if grace_s is None else grace_s)
        self._server = None
        log.info("coordinator_stopped")

    async def wait(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

    async def _set_health(self, name: str, status) -> None:
        result = self._health.set(name, status)
        if asyncio.iscoroutine(result):
            await result

    # ---- security hooks (tokens and mTLS come later) -----------------------
    def authorize(self, context, *, admin: bool) -> None:
        return None

    def authorize_node(self, node_id: str, context) -> None:
        return None

    # ---- agent stream hooks -------------------------------------------------
    def node_registered(self, reg: pb.Register, session: AgentSession) -> NodeRecord:
        now = self.clock()
        node = self.view.register(reg, now)
        self._keyframed.discard(reg.node_id)
        log.info("node_registered", node_id=reg.node_id, gpus=len(reg.gpus), backend=reg.backend, peer=session.peer)
        return node

    def node_seen(self, node_id: str) -> None:
        return None

    def node_disconnected(self, node_id: str) -> None:
        log.info("node_disconnected", node_id=node_id)

    def batch_applied(self, node: NodeRecord, result: DecodeResult, batch: pb.MetricBatch, now_s: float) -> None:
        if batch.keyframe:
            self.view.mark_all_read(node, now_s)
            self._keyframed.add(node.node_id)
        else:
            self.view.apply(node, result.rows, now_s)
        if batch.HasField("host_io"):
            io = batch.host_io
            node.disk_await_ms = io.disk_await_us / 1000 if io.HasField("disk_await_us") else None
            node.disk_util_pct = io.disk_util_permille / 10 if io.HasField("disk_util_permille") else None
        for entry in batch.processes:
            node.processes[entry.gpu_index] = [(p.pid, p.used_memory_mib) for p in entry.processes]
        node.sample_interval_ms = batch.sample_interval_ms

    def task_event(self, node_id: str, event: pb.TaskEvent) -> None:
        log.info("task_event", node_id=node_id, task_id=event.task_id, kind=pb.TaskEventKind.Name(event.kind))

    def metrics_envelope_rejected(self, node_id: str, field: str) -> None:
        self.rejected_envelopes += 1

    def metrics_resync(self, node_id: str) -> None:
        self.resync_requests += 1

    # ---- views for the operator API -----------------------------------------
    def node_state(self, node_id: str) -> int:
        if node_id not in self.view.nodes:
            return cpb.NODE_STATE_REMOVED
        if node_id not in self._keyframed:
            return cpb.NODE_STATE_CONNECTING
        return cpb.NODE_STATE_HEALTHY

    def node_message(self, node: NodeRecord) -> cpb.Node:
        return node_message(
            self.view, node, now_s=self.clock(), staleness_s=self.config.staleness_s, state=self.node_state(node.node_id)
        )

    def gpu_messages(self, *, node_id: str = "", model: str = "", node_state: int = 0, smoothed: bool = False, metrics) -> list[cpb.Gpu]:
        nodes = sorted(self.view.nodes.values(), key=lambda n: n.node_id)
        if node_id:
            nodes = [n for n in nodes if n.node_id == node_id]
        if node_state:
            nodes = [n for n in nodes if self.node_state(n.node_id) == node_state]
        gpus = gpu_messages(
            self.view,
            nodes,
            now_s=self.clock(),
            staleness_s=self.config.staleness_s,
            node_state=self.node_state,
            metrics=metrics,
            smoothed=None,
        )
        if model:
            needle = model.lower()
            gpus = [g for g in gpus if needle in g.model.lower()]
        return gpus
