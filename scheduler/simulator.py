"""Trace-driven simulation of a GPU cluster on a virtual clock, placing tasks
with the very scheduler the coordinator runs.

``Simulation`` replays a trace (``scheduler.traces``) into a modelled cluster
(``scheduler.cluster``). Placement is never re-implemented here: a
``scheduler.engine.Scheduler`` with its queue, filters, scores, policies and
reservations receives every submission and every completion and decides every
placement, from a ``ClusterSnapshot`` the simulator builds out of delayed,
smoothed telemetry. What the simulator adds is the world the scheduler cannot
see directly.

The model
=========

Load. A running task puts ``util`` % (else ``100 * gpu_share``) on each of its
GPUs. A GPU's true utilisation is ``min(100, sum of its tasks' util)``.

Speed and sharing. A task's ``duration_s`` is its run time alone on a speed-1.0
GPU (RTX 4090). It progresses at ``speed(node) * min over its GPUs of
min(1, 100 / demand(g))``: a GPU asked for more than 100 % is shared in
proportion (processor sharing), so stacking tasks on one GPU slows all of them.
Finish times are recomputed whenever a GPU's demand changes.

Real memory. What a task really uses differs from its ``vram_mib`` ask. The
default ``GenAIMemory`` draws it from the measured GenAI series
(``agent.replay.load_genai``: 144 Stable Diffusion serving pods, one reading a
minute for 22.8 h): each pod's series is divided by the pod's own median, so a
value is "real use / typical use" (pooled: p5 0.64, p50 1.0, p90 1.11, p95
1.16, p99 1.43, max 2.1). A task is treated as asking for its typical use: it
draws a pod and a start minute at random (seeded, in trace order, so every
policy replays the same draws), cuts its run into ``n = clip(ceil(duration /
57 s), 1, 4)`` equal phases of work, and uses ``ask * ratio`` in phase ``i``,
the ratio read from that pod at the start of the ``i``-th of ``n`` consecutive
stretches of ``min(duration, 22.8 h)``. Consecutive readings of one pod keep
the series' own persistence (a pod that runs high stays high). Tests use
``AskedMemory`` (real = ask) or ``RatioMemory`` (ratios given per task).

Out-of-memory kills. When a task's start or a phase's growth takes a GPU's real
memory beyond its capacity, that task's allocation fails (the newcomer or the
grower dies, not its neighbours): it is killed, counted, its lease completed
as failed, and it is submitted again at once with its ask raised to the use
that killed it (a user re-running with a bigger request), from zero progress,
up to ``max_attempts`` runs in all; after that, or when the raised ask fits
no GPU (REJECTED), it counts as dropped.

Prediction and rebalancing. Both learners run by default, because the
coordinator always runs them (its advisor runtime annotates every snapshot
it places from). ``prediction``: a ``scheduler.predictor.SpeedPredictor``
learns slowdowns from every completed run (starting from the cluster file's
speeds, ``prediction_prior``), against the estimate the client gave (the
trace's ``estimate_s``, else its duration), as the coordinator learns from
the spec's ``duration_s``; snapshots carry its columns for the load-aware
``completion`` term and the backfill's run-time arithmetic.
``memory_learning``: every run that ends reports its peak over its ask to
a ``scheduler.memgrowth.MemoryGrowth`` (a completed run the largest phase
use it went through, a killed one the use that killed it: what an agent
reports in its task event), and snapshots carry the learned ratios for the
``oom_risk`` term. The run's ask is what it
reports against, so a re-run with a raised ask reports a smaller ratio, as it
would on a real cluster. Turning either off (``--no-prediction``,
``--no-memory-learning``) shows what it is worth. The rebalance advisor
(``advisor``) is off unless configured; its plans are carried out as an
executor does through the coordinator's MigrateTask (``Scheduler.migrate``:
the lease moves to the destination in one step, the restart never queues),
with a checkpoint-and-restart cost (``migration_cost_s``). The scheduler's
preemption runs as it does in the coordinator (``SchedulerConfig.preemption``):
a lease it evicts for a P0 task stops at once (its memory shows free after
the sampling delay, when the P0 task can start); a movable task resumes with
the same restart cost, any other starts over.

Telemetry. The scheduler sees what the coordinator's view would show, not the
truth. A change is first sampled ``sample_delay_s`` later (the agent's stable
sampling interval; the agent then samples every ``fast_sample_s``). A step
larger than the coordinator's anomaly floor (2 % util, 64 MiB) is, for its
filter, a level shift: rejected as an anomaly until ``persist`` readings in a
row agree and then snapped to, so it becomes visible ``sample_delay_s +
(persist - 1) * fast_sample_s`` after it happened (2.4 s by default) in one
step. A smaller step glides in by the view's EWMA (alpha 0.3 per reading).
The forecast is the smoothed level (simple exponential smoothing), the trend
0, temperature ``35 + 0.4 * util`` °C. Between placements the engine's own
reservations cover what the readings do not show yet (its "assume" step).
Because the readings of a finished task's memory only drop 2.4 s later, the
simulator dispatches on every submission and completion (as the coordinator
does) and once more when a release becomes visible, while tasks are queued.

Snapshots. A snapshot is rebuilt only when the readings it would show have
moved since the last one (an observation arrived, or an EWMA glide was still
running when it was taken); otherwise the same object is passed again, and
the engine keeps using its view, patched per placement, exactly as it does
between two metrics ticks of the coordinator.

Leases never expire (lease length 10^12 s): the simulated agents never die.

Measurement window. Utilisation figures integrate the true per-GPU
utilisation over the *arrival window*: from the submission of the task at the
first percentile (openb's first 1 % of tasks trickle in over 115 days, before
the 34 busy ones) to the last submission (while the trace offers load; the
drain-out after it says more about the trace's longest task than about
placement). When the submissions have no spread (every task at time 0, or a
burst at one instant T) the window runs from the first submission to the
last completion. The makespan counts from the first submission too.

Saturation (``saturate``). The FGD paper's measure: tasks arrive one after the
other in trace order (cycling through the trace when it runs out) and never
end; each is placed at once or cancelled when it does not fit. It reports
the share of GPU capacity left unallocated when the first task does not fit,
and when the arrived workload reaches the cluster's GPU count.

Engine adapter, and what the simulator needs from the engine
============================================================

``ColumnarReservations`` (below) is passed to the ``Scheduler`` as its
``reservations``: a ``Reservations`` subclass with the same bookkeeping that
also mirrors each GPU's stack (baseline, MiB, %, leases) in arrays over the
simulator's fixed GPU order, so ``columns`` is a few vector operations with
no Python pass over the reserved GPUs (5,000 leases: 1.7 ms a fresh snapshot
with the engine's own gather, 0.07 ms here).
``tests/test_simulator.py`` checks it against the base class on random
sequences; ``SimConfig.columnar_reservations = False`` runs the engine's own.

Still wanted from ``scheduler.view`` (measured on openb, 6,212 GPUs): each new
snapshot rebuilds data that depends only on the topology: the ``row_of``
dict (0.7 ms), ``node_has_nvlink`` (0.2 ms) and ``_nvlink_peers`` (0.2 ms),
about 60 % of a whole simulation. Reusing them when a snapshot shares its
``gpu_uuid`` and ``node_nvlink`` objects with the previous view's (the
simulator always passes the same ones) took the openb default replay from
48,000 to 88,000 tasks per minute in a monkeypatched experiment.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import os
import sys
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Mapping, Protocol, Sequence, TextIO

import numpy as np

from scheduler import setsearch
from scheduler.advisor import Advisor, AdvisorConfig, next_change_s
from scheduler.cluster import ClusterNode, convert_openb_nodes, homogeneous, read_cluster, write_cluster
from scheduler.config import SchedulerConfig
from scheduler.engine import Scheduler
from scheduler.errors import SchedulerError
from scheduler.memgrowth import MemoryGrowth, MemoryGrowthConfig
from scheduler.policies import POLICIES, make_policy
from scheduler.predictor import PredictorConfig, SpeedPredictor, model_speeds
from scheduler.reservations import Reservations, ReservedColumns
from scheduler.snapshot import ClusterSnapshot, NodeFacts
from scheduler.task import TaskState
from scheduler.traces import TraceTask, convert_openb, misestimate, read_trace, scale_trace

__all__ = [
    "REQUESTS_ONLY",
    "parse_policy",
    "policy_weights",
    "SimConfig",
    "MemoryModel",
    "AskedMemory",
    "RatioMemory",
    "GenAIMemory",
    "TaskRecord",
    "SimResult",
    "SaturationResult",
    "Simulation",
    "ColumnarReservations",
    "simulate",
    "saturate",
    "simulate_main",
    "trace_main",
]

_LEASE_S = 1e12  # leases never run out in the simulation


# ---- memory models ----------------------------------------------------------------------------


class MemoryModel(Protocol):
    """Real memory use of a task, as ratios to its ask, one per phase of work."""

    def ratios(self, task: TraceTask, index: int, rng: np.random.Generator) -> tuple[float, ...]:
        ...


class AskedMemory:
    """Real use equals the ask (one phase)."""

    def ratios(self, task: TraceTask, index: int, rng: np.random.Generator) -> tuple[float, ...]:
        return (1.0,)


class RatioMemory:
    """Given ratios per task id (equal phases of work); others use their ask."""

    def __init__(self, by_task: Mapping[str, Sequence[float]]) -> None:
        self._by_task = {k: tuple(float(x) for x in v) for k, v in by_task.items()}

    def ratios(self, task: TraceTask, index: int, rng: np.random.Generator) -> tuple[float, ...]:
        return self._by_task.get(task.task_id, (1.0,))


class GenAIMemory:
    """Real/asked ratios read from the measured GenAI memory series (module docstring)."""

    MAX_PHASES = 4

    def __init__(self, trace_dir: str | os.PathLike[str] | None = None) -> None:
        from agent.replay import load_genai  # the replay module owns reading the tarballs

        series = load_genai(trace_dir)
        self.pods: list[np.ndarray] = []
        step = 60.0
        for s in series:
            values = s.memory_mib
            if values.size < 10:
                continue
            median = float(np.median(values))
            if median <= 0:
                continue
            self.pods.append(values / median)
            step = s.step_s
        if not self.pods:
            raise ValueError("the GenAI memory trace has no usable pod series")
        self.step_s = float(step)

    def ratios(self, task: TraceTask, index: int, rng: np.random.Generator) -> tuple[float, ...]:
        pod = self.pods[int(rng.integers(len(self.pods)))]
        size = pod.size
        start = int(rng.integers(size))
        phases = int(min(self.MAX_PHASES, max(1, math.ceil(task.duration_s / self.step_s))))
        span = min(size, max(1, int(round(task.duration_s / self.step_s))))
        return tuple(float(pod[(start + (i * span) // phases) % size]) for i in range(phases))


# ---- configuration and results -------------------------------------------------------------------


@dataclass(frozen=True)
class SimConfig:
    """Knobs of the simulated world (the scheduler's own are in ``scheduler``)."""

    seed: int = 0
    # s until a change is first sampled (the agent's stable sampling interval)
    sample_delay_s: float = 2.0
    # s between samples once readings move (the agent's fast sampling)
    fast_sample_s: float = 0.2
    # readings in a row that make a step a level shift (coordinator filter)
    persist: int = 3
    ewma_alpha: float = 0.3
    # steps at or below these glide in by EWMA; above, they snap after persist readings
    util_floor_pct: float = 2.0
    memory_floor_mib: float = 64.0
    # residual share of a glide below which a reading counts as settled
    settle_tolerance: float = 0.01
    # OOM-killed runs a task may have before it is dropped (runs in all)
    max_attempts: int = 3
    # real memory: "genai" (measured ratios), "asked" (real = ask) or a MemoryModel
    memory: object = "genai"
    # scheduler configuration; policy and lease length are set per run
    scheduler: SchedulerConfig | None = None
    # engine adapter (module docstring); False runs the engine untouched
    columnar_reservations: bool = True
    # heat-map samples of per-GPU utilisation over the window
    heatmap_samples: int = 120
    # stop at this virtual time (None: when every task has ended)
    horizon_s: float | None = None
    # ---- learning (module docstring, "Prediction and rebalancing") ----
    # learn speeds from completions and score placements with them (the
    # coordinator always does; False shows what it is worth)
    prediction: bool = True
    # where learned speeds start: "cluster" (the cluster file's speeds),
    # "table" (scheduler.cluster.KNOWN_MODELS only) or "none" (every model 1.0)
    prediction_prior: str = "cluster"
    predictor: PredictorConfig | None = None
    # learn how far tasks outgrow their asks from the runs that ended (their
    # peak use, or the use that killed them) and score placements with it
    # (the load-aware oom_risk term), as the coordinator does from its
    # agents' task events; False keeps the scheduler blind to growth
    memory_learning: bool = True
    memory_growth: MemoryGrowthConfig | None = None
    # the rebalance advisor; None runs without it
    advisor: AdvisorConfig | None = None
    # s between advisor evaluations
    advisor_interval_s: float = 30.0
    # s a migrated task loses on its new GPU (checkpoint, transfer, restart),
    # at that GPU's speed: it redoes cost * speed s of reference work
    migration_cost_s: float = 30.0
    # load drift after placement (module docstring): sigma of the log step of
    # a task's utilisation from one phase of work to the next; 0 = constant
    util_drift: float = 0.0
    # False: the scheduler gets no readings at all (every GPU reads 0 % and
    # 0 MiB), so it places by the tasks' asks only, as a scheduler without a
    # metrics pipeline does; a policy name "NAME@requests" sets it per run
    telemetry: bool = True

    @property
    def visible_after_s(self) -> float:
        """s from a level shift to the view showing it."""
        return self.sample_delay_s + (self.persist - 1) * self.fast_sample_s

    @property
    def settle_s(self) -> float:
        """s from a glide's first sample until it is within ``settle_tolerance``."""
        q = 1.0 - self.ewma_alpha
        if q <= 0:
            return 0.0
        k = math.ceil(math.log(self.settle_tolerance) / math.log(q))
        return (k - 1) * self.fast_sample_s


@dataclass(slots=True)
class TaskRecord:
    """What happened to one trace task (over all its runs)."""

    task_id: str
    priority: int
    kind: str
    submit_s: float
    duration_s: float  # reference duration (speed 1.0, alone)
    num_gpus: int
    gpu_share: float
    first_start_s: float = math.nan
    finish_s: float = math.nan
    wait_s: float = 0.0  # queued time summed over runs
    runs: int = 0
    oom_kills: int = 0
    state: str = "pending"  # completed | dropped | rejected | unfinished
    reason: str = ""
    migrations: int = 0  # times the advisor moved it
    preemptions: int = 0  # times it was evicted for a P0 task

    @property
    def jct_s(self) -> float:
        return self.finish_s - self.submit_s


@dataclass
class SimResult:
    """Raw outcome of one run; ``scheduler.simreport`` turns it into figures."""

    policy: str
    gpus: int
    nodes: int
    records: list[TaskRecord]
    window_s: float
    makespan_s: float
    gpu_mean_util: np.ndarray  # % per GPU, time-weighted over the window
    gpu_hot_share: np.ndarray  # share of the window each GPU spent at >= 90 %
    util_std_time_mean: float  # time-weighted mean of the across-GPU std (%)
    gpu_node: np.ndarray
    heatmap_t: np.ndarray  # s
    heatmap: np.ndarray  # (samples, GPUs) true util %
    oom_kills: int
    oom_kills_alone: int  # of those, runs alone on their GPUs (they outgrew the card)
    sla_misses: int
    dispatches: int
    snapshots: int
    events: int
    wall_s: float
    saturation: "SaturationResult | None" = None
    meta: dict = field(default_factory=dict)
    plans: int = 0  # rebalance plans applied
    migrations: int = 0  # moves of those plans carried out
    prediction_mape: float = math.nan  # predictor's MAPE (ratio) over its last completions
    prediction_samples: int = 0  # completions the predictor learned from
    memory_growth_samples: int = 0  # peak/ask ratios held by the memory-growth learner (at most its window)
    # OOM kills of runs for which, when placed, an idle GPU had the memory they reached: a
    # placement that knew their peak could have saved them without sharing a GPU
    oom_kills_idle_room: int = 0
    # tasks that waited for a GPU with room for their kind's growth (growth_room_wait_s),
    # and of those, the ones placed with that room
    room_waits: int = 0
    room_waits_found: int = 0
    # leases evicted for P0 tasks (Scheduler preemption), and the work those
    # runs redo: GPU-seconds at reference speed (a movable task's restart
    # cost; the whole run so far of one that starts over)
    preemptions: int = 0
    preempted_work_s: float = 0.0


@dataclass
class SaturationResult:
    """FGD-style saturating run (module docstring)."""

    policy: str
    gpus: int
    arrived_at_first_failure: float  # arrived GPU demand / GPU count
    unallocated_at_first_failure: float  # share of GPU capacity not allocated
    unallocated_at_full: float  # same, when arrived demand reaches the GPU count
    idle_gpus_at_full: float  # share of GPUs with nothing on them
    placed: int
    failed: int
    rejected: int
    first_failure_task: str
    wall_s: float


# ---- the engine adapter ------------------------------------------------------------------------


class ColumnarReservations(Reservations):
    """``Reservations`` whose ``columns`` is vectorised over a fixed GPU order.

    The base class stays the single source of truth; this subclass mirrors
    each touched GPU's stack into arrays after ``add`` and ``release``, and
    re-reads a GPU after anyone fetched it with ``gpu()`` (the view's
    ``refresh`` may lower its baseline through ``effective``). ``columns``
    then applies ``GpuReservation.effective`` to every row at once and writes
    lowered baselines back. Falls back to the base class when the snapshot's
    rows are not the fixed order.
    """

    def __init__(self, gpu_uuids: Sequence[str]) -> None:
        super().__init__()
        self._order = list(gpu_uuids)
        self._row = {u: i for i, u in enumerate(self._order)}
        n = len(self._order)
        self._b = np.full(n, np.inf)
        self._bu = np.full(n, np.inf)
        self._r = np.zeros(n)
        self._u = np.zeros(n)
        self._n = np.zeros(n, dtype=np.int32)
        self._dirty: set[str] = set()

    def _sync(self, uuids: Iterable[str]) -> None:
        for u in uuids:
            row = self._row.get(u)
            if row is None:
                continue
            g = Reservations.gpu(self, u)
            if g is None:
                self._b[row], self._r[row], self._u[row], self._n[row] = math.inf, 0.0, 0.0, 0
                self._bu[row] = math.inf
            else:
                self._b[row] = g.baseline_mib
                self._bu[row] = g.baseline_util_pct
                self._r[row] = g.vram_mib
                self._u[row] = g.util_pct
                self._n[row] = len(g.members)

    def gpu(self, gpu_uuid: str):  # type: ignore[override]
        self._dirty.add(gpu_uuid)
        return super().gpu(gpu_uuid)

    def add(self, key, gpu_uuids, vram_mib, util_pct, used_mib, util_now=None) -> None:  # type: ignore[override]
        super().add(key, gpu_uuids, vram_mib, util_pct, used_mib, util_now)
        self._sync(gpu_uuids)

    def release(self, key: str) -> tuple[str, ...]:
        uuids = super().release(key)
        self._sync(uuids)
        return uuids

    def columns(
        self, row_of: Mapping[str, int], used_mib: np.ndarray, fresh: np.ndarray, util_now: np.ndarray | None = None,
    ) -> ReservedColumns:
        n = len(self._order)
        if (
            len(row_of) != n
            or used_mib.shape[0] != n
            or (n and (row_of.get(self._order[0]) != 0 or row_of.get(self._order[-1]) != n - 1))
        ):
            return super().columns(row_of, used_mib, fresh, util_now)
        if self._dirty:
            dirty, self._dirty = self._dirty, set()
            self._sync(dirty)
        r, b = self._r, self._b
        has = r > 0
        used = np.asarray(used_mib, dtype=np.float64)
        live = has & np.asarray(fresh, dtype=bool) & np.isfinite(used)
        self._lower_baselines(b, used, live, "baseline_mib")
        with np.errstate(invalid="ignore"):
            eff_live = np.minimum(r, np.maximum(0.0, b + r - used))
        eff = np.where(live, eff_live, np.where(has, r, 0.0))
        util = np.where(has, self._u * eff / np.where(has, r, 1.0), 0.0)
        if util_now is not None:  # as Reservations.columns: compute shown by the util reading
            x = np.asarray(util_now, dtype=np.float64)
            known = live & np.isfinite(x)
            self._lower_baselines(self._bu, x, known, "baseline_util_pct")
            with np.errstate(invalid="ignore"):
                shown = np.minimum(self._u, np.maximum(0.0, self._bu + self._u - x))
            util = np.where(known, np.minimum(util, shown), util)
        return ReservedColumns(vram_mib=eff, util_pct=util, leases=self._n.copy(), asked_mib=r.copy())

    def _lower_baselines(self, baseline: np.ndarray, reading: np.ndarray, where: np.ndarray, attr: str) -> None:
        """Where a reading (``where``) is under its row's baseline, lower the
        baseline column and the stack's ``attr`` to it, as ``GpuReservation``
        does (memory ``B``, util ``Bu``)."""
        lower = where & (reading < baseline)
        if lower.any():
            baseline[lower] = reading[lower]
            for row in np.flatnonzero(lower):
                g = Reservations.gpu(self, self._order[row])
                if g is not None:
                    setattr(g, attr, float(reading[row]))


# ---- the simulation ------------------------------------------------------------------------------

# event kinds, in the order they are handled at one instant
_SUBMIT, _STEP, _VISIBLE, _SAMPLE, _ADVISE, _WAKE = 0, 1, 2, 3, 4, 5



class _Run:
    """One placement of a task (a task OOM-killed and resubmitted has several)."""

    __slots__ = (
        "idx",
        "run_id",
        "lease_id",
        "rows",
        "speed",
        "util",
        "mem",
        "phase",
        "ask",
        "work",
        "done",
        "rate",
        "t_last",
        "version",
        "start",
        "migrated",
        "utils",
        "idle_with_room",
    )

    def __init__(self, idx: int, run_id: str, lease_id: str, rows: tuple[int, ...], speed: float,
                 util: float, mem: tuple[float, ...], ask: float, work: float, now: float) -> None:
        self.idx = idx
        self.run_id = run_id
        self.lease_id = lease_id
        self.rows = rows
        self.speed = speed
        self.util = util
        self.mem = mem  # real MiB per phase
        self.phase = 0
        self.ask = ask
        self.work = work  # s of work at rate 1
        self.done = 0.0
        self.rate = 0.0
        self.t_last = now
        self.version = 0
        self.start = now
        self.migrated = False  # a restart after a migration (its run time is not a clean sample)
        self.utils: tuple[float, ...] = ()  # % per phase when the load drifts (else util throughout)
        # GPUs idle when it was placed whose memory holds its peak; counted only for
        # a run whose peak outgrows its own GPU (-1: not counted)
        self.idle_with_room = -1

    def next_milestone(self) -> float:
        """Work at which the next phase starts (or the run ends)."""
        return self.work * (self.phase + 1) / len(self.mem)


def _resolve_memory(memory: object) -> MemoryModel:
    if isinstance(memory, str):
        if memory == "genai":
            return GenAIMemory()
        if memory == "asked":
            return AskedMemory()
        raise ValueError(f"unknown memory model {memory!r}; use 'genai' or 'asked'")
    if not hasattr(memory, "ratios"):
        raise ValueError("memory must be 'genai', 'asked' or have a ratios() method")
    return memory  # type: ignore[return-value]


def _drift_ratios(phases: Sequence[int], sigma: float, seed: int) -> list[tuple[float, ...]]:
    """Per task, its utilisation ratio per phase: 1 at the start (what placement
    was told), then a random walk in log space with steps of ``sigma``,
    clipped to [0.25, 2] (seeded, in trace order: every policy sees the same)."""
    rng = np.random.default_rng([seed, 0x6472696674])  # a stream apart from the memory draws
    out = []
    for n in phases:
        steps = rng.normal(0.0, sigma, max(n - 1, 0))
        out.append(tuple(np.clip(np.exp(np.concatenate(([0.0], np.cumsum(steps)))), 0.25, 2.0).tolist()))
    return out


def _memory_profiles(tasks: Sequence[TraceTask], model: MemoryModel, seed: int) -> list[tuple[float, ...]]:
    rng = np.random.default_rng(seed)
    out = []
    for i, t in enumerate(tasks):
        ratios = model.ratios(t, i, rng)
        if not ratios:
            ratios = (1.0,)
        out.append(tuple(max(0.0, r) * t.vram_mib for r in ratios))
    return out


class Simulation:
    """One policy over one trace on one cluster (see the module docstring)."""

    def __init__(
        self,
        tasks: Sequence[TraceTask],
        nodes: Sequence[ClusterNode | NodeFacts],
        policy: str = "load_aware",
        config: SimConfig | None = None,
        *,
        weights: Mapping[str, float] | None = None,
        profiles: Sequence[tuple[float, ...]] | None = None,
        progress: Callable[[int, int, float], None] | None = None,
    ) -> None:
        cfg = config or SimConfig()
        base_policy, blind = parse_policy(policy)
        weights = weights or policy_weights(policy) or None
        if blind:
            cfg = replace(cfg, telemetry=False)
        self.cfg = cfg
        self.policy = policy
        self.tasks = sorted(tasks, key=lambda t: t.submit_s)
        facts = [n.facts() if isinstance(n, ClusterNode) else n for n in nodes]
        if not facts:
            raise ValueError("the cluster has no nodes")
        if cfg.prediction_prior not in ("cluster", "table", "none"):
            raise ValueError(f"prediction_prior must be 'cluster', 'table' or 'none', got {cfg.prediction_prior!r}")
        self.facts = facts
        self._progress = progress
        if profiles is None:
            profiles = _memory_profiles(self.tasks, _resolve_memory(cfg.memory), cfg.seed)
        elif len(profiles) != len(self.tasks):
            raise ValueError("need one memory profile per task")
        self.profiles = profiles
        self._drift = (
            _drift_ratios([len(p) for p in profiles], cfg.util_drift, cfg.seed) if cfg.util_drift > 0 else None
        )

        base = ClusterSnapshot.build(facts)
        self._base = base
        g = base.gpu_count
        self.G = g
        self._row_of = {u: i for i, u in enumerate(base.gpu_uuid)}
        self._cap = [float(x) for x in base.memory_total_mib]
        self._speed = [float(base.node_speed[n]) for n in base.gpu_node]
        # truth (Python lists: touched a few rows at a time)
        self._demand = [0.0] * g
        self._mem = [0.0] * g
        # runs per GPU row, in the order they started there: a dict, not a set, whose
        # order would follow the runs' memory addresses and, through the order of
        # same-time events, change results from one run of a process to the next
        self._runs_on: list[dict[_Run, None]] = [{} for _ in range(g)]
        # observed (what the view shows): level v0 moving to target from t0
        self._u_v0 = np.zeros(g)
        self._u_tg = np.zeros(g)
        self._u_t0 = np.zeros(g)
        self._u_snap = np.ones(g, dtype=bool)
        self._m_v0 = np.zeros(g)
        self._m_tg = np.zeros(g)
        self._m_t0 = np.zeros(g)
        self._m_snap = np.ones(g, dtype=bool)
        self._active = np.zeros(g, dtype=np.int32)
        self._q = 1.0 - cfg.ewma_alpha
        self._pending_obs: deque[tuple[float, int, float, float, int]] = deque()
        self._last_obs = -math.inf  # virtual time of the latest applied observation
        self._glide_until = -math.inf
        self._moving: dict[int, float] = {}  # row -> when its reading reaches the target
        self._snap: ClusterSnapshot | None = None
        self._snap_at = -math.inf
        # utilisation integrals
        self._util = [0.0] * g  # true util % now
        self._t_row = [0.0] * g
        self._int_u = [0.0] * g
        self._int_hot = [0.0] * g
        self._s1 = 0.0
        self._s2 = 0.0
        self._std_int = 0.0
        self._t_std = 0.0
        self._changes = 0
        # clock and events
        self.now = 0.0
        self._heap: list[tuple[float, int, int, object]] = []
        self._seq = itertools.count()
        self._lease_seq = itertools.count()
        sched_cfg = replace(cfg.scheduler or SchedulerConfig(), policy=base_policy, lease_s=_LEASE_S,
                            weights=dict(weights or (cfg.scheduler.weights if cfg.scheduler else {})))
        self.sched = Scheduler(
            sched_cfg,
            clock=lambda: self.now,
            lease_ids=self._lease_id,
            reservations=ColumnarReservations(base.gpu_uuid) if cfg.columnar_reservations else None,
        )
        self.sched.add_listener(self._on_change)
        # learning
        self.predictor: SpeedPredictor | None = None
        if cfg.prediction:
            prior = cfg.prediction_prior
            self.predictor = SpeedPredictor(
                model_speeds(base) if prior == "cluster" else None,
                cfg.predictor,
                use_known_models=prior != "none",
            )
        self.advisor = Advisor(cfg.advisor, sched_cfg) if cfg.advisor is not None else None
        self.growth = MemoryGrowth(cfg.memory_growth) if cfg.memory_learning else None
        self._resume: dict[str, tuple[float, float]] = {}  # migrated run id -> (reference work left, util %)
        self._advised: ClusterSnapshot | None = None  # snapshot of the last advisor evaluation
        self._advise_gate = math.inf  # when that evaluation's answer may change on the same readings
        self.plans = 0
        self.migrations = 0
        self.preemptions = 0
        self.preempted_work_s = 0.0
        # bookkeeping
        self.records = [
            TaskRecord(t.task_id, int(t.priority), t.kind, t.submit_s, t.duration_s, t.num_gpus, t.gpu_share)
            for t in self.tasks
        ]
        self._queued: dict[str, tuple[int, float, float]] = {}  # run id -> (task idx, ask, queued at)
        self._running: dict[str, _Run] = {}
        self._attempt = [0] * len(self.tasks)
        self._remaining = len(self.tasks)
        self.oom_kills = 0
        self.oom_kills_alone = 0
        self.oom_kills_idle_room = 0
        self.dispatches = 0
        self.snapshots = 0
        self.events = 0
        self._visible_pending: set[float] = set()
        self._wakes: set[float] = set()  # times of pending _WAKE events
        last_submit = self.tasks[-1].submit_s if self.tasks else 0.0
        # the window opens at the first percentile of submissions (module docstring)
        first = self.tasks[len(self.tasks) // 100].submit_s if self.tasks else 0.0
        if first < last_submit:
            self._window_start, self._window_end = first, last_submit
        else:
            # the load arrives at one instant (a burst, at 0 or later): from the
            # first submission to the makespan. [0, T] for a burst at T held no
            # work at all, and every utilisation figure read 0
            self._window_start = self.tasks[0].submit_s if self.tasks else 0.0
            self._window_end = None
        self._window_frozen: tuple | None = None
        self._window_opened: tuple | None = None
        self._heat_t: list[float] = []
        self._heat: list[np.ndarray] = []

    def _on_change(self, task) -> None:
        """A queued run the engine ended without placing it (REJECTED, EXPIRED),
        or a running one it evicted for a P0 task (PREEMPTED)."""
        if task.state == TaskState.PREEMPTED:
            run = self._running.get(task.task_id)
            if run is not None:
                self._preempted(run)
            return
        if task.terminal and task.task_id in self._queued and task.state != TaskState.COMPLETED:
            idx, _, _ = self._queued.pop(task.task_id)
            rec = self.records[idx]
            rec.state = "rejected" if self._attempt[idx] == 1 else "dropped"
            rec.reason = task.reason
            self._remaining -= 1

    def _lease_id(self) -> str:
        return f"lease-{next(self._lease_seq)}"

    # ---- events ------------------------------------------------------------------------------
    def _push(self, t: float, kind: int, payload: object) -> None:
        heapq.heappush(self._heap, (t, kind, next(self._seq), payload))

    def run(self) -> SimResult:
        setsearch.warm()  # compiling is not simulation time
        started = time.perf_counter()
        cfg = self.cfg
        for i, t in enumerate(self.tasks):
            self._push(t.submit_s, _SUBMIT, i)
        horizon = cfg.horizon_s if cfg.horizon_s is not None else math.inf
        self._heat_step = 0.0  # while the window's end is the makespan, unknown yet
        if self._window_end is not None and cfg.heatmap_samples > 0:
            step = (self._window_end - self._window_start) / cfg.heatmap_samples
            for k in range(cfg.heatmap_samples + 1):
                self._push(self._window_start + k * step, _SAMPLE, None)
        elif self.tasks and cfg.heatmap_samples > 0:
            # sampled on until the last task ends, at a step from a guess of
            # the span (the longest task, or the work over the cluster's GPUs)
            work = sum(t.duration_s * t.num_gpus for t in self.tasks) / max(self.G, 1)
            span = max(max(t.duration_s for t in self.tasks), work) / max(min(self._speed, default=1.0), 1e-9)
            self._heat_step = max(span / cfg.heatmap_samples, 1e-6)
            self._push(self._window_start, _SAMPLE, None)
        if self.advisor is not None and self.tasks:
            self._push(self.tasks[0].submit_s + cfg.advisor_interval_s, _ADVISE, None)
        heap = self._heap
        report_every = max(1, len(self.tasks) // 200)
        last_report = -1
        while heap:
            t = heap[0][0]
            if t > horizon:
                break
            if self._window_opened is None and t > self._window_start:
                self._open_window()
            if self._window_end is not None and self._window_frozen is None and t > self._window_end:
                self._freeze_window(self._window_end)
            self.now = t
            need = False
            while heap and heap[0][0] == t:
                _, kind, _, payload = heapq.heappop(heap)
                self.events += 1
                if kind == _SUBMIT:
                    need |= self._submit(payload)  # type: ignore[arg-type]
                elif kind == _STEP:
                    need |= self._step(payload)  # type: ignore[arg-type]
                elif kind == _VISIBLE:
                    self._visible_pending.discard(t)
                    need |= bool(self._queued)
                elif kind == _WAKE:
                    self._wakes.discard(t)
                    need |= bool(self._queued)
                elif kind == _ADVISE:
                    need |= self._advise()
                    if self._remaining > 0:
                        self._push(t + cfg.advisor_interval_s, _ADVISE, None)
                else:
                    self._sample()
                    if self._heat_step > 0 and self._remaining > 0:
                        self._push(t + self._heat_step, _SAMPLE, None)
            if need and self._queued:
                self._dispatch()
            if self._progress is not None:
                done = len(self.tasks) - self._remaining
                if done // report_every != last_report:
                    last_report = done // report_every
                    self._progress(done, len(self.tasks), time.perf_counter() - started)
        end = self.now
        if self._progress is not None:
            self._progress(len(self.tasks) - self._remaining, len(self.tasks), time.perf_counter() - started)
        for run in list(self._running.values()):
            rec = self.records[run.idx]
            rec.state = "unfinished"
        for run_id, (idx, _, _) in self._queued.items():
            if self.records[idx].state == "pending":
                self.records[idx].state = "unfinished"
        # from the first submission: a slice of a trace that starts late is not
        # charged the time before its first task
        last_finish = max((r.finish_s for r in self.records if r.finish_s == r.finish_s), default=0.0)
        first_submit = self.tasks[0].submit_s if self.tasks else 0.0
        makespan = max(0.0, last_finish - first_submit) if last_finish > 0 else 0.0
        if self._window_frozen is None:
            self._freeze_window(self._window_end if self._window_end is not None else (last_finish or end))
        win, mean_u, hot, std_mean = self._window_frozen  # type: ignore[misc]
        return SimResult(
            policy=self.policy,
            gpus=self.G,
            nodes=len(self.facts),
            records=self.records,
            window_s=win,
            makespan_s=makespan,
            gpu_mean_util=mean_u,
            gpu_hot_share=hot,
            util_std_time_mean=std_mean,
            gpu_node=self._base.gpu_node.copy(),
            heatmap_t=np.asarray(self._heat_t),
            heatmap=np.asarray(self._heat) if self._heat else np.zeros((0, self.G)),
            oom_kills=self.oom_kills,
            oom_kills_alone=self.oom_kills_alone,
            oom_kills_idle_room=self.oom_kills_idle_room,
            room_waits=self.sched.room_wait_counts["waited"],
            room_waits_found=self.sched.room_wait_counts["found"],
            sla_misses=self.sched.queue_summary().sla_misses,
            dispatches=self.dispatches,
            snapshots=self.snapshots,
            events=self.events,
            wall_s=time.perf_counter() - started,
            meta={
                "visible_after_s": self.cfg.visible_after_s,
                "window_start_s": self._window_start,
                "seed": self.cfg.seed,
                "tasks": len(self.tasks),
            },
            plans=self.plans,
            migrations=self.migrations,
            preemptions=self.preemptions,
            preempted_work_s=self.preempted_work_s,
            prediction_mape=self.predictor.mape() if self.predictor is not None else math.nan,
            prediction_samples=self.predictor.samples if self.predictor is not None else 0,
            memory_growth_samples=self.growth.samples if self.growth is not None else 0,
        )

    # ---- submissions and dispatch -----------------------------------------------------------------
    def _submit(self, idx: int, ask: float | None = None) -> bool:
        task = self.tasks[idx]
        self._attempt[idx] += 1
        attempt = self._attempt[idx]
        run_id = task.task_id if attempt == 1 else f"{task.task_id}~{attempt}"
        ask = task.vram_mib if ask is None else ask
        # the first submission carries the cluster, so never-fits is judged at once
        first = self._base if self.sched.last_snapshot is None else None
        result = self.sched.submit(task.to_spec(task_id=run_id, vram_mib=ask), first)
        rec = self.records[idx]
        if result.state == TaskState.REJECTED:
            rec.state = "rejected" if attempt == 1 else "dropped"
            rec.reason = result.reason
            self._remaining -= 1
            return False
        self._queued[run_id] = (idx, ask, self.now)
        return True

    def _dispatch(self) -> None:
        snap = self._snapshot()
        self.dispatches += 1
        placed = self.sched.dispatch(snap)
        for task in placed:
            self._start(task)
        wake = self.sched.next_decision_at()
        if wake is not None and wake not in self._wakes:
            # the coordinator dispatches at least every dispatch_interval_s; here
            # nothing else need happen by the time a task stops waiting for room
            self._wakes.add(wake)
            self._push(wake, _WAKE, None)

    def _snapshot(self) -> ClusterSnapshot:
        now = self.now
        self._apply_observations(now)
        snap = self._snap
        if snap is not None and self._last_obs <= self._snap_at and self._snap_at >= self._glide_until:
            return snap
        util = self._u_tg.copy()
        mem = self._m_tg.copy()
        moving = self._moving
        if not self.cfg.telemetry:
            # no metrics pipeline: every GPU reads idle, so reservations never
            # fade and the filters see only what tasks asked for
            util[:] = 0.0
            mem[:] = 0.0
            moving = {}
        if moving:
            # rows whose reading has not reached its target yet (few): the
            # level a reading-by-reading filter shows at ``now``
            idx = np.fromiter(moving.keys(), dtype=np.intp, count=len(moving))
            dt = self.cfg.fast_sample_s
            for v0, tg, t0, snapped, out in (
                (self._u_v0, self._u_tg, self._u_t0, self._u_snap, util),
                (self._m_v0, self._m_tg, self._m_t0, self._m_snap, mem),
            ):
                elapsed = now - t0[idx]
                k = np.floor(elapsed / dt + 1e-9) + 1.0
                factor = np.where(
                    elapsed < -1e-9, 1.0, np.where(snapped[idx], 0.0, self._q ** np.maximum(k, 0.0))
                )
                out[idx] = tg[idx] + (v0[idx] - tg[idx]) * factor
            for row in [r for r, until in moving.items() if until <= now]:
                del moving[row]
                # settled: the reading is the target from here on
                self._u_v0[row] = self._u_tg[row]
                self._m_v0[row] = self._m_tg[row]
        b = self._base
        snap = ClusterSnapshot(
            gpu_node=b.gpu_node,
            gpu_index=b.gpu_index,
            gpu_uuid=b.gpu_uuid,
            gpu_model=b.gpu_model,
            healthy=b.healthy,
            util_pct=util,
            util_forecast_pct=util,
            util_trend_pct_per_min=b.util_trend_pct_per_min,
            memory_used_mib=mem,
            memory_total_mib=b.memory_total_mib,
            temperature_c=35.0 + 0.4 * util,
            nvlink_competition=b.nvlink_competition,
            active_tasks=self._active.copy(),
            node_ids=b.node_ids,
            node_labels=b.node_labels,
            node_schedulable=b.node_schedulable,
            node_stale=b.node_stale,
            node_disk_await_ms=b.node_disk_await_ms,
            node_response_time_s=b.node_response_time_s,
            node_speed=b.node_speed,
            node_nvlink=b.node_nvlink,
            taken_at_s=now,
        )
        if self.predictor is not None:
            snap.gpu_slowdown = self.predictor.slowdown_columns(snap)
            snap.gpu_overrun = self.predictor.overrun_columns(snap)
        if self.growth is not None:
            snap.memory_growth = self.growth.tables()
        self._snap = snap
        self._snap_at = now
        self.snapshots += 1
        return snap

    # ---- observations ---------------------------------------------------------------------------------
    def _observe(self, row: int) -> None:
        """Queue the row's new truth for the view (it arrives ``sample_delay_s`` later)."""
        self._pending_obs.append(
            (self.now + self.cfg.sample_delay_s, row, self._util[row], self._mem[row], len(self._runs_on[row]))
        )

    def _apply_observations(self, now: float) -> None:
        pending = self._pending_obs
        if not pending or pending[0][0] > now:
            return
        cfg = self.cfg
        q = self._q
        dt = cfg.fast_sample_s
        shift_delay = (cfg.persist - 1) * dt
        settle = cfg.settle_s
        u_v0, u_tg, u_t0, u_snap = self._u_v0, self._u_tg, self._u_t0, self._u_snap
        m_v0, m_tg, m_t0, m_snap = self._m_v0, self._m_tg, self._m_t0, self._m_snap

        def before(v0: float, tg: float, t0: float, snapped: bool, te: float) -> float:
            # the level just before a reading at te (readings at t0, t0 + dt, ... < te)
            if te <= t0:
                return v0
            if snapped:
                return tg
            k = math.ceil((te - t0) / dt - 1e-9)
            return tg + (v0 - tg) * q**k

        while pending and pending[0][0] <= now:
            te, row, util, mem, active = pending.popleft()
            cur = before(u_v0[row], u_tg[row], u_t0[row], u_snap[row], te)
            u_v0[row] = cur
            u_tg[row] = util
            if abs(util - cur) > cfg.util_floor_pct:
                u_snap[row] = True
                u_t0[row] = te + shift_delay
            else:
                u_snap[row] = False
                u_t0[row] = te
                self._glide_until = max(self._glide_until, te + settle)
            cur = before(m_v0[row], m_tg[row], m_t0[row], m_snap[row], te)
            m_v0[row] = cur
            m_tg[row] = mem
            if abs(mem - cur) > cfg.memory_floor_mib:
                m_snap[row] = True
                m_t0[row] = te + shift_delay
            else:
                m_snap[row] = False
                m_t0[row] = te
                self._glide_until = max(self._glide_until, te + settle)
            self._active[row] = active
            self._moving[row] = max(
                u_t0[row] + (0.0 if u_snap[row] else settle),
                m_t0[row] + (0.0 if m_snap[row] else settle),
            )
            self._last_obs = max(self._last_obs, te + shift_delay)
        # readings that only become visible after now keep the snapshot dirty
        self._glide_until = max(self._glide_until, self._last_obs)

    def _schedule_visible(self) -> None:
        """Dispatch again when a release becomes visible to the view."""
        cfg = self.cfg
        # the same float expression as the reading's snap time in _apply_observations
        t = (self.now + cfg.sample_delay_s) + (cfg.persist - 1) * cfg.fast_sample_s
        if t not in self._visible_pending:
            self._visible_pending.add(t)
            self._push(t, _VISIBLE, None)

    # ---- truth ---------------------------------------------------------------------------------------------
    def _set_util(self, row: int, demand: float) -> None:
        """Record GPU ``row``'s new demand; integrate utilisation up to now."""
        now = self.now
        self._demand[row] = demand
        new = demand if demand < 100.0 else 100.0
        old = self._util[row]
        if new == old:
            return
        dt = now - self._t_row[row]
        if dt > 0:
            self._int_u[row] += old * dt
            if old >= 90.0:
                self._int_hot[row] += dt
        self._t_row[row] = now
        self._advance_std(now)
        self._s1 += new - old
        self._s2 += new * new - old * old
        self._util[row] = new
        self._changes += 1
        if self._changes % 50_000 == 0:  # keep the running sums exact
            self._s1 = math.fsum(self._util)
            self._s2 = math.fsum(u * u for u in self._util)

    def _advance_std(self, now: float) -> None:
        dt = now - self._t_std
        if dt > 0:
            g = self.G
            mean = self._s1 / g
            var = self._s2 / g - mean * mean
            self._std_int += math.sqrt(var) * dt if var > 0 else 0.0
            self._t_std = now

    def _integrals_at(self, t: float) -> tuple[np.ndarray, np.ndarray, float]:
        """Per-GPU integrals of util and of time at >= 90 %, and of the across-GPU
        std, over [0, t]; valid while no change happened after ``t``."""
        g = self.G
        util = np.asarray(self._util)
        span = np.maximum(t - np.asarray(self._t_row), 0.0)
        int_u = np.asarray(self._int_u) + util * span
        int_hot = np.asarray(self._int_hot) + (util >= 90.0) * span
        std_int = self._std_int
        dt = t - self._t_std
        if dt > 0:
            mean = self._s1 / g
            var = self._s2 / g - mean * mean
            std_int += math.sqrt(var) * dt if var > 0 else 0.0
        return int_u, int_hot, std_int

    def _open_window(self) -> None:
        self._window_opened = self._integrals_at(self._window_start)

    def _freeze_window(self, end: float) -> None:
        """Utilisation figures over [window start, end] (no change after ``end`` yet)."""
        if self._window_opened is None:
            self._open_window()
        u0, h0, s0 = self._window_opened  # type: ignore[misc]
        u1, h1, s1 = self._integrals_at(end)
        span = end - self._window_start
        if span <= 0:
            util = np.asarray(self._util)
            self._window_frozen = (0.0, util.copy(), (util >= 90.0).astype(float), float(np.std(util)))
            return
        self._window_frozen = (span, (u1 - u0) / span, (h1 - h0) / span, (s1 - s0) / span)

    def _sample(self) -> None:
        self._heat_t.append(self.now)
        self._heat.append(np.asarray(self._util, dtype=np.float32))

    def _rerate(self, runs: Iterable[_Run]) -> None:
        """Progress runs to now at their old rate, then reschedule at the new one."""
        now = self.now
        demand = self._demand
        for run in runs:
            rate = 1.0
            for r in run.rows:
                d = demand[r]
                if d > 100.0:
                    rate = min(rate, 100.0 / d)
            rate *= run.speed
            run.done += run.rate * (now - run.t_last)
            run.t_last = now
            if rate != run.rate:
                run.rate = rate
                run.version += 1
                left = run.next_milestone() - run.done
                self._push(now + max(left, 0.0) / rate, _STEP, (run, run.version))

    def _affected(self, rows: Iterable[int]) -> dict[_Run, None]:
        out: dict[_Run, None] = {}
        for r in rows:
            out.update(self._runs_on[r])
        return out

    def _start(self, task) -> None:
        run_id = task.task_id
        idx, ask, queued_at = self._queued.pop(run_id)
        rec = self.records[idx]
        now = self.now
        rec.wait_s += now - queued_at
        if rec.runs == 0:
            rec.first_start_s = now
        rec.runs += 1
        a = task.assignment
        rows = tuple(self._row_of[u] for u in a.gpu_uuids)
        t = self.tasks[idx]
        speed = self._speed[rows[0]]
        resumed = self._resume.pop(run_id, None)
        util = t.util_pct
        if resumed is None:
            work = t.duration_s
            if self._drift is not None:
                run_utils = tuple(min(100.0, util * r) for r in self._drift[idx])
                util = run_utils[0]
        else:
            # a migrated task redoes the migration's cost on its new GPU and
            # keeps the load it had when it left
            left, util = resumed
            work = left + self.cfg.migration_cost_s * speed
        # a raised ask (after an OOM kill) changes the request, not what the task uses
        run = _Run(idx, run_id, a.lease_id, rows, speed, util, self.profiles[idx], ask, work, now)
        run.migrated = resumed is not None
        if resumed is None and self._drift is not None:
            run.utils = run_utils
        self._running[run_id] = run
        peak = max(run.mem)
        if peak > min(self._cap[r] for r in rows):  # it will die: could a placement knowing its peak have saved it?
            run.idle_with_room = sum(1 for g in range(self.G) if not self._runs_on[g] and self._cap[g] >= peak)
        first = run.mem[0]
        for r in rows:
            self._runs_on[r][run] = None
            self._mem[r] += first
            self._set_util(r, self._demand[r] + run.util)
            self._observe(r)
        if any(self._mem[r] > self._cap[r] for r in rows):
            self._kill(run, first)
            return
        self._rerate(self._affected(rows))

    def _step(self, payload: tuple[_Run, int]) -> bool:
        run, version = payload
        if version != run.version or run.run_id not in self._running:
            return False
        now = self.now
        run.done += run.rate * (now - run.t_last)
        run.t_last = now
        if run.phase + 1 >= len(run.mem):
            self._end(run)
            return True
        old = run.mem[run.phase]
        run.phase += 1
        new = run.mem[run.phase]
        old_util = run.util
        if run.phase < len(run.utils) and run.utils[run.phase] != old_util:
            run.util = run.utils[run.phase]  # the load drifts
            for r in run.rows:
                self._set_util(r, self._demand[r] - old_util + run.util)
        for r in run.rows:
            self._mem[r] += new - old
            self._observe(r)
        if new > old and any(self._mem[r] > self._cap[r] for r in run.rows):
            self._kill(run, new)
            return True
        if run.util != old_util:
            self._rerate(self._affected(run.rows))
            if run.util < old_util:
                self._schedule_visible()
        run.version += 1
        left = run.next_milestone() - run.done
        self._push(now + max(left, 0.0) / run.rate, _STEP, (run, run.version))
        if new < old:
            self._schedule_visible()
        return False

    def _remove(self, run: _Run) -> None:
        del self._running[run.run_id]
        mem = run.mem[run.phase]
        for r in run.rows:
            self._runs_on[r].pop(run, None)
            self._mem[r] -= mem
            if not self._runs_on[r]:
                self._mem[r] = 0.0  # no float residue on an empty GPU
                self._set_util(r, 0.0)
            else:
                self._set_util(r, self._demand[r] - run.util)
            self._observe(r)
        run.version += 1
        self._rerate(self._affected(run.rows))
        self._schedule_visible()

    def _end(self, run: _Run) -> None:
        self._remove(run)
        self.sched.complete(run.run_id, run.lease_id)
        if self.growth is not None:
            # the peak over the phases this run went through (the agent's report)
            self.growth.observe(self.tasks[run.idx].kind, run.ask, max(run.mem[: run.phase + 1]))
        if self.predictor is not None and not run.migrated:
            row = run.rows[0]
            b = self._base
            # against the estimate the client gave, as the coordinator learns
            # (a run not migrated did all its work: an OOM-killed one started over)
            t = self.tasks[run.idx]
            self.predictor.observe(
                b.node_ids[int(b.gpu_node[row])], str(b.gpu_model[row]), t.kind, t.estimate, self.now - run.start,
            )
        rec = self.records[run.idx]
        rec.finish_s = self.now
        rec.state = "completed"
        self._remaining -= 1

    # ---- rebalancing ---------------------------------------------------------------------------------
    def _advise(self) -> bool:
        """One advisor evaluation; carries out its plan. True when runs were re-queued."""
        advisor = self.advisor
        assert advisor is not None
        if not self._running:
            return False
        snap = self._snapshot()
        if (snap is self._advised and advisor.state.streak == 0 and self.now < self._advise_gate
                and self._advisor_settled(snap)):
            # the same readings, averaged in already, nothing pending and no task come
            # of age or out of a cool-down since (next_change_s): the same answer
            return False
        self._advised = snap
        tasks = [task for task in map(self.sched.get, self._running) if task.state == TaskState.LEASED]
        plan = advisor.evaluate(snap, tasks, self.now, reservations=self.sched.reservations,
                                queued=self.sched.queued(), workload_mix=self.sched.workload_mix)
        self._advise_gate = next_change_s(advisor.state, advisor.config, tasks, self.now)
        if plan is None:
            return False
        self.plans += 1
        moved = False
        for m in plan.moves:
            run = self._running.get(m.task_id)
            if run is None or sorted(run.rows) != sorted(self._row_of[u] for u in m.from_gpu_uuids):
                continue
            moved |= self._migrate(run, m.to_gpu_uuids, snap)
        return moved

    def _advisor_settled(self, snap: ClusterSnapshot) -> bool:
        """Whether the advisor's per-GPU averages have reached ``snap``'s readings
        (within 0.01 %): until then each evaluation moves them, even on the same
        readings, and may fire the trigger."""
        state = self.advisor.state  # type: ignore[union-attr]
        avg = state.smoothed_util
        if avg is None or state.smoothed_uuids != tuple(snap.gpu_uuid):
            return False
        reading = np.asarray(snap.util_pct, dtype=np.float64)
        known = np.isfinite(reading)
        return bool(np.all(np.abs(avg[known] - reading[known]) < 0.01))

    def _migrate(self, run: _Run, to_gpu_uuids: Sequence[str], snap: ClusterSnapshot) -> bool:
        """Checkpoint ``run`` now and restart the rest of its work on
        ``to_gpu_uuids`` under a new lease, as an executor does through the
        coordinator's MigrateTask: the scheduler moves the lease in one step
        (``Scheduler.migrate``), so the restart never waits behind the queue.
        False when the destination no longer takes it (the move is dropped)."""
        now = self.now
        try:
            task = self.sched.migrate(run.run_id, run.lease_id, tuple(to_gpu_uuids), snap)
        except SchedulerError:
            return False
        left = self._stop(run)
        rec = self.records[run.idx]
        rec.migrations += 1
        self.migrations += 1
        # restarted as a fresh run of the same task: _start charges the
        # migration's cost on the new GPU and keeps the load it had
        self._queued[run.run_id] = (run.idx, run.ask, now)
        self._resume[run.run_id] = (left, run.util)
        self._start(task)
        return True

    def _stop(self, run: _Run) -> float:
        """Stop ``run`` now: its load and memory leave its GPUs. Returns the
        work (reference seconds) it has left."""
        run.done += run.rate * (self.now - run.t_last)
        run.t_last = self.now
        left = max(run.work - run.done, 0.0)
        self._remove(run)
        return left

    def _preempted(self, run: _Run) -> None:
        """The scheduler evicted ``run`` for a P0 task and re-queued it: its
        load and memory leave the GPUs now (the readings show it after the
        sampling delay, when the P0 task can start). A movable task was
        checkpointed: its next run does what is left plus the restart cost
        (``migration_cost_s``, as a migration); any other starts over."""
        now = self.now
        left = self._stop(run)
        rec = self.records[run.idx]
        rec.preemptions += 1
        self.preemptions += 1
        gpus = len(run.rows)
        if self.tasks[run.idx].is_movable:
            self._resume[run.run_id] = (left, run.util)
            # the restart redoes migration_cost_s at its GPU's speed: reference
            # seconds, as run.done (the other branch) is
            self.preempted_work_s += self.cfg.migration_cost_s * run.speed * gpus
        else:
            self.preempted_work_s += run.done * gpus
        self._queued[run.run_id] = (run.idx, run.ask, now)

    def _kill(self, run: _Run, used: float) -> None:
        """Out of memory: the run whose allocation overflowed dies and is resubmitted."""
        self.oom_kills += 1
        if all(len(self._runs_on[r]) == 1 for r in run.rows):
            # alone on its GPUs: it outgrew the card itself, no co-tenant to blame
            self.oom_kills_alone += 1
        if run.idle_with_room > 0:
            self.oom_kills_idle_room += 1
        rec = self.records[run.idx]
        rec.oom_kills += 1
        self._remove(run)
        self.sched.complete(run.run_id, run.lease_id, failed=True)
        if self.growth is not None:
            # the use that killed it: a lower bound of the peak it would have reached
            self.growth.observe(self.tasks[run.idx].kind, run.ask, used, oom_killed=True)
        if self._attempt[run.idx] >= self.cfg.max_attempts:
            rec.state = "dropped"
            rec.reason = f"out of memory {self._attempt[run.idx]} times"
            self._remaining -= 1
            return
        ask = max(run.ask, math.ceil(used))
        if self._submit(run.idx, ask):
            pass  # dispatched with the rest of this instant


# ---- saturation (FGD measure) -------------------------------------------------------------------------


def saturate(
    tasks: Sequence[TraceTask],
    nodes: Sequence[ClusterNode | NodeFacts],
    policy: str,
    *,
    config: SimConfig | None = None,
    weights: Mapping[str, float] | None = None,
    max_arrived: float = 1.0,
) -> SaturationResult:
    """Place tasks in trace order, never ending, until the arrived GPU demand
    reaches ``max_arrived`` times the GPU count (module docstring)."""
    started = time.perf_counter()
    cfg = config or SimConfig()
    facts = [n.facts() if isinstance(n, ClusterNode) else n for n in nodes]
    snap = ClusterSnapshot.build(facts)
    g = snap.gpu_count
    row_of = {u: i for i, u in enumerate(snap.gpu_uuid)}
    now = [0.0]
    seq = itertools.count()
    # the snapshot here never changes (no readings): NAME@requests is NAME
    sched_cfg = replace(cfg.scheduler or SchedulerConfig(), policy=parse_policy(policy)[0], lease_s=_LEASE_S,
                        weights=dict(weights or {}))
    sched = Scheduler(
        sched_cfg,
        clock=lambda: now[0],
        lease_ids=lambda: f"lease-{next(seq)}",
        reservations=ColumnarReservations(snap.gpu_uuid) if cfg.columnar_reservations else None,
    )
    alloc = np.zeros(g)
    busy = np.zeros(g, dtype=bool)
    ordered = [t for t in sorted(tasks, key=lambda t: t.submit_s)]
    if not ordered:
        raise ValueError("no tasks")
    arrived = 0.0
    placed = failed = rejected = 0
    first: tuple[float, float, str] | None = None
    full: tuple[float, float] | None = None
    for k in itertools.count():
        if full is None and arrived >= max_arrived * g:
            full = (float(np.sum(1.0 - np.minimum(alloc, 1.0)) / g), float(np.mean(~busy)))
        if full is not None and first is not None:
            break
        if arrived >= 3 * g or k >= 50 * len(ordered):
            break  # overcommitted far beyond the GPU count without a failure
        t = ordered[k % len(ordered)]
        cycle = k // len(ordered)
        spec = t.to_spec(task_id=t.task_id if cycle == 0 else f"{t.task_id}~c{cycle}")
        now[0] += 1.0
        got = sched.submit(spec, snap if k == 0 else None)
        if got.state == TaskState.REJECTED:
            rejected += 1
            continue
        arrived += t.num_gpus * t.gpu_share
        out = sched.dispatch(snap)
        if out:
            placed += 1
            rows = [row_of[u] for u in out[0].assignment.gpu_uuids]
            alloc[rows] += t.gpu_share
            busy[rows] = True
        else:
            failed += 1
            if first is None:
                unalloc = float(np.sum(1.0 - np.minimum(alloc, 1.0)) / g)
                first = ((arrived - t.num_gpus * t.gpu_share) / g, unalloc, spec.task_id)
            sched.cancel(spec.task_id, "does not fit (saturation run)")
    if full is None:
        full = (float(np.sum(1.0 - np.minimum(alloc, 1.0)) / g), float(np.mean(~busy)))
    if first is None:
        first = (arrived / g, full[0], "")
    return SaturationResult(
        policy=policy,
        gpus=g,
        arrived_at_first_failure=first[0],
        unallocated_at_first_failure=first[1],
        unallocated_at_full=full[0],
        idle_gpus_at_full=full[1],
        placed=placed,
        failed=failed,
        rejected=rejected,
        first_failure_task=first[2],
        wall_s=time.perf_counter() - started,
    )


def simulate(
    tasks: Sequence[TraceTask],
    nodes: Sequence[ClusterNode | NodeFacts],
    policies: Sequence[str],
    config: SimConfig | None = None,
    *,
    progress: bool = False,
    stream: TextIO | None = None,
    label_suffix: str = "",
) -> list[SimResult]:
    """Run every policy on the same trace, cluster and memory draws
    (``label_suffix`` follows each policy's name on the progress bar)."""
    cfg = config or SimConfig()
    ordered = sorted(tasks, key=lambda t: t.submit_s)
    profiles = _memory_profiles(ordered, _resolve_memory(cfg.memory), cfg.seed)
    results = []
    for name in policies:
        bar = _ProgressBar(name + label_suffix, stream or sys.stderr) if progress else None
        sim = Simulation(ordered, nodes, name, cfg, profiles=profiles, progress=bar)
        results.append(sim.run())
        if bar is not None:
            bar.close()
    return results


class _ProgressBar:
    """One line on stderr: policy, bar, tasks done, tasks per second."""

    def __init__(self, label: str, stream: TextIO, every_s: float = 0.25) -> None:
        self.label = label
        self.stream = stream
        self.every_s = every_s
        self._last = -math.inf

    def __call__(self, done: int, total: int, elapsed: float) -> None:
        if done < total and elapsed - self._last < self.every_s:
            return
        self._last = elapsed
        width = 30
        frac = done / total if total else 1.0
        filled = int(frac * width)
        rate = done / elapsed if elapsed > 0 else 0.0
        self.stream.write(
            f"\r{self.label:<22} [{'#' * filled}{'.' * (width - filled)}] "
            f"{done:>7,}/{total:,} tasks  {rate:>9,.0f}/s"
        )
        self.stream.flush()

    def close(self) -> None:
        self.stream.write("\n")
        self.stream.flush()


# ---- command line ------------------------------------------------------------------------------------------


#: suffix of a policy name that runs it without telemetry ("round_robin@requests")
REQUESTS_ONLY = "@requests"


def parse_policy(name: str) -> tuple[str, bool]:
    """(registered policy, whether it runs blind: ``NAME@requests``); weights
    after a colon (``policy_weights``) are allowed and left out."""
    base, at, mode = name.partition(":")[0].partition("@")
    if base not in POLICIES or (at and at + mode != REQUESTS_ONLY):
        raise ValueError(f"unknown policy {name!r}; available: {', '.join(POLICIES)} (each also as NAME{REQUESTS_ONLY})")
    return base, bool(at)


def policy_weights(name: str) -> dict[str, float]:
    """The weights a policy label carries: ``load_aware:spread=0.05+jitter=0.2``
    (a label, so several weightings of one policy run side by side)."""
    _, colon, text = name.partition(":")
    if not colon:
        return {}
    weights: dict[str, float] = {}
    for item in text.split("+"):
        key, eq, value = item.partition("=")
        try:
            weights[key.strip()] = float(value)
        except ValueError:
            raise ValueError(f"policy {name!r}: expected NAME:weight=value[+weight=value...], got {item!r}") from None
        if not eq or not key.strip():
            raise ValueError(f"policy {name!r}: expected NAME:weight=value[+weight=value...], got {item!r}")
    return weights


def _policies(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    if names == ["all"]:
        return list(POLICIES)
    for n in names:
        try:
            base, _ = parse_policy(n)
            make_policy(base, policy_weights(n))  # names and values of the weights, checked now
        except (ValueError, SchedulerError) as exc:
            raise argparse.ArgumentTypeError(
                f"{exc}; policies: {', '.join(POLICIES)}, all; NAME{REQUESTS_ONLY} runs one without telemetry, "
                f"NAME:weight=value[+...] with other weights"
            ) from None
    if not names:
        raise argparse.ArgumentTypeError("no policy given")
    return names


def _number(text: str, *, zero: bool) -> float:
    """An argparse value: a finite number > 0 (>= 0 with ``zero``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and (value >= 0 if zero else value > 0)):
        raise argparse.ArgumentTypeError(f"expected a number {'>=' if zero else '>'} 0, got {text!r}")
    return value


def _positive(text: str) -> float:
    return _number(text, zero=False)


def _non_negative(text: str) -> float:
    return _number(text, zero=True)


#: the most --time-scale / --arrival-scale compress a trace: a million times is
#: a year in 30 s; 1e300 ran and printed absurd figures (throughputs of 1e290)
_SCALE_MAX = 1e6


def _scale(text: str) -> float:
    value = _number(text, zero=False)
    if value > _SCALE_MAX:
        raise argparse.ArgumentTypeError(f"expected a number > 0 and at most {_SCALE_MAX:g}, got {text!r}")
    return value


def _ranged(high: float, why: str = ""):
    """An argparse type: a finite number in [0, ``high``] (``why`` says why the bound)."""

    def parse(text: str) -> float:
        value = _number(text, zero=True)
        if value > high:
            raise argparse.ArgumentTypeError(f"expected a number in [0, {high:g}], got {text!r}{why}")
        return value

    return parse


def _integer_from(low: int, what: str):
    """An argparse type: an integer >= ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}")
        return value

    parse.__doc__ = what
    return parse


#: an argparse value: a seed, an integer >= 0 (what numpy's generators take)
_seed = _integer_from(0, "a seed")
#: an argparse value: an integer >= 1
_count = _integer_from(1, "a count")


#: s a task may run alone on the slowest node of a replay: a hundredth of the
#: simulator's lease, the rest room for slowdowns from sharing a GPU
_MAX_ALONE_S = _LEASE_S / 100


def _replay_limits_error(
    tasks: Sequence[TraceTask], nodes: Sequence[ClusterNode], time_scale: float, arrival_scale: float,
    migration_cost: float,
) -> str | None:
    """Why the scaled trace is beyond what a replay takes (None: it is not):
    submit times and durations as the trace format bounds them, finite
    estimates, and every task's run alone on the slowest node well within the
    simulator's leases (``_MAX_ALONE_S``)."""
    from scheduler.traces import MAX_TRACE_S

    scales = f"--time-scale {time_scale:g}" + (f" --arrival-scale {arrival_scale:g}" if arrival_scale != 1.0 else "")
    limit = f"a replay takes at most {MAX_TRACE_S:g} s (about 31 years)"
    for t in tasks:
        if not t.duration_s <= MAX_TRACE_S:
            return f"{scales}: task {t.task_id!r} would run {t.duration_s:g} s; {limit}: raise --time-scale"
        if not t.duration_s > 0:
            return (f"{scales}: task {t.task_id!r}'s duration comes to {t.duration_s:g} s (below what a float "
                    "holds): lower --time-scale")
        if not t.submit_s <= MAX_TRACE_S:
            return (f"{scales}: task {t.task_id!r} would be submitted at {t.submit_s:g} s; {limit}: "
                    "raise --time-scale or --arrival-scale")
        if t.estimate_s is not None and not math.isfinite(t.estimate_s):
            return f"{scales}: task {t.task_id!r}'s estimate_s comes to {t.estimate_s:g} s: raise --time-scale"
    if not tasks:
        return None
    slowest = min(nodes, key=lambda n: n.speed)
    longest = max(tasks, key=lambda t: t.duration_s)
    alone = (longest.duration_s + migration_cost) / slowest.speed
    if alone > _MAX_ALONE_S:
        return (
            f"task {longest.task_id!r} would run {alone:g} s alone on the slowest node, {slowest.node_id!r} "
            f"(speed {slowest.speed:g}): duration {longest.duration_s:g} s"
            + (f" + --migration-cost {migration_cost:g} s" if migration_cost else "")
            + f" over the speed; a replay's runs must end within {_MAX_ALONE_S:g} s alone (the simulator's leases "
            f"last {_LEASE_S:g} s, the rest is room for sharing a GPU): raise --time-scale or use faster nodes"
        )
    return None


def _plot_dir_error(path: str) -> str | None:
    """Create the --plot folder now, before the replay; why it cannot be (None: it can)."""
    import tempfile

    try:
        os.makedirs(path, exist_ok=True)
    except FileExistsError:
        return f"--plot {path}: exists and is not a folder"
    except OSError as exc:
        return f"--plot {path}: cannot create the folder: {exc.strerror or exc}"
    if not os.path.isdir(path):
        return f"--plot {path}: not a folder"
    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        return f"--plot {path}: cannot write there: {exc.strerror or exc}"
    return None


#: what a task that did not complete without a recorded reason was doing
_UNFINISHED_REASON = "still queued or running when the replay ended"
_NOT_COMPLETED_STATES = ("rejected", "dropped", "unfinished")


def _not_completed(result: SimResult) -> list[tuple[str, str, str]]:
    """(task id, state, reason) of each task of ``result`` that did not complete."""
    out = []
    for rec in result.records:
        if rec.state == "completed":
            continue
        state = "unfinished" if rec.state == "pending" else rec.state
        reason = rec.reason or (_UNFINISHED_REASON if state == "unfinished" else "(no reason recorded)")
        out.append((rec.task_id, state, reason))
    return out


def _reasons_json(result: SimResult) -> dict:
    """``--json``'s account of the tasks that did not complete: counts by state
    and reason, and each task with its state and reason."""
    by: dict[str, dict[str, int]] = {}
    tasks = []
    for task_id, state, reason in _not_completed(result):
        counts = by.setdefault(state, {})
        counts[reason] = counts.get(reason, 0) + 1
        tasks.append({"task_id": task_id, "state": state, "reason": reason})
    return {"by_reason": by, "tasks": tasks}


def _reasons_table(results: Sequence[SimResult], rows: int = 20, examples: int = 3) -> str:
    """Why tasks did not complete, one line per state and reason: the count
    under each policy and a few task ids ("" when every task completed)."""
    keys: dict[tuple[str, str], list] = {}  # (state, reason) -> [counts per policy, example ids]
    for i, r in enumerate(results):
        for task_id, state, reason in _not_completed(r):
            entry = keys.setdefault((state, reason), [[0] * len(results), []])
            entry[0][i] += 1
            if len(entry[1]) < examples and task_id not in entry[1]:
                entry[1].append(task_id)
    if not keys:
        return ""
    order = sorted(keys.items(), key=lambda kv: (_NOT_COMPLETED_STATES.index(kv[0][0])
                                                 if kv[0][0] in _NOT_COMPLETED_STATES else 9, -sum(kv[1][0])))
    lines = [f"tasks not completed, by reason (count: {' / '.join(r.policy for r in results)}; e.g. task ids):"]
    cells = [(state, "/".join(str(c) for c in counts), reason, ", ".join(ids))
             for (state, reason), (counts, ids) in order[:rows]]
    w0 = max(len(c[0]) for c in cells)
    w1 = max(len(c[1]) for c in cells)
    for state, count, reason, ids in cells:
        lines.append(f"  {state:<{w0}}  {count:>{w1}}  {reason}  (e.g. {ids})")
    if len(order) > rows:
        lines.append(f"  ... {len(order) - rows} more reasons (--json lists every task and its reason)")
    return "\n".join(lines)


def simulate_main(argv: Sequence[str] | None = None) -> int:
    """``gpulb simulate``: replay a trace into a cluster under each policy."""
    from scheduler import simreport
    from scheduler.errors import NotLeaseHolder

    p = argparse.ArgumentParser(
        prog="gpulb simulate",
        description="Replay a task trace into a modelled cluster on a virtual clock, "
        "placing with gpulb's own scheduler, and compare policies side by side.",
    )
    p.add_argument("--trace", required=True, help="trace CSV (see scheduler/traces.py)")
    p.add_argument("--cluster", required=True, help="cluster CSV (see scheduler/cluster.py)")
    p.add_argument("--policy", type=_policies, default=list(POLICIES),
                   help="comma-separated policies, or 'all' (default: all); NAME@requests runs NAME with no "
                        "telemetry (placement by the tasks' asks only, the baseline of a scheduler without a metrics pipeline)")
    p.add_argument("--time-scale", type=_scale, default=1.0,
                   help="divide submit times and durations by this (a faster clock)")
    p.add_argument("--arrival-scale", type=_scale, default=1.0,
                   help="divide submit times only by this (more offered load)")
    p.add_argument("--seed", type=_seed, default=0, help="seed of the memory draws, an integer >= 0 (default 0)")
    p.add_argument("--memory", choices=("genai", "asked"), default="genai",
                   help="real memory use: measured GenAI ratios (default) or exactly the ask")
    p.add_argument("--max-tasks", type=_count, default=None, metavar="N",
                   help="replay only the first N tasks by submit time (N >= 1; default: all)")
    p.add_argument("--no-prediction", action="store_true",
                   help="score without learned speeds (the coordinator always learns them; this shows what they are worth)")
    p.add_argument("--no-memory-learning", action="store_true",
                   help="score without learned memory growth (no oom_risk term; shows what it is worth)")
    p.add_argument("--saturate", action="store_true",
                   help="also run the FGD saturation measure (tasks never end)")
    p.add_argument("--advisor", action="store_true",
                   help="also run each policy with the rebalance advisor carrying out its plans (shown as POLICY+advisor)")
    p.add_argument("--advisor-set", action="append", default=[], metavar="OPTION=VALUE",
                   help="an [advisor] option for the --advisor runs, e.g. variance_threshold=100 or "
                   "movable_kinds=training,batch (repeatable)")
    p.add_argument("--scheduler-set", action="append", default=[], metavar="OPTION=VALUE",
                   help="a [scheduler] option for every run, as the coordinator would have it, e.g. "
                   "growth_room_wait_s=0 or backfill_estimate_factor=2 (repeatable; --policy names the policy)")
    p.add_argument("--migration-cost", type=_ranged(1e9), default=SimConfig.migration_cost_s, metavar="S",
                   help="s of work a migrated task redoes on its new GPU: checkpoint, transfer, restart (default 30; "
                   "at most 1e9)")
    p.add_argument("--load-drift", type=_ranged(10.0, " (the walk is clipped to 0.25..2 times the start anyway)"),
                   default=0.0, metavar="SIGMA",
                   help="tasks' utilisation walks after placement, a log-normal step of SIGMA per phase of work "
                   "(default 0: constant; at most 10); what the advisor is for")
    p.add_argument("--estimate-scale", type=_ranged(1000.0), default=1.0, metavar="F",
                   help="clients estimate each task's run time as F times its duration (default 1: exact; "
                   "below 1: they estimate short; at most 1000); tasks with an estimate_s column keep theirs")
    p.add_argument("--estimate-noise", type=_ranged(10.0, " (10 already puts estimates e^10 = 22,026 times off)"),
                   default=0.0, metavar="SIGMA",
                   help="and misjudge it by a log-normal factor exp(SIGMA * z), drawn per task from --seed (default 0; "
                   "at most 10)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("--plot", metavar="DIR", help="write PNG plots here (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr (shown only on a terminal)")
    args = p.parse_args(argv)
    if args.advisor_set and not args.advisor:
        p.error("--advisor-set needs --advisor (it sets the advisor of the --advisor runs)")
    if not 0 < args.time_scale * args.arrival_scale < math.inf:
        p.error(f"--time-scale {args.time_scale:g} times --arrival-scale {args.arrival_scale:g} is out of range")
    try:
        tasks = read_trace(args.trace)
        nodes = read_cluster(args.cluster)
    except (OSError, ValueError) as exc:
        print(f"gpulb simulate: {exc}", file=sys.stderr)
        return 2
    if not tasks:
        print(f"gpulb simulate: {args.trace}: no tasks (a header and no rows): nothing to replay", file=sys.stderr)
        return 2
    tasks = scale_trace(tasks, args.time_scale, args.arrival_scale)
    tasks = misestimate(tasks, args.estimate_scale, args.estimate_noise, args.seed)
    tasks.sort(key=lambda t: t.submit_s)
    if args.max_tasks is not None:
        tasks = tasks[: args.max_tasks]
    problem = _replay_limits_error(tasks, nodes, args.time_scale, args.arrival_scale, args.migration_cost)
    if problem is not None:
        print(f"gpulb simulate: {problem}", file=sys.stderr)
        return 2
    try:
        from coordinator.settings import section_from_text  # the [advisor] table's own parsing

        advisor = section_from_text("advisor", args.advisor_set) if args.advisor else None
    except ValueError as exc:
        print(f"gpulb simulate: --advisor-set: {exc}", file=sys.stderr)
        return 2
    scheduler = None
    if args.scheduler_set:
        from coordinator.settings import SECTIONS, options

        # the policy comes from --policy, and simulated leases never expire
        fixed = {"policy": "use --policy", "lease_s": "simulated leases never expire"}
        # the [scheduler] table's own list would offer the fixed ones, then refuse them
        settable = sorted(o.name for section in SECTIONS if section.name == "scheduler"
                          for o in options(section) if o.name not in fixed)
        for assignment in args.scheduler_set:
            key, sep, _ = assignment.partition("=")
            key = key.strip()
            if key in fixed:
                print(f"gpulb simulate: --scheduler-set: {assignment!r}: set by the simulator ({fixed[key]})",
                      file=sys.stderr)
                return 2
            if not sep or key not in settable:
                print(f"gpulb simulate: --scheduler-set: {assignment!r}: expected OPTION=VALUE with OPTION one of "
                      f"{', '.join(settable)}", file=sys.stderr)
                return 2
        try:
            scheduler = section_from_text("scheduler", args.scheduler_set)
        except ValueError as exc:
            print(f"gpulb simulate: --scheduler-set: {exc}", file=sys.stderr)
            return 2
    cfg = SimConfig(seed=args.seed, memory=args.memory, prediction=not args.no_prediction,
                    memory_learning=not args.no_memory_learning, migration_cost_s=args.migration_cost,
                    util_drift=args.load_drift, scheduler=scheduler)
    if args.plot:
        # made now: a folder that cannot be is said before the replay, not after it
        problem = _plot_dir_error(args.plot)
        if problem is not None:
            print(f"gpulb simulate: {problem}", file=sys.stderr)
            return 2
    progress = not args.no_progress and sys.stderr.isatty()
    try:
        results = simulate(tasks, nodes, args.policy, cfg, progress=progress)
        bases = list(args.policy)  # the policy each result runs, without "+advisor"
        if advisor is not None:
            # each policy next to itself with the advisor: the same trace, draws and drift
            with_advisor = simulate(tasks, nodes, args.policy, replace(cfg, advisor=advisor), progress=progress,
                                    label_suffix="+advisor")
            for r in with_advisor:
                r.policy = f"{r.policy}+advisor"
            results = [r for pair in zip(results, with_advisor) for r in pair]
            bases = [name for name in args.policy for _ in range(2)]
        simreport.attach_floors(results, tasks, nodes)  # how far each policy is from the best the work allows
        if args.saturate:
            # the saturation run places without ever ending a task: no advisor
            # acts in it, so a POLICY+advisor run shares POLICY's
            measured: dict[str, SaturationResult] = {}
            for r, base in zip(results, bases):
                if base not in measured:
                    measured[base] = saturate(tasks, nodes, base, config=cfg)
                r.saturation = measured[base]
    except NotLeaseHolder as exc:
        # the limits checked above leave a hundredfold for sharing; a run
        # slowed beyond that outlives the simulator's lease
        if progress:
            sys.stderr.write("\n")  # off the progress bar's line
        print(f"gpulb simulate: task {exc.task_id!r} ran past the simulator's {_LEASE_S:g} s lease (a run slowed "
              f"far beyond its duration by sharing its GPUs): shorten the trace's durations or raise --time-scale",
              file=sys.stderr)
        return 2
    meta = {
        "trace": args.trace,
        "cluster": args.cluster,
        "time_scale": args.time_scale,
        "arrival_scale": args.arrival_scale,
        "seed": args.seed,
        "memory": args.memory,
    }
    if args.load_drift:
        meta["load_drift"] = args.load_drift
    if args.estimate_scale != 1.0 or args.estimate_noise:
        meta["estimate_scale"] = args.estimate_scale
        meta["estimate_noise"] = args.estimate_noise
    meta.update({f"scheduler.{o.partition('=')[0].strip()}": o.partition("=")[2].strip() for o in args.scheduler_set})
    if advisor is not None:
        meta["migration_cost_s"] = args.migration_cost
        meta.update({f"advisor.{o.partition('=')[0].strip()}": o.partition("=")[2].strip() for o in args.advisor_set})
    if args.json:
        doc = simreport.to_json(results, meta)
        for fig, r in zip(doc["policies"], results):
            fig["not_completed"] = _reasons_json(r)  # why: counts by state and reason, and each task
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(simreport.render(results, meta))
        reasons = _reasons_table(results)
        if reasons:
            print()
            print(reasons)
    if args.plot:
        written = simreport.plot(results, args.plot)
        if not written:
            print("gpulb simulate: matplotlib is not installed; no plots written", file=sys.stderr)
        else:
            for path in written:
                print(f"wrote {path}", file=sys.stderr)
    return 0


def trace_main(argv: Sequence[str] | None = None) -> int:
    """``gpulb trace convert openb POD_CSV OUT_CSV`` and ``gpulb cluster ...``.

    ``argv`` starts with the group: ``trace`` or ``cluster``.
    """
    p = argparse.ArgumentParser(prog="gpulb", description="Make trace and cluster files for the simulator.")
    groups = p.add_subparsers(dest="group", required=True)

    tr = groups.add_parser("trace", help="trace files")
    tr_sub = tr.add_subparsers(dest="action", required=True)
    conv = tr_sub.add_parser("convert", help="convert a public trace")
    conv.add_argument("source", choices=("openb",))
    conv.add_argument("pod_csv")
    conv.add_argument("out_csv")
    conv.add_argument("--time-scale", type=_scale, default=1.0, help="divide all times by this")
    conv.add_argument("--times-from", help="reference pod list for lists without times (must exist)")
    conv.add_argument("--seed", type=_seed, default=0,
                      help="seed of the reference rows drawn for pods without times, an integer >= 0 (default 0)")

    cl = groups.add_parser("cluster", help="cluster files")
    cl_sub = cl.add_subparsers(dest="action", required=True)
    cconv = cl_sub.add_parser("convert", help="convert a public node list")
    cconv.add_argument("source", choices=("openb",))
    cconv.add_argument("node_csv")
    cconv.add_argument("out_csv")
    cconv.add_argument("--no-normalize-speed", action="store_true",
                       help="keep the table speeds (RTX 4090 = 1.0) instead of a mean of 1.0")
    homo = cl_sub.add_parser("homogeneous", help="N identical hosts")
    homo.add_argument("--hosts", type=int, default=8, help="hosts, 1..100,000 (default 8)")
    homo.add_argument("--gpus", type=int, default=4, help="GPUs per host, 1..64 (default 4)")
    homo.add_argument("--model", default="RTX 4090", help="a known GPU model (default RTX 4090)")
    homo.add_argument("--nvlink", default="", metavar="none|all|pairs|0-1;2-3",
                      help="each host's NVLink (the cluster format's nvlink column; default none)")
    homo.add_argument("out_csv")
    args = p.parse_args(argv)
    if args.group == "trace" and args.times_from and not os.path.isfile(args.times_from):
        print(f"gpulb trace: --times-from {args.times_from}: no such file", file=sys.stderr)
        return 2
    try:
        if args.group == "trace":
            tasks, stats = convert_openb(
                args.pod_csv, args.out_csv, time_scale=args.time_scale, times_from=args.times_from, seed=args.seed
            )
            print(f"{args.out_csv}: {stats.summary()}")
        elif args.action == "convert":
            nodes = convert_openb_nodes(args.node_csv, args.out_csv, normalize_speed=not args.no_normalize_speed)
            print(f"{args.out_csv}: {len(nodes)} nodes, {sum(n.gpus for n in nodes)} GPUs")
        else:
            nodes = homogeneous(args.hosts, args.gpus, args.model, nvlink=args.nvlink)
            write_cluster(nodes, args.out_csv)
            linked = f", NVLink {args.nvlink}" if nodes[0].nvlink_pairs else ""
            print(f"{args.out_csv}: {args.hosts} hosts x {args.gpus} {nodes[0].model}{linked}")
    except (OSError, ValueError) as exc:
        print(f"gpulb {args.group}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(simulate_main())
