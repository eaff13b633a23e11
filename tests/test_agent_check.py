"""``gpulb-agent --check``: the pre-flight an operator runs on a GPU host
before enabling the service, against the shipped fake NVML and the simulator;
and the NVML backend's parallel rounds that keep a many-GPU host inside the
fastest sampling period."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pynvml
import pytest
import structlog

from agent import main as agent_main
from agent.backend import BackendError
from agent.check import render_check, run_check
from agent.fake_nvml import MIB, FakeNvml, FakeProcess
from agent.nvml import NvmlBackend


def _gpus() -> FakeNvml:
    nv = FakeNvml.with_gpus(2)
    a, b = nv.gpus
    a.util_gpu, a.memory_used = 91, 20_000 * MIB
    a.processes = [FakeProcess(4242, 19_000 * MIB)]
    # a consumer card: no ECC
    a.errors["nvmlDeviceGetTotalEccErrors"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    b.name = "NVIDIA H200"
    b.memory_total = 143_771 * MIB
    b.memory_reserved = 615 * MIB  # as read on one (driver 580)
    b.memory_used = 615 * MIB
    b.errors["nvmlDeviceGetTemperature"] = pynvml.NVML_ERROR_UNKNOWN
    return nv


class SteppedClock:
    """perf_counter stand-in: each backend.sample() takes ``round_s``."""

    def __init__(self, round_s: float) -> None:
        self.now, self.round_s, self.calls = 0.0, round_s, 0

    def __call__(self) -> float:
        self.calls += 1
        if self.calls % 2 == 0:  # the second read of a pair closes a round
            self.now += self.round_s
        return self.now


def test_check_reports_each_field_as_read_missing_or_failing() -> None:
    backend = NvmlBackend(nvml=_gpus())
    slept: list[float] = []
    report = run_check(backend, rounds=3, interval_min_s=0.2, sleep=slept.append, clock=SteppedClock(0.004))
    a, b = report.gpus
    assert (a.model, a.known_model, a.speed_prior) == ("NVIDIA GeForce RTX 4090", "RTX 4090", 1.0)
    assert a.values["util_gpu_pct"] == 91 and a.values["memory_used_mib"] == 20_000
    assert a.values["ecc_corrected"] is None and "ecc_corrected" not in a.errors  # not reported, no error
    assert a.processes == [(4242, 19_000)]
    assert a.values["xid_last"] == 0  # watched for Xid events, none seen
    assert (b.memory_total_mib, b.memory_reserved_mib, b.known_model) == (143_771, 615, "H200")
    assert b.values["memory_used_mib"] == 615  # v1: the reservation counts as used
    assert a.memory_reserved_mib is None  # a driver without the v2 call
    assert b.values["temperature_c"] is None and "Unknown" in b.errors["temperature_c"]
    assert a.health == b.health == "OK"  # one failing read is not a failing GPU
    # the fake is instant, and the clock says each round took 4 ms
    assert report.round_ms == pytest.approx([4.0, 4.0, 4.0])
    assert slept == pytest.approx([0.196, 0.196])  # start to start, 200 ms
    assert report.ok
    # reads timed per GPU; an unsupported read is never timed
    assert "utilization" in a.read_ms and "ecc_corrected" not in a.read_ms
    assert "temperature" in b.read_ms  # failed, but it was a call that took time
    text = render_check(report)
    assert "not reported" in text and "error: Unknown" in text and "check: PASS" in text
    assert "counts the driver's reservation" in text
    data = json.loads(report.to_json())
    assert data["ok"] is True and data["gpus"][1]["model"] == "NVIDIA H200"


def test_check_names_the_driver_and_leaves_out_what_the_library_cannot_tell() -> None:
    nv = _gpus()
    nv.driver_version, nv.cuda_driver_version = "580.159.04", 13000
    report = run_check(NvmlBackend(nvml=nv), rounds=1, sleep=lambda s: None)
    assert report.driver_version == "580.159.04, CUDA 13.0"
    assert "NVIDIA driver 580.159.04, CUDA 13.0" in render_check(report).splitlines()[0]
    assert json.loads(report.to_json())["driver_version"] == "580.159.04, CUDA 13.0"

    nv = _gpus()
    nv.driver_version, nv.cuda_driver_version = "535.288.01", 12020
    assert run_check(NvmlBackend(nvml=nv), rounds=1, sleep=lambda s: None).driver_version == "535.288.01, CUDA 12.2"

    nv = _gpus()
    nv.cuda_driver_version = None  # an old library: the call is not there
    assert run_check(NvmlBackend(nvml=nv), rounds=1, sleep=lambda s: None).driver_version == "580.159.04"
    nv = _gpus()
    nv.driver_version = nv.cuda_driver_version = None
    report = run_check(NvmlBackend(nvml=nv), rounds=1, sleep=lambda s: None)
    assert report.driver_version == "" and "driver" not in render_check(report).splitlines()[0]
    assert report.ok  # not knowing the driver fails nothing


def test_check_fails_a_lost_gpu_and_a_round_too_slow_for_the_fastest_period() -> None:
    nv = _gpus()
    nv.gpus[1].lost = True
    report = run_check(NvmlBackend(nvml=nv), rounds=2, interval_min_s=0.2, sleep=lambda s: None, clock=SteppedClock(0.001))
    assert [g.health for g in report.gpus] == ["OK", "LOST"]
    assert report.round_fits and not report.ok
    assert "GPU 1 LOST" in render_check(report)

    slow = run_check(NvmlBackend(nvml=_gpus()), rounds=2, interval_min_s=0.2, sleep=lambda s: None, clock=SteppedClock(0.120))
    assert slow.healthy and not slow.round_fits and not slow.ok  # 120 ms > half of 200 ms
    assert "TOO SLOW" in render_check(slow)
    # the same round is fine for an agent that samples at most every 500 ms
    assert run_check(NvmlBackend(nvml=_gpus()), rounds=2, interval_min_s=0.5, sleep=lambda s: None, clock=SteppedClock(0.120)).ok


def test_parallel_rounds_read_the_same_values_as_serial_ones() -> None:
    serial = NvmlBackend(nvml=_gpus(), parallel=False)
    parallel = NvmlBackend(nvml=_gpus(), parallel=True)
    assert parallel.parallel and not serial.parallel
    for _ in range(3):
        assert parallel.sample() == serial.sample()
    # one GPU is read on a thread of its own too (its deadline needs it),
    # but there is nothing to read in parallel with it
    assert not NvmlBackend(nvml=FakeNvml.with_gpus(1), parallel=True).parallel
    assert NvmlBackend(nvml=_gpus()).parallel  # the default, fake NVML or real
    parallel.close()
    with pytest.raises(BackendError, match="closed"):
        parallel.sample()


@pytest.fixture
def logging_restored():
    """main() configures structlog onto the captured stdout, which pytest
    closes after the test: put the configuration back for the tests after."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


def test_command_line_check_on_the_simulator_and_without_a_driver(capsys, logging_restored) -> None:
    assert agent_main.main(["--check", "--no-coordinator", "--backend", "sim", "--sim-gpus", "3", "--check-rounds", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["backend"] == "sim" and len(data["gpus"]) == 3 and data["ok"] is True
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        assert agent_main.main(["--check", "--no-coordinator", "--backend", "nvml"]) == 2
        assert "cannot start" in capsys.readouterr().err
        return
    pynvml.nvmlShutdown()
    pytest.skip("this host has a working NVML driver")


NO_NVML = "NVML did not initialise: NVML Shared Library Not Found"  # as on a host without the driver


@pytest.fixture
def host_without_nvml(monkeypatch):
    """NVML fails the way it does on a host without the driver, whatever
    this host has."""
    from agent import nvml
    from agent.backend import BackendUnavailable

    def unavailable(*args, **kwargs):
        raise BackendUnavailable(NO_NVML)

    monkeypatch.setattr(nvml, "NvmlBackend", unavailable)


def test_a_check_on_gpus_simulated_for_want_of_nvml_fails() -> None:
    """The report of a check whose backend auto fell back to the simulator:
    every simulated GPU reads OK and a round fits, yet it is no pre-flight of
    this host's GPUs, so it fails and says why, in the table and the JSON."""
    from agent.sim import SimBackend

    report = run_check(SimBackend(gpus=2, seed=1), rounds=1, sleep=lambda s: None, nvml_error=NO_NVML)
    assert report.healthy and report.round_fits and report.simulated_instead_of_nvml and not report.ok
    text = render_check(report)
    assert text.splitlines()[0].startswith("backend sim (auto: NVML unusable, so SIMULATED GPUs): 2 GPU(s)")
    verdict = next(line for line in text.splitlines() if line.startswith("backend: FAIL: "))
    assert "SIMULATED" in verdict and NO_NVML in verdict and "--backend nvml" in verdict
    assert text.endswith("check: FAIL")
    data = json.loads(report.to_json())
    assert data["ok"] is False and data["nvml_error"] == NO_NVML and data["simulated_instead_of_nvml"] is True
    # the simulator asked for by name is what was asked for: it passes
    asked = run_check(SimBackend(gpus=2, seed=1), rounds=1, sleep=lambda s: None)
    assert asked.ok and not asked.simulated_instead_of_nvml and "SIMULATED" not in render_check(asked)


def test_the_default_backend_without_nvml_is_not_ready(host_without_nvml, capsys, logging_restored) -> None:
    """`gpulb-agent --check` (backend auto) on a host without NVML said PASS,
    exit 0, from simulated GPUs (QA pass 23, first run): now exit 1 and a
    FAIL line naming NVML's error, and "ok": false in the JSON; with
    --backend sim, asked for, it still passes."""
    base = ["--check", "--no-coordinator", "--check-rounds", "1", "--sim-gpus", "2"]
    assert agent_main.main(base) == 1
    captured = capsys.readouterr()
    assert f"NVML could not be used ({NO_NVML})" in captured.out and captured.out.rstrip().endswith("check: FAIL")
    assert "SIMULATING_GPUS" in captured.err  # the log line, as the daemon says it

    assert agent_main.main([*base, "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert (data["backend"], data["ok"], data["nvml_error"]) == ("sim", False, NO_NVML)

    assert agent_main.main([*base, "--backend", "sim"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("check: PASS")


async def test_check_asks_the_coordinator_the_agents_way(capsys, logging_restored) -> None:
    """A real coordinator on loopback: SERVING passes; a port nobody listens
    on fails the check and says why."""
    import asyncio

    from coordinator.config import CoordinatorConfig
    from coordinator.demo import free_port
    from coordinator.server import Coordinator

    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0"))
    port = await coord.start()
    try:
        base = ["--check", "--backend", "sim", "--sim-gpus", "1", "--check-rounds", "1"]
        rc = await asyncio.to_thread(agent_main.main, [*base, "--coordinator", f"127.0.0.1:{port}", "--json"])
        out = capsys.readouterr().out  # the coordinator's own log lines come first
        data, _ = json.JSONDecoder().raw_decode(out[out.index("{\n"):])
        assert rc == 0 and data["ok"] is True
        assert data["coordinator"] == {"ok": True, "detail": f"127.0.0.1:{port}: gpulb.v1.AgentGateway SERVING"}
        rc = await asyncio.to_thread(agent_main.main, [*base, "--coordinator", f"127.0.0.1:{free_port()}"])
        out = capsys.readouterr().out
        assert rc == 1 and "coordinator: NOT READY" in out and "UNAVAILABLE" in out and out.rstrip().endswith("check: FAIL")
    finally:
        await coord.stop(grace_s=0.1)


async def test_check_uses_the_agents_tls_and_certificate(tmp_path, logging_restored) -> None:
    """Over mutual TLS on the agent port: the agent's certificate gets
    SERVING; without one the handshake fails and the check says so."""
    import asyncio

    from certs import make_test_pki
    from coordinator.config import CoordinatorConfig
    from coordinator.demo import free_port
    from coordinator.server import Coordinator
    from agent.check import check_coordinator
    from coordinator.main import build_security
    from coordinator.security import hash_token

    pki = make_test_pki(tmp_path / "pki", ("gpu-host",))
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(f'[tokens."{hash_token("tok-agent")}"]\nrole = "agent"\nname = "agents"\nnodes = ["gpu-host"]\n')
    agent_port = free_port()
    cfg = CoordinatorConfig(
        listen="127.0.0.1:0", agent_listen=f"127.0.0.1:{agent_port}",
        tls_cert_file=str(pki.server.cert_file), tls_key_file=str(pki.server.key_file),
        tls_client_ca_file=str(pki.ca_file), token_file=str(tokens), insecure=False,
    )
    coord = Coordinator(cfg, security=build_security(cfg))  # as gpulb-coordinator builds it
    await coord.start()
    try:
        target = f"localhost:{agent_port}"
        pair = pki.agents["gpu-host"]
        ok, detail = await asyncio.to_thread(
            check_coordinator, target, ca_file=str(pki.ca_file), cert_file=str(pair.cert_file),
            key_file=str(pair.key_file), token="tok-agent",
        )
        assert ok, detail
        ok, detail = await asyncio.to_thread(check_coordinator, target, ca_file=str(pki.ca_file))
        assert not ok and "UNAVAILABLE" in detail
        ok, detail = await asyncio.to_thread(check_coordinator, target, ca_file=str(tmp_path / "missing.pem"))
        assert not ok and detail.startswith("TLS files unusable")
    finally:
        await coord.stop(grace_s=0.1)


def test_check_says_how_it_ran_against_how_the_unit_runs_the_agent() -> None:
    """A check as root without W^X can pass where the service (User=gpulb,
    MemoryDenyWriteExecute=yes) fails: it says so and how to check the unit's
    way; run the unit's way, it says nothing more. Informational: the verdict
    stays the devices'."""
    import dataclasses
    import pwd

    from agent.check import UNIT_CHECK_COMMAND

    report = run_check(NvmlBackend(nvml=_gpus()), rounds=1, sleep=lambda s: None)
    assert report.process_user == pwd.getpwuid(os.geteuid()).pw_name
    assert report.write_xor_execute in (True, False)
    assert report.seccomp_filter is False  # pytest runs unconfined
    as_root = dataclasses.replace(report, process_user="root", write_xor_execute=False)
    line = next(l for l in render_check(as_root).splitlines() if l.startswith("process: "))
    assert line.startswith("process: user root, W^X not enforced, no seccomp filter") and UNIT_CHECK_COMMAND in line
    as_unit = dataclasses.replace(report, process_user="gpulb", write_xor_execute=True, seccomp_filter=True)
    line = next(l for l in render_check(as_unit).splitlines() if l.startswith("process: "))
    assert line == "process: user gpulb, W^X enforced, seccomp filter"
    # the unit's user under W^X but without its system-call filter is not the unit's way either
    unfiltered = dataclasses.replace(as_unit, seccomp_filter=False)
    line = next(l for l in render_check(unfiltered).splitlines() if l.startswith("process: "))
    assert line.startswith("process: user gpulb, W^X enforced, no seccomp filter (") and UNIT_CHECK_COMMAND in line
    assert render_check(as_root).endswith("check: PASS") and render_check(as_unit).endswith("check: PASS")


def test_the_readme_gives_the_units_check_command_the_check_prints() -> None:
    from agent.check import UNIT_CHECK_COMMAND

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert f"sudo {UNIT_CHECK_COMMAND}\n" in readme


def test_the_check_sees_write_xor_execute_when_it_is_in_force() -> None:
    import subprocess
    import sys

    from coordinator.demo import can_deny_write_execute
    from coordinator.sandbox import launcher_argv

    if not can_deny_write_execute():
        pytest.skip("the kernel cannot enforce W^X on a process (PR_SET_MDWE, Linux < 6.3)")
    argv = [sys.executable, "-m", "agent.main", "--check", "--backend", "sim", "--check-rounds", "1", "--no-coordinator", "--json"]
    under_wx = subprocess.run(launcher_argv(argv, write_xor_execute=True), capture_output=True, text=True, timeout=60)
    plain = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert json.loads(under_wx.stdout)["write_xor_execute"] is True, under_wx.stdout + under_wx.stderr
    assert json.loads(plain.stdout)["write_xor_execute"] is False
