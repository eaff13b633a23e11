"""Policies: the registry, weight validation, each policy's characteristic
choice, and multi-GPU set selection (NVLink preference, connectivity, and
exactness against brute force for pairs)."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler.errors import InvalidWeight, UnknownPolicy
from scheduler.filters import feasible, nvlink_groups
from scheduler.policies import POLICIES, Policy, make_policy
from scheduler.reservations import Reservations
from scheduler.snapshot import ClusterSnapshot, NodeFacts
from scheduler.task import TaskSpec
from scheduler.view import PlacementView


def spec(**changes) -> TaskSpec:
    base = dict(task_id="t", vram_mib=2_000.0, gpu_share=0.2)
    base.update(changes)
    return TaskSpec(**base)


def place(policy: Policy, view: PlacementView, task: TaskSpec, res: Reservations, key: str):
    placement = policy.choose(view, task, feasible(view, task))
    if placement is not None:
        res.add(key, placement.gpu_uuids, task.vram_mib, 100 * task.gpu_share, [float(view.used[r]) for r in placement.rows])
        view.refresh(placement.gpu_uuids)
        policy.commit(view, placement)
    return placement


# ---- registry and weights ---------------------------------------------------------------------------


def test_registry_is_one_explicit_dict_keyed_by_name() -> None:
    assert list(POLICIES) == ["round_robin", "weighted_round_robin", "least_connections", "load_aware", "binpack", "fgd"]
    for name, cls in POLICIES.items():
        assert cls.NAME == name
        policy = make_policy(name)
        assert policy.weights == dict(cls.DEFAULT_WEIGHTS) and "nvlink" in policy.weights


def test_unknown_policy_names_it() -> None:
    with pytest.raises(UnknownPolicy) as info:
        make_policy("fastest")
    assert info.value.name == "fastest" and "fastest" in str(info.value)
    assert "load_aware" in info.value.available


@pytest.mark.parametrize(
    "name, weights, bad",
    [
        ("load_aware", {"lod": 1.0}, "lod"),
        ("load_aware", {"load": -1.0}, "load"),
        ("load_aware", {"memory": math.nan}, "memory"),
        ("load_aware", {"temperature": math.inf}, "temperature"),
        ("binpack", {"load": 1.0}, "load"),
        ("round_robin", {"nvlink": True}, "nvlink"),
        ("weighted_round_robin", {"speed": 0.0}, "speed"),  # speed and memory both 0
    ],
)
def test_invalid_weights_name_the_weight(name: str, weights: dict, bad: str) -> None:
    with pytest.raises(InvalidWeight) as info:
        make_policy(name, weights)
    assert info.value.name == bad and bad in str(info.value)


def test_update_weights_changes_only_the_given_terms_and_is_atomic() -> None:
    policy = make_policy("load_aware", {"load": 2.0})
    before = dict(policy.weights)
    with pytest.raises(InvalidWeight):
        policy.update_weights({"memory": 3.0, "bogus": 1.0})
    assert policy.weights == before
    policy.update_weights({"memory": 3.0})
    assert policy.weights == {**before, "memory": 3.0}


# ---- characteristic choices -----------------------------------------------------------------------

NODES = [NodeFacts("a", 2, speed=2.0), NodeFacts("b", 2, speed=1.0)]


def small(used=(0.0, 0.0, 0.0, 0.0), util=(0.0, 0.0, 0.0, 0.0), active=(0, 0, 0, 0)) -> ClusterSnapshot:
    snap = ClusterSnapshot.build(NODES, util_pct=list(util), memory_used_mib=list(used))
    snap.active_tasks[:] = active
    return snap


def test_round_robin_takes_the_next_feasible_gpu_cycling() -> None:
    snap = small(used=(0.0, 24_000.0, 0.0, 0.0))  # GPU 1 is full
    view = PlacementView(snap, res := Reservations())
    policy = make_policy("round_robin")
    rows = [place(policy, view, spec(task_id=f"t{i}", vram_mib=1.0), res, f"k{i}").rows[0] for i in range(6)]
    assert rows == [0, 2, 3, 0, 2, 3]


def test_round_robin_cursor_follows_the_gpu_across_snapshots() -> None:
    policy = make_policy("round_robin")
    view = PlacementView(small(), res := Reservations())
    assert place(policy, view, spec(vram_mib=1.0), res, "k0").gpu_uuids == ("GPU-a-0",)
    # node "a" left and came back behind "b": rows moved, the cursor did not
    moved = ClusterSnapshot.build([NODES[1], NODES[0]])
    view = PlacementView(moved, res)
    assert place(policy, view, spec(vram_mib=1.0), res, "k1").gpu_uuids == ("GPU-a-1",)


def test_weighted_round_robin_follows_node_speed() -> None:
    view = PlacementView(small(), res := Reservations())
    policy = make_policy("weighted_round_robin")
    counts = Counter(place(policy, view, spec(task_id=f"t{i}", vram_mib=1.0, gpu_share=0.0), res, f"k{i}").node_id for i in range(60))
    assert counts == {"a": 40, "b": 20}


def test_weighted_round_robin_by_memory() -> None:
    nodes = [NodeFacts("small", 1, memory_total_mib=24_576.0), NodeFacts("big", 1, memory_total_mib=3 * 24_576.0)]
    view = PlacementView(ClusterSnapshot.build(nodes), res := Reservations())
    policy = make_policy("weighted_round_robin", {"speed": 0.0, "memory": 1.0})
    counts = Counter(place(policy, view, spec(task_id=f"t{i}", vram_mib=1.0, gpu_share=0.0), res, f"k{i}").node_id for i in range(40))
    assert counts == {"big": 30, "small": 10}


def test_least_connections_takes_the_fewest_active_then_the_least_loaded() -> None:
    view = PlacementView(small(active=(3, 1, 1, 2), util=(0.0, 80.0, 20.0, 0.0)))
    choice = make_policy("least_connections").choose(view, spec(), feasible(view, spec()))
    assert choice.rows == (2,) and choice.score.terms["active"] == 1.0


def test_load_aware_takes_the_least_loaded_coolest_gpu() -> None:
    snap = small(util=(80.0, 10.0, 10.0, 40.0))
    snap.temperature_c[:] = [40.0, 84.0, 45.0, 40.0]
    view = PlacementView(snap)
    choice = make_policy("load_aware").choose(view, spec(), feasible(view, spec()))
    assert choice.rows == (2,)


def test_binpack_takes_the_tightest_fit() -> None:
    view = PlacementView(small(used=(10_000.0, 16_000.0, 19_000.0, 0.0)))
    task = spec(vram_mib=2_000.0)
    choice = make_policy("binpack").choose(view, task, feasible(view, task))
    # GPU 2 would leave the least free but 19,000 + 2,000 is over 85 %: GPU 1 is the tightest fit
    assert choice.rows == (1,)
    assert choice.score.terms["free_after"] == pytest.approx((24_564 - 18_000) / 24_564)


def test_each_policy_makes_its_own_choice_on_the_same_snapshot() -> None:
    snap = small(used=(0.0, 12_000.0, 6_000.0, 0.0), util=(60.0, 90.0, 30.0, 5.0), active=(1, 2, 0, 1))
    snap.util_forecast_pct[:] = snap.util_pct
    view = PlacementView(snap)
    task = spec()
    got = {name: make_policy(name).choose(view, task, feasible(view, task)).rows[0] for name in POLICIES}
    assert got == {
        "round_robin": 0,  # first GPU after the (unset) cursor
        "weighted_round_robin": 0,  # node a is twice as fast: smallest virtual finish
        "least_connections": 2,  # no active task
        "load_aware": 3,  # 5 % util and one task beats 30 % util and none
        "binpack": 1,  # the fullest GPU that still fits
        "fgd": 1,  # no GPU left too small for another task like it: the tightest fit breaks the tie
    }


# ---- multi-GPU sets --------------------------------------------------------------------------------


def test_a_multi_gpu_task_stays_on_one_node() -> None:
    snap = ClusterSnapshot.build([NodeFacts("a", 2), NodeFacts("b", 3)])
    view = PlacementView(snap)
    choice = make_policy("load_aware").choose(view, spec(num_gpus=3), feasible(view, spec(num_gpus=3)))
    assert choice.node_id == "b" and choice.gpu_indices == (0, 1, 2) and choice.score.candidates == 1
    assert make_policy("load_aware").choose(view, spec(num_gpus=4), feasible(view, spec(num_gpus=4))) is None


def test_nvlink_connected_pairs_are_preferred() -> None:
    snap = ClusterSnapshot.build(
        [NodeFacts("a", 4, nvlink_pairs=[(0, 1), (2, 3)])], util_pct=[0.0, 40.0, 10.0, 40.0]
    )
    view = PlacementView(snap)
    task = spec(num_gpus=2)
    # best two by score are 0 and 2 (not linked); 0+1 is linked and wins by the bonus
    choice = make_policy("load_aware").choose(view, task, feasible(view, task))
    assert choice.gpu_indices == (0, 1) and choice.score.terms["nvlink"] == pytest.approx(-0.5)
    unlinked = make_policy("load_aware", {"nvlink": 0.0}).choose(view, task, feasible(view, task))
    assert unlinked.gpu_indices == (0, 2)


def test_needs_nvlink_requires_a_connected_set() -> None:
    snap = ClusterSnapshot.build([NodeFacts("a", 4, nvlink_pairs=[(0, 1), (2, 3)]), NodeFacts("b", 4, nvlink_pairs=[(0, 1), (1, 2), (2, 3)])])
    snap.util_pct[4:] = 90.0
    snap.util_forecast_pct[4:] = 90.0
    view = PlacementView(snap)
    four = spec(num_gpus=4, needs_nvlink=True)
    choice = make_policy("load_aware").choose(view, four, feasible(view, four))
    assert choice.node_id == "b"  # hotter, but "a" has no connected four
    snap.memory_used_mib[5] = 24_000.0  # b's GPU 1 full: its chain breaks
    view = PlacementView(snap)
    assert make_policy("load_aware").choose(view, four, feasible(view, four)) is None
    three = spec(num_gpus=2, needs_nvlink=True)
    assert make_policy("load_aware").choose(view, three, feasible(view, three)).gpu_indices in {(0, 1), (2, 3)}


def brute_force_pairs(view: PlacementView, scores: np.ndarray, mask: np.ndarray, bonus: float, needs: bool) -> float:
    best = math.inf
    snap = view.snapshot
    for n in range(snap.node_count):
        rows = [r for r in np.flatnonzero(mask) if view.node[r] == n]
        for a, b in itertools.combinations(rows, 2):
            linked = frozenset({int(snap.gpu_index[a]), int(snap.gpu_index[b])}) in snap.node_nvlink[n]
            if needs and not linked:
                continue
            best = min(best, (scores[a] + scores[b]) / 2 - bonus * linked)
    return best


@settings(max_examples=80, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    data=st.data(),
    needs=st.booleans(),
    name=st.sampled_from(["load_aware", "binpack", "least_connections"]),
)
def test_pair_choice_matches_brute_force(sizes: list[int], data, needs: bool, name: str) -> None:
    nodes = []
    for i, size in enumerate(sizes):
        pairs = data.draw(st.lists(st.tuples(st.integers(0, size - 1), st.integers(0, size - 1)).filter(lambda p: p[0] != p[1]), max_size=6))
        nodes.append(NodeFacts(f"n{i}", size, nvlink_pairs=pairs))
    count = sum(sizes)
    snap = ClusterSnapshot.build(
        nodes,
        util_pct=data.draw(st.lists(st.floats(0, 100), min_size=count, max_size=count)),
        memory_used_mib=data.draw(st.lists(st.floats(0, 22_000), min_size=count, max_size=count)),
    )
    snap.active_tasks[:] = data.draw(st.lists(st.integers(0, 3), min_size=count, max_size=count))
    view = PlacementView(snap)
    task = spec(num_gpus=2, needs_nvlink=needs)
    policy = make_policy(name)
    mask = feasible(view, task)
    expected = brute_force_pairs(view, policy.gpu_scores(view, task), mask, policy.weights["nvlink"], needs)
    choice = policy.choose(view, task, mask)
    if expected == math.inf:
        assert choice is None
    else:
        assert choice is not None and choice.score.total == pytest.approx(expected)
        assert len(set(view.node[list(choice.rows)])) == 1 and all(mask[list(choice.rows)])


@settings(max_examples=60, deadline=None)
@given(size=st.integers(3, 8), k=st.integers(3, 6), data=st.data())
def test_needs_nvlink_sets_are_connected_and_found_when_one_exists(size: int, k: int, data) -> None:
    pairs = data.draw(st.lists(st.tuples(st.integers(0, size - 1), st.integers(0, size - 1)).filter(lambda p: p[0] != p[1]), max_size=12))
    snap = ClusterSnapshot.build([NodeFacts("n", size, nvlink_pairs=pairs)], util_pct=data.draw(st.lists(st.floats(0, 100), min_size=size, max_size=size)))
    full = data.draw(st.lists(st.integers(0, size - 1), max_size=2))
    snap.memory_used_mib[full] = 24_000.0
    view = PlacementView(snap)
    task = spec(num_gpus=k, needs_nvlink=True)
    mask = feasible(view, task)
    members = [int(snap.gpu_index[r]) for r in np.flatnonzero(mask)]
    exists = any(len(g) >= k for g in nvlink_groups(snap.node_nvlink[0], members))
    choice = make_policy("load_aware").choose(view, task, mask)
    assert (choice is not None) == exists
    if choice is not None:
        assert len(choice.rows) == k and all(mask[list(choice.rows)])
        groups = nvlink_groups(snap.node_nvlink[0], list(choice.gpu_indices))
        assert len(groups) == 1


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("k", [1, 2, 4])
def test_every_breakdown_adds_up_to_its_total(name: str, k: int) -> None:
    snap = ClusterSnapshot.build(
        [NodeFacts("a", 4, nvlink_pairs=[(0, 1), (2, 3)]), NodeFacts("b", 4, stale=True)],
        util_pct=[10.0, 60.0, 30.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        memory_used_mib=[2_000.0, 18_000.0, 9_000.0, 0.0, 0.0, 0.0, 0.0, 0.0],
    )
    view = PlacementView(snap)
    task = spec(num_gpus=k, preferred_node_labels={"x": "y"})
    choice = make_policy(name).choose(view, task, feasible(view, task))
    assert choice is not None and len(choice.rows) == k
    assert sum(choice.score.terms.values()) == pytest.approx(choice.score.total)
    assert choice.score.policy == name and choice.score.candidates >= 1


# ---- the (node x GPU) fast path against the general set selection ---------------------------------


@pytest.fixture(params=["numpy", "compiled"])
def set_search(request, monkeypatch) -> str:
    """Runs a test over both uniform-layout set choices: the numpy paths and
    the compiled loop of ``scheduler.setsearch`` (skipped without numba)."""
    from scheduler import setsearch

    if request.param == "compiled":
        if not setsearch.ready():
            pytest.skip(f"numba is not installed or cannot compile: {setsearch.failure}")
    else:
        monkeypatch.setattr(setsearch, "ready", lambda: False)
    return request.param


TOPOLOGIES = {
    "none": [],
    "pairs": [(0, 1), (2, 3), (4, 5), (6, 7)],
    "ring": [(g, (g + 1) % 8) for g in range(8)],
    "mesh": [(a, b) for a in range(8) for b in range(a + 1, 8)],
}


def uniform_snapshot(rng: np.random.Generator, nodes: int, width: int, ties: bool) -> ClusterSnapshot:
    """``nodes`` nodes of ``width`` GPUs, mixed NVLink topologies, some stale or full GPUs."""
    facts = []
    for i in range(nodes):
        kind = list(TOPOLOGIES)[int(rng.integers(0, 4))]
        if rng.random() < 0.2:  # an odd topology of its own
            pairs = [tuple(int(x) for x in rng.integers(0, width, 2)) for _ in range(int(rng.integers(1, 6)))]
        else:
            pairs = [(a, b) for a, b in TOPOLOGIES[kind] if a < width and b < width]
        facts.append(NodeFacts(f"n{i:03d}", width, nvlink_pairs=pairs, stale=bool(rng.random() < 0.05),
                               response_time_s=float(rng.choice([0.5, 1.0])) if ties else float(rng.uniform(0.1, 3))))
    count = nodes * width
    if ties:  # few distinct readings: equal scores within and across nodes
        util = rng.choice([0.0, 25.0, 50.0], count)
        used = rng.choice([0.0, 4_096.0, 23_000.0], count)
    else:
        util = rng.uniform(0, 100, count)
        used = np.where(rng.random(count) < 0.1, 23_000.0, rng.uniform(0, 16_000, count))
    snap = ClusterSnapshot.build(facts, util_pct=util, memory_used_mib=used,
                                 temperature_c=rng.choice([40.0, 70.0], count) if ties else rng.uniform(30, 80, count))
    snap.active_tasks[:] = rng.integers(0, 3, count)
    return snap


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("ties", [False, True])
def test_uniform_set_choice_matches_the_general_path(seed: int, ties: bool, set_search: str) -> None:
    rng = np.random.default_rng(seed)
    width = int(rng.choice([2, 3, 4, 8, 8, 8]))
    nodes = int(rng.choice([1, 5, 40, 120]))
    snap = uniform_snapshot(rng, nodes, width, ties)
    view = PlacementView(snap, res := Reservations())
    assert view.uniform_width == width
    name = ["load_aware", "binpack", "least_connections", "round_robin"][seed % 4]
    policy = make_policy(name, {"nvlink": float(rng.choice([0.0, 0.5, 0.5, 3.0]))})
    for i in range(12):
        k = int(rng.integers(2, width + 1))
        task = spec(task_id=f"t{i}", num_gpus=k, needs_nvlink=bool(rng.random() < 0.4),
                    preferred_node_labels={"x": "y"} if rng.random() < 0.2 else {})
        mask = feasible(view, task)
        fast = policy.choose(view, task, mask)
        reference = policy._choose_set_general(view, task, mask, policy.gpu_scores(view, task))
        assert fast == reference, (k, task.needs_nvlink)
        if fast is not None:  # place it, so later decisions see reservations
            res.add(f"k{i}", fast.gpu_uuids, task.vram_mib, 100 * task.gpu_share, [float(view.used[r]) for r in fast.rows])
            view.refresh(fast.gpu_uuids)


def test_non_uniform_layouts_take_the_general_path() -> None:
    snap = ClusterSnapshot.build([NodeFacts("a", 4), NodeFacts("b", 2)])
    assert PlacementView(snap).uniform_width == 0
    assert PlacementView(ClusterSnapshot.build([NodeFacts("a", 4), NodeFacts("b", 4)])).uniform_width == 4


def set_objective(view: PlacementView, scores: np.ndarray, rows, bonus: float) -> tuple[float, bool]:
    """(mean score - bonus * links / (k(k-1)/2), connected) of a GPU set, from the snapshot's pairs."""
    snap = view.snapshot
    node = int(view.node[rows[0]])
    members = [int(snap.gpu_index[r]) for r in rows]
    links = sum(frozenset(p) in snap.node_nvlink[node] for p in itertools.combinations(members, 2))
    k = len(rows)
    connected = len(nvlink_groups(snap.node_nvlink[node], members)) == 1
    return float(np.mean(scores[list(rows)])) - bonus * links / (k * (k - 1) / 2), connected


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])  # set_search holds for all inputs
@given(seed=st.integers(0, 10_000), needs=st.booleans(), k=st.integers(3, 4))
def test_larger_sets_against_brute_force(seed: int, needs: bool, k: int, set_search: str) -> None:
    """k = 3, 4: the greedy growth is not exact, but the choice is a real set
    whose objective is the reported total, no better than the brute-force
    optimum, no worse than the best plain k best GPUs of a node (option A), and
    connected when NVLink is needed; None only when no connected set exists."""
    rng = np.random.default_rng(seed)
    snap = uniform_snapshot(rng, 6, 5, ties=bool(seed % 2))
    view = PlacementView(snap)
    policy = make_policy("load_aware")
    bonus = policy.weights["nvlink"]
    task = spec(num_gpus=k, needs_nvlink=needs)
    mask = feasible(view, task)
    scores = policy.gpu_scores(view, task)
    optimum, plain = math.inf, math.inf
    for n in range(snap.node_count):
        rows = [int(r) for r in np.flatnonzero(mask & (view.node == n))]
        if len(rows) < k:
            continue
        best_k = sorted(rows, key=lambda r: (scores[r], r))[:k]
        value, connected = set_objective(view, scores, best_k, bonus)
        if connected or not needs:
            plain = min(plain, value)
        for combo in itertools.combinations(rows, k):
            value, connected = set_objective(view, scores, combo, bonus)
            if connected or not needs:
                optimum = min(optimum, value)
    choice = policy.choose(view, task, mask)
    assert choice == policy._choose_set_general(view, task, mask, scores)
    if choice is None:
        assert optimum == math.inf
        return
    value, connected = set_objective(view, scores, choice.rows, bonus)
    assert choice.score.total == pytest.approx(value)
    assert optimum - 1e-9 <= value <= plain + 1e-9
    assert connected or not needs
    assert len(set(view.node[list(choice.rows)])) == 1 and all(mask[list(choice.rows)])


# ---- single-GPU fast paths against the plain masked argmin ----------------------------------------


def masked_argmin(policy: Policy, view: PlacementView, task: TaskSpec, mask: np.ndarray):
    """The reference single-GPU choice: (row, total, candidates) or None."""
    scores = policy.gpu_scores(view, task)
    masked = np.where(mask, scores, np.inf)
    row = int(np.argmin(masked))
    if not masked[row] < np.inf:
        finite = mask & np.isfinite(scores)
        if not finite.any():
            return None
        row = int(np.argmin(np.where(finite, scores, np.inf)))
    return row, float(scores[row]), int(np.count_nonzero(mask))


@pytest.mark.parametrize("seed", range(24))
def test_single_gpu_choice_matches_the_masked_argmin(seed: int) -> None:
    rng = np.random.default_rng(seed)
    width = int(rng.choice([1, 4, 8]))
    nodes = [
        NodeFacts(f"n{i}", width if seed % 3 else int(rng.integers(1, 9)), labels={"zone": f"z{i % 6}"},
                  stale=bool(rng.random() < 0.1), schedulable=bool(rng.random() < 0.95))
        for i in range(int(rng.choice([3, 30, 200])))
    ]
    count = sum(n.gpus for n in nodes)
    snap = ClusterSnapshot.build(
        nodes,
        util_pct=np.where(rng.random(count) < 0.05, math.nan, rng.choice([0.0, 50.0], count) if seed % 2 else rng.uniform(0, 100, count)),
        memory_used_mib=np.where(rng.random(count) < 0.05, math.nan, rng.uniform(0, 22_000, count)),
        temperature_c=rng.uniform(30, 90, count),
    )
    snap.active_tasks[:] = rng.integers(0, 3, count)
    view = PlacementView(snap, res := Reservations())
    policy = make_policy(["load_aware", "binpack", "least_connections", "weighted_round_robin"][seed % 4])
    for i in range(25):
        task = spec(task_id=f"t{i}", vram_mib=float(rng.choice([500.0, 4_000.0, 12_000.0, 19_000.0])),
                    gpu_share=float(rng.uniform(0, 0.5)),
                    required_node_labels={"zone": f"z{int(rng.integers(0, 7))}"} if rng.random() < 0.4 else {},
                    preferred_node_labels={"zone": "z2"} if rng.random() < 0.3 else {})
        mask = feasible(view, task)
        expected = masked_argmin(policy, view, task, mask)
        choice = place(policy, view, task, res, f"k{i}")
        if expected is None:
            assert choice is None
        else:
            assert choice is not None
            assert (choice.rows[0], choice.score.total, choice.score.candidates) == expected
            if policy.NAME == "load_aware":
                assert sum(choice.score.terms.values()) == pytest.approx(choice.score.total)


@pytest.mark.parametrize("k", [2, 3])
def test_uniform_set_choice_when_no_node_has_its_best_gpus_connected(k: int, set_search: str) -> None:
    # NVLink 0-1-3-2 and 4-5-7-6 (no even pair); the even GPUs are the least
    # loaded, so no node's k best GPUs are connected and option A has nothing
    # to bound the search by
    rng = np.random.default_rng(k)
    links = [(0, 1), (1, 3), (3, 2), (4, 5), (5, 7), (7, 6)]
    nodes = [NodeFacts(f"n{i:03d}", 8, nvlink_pairs=links) for i in range(100)]
    util = np.where(np.arange(800) % 2 == 0, rng.uniform(0, 10, 800), rng.uniform(50, 100, 800))
    snap = ClusterSnapshot.build(nodes, util_pct=util)
    view = PlacementView(snap)
    policy = make_policy("load_aware")
    task = spec(num_gpus=k, needs_nvlink=True)
    mask = feasible(view, task)
    choice = policy.choose(view, task, mask)
    assert choice == policy._choose_set_general(view, task, mask, policy.gpu_scores(view, task))
    assert choice is not None and len(nvlink_groups(snap.node_nvlink[0], list(choice.gpu_indices))) == 1


@pytest.mark.parametrize("k", [2, 4])
def test_uniform_set_choice_on_a_large_fleet_of_linked_nodes(k: int, set_search: str) -> None:
    # every node has NVLink pairs, so nearly every node is hopeful: the fast
    # path keeps hundreds of nodes and sorts most of them by score only
    rng = np.random.default_rng(10 + k)
    nodes = [NodeFacts(f"n{i:03d}", 8, nvlink_pairs=[(0, 1), (2, 3), (4, 5), (6, 7)]) for i in range(600)]
    snap = ClusterSnapshot.build(nodes, util_pct=rng.uniform(0, 100, 4_800), memory_used_mib=rng.uniform(0, 12_000, 4_800))
    view = PlacementView(snap, res := Reservations())
    policy = make_policy("load_aware")
    for i in range(8):
        task = spec(task_id=f"t{i}", num_gpus=k, needs_nvlink=i % 2 == 1)
        mask = feasible(view, task)
        expected = policy._choose_set_general(view, task, mask, policy.gpu_scores(view, task))
        assert place(policy, view, task, res, f"k{i}") == expected


@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize("ties", [False, True])
def test_choice_from_lower_bounds_is_the_choice_from_every_score(seed: int, ties: bool, monkeypatch) -> None:
    """load_aware on a big fleet scores exactly only the GPUs its lower
    bounds say can win (``Policy.gpu_bounds``); the placement must be the
    one of scoring every GPU, to the bit, ties included, with learned
    slowdowns (the completion term) and preferred labels. (The numpy set
    choice: the compiled one always scores every GPU.)"""
    import dataclasses

    from scheduler import policies, setsearch

    monkeypatch.setattr(setsearch, "ready", lambda: False)

    rng = np.random.default_rng(1000 + seed)
    width = int(rng.choice([4, 8]))
    snap = uniform_snapshot(rng, int(rng.choice([40, 120])), width, ties)
    snap.node_stale[:] = False  # a stale node turns the bounds off
    count = snap.gpu_count
    if rng.random() < 0.7:
        slow = lambda: rng.choice([0.8, 1.0, 1.0, 1.5, math.nan], count)  # noqa: E731
        snap = dataclasses.replace(snap, gpu_slowdown={"": slow(), "training": slow()})
    view = PlacementView(snap, res := Reservations())
    policy = make_policy("load_aware", {"nvlink": float(rng.choice([0.0, 0.5, 3.0])),
                                        "jitter": float(rng.choice([0.0, 0.1]))})
    full_scorings = []
    every_row = policy.gpu_scores

    def counted(view, task):
        full_scorings.append(task.task_id)
        return every_row(view, task)

    policy.gpu_scores = counted
    bounded = 0
    for i in range(16):
        k = int(rng.choice([1, 1, 2, min(4, width), width]))
        task = spec(task_id=f"t{i}", num_gpus=k, needs_nvlink=bool(k > 1 and rng.random() < 0.3),
                    vram_mib=float(rng.choice([1_024.0, 4_096.0, 12_000.0])), gpu_share=float(rng.uniform(0, 1)),
                    kind=str(rng.choice(["inference", "training"])),
                    preferred_node_labels={"x": "y"} if rng.random() < 0.2 else {})
        mask = feasible(view, task)
        monkeypatch.setattr(policies, "_BOUNDS_MIN_GPUS", 10**9)
        monkeypatch.setattr(policies, "_ONE_BOUNDS_MIN_GPUS", 10**9)
        reference = policy.choose(view, task, mask)
        monkeypatch.setattr(policies, "_BOUNDS_MIN_GPUS", 0)
        monkeypatch.setattr(policies, "_ONE_BOUNDS_MIN_GPUS", 0)
        del full_scorings[:]
        fast = policy.choose(view, task, mask)
        assert fast == reference, (k, task.needs_nvlink)
        if k > 1 and mask.any():
            assert reference == policy._choose_set_general(view, task, mask, every_row(view, task))
        bounded += fast is not None and not full_scorings
        if fast is not None:  # place it, so later decisions see reservations
            res.add(f"k{i}", fast.gpu_uuids, task.vram_mib, 100 * task.gpu_share,
                    [float(view.used[r]) for r in fast.rows])
            view.refresh(fast.gpu_uuids)
    assert bounded > 0  # some placements were made without scoring every GPU


# ---- multi-GPU paths of large fleets against the general path -------------------------------------


def test_fewest_and_most_links_and_the_link_matrix_match_brute_force() -> None:
    rng = np.random.default_rng(5)
    facts = []
    for i in range(40):
        pairs = [tuple(int(x) for x in rng.integers(0, 6, 2)) for _ in range(int(rng.integers(0, 9)))]
        facts.append(NodeFacts(f"n{i}", 6, nvlink_pairs=pairs))
    view = PlacementView(ClusterSnapshot.build(facts))
    for n, fact in enumerate(facts):
        joined = {frozenset(p) for p in fact.nvlink_pairs if p[0] != p[1]}
        for a, b in itertools.product(range(6), repeat=2):
            assert view.nvlink_matrix[n, a, b] == (frozenset((a, b)) in joined)
        for k in (2, 3, 4, 6):
            links = [sum(frozenset(p) in joined for p in itertools.combinations(c, 2))
                     for c in itertools.combinations(range(6), k)]
            assert (view.min_links(k)[n], view.max_links(k)[n]) == (min(links), max(links))


def messy_fleet(rng: np.random.Generator, nodes: int, ties: bool, identical: bool = False,
                stale: bool = False) -> ClusterSnapshot:
    """8-GPU nodes of mixed topologies with ties, NaN readings, full GPUs,
    labels and learned slowdowns (NaN ones too); ``identical``: every node
    the same (ties across all nodes); ``stale``: some stale nodes (scored by
    free GPUs; the lower bounds are off)."""
    import dataclasses

    if identical:
        facts = [NodeFacts(f"n{i:04d}", 8, labels={"zone": f"z{i % 3}"}, nvlink_pairs=TOPOLOGIES["pairs"])
                 for i in range(nodes)]
        snap = ClusterSnapshot.build(facts, util_pct=np.tile([0.0, 30.0, 10.0, 10.0, 50.0, 0.0, 20.0, 5.0], nodes))
        return snap
    snap = uniform_snapshot(rng, nodes, 8, ties)
    count = snap.gpu_count
    if not stale:
        snap.node_stale[:] = False  # stale nodes turn the lower bounds off
    snap.util_pct[rng.random(count) < 0.03] = math.nan
    snap.util_forecast_pct[:] = snap.util_pct
    snap.memory_used_mib[rng.random(count) < 0.03] = math.nan
    snap.temperature_c[rng.random(count) < 0.03] = math.nan
    labels = [{"zone": f"z{i % 3}"} for i in range(nodes)]
    snap = dataclasses.replace(snap, node_labels=labels)
    if rng.random() < 0.6:
        slow = lambda: rng.choice([0.8, 1.0, 1.0, 1.5, math.nan], count)  # noqa: E731
        snap = dataclasses.replace(snap, gpu_slowdown={"": slow(), "training": slow()})
    return snap


@pytest.mark.parametrize("seed", range(16))
@pytest.mark.parametrize("fleet", ["random", "ties", "identical", "stale"])
def test_every_set_choice_path_matches_the_general_path(seed: int, fleet: str, monkeypatch) -> None:
    """On fleets of hundreds of nodes, the set choice from sorting every node
    (exact scores), from probing and bounds (exact scores), and from node and
    GPU lower bounds (big fleets) all give the general path's placement, to
    the bit, through placements and releases (the view's per-node sums are
    patched), with ties, NVLink needs, slowdowns, NaN rows and labels; so
    does the compiled loop of ``scheduler.setsearch`` where numba is installed."""
    from scheduler import policies, setsearch

    compiled = setsearch.ready()

    rng = np.random.default_rng(2000 + seed)
    snap = messy_fleet(rng, int(rng.choice([60, 150, 300])), fleet == "ties", fleet == "identical", fleet == "stale")
    view = PlacementView(snap, res := Reservations())
    policy = make_policy("load_aware", {"nvlink": float(rng.choice([0.0, 0.5, 0.5, 3.0])),
                                        "jitter": float(rng.choice([0.0, 0.1])),
                                        "spread": float(rng.choice([0.0, 0.05]))})
    leases = []
    for i in range(14):
        k = int(rng.choice([2, 2, 3, 4, 8]))
        task = spec(task_id=f"t{i}", num_gpus=k, needs_nvlink=bool(rng.random() < 0.3),
                    vram_mib=float(rng.choice([1_024.0, 4_096.0, 12_000.0])), gpu_share=float(rng.uniform(0, 1)),
                    kind=str(rng.choice(["inference", "training"])),
                    required_node_labels={"zone": "z1"} if rng.random() < 0.15 else {},
                    preferred_node_labels={"zone": "z2"} if rng.random() < 0.2 else {})
        mask = feasible(view, task)
        reference = policy._choose_set_general(view, task, mask, policy.gpu_scores(view, task))
        # (GPU bounds from, node bounds from, sort every node up to): sort every
        # node; probe by the best GPU; probe by node bounds; GPU bounds with
        # and without node bounds
        never = 10**9
        monkeypatch.setattr(setsearch, "ready", lambda: False)
        for paths in ((never, never, never), (never, never, 0), (never, 0, 0), (0, 0, never), (0, never, never)):
            monkeypatch.setattr(policies, "_BOUNDS_MIN_GPUS", paths[0])
            monkeypatch.setattr(policies, "_NODE_BOUNDS_MIN_GPUS", paths[1])
            monkeypatch.setattr(policies, "_SORT_EVERY_NODE", paths[2])
            assert policy.choose(view, task, mask) == reference, (k, task.needs_nvlink, paths)
        monkeypatch.undo()
        if compiled:  # and the compiled loop (scheduler.setsearch)
            assert policy.choose(view, task, mask) == reference, (k, task.needs_nvlink, "compiled")
        if reference is not None:
            res.add(f"k{i}", reference.gpu_uuids, task.vram_mib, 100 * task.gpu_share,
                    [float(view.used[r]) for r in reference.rows])
            view.refresh(reference.gpu_uuids)
            policy.commit(view, reference)  # the spread term's history moves on
            leases.append(f"k{i}")
        if leases and rng.random() < 0.3:
            view.refresh(res.release(leases.pop(0)))


def test_the_compiled_set_choice_is_optional_and_can_be_turned_off() -> None:
    """GPULB_NO_JIT=1 leaves numba unused (the numpy paths decide alike, as the
    tests above check); without it, where numba is installed, ``warm``
    compiles or loads the loop and reports the seconds it took."""
    import os
    import subprocess
    import sys

    probe = "from scheduler import setsearch; print(setsearch.available(), setsearch.warm())"
    env = dict(os.environ, GPULB_NO_JIT="1")
    off = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert off.stdout.split() == ["False", "None"]
    from scheduler import setsearch

    if setsearch.ready():
        seconds = setsearch.warm()
        assert seconds is not None and seconds >= 0


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("width", [16, 40])
def test_wide_nodes_set_choice_matches_the_general_path(seed: int, width: int, set_search: str) -> None:
    """Nodes wider than the 8-rank lookup table (16- and 40-GPU hosts): rank
    masks go through the bit tricks, on both set choices."""
    rng = np.random.default_rng(500 + seed)
    snap = uniform_snapshot(rng, 30, width, ties=bool(seed % 2))
    view = PlacementView(snap, res := Reservations())
    policy = make_policy("load_aware", {"nvlink": float(rng.choice([0.5, 3.0]))})
    placed = 0
    for i in range(10):
        k = int(rng.choice([2, 3, 5, 7]))
        task = spec(task_id=f"t{i}", num_gpus=k, needs_nvlink=bool(k <= 3 and rng.random() < 0.4))
        mask = feasible(view, task)
        reference = policy._choose_set_general(view, task, mask, policy.gpu_scores(view, task))
        assert policy.choose(view, task, mask) == reference, (k, task.needs_nvlink)
        if reference is not None:
            placed += 1
            res.add(f"k{i}", reference.gpu_uuids, task.vram_mib, 100 * task.gpu_share,
                    [float(view.used[r]) for r in reference.rows])
            view.refresh(reference.gpu_uuids)
    assert placed >= 5


_AOT_CHECK = """
import sys
import numpy as np
sys.path.insert(0, "tests")
from test_sched_policies import messy_fleet, spec
from scheduler import setsearch
from scheduler.filters import feasible
from scheduler.policies import make_policy
from scheduler.reservations import Reservations
from scheduler.view import PlacementView

assert setsearch.ready() and setsearch.mode == "aot", (setsearch.mode, setsearch.failure)
compared = 0
for seed in range(6):
    rng = np.random.default_rng(7000 + seed)
    view = PlacementView(messy_fleet(rng, 150, seed % 2 == 0, False, seed == 5), res := Reservations())
    name = ["load_aware", "binpack", "least_connections", "round_robin", "weighted_round_robin", "load_aware"][seed]
    policy = make_policy(name, {"nvlink": float(rng.choice([0.5, 3.0]))})
    for i in range(12):
        k = int(rng.choice([2, 3, 4]))
        task = spec(task_id=f"t{i}", num_gpus=k, needs_nvlink=bool(rng.random() < 0.3),
                    gpu_share=float(rng.uniform(0, 1)), vram_mib=float(rng.choice([1024.0, 12000.0])))
        mask = feasible(view, task)
        reference = policy._choose_set_general(view, task, mask, policy.gpu_scores(view, task))
        assert policy.choose(view, task, mask) == reference, (seed, i, k)
        compared += 1
        if reference is not None:
            res.add(f"k{i}", reference.gpu_uuids, task.vram_mib, 100 * task.gpu_share,
                    [float(view.used[r]) for r in reference.rows])
            view.refresh(reference.gpu_uuids)
# the second kernel of the build: the oom_risk term, equal to its numpy path
from scheduler import memgrowth
table = memgrowth.GrowthTable.from_ratios(np.random.default_rng(1).lognormal(0.0, 0.2, 300))
free = np.random.default_rng(2).uniform(-100.0, 30_000.0, 5_000)
free[::97] = np.nan
compiled, plain = np.zeros(5_000), np.zeros(5_000)
table.add_risk(compiled, free, 9_000.0, 2.0)
memgrowth._COMPILED_MIN_ROWS = 10**9
table.add_risk(plain, free, 9_000.0, 2.0)
assert compiled.tolist() == plain.tolist() and compiled.max() > 0
# the third: the fgd policy's one-GPU fragmentation change, equal to its numpy path
from scheduler import fragmentation
mix = fragmentation.WorkloadMix()
for k, v, s in [(1, 4000.0, 0.3), (1, 9000.0, 0.5), (1, 13107.0, 1.0), (2, 13107.0, 1.0), (4, 13107.0, 1.0)] * 3:
    mix.observe_shape(k, v, s)
task = spec(task_id="frag", vram_mib=5000.0, gpu_share=0.4)
got = fragmentation.fragmentation_delta(view, task, mix.shapes(), compiled=True)
assert setsearch.frag_kernel() is not None
assert got.tolist() == fragmentation.fragmentation_delta(view, task, mix.shapes(), compiled=False).tolist()
print("AOT_OK", compared, "numba" in sys.modules)
"""


@pytest.mark.timeout(300)
def test_the_ahead_of_time_build_places_as_the_general_path(aot_build) -> None:
    """``gpulb set-search build`` compiles the same kernel to a C extension:
    loaded from GPULB_AOT_DIR without importing numba, it places as the
    general path does, to the bit."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, GPULB_AOT_DIR=str(aot_build))
    result = subprocess.run([sys.executable, "-c", _AOT_CHECK], cwd=root, env=env, capture_output=True, text=True,
                            timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "AOT_OK 72 False" in result.stdout


def test_set_search_status_says_how_the_search_runs(aot_build) -> None:
    """``gpulb set-search status``: the operator's check of which form runs."""
    import os
    import subprocess
    import sys

    def status(**env: str) -> str:
        result = subprocess.run([sys.executable, "-m", "coordinator.cli", "set-search", "status"],
                                env=dict(os.environ, **env), capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        return result.stdout.strip()

    assert status(GPULB_NO_JIT="1") == "set search: numpy"
    assert status(GPULB_AOT_DIR=str(aot_build)).startswith("set search: aot (loaded in ")


def test_load_aware_spread_rotates_equally_idle_gpus_and_is_off_by_default() -> None:
    """With ``spread`` > 0 a GPU just chosen yields to an equally good one
    not chosen lately (``scheduler.scoring``, R); at 0 (the default) the
    lowest row wins every tie, as before. The breakdown shows the term."""
    snap = ClusterSnapshot.build([NodeFacts(f"n{i}", 2) for i in range(3)], util_pct=[0.0] * 6)

    def rows_chosen(weights: dict, count: int) -> list[int]:
        view = PlacementView(snap, res := Reservations())
        policy = make_policy("load_aware", weights)
        out = []
        for i in range(count):
            task = spec(task_id=f"t{i}", vram_mib=1_000.0, gpu_share=0.0)
            placement = policy.choose(view, task, feasible(view, task))
            policy.commit(view, placement)
            out.append(placement.rows[0])
            if weights.get("spread"):
                # the sixth goes to the last GPU never chosen (R = 0); the
                # seventh and eighth to those chosen 5 placements before, of 6
                # GPUs (R = 1 - 5/6)
                if i == 5:
                    assert placement.score.terms["spread"] == 0.0
                if i in (6, 7):
                    assert placement.score.terms["spread"] == pytest.approx(0.05 * (1 - 5 / 6))
                assert placement.score.total == pytest.approx(sum(placement.score.terms.values()))
            else:
                assert "spread" not in placement.score.terms
            # placed and finished at once: the GPUs stay equally idle
            res.add(f"k{i}", placement.gpu_uuids, task.vram_mib, 0.0, [0.0])
            view.refresh(res.release(f"k{i}"))
        return out

    assert rows_chosen({}, 6) == [0, 0, 0, 0, 0, 0]
    assert rows_chosen({"spread": 0.05}, 6) == [0, 1, 2, 3, 4, 5]
    # after a full round the least recently chosen comes first again
    assert rows_chosen({"spread": 0.05}, 8)[6:] == [0, 1]


def test_a_broken_ahead_of_time_build_falls_back_to_the_jit(tmp_path) -> None:
    """An extension that cannot load (say, built against another numpy) is
    skipped for the JIT, not taken for a reason to give up on compiling."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from scheduler import setsearch

    if not setsearch.available():
        pytest.skip("numba is not installed")
    (tmp_path / f"{setsearch.AOT_MODULE}.cpython-311-x86_64-linux-gnu.so").write_bytes(b"not an ELF file")
    probe = "from scheduler import setsearch; print(setsearch.ready(), setsearch.mode, setsearch.failure)"
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-c", probe], cwd=root, capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, GPULB_AOT_DIR=str(tmp_path)))
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["True", "jit", "None"]
