"""What an on-call operator reads, from QA pass 24 ("running it for a month").

* Every service line is JSON: what the scheduler and libraries log through
  the standard library too (it came out as a bare message, no level or time),
  and gRPC's C core no longer writes its own "I1201 ... Handshake failed"
  lines per reconnect attempt.
* ``/metrics`` says what the process does over a month (memory, open files,
  start time, release, whether the last reload was applied) and is gzipped
  when Prometheus asks.
* A reload whose file edits a variable or flag overrides says so, and
  ``--print-config`` shows the warnings the daemon would log.
"""

from __future__ import annotations

import asyncio
import gzip
import io
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest
import structlog
from prometheus_client.parser import text_string_to_metric_families

from coordinator import main as coordinator_main
from coordinator.config import CoordinatorConfig
from coordinator.demo import free_port
from coordinator.security import Security
from coordinator.server import Coordinator
from protos.runtime import configure_logging
from waiting import CoordinatorProcess

pytestmark = pytest.mark.timeout(90)


def test_standard_library_log_lines_are_json_with_level_time_and_logger() -> None:
    saved = structlog.get_config()
    root = logging.getLogger()
    before = list(root.handlers), root.level
    out = io.StringIO()
    try:
        configure_logging("info", "json", stream=out)
        logging.getLogger("scheduler.engine").warning("preemption lapsed for %s", "urgent")
        logging.getLogger("scheduler.engine").info("lost %d tasks", 2)  # the project's own info is kept
        logging.getLogger("some.library").info("chatter")  # a library's is not
        try:
            raise ZeroDivisionError("x")
        except ZeroDivisionError:
            logging.getLogger("scheduler.engine").exception("task listener failed")
    finally:
        root.handlers[:], _ = before[0], root.setLevel(before[1])
        structlog.configure(**saved)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(e["event"], e["level"], e["logger"]) for e in lines] == [
        ("preemption lapsed for urgent", "warning", "scheduler.engine"),
        ("lost 2 tasks", "info", "scheduler.engine"),
        ("task listener failed", "error", "scheduler.engine"),
    ]
    assert all("timestamp" in e for e in lines)
    assert "ZeroDivisionError" in lines[2]["exception"]


def test_grpc_core_lines_stay_out_of_the_daemons_output() -> None:
    """A TLS client against a plaintext port: gRPC's core wrote an
    "I... Handshake failed" line per attempt to stderr, outside the JSON log."""
    script = textwrap.dedent("""
        import socket, threading
        import agent  # the package the daemon runs from, imported first as it is
        import grpc
        s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(); port = s.getsockname()[1]
        def serve():
            while True:
                c, _ = s.accept(); c.send(b"HTTP/1.1 400 no\\r\\n\\r\\n"); c.close()
        threading.Thread(target=serve, daemon=True).start()
        channel = grpc.secure_channel(f"127.0.0.1:{port}", grpc.ssl_channel_credentials())
        try:
            grpc.channel_ready_future(channel).result(timeout=2)
        except grpc.FutureTimeoutError:
            print("refused, as it should be")
    """)
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert "refused, as it should be" in run.stdout
    assert "Handshake failed" not in run.stderr and "ssl_transport_security" not in run.stderr, run.stderr


async def test_metrics_show_the_process_release_and_reloads_and_are_gzipped_when_asked() -> None:
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", metrics_listen="127.0.0.1:0"), security=Security(insecure=True))
    await coord.start()
    try:
        def get(encoding: str | None) -> tuple[dict, bytes]:
            request = urllib.request.Request(f"http://127.0.0.1:{coord.metrics_port}/metrics")
            if encoding:
                request.add_header("Accept-Encoding", encoding)
            with urllib.request.urlopen(request, timeout=10) as reply:
                return dict(reply.headers), reply.read()

        headers, plain = await asyncio.to_thread(get, None)
        assert "Content-Encoding" not in headers
        headers, packed = await asyncio.to_thread(get, "gzip, deflate")
        assert headers["Content-Encoding"] == "gzip" and len(packed) < len(plain) / 2
        families = {f.name: f for f in text_string_to_metric_families(gzip.decompress(packed).decode())}
        for name in ("process_resident_memory_bytes", "process_open_fds", "process_max_fds", "process_start_time_seconds"):
            assert families[name].samples[0].value > 0, name
        assert families["gpulb_coordinator_info"].samples[0].labels["version"]
        assert families["gpulb_config_last_reload_successful"].samples[0].value == 1
        assert families["gpulb_config_last_reload_success_timestamp_seconds"].samples[0].value > time.time() - 600
    finally:
        await coord.stop(grace_s=0.1)


def test_a_reload_says_which_file_edits_a_variable_overrides_and_when_it_was_rejected(tmp_path: Path) -> None:
    port, mport = free_port(), free_port()
    config = tmp_path / "coordinator.toml"
    config.write_text(f'[coordinator]\nlisten = "127.0.0.1:{port}"\nmetrics_listen = "127.0.0.1:{mport}"\n'
                      'log_format = "json"\ninsecure = true\n\n[scheduler]\npolicy = "load_aware"\n')
    daemon = CoordinatorProcess(config, tmp_path / "coordinator.log", env={"GPULB_SCHEDULER_POLICY": "binpack"})
    coord, events, wait_for = daemon.proc, daemon.events, daemon.wait_for

    def reload_ok() -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        return next(s.value for f in text_string_to_metric_families(text) if f.name == "gpulb_config_last_reload_successful"
                    for s in f.samples)

    try:
        wait_for(lambda: events("coordinator_listening"), "started")
        config.write_text(config.read_text().replace('"load_aware"', '"fgd"'))
        coord.send_signal(signal.SIGHUP)
        wait_for(lambda: events("configuration_reloaded"), "reloaded")
        reloaded = events("configuration_reloaded")[0]
        assert reloaded["overridden"] == {"scheduler.policy": "env:GPULB_SCHEDULER_POLICY"}
        assert reloaded["level"] == "warning" and reloaded["changed"] == {}
        assert reload_ok() == 1

        config.write_text(config.read_text() + "\n[scheduler.nonsense\n")
        coord.send_signal(signal.SIGHUP)
        wait_for(lambda: events("reload_rejected"), "rejected")
        assert reload_ok() == 0
    finally:
        daemon.stop()


def test_print_config_shows_the_warnings_the_daemon_would_log(monkeypatch, capsys) -> None:
    monkeypatch.setenv("GPULB_HEARTBEAT_INTERVAL_SS", "5")
    assert coordinator_main.main(["--insecure", "--print-config"]) == 0
    assert "did you mean GPULB_HEARTBEAT_INTERVAL_S" in capsys.readouterr().err


def test_the_release_names_the_version_and_the_checkouts_commit() -> None:
    """QA pass 24 (upgrades): every commit registered and exported 0.1.0, so
    a rolling upgrade over days could not show which hosts were done."""
    import re

    from agent.client import AGENT_VERSION
    from protos.runtime import _checkout_commit, release

    root = Path(__file__).resolve().parents[1]
    version = release()
    assert re.fullmatch(r"\d+\.\d+\.\d+(\+g[0-9a-f]{10})?", version), version
    assert AGENT_VERSION == version
    commit = _checkout_commit(root / ".git")
    if commit is not None:  # a git checkout (CI runs in a clone)
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True)
        if head.returncode == 0:
            assert commit == head.stdout.strip()
        assert version.endswith("+g" + commit[:10])
    assert _checkout_commit(root / "no-such-dir") is None
