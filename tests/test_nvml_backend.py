"""The NVML backend against the shipped fake NVML library: field mapping,
error translation, lost-GPU re-init with backoff, frozen detection and
topology; plus the pure parsers on real pynvml structs."""

from __future__ import annotations

import pynvml
import pytest
import structlog

from agent.backend import BackendError, BackendUnavailable, GpuBackend, GpuProcess, Health, TopologyLink
from agent.fake_nvml import MIB, SWITCH, FakeGpu, FakeNvml, FakeProcess
from agent.nvml import (
    FrozenDetector,
    NvmlBackend,
    build_topology,
    bytes_to_mib,
    link_kind,
    parse_bus_id,
    parse_memory,
    parse_processes,
    parse_utilization,
)
from protos import telemetry_pb2 as pb


class FakeClock:
    def __init__(self) -> None:
        self.now = 500.0

    def __call__(self) -> float:
        return self.now


def _backend(nv: FakeNvml, clock: FakeClock | None = None, **kwargs) -> NvmlBackend:
    return NvmlBackend(nvml=nv, clock=clock or FakeClock(), **kwargs)


# --- pure parsers, on pynvml's own structs ---------------------------------------


def test_parsers_on_real_pynvml_structs() -> None:
    assert parse_utilization(pynvml.c_nvmlUtilization_t(gpu=87, memory=41)) == {
        "util_gpu_pct": 87,
        "util_memory_pct": 41,
    }
    # a 24 GiB card as NVML reports it: 25757220864 bytes = 24564 MiB
    mem = pynvml.c_nvmlMemory_t(total=25_757_220_864, free=0, used=300 * MIB + MIB - 1)
    assert parse_memory(mem) == {"memory_used_mib": 300, "memory_total_mib": 24564}
    assert bytes_to_mib(MIB - 1) == 0


def test_process_memory_none_counts_as_zero() -> None:
    # pynvml returns its "friendly objects" here, usedGpuMemory None on WDDM
    procs = [
        pynvml.nvmlFriendlyObject({"pid": 11, "usedGpuMemory": 2048 * MIB}),
        pynvml.nvmlFriendlyObject({"pid": 12, "usedGpuMemory": None}),
    ]
    assert parse_processes(procs) == (
        GpuProcess(11, 2048),
        GpuProcess(12, 0),
    )


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("00000000:3B:00.0", (0, 0x3B, 0, 0)),
        (b"0000:3b:00.0", (0, 0x3B, 0, 0)),
        ("00000001:AF:1F.7\x00", (1, 0xAF, 0x1F, 7)),
        ("", None),
        ("not-a-bus", None),
        ("0000:zz:00.0", None),
    ],
)
def test_parse_bus_id(text: str | bytes, key: tuple | None) -> None:
    assert parse_bus_id(text) == key


@pytest.mark.parametrize(
    ("level", "kind"),
    [
        (pynvml.NVML_TOPOLOGY_INTERNAL, pb.LINK_KIND_PCIE_SWITCH),
        (pynvml.NVML_TOPOLOGY_SINGLE, pb.LINK_KIND_PCIE_SWITCH),
        (pynvml.NVML_TOPOLOGY_MULTIPLE, pb.LINK_KIND_PCIE_SWITCH),
        (pynvml.NVML_TOPOLOGY_HOSTBRIDGE, pb.LINK_KIND_PCIE_HOST),
        (pynvml.NVML_TOPOLOGY_NODE, pb.LINK_KIND_NUMA),
        (pynvml.NVML_TOPOLOGY_SYSTEM, pb.LINK_KIND_SYSTEM),
        (77, pb.LINK_KIND_UNSPECIFIED),
    ],
)
def test_link_kind(level: int, kind: int) -> None:
    assert link_kind(level) == kind


def test_build_topology_counts_links_from_the_better_end() -> None:
    links = build_topology(
        [0, 1, 2],
        levels={(0, 1): 10, (1, 2): 50},  # (0, 2) unknown
        direct_links={(0, 1): 4, (1, 0): 3},  # one port of GPU 1 unreadable
        switch_links={2: 6},  # one GPU on a switch alone reaches no GPU
    )
    assert links == [TopologyLink(0, 1, pb.LINK_KIND_NVLINK, 4), TopologyLink(1, 2, pb.LINK_KIND_SYSTEM, 0)]


@pytest.mark.parametrize(
    ("readings", "frozen"),
    [
        # busy, util exactly repeated with processes: frozen on the 3rd
        ([(50, 20, 4000, 1)] * 3, [False, False, True]),
        # busy and jittering: never
        ([(50, 20, 4000, 1), (51, 20, 4000, 1), (50, 20, 4000, 1)], [False, False, False]),
        # counters gone to zero while processes run: frozen, even if util flickers
        ([(0, 0, 0, 2), (3, 0, 0, 2), (0, 1, 0, 2)], [False, False, True]),
        # an inference server waiting: util 0, memory held, repeated: idle, not frozen
        ([(0, 0, 9000, 1)] * 5, [False] * 5),
        # no processes: a stable reading is just a stable GPU
        ([(50, 20, 4000, 0)] * 4, [False] * 4),
        # unknown process list: cannot judge
        ([(50, 20, 4000, None)] * 4, [False] * 4),
        # a moving reading ends it at once
        ([(50, 20, 4000, 1)] * 3 + [(60, 20, 4000, 1)], [False, False, True, False]),
        # a break in the run starts the count again
        ([(50, 20, 4000, 1)] * 2 + [(50, 20, 4000, 0)] + [(50, 20, 4000, 1)] * 2, [False] * 5),
        # a steady job pinned at 100 %: util and memory repeat, power moves
        # (as read on an H200 under bf16 matrix products): never frozen
        ([(100, 60, 67_379, 1, p) for p in (690_480, 691_210, 691_210, 692_700, 692_240)], [False] * 5),
        # stale counters freeze power too
        ([(100, 60, 67_379, 1, 691_210)] * 3, [False, False, True]),
    ],
)
def test_frozen_detector(readings: list[tuple], frozen: list[bool]) -> None:
    det = FrozenDetector(threshold=3)
    assert [det.update(*r) for r in readings] == frozen


# --- construction ----------------------------------------------------------------


def test_init_failure_is_backend_unavailable() -> None:
    with pytest.raises(BackendUnavailable, match="Driver Not Loaded"):
        _backend(FakeNvml.with_gpus(2, init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED))


def test_no_gpu_is_backend_unavailable_and_releases_nvml() -> None:
    nv = FakeNvml([])
    with pytest.raises(BackendUnavailable, match="no GPU"):
        _backend(nv)
    assert nv.shutdown_calls == 1 and not nv.initialized


def test_real_pynvml_without_a_driver_is_backend_unavailable() -> None:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        with pytest.raises(BackendUnavailable):
            NvmlBackend()
        return
    pynvml.nvmlShutdown()
    pytest.skip("this host has a working NVML driver")


def test_inventory_and_a_full_sample() -> None:
    nv = FakeNvml.with_gpus(2)
    g = nv.gpus[0]
    g.util_gpu, g.util_memory = 73, 35
    g.memory_used = 10_000 * MIB + 123
    g.temperature, g.power_mw, g.power_limit_mw = 71, 312_456, 400_000
    g.sm_clock_mhz, g.pcie_rx_kbps, g.pcie_tx_kbps = 2505, 812_000, 93_000
    g.ecc_corrected, g.ecc_uncorrected = 3, 1
    g.processes = [FakeProcess(4242, 9_000 * MIB), FakeProcess(4243, None)]
    backend = _backend(nv)
    assert isinstance(backend, GpuBackend)
    assert backend.name == "nvml"

    inv = backend.inventory()
    assert [i.index for i in inv] == [0, 1]
    assert inv[0].uuid == "GPU-fake-0000"
    assert inv[0].model == "NVIDIA GeForce RTX 4090"
    assert inv[0].memory_total_mib == 24564
    assert inv[0].power_limit_mw == 400_000
    assert inv[1].pci_bus_id == "00000000:11:00.0"

    s0, s1 = backend.sample()
    assert (s0.index, s0.health, s0.errors) == (0, Health.OK, {})
    assert (s0.util_gpu_pct, s0.util_memory_pct) == (73, 35)
    assert (s0.memory_used_mib, s0.memory_total_mib) == (10_000, 24564)
    assert (s0.temperature_c, s0.power_mw, s0.power_limit_mw) == (71, 312_456, 400_000)
    assert (s0.sm_clock_mhz, s0.pcie_rx_kbps, s0.pcie_tx_kbps) == (2505, 812_000, 93_000)
    assert (s0.ecc_corrected, s0.ecc_uncorrected) == (3, 1)
    assert s0.processes == (GpuProcess(4242, 9000), GpuProcess(4243, 0))
    assert s0.process_count == 2
    assert s0.xid_last == 0  # watched for Xid events, none yet
    assert (s1.index, s1.util_gpu_pct, s1.process_count, s1.processes) == (1, 0, 0, ())


# --- error translation -------------------------------------------------------------


def test_not_supported_fields_are_absent_and_not_asked_again() -> None:
    nv = FakeNvml.with_gpus(1)
    nv.gpus[0].errors["nvmlDeviceGetTotalEccErrors"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    nv.gpus[0].errors["nvmlDeviceGetPcieThroughput"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    backend = _backend(nv)
    (s,) = backend.sample()
    assert s.health == Health.OK
    assert (s.ecc_corrected, s.ecc_uncorrected, s.pcie_rx_kbps, s.pcie_tx_kbps) == (None, None, None, None)
    assert s.errors == {}  # absent is not an error
    asked = (nv.calls["nvmlDeviceGetTotalEccErrors"], nv.calls["nvmlDeviceGetPcieThroughput"])
    assert asked == (2, 2)  # corrected + uncorrected, rx + tx: once each
    for _ in range(3):
        (s,) = backend.sample()
        assert s.ecc_corrected is None and s.temperature_c == 35
    assert (nv.calls["nvmlDeviceGetTotalEccErrors"], nv.calls["nvmlDeviceGetPcieThroughput"]) == asked


def test_one_failing_field_leaves_the_rest_and_the_other_gpus() -> None:
    nv = FakeNvml.with_gpus(2)
    nv.gpus[1].temperature = 64
    nv.gpus[1].errors["nvmlDeviceGetTemperature"] = pynvml.NVML_ERROR_UNKNOWN
    backend = _backend(nv)
    s0, s1 = backend.sample()
    assert s0.temperature_c == 35 and s0.errors == {}
    assert s1.health == Health.OK
    assert s1.temperature_c is None
    assert set(s1.errors) == {"temperature_c"}
    assert "999" in s1.errors["temperature_c"]
    assert s1.power_mw == 30_000 and s1.memory_used_mib == 300
    # a failure is retried next round, unlike NOT_SUPPORTED
    del nv.gpus[1].errors["nvmlDeviceGetTemperature"]
    assert backend.sample()[1].temperature_c == 64


def test_a_read_error_on_a_two_field_call_marks_both_fields() -> None:
    nv = FakeNvml.with_gpus(1)
    nv.gpus[0].errors["nvmlDeviceGetUtilizationRates"] = pynvml.NVML_ERROR_TIMEOUT
    (s,) = _backend(nv).sample()
    assert (s.util_gpu_pct, s.util_memory_pct) == (None, None)
    assert set(s.errors) == {"util_gpu_pct", "util_memory_pct"}


def test_a_gpu_whose_every_read_fails_is_read_failed() -> None:
    nv = FakeNvml.with_gpus(2)
    backend = _backend(nv)
    fns = [
        "nvmlDeviceGetUtilizationRates",
        "nvmlDeviceGetMemoryInfo",
        "nvmlDeviceGetTemperature",
        "nvmlDeviceGetPowerUsage",
        "nvmlDeviceGetEnforcedPowerLimit",
        "nvmlDeviceGetClockInfo",
        "nvmlDeviceGetPcieThroughput",
        "nvmlDeviceGetTotalEccErrors",
        "nvmlDeviceGetComputeRunningProcesses",
    ]
    nv.gpus[0].errors = {fn: pynvml.NVML_ERROR_UNKNOWN for fn in fns}
    s0, s1 = backend.sample()
    assert s0.health == Health.READ_FAILED
    assert s0.util_gpu_pct is None and s0.memory_used_mib is None
    assert s1.health == Health.OK
    # all but one failing is not a failed GPU
    del nv.gpus[0].errors["nvmlDeviceGetPowerUsage"]
    s0, _ = backend.sample()
    assert s0.health == Health.OK and s0.power_mw == 30_000


def test_a_gpu_without_a_handle_is_listed_read_failed_and_recovers() -> None:
    nv = FakeNvml.with_gpus(2)
    nv.gpus[1].errors["nvmlDeviceGetHandleByIndex"] = pynvml.NVML_ERROR_UNKNOWN
    backend = _backend(nv)
    assert backend.inventory()[1].model == "unknown"
    s0, s1 = backend.sample()
    assert s0.health == Health.OK
    assert s1.health == Health.READ_FAILED and "handle" in s1.errors
    del nv.gpus[1].errors["nvmlDeviceGetHandleByIndex"]
    assert backend.sample()[1].health == Health.OK


# --- lost GPUs ---------------------------------------------------------------------


def test_lost_gpu_reinitialises_nvml_with_exponential_backoff() -> None:
    nv = FakeNvml.with_gpus(2)
    nv.gpus[0].util_gpu = 40
    clock = FakeClock()
    backend = _backend(nv, clock, reinit_backoff_s=1.0, reinit_backoff_max_s=60.0)
    assert nv.init_calls == 1
    t0 = clock.now
    nv.gpus[1].lost = True

    def at(dt: float) -> list:
        clock.now = t0 + dt
        s0, s1 = backend.sample()
        # the healthy GPU is read every round, re-init or not
        assert (s0.health, s0.util_gpu_pct) == (Health.OK, 40)
        return [s1.health, nv.init_calls - 1]

    assert at(0.0) == [Health.LOST, 0]  # lost: re-init in 1 s
    assert at(0.5) == [Health.LOST, 0]
    assert at(1.0) == [Health.LOST, 1]  # tried; still lost: next in 2 s
    assert at(2.9) == [Health.LOST, 1]
    assert at(3.0) == [Health.LOST, 2]  # next in 4 s
    assert at(6.9) == [Health.LOST, 2]
    assert nv.shutdown_calls == 2
    nv.gpus[1].lost = False  # the driver reset finished
    assert at(7.0) == [Health.OK, 3]
    assert at(7.1) == [Health.OK, 3]
    # recovered: the backoff starts over
    nv.gpus[1].lost = True
    assert at(8.0) == [Health.LOST, 3]
    assert at(9.0) == [Health.LOST, 4]


def test_reinit_backoff_is_capped() -> None:
    nv = FakeNvml.with_gpus(1)
    clock = FakeClock()
    backend = _backend(nv, clock, reinit_backoff_s=1.0, reinit_backoff_max_s=4.0)
    nv.gpus[0].lost = True
    attempts = []
    for step in range(0, 400):  # 40 s in 100 ms steps
        clock.now = 1000.0 + step / 10
        before = nv.init_calls
        backend.sample()
        if nv.init_calls > before:
            attempts.append(round(clock.now - 1000.0, 1))
    assert attempts[:5] == [1.0, 3.0, 7.0, 11.0, 15.0]


def test_failing_nvml_init_during_recovery_keeps_trying() -> None:
    nv = FakeNvml.with_gpus(2)
    clock = FakeClock()
    backend = _backend(nv, clock)
    nv.gpus[1].lost = True
    backend.sample()
    nv.init_error = pynvml.NVML_ERROR_UNKNOWN
    clock.now += 1.0
    s0, s1 = backend.sample()
    # NVML is down: the other GPU cannot be read, but it is not lost
    assert (s0.health, s1.health) == (Health.READ_FAILED, Health.LOST)
    nv.init_error = None
    nv.gpus[1].lost = False
    clock.now += 2.0
    assert [s.health for s in backend.sample()] == [Health.OK, Health.OK]


def test_reinit_finds_gpus_by_uuid_after_renumbering() -> None:
    nv = FakeNvml.with_gpus(2)
    nv.gpus[0].temperature, nv.gpus[1].temperature = 40, 60
    clock = FakeClock()
    backend = _backend(nv, clock)
    nv.gpus[0].lost = True
    backend.sample()
    nv.gpus[0].lost = False
    nv.gpus.reverse()  # the reset enumerated them the other way round
    clock.now += 1.0
    s0, s1 = backend.sample()
    assert (s0.temperature_c, s1.temperature_c) == (40, 60)


def test_close_shuts_nvml_down_once() -> None:
    nv = FakeNvml.with_gpus(1)
    backend = _backend(nv)
    backend.close()
    backend.close()
    assert nv.shutdown_calls == 1 and not nv.initialized
    with pytest.raises(BackendError):
        backend.sample()


# --- Xid events -------------------------------------------------------------------


def test_xid_events_reach_the_sample_of_their_gpu_and_are_logged() -> None:
    nv = FakeNvml.with_gpus(3)
    nv.gpus[2].xid_events = False  # a GPU that cannot deliver them
    backend = _backend(nv)
    assert [s.xid_last for s in backend.sample()] == [0, 0, None]
    nv.xid(1, 31)
    nv.xid(1, 79)
    with structlog.testing.capture_logs() as logs:
        assert [s.xid_last for s in backend.sample()] == [0, 79, None]  # the last one seen
    assert [(e["gpu"], e["xid"]) for e in logs if e["event"] == "gpu_xid"] == [(1, 31), (1, 79)]
    assert "fallen off the bus" in logs[-1]["meaning"] and logs[-1]["uuid"] == "GPU-fake-0001"
    assert [s.xid_last for s in backend.sample()] == [0, 79, None]  # it stays
    backend.close()
    assert all(event_set.freed for event_set in nv.event_sets)


def test_an_unknown_error_while_registering_drops_the_event_set() -> None:
    # NVML: after UNKNOWN the set is in an undefined state and must be freed
    nv = FakeNvml.with_gpus(2)
    nv.gpus[1].errors["nvmlDeviceRegisterEvents"] = pynvml.NVML_ERROR_UNKNOWN
    backend = _backend(nv)
    assert [s.xid_last for s in backend.sample()] == [None, None]
    assert nv.event_sets[0].freed


def test_xid_events_are_watched_again_after_nvml_is_reinitialised() -> None:
    clock = FakeClock()
    nv = FakeNvml.with_gpus(2)
    backend = _backend(nv, clock)
    backend.sample()
    nv.gpus[0].lost = True
    assert backend.sample()[0].health == Health.LOST
    nv.gpus[0].lost = False
    clock.now += 10.0
    backend.sample()  # re-initialises NVML: a new session, a new event set
    assert nv.event_sets[0].freed and not nv.event_sets[-1].freed and len(nv.event_sets) == 2
    nv.xid(0, 48)
    assert [s.xid_last for s in backend.sample()] == [48, 0]


# --- frozen ---------------------------------------------------------------------


def test_frozen_gpu_with_processes_after_n_unchanged_samples() -> None:
    nv = FakeNvml.with_gpus(2)
    for g in nv.gpus:
        g.util_gpu, g.util_memory, g.memory_used = 88, 40, 12_000 * MIB
        g.processes = [FakeProcess(100, 11_000 * MIB)]
    backend = _backend(nv)  # default: 15 samples
    health = []
    for i in range(16):
        nv.gpus[1].util_gpu = 80 + i % 3  # GPU 1 jitters like a live GPU
        health.append([s.health for s in backend.sample()])
    assert [h[0] for h in health] == [Health.OK] * 14 + [Health.FROZEN] * 2
    assert all(h[1] == Health.OK for h in health)
    nv.gpus[0].util_gpu = 87
    assert backend.sample()[0].health == Health.OK


def test_metrics_gone_to_zero_under_load_is_frozen_not_idle() -> None:
    nv = FakeNvml.with_gpus(1)
    g = nv.gpus[0]
    g.util_gpu, g.memory_used = 0, 0
    g.processes = [FakeProcess(100, 11_000 * MIB)]
    backend = _backend(nv, frozen_after=3)
    assert [backend.sample()[0].health for _ in range(3)] == [Health.OK, Health.OK, Health.FROZEN]
    g.processes = []  # the job ended: zeros are now believable
    assert backend.sample()[0].health == Health.OK


def test_idle_server_holding_memory_is_not_frozen() -> None:
    nv = FakeNvml.with_gpus(1)
    g = nv.gpus[0]
    g.util_gpu, g.memory_used = 0, 9_000 * MIB
    g.processes = [FakeProcess(100, 8_700 * MIB)]
    backend = _backend(nv, frozen_after=3)
    assert {backend.sample()[0].health for _ in range(10)} == {Health.OK}


# --- topology -----------------------------------------------------------------------


def _bus(i: int) -> str:
    return f"00000000:{0x10 + i:02X}:00.0"


def test_topology_nvlink_peers_switches_and_pcie_levels() -> None:
    nv = FakeNvml.with_gpus(5)
    g = nv.gpus
    # 0 <-> 1: two direct NVLinks (ports 0 and 2 on GPU 0; port 1 inactive)
    g[0].nvlink_ports, g[0].nvlinks = 4, {0: _bus(1), 2: _bus(1)}
    g[1].nvlink_ports, g[1].nvlinks = 4, {0: _bus(0), 1: _bus(0)}
    # 2 and 3 on NVSwitches: 3 and 6 links
    g[2].nvlink_ports, g[2].nvlinks = 6, {0: SWITCH, 1: SWITCH, 2: SWITCH}
    g[3].nvlink_ports, g[3].nvlinks = 6, {i: SWITCH for i in range(6)}
    # GPU 4 has no NVLink at all (NOT_SUPPORTED); its ancestor call fails
    g[4].errors["nvmlDeviceGetTopologyCommonAncestor"] = pynvml.NVML_ERROR_UNKNOWN
    nv.topology = {
        (0, 2): pynvml.NVML_TOPOLOGY_SYSTEM,
        (0, 3): pynvml.NVML_TOPOLOGY_NODE,
        (1, 2): pynvml.NVML_TOPOLOGY_HOSTBRIDGE,
        (3, 1): pynvml.NVML_TOPOLOGY_SINGLE,
    }
    backend = _backend(nv)
    links = {(l.gpu_a, l.gpu_b): (l.kind, l.nvlink_count) for l in backend.topology()}
    assert links == {
        (0, 1): (pb.LINK_KIND_NVLINK, 2),
        (0, 2): (pb.LINK_KIND_SYSTEM, 0),
        (0, 3): (pb.LINK_KIND_NUMA, 0),
        (1, 2): (pb.LINK_KIND_PCIE_HOST, 0),
        (1, 3): (pb.LINK_KIND_PCIE_SWITCH, 0),
        (2, 3): (pb.LINK_KIND_NVLINK, 3),
    }
    # read once at start, not per call or per sample
    asked = nv.calls["nvmlDeviceGetNvLinkState"]
    backend.sample()
    backend.topology()
    assert nv.calls["nvmlDeviceGetNvLinkState"] == asked
    # ports are walked until the GPU's last one, not all NVML_NVLINK_MAX_LINKS
    assert asked <= 4 + 4 + 6 + 6 + 1 + 5


def test_fake_is_faithful_where_it_matters() -> None:
    nv = FakeNvml.with_gpus(1)
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nv.nvmlDeviceGetCount()
    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(0)
    nv.nvmlShutdown()
    nv.nvmlInit()
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nv.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)  # stale handle
    assert nv.NVML_CLOCK_SM == pynvml.NVML_CLOCK_SM
    assert isinstance(FakeGpu(uuid="u", bus_id=_bus(0)).processes, list)
