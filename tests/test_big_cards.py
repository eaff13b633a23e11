"""The load-aware ``big_cards`` term: the few big-memory cards are kept for
work the other cards cannot hold (``scheduler.scoring``, B(g))."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from scheduler.cluster import ClusterNode
from scheduler.config import SchedulerConfig
from scheduler.errors import InvalidArgument
from scheduler.filters import feasible
from scheduler.memgrowth import ANY_KIND, GrowthTable, MemoryGrowthConfig
from scheduler.policies import LoadAware
from scheduler.scoring import LOAD_AWARE_WEIGHTS, big_card_column, big_card_need, load_aware_scores
from scheduler.simulator import RatioMemory, SimConfig, Simulation
from scheduler.snapshot import ClusterSnapshot, NodeFacts
from scheduler.task import Priority, TaskSpec
from scheduler.traces import TraceTask
from scheduler.view import PlacementView

W = LOAD_AWARE_WEIGHTS
G3, V100_32, G2 = 81_920.0, 32_768.0, 24_576.0


def cluster(sizes: list[float], growth: dict[str, list[float]] | None = None) -> ClusterSnapshot:
    """One idle single-GPU node per size, in that order (row i = sizes[i])."""
    snap = ClusterSnapshot.build(
        [NodeFacts(f"n{i}", 1, memory_total_mib=size) for i, size in enumerate(sizes)],
        util_pct=[0.0] * len(sizes), memory_used_mib=[0.0] * len(sizes), temperature_c=[40.0] * len(sizes),
    )
    if growth:
        snap.memory_growth = {kind: GrowthTable.from_ratios(r) for kind, r in growth.items()}
    return snap


# one 80 GiB card and one 32 GiB card among 18 of 24 GiB: 5 % and 10 % of the GPUs
OPENB_LIKE = [G3, V100_32] + [G2] * 18


@pytest.mark.parametrize(
    "sizes, share, big_rows, small",
    [
        (OPENB_LIKE, 0.1, [0, 1], G2),  # 80 and 32 GiB together are 10 %: both big
        (OPENB_LIKE, 0.05, [0], V100_32),  # only the 80 GiB card is within 5 %
        (OPENB_LIKE, 0.0, None, None),  # off
        ([G2] * 20, 0.1, None, None),  # one size: nothing is big
        ([G3, G3, G3] + [G2] * 7, 0.1, None, None),  # the largest alone are 30 %
        ([G3, 0.0] + [G2] * 18, 0.1, [0], G2),  # an unknown capacity counts for nothing
        ([24_576.0] + [24_564.0] * 19, 0.1, None, None),  # 12 MiB more is the same card, not a big one
        ([G3, 24_576.0] + [24_564.0] * 18, 0.1, [0], 24_576.0),  # the step is above the near-equal sizes
        ([40_000.0, 36_000.0] + [G2] * 18, 0.1, [0, 1], G2),  # big ones may differ among themselves
    ],
)
def test_big_cards_are_the_largest_within_their_share(sizes, share, big_rows, small) -> None:
    view = PlacementView(cluster(sizes), None, SchedulerConfig(big_card_share=share))
    big = big_card_column(view)
    if big_rows is None:
        assert big is None
        return
    column, small_mib = big
    assert np.flatnonzero(column).tolist() == big_rows
    assert small_mib == small


def test_views_of_different_clusters_in_turn_each_get_their_own_big_cards() -> None:
    # the answer is remembered for the last capacities asked about: a view of
    # other capacities, or another share, must not get it
    mixed, uniform = cluster(OPENB_LIKE), cluster([G2] * 20)
    answers = []
    for snap, share in [(mixed, 0.1), (uniform, 0.1), (mixed, 0.1), (mixed, 0.05), (mixed, 0.1)]:
        big = big_card_column(PlacementView(snap, None, SchedulerConfig(big_card_share=share)))
        answers.append(None if big is None else (np.flatnonzero(big[0]).tolist(), big[1]))
    assert answers == [([0, 1], G2), None, ([0, 1], G2), ([0], V100_32), ([0, 1], G2)]


@pytest.mark.parametrize(
    "vram, growth, need, penalised",
    [
        (4_000.0, None, 4_000.0, True),  # nothing learned: the ask
        (13_107.0, {"inference": [1.0, 1.5]}, 19_660.5, True),  # grows to 1.5x: still fits 24 GiB
        (13_107.0, {"inference": [1.0, 2.1]}, 27_524.7, False),  # grows to 2.1x: needs a big card
        (13_107.0, {ANY_KIND: [2.1]}, 27_524.7, False),  # no table of its own: all kinds'
        (13_107.0, {"inference": [0.5, 0.8]}, 13_107.0, True),  # shrinking never lowers the need below the ask
        (30_000.0, None, 30_000.0, False),  # asks more than the small cards hold
        (0.0, None, 0.0, False),  # no ask: nothing to judge it by
    ],
)
def test_a_task_that_fits_the_other_cards_pays_the_term_on_big_ones(vram, growth, need, penalised) -> None:
    snap = cluster(OPENB_LIKE, growth)
    view = PlacementView(snap)
    spec = TaskSpec("t", vram_mib=vram, gpu_share=0.5, kind="inference")
    assert big_card_need(view, spec) == pytest.approx(need, abs=0.1)
    with_term = load_aware_scores(view, spec, W)
    without = load_aware_scores(view, spec, dict(W, big_cards=0.0))
    extra = with_term - without
    expected = W["big_cards"] if penalised else 0.0
    assert extra[:2].tolist() == pytest.approx([expected, expected])  # the 80 and the 32 GiB card
    assert not extra[2:].any()  # never on the 24 GiB ones


def test_a_small_task_goes_to_a_small_card_and_would_not_without_the_term() -> None:
    # every GPU idle: equal scores tie and the lowest row, the 80 GiB card, would win
    view = PlacementView(cluster(OPENB_LIKE))
    spec = TaskSpec("t", vram_mib=4_000.0, gpu_share=0.5)
    with_term = LoadAware().choose(view, spec, feasible(view, spec))
    without = LoadAware({"big_cards": 0.0}).choose(view, spec, feasible(view, spec))
    assert without.node_id == "n0"
    assert with_term.node_id == "n2"
    assert with_term.score.terms["big_cards"] == 0.0  # the term applies to the task, paid only on big cards
    # the breakdown names the term where it is paid, and still adds up
    big = LoadAware().terms(view, spec, [0], load_aware_scores(view, spec, W))
    assert big["big_cards"] == W["big_cards"]
    assert sum(big.values()) == pytest.approx(load_aware_scores(view, spec, W)[0])


def test_on_cards_of_one_size_the_weight_changes_nothing() -> None:
    rng = np.random.default_rng(3)
    snap = ClusterSnapshot.build(
        [NodeFacts(f"n{i}", 4, memory_total_mib=G2) for i in range(8)],
        util_pct=rng.uniform(0, 100, 32), memory_used_mib=rng.uniform(0, 20_000, 32),
    )
    view = PlacementView(snap)
    for vram in (1_000.0, 8_000.0, 20_000.0):
        spec = TaskSpec("t", vram_mib=vram, gpu_share=0.3)
        assert np.array_equal(load_aware_scores(view, spec, W), load_aware_scores(view, spec, dict(W, big_cards=0.0)))


@pytest.mark.parametrize("share", [1.0, -0.1, math.nan, math.inf])
def test_big_card_share_out_of_range_is_refused_by_name(share) -> None:
    with pytest.raises(InvalidArgument, match="big_card_share"):
        SchedulerConfig(big_card_share=share).validate()


def test_simulated_urgent_task_gets_the_big_card_to_itself() -> None:
    """One 80 GiB card and nine of 24 GiB, all of speed 1. W (inference) grows
    to 1.6x its ask and ends, teaching it; S, a batch task asking 4,000 MiB
    at half a GPU, arrives at t = 20 for a long run; L, a P0 inference task
    asking 20,000 MiB, arrives at t = 40 and grows to 1.6x (32,000 MiB): only
    the big card holds it. Idle cards tie and the lowest row wins, so without
    the term S takes the big card and L must share its compute (150 %: 100 s
    of work take 150 s), or, as P0 work may (``preempt_for_compute``), evict S
    for it, S's 30 s of work lost; with it S runs on a 24 GiB card and L
    alone."""
    cards = [ClusterNode("big", 1, "G3", G3, 1.0)] + [ClusterNode(f"g2-{i}", 1, "G2", G2, 1.0) for i in range(9)]
    tasks = [
        TraceTask("W", 0.0, 10.0, 1, 10_000.0, 1.0, Priority.P3, "inference"),
        TraceTask("S", 20.0, 10_000.0, 1, 4_000.0, 0.5, Priority.P2, "batch"),
        TraceTask("L", 40.0, 100.0, 1, 20_000.0, 1.0, Priority.P0, "inference"),
    ]
    memory = RatioMemory({"W": (1.6,), "L": (1.6,)})
    cfg = SimConfig(memory=memory, memory_growth=MemoryGrowthConfig(min_samples=1))
    compute_eviction = replace(cfg, scheduler=SchedulerConfig(preempt_for_compute=True))
    jct, evicted = {}, {}
    for policy, config in (("load_aware", cfg), ("load_aware:big_cards=0", cfg),
                           ("load_aware:big_cards=0", compute_eviction)):
        result = Simulation(tasks, cards, policy, config).run()
        assert result.oom_kills == 0 and all(r.state == "completed" for r in result.records)
        key = (policy, config.scheduler is not None)
        jct[key] = {r.task_id: r.jct_s for r in result.records}
        evicted[key] = result.preemptions
    assert jct["load_aware", False]["L"] == pytest.approx(100.0)
    assert jct["load_aware", False]["S"] == pytest.approx(10_000.0) and evicted["load_aware", False] == 0
    assert jct["load_aware:big_cards=0", False]["L"] == pytest.approx(150.0)
    # it waits for S's memory to show gone (the agent's sampling delay), then runs alone
    assert 100.0 < jct["load_aware:big_cards=0", True]["L"] < 110.0
    assert jct["load_aware:big_cards=0", True]["S"] > 10_000.0 and evicted["load_aware:big_cards=0", True] == 1


# ---- through a real coordinator -------------------------------------------------------------------


async def test_small_tasks_leave_the_big_card_to_a_task_that_needs_it_through_a_real_coordinator():
    """Ten simulated hosts of one GPU: sim-01 has 80 GiB, the others 24 GiB
    (10 %: sim-01 is big). Twelve small tasks (4 GiB, 30 % of a GPU) all go
    to the 24 GiB cards, though the 80 GiB one is idle; with the weight set to
    0 through SetPolicy the next goes to it (the idlest). A 40 GiB task, which
    only the big card holds, is then placed at once and pays no such term."""
    import grpc

    from agent.fleet import SimFleet
    from coordinator.config import CoordinatorConfig
    from coordinator.server import Coordinator
    from protos import tasks_pb2 as tpb
    from protos import tasks_pb2_grpc as tpb_grpc
    from waiting import until

    gib = 1024
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", insecure=True, dispatch_interval_s=0.1))
    port = await coord.start()
    # an A100 80GB (speed 1.3 to the RTX 4090s' 1.0, the table's priors): the
    # completion term's pull towards it (2 x 0.23) stays under big_cards' 1;
    # an H100's (2 x 0.55, speed 2.2) would not, and rightly draws work
    big_card = {"sim-01": {"model": "NVIDIA A100-SXM4-80GB", "memory_total_mib": 81_920}}
    try:
        async with SimFleet(f"127.0.0.1:{port}", hosts=10, gpus=1, workload="idle", backend_options=big_card):
            await until(lambda: int(coord.dispatcher.snapshots.snapshot().healthy.sum()) == 10, what="ten healthy GPUs")
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = tpb_grpc.SchedulerStub(ch)

                async def place(task_id: str, vram_gib: float, share: float) -> tpb.Task:
                    spec = tpb.TaskSpec(task_id=task_id, num_gpus=1, vram_mib=int(vram_gib * gib), gpu_share=share,
                                        kind="batch", priority=tpb.PRIORITY_P2)
                    task = (await stub.ScheduleTask(tpb.ScheduleTaskRequest(spec=spec), timeout=10)).task
                    assert task.state == tpb.TASK_STATE_LEASED, task.reason
                    return task

                small = [await place(f"small-{i}", 4, 0.3) for i in range(12)]
                assert all(t.assignment.node_id != "sim-01" for t in small)
                assert small[0].assignment.score.terms["big_cards"] == 0.0  # the term applied, paid nowhere it went
                await stub.SetPolicy(tpb.SetPolicyRequest(name="load_aware", weights={"big_cards": 0.0}))
                assert (await place("small-unkept", 4, 0.3)).assignment.node_id == "sim-01"
                await stub.SetPolicy(tpb.SetPolicyRequest(name="load_aware", weights={"big_cards": 1.0}))
                large = await place("large", 40, 0.5)
                assert large.assignment.node_id == "sim-01"
                assert "big_cards" not in large.assignment.score.terms  # it needs the big card
            # the operator can see that one card is kept, and for what
            from prometheus_client.parser import text_string_to_metric_families

            samples = {s.name: s.value for f in text_string_to_metric_families(coord.metrics.exposition().decode())
                       for s in f.samples}
            assert samples["gpulb_big_cards"] == 1
            assert samples["gpulb_big_cards_need_limit_bytes"] == 24_564 * 2**20  # a simulated RTX 4090
    finally:
        await coord.stop(grace_s=0.1)
