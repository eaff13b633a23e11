"""The cluster snapshot: what the scheduler sees of the cluster at one instant.

The coordinator's view and the simulator both produce a ``ClusterSnapshot``;
filters, scores and policies are pure functions over it. It is columnar: one
numpy row per GPU, so a decision over thousands of GPUs is a few vector
operations. Per-node facts live in per-node arrays indexed by ``gpu_node``.

Units: % for utilisation, MiB for memory, °C, ms for disk await, s for times.
NaN means "unknown" (not reported, or stale) and never means zero.

The scheduler treats a snapshot as immutable once it has seen it: it
caches what it derives from one (``memo``), and what it derives from the
static columns (``node_labels``, ``gpu_uuid``, ``gpu_index``, ``gpu_node``,
``node_nvlink``, ``node_ids``, ``gpu_model``) is cached by the identity of those
objects, which the coordinator and the simulator pass again unchanged while
node membership stays the same. To change a static column, pass a new object.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping, Sequence

import numpy as np

if TYPE_CHECKING:
    from scheduler.memgrowth import GrowthTable

__all__ = ["ClusterSnapshot", "NodeFacts"]


@dataclass(frozen=True, slots=True)
class NodeFacts:
    """Per-node input for ``ClusterSnapshot.build`` (tests, simulator)."""

    node_id: str
    gpus: int
    model: str = "NVIDIA GeForce RTX 4090"
    memory_total_mib: float = 24_564.0
    labels: Mapping[str, str] = field(default_factory=dict)
    schedulable: bool = True
    stale: bool = False
    disk_await_ms: float = float("nan")
    response_time_s: float = float("nan")
    # pairs of host-local GPU indices joined by NVLink
    nvlink_pairs: Sequence[tuple[int, int]] = ()
    speed: float = 1.0


@dataclass(slots=True)
class ClusterSnapshot:
    # ---- per GPU (length G) -------------------------------------------------
    gpu_node: np.ndarray  # int32, index into the per-node arrays
    gpu_index: np.ndarray  # int32, host-local GPU index
    gpu_uuid: list[str]
    gpu_model: np.ndarray  # object (str)
    healthy: np.ndarray  # bool: GPU health OK (not frozen/failed/lost)
    util_pct: np.ndarray  # float64, smoothed utilisation %, NaN unknown
    util_forecast_pct: np.ndarray  # float64, one-step EWMA forecast %
    util_trend_pct_per_min: np.ndarray  # float64, %/min over the last minute
    memory_used_mib: np.ndarray  # float64, smoothed
    memory_total_mib: np.ndarray  # float64
    temperature_c: np.ndarray  # float64
    nvlink_competition: np.ndarray  # float64 0..1, NaN when the GPU has no NVLink
    active_tasks: np.ndarray  # int32, tasks leased on this GPU
    # ---- per node (length N) ------------------------------------------------
    node_ids: list[str]
    node_labels: list[Mapping[str, str]]
    node_schedulable: np.ndarray  # bool: HEALTHY, not cordoned/draining/unreachable
    node_stale: np.ndarray  # bool: readings older than the staleness bound
    node_disk_await_ms: np.ndarray  # float64, NaN unknown
    node_response_time_s: np.ndarray  # float64, observed placement-to-start time
    node_speed: np.ndarray  # float64, relative speed (1.0 = RTX 4090)
    # node index -> set of frozenset({a, b}) host-local GPU index pairs on NVLink
    node_nvlink: list[frozenset[frozenset[int]]]
    taken_at_s: float = 0.0  # monotonic seconds when the snapshot was taken
    # Predicted slowdown (actual / expected run time) of every GPU row, per
    # task kind ("" = any kind), from ``scheduler.predictor``; empty when no
    # predictor runs. The load-aware ``completion`` term reads it.
    gpu_slowdown: Mapping[str, np.ndarray] = field(default_factory=dict)
    # How many times its predicted run a task of a kind may take on every GPU
    # row (the 90th percentile of actual / predicted, ``SpeedPredictor.overrun``;
    # NaN where too few completions), per task kind; the backfill's margin.
    gpu_overrun: Mapping[str, np.ndarray] = field(default_factory=dict)
    # Peak-over-ask memory ratios of ended tasks as lookup tables, per task
    # kind ("" = any kind), from ``scheduler.memgrowth``; empty when nothing
    # is learned. The load-aware ``oom_risk`` term reads it.
    memory_growth: Mapping[str, GrowthTable] = field(default_factory=dict)
    # Results derived from this snapshot alone (``filters.never_fits``), kept
    # for its lifetime; not part of its value (a replace() starts empty).
    memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def gpu_count(self) -> int:
        return int(self.gpu_node.shape[0])

    @property
    def node_count(self) -> int:
        return len(self.node_ids)

    @classmethod
    def build(
        cls,
        nodes: Sequence[NodeFacts],
        *,
        util_pct: Sequence[float] | None = None,
        memory_used_mib: Sequence[float] | None = None,
        temperature_c: Sequence[float] | None = None,
        taken_at_s: float = 0.0,
    ) -> "ClusterSnapshot":
        """A snapshot from per-node facts, every GPU idle unless given.

        Per-GPU overrides are flat sequences in node order, then GPU order.
        """
        gpu_node: list[int] = []
        gpu_index: list[int] = []
        uuids: list[str] = []
        models: list[str] = []
        totals: list[float] = []
        for n, facts in enumerate(nodes):
            for g in range(facts.gpus):
                gpu_node.append(n)
                gpu_index.append(g)
                uuids.append(f"GPU-{facts.node_id}-{g}")
                models.append(facts.model)
                totals.append(facts.memory_total_mib)
        count = len(gpu_node)

        def column(values: Sequence[float] | None, default: float) -> np.ndarray:
            if values is None:
                return np.full(count, default, dtype=np.float64)
            arr = np.asarray(values, dtype=np.float64)
            if arr.shape != (count,):
                raise ValueError(f"expected {count} per-GPU values, got {arr.shape}")
            return arr

        util = column(util_pct, 0.0)
        return cls(
            gpu_node=np.asarray(gpu_node, dtype=np.int32),
            gpu_index=np.asarray(gpu_index, dtype=np.int32),
            gpu_uuid=uuids,
            gpu_model=np.asarray(models, dtype=object),
            healthy=np.ones(count, dtype=bool),
            util_pct=util,
            util_forecast_pct=util.copy(),
            util_trend_pct_per_min=np.zeros(count),
            memory_used_mib=column(memory_used_mib, 0.0),
            memory_total_mib=np.asarray(totals, dtype=np.float64),
            temperature_c=column(temperature_c, 35.0),
            nvlink_competition=np.full(count, np.nan),
            active_tasks=np.zeros(count, dtype=np.int32),
            node_ids=[n.node_id for n in nodes],
            node_labels=[dict(n.labels) for n in nodes],
            node_schedulable=np.asarray([n.schedulable for n in nodes], dtype=bool),
            node_stale=np.asarray([n.stale for n in nodes], dtype=bool),
            node_disk_await_ms=np.asarray([n.disk_await_ms for n in nodes], dtype=np.float64),
            node_response_time_s=np.asarray([n.response_time_s for n in nodes], dtype=np.float64),
            node_speed=np.asarray([n.speed for n in nodes], dtype=np.float64),
            node_nvlink=[
                frozenset(frozenset(p) for p in n.nvlink_pairs) for n in nodes
            ],
            taken_at_s=taken_at_s,
        )
