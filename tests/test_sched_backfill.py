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
