"""The placement view: the columns one decision reads, prepared once per snapshot.

``PlacementView`` joins a ``ClusterSnapshot`` with the scheduler's live
reservations. Task-independent facts (masks, static score terms) are computed
once per snapshot; columns that reservations change (effective reserved VRAM,
committed memory, headroom, predicted load, lease counts) are kept up to date
row by row with ``refresh``, so a decision never rebuilds a big array. A view
built afresh from the same snapshot and reservations has the same columns as
one patched incrementally (tested).

The snapshot is treated as immutable once a view is built over it.

NaN and staleness rules (applied here, relied on by filters and scores):

* memory used NaN on a fresh node: committed memory is NaN, so the VRAM and
  memory-threshold filters fail closed (we cannot prove the task fits);
* stale node: its readings are too old to be evidence, so memory used counts
  as 0 and temperature, NVLink competition and disk await filters pass; in
  exchange only GPUs with no task on them (no lease of ours, no active task in
  the snapshot) are offered, and they are scored by the node's free GPU count;
* temperature NaN on a fresh node: not evidence of heat, passes the filter and
  gets the largest temperature penalty;
* util NaN: predicted load counts it as 100 % (an unknown GPU never beats a known idle one);
* NVLink competition NaN on a GPU with an NVLink peer: passes (unknown contention
  is not contention); a GPU with no NVLink peer never passes for needs_nvlink;
* disk await NaN: passes (not evidence of slowness);
* response time NaN: scored as the median of the nodes that report one.
"""

from __future__ import annotations

from typing import Iterable, Mapping

import numpy as np

from scheduler.config import SchedulerConfig
from scheduler.gpuspec import gpu_spec_mask
from scheduler.reservations import Reservations, ReservedColumns
from scheduler.scoring import response_time_term, temperature_penalty
from scheduler.snapshot import ClusterSnapshot

__all__ = ["PlacementView", "node_label_mask", "preferred_label_fraction"]

# Host-local GPU indices tracked in NVLink bit masks (int64, sign bit unused).
_MAX_LOCAL = 63
def node_label_mask(node_labels: list[Mapping[str, str]], required: Mapping[str, str]) -> np.ndarray:
    """Per node: carries every required ``key=value`` label."""
    items = tuple(required.items())
    return np.fromiter(
        (all(labels.get(k) == v for k, v in items) for labels in node_labels),
        dtype=bool,
        count=len(node_labels),
    )


def preferred_label_fraction(
    node_labels: list[Mapping[str, str]], preferred: Mapping[str, str]
) -> np.ndarray:
    """Per node: fraction of the preferred ``key=value`` labels it carries (0..1)."""
    items = tuple(preferred.items())
    if not items:
        return np.zeros(len(node_labels))
    return np.fromiter(
        (sum(labels.get(k) == v for k, v in items) / len(items) for labels in node_labels),
        dtype=np.float64,
        count=len(node_labels),
    )


class PlacementView:
    """Snapshot columns plus effective reservations, for filters, scores and policies."""

    def __init__(
        self,
        snapshot: ClusterSnapshot,
        reservations: Reservations | None = None,
        config: SchedulerConfig | None = None,
    ) -> None:
        cfg = config or SchedulerConfig()
        self.snapshot = snapshot
        self.config = cfg
        s = snapshot
        count = s.gpu_count
        self.gpu_count = count
        self.node_count = s.node_count
        node = s.gpu_node.astype(np.intp)
        self.node = node
        self.stale = s.node_stale[node] if count else np.zeros(0, dtype=bool)
        self.any_stale = bool(self.stale.any())
        fresh = ~self.stale
        self.fresh = fresh

        with np.errstate(invalid="ignore", divide="ignore"):
            total = np.asarray(s.memory_total_mib, dtype=np.float64)
            # zero or unknown capacity is no capacity
            total = np.where(np.isfinite(total) & (total > 0), total, 0.0)
            self.total = total
            self.inv_total = np.where(total > 0, 1.0 / np.where(total > 0, total, 1.0), np.inf)
            used = np.asarray(s.memory_used_mib, dtype=np.float64)
            self.used = used
            self.used_fit = np.where(self.stale, 0.0, used)
            self.reject_total = total * (cfg.memory_reject_pct / 100.0)

            temp = np.asarray(s.temperature_c, dtype=np.float64)
            self.hot = fresh & (temp >= cfg.temperature_reject_c)
            self.node_ok = s.node_schedulable[node] if count else np.zeros(0, dtype=bool)
            self.healthy = np.asarray(s.healthy, dtype=bool)
            self.base_ok = self.node_ok & self.healthy & ~self.hot

            self.has_peer = self._nvlink_peers()
            comp = np.asarray(s.nvlink_competition, dtype=np.float64)
            self.nvlink_ok = self.has_peer & ~(fresh & (comp >= cfg.nvlink_competition_max))
            node_slow = s.node_disk_await_ms >= cfg.disk_await_max_ms
            self.io_ok = ~(fresh & node_slow[node]) if count else np.zeros(0, dtype=bool)
            self.node_has_nvlink = np.fromiter(
                (bool(pairs) for pairs in s.node_nvlink), dtype=bool, count=self.node_count
            )

            # ---- static score terms (unweighted, 0..1) ----
            t = temperature_penalty(temp, cfg.temperature_penalty_start_c, cfg.temperature_reject_c)
            self.temp_term = np.where(self.stale, 0.0, t)
            self.node_rt_term = response_time_term(s.node_response_time_s, cfg.response_time_ref_s)
            self.rt_term = self.node_rt_term[node]
            util = np.asarray(s.util_pct, dtype=np.float64)
            if cfg.use_forecast:
                forecast = np.asarray(s.util_forecast_pct, dtype=np.float64)
                util = np.where(np.isnan(forecast), util, forecast)
            self.util_base = np.where(np.isnan(util), 100.0, np.clip(util, 0.0, 100.0))

        # GPUs of a node in consecutive rows (usual): set selection can skip a sort
        self.nodes_contiguous = bool(np.all(node[1:] >= node[:-1])) if count > 1 else True
        self.node_gpus = np.bincount(node, minlength=self.node_count)
        self.max_node_gpus = int(self.node_gpus.max()) if self.node_count else 0
        self._row_of: dict[str, int] | None = None
        self._spec_masks: dict[str, np.ndarray] = {}
        self._label_masks: dict[frozenset, np.ndarray] = {}
        self._pref: dict[frozenset, np.ndarray] = {}
        self.static_cache: dict[object, np.ndarray] = {}  # policies keep weighted statics here

        if reservations is not None and len(reservations):
            cols = reservations.columns(self.row_of, used, fresh)
        else:
            cols = ReservedColumns.empty(count)
        self._reservations = reservations
        self._set_dynamic(cols)

    # ---- derived lookups (cached per view) --------------------------------------
    @property
    def row_of(self) -> dict[str, int]:
        """GPU uuid -> row."""
        if self._row_of is None:
            self._row_of = {u: i for i, u in enumerate(self.snapshot.gpu_uuid)}
        return self._row_of

    def spec_mask(self, gpu_spec: str) -> np.ndarray:
        mask = self._spec_masks.get(gpu_spec)
        if mask is None:
            mask = gpu_spec_mask(self.snapshot.gpu_model, self.snapshot.memory_total_mib, gpu_spec)
            self._spec_masks[gpu_spec] = mask
        return mask

    def label_mask(self, required: Mapping[str, str]) -> np.ndarray:
        key = frozenset(required.items())
        mask = self._label_masks.get(key)
        if mask is None:
            mask = node_label_mask(self.snapshot.node_labels, required)[self.node]
            self._label_masks[key] = mask
        return mask

    def preferred_fraction(self, preferred: Mapping[str, str]) -> np.ndarray:
        """Per GPU: fraction of the preferred node labels its node carries."""
        key = frozenset(preferred.items())
        frac = self._pref.get(key)
        if frac is None:
            frac = preferred_label_fraction(self.snapshot.node_labels, preferred)[self.node]
            self._pref[key] = frac
        return frac

    def _nvlink_peers(self) -> np.ndarray:
        """Per GPU: has at least one NVLink peer (from the node's topology).

        Also sets ``adj_bits``: per GPU, the bit mask of host-local indices it
        is NVLink-joined to (indices 0..62; larger ones are ignored), which
        lets policies count links inside many GPU sets with a few vector ops.
        """
        s = self.snapshot
        if not self.gpu_count:
            self.adj_bits = np.zeros(0, dtype=np.int64)
            self.local_bit = np.zeros(0, dtype=np.int64)
            return np.zeros(0, dtype=bool)
        # equal topologies share one row of the table (most nodes look alike)
        rows: dict[frozenset, int] = {frozenset(): 0}
        table = [np.zeros(_MAX_LOCAL, dtype=np.int64)]
        node_row = np.zeros(self.node_count, dtype=np.intp)
        for n, pairs in enumerate(s.node_nvlink):
            if not pairs:
                continue
            r = rows.get(pairs)
            if r is None:
                bits = np.zeros(_MAX_LOCAL, dtype=np.int64)
                for pair in pairs:
                    if len(pair) != 2:
                        continue  # a GPU linked to itself is no link
                    a, b = tuple(pair)
                    if 0 <= a < _MAX_LOCAL and 0 <= b < _MAX_LOCAL:
                        bits[a] |= 1 << b
                        bits[b] |= 1 << a
                r = rows[pairs] = len(table)
                table.append(bits)
            node_row[n] = r
        idx = s.gpu_index.astype(np.intp)
        inside = (idx >= 0) & (idx < _MAX_LOCAL)
        clipped = np.clip(idx, 0, _MAX_LOCAL - 1)
        self.adj_bits = np.where(inside, np.stack(table)[node_row[self.node], clipped], 0)
        # bit of each GPU in the masks; 63 (index out of range) is never in a peer mask
        self.local_bit = np.where(inside, idx, 63).astype(np.int64)
        return self.adj_bits != 0

    # ---- dynamic columns ----------------------------------------------------------
    def _set_dynamic(self, cols: ReservedColumns) -> None:
        self.res_vram = cols.vram_mib
        self.res_util = cols.util_pct
        self.leases = cols.leases
        self.active = np.maximum(self.snapshot.active_tasks.astype(np.int32), cols.leases)
        self.committed = self.used_fit + self.res_vram
        self.headroom = self.total - self.committed
        self.reject_headroom = self.reject_total - self.committed
        self.load = self.util_base + self.res_util
        self.avail = self.base_ok & ~(self.stale & (self.active > 0))
        if self.any_stale:
            free = np.bincount(
                self.node[self.stale & (self.active == 0)], minlength=self.node_count
            )
            self.node_free = free
            self.stale_busy = 1.0 - free / np.maximum(self.node_gpus, 1)
        else:
            self.node_free = np.zeros(self.node_count, dtype=np.int64)
            self.stale_busy = np.zeros(self.node_count)

    def refresh(self, gpu_uuids: Iterable[str]) -> None:
        """Re-read the reservations of these GPUs into the dynamic columns."""
        res = self._reservations
        rows = []
        for gpu_uuid in gpu_uuids:
            row = self.row_of.get(gpu_uuid)
            if row is None:
                continue
            gpu = res.gpu(gpu_uuid) if res is not None else None
            if gpu is None:
                eff, util, leases = 0.0, 0.0, 0
            else:
                eff, util = gpu.effective(float(self.used[row]), bool(self.fresh[row]))
                leases = len(gpu.members)
            self.res_vram[row] = eff
            self.res_util[row] = util
            self.leases[row] = leases
            rows.append(row)
        if not rows:
            return
        r = np.asarray(rows, dtype=np.intp)
        self.active[r] = np.maximum(self.snapshot.active_tasks[r], self.leases[r])
        self.committed[r] = self.used_fit[r] + self.res_vram[r]
        self.headroom[r] = self.total[r] - self.committed[r]
        self.reject_headroom[r] = self.reject_total[r] - self.committed[r]
        self.load[r] = self.util_base[r] + self.res_util[r]
        self.avail[r] = self.base_ok[r] & ~(self.stale[r] & (self.active[r] > 0))
        if self.any_stale and self.stale[r].any():
            for n in np.unique(self.node[r][self.stale[r]]):
                on_node = self.node == n
                free = int(np.count_nonzero(on_node & (self.active == 0)))
                self.node_free[n] = free
                self.stale_busy[n] = 1.0 - free / max(int(self.node_gpus[n]), 1)

    def attach(self, reservations: Reservations) -> None:
        """Use ``reservations`` for later ``refresh`` calls (views built without any)."""
        self._reservations = reservations

    def any_room(self) -> bool:
        """Whether any GPU could take any task at all right now (every task needs VRAM)."""
        return bool(np.any(self.avail & (self.headroom > 0)))
