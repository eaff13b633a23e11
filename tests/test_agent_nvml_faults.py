"""The agent on real-world GPU faults (QA pass 24, agent sections 1, 2, 3, 7
and 12), against the shipped fake NVML: a failed sensor's out-of-range
reading, GPUs renumbered by a re-init, a hung NVML call, MIG mode and a
field that was unsupported once, and SIGTERM while NVML hangs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pynvml
import pytest
import structlog

from agent import telemetry
from agent.backend import EXIT_REREAD, GpuSample, Health, InventoryChanged
from agent.check import render_check, run_check
from agent.fake_nvml import MIB, FakeNvml
from agent.nvml import READ_TIMEOUT_S, REPROBE_S, NvmlBackend
from agent.telemetry import OUT_OF_RANGE, drop_out_of_range, samples_to_matrix
from protos.codec import LOWER, UPPER, InvalidReading, TelemetryDecoder, TelemetryEncoder
from protos.fields import BY_NAME, FIELDS

ROOT = Path(__file__).resolve().parent.parent
#: nothing listens here: an agent pointed at it samples "while away" (no
#: server is started by these tests)
NOBODY = "127.0.0.1:44497"


class FakeClock:
    def __init__(self) -> None:
        self.now = 500.0

    def __call__(self) -> float:
        return self.now


# --- 1. out-of-range readings (QA §1) ----------------------------------------------


def _sample(index: int, **values) -> GpuSample:
    base = dict(util_gpu_pct=40, util_memory_pct=10, memory_used_mib=300, memory_total_mib=24_564, temperature_c=35,
                power_mw=300_000, power_limit_mw=450_000, sm_clock_mhz=2_505, process_count=0)
    base.update(values)
    return GpuSample(index=index, **base)


@pytest.fixture
def fresh_log():
    """``samples_to_matrix`` logs each (GPU, field) once per process."""
    telemetry._LOGGED.clear()
    yield
    telemetry._LOGGED.clear()


def test_a_failed_sensors_reading_is_not_reported_and_the_rest_is(fresh_log) -> None:
    samples = [
        _sample(0),
        _sample(1, util_gpu_pct=255, temperature_c=255, power_mw=0xFFFFFFFF),  # a failed sensor's values
    ]
    with structlog.testing.capture_logs() as logs:
        values, present = samples_to_matrix(samples, [0, 1])
    col = BY_NAME
    # GPU 0 untouched; GPU 1 loses exactly the three bad fields
    assert present[0].sum() == present[0].size - 5  # (no pcie rx/tx, ecc x2, xid in these samples)
    assert present[1].sum() == present[0].sum() - 3
    assert not present[1, col["util_gpu_pct"]] and not present[1, col["temperature_c"]] and not present[1, col["power_w"]]
    assert present[1, col["memory_used_mib"]] and values[1, col["util_memory_pct"]] == 10
    assert samples[1].util_gpu_pct is None and samples[1].health == Health.OK  # fields are left: not failed
    assert samples[1].errors["util_gpu_pct"].startswith(f"{OUT_OF_RANGE}: 255 % outside 0..100")
    assert samples[1].errors["power_mw"].startswith(f"{OUT_OF_RANGE}: 4294967 W outside 0..5000")
    assert samples[0].errors == {}
    # every value sent lies in its field's range: what the coordinator checks
    assert ((values >= LOWER) & (values <= UPPER) | ~present).all()
    assert sorted((e["gpu"], e["field"]) for e in logs if e["event"] == OUT_OF_RANGE) == [
        (1, "power_w"), (1, "temperature_c"), (1, "util_gpu_pct")]
    # logged once per GPU and field: the same readings again say nothing
    with structlog.testing.capture_logs() as logs:
        samples_to_matrix([_sample(1, util_gpu_pct=255)], [0, 1])
    assert [e for e in logs if e["event"] == OUT_OF_RANGE] == []


def test_a_gpu_left_with_no_reading_is_read_failed_never_idle() -> None:
    every = {spec.attr: 10**15 for spec in FIELDS if spec.attr not in ("health", "xid_last")}
    bad = _sample(0, **every)
    lost = GpuSample(index=1, health=Health.LOST, util_gpu_pct=300)
    nan = _sample(2, temperature_c=float("nan"), util_gpu_pct=2**80)  # not a number, past int64
    assert drop_out_of_range([bad, lost, nan], logged=None) == len(every) + 1 + 2
    assert bad.health == Health.READ_FAILED and all(getattr(bad, a) is None for a in every)
    assert lost.health == Health.LOST  # still lost, not merely failed
    assert nan.health == Health.OK and nan.temperature_c is None and "nan" in nan.errors["temperature_c"]
    values, present = samples_to_matrix([nan], [2])  # no OverflowError on the way to int64
    assert not present[0, BY_NAME["util_gpu_pct"]]


def test_any_reading_at_all_encodes_within_the_coordinators_ranges(fresh_log) -> None:
    rng = np.random.default_rng(24)
    attrs = [spec.attr for spec in FIELDS if spec.attr != "health"]
    for _ in range(200):
        samples = [GpuSample(index=i, **{a: int(rng.integers(-(2**40), 2**42)) for a in attrs}) for i in range(3)]
        values, present = samples_to_matrix(samples, [0, 1, 2])
        assert ((values >= LOWER) & (values <= UPPER) | ~present).all()


def test_the_coordinators_range_rule_accepts_what_a_failing_nvml_sensor_makes_the_agent_send(fresh_log) -> None:
    """QA §1: util 255 on GPU 1 got the node's stream closed in a loop (the
    coordinator rejects an out-of-range value, rightly). The codec's decoder
    applies the same rule (protos.codec LOWER/UPPER) as coordinator.ingest."""
    nv = FakeNvml.with_gpus(2)
    nv.gpus[0].util_gpu, nv.gpus[1].util_gpu = 40, 10
    backend = NvmlBackend(nvml=nv, clock=FakeClock())
    enc, dec = TelemetryEncoder([0, 1]), TelemetryDecoder([0, 1])
    for step, (util1, temp1, power1) in enumerate([(10, 35, 30_000), (255, 35, 30_000), (255, 255, 0xFFFFFFFF),
                                                   (20, 36, 31_000)]):
        nv.gpus[1].util_gpu, nv.gpus[1].temperature, nv.gpus[1].power_mw = util1, temp1, power1
        nv.gpus[0].util_gpu = 40 + 10 * step  # GPU 0 keeps moving
        samples = backend.sample()
        values, present = samples_to_matrix(samples, [0, 1])
        env, _ = enc.encode(values, present, now_s=float(step), sampled_at_ns=step)
        try:
            dec.apply(env)
        except InvalidReading as exc:  # what closed the stream
            pytest.fail(f"step {step}: the coordinator would close the stream: {exc}")
        assert samples[0].util_gpu_pct == 40 + 10 * step and samples[1].health == Health.OK
        assert (samples[1].util_gpu_pct is None) == (util1 == 255)
    backend.close()


# --- 2. a re-init that renumbers the GPUs (QA §2) ------------------------------------


def _three_gpus() -> FakeNvml:
    nv = FakeNvml.with_gpus(3)
    for i, util in enumerate((11, 22, 33)):
        nv.gpus[i].util_gpu, nv.gpus[i].memory_used = util, 1000 * (i + 1) * MIB
    return nv


def _reload_without(nv: FakeNvml, gone: int) -> None:
    """The next nvmlInit enumerates the GPUs without ``gone``: a driver
    reload without the dead card renumbers the ones after it."""
    real_init = nv.nvmlInit

    def init_after_reload() -> None:
        if len(nv.gpus) == 3:
            del nv.gpus[gone]
        real_init()

    nv.nvmlInit = init_after_reload


def test_a_gpu_gone_after_a_reinit_is_never_reported_with_another_gpus_readings() -> None:
    nv, clock = _three_gpus(), FakeClock()
    backend = NvmlBackend(nvml=nv, clock=clock)
    assert [s.util_gpu_pct for s in backend.sample()] == [11, 22, 33]
    nv.gpus[1].lost = True
    assert [s.health for s in backend.sample()] == [Health.OK, Health.LOST, Health.OK]
    _reload_without(nv, 1)
    clock.now += 1.0  # the re-init is due
    with structlog.testing.capture_logs() as logs, pytest.raises(InventoryChanged) as exc:
        backend.sample()
    # the process exits with gpulb-agent's "read the GPUs again" status
    from agent.main import EXIT_REREAD as MAIN_EXIT_REREAD

    assert exc.value.code == EXIT_REREAD == MAIN_EXIT_REREAD == 75
    assert "NVML lists 2 GPU(s), this process registered 3" in str(exc.value)
    assert any(e["event"] == "gpu_inventory_changed" and e["exit_code"] == 75 for e in logs)
    assert backend._gpus[1].lost  # never re-opened at index 1 (now GPU 2)
    with pytest.raises(InventoryChanged):  # and it keeps saying so
        backend.sample()
    backend.close()
    assert nv.shutdown_calls >= 2 and not nv.initialized


def test_a_gpu_whose_uuid_is_missing_stays_lost_while_its_index_is_unreadable() -> None:
    """The GPU is still off the bus (its index answers GPU_IS_LOST), the
    count is the same: not a new inventory; it stays LOST, the others
    report, and a later re-init finds it by UUID."""
    nv, clock = _three_gpus(), FakeClock()
    backend = NvmlBackend(nvml=nv, clock=clock)
    nv.gpus[1].lost = True
    backend.sample()
    clock.now += 1.0
    assert [(s.health, s.util_gpu_pct) for s in backend.sample()] == [(Health.OK, 11), (Health.LOST, None), (Health.OK, 33)]
    nv.gpus[1].lost = False
    clock.now += 2.0
    assert [(s.health, s.util_gpu_pct) for s in backend.sample()] == [(Health.OK, 11), (Health.OK, 22), (Health.OK, 33)]


def test_another_gpu_at_a_lost_gpus_index_is_a_changed_inventory_not_its_readings() -> None:
    """Same count, but the card at index 1 is another one (swapped during
    the outage): its UUID is not registered."""
    nv, clock = _three_gpus(), FakeClock()
    backend = NvmlBackend(nvml=nv, clock=clock)
    nv.gpus[1].lost = True
    backend.sample()
    nv.gpus[1].lost, nv.gpus[1].uuid, nv.gpus[1].util_gpu = False, "GPU-fake-new", 99
    clock.now += 1.0
    with pytest.raises(InventoryChanged, match="GPU index 1 is GPU-fake-new"):
        backend.sample()


def test_the_agent_process_exits_75_when_the_gpus_change(tmp_path: Path) -> None:
    """The real entry point (gpulb-agent, NVML replaced by the fake): a
    re-init that finds 2 of 3 GPUs ends the process with status 75, which
    systemd restarts to register the GPUs as they are."""
    script = tmp_path / "agent_renumber.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        import agent.nvml as nvml_mod
        from agent.fake_nvml import FakeNvml

        nv = FakeNvml.with_gpus(3)
        t0 = time.monotonic()

        class Fake(FakeNvml):
            pass

        real_util = nv.nvmlDeviceGetUtilizationRates
        def util(handle):
            if time.monotonic() - t0 > 1.0 and len(nv.gpus) == 3:
                nv.gpus[1].lost = True  # falls off the bus after 1 s ...
            return real_util(handle)
        nv.nvmlDeviceGetUtilizationRates = util
        real_init = nv.nvmlInit
        def init():  # ... and the driver comes back without it
            if nv.init_calls >= 1 and len(nv.gpus) == 3:
                del nv.gpus[1]
            real_init()
        nv.nvmlInit = init

        class Patched(nvml_mod.NvmlBackend):
            def __init__(self, nvml=None, **kw):
                super().__init__(nvml=nv if nvml is None else nvml, **kw)
        nvml_mod.NvmlBackend = Patched
        from agent.main import main
        sys.exit(main())
    """))
    run = subprocess.run(
        [sys.executable, str(script), "--coordinator", NOBODY, "--node-id", "renumbered", "--backend", "nvml",
         "--interval-max", "0.5", "--log-format", "json"],
        capture_output=True, text=True, timeout=30, cwd=ROOT,
    )
    assert run.returncode == 75, run.stdout[-2000:] + run.stderr[-2000:]
    assert "gpu_inventory_changed" in run.stderr and "NVML lists 2 GPU(s)" in run.stderr


# --- 3. a hung NVML call (QA §3) ---------------------------------------------------------


class HangingNvml(FakeNvml):
    """GPU 1's utilisation read blocks until ``release`` is set."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.release = threading.Event()
        self.hang = False
        self.entered = 0

    def nvmlDeviceGetUtilizationRates(self, handle):
        if handle.index == 1 and self.hang:
            self.entered += 1
            self.release.wait(60)
        return super().nvmlDeviceGetUtilizationRates(handle)


def _bounded(fn, limit_s: float):
    """fn() on a thread; (finished, result, seconds). A round that never
    returns fails the test instead of hanging it."""
    out: list = []
    worker = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    started = time.monotonic()
    worker.start()
    worker.join(limit_s)
    return bool(out), (out[0] if out else None), time.monotonic() - started


def test_a_hung_read_is_read_failed_after_the_deadline_and_the_other_gpus_report() -> None:
    nv = HangingNvml.with_gpus(3)
    nv.gpus[0].util_gpu, nv.gpus[2].util_gpu = 40, 60
    backend = NvmlBackend(nvml=nv, clock=FakeClock())  # the agent's default deadline
    assert backend.read_timeout_s == READ_TIMEOUT_S == 2.0
    try:
        backend.sample()
        nv.hang = True
        threads_before = threading.active_count()
        with structlog.testing.capture_logs() as logs:
            finished, samples, took = _bounded(backend.sample, 5.0)
        assert finished, "sample() waited for the hung GPU"
        assert READ_TIMEOUT_S <= took < READ_TIMEOUT_S + 1.5
        s0, s1, s2 = samples
        assert (s0.health, s0.util_gpu_pct, s2.health, s2.util_gpu_pct) == (Health.OK, 40, Health.OK, 60)
        assert s1.health == Health.READ_FAILED and s1.util_gpu_pct is None
        assert "nvml call timed out" in s1.errors["nvml"] and "utilization" in s1.errors["nvml"]
        assert [e["gpu"] for e in logs if e["event"] == "nvml_call_timed_out"] == [1]
        # later rounds: no second read of GPU 1 while the first is stuck,
        # no wait for it, no thread piling up; the others still report
        for _ in range(5):
            finished, samples, took = _bounded(backend.sample, 5.0)
            assert finished and took < 0.25
            assert [s.health for s in samples] == [Health.OK, Health.READ_FAILED, Health.OK]
        assert nv.entered == 1
        assert threading.active_count() <= threads_before + 1
        # the call returns: GPU 1 is read again next round
        nv.release.set()
        deadline = time.monotonic() + 5
        while backend._stuck() and time.monotonic() < deadline:
            time.sleep(0.01)
        nv.hang = False
        assert [(s.health, s.util_gpu_pct) for s in backend.sample()] == [(Health.OK, 40), (Health.OK, 0), (Health.OK, 60)]
    finally:
        nv.release.set()
        backend.close()


def test_close_does_not_wait_for_a_read_stuck_in_nvml() -> None:
    nv = HangingNvml.with_gpus(2)
    backend = NvmlBackend(nvml=nv, clock=FakeClock())
    nv.hang = True
    try:
        assert _bounded(backend.sample, 5.0)[0], "sample() waited for the hung GPU"
        with structlog.testing.capture_logs() as logs:
            finished, _, took = _bounded(backend.close, 5.0)
        assert finished and took < 1.0
        # NVML left to the process exit rather than shut down under the call
        assert nv.shutdown_calls == 0 and any(e["event"] == "nvml_left_initialised" for e in logs)
        stuck = [t for t in threading.enumerate() if t.name == "nvml-gpu1"]
        assert stuck and all(t.daemon for t in stuck)  # not joined at interpreter exit
    finally:
        nv.release.set()


# --- 4. MIG and NOT_SUPPORTED that does not stick (QA §7) ----------------------------------


def test_check_warns_of_a_mig_gpu_and_still_passes() -> None:
    nv = FakeNvml.with_gpus(2)
    nv.gpus[0].mig_mode = pynvml.NVML_DEVICE_MIG_DISABLE  # MIG-capable, off
    nv.gpus[1].mig_mode = pynvml.NVML_DEVICE_MIG_ENABLE
    nv.gpus[1].memory_used = 4_000 * MIB
    with structlog.testing.capture_logs() as logs:
        backend = NvmlBackend(nvml=nv, clock=FakeClock())
    assert [e["gpu"] for e in logs if e["event"] == "gpu_mig_enabled"] == [1]
    report = run_check(backend, rounds=2, sleep=lambda s: None)
    a, b = report.gpus
    assert (a.mig_enabled, b.mig_enabled) == (False, True)
    assert b.values["util_gpu_pct"] is None and b.values["memory_used_mib"] == 4_000  # memory still works
    text = render_check(report)
    (warning,) = [line for line in text.splitlines() if line.startswith("WARNING: ")]
    assert warning.startswith("WARNING: GPU 1: MIG mode is enabled: gpulb schedules whole GPUs")
    assert "utilisation" in warning and "nvidia-smi -i 1 -mig 0" in warning
    assert report.ok and text.endswith("check: PASS")  # a warning, not a failure
    assert report.to_dict()["warnings"] == [warning.removeprefix("WARNING: ")]
    # a GPU without MIG (consumer card): no MIG verdict, no warning
    plain = run_check(NvmlBackend(nvml=FakeNvml.with_gpus(1)), rounds=1, sleep=lambda s: None)
    assert plain.gpus[0].mig_enabled is None and plain.warnings == []


UTIL = "nvmlDeviceGetUtilizationRates"


def test_the_fakes_mig_mode_takes_utilisation_away() -> None:
    nv = FakeNvml.with_gpus(1)
    nv.gpus[0].util_gpu, nv.gpus[0].mig_mode = 42, pynvml.NVML_DEVICE_MIG_ENABLE
    nv.nvmlInit()
    handle = nv.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nv.nvmlDeviceGetUtilizationRates(handle)
    assert nv.nvmlDeviceGetMigMode(handle) == [1, 1]
    nv.gpus[0].mig_pending = pynvml.NVML_DEVICE_MIG_DISABLE  # takes effect at the next reset
    assert nv.nvmlDeviceGetMigMode(handle) == [1, 0]
    nv.gpus[0].mig_mode = nv.gpus[0].mig_pending = pynvml.NVML_DEVICE_MIG_DISABLE
    assert nv.nvmlDeviceGetUtilizationRates(handle).gpu == 42
    nv.gpus[0].mig_mode = None  # no MIG on this GPU
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nv.nvmlDeviceGetMigMode(handle)


def test_an_unsupported_read_is_asked_again_once_a_minute_so_mig_off_brings_util_back() -> None:
    nv, clock = FakeNvml.with_gpus(1), FakeClock()
    nv.gpus[0].util_gpu = 42
    nv.gpus[0].errors[UTIL] = pynvml.NVML_ERROR_NOT_SUPPORTED  # as under MIG
    backend = NvmlBackend(nvml=nv, clock=clock)
    t0 = clock.now
    assert backend.sample()[0].util_gpu_pct is None
    asked = nv.calls[UTIL]
    del nv.gpus[0].errors[UTIL]  # MIG turned off
    for dt in (1.0, 30.0, REPROBE_S - 0.1):
        clock.now = t0 + dt
        assert backend.sample()[0].util_gpu_pct is None
    assert nv.calls[UTIL] == asked  # not asked within the minute
    clock.now = t0 + REPROBE_S
    assert backend.sample()[0].util_gpu_pct == 42
    # unsupported again: asked again a minute after that, not sooner
    nv.gpus[0].errors[UTIL] = pynvml.NVML_ERROR_NOT_SUPPORTED
    clock.now += 1.0
    t1 = clock.now
    assert backend.sample()[0].util_gpu_pct is None
    asked = nv.calls[UTIL]
    for dt in (1.0, REPROBE_S - 0.1):
        clock.now = t1 + dt
        backend.sample()
    assert nv.calls[UTIL] == asked
    clock.now = t1 + REPROBE_S
    backend.sample()
    assert nv.calls[UTIL] == asked + 1


def test_a_reinit_forgets_what_was_unsupported() -> None:
    nv, clock = FakeNvml.with_gpus(2), FakeClock()
    nv.gpus[0].util_gpu = 42
    nv.gpus[0].errors[UTIL] = pynvml.NVML_ERROR_NOT_SUPPORTED  # as under MIG
    backend = NvmlBackend(nvml=nv, clock=clock)
    assert backend.sample()[0].util_gpu_pct is None
    del nv.gpus[0].errors[UTIL]  # MIG off, with a GPU reset ...
    nv.gpus[1].lost = True  # ... during which NVML lost a GPU
    backend.sample()
    nv.gpus[1].lost = False
    clock.now += 1.0  # the re-init: well within the minute
    assert [s.util_gpu_pct for s in backend.sample()] == [42, 0]


# --- 5. SIGTERM while an NVML call hangs (QA §12) -------------------------------------------


def test_sigterm_stops_the_agent_promptly_while_an_nvml_call_hangs(tmp_path: Path) -> None:
    script = tmp_path / "agent_hang.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        import agent.nvml as nvml_mod
        from agent.fake_nvml import FakeNvml

        T0 = time.monotonic()

        class Fake(FakeNvml):
            def nvmlDeviceGetUtilizationRates(self, handle):
                if handle.index == 1 and time.monotonic() - T0 > 1.0:
                    print("HANGING", file=sys.stderr, flush=True)
                    time.sleep(120)  # a wedged driver
                return super().nvmlDeviceGetUtilizationRates(handle)

        class Patched(nvml_mod.NvmlBackend):
            def __init__(self, nvml=None, **kw):
                super().__init__(nvml=Fake.with_gpus(2) if nvml is None else nvml, **kw)
        nvml_mod.NvmlBackend = Patched
        from agent.main import main
        sys.exit(main())
    """))
    err = tmp_path / "agent.err"
    with open(err, "w") as fh:
        proc = subprocess.Popen(
            [sys.executable, str(script), "--coordinator", NOBODY, "--node-id", "hang1", "--backend", "nvml",
             "--interval-max", "0.5", "--log-format", "json"],
            stdout=subprocess.DEVNULL, stderr=fh, cwd=ROOT,
        )
    try:
        deadline = time.monotonic() + 30
        while "HANGING" not in err.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "HANGING" in err.read_text(), err.read_text()[-2000:]
        time.sleep(0.5)  # well inside the stuck call
        sent = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        try:
            rc = proc.wait(timeout=8)
        except subprocess.TimeoutExpired:
            pytest.fail("the agent did not exit within 8 s of SIGTERM while NVML hung")
        assert rc == 0 and time.monotonic() - sent < 5, err.read_text()[-2000:]
        assert "agent_stopped" in err.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
