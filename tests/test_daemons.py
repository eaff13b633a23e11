"""Both daemons as real processes under a fake systemd: READY=1, WATCHDOG=1
pings and STOPPING=1 on SIGTERM over a datagram socket the test owns, and a
SIGHUP reload that changes scheduler weights without dropping agent streams."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from coordinator.demo import free_port
from coordinator.sdnotify import NotifyListener
from protos import cluster_pb2 as cpb
from protos import cluster_pb2_grpc as cpb_grpc
from protos import tasks_pb2 as tpb
from protos import tasks_pb2_grpc as tpb_grpc

pytestmark = pytest.mark.timeout(90)


def _has(messages, text: str) -> bool:
    return any(text in m.text.split("\n") for m in messages)


def _spawn(argv: list[str], notify: str, tmp_path: Path, name: str) -> subprocess.Popen:
    env = {**os.environ, "NOTIFY_SOCKET": notify, "WATCHDOG_USEC": "400000", "PYTHONUNBUFFERED": "1"}
    env.pop("WATCHDOG_PID", None)
    log = open(tmp_path / f"{name}.log", "wb")
    return subprocess.Popen([sys.executable, "-m", *argv], env=env, stdout=log, stderr=subprocess.STDOUT)


def _stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def test_daemons_notify_ready_watchdog_stopping_and_reload_keeps_streams(tmp_path):
    port = free_port()
    config = tmp_path / "coordinator.toml"
    config.write_text(
        f'[coordinator]\nlisten = "127.0.0.1:{port}"\nlog_format = "json"\ninsecure = true\n\n'
        '[scheduler]\npolicy = "load_aware"\nweights = { load = 1.0 }\n'
    )
    with NotifyListener(f"@gpulb-test-coord-{os.getpid()}") as coord_sd, NotifyListener(str(tmp_path / "agent.sock")) as agent_sd:
        coord = _spawn(["coordinator.main", "--config", str(config)], coord_sd.address, tmp_path, "coordinator")
        agent = None
        try:
            coord_sd.wait_for(lambda m: _has(m, "READY=1"), timeout=30)
            coord_sd.wait_for(lambda m: sum(_has([x], "WATCHDOG=1") for x in m) >= 3, timeout=10)
            agent = _spawn(
                ["agent.main", "--coordinator", f"127.0.0.1:{port}", "--node-id", "sd-agent", "--backend", "sim",
                 "--sim-gpus", "2", "--log-format", "json"],
                agent_sd.address,
                tmp_path,
                "agent",
            )
            agent_sd.wait_for(lambda m: _has(m, "READY=1"), timeout=30)
            agent_sd.wait_for(lambda m: sum(_has([x], "WATCHDOG=1") for x in m) >= 3, timeout=10)
            ready = next(m for m in agent_sd.snapshot() if _has([m], "READY=1"))
            assert "streaming 2 sim GPUs" in ready.fields.get("STATUS", "")
            assert ready.pid == agent.pid

            with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                op = cpb_grpc.ClusterOperatorStub(ch)
                sched = tpb_grpc.SchedulerStub(ch)
                deadline = time.monotonic() + 20
                while not [n for n in op.ListNodes(cpb.ListNodesRequest()).nodes if n.state == cpb.NODE_STATE_HEALTHY]:
                    assert time.monotonic() < deadline, "agent never became HEALTHY"
                    time.sleep(0.1)
                envelopes_before = op.GetNode(cpb.GetNodeRequest(node_id="sd-agent")).envelopes
                assert sched.GetPolicy(tpb.GetPolicyRequest()).weights["load"] == 1.0

                # SIGHUP: new weights and policy, same streams.
                config.write_text(config.read_text().replace("weights = { load = 1.0 }", "weights = { load = 2.5, memory = 0.25 }").replace('"load_aware"', '"load_aware"'))
                coord.send_signal(signal.SIGHUP)
                coord_sd.wait_for(lambda m: _has(m, "RELOADING=1"), timeout=10)
                deadline = time.monotonic() + 10
                while sched.GetPolicy(tpb.GetPolicyRequest()).weights["load"] != 2.5:
                    assert time.monotonic() < deadline, "weights not reloaded"
                    time.sleep(0.1)
                policy = sched.GetPolicy(tpb.GetPolicyRequest())
                assert policy.weights["memory"] == 0.25
                placed = sched.ScheduleTask(tpb.ScheduleTaskRequest(spec=tpb.TaskSpec(task_id="after-reload", vram_mib=512)), timeout=10).task
                assert placed.assignment.score.terms["load"] >= 0 and placed.assignment.score.policy == "load_aware"
                node = op.GetNode(cpb.GetNodeRequest(node_id="sd-agent"))
                assert node.state == cpb.NODE_STATE_HEALTHY
                assert node.envelopes >= envelopes_before  # the same stream's count: it was never reset
                reloaded = [m for m in coord_sd.snapshot() if m.fields.get("STATUS", "").startswith("reloaded")]
                assert reloaded, coord_sd.texts()

            assert _stop(agent) == 0
            agent_sd.wait_for(lambda m: _has(m, "STOPPING=1"), timeout=5)
            assert _stop(coord) == 0
            coord_sd.wait_for(lambda m: _has(m, "STOPPING=1"), timeout=5)
        finally:
            if agent is not None:
                _stop(agent)
            _stop(coord)
        log = (tmp_path / "coordinator.log").read_text()
        # one registration: the reload never dropped the agent's stream
        assert log.count('"event": "node_registered"') == 1
        assert '"event": "reconnecting"' not in (tmp_path / "agent.log").read_text()
        assert '"event": "configuration_reloaded"' in log
        # the runtime tuning the ingest benchmark relies on is in force in the real daemon
        runtime = next(json.loads(line) for line in log.splitlines() if '"event": "runtime"' in line)
        assert runtime["event_loop"] == "uvloop" and runtime["gc_threshold"][0] == 50_000
        assert "scheduler.weights" in log


def test_bad_configuration_names_the_option_and_the_file(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text("[coordinator]\nheartbeat_interval_s = \"soon\"\n")
    result = subprocess.run([sys.executable, "-m", "coordinator.main", "--config", str(config)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert str(config) in result.stderr and "heartbeat_interval_s" in result.stderr
    printed = subprocess.run(
        [sys.executable, "-m", "coordinator.main", "--print-config", "--listen", "127.0.0.1:9", "--insecure"],
        capture_output=True, text=True, timeout=30, env={**os.environ, "GPULB_STALENESS_S": "7.5"},
    )
    assert printed.returncode == 0
    assert 'listen = "127.0.0.1:9"' in printed.stdout and "staleness_s = 7.5" in printed.stdout
    assert "env:GPULB_STALENESS_S" in printed.stdout


def test_daemon_refuses_to_start_open_unless_asked(tmp_path):
    result = subprocess.run([sys.executable, "-m", "coordinator.main", "--listen", "127.0.0.1:0"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert "insecure" in result.stderr and "TLS" in result.stderr
