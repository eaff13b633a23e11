"""Per-tenant limits on submissions, through a real coordinator on loopback
with tenant tokens (QA pass 25, one cluster, three tenants):

* ``[scheduler] tenant_max_priority``: a tenant token may not submit above
  its tenant's class (before, any tenant could submit P0 and evict other
  tenants' work); PERMISSION_DENIED naming ``priority`` (``specs[i].priority``
  in a batch) and the classes allowed; admins are not limited; a reload
  applies to the next submission;
* ``max_queued_per_tenant``: the refusal of a batch gives the queued count
  and the call's new tasks apart (it said "has 20 queued" with none queued)
  and says to split the array; an identical repeat of a task the coordinator
  holds (ended or leased) returns it at the limit instead of
  RESOURCE_EXHAUSTED;
* another tenant's task: PERMISSION_DENIED without naming its tenant, the
  same from every task call.
"""

from __future__ import annotations

import itertools
import os
import socket
from dataclasses import replace

import grpc
import pytest

from agent.fleet import SimFleet
from coordinator.config import CoordinatorConfig
from coordinator.security import Security, TenantQuota, TokenAuth, bearer_metadata
from coordinator.server import Coordinator
from protos import tasks_pb2 as tpb
from protos import tasks_pb2_grpc as tpb_grpc
from scheduler.config import SchedulerConfig
from waiting import until

pytestmark = pytest.mark.timeout(120)

Code = grpc.StatusCode
GIB = 1024

TOKENS = {
    "ops-tok": {"role": "admin", "name": "ops"},
    "interns-tok": {"role": "tenant", "tenant": "interns", "name": "interns"},
    "research-tok": {"role": "tenant", "tenant": "research", "name": "research"},
    "agent-tok": {"role": "agent", "name": "gpu-hosts"},
}


def listen_address() -> str:
    """127.0.0.1 and a port: one free in GPULB_TEST_PORTS ("LOW-HIGH") where
    the ports a test may bind are given, else one the kernel picks."""
    ports = os.environ.get("GPULB_TEST_PORTS", "")
    if ports:
        low, high = (int(p) for p in ports.split("-"))
        for _ in range(high - low + 1):  # round the range, so that two addresses asked for in a row differ
            port = low + next(_turns) % (high - low + 1)
            with socket.socket() as probe:
                try:
                    probe.bind(("127.0.0.1", port))
                except OSError:
                    continue
            return f"127.0.0.1:{port}"
        raise RuntimeError(f"no free port in GPULB_TEST_PORTS {ports}")
    return "127.0.0.1:0"


_turns = itertools.count()


async def start(scheduler_config: SchedulerConfig | None = None, max_queued: int | None = None) -> tuple[Coordinator, int]:
    coord = Coordinator(CoordinatorConfig(listen=listen_address(), dispatch_interval_s=0.1),
                        scheduler_config=scheduler_config,
                        security=Security(tokens=TokenAuth.from_tokens(TOKENS), insecure=True,
                                          quota=TenantQuota(max_queued)))
    return coord, await coord.start()


def spec(task_id: str, priority: int = tpb.PRIORITY_P2, **kw) -> tpb.TaskSpec:
    base = dict(task_id=task_id, vram_mib=2 * GIB, gpu_share=0.3, kind="batch", priority=priority)
    base.update(kw)
    return tpb.TaskSpec(**base)


async def refusal(call) -> tuple[Code, str]:
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details()
    return Code.OK, ""


async def test_a_tenant_submits_only_the_classes_its_tenant_max_priority_allows() -> None:
    config = SchedulerConfig(tenant_max_priority={"interns": "P2"})
    coord, port = await start(config)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = tpb_grpc.SchedulerStub(channel)

            def submit(token: str, task: tpb.TaskSpec):
                return stub.ScheduleTask(tpb.ScheduleTaskRequest(spec=task, wait=False),
                                         metadata=bearer_metadata(token), timeout=10)

            for task_id, priority in (("i-p0", tpb.PRIORITY_P0), ("i-p1", tpb.PRIORITY_P1)):
                code, details = await refusal(submit("interns-tok", spec(task_id, priority)))
                assert code == Code.PERMISSION_DENIED, details
                assert details.startswith("spec.priority: tenant 'interns' may submit P2 to P3 (tenant_max_priority), "
                                          f"got P{priority - 1}"), details
            for task_id, priority in (("i-p2", tpb.PRIORITY_P2), ("i-p3", tpb.PRIORITY_P3), ("i-default", 0)):
                assert (await submit("interns-tok", spec(task_id, priority))).task.state == tpb.TASK_STATE_QUEUED
            # a batch names the spec, and queues nothing of a refused call
            code, details = await refusal(stub.ScheduleTasks(
                tpb.ScheduleTasksRequest(specs=[spec("b-0", tpb.PRIORITY_P3), spec("b-1", tpb.PRIORITY_P0)], wait=False),
                metadata=bearer_metadata("interns-tok"), timeout=10))
            assert code == Code.PERMISSION_DENIED
            assert details.startswith("specs[1].priority: tenant 'interns' may submit P2 to P3"), details
            assert {t.task_id for t in coord.dispatcher.engine.tasks()} == {"i-p2", "i-p3", "i-default"}
            # other tenants are not limited, nor are admins, even for interns
            assert (await submit("research-tok", spec("r-p0", tpb.PRIORITY_P0))).task.state == tpb.TASK_STATE_QUEUED
            ops = await submit("ops-tok", spec("ops-p0", tpb.PRIORITY_P0, tenant="interns"))
            assert ops.task.spec.tenant == "interns" and ops.task.state == tpb.TASK_STATE_QUEUED

            # a reload (SIGHUP) applies to the next submission; what was accepted stays
            # what it is, and its identical repeat is answered with it
            lowered = replace(config, tenant_max_priority={"interns": "P3"})
            coord.apply_settings(coord.config, lowered, ["scheduler.tenant_max_priority"])
            code, details = await refusal(submit("interns-tok", spec("i-p2-again", tpb.PRIORITY_P2)))
            assert code == Code.PERMISSION_DENIED and "may submit P3 only" in details, details
            repeat = await submit("interns-tok", spec("i-p2", tpb.PRIORITY_P2))
            assert repeat.task.state == tpb.TASK_STATE_QUEUED and repeat.task.spec.priority == tpb.PRIORITY_P2
    finally:
        await coord.stop(grace_s=0.1)


def test_tenant_max_priority_is_checked_with_the_configuration() -> None:
    from scheduler.errors import InvalidArgument

    config = SchedulerConfig(tenant_max_priority={"a": "P1", "b": "p3"}).validate()
    assert (config.max_priority_for("a"), config.max_priority_for("b"), config.max_priority_for("c")) == (1, 3, None)
    with pytest.raises(InvalidArgument, match=r"tenant_max_priority\[a\]: must be one of P0, P1, P2, P3"):
        SchedulerConfig(tenant_max_priority={"a": "P4"}).validate()


async def test_the_queue_limit_counts_a_batch_apart_and_lets_repeats_of_held_tasks_through() -> None:
    coord, port = await start(max_queued=3)
    try:
        async with SimFleet(f"127.0.0.1:{port}", hosts=1, gpus=1, workload="idle",
                            agent_options={"token": "agent-tok"}):
            await until(lambda: coord.dispatcher.snapshots.snapshot().healthy.sum() == 1, what="a healthy GPU")
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = tpb_grpc.SchedulerStub(channel)
                interns = bearer_metadata("interns-tok")

                def submit(task: tpb.TaskSpec, wait: bool = False):
                    return stub.ScheduleTask(tpb.ScheduleTaskRequest(spec=task, wait=wait), metadata=interns, timeout=20)

                def submit_many(tasks: list[tpb.TaskSpec]):
                    return stub.ScheduleTasks(tpb.ScheduleTasksRequest(specs=tasks, wait=False), metadata=interns,
                                              timeout=20)

                # an array larger than the limit, with nothing queued: the message says so
                code, details = await refusal(submit_many([spec(f"big-{i}", vram_mib=20 * GIB) for i in range(5)]))
                assert code == Code.RESOURCE_EXHAUSTED
                assert details.startswith("tenant 'interns' has 0 queued tasks and this call would queue 5 more, the "
                                          "most allowed is 3 (max_queued_per_tenant): a call may add 3 now; split"), details

                # one task ends, one holds the only GPU, three wait behind it: the limit
                ended = spec("ended-1", vram_mib=20 * GIB)
                assert (await submit(ended)).task.state in (tpb.TASK_STATE_QUEUED, tpb.TASK_STATE_LEASED)
                await stub.CancelTask(tpb.CancelTaskRequest(task_id="ended-1"), metadata=interns, timeout=10)
                running = spec("run-1", vram_mib=20 * GIB)
                assert (await submit(running, wait=True)).task.state == tpb.TASK_STATE_LEASED
                for i in range(3):
                    assert (await submit(spec(f"wait-{i}", vram_mib=20 * GIB))).task.state == tpb.TASK_STATE_QUEUED
                code, details = await refusal(submit(spec("wait-3", vram_mib=20 * GIB)))
                assert (code, details) == (Code.RESOURCE_EXHAUSTED, "tenant 'interns' has 3 queued tasks, the most "
                                                                    "allowed is 3 (max_queued_per_tenant)")
                code, details = await refusal(submit_many([spec("wait-2", vram_mib=20 * GIB),
                                                           spec("wait-4", vram_mib=20 * GIB)]))
                assert code == Code.RESOURCE_EXHAUSTED and "has 3 queued tasks and this call would queue 1 more" in details

                # at the limit, repeats of the ended, the leased and a queued task queue nothing: answered with them
                assert (await submit(ended)).task.state == tpb.TASK_STATE_CANCELLED
                assert (await submit(running)).task.state == tpb.TASK_STATE_LEASED
                assert (await submit(spec("wait-0", vram_mib=20 * GIB))).task.state == tpb.TASK_STATE_QUEUED
                states = [t.state for t in (await submit_many([ended, running, spec("wait-1", vram_mib=20 * GIB)])).tasks]
                assert states == [tpb.TASK_STATE_CANCELLED, tpb.TASK_STATE_LEASED, tpb.TASK_STATE_QUEUED]
                # and the same id with another spec is what it is below the limit: ALREADY_EXISTS
                code, details = await refusal(submit(spec("run-1", vram_mib=4 * GIB)))
                assert code == Code.ALREADY_EXISTS, details
    finally:
        await coord.stop(grace_s=0.1)


async def test_another_tenants_task_is_refused_without_naming_its_tenant_by_every_task_call() -> None:
    coord, port = await start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = tpb_grpc.SchedulerStub(channel)
            await stub.ScheduleTask(tpb.ScheduleTaskRequest(spec=spec("llm-pretrain-v7"), wait=False),
                                    metadata=bearer_metadata("research-tok"), timeout=10)
            interns = bearer_metadata("interns-tok")
            task_id = "llm-pretrain-v7"

            async def watch() -> None:
                async for _ in stub.WatchTask(tpb.WatchTaskRequest(task_id=task_id), metadata=interns, timeout=10):
                    pass

            calls = {
                "GetTask": stub.GetTask(tpb.GetTaskRequest(task_id=task_id), metadata=interns, timeout=10),
                "WatchTask": watch(),
                "CancelTask": stub.CancelTask(tpb.CancelTaskRequest(task_id=task_id), metadata=interns, timeout=10),
                "CompleteTask": stub.CompleteTask(tpb.CompleteTaskRequest(task_id=task_id, lease_id="x"),
                                                  metadata=interns, timeout=10),
                "RenewLease": stub.RenewLease(tpb.RenewLeaseRequest(task_id=task_id, lease_id="x", extend_s=10),
                                              metadata=interns, timeout=10),
                "MigrateTask": stub.MigrateTask(tpb.MigrateTaskRequest(task_id=task_id, lease_id="x",
                                                                       to_gpu_uuid=["GPU-x"]),
                                                metadata=interns, timeout=10),
            }
            expected = ("token 'interns' (tenant 'interns') cannot act on task 'llm-pretrain-v7': it belongs to another "
                        "tenant (task ids are shared by every tenant)")
            for name, call in calls.items():
                assert await refusal(call) == (Code.PERMISSION_DENIED, expected), name
            assert coord.dispatcher.engine.get(task_id).state.name == "QUEUED"
            # the owner and an admin still may
            owner = await stub.GetTask(tpb.GetTaskRequest(task_id=task_id), metadata=bearer_metadata("research-tok"),
                                       timeout=10)
            assert owner.spec.tenant == "research"
            cancelled = await stub.CancelTask(tpb.CancelTaskRequest(task_id=task_id), metadata=bearer_metadata("ops-tok"),
                                              timeout=10)
            assert cancelled.task.state == tpb.TASK_STATE_CANCELLED
    finally:
        await coord.stop(grace_s=0.1)

