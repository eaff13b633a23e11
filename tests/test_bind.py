"""One coordinator per port, and a listener that cannot bind ends the start
cleanly: one log line naming the option and the address, a non-zero exit, no
traceback, and nothing half-started (no port bound, the state directory
unlocked). gRPC sets SO_REUSEPORT by default, so a second coordinator on the
port used to start too and take half the agents and clients."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.config import CoordinatorConfig
from coordinator.demo import free_port
from coordinator.server import Coordinator, ListenError
from coordinator.state import open_state_dir

pytestmark = pytest.mark.timeout(60)


def _held_port() -> socket.socket:
    """A listening socket on a loopback port (no SO_REUSEPORT), as another process would hold it."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _run_coordinator(tmp_path: Path, *flags: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """Run ``gpulb-coordinator`` expecting it to refuse to start: its result and JSON log events."""
    argv = [sys.executable, "-m", "coordinator.main", "--insecure", "--log-format", "json",
            "--state-dir", str(tmp_path / "second"), *flags]
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=30, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    except subprocess.TimeoutExpired as exc:  # killed by run()
        pytest.fail(f"the coordinator started and kept running: {(exc.stderr or b'')[-2000:]!r}")
    events = []
    for line in (result.stdout + result.stderr).splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            pass
    return result, events


async def test_a_second_coordinator_on_the_port_fails_to_bind_and_exits(tmp_path: Path) -> None:
    port = free_port()
    first = Coordinator(CoordinatorConfig(listen=f"127.0.0.1:{port}"), store=open_state_dir(tmp_path / "first"))
    assert await first.start() == port
    try:
        result, events = _run_coordinator(tmp_path, "--listen", f"127.0.0.1:{port}")
    finally:
        await first.stop(0)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    failed = [e for e in events if e.get("event") == "listen_failed"]
    assert len(failed) == 1, output
    assert failed[0]["option"] == "listen" and failed[0]["address"] == f"127.0.0.1:{port}", failed
    assert failed[0]["error"] == "address already in use", failed
    assert not [e for e in events if e.get("event") == "coordinator_listening"], output
    assert "Traceback" not in output and "Event loop is closed" not in output, output


@pytest.mark.parametrize("address", ["held", "256.1.1.1:9999"])
def test_a_metrics_listener_that_cannot_bind_fails_the_start_cleanly(tmp_path: Path, address: str) -> None:
    with _held_port() as held:
        if address == "held":
            address = f"127.0.0.1:{held.getsockname()[1]}"
        port = free_port()
        result, events = _run_coordinator(tmp_path, "--listen", f"127.0.0.1:{port}", "--metrics-listen", address)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    failed = [e for e in events if e.get("event") == "listen_failed"]
    assert len(failed) == 1 and failed[0]["option"] == "metrics_listen" and failed[0]["address"] == address, output
    expected = "address already in use" if address.startswith("127.") else "cannot resolve '256.1.1.1'"
    assert failed[0]["error"].startswith(expected), failed
    assert "Traceback" not in output and "Event loop is closed" not in output, output
    assert not [e for e in events if e.get("event") == "coordinator_listening"], output


async def test_a_failed_start_leaves_nothing_bound_running_or_locked(tmp_path: Path) -> None:
    port = free_port()
    with _held_port() as held:
        metrics = f"127.0.0.1:{held.getsockname()[1]}"
        coordinator = Coordinator(CoordinatorConfig(listen=f"127.0.0.1:{port}", metrics_listen=metrics),
                                  store=open_state_dir(tmp_path / "state"))
        with pytest.raises(ListenError) as info:
            await coordinator.start()
    err = info.value
    assert (err.option, err.address, err.reason) == ("metrics_listen", metrics, "address already in use")
    assert str(err) == f"metrics_listen {metrics}: cannot listen: address already in use"
    # the gRPC port it had bound is free again, no loop was started, and the
    # state directory can be opened (its lock was released)
    assert _bindable(port)
    assert coordinator._server is None and coordinator._smoother is None and not coordinator._background
    open_state_dir(tmp_path / "state").close()
    await coordinator.stop()  # a stop after a failed start is a no-op


async def test_listen_in_use_names_listen_and_agent_listen_names_itself(tmp_path: Path) -> None:
    with _held_port() as held:
        taken = f"127.0.0.1:{held.getsockname()[1]}"
        metrics = free_port()
        coordinator = Coordinator(CoordinatorConfig(listen=taken, metrics_listen=f"127.0.0.1:{metrics}"),
                                  store=open_state_dir(tmp_path / "state"))
        with pytest.raises(ListenError) as info:
            await coordinator.start()
        assert (info.value.option, info.value.address, info.value.reason) == ("listen", taken, "address already in use")
        open_state_dir(tmp_path / "state").close()  # unlocked
        assert _bindable(metrics) and coordinator._metrics_server is None  # the metrics listener it had started is closed

        port = free_port()
        coordinator = Coordinator(CoordinatorConfig(listen=f"127.0.0.1:{port}", agent_listen=taken))
        with pytest.raises(ListenError) as info:
            await coordinator.start()
        assert (info.value.option, info.value.address) == ("agent_listen", taken)
        assert _bindable(port)  # the listen port bound before it was given back
