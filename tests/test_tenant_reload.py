"""A reload (SIGHUP) that lowers a tenant's ``tenant_memory_reject_pct``
judges that tenant's queued tasks again (QA pass 25): one that no node can
ever take now is REJECTED with the reason, as the same spec submitted now
is, instead of waiting for ever (counting against the tenant's queue limit,
aging up the classes, holding a ScheduleTask(wait=true) caller until its
deadline). The engine does it against the last snapshot it dispatched (or,
before any, at the first dispatch); the coordinator's reload says which
tasks it rejected.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import grpc
import pytest
import structlog
from structlog.testing import capture_logs

from agent.fleet import SimFleet
from coordinator.config import CoordinatorConfig
from coordinator.security import Security, TokenAuth, bearer_metadata
from coordinator.server import Coordinator
from protos import tasks_pb2 as tpb
from protos import tasks_pb2_grpc as tpb_grpc
from scheduler.config import SchedulerConfig
from scheduler.engine import Scheduler
from scheduler.snapshot import ClusterSnapshot, NodeFacts
from scheduler.task import TaskSpec, TaskState
from test_tenant_limits import listen_address  # tests/ is on sys.path under pytest
from waiting import until

pytestmark = pytest.mark.timeout(120)

CARD_MIB = 24_564  # an RTX 4090 as the simulated agents report it
ASK_MIB = 17_408  # under 75 % of the card (18,423 MiB), over 70.5 % (17,317.6 MiB)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(autouse=True)
def _keep_logging():
    """capture_logs reconfigures structlog; put back what the tests after these expect."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


def one_full_card() -> ClusterSnapshot:
    return ClusterSnapshot.build([NodeFacts("n0", 1, memory_total_mib=CARD_MIB)], memory_used_mib=[20_000.0])


def task(task_id: str, tenant: str) -> TaskSpec:
    return TaskSpec(task_id=task_id, tenant=tenant, vram_mib=ASK_MIB, gpu_share=0.3, kind="batch")


def test_a_lowered_tenant_threshold_rejects_that_tenants_queued_tasks_that_can_no_longer_fit() -> None:
    config = SchedulerConfig(tenant_memory_reject_pct={"interns": 75.0})
    engine = Scheduler(config, clock=Clock())
    heard: list = []
    engine.add_listener(heard.append)
    snapshot = one_full_card()
    for spec in (task("stuck-1", "interns"), task("other-1", "research")):
        assert engine.submit(spec, snapshot).state == TaskState.QUEUED
    engine.dispatch(snapshot)  # the card is full: both wait
    assert {t.task_id: t.state for t in engine.tasks()} == {"stuck-1": TaskState.QUEUED, "other-1": TaskState.QUEUED}

    heard.clear()
    engine.reconfigure(replace(config, tenant_memory_reject_pct={"interns": 70.5}))
    stuck = engine.get("stuck-1")
    assert stuck.state == TaskState.REJECTED
    assert "70.5%" in stuck.reason and "17317.6 MiB" in stuck.reason, stuck.reason
    assert [(t.task_id, t.state) for t in heard] == [("stuck-1", TaskState.REJECTED)]
    assert engine.get("other-1").state == TaskState.QUEUED  # research's threshold did not change
    assert engine.queued() == 1
    # the same spec submitted now is rejected with the same reason
    assert engine.submit(task("stuck-2", "interns"), snapshot).reason == stuck.reason
    # raising a threshold again judges nothing
    engine.reconfigure(replace(config, tenant_memory_reject_pct={"interns": 90.0}))
    assert engine.get("other-1").state == TaskState.QUEUED


def test_before_any_snapshot_the_first_dispatch_judges_them() -> None:
    config = SchedulerConfig(tenant_memory_reject_pct={"interns": 75.0})
    engine = Scheduler(config, clock=Clock())
    engine.submit(task("early-1", "interns"))  # no node yet: nothing to judge against
    engine.reconfigure(replace(config, tenant_memory_reject_pct={"interns": 70.5}))
    assert engine.get("early-1").state == TaskState.QUEUED
    engine.dispatch(one_full_card())
    assert engine.get("early-1").state == TaskState.REJECTED


async def test_a_reload_rejects_the_stranded_task_its_waiting_caller_hears_and_the_log_names_it() -> None:
    tokens = TokenAuth.from_tokens({"interns-tok": {"role": "tenant", "tenant": "interns"},
                                    "research-tok": {"role": "tenant", "tenant": "research"},
                                    "agent-tok": {"role": "agent"}})
    config = SchedulerConfig(tenant_memory_reject_pct={"interns": 75.0})
    coord = Coordinator(CoordinatorConfig(listen=listen_address(), dispatch_interval_s=0.1), scheduler_config=config,
                        security=Security(tokens=tokens, insecure=True))
    port = await coord.start()
    try:
        async with SimFleet(f"127.0.0.1:{port}", hosts=1, gpus=1, workload="idle", agent_options={"token": "agent-tok"}):
            await until(lambda: coord.dispatcher.snapshots.snapshot().healthy.sum() == 1, what="a healthy GPU")
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = tpb_grpc.SchedulerStub(channel)
                filler = tpb.TaskSpec(task_id="fill", vram_mib=16 * 1024, gpu_share=0.3, kind="batch")
                placed = await stub.ScheduleTask(tpb.ScheduleTaskRequest(spec=filler),
                                                 metadata=bearer_metadata("research-tok"), timeout=20)
                assert placed.task.state == tpb.TASK_STATE_LEASED
                stuck = tpb.TaskSpec(task_id="stuck-1", vram_mib=ASK_MIB, gpu_share=0.3, kind="batch")
                waiting = asyncio.ensure_future(stub.ScheduleTask(
                    tpb.ScheduleTaskRequest(spec=stuck, wait=True), metadata=bearer_metadata("interns-tok"), timeout=60))
                await until(lambda: "stuck-1" in {t.task_id for t in coord.dispatcher.engine.tasks()}, what="queued")
                assert coord.dispatcher.engine.get("stuck-1").state == TaskState.QUEUED

                with capture_logs() as logs:
                    coord.apply_settings(coord.config, replace(config, tenant_memory_reject_pct={"interns": 70.5}),
                                         ["scheduler.tenant_memory_reject_pct"])
                reply = await asyncio.wait_for(waiting, 20)
                assert reply.task.state == tpb.TASK_STATE_REJECTED and "70.5%" in reply.task.reason
                events = [e for e in logs if e["event"] == "queued_tasks_rejected"]
                assert len(events) == 1 and events[0]["tasks"] == ["stuck-1"] and events[0]["tenants"] == ["interns"]
                assert events[0]["count"] == 1 and "70.5%" in events[0]["reason"]
                # the filler, research's, is untouched
                assert coord.dispatcher.engine.get("fill").state == TaskState.LEASED
    finally:
        await coord.stop(grace_s=0.1)
