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
``window`` peak ratios ``r = peak MiB / asked MiB``: one per task that ended,
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

The ratios a snapshot carries (``ClusterSnapshot.memory_growth``) are sorted
arrays, so ``O`` is one ``searchsorted`` per decision; ``tables`` returns the
same objects until something new is learned, so views and caches stay warm.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Mapping

import numpy as np

__all__ = ["ANY_KIND", "MemoryGrowthConfig", "GrowthStats", "MemoryGrowth", "oom_risk", "table_for"]

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


class MemoryGrowth:
    """Peak-over-ask ratios per task kind (module docstring)."""

    def __init__(self, config: MemoryGrowthConfig | None = None) -> None:
        self.config = (config or MemoryGrowthConfig()).validate()
        self._ratios: dict[str, deque[float]] = {}
        self._ooms: dict[str, deque[bool]] = {}
        #: bumped on every ratio learned
        self.version = 0
        self._tables: tuple[int, dict[str, np.ndarray]] | None = None

    def observe(self, kind: str, asked_mib: float, peak_mib: float, *, oom_killed: bool = False) -> float | None:
        """Learn from one ended run: the ratio learned, or None when the report
        cannot say anything (no ask, no or non-finite peak)."""
        if not (math.isfinite(asked_mib) and asked_mib > 0 and math.isfinite(peak_mib) and peak_mib > 0):
            return None
        ratio = min(max(peak_mib / asked_mib, _RATIO_MIN), _RATIO_MAX)
        for key in {ANY_KIND, str(kind)}:
            ratios = self._ratios.get(key)
            if ratios is None:
                ratios = self._ratios[key] = deque(maxlen=self.config.window)
                self._ooms[key] = deque(maxlen=self.config.window)
            ratios.append(ratio)
            self._ooms[key].append(bool(oom_killed))
        self.version += 1
        return ratio

    @property
    def samples(self) -> int:
        """Ratios held over all kinds (at most the window)."""
        ratios = self._ratios.get(ANY_KIND)
        return len(ratios) if ratios is not None else 0

    def tables(self) -> Mapping[str, np.ndarray]:
        """Sorted ratios per kind for placement (``ANY_KIND`` included once it
        has ``min_samples``; a kind only once it has them): the same dict
        until the next ratio is learned. Empty while nothing is known."""
        cached = self._tables
        if cached is not None and cached[0] == self.version:
            return cached[1]
        out: dict[str, np.ndarray] = {}
        for kind, ratios in self._ratios.items():
            if len(ratios) >= self.config.min_samples:
                table = np.sort(np.fromiter(ratios, dtype=np.float64, count=len(ratios)))
                table.flags.writeable = False
                out[kind] = table
        self._tables = (self.version, out)
        return out

    def stats(self) -> list[GrowthStats]:
        """Per kind (all kinds first), what is held."""
        out = []
        for kind in sorted(self._ratios):
            ratios = np.fromiter(self._ratios[kind], dtype=np.float64)
            q = np.quantile(ratios, [0.5, 0.95, 0.99]) if ratios.size else [math.nan] * 3
            out.append(
                GrowthStats(
                    kind=kind,
                    samples=int(ratios.size),
                    oom_kills=int(sum(self._ooms[kind])),
                    p50=float(q[0]),
                    p95=float(q[1]),
                    p99=float(q[2]),
                    max=float(ratios.max()) if ratios.size else math.nan,
                )
            )
        return out

    # ---- persistence (the coordinator's state file) -------------------------------------------------
    def to_state(self) -> dict:
        return {
            kind: {"ratios": list(self._ratios[kind]), "oom_killed": list(self._ooms[kind])}
            for kind in self._ratios
        }

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
            self._ratios[str(kind)] = deque(ratios, maxlen=window)
            self._ooms[str(kind)] = deque(ooms, maxlen=window)
        self.version += 1


def table_for(tables: Mapping[str, np.ndarray], kind: str) -> np.ndarray | None:
    """The kind's sorted ratios, else the all-kinds ones, else None."""
    table = tables.get(kind)
    return table if table is not None else tables.get(ANY_KIND)


def oom_risk(free_mib: np.ndarray, vram_mib: float, table: np.ndarray) -> np.ndarray:
    """O(g) of the module docstring: the share of ``table``'s ratios r with
    ``vram_mib * r > free_mib`` per GPU (a new array)."""
    n = table.shape[0]
    # r > free / vram  <=>  not (r <= free / vram): count the ones at or below
    fits = np.searchsorted(table, np.divide(free_mib, vram_mib), side="right")
    risk = np.subtract(n, fits, dtype=np.float64)
    risk /= n
    return risk
