"""The operator API servicer (gpulb.v1.ClusterOperator): thin, it validates the
request, asks the coordinator, and converts the answer."""

from __future__ import annotations

import asyncio
import math
import time
from time import time_ns
from typing import TYPE_CHECKING

import grpc

from coordinator.convert import UnknownMetric, resolve_metrics
from coordinator.liveness import UnknownNode
from coordinator.shutdown import or_shutdown
from coordinator.state import StateError
from scheduler.task import MAX_REASON_LEN
from protos import cluster_pb2 as cpb
from protos import cluster_pb2_grpc as cpb_grpc

if TYPE_CHECKING:
    from coordinator.server import Coordinator

__all__ = ["ClusterOperatorService"]


class ClusterOperatorService(cpb_grpc.ClusterOperatorServicer):
    #: a watcher takes an update built this recently (s) though the view moved
    #: since: the 200 ms floor of min_interval_ms, and below the 200 ms-2 s
    #: the agents sample at, so what it shows is no older than a reading is
    SHARE_S = 0.2
    #: updates built longer ago than this (s) are dropped when one is built
    #: (a watcher of one node that left, say)
    KEEP_S = 10.0

    def __init__(self, coordinator: "Coordinator", clock=time.monotonic) -> None:
        self.c = coordinator
        self.clock = clock
        self._all_metrics = resolve_metrics([])
        # (node_id, smoothed) -> ((view version, liveness version), built at, update)
        self._updates: dict[tuple[str, bool], tuple[tuple[int, int], float, cpb.ViewUpdate]] = {}
        self.builds = 0  # updates built, for tests and benchmarks

    async def ListNodes(self, request: cpb.ListNodesRequest, context) -> cpb.ListNodesResponse:
        self.c.authorize(context, admin=False)
        if request.state not in cpb.NodeState.values():
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"state: unknown node state {request.state}")
        # filtered before the messages are built (each reads its GPUs'
        # reservations): gpulb nodes asks a second time for the removed ones
        nodes = [
            self.c.node_message(node)
            for node in sorted(self.c.view.nodes.values(), key=lambda n: n.node_id)
            if not request.state or self.c.node_state(node.node_id) == request.state
        ]
        if request.state == cpb.NODE_STATE_REMOVED:
            # they left the view, not the liveness records: what
            # gpulb_nodes{state="removed"} counts (and GpulbNodeUnreachable
            # fires on) until they register again or UncordonNode forgets them
            nodes.extend(self._removed_nodes())
            nodes.sort(key=lambda n: n.node_id)
        return cpb.ListNodesResponse(nodes=nodes)

    def _removed_nodes(self) -> list[cpb.Node]:
        """The REMOVED nodes not in the view, as much as is known of them: the
        id, the state and, for one removed for silence in this run, when its
        last message came (0 for one recorded as REMOVED from a stored cordon
        at start: never heard from since)."""
        liveness, view, wall = self.c.liveness, self.c.view, self.c.dispatcher.wall
        out = []
        for node_id in sorted(n for n in liveness.removed() if n not in view.nodes):
            try:
                state = liveness.state(node_id)
            except UnknownNode:
                continue
            heard = state.since_s > state.last_seen_s  # removed after a silence, not restored so
            out.append(cpb.Node(node_id=node_id, state=cpb.NODE_STATE_REMOVED, reading_age_s=-1.0, stale=True,
                                last_heartbeat_ns=wall.ns(state.last_seen_s) if heard else 0))
        return out

    async def GetNode(self, request: cpb.GetNodeRequest, context) -> cpb.Node:
        self.c.authorize(context, admin=False)
        await _node_id_given(request.node_id, context)
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
        if request.node_id and request.node_id not in self.c.view.nodes:
            # a mistyped node is not an empty one (WatchView and GetNode say so too)
            await context.abort(grpc.StatusCode.NOT_FOUND, f"node_id: no node {request.node_id!r}")
        response = cpb.ListGpusResponse()
        self.c.gpu_messages(
            node_id=request.node_id,
            model=request.model,
            node_state=request.node_state,
            smoothed=request.values == cpb.VALUE_VIEW_SMOOTHED,
            metrics=metrics,
            into=response.gpus,  # built in place: copying 8,000 messages into a response took 5 ms
        )
        return response

    async def WatchView(self, request: cpb.WatchViewRequest, context):
        """A snapshot now, then an update (at most one per min_interval_ms)
        whenever readings or a node's state change, and at least every
        max(min_interval_ms, staleness_s / 2) though nothing does.

        A node's state (UNREACHABLE, REMOVED, cordoned...) comes from the
        liveness tracker, not the view, so its version counts as a change
        too. Ages and stale flags move with time alone: without the refresh a
        watcher kept the last ones it was sent, and a stopped agent's node
        showed "HEALTHY, 0.6 s old" until it left the view. Half the
        staleness bound is the cadence at which an idle agent vouches for
        its readings (RegisterAck.refresh_interval_ms): the ages shown lag
        no more than an idle node's own do, and a stale flag shows at most
        half a bound late. It costs one build per watched filter per
        interval (~57 ms at 8,000 GPUs, every 5 s by default), shared by
        all its watchers."""
        self.c.authorize(context, admin=False)
        if request.node_id and request.node_id not in self.c.view.nodes:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"node_id: no node {request.node_id!r}")
        interval_ms = request.min_interval_ms or 1000
        if interval_ms < 200:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"min_interval_ms: {interval_ms} is below the 200 ms floor")
        smoothed = request.values == cpb.VALUE_VIEW_SMOOTHED
        # admitted once the request is known good (a refused one holds no
        # slot); the slot goes back however the stream ends: the client
        # cancels, the coordinator stops (or_shutdown aborts), an error
        with self.c.security.admit_watch(context, self.c.config) as slot:
            last = None
            while True:
                refresh_s = max(interval_ms / 1000, self.c.config.staleness_s / 2)  # staleness_s may change on SIGHUP
                _, update = self.view_update(request.node_id, smoothed, max_age_s=refresh_s)
                if update is not last:  # a new build: something changed, or the last one got old
                    last = update
                    yield update
                await or_shutdown(asyncio.sleep(interval_ms / 1000), self.c.stopping, context, slot.revoked)

    def view_update(self, node_id: str, smoothed: bool,
                    max_age_s: float = math.inf) -> tuple[tuple[int, int], cpb.ViewUpdate]:
        """((view version, liveness version), ViewUpdate) for a watcher,
        shared by all watchers of the same nodes and values: one built while
        neither the view nor any node's state has changed, and less than
        ``max_age_s`` ago, or one built within SHARE_S whatever changed since,
        serves them all (its ``at_ns`` says when it was built). Each costs
        ~57 ms of the event loop at 8,000 GPUs, and a view fed by agents
        changes on every batch, so without it every dashboard or grpcurl
        watcher paid that again."""
        key = (node_id, smoothed)
        now = self.clock()
        version = (self.c.view.version, self.c.liveness.version)
        cached = self._updates.get(key)
        if cached is not None:
            age = now - cached[1]
            if age < self.SHARE_S or (cached[0] == version and age < max_age_s):
                return cached[0], cached[2]
        nodes = [self.c.node_message(n) for n in sorted(self.c.view.nodes.values(), key=lambda n: n.node_id)
                 if not node_id or n.node_id == node_id]
        update = cpb.ViewUpdate(at_ns=time_ns(), nodes=nodes)
        self.c.gpu_messages(node_id=node_id, smoothed=smoothed, metrics=self._all_metrics, into=update.gpus)
        for old in [k for k, (_, built, _) in self._updates.items() if now - built > self.KEEP_S]:
            del self._updates[old]
        self.builds += 1
        self._updates[key] = (version, now, update)
        return version, update

    async def _node_action(self, request: cpb.NodeActionRequest, context, action: str) -> cpb.NodeActionResponse:
        self.c.authorize(context, admin=True)
        await _node_id_given(request.node_id, context)
        if len(request.reason) > MAX_REASON_LEN:
            # logged and stored with the cordon: bounded as a cancel reason is
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"reason: {len(request.reason):,} characters; at most {MAX_REASON_LEN:,}")
        if request.node_id not in self.c.view.nodes:
            try:
                forgotten = action == "uncordon" and self.c.forget_removed_node(request.node_id, request.reason)
            except StateError as exc:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"state: could not forget the stored cordon ({exc}); "
                                    "nothing changed; retry")
            # and its learned speed residual (saved with the learners), also of a
            # node gone before a restart, which liveness no longer knows
            if action == "uncordon" and self.c.advisor.predictor.forget_node(request.node_id):
                forgotten = True
            if forgotten:
                # a node that left the pool (decommissioned, or kept cordoned over a
                # restart): its record and stored cordon go, and with them its count
                # in gpulb_nodes{state="removed"} and the alert on it
                return cpb.NodeActionResponse(node=cpb.Node(node_id=request.node_id, state=cpb.NODE_STATE_REMOVED))
            await context.abort(grpc.StatusCode.NOT_FOUND, f"node_id: no node {request.node_id!r}")
        try:
            self.c.node_admin(request.node_id, action, request.reason)
        except UnknownNode:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"node_id: no node {request.node_id!r}")
        except StateError as exc:  # not stored, so not made (Coordinator.node_admin)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"state: could not store the {action} ({exc}); "
                                "nothing changed; retry")
        return cpb.NodeActionResponse(node=self.c.node_message(self.c.view.nodes[request.node_id]))

    async def CordonNode(self, request, context):
        return await self._node_action(request, context, "cordon")

    async def DrainNode(self, request, context):
        return await self._node_action(request, context, "drain")

    async def UncordonNode(self, request, context):
        return await self._node_action(request, context, "uncordon")


async def _node_id_given(node_id: str, context) -> None:
    """An empty node_id is a malformed request, not a node that is not there."""
    if not node_id:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "node_id: required (a Node.node_id; ListNodes lists them)")
