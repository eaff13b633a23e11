from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Priority(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRIORITY_UNSPECIFIED: _ClassVar[Priority]
    PRIORITY_P0: _ClassVar[Priority]
    PRIORITY_P1: _ClassVar[Priority]
    PRIORITY_P2: _ClassVar[Priority]
    PRIORITY_P3: _ClassVar[Priority]

class TaskState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TASK_STATE_UNSPECIFIED: _ClassVar[TaskState]
    TASK_STATE_QUEUED: _ClassVar[TaskState]
    TASK_STATE_LEASED: _ClassVar[TaskState]
    TASK_STATE_COMPLETED: _ClassVar[TaskState]
    TASK_STATE_CANCELLED: _ClassVar[TaskState]
    TASK_STATE_EXPIRED: _ClassVar[TaskState]
    TASK_STATE_LOST: _ClassVar[TaskState]
    TASK_STATE_REJECTED: _ClassVar[TaskState]
    TASK_STATE_FAILED: _ClassVar[TaskState]
    TASK_STATE_PREEMPTED: _ClassVar[TaskState]
PRIORITY_UNSPECIFIED: Priority
PRIORITY_P0: Priority
PRIORITY_P1: Priority
PRIORITY_P2: Priority
PRIORITY_P3: Priority
TASK_STATE_UNSPECIFIED: TaskState
TASK_STATE_QUEUED: TaskState
TASK_STATE_LEASED: TaskState
TASK_STATE_COMPLETED: TaskState
TASK_STATE_CANCELLED: TaskState
TASK_STATE_EXPIRED: TaskState
TASK_STATE_LOST: TaskState
TASK_STATE_REJECTED: TaskState
TASK_STATE_FAILED: TaskState
TASK_STATE_PREEMPTED: TaskState

class TaskSpec(_message.Message):
    __slots__ = ("task_id", "tenant", "priority", "kind", "num_gpus", "vram_mib", "gpu_share", "duration_s", "gpu_spec", "needs_nvlink", "io_heavy", "movable", "deadline_s", "labels", "required_node_labels", "preferred_node_labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class RequiredNodeLabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class PreferredNodeLabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NUM_GPUS_FIELD_NUMBER: _ClassVar[int]
    VRAM_MIB_FIELD_NUMBER: _ClassVar[int]
    GPU_SHARE_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    GPU_SPEC_FIELD_NUMBER: _ClassVar[int]
    NEEDS_NVLINK_FIELD_NUMBER: _ClassVar[int]
    IO_HEAVY_FIELD_NUMBER: _ClassVar[int]
    MOVABLE_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    REQUIRED_NODE_LABELS_FIELD_NUMBER: _ClassVar[int]
    PREFERRED_NODE_LABELS_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    tenant: str
    priority: Priority
    kind: str
    num_gpus: int
    vram_mib: int
    gpu_share: float
    duration_s: float
    gpu_spec: str
    needs_nvlink: bool
    io_heavy: bool
    movable: bool
    deadline_s: float
    labels: _containers.ScalarMap[str, str]
    required_node_labels: _containers.ScalarMap[str, str]
    preferred_node_labels: _containers.ScalarMap[str, str]
    def __init__(self, task_id: _Optional[str] = ..., tenant: _Optional[str] = ..., priority: _Optional[_Union[Priority, str]] = ..., kind: _Optional[str] = ..., num_gpus: _Optional[int] = ..., vram_mib: _Optional[int] = ..., gpu_share: _Optional[float] = ..., duration_s: _Optional[float] = ..., gpu_spec: _Optional[str] = ..., needs_nvlink: _Optional[bool] = ..., io_heavy: _Optional[bool] = ..., movable: _Optional[bool] = ..., deadline_s: _Optional[float] = ..., labels: _Optional[_Mapping[str, str]] = ..., required_node_labels: _Optional[_Mapping[str, str]] = ..., preferred_node_labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ScoreBreakdown(_message.Message):
    __slots__ = ("policy", "total", "terms", "candidates")
    class TermsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    POLICY_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    TERMS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    policy: str
    total: float
    terms: _containers.ScalarMap[str, float]
    candidates: int
    def __init__(self, policy: _Optional[str] = ..., total: _Optional[float] = ..., terms: _Optional[_Mapping[str, float]] = ..., candidates: _Optional[int] = ...) -> None: ...

class Assignment(_message.Message):
    __slots__ = ("node_id", "gpu_index", "gpu_uuid", "lease_id", "lease_expires_at_ns", "score", "placed_at_ns", "run_started_at_ns")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    GPU_INDEX_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_AT_NS_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    PLACED_AT_NS_FIELD_NUMBER: _ClassVar[int]
    RUN_STARTED_AT_NS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    gpu_index: _containers.RepeatedScalarFieldContainer[int]
    gpu_uuid: _containers.RepeatedScalarFieldContainer[str]
    lease_id: str
    lease_expires_at_ns: int
    score: ScoreBreakdown
    placed_at_ns: int
    run_started_at_ns: int
    def __init__(self, node_id: _Optional[str] = ..., gpu_index: _Optional[_Iterable[int]] = ..., gpu_uuid: _Optional[_Iterable[str]] = ..., lease_id: _Optional[str] = ..., lease_expires_at_ns: _Optional[int] = ..., score: _Optional[_Union[ScoreBreakdown, _Mapping]] = ..., placed_at_ns: _Optional[int] = ..., run_started_at_ns: _Optional[int] = ...) -> None: ...

class Task(_message.Message):
    __slots__ = ("spec", "state", "effective_priority", "submitted_at_ns", "assignment", "reason", "finished_at_ns", "sla_missed", "attempts")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    EFFECTIVE_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    SUBMITTED_AT_NS_FIELD_NUMBER: _ClassVar[int]
    ASSIGNMENT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_NS_FIELD_NUMBER: _ClassVar[int]
    SLA_MISSED_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    spec: TaskSpec
    state: TaskState
    effective_priority: Priority
    submitted_at_ns: int
    assignment: Assignment
    reason: str
    finished_at_ns: int
    sla_missed: bool
    attempts: int
    def __init__(self, spec: _Optional[_Union[TaskSpec, _Mapping]] = ..., state: _Optional[_Union[TaskState, str]] = ..., effective_priority: _Optional[_Union[Priority, str]] = ..., submitted_at_ns: _Optional[int] = ..., assignment: _Optional[_Union[Assignment, _Mapping]] = ..., reason: _Optional[str] = ..., finished_at_ns: _Optional[int] = ..., sla_missed: _Optional[bool] = ..., attempts: _Optional[int] = ...) -> None: ...

class ScheduleTaskRequest(_message.Message):
    __slots__ = ("spec", "wait")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    spec: TaskSpec
    wait: bool
    def __init__(self, spec: _Optional[_Union[TaskSpec, _Mapping]] = ..., wait: _Optional[bool] = ...) -> None: ...

class ScheduleTaskResponse(_message.Message):
    __slots__ = ("task",)
    TASK_FIELD_NUMBER: _ClassVar[int]
    task: Task
    def __init__(self, task: _Optional[_Union[Task, _Mapping]] = ...) -> None: ...

class ScheduleTasksRequest(_message.Message):
    __slots__ = ("specs", "wait")
    SPECS_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    specs: _containers.RepeatedCompositeFieldContainer[TaskSpec]
    wait: bool
    def __init__(self, specs: _Optional[_Iterable[_Union[TaskSpec, _Mapping]]] = ..., wait: _Optional[bool] = ...) -> None: ...

class ScheduleTasksResponse(_message.Message):
    __slots__ = ("tasks",)
    TASKS_FIELD_NUMBER: _ClassVar[int]
    tasks: _containers.RepeatedCompositeFieldContainer[Task]
    def __init__(self, tasks: _Optional[_Iterable[_Union[Task, _Mapping]]] = ...) -> None: ...

class GetTaskRequest(_message.Message):
    __slots__ = ("task_id",)
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    def __init__(self, task_id: _Optional[str] = ...) -> None: ...

class ListTasksRequest(_message.Message):
    __slots__ = ("state", "tenant", "limit", "page_token", "paged")
    STATE_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PAGED_FIELD_NUMBER: _ClassVar[int]
    state: TaskState
    tenant: str
    limit: int
    page_token: str
    paged: bool
    def __init__(self, state: _Optional[_Union[TaskState, str]] = ..., tenant: _Optional[str] = ..., limit: _Optional[int] = ..., page_token: _Optional[str] = ..., paged: _Optional[bool] = ...) -> None: ...

class ListTasksResponse(_message.Message):
    __slots__ = ("tasks", "next_page_token")
    TASKS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    tasks: _containers.RepeatedCompositeFieldContainer[Task]
    next_page_token: str
    def __init__(self, tasks: _Optional[_Iterable[_Union[Task, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class WatchTaskRequest(_message.Message):
    __slots__ = ("task_id",)
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    def __init__(self, task_id: _Optional[str] = ...) -> None: ...

class CompleteTaskRequest(_message.Message):
    __slots__ = ("task_id", "lease_id", "failed", "actual_duration_s", "peak_vram_mib", "oom_killed")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    ACTUAL_DURATION_S_FIELD_NUMBER: _ClassVar[int]
    PEAK_VRAM_MIB_FIELD_NUMBER: _ClassVar[int]
    OOM_KILLED_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    lease_id: str
    failed: bool
    actual_duration_s: float
    peak_vram_mib: float
    oom_killed: bool
    def __init__(self, task_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., failed: _Optional[bool] = ..., actual_duration_s: _Optional[float] = ..., peak_vram_mib: _Optional[float] = ..., oom_killed: _Optional[bool] = ...) -> None: ...

class CompleteTaskResponse(_message.Message):
    __slots__ = ("task",)
    TASK_FIELD_NUMBER: _ClassVar[int]
    task: Task
    def __init__(self, task: _Optional[_Union[Task, _Mapping]] = ...) -> None: ...

class CancelTaskRequest(_message.Message):
    __slots__ = ("task_id", "reason")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    reason: str
    def __init__(self, task_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class CancelTaskResponse(_message.Message):
    __slots__ = ("task",)
    TASK_FIELD_NUMBER: _ClassVar[int]
    task: Task
    def __init__(self, task: _Optional[_Union[Task, _Mapping]] = ...) -> None: ...

class RenewLeaseRequest(_message.Message):
    __slots__ = ("task_id", "lease_id", "extend_s")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    EXTEND_S_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    lease_id: str
    extend_s: float
    def __init__(self, task_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., extend_s: _Optional[float] = ...) -> None: ...

class RenewLeaseResponse(_message.Message):
    __slots__ = ("task",)
    TASK_FIELD_NUMBER: _ClassVar[int]
    task: Task
    def __init__(self, task: _Optional[_Union[Task, _Mapping]] = ...) -> None: ...

class MigrateTaskRequest(_message.Message):
    __slots__ = ("task_id", "lease_id", "to_gpu_uuid")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TO_GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    lease_id: str
    to_gpu_uuid: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, task_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., to_gpu_uuid: _Optional[_Iterable[str]] = ...) -> None: ...

class MigrateTaskResponse(_message.Message):
    __slots__ = ("task",)
    TASK_FIELD_NUMBER: _ClassVar[int]
    task: Task
    def __init__(self, task: _Optional[_Union[Task, _Mapping]] = ...) -> None: ...

class QueueClass(_message.Message):
    __slots__ = ("priority", "depth", "oldest_wait_s")
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    OLDEST_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    priority: Priority
    depth: int
    oldest_wait_s: float
    def __init__(self, priority: _Optional[_Union[Priority, str]] = ..., depth: _Optional[int] = ..., oldest_wait_s: _Optional[float] = ...) -> None: ...

class GetQueueRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetQueueResponse(_message.Message):
    __slots__ = ("classes", "head", "sla_misses", "placed")
    CLASSES_FIELD_NUMBER: _ClassVar[int]
    HEAD_FIELD_NUMBER: _ClassVar[int]
    SLA_MISSES_FIELD_NUMBER: _ClassVar[int]
    PLACED_FIELD_NUMBER: _ClassVar[int]
    classes: _containers.RepeatedCompositeFieldContainer[QueueClass]
    head: _containers.RepeatedCompositeFieldContainer[Task]
    sla_misses: int
    placed: int
    def __init__(self, classes: _Optional[_Iterable[_Union[QueueClass, _Mapping]]] = ..., head: _Optional[_Iterable[_Union[Task, _Mapping]]] = ..., sla_misses: _Optional[int] = ..., placed: _Optional[int] = ...) -> None: ...

class GetPolicyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Policy(_message.Message):
    __slots__ = ("name", "weights", "available")
    class WeightsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    name: str
    weights: _containers.ScalarMap[str, float]
    available: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., weights: _Optional[_Mapping[str, float]] = ..., available: _Optional[_Iterable[str]] = ...) -> None: ...

class SetPolicyRequest(_message.Message):
    __slots__ = ("name", "weights")
    class WeightsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    weights: _containers.ScalarMap[str, float]
    def __init__(self, name: _Optional[str] = ..., weights: _Optional[_Mapping[str, float]] = ...) -> None: ...
