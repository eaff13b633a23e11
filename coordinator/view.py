"""The coordinator's global view: every node and, one numpy row per GPU, its
latest readings.

Rows are allocated when a node registers and kept across reconnects of the
same node with the same GPUs, so a scheduler's row numbers stay valid. Raw
values come straight from each node's telemetry decoder; smoothing and anomaly
filtering are layered on by ``coordinator.signals``. Everything here is owned
by the coordinator's event loop: no locks.
"""

from __future__ import annotations

import math
import re
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from coordinator.signals import SignalBank, min_spread_for
from protos import telemetry_pb2 as pb
from protos.codec import TelemetryDecoder
from protos.fields import BY_NAME, FIELD_COUNT

__all__ = [
    "ClusterView",
    "NodeRecord",
    "RegistrationConflict",
    "RegistrationError",
    "validate_register",
    "MAX_GPUS_PER_NODE",
    "SIGNALS",
    "SignalSettings",
]

#: signals that are anomaly-filtered and smoothed, in SignalBank column order;
#: the last is the host's storage await, repeated on each of its GPU rows so the
#: scheduler reads it as a column like the others.
SIGNALS = ("util_gpu_pct", "memory_used_mib", "temperature_c", "power_w", "disk_await_ms")
_SIGNAL_FIELDS = [BY_NAME[name] for name in SIGNALS[:-1]]
_SIGNAL_COLS = np.asarray(_SIGNAL_FIELDS, dtype=np.intp)[None, :]
_DISK = len(SIGNALS) - 1


@dataclass(frozen=True)
class SignalSettings:
    window: int = 30
    alpha: float = 0.3
    iqr_k: float = 1.5
    z_max: float = 3.0
    persist: int = 3
    #: s after a lease ends on a GPU during which its readings' first drop
    #: is taken as the new level at once (``ClusterView.expect_release``):
    #: a released task stops within a few of its agent's readings, and a
    #: preempted one's worker learns of it at its next renewal
    release_expect_s: float = 10.0

MAX_GPUS_PER_NODE = 64
#: tasks a host may say it runs at registration (64 GPUs x 64 tasks)
MAX_RUNNING_TASKS = 4096
#: Register's free-text fields, in characters. Each is shown by ListNodes or
#: ListGpus, logged in node_registered, and hostname, agent_version,
#: driver_version and backend are labels of gpulb_node_info in every scrape:
#: unbounded, one agent made both answers too large for every client.
#: backend names an agent backend ("nvml", "sim"); a PCI bus id is at most 31
#: characters in NVML's own 32-byte buffer ("00000000:01:00.0" is 16)
REGISTER_TEXT_LIMITS = (("hostname", 255), ("agent_version", 64), ("driver_version", 128), ("backend", 32))
MAX_GPU_UUID = 128
MAX_GPU_MODEL = 128
MAX_PCI_BUS_ID = 64
#: GpuInfo.supported_fields entries: Field has 15 values; room for fields a
#: newer agent knows, not for a list that only takes memory
MAX_SUPPORTED_FIELDS = 64
_NODE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_LABEL_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}$")


class RegistrationError(Exception):
    """A Register message that cannot be accepted (INVALID_ARGUMENT)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class RegistrationConflict(RegistrationError):
    """A well-formed Register that clashes with another node's (ALREADY_EXISTS):
    a GPU uuid that a registered node holds."""


def validate_register(reg: pb.Register) -> None:
    """Raise RegistrationError naming the first field that is wrong."""
    if not _NODE_ID.match(reg.node_id):
        raise RegistrationError("register.node_id", f"{reg.node_id!r} must be 1-128 of [A-Za-z0-9._-], starting alphanumeric")
    if not 1 <= len(reg.gpus) <= MAX_GPUS_PER_NODE:
        raise RegistrationError("register.gpus", f"{len(reg.gpus)} GPUs; a node registers 1..{MAX_GPUS_PER_NODE}")
    seen: set[int] = set()
    uuids: dict[str, int] = {}
    for i, gpu in enumerate(reg.gpus):
        if gpu.index in seen:
            raise RegistrationError(f"register.gpus[{i}].index", f"GPU {gpu.index} registered twice")
        if gpu.index >= 1024:
            raise RegistrationError(f"register.gpus[{i}].index", f"{gpu.index} is not a plausible GPU index")
        seen.add(gpu.index)
        if not 0 < gpu.memory_total_mib <= 4 * 1024 * 1024:
            raise RegistrationError(f"register.gpus[{i}].memory_total_mib", f"{gpu.memory_total_mib} MiB is out of range")
        for name, limit in (("uuid", MAX_GPU_UUID), ("model", MAX_GPU_MODEL), ("pci_bus_id", MAX_PCI_BUS_ID)):
            if len(getattr(gpu, name)) > limit:
                raise RegistrationError(f"register.gpus[{i}].{name}", f"{len(getattr(gpu, name))} characters; at most {limit}")
        if len(gpu.supported_fields) > MAX_SUPPORTED_FIELDS:
            raise RegistrationError(f"register.gpus[{i}].supported_fields",
                                    f"{len(gpu.supported_fields)} entries; at most {MAX_SUPPORTED_FIELDS}")
        # the uuid names the GPU across the cluster (placements, migrations, leases)
        if not gpu.uuid:
            raise RegistrationError(f"register.gpus[{i}].uuid", f"empty: GPU {gpu.index} must register its uuid")
        if gpu.uuid in uuids:
            raise RegistrationError(f"register.gpus[{i}].uuid", f"{gpu.uuid!r} is also register.gpus[{uuids[gpu.uuid]}].uuid: a GPU registers once")
        uuids[gpu.uuid] = i
    # one link per GPU pair (the agent sends a < b; either order is taken):
    # the node keeps its topology and ListNodes returns it whole
    most_links = len(reg.gpus) * (len(reg.gpus) - 1)
    if len(reg.topology) > most_links:
        raise RegistrationError("register.topology", f"{len(reg.topology)} links; at most {most_links} for "
                                                     f"{len(reg.gpus)} GPUs (one per GPU pair)")
    links: dict[tuple[int, int], int] = {}
    for i, link in enumerate(reg.topology):
        if link.gpu_a not in seen or link.gpu_b not in seen or link.gpu_a == link.gpu_b:
            raise RegistrationError(f"register.topology[{i}]", f"link {link.gpu_a}-{link.gpu_b} names an unregistered GPU")
        pair = (link.gpu_a, link.gpu_b)
        if pair in links:
            raise RegistrationError(f"register.topology[{i}]",
                                    f"link {link.gpu_a}-{link.gpu_b} repeats register.topology[{links[pair]}]")
        links[pair] = i
    for name, limit in REGISTER_TEXT_LIMITS:
        if len(getattr(reg, name)) > limit:
            raise RegistrationError(f"register.{name}", f"{len(getattr(reg, name))} characters; at most {limit}")
    # 0 = not said (a client that does not adapt its sampling)
    if reg.sample_interval_min_ms and reg.sample_interval_max_ms and reg.sample_interval_min_ms > reg.sample_interval_max_ms:
        raise RegistrationError(
            "register.sample_interval_min_ms",
            f"{reg.sample_interval_min_ms} ms is above sample_interval_max_ms ({reg.sample_interval_max_ms} ms)",
        )
    if len(reg.running_task_ids) > MAX_RUNNING_TASKS:
        raise RegistrationError("register.running_task_ids", f"{len(reg.running_task_ids)} tasks; at most {MAX_RUNNING_TASKS}")
    for i, task_id in enumerate(reg.running_task_ids):
        if not 0 < len(task_id) <= 128:
            raise RegistrationError(f"register.running_task_ids[{i}]", f"{len(task_id)} characters; a task id has 1-128")
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
    agent_version: str = ""
    driver_version: str = ""  # "580.159.04, CUDA 13.0"; "" for the sim or when NVML cannot tell
    #: True until the stream's first live batch: batches before it that say
    #: no sampling period (0) are rounds the agent sampled while no stream was
    #: open, replayed from its outage buffer (``ClusterView.replay_batch``)
    replaying: bool = True
    #: this coordinator's clock minus the agent's wall clock, in s, measured
    #: on the stream's first live batch (None until then): how a replayed
    #: round's sampled_at_ns maps to coordinator time, whatever the agent's
    #: clock is set to
    clock_offset_s: float | None = None

    @property
    def model(self) -> str:
        models = {g.model for g in self.gpus}
        return models.pop() if len(models) == 1 else "mixed"

    def nvlink_pairs(self) -> list[tuple[int, int]]:
        return [(l.gpu_a, l.gpu_b) for l in self.topology if l.kind == pb.LINK_KIND_NVLINK]


#: How long a stream's replayed rounds wait for its first live batch, which
#: the agent sends right after its outage buffer; past this (a client that
#: never says its sampling period) they are timed as if the newest were live.
REPLAY_HOLD_S = 2.0
#: replayed rounds kept per stream while waiting: older ones would have left
#: the anomaly window (30 readings by default) before the live round anyway
_REPLAY_KEPT = 1024


@dataclass
class _Replay:
    """A stream's replayed rounds whose readings wait for its clock offset."""

    node: NodeRecord
    first_arrived_s: float
    #: smallest arrival minus sample time: the offset if the newest round were live
    min_lag_s: float = float("inf")
    newest_sampled_s: float = float("-inf")
    newest_arrived_s: float = float("-inf")
    #: (view rows, signal values, agent sample time s, arrival s), oldest first
    readings: deque = field(default_factory=lambda: deque(maxlen=_REPLAY_KEPT))


class ClusterView:
    """Nodes plus per-GPU columns. Columns grow by doubling; freed rows are reused.

    Readings reach the anomaly filter, EWMA and trend with the time they
    were taken. A live batch's is its arrival: the agent sends a round as it
    samples it, and its clock is not trusted. Rounds the agent sampled while
    no stream was open (its outage buffer, replayed first on a reconnect)
    carry minutes of history that arrive in milliseconds: they keep their
    sample times, mapped to this coordinator's clock by the offset the
    stream's first live batch shows (``replay_batch``, ``settle_replay``).
    """

    def __init__(self, capacity: int = 64, signals: SignalSettings | None = None) -> None:
        self.nodes: dict[str, NodeRecord] = {}
        self._capacity = capacity
        sig = signals or SignalSettings()
        spread = min_spread_for(list(SIGNALS[:-1]))
        self.signals = SignalBank(
            capacity,
            len(SIGNALS),
            window=sig.window,
            alpha=sig.alpha,
            iqr_k=sig.iqr_k,
            z_max=sig.z_max,
            persist=min(sig.persist, sig.window),
            min_spread=np.append(spread, 2.0),  # 2 ms of disk await
        )
        if not (math.isfinite(sig.release_expect_s) and sig.release_expect_s >= 0):
            raise ValueError(f"release_expect_s must be finite and >= 0, got {sig.release_expect_s!r}")
        self.release_expect_s = float(sig.release_expect_s)
        # Readings waiting for the next smoothing tick: (view rows, values, arrival time).
        self._pending_rows: list[np.ndarray] = []
        self._pending_values: list[np.ndarray] = []
        self._pending_at: list[float] = []
        self.disk_await_ms = np.full(capacity, np.nan)  # per GPU row: its host's storage await
        self.sample_interval_s = np.full(capacity, 2.0)  # per GPU row: its agent's sampling period
        self.raw = np.full((capacity, FIELD_COUNT), np.nan)
        self.reading_at_s = np.full(capacity, np.nan)  # coordinator monotonic time of last reading
        self.row_used = np.zeros(capacity, dtype=bool)
        self.row_node: list[str | None] = [None] * capacity
        self.row_gpu_index = np.full(capacity, -1, dtype=np.int32)
        self._free: list[int] = list(range(capacity - 1, -1, -1))
        # GPU uuid -> the node that registered it (every node here is not
        # REMOVED), so a registration cannot claim another node's GPU
        self.gpu_owner: dict[str, str] = {}
        self.version = 0  # bumps on every change, for watchers
        self.membership_version = 0  # bumps when nodes or their GPU rows come and go
        self._last_reread_s = float("-inf")
        # node id -> its stream's replayed rounds waiting for the clock offset
        self._replays: dict[str, _Replay] = {}

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
        self.disk_await_ms = np.concatenate([self.disk_await_ms, np.full(new - old, np.nan)])
        self.sample_interval_s = np.concatenate([self.sample_interval_s, np.full(new - old, 2.0)])
        self.signals.grow(new)
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
            self.disk_await_ms[row] = np.nan
            self._free.append(int(row))
        self._forget_pending(rows)

    # ---- nodes ------------------------------------------------------------
    def check_gpu_uuids(self, reg: pb.Register) -> None:
        """Raise RegistrationConflict when a GPU of ``reg`` is held by another
        node of the view. The same node registering again (a reconnect, a
        restarted agent) keeps its own GPUs."""
        for i, gpu in enumerate(reg.gpus):
            owner = self.gpu_owner.get(gpu.uuid)
            if owner is not None and owner != reg.node_id:
                raise RegistrationConflict(
                    f"register.gpus[{i}].uuid",
                    f"GPU {gpu.uuid} is held by node {owner}; a GPU belongs to one node "
                    f"({owner} lets it go when it registers without it or is removed after its missed heartbeats)",
                )

    def _disown(self, record: NodeRecord) -> None:
        for gpu in record.gpus:
            if self.gpu_owner.get(gpu.uuid) == record.node_id:
                del self.gpu_owner[gpu.uuid]

    def register(self, reg: pb.Register, now_s: float) -> NodeRecord:
        """Add or refresh a node. Rows are kept when the GPU set is unchanged.
        The gateway checks ``check_gpu_uuids`` first; this does not."""
        indices = [g.index for g in reg.gpus]
        existing = self.nodes.get(reg.node_id)
        self._replays.pop(reg.node_id, None)  # the old stream's: its clock offset died with it
        if existing is not None:
            self._disown(existing)
        for gpu in reg.gpus:
            self.gpu_owner[gpu.uuid] = reg.node_id
        if existing is not None and [g.index for g in existing.gpus] == indices:
            rows = existing.rows
            # Old readings are not fresh for the new stream: unknown until the
            # keyframe. The smoothing history is kept: it is the same GPU.
            self.raw[rows] = np.nan
            self.reading_at_s[rows] = np.nan
        else:
            if existing is not None:
                self._release(existing.rows)
            rows = self._allocate(len(indices))
            self.signals.reset_rows(rows)
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
            agent_version=reg.agent_version,
            driver_version=reg.driver_version,
        )
        self.nodes[reg.node_id] = record
        self.version += 1
        self.membership_version += 1
        return record

    def remove(self, node_id: str) -> NodeRecord | None:
        record = self.nodes.pop(node_id, None)
        self._replays.pop(node_id, None)
        if record is not None:
            self._disown(record)
            self._release(record.rows)
            self.version += 1
            self.membership_version += 1
        return record

    def set_disk_await(self, node: NodeRecord, await_ms: float | None, now_s: float) -> None:
        value = np.nan if await_ms is None else float(await_ms)
        self.disk_await_ms[node.rows] = value
        if not np.isnan(value):
            values = np.full((len(node.rows), len(SIGNALS) - 1), np.nan)
            self._queue(node.rows, values, now_s, disk=value)

    #: field columns of the GPU signals, and field column -> signal index (-1: not a signal)
    signal_field_columns = np.asarray(_SIGNAL_FIELDS, dtype=np.intp)
    signal_index_of_field = np.full(FIELD_COUNT, -1, dtype=np.intp)
    signal_index_of_field[_SIGNAL_FIELDS] = np.arange(len(_SIGNAL_FIELDS))

    def queue_signals(self, view_rows: np.ndarray, signal_values: np.ndarray, at_s) -> None:
        """Queue readings of the GPU signals (NaN = no reading) for the next
        smoothing tick; ``at_s`` is one time or one per row."""
        self._queue(view_rows, signal_values, at_s)

    def _queue(self, view_rows: np.ndarray, signal_values: np.ndarray, at_s, disk: float = np.nan) -> None:
        values = np.full((len(view_rows), len(SIGNALS)), disk)
        values[:, :_DISK] = signal_values
        self._pending_rows.append(view_rows)
        self._pending_values.append(values)
        self._pending_at.append(np.broadcast_to(np.asarray(at_s, dtype=np.float64), (len(view_rows),)))

    def _forget_pending(self, rows) -> None:
        if not self._pending_rows:
            return
        gone = np.asarray(list(rows), dtype=np.intp)
        kept = [(r, v, t) for r, v, t in zip(self._pending_rows, self._pending_values, self._pending_at) if not np.isin(r, gone).any()]
        self._pending_rows = [k[0] for k in kept]
        self._pending_values = [k[1] for k in kept]
        self._pending_at = [k[2] for k in kept]

    @property
    def pending(self) -> int:
        return len(self._pending_rows)

    def _reread_quiet_signals(self, now_s: float) -> None:
        """Feed again the signals whose filter has not caught up with a value
        that stopped moving.

        Agents send a value only when it changes, so a real step (a 20 GiB
        allocation) arrives once and then goes quiet. Without re-reading, the
        filter would wait forever for the ``persist`` readings that accept a
        flagged step, and the EWMA would stay wherever its last update left it.
        Silence for two of the node's sampling periods means the agent sampled
        again and saw the same value, so that value is fed again as a reading,
        once per such period, while the signal is flagged or its smoothed value
        is further from the reading than the filter's spread floor. A
        one-sample spike is undone by the agent's next sample (moving readings
        make it sample fast) before that, and stays rejected.
        """
        bank = self.signals
        # Silence first: it is one comparison over every cell, and while
        # readings stream in (2,500 nodes at 200 ms) almost no cell is silent,
        # so the costlier tests below run on a handful of cells instead of
        # every (row, signal) - about 6 ms of the event loop every 200 ms
        # before at 20,000 GPUs.
        quiet_for = np.maximum(2.0 * self.sample_interval_s, 0.2)
        with np.errstate(invalid="ignore"):
            due = (now_s - bank.last_reading_s) >= quiet_for[:, None]
        due &= self.row_used[:, None]
        for replay in self._replays.values():
            # its raw values are history until the stream's clock is known:
            # fed again now, an old value would count as a reading taken now
            due[replay.node.rows] = False
        rows, sigs = np.nonzero(due)
        if rows.size == 0:
            return
        disk = sigs == _DISK
        current = np.empty(rows.size)
        current[~disk] = self.raw[rows[~disk], self.signal_field_columns[sigs[~disk]]]
        current[disk] = self.disk_await_ms[rows[disk]]
        with np.errstate(invalid="ignore"):
            behind = np.abs(bank.smoothed[rows, sigs] - current) > bank.min_spread[sigs]
        pending = ~np.isnan(current) & (bank.flagged[rows, sigs] | behind)
        if not pending.any():
            return
        rows, sigs, current = rows[pending], sigs[pending], current[pending]
        unique_rows, inverse = np.unique(rows, return_inverse=True)
        values = np.full((unique_rows.size, len(SIGNALS)), np.nan)
        values[inverse, sigs] = current
        self._pending_rows.append(unique_rows)
        self._pending_values.append(values)
        self._pending_at.append(np.full(unique_rows.size, now_s))

    # ---- replayed rounds ----------------------------------------------------
    def replay_batch(self, node: NodeRecord, sampled_s: float, arrived_s: float) -> None:
        """A round of ``node``'s outage buffer was admitted: sampled at
        ``sampled_s`` on the agent's wall clock, arrived at ``arrived_s``. Its
        readings wait (``queue_replayed``) until the stream's clock offset is
        known. A replay arrives in one burst, so no round of it can tell how
        old it is; the live round the agent sends right after it can."""
        replay = self._replays.get(node.node_id)
        if replay is None or replay.node is not node:
            replay = self._replays[node.node_id] = _Replay(node, arrived_s)
        replay.min_lag_s = min(replay.min_lag_s, arrived_s - sampled_s)
        if sampled_s >= replay.newest_sampled_s:
            replay.newest_sampled_s, replay.newest_arrived_s = sampled_s, arrived_s

    def queue_replayed(self, node: NodeRecord, view_rows: np.ndarray, signal_values: np.ndarray, sampled_s: float, arrived_s: float) -> None:
        """``queue_signals`` for a replayed round: held until the stream's
        clock offset is known, then queued at its sample time."""
        if node.clock_offset_s is None:
            replay = self._replays.get(node.node_id)
            if replay is not None and replay.node is node:
                replay.readings.append((view_rows, signal_values, sampled_s, arrived_s))
            return
        self._queue(view_rows, signal_values, self._replayed_at(node, view_rows, sampled_s, arrived_s))

    def settle_replay(self, node: NodeRecord, offset_s: float | None) -> None:
        """The stream's clock offset is known (its first live batch; None:
        none said, time the replay by its newest round): feed the readings
        that waited, oldest first, and let them vouch for the node as of the
        newest one's sample time. Later batches are live."""
        node.replaying = False
        replay = self._replays.pop(node.node_id, None)
        if replay is not None and replay.node is not node:
            replay = None
        if offset_s is None and replay is not None:
            offset_s = replay.min_lag_s
        node.clock_offset_s = offset_s
        if replay is None or offset_s is None:
            return
        for view_rows, values, sampled_s, arrived_s in replay.readings:
            self._queue(view_rows, values, self._replayed_at(node, view_rows, sampled_s, arrived_s))
        at = min(replay.newest_sampled_s + offset_s, replay.newest_arrived_s)
        self.reading_at_s[node.rows] = np.fmax(self.reading_at_s[node.rows], at)

    def _replayed_at(self, node: NodeRecord, view_rows: np.ndarray, sampled_s: float, arrived_s: float) -> np.ndarray:
        """Coordinator time of a replayed reading, per row: its sample time
        through the stream's offset, never later than it arrived nor earlier
        than the row's last reading already filtered (an agent clock stepped
        during the outage must not reorder the row's history)."""
        at = np.full(len(view_rows), min(sampled_s + node.clock_offset_s, arrived_s))
        return np.fmax(at, self.signals.last_update_s[view_rows])

    def set_sample_interval(self, node: NodeRecord, interval_ms: int) -> None:
        if interval_ms > 0:
            self.sample_interval_s[node.rows] = interval_ms / 1000.0

    def flush_signals(self, now_s: float | None = None) -> int:
        """Run the anomaly filter and EWMA over every queued reading in one
        vectorised pass. Returns how many readings were applied."""
        if now_s is not None and self._replays:
            # replays whose live round never came (a client that says no period)
            for replay in [r for r in self._replays.values() if now_s - r.first_arrived_s >= REPLAY_HOLD_S]:
                self.settle_replay(replay.node, None)
        # The re-read scans every row; its own threshold is >= 0.2 s, so
        # scanning more often than that finds nothing new.
        if now_s is not None and now_s - self._last_reread_s >= 0.2:
            self._last_reread_s = now_s
            self._reread_quiet_signals(now_s)
        if not self._pending_rows:
            return 0
        rows = np.concatenate(self._pending_rows)
        values = np.concatenate(self._pending_values)
        times = np.concatenate(self._pending_at)
        self._pending_rows, self._pending_values, self._pending_at = [], [], []
        self.signals.update(rows, values, times)
        return int(rows.size)

    def expect_release(self, node_id: str, gpu_uuids: Iterable[str], now_s: float) -> int:
        """A lease on these GPUs of ``node_id`` just ended by the
        coordinator's own decision (completed, failed, cancelled, preempted,
        expired, migrated away): their util, memory, power and temperature are
        about to fall, and a fall the coordinator caused is no anomaly. For
        ``release_expect_s`` the first drop of each is taken as the new level
        at once, and one already flagged becomes the level now
        (``SignalBank.expect_drop``); a rise is judged as always. The host's
        disk await is not the GPU's. Returns the GPU rows told (0 for a node
        or GPU no longer in the view)."""
        node = self.nodes.get(node_id)
        if node is None:
            return 0
        wanted = set(gpu_uuids)
        rows = [int(row) for row, gpu in zip(node.rows, node.gpus) if gpu.uuid in wanted]
        if not rows:
            return 0
        if self.signals.expect_drop(rows, now_s + self.release_expect_s, signals=np.arange(_DISK)):
            self.version += 1  # smoothed values moved: snapshots must see them
        return len(rows)

    def smoothed(self, name: str) -> np.ndarray:
        """The smoothed column of a signal (NaN where unknown)."""
        return self.signals.smoothed[:, SIGNALS.index(name)]

    # ---- queries ----------------------------------------------------------
    def node_reading_age_s(self, node: NodeRecord, now_s: float) -> float:
        # in Python: a node has a handful of rows, where numpy's per-call cost
        # (nanmax) was a third of a node's message for ListNodes and WatchView
        newest = max((t for t in self.reading_at_s[node.rows].tolist() if t == t), default=None)
        return float("inf") if newest is None else float(now_s - newest)

    def column(self, name: str) -> np.ndarray:
        return self.raw[:, BY_NAME[name]]
