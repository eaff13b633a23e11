"""The Scheduler end to end on a fake clock: no double-booking, rejection of
tasks that never fit, idempotency, leases, lost nodes, policy swaps, listeners."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from scheduler.config import SchedulerConfig
from scheduler.engine import Scheduler
from scheduler.errors import (
    InvalidArgument,
    InvalidTask,
    InvalidWeight,
    NotLeaseHolder,
    TaskConflict,
    TaskFinished,
    UnknownPolicy,
    UnknownTask,
)
from scheduler.policies import POLICIES
from scheduler.snapshot import ClusterSnapshot, NodeFacts
from scheduler.task import Priority, Task, TaskSpec, TaskState

GIB = 1024.0


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make(config: SchedulerConfig | None = None, **kw) -> tuple[Scheduler, Clock]:
    clock = Clock()
    ids = (f"lease-{i}" for i in itertools.count())
    return Scheduler(config, clock=clock, lease_ids=lambda: next(ids), **kw), clock


def spec(task_id: str, **changes) -> TaskSpec:
    base = dict(task_id=task_id, vram_mib=2 * GIB, gpu_share=0.2, kind="batch")
    base.update(changes)
    return TaskSpec(**base)


def fifty_free_gpus() -> ClusterSnapshot:
    """Exactly 50 free 24 GiB GPUs, plus a node whose GPUs are nearly full."""
    nodes = [NodeFacts(f"n{i}", 8, memory_total_mib=24 * GIB) for i in range(6)]
    nodes.append(NodeFacts("n6", 2, memory_total_mib=24 * GIB))
    nodes.append(NodeFacts("full", 8, memory_total_mib=24 * GIB))
    used = [0.0] * 50 + [20 * GIB] * 8
    return ClusterSnapshot.build(nodes, memory_used_mib=used)


def test_leased_hands_out_the_live_leased_tasks_in_submission_order() -> None:
    sched, _ = make()
    snap = fifty_free_gpus()
    for i in range(60):
        sched.submit(spec(f"t{i:03d}", vram_mib=20 * GIB), snap)
    sched.dispatch(snap)
    leased = sched.leased()
    assert [t.task_id for t in leased] == [t.task_id for t in sched.tasks(state=TaskState.LEASED)]
    assert [t.task_id for t in leased] == [f"t{i:03d}" for i in range(50)]  # the ten that wait are not there
    first = leased[0]
    assert sched.leased()[0] is first  # the record itself, not a copy
    sched.complete(first.task_id, first.assignment.lease_id)
    assert first.state == TaskState.COMPLETED and sched.leased()[0].task_id == "t001"
    assert sched.state_counts() == Counter(t.state for t in sched.tasks(limit=10**9))
    assert sched.state_counts() == {TaskState.LEASED: 49, TaskState.QUEUED: 10, TaskState.COMPLETED: 1}


# ---- double booking --------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", list(POLICIES))
def test_no_double_booking_before_metrics_show_the_placements(policy: str) -> None:
    sched, clock = make(SchedulerConfig(policy=policy))
    snap = fifty_free_gpus()
    for i in range(100):
        assert sched.submit(spec(f"t{i:03d}", vram_mib=20 * GIB), snap).state == TaskState.QUEUED
    placed = sched.dispatch(snap)
    assert len(placed) == 50
    gpus = [t.assignment.gpu_uuids[0] for t in placed]
    assert len(set(gpus)) == 50 and not any("full" in g for g in gpus)
    assert Counter(t.state for t in sched.tasks()) == {TaskState.LEASED: 50, TaskState.QUEUED: 50}

    # the same snapshot again, and a new one that still does not show the tasks
    assert sched.dispatch(snap) == []
    clock.now += 1
    assert sched.dispatch(fifty_free_gpus()) == []
    queued = sched.tasks(state=TaskState.QUEUED)
    assert all(t.reason.startswith("waiting: no GPU fits") for t in queued)

    # leases complete: exactly that many more are placed, on the GPUs just freed
    done = placed[:10]
    for t in done:
        sched.complete(t.task_id, t.assignment.lease_id)
    second = sched.dispatch(fifty_free_gpus())
    assert len(second) == 10
    assert {t.assignment.gpu_uuids[0] for t in second} == {t.assignment.gpu_uuids[0] for t in done}
    leased = [t.assignment.gpu_uuids[0] for t in sched.tasks(state=TaskState.LEASED)]
    assert len(leased) == len(set(leased)) == 50

    # complete everything that runs, round after round: all 100 get placed, never two per GPU
    while sched.tasks(state=TaskState.QUEUED):
        for t in sched.tasks(state=TaskState.LEASED):
            sched.complete(t.task_id, t.assignment.lease_id)
        assert sched.dispatch(fifty_free_gpus())
        leased = [t.assignment.gpu_uuids[0] for t in sched.tasks(state=TaskState.LEASED)]
        assert len(leased) == len(set(leased))
    assert sched.queue_summary().placed == 100


def test_reservations_fade_when_the_readings_show_the_task() -> None:
    sched, _ = make()
    nodes = [NodeFacts("n", 1, memory_total_mib=24 * GIB)]
    empty = ClusterSnapshot.build(nodes)
    a = sched.submit(spec("a", vram_mib=8 * GIB), empty)
    b = sched.submit(spec("b", vram_mib=8 * GIB), empty)
    c = sched.submit(spec("c", vram_mib=8 * GIB), empty)
    assert [t.task_id for t in sched.dispatch(empty)] == ["a", "b"]  # 24 GiB at 85 %: room for two
    # the agent now reports both tasks (16 GiB used): still no room for a third
    shown = ClusterSnapshot.build(nodes, memory_used_mib=[16 * GIB])
    assert sched.dispatch(shown) == []
    # "a" ends; its memory is still in the reading, but the reservation of "b" has faded
    # and "a"'s is gone, so the scheduler trusts the reading: 16 + 8 GiB is over 85 %
    sched.complete("a", sched.get("a").assignment.lease_id)
    assert sched.dispatch(shown) == []
    # the reading drops once "a" has really exited
    freed = ClusterSnapshot.build(nodes, memory_used_mib=[8 * GIB])
    assert [t.task_id for t in sched.dispatch(freed)] == ["c"]
    assert a.task_id and b.task_id and c.task_id


# ---- submission ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, reason",
    [
        (dict(num_gpus=9), "num_gpus 9 exceeds every node"),
        (dict(vram_mib=30 * GIB), "vram_mib"),
        (dict(vram_mib=21 * GIB), "vram_mib"),  # above 85 % of 24 GiB
        (dict(gpu_spec="V100M16|V100M32"), "no GPU matches gpu_spec"),
        (dict(required_node_labels={"zone": "mars"}), "no node carries required_node_labels"),
        (dict(num_gpus=4, needs_nvlink=True), "no node has 4 NVLink-connected"),
    ],
)
def test_tasks_that_never_fit_are_rejected_with_the_reason(changes: dict, reason: str) -> None:
    seen: list[Task] = []
    sched, _ = make(on_change=seen.append)
    snap = fifty_free_gpus()
    task = sched.submit(spec("big", **changes), snap)
    assert task.state == TaskState.REJECTED and reason in task.reason
    assert task.finished_at is not None
    assert [t.state for t in seen] == [TaskState.REJECTED]
    assert sched.queue_summary().classes[Priority.P2].depth == 0


def test_tasks_submitted_before_any_snapshot_are_checked_at_the_first_dispatch() -> None:
    sched, _ = make()
    assert sched.submit(spec("huge", num_gpus=16)).state == TaskState.QUEUED
    assert sched.submit(spec("fine")).state == TaskState.QUEUED
    placed = sched.dispatch(fifty_free_gpus())
    assert [t.task_id for t in placed] == ["fine"]
    assert sched.get("huge").state == TaskState.REJECTED
    # later submissions are checked against the latest snapshot at once
    assert sched.submit(spec("huge2", num_gpus=16)).state == TaskState.REJECTED


def test_resubmission_is_idempotent_and_a_changed_spec_conflicts() -> None:
    sched, clock = make()
    snap = fifty_free_gpus()
    first = sched.submit(spec("a"), snap)
    clock.now += 5
    again = sched.submit(spec("a"), snap)
    assert again.submitted_at == first.submitted_at and again.state == TaskState.QUEUED
    sched.dispatch(snap)
    leased = sched.submit(spec("a"), snap)
    assert leased.state == TaskState.LEASED and leased.attempts == 1
    with pytest.raises(TaskConflict) as info:
        sched.submit(spec("a", vram_mib=4 * GIB, priority=Priority.P0), snap)
    assert info.value.task_id == "a" and info.value.fields == ("priority", "vram_mib")
    assert len(sched.tasks()) == 1


def test_finished_tasks_are_forgotten_oldest_first_past_the_retention() -> None:
    sched, _ = make(SchedulerConfig(retain_finished=2))
    snap = one_node()
    for name in "abc":
        sched.submit(spec(name), snap)
        sched.cancel(name)
    with pytest.raises(UnknownTask):
        sched.get("a")
    assert [t.task_id for t in sched.tasks()] == ["b", "c"]
    assert sched.submit(spec("a"), snap).state == TaskState.QUEUED  # a new task now


def test_finished_tasks_are_forgotten_past_the_retention_age_oldest_first() -> None:
    """prune_finished (the coordinator's finished_retention_s): a task that
    finished longer ago than the age is forgotten, by the store's rule
    (strictly older), oldest first, at most ``limit`` at a time; queued tasks
    stay, and a forgotten id may be submitted anew with another spec."""
    sched, clock = make(SchedulerConfig(retain_finished=100))
    snap = one_node()
    for name in "abcd":  # finished at 1000, 1010, 1020, 1030
        sched.submit(spec(name), snap)
        sched.cancel(name)
        clock.now += 10
    sched.submit(spec("live"), snap)
    assert clock.now == 1040.0
    assert sched.prune_finished(25.0) == 2  # a, b: 40 and 30 s ago
    assert sched.prune_finished(20.0) == 0  # c finished exactly 20 s ago: kept
    assert [t.task_id for t in sched.tasks()] == ["c", "d", "live"]
    assert sched.prune_finished(0.0, limit=1) == 1  # one at a time
    assert [t.task_id for t in sched.tasks()] == ["d", "live"]
    assert sched.prune_finished(0.0, now=1030.0) == 0  # d finished at 1030: not older than that
    assert sched.prune_finished(0.0) == 1
    assert [t.task_id for t in sched.tasks()] == ["live"]
    with pytest.raises(UnknownTask):
        sched.get("a")
    again = sched.submit(spec("a", vram_mib=4 * GIB), snap)  # no conflict with the forgotten one
    assert again.state == TaskState.QUEUED and again.spec.vram_mib == 4 * GIB


def test_invalid_specs_are_refused_before_anything_changes() -> None:
    sched, _ = make()
    with pytest.raises(InvalidTask) as info:
        sched.submit(spec("bad", gpu_share=float("nan")))
    assert info.value.field == "gpu_share"
    assert sched.tasks() == []


# ---- leases ------------------------------------------------------------------------------------------


def one_node() -> ClusterSnapshot:
    return ClusterSnapshot.build([NodeFacts("n", 2)])


def test_complete_fail_cancel_and_their_errors() -> None:
    sched, _ = make()
    snap = one_node()
    for name in "abc":
        sched.submit(spec(name, vram_mib=12 * GIB), snap)  # one per GPU
    sched.dispatch(snap)
    a, b = sched.get("a"), sched.get("b")
    with pytest.raises(NotLeaseHolder) as info:
        sched.complete("a", "someone-else")
    assert info.value.reason == "not the task's current lease"
    with pytest.raises(NotLeaseHolder) as info:
        sched.complete("c", "x")
    assert "QUEUED" in info.value.reason
    with pytest.raises(UnknownTask):
        sched.complete("zz", "x")

    done = sched.complete("a", a.assignment.lease_id)
    assert done.state == TaskState.COMPLETED and done.finished_at == 1000.0
    assert sched.complete("a", a.assignment.lease_id).state == TaskState.COMPLETED  # RPC retry
    assert sched.complete("b", b.assignment.lease_id, failed=True).state == TaskState.FAILED

    assert sched.cancel("c", "user asked").state == TaskState.CANCELLED
    assert sched.get("c").reason == "user asked"
    assert sched.cancel("c").state == TaskState.CANCELLED
    with pytest.raises(TaskFinished) as finished:
        sched.cancel("a")
    assert finished.value.state == "COMPLETED"
    assert sched.queue_summary().classes[Priority.P2].depth == 0


def test_cancelling_a_leased_task_frees_its_gpu() -> None:
    sched, _ = make()
    snap = ClusterSnapshot.build([NodeFacts("n", 1)])
    sched.submit(spec("a", vram_mib=18 * GIB), snap)
    sched.submit(spec("b", vram_mib=18 * GIB), snap)
    assert [t.task_id for t in sched.dispatch(snap)] == ["a"]
    sched.cancel("a")
    assert [t.task_id for t in sched.dispatch(snap)] == ["b"]


def test_leases_expire_on_the_clock_and_renewal_keeps_them() -> None:
    sched, clock = make(SchedulerConfig(lease_s=60.0))
    snap = one_node()
    sched.submit(spec("keep"), snap)
    sched.submit(spec("drop"), snap)
    sched.dispatch(snap)
    keep, drop = sched.get("keep"), sched.get("drop")
    assert keep.assignment.lease_expires_at == 1060.0
    clock.now = 1050.0
    renewed = sched.renew("keep", keep.assignment.lease_id, 100.0)
    assert renewed.assignment.lease_expires_at == 1150.0
    # now + the configured 60 s would be 1110: a renewal never shortens a lease (QA pass 24)
    assert sched.renew("keep", keep.assignment.lease_id).assignment.lease_expires_at == 1150.0
    assert sched.renew("keep", keep.assignment.lease_id, 0.0001).assignment.lease_expires_at == 1150.0
    with pytest.raises(InvalidArgument) as info:
        sched.renew("keep", keep.assignment.lease_id, -1.0)
    assert info.value.field == "extend_s"
    assert sched.expire_leases(1059.999) == []
    expired = sched.expire_leases(1060.0)
    assert [t.task_id for t in expired] == ["drop"] and expired[0].state == TaskState.EXPIRED
    clock.now = 1061.0
    with pytest.raises(NotLeaseHolder) as lease_error:
        sched.renew("drop", drop.assignment.lease_id)
    assert lease_error.value.reason == "the lease expired"
    # an unswept expiry is noticed by the call itself
    clock.now = 1200.0
    with pytest.raises(NotLeaseHolder):
        sched.complete("keep", keep.assignment.lease_id)
    assert sched.get("keep").state == TaskState.EXPIRED


def test_queue_deadline_expires_waiting_tasks() -> None:
    sched, clock = make()
    snap = ClusterSnapshot.build([NodeFacts("n", 1)], memory_used_mib=[24_000.0])
    sched.submit(spec("patient"), snap)
    sched.submit(spec("hurried", deadline_s=10.0), snap)
    clock.now += 9.9
    sched.dispatch(snap)
    assert sched.get("hurried").state == TaskState.QUEUED
    clock.now += 0.1
    sched.dispatch(snap)
    hurried = sched.get("hurried")
    assert hurried.state == TaskState.EXPIRED and "deadline_s 10" in hurried.reason
    assert sched.get("patient").state == TaskState.QUEUED


# ---- lost nodes ----------------------------------------------------------------------------------


def test_node_removal_loses_tasks_and_requeues_the_retryable() -> None:
    seen: list[tuple[str, TaskState]] = []
    sched, _ = make(SchedulerConfig(max_attempts=2), on_change=lambda t: seen.append((t.task_id, t.state)))
    snap = ClusterSnapshot.build([NodeFacts("doomed", 4), NodeFacts("other", 1, memory_total_mib=1.0)])
    sched.submit(spec("train", kind="training"), snap)
    sched.submit(spec("serve", kind="inference", priority=Priority.P0), snap)
    sched.submit(spec("moveme", kind="inference", movable=True), snap)
    sched.dispatch(snap)
    seen.clear()
    affected = {t.task_id: t for t in sched.node_removed("doomed")}
    assert affected["serve"].state == TaskState.LOST and "doomed" in affected["serve"].reason
    for name in ("train", "moveme"):
        task = affected[name]
        assert task.state == TaskState.QUEUED and task.assignment is None and task.attempts == 1
        assert seen.index((name, TaskState.LOST)) < seen.index((name, TaskState.QUEUED))
    assert sched.node_removed("doomed") == []
    # placed again, lost again: the attempt limit (2) leaves it LOST
    sched.dispatch(snap)
    assert sched.get("train").attempts == 2
    again = {t.task_id: t for t in sched.node_removed("doomed")}
    assert again["train"].state == TaskState.LOST


def test_a_requeued_tasks_lost_update_is_not_its_end() -> None:
    """A retryable task whose node is removed: its listeners see that run's
    LOST as not terminal (no finish time; QUEUED follows at once, so a watch
    goes on and it is not counted finished, as after PREEMPTED). A task that
    stays LOST, or a retryable one past the attempt limit, ends there."""
    seen: list[tuple[str, TaskState, bool, float | None]] = []
    sched, clock = make(SchedulerConfig(max_attempts=2),
                        on_change=lambda t: seen.append((t.task_id, t.state, t.terminal, t.finished_at)))
    snap = ClusterSnapshot.build([NodeFacts("doomed", 2), NodeFacts("other", 1, memory_total_mib=1.0)])
    sched.submit(spec("train", kind="training"), snap)
    sched.submit(spec("serve", kind="inference"), snap)
    sched.dispatch(snap)
    seen.clear()
    sched.node_removed("doomed")
    assert [s for s in seen if s[0] == "train"] == [("train", TaskState.LOST, False, None),
                                                   ("train", TaskState.QUEUED, False, None)]
    assert [s for s in seen if s[0] == "serve"] == [("serve", TaskState.LOST, True, clock.now)]
    assert not sched.get("train").requeued and not sched.get("train").terminal
    sched.dispatch(snap)
    seen.clear()
    sched.node_removed("doomed")  # its second placement lost: the attempt limit makes this LOST its end
    assert seen == [("train", TaskState.LOST, True, clock.now)]


# ---- policy ----------------------------------------------------------------------------------------


def test_policy_swap_changes_the_next_decision() -> None:
    sched, _ = make()
    snap = ClusterSnapshot.build([NodeFacts("n", 2)], memory_used_mib=[12_000.0, 0.0], util_pct=[5.0, 50.0])
    sched.submit(spec("first"), snap)
    sched.dispatch(snap)
    assert sched.get("first").assignment.gpu_indices == (0,)  # load_aware: the cooler GPU
    sched.cancel("first")
    info = sched.set_policy("binpack")
    assert info.name == "binpack" and set(info.available) == set(POLICIES)
    sched.submit(spec("second"), snap)
    sched.dispatch(snap)
    assert sched.get("second").assignment.gpu_indices == (0,)
    sched.cancel("second")
    sched.set_policy("load_aware", {"memory": 0.0, "load": 0.0, "jitter": 0.0, "temperature": 0.0})
    sched.submit(spec("third", vram_mib=9_000.0), snap)
    sched.dispatch(snap)
    # 12,000 + 9,000 is over 85 % on GPU 0: only GPU 1 fits
    assert sched.get("third").assignment.gpu_indices == (1,)
    assert sched.get("third").assignment.score.policy == "load_aware"


def test_load_aware_and_binpack_disagree_and_the_swap_shows() -> None:
    sched, _ = make()
    snap = ClusterSnapshot.build([NodeFacts("n", 2)], memory_used_mib=[10_000.0, 0.0], util_pct=[50.0, 5.0])
    sched.submit(spec("a"), snap)
    sched.dispatch(snap)
    assert sched.get("a").assignment.gpu_indices == (1,)
    sched.set_policy("binpack")
    sched.submit(spec("b"), snap)
    sched.dispatch(snap)
    assert sched.get("b").assignment.gpu_indices == (0,)
    assert sched.get("b").assignment.score.terms.keys() == {"free_after", "load_tiebreak"}


def test_bad_policy_changes_name_the_culprit_and_change_nothing() -> None:
    sched, _ = make()
    before = sched.get_policy()
    with pytest.raises(UnknownPolicy) as info:
        sched.set_policy("random")
    assert info.value.name == "random"
    with pytest.raises(InvalidWeight) as weight:
        sched.set_policy("binpack", {"memory": 1.0})
    assert weight.value.name == "memory"
    with pytest.raises(InvalidWeight):
        sched.set_policy("", {"load": -1.0})
    assert sched.get_policy() == before
    changed = sched.set_policy("", {"load": 2.5})
    assert changed.name == "load_aware" and changed.weights["load"] == 2.5
    assert changed.weights["memory"] == before.weights["memory"]


# ---- queue, aging, summaries, listeners -------------------------------------------------------------


def test_queue_summary_aging_and_sla() -> None:
    sched, clock = make()
    full = ClusterSnapshot.build([NodeFacts("n", 1)], memory_used_mib=[24_000.0])
    sched.submit(spec("rt", priority=Priority.P0, kind="inference"), full)
    sched.submit(spec("bg", priority=Priority.P3), full)
    sched.submit(spec("batch", priority=Priority.P2), full)
    clock.now += 4.0
    summary = sched.queue_summary()
    assert [c.depth for c in summary.classes] == [1, 0, 1, 1]
    assert summary.classes[0].oldest_wait_s == 4.0 and summary.sla_misses == 0
    assert [t.task_id for t in summary.head] == ["rt", "batch", "bg"]
    clock.now += 1.0
    sched.dispatch(full)
    assert sched.get("rt").sla_missed and sched.queue_summary().sla_misses == 1
    clock.now += 300.0
    sched.dispatch(full)
    assert sched.get("batch").priority == Priority.P1 and sched.get("bg").priority == Priority.P3


def test_listeners_get_copies_in_order_and_a_broken_one_breaks_nothing() -> None:
    sched, _ = make()
    seen: list[Task] = []

    def broken(task: Task) -> None:
        raise RuntimeError("listener bug")

    sched.add_listener(broken)
    unsubscribe = sched.add_listener(seen.append)
    snap = one_node()
    sched.submit(spec("a"), snap)
    sched.dispatch(snap)
    assert [t.state for t in seen] == [TaskState.QUEUED, TaskState.LEASED]
    seen[0].state = TaskState.FAILED  # a copy: the scheduler's record is untouched
    assert sched.get("a").state == TaskState.LEASED
    unsubscribe()
    sched.cancel("a")
    assert len(seen) == 2


def wide_task_wait(config: SchedulerConfig, ticks: int = 400) -> float | None:
    """One 8-GPU node, three 1-GPU tasks a second holding a whole GPU for 3 s, and
    an 8-GPU task arriving at t = 20: how long it waits (None: never placed)."""
    sched, clock = make(config)
    snap = ClusterSnapshot.build([NodeFacts("n", 8)])
    serial = itertools.count()
    started: dict[str, float] = {}
    for tick in range(ticks):
        clock.now = 1000.0 + tick
        for name, at in list(started.items()):
            if clock.now - at >= 3.0:
                sched.complete(name, sched.get(name).assignment.lease_id)
                del started[name]
        for _ in range(3):
            sched.submit(spec(f"s{next(serial)}", vram_mib=12 * GIB, priority=Priority.P1), snap)
        if tick == 20:
            sched.submit(spec("wide", num_gpus=8, vram_mib=12 * GIB, priority=Priority.P2), snap)
        for task in sched.dispatch(snap):
            if task.task_id == "wide":
                return task.assignment.placed_at - task.submitted_at
            started[task.task_id] = clock.now
    return None


def test_a_wide_task_is_not_starved_by_a_stream_of_small_ones() -> None:
    config = SchedulerConfig(backfill_max_head_wait_s=10.0, promote_after_s=(5.0, 10.0, 20.0))
    wait = wide_task_wait(config)
    # blocked at once and a barrier after 10 s, when it is also promoted to P1;
    # the P1 backlog queued before it still goes first (about 4 s), then nothing
    # passes it and the 3 s leases on its GPUs end
    assert wait is not None and 10.0 <= wait <= 10.0 + 5.0 + 3.0
    # the control: unbounded backfill and no aging starve it
    never = SchedulerConfig(
        backfill_max_head_wait_s=1e9, backfill_max_skips=10**9, promote_after_s=(1e9, 1e9, 1e9)
    )
    assert wide_task_wait(never) is None


def test_a_stale_node_only_takes_tasks_on_its_idle_gpus() -> None:
    sched, _ = make()
    snap = ClusterSnapshot.build([NodeFacts("quiet", 2, stale=True)], memory_used_mib=[float("nan")] * 2)
    for name in "abc":
        sched.submit(spec(name, vram_mib=1 * GIB), snap)
    placed = sched.dispatch(snap)
    assert sorted(t.assignment.gpu_indices[0] for t in placed) == [0, 1]
    assert placed[0].assignment.score.terms.keys() == {"stale"}
    waiting = sched.get("c")
    assert waiting.state == TaskState.QUEUED and "stale_busy 2" in waiting.reason


# ---- migration -------------------------------------------------------------------------------------


def two_nodes(used: list[float] | None = None) -> ClusterSnapshot:
    nodes = [NodeFacts("a", 2, memory_total_mib=24 * GIB), NodeFacts("b", 2, memory_total_mib=24 * GIB)]
    return ClusterSnapshot.build(nodes, memory_used_mib=used or [0.0] * 4)


def test_a_migration_moves_the_lease_in_one_step_and_frees_the_old_gpu_for_the_queue() -> None:
    # t (10 GiB) runs on a-0; b-0 has 8 GiB of other processes' memory, a-1
    # and b-1 are nearly full. A 15 GiB task fits neither a-0 beside t nor
    # b-0 (85 % of 24 GiB is 20.4), so it waits. Moving t to b-0 frees a-0,
    # and the next dispatch places the waiting task there.
    from scheduler.errors import Unplaceable

    sched, clock = make(SchedulerConfig(policy="round_robin"))
    seen: list[tuple[TaskState, str]] = []
    sched.add_listener(lambda t: seen.append((t.state, t.assignment.lease_id if t.assignment else "")))
    snap = two_nodes([0.0, 20 * GIB, 8 * GIB, 20 * GIB])
    sched.submit(spec("t", vram_mib=10 * GIB, kind="training"), snap)
    (t,) = sched.dispatch(snap)
    assert t.assignment.gpu_uuids == ("GPU-a-0",)
    sched.submit(spec("big", vram_mib=15 * GIB), snap)
    assert sched.dispatch(snap) == [] and sched.get("big").state == TaskState.QUEUED
    clock.now += 5
    moved = sched.migrate("t", t.assignment.lease_id, ["GPU-b-0"])
    assert moved.state == TaskState.LEASED and moved.assignment.gpu_uuids == ("GPU-b-0",)
    assert moved.assignment.node_id == "b" and moved.assignment.lease_id != t.assignment.lease_id
    assert moved.assignment.placed_at == clock.now and moved.assignment.score.policy == "migration"
    assert moved.attempts == t.attempts and sched.migrated == 1 and sched.placed == 1
    assert seen[-1] == (TaskState.LEASED, moved.assignment.lease_id)
    # the old lease is gone, the new one works
    with pytest.raises(NotLeaseHolder):
        sched.renew("t", t.assignment.lease_id)
    sched.renew("t", moved.assignment.lease_id)
    (big,) = sched.dispatch(snap)
    assert big.task_id == "big" and big.assignment.gpu_uuids == ("GPU-a-0",)
    # and back again is refused while big holds a-0
    with pytest.raises(Unplaceable, match="GPU-a-0 on node a fails the vram filter"):
        sched.migrate("t", moved.assignment.lease_id, ["GPU-a-0"])
    assert sched.get("t").assignment.lease_id == moved.assignment.lease_id
    sched.complete("t", moved.assignment.lease_id)
    assert sched.get("t").state == TaskState.COMPLETED


@pytest.mark.parametrize(
    "to, error, match",
    [
        (["GPU-b-0", "GPU-b-1"], InvalidArgument, "to_gpu_uuid: the task runs on 1 GPU"),
        ([], InvalidArgument, "to_gpu_uuid: the task runs on 1 GPU"),
        (["GPU-a-0"], InvalidArgument, "GPU-a-0 is already one of the task's GPUs"),
        (["GPU-z-9"], InvalidArgument, "unknown GPU 'GPU-z-9'"),
        (["GPU-b-1"], "Unplaceable", "GPU-b-1 on node b fails the memory_threshold filter"),
    ],
)
def test_a_migration_that_cannot_be_made_names_why_and_changes_nothing(to, error, match) -> None:
    from scheduler.errors import Unplaceable

    sched, _ = make()
    snap = two_nodes([0.0, 0.0, 0.0, 14 * GIB])
    sched.submit(spec("t", vram_mib=8 * GIB), snap)
    (t,) = sched.dispatch(snap)
    assert t.assignment.gpu_uuids == ("GPU-a-0",)
    with pytest.raises(Unplaceable if error == "Unplaceable" else error, match=match):
        sched.migrate("t", t.assignment.lease_id, to)
    with pytest.raises(NotLeaseHolder):
        sched.migrate("t", "not-the-lease", ["GPU-b-0"])
    with pytest.raises(UnknownTask):
        sched.migrate("nobody", "x", ["GPU-b-0"])
    after = sched.get("t")
    assert after.assignment == t.assignment and sched.migrated == 0
    # the reservation is still on a-0: a task filling a-0 cannot go there
    sched.submit(spec("fill", vram_mib=18 * GIB), snap)
    (fill,) = sched.dispatch(snap)
    assert fill.assignment.gpu_uuids != ("GPU-a-0",)


def test_a_migration_never_lands_on_a_node_kept_for_a_blocked_multi_gpu_task() -> None:
    # one small task on each node (by label), then a pair that needs a whole
    # node waits past the backfill bound and one node is kept for it while
    # gpulb's task there ends: the other node's task may not move onto it.
    from scheduler.errors import Unplaceable

    sched, clock = make(SchedulerConfig(backfill_max_head_wait_s=1.0))
    nodes = [NodeFacts(n, 2, memory_total_mib=24 * GIB, labels={"pool": n}) for n in ("a", "b")]
    snap = ClusterSnapshot.build(nodes, memory_used_mib=[0.0] * 4)
    for n in ("a", "b"):
        sched.submit(spec(f"small-{n}", vram_mib=4 * GIB, required_node_labels={"pool": n}), snap)
    placed = {t.task_id: t for t in sched.dispatch(snap)}
    assert {t.assignment.node_id for t in placed.values()} == {"a", "b"}
    sched.submit(spec("pair", num_gpus=2, vram_mib=20 * GIB, gpu_share=1.0), snap)
    for _ in range(3):
        clock.now += 2.0
        sched.dispatch(snap)
    kept = sched._held_nodes.get("pair")
    assert kept in ("a", "b") and sched.get("pair").state == TaskState.QUEUED
    mover = placed[f"small-{'b' if kept == 'a' else 'a'}"]
    free_gpu = next(u for u in (f"GPU-{kept}-0", f"GPU-{kept}-1") if u != placed[f"small-{kept}"].assignment.gpu_uuids[0])
    # (its label would keep it off that node too; the hold is checked first, and named)
    with pytest.raises(Unplaceable, match=f"node {kept} is kept for a blocked multi-GPU task while"):
        sched.migrate(mover.task_id, mover.assignment.lease_id, [free_gpu])


def test_an_nvlink_task_moves_only_onto_one_nvlink_connected_group() -> None:
    from scheduler.errors import Unplaceable

    # node a: GPUs 0-1 linked; node b: 0-1 and 2-3 linked in pairs, no link
    # between the pairs. b is full when the pair is placed (so it takes a),
    # then empties.
    nodes = [NodeFacts("a", 2, memory_total_mib=24 * GIB, nvlink_pairs=[(0, 1)]),
             NodeFacts("b", 4, memory_total_mib=24 * GIB, nvlink_pairs=[(0, 1), (2, 3)])]
    sched, _ = make()
    full = ClusterSnapshot.build(nodes, memory_used_mib=[0.0, 0.0] + [22 * GIB] * 4)
    sched.submit(spec("pair", num_gpus=2, needs_nvlink=True, vram_mib=4 * GIB), full)
    (t,) = sched.dispatch(full)
    assert t.assignment.gpu_uuids == ("GPU-a-0", "GPU-a-1")
    empty = ClusterSnapshot.build(nodes, memory_used_mib=[0.0] * 6)
    with pytest.raises(Unplaceable, match=r"needs NVLink and GPUs \[1, 2\] of node b are not one NVLink-connected group"):
        sched.migrate("pair", t.assignment.lease_id, ["GPU-b-1", "GPU-b-2"], empty)
    moved = sched.migrate("pair", t.assignment.lease_id, ["GPU-b-2", "GPU-b-3"], empty)
    assert moved.assignment.gpu_uuids == ("GPU-b-2", "GPU-b-3") and moved.assignment.gpu_indices == (2, 3)


@pytest.mark.parametrize("changes, name", [
    (dict(queue_head_limit=-1), "queue_head_limit"),
])
def test_scheduler_config_refuses_a_negative_queue_head_limit(changes, name):
    """Checked by SchedulerConfig itself, so the simulator and any embedding
    caller get it too, not only the coordinator's settings loader."""
    from scheduler.errors import InvalidArgument

    with pytest.raises(InvalidArgument) as info:
        SchedulerConfig(**changes).validate()
    assert name in str(info.value)


def test_retry_kinds_match_whatever_their_case() -> None:
    """Kinds are compared in lower case; an operator's "Training" in
    retry_kinds never matched, and a lost training task stayed LOST."""
    config = SchedulerConfig(retry_kinds=frozenset({"Training", "BATCH"}))
    assert config.retry_kinds == {"training", "batch"}
    sched, _ = make(config)
    snap = fifty_free_gpus()
    sched.submit(spec("t", kind="training"), snap)
    sched.dispatch(snap)
    assert sched.get("t").state == TaskState.LEASED
    lost = sched.node_removed(sched.get("t").assignment.node_id)
    assert [t.task_id for t in lost] == ["t"] and sched.get("t").state == TaskState.QUEUED
