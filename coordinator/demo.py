"""``gpulb demo``: a coordinator and simulated agents as real processes on
loopback, then a table of the cluster's GPUs. Every child is stopped on the
way out (also on Ctrl-C); the exit code says whether the cluster came up."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import grpc

from coordinator.tables import fmt, render_table
from protos import cluster_pb2 as cpb
from protos import cluster_pb2_grpc as cpb_grpc

__all__ = ["run_demo", "free_port", "ProcessGroup", "add_demo_arguments"]


def add_demo_arguments(demo: argparse.ArgumentParser) -> None:
    demo.add_argument("--agents", type=int, default=3, help="simulated hosts")
    demo.add_argument("--gpus-per-agent", type=int, default=4)
    demo.add_argument("--duration", type=float, default=4.0, help="s to stream before the summary")
    demo.add_argument("--no-live", action="store_true", help="no live table (logs and CI)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ProcessGroup:
    """Children started by the demo, each in its own process group so one
    signal stops it and anything it started."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "wb")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        log.close()
        self.procs.append((name, proc))
        return proc

    def stop_all(self, grace_s: float = 8.0) -> list[tuple[str, int | None]]:
        """SIGTERM everyone, wait up to ``grace_s``, SIGKILL the rest."""
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        for _, proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        return [(name, proc.returncode) for name, proc in self.procs]


def _wait_for_gpus(target: str, count: int, timeout_s: float) -> list[cpb.Gpu]:
    deadline = time.monotonic() + timeout_s
    gpus: list[cpb.Gpu] = []
    with grpc.insecure_channel(target) as ch:
        stub = cpb_grpc.ClusterOperatorStub(ch)
        while time.monotonic() < deadline:
            try:
                gpus = list(stub.ListGpus(cpb.ListGpusRequest(), timeout=2).gpus)
            except grpc.RpcError:
                gpus = []
            if len([g for g in gpus if g.HasField("util_gpu_pct")]) >= count:
                return gpus
            time.sleep(0.2)
    return gpus


def run_demo(args: argparse.Namespace) -> int:
    port = free_port()
    target = f"127.0.0.1:{port}"
    expected = args.agents * args.gpus_per_agent
    py = sys.executable
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gpulb-demo-")))
        group = ProcessGroup(tmp)
        try:
            print(f"starting coordinator on {target} and {args.agents} simulated agents ({args.gpus_per_agent} x RTX 4090 each)")
            group.start("coordinator", [py, "-m", "coordinator.main", "--listen", target, "--log-format", "json"])
            for i in range(args.agents):
                group.start(
                    f"agent-{i + 1}",
                    [py, "-m", "agent.main", "--coordinator", target, "--node-id", f"sim-{i + 1:02d}", "--backend", "sim",
                     "--sim-gpus", str(args.gpus_per_agent), "--sim-seed", str(i + 1), "--log-format", "json"],
                )
            gpus = _wait_for_gpus(target, expected, timeout_s=30)
            ok = len(gpus) >= expected
            if ok:
                time.sleep(max(0.0, args.duration))
                gpus = _wait_for_gpus(target, expected, timeout_s=5)
            rows = [
                [g.node_id, g.index, fmt(g.util_gpu_pct if g.HasField("util_gpu_pct") else None, 0, "%"),
                 f"{g.memory_used_mib / 1024:.1f}/{g.memory_total_mib / 1024:.1f}" if g.HasField("memory_used_mib") else "-",
                 fmt(g.temperature_c if g.HasField("temperature_c") else None, 0),
                 fmt(g.power_w if g.HasField("power_w") else None, 0)]
                for g in gpus
            ]
            print(render_table(["NODE", "GPU", "UTIL", "MEM GiB", "TEMP C", "POWER W"], rows))
            print(f"{len(gpus)} of {expected} GPUs reporting")
        except KeyboardInterrupt:
            ok = False
            print("interrupted")
        finally:
            results = group.stop_all()
        unclean = [(n, rc) for n, rc in results if rc not in (0, -signal.SIGTERM)]
        for name, rc in unclean:
            print(f"{name} exited with {rc}; its log:")
            print((tmp / f"{name}.log").read_text()[-2000:])
        print("all processes stopped" if not unclean else "some processes did not stop cleanly")
        return 0 if ok and not unclean else 1
