"""From backend readings to wire rows: GpuSample lists become the (GPU x field)
integer matrix the codec encodes, and the inventory becomes a Register message.
Pure functions, tested on literals."""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from agent.backend import GpuInfo, GpuProcess, GpuSample, TopologyLink
from protos import telemetry_pb2 as pb
from protos.fields import FIELD_COUNT, FIELDS

__all__ = ["samples_to_matrix", "register_message", "process_lists", "movement"]

_ATTRS = [(spec.attr, spec.sample_divisor) for spec in FIELDS]


def samples_to_matrix(samples: Sequence[GpuSample], gpu_order: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(values int64, present bool), both GPUs x FIELDS, rows in ``gpu_order``.

    A GPU missing from ``samples`` has no present fields this round.
    """
    values = np.zeros((len(gpu_order), FIELD_COUNT), dtype=np.int64)
    present = np.zeros((len(gpu_order), FIELD_COUNT), dtype=bool)
    row_of = {idx: row for row, idx in enumerate(gpu_order)}
    for sample in samples:
        row = row_of.get(sample.index)
        if row is None:
            continue
        for col, (attr, divisor) in enumerate(_ATTRS):
            value = getattr(sample, attr)
            if value is not None:
                values[row, col] = int(round(value / divisor))
                present[row, col] = True
    return values, present


def process_lists(samples: Sequence[GpuSample]) -> dict[int, tuple[GpuProcess, ...]]:
    return {s.index: tuple(sorted(s.processes, key=lambda p: p.pid)) for s in samples if s.processes is not None}


def movement(previous: np.ndarray | None, current: np.ndarray, present: np.ndarray, deadbands: np.ndarray) -> bool:
    """Whether a reading moved by more than twice its deadband since the last
    round: the signal that makes the adaptive sampler speed up."""
    if previous is None:
        return True
    moved = np.abs(current - previous) > 2 * deadbands
    return bool((moved & present).any())


def register_message(
    *,
    node_id: str,
    hostname: str,
    backend: str,
    inventory: Sequence[GpuInfo],
    topology: Sequence[TopologyLink],
    labels: Mapping[str, str],
    session_id: int,
    version: str,
    interval_min_ms: int,
    interval_max_ms: int,
    supported: Mapping[int, Sequence[int]] | None = None,
    driver_version: str = "",
    running_task_ids: Sequence[str] = (),
) -> pb.Register:
    msg = pb.Register(
        node_id=node_id,
        hostname=hostname,
        agent_version=version,
        backend=backend,
        labels=dict(labels),
        session_id=session_id,
        sample_interval_min_ms=interval_min_ms,
        sample_interval_max_ms=interval_max_ms,
        driver_version=driver_version,
        running_task_ids=list(running_task_ids),
    )
    for info in inventory:
        gpu = msg.gpus.add(
            index=info.index,
            uuid=info.uuid,
            model=info.model,
            memory_total_mib=info.memory_total_mib,
            power_limit_mw=info.power_limit_mw or 0,
            pci_bus_id=info.pci_bus_id,
        )
        if supported is not None:
            gpu.supported_fields.extend(supported.get(info.index, ()))
    for link in topology:
        msg.topology.add(gpu_a=link.gpu_a, gpu_b=link.gpu_b, kind=link.kind, nvlink_count=link.nvlink_count)
    return msg
