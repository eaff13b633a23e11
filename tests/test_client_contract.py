"""The client contract of gpulb.v1 as QA pass 24 checked it: what a tenant's
token sees (GetQueue, GetPredictions, ALREADY_EXISTS messages), ListTasks
pages that never outgrow a reply, a rejected task's id judged again, replies
that show a task as it is when sent (deadline_s), renewals that never
shorten a lease, and proto comments that say what the code does."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import time
from pathlib import Path

import grpc
import pytest

from agent.fleet import SimFleet
from coordinator.config import CoordinatorConfig
from coordinator.security import Security, TokenAuth, bearer_metadata
from coordinator.server import Coordinator
from coordinator.state import TaskStore, restore_into
from protos import advisor_pb2 as apb
from protos import advisor_pb2_grpc as apb_grpc
from protos import cluster_pb2 as cpb
from protos import cluster_pb2_grpc as cpb_grpc
from protos import tasks_pb2 as tpb
from protos import tasks_pb2_grpc as tpb_grpc
from scheduler.config import SchedulerConfig
from scheduler.engine import Scheduler
from scheduler.errors import TaskConflict
from scheduler.snapshot import ClusterSnapshot, NodeFacts
from scheduler.task import Priority, TaskSpec, TaskState
from waiting import until as _until

pytestmark = pytest.mark.timeout(90)

ROOT = Path(__file__).resolve().parents[1]
GIB = 1024

TOKENS = {
    "admin-token": {"role": "admin"},
    "alice-token": {"role": "tenant", "tenant": "alice"},
    "bob-token": {"role": "tenant", "tenant": "bob"},
}
ADMIN, ALICE, BOB = (bearer_metadata(t) for t in ("admin-token", "alice-token", "bob-token"))


async def _start(*, tokens: bool = True, scheduler_config: SchedulerConfig | None = None, **config) -> tuple[Coordinator, int]:
    security = Security(tokens=TokenAuth.from_tokens(TOKENS), insecure=True) if tokens else None
    coord = Coordinator(CoordinatorConfig(**{"listen": "127.0.0.1:0", "dispatch_interval_s": 0.1, **config}),
                        scheduler_config, security=security)
    return coord, await coord.start()


def _spec(task_id: str, **kw) -> tpb.TaskSpec:
    base = dict(task_id=task_id, num_gpus=1, vram_mib=2 * GIB, gpu_share=0.3, kind="batch", priority=tpb.PRIORITY_P2)
    base.update(kw)
    return tpb.TaskSpec(**base)


async def _error(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value


# ---- engine --------------------------------------------------------------------------------------


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _engine(config: SchedulerConfig | None = None) -> tuple[Scheduler, Clock]:
    clock = Clock()
    ids = (f"lease-{i}" for i in itertools.count())
    return Scheduler(config, clock=clock, lease_ids=lambda: next(ids)), clock


def _task(task_id: str, **kw) -> TaskSpec:
    base = dict(task_id=task_id, vram_mib=2.0 * GIB, gpu_share=0.2, kind="batch")
    base.update(kw)
    return TaskSpec(**base)


def _two_gpus(*extra: NodeFacts) -> ClusterSnapshot:
    return ClusterSnapshot.build([NodeFacts("n0", 2, memory_total_mib=24.0 * GIB), *extra])


def test_a_rejected_id_is_judged_again_and_the_new_record_replaces_it() -> None:
    sched, clock = _engine()
    small = _two_gpus()
    first = sched.submit(_task("rj", num_gpus=4), small)
    assert first.state == TaskState.REJECTED and "num_gpus 4 exceeds every node" in first.reason
    sched.submit(_task("other"), small)
    # the same spec on the same cluster: judged again, rejected again, a fresh record
    clock.now += 5
    again = sched.submit(_task("rj", num_gpus=4), small)
    assert again.state == TaskState.REJECTED and again.submitted_at == again.finished_at == clock.now
    # a fixed spec under the same id: queued (was: ALREADY_EXISTS for 24 h)
    fixed = sched.submit(_task("rj", num_gpus=2), small)
    assert fixed.state == TaskState.QUEUED
    assert [t.task_id for t in sched.tasks()] == ["other", "rj"]  # the newest submission now
    assert sched.submit(_task("rj", num_gpus=2), small).seq == fixed.seq  # a live task: idempotent
    with pytest.raises(TaskConflict):
        sched.submit(_task("rj", num_gpus=1), small)  # and its id held

    # the cluster changed: an identical retry is judged against it, not the old reason repeated
    wanted = {"rack": "r2"}
    assert sched.submit(_task("lab", required_node_labels=wanted), small).state == TaskState.REJECTED
    labelled = _two_gpus(NodeFacts("n1", 2, memory_total_mib=24.0 * GIB, labels=wanted))
    assert sched.submit(_task("lab", required_node_labels=wanted), labelled).state == TaskState.QUEUED

    # another tenant's rejected id stays taken, and its owner's record stays
    assert sched.submit(_task("alice-rj", tenant="alice", num_gpus=4), small).state == TaskState.REJECTED
    with pytest.raises(TaskConflict) as info:
        sched.submit(_task("alice-rj", tenant="bob", num_gpus=2), small)
    assert "tenant" in info.value.fields
    assert sched.get("alice-rj").spec.tenant == "alice"


def test_schedule_tasks_judges_a_rejected_id_again_once_per_call() -> None:
    sched, _ = _engine()
    small = _two_gpus()
    [rejected] = sched.submit_many([_task("b1", num_gpus=4)], small)
    assert rejected.state == TaskState.REJECTED
    # an identical repeat within the call is one new try, not two
    twice = sched.submit_many([_task("b1", num_gpus=4), _task("b1", num_gpus=4)], small)
    assert [t.state for t in twice] == [TaskState.REJECTED] * 2 and twice[0].seq == twice[1].seq != rejected.seq
    fixed = sched.submit_many([_task("b1", num_gpus=2), _task("b2")], small)
    assert [t.state for t in fixed] == [TaskState.QUEUED, TaskState.QUEUED]
    assert [t.task_id for t in sched.tasks()] == ["b1", "b2"]


def test_a_rejected_tasks_old_deadline_does_not_expire_its_new_try() -> None:
    sched, clock = _engine()
    # submitted before any snapshot: judged (and rejected) at the first dispatch,
    # after its deadline was noted
    sched.submit(_task("d", num_gpus=4, deadline_s=10.0))
    sched.dispatch(_two_gpus())
    assert sched.get("d").state == TaskState.REJECTED
    assert sched.submit(_task("d", num_gpus=2, deadline_s=100.0)).state == TaskState.QUEUED
    clock.now += 20.0  # past the rejected task's deadline, not the new one's
    assert sched.expire_deadlines() == []
    assert sched.get("d").state == TaskState.QUEUED


def test_the_new_try_of_a_rejected_task_replaces_its_stored_row(tmp_path: Path) -> None:
    sched, clock = _engine()
    small = _two_gpus()
    with TaskStore(tmp_path / "s.db") as store:
        sched.add_listener(store.stage)
        sched.submit(_task("a", vram_mib=30.0 * GIB, num_gpus=1), None)  # waits: no snapshot yet
        assert sched.submit(_task("rj", num_gpus=4), small).state == TaskState.REJECTED
        store.commit()
        clock.now += 1
        sched.submit(_task("b"), small)
        store.commit()
        clock.now += 1
        assert sched.submit(_task("rj", num_gpus=2), small).state == TaskState.QUEUED
        store.commit()
        # rejected and tried again before a commit: one row, the new one, newest
        assert sched.submit(_task("rj2", num_gpus=4), small).state == TaskState.REJECTED
        sched.submit(_task("c"), small)
        assert sched.submit(_task("rj2", num_gpus=1), small).state == TaskState.QUEUED
        store.commit()
        order = [t.task_id for t in sched.tasks()]
        assert order == ["a", "b", "rj", "c", "rj2"]
        loaded = store.load()
    assert [t.task_id for t in loaded.tasks] == order
    by_id = {t.task_id: t for t in loaded.tasks}
    assert by_id["rj"].state == TaskState.QUEUED and by_id["rj"].spec.num_gpus == 2 and by_id["rj"].finished_at is None
    assert by_id["rj2"].state == TaskState.QUEUED and by_id["rj2"].spec.num_gpus == 1
    fresh, _ = _engine()
    restore_into(fresh, loaded)
    assert [t.task_id for t in fresh.tasks()] == order
    assert fresh.get("rj").state == TaskState.QUEUED and fresh.queued() == 5


def test_a_tenants_queue_head_holds_its_own_tasks_only() -> None:
    sched, _ = _engine()
    for i in range(3):
        sched.submit(_task(f"alice-{i}", tenant="alice", priority=Priority.P1))
    sched.submit(_task("bob-0", tenant="bob"))
    everyone = sched.queue_summary()
    bob = sched.queue_summary(tenant="bob")
    assert sorted(t.task_id for t in everyone.head) == ["alice-0", "alice-1", "alice-2", "bob-0"]
    assert [t.task_id for t in bob.head] == ["bob-0"]
    assert bob.classes == everyone.classes  # the depths and waits stay every tenant's


# ---- through a coordinator: tenancy ----------------------------------------------------------------


async def test_get_queue_shows_a_tenant_its_own_tasks_and_an_admin_every_task():
    coord, port = await _start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = tpb_grpc.SchedulerStub(ch)
            for i in range(3):  # no node yet: they wait
                await stub.ScheduleTask(tpb.ScheduleTaskRequest(spec=_spec(f"alice-wait{i}", labels={"customer": "acme-corp"}),
                                                                wait=False), metadata=ALICE, timeout=10)
            await stub.ScheduleTask(tpb.ScheduleTaskRequest(spec=_spec("bob-wait"), wait=False), metadata=BOB, timeout=10)
            seen = {}
            for who, md in (("alice", ALICE), ("bob", BOB), ("admin", ADMIN)):
                queue = await stub.GetQueue(tpb.GetQueueRequest(), metadata=md, timeout=10)
                assert sum(c.depth for c in queue.classes) == 4, who  # the depths are every tenant's
                seen[who] = [(t.spec.task_id, t.spec.tenant) for t in queue.head]
            assert seen["bob"] == [("bob-wait", "bob")]
            assert seen["alice"] == [(f"alice-wait{i}", "alice") for i in range(3)]
            assert sorted(seen["admin"]) == sorted(seen["alice"] + seen["bob"])
    finally:
        await coord.stop(grace_s=0.1)


async def test_an_id_another_tenant_holds_is_taken_without_naming_what_differs():
    coord, port = await _start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = tpb_grpc.SchedulerStub(ch)
            await stub.ScheduleTask(tpb.ScheduleTaskRequest(spec=_spec("alice-run", labels={"customer": "acme"}), wait=False),
                                    metadata=ALICE, timeout=10)
            for call in (
                stub.ScheduleTask(tpb.ScheduleTaskRequest(spec=_spec("alice-run"), wait=False), metadata=BOB, timeout=10),
                stub.ScheduleTasks(tpb.ScheduleTasksRequest(specs=[_spec("bob-1"), _spec("alice-run")], wait=False),
                                   metadata=BOB, timeout=10),
            ):
                error = await _error(call)
                assert error.code() == grpc.StatusCode.ALREADY_EXISTS
                details = error.details()
                assert "'alice-run' is taken" in details and "choose another id" in details, details
                assert not re.search(r"differ|tenant '|labels|alice'?$|acme", details.replace("'alice-run'", "")), details
            assert error.details().startswith("specs[1]: ")
            # the id's own tenant, and an admin, are told what differs
            error = await _error(stub.ScheduleTask(tpb.ScheduleTaskRequest(spec=_spec("alice-run", vram_mib=3 * GIB,
                                                                                      labels={"customer": "acme"}), wait=False),
                                                   metadata=ALICE, timeout=10))
            assert error.code() == grpc.StatusCode.ALREADY_EXISTS and "differs in: vram_mib" in error.details()
            error = await _error(stub.ScheduleTask(tpb.ScheduleTaskRequest(spec=_spec("alice-run", tenant="bob"), wait=False),
                                                   metadata=ADMIN, timeout=10))
            assert "differs in: tenant, labels" in error.details()
            # nothing of bob's batch was queued
            assert [t.spec.task_id for t in (await stub.ListTasks(tpb.ListTasksRequest(), metadata=ADMIN)).tasks] == ["alice-run"]
    finally:
        await coord.stop(grace_s=0.1)


async def test_get_predictions_shows_a_tenant_the_kinds_its_tenant_submitted():
    coord, port = await _start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = tpb_grpc.SchedulerStub(ch)
            await stub.ScheduleTask(tpb.ScheduleTaskRequest(spec=_spec("m-1", kind="acme-merger-model"), wait=False),
                                    metadata=ALICE, timeout=10)
            await stub.ScheduleTask(tpb.ScheduleTaskRequest(spec=_spec("b-1", kind="bob-kind"), wait=False),
                                    metadata=BOB, timeout=10)
            runtime = coord.advisor
            for kind in ("acme-merger-model", "bob-kind", "never-submitted"):
                runtime.predictor.observe("n1", "NVIDIA GeForce RTX 4090", kind, 10.0, 12.0)
                runtime.growth.observe(kind, 1000.0, 1500.0)
            advisor = apb_grpc.AdvisorStub(ch)
            kinds = {}
            for who, md in (("alice", ALICE), ("bob", BOB), ("admin", ADMIN)):
                reply = await advisor.GetPredictions(apb.GetPredictionsRequest(), metadata=md, timeout=10)
                kinds[who] = ({f.kind for f in reply.models}, {g.kind for g in reply.memory_growth})
            every = {"", "acme-merger-model", "bob-kind", "never-submitted"}
            assert kinds["admin"] == (every, every)
            assert kinds["bob"] == ({"", "bob-kind"}, {"", "bob-kind"})
            assert kinds["alice"] == ({"", "acme-merger-model"}, {"", "acme-merger-model"})
            # a kind filter cannot reach past it
            reply = await advisor.GetPredictions(apb.GetPredictionsRequest(kind="acme-merger-model"), metadata=BOB, timeout=10)
            assert {f.kind for f in reply.models} == {""} and {g.kind for g in reply.memory_growth} == {""}
    finally:
        await coord.stop(grace_s=0.1)


# ---- ListTasks pages ------------------------------------------------------------------------------


def _labels(i: int) -> dict[str, str]:
    """About 7,800 characters: inside the documented 8,192 over the three maps."""
    return {f"k{j:02d}-{i:04d}": "v" * 250 for j in range(30)}


async def _pages(stub, md, **request) -> list[tpb.ListTasksResponse]:
    pages, token = [], ""
    while True:
        reply = await stub.ListTasks(tpb.ListTasksRequest(page_token=token, paged=True, **request), metadata=md, timeout=10)
        pages.append(reply)
        token = reply.next_page_token
        if not token:
            return pages
        assert len(pages) < 100


async def test_list_tasks_pages_stay_under_the_message_limit_and_reach_every_task(capsys):
    from coordinator.cli import main as gpulb

    limit = 128 * 1024
    coord, port = await _start(max_message_bytes=limit)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = tpb_grpc.SchedulerStub(ch)
            big = [_spec(f"big-{i:03d}", labels=_labels(i)) for i in range(40)]
            for start in range(0, 40, 10):
                if start == 20:  # two small tasks of bob's among them
                    await stub.ScheduleTasks(tpb.ScheduleTasksRequest(specs=[_spec("bob-0"), _spec("bob-1")], wait=False),
                                             metadata=BOB, timeout=10)
                await stub.ScheduleTasks(tpb.ScheduleTasksRequest(specs=big[start:start + 10], wait=False),
                                         metadata=ALICE, timeout=10)
            order = [f"big-{i:03d}" for i in range(20)] + ["bob-0", "bob-1"] + [f"big-{i:03d}" for i in range(20, 40)]

            # a client that does not say it pages (one written before paging,
            # which would take a short page for the whole listing) is told
            # the listing does not fit, naming the field, as before paging
            error = await _error(stub.ListTasks(tpb.ListTasksRequest(), metadata=ADMIN, timeout=10))
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and error.details().startswith("paged: ")
            assert len((await stub.ListTasks(tpb.ListTasksRequest(limit=5), metadata=ADMIN, timeout=10)).tasks) == 5

            # paged: one page under the limit (was RESOURCE_EXHAUSTED), then the rest
            pages = await _pages(stub, ADMIN)
            assert len(pages) > 1 and all(p.ByteSize() < limit for p in pages)
            assert [t.spec.task_id for p in pages for t in p.tasks] == order
            # by count too; a tenant pages through its own
            pages = await _pages(stub, ALICE, limit=7)
            assert [len(p.tasks) for p in pages] == [7, 7, 7, 7, 7, 5]
            assert [t.spec.task_id for p in pages for t in p.tasks] == [i for i in order if i.startswith("big")]
            pages = await _pages(stub, BOB)
            assert len(pages) == 1 and [t.spec.task_id for t in pages[0].tasks] == ["bob-0", "bob-1"]
            # a filter holds across pages
            pages = await _pages(stub, ADMIN, state=tpb.TASK_STATE_QUEUED, limit=15)
            assert [t.spec.task_id for p in pages for t in p.tasks] == order

            # a task submitted between pages comes on a later page; none twice
            first = await stub.ListTasks(tpb.ListTasksRequest(limit=5), metadata=ADMIN, timeout=10)
            await stub.ScheduleTask(tpb.ScheduleTaskRequest(spec=_spec("late"), wait=False), metadata=ALICE, timeout=10)
            token, seen = first.next_page_token, [t.spec.task_id for t in first.tasks]
            while token:
                reply = await stub.ListTasks(tpb.ListTasksRequest(limit=5, page_token=token), metadata=ADMIN, timeout=10)
                seen += [t.spec.task_id for t in reply.tasks]
                token = reply.next_page_token
            assert seen == order + ["late"]

            # a token from before a restart (another run's seq numbers) resumes after its task
            first = await stub.ListTasks(tpb.ListTasksRequest(limit=3), metadata=ALICE, timeout=10)
            coord.dispatcher.page_epoch = "restarted"
            after = await stub.ListTasks(tpb.ListTasksRequest(limit=3, page_token=first.next_page_token), metadata=ALICE, timeout=10)
            assert [t.spec.task_id for t in after.tasks] == ["big-003", "big-004", "big-005"]
            # ...but not for a caller who may not see that task, nor a made-up one
            for md, token in ((BOB, first.next_page_token), (ADMIN, "not-a-token"), (ADMIN, "bm90LWEtdG9rZW4")):
                error = await _error(stub.ListTasks(tpb.ListTasksRequest(page_token=token), metadata=md, timeout=10))
                assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error.details().startswith("page_token: ")

            # gpulb tasks follows the pages (was: RESOURCE_EXHAUSTED), up to --limit
            argv = ["--coordinator", f"127.0.0.1:{port}", "--token", "admin-token", "tasks"]
            capsys.readouterr()
            assert await asyncio.to_thread(gpulb, argv + ["--json"]) == 0
            out = capsys.readouterr().out
            listed, _ = json.JSONDecoder().raw_decode(out[out.index("[\n"):])
            assert [t["spec"]["task_id"] for t in listed] == order + ["late"]
            assert await asyncio.to_thread(gpulb, argv + ["--limit", "30"]) == 0
            captured = capsys.readouterr()
            assert "big-019" in captured.out and "big-029" not in captured.out
            assert "the first 30; there are more" in captured.err
    finally:
        await coord.stop(grace_s=0.1)


# ---- replies as they are when sent ----------------------------------------------------------------


async def test_a_task_whose_deadline_passed_while_the_call_waited_is_expired_in_the_reply():
    # no node: nothing is placed, and the periodic pass comes seldom
    coord, port = await _start(tokens=False, dispatch_interval_s=5.0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = tpb_grpc.SchedulerStub(ch)
            started = time.monotonic()
            task = (await stub.ScheduleTask(tpb.ScheduleTaskRequest(spec=_spec("xd0", deadline_s=0.3)), timeout=10)).task
            assert time.monotonic() - started < 2.0
            assert task.state == tpb.TASK_STATE_EXPIRED and task.reason == "deadline_s 0.3 passed while queued"
            assert task.finished_at_ns > 0
            reply = await stub.ScheduleTasks(tpb.ScheduleTasksRequest(specs=[
                _spec("xc0", deadline_s=0.2), _spec("xc1", deadline_s=0.8)]), timeout=10)
            assert [(t.spec.task_id, t.state) for t in reply.tasks] == [
                ("xc0", tpb.TASK_STATE_EXPIRED), ("xc1", tpb.TASK_STATE_EXPIRED)]
            # a call deadline before the task's: still queued, and so shown
            reply = await stub.ScheduleTasks(tpb.ScheduleTasksRequest(specs=[_spec("xc2", deadline_s=30.0)]), timeout=0.5)
            assert [t.state for t in reply.tasks] == [tpb.TASK_STATE_QUEUED]
            assert (await stub.GetTask(tpb.GetTaskRequest(task_id="xc1"))).state == tpb.TASK_STATE_EXPIRED
    finally:
        await coord.stop(grace_s=0.1)


async def test_deadlines_pass_with_no_node_connected():
    """QA pass 24 (durability): a queued task's deadline_s expired only in a
    dispatch pass over a cluster with GPUs, so with no agent connected (right
    after a coordinator restart, say) it stayed QUEUED past it; a watcher,
    not the submitter, sees it end now."""
    coord, port = await _start(tokens=False, dispatch_interval_s=0.1)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = tpb_grpc.SchedulerStub(ch)
            await stub.ScheduleTask(tpb.ScheduleTaskRequest(spec=_spec("nd0", deadline_s=0.5), wait=False), timeout=10)
            watch = stub.WatchTask(tpb.WatchTaskRequest(task_id="nd0"))
            assert (await watch.read()).state == tpb.TASK_STATE_QUEUED
            ended = await asyncio.wait_for(watch.read(), 5)
            assert ended.state == tpb.TASK_STATE_EXPIRED
    finally:
        await coord.stop(grace_s=0.1)


# ---- a rejected id, renewals, through a coordinator with nodes ----------------------------------


async def test_a_rejected_id_can_be_submitted_again_and_a_renewal_never_shortens_a_lease():
    coord, port = await _start(tokens=False, scheduler_config=SchedulerConfig(lease_s=60.0))
    try:
        async with SimFleet(f"127.0.0.1:{port}", hosts=1, gpus=2, workload="idle"):
            await _until(lambda: coord.dispatcher.snapshots.snapshot().healthy.sum() == 2, what="2 healthy GPUs")
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = tpb_grpc.SchedulerStub(ch)
                error = await _error(stub.ScheduleTask(tpb.ScheduleTaskRequest(spec=_spec("rj-1", num_gpus=9)), timeout=10))
                assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "rejected" in error.details()
                assert (await stub.GetTask(tpb.GetTaskRequest(task_id="rj-1"))).state == tpb.TASK_STATE_REJECTED
                # the fixed spec under the same id (was: ALREADY_EXISTS, differs in num_gpus)
                placed = (await stub.ScheduleTask(tpb.ScheduleTaskRequest(spec=_spec("rj-1", num_gpus=2)), timeout=10)).task
                assert placed.state == tpb.TASK_STATE_LEASED and placed.spec.num_gpus == 2
                # the same through ScheduleTasks, where a rejection is part of an OK reply
                [rejected] = (await stub.ScheduleTasks(tpb.ScheduleTasksRequest(specs=[_spec("rj-2", vram_mib=80 * GIB)]),
                                                       timeout=10)).tasks
                assert rejected.state == tpb.TASK_STATE_REJECTED
                await stub.CompleteTask(tpb.CompleteTaskRequest(task_id="rj-1", lease_id=placed.assignment.lease_id))
                [again] = (await stub.ScheduleTasks(tpb.ScheduleTasksRequest(specs=[_spec("rj-2")]), timeout=10)).tasks
                assert again.state == tpb.TASK_STATE_LEASED

                # RenewLease: a tiny extend_s leaves the lease as it is; the reply shows the expiry in force
                lease = again.assignment
                renewed = (await stub.RenewLease(tpb.RenewLeaseRequest(task_id="rj-2", lease_id=lease.lease_id,
                                                                         extend_s=0.0001), timeout=10)).task
                assert renewed.state == tpb.TASK_STATE_LEASED
                assert renewed.assignment.lease_expires_at_ns == lease.lease_expires_at_ns > time.time_ns() + 50 * 10**9
                longer = (await stub.RenewLease(tpb.RenewLeaseRequest(task_id="rj-2", lease_id=lease.lease_id,
                                                                       extend_s=600.0), timeout=10)).task
                assert longer.assignment.lease_expires_at_ns > time.time_ns() + 590 * 10**9
    finally:
        await coord.stop(grace_s=0.1)


# ---- errors and comments ---------------------------------------------------------------------------


async def test_a_long_cordon_or_cancel_reason_is_refused_with_one_number_format():
    coord, port = await _start(tokens=False)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            error = await _error(cpb_grpc.ClusterOperatorStub(ch).CordonNode(
                cpb.NodeActionRequest(node_id="n1", reason="x" * 10_000), timeout=10))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert error.details() == "reason: 10,000 characters; at most 1,024"
            stub = tpb_grpc.SchedulerStub(ch)
            await stub.ScheduleTask(tpb.ScheduleTaskRequest(spec=_spec("c"), wait=False), timeout=10)
            error = await _error(stub.CancelTask(tpb.CancelTaskRequest(task_id="c", reason="x" * 10_000), timeout=10))
            assert error.details() == "reason: 10,000 characters; at most 1,024"
            # SetPolicyRequest.name: empty keeps the current policy (as its comment now says)
            before = await stub.GetPolicy(tpb.GetPolicyRequest())
            after = await stub.SetPolicy(tpb.SetPolicyRequest(name=""))
            assert after.name == before.name
    finally:
        await coord.stop(grace_s=0.1)


def _comment_of(proto: str, anchor: str) -> str:
    """The comment lines right above ``anchor``'s line plus its trailing comment."""
    lines = proto.splitlines()
    index = next(i for i, line in enumerate(lines) if anchor in line)
    above = []
    for line in reversed(lines[:index]):
        if not line.strip().startswith("//"):
            break
        above.insert(0, line.strip().removeprefix("//").strip())
    trailing = lines[index].split("//", 1)[1].strip() if "//" in lines[index] else ""
    return " ".join(above + [trailing])


def test_the_proto_comments_say_what_the_code_does():
    tasks = (ROOT / "protos" / "tasks.proto").read_text()

    def between(first: str, last: str) -> str:
        return tasks[tasks.index(first):tasks.index(last)]

    def comment(anchor: str) -> str:
        return _comment_of(tasks, anchor)

    # a renewal and a new reason while queued are updates too (QA saw LEASED twice, QUEUED thrice)
    watch = between("message WatchTaskRequest", "message CompleteTaskRequest")
    assert "once per change" in watch and "per state change" not in watch
    # a task that never fits is FAILED_PRECONDITION, never a reply
    response = between("message ScheduleTaskResponse", "// Several tasks in one call")
    assert "FAILED_PRECONDITION" in response and "placed, queued or rejected" not in response
    listing = between("// Tasks in submission order", "message WatchTaskRequest")
    assert "oldest first" in listing and "page_token" in listing and "next_page_token" in listing
    assert "empty = keep the current one" in comment("string name = 1;                   // policy to switch to")
    assert "RESOURCE_EXHAUSTED naming the tenant" in between("// Several tasks in one call", "message ScheduleTasksRequest")
    assert "never shortens" in comment("double extend_s = 3;")
    # the scheduler places a 1-GPU needs_nvlink task on a GPU with a peer, and
    # `gpulb simulate` traces carry such rows (tests/test_sim_input.py): documented, not refused
    nvlink = comment("bool needs_nvlink = 10;")
    assert "num_gpus 1" in nvlink and "NVLink peer" in nvlink
    assert "only its own" in comment("repeated Task head = 2;")
    task_id = comment("string task_id = 1;")  # TaskSpec's, the first
    assert "one namespace across tenants" in task_id and "REJECTED" in task_id
    assert "judged again" in comment("TASK_STATE_REJECTED = 7;")
    for wait in (between("message ScheduleTaskRequest", "message ScheduleTaskResponse"),
                 between("message ScheduleTasksResponse", "message GetTaskRequest")):
        assert "EXPIRED" in wait
