"""GPU fragmentation against the workload mix (FGD, Weng et al., ATC '23).

A GPU's free compute share is a *fragment* for a task shape when that shape
cannot use it: a single-GPU shape asking ``v`` MiB and a share ``s`` cannot
use a GPU with less than ``v`` memory or less than ``s`` compute free; a
``k``-GPU shape cannot use any GPU of a node that has fewer than ``k`` GPUs
it fits, nor, on a node that has them, a GPU it does not fit. A node's
fragmentation is the expected fragment over the shapes arriving, weighted by
how often each arrives:

    F_n = sum_m p_m * frag_n(m)          (in GPUs: shares of compute)

Fragmentation gradient descent places a task where ``F`` grows least (or
falls most): it fills the fragments small tasks can use and leaves whole GPUs
and whole nodes to the shapes that need them. The paper's resource is the
GPU compute share, allocated without overcommit. gpulb's hard limit is
memory (the ``vram`` and ``memory_threshold`` filters) and compute may be
shared, so here a GPU fits a shape when both its memory and its compute
share are free enough, fragments are counted in compute share, and the
compute demand past a GPU's capacity once a task is there is its
*overcommit*, a separate score term (``scheduler.policies.Fragmentation``):
a GPU whose compute is taken has no fragment to lose, so it would otherwise
look like a free place to stack more work.

Free memory is the smaller room of the two memory filters; free share is
``1 - load / 100``, load being the view's predicted load (smoothed util, or
100 % when unknown, plus the reservations not yet in the readings).

``WorkloadMix`` is what arrives: counts of task shapes (GPU count, memory ask
rounded up to 128 MiB, share rounded up to 0.01) that fade with a half-life
of ``half_life`` arrivals (2,000), so the mix follows the workload without
forgetting a rare 8-GPU shape after a burst of small ones. The scheduler
feeds it every task it queues; at most 64 shapes are kept (the lightest
goes).

``fragmentation_delta`` is, per GPU, the change in its node's ``F`` if the
task were placed there: exact for single-GPU tasks (only that GPU changes);
for a ``k``-GPU task, exact for the set of the node's ``k`` fullest GPUs (by
memory) that fit the task, which every GPU of the node gets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from scheduler import setsearch
from scheduler.task import TaskSpec
from scheduler.view import PlacementView

__all__ = ["MixShapes", "WorkloadMix", "free_resources", "fragmentation_delta", "node_fragmentation"]

_VRAM_BUCKET_MIB = 128.0
_SHARE_BUCKET = 0.01
_EPS = 1e-9  # shares are sums of hundredths: equal means fits
NO_SET = 1e9  # a node with no set for the task: finite, so a set search never mistakes it for "nothing fits"


@dataclass(frozen=True, slots=True)
class MixShapes:
    """The mix as arrays, probabilities summing to 1."""

    # single-GPU shapes: P(a shape fits) on a (memory, share) grid; a GPU's cell
    # is found by two searchsorted calls
    vram_edges: np.ndarray  # distinct single-GPU asks, ascending
    share_edges: np.ndarray  # distinct single-GPU shares, ascending
    fits_table: np.ndarray  # [i, j]: P(ask <= vram_edges[i - 1] and share <= share_edges[j - 1]); row/col 0: none
    single_total: float  # P(a single-GPU shape)
    # multi-GPU shapes grouped by (ask, share): ((vram, share), ((num_gpus, p), ...))
    multi: tuple[tuple[tuple[float, float], tuple[tuple[int, float], ...]], ...]
    tables: dict = field(default_factory=dict, compare=False)  # width -> _count_tables


class WorkloadMix:
    """Fading counts of arriving task shapes (module docstring)."""

    def __init__(self, half_life: float = 2000.0, max_shapes: int = 64) -> None:
        if not half_life > 0:
            raise ValueError("half_life must be > 0")
        self.half_life = float(half_life)
        self.max_shapes = int(max_shapes)
        self._growth = 2.0 ** (1.0 / self.half_life)
        self._unit = 1.0  # weight of the next arrival; older ones fade relative to it
        self._counts: dict[tuple[int, float, float], float] = {}
        self._shapes: MixShapes | None = None
        self._built_at = 0  # arrivals when the arrays were built
        self.arrivals = 0

    def observe(self, spec: TaskSpec) -> None:
        """Count one arriving task."""
        self.observe_shape(spec.num_gpus, spec.vram_mib, spec.gpu_share)

    def observe_shape(self, num_gpus: int, vram_mib: float, share: float = 0.0) -> None:
        # rounded up: a shape is never thought to fit where its task would not
        key = (
            int(num_gpus),
            max(1.0, math.ceil(float(vram_mib) / _VRAM_BUCKET_MIB - _EPS)) * _VRAM_BUCKET_MIB,
            round(math.ceil(float(share) / _SHARE_BUCKET - _EPS) * _SHARE_BUCKET, 6),
        )
        known = key in self._counts
        self._counts[key] = self._counts.get(key, 0.0) + self._unit
        self._unit *= self._growth
        self.arrivals += 1
        if self._unit > 1e100:  # rescale before floats overflow; ratios are what count
            self._counts = {k: c / self._unit for k, c in self._counts.items()}
            self._unit = 1.0
        if len(self._counts) > self.max_shapes:
            del self._counts[min(self._counts, key=self._counts.__getitem__)]
        # a new shape shows at once; known ones move the mix by well under 1 %
        # in 1 % of a half-life, so the arrays are rebuilt that often (a
        # rebuild per arrival was a third of a decision on the openb replay)
        if not known or self.arrivals - self._built_at >= max(1.0, self.half_life / 100):
            self._shapes = None

    def shapes(self) -> MixShapes:
        """The current mix as arrays (rebuilt when a new shape arrives, else
        every 1 % of a half-life of arrivals)."""
        if self._shapes is None:
            self._shapes = _to_shapes(self._counts)
            self._built_at = self.arrivals
        return self._shapes

    def ask_quantile(self, q: float, num_gpus: int = 1) -> float:
        """The ``q`` quantile of the memory asks (MiB per GPU, rounded up to
        128) of arriving ``num_gpus``-GPU tasks, weighted as the mix fades
        them; 0 before any arrived."""
        asks = sorted((v, c) for (k, v, _), c in self._counts.items() if k == num_gpus)
        total = sum(c for _, c in asks)
        if not total:
            return 0.0
        seen = 0.0
        for vram, count in asks:
            seen += count
            if seen >= q * total * (1 - 1e-12):
                return vram
        return asks[-1][0]

    def gpu_counts(self) -> list[int]:
        """GPU counts of the shapes in the mix, ascending."""
        return sorted({k for k, _, _ in self._counts})

    def probabilities(self) -> dict[tuple[int, float, float], float]:
        """(num_gpus, vram MiB, share) -> share of the faded arrivals; for operators and tests."""
        total = sum(self._counts.values())
        return {k: c / total for k, c in sorted(self._counts.items())} if total else {}


def _to_shapes(counts: dict[tuple[int, float, float], float]) -> MixShapes:
    total = sum(counts.values()) or 1.0
    singles = [(v, s, c / total) for (k, v, s), c in counts.items() if k == 1]
    vram_edges = np.array(sorted({v for v, _, _ in singles}), dtype=np.float64)
    share_edges = np.array(sorted({s for _, s, _ in singles}), dtype=np.float64)
    row = {v: i + 1 for i, v in enumerate(vram_edges.tolist())}
    col = {s: j + 1 for j, s in enumerate(share_edges.tolist())}
    table = np.zeros((len(vram_edges) + 1, len(share_edges) + 1))
    for v, s, p in singles:
        table[row[v], col[s]] += p
    table = table.cumsum(axis=0).cumsum(axis=1)  # dominance: every shape at or below both
    grouped: dict[tuple[float, float], list[tuple[int, float]]] = {}
    for (k, v, s), c in sorted(counts.items()):
        if k > 1:
            grouped.setdefault((v, s), []).append((k, c / total))
    return MixShapes(
        vram_edges=vram_edges,
        share_edges=share_edges,
        fits_table=table,
        single_total=float(sum(p for _, _, p in singles)),
        multi=tuple((key, tuple(sizes)) for key, sizes in grouped.items()),
    )


def free_resources(view: PlacementView, rows: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per GPU (or per row of ``rows``), (memory a new task could still ask
    for, MiB; compute share free, 0..1), both 0 where the GPU takes no task
    (module docstring)."""
    every = slice(None) if rows is None else rows
    memory = np.minimum(view.headroom[every], view.reject_headroom[every])
    np.fmax(memory, 0.0, out=memory)  # unknown memory (NaN): none, as the filters fail closed
    share = 1.0 - view.load[every] / 100.0
    np.fmax(share, 0.0, out=share)
    np.fmin(share, 1.0, out=share)
    off = ~view.avail[every]
    memory[off] = 0.0
    share[off] = 0.0
    return memory, share


def _single_fragment(memory: np.ndarray, share: np.ndarray, shapes: MixShapes) -> np.ndarray:
    """Per GPU, expected fragment over the single-GPU shapes: share * P(shape does not fit)."""
    if not shapes.single_total:
        return np.zeros_like(share)
    i = np.searchsorted(shapes.vram_edges, memory + _EPS, side="right")
    j = np.searchsorted(shapes.share_edges, share + _EPS, side="right")
    return share * (shapes.single_total - shapes.fits_table[i, j])


def node_fragmentation(
    memory: np.ndarray, share: np.ndarray, node: np.ndarray, node_count: int, shapes: MixShapes
) -> np.ndarray:
    """Per node, ``F_n`` in GPUs of expected fragment (module docstring)."""
    frag = np.bincount(node, weights=_single_fragment(memory, share, shapes), minlength=node_count)
    if shapes.multi:
        total = np.bincount(node, weights=share, minlength=node_count)
        for (v, s), sizes in shapes.multi:
            fits = (memory >= v) & (share + _EPS >= s)
            count = np.bincount(node, weights=fits, minlength=node_count)
            small = np.bincount(node, weights=np.where(fits, 0.0, share), minlength=node_count)
            for k, p in sizes:
                frag += p * np.where(count < k, total, small)
    return frag


def fragmentation_delta(
    view: PlacementView,
    spec: TaskSpec,
    shapes: MixShapes,
    free: tuple[np.ndarray, np.ndarray] | None = None,
    compiled: bool = True,
) -> np.ndarray:
    """Per GPU row, the change in its node's fragmentation (GPUs of expected
    fragment) if the task were placed there (module docstring). ``k`` GPUs:
    every GPU of a node gets the change of the node's ``k`` fullest fitting
    GPUs; ``NO_SET`` on nodes with fewer than ``k`` (the filters' strict
    threshold may still pass one). Rows that cannot take the task get a
    value too; filters exclude them. One GPU: the compiled loop of
    ``scheduler.setsearch`` when it is in use (``compiled=False``: numpy),
    the same result to the bit."""
    memory, share = free_resources(view) if free is None else free
    if spec.num_gpus > 1:
        return _set_delta(view, spec, shapes, memory, share)
    kernel = setsearch.frag_kernel() if compiled else None
    if kernel is not None:
        tables = _count_tables(shapes, view.max_node_gpus)
        delta = np.empty_like(memory)
        kernel(
            delta, memory, share, np.asarray(view.node, dtype=np.int64), int(view.node_count),
            float(spec.vram_mib), float(spec.gpu_share), shapes.vram_edges, shapes.share_edges,
            shapes.fits_table, float(shapes.single_total), *tables,
        )
        return delta
    memory_after = np.maximum(memory - spec.vram_mib, 0.0)
    share_after = np.maximum(share - spec.gpu_share, 0.0)
    delta = _single_fragment(memory_after, share_after, shapes)
    delta -= _single_fragment(memory, share, shapes)
    if shapes.multi:
        # Only GPU g changes: its share by ``taken``. For a k-GPU shape on g's
        # node (c GPUs it fits, S share free in all, A free on GPUs it does not fit):
        #   c < k: the node stays unusable, all its free share a fragment: -taken
        #   c = k and g stops fitting: usable -> unusable: S - taken - A
        #   otherwise: only g's own fragment changes: d_small
        # so one pass per distinct (ask, share) serves every k (tables by c).
        node, n_nodes = view.node, view.node_count
        taken = share - share_after
        total = np.bincount(node, weights=share, minlength=n_nodes)[node]
        for v, s, p_less, p_equal, p_more in zip(*_count_tables(shapes, view.max_node_gpus)):
            fits = (memory >= v) & (share + _EPS >= s)
            fits_after = (memory_after >= v) & (share_after + _EPS >= s)
            count = np.bincount(node, weights=fits, minlength=n_nodes).astype(np.intp)[node]
            small_of = np.where(fits, 0.0, share)
            small = np.bincount(node, weights=small_of, minlength=n_nodes)[node]
            d_small = np.where(fits_after, 0.0, share_after) - small_of
            drops = fits & ~fits_after
            delta += p_more[count] * d_small
            delta -= p_less[count] * taken
            delta += p_equal[count] * np.where(drops, total - taken - small, d_small)
    return delta


def _count_tables(shapes: MixShapes, width: int) -> tuple[np.ndarray, ...]:
    """Per distinct multi-GPU (ask, share), one row each: the asks, the
    shares, and probabilities indexed by a node's count c of GPUs the shape
    fits — of shapes needing more than c GPUs, exactly c, fewer. Cached on
    the shapes per width; the numpy path and the compiled loop read the same."""
    cached = shapes.tables.get(width)
    if cached is None:
        groups = len(shapes.multi)
        c = np.arange(width + 1)
        less, equal, more = (np.zeros((groups, width + 1)) for _ in range(3))
        for q, (_, sizes) in enumerate(shapes.multi):
            for k, p in sizes:
                less[q, c < k] += p
                equal[q, c == k] += p
                more[q, c > k] += p
        cached = (
            np.array([key[0] for key, _ in shapes.multi], dtype=np.float64),
            np.array([key[1] for key, _ in shapes.multi], dtype=np.float64),
            less, equal, more,
        )
        shapes.tables[width] = cached
    return cached


def _set_delta(
    view: PlacementView, spec: TaskSpec, shapes: MixShapes, memory: np.ndarray, share: np.ndarray
) -> np.ndarray:
    """``fragmentation_delta`` for a task on ``k`` > 1 GPUs of one node."""
    k = spec.num_gpus
    node, n_nodes = view.node, view.node_count
    room = memory >= spec.vram_mib
    # per node, its GPUs with room fullest first (least memory left), then by row
    fill = np.where(room, memory, np.inf)
    order = np.lexsort((np.arange(len(memory)), fill, node))
    sorted_node = node[order]
    rank = np.arange(len(order)) - np.searchsorted(sorted_node, sorted_node, side="left")
    taken = order[(rank < k) & room[order]]
    memory_after = memory.copy()
    memory_after[taken] -= spec.vram_mib
    share_after = share.copy()
    share_after[taken] = np.maximum(share_after[taken] - spec.gpu_share, 0.0)
    delta = node_fragmentation(memory_after, share_after, node, n_nodes, shapes)
    delta -= node_fragmentation(memory, share, node, n_nodes, shapes)
    enough = np.bincount(node, weights=room, minlength=n_nodes) >= k
    return np.where(enough, delta, NO_SET)[node]
