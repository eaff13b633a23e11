"""The coordinator's global view: every node and, one numpy row per GPU, its
latest readings.

Rows are allocated when a node registers and kept across reconnects of the
same node with the same GPUs, so a scheduler's row numbers stay valid. Raw
values come straight from each node's telemetry decoder; smoothing and anomaly
filtering are layered on by ``coordinator.signals``. Everything here is owned
by the coordinator's event loop: no locks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from protos import telemetry_pb2 as pb
from protos.codec import TelemetryDecoder
from protos.fields import BY_NAME, FIELD_COUNT

__all__ = ["ClusterView", "NodeRecord", "RegistrationError", "validate_register", "MAX_GPUS_PER_NODE"]

MAX_GPUS_PER_NODE = 64
_NODE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_LABEL_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}$")


class RegistrationError(Exception):
    """A Register message that cannot be accepted (INVALID_ARGUMENT)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def validate_register(reg: pb.Register) -> None:
    """Raise RegistrationError naming the first field that is wrong."""
    if not _NODE_ID.match(reg.node_id):
        raise RegistrationError("register.node_id", f"{reg.node_id!r} must be 1-128 of [A-Za-z0-9._-], starting alphanumeric")
    if not 1 <= len(reg.gpus) <= MAX_GPUS_PER_NODE:
        raise RegistrationError("register.gpus", f"{len(reg.gpus)} GPUs; a node registers 1..{MAX_GPUS_PER_NODE}")
    seen: set[int] = set()
    for i, gpu in enumerate(reg.gpus):
        if gpu.index in seen:
            raise RegistrationError(f"register.gpus[{i}].index", f"GPU {gpu.index} registered twice")
        if gpu.index >= 1024:
            raise RegistrationError(f"register.gpus[{i}].index", f"{gpu.index} is not a plausible GPU index")
        seen.add(gpu.index)
        if not 0 < gpu.memory_total_mib <= 4 * 1024 * 1024:
            raise RegistrationError(f"register.gpus[{i}].memory_total_mib", f"{gpu.memory_total_mib} MiB is out of range")
        if len(gpu.uuid) > 128 or len(gpu.model) > 128:
            raise RegistrationError(f"register.gpus[{i}]", "uuid and model are at most 128 characters")
    for i, link in enumerate(reg.topology):
        if link.gpu_a not in seen or link.gpu_b not in seen or link.gpu_a == link.gpu_b:
            raise RegistrationError(f"register.topology[{i}]", f"link {link.gpu_a}-{link.gpu_b} names an unregistered GPU")
    if len(reg.labels) > 64:
        raise RegistrationError("register.labels", f"{len(reg.labels)} labels; at most 64")
    for key, value in reg.labels.items():
        if not _LABEL_KEY.match(key) or len(value) > 256:
            raise RegistrationError(f"register.labels[{key!r}]", "keys are 1-63 of [A-Za-z0-9._/-], values at most 256 characters")


@dataclass
class NodeRecord:
    node_id: str
    hostname: str
    backend: str
    labels: dict[str, str]
    gpus: list[pb.GpuInfo]
    topology: list[pb.TopologyLink]
    session_id: int
    rows: np.ndarray  # view rows of this node's GPUs, in registration order
    decoder: TelemetryDecoder
    connected_at_s: float
    last_seen_s: float
    last_heartbeat_ns: int = 0
    envelopes: int = 0
    resyncs: int = 0
    bytes_received: int = 0
    last_resync_request_s: float = float("-inf")
    disk_await_ms: float | None = None
    disk_util_pct: float | None = None
    processes: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    sample_interval_ms: int = 0

    @property
    def model(self) -> str:
        models = {g.model for g in self.gpus}
        return models.pop() if len(models) == 1 else "mixed"

    def nvlink_pairs(self) -> list[tuple[int, int]]:
        return [(l.gpu_a, l.gpu_b) for l in self.topology if l.kind == pb.LINK_KIND_NVLINK]


class ClusterView:
    """Nodes plus per-GPU columns. Columns grow by doubling; freed rows are reused."""

    def __init__(self, capacity: int = 64) -> None:
        self.nodes: dict[str, NodeRecord] = {}
        self._capacity = capacity
        self.raw = np.full((capacity, FIELD_COUNT), np.nan)
        self.reading_at_s = np.full(capacity, np.nan)  # coordinator monotonic time of last reading
        self.row_used = np.zeros(capacity, dtype=bool)
        self.row_node: list[str | None] = [None] * capacity
        self.row_gpu_index = np.full(capacity, -1, dtype=np.int32)
        self._free: list[int] = list(range(capacity - 1, -1, -1))
        self.version = 0  # bumps on every change, for watchers

    # ---- rows -------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self._capacity

    def _grow(self) -> None:
        old = self._capacity
        new = old * 2
        self.raw = np.vstack([self.raw, np.full((new - old, FIELD_COUNT), np.nan)])
        self.reading_at_s = np.concatenate([self.reading_at_s, np.full(new - old, np.nan)])
        self.row_used = np.concatenate([self.row_used, np.zeros(new - old, dtype=bool)])
        self.row_gpu_index = np.concatenate([self.row_gpu_index, np.full(new - old, -1, dtype=np.int32)])
        self.row_node.extend([None] * (new - old))
        self._free.extend(range(new - 1, old - 1, -1))
        self._capacity = new

    def _allocate(self, count: int) -> np.ndarray:
        while len(self._free) < count:
            self._grow()
        rows = np.asarray([self._free.pop() for _ in range(count)], dtype=np.intp)
        return rows

    def _release(self, rows: Iterable[int]) -> None:
        for row in rows:
            self.row_used[row] = False
            self.row_node[row] = None
            self.row_gpu_index[row] = -1
            self.raw[row] = np.nan
            self.reading_at_s[row] = np.nan
            self._free.append(int(row))

    # ---- nodes ------------------------------------------------------------
    def register(self, reg: pb.Register, now_s: float) -> NodeRecord:
        """Add or refresh a node. Rows are kept when the GPU set is unchanged."""
        indices = [g.index for g in reg.gpus]
        existing = self.nodes.get(reg.node_id)
        if existing is not None and [g.index for g in existing.gpus] == indices:
            rows = existing.rows
            # Old readings are not fresh for the new stream: unknown until the keyframe.
            self.raw[rows] = np.nan
            self.reading_at_s[rows] = np.nan
        else:
            if existing is not None:
                self._release(existing.rows)
            rows = self._allocate(len(indices))
        for row, index in zip(rows, indices):
            self.row_used[row] = True
            self.row_node[row] = reg.node_id
            self.row_gpu_index[row] = index
        record = NodeRecord(
            node_id=reg.node_id,
            hostname=reg.hostname,
            backend=reg.backend,
            labels=dict(reg.labels),
            gpus=list(reg.gpus),
            topology=list(reg.topology),
            session_id=reg.session_id,
            rows=rows,
            decoder=TelemetryDecoder(indices),
            connected_at_s=now_s,
            last_seen_s=now_s,
        )
        self.nodes[reg.node_id] = record
        self.version += 1
        return record

    def remove(self, node_id: str) -> NodeRecord | None:
        record = self.nodes.pop(node_id, None)
        if record is not None:
            self._release(record.rows)
            self.version += 1
        return record

    def apply(self, node: NodeRecord, rows: np.ndarray, now_s: float) -> np.ndarray:
        """Copy the decoder's values for ``rows`` (decoder order) into the view.
        Returns the view rows that changed."""
        view_rows = node.rows[rows]
        if rows.size:
            self.raw[view_rows] = node.decoder.values[rows]
            self.reading_at_s[view_rows] = now_s
            self.version += 1
        return view_rows

    def mark_all_read(self, node: NodeRecord, now_s: float) -> None:
        """A keyframe refreshes every GPU of the node, including ones with no values."""
        self.raw[node.rows] = node.decoder.values
        self.reading_at_s[node.rows] = now_s
        self.version += 1

    # ---- queries ----------------------------------------------------------
    def node_reading_age_s(self, node: NodeRecord, now_s: float) -> float:
        times = self.reading_at_s[node.rows]
        if np.isnan(times).all():
            return float("inf")
        return float(now_s - np.nanmax(times))

    def column(self, name: str) -> np.ndarray:
        return self.raw[:, BY_NAME[name]]
