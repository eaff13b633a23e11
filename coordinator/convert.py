"""Proto conversion for the operator API, in one place: view rows and node
records in, ``cluster_pb2`` messages out. Servicers stay thin."""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import numpy as np

from coordinator.view import ClusterView, NodeRecord
from protos import cluster_pb2 as cpb
from protos.fields import BY_NAME

__all__ = ["gpu_messages", "node_message", "METRIC_ALIASES", "resolve_metrics", "UnknownMetric"]

#: Gpu message fields filled from the view's columns (same names, wire units)
_GPU_FIELDS: tuple[str, ...] = (
    "util_gpu_pct",
    "util_memory_pct",
    "memory_used_mib",
    "memory_total_mib",
    "temperature_c",
    "power_w",
    "power_limit_w",
    "sm_clock_mhz",
    "pcie_rx_mbps",
    "pcie_tx_mbps",
    "ecc_corrected",
    "ecc_uncorrected",
    "xid_last",
    "process_count",
)

#: short names operators type (the seeds' ``metrics=util,memory``)
METRIC_ALIASES: dict[str, tuple[str, ...]] = {
    "util": ("util_gpu_pct", "util_memory_pct"),
    "memory": ("memory_used_mib", "memory_total_mib"),
    "mem": ("memory_used_mib", "memory_total_mib"),
    "temp": ("temperature_c",),
    "temperature": ("temperature_c",),
    "power": ("power_w", "power_limit_w"),
    "clock": ("sm_clock_mhz",),
    "pcie": ("pcie_rx_mbps", "pcie_tx_mbps"),
    "ecc": ("ecc_corrected", "ecc_uncorrected"),
}

# Signals the smoothed view replaces (the ones the anomaly filter runs on).
SMOOTHED_FIELDS = ("util_gpu_pct", "memory_used_mib", "temperature_c", "power_w")


class UnknownMetric(ValueError):
    def __init__(self, index: int, name: str) -> None:
        known = sorted(set(_GPU_FIELDS) | set(METRIC_ALIASES))
        super().__init__(f"metrics[{index}]: unknown metric {name!r}; known: {', '.join(known)}")
        self.field = f"metrics[{index}]"


def resolve_metrics(names: Sequence[str]) -> tuple[str, ...]:
    if not names:
        return tuple(_GPU_FIELDS)
    out: list[str] = []
    for i, name in enumerate(names):
        key = name.strip().lower()
        if key in _GPU_FIELDS:
            out.append(key)
        elif key in METRIC_ALIASES:
            out.extend(METRIC_ALIASES[key])
        else:
            raise UnknownMetric(i, name)
    return tuple(dict.fromkeys(out))


def _finite(value: float) -> bool:
    return not math.isnan(value) and not math.isinf(value)


def gpu_messages(
    view: ClusterView,
    nodes: Iterable[NodeRecord],
    *,
    now_s: float,
    staleness_s: float,
    node_state,
    metrics: Sequence[str],
    smoothed: dict[str, np.ndarray] | None = None,
    extras=None,
    model: str = "",
    into=None,
):
    """One Gpu message per GPU of ``nodes`` (whose model contains ``model``,
    case-insensitive, when given), added to the repeated field ``into`` (a
    response's ``gpus``) or returned as a list.

    ``smoothed`` maps Gpu field names to per-row arrays that replace the raw
    values (the smoothed view); ``extras(node, row, msg)`` fills scheduler facts.

    ListGpus and every WatchView client build this for the whole cluster on
    the coordinator's event loop, so it reads the view a column at a time
    into Python floats and builds each message in one constructor call:
    reading one numpy scalar at a time, setting fields one by one and
    copying the list into the response took ~65 ms at 8,000 GPUs.
    """
    needle = model.lower()
    picked = [(node, gpu, row) for node in nodes for gpu, row in zip(node.gpus, node.rows)
              if not needle or needle in gpu.model.lower()]
    out = [] if into is None else into
    if not picked:
        return out
    rows = np.fromiter((row for _, _, row in picked), dtype=np.intp, count=len(picked))
    metrics = tuple(metrics)
    block = view.raw[rows][:, [BY_NAME[name] for name in metrics]]
    if smoothed is not None:
        for j, name in enumerate(metrics):
            if name in smoothed:
                block[:, j] = smoothed[name][rows]
    finite = np.isfinite(block)
    all_finite = finite.all(axis=1).tolist()
    finite = finite.tolist()
    values = block.tolist()
    health = view.raw[rows, BY_NAME["health"]]
    health = np.where(np.isfinite(health), health, 0).astype(np.int64).tolist()
    read_at = view.reading_at_s[rows]
    age = np.where(np.isfinite(read_at), now_s - read_at, np.inf)
    stale = (~(age <= staleness_s)).tolist()
    age = np.where(np.isfinite(age), age, -1.0).tolist()
    is_smoothed = smoothed is not None
    build = cpb.Gpu if into is None else into.add
    states: dict[str, int] = {}
    for i, (node, gpu, row) in enumerate(picked):
        state = states.get(node.node_id)
        if state is None:
            state = states[node.node_id] = node_state(node.node_id)
        if all_finite[i]:
            fields = dict(zip(metrics, values[i]))
        else:
            fields = {name: value for name, value, ok in zip(metrics, values[i], finite[i]) if ok}
        msg = build(
            node_id=node.node_id,
            index=gpu.index,
            uuid=gpu.uuid,
            model=gpu.model,
            node_state=state,
            reading_age_s=age[i],
            stale=stale[i],
            smoothed=is_smoothed,
            health=health[i],
            **fields,
        )
        if extras is not None:
            extras(node, row, msg)
        if into is None:
            out.append(msg)
    return out


def node_message(view: ClusterView, node: NodeRecord, *, now_s: float, staleness_s: float, state, extras=None) -> cpb.Node:
    age = view.node_reading_age_s(node, now_s)
    msg = cpb.Node(
        node_id=node.node_id,
        state=state,
        hostname=node.hostname,
        backend=node.backend,
        labels=node.labels,
        gpu_count=len(node.gpus),
        model=node.model,
        last_heartbeat_ns=node.last_heartbeat_ns,
        reading_age_s=age if _finite(age) else -1.0,
        stale=not age <= staleness_s,
        envelopes=node.envelopes,
        resyncs=node.resyncs,
        topology=node.topology,
        sample_interval_ms=node.sample_interval_ms,
        agent_version=node.agent_version,
        driver_version=node.driver_version,
    )
    if node.disk_await_ms is not None:
        msg.disk_await_ms = node.disk_await_ms
    if node.disk_util_pct is not None:
        msg.disk_util_pct = node.disk_util_pct
    if extras is not None:
        extras(node, msg)
    return msg
