"""When state_dir cannot be written (a full or read-only disk): what the
operator is told, what the running coordinator does, and what shows it.

QA pass 24 filled the state directory's disk: a cordon was answered
``UNKNOWN: Unexpected <class 'sqlite3.OperationalError'>`` and held in memory
anyway, so the node came back HEALTHY at the next restart; nothing an
operator watches said that writes were failing (the one log line was plain
text inside a JSON log). Now a write that fails is not made, is answered
UNAVAILABLE, and is counted in ``gpulb_state_write_failures_total``.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import grpc
import pytest
import structlog
from prometheus_client.parser import text_string_to_metric_families

from agent.fleet import SimFleet
from coordinator import main as coordinator_main
from coordinator.config import CoordinatorConfig
from coordinator.server import Coordinator
from coordinator.state import open_state_dir
from protos import cluster_pb2 as cpb
from protos import cluster_pb2_grpc as cpb_grpc
from protos import tasks_pb2 as tpb
from protos import tasks_pb2_grpc as tpb_grpc
from waiting import until

pytestmark = pytest.mark.timeout(60)

DISK_FULL = "database or disk is full"


class FullDisk:
    """The store's connection on a full disk: reads work, every write fails
    as SQLite fails it (SQLITE_FULL)."""

    def __init__(self, real: sqlite3.Connection) -> None:
        self.real = real

    def __getattr__(self, name):
        return getattr(self.real, name)

    def execute(self, sql, *args):
        if sql.lstrip().split()[0].upper() in ("INSERT", "DELETE", "UPDATE", "BEGIN"):
            raise sqlite3.OperationalError(DISK_FULL)
        return self.real.execute(sql, *args)

    def executemany(self, *args):
        raise sqlite3.OperationalError(DISK_FULL)


def _failures(coord: Coordinator) -> dict[str, float]:
    families = {f.name: f for f in text_string_to_metric_families(coord.metrics.exposition(False).decode())}
    return {s.labels["write"]: s.value for s in families["gpulb_state_write_failures"].samples if s.name.endswith("_total")}


async def test_a_cordon_that_cannot_be_stored_is_not_made_and_is_counted(tmp_path: Path) -> None:
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", insecure=True), store=open_state_dir(tmp_path / "state"))
    port = await coord.start()
    saved = structlog.get_config()
    try:
        async with SimFleet(f"127.0.0.1:{port}", hosts=1, gpus=1, workload="idle"):
            await until(lambda: "sim-01" in coord.view.nodes, what="the node registered")
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                cluster, sched = cpb_grpc.ClusterOperatorStub(ch), tpb_grpc.SchedulerStub(ch)
                assert _failures(coord) == {"commit": 0.0, "node_admin": 0.0, "learned": 0.0}
                real = coord.store._db
                coord.store._db = FullDisk(real)
                for call in (cluster.CordonNode, cluster.DrainNode):
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await call(cpb.NodeActionRequest(node_id="sim-01", reason="fan swap"), timeout=5)
                    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
                    assert refused.value.details().startswith("state: could not store the ")
                    assert DISK_FULL in refused.value.details() and "nothing changed" in refused.value.details()
                node = await cluster.GetNode(cpb.GetNodeRequest(node_id="sim-01"), timeout=5)
                assert node.state == cpb.NODE_STATE_HEALTHY  # as it was: the levers were not pulled

                with structlog.testing.capture_logs() as logs:
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await sched.ScheduleTask(tpb.ScheduleTaskRequest(spec=tpb.TaskSpec(task_id="t1", vram_mib=512)),
                                                 timeout=5)
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
                failed = [e for e in logs if e["event"] == "state_commit_failed"]
                assert failed and DISK_FULL in failed[0]["error"] and failed[0]["log_level"] == "error"
                assert _failures(coord) == {"commit": 1.0, "node_admin": 2.0, "learned": 0.0}

                coord.store._db = real  # space freed: the same call works, and is stored
                await cluster.CordonNode(cpb.NodeActionRequest(node_id="sim-01"), timeout=5)
                assert coord.store.load_node_admin() == {"sim-01": "CORDONED"}
    finally:
        structlog.configure(**saved)
        await coord.stop(grace_s=0.1)


async def test_a_restart_forgets_finished_tasks_past_the_retention_before_serving(tmp_path: Path) -> None:
    """Finished while the coordinator ran, past finished_retention_s when it
    starts again: the first call after the restart already finds it gone
    (it answered with the old COMPLETED until the first prune, so a job's id
    resubmitted then was not run)."""
    import asyncio

    state_dir = tmp_path / "state"
    spec = tpb.TaskSpec(task_id="nightly", vram_mib=512)
    for run in range(2):
        coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", insecure=True, finished_retention_s=0.5),
                            store=open_state_dir(state_dir))
        port = await coord.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                sched = tpb_grpc.SchedulerStub(ch)
                task = (await sched.ScheduleTask(tpb.ScheduleTaskRequest(spec=spec, wait=False), timeout=5)).task
                assert task.state == tpb.TASK_STATE_QUEUED  # run 1: a new run, not last night's CANCELLED
                if run == 0:
                    await sched.CancelTask(tpb.CancelTaskRequest(task_id="nightly"), timeout=5)
        finally:
            await coord.stop(grace_s=0.1)
        await asyncio.sleep(1.0)  # past the retention while stopped


def test_print_config_says_when_state_dir_cannot_be_created(tmp_path: Path, capsys) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    rc = coordinator_main.main(["--insecure", "--state-dir", str(blocker / "state"), "--print-config"])
    assert rc == 2
    assert "state_dir" in capsys.readouterr().err
    assert coordinator_main.main(["--insecure", "--state-dir", str(tmp_path / "ok" / "state"), "--print-config"]) == 0
    assert not (tmp_path / "ok").exists()  # looked at, not created
