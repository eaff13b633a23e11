"""Durable task state: one SQLite database in WAL mode under ``--state-dir``.

What is stored
    One row per task (the full ``scheduler.task.Task`` record: spec as JSON,
    state, effective priority, the three queue times, the assignment with its
    lease id, expiry and score, reason, attempts, SLA flag, finish time) and one
    row for the active policy (name and weights). Leases and reservations are
    not stored separately: both are functions of the LEASED rows (a lease is
    ``assignment.lease_id`` / ``lease_expires_at``; a reservation is the spec's
    ``vram_mib`` and ``gpu_share`` on ``assignment.gpu_uuids``).

Durability
    ``journal_mode=WAL`` with ``synchronous=NORMAL`` (the default here). A
    commit appends the transaction to the WAL file with ``write(2)`` and
    returns; the WAL is fsynced only at checkpoints. Data handed to the kernel
    survives the death of the *process* (SIGKILL, OOM kill, a crash in native
    code): the page cache belongs to the kernel, and SQLite recovers the WAL on
    the next open. It does not survive power loss or a kernel panic, where the
    last transactions before the crash can be rolled back (never corrupted).
    That is the requirement of issue 7 ("acknowledged only after its row is
    durable against a process crash"), at ~tens of microseconds per commit.
    ``synchronous="FULL"`` fsyncs the WAL on every commit (power-loss durable,
    milliseconds per commit on real disks); use it with the batching writer.

Times
    The scheduler's times are monotonic seconds of its own process, which mean
    nothing after a restart. Rows hold wall-clock (Unix) seconds: ``to_wall``
    on the way in, ``from_wall`` on the way back, each relative to the process
    that runs it (``TimeBase``). So a queued task keeps its age (the downtime
    counts as waiting, which it was), its class and due promotion, and a lease
    keeps its absolute expiry. A wall-clock step between the two processes
    shifts every restored time by the step.

Order
    ``submit_seq`` (first time a task is written) gives submission order;
    ``entry_seq`` changes whenever a queued task enters a new queue class (a
    submission, a promotion, a re-queue), in the order the changes were staged,
    which is the order in which ``AgingQueue`` appended them to their class.
    Restoring pushes each class in ``entry_seq`` order, so the FIFO inside
    every class is exactly what it was.

Batching
    ``stage(task)`` keeps the newest copy of each task; ``commit()`` writes all
    staged rows in one transaction. ``TaskStore.writer()`` returns a
    ``GroupCommitter`` for the event loop: its ``stage`` is a scheduler
    listener, and ``await writer.durable()`` returns once everything staged
    before the call is committed - one commit per loop turn however many
    handlers wait on it.

``restore_into(scheduler, restored)`` rebuilds a fresh ``Scheduler`` from what
``load()`` returned (see its docstring for the engine internals it touches).

Run ``python -m coordinator.state bench DIR`` for commit latencies.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import json
import math
import os
import sqlite3
import statistics
import threading
import time
import weakref
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Mapping

import structlog

from scheduler.reservations import Lease
from scheduler.task import TERMINAL_STATES, Assignment, Priority, ScoreBreakdown, Task, TaskSpec, TaskState

if TYPE_CHECKING:
    from scheduler.engine import Scheduler

__all__ = [
    "DB_NAME",
    "SCHEMA_VERSION",
    "StateError",
    "StateLocked",
    "TimeBase",
    "to_wall",
    "from_wall",
    "PolicyRecord",
    "Restored",
    "TaskStore",
    "GroupCommitter",
    "RestoreReport",
    "open_state_dir",
    "restore_into",
]

log = structlog.get_logger("gpulb.state")

DB_NAME = "gpulb.sqlite3"
#: 1: tasks, policy, learned state. 2: node_admin (cordons and drains) is
#: part of the state: a release that reads 1 would open a state of 2 and drop
#: its cordons without a word (QA pass 24: work placed on a node under
#: maintenance after a rollback, and the stale cordon back after the next
#: upgrade), so it must refuse it, which is what the version is for. A
#: table whose loss changes what the coordinator does bumps it.
SCHEMA_VERSION = 2

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tasks (
    task_id          TEXT PRIMARY KEY,
    tenant           TEXT NOT NULL,
    spec             TEXT NOT NULL,     -- JSON of TaskSpec, tasks.proto field names
    state            INTEGER NOT NULL,  -- TaskState value
    priority         INTEGER NOT NULL,  -- effective class (Priority value)
    submitted_at     REAL NOT NULL,     -- Unix s
    queued_at        REAL NOT NULL,     -- Unix s
    enqueued_at      REAL NOT NULL,     -- Unix s
    node_id          TEXT,              -- assignment.node_id (for queries)
    assignment       TEXT,              -- JSON, times in Unix s; NULL when none
    reason           TEXT NOT NULL,
    attempts         INTEGER NOT NULL,
    sla_missed       INTEGER NOT NULL,
    finished_at      REAL,              -- Unix s; NULL until terminal
    submit_seq       INTEGER NOT NULL,  -- first write order: submission order
    entry_seq        INTEGER NOT NULL,  -- order of entry into the current queue class
    updated_at       REAL NOT NULL      -- Unix s of the last write
);
CREATE INDEX IF NOT EXISTS tasks_by_submit ON tasks(submit_seq);
CREATE INDEX IF NOT EXISTS tasks_finished ON tasks(finished_at) WHERE finished_at IS NOT NULL;
CREATE TABLE IF NOT EXISTS policy (
    id          INTEGER PRIMARY KEY CHECK (id = 1),
    name        TEXT NOT NULL,
    weights     TEXT NOT NULL,          -- JSON object term -> weight
    updated_at  REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS learned (
    name        TEXT PRIMARY KEY,       -- what learned it, e.g. "predictor"
    state       TEXT NOT NULL,          -- JSON, the learner's own format (SpeedPredictor.to_state)
    updated_at  REAL NOT NULL           -- Unix s
);
CREATE TABLE IF NOT EXISTS node_admin (
    node_id     TEXT PRIMARY KEY,       -- a node an operator cordoned or drained (absent: active)
    admin       TEXT NOT NULL,          -- CORDONED or DRAINING (coordinator.liveness.Admin value)
    updated_at  REAL NOT NULL           -- Unix s
);
"""

# Upsert: submit_seq is kept from the first write, except over a REJECTED row:
# a rejected task is never written again, so a write for its id is a new try
# of it (Scheduler._retries_rejected), a new submission whose record replaces
# the rejected one, newest in submission order as it is in the scheduler;
# entry_seq is kept unless the task entered another queue class (its class
# or enqueue time changed).
_UPSERT = f"""
INSERT INTO tasks (task_id, tenant, spec, state, priority, submitted_at, queued_at, enqueued_at,
                   node_id, assignment, reason, attempts, sla_missed, finished_at, submit_seq, entry_seq, updated_at)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT(task_id) DO UPDATE SET
    submit_seq = CASE WHEN tasks.state = {int(TaskState.REJECTED)} THEN excluded.submit_seq ELSE tasks.submit_seq END,
    tenant = excluded.tenant, spec = excluded.spec, state = excluded.state,
    entry_seq = CASE WHEN tasks.priority = excluded.priority AND tasks.enqueued_at = excluded.enqueued_at
                     THEN tasks.entry_seq ELSE excluded.entry_seq END,
    priority = excluded.priority, submitted_at = excluded.submitted_at, queued_at = excluded.queued_at,
    enqueued_at = excluded.enqueued_at, node_id = excluded.node_id, assignment = excluded.assignment,
    reason = excluded.reason, attempts = excluded.attempts, sla_missed = excluded.sla_missed,
    finished_at = excluded.finished_at, updated_at = excluded.updated_at
"""

_SYNC_MODES = ("OFF", "NORMAL", "FULL", "EXTRA")


class StateError(RuntimeError):
    """The state database cannot be used (newer schema, bad row, I/O error)."""


def _repair_hint(path: Path) -> str:
    """What an operator can do about a damaged state database."""
    return (f"`sqlite3 {path} 'PRAGMA integrity_check'` says what is damaged; to start from an empty state, stop "
            f"gpulb and move {path.name}* aside (queued and leased tasks are then forgotten), or put back a copy "
            f"(the database with its -wal file, or one made by sqlite3's .backup)")


class StateLocked(StateError):
    """Another process holds the state directory."""


# ---- times -------------------------------------------------------------------------------------


class TimeBase:
    """Monotonic seconds of *this* process <-> Unix seconds.

    The offset is taken once (``wall() - monotonic()``), so converting back and
    forth within a process is consistent. Pass ``offset`` to share one with
    another converter (e.g. ``coordinator.taskconvert.WallClock.offset_ns / 1e9``).
    """

    def __init__(
        self,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        *,
        offset: float | None = None,
    ) -> None:
        self.monotonic = monotonic
        self.wall = wall
        self.offset = float(offset) if offset is not None else wall() - monotonic()

    def to_wall(self, mono: float | None) -> float | None:
        return None if mono is None else mono + self.offset

    def from_wall(self, wall: float | None) -> float | None:
        return None if wall is None else wall - self.offset

    def now_wall(self) -> float:
        return self.monotonic() + self.offset


_DEFAULT_BASE = TimeBase()


def to_wall(mono: float | None, base: TimeBase | None = None) -> float | None:
    """Monotonic seconds (this process) -> Unix seconds; None stays None."""
    return (base or _DEFAULT_BASE).to_wall(mono)


def from_wall(wall: float | None, base: TimeBase | None = None) -> float | None:
    """Unix seconds -> monotonic seconds of this process; None stays None."""
    return (base or _DEFAULT_BASE).from_wall(wall)


# ---- (de)serialisation -------------------------------------------------------------------------

_SPEC_FIELDS = tuple(f.name for f in fields(TaskSpec))


# A task's spec never changes (a different spec under the same id is a
# TaskConflict), and the scheduler's copies share the spec object: encode once.
_spec_json_cache: "weakref.WeakKeyDictionary[TaskSpec, str]" = weakref.WeakKeyDictionary()


def spec_to_json(spec: TaskSpec) -> str:
    try:
        cached = _spec_json_cache.get(spec)
    except TypeError:  # unhashable label values: encode without the cache
        cached = None
    if cached is not None:
        return cached
    data = {name: getattr(spec, name) for name in _SPEC_FIELDS}
    data["priority"] = int(spec.priority)
    for name in ("labels", "required_node_labels", "preferred_node_labels"):
        data[name] = dict(data[name])
    text = json.dumps(data, separators=(",", ":"))
    try:
        _spec_json_cache[spec] = text
    except TypeError:
        pass
    return text


def spec_from_json(text: str) -> TaskSpec:
    data = json.loads(text)
    known = {k: v for k, v in data.items() if k in _SPEC_FIELDS}  # a newer writer's extra fields are ignored
    known["priority"] = Priority(known.get("priority", Priority.P2))
    return TaskSpec(**known)


def assignment_to_json(a: Assignment, base: TimeBase) -> str:
    return json.dumps(
        {
            "node_id": a.node_id,
            "gpu_indices": list(a.gpu_indices),
            "gpu_uuids": list(a.gpu_uuids),
            "lease_id": a.lease_id,
            "lease_expires_at": base.to_wall(a.lease_expires_at),
            "placed_at": base.to_wall(a.placed_at),
            **({} if a.run_started_at is None else {"run_started_at": base.to_wall(a.run_started_at)}),
            "score": {
                "policy": a.score.policy,
                "total": a.score.total,
                "terms": dict(a.score.terms),
                "candidates": a.score.candidates,
            },
        },
        separators=(",", ":"),
    )


def assignment_from_json(text: str, base: TimeBase) -> Assignment:
    d = json.loads(text)
    s = d["score"]
    return Assignment(
        node_id=d["node_id"],
        gpu_indices=tuple(int(i) for i in d["gpu_indices"]),
        gpu_uuids=tuple(d["gpu_uuids"]),
        lease_id=d["lease_id"],
        lease_expires_at=base.from_wall(d["lease_expires_at"]),
        placed_at=base.from_wall(d["placed_at"]),
        run_started_at=base.from_wall(d["run_started_at"]) if "run_started_at" in d else None,
        score=ScoreBreakdown(policy=s["policy"], total=float(s["total"]), terms=dict(s["terms"]), candidates=int(s["candidates"])),
    )


def _queue_key(task: Task) -> tuple[int, float]:
    return int(task.priority), task.enqueued_at


# ---- records -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PolicyRecord:
    name: str
    weights: Mapping[str, float]
    updated_at: float  # Unix s


@dataclass
class Restored:
    """What ``TaskStore.load`` found: tasks in submission order (times already
    converted to this process's monotonic clock), the queue entry order of each
    task, and the last policy (None if never set)."""

    tasks: list[Task]
    policy: PolicyRecord | None
    entry_order: dict[str, int] = field(default_factory=dict)

    def by_state(self) -> dict[TaskState, int]:
        out: dict[TaskState, int] = {}
        for t in self.tasks:
            out[t.state] = out.get(t.state, 0) + 1
        return out


@dataclass(slots=True)
class _Staged:
    task: Task
    first_seq: int  # when this batch first saw the task: its submit_seq if the row is new
    entry_seq: int  # when it entered its current queue class


# ---- the store ---------------------------------------------------------------------------------


class TaskStore:
    """Tasks and the policy in one SQLite file (see module docstring).

    Thread-safe: the connection is used under one lock and the staging area
    under another, held only for a swap, so ``commit`` may run in a worker
    thread (``GroupCommitter(offload=True)``) while the event loop keeps
    staging without waiting for the disk.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        synchronous: str = "NORMAL",
        timebase: TimeBase | None = None,
        lock: bool = True,
        background_checkpoint_s: float | None = None,
    ) -> None:
        """``path``: the database file; ``synchronous``: NORMAL (process-crash
        durable) or FULL (power-loss durable); ``timebase``: monotonic <-> wall
        conversion (the default uses ``time.monotonic``); ``lock``: take an
        exclusive ``flock`` on ``path + '.lock'`` so a second coordinator on the
        same state fails fast with ``StateLocked``; ``background_checkpoint_s``:
        instead of SQLite's automatic checkpoint inside a commit (which fsyncs
        the database file, ~10 ms, on the committing thread: the event loop),
        fold the WAL into the database from a daemon thread with its own
        connection every so many seconds when something was committed."""
        sync = synchronous.upper()
        if sync not in _SYNC_MODES:
            raise ValueError(f"synchronous must be one of {_SYNC_MODES}, got {synchronous!r}")
        self.path = Path(path)
        self.timebase = timebase or _DEFAULT_BASE
        self.synchronous = sync
        self._lock_fd: int | None = None
        if lock:
            self._lock_fd = self._take_lock(Path(str(self.path) + ".lock"))
        self._mutex = threading.Lock()  # the connection
        self._stage_lock = threading.Lock()  # _staged, _staged_policy, _seq
        self._staged: dict[str, _Staged] = {}
        self._staged_policy: tuple[str, dict[str, float]] | None = None
        self.commits = 0  # transactions written, for tests and metrics
        self.rows_written = 0
        self.last_commit_s = 0.0
        self._checkpointer: threading.Thread | None = None
        self._stop_checkpoints = threading.Event()
        self.background_checkpoint_s = background_checkpoint_s
        self._db = None
        try:
            # owner-only, like the lock file: the tasks' specs (tenants, labels,
            # kinds) are the cluster's business, not every local user's. SQLite
            # gives its -wal and -shm files the database file's mode.
            os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600))
            self._owner_only()
            self._db = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
            self._init_db()
        except BaseException as exc:
            if self._db is not None:
                self._db.close()
                self._db = None
            self._release_lock()
            if isinstance(exc, sqlite3.DatabaseError) and not isinstance(exc, sqlite3.OperationalError):
                raise StateError(f"{self.path}: {exc}; {_repair_hint(self.path)}") from exc  # damaged, not busy
            if isinstance(exc, sqlite3.Error):
                raise StateError(f"{self.path}: {exc}") from exc
            raise
        if self.background_checkpoint_s:
            self._checkpointer = threading.Thread(target=self._checkpoint_loop, name="gpulb-state-checkpoint", daemon=True)
            self._checkpointer.start()

    # ---- opening -----------------------------------------------------------------
    def _owner_only(self) -> None:
        """A database (and its -wal, -shm) made by an older release, or by
        hand, open to group or others is made owner-only, as a new one is
        created: the mode applies at creation only, so an upgrade kept the
        tenants' specs readable by every local user (QA pass 24)."""
        for path in (self.path, Path(f"{self.path}-wal"), Path(f"{self.path}-shm")):
            try:
                mode = path.stat().st_mode & 0o777
                if mode & 0o077:
                    os.chmod(path, mode & 0o700)
                    log.warning("state_file_mode_fixed", path=str(path), was=oct(mode), now=oct(mode & 0o700))
            except FileNotFoundError:
                continue

    @staticmethod
    def _take_lock(lock_path: Path) -> int:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StateLocked(f"{lock_path}: another process is using this state directory") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        return fd

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing drops the flock
            self._lock_fd = None

    def _init_db(self) -> None:
        db = self._db
        mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise StateError(f"{self.path}: cannot switch to WAL mode (got {mode})")
        db.execute(f"PRAGMA synchronous={self.synchronous}")
        db.execute("PRAGMA busy_timeout=5000")
        db.execute("PRAGMA journal_size_limit=67108864")  # truncate the WAL to 64 MiB after checkpoints
        if self.background_checkpoint_s:
            db.execute("PRAGMA wal_autocheckpoint=0")
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise StateError(f"{self.path}: schema version {version} is newer than this gpulb ({SCHEMA_VERSION}): a "
                             "newer release wrote it; run that release, or put back the copy of the state taken "
                             "before the upgrade (README, \"Upgrading\")")
        # one script, one transaction: a crash while creating leaves no half schema
        db.executescript(f"BEGIN IMMEDIATE;{_SCHEMA};PRAGMA user_version={SCHEMA_VERSION};COMMIT;")
        if 0 < version < SCHEMA_VERSION:
            log.warning("state_schema_upgraded", path=str(self.path), old=version, new=SCHEMA_VERSION,
                        detail="releases before this one refuse this state from now on: to roll back, put back the "
                               "copy taken before the upgrade (database and -wal file)")
        row = db.execute("SELECT COALESCE(MAX(MAX(submit_seq), MAX(entry_seq)), 0) FROM tasks").fetchone()
        self._seq = int(row[0])

    # ---- writing -------------------------------------------------------------------
    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def stage(self, task: Task) -> None:
        """Remember the newest copy of ``task`` for the next ``commit``.

        Call it in the order the scheduler reports changes (it is a valid
        ``Scheduler.add_listener`` callback): that order defines queue entry order.
        """
        with self._stage_lock:
            prev = self._staged.get(task.task_id)
            if prev is not None and prev.task.state == TaskState.REJECTED and prev.task.seq != task.seq:
                prev = None  # a new try of a rejected task (see _UPSERT): a new submission
            if prev is None:
                seq = self._next_seq()
                self._staged[task.task_id] = _Staged(task, seq, seq)
            elif _queue_key(prev.task) == _queue_key(task):
                self._staged[task.task_id] = _Staged(task, prev.first_seq, prev.entry_seq)
            else:
                self._staged[task.task_id] = _Staged(task, prev.first_seq, self._next_seq())

    def stage_policy(self, name: str, weights: Mapping[str, float]) -> None:
        with self._stage_lock:
            self._staged_policy = (name, {str(k): float(v) for k, v in weights.items()})

    @property
    def pending(self) -> int:
        """Staged rows not committed yet (the policy counts as one)."""
        return len(self._staged) + (self._staged_policy is not None)

    def _row(self, staged: _Staged, now_wall: float) -> tuple:
        t, base = staged.task, self.timebase
        a = t.assignment
        return (
            t.task_id,
            t.spec.tenant,
            spec_to_json(t.spec),
            int(t.state),
            int(t.priority),
            base.to_wall(t.submitted_at),
            base.to_wall(t.queued_at),
            base.to_wall(t.enqueued_at),
            a.node_id if a is not None else None,
            assignment_to_json(a, base) if a is not None else None,
            t.reason,
            int(t.attempts),
            int(bool(t.sla_missed)),
            base.to_wall(t.finished_at),
            staged.first_seq,  # submit_seq: only used when the row is new
            staged.entry_seq,
            now_wall,
        )

    def commit(self) -> int:
        """Write everything staged in one transaction; returns the rows written.

        When it returns the rows are durable to the configured level. On error
        the staged rows are put back (unless newer copies were staged since)
        and ``StateError`` is raised.
        """
        with self._mutex:
            with self._stage_lock:
                staged, self._staged = self._staged, {}
                policy, self._staged_policy = self._staged_policy, None
            if not staged and policy is None:
                return 0
            started = time.perf_counter()
            now_wall = time.time()
            try:
                rows = [self._row(s, now_wall) for s in staged.values()]
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    if rows:
                        self._db.executemany(_UPSERT, rows)
                    if policy is not None:
                        self._db.execute(
                            "INSERT INTO policy (id, name, weights, updated_at) VALUES (1, ?, ?, ?) "
                            "ON CONFLICT(id) DO UPDATE SET name = excluded.name, weights = excluded.weights, updated_at = excluded.updated_at",
                            (policy[0], json.dumps(policy[1], sort_keys=True), now_wall),
                        )
                    self._db.execute("COMMIT")
                except BaseException:
                    if self._db.in_transaction:
                        self._db.execute("ROLLBACK")
                    raise
            except (sqlite3.Error, OSError, ValueError, TypeError) as exc:
                with self._stage_lock:
                    # put them back, behind nothing: newer copies staged meanwhile win
                    for task_id, s in staged.items():
                        self._staged.setdefault(task_id, s)
                    if self._staged_policy is None:
                        self._staged_policy = policy
                raise StateError(f"{self.path}: commit failed: {exc}") from exc
            self.commits += 1
            self.rows_written += len(rows)
            self.last_commit_s = time.perf_counter() - started
            return len(rows) + (policy is not None)

    def save_task(self, task: Task) -> None:
        """Upsert one task, durably, now (a transaction of its own plus anything staged)."""
        self.stage(task)
        self.commit()

    def save_tasks(self, tasks: Iterable[Task]) -> int:
        """Upsert many tasks in one transaction (in the given order)."""
        for task in tasks:
            self.stage(task)
        return self.commit()

    def save_policy(self, name: str, weights: Mapping[str, float]) -> None:
        self.stage_policy(name, weights)
        self.commit()

    def writer(self, loop: asyncio.AbstractEventLoop | None = None, *, offload: bool = False, delay_s: float = 0.0) -> "GroupCommitter":
        """A group committer on ``loop`` (the running loop by default)."""
        return GroupCommitter(self, loop=loop, offload=offload, delay_s=delay_s)

    # ---- reading -------------------------------------------------------------------
    def load(self) -> Restored:
        """Every stored task, oldest submission first, times in this process's
        monotonic seconds; and the policy. Staged rows are not included."""
        base = self.timebase
        with self._mutex, self._readable("tasks"):
            rows = self._db.execute(
                "SELECT task_id, spec, state, priority, submitted_at, queued_at, enqueued_at, assignment, reason, "
                "attempts, sla_missed, finished_at, entry_seq FROM tasks ORDER BY submit_seq"
            ).fetchall()
            prow = self._db.execute("SELECT name, weights, updated_at FROM policy WHERE id = 1").fetchone()
        tasks: list[Task] = []
        order: dict[str, int] = {}
        for (task_id, spec, state, priority, submitted, queued, enqueued, assignment, reason, attempts, sla, finished, entry_seq) in rows:
            try:
                task = Task(
                    spec=spec_from_json(spec),
                    state=TaskState(state),
                    priority=Priority(priority),
                    submitted_at=base.from_wall(submitted),
                    queued_at=base.from_wall(queued),
                    enqueued_at=base.from_wall(enqueued),
                    assignment=assignment_from_json(assignment, base) if assignment else None,
                    reason=reason,
                    attempts=int(attempts),
                    sla_missed=bool(sla),
                    finished_at=base.from_wall(finished),
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise StateError(f"{self.path}: task {task_id!r} cannot be read: {exc}") from exc
            tasks.append(task)
            order[task_id] = int(entry_seq)
        policy = None
        if prow is not None:
            policy = PolicyRecord(name=prow[0], weights=json.loads(prow[1]), updated_at=float(prow[2]))
        return Restored(tasks=tasks, policy=policy, entry_order=order)

    def save_learned(self, name: str, state: Mapping) -> None:
        """Store what a learner knows (a JSON-able mapping), replacing the
        previous copy in one transaction of its own."""
        text = json.dumps(state, allow_nan=False)
        with self._mutex, self._writable(f"learned state {name!r}"):
            self._db.execute(
                "INSERT INTO learned (name, state, updated_at) VALUES (?, ?, ?) "
                "ON CONFLICT(name) DO UPDATE SET state = excluded.state, updated_at = excluded.updated_at",
                (name, text, time.time()),
            )

    def load_learned(self, name: str) -> dict | None:
        """The last ``save_learned`` copy of ``name``; None when there is none."""
        with self._mutex, self._readable(f"learned state {name!r}"):
            row = self._db.execute("SELECT state FROM learned WHERE name = ?", (name,)).fetchone()
        if row is None:
            return None
        try:
            return json.loads(row[0])
        except ValueError as exc:
            raise StateError(f"{self.path}: learned state {name!r} cannot be read: {exc}") from exc

    def save_node_admin(self, node_id: str, admin: str) -> None:
        """Store an operator's cordon or drain of ``node_id`` (``admin``, an
        ``Admin`` value; ACTIVE forgets it), in a transaction of its own: a maintenance
        cordon must outlive a coordinator restart, or new work lands on the
        node being serviced the moment its agent reconnects."""
        with self._mutex, self._writable(f"the cordon or drain of node {node_id!r}"):
            if admin == "ACTIVE":
                self._db.execute("DELETE FROM node_admin WHERE node_id = ?", (node_id,))
            else:
                self._db.execute(
                    "INSERT INTO node_admin (node_id, admin, updated_at) VALUES (?, ?, ?) "
                    "ON CONFLICT(node_id) DO UPDATE SET admin = excluded.admin, updated_at = excluded.updated_at",
                    (node_id, admin, time.time()),
                )

    def load_node_admin(self) -> dict[str, str]:
        """node id -> CORDONED / DRAINING, as ``save_node_admin`` left them."""
        with self._mutex, self._readable("node cordons and drains"):
            return {str(n): str(a) for n, a in self._db.execute("SELECT node_id, admin FROM node_admin")}

    @contextlib.contextmanager
    def _writable(self, what: str):
        """sqlite3's errors on a write of its own (a full or read-only disk) as
        StateError, as a failed group commit is: the caller answers
        UNAVAILABLE naming the state, not UNKNOWN naming a Python class."""
        try:
            yield
        except sqlite3.Error as exc:
            raise StateError(f"{self.path}: could not store {what}: {exc}") from exc

    @contextlib.contextmanager
    def _readable(self, what: str):
        """sqlite3's errors on reading (a damaged page: "database disk image is
        malformed") as StateError naming the file, what was read and what to do."""
        try:
            yield
        except sqlite3.DatabaseError as exc:
            raise StateError(f"{self.path}: {what} cannot be read: {exc}; {_repair_hint(self.path)}") from exc

    def count(self) -> int:
        with self._mutex:
            return int(self._db.execute("SELECT COUNT(*) FROM tasks").fetchone()[0])

    # ---- retention -----------------------------------------------------------------
    def prune_finished(self, older_than_s: float, keep_at_most: int | None = None, *, now_wall: float | None = None) -> int:
        """Delete terminal tasks that finished more than ``older_than_s`` ago,
        and beyond the newest ``keep_at_most`` terminal tasks; returns how many.

        Queued and leased tasks are never pruned.
        """
        now_wall = time.time() if now_wall is None else now_wall
        with self._mutex, self._writable("the prune of finished tasks"):
            db = self._db
            db.execute("BEGIN IMMEDIATE")
            try:
                cur = db.execute("DELETE FROM tasks WHERE finished_at IS NOT NULL AND finished_at < ?", (now_wall - older_than_s,))
                deleted = cur.rowcount
                if keep_at_most is not None:
                    cur = db.execute(
                        "DELETE FROM tasks WHERE finished_at IS NOT NULL AND task_id NOT IN "
                        "(SELECT task_id FROM tasks WHERE finished_at IS NOT NULL ORDER BY finished_at DESC, submit_seq DESC LIMIT ?)",
                        (max(0, int(keep_at_most)),),
                    )
                    deleted += cur.rowcount
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise
            return deleted

    def _checkpoint_loop(self) -> None:
        db = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
        try:
            db.execute("PRAGMA busy_timeout=5000")
            done = 0
            while not self._stop_checkpoints.wait(self.background_checkpoint_s):
                if self.commits == done:
                    continue
                done = self.commits
                try:
                    # PASSIVE: never blocks the writer; it copies what it can
                    db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
                except sqlite3.Error as exc:
                    log.warning("state_checkpoint_failed", error=str(exc))
        finally:
            db.close()

    def checkpoint(self) -> None:
        """Fold the WAL into the database file (e.g. at a clean shutdown)."""
        with self._mutex:
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def integrity_check(self) -> str:
        with self._mutex:
            return str(self._db.execute("PRAGMA integrity_check").fetchone()[0])

    def close(self, *, flush: bool = True) -> None:
        """Commit what is staged (unless ``flush=False``), checkpoint, close, unlock."""
        if self._db is None:
            return
        if self._checkpointer is not None:
            self._stop_checkpoints.set()
            self._checkpointer.join()
            self._checkpointer = None
        try:
            if flush:
                self.commit()
            try:
                self.checkpoint()
            except sqlite3.Error:
                pass
        finally:
            with self._mutex:
                self._db.close()
                self._db = None
            self._release_lock()

    def __enter__(self) -> "TaskStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def state_dir_problem(state_dir: str | os.PathLike) -> str | None:
    """Why the daemon could not open ``state_dir`` (not a directory, a
    read-only disk, no write permission), found without creating or locking
    anything (``--print-config``); None when it looks usable."""
    path = Path(state_dir)
    if path.exists():
        if not path.is_dir():
            return f"state_dir {str(path)!r}: not a directory"
        if not os.access(path, os.W_OK | os.X_OK):
            return f"state_dir {str(path)!r}: not writable by this user (or on a read-only file system)"
        for name in (DB_NAME, DB_NAME + "-wal", DB_NAME + ".lock"):
            f = path / name
            if f.exists() and not os.access(f, os.R_OK | os.W_OK):
                return f"state_dir {str(path)!r}: {name} is not readable and writable by this user"
        return None
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        return f"state_dir {str(path)!r}: cannot be created: {str(parent)!r} is not writable by this user"
    return None


def open_state_dir(state_dir: str | os.PathLike, **kw) -> TaskStore:
    """Create ``state_dir`` (mode 0700) if needed and open its store."""
    path = Path(state_dir)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return TaskStore(path / DB_NAME, **kw)


# ---- group commit on the event loop ------------------------------------------------------------


class GroupCommitter:
    """One commit per event-loop turn for everything staged in that turn.

    ``stage(task)`` is synchronous (use it as a scheduler listener); the first
    stage of a turn schedules a commit with ``loop.call_soon`` (or
    ``call_later(delay_s)`` to gather across turns). ``await durable()`` returns
    once everything staged before it is committed, and raises ``StateError``
    if that commit failed. With ``offload=True`` the commit runs in a worker
    thread (for ``synchronous=FULL``, whose fsync would stall the loop); while
    one commit is in flight, new stages gather for the next.
    """

    def __init__(self, store: TaskStore, *, loop: asyncio.AbstractEventLoop | None = None, offload: bool = False, delay_s: float = 0.0) -> None:
        self.store = store
        self.loop = loop or asyncio.get_running_loop()
        self.offload = offload
        self.delay_s = delay_s
        self._next: asyncio.Future | None = None  # resolves when the next commit is done
        self._inflight: asyncio.Future | None = None  # the commit running in a thread
        self._scheduled = False
        self._running = False
        self.failures = 0
        #: called at each failed commit (the coordinator counts them in a metric)
        self.on_failure: Callable[[], object] | None = None

    def stage(self, task: Task) -> None:
        self.store.stage(task)
        self._schedule()

    def stage_policy(self, name: str, weights: Mapping[str, float]) -> None:
        self.store.stage_policy(name, weights)
        self._schedule()

    def _schedule(self) -> None:
        if self._scheduled or self._running:
            return  # the running commit reschedules itself when more is staged
        self._scheduled = True
        if self.delay_s > 0:
            self.loop.call_later(self.delay_s, self._start)
        else:
            self.loop.call_soon(self._start)

    def _start(self) -> None:
        self._scheduled = False
        if self._running:
            return
        future, self._next = self._next, None
        if not self.offload:
            self._finish(future, *self._commit())
            return
        self._running = True
        self._inflight = future = future or self.loop.create_future()
        work = self.loop.run_in_executor(None, self._commit)
        work.add_done_callback(lambda done: self._after_thread(future, done))

    def _commit(self) -> tuple[BaseException | None, int]:
        try:
            return None, self.store.commit()
        except BaseException as exc:  # handed to the waiters
            return exc, 0

    def _after_thread(self, future: asyncio.Future, done: asyncio.Future) -> None:
        self._running = False
        self._inflight = None
        error, rows = done.result()
        self._finish(future, error, rows)
        # more was staged meanwhile, or someone waits: go again (after a failure
        # only for waiters, so a broken disk is not retried in a tight loop)
        if self._next is not None or (error is None and self.store.pending):
            self._schedule()

    def _finish(self, future: asyncio.Future | None, error: BaseException | None, _rows: int) -> None:
        if error is not None:
            self.failures += 1
            if self.on_failure is not None:
                self.on_failure()
            log.error("state_commit_failed", error=str(error), failures=self.failures,
                      detail="the calls waiting on it get UNAVAILABLE (retry); what they changed is kept in memory and "
                             "stored by the next commit that works")
        if future is None or future.done():
            return
        if error is not None:
            future.set_exception(error if isinstance(error, StateError) else StateError(str(error)))
            future.add_done_callback(lambda f: f.exception())  # retrieved even if every waiter was cancelled
        else:
            future.set_result(None)

    async def durable(self) -> None:
        """Return once everything staged so far is committed."""
        if self.store.pending:
            if self._next is None:
                self._next = self.loop.create_future()
            self._schedule()
            await asyncio.shield(self._next)
        elif self._inflight is not None:
            await asyncio.shield(self._inflight)

    async def flush(self) -> None:
        """Commit now what is staged (e.g. before shutdown)."""
        while self.store.pending or self._running:
            await self.durable()


# ---- restore -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RestoreReport:
    queued: int
    leased: int
    finished: int
    dropped: int  # finished tasks beyond config.retain_finished, or unusable rows
    policy: str | None

    def as_dict(self) -> dict:
        return {"queued": self.queued, "leased": self.leased, "finished": self.finished, "dropped": self.dropped, "policy": self.policy}


def restore_into(scheduler: "Scheduler", restored: Restored, now: float | None = None) -> RestoreReport:
    """Rebuild a *fresh* ``Scheduler``'s state from ``restored``.

    * every task goes into ``_tasks`` in submission order (``tasks()`` order);
    * QUEUED tasks are pushed class by class in their stored entry order with
      ``AgingQueue.push(task, task.enqueued_at)``, so class, FIFO position,
      promotion due time and the P0 SLA watch are what they were; their
      deadline goes back on ``_deadlines`` (``submitted_at + deadline_s``, as
      ``submit`` computes it);
    * LEASED tasks get their lease back in ``_leases`` (same id and expiry; an
      expired one ends at the next ``expire_leases``), a reservation of the
      spec's VRAM and share on their GPUs with NaN readings (so it counts in
      full until fresh readings arrive: ``Reservations.add``), and their entry
      in ``_by_node``; a LEASED row without an assignment is re-queued;
    * terminal tasks are kept for idempotent resubmission, the newest
      ``config.retain_finished`` of them, in ``_finished`` by finish time;
    * the stored policy is applied with ``set_policy`` (an unknown one is
      logged and the configured policy stays).

    Queue times later than ``now`` (a wall clock stepped back) are clamped to
    ``now``. Listeners are not called: nothing changed. The tasks are not
    re-checked against the first snapshot (``_unchecked``): right after a
    restart the cluster is not whole yet and "never fits" would be wrong.

    Engine internals used: ``_tasks``, ``_queue``, ``_leases`` (``_put``),
    ``_reservations``, ``_by_node``, ``_finished``, ``_deadlines``, ``_clock``,
    ``config``. A ``Scheduler.restore(tasks, entry_order)`` doing the same
    inside the engine would let this function shrink to a call.
    """
    import heapq

    s = scheduler
    if s._tasks or len(s._queue) or len(s._leases) or len(s._reservations):
        raise ValueError("restore_into needs a fresh scheduler (it already has tasks, leases or reservations)")
    now = s._clock() if now is None else now
    order = restored.entry_order
    queued: list[Task] = []
    leased: list[Task] = []
    finished: list[Task] = []
    dropped = 0
    for task in restored.tasks:
        if task.state == TaskState.PREEMPTED:
            # a passage the engine leaves at once for QUEUED; stored only if a
            # write ever stopped between the two
            task.state = TaskState.QUEUED
            task.assignment = None
            task.queued_at = task.enqueued_at = now
        if task.state == TaskState.LEASED and task.assignment is None:
            task.state = TaskState.QUEUED
            task.reason = "re-queued on restore: lease record missing"
            task.queued_at = task.enqueued_at = now
        if task.state == TaskState.QUEUED:
            task.submitted_at = min(task.submitted_at, now)
            task.queued_at = min(task.queued_at, now)
            task.enqueued_at = min(task.enqueued_at, now)
            queued.append(task)
        elif task.state == TaskState.LEASED:
            leased.append(task)
        elif task.state in TERMINAL_STATES:
            finished.append(task)
        else:  # pragma: no cover - every TaskState is one of the above
            dropped += 1
            continue
    finished.sort(key=lambda t: t.finished_at if t.finished_at is not None else -math.inf)
    keep = s.config.retain_finished
    if len(finished) > keep:
        dropped += len(finished) - keep
        gone = {t.task_id for t in finished[: len(finished) - keep]}
        finished = finished[len(finished) - keep :]
    else:
        gone = set()

    for task in restored.tasks:
        if task.task_id not in gone:
            s._tasks[task.task_id] = task
    s._finished.extend(t.task_id for t in finished)

    for task in sorted(queued, key=lambda t: (int(t.priority), order.get(t.task_id, 0))):
        s._queue.push(task, task.enqueued_at)
        if task.spec.deadline_s > 0:
            heapq.heappush(s._deadlines, (task.submitted_at + task.spec.deadline_s, task.task_id))

    for task in leased:
        a = task.assignment
        lease = Lease(a.lease_id, task.task_id, a.lease_expires_at)
        if s._leases.get(a.lease_id) is not None or a.lease_id in s._reservations:
            log.warning("restore_duplicate_lease", lease_id=a.lease_id, task_id=task.task_id, kept="the first; this lease dropped")
            continue
        s._leases._put(lease)
        spec = task.spec
        # the task runs: its memory is in the readings its agent sends on reconnecting
        s._reservations.add(a.lease_id, a.gpu_uuids, float(spec.vram_mib), 100.0 * spec.gpu_share,
                            [math.nan] * len(a.gpu_uuids), shown=True)
        s._by_node.setdefault(a.node_id, set()).add(task.task_id)
        s.count_p0_lease(task, 1)
    s._view = None  # reservations changed under any view

    policy = None
    if restored.policy is not None:
        try:
            s.set_policy(restored.policy.name, dict(restored.policy.weights))
            policy = restored.policy.name
        except Exception as exc:  # UnknownPolicy / InvalidWeight from an older or newer build
            log.warning("restore_policy_not_applied", policy=restored.policy.name, error=str(exc))
    return RestoreReport(queued=len(queued), leased=len(leased), finished=len(finished), dropped=dropped, policy=policy)


# ---- benchmark ---------------------------------------------------------------------------------


def _bench_task(i: int, now: float) -> Task:
    spec = TaskSpec(task_id=f"bench-{i:07d}", tenant=f"t{i % 7}", kind="batch", vram_mib=4096.0, gpu_share=0.25,
                    labels={"team": "bench"}, priority=Priority(i % 4))
    return Task(spec=spec, state=TaskState.QUEUED, priority=spec.priority, submitted_at=now, queued_at=now, enqueued_at=now)


def bench(directory: str | os.PathLike, *, synchronous: str = "NORMAL", batches: Iterable[int] = (1, 10, 100), rounds: int = 200,
          background_checkpoint_s: float | None = None) -> list[dict]:
    """Commit latency for batches of new QUEUED tasks; one row per batch size."""
    out = []
    for batch in batches:
        path = Path(directory) / f"bench-{synchronous.lower()}-{batch}.sqlite3"
        for suffix in ("", "-wal", "-shm", ".lock"):
            Path(str(path) + suffix).unlink(missing_ok=True)
        store = TaskStore(path, synchronous=synchronous, background_checkpoint_s=background_checkpoint_s)
        times = []
        n = 0
        for _ in range(rounds):
            now = time.monotonic()
            for _ in range(batch):
                store.stage(_bench_task(n, now))
                n += 1
            t0 = time.perf_counter()
            store.commit()
            times.append(time.perf_counter() - t0)
        store.close()
        times.sort()
        out.append({
            "synchronous": synchronous, "background_checkpoint_s": background_checkpoint_s, "batch": batch, "commits": rounds,
            "p50_ms": 1e3 * statistics.median(times), "p99_ms": 1e3 * times[int(0.99 * (len(times) - 1))],
            "per_task_us": 1e6 * statistics.mean(times) / batch,
        })
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m coordinator.state")
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bench", help="commit latency of the task store")
    b.add_argument("dir")
    b.add_argument("--rounds", type=int, default=200)
    b.add_argument("--sync", default="NORMAL,FULL")
    b.add_argument("--background-checkpoint-s", type=float, default=None)
    args = parser.parse_args(argv)
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    for sync in args.sync.split(","):
        for row in bench(args.dir, synchronous=sync, rounds=args.rounds, background_checkpoint_s=args.background_checkpoint_s):
            print(json.dumps(row))


if __name__ == "__main__":  # pragma: no cover
    main()
