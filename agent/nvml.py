"""The real GPU backend: reads every GPU of the host through NVML (pynvml).

NVML's structs and ``NVMLError`` stop here (STYLE.md #9): each read is a
call into the library followed by a small pure parser to our types, and each
error becomes a ``None`` field, a health value or ``BackendUnavailable``:

- ``NVML_ERROR_NOT_SUPPORTED``: the GPU does not have the field (consumer
  cards have no ECC; a MIG-enabled GPU has no utilisation). It stays
  ``None`` and is asked for again only once a minute (``REPROBE_S``) and
  after a re-init, so a GPU whose MIG mode is turned off gets its
  utilisation back.
- any other error on one read: those fields are ``None`` this round and the
  reason is in ``sample.errors[field]``.
- every read of a GPU failing, or its handle: health ``READ_FAILED``.
- a GPU whose reads have not returned ``read_timeout_s`` (2 s) into the
  round: health ``READ_FAILED`` with "nvml call timed out" in
  ``sample.errors["nvml"]``; the other GPUs report as usual. Each GPU is
  read by a long-lived daemon worker thread of its own (``nvml-gpuN``,
  started at its first call, handed each round's reads, told to stop by
  ``close``), and a GPU whose call is still stuck gets no new one (at most
  one call in flight per GPU; it stays ``READ_FAILED`` until the call
  returns, and its worker then takes the next round's reads). ``close``
  joins none of them, so a process whose NVML is wedged still stops
  promptly.
- NVML's re-init, the Xid drain and ``close``'s shutdown run on a worker of
  their own (``nvml-control``), MIG mode reads on the GPU's worker, all
  under the same deadline, so no NVML call can hang a round. A re-init that
  has not returned by then (``nvml_reinit_timed_out``) leaves the round
  to go on without it: the lost GPUs report ``LOST`` and the others
  ``READ_FAILED`` ("nvml call timed out: NVML's re-init ..."), since NVML
  was shut down for the re-init and no handle is valid until ``nvmlInit``
  returns; no read and no second re-init starts until it returns, and the
  first round after that applies it. An Xid drain that has not returned
  (``nvml_xid_drain_timed_out``) leaves the GPUs read as usual, each
  ``xid_last`` as it was; no drain or re-init starts until it returns, and
  the events it took are logged then.
- ``NVML_ERROR_GPU_IS_LOST``: health ``LOST``; the backend re-initialises
  NVML (``nvmlShutdown`` + ``nvmlInit``) with exponential backoff measured on
  the injected clock. It never sleeps: the other GPUs keep being sampled.
  The re-init finds each GPU by UUID; a GPU whose UUID NVML no longer lists
  stays ``LOST``, never re-opened by index (the index may now be another
  GPU's). When the set of GPUs NVML lists is not the one registered (a count
  that changed, a UUID not registered) ``sample`` raises
  ``InventoryChanged``: ``gpulb-agent`` exits 75 and a new process
  registers the GPUs as they are.
- NVML not loadable or no GPU at construction: ``BackendUnavailable``.

A GPU whose readings stop moving while it runs compute processes is reported
``FROZEN`` (see ``FrozenDetector``), so a driver that reports stale or zero
metrics after a reset is not taken for an idle GPU.

Xid errors (the driver's error reports: a page fault in a job, a double-bit
ECC error, a GPU fallen off the bus) arrive as NVML critical-error events,
drained without waiting at every round: each is logged with what it means,
and the GPU's ``xid_last`` reports the last code seen (0: none since the
agent started; absent where the GPU cannot deliver the events).
"""

from __future__ import annotations

import functools
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog

from agent.backend import (
    BackendError,
    BackendUnavailable,
    GpuInfo,
    GpuProcess,
    GpuSample,
    Health,
    InventoryChanged,
    TopologyLink,
)
from protos import telemetry_pb2 as pb

__all__ = [
    "NvmlBackend",
    "FrozenDetector",
    "bytes_to_mib",
    "parse_utilization",
    "parse_memory",
    "parse_processes",
    "parse_bus_id",
    "link_kind",
    "build_topology",
    "DEFAULT_FROZEN_AFTER",
    "READ_TIMEOUT_S",
    "REPROBE_S",
]

log = structlog.get_logger("gpulb.agent.nvml")

_MIB = 1024 * 1024
DEFAULT_FROZEN_AFTER = 15
#: events drained per round at most: a storm must not stall the sampling
_MAX_EVENTS_PER_ROUND = 64

#: Xid codes and what they mean, from NVIDIA's Xid catalogue (the ones an
#: operator of a GPU cluster meets most); "application" ones are a job's own
#: fault, the others point at the GPU, its memory or its link
XID_MEANINGS: dict[int, str] = {
    13: "graphics engine exception (application)",
    31: "GPU memory page fault (application)",
    43: "GPU stopped processing (application)",
    45: "preemptive cleanup after a fault",
    48: "double-bit ECC error: reset the GPU",
    61: "internal micro-controller breakpoint",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remap recorded",
    64: "ECC page retirement or row remap failed",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error: reset the GPU",
    119: "GSP RPC timeout",
    120: "GSP error",
}
#: what a control call that missed its deadline holds up (its log line)
_CONTROL_STUCK = {
    "reinit": "NVML's re-init has not returned: until it does the GPUs are not read (lost ones report lost, the "
              "others read_failed) and no second re-init starts; the first round after it returns applies it",
    "xid_drain": "taking Xid events has not returned: the GPUs are read as usual; no Xid events are taken and NVML "
                 "is not re-initialised until the call returns, and the events it took are logged then",
    "shutdown": "nvmlShutdown has not returned: NVML is released when the process exits",
}
_REINIT_BACKOFF_S = 1.0
_REINIT_BACKOFF_MAX_S = 60.0

#: How long a round waits for one GPU's reads, s. A healthy GPU takes about
#: 45 ms (two 20 ms PCIe throughput reads and a few fast calls), so 2 s is
#: some 40 times that: only a call that hangs (a wedged driver, a GPU in a
#: bad state) misses it. And it is a fifth of the 10 s heartbeat interval:
#: a round that waits this long still leaves the agent time to send its
#: heartbeat before its node is judged unreachable (10 s + 1 s). A
#: constant, not a share of the heartbeat interval, because the backend
#: does not know that interval (the coordinator sets it) and because a
#: deadline far below 2 s would turn a GPU that is merely slow to answer
#: under load into a READ_FAILED one.
READ_TIMEOUT_S = 2.0
#: How often a read that said NOT_SUPPORTED is asked again, s: MIG mode, for
#: one, can be turned off (and utilisation come back) without the agent
#: restarting; a consumer card's missing ECC costs one failing call a minute.
REPROBE_S = 60.0

BusKey = tuple[int, int, int, int]  # PCI domain, bus, device, function


# --- pure parsers: NVML values -> our types ----------------------------------


def bytes_to_mib(n: int) -> int:
    """Whole MiB in ``n`` bytes (rounded down, as nvidia-smi shows them)."""
    return int(n) // _MIB


def parse_utilization(u: Any) -> dict[str, int]:
    """``nvmlUtilization_t`` -> util fields (both already percent)."""
    return {"util_gpu_pct": int(u.gpu), "util_memory_pct": int(u.memory)}


def parse_memory(m: Any) -> dict[str, int]:
    """``nvmlMemory_t`` (bytes) -> memory fields (MiB)."""
    return {"memory_used_mib": bytes_to_mib(m.used), "memory_total_mib": bytes_to_mib(m.total)}


def parse_processes(procs: Iterable[Any]) -> tuple[GpuProcess, ...]:
    """Compute processes -> ``GpuProcess``es. NVML reports ``usedGpuMemory``
    as ``None`` where it cannot tell (Windows WDDM); that counts as 0 MiB,
    the process itself is still there."""
    return tuple(
        GpuProcess(pid=int(p.pid), used_memory_mib=0 if p.usedGpuMemory is None else bytes_to_mib(p.usedGpuMemory))
        for p in procs
    )


def _text(v: str | bytes) -> str:
    return v.decode("ascii", errors="replace") if isinstance(v, bytes) else str(v)


def parse_bus_id(bus_id: str | bytes) -> BusKey | None:
    """``"00000000:3B:00.0"`` (any domain width, any case, str or bytes) ->
    (domain, bus, device, function); ``None`` if it is not a PCI address.
    NVML writes the domain with 8 digits in some places and 4 in others, so
    addresses are compared as numbers, never as strings."""
    text = _text(bus_id).strip().rstrip("\x00")
    try:
        domain, bus, rest = text.split(":")
        device, function = rest.split(".")
        return int(domain, 16), int(bus, 16), int(device, 16), int(function, 16)
    except ValueError:
        return None


#: NVML_TOPOLOGY_* level -> telemetry LinkKind. INTERNAL is two GPUs on one
#: board, joined by the board's own PCIe switch.
_LEVEL_KIND = {
    0: pb.LINK_KIND_PCIE_SWITCH,  # NVML_TOPOLOGY_INTERNAL
    10: pb.LINK_KIND_PCIE_SWITCH,  # NVML_TOPOLOGY_SINGLE
    20: pb.LINK_KIND_PCIE_SWITCH,  # NVML_TOPOLOGY_MULTIPLE
    30: pb.LINK_KIND_PCIE_HOST,  # NVML_TOPOLOGY_HOSTBRIDGE
    40: pb.LINK_KIND_NUMA,  # NVML_TOPOLOGY_NODE
    50: pb.LINK_KIND_SYSTEM,  # NVML_TOPOLOGY_SYSTEM
}


def link_kind(level: int) -> int:
    """``nvmlDeviceGetTopologyCommonAncestor`` level -> ``LinkKind``."""
    return _LEVEL_KIND.get(int(level), pb.LINK_KIND_UNSPECIFIED)


def build_topology(
    indices: Iterable[int],
    levels: Mapping[tuple[int, int], int],
    direct_links: Mapping[tuple[int, int], int],
    switch_links: Mapping[int, int],
) -> list[TopologyLink]:
    """One ``TopologyLink`` per GPU pair (a < b) whose connection is known.

    ``levels``: pair -> NVML topology level. ``direct_links``: (from, to) ->
    active NVLinks GPU ``from`` sees to GPU ``to``; each link shows from both
    ends, and the larger count wins in case one end could not be read.
    ``switch_links``: GPU -> active NVLinks to NVSwitches; two GPUs on
    switches reach each other over NVLink, through the fewer of their links.
    """
    ordered = sorted(set(indices))
    out = []
    for i, a in enumerate(ordered):
        for b in ordered[i + 1 :]:
            count = max(direct_links.get((a, b), 0), direct_links.get((b, a), 0))
            if count == 0 and switch_links.get(a, 0) and switch_links.get(b, 0):
                count = min(switch_links[a], switch_links[b])
            if count > 0:
                out.append(TopologyLink(a, b, pb.LINK_KIND_NVLINK, count))
                continue
            level = levels.get((a, b), levels.get((b, a)))
            if level is not None:
                out.append(TopologyLink(a, b, link_kind(level), 0))
    return out


class FrozenDetector:
    """Tells a GPU whose metrics stopped moving from a GPU that is idle.

    A sample is suspect when the GPU runs compute processes and either its
    memory reads 0 MiB (a context alone holds memory, so this is impossible
    while processes run), or util is above 0 and (util.gpu, util.memory,
    memory used, power) is exactly the previous sample's. ``threshold``
    suspect samples of one unchanged reading in a row make it frozen, until a
    reading moves.

    Power is in the key because util alone does not jitter enough: on an
    H200 under a steady bf16 matrix-product load, nvidia-smi read the same
    util and memory 14 times in a row at 200 ms (one short of the default
    threshold) while the power draw (mW) never held for more than two
    readings. A driver that serves stale counters freezes power with them.

    Identical readings at util 0 are not suspect: that is an inference
    server waiting for requests, holding its memory, and it is idle.
    """

    def __init__(self, threshold: int = DEFAULT_FROZEN_AFTER) -> None:
        if threshold < 1:
            raise ValueError("threshold must be >= 1")
        self.threshold = threshold
        self._key: tuple[int, ...] | None = None
        self._run = 0

    def reset(self) -> None:
        self._key, self._run = None, 0

    def update(
        self,
        util_gpu_pct: int | None,
        util_memory_pct: int | None,
        memory_used_mib: int | None,
        process_count: int | None,
        power_mw: int | None = None,
    ) -> bool:
        """Feed one sample; True while the GPU counts as frozen."""
        if (
            not process_count
            or util_gpu_pct is None
            or util_memory_pct is None
            or memory_used_mib is None
            or (memory_used_mib > 0 and util_gpu_pct == 0)
        ):
            self.reset()
            return False
        # All zero-memory readings are one key: the counters are gone.
        key = (-1,) if memory_used_mib == 0 else (util_gpu_pct, util_memory_pct, memory_used_mib, power_mw)
        if key == self._key:
            self._run += 1
        else:
            self._key, self._run = key, 1
        return self._run >= self.threshold


# --- the reads ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Read:
    """One NVML call per sample and how its answer becomes sample fields."""

    name: str
    fields: tuple[str, ...]
    call: Callable[[Any, Any], Any]  # (nvml, handle) -> raw value
    parse: Callable[[Any], dict[str, Any]]


def _one(name: str) -> Callable[[Any], dict[str, Any]]:
    return lambda v: {name: int(v)}


def _procs(v: Any) -> dict[str, Any]:
    procs = parse_processes(v)
    return {"processes": procs, "process_count": len(procs)}


_READS: tuple[_Read, ...] = (
    _Read(
        "utilization",
        ("util_gpu_pct", "util_memory_pct"),
        lambda nv, h: nv.nvmlDeviceGetUtilizationRates(h),
        parse_utilization,
    ),
    # v1 on purpose: its "used" includes the driver's reservation (615 MiB
    # on an H200, driver 580), which nvidia-smi leaves out but no task can
    # allocate, so total - used is what a placement can really have.
    _Read(
        "memory",
        ("memory_used_mib", "memory_total_mib"),
        lambda nv, h: nv.nvmlDeviceGetMemoryInfo(h),
        parse_memory,
    ),
    _Read(
        "temperature",
        ("temperature_c",),
        lambda nv, h: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU),
        _one("temperature_c"),
    ),
    _Read("power", ("power_mw",), lambda nv, h: nv.nvmlDeviceGetPowerUsage(h), _one("power_mw")),
    _Read(
        "power_limit",
        ("power_limit_mw",),
        lambda nv, h: nv.nvmlDeviceGetEnforcedPowerLimit(h),
        _one("power_limit_mw"),
    ),
    _Read(
        "sm_clock",
        ("sm_clock_mhz",),
        lambda nv, h: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
        _one("sm_clock_mhz"),
    ),
    _Read(
        "pcie_rx",
        ("pcie_rx_kbps",),
        lambda nv, h: nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_RX_BYTES),
        _one("pcie_rx_kbps"),
    ),
    _Read(
        "pcie_tx",
        ("pcie_tx_kbps",),
        lambda nv, h: nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_TX_BYTES),
        _one("pcie_tx_kbps"),
    ),
    _Read(
        "ecc_corrected",
        ("ecc_corrected",),
        lambda nv, h: nv.nvmlDeviceGetTotalEccErrors(h, nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_VOLATILE_ECC),
        _one("ecc_corrected"),
    ),
    _Read(
        "ecc_uncorrected",
        ("ecc_uncorrected",),
        lambda nv, h: nv.nvmlDeviceGetTotalEccErrors(h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC),
        _one("ecc_uncorrected"),
    ),
    _Read(
        "processes",
        ("processes", "process_count"),
        lambda nv, h: nv.nvmlDeviceGetComputeRunningProcesses(h),
        _procs,
    ),
)

#: What a struct of unexpected shape raises while being parsed: a field
#: error, like an NVML error, never a crash of the whole sample.
_PARSE_ERRORS = (AttributeError, TypeError, ValueError, OverflowError)


class _Job:
    """One piece of NVML work handed to a worker thread: a GPU's reads for a
    round, its MIG mode, a re-init, an Xid drain. The worker only calls
    NVML: what it found is applied to the backend's state on the sampling
    thread, by the round that waits for it or, once it comes back after its
    round gave up on it, by the next one (a GPU's reads are then dropped)."""

    __slots__ = ("kind", "fn", "done", "result", "error", "call", "started", "stuck_on")

    def __init__(self, kind: str, fn: Callable[[_Job], Any], call: str) -> None:
        self.kind = kind
        self.fn: Callable[[_Job], Any] | None = fn
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.call = call  # the NVML call in progress: what a timeout names
        self.started = time.monotonic()
        self.stuck_on = ""  # the call it was in when its round gave up on it

    def run(self) -> None:
        fn, self.fn = self.fn, None  # an idle worker keeps no backend alive
        try:
            assert fn is not None, "a job runs once"
            self.result = fn(self)
        except BaseException as exc:  # handed to the sampling thread, which raises it
            self.error = exc
        finally:
            self.done.set()


def _serve(jobs: queue.SimpleQueue[_Job | None]) -> None:
    """A worker thread's loop: each job handed to it, one at a time, until
    told to stop (``None``). It holds its queue, never the backend."""
    while True:
        job = jobs.get()
        if job is None:
            return
        job.run()
        job = None  # not kept while waiting for the next one


class _Worker:
    """A long-lived daemon thread and its job queue, the thread started at
    the first job. A worker stuck in NVML is handed nothing (the backend
    checks first): it takes the next job once its call returns. ``stop``
    asks it to end after what it is doing; nobody joins it."""

    __slots__ = ("name", "jobs", "thread")

    def __init__(self, name: str) -> None:
        self.name = name
        self.jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.thread: threading.Thread | None = None

    def submit(self, job: _Job) -> None:
        if self.thread is None or not self.thread.is_alive():  # first job, or the thread died
            self.thread = threading.Thread(target=_serve, args=(self.jobs,), name=self.name, daemon=True)
            self.thread.start()
        self.jobs.put(job)

    def stop(self) -> None:
        self.jobs.put(None)


def _stop_workers(workers: dict[int | str, _Worker]) -> None:
    for worker in workers.values():
        worker.stop()


@dataclass(slots=True)
class _Reinit:
    """What a re-init found in NVML; applied on the sampling thread."""

    #: why ``nvmlInit`` failed (None: it succeeded)
    error: str | None = None
    #: how many GPUs NVML lists (None: it could not say)
    count: int | None = None
    #: (index, UUID) of every GPU NVML lists that could be read
    listed: list[tuple[int, str]] = field(default_factory=list)
    #: registered GPU index -> its new handle, found by UUID
    handles: dict[int, Any] = field(default_factory=dict)
    #: the new Xid event set (None: none) and the GPU indices it watches
    events: Any = None
    watched: frozenset[int] = frozenset()


@dataclass(slots=True)
class _Result:
    """What one GPU's reads found; applied on the sampling thread."""

    sample: GpuSample
    handle: Any | None
    read_s: dict[str, float]
    #: reads that said NOT_SUPPORTED this time
    unsupported: set[str] = field(default_factory=set)
    #: every read attempted failed
    all_failed: bool = False
    #: why the GPU is lost (GPU_IS_LOST, or another GPU at its index)
    lost: str | None = None
    #: the GPU at this index is not the one registered there
    changed: str | None = None


@dataclass(slots=True)
class _Gpu:
    index: int
    uuid: str
    handle: Any | None
    unsupported: set[str] = field(default_factory=set)
    #: when the unsupported reads are asked again (injected clock)
    reprobe_at: float | None = None
    lost: bool = False
    #: the call in flight on the GPU's worker (threaded backends), or None
    job: _Job | None = None
    frozen: FrozenDetector = field(default_factory=FrozenDetector)
    #: seconds each read took in the last round (``gpulb-agent --check``)
    read_s: dict[str, float] = field(default_factory=dict)
    #: Xid events registered for this GPU; the last code seen (0: none)
    xid_watched: bool = False
    xid_last: int = 0


#: what the agent and ``gpulb-agent --check`` say of a GPU in MIG mode
MIG_WARNING = (
    "MIG mode is enabled: gpulb schedules whole GPUs, not MIG instances, and NVML does not "
    "report this GPU's utilisation under MIG (util_gpu_pct not reported; the scheduler scores the GPU as fully "
    "busy); its memory, power and temperature are still reported. To schedule it with gpulb, turn MIG "
    "off (nvidia-smi -i INDEX -mig 0, then reset the GPU): the agent reads its utilisation again within a minute"
)


class NvmlBackend:
    """Every GPU of the host through NVML. See the module docstring.

    ``nvml`` is the pynvml module or anything shaped like it
    (``agent.fake_nvml.FakeNvml`` in tests). ``clock`` times the re-init
    backoff. ``frozen_after`` is how many unchanged samples with running
    processes make a GPU ``FROZEN``.

    Each GPU is read by a daemon worker thread of its own (NVML is
    thread-safe), so the GPUs are read in parallel and a round waits at most
    ``read_timeout_s`` for any of them (see the module docstring). Each PCIe
    throughput read blocks for the 20 ms over which the driver counts bytes,
    so one GPU costs ~45 ms a round: read one after another, an 8-GPU host
    would take longer than the 200 ms fast period. The workers live as long
    as the backend: a thread started per GPU and round cost ~70 µs each.
    ``parallel=False`` makes every NVML call on the caller's thread one
    after another instead, without a deadline (a hung call then hangs the
    round): for comparisons and tests.
    """

    name = "nvml"

    def __init__(
        self,
        nvml: Any = None,
        clock: Callable[[], float] = time.monotonic,
        frozen_after: int = DEFAULT_FROZEN_AFTER,
        reinit_backoff_s: float = _REINIT_BACKOFF_S,
        reinit_backoff_max_s: float = _REINIT_BACKOFF_MAX_S,
        parallel: bool | None = None,
        read_timeout_s: float = READ_TIMEOUT_S,
    ) -> None:
        if nvml is None:
            try:
                import pynvml as nvml
            except ImportError as exc:  # pragma: no cover - a declared dependency
                raise BackendUnavailable(f"pynvml is not installed: {exc}") from exc
        if not 0 < reinit_backoff_s <= reinit_backoff_max_s:
            raise ValueError("need 0 < reinit_backoff_s <= reinit_backoff_max_s")
        if not 0 < read_timeout_s < float("inf"):
            raise ValueError("need 0 < read_timeout_s < inf")
        self._nv = nvml
        self._err: type[Exception] = nvml.NVMLError
        self._clock = clock
        self._frozen_after = frozen_after
        self._backoff_base = reinit_backoff_s
        self._backoff_max = reinit_backoff_max_s
        self._backoff = reinit_backoff_s
        self._reinit_at: float | None = None
        self._closed = False
        self._read_timeout = float(read_timeout_s)
        self._threaded = parallel is None or bool(parallel)
        #: one round at a time, and close() not in the middle of one
        self._lock = threading.Lock()
        #: why the GPUs are no longer the registered ones; sample() raises
        self._changed: str | None = None
        #: GPU index (its reads, its MIG mode) or "control" (re-init, Xid
        #: drain, shutdown) -> its worker thread, started at its first job;
        #: stopped by close(), or when the backend is dropped without it
        self._workers: dict[int | str, _Worker] = {}
        self._end_workers = weakref.finalize(self, _stop_workers, self._workers)
        #: the re-init, Xid drain or shutdown in flight on the control worker
        #: (threaded backends), or None; at most one at a time
        self._control_job: _Job | None = None
        self._events: Any = None

        try:
            nvml.nvmlInit()
        except (self._err, OSError) as exc:
            raise BackendUnavailable(f"NVML did not initialise: {exc}") from exc
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except self._err as exc:
            self._shutdown()
            raise BackendUnavailable(f"NVML cannot count GPUs: {exc}") from exc
        if count < 1:
            self._shutdown()
            raise BackendUnavailable("NVML sees no GPU")

        self.driver_version = self._read_driver_version()
        self._gpus: list[_Gpu] = []
        self._inventory: list[GpuInfo] = []
        for index in range(count):
            gpu, info = self._discover(index)
            self._gpus.append(gpu)
            self._inventory.append(info)
        self._topology = self._read_topology()
        self._watch(*self._register_xids({gpu.index: gpu.handle for gpu in self._gpus}))
        for index, enabled in self.mig_modes().items():
            if enabled:
                log.warning("gpu_mig_enabled", gpu=index, uuid=self._gpus[index].uuid,
                            detail=MIG_WARNING.replace("INDEX", str(index)))

    def _read_driver_version(self) -> str:
        """"580.159.04, CUDA 13.0": what an operator compares first when a
        field is missing or a setting (W^X, say) misbehaves on one host; the
        parts this library or driver cannot tell are left out ("" if none)."""
        nv, parts = self._nv, []
        try:
            version = nv.nvmlSystemGetDriverVersion()
            parts.append(version.decode() if isinstance(version, bytes) else str(version))
        except (self._err, AttributeError):
            pass
        try:
            cuda = int(nv.nvmlSystemGetCudaDriverVersion_v2())  # 13000 is CUDA 13.0
            parts.append(f"CUDA {cuda // 1000}.{cuda % 1000 // 10}")
        except (self._err, AttributeError, TypeError, ValueError):
            pass
        return ", ".join(parts)

    # --- the GpuBackend seam --------------------------------------------------

    def inventory(self) -> list[GpuInfo]:
        return list(self._inventory)

    def topology(self) -> list[TopologyLink]:
        return list(self._topology)

    def sample(self) -> list[GpuSample]:
        """A reading of every GPU, within ``read_timeout_s`` or so (twice
        that in a round that re-initialises NVML). Raises
        ``InventoryChanged`` once NVML lists other GPUs than the registered
        ones (and at every call after)."""
        with self._lock:
            if self._closed:
                raise BackendError("NVML backend is closed")
            if self._changed is not None:
                raise InventoryChanged(self._changed)
            now = self._clock()
            reinit_done = self._collect_control()
            if (self._reinit_at is not None and now >= self._reinit_at and self._control_job is None
                    and not self._stuck()):
                # (while a call is stuck in NVML the re-init waits: shutting
                # NVML down under a call in flight is not defined)
                self._reinit_at = None
                job = self._start_reinit()
                reinit_done = self._finish_control(job, time.monotonic() + self._read_timeout) or reinit_done
            self._raise_if_changed()
            reinit = self._control_job if self._control_job is not None and self._control_job.kind == "reinit" else None
            if reinit is not None:
                # NVML is down for the re-init: no handle is valid and no
                # call is defined until nvmlInit returns
                samples = [self._lost_sample(gpu) if gpu.lost else self._reinit_pending(gpu, reinit)
                           for gpu in self._gpus]
            else:
                samples = self._read_all(now)
            self._raise_if_changed()
            if reinit is not None:
                pass  # the next one is scheduled once this one is applied
            elif any(gpu.lost for gpu in self._gpus):
                if self._reinit_at is None:
                    if reinit_done:
                        # The last re-init did not bring it back: wait longer.
                        self._backoff = min(self._backoff_max, self._backoff * 2)
                    self._reinit_at = now + self._backoff
            elif reinit_done:
                self._backoff = self._backoff_base
            return samples

    def close(self) -> None:
        """Release NVML and tell the worker threads to end. Joins none of
        them: one stuck in NVML is a daemon thread left to the process exit,
        and NVML is then left initialised (shutting it down under the stuck
        call could hang as well); so is it if the shutdown itself hangs."""
        if self._closed:
            return
        self._closed = True
        # A round in progress ends by its deadline (on a serial backend it
        # may not): wait that long, not for ever.
        locked = self._lock.acquire(timeout=self._read_timeout + 1.0)
        try:
            if locked:
                self._collect_control()  # a late re-init's event set is freed below
            stuck = self._stuck()
            control = self._control_job
            if stuck or control is not None or not locked:
                log.warning("nvml_left_initialised", gpus_stuck=stuck, round_in_progress=not locked,
                            **({"call_stuck": f"{control.kind}: {control.call}"} if control is not None else {}),
                            detail="an NVML call has not returned; NVML is released when the process exits")
                return
            events = self._take_events()
            self._finish_control(self._start_control("shutdown", self._release_nvml, events, call="nvmlEventSetFree"),
                                 time.monotonic() + self._read_timeout)
        finally:
            if locked:
                self._end_workers()
                self._lock.release()

    @property
    def parallel(self) -> bool:
        """Whether a round reads the GPUs concurrently."""
        return self._threaded and len(self._gpus) > 1

    @property
    def read_timeout_s(self) -> float:
        """How long a round waits for one GPU's reads (threaded backends)."""
        return self._read_timeout

    def mig_modes(self) -> dict[int, bool | None]:
        """Per GPU index: whether its MIG mode is enabled now (None: the GPU,
        driver or library cannot say, as on a GPU without MIG, or it did
        not answer within ``read_timeout_s``). Each GPU is asked on its
        worker, as its reads are: one whose call is still stuck is not
        asked again."""
        out: dict[int, bool | None] = {gpu.index: None for gpu in self._gpus}
        with self._lock:
            if self._closed:
                return out
            waiting: list[tuple[_Gpu, _Job]] = []
            for gpu in self._gpus:
                # (a GPU's handle is None while NVML is re-initialised, too)
                if gpu.handle is None or gpu.lost or not self._idle(gpu):
                    continue
                job = _Job("mig_mode", functools.partial(self._read_mig_mode, gpu.handle), "mig_mode")
                gpu.job = job
                self._dispatch(gpu.index, job)
                waiting.append((gpu, job))
            deadline = time.monotonic() + self._read_timeout
            for gpu, job in waiting:
                if not job.done.wait(max(0.0, deadline - time.monotonic())):
                    self._note_timeout(gpu, job)
                    continue
                gpu.job = None
                if job.error is not None:
                    raise job.error
                out[gpu.index] = job.result
        return out

    def _read_mig_mode(self, handle: Any, job: _Job) -> bool | None:
        nv = self._nv
        try:
            current, _pending = nv.nvmlDeviceGetMigMode(handle)
            return int(current) == int(nv.NVML_DEVICE_MIG_ENABLE)
        except (self._err, *_PARSE_ERRORS):
            return None

    def read_seconds(self) -> dict[int, dict[str, float]]:
        """Per GPU index: how long each NVML read took in the last round, s
        (reads a GPU does not support are left out)."""
        return {gpu.index: dict(gpu.read_s) for gpu in self._gpus}

    # --- the workers -------------------------------------------------------------

    def _dispatch(self, key: int | str, job: _Job) -> None:
        """``job`` to the worker of GPU ``key`` (or "control"); on a serial
        backend it runs here and now."""
        if not self._threaded:
            job.run()
            return
        worker = self._workers.get(key)
        if worker is None:
            worker = self._workers[key] = _Worker(f"nvml-gpu{key}" if isinstance(key, int) else f"nvml-{key}")
        worker.submit(job)

    def _idle(self, gpu: _Gpu) -> bool:
        """Whether the GPU's worker may be handed a job: none of its calls is
        still in NVML. A job that came back after its round gave up on it is
        dropped here."""
        job = gpu.job
        if job is None:
            return True
        if not job.done.is_set():
            return False
        gpu.job = None
        log.info("nvml_call_returned", gpu=gpu.index, read=job.stuck_on,
                 after_s=round(time.monotonic() - job.started, 1))
        return True

    def _start_control(self, kind: str, fn: Callable[..., Any], *args: Any, call: str) -> _Job:
        job = _Job(kind, functools.partial(fn, *args), call)
        self._control_job = job
        self._dispatch("control", job)
        return job

    def _finish_control(self, job: _Job, deadline: float) -> bool:
        """Wait for the control job until ``deadline``, then apply what it
        found; True if that was a re-init. One that has not returned stays
        in flight (logged once): the next round that finds it done applies it."""
        if not job.done.wait(max(0.0, deadline - time.monotonic())):
            if not job.stuck_on:
                job.stuck_on = job.call
                log.warning(f"nvml_{job.kind}_timed_out", gpu=None, call=job.call, timeout_s=self._read_timeout,
                            detail=_CONTROL_STUCK[job.kind])
            return False
        self._control_job = None
        if job.error is not None:
            raise job.error
        if job.kind == "reinit":
            self._apply_reinit(job.result)
            return True
        if job.kind == "xid_drain":
            self._apply_xids(job.result)
        return False

    def _collect_control(self) -> bool:
        """Apply a control job that came back after its round gave up on it;
        True if that was a re-init."""
        job = self._control_job
        if job is None or not job.done.is_set():
            return False
        log.info("nvml_call_returned", gpu=None, task=job.kind, read=job.stuck_on,
                 after_s=round(time.monotonic() - job.started, 1))
        return self._finish_control(job, 0.0)

    # --- Xid events ------------------------------------------------------------

    def _register_xids(self, handles: Mapping[int, Any]) -> tuple[Any, frozenset[int]]:
        """A new event set with every GPU of ``handles`` that can registered
        for critical-error (Xid) events, and those GPUs' indices; (None,
        none) if none can. Calls NVML only: see ``_watch``."""
        nv = self._nv
        try:
            events = nv.nvmlEventSetCreate()
        except (self._err, AttributeError):
            return None, frozenset()  # no event support in this driver or library
        watched: set[int] = set()
        for index, handle in handles.items():
            if handle is None:
                continue
            try:
                nv.nvmlDeviceRegisterEvents(handle, nv.nvmlEventTypeXidCriticalError, events)
            except self._err as exc:
                if self._code(exc) == nv.NVML_ERROR_UNKNOWN:
                    watched.clear()  # NVML: the set is then in an undefined state; free it
                    break
                continue  # NOT_SUPPORTED on this GPU: its xid_last stays absent
            watched.add(index)
        if watched:
            return events, frozenset(watched)
        try:
            nv.nvmlEventSetFree(events)
        except self._err:
            pass
        return None, frozenset()

    def _watch(self, events: Any, watched: frozenset[int]) -> None:
        self._events = events
        for gpu in self._gpus:
            gpu.xid_watched = gpu.index in watched

    def _take_events(self) -> Any:
        """The event set, no longer this backend's (its GPUs unwatched): for
        the caller to free."""
        events, self._events = self._events, None
        for gpu in self._gpus:
            gpu.xid_watched = False
        return events

    def _free_events(self, events: Any) -> None:
        if events is not None:
            try:
                self._nv.nvmlEventSetFree(events)
            except self._err:
                pass  # gone with the session already

    def _drain_xids(self, events: Any, job: _Job) -> list[tuple[str, int]]:
        """(UUID, Xid code) of every pending Xid event, taken without
        waiting. Calls NVML only: ``_apply_xids`` logs them."""
        nv, found = self._nv, []
        for _ in range(_MAX_EVENTS_PER_ROUND):
            try:
                data = nv.nvmlEventSetWait_v2(events, 0)
            except self._err:
                break  # TIMEOUT: none pending (any other error: next round)
            try:
                code = int(data.eventData)
            except _PARSE_ERRORS:
                continue
            try:
                uuid = _text(nv.nvmlDeviceGetUUID(data.device))
            except (self._err, *_PARSE_ERRORS):
                uuid = ""
            found.append((uuid, code))
        return found

    def _apply_xids(self, found: list[tuple[str, int]]) -> None:
        for uuid, code in found:
            gpu = next((g for g in self._gpus if g.uuid and g.uuid == uuid), None)
            if gpu is not None:
                gpu.xid_last = code
            log.warning(
                "gpu_xid",
                gpu=gpu.index if gpu is not None else None,
                uuid=uuid,
                xid=code,
                meaning=XID_MEANINGS.get(code, "see NVIDIA's Xid catalogue"),
            )

    # --- start ------------------------------------------------------------------

    def _code(self, exc: Exception) -> int | None:
        return getattr(exc, "value", None)

    def _shutdown(self) -> None:
        try:
            self._nv.nvmlShutdown()
        except self._err:
            pass  # already down; nothing to release

    def _discover(self, index: int) -> tuple[_Gpu, GpuInfo]:
        """Static facts of one GPU. A GPU that cannot be read now is still
        listed (as "unknown") so it keeps its index and reports READ_FAILED
        rather than vanishing."""
        nv = self._nv
        gpu = _Gpu(index=index, uuid="", handle=None, frozen=FrozenDetector(self._frozen_after))
        try:
            gpu.handle = nv.nvmlDeviceGetHandleByIndex(index)
        except self._err:
            return gpu, GpuInfo(index=index, uuid="", model="unknown", memory_total_mib=0)

        def get(fn: Callable[[], Any], default: Any) -> Any:
            try:
                return fn()
            except (self._err, *_PARSE_ERRORS):
                return default

        h = gpu.handle
        gpu.uuid = get(lambda: _text(nv.nvmlDeviceGetUUID(h)), "")
        info = GpuInfo(
            index=index,
            uuid=gpu.uuid,
            model=get(lambda: _text(nv.nvmlDeviceGetName(h)), "unknown"),
            memory_total_mib=get(lambda: bytes_to_mib(nv.nvmlDeviceGetMemoryInfo(h).total), 0),
            power_limit_mw=get(lambda: int(nv.nvmlDeviceGetEnforcedPowerLimit(h)), None),
            pci_bus_id=get(lambda: _text(nv.nvmlDeviceGetPciInfo(h).busId).rstrip("\x00"), ""),
            memory_reserved_mib=get(lambda: bytes_to_mib(nv.nvmlDeviceGetMemoryInfo(h, version=nv.nvmlMemory_v2).reserved), None),
        )
        return gpu, info

    def _read_topology(self) -> list[TopologyLink]:
        """Common PCIe ancestor of every pair, and NVLink peers per port."""
        nv, err = self._nv, self._err
        handles = {g.index: g.handle for g in self._gpus if g.handle is not None}
        levels: dict[tuple[int, int], int] = {}
        ordered = sorted(handles)
        for i, a in enumerate(ordered):
            for b in ordered[i + 1 :]:
                try:
                    levels[(a, b)] = int(nv.nvmlDeviceGetTopologyCommonAncestor(handles[a], handles[b]))
                except err:
                    continue  # unknown link: left out rather than guessed
        by_bus = {
            key: info.index for info in self._inventory if (key := parse_bus_id(info.pci_bus_id)) is not None
        }
        direct: dict[tuple[int, int], int] = {}
        switch: dict[int, int] = {}
        for a, h in handles.items():
            for link in range(int(nv.NVML_NVLINK_MAX_LINKS)):
                try:
                    active = nv.nvmlDeviceGetNvLinkState(h, link) == nv.NVML_FEATURE_ENABLED
                except err as exc:
                    if self._code(exc) in (nv.NVML_ERROR_NOT_SUPPORTED, nv.NVML_ERROR_INVALID_ARGUMENT):
                        break  # no NVLink, or past the GPU's last port
                    continue
                if not active:
                    continue
                try:
                    peer = by_bus.get(parse_bus_id(nv.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId))
                except (err, *_PARSE_ERRORS):
                    continue
                if peer is not None and peer != a:
                    direct[(a, peer)] = direct.get((a, peer), 0) + 1
                    continue
                try:
                    remote = nv.nvmlDeviceGetNvLinkRemoteDeviceType(h, link)
                except (err, AttributeError):
                    continue  # older drivers cannot say; the link stays unmapped
                if remote == nv.NVML_NVLINK_DEVICE_TYPE_SWITCH:
                    switch[a] = switch.get(a, 0) + 1
        return build_topology((g.index for g in self._gpus), levels, direct, switch)

    # --- sampling -----------------------------------------------------------------

    def _stuck(self) -> list[int]:
        """GPUs whose read is still in NVML, from this round or an earlier one."""
        return [gpu.index for gpu in self._gpus if gpu.job is not None and not gpu.job.done.is_set()]

    def _read_all(self, now: float) -> list[GpuSample]:
        """Every GPU's sample this round, read on its worker with one
        deadline for all (the Xid drain on the control worker alongside),
        or (``parallel=False``) one after another here."""
        samples: list[GpuSample | None] = [None] * len(self._gpus)
        xids = None
        if self._events is not None and self._control_job is None:
            xids = self._start_control("xid_drain", self._drain_xids, self._events, call="nvmlEventSetWait_v2")
        waiting: list[tuple[int, _Gpu, _Job]] = []
        for i, gpu in enumerate(self._gpus):
            if gpu.lost:
                samples[i] = self._lost_sample(gpu)
                continue
            if not self._idle(gpu):
                # Still stuck since an earlier round: no second call for
                # this GPU while it is.
                assert gpu.job is not None
                samples[i] = self._timed_out(gpu, gpu.job)
                continue
            job = _Job("read", functools.partial(self._read_gpu, gpu.index, gpu.uuid, gpu.handle, self._plan(gpu, now)),
                       "handle")
            gpu.job = job
            self._dispatch(gpu.index, job)
            waiting.append((i, gpu, job))
        deadline = time.monotonic() + self._read_timeout
        if xids is not None:
            self._finish_control(xids, deadline)  # before the reads: their samples carry xid_last
        for i, gpu, job in waiting:
            if not job.done.wait(max(0.0, deadline - time.monotonic())):
                samples[i] = self._timed_out(gpu, job)
                continue
            gpu.job = None
            if job.error is not None:
                raise job.error
            assert job.result is not None
            samples[i] = self._apply(gpu, job.result, now)
        return [s for s in samples if s is not None]

    def _plan(self, gpu: _Gpu, now: float) -> frozenset[str]:
        """The reads this round leaves out: the unsupported ones, but once
        a minute (REPROBE_S) none, to see whether they came back."""
        if gpu.unsupported and gpu.reprobe_at is not None and now >= gpu.reprobe_at:
            gpu.unsupported.clear()
            gpu.reprobe_at = None
        return frozenset(gpu.unsupported)

    def _lost_sample(self, gpu: _Gpu) -> GpuSample:
        # Until NVML is re-initialised every call would say the same.
        return GpuSample(index=gpu.index, health=Health.LOST)

    def _timed_out(self, gpu: _Gpu, job: _Job) -> GpuSample:
        waited = time.monotonic() - job.started
        sample = GpuSample(index=gpu.index, health=Health.READ_FAILED)
        sample.errors["nvml"] = (
            f"nvml call timed out: the {job.call} read of GPU {gpu.index} has not returned after {waited:.1f} s"
        )
        if gpu.xid_watched:
            sample.xid_last = gpu.xid_last
        gpu.frozen.reset()
        gpu.read_s = {job.call: waited}  # --check shows how long it has hung
        self._note_timeout(gpu, job)
        return sample

    def _note_timeout(self, gpu: _Gpu, job: _Job) -> None:
        if not job.stuck_on:
            job.stuck_on = job.call
            log.warning("nvml_call_timed_out", gpu=gpu.index, uuid=gpu.uuid, read=job.call,
                        timeout_s=self._read_timeout,
                        detail="the GPU reports read_failed, and gets no new read, until the call returns")

    def _reinit_pending(self, gpu: _Gpu, job: _Job) -> GpuSample:
        """A GPU not read because NVML's re-init has not returned."""
        waited = time.monotonic() - job.started
        sample = GpuSample(index=gpu.index, health=Health.READ_FAILED)
        sample.errors["nvml"] = (
            f"nvml call timed out: NVML's re-init ({job.call}) has not returned after {waited:.1f} s; "
            f"GPU {gpu.index} is read again once it does"
        )
        gpu.frozen.reset()
        gpu.read_s = {}
        return sample

    def _read_gpu(self, index: int, uuid: str, handle: Any, skip: frozenset[str], job: _Job | None) -> _Result:
        """One GPU's reads, but ``skip``. Touches no GPU state (it may run
        on a thread that its round gave up on): what it finds is returned."""
        nv, err = self._nv, self._err
        sample = GpuSample(index=index)
        read_s: dict[str, float] = {}
        if handle is None:
            try:
                handle = nv.nvmlDeviceGetHandleByIndex(index)
                # The index may be another GPU's now (a renumbering NVML
                # did): a handle is only this GPU's if the UUID says so.
                found = _text(nv.nvmlDeviceGetUUID(handle)) if uuid else uuid
            except err as exc:
                if self._code(exc) == nv.NVML_ERROR_GPU_IS_LOST:
                    return _Result(sample, None, read_s, lost=_reason(exc))
                sample.health = Health.READ_FAILED
                sample.errors["handle"] = _reason(exc)
                return _Result(sample, None, read_s)
            except _PARSE_ERRORS as exc:
                sample.health = Health.READ_FAILED
                sample.errors["handle"] = f"unreadable UUID: {exc}"
                return _Result(sample, None, read_s)
            if found != uuid:
                why = f"GPU index {index} is now {found}, not the registered {uuid}"
                return _Result(sample, None, read_s, lost=why, changed=why)
        attempted = failed = 0
        unsupported: set[str] = set()
        for read in _READS:
            if read.name in skip:
                continue
            if job is not None:
                job.call = read.name
            attempted += 1
            started = time.perf_counter()
            try:
                try:
                    raw = read.call(nv, handle)
                finally:
                    read_s[read.name] = time.perf_counter() - started
                values = read.parse(raw)
            except err as exc:
                code = self._code(exc)
                if code == nv.NVML_ERROR_NOT_SUPPORTED:
                    unsupported.add(read.name)
                    read_s.pop(read.name, None)
                    attempted -= 1
                    continue
                if code == nv.NVML_ERROR_GPU_IS_LOST:
                    return _Result(GpuSample(index=index), None, read_s, lost=_reason(exc))
                failed += 1
                for name in read.fields:
                    sample.errors[name] = _reason(exc)
                continue
            except _PARSE_ERRORS as exc:
                failed += 1
                for name in read.fields:
                    sample.errors[name] = f"unreadable value: {exc}"
                continue
            for name, value in values.items():
                setattr(sample, name, value)
        return _Result(sample, handle, read_s, unsupported=unsupported, all_failed=bool(attempted) and failed == attempted)

    def _apply(self, gpu: _Gpu, result: _Result, now: float) -> GpuSample:
        """A read's result into the GPU's state; its sample, health decided."""
        gpu.read_s = result.read_s
        if result.changed is not None and self._changed is None:
            self._changed = result.changed
        if result.lost is not None:
            return self._lose(gpu, GpuSample(index=gpu.index), result.lost)
        gpu.handle = result.handle
        if result.unsupported:
            gpu.unsupported |= result.unsupported
            if gpu.reprobe_at is None:
                gpu.reprobe_at = now + REPROBE_S
        sample = result.sample
        if gpu.xid_watched:
            sample.xid_last = gpu.xid_last
        if sample.health == Health.READ_FAILED:  # no handle
            gpu.frozen.reset()
        elif result.all_failed:
            sample.health = Health.READ_FAILED
            gpu.frozen.reset()
        elif gpu.frozen.update(
            sample.util_gpu_pct, sample.util_memory_pct, sample.memory_used_mib, sample.process_count, sample.power_mw
        ):
            sample.health = Health.FROZEN
        return sample

    def _lose(self, gpu: _Gpu, sample: GpuSample, reason: str) -> GpuSample:
        gpu.lost = True
        gpu.handle = None
        gpu.frozen.reset()
        sample.health = Health.LOST
        sample.errors["handle"] = reason
        return sample

    def _raise_if_changed(self) -> None:
        if self._changed is None:
            return
        log.error("gpu_inventory_changed", reason=self._changed, exit_code=InventoryChanged(self._changed).code,
                  detail="NVML lists other GPUs than this process registered: a new process registers them")
        raise InventoryChanged(self._changed)

    def _start_reinit(self) -> _Job:
        """Hand NVML's re-init to the control worker (no call may be in
        flight). The GPUs' handles die with the shutdown it begins with."""
        events = self._take_events()  # an event set lives and dies with its session
        for gpu in self._gpus:
            gpu.handle = None
        return self._start_control("reinit", self._reinit_nvml, events, call="nvmlEventSetFree")

    def _reinit_nvml(self, events: Any, job: _Job) -> _Reinit:
        """Restart NVML and find every registered GPU's new handle by UUID,
        since a reset may renumber them; watch them for Xid events again.
        Calls NVML only (on the control worker): ``_apply_reinit`` decides."""
        nv, err = self._nv, self._err
        self._free_events(events)
        job.call = "nvmlShutdown"
        self._shutdown()
        job.call = "nvmlInit"
        try:
            nv.nvmlInit()
        except (err, OSError) as exc:
            return _Reinit(error=_reason(exc))
        found = _Reinit()
        job.call = "nvmlDeviceGetCount"
        try:
            found.count = int(nv.nvmlDeviceGetCount())
        except err:
            pass
        job.call = "nvmlDeviceGetHandleByIndex"
        by_uuid: dict[str, Any] = {}
        for index in range(len(self._gpus) if found.count is None else found.count):
            try:
                handle = nv.nvmlDeviceGetHandleByIndex(index)
                uuid = _text(nv.nvmlDeviceGetUUID(handle))
            except (err, *_PARSE_ERRORS):
                continue  # unreadable now (off the bus, say): not a change by itself
            by_uuid[uuid] = handle
            found.listed.append((index, uuid))
        found.handles = {gpu.index: by_uuid.get(gpu.uuid) if gpu.uuid else None for gpu in self._gpus}
        job.call = "nvmlDeviceRegisterEvents"
        found.events, found.watched = self._register_xids(found.handles)
        return found

    def _apply_reinit(self, found: _Reinit) -> None:
        """A re-init's findings into the GPUs' state. A GPU whose UUID NVML
        no longer lists stays lost (its index may be another GPU's now); if
        the set of GPUs is not the registered one, ``_changed`` says how
        (``sample`` raises). A failed ``nvmlInit`` leaves the lost GPUs
        lost; the caller schedules the next attempt."""
        if found.error is not None:
            log.warning("nvml_reinit_failed", error=found.error,
                        detail="nvmlInit failed: the lost GPUs stay lost and NVML is initialised again after a backoff")
            return
        registered = {gpu.uuid for gpu in self._gpus if gpu.uuid}
        changes: list[str] = []
        if found.count is not None and found.count != len(self._gpus):
            changes.append(f"NVML lists {found.count} GPU(s), this process registered {len(self._gpus)}")
        for index, uuid in found.listed:
            if uuid not in registered:
                changes.append(f"GPU index {index} is {uuid}, which this process did not register")
        for gpu in self._gpus:
            gpu.handle = found.handles.get(gpu.index)
            if gpu.uuid and gpu.handle is None:
                if not gpu.lost:
                    log.warning("gpu_not_found", gpu=gpu.index, uuid=gpu.uuid,
                                detail="NVML does not list this GPU after its re-init: it stays lost")
                gpu.lost = True
            else:
                gpu.lost = False
            gpu.frozen.reset()
            # what the GPU did not support may have changed with the reset
            gpu.unsupported.clear()
            gpu.reprobe_at = None
        if changes and self._changed is None:
            self._changed = "; ".join(changes)
        self._watch(found.events, found.watched)

    def _release_nvml(self, events: Any, job: _Job) -> None:
        """``close``'s calls, on the control worker."""
        self._free_events(events)
        job.call = "nvmlShutdown"
        self._shutdown()


def _reason(exc: Exception) -> str:
    code = getattr(exc, "value", None)
    return f"{exc} (NVML {code})" if code is not None else str(exc)
