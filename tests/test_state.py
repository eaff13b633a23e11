"""Durable task state (coordinator.state): every field round-trips through a real
SQLite file, a restart keeps queue order, class, age and lease expiry, group
commit writes one transaction per loop turn, a writer SIGKILLed mid-stream
loses nothing it reported committed, and the predictor's learning survives a
restart."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import random
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from coordinator.state import (
    SCHEMA_VERSION,
    StateError,
    StateLocked,
    TaskStore,
    TimeBase,
    from_wall,
    open_state_dir,
    restore_into,
    to_wall,
)
from scheduler.config import SchedulerConfig
from scheduler.engine import Scheduler
from scheduler.snapshot import ClusterSnapshot, NodeFacts
from scheduler.task import Assignment, Priority, ScoreBreakdown, Task, TaskSpec, TaskState

GIB = 1024.0
REPO = Path(__file__).resolve().parents[1]
WALL0 = 1_700_000_000.0


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def timebase(clock: Clock, wall_at_now: float) -> TimeBase:
    """A TimeBase for a process whose monotonic clock reads ``clock.now`` at Unix ``wall_at_now``."""
    return TimeBase(monotonic=clock, offset=wall_at_now - clock.now)


def full_task() -> Task:
    spec = TaskSpec(
        task_id="t-every-field",
        tenant="acme",
        priority=Priority.P1,
        kind="training",
        num_gpus=2,
        vram_mib=12345.5,
        gpu_share=0.75,
        duration_s=3600.25,
        gpu_spec="A100M80|H100",
        needs_nvlink=True,
        io_heavy=True,
        movable=True,
        deadline_s=900.0,
        labels={"team": "ml", "ünï": "cödé"},
        required_node_labels={"zone": "b"},
        preferred_node_labels={"rack": "r7"},
    )
    assignment = Assignment(
        node_id="node-7",
        gpu_indices=(2, 3),
        gpu_uuids=("GPU-aaa", "GPU-bbb"),
        lease_id="lease-xyz",
        lease_expires_at=1300.5,
        score=ScoreBreakdown(policy="load_aware", total=0.4321, terms={"memory": 0.25, "util": 0.1821, "nan_term": math.nan}, candidates=17),
        placed_at=1000.125,
    )
    return Task(
        spec=spec,
        state=TaskState.FAILED,
        priority=Priority.P0,
        submitted_at=900.0,
        queued_at=950.5,
        enqueued_at=975.25,
        assignment=assignment,
        reason="the lease holder reported failure",
        attempts=3,
        sla_missed=True,
        finished_at=1100.75,
    )


def assert_same_task(a: Task, b: Task, shift: float = 0.0) -> None:
    """Equal records; ``b``'s times are ``a``'s plus ``shift``."""
    assert a.spec == b.spec and a.spec.labels == b.spec.labels
    assert (a.state, a.priority, a.reason, a.attempts, a.sla_missed) == (b.state, b.priority, b.reason, b.attempts, b.sla_missed)
    for name in ("submitted_at", "queued_at", "enqueued_at", "finished_at"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert y == pytest.approx(x + shift, abs=1e-5), name
    assert (a.assignment is None) == (b.assignment is None)
    if a.assignment is not None:
        x, y = a.assignment, b.assignment
        assert (x.node_id, x.gpu_indices, x.gpu_uuids, x.lease_id) == (y.node_id, y.gpu_indices, y.gpu_uuids, y.lease_id)
        assert y.lease_expires_at == pytest.approx(x.lease_expires_at + shift, abs=1e-5)
        assert y.placed_at == pytest.approx(x.placed_at + shift, abs=1e-5)
        assert (x.score.policy, x.score.total, x.score.candidates) == (y.score.policy, y.score.total, y.score.candidates)
        assert x.score.terms.keys() == y.score.terms.keys()
        for k in x.score.terms:
            assert x.score.terms[k] == y.score.terms[k] or (math.isnan(x.score.terms[k]) and math.isnan(y.score.terms[k]))


# ---- round trip ---------------------------------------------------------------------------------


def test_every_field_round_trips_through_the_file(tmp_path: Path) -> None:
    clock = Clock(1000.0)
    base = timebase(clock, WALL0)
    task = full_task()
    with TaskStore(tmp_path / "s.db", timebase=base) as store:
        store.save_task(task)
        store.save_policy("bin_pack", {"memory": 2.0, "util": 0.5})
    with TaskStore(tmp_path / "s.db", timebase=base) as store:
        restored = store.load()
    assert len(restored.tasks) == 1
    assert_same_task(task, restored.tasks[0])
    assert restored.policy.name == "bin_pack" and restored.policy.weights == {"memory": 2.0, "util": 0.5}
    # the row holds Unix seconds
    db = sqlite3.connect(tmp_path / "s.db")
    submitted, finished, assignment = db.execute("SELECT submitted_at, finished_at, assignment FROM tasks").fetchone()
    assert submitted == pytest.approx(WALL0 - 100.0)
    assert finished == pytest.approx(WALL0 + 100.75)
    assert json.loads(assignment)["lease_expires_at"] == pytest.approx(WALL0 + 300.5)
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_times_come_back_relative_to_the_new_process_clock(tmp_path: Path) -> None:
    old = Clock(1000.0)
    with TaskStore(tmp_path / "s.db", timebase=timebase(old, WALL0)) as store:
        store.save_task(full_task())
    # new process: monotonic restarted near 0, and 42 s of wall time passed
    new = Clock(7.0)
    with TaskStore(tmp_path / "s.db", timebase=timebase(new, WALL0 + 42.0)) as store:
        task = store.load().tasks[0]
    assert_same_task(full_task(), task, shift=7.0 - 1000.0 - 42.0)
    # age as seen by each process is the same plus the downtime
    assert new.now - task.submitted_at == pytest.approx(1000.0 - 900.0 + 42.0)


def test_module_helpers_convert_with_this_process_offset() -> None:
    mono = time.monotonic()
    assert to_wall(mono) == pytest.approx(time.time(), abs=0.05)
    assert from_wall(to_wall(mono)) == pytest.approx(mono, abs=1e-6)
    assert to_wall(None) is None and from_wall(None) is None


def test_upsert_keeps_one_row_and_submission_order(tmp_path: Path) -> None:
    with TaskStore(tmp_path / "s.db") as store:
        tasks = [full_task() for _ in range(3)]
        for i, t in enumerate(tasks):
            t.spec = TaskSpec(task_id=f"t{2 - i}", vram_mib=1.0)
            store.save_task(t)
        tasks[0].state = TaskState.COMPLETED
        store.save_tasks(tasks)
        store.save_tasks(tasks[::-1])  # later writes do not move a task in submission order
        assert store.count() == 3
        loaded = store.load().tasks
    assert [t.task_id for t in loaded] == ["t2", "t1", "t0"]
    assert loaded[0].state == TaskState.COMPLETED


# ---- restart through the scheduler ------------------------------------------------------------


def snapshot() -> ClusterSnapshot:
    return ClusterSnapshot.build([NodeFacts("n0", 1, memory_total_mib=24 * GIB), NodeFacts("n1", 1, memory_total_mib=24 * GIB)])


def scheduler(clock: Clock, config: SchedulerConfig) -> Scheduler:
    ids = (f"lease-{i}" for i in itertools.count())
    return Scheduler(config, clock=clock, lease_ids=lambda: next(ids))


def queue_fifo(s: Scheduler) -> list[tuple[str, Priority]]:
    return [(t.task_id, t.priority) for t in s._queue.tasks()]


def test_restart_keeps_order_class_age_and_lease_expiry(tmp_path: Path) -> None:
    config = SchedulerConfig(promote_after_s=(30.0, 95.0, 600.0), lease_s=300.0)
    a_clock = Clock(1000.0)
    a_base = timebase(a_clock, WALL0)
    store = open_state_dir(tmp_path / "state", timebase=a_base)
    a = scheduler(a_clock, config)
    a.add_listener(store.stage)
    snap = snapshot()

    def submit(task_id: str, priority: Priority, **kw) -> None:
        a.submit(TaskSpec(task_id=task_id, priority=priority, vram_mib=20 * GIB, kind="batch", **kw), snap)
        store.commit()

    # two tasks take both GPUs; the rest wait
    submit("run-0", Priority.P1)
    submit("run-1", Priority.P1)
    a.dispatch(snap)
    store.commit()
    a_clock.now += 10
    submit("old-p2", Priority.P2)  # due for P1 at 1010 + 95
    submit("p3", Priority.P3, deadline_s=500.0)
    submit("p0-late", Priority.P0)
    a_clock.now += 50
    submit("p2-b", Priority.P2)
    a.set_policy("binpack")
    store.save_policy(a.get_policy().name, a.get_policy().weights)
    a_clock.now = 1100.0
    submit("p1-direct", Priority.P1)  # enters P1 at 1100, before old-p2's promotion is applied
    a_clock.now = 1106.0
    a.dispatch(snap)  # promotes old-p2 (due 1105): it joins P1 *after* p1-direct
    store.commit()
    done = a.complete("run-1", a.get("run-1").assignment.lease_id)
    store.commit()
    a.dispatch(snap)  # the freed GPU goes to the head of the queue
    store.commit()
    a.renew("run-0", a.get("run-0").assignment.lease_id, 400.0)  # past its 300 s lease: a renewal never shortens one
    store.commit()

    before_fifo = queue_fifo(a)
    assert ("p1-direct", Priority.P1) in before_fifo and ("old-p2", Priority.P1) in before_fifo
    assert [i for i, _ in before_fifo].index("p1-direct") < [i for i, _ in before_fifo].index("old-p2")
    before_tasks = {t.task_id: t for t in a.tasks()}
    leased = [t for t in a.tasks(state=TaskState.LEASED)]
    assert len(leased) == 2
    crash_at = a_clock.now
    store._release_lock()  # a SIGKILL: no close, no checkpoint; the kernel drops the lock
    store._db.close()

    # the new process: monotonic clock near zero, 25 s of wall time later
    downtime = 25.0
    b_clock = Clock(3.0)
    b_base = timebase(b_clock, WALL0 + (crash_at - 1000.0) + downtime)
    shift = b_clock.now - crash_at - downtime  # old monotonic -> new monotonic
    with open_state_dir(tmp_path / "state", timebase=b_base) as store2:
        restored = store2.load()
    b = scheduler(b_clock, config)
    report = restore_into(b, restored)
    assert (report.queued, report.leased, report.finished) == (len(before_fifo), 2, 1)
    assert report.policy == "binpack" == b.get_policy().name

    # same FIFO in every class, same classes
    assert queue_fifo(b) == before_fifo
    # every field, times shifted onto the new clock: ages grew by the downtime
    assert [t.task_id for t in b.tasks()] == list(before_tasks)
    for t in b.tasks():
        assert_same_task(before_tasks[t.task_id], t, shift=shift)
        if t.state == TaskState.QUEUED:
            old = before_tasks[t.task_id]
            assert b_clock.now - t.queued_at == pytest.approx(crash_at - old.queued_at + downtime)
    # leases: same ids, same absolute expiry; reservations in full until readings come
    for t in leased:
        lease = b._leases.get(t.assignment.lease_id)
        assert lease.expires_at == pytest.approx(t.assignment.lease_expires_at + shift)
        assert b_base.to_wall(lease.expires_at) == pytest.approx(a_base.to_wall(t.assignment.lease_expires_at))
        assert t.task_id in b._by_node[t.assignment.node_id]
        for uuid in t.assignment.gpu_uuids:
            assert b.reservations.gpu(uuid).vram_mib == 20 * GIB
    # a completed task is still known: resubmitting its spec is idempotent
    assert b.submit(done.spec).state == TaskState.COMPLETED

    # time keeps running on the new clock: the p2-b promotion falls due at its old instant
    p2b = b.get("p2-b")
    b_clock.now = p2b.enqueued_at + 95.0 - 0.001
    b.queue_summary()
    assert b.get("p2-b").priority == Priority.P2
    b_clock.now += 0.002
    b.queue_summary()
    assert b.get("p2-b").priority == Priority.P1
    # the queue deadline counts from the original submission
    deadline = b.get("p3").submitted_at + 500.0
    assert b.expire_deadlines(deadline - 0.01) == []
    assert [t.task_id for t in b.expire_deadlines(deadline)] == ["p3"]
    # and the leases run out when they always would have (run-0 was renewed for 400 s)
    run0 = b.get("run-0")
    assert run0.assignment.lease_expires_at == pytest.approx(1106.0 + 400.0 + shift)
    assert "run-0" not in [t.task_id for t in b.expire_leases(run0.assignment.lease_expires_at - 0.01)]
    assert "run-0" in [t.task_id for t in b.expire_leases(run0.assignment.lease_expires_at)]
    assert b.get("run-0").state == TaskState.EXPIRED
    assert b.reservations.gpu(run0.assignment.gpu_uuids[0]) is None


def test_restore_keeps_the_newest_finished_within_retention(tmp_path: Path) -> None:
    clock = Clock(100.0)
    s = scheduler(clock, SchedulerConfig(retain_finished=1000))
    with TaskStore(tmp_path / "s.db", timebase=timebase(clock, WALL0)) as store:
        s.add_listener(store.stage)
        for i in range(5):
            s.submit(TaskSpec(task_id=f"t{i}", vram_mib=1.0))
            clock.now += 1
            s.cancel(f"t{i}")
        store.commit()
        restored = store.load()
    fresh = scheduler(clock, SchedulerConfig(retain_finished=2))
    report = restore_into(fresh, restored)
    assert (report.finished, report.dropped) == (2, 3)
    assert [t.task_id for t in fresh.tasks()] == ["t3", "t4"]
    with pytest.raises(ValueError):
        restore_into(fresh, restored)  # not a fresh scheduler any more


def test_an_expired_lease_ends_at_the_first_sweep_after_restore(tmp_path: Path) -> None:
    clock = Clock(100.0)
    s = scheduler(clock, SchedulerConfig(lease_s=10.0))
    with TaskStore(tmp_path / "s.db", timebase=timebase(clock, WALL0)) as store:
        s.add_listener(store.stage)
        s.submit(TaskSpec(task_id="t", vram_mib=GIB), snapshot())
        s.dispatch(snapshot())
        store.commit()
    # down for a minute: longer than the lease
    new = Clock(1.0)
    with TaskStore(tmp_path / "s.db", timebase=timebase(new, WALL0 + 60.0)) as store:
        fresh = scheduler(new, SchedulerConfig(lease_s=10.0))
        restore_into(fresh, store.load())
    assert fresh.get("t").state == TaskState.LEASED
    assert [t.task_id for t in fresh.expire_leases()] == ["t"]
    assert fresh.get("t").state == TaskState.EXPIRED and len(fresh.reservations) == 0


# ---- group commit ------------------------------------------------------------------------------


def queued_task(i: int, now: float = 10.0) -> Task:
    spec = TaskSpec(task_id=f"q{i:05d}", vram_mib=GIB)
    return Task(spec=spec, state=TaskState.QUEUED, priority=spec.priority, submitted_at=now, queued_at=now, enqueued_at=now)


@pytest.mark.parametrize("offload", [False, True])
async def test_a_burst_of_100_submissions_is_one_commit(tmp_path: Path, offload: bool) -> None:
    with TaskStore(tmp_path / "s.db") as store:
        writer = store.writer(offload=offload)
        await writer.durable()  # nothing staged: returns at once
        assert store.commits == 0

        async def handler(i: int) -> str:
            writer.stage(queued_task(i))
            await writer.durable()
            return f"q{i:05d}"

        acked = await asyncio.gather(*(handler(i) for i in range(100)))
        assert store.commits == 1 and store.rows_written == 100
        assert {t.task_id for t in store.load().tasks} == set(acked)

        # stages that arrive while a commit runs go into the next one
        for i in range(100, 110):
            writer.stage(queued_task(i))
        first = asyncio.ensure_future(writer.durable())
        await asyncio.sleep(0)
        writer.stage(queued_task(110))
        await asyncio.gather(first, writer.durable())
        assert store.count() == 111 and store.commits <= 3
        await writer.flush()


@pytest.mark.parametrize("offload", [False, True])
async def test_a_failed_commit_fails_its_waiters_and_keeps_the_rows(tmp_path: Path, offload: bool) -> None:
    with TaskStore(tmp_path / "s.db") as store:
        writer = store.writer(offload=offload)
        real = store._db

        class Broken:
            def __getattr__(self, name):
                return getattr(real, name)

            def executemany(self, *a):
                raise sqlite3.OperationalError("disk I/O error")

        store._db = Broken()
        writer.stage(queued_task(1))
        with pytest.raises(StateError, match="disk I/O error"):
            await writer.durable()
        assert store.pending == 1 and writer.failures == 1
        await asyncio.sleep(0.05)
        assert writer.failures == 1  # no retry loop on a broken disk while nobody waits
        store._db = real
        await writer.durable()
        assert store.pending == 0 and store.count() == 1


# ---- retention, locking, versions ---------------------------------------------------------------


def test_prune_finished_by_age_and_count(tmp_path: Path) -> None:
    clock = Clock(1000.0)
    base = timebase(clock, WALL0)
    with TaskStore(tmp_path / "s.db", timebase=base) as store:
        for i in range(10):
            t = queued_task(i)
            if i < 8:
                t.state, t.finished_at = TaskState.COMPLETED, 900.0 + 10 * i  # finished 100..30 s ago
            store.stage(t)
        store.commit()
        assert store.prune_finished(older_than_s=75.0, now_wall=WALL0) == 3  # 100, 90, 80 s ago
        assert store.prune_finished(older_than_s=1e9, keep_at_most=2, now_wall=WALL0) == 3
        left = store.load().tasks
    assert sorted(t.task_id for t in left) == ["q00006", "q00007", "q00008", "q00009"]


def test_one_process_per_state_directory(tmp_path: Path) -> None:
    store = open_state_dir(tmp_path / "state")
    with pytest.raises(StateLocked):
        open_state_dir(tmp_path / "state")
    store.close()
    open_state_dir(tmp_path / "state").close()
    assert oct((tmp_path / "state").stat().st_mode & 0o777) == oct(0o700)


def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    TaskStore(tmp_path / "s.db").close()
    db = sqlite3.connect(tmp_path / "s.db")
    db.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(StateError, match="newer"):
        TaskStore(tmp_path / "s.db")
    # the failed open released its lock: the error is the schema again, not StateLocked
    with pytest.raises(StateError, match="newer"):
        TaskStore(tmp_path / "s.db")


def test_a_schema_1_state_is_upgraded_with_its_cordons_and_made_owner_only(tmp_path: Path) -> None:
    """A state written by a release of schema 1 (before cordons were part of
    it, as far as the version said) opens, keeps its tasks, and is marked 2,
    so that a release reading 1 refuses it instead of dropping its cordons
    (QA pass 24: a rollback placed work on a node under maintenance). One
    left readable by others by that release is made owner-only."""
    from structlog.testing import capture_logs

    path = tmp_path / "s.db"
    with TaskStore(path) as store:
        store.save_tasks([queued_task(1)])
        store.save_node_admin("gpu-01", "CORDONED")
    db = sqlite3.connect(path)
    db.execute("PRAGMA user_version=1")
    db.close()
    os.chmod(path, 0o644)
    with capture_logs() as logs:
        with TaskStore(path) as store:
            assert [t.task_id for t in store.load().tasks] == [queued_task(1).task_id]
            assert store.load_node_admin() == {"gpu-01": "CORDONED"}
    assert SCHEMA_VERSION == 2
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == 2
    assert oct(path.stat().st_mode & 0o777) == oct(0o600)
    events = {e["event"]: e for e in logs}
    assert events["state_schema_upgraded"]["old"] == 1
    assert events["state_file_mode_fixed"]["was"] == "0o644"


def test_background_checkpoint_keeps_the_wal_small(tmp_path: Path) -> None:
    with TaskStore(tmp_path / "s.db", background_checkpoint_s=0.05) as store:
        store.save_tasks(queued_task(i) for i in range(2000))
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            busy, log_frames, done = sqlite3.connect(tmp_path / "s.db").execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
            if log_frames == done:
                break
            time.sleep(0.05)
        assert store.count() == 2000
    assert TaskStore(tmp_path / "s.db").load().tasks[-1].task_id == "q01999"


# ---- crash -------------------------------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import json, sys
    from coordinator.state import TaskStore
    from scheduler.task import Assignment, ScoreBreakdown, Task, TaskSpec, TaskState

    store = TaskStore(sys.argv[1])
    start = int(sys.argv[2])
    i = start
    tasks = {}
    print(json.dumps({"ready": True}), flush=True)
    while True:
        new = []
        for _ in range(20):
            spec = TaskSpec(task_id=f"t{i:07d}", tenant="c", vram_mib=1024.0, labels={"pad": "x" * 200})
            task = Task(spec=spec, state=TaskState.QUEUED, priority=spec.priority, submitted_at=1.0 * i, queued_at=1.0 * i, enqueued_at=1.0 * i)
            tasks[spec.task_id] = task
            store.stage(task)
            new.append(spec.task_id)
            i += 1
        leased = []
        for task_id in new[:5]:
            t = tasks.pop(task_id)
            t.state = TaskState.LEASED
            t.attempts = 1
            t.assignment = Assignment("n0", (0,), ("GPU-0",), "lease-" + task_id, 1e6, ScoreBreakdown("p", 0.0, {}, 1), 1.0)
            store.stage(t)
            leased.append(task_id)
        store.commit()
        print(json.dumps({"new": new, "leased": leased}), flush=True)
    """
)


def run_child_and_kill(path: Path, start: int, report_lines: int) -> tuple[set[str], set[str]]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(path), str(start)], stdout=subprocess.PIPE, env=env, cwd=REPO, text=True)
    committed: set[str] = set()
    leased: set[str] = set()
    try:
        assert json.loads(proc.stdout.readline()) == {"ready": True}
        for _ in range(report_lines):
            line = json.loads(proc.stdout.readline())
            committed.update(line["new"])
            leased.update(line["leased"])
        # kill at a random instant while it keeps writing (the pipe buffer lets it
        # run ~100 commits ahead of what was read): mid-transaction at times
        time.sleep(random.uniform(0.0, 0.03))
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    return committed, leased


@pytest.mark.timeout(120)
def test_sigkill_mid_stream_loses_nothing_reported_committed(tmp_path: Path) -> None:
    path = tmp_path / "crash.db"
    committed: set[str] = set()
    leased: set[str] = set()
    for round_, lines in enumerate((60, 35)):  # two crashes on the same file
        c, l_ = run_child_and_kill(path, start=1_000_000 * (round_ + 1), report_lines=lines)
        committed |= c
        leased |= l_
        with TaskStore(path) as store:
            assert store.integrity_check() == "ok"
            tasks = store.load().tasks
        ids = [t.task_id for t in tasks]
        assert len(ids) == len(set(ids))  # exactly once
        present = {t.task_id: t for t in tasks}
        missing = committed - present.keys()
        assert not missing, f"{len(missing)} acknowledged tasks lost, e.g. {sorted(missing)[:3]}"
        for task_id in leased:
            t = present[task_id]
            assert t.state == TaskState.LEASED and t.assignment.lease_id == "lease-" + task_id
        # anything beyond what was reported is whole transactions only (20 new rows each)
        extra = [i for i in ids if i not in committed]
        assert len(extra) % 20 == 0
        assert [t.task_id for t in tasks] == sorted(ids, key=lambda i: (int(i[1:]) // 1_000_000, i))


def test_submission_order_survives_a_class_change_in_the_same_batch(tmp_path: Path) -> None:
    with TaskStore(tmp_path / "s.db") as store:
        first, second = queued_task(1), queued_task(2)
        store.stage(first)
        store.stage(second)
        promoted = Task(**{**first.__dict__, "priority": Priority.P1, "enqueued_at": 20.0})
        store.stage(promoted)  # promoted before the commit: a new queue entry, same submission
        store.commit()
        restored = store.load()
    assert [t.task_id for t in restored.tasks] == ["q00001", "q00002"]
    assert restored.entry_order["q00001"] > restored.entry_order["q00002"]


async def test_what_the_predictor_learned_survives_a_coordinator_restart(tmp_path: Path) -> None:
    """A real coordinator with a real state directory: factors learned before
    a stop are there after the restart; a damaged copy costs the learning,
    not the start."""
    from coordinator.config import CoordinatorConfig
    from coordinator.server import Coordinator

    state_dir = tmp_path / "state"
    m40 = "Tesla M40 24GB"

    async def run(check) -> None:
        coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0"), store=open_state_dir(state_dir))
        await coord.start()
        try:
            check(coord.advisor.predictor)
        finally:
            await coord.stop(0)

    def learn(p) -> None:
        assert p.samples == 0
        for i in range(20):
            p.observe(f"m40-{i % 2}", m40, "training", 100.0, 100.0 * 9.0)
        learned["factor"] = p.factor("m40-1", m40, "training")
        learned["mape"] = p.mape()

    learned: dict = {}
    await run(learn)
    assert learned["factor"] == pytest.approx(9.0, rel=0.1)

    def same(p) -> None:
        assert p.samples == 20
        assert p.factor("m40-1", m40, "training") == pytest.approx(learned["factor"])
        assert p.mape() == pytest.approx(learned["mape"])

    await run(same)

    db = sqlite3.connect(state_dir / "gpulb.sqlite3")
    db.execute("UPDATE learned SET state = '{\"version\": 1}' WHERE name = 'predictor'")
    db.commit()
    db.close()

    def from_priors(p) -> None:
        assert p.samples == 0
        assert p.factor("m40-1", m40, "training") == pytest.approx(p.prior(m40))

    await run(from_priors)


async def test_a_finished_task_past_the_retention_is_gone_from_memory_and_store_alike(tmp_path: Path) -> None:
    """finished_retention_s, with a state directory: the prune loop forgets a
    task that finished longer ago in the engine and the store by the same
    rule, so GetTask says NOT_FOUND before a restart as after it (the engine
    had kept it: found before the restart, gone after)."""
    import grpc

    from coordinator.config import CoordinatorConfig
    from coordinator.server import Coordinator
    from protos import tasks_pb2 as tpb
    from protos import tasks_pb2_grpc as tpb_grpc
    from waiting import until

    state_dir = tmp_path / "state"
    spec = tpb.TaskSpec(task_id="done", num_gpus=1, vram_mib=1024, gpu_share=0.5, kind="batch")

    async def gone(stub) -> bool:
        try:
            await stub.GetTask(tpb.GetTaskRequest(task_id="done"), timeout=5)
        except grpc.aio.AioRpcError as exc:
            return exc.code() == grpc.StatusCode.NOT_FOUND
        return False

    for first in (True, False):
        coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", insecure=True, finished_retention_s=0.5),
                            store=open_state_dir(state_dir))
        port = await coord.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = tpb_grpc.SchedulerStub(ch)
                if first:
                    await stub.ScheduleTask(tpb.ScheduleTaskRequest(spec=spec, wait=False), timeout=5)
                    await stub.CancelTask(tpb.CancelTaskRequest(task_id="done"), timeout=5)
                    assert not await gone(stub)
                    await until(lambda: gone(stub), timeout=10, what="the finished task forgotten")
                    await until(lambda: "done" not in {t.task_id for t in coord.store.load().tasks},
                                timeout=10, what="the finished task pruned from the store")
                else:
                    assert await gone(stub)  # after the restart: the same answer
        finally:
            await coord.stop(grace_s=0.1)


def test_a_preempted_task_is_stored_queued_and_one_stored_preempted_restores_queued(tmp_path: Path) -> None:
    """The engine passes a victim through PREEMPTED to QUEUED in one step, so
    the store holds QUEUED; a row left PREEMPTED (a write that stopped
    between the two) comes back queued, with no assignment."""
    clock = Clock(100.0)
    s = scheduler(clock, SchedulerConfig())
    one = ClusterSnapshot.build([NodeFacts("n0", 1, memory_total_mib=24 * GIB)])
    with TaskStore(tmp_path / "s.db", timebase=timebase(clock, WALL0)) as store:
        s.add_listener(store.stage)
        s.submit(TaskSpec(task_id="bg", vram_mib=16 * GIB, priority=Priority.P3, kind="background"), one)
        s.dispatch(one)
        busy = ClusterSnapshot.build([NodeFacts("n0", 1, memory_total_mib=24 * GIB)], memory_used_mib=[16 * GIB])
        s.submit(TaskSpec(task_id="urgent", vram_mib=16 * GIB, priority=Priority.P0, kind="inference"), busy)
        clock.now += 1.0
        s.dispatch(busy)
        assert s.get("bg").state == TaskState.QUEUED
        store.commit()
        restored = store.load()
    assert {t.task_id: t.state for t in restored.tasks} == {"bg": TaskState.QUEUED, "urgent": TaskState.QUEUED}
    bg = next(t for t in restored.tasks if t.task_id == "bg")
    bg.state, bg.assignment = TaskState.PREEMPTED, replace_assignment()
    fresh = scheduler(Clock(5.0), SchedulerConfig())
    restore_into(fresh, restored)
    again = fresh.get("bg")
    assert again.state == TaskState.QUEUED and again.assignment is None
    assert [t.task_id for t in fresh._queue.tasks()] == ["urgent", "bg"]


def replace_assignment() -> Assignment:
    return Assignment(node_id="n0", gpu_indices=(0,), gpu_uuids=("GPU-n0-0",), lease_id="old", lease_expires_at=0.0,
                      score=ScoreBreakdown(policy="load_aware", total=0.0, terms={}, candidates=1), placed_at=0.0)


async def test_a_cordon_survives_a_coordinator_restart(tmp_path: Path) -> None:
    """A real coordinator with a state directory and two simulated hosts: an
    operator cordons sim-01 and drains sim-02 through the operator RPCs, the
    coordinator stops and starts again, and when the agents reconnect the
    nodes are still cordoned / draining and a new task is refused a place on
    them (it waits) until sim-01 is uncordoned, which is stored too: the next
    restart finds sim-01 active and sim-02 still draining."""
    import grpc

    from agent.fleet import SimFleet
    from coordinator.config import CoordinatorConfig
    from coordinator.server import Coordinator
    from protos import cluster_pb2 as cpb
    from protos import cluster_pb2_grpc as cpb_grpc
    from protos import tasks_pb2 as tpb
    from protos import tasks_pb2_grpc as tpb_grpc
    from waiting import until

    state_dir = tmp_path / "state"

    async def session(work) -> None:
        coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", insecure=True, dispatch_interval_s=0.05),
                            store=open_state_dir(state_dir))
        port = await coord.start()
        try:
            async with SimFleet(f"127.0.0.1:{port}", hosts=2, gpus=1, workload="idle"):
                await until(lambda: int(coord.dispatcher.snapshots.snapshot().healthy.sum()) == 2, what="two healthy GPUs")
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                    await work(coord, cpb_grpc.ClusterOperatorStub(ch), tpb_grpc.SchedulerStub(ch))
        finally:
            await coord.stop(grace_s=0.1)

    async def states(cluster) -> dict[str, str]:
        nodes = (await cluster.ListNodes(cpb.ListNodesRequest(), timeout=5)).nodes
        return {n.node_id: cpb.NodeState.Name(n.state) for n in nodes}

    async def cordon_and_drain(coord, cluster, sched) -> None:
        await cluster.CordonNode(cpb.NodeActionRequest(node_id="sim-01", reason="fan swap"), timeout=5)
        await cluster.DrainNode(cpb.NodeActionRequest(node_id="sim-02"), timeout=5)
        assert await states(cluster) == {"sim-01": "NODE_STATE_CORDONED", "sim-02": "NODE_STATE_DRAINING"}

    async def still_kept(coord, cluster, sched) -> None:
        assert await states(cluster) == {"sim-01": "NODE_STATE_CORDONED", "sim-02": "NODE_STATE_DRAINING"}
        spec = tpb.TaskSpec(task_id="after-restart", num_gpus=1, vram_mib=1024, gpu_share=0.5, kind="batch",
                            priority=tpb.PRIORITY_P2)
        task = (await sched.ScheduleTask(tpb.ScheduleTaskRequest(spec=spec, wait=False), timeout=5)).task
        assert task.state == tpb.TASK_STATE_QUEUED, task.reason
        await until(lambda: "node_unschedulable" in coord.dispatcher.engine.get("after-restart").reason,
                    what="the dispatcher's reason: both nodes refused")
        waiting = coord.dispatcher.engine.get("after-restart")
        assert waiting.state.name == "QUEUED"
        assert "free memory" not in waiting.reason  # no node may take it: memory is not what it waits for
        await cluster.UncordonNode(cpb.NodeActionRequest(node_id="sim-01"), timeout=5)
        await until(lambda: coord.dispatcher.engine.get("after-restart").state.name == "LEASED", what="placed once uncordoned")
        assert coord.dispatcher.engine.get("after-restart").assignment.node_id == "sim-01"

    async def uncordon_kept(coord, cluster, sched) -> None:
        assert await states(cluster) == {"sim-01": "NODE_STATE_HEALTHY", "sim-02": "NODE_STATE_DRAINING"}

    await session(cordon_and_drain)
    await session(still_kept)
    await session(uncordon_kept)

    # sim-02 is decommissioned while draining: after a restart without its agent
    # it counts as removed (and alerts) until an uncordon forgets it, for good
    def removed_count(coord) -> int:
        return sum(1 for n in coord.liveness.nodes() if n.liveness.name == "REMOVED")

    for forget in (True, False):
        coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", insecure=True), store=open_state_dir(state_dir))
        port = await coord.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                op = cpb_grpc.ClusterOperatorStub(ch)
                if forget:
                    assert removed_count(coord) == 1
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await op.CordonNode(cpb.NodeActionRequest(node_id="sim-02"), timeout=5)
                    assert info.value.code() == grpc.StatusCode.NOT_FOUND  # only uncordon reaches a removed node
                    gone = await op.UncordonNode(cpb.NodeActionRequest(node_id="sim-02", reason="decommissioned"), timeout=5)
                    assert gone.node.state == cpb.NODE_STATE_REMOVED
                assert removed_count(coord) == 0
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await op.UncordonNode(cpb.NodeActionRequest(node_id="sim-02"), timeout=5)
                assert info.value.code() == grpc.StatusCode.NOT_FOUND
        finally:
            await coord.stop(grace_s=0.1)
    mode = (state_dir / "gpulb.sqlite3").stat().st_mode & 0o777
    assert mode == 0o600, oct(mode)  # owner-only, like the lock file


async def test_a_reload_keeps_the_policy_an_operator_set_unless_the_file_changes_its_own(tmp_path: Path) -> None:
    """SetPolicy (stored, and kept over restarts) is not undone by a SIGHUP
    reload that changes another [scheduler] option; a reload that changes the
    file's own policy applies it, and that is stored too, so the next start
    runs it rather than the older SetPolicy."""
    import grpc

    from coordinator.server import Coordinator
    from coordinator.settings import diff_settings, load_settings
    from protos import tasks_pb2 as tpb
    from protos import tasks_pb2_grpc as tpb_grpc

    path = tmp_path / "coordinator.toml"
    path.write_text('[coordinator]\nlisten = "127.0.0.1:0"\ninsecure = true\n[scheduler]\npolicy = "load_aware"\n')
    state_dir = tmp_path / "state"

    def start(settings) -> Coordinator:
        return Coordinator(settings.coordinator, settings.scheduler, store=open_state_dir(state_dir))

    def reload(coord: Coordinator, old, text: str):
        path.write_text(text)
        new = load_settings(path, {}, {})
        coord.apply_settings(new.coordinator, new.scheduler, [n for n, _, _ in diff_settings(old, new)])
        return new

    settings = load_settings(path, {}, {})
    coord = start(settings)
    port = await coord.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = tpb_grpc.SchedulerStub(ch)
            await stub.SetPolicy(tpb.SetPolicyRequest(name="fgd", weights={"pack": 2.0}), timeout=5)
            settings = reload(coord, settings, path.read_text() + "memory_reject_pct = 84.0\n")
            kept = await stub.GetPolicy(tpb.GetPolicyRequest(), timeout=5)
            assert kept.name == "fgd" and kept.weights["pack"] == 2.0
            assert coord.dispatcher.engine.config.memory_reject_pct == 84.0  # the threshold did change
            settings = reload(coord, settings, path.read_text().replace('"load_aware"', '"binpack"'))
            assert (await stub.GetPolicy(tpb.GetPolicyRequest(), timeout=5)).name == "binpack"
    finally:
        await coord.stop(0)
    again = start(settings)
    await again.start()
    try:
        assert again.dispatcher.engine.get_policy().name == "binpack"
    finally:
        await again.stop(0)


def test_a_restored_lease_is_not_reserved_again_on_top_of_the_memory_it_reads_as(tmp_path: Path) -> None:
    """A lease restored after a restart belongs to a task that runs: once its
    GPU reads that task's memory, none of it stays reserved. It had stayed
    reserved in full (the stack's baseline was the first reading, which
    already held the task), so a 24 GiB GPU holding a 12 GiB task refused
    a 6 GiB one as full, for as long as the first task ran."""
    clock = Clock(100.0)
    a = scheduler(clock, SchedulerConfig())
    one = ClusterSnapshot.build([NodeFacts("n0", 1, memory_total_mib=24 * GIB)])
    with TaskStore(tmp_path / "s.db", timebase=timebase(clock, WALL0)) as store:
        a.add_listener(store.stage)
        a.submit(TaskSpec(task_id="running", vram_mib=12 * GIB, kind="training"), one)
        a.dispatch(one)
        assert a.get("running").state == TaskState.LEASED
        store.commit()
        restored = store.load()
    ids = (f"after-{i}" for i in itertools.count())
    b = Scheduler(SchedulerConfig(), clock=Clock(5.0), lease_ids=lambda: next(ids))
    restore_into(b, restored)
    unknown = ClusterSnapshot.build([NodeFacts("n0", 1, memory_total_mib=24 * GIB)], memory_used_mib=[math.nan])
    b.submit(TaskSpec(task_id="while-unknown", vram_mib=16 * GIB, kind="batch"), unknown)
    b.dispatch(unknown)  # no reading yet: the restored lease's memory is held in full
    assert b.get("while-unknown").state == TaskState.QUEUED
    b.cancel("while-unknown")
    reads = ClusterSnapshot.build([NodeFacts("n0", 1, memory_total_mib=24 * GIB)], memory_used_mib=[12 * GIB])
    b.submit(TaskSpec(task_id="fits-next-to-it", vram_mib=6 * GIB, kind="batch"), reads)
    b.dispatch(reads)
    assert b.get("fits-next-to-it").state == TaskState.LEASED, b.get("fits-next-to-it").reason
    again = ClusterSnapshot.build([NodeFacts("n0", 1, memory_total_mib=24 * GIB)], memory_used_mib=[12 * GIB])
    b.submit(TaskSpec(task_id="no-room-left", vram_mib=6 * GIB, kind="batch"), again)
    b.dispatch(again)  # the new placement is reserved as usual until its memory shows
    assert b.get("no-room-left").state == TaskState.QUEUED


def test_a_restored_lease_whose_task_had_not_started_is_reserved_in_full_once_placed_again(tmp_path: Path) -> None:
    """Two leases on one 24 GiB GPU restored after a restart; the host, on
    reconnecting, runs only one (the other had been placed just before the
    coordinator died, or the host restarted): the coordinator places it
    again (``Scheduler.start_again``) and its 8 GiB stay reserved above the
    8 GiB the GPU reads, so a 10 GiB task does not fit and a 4 GiB one does.
    Taken as running, the second lease's memory had faded at the first
    reading: the 10 GiB task was placed onto memory the restarted task needs."""
    clock = Clock(100.0)
    a = scheduler(clock, SchedulerConfig())
    one = ClusterSnapshot.build([NodeFacts("n0", 1, memory_total_mib=24 * GIB)])
    with TaskStore(tmp_path / "s.db", timebase=timebase(clock, WALL0)) as store:
        a.add_listener(store.stage)
        for name in ("runs", "not-started"):
            a.submit(TaskSpec(task_id=name, vram_mib=8 * GIB, kind="training"), one)
        a.dispatch(one)
        assert {a.get(n).state for n in ("runs", "not-started")} == {TaskState.LEASED}
        store.commit()
        restored = store.load()
    ids = (f"after-{i}" for i in itertools.count())
    b = Scheduler(SchedulerConfig(), clock=Clock(5.0), lease_ids=lambda: next(ids))
    restore_into(b, restored)
    assert b.start_again("not-started") and not b.start_again("no-such-task")
    reads = ClusterSnapshot.build([NodeFacts("n0", 1, memory_total_mib=24 * GIB)], memory_used_mib=[8 * GIB])
    b.submit(TaskSpec(task_id="too-big", vram_mib=10 * GIB, kind="batch"), reads)
    b.submit(TaskSpec(task_id="fits", vram_mib=4 * GIB, kind="batch"), reads)
    b.dispatch(reads)
    assert b.get("too-big").state == TaskState.QUEUED
    assert b.get("fits").state == TaskState.LEASED, b.get("fits").reason


def _damage(db: Path, table: str) -> None:
    """Overwrite the first page of ``table`` with garbage, as a bad sector would."""
    con = sqlite3.connect(db)
    page = con.execute("SELECT rootpage FROM sqlite_master WHERE name = ?", (table,)).fetchone()[0]
    size = con.execute("PRAGMA page_size").fetchone()[0]
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    con.close()
    with open(db, "r+b") as fh:
        fh.seek((page - 1) * size)
        fh.write(b"\xa5" * size)


@pytest.mark.parametrize("table", ["tasks", "node_admin", "learned"])
def test_a_damaged_state_database_is_one_line_with_what_to_do_not_a_traceback(tmp_path: Path, table: str) -> None:
    """A damaged page of the tasks ends the start (exit 2, one line naming the
    file and what to do); one of the learned state or of the cordons costs
    only those (logged as errors), and the coordinator starts."""
    state = tmp_path / "state"
    with open_state_dir(state) as store:
        store.save_task(Task(spec=TaskSpec(task_id="t", vram_mib=1024), state=TaskState.QUEUED, priority=Priority.P2,
                             submitted_at=1.0, queued_at=1.0, enqueued_at=1.0))
        store.save_node_admin("n1", "CORDONED")
        store.save_learned("predictor", {"version": 1})
    _damage(state / "gpulb.sqlite3", table)
    if table == "tasks":
        proc = subprocess.run(
            [sys.executable, "-m", "coordinator.main", "--listen", "127.0.0.1:0", "--insecure", "--state-dir",
             str(state), "--log-format", "json"],
            capture_output=True, text=True, timeout=60,
        )
        out = proc.stdout + proc.stderr
        assert proc.returncode == 2, out
        assert "Traceback" not in out
        assert '"event": "state_unavailable"' in out and "integrity_check" in out and "gpulb.sqlite3" in out
        return

    from coordinator.config import CoordinatorConfig
    from coordinator.server import Coordinator
    from structlog.testing import capture_logs

    async def start_and_stop() -> list[dict]:
        with capture_logs() as logs:
            coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", insecure=True), store=open_state_dir(state))
            await coord.start()
            assert coord.dispatcher.engine.get("t").state == TaskState.QUEUED  # the tasks came back
            await coord.stop(0)
        return logs

    logs = asyncio.run(start_and_stop())
    events = {e["event"] for e in logs}
    assert ("node_admin_unreadable" if table == "node_admin" else "predictor_state_unreadable") in events
