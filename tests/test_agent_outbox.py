"""What the coordinator sends down an agent's stream: task placements and
releases are never dropped, however many one call makes; an agent that
heartbeats but does not read has its stream closed, and its registration then
gets it every placement it missed. A real coordinator on loopback, a
simulated host's own Agent, and a raw stream for the agent that does not read."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from waiting import until
from agent.fleet import SimFleet
from coordinator.config import CoordinatorConfig
from coordinator.server import Coordinator
from protos import tasks_pb2 as tpb
from protos import tasks_pb2_grpc as tpb_grpc
from protos import telemetry_pb2 as pb
from protos import telemetry_pb2_grpc as pb_grpc
from protos.codec import LOWER, TelemetryEncoder
from protos.fields import BY_NAME
from scheduler.config import SchedulerConfig

pytestmark = pytest.mark.timeout(90)

#: a documented maximum: one ScheduleTasks call, ``gpulb submit --array 1000``
ARRAY = 1000


def _tiny(task_id: str, **kw) -> tpb.TaskSpec:
    return tpb.TaskSpec(task_id=task_id, vram_mib=16, gpu_share=0.0, kind="batch", priority=tpb.PRIORITY_P3, **kw)


async def test_a_full_job_array_and_the_releases_of_its_leases_all_reach_a_reading_host():
    # every lease of the array ends in one dispatch pass: 1,000 releases at once
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", dispatch_interval_s=0.1),
                        scheduler_config=SchedulerConfig(lease_s=6.0))
    port = await coord.start()
    target = f"127.0.0.1:{port}"
    try:
        async with SimFleet(target, hosts=1, gpus=2, workload="idle") as fleet:
            agent = fleet.agents[0]
            await until(lambda: coord.dispatcher.snapshots.snapshot().healthy.sum() == 2, what="2 healthy GPUs")
            async with grpc.aio.insecure_channel(target) as ch:
                stub = tpb_grpc.SchedulerStub(ch)
                specs = [_tiny(f"arr-{i}") for i in range(ARRAY)]
                tasks = (await stub.ScheduleTasks(tpb.ScheduleTasksRequest(specs=specs), timeout=30)).tasks
                assert all(t.state == tpb.TASK_STATE_LEASED for t in tasks)
                await until(lambda: len(agent.backend.running_task_ids()) == ARRAY, timeout=15,
                            what=f"all {ARRAY} placements on the host")
                await until(lambda: agent.backend.running_task_ids() == [], timeout=30,
                            what=f"all {ARRAY} releases carried out on the host")
            assert all(coord.dispatcher.engine.get(s.task_id).state.name == "EXPIRED" for s in specs)
            # on the one stream: no reconnect (whose registration would set things right) was needed
            assert agent.stats.sessions == 1
            session = coord.gateway.sessions[agent.config.node_id]
            assert not session.dropped and coord.gateway.closed_not_reading == 0
    finally:
        await coord.stop(grace_s=0.1)


def test_placements_and_releases_are_never_dropped_and_chatter_is_bounded():
    from coordinator.gateway import CHATTER_KEPT, AgentSession

    session = AgentSession(node_id="n", peer="test")
    hint = pb.CoordinatorMessage(sampling_hint=pb.SamplingHint(interval_ms=200, duration_ms=10_000))
    for i in range(5_000):  # as one pass placing 5,000 tasks queues them
        assert session.send(pb.CoordinatorMessage(place=pb.TaskPlacement(task_id=f"t-{i}")))
        assert session.send(hint)  # the same fast sampling: asked for once
    for i in range(5_000):
        assert session.send(pb.CoordinatorMessage(release=pb.TaskRelease(task_id=f"t-{i}")))
    acks = [session.send(pb.CoordinatorMessage(ack=pb.Ack(seq=i))) for i in range(2 * CHATTER_KEPT)]
    assert acks.count(True) == CHATTER_KEPT - 1 and session.dropped == {"ack": CHATTER_KEPT + 1}
    order = []
    while (msg := session.next_message()) is not None:
        order.append(msg.WhichOneof("body"))
    # control first, in order; then what helps
    assert order[:10_000] == ["place"] * 5_000 + ["release"] * 5_000
    assert sorted(order[10_000:]) == ["ack"] * (CHATTER_KEPT - 1) + ["sampling_hint"]
    assert session.send(hint)  # none waits now: queued again


class _DeafAgent:
    """A raw stream for a 4-GPU simulated host: registers, sends a keyframe,
    then an envelope every 0.2 s (so it stays HEALTHY and heartbeating),
    and reads nothing until ``read_all``."""

    def __init__(self, port: int, node_id: str, running: list[str] = ()) -> None:
        # a fixed 64 KiB receive window (no growing it by bandwidth probes):
        # the writer blocks once about 1,500 messages are unread, not after MBs
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.http2.bdp_probe", 0)])
        self.register = pb.Register(
            node_id=node_id, backend="sim", session_id=7, labels={"role": "deaf"}, running_task_ids=list(running),
            gpus=[pb.GpuInfo(index=i, uuid=f"GPU-deaf-{i}", model="X", memory_total_mib=80_000) for i in range(4)])
        self.stop = asyncio.Event()
        self.call = pb_grpc.AgentGatewayStub(self.channel).Connect(self._messages())

    async def _messages(self):
        yield pb.AgentMessage(register=self.register)
        encoder = TelemetryEncoder([0, 1, 2, 3])
        values = np.tile(np.maximum(LOWER, 1), (4, 1))
        values[:, BY_NAME["memory_total_mib"]] = 80_000
        present = np.ones_like(values, bool)
        tick = 0
        while not self.stop.is_set():
            envelope, _ = encoder.encode(values, present, now_s=tick, sampled_at_ns=tick)
            yield pb.AgentMessage(telemetry=envelope)
            tick += 1
            try:
                await asyncio.wait_for(self.stop.wait(), 0.2)
            except asyncio.TimeoutError:
                pass

    async def read_all(self, timeout: float) -> tuple[list[pb.CoordinatorMessage], grpc.StatusCode, str]:
        """Every message the coordinator sent, then the status it ended with
        (``None`` while the stream is still open after ``timeout``)."""
        got = []
        try:
            while (msg := await asyncio.wait_for(self.call.read(), timeout)) is not grpc.aio.EOF:
                got.append(msg)
        except grpc.aio.AioRpcError as exc:
            return got, exc.code(), exc.details()
        except asyncio.TimeoutError:
            return got, None, ""
        return got, await self.call.code(), await self.call.details()

    async def close(self) -> None:
        self.stop.set()
        self.call.cancel()
        await self.channel.close()


async def test_an_agent_that_does_not_read_is_closed_and_its_registration_gets_every_placement():
    # heartbeat timeout 1 s + 1 s grace: a message unwritten for 2 s means the agent is not reading;
    # its node is removed (its leases lost) only after 30 s without a stream
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", dispatch_interval_s=0.1, heartbeat_interval_s=1.0,
                                          remove_after_intervals=30))
    port = await coord.start()
    target = f"127.0.0.1:{port}"
    deaf = _DeafAgent(port, "deaf-1")
    again = None
    fleet = SimFleet(target, hosts=1, gpus=1, workload="idle", heartbeat_interval_s=0.5)  # everyone else
    await fleet.__aenter__()
    try:
        await until(lambda: coord.dispatcher.snapshots.snapshot().healthy.sum() == 5, what="the deaf host healthy")
        async with grpc.aio.insecure_channel(target) as ch:
            stub = tpb_grpc.SchedulerStub(ch)
            # more than the stream's transport holds unread (about 1,000 messages): the writer blocks
            ids = []
            for batch in range(3):
                specs = [_tiny(f"deaf-{batch}-{i}", required_node_labels={"role": "deaf"}) for i in range(ARRAY)]
                tasks = (await stub.ScheduleTasks(tpb.ScheduleTasksRequest(specs=specs), timeout=30)).tasks
                assert all(t.state == tpb.TASK_STATE_LEASED and t.assignment.node_id == "deaf-1" for t in tasks), tasks[0]
                ids += [s.task_id for s in specs]

            # the agent keeps writing, so only its not reading tells: closed within the bound and a write or two
            await until(lambda: "deaf-1" not in coord.gateway.sessions, timeout=15, what="the deaf stream closed")
            assert coord.gateway.closed_not_reading == 1
            scrape = coord.metrics.exposition(per_gpu=False).decode()
            assert "gpulb_agent_streams_closed_not_reading_total 1.0" in scrape  # what an operator sees
            got, code, detail = await deaf.read_all(timeout=10)
            # The status reaches a peer that does not read only when the
            # coordinator's cancelled write had not yet been handed to gRPC's
            # core; with a write still pending there (more often on a loaded
            # machine: 2 runs in 4 with four at once, at 07c2242 too) the abort
            # ends the call as "Internal error from Core". Either way the
            # stream is closed, counted, and the registration below sets the
            # node's tasks right, which is what this test is about.
            assert code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL), (code, detail)
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                assert "not reading its stream" in detail and "deaf-1" in detail
            placed = {m.place.task_id for m in got if m.WhichOneof("body") == "place"}
            assert 0 < len(placed) < len(ids)  # what it read before the stream closed
            # the leases stay: closing a stream is not losing a node
            assert all(coord.dispatcher.engine.get(i).state.name == "LEASED" for i in ids)
            await deaf.close()

            # it reconnects saying what it runs: the registration places the rest again
            again = _DeafAgent(port, "deaf-1", running=sorted(placed))
            await until(lambda: "deaf-1" in coord.gateway.sessions, what="the host registered again")
            more = []
            while len(placed) + len(more) < len(ids):
                msg = await asyncio.wait_for(again.call.read(), 10)
                assert msg is not grpc.aio.EOF, "stream ended before every placement arrived"
                if msg.WhichOneof("body") == "place":
                    more.append(msg.place.task_id)
            assert set(more) == set(ids) - placed and len(more) == len(set(more))
            assert "deaf-1" in coord.gateway.sessions  # reading now, it is not closed
        # the other host's stream was never disturbed
        assert fleet.agents[0].stats.sessions == 1 and "sim-01" in coord.gateway.sessions
    finally:
        await fleet.__aexit__(None, None, None)
        await deaf.close()
        if again is not None:
            await again.close()
        await coord.stop(grace_s=0.1)
