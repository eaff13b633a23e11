"""gpulb's placement library: queue, filters, scores, policies, reservations, leases.

Pure Python and numpy, synchronous, with an injected clock; the coordinator
wraps ``Scheduler`` in its servicer and the simulator drives it on virtual time.
"""

from scheduler.config import SchedulerConfig
from scheduler.engine import ClassSummary, PolicyInfo, QueueSummary, Scheduler
from scheduler.errors import (
    InvalidArgument,
    InvalidTask,
    InvalidWeight,
    LeaseMismatch,
    NotLeaseHolder,
    SchedulerError,
    TaskConflict,
    TaskFinished,
    UnknownPolicy,
    UnknownTask,
    Unplaceable,
)
from scheduler.policies import POLICIES, Placement, Policy, make_policy
from scheduler.queue import AgingQueue, Outcome
from scheduler.reservations import Lease, LeaseBook, Reservations
from scheduler.snapshot import ClusterSnapshot, NodeFacts
from scheduler.task import Assignment, Priority, ScoreBreakdown, Task, TaskSpec, TaskState
from scheduler.view import PlacementView

__all__ = [
    "AgingQueue",
    "Assignment",
    "ClassSummary",
    "ClusterSnapshot",
    "InvalidArgument",
    "InvalidTask",
    "InvalidWeight",
    "Lease",
    "LeaseBook",
    "LeaseMismatch",
    "NodeFacts",
    "NotLeaseHolder",
    "Outcome",
    "POLICIES",
    "Placement",
    "PlacementView",
    "Policy",
    "PolicyInfo",
    "Priority",
    "QueueSummary",
    "Reservations",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerError",
    "ScoreBreakdown",
    "Task",
    "TaskConflict",
    "TaskFinished",
    "TaskSpec",
    "TaskState",
    "UnknownPolicy",
    "UnknownTask",
    "Unplaceable",
    "make_policy",
]
