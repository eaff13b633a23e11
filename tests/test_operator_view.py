"""The operator surface over a real coordinator and simulated agents: node and
GPU listings with filters and smoothed values, cordon/drain, the view watch,
liveness driven by a fake clock, and the Prometheus exposition checked by
prometheus-client's parser (and promtool where installed)."""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import subprocess
import sys
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from waiting import until as _until
from agent.fleet import SimFleet
from coordinator.config import CoordinatorConfig
from coordinator.liveness import ManualClock
from coordinator.metrics import EXPORTED_METRIC_NAMES
from coordinator.server import Coordinator
from protos import cluster_pb2 as cpb
from protos import cluster_pb2_grpc as cpb_grpc
from protos import tasks_pb2 as tpb
from protos import tasks_pb2_grpc as tpb_grpc
from protos import telemetry_pb2 as pb
from protos import telemetry_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(60)



async def test_list_filters_smoothing_cordon_and_watch():
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", metrics_listen="127.0.0.1:0"))
    port = await coord.start()
    try:
        async with SimFleet(f"127.0.0.1:{port}", hosts=2, gpus=2, workload="synthetic", labels={"sim-01": {"rack": "r1"}}):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                op = cpb_grpc.ClusterOperatorStub(ch)

                async def healthy():
                    nodes = (await op.ListNodes(cpb.ListNodesRequest(state=cpb.NODE_STATE_HEALTHY))).nodes
                    return len(nodes) == 2

                await _until(healthy, what="both nodes HEALTHY")
                nodes = (await op.ListNodes(cpb.ListNodesRequest())).nodes
                assert [n.node_id for n in nodes] == ["sim-01", "sim-02"]
                assert nodes[0].labels["rack"] == "r1" and nodes[0].gpu_count == 2
                assert any(link.kind == pb.LINK_KIND_NVLINK for link in nodes[0].topology)

                only = (await op.ListGpus(cpb.ListGpusRequest(node_id="sim-02", metrics=["util", "temp"]))).gpus
                assert {(g.node_id, g.index) for g in only} == {("sim-02", 0), ("sim-02", 1)}
                assert all(g.HasField("util_gpu_pct") and g.HasField("temperature_c") for g in only)
                assert not any(g.HasField("power_w") or g.HasField("memory_used_mib") for g in only)
                assert len((await op.ListGpus(cpb.ListGpusRequest(model="4090"))).gpus) == 4
                assert len((await op.ListGpus(cpb.ListGpusRequest(model="A100"))).gpus) == 0

                async def smoothed_ready():
                    gpus = (await op.ListGpus(cpb.ListGpusRequest(values=cpb.VALUE_VIEW_SMOOTHED))).gpus
                    return gpus if all(g.HasField("util_gpu_pct") and g.smoothed for g in gpus) else None

                smoothed = await _until(smoothed_ready, what="smoothed values")
                assert all(0 <= g.util_gpu_pct <= 100 for g in smoothed)
                assert any(g.HasField("util_forecast_pct") for g in smoothed)

                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await op.ListGpus(cpb.ListGpusRequest(metrics=["util", "vibes"]))
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "metrics[1]" in info.value.details()
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await op.CordonNode(cpb.NodeActionRequest(node_id="nope"))
                assert info.value.code() == grpc.StatusCode.NOT_FOUND
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await op.ListGpus(cpb.ListGpusRequest(node_id="nope"))  # not an empty node
                assert info.value.code() == grpc.StatusCode.NOT_FOUND and info.value.details() == "node_id: no node 'nope'"
                for call, request in [(op.CordonNode, cpb.NodeActionRequest()), (op.GetNode, cpb.GetNodeRequest())]:
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await call(request)
                    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                    assert info.value.details().startswith("node_id: required")

                with pytest.raises(grpc.aio.AioRpcError) as info:  # logged and stored: bounded like a cancel reason
                    await op.CordonNode(cpb.NodeActionRequest(node_id="sim-01", reason="x" * 1025))
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith("reason: 1,025")
                assert coord.node_state("sim-01") == cpb.NODE_STATE_HEALTHY

                # Cordon: no new tasks on the node; uncordon: back in the pool.
                cordoned = await op.CordonNode(cpb.NodeActionRequest(node_id="sim-01", reason="maintenance"))
                assert cordoned.node.state == cpb.NODE_STATE_CORDONED
                sched = tpb_grpc.SchedulerStub(ch)
                for i in range(3):
                    t = (await sched.ScheduleTask(tpb.ScheduleTaskRequest(spec=tpb.TaskSpec(task_id=f"t{i}", vram_mib=256, gpu_share=0.1)), timeout=10)).task
                    assert t.assignment.node_id == "sim-02"
                drained = await op.DrainNode(cpb.NodeActionRequest(node_id="sim-02"))
                assert drained.node.state == cpb.NODE_STATE_DRAINING
                queued = (await sched.ScheduleTask(tpb.ScheduleTaskRequest(spec=tpb.TaskSpec(task_id="waits", vram_mib=256), wait=False))).task
                assert queued.state == tpb.TASK_STATE_QUEUED
                await asyncio.sleep(0.6)
                assert (await sched.GetTask(tpb.GetTaskRequest(task_id="waits"))).state == tpb.TASK_STATE_QUEUED
                back = await op.UncordonNode(cpb.NodeActionRequest(node_id="sim-01"))
                assert back.node.state == cpb.NODE_STATE_HEALTHY
                placed = await _until(lambda: _placed(sched, "waits"), what="task placed after uncordon")
                assert placed.assignment.node_id == "sim-01"

                # WatchView: a snapshot, then updates as readings change.
                watch = op.WatchView(cpb.WatchViewRequest(min_interval_ms=200))
                first = await watch.read()
                second = await asyncio.wait_for(watch.read(), 5)
                assert len(first.gpus) == 4 and second.at_ns > first.at_ns
                watch.cancel()
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await op.WatchView(cpb.WatchViewRequest(min_interval_ms=50)).read()
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT

            # Prometheus exposition, parsed by prometheus-client's own parser.
            body = await asyncio.to_thread(
                lambda: urllib.request.urlopen(f"http://127.0.0.1:{coord.metrics_port}/metrics", timeout=5).read().decode()
            )
            families = {f.name: f for f in text_string_to_metric_families(body)}
            util = families["gpulb_gpu_utilization_ratio"]
            assert {s.labels["node"] for s in util.samples} == {"sim-01", "sim-02"}
            assert all(0.0 <= s.value <= 1.0 for s in util.samples)
            memory_total = families["gpulb_gpu_memory_total_bytes"].samples[0].value
            assert memory_total == 24564 * 1024 * 1024
            assert families["gpulb_agent_streams"].samples[0].value == 2
            states = {s.labels["state"]: s.value for s in families["gpulb_nodes"].samples}
            assert states["healthy"] + states["cordoned"] + states["draining"] == 2
            placed_total = sum(s.value for s in families["gpulb_tasks_placed"].samples if s.name.endswith("_total"))
            assert placed_total == 4
            assert families["gpulb_envelopes_received"].samples[0].value > 0
            # the mix fgd packs for: three tasks of 256 MiB at 0.1, one at 256 MiB and no share
            mix = {(s.labels["gpus"], s.labels["vram_mib"], s.labels["gpu_share"]): s.value
                   for s in families["gpulb_workload_mix_share"].samples}
            assert set(mix) == {("1", "256", "0.1"), ("1", "256", "0")}
            assert mix[("1", "256", "0.1")] == pytest.approx(0.75, rel=1e-3)
            assert sum(mix.values()) == pytest.approx(1.0)
            exported = set(EXPORTED_METRIC_NAMES)
            for name in families:
                base = name.removesuffix("_total")
                assert name in exported or base in exported or f"{base}_total" in exported, name
            if shutil.which("promtool"):
                check = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True, text=True)
                assert check.returncode == 0, check.stdout + check.stderr
    finally:
        await coord.stop(grace_s=0.1)


async def test_per_gpu_exposition_says_what_list_gpus_says():
    """The per-GPU families, written column by column, carry for every GPU the
    values ListGpus gives in the same turn of the loop (raw and smoothed
    readings, reservations and leases, reading age), and the exposition
    still parses and passes promtool."""
    from coordinator.convert import resolve_metrics
    from coordinator.metrics import _label

    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", metrics_listen="127.0.0.1:0"))
    port = await coord.start()
    try:
        async with SimFleet(f"127.0.0.1:{port}", hosts=2, gpus=2, workload="synthetic"):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = tpb_grpc.SchedulerStub(ch)
                await _until(lambda: len(coord.dispatcher.snapshots.snapshot().gpu_uuid) == 4
                             and coord.dispatcher.snapshots.snapshot().healthy.all(), what="4 healthy GPUs")
                placed = await stub.ScheduleTask(tpb.ScheduleTaskRequest(spec=tpb.TaskSpec(
                    task_id="job", vram_mib=3_000, gpu_share=0.5, kind="training")), timeout=30)
                assert placed.task.state == tpb.TASK_STATE_LEASED
            # one turn of the loop: nothing changes between the three reads
            body = coord.metrics.exposition().decode()
            raw = coord.gpu_messages(metrics=resolve_metrics([]))
            smooth = coord.gpu_messages(smoothed=True, metrics=resolve_metrics([]))
        by = {}
        for family in text_string_to_metric_families(body):
            for sample in family.samples:
                if sample.name.startswith("gpulb_gpu_"):
                    by[(sample.name, sample.labels["node"], sample.labels["gpu"])] = sample
        mib = 1024.0 * 1024.0
        leased = 0
        for g, sg in zip(raw, smooth):
            def value(name):
                return by[(name, g.node_id, str(g.index))].value

            assert by[("gpulb_gpu_utilization_ratio", g.node_id, str(g.index))].labels == {
                "node": g.node_id, "gpu": str(g.index), "uuid": g.uuid, "model": g.model}
            assert value("gpulb_gpu_utilization_ratio") == pytest.approx(g.util_gpu_pct / 100, abs=1e-12)
            assert value("gpulb_gpu_utilization_smoothed_ratio") == pytest.approx(sg.util_gpu_pct / 100, abs=1e-12)
            assert value("gpulb_gpu_memory_used_bytes") == pytest.approx(g.memory_used_mib * mib)
            assert value("gpulb_gpu_memory_used_smoothed_bytes") == pytest.approx(sg.memory_used_mib * mib)
            assert value("gpulb_gpu_memory_total_bytes") == g.memory_total_mib * mib
            assert value("gpulb_gpu_temperature_celsius") == pytest.approx(g.temperature_c)
            assert value("gpulb_gpu_power_watts") == pytest.approx(g.power_w)
            if g.HasField("xid_last"):
                assert value("gpulb_gpu_xid_last") == g.xid_last
            else:  # a simulated GPU reports no Xid: absent, not 0
                assert ("gpulb_gpu_xid_last", g.node_id, str(g.index)) not in by
            assert value("gpulb_gpu_reading_age_seconds") == pytest.approx(g.reading_age_s, abs=0.05)
            if g.active_tasks:
                leased += 1
                assert value("gpulb_gpu_active_tasks") == g.active_tasks
                assert value("gpulb_gpu_reserved_memory_bytes") == pytest.approx(g.reserved_vram_mib * mib, abs=mib)
            else:
                assert ("gpulb_gpu_active_tasks", g.node_id, str(g.index)) not in by
        assert leased == 1 and len(raw) == 4
        assert body.count("# TYPE gpulb_gpu_utilization_ratio gauge") == 1
        if shutil.which("promtool"):
            check = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True, text=True)
            assert check.returncode == 0, check.stdout + check.stderr
        # label values are escaped as the text format wants
        assert _label('RTX "4090"\\x\n') == 'RTX \\"4090\\"\\\\x\\n'
    finally:
        await coord.stop(grace_s=0.1)


async def test_reserved_memory_is_what_the_readings_do_not_show_yet():
    """ListGpus' reserved_vram_mib and gpulb_gpu_reserved_memory_bytes are the
    reservation the scheduler places with: once the GPU's memory reading shows
    the task, nothing of its ask stays reserved on top (both had stayed at the
    whole ask for the whole run: a 24 GiB card read 18.7 GiB used + 18 GiB
    reserved while placement counted the faded figure)."""
    ask = 6 * 1024
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", dispatch_interval_s=0.1))
    port = await coord.start()
    try:
        async with SimFleet(f"127.0.0.1:{port}", hosts=1, gpus=2, workload="idle"):
            await _until(lambda: coord.dispatcher.snapshots.snapshot().healthy.all()
                         and len(coord.dispatcher.snapshots.snapshot().gpu_uuid) == 2, what="2 healthy GPUs")
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                placed = (await tpb_grpc.SchedulerStub(ch).ScheduleTask(tpb.ScheduleTaskRequest(spec=tpb.TaskSpec(
                    task_id="job", vram_mib=ask, gpu_share=0.5, kind="training")), timeout=30)).task
                assert placed.state == tpb.TASK_STATE_LEASED
                uuid = placed.assignment.gpu_uuid[0]
                op = cpb_grpc.ClusterOperatorStub(ch)

                async def shown():
                    gpus = (await op.ListGpus(cpb.ListGpusRequest(node_id=placed.assignment.node_id))).gpus
                    g = next(g for g in gpus if g.uuid == uuid)
                    return g if g.memory_used_mib >= ask and g.reserved_vram_mib < ask else None

                g = await _until(shown, what="the readings show the task and its reservation fades")
            assert g.active_tasks == 1
            # the same numbers as a placement made now: a pass on the current snapshot
            coord.dispatcher.dispatch_now()
            view = coord.dispatcher.engine._view
            reserved, leases = coord.gpu_scheduler_facts()[uuid]
            assert (reserved, leases) == (pytest.approx(view.res_vram[view.row_of[uuid]]), 1)
            samples = {s.labels["uuid"]: s.value for family in text_string_to_metric_families(coord.metrics.exposition().decode())
                       for s in family.samples if s.name == "gpulb_gpu_reserved_memory_bytes"}
            assert samples[uuid] == pytest.approx(reserved * 1024 * 1024)
    finally:
        await coord.stop(grace_s=0.1)


async def _placed(stub, task_id: str):
    task = await stub.GetTask(tpb.GetTaskRequest(task_id=task_id))
    return task if task.state == tpb.TASK_STATE_LEASED else None


def _register(node_id: str) -> pb.AgentMessage:
    return pb.AgentMessage(
        register=pb.Register(node_id=node_id, gpus=[pb.GpuInfo(index=0, uuid=f"GPU-{node_id}", model="M", memory_total_mib=1000)])
    )


async def test_liveness_transitions_through_the_server_on_a_fake_clock():
    """A node that stays connected but silent goes UNREACHABLE after one
    heartbeat interval and REMOVED after three, with no real waiting: the
    coordinator runs on a manual clock."""
    from protos.codec import LOWER, TelemetryEncoder

    import numpy as np

    clock = ManualClock(1000.0)
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", heartbeat_interval_s=10.0), clock=clock)
    port = await coord.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            call = pb_grpc.AgentGatewayStub(ch).Connect()
            await call.write(_register("quiet"))
            enc = TelemetryEncoder([0])
            v = np.maximum(LOWER, 1)[None, :]
            env, _ = enc.encode(v, np.ones_like(v, bool), now_s=0, sampled_at_ns=0)
            await call.write(pb.AgentMessage(telemetry=env))
            await _until(lambda: coord.node_state("quiet") == cpb.NODE_STATE_HEALTHY, what="HEALTHY after keyframe")
            clock.advance(11.5)
            await _until(lambda: coord.node_state("quiet") == cpb.NODE_STATE_UNREACHABLE, what="UNREACHABLE")
            # A heartbeat brings it back.
            await call.write(pb.AgentMessage(heartbeat=pb.Heartbeat()))
            await _until(lambda: coord.node_state("quiet") == cpb.NODE_STATE_HEALTHY, what="HEALTHY after heartbeat")
            clock.advance(40.0)
            await _until(lambda: "quiet" not in coord.view.nodes, what="REMOVED from the view")
            assert coord.node_state("quiet") == cpb.NODE_STATE_REMOVED
            # The removed node's stream is told to register again.
            with pytest.raises(grpc.aio.AioRpcError) as info:
                while True:
                    msg = await asyncio.wait_for(call.read(), 5)
                    if msg is grpc.aio.EOF:
                        break
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "register again" in info.value.details()
    finally:
        await coord.stop(grace_s=0.1)


async def _healthy_raw_node(ch, coord: Coordinator, node_id: str = "quiet"):
    """A node on a raw agent stream, HEALTHY after its keyframe, that sends
    nothing more unless the test writes to the returned call."""
    import numpy as np

    from protos.codec import LOWER, TelemetryEncoder

    call = pb_grpc.AgentGatewayStub(ch).Connect()
    await call.write(_register(node_id))
    v = np.maximum(LOWER, 1)[None, :]
    env, _ = TelemetryEncoder([0]).encode(v, np.ones_like(v, bool), now_s=0, sampled_at_ns=0)
    await call.write(pb.AgentMessage(telemetry=env))
    await _until(lambda: coord.node_state(node_id) == cpb.NODE_STATE_HEALTHY, what="HEALTHY after keyframe")
    return call


async def test_a_stalled_coordinator_does_not_take_its_own_stall_for_silence():
    """The coordinator process stops for 35 s (SIGSTOP, a frozen VM) while
    its agents keep sending. On waking, the sweep's timer fires before the
    read loops take in the waiting messages: the node must still be
    HEALTHY, in the view and on its stream when they are read, not REMOVED
    with its stream refused. The stall is the sweeper's own lateness, here
    measured on the same manual clock as the silence."""
    clock = ManualClock(1000.0)
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", heartbeat_interval_s=10.0), clock=clock)
    coord._sweeper.clock = clock
    port = await coord.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            call = await _healthy_raw_node(ch, coord)
            await coord._sweeper.sweep_once()  # a sweep on time, at 1000.0
            clock.advance(35.0)  # stopped: more than the three intervals that remove a node
            assert await coord._sweeper.sweep_once() == []  # the timer runs first on waking
            assert coord._sweeper.stalls == 1
            assert coord.node_state("quiet") == cpb.NODE_STATE_HEALTHY and "quiet" in coord.view.nodes
            await call.write(pb.AgentMessage(heartbeat=pb.Heartbeat()))  # what waited in the socket
            await _until(lambda: coord.liveness.state("quiet").last_seen_s == 1035.0, what="the waiting message read")
            assert coord.node_state("quiet") == cpb.NODE_STATE_HEALTHY
            assert coord.gateway.sessions.get("quiet") is not None  # its stream was not refused
            # Silence while the coordinator runs still counts: swept once a
            # second (on this clock a jump is a stall), the node is
            # UNREACHABLE after an interval and grace of it.
            for _ in range(11):
                clock.advance(1.0)
                assert await coord._sweeper.sweep_once() == []
            clock.advance(1.0)
            events = await coord._sweeper.sweep_once()
            assert [(e.node_id, e.new.name) for e in events] == [("quiet", "UNREACHABLE")]
            assert coord._sweeper.stalls == 1
            call.cancel()
    finally:
        await coord.stop(grace_s=0.1)


async def test_a_watcher_sees_a_silent_node_go_unreachable():
    """A node's state comes from the liveness tracker, not the view: when a
    silent node goes UNREACHABLE no reading changes, yet a watcher must be
    told. (The staleness bound is long, so the periodic refresh cannot be
    what sends the update.)"""
    clock = ManualClock(1000.0)
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", heartbeat_interval_s=10.0, staleness_s=600.0), clock=clock)
    port = await coord.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            call = await _healthy_raw_node(ch, coord)
            watch = cpb_grpc.ClusterOperatorStub(ch).WatchView(cpb.WatchViewRequest(min_interval_ms=200))
            first = await watch.read()
            assert [(n.node_id, n.state) for n in first.nodes] == [("quiet", cpb.NODE_STATE_HEALTHY)]
            view_version = coord.view.version
            clock.advance(11.5)  # silent past interval + grace
            update = await asyncio.wait_for(watch.read(), 20)
            assert [(n.node_id, n.state) for n in update.nodes] == [("quiet", cpb.NODE_STATE_UNREACHABLE)]
            assert update.nodes[0].reading_age_s == pytest.approx(11.5)
            assert coord.view.version == view_version  # no reading moved: the state alone
            watch.cancel()
            call.cancel()
    finally:
        await coord.stop(grace_s=0.1)


async def test_a_watcher_of_a_quiet_node_sees_its_readings_age_and_go_stale():
    """Nothing changes in the view or in any node's state, yet the ages and
    stale flags a watcher shows must not freeze: an update at least every
    half staleness bound (0.5 s here)."""
    clock = ManualClock(1000.0)
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", heartbeat_interval_s=10.0, staleness_s=1.0), clock=clock)
    port = await coord.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            call = await _healthy_raw_node(ch, coord)
            watch = cpb_grpc.ClusterOperatorStub(ch).WatchView(cpb.WatchViewRequest(min_interval_ms=200))
            first = await watch.read()
            assert not first.nodes[0].stale and first.nodes[0].reading_age_s == pytest.approx(0.0)
            versions = (coord.view.version, coord.liveness.version)
            clock.advance(2.0)  # past the staleness bound, well within the heartbeat interval
            update = await asyncio.wait_for(watch.read(), 20)
            node = update.nodes[0]
            assert (node.state, node.stale, node.reading_age_s) == (cpb.NODE_STATE_HEALTHY, True, pytest.approx(2.0))
            assert all(g.stale for g in update.gpus)
            assert (coord.view.version, coord.liveness.version) == versions
            watch.cancel()
            call.cancel()
    finally:
        await coord.stop(grace_s=0.1)


@contextlib.asynccontextmanager
async def _nvml_host(nv):
    """A coordinator on a loopback port and one agent, "gpu-host", on the NVML
    backend over the shipped fake library ``nv``; yields the coordinator."""
    from agent.client import Agent, AgentConfig
    from agent.nvml import NvmlBackend

    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", metrics_listen="127.0.0.1:0"))
    port = await coord.start()
    agent = Agent(
        AgentConfig(node_id="gpu-host", coordinator=f"127.0.0.1:{port}", interval_min_s=0.05, interval_max_s=0.1),
        NvmlBackend(nvml=nv),
    )
    task = asyncio.create_task(agent.run())
    try:
        yield coord
    finally:
        await agent.stop()
        await asyncio.gather(task, return_exceptions=True)
        await coord.stop(grace_s=0.1)


async def test_an_xid_on_a_real_backend_reaches_the_operator_and_prometheus():
    """The NVML backend (over the shipped fake library) in a real agent: an
    Xid the driver reports shows as the GPU's xid_last and flag in ListGpus
    and as gpulb_gpu_xid_last in the exposition."""
    from agent.fake_nvml import FakeNvml

    nv = FakeNvml.with_gpus(2)
    async with _nvml_host(nv) as coord:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{coord.port}") as ch:
            op = cpb_grpc.ClusterOperatorStub(ch)

            async def xid_of_gpu_1():
                gpus = (await op.ListGpus(cpb.ListGpusRequest())).gpus
                if len(gpus) == 2 and all(g.HasField("xid_last") for g in gpus):
                    return gpus
                return None

            gpus = await _until(xid_of_gpu_1, what="both GPUs reporting xid_last")
            assert [g.xid_last for g in gpus] == [0, 0] and not any(f.startswith("xid") for g in gpus for f in g.flags)
            nv.xid(1, 79)

            async def flagged():
                gpus = (await op.ListGpus(cpb.ListGpusRequest())).gpus
                return gpus if gpus[1].xid_last == 79 else None

            gpus = await _until(flagged, what="Xid 79 on GPU 1")
            assert "xid_79" in gpus[1].flags and gpus[0].xid_last == 0
        body = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{coord.metrics_port}/metrics", timeout=5).read().decode()
        )
        xids = {s.labels["gpu"]: s.value for f in text_string_to_metric_families(body) if f.name == "gpulb_gpu_xid_last" for s in f.samples}
        assert xids == {"0": 0.0, "1": 79.0}


async def test_each_gpus_processes_reach_list_gpus_and_gpulb_processes():
    """Compute processes NVML lists on a GPU (the shipped fake library) reach
    ListGpus, most memory first, follow a process that exits, and `gpulb
    processes` shows them (in its own process, as operators run it)."""
    from agent.fake_nvml import MIB, FakeNvml, FakeProcess

    nv = FakeNvml.with_gpus(2)
    nv.gpus[0].processes = [FakeProcess(777, 1_000 * MIB), FakeProcess(4242, 19_000 * MIB)]
    async with _nvml_host(nv) as coord:
        port = coord.port
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            op = cpb_grpc.ClusterOperatorStub(ch)

            async def listed(want: int):
                gpus = (await op.ListGpus(cpb.ListGpusRequest(node_id="gpu-host"))).gpus
                return gpus if len(gpus) == 2 and len(gpus[0].processes) == want else None

            gpus = await _until(lambda: listed(2), what="GPU 0's two processes listed")
            assert [(p.pid, p.used_memory_mib) for p in gpus[0].processes] == [(4242, 19_000), (777, 1_000)]
            assert list(gpus[1].processes) == []
            cli = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "coordinator.cli", "--coordinator", f"127.0.0.1:{port}", "processes",
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )
            out, err = await asyncio.wait_for(cli.communicate(), 60)
            assert cli.returncode == 0, err.decode()
            rows = [line.split() for line in out.decode().splitlines()[2:]]
            assert [(r[0], r[1], r[2], r[3]) for r in rows] == [("gpu-host", "0", "4242", "19,000"), ("gpu-host", "0", "777", "1,000")]

            nv.gpus[0].processes = [FakeProcess(777, 1_000 * MIB)]  # 4242 exits
            gpus = await _until(lambda: listed(1), what="the exited process gone")
            assert [p.pid for p in gpus[0].processes] == [777]


async def test_each_hosts_driver_and_agent_release_reach_list_nodes_prometheus_and_the_cli():
    """A host on NVML (the shipped fake library, driver 535) and one on the
    simulator: ListNodes, gpulb_node_info and `gpulb nodes` tell which host
    runs which driver and agent release (the simulator: no driver)."""
    from agent.client import AGENT_VERSION, Agent, AgentConfig
    from agent.fake_nvml import FakeNvml
    from agent.nvml import NvmlBackend
    from agent.sim import SimBackend

    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", metrics_listen="127.0.0.1:0"))
    port = await coord.start()
    nv = FakeNvml.with_gpus(1)
    nv.driver_version, nv.cuda_driver_version = "535.288.01", 12020
    agents = [
        Agent(AgentConfig(node_id="nvml-host", coordinator=f"127.0.0.1:{port}", interval_min_s=0.05, interval_max_s=0.1),
              NvmlBackend(nvml=nv)),
        Agent(AgentConfig(node_id="sim-host", coordinator=f"127.0.0.1:{port}", interval_min_s=0.05, interval_max_s=0.1),
              SimBackend(gpus=1, seed=2)),
    ]
    tasks = [asyncio.create_task(a.run()) for a in agents]
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            op = cpb_grpc.ClusterOperatorStub(ch)

            async def both():
                nodes = (await op.ListNodes(cpb.ListNodesRequest())).nodes
                return {n.node_id: n for n in nodes} if len(nodes) == 2 else None

            nodes = await _until(both, what="both hosts registered")
        assert nodes["nvml-host"].driver_version == "535.288.01, CUDA 12.2"
        assert nodes["sim-host"].driver_version == ""
        assert nodes["nvml-host"].agent_version == nodes["sim-host"].agent_version == AGENT_VERSION != ""
        body = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{coord.metrics_port}/metrics?per_gpu=0", timeout=5).read().decode()
        )
        info = {s.labels["node"]: s for f in text_string_to_metric_families(body) if f.name == "gpulb_node_info" for s in f.samples}
        assert set(info) == {"nvml-host", "sim-host"} and all(s.value == 1.0 for s in info.values())
        assert (info["nvml-host"].labels["driver"], info["nvml-host"].labels["backend"]) == ("535.288.01, CUDA 12.2", "nvml")
        assert (info["sim-host"].labels["driver"], info["sim-host"].labels["agent_version"]) == ("", AGENT_VERSION)

        # the CLI as operators run it, in a process of its own: in this one its table
        # would share stdout with the coordinator's and agents' log lines
        cli = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "coordinator.cli", "--coordinator", f"127.0.0.1:{port}", "nodes",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(cli.communicate(), 60)
        assert cli.returncode == 0, err.decode()
        lines = out.decode().splitlines()
        # the column's span from the dashes under the headers (models have spaces in them)
        spans = [m.span() for m in re.finditer(r"-+", lines[1])]
        start, end = next(span for span in spans if span[0] <= lines[0].index("DRIVER") < span[1])
        driver = {line.split()[0]: line[start:end].strip() for line in lines[2:] if line.strip()}
        assert driver == {"nvml-host": "535.288.01", "sim-host": "-"}
    finally:
        for a in agents:
            await a.stop()
        await asyncio.gather(*tasks, return_exceptions=True)
        await coord.stop(grace_s=0.1)


def _populated(nodes: int) -> Coordinator:
    from coordinator.schedbench import populate

    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0"))
    populate(coord, nodes)
    return coord


async def test_gpu_messages_carry_the_view_field_by_field():
    """The column-at-a-time builder against the view read one GPU and field
    at a time: a missing reading is an absent field (not 0), health and age
    without a reading, staleness, the smoothed columns replacing the raw
    ones, the model filter per GPU, and the in-place build equal to the list."""
    import math

    import numpy as np

    from coordinator.convert import SMOOTHED_FIELDS, resolve_metrics
    from protos.fields import BY_NAME

    coord = _populated(3)
    view = coord.view
    rows = sorted(row for node in view.nodes.values() for row in node.rows)
    view.raw[rows[0], BY_NAME["util_gpu_pct"]] = np.nan
    view.raw[rows[1], BY_NAME["power_w"]] = np.inf
    view.raw[rows[2], BY_NAME["health"]] = np.nan
    view.raw[rows[3], BY_NAME["health"]] = pb.GPU_HEALTH_FROZEN
    view.raw[rows[4], BY_NAME["xid_last"]] = 79
    view.reading_at_s[rows] = 100.0
    view.reading_at_s[rows[5]] = np.nan
    view.reading_at_s[rows[6]] = 100.0 - 3_600  # an hour old: stale
    coord.clock = lambda: 102.5
    metrics = resolve_metrics([])
    for smoothed in (False, True):
        gpus = coord.gpu_messages(metrics=metrics, smoothed=smoothed)
        assert len(gpus) == len(rows) == 24
        columns = coord.smoothed_columns()
        for g in gpus:
            node = view.nodes[g.node_id]
            row = node.rows[[gpu.index for gpu in node.gpus].index(g.index)]
            for name in metrics:
                expected = float(columns[name][row] if smoothed and name in SMOOTHED_FIELDS else view.raw[row, BY_NAME[name]])
                if math.isfinite(expected):
                    assert g.HasField(name) and getattr(g, name) == expected, (row, name)
                else:
                    assert not g.HasField(name), (row, name)
            health = view.raw[row, BY_NAME["health"]]
            assert g.health == (int(health) if math.isfinite(health) else 0)
            read_at = view.reading_at_s[row]
            assert g.reading_age_s == (102.5 - read_at if math.isfinite(read_at) else -1.0)
            assert g.stale == (not math.isfinite(read_at) or 102.5 - read_at > coord.config.staleness_s)
            assert g.smoothed == smoothed
    by_row = {r: g for r, g in zip(rows, coord.gpu_messages(metrics=metrics))}
    assert not by_row[rows[0]].HasField("util_gpu_pct") and by_row[rows[0]].HasField("memory_used_mib")
    assert by_row[rows[2]].health == 0 and "frozen" in by_row[rows[3]].flags
    assert "xid_79" in by_row[rows[4]].flags
    assert by_row[rows[5]].reading_age_s == -1.0 and by_row[rows[5]].stale and "stale" in by_row[rows[5]].flags
    assert by_row[rows[6]].stale and not by_row[rows[7]].stale
    # a node's age is its newest GPU reading's; without any, -1 and stale
    first, second = (view.nodes[n] for n in sorted(view.nodes)[:2])
    view.reading_at_s[first.rows] = np.nan
    view.reading_at_s[second.rows] = np.nan
    view.reading_at_s[second.rows[3]] = 101.0
    view.reading_at_s[second.rows[5]] = 100.0
    assert coord.node_message(first).reading_age_s == -1.0 and coord.node_message(first).stale
    assert coord.node_message(second).reading_age_s == 1.5 and not coord.node_message(second).stale
    # the model filter is per GPU; the in-place build is the list, byte for byte
    some = view.nodes[next(iter(view.nodes))].gpus[0].model
    assert {g.model for g in coord.gpu_messages(metrics=metrics, model=some.lower())} == {some}
    for kwargs in ({}, {"smoothed": True}, {"node_id": next(iter(view.nodes))}, {"model": some}):
        listed = cpb.ListGpusResponse(gpus=coord.gpu_messages(metrics=metrics, **kwargs))
        built = cpb.ListGpusResponse()
        coord.gpu_messages(metrics=metrics, into=built.gpus, **kwargs)
        assert built.gpus and built.SerializeToString() == listed.SerializeToString()


async def test_watchers_share_one_update():
    """Watchers of the same nodes and values share one built update while the
    view has not changed, or within SHARE_S of its build though it has; a
    newer one is built after that, and the others built long ago are
    dropped then."""
    coord = _populated(2)
    clock = ManualClock(50.0)
    op = type(coord.operator)(coord, clock=clock)
    version, first = op.view_update("", False)
    assert op.builds == 1 and len(first.gpus) == 16 and len(first.nodes) == 2
    assert op.view_update("", False) == (version, first)  # nothing changed
    coord.view.version += 1  # a reading arrived
    clock.advance(op.SHARE_S / 2)
    assert op.view_update("", False) == (version, first) and op.builds == 1
    clock.advance(op.SHARE_S)
    newer_version, newer = op.view_update("", False)
    assert op.builds == 2 and newer_version == (version[0] + 1, version[1]) and newer is not first
    assert newer.at_ns >= first.at_ns
    # other nodes or other values: their own update
    node_id = sorted(coord.view.nodes)[1]
    _, one_node = op.view_update(node_id, False)
    _, smoothed = op.view_update("", True)
    assert op.builds == 4 and {g.node_id for g in one_node.gpus} == {node_id}
    assert all(g.smoothed for g in smoothed.gpus) and not any(g.smoothed for g in newer.gpus)
    clock.advance(op.KEEP_S + 1)
    coord.view.version += 1
    op.view_update("", False)
    assert set(op._updates) == {("", False)}


async def test_a_watchers_update_is_rebuilt_when_a_node_changes_state_or_grows_old():
    """A node's state is the liveness tracker's, not the view's: a change of
    it makes a new update though no reading moved. And a watcher that asks
    for one no older than max_age_s gets a new build once the shared one is
    older, so the ages it shows do not freeze."""
    coord = _populated(2)
    clock = ManualClock(50.0)
    op = type(coord.operator)(coord, clock=clock)
    version, first = op.view_update("", False)
    node_id = sorted(coord.view.nodes)[0]
    clock.advance(op.SHARE_S)
    coord.liveness.disconnected(node_id)  # its stream closed: UNREACHABLE, no reading changed
    newer_version, newer = op.view_update("", False)
    assert newer is not first and newer_version == (version[0], version[1] + 1)
    assert {n.node_id: n.state for n in newer.nodes}[node_id] == cpb.NODE_STATE_UNREACHABLE
    clock.advance(4.0)
    assert op.view_update("", False)[1] is newer  # nothing changed, and no age limit asked
    assert op.view_update("", False, max_age_s=5.0)[1] is newer  # 4 s old: young enough
    clock.advance(1.0)
    _, refreshed = op.view_update("", False, max_age_s=5.0)
    assert refreshed is not newer and op.builds == 3
    assert op.view_update("", False)[1] is refreshed  # shared with every watcher from then on


async def test_concurrent_watchers_over_grpc_get_the_same_update():
    """Three watchers of a coordinator whose view holds still get the same
    snapshot, built once."""
    coord = _populated(2)
    port = await coord.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            op = cpb_grpc.ClusterOperatorStub(ch)
            watches = [op.WatchView(cpb.WatchViewRequest(min_interval_ms=200)) for _ in range(3)]
            firsts = await asyncio.gather(*(w.read() for w in watches))
            for w in watches:
                w.cancel()
        assert len(firsts[0].gpus) == 16
        assert all(f.SerializeToString() == firsts[0].SerializeToString() for f in firsts)
        assert coord.operator.builds == 1
    finally:
        await coord.stop(grace_s=0.1)


async def test_gpulb_top_shows_raw_and_smoothed_values_of_every_gpu():
    """`gpulb top` as operators run it: every GPU's raw util, memory,
    temperature and power, its smoothed util, and an Xid flag (it asks for
    only the fields it shows, so a field it drops would show here)."""
    from protos.fields import BY_NAME

    coord = _populated(2)
    node = coord.view.nodes[sorted(coord.view.nodes)[0]]
    coord.view.raw[node.rows[1], BY_NAME["xid_last"]] = 79
    port = await coord.start()
    try:
        cli = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "coordinator.cli", "--coordinator", f"127.0.0.1:{port}", "top",
            "--iterations", "1", "--no-clear", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(cli.communicate(), 60)
        assert cli.returncode == 0, err.decode()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            op = cpb_grpc.ClusterOperatorStub(ch)
            raw = {(g.node_id, g.index): g for g in (await op.ListGpus(cpb.ListGpusRequest())).gpus}
            smooth = {(g.node_id, g.index): g for g in
                      (await op.ListGpus(cpb.ListGpusRequest(values=cpb.VALUE_VIEW_SMOOTHED))).gpus}
    finally:
        await coord.stop(grace_s=0.1)
    lines = out.decode().splitlines()
    assert lines[0].startswith("gpulb top - ") and "16 GPUs" in lines[0]
    header, dashes, rows = lines[1], lines[2], [line for line in lines[3:] if line.strip()]
    spans = [m.span() for m in re.finditer(r"-+", dashes)]

    def column(name):
        start, end = next(span for span in spans if span[0] <= header.index(name) < span[1])
        return {(line.split()[0], int(line.split()[1])): line[start:end].strip() for line in rows}

    util, smoothed, mem, temp, power, flags = (column(n) for n in ("UTIL", "SMOOTHED", "MEM GiB", "TEMP C", "POWER W", "FLAGS"))
    assert set(util) == set(raw) and len(raw) == 16
    for key, g in raw.items():  # the view holds still: nothing moves between the calls
        assert util[key] == f"{g.util_gpu_pct:.0f}%"
        assert smoothed[key] == f"{smooth[key].util_gpu_pct:.1f}%"
        assert mem[key] == f"{g.memory_used_mib / 1024:.1f}/{g.memory_total_mib / 1024:.1f}"
        assert temp[key] == f"{g.temperature_c:.0f}" and power[key] == f"{g.power_w:.0f}"
        assert ("xid_79" in flags[key]) == (key == (node.node_id, node.gpus[1].index))


async def test_per_gpu_values_are_written_as_the_text_format_reads_them():
    """Finite values go out as Python writes floats (a number the format
    reads exactly), an infinite reading as +Inf: parsed back, every value is
    the view's to the bit, and promtool takes the text."""
    import math

    from protos.fields import BY_NAME

    coord = _populated(2)
    rows = sorted(r for n in coord.view.nodes.values() for r in n.rows)
    coord.view.raw[rows[3], BY_NAME["power_w"]] = math.inf
    coord.view.raw[rows[4], BY_NAME["temperature_c"]] = 1e-7
    body = coord.metrics.exposition().decode()
    power = [s for f in text_string_to_metric_families(body) if f.name == "gpulb_gpu_power_watts" for s in f.samples]
    by_row = {r: coord.view.raw[r, BY_NAME["power_w"]] for r in rows}
    assert sorted(s.value for s in power) == sorted(float(v) for v in by_row.values())
    assert any(line.startswith("gpulb_gpu_power_watts{") and line.endswith(" +Inf") for line in body.splitlines())
    temps = [s.value for f in text_string_to_metric_families(body) if f.name == "gpulb_gpu_temperature_celsius"
             for s in f.samples]
    assert 1e-7 in temps
    memory = [s.value for f in text_string_to_metric_families(body) if f.name == "gpulb_gpu_memory_total_bytes"
              for s in f.samples]
    assert memory and all(v == coord.view.raw[rows[0], BY_NAME["memory_total_mib"]] * 1024 * 1024 for v in memory)
    if shutil.which("promtool"):
        check = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr


async def test_utilization_ratio_is_written_as_the_percent_over_100_without_float_noise():
    """Every whole percent on the wire goes out as its ratio and nothing
    more: 57 % is "0.57", not 0.5700000000000001 (57 * 0.01)."""
    from decimal import Decimal

    from protos.fields import BY_NAME

    coord = _populated(2)
    rows = sorted(r for n in coord.view.nodes.values() for r in n.rows)
    written: dict[int, set[str]] = {}
    for pct in range(101):
        coord.view.raw[rows, BY_NAME["util_gpu_pct"]] = pct
        lines = [line for line in coord.metrics.exposition().decode().splitlines()
                 if line.startswith("gpulb_gpu_utilization_ratio{")]
        assert len(lines) == len(rows)
        written[pct] = {line.rsplit(" ", 1)[1] for line in lines}
    noisy = {pct: texts for pct, texts in written.items() if {Decimal(t) for t in texts} != {Decimal(pct) / 100}}
    assert noisy == {}


async def test_a_removed_node_stays_counted_as_removed_so_a_dead_agent_can_alert():
    """One of two agents stops: its node goes unreachable, then removed, and
    leaves the view; gpulb_nodes{state="removed"} must keep counting it (the
    GpulbNodeUnreachable alert sums unreachable and removed: unreachable
    alone lasts less than its minute), until the agent registers again."""
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", insecure=True, heartbeat_interval_s=0.2,
                                          remove_after_intervals=2))
    port = await coord.start()

    def nodes_gauge() -> dict[str, float]:
        body = coord.metrics.exposition().decode()
        family = next(f for f in text_string_to_metric_families(body) if f.name == "gpulb_nodes")
        return {s.labels["state"]: s.value for s in family.samples}

    try:
        async with SimFleet(f"127.0.0.1:{port}", hosts=1, gpus=1, workload="idle", prefix="stays"):
            async with SimFleet(f"127.0.0.1:{port}", hosts=1, gpus=1, workload="idle", prefix="dies"):
                await _until(lambda: nodes_gauge()["healthy"] == 2, what="two healthy nodes")
            await _until(lambda: "dies-01" not in coord.view.nodes, what="the stopped agent's node removed")
            gauge = nodes_gauge()
            assert (gauge["healthy"], gauge["removed"], gauge["unreachable"]) == (1, 1, 0)
            async with SimFleet(f"127.0.0.1:{port}", hosts=1, gpus=1, workload="idle", prefix="dies"):
                await _until(lambda: nodes_gauge()["healthy"] == 2, what="the node back")
                assert nodes_gauge()["removed"] == 0
    finally:
        await coord.stop(grace_s=0.1)
