"""How much more GPU memory tasks really use than they ask for, learned from
the tasks that ended, and the risk that a placement ends in an OOM kill.

A task's ``vram_mib`` is what its owner asked for; what it really reaches is
``vram_mib * r``, and ``r`` varies (a diffusion server's batch grows, a
training step allocates a bigger activation). A GPU whose free memory covers
the ask but not the growth runs the task until the growth arrives and then
kills it (the allocation fails): the work so far is lost and the task starts
again elsewhere. The memory filter cannot know ``r``; this module learns its
distribution from what happened.

``MemoryGrowth`` keeps, per task kind and over all kinds, the last
``window`` peak ratios ``r = peak MiB / asked MiB`` (and the count and sum
of every ratio it ever learned, which only grow): one per task that ended,
reported by whoever saw its peak (the agent that ran it, in its task event;
the executor, in CompleteTask; the simulator, which knows the truth). A run
killed for memory reports the use that killed it, a lower bound of its peak
(the run never reached its real one), so the learned tail is if anything a
little light. Before a kind has ``min_samples`` ratios the all-kinds ones
stand in; before those exist nothing is learned and no term is scored.

Placement (``oom_risk`` of ``scheduler.scoring``). For a task asking ``v``
MiB on GPU g with ``free_g = total_g - committed_g`` MiB not taken by its
readings or reservations, the risk is the learned share of ratios that would
not fit::

    O(g) = #{ r in learned(kind) : v * r > free_g } / #learned(kind)

the empirical probability that this task, like the ones before it, outgrows
that GPU. It is 0 where even the largest ratio fits and 1 where the ask
alone barely does, so among GPUs that the load and memory terms rate alike
the one with headroom for growth wins, and a whole-GPU task goes to a card
with room to grow rather than a 16 GiB one that it fills to 80 %.

A snapshot carries one ``GrowthTable`` per kind (``ClusterSnapshot.memory_growth``):
the sorted ratios and ``O`` binned for lookup. ``x = free / v`` falls into one
of ``BINS`` equal steps between the smallest and the largest ratio, and the
risk there is the share of ratios above that step's lower edge: exact where no
ratio lies inside the step, otherwise at most that step's ratios too high
(never too low); 1 below the smallest ratio, 0 from the largest on, and 0
where free memory is unknown (the memory filters already refuse those GPUs).
Cost: a ``searchsorted`` of every GPU against 512 ratios took ~120 µs a
decision at 8,000 GPUs (a binary search per row with unpredictable
branches); now only the GPUs whose free memory is under ``v * max(r)`` are
looked up, in one compiled loop where the set search's kernels are compiled
(``scheduler.setsearch``: ~43 µs at 40,000 GPUs) and in a few vector
operations otherwise (~140 µs there), the same floats either way. ``tables``
returns the same objects until something new is learned, so views and caches
stay warm.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from scheduler import setsearch
from scheduler.task import MAX_LEARNED_KINDS

__all__ = ["ANY_KIND", "BINS", "MemoryGrowthConfig", "GrowthStats", "GrowthTable", "MemoryGrowth", "largest_growth",
           "table_for"]

#: the key of the all-kinds table (the same as ``scheduler.predictor.ANY_KIND``)
ANY_KIND = ""

# ratios are clipped to this range: a peak of 0 (an agent that saw nothing)
# or 1000x the ask is a broken report, not growth
_RATIO_MIN = 0.05
_RATIO_MAX = 20.0


@dataclass(frozen=True)
class MemoryGrowthConfig:
    """Windows of ``MemoryGrowth``."""

    # Peak-over-asked memory ratios kept per task kind and over all kinds (the most recent).
    window: int = 512
    # Ratios before the oom_risk score uses them: a kind's own, else all kinds' together.
    min_samples: int = 20

    def validate(self) -> "MemoryGrowthConfig":
        if self.window < 1:
            raise ValueError(f"window: must be >= 1, got {self.window!r}")
        if self.min_samples < 1:
            raise ValueError(f"min_samples: must be >= 1, got {self.min_samples!r}")
        if self.min_samples > self.window:
            raise ValueError(f"min_samples: must be <= window ({self.window}), got {self.min_samples!r}")
        return self


#: equal steps the risk is binned into between the smallest and largest ratio
BINS = 512

# below this many GPUs the numpy path costs about what the call does
_COMPILED_MIN_ROWS = 256


@dataclass(frozen=True, eq=False)
class GrowthTable:
    """One kind's learned ratios, and the risk binned for lookup (module docstring)."""

    ratios: np.ndarray  # sorted, read-only
    hi: float  # the largest ratio: no risk where free >= vram * hi
    offset: float  # lo * inv_step - 1: free * inv_step / vram - offset is 1 + steps above lo
    inv_step: float  # BINS / (hi - lo)
    grid: np.ndarray  # BINS + 2 risks: below lo, each step from its lower edge, from hi on
    # weight -> grid * weight, what the score adds (built once per weight)
    _weighted: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_ratios(cls, ratios: np.ndarray) -> "GrowthTable":
        r = np.sort(np.asarray(ratios, dtype=np.float64))
        if r.size == 0:
            raise ValueError("a growth table needs at least one ratio")
        r.flags.writeable = False
        lo, hi = float(r[0]), float(r[-1])
        if hi <= lo:
            hi = lo * (1.0 + 1e-9) + 1e-12  # one ratio (or all equal): a step at lo
        inv_step = BINS / (hi - lo)
        edges = lo + np.arange(BINS) / inv_step
        grid = np.empty(BINS + 2)
        grid[0] = 1.0
        # share of ratios strictly above each lower edge
        grid[1:-1] = (r.size - np.searchsorted(r, edges, side="right")) / r.size
        grid[-1] = 0.0
        grid.flags.writeable = False
        return cls(r, float(r[-1]), lo * inv_step - 1.0, inv_step, grid)

    def risk(self, free_mib: np.ndarray, vram_mib: float) -> np.ndarray:
        """O(g) for each GPU's free MiB (a new array)."""
        free = np.asarray(free_mib, dtype=np.float64)
        out = np.zeros(free.shape)
        self.add_risk(out, free, vram_mib, 1.0)
        return out

    def weighted_grid(self, weight: float) -> np.ndarray:
        grid = self._weighted.get(weight)
        if grid is None:
            grid = self._weighted[weight] = self.grid * weight
        return grid

    def add_risk(self, score: np.ndarray, free_mib: np.ndarray, vram_mib: float, weight: float) -> None:
        """``score += weight * O(g)`` in place, ``free_mib`` aligned with
        ``score``; compiled in one pass where the compiled kernels run
        (``scheduler.setsearch``), the same floats either way."""
        limit = vram_mib * self.hi
        scale = self.inv_step / vram_mib
        grid = self.weighted_grid(weight)
        if score.shape[0] >= _COMPILED_MIN_ROWS:
            kernel = setsearch.risk_kernel()
            if kernel is not None and score.dtype == np.float64 and free_mib.dtype == np.float64:
                kernel(score, free_mib, scale, self.offset, limit, grid)
                return
        hot = np.flatnonzero(free_mib < limit)
        if hot.size:
            t = np.multiply(free_mib[hot], scale)
            t -= self.offset
            np.maximum(t, 0.0, out=t)
            np.minimum(t, float(BINS + 1), out=t)
            score[hot] += grid[t.astype(np.intp)]

    def risk_at(self, free_mib: float, vram_mib: float) -> float:
        """``risk`` for one GPU, the same float operations (bit-identical)."""
        if not free_mib < vram_mib * self.hi:
            return 0.0
        t = free_mib * (self.inv_step / vram_mib) - self.offset
        t = min(max(t, 0.0), float(BINS + 1))
        return float(self.grid[int(t)])


@dataclass(frozen=True, slots=True)
class GrowthStats:
    """What is known of one kind's growth (``kind`` empty: all kinds)."""

    kind: str
    samples: int  # ratios held (at most the window)
    oom_kills: int  # of those, from runs killed for memory (lower bounds)
    p50: float  # NaN when no ratio is held
    p95: float
    p99: float
    max: float
    # every ratio learned for the kind, the window's and the ones it let go
    # (and those of earlier runs, where the state was saved): a summary's
    # _count and _sum, which are counters and so never go down
    count: int = 0
    total: float = 0.0


class MemoryGrowth:
    """Peak-over-ask ratios per task kind (module docstring)."""

    def __init__(self, config: MemoryGrowthConfig | None = None) -> None:
        self.config = (config or MemoryGrowthConfig()).validate()
        self._ratios: dict[str, deque[float]] = {}
        self._ooms: dict[str, deque[bool]] = {}
        # kind -> (ratios learned, their sum) since the first: the window
        # forgets, these only grow (a Prometheus summary's _count and _sum)
        self._seen: dict[str, tuple[int, float]] = {}
        #: bumped on every ratio learned
        self.version = 0
        self._tables: tuple[int, dict[str, GrowthTable]] | None = None
        self._changed: set[str] = set()  # kinds whose table is out of date

    def observe(self, kind: str, asked_mib: float, peak_mib: float, *, oom_killed: bool = False) -> float | None:
        """Learn from one ended run: the ratio learned, or None when the report
        cannot say anything (no ask, no or non-finite peak)."""
        if not (math.isfinite(asked_mib) and asked_mib > 0 and math.isfinite(peak_mib) and peak_mib > 0):
            return None
        ratio = min(max(peak_mib / asked_mib, _RATIO_MIN), _RATIO_MAX)
        keys = {ANY_KIND, str(kind)}
        if str(kind) not in self._ratios and len(self._ratios) > MAX_LEARNED_KINDS:  # ANY_KIND is one of them
            keys = {ANY_KIND}  # a kind past the limit counts in the all-kinds table only
        for key in keys:
            ratios = self._ratios.get(key)
            if ratios is None:
                ratios = self._ratios[key] = deque(maxlen=self.config.window)
                self._ooms[key] = deque(maxlen=self.config.window)
            ratios.append(ratio)
            self._ooms[key].append(bool(oom_killed))
            count, total = self._seen.get(key, (0, 0.0))
            self._seen[key] = (count + 1, total + ratio)
            self._changed.add(key)
        self.version += 1
        return ratio

    @property
    def samples(self) -> int:
        """Ratios held over all kinds (at most the window)."""
        ratios = self._ratios.get(ANY_KIND)
        return len(ratios) if ratios is not None else 0

    def tables(self) -> Mapping[str, GrowthTable]:
        """Per kind, the table placement reads (``ANY_KIND`` included once it
        has ``min_samples`` ratios; a kind only once it has them): the same
        dict until the next ratio is learned (then a new one, rebuilding only
        the tables of the kinds that learned). Empty while nothing is known."""
        cached = self._tables
        if cached is not None and cached[0] == self.version:
            return cached[1]
        out = dict(cached[1]) if cached is not None else {}
        for kind in self._changed:
            ratios = self._ratios[kind]
            if len(ratios) >= self.config.min_samples:
                out[kind] = GrowthTable.from_ratios(np.fromiter(ratios, dtype=np.float64, count=len(ratios)))
        self._changed.clear()
        self._tables = (self.version, out)
        return out

    def stats(self) -> list[GrowthStats]:
        """Per kind (all kinds first), what is held."""
        out = []
        for kind in sorted(self._ratios):
            ratios = np.fromiter(self._ratios[kind], dtype=np.float64)
            q = np.quantile(ratios, [0.5, 0.95, 0.99]) if ratios.size else [math.nan] * 3
            count, total = self._seen.get(kind, (int(ratios.size), float(ratios.sum())))
            out.append(
                GrowthStats(
                    kind=kind,
                    samples=int(ratios.size),
                    oom_kills=int(sum(self._ooms[kind])),
                    p50=float(q[0]),
                    p95=float(q[1]),
                    p99=float(q[2]),
                    max=float(ratios.max()) if ratios.size else math.nan,
                    count=count,
                    total=total,
                )
            )
        return out

    # ---- persistence (the coordinator's state file) -------------------------------------------------
    def to_state(self) -> dict:
        out = {}
        for kind in self._ratios:
            count, total = self._seen.get(kind, (len(self._ratios[kind]), float(sum(self._ratios[kind]))))
            out[kind] = {"ratios": list(self._ratios[kind]), "oom_killed": list(self._ooms[kind]),
                         "count": count, "sum": total}
        return out

    def load_state(self, state: Mapping) -> None:
        """Restore what ``to_state`` saved (entries that do not parse are skipped)."""
        if not isinstance(state, Mapping):
            raise ValueError(f"memory growth state: expected an object of kinds, got {type(state).__name__}")
        window = self.config.window
        for kind, entry in state.items():
            try:
                ratios = [min(max(float(r), _RATIO_MIN), _RATIO_MAX) for r in entry["ratios"]]
                ooms = [bool(o) for o in entry.get("oom_killed", [False] * len(ratios))]
            except (TypeError, ValueError, KeyError):
                continue
            if len(ooms) != len(ratios) or any(not math.isfinite(r) for r in ratios):
                continue
            # the totals since the first ratio (a state from before they were
            # kept has the window's): never fewer than the ratios held
            count, total = len(ratios), float(sum(ratios))
            try:
                saved_count, saved_sum = int(entry.get("count", count)), float(entry.get("sum", total))
            except (TypeError, ValueError, OverflowError):
                saved_count, saved_sum = count, total
            if saved_count >= count and math.isfinite(saved_sum) and saved_sum >= total:
                count, total = saved_count, saved_sum
            self._ratios[str(kind)] = deque(ratios, maxlen=window)
            self._ooms[str(kind)] = deque(ooms, maxlen=window)
            self._seen[str(kind)] = (count, total)
        self._tables = None  # every table is rebuilt
        self._changed = set(self._ratios)
        self.version += 1


def table_for(tables: Mapping[str, GrowthTable], kind: str) -> GrowthTable | None:
    """The kind's table, else the all-kinds one, else None."""
    table = tables.get(kind)
    return table if table is not None else tables.get(ANY_KIND)


def largest_growth(tables: Mapping[str, GrowthTable] | None, kind: str) -> float:
    """The largest peak-over-ask ratio learned for ``kind`` (``table_for``),
    at least 1.0: what an ask is grown by when judging where it may outgrow
    a card (the engine's room to grow, the load-aware big_cards term)."""
    table = table_for(tables, kind) if tables else None
    return max(table.hi, 1.0) if table is not None else 1.0
