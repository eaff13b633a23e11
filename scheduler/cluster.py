"""Modelled clusters for the simulator: the cluster CSV format, the table of
known GPU models, the openb node-list converter and a homogeneous generator.

The format
==========

One CSV file, UTF-8 (a leading byte-order mark is skipped), one node a row,
with a header; blank lines and ``#`` lines are ignored.

================ ======== ======================================================
column           required meaning
================ ======== ======================================================
node_id          yes      unique node name
gpus             yes      GPUs on the node, 1..64
model            yes      a known model (``KNOWN_MODELS``: key, alias or full
                          name, case and punctuation ignored) or any name when
                          ``vram_mib_per_gpu`` is given
vram_mib_per_gpu no       MiB per GPU; empty = the model's
speed            no       relative speed (RTX 4090 = 1.0), 0.001..1000; empty =
                          the model's
nvlink           no       the node's NVLink: empty or ``none``; ``all`` (every
                          pair, an NVSwitch host); ``pairs`` (0-1, 2-3, ...:
                          bridged PCIe cards); or the linked pairs of GPU
                          indices, ``0-1;2-3;0-2``
================ ======== ======================================================

``read_cluster`` returns ``scheduler.snapshot.NodeFacts``, the model's full
(NVML-style) name in ``model`` so that ``gpu_spec`` constraints such as
``V100M16|V100M32`` or ``T4`` match as they would on real hardware, and
the NVLink pairs as an agent reports them, so a task that ``needs_nvlink``
(trace column) is placed on, and evicts for, linked GPUs only, as the
coordinator places it.

Known models
============

Memory is what NVML reports as total (MiB); speed is relative to an RTX 4090
for mixed-precision deep-learning work, rounded from public FP16 tensor
throughput and training benchmarks: a task of ``duration_s`` on a 1.0 GPU
takes ``duration_s / speed`` on another. G1, G2 and G3 are the openb trace's
undisclosed models; their figures are our guesses and say so:

* **G1** (not in the openb node list): 16 GiB, 0.35, a T4/P100-generation card.
* **G2** (4,392 of openb's 6,212 GPUs, 8 per node, 96 cores, 384 GiB host
  memory): 24 GiB, 0.5, an A10/A30-class inference-and-training card.
* **G3** (312 GPUs, 8 per node, 128 cores, 768 GiB: the shape of an
  A100 8-GPU server): 80 GiB, 1.2, A100-class.

K20c and M40 are old, small and slow on purpose: heterogeneity tests use them
to check that a policy does not treat every GPU alike.

The openb converter
===================

``convert_openb_nodes`` reads ``openb_node_list_gpu_node.csv``
(``sn, cpu_milli, memory_mib, gpu, model``) into this format: ``node_id`` is
``sn``; nodes with 0 GPUs are skipped. ``speed`` is written explicitly as the
model's table speed divided by the GPU-weighted mean table speed of the whole
node list (``normalize_speed``, on by default): openb's durations were measured
on that very mix of GPUs, so with the mean at 1.0 the trace's total work takes
as long in the modelled cluster as it did in the real one, while faster models
still finish sooner than slower ones.
"""

from __future__ import annotations

import csv
import os
import re
from dataclasses import dataclass
from typing import IO, Iterable, Sequence

from scheduler.snapshot import NodeFacts
from scheduler.traces import TraceFormatError, csv_records, read_csv_file, read_header

__all__ = [
    "GpuModel",
    "KNOWN_MODELS",
    "lookup_model",
    "CLUSTER_COLUMNS",
    "OPTIONAL_CLUSTER_COLUMNS",
    "ClusterNode",
    "parse_cluster",
    "read_cluster",
    "write_cluster",
    "node_facts",
    "nvlink_pairs",
    "nvlink_text",
    "homogeneous",
    "convert_openb_nodes",
]

CLUSTER_COLUMNS = ("node_id", "gpus", "model")
#: the speeds a cluster file may give: a task's run time is its duration over
#: its node's speed, and the simulator's runs must end well within its leases
MIN_SPEED, MAX_SPEED = 1e-3, 1e3
OPTIONAL_CLUSTER_COLUMNS = ("vram_mib_per_gpu", "speed", "nvlink")


@dataclass(frozen=True, slots=True)
class GpuModel:
    """A GPU model: the key used in cluster files, its NVML name, memory and speed."""

    key: str
    name: str  # as NVML reports it (what gpu_spec matches against)
    memory_mib: float
    speed: float  # relative to an RTX 4090
    aliases: tuple[str, ...] = ()


KNOWN_MODELS: dict[str, GpuModel] = {
    m.key: m
    for m in (
        GpuModel("RTX 4090", "NVIDIA GeForce RTX 4090", 24_564.0, 1.0, ("4090", "GeForce RTX 4090")),
        GpuModel("H100", "NVIDIA H100 80GB HBM3", 81_559.0, 2.2, ("H100 80GB", "H100M80")),
        # name and memory as NVML reported them on an H200 (driver 580.159);
        # the H100's compute with 1.4x its memory bandwidth, so a little
        # faster on the memory-bound half of the work: a prior, learned on
        GpuModel("H200", "NVIDIA H200", 143_771.0, 2.4, ("H200 141GB",)),
        GpuModel("A100 80GB", "NVIDIA A100-SXM4-80GB", 81_920.0, 1.3, ("A100", "A100M80")),
        GpuModel("A10", "NVIDIA A10", 23_028.0, 0.45, ()),
        GpuModel("V100M32", "Tesla V100-SXM2-32GB", 32_768.0, 0.55, ("V100 32GB",)),
        GpuModel("V100M16", "Tesla V100-SXM2-16GB", 16_160.0, 0.55, ("V100", "V100 16GB")),
        GpuModel("T4", "Tesla T4", 15_360.0, 0.2, ()),
        GpuModel("P100", "Tesla P100-PCIE-16GB", 16_280.0, 0.3, ("P100M16",)),
        GpuModel("G1", "G1", 16_384.0, 0.35, ()),
        GpuModel("G2", "G2", 24_576.0, 0.5, ()),
        GpuModel("G3", "G3", 81_920.0, 1.2, ()),
        GpuModel("K20c", "Tesla K20c", 4_800.0, 0.05, ("K20",)),
        GpuModel("M40", "Tesla M40 24GB", 24_472.0, 0.12, ("M40 24GB",)),
    )
}


def _norm(text: str) -> str:
    return re.sub(r"[^A-Z0-9]", "", text.upper())


_LOOKUP: dict[str, GpuModel] = {}
for _m in KNOWN_MODELS.values():
    for _name in (_m.key, _m.name, *_m.aliases):
        _LOOKUP.setdefault(_norm(_name), _m)


def lookup_model(text: str) -> GpuModel | None:
    """The known model named by a key, alias or full name (case, spaces and
    punctuation ignored), or None."""
    return _LOOKUP.get(_norm(text))


@dataclass(frozen=True, slots=True)
class ClusterNode:
    """One row of a cluster file, resolved: model name, memory and speed known."""

    node_id: str
    gpus: int
    model: str  # full name
    vram_mib_per_gpu: float
    speed: float
    model_key: str = ""  # the cluster file's model text
    nvlink_pairs: tuple[tuple[int, int], ...] = ()  # linked GPU index pairs, a < b

    def facts(self) -> NodeFacts:
        return NodeFacts(
            node_id=self.node_id,
            gpus=self.gpus,
            model=self.model,
            memory_total_mib=self.vram_mib_per_gpu,
            speed=self.speed,
            nvlink_pairs=self.nvlink_pairs,
        )


def nvlink_pairs(text: str, gpus: int) -> tuple[tuple[int, int], ...]:
    """The ``nvlink`` column of a node of ``gpus`` GPUs (module docstring) as
    sorted index pairs; ValueError says what is wrong."""
    t = text.strip().lower()
    if t in ("", "none"):
        return ()
    if t == "all":
        return tuple((a, b) for a in range(gpus) for b in range(a + 1, gpus))
    if t == "pairs":
        return tuple((a, a + 1) for a in range(0, gpus - 1, 2))
    pairs = set()
    for part in filter(None, (p.strip() for p in t.split(";"))):
        ends = part.split("-")
        if len(ends) != 2 or not all(e.strip().isdigit() for e in ends):
            raise ValueError(f"expected none, all, pairs or pairs of GPU indices like 0-1;2-3, got {part!r}")
        a, b = sorted(int(e) for e in ends)
        if a == b or b >= gpus:
            raise ValueError(f"{part!r}: expected two different GPU indices below {gpus}")
        pairs.add((a, b))
    return tuple(sorted(pairs))


def nvlink_text(pairs: Sequence[tuple[int, int]], gpus: int) -> str:
    """The shortest ``nvlink`` column text for ``pairs``."""
    kept = tuple(sorted(pairs))
    if not kept:
        return ""
    for word in ("all", "pairs"):
        if kept == nvlink_pairs(word, gpus):
            return word
    return ";".join(f"{a}-{b}" for a, b in kept)


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"expected a number, got {text!r}") from None
    if not (value > 0 and value < float("inf")):
        raise ValueError(f"expected a finite number > 0, got {text!r}")
    return value


def _speed(text: str) -> float:
    value = _positive(text)
    if not MIN_SPEED <= value <= MAX_SPEED:
        raise ValueError(f"expected a number in [{MIN_SPEED:g}, {MAX_SPEED:g}] (RTX 4090 = 1), got {text!r}")
    return value


def parse_cluster(lines: Iterable[str], source: str = "<cluster>") -> list[ClusterNode]:
    """Parse cluster CSV text into nodes; ``TraceFormatError`` names line and column."""
    rows = csv_records(lines, source)
    names = read_header(rows, source, CLUSTER_COLUMNS, OPTIONAL_CLUSTER_COLUMNS)
    index = {n: i for i, n in enumerate(names)}
    nodes: list[ClusterNode] = []
    first: dict[str, int] = {}
    for line, cells in rows:
        if len(cells) != len(names):
            raise TraceFormatError(source, line, None, f"expected {len(names)} fields, got {len(cells)}")
        column = ""
        try:
            column = "node_id"
            node_id = cells[index["node_id"]].strip()
            if not node_id or not node_id.isprintable():
                raise ValueError(f"expected a printable, non-empty name, got {node_id!r}")
            if node_id in first:
                raise ValueError(f"duplicate node_id {node_id!r} (first on line {first[node_id]})")
            column = "gpus"
            text = cells[index["gpus"]].strip()
            if not text.isdigit() or not 1 <= int(text) <= 64:
                raise ValueError(f"expected an integer 1..64, got {text!r}")
            gpus = int(text)
            column = "model"
            model_text = cells[index["model"]].strip()
            if not model_text:
                raise ValueError("must not be empty")
            model = lookup_model(model_text)
            vram_text = cells[index["vram_mib_per_gpu"]].strip() if "vram_mib_per_gpu" in index else ""
            speed_text = cells[index["speed"]].strip() if "speed" in index else ""
            if model is None and not vram_text:
                known_keys = ", ".join(KNOWN_MODELS)
                raise ValueError(
                    f"unknown model {model_text!r} and no vram_mib_per_gpu; known: {known_keys}"
                )
            column = "vram_mib_per_gpu"
            vram = _positive(vram_text) if vram_text else model.memory_mib  # type: ignore[union-attr]
            column = "speed"
            speed = _speed(speed_text) if speed_text else (model.speed if model else 1.0)
            column = "nvlink"
            links = nvlink_pairs(cells[index["nvlink"]], gpus) if "nvlink" in index else ()
        except ValueError as exc:
            raise TraceFormatError(source, line, column, str(exc)) from None
        first[node_id] = line
        nodes.append(
            ClusterNode(
                node_id=node_id,
                gpus=gpus,
                model=model.name if model else model_text,
                vram_mib_per_gpu=vram,
                speed=speed,
                model_key=model_text,
                nvlink_pairs=links,
            )
        )
    if not nodes:
        raise TraceFormatError(source, None, None, "no nodes")
    return nodes


def read_cluster(path: str | os.PathLike[str]) -> list[ClusterNode]:
    """Read a cluster CSV file (see the module docstring)."""
    return read_csv_file(path, lambda fh, source: parse_cluster(fh, source=source))


def node_facts(nodes: Sequence[ClusterNode]) -> list[NodeFacts]:
    """``NodeFacts`` for ``ClusterSnapshot.build`` / the simulator."""
    return [n.facts() for n in nodes]


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def write_cluster(nodes: Sequence[ClusterNode], out: str | os.PathLike[str] | IO[str]) -> None:
    """Write nodes with every column (model as the file's key when known;
    ``nvlink`` only when some node has it)."""
    linked = any(n.nvlink_pairs for n in nodes)

    def emit(fh: IO[str]) -> None:
        w = csv.writer(fh, lineterminator="\n")
        w.writerow([*CLUSTER_COLUMNS, *OPTIONAL_CLUSTER_COLUMNS[: 3 if linked else 2]])
        for n in nodes:
            row = [n.node_id, n.gpus, n.model_key or n.model, _num(n.vram_mib_per_gpu), _num(n.speed)]
            if linked:
                row.append(nvlink_text(n.nvlink_pairs, n.gpus))
            w.writerow(row)

    if isinstance(out, (str, os.PathLike)):
        with open(out, "w", newline="", encoding="utf-8") as fh:
            emit(fh)
    else:
        emit(out)


#: hosts in a generated cluster: ten times the largest cluster the benchmarks
#: replay; 1e8 wrote rows for minutes before a replay could begin
MAX_HOMOGENEOUS_HOSTS = 100_000


def homogeneous(
    hosts: int, gpus: int, model: str = "RTX 4090", prefix: str = "node", nvlink: str = ""
) -> list[ClusterNode]:
    """``hosts`` nodes of ``gpus`` GPUs of one known model (e.g. 8 x 4 RTX 4090),
    with the ``nvlink`` of the cluster format on each (e.g. ``all``)."""
    if not 1 <= hosts <= MAX_HOMOGENEOUS_HOSTS or not 1 <= gpus <= 64:
        raise ValueError(f"need 1..{MAX_HOMOGENEOUS_HOSTS:,} hosts and 1..64 GPUs per host, got {hosts} x {gpus}")
    m = lookup_model(model)
    if m is None:
        raise ValueError(f"unknown model {model!r}; known: {', '.join(KNOWN_MODELS)}")
    links = nvlink_pairs(nvlink, gpus)
    width = max(2, len(str(hosts - 1)))
    return [
        ClusterNode(f"{prefix}-{i:0{width}d}", gpus, m.name, m.memory_mib, m.speed, m.key, links)
        for i in range(hosts)
    ]


def convert_openb_nodes(
    node_csv: str | os.PathLike[str],
    out_csv: str | os.PathLike[str] | IO[str] | None = None,
    *,
    normalize_speed: bool = True,
) -> list[ClusterNode]:
    """The openb node list as cluster nodes (and a cluster file when ``out_csv``)."""
    source = str(node_csv)

    def read(fh: IO[str], source: str) -> list[dict[str, str]]:
        reader = csv.DictReader(fh)
        try:
            for col in ("sn", "gpu", "model"):
                if col not in (reader.fieldnames or []):
                    raise TraceFormatError(source, 1, col, "openb node list column is missing")
            return list(reader)
        except csv.Error as exc:
            raise TraceFormatError(source, reader.line_num or None, None, f"not valid CSV: {exc}") from None

    raw = read_csv_file(node_csv, read)
    nodes: list[ClusterNode] = []
    for i, row in enumerate(raw):
        line = i + 2
        text = (row["gpu"] or "").strip()
        if not text.isdigit():
            raise TraceFormatError(source, line, "gpu", f"expected an integer, got {text!r}")
        if int(text) == 0:
            continue
        m = lookup_model(row["model"] or "")
        if m is None:
            raise TraceFormatError(source, line, "model", f"unknown model {row['model']!r}")
        nodes.append(ClusterNode(row["sn"].strip(), int(text), m.name, m.memory_mib, m.speed, m.key))
    if normalize_speed and nodes:
        total = sum(n.gpus for n in nodes)
        mean = sum(n.gpus * n.speed for n in nodes) / total
        nodes = [
            ClusterNode(n.node_id, n.gpus, n.model, n.vram_mib_per_gpu, round(n.speed / mean, 4), n.model_key)
            for n in nodes
        ]
    if out_csv is not None:
        write_cluster(nodes, out_csv)
    return nodes
