"""A host's stream drops and comes back: what the coordinator sent while it
was down is not lost. The registration carries the tasks the host runs; the
coordinator releases those no longer leased there and places again those that
are leased there but not running (a real coordinator, a simulated host's own
Agent and backend on loopback)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from waiting import until
from agent.client import Agent
from agent.fleet import SimFleet
from agent.sim import SimBackend
from coordinator.config import CoordinatorConfig
from coordinator.server import Coordinator
from protos import tasks_pb2 as tpb
from protos import tasks_pb2_grpc as tpb_grpc
from protos import telemetry_pb2 as pb

pytestmark = pytest.mark.timeout(90)


async def test_a_release_lost_while_the_stream_was_down_and_a_restarted_host_are_set_right():
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", dispatch_interval_s=0.1))
    port = await coord.start()
    target = f"127.0.0.1:{port}"
    try:
        async with SimFleet(target, hosts=1, gpus=2, workload="idle") as fleet:
            agent = fleet.agents[0]
            backend = agent.backend
            await until(lambda: coord.dispatcher.snapshots.snapshot().gpu_count == 2, what="2 GPUs")
            async with grpc.aio.insecure_channel(target) as ch:
                sched = tpb_grpc.SchedulerStub(ch)
                leases = {}
                for name in ("keep", "done"):
                    spec = tpb.TaskSpec(task_id=name, vram_mib=2048, gpu_share=0.3, kind="batch")
                    leases[name] = (await sched.ScheduleTask(tpb.ScheduleTaskRequest(spec=spec), timeout=10)).task.assignment.lease_id
                await until(lambda: backend.running_task_ids() == ["done", "keep"], what="both tasks running on the host")

                # the stream drops; "done" completes meanwhile: its release has nowhere to go
                await fleet.stop_agent("sim-01")
                await sched.CompleteTask(tpb.CompleteTaskRequest(task_id="done", lease_id=leases["done"]))
                assert backend.running_task_ids() == ["done", "keep"]
                # the same host comes back (same process, same backend): "done" is released
                again = Agent(agent.config, backend, seed=7)
                runner = asyncio.create_task(again.run())
                await asyncio.wait_for(again.connected.wait(), 10)
                await until(lambda: backend.running_task_ids() == ["keep"], what="the lost release carried out")
                await again.stop()
                await runner

                # the host restarts (a new process, nothing running; the same
                # GPUs, so the same uuids): "keep" is placed again
                fresh = SimBackend(gpus=2, seed=1000, workload="idle", node_id="sim-01")  # SimFleet: seed 1, host 0
                restarted = Agent(agent.config, fresh, seed=8)
                runner = asyncio.create_task(restarted.run())
                await asyncio.wait_for(restarted.connected.wait(), 10)
                await until(lambda: fresh.running_task_ids() == ["keep"], what="the leased task placed again")
                task = await sched.GetTask(tpb.GetTaskRequest(task_id="keep"))
                assert task.state == tpb.TASK_STATE_LEASED and task.assignment.lease_id == leases["keep"]
                await restarted.stop()
                await runner
                fresh.close()
    finally:
        await coord.stop(0)


def test_the_registration_names_a_bad_running_task_id():
    from coordinator.view import MAX_RUNNING_TASKS, RegistrationError, validate_register

    reg = pb.Register(node_id="n1", gpus=[pb.GpuInfo(index=0, uuid="GPU-0", model="m", memory_total_mib=1024)])
    reg.running_task_ids.extend(["ok", ""])
    with pytest.raises(RegistrationError, match=r"register.running_task_ids\[1\]"):
        validate_register(reg)
    del reg.running_task_ids[:]
    reg.running_task_ids.extend(f"t{i}" for i in range(MAX_RUNNING_TASKS + 1))
    with pytest.raises(RegistrationError, match="register.running_task_ids"):
        validate_register(reg)
    del reg.running_task_ids[1:]
    validate_register(reg)


async def test_leases_on_gpus_a_host_came_back_without_are_lost_and_requeued():
    """A host registers again with fewer GPUs (a card off the bus, removed
    in maintenance): its leases on the GPUs it no longer has are lost runs,
    re-queued for retryable kinds (QA pass 24: they stayed LEASED on GPUs
    that do not exist, or, placed again on the simulated host, ended FAILED
    "the lease holder reported failure" though the task had not failed).
    The leases on the GPUs it still has are kept."""
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", dispatch_interval_s=0.1))
    port = await coord.start()
    target = f"127.0.0.1:{port}"
    try:
        async with SimFleet(target, hosts=1, gpus=4, workload="idle") as fleet:
            agent = fleet.agents[0]
            await until(lambda: coord.dispatcher.snapshots.snapshot().gpu_count == 4, what="4 GPUs")
            async with grpc.aio.insecure_channel(target) as ch:
                sched = tpb_grpc.SchedulerStub(ch)
                where = {}
                for i in range(4):
                    spec = tpb.TaskSpec(task_id=f"t{i}", vram_mib=20_000, gpu_share=0.9, kind="training")
                    task = (await sched.ScheduleTask(tpb.ScheduleTaskRequest(spec=spec), timeout=10)).task
                    where[task.spec.task_id] = task.assignment.gpu_index[0]
                assert sorted(where.values()) == [0, 1, 2, 3]
                await fleet.stop_agent("sim-01")
                # the same host, same GPU uuids for indices 0 and 1, two cards fewer
                smaller = SimBackend(gpus=2, seed=1000, workload="idle", node_id="sim-01")  # SimFleet: seed 1, host 0
                again = Agent(agent.config, smaller, seed=3)
                runner = asyncio.create_task(again.run())
                await asyncio.wait_for(again.connected.wait(), 10)
                kept = sorted(t for t, i in where.items() if i < 2)
                gone = sorted(t for t, i in where.items() if i >= 2)
                await until(lambda: sorted(smaller.running_task_ids()) == kept, what="the kept leases running")
                for task_id in gone:
                    task = await sched.GetTask(tpb.GetTaskRequest(task_id=task_id))
                    assert task.state == tpb.TASK_STATE_QUEUED, (task_id, tpb.TaskState.Name(task.state))
                    assert not task.HasField("assignment")  # not on a GPU that is not there
                for task_id in kept:
                    assert (await sched.GetTask(tpb.GetTaskRequest(task_id=task_id))).state == tpb.TASK_STATE_LEASED
                requeued = {s.labels["cause"]: s.value for f in coord.scheduler_metric_families()
                            if f.name == "gpulb_tasks_requeued" for s in f.samples}
                assert requeued["gpu_gone"] == 2 and requeued["node_removed"] == 0
                await again.stop()
                await runner
                smaller.close()
    finally:
        await coord.stop(0)
