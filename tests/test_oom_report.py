"""OOM kills on /metrics and from the lease holder (QA pass 25, item 3): a
worker says ``CompleteTaskRequest.oom_killed`` (it implies failed), the
coordinator counts it once in ``gpulb_oom_kills_total`` beside the agent's
OOM task events, and the memory-growth learner records the run as an OOM
kill; ``gpulb complete --oom-killed`` sends it.

Needs the diffs to coordinator/scheduling.py (CompleteTask passes
``oom_killed`` on, ``metric_families`` exports the counter),
coordinator/metrics.py (``EXPORTED_METRIC_NAMES``) and coordinator/cli.py
(``--oom-killed``). In-process: the node is registered and keyframed
through the calls an agent stream makes, on a manual clock; the servicer
is called directly; no server."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from coordinator import cli
from coordinator.config import CoordinatorConfig
from coordinator.liveness import ManualClock
from coordinator.metrics import EXPORTED_METRIC_NAMES
from coordinator.server import Coordinator
from protos import tasks_pb2 as tpb
from protos import telemetry_pb2 as pb
from protos.codec import DecodeOutcome, TelemetryEncoder
from protos.fields import BY_NAME, FIELD_COUNT
from scheduler.task import Priority, TaskSpec, TaskState

pytestmark = pytest.mark.timeout(60)


class _Aborted(Exception):
    def __init__(self, code, details) -> None:
        super().__init__(f"{code}: {details}")
        self.code = code


class _Context:
    async def abort(self, code, details):
        raise _Aborted(code, details)

    def time_remaining(self):
        return None


def _coordinator() -> Coordinator:
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0"), clock=ManualClock(1_000.0))
    reg = pb.Register(node_id="n1", hostname="n1", backend="test", gpus=[
        pb.GpuInfo(index=i, uuid=f"GPU-n1-{i}", model="NVIDIA GeForce RTX 4090", memory_total_mib=24_564)
        for i in range(2)])
    node = coord.view.register(reg, coord.clock())
    coord.liveness.register("n1")
    values = np.zeros((2, FIELD_COUNT), dtype=np.int64)
    values[:, BY_NAME["memory_used_mib"]] = 300
    values[:, BY_NAME["memory_total_mib"]] = 24_564
    values[:, BY_NAME["health"]] = pb.GPU_HEALTH_OK
    env, _ = TelemetryEncoder([0, 1]).encode(values, np.ones_like(values, dtype=bool), now_s=coord.clock(),
                                             sampled_at_ns=time.time_ns(), sample_interval_ms=1_000)
    result = node.decoder.admit(env)
    assert result.outcome is DecodeOutcome.APPLIED
    coord.batch_applied(node, result, result.batch, coord.clock())
    coord.dispatcher.snapshots.liveness_changed()
    coord.smooth_now()
    return coord


def _place(coord: Coordinator, task_id: str):
    engine = coord.dispatcher.engine
    engine.submit(TaskSpec(task_id, priority=Priority.P2, kind="finetune", vram_mib=6_144.0, gpu_share=0.5,
                           duration_s=60.0), coord.dispatcher.snapshots.snapshot())
    coord.dispatcher.dispatch_now()
    task = engine.get(task_id)
    assert task.state == TaskState.LEASED
    return task


def _series(coord: Coordinator) -> dict[tuple[str, tuple], float]:
    text = coord.metrics.exposition().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def _complete(coord: Coordinator, **fields) -> tpb.CompleteTaskResponse:
    return asyncio.run(coord.scheduler_service.CompleteTask(tpb.CompleteTaskRequest(**fields), _Context()))


def test_oom_killed_is_field_6_of_complete_task_request() -> None:
    field = tpb.CompleteTaskRequest.DESCRIPTOR.fields_by_name["oom_killed"]
    assert field.number == 6 and field.type == field.TYPE_BOOL
    # an old worker's request (no field 6) reads as not killed
    old = tpb.CompleteTaskRequest(task_id="t", lease_id="l", failed=True).SerializeToString()
    assert not tpb.CompleteTaskRequest.FromString(old).oom_killed


def test_a_worker_reports_an_oom_kill_counted_once_failed_and_learned() -> None:
    coord = _coordinator()
    assert _series(coord)[("gpulb_oom_kills_total", ())] == 0
    assert "gpulb_oom_kills_total" in EXPORTED_METRIC_NAMES
    task = _place(coord, "ft1")
    lease = task.assignment.lease_id
    # `failed` not said: oom_killed implies it
    reply = _complete(coord, task_id="ft1", lease_id=lease, oom_killed=True, peak_vram_mib=18_432.0)
    assert reply.task.state == tpb.TASK_STATE_FAILED
    series = _series(coord)
    assert series[("gpulb_oom_kills_total", ())] == 1
    assert series[("gpulb_tasks_finished_total", (("state", "failed"),))] == 1
    # the learner has the run as an OOM kill at 3x its ask
    (stats,) = [g for g in coord.advisor.growth.stats() if g.kind == "finetune"]
    assert stats.samples == 1 and stats.oom_kills == 1
    # a retried call (same lease) changes and counts nothing
    again = _complete(coord, task_id="ft1", lease_id=lease, oom_killed=True, peak_vram_mib=18_432.0)
    assert again.task.state == tpb.TASK_STATE_FAILED
    assert _series(coord)[("gpulb_oom_kills_total", ())] == 1
    # a plain failure is no OOM kill
    other = _place(coord, "ft2")
    _complete(coord, task_id="ft2", lease_id=other.assignment.lease_id, failed=True, peak_vram_mib=7_000.0)
    assert _series(coord)[("gpulb_oom_kills_total", ())] == 1
    (stats,) = [g for g in coord.advisor.growth.stats() if g.kind == "finetune"]
    assert stats.samples == 2 and stats.oom_kills == 1


def test_an_agents_oom_event_is_on_metrics_too() -> None:
    coord = _coordinator()
    task = _place(coord, "ft1")
    coord.dispatcher.task_event("n1", pb.TaskEvent(task_id="ft1", kind=pb.TASK_EVENT_KIND_OOM_KILLED,
                                                   peak_vram_mib=20_000))
    assert coord.dispatcher.engine.get("ft1").state == TaskState.FAILED
    assert task.assignment is not None
    assert _series(coord)[("gpulb_oom_kills_total", ())] == 1


def test_gpulb_complete_oom_killed_sends_it_with_failed(monkeypatch, capsys) -> None:
    sent = []

    class _Stub:
        def __init__(self, channel) -> None:
            pass

        def CompleteTask(self, request, timeout=None):
            sent.append(request)
            task = tpb.Task(spec=tpb.TaskSpec(task_id=request.task_id), state=tpb.TASK_STATE_FAILED)
            return tpb.CompleteTaskResponse(task=task)

    class _Channel:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(cli, "_channel", lambda args: _Channel())
    monkeypatch.setattr(cli.tpb_grpc, "SchedulerStub", _Stub)
    assert cli.main(["--coordinator", "127.0.0.1:1", "complete", "ft1", "--lease", "L1", "--oom-killed",
                     "--peak-vram-mib", "20000"]) == 0
    assert cli.main(["--coordinator", "127.0.0.1:1", "complete", "ft2", "--lease", "L2"]) == 0
    assert [(r.task_id, r.lease_id, r.failed, r.oom_killed, r.peak_vram_mib) for r in sent] == [
        ("ft1", "L1", True, True, 20000.0), ("ft2", "L2", False, False, 0.0)]
    assert "ft1: " in capsys.readouterr().out


def test_an_oom_kill_says_so_in_the_task_s_reason():
    """QA pass 25: an OOM-killed task read "the lease holder reported
    failure", so one looking at the task could not tell."""
    import itertools

    from scheduler.engine import Scheduler
    from scheduler.snapshot import ClusterSnapshot, NodeFacts
    from scheduler.task import TaskSpec, TaskState

    ids = (f"L{i}" for i in itertools.count())
    sched = Scheduler(clock=lambda: 10.0, lease_ids=lambda: next(ids))
    snap = ClusterSnapshot.build([NodeFacts("n0", 2)])
    for task_id in ("oom", "plain"):
        sched.submit(TaskSpec(task_id=task_id, vram_mib=1024.0, gpu_share=0.1), snap)
    leases = {t.task_id: t.assignment.lease_id for t in sched.dispatch(snap)}
    oom = sched.complete("oom", leases["oom"], oom_killed=True)
    plain = sched.complete("plain", leases["plain"], failed=True)
    assert oom.state == plain.state == TaskState.FAILED
    assert "out of GPU memory" in oom.reason and "out of GPU memory" not in plain.reason
