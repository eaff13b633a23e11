"""Job traces for the simulator: the trace CSV format, its reader and writer,
and the converter from the Alibaba openb pod lists.

The format
==========

One CSV file, UTF-8 (a byte-order mark, as spreadsheets write, is skipped),
one task a row, a header naming the columns (any order). Blank lines and
lines starting with ``#`` between records are ignored; a quoted value may
span lines (line numbers in errors are the file's, where the record starts).

============ ======== ==========================================================
column       required meaning
============ ======== ==========================================================
task_id      yes      unique, printable, at most 128 characters
submit_s     yes      s from the trace start when the task is submitted
                      (0..1e9: a billion seconds, about 31 years)
duration_s   yes      s the task runs on a speed-1.0 GPU (RTX 4090) alone
                      (> 0, at most 1e9)
num_gpus     yes      GPUs on one node, 1..64
vram_mib     yes      MiB of GPU memory the task asks for on each GPU (> 0)
gpu_share    yes      0..1, share of each GPU's compute the task expects
priority     yes      ``P0``..``P3`` (or 0..3); P0 is real-time inference
kind         yes      ``inference``, ``training``, ``batch``, ``background`` or free
                      text (printable, at most 64 characters)
gpu_spec     no       model constraint, e.g. ``V100M16|V100M32`` (empty = any)
tenant       no       tenant name (per-tenant memory thresholds; printable, at
                      most 128 characters)
util         no       % utilisation the task puts on each GPU (0..100);
                      empty = ``100 * gpu_share``
movable      no       ``true``/``false`` (also 1/0, yes/no); empty = by kind
needs_nvlink no       ``true``: its GPUs must be NVLink-connected (a cluster
                      file's ``nvlink`` column says which are); empty = false
estimate_s   no       s the client tells the scheduler the task will run (its
                      ``duration_s`` estimate, e.g. a batch system's time
                      limit); ``duration_s`` is what it really runs. Empty =
                      ``duration_s`` (an exact estimate); 0 = no estimate; at
                      most 1e9
============ ======== ==========================================================

Any other column is an error (a misspelt optional column must not be silently
ignored). Each row must also pass the limits a submitted ``TaskSpec`` has
(``TaskSpec.validate``), so a trace that reads is one the scheduler takes.
``read_trace`` raises ``TraceFormatError`` naming the file, the line and the
column of the first bad value (or the line of a byte that is not UTF-8).

The openb converter
===================

``convert_openb`` turns a pod list of the Alibaba GPU cluster trace
(cluster-trace-gpu-v2023, Weng et al., ATC '23; ``../shared/traces/alibaba-openb``)
into this format. Every mapping choice:

* **submit_s** = ``creation_time`` minus the smallest ``creation_time`` in the
  file (divided by ``time_scale``). Creation, not ``scheduled_time``: how long a
  task waits is what the simulated scheduler decides.
* **duration_s** = ``deletion_time - scheduled_time`` (divided by
  ``time_scale``): the time the pod really held its GPUs. Pods that ran and
  failed (``Failed``) keep their real run time: they held GPUs for it.
  openb ran on a mix of GPU models, so its durations are taken as durations
  on the "average" GPU of that mix: the openb cluster converter
  (``scheduler.cluster.convert_openb_nodes``) scales its speeds so the
  GPU-weighted mean is 1.0, and the trace's total work takes as long there
  as it did in the real cluster.
* **Running pods whose deletion is the trace end** (the latest
  ``deletion_time`` of the file) were still running when the trace was cut:
  their duration is a lower bound. They are kept with it (they hold their
  GPUs until the end of the replayed period, as in the real cluster) and
  counted as ``censored``.
* **Pending pods** (no ``scheduled_time``: 897 of the default list) never
  ran, so the trace does not say how long they would have run. They are
  skipped and counted (``skipped_pending``) rather than given an invented
  duration.
* **CPU-only pods** (``num_gpu == 0``) are not GPU work: skipped, counted
  (``skipped_cpu_only``).
* **qos -> priority and kind.** ``LS`` (latency-sensitive: Alibaba's online
  services) -> ``P0``, kind ``inference``: that is what P0 means here
  (real-time serving whose wait past the SLA counts), and it gives the P0 SLA
  figure real content. ``Guaranteed`` (Kubernetes' strongest resource
  guarantee, but not marked latency-sensitive) -> ``P1``, ``training``.
  ``Burstable`` -> ``P2``, ``batch``. ``BE`` (best effort) -> ``P3``,
  ``background``. An unknown qos -> ``P2``, ``batch``, counted.
* **gpu_milli -> gpu_share**: ``gpu_milli / 1000`` for single-GPU pods (values
  below 1000 are GPU sharing); multi-GPU pods always take whole GPUs
  (``gpu_milli`` is 1000 for all of them in openb), share 1.0.
* **vram_mib** = ``gpu_share * 0.8 * 15360`` MiB per GPU. openb has no memory
  column and its GPU sharing splits a GPU's memory with its compute, so the
  ask follows the share. The reference card is the smallest in the openb
  cluster, the T4 (15,360 MiB as NVML reports it; the P100 and V100M16 have
  16,280 and 16,160), so an unconstrained task fits every GPU of that
  cluster; the factor 0.8 keeps a whole-GPU task (12,288 MiB) under the
  scheduler's 85 % memory reject threshold of that card. Until round 23 the
  reference was 16 GiB (a whole-GPU ask of 13,107 MiB): 85.3 % of a T4, just
  past the threshold, so openb's 808 T4s took only fractional tasks. On larger cards
  the memory filter alone would let two whole-GPU tasks share a GPU; the
  load-aware score is what keeps them apart while free GPUs exist. What a
  task *really* uses differs from this ask: the simulator draws it from the
  measured GenAI memory series (see ``scheduler.simulator``).
* **util** is left empty (``100 * gpu_share``); **tenant** empty;
  **movable** empty (by kind: training, batch and background move).
* **gpu_spec** is copied when the file has the column (the gpuspec33 list).
* **Lists without time columns** (the multigpu50 list has only
  ``name, cpu_milli, memory_mib, num_gpu, gpu_milli``) take times and qos from
  a reference list (``times_from``; by default ``openb_pod_list_default.csv``
  next to the input): a row whose ``name`` is in the reference takes that
  row's ``qos``, ``pod_phase`` and times (in multigpu50 these are the 8,152
  rows of the default list, unchanged); any other row takes them from a
  reference row drawn at random (seeded) among the *scheduled* reference rows
  with the same ``num_gpu`` (all scheduled GPU rows if none has it), so the
  added multi-GPU tasks arrive and last like the trace's own multi-GPU tasks.
  Those rows are counted as ``synthesized_times``.

Rows are written sorted by ``submit_s`` (file order on ties).
"""

from __future__ import annotations

import codecs
import csv
import io
import math
import os
import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Iterable, Iterator, Sequence

from scheduler.errors import InvalidTask
from scheduler.gpuspec import parse_gpu_spec
from scheduler.task import MAX_GPUS, MAX_TASK_ID_LEN, Priority, TaskSpec

__all__ = [
    "TRACE_COLUMNS",
    "OPTIONAL_TRACE_COLUMNS",
    "TraceTask",
    "TraceFormatError",
    "read_trace",
    "parse_trace",
    "write_trace",
    "scale_trace",
    "ConversionStats",
    "convert_openb",
    "convert_openb_rows",
    "trace_to_text",
    "csv_records",
    "read_csv_file",
    "MAX_TRACE_S",
    "OPENB_QOS",
    "OPENB_REFERENCE_VRAM_MIB",
    "OPENB_VRAM_FRACTION",
]

TRACE_COLUMNS = (
    "task_id",
    "submit_s",
    "duration_s",
    "num_gpus",
    "vram_mib",
    "gpu_share",
    "priority",
    "kind",
)
OPTIONAL_TRACE_COLUMNS = ("gpu_spec", "tenant", "util", "movable", "needs_nvlink", "estimate_s")

# openb qos -> (priority, kind); see the module docstring for why.
OPENB_QOS: dict[str, tuple[Priority, str]] = {
    "LS": (Priority.P0, "inference"),
    "Guaranteed": (Priority.P1, "training"),
    "Burstable": (Priority.P2, "batch"),
    "BE": (Priority.P3, "background"),
}
OPENB_REFERENCE_VRAM_MIB = 15_360.0  # the smallest card of the openb cluster: the T4
OPENB_VRAM_FRACTION = 0.8  # of the reference card for a whole-GPU task
_MOVABLE_KINDS = frozenset({"training", "batch", "background"})
_TRUE = frozenset({"true", "1", "yes", "y", "t"})
_FALSE = frozenset({"false", "0", "no", "n", "f"})
#: s: the largest submit time, duration or estimate a trace may hold (about 31
#: years). The simulator's leases last 1e12 s and its arithmetic runs on the
#: virtual clock, so times far beyond this hang or overflow it.
MAX_TRACE_S = 1e9
_TIME_NOTE = "s; 1e9 s is about 31 years of simulated time"


class TraceFormatError(ValueError):
    """A trace (or cluster) file is malformed; names the file, line and column."""

    def __init__(self, source: str, line: int | None, column: str | None, message: str) -> None:
        where = source
        if line is not None:
            where += f":{line}"
        if column is not None:
            where += f": column {column!r}"
        super().__init__(f"{where}: {message}")
        self.source = source
        self.line = line
        self.column = column
        self.message = message


@dataclass(frozen=True, slots=True)
class TraceTask:
    """One row of a trace (units as in the module docstring)."""

    task_id: str
    submit_s: float
    duration_s: float
    num_gpus: int
    vram_mib: float
    gpu_share: float
    priority: Priority
    kind: str
    gpu_spec: str = ""
    tenant: str = ""
    util: float | None = None  # % per GPU; None = 100 * gpu_share
    movable: bool | None = None  # None = by kind
    needs_nvlink: bool = False
    estimate_s: float | None = None  # the client's estimate; None = duration_s, 0 = none

    @property
    def estimate(self) -> float:
        """s the client tells the scheduler this task will run (0: no estimate)."""
        return self.duration_s if self.estimate_s is None else self.estimate_s

    @property
    def util_pct(self) -> float:
        """% utilisation the task puts on each GPU when it runs alone."""
        return self.util if self.util is not None else 100.0 * self.gpu_share

    @property
    def is_movable(self) -> bool:
        if self.movable is not None:
            return self.movable
        return self.kind.lower() in _MOVABLE_KINDS

    def to_spec(self, task_id: str | None = None, vram_mib: float | None = None) -> TaskSpec:
        """The ``TaskSpec`` a client would submit for this task.

        The client's estimate (``estimate_s``, else the duration) is passed as
        the spec's ``duration_s``.
        """
        return TaskSpec(
            task_id=task_id or self.task_id,
            tenant=self.tenant,
            priority=self.priority,
            kind=self.kind,
            num_gpus=self.num_gpus,
            vram_mib=float(vram_mib if vram_mib is not None else self.vram_mib),
            gpu_share=self.gpu_share,
            duration_s=self.estimate,
            gpu_spec=self.gpu_spec,
            movable=self.is_movable,
            needs_nvlink=self.needs_nvlink,
        )


# ---- reading ------------------------------------------------------------------------------


def _float(
    text: str, column: str, *, low: float, high: float = math.inf, low_open: bool = False,
    most: float = math.inf, note: str = "",
) -> float:
    """Parse a finite float in [low, high] (or (low, high]), at most ``most``;
    ValueError names the rule (``note``: why ``most``)."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {text!r}")
    if value < low or (low_open and value == low) or value > high:
        lo = "(" if low_open else "["
        hi = f"{high:g}]" if math.isfinite(high) else "inf)"
        raise ValueError(f"expected a number in {lo}{low:g}, {hi}, got {text!r}")
    if value > most:
        raise ValueError(f"expected at most {most:g}, got {text!r}" + (f" ({note})" if note else ""))
    return value


def _priority(text: str) -> Priority:
    t = text.strip().upper()
    if t.startswith("P"):
        t = t[1:]
    if t.isdigit() and 0 <= int(t) <= 3:
        return Priority(int(t))
    raise ValueError(f"expected P0..P3 (or 0..3), got {text!r}")


def _int(text: str, low: int, high: int) -> int:
    t = text.strip()
    try:
        value = int(t)
    except ValueError:
        # "2.0" is an integer written as a float (spreadsheets do this)
        try:
            f = float(t)
        except ValueError:
            raise ValueError(f"expected an integer, got {text!r}") from None
        if not (math.isfinite(f) and f.is_integer()):
            raise ValueError(f"expected an integer, got {text!r}") from None
        value = int(f)
    if not low <= value <= high:
        raise ValueError(f"expected an integer in {low}..{high}, got {text!r}")
    return value


def _bool(text: str) -> bool | None:
    t = text.strip().lower()
    if not t:
        return None
    if t in _TRUE:
        return True
    if t in _FALSE:
        return False
    raise ValueError(f"expected true/false, got {text!r}")


def csv_records(lines: Iterable[str], source: str = "<csv>") -> Iterator[tuple[int, list[str]]]:
    """(line number, cells) for each non-blank, non-comment CSV record.

    The number is the file's line where the record starts: blank and ``#``
    lines between records are skipped but counted, and a quoted value that
    spans lines (its lines may be blank or start with ``#``) is one record.
    A CSV error (``csv.Error``) is a ``TraceFormatError`` naming the line.
    """
    at = {"between": True, "line": 0, "start": 0}

    def fed() -> Iterator[str]:
        for n, line in enumerate(lines, start=1):
            at["line"] = n
            if at["between"]:
                if not line.strip() or line.lstrip().startswith("#"):
                    continue
                at["between"] = False
                at["start"] = n
            yield line

    reader = csv.reader(fed())
    while True:
        at["between"] = True
        try:
            cells = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            raise TraceFormatError(source, at["line"] or None, None, f"not valid CSV: {exc}") from None
        yield at["start"], cells


def read_header(
    rows: Iterator[tuple[int, list[str]]], source: str, required: Sequence[str], optional: Sequence[str]
) -> list[str]:
    """The column names of a CSV's header row, checked: no unknown, repeated or
    missing column (``TraceFormatError`` names it and the line)."""
    try:
        header_line, header = next(rows)
    except StopIteration:
        raise TraceFormatError(source, None, None, "empty file: no header") from None
    names = [h.strip() for h in header]
    known = set(required) | set(optional)
    seen: set[str] = set()
    for name in names:
        if name not in known:
            raise TraceFormatError(
                source, header_line, name,
                f"unknown column; expected {', '.join(required)} and optionally {', '.join(optional)}",
            )
        if name in seen:
            raise TraceFormatError(source, header_line, name, "column appears twice")
        seen.add(name)
    for name in required:
        if name not in seen:
            raise TraceFormatError(source, header_line, name, "required column is missing")
    return names


def parse_trace(lines: Iterable[str], source: str = "<trace>") -> list[TraceTask]:
    """Parse trace CSV text (an iterable of lines) into tasks, in file order.

    Raises ``TraceFormatError`` naming the line and column of the first problem.
    """
    rows = csv_records(lines, source)
    names = read_header(rows, source, TRACE_COLUMNS, OPTIONAL_TRACE_COLUMNS)
    index = {name: i for i, name in enumerate(names)}
    tasks: list[TraceTask] = []
    first_line: dict[str, int] = {}
    for line, cells in rows:
        if len(cells) != len(names):
            raise TraceFormatError(
                source, line, None, f"expected {len(names)} fields, got {len(cells)}"
            )
        column = ""
        try:
            column = "task_id"
            task_id = cells[index["task_id"]].strip()
            if not task_id:
                raise ValueError("must not be empty")
            if len(task_id) > MAX_TASK_ID_LEN:
                raise ValueError(f"longer than {MAX_TASK_ID_LEN} characters")
            if not task_id.isprintable():
                raise ValueError("contains control characters")
            if task_id in first_line:
                raise ValueError(f"duplicate task_id {task_id!r} (first on line {first_line[task_id]})")
            column = "submit_s"
            submit = _float(cells[index["submit_s"]], column, low=0.0, most=MAX_TRACE_S, note=_TIME_NOTE)
            column = "duration_s"
            duration = _float(
                cells[index["duration_s"]], column, low=0.0, low_open=True, most=MAX_TRACE_S, note=_TIME_NOTE
            )
            column = "num_gpus"
            num_gpus = _int(cells[index["num_gpus"]], 1, MAX_GPUS)
            column = "vram_mib"
            vram = _float(cells[index["vram_mib"]], column, low=0.0, low_open=True)
            column = "gpu_share"
            share = _float(cells[index["gpu_share"]], column, low=0.0, high=1.0)
            column = "priority"
            priority = _priority(cells[index["priority"]])
            column = "kind"
            kind = cells[index["kind"]].strip()
            gpu_spec = tenant = ""
            util: float | None = None
            movable: bool | None = None
            if "gpu_spec" in index:
                column = "gpu_spec"
                gpu_spec = cells[index["gpu_spec"]].strip()
                if gpu_spec:
                    parse_gpu_spec(gpu_spec)
            if "tenant" in index:
                tenant = cells[index["tenant"]].strip()
            if "util" in index:
                column = "util"
                text = cells[index["util"]].strip()
                if text:
                    util = _float(text, column, low=0.0, high=100.0)
            if "movable" in index:
                column = "movable"
                movable = _bool(cells[index["movable"]])
            needs_nvlink = False
            if "needs_nvlink" in index:
                column = "needs_nvlink"
                needs_nvlink = bool(_bool(cells[index["needs_nvlink"]]))
            estimate: float | None = None
            if "estimate_s" in index:
                column = "estimate_s"
                text = cells[index["estimate_s"]].strip()
                if text:
                    estimate = _float(text, column, low=0.0, most=MAX_TRACE_S, note=_TIME_NOTE)
        except ValueError as exc:
            raise TraceFormatError(source, line, column, str(exc)) from None
        task = TraceTask(
            task_id=task_id,
            submit_s=submit,
            duration_s=duration,
            num_gpus=num_gpus,
            vram_mib=vram,
            gpu_share=share,
            priority=priority,
            kind=kind,
            gpu_spec=gpu_spec,
            tenant=tenant,
            util=util,
            movable=movable,
            needs_nvlink=needs_nvlink,
            estimate_s=estimate,
        )
        try:
            # the limits a submitted spec has (kind and tenant length, printable):
            # a row past them would pass here and fail in the replay
            task.to_spec().validate()
        except InvalidTask as exc:
            field_ = exc.field
            if field_ == "duration_s":  # the spec's duration is the client's estimate
                field_ = "estimate_s" if estimate is not None else "duration_s"
            raise TraceFormatError(source, line, field_ if field_ in index else None, exc.message) from None
        first_line[task_id] = line
        tasks.append(task)
    return tasks


def _not_utf8(path: str | os.PathLike[str]) -> TraceFormatError:
    """The error for a file that is not UTF-8: its line and the first bad byte."""
    line = None
    detail = ""
    try:
        data = Path(path).read_bytes()
        if data.startswith(codecs.BOM_UTF8):
            data = data[len(codecs.BOM_UTF8):]
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        detail = f" (byte 0x{data[exc.start]:02x})"
    except OSError:
        pass
    return TraceFormatError(
        str(path), line, None, f"not UTF-8 text{detail}; save the file as UTF-8 (e.g. \"CSV UTF-8\")"
    )


def read_csv_file(path: str | os.PathLike[str], parse):
    """``parse(file, source)`` on a CSV file opened as UTF-8 text (a leading
    byte-order mark skipped); a byte that is not UTF-8 is a ``TraceFormatError``
    naming the file and its line."""
    try:
        with open(path, newline="", encoding="utf-8-sig") as fh:
            return parse(fh, str(path))
    except UnicodeDecodeError:
        raise _not_utf8(path) from None


def read_trace(path: str | os.PathLike[str]) -> list[TraceTask]:
    """Read a trace CSV file (see the module docstring), in file order."""
    return read_csv_file(path, lambda fh, source: parse_trace(fh, source=source))


# ---- writing ------------------------------------------------------------------------------


def _num(value: float) -> str:
    """Shortest text that reads back as the same float; integers without '.0'."""
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


def write_trace(tasks: Sequence[TraceTask], out: str | os.PathLike[str] | IO[str]) -> None:
    """Write tasks as trace CSV; optional columns only when some task uses them."""
    optional = [
        name
        for name in OPTIONAL_TRACE_COLUMNS
        if any(
            (name == "gpu_spec" and t.gpu_spec)
            or (name == "tenant" and t.tenant)
            or (name == "util" and t.util is not None)
            or (name == "movable" and t.movable is not None)
            or (name == "needs_nvlink" and t.needs_nvlink)
            or (name == "estimate_s" and t.estimate_s is not None)
            for t in tasks
        )
    ]

    def emit(fh: IO[str]) -> None:
        writer = csv.writer(fh, lineterminator="\n")
        writer.writerow([*TRACE_COLUMNS, *optional])
        for t in tasks:
            row = [
                t.task_id,
                _num(t.submit_s),
                _num(t.duration_s),
                str(t.num_gpus),
                _num(t.vram_mib),
                _num(t.gpu_share),
                f"P{int(t.priority)}",
                t.kind,
            ]
            for name in optional:
                if name == "gpu_spec":
                    row.append(t.gpu_spec)
                elif name == "tenant":
                    row.append(t.tenant)
                elif name == "util":
                    row.append("" if t.util is None else _num(t.util))
                elif name == "movable":
                    row.append("" if t.movable is None else ("true" if t.movable else "false"))
                elif name == "needs_nvlink":
                    row.append("true" if t.needs_nvlink else "")
                else:
                    row.append("" if t.estimate_s is None else _num(t.estimate_s))
            writer.writerow(row)

    if isinstance(out, (str, os.PathLike)):
        with open(out, "w", newline="", encoding="utf-8") as fh:
            emit(fh)
    else:
        emit(out)


def scale_trace(
    tasks: Sequence[TraceTask], time_scale: float = 1.0, arrival_scale: float = 1.0
) -> list[TraceTask]:
    """Compress time: submit times divided by ``time_scale * arrival_scale``,
    durations by ``time_scale``.

    ``time_scale`` is a faster clock (the offered load stays the same; the
    scheduler's fixed constants, aging thresholds, the P0 SLA, telemetry
    delay, grow relative to the tasks). ``arrival_scale`` brings arrivals
    closer together with durations unchanged, multiplying the offered load.
    """
    for name, value in (("time_scale", time_scale), ("arrival_scale", arrival_scale)):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    if time_scale == 1.0 and arrival_scale == 1.0:
        return list(tasks)
    sub = time_scale * arrival_scale

    return [
        replace(
            t,
            submit_s=t.submit_s / sub,
            duration_s=t.duration_s / time_scale,
            estimate_s=None if t.estimate_s is None else t.estimate_s / time_scale,
        )
        for t in tasks
    ]


def misestimate(tasks: Sequence[TraceTask], scale: float = 1.0, noise: float = 0.0, seed: int = 0) -> list[TraceTask]:
    """The tasks as clients that misjudge run times would submit them: each
    task without an ``estimate_s`` gets ``duration_s * scale * exp(noise * z)``,
    ``z`` a standard normal drawn per task from ``seed`` (run times are
    misjudged by factors, so the error is log-normal; ``noise`` 1 puts a
    third of the estimates more than 2.7 times off). ``scale`` below 1 is
    clients that estimate short, the risk an estimate-trusting backfill
    runs. Tasks that carry their own estimate keep it. Deterministic for
    ``seed``."""
    for name, value in (("scale", scale), ("noise", noise)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"estimate {name} must be a finite number >= 0, got {value!r}")
    if scale == 1.0 and noise == 0.0:
        return list(tasks)
    rng = random.Random(seed)
    out = []
    for t in tasks:
        z = rng.gauss(0.0, 1.0)  # drawn for every task, so one task's estimate does not move the others'
        out.append(t if t.estimate_s is not None else replace(t, estimate_s=t.duration_s * scale * math.exp(noise * z)))
    return out


# ---- openb ------------------------------------------------------------------------------------


@dataclass(slots=True)
class ConversionStats:
    """What ``convert_openb`` did with the rows (see the module docstring)."""

    rows: int = 0
    written: int = 0
    skipped_cpu_only: int = 0
    skipped_pending: int = 0
    censored: int = 0  # Running at the trace end: duration is a lower bound
    synthesized_times: int = 0
    unknown_qos: int = 0
    by_priority: dict[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        prio = ", ".join(f"{k} {v}" for k, v in sorted(self.by_priority.items()))
        return (
            f"{self.rows} rows -> {self.written} tasks ({prio}); skipped: "
            f"{self.skipped_cpu_only} CPU-only, {self.skipped_pending} pending (never scheduled); "
            f"{self.censored} still running at the trace end (duration is a lower bound); "
            f"{self.synthesized_times} with times drawn from the reference list; "
            f"{self.unknown_qos} with an unknown qos (P2)"
        )


_OPENB_TIME_COLUMNS = ("qos", "pod_phase", "creation_time", "deletion_time", "scheduled_time")
_OPENB_BASE_COLUMNS = ("name", "num_gpu", "gpu_milli")


def _openb_read(path: str | os.PathLike[str]) -> tuple[list[str], list[dict[str, str]]]:
    def read(fh: IO[str], source: str) -> tuple[list[str], list[dict[str, str]]]:
        reader = csv.DictReader(fh)
        try:
            return list(reader.fieldnames or []), list(reader)
        except csv.Error as exc:
            raise TraceFormatError(source, reader.line_num or None, None, f"not valid CSV: {exc}") from None

    header, rows = read_csv_file(path, read)
    for name in _OPENB_BASE_COLUMNS:
        if name not in header:
            raise TraceFormatError(str(path), 1, name, "openb pod list column is missing")
    return header, rows


def _openb_float(row: dict[str, str], column: str, source: str, line: int) -> float:
    text = (row.get(column) or "").strip()
    try:
        value = float(text)
    except ValueError:
        raise TraceFormatError(source, line, column, f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise TraceFormatError(source, line, column, f"expected a finite number, got {text!r}")
    return value


def convert_openb_rows(
    rows: Sequence[dict[str, str]],
    *,
    source: str = "<openb>",
    reference: Sequence[dict[str, str]] | None = None,
    time_scale: float = 1.0,
    seed: int = 0,
) -> tuple[list[TraceTask], ConversionStats]:
    """Convert openb pod-list rows (dicts by column name) into trace tasks.

    ``reference`` supplies qos and times for rows that lack them (see the
    module docstring); it is required when the rows have no time columns.
    Line numbers in errors count the header as line 1.
    """
    if not (math.isfinite(time_scale) and time_scale > 0):
        raise ValueError(f"time_scale must be a finite number > 0, got {time_scale!r}")
    stats = ConversionStats(rows=len(rows))
    has_times = bool(rows) and all(c in rows[0] for c in _OPENB_TIME_COLUMNS)
    by_name: dict[str, dict[str, str]] = {}
    pool: dict[int, list[dict[str, str]]] = {}
    if not has_times and rows:
        if reference is None:
            raise TraceFormatError(
                source,
                1,
                "creation_time",
                "this pod list has no time columns; give a reference list with times "
                "(times_from=, e.g. openb_pod_list_default.csv)",
            )
        for ref in reference:
            by_name[ref["name"]] = ref
            if (ref.get("scheduled_time") or "").strip() and ref.get("num_gpu", "0") != "0":
                pool.setdefault(int(ref["num_gpu"]), []).append(ref)
    rng = random.Random(seed)
    all_scheduled = [r for group in pool.values() for r in group]

    # resolve times first: the trace end and the time origin need every row
    resolved: list[tuple[int, dict[str, str], dict[str, str]]] = []
    for i, row in enumerate(rows):
        line = i + 2
        timed = row
        if not has_times:
            timed = by_name.get(row["name"])
            if timed is None:
                num = int(_openb_float(row, "num_gpu", source, line))
                group = pool.get(num) or all_scheduled
                if not group:
                    raise TraceFormatError(source, line, "name", "no reference row to take times from")
                timed = group[rng.randrange(len(group))]
                stats.synthesized_times += 1
        resolved.append((line, row, timed))
    if not resolved:
        return [], stats
    origin = min(_openb_float(t, "creation_time", source, line) for line, _, t in resolved)
    trace_end = max(_openb_float(t, "deletion_time", source, line) for line, _, t in resolved)

    out: list[tuple[float, int, TraceTask]] = []
    for order, (line, row, timed) in enumerate(resolved):
        num_gpu = _openb_float(row, "num_gpu", source, line)
        if not num_gpu.is_integer() or num_gpu < 0 or num_gpu > MAX_GPUS:
            raise TraceFormatError(source, line, "num_gpu", f"expected an integer 0..{MAX_GPUS}")
        if num_gpu == 0:
            stats.skipped_cpu_only += 1
            continue
        scheduled = (timed.get("scheduled_time") or "").strip()
        if not scheduled:
            stats.skipped_pending += 1
            continue
        created = _openb_float(timed, "creation_time", source, line)
        start = _openb_float(timed, "scheduled_time", source, line)
        end = _openb_float(timed, "deletion_time", source, line)
        duration = end - start
        if duration <= 0:
            # a pod deleted the instant it was scheduled held nothing; keep it
            # at the smallest duration the format allows rather than drop it
            duration = 1.0
        if (timed.get("pod_phase") or "") == "Running" and end >= trace_end:
            stats.censored += 1
        milli = _openb_float(row, "gpu_milli", source, line)
        if not 0 < milli <= 1000:
            raise TraceFormatError(source, line, "gpu_milli", f"expected 1..1000, got {milli:g}")
        share = milli / 1000.0 if num_gpu == 1 else 1.0
        qos = (timed.get("qos") or "").strip()
        mapped = OPENB_QOS.get(qos)
        if mapped is None:
            stats.unknown_qos += 1
            mapped = (Priority.P2, "batch")
        priority, kind = mapped
        gpu_spec = (row.get("gpu_spec") or "").strip()
        submit_s, duration_s = (created - origin) / time_scale, duration / time_scale
        for column, value in (("creation_time", submit_s), ("deletion_time", duration_s)):
            # what the trace format (and so the simulator) takes: a time_scale
            # far below 1 must not write a trace that no reader accepts
            if not (0 < value <= MAX_TRACE_S or (value == 0 and column == "creation_time")):
                what = "submit time" if column == "creation_time" else "duration"
                raise TraceFormatError(
                    source, line, column,
                    f"{what} {value:g} s after time_scale {time_scale:g} is out of the trace format's "
                    f"range (0, {MAX_TRACE_S:g}] s",
                )
        task = TraceTask(
            task_id=row["name"],
            submit_s=submit_s,
            duration_s=duration_s,
            num_gpus=int(num_gpu),
            vram_mib=round(share * OPENB_VRAM_FRACTION * OPENB_REFERENCE_VRAM_MIB, 1),
            gpu_share=share,
            priority=priority,
            kind=kind,
            gpu_spec=gpu_spec,
        )
        key = f"P{int(priority)}"
        stats.by_priority[key] = stats.by_priority.get(key, 0) + 1
        out.append((task.submit_s, order, task))
    out.sort(key=lambda x: (x[0], x[1]))
    tasks = [t for _, _, t in out]
    stats.written = len(tasks)
    return tasks, stats


def convert_openb(
    pod_csv: str | os.PathLike[str],
    out_csv: str | os.PathLike[str] | IO[str] | None,
    *,
    time_scale: float = 1.0,
    times_from: str | os.PathLike[str] | None = None,
    seed: int = 0,
) -> tuple[list[TraceTask], ConversionStats]:
    """Convert an openb pod list file into a trace file (``None``: just return the tasks).

    ``times_from`` is the reference list for pod lists without time columns;
    by default ``openb_pod_list_default.csv`` in the same folder, if present.
    A ``times_from`` given that is not a file is an error (even for a list
    with its own times: it was asked for).
    """
    if times_from and not Path(times_from).is_file():
        raise TraceFormatError(str(times_from), None, None, "times_from: no such file (the reference pod list)")
    header, rows = _openb_read(pod_csv)
    reference = None
    if not all(c in header for c in _OPENB_TIME_COLUMNS):
        ref_path = Path(times_from) if times_from else Path(pod_csv).with_name("openb_pod_list_default.csv")
        if ref_path.exists():
            _, reference = _openb_read(ref_path)
    tasks, stats = convert_openb_rows(
        rows, source=str(pod_csv), reference=reference, time_scale=time_scale, seed=seed
    )
    if out_csv is not None:
        write_trace(tasks, out_csv)
    return tasks, stats


def trace_to_text(tasks: Sequence[TraceTask]) -> str:
    """The trace as CSV text (tests, small fixtures)."""
    buf = io.StringIO()
    write_trace(tasks, buf)
    return buf.getvalue()
