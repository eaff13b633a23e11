"""GetPredictions shows a tenant token the rows of the kinds its tenant
submitted (kinds are free text that can name a project or a customer). A
submission rejected at once (it can never fit: never queued, never run)
gave that right before (QA pass 25): a tenant that guessed another
tenant's kind read its learned rows by submitting one impossible task of it.
Now only a task that was accepted (queued or placed) counts.
"""

from __future__ import annotations

import grpc
import pytest

from agent.fleet import SimFleet
from coordinator.config import CoordinatorConfig
from coordinator.security import Security, TokenAuth, bearer_metadata
from coordinator.server import Coordinator
from protos import advisor_pb2 as apb
from protos import advisor_pb2_grpc as apb_grpc
from protos import tasks_pb2 as tpb
from protos import tasks_pb2_grpc as tpb_grpc
from test_tenant_limits import listen_address  # tests/ is on sys.path under pytest
from waiting import until

pytestmark = pytest.mark.timeout(120)

KIND = "acme-customer-finetune"
TOKENS = {
    "interns-tok": {"role": "tenant", "tenant": "interns"},
    "research-tok": {"role": "tenant", "tenant": "research"},
    "agent-tok": {"role": "agent"},
}


async def test_a_submission_rejected_at_once_does_not_show_the_kinds_rows() -> None:
    coord = Coordinator(CoordinatorConfig(listen=listen_address(), dispatch_interval_s=0.1),
                        security=Security(tokens=TokenAuth.from_tokens(TOKENS), insecure=True))
    port = await coord.start()
    try:
        async with SimFleet(f"127.0.0.1:{port}", hosts=1, gpus=1, workload="idle", agent_options={"token": "agent-tok"}):
            await until(lambda: coord.dispatcher.snapshots.snapshot().healthy.sum() == 1, what="a healthy GPU")
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                sched, advisor = tpb_grpc.SchedulerStub(channel), apb_grpc.AdvisorStub(channel)
                research, interns = bearer_metadata("research-tok"), bearer_metadata("interns-tok")

                def spec(task_id: str, vram_mib: int = 2048) -> tpb.TaskSpec:
                    return tpb.TaskSpec(task_id=task_id, vram_mib=vram_mib, gpu_share=0.2, kind=KIND, duration_s=10)

                for i in range(3):
                    task = (await sched.ScheduleTask(tpb.ScheduleTaskRequest(spec=spec(f"cust-{i}")), metadata=research,
                                                     timeout=20)).task
                    assert task.state == tpb.TASK_STATE_LEASED
                    await sched.CompleteTask(tpb.CompleteTaskRequest(task_id=task.spec.task_id,
                                                                     lease_id=task.assignment.lease_id,
                                                                     actual_duration_s=20), metadata=research, timeout=10)

                async def kinds(metadata) -> set[str]:
                    reply = await advisor.GetPredictions(apb.GetPredictionsRequest(), metadata=metadata, timeout=10)
                    return {m.kind for m in reply.models}

                assert KIND in await kinds(research)
                assert KIND not in await kinds(interns)
                with pytest.raises(grpc.aio.AioRpcError) as probe:
                    await sched.ScheduleTask(tpb.ScheduleTaskRequest(spec=spec("probe-x", vram_mib=10**6), wait=False),
                                             metadata=interns, timeout=10)
                assert probe.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert KIND not in await kinds(interns)  # refused outright: no right to the kind's rows
                # a task of that kind that interns really submit (it is queued or placed) does give it
                await sched.ScheduleTask(tpb.ScheduleTaskRequest(spec=spec("mine-1"), wait=False), metadata=interns,
                                         timeout=10)
                assert KIND in await kinds(interns)
    finally:
        await coord.stop(grace_s=0.1)
