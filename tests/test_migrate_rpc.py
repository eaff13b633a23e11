"""MigrateTask against a real coordinator and simulated agents on loopback:
a leased task's lease moves to another node's GPU in one call, the old
host's agent stops it and the new one's starts it (seen in the readings the
coordinator gets back), the move is counted, survives a restart, and bad
input gets a precise status naming the field while nothing changes."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from waiting import until
from agent.fleet import SimFleet
from coordinator.config import CoordinatorConfig
from coordinator.server import Coordinator
from coordinator.state import open_state_dir
from protos import cluster_pb2 as cpb
from protos import cluster_pb2_grpc as cpb_grpc
from protos import tasks_pb2 as tpb
from protos import tasks_pb2_grpc as tpb_grpc

pytestmark = pytest.mark.timeout(90)


async def _processes(ops: cpb_grpc.ClusterOperatorStub) -> dict[str, float]:
    """GPU uuid -> compute processes the agent reports on it."""
    gpus = (await ops.ListGpus(cpb.ListGpusRequest())).gpus
    return {g.uuid: g.process_count for g in gpus if g.HasField("process_count")}


async def test_a_migration_moves_the_task_between_hosts_and_refuses_bad_input_by_name(tmp_path, capsys):
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", dispatch_interval_s=0.1), store=open_state_dir(tmp_path))
    port = await coord.start()
    target = f"127.0.0.1:{port}"
    try:
        async with SimFleet(target, hosts=2, gpus=1, workload="idle"):
            await until(lambda: coord.dispatcher.snapshots.snapshot().gpu_count == 2, what="2 GPUs")
            async with grpc.aio.insecure_channel(target) as ch:
                sched, ops = tpb_grpc.SchedulerStub(ch), cpb_grpc.ClusterOperatorStub(ch)
                spec = tpb.TaskSpec(task_id="train-1", vram_mib=4096, gpu_share=0.5, kind="training",
                                    priority=tpb.PRIORITY_P1, movable=True, duration_s=600.0)
                placed = (await sched.ScheduleTask(tpb.ScheduleTaskRequest(spec=spec), timeout=10)).task
                assert placed.state == tpb.TASK_STATE_LEASED
                src = placed.assignment.gpu_uuid[0]
                (dest,) = [u for u in coord.dispatcher.snapshots.snapshot().gpu_uuid if u != src]
                await until(lambda: _has(ops, src, 1), what="the task's process on its GPU")
                lease = placed.assignment.lease_id

                async def refused(to: list[str], lease_id: str = lease, task_id: str = "train-1") -> grpc.aio.AioRpcError:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await sched.MigrateTask(tpb.MigrateTaskRequest(task_id=task_id, lease_id=lease_id, to_gpu_uuid=to))
                    return err.value

                for to, code, words in (
                    ([], grpc.StatusCode.INVALID_ARGUMENT, "to_gpu_uuid: the task runs on 1 GPU(s); 0 given"),
                    ([dest, dest], grpc.StatusCode.INVALID_ARGUMENT, "to_gpu_uuid: the task runs on 1"),
                    ([src], grpc.StatusCode.INVALID_ARGUMENT, f"to_gpu_uuid: {src} is already one of the task's GPUs"),
                    (["GPU-nowhere"], grpc.StatusCode.INVALID_ARGUMENT, "to_gpu_uuid: unknown GPU 'GPU-nowhere'"),
                ):
                    err = await refused(to)
                    assert err.code() == code and words in err.details(), err.details()
                err = await refused([dest], lease_id="0" * 32)
                assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "not the task's current lease" in err.details()
                err = await refused([dest], task_id="nobody")
                assert err.code() == grpc.StatusCode.NOT_FOUND and "nobody" in err.details()
                # a destination the task does not fit: its memory is held by another task
                big = tpb.TaskSpec(task_id="big", vram_mib=18_000, gpu_share=0.2, kind="batch")
                big_task = (await sched.ScheduleTask(tpb.ScheduleTaskRequest(spec=big), timeout=10)).task
                assert big_task.assignment.gpu_uuid[0] == dest
                err = await refused([dest])
                assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert f"to_gpu_uuid: {dest} on node {big_task.assignment.node_id} fails the" in err.details()
                assert (await sched.GetTask(tpb.GetTaskRequest(task_id="train-1"))).assignment.lease_id == lease
                await sched.CompleteTask(tpb.CompleteTaskRequest(task_id="big", lease_id=big_task.assignment.lease_id))

                moved = (await sched.MigrateTask(tpb.MigrateTaskRequest(task_id="train-1", lease_id=lease, to_gpu_uuid=[dest]))).task
                assert moved.state == tpb.TASK_STATE_LEASED and list(moved.assignment.gpu_uuid) == [dest]
                assert moved.assignment.node_id != placed.assignment.node_id
                assert moved.assignment.lease_id != lease and moved.assignment.score.policy == "migration"
                assert moved.attempts == placed.attempts
                # the run goes on from where it was: it began at the first placement
                first = placed.assignment.placed_at_ns
                assert moved.assignment.run_started_at_ns == placed.assignment.run_started_at_ns == first
                assert moved.assignment.placed_at_ns > first
                # the old host stopped it, the new one runs it
                await until(lambda: _has(ops, src, 0), what="the source GPU without the task")
                await until(lambda: _has(ops, dest, 1), what="the task on its destination")
                text = coord.metrics.exposition(per_gpu=False).decode()
                assert "gpulb_tasks_migrated_total 1.0" in text
                # the old lease is dead, the new one lives
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await sched.RenewLease(tpb.RenewLeaseRequest(task_id="train-1", lease_id=lease))
                assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                await sched.RenewLease(tpb.RenewLeaseRequest(task_id="train-1", lease_id=moved.assignment.lease_id))
                # and back, through the CLI, naming the GPU as NODE:INDEX (sync gRPC: off the loop)
                from coordinator.cli import main as gpulb

                capsys.readouterr()
                back = f"{placed.assignment.node_id}:{placed.assignment.gpu_index[0]}"
                assert await asyncio.to_thread(gpulb, ["--coordinator", target, "migrate", "train-1", "--to-gpu", back]) == 0
                out = capsys.readouterr().out  # the coordinator's log lines land here too
                assert f"\ntrain-1: leased on {back}, lease " in "\n" + out, out
                moved = (await sched.GetTask(tpb.GetTaskRequest(task_id="train-1")))
                assert list(moved.assignment.gpu_uuid) == [src] and moved.assignment.lease_id in out
                await until(lambda: _has(ops, src, 1), what="the task back on its first GPU")
                # a task that moved while running teaches no GPU's speed; one that did not does
                learned = coord.advisor.predictor.samples
                await sched.CompleteTask(tpb.CompleteTaskRequest(task_id="train-1", lease_id=moved.assignment.lease_id,
                                                                 actual_duration_s=5.0))
                assert coord.advisor.predictor.samples == learned
                other = tpb.TaskSpec(task_id="train-2", vram_mib=2048, gpu_share=0.3, kind="training", duration_s=600.0)
                still = (await sched.ScheduleTask(tpb.ScheduleTaskRequest(spec=other), timeout=10)).task
                await sched.CompleteTask(tpb.CompleteTaskRequest(task_id="train-2", lease_id=still.assignment.lease_id,
                                                                 actual_duration_s=5.0))
                assert coord.advisor.predictor.samples == learned + 1
    finally:
        await coord.stop(0)
    # the moves were durable: a restarted coordinator knows the last lease
    again = Coordinator(CoordinatorConfig(listen="127.0.0.1:0"), store=open_state_dir(tmp_path))
    await again.start()
    try:
        restored = again.dispatcher.engine.get("train-1")
        assert restored.state.name == "COMPLETED" and restored.assignment.lease_id == moved.assignment.lease_id
        assert restored.assignment.gpu_uuids == (src,)
        a = restored.assignment
        assert a.run_started_at is not None and a.run_started_at < a.placed_at
    finally:
        await again.stop(0)


async def _hot_spot(sched: tpb_grpc.SchedulerStub, ops: cpb_grpc.ClusterOperatorStub, gpus: int = 1) -> None:
    """Two training tasks of 45 % on all of sim-01's ``gpus`` GPUs (sim-02
    cordoned while they are placed), sim-02 idle: a variance of 2,025 %²."""
    await ops.CordonNode(cpb.NodeActionRequest(node_id="sim-02", reason="test"))
    for name in ("train-a", "train-b"):
        spec = tpb.TaskSpec(task_id=name, vram_mib=4096, gpu_share=0.45, kind="training", priority=tpb.PRIORITY_P1,
                            num_gpus=gpus)
        placed = (await sched.ScheduleTask(tpb.ScheduleTaskRequest(spec=spec), timeout=10)).task
        assert placed.assignment.node_id == "sim-01"
    await ops.UncordonNode(cpb.NodeActionRequest(node_id="sim-02", reason="test"))


@contextlib.asynccontextmanager
async def _hot_spot_cluster(listen: str = "127.0.0.1:0", gpus: int = 1, **config):
    """A coordinator whose advisor plans at once (persist 1, no minimum age, no
    averaging, 0.3 s evaluations), two simulated hosts of ``gpus`` GPUs and
    the hot spot: yields (coordinator, target, Scheduler stub, ClusterOperator stub)."""
    from scheduler.advisor import AdvisorConfig

    advisor = AdvisorConfig(persist=1, min_age_s=0.0, smoothing_alpha=1.0, cooldown_s=5.0, window_s=5.0)
    coord = Coordinator(CoordinatorConfig(listen=listen, dispatch_interval_s=0.1, advisor_interval_s=0.3, **config),
                        advisor_config=advisor)
    port = await coord.start()
    target = f"127.0.0.1:{port}"
    try:
        async with SimFleet(target, hosts=2, gpus=gpus, workload="idle"):
            await until(lambda: coord.dispatcher.snapshots.snapshot().gpu_count == 2 * gpus, what=f"{2 * gpus} GPUs")
            async with grpc.aio.insecure_channel(target) as ch:
                sched, ops = tpb_grpc.SchedulerStub(ch), cpb_grpc.ClusterOperatorStub(ch)
                await _hot_spot(sched, ops, gpus)
                yield coord, target, sched, ops
    finally:
        await coord.stop(0)


async def _has(ops: cpb_grpc.ClusterOperatorStub, uuid: str, count: int) -> bool:
    return (await _processes(ops)).get(uuid) == count


async def test_gpulb_advisor_execute_carries_a_plan_out_and_the_load_evens(tmp_path, capsys):
    """The whole loop on real processes' code paths: two training tasks share
    one host's GPU (the other host was cordoned while they were placed), the
    advisor's trigger fires, `gpulb advisor execute` runs the operator's
    checkpoint command, MigrateTask and the restart command, the agents stop
    and start the task, and the coordinator's readings show the two GPUs even."""
    import json
    import sys

    from coordinator.cli import main as gpulb

    record = ("import json, os, sys; "
              "open(sys.argv[1], 'a').write(json.dumps({k: v for k, v in os.environ.items() if k.startswith('GPULB_')}) + '\\n')")
    checkpoints, restarts = tmp_path / "checkpoint.jsonl", tmp_path / "restart.jsonl"
    async with _hot_spot_cluster() as (coord, target, sched, ops):
        argv = ["--coordinator", target, "advisor", "execute", "--plans", "1", "--json",
                "--checkpoint", f"{sys.executable} -c \"{record}\" {checkpoints}",
                "--restart", f"{sys.executable} -c \"{record}\" {restarts}"]
        capsys.readouterr()
        assert await asyncio.to_thread(gpulb, argv) == 0
        lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{\"plan_id\"")]
        (outcome,) = lines
        assert outcome["outcome"] == "moved" and outcome["to_gpu"] == "sim-02:0", outcome
        moved = await sched.GetTask(tpb.GetTaskRequest(task_id=outcome["task_id"]))
        assert moved.assignment.node_id == "sim-02" and moved.assignment.lease_id == outcome["lease_id"]
        (before,) = [json.loads(x) for x in checkpoints.read_text().splitlines()]
        (after,) = [json.loads(x) for x in restarts.read_text().splitlines()]
        assert before["GPULB_TASK_ID"] == after["GPULB_TASK_ID"] == outcome["task_id"]
        # the checkpoint is told where the task goes (to stage its data there), the restart where it is now
        assert before["GPULB_TO_NODE"] == after["GPULB_TO_NODE"] == "sim-02"
        assert before["GPULB_FROM_NODE"] == after["GPULB_FROM_NODE"] == "sim-01"
        assert before["GPULB_TO_GPU_UUID"] == after["GPULB_TO_GPU_UUID"] != before["GPULB_FROM_GPU_UUID"]
        assert after["GPULB_LEASE_ID"] == outcome["lease_id"] != before["GPULB_LEASE_ID"]

        async def even() -> bool:
            gpus = (await ops.ListGpus(cpb.ListGpusRequest())).gpus
            utils = [g.util_gpu_pct for g in gpus]
            return len(utils) == 2 and all(35.0 <= u <= 55.0 for u in utils)

        await until(even, what="both GPUs near 45 %")

        # the same move again, with the lease it no longer holds (a stale plan:
        # the task runs on sim-02 under another lease): nothing runs, neither the
        # checkpoint (it would stop the task) nor a restart on sim-01 under the
        # lease that is over (before: restarted there, a second copy gpulb no
        # longer accounted for)
        from coordinator.executor import PlanExecutor
        from protos import advisor_pb2 as apb

        def move(plan_id: int, lease_id: str, src: tuple[str, str], dst: tuple[str, str]) -> apb.RebalancePlan:
            return apb.RebalancePlan(plan_id=plan_id, moves=[apb.Migration(
                task_id=outcome["task_id"], lease_id=lease_id, from_node_id=src[0], from_gpu_index=0,
                from_gpu_uuid=src[1], to_node_id=dst[0], to_gpu_index=0, to_gpu_uuid=dst[1])])

        on_01, on_02 = ("sim-01", before["GPULB_FROM_GPU_UUID"]), ("sim-02", after["GPULB_TO_GPU_UUID"])
        stale = move(99, before["GPULB_LEASE_ID"], on_01, on_02)

        def run(plan: apb.RebalancePlan, checkpoint: list[str] | None = None, restart: list[str] | None = None):
            ckpt = [sys.executable, "-c", record, str(checkpoints)] if checkpoint is None else checkpoint
            again = [sys.executable, "-c", record, str(restarts)] if restart is None else restart
            with grpc.insecure_channel(target) as sync:
                return PlanExecutor(tpb_grpc.SchedulerStub(sync), checkpoint=ckpt, restart=again).execute(plan)

        def ran() -> tuple[int, int]:
            return len(checkpoints.read_text().splitlines()), len(restarts.read_text().splitlines())

        (skipped_stale,) = await asyncio.to_thread(run, stale)
        assert skipped_stale.outcome == "stale", skipped_stale
        assert (f"stale plan: the task holds lease {outcome['lease_id']} on sim-02:0 now, "
                f"not the plan's lease {before['GPULB_LEASE_ID']}") in skipped_stale.detail
        assert skipped_stale.lease_id == outcome["lease_id"] and ran() == (1, 1)
        # a checkpoint that fails skips a current move: nothing else runs
        current = move(101, outcome["lease_id"], on_02, on_01)
        (skipped,) = await asyncio.to_thread(run, current, [sys.executable, "-c", "raise SystemExit('disk full')"])
        assert skipped.outcome == "skipped" and "exited 1: disk full" in skipped.detail
        assert ran() == (1, 1)
        # a current move the coordinator refuses (the destination is no GPU of it):
        # the task still holds its lease on sim-02, so it restarts there, under that lease
        (refused,) = await asyncio.to_thread(run, move(102, outcome["lease_id"], on_02, ("sim-01", "GPU-nowhere")))
        assert refused.outcome == "refused" and "not restarted" not in refused.detail, refused
        assert refused.lease_id == outcome["lease_id"] and ran() == (2, 2)
        in_place = json.loads(restarts.read_text().splitlines()[-1])
        assert in_place["GPULB_TO_NODE"] == "sim-02" and in_place["GPULB_LEASE_ID"] == outcome["lease_id"]
        assert in_place["GPULB_TO_GPU_UUID"] == after["GPULB_TO_GPU_UUID"]
        # a move made whose restart fails: said so (the CLI exits 1 on it), the lease is on the new GPU
        (failed,) = await asyncio.to_thread(run, current, [], [sys.executable, "-c", "raise SystemExit(4)"])
        assert failed.outcome == "restart failed" and "exited 4" in failed.detail
        now = await sched.GetTask(tpb.GetTaskRequest(task_id=outcome["task_id"]))
        assert now.assignment.node_id == "sim-01" and now.assignment.lease_id == failed.lease_id
        # the task is cancelled while its checkpoint runs: MigrateTask refuses the
        # move, and the task, which holds no lease now, is not restarted
        cancel = (f"import subprocess, sys; subprocess.run([sys.executable, '-m', 'coordinator.cli', '--coordinator', "
                  f"'{target}', 'cancel', '{outcome['task_id']}'], check=True)")
        (gone,) = await asyncio.to_thread(run, move(103, failed.lease_id, on_01, on_02), [sys.executable, "-c", cancel])
        assert gone.outcome == "refused" and "; not restarted: the task is cancelled" in gone.detail, gone
        assert gone.lease_id == "" and ran() == (2, 2)
        # ... and a plan made before the cancel is stale: nothing runs
        (cancelled,) = await asyncio.to_thread(run, move(104, failed.lease_id, on_01, on_02))
        assert cancelled.outcome == "stale" and "stale plan: the task is cancelled" in cancelled.detail, cancelled
        assert cancelled.lease_id == "" and ran() == (2, 2)
        assert (await sched.GetTask(tpb.GetTaskRequest(task_id=outcome["task_id"]))).state == tpb.TASK_STATE_CANCELLED


class _Refusal(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class _Scheduler:
    """A Scheduler stub answering GetTask from a script (a Task or an error
    each call) and refusing every MigrateTask."""

    def __init__(self, *answers) -> None:
        self.answers = list(answers)
        self.migrations = 0

    def GetTask(self, request, timeout):
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def MigrateTask(self, request, timeout):
        self.migrations += 1
        raise _Refusal(grpc.StatusCode.FAILED_PRECONDITION, "destination no longer fits")


def test_the_executor_never_checkpoints_or_restarts_on_doubt(tmp_path):
    """GetTask failing, before the checkpoint or after a refusal, leaves the
    task alone: no checkpoint of a task not known to hold the plan's lease, no
    restart in place of one not known to hold it still."""
    import sys

    from coordinator.executor import PlanExecutor
    from protos import advisor_pb2 as apb

    plan = apb.RebalancePlan(plan_id=5, moves=[apb.Migration(
        task_id="t1", lease_id="L1", from_node_id="a", from_gpu_index=0, from_gpu_uuid="GPU-a",
        to_node_id="b", to_gpu_index=1, to_gpu_uuid="GPU-b")])
    leased = tpb.Task(spec=tpb.TaskSpec(task_id="t1"), state=tpb.TASK_STATE_LEASED,
                      assignment=tpb.Assignment(node_id="a", gpu_index=[0], gpu_uuid=["GPU-a"], lease_id="L1"))
    down = _Refusal(grpc.StatusCode.UNAVAILABLE, "connection refused")
    ran = tmp_path / "ran"

    def execute(stub: _Scheduler):
        touch = [sys.executable, "-c", f"open({str(ran)!r}, 'a').write('x')"]
        return PlanExecutor(stub, checkpoint=touch, restart=touch).execute(plan)

    stub = _Scheduler(down)
    (unchecked,) = execute(stub)
    assert unchecked.outcome == "unchecked" and stub.migrations == 0 and not ran.exists(), unchecked
    assert unchecked.detail.startswith("GetTask failed (UNAVAILABLE: connection refused), so whether the task "
                                       "still holds lease L1 is unknown; the move was not tried")
    # refused, then GetTask fails: the checkpoint ran (the task was leased), no restart
    stub = _Scheduler(leased, down)
    (refused,) = execute(stub)
    assert refused.outcome == "refused" and stub.migrations == 1 and ran.read_text() == "x", refused
    assert refused.detail == ("FAILED_PRECONDITION: destination no longer fits; not restarted: GetTask failed "
                              "(UNAVAILABLE: connection refused), so whether the task still holds lease L1 is unknown")
    # refused, and the task still holds the lease on its GPU: restarted in place
    (in_place,) = execute(_Scheduler(leased, leased))
    assert in_place.outcome == "refused" and in_place.detail == "FAILED_PRECONDITION: destination no longer fits"
    assert ran.read_text() == "xxx" and in_place.lease_id == "L1"
    # a task the coordinator forgot (finished long ago) is a stale plan
    (forgotten,) = execute(_Scheduler(_Refusal(grpc.StatusCode.NOT_FOUND, "no task 't1'")))
    assert forgotten.outcome == "stale" and "the coordinator has no task 't1' any more" in forgotten.detail
    assert ran.read_text() == "xxx"


async def test_a_two_gpu_task_moves_whole_to_the_idle_host(tmp_path, capsys):
    """Two 2-GPU training tasks of 45 % share sim-01's two GPUs; the plan
    moves one of them, both GPUs at once, onto sim-02's two, and the restart
    command gets every GPU (``GPULB_TO_GPU_INDEXES``, ready for CUDA_VISIBLE_DEVICES)."""
    import json
    import sys

    from coordinator.cli import main as gpulb

    record = ("import json, os, sys; "
              "open(sys.argv[1], 'a').write(json.dumps({k: v for k, v in os.environ.items() if k.startswith('GPULB_')}) + '\\n')")
    restarts = tmp_path / "restart.jsonl"
    async with _hot_spot_cluster(gpus=2) as (coord, target, sched, ops):
        argv = ["--coordinator", target, "advisor", "execute", "--plans", "1", "--json",
                "--restart", f"{sys.executable} -c \"{record}\" {restarts}"]
        capsys.readouterr()
        assert await asyncio.to_thread(gpulb, argv) == 0
        (outcome,) = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{\"plan_id\"")]
        assert (outcome["outcome"], outcome["from_gpu"], outcome["to_gpu"]) == ("moved", "sim-01:0,1", "sim-02:0,1")
        moved = (await sched.GetTask(tpb.GetTaskRequest(task_id=outcome["task_id"]))).assignment
        assert moved.node_id == "sim-02" and list(moved.gpu_index) == [0, 1]
        (env,) = [json.loads(x) for x in restarts.read_text().splitlines()]
        assert env["GPULB_FROM_GPU_INDEXES"] == env["GPULB_TO_GPU_INDEXES"] == "0,1"
        assert env["GPULB_TO_GPU_UUIDS"].split(",") == list(moved.gpu_uuid)
        assert env["GPULB_TO_GPU_UUID"] == moved.gpu_uuid[0] and env["GPULB_LEASE_ID"] == moved.lease_id
        assert len(set(env["GPULB_FROM_GPU_UUIDS"].split(",")) & set(moved.gpu_uuid)) == 0

        async def even() -> bool:
            utils = [g.util_gpu_pct for g in (await ops.ListGpus(cpb.ListGpusRequest())).gpus]
            return len(utils) == 4 and all(35.0 <= u <= 55.0 for u in utils)

        await until(even, what="all four GPUs near 45 %")
        # and back by hand, both GPUs named as the plan's table names them
        argv = ["--coordinator", target, "migrate", outcome["task_id"], "--to-gpu", "sim-01:0,1"]
        assert await asyncio.to_thread(gpulb, argv) == 0
        back = (await sched.GetTask(tpb.GetTaskRequest(task_id=outcome["task_id"]))).assignment
        assert back.node_id == "sim-01" and list(back.gpu_index) == [0, 1]
        with pytest.raises(SystemExit, match="node 'sim-02' has no GPU 7"):
            await asyncio.to_thread(gpulb, ["--coordinator", target, "migrate", outcome["task_id"], "--to-gpu", "sim-02:0,7"])


async def test_the_coordinators_advisor_hook_runs_the_executor_and_rebalances_by_itself():
    """advisor_hook = "gpulb advisor execute --stdin ...": every plan the
    coordinator makes is carried out without anyone watching."""
    import shlex
    import sys

    from coordinator.demo import free_port

    target = f"127.0.0.1:{free_port()}"
    hook = shlex.join([sys.executable, "-m", "coordinator.cli", "--coordinator", target, "advisor", "execute", "--stdin"])
    async with _hot_spot_cluster(target, advisor_hook=hook) as (coord, _, sched, ops):
        async def split() -> bool:
            tasks = (await sched.ListTasks(tpb.ListTasksRequest(state=tpb.TASK_STATE_LEASED))).tasks
            return sorted(t.assignment.node_id for t in tasks) == ["sim-01", "sim-02"]

        await until(split, timeout=30, what="one task moved to sim-02 by the hook")
        await until(lambda: coord.advisor.last_hook is not None, what="the hook's end")
        assert coord.advisor.last_hook.outcome == "ok", coord.advisor.last_hook
        assert "moved" in coord.advisor.last_hook.stdout_tail
        text = coord.metrics.exposition(per_gpu=False).decode()
        assert "gpulb_tasks_migrated_total 1.0" in text
