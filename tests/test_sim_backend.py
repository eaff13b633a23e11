"""The simulated GPU backend (and the trace replay it plays): determinism,
the physical model, placed-task events, and real GenAI trace values."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from agent.backend import GpuBackend, Health
from agent.replay import ReplaySeries, _read_metric, default_trace_dir, load_genai
from agent.sim import (
    AMBIENT_C,
    C_PER_W,
    DRIVER_BASE_MIB,
    SM_BOOST_MHZ,
    SM_IDLE_MHZ,
    THERMAL_TAU_S,
    SimBackend,
    SimTaskEvent,
)
from protos import telemetry_pb2 as pb


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _run(seed: int, times: list[float]) -> list[list]:
    clock = FakeClock(0.0)
    sim = SimBackend(seed=seed, clock=clock)
    out = []
    for t in times:
        clock.now = t
        out.append(sim.sample())
    return out


def test_is_a_gpu_backend() -> None:
    assert isinstance(SimBackend(clock=FakeClock()), GpuBackend)


def test_same_seed_and_clock_give_the_same_samples() -> None:
    times = [0.0, 0.2, 0.4, 2.4, 4.4, 30.0, 31.0, 90.0, 240.0]
    assert _run(7, times) == _run(7, times)
    assert _run(7, times) != _run(8, times)
    assert SimBackend(seed=7, clock=FakeClock()).inventory() == SimBackend(seed=7, clock=FakeClock()).inventory()
    uuids = [g.uuid for g in SimBackend(seed=7, clock=FakeClock()).inventory()]
    other = [g.uuid for g in SimBackend(seed=8, clock=FakeClock()).inventory()]
    assert len(set(uuids + other)) == 8


def test_background_load_does_not_depend_on_sampling_rate() -> None:
    fast_clock, slow_clock = FakeClock(0.0), FakeClock(0.0)
    fast, slow = SimBackend(seed=3, clock=fast_clock), SimBackend(seed=3, clock=slow_clock)
    for step in range(1, 601):  # 200 ms for two minutes
        fast_clock.now = step * 0.2
        f = fast.sample()
        if step % 50 == 0:  # every 10 s
            slow_clock.now = fast_clock.now
            s = slow.sample()
            # memory and process lists carry no noise: the workload is the same
            assert [x.memory_used_mib for x in f] == [x.memory_used_mib for x in s]
            assert [x.processes for x in f] == [x.processes for x in s]


def test_rewind_background_replays_the_other_tenants_load_from_its_start() -> None:
    """gpulb demo compares policies one phase after another; after a rewind
    the second phase must meet the memory and processes the first met."""
    clock = FakeClock(0.0)
    sim = SimBackend(seed=5, clock=clock)
    offsets = [float(t) for t in range(0, 120, 3)]
    first = []
    for t in offsets:
        clock.now = t
        first.append([(x.memory_used_mib, x.processes) for x in sim.sample()])
    clock.now = 500.0
    sim.sample()
    sim.rewind_background()
    again = []
    for t in offsets:
        clock.now = 500.0 + t
        again.append([(x.memory_used_mib, x.processes) for x in sim.sample()])
    assert again == first
    # without the rewind the load 500 s on is not the one from the start (the
    # check has teeth: this seed's background moves in those two minutes)
    late = SimBackend(seed=5, clock=FakeClock(0.0))
    later = []
    for t in offsets:
        late._clock.now = 500.0 + t  # type: ignore[attr-defined]
        later.append([(x.memory_used_mib, x.processes) for x in late.sample()])
    assert later != first
    assert len({tuple(m for m, _ in row) for row in first}) > 1


def test_synthetic_workload_steps_so_there_is_something_to_react_to() -> None:
    clock = FakeClock(0.0)
    sim = SimBackend(seed=0, clock=clock)
    seen: set[int] = set()
    for t in range(0, 600, 5):
        clock.now = float(t)
        seen.update(s.memory_used_mib for s in sim.sample())
    assert DRIVER_BASE_MIB in seen  # idle spells
    assert len(seen) >= 8  # and several distinct load levels


def test_idle_card_reads_like_an_idle_4090() -> None:
    clock = FakeClock()
    sim = SimBackend(gpus=2, clock=clock, workload="idle")
    clock.now += 5
    for s in sim.sample():
        assert s.health == Health.OK
        assert (s.util_gpu_pct, s.util_memory_pct, s.process_count, s.processes) == (0, 0, 0, ())
        assert s.memory_used_mib == DRIVER_BASE_MIB
        assert s.memory_total_mib == 24564
        assert s.sm_clock_mhz == SM_IDLE_MHZ
        assert 29_000 <= s.power_mw <= 31_000
        assert s.power_limit_mw == 450_000
        assert s.temperature_c == round(AMBIENT_C + C_PER_W * 30)
        assert s.ecc_corrected is None and s.ecc_uncorrected is None  # 4090: ECC off
        assert s.pcie_rx_kbps == 0


def test_full_load_power_clock_memory_and_processes() -> None:
    clock = FakeClock()
    sim = SimBackend(gpus=2, clock=clock, workload="idle")
    sim.place("a", [0], vram_mib=8000, gpu_share=0.6, duration_s=0, kind="training")
    sim.place("b", [0], vram_mib=2000, gpu_share=0.6, duration_s=0, kind="inference")
    clock.now += 1
    g0, g1 = sim.sample()
    assert g0.memory_used_mib == DRIVER_BASE_MIB + 10_000
    assert g0.process_count == 2
    assert sorted(p.used_memory_mib for p in g0.processes) == [2000, 8000]
    assert 97 <= g0.util_gpu_pct <= 100  # 120 % asked, capped at the card
    assert g0.sm_clock_mhz == SM_BOOST_MHZ
    # 30 W + 420 W * 0.9 = 408 W, noise 1 %
    assert 400_000 <= g0.power_mw <= 416_000
    assert g1.process_count == 0 and g1.memory_used_mib == DRIVER_BASE_MIB


def test_temperature_follows_power_with_a_first_order_lag() -> None:
    clock = FakeClock()
    sim = SimBackend(gpus=1, clock=clock, workload="idle")
    start = sim.sample()[0].temperature_c
    sim.place("hot", [0], vram_mib=1000, gpu_share=1.0, duration_s=0, kind="training")
    target = AMBIENT_C + C_PER_W * (30 + 420 * 0.9)
    temps = []
    for _ in range(int(10 * THERMAL_TAU_S)):
        clock.now += 1.0
        temps.append(sim.sample()[0].temperature_c)
    assert temps[0] <= start + 1  # no jump
    assert temps == sorted(temps)  # rises monotonically
    # one time constant: 63 % of the way
    assert abs(temps[int(THERMAL_TAU_S) - 1] - (start + 0.632 * (target - start))) <= 1.5
    assert abs(temps[-1] - target) <= 1
    sim.release("hot")
    clock.now += 5.0
    cooling = sim.sample()[0].temperature_c
    assert target - 10 < cooling < target  # cools, but not at once


def test_oom_kill_when_the_task_does_not_fit() -> None:
    clock = FakeClock()
    sim = SimBackend(gpus=2, clock=clock, workload="idle")
    sim.place("big", [0], vram_mib=20_000, gpu_share=0.5, duration_s=0, kind="training")
    sim.place("more", [0, 1], vram_mib=5_000, gpu_share=0.5, duration_s=0, kind="training")
    events = sim.drain_events()
    assert [(e.task_id, e.kind) for e in events] == [("big", "started"), ("more", "oom_killed")]
    assert "GPU 0" in events[1].detail
    assert sim.drain_events() == []
    g0, g1 = sim.sample()
    assert g0.memory_used_mib == DRIVER_BASE_MIB + 20_000
    assert g1.memory_used_mib == DRIVER_BASE_MIB  # the killed task holds nothing anywhere
    # it fits exactly up to the card
    sim.place("exact", [0], vram_mib=24564 - DRIVER_BASE_MIB - 20_000, gpu_share=0.0, duration_s=0, kind="x")
    assert sim.drain_events() == [SimTaskEvent("exact", "started", "GPUs [0]")]


def test_task_finishes_after_its_duration() -> None:
    clock = FakeClock()
    sim = SimBackend(gpus=4, clock=clock, workload="idle")
    sim.place("t", [2, 3], vram_mib=1000, gpu_share=0.5, duration_s=10, kind="training")
    assert [e.kind for e in sim.drain_events()] == ["started"]
    clock.now += 9.9
    assert [s.process_count for s in sim.sample()] == [0, 0, 1, 1]
    assert sim.drain_events() == []
    clock.now += 0.1
    assert [(e.task_id, e.kind) for e in sim.drain_events()] == [("t", "finished")]
    assert [s.process_count for s in sim.sample()] == [0, 0, 0, 0]
    assert sim.release("t") is False


def test_release_stops_a_task_without_an_event() -> None:
    clock = FakeClock()
    sim = SimBackend(gpus=1, clock=clock, workload="idle")
    sim.place("r", [0], vram_mib=1000, gpu_share=0.3, duration_s=0, kind="inference")
    sim.drain_events()
    clock.now += 3600
    assert sim.drain_events() == []  # duration 0: runs until released
    assert sim.release("r") is True
    assert sim.drain_events() == []
    assert sim.sample()[0].process_count == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(gpu_indices=[], vram_mib=1, gpu_share=0.1, duration_s=1), "gpu_indices"),
        (dict(gpu_indices=[4], vram_mib=1, gpu_share=0.1, duration_s=1), "gpu_indices"),
        (dict(gpu_indices=[1, 1], vram_mib=1, gpu_share=0.1, duration_s=1), "gpu_indices"),
        (dict(gpu_indices=[0], vram_mib=-1, gpu_share=0.1, duration_s=1), "vram"),
        (dict(gpu_indices=[0], vram_mib=1, gpu_share=1.5, duration_s=1), "gpu_share"),
        (dict(gpu_indices=[0], vram_mib=1, gpu_share=float("nan"), duration_s=1), "gpu_share"),
        (dict(gpu_indices=[0], vram_mib=1, gpu_share=0.1, duration_s=-1), "duration"),
    ],
)
def test_invalid_placement_fails_as_an_event_not_an_exception(kwargs: dict, match: str) -> None:
    sim = SimBackend(clock=FakeClock(), workload="idle")
    sim.place("x", kind="training", **kwargs)
    (event,) = sim.drain_events()
    assert (event.task_id, event.kind) == ("x", "failed")
    assert match in event.detail
    assert all(s.process_count == 0 for s in sim.sample())


def test_placing_a_running_task_again_changes_nothing() -> None:
    clock = FakeClock()
    sim = SimBackend(gpus=2, clock=clock, workload="idle")
    sim.place("x", [0], 1000, 0.1, 30, "training")
    clock.now += 20
    sim.place("x", [1], 2000, 0.1, 30, "training")  # re-sent after a reconnect
    assert [(e.task_id, e.kind) for e in sim.drain_events()] == [("x", "started")]
    assert [s.memory_used_mib for s in sim.sample()] == [DRIVER_BASE_MIB + 1000, DRIVER_BASE_MIB]
    clock.now += 10
    assert [(e.task_id, e.kind) for e in sim.drain_events()] == [("x", "finished")]
    sim.place("x", [1], 2000, 0.1, 30, "training")  # a finished id may run again
    assert [(e.task_id, e.kind) for e in sim.drain_events()] == [("x", "started")]


def test_topology_pairs_are_nvlink_the_rest_pcie() -> None:
    links = {(l.gpu_a, l.gpu_b): l for l in SimBackend(gpus=4, clock=FakeClock()).topology()}
    assert set(links) == {(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)}
    nvlink = {k for k, l in links.items() if l.kind == pb.LINK_KIND_NVLINK}
    assert nvlink == {(0, 1), (2, 3)}
    assert all(links[k].nvlink_count > 0 for k in nvlink)
    assert all(l.kind == pb.LINK_KIND_PCIE_SWITCH and l.nvlink_count == 0 for k, l in links.items() if k not in nvlink)


# --- replay: literal series ---------------------------------------------------


def _series(mem_mib: list[float], duty: list[float], ref_mib: float = 1000.0) -> ReplaySeries:
    t = np.arange(len(mem_mib), dtype=np.float64) * 60.0
    return ReplaySeries(
        pod_id="pod",
        memory_t=t,
        memory_mib=np.asarray(mem_mib, dtype=np.float64),
        duty_t=np.arange(len(duty), dtype=np.float64) * 60.0,
        duty_pct=np.asarray(duty, dtype=np.float64),
        memory_ref_mib=ref_mib,
        step_s=60.0,
    )


def test_replay_series_steps_wraps_and_compresses_time() -> None:
    s = _series([100, 500, 1000], [10, 50, 90])
    assert s.period_s == 180.0
    assert [s.duty_pct_at(t) for t in (0, 59.9, 60, 130, 179.9, 180, 245)] == [10, 10, 50, 90, 90, 10, 50]
    assert s.duty_pct_at(1.0, speed=60) == 50  # one second is one step at 60x
    # memory: the reference maps to the capacity, shape kept, clipped
    assert s.memory_mib_at(0, capacity_mib=2000) == 200
    assert s.memory_mib_at(120, capacity_mib=2000) == 2000
    assert _series([3000], [0]).memory_mib_at(0, capacity_mib=2000) == 2000
    with pytest.raises(ValueError):
        s.duty_pct_at(float("nan"))


def test_replay_series_missing_metric_reads_none() -> None:
    s = _series([100, 200], [])
    assert s.duty_pct_at(30) is None
    assert s.memory_mib_at(30) is not None


def test_replay_workload_plays_the_series_and_a_growing_tenant_is_refused_not_the_task() -> None:
    """The other tenant's pod grows to the full card while a gpulb task holds
    5,000 MiB: as on a real GPU, the allocation that fails is the pod's (the
    process asking), the task runs on; the refusal is counted once per
    episode, and the pod gets the card again once the task has gone."""
    clock = FakeClock()
    capacity = 24564 - DRIVER_BASE_MIB
    # 10 % of the card, then the full card a minute later
    grow = _series([100, 1000, 1000, 1000, 1000], [40, 80, 80, 80, 80], ref_mib=1000.0)
    sim = SimBackend(gpus=1, clock=clock, workload="replay", replay=grow)
    s = sim.sample()[0]
    assert s.memory_used_mib == DRIVER_BASE_MIB + round(capacity * 0.1)
    assert abs(s.util_gpu_pct - 40) <= 6
    sim.place("holder", [0], vram_mib=5000, gpu_share=0.1, duration_s=0, kind="inference")
    clock.now += 60
    s = sim.sample()[0]
    assert [(e.task_id, e.kind) for e in sim.drain_events()] == [("holder", "started")]  # not killed
    assert s.memory_used_mib == 24564 and sim.tenant_ooms == [1]
    pod, task = s.processes
    assert (task.pid, task.used_memory_mib) != (0, 0) and task.used_memory_mib == 5000
    assert pod.used_memory_mib == capacity - 5000  # what was left for it
    clock.now += 30
    sim.sample()
    assert sim.tenant_ooms == [1]  # the same episode
    assert sim.release("holder")
    clock.now += 30
    s = sim.sample()[0]
    assert s.processes[0].used_memory_mib == capacity and sim.tenant_ooms == [1]
    sim.place("again", [0], vram_mib=1, gpu_share=0.1, duration_s=0, kind="inference")
    assert [(e.task_id, e.kind) for e in sim.drain_events()] == [("again", "oom_killed")]  # nothing free to start on


def test_synthetic_tenants_refused_memory_are_counted_per_episode_and_tasks_never_die_of_it() -> None:
    clock = FakeClock()
    sim = SimBackend(gpus=2, clock=clock, seed=4)
    # a task on each GPU holding half the card, placed once it fits: the
    # background's busier steps (up to 16 GiB) then run into it
    for g in range(2):
        while True:
            sim.place(f"big-{g}", [g], vram_mib=12_000, gpu_share=0.2, duration_s=0, kind="training")
            if sim.drain_events()[-1].kind == "started":
                break
            clock.now += 1.0
    episodes_seen = 0
    for _ in range(3600):
        clock.now += 1.0
        samples = sim.sample()
        assert all(s.memory_used_mib <= 24564 for s in samples)
        episodes_seen += sum(sim._tenant_refused)
    assert sim.drain_events() == []  # neither task died of it
    assert all(count > 0 for count in sim.tenant_ooms)
    # an episode spans several samples: counts are of starts, not of refused samples
    assert sum(sim.tenant_ooms) < episodes_seen


# --- replay: the real GenAI trace ------------------------------------------------

_GENAI = default_trace_dir() / "alibaba-genai"
needs_traces = pytest.mark.skipif(
    not (_GENAI / "pod_gpu_duty_cycle_anon.tar.gz").exists(),
    reason=f"GenAI traces not found under {_GENAI} (set GPULB_TRACES)",
)


@needs_traces
def test_load_genai_gives_sorted_pods_and_series() -> None:
    series = load_genai(max_pods=5)
    assert len(series) == 5
    ids = [s.pod_id for s in series]
    assert ids == sorted(ids)
    hits = _read_metric.cache_info().hits
    everything = load_genai()
    assert _read_metric.cache_info().hits == hits + 2  # both tarballs parsed once per process
    assert len(everything) == 144  # the union of both files' pods
    assert [s.pod_id for s in everything[:5]] == ids
    for s in everything:
        assert np.all(np.diff(s.memory_t) >= 0) and np.all(np.diff(s.duty_t) >= 0)
        assert s.duty_pct.size == 0 or (s.duty_pct.min() >= 0 and s.duty_pct.max() <= 100)
    # one trace-wide reference: the largest reading of all (50.8 GB)
    assert abs(everything[0].memory_ref_mib - 50_833_129_472 / 2**20) < 1
    assert max(float(s.memory_mib.max()) for s in everything if s.memory_mib.size) == everything[0].memory_ref_mib
    assert everything[0].step_s == 57.0


@needs_traces
def test_replay_mode_plays_real_trace_values() -> None:
    pods = load_genai(max_pods=2)
    clock = FakeClock()
    sim = SimBackend(gpus=2, clock=clock, workload="replay", replay=pods, replay_speed=60.0)
    capacity = 24564 - DRIVER_BASE_MIB
    busy_seen = False
    for step in range(0, 300):
        t = step * 1.0
        clock.now = 1000.0 + t
        for s, pod in zip(sim.sample(), pods):
            want_mem = pod.memory_mib_at(t, capacity_mib=capacity, speed=60.0)
            want_util = pod.duty_pct_at(t, speed=60.0)
            assert s.memory_used_mib == DRIVER_BASE_MIB + (want_mem or 0)
            if want_util:
                busy_seen = True
                assert abs(s.util_gpu_pct - min(100.0, want_util)) <= 7
            else:
                assert s.util_gpu_pct == 0
    assert busy_seen


def test_replay_without_traces_is_backend_unavailable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from agent.backend import BackendUnavailable

    monkeypatch.setenv("GPULB_TRACES", str(tmp_path))
    assert default_trace_dir() == tmp_path
    with pytest.raises(FileNotFoundError):
        load_genai()
    with pytest.raises(BackendUnavailable):
        SimBackend(clock=FakeClock(), workload="replay")
