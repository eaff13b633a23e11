"""``gpulb demo``: a coordinator and simulated agents as real processes on
loopback, balancing a mixed GPU workload first with round_robin and then with
load_aware (switched with SetPolicy), and a side-by-side summary of the two.

Every child is stopped on the way out (also on Ctrl-C, SIGTERM or SIGHUP; a
second one while stopping kills what is left). The children get the caller's
environment without GPULB_*: the demo configures them itself. The exit code
is 0 only when both phases placed tasks and every child stopped cleanly, 128
+ the signal's number when a signal stopped the demo, 2 for a flag value it
cannot use, else 1. The workload itself is ``coordinator.demo_workload``.
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
from typing import Callable, Iterable, Mapping, Sequence, TextIO

import grpc

from coordinator.demo_workload import SCENARIOS, DemoTask, build_workload
from coordinator.sandbox import UnitSeccomp, launcher_argv
from coordinator.tables import fmt, render_table
from protos import cluster_pb2 as cpb
from protos import cluster_pb2_grpc as cpb_grpc
from protos import tasks_pb2 as tpb
from protos import tasks_pb2_grpc as tpb_grpc
from scheduler.task import MAX_GPUS

__all__ = [
    "run_demo",
    "free_port",
    "ProcessGroup",
    "ChildExited",
    "child_environment",
    "popen_as",
    "can_deny_write_execute",
    "add_demo_arguments",
    "GpuReading",
    "TaskOutcome",
    "PhaseFigures",
    "phase_figures",
    "render_summary",
    "POLICY_ORDER",
    "MAX_AGENTS",
    "MIN_DURATION_S",
    "MAX_DURATION_S",
]

#: the phases, in order: the naive baseline first
POLICY_ORDER = ("round_robin", "load_aware")
#: s a P0 task may wait before it is an SLA miss (SchedulerConfig.p0_sla_s)
P0_SLA_S = 5.0
_RPC_TIMEOUT_S = 5.0
_ACTIVE = (tpb.TASK_STATE_QUEUED, tpb.TASK_STATE_LEASED)
#: s between a lease holder's checks that its lease is still its own
_HOLDER_CHECK_S = 1.0


#: simulated hosts at most. Each is an agent process of about 75 MiB RSS (64
#: took 4.7 GiB in a first-run QA pass) and a share of this one machine's
#: CPUs: 64 fit a typical workstation and show balancing as well as more
#: would; --agents 1000 would exhaust its memory instead.
MAX_AGENTS = 64
#: s of submissions at most (half per policy): an hour. The workload is built
#: up front (64 hosts x 64 GPUs for an hour: about 1.3 M tasks a phase, 9 s to
#: build), and a longer run shows nothing an hour does not.
MAX_DURATION_S = 3600.0
#: s of submissions at least: two 2 s windows still place tasks in both phases
MIN_DURATION_S = 4.0


def _bounded(kind: type, low: float, high: float):
    """An argparse ``type``: an integer (``kind`` int) or a finite number in
    [low, high]; the error names the range, as the other gpulb commands' do."""
    noun = "an integer" if kind is int else "a number"
    wanted = f"must be {noun} from {low:g} to {high:g}"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{wanted}, got {text!r}") from None
        if not (low <= value <= high):  # also NaN
            raise argparse.ArgumentTypeError(f"{wanted}, got {text!r}")
        return value

    parse.__name__ = "integer" if kind is int else "number"
    return parse


def add_demo_arguments(demo: argparse.ArgumentParser) -> None:
    demo.add_argument("--agents", type=_bounded(int, 1, MAX_AGENTS), default=6,
                      help=f"simulated hosts, 1..{MAX_AGENTS} (default 6; each agent takes about 75 MiB)")
    # the agent's own bound (gpulb-agent --sim-gpus): the coordinator takes at most MAX_GPUS a node
    demo.add_argument("--gpus-per-agent", type=_bounded(int, 1, MAX_GPUS), default=4,
                      help=f"simulated RTX 4090s per host, 1..{MAX_GPUS} (default 4)")
    demo.add_argument(
        "--duration", type=_bounded(float, MIN_DURATION_S, MAX_DURATION_S), default=60.0,
        help=f"s of submissions in all, half per policy, {MIN_DURATION_S:g}..{MAX_DURATION_S:g} (default 60); "
        "draining between phases adds a little",
    )
    demo.add_argument("--seed", type=int, default=0, help="workload and simulated-GPU seed (default 0)")
    demo.add_argument(
        "--background", choices=("idle", "synthetic"), default="synthetic",
        help="load on the GPUs besides the workload: synthetic (default: other tenants' jobs that come and go, "
        "deterministic for the agent seeds, which is what a load-aware placement must see) or idle (an empty cluster)",
    )
    demo.add_argument("--no-live", action="store_true", help="periodic log lines instead of a live table (logs and CI)")
    demo.add_argument("--log-dir", help="keep the coordinator's and agents' logs here, relative to the current "
                      "directory (default: a temporary directory, removed)")


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


class ChildExited(Exception):
    """A child stopped before the demo stopped it: the demo cannot go on."""

    def __init__(self, name: str, status: int) -> None:
        super().__init__(f"{name} exited with {status}")
        self.name = name
        self.status = status


class ProcessGroup:
    """Children started by the demo, each in its own process group so one
    signal stops it and anything it started. ``env``: their environment (None:
    this process's); ``cwd``: their working directory (None: this one's)."""

    def __init__(self, log_dir: Path, env: Mapping[str, str] | None = None, cwd: Path | None = None) -> None:
        self.log_dir = log_dir
        self.env = env
        self.cwd = cwd
        self.procs: list[tuple[str, subprocess.Popen]] = []
        #: children stop_all killed at once because ``hurry`` said so
        self.killed: list[str] = []

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
            env={**(os.environ if self.env is None else self.env), "PYTHONUNBUFFERED": "1"}, cwd=self.cwd,
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

    def exited(self) -> list[tuple[str, int]]:
        """The children that have exited, with their exit statuses."""
        return [(name, proc.returncode) for name, proc in self.procs if proc.poll() is not None]

    def raise_if_exited(self) -> None:
        """``ChildExited`` for the first child that has exited: one the demo
        has not stopped yet exited early."""
        for name, status in self.exited():
            raise ChildExited(name, status)

    def stop_all(self, grace_s: float = 8.0, hurry: Callable[[], bool] | None = None) -> list[tuple[str, int | None]]:
        """SIGTERM everyone, wait up to ``grace_s``, SIGKILL the rest; SIGKILL
        the rest at once when ``hurry()`` turns true while waiting (a second
        Ctrl-C), and name those in ``killed``."""
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        while alive := [(name, proc) for name, proc in self.procs if proc.poll() is None]:
            hurried = hurry is not None and hurry()
            if hurried or time.monotonic() >= deadline:
                for name, proc in alive:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    if hurried:
                        self.killed.append(name)
                for _, proc in alive:
                    proc.wait()
                break
            time.sleep(0.05)  # a poll, not a blocking wait: a second signal must not wait on a child
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
    lines every ``log_every_s``.

    The live frame is moved over by counting its lines, so no line of it may
    wrap: every line is cut to the terminal's width, less one column (a line
    that fills the last column wraps early on some terminals), and the frame
    to its height, less the bar's line and one spare."""

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

    def update(self, now: float, progress: str, frac: float, status: Sequence[str], gpus: Sequence[cpb.Gpu]) -> None:
        """``status``: the parts of the status line (phase, task counts,
        utilisation); a log line joins them, the live frame wraps between
        them."""
        size = shutil.get_terminal_size((120, 50))
        width = max(20, size.columns - 1)
        if self.live:
            self._clear_bar()
            head = _wrap_parts(status, width)
            table = _gpu_table(gpus, max_lines=max(3, size.lines - 2 - len(head)), max_width=width)
            frame = "\n".join([*head, table]) + "\n"
            if self._lines:
                self.out.write(f"\x1b[{self._lines}F\x1b[J")
            self.out.write(frame)
            self.out.flush()
            self._lines = frame.count("\n")
        elif now - self._last_log >= self.log_every_s:
            self._last_log = now
            self._clear_bar()
            self.out.write(" | ".join([" ".join(status[:-1]), status[-1]]) + "\n")
            self.out.flush()
        if self.bar:
            bar_width = 30
            filled = int(max(0.0, min(1.0, frac)) * bar_width)
            line = f"{progress} [{'#' * filled}{'.' * (bar_width - filled)}]"
            self.err.write(f"\r{line[:width]}\x1b[K")
            self.err.flush()
            self._bar_shown = True

    def close(self) -> None:
        self._clear_bar()


def _wrap_parts(parts: Sequence[str], width: int) -> list[str]:
    """``parts`` joined by two spaces into lines of at most ``width``: a part
    goes to the next line rather than be split; one longer than ``width`` is
    cut."""
    lines: list[str] = []
    for part in parts:
        if lines and len(lines[-1]) + 2 + len(part) <= width:
            lines[-1] += "  " + part
        else:
            lines.append(part[:width])
    return lines


def _fits(table: str, max_lines: int, max_width: int) -> bool:
    rows = table.splitlines()
    return len(rows) <= max_lines and max(map(len, rows)) <= max_width


def _side_by_side(headers: list[str], rows: list[list[object]], align: str) -> str:
    """The table in two halves, the second to the right of the first."""
    half = (len(rows) + 1) // 2
    blank = [""] * len(headers)
    joined = [rows[i] + ["|"] + (rows[half + i] if half + i < len(rows) else blank) for i in range(half)]
    return render_table(headers + ["|"] + headers, joined, align=align + "l" + align)


def _gpu_table(gpus: Sequence[cpb.Gpu], max_lines: int = 1_000, max_width: int = 1_000) -> str:
    """Every GPU, in the first layout that fits ``max_lines`` x
    ``max_width`` (a frame taller or wider than the terminal cannot be
    redrawn in place):

    * one GPU a row (about 55 columns);
    * that table in two side-by-side halves (about 115 columns);
    * one node a row: each GPU's utilisation in index order, the node's
      memory, hottest GPU and tasks (about 50 columns with 4 GPUs a node;
      more GPUs wrap onto further lines), in two halves when that fits;
    * that, cut to ``max_lines`` with a last line saying how many nodes
      were left out; and any line still too wide is cut to ``max_width``.
    """
    rows: list[list[object]] = []
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
    table = render_table(headers, rows, align=align)
    if _fits(table, max_lines, max_width):
        return table
    if len(rows) > 1 and _fits(folded := _side_by_side(headers, rows, align), max_lines, max_width):
        return folded
    return _node_table(gpus, max_lines, max_width)


def _node_table(gpus: Sequence[cpb.Gpu], max_lines: int, max_width: int) -> str:
    """One node a row (``_gpu_table``'s compact layouts)."""
    nodes: dict[str, list[cpb.Gpu]] = {}
    for g in gpus:
        nodes.setdefault(g.node_id, []).append(g)
    summary: list[tuple[str, list[str], str, str, int]] = []  # node, util cells, memory, hottest, tasks
    for node, cards in nodes.items():
        cards = sorted(cards, key=lambda g: g.index)
        utils = [f"{g.util_gpu_pct:3.0f}" if g.HasField("util_gpu_pct") else "  -" for g in cards]
        known = [g for g in cards if g.HasField("memory_used_mib") and g.HasField("memory_total_mib")]
        mem = (f"{sum(g.memory_used_mib for g in known) / 1024:.1f}/{sum(g.memory_total_mib for g in known) / 1024:.1f}"
               if known else "-")
        temps = [g.temperature_c for g in cards if g.HasField("temperature_c")]
        summary.append((node, utils, mem, fmt(max(temps) if temps else None, 0), sum(g.active_tasks for g in cards)))
    headers, align = ["NODE", "UTIL % BY GPU", "MEM GiB", "HOT C", "TASKS"], "llrrr"
    # the utilisation cells wrap onto as many lines as the other columns leave room for
    others = sum(max(len(h), *(len(str(row[i])) for row in summary)) for i, h in zip((0, 2, 3, 4), headers[:1] + headers[2:]))
    per_line = max(1, (max_width - others - 2 * (len(headers) - 1) + 1) // 4)
    rows: list[list[object]] = []
    for node, utils, mem, hot, tasks in summary:
        chunks = [utils[i:i + per_line] for i in range(0, len(utils), per_line)]
        rows.append([node, " ".join(chunks[0]), mem, hot, tasks])
        rows.extend(["", " ".join(chunk), "", "", ""] for chunk in chunks[1:])
    table = render_table(headers, rows, align=align)
    if _fits(table, max_lines, max_width):
        return table
    if len(rows) == len(summary) > 1 and _fits(folded := _side_by_side(headers, rows, align), max_lines, max_width):
        return folded
    if len(rows) + 2 <= max_lines:  # only too wide (a very narrow terminal): cut the lines
        return "\n".join(line[:max_width] for line in table.splitlines())
    # too many nodes for the terminal: the first ones, and a line for the rest
    shown = rows[: max(0, max_lines - 3)]  # less the header, its rule and that line
    if len(shown) < len(rows) and not rows[len(shown)][0]:
        # the cut falls among one node's lines: leave that node out whole
        while shown and not shown[-1][0]:
            shown.pop()
        if shown:
            shown.pop()
    left_out = len(summary) - sum(1 for row in shown if row[0])
    lines = render_table(headers, shown, align=align).splitlines()
    lines.append(f"... {_plural(left_out, 'more node')} (a taller terminal shows them)")
    return "\n".join(line[:max_width] for line in lines)


def _plural(n: int, noun: str) -> str:
    """``n noun``, with an s unless n is 1."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


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
    check: Callable[[], None],
) -> None:
    """Once a second until the phase is drained (or ``drain_s`` after its
    window): sample every GPU (kept while the window lasts), count the
    phase's tasks, show both. ``check`` raises when the demo must stop (a
    stop signal, a child that exited)."""
    policy = record.policy
    draining_since: float | None = None
    next_tick = t0
    while True:
        check()
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
        status = [f"[{policy} {stage}]", _counts(tasks), _spread(readings)]
        display.update(elapsed, f"{policy:<12} {stage:<20}", frac, status, gpus)
        next_tick += 1.0
        time.sleep(max(0.0, next_tick - time.monotonic()))


def _run_phase(
    target: str, number: int, policy: str, workload: list[DemoTask], window_s: float, drain_s: float,
    display: _Display, check: Callable[[], None],
) -> _PhaseRecord:
    record = _PhaseRecord(policy)
    prefix = f"{policy}/"
    with grpc.insecure_channel(target) as channel:
        sched = tpb_grpc.SchedulerStub(channel)
        ops = cpb_grpc.ClusterOperatorStub(channel)
        active = sched.SetPolicy(tpb.SetPolicyRequest(name=policy), timeout=_RPC_TIMEOUT_S)
        sla_before = sched.GetQueue(tpb.GetQueueRequest(), timeout=_RPC_TIMEOUT_S).sla_misses
        by_scenario: dict[str, list[DemoTask]] = {}
        for task in workload:
            by_scenario.setdefault(task.scenario, []).append(task)
        # one client a scenario that has tasks (a 1-GPU host gets no LoRA fine-tunes)
        display.message(
            f"phase {number}/{len(POLICY_ORDER)}: policy {active.name} (SetPolicy, no restart); "
            f"{_plural(len(workload), 'task')} over {window_s:g} s from {_plural(len(by_scenario), 'concurrent client')}"
        )
        t0 = time.monotonic()
        record.started_at = time.time()
        # The clients stop with the phase, or at once on Ctrl-C.
        phase_stop = threading.Event()
        clients = [_Client(target, prefix, tasks, t0, phase_stop) for tasks in by_scenario.values()]
        try:
            for client in clients:
                client.start()
            _watch_phase(record, sched, ops, prefix, clients, t0, window_s, drain_s, display, check)
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


def _wait_for_gpus(target: str, count: int, timeout_s: float, check_children: Callable[[], None]) -> list[cpb.Gpu]:
    """ListGpus until ``count`` GPUs report or ``timeout_s`` passes;
    ``check_children`` raises as soon as a child has exited (a coordinator
    or agent that refused its configuration will never report)."""
    deadline = time.monotonic() + timeout_s
    gpus: list[cpb.Gpu] = []
    with grpc.insecure_channel(target) as ch:
        stub = cpb_grpc.ClusterOperatorStub(ch)
        while time.monotonic() < deadline:
            check_children()
            try:
                gpus = list(stub.ListGpus(cpb.ListGpusRequest(), timeout=2).gpus)
            except grpc.RpcError:
                gpus = []
            if len([g for g in gpus if g.HasField("util_gpu_pct")]) >= count:
                return gpus
            time.sleep(0.2)
    return gpus


class _Interrupted(Exception):
    """SIGINT, SIGTERM or SIGHUP asked the demo to stop."""


#: the signals that stop the demo: Ctrl-C, kill / systemd, and a closed
#: terminal or dropped SSH session (SIGHUP: it would otherwise end the demo
#: without removing its temporary directory)
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _StopSignals:
    """The demo's handling of ``_STOP_SIGNALS``. The first one raises
    ``_Interrupted`` where the demo is (its phases then stop); any later
    one, or any one once the demo is already stopping, only counts: while
    the children are being stopped it means "stop at once" (``hurry``), and
    raising there would leave a traceback and children not waited for."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._raising = True
        self._stopping = False
        self._hurry_at = 1
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():  # signal.signal works only there
            self._previous = {sig: signal.signal(sig, self._handle) for sig in _STOP_SIGNALS}

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum: int, frame) -> None:
        self.received.append(signum)
        if self._raising:
            self._raising = False
            raise _Interrupted(signal.Signals(signum).name)

    def check(self) -> None:
        """Raise for a signal whose exception was lost: one raised from the
        handler while a blocking gRPC call runs can be swallowed inside grpc
        (a SIGINT let a test's demo run to its end once), so the phase loop
        also checks once a second."""
        if self.received and not self._stopping:
            raise _Interrupted(signal.Signals(self.received[0]).name)

    def stopping(self) -> None:
        """The demo is stopping its children: a signal from now on hurries
        it, or the second one when a signal is what stopped it. Only the
        first call counts."""
        if not self._stopping:
            self._raising = False
            self._stopping = True
            self._hurry_at = 2 if self.received else 1

    def hurry(self) -> bool:
        return len(self.received) >= self._hurry_at

    @property
    def first(self) -> int | None:
        return self.received[0] if self.received else None


#: variables of the caller's environment the demo's children do not get.
#: GPULB_* configure the coordinator (GPULB_TOKEN_FILE, GPULB_METRICS_LISTEN,
#: GPULB_SCHEDULER_*) and are also the CLI's (GPULB_COORDINATOR, GPULB_TOKEN_FILE,
#: exported by operators as the README shows); the demo is a self-contained
#: loopback lab configured by its own flags alone. systemd's per-service
#: variables name the demo's own process, not its children.
_CHILD_ENV_DROPPED = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES")


def child_environment(environ: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """The environment of the demo's coordinator and agents: ``environ``
    (PATH, HOME, PYTHONPATH, TMPDIR, ...) without GPULB_* and
    ``_CHILD_ENV_DROPPED``; and the GPULB_* names left out."""
    gpulb = sorted(name for name in environ if name.startswith("GPULB_"))
    env = {k: v for k, v in environ.items() if not k.startswith("GPULB_") and k not in _CHILD_ENV_DROPPED}
    return env, gpulb


#: the directory that holds this gpulb's packages: the children's working
#: directory, so ``python -m coordinator.main`` runs this very gpulb whatever
#: directory the demo was started from (one with a coordinator/ of its own
#: would shadow it)
_PACKAGE_ROOT = Path(__file__).resolve().parent.parent


class _UsageError(Exception):
    """A flag's value the demo cannot use: an argparse-style error, exit 2."""


def _prepare_log_dir(text: str) -> Path:
    """``--log-dir`` as an absolute path (a relative one is the caller's
    working directory's), created, writable and without the agent logs of an
    earlier run with more agents (they would read as this run's)."""
    path = Path(text).expanduser().absolute()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise _UsageError(f"argument --log-dir: {path} exists and is not a directory") from None
    except OSError as exc:
        raise _UsageError(f"argument --log-dir: cannot create {path}: {exc.strerror}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise _UsageError(f"argument --log-dir: cannot write to {path}")
    for old in path.glob("agent-*.log"):
        if old.stem.removeprefix("agent-").isdigit():
            old.unlink(missing_ok=True)
    return path


def _check_arguments(args: argparse.Namespace) -> None:
    """The bounds the parser's types enforce, for callers that build
    ``args`` themselves."""
    if not 1 <= args.agents <= MAX_AGENTS:
        raise _UsageError(f"argument --agents: must be an integer from 1 to {MAX_AGENTS}, got {args.agents!r}")
    if not 1 <= args.gpus_per_agent <= MAX_GPUS:
        raise _UsageError(f"argument --gpus-per-agent: must be an integer from 1 to {MAX_GPUS}, got {args.gpus_per_agent!r}")
    if not MIN_DURATION_S <= args.duration <= MAX_DURATION_S:
        raise _UsageError(f"argument --duration: must be a number from {MIN_DURATION_S:g} to {MAX_DURATION_S:g}, "
                          f"got {args.duration!r}")


def _usage_error(args: argparse.Namespace, message: str) -> int:
    """The parser's own error (usage, message, exit 2) when the CLI gave one."""
    error = getattr(args, "usage_error", None)
    if error is not None:
        error(message)  # exits
    print(f"gpulb demo: error: {message}", file=sys.stderr)
    return 2


def _status_text(status: int | None) -> str:
    if status is not None and status < 0:
        try:
            return f"was killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"was killed by signal {-status}"
    return f"exited with status {status}"


def _log_tail(path: Path, lines: int = 10) -> str:
    """The last whole ``lines`` of a child's log, indented."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "  (no log)"
    tail = text.splitlines()[-lines:]
    return "\n".join(f"  {line}" for line in tail) if tail else "  (its log is empty)"


def _leave_the_terminal() -> None:
    """After SIGHUP the terminal is gone: further writes to it could fail
    (EIO) and stop the clean-up half-way, so what still goes to a terminal
    goes nowhere. A file or pipe keeps getting the demo's output."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream.isatty():
                stream.flush()
                os.dup2(devnull, stream.fileno())
        except (OSError, ValueError, AttributeError):
            pass
    os.close(devnull)


def run_demo(args: argparse.Namespace) -> int:
    """The demo; its exit status: 0 when both phases placed tasks and every
    child stopped cleanly, 128 + the signal's number when a signal stopped
    it (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP), 2 for a flag it cannot use,
    else 1."""
    try:
        _check_arguments(args)
        logs_kept = _prepare_log_dir(args.log_dir) if getattr(args, "log_dir", None) else None
    except _UsageError as exc:
        return _usage_error(args, str(exc))
    port = free_port()
    target = f"127.0.0.1:{port}"
    expected = args.agents * args.gpus_per_agent
    window_s = args.duration / 2
    drain_s = max(5.0, min(20.0, window_s / 2))
    workload = build_workload(args.seed, window_s, args.agents, args.gpus_per_agent)
    live = sys.stdout.isatty() and not args.no_live
    display = _Display(sys.stdout, sys.stderr, live, log_every_s=min(5.0, max(1.0, window_s / 5)))
    py = sys.executable
    env, ignored = child_environment(os.environ)
    records: list[_PhaseRecord] = []
    phase = 0  # the phase running, 0 while starting
    reported: set[str] = set()  # children whose early exit was told at once
    ok = False
    stop = _StopSignals()
    with ExitStack() as stack:
        stack.callback(stop.restore)  # last: the handlers stay while the temporary directory goes
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gpulb-demo-")))
        logs = logs_kept or tmp
        group = ProcessGroup(logs, env=env, cwd=_PACKAGE_ROOT)

        def check() -> None:
            stop.check()
            group.raise_if_exited()

        try:
            stop.install()
            counts = Counter(t.scenario for t in workload)
            print(
                f"gpulb demo: coordinator on {target}, {_plural(args.agents, 'simulated host')} x "
                f"{args.gpus_per_agent} RTX 4090 "
                f"({args.background} background load{', replayed from its start for each policy' if args.background == 'synthetic' else ''}), "
                f"seed {args.seed}"
                + (f"; logs kept in {logs_kept}" if logs_kept else "")
            )
            if ignored:
                print(f"ignoring {', '.join(ignored)} from the environment: the demo's coordinator and agents "
                      "take their settings from the demo alone")
            print(
                f"workload per phase ({window_s:g} s, the same for both policies): "
                + ", ".join(f"{counts[s]} x {label}" for s, (_, label) in SCENARIOS.items())
                + ("" if counts["lora-finetune"] else " (a LoRA fine-tune needs 2 GPUs on one host: --gpus-per-agent 2 or more)")
            )
            lora = sorted(t.run_s for t in workload if t.scenario == "lora-finetune")
            if lora:
                runs = f"{lora[0]:g}" if lora[0] == lora[-1] else f"{lora[0]:g}-{lora[-1]:g}"
                print(f"times are compressed for the demo: LoRA fine-tunes that take minutes run {runs} s here")
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
            gpus = _wait_for_gpus(target, expected, timeout_s=60, check_children=check)
            reporting = len([g for g in gpus if g.HasField("util_gpu_pct")])
            print(f"{reporting} of {_plural(expected, 'GPU')} reporting")
            if reporting >= expected:
                for number, policy in enumerate(POLICY_ORDER, start=1):
                    phase = number
                    check()
                    if args.background == "synthetic":
                        # Both phases meet the same other tenants' load
                        # (SimBackend.rewind_background), not whatever the
                        # synthetic timeline reached by the second phase.
                        group.signal("agent-", signal.SIGUSR1)
                        time.sleep(2.5)  # a calm agent's next round (2 s) shows it to the coordinator
                    record = _run_phase(target, number, policy, workload, window_s, drain_s, display, check)
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
            if not stop.received:  # KeyboardInterrupt: the handlers were not ours (not the main thread)
                stop.received.append(signal.SIGINT)
            stop.stopping()
            if stop.first == signal.SIGHUP:
                _leave_the_terminal()
            display.close()
            print(f"\n{signal.Signals(stop.first).name} {_when(phase, records)}: stopping the cluster")
        except ChildExited:
            stop.stopping()
            display.close()
            _tell_early_exit(group, logs, reported)
        except grpc.RpcError as exc:
            stop.stopping()
            display.close()
            if group.exited():  # the call failed because the coordinator (or an agent) is gone
                _tell_early_exit(group, logs, reported)
            else:
                print(f"gpulb demo: coordinator call failed: {exc.code().name}: {exc.details()}")
        finally:
            stop.stopping()
            results = group.stop_all(hurry=stop.hurry)
        if group.killed:
            print(f"{signal.Signals(stop.received[-1]).name} again: killed {', '.join(group.killed)} "
                  "instead of waiting for a clean stop")
        count_tenant_ooms(records, [logs / f"{name}.log" for name, _ in results if name.startswith("agent-")])
        count_preemptions(records, logs / "coordinator.log")
        interrupted = stop.first
        if records:
            print()
            same = ("the same workload, and the same other tenants' load, for each policy"
                    if args.background == "synthetic" else "the same workload for each policy, no other tenants' load")
            if len(records) < len(POLICY_ORDER):
                print(f"partial summary: {'interrupted' if interrupted else 'stopped'} {_when(phase, records)}; "
                      "the finished phases only")
            else:
                print(f"summary ({same})")
            print(render_summary([_figures(r) for r in records]))
            print("wait: submission to placement, by the coordinator's clock")
            print("util: every GPU sampled once a second during the phase's window; std and max - min are across")
            print("      GPUs, averaged over the samples")
            if len(records) > 1:
                print("temperatures carry over: the second phase starts on cards still warm from the first")
            for record in records:
                for task_id, why in record.refused[:3]:
                    print(f"refused: {task_id}: {why}")
        elif interrupted:
            print(f"no summary: interrupted {_when(phase, records)}, before a phase finished")
        unclean = [(n, rc) for n, rc in results
                   if rc not in (0, -signal.SIGTERM) and n not in reported and n not in group.killed]
        if len(records) < len(POLICY_ORDER) and not (unclean or reported or interrupted):
            # the coordinator served but the demo could not go on (GPUs that never reported, a failed call)
            print("the coordinator's log ends:")
            print(_log_tail(logs / "coordinator.log"))
        for name, rc in unclean:
            print(f"{name} {_status_text(rc)} when stopped; its log ends:")
            print(_log_tail(logs / f"{name}.log"))
        if logs_kept:
            print(f"logs kept in {logs_kept}")
        print("all processes stopped" if not unclean else "some processes did not stop cleanly")
        if interrupted:
            return 128 + interrupted
        return 0 if ok and not unclean else 1


def _when(phase: int, records: Sequence[_PhaseRecord]) -> str:
    """When the demo was interrupted: while starting, during a phase, or
    between two (``phase`` finished, the next not begun)."""
    if not phase:
        return "while starting"
    if len(records) >= phase:
        return f"after phase {phase} of {len(POLICY_ORDER)}"
    return f"during phase {phase} of {len(POLICY_ORDER)} ({POLICY_ORDER[phase - 1]})"


def _tell_early_exit(group: ProcessGroup, logs: Path, reported: set[str]) -> None:
    """Say which children exited before the demo stopped them, how, and how
    each one's log ends: the first, and usually the only, reason the demo
    cannot go on (a refused configuration, a bad flag)."""
    for name, status in group.exited():
        print(f"gpulb demo: {name} {_status_text(status)} before the demo stopped it; its log ends:")
        print(_log_tail(logs / f"{name}.log"))
        reported.add(name)


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
