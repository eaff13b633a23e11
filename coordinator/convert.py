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
) -> list[cpb.Gpu]:
    """One Gpu message per GPU of ``nodes``.

    ``smoothed`` maps Gpu field names to per-row arrays that replace the raw
    values (the smoothed view); ``extras(row, msg)`` fills scheduler facts.
    """
    out: list[cpb.Gpu] = []
    health_col = BY_NAME["health"]
    for node in nodes:
        state = node_state(node.node_id)
        for gpu, row in zip(node.gpus, node.rows):
            raw = view.raw[row]
            read_at = view.reading_at_s[row]
            age = float(now_s - read_at) if _finite(read_at) else float("inf")
            msg = cpb.Gpu(
                node_id=node.node_id,
                index=gpu.index,
                uuid=gpu.uuid,
                model=gpu.model,
                node_state=state,
                reading_age_s=age if _finite(age) else -1.0,
                stale=not age <= staleness_s,
                smoothed=smoothed is not None,
            )
            health = raw[health_col]
            msg.health = int(health) if _finite(health) else 0
            for name in metrics:
                if smoothed is not None and name in smoothed:
                    value = float(smoothed[name][row])
                else:
                    value = float(raw[BY_NAME[name]])
                if _finite(value):
                    setattr(msg, name, value)
            if extras is not None:
                extras(row, msg)
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
