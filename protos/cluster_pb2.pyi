from protos import telemetry_pb2 as _telemetry_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NodeState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NODE_STATE_UNSPECIFIED: _ClassVar[NodeState]
    NODE_STATE_CONNECTING: _ClassVar[NodeState]
    NODE_STATE_HEALTHY: _ClassVar[NodeState]
    NODE_STATE_UNREACHABLE: _ClassVar[NodeState]
    NODE_STATE_REMOVED: _ClassVar[NodeState]
    NODE_STATE_CORDONED: _ClassVar[NodeState]
    NODE_STATE_DRAINING: _ClassVar[NodeState]

class ValueView(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VALUE_VIEW_UNSPECIFIED: _ClassVar[ValueView]
    VALUE_VIEW_RAW: _ClassVar[ValueView]
    VALUE_VIEW_SMOOTHED: _ClassVar[ValueView]
NODE_STATE_UNSPECIFIED: NodeState
NODE_STATE_CONNECTING: NodeState
NODE_STATE_HEALTHY: NodeState
NODE_STATE_UNREACHABLE: NodeState
NODE_STATE_REMOVED: NodeState
NODE_STATE_CORDONED: NodeState
NODE_STATE_DRAINING: NodeState
VALUE_VIEW_UNSPECIFIED: ValueView
VALUE_VIEW_RAW: ValueView
VALUE_VIEW_SMOOTHED: ValueView

class Node(_message.Message):
    __slots__ = ("node_id", "state", "hostname", "backend", "labels", "gpu_count", "model", "last_heartbeat_ns", "reading_age_s", "stale", "envelopes", "resyncs", "disk_await_ms", "disk_util_pct", "topology", "active_tasks", "sample_interval_ms", "agent_version", "driver_version")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    GPU_COUNT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_NS_FIELD_NUMBER: _ClassVar[int]
    READING_AGE_S_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    ENVELOPES_FIELD_NUMBER: _ClassVar[int]
    RESYNCS_FIELD_NUMBER: _ClassVar[int]
    DISK_AWAIT_MS_FIELD_NUMBER: _ClassVar[int]
    DISK_UTIL_PCT_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_TASKS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    DRIVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    state: NodeState
    hostname: str
    backend: str
    labels: _containers.ScalarMap[str, str]
    gpu_count: int
    model: str
    last_heartbeat_ns: int
    reading_age_s: float
    stale: bool
    envelopes: int
    resyncs: int
    disk_await_ms: float
    disk_util_pct: float
    topology: _containers.RepeatedCompositeFieldContainer[_telemetry_pb2.TopologyLink]
    active_tasks: int
    sample_interval_ms: int
    agent_version: str
    driver_version: str
    def __init__(self, node_id: _Optional[str] = ..., state: _Optional[_Union[NodeState, str]] = ..., hostname: _Optional[str] = ..., backend: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., gpu_count: _Optional[int] = ..., model: _Optional[str] = ..., last_heartbeat_ns: _Optional[int] = ..., reading_age_s: _Optional[float] = ..., stale: _Optional[bool] = ..., envelopes: _Optional[int] = ..., resyncs: _Optional[int] = ..., disk_await_ms: _Optional[float] = ..., disk_util_pct: _Optional[float] = ..., topology: _Optional[_Iterable[_Union[_telemetry_pb2.TopologyLink, _Mapping]]] = ..., active_tasks: _Optional[int] = ..., sample_interval_ms: _Optional[int] = ..., agent_version: _Optional[str] = ..., driver_version: _Optional[str] = ...) -> None: ...

class Gpu(_message.Message):
    __slots__ = ("node_id", "index", "uuid", "model", "node_state", "health", "util_gpu_pct", "util_memory_pct", "memory_used_mib", "memory_total_mib", "temperature_c", "power_w", "power_limit_w", "sm_clock_mhz", "pcie_rx_mbps", "pcie_tx_mbps", "ecc_corrected", "ecc_uncorrected", "xid_last", "process_count", "reading_age_s", "stale", "smoothed", "util_forecast_pct", "util_trend_pct_per_min", "flags", "reserved_vram_mib", "active_tasks", "processes")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NODE_STATE_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    UTIL_GPU_PCT_FIELD_NUMBER: _ClassVar[int]
    UTIL_MEMORY_PCT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_MIB_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_MIB_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_C_FIELD_NUMBER: _ClassVar[int]
    POWER_W_FIELD_NUMBER: _ClassVar[int]
    POWER_LIMIT_W_FIELD_NUMBER: _ClassVar[int]
    SM_CLOCK_MHZ_FIELD_NUMBER: _ClassVar[int]
    PCIE_RX_MBPS_FIELD_NUMBER: _ClassVar[int]
    PCIE_TX_MBPS_FIELD_NUMBER: _ClassVar[int]
    ECC_CORRECTED_FIELD_NUMBER: _ClassVar[int]
    ECC_UNCORRECTED_FIELD_NUMBER: _ClassVar[int]
    XID_LAST_FIELD_NUMBER: _ClassVar[int]
    PROCESS_COUNT_FIELD_NUMBER: _ClassVar[int]
    READING_AGE_S_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    SMOOTHED_FIELD_NUMBER: _ClassVar[int]
    UTIL_FORECAST_PCT_FIELD_NUMBER: _ClassVar[int]
    UTIL_TREND_PCT_PER_MIN_FIELD_NUMBER: _ClassVar[int]
    FLAGS_FIELD_NUMBER: _ClassVar[int]
    RESERVED_VRAM_MIB_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_TASKS_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    index: int
    uuid: str
    model: str
    node_state: NodeState
    health: _telemetry_pb2.GpuHealth
    util_gpu_pct: float
    util_memory_pct: float
    memory_used_mib: float
    memory_total_mib: float
    temperature_c: float
    power_w: float
    power_limit_w: float
    sm_clock_mhz: float
    pcie_rx_mbps: float
    pcie_tx_mbps: float
    ecc_corrected: float
    ecc_uncorrected: float
    xid_last: float
    process_count: float
    reading_age_s: float
    stale: bool
    smoothed: bool
    util_forecast_pct: float
    util_trend_pct_per_min: float
    flags: _containers.RepeatedScalarFieldContainer[str]
    reserved_vram_mib: int
    active_tasks: int
    processes: _containers.RepeatedCompositeFieldContainer[_telemetry_pb2.GpuProcess]
    def __init__(self, node_id: _Optional[str] = ..., index: _Optional[int] = ..., uuid: _Optional[str] = ..., model: _Optional[str] = ..., node_state: _Optional[_Union[NodeState, str]] = ..., health: _Optional[_Union[_telemetry_pb2.GpuHealth, str]] = ..., util_gpu_pct: _Optional[float] = ..., util_memory_pct: _Optional[float] = ..., memory_used_mib: _Optional[float] = ..., memory_total_mib: _Optional[float] = ..., temperature_c: _Optional[float] = ..., power_w: _Optional[float] = ..., power_limit_w: _Optional[float] = ..., sm_clock_mhz: _Optional[float] = ..., pcie_rx_mbps: _Optional[float] = ..., pcie_tx_mbps: _Optional[float] = ..., ecc_corrected: _Optional[float] = ..., ecc_uncorrected: _Optional[float] = ..., xid_last: _Optional[float] = ..., process_count: _Optional[float] = ..., reading_age_s: _Optional[float] = ..., stale: _Optional[bool] = ..., smoothed: _Optional[bool] = ..., util_forecast_pct: _Optional[float] = ..., util_trend_pct_per_min: _Optional[float] = ..., flags: _Optional[_Iterable[str]] = ..., reserved_vram_mib: _Optional[int] = ..., active_tasks: _Optional[int] = ..., processes: _Optional[_Iterable[_Union[_telemetry_pb2.GpuProcess, _Mapping]]] = ...) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: NodeState
    def __init__(self, state: _Optional[_Union[NodeState, str]] = ...) -> None: ...

class ListNodesResponse(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[Node]
    def __init__(self, nodes: _Optional[_Iterable[_Union[Node, _Mapping]]] = ...) -> None: ...

class GetNodeRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class ListGpusRequest(_message.Message):
    __slots__ = ("node_id", "model", "node_state", "values", "metrics")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NODE_STATE_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    model: str
    node_state: NodeState
    values: ValueView
    metrics: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, node_id: _Optional[str] = ..., model: _Optional[str] = ..., node_state: _Optional[_Union[NodeState, str]] = ..., values: _Optional[_Union[ValueView, str]] = ..., metrics: _Optional[_Iterable[str]] = ...) -> None: ...

class ListGpusResponse(_message.Message):
    __slots__ = ("gpus",)
    GPUS_FIELD_NUMBER: _ClassVar[int]
    gpus: _containers.RepeatedCompositeFieldContainer[Gpu]
    def __init__(self, gpus: _Optional[_Iterable[_Union[Gpu, _Mapping]]] = ...) -> None: ...

class WatchViewRequest(_message.Message):
    __slots__ = ("node_id", "min_interval_ms", "values")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    MIN_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    min_interval_ms: int
    values: ValueView
    def __init__(self, node_id: _Optional[str] = ..., min_interval_ms: _Optional[int] = ..., values: _Optional[_Union[ValueView, str]] = ...) -> None: ...

class ViewUpdate(_message.Message):
    __slots__ = ("at_ns", "nodes", "gpus")
    AT_NS_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    at_ns: int
    nodes: _containers.RepeatedCompositeFieldContainer[Node]
    gpus: _containers.RepeatedCompositeFieldContainer[Gpu]
    def __init__(self, at_ns: _Optional[int] = ..., nodes: _Optional[_Iterable[_Union[Node, _Mapping]]] = ..., gpus: _Optional[_Iterable[_Union[Gpu, _Mapping]]] = ...) -> None: ...

class NodeActionRequest(_message.Message):
    __slots__ = ("node_id", "reason")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    reason: str
    def __init__(self, node_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class NodeActionResponse(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: Node
    def __init__(self, node: _Optional[_Union[Node, _Mapping]] = ...) -> None: ...
