from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetPredictionsRequest(_message.Message):
    __slots__ = ("model", "kind", "node_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    kind: str
    node_id: str
    def __init__(self, model: _Optional[str] = ..., kind: _Optional[str] = ..., node_id: _Optional[str] = ...) -> None: ...

class SpeedFactor(_message.Message):
    __slots__ = ("model", "kind", "slowdown", "prior", "samples", "mape_ratio", "overrun_ratio")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SLOWDOWN_FIELD_NUMBER: _ClassVar[int]
    PRIOR_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    MAPE_RATIO_FIELD_NUMBER: _ClassVar[int]
    OVERRUN_RATIO_FIELD_NUMBER: _ClassVar[int]
    model: str
    kind: str
    slowdown: float
    prior: float
    samples: int
    mape_ratio: float
    overrun_ratio: float
    def __init__(self, model: _Optional[str] = ..., kind: _Optional[str] = ..., slowdown: _Optional[float] = ..., prior: _Optional[float] = ..., samples: _Optional[int] = ..., mape_ratio: _Optional[float] = ..., overrun_ratio: _Optional[float] = ...) -> None: ...

class NodeFactor(_message.Message):
    __slots__ = ("node_id", "residual", "samples", "mape_ratio")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    RESIDUAL_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    MAPE_RATIO_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    residual: float
    samples: int
    mape_ratio: float
    def __init__(self, node_id: _Optional[str] = ..., residual: _Optional[float] = ..., samples: _Optional[int] = ..., mape_ratio: _Optional[float] = ...) -> None: ...

class GetPredictionsResponse(_message.Message):
    __slots__ = ("models", "nodes", "mape_ratio", "samples", "error_window", "memory_growth")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    MAPE_RATIO_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    ERROR_WINDOW_FIELD_NUMBER: _ClassVar[int]
    MEMORY_GROWTH_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[SpeedFactor]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeFactor]
    mape_ratio: float
    samples: int
    error_window: int
    memory_growth: _containers.RepeatedCompositeFieldContainer[MemoryGrowth]
    def __init__(self, models: _Optional[_Iterable[_Union[SpeedFactor, _Mapping]]] = ..., nodes: _Optional[_Iterable[_Union[NodeFactor, _Mapping]]] = ..., mape_ratio: _Optional[float] = ..., samples: _Optional[int] = ..., error_window: _Optional[int] = ..., memory_growth: _Optional[_Iterable[_Union[MemoryGrowth, _Mapping]]] = ...) -> None: ...

class MemoryGrowth(_message.Message):
    __slots__ = ("kind", "samples", "oom_kills", "p50", "p95", "p99", "max")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    OOM_KILLS_FIELD_NUMBER: _ClassVar[int]
    P50_FIELD_NUMBER: _ClassVar[int]
    P95_FIELD_NUMBER: _ClassVar[int]
    P99_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    kind: str
    samples: int
    oom_kills: int
    p50: float
    p95: float
    p99: float
    max: float
    def __init__(self, kind: _Optional[str] = ..., samples: _Optional[int] = ..., oom_kills: _Optional[int] = ..., p50: _Optional[float] = ..., p95: _Optional[float] = ..., p99: _Optional[float] = ..., max: _Optional[float] = ...) -> None: ...

class Migration(_message.Message):
    __slots__ = ("task_id", "lease_id", "kind", "from_node_id", "from_gpu_index", "from_gpu_uuid", "to_node_id", "to_gpu_index", "to_gpu_uuid", "load_pct", "from_util_pct", "to_util_pct", "variance_after", "from_gpu_indexes", "from_gpu_uuids", "to_gpu_indexes", "to_gpu_uuids")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    FROM_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_GPU_INDEX_FIELD_NUMBER: _ClassVar[int]
    FROM_GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    TO_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    TO_GPU_INDEX_FIELD_NUMBER: _ClassVar[int]
    TO_GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    LOAD_PCT_FIELD_NUMBER: _ClassVar[int]
    FROM_UTIL_PCT_FIELD_NUMBER: _ClassVar[int]
    TO_UTIL_PCT_FIELD_NUMBER: _ClassVar[int]
    VARIANCE_AFTER_FIELD_NUMBER: _ClassVar[int]
    FROM_GPU_INDEXES_FIELD_NUMBER: _ClassVar[int]
    FROM_GPU_UUIDS_FIELD_NUMBER: _ClassVar[int]
    TO_GPU_INDEXES_FIELD_NUMBER: _ClassVar[int]
    TO_GPU_UUIDS_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    lease_id: str
    kind: str
    from_node_id: str
    from_gpu_index: int
    from_gpu_uuid: str
    to_node_id: str
    to_gpu_index: int
    to_gpu_uuid: str
    load_pct: float
    from_util_pct: float
    to_util_pct: float
    variance_after: float
    from_gpu_indexes: _containers.RepeatedScalarFieldContainer[int]
    from_gpu_uuids: _containers.RepeatedScalarFieldContainer[str]
    to_gpu_indexes: _containers.RepeatedScalarFieldContainer[int]
    to_gpu_uuids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, task_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., kind: _Optional[str] = ..., from_node_id: _Optional[str] = ..., from_gpu_index: _Optional[int] = ..., from_gpu_uuid: _Optional[str] = ..., to_node_id: _Optional[str] = ..., to_gpu_index: _Optional[int] = ..., to_gpu_uuid: _Optional[str] = ..., load_pct: _Optional[float] = ..., from_util_pct: _Optional[float] = ..., to_util_pct: _Optional[float] = ..., variance_after: _Optional[float] = ..., from_gpu_indexes: _Optional[_Iterable[int]] = ..., from_gpu_uuids: _Optional[_Iterable[str]] = ..., to_gpu_indexes: _Optional[_Iterable[int]] = ..., to_gpu_uuids: _Optional[_Iterable[str]] = ...) -> None: ...

class RebalancePlan(_message.Message):
    __slots__ = ("plan_id", "created_at_ns", "trigger", "variance_before", "variance_after", "spread_before", "spread_after", "moves", "dry_run")
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_NS_FIELD_NUMBER: _ClassVar[int]
    TRIGGER_FIELD_NUMBER: _ClassVar[int]
    VARIANCE_BEFORE_FIELD_NUMBER: _ClassVar[int]
    VARIANCE_AFTER_FIELD_NUMBER: _ClassVar[int]
    SPREAD_BEFORE_FIELD_NUMBER: _ClassVar[int]
    SPREAD_AFTER_FIELD_NUMBER: _ClassVar[int]
    MOVES_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    plan_id: int
    created_at_ns: int
    trigger: str
    variance_before: float
    variance_after: float
    spread_before: float
    spread_after: float
    moves: _containers.RepeatedCompositeFieldContainer[Migration]
    dry_run: bool
    def __init__(self, plan_id: _Optional[int] = ..., created_at_ns: _Optional[int] = ..., trigger: _Optional[str] = ..., variance_before: _Optional[float] = ..., variance_after: _Optional[float] = ..., spread_before: _Optional[float] = ..., spread_after: _Optional[float] = ..., moves: _Optional[_Iterable[_Union[Migration, _Mapping]]] = ..., dry_run: _Optional[bool] = ...) -> None: ...

class GetPlanRequest(_message.Message):
    __slots__ = ("evaluate_now",)
    EVALUATE_NOW_FIELD_NUMBER: _ClassVar[int]
    evaluate_now: bool
    def __init__(self, evaluate_now: _Optional[bool] = ...) -> None: ...

class TriggerState(_message.Message):
    __slots__ = ("fired", "reason", "variance", "hottest_pct", "rising", "gpus", "variance_threshold", "hot_pct", "rising_pct_per_min", "rising_gpus", "release_variance", "held")
    FIRED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    VARIANCE_FIELD_NUMBER: _ClassVar[int]
    HOTTEST_PCT_FIELD_NUMBER: _ClassVar[int]
    RISING_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    VARIANCE_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    HOT_PCT_FIELD_NUMBER: _ClassVar[int]
    RISING_PCT_PER_MIN_FIELD_NUMBER: _ClassVar[int]
    RISING_GPUS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_VARIANCE_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    fired: bool
    reason: str
    variance: float
    hottest_pct: float
    rising: int
    gpus: int
    variance_threshold: float
    hot_pct: float
    rising_pct_per_min: float
    rising_gpus: int
    release_variance: float
    held: bool
    def __init__(self, fired: _Optional[bool] = ..., reason: _Optional[str] = ..., variance: _Optional[float] = ..., hottest_pct: _Optional[float] = ..., rising: _Optional[int] = ..., gpus: _Optional[int] = ..., variance_threshold: _Optional[float] = ..., hot_pct: _Optional[float] = ..., rising_pct_per_min: _Optional[float] = ..., rising_gpus: _Optional[int] = ..., release_variance: _Optional[float] = ..., held: _Optional[bool] = ...) -> None: ...

class GetPlanResponse(_message.Message):
    __slots__ = ("plan", "trigger", "evaluated_at_ns", "no_move")
    class NoMoveEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    PLAN_FIELD_NUMBER: _ClassVar[int]
    TRIGGER_FIELD_NUMBER: _ClassVar[int]
    EVALUATED_AT_NS_FIELD_NUMBER: _ClassVar[int]
    NO_MOVE_FIELD_NUMBER: _ClassVar[int]
    plan: RebalancePlan
    trigger: TriggerState
    evaluated_at_ns: int
    no_move: _containers.ScalarMap[str, int]
    def __init__(self, plan: _Optional[_Union[RebalancePlan, _Mapping]] = ..., trigger: _Optional[_Union[TriggerState, _Mapping]] = ..., evaluated_at_ns: _Optional[int] = ..., no_move: _Optional[_Mapping[str, int]] = ...) -> None: ...

class WatchPlansRequest(_message.Message):
    __slots__ = ("include_latest",)
    INCLUDE_LATEST_FIELD_NUMBER: _ClassVar[int]
    include_latest: bool
    def __init__(self, include_latest: _Optional[bool] = ...) -> None: ...
