"""The placement view: the columns one decision reads, prepared once per snapshot.

``PlacementView`` joins a ``ClusterSnapshot`` with the scheduler's live
reservations. Task-independent facts (masks, static score terms) are computed
once per snapshot; columns that reservations change (effective reserved VRAM,
committed memory, headroom, predicted load, lease counts) are kept up to date
row by row with ``refresh``, so a decision never rebuilds a big array. A view
built afresh from the same snapshot and reservations has the same columns as
one patched incrementally (tested).

The snapshot is treated as immutable once a view is built over it.

What depends only on a snapshot's static columns is shared by every view over
snapshots that pass the same column objects (the coordinator and the
simulator do, until node membership changes), held in small caches keyed by
object identity (``IdentityCache``): the label index (``(key, value)`` -> node
mask; required labels are ANDs of those, preferred ones their mean), the GPU
rows by uuid, the NVLink bit masks and the node layout (``uniform_width``:
every node with the same GPU count in consecutive rows). Policies keep
task-independent per-GPU products of the dynamic columns as ``derived``
columns, which ``refresh`` patches with the rest.

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

import itertools
import threading
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

from scheduler.config import SchedulerConfig
from scheduler.gpuspec import coded_spec_mask, model_codes, parse_gpu_spec
from scheduler.reservations import Reservations, ReservedColumns
from scheduler.scoring import response_time_term, temperature_penalty
from scheduler.snapshot import ClusterSnapshot

__all__ = [
    "PlacementView",
    "LabelIndex",
    "label_index",
    "node_label_mask",
    "preferred_label_fraction",
]

# Host-local GPU indices tracked in NVLink bit masks (int64, sign bit unused).
_MAX_LOCAL = 63


class IdentityCache:
    """A few values keyed by the *identity* of some objects, newest first.

    The objects are held, so their ids cannot be reused while an entry lives.
    Used for what depends only on a snapshot's static columns (labels,
    topology), which the coordinator and the simulator pass again, as the same
    objects, in every snapshot until node membership changes. Those columns
    must not be mutated in place once a snapshot is built (make new ones).
    """

    def __init__(self, size: int) -> None:
        self._size = size
        self._entries: list[tuple[tuple[object, ...], object]] = []
        self._lock = threading.Lock()

    def get(self, objects: tuple[object, ...], build: Callable[[], object]) -> object:
        """The value for these objects, built by ``build()`` on a miss."""
        entries = self._entries
        for i, (held, value) in enumerate(entries):
            if len(held) == len(objects) and all(a is b for a, b in zip(held, objects)):
                if i:
                    with self._lock:  # least recently used goes first
                        rest = [e for e in self._entries if e[0] is not held]
                        self._entries = [(held, value), *rest]
                return value
        value = build()
        with self._lock:
            self._entries = [(objects, value), *self._entries[: self._size - 1]]
        return value


class LabelIndex:
    """Inverted index of node labels: ``(key, value)`` -> per-node bool mask.

    Built once per ``node_labels`` list (one pass over the nodes' labels);
    a required-labels mask is then the AND of one mask per pair and a
    preferred fraction the mean, cached per label set, per node and (for the
    ``gpu_node`` array last used) per GPU.
    """

    def __init__(self, node_labels: Sequence[Mapping[str, str]]) -> None:
        self.node_count = len(node_labels)
        postings: dict[tuple[str, str], list[int]] = {}
        for n, labels in enumerate(node_labels):
            for item in labels.items():
                postings.setdefault(item, []).append(n)
        self._postings = postings
        self._pairs: dict[tuple[str, str], np.ndarray] = {}
        self._required: dict[frozenset, np.ndarray] = {}
        self._preferred: dict[frozenset, np.ndarray] = {}
        self._gpu_node: np.ndarray | None = None
        self._gpu_required: dict[frozenset, np.ndarray] = {}
        self._gpu_preferred: dict[frozenset, np.ndarray] = {}
        self._lock = threading.Lock()

    def pair(self, key: str, value: str) -> np.ndarray:
        """Per node: carries ``key=value`` (read-only)."""
        mask = self._pairs.get((key, value))
        if mask is None:
            mask = np.zeros(self.node_count, dtype=bool)
            nodes = self._postings.get((key, value))
            if nodes:
                mask[nodes] = True
            mask.flags.writeable = False
            self._pairs[(key, value)] = mask
        return mask

    def required(self, required: Mapping[str, str]) -> np.ndarray:
        """Per node: carries every ``key=value`` of ``required`` (read-only)."""
        key = frozenset(required.items())
        mask = self._required.get(key)
        if mask is None:
            mask = np.ones(self.node_count, dtype=bool)
            for k, v in required.items():
                mask &= self.pair(k, v)
            mask.flags.writeable = False
            self._required[key] = mask
        return mask

    def preferred(self, preferred: Mapping[str, str]) -> np.ndarray:
        """Per node: fraction of the ``preferred`` pairs it carries, 0..1 (read-only)."""
        key = frozenset(preferred.items())
        frac = self._preferred.get(key)
        if frac is None:
            items = tuple(preferred.items())
            if not items:
                frac = np.zeros(self.node_count)
            else:
                hits = np.zeros(self.node_count, dtype=np.int64)
                for k, v in items:
                    hits += self.pair(k, v)
                frac = hits / len(items)
            frac.flags.writeable = False
            self._preferred[key] = frac
        return frac

    def _per_gpu(self, gpu_node: np.ndarray) -> None:
        if self._gpu_node is not gpu_node:
            with self._lock:
                self._gpu_required = {}
                self._gpu_preferred = {}
                self._gpu_node = gpu_node

    def required_gpu(self, required: Mapping[str, str], gpu_node: np.ndarray, node: np.ndarray) -> np.ndarray:
        """``required`` expanded to GPU rows (``node``: ``gpu_node`` as intp)."""
        self._per_gpu(gpu_node)
        key = frozenset(required.items())
        mask = self._gpu_required.get(key)
        if mask is None:
            mask = self.required(required)[node]
            mask.flags.writeable = False
            self._gpu_required[key] = mask
        return mask

    def preferred_gpu(self, preferred: Mapping[str, str], gpu_node: np.ndarray, node: np.ndarray) -> np.ndarray:
        """``preferred`` expanded to GPU rows (``node``: ``gpu_node`` as intp)."""
        self._per_gpu(gpu_node)
        key = frozenset(preferred.items())
        frac = self._gpu_preferred.get(key)
        if frac is None:
            frac = self.preferred(preferred)[node]
            frac.flags.writeable = False
            self._gpu_preferred[key] = frac
        return frac


_LABEL_INDEXES = IdentityCache(4)


def label_index(node_labels: Sequence[Mapping[str, str]]) -> LabelIndex:
    """The ``LabelIndex`` of this ``node_labels`` list, built once per list object."""
    return _LABEL_INDEXES.get((node_labels,), lambda: LabelIndex(node_labels))  # type: ignore[return-value]


def node_label_mask(node_labels: list[Mapping[str, str]], required: Mapping[str, str]) -> np.ndarray:
    """Per node: carries every required ``key=value`` label (read-only array)."""
    return label_index(node_labels).required(required)


def preferred_label_fraction(
    node_labels: list[Mapping[str, str]], preferred: Mapping[str, str]
) -> np.ndarray:
    """Per node: fraction of the preferred ``key=value`` labels it carries (0..1, read-only)."""
    return label_index(node_labels).preferred(preferred)


class _Topology:
    """What a view derives from the static columns only (GPU rows, nodes, NVLink).

    Shared by every view over snapshots with the same static column objects.
    """

    def __init__(self, s: ClusterSnapshot) -> None:
        count = s.gpu_count
        node_count = s.node_count
        self.gpu_uuid = s.gpu_uuid
        self.node = s.gpu_node.astype(np.intp)
        node = self.node
        self.node_has_nvlink = np.fromiter(
            (bool(pairs) for pairs in s.node_nvlink), dtype=bool, count=node_count
        )
        self.adj_bits, self.local_bit = _nvlink_bits(s, node)
        self.has_peer = self.adj_bits != 0
        # GPUs of a node in consecutive rows (usual): set selection can skip a sort
        self.nodes_contiguous = bool(np.all(node[1:] >= node[:-1])) if count > 1 else True
        self.node_gpus = np.bincount(node, minlength=node_count)
        self.max_node_gpus = int(self.node_gpus.max()) if node_count else 0
        # every node has the same number of GPUs, in consecutive rows (the usual
        # fleet): per-GPU columns reshape to (node, GPU); 0 otherwise
        width = self.max_node_gpus
        self.uniform_width = (
            width
            if count
            and count == node_count * width
            and self.nodes_contiguous
            and bool(np.all(self.node_gpus == width))
            else 0
        )
        for arr in (self.node, self.node_has_nvlink, self.adj_bits, self.local_bit, self.has_peer, self.node_gpus):
            arr.flags.writeable = False
        self._row_of: dict[str, int] | None = None
        self._links: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # (fewest, most) links among k GPUs
        self._nvlink_matrix: np.ndarray | None = None

    @property
    def row_of(self) -> dict[str, int]:
        if self._row_of is None:
            self._row_of = {u: i for i, u in enumerate(self.gpu_uuid)}
        return self._row_of

    def max_links(self, k: int) -> np.ndarray:
        """Per node: the most NVLink-joined pairs among any ``k`` of its GPUs
        (uniform layouts; past ``_MAX_LINKS_WIDTH`` GPUs a node, an upper
        bound: its pairs, at most k(k-1)/2). Read-only, cached per k."""
        return self._links_range(k)[1]

    def min_links(self, k: int) -> np.ndarray:
        """Per node: the fewest NVLink-joined pairs among any ``k`` of its GPUs
        (uniform layouts; past ``_MAX_LINKS_WIDTH`` GPUs a node, 0, a lower
        bound). Read-only, cached per k."""
        return self._links_range(k)[0]

    def _links_range(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        cached = self._links.get(k)
        if cached is None:
            cached = _links_range(self.adj_bits, self.local_bit, self.uniform_width, k)
            for arr in cached:
                arr.flags.writeable = False
            self._links[k] = cached
        return cached

    @property
    def nvlink_matrix(self) -> np.ndarray:
        """(node x GPU x GPU) bool, uniform layouts: ``[n, a, b]`` when the
        GPUs at positions a and b of node n are joined by NVLink. Read-only."""
        if self._nvlink_matrix is None:
            width = self.uniform_width
            if not width:
                raise ValueError("nvlink_matrix needs a uniform layout")
            adj = self.adj_bits.reshape(-1, width)
            local = self.local_bit.reshape(-1, width)
            # bit 63 (an index past 62) is in no peer mask: no link
            matrix = ((adj[:, :, None] >> local[:, None, :]) & 1).astype(bool)
            matrix.flags.writeable = False
            self._nvlink_matrix = matrix
        return self._nvlink_matrix


# Nodes up to this many GPUs get the exact fewest and most links among k of them (by trying every k-set).
_MAX_LINKS_WIDTH = 16


def _links_range(adj_bits: np.ndarray, local_bit: np.ndarray, width: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``(_Topology.min_links, _Topology.max_links)`` over (node x GPU)
    columns; one search per distinct node topology."""
    if not width:
        raise ValueError("max_links needs a uniform layout")
    nodes = adj_bits.shape[0] // width
    full = k * (k - 1) // 2
    if not nodes or k < 2:
        return np.zeros(nodes, dtype=np.int64), np.zeros(nodes, dtype=np.int64)
    adj = adj_bits.reshape(nodes, width)
    local = local_bit.reshape(nodes, width)
    patterns, which = np.unique(np.concatenate([adj, local], axis=1), axis=0, return_inverse=True)
    fewest = np.zeros(len(patterns), dtype=np.int64)
    most = np.zeros(len(patterns), dtype=np.int64)
    for p, pattern in enumerate(patterns):
        row_adj, row_local = pattern[:width], pattern[width:]
        # (a, b): GPUs at positions a and b of the node are joined by NVLink
        joined = ((row_adj[:, None] >> row_local[None, :]) & 1).astype(bool)
        pairs = int(np.count_nonzero(np.triu(joined, 1)))
        if width > _MAX_LINKS_WIDTH or k > width:
            most[p] = min(full, pairs)
            continue
        high, low = 0, full
        for combo in itertools.combinations(range(width), k):
            sub = joined[np.ix_(combo, combo)]
            links = int(np.count_nonzero(np.triu(sub, 1)))
            high, low = max(high, links), min(low, links)
            if (high == full or high == pairs) and low == 0:
                break
        fewest[p], most[p] = low, high
    which = np.asarray(which).reshape(-1)
    return fewest[which], most[which]


def _nvlink_bits(s: ClusterSnapshot, node: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per GPU: bit mask of the host-local indices it is NVLink-joined to, and its own bit.

    Indices 0..62 are tracked (larger ones are ignored; their bit is 63,
    never in a peer mask), which lets policies count links inside many GPU
    sets with a few vector ops.
    """
    count = s.gpu_count
    if not count:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    # equal topologies share one row of the table (most nodes look alike);
    # the same frozenset object (often shared) is looked up by identity first
    rows: dict[frozenset, int] = {frozenset(): 0}
    by_id: dict[int, int] = {}
    table = [np.zeros(_MAX_LOCAL, dtype=np.int64)]
    node_row = np.zeros(s.node_count, dtype=np.intp)
    for n, pairs in enumerate(s.node_nvlink):
        if not pairs:
            continue
        r = by_id.get(id(pairs))
        if r is None:
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
            by_id[id(pairs)] = r  # pairs is held by s.node_nvlink during the loop
        node_row[n] = r
    idx = s.gpu_index.astype(np.intp)
    inside = (idx >= 0) & (idx < _MAX_LOCAL)
    clipped = np.clip(idx, 0, _MAX_LOCAL - 1)
    adj_bits = np.where(inside, np.stack(table)[node_row[node], clipped], 0)
    local_bit = np.where(inside, idx, 63).astype(np.int64)
    return adj_bits, local_bit


def _sorted_sums(values: np.ndarray) -> np.ndarray:
    """Running sums of ``values`` sorted ascending along the last axis, NaN as -inf."""
    values = np.sort(np.where(np.isnan(values), -np.inf, values), axis=-1)
    return np.cumsum(values, axis=-1)


_TOPOLOGIES = IdentityCache(4)
_MODEL_CODES = IdentityCache(4)


def coded_models(snapshot: ClusterSnapshot) -> tuple[np.ndarray, np.ndarray]:
    """``gpuspec.model_codes`` of the snapshot's GPUs (distinct model names,
    per GPU the index of its name), coded once per ``gpu_model`` column object."""
    models = snapshot.gpu_model
    return _MODEL_CODES.get((models,), lambda: model_codes(models))  # type: ignore[return-value]


def spec_mask(snapshot: ClusterSnapshot, gpu_spec: str) -> np.ndarray:
    """``gpuspec.gpu_spec_mask`` of the snapshot's GPUs, the model names coded
    once per ``gpu_model`` column object."""
    patterns = parse_gpu_spec(gpu_spec)
    if not patterns:
        return np.ones(snapshot.gpu_count, dtype=bool)
    return coded_spec_mask(coded_models(snapshot), snapshot.memory_total_mib, patterns)


def _topology(s: ClusterSnapshot) -> _Topology:
    key = (s.gpu_uuid, s.gpu_index, s.gpu_node, s.node_nvlink, s.node_ids)
    return _TOPOLOGIES.get(key, lambda: _Topology(s))  # type: ignore[return-value]


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
        topo = _topology(s)
        self._topology = topo
        node = topo.node
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

            # NVLink topology (shared with other views over the same static columns)
            self.adj_bits = topo.adj_bits
            self.local_bit = topo.local_bit
            self.has_peer = topo.has_peer
            comp = np.asarray(s.nvlink_competition, dtype=np.float64)
            self.nvlink_ok = self.has_peer & ~(fresh & (comp >= cfg.nvlink_competition_max))
            node_slow = s.node_disk_await_ms >= cfg.disk_await_max_ms
            self.io_ok = ~(fresh & node_slow[node]) if count else np.zeros(0, dtype=bool)
            self.node_has_nvlink = topo.node_has_nvlink

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
            # the reading reservations fade against (NaN: unknown, they stay)
            self.util_reading = np.where(self.stale, np.nan, np.clip(util, 0.0, 100.0))

        self.nodes_contiguous = topo.nodes_contiguous
        self.node_gpus = topo.node_gpus
        self.max_node_gpus = topo.max_node_gpus
        # GPUs per node when every node has that many in consecutive rows, else 0
        self.uniform_width = topo.uniform_width
        self.max_links = topo.max_links
        self.min_links = topo.min_links
        self._labels: LabelIndex | None = None  # built on the first label lookup
        self._spec_masks: dict[str, np.ndarray] = {}
        self.static_cache: dict[object, np.ndarray] = {}  # policies keep weighted statics here
        # per-GPU columns derived from the dynamic ones, kept current by refresh
        self._derived: dict[object, tuple[Callable[["PlacementView", object], np.ndarray], np.ndarray]] = {}
        # per node, running sums of a derived column's values sorted (uniform layouts), kept current by refresh
        self._node_sums: dict[object, tuple[np.ndarray, np.ndarray]] = {}

        if reservations is not None and len(reservations):
            cols = reservations.columns(self.row_of, used, fresh, self.util_reading)
        else:
            cols = ReservedColumns.empty(count)
        self._reservations = reservations
        self._set_dynamic(cols)

    # ---- derived lookups (cached per view) --------------------------------------
    @property
    def row_of(self) -> dict[str, int]:
        """GPU uuid -> row (shared by views over the same static columns; do not modify)."""
        return self._topology.row_of

    @property
    def nvlink_matrix(self) -> np.ndarray:
        """Per node, which of its GPU positions are NVLink-joined (``_Topology.nvlink_matrix``)."""
        return self._topology.nvlink_matrix

    def spec_mask(self, gpu_spec: str) -> np.ndarray:
        mask = self._spec_masks.get(gpu_spec)
        if mask is None:
            mask = spec_mask(self.snapshot, gpu_spec)
            self._spec_masks[gpu_spec] = mask
        return mask

    @property
    def labels(self) -> LabelIndex:
        """The label index of the snapshot's ``node_labels``."""
        if self._labels is None:
            self._labels = label_index(self.snapshot.node_labels)
        return self._labels

    def label_mask(self, required: Mapping[str, str]) -> np.ndarray:
        """Per GPU: its node carries every required label (read-only)."""
        return self.labels.required_gpu(required, self.snapshot.gpu_node, self.node)

    def preferred_fraction(self, preferred: Mapping[str, str]) -> np.ndarray:
        """Per GPU: fraction of the preferred node labels its node carries (read-only)."""
        return self.labels.preferred_gpu(preferred, self.snapshot.gpu_node, self.node)

    def derived(
        self, key: object, compute: Callable[["PlacementView", object], np.ndarray]
    ) -> np.ndarray:
        """A per-GPU column ``compute(view, rows)`` of the dynamic columns, cached.

        ``compute`` must be row-local (row r of the result depends only on
        row r of view columns); it is called with ``slice(None)`` once, and by
        ``refresh`` with each row (an int) that changed, so the column stays
        what a fresh computation would give. Do not modify it.
        """
        entry = self._derived.get(key)
        if entry is None:
            column = np.array(compute(self, slice(None)), dtype=np.float64)
            self._derived[key] = (compute, column)
            return column
        return entry[1]

    def node_sorted_sums(
        self, key: object, compute: Callable[["PlacementView", object], np.ndarray]
    ) -> np.ndarray | None:
        """Per node, the running sums of its GPUs' values of ``derived(key,
        compute)`` in ascending order, as (node x GPU): ``[n, j]`` is the sum
        of node n's ``j + 1`` lowest values (NaN counts as -inf, so the sums
        stay lower bounds). Uniform layouts only (else None); kept current by
        ``refresh`` for the nodes whose rows change. Do not modify it.
        """
        width = self.uniform_width
        if not width:
            return None
        entry = self._node_sums.get(key)
        if entry is None:
            column = self.derived(key, compute)
            sums = _sorted_sums(column.reshape(-1, width))
            self._node_sums[key] = (column, sums)
            return sums
        return entry[1]

    # ---- dynamic columns ----------------------------------------------------------
    def _set_dynamic(self, cols: ReservedColumns) -> None:
        self.res_vram = cols.vram_mib
        self.res_util = cols.util_pct
        self.leases = cols.leases
        self.res_asked = cols.asked_mib
        self.active = np.maximum(self.snapshot.active_tasks.astype(np.int32), cols.leases)
        self.committed = self.used_fit + self.res_vram
        self.headroom = self.total - self.committed
        self.reject_headroom = self.reject_total - self.committed
        self.load = self.util_base + self.res_util
        self.avail = self.base_ok & ~(self.stale & (self.active > 0))
        self._any_room: bool | None = None  # any_room's answer until the next refresh
        self._memo: dict[object, object] = {}  # memo's values until the next refresh
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
        """Re-read the reservations of these GPUs into the dynamic columns.

        Row by row in scalars (a placement touches a few rows; the same IEEE
        arithmetic as the vector form in ``_set_dynamic``).
        """
        res = self._reservations
        row_of = self.row_of
        derived = tuple(self._derived.values())
        self._any_room = None
        if self._memo:
            self._memo = {}
        stale_rows = []
        changed = []
        for gpu_uuid in gpu_uuids:
            row = row_of.get(gpu_uuid)
            if row is None:
                continue
            gpu = res.gpu(gpu_uuid) if res is not None else None
            if gpu is None:
                eff, util, leases, asked = 0.0, 0.0, 0, 0.0
            else:
                eff, util = gpu.effective(float(self.used[row]), bool(self.fresh[row]), float(self.util_reading[row]))
                leases, asked = len(gpu.members), gpu.vram_mib
            self.res_vram[row] = eff
            self.res_util[row] = util
            self.leases[row] = leases
            self.res_asked[row] = asked
            active = max(int(self.snapshot.active_tasks[row]), leases)
            self.active[row] = active
            committed = self.used_fit[row] + self.res_vram[row]
            self.committed[row] = committed
            self.headroom[row] = self.total[row] - committed
            self.reject_headroom[row] = self.reject_total[row] - committed
            self.load[row] = self.util_base[row] + self.res_util[row]
            stale = bool(self.stale[row])
            self.avail[row] = bool(self.base_ok[row]) and not (stale and active > 0)
            for compute, column in derived:
                column[row] = compute(self, row)
            if stale:
                stale_rows.append(row)
            changed.append(row)
        if self._node_sums and changed:
            width = self.uniform_width
            for n in {row // width for row in changed}:
                start = n * width
                for column, sums in self._node_sums.values():
                    sums[n] = _sorted_sums(column[start : start + width])
        if stale_rows:
            for n in np.unique(self.node[stale_rows]):
                on_node = self.node == n
                free = int(np.count_nonzero(on_node & (self.active == 0)))
                self.node_free[n] = free
                self.stale_busy[n] = 1.0 - free / max(int(self.node_gpus[n]), 1)

    def attach(self, reservations: Reservations) -> None:
        """Use ``reservations`` for later ``refresh`` calls (views built without any)."""
        self._reservations = reservations

    def memo(self, key: object, compute: Callable[[], object]) -> object:
        """``compute()``, kept until the next ``refresh`` (or a new view): for
        answers that depend on the dynamic columns as a whole. A dispatch over
        a deep queue asks the same question of thousands of tasks of a few
        shapes while nothing is placed. Do not modify what it returns."""
        try:
            return self._memo[key]
        except KeyError:
            value = self._memo[key] = compute()
            return value

    def any_room(self) -> bool:
        """Whether any GPU could take any task at all right now (every task needs
        VRAM). Kept until the next ``refresh``: a dispatch asks it after every
        task that did not fit, thousands of times over an unchanged view."""
        if self._any_room is None:
            self._any_room = bool(np.any(self.avail & (self.headroom > 0)))
        return self._any_room
