"""The NVML backend's worker threads, against the shipped fake NVML: one
long-lived worker per GPU (no thread started per round, the same one reused
once a hung call returns), and no NVML call (a GPU's reads, its MIG mode,
the re-init, the Xid drain) that can hold a round past its deadline."""

from __future__ import annotations

import gc
import threading
import time

import pynvml
import pytest
import structlog

from agent.backend import Health
from agent.fake_nvml import FakeNvml
from agent.nvml import NvmlBackend

#: the backends' read_timeout_s here: a hang is noticed in a second, and a healthy
#: read of the fake (well under 1 ms) never misses it; every bound below is many times it
DEADLINE_S = 1.0
#: how long a test waits for what should take at most a deadline or two
LIMIT_S = 10.0
UTIL = "nvmlDeviceGetUtilizationRates"


class FakeClock:
    def __init__(self) -> None:
        self.now = 500.0

    def __call__(self) -> float:
        return self.now


def _backend(nv: FakeNvml, clock: FakeClock | None = None, **kwargs) -> NvmlBackend:
    return NvmlBackend(nvml=nv, clock=clock or FakeClock(), read_timeout_s=DEADLINE_S, **kwargs)


def _bounded(fn, limit_s: float = LIMIT_S):
    """(finished, result) of fn() run on a thread: a call that never returns
    fails the test instead of hanging it."""
    out: list = []
    worker = threading.Thread(target=lambda: out.append(fn()), name="test-bounded", daemon=True)
    worker.start()
    worker.join(limit_s)
    return bool(out), (out[0] if out else None)


def _until(fn, limit_s: float = LIMIT_S):
    """fn() again and again until it is true or ``limit_s`` passed; its last value."""
    give_up = time.monotonic() + limit_s
    while True:
        value = fn()
        if value or time.monotonic() > give_up:
            return value
        time.sleep(0.01)


@pytest.fixture
def nvml_threads(monkeypatch) -> list[threading.Thread]:
    """Every NVML thread (named nvml-*) started while the test runs."""
    started: list[threading.Thread] = []
    real_start = threading.Thread.start

    def start(self: threading.Thread) -> None:
        if self.name.startswith("nvml-"):
            started.append(self)
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    return started


def _health(samples) -> list:
    return [s.health for s in samples]


# --- one worker per GPU ------------------------------------------------------------


def test_rounds_start_no_thread_each_gpu_is_read_by_one_worker_of_its_own(nvml_threads) -> None:
    nv = FakeNvml.with_gpus(4)
    backend = _backend(nv)
    try:
        backend.sample()
        first = len(nvml_threads)
        assert first <= 4 + 1  # a worker per GPU and the control worker, at most
        readers: dict[int, set[int]] = {i: set() for i in range(4)}
        real_util = nv.nvmlDeviceGetUtilizationRates

        def util(handle):
            readers[handle.index].add(threading.get_ident())
            return real_util(handle)

        nv.nvmlDeviceGetUtilizationRates = util
        for step in range(50):
            nv.gpus[2].util_gpu = step
            samples = backend.sample()
            assert _health(samples) == [Health.OK] * 4 and samples[2].util_gpu_pct == step
        assert len(nvml_threads) == first, "threads started per round"
        assert all(len(idents) == 1 for idents in readers.values())  # the same worker every round
        assert len(set().union(*readers.values())) == 4  # and one per GPU: read in parallel
        assert all(t.is_alive() and t.daemon for t in nvml_threads)  # waiting for the next round
    finally:
        backend.close()


def test_close_ends_the_workers_and_so_does_dropping_the_backend(nvml_threads) -> None:
    backend = _backend(FakeNvml.with_gpus(3))
    backend.sample()
    backend.close()
    for thread in nvml_threads:
        thread.join(LIMIT_S)
    assert nvml_threads and not any(t.is_alive() for t in nvml_threads)
    nvml_threads.clear()
    # a backend nobody closes (a test, a --check that raised) leaves no
    # idle threads behind once it is gone
    dropped = _backend(FakeNvml.with_gpus(3))
    dropped.sample()
    del dropped
    gc.collect()
    for thread in nvml_threads:
        thread.join(LIMIT_S)
    assert nvml_threads and not any(t.is_alive() for t in nvml_threads)


def test_a_serial_backend_starts_no_thread(nvml_threads) -> None:
    backend = _backend(FakeNvml.with_gpus(3), parallel=False)
    for _ in range(3):
        assert _health(backend.sample()) == [Health.OK] * 3
    backend.mig_modes()
    backend.close()
    assert nvml_threads == []


def test_a_worker_whose_call_hung_takes_the_next_reads_once_it_returns(nvml_threads) -> None:
    nv = FakeNvml.with_gpus(3)
    backend = _backend(nv)
    release = threading.Event()
    try:
        backend.sample()
        workers = list(nvml_threads)
        release = nv.hang(UTIL, gpu=1)
        with structlog.testing.capture_logs() as logs:
            finished, samples = _bounded(backend.sample)
        assert finished, "sample() waited for the hung GPU"
        assert _health(samples) == [Health.OK, Health.READ_FAILED, Health.OK]
        assert "nvml call timed out: the utilization read of GPU 1" in samples[1].errors["nvml"]
        assert [(e["gpu"], e["read"]) for e in logs if e["event"] == "nvml_call_timed_out"] == [(1, "utilization")]
        for _ in range(5):
            finished, samples = _bounded(backend.sample)
            assert finished and _health(samples) == [Health.OK, Health.READ_FAILED, Health.OK]
        assert nv.hung[UTIL] == 1  # no second call while the first is stuck
        release.set()
        assert _until(lambda: not backend._stuck())
        nv.gpus[1].util_gpu = 77
        samples = backend.sample()
        assert _health(samples) == [Health.OK] * 3 and samples[1].util_gpu_pct == 77
        assert nvml_threads == workers  # the worker came back to work: none replaced it
    finally:
        release.set()
        backend.close()


# --- re-init, Xid drain and MIG mode under the deadline ----------------------------------


def test_a_hung_nvml_init_does_not_stop_the_rounds_and_is_not_started_twice() -> None:
    nv, clock = FakeNvml.with_gpus(3), FakeClock()
    for i, util in enumerate((11, 22, 33)):
        nv.gpus[i].util_gpu = util
    backend = _backend(nv, clock)
    release = threading.Event()
    try:
        nv.gpus[1].lost = True
        assert _health(backend.sample()) == [Health.OK, Health.LOST, Health.OK]  # a re-init in 1 s
        release = nv.hang("nvmlInit")
        clock.now += 1.0
        with structlog.testing.capture_logs() as logs:
            finished, samples = _bounded(backend.sample)
        assert finished, "sample() waited for nvmlInit"
        # NVML is down for the re-init: nothing can be read until it is back,
        # and the round says so rather than waiting
        assert _health(samples) == [Health.READ_FAILED, Health.LOST, Health.READ_FAILED]
        assert "NVML's re-init (nvmlInit) has not returned" in samples[0].errors["nvml"]
        (timed_out,) = [e for e in logs if e["event"] == "nvml_reinit_timed_out"]
        assert timed_out["call"] == "nvmlInit" and "no second re-init" in timed_out["detail"]
        called = sum(nv.calls.values())
        for _ in range(5):
            clock.now += 100.0  # far past any backoff
            finished, samples = _bounded(backend.sample)
            assert finished and _health(samples) == [Health.READ_FAILED, Health.LOST, Health.READ_FAILED]
        assert nv.hung["nvmlInit"] == 1 and nv.init_calls == 2  # at start, and the hung one: no other
        assert sum(nv.calls.values()) == called  # no call into NVML while it is re-initialised
        # the driver comes back with the GPU: the next round applies the re-init
        nv.gpus[1].lost = False
        release.set()
        samples = _until(lambda: (s := backend.sample()) and all(x.health == Health.OK for x in s) and s)
        assert [(s.health, s.util_gpu_pct) for s in samples] == [(Health.OK, 11), (Health.OK, 22), (Health.OK, 33)]
        assert nv.init_calls == 2  # applied as it was, not started again
        nv.xid(1, 48)  # watched for Xid events again, in the new session
        assert [s.xid_last for s in backend.sample()] == [0, 48, 0]
    finally:
        release.set()
        backend.close()


def test_a_hung_xid_drain_does_not_stall_the_round() -> None:
    nv, clock = FakeNvml.with_gpus(2), FakeClock()
    backend = _backend(nv, clock)
    release = threading.Event()
    try:
        backend.sample()
        release = nv.hang("nvmlEventSetWait_v2")
        nv.gpus[0].util_gpu = 40
        with structlog.testing.capture_logs() as logs:
            finished, samples = _bounded(backend.sample)
        assert finished, "sample() waited for the Xid drain"
        assert [(s.health, s.util_gpu_pct, s.xid_last) for s in samples] == [(Health.OK, 40, 0), (Health.OK, 0, 0)]
        assert [e["call"] for e in logs if e["event"] == "nvml_xid_drain_timed_out"] == ["nvmlEventSetWait_v2"]
        nv.xid(1, 79)  # while the drain hangs
        for step in range(5):
            nv.gpus[0].util_gpu = 50 + step  # the readings keep coming
            finished, samples = _bounded(backend.sample)
            assert finished and [(s.health, s.util_gpu_pct) for s in samples] == [(Health.OK, 50 + step), (Health.OK, 0)]
        assert nv.hung["nvmlEventSetWait_v2"] == 1  # no second drain while the first is stuck
        # a GPU lost meanwhile: the re-init waits for the stuck call
        nv.gpus[1].lost = True
        assert _health(backend.sample()) == [Health.OK, Health.LOST]
        clock.now += 10.0
        assert _health(backend.sample()) == [Health.OK, Health.LOST]
        assert nv.init_calls == 1
        nv.gpus[1].lost = False
        release.set()
        with structlog.testing.capture_logs() as logs:

            def recovered():
                clock.now += 10.0
                samples = backend.sample()
                return samples if [(s.health, s.xid_last) for s in samples] == [(Health.OK, 0), (Health.OK, 79)] else None

            assert _until(recovered), "the Xid taken by the stuck drain, or the GPU, did not come back"
        assert [(e["gpu"], e["xid"]) for e in logs if e["event"] == "gpu_xid"] == [(1, 79)]
        assert nv.init_calls == 2
    finally:
        release.set()
        backend.close()


def test_a_hung_mig_query_holds_up_neither_the_start_nor_the_check() -> None:
    nv, clock = FakeNvml.with_gpus(2), FakeClock()
    nv.gpus[0].mig_mode = pynvml.NVML_DEVICE_MIG_DISABLE
    nv.gpus[1].mig_mode = pynvml.NVML_DEVICE_MIG_ENABLE
    release = nv.hang("nvmlDeviceGetMigMode", gpu=1)
    try:
        with structlog.testing.capture_logs() as logs:
            finished, backend = _bounded(lambda: _backend(nv, clock))
        assert finished, "the backend's start waited for the MIG query"
        assert [(e["gpu"], e["read"]) for e in logs if e["event"] == "nvml_call_timed_out"] == [(1, "mig_mode")]
        samples = backend.sample()
        assert _health(samples) == [Health.OK, Health.READ_FAILED]
        assert "the mig_mode read of GPU 1" in samples[1].errors["nvml"]
        finished, modes = _bounded(backend.mig_modes)
        assert finished and modes == {0: False, 1: None}
        assert nv.calls["nvmlDeviceGetMigMode"] == 3 and nv.hung["nvmlDeviceGetMigMode"] == 1  # GPU 1 asked once
        release.set()
        assert _until(lambda: _health(backend.sample()) == [Health.OK, Health.OK])
        assert backend.mig_modes() == {0: False, 1: True}
    finally:
        release.set()
    backend.close()


@pytest.mark.parametrize("call", ["nvmlInit", "nvmlEventSetWait_v2"])
def test_close_does_not_wait_for_a_hung_reinit_or_xid_drain(call: str) -> None:
    nv, clock = FakeNvml.with_gpus(2), FakeClock()
    backend = _backend(nv, clock)
    if call == "nvmlInit":
        nv.gpus[1].lost = True
        backend.sample()
        clock.now += 1.0  # the re-init is due
    release = nv.hang(call)
    try:
        assert _bounded(backend.sample)[0], "sample() waited for the hung call"
        shutdowns = nv.shutdown_calls
        with structlog.testing.capture_logs() as logs:
            finished, _ = _bounded(backend.close)
        assert finished
        (left,) = [e for e in logs if e["event"] == "nvml_left_initialised"]
        assert call in left["call_stuck"]
        assert nv.shutdown_calls == shutdowns  # not shut down under the stuck call
        stuck = [t for t in threading.enumerate() if t.name == "nvml-control"]
        assert stuck and all(t.daemon for t in stuck)  # not joined at interpreter exit
    finally:
        release.set()
