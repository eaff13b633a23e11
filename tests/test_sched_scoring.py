"""Score terms, table-tested one by one, and the load-aware sum they make."""

from __future__ import annotations

import math

import numpy as np
import pytest

from scheduler.config import SchedulerConfig
from scheduler.filters import feasible
from scheduler.policies import LoadAware
from scheduler.scoring import (
    LOAD_AWARE_WEIGHTS,
    load_aware_scores,
    memory_pressure,
    predicted_load,
    response_time_term,
    stale_score,
    temperature_penalty,
)
from scheduler.snapshot import ClusterSnapshot, NodeFacts
from scheduler.task import TaskSpec
from scheduler.view import PlacementView

NAN = math.nan
TOTAL = 24_564.0


@pytest.mark.parametrize(
    "frac, expected",
    [(0.0, 0.0), (0.5, 0.0), (0.70, 0.0), (0.775, 0.5), (0.82, 0.8), (0.85, 1.0), (0.99, 1.0)],
)
def test_memory_pressure_rises_linearly_in_the_warning_band(frac: float, expected: float) -> None:
    assert memory_pressure(np.array([frac]), 0.70, 0.85)[0] == pytest.approx(expected)


@pytest.mark.parametrize(
    "temp, expected", [(20.0, 0.0), (60.0, 0.0), (72.5, 0.5), (85.0, 1.0), (99.0, 1.0), (NAN, 1.0)]
)
def test_temperature_penalty_above_60(temp: float, expected: float) -> None:
    assert temperature_penalty(np.array([temp]), 60.0, 85.0)[0] == pytest.approx(expected)


@pytest.mark.parametrize(
    "values, expected",
    [
        ([1.0, NAN, 3.0], [0.2, 0.4, 0.6]),  # NaN -> median of the known (2 s)
        ([NAN, NAN], [0.0, 0.0]),
        ([10.0, 0.0], [1.0, 0.0]),
    ],
)
def test_response_time_term(values: list[float], expected: list[float]) -> None:
    assert response_time_term(np.array(values), 5.0).tolist() == pytest.approx(expected)


@pytest.mark.parametrize(
    "util, reserved, share, expected",
    [(30.0, 20.0, 0.1, 0.6), (0.0, 0.0, 0.0, 0.0), (NAN, 0.0, 0.5, 1.5), (90.0, 50.0, 1.0, 2.4)],
)
def test_predicted_load(util: float, reserved: float, share: float, expected: float) -> None:
    assert predicted_load(np.array([util]), np.array([reserved]), share)[0] == pytest.approx(expected)


@pytest.mark.parametrize("free, gpus, expected", [(8, 8, 1.0), (4, 8, 1.5), (0, 8, 2.0), (0, 0, 2.0)])
def test_stale_score_by_free_gpu_count(free: int, gpus: int, expected: float) -> None:
    assert stale_score(np.array([free]), np.array([gpus]), 1.0)[0] == pytest.approx(expected)


def one_gpu(*, util=0.0, used=0.0, temp=40.0, active=0, rt=NAN, labels=None, stale=False) -> ClusterSnapshot:
    snap = ClusterSnapshot.build(
        [NodeFacts("n0", 1, response_time_s=rt, labels=labels or {}, stale=stale)],
        util_pct=[util],
        memory_used_mib=[used],
        temperature_c=[temp],
    )
    snap.active_tasks[:] = active
    return snap


SPEC = TaskSpec("t", vram_mib=2_000.0, gpu_share=0.25)
W = LOAD_AWARE_WEIGHTS


@pytest.mark.parametrize(
    "snap, spec, expected",
    [
        ("idle", SPEC, W["load"] * 0.25),
        ("util 40", SPEC, W["load"] * 0.65),
        ("util NaN counts as 100 %", SPEC, W["load"] * 1.25),
        ("memory 80 % after placement", SPEC, W["load"] * 0.25 + W["memory"] * (0.80 - 0.70) / 0.15),
        ("70 C", SPEC, W["load"] * 0.25 + W["temperature"] * 0.4),
        ("temperature NaN", SPEC, W["load"] * 0.25 + W["temperature"] * 1.0),
        ("3 active tasks", SPEC, W["load"] * 0.25 + W["jitter"] * 3),
        ("response 2.5 s", SPEC, W["load"] * 0.25 + W["response_time"] * 0.5),
        ("preferred label", TaskSpec("t", vram_mib=2_000.0, gpu_share=0.25, preferred_node_labels={"ssd": "yes", "x": "y"}),
         W["load"] * 0.25 - W["preferred_labels"] * 0.5),
        ("stale, idle", SPEC, W["stale"] * 1.0),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_load_aware_score_table(snap: str, spec: TaskSpec, expected: float) -> None:
    used_80 = 0.80 * TOTAL - 2_000.0
    snapshots = {
        "idle": one_gpu(),
        "util 40": one_gpu(util=40.0),
        "util NaN counts as 100 %": one_gpu(util=NAN),
        "memory 80 % after placement": one_gpu(used=used_80),
        "70 C": one_gpu(temp=70.0),
        "temperature NaN": one_gpu(temp=NAN),
        "3 active tasks": one_gpu(active=3),
        "response 2.5 s": one_gpu(rt=2.5),
        "preferred label": one_gpu(labels={"ssd": "yes"}),
        "stale, idle": one_gpu(stale=True, util=99.0, temp=99.0),
    }
    view = PlacementView(snapshots[snap], None, SchedulerConfig(use_forecast=False))
    assert load_aware_scores(view, spec, W)[0] == pytest.approx(expected)


def test_breakdown_terms_add_up_to_the_total() -> None:
    snap = ClusterSnapshot.build(
        [NodeFacts("a", 2, response_time_s=1.0, labels={"ssd": "yes"}), NodeFacts("b", 2, stale=True)],
        util_pct=[50.0, 20.0, 0.0, 0.0],
        memory_used_mib=[15_000.0, 12_000.0, 0.0, 0.0],
        temperature_c=[70.0, 66.0, 40.0, 40.0],
    )
    snap.active_tasks[:] = [2, 1, 0, 0]
    spec = TaskSpec("t", vram_mib=4_000.0, gpu_share=0.3, preferred_node_labels={"ssd": "yes"})
    view = PlacementView(snap)
    placement = LoadAware().choose(view, spec, feasible(view, spec))
    assert placement is not None
    terms = placement.score.terms
    assert set(terms) == {"load", "memory", "temperature", "jitter", "response_time", "preferred_labels"}
    assert sum(terms.values()) == pytest.approx(placement.score.total)
    assert placement.score.candidates == 4 and placement.score.policy == "load_aware"


def test_fresh_wins_ties_and_emptier_stale_nodes_win_among_stale() -> None:
    snap = ClusterSnapshot.build(
        [NodeFacts("fresh", 1), NodeFacts("stale-busy", 2, stale=True), NodeFacts("stale-empty", 2, stale=True)],
        util_pct=[0.0, 0, 0, 0, 0],
    )
    snap.active_tasks[:] = [0, 1, 0, 0, 0]
    spec = TaskSpec("t", vram_mib=1_000.0, gpu_share=0.25)
    view = PlacementView(snap)
    scores = load_aware_scores(view, spec, W)
    # idle everywhere: the stale floor makes the fresh GPU win
    assert scores[0] == pytest.approx(0.25)
    assert scores[2] == pytest.approx(1.5) and scores[3] == pytest.approx(1.0)
    assert LoadAware().choose(view, spec, feasible(view, spec)).node_id == "fresh"
    # a fresh GPU loaded past the floor loses to the emptiest stale node, not the busier one
    snap.util_pct[0] = snap.util_forecast_pct[0] = 90.0
    view = PlacementView(snap)
    assert LoadAware().choose(view, spec, feasible(view, spec)).node_id == "stale-empty"


def test_nothing_feasible_means_no_placement() -> None:
    snap = one_gpu(used=24_000.0)
    view = PlacementView(snap)
    assert LoadAware().choose(view, SPEC, feasible(view, SPEC)) is None


@pytest.mark.parametrize("seed", range(8))
def test_scores_of_some_rows_are_those_of_all_rows_to_the_bit(seed: int) -> None:
    rng = np.random.default_rng(seed)
    nodes = [
        NodeFacts(f"n{i}", 4, labels={"zone": f"z{i % 3}"}, stale=bool(rng.random() < 0.2),
                  response_time_s=float(rng.choice([NAN, 0.5, 2.0])))
        for i in range(12)
    ]
    count = 48
    snap = ClusterSnapshot.build(
        nodes,
        util_pct=np.where(rng.random(count) < 0.1, NAN, rng.uniform(0, 100, count)),
        memory_used_mib=np.where(rng.random(count) < 0.1, NAN, rng.uniform(0, 24_000, count)),
        temperature_c=np.where(rng.random(count) < 0.1, NAN, rng.uniform(30, 90, count)),
    )
    snap.active_tasks[:] = rng.integers(0, 4, count)
    view = PlacementView(snap)
    weights = dict(W, jitter=float(rng.choice([0.0, 0.1])))
    for i in range(10):
        spec = TaskSpec(f"t{i}", vram_mib=float(rng.uniform(100, 8_000)), gpu_share=float(rng.uniform(0, 1)),
                        preferred_node_labels={"zone": "z1"} if i % 2 else {})
        rows = np.sort(rng.choice(count, int(rng.integers(1, count)), replace=False))
        every = load_aware_scores(view, spec, weights)
        assert np.array_equal(load_aware_scores(view, spec, weights, rows), every[rows], equal_nan=True)
        assert np.array_equal(LoadAware(weights).gpu_scores_at(view, spec, rows), every[rows], equal_nan=True)


@pytest.mark.parametrize("seed", range(6))
def test_node_bounds_are_lower_bounds_kept_current_by_refresh(seed: int) -> None:
    """``load_aware_node_bounds``: per node, at most the mean score of any k of
    its GPUs (the k lowest, exactly scored), from running sums the view keeps
    sorted per node; after placements and releases they equal a fresh view's."""
    import dataclasses

    from scheduler.reservations import Reservations
    from scheduler.scoring import load_aware_node_bounds

    rng = np.random.default_rng(seed)
    width = int(rng.choice([2, 4, 8]))
    nodes = [NodeFacts(f"n{i}", width, labels={"zone": f"z{i % 3}"}) for i in range(30)]
    count = 30 * width
    snap = ClusterSnapshot.build(
        nodes,
        util_pct=np.where(rng.random(count) < 0.1, NAN, rng.choice([0.0, 50.0], count) if seed % 2 else rng.uniform(0, 100, count)),
        memory_used_mib=rng.uniform(0, 20_000, count),
        temperature_c=np.where(rng.random(count) < 0.1, NAN, rng.uniform(30, 80, count)),
    )
    snap.active_tasks[:] = rng.integers(0, 3, count)
    if seed % 3 == 0:  # learned slowdowns (NaN ones too): the completion term
        snap = dataclasses.replace(snap, gpu_slowdown={"": rng.choice([0.8, 1.0, 1.5, NAN], count)})
    res = Reservations()
    view = PlacementView(snap, res)
    weights = dict(W, jitter=float(rng.choice([0.0, 0.1])))
    leases = []
    for i in range(12):
        k = int(rng.integers(1, width + 1))
        spec = TaskSpec(f"t{i}", num_gpus=k, vram_mib=float(rng.uniform(100, 8_000)), gpu_share=float(rng.uniform(0, 1)),
                        preferred_node_labels={"zone": "z1"} if i % 2 else {})
        bound = load_aware_node_bounds(view, spec, weights, k)
        best_k = np.sort(load_aware_scores(view, spec, weights).reshape(30, width), axis=1)[:, :k].mean(axis=1)
        assert np.all(bound <= best_k + 1e-9)
        fresh = PlacementView(snap, res)
        assert np.allclose(load_aware_node_bounds(fresh, spec, weights, k), bound, rtol=0, atol=1e-12)
        # a placement on some node, and now and then a release
        node = int(rng.integers(0, 30))
        gpus = [snap.gpu_uuid[node * width + g] for g in rng.choice(width, k, replace=False)]
        res.add(f"l{i}", gpus, 2_000.0, 30.0, [0.0] * k)
        view.refresh(gpus)
        leases.append(f"l{i}")
        if rng.random() < 0.4:
            view.refresh(res.release(leases.pop(0)))
    assert load_aware_node_bounds(view, TaskSpec("x", num_gpus=width + 1), weights, width + 1) is None


def test_node_sorted_sums_count_nan_as_minus_inf() -> None:
    snap = ClusterSnapshot.build([NodeFacts("a", 2), NodeFacts("b", 2)])
    view = PlacementView(snap)
    column = np.array([3.0, NAN, 2.0, 1.0])
    sums = view.node_sorted_sums("test", lambda v, rows: column[rows])
    assert sums[0, 0] == -math.inf and sums[1].tolist() == [1.0, 3.0]
    assert PlacementView(ClusterSnapshot.build([NodeFacts("a", 2), NodeFacts("b", 1)])).node_sorted_sums(
        "test", lambda v, rows: np.zeros(3)[rows]) is None
