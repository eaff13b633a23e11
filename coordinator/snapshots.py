"""From the coordinator's view to the scheduler's ``ClusterSnapshot``.

The static part of a snapshot (which GPU rows exist, their nodes, models,
memory totals, labels, NVLink pairs) changes only when nodes come and go, so
it is rebuilt only then; the dynamic columns (smoothed readings, health,
staleness, schedulability) are gathered from the view's columns with one fancy
index each. A new snapshot object is made only when the view changed, so the
scheduler's per-snapshot caches stay warm between changes.

What the scheduler sees, per GPU (NaN = unknown):
- util: the anomaly-filtered EWMA (raw reading until the filter has one);
- memory used: the last raw reading, because a real allocation or release
  must count at once, not after the filter catches up;
- temperature: smoothed; health: the agent's last GPU health (OK or not);
- NVLink competition: the mean utilisation of the GPU's NVLink peers (0..1).

Per node, its speed (RTX 4090 = 1.0) is its registered GPU model's in the
table of known models (``known_speed``): the speed-aware policies, the
backfill's run estimates and the predictor's priors (``model_speeds``) read
it, so a fresh coordinator already prefers an RTX 4090 to an M40.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable

import numpy as np

from protos import telemetry_pb2 as pb
from protos.fields import BY_NAME
from scheduler.cluster import lookup_model
from scheduler.snapshot import ClusterSnapshot

if TYPE_CHECKING:
    from coordinator.view import ClusterView

__all__ = ["SnapshotBuilder", "known_speed"]

_UTIL = BY_NAME["util_gpu_pct"]
_MEM = BY_NAME["memory_used_mib"]
_TOTAL = BY_NAME["memory_total_mib"]
_TEMP = BY_NAME["temperature_c"]
_HEALTH = BY_NAME["health"]


def known_speed(models: Iterable[str], memo: dict[str, float] | None = None) -> float:
    """A node's relative speed from its GPUs' model names (as NVML reports
    them) through the table of known models (``scheduler.cluster``): its
    slowest GPU's, a model the table does not know counting 1.0, as every
    reader of ``node_speed`` takes an unknown speed (the weighted round robin
    reads it as is, so it must be a number). The predictor's prior for an
    unknown model is 1.0 too, so this passes it nothing the table does not.
    ``memo``: model -> speed, shared across calls (a lookup normalises the
    name)."""
    memo = {} if memo is None else memo
    speed = None
    for model in models:
        value = memo.get(model)
        if value is None:
            known = lookup_model(model)
            value = memo[model] = known.speed if known is not None else 1.0
        speed = value if speed is None else min(speed, value)
    return 1.0 if speed is None else speed


class SnapshotBuilder:
    """Builds the scheduler's snapshot from the view (module docstring).
    ``node_speed``: node id -> relative speed; default ``known_speed`` of the
    node's registered GPU models."""

    def __init__(
        self,
        view: "ClusterView",
        *,
        schedulable: Callable[[str], bool],
        staleness_s: float,
        clock: Callable[[], float],
        node_speed: Callable[[str], float] | None = None,
    ) -> None:
        self.view = view
        self.schedulable = schedulable
        self.staleness_s = staleness_s
        self.clock = clock
        self.node_speed = node_speed
        self.response_time_s: dict[str, float] = {}
        self._membership: int | None = None
        self._static: dict | None = None
        self._snapshot: ClusterSnapshot | None = None
        self._built_at_version = -1
        self._liveness_version = 0
        self._built_liveness_version = -1
        self._node_facts_version = -1
        self._node_facts: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._facts_version = 0

    #: telemetry alone rebuilds the snapshot at most this often; reservations
    #: cover placements made in between, and liveness/membership changes
    #: rebuild at once
    min_rebuild_s = 0.25

    def liveness_changed(self) -> None:
        """A node's liveness or operator state changed (schedulability may differ)."""
        self._liveness_version += 1

    def facts_changed(self) -> None:
        """Response times or speeds changed."""
        self._facts_version += 1

    def _rebuild_static(self) -> dict:
        nodes = sorted(self.view.nodes.values(), key=lambda n: n.node_id)
        memo: dict[str, float] = {}
        rows = np.concatenate([n.rows for n in nodes]) if nodes else np.zeros(0, dtype=np.intp)
        gpu_node = np.concatenate([np.full(len(n.rows), i, dtype=np.int32) for i, n in enumerate(nodes)]) if nodes else np.zeros(0, dtype=np.int32)
        gpu_index = np.asarray([g.index for n in nodes for g in n.gpus], dtype=np.int32)
        uuids = [g.uuid for n in nodes for g in n.gpus]
        models = np.asarray([g.model for n in nodes for g in n.gpus], dtype=object)
        totals = np.asarray([float(g.memory_total_mib) for n in nodes for g in n.gpus], dtype=np.float64)
        # NVLink peers as (gpu position, peer position) pairs, for the competition column
        src: list[int] = []
        dst: list[int] = []
        offset = 0
        for n in nodes:
            position = {g.index: offset + k for k, g in enumerate(n.gpus)}
            for a, b in n.nvlink_pairs():
                if a in position and b in position:
                    src += [position[a], position[b]]
                    dst += [position[b], position[a]]
            offset += len(n.gpus)
        return {
            "nodes": nodes,
            "rows": rows,
            "gpu_node": gpu_node,
            "gpu_index": gpu_index,
            "uuids": uuids,
            "models": models,
            "totals": totals,
            "peer_src": np.asarray(src, dtype=np.intp),
            "peer_dst": np.asarray(dst, dtype=np.intp),
            "node_ids": [n.node_id for n in nodes],
            "labels": [dict(n.labels) for n in nodes],
            "nvlink": [frozenset(frozenset(p) for p in n.nvlink_pairs()) for n in nodes],
            "first_row": np.asarray([n.rows[0] for n in nodes], dtype=np.intp),
            # read once per membership change (a node re-registers to change its GPUs)
            "speeds": np.asarray([known_speed((g.model for g in n.gpus), memo) for n in nodes], dtype=np.float64),
        }

    def snapshot(self) -> ClusterSnapshot:
        view = self.view
        # Staleness moves with time alone, so even an unchanged view is re-read
        # once a second.
        current = self._snapshot
        if current is not None and self._liveness_version == self._built_liveness_version and view.membership_version == self._membership:
            age = self.clock() - current.taken_at_s
            if age < 1.0 and (view.version == self._built_at_version or age < self.min_rebuild_s):
                return current
        if view.membership_version != self._membership or self._static is None:
            self._static = self._rebuild_static()
            self._membership = view.membership_version
            self._node_facts = None
        st = self._static
        now = self.clock()
        rows = st["rows"]
        raw = view.raw[rows]
        signals = view.signals
        smoothed = signals.smoothed[rows]
        util = np.where(np.isnan(smoothed[:, 0]), raw[:, _UTIL], smoothed[:, 0])
        # Memory is not a noisy signal: what the agent last read (within its
        # 1 MiB deadband) is what a new task must fit next to. Smoothing would
        # keep freed memory looking busy for seconds.
        memory = raw[:, _MEM]
        temperature = np.where(np.isnan(smoothed[:, 2]), raw[:, _TEMP], smoothed[:, 2])
        forecast = signals.forecast[rows, 0]
        forecast = np.where(np.isnan(forecast), util, forecast)
        trend = signals.trend_per_min[rows, 0]
        totals = np.where(np.isnan(raw[:, _TOTAL]), st["totals"], raw[:, _TOTAL])
        healthy = raw[:, _HEALTH] == pb.GPU_HEALTH_OK
        competition = np.full(rows.size, np.nan)
        if st["peer_src"].size:
            peer_util = np.nan_to_num(util[st["peer_dst"]], nan=100.0)
            sums = np.bincount(st["peer_src"], weights=peer_util, minlength=rows.size)
            counts = np.bincount(st["peer_src"], minlength=rows.size)
            has = counts > 0
            competition[has] = sums[has] / counts[has] / 100.0
        node_ids = st["node_ids"]
        read_at = view.reading_at_s[rows]
        node_age = np.full(len(node_ids), np.inf)
        if rows.size:
            newest = np.fmax.reduceat(np.nan_to_num(read_at, nan=-np.inf), np.flatnonzero(np.r_[True, st["gpu_node"][1:] != st["gpu_node"][:-1]]))
            node_age = now - newest
        disk = signals.smoothed[st["first_row"], 4] if len(node_ids) else np.zeros(0)
        disk = np.where(np.isnan(disk), view.disk_await_ms[st["first_row"]] if len(node_ids) else disk, disk)
        snapshot = ClusterSnapshot(
            gpu_node=st["gpu_node"],
            gpu_index=st["gpu_index"],
            gpu_uuid=st["uuids"],
            gpu_model=st["models"],
            healthy=healthy,
            util_pct=util,
            util_forecast_pct=forecast,
            util_trend_pct_per_min=trend,
            memory_used_mib=memory,
            memory_total_mib=totals,
            temperature_c=temperature,
            nvlink_competition=competition,
            # Our own leases are counted from the scheduler's reservations.
            active_tasks=np.zeros(rows.size, dtype=np.int32),
            node_ids=node_ids,
            node_labels=st["labels"],
            node_schedulable=self._schedulable(node_ids),
            node_stale=~(node_age <= self.staleness_s),
            node_disk_await_ms=np.asarray(disk, dtype=np.float64),
            node_response_time_s=self._facts(node_ids)[0],
            node_speed=self._facts(node_ids)[1],
            node_nvlink=st["nvlink"],
            taken_at_s=now,
        )
        self._snapshot = snapshot
        self._built_at_version = view.version
        self._built_liveness_version = self._liveness_version
        return snapshot

    def _schedulable(self, node_ids: list[str]) -> np.ndarray:
        cached = getattr(self, "_schedulable_cache", None)
        if cached is not None and cached[0] == (self._liveness_version, self._membership):
            return cached[1]
        value = np.asarray([self.schedulable(n) for n in node_ids], dtype=bool)
        self._schedulable_cache = ((self._liveness_version, self._membership), value)
        return value

    def _facts(self, node_ids: list[str]) -> tuple[np.ndarray, np.ndarray]:
        if self._node_facts is None or self._node_facts_version != self._facts_version:
            self._node_facts = (
                np.asarray([self.response_time_s.get(n, np.nan) for n in node_ids], dtype=np.float64),
                np.asarray([self.node_speed(n) for n in node_ids], dtype=np.float64) if self.node_speed is not None
                else self._static["speeds"],  # the node ids are the static part's (snapshot)
                np.zeros(0),
            )
            self._node_facts_version = self._facts_version
        return self._node_facts[0], self._node_facts[1]

    def view_row_of(self, gpu_position: int) -> int:
        assert self._static is not None
        return int(self._static["rows"][gpu_position])
