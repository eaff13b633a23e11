"""The operator API servicer (gpulb.v1.ClusterOperator): thin, it validates the
request, asks the coordinator, and converts the answer."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from coordinator.convert import UnknownMetric, gpu_messages, node_message, resolve_metrics
from protos import cluster_pb2 as cpb
from protos import cluster_pb2_grpc as cpb_grpc

if TYPE_CHECKING:
    from coordinator.server import Coordinator

__all__ = ["ClusterOperatorService"]


class ClusterOperatorService(cpb_grpc.ClusterOperatorServicer):
    def __init__(self, coordinator: "Coordinator") -> None:
        self.c = coordinator

    async def ListNodes(self, request: cpb.ListNodesRequest, context) -> cpb.ListNodesResponse:
        self.c.authorize(context, admin=False)
        if request.state not in cpb.NodeState.values():
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"state: unknown node state {request.state}")
        nodes = [
            self.c.node_message(node)
            for node in sorted(self.c.view.nodes.values(), key=lambda n: n.node_id)
        ]
        if request.state:
            nodes = [n for n in nodes if n.state == request.state]
        return cpb.ListNodesResponse(nodes=nodes)

    async def GetNode(self, request: cpb.GetNodeRequest, context) -> cpb.Node:
        self.c.authorize(context, admin=False)
        node = self.c.view.nodes.get(request.node_id)
        if node is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"node_id: no node {request.node_id!r}")
        return self.c.node_message(node)

    async def ListGpus(self, request: cpb.ListGpusRequest, context) -> cpb.ListGpusResponse:
        self.c.authorize(context, admin=False)
        try:
            metrics = resolve_metrics(list(request.metrics))
        except UnknownMetric as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if request.values not in cpb.ValueView.values():
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"values: unknown value view {request.values}")
        if request.node_state not in cpb.NodeState.values():
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"node_state: unknown node state {request.node_state}")
        return cpb.ListGpusResponse(gpus=self.c.gpu_messages(
            node_id=request.node_id,
            model=request.model,
            node_state=request.node_state,
            smoothed=request.values == cpb.VALUE_VIEW_SMOOTHED,
            metrics=metrics,
        ))
