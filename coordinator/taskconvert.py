"""Proto conversion for the scheduling API, in one place: ``tasks_pb2``
messages to and from the scheduler's domain types. Monotonic times become Unix
nanoseconds here, with an offset taken once per process."""

from __future__ import annotations

import time

from protos import tasks_pb2 as tpb
from scheduler.errors import InvalidTask
from scheduler.task import Priority, Task, TaskSpec, TaskState

__all__ = ["spec_from_proto", "task_to_proto", "priority_to_proto", "priority_from_proto", "WallClock"]


def priority_from_proto(value: int) -> Priority:
    """PRIORITY_P0..P3 (1..4) -> Priority; UNSPECIFIED (0) means P2."""
    if value == tpb.PRIORITY_UNSPECIFIED:
        return Priority.P2
    if value not in (tpb.PRIORITY_P0, tpb.PRIORITY_P1, tpb.PRIORITY_P2, tpb.PRIORITY_P3):
        raise InvalidTask("priority", f"unknown priority {value}; use PRIORITY_P0..PRIORITY_P3")
    return Priority(value - 1)


def priority_to_proto(priority: Priority) -> int:
    return int(priority) + 1


#: MiB: no GPU has more (the telemetry field table's bound too)
MAX_VRAM_MIB = 4 * 1024 * 1024


def spec_from_proto(spec: tpb.TaskSpec) -> TaskSpec:
    """A validated TaskSpec; InvalidTask names the field."""
    if spec.vram_mib > MAX_VRAM_MIB:
        raise InvalidTask("vram_mib", f"{spec.vram_mib} MiB is more than any GPU has (at most {MAX_VRAM_MIB})")
    return TaskSpec(
        task_id=spec.task_id,
        tenant=spec.tenant,
        priority=priority_from_proto(spec.priority),
        kind=spec.kind,
        num_gpus=spec.num_gpus or 1,  # proto3 cannot tell unset from 0: unset means one GPU
        vram_mib=float(spec.vram_mib),
        gpu_share=spec.gpu_share,
        duration_s=spec.duration_s,
        gpu_spec=spec.gpu_spec,
        needs_nvlink=spec.needs_nvlink,
        io_heavy=spec.io_heavy,
        movable=spec.movable,
        deadline_s=spec.deadline_s,
        labels=dict(spec.labels),
        required_node_labels=dict(spec.required_node_labels),
        preferred_node_labels=dict(spec.preferred_node_labels),
    ).validate()


def spec_to_proto(spec: TaskSpec) -> tpb.TaskSpec:
    return tpb.TaskSpec(
        task_id=spec.task_id,
        tenant=spec.tenant,
        priority=priority_to_proto(spec.priority),
        kind=spec.kind,
        num_gpus=spec.num_gpus,
        vram_mib=int(spec.vram_mib),
        gpu_share=spec.gpu_share,
        duration_s=spec.duration_s,
        gpu_spec=spec.gpu_spec,
        needs_nvlink=spec.needs_nvlink,
        io_heavy=spec.io_heavy,
        movable=spec.movable,
        deadline_s=spec.deadline_s,
        labels=dict(spec.labels),
        required_node_labels=dict(spec.required_node_labels),
        preferred_node_labels=dict(spec.preferred_node_labels),
    )


class WallClock:
    """Monotonic seconds -> Unix nanoseconds, with one offset per process."""

    def __init__(self, monotonic=time.monotonic) -> None:
        self.offset_ns = time.time_ns() - int(monotonic() * 1e9)

    def ns(self, monotonic_s: float | None) -> int:
        if monotonic_s is None:
            return 0
        return int(monotonic_s * 1e9) + self.offset_ns


def task_to_proto(task: Task, wall: WallClock, *, sla_s: float = 5.0) -> tpb.Task:
    msg = tpb.Task(
        spec=spec_to_proto(task.spec),
        state=int(task.state),
        effective_priority=priority_to_proto(task.priority),
        submitted_at_ns=wall.ns(task.submitted_at),
        reason=task.reason,
        finished_at_ns=wall.ns(task.finished_at),
        sla_missed=task.sla_missed,
        attempts=task.attempts,
    )
    a = task.assignment
    if a is not None and task.state != TaskState.QUEUED:
        msg.assignment.CopyFrom(
            tpb.Assignment(
                node_id=a.node_id,
                gpu_index=list(a.gpu_indices),
                gpu_uuid=list(a.gpu_uuids),
                lease_id=a.lease_id,
                lease_expires_at_ns=wall.ns(a.lease_expires_at),
                placed_at_ns=wall.ns(a.placed_at),
                run_started_at_ns=wall.ns(a.run_start),
                score=tpb.ScoreBreakdown(
                    policy=a.score.policy,
                    total=a.score.total,
                    terms=dict(a.score.terms),
                    candidates=a.score.candidates,
                ),
            )
        )
    return msg
