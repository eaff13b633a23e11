"""The Scheduler gRPC API against a real coordinator and simulated agents on
loopback: no double-booking under concurrency, precise statuses for bad
input, policy swaps under load, and tasks lost with their node."""

from __future__ import annotations

import asyncio
import math
import re

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from waiting import until as _until
from agent.fleet import SimFleet
from coordinator.config import CoordinatorConfig
from coordinator.server import Coordinator
from protos import tasks_pb2 as tpb
from protos import tasks_pb2_grpc as tpb_grpc

pytestmark = pytest.mark.timeout(90)

GIB = 1024


async def _start(**config) -> tuple[Coordinator, int]:
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", dispatch_interval_s=0.1, **config))
    port = await coord.start()
    return coord, port



def _spec(task_id: str, **kw) -> tpb.TaskSpec:
    base = dict(task_id=task_id, num_gpus=1, vram_mib=2 * GIB, gpu_share=0.3, kind="batch", priority=tpb.PRIORITY_P2)
    base.update(kw)
    return tpb.TaskSpec(**base)


async def test_hundred_concurrent_submissions_never_double_book_fifty_gpus():
    coord, port = await _start()
    try:
        async with SimFleet(f"127.0.0.1:{port}", hosts=10, gpus=5, workload="idle"):
            await _until(lambda: len(coord.dispatcher.snapshots.snapshot().gpu_uuid) == 50 and coord.dispatcher.snapshots.snapshot().healthy.all(), what="50 healthy GPUs")
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = tpb_grpc.SchedulerStub(ch)
                calls = [
                    asyncio.ensure_future(
                        stub.ScheduleTask(tpb.ScheduleTaskRequest(spec=_spec(f"big-{i:03d}", vram_mib=20 * GIB, kind="training")), timeout=60)
                    )
                    for i in range(100)
                ]
                await _until(lambda: sum(c.done() for c in calls) >= 50, what="first 50 placements")
                await asyncio.sleep(1.0)  # readings of the placed tasks arrive; nothing more may fit
                first = [c.result().task for c in calls if c.done()]
                assert len(first) == 50
                assert all(t.state == tpb.TASK_STATE_LEASED for t in first)
                uuids = [t.assignment.gpu_uuid[0] for t in first]
                assert len(set(uuids)) == 50, "a GPU holds two 20 GiB tasks"
                queue = await stub.GetQueue(tpb.GetQueueRequest())
                assert sum(c.depth for c in queue.classes) == 50
                # each leased GPU's facts for ListGpus and ListNodes: built once, kept until a lease changes
                facts = coord.dispatcher.gpu_facts()
                # one lease each; reserved: what of its 20 GiB the readings do not show yet
                assert sorted(facts) == sorted(uuids) and all(f[1] == 1 and 0 <= f[0] <= 20 * GIB for f in facts.values())
                assert coord.dispatcher.gpu_facts() is facts
                # the exposition's task counts (counted without copying every task)
                exposition = text_string_to_metric_families(coord.metrics.exposition().decode())
                by_state = {s.labels["state"]: s.value for f in exposition if f.name == "gpulb_tasks" for s in f.samples}
                assert (by_state["leased"], by_state["queued"], by_state["completed"]) == (50, 50, 0)
                # The leases complete; the queued half takes the freed GPUs.
                for t in first:
                    await stub.CompleteTask(tpb.CompleteTaskRequest(task_id=t.spec.task_id, lease_id=t.assignment.lease_id))
                assert coord.dispatcher.gpu_facts() is not facts
                await _until(lambda: all(c.done() for c in calls), timeout=30, what="second 50 placements")
                second = [c.result().task for c in calls if c.result().task.spec.task_id not in {t.spec.task_id for t in first}]
                assert len(second) == 50 and all(t.state == tpb.TASK_STATE_LEASED for t in second)
                assert len({t.assignment.gpu_uuid[0] for t in second}) == 50
    finally:
        await coord.stop(grace_s=0.1)


@pytest.mark.parametrize(
    "spec, code, needle",
    [
        (_spec("zero-vram", vram_mib=0), grpc.StatusCode.INVALID_ARGUMENT, "spec.vram_mib"),
        (_spec("nan-share", gpu_share=math.nan), grpc.StatusCode.INVALID_ARGUMENT, "spec.gpu_share"),
        (_spec("bad-prio", priority=9), grpc.StatusCode.INVALID_ARGUMENT, "spec.priority"),
        (_spec("too-many-gpus", num_gpus=65), grpc.StatusCode.INVALID_ARGUMENT, "spec.num_gpus"),
        (_spec("", vram_mib=10), grpc.StatusCode.INVALID_ARGUMENT, "spec.task_id"),
        (_spec("too-wide", num_gpus=9), grpc.StatusCode.FAILED_PRECONDITION, "num_gpus"),
        (_spec("too-big", vram_mib=80 * GIB), grpc.StatusCode.FAILED_PRECONDITION, "rejected"),
        (_spec("no-such-model", gpu_spec="V100M32"), grpc.StatusCode.FAILED_PRECONDITION, "rejected"),
        (_spec("queued-1", vram_mib=3 * GIB), grpc.StatusCode.ALREADY_EXISTS, "vram_mib"),
    ],
)
async def test_bad_submissions_get_precise_status_and_leave_the_queue_alone(spec, code, needle):
    coord, port = await _start()
    try:
        async with SimFleet(f"127.0.0.1:{port}", hosts=1, gpus=4, workload="idle"):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = tpb_grpc.SchedulerStub(ch)
                await _until(lambda: coord.dispatcher.snapshots.snapshot().healthy.any(), what="a healthy GPU")
                kept = await stub.ScheduleTask(tpb.ScheduleTaskRequest(spec=_spec("queued-1"), wait=True), timeout=10)
                assert kept.task.state == tpb.TASK_STATE_LEASED
                before = await stub.ListTasks(tpb.ListTasksRequest())
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.ScheduleTask(tpb.ScheduleTaskRequest(spec=spec), timeout=10)
                assert info.value.code() == code
                assert needle in info.value.details()
                after = await stub.GetTask(tpb.GetTaskRequest(task_id="queued-1"))
                assert after.state == tpb.TASK_STATE_LEASED
                assert after.assignment.lease_id == kept.task.assignment.lease_id
                listed = await stub.ListTasks(tpb.ListTasksRequest(state=tpb.TASK_STATE_LEASED))
                assert [t.spec.task_id for t in listed.tasks] == ["queued-1"]
                assert len(before.tasks) >= 1
    finally:
        await coord.stop(grace_s=0.1)


async def test_lease_policy_and_task_errors_name_what_is_wrong():
    coord, port = await _start()
    try:
        async with SimFleet(f"127.0.0.1:{port}", hosts=1, gpus=2, workload="idle"):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = tpb_grpc.SchedulerStub(ch)
                await _until(lambda: coord.dispatcher.snapshots.snapshot().healthy.any(), what="a healthy GPU")
                t = (await stub.ScheduleTask(tpb.ScheduleTaskRequest(spec=_spec("a")), timeout=10)).task
                cases = [
                    (stub.CompleteTask(tpb.CompleteTaskRequest(task_id="a", lease_id="not-it")), grpc.StatusCode.FAILED_PRECONDITION, "not the task's current lease"),
                    (stub.CompleteTask(tpb.CompleteTaskRequest(task_id="ghost", lease_id="x")), grpc.StatusCode.NOT_FOUND, "ghost"),
                    (stub.SetPolicy(tpb.SetPolicyRequest(name="fastest")), grpc.StatusCode.INVALID_ARGUMENT, "fastest"),
                    (stub.SetPolicy(tpb.SetPolicyRequest(name="load_aware", weights={"luck": 1.0})), grpc.StatusCode.INVALID_ARGUMENT, "weights[luck]"),
                    (stub.RenewLease(tpb.RenewLeaseRequest(task_id="a", lease_id=t.assignment.lease_id, extend_s=-1)), grpc.StatusCode.INVALID_ARGUMENT, "extend_s"),
                ]
                for call, code, needle in cases:
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await call
                    assert info.value.code() == code, info.value.details()
                    assert needle in info.value.details()
                policy = await stub.GetPolicy(tpb.GetPolicyRequest())
                assert policy.name == "load_aware"  # nothing changed by the failed SetPolicy calls
                done = await stub.CompleteTask(tpb.CompleteTaskRequest(task_id="a", lease_id=t.assignment.lease_id))
                assert done.task.state == tpb.TASK_STATE_COMPLETED
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.CancelTask(tpb.CancelTaskRequest(task_id="a"))
                assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        await coord.stop(grace_s=0.1)


async def test_set_policy_under_load_changes_the_next_decisions_and_fails_no_call():
    coord, port = await _start()
    try:
        async with SimFleet(f"127.0.0.1:{port}", hosts=3, gpus=4, workload="idle"):
            await _until(lambda: coord.dispatcher.snapshots.snapshot().healthy.sum() == 12, what="12 GPUs")
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = tpb_grpc.SchedulerStub(ch)
                policies = ["round_robin", "binpack", "fgd", "least_connections", "weighted_round_robin", "load_aware"]
                seen: list[tuple[str, str]] = []

                switching = asyncio.Event()
                calls = [0]

                async def client(n: int) -> None:
                    i = 0
                    while not switching.is_set():
                        i += 1
                        calls[0] += 1
                        r = await stub.ScheduleTask(tpb.ScheduleTaskRequest(spec=_spec(f"c{n}-{i}", vram_mib=512)), timeout=20)
                        assert r.task.state == tpb.TASK_STATE_LEASED
                        seen.append((policy_now[0], r.task.assignment.score.policy))
                        await stub.CompleteTask(tpb.CompleteTaskRequest(task_id=r.task.spec.task_id, lease_id=r.task.assignment.lease_id))

                policy_now = ["load_aware"]

                async def switcher() -> None:
                    for name in policies:
                        await asyncio.sleep(0.3)
                        await stub.SetPolicy(tpb.SetPolicyRequest(name=name))
                        policy_now[0] = name
                    await asyncio.sleep(0.2)
                    switching.set()

                await asyncio.gather(switcher(), *(client(n) for n in range(4)))
                assert len(seen) == calls[0]  # every call came back placed: none failed
                used = {p for _, p in seen}
                assert used == set(policies), used
                # After the last switch completed, every decision uses it.
                r = await stub.ScheduleTask(tpb.ScheduleTaskRequest(spec=_spec("after", vram_mib=512)), timeout=10)
                assert r.task.assignment.score.policy == "load_aware"
                await stub.SetPolicy(tpb.SetPolicyRequest(name="binpack"))
                r = await stub.ScheduleTask(tpb.ScheduleTaskRequest(spec=_spec("after-2", vram_mib=512)), timeout=10)
                assert r.task.assignment.score.policy == "binpack"
                # fgd over the wire: its breakdown names the change of fragmentation
                await stub.SetPolicy(tpb.SetPolicyRequest(name="fgd", weights={"overcommit": 2.0}))
                r = await stub.ScheduleTask(tpb.ScheduleTaskRequest(spec=_spec("after-3", vram_mib=512)), timeout=10)
                score = r.task.assignment.score
                assert score.policy == "fgd" and {"fragmentation", "overcommit", "pack"} <= set(score.terms)
                assert (await stub.GetPolicy(tpb.GetPolicyRequest())).weights["overcommit"] == 2.0
    finally:
        await coord.stop(grace_s=0.1)


async def test_node_removed_with_leases_loses_or_requeues_its_tasks():
    coord, port = await _start(heartbeat_interval_s=0.3)
    labels = {"sim-01": {"rack": "a"}, "sim-02": {"rack": "b"}}
    try:
        async with SimFleet(f"127.0.0.1:{port}", hosts=2, gpus=2, workload="idle", labels=labels, heartbeat_interval_s=0.1) as fleet:
            await _until(lambda: coord.dispatcher.snapshots.snapshot().healthy.sum() == 4, what="4 GPUs")
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = tpb_grpc.SchedulerStub(ch)
                infer = (await stub.ScheduleTask(tpb.ScheduleTaskRequest(spec=_spec("infer", kind="inference", priority=tpb.PRIORITY_P0, required_node_labels={"rack": "a"})), timeout=10)).task
                train = (await stub.ScheduleTask(tpb.ScheduleTaskRequest(spec=_spec("train", kind="training", preferred_node_labels={"rack": "a"}, gpu_spec="RTX 4090")), timeout=10)).task
                assert infer.assignment.node_id == "sim-01"
                assert train.assignment.node_id == "sim-01"
                reserved_before = coord.gpu_scheduler_facts()
                assert {uuid for uuid in reserved_before} & set(infer.assignment.gpu_uuid)
                watch = stub.WatchTask(tpb.WatchTaskRequest(task_id="infer"))
                first = await watch.read()
                assert first.state == tpb.TASK_STATE_LEASED
                train_watch = stub.WatchTask(tpb.WatchTaskRequest(task_id="train"))
                assert (await train_watch.read()).state == tpb.TASK_STATE_LEASED
                await fleet.stop_agent("sim-01")
                update = await asyncio.wait_for(watch.read(), 15)
                assert update.state == tpb.TASK_STATE_LOST
                assert "sim-01" in update.reason and update.finished_at_ns > 0
                assert await asyncio.wait_for(watch.read(), 5) is grpc.aio.EOF  # its end: the watch ends
                # the retryable training task is placed again on the surviving node
                moved = await _until(lambda: _leased_on(stub, "train", "sim-02"), what="training task re-placed on sim-02")
                assert moved.attempts == 2
                assert "sim-01" not in coord.view.nodes
                assert not set(coord.gpu_scheduler_facts()) & set(infer.assignment.gpu_uuid)
                # its watch saw the run lost, the re-queue and the new placement: the LOST did not end it
                states = []
                while not states or states[-1] != tpb.TASK_STATE_LEASED:
                    got = await asyncio.wait_for(train_watch.read(), 5)
                    assert got is not grpc.aio.EOF, f"the watch ended after {states}"
                    if not states or states[-1] != got.state:
                        states.append(got.state)
                        if got.state == tpb.TASK_STATE_LOST:
                            assert "sim-01" in got.reason and got.finished_at_ns == 0
                assert states == [tpb.TASK_STATE_LOST, tpb.TASK_STATE_QUEUED, tpb.TASK_STATE_LEASED]
                assert got.assignment.node_id == "sim-02"
                train_watch.cancel()
                # one task finished lost (infer); the training task's lost run is a re-queue
                samples = {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
                           for family in text_string_to_metric_families(coord.metrics.exposition().decode())
                           for sample in family.samples}
                assert samples[("gpulb_tasks_finished_total", (("state", "lost"),))] == 1
                assert samples[("gpulb_tasks_requeued_total", (("cause", "node_removed"),))] == 1
                assert samples[("gpulb_tasks", (("state", "lost"),))] == 1
    finally:
        await coord.stop(grace_s=0.1)


async def _forgotten(stub, task_id: str) -> bool:
    try:
        await stub.GetTask(tpb.GetTaskRequest(task_id=task_id), timeout=5)
    except grpc.aio.AioRpcError as exc:
        return exc.code() == grpc.StatusCode.NOT_FOUND
    return False


async def test_finished_tasks_are_forgotten_past_the_retention_without_a_state_dir():
    """finished_retention_s holds for the coordinator's memory, state_dir or
    not: a task that finished longer ago is NOT_FOUND and its id takes another
    spec, as after a restart (the engine had kept it, by count alone: GetTask
    found it and a new spec was ALREADY_EXISTS long after). Queued tasks stay."""
    coord, port = await _start(finished_retention_s=0.5)
    try:
        assert coord.store is None
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = tpb_grpc.SchedulerStub(ch)
            for task_id in ("done", "waiting"):  # no GPUs yet: both wait
                await stub.ScheduleTask(tpb.ScheduleTaskRequest(spec=_spec(task_id), wait=False), timeout=5)
            await stub.CancelTask(tpb.CancelTaskRequest(task_id="done"), timeout=5)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.ScheduleTask(tpb.ScheduleTaskRequest(spec=_spec("done", vram_mib=4 * GIB), wait=False), timeout=5)
            assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS  # within the retention: the same task
            await _until(lambda: _forgotten(stub, "done"), timeout=10, what="the finished task forgotten")
            again = (await stub.ScheduleTask(tpb.ScheduleTaskRequest(spec=_spec("done", vram_mib=4 * GIB), wait=False), timeout=5)).task
            assert again.state == tpb.TASK_STATE_QUEUED and again.spec.vram_mib == 4 * GIB
            assert (await stub.GetTask(tpb.GetTaskRequest(task_id="waiting"), timeout=5)).state == tpb.TASK_STATE_QUEUED
    finally:
        await coord.stop(grace_s=0.1)


async def _leased_on(stub, task_id: str, node_id: str):
    task = await stub.GetTask(tpb.GetTaskRequest(task_id=task_id))
    return task if task.state == tpb.TASK_STATE_LEASED and task.assignment.node_id == node_id else None


async def test_sim_agent_runs_the_placed_task_and_its_lease_completes():
    coord, port = await _start()
    try:
        async with SimFleet(f"127.0.0.1:{port}", hosts=1, gpus=2, workload="idle"):
            await _until(lambda: coord.dispatcher.snapshots.snapshot().healthy.any(), what="a healthy GPU")
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = tpb_grpc.SchedulerStub(ch)
                placed = (await stub.ScheduleTask(tpb.ScheduleTaskRequest(spec=_spec("short", duration_s=0.5, vram_mib=6 * GIB)), timeout=10)).task
                assert placed.state == tpb.TASK_STATE_LEASED
                node = coord.view.nodes[placed.assignment.node_id]
                row = node.rows[placed.assignment.gpu_index[0]]

                def memory_shows_task():
                    return coord.view.raw[row, 2] >= 6 * GIB

                await _until(memory_shows_task, what="the GPU's readings show the task's VRAM")
                done = await _until(lambda: _state(stub, "short", tpb.TASK_STATE_COMPLETED), what="the sim finished the task")
                assert done.finished_at_ns >= placed.assignment.placed_at_ns
    finally:
        await coord.stop(grace_s=0.1)


async def _state(stub, task_id: str, state: int):
    task = await stub.GetTask(tpb.GetTaskRequest(task_id=task_id))
    return task if task.state == state else None


async def test_schedule_tasks_places_a_batch_and_checks_every_spec_before_queueing_any():
    """ScheduleTasks: one call, many tasks, each the task ScheduleTask would
    make; a bad spec anywhere fails the call naming specs[i] and queues none;
    a task that can never fit comes back REJECTED without harming the rest."""
    from coordinator.security import Security, TenantQuota

    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", dispatch_interval_s=0.1),
                        security=Security(insecure=True, quota=TenantQuota(6)))
    port = await coord.start()
    try:
        async with SimFleet(f"127.0.0.1:{port}", hosts=2, gpus=2, workload="idle"):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = tpb_grpc.SchedulerStub(ch)
                await _until(lambda: coord.dispatcher.snapshots.snapshot().healthy.sum() == 4, what="4 healthy GPUs")
                batch = [_spec(f"arr-{i}", vram_mib=20 * GIB) for i in range(4)] + [_spec("arr-huge", vram_mib=80 * GIB)]
                got = (await stub.ScheduleTasks(tpb.ScheduleTasksRequest(specs=batch), timeout=20)).tasks
                assert [t.spec.task_id for t in got] == [s.task_id for s in batch]  # in the order given
                placed = got[:4]
                assert all(t.state == tpb.TASK_STATE_LEASED for t in placed)
                assert len({t.assignment.gpu_uuid[0] for t in placed}) == 4  # one 20 GiB task per 24 GiB GPU
                assert got[4].state == tpb.TASK_STATE_REJECTED and "vram" in got[4].reason.lower()
                # idempotent: the same batch again is the same tasks, nothing new
                again = (await stub.ScheduleTasks(tpb.ScheduleTasksRequest(specs=batch[:4], wait=False), timeout=10)).tasks
                assert [t.assignment.lease_id for t in again] == [t.assignment.lease_id for t in placed]

                before = {t.spec.task_id for t in (await stub.ListTasks(tpb.ListTasksRequest())).tasks}
                bad_cases = [
                    ([_spec("ok-1"), _spec("ok-2", vram_mib=0)], grpc.StatusCode.INVALID_ARGUMENT, "specs[1].vram_mib"),
                    ([_spec("ok-1"), _spec("arr-0", vram_mib=3 * GIB)], grpc.StatusCode.ALREADY_EXISTS, "specs[1]: task 'arr-0'"),
                    ([_spec("ok-1"), _spec("ok-1", vram_mib=3 * GIB)], grpc.StatusCode.INVALID_ARGUMENT,
                     "specs[1].task_id: 'ok-1' repeats specs[0] with different values"),
                    ([_spec(f"q-{i}") for i in range(7)], grpc.StatusCode.RESOURCE_EXHAUSTED, "the most allowed is 6"),
                    ([], grpc.StatusCode.INVALID_ARGUMENT, "specs: 1 to 1000 tasks per call, got 0"),
                ]
                for specs, code, needle in bad_cases:
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await stub.ScheduleTasks(tpb.ScheduleTasksRequest(specs=specs, wait=False), timeout=10)
                    assert info.value.code() == code, (needle, info.value.details())
                    assert needle in info.value.details()
                after = {t.spec.task_id for t in (await stub.ListTasks(tpb.ListTasksRequest())).tasks}
                assert after == before  # nothing of a refused call was queued
                # an empty id is a malformed request, a wrong one a task that is not there
                for call, request in [(stub.GetTask, tpb.GetTaskRequest()), (stub.CancelTask, tpb.CancelTaskRequest()),
                                      (stub.CompleteTask, tpb.CompleteTaskRequest()),
                                      (stub.RenewLease, tpb.RenewLeaseRequest(extend_s=10))]:
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await call(request, timeout=10)
                    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                    assert info.value.details().startswith("task_id: required")
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.GetTask(tpb.GetTaskRequest(task_id="never"), timeout=10)
                assert info.value.code() == grpc.StatusCode.NOT_FOUND
                assert info.value.details() == "task_id: unknown task 'never'"

                # wait=false returns at once with the queued tasks; they place as leases complete
                queued = (await stub.ScheduleTasks(tpb.ScheduleTasksRequest(
                    specs=[_spec(f"next-{i}", vram_mib=20 * GIB) for i in range(2)], wait=False), timeout=10)).tasks
                assert [t.state for t in queued] == [tpb.TASK_STATE_QUEUED] * 2
                for t in placed[:2]:
                    await stub.CompleteTask(tpb.CompleteTaskRequest(task_id=t.spec.task_id, lease_id=t.assignment.lease_id))
                for t in queued:
                    await _until(lambda t=t: coord.dispatcher.engine.get(t.spec.task_id).state.name == "LEASED",
                                 timeout=20, what=f"{t.spec.task_id} placed")
    finally:
        await coord.stop(grace_s=0.1)


async def test_gpulb_submit_array_places_n_tasks_named_id_i(capsys):
    import json

    from coordinator.cli import main as gpulb

    coord, port = await _start()
    try:
        async with SimFleet(f"127.0.0.1:{port}", hosts=1, gpus=2, workload="idle"):
            await _until(lambda: coord.dispatcher.snapshots.snapshot().healthy.sum() == 2, what="2 healthy GPUs")
            capsys.readouterr()  # the coordinator's log lines so far
            argv = ["--coordinator", f"127.0.0.1:{port}", "submit", "--id", "sweep", "--vram-gib", "1", "--kind", "batch"]
            assert await asyncio.to_thread(gpulb, argv + ["--array", "3", "--json"]) == 0
            out = capsys.readouterr().out  # the CLI's JSON, among the coordinator's log lines
            listed, _ = json.JSONDecoder().raw_decode(out[out.index("[\n"):])
            assert [t["spec"]["task_id"] for t in listed] == ["sweep-0", "sweep-1", "sweep-2"]
            assert all(t["state"] == "TASK_STATE_LEASED" for t in listed)
            assert {coord.dispatcher.engine.get(f"sweep-{i}").state.name for i in range(3)} == {"LEASED"}
            with pytest.raises(SystemExit, match="--array takes 1 to 1000"):
                await asyncio.to_thread(gpulb, argv + ["--array", "0"])
    finally:
        await coord.stop(grace_s=0.1)


async def test_a_p0_task_preempts_a_background_task_through_a_real_coordinator():
    """One 24 GiB GPU holding a background task that runs until released: an
    urgent P0 task evicts it. Its watcher sees PREEMPTED (with the GPU it
    left), then QUEUED; its old lease is refused; the sim agent stops it, so
    the readings show the memory free, and the P0 task is placed there."""
    coord, port = await _start()
    try:
        async with SimFleet(f"127.0.0.1:{port}", hosts=1, gpus=1, workload="idle"):
            await _until(lambda: coord.dispatcher.snapshots.snapshot().healthy.any(), what="a healthy GPU")
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = tpb_grpc.SchedulerStub(ch)
                bg = (await stub.ScheduleTask(tpb.ScheduleTaskRequest(spec=_spec(
                    "bg", kind="background", priority=tpb.PRIORITY_P3, vram_mib=16 * GIB, gpu_share=0.5)), timeout=10)).task
                assert bg.state == tpb.TASK_STATE_LEASED
                row = coord.view.nodes[bg.assignment.node_id].rows[bg.assignment.gpu_index[0]]
                await _until(lambda: coord.view.raw[row, 2] >= 16 * GIB, what="the readings show the background task")
                watch = stub.WatchTask(tpb.WatchTaskRequest(task_id="bg"))
                assert (await watch.read()).state == tpb.TASK_STATE_LEASED
                urgent = (await stub.ScheduleTask(tpb.ScheduleTaskRequest(spec=_spec(
                    "urgent", kind="inference", priority=tpb.PRIORITY_P0, vram_mib=16 * GIB, gpu_share=0.5)), timeout=20)).task
                assert urgent.state == tpb.TASK_STATE_LEASED
                assert urgent.assignment.gpu_uuid == bg.assignment.gpu_uuid
                evicted = await asyncio.wait_for(watch.read(), 5)
                assert evicted.state == tpb.TASK_STATE_PREEMPTED
                assert evicted.reason.startswith("preempted for a P0 task on node ") and "urgent" not in evicted.reason
                assert list(evicted.assignment.gpu_uuid) == list(bg.assignment.gpu_uuid)
                requeued = await asyncio.wait_for(watch.read(), 5)
                assert requeued.state == tpb.TASK_STATE_QUEUED and not requeued.HasField("assignment")
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.CompleteTask(tpb.CompleteTaskRequest(task_id="bg", lease_id=bg.assignment.lease_id))
                assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                # the agent stopped it: the GPU holds the P0 task's memory alone
                await _until(lambda: 15 * GIB <= coord.view.raw[row, 2] < 20 * GIB, what="one task's memory on the GPU")
                exposition = text_string_to_metric_families(coord.metrics.exposition().decode())
                counts = {s.labels["outcome"]: s.value for f in exposition if f.name == "gpulb_preemptions"
                          for s in f.samples if s.name == "gpulb_preemptions_total"}
                assert counts == {"nominated": 1, "for_growth": 0, "for_compute": 0, "evicted": 1, "placed_there": 1,
                                  "placed_elsewhere": 0, "lapsed": 0}
                assert (await stub.GetTask(tpb.GetTaskRequest(task_id="bg"))).state == tpb.TASK_STATE_QUEUED
    finally:
        await coord.stop(grace_s=0.1)


async def test_the_demos_lease_holder_stops_when_preempted_and_runs_again_when_placed_again():
    import threading

    from coordinator.demo import _Client
    from coordinator.demo_workload import DemoTask
    from scheduler.task import Priority

    coord, port = await _start()
    try:
        async with SimFleet(f"127.0.0.1:{port}", hosts=1, gpus=1, workload="idle"):
            await _until(lambda: coord.dispatcher.snapshots.snapshot().healthy.any(), what="a healthy GPU")
            target = f"127.0.0.1:{port}"
            bg = DemoTask("bg-0", "analysis", 0.0, Priority.P3, "background", 1, 16 * GIB, 0.3, 3.0,
                          client_completes=True)
            client = _Client(target, "t-", [bg], 0.0, threading.Event())
            async with grpc.aio.insecure_channel(target) as ch:
                stub = tpb_grpc.SchedulerStub(ch)
                holder = asyncio.ensure_future(asyncio.to_thread(client._hold, client_stub(target), bg, "t-bg-0"))
                first = await _until(lambda: _state(stub, "t-bg-0", tpb.TASK_STATE_LEASED), what="the holder's task placed")
                urgent = (await stub.ScheduleTask(tpb.ScheduleTaskRequest(spec=_spec(
                    "urgent", kind="inference", priority=tpb.PRIORITY_P0, vram_mib=16 * GIB, duration_s=1.0)),
                    timeout=20)).task
                assert urgent.state == tpb.TASK_STATE_LEASED
                await asyncio.wait_for(holder, 30)
                done = await stub.GetTask(tpb.GetTaskRequest(task_id="t-bg-0"))
                # completed under its second lease: it ran again after the P0 task
                assert done.state == tpb.TASK_STATE_COMPLETED and done.attempts == 2
                assert done.assignment.lease_id != first.assignment.lease_id
                assert done.finished_at_ns > urgent.assignment.placed_at_ns
    finally:
        await coord.stop(grace_s=0.1)


def client_stub(target: str):
    return tpb_grpc.SchedulerStub(grpc.insecure_channel(target))


async def test_an_nvlink_p0_task_evicts_only_for_a_linked_pair_through_a_real_coordinator():
    """One host of four 24 GiB GPUs with NVLink in pairs, 0-1 and 2-3, as the
    sim agent reports its topology. P1 training (never evicted) holds one GPU
    of each pair and background tasks the other two: those two could be
    cleared, but they are not linked, so an urgent two-GPU task that needs
    NVLink evicts nothing. Once one training task ends, its pair is one
    eviction away: the background task there goes and the P0 task takes
    that pair."""
    coord, port = await _start()
    try:
        async with SimFleet(f"127.0.0.1:{port}", hosts=1, gpus=4, workload="idle"):
            await _until(lambda: coord.dispatcher.snapshots.snapshot().healthy.sum() == 4, what="4 healthy GPUs")
            snap = coord.dispatcher.snapshots.snapshot()
            assert snap.node_nvlink[0] == frozenset({frozenset({0, 1}), frozenset({2, 3})})
            uuid_of = {int(snap.gpu_index[r]): str(snap.gpu_uuid[r]) for r in range(4)}
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = tpb_grpc.SchedulerStub(ch)

                async def lease(task_id: str, **kw) -> tpb.Task:
                    task = (await stub.ScheduleTask(tpb.ScheduleTaskRequest(spec=_spec(
                        task_id, vram_mib=16 * GIB, gpu_share=0.5, **kw)), timeout=10)).task
                    assert task.state == tpb.TASK_STATE_LEASED
                    return task

                train = {t: await lease(t, kind="training", priority=tpb.PRIORITY_P1) for t in ("train-a", "train-b")}
                index = {t: task.assignment.gpu_index[0] for t, task in train.items()}
                if index["train-a"] // 2 == index["train-b"] // 2:  # one in each pair: move train-b over
                    to = 2 if index["train-b"] < 2 else 0
                    train["train-b"] = (await stub.MigrateTask(tpb.MigrateTaskRequest(
                        task_id="train-b", lease_id=train["train-b"].assignment.lease_id,
                        to_gpu_uuid=[uuid_of[to]]))).task
                    index["train-b"] = to
                bg = {t: await lease(t, kind="background", priority=tpb.PRIORITY_P3) for t in ("bg-1", "bg-2")}
                assert {task.assignment.gpu_index[0] for task in bg.values()} == set(range(4)) - set(index.values())
                await _until(lambda: (coord.view.raw[[coord.view.nodes[snap.node_ids[0]].rows[i] for i in range(4)], 2]
                                      >= 16 * GIB).all(), what="the readings show all four tasks")

                await stub.ScheduleTasks(tpb.ScheduleTasksRequest(specs=[_spec(
                    "urgent", kind="inference", priority=tpb.PRIORITY_P0, num_gpus=2, needs_nvlink=True,
                    vram_mib=16 * GIB, gpu_share=0.5)], wait=False), timeout=10)
                await asyncio.sleep(2.0)  # past preempt_after_s (1 s), a dispatch every 0.1 s
                engine = coord.dispatcher.engine
                assert engine.get("urgent").state.name == "QUEUED" and engine.nominations() == {}
                assert "NVLink-connected" in engine.get("urgent").reason
                assert {engine.get(t).state.name for t in bg} == {"LEASED"}

                # train-b ends: its pair is the background task next to it away
                await stub.CompleteTask(tpb.CompleteTaskRequest(task_id="train-b",
                                                                lease_id=train["train-b"].assignment.lease_id))
                pair = {index["train-b"], index["train-b"] ^ 1}
                victim = next(t for t, task in bg.items() if task.assignment.gpu_index[0] in pair)
                await _until(lambda: engine.get("urgent").state.name == "LEASED", timeout=20, what="the P0 task placed")
                assert set(engine.get("urgent").assignment.gpu_indices) == pair
                assert engine.get(victim).state.name == "QUEUED"
                assert engine.get(next(t for t in bg if t != victim)).state.name == "LEASED"
                assert engine.get("train-a").state.name == "LEASED"
    finally:
        await coord.stop(grace_s=0.1)


async def test_a_held_node_takes_a_task_that_ends_before_it_drains_through_a_real_coordinator():
    """The backfill as the coordinator runs it by default: two hosts of two
    GPUs, one 1,000 s lease on each, a 2-GPU task blocked past the bound
    holds one host. A 100 s task (twice that ends well before the host
    drains) is placed on the held host; a task without an estimate is not:
    nothing can be known to end before the lease there does."""
    from scheduler.config import SchedulerConfig

    assert SchedulerConfig().backfill_estimate_factor == 2.0  # on by default
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", dispatch_interval_s=0.1),
                        scheduler_config=SchedulerConfig(backfill_max_head_wait_s=0.5, backfill_max_skips=5))
    port = await coord.start()
    try:
        labels = {"sim-01": {"host": "a"}, "sim-02": {"host": "b"}}
        async with SimFleet(f"127.0.0.1:{port}", hosts=2, gpus=2, workload="idle", labels=labels):
            await _until(lambda: int(coord.dispatcher.snapshots.snapshot().healthy.sum()) == 4, what="four healthy GPUs")
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = tpb_grpc.SchedulerStub(ch)
                for host in ("a", "b"):
                    long = (await stub.ScheduleTask(tpb.ScheduleTaskRequest(spec=_spec(
                        f"long-{host}", gpu_share=1.0, vram_mib=18 * GIB, duration_s=1_000.0,
                        required_node_labels={"host": host})),
                        timeout=10)).task
                    assert long.state == tpb.TASK_STATE_LEASED
                wide = (await stub.ScheduleTask(tpb.ScheduleTaskRequest(spec=_spec(
                    "wide", kind="training", num_gpus=2, vram_mib=8 * GIB, gpu_share=1.0, duration_s=500.0), wait=False),
                    timeout=10)).task
                assert wide.state == tpb.TASK_STATE_QUEUED
                held = ""
                for _ in range(100):  # its waiting reason names the host it holds once past the bound
                    reason = (await stub.GetTask(tpb.GetTaskRequest(task_id="wide"))).reason
                    if found := re.search(r"node (\S+) is kept for it", reason):
                        held = found.group(1)
                        break
                    await asyncio.sleep(0.1)
                assert held in labels, reason
                host = labels[held]["host"]
                # pinned to the held host: only the backfill can place them
                short = (await stub.ScheduleTask(tpb.ScheduleTaskRequest(spec=_spec(
                    "short", kind="background", priority=tpb.PRIORITY_P3, gpu_share=0.5, duration_s=100.0,
                    required_node_labels={"host": host})), timeout=10)).task
                assert short.state == tpb.TASK_STATE_LEASED and short.assignment.node_id == held
                unknown = (await stub.ScheduleTask(tpb.ScheduleTaskRequest(spec=_spec(
                    "unknown", kind="background", priority=tpb.PRIORITY_P3, gpu_share=0.5,
                    required_node_labels={"host": host}), wait=False), timeout=10)).task
                assert unknown.state == tpb.TASK_STATE_QUEUED
                await asyncio.sleep(0.5)  # several dispatches
                got = await stub.GetTask(tpb.GetTaskRequest(task_id="unknown"))
                assert got.state == tpb.TASK_STATE_QUEUED and "waiting" in got.reason
    finally:
        await coord.stop(grace_s=0.1)


async def test_stopping_ends_waiting_and_watching_calls_at_once_not_after_the_grace():
    """A ScheduleTask waiting for a placement that cannot come, a WatchTask
    and a WatchView are in flight when the coordinator stops with a long
    grace: the stop does not wait that grace out (it had: every systemd
    stop took grace_s), the ScheduleTask returns the task QUEUED (it is
    kept), and the watches end UNAVAILABLE saying to call again."""
    from protos import cluster_pb2 as cpb
    from protos import cluster_pb2_grpc as cpb_grpc

    coord, port = await _start()
    stopped = False
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = tpb_grpc.SchedulerStub(ch)
            waiting = asyncio.ensure_future(stub.ScheduleTask(tpb.ScheduleTaskRequest(spec=_spec("no-gpus-yet")), timeout=120))
            await _until(lambda: "no-gpus-yet" in coord.dispatcher._waiters, what="the call waiting for a placement")
            task_watch = stub.WatchTask(tpb.WatchTaskRequest(task_id="no-gpus-yet"), timeout=120)
            assert (await task_watch.read()).state == tpb.TASK_STATE_QUEUED
            view_watch = cpb_grpc.ClusterOperatorStub(ch).WatchView(cpb.WatchViewRequest(min_interval_ms=200), timeout=120)
            await view_watch.read()
            await asyncio.wait_for(coord.stop(grace_s=120), timeout=30)  # far less than the grace
            stopped = True
            assert (await waiting).task.state == tpb.TASK_STATE_QUEUED
            for watch in (task_watch, view_watch):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    while True:
                        await watch.read()
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "shutting down; call again" in info.value.details()
    finally:
        if not stopped:
            await coord.stop(grace_s=0.1)


async def test_a_cancel_reason_past_1024_characters_is_refused_naming_reason_and_cancels_nothing():
    """CancelTaskRequest.reason is kept as Task.reason, stored, and in every
    ListTasks reply: 40 cancels with 3.5 MB reasons had made ListTasks too
    large for every client. Past the bound the cancel is refused and the task
    is untouched; at the bound it is kept whole."""
    bound = 1024  # as documented for CancelTaskRequest.reason
    coord, port = await _start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = tpb_grpc.SchedulerStub(ch)
            for task_id in ("long-why", "short-why"):
                await stub.ScheduleTask(tpb.ScheduleTaskRequest(spec=_spec(task_id), wait=False), timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.CancelTask(tpb.CancelTaskRequest(task_id="long-why", reason="x" * 3_500_000), timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.details() == f"reason: 3,500,000 characters; at most {bound:,}"
            assert (await stub.GetTask(tpb.GetTaskRequest(task_id="long-why"))).state == tpb.TASK_STATE_QUEUED
            # at the bound: cancelled, the reason kept whole
            why = "y" * bound
            cancelled = (await stub.CancelTask(tpb.CancelTaskRequest(task_id="short-why", reason=why), timeout=10)).task
            assert cancelled.state == tpb.TASK_STATE_CANCELLED and cancelled.reason == why
            listed = (await stub.ListTasks(tpb.ListTasksRequest(), timeout=10)).tasks
            assert {t.spec.task_id for t in listed} == {"long-why", "short-why"}
    finally:
        await coord.stop(grace_s=0.1)
