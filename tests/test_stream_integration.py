"""A real coordinator on a loopback port and real agents (sim backend) streaming
to it: the view must hold exactly what the agents sent, survive a coordinator
restart, and keep serving everyone when one stream sends garbage."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from waiting import until as _eventually
from agent.client import Agent, AgentConfig
from agent.sim import SimBackend
from coordinator.config import CoordinatorConfig
from coordinator.server import Coordinator
from protos import cluster_pb2 as cpb
from protos import cluster_pb2_grpc as cpb_grpc
from protos import telemetry_pb2 as pb
from protos import telemetry_pb2_grpc as pb_grpc
from protos.fields import BY_NAME

pytestmark = pytest.mark.timeout(60)


def _agent(node_id: str, port: int, seed: int, gpus: int = 4) -> Agent:
    cfg = AgentConfig(
        node_id=node_id,
        coordinator=f"127.0.0.1:{port}",
        interval_min_s=0.05,
        interval_max_s=0.1,
        backoff_initial_s=0.05,
        backoff_max_s=0.2,
    )
    return Agent(cfg, SimBackend(gpus=gpus, seed=seed), seed=seed)



async def _list_gpus(port: int, **kw) -> list[cpb.Gpu]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        return list((await cpb_grpc.ClusterOperatorStub(ch).ListGpus(cpb.ListGpusRequest(**kw))).gpus)


def _matches_last_sent(gpus: list[cpb.Gpu], agents: list[Agent]) -> bool:
    by_key = {(g.node_id, g.index): g for g in gpus}
    for agent in agents:
        values, known = agent.encoder.last_sent
        for row, index in enumerate(agent.gpu_order):
            gpu = by_key.get((agent.config.node_id, index))
            if gpu is None:
                return False
            for field, column in (("util_gpu_pct", "util_gpu_pct"), ("memory_used_mib", "memory_used_mib"), ("temperature_c", "temperature_c")):
                col = BY_NAME[column]
                if not known[row, col] or not gpu.HasField(field) or getattr(gpu, field) != values[row, col]:
                    return False
            if not gpu.HasField("power_w") or gpu.power_w != values[row, BY_NAME["power_w"]]:
                return False
    return True


async def test_two_agents_view_matches_samples_and_survives_restart():
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0"))
    port = await coord.start()
    agents = [_agent("node-a", port, 1), _agent("node-b", port, 2, gpus=2)]
    tasks = [asyncio.create_task(a.run()) for a in agents]
    try:
        await _eventually(lambda: all(a.connected.is_set() for a in agents), what="agents streaming")
        gpus = await _eventually(lambda: _ready(port, 6), what="6 GPUs in the view")
        assert {(g.node_id, g.index) for g in gpus} == {("node-a", i) for i in range(4)} | {("node-b", i) for i in range(2)}
        # Freeze the agents, then the view must equal what they last sent.
        for a in agents:
            await a.stop()
        await asyncio.gather(*tasks)

        async def settled():
            return _matches_last_sent(await _list_gpus(port), agents)

        await _eventually(settled, what="view == agents' last sent values")
        gpus = await _list_gpus(port)
        for g in gpus:
            assert g.model == "NVIDIA GeForce RTX 4090"
            assert g.memory_total_mib == 24564
            assert 0 <= g.util_gpu_pct <= 100
            assert g.health == pb.GPU_HEALTH_OK

        # Restart the coordinator on the same port: agents reconnect, view is whole.
        agents = [_agent("node-a", port, 1), _agent("node-b", port, 2, gpus=2)]
        tasks = [asyncio.create_task(a.run()) for a in agents]
        await _eventually(lambda: all(a.connected.is_set() for a in agents), what="agents streaming")
        await coord.stop(grace_s=0.1)
        coord = Coordinator(CoordinatorConfig(listen=f"127.0.0.1:{port}"))
        await coord.start()
        assert not coord.view.nodes
        await _eventually(lambda: _ready(port, 6), what="view whole again after restart")
        assert all(a.stats.sessions >= 2 for a in agents)
        assert all(a.stats.keyframes >= 2 for a in agents)
    finally:
        for a in agents:
            await a.stop()
        await asyncio.gather(*tasks, return_exceptions=True)
        await coord.stop(grace_s=0.1)


async def test_node_shows_the_agents_sampling_period_as_it_calms_down():
    """An idle host backs off to its slowest period and ListNodes says so,
    though its readings stopped moving and it sends no values."""
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0"))
    port = await coord.start()
    cfg = AgentConfig(node_id="calm", coordinator=f"127.0.0.1:{port}", interval_min_s=0.05, interval_max_s=0.2)
    agent = Agent(cfg, SimBackend(gpus=2, seed=3, workload="idle"), seed=3)
    task = asyncio.create_task(agent.run())

    async def period_ms():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            nodes = (await cpb_grpc.ClusterOperatorStub(ch).ListNodes(cpb.ListNodesRequest())).nodes
        return nodes[0].sample_interval_ms if nodes else None

    try:
        assert await _eventually(lambda: _expect(period_ms(), 200), what="node at its slowest period, 200 ms") == 200
        assert agent.sampler.current_s == pytest.approx(0.2)
    finally:
        await agent.stop()
        await asyncio.gather(task, return_exceptions=True)
        await coord.stop(grace_s=0.1)


async def test_a_quiet_host_stays_fresh_though_its_readings_do_not_move():
    """An idle GPU's readings stop moving, so the agent has nothing to send;
    its empty deltas (every half staleness bound, as the coordinator asks)
    keep the node's readings fresh: not stale, so not taken out of placement."""
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", staleness_s=1.0))
    port = await coord.start()
    cfg = AgentConfig(node_id="idle", coordinator=f"127.0.0.1:{port}", interval_min_s=0.05, interval_max_s=0.2)
    agent = Agent(cfg, SimBackend(gpus=2, seed=3, workload="idle"), seed=3)
    task = asyncio.create_task(agent.run())
    try:
        await _eventually(lambda: _ready(port, 2), what="GPUs in the view")
        assert agent.encoder.refresh_interval_s == pytest.approx(0.5)  # from the RegisterAck
        samples_then = agent.stats.samples
        await asyncio.sleep(2.5)  # > 2 staleness bounds of unchanged readings
        assert agent.stats.samples > samples_then  # still sampling: nothing moved
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            node = (await cpb_grpc.ClusterOperatorStub(ch).ListNodes(cpb.ListNodesRequest())).nodes[0]
            gpus = (await cpb_grpc.ClusterOperatorStub(ch).ListGpus(cpb.ListGpusRequest())).gpus
        assert not node.stale and node.reading_age_s < 1.0
        assert not any(g.stale for g in gpus)
    finally:
        await agent.stop()
        await asyncio.gather(task, return_exceptions=True)
        await coord.stop(grace_s=0.1)


async def test_a_nodes_last_heartbeat_is_its_last_message_of_any_kind():
    """Node.last_heartbeat_ns says when the node was last heard from, as
    liveness counts it. With the default intervals a streaming agent never
    needs a Heartbeat message (its telemetry comes more often), so any
    message must set it, and each later one move it on."""
    import time

    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0"))
    port = await coord.start()
    before_ns = time.time_ns()
    agent = _agent("talker", port, seed=5, gpus=1)
    task = asyncio.create_task(agent.run())

    async def heard_ns(after_ns: int = 0):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            node = await cpb_grpc.ClusterOperatorStub(ch).GetNode(cpb.GetNodeRequest(node_id="talker"))
        return node.last_heartbeat_ns if node.last_heartbeat_ns > after_ns else None

    try:
        await _eventually(lambda: _ready(port, 1), what="the GPU in the view")
        first = await _eventually(heard_ns, what="last_heartbeat_ns set")
        assert before_ns <= first <= time.time_ns()
        later = await _eventually(lambda: heard_ns(first), what="last_heartbeat_ns moved on by a later message")
        assert later <= time.time_ns()
        assert agent.stats.heartbeats == 0  # telemetry alone set it
    finally:
        await agent.stop()
        await asyncio.gather(task, return_exceptions=True)
        await coord.stop(grace_s=0.1)


async def _expect(value, wanted):
    got = await value
    return got if got == wanted else None


async def _ready(port: int, count: int):
    try:
        gpus = await _list_gpus(port)
    except grpc.aio.AioRpcError:
        return None
    full = [g for g in gpus if g.HasField("util_gpu_pct") and g.HasField("memory_used_mib")]
    return gpus if len(full) == count else None


def _register(node_id: str, gpus: int = 2, **fields) -> pb.AgentMessage:
    return pb.AgentMessage(
        register=pb.Register(
            node_id=node_id,
            backend="sim",
            gpus=[pb.GpuInfo(index=i, uuid=f"GPU-{i}", model="X", memory_total_mib=1000) for i in range(gpus)],
            **fields,
        )
    )


def _event(task_id: str, **fields) -> pb.AgentMessage:
    return pb.AgentMessage(task_event=pb.TaskEvent(task_id=task_id, kind=pb.TASK_EVENT_KIND_FINISHED, **fields))


async def _raw_stream(port: int, messages: list[pb.AgentMessage]) -> tuple[grpc.StatusCode, str] | None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        async def requests():
            for m in messages:
                yield m
                await asyncio.sleep(0.01)

        call = pb_grpc.AgentGatewayStub(ch).Connect(requests())
        try:
            async for _ in call:  # unread replies would mask the status
                pass
        except grpc.aio.AioRpcError:
            pass
        code = await call.code()
        if code == grpc.StatusCode.OK:
            return None
        return code, await call.details()


@pytest.mark.parametrize(
    "messages, code, needle",
    [
        ([pb.AgentMessage(heartbeat=pb.Heartbeat())], grpc.StatusCode.FAILED_PRECONDITION, "register"),
        ([_register("bad id!")], grpc.StatusCode.INVALID_ARGUMENT, "register.node_id"),
        ([_register("n", gpus=0)], grpc.StatusCode.INVALID_ARGUMENT, "register.gpus"),
        # these reach ListNodes and Prometheus labels: bounded
        ([_register("n", driver_version="5" * 129)], grpc.StatusCode.INVALID_ARGUMENT, "register.driver_version"),
        ([_register("n", hostname="h" * 256)], grpc.StatusCode.INVALID_ARGUMENT, "register.hostname"),
        (
            [_register("bad-env"), pb.AgentMessage(telemetry=pb.Envelope(seq=1, compression=pb.COMPRESSION_SNAPPY, raw_size=4, payload=b"\xff\xff\xff"))],
            grpc.StatusCode.INVALID_ARGUMENT,
            "telemetry.payload",
        ),
        (
            [_register("bomb"), pb.AgentMessage(telemetry=pb.Envelope(seq=1, compression=pb.COMPRESSION_SNAPPY, raw_size=5, payload=b"\x80\x80\x80\x80\x0f"))],
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "telemetry.payload",
        ),
        ([_register("twice"), _register("twice")], grpc.StatusCode.FAILED_PRECONDITION, "register"),
        # logged with the event before the id is looked up: bounded (50 events with 3.9 MB ids wrote 195 MB of log)
        ([_register("ev"), _event("t" * 129)], grpc.StatusCode.INVALID_ARGUMENT, "task_event.task_id: 129 characters"),
        ([_register("ev"), _event("")], grpc.StatusCode.INVALID_ARGUMENT, "task_event.task_id: 0 characters"),
        ([_register("ev"), _event("t", detail="d" * 1025)], grpc.StatusCode.INVALID_ARGUMENT,
         "task_event.detail: 1025 characters; at most 1024"),
    ],
)
async def test_bad_stream_gets_precise_status_while_others_keep_flowing(messages, code, needle):
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0"))
    port = await coord.start()
    good = _agent("good", port, 7, gpus=2)
    task = asyncio.create_task(good.run())
    try:
        await _eventually(lambda: good.connected.is_set(), what="good agent streaming")
        before = good.stats.envelopes
        error = await asyncio.wait_for(_raw_stream(port, messages + [pb.AgentMessage(heartbeat=pb.Heartbeat())] * 3), 10)
        assert error is not None and error[0] == code, error
        assert needle in error[1]
        await _eventually(lambda: good.stats.envelopes > before + 2, what="good agent still streaming")
        assert good.stats.sessions == 1
        assert "good" in coord.gateway.sessions
    finally:
        await good.stop()
        await task
        await coord.stop(grace_s=0.1)


async def test_newer_stream_for_same_node_wins_and_older_is_aborted():
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0"))
    port = await coord.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.AgentGatewayStub(ch)
            old = stub.Connect()
            await old.write(_register("dup"))
            await old.read()  # register ack
            new = stub.Connect()
            await new.write(_register("dup"))
            await new.read()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                while True:
                    msg = await old.read()
                    if msg is grpc.aio.EOF:
                        break
            assert info.value.code() == grpc.StatusCode.ABORTED
            assert "newer stream" in info.value.details()
            assert coord.gateway.sessions["dup"] is not None
            new.cancel()
    finally:
        await coord.stop(grace_s=0.1)


async def test_sequence_gap_asks_for_keyframe_and_ignores_deltas():
    from protos.codec import TelemetryEncoder, LOWER

    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0"))
    port = await coord.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            call = pb_grpc.AgentGatewayStub(ch).Connect()
            await call.write(_register("gappy", gpus=2))
            enc = TelemetryEncoder([0, 1])
            v = np.tile(np.maximum(LOWER, 1), (2, 1))
            p = np.ones_like(v, bool)
            envs = [enc.encode(v + (i % 2) * 5, p, now_s=i, sampled_at_ns=i)[0] for i in range(4)]
            for env in (envs[0], envs[2], envs[3]):  # envelope 2 is lost
                await call.write(pb.AgentMessage(telemetry=env))
            resync = None
            while resync is None:
                msg = await asyncio.wait_for(call.read(), 5)
                if msg.WhichOneof("body") == "resync":
                    resync = msg.resync
            assert resync.expected_seq == 2
            node = coord.view.nodes["gappy"]
            assert node.decoder.awaiting_keyframe and node.resyncs == 1
            col = BY_NAME["util_gpu_pct"]
            # The view still holds envelope 1's values, not envelope 3's deltas.
            assert coord.view.raw[node.rows[0], col] == v[0, col]
            enc.request_keyframe()
            fresh = v.copy()
            fresh[:, col] += 9
            kf, _ = enc.encode(fresh, p, now_s=10, sampled_at_ns=10)
            await call.write(pb.AgentMessage(telemetry=kf))
            await _eventually(lambda: not node.decoder.awaiting_keyframe, what="keyframe applied")
            assert coord.view.raw[node.rows[0], col] == v[0, col] + 9
            call.cancel()
    finally:
        await coord.stop(grace_s=0.1)
