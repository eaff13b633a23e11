"""The real GPU backend: reads every GPU of the host through NVML (pynvml).

NVML's structs and ``NVMLError`` stop here (STYLE.md #9): each read is a
call into the library followed by a small pure parser to our types, and each
error becomes a ``None`` field, a health value or ``BackendUnavailable``:

- ``NVML_ERROR_NOT_SUPPORTED``: the GPU does not have the field. It stays
  ``None`` and is never asked for again (consumer cards have no ECC).
- any other error on one read: those fields are ``None`` this round and the
  reason is in ``sample.errors[field]``.
- every read of a GPU failing, or its handle: health ``READ_FAILED``.
- ``NVML_ERROR_GPU_IS_LOST``: health ``LOST``; the backend re-initialises
  NVML (``nvmlShutdown`` + ``nvmlInit``) with exponential backoff measured on
  the injected clock. It never sleeps: the other GPUs keep being sampled.
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

import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
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
_REINIT_BACKOFF_S = 1.0
_REINIT_BACKOFF_MAX_S = 60.0

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


@dataclass(slots=True)
class _Gpu:
    index: int
    uuid: str
    handle: Any | None
    unsupported: set[str] = field(default_factory=set)
    lost: bool = False
    frozen: FrozenDetector = field(default_factory=FrozenDetector)
    #: seconds each read took in the last round (``gpulb-agent --check``)
    read_s: dict[str, float] = field(default_factory=dict)
    #: Xid events registered for this GPU; the last code seen (0: none)
    xid_watched: bool = False
    xid_last: int = 0


class NvmlBackend:
    """Every GPU of the host through NVML. See the module docstring.

    ``nvml`` is the pynvml module or anything shaped like it
    (``agent.fake_nvml.FakeNvml`` in tests). ``clock`` times the re-init
    backoff. ``frozen_after`` is how many unchanged samples with running
    processes make a GPU ``FROZEN``.

    ``parallel`` reads the GPUs of a round on one thread each (default: with
    the real pynvml and more than one GPU). NVML is thread-safe, and each
    PCIe throughput read blocks for the 20 ms over which the driver counts
    bytes, so one GPU costs ~45 ms a round: read one after another, an
    8-GPU host would take longer than the 200 ms fast period.
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
    ) -> None:
        real_nvml = nvml is None
        if nvml is None:
            try:
                import pynvml as nvml
            except ImportError as exc:  # pragma: no cover - a declared dependency
                raise BackendUnavailable(f"pynvml is not installed: {exc}") from exc
        if not 0 < reinit_backoff_s <= reinit_backoff_max_s:
            raise ValueError("need 0 < reinit_backoff_s <= reinit_backoff_max_s")
        self._nv = nvml
        self._err: type[Exception] = nvml.NVMLError
        self._clock = clock
        self._frozen_after = frozen_after
        self._backoff_base = reinit_backoff_s
        self._backoff_max = reinit_backoff_max_s
        self._backoff = reinit_backoff_s
        self._reinit_at: float | None = None
        self._closed = False

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
        self._events: Any = None
        self._watch_xids()
        if parallel is None:
            parallel = real_nvml and count > 1
        self._pool: ThreadPoolExecutor | None = None
        if parallel and count > 1:
            self._pool = ThreadPoolExecutor(max_workers=min(count, 16), thread_name_prefix="nvml")

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
        if self._closed:
            raise BackendError("NVML backend is closed")
        now = self._clock()
        reinit_tried = False
        if self._reinit_at is not None and now >= self._reinit_at:
            reinit_tried = True
            self._reinit_at = None
            self._reinit()
        self._drain_xids()
        if self._pool is not None:
            samples = list(self._pool.map(self._sample_gpu, self._gpus))
        else:
            samples = [self._sample_gpu(gpu) for gpu in self._gpus]
        if any(gpu.lost for gpu in self._gpus):
            if self._reinit_at is None:
                if reinit_tried:
                    # The last re-init did not bring it back: wait longer.
                    self._backoff = min(self._backoff_max, self._backoff * 2)
                self._reinit_at = now + self._backoff
        elif reinit_tried:
            self._backoff = self._backoff_base
        return samples

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            self._free_events()
            self._shutdown()

    @property
    def parallel(self) -> bool:
        """Whether a round reads the GPUs concurrently."""
        return self._pool is not None

    def read_seconds(self) -> dict[int, dict[str, float]]:
        """Per GPU index: how long each NVML read took in the last round, s
        (reads a GPU does not support are left out)."""
        return {gpu.index: dict(gpu.read_s) for gpu in self._gpus}

    # --- Xid events ------------------------------------------------------------

    def _watch_xids(self) -> None:
        """Register every GPU that can for critical-error (Xid) events."""
        nv = self._nv
        try:
            events = nv.nvmlEventSetCreate()
        except (self._err, AttributeError):
            return  # no event support in this driver or library
        watched = 0
        for gpu in self._gpus:
            gpu.xid_watched = False
            if gpu.handle is None:
                continue
            try:
                nv.nvmlDeviceRegisterEvents(gpu.handle, nv.nvmlEventTypeXidCriticalError, events)
            except self._err as exc:
                if self._code(exc) == nv.NVML_ERROR_UNKNOWN:
                    # NVML: the set is then in an undefined state; free it
                    for other in self._gpus:
                        other.xid_watched = False
                    watched = 0
                    break
                continue  # NOT_SUPPORTED on this GPU: its xid_last stays absent
            gpu.xid_watched = True
            watched += 1
        if watched:
            self._events = events
        else:
            try:
                nv.nvmlEventSetFree(events)
            except self._err:
                pass

    def _free_events(self) -> None:
        for gpu in self._gpus:
            gpu.xid_watched = False
        if self._events is not None:
            try:
                self._nv.nvmlEventSetFree(self._events)
            except self._err:
                pass  # gone with the session already
            self._events = None

    def _drain_xids(self) -> None:
        """Take every pending Xid event, without waiting."""
        nv = self._nv
        if self._events is None:
            return
        for _ in range(_MAX_EVENTS_PER_ROUND):
            try:
                data = nv.nvmlEventSetWait_v2(self._events, 0)
            except self._err:
                return  # TIMEOUT: none pending (any other error: next round)
            try:
                uuid = _text(nv.nvmlDeviceGetUUID(data.device))
            except (self._err, *_PARSE_ERRORS):
                uuid = ""
            code = int(data.eventData)
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

    def _sample_gpu(self, gpu: _Gpu) -> GpuSample:
        nv, err = self._nv, self._err
        sample = GpuSample(index=gpu.index)
        if gpu.lost:
            # Until NVML is re-initialised every call would say the same.
            sample.health = Health.LOST
            return sample
        if gpu.handle is None:
            try:
                gpu.handle = nv.nvmlDeviceGetHandleByIndex(gpu.index)
            except err as exc:
                if self._code(exc) == nv.NVML_ERROR_GPU_IS_LOST:
                    return self._lose(gpu, sample, _reason(exc))
                sample.health = Health.READ_FAILED
                sample.errors["handle"] = _reason(exc)
                return sample
        attempted = failed = 0
        gpu.read_s.clear()
        for read in _READS:
            if read.name in gpu.unsupported:
                continue
            attempted += 1
            started = time.perf_counter()
            try:
                try:
                    raw = read.call(nv, gpu.handle)
                finally:
                    gpu.read_s[read.name] = time.perf_counter() - started
                values = read.parse(raw)
            except err as exc:
                code = self._code(exc)
                if code == nv.NVML_ERROR_NOT_SUPPORTED:
                    gpu.unsupported.add(read.name)
                    gpu.read_s.pop(read.name, None)
                    attempted -= 1
                    continue
                if code == nv.NVML_ERROR_GPU_IS_LOST:
                    return self._lose(gpu, GpuSample(index=gpu.index), _reason(exc))
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
        if gpu.xid_watched:
            sample.xid_last = gpu.xid_last
        if attempted and failed == attempted:
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

    def _reinit(self) -> None:
        """Restart NVML and find every GPU's new handle (by UUID, since a
        reset may renumber them). A failure leaves the lost GPUs lost; the
        caller schedules the next attempt."""
        nv, err = self._nv, self._err
        self._free_events()  # an event set lives and dies with its session
        self._shutdown()
        try:
            nv.nvmlInit()
        except (err, OSError):
            for gpu in self._gpus:
                gpu.handle = None  # handles died with the shutdown
            return
        by_uuid: dict[str, Any] = {}
        try:
            count = int(nv.nvmlDeviceGetCount())
        except err:
            count = len(self._gpus)
        for index in range(count):
            try:
                handle = nv.nvmlDeviceGetHandleByIndex(index)
                by_uuid[_text(nv.nvmlDeviceGetUUID(handle))] = handle
            except err:
                continue
        for gpu in self._gpus:
            # No handle here: the sample re-opens it by index (and finds
            # out whether the GPU is still lost).
            gpu.handle = by_uuid.get(gpu.uuid) if gpu.uuid else None
            gpu.lost = False
            gpu.frozen.reset()
        self._watch_xids()


def _reason(exc: Exception) -> str:
    code = getattr(exc, "value", None)
    return f"{exc} (NVML {code})" if code is not None else str(exc)
