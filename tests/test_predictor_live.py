"""The predictor inside a real coordinator (QA pass 25): node speeds and the
priors from the registered GPU models, and a removed node's residual
forgotten by ``UncordonNode``. In-process: nodes are registered and their
keyframes applied through the calls an agent stream makes (as
``coordinator.schedbench.populate``), on a manual clock; no server."""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np
import pytest

from coordinator.config import CoordinatorConfig
from coordinator.liveness import ManualClock
from coordinator.server import Coordinator
from protos import cluster_pb2 as cpb
from protos import telemetry_pb2 as pb
from protos.codec import DecodeOutcome, TelemetryEncoder
from protos.fields import BY_NAME, FIELD_COUNT
from scheduler.task import Priority, TaskSpec

pytestmark = pytest.mark.timeout(60)

RTX = "NVIDIA GeForce RTX 4090"
M40 = "Tesla M40 24GB"
H100 = "NVIDIA H100 80GB HBM3"


def _register(coord: Coordinator, node_id: str, models: list[str]) -> None:
    """One idle node with GPUs of ``models``, registered and keyframed."""
    reg = pb.Register(node_id=node_id, hostname=node_id, backend="test", gpus=[
        pb.GpuInfo(index=i, uuid=f"GPU-{node_id}-{i}", model=m, memory_total_mib=24_000) for i, m in enumerate(models)])
    now = coord.clock()
    coord.ingest.forget_node(node_id)
    node = coord.view.register(reg, now)
    coord.liveness.register(node_id)
    values = np.zeros((len(models), FIELD_COUNT), dtype=np.int64)
    values[:, BY_NAME["memory_used_mib"]] = 300
    values[:, BY_NAME["memory_total_mib"]] = 24_000
    values[:, BY_NAME["temperature_c"]] = 35
    values[:, BY_NAME["health"]] = pb.GPU_HEALTH_OK
    encoder = TelemetryEncoder([g.index for g in reg.gpus], keyframe_interval_s=1e9)
    env, _ = encoder.encode(values, np.ones_like(values, dtype=bool), now_s=now, sampled_at_ns=time.time_ns(),
                            sample_interval_ms=1_000)
    result = node.decoder.admit(env)
    assert result.outcome is DecodeOutcome.APPLIED
    coord.batch_applied(node, result, result.batch, now)
    coord.dispatcher.snapshots.liveness_changed()
    coord.smooth_now()


def _coordinator(clock: ManualClock | None = None) -> Coordinator:
    config = CoordinatorConfig(listen="127.0.0.1:0", heartbeat_interval_s=1.0, remove_after_intervals=2)
    return Coordinator(config, clock=clock or ManualClock(1_000.0))


@pytest.mark.parametrize(
    "models, speed",
    [
        ([RTX], 1.0),
        ([M40, M40], 0.12),
        (["tesla m40 24gb"], 0.12),  # the table's lookup: case and punctuation ignored
        ([H100], 2.2),
        (["Mystery X1"], 1.0),  # unknown: what every reader of node_speed takes unknown for
        ([RTX, M40], 0.12),  # a mixed node: its slowest GPU
        ([], 1.0),
    ],
)
def test_a_nodes_speed_is_its_registered_models_from_the_table(models, speed):
    from coordinator.snapshots import known_speed

    assert known_speed(models) == pytest.approx(speed)


def test_the_live_coordinator_places_p0_work_on_the_fast_gpu_before_learning_anything():
    """QA 25 #1: the SnapshotBuilder read every node at speed 1.0, so the
    priors were {every model: 1.0} and a P0 task went to the M40 (first by
    name) as readily as to the RTX 4090."""
    coord = _coordinator()
    _register(coord, "a-m40", [M40])
    _register(coord, "b-rtx", [RTX])
    _register(coord, "c-h100", [H100])
    snap = coord.dispatcher.snapshots.snapshot()
    assert snap.node_ids == ["a-m40", "b-rtx", "c-h100"]
    assert snap.node_speed.tolist() == pytest.approx([0.12, 1.0, 2.2])
    p = coord.advisor.predictor
    coord.advisor.annotate(snap)  # what every dispatch pass does: the priors are read from the snapshot
    assert p.model_factor(M40) == pytest.approx(1 / 0.12)
    assert p.model_factor(H100) == pytest.approx(1 / 2.2)
    engine = coord.dispatcher.engine
    engine.submit(TaskSpec("p0", priority=Priority.P0, kind="inference", vram_mib=1_024.0, gpu_share=0.1,
                           duration_s=5.0), snap)
    (task,) = coord.dispatcher.dispatch_now()
    assert task.assignment.node_id == "c-h100"
    assert task.assignment.score.terms["completion"] == pytest.approx(0.0)
    # the prior served is the table's, and learning starts from it
    p.observe("a-m40", M40, "training", 10.0, 80.0)
    (m40,) = [f for f in p.stats()[0] if f.model == M40 and f.kind == ""]
    assert m40.prior == pytest.approx(1 / 0.12)


class _Aborted(Exception):
    def __init__(self, code, details) -> None:
        super().__init__(f"{code}: {details}")
        self.code = code


class _Context:
    async def abort(self, code, details):
        raise _Aborted(code, details)


def test_uncordon_of_a_removed_node_forgets_its_learned_residual():
    """QA 25 #8: node residuals were never forgotten, so a cluster with
    ephemeral host names grew its GetPredictions rows and saved state
    without end. `gpulb uncordon` of a REMOVED node drops its residual; so
    does one of a node gone before a restart (liveness no longer knows it,
    the saved residual does)."""
    clock = ManualClock(1_000.0)
    coord = _coordinator(clock)
    _register(coord, "stays", [RTX])
    _register(coord, "goes", [RTX])
    p = coord.advisor.predictor
    for _ in range(5):
        p.observe("stays", RTX, "training", 10.0, 10.0)
        p.observe("goes", RTX, "training", 10.0, 20.0)
    p.observe("gone-before-restart", RTX, "training", 10.0, 10.0)  # as restored from the saved state
    assert {"stays", "goes", "gone-before-restart"} <= {f.node_id for f in p.stats()[1]}
    predicted = p.predict("stays", RTX, "training", 10.0)
    version = p.version

    async def run():
        clock.advance(0.5)
        _register(coord, "stays", [RTX])  # keeps heartbeating: registered afresh
        clock.advance(3.0)
        coord.liveness.keyframe_applied("stays")
        await coord._on_liveness_events(coord.liveness.sweep())
        assert "goes" in set(coord.liveness.removed()) and "goes" not in coord.view.nodes
        ops = coord.operator
        back = await ops.UncordonNode(cpb.NodeActionRequest(node_id="goes"), _Context())
        assert back.node.state == cpb.NODE_STATE_REMOVED
        assert "goes" not in {f.node_id for f in p.stats()[1]}
        assert await ops.UncordonNode(cpb.NodeActionRequest(node_id="gone-before-restart"), _Context())
        with pytest.raises(_Aborted) as err:
            await ops.UncordonNode(cpb.NodeActionRequest(node_id="never-seen"), _Context())
        assert err.value.code == grpc.StatusCode.NOT_FOUND

    asyncio.run(run())
    assert {f.node_id for f in p.stats()[1]} == {"stays"}
    assert "goes" not in {row[0] for row in p.to_state()["nodes"]}
    assert p.version > version  # saved with the learners at the next save
    # the node that stays is predicted as before
    assert p.predict("stays", RTX, "training", 10.0) == pytest.approx(predicted)
