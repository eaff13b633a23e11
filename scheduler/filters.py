"""Hard filters: which GPUs may take a task, and why the others may not.

Pure functions over a ``PlacementView`` (a snapshot plus effective
reservations) and a ``TaskSpec``; a filter is a bool mask over GPU rows, a few
vector operations, no per-GPU Python. The NaN and staleness rules are those of
``scheduler.view`` (fail closed on unknown memory; stale readings are not
evidence, but a stale node only offers its idle GPUs).

Filters, in the order rejections are attributed (a GPU is counted under the
first filter it fails):

================== ===========================================================
name               a GPU passes when
================== ===========================================================
node_unschedulable its node is schedulable (healthy, not cordoned/draining/unreachable)
gpu_unhealthy      the GPU is healthy
gpu_spec           its model matches ``spec.gpu_spec`` (``scheduler.gpuspec``)
node_labels        its node carries every ``required_node_labels`` pair
stale_busy         its node is fresh, or the GPU has no task on it
vram               ``total - (used + reserved) >= vram_mib``
memory_threshold   ``used + reserved + vram_mib < reject% * total`` (per-tenant %)
temperature        ``temperature < temperature_reject_c`` (NaN passes)
nvlink             needs_nvlink only: has an NVLink peer and competition < max (NaN passes)
disk_await         io_heavy only: node disk await < max ms (NaN passes)
================== ===========================================================

``never_fits`` is the static check behind REJECTED: can the task fit some node
of the cluster if that node were empty?
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np

from scheduler.config import SchedulerConfig
from scheduler.snapshot import ClusterSnapshot
from scheduler.task import TaskSpec
from scheduler.view import PlacementView, label_index, spec_mask

__all__ = [
    "FILTERS",
    "FilterResult",
    "feasible",
    "explain",
    "first_failure",
    "describe",
    "never_fits",
    "nvlink_groups",
]

FILTERS = (
    "node_unschedulable",
    "gpu_unhealthy",
    "gpu_spec",
    "node_labels",
    "stale_busy",
    "vram",
    "memory_threshold",
    "temperature",
    "nvlink",
    "disk_await",
)


@dataclass(frozen=True, slots=True)
class FilterResult:
    mask: np.ndarray  # bool per GPU: passes every filter
    rejected: Mapping[str, int]  # filter -> GPUs it rejected first (only non-zero)
    total: int  # GPUs considered

    @property
    def passed(self) -> int:
        return int(np.count_nonzero(self.mask))


def _memory_ok(view: PlacementView, spec: TaskSpec, config: SchedulerConfig) -> np.ndarray:
    pct = config.memory_reject_for(spec.tenant)
    if pct == config.memory_reject_pct:
        return view.reject_headroom > spec.vram_mib
    return view.total * (pct / 100.0) - view.committed > spec.vram_mib


def feasible(view: PlacementView, spec: TaskSpec, config: SchedulerConfig | None = None) -> np.ndarray:
    """Bool mask of GPUs that pass every filter (the fast path: no attribution)."""
    cfg = config or view.config
    mask = view.avail & (view.headroom >= spec.vram_mib)
    mask &= _memory_ok(view, spec, cfg)
    if spec.gpu_spec:
        mask &= view.spec_mask(spec.gpu_spec)
    if spec.required_node_labels:
        mask &= view.label_mask(spec.required_node_labels)
    if spec.needs_nvlink:
        mask &= view.nvlink_ok
    if spec.io_heavy:
        mask &= view.io_ok
    return mask


def explain(view: PlacementView, spec: TaskSpec, config: SchedulerConfig | None = None) -> FilterResult:
    """The mask plus, per filter, how many GPUs it was the first to reject."""
    count = view.gpu_count
    alive = np.ones(count, dtype=bool)
    rejected: dict[str, int] = {}
    for name, ok in _checks(view, spec, config or view.config):
        newly = int(np.count_nonzero(alive & ~ok))
        if newly:
            rejected[name] = newly
        alive &= ok
    return FilterResult(mask=alive, rejected=rejected, total=count)


def first_failure(view: PlacementView, spec: TaskSpec, row: int, config: SchedulerConfig | None = None) -> str | None:
    """The first filter (in ``FILTERS`` order) GPU ``row`` fails for ``spec``; None when it passes them all."""
    for name, ok in _checks(view, spec, config or view.config):
        if not ok[row]:
            return name
    return None


def _checks(view: PlacementView, spec: TaskSpec, cfg: SchedulerConfig) -> list[tuple[str, np.ndarray]]:
    """Each filter's pass mask, in ``FILTERS`` order."""
    everything = np.ones(view.gpu_count, dtype=bool)
    return [
        ("node_unschedulable", view.node_ok),
        ("gpu_unhealthy", view.healthy),
        ("gpu_spec", view.spec_mask(spec.gpu_spec) if spec.gpu_spec else everything),
        (
            "node_labels",
            view.label_mask(spec.required_node_labels) if spec.required_node_labels else everything,
        ),
        ("stale_busy", ~(view.stale & (view.active > 0))),
        ("vram", view.headroom >= spec.vram_mib),
        ("memory_threshold", _memory_ok(view, spec, cfg)),
        ("temperature", ~view.hot),
        ("nvlink", view.nvlink_ok if spec.needs_nvlink else everything),
        ("disk_await", view.io_ok if spec.io_heavy else everything),
    ]


def describe(rejected: Mapping[str, int], total: int) -> str:
    """One line for ``Task.reason``: the filters that rejected GPUs, most first."""
    if total == 0:
        return "no GPUs in the cluster"
    parts = [f"{name} {n}" for name, n in sorted(rejected.items(), key=lambda kv: -kv[1])]
    return f"no GPU fits ({total} GPUs; rejected by: {', '.join(parts) or 'nothing'})"


def nvlink_groups(pairs: Iterable[Iterable[int]], members: Sequence[int]) -> list[set[int]]:
    """Connected groups of ``members`` (host-local indices) under the NVLink pairs."""
    member_set = set(members)
    adjacent: dict[int, set[int]] = {g: set() for g in member_set}
    for pair in pairs:
        if len(pair) != 2:
            continue
        a, b = tuple(pair)
        if a in member_set and b in member_set:
            adjacent[a].add(b)
            adjacent[b].add(a)
    groups: list[set[int]] = []
    seen: set[int] = set()
    for g in members:
        if g in seen:
            continue
        group = {g}
        frontier = [g]
        while frontier:
            for peer in adjacent[frontier.pop()]:
                if peer not in group:
                    group.add(peer)
                    frontier.append(peer)
        seen |= group
        groups.append(group)
    return groups


# never_fits results memoised per snapshot; past this many shapes the memo starts over
_NEVER_FITS_MEMO = 4096


def never_fits(
    snapshot: ClusterSnapshot, spec: TaskSpec, config: SchedulerConfig | None = None
) -> str | None:
    """Why ``spec`` cannot fit any node even when empty, or None if some node could take it.

    Every node of the snapshot counts, whatever its health, schedulability or
    staleness right now (those pass); what is checked is what does not change
    while a node stays: required labels, GPU models, GPU memory (``vram_mib``
    below the tenant's reject % of the total), GPUs per node and, for
    needs_nvlink multi-GPU tasks, an NVLink-connected group of that size.

    The answer depends on the snapshot and on the task's shape only, so it is
    memoised per snapshot (``ClusterSnapshot.memo``) and shape.
    """
    cfg = config or SchedulerConfig()
    pct = cfg.memory_reject_for(spec.tenant)
    key = (
        "never_fits",
        spec.num_gpus,
        spec.vram_mib,
        pct,
        spec.gpu_spec,
        spec.needs_nvlink,
        frozenset(spec.required_node_labels.items()),
    )
    memo = snapshot.memo
    try:
        return memo[key]
    except KeyError:
        pass
    reason = _never_fits(snapshot, spec, pct)
    if len(memo) >= _NEVER_FITS_MEMO:
        memo.clear()
    memo[key] = reason
    return reason


def _never_fits(s: ClusterSnapshot, spec: TaskSpec, pct: float) -> str | None:
    if s.node_count == 0 or s.gpu_count == 0:
        return "no GPU nodes in the cluster"
    node = s.gpu_node.astype(np.intp)
    eligible = np.ones(s.gpu_count, dtype=bool)
    if spec.required_node_labels:
        nodes_ok = label_index(s.node_labels).required(spec.required_node_labels)
        if not nodes_ok.any():
            wanted = ", ".join(f"{k}={v}" for k, v in sorted(spec.required_node_labels.items()))
            return f"no node carries required_node_labels {wanted}"
        eligible &= nodes_ok[node]
    if spec.gpu_spec:
        eligible &= spec_mask(s, spec.gpu_spec)
        if not eligible.any():
            models = ", ".join(sorted({str(m) for m in s.gpu_model}))
            return f"no GPU matches gpu_spec {spec.gpu_spec!r} (models: {models})"
    with np.errstate(invalid="ignore"):
        total = np.asarray(s.memory_total_mib, dtype=np.float64)
        big_enough = (total >= spec.vram_mib) & (spec.vram_mib < total * (pct / 100.0))
    if not (eligible & big_enough).any():
        largest = float(np.nanmax(np.where(eligible, total, np.nan))) if eligible.any() else 0.0
        return (
            f"vram_mib {spec.vram_mib:g} exceeds every eligible GPU: the largest has "
            f"{largest:g} MiB, of which under {pct:g}% ({largest * pct / 100:g} MiB) may be used"
        )
    eligible &= big_enough
    per_node = np.bincount(node[eligible], minlength=s.node_count)
    if int(per_node.max()) < spec.num_gpus:
        return (
            f"num_gpus {spec.num_gpus} exceeds every node: at most {int(per_node.max())} "
            "eligible GPUs share a node"
        )
    if spec.needs_nvlink:
        k = spec.num_gpus
        # eligible rows grouped by node: node n's are rows[starts[n] : starts[n] + per_node[n]]
        rows = np.flatnonzero(eligible)
        rows = rows[np.argsort(node[rows], kind="stable")]
        starts = np.cumsum(per_node) - per_node
        index = s.gpu_index
        tried: set[tuple] = set()  # (topology, members) already found wanting
        for n in np.flatnonzero(per_node >= k):
            start = int(starts[n])
            members = tuple(index[rows[start : start + int(per_node[n])]].tolist())
            pairs = s.node_nvlink[n]
            if (pairs, members) in tried:
                continue  # most nodes share a topology: each case is checked once
            if k == 1:
                # a single-GPU needs_nvlink task needs a GPU with an NVLink peer
                linked = {g for pair in pairs for g in pair}
                if linked.intersection(members):
                    return None
            elif any(len(g) >= k for g in nvlink_groups(pairs, members)):
                return None
            tried.add((pairs, members))
        return f"no node has {k} NVLink-connected eligible GPUs"
    return None
