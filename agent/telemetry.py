"""From backend readings to wire rows: GpuSample lists become the (GPU x field)
integer matrix the codec encodes, and the inventory becomes a Register message.
Pure functions, tested on literals; ``drop_out_of_range`` also logs (once per
GPU and field) what it drops.

Every reading the agent sends lies in its field's range (``protos.fields``
``lo``..``hi``): the coordinator closes the stream of an agent that sends one
outside it, so a failed sensor's reading (util 255 %, 0xFFFFFFFF mW) would
take the whole node out, reconnecting in a loop. ``samples_to_matrix``, the
one way every backend's samples (NVML, the simulator, replays) reach the
encoder, drops such a reading first: that field of that GPU is not reported
(None, never a stand-in value) and ``sample.errors`` says why; a GPU left
with no reading at all is ``READ_FAILED``, never idle."""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np
import structlog

from agent.backend import GpuInfo, GpuProcess, GpuSample, Health, TopologyLink
from protos import telemetry_pb2 as pb
from protos.fields import FIELD_COUNT, FIELDS

__all__ = ["samples_to_matrix", "drop_out_of_range", "OUT_OF_RANGE", "register_message", "process_lists", "movement"]

log = structlog.get_logger("gpulb.agent.telemetry")

#: the reason a dropped reading gets in ``sample.errors`` (and the log event)
OUT_OF_RANGE = "reading_out_of_range"

#: fields that are readings of the GPU: health is the verdict on them, and
#: xid_last comes from the driver's event queue, not from reading the GPU
_READING_ATTRS = tuple(spec.attr for spec in FIELDS if spec.attr not in ("health", "xid_last"))
_HEALTH_COL = next(col for col, spec in enumerate(FIELDS) if spec.attr == "health")
_HEALTH = FIELDS[_HEALTH_COL]
#: (column, sample attribute, divisor, lo, hi, spec) of every field but health
_CHECKS = tuple(
    (col, spec.attr, spec.sample_divisor, spec.lo, spec.hi, spec) for col, spec in enumerate(FIELDS) if col != _HEALTH_COL
)

#: (GPU index, field) already logged as out of range by this process
_LOGGED: set[tuple[int, str]] = set()


def _wire(value: Any, divisor: int) -> int | None:
    """A sample value in wire units; None if it is no finite number."""
    try:
        scaled = value / divisor
        if not math.isfinite(scaled):
            return None
        return int(round(scaled))
    except (TypeError, ValueError, OverflowError):
        return None


def _checked(sample: GpuSample, logged: set[tuple[int, str]] | None) -> tuple[list[tuple[int, int]], int]:
    """(column, wire value) of every reading of ``sample`` within its
    field's range, health last; and how many readings were dropped (made
    None in ``sample``, the reason in its errors; see ``drop_out_of_range``)."""
    cells: list[tuple[int, int]] = []
    dropped = 0
    for col, attr, divisor, lo, hi, spec in _CHECKS:
        value = getattr(sample, attr)
        if value is None:
            continue
        # the common case first, fast: an int already in wire units
        wire = value if divisor == 1 and type(value) is int else _wire(value, divisor)
        if wire is not None and lo <= wire <= hi:
            cells.append((col, wire))
            continue
        shown = str(value if wire is None else wire)
        if len(shown) > 24:  # a garbage integer of hundreds of digits
            shown = shown[:20] + "..."
        setattr(sample, spec.attr, None)
        sample.errors[spec.attr] = f"{OUT_OF_RANGE}: {shown} {spec.unit} outside {spec.lo}..{spec.hi} ({spec.name}), not reported"
        dropped += 1
        if logged is not None and (sample.index, spec.attr) not in logged:
            logged.add((sample.index, spec.attr))
            log.warning(OUT_OF_RANGE, gpu=sample.index, field=spec.name, value=shown, lo=spec.lo, hi=spec.hi,
                        unit=spec.unit, detail="a failed sensor, most likely: that field of that GPU is not reported "
                        "while it reads so (logged once per GPU and field)")
    if not isinstance(sample.health, (int, np.integer)) or not _HEALTH.lo <= sample.health <= _HEALTH.hi:
        sample.errors["health"] = f"{OUT_OF_RANGE}: health {sample.health!r} is no GpuHealth, reported read_failed"
        sample.health = Health.READ_FAILED
    elif dropped and sample.health in (Health.OK, Health.FROZEN):
        if all(getattr(sample, attr) is None for attr in _READING_ATTRS):
            sample.health = Health.READ_FAILED  # nothing left: failed, never idle
    cells.append((_HEALTH_COL, int(sample.health)))
    return cells, dropped


def drop_out_of_range(samples: Sequence[GpuSample], logged: set[tuple[int, str]] | None = _LOGGED) -> int:
    """Turn every reading outside its field's range into "not reported",
    in place: the field becomes None and ``sample.errors[field]`` says
    ``reading_out_of_range: ...``. A GPU that had readings and has none
    left is ``READ_FAILED`` (a LOST or already failed one stays so). Each
    (GPU, field) is logged once, the first time, into ``logged`` (None: no
    log, for ``gpulb-agent --check``, which prints the reasons). Returns
    how many readings were dropped."""
    return sum(_checked(sample, logged)[1] for sample in samples)


def samples_to_matrix(samples: Sequence[GpuSample], gpu_order: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(values int64, present bool), both GPUs x FIELDS, rows in ``gpu_order``.

    A GPU missing from ``samples`` has no present fields this round. A
    reading outside its field's range is dropped on the way
    (``drop_out_of_range``, which changes ``samples`` in place): it is not
    present, and every present value is within its field's ``lo``..``hi``.
    """
    values = np.zeros((len(gpu_order), FIELD_COUNT), dtype=np.int64)
    present = np.zeros((len(gpu_order), FIELD_COUNT), dtype=bool)
    row_of = {idx: row for row, idx in enumerate(gpu_order)}
    for sample in samples:
        cells, _ = _checked(sample, _LOGGED)
        row = row_of.get(sample.index)
        if row is None:
            continue
        for col, wire in cells:
            values[row, col] = wire
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
