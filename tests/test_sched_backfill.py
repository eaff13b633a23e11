"""EASY-style backfill in the engine: a blocked multi-GPU head holds one node
for itself, tasks behind it keep flowing to the other nodes, and the head is
placed as soon as its node drains."""

from __future__ import annotations

from scheduler.config import SchedulerConfig
from scheduler.engine import Scheduler
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
