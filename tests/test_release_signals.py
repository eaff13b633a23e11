"""A drop the coordinator caused is the new level, not an anomaly (QA pass 25,
item 2): when a lease ends, the GPU's util, memory and power fall, and the
anomaly filter used to reject that fall for ``persist`` readings (~1-1.5 s),
flag an idle GPU ``util_anomaly,memory_anomaly,power_anomaly`` and keep its
smoothed and forecast util at the old level, so the next task stacked on a
busy GPU beside the freed one.

``SignalBank.expect_drop`` on literals; ``ClusterView.expect_release``; and
the whole pipeline inside a coordinator (agent-side ``TelemetryEncoder``
rounds in, the view's smoothed/forecast values, flags and the scheduler's
snapshot out), in-process on a manual clock, with a lease ended by each way
the coordinator ends one, beside a GPU whose identical drop has no release
and is still flagged as before.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from coordinator.config import CoordinatorConfig
from coordinator.liveness import ManualClock
from coordinator.server import Coordinator
from coordinator.signals import SignalBank
from coordinator.view import SIGNALS, ClusterView, SignalSettings
from protos import cluster_pb2 as cpb
from protos import telemetry_pb2 as pb
from protos.codec import DecodeOutcome, TelemetryEncoder
from protos.fields import BY_NAME, FIELD_COUNT
from scheduler.task import Priority, TaskSpec, TaskState

pytestmark = pytest.mark.timeout(60)

UTIL, MEM, TEMP, POWER, DISK = (SIGNALS.index(n) for n in SIGNALS)


def _busy(bank: SignalBank, rows, t: float, n: int = 30, level: float = 88.0, dt: float = 0.2) -> float:
    """``n`` readings of ``level`` +-1 on signal 0 of ``rows``; returns the next time."""
    rows = list(rows)
    for i in range(n):
        values = np.full((len(rows), bank.signals), np.nan)
        values[:, 0] = level + (i % 3) - 1
        bank.update(rows, values, t)
        t += dt
    return t


def _read(bank: SignalBank, rows, value: float, t: float) -> None:
    values = np.full((len(rows), bank.signals), np.nan)
    values[:, 0] = value
    bank.update(list(rows), values, t)


# --------------------------------------------------------------------- SignalBank
def test_an_expected_drop_is_the_new_level_at_once_and_the_same_drop_unexpected_is_still_flagged() -> None:
    bank = SignalBank(2, 1, min_spread=2.0)
    t = _busy(bank, [0, 1], 0.0)
    before = bank.smoothed[1, 0]
    assert bank.expect_drop([0], until_s=t + 10.0) == 0  # nothing flagged yet: nothing moved
    _read(bank, [0, 1], 0.0, t)
    # row 0's lease ended: the drop is its level, smoothed and forecast
    assert not bank.flagged[0, 0]
    assert bank.smoothed[0, 0] == 0.0 and bank.forecast[0, 0] == 0.0
    assert bank.expected_shift_counts[0] == 1
    # row 1, the same drop without a release: an anomaly until persist readings, as before
    assert bank.flagged[1, 0]
    assert bank.smoothed[1, 0] == before and bank.forecast[1, 0] == before
    assert bank.anomaly_counts[0] == 1 and bank.shift_counts[0] == 0
    _read(bank, [0, 1], 0.0, t + 0.2)
    assert bank.flagged[1, 0] and bank.smoothed[1, 0] == before
    _read(bank, [0, 1], 0.0, t + 0.4)
    assert not bank.flagged[1, 0] and bank.smoothed[1, 0] == 0.0  # persist = 3: shifted
    assert bank.shift_counts[0] == 1 and bank.anomaly_counts[0] == 2
    assert bank.expected_shift_counts[0] == 1


def test_a_reading_taken_while_the_task_stopped_does_not_hold_the_level_up() -> None:
    """40 % between 88 % and 0 %: the level after the expected shift is the
    median of the readings since it until persist have come, so it is
    never behind what the persist rule reaches (the median of the run)."""
    expected = SignalBank(1, 1, min_spread=2.0)
    unexpected = SignalBank(1, 1, min_spread=2.0)
    t = _busy(expected, [0], 0.0)
    _busy(unexpected, [0], 0.0)
    expected.expect_drop([0], until_s=t + 10.0)
    levels, old_levels = [], []
    for i, v in enumerate([40.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]):
        _read(expected, [0], v, t + 0.2 * i)
        _read(unexpected, [0], v, t + 0.2 * i)
        levels.append(float(expected.smoothed[0, 0]))
        old_levels.append(float(unexpected.smoothed[0, 0]))
    assert levels == [40.0, 20.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert old_levels[:2] == [pytest.approx(88.0, abs=1.5)] * 2 and old_levels[2:] == [0.0] * 5
    assert all(a <= b for a, b in zip(levels, old_levels))
    assert not expected.flagged[0, 0] and expected.anomaly_counts[0] == 0
    # from persist readings on, the EWMA as after any shift
    _read(expected, [0], 1.0, t + 2.0)
    assert expected.smoothed[0, 0] == pytest.approx(0.3)


def test_a_spike_up_is_still_rejected_while_a_drop_is_expected() -> None:
    bank = SignalBank(1, 1, min_spread=2.0)
    t = _busy(bank, [0], 0.0, level=45.0)
    level = bank.smoothed[0, 0]
    bank.expect_drop([0], until_s=t + 10.0)
    _read(bank, [0], 99.0, t)
    assert bank.flagged[0, 0] and bank.smoothed[0, 0] == level
    assert bank.expected_shift_counts[0] == 0 and bank.anomaly_counts[0] == 1
    # a drop still within the fence is a plain reading, and the expectation stays
    _read(bank, [0], 44.0, t + 0.2)
    assert not bank.flagged[0, 0] and bank.expecting_drop_until[0, 0] == t + 10.0


def test_a_drop_flagged_before_the_release_becomes_the_level_when_it_comes() -> None:
    """The task's process exits, then its worker calls CompleteTask: the
    drop's readings came first and were flagged."""
    bank = SignalBank(1, 2, min_spread=[2.0, 64.0], forecast_horizon_s=30.0)
    t = 0.0
    for i in range(30):
        bank.update([0], [[88.0 + (i % 3), 12_588.0 + (i % 2)]], t)
        t += 0.2
    bank.update([0], [[0.0, 300.0]], t)
    bank.update([0], [[0.0, 300.0]], t + 0.2)
    assert bank.flagged[0].tolist() == [True, True]
    assert bank.expect_drop([0], until_s=t + 10.0) == 2
    assert bank.flagged[0].tolist() == [False, False]
    assert bank.smoothed[0].tolist() == [0.0, 300.0]
    assert bank.forecast[0].tolist() == [0.0, 300.0]  # flat run: no trend to add
    assert bank.window_counts[0].tolist() == [2, 2]  # re-seeded with the run
    assert bank.anomaly_counts.tolist() == [2, 2]  # rejected when they came: still counted
    assert bank.expected_shift_counts.tolist() == [1, 1]
    assert np.isnan(bank.expecting_drop_until[0]).all()  # one shift per release
    bank.update([0], [[0.0, 300.0]], t + 0.4)
    assert bank.smoothed[0].tolist() == [0.0, 300.0] and not bank.flagged[0].any()


def test_one_expected_shift_per_release_and_none_after_the_window() -> None:
    bank = SignalBank(2, 1, min_spread=2.0)
    t = _busy(bank, [0, 1], 0.0)
    bank.expect_drop([0, 1], until_s=t + 1.0)
    _read(bank, [0], 0.0, t)  # row 0: taken
    t1 = _busy(bank, [0], t + 0.2, level=50.0)  # the GPU's next task, fenced again
    _read(bank, [0], 0.0, t1)
    assert bank.flagged[0, 0]  # a second drop in the window is judged as always
    _read(bank, [1], 0.0, t + 1.2)  # row 1: its window is over
    assert bank.flagged[1, 0]
    assert bank.expected_shift_counts[0] == 1


def test_reset_rows_forgets_an_expectation_and_bad_calls_are_refused() -> None:
    bank = SignalBank(2, 2, min_spread=2.0)
    bank.expect_drop([0], until_s=5.0, signals=[1])
    assert np.isnan(bank.expecting_drop_until[0, 0]) and bank.expecting_drop_until[0, 1] == 5.0
    bank.reset_rows([0])
    assert np.isnan(bank.expecting_drop_until[0]).all()
    with pytest.raises(IndexError):
        bank.expect_drop([2], until_s=1.0)
    with pytest.raises(IndexError):
        bank.expect_drop([0], until_s=1.0, signals=[2])
    with pytest.raises(ValueError):
        bank.expect_drop([0], until_s=float("nan"))


def test_expected_drops_batch_equals_row_by_row() -> None:
    rng = np.random.default_rng(3)
    rows, steps = 30, 60
    vals = rng.normal(60, 2, size=(steps, rows, 2))
    vals[rng.random(vals.shape) < 0.05] += 30  # spikes
    vals[30:, :20] -= 55  # the drop
    vals[rng.random(vals.shape) < 0.1] = np.nan
    batched = SignalBank(rows, 2, min_spread=1.0)
    single = SignalBank(rows, 2, min_spread=1.0)
    for i in range(steps):
        if i == 30:
            for b in (batched, single):
                b.expect_drop(np.arange(0, rows, 2), until_s=35.0)
        batched.update(np.arange(rows)[::-1], vals[i][::-1], float(i))
        for r in range(rows):
            single.update([r], vals[i, r : r + 1], float(i))
    for name in ("raw", "flagged", "window_counts"):
        np.testing.assert_array_equal(getattr(batched, name), getattr(single, name), err_msg=name)
    for name in ("smoothed", "forecast", "trend_per_min"):
        np.testing.assert_allclose(getattr(batched, name), getattr(single, name), rtol=1e-9, err_msg=name)
    np.testing.assert_array_equal(batched.expected_shift_counts, single.expected_shift_counts)
    assert batched.expected_shift_counts.sum() >= 15


# --------------------------------------------------------------------- the coordinator
class _Agent:
    """A registered node and the agent side of its stream: each round goes
    through the encoder, the decoder, ingest and the smoothing tick."""

    def __init__(self, coord: Coordinator, node_id: str, gpus: int) -> None:
        self.coord = coord
        reg = pb.Register(node_id=node_id, hostname=node_id, backend="test", gpus=[
            pb.GpuInfo(index=i, uuid=f"GPU-{node_id}-{i}", model="NVIDIA GeForce RTX 4090", memory_total_mib=24_564)
            for i in range(gpus)])
        coord.ingest.forget_node(node_id)
        self.node = coord.view.register(reg, coord.clock())
        coord.liveness.register(node_id)
        self.encoder = TelemetryEncoder(list(range(gpus)), keyframe_interval_s=1e9)
        self.values = np.zeros((gpus, FIELD_COUNT), dtype=np.int64)
        self.values[:, BY_NAME["memory_total_mib"]] = 24_564
        self.values[:, BY_NAME["health"]] = pb.GPU_HEALTH_OK
        self.idle(range(gpus))
        self.round()
        coord.dispatcher.snapshots.liveness_changed()

    def set(self, gpu: int, util: int, memory: int, power: int, temp: int) -> None:
        v = self.values[gpu]
        v[BY_NAME["util_gpu_pct"]], v[BY_NAME["memory_used_mib"]] = util, memory
        v[BY_NAME["power_w"]], v[BY_NAME["temperature_c"]] = power, temp

    def idle(self, gpus) -> None:
        for g in gpus:
            self.set(g, 0, 300, 30, 35)

    def busy(self, gpus, i: int) -> None:
        for g in gpus:  # a loaded GPU's readings wander by a few units
            self.set(g, 86 + i % 4, 12_588 + 8 * (i % 3), 296 + 4 * (i % 3), 60 + i % 2)

    def round(self, dt: float = 0.2) -> None:
        coord = self.coord
        coord.clock.advance(dt)
        now = coord.clock()
        env, _ = self.encoder.encode(self.values, np.ones_like(self.values, dtype=bool), now_s=now,
                                     sampled_at_ns=time.time_ns(), sample_interval_ms=200)
        if env is None:
            return
        result = self.node.decoder.admit(env)
        assert result.outcome is DecodeOutcome.APPLIED
        coord.batch_applied(self.node, result, result.batch, now)
        coord.liveness.keyframe_applied(self.node.node_id)
        coord.smooth_now()

    def rows(self) -> list[int]:
        return [int(r) for r in self.node.rows]


def _coordinator() -> Coordinator:
    return Coordinator(CoordinatorConfig(listen="127.0.0.1:0"), clock=ManualClock(1_000.0))


def _two_busy_gpus(coord: Coordinator, agent: _Agent) -> list:
    """Tasks placed on GPUs 0 and 1, which then run them for 6 s of readings."""
    engine = coord.dispatcher.engine
    for name in ("a", "b"):
        engine.submit(TaskSpec(name, priority=Priority.P2, kind="training", vram_mib=12_288.0, gpu_share=0.9,
                               duration_s=600.0), coord.dispatcher.snapshots.snapshot())
        coord.dispatcher.dispatch_now()
    tasks = [engine.get(n) for n in ("a", "b")]
    assert all(t.state == TaskState.LEASED for t in tasks)
    on = sorted(t.assignment.gpu_indices[0] for t in tasks)
    assert on == [0, 1], on
    for i in range(30):
        agent.busy([0, 1], i)
        agent.round()
    return sorted(tasks, key=lambda t: t.assignment.gpu_indices[0])


def _end(coord: Coordinator, task, how: str, other) -> None:
    engine, d = coord.dispatcher.engine, coord.dispatcher
    a = task.assignment
    if how == "complete":
        engine.complete(task.task_id, a.lease_id)
    elif how == "fail":
        engine.complete(task.task_id, a.lease_id, failed=True)
    elif how == "cancel":
        engine.cancel(task.task_id, "test")
    elif how == "expire":
        coord.clock.advance(a.lease_expires_at - coord.clock() - 1.0)
        engine.renew(other.task_id, other.assignment.lease_id)  # the other task's worker renews
        coord.clock.advance(1.01)
        assert [t.task_id for t in engine.expire_leases()] == [task.task_id]
    elif how == "migrate":
        d.migrate(task.task_id, a.lease_id, ["GPU-n1-2"])
    else:
        raise AssertionError(how)


def _flags(coord: Coordinator, row: int) -> list[str]:
    msg = cpb.Gpu()
    coord.gpu_flags(msg, coord.view.signals.flagged[row].tolist())
    return list(msg.flags)


@pytest.mark.parametrize("how", ["complete", "fail", "cancel", "expire", "migrate"])
def test_a_released_gpus_drop_is_its_level_at_once_in_the_coordinator(how) -> None:
    """Needs coordinator/scheduling.py to call ``ClusterView.expect_release``
    where a lease ends. GPU 0's lease ends; GPUs 0 and 1 then read idle. GPU
    0: no flag, smoothed and forecast util 0, the snapshot's forecast 0.
    GPU 1 (its task still leased: a real anomaly as far as the filter
    knows) is flagged and keeps its level, as before."""
    coord = _coordinator()
    agent = _Agent(coord, "n1", 3)
    first, second = _two_busy_gpus(coord, agent)
    assert first.assignment.gpu_indices == (0,)
    bank = coord.view.signals
    r0, r1, _ = agent.rows()
    busy = float(bank.smoothed[r1, UTIL])
    assert busy > 80 and bank.smoothed[r0, UTIL] > 80
    _end(coord, first, how, second)
    agent.idle([0, 1])
    if how == "migrate":
        agent.busy([2], 0)
    agent.round()
    assert _flags(coord, r0) == []
    assert bank.smoothed[r0, UTIL] == 0.0 and bank.forecast[r0, UTIL] == 0.0
    assert bank.smoothed[r0, MEM] == 300.0 and bank.smoothed[r0, POWER] == 30.0
    # telemetry alone rebuilds the scheduler's snapshot at most every min_rebuild_s
    coord.clock.advance(coord.dispatcher.snapshots.min_rebuild_s)
    snap = coord.dispatcher.snapshots.snapshot()
    g0 = snap.gpu_uuid.index("GPU-n1-0")
    assert snap.util_forecast_pct[g0] == 0.0
    # the same drop on GPU 1, no lease ended: flagged, level kept (as before)
    assert {"util_anomaly", "memory_anomaly", "power_anomaly"} <= set(_flags(coord, r1))
    assert bank.smoothed[r1, UTIL] == busy
    assert bank.expected_shift_counts[[UTIL, MEM, POWER]].tolist() == [1, 1, 1]


def test_a_drop_that_came_before_the_completion_is_taken_when_it_comes() -> None:
    """The task's process ended and the GPU read idle; its worker reports
    the completion 0.4 s later. Until then the drop is flagged (no one has
    said a lease ended); the completion makes it the level at once."""
    coord = _coordinator()
    agent = _Agent(coord, "n1", 2)
    first, second = _two_busy_gpus(coord, agent)
    bank = coord.view.signals
    r0, _ = agent.rows()
    agent.idle([0])
    agent.round()
    agent.round()
    assert "util_anomaly" in _flags(coord, r0)
    version = coord.view.version
    coord.dispatcher.engine.complete(first.task_id, first.assignment.lease_id)
    assert coord.view.version > version  # the snapshot is built again
    assert _flags(coord, r0) == []
    assert bank.smoothed[r0, UTIL] == 0.0 and bank.forecast[r0, UTIL] == 0.0
    coord.clock.advance(coord.dispatcher.snapshots.min_rebuild_s)
    snap = coord.dispatcher.snapshots.snapshot()
    assert snap.util_forecast_pct[snap.gpu_uuid.index("GPU-n1-0")] == 0.0


# --------------------------------------------------------------------- the view
def test_expect_release_tells_the_gpus_of_the_lease_and_nothing_else() -> None:
    view = ClusterView(signals=SignalSettings(release_expect_s=7.0))
    reg = pb.Register(node_id="n1", gpus=[pb.GpuInfo(index=i, uuid=f"GPU-{i}", memory_total_mib=24_564) for i in range(3)])
    node = view.register(reg, 0.0)
    assert view.expect_release("n1", ["GPU-2", "GPU-0", "GPU-elsewhere"], 100.0) == 2
    until = view.signals.expecting_drop_until
    for row, told in zip(node.rows, (True, False, True)):
        assert (until[row, :DISK] == 107.0).all() == told
        assert np.isnan(until[row, DISK])  # the host's disk await is not the GPU's
    assert view.expect_release("gone", ["GPU-0"], 100.0) == 0
    with pytest.raises(ValueError):
        ClusterView(signals=SignalSettings(release_expect_s=-1.0))
