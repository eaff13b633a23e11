"""Preemption: a P0 task that fits nowhere evicts lower-priority leases, the
GPUs are kept for it until the readings show them free, and the victims go
back to the queue (scheduler.engine, ``_preempt``).

Cards here are 24,564 MiB: the memory filter admits up to 85 %, 20,879 MiB.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from scheduler.config import SchedulerConfig
from scheduler.engine import Scheduler
from scheduler.errors import InvalidArgument, NotLeaseHolder, Unplaceable
from scheduler.snapshot import ClusterSnapshot, NodeFacts
from scheduler.task import Priority, TaskSpec, TaskState

GIB = 1024.0


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make(**config):
    clock = Clock()
    ids = (f"lease-{i}" for i in itertools.count())
    seen = []
    sched = Scheduler(SchedulerConfig(**config), clock=clock, lease_ids=lambda: next(ids), on_change=seen.append)
    return sched, clock, seen


def spec(task_id: str, gib: float, priority: Priority = Priority.P3, share: float = 0.5, **changes) -> TaskSpec:
    kind = {Priority.P0: "inference", Priority.P1: "training", Priority.P2: "batch"}.get(priority, "background")
    return TaskSpec(task_id=task_id, vram_mib=gib * GIB, gpu_share=share, priority=priority, kind=kind, **changes)


def cluster(used_gib, nodes=1, gpus=None) -> ClusterSnapshot:
    facts = [NodeFacts(f"n{i}", gpus or len(used_gib) // nodes) for i in range(nodes)]
    return ClusterSnapshot.build(facts, memory_used_mib=[g * GIB for g in used_gib])


def put(sched, s: TaskSpec, row: int, truth: list, nodes: int = 1):
    """Place ``s`` on GPU ``row`` (the others read full while it is placed)
    and add its memory to ``truth``, the readings (GiB per GPU) from then on."""
    full = [20.5 if r != row else used for r, used in enumerate(truth)]
    snap = cluster(full, nodes=nodes, gpus=len(truth) // nodes)
    sched.submit(s, snap)
    placed = sched.dispatch(snap)
    assert [t.task_id for t in placed] == [s.task_id]
    truth[row] += s.vram_mib / GIB
    return placed[0]


def test_a_p0_task_evicts_the_background_task_and_takes_its_gpu_once_the_readings_show_it_free():
    sched, clock, seen = make()
    # background (P3, 16 GiB) on GPU 0, batch (P2, 19 GiB) on GPU 1
    truth = [0.0, 0.0]
    leases = {}
    for s, row in ((spec("bg", 16), 0), (spec("batch", 19, Priority.P2), 1)):
        leases[s.task_id] = put(sched, s, row, truth)
    bg_gpu = leases["bg"].assignment.gpu_uuids[0]
    busy = cluster(truth)
    assert sched.dispatch(busy) == []

    sched.submit(spec("urgent", 16, Priority.P0), busy)
    assert sched.dispatch(busy) == []
    assert sched.get("bg").state == TaskState.LEASED  # not before preempt_after_s (1 s)
    assert sched.next_decision_at() == pytest.approx(1001.0)

    clock.now += 1.0
    seen.clear()
    assert sched.dispatch(busy) == []
    # the background task is the victim, not the batch one: P3 goes before P2
    assert [(t.task_id, t.state) for t in seen if t.task_id == "bg"] == [
        ("bg", TaskState.PREEMPTED), ("bg", TaskState.QUEUED)]
    evicted = next(t for t in seen if t.state == TaskState.PREEMPTED)
    assert evicted.assignment.gpu_uuids == (bg_gpu,)  # watchers see which GPUs it left
    # the P0 task is not named: its owner may be another tenant (QA pass 24)
    assert evicted.reason == "preempted for a P0 task on node n0"
    assert sched.get("batch").state == TaskState.LEASED
    bg = sched.get("bg")
    assert bg.assignment is None and bg.priority == Priority.P3 and "re-queued" in bg.reason
    assert "urgent" not in bg.reason
    with pytest.raises(NotLeaseHolder):  # its lease holder can no longer complete or renew it
        sched.complete("bg", leases["bg"].assignment.lease_id)
    urgent = sched.get("urgent")
    assert urgent.state == TaskState.QUEUED
    assert "1 lower-priority task(s) evicted for it from node n0" in urgent.reason
    kept = sched.nominations()["urgent"]
    assert kept.gpu_uuids == (bg_gpu,) and kept.victims == ("bg",) and kept.until == pytest.approx(1031.0)
    assert sched.preemption_counts == {"nominated": 1, "evicted": 1}

    # the readings still show the victim's memory: nothing fits yet, and a
    # small task that would fit beside it keeps off the GPU kept for the P0
    clock.now += 1.0
    sched.submit(spec("small", 2), busy)
    assert sched.dispatch(busy) == []
    assert "small" not in [t.task_id for t in sched.tasks(state=TaskState.LEASED)]

    # the victim's memory shows free: the P0 task goes there, the small one beside it
    freed = cluster([0, 19])
    clock.now += 1.0
    placed = {t.task_id: t for t in sched.dispatch(freed)}
    assert placed["urgent"].assignment.gpu_uuids == (bg_gpu,)
    assert set(placed) == {"urgent", "small"}
    assert sched.get("bg").state == TaskState.QUEUED  # 16 + 16 GiB does not fit one card
    assert sched.nominations() == {}
    assert sched.preemption_counts == {"nominated": 1, "evicted": 1, "placed_there": 1}
    assert not sched.get("urgent").sla_missed  # 3 s < 5 s


def test_a_victim_goes_back_to_the_head_of_its_class_not_behind_what_came_while_it_ran():
    sched, clock, _ = make()
    truth = [0.0]
    put(sched, spec("bg", 16), 0, truth)
    busy = cluster(truth)
    for i in range(3):
        clock.now += 1.0
        sched.submit(spec(f"later-{i}", 16), busy)
    sched.submit(spec("urgent", 16, Priority.P0), busy)
    assert sched.dispatch(busy) == []
    clock.now += 1.0
    sched.dispatch(busy)
    assert sched.get("bg").state == TaskState.QUEUED
    order = [t.task_id for t in sched.queue_summary().head]
    assert order == ["urgent", "bg", "later-0", "later-1", "later-2"]


def test_p0_and_p1_leases_are_never_evicted_and_p2_only_when_allowed():
    sched, clock, _ = make(preempt_min_victim_priority=3)
    empty = cluster([0, 0, 0])
    for s in (spec("p0", 16, Priority.P0), spec("p1", 16, Priority.P1), spec("p2", 16, Priority.P2)):
        sched.submit(s, empty)
    assert len(sched.dispatch(empty)) == 3
    busy = cluster([16, 16, 16], gpus=3)
    sched.submit(spec("urgent", 16, Priority.P0), busy)
    clock.now += 2.0
    assert sched.dispatch(busy) == []
    assert sched.preemption_counts == {}
    assert all(sched.get(t).state == TaskState.LEASED for t in ("p0", "p1", "p2"))
    assert "evicted" not in sched.get("urgent").reason
    assert sched.get("urgent").reason.endswith("; evicting P3 work would not free a GPU for it")

    # with P2 allowed (the default) the batch task goes
    sched.reconfigure(SchedulerConfig(preempt_min_victim_priority=2))
    assert sched.dispatch(busy) == []
    assert sched.get("p2").state == TaskState.QUEUED and sched.preemption_counts["evicted"] == 1


def test_nothing_is_evicted_when_it_would_not_make_room():
    # 10 GiB of memory gpulb did not place (another process) stays: evicting
    # the 4 GiB background task leaves 20.4 - 10 = 10.4 GiB, short of 16
    sched, clock, _ = make()
    snap = ClusterSnapshot.build([NodeFacts("n0", 1)], memory_used_mib=[10 * GIB])
    sched.submit(spec("bg", 4), snap)
    assert len(sched.dispatch(snap)) == 1
    sched.submit(spec("urgent", 16, Priority.P0), snap)
    clock.now += 5.0
    assert sched.dispatch(snap) == []
    assert sched.get("bg").state == TaskState.LEASED and sched.preemption_counts == {}


def test_preemption_off_evicts_nothing():
    sched, clock, _ = make(preemption=False)
    empty = cluster([0], gpus=1)
    sched.submit(spec("bg", 16), empty)
    sched.dispatch(empty)
    busy = cluster([16], gpus=1)
    sched.submit(spec("urgent", 16, Priority.P0), busy)
    clock.now += 10.0
    assert sched.dispatch(busy) == []
    assert sched.get("bg").state == TaskState.LEASED and sched.next_decision_at() is None


def test_among_gpus_the_policy_scores_alike_the_cheapest_to_clear_is_chosen():
    # Two 8 GiB tasks on each GPU, the same memory, compute and task count, so
    # load_aware scores them alike: background on GPU 0, batch on GPU 1,
    # background on GPU 2 but one of them not movable. P3 victims beat P2
    # ones; of the two P3 GPUs the one whose victims all checkpoint wins.
    sched, clock, _ = make()
    truth = [0.0, 0.0, 0.0]
    # (the all-movable GPU last, so the row order cannot be what picks it)
    layout = [(spec("c1", 8, share=0.25, movable=True), 0), (spec("c2", 8, share=0.25), 0),
              (spec("b1", 8, Priority.P2, share=0.25, movable=True), 1),
              (spec("b2", 8, Priority.P2, share=0.25, movable=True), 1),
              (spec("a1", 8, share=0.25, movable=True), 2), (spec("a2", 8, share=0.25, movable=True), 2)]
    for s, row in layout:
        put(sched, s, row, truth)
    busy = cluster(truth, gpus=3)
    sched.submit(spec("urgent", 16, Priority.P0), busy)
    clock.now += 1.0
    sched.dispatch(busy)
    kept = sched.nominations()["urgent"]
    assert kept.gpu_uuids == ("GPU-n0-2",) and sorted(kept.victims) == ["a1", "a2"]
    assert sched.get("b1").state == TaskState.LEASED and sched.get("c2").state == TaskState.LEASED


def test_the_gpu_the_policy_would_give_the_task_beats_a_cheaper_eviction():
    # GPU 0 holds a background task (P3: the cheaper victim) using all its
    # compute; GPU 1 a batch task (P2) using a tenth: the urgent task is
    # better off on GPU 1, and load_aware scores it so
    sched, clock, _ = make()
    truth = [0.0, 0.0]
    put(sched, spec("bg", 16, share=1.0), 0, truth)
    put(sched, spec("batch", 16, Priority.P2, share=0.1), 1, truth)
    busy = ClusterSnapshot.build([NodeFacts("n0", 2)], memory_used_mib=[16 * GIB, 16 * GIB], util_pct=[100.0, 10.0])
    sched.submit(spec("urgent", 16, Priority.P0), busy)
    clock.now += 1.0
    sched.dispatch(busy)
    assert sched.nominations()["urgent"].victims == ("batch",)
    assert sched.get("bg").state == TaskState.LEASED


def _old_and_new_then_urgent(sched, clock, new: str) -> None:
    """Batch task "old" on GPU 0, ``new`` on GPU 1 100 s later, then a P0
    task that fits nowhere, dispatched once it may evict."""
    truth = [0.0, 0.0]
    put(sched, spec("old", 16), 0, truth)
    clock.now += 100.0
    put(sched, spec(new, 16), 1, truth)
    busy = cluster(truth)
    sched.submit(spec("urgent", 16, Priority.P0), busy)
    clock.now += 1.0
    sched.dispatch(busy)


def test_of_two_alike_victims_the_one_placed_last_goes():
    sched, clock, _ = make()
    _old_and_new_then_urgent(sched, clock, "new")
    assert sched.nominations()["urgent"].victims == ("new",)  # 1 s of work lost, not 101 s


def test_no_gpu_that_needs_more_victims_than_allowed():
    sched, clock, _ = make(preempt_max_victims=2)
    empty = cluster([0], gpus=1)
    for i in range(3):
        sched.submit(spec(f"bg{i}", 5), empty)
    assert len(sched.dispatch(empty)) == 3
    busy = cluster([15], gpus=1)
    sched.submit(spec("urgent", 16, Priority.P0), busy)  # needs 16 - (20.4 - 15) = 10.6 GiB freed: 3 victims
    clock.now += 1.0
    sched.dispatch(busy)
    assert sched.preemption_counts == {} and len(sched.leased()) == 3


def test_kept_gpus_lapse_when_the_memory_never_shows_free_and_the_task_may_evict_again():
    sched, clock, _ = make(preempt_grace_s=10.0)
    empty = cluster([0, 0])
    sched.submit(spec("bg0", 16), empty)
    sched.submit(spec("bg1", 16), empty)
    sched.dispatch(empty)
    busy = cluster([16, 16])
    sched.submit(spec("urgent", 16, Priority.P0), busy)
    clock.now += 1.0
    sched.dispatch(busy)
    first = sched.nominations()["urgent"]
    assert sched.next_decision_at() == clock.now  # the victim's room may show at once: try again
    assert sched.dispatch(busy) == []
    assert sched.next_decision_at() == pytest.approx(first.until)
    # the victim's process never stops: its memory stays in the readings
    clock.now = first.until
    sched.dispatch(busy)
    second = sched.nominations()["urgent"]
    assert second.gpu_uuids != first.gpu_uuids  # the other GPU this time
    assert sched.preemption_counts == {"nominated": 2, "evicted": 2, "lapsed": 1}


def test_a_two_gpu_p0_task_clears_two_gpus_of_one_node():
    sched, clock, _ = make()
    empty = cluster([0, 0, 0, 0], nodes=2)
    for i in range(4):
        sched.submit(spec(f"bg{i}", 16), empty)
    assert len(sched.dispatch(empty)) == 4
    busy = cluster([16, 16, 16, 16], nodes=2)
    sched.submit(spec("urgent", 16, Priority.P0, num_gpus=2), busy)
    clock.now += 1.0
    sched.dispatch(busy)
    kept = sched.nominations()["urgent"]
    assert len(kept.gpu_uuids) == 2 and len(kept.victims) == 2
    assert {u.split("-")[1] for u in kept.gpu_uuids} == {kept.node_id}
    freed = [0 if f"GPU-n{i // 2}-{i % 2}" in kept.gpu_uuids else 16 for i in range(4)]
    clock.now += 2.5
    placed = sched.dispatch(cluster(freed, nodes=2))
    assert [t.task_id for t in placed] == ["urgent"] and set(placed[0].assignment.gpu_uuids) == set(kept.gpu_uuids)


def test_a_migration_may_not_take_a_gpu_kept_for_a_p0_task():
    sched, clock, _ = make()
    truth = [0.0, 0.0]
    put(sched, spec("bg", 16), 0, truth)
    mover = put(sched, spec("mover", 2, Priority.P2), 1, truth)
    busy = cluster([16, 20])
    sched.submit(spec("urgent", 16, Priority.P0), busy)
    clock.now += 1.0
    sched.dispatch(busy)
    assert sched.nominations()["urgent"].gpu_uuids == ("GPU-n0-0",)
    with pytest.raises(Unplaceable, match="is kept for a P0 task: lower-priority tasks were evicted"):
        sched.migrate("mover", mover.assignment.lease_id, ["GPU-n0-0"], cluster([0, 20]))
    assert sched.get("mover").assignment.gpu_uuids == ("GPU-n0-1",)


@pytest.mark.parametrize("option, value", [
    ("preempt_after_s", -1.0), ("preempt_after_s", float("nan")), ("preempt_min_victim_priority", 0),
    ("preempt_min_victim_priority", 4), ("preempt_max_victims", 0), ("preempt_grace_s", 0.0),
    ("preempt_min_run_s", -1.0), ("preempt_min_run_s", float("inf")),
])
def test_bad_preemption_settings_are_refused_by_name(option, value):
    with pytest.raises(InvalidArgument) as err:
        SchedulerConfig(**{option: value}).validate()
    assert err.value.field == option


def test_a_task_that_checkpoints_is_not_the_victim_every_time():
    # a and b (background, movable) share GPU 0. The first P0 task evicts b
    # (placed last); once b runs there again, the next one evicts a: among
    # tasks that lose only a restart, the one evicted least often goes
    sched, clock, _ = make()
    truth = [0.0]
    put(sched, spec("a", 8, movable=True), 0, truth)
    clock.now += 10.0
    put(sched, spec("b", 8, movable=True), 0, truth)
    busy = cluster(truth)
    sched.submit(spec("u1", 8, Priority.P0), busy)
    clock.now += 1.0
    sched.dispatch(busy)
    assert sched.nominations()["u1"].victims == ("b",)
    # b's memory shows free: u1 goes there; u1 ends; b runs there again
    clock.now += 2.5
    placed = {t.task_id: t for t in sched.dispatch(cluster([8.0]))}
    assert "u1" in placed
    sched.complete("u1", placed["u1"].assignment.lease_id)
    clock.now += 2.5
    again = sched.dispatch(cluster([8.0]))
    assert [t.task_id for t in again] == ["b"]
    busy = cluster([16.0])
    sched.submit(spec("u2", 8, Priority.P0), busy)
    clock.now += 1.0
    sched.dispatch(busy)
    assert sched.nominations()["u2"].victims == ("a",)


def test_a_lease_younger_than_preempt_min_run_s_is_exempt():
    sched, clock, _ = make(preempt_min_run_s=60.0)
    _old_and_new_then_urgent(sched, clock, "young")
    # without the exemption "young" would go (the least work lost)
    assert sched.nominations()["urgent"].victims == ("old",)
    assert sched.get("young").state == TaskState.LEASED


def linked(used_gib) -> ClusterSnapshot:
    """One host of four cards with NVLink in pairs, 0-1 and 2-3 (PCIe between the pairs)."""
    return ClusterSnapshot.build([NodeFacts("n0", 4, nvlink_pairs=((0, 1), (2, 3)))],
                                 memory_used_mib=[g * GIB for g in used_gib])


def _fill_pairs(sched, clock, tenants) -> list[float]:
    """Place ``tenants`` (spec per GPU row 0..3, in that order, 10 s apart)
    one GPU each; the readings (GiB per GPU) once all run."""
    truth = [0.0] * 4
    for row, s in enumerate(tenants):
        snap = linked([20.5 if r != row else used for r, used in enumerate(truth)])
        sched.submit(s, snap)
        assert [t.task_id for t in sched.dispatch(snap)] == [s.task_id]
        truth[row] += s.vram_mib / GIB
        clock.now += 10.0
    return truth


def test_an_nvlink_p0_task_clears_one_linked_pair_not_the_two_cheapest_gpus():
    sched, clock, _ = make()
    # the two cheapest victims, the background tasks placed last, sit on
    # GPUs 3 and 1, which NVLink does not join; of the two linked pairs,
    # 0-1 costs two background tasks, 2-3 a batch task too (P2 goes after P3)
    truth = _fill_pairs(sched, clock, [spec("bg0", 16), spec("bg1", 16), spec("batch2", 16, Priority.P2),
                                       spec("bg3", 16)])
    busy = linked(truth)
    urgent = spec("urgent", 16, Priority.P0, num_gpus=2, needs_nvlink=True)
    sched.submit(urgent, busy)
    clock.now += 1.0
    assert sched.dispatch(busy) == []
    kept = sched.nominations()["urgent"]
    assert sorted(kept.gpu_uuids) == ["GPU-n0-0", "GPU-n0-1"]
    assert sorted(kept.victims) == ["bg0", "bg1"]
    assert sched.get("batch2").state == TaskState.LEASED and sched.get("bg3").state == TaskState.LEASED
    clock.now += 2.5
    placed = sched.dispatch(linked([0.0, 0.0, truth[2], truth[3]]))
    assert [t.task_id for t in placed] == ["urgent"]
    assert sorted(placed[0].assignment.gpu_uuids) == ["GPU-n0-0", "GPU-n0-1"]


def test_an_nvlink_p0_task_evicts_nothing_where_no_linked_group_can_be_cleared():
    sched, clock, _ = make()
    # P1 work on one GPU of each pair: GPUs 0 and 2 could be cleared, but they
    # are not linked, and a task that needs NVLink could not use them
    truth = _fill_pairs(sched, clock, [spec("bg0", 16), spec("train1", 16, Priority.P1), spec("bg2", 16),
                                       spec("train3", 16, Priority.P1)])
    busy = linked(truth)
    sched.submit(spec("urgent", 16, Priority.P0, num_gpus=2, needs_nvlink=True), busy)
    clock.now += 1.0
    assert sched.dispatch(busy) == []
    assert sched.nominations() == {} and sched.preemption_counts == {}
    assert len(sched.leased()) == 4
    assert sched.get("urgent").reason.endswith(
        "; evicting P2/P3 work would not free 2 NVLink-connected GPUs on one node for it")
    # the same task without NVLink takes GPUs 0 and 2
    sched.cancel("urgent")
    sched.submit(spec("urgent-pcie", 16, Priority.P0, num_gpus=2), busy)
    clock.now += 1.0
    sched.dispatch(busy)
    assert sorted(sched.nominations()["urgent-pcie"].gpu_uuids) == ["GPU-n0-0", "GPU-n0-2"]


def test_a_four_gpu_nvlink_p0_task_clears_one_linked_quad_and_is_placed_on_it():
    # an 8-GPU host with NVLink within each half (0-3, 4-7, all pairs): the
    # task needs four linked GPUs; the cheapest four victims straddle both halves
    quads = tuple((a, b) for half in (range(4), range(4, 8)) for a in half for b in half if a < b)

    def host(used_gib):
        return ClusterSnapshot.build([NodeFacts("n0", 8, nvlink_pairs=quads)], memory_used_mib=[g * GIB for g in used_gib])

    sched, clock, _ = make()
    truth = [0.0] * 8
    # background everywhere; the low half placed first (more work lost), the high half's GPU 7 batch
    for row in (0, 1, 2, 4, 3, 5, 6, 7):
        s = spec(f"t{row}", 16, Priority.P2 if row == 7 else Priority.P3)
        snap = host([20.5 if r != row else used for r, used in enumerate(truth)])
        sched.submit(s, snap)
        assert [t.task_id for t in sched.dispatch(snap)] == [s.task_id]
        truth[row] += 16.0
        clock.now += 10.0
    busy = host(truth)
    sched.submit(spec("urgent", 16, Priority.P0, num_gpus=4, needs_nvlink=True), busy)
    clock.now += 1.0
    assert sched.dispatch(busy) == []
    kept = sched.nominations()["urgent"]
    # 4-7 would cost the batch task too: the low half goes, though its tasks ran longer
    assert sorted(kept.gpu_uuids) == [f"GPU-n0-{i}" for i in range(4)]
    clock.now += 2.5
    placed = sched.dispatch(host([0.0] * 4 + truth[4:]))
    assert [t.task_id for t in placed] == ["urgent"]
    assert sorted(placed[0].assignment.gpu_uuids) == [f"GPU-n0-{i}" for i in range(4)]


def test_an_nvlink_p0_task_does_not_clear_a_pair_whose_nvlink_is_busy():
    # the set-up of the pair test above, with GPUs 0 and 1 reading NVLink
    # competition 0.9 (over nvlink_competition_max, 0.6): placement would
    # refuse them once cleared, so the eviction takes 2-3, batch task and all
    sched, clock, _ = make()
    truth = _fill_pairs(sched, clock, [spec("bg0", 16), spec("bg1", 16), spec("batch2", 16, Priority.P2),
                                       spec("bg3", 16)])
    busy = dataclasses.replace(linked(truth), nvlink_competition=np.array([0.9, 0.9, np.nan, np.nan]))
    sched.submit(spec("urgent", 16, Priority.P0, num_gpus=2, needs_nvlink=True), busy)
    clock.now += 1.0
    assert sched.dispatch(busy) == []
    kept = sched.nominations()["urgent"]
    assert sorted(kept.gpu_uuids) == ["GPU-n0-2", "GPU-n0-3"] and sorted(kept.victims) == ["batch2", "bg3"]


def test_a_p0_backlog_with_nothing_to_evict_shares_freed_gpus_by_the_class_weights():
    """Two GPUs busy with P0 work, a backlog of P0 tasks and of P1 tasks, all
    whole-GPU. P1 leases may not be evicted, so the P0 tasks stuck past
    preempt_after_s find no victim: they take their 8:4 share of the freed
    GPUs, not all of them. Before, every stuck P0 task was offered ahead of
    the weighted rounds at every dispatch, and the P1 work waited until the
    P0 backlog was gone (QA: a P1 task queued 27 s behind a P0 stream)."""
    sched, clock, _ = make()
    whole = 18.0  # GiB: one task per 24 GiB card
    truth = [0.0, 0.0]
    for i, row in ((0, 0), (1, 1)):
        put(sched, spec(f"running-{i}", whole, Priority.P0), row, truth)
    full = cluster(truth)
    for i in range(12):
        sched.submit(spec(f"p0-{i:02d}", whole, Priority.P0), full)
    for i in range(6):
        sched.submit(spec(f"p1-{i}", whole, Priority.P1), full)
    clock.now += 5.0  # every P0 task is past preempt_after_s (1 s)
    assert sched.dispatch(full) == []
    order = []
    for _ in range(9):  # each round: the two leases end, two GPUs free
        for task in [t for t in sched.tasks() if t.state == TaskState.LEASED]:
            sched.complete(task.task_id, task.assignment.lease_id)
        clock.now += 0.5  # younger than any P1 aging threshold
        order += [t.task_id[:2] for t in sched.dispatch(cluster([0.0, 0.0]))]
    first = order[:12]
    assert first.count("p1") >= 3, order  # 8:4 of 12 placements is 4; P0-first gave 0
    assert "p1" in order[:4], order


# ---- compute, and leases about to end (QA pass 25: the product's promises, live) ------------------------


def _stacked(sched, clock, shares=(1.0, 1.0, 1.0)):
    """GPU 0 (node n0, 80 GiB) runs three P3 batch tasks of 16 GiB each asking the shares
    given; GPU 1 (24 GiB) runs one of 20 GiB. The readings show them all."""
    truth = [0.0, 0.0]
    facts = [NodeFacts("n0", 1, memory_total_mib=80 * GIB), NodeFacts("n1", 1, memory_total_mib=24 * GIB)]

    def snap(used, util0=min(100.0, 100.0 * sum(shares))):
        return ClusterSnapshot.build(facts, memory_used_mib=[g * GIB for g in used], util_pct=[util0, 100.0])

    for i, share in enumerate(shares):
        s = spec(f"batch-{i}", 16, share=share)
        sched.submit(s, snap([truth[0], 24.0]))
        assert [t.task_id for t in sched.dispatch(snap([truth[0], 24.0]))] == [s.task_id]
        truth[0] += 16
    other = spec("other", 20, share=1.0)
    sched.submit(other, snap([80.0, truth[1]]))
    assert [t.task_id for t in sched.dispatch(snap([80.0, truth[1]]))] == ["other"]
    truth[1] += 20
    return truth, snap


def test_a_p0_task_that_fits_only_where_batch_work_takes_the_compute_evicts_for_it():
    """QA: every P0 inference task went at once to an A100 running three batch
    tasks of a whole GPU each, and got a quarter of it, with no eviction and
    no SLA miss. Now it evicts for its half of the GPU (all three: two would
    still ask 200 %), waits for their memory to show free, and the batch work
    does not come back onto its GPU while it runs."""
    sched, clock, seen = make(preempt_for_compute=True)
    truth, snap = _stacked(sched, clock)
    sched.submit(spec("urgent", 8, Priority.P0, share=0.5), snap(truth))
    assert sched.dispatch(snap(truth)) == []
    urgent = sched.get("urgent")
    assert urgent.state == TaskState.QUEUED and "for compute" in urgent.reason
    kept = sched.nominations()["urgent"]
    assert sorted(kept.victims) == ["batch-0", "batch-1", "batch-2"] and kept.node_id == "n0"
    assert sched.preemption_counts["for_compute"] == 1 and sched.preemption_counts["evicted"] == 3
    # it fits beside their memory already, but placed before the readings show them
    # gone its reservation would count their memory as its own for as long as it ran
    assert sched.dispatch(snap(truth)) == [] and sched.get("urgent").state == TaskState.QUEUED
    clock.now += 1.0
    truth[0] = 0.0  # the victims' memory shows free
    placed = sched.dispatch(snap(truth))
    assert [t.task_id for t in placed] == ["urgent"]
    assert placed[0].assignment.gpu_uuids == kept.gpu_uuids
    truth[0] += 8
    clock.now += 1.0
    running = snap(truth, util0=50.0)  # the readings show the P0 task at its half
    assert sched.dispatch(running) == []  # 72 GiB free there, but not the compute
    for i in range(3):
        batch = sched.get(f"batch-{i}")
        assert batch.state == TaskState.QUEUED and "run P0 work that keeps their compute" in batch.reason
    # a half-GPU task still fits beside it (50 % + 50 %)
    sched.submit(spec("half", 8, share=0.5), running)
    assert [t.task_id for t in sched.dispatch(running)] == ["half"]
    # once the P0 task ends, the batch work may go back
    sched.complete("urgent", sched.get("urgent").assignment.lease_id)
    clock.now += 1.0
    assert len(sched.dispatch(running)) >= 1


def test_a_p0_task_goes_where_compute_is_to_spare_before_evicting_anything():
    sched, clock, seen = make(preempt_for_compute=True)
    truth, snap = _stacked(sched, clock, shares=(1.0, 1.0, 0.0))  # GPU 0 asked for 200 %: no room for 50 %
    facts = [NodeFacts("n0", 1, memory_total_mib=80 * GIB), NodeFacts("n1", 1, memory_total_mib=24 * GIB),
             NodeFacts("n2", 1, memory_total_mib=24 * GIB)]
    roomy = ClusterSnapshot.build(facts, memory_used_mib=[g * GIB for g in truth] + [4 * GIB],
                                  util_pct=[100.0, 100.0, 30.0])
    sched.submit(spec("urgent", 8, Priority.P0, share=0.5), roomy)
    placed = sched.dispatch(roomy)
    assert [t.task_id for t in placed] == ["urgent"] and placed[0].assignment.node_id == "n2"
    assert sched.preemption_counts["evicted"] == 0


def test_with_preempt_for_compute_off_the_default_a_p0_task_shares_the_busy_gpu_as_before():
    sched, clock, seen = make()
    truth, snap = _stacked(sched, clock)
    sched.submit(spec("urgent", 8, Priority.P0, share=0.5), snap(truth))
    assert [t.task_id for t in sched.dispatch(snap(truth))] == ["urgent"]
    assert sched.preemption_counts["evicted"] == 0


def test_a_p0_task_waits_for_a_lease_expected_to_end_within_its_sla_instead_of_evicting():
    """QA: half of a P0 run's evictions were wasted: the P0 task was placed on
    a GPU another P0 lease freed a moment later, and its victim placed back
    where it had been. A lease whose own estimate ends within the SLA is
    waited for; one without an estimate is not."""
    for estimate, evicts in ((2.5, False), (0.0, True)):
        sched, clock, seen = make()
        truth = [0.0, 0.0]
        put(sched, spec("bg", 16), 0, truth)
        put(sched, spec("served", 16, Priority.P0, duration_s=estimate), 1, truth)
        sched.submit(spec("urgent", 16, Priority.P0), cluster(truth))
        assert sched.dispatch(cluster(truth)) == []
        clock.now += 1.0  # preempt_after_s: "served" is expected to end 1.5 s from now, within the 5 s SLA
        assert sched.dispatch(cluster(truth)) == []
        assert (sched.get("bg").state == TaskState.QUEUED) is evicts, estimate
        if not evicts:
            assert "expected to free room for it in 1.5 s" in sched.get("urgent").reason
            assert sched.preemption_counts["evicted"] == 0
            # a caller that dispatches only on events (the simulator) looks again then
            assert sched.next_decision_at() == pytest.approx(clock.now + 1.5)
            served = sched.get("served")
            sched.complete("served", served.assignment.lease_id)
            truth[1] -= 16
            clock.now += 1.5
            placed = sched.dispatch(cluster(truth))
            assert [t.task_id for t in placed] == ["urgent"]


def test_a_p0_task_is_not_skipped_for_a_same_shape_task_below_p0_that_the_guard_kept_off():
    """Review of round 25: the dispatch's cache of failed shapes did not know
    that the guard keeps only tasks below P0 off a P0 lease's GPU; a P1 task
    aged into class P0 failed there first, and the P0 task of the same shape
    behind it was skipped with the P1 task's reason."""
    for with_p1 in (False, True):
        sched, clock, seen = make(preempt_for_compute=True, promote_after_s=(0.5, 300.0, 600.0))
        facts = [NodeFacts("n0", 1, memory_total_mib=80 * GIB)]

        def snap(used, util):
            return ClusterSnapshot.build(facts, memory_used_mib=[used * GIB], util_pct=[util])

        sched.submit(spec("served", 8, Priority.P0, share=0.5), snap(0, 0))
        assert [t.task_id for t in sched.dispatch(snap(0, 0))] == ["served"]
        running = snap(8, 50)
        if with_p1:
            sched.submit(spec("p1", 4, Priority.P1, share=0.6), running)
            assert sched.dispatch(running) == []  # 50 % + 60 %: kept off
            clock.now += 1.0
            assert sched.dispatch(running) == [] and sched.get("p1").priority == Priority.P0  # aged
        sched.submit(spec("p0", 4, Priority.P0, share=0.6), running)
        placed = [t.task_id for t in sched.dispatch(running)]
        assert placed == ["p0"], (with_p1, sched.get("p0").reason)
