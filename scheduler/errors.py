"""The scheduler's exception tree, documented in one place.

The coordinator maps each class to one gRPC status code (column below), so every
exception carries the precise field, task, policy or reason the client needs;
``str(exc)`` is the human message.

======================  ==========================  =====================================
exception               gRPC status                 carries
======================  ==========================  =====================================
InvalidArgument         INVALID_ARGUMENT            ``field``, ``message``
  InvalidTask           INVALID_ARGUMENT            ``field`` of TaskSpec, ``message``
  InvalidWeight         INVALID_ARGUMENT            ``name`` of the weight, ``message``
  UnknownPolicy         INVALID_ARGUMENT            ``name``, ``available``
TaskConflict            ALREADY_EXISTS              ``task_id``, ``fields`` that differ
UnknownTask             NOT_FOUND                   ``task_id``
NotLeaseHolder          FAILED_PRECONDITION         ``task_id``, ``lease_id``, ``reason``
TaskFinished            FAILED_PRECONDITION         ``task_id``, ``state``
Unplaceable             FAILED_PRECONDITION         ``reason``, ``rejected`` counts
======================  ==========================  =====================================
"""

from __future__ import annotations

from typing import Mapping, Sequence

__all__ = [
    "SchedulerError",
    "InvalidArgument",
    "InvalidTask",
    "InvalidWeight",
    "UnknownPolicy",
    "TaskConflict",
    "UnknownTask",
    "NotLeaseHolder",
    "LeaseMismatch",
    "TaskFinished",
    "Unplaceable",
]


class SchedulerError(Exception):
    """Base of every error the scheduler raises on purpose."""


class InvalidArgument(SchedulerError):
    """A request value is out of range, NaN, malformed or unknown."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class InvalidTask(InvalidArgument):
    """A ``TaskSpec`` field fails validation; ``field`` is its proto name."""


class InvalidWeight(InvalidArgument):
    """A policy weight is unknown to the policy, negative or not finite."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"weights[{name}]", message)
        self.name = name


class UnknownPolicy(InvalidArgument):
    """No policy is registered under ``name``."""

    def __init__(self, name: str, available: Sequence[str]) -> None:
        super().__init__(
            "name", f"unknown policy {name!r}; available: {', '.join(sorted(available))}"
        )
        self.name = name
        self.available = tuple(sorted(available))


class TaskConflict(SchedulerError):
    """A task id was resubmitted with a different spec."""

    def __init__(self, task_id: str, fields: Sequence[str]) -> None:
        super().__init__(
            f"task {task_id!r} already exists with a different spec "
            f"(differs in: {', '.join(fields)})"
        )
        self.task_id = task_id
        self.fields = tuple(fields)


class UnknownTask(SchedulerError):
    """No task with this id is known (never submitted, or forgotten)."""

    def __init__(self, task_id: str) -> None:
        super().__init__(f"unknown task {task_id!r}")
        self.task_id = task_id


class NotLeaseHolder(SchedulerError):
    """The caller's lease id is not the task's live lease (wrong, expired, or none)."""

    def __init__(self, task_id: str, lease_id: str, reason: str) -> None:
        super().__init__(f"task {task_id!r}, lease {lease_id!r}: {reason}")
        self.task_id = task_id
        self.lease_id = lease_id
        self.reason = reason


# One class, two names: the brief's two spellings of the same condition.
LeaseMismatch = NotLeaseHolder


class TaskFinished(SchedulerError):
    """The task already reached a final state that the operation cannot change."""

    def __init__(self, task_id: str, state: str) -> None:
        super().__init__(f"task {task_id!r} is already {state}")
        self.task_id = task_id
        self.state = state


class Unplaceable(SchedulerError):
    """A task cannot be placed; ``reason`` says why, ``rejected`` counts GPUs per filter."""

    def __init__(self, reason: str, rejected: Mapping[str, int] | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.rejected = dict(rejected or {})
