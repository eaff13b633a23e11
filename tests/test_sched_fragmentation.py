"""Fragmentation-aware placement (``fgd``): the arriving mix, the per-GPU
change of fragmentation against a brute-force recount, and choices worked out
by hand where the tightest fit (binpack) breaks the room a bigger task needs."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from scheduler.config import SchedulerConfig
from scheduler.engine import Scheduler
from scheduler.filters import feasible
from scheduler import setsearch
from scheduler.fragmentation import WorkloadMix, free_resources, fragmentation_delta, node_fragmentation
from scheduler.policies import make_policy
from scheduler.snapshot import ClusterSnapshot, NodeFacts
from scheduler.task import TaskSpec, TaskState
from scheduler.view import PlacementView

GIB = 1024.0
TOTAL = 24 * GIB
USABLE = 0.85 * TOTAL  # the memory_threshold filter's limit at its default 85 %


def spec(task_id: str = "t", **changes) -> TaskSpec:
    base = dict(task_id=task_id, vram_mib=2 * GIB, gpu_share=0.5)
    base.update(changes)
    return TaskSpec(**base)


def mix_of(*shapes: tuple[int, float, float, int]) -> WorkloadMix:
    """A mix from (num_gpus, vram MiB, share, arrivals), all at once."""
    mix = WorkloadMix()
    for k, v, share, n in shapes:
        for _ in range(n):
            mix.observe_shape(k, v, share)
    return mix


# ---- the mix -----------------------------------------------------------------------------------------


def test_an_arrival_half_life_ago_weighs_half_of_one_now() -> None:
    mix = WorkloadMix(half_life=100)
    mix.observe_shape(1, 4 * GIB, 0.5)
    for _ in range(99):
        mix.observe_shape(1, 8 * GIB, 0.5)
    mix.observe_shape(2, 16 * GIB, 1.0)  # 100 arrivals after the first
    p = mix.probabilities()
    assert p[(1, 4 * GIB, 0.5)] / p[(2, 16 * GIB, 1.0)] == pytest.approx(0.5)
    assert sum(p.values()) == pytest.approx(1.0)


def test_shapes_round_up_and_the_lightest_shape_goes_first() -> None:
    mix = WorkloadMix(max_shapes=2)
    mix.observe_shape(1, 1000.0, 0.32)
    mix.observe_shape(1, 1020.0, 0.315)  # the same 1,024 MiB / 0.32 bucket
    mix.observe_shape(4, 13_107.0, 1.0)  # up to 13,184: a shape never fits where its task would not
    assert set(mix.probabilities()) == {(1, 1024.0, 0.32), (4, 13_184.0, 1.0)}
    mix.observe_shape(8, 13_107.0, 1.0)  # a third shape: the lightest (the 4-GPU one, seen once) leaves
    assert set(mix.probabilities()) == {(1, 1024.0, 0.32), (8, 13_184.0, 1.0)}


def test_a_new_shape_shows_at_once_known_ones_every_percent_of_a_half_life() -> None:
    mix = mix_of((1, 4 * GIB, 0.5, 1))
    first = mix.shapes()
    mix.observe_shape(1, 4 * GIB, 0.5)
    assert mix.shapes() is first  # a known shape: the arrays wait
    mix.observe_shape(2, 8 * GIB, 1.0)
    assert mix.shapes() is not first and mix.shapes().multi  # a new one: at once
    rebuilt = mix.shapes()
    for _ in range(20):  # 1 % of the 2,000-arrival half-life
        mix.observe_shape(1, 4 * GIB, 0.5)
    assert mix.shapes() is not rebuilt


def test_the_scheduler_counts_what_it_queues_not_what_it_rejects_and_keeps_it_across_swaps() -> None:
    ids = (f"lease-{i}" for i in itertools.count())
    sched = Scheduler(SchedulerConfig(policy="fgd"), clock=lambda: 0.0, lease_ids=lambda: next(ids))
    snap = ClusterSnapshot.build([NodeFacts("a", 2, memory_total_mib=TOTAL)])
    sched.submit(spec("small", vram_mib=4 * GIB), snap)
    assert sched.submit(spec("huge", vram_mib=40 * GIB), snap).state == TaskState.REJECTED
    assert sched.workload_mix.probabilities() == {(1, 4 * GIB, 0.5): 1.0}
    sched.set_policy("binpack")
    sched.set_policy("fgd")
    assert sched._policy.workload_mix is sched.workload_mix


# ---- the per-GPU change against a recount ----------------------------------------------------------


def _random_view(rng: np.random.Generator) -> PlacementView:
    nodes = [NodeFacts(f"n{i}", int(rng.integers(1, 6)), memory_total_mib=TOTAL) for i in range(int(rng.integers(1, 6)))]
    count = sum(n.gpus for n in nodes)

    def column(top: float) -> list[float]:  # some at 0, some at the top, some unknown, the rest between
        kind = rng.integers(0, 4, count)
        between = np.where(kind == 2, np.round(rng.random(count) * top, 2), np.nan)
        return list(np.where(kind == 0, 0.0, np.where(kind == 1, top, between)))

    return PlacementView(ClusterSnapshot.build(nodes, memory_used_mib=column(TOTAL), util_pct=column(100.0)))


def _random_mix(rng: np.random.Generator) -> WorkloadMix:
    return mix_of(
        *[(1, float(rng.integers(1, 20) * GIB), float(rng.integers(1, 11) / 10), int(rng.integers(1, 5))) for _ in range(3)],
        *[(int(k), float(rng.integers(4, 20) * GIB), float(rng.choice([0.5, 1.0])), int(rng.integers(1, 5))) for k in rng.integers(2, 6, 2)],
    )


@pytest.mark.parametrize("seed", range(40))
def test_the_change_is_the_recounted_fragmentation_difference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    view = _random_view(rng)
    shapes = _random_mix(rng).shapes()
    memory, share = free_resources(view)

    def recount(rows, task) -> float:
        after_m, after_s = memory.copy(), share.copy()
        after_m[rows] = np.maximum(after_m[rows] - task.vram_mib, 0.0)
        after_s[rows] = np.maximum(after_s[rows] - task.gpu_share, 0.0)
        return node_fragmentation(after_m, after_s, view.node, view.node_count, shapes)

    before = node_fragmentation(memory, share, view.node, view.node_count, shapes)
    for k in (1, 2, 3):
        task = spec(num_gpus=k, vram_mib=float(rng.integers(1, 16) * GIB), gpu_share=float(rng.integers(1, 11) / 10))
        for compiled in (False, True):
            delta = fragmentation_delta(view, task, shapes, compiled=compiled)
            for n in range(view.node_count):
                rows = np.flatnonzero(view.node == n)
                fitting = [r for r in sorted(rows, key=lambda r: (memory[r], r)) if memory[r] >= task.vram_mib]
                if k == 1:
                    for r in rows:  # the task on that GPU alone
                        assert delta[r] == pytest.approx(recount([r], task)[n] - before[n], abs=1e-9)
                elif len(fitting) >= k:  # on the node's k fullest GPUs with room
                    assert delta[rows] == pytest.approx(recount(fitting[:k], task)[n] - before[n], abs=1e-9)
                else:
                    assert (delta[rows] > 1e6).all()  # no set there


@pytest.mark.skipif(not setsearch.ready(), reason=f"no compiled kernels here: {setsearch.failure}")
@pytest.mark.parametrize("seed", range(40))
def test_the_compiled_loop_gives_the_numpy_result_to_the_bit(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    view = _random_view(rng)
    shapes = _random_mix(rng).shapes()
    task = spec(vram_mib=float(rng.integers(1, 16) * GIB), gpu_share=float(rng.integers(0, 11) / 10))
    np.testing.assert_array_equal(
        fragmentation_delta(view, task, shapes, compiled=True), fragmentation_delta(view, task, shapes, compiled=False)
    )


# ---- choices worked out by hand --------------------------------------------------------------------


def two_by_two(used: list[float], util: list[float] | None = None) -> PlacementView:
    nodes = [NodeFacts("a", 2, memory_total_mib=TOTAL), NodeFacts("b", 2, memory_total_mib=TOTAL)]
    return PlacementView(ClusterSnapshot.build(nodes, memory_used_mib=used, util_pct=util))


def test_a_small_task_goes_where_it_leaves_no_fragment_not_to_the_tightest_fit() -> None:
    # memory room: GPU a0 9 GiB, b0 16 GiB, the others none; all idle. The mix:
    # 8 GiB tasks of half a GPU. A 2 GiB task of 0.2 on a0 (binpack's tightest
    # fit) leaves 7 GiB and 0.8 of its compute that no task of the mix can
    # use; on b0 it leaves 14 GiB, room for one: fgd takes b0.
    view = two_by_two([USABLE - 9 * GIB, TOTAL, USABLE - 16 * GIB, TOTAL])
    task = spec(vram_mib=2 * GIB, gpu_share=0.2)
    fgd = make_policy("fgd")
    fgd.workload_mix = mix_of((1, 8 * GIB, 0.5, 10))
    chosen = fgd.choose(view, task, feasible(view, task))
    assert chosen.gpu_uuids == ("GPU-b-0",)
    assert chosen.score.terms["fragmentation"] == pytest.approx(0.0)
    assert make_policy("binpack").choose(view, task, feasible(view, task)).gpu_uuids == ("GPU-a-0",)
    assert fragmentation_delta(view, task, fgd.workload_mix.shapes())[0] == pytest.approx(0.8)


def test_without_a_mix_the_task_itself_stands_for_it() -> None:
    view = two_by_two([USABLE - 9 * GIB, TOTAL, USABLE - 16 * GIB, TOTAL])
    task = spec(vram_mib=5 * GIB, gpu_share=0.5)  # on a0 it leaves 4 GiB: too little for another like it
    assert make_policy("fgd").choose(view, task, feasible(view, task)).gpu_uuids == ("GPU-b-0",)


@pytest.mark.parametrize("overcommit, chosen", [(1.0, "GPU-b-0"), (0.0, "GPU-a-0")])
def test_sharing_a_busy_gpus_compute_is_counted_against_it(overcommit: float, chosen: str) -> None:
    # a0 has plenty of memory but 90 % of its compute is in use; b0 is idle. A
    # task of half a GPU on a0 takes its last 0.1 (a fragment gone: dF = -0.1)
    # and shares 0.4 it does not have; on b0 it leaves 0.5, room for another
    # like it (dF = 0). Counted, the overcommit (0.4) sends it to b0.
    view = two_by_two([0.0, TOTAL, 0.0, TOTAL], util=[90.0, 0.0, 0.0, 0.0])
    task = spec(vram_mib=4 * GIB, gpu_share=0.5)
    policy = make_policy("fgd", {"overcommit": overcommit})
    got = policy.choose(view, task, feasible(view, task))
    assert got.gpu_uuids == (chosen,)
    if chosen == "GPU-a-0":
        assert got.score.terms["fragmentation"] == pytest.approx(-0.1)


@pytest.mark.parametrize("policy, quad_placed", [("fgd", True), ("binpack", False)])
def test_a_pair_takes_the_half_used_node_so_a_whole_node_stays_for_four(policy: str, quad_placed: bool) -> None:
    # node b (first in rows) is empty; on node a other processes hold 20 GiB of
    # GPUs 0 and 1. A 2-GPU task of whole GPUs (13 GiB) fits a's GPUs 2, 3 or
    # any two of b's; a 4-GPU one only b. Worked out (GPUs, mix about 1/2 each):
    # on a, F goes 0.5 * (4 -> 2) + 0.5 * (2 -> 2) = -1 (its two GPUs without
    # the memory were already unusable); on b, 0.5 * (0 -> 2) + 0.5 * (0 -> 0)
    # = +1. binpack sees equal room on the four empty GPUs and takes the first rows: b.
    ids = (f"lease-{i}" for i in itertools.count())
    sched = Scheduler(SchedulerConfig(policy=policy), clock=lambda: 0.0, lease_ids=lambda: next(ids))
    nodes = [NodeFacts("b", 4, memory_total_mib=TOTAL), NodeFacts("a", 4, memory_total_mib=TOTAL)]
    snap = ClusterSnapshot.build(nodes, memory_used_mib=[0.0] * 4 + [20 * GIB] * 2 + [0.0] * 2)
    sched.submit(spec("pair", num_gpus=2, vram_mib=13 * GIB, gpu_share=1.0), snap)
    sched.submit(spec("quad", num_gpus=4, vram_mib=13 * GIB, gpu_share=1.0), snap)
    sched.dispatch(snap)
    pair, quad = sched.get("pair"), sched.get("quad")
    assert pair.state == TaskState.LEASED
    assert pair.assignment.node_id == ("a" if quad_placed else "b")
    assert (quad.state == TaskState.LEASED) is quad_placed
    if quad_placed:
        assert quad.assignment.node_id == "b"
        assert pair.assignment.score.terms["fragmentation"] == pytest.approx(-1.0, rel=2e-3)
    else:
        assert "no node has 4" in quad.reason


def test_learned_growth_keeps_a_whole_gpu_task_off_the_card_it_would_outgrow() -> None:
    # two idle cards: 16 GiB (13,926 MiB usable) and 24 GiB with 4,000 MiB used
    # by others. Packing takes the small one, the tightest fit; once every
    # ended training task grew to 1.3x (17,039 MiB, over the small card's
    # 16,384), the learned risk (weight 2, as load_aware's) sends it to the big one.
    from scheduler.memgrowth import GrowthTable
    from scheduler.predictor import ANY_KIND

    def view(growth=None) -> PlacementView:
        snap = ClusterSnapshot.build(
            [NodeFacts("small", 1, model="Tesla T4", memory_total_mib=16_384.0),
             NodeFacts("big", 1, model="RTX 4090", memory_total_mib=24_576.0)],
            memory_used_mib=[0.0, 4_000.0],
        )
        if growth is not None:
            snap.memory_growth = growth
        return PlacementView(snap)

    task = spec(vram_mib=13_107.0, gpu_share=1.0, kind="training")
    fgd = make_policy("fgd")
    blind = view()
    assert fgd.choose(blind, task, feasible(blind, task)).node_id == "small"
    learned = view({ANY_KIND: GrowthTable.from_ratios([1.3] * 20), "training": GrowthTable.from_ratios([1.3] * 20)})
    chosen = fgd.choose(learned, task, feasible(learned, task))
    assert chosen.node_id == "big" and chosen.score.terms["oom_risk"] == 0.0
    small = fgd.terms(learned, task, [0], fgd.gpu_scores(learned, task))
    assert small["oom_risk"] == pytest.approx(2.0)


def test_when_every_gpu_is_past_its_compute_the_least_overloaded_takes_more() -> None:
    # both GPUs with room hold 24 GiB cards' worth of shared work: a0 at 150 %
    # of its compute (readings 100 % plus 50 % reserved), b0 at 100 %. No
    # fragment anywhere changes (no compute is free); a0 has the tighter
    # memory fit, but adding half a GPU there leaves 2.0 GPUs of demand on
    # one, against 1.5 on b0.
    from scheduler.reservations import Reservations

    snap = ClusterSnapshot.build(
        [NodeFacts("a", 2, memory_total_mib=TOTAL), NodeFacts("b", 2, memory_total_mib=TOTAL)],
        memory_used_mib=[8 * GIB, TOTAL, 4 * GIB, TOTAL], util_pct=[100.0, 0.0, 100.0, 0.0],
    )
    res = Reservations()
    res.add("busy", ("GPU-a-0",), 1 * GIB, 50.0, [8 * GIB])
    view = PlacementView(snap, res)
    task = spec(vram_mib=2 * GIB, gpu_share=0.5)
    chosen = make_policy("fgd").choose(view, task, feasible(view, task))
    assert chosen.gpu_uuids == ("GPU-b-0",)
    assert chosen.score.terms["overcommit"] == pytest.approx(0.5)
    assert make_policy("binpack").choose(view, task, feasible(view, task)).gpu_uuids == ("GPU-a-0",)


@pytest.mark.parametrize("speed, chosen", [(0.0, "slow"), (2.0, "fast"), (None, "fast")])
def test_with_learned_speeds_the_gpu_that_finishes_sooner_wins_among_equal_fragments(speed: float | None, chosen: str) -> None:
    # two idle 24 GiB cards, the first in rows three times slower for the
    # task's kind (the predictor's slowdown column). The fragment either
    # leaves is the same, so without the speed term the lowest row wins; with
    # it the task loses 2/3 of its speed on the slow card, w * (1 - 1/3)
    # against it, and fgd takes the fast one (None: the default weights).
    import dataclasses

    snap = ClusterSnapshot.build([NodeFacts("slow", 1, memory_total_mib=TOTAL), NodeFacts("fast", 1, memory_total_mib=TOTAL)],
                                 memory_used_mib=[0.0, 0.0])
    view = PlacementView(dataclasses.replace(snap, gpu_slowdown={"": np.asarray([3.0, 1.0]), "training": np.asarray([3.0, 1.0])}))
    task = spec(vram_mib=8 * GIB, gpu_share=0.5, kind="training")
    fgd = make_policy("fgd", None if speed is None else {"speed": speed})
    fgd.workload_mix = mix_of((1, 8 * GIB, 0.5, 10))
    weight = fgd.weights["speed"]
    got = fgd.choose(view, task, feasible(view, task))
    assert got.node_id == chosen
    scores = fgd.gpu_scores(view, task)
    if weight:
        assert fgd.terms(view, task, [0], scores)["speed"] == pytest.approx(weight * (1 - 1 / 3))
        assert got.score.terms["speed"] == pytest.approx(0.0)
        # the fragment terms are the same on both: only the speed term differs
        assert scores[0] - scores[1] == pytest.approx(weight * (1 - 1 / 3))
    else:
        assert "speed" not in got.score.terms and scores[0] == pytest.approx(scores[1])
    # without learned speeds the term is absent whatever its weight
    plain = PlacementView(snap)
    assert "speed" not in fgd.choose(plain, task, feasible(plain, task)).score.terms


@pytest.mark.parametrize("fill, learned, chosen", [(None, True, "big"), (0.0, True, "small"), (None, False, "small")])
def test_a_task_that_alone_nearly_fills_a_card_goes_to_a_bigger_one_once_growth_is_learned(
    fill: float | None, learned: bool, chosen: str
) -> None:
    # two idle cards, 16 GiB and 24 GiB, and a whole-GPU ask of 13,107 MiB: 80 %
    # of the small card, past its 70 % warn level, and 53 % of the big one.
    # Every run learned so far ended at its ask (the learned risk of outgrowing
    # either card is 0), so only the fill term tells them apart: on the small
    # card w * (0.8 - 0.7) / (0.85 - 0.7) = 2/3 w, on the big one 0. Without it
    # packing takes the tightest fit; with nothing learned it is not applied.
    from scheduler.memgrowth import GrowthTable
    from scheduler.predictor import ANY_KIND

    snap = ClusterSnapshot.build(
        [NodeFacts("small", 1, model="Tesla T4", memory_total_mib=16_384.0),
         NodeFacts("big", 1, model="RTX 4090", memory_total_mib=24_576.0)],
        memory_used_mib=[0.0, 0.0],
    )
    if learned:
        snap.memory_growth = {ANY_KIND: GrowthTable.from_ratios([1.0] * 20),
                              "inference": GrowthTable.from_ratios([1.0] * 20)}
    view = PlacementView(snap)
    task = spec(vram_mib=13_107.0, gpu_share=1.0, kind="inference")
    fgd = make_policy("fgd", None if fill is None else {"fill": fill})
    got = fgd.choose(view, task, feasible(view, task))
    assert got.node_id == chosen
    terms = fgd.terms(view, task, [0], fgd.gpu_scores(view, task))
    if fgd.weights["fill"] and learned:
        assert terms["fill"] == pytest.approx(fgd.weights["fill"] * (13_107 / 16_384 - 0.7) / 0.15)
        assert got.score.terms["fill"] == 0.0 and got.score.terms.get("oom_risk", 0.0) == 0.0
    else:
        assert "fill" not in terms
    # an ask under the warn level of every card: no term at all
    small_ask = spec(vram_mib=8_000.0, gpu_share=1.0, kind="inference")
    assert "fill" not in fgd.terms(view, small_ask, [0], fgd.gpu_scores(view, small_ask))
