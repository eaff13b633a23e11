"""The coordinator's advisor runtime and the gpulb.v1.Advisor servicer, over a
real grpc.aio server on port 0, a real Scheduler and a snapshot provider."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import sys
from pathlib import Path
from dataclasses import replace

import grpc
import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from coordinator.advisor import ADVISOR_METRIC_NAMES, AdvisorRuntime, AdvisorService, CommandHook, add_to_server
from protos import advisor_pb2 as apb
from protos import advisor_pb2_grpc as apb_grpc
from scheduler.advisor import AdvisorConfig
from scheduler.config import SchedulerConfig
from scheduler.engine import Scheduler
from scheduler.snapshot import ClusterSnapshot, NodeFacts
from scheduler.task import Priority, TaskSpec, TaskState

pytestmark = pytest.mark.timeout(30)

RTX = "NVIDIA GeForce RTX 4090"
M40 = "Tesla M40 24GB"


class Cluster:
    """What the coordinator would pass the runtime: a snapshot, the engine's
    leased tasks and a clock; util readings are set by the test."""

    def __init__(self) -> None:
        self.now = 1_000.0
        facts = [
            NodeFacts("rtx-a", 2, model=RTX, labels={"name": "rtx-a"}),
            NodeFacts("rtx-b", 2, model=RTX, labels={"name": "rtx-b"}),
            NodeFacts("m40", 2, model=M40, memory_total_mib=24_472.0, speed=0.12, labels={"name": "m40"}),
        ]
        self.snap = ClusterSnapshot.build(facts)
        self.engine = Scheduler(SchedulerConfig(lease_s=1e9), clock=lambda: self.now)

    def snapshot(self) -> ClusterSnapshot:
        return self.snap

    def leased(self):
        return self.engine.tasks(state=TaskState.LEASED, limit=10_000)

    def readings(self, util) -> None:
        u = np.asarray(util, dtype=np.float64)
        self.snap = replace(self.snap, util_pct=u, util_forecast_pct=u.copy())

    def place(self, task_id, node, *, kind="training", duration_s=10.0, share=0.4, priority=Priority.P1):
        """Place a task through the scheduler on ``node`` (the others cordoned for the moment)."""
        spec = TaskSpec(task_id, kind=kind, priority=priority, vram_mib=2_000.0, gpu_share=share,
                        duration_s=duration_s, movable=kind != "inference")
        self.engine.submit(spec, self.snap)
        only = replace(self.snap, node_schedulable=np.asarray([n == node for n in self.snap.node_ids]))
        (task,) = self.engine.dispatch(only)
        return task


def runtime_for(cluster: Cluster, **kw) -> AdvisorRuntime:
    kw.setdefault("advisor_config", AdvisorConfig(persist=2, min_age_s=0.0))
    rt = AdvisorRuntime(snapshot=cluster.snapshot, tasks=cluster.leased, clock=lambda: cluster.now,
                        reservations=lambda: cluster.engine.reservations, queued=cluster.engine.queued,
                        unix_ns=lambda s: int(s * 1e9), **kw)
    cluster.engine.add_listener(rt.on_task_change)
    return rt


async def serve(runtime: AdvisorRuntime):
    server = grpc.aio.server()
    add_to_server(AdvisorService(runtime), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    return server, channel, apb_grpc.AdvisorStub(channel)


def hot_spot(cluster: Cluster) -> list:
    """Two training tasks and a server on the first RTX node, the rest idle."""
    tasks = [cluster.place("train-1", "rtx-a"), cluster.place("train-2", "rtx-a"),
             cluster.place("serve", "rtx-a", kind="inference", share=0.2, priority=Priority.P0)]
    rows = {t.assignment.gpu_uuids[0] for t in tasks}
    util = [0.0] * cluster.snap.gpu_count
    for uuid in rows:
        util[cluster.snap.gpu_uuid.index(uuid)] = 95.0
    cluster.readings(util)
    return tasks


# ---- predictions ----------------------------------------------------------------------------------


async def test_get_predictions_reports_learned_factors_and_their_error():
    c = Cluster()
    rt = runtime_for(c)
    for i in range(6):
        t = c.place(f"m40-{i}", "m40", duration_s=10.0)
        rt.task_started(t.task_id)  # a run time needs a start (or the client's measure)
        c.now += 80.0  # 8x slower than on the reference GPU
        c.engine.complete(t.task_id, t.assignment.lease_id)
    # the client's measured run time wins over the lease's span
    t = c.place("reported", "rtx-a", kind="inference", duration_s=2.0)
    rt.note_actual_duration("reported", 2.5)
    c.now += 60.0
    c.engine.complete(t.task_id, t.assignment.lease_id)
    # the agent's STARTED time counts instead of the placement time
    t = c.place("started", "rtx-b", kind="inference", duration_s=2.0)
    c.now += 30.0
    rt.task_started("started")
    c.now += 2.0
    c.engine.complete(t.task_id, t.assignment.lease_id)
    # failed and cancelled tasks teach nothing
    t = c.place("failed", "rtx-b", duration_s=5.0)
    c.now += 500.0
    c.engine.complete(t.task_id, t.assignment.lease_id, failed=True)

    server, channel, stub = await serve(rt)
    try:
        resp = await stub.GetPredictions(apb.GetPredictionsRequest())
        assert resp.samples == 8 and resp.error_window == rt.predictor.config.error_window
        assert 0.0 < resp.mape_ratio < 1.0
        by = {(f.model, f.kind): f for f in resp.models}
        m40 = by[(M40, "training")]
        assert m40.samples == 6 and m40.prior == pytest.approx(1 / 0.12)
        assert m40.slowdown * rt.predictor.node_factor("m40") == pytest.approx(8.0, rel=0.05)
        rtx = by[(RTX, "inference")]
        assert rtx.samples == 2
        assert rt.predictor.factor("rtx-a", RTX, "inference") < 1.3  # 2.5 s and 2 s for 2 s of work
        assert {n.node_id for n in resp.nodes} == {"m40", "rtx-a", "rtx-b"}
        only = await stub.GetPredictions(apb.GetPredictionsRequest(model=M40, kind="training", node_id="m40"))
        assert {(f.model, f.kind) for f in only.models} == {(M40, ""), (M40, "training")}
        assert [n.node_id for n in only.nodes] == ["m40"]
        # the backfill's margin per kind: NaN below 20 completions, then the 90th
        # percentile of actual / predicted (here every run took its prediction)
        assert math.isnan(m40.overrun_ratio) and math.isnan(by[(M40, "")].overrun_ratio)
        for _ in range(40):
            rt.predictor.observe("m40", M40, "training", 10.0, 10.0 * rt.predictor.factor("m40", M40, "training"))
        again = await stub.GetPredictions(apb.GetPredictionsRequest(model=M40, kind="training"))
        (trained,) = [f for f in again.models if f.kind == "training"]
        assert trained.overrun_ratio == pytest.approx(1.0, abs=0.01)
    finally:
        await channel.close()
        await server.stop(None)


def test_annotate_gives_the_scheduler_slowdown_columns():
    c = Cluster()
    rt = runtime_for(c)
    snap = rt.annotate(c.snap)
    assert snap is not c.snap
    assert snap.gpu_slowdown[""].tolist() == pytest.approx([1.0] * 4 + [1 / 0.12] * 2)
    assert rt.annotate(snap) is snap  # nothing learned since: the same object
    assert rt.annotate(c.snap) is snap  # the same snapshot again: the same annotated object
    # what is learned reaches the columns at most once a second (each refresh is a new placement view)
    rt.predictor.observe("m40", M40, "training", 10.0, 20.0)
    assert rt.annotate(c.snap) is snap
    c.now += 1.0
    fresh = rt.annotate(c.snap)
    assert fresh is not snap and fresh.gpu_slowdown["training"][4] < 1 / 0.12


def test_annotate_carries_learned_memory_growth_once_there_is_enough():
    from scheduler.memgrowth import MemoryGrowthConfig

    c = Cluster()
    rt = runtime_for(c, growth_config=MemoryGrowthConfig(min_samples=2))
    t = c.place("first", "rtx-a")
    rt.note_peak_memory("first", 3_000.0)  # asked 2,000
    c.engine.complete(t.task_id, t.assignment.lease_id)
    assert not rt.annotate(c.snap).memory_growth  # one ratio: not enough
    # a failed task's peak counts too (the use that killed it); a cancelled one's would not
    t = c.place("second", "rtx-b")
    rt.note_peak_memory("second", 5_000.0, oom_killed=True)
    c.engine.complete(t.task_id, t.assignment.lease_id, failed=True)
    t = c.place("third", "rtx-b")
    rt.note_peak_memory("third", 9_000.0)
    c.engine.cancel(t.task_id, "user")
    c.now += 1.0
    snap = rt.annotate(c.snap)
    assert snap.memory_growth[""].ratios.tolist() == [1.5, 2.5]
    assert snap.memory_growth["training"].ratios.tolist() == [1.5, 2.5]
    assert snap.gpu_slowdown  # the predictor's columns are still there
    c.now += 1.0
    assert rt.annotate(c.snap) is snap  # nothing learned since: the same object
    assert [g.oom_kills for g in rt.growth.stats()] == [1, 1]


# ---- plans -------------------------------------------------------------------------------------------


async def test_get_plan_dry_run_then_a_plan_after_persistent_imbalance():
    c = Cluster()
    rt = runtime_for(c)
    hot_spot(c)
    server, channel, stub = await serve(rt)
    try:
        empty = await stub.GetPlan(apb.GetPlanRequest())
        assert not empty.HasField("plan") and empty.evaluated_at_ns == 0
        dry = await stub.GetPlan(apb.GetPlanRequest(evaluate_now=True))
        assert dry.trigger.fired and dry.trigger.reason == "variance"
        assert dry.plan.dry_run and dry.plan.plan_id == 0
        assert [m.task_id for m in dry.plan.moves] == ["train-1"]
        # a dry run starts nothing: the first evaluation makes no plan yet (persist 2)
        assert rt.evaluate_now() is None
        c.now += 30.0
        plan = rt.evaluate_now()
        assert plan is not None and plan.plan_id == 1
        got = await stub.GetPlan(apb.GetPlanRequest())
        assert got.plan.plan_id == 1 and not got.plan.dry_run
        assert got.evaluated_at_ns == int(c.now * 1e9) and got.plan.created_at_ns == int(c.now * 1e9)
        move = got.plan.moves[0]
        assert move.from_node_id == "rtx-a" and move.to_node_id == "rtx-b"  # never the 8x slower M40
        # train-2 has its GPU to itself: moving all of it would just move the hot spot
        assert move.task_id == "train-1" and move.load_pct == pytest.approx(95.0 * 0.4 / 0.6)
        assert got.plan.variance_after < got.plan.variance_before
    finally:
        await channel.close()
        await server.stop(None)


async def test_no_plan_for_inference_only_hot_spots():
    c = Cluster()
    rt = runtime_for(c)
    c.place("serve-1", "rtx-a", kind="inference", share=0.5, priority=Priority.P0)
    c.place("serve-2", "rtx-a", kind="inference", share=0.5, priority=Priority.P0)
    c.readings([100.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    for _ in range(4):
        c.now += 30.0
        assert rt.evaluate_now() is None
    assert rt.last_trigger.fired
    # and the operator is told why
    from coordinator.cli import _why_no_move

    server, channel, stub = await serve(rt)
    try:
        dry = await stub.GetPlan(apb.GetPlanRequest(evaluate_now=True))
        assert not dry.HasField("plan") and dict(dry.no_move) == {"pinned": 2}
        assert _why_no_move(dry.no_move) == ": 2 tasks of kinds that may not move"
        assert not (await stub.GetPlan(apb.GetPlanRequest())).no_move  # only a dry run says why
        c.readings([50.0] * 6)
        for _ in range(10):  # the advisor's averages settle on the even readings
            c.now += 30.0
            rt.evaluate_now()
        dry = await stub.GetPlan(apb.GetPlanRequest(evaluate_now=True))
        assert dict(dry.no_move) == {"not_fired": 1} and _why_no_move(dry.no_move) == ": the trigger has not fired"
    finally:
        await channel.close()
        await server.stop(None)


async def test_watch_plans_streams_each_plan():
    c = Cluster()
    rt = runtime_for(c)
    hot_spot(c)
    server, channel, stub = await serve(rt)
    try:
        stream = stub.WatchPlans(apb.WatchPlansRequest(include_latest=True))
        first = asyncio.ensure_future(stream.read())
        await asyncio.sleep(0.2)  # the watch is registered
        assert not first.done()
        rt.evaluate_now()
        c.now += 30.0
        plan = rt.evaluate_now()
        msg = await asyncio.wait_for(first, 5)
        assert msg.plan_id == plan.plan_id and len(msg.moves) == len(plan.moves)
        stream.cancel()
        # a late watcher asking for the latest gets it at once
        late = stub.WatchPlans(apb.WatchPlansRequest(include_latest=True))
        assert (await asyncio.wait_for(late.read(), 5)).plan_id == plan.plan_id
        late.cancel()
    finally:
        await channel.close()
        await server.stop(None)


async def test_the_loop_evaluates_on_its_own_and_stops_cleanly():
    c = Cluster()
    rt = runtime_for(c, interval_s=0.02)
    hot_spot(c)
    rt.start()
    try:
        for _ in range(100):
            if rt.last_plan is not None:
                break
            await asyncio.sleep(0.02)
        assert rt.last_plan is not None
    finally:
        await rt.stop()
    assert rt._loop_task is None


# ---- the command hook ---------------------------------------------------------------------------------


async def test_hook_gets_the_plan_as_json_on_stdin(tmp_path):
    out = tmp_path / "plan.json"
    script = f"import sys, os, json; d = json.load(sys.stdin); d['env'] = os.environ['GPULB_PLAN_ID']; open({str(out)!r}, 'w').write(json.dumps(d))"
    c = Cluster()
    rt = runtime_for(c, hook=CommandHook([sys.executable, "-c", script], timeout_s=10))
    hot_spot(c)
    rt.evaluate_now()
    c.now += 30.0
    plan = rt.evaluate_now()
    await rt.hook_idle()
    assert rt.last_hook.outcome == "ok" and rt.hook_runs == {"ok": 1}
    doc = json.loads(out.read_text())
    assert doc["plan_id"] == plan.plan_id and doc["env"] == str(plan.plan_id)
    assert doc["moves"][0]["task_id"] == plan.moves[0].task_id


async def test_hook_is_bounded_in_time_and_failures_are_counted():
    c = Cluster()
    slow = CommandHook([sys.executable, "-c", "import time; time.sleep(30)"], timeout_s=0.3)
    rt = runtime_for(c, hook=slow)
    hot_spot(c)
    rt.evaluate_now()
    c.now += 30.0
    rt.evaluate_now()
    await asyncio.wait_for(rt.hook_idle(), 5)
    assert rt.last_hook.outcome == "timeout" and rt.last_hook.duration_s < 5
    failing = CommandHook([sys.executable, "-c", "import sys; print('no', file=sys.stderr); sys.exit(3)"])
    plan = rt.last_plan
    result = await failing.run(plan)
    assert (result.outcome, result.returncode, result.stderr_tail.strip()) == ("failed", 3, "no")
    missing = await CommandHook(["/nonexistent/executor"]).run(plan)
    assert missing.outcome == "error"
    with pytest.raises(ValueError):
        CommandHook([])


async def test_a_hook_timeout_ends_what_the_hook_started_and_keeps_what_it_said(tmp_path):
    """The usual hook is a shell running the executor, which runs the
    checkpoint command: a timeout killed only the shell, and the result came
    when the grandchild ended (20 s for a 3 s limit, QA pass), with its output
    lost. The whole process group goes now, at the limit."""
    child = tmp_path / "child.pid"
    script = tmp_path / "hook.sh"
    script.write_text(f"#!/bin/sh\necho starting the checkpoint >&2\nsleep 30 &\necho $! > {child}\nwait\n")
    script.chmod(0o755)
    c = Cluster()
    rt = runtime_for(c)
    hot_spot(c)
    rt.evaluate_now()
    c.now += 30.0
    plan = rt.evaluate_now()
    assert plan is not None
    result = await asyncio.wait_for(CommandHook([str(script)], timeout_s=0.5).run(plan), 10)
    assert result.outcome == "timeout" and result.duration_s < 5
    assert result.stderr_tail.strip() == "starting the checkpoint"
    pid = int(child.read_text())
    await asyncio.sleep(0.1)
    stat = Path(f"/proc/{pid}/stat")
    # the checkpoint command went with the hook: gone, or a zombie no one reaps yet
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"


async def test_moves_a_failed_hook_did_not_make_leave_the_cool_down():
    """A hook that fails moved nothing: its tasks must not stay in the
    cool-down, or the advisor will not propose them again and `plan --now`
    says they were moved."""
    c = Cluster()
    rt = runtime_for(c, hook=CommandHook([sys.executable, "-c", "import sys; sys.exit(3)"], timeout_s=10))
    hot_spot(c)
    rt.evaluate_now()
    c.now += 30.0
    plan = rt.evaluate_now()
    assert plan is not None and plan.moves
    moved = {m.task_id for m in plan.moves}
    assert moved <= set(rt.advisor.state.moved_at)  # cooled down as planned
    await rt.hook_idle()
    assert rt.last_hook.outcome == "failed"
    assert not moved & set(rt.advisor.state.moved_at)
    assert rt.advisor.state.move_times == ()


# ---- metrics -------------------------------------------------------------------------------------------


async def test_metric_families():
    c = Cluster()
    rt = runtime_for(c)
    hot_spot(c)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(rt.collector())
    rt.evaluate_now()
    c.now += 30.0
    rt.evaluate_now()
    t = c.place("m40-x", "m40", duration_s=10.0)
    rt.task_started(t.task_id)
    c.now += 80.0
    c.engine.complete(t.task_id, t.assignment.lease_id)
    text = generate_latest(registry).decode()
    for name in ADVISOR_METRIC_NAMES:
        assert f"# TYPE {name} " in text or f"# TYPE {name.removesuffix('_total')} counter" in text, name
    assert 'gpulb_rebalance_plans_total{trigger="variance"} 1.0' in text
    assert "gpulb_predictor_completions_total 1.0" in text
    variance = float(next(line.split()[-1] for line in text.splitlines() if line.startswith("gpulb_gpu_utilization_variance ")))
    assert variance == pytest.approx(rt.last_trigger.variance / 10_000)
    holding = float(next(line.split()[-1] for line in text.splitlines() if line.startswith("gpulb_rebalance_holding ")))
    assert holding == (1.0 if rt.advisor.state.armed else 0.0) == 1.0  # the plan above armed the hold
    assert f'gpulb_predictor_slowdown_ratio{{kind="training",model="{M40}"}}' in text
    assert "gpulb_predictor_overrun_ratio{" not in text  # one completion: too few to say
    for _ in range(20):
        rt.predictor.observe("m40-x", M40, "inference", 10.0, 30.0 * rt.predictor.factor("m40-x", M40, "inference"))
    text = generate_latest(registry).decode()
    overrun = float(next(line.split()[-1] for line in text.splitlines()
                         if line.startswith(f'gpulb_predictor_overrun_ratio{{kind="inference",model="{M40}"}}')))
    assert overrun == pytest.approx(rt.predictor.overrun(M40, "inference")) and overrun > 1.0
    last = float(next(line.split()[-1] for line in text.splitlines()
                      if line.startswith("gpulb_rebalance_last_evaluation_seconds ")))
    total = float(next(line.split()[-1] for line in text.splitlines()
                       if line.startswith("gpulb_rebalance_evaluation_seconds_total ")))
    # two evaluations ran: the total is more than the last one alone
    assert last == pytest.approx(rt.last_evaluation_s) and total == pytest.approx(rt.evaluation_s_total)
    assert 0 < last < total
    assert not math.isnan(rt.predictor.mape())


# ---- through a real coordinator (the lead's wiring) -----------------------------------------------


@contextlib.asynccontextmanager
async def coordinator_with_sim_host(store=None):
    """A real coordinator on a loopback port with one simulated 2-GPU host
    streaming to it: yields (coordinator, port, Scheduler stub, Advisor stub)."""
    from agent.fleet import SimFleet
    from coordinator.config import CoordinatorConfig
    from coordinator.server import Coordinator
    from protos import tasks_pb2_grpc as tpb_grpc
    from waiting import until

    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", dispatch_interval_s=0.1), store=store)
    port = await coord.start()
    try:
        async with SimFleet(f"127.0.0.1:{port}", hosts=1, gpus=2, workload="idle"):
            await until(lambda: coord.dispatcher.snapshots.snapshot().gpu_count == 2, what="2 GPUs")
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                yield coord, port, tpb_grpc.SchedulerStub(ch), apb_grpc.AdvisorStub(ch)
    finally:
        await coord.stop(0)


async def test_through_a_real_coordinator_completions_teach_the_predictor(capsys):
    from protos import tasks_pb2 as tpb

    async with coordinator_with_sim_host() as (coord, port, sched, advisor):
        spec = tpb.TaskSpec(task_id="job-1", vram_mib=1024, gpu_share=0.3, duration_s=10.0, kind="training",
                            priority=tpb.PRIORITY_P1, movable=True)
        placed = (await sched.ScheduleTask(tpb.ScheduleTaskRequest(spec=spec), timeout=10)).task
        assert placed.state == tpb.TASK_STATE_LEASED
        await sched.CompleteTask(tpb.CompleteTaskRequest(task_id="job-1", lease_id=placed.assignment.lease_id,
                                                         actual_duration_s=12.0))
        got = await advisor.GetPredictions(apb.GetPredictionsRequest())
        assert got.samples == 1
        (factor,) = [f for f in got.models if f.kind == "training"]
        assert factor.samples == 1 and factor.slowdown > 1.0  # 12 s for 10 s of work
        plan = await advisor.GetPlan(apb.GetPlanRequest(evaluate_now=True))
        assert plan.trigger.gpus == 2 and not plan.trigger.fired
        # the advisor's reserve is sized by what the scheduler saw arrive
        from scheduler.advisor import reserve_ask_mib

        assert reserve_ask_mib(coord.advisor.advisor.config, coord.advisor._workload_mix()) == 1024.0

        # the operator's view of the same through `gpulb advisor` (sync gRPC: off the loop)
        from coordinator.cli import main as gpulb

        addr = ["--coordinator", f"127.0.0.1:{port}"]
        capsys.readouterr()  # the coordinator's log lines so far
        assert await asyncio.to_thread(gpulb, addr + ["advisor", "predictions", "--json"]) == 0
        out = capsys.readouterr().out  # the CLI's JSON; a coordinator log line may share stdout
        listed, _ = json.JSONDecoder().raw_decode(out[out.index("{\n"):])
        assert listed["samples"] == "1" and any(m.get("kind") == "training" and m["samples"] == "1" for m in listed["models"])
        assert await asyncio.to_thread(gpulb, addr + ["advisor", "predictions", "--kind", "training"]) == 0
        table = capsys.readouterr().out
        assert "learned from 1 completions" in table and "training" in table and "OVERRUN P90" in table
        assert await asyncio.to_thread(gpulb, addr + ["advisor", "plan", "--now"]) == 0
        text = capsys.readouterr().out
        assert "trigger quiet over 2 GPUs" in text and "fires above 400" in text and "no plan would be made now" in text
        text = coord.metrics.exposition(per_gpu=False).decode()
        assert "gpulb_predictor_completions_total 1.0" in text and "gpulb_gpu_utilization_variance" in text


async def test_through_a_real_coordinator_peaks_teach_memory_growth(capsys, tmp_path):
    """The agent's task events and the client's CompleteTask both report peak
    memory; a bad report is refused by name and loses nothing; what was
    learned reaches GetPredictions, the CLI, the metrics, the scheduler's
    snapshot, and survives a restart."""
    from coordinator.config import CoordinatorConfig
    from coordinator.server import Coordinator
    from coordinator.state import open_state_dir
    from protos import tasks_pb2 as tpb
    from waiting import until

    async with coordinator_with_sim_host(store=open_state_dir(tmp_path)) as (coord, port, sched, advisor):
        spec = tpb.TaskSpec(task_id="grows", vram_mib=1000, gpu_share=0.3, kind="training",
                            priority=tpb.PRIORITY_P1, movable=True)
        placed = (await sched.ScheduleTask(tpb.ScheduleTaskRequest(spec=spec), timeout=10)).task
        lease = placed.assignment.lease_id
        for bad in (-1.0, math.nan, math.inf, 1e300, 24_565.0):  # the sim host's GPU: an RTX 4090, 24,564 MiB
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await sched.CompleteTask(tpb.CompleteTaskRequest(task_id="grows", lease_id=lease, peak_vram_mib=bad))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "peak_vram_mib" in err.value.details()
        assert "more than the task's GPU holds (24564 MiB)" in err.value.details()
        assert coord.advisor.growth.samples == 0  # nothing of a refused report was learned
        # a completion with a stale lease is refused and its report forgotten
        with pytest.raises(grpc.aio.AioRpcError):
            await sched.CompleteTask(tpb.CompleteTaskRequest(task_id="grows", lease_id="stale", peak_vram_mib=9000))
        assert "grows" not in coord.advisor._peaks
        # refused without effect: the task still holds its lease
        got = await sched.GetTask(tpb.GetTaskRequest(task_id="grows"))
        assert got.state == tpb.TASK_STATE_LEASED
        await sched.CompleteTask(tpb.CompleteTaskRequest(task_id="grows", lease_id=lease, peak_vram_mib=1500))
        # the simulated agent runs this one and reports its peak (its ask) when it finishes
        short = tpb.TaskSpec(task_id="short", vram_mib=2000, gpu_share=0.2, kind="inference",
                             duration_s=0.3, priority=tpb.PRIORITY_P0)
        await sched.ScheduleTask(tpb.ScheduleTaskRequest(spec=short), timeout=10)
        await until(lambda: coord.advisor.growth.samples == 2, what="the agent's finished event")
        got = await advisor.GetPredictions(apb.GetPredictionsRequest())
        by = {g.kind: g for g in got.memory_growth}
        assert set(by) == {"", "training", "inference"}
        assert (by["training"].samples, by["training"].max) == (1, pytest.approx(1.5))
        assert (by["inference"].samples, by["inference"].max) == (1, pytest.approx(1.0))
        assert by[""].samples == 2 and by[""].oom_kills == 0
        only = await advisor.GetPredictions(apb.GetPredictionsRequest(kind="training"))
        assert {g.kind for g in only.memory_growth} == {"", "training"}

        from coordinator.cli import main as gpulb

        capsys.readouterr()
        addr = ["--coordinator", f"127.0.0.1:{port}"]
        assert await asyncio.to_thread(gpulb, addr + ["advisor", "predictions"]) == 0
        table = capsys.readouterr().out
        assert "OOM KILLS" in table and "1.500" in table
        text = coord.metrics.exposition(per_gpu=False).decode()
        assert 'gpulb_memory_growth_ratio{kind="training",quantile="1"} 1.5' in text
        assert 'gpulb_memory_growth_samples{kind=""} 2.0' in text
        # min_samples (20) not reached: the scheduler's snapshot carries nothing yet
        assert not coord.advisor.annotate(coord.dispatcher.snapshots.snapshot()).memory_growth
    again = Coordinator(CoordinatorConfig(listen="127.0.0.1:0"), store=open_state_dir(tmp_path))
    await again.start()
    try:
        assert again.advisor.growth.samples == 2
        assert {s.kind: s.samples for s in again.advisor.growth.stats()} == {"": 2, "training": 1, "inference": 1}
    finally:
        await again.stop(0)


async def test_advisor_table_configures_the_coordinator_and_reloads_live(tmp_path):
    """``[advisor]`` from a real TOML file reaches the coordinator's advisor; a
    reload (what SIGHUP calls) changes the thresholds GetPlan reports, and a
    bad value is refused whole, naming the option."""
    from coordinator.server import Coordinator
    from coordinator.settings import ConfigError, diff_settings, load_settings

    path = tmp_path / "coordinator.toml"
    path.write_text('[coordinator]\nlisten = "127.0.0.1:0"\n[advisor]\nvariance_threshold = 250.0\nmovable_kinds = ["training", "batch"]\n'
                    "[predictor]\nalpha = 0.2\n")
    settings = load_settings(path, {"GPULB_ADVISOR_HOT_PCT": "90"}, {})
    assert settings.sources["advisor.hot_pct"] == "env:GPULB_ADVISOR_HOT_PCT"
    coord = Coordinator(settings.coordinator, settings.scheduler,
                        advisor_config=settings.advisor, predictor_config=settings.predictor)
    port = await coord.start()
    try:
        assert coord.advisor.predictor.config.alpha == 0.2
        assert coord.advisor.advisor.config.movable_kinds == frozenset({"training", "batch"})
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = apb_grpc.AdvisorStub(ch)
            before = (await stub.GetPlan(apb.GetPlanRequest())).trigger
            assert (before.variance_threshold, before.hot_pct, before.rising_gpus) == (250.0, 90.0, 2)
            assert before.release_variance == 25.0 and not before.held
            assert before.gpus == 0 and not before.fired  # never evaluated: thresholds only

            path.write_text(path.read_text().replace("variance_threshold = 250.0", "variance_threshold = 600.0\nrising_gpus = 3"))
            new = load_settings(path, {"GPULB_ADVISOR_HOT_PCT": "90"}, {})
            changed = [name for name, _, _ in diff_settings(settings, new)]
            assert changed == ["advisor.variance_threshold", "advisor.rising_gpus"]
            coord.apply_settings(new.coordinator, new.scheduler, changed, advisor_config=new.advisor)
            after = (await stub.GetPlan(apb.GetPlanRequest(evaluate_now=True))).trigger
            assert (after.variance_threshold, after.rising_gpus) == (600.0, 3)

        path.write_text(path.read_text().replace("rising_gpus = 3", "rising_gpus = 0"))
        with pytest.raises(ConfigError) as info:
            load_settings(path, {}, {})
        assert info.value.option == "advisor.rising_gpus" and str(path) in str(info.value)
        assert coord.advisor.advisor.config.rising_gpus == 3  # the running value stays
    finally:
        await coord.stop(0)
