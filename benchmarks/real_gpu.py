"""The agent and coordinator against this host's real GPU(s): what NVML
reports, how fast the agent reacts, and whether placement follows real memory.

Run from the repository root on a host with an NVIDIA driver and PyTorch
(or CuPy) for the load::

    python benchmarks/real_gpu.py [--out DIR] [--load-s 15] [--load-gib 64] [--xid] [--agent-user gpulb] [--agent-wx]
                                  [--agent-seccomp SPEC.json]

Steps, on loopback:

1. ``gpulb-agent --check`` in-process (``agent.check.run_check`` on the real
   ``NvmlBackend``, 20 rounds): every field, its NVML read time, the round
   time against the 200 ms fast period;
2. whether NVML's PCIe throughput reads (each counts bytes over 20 ms)
   overlap when issued from two threads (the reason the backend reads the
   GPUs of a round in parallel); and, under host<->GPU copies, those reads
   against NVML's cumulative PCIe byte counters (which would need no wait);
3. a coordinator and an agent (``--backend nvml``) as real processes, a
   poller reading the coordinator's raw view (ListGpus, ListNodes) every
   100 ms and ``nvidia-smi -lms 200`` beside it, through three phases:
   calm, a load (a process allocating ``--load-gib`` GiB and running bf16
   matrix products on GPU 0), calm again. During the load two tasks are
   submitted: one whose VRAM fits beside the load, one that fits only once
   the load has freed its memory.

With ``--agent-user gpulb`` (as root) the agent of step 3, its own
``--check`` against the coordinator, and the Xid watcher of ``--xid`` run as
that user with its groups, as the systemd unit's ``User=gpulb`` does: whether
NVML gives an unprivileged agent every field and the Xid events. With
``--agent-wx`` they run under W^X memory (``PR_SET_MDWE``, Linux >= 6.3), as
the unit's ``MemoryDenyWriteExecute=yes``: whether this driver's
libnvidia-ml loads and works without writable-executable memory. With
``--agent-seccomp SPEC.json`` (written where systemd is installed by
``python -m coordinator.sandbox --out SPEC.json``) they run under the unit's
system-call filter too: ``SystemCallFilter=@system-service`` as that systemd
version expands it, refusals EPERM, socket families as
``RestrictAddressFamilies=``. All three together run the agent as the unit
does, less its mount namespace and device cgroup.

During the load, ``gpulb processes --json`` is asked for the compute
processes the agent lists, beside ``nvidia-smi --query-compute-apps`` and the
load's own PID.

Figures: the agent's sampling period per phase (ListNodes), how long after
nvidia-smi the coordinator saw the load come and go, how far the
coordinator's readings were from nvidia-smi's, the agent's CPU and the
telemetry bytes per second per phase, and when each task was placed.
Writes ``real_gpu.json``, ``timeline.csv`` and the services' logs to
``--out``.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from coordinator.demo import ProcessGroup, can_deny_write_execute, free_port, popen_as  # noqa: E402
from coordinator.ingestbench import process_cpu_s, scrape_metrics  # noqa: E402
from coordinator.sandbox import UnitSeccomp, launcher_argv  # noqa: E402
from coordinator.tables import render_table  # noqa: E402
from protos import cluster_pb2 as cpb  # noqa: E402
from protos import cluster_pb2_grpc as cpb_grpc  # noqa: E402
from protos import tasks_pb2 as tpb  # noqa: E402
from protos import tasks_pb2_grpc as tpb_grpc  # noqa: E402

_LOADER = r"""
import json, sys, time
def say(event, **kw):
    print(json.dumps({"event": event, "t": time.time(), **kw}), flush=True)
gib, seconds = float(sys.argv[1]), float(sys.argv[2])
if len(sys.argv) > 3:  # --rehearse: no GPU, the same events
    say("ready", lib="none")
    sys.stdin.readline()
    say("allocated", gib=gib)
    time.sleep(seconds)
    say("done", products=0, tflops=0.0)
    say("exiting")
    sys.exit(0)
try:
    import torch
    dev = torch.device("cuda:0")
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    lib = "torch"
except Exception as exc:
    say("no_loader", error=repr(exc)); sys.exit(3)
say("ready", lib=lib)
sys.stdin.readline()
hold = torch.empty(int(gib * 2**30), dtype=torch.uint8, device=dev)
hold.fill_(1)
torch.cuda.synchronize()
say("allocated", gib=gib)
end = time.time() + seconds
products = 0
while time.time() < end:
    for _ in range(20):
        c = a @ b
    torch.cuda.synchronize()
    products += 20
say("done", products=products, tflops=products * 2 * 8192**3 / seconds / 1e12)
del hold, c
torch.cuda.synchronize()
say("exiting")
"""


@dataclass
class Row:
    t: float
    phase: str
    util: float | None = None
    mem: float | None = None
    power: float | None = None
    age: float | None = None
    period_ms: int = 0
    envelopes: int = 0
    processes: float | None = None


@dataclass
class SmiRow:
    t: float
    util: float
    mem: float
    power: float


@dataclass
class Run:
    rows: list[Row] = field(default_factory=list)
    smi: list[SmiRow] = field(default_factory=list)
    events: dict[str, float] = field(default_factory=dict)
    tasks: dict[str, dict] = field(default_factory=dict)
    phase: str = "start"


def _pcie_overlap(rounds: int = 10) -> dict[str, float]:
    """ms for an rx and a tx PCIe throughput read, one after the other and
    from two threads at once, on GPU 0."""
    import pynvml as nv

    nv.nvmlInit()
    try:
        h = nv.nvmlDeviceGetHandleByIndex(0)
        try:
            nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_RX_BYTES)
        except nv.NVMLError as exc:
            return {"error": str(exc)}

        def rx():
            nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_RX_BYTES)

        def tx():
            nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_TX_BYTES)

        def serial():
            rx()
            tx()

        def threads():
            ts = [threading.Thread(target=f) for f in (rx, tx)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()

        out = {}
        for name, fn in (("one_read", rx), ("two_serial", serial), ("two_threads", threads)):
            times = []
            for _ in range(rounds):
                s = time.perf_counter()
                fn()
                times.append((time.perf_counter() - s) * 1000)
            out[name + "_ms"] = statistics.median(times)
        return out
    finally:
        nv.nvmlShutdown()


_COPIER = r"""
import json, sys, time, torch
host = torch.empty(2**30, dtype=torch.uint8).pin_memory()
dev = torch.empty(2**30, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
for direction, seconds in (("h2d", 3.0), ("d2h", 3.0)):
    print(json.dumps({"event": direction, "t": time.time()}), flush=True)
    end, copied = time.time() + seconds, 0
    while time.time() < end:
        (dev.copy_(host) if direction == "h2d" else host.copy_(dev))
        torch.cuda.synchronize()
        copied += 2**30
    print(json.dumps({"event": direction + "_done", "t": time.time(), "gib_per_s": copied / 2**30 / seconds}), flush=True)
"""


def _pcie_agreement() -> dict:
    """PCIe rates while a process copies 1 GiB blocks host->GPU for 3 s,
    then GPU->host for 3 s: NVML's 20 ms throughput reads (what the agent
    uses) against rates from the cumulative byte counters
    (NVML_FI_DEV_PCIE_COUNT_RX/TX_BYTES), the counters read 250 ms apart
    (the agent's period) and 20 ms apart (under 4 GiB between reads even
    at 64 GB/s, so a 32-bit wrap cannot hide); medians per direction, KB/s.
    Run on an H200 the 250 ms rates were 40-70x too low: the counters are
    not usable at the agent's period, hence the 20 ms reads."""
    import pynvml as nv

    nv.nvmlInit()
    try:
        h = nv.nvmlDeviceGetHandleByIndex(0)
        fields = [nv.NVML_FI_DEV_PCIE_COUNT_RX_BYTES, nv.NVML_FI_DEV_PCIE_COUNT_TX_BYTES]
        try:
            probe = nv.nvmlDeviceGetFieldValues(h, fields)
            counters = all(v.nvmlReturn == nv.NVML_SUCCESS for v in probe)
        except nv.NVMLError as exc:
            return {"counters": False, "error": str(exc)}
        if not counters:
            return {"counters": False, "returns": [int(v.nvmlReturn) for v in probe]}
        value_types = [int(v.valueType) for v in probe]
        proc = subprocess.Popen([sys.executable, "-c", _COPIER], stdout=subprocess.PIPE, text=True)
        events: dict[str, float] = {}
        rates: dict[str, float] = {}

        def read_events() -> None:
            for line in proc.stdout:
                ev = json.loads(line)
                events[ev["event"]] = ev["t"]
                if "gib_per_s" in ev:
                    rates[ev["event"]] = ev["gib_per_s"]

        reader = threading.Thread(target=read_events, daemon=True)
        reader.start()
        def counts():
            v = nv.nvmlDeviceGetFieldValues(h, fields)
            return int(v[0].value.ullVal), int(v[1].value.ullVal), max(int(x.timestamp) for x in v)

        def rate(a, b):
            dt = (b[2] - a[2]) / 1e6
            return (b[0] - a[0]) / 1024 / dt, (b[1] - a[1]) / 1024 / dt

        rows, last = [], None
        while proc.poll() is None:
            now = counts()
            api_rx = nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_RX_BYTES)
            api_tx = nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_TX_BYTES)
            fast_a = counts()
            time.sleep(0.02)
            fast_b = counts()
            fast = rate(fast_a, fast_b) if fast_b[2] > fast_a[2] else (math.nan, math.nan)
            if last is not None and now[2] > last[2]:
                slow = rate(last, now)
                rows.append((time.time(), api_rx, api_tx, slow[0], slow[1], fast[0], fast[1]))
            last = now
            time.sleep(0.2)
        reader.join(timeout=5)
        out = {"counters": True, "value_types": value_types, "copy_gib_per_s": rates}
        for d in ("h2d", "d2h"):
            if d in events and d + "_done" in events:
                w = [r for r in rows if events[d] + 0.3 <= r[0] <= events[d + "_done"]]
                if w:
                    out[d] = {name: statistics.median(r[i] for r in w) for i, name in
                              ((1, "api_rx_kbps"), (2, "api_tx_kbps"), (3, "counter_rx_kbps"), (4, "counter_tx_kbps"),
                               (5, "counter_20ms_rx_kbps"), (6, "counter_20ms_tx_kbps"))}
                    out[d]["samples"] = len(w)
        return out
    finally:
        nv.nvmlShutdown()


_FAULTER = r"""
import cupy as cp, numpy as np
bad = cp.RawKernel(r'extern "C" __global__ void bad(int* p) { p[threadIdx.x] = 1; }', "bad")
bad((1,), (32,), (np.uint64(0x10),))  # an address no allocation maps: a GPU page fault
try:
    cp.cuda.runtime.deviceSynchronize()
    print("no fault")
except Exception as exc:
    print("fault:", exc)
"""


_XID_WATCHER = r"""
import json, sys, time
from agent.check import seccomp_filter_in_force, write_xor_execute_in_force
from agent.nvml import NvmlBackend

wx = write_xor_execute_in_force()  # under --agent-wx, as the unit's agent runs
seccomp = seccomp_filter_in_force()  # under --agent-seccomp
seconds = float(sys.argv[1])
backend = NvmlBackend()
try:
    before = [s.xid_last for s in backend.sample()]  # None: the GPU is not watched
    print(json.dumps({"event": "ready", "xid": before, "write_xor_execute": wx, "seccomp_filter": seccomp}), flush=True)
    sys.stdin.readline()  # the faulting process has exited
    deadline, after = time.time() + seconds, before
    while time.time() < deadline:
        after = [s.xid_last for s in backend.sample()]
        if after != before:
            break
        time.sleep(0.2)
    print(json.dumps({"event": "done", "t": time.time(), "xid": after,
                      "health": [s.health for s in backend.sample()]}), flush=True)
finally:
    backend.close()
"""


def _next_event(stream) -> dict:
    """The watcher's next JSON event line, past the backend's own log lines
    (structlog writes to stdout too); {} at the end of the stream."""
    for line in stream:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and "event" in event and event["event"] in ("ready", "done"):
            return event
    return {}


def _xid_check(user: str | None, wx: bool = False, seconds: float = 5.0, seccomp: UnitSeccomp | None = None) -> dict:
    """A process that writes through a null pointer on GPU 0 (a page fault
    in that process only: the driver reports it as an Xid and cleans up its
    context), with the agent's NVML backend sampling in a process of its own,
    as ``user`` when given (NVML may refuse event registration to a user
    without privileges): which Xid it saw, and when."""
    watcher = subprocess.Popen(launcher_argv([sys.executable, "-c", _XID_WATCHER, str(seconds)], write_xor_execute=wx,
                                             seccomp=seccomp), cwd=ROOT,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               **popen_as(user))
    try:
        ready = _next_event(watcher.stdout)
        if ready.get("event") != "ready":
            return {"error": "the watcher did not start", "stderr": watcher.stderr.read()[-500:]}
        started = time.time()
        proc = subprocess.run([sys.executable, "-c", _FAULTER], capture_output=True, text=True, timeout=120)
        watcher.stdin.write("go\n")
        watcher.stdin.flush()
        done = _next_event(watcher.stdout)
        if done.get("event") != "done":
            return {"error": "the watcher gave no result", "stderr": watcher.stderr.read()[-500:]}
        seen = done.get("xid") != ready["xid"]
        return {"user": user or "(this one)", "write_xor_execute": ready.get("write_xor_execute"),
                "seccomp_filter": ready.get("seccomp_filter"),
                "xid_before": ready["xid"], "xid_after": done.get("xid"),
                "seen_after_s": round(done["t"] - started, 2) if seen else None,
                "faulter": (proc.stdout + proc.stderr).strip()[-300:], "health_after": done.get("health")}
    finally:
        if watcher.poll() is None:
            watcher.kill()
        watcher.wait(timeout=10)


def _nvml_runs(stop: threading.Event, out: dict) -> None:
    """GPU 0 read straight from NVML every 200 ms (the agent's fast period)
    while the load runs: the longest run of identical (util.gpu, util.memory,
    memory used) readings, with and without the power draw, which is what
    the FROZEN detector keys on (15 in a row make a GPU frozen)."""
    import pynvml as nv

    nv.nvmlInit()
    try:
        h = nv.nvmlDeviceGetHandleByIndex(0)
        keys = []
        while not stop.is_set():
            u = nv.nvmlDeviceGetUtilizationRates(h)
            m = nv.nvmlDeviceGetMemoryInfo(h)
            keys.append((u.gpu, u.memory, m.used // 2**20, nv.nvmlDeviceGetPowerUsage(h)))
            stop.wait(0.2)
    finally:
        nv.nvmlShutdown()

    def longest(seq) -> int:
        best = run = 0
        prev = None
        for k in seq:
            run = run + 1 if k == prev else 1
            prev = k
            best = max(best, run)
        return best

    busy = [k for k in keys if k[0] > 0]
    out.update(readings=len(keys), busy_readings=len(busy),
               longest_same_util_memory=longest(k[:3] for k in busy),
               longest_same_util_memory_power=longest(busy))


def _poll(target: str, run: Run, stop: threading.Event) -> None:
    with grpc.insecure_channel(target) as ch:
        ops = cpb_grpc.ClusterOperatorStub(ch)
        sched = tpb_grpc.SchedulerStub(ch)
        while not stop.is_set():
            t = time.time()
            try:
                gpus = ops.ListGpus(cpb.ListGpusRequest(values=cpb.VALUE_VIEW_RAW), timeout=2).gpus
                nodes = ops.ListNodes(cpb.ListNodesRequest(), timeout=2).nodes
            except grpc.RpcError:
                stop.wait(0.1)
                continue
            row = Row(t=t, phase=run.phase)
            g0 = next((g for g in gpus if g.index == 0), None)
            if g0 is not None:
                row.util = g0.util_gpu_pct if g0.HasField("util_gpu_pct") else None
                row.mem = g0.memory_used_mib if g0.HasField("memory_used_mib") else None
                row.power = g0.power_w if g0.HasField("power_w") else None
                row.age = g0.reading_age_s
                row.processes = g0.process_count if g0.HasField("process_count") else None
            if nodes:
                row.period_ms = nodes[0].sample_interval_ms
                row.envelopes = nodes[0].envelopes
            run.rows.append(row)
            for task_id, info in run.tasks.items():
                if "placed_t" in info:
                    continue
                task = sched.GetTask(tpb.GetTaskRequest(task_id=task_id), timeout=2)
                info["state"] = tpb.TaskState.Name(task.state)
                info["reason"] = task.reason
                if task.state == tpb.TASK_STATE_LEASED:
                    info["placed_t"] = task.assignment.placed_at_ns / 1e9
                    info["gpu"] = f"{task.assignment.node_id}/{list(task.assignment.gpu_index)}"
            stop.wait(max(0.0, 0.1 - (time.time() - t)))


def _smi(run: Run, stop: threading.Event) -> subprocess.Popen | None:
    if shutil.which("nvidia-smi") is None:
        return None
    proc = subprocess.Popen(
        ["nvidia-smi", "--query-gpu=index,utilization.gpu,memory.used,power.draw", "--format=csv,noheader,nounits", "-lms", "200"],
        stdout=subprocess.PIPE, text=True,
    )

    def read() -> None:
        for line in proc.stdout:
            parts = [p.strip() for p in line.split(",")]
            if len(parts) == 4 and parts[0] == "0":
                try:
                    run.smi.append(SmiRow(time.time(), float(parts[1]), float(parts[2]), float(parts[3])))
                except ValueError:
                    continue

    threading.Thread(target=read, daemon=True).start()
    return proc


def _first(rows, after: float, pred) -> float | None:
    for r in rows:
        if r.t >= after and pred(r):
            return r.t
    return None


def _processes(target: str, load_pid: int) -> dict:
    """``gpulb processes --json`` (the CLI an operator runs) against
    ``nvidia-smi --query-compute-apps``: which PIDs and memory each lists."""
    cli = subprocess.run([sys.executable, "-m", "coordinator.cli", "--coordinator", target, "processes", "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=30)
    try:
        listed = [{"pid": p["pid"], "used_memory_mib": p["used_memory_mib"], "gpu": p["gpu_index"]}
                  for p in json.loads(cli.stdout)]
    except ValueError:
        listed = {"exit_code": cli.returncode, "output": (cli.stdout + cli.stderr)[-500:]}
    smi = []
    if shutil.which("nvidia-smi"):
        q = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=30)
        smi = [{"pid": int(a), "used_memory_mib": int(b)} for a, b in
               (line.split(",") for line in q.stdout.splitlines() if line.count(",") == 1)]
    return {"load_pid": load_pid, "gpulb": listed, "nvidia_smi": smi}


def _submit(target: str, task_id: str, vram_mib: int, share: float, priority: int) -> None:
    with grpc.insecure_channel(target) as ch:
        tpb_grpc.SchedulerStub(ch).ScheduleTask(
            tpb.ScheduleTaskRequest(
                spec=tpb.TaskSpec(task_id=task_id, vram_mib=vram_mib, gpu_share=share, priority=priority, kind="inference", duration_s=60),
                wait=False,
            ),
            timeout=5,
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="out/real_gpu", help="folder for real_gpu.json, timeline.csv and logs")
    p.add_argument("--load-s", type=float, default=30.0)
    p.add_argument("--load-gib", type=float, default=64.0)
    p.add_argument("--calm-s", type=float, default=10.0)
    p.add_argument("--xid", action="store_true",
                   help="also fault a throw-away process on GPU 0 (a write through a null pointer: Xid 31) and see the agent report it")
    p.add_argument("--agent-user", metavar="USER",
                   help="run the agent, its own --check and the Xid watcher as USER (with USER's groups), as the "
                        "systemd unit does with User=gpulb; needs root")
    p.add_argument("--agent-wx", action="store_true",
                   help="run the agent, its own --check and the Xid watcher under W^X memory (PR_SET_MDWE, Linux >= 6.3), "
                        "as the unit's MemoryDenyWriteExecute=yes does")
    p.add_argument("--agent-seccomp", metavar="SPEC.json", type=Path,
                   help="run the agent, its own --check and the Xid watcher under the unit's system-call filter, "
                        "resolved by `python -m coordinator.sandbox --out SPEC.json` where systemd is installed")
    p.add_argument("--rehearse", action="store_true", help="no GPU: the simulated backend and a load that only sleeps (tries the script)")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.agent_wx and not can_deny_write_execute():
        print("--agent-wx: this kernel cannot enforce W^X on a process (PR_SET_MDWE, Linux >= 6.3)", file=sys.stderr)
        return 2

    seccomp = UnitSeccomp.from_json(args.agent_seccomp.read_text()) if args.agent_seccomp else None
    from agent.check import check_coordinator, render_check, run_check
    from agent.nvml import NvmlBackend
    from agent.backend import BackendUnavailable

    try:
        if args.rehearse:
            from agent.sim import SimBackend

            backend = SimBackend(gpus=1, seed=1, workload="idle")
        else:
            backend = NvmlBackend()
    except BackendUnavailable as exc:
        print(f"no GPU to measure: {exc}", file=sys.stderr)
        return 2
    print("== 1. gpulb-agent --check (20 rounds)", flush=True)
    check = run_check(backend, rounds=20)
    backend.close()
    print(render_check(check), flush=True)
    print("\n== 2. PCIe throughput reads, GPU 0, median ms", flush=True)
    overlap = {} if args.rehearse else _pcie_overlap()
    print(json.dumps(overlap), flush=True)
    print("\n== 2b. PCIe rates under copies: 20 ms throughput reads vs the byte counters (not used), median KB/s", flush=True)
    try:
        agreement = {} if args.rehearse else _pcie_agreement()
    except Exception as exc:  # a measurement of its own: the rest still runs
        agreement = {"error": repr(exc)}
    print(json.dumps(agreement, indent=1), flush=True)

    print("\n== 3. coordinator + agent (nvml) on loopback, calm / load / calm", flush=True)
    total_mib = check.gpus[0].memory_total_mib
    logs = Path(tempfile.mkdtemp(prefix="gpulb-real-"))
    port, mport = free_port(), free_port()
    target = f"127.0.0.1:{port}"
    group = ProcessGroup(logs)
    run = Run()
    stop = threading.Event()
    smi = None
    loader = None
    summary: dict = {"agent_user": args.agent_user, "agent_write_xor_execute": args.agent_wx,
                     "agent_seccomp": seccomp.source if seccomp else None,
                     "check": check.to_dict(), "user_check": None, "pcie_overlap": overlap, "pcie_agreement": agreement}
    try:
        coordinator = group.start("coordinator", [sys.executable, "-m", "coordinator.main", "--listen", target,
                                    "--metrics-listen", f"127.0.0.1:{mport}", "--log-format", "json", "--insecure"])
        if args.agent_user or args.agent_wx or seccomp:
            deadline = time.time() + 30
            while not check_coordinator(target)[0]:  # serving before the agent's check asks it
                if time.time() > deadline or coordinator.poll() is not None:
                    raise RuntimeError(f"the coordinator never served (logs in {logs})")
                time.sleep(0.2)
            how = ", ".join(filter(None, [f"as {args.agent_user}" if args.agent_user else "",
                                          "under W^X" if args.agent_wx else "",
                                          "under the unit's seccomp filter" if seccomp else ""]))
            print(f"\n== 3a. gpulb-agent --check {how} (as the systemd unit runs it), against the coordinator", flush=True)
            try:
                check_argv = [sys.executable, "-m", "agent.main", "--check", "--backend", "sim" if args.rehearse else "nvml",
                              "--check-rounds", "5", "--sim-gpus", "1", "--coordinator", target]
                proc = subprocess.run(launcher_argv(check_argv, write_xor_execute=args.agent_wx, seccomp=seccomp),
                                      cwd=ROOT, capture_output=True, text=True, timeout=120, **popen_as(args.agent_user))
            except (OSError, KeyError) as exc:  # no such user, not root, or the user cannot run this Python
                print(f"cannot run the agent as {args.agent_user}: {exc} (the interpreter and {ROOT} must be readable "
                      f"by that user)", file=sys.stderr)
                raise SystemExit(2)
            summary["user_check"] = {"user": args.agent_user, "write_xor_execute": args.agent_wx,
                                     "seccomp": bool(seccomp),
                                     "exit_code": proc.returncode, "output": (proc.stdout + proc.stderr)[-4000:]}
            print(proc.stdout + proc.stderr, f"exit {proc.returncode}", flush=True)
        agent = group.start("agent", [sys.executable, "-m", "agent.main", "--backend", "sim" if args.rehearse else "nvml",
                                      "--sim-gpus", "1", "--sim-workload", "idle",
                                      "--coordinator", target, "--node-id", "gpu-host", "--log-format", "json"],
                            user=args.agent_user, write_xor_execute=args.agent_wx, seccomp=seccomp)
        poller = threading.Thread(target=_poll, args=(target, run, stop), daemon=True)
        poller.start()
        deadline = time.time() + 30
        while not (run.rows and run.rows[-1].mem is not None):
            if time.time() > deadline or coordinator.poll() is not None or agent.poll() is not None:
                raise RuntimeError(f"the agent's GPU never reached the coordinator's view (logs in {logs})")
            time.sleep(0.2)
        smi = None if args.rehearse else _smi(run, stop)
        loader = subprocess.Popen([sys.executable, "-c", _LOADER, str(args.load_gib), str(args.load_s)] + (["rehearse"] if args.rehearse else []),
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = json.loads(loader.stdout.readline() or '{"event": "no_loader"}')
        if ready["event"] != "ready":
            raise RuntimeError(f"no GPU load available: {ready}")

        def phase_marks() -> dict:
            return {"t": time.time(), "cpu_s": process_cpu_s(agent.pid),
                    "bytes": scrape_metrics(mport).get("gpulb_telemetry_received_bytes_total", float("nan"))}

        marks = {}
        run.phase = "calm"
        marks["calm"] = phase_marks()
        run.events["calm"] = time.time()
        time.sleep(args.calm_s)
        run.phase = "load"
        marks["load"] = phase_marks()
        nvml_stop, frozen_runs = threading.Event(), {}
        nvml_thread = None
        if not args.rehearse:
            nvml_thread = threading.Thread(target=_nvml_runs, args=(nvml_stop, frozen_runs), daemon=True)
            nvml_thread.start()
        run.events["go"] = time.time()
        loader.stdin.write("go\n")
        loader.stdin.flush()
        for line in loader.stdout:
            ev = json.loads(line)
            run.events[ev["event"]] = ev["t"]
            if ev["event"] == "allocated":
                # let the view see the load, then ask for a task that fits
                # only beside it and one that fits only once it has gone
                time.sleep(4.0)
                fits = 8 * 1024
                after = max(1024, int(total_mib - args.load_gib * 1024 * 0.6))
                run.events["submitted"] = time.time()
                _submit(target, "fits-beside-load", fits, 0.3, tpb.PRIORITY_P0)
                _submit(target, "needs-the-load-gone", after, 1.0, tpb.PRIORITY_P1)
                run.tasks = {"fits-beside-load": {"vram_mib": fits}, "needs-the-load-gone": {"vram_mib": after}}
                summary["processes"] = _processes(target, loader.pid)
            if ev["event"] == "done":
                summary["load_tflops"] = ev["tflops"]
                nvml_stop.set()
                if nvml_thread is not None:
                    nvml_thread.join()
                summary["frozen_key_runs"] = frozen_runs
        loader.wait(timeout=60)
        run.events["loader_exited"] = time.time()
        run.phase = "calm-after"
        marks["calm-after"] = phase_marks()
        time.sleep(args.calm_s + 4)
        marks["end"] = phase_marks()
    finally:
        stop.set()
        if loader is not None and loader.poll() is None:
            loader.kill()
        if smi is not None:
            smi.terminate()
        codes = group.stop_all()
        for name in ("coordinator", "agent"):
            if (logs / f"{name}.log").exists():
                shutil.copy(logs / f"{name}.log", out / f"{name}.log")
    summary["exit_codes"] = dict(codes)

    # ---- figures
    ev = run.events
    phases = [("calm", "calm", "load"), ("load", "load", "calm-after"), ("calm after", "calm-after", "end")]
    per_phase = []
    for label, a, b in phases:
        rows = [r for r in run.rows if marks[a]["t"] <= r.t < marks[b]["t"]]
        wall = marks[b]["t"] - marks[a]["t"]
        periods = [r.period_ms for r in rows if r.period_ms]
        per_phase.append({
            "phase": label,
            "seconds": round(wall, 1),
            "period_ms_min": min(periods) if periods else None,
            "period_ms_last": periods[-1] if periods else None,
            "envelopes_per_s": (rows[-1].envelopes - rows[0].envelopes) / wall if len(rows) > 1 else None,
            "bytes_per_s": (marks[b]["bytes"] - marks[a]["bytes"]) / wall,
            "agent_cpu_pct": 100 * (marks[b]["cpu_s"] - marks[a]["cpu_s"]) / wall,
            # the coordinator's reading age of GPU 0 (stale past staleness_s, 10 s)
            "reading_age_s_max": max((r.age for r in rows if r.age is not None), default=None),
        })
    summary["phases"] = per_phase
    smi_busy = _first(run.smi, ev.get("go", ev["calm"]), lambda r: r.util >= 50)
    coord_busy = _first(run.rows, ev.get("go", ev["calm"]), lambda r: (r.util or 0) >= 50)
    smi_mem = _first(run.smi, ev["calm"], lambda r: r.mem >= args.load_gib * 1024 * 0.9)
    coord_mem = _first(run.rows, ev["calm"], lambda r: (r.mem or 0) >= args.load_gib * 1024 * 0.9)
    smi_free = None if smi_mem is None else _first(run.smi, smi_mem, lambda r: r.mem < args.load_gib * 1024 * 0.5)
    coord_free = None if coord_mem is None else _first(run.rows, coord_mem, lambda r: (r.mem or 1e12) < args.load_gib * 1024 * 0.5)
    smi_idle = _first(run.smi, ev.get("done", ev["calm"]), lambda r: r.util < 50)
    coord_idle = _first(run.rows, ev.get("done", ev["calm"]), lambda r: (r.util or 0) < 50)
    lag = summary["lag_s"] = {
        "util>=50%: coordinator after nvidia-smi": None if None in (smi_busy, coord_busy) else coord_busy - smi_busy,
        "memory up: coordinator after allocation": None if coord_mem is None else coord_mem - ev["allocated"],
        "memory up: nvidia-smi after allocation": None if smi_mem is None else smi_mem - ev["allocated"],
        "memory freed: coordinator after nvidia-smi": None if None in (smi_free, coord_free) else coord_free - smi_free,
        "util<50% after the load: coordinator after nvidia-smi": None if None in (smi_idle, coord_idle) else coord_idle - smi_idle,
    }
    # agreement: each nvidia-smi reading against the coordinator's reading
    # just after it (the agent samples independently; both lag the truth)
    diffs_mem, diffs_util, offsets = [], [], []
    for s in run.smi:
        nxt = next((r for r in run.rows if r.t >= s.t + 0.3 and r.mem is not None), None)
        if nxt is None:
            continue
        diffs_mem.append(abs(nxt.mem - s.mem))
        offsets.append(nxt.mem - s.mem)
        if nxt.util is not None:
            diffs_util.append(abs(nxt.util - s.util))
    summary["agreement"] = {
        "pairs": len(diffs_mem),
        "memory_abs_diff_mib_median": statistics.median(diffs_mem) if diffs_mem else None,
        "util_abs_diff_pct_median": statistics.median(diffs_util) if diffs_util else None,
        "memory_offset_mib_median": statistics.median(offsets) if offsets else None,
        "driver_reserved_mib": check.gpus[0].memory_reserved_mib,
    }
    load_rows = [r for r in run.rows if r.phase == "load" and r.processes is not None]
    summary["processes_seen_in_load"] = max((r.processes for r in load_rows), default=None)
    summary["tasks"] = {
        k: {**v, "wait_s": (v["placed_t"] - ev["submitted"]) if "placed_t" in v else None,
            "placed_after_loader_exit_s": (v["placed_t"] - ev["loader_exited"]) if "placed_t" in v else None}
        for k, v in run.tasks.items()
    }
    summary["events"] = {k: round(v - ev["calm"], 2) for k, v in ev.items()}

    print(render_table(
        ["PHASE", "s", "PERIOD ms (min / last)", "ENVELOPES/s", "BYTES/s", "AGENT CPU %", "READING AGE MAX s"],
        [[p["phase"], p["seconds"], f"{p['period_ms_min']} / {p['period_ms_last']}",
          f"{p['envelopes_per_s']:.2f}" if p["envelopes_per_s"] is not None else "-",
          f"{p['bytes_per_s']:.0f}", f"{p['agent_cpu_pct']:.1f}",
          f"{p['reading_age_s_max']:.1f}" if p["reading_age_s_max"] is not None else "-"] for p in per_phase],
    ))
    print()
    print(render_table(["LAG", "s"], [[k, f"{v:.2f}" if v is not None else "never"] for k, v in lag.items()]))
    print()
    agree = summary["agreement"]
    print(f"coordinator vs nvidia-smi over {agree['pairs']} readings: median |memory| {agree['memory_abs_diff_mib_median']} MiB "
          f"(coordinator - nvidia-smi: {agree['memory_offset_mib_median']} MiB; driver reservation {agree['driver_reserved_mib']} MiB), "
          f"median |util| {agree['util_abs_diff_pct_median']} %")
    print(f"compute processes the coordinator saw on GPU 0 during the load: {summary['processes_seen_in_load']}")
    procs = summary.get("processes") or {}
    print(f"gpulb processes during the load (the load is PID {procs.get('load_pid')}): {json.dumps(procs.get('gpulb'))}; "
          f"nvidia-smi: {json.dumps(procs.get('nvidia_smi'))}")
    if summary.get("frozen_key_runs"):
        fr = summary["frozen_key_runs"]
        print(f"NVML at 200 ms under load, {fr['busy_readings']} busy readings: longest run of identical (util, util.memory, memory) "
              f"{fr['longest_same_util_memory']}, with power {fr['longest_same_util_memory_power']} (FROZEN after 15)")
    print()
    print(render_table(
        ["TASK", "VRAM MiB", "STATE", "WAIT s", "PLACED AFTER LOAD EXIT s", "GPU", "REASON"],
        [[k, v["vram_mib"], v.get("state", "?"), f"{v['wait_s']:.2f}" if v["wait_s"] is not None else "-",
          f"{v['placed_after_loader_exit_s']:.2f}" if v["placed_after_loader_exit_s"] is not None else "-",
          v.get("gpu", "-"), v.get("reason", "")[:60]] for k, v in summary["tasks"].items()],
    ))
    print(f"\nload: {summary.get('load_tflops', 0):.0f} TFLOP/s bf16; services exited {summary['exit_codes']}")

    if args.xid and not args.rehearse:
        print("\n== 4. an Xid: a process faults on GPU 0 while the NVML backend samples", flush=True)
        try:
            summary["xid"] = _xid_check(args.agent_user, args.agent_wx, seccomp=seccomp)
        except Exception as exc:
            summary["xid"] = {"error": repr(exc)}
        print(json.dumps(summary["xid"], indent=1), flush=True)

    (out / "real_gpu.json").write_text(json.dumps(summary, indent=2, default=str))
    with open(out / "timeline.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["source", "t_s", "phase", "util_pct", "memory_used_mib", "power_w", "period_ms", "envelopes", "reading_age_s"])
        for r in run.rows:
            w.writerow(["coordinator", f"{r.t - ev['calm']:.3f}", r.phase, r.util, r.mem, r.power, r.period_ms, r.envelopes, r.age])
        for s in run.smi:
            w.writerow(["nvidia-smi", f"{s.t - ev['calm']:.3f}", "", s.util, s.mem, s.power, "", "", ""])
    return 0


if __name__ == "__main__":
    sys.exit(main())
