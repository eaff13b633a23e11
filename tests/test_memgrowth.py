"""Learned memory growth (``scheduler.memgrowth``) and the load-aware
``oom_risk`` term it feeds: the learner's bookkeeping, the risk worked out by
hand, the term in the score (same to the bit for all rows and some rows, and
in the breakdown), and a simulated cluster where learning turns repeated OOM
kills into one."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from scheduler.cluster import ClusterNode, homogeneous
from scheduler.config import SchedulerConfig
from scheduler.memgrowth import BINS, ANY_KIND, GrowthTable, MemoryGrowth, MemoryGrowthConfig, table_for
from scheduler.policies import make_policy
from scheduler.reservations import Reservations
from scheduler.scoring import LOAD_AWARE_WEIGHTS, load_aware_scores, load_aware_terms
from scheduler.simulator import RatioMemory, SimConfig, Simulation
from scheduler.snapshot import ClusterSnapshot, NodeFacts
from scheduler.task import Priority, TaskSpec
from scheduler.traces import TraceTask
from scheduler.view import PlacementView

# ---- the learner -----------------------------------------------------------------------------


def test_observe_keeps_ratios_per_kind_and_over_all_kinds():
    g = MemoryGrowth(MemoryGrowthConfig(window=4, min_samples=2))
    assert g.observe("training", 10_000, 15_000) == pytest.approx(1.5)
    assert g.tables() == {}  # one ratio is not enough for anyone
    g.observe("inference", 2_000, 2_200)
    tables = g.tables()
    # two ratios over all kinds; neither kind has two of its own yet
    assert set(tables) == {ANY_KIND}
    assert tables[ANY_KIND].ratios.tolist() == pytest.approx([1.1, 1.5])
    g.observe("training", 10_000, 12_000, oom_killed=True)
    tables = g.tables()
    assert set(tables) == {ANY_KIND, "training"}
    assert tables["training"].ratios.tolist() == pytest.approx([1.2, 1.5])
    # a kind with too few ratios of its own falls back to all kinds'
    assert table_for(tables, "inference") is tables[ANY_KIND]
    assert table_for({}, "inference") is None
    stats = {s.kind: s for s in g.stats()}
    assert stats["training"].samples == 2 and stats["training"].oom_kills == 1
    assert stats[ANY_KIND].samples == 3 and stats[ANY_KIND].max == pytest.approx(1.5)


def test_window_keeps_the_most_recent_ratios():
    g = MemoryGrowth(MemoryGrowthConfig(window=3, min_samples=1))
    for peak in (1_000, 2_000, 3_000, 4_000):
        g.observe("batch", 1_000, peak)
    assert g.tables()["batch"].ratios.tolist() == [2.0, 3.0, 4.0]
    assert g.samples == 3


def test_tables_are_the_same_object_until_something_is_learned():
    g = MemoryGrowth(MemoryGrowthConfig(min_samples=1))
    g.observe("batch", 1_000, 1_100)
    first = g.tables()
    assert g.tables() is first
    assert not first[ANY_KIND].ratios.flags.writeable  # shared with every view: read-only
    assert not first[ANY_KIND].grid.flags.writeable
    g.observe("batch", 1_000, 1_300)
    assert g.tables() is not first


@pytest.mark.parametrize(
    "asked, peak",
    [(0.0, 1_000.0), (-5.0, 1_000.0), (1_000.0, 0.0), (1_000.0, math.nan), (math.inf, 1_000.0), (1_000.0, -1.0)],
)
def test_reports_that_say_nothing_are_ignored(asked, peak):
    g = MemoryGrowth()
    assert g.observe("batch", asked, peak) is None
    assert g.samples == 0 and g.version == 0


def test_broken_ratios_are_clipped():
    g = MemoryGrowth(MemoryGrowthConfig(min_samples=1))
    assert g.observe("batch", 1_000, 1e9) == 20.0  # 1,000,000x is a broken report, not growth
    assert g.observe("batch", 1_000, 1) == 0.05


def test_state_round_trips_and_bad_copies_are_refused():
    g = MemoryGrowth(MemoryGrowthConfig(min_samples=1))
    g.observe("training", 10_000, 14_000)
    g.observe("inference", 1_000, 1_000, oom_killed=True)
    restored = MemoryGrowth(MemoryGrowthConfig(min_samples=1))
    restored.load_state(g.to_state())
    assert {k: v.ratios.tolist() for k, v in restored.tables().items()} == {
        k: v.ratios.tolist() for k, v in g.tables().items()
    }
    assert [s.oom_kills for s in restored.stats()] == [s.oom_kills for s in g.stats()]
    with pytest.raises(ValueError, match="memory growth state"):
        restored.load_state([1.2, 1.3])
    # an entry that does not parse is skipped, the others are kept
    partial = MemoryGrowth(MemoryGrowthConfig(min_samples=1))
    partial.load_state({"batch": {"ratios": ["x"]}, "training": {"ratios": [1.5], "oom_killed": [False]}})
    assert set(partial.tables()) == {"training"}


def test_config_is_validated():
    with pytest.raises(ValueError, match="window"):
        MemoryGrowthConfig(window=0).validate()
    with pytest.raises(ValueError, match="min_samples"):
        MemoryGrowthConfig(window=10, min_samples=11).validate()


# ---- the risk ----------------------------------------------------------------------------------


def test_oom_risk_by_hand():
    table = GrowthTable.from_ratios(np.array([2.0, 1.0, 1.5, 1.2]))
    assert table.ratios.tolist() == [1.0, 1.2, 1.5, 2.0]
    free = np.array([25_000.0, 16_000.0, 13_000.0, 9_000.0, 20_000.0, 10_000.0, np.nan])
    # free / ask = 2.5, 1.6, 1.3, 0.9, 2.0 (the largest ratio), 1.0 (the smallest), unknown:
    # the share of ratios strictly above each (none of 1.6 and 1.3's bins holds a ratio:
    # exact); unknown free memory is left to the memory filters (they refuse it)
    expected = [0.0, 0.25, 0.5, 1.0, 0.0, 0.75, 0.0]
    assert table.risk(free, 10_000.0).tolist() == expected
    assert [table.risk_at(float(f), 10_000.0) for f in free] == expected


def test_binned_risk_is_never_below_the_exact_share_and_at_most_a_bin_above():
    rng = np.random.default_rng(3)
    ratios = rng.lognormal(0.0, 0.15, 512)
    table = GrowthTable.from_ratios(ratios)
    x = rng.uniform(0.4, 2.0, 20_000)
    binned = table.risk(x * 1_000.0, 1_000.0)
    exact = (ratios.size - np.searchsorted(np.sort(ratios), x * (1_000.0 / 1_000.0), side="right")) / ratios.size
    assert np.all(binned >= exact - 1e-12)
    step = (ratios.max() - ratios.min()) / BINS
    within = (np.searchsorted(np.sort(ratios), x + step, side="right") - np.searchsorted(np.sort(ratios), x - step, side="left"))
    assert np.all(binned - exact <= within / ratios.size + 1e-12)
    # the scalar form is bit-identical
    assert [table.risk_at(float(v), 1_000.0) for v in x[:500] * 1_000.0] == binned[:500].tolist()


def test_compiled_risk_adds_the_same_floats_as_numpy(monkeypatch):
    """The one-pass compiled form (``setsearch.risk_kernel``) and the numpy
    form give the same scores to the bit, NaN scores and NaN free memory included."""
    from scheduler import memgrowth, setsearch

    if not setsearch.ready():
        pytest.skip(f"compiled kernels not in use here: {setsearch.failure or 'numba missing or disabled'}")
    rng = np.random.default_rng(11)
    table = GrowthTable.from_ratios(rng.lognormal(0.0, 0.15, 512))
    free = rng.uniform(-500.0, 40_000.0, 8_000)
    free[::53] = np.nan
    base = rng.uniform(0.0, 3.0, 8_000)
    base[::71] = np.nan
    for vram in (512.0, 8_000.0, 24_000.0):
        compiled, plain = base.copy(), base.copy()
        table.add_risk(compiled, free, vram, 2.0)
        monkeypatch.setattr(memgrowth, "_COMPILED_MIN_ROWS", 10**9)
        table.add_risk(plain, free, vram, 2.0)
        monkeypatch.undo()
        assert np.array_equal(compiled, plain, equal_nan=True), vram
        assert np.nanmax(compiled - base) > 0


# ---- the score -----------------------------------------------------------------------------------


def _snapshot(growth=None):
    """Two idle-ish GPUs: a 16 GiB T4-class card, idle, and a 24 GiB card at
    80 % util with 4,000 MiB used."""
    snap = ClusterSnapshot.build(
        [
            NodeFacts("small", 1, model="Tesla T4", memory_total_mib=16_384.0),
            NodeFacts("big", 1, model="RTX 4090", memory_total_mib=24_576.0),
        ],
        util_pct=[0.0, 80.0],
        memory_used_mib=[0.0, 4_000.0],
    )
    if growth is not None:
        snap.memory_growth = growth
    return snap


def _view(snap):
    return PlacementView(snap, Reservations(), SchedulerConfig())


WHOLE = TaskSpec(task_id="t", vram_mib=13_107.0, gpu_share=1.0, priority=Priority.P1, kind="training")


def test_learned_growth_moves_a_whole_gpu_task_to_the_card_it_cannot_outgrow():
    policy = make_policy("load_aware")
    blind = policy.gpu_scores(_view(_snapshot()), WHOLE)
    # blind: the idle 16 GiB card (memory pressure 0.67) beats the 80 % busy one
    assert blind[0] < blind[1]
    # every ended training task grew to 1.3x: 13,107 * 1.3 = 17,039 MiB > 16,384 free
    # on the small card (risk 1); 20,576 free on the big one (risk 0)
    growth = {ANY_KIND: GrowthTable.from_ratios([1.3] * 20), "training": GrowthTable.from_ratios([1.3] * 20)}
    view = _view(_snapshot(growth))
    learned = policy.gpu_scores(view, WHOLE)
    assert learned[0] == pytest.approx(blind[0] + LOAD_AWARE_WEIGHTS["oom_risk"])
    assert learned[1] == pytest.approx(blind[1])
    assert learned[1] < learned[0]
    # some rows only: the same numbers to the bit
    assert policy.gpu_scores_at(view, WHOLE, np.array([1, 0])).tolist() == [learned[1], learned[0]]
    # the breakdown names the term and agrees with the score
    terms = load_aware_terms(view, WHOLE, policy.weights, [0])
    assert terms["oom_risk"] == pytest.approx(LOAD_AWARE_WEIGHTS["oom_risk"])
    assert sum(terms.values()) == pytest.approx(learned[0])
    assert "oom_risk" not in load_aware_terms(_view(_snapshot()), WHOLE, policy.weights, [0])


def test_the_term_is_off_without_weight_or_ask():
    growth = {ANY_KIND: GrowthTable.from_ratios([1.3] * 20)}
    view = _view(_snapshot(growth))
    weights = dict(LOAD_AWARE_WEIGHTS, oom_risk=0.0)
    blind = load_aware_scores(_view(_snapshot()), WHOLE, weights)
    assert load_aware_scores(view, WHOLE, weights).tolist() == blind.tolist()
    no_ask = TaskSpec(task_id="u", vram_mib=0.0, gpu_share=1.0, priority=Priority.P1, kind="training")
    assert (
        load_aware_scores(view, no_ask, LOAD_AWARE_WEIGHTS).tolist()
        == load_aware_scores(_view(_snapshot()), no_ask, LOAD_AWARE_WEIGHTS).tolist()
    )


# ---- in the simulator ------------------------------------------------------------------------------

# An RTX 4090 that a long task keeps at 70 % and a 16 GiB card, idle. Tasks
# T1..T4 ask 10,000 MiB at 20 % and really use 1.7x (17,000 MiB) from the
# start, one after the other. Blind, load_aware puts each on the idle small
# card (load 0.2 against 0.9 + jitter 0.1), where 17,000 > 16,384 MiB kills
# it; re-asking 17,000 it no longer passes the small card's 85 % filter and
# runs on the 4090. Learning from the first kill (ratio 1.7; T1's second run
# then reports 1.0 against its raised ask), the small card's risk for T2 is
# half the ratios (+1.0 on 0.2) and the 4090 (about 1.06) wins, as it does
# for T3 and T4: one kill in all.
CARDS = [
    *homogeneous(1, 1, prefix="big"),  # first row: the hog lands here (idle GPUs tie, the lowest row wins)
    ClusterNode("small", 1, "Tesla T4", 16_384.0, 1.0),
]


@pytest.mark.parametrize("learning, kills", [(False, 4), (True, 1)])
def test_simulated_cluster_learns_to_stop_killing(learning, kills):
    hog = TraceTask("hog", 0.0, 10_000.0, 1, 1_000.0, 0.7, Priority.P3, "background")
    tasks = [hog] + [
        TraceTask(f"T{i}", 10.0 + 100.0 * i, 50.0, 1, 10_000.0, 0.2, Priority.P2, "batch") for i in range(1, 5)
    ]
    memory = RatioMemory({f"T{i}": (1.7,) for i in range(1, 5)})
    cfg = SimConfig(memory=memory, memory_learning=learning, memory_growth=MemoryGrowthConfig(min_samples=1))
    sim = Simulation(tasks, CARDS, "load_aware", cfg)
    result = sim.run()
    assert result.oom_kills == kills
    assert all(r.state == "completed" for r in result.records)
    if learning:
        # the kill (1.7), T1's second run (1.0 of its raised ask), T2..T4 (1.7), the hog (1.0)
        assert sim.growth is not None
        assert sim.growth.tables()[""].ratios.tolist() == pytest.approx([1.0, 1.0, 1.7, 1.7, 1.7, 1.7])
    else:
        assert sim.growth is None


# ---- waiting a little for room to grow (SchedulerConfig.growth_room_wait_s) -------------------------


def _g2_and_g3(g3_used_mib: float, growth: bool = True) -> ClusterSnapshot:
    """An idle 24 GiB card and a 32 GiB one holding ``g3_used_mib`` of
    another process's memory; learned: one task in twenty grew to 2.1x."""
    snap = ClusterSnapshot.build(
        [NodeFacts("g2", 1, model="G2", memory_total_mib=24_576.0),
         NodeFacts("g3", 1, model="G3", memory_total_mib=32_768.0)],
        memory_used_mib=[0.0, g3_used_mib],
    )
    if growth:
        snap.memory_growth = {ANY_KIND: GrowthTable.from_ratios([1.0] * 19 + [2.1])}
    return snap


def _scheduler(**config):
    from scheduler.engine import Scheduler

    clock = [100.0]
    ids = iter(range(10**6))
    sched = Scheduler(SchedulerConfig(**config), clock=lambda: clock[0], lease_ids=lambda: f"l{next(ids)}")
    return sched, clock


def test_a_task_below_p0_waits_a_little_for_a_card_with_room_for_the_largest_growth():
    # 13,107 MiB at the largest learned ratio, 2.1x: 27,525 MiB. The G3 could
    # hold it but another process holds 20 GiB there; the G2 never could.
    sched, clock = _scheduler(growth_room_wait_s=5.0)
    busy = _g2_and_g3(20_480.0)
    sched.submit(WHOLE, busy)
    assert sched.dispatch(busy) == []
    task = sched.get("t")
    assert task.state.name == "QUEUED"
    assert "27,525 MiB free" in task.reason and "2.10x the ask" in task.reason and "training" in task.reason
    assert sched.next_decision_at() == 105.0  # a dispatcher driven by events wakes then
    # the G3's memory is freed within the wait: the task goes there
    clock[0] += 3.0
    freed = _g2_and_g3(0.0)
    placed = sched.dispatch(freed)
    assert [t.assignment.node_id for t in placed] == ["g3"]
    assert sched.next_decision_at() is None
    assert sched.room_wait_counts == {"waited": 1, "found": 1}


def test_after_the_wait_it_takes_the_best_card_it_fits():
    sched, clock = _scheduler(growth_room_wait_s=5.0)
    busy = _g2_and_g3(20_480.0)
    sched.submit(WHOLE, busy)
    assert sched.dispatch(busy) == []
    clock[0] += 4.9
    assert sched.dispatch(busy) == []
    clock[0] += 0.2
    placed = sched.dispatch(busy)
    assert [t.assignment.node_id for t in placed] == ["g2"] and placed[0].reason == ""
    assert sched.room_wait_counts == {"waited": 1, "gave_up": 1}


def test_a_cancelled_wait_is_forgotten_at_the_next_dispatch():
    """The coordinator never asks next_decision_at; dispatch forgets ended waits."""
    sched, clock = _scheduler(growth_room_wait_s=5.0)
    busy = _g2_and_g3(20_480.0)
    sched.submit(WHOLE, busy)
    assert sched.dispatch(busy) == [] and sched._room_waits == {"t": 105.0}
    sched.cancel("t")
    sched.dispatch(busy)
    assert sched._room_waits == {} and sched.room_wait_counts == {"waited": 1}


@pytest.mark.parametrize("case", ["p0", "round_robin", "off", "gpu_spec", "nothing_learned", "no_node_of_two"])
def test_who_never_waits_for_room_to_grow(case):
    """Urgent work, a policy blind to growth, the option off, a task whose
    allowed cards (here its gpu_spec) could never hold the growth, nothing
    learned yet, and a 2-GPU task where no node has two such cards."""
    config = {"growth_room_wait_s": 0.0 if case == "off" else 5.0}
    if case == "round_robin":
        config["policy"] = "round_robin"
    sched, _ = _scheduler(**config)
    busy = _g2_and_g3(20_480.0, growth=case != "nothing_learned")
    task = WHOLE
    if case == "p0":
        task = TaskSpec(task_id="t", vram_mib=13_107.0, gpu_share=1.0, priority=Priority.P0, kind="inference")
    elif case == "gpu_spec":
        task = TaskSpec(task_id="t", vram_mib=13_107.0, gpu_share=1.0, priority=Priority.P1, kind="training",
                        gpu_spec="G2")
    elif case == "no_node_of_two":
        busy = ClusterSnapshot.build(
            [NodeFacts("g2", 2, model="G2", memory_total_mib=24_576.0),
             NodeFacts("g3", 1, model="G3", memory_total_mib=32_768.0)],
            memory_used_mib=[0.0, 0.0, 0.0],
        )
        busy.memory_growth = {ANY_KIND: GrowthTable.from_ratios([1.0] * 19 + [2.1])}
        task = TaskSpec(task_id="t", vram_mib=13_107.0, gpu_share=1.0, num_gpus=2, priority=Priority.P1,
                        kind="training")
    sched.submit(task, busy)
    assert len(sched.dispatch(busy)) == 1


def test_the_wait_is_validated():
    from scheduler.errors import InvalidArgument

    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(InvalidArgument) as info:
            SchedulerConfig(growth_room_wait_s=bad).validate()
        assert info.value.field == "growth_room_wait_s"


@pytest.mark.parametrize("wait_s, kills", [(0.0, 1), (30.0, 0)])
def test_simulated_task_that_waits_for_room_is_not_killed(wait_s, kills):
    """A 32 GiB card and a 24 GiB one. W grows to 1.9x and ends, teaching
    it; a hog then holds 10,000 MiB of the big card until t = 40; T, a batch
    task asking 13,107 MiB that grows 1.9x (24,903 MiB: more than the small
    card has), arrives at t = 30. Placed at once it runs on the small card
    and is killed; waiting up to 30 s it gets the big one when the hog ends."""
    cards = [ClusterNode("big", 1, "G3", 32_768.0, 1.0), ClusterNode("small", 1, "G2", 24_576.0, 1.0)]
    tasks = [
        TraceTask("W", 0.0, 10.0, 1, 10_000.0, 1.0, Priority.P3, "batch"),
        TraceTask("hog", 15.0, 25.0, 1, 10_000.0, 0.2, Priority.P3, "background"),
        TraceTask("T", 30.0, 50.0, 1, 13_107.0, 1.0, Priority.P2, "batch"),
    ]
    memory = RatioMemory({"W": (1.9,), "T": (1.9,)})
    cfg = SimConfig(memory=memory, memory_growth=MemoryGrowthConfig(min_samples=1),
                    scheduler=SchedulerConfig(growth_room_wait_s=wait_s))
    result = Simulation(tasks, cards, "load_aware", cfg).run()
    assert result.oom_kills == kills
    assert all(r.state == "completed" for r in result.records)
    t = result.records[2]
    if wait_s:
        assert 10.0 <= t.wait_s < 30.0  # until the hog's release showed
    assert (result.room_waits, result.room_waits_found) == ((1, 1) if wait_s else (0, 0))


def test_on_cards_of_one_size_nothing_waits_for_room():
    """The same tasks on two 32 GiB cards: the wait changes nothing, to the bit."""
    cards = [ClusterNode("a", 1, "G3", 32_768.0, 1.0), ClusterNode("b", 1, "G3", 32_768.0, 1.0)]
    tasks = [
        TraceTask("W", 0.0, 10.0, 1, 10_000.0, 1.0, Priority.P3, "batch"),
        TraceTask("hog", 15.0, 25.0, 1, 10_000.0, 0.2, Priority.P3, "background"),
        TraceTask("hog2", 16.0, 25.0, 1, 10_000.0, 0.2, Priority.P3, "background"),
        TraceTask("T", 30.0, 50.0, 1, 13_107.0, 1.0, Priority.P2, "batch"),
    ]
    memory = RatioMemory({"W": (1.9,), "T": (1.9,)})
    runs = []
    for wait_s in (0.0, 30.0):
        cfg = SimConfig(memory=memory, memory_growth=MemoryGrowthConfig(min_samples=1),
                        scheduler=SchedulerConfig(growth_room_wait_s=wait_s))
        runs.append(Simulation(tasks, cards, "load_aware", cfg).run())
    assert runs[0].records == runs[1].records
    assert runs[0].records[3].first_start_s == 30.0  # placed at once (then killed: the hogs share its card)


async def test_room_waits_reach_prometheus():
    """The coordinator exports the engine's wait outcomes as a counter."""
    from prometheus_client.parser import text_string_to_metric_families

    from coordinator.config import CoordinatorConfig
    from coordinator.server import Coordinator

    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", insecure=True))
    engine = coord.dispatcher.engine
    busy = _g2_and_g3(20_480.0)
    engine.submit(WHOLE, busy)
    engine.dispatch(busy)
    engine.dispatch(_g2_and_g3(0.0))
    families = {f.name: f for f in text_string_to_metric_families(coord.metrics.exposition().decode())}
    samples = {s.labels["outcome"]: s.value for s in families["gpulb_growth_room_waits"].samples}
    assert samples == {"waited": 1.0, "found": 1.0, "gave_up": 0.0}


def test_tasks_of_one_shape_wait_alike_in_one_dispatch():
    """The second task of the same shape and kind takes the first one's
    answer within a dispatch (free room only shrinks there)."""
    sched, clock = _scheduler(growth_room_wait_s=5.0)
    busy = _g2_and_g3(20_480.0)
    for task_id in ("a", "b"):
        sched.submit(TaskSpec(task_id=task_id, vram_mib=13_107.0, gpu_share=1.0, priority=Priority.P1,
                              kind="training"), busy)
    calls = []
    choose = sched._policy.choose
    sched._policy.choose = lambda *a, **k: calls.append(1) or choose(*a, **k)
    assert sched.dispatch(busy) == []
    assert len(calls) == 2  # the first task's two tries (with room, then anywhere); none for the second
    assert set(sched._room_waits) == {"a", "b"} and sched.room_wait_counts == {"waited": 2}
    assert sched.get("a").reason == sched.get("b").reason and "27,525 MiB free" in sched.get("b").reason


@pytest.mark.parametrize("wait_s, node", [(5.0, "g3"), (0.0, "g2")])
def test_a_card_with_room_to_grow_wins_over_a_less_loaded_one(wait_s, node):
    """What saved the openb kills: no wait at all. The 32 GiB card is 80 %
    busy (another process's compute, no memory), the 24 GiB one idle; the
    score alone takes the idle card the task could outgrow, the room rule the
    busy one that holds its growth (off: the score's choice)."""
    sched, _ = _scheduler(growth_room_wait_s=wait_s)
    snap = ClusterSnapshot.build(
        [NodeFacts("g2", 1, model="G2", memory_total_mib=24_576.0),
         NodeFacts("g3", 1, model="G3", memory_total_mib=32_768.0)],
        util_pct=[0.0, 80.0], memory_used_mib=[0.0, 0.0],
    )
    snap.memory_growth = {ANY_KIND: GrowthTable.from_ratios([1.0] * 19 + [2.1])}
    sched.submit(WHOLE, snap)
    placed = sched.dispatch(snap)
    assert [t.assignment.node_id for t in placed] == [node]
    assert sched.room_wait_counts == {}  # nobody waited


# ---- P0 tasks: no wait, but eviction for room to grow (preempt_for_growth) -------------------------

URGENT = TaskSpec(task_id="u", vram_mib=13_107.0, gpu_share=1.0, priority=Priority.P0, kind="inference")


def _placed_on_g3(sched, spec: TaskSpec) -> None:
    """``spec`` placed on the G3 while the G2 reads full (one task in twenty
    learned to grow 2.1x, as in ``_readings``)."""
    full_g2 = ClusterSnapshot.build(
        [NodeFacts("g2", 1, model="G2", memory_total_mib=24_576.0),
         NodeFacts("g3", 1, model="G3", memory_total_mib=32_768.0)], memory_used_mib=[24_000.0, 0.0])
    full_g2.memory_growth = {ANY_KIND: GrowthTable.from_ratios([1.0] * 19 + [2.1])}
    sched.submit(spec, full_g2)
    assert [t.assignment.node_id for t in sched.dispatch(full_g2)] == ["g3"]


def _g2_and_busy_g3(clock, sched, g3_priority=Priority.P3, share=0.5):
    """The G3 holds a 16 GiB task of ``g3_priority`` (placed while the G2
    read full), using half its compute; the G2 is idle. Returns the snapshot
    as the readings show it now."""
    kind = "inference" if g3_priority == Priority.P0 else "background"
    _placed_on_g3(sched, TaskSpec(task_id="bg", vram_mib=16_384.0, gpu_share=share, priority=g3_priority, kind=kind))
    return _readings(g3_used=16_384.0, g3_util=100.0 * share)


def _readings(g3_used: float, g3_util: float) -> ClusterSnapshot:
    snap = ClusterSnapshot.build(
        [NodeFacts("g2", 1, model="G2", memory_total_mib=24_576.0),
         NodeFacts("g3", 1, model="G3", memory_total_mib=32_768.0)],
        memory_used_mib=[0.0, g3_used], util_pct=[0.0, g3_util])
    snap.memory_growth = {ANY_KIND: GrowthTable.from_ratios([1.0] * 19 + [2.1])}
    return snap


def test_a_p0_task_evicts_background_work_from_the_card_it_cannot_outgrow_and_waits_for_it():
    # 13,107 MiB x 2.1 = 27,525 MiB: only the G3 could hold it, and a
    # background task holds 16 GiB there. The G2 takes it now; instead the
    # background task is evicted and the P0 task goes to the G3 once it reads free.
    sched, clock = _scheduler()
    busy = _g2_and_busy_g3(clock, sched)
    sched.submit(URGENT, busy)
    assert sched.dispatch(busy) == []
    assert sched.get("bg").state.name == "QUEUED" and sched.get("u").state.name == "QUEUED"
    assert "for room to grow (27,525 MiB: 2.10x the ask" in sched.get("u").reason
    assert sched.nominations()["u"].gpu_uuids == ("GPU-g3-0",)
    assert sched.nominations()["u"].until == pytest.approx(100.0 + 5.0 - 0.5)  # within its SLA
    clock[0] += 2.4
    placed = sched.dispatch(_readings(g3_used=0.0, g3_util=50.0))  # the smoothed load still falling
    by_id = {t.task_id: t.assignment.node_id for t in placed}
    assert by_id["u"] == "g3" and not sched.get("u").sla_missed
    assert by_id.get("bg") == "g2"  # the victim, re-queued at the head of P3, takes the idle G2
    assert sched.preemption_counts["for_growth"] == 1 and sched.preemption_counts["placed_there"] == 1


def test_a_p0_task_takes_the_card_it_fits_when_nothing_there_may_be_evicted():
    sched, clock = _scheduler()
    busy = _g2_and_busy_g3(clock, sched, g3_priority=Priority.P0)
    sched.submit(URGENT, busy)
    placed = sched.dispatch(busy)
    assert [t.assignment.node_id for t in placed] == ["g2"]
    assert sched.get("bg").state.name == "LEASED" and sched.preemption_counts == {}


def test_the_wait_for_room_to_grow_ends_before_the_p0_sla_and_the_task_takes_the_card_it_fits():
    sched, clock = _scheduler()
    busy = _g2_and_busy_g3(clock, sched)
    sched.submit(URGENT, busy)
    sched.dispatch(busy)
    # the victim's memory never shows free (its holder does not stop it)
    clock[0] += 4.5
    placed = sched.dispatch(busy)
    assert [t.assignment.node_id for t in placed] == ["g2"]
    assert not placed[0].sla_missed and sched.preemption_counts["lapsed"] == 1
    assert sched.get("u").state.name == "LEASED"


@pytest.mark.parametrize("config", [{"preempt_for_growth": False}, {"preemption": False}])
def test_without_preemption_for_growth_the_p0_task_takes_the_card_it_fits_at_once(config):
    sched, clock = _scheduler(**config)
    busy = _g2_and_busy_g3(clock, sched)
    sched.submit(URGENT, busy)
    assert [t.assignment.node_id for t in sched.dispatch(busy)] == ["g2"]
    assert sched.get("bg").state.name == "LEASED"


def test_a_p0_task_goes_straight_to_a_big_card_with_memory_and_compute_to_spare():
    # a background task of 4 GiB and a tenth of the compute on the G3: a P0
    # task of half a GPU's compute that may grow to 27,525 MiB fits beside it
    # (32,768 - 4,096 MiB free, 10-20 % + 50 % load): nothing is evicted
    sched, clock = _scheduler()
    _placed_on_g3(sched, TaskSpec(task_id="small", vram_mib=4_096.0, gpu_share=0.1, priority=Priority.P3,
                                  kind="background"))
    now = _readings(g3_used=4_096.0, g3_util=10.0)
    sched.submit(replace(URGENT, gpu_share=0.5), now)
    placed = sched.dispatch(now)
    assert [t.assignment.node_id for t in placed] == ["g3"] and sched.preemption_counts == {}
    assert sched.get("small").state.name == "LEASED"


def test_a_victim_using_less_memory_than_it_asked_is_evicted_for_room_to_grow():
    # The batch task on the G3 asked 4,096 MiB and the whole GPU but reads only
    # 1,000 MiB. Reservations used to fade with the memory reading alone, so 76 %
    # of its compute stayed reserved on top of the 100 % util the GPU reads:
    # "176 %", more than evicting it (its share, 100 %) could free, and the P0
    # task took the G2 it may outgrow (openb cluster: such G3 cards read "200 %"
    # with one batch task). The util reading shows its compute: load 100 %.
    sched, clock = _scheduler()
    _placed_on_g3(sched, TaskSpec(task_id="bg", vram_mib=4_096.0, gpu_share=1.0, priority=Priority.P3, kind="batch"))
    clock[0] += 60.0
    busy = _readings(g3_used=1_000.0, g3_util=100.0)
    sched.submit(URGENT, busy)
    assert sched.dispatch(busy) == []
    assert sched.get("bg").state.name == "QUEUED"
    assert sched.nominations()["u"].gpu_uuids == ("GPU-g3-0",)
    clock[0] += 2.4
    placed = sched.dispatch(_readings(g3_used=0.0, g3_util=40.0))
    assert {t.task_id: t.assignment.node_id for t in placed}["u"] == "g3"


def _g3_running_p0(sched):
    """A P0 task of 4 GiB and the whole GPU placed on the G3 (the G2 read
    full); the readings now: the G2 idle, the G3 at 100 % with 4 GiB used."""
    _placed_on_g3(sched, TaskSpec(task_id="p0", vram_mib=4_096.0, gpu_share=1.0, priority=Priority.P0, kind="serve"))
    return _readings(g3_used=4_096.0, g3_util=100.0)


def test_a_p0_task_takes_a_big_card_whose_last_lease_just_ended_though_it_still_reads_busy():
    # The G3's P0 task has just completed: for a sampling round or two the G3
    # still reads 100 % util (and its 4 GiB). Its compute is free, so the P0
    # task that may grow to 27,525 MiB goes there, not to the G2 it could
    # outgrow; nothing is evicted.
    sched, clock = _scheduler()
    busy = _g3_running_p0(sched)
    clock[0] += 5.0  # within its lease
    sched.complete("p0", sched.get("p0").assignment.lease_id)
    clock[0] += 1.0
    sched.submit(URGENT, busy)
    assert [t.assignment.node_id for t in sched.dispatch(busy)] == ["g3"]
    assert sched.preemption_counts == {}


def test_a_big_card_busy_with_work_gpulb_did_not_place_is_not_taken_for_room_to_grow():
    # Past the readings' lag, 100 % util with no lease of gpulb's there is
    # another tenant's compute: the P0 task takes the G2 at once, as before.
    sched, clock = _scheduler()
    busy = _g3_running_p0(sched)
    sched.complete("p0", sched.get("p0").assignment.lease_id)
    clock[0] += 60.0
    sched.submit(URGENT, busy)
    assert [t.assignment.node_id for t in sched.dispatch(busy)] == ["g2"]


def test_kinds_past_the_limit_count_in_the_all_kinds_table_only():
    from scheduler.memgrowth import ANY_KIND, MemoryGrowth, MemoryGrowthConfig
    from scheduler.task import MAX_LEARNED_KINDS

    g = MemoryGrowth(MemoryGrowthConfig(min_samples=1))
    for i in range(MAX_LEARNED_KINDS):
        g.observe(f"kind-{i}", 1000.0, 1500.0)
    g.observe("one-too-many", 1000.0, 3000.0)
    kinds = {s.kind: s for s in g.stats()}
    assert "one-too-many" not in kinds and len(kinds) == MAX_LEARNED_KINDS + 1  # with the all-kinds one
    assert kinds[ANY_KIND].samples == MAX_LEARNED_KINDS + 1 and kinds[ANY_KIND].max == 3.0
    assert "one-too-many" not in g.tables() and g.tables()[ANY_KIND].hi == 3.0
