"""Hard filters: one table row per rule, NaN, stale and zero-capacity rows,
attribution of rejections, and the never-fits check behind REJECTED."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from scheduler.config import SchedulerConfig
from scheduler.filters import FILTERS, describe, explain, feasible, never_fits
from scheduler.reservations import Reservations
from scheduler.snapshot import ClusterSnapshot, NodeFacts
from scheduler.task import TaskSpec
from scheduler.view import PlacementView

NAN = math.nan
TOTAL = 24_564.0  # NodeFacts default (RTX 4090)


def gpu(
    *,
    node: dict | None = None,
    used: float = 0.0,
    temp: float = 40.0,
    util: float = 10.0,
    healthy: bool = True,
    competition: float = NAN,
    active: int = 0,
    peer: bool = False,
) -> ClusterSnapshot:
    """A one-node snapshot; GPU 0 is the GPU under test (GPU 1 exists only as an NVLink peer)."""
    facts = dict(node or {})
    gpus = 2 if peer else 1
    if peer:
        facts["nvlink_pairs"] = [(0, 1)]
    snap = ClusterSnapshot.build(
        [NodeFacts("n0", gpus, **facts)],
        util_pct=[util] * gpus,
        memory_used_mib=[used] * gpus,
        temperature_c=[temp] * gpus,
    )
    snap.healthy[:] = healthy
    snap.nvlink_competition[:] = competition
    snap.active_tasks[:] = active
    return snap


def task(**changes) -> TaskSpec:
    base = dict(task_id="t", vram_mib=4096.0, gpu_share=0.2)
    base.update(changes)
    return TaskSpec(**base)


# (id, snapshot, task, config, expected first rejecting filter or None for "passes")
ROWS = [
    ("baseline", gpu(), task(), None, None),
    ("node unschedulable", gpu(node=dict(schedulable=False)), task(), None, "node_unschedulable"),
    ("gpu unhealthy", gpu(healthy=False), task(), None, "gpu_unhealthy"),
    ("model mismatch", gpu(), task(gpu_spec="A100"), None, "gpu_spec"),
    ("model match by token", gpu(), task(gpu_spec="V100|rtx 4090"), None, None),
    ("required label missing", gpu(node=dict(labels={"zone": "a"})), task(required_node_labels={"zone": "b"}), None, "node_labels"),
    ("required label present", gpu(node=dict(labels={"zone": "b", "x": "y"})), task(required_node_labels={"zone": "b"}), None, None),
    # stale: readings are not evidence, but only idle GPUs are offered
    ("stale node, idle GPU", gpu(node=dict(stale=True), used=NAN, temp=NAN), task(), None, None),
    ("stale node, hot old reading", gpu(node=dict(stale=True), temp=99.0, used=24_000.0), task(), None, None),
    ("stale node, busy GPU", gpu(node=dict(stale=True), active=1), task(), None, "stale_busy"),
    ("stale node, slow old disk", gpu(node=dict(stale=True, disk_await_ms=500.0)), task(io_heavy=True), None, None),
    # memory
    ("vram short", gpu(used=20_000.0), task(vram_mib=5_000.0), None, "vram"),
    ("vram exactly enough, threshold breached", gpu(used=TOTAL - 5_000.0), task(vram_mib=5_000.0), None, "memory_threshold"),
    ("above 85 % after placement", gpu(used=10_000.0), task(vram_mib=11_000.0), None, "memory_threshold"),
    ("just under 85 %", gpu(used=10_000.0), task(vram_mib=0.85 * TOTAL - 10_000.0 - 1.0), None, None),
    ("exactly 85 % is not under", gpu(used=0.0), task(vram_mib=0.85 * TOTAL), None, "memory_threshold"),
    ("tenant override 95 %", gpu(used=10_000.0), task(vram_mib=11_000.0, tenant="big"), SchedulerConfig(tenant_memory_reject_pct={"big": 95.0}), None),
    ("tenant override 75 %", gpu(used=10_000.0), task(vram_mib=9_000.0, tenant="tight"), SchedulerConfig(tenant_memory_reject_pct={"tight": 75.0}), "memory_threshold"),
    ("used NaN on a fresh node fails closed", gpu(used=NAN), task(), None, "vram"),
    ("zero capacity", gpu(node=dict(memory_total_mib=0.0)), task(), None, "vram"),
    ("unknown capacity", gpu(node=dict(memory_total_mib=NAN)), task(), None, "vram"),
    # temperature
    ("at 85 C", gpu(temp=85.0), task(), None, "temperature"),
    ("just under 85 C", gpu(temp=84.9), task(), None, None),
    ("temperature NaN passes", gpu(temp=NAN), task(), None, None),
    # NVLink
    ("needs nvlink, no peer", gpu(), task(needs_nvlink=True), None, "nvlink"),
    ("needs nvlink, competition 0.6", gpu(peer=True, competition=0.6), task(needs_nvlink=True), None, "nvlink"),
    ("needs nvlink, competition 0.59", gpu(peer=True, competition=0.59), task(needs_nvlink=True), None, None),
    ("needs nvlink, competition NaN", gpu(peer=True), task(needs_nvlink=True), None, None),
    ("no nvlink need, high competition", gpu(peer=True, competition=0.99), task(), None, None),
    # disk
    ("io heavy, await 70 ms", gpu(node=dict(disk_await_ms=70.0)), task(io_heavy=True), None, "disk_await"),
    ("io heavy, await 69 ms", gpu(node=dict(disk_await_ms=69.0)), task(io_heavy=True), None, None),
    ("io heavy, await unknown", gpu(), task(io_heavy=True), None, None),
    ("not io heavy, slow disk", gpu(node=dict(disk_await_ms=500.0)), task(), None, None),
]


@pytest.mark.parametrize("snap, spec, config, rejected_by", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_filter_table(snap: ClusterSnapshot, spec: TaskSpec, config: SchedulerConfig | None, rejected_by: str | None) -> None:
    cfg = config or SchedulerConfig()
    view = PlacementView(snap, None, cfg)
    mask = feasible(view, spec, cfg)
    result = explain(view, spec, cfg)
    assert mask[0] == (rejected_by is None)
    assert result.mask.tolist() == mask.tolist()
    # every GPU of these snapshots reads the same (GPU 1 is GPU 0's twin peer)
    if rejected_by is None:
        assert result.rejected == {}
    else:
        assert rejected_by in FILTERS
        assert result.rejected == {rejected_by: snap.gpu_count}


def test_reservations_count_against_free_memory_until_readings_show_them() -> None:
    snap = gpu(used=10_000.0)
    res = Reservations()
    res.add("lease-1", ["GPU-n0-0"], 8_000.0, 30.0, [10_000.0])
    spec = task(vram_mib=4_000.0)  # 10,000 + 8,000 + 4,000 = 89.6 %: over the threshold
    view = PlacementView(snap, res)
    assert not feasible(view, spec)[0]
    assert explain(view, spec).rejected == {"memory_threshold": 1}
    # the agent now reports the reserved task's memory: the reservation has faded
    shown = gpu(used=18_000.0)
    assert not feasible(PlacementView(shown, res), spec)[0]  # 18,000 + 4,000 = 89.6 % still
    assert feasible(PlacementView(shown, res), task(vram_mib=2_000.0))[0]
    assert feasible(PlacementView(gpu(used=10_000.0), None), spec)[0]  # without it, it fits


def test_rejections_are_attributed_to_the_first_failing_filter_and_sum_up() -> None:
    nodes = [
        NodeFacts("down", 2, schedulable=False),
        NodeFacts("hot", 2),
        NodeFacts("full", 2),
        NodeFacts("ok", 2),
    ]
    snap = ClusterSnapshot.build(
        nodes,
        memory_used_mib=[0, 0, 0, 0, 23_000, 23_000, 0, 0],
        temperature_c=[99, 99, 90, 90, 40, 40, 40, 40],
    )
    snap.healthy[7] = False
    result = explain(PlacementView(snap), task())
    assert result.rejected == {"node_unschedulable": 2, "gpu_unhealthy": 1, "vram": 2, "temperature": 2}
    assert sum(result.rejected.values()) + result.passed == snap.gpu_count
    assert result.mask.tolist() == [False] * 6 + [True, False]


def test_all_filtered_and_empty_cluster() -> None:
    snap = ClusterSnapshot.build([NodeFacts("n", 4)], memory_used_mib=[24_000.0] * 4)
    view = PlacementView(snap)
    assert not feasible(view, task()).any()
    result = explain(view, task())
    assert result.passed == 0 and result.rejected == {"vram": 4}
    assert describe(result.rejected, result.total) == "no GPU fits (4 GPUs; rejected by: vram 4)"
    empty = ClusterSnapshot.build([])
    view = PlacementView(empty)
    assert feasible(view, task()).shape == (0,)
    assert describe(explain(view, task()).rejected, 0) == "no GPUs in the cluster"


# ---- never fits -------------------------------------------------------------------------------------

CLUSTER = ClusterSnapshot.build(
    [
        NodeFacts("a", 8, labels={"zone": "a"}, nvlink_pairs=[(0, 1), (2, 3), (4, 5), (6, 7)]),
        NodeFacts("b", 4, model="Tesla V100-SXM2-32GB", memory_total_mib=32_510.0, schedulable=False),
        NodeFacts("c", 2, stale=True),
    ]
)


@pytest.mark.parametrize(
    "spec, config, reason",
    [
        (task(), None, None),
        (task(num_gpus=8), None, None),
        (task(num_gpus=9), None, "num_gpus 9 exceeds every node"),
        (task(vram_mib=20_000.0), None, None),
        (task(vram_mib=24_000.0), None, None),  # the V100 32GB node could take it
        (task(vram_mib=24_000.0, gpu_spec="4090"), None, "vram_mib 24000 exceeds every eligible GPU"),
        (task(vram_mib=40_000.0), None, "vram_mib 40000 exceeds every eligible GPU"),
        (task(vram_mib=24_000.0, gpu_spec="4090", tenant="t"), SchedulerConfig(tenant_memory_reject_pct={"t": 99.0}), None),
        (task(gpu_spec="V100M16"), None, "no GPU matches gpu_spec 'V100M16'"),
        (task(gpu_spec="V100M32", num_gpus=4), None, None),  # unschedulable now, but it exists
        (task(required_node_labels={"zone": "z"}), None, "no node carries required_node_labels zone=z"),
        (task(required_node_labels={"zone": "a"}, num_gpus=8), None, None),
        (task(needs_nvlink=True, num_gpus=2), None, None),
        (task(needs_nvlink=True, num_gpus=4), None, "no node has 4 NVLink-connected eligible GPUs"),
        (task(needs_nvlink=True, gpu_spec="V100"), None, "no node has 1 NVLink-connected eligible GPUs"),
    ],
)
def test_never_fits_table(spec: TaskSpec, config: SchedulerConfig | None, reason: str | None) -> None:
    got = never_fits(CLUSTER, spec, config)
    if reason is None:
        assert got is None
    else:
        assert got is not None and got.startswith(reason), got


def test_never_fits_an_empty_cluster() -> None:
    assert never_fits(ClusterSnapshot.build([]), task()) == "no GPU nodes in the cluster"


def test_filters_are_vectorised_over_many_gpus() -> None:
    rng = np.random.default_rng(3)
    count = 64
    snap = ClusterSnapshot.build(
        [NodeFacts(f"n{i}", 8) for i in range(count // 8)],
        memory_used_mib=rng.uniform(0, 24_000, count),
        temperature_c=rng.uniform(30, 95, count),
    )
    spec = task(vram_mib=6_000.0)
    mask = feasible(PlacementView(snap), spec)
    used, temp = snap.memory_used_mib, snap.temperature_c
    expected = (TOTAL - used >= 6_000) & (used + 6_000 < 0.85 * TOTAL) & (temp < 85)
    assert mask.tolist() == expected.tolist()


# ---- label index and the never-fits memo ---------------------------------------------------------


def brute_required(node_labels, required) -> list[bool]:
    return [all(labels.get(k) == v for k, v in required.items()) for labels in node_labels]


def brute_preferred(node_labels, preferred) -> list[float]:
    items = list(preferred.items())
    return [sum(labels.get(k) == v for k, v in items) / len(items) for labels in node_labels]


def random_labels(rng: np.random.Generator, nodes: int) -> list[dict[str, str]]:
    out = []
    for _ in range(nodes):
        labels = {}
        for key in ("zone", "rack", "pool"):
            if rng.random() < 0.8:
                labels[key] = f"{key[0]}{int(rng.integers(0, 3))}"
        out.append(labels)
    return out


@pytest.mark.parametrize("seed", range(5))
def test_label_masks_from_the_index_match_a_scan_of_every_node(seed: int) -> None:
    rng = np.random.default_rng(seed)
    labels = random_labels(rng, 40)
    snap = ClusterSnapshot.build([NodeFacts(f"n{i}", 2, labels=labels[i]) for i in range(40)])
    view = PlacementView(snap)
    for _ in range(30):
        want = {k: f"{k[0]}{int(rng.integers(0, 4))}" for k in ("zone", "rack", "pool", "other") if rng.random() < 0.5}
        if not want:
            continue
        node_mask = brute_required(snap.node_labels, want)
        assert view.label_mask(want).tolist() == [node_mask[n] for n in snap.gpu_node]
        fraction = brute_preferred(snap.node_labels, want)
        assert view.preferred_fraction(want).tolist() == [fraction[n] for n in snap.gpu_node]
        spec = task(required_node_labels=want)
        got = never_fits(snap, spec)
        assert (got is None) == any(node_mask), got


def test_the_label_index_follows_the_labels_object_not_its_position() -> None:
    first = ClusterSnapshot.build([NodeFacts("a", 1, labels={"zone": "a"}), NodeFacts("b", 1)])
    assert PlacementView(first).label_mask({"zone": "a"}).tolist() == [True, False]
    # the coordinator's next snapshot reuses the labels list: the index is reused
    again = dataclasses.replace(first, taken_at_s=1.0)
    assert PlacementView(again).label_mask({"zone": "a"}).tolist() == [True, False]
    # membership changed: a new list, a new index
    moved = ClusterSnapshot.build([NodeFacts("b", 1), NodeFacts("a", 1, labels={"zone": "a"})])
    assert PlacementView(moved).label_mask({"zone": "a"}).tolist() == [False, True]
    assert PlacementView(first).label_mask({"zone": "a"}).tolist() == [True, False]


def test_never_fits_is_memoised_per_snapshot_with_the_same_answers() -> None:
    rng = np.random.default_rng(5)
    nodes = [
        NodeFacts(
            f"n{i}", int(rng.integers(1, 5)),
            labels={"zone": f"z{i % 3}"},
            model=["NVIDIA GeForce RTX 4090", "Tesla V100-SXM2-32GB"][i % 2],
            memory_total_mib=[24_564.0, 32_510.0][i % 2],
            nvlink_pairs=[(0, 1), (1, 2)] if i % 4 == 0 else [],
        )
        for i in range(12)
    ]
    snap = ClusterSnapshot.build(nodes)
    cfg = SchedulerConfig(tenant_memory_reject_pct={"big": 99.0})
    specs = [
        task(
            task_id=f"t{i}",
            tenant=["", "big"][int(rng.integers(0, 2))],
            num_gpus=int(rng.integers(1, 5)),
            vram_mib=float(rng.choice([1_000.0, 20_000.0, 24_000.0, 30_000.0])),
            gpu_spec=["", "4090", "V100M32", "A100"][int(rng.integers(0, 4))],
            needs_nvlink=bool(rng.random() < 0.4),
            required_node_labels={"zone": f"z{int(rng.integers(0, 4))}"} if rng.random() < 0.4 else {},
        )
        for i in range(200)
    ]
    first = [never_fits(snap, s, cfg) for s in specs]
    assert snap.memo  # answers are kept with the snapshot
    assert [never_fits(snap, s, cfg) for s in specs] == first
    fresh = dataclasses.replace(snap, taken_at_s=1.0)
    assert not fresh.memo  # a new snapshot starts with no answers
    assert [never_fits(fresh, s, cfg) for s in reversed(specs)] == first[::-1]
    assert any(r is None for r in first) and any(r is not None for r in first)


def test_never_fits_nvlink_search_over_many_alike_nodes() -> None:
    # 300 nodes of NVLink pairs: a connected four exists on none but the last
    nodes = [NodeFacts(f"n{i}", 8, nvlink_pairs=[(0, 1), (2, 3), (4, 5), (6, 7)]) for i in range(299)]
    nodes.append(NodeFacts("ring", 8, nvlink_pairs=[(g, (g + 1) % 8) for g in range(8)]))
    snap = ClusterSnapshot.build(nodes)
    assert never_fits(snap, task(num_gpus=4, needs_nvlink=True)) is None
    assert never_fits(snap, task(num_gpus=8, needs_nvlink=True)) is None
    without = ClusterSnapshot.build(nodes[:-1])
    assert never_fits(without, task(num_gpus=4, needs_nvlink=True)) == "no node has 4 NVLink-connected eligible GPUs"
    assert never_fits(without, task(num_gpus=2, needs_nvlink=True)) is None
