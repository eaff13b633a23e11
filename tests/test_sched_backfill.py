"""EASY-style backfill in the engine: a blocked multi-GPU head holds one node
for itself, tasks behind it keep flowing to the other nodes, and the head is
placed as soon as its node drains."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from scheduler.config import SchedulerConfig
from scheduler.engine import Scheduler
from scheduler.errors import Unplaceable
from scheduler.snapshot import ClusterSnapshot, NodeFacts
from scheduler.task import Priority, TaskSpec, TaskState


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def small(i: int, node: str = "") -> TaskSpec:
    pin = {"host": node} if node else {}
    return TaskSpec(task_id=f"s{i}", priority=Priority.P2, kind="batch", vram_mib=18432, gpu_share=0.2, required_node_labels=pin)


def nodes(count: int, gpus: int) -> ClusterSnapshot:
    return ClusterSnapshot.build([NodeFacts(f"n{i}", gpus, labels={"host": f"n{i}"}) for i in range(count)])


def test_blocked_head_holds_one_node_while_the_rest_keeps_working():
    clock = Clock()
    sched = Scheduler(SchedulerConfig(backfill_max_head_wait_s=10.0, backfill_max_skips=10_000), clock=clock)
    snapshot = nodes(3, 4)
    for i in range(3):
        sched.submit(small(i, f"n{i}"), snapshot)  # one task on every node
    first = {t.task_id: t.assignment.node_id for t in sched.dispatch(snapshot)}
    assert sorted(first.values()) == ["n0", "n1", "n2"]  # no node has 4 free GPUs now
    big = TaskSpec(task_id="big", priority=Priority.P2, kind="training", num_gpus=4, vram_mib=8192, gpu_share=1.0)
    sched.submit(big, snapshot)
    assert sched.dispatch(snapshot) == []
    clock.now = 11.0  # past the backfill bound: "big" is a barrier now
    later = []
    for i in range(3, 9):
        sched.submit(small(i), snapshot)
    placed = sched.dispatch(snapshot)
    later += placed
    assert len(placed) == 6, "tasks behind the barrier still run, on the nodes not held for it"
    held = sched._held_nodes["big"]
    assert all(t.assignment.node_id != held for t in placed)
    # The small task on the held node ends: the head takes the node at once.
    on_held = next(task_id for task_id, node in first.items() if node == held)
    lease = sched.get(on_held).assignment.lease_id
    clock.now = 12.0
    sched.complete(on_held, lease)
    placed = sched.dispatch(snapshot)
    assert [t.task_id for t in placed] == ["big"]
    got = sched.get("big")
    assert got.state == TaskState.LEASED and got.assignment.node_id == held
    assert "big" not in sched._held_nodes


def test_head_below_the_bound_lets_everything_pass():
    clock = Clock()
    sched = Scheduler(SchedulerConfig(backfill_max_head_wait_s=60.0, backfill_max_skips=10_000), clock=clock)
    snapshot = nodes(2, 2)
    sched.submit(small(0, "n0"), snapshot)
    sched.submit(small(1, "n1"), snapshot)
    sched.dispatch(snapshot)
    sched.submit(TaskSpec(task_id="wide", num_gpus=2, vram_mib=8192), snapshot)
    sched.submit(small(2), snapshot)
    sched.submit(small(3), snapshot)
    placed = [t.task_id for t in sched.dispatch(snapshot)]
    assert placed == ["s2", "s3"] and sched._held_nodes == {}


def _held_node_setup(factor: float = 2.0, first_duration: float = 1_000.0):
    """3 nodes x 4 GPUs, one 1,000 s task on each, a 4-GPU head past the bound:
    it holds one node (n_held)."""
    clock = Clock()
    sched = Scheduler(SchedulerConfig(backfill_max_head_wait_s=10.0, backfill_max_skips=10_000,
                                      backfill_estimate_factor=factor, lease_s=100_000.0), clock=clock)
    snapshot = nodes(3, 4)
    for i in range(3):
        spec = TaskSpec(task_id=f"s{i}", priority=Priority.P2, kind="batch", vram_mib=18432, gpu_share=0.2,
                        duration_s=first_duration, required_node_labels={"host": f"n{i}"})
        sched.submit(spec, snapshot)
    sched.dispatch(snapshot)
    sched.submit(TaskSpec(task_id="big", priority=Priority.P2, kind="training", num_gpus=4, vram_mib=8192,
                          gpu_share=1.0, duration_s=5_000.0), snapshot)
    assert sched.dispatch(snapshot) == []
    clock.now = 11.0  # "big" is a barrier now, holding one node
    sched.submit(TaskSpec(task_id="probe", priority=Priority.P2, vram_mib=1024, duration_s=1.0), snapshot)
    sched.dispatch(snapshot)
    return clock, sched, snapshot, sched._held_nodes["big"]


def short(task_id: str, node: str, duration_s: float) -> TaskSpec:
    return TaskSpec(task_id=task_id, priority=Priority.P2, kind="batch", vram_mib=1024, gpu_share=0.2,
                    duration_s=duration_s, required_node_labels={"host": node})


def test_a_task_that_ends_before_the_held_node_drains_may_backfill_onto_it():
    clock, sched, snapshot, held = _held_node_setup()
    # the held node's lease ends at 1,000 s; at 11 s a task of 400 s (x2 = 800 s) ends before it
    sched.submit(short("fits", held, 400.0), snapshot)
    sched.submit(short("too-long", held, 600.0), snapshot)  # x2 = 1,200 s: would delay the head
    sched.submit(short("unknown", held, 0.0), snapshot)  # no estimate: nothing can be known
    placed = [t.task_id for t in sched.dispatch(snapshot)]
    assert placed == ["fits"]
    assert sched.get("fits").assignment.node_id == held
    # the head still starts when the node drains: the long lease ends, then the backfilled one
    clock.now = 500.0
    sched.complete("fits", sched.get("fits").assignment.lease_id)
    on_held = next(f"s{i}" for i in range(3) if f"n{i}" == held)
    clock.now = 1_000.0
    sched.complete(on_held, sched.get(on_held).assignment.lease_id)
    placed = [t.task_id for t in sched.dispatch(snapshot)]
    assert "big" in placed and sched.get("big").assignment.node_id == held


def test_no_estimate_on_the_held_node_or_factor_zero_keeps_it_closed():
    _, sched, snapshot, held = _held_node_setup(first_duration=0.0)  # its lease has no estimate
    sched.submit(short("fits", held, 1.0), snapshot)
    assert sched.dispatch(snapshot) == []
    _, sched, snapshot, held = _held_node_setup(factor=0.0)
    sched.submit(short("fits", held, 1.0), snapshot)
    assert sched.dispatch(snapshot) == []
    assert "waiting" in sched.get("fits").reason


def test_backfill_estimate_factor_is_validated():
    import pytest

    from scheduler.errors import InvalidArgument

    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(InvalidArgument) as info:
            SchedulerConfig(backfill_estimate_factor=bad).validate()
        assert info.value.field == "backfill_estimate_factor"


def _mixed_speed_setup(fast_lease_s: float):
    """n0: one fast GPU (speed 1), busy until ``fast_lease_s``; n1, n2: two
    slow GPUs each (speed 0.1), busy for days. A 2-GPU head that must run on
    a slow node is past the bound and holds the slow node with a free GPU."""
    clock = Clock()
    sched = Scheduler(SchedulerConfig(backfill_max_head_wait_s=10.0, backfill_max_skips=10_000,
                                      backfill_estimate_factor=2.0, lease_s=1e9), clock=clock)
    snapshot = ClusterSnapshot.build([
        NodeFacts("n0", 1, labels={"host": "n0"}, speed=1.0),
        NodeFacts("n1", 2, labels={"host": "n1", "pool": "slow"}, speed=0.1),
        NodeFacts("n2", 2, labels={"host": "n2", "pool": "slow"}, speed=0.1),
    ])
    busy = [("f", "n0", fast_lease_s * 1.0), ("a", "n1", 10_000.0), ("b", "n2", 10_000.0), ("c", "n2", 10_000.0)]
    for task_id, node, duration in busy:
        sched.submit(TaskSpec(task_id=task_id, priority=Priority.P2, kind="batch", vram_mib=20_000, gpu_share=1.0,
                              duration_s=duration, required_node_labels={"host": node}), snapshot)
    assert len(sched.dispatch(snapshot)) == 4
    sched.submit(TaskSpec(task_id="big", priority=Priority.P1, kind="training", num_gpus=2, vram_mib=8192,
                          gpu_share=1.0, duration_s=5_000.0, required_node_labels={"pool": "slow"}), snapshot)
    assert sched.dispatch(snapshot) == []
    clock.now = 11.0  # "big" is past the bound: the next task behind it is fenced
    return sched, snapshot


def test_backfill_onto_a_slow_held_node_only_when_waiting_for_a_fast_gpu_is_slower():
    # 50 s of work: 500 s on the slow held node, ends at 511 s (well before
    # its lease, at 100,000 s). The fast GPU frees at 100 s: 150 s by waiting.
    sched, snapshot = _mixed_speed_setup(fast_lease_s=100.0)
    # behind the head in its class, so fenced off the held node unless backfilled
    urgent = TaskSpec(task_id="urgent", priority=Priority.P1, kind="inference", vram_mib=1024, gpu_share=0.5, duration_s=50.0)
    sched.submit(urgent, snapshot)
    assert sched.dispatch(snapshot) == [] and sched.get("urgent").state == TaskState.QUEUED
    assert sched._held_nodes["big"] == "n1"  # the slow node with a GPU free
    # the fast GPU busy for 10,000 s instead: 10,050 s by waiting, so the slow node it is
    sched, snapshot = _mixed_speed_setup(fast_lease_s=10_000.0)
    sched.submit(urgent, snapshot)
    assert [t.assignment.node_id for t in sched.dispatch(snapshot)] == ["n1"]


# ---- what a hold may be, and who keeps off it ------------------------------------------------


def _pinned(task_id: str, node: str, priority: Priority = Priority.P2, duration_s: float = 0.0,
            vram_mib: int = 8192) -> TaskSpec:
    return TaskSpec(task_id=task_id, priority=priority, kind="batch", vram_mib=vram_mib, gpu_share=0.2,
                    duration_s=duration_s, required_node_labels={"host": node})


def _two_gpu(task_id: str, vram_mib: int, priority: Priority = Priority.P1) -> TaskSpec:
    return TaskSpec(task_id=task_id, priority=priority, kind="training", num_gpus=2, vram_mib=vram_mib,
                    gpu_share=0.9)


def test_no_node_is_held_where_other_tenants_memory_keeps_the_task_out():
    """The demo's LoRA case: memory gpulb did not place decides which node a
    blocked task can ever get. n0 has a GPU free now but another tenant's
    20 GiB job on its other one; n1's two GPUs hold gpulb tasks over 2 GiB
    of other tenants' memory each. "huge" (2 x 20,000 MiB) fits an empty
    GPU but none of these once gpulb's tasks end: it holds nothing, so the
    2 x 16 GiB task behind it in its class holds n1 (not n0, where one GPU
    fits now but the other never will), and n1 drains for it."""
    clock = Clock()
    sched = Scheduler(SchedulerConfig(backfill_max_head_wait_s=10.0, backfill_max_skips=10_000), clock=clock)
    snapshot = ClusterSnapshot.build(
        [NodeFacts(f"n{i}", 2, labels={"host": f"n{i}"}) for i in range(2)],
        memory_used_mib=[20_480.0, 0.0, 2_048.0, 2_048.0],
    )
    for i in range(2):
        sched.submit(_pinned(f"g{i}", "n1", vram_mib=8192), snapshot)
    assert len(sched.dispatch(snapshot)) == 2
    sched.submit(_two_gpu("huge", 20_000), snapshot)
    sched.submit(_two_gpu("wide", 16_384), snapshot)
    assert sched.dispatch(snapshot) == []
    clock.now = 11.0  # both past the backfill bound
    for i in range(3):
        sched.submit(TaskSpec(task_id=f"late{i}", priority=Priority.P2, kind="batch", vram_mib=4096), snapshot)
    assert {t.assignment.node_id for t in sched.dispatch(snapshot)} == {"n0"}
    assert "huge" not in sched._held_nodes
    assert sched._held_nodes["wide"] == "n1"
    sched.dispatch(snapshot)
    assert sched.get("wide").reason.endswith("; node n1 is kept for it while gpulb's tasks there end")
    assert "kept for it" not in sched.get("huge").reason
    assert sched.get("huge").reason.endswith("; no node can take it until other processes there free memory (gpulb processes lists them)")
    assert "other processes" not in sched.get("wide").reason
    for i in range(2):
        task = sched.get(f"g{i}")
        sched.complete(task.task_id, task.assignment.lease_id)
    placed = [t.task_id for t in sched.dispatch(snapshot)]
    assert placed[0] == "wide" and sched.get("wide").assignment.node_id == "n1"
    assert sched.get("huge").state == TaskState.QUEUED


@pytest.mark.parametrize("estimates", [True, False])
def test_a_blocked_multi_gpu_task_keeps_less_urgent_work_off_the_node_that_frees_first(estimates):
    """From its first failure (long before it is a barrier), a P1 2-GPU task
    softly holds the node expected to free first: a P2 task that fits
    elsewhere goes elsewhere, and when that node's task ends the P1 task
    starts there at once. Without estimates a task is expected to run as
    long again as it has run, so the younger one frees first."""
    clock = Clock()
    sched = Scheduler(SchedulerConfig(backfill_max_head_wait_s=600.0, backfill_max_skips=10_000), clock=clock)
    snapshot = nodes(2, 2)
    # n0's task ends at 10 s, n1's at 100 s; without estimates n1's is the
    # younger (placed at 9 s against 0 s), so at 10 s it is expected to end first
    if estimates:
        sched.submit(_pinned("a", "n0", duration_s=10.0), snapshot)
        sched.submit(_pinned("b", "n1", duration_s=100.0), snapshot)
        sched.dispatch(snapshot)
        first, other = "n0", "n1"
    else:
        sched.submit(_pinned("a", "n0"), snapshot)
        sched.dispatch(snapshot)
        clock.now = 9.0
        sched.submit(_pinned("b", "n1"), snapshot)
        sched.dispatch(snapshot)
        first, other = "n1", "n0"
    clock.now = 9.5
    sched.submit(_two_gpu("ft", 16_384), snapshot)
    assert sched.dispatch(snapshot) == []
    sched.submit(TaskSpec(task_id="s", priority=Priority.P2, kind="batch", vram_mib=4096, gpu_share=0.2), snapshot)
    assert [t.assignment.node_id for t in sched.dispatch(snapshot)] == [other]
    assert sched._held_nodes["ft"] == first
    clock.now = 10.0
    done = sched.get("a" if first == "n0" else "b")
    sched.complete(done.task_id, done.assignment.lease_id)
    assert [(t.task_id, t.assignment.node_id) for t in sched.dispatch(snapshot)] == [("ft", first)]


def test_less_urgent_work_still_takes_a_softly_held_node_when_nothing_else_fits():
    clock = Clock()
    sched = Scheduler(SchedulerConfig(backfill_max_head_wait_s=600.0, backfill_max_skips=10_000), clock=clock)
    snapshot = nodes(2, 2)
    sched.submit(_pinned("a", "n0", duration_s=10.0), snapshot)
    for i in range(2):
        sched.submit(_pinned(f"b{i}", "n1", duration_s=100.0, vram_mib=18_432), snapshot)
    assert len(sched.dispatch(snapshot)) == 3
    sched.submit(_two_gpu("ft", 16_384), snapshot)
    assert sched.dispatch(snapshot) == []
    sched.submit(TaskSpec(task_id="s", priority=Priority.P2, kind="batch", vram_mib=4096, gpu_share=0.2), snapshot)
    assert [t.assignment.node_id for t in sched.dispatch(snapshot)] == ["n0"]
    assert sched._held_nodes["ft"] == "n0"
    # a more urgent task is not asked to keep off at all
    sched.submit(TaskSpec(task_id="p0", priority=Priority.P0, kind="inference", vram_mib=1024, gpu_share=0.1), snapshot)
    assert [t.assignment.node_id for t in sched.dispatch(snapshot)] == ["n0"]


def test_two_blocked_tasks_hold_different_nodes():
    clock = Clock()
    sched = Scheduler(SchedulerConfig(backfill_max_head_wait_s=600.0, backfill_max_skips=10_000), clock=clock)
    snapshot = nodes(3, 2)
    for i in range(3):
        sched.submit(_pinned(f"a{i}", f"n{i}", duration_s=10.0 * (i + 1)), snapshot)
    sched.dispatch(snapshot)
    sched.submit(_two_gpu("ft1", 16_384), snapshot)
    sched.submit(_two_gpu("ft2", 16_384), snapshot)
    assert sched.dispatch(snapshot) == []
    # the holds are chosen when less urgent work comes to ask where it may go
    sched.submit(TaskSpec(task_id="s", priority=Priority.P2, kind="batch", vram_mib=4096, gpu_share=0.2), snapshot)
    assert [t.assignment.node_id for t in sched.dispatch(snapshot)] == ["n2"]
    # the one queued first gets the node that frees first
    assert (sched._held_nodes["ft1"], sched._held_nodes["ft2"]) == ("n0", "n1")


def test_a_hold_survives_a_reading_that_lags_a_lease_end_but_not_a_lasting_change():
    """The memory of a task that ended shows in the readings for a round or
    two: the hold stays put for _HOLD_GRACE_S, then moves if the node still
    cannot take the task (another tenant's job took the memory)."""
    from scheduler.engine import _HOLD_GRACE_S

    clock = Clock()
    sched = Scheduler(SchedulerConfig(backfill_max_head_wait_s=600.0, backfill_max_skips=10_000), clock=clock)
    facts = [NodeFacts(f"n{i}", 2, labels={"host": f"n{i}"}) for i in range(2)]
    calm = ClusterSnapshot.build(facts)
    sched.submit(_pinned("a", "n0", duration_s=10.0), calm)
    sched.submit(_pinned("b", "n1", duration_s=100.0), calm)
    sched.dispatch(calm)
    sched.submit(_two_gpu("ft", 16_384), calm)
    sched.dispatch(calm)

    def ask(snapshot: ClusterSnapshot, n: int) -> None:
        # less urgent work asking where it may go makes the engine look at the hold
        sched.submit(TaskSpec(task_id=f"probe{n}", priority=Priority.P3, vram_mib=64, gpu_share=0.01), snapshot)
        sched.dispatch(snapshot)

    ask(calm, 0)
    assert sched._held_nodes["ft"] == "n0"
    # 12 GiB that is not gpulb's shows on n0's second GPU
    other_tenant = ClusterSnapshot.build(facts, memory_used_mib=[0.0, 12_288.0, 0.0, 0.0])
    clock.now = 1.0
    ask(other_tenant, 1)
    assert sched._held_nodes["ft"] == "n0"
    clock.now = 1.0 + _HOLD_GRACE_S + 0.1
    ask(other_tenant, 2)
    assert sched._held_nodes["ft"] == "n1"


def test_the_node_kept_is_the_one_that_would_finish_the_task_first():
    """On a mixed cluster the node that frees first is not the one that
    finishes first: a 1,000 s task on a node at a tenth of the speed would
    end at ~10,010 s there, at 1,100 s on the fast node that frees at 100 s."""
    clock = Clock()
    sched = Scheduler(SchedulerConfig(backfill_max_head_wait_s=600.0, backfill_max_skips=10_000), clock=clock)
    snapshot = ClusterSnapshot.build([
        NodeFacts("slow", 2, labels={"host": "slow"}, speed=0.1),
        NodeFacts("fast", 2, labels={"host": "fast"}, speed=1.0),
    ])
    sched.submit(_pinned("a", "slow", duration_s=1.0), snapshot)  # 10 s at a tenth of the speed
    sched.submit(_pinned("b", "fast", duration_s=100.0), snapshot)
    sched.dispatch(snapshot)
    sched.submit(dataclasses.replace(_two_gpu("ft", 16_384), duration_s=1_000.0), snapshot)
    sched.dispatch(snapshot)
    sched.submit(TaskSpec(task_id="s", priority=Priority.P2, kind="batch", vram_mib=1024, gpu_share=0.1), snapshot)
    sched.dispatch(snapshot)
    assert sched._held_nodes["ft"] == "fast"


def test_a_migrated_task_is_expected_to_end_when_its_run_would_have_not_a_whole_run_after_the_move():
    # s0 (1,000 s) and s1 (1,200 s) each fill one GPU of two on their node,
    # so the 2-GPU head fits nowhere. At 900 s s0 moves to its node's other
    # GPU: its run still ends near 1,000 s, not 900 + 1,000 s, so n0 is the
    # node that frees first and the one the head keeps.
    clock = Clock()
    sched = Scheduler(SchedulerConfig(backfill_max_head_wait_s=10.0, backfill_max_skips=10_000,
                                      backfill_estimate_factor=2.0, lease_s=100_000.0), clock=clock)
    snapshot = nodes(2, 2)
    for i, duration in ((0, 1_000.0), (1, 1_200.0)):
        sched.submit(TaskSpec(task_id=f"s{i}", priority=Priority.P2, kind="batch", vram_mib=18432, gpu_share=0.2,
                              duration_s=duration, required_node_labels={"host": f"n{i}"}), snapshot)
    sched.dispatch(snapshot)
    sched.submit(TaskSpec(task_id="big", priority=Priority.P2, kind="training", num_gpus=2, vram_mib=18432,
                          gpu_share=1.0, duration_s=5_000.0), snapshot)
    assert sched.dispatch(snapshot) == []
    clock.now = 900.0
    s0 = sched.get("s0").assignment
    moved = sched.migrate("s0", s0.lease_id, ["GPU-n0-1"]).assignment
    assert (moved.placed_at, moved.run_started_at, moved.run_start) == (900.0, 0.0, 0.0)
    assert sched.dispatch(snapshot) == []
    assert sched._held_nodes["big"] == "n0"
    # moved again, within the node: refused while the head keeps it
    with pytest.raises(Unplaceable, match="node n0 is kept for a blocked multi-GPU task while"):
        sched.migrate("s0", moved.lease_id, ["GPU-n0-0"])


def _learned(snapshot, field: str, **by_kind: float):
    """``snapshot`` carrying a learned per-kind column (``gpu_slowdown`` or
    ``gpu_overrun``), one value per kind on every GPU."""
    return dataclasses.replace(snapshot, **{field: {k: np.full(snapshot.gpu_count, v) for k, v in by_kind.items()}})


def _backfill_eval_and_batch(field: str, **by_kind: float):
    """A 400 s "eval" and a 400 s "batch" task pinned to the held node (its
    lease ends at 1,000 s) under learned ``field`` columns: what is placed,
    and the scheduler."""
    _, sched, snapshot, held = _held_node_setup()
    learned = _learned(snapshot, field, **by_kind)
    sched.submit(dataclasses.replace(short("eval-400", held, 400.0), kind="eval"), learned)
    sched.submit(short("batch-400", held, 400.0), learned)
    return [t.task_id for t in sched.dispatch(learned)], sched


def test_the_backfill_trusts_an_estimate_as_far_as_its_kind_has_kept_to_estimates():
    """With learned slowdowns in the snapshot (actual over estimated run time
    per kind, what the coordinator's predictor annotates), a kind that runs
    three times its estimate is judged by that: 400 s of "eval" is 1,200 s,
    twice that ends after the held node's 1,000 s lease; 400 s of "batch",
    whose kind keeps to its estimates, still backfills."""
    placed, sched = _backfill_eval_and_batch("gpu_slowdown", batch=1.0, eval=3.0)
    assert placed == ["batch-400"] and "waiting" in sched.get("eval-400").reason
    # without what was learned, the eval task's 400 s estimate is taken at its word
    placed, _ = _backfill_eval_and_batch("gpu_slowdown")
    assert placed == ["eval-400", "batch-400"]


def test_a_lease_whose_kind_overruns_its_estimates_drains_later_so_more_fits_before_it():
    """The held node's lease is "batch", 1,000 s estimated; learned: batch
    runs 2.5 times its estimates, so the node drains at ~2,500 s, and an
    "eval" task (kind at its word) of 1,000 s (x2 = 2,000 s) ends before."""
    _, sched, snapshot, held = _held_node_setup()
    learned = _learned(snapshot, "gpu_slowdown", batch=2.5, eval=1.0)
    sched.submit(dataclasses.replace(short("eval-1000", held, 1_000.0), kind="eval"), learned)
    assert [t.task_id for t in sched.dispatch(learned)] == ["eval-1000"]
    _, sched, snapshot, held = _held_node_setup()
    sched.submit(dataclasses.replace(short("eval-1000", held, 1_000.0), kind="eval"), snapshot)
    assert sched.dispatch(snapshot) == []


def test_a_kind_whose_runs_scatter_around_their_estimates_gets_a_wider_margin():
    """Learned: 10 % of "eval" runs take 3 times what was predicted for them
    (clients that misjudge it), so the margin for eval widens from the
    factor's 2 to 3: 400 s is 1,200 s, past the held node's 1,000 s lease;
    "batch" keeps to its estimates (overrun 1.1): its margin stays 2."""
    placed, sched = _backfill_eval_and_batch("gpu_overrun", batch=1.1, eval=3.0)
    assert placed == ["batch-400"] and "waiting" in sched.get("eval-400").reason
    # a kind learned on other GPUs only (NaN here) keeps the factor's margin
    placed, _ = _backfill_eval_and_batch("gpu_overrun", eval=np.nan)
    assert placed == ["eval-400", "batch-400"]


def test_only_the_most_urgent_barrier_is_said_to_have_its_node_kept():
    """A P3 task past the backfill bound holds n0; then a P1 one, more
    urgent, holds n1, and from then on only it fences its node (the queue
    keeps one). The P3 task's reason had gone on saying "node n0 is kept for
    it" while other work was placed on n0 (QA); it now says the node is
    chosen for it, to be kept once no more urgent task waits, and says
    "kept" again once it is the most urgent barrier."""
    clock = Clock()
    sched = Scheduler(SchedulerConfig(backfill_max_head_wait_s=10.0, backfill_max_skips=10_000,
                                      promote_after_s=(1e6, 1e6, 1e6)), clock=clock)
    snapshot = ClusterSnapshot.build([NodeFacts(f"n{i}", 1, labels={"host": f"n{i}"}) for i in range(2)])
    for i in range(2):
        sched.submit(_pinned(f"busy{i}", f"n{i}", vram_mib=16_384), snapshot)
    assert len(sched.dispatch(snapshot)) == 2
    whole = dict(kind="batch", vram_mib=16_384, gpu_share=1.0)
    sched.submit(TaskSpec(task_id="bg", priority=Priority.P3, **whole), snapshot)
    assert sched.dispatch(snapshot) == []
    clock.now = 11.0
    sched.dispatch(snapshot)
    bg_node = sched._held_nodes["bg"]
    assert sched.get("bg").reason.endswith(f"; node {bg_node} is kept for it while gpulb's tasks there end")
    sched.submit(TaskSpec(task_id="urgent", priority=Priority.P1, **whole), snapshot)
    sched.dispatch(snapshot)
    clock.now = 22.0
    sched.dispatch(snapshot)
    assert sched._queue.head_barrier == "urgent" and "urgent" in sched._held_nodes
    assert sched.get("urgent").reason.endswith(" is kept for it while gpulb's tasks there end")
    assert sched.get("bg").reason.endswith(
        f"; node {bg_node} is chosen for it, to be kept once no more urgent task is waiting for a node")
    sched.cancel("urgent")
    sched.dispatch(snapshot)
    assert sched.get("bg").reason.endswith(f"; node {bg_node} is kept for it while gpulb's tasks there end")
