"""``gpulb demo``: a coordinator and simulated agents as real processes on
loopback, balancing a mixed GPU workload first with round_robin and then with
load_aware (switched with SetPolicy), and a side-by-side summary of the two.

Every child is stopped on the way out (also on Ctrl-C or SIGTERM); the exit
code is 0 only when both phases placed tasks and every child stopped cleanly.
The workload itself is ``coordinator.demo_workload``.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Callable, Iterable, Sequence, TextIO

import grpc

from coordinator.demo_workload import SCENARIOS, DemoTask, build_workload
from coordinator.sandbox import UnitSeccomp, launcher_argv
from coordinator.tables import fmt, render_table
from protos import cluster_pb2 as cpb
from protos import cluster_pb2_grpc as cpb_grpc
from protos import tasks_pb2 as tpb
from protos import tasks_pb2_grpc as tpb_grpc

__all__ = [
    "run_demo",
    "free_port",
    "ProcessGroup",
    "popen_as",
    "can_deny_write_execute",
    "add_demo_arguments",
    "GpuReading",
    "TaskOutcome",
    "PhaseFigures",
    "phase_figures",
    "render_summary",
    "POLICY_ORDER",
]

#: the phases, in order: the naive baseline first
POLICY_ORDER = ("round_robin", "load_aware")
#: s a P0 task may wait before it is an SLA miss (SchedulerConfig.p0_sla_s)
P0_SLA_S = 5.0
_RPC_TIMEOUT_S = 5.0
_ACTIVE = (tpb.TASK_STATE_QUEUED, tpb.TASK_STATE_LEASED)
#: s between a lease holder's checks that its lease is still its own
_HOLDER_CHECK_S = 1.0


def add_demo_arguments(demo: argparse.ArgumentParser) -> None:
    demo.add_argument("--agents", type=int, default=6, help="simulated hosts (default 6)")
    demo.add_argument("--gpus-per-agent", type=int, default=4, help="simulated RTX 4090s per host (default 4)")
    demo.add_argument(
        "--duration", type=float, default=60.0,
        help="s of submissions in all, half per policy (default 60); draining between phases adds a little",
    )
    demo.add_argument("--seed", type=int, default=0, help="workload and simulated-GPU seed (default 0)")
    demo.add_argument(
        "--background", choices=("idle", "synthetic"), default="synthetic",
        help="load on the GPUs besides the workload: synthetic (default: other tenants' jobs that come and go, "
        "deterministic for the agent seeds, which is what a load-aware placement must see) or idle (an empty cluster)",
    )
    demo.add_argument("--no-live", action="store_true", help="periodic log lines instead of a live table (logs and CI)")
    demo.add_argument("--log-dir", help="keep the coordinator's and agents' logs here (default: a temporary directory, removed)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def popen_as(user: str | None) -> dict:
    """``subprocess.Popen`` keyword arguments that run the child as ``user``
    with its primary and supplementary groups (the ``video`` group that may
    own /dev/nvidia*, say), or none for the current user."""
    if not user:
        return {}
    import pwd

    entry = pwd.getpwnam(user)
    return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": os.getgrouplist(user, entry.pw_gid)}


@functools.lru_cache(maxsize=None)
def can_deny_write_execute() -> bool:
    """Whether this kernel can put a child under W^X (the launcher's
    ``PR_SET_MDWE``, ``coordinator.sandbox``): a throw-away child tries, once
    per process (a property of the kernel)."""
    try:
        subprocess.run(launcher_argv([sys.executable, "-c", "pass"], write_xor_execute=True), check=True,
                       stderr=subprocess.DEVNULL)
        return True
    except (subprocess.SubprocessError, OSError):
        return False


class ProcessGroup:
    """Children started by the demo, each in its own process group so one
    signal stops it and anything it started."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(
        self, name: str, argv: list[str], user: str | None = None, write_xor_execute: bool = False,
        seccomp: UnitSeccomp | None = None,
    ) -> subprocess.Popen:
        """Start ``argv`` logging to ``<name>.log``; as ``user`` (with that
        user's groups, as a systemd ``User=`` unit runs) when given: only root
        can do that; with ``write_xor_execute``, under W^X memory as
        ``MemoryDenyWriteExecute=yes`` runs it; with ``seccomp``, under a
        unit's system-call filter (``coordinator.sandbox``, whose launcher
        sets these up in the child, so no Python runs between fork and exec).
        On Linux the child gets SIGTERM if the demo dies, even by SIGKILL, so
        not even a killed demo leaves its cluster running."""
        linux = sys.platform.startswith("linux")
        argv = launcher_argv(argv, die_with_parent_pid=os.getpid() if linux else None,
                             write_xor_execute=write_xor_execute, seccomp=seccomp)
        log = open(self.log_dir / f"{name}.log", "wb")
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            **popen_as(user),
        )
        log.close()
        self.procs.append((name, proc))
        return proc

    def signal(self, prefix: str, sig: int) -> int:
        """Send ``sig`` to every live child whose name starts with ``prefix``;
        how many were sent it."""
        sent = 0
        for name, proc in self.procs:
            if name.startswith(prefix) and proc.poll() is None:
                try:
                    os.kill(proc.pid, sig)
                    sent += 1
                except ProcessLookupError:
                    pass
        return sent

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
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        return [(name, proc.returncode) for name, proc in self.procs]


# ---- what a phase measured, and the figures drawn from it -------------------------------------


@dataclass(frozen=True, slots=True)
class GpuReading:
    """One GPU in one once-a-second sample of ListGpus."""

    node_id: str
    index: int
    util_pct: float | None
    temperature_c: float | None


@dataclass(frozen=True, slots=True)
class TaskOutcome:
    """How one submitted task ended, from the coordinator's record."""

    scenario: str
    state: int  # tpb.TaskState
    wait_s: float | None  # submission to (last) placement; None when never placed
    ran: bool  # was placed at least once


@dataclass(frozen=True, slots=True)
class PhaseFigures:
    """The summary column of one policy."""

    policy: str
    submitted: int
    placed: int
    completed: int
    failed: int  # FAILED: the agent OOM-killed it
    cancelled_queued: int  # never placed by the end of the phase
    cancelled_running: int  # still running at the end of the phase
    refused: int  # ScheduleTask errors (rejected at submission)
    waits: dict[str, tuple[float, float, int]]  # scenario -> (mean s, p95 s, placed)
    sla_misses: int
    util_mean: float
    util_std: float
    util_range: float
    hottest: str
    tenant_ooms: int | None = None  # other tenants refused memory gpulb's tasks held (simulated hosts)
    preempted: int | None = None  # leases evicted for P0 tasks (the coordinator's log)


def _p95(values: Sequence[float]) -> float:
    """Nearest-rank 95th percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def phase_figures(
    policy: str,
    outcomes: Sequence[TaskOutcome],
    samples: Sequence[Sequence[GpuReading]],
    sla_misses: int,
    refused: int = 0,
    tenant_ooms: int | None = None,
    preempted: int | None = None,
) -> PhaseFigures:
    """Figures of one phase.

    * waits per scenario over the tasks that were placed: mean and p95
      (nearest rank) of submission-to-placement;
    * utilisation spread: for each once-a-second sample, the mean, the
      population std and max - min of util over the GPUs that reported one;
      each figure is then averaged over the samples;
    * hottest: the GPU with the highest temperature in any sample.
    """
    states = Counter(o.state for o in outcomes)
    waits: dict[str, tuple[float, float, int]] = {}
    for scenario in SCENARIOS:
        w = [o.wait_s for o in outcomes if o.scenario == scenario and o.wait_s is not None]
        if w:
            waits[scenario] = (sum(w) / len(w), _p95(w), len(w))
    means, stds, ranges = [], [], []
    hot: tuple[float, str] | None = None
    for sample in samples:
        utils = [r.util_pct for r in sample if r.util_pct is not None]
        if utils:
            mean = sum(utils) / len(utils)
            means.append(mean)
            stds.append(math.sqrt(sum((u - mean) ** 2 for u in utils) / len(utils)))
            ranges.append(max(utils) - min(utils))
        for r in sample:
            if r.temperature_c is not None and (hot is None or r.temperature_c > hot[0]):
                hot = (r.temperature_c, f"{r.node_id}/{r.index} {r.temperature_c:.0f} C")

    def avg(xs: list[float]) -> float:
        return sum(xs) / len(xs) if xs else math.nan

    return PhaseFigures(
        policy=policy,
        submitted=len(outcomes) + refused,
        placed=sum(1 for o in outcomes if o.ran),
        completed=states[tpb.TASK_STATE_COMPLETED],
        failed=states[tpb.TASK_STATE_FAILED],
        cancelled_queued=sum(1 for o in outcomes if o.state == tpb.TASK_STATE_CANCELLED and not o.ran),
        cancelled_running=sum(1 for o in outcomes if o.state == tpb.TASK_STATE_CANCELLED and o.ran),
        refused=refused,
        waits=waits,
        sla_misses=sla_misses,
        util_mean=avg(means),
        util_std=avg(stds),
        util_range=avg(ranges),
        hottest=hot[1] if hot else "-",
        tenant_ooms=tenant_ooms,
        preempted=preempted,
    )


def render_summary(phases: Sequence[PhaseFigures]) -> str:
    """The side-by-side table: one row per figure, one column per policy."""

    def row(label: str, get: Callable[[PhaseFigures], object]) -> list[object]:
        return [label, *(get(p) for p in phases)]

    def wait(scenario: str, p: PhaseFigures) -> str:
        w = p.waits.get(scenario)
        return "-" if w is None else f"{w[0]:.2f} / {w[1]:.2f}"

    rows = [
        row("tasks submitted", lambda p: p.submitted),
        row("tasks placed", lambda p: p.placed),
        row("tasks completed", lambda p: p.completed),
        row("tasks failed (OOM-killed)", lambda p: p.failed),
    ]
    if any(p.tenant_ooms is not None for p in phases):
        rows.append(row("other tenants refused memory", lambda p: "-" if p.tenant_ooms is None else p.tenant_ooms))
    rows += [
        row("never placed (cancelled at end)", lambda p: p.cancelled_queued),
        row("still running (cancelled at end)", lambda p: p.cancelled_running),
    ]
    if any(p.refused for p in phases):
        rows.append(row("refused at submission", lambda p: p.refused))
    for scenario, (_, label) in SCENARIOS.items():
        rows.append(row(f"wait s, mean / p95: {label}", lambda p, s=scenario: wait(s, p)))
    rows += [
        row(f"P0 SLA misses (waited > {P0_SLA_S:g} s)", lambda p: p.sla_misses),
        *([row("preempted for P0 (re-queued)", lambda p: "-" if p.preempted is None else p.preempted)]
          if any(p.preempted for p in phases) else []),
        row("GPU util mean %", lambda p: fmt(p.util_mean, 1)),
        row("util std across GPUs, pp", lambda p: fmt(p.util_std, 1)),
        row("util max - min across GPUs, pp", lambda p: fmt(p.util_range, 1)),
        row("hottest GPU", lambda p: p.hottest),
    ]
    return render_table(["", *(p.policy for p in phases)], rows, align="l" + "r" * len(phases))


# ---- talking to the coordinator ---------------------------------------------------------------


def _spec(task: DemoTask, task_id: str) -> tpb.TaskSpec:
    return tpb.TaskSpec(
        task_id=task_id,
        tenant=task.tenant,
        priority=int(task.priority) + 1,
        kind=task.kind,
        num_gpus=task.num_gpus,
        vram_mib=task.vram_mib,
        gpu_share=task.gpu_share,
        duration_s=0.0 if task.client_completes else task.run_s,
        movable=task.kind in ("training", "batch", "background"),
        labels={"scenario": task.scenario, "source": "gpulb-demo"},
    )


def _readings(gpus: Iterable[cpb.Gpu]) -> list[GpuReading]:
    return [
        GpuReading(
            g.node_id, g.index,
            g.util_gpu_pct if g.HasField("util_gpu_pct") else None,
            g.temperature_c if g.HasField("temperature_c") else None,
        )
        for g in gpus
    ]


def _outcome(task: tpb.Task) -> TaskOutcome:
    placed = task.HasField("assignment") and task.assignment.placed_at_ns > 0
    started = task.assignment.run_started_at_ns or task.assignment.placed_at_ns
    wait = max(0.0, (started - task.submitted_at_ns) / 1e9) if placed else None
    return TaskOutcome(task.spec.labels.get("scenario", "?"), task.state, wait, placed)


class _Client(threading.Thread):
    """One tenant's client: its own channel, submitting its scenario's tasks at
    their times. Tasks the client completes itself get a holder thread that
    waits for the placement, runs for ``run_s`` and calls CompleteTask."""

    def __init__(self, target: str, prefix: str, tasks: list[DemoTask], t0: float, stop: threading.Event) -> None:
        super().__init__(name=f"demo-client-{tasks[0].tenant}", daemon=True)
        self.target = target
        self.prefix = prefix
        self.tasks = tasks
        self.t0 = t0
        self.stop = stop
        self.submitted: list[str] = []
        self.refused: list[tuple[str, str]] = []
        self.holders: list[threading.Thread] = []

    def run(self) -> None:
        with grpc.insecure_channel(self.target) as channel:
            stub = tpb_grpc.SchedulerStub(channel)
            for task in self.tasks:
                if self.stop.wait(max(0.0, self.t0 + task.submit_s - time.monotonic())):
                    break
                task_id = f"{self.prefix}{task.name}"
                if task.client_completes:
                    holder = threading.Thread(target=self._hold, args=(stub, task, task_id), daemon=True)
                    self.holders.append(holder)
                    holder.start()
                    continue
                try:
                    stub.ScheduleTask(tpb.ScheduleTaskRequest(spec=_spec(task, task_id), wait=False), timeout=_RPC_TIMEOUT_S)
                    self.submitted.append(task_id)
                except grpc.RpcError as exc:
                    self.refused.append((task_id, f"{exc.code().name}: {exc.details()}"))
            for holder in self.holders:
                holder.join()

    def _hold(self, stub: tpb_grpc.SchedulerStub, task: DemoTask, task_id: str) -> None:
        """Run the task as a well-behaved lease holder does: stop when the
        lease is no longer its own (preempted for a P0 task: PREEMPTED, then
        QUEUED) and run it again once it is placed again."""
        try:
            # Submitted (not yet placed) counts as soon as the call is made; a
            # waiting call returns when the task is placed or cancelled (the
            # same spec again is the same task: after a preemption it waits
            # for the next placement).
            self.submitted.append(task_id)
            spec = _spec(task, task_id)
            while True:
                t = stub.ScheduleTask(tpb.ScheduleTaskRequest(spec=spec, wait=True), timeout=3600).task
                if t.state != tpb.TASK_STATE_LEASED:
                    return
                lease_id = t.assignment.lease_id
                ends = time.monotonic() + task.run_s
                while (left := ends - time.monotonic()) > 0:
                    if self.stop.wait(min(_HOLDER_CHECK_S, left)):
                        return
                    now = stub.GetTask(tpb.GetTaskRequest(task_id=task_id), timeout=_RPC_TIMEOUT_S)
                    if now.state != tpb.TASK_STATE_LEASED or now.assignment.lease_id != lease_id:
                        break  # preempted (or cancelled): stop
                else:
                    stub.CompleteTask(
                        tpb.CompleteTaskRequest(task_id=task_id, lease_id=lease_id, actual_duration_s=task.run_s),
                        timeout=_RPC_TIMEOUT_S,
                    )
                    return
                if now.state != tpb.TASK_STATE_QUEUED:
                    return
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT or exc.code() == grpc.StatusCode.ALREADY_EXISTS:
                self.refused.append((task_id, f"{exc.code().name}: {exc.details()}"))
            # Otherwise: cancelled at the end of the phase, or the demo is stopping.


# ---- showing it -------------------------------------------------------------------------------


class _Display:
    """The progress bar (stderr, when it is a terminal) and either a live
    table of every GPU redrawn in place (stdout is a terminal) or plain log
    lines every ``log_every_s``."""

    def __init__(self, out: TextIO, err: TextIO, live: bool, log_every_s: float) -> None:
        self.out = out
        self.err = err
        self.live = live
        self.bar = err.isatty()
        self.log_every_s = log_every_s
        self._lines = 0  # lines of the live frame on screen
        self._bar_shown = False
        self._last_log = -math.inf

    def _clear_bar(self) -> None:
        if self._bar_shown:
            self.err.write("\r\x1b[K")
            self.err.flush()
            self._bar_shown = False

    def message(self, text: str) -> None:
        """A line that stays (phase starts and ends)."""
        self._clear_bar()
        self._lines = 0  # the frame above scrolls away with the message
        self._last_log = -math.inf  # phase clocks restart at 0
        self.out.write(text + "\n")
        self.out.flush()

    def update(self, now: float, progress: str, frac: float, status: str, gpus: Sequence[cpb.Gpu]) -> None:
        if self.live:
            self._clear_bar()
            height = shutil.get_terminal_size((120, 50)).lines
            frame = f"{status}\n{_gpu_table(gpus, max_lines=height - 3)}\n"
            if self._lines:
                self.out.write(f"\x1b[{self._lines}F\x1b[J")
            self.out.write(frame)
            self.out.flush()
            self._lines = frame.count("\n")
        elif now - self._last_log >= self.log_every_s:
            self._last_log = now
            self._clear_bar()
            self.out.write(status + "\n")
            self.out.flush()
        if self.bar:
            width = 30
            filled = int(max(0.0, min(1.0, frac)) * width)
            self.err.write(f"\r{progress} [{'#' * filled}{'.' * (width - filled)}]\x1b[K")
            self.err.flush()
            self._bar_shown = True

    def close(self) -> None:
        self._clear_bar()


def _gpu_table(gpus: Sequence[cpb.Gpu], max_lines: int = 1_000) -> str:
    """Every GPU, one a row; in two side-by-side halves when one column
    would not fit ``max_lines`` (a frame taller than the terminal cannot be
    redrawn in place)."""
    rows = []
    for g in gpus:
        util = g.util_gpu_pct if g.HasField("util_gpu_pct") else None
        bar = "-" if util is None else "#" * int(round(util / 10)) + "." * (10 - int(round(util / 10)))
        mem = "-"
        if g.HasField("memory_used_mib") and g.HasField("memory_total_mib"):
            mem = f"{g.memory_used_mib / 1024:.1f}/{g.memory_total_mib / 1024:.1f}"
        rows.append([
            g.node_id, g.index, fmt(util, 0, "%"), bar, mem,
            fmt(g.temperature_c if g.HasField("temperature_c") else None, 0), g.active_tasks,
        ])
    headers, align = ["NODE", "GPU", "UTIL", "", "MEM GiB", "TEMP C", "TASKS"], "lrrlrrr"
    if len(rows) + 2 > max_lines and len(rows) > 1:
        half = (len(rows) + 1) // 2
        blank = [""] * len(headers)
        rows = [rows[i] + ["|"] + (rows[half + i] if half + i < len(rows) else blank) for i in range(half)]
        headers, align = headers + ["|"] + headers, align + "l" + align
    return render_table(headers, rows, align=align)


# ---- the phases -------------------------------------------------------------------------------


@dataclass
class _PhaseRecord:
    policy: str
    samples: list[list[GpuReading]] = field(default_factory=list)
    tasks: list[tpb.Task] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)
    sla_misses: int = 0
    # why each task still queued at the end of the phase was waiting
    unplaced: list[tuple[str, str]] = field(default_factory=list)
    # wall clock (time.time) from the first submission to the last cancel
    started_at: float = 0.0
    ended_at: float = 0.0
    # other tenants refused memory gpulb's tasks held, from the simulated
    # hosts' logs once they stopped (None: not counted)
    tenant_ooms: int | None = None
    # leases evicted for P0 tasks, from the coordinator's log (None: not counted)
    preempted: int | None = None


def _phase_tasks(stub: tpb_grpc.SchedulerStub, prefix: str) -> list[tpb.Task]:
    reply = stub.ListTasks(tpb.ListTasksRequest(limit=1_000_000), timeout=_RPC_TIMEOUT_S)
    return [t for t in reply.tasks if t.spec.task_id.startswith(prefix)]


def _counts(tasks: Sequence[tpb.Task]) -> str:
    states = Counter(t.state for t in tasks)
    return (
        f"submitted {len(tasks)}  queued {states[tpb.TASK_STATE_QUEUED]}  running {states[tpb.TASK_STATE_LEASED]}  "
        f"completed {states[tpb.TASK_STATE_COMPLETED]}  failed {states[tpb.TASK_STATE_FAILED]}"
    )


def _spread(readings: Sequence[GpuReading]) -> str:
    utils = [r.util_pct for r in readings if r.util_pct is not None]
    if not utils:
        return "no readings"
    mean = sum(utils) / len(utils)
    std = math.sqrt(sum((u - mean) ** 2 for u in utils) / len(utils))
    return f"util mean {mean:.0f}% std {std:.0f} max-min {max(utils) - min(utils):.0f}"


def _watch_phase(
    record: _PhaseRecord, sched: tpb_grpc.SchedulerStub, ops: cpb_grpc.ClusterOperatorStub, prefix: str,
    clients: Sequence[_Client], t0: float, window_s: float, drain_s: float, display: _Display,
) -> None:
    """Once a second until the phase is drained (or ``drain_s`` after its
    window): sample every GPU (kept while the window lasts), count the
    phase's tasks, show both."""
    policy = record.policy
    draining_since: float | None = None
    next_tick = t0
    while True:
        _check_stop()
        now = time.monotonic()
        elapsed = now - t0
        gpus = list(ops.ListGpus(cpb.ListGpusRequest(), timeout=_RPC_TIMEOUT_S).gpus)
        tasks = _phase_tasks(sched, prefix)
        readings = _readings(gpus)
        left = sum(1 for t in tasks if t.state in _ACTIVE)
        if elapsed < window_s:
            record.samples.append(readings)
            frac, stage = elapsed / window_s, f"{elapsed:4.0f}/{window_s:g} s"
        else:
            if draining_since is None:
                draining_since = now
            drained = now - draining_since
            frac, stage = drained / drain_s, f"draining, {left} left"
            clients_done = not any(c.is_alive() for c in clients)
            if (left == 0 and clients_done) or drained >= drain_s:
                break
        status = f"[{policy} {stage}] {_counts(tasks)} | {_spread(readings)}"
        display.update(elapsed, f"{policy:<12} {stage:<20}", frac, status, gpus)
        next_tick += 1.0
        time.sleep(max(0.0, next_tick - time.monotonic()))


def _run_phase(
    target: str, number: int, policy: str, workload: list[DemoTask], window_s: float, drain_s: float,
    display: _Display,
) -> _PhaseRecord:
    record = _PhaseRecord(policy)
    prefix = f"{policy}/"
    with grpc.insecure_channel(target) as channel:
        sched = tpb_grpc.SchedulerStub(channel)
        ops = cpb_grpc.ClusterOperatorStub(channel)
        active = sched.SetPolicy(tpb.SetPolicyRequest(name=policy), timeout=_RPC_TIMEOUT_S)
        sla_before = sched.GetQueue(tpb.GetQueueRequest(), timeout=_RPC_TIMEOUT_S).sla_misses
        display.message(
            f"phase {number}/{len(POLICY_ORDER)}: policy {active.name} (SetPolicy, no restart); "
            f"{len(workload)} tasks over {window_s:g} s from {len(SCENARIOS)} concurrent clients"
        )
        t0 = time.monotonic()
        record.started_at = time.time()
        by_scenario: dict[str, list[DemoTask]] = {}
        for task in workload:
            by_scenario.setdefault(task.scenario, []).append(task)
        # The clients stop with the phase, or at once on Ctrl-C.
        phase_stop = threading.Event()
        clients = [_Client(target, prefix, tasks, t0, phase_stop) for tasks in by_scenario.values()]
        try:
            for client in clients:
                client.start()
            _watch_phase(record, sched, ops, prefix, clients, t0, window_s, drain_s, display)
        finally:
            phase_stop.set()

        # Leftovers would load the next phase: cancel them (queued ones never
        # ran; running ones are released on their agents).
        for task in _phase_tasks(sched, prefix):
            if task.state == tpb.TASK_STATE_QUEUED:
                record.unplaced.append((task.spec.task_id.removeprefix(prefix), task.reason))
            if task.state in _ACTIVE:
                try:
                    sched.CancelTask(
                        tpb.CancelTaskRequest(task_id=task.spec.task_id, reason="demo phase over"), timeout=_RPC_TIMEOUT_S
                    )
                except grpc.RpcError:
                    pass  # it finished meanwhile
        record.ended_at = time.time()
        for client in clients:
            client.join(timeout=10)
            record.refused += client.refused
        record.tasks = _phase_tasks(sched, prefix)
        record.sla_misses = sched.GetQueue(tpb.GetQueueRequest(), timeout=_RPC_TIMEOUT_S).sla_misses - sla_before
    display.close()
    return record


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


class _Interrupted(Exception):
    """SIGTERM (or SIGINT) asked the demo to stop."""


# Set by the signal handler too: an exception raised from a handler while a
# blocking gRPC call runs can be lost inside grpc (a SIGINT let a test's demo
# run to its end once), so the phase loop also checks this once a second.
_STOP_REQUESTED: list[str] = []


def _raise_interrupted(signum, frame) -> None:
    name = signal.Signals(signum).name
    _STOP_REQUESTED.append(name)
    raise _Interrupted(name)


def _check_stop() -> None:
    if _STOP_REQUESTED:
        raise _Interrupted(_STOP_REQUESTED[0])


def run_demo(args: argparse.Namespace) -> int:
    if args.agents < 1 or args.gpus_per_agent < 1 or not args.duration >= 4:
        print("gpulb demo: --agents and --gpus-per-agent must be >= 1, --duration >= 4 s", file=sys.stderr)
        return 2
    port = free_port()
    target = f"127.0.0.1:{port}"
    expected = args.agents * args.gpus_per_agent
    window_s = args.duration / 2
    drain_s = max(5.0, min(20.0, window_s / 2))
    workload = build_workload(args.seed, window_s, args.agents, args.gpus_per_agent)
    live = sys.stdout.isatty() and not args.no_live
    display = _Display(sys.stdout, sys.stderr, live, log_every_s=min(5.0, max(1.0, window_s / 5)))
    py = sys.executable
    records: list[_PhaseRecord] = []
    ok = False
    previous_handlers = {}
    if threading.current_thread() is threading.main_thread():
        _STOP_REQUESTED.clear()
        previous_handlers = {sig: signal.signal(sig, _raise_interrupted) for sig in (signal.SIGTERM, signal.SIGINT)}
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gpulb-demo-")))
        logs = Path(args.log_dir) if getattr(args, "log_dir", None) else tmp
        logs.mkdir(parents=True, exist_ok=True)
        group = ProcessGroup(logs)
        try:
            counts = Counter(t.scenario for t in workload)
            print(
                f"gpulb demo: coordinator on {target}, {args.agents} simulated hosts x {args.gpus_per_agent} RTX 4090 "
                f"({args.background} background load{', replayed from its start for each policy' if args.background == 'synthetic' else ''}), "
                f"seed {args.seed}; "
                f"coordinator state in {tmp}"
            )
            print(
                f"workload per phase ({window_s:g} s, the same for both policies): "
                + ", ".join(f"{counts[s]} x {label}" for s, (_, label) in SCENARIOS.items())
            )
            print(
                f"times are compressed for the demo: LoRA fine-tunes that take minutes run "
                f"{0.3 * window_s:.0f}-{0.5 * window_s:.0f} s here"
            )
            # A loopback lab: plaintext and no tokens, asked for explicitly.
            coordinator_argv = [py, "-m", "coordinator.main", "--listen", target, "--log-format", "json",
                                "--insecure", "--state-dir", str(tmp / "state")]
            group.start("coordinator", coordinator_argv)
            for i in range(args.agents):
                group.start(
                    f"agent-{i + 1}",
                    [py, "-m", "agent.main", "--coordinator", target, "--node-id", f"sim-{i + 1:02d}", "--backend", "sim",
                     "--sim-gpus", str(args.gpus_per_agent), "--sim-seed", str(args.seed * 1000 + i + 1),
                     "--sim-workload", args.background, "--log-format", "json"],
                )
            gpus = _wait_for_gpus(target, expected, timeout_s=60)
            reporting = len([g for g in gpus if g.HasField("util_gpu_pct")])
            print(f"{reporting} of {expected} GPUs reporting")
            if reporting >= expected:
                for number, policy in enumerate(POLICY_ORDER, start=1):
                    _check_stop()
                    if args.background == "synthetic":
                        # Both phases meet the same other tenants' load
                        # (SimBackend.rewind_background), not whatever the
                        # synthetic timeline reached by the second phase.
                        group.signal("agent-", signal.SIGUSR1)
                        time.sleep(2.5)  # a calm agent's next round (2 s) shows it to the coordinator
                    record = _run_phase(target, number, policy, workload, window_s, drain_s, display)
                    records.append(record)
                    figures = _figures(record)
                    display.message(
                        f"phase {number} done: {figures.placed} of {figures.submitted} placed, "
                        f"{figures.completed} completed, {figures.failed} OOM-killed, "
                        f"{figures.cancelled_queued + figures.cancelled_running} cancelled at the end"
                    )
                    for task_id, reason in record.unplaced:
                        display.message(f"  never placed: {task_id}: {reason}")
                ok = len(records) == len(POLICY_ORDER) and all(_figures(r).placed > 0 for r in records)
        except (KeyboardInterrupt, _Interrupted):
            display.close()
            print("\ninterrupted: stopping the cluster")
        except grpc.RpcError as exc:
            display.close()
            print(f"gpulb demo: coordinator call failed: {exc.code().name}: {exc.details()}")
        finally:
            results = group.stop_all()
            for sig, handler in previous_handlers.items():
                signal.signal(sig, handler)
        count_tenant_ooms(records, sorted(logs.glob("agent-*.log")))
        count_preemptions(records, logs / "coordinator.log")
        if records:
            print()
            print("summary (the same workload, and the same other tenants' load, for each policy)")
            print(render_summary([_figures(r) for r in records]))
            print("wait: submission to placement, by the coordinator's clock")
            print("util: every GPU sampled once a second during the phase's window; std and max - min are across")
            print("      GPUs, averaged over the samples")
            print("temperatures carry over: the second phase starts on cards still warm from the first")
            for record in records:
                for task_id, why in record.refused[:3]:
                    print(f"refused: {task_id}: {why}")
        unclean = [(n, rc) for n, rc in results if rc not in (0, -signal.SIGTERM)]
        if len(records) < len(POLICY_ORDER) and not unclean:
            print("the coordinator's log ends:")
            print((logs / "coordinator.log").read_text(errors="replace")[-1500:])
        for name, rc in unclean:
            print(f"{name} exited with {rc}; its log ends:")
            print((logs / f"{name}.log").read_text(errors="replace")[-2000:])
        if logs != tmp:
            print(f"logs kept in {logs}")
        print("all processes stopped" if not unclean else "some processes did not stop cleanly")
        return 0 if ok and not unclean else 1


def _figures(record: _PhaseRecord) -> PhaseFigures:
    return phase_figures(
        record.policy,
        [_outcome(t) for t in record.tasks],
        record.samples,
        record.sla_misses,
        refused=len(record.refused),
        tenant_ooms=record.tenant_ooms,
        preempted=record.preempted,
    )


def count_tenant_ooms(records: Sequence[_PhaseRecord], agent_logs: Iterable[Path]) -> None:
    """Set each phase's ``tenant_ooms``: the simulated hosts' ``sim_tenant_oom``
    events (another tenant's job refused memory gpulb's tasks held; JSON log
    lines) whose time falls in the phase. Only the simulator knows of them: on
    real hosts the refused process is not gpulb's to see."""
    times = _event_times(agent_logs, "sim_tenant_oom")
    for record in records:
        if record.ended_at > record.started_at:
            record.tenant_ooms = sum(1 for t in times if record.started_at <= t <= record.ended_at)


def count_preemptions(records: Sequence[_PhaseRecord], coordinator_log: Path) -> None:
    """Set each phase's ``preempted``: the coordinator's ``task_preempted``
    events (a lease evicted for a P0 task) whose time falls in the phase."""
    times = _event_times([coordinator_log], "task_preempted")
    for record in records:
        if record.ended_at > record.started_at:
            record.preempted = sum(1 for t in times if record.started_at <= t <= record.ended_at)


def _event_times(logs: Iterable[Path], event_name: str) -> list[float]:
    """Unix times of the JSON log lines whose event is ``event_name``."""
    needle = f'"{event_name}"'
    times: list[float] = []
    for path in logs:
        if not path.exists():
            continue
        for line in path.read_text(errors="replace").splitlines():
            if needle not in line:
                continue
            try:
                event = json.loads(line)
                if event.get("event") == event_name:
                    times.append(datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp())
            except (ValueError, KeyError, TypeError, AttributeError):
                continue  # a torn last line of a killed process
    return times
