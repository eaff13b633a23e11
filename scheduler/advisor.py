"""The rebalance advisor: which running tasks to migrate, from hot GPUs to
cool ones, when load has drifted after placement.

Pure functions over a ``ClusterSnapshot`` and the leased tasks; the only state
(cool-downs, the trigger's streak, the moves of the current window) is an
explicit ``AdvisorState`` value passed in and returned (``Advisor`` keeps it
for callers that want an object).

Which GPUs count. A GPU's utilisation is the snapshot's smoothed ``util_pct``;
only healthy GPUs on fresh nodes with a known reading count (a stale reading
is not evidence). ``variance`` is the population variance of those readings,
in %².

Trigger (``check_trigger``), either of:

* ``variance``: the variance across GPUs is above ``variance_threshold`` (400 %²,
  a standard deviation of 20 points);
* ``hot_rising``: some GPU is above ``hot_pct`` (85 %) while ``rising_gpus`` (2)
  or more GPUs trend upward faster than ``rising_pct_per_min`` (5 %/min).

Each comparison is strict (at the threshold exactly, nothing fires).

Hysteresis. Once the variance rule has led to a plan it holds
(``Trigger.held``) until the variance falls to ``release_variance`` (25 %², a
standard deviation of 5 points; never above ``variance_threshold``): plans go
on until the load is even, not only until it is one move under the threshold,
and a variance hovering at the threshold does not switch the advisor on and
off. It arms on a plan, not on the rule firing, so noise that crosses the
threshold without a persistent source (see below) arms nothing. Without it
the advisor stops at ~399 %² and the cluster spends its time just under the
threshold (bench_learning's training cluster, 3 seeds: util std −7 % with
the advisor on; with the hold, −15 %). What ends a held episode is then
mostly the move rules, not the release: once no move narrows a difference by
``margin_pct`` the plans stop by themselves. A release of 100 %² (a std of
10, round 17) let go while such moves were left: util std on that cluster,
placed by load_aware, −17 % with it, −29 % at 25 %² (50: −28 %; 10 or 0:
the same as 25), with more moves (243 -> 413 a run) and a shorter mean
response, and on every bench_learning run mean slowdown fell or held.
``release_variance = variance_threshold`` turns it off.

Against noise (``advise``). Migrating is expensive, so the advisor acts on
imbalance that lasts: it judges each GPU by its own EWMA of the readings over
its evaluations (``smoothing_alpha``, 0.3; 1.0 judges the latest reading
alone), and proposes a plan only once the trigger has fired, and the move it
would start with has come from the same source GPU, in ``persist``
evaluations in a row: a real hot spot stays where it is, while noise moves
the apparent one around. Once a plan is made, the averages of its GPUs are
set to what the plan expects, so the next evaluation does not act again on
load that is already on its way out.

Moves (``plan_moves``; rule 5 in ``advise``), greedy, at most ``max_moves``
per ``window_s``:

1. a task's *load* is its part of its GPU's measured utilisation, split
   between the GPU's tasks in proportion to their declared ``gpu_share``
   (equal parts when none declares one); on several GPUs, the mean of its
   parts;
2. a task may move when it is *movable* (``spec.movable`` or its kind is in
   ``movable_kinds``; never when its kind is in ``pinned_kinds``, inference by
   default; kinds compared in lower case), was placed at least ``min_age_s``
   ago, and is not cooling down from an earlier move;
3. sources are GPUs hotter than the mean, hottest first (a multi-GPU task
   counts under its hottest GPU); for each of its movable tasks the
   destination is the coolest GPU that passes the scheduler's own filters
   (``scheduler.filters.feasible`` over a ``PlacementView`` with the live
   reservations) for the task's spec, after the memory of moves already
   planned, is not the source, and is not much slower for the task: its
   slowdown (the snapshot's learned ``gpu_slowdown`` for the task's kind,
   else ``1 / node_speed``) at most ``max_slowdown_ratio`` times the
   source's (on a mixed cluster a move must not trade a hot fast GPU for a
   cool one 20 times slower). A task on ``k`` GPUs moves whole, to ``k``
   GPUs of one node (as ``Scheduler.migrate`` takes it): per node its ``k``
   coolest that pass, for an NVLink task only when those are one
   NVLink-connected group;
4. moving load ``l`` from a source at ``u_h`` to a destination at ``u_c``
   (gap ``d = u_h - u_c``) changes the variance by ``2 l (l - d) / N``; the
   move is taken only when it narrows the pair's difference by at least
   ``margin_pct``: ``margin / 2 <= l <= d - margin / 2`` (so it always lowers
   the variance, and never makes the destination the new hot spot). On
   ``k`` GPUs the sources and destinations pair hottest with hottest (the
   pairing that leaves the smallest gap largest) and every pair must pass;
   the node with the largest total gap wins. Among a source's tasks the one
   with the largest variance reduction wins;
5. no plan while tasks wait in the queue (``pause_when_queued``): the
   scheduler is already filling the cool GPUs with new work (a migrated task
   no longer queues, ``Scheduler.migrate`` moves its lease in one step, but
   acting while tasks wait gained nothing in bench_learning and cost the
   mixed cluster mean response);
6. both GPUs of a move take no part in another move of the same plan, and
   the task and both GPUs are left alone for ``cooldown_s`` afterwards: a
   plan cannot be undone by the next one (no flapping);
7. the reserve: per GPU model, the GPUs with memory room for a *large* task
   (``reserve_mib``, else the 90th percentile of the memory asks of arriving
   single-GPU tasks, from the scheduler's ``WorkloadMix``) are kept: a move
   does not fill such a GPU past that room while no more than
   ``reserve_share`` of the model's counted GPUs have it, unless its
   source, of the same model, gains the room. Evening load also evens free
   memory: without the reserve, on bench_learning's mixed cluster (10
   seeds), whole-GPU tasks found no RTX 4090 with room and went to the 20x
   slower cards, and mean wait rose 37 % with the advisor on. The same for
   tasks on k > 1 GPUs, per GPU count k among the arrivals: a node is *open*
   for k when k of its GPUs have room for a large k-GPU task (the 90th
   percentile of their asks per GPU), and a move does not close one while
   no more than ``reserve_share`` of the model's nodes (of at least k
   counted GPUs) are open, unless its source node, of the same model, opens.
   Spreading single-GPU work over the GPUs leaves no node for a multi-GPU
   task to start on: on bench_learning's 8 x 4 cluster (24 seeds, three
   restart costs) the advisor's mean slowdown cost was 1.6 points, 0.5
   without the few 2- and 4-GPU tasks in the trace, and 1.4 with open
   nodes kept (that replay is chaotic: README, "Learning", round 12);
8. the big cards (``keep_big_cards``): where a few cards have much more
   memory than the rest (``scheduler.scoring.big_card_column``, the
   load-aware ``big_cards`` rule), a task whose need the other cards hold
   is not moved onto one. They are often the coolest GPUs because placement
   keeps small work off them; filling them by migration would undo that
   (refused as ``reserve``).

Each ``Move`` carries the variance expected once it and the moves before it
are done; the ``Plan`` the variance before and after all of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from scheduler.config import SchedulerConfig
from scheduler.filters import feasible, nvlink_groups
from scheduler.fragmentation import WorkloadMix
from scheduler.reservations import Reservations
from scheduler.scoring import big_card_column, big_card_need
from scheduler.snapshot import ClusterSnapshot
from scheduler.task import Task, TaskState
from scheduler.view import PlacementView, coded_models

__all__ = [
    "AdvisorConfig",
    "AdvisorState",
    "Trigger",
    "Move",
    "Plan",
    "Advisor",
    "counted_gpus",
    "utilization_variance",
    "check_trigger",
    "is_movable",
    "task_loads",
    "plan_moves",
    "advise",
    "reserve_ask_mib",
    "next_change_s",
    "WHY_NO_MOVE",
]

TRIGGER_VARIANCE = "variance"
# Why a dry run found nothing to move, per leased task kept in place (plan_moves' ``why``):
# pinned (its kind may not move), cooling_down (moved within cooldown_s),
# too_young (placed under min_age_s ago), not_on_a_hot_gpu (its GPU is not
# hotter than the mean, or is part of a move already), load_not_in_the_gap
# (no GPU cool enough to narrow the difference by margin_pct without
# becoming the hot spot), no_gpu_takes_it (filters, memory, slowdown),
# reserve (only GPUs or nodes the reserve keeps room on would take it); and, with no
# task looked at: not_fired, window_full (max_moves used), tasks_queued
# (pause_when_queued), too_few_gpus
WHY_NO_MOVE = ("pinned", "cooling_down", "too_young", "not_on_a_hot_gpu", "load_not_in_the_gap", "no_gpu_takes_it",
               "reserve", "not_fired", "window_full", "tasks_queued", "too_few_gpus")
# which of the arriving tasks' memory asks (per GPU count) is a large task's (rule 7)
RESERVE_ASK_QUANTILE = 0.9
# sources examined per move, hottest first (each costs a filter pass per task)
_MAX_SOURCES = 64
TRIGGER_HOT_RISING = "hot_rising"


@dataclass(frozen=True)
class AdvisorConfig:
    """Thresholds and limits of the advisor, with their units."""

    # %²: variance of utilisation across GPUs above which a plan is wanted.
    variance_threshold: float = 400.0
    # %²: once a plan came of the variance rule, it holds until the variance
    # falls to this (at most variance_threshold).
    release_variance: float = 25.0
    # %: a GPU above this is hot.
    hot_pct: float = 85.0
    # %/min: a GPU whose trend is above this is rising.
    rising_pct_per_min: float = 5.0
    # GPUs rising at once that, with one hot GPU, trigger a plan.
    rising_gpus: int = 2
    # Evaluations in a row the trigger must hold, with the same source GPU, before a plan.
    persist: int = 2
    # EWMA weight of a new reading in the advisor's per-GPU average (1.0: no averaging).
    smoothing_alpha: float = 0.3
    # Migrations per window (over all plans in it).
    max_moves: int = 2
    # s: the window max_moves counts over.
    window_s: float = 60.0
    # s: how long a moved task and both GPUs of its move are left alone.
    cooldown_s: float = 300.0
    # s: how long a task must have been placed before it may move.
    min_age_s: float = 60.0
    # %: a move must narrow the source/destination difference by at least this.
    margin_pct: float = 10.0
    # A destination may be at most this many times slower for the task than its source.
    max_slowdown_ratio: float = 1.5
    # Kinds that move even when spec.movable is not set.
    movable_kinds: frozenset[str] = frozenset({"training"})
    # Kinds that never move, whatever spec.movable says.
    pinned_kinds: frozenset[str] = frozenset({"inference"})
    # Propose nothing while tasks wait in the scheduler's queue.
    pause_when_queued: bool = True
    # Share of each model's GPUs kept with room for a large task, and of its nodes with room for a large multi-GPU one: a move does not take that room from one of the last ones (0: no reserve).
    reserve_share: float = 0.25
    # MiB: what a large single-GPU task asks; 0: the 90th percentile of the asks of arriving single-GPU tasks (a large k-GPU task's always comes from the arrivals).
    reserve_mib: float = 0.0
    # Rule 8: a move does not put a task on one of the few big-memory cards when the other cards hold its need (the load-aware big_cards rule, [scheduler] big_card_share), so the advisor does not fill what placement keeps free.
    keep_big_cards: bool = True

    def __post_init__(self) -> None:
        # task kinds are free text kept as submitted and compared in lower case
        # (is_movable, as the scheduler's retry_kinds): "LLM-Serving" as written
        # by the operator never matched, and a pinned kind moved (QA pass 25)
        for name in ("movable_kinds", "pinned_kinds"):
            value = getattr(self, name)
            if not isinstance(value, str) and all(isinstance(k, str) for k in value):
                object.__setattr__(self, name, frozenset(k.lower() for k in value))

    @property
    def release_level(self) -> float:
        """%²: where the variance rule's hold ends (``release_variance``, never
        above ``variance_threshold``)."""
        return min(self.release_variance, self.variance_threshold)

    def validate(self) -> "AdvisorConfig":
        def non_negative(name: str) -> None:
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name}: must be a finite number >= 0, got {value!r}")

        for name in ("variance_threshold", "release_variance", "rising_pct_per_min", "cooldown_s", "min_age_s",
                     "margin_pct", "reserve_mib"):
            non_negative(name)
        if not (math.isfinite(self.max_slowdown_ratio) and self.max_slowdown_ratio >= 1.0):
            raise ValueError(f"max_slowdown_ratio: must be a finite number >= 1, got {self.max_slowdown_ratio!r}")
        if not (math.isfinite(self.hot_pct) and 0 <= self.hot_pct <= 100):
            raise ValueError(f"hot_pct: must be in [0, 100], got {self.hot_pct!r}")
        if not (math.isfinite(self.smoothing_alpha) and 0 < self.smoothing_alpha <= 1):
            raise ValueError(f"smoothing_alpha: must be in (0, 1], got {self.smoothing_alpha!r}")
        if not (math.isfinite(self.window_s) and self.window_s > 0):
            raise ValueError(f"window_s: must be a finite number > 0, got {self.window_s!r}")
        if not (math.isfinite(self.reserve_share) and 0 <= self.reserve_share <= 1):
            raise ValueError(f"reserve_share: must be in [0, 1], got {self.reserve_share!r}")
        for name in ("movable_kinds", "pinned_kinds"):
            value = getattr(self, name)
            if isinstance(value, str) or not all(isinstance(k, str) for k in value):
                raise ValueError(f"{name}: must be a list of task kinds, got {value!r}")
        for name in ("rising_gpus", "persist", "max_moves"):
            least = 0 if name == "max_moves" else 1
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name}: must be an integer >= {least}, got {value!r}")
        return self


@dataclass(frozen=True, slots=True)
class Trigger:
    """Why a plan is wanted (or, with ``fired`` False, the figures that said no)."""

    fired: bool
    reason: str  # "variance", "hot_rising" or "" when not fired
    variance: float  # %² across counted GPUs
    hottest_pct: float  # % of the hottest counted GPU
    rising: int  # GPUs trending up faster than rising_pct_per_min
    gpus: int  # GPUs counted
    held: bool = False  # fired only because the variance rule holds (hysteresis, module docstring)


@dataclass(frozen=True, slots=True)
class Move:
    """Migrate one task from its GPUs to as many GPUs of one node.

    The ``*_gpu_index`` / ``*_gpu_uuid`` fields name the first GPU of each
    side (all a single-GPU task has); the ``*_gpu_indexes`` / ``*_gpu_uuids``
    tuples name every GPU, the source in the task's order and the
    destination by index."""

    task_id: str
    lease_id: str
    kind: str
    from_node_id: str
    from_gpu_index: int
    from_gpu_uuid: str
    to_node_id: str
    to_gpu_index: int
    to_gpu_uuid: str
    load_pct: float  # % utilisation the move shifts, per GPU
    from_util_pct: float  # source utilisation before the move (%, mean over its GPUs)
    to_util_pct: float  # destination utilisation before the move (%, mean over its GPUs)
    variance_after: float  # %² expected once this move and the ones before it are done
    from_gpu_indexes: tuple[int, ...] = ()
    from_gpu_uuids: tuple[str, ...] = ()
    to_gpu_indexes: tuple[int, ...] = ()
    to_gpu_uuids: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # a single-GPU move named by its first GPUs alone
        for many, one in (("from_gpu_indexes", "from_gpu_index"), ("from_gpu_uuids", "from_gpu_uuid"),
                          ("to_gpu_indexes", "to_gpu_index"), ("to_gpu_uuids", "to_gpu_uuid")):
            if not getattr(self, many):
                object.__setattr__(self, many, (getattr(self, one),))

    def to_dict(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in self.__slots__}
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


@dataclass(frozen=True, slots=True)
class Plan:
    """A set of moves proposed at one instant."""

    plan_id: int
    created_at_s: float  # the clock's seconds (monotonic in the coordinator, virtual in the simulator)
    trigger: str  # "variance" or "hot_rising"
    variance_before: float  # %²
    variance_after: float  # %², expected once every move is done
    spread_before: float  # % hottest minus coolest counted GPU
    spread_after: float  # %, expected
    moves: tuple[Move, ...]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (the command hook's stdin)."""
        out = {name: getattr(self, name) for name in self.__slots__ if name != "moves"}
        out["moves"] = [m.to_dict() for m in self.moves]
        return out


@dataclass(frozen=True)
class AdvisorState:
    """What the advisor remembers between evaluations (immutable; ``advise`` returns the next)."""

    streak: int = 0  # evaluations in a row with the trigger fired and the same first source GPU
    armed: bool = False  # a plan came of the variance rule, and the variance has not fallen to release_variance since
    source: str = ""  # GPU uuid the last evaluation's plan would have started from
    moved_at: Mapping[str, float] = field(default_factory=dict)  # task id -> s of its last move
    touched_at: Mapping[str, float] = field(default_factory=dict)  # GPU uuid -> s of its last move
    move_times: tuple[float, ...] = ()  # s of the moves inside the current window
    next_plan_id: int = 1
    last_trigger: Trigger | None = None
    # the advisor's per-GPU EWMA of utilisation (%), rows in the order of ``smoothed_uuids``
    smoothed_uuids: tuple[str, ...] = ()
    smoothed_util: np.ndarray | None = field(default=None, compare=False)

    def moves_in_window(self, now: float, window_s: float) -> int:
        return sum(1 for t in self.move_times if now - t < window_s)


# ---- measurements ---------------------------------------------------------------------------------


def counted_gpus(snapshot: ClusterSnapshot) -> np.ndarray:
    """Bool per GPU row: healthy, on a fresh node, with a known utilisation."""
    s = snapshot
    if s.gpu_count == 0:
        return np.zeros(0, dtype=bool)
    util = np.asarray(s.util_pct, dtype=np.float64)
    return np.asarray(s.healthy, dtype=bool) & ~np.asarray(s.node_stale, dtype=bool)[s.gpu_node] & np.isfinite(util)


def utilization_variance(snapshot: ClusterSnapshot) -> float:
    """Population variance (%²) of utilisation over the counted GPUs; 0 with fewer than 2."""
    counted = counted_gpus(snapshot)
    if int(counted.sum()) < 2:
        return 0.0
    return float(np.var(np.clip(np.asarray(snapshot.util_pct, dtype=np.float64)[counted], 0.0, 100.0)))


def check_trigger(snapshot: ClusterSnapshot, config: AdvisorConfig | None = None, *, armed: bool = False) -> Trigger:
    """The trigger rules of the module docstring, on one snapshot; ``armed``:
    a plan came of the variance rule and the hold has not been released since."""
    cfg = config or AdvisorConfig()
    counted = counted_gpus(snapshot)
    n = int(counted.sum())
    if n < 2:
        return Trigger(False, "", 0.0, math.nan if n == 0 else float(snapshot.util_pct[counted][0]), 0, n)
    util = np.clip(np.asarray(snapshot.util_pct, dtype=np.float64)[counted], 0.0, 100.0)
    trend = np.asarray(snapshot.util_trend_pct_per_min, dtype=np.float64)[counted]
    variance = float(np.var(util))
    hottest = float(util.max())
    rising = int(np.count_nonzero(np.nan_to_num(trend, nan=0.0) > cfg.rising_pct_per_min))
    if variance > cfg.variance_threshold:
        return Trigger(True, TRIGGER_VARIANCE, variance, hottest, rising, n)
    if armed and variance > cfg.release_level:
        return Trigger(True, TRIGGER_VARIANCE, variance, hottest, rising, n, held=True)
    if hottest > cfg.hot_pct and rising >= cfg.rising_gpus:
        return Trigger(True, TRIGGER_HOT_RISING, variance, hottest, rising, n)
    return Trigger(False, "", variance, hottest, rising, n)


def is_movable(task: Task, config: AdvisorConfig | None = None) -> bool:
    """Movable by kind and flag (module docstring, rule 2, first part)."""
    cfg = config or AdvisorConfig()
    kind = task.spec.kind.lower()
    if kind in cfg.pinned_kinds:
        return False
    return bool(task.spec.movable) or kind in cfg.movable_kinds


def task_loads(snapshot: ClusterSnapshot, tasks: Iterable[Task]) -> dict[str, tuple[tuple[int, ...], float]]:
    """Leased task id -> (GPU rows, load %): each GPU's measured utilisation split
    between its tasks in proportion to their ``gpu_share`` (equal parts when
    none declares one). Tasks on GPUs the snapshot does not have are left out."""
    row_of = {u: i for i, u in enumerate(snapshot.gpu_uuid)}.get
    ids: list[str] = []
    placed: list[tuple[int, ...]] = []
    shares: list[float] = []
    leased = TaskState.LEASED
    # one pass per leased task on the coordinator's event loop (16,000 at 1,000
    # nodes): the single-GPU case, nearly every task, without a generator
    for task in tasks:
        a = task.assignment
        if a is None or task.state != leased:
            continue
        uuids = a.gpu_uuids
        if len(uuids) == 1:
            row = row_of(uuids[0], -1)
            if row < 0:
                continue
            rows: tuple[int, ...] = (row,)
        else:
            rows = tuple([row_of(u, -1) for u in uuids])
            if not rows or min(rows) < 0:
                continue
        spec = task.spec
        ids.append(spec.task_id)
        placed.append(rows)
        shares.append(spec.gpu_share)
    if not ids:
        return {}
    # one entry per (task, GPU) pair, split per GPU in numpy: a Python pass
    # per pair was half of a plan's time at 1,000 nodes and 16,000 tasks
    widths = np.fromiter(map(len, placed), dtype=np.intp, count=len(placed))
    owner = np.repeat(np.arange(len(ids)), widths)
    row = np.fromiter((r for rows in placed for r in rows), dtype=np.intp, count=int(widths.sum()))
    share = np.asarray(shares, dtype=np.float64)[owner]
    g = snapshot.gpu_count
    reading = np.asarray(snapshot.util_pct, dtype=np.float64)[row]
    util = np.clip(np.where(np.isfinite(reading), reading, 0.0), 0.0, 100.0)
    total = np.bincount(row, weights=share, minlength=g)[row]
    count = np.bincount(row, minlength=g)[row]
    part = np.where(total > 0, util * share / np.where(total > 0, total, 1.0), util / count)
    load = np.bincount(owner, weights=part, minlength=len(ids)) / widths
    return {i: (rows, float(x)) for i, rows, x in zip(ids, placed, load.tolist())}


# ---- planning ----------------------------------------------------------------------------------------


def plan_moves(
    snapshot: ClusterSnapshot,
    tasks: Sequence[Task],
    config: AdvisorConfig | None = None,
    *,
    now: float,
    budget: int | None = None,
    cooling_tasks: Iterable[str] = (),
    cooling_gpus: Iterable[str] = (),
    reservations: Reservations | None = None,
    scheduler_config: SchedulerConfig | None = None,
    workload_mix: WorkloadMix | None = None,
    why: dict[str, int] | None = None,
) -> tuple[list[Move], float, float, float, float]:
    """Greedy moves (module docstring, rules 2-4 and 6-7): ``(moves, variance before,
    variance after, spread before, spread after)``. ``budget`` caps the moves
    (default ``max_moves``); ``cooling_*`` are task ids and GPU uuids left alone;
    ``workload_mix`` (the scheduler's arrivals) sizes the reserve's large task
    unless ``reserve_mib`` does. When no move is found, ``why`` (if given)
    gets, per ``WHY_NO_MOVE`` reason, how many leased tasks it kept in place."""
    def refuse(reason: str) -> None:
        if why is not None and not moves:
            why[reason] = why.get(reason, 0) + 1

    cfg = config or AdvisorConfig()
    budget = cfg.max_moves if budget is None else budget
    counted = counted_gpus(snapshot)
    n = int(counted.sum())
    util = np.clip(np.nan_to_num(np.asarray(snapshot.util_pct, dtype=np.float64), nan=0.0), 0.0, 100.0)

    def spread(u: np.ndarray) -> float:
        return float(u[counted].max() - u[counted].min()) if n else 0.0

    before = float(np.var(util[counted])) if n >= 2 else 0.0
    spread0 = spread(util)
    moves: list[Move] = []
    if n < 2 or budget <= 0 or not tasks:
        return [], before, before, spread0, spread0
    by_id = {t.task_id: t for t in tasks}
    loads = task_loads(snapshot, tasks)
    cooling_task_set = set(cooling_tasks)
    busy = np.zeros(snapshot.gpu_count, dtype=bool)
    row_of = {u: i for i, u in enumerate(snapshot.gpu_uuid)}
    for uuid in cooling_gpus:
        r = row_of.get(uuid)
        if r is not None:
            busy[r] = True
    # movable tasks per source row: a multi-GPU task under its hottest GPU
    candidates: dict[int, list[tuple[str, float, tuple[int, ...]]]] = {}
    util_at = util.tolist()
    movable_by: dict[tuple[str, bool], bool] = {}  # (kind, movable flag) -> is_movable
    for task_id, (rows, load) in loads.items():
        task = by_id[task_id]
        spec = task.spec
        key = (spec.kind, spec.movable)
        movable = movable_by.get(key)
        if movable is None:
            movable = movable_by[key] = is_movable(task, cfg)
        if not movable:
            refuse("pinned")
            continue
        if task_id in cooling_task_set:
            refuse("cooling_down")
            continue
        if now - task.assignment.placed_at < cfg.min_age_s:  # type: ignore[union-attr]
            refuse("too_young")
            continue
        source = rows[0] if len(rows) == 1 else max(rows, key=util_at.__getitem__)
        listed = candidates.get(source)
        if listed is None:
            candidates[source] = [(task_id, load, rows)]
        else:
            listed.append((task_id, load, rows))
    if not candidates:
        return [], before, before, spread0, spread0

    candidate_rows = np.fromiter(candidates, dtype=np.intp, count=len(candidates))
    view = PlacementView(snapshot, reservations, scheduler_config)
    added_vram = np.zeros(snapshot.gpu_count)
    slowdowns: dict[str, np.ndarray] = {}
    u = util.copy()
    half = cfg.margin_pct / 2.0
    s = snapshot
    large = reserve_ask_mib(cfg, workload_mix) if cfg.reserve_share > 0 else 0.0
    node_asks = node_reserve_asks(cfg, workload_mix)
    big_cards = big_card_column(view) if cfg.keep_big_cards else None  # rule 8
    if large > 0 or node_asks:
        models, model_code = coded_models(s)
        memory_room = np.minimum(view.headroom, view.reject_headroom)  # before the moves planned
    if large > 0:
        reserve = cfg.reserve_share * np.bincount(model_code[counted], minlength=len(models))
    if node_asks:
        gpu_node = np.asarray(s.gpu_node)
        node_model = np.zeros(s.node_count, dtype=np.int64)
        node_model[gpu_node] = model_code  # a node counts under its GPUs' model
        counted_per_node = np.bincount(gpu_node, weights=counted, minlength=s.node_count)
        node_reserve = {k: cfg.reserve_share * np.bincount(node_model[counted_per_node >= k], minlength=len(models))
                        for k in node_asks}
    while len(moves) < budget:
        mean = float(u[counted].mean())
        free = counted & ~busy
        coolest = float(u[free].min()) if free.any() else math.inf
        if large > 0 or node_asks:
            room = memory_room - added_vram  # after the moves planned
        if large > 0:
            # rule 7: per model, the GPUs with room for a large task
            hole = counted & (room >= large)
            scarce = (np.bincount(model_code[hole], minlength=len(models)) <= reserve)[model_code]
        if node_asks:
            # rule 7 for k-GPU tasks: per model, the nodes with k GPUs of room for a large one
            closing: list[tuple[int, float, np.ndarray, np.ndarray, np.ndarray]] = []
            for k, ask in node_asks.items():
                roomy = counted & (room >= ask)
                per_node = np.bincount(gpu_node, weights=roomy, minlength=s.node_count)
                open_node = per_node >= k
                scarce_node = open_node & (
                    np.bincount(node_model[open_node], minlength=len(models)) <= node_reserve[k])[node_model]
                closing.append((k, ask, roomy, per_node, scarce_node))
        best: tuple[float, tuple[int, ...], tuple[int, ...], str, float] | None = None
        # hottest first, ties in the order the sources were met (as a stable sort)
        by_heat = candidate_rows[np.argsort(-u[candidate_rows], kind="stable")]
        sources = by_heat[~busy[by_heat] & counted[by_heat] & (u[by_heat] > mean)].tolist()
        if why is not None and not moves:
            examined = set(sources[:_MAX_SOURCES])
            for h, listed in candidates.items():
                if h not in examined:
                    for _ in listed:
                        refuse("not_on_a_hot_gpu")
        for h in sources[:_MAX_SOURCES]:
            for task_id, load, rows in candidates[h]:
                if task_id in cooling_task_set or not (half <= load <= u[h] - coolest - half):
                    refuse("load_not_in_the_gap")  # not even the coolest GPU would make this move worth it
                    continue
                own = list(rows)
                if len(rows) > 1 and (busy[own].any() or not counted[own].all()):
                    refuse("not_on_a_hot_gpu")
                    continue
                spec = by_id[task_id].spec
                mask = feasible(view, spec) & counted & ~busy
                mask[own] = False
                slow = slowdowns.get(spec.kind)
                if slow is None:
                    slow = slowdowns[spec.kind] = _slowdown_of(snapshot, spec.kind)
                mask &= slow <= slow[own].max() * cfg.max_slowdown_ratio
                mask &= view.headroom - added_vram >= spec.vram_mib
                mask &= view.reject_headroom - added_vram > spec.vram_mib
                if not mask.any():
                    refuse("no_gpu_takes_it")
                    continue
                if big_cards is not None and 0 < big_card_need(view, spec) <= big_cards[1]:
                    mask &= big_cards[0] == 0  # rule 8: the other cards hold it
                    if not mask.any():
                        refuse("reserve")
                        continue
                if large > 0:
                    takes = hole & (room - spec.vram_mib < large) & scarce
                    for r in own:  # a source the move leaves with the room gives its model one back
                        if not hole[r] and room[r] + spec.vram_mib >= large:
                            takes &= model_code != model_code[r]
                    mask &= ~takes
                    if not mask.any():
                        refuse("reserve")
                        continue
                if node_asks:
                    # per k: the GPUs of the source's model when the move opens its node (it gives one back)
                    spared = [node_model[gpu_node] == node_model[gpu_node[own[0]]]
                              if _opens_source(own, k, ask, roomy, per_node, room, spec.vram_mib, gpu_node) else None
                              for k, ask, roomy, per_node, _ in closing]
                    for (k, ask, roomy, per_node, scarce_node), same_model in zip(closing, spared):
                        # the GPUs whose filling closes a scarce node (one with exactly k that have room)
                        takes = roomy & (room - spec.vram_mib < ask) & (per_node[gpu_node] == k) & scarce_node[gpu_node]
                        mask &= ~takes if same_model is None else ~(takes & ~same_model)
                    if not mask.any():
                        refuse("reserve")
                        continue
                # sources and destinations paired hottest with hottest: every
                # pair's gap must fit the load with the margin (for one GPU:
                # the destination is the coolest)
                src = np.asarray(sorted(rows, key=lambda r: -u[r]))
                dests = _destination_sets(snapshot, mask, u, len(rows), spec.needs_nvlink)
                if node_asks and len(rows) > 1 and len(dests):
                    # GPU by GPU misses a k'-GPU task closing a node that has
                    # room on fewer than k + k' GPUs: judge each node's set whole
                    keep = np.ones(len(dests), dtype=bool)
                    dest_node = gpu_node[dests[:, 0]]
                    for (k, ask, roomy, per_node, scarce_node), same_model in zip(closing, spared):
                        lost = (roomy[dests] & (room[dests] - spec.vram_mib < ask)).sum(axis=1)
                        closes = scarce_node[dest_node] & (per_node[dest_node] - lost < k)
                        keep &= ~closes if same_model is None else ~(closes & ~same_model[dests[:, 0]])
                    if not keep.any():
                        refuse("reserve")
                        continue
                    dests = dests[keep]
                if not len(dests):
                    refuse("no_gpu_takes_it")
                    continue
                gaps = u[src][None, :] - u[dests[:, ::-1]]
                ok = (gaps.min(axis=1) >= load + half) & (load >= half) & (load > 0)
                if not ok.any():
                    refuse("load_not_in_the_gap")
                    continue
                total_gap = np.where(ok, gaps.sum(axis=1), -np.inf)
                pick = int(np.argmax(total_gap))
                # moving load l from each source to its destination changes
                # the variance by 2 l (l - gap) / N per pair
                gain = 2.0 * load * float(total_gap[pick] - len(rows) * load) / n
                if best is None or gain > best[0]:
                    best = (gain, tuple(rows), tuple(int(r) for r in dests[pick]), task_id, load)
            if best is not None:
                break  # the hottest source with a useful move
        if best is None:
            break
        _, src_rows, dst_rows, task_id, load = best
        task = by_id[task_id]
        dst_rows = tuple(sorted(dst_rows, key=lambda r: int(s.gpu_index[r])))
        from_util, to_util = float(u[list(src_rows)].mean()), float(u[list(dst_rows)].mean())
        for r in src_rows:
            u[r] = max(0.0, u[r] - load)
        for r in dst_rows:
            u[r] = min(100.0, u[r] + load)
            added_vram[r] += task.spec.vram_mib
        busy[list(src_rows + dst_rows)] = True
        cooling_task_set.add(task_id)
        moves.append(
            Move(
                task_id=task_id,
                lease_id=task.assignment.lease_id,  # type: ignore[union-attr]
                kind=task.spec.kind,
                from_node_id=s.node_ids[int(s.gpu_node[src_rows[0]])],
                from_gpu_index=int(s.gpu_index[src_rows[0]]),
                from_gpu_uuid=s.gpu_uuid[src_rows[0]],
                to_node_id=s.node_ids[int(s.gpu_node[dst_rows[0]])],
                to_gpu_index=int(s.gpu_index[dst_rows[0]]),
                to_gpu_uuid=s.gpu_uuid[dst_rows[0]],
                load_pct=load,
                from_util_pct=from_util,
                to_util_pct=to_util,
                variance_after=float(np.var(u[counted])),
                from_gpu_indexes=tuple(int(s.gpu_index[r]) for r in src_rows),
                from_gpu_uuids=tuple(s.gpu_uuid[r] for r in src_rows),
                to_gpu_indexes=tuple(int(s.gpu_index[r]) for r in dst_rows),
                to_gpu_uuids=tuple(s.gpu_uuid[r] for r in dst_rows),
            )
        )
    after = float(np.var(u[counted]))
    return moves, before, after, spread0, spread(u)


def reserve_ask_mib(config: AdvisorConfig, workload_mix: WorkloadMix | None) -> float:
    """MiB a large task asks, for rule 7: ``reserve_mib``, else the 90th
    percentile of the asks of arriving single-GPU tasks; 0 when unknown."""
    if config.reserve_mib > 0:
        return float(config.reserve_mib)
    return workload_mix.ask_quantile(RESERVE_ASK_QUANTILE) if workload_mix is not None else 0.0


def _opens_source(own: Sequence[int], k: int, ask: float, roomy: np.ndarray, per_node: np.ndarray,
                  room: np.ndarray, vram_mib: float, gpu_node: np.ndarray) -> bool:
    """Whether moving a task off ``own`` (GPUs of one node) opens that node
    for a large k-GPU task (``roomy``: GPUs with room for one now): it gives
    its model one back (rule 7)."""
    n = int(gpu_node[own[0]])
    gained = sum(1 for r in own if not roomy[r] and room[r] + vram_mib >= ask)
    return per_node[n] < k <= per_node[n] + gained


def node_reserve_asks(config: AdvisorConfig, workload_mix: WorkloadMix | None) -> dict[int, float]:
    """Per GPU count k > 1 of arriving tasks: the MiB per GPU a large k-GPU
    task asks (the 90th percentile of their asks), for rule 7's nodes."""
    if config.reserve_share <= 0 or workload_mix is None:
        return {}
    asks = {k: workload_mix.ask_quantile(RESERVE_ASK_QUANTILE, k) for k in workload_mix.gpu_counts() if k > 1}
    return {k: a for k, a in asks.items() if a > 0}


def _destination_sets(
    snapshot: ClusterSnapshot, mask: np.ndarray, u: np.ndarray, count: int, needs_nvlink: bool
) -> np.ndarray:
    """Candidate destinations for a task on ``count`` GPUs, one per node with
    enough GPUs in ``mask``: that node's ``count`` coolest (by ``u``), ascending,
    as rows of a ``(nodes, count)`` array (the coolest GPU alone for one GPU).
    For an NVLink task on several GPUs, a node whose coolest set is not one
    NVLink-connected group offers none (``Scheduler.migrate`` would refuse it)."""
    if count == 1:
        return np.asarray([[int(np.argmin(np.where(mask, u, np.inf)))]]) if mask.any() else np.zeros((0, 1), int)
    rows = np.flatnonzero(mask)
    nodes = np.asarray(snapshot.gpu_node)[rows]
    order = np.lexsort((u[rows], nodes))
    rows, nodes = rows[order], nodes[order]
    starts = np.flatnonzero(np.r_[True, nodes[1:] != nodes[:-1]]) if rows.size else np.zeros(0, int)
    sizes = np.diff(np.r_[starts, rows.size])
    sets = rows[starts[sizes >= count][:, None] + np.arange(count)]
    if needs_nvlink and len(sets):
        index = np.asarray(snapshot.gpu_index)
        linked = [len(nvlink_groups(snapshot.node_nvlink[int(snapshot.gpu_node[g[0]])],
                                    [int(index[r]) for r in g])) == 1 for g in sets]
        sets = sets[np.asarray(linked, dtype=bool)]
    return sets


def _smooth(snapshot: ClusterSnapshot, state: AdvisorState, alpha: float) -> tuple[tuple[str, ...], np.ndarray]:
    """(GPU uuids, the advisor's average utilisation per row) after this reading."""
    uuids = tuple(snapshot.gpu_uuid)
    reading = np.asarray(snapshot.util_pct, dtype=np.float64)
    prev = state.smoothed_util
    if prev is None or alpha >= 1.0:
        return uuids, reading.copy()
    if uuids == state.smoothed_uuids:
        old = prev
    else:  # membership changed: carry over the GPUs that stayed
        index = {u: i for i, u in enumerate(state.smoothed_uuids)}
        old = np.asarray([prev[index[u]] if u in index else np.nan for u in uuids], dtype=np.float64)
    # unknown before (or now): start from (keep) the reading
    smoothed = np.where(np.isfinite(old), old + alpha * (reading - old), reading)
    return uuids, np.where(np.isfinite(reading), smoothed, np.nan)


def _slowdown_of(snapshot: ClusterSnapshot, kind: str) -> np.ndarray:
    """Per GPU row: the learned slowdown for ``kind`` (else any kind), else 1 / node speed."""
    columns = snapshot.gpu_slowdown
    column = columns.get(kind, columns.get("")) if columns else None
    if column is None or column.shape != (snapshot.gpu_count,):
        speed = np.asarray(snapshot.node_speed, dtype=np.float64)[snapshot.gpu_node]
        column = 1.0 / np.where(np.isfinite(speed) & (speed > 0), speed, 1.0)
    return np.where(np.isfinite(column) & (column > 0), column, 1.0)


def _prune(times: Mapping[str, float], now: float, keep_s: float) -> dict[str, float]:
    return {k: t for k, t in times.items() if now - t < keep_s}


def next_change_s(state: AdvisorState, config: AdvisorConfig, tasks: Iterable[Task], now: float) -> float:
    """The first time after ``now`` at which an evaluation on the same readings
    could answer differently: a leased task reaching ``min_age_s``, a task's or
    GPU's cool-down ending, a move leaving the window (``math.inf``: none). A
    caller that skips evaluations on unchanged readings (the simulator) must
    not skip past it, or a cluster whose load holds still never sees its tasks
    come of age."""
    gates = [t + config.cooldown_s for t in state.moved_at.values()]
    gates += [t + config.cooldown_s for t in state.touched_at.values()]
    gates += [t + config.window_s for t in state.move_times]
    for task in tasks:
        a = task.assignment
        if task.state == TaskState.LEASED and a is not None:
            gates.append(a.placed_at + config.min_age_s)
    return min((g for g in gates if g > now), default=math.inf)


def advise(
    snapshot: ClusterSnapshot,
    tasks: Sequence[Task],
    now: float,
    state: AdvisorState | None = None,
    config: AdvisorConfig | None = None,
    *,
    reservations: Reservations | None = None,
    scheduler_config: SchedulerConfig | None = None,
    queued: int = 0,
    workload_mix: WorkloadMix | None = None,
    paused: bool = False,
) -> tuple[Plan | None, AdvisorState]:
    """One evaluation: the trigger, the moves within the window's budget, and
    a plan once they have started from the same source GPU ``persist`` times
    in a row. ``queued``: tasks waiting in the scheduler's queue; ``paused``:
    no plan now (the coordinator's executor still carries out the last one),
    the averages and the trigger are updated and the streak starts over.
    Returns the plan (None when there is nothing to do yet) and the next state."""
    cfg = config or AdvisorConfig()
    state = state or AdvisorState()
    uuids, smoothed = _smooth(snapshot, state, cfg.smoothing_alpha)
    judged = replace(snapshot, util_pct=smoothed)
    trigger = check_trigger(judged, cfg, armed=state.armed)
    moved_at = _prune(state.moved_at, now, cfg.cooldown_s)
    touched_at = _prune(state.touched_at, now, cfg.cooldown_s)
    move_times = tuple(t for t in state.move_times if now - t < cfg.window_s)
    nxt = replace(state, streak=0, source="", moved_at=moved_at, touched_at=touched_at, move_times=move_times,
                  last_trigger=trigger, smoothed_uuids=uuids, smoothed_util=smoothed,
                  armed=state.armed and trigger.fired and trigger.reason == TRIGGER_VARIANCE)
    budget = cfg.max_moves - len(move_times)
    if paused or not trigger.fired or budget <= 0 or (cfg.pause_when_queued and queued > 0):
        return None, nxt
    moves, before, after, spread0, spread1 = plan_moves(
        judged,
        tasks,
        cfg,
        now=now,
        budget=budget,
        cooling_tasks=moved_at,
        cooling_gpus=touched_at,
        reservations=reservations,
        scheduler_config=scheduler_config,
        workload_mix=workload_mix,
    )
    if not moves:
        return None, nxt
    source = moves[0].from_gpu_uuid
    streak = state.streak + 1 if source == state.source else 1
    if streak < cfg.persist:
        return None, replace(nxt, streak=streak, source=source)
    plan = Plan(
        plan_id=state.next_plan_id,
        created_at_s=now,
        trigger=trigger.reason,
        variance_before=before,
        variance_after=after,
        spread_before=spread0,
        spread_after=spread1,
        moves=tuple(moves),
    )
    # the averages the plan expects (the GPUs of a plan's moves are disjoint)
    judged_util = np.clip(np.nan_to_num(smoothed, nan=0.0), 0.0, 100.0)
    expected = smoothed.copy()
    row_of = {u: i for i, u in enumerate(uuids)}
    for m in moves:
        moved_at[m.task_id] = now
        for uuid in m.from_gpu_uuids:
            touched_at[uuid] = now
            expected[row_of[uuid]] = max(0.0, judged_util[row_of[uuid]] - m.load_pct)
        for uuid in m.to_gpu_uuids:
            touched_at[uuid] = now
            expected[row_of[uuid]] = min(100.0, judged_util[row_of[uuid]] + m.load_pct)
    nxt = replace(
        nxt,
        smoothed_util=expected,
        streak=0,
        moved_at=moved_at,
        touched_at=touched_at,
        move_times=move_times + (now,) * len(moves),
        next_plan_id=state.next_plan_id + 1,
        armed=trigger.reason == TRIGGER_VARIANCE,
    )
    return plan, nxt


class Advisor:
    """``advise`` with its state kept between calls."""

    def __init__(self, config: AdvisorConfig | None = None, scheduler_config: SchedulerConfig | None = None) -> None:
        self.config = (config or AdvisorConfig()).validate()
        self.scheduler_config = scheduler_config
        self.state = AdvisorState()
        self.last_plan: Plan | None = None

    def not_carried_out(self, moves: Sequence[Move], planned_at: float) -> None:
        """Moves of a plan at ``planned_at`` that the executor did not carry
        out (its hook failed, timed out or could not start): their tasks and
        GPUs leave the cool-down and their slots return to the move window,
        so the advisor may propose them again and ``no_move`` does not count
        them as moved."""
        if not moves:
            return
        st = self.state
        tasks = {m.task_id for m in moves}
        gpus = {u for m in moves for u in (*m.from_gpu_uuids, *m.to_gpu_uuids)}
        moved_at = {k: t for k, t in st.moved_at.items() if not (k in tasks and t == planned_at)}
        touched_at = {k: t for k, t in st.touched_at.items() if not (k in gpus and t == planned_at)}
        times = list(st.move_times)
        for _ in moves:
            if planned_at in times:
                times.remove(planned_at)
        self.state = replace(st, moved_at=moved_at, touched_at=touched_at, move_times=tuple(times))

    def moved_before(self, moves: Mapping[str, tuple[float, Sequence[str]]], now: float) -> None:
        """Moves made before this advisor existed (a coordinator restart:
        task id -> (s of the move, the GPU uuids it moved to)): their tasks
        and GPUs cool down, and the move counts in the window, from then."""
        cfg, st = self.config, self.state
        moved_at, touched_at, times = dict(st.moved_at), dict(st.touched_at), list(st.move_times)
        for task_id, (at, gpus) in moves.items():
            if now - at < cfg.cooldown_s:
                moved_at[task_id] = max(at, moved_at.get(task_id, -math.inf))
                for uuid in gpus:
                    touched_at[uuid] = max(at, touched_at.get(uuid, -math.inf))
            if now - at < cfg.window_s:
                times.append(at)
        self.state = replace(st, moved_at=moved_at, touched_at=touched_at, move_times=tuple(sorted(times)))

    def evaluate(
        self,
        snapshot: ClusterSnapshot,
        tasks: Sequence[Task],
        now: float,
        *,
        reservations: Reservations | None = None,
        queued: int = 0,
        workload_mix: WorkloadMix | None = None,
        paused: bool = False,
    ) -> Plan | None:
        plan, self.state = advise(
            snapshot,
            tasks,
            now,
            self.state,
            self.config,
            reservations=reservations,
            scheduler_config=self.scheduler_config,
            queued=queued,
            workload_mix=workload_mix,
            paused=paused,
        )
        if plan is not None:
            self.last_plan = plan
        return plan

    def dry_run(
        self,
        snapshot: ClusterSnapshot,
        tasks: Sequence[Task],
        now: float,
        *,
        reservations: Reservations | None = None,
        queued: int = 0,
        workload_mix: WorkloadMix | None = None,
        why: dict[str, int] | None = None,
    ) -> tuple[Trigger, Plan | None]:
        """What a plan would be now, with this reading in the averages but
        ignoring persistence and leaving the state untouched: the trigger's
        figures and the plan (``plan_id`` 0; None when nothing would move,
        and then ``why``, if given, says why: ``WHY_NO_MOVE``)."""
        cfg = self.config
        _, smoothed = _smooth(snapshot, self.state, cfg.smoothing_alpha)
        snapshot = replace(snapshot, util_pct=smoothed)
        trigger = check_trigger(snapshot, cfg, armed=self.state.armed)
        budget = cfg.max_moves - self.state.moves_in_window(now, cfg.window_s)
        stop = ("too_few_gpus", 1) if trigger.gpus < 2 else ("not_fired", 1) if not trigger.fired else (
            ("window_full", 1) if budget <= 0 else ("tasks_queued", queued) if cfg.pause_when_queued and queued > 0
            else None)
        if stop is not None:
            if why is not None:
                why[stop[0]] = stop[1]
            return trigger, None
        moves, before, after, spread0, spread1 = plan_moves(
            snapshot, tasks, cfg, now=now, budget=budget,
            cooling_tasks=_prune(self.state.moved_at, now, cfg.cooldown_s),
            cooling_gpus=_prune(self.state.touched_at, now, cfg.cooldown_s),
            reservations=reservations, scheduler_config=self.scheduler_config, workload_mix=workload_mix, why=why,
        )
        if not moves:
            return trigger, None
        return trigger, Plan(0, now, trigger.reason, before, after, spread0, spread1, tuple(moves))
