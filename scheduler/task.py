"""Domain types of a task: its priority, its life-cycle states, the spec a client
submits (mirroring ``gpulb.v1.TaskSpec``) and the scheduler's record of it.

Times on a ``Task`` are monotonic seconds from the scheduler's injected clock;
the coordinator converts them to Unix nanoseconds for the wire.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, fields
from enum import IntEnum
from typing import Mapping

from scheduler.errors import InvalidTask
from scheduler.gpuspec import parse_gpu_spec

__all__ = [
    "Priority",
    "TaskState",
    "TERMINAL_STATES",
    "TaskSpec",
    "ScoreBreakdown",
    "Assignment",
    "Task",
    "MAX_TASK_ID_LEN",
    "MAX_GPUS",
    "MAX_REASON_LEN",
]

MAX_TASK_ID_LEN = 128
# kind and tenant name metric labels (gpulb_memory_growth_*, gpulb_predictor_*,
# per-tenant counters) and table columns: bounded so that one client cannot
# grow a scrape or a table without end
MAX_KIND_LEN = 64
# distinct kinds the learners keep apart (scheduler.predictor, scheduler.memgrowth):
# the learners keep at most this many kinds, so that a client inventing kinds
# cannot grow them, their state or a scrape without end: past it memory
# growth learns a new kind only into the all-kinds figures, and the speed
# predictor replaces the kind least recently completed
MAX_LEARNED_KINDS = 64
MAX_TENANT_LEN = 128
# each label map: entries, key and value length
MAX_LABELS = 64
MAX_LABEL_KEY_LEN = 128
MAX_LABEL_VALUE_LEN = 256
# CancelTaskRequest.reason: kept as Task.reason, stored, and returned by every
# ListTasks and GetTask: a sentence or two, not a document (40 cancels with
# 3.5 MB reasons made ListTasks too large for any client)
MAX_REASON_LEN = 1024
MAX_GPU_SPEC_LEN = 256
# characters of keys and values of the three label maps together: each may
# hold 64 entries of 128 + 256, and a task at all three limits kept ~159 KiB
# of memory (and its row in the state file) for as long as it is retained,
# a day and up to 100,000 finished tasks by default: one client could pin
# gigabytes (QA pass 23). 8,192 is a few dozen labels of ordinary length.
MAX_LABEL_TEXT = 8192
MAX_GPUS = 64

# Task.seq: every record made in this process gets the next number, so a
# scheduler, which adds each record to its table as it makes it (a restore
# adds the stored ones in their submission order before any new one), holds
# its tasks in increasing ``seq`` order: ListTasks pages by it.
_next_seq = itertools.count(1).__next__


class Priority(IntEnum):
    """Queue class; 0 is the most urgent. Proto value = this value + 1."""

    P0 = 0  # real-time inference; waiting past the SLA bound is a miss
    P1 = 1  # interactive / fine-tuning
    P2 = 2  # batch
    P3 = 3  # background


class TaskState(IntEnum):
    """Where a task is in its life. Proto value = this value."""

    QUEUED = 1
    LEASED = 2
    COMPLETED = 3
    CANCELLED = 4
    EXPIRED = 5  # lease ran out, or the queue deadline passed before placement
    LOST = 6  # its node was removed while it ran; final unless re-queued (``Task.requeued``)
    REJECTED = 7  # can never fit any current node
    FAILED = 8  # the lease holder reported failure
    PREEMPTED = 9  # evicted for a P0 task: the lease ended, and it is QUEUED again at once


TERMINAL_STATES = frozenset(
    {
        TaskState.COMPLETED,
        TaskState.CANCELLED,
        TaskState.EXPIRED,
        TaskState.LOST,
        TaskState.REJECTED,
        TaskState.FAILED,
    }
)


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class TaskSpec:
    """What a client asks for; field names and units are those of tasks.proto.

    Equality is by value (the idempotency check compares specs). The label
    maps are copied on construction so a caller mutating its dict later cannot
    change an accepted spec.
    """

    task_id: str
    tenant: str = ""
    priority: Priority = Priority.P2
    kind: str = ""  # "inference", "training", "batch", "background" or free text
    num_gpus: int = 1  # GPUs on one node
    vram_mib: float = 0.0  # MiB per GPU, > 0 (0 fails validation, as on the wire)
    gpu_share: float = 0.0  # 0..1 expected utilisation share of each GPU
    duration_s: float = 0.0  # s, estimate; 0 = unknown
    gpu_spec: str = ""  # "V100M16|V100M32" style; empty = any model
    needs_nvlink: bool = False
    io_heavy: bool = False
    movable: bool = False
    deadline_s: float = 0.0  # s from submission to stop waiting; 0 = none
    labels: Mapping[str, str] = field(default_factory=dict)
    required_node_labels: Mapping[str, str] = field(default_factory=dict)
    preferred_node_labels: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("labels", "required_node_labels", "preferred_node_labels"):
            object.__setattr__(self, name, dict(getattr(self, name)))

    # Specs with equal values share a task id, so hashing by id is consistent with ==.
    def __hash__(self) -> int:
        return hash(self.task_id)

    def validate(self) -> "TaskSpec":
        """Raise ``InvalidTask(field, message)`` for the first bad field; return self."""
        if not isinstance(self.task_id, str) or not self.task_id:
            raise InvalidTask("task_id", "must be a non-empty string")
        if len(self.task_id) > MAX_TASK_ID_LEN:
            raise InvalidTask("task_id", f"longer than {MAX_TASK_ID_LEN} characters")
        if not self.task_id.isprintable():
            raise InvalidTask("task_id", "contains control characters")
        for name, limit in (("kind", MAX_KIND_LEN), ("tenant", MAX_TENANT_LEN)):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise InvalidTask(name, "must be a string")
            if len(value) > limit:
                raise InvalidTask(name, f"longer than {limit} characters ({len(value)})")
            if not value.isprintable():
                raise InvalidTask(name, "contains control characters")
        try:
            Priority(self.priority)
        except ValueError:
            raise InvalidTask("priority", f"unknown priority {self.priority!r}") from None
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise InvalidTask("priority", f"unknown priority {self.priority!r}")
        if isinstance(self.num_gpus, bool) or not isinstance(self.num_gpus, int):
            raise InvalidTask("num_gpus", "must be an integer")
        if not 1 <= self.num_gpus <= MAX_GPUS:
            raise InvalidTask("num_gpus", f"must be in 1..{MAX_GPUS}, got {self.num_gpus}")
        if not _finite(self.vram_mib) or self.vram_mib <= 0:
            raise InvalidTask("vram_mib", f"must be a finite number > 0, got {self.vram_mib!r}")
        if not _finite(self.gpu_share) or not 0.0 <= self.gpu_share <= 1.0:
            raise InvalidTask("gpu_share", f"must be in 0..1, got {self.gpu_share!r}")
        if not _finite(self.duration_s) or self.duration_s < 0:
            raise InvalidTask("duration_s", f"must be finite and >= 0, got {self.duration_s!r}")
        if not _finite(self.deadline_s) or self.deadline_s < 0:
            raise InvalidTask("deadline_s", f"must be finite and >= 0, got {self.deadline_s!r}")
        if not isinstance(self.gpu_spec, str):
            raise InvalidTask("gpu_spec", "must be a string")
        if len(self.gpu_spec) > MAX_GPU_SPEC_LEN:
            # a few model names joined by "|"; 3 MB was taken, kept and repeated whole in errors
            raise InvalidTask("gpu_spec", f"{len(self.gpu_spec):,} characters; at most {MAX_GPU_SPEC_LEN}")
        try:
            parse_gpu_spec(self.gpu_spec)
        except ValueError as exc:
            raise InvalidTask("gpu_spec", str(exc)) from None
        text = 0
        for name in ("labels", "required_node_labels", "preferred_node_labels"):
            entries = getattr(self, name)
            if len(entries) > MAX_LABELS:
                raise InvalidTask(name, f"more than {MAX_LABELS} entries ({len(entries)})")
            for key, value in entries.items():
                if not isinstance(key, str) or not isinstance(value, str) or not key:
                    raise InvalidTask(name, f"keys and values must be strings, got {key!r}")
                if len(key) > MAX_LABEL_KEY_LEN:
                    raise InvalidTask(name, f"key {key[:32]!r}... longer than {MAX_LABEL_KEY_LEN} characters")
                if len(value) > MAX_LABEL_VALUE_LEN:
                    raise InvalidTask(f"{name}[{key}]", f"longer than {MAX_LABEL_VALUE_LEN} characters ({len(value)})")
                text += len(key) + len(value)
            if text > MAX_LABEL_TEXT:
                raise InvalidTask(name, f"labels, required_node_labels and preferred_node_labels hold {text:,} characters "
                                        f"of keys and values together so far; at most {MAX_LABEL_TEXT:,}")
        return self

    def differing_fields(self, other: "TaskSpec") -> list[str]:
        """Names of fields whose values differ (for ``TaskConflict``)."""
        return [f.name for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]


@dataclass(frozen=True, slots=True)
class ScoreBreakdown:
    """Why a placement won: lower total is better (tasks.proto ScoreBreakdown)."""

    policy: str
    total: float
    terms: Mapping[str, float]  # term -> weighted contribution
    candidates: int  # GPUs (or GPU sets) that passed the filters


@dataclass(frozen=True, slots=True)
class Assignment:
    """Where a task runs, under which lease (tasks.proto Assignment)."""

    node_id: str
    gpu_indices: tuple[int, ...]
    gpu_uuids: tuple[str, ...]
    lease_id: str
    lease_expires_at: float  # monotonic s
    score: ScoreBreakdown
    placed_at: float  # monotonic s: this placement (a migration's is the move)
    # monotonic s of the run's first placement, kept across migrations (a
    # checkpointed run resumes, it does not start over); None: placed_at
    run_started_at: float | None = None

    @property
    def run_start(self) -> float:
        """When this run began: its first placement, before any migration."""
        return self.placed_at if self.run_started_at is None else self.run_started_at


@dataclass(eq=False)
class Task:
    """The scheduler's mutable record of one task.

    ``enqueued_at`` is when the task entered its *current* queue class (aging
    counts from it); ``queued_at`` is when it last entered the queue at all
    (the P0 SLA and the queue deadline count from it, re-queues restart it).
    Listeners receive shallow copies, which are true snapshots because every
    field value is immutable.
    """

    spec: TaskSpec
    state: TaskState
    priority: Priority  # effective, after aging
    submitted_at: float
    queued_at: float
    enqueued_at: float
    assignment: Assignment | None = None
    reason: str = ""
    attempts: int = 0  # placements so far
    sla_missed: bool = False
    finished_at: float | None = None
    # True only on the LOST update listeners get when a retryable task's node
    # is removed: that run was lost, but the task is QUEUED again at once (the
    # retry rule), so it has not ended, as after PREEMPTED
    requeued: bool = False
    # the record's place in submission order (``_next_seq``): later records
    # have larger numbers; a copy keeps it; numbers start over in a new process
    seq: int = field(default_factory=_next_seq, repr=False)

    @property
    def task_id(self) -> str:
        return self.spec.task_id

    @property
    def terminal(self) -> bool:
        """Whether the task has ended for good: a watch ends here, and it
        counts as finished (not the LOST of a run whose task is re-queued)."""
        return self.state in TERMINAL_STATES and not self.requeued

    def __copy__(self) -> "Task":
        # copy.copy's generic __reduce_ex__ route costs ~8 us; every state
        # change hands listeners a copy, on the placing path too
        twin = object.__new__(Task)
        twin.__dict__.update(self.__dict__)
        return twin
