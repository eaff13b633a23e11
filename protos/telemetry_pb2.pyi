from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Field(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FIELD_UNSPECIFIED: _ClassVar[Field]
    FIELD_UTIL_GPU_PCT: _ClassVar[Field]
    FIELD_UTIL_MEMORY_PCT: _ClassVar[Field]
    FIELD_MEMORY_USED_MIB: _ClassVar[Field]
    FIELD_MEMORY_TOTAL_MIB: _ClassVar[Field]
    FIELD_TEMPERATURE_C: _ClassVar[Field]
    FIELD_POWER_W: _ClassVar[Field]
    FIELD_POWER_LIMIT_W: _ClassVar[Field]
    FIELD_SM_CLOCK_MHZ: _ClassVar[Field]
    FIELD_PCIE_RX_MBPS: _ClassVar[Field]
    FIELD_PCIE_TX_MBPS: _ClassVar[Field]
    FIELD_ECC_CORRECTED: _ClassVar[Field]
    FIELD_ECC_UNCORRECTED: _ClassVar[Field]
    FIELD_XID_LAST: _ClassVar[Field]
    FIELD_HEALTH: _ClassVar[Field]
    FIELD_PROCESS_COUNT: _ClassVar[Field]

class GpuHealth(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GPU_HEALTH_UNSPECIFIED: _ClassVar[GpuHealth]
    GPU_HEALTH_OK: _ClassVar[GpuHealth]
    GPU_HEALTH_READ_FAILED: _ClassVar[GpuHealth]
    GPU_HEALTH_FROZEN: _ClassVar[GpuHealth]
    GPU_HEALTH_LOST: _ClassVar[GpuHealth]

class LinkKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LINK_KIND_UNSPECIFIED: _ClassVar[LinkKind]
    LINK_KIND_NVLINK: _ClassVar[LinkKind]
    LINK_KIND_PCIE_SWITCH: _ClassVar[LinkKind]
    LINK_KIND_PCIE_HOST: _ClassVar[LinkKind]
    LINK_KIND_NUMA: _ClassVar[LinkKind]
    LINK_KIND_SYSTEM: _ClassVar[LinkKind]

class Compression(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMPRESSION_NONE: _ClassVar[Compression]
    COMPRESSION_SNAPPY: _ClassVar[Compression]

class TaskEventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TASK_EVENT_KIND_UNSPECIFIED: _ClassVar[TaskEventKind]
    TASK_EVENT_KIND_STARTED: _ClassVar[TaskEventKind]
    TASK_EVENT_KIND_FINISHED: _ClassVar[TaskEventKind]
    TASK_EVENT_KIND_FAILED: _ClassVar[TaskEventKind]
    TASK_EVENT_KIND_OOM_KILLED: _ClassVar[TaskEventKind]
FIELD_UNSPECIFIED: Field
FIELD_UTIL_GPU_PCT: Field
FIELD_UTIL_MEMORY_PCT: Field
FIELD_MEMORY_USED_MIB: Field
FIELD_MEMORY_TOTAL_MIB: Field
FIELD_TEMPERATURE_C: Field
FIELD_POWER_W: Field
FIELD_POWER_LIMIT_W: Field
FIELD_SM_CLOCK_MHZ: Field
FIELD_PCIE_RX_MBPS: Field
FIELD_PCIE_TX_MBPS: Field
FIELD_ECC_CORRECTED: Field
FIELD_ECC_UNCORRECTED: Field
FIELD_XID_LAST: Field
FIELD_HEALTH: Field
FIELD_PROCESS_COUNT: Field
GPU_HEALTH_UNSPECIFIED: GpuHealth
GPU_HEALTH_OK: GpuHealth
GPU_HEALTH_READ_FAILED: GpuHealth
GPU_HEALTH_FROZEN: GpuHealth
GPU_HEALTH_LOST: GpuHealth
LINK_KIND_UNSPECIFIED: LinkKind
LINK_KIND_NVLINK: LinkKind
LINK_KIND_PCIE_SWITCH: LinkKind
LINK_KIND_PCIE_HOST: LinkKind
LINK_KIND_NUMA: LinkKind
LINK_KIND_SYSTEM: LinkKind
COMPRESSION_NONE: Compression
COMPRESSION_SNAPPY: Compression
TASK_EVENT_KIND_UNSPECIFIED: TaskEventKind
TASK_EVENT_KIND_STARTED: TaskEventKind
TASK_EVENT_KIND_FINISHED: TaskEventKind
TASK_EVENT_KIND_FAILED: TaskEventKind
TASK_EVENT_KIND_OOM_KILLED: TaskEventKind

class GpuInfo(_message.Message):
    __slots__ = ("index", "uuid", "model", "memory_total_mib", "power_limit_mw", "pci_bus_id", "supported_fields")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_MIB_FIELD_NUMBER: _ClassVar[int]
    POWER_LIMIT_MW_FIELD_NUMBER: _ClassVar[int]
    PCI_BUS_ID_FIELD_NUMBER: _ClassVar[int]
    SUPPORTED_FIELDS_FIELD_NUMBER: _ClassVar[int]
    index: int
    uuid: str
    model: str
    memory_total_mib: int
    power_limit_mw: int
    pci_bus_id: str
    supported_fields: _containers.RepeatedScalarFieldContainer[Field]
    def __init__(self, index: _Optional[int] = ..., uuid: _Optional[str] = ..., model: _Optional[str] = ..., memory_total_mib: _Optional[int] = ..., power_limit_mw: _Optional[int] = ..., pci_bus_id: _Optional[str] = ..., supported_fields: _Optional[_Iterable[_Union[Field, str]]] = ...) -> None: ...

class TopologyLink(_message.Message):
    __slots__ = ("gpu_a", "gpu_b", "kind", "nvlink_count")
    GPU_A_FIELD_NUMBER: _ClassVar[int]
    GPU_B_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NVLINK_COUNT_FIELD_NUMBER: _ClassVar[int]
    gpu_a: int
    gpu_b: int
    kind: LinkKind
    nvlink_count: int
    def __init__(self, gpu_a: _Optional[int] = ..., gpu_b: _Optional[int] = ..., kind: _Optional[_Union[LinkKind, str]] = ..., nvlink_count: _Optional[int] = ...) -> None: ...

class Register(_message.Message):
    __slots__ = ("node_id", "hostname", "agent_version", "backend", "labels", "gpus", "topology", "session_id", "sample_interval_min_ms", "sample_interval_max_ms", "driver_version", "running_task_ids")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INTERVAL_MIN_MS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INTERVAL_MAX_MS_FIELD_NUMBER: _ClassVar[int]
    DRIVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUNNING_TASK_IDS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    hostname: str
    agent_version: str
    backend: str
    labels: _containers.ScalarMap[str, str]
    gpus: _containers.RepeatedCompositeFieldContainer[GpuInfo]
    topology: _containers.RepeatedCompositeFieldContainer[TopologyLink]
    session_id: int
    sample_interval_min_ms: int
    sample_interval_max_ms: int
    driver_version: str
    running_task_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, node_id: _Optional[str] = ..., hostname: _Optional[str] = ..., agent_version: _Optional[str] = ..., backend: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., gpus: _Optional[_Iterable[_Union[GpuInfo, _Mapping]]] = ..., topology: _Optional[_Iterable[_Union[TopologyLink, _Mapping]]] = ..., session_id: _Optional[int] = ..., sample_interval_min_ms: _Optional[int] = ..., sample_interval_max_ms: _Optional[int] = ..., driver_version: _Optional[str] = ..., running_task_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class FieldColumn(_message.Message):
    __slots__ = ("field", "presence", "values")
    FIELD_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    field: Field
    presence: bytes
    values: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, field: _Optional[_Union[Field, str]] = ..., presence: _Optional[bytes] = ..., values: _Optional[_Iterable[int]] = ...) -> None: ...

class HostIo(_message.Message):
    __slots__ = ("disk_await_us", "disk_util_permille")
    DISK_AWAIT_US_FIELD_NUMBER: _ClassVar[int]
    DISK_UTIL_PERMILLE_FIELD_NUMBER: _ClassVar[int]
    disk_await_us: int
    disk_util_permille: int
    def __init__(self, disk_await_us: _Optional[int] = ..., disk_util_permille: _Optional[int] = ...) -> None: ...

class GpuProcess(_message.Message):
    __slots__ = ("pid", "used_memory_mib")
    PID_FIELD_NUMBER: _ClassVar[int]
    USED_MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    pid: int
    used_memory_mib: int
    def __init__(self, pid: _Optional[int] = ..., used_memory_mib: _Optional[int] = ...) -> None: ...

class GpuProcesses(_message.Message):
    __slots__ = ("gpu_index", "processes")
    GPU_INDEX_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    gpu_index: int
    processes: _containers.RepeatedCompositeFieldContainer[GpuProcess]
    def __init__(self, gpu_index: _Optional[int] = ..., processes: _Optional[_Iterable[_Union[GpuProcess, _Mapping]]] = ...) -> None: ...

class MetricBatch(_message.Message):
    __slots__ = ("sampled_at_ns", "keyframe", "gpu_index", "columns", "host_io", "processes", "sample_interval_ms")
    SAMPLED_AT_NS_FIELD_NUMBER: _ClassVar[int]
    KEYFRAME_FIELD_NUMBER: _ClassVar[int]
    GPU_INDEX_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    HOST_IO_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    sampled_at_ns: int
    keyframe: bool
    gpu_index: _containers.RepeatedScalarFieldContainer[int]
    columns: _containers.RepeatedCompositeFieldContainer[FieldColumn]
    host_io: HostIo
    processes: _containers.RepeatedCompositeFieldContainer[GpuProcesses]
    sample_interval_ms: int
    def __init__(self, sampled_at_ns: _Optional[int] = ..., keyframe: _Optional[bool] = ..., gpu_index: _Optional[_Iterable[int]] = ..., columns: _Optional[_Iterable[_Union[FieldColumn, _Mapping]]] = ..., host_io: _Optional[_Union[HostIo, _Mapping]] = ..., processes: _Optional[_Iterable[_Union[GpuProcesses, _Mapping]]] = ..., sample_interval_ms: _Optional[int] = ...) -> None: ...

class Envelope(_message.Message):
    __slots__ = ("seq", "compression", "raw_size", "payload")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    RAW_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    seq: int
    compression: Compression
    raw_size: int
    payload: bytes
    def __init__(self, seq: _Optional[int] = ..., compression: _Optional[_Union[Compression, str]] = ..., raw_size: _Optional[int] = ..., payload: _Optional[bytes] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("sent_at_ns", "last_seq")
    SENT_AT_NS_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    sent_at_ns: int
    last_seq: int
    def __init__(self, sent_at_ns: _Optional[int] = ..., last_seq: _Optional[int] = ...) -> None: ...

class TaskEvent(_message.Message):
    __slots__ = ("task_id", "kind", "at_ns", "detail", "peak_vram_mib")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    AT_NS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    PEAK_VRAM_MIB_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    kind: TaskEventKind
    at_ns: int
    detail: str
    peak_vram_mib: float
    def __init__(self, task_id: _Optional[str] = ..., kind: _Optional[_Union[TaskEventKind, str]] = ..., at_ns: _Optional[int] = ..., detail: _Optional[str] = ..., peak_vram_mib: _Optional[float] = ...) -> None: ...

class AgentMessage(_message.Message):
    __slots__ = ("register", "telemetry", "heartbeat", "task_event")
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    TELEMETRY_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    TASK_EVENT_FIELD_NUMBER: _ClassVar[int]
    register: Register
    telemetry: Envelope
    heartbeat: Heartbeat
    task_event: TaskEvent
    def __init__(self, register: _Optional[_Union[Register, _Mapping]] = ..., telemetry: _Optional[_Union[Envelope, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., task_event: _Optional[_Union[TaskEvent, _Mapping]] = ...) -> None: ...

class RegisterAck(_message.Message):
    __slots__ = ("heartbeat_interval_ms", "keyframe_interval_ms", "refresh_interval_ms")
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    KEYFRAME_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    REFRESH_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_ms: int
    keyframe_interval_ms: int
    refresh_interval_ms: int
    def __init__(self, heartbeat_interval_ms: _Optional[int] = ..., keyframe_interval_ms: _Optional[int] = ..., refresh_interval_ms: _Optional[int] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("seq",)
    SEQ_FIELD_NUMBER: _ClassVar[int]
    seq: int
    def __init__(self, seq: _Optional[int] = ...) -> None: ...

class ResyncRequest(_message.Message):
    __slots__ = ("expected_seq", "reason")
    EXPECTED_SEQ_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    expected_seq: int
    reason: str
    def __init__(self, expected_seq: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class SamplingHint(_message.Message):
    __slots__ = ("interval_ms", "duration_ms")
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    interval_ms: int
    duration_ms: int
    def __init__(self, interval_ms: _Optional[int] = ..., duration_ms: _Optional[int] = ...) -> None: ...

class TaskPlacement(_message.Message):
    __slots__ = ("task_id", "gpu_index", "vram_mib", "gpu_share", "duration_s", "kind")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    GPU_INDEX_FIELD_NUMBER: _ClassVar[int]
    VRAM_MIB_FIELD_NUMBER: _ClassVar[int]
    GPU_SHARE_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    gpu_index: _containers.RepeatedScalarFieldContainer[int]
    vram_mib: int
    gpu_share: float
    duration_s: float
    kind: str
    def __init__(self, task_id: _Optional[str] = ..., gpu_index: _Optional[_Iterable[int]] = ..., vram_mib: _Optional[int] = ..., gpu_share: _Optional[float] = ..., duration_s: _Optional[float] = ..., kind: _Optional[str] = ...) -> None: ...

class TaskRelease(_message.Message):
    __slots__ = ("task_id", "reason")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    reason: str
    def __init__(self, task_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class CoordinatorMessage(_message.Message):
    __slots__ = ("register_ack", "ack", "resync", "sampling_hint", "place", "release")
    REGISTER_ACK_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_HINT_FIELD_NUMBER: _ClassVar[int]
    PLACE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    register_ack: RegisterAck
    ack: Ack
    resync: ResyncRequest
    sampling_hint: SamplingHint
    place: TaskPlacement
    release: TaskRelease
    def __init__(self, register_ack: _Optional[_Union[RegisterAck, _Mapping]] = ..., ack: _Optional[_Union[Ack, _Mapping]] = ..., resync: _Optional[_Union[ResyncRequest, _Mapping]] = ..., sampling_hint: _Optional[_Union[SamplingHint, _Mapping]] = ..., place: _Optional[_Union[TaskPlacement, _Mapping]] = ..., release: _Optional[_Union[TaskRelease, _Mapping]] = ...) -> None: ...
