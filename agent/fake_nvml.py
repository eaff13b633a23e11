"""A fake NVML library: the slice of ``pynvml`` that ``agent.nvml`` calls,
backed by plain Python state instead of a driver.

Pass a ``FakeNvml`` where ``NvmlBackend`` takes its ``nvml`` module to test
error translation, lost GPUs, frozen readings and topology without a GPU
(STYLE.md #8: a shipped fake, not mocks). It raises the real
``pynvml.NVMLError`` subclasses with real error codes and exposes pynvml's
constants, so the code under test cannot tell the difference by type or
value. ``pynvml`` is importable without a driver: it loads the library only
in ``nvmlInit``.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pynvml

__all__ = ["FakeNvml", "FakeGpu", "FakeProcess", "MIB", "SWITCH"]

MIB = 1024 * 1024
#: an NVLink remote that is an NVSwitch, not a GPU
SWITCH = "switch"


@dataclass
class FakeProcess:
    pid: int
    #: bytes; None as on Windows WDDM, where NVML cannot tell
    used_gpu_memory: int | None


@dataclass
class FakeGpu:
    """One GPU's state. Tests change the fields between samples."""

    uuid: str
    bus_id: str  # "00000000:01:00.0"
    name: str = "NVIDIA GeForce RTX 4090"
    memory_total: int = 24564 * MIB  # bytes
    memory_used: int = 300 * MIB  # bytes, as nvmlDeviceGetMemoryInfo (v1) counts it: reserved included
    #: bytes the driver reserves (nvmlDeviceGetMemoryInfo_v2); None: a driver
    #: without the v2 call
    memory_reserved: int | None = None
    util_gpu: int = 0
    util_memory: int = 0
    temperature: int = 35
    power_mw: int = 30_000
    power_limit_mw: int = 450_000
    sm_clock_mhz: int = 210
    pcie_rx_kbps: int = 0
    pcie_tx_kbps: int = 0
    ecc_corrected: int = 0
    ecc_uncorrected: int = 0
    processes: list[FakeProcess] = field(default_factory=list)
    #: NVLink ports the GPU has (0: NVLink not supported)
    nvlink_ports: int = 0
    #: active port -> remote bus id, or SWITCH
    nvlinks: dict[int, str] = field(default_factory=dict)
    #: pynvml function name -> NVML error code it raises on every call
    errors: dict[str, int] = field(default_factory=dict)
    #: every call on the GPU raises GPU_IS_LOST (fallen off the bus)
    lost: bool = False
    #: whether the GPU can deliver Xid (critical error) events
    xid_events: bool = True
    #: MIG mode (nvmlDeviceGetMigMode's current mode): None for a GPU without
    #: MIG (NOT_SUPPORTED, as on consumer cards), NVML_DEVICE_MIG_DISABLE (0)
    #: or NVML_DEVICE_MIG_ENABLE (1). Enabled, utilisation is NOT_SUPPORTED,
    #: as NVML documents for a MIG-enabled GPU
    mig_mode: int | None = None
    #: the mode after the next GPU reset; None: the current one
    mig_pending: int | None = None


class _Handle:
    """An opaque device handle, valid only in the NVML session it came from."""

    __slots__ = ("index", "session")

    def __init__(self, index: int, session: int) -> None:
        self.index = index
        self.session = session


class _Utilization:
    def __init__(self, gpu: int, memory: int) -> None:
        self.gpu = gpu
        self.memory = memory


class _Memory:
    def __init__(self, total: int, used: int) -> None:
        self.total = total
        self.used = used
        self.free = total - used


class _MemoryV2:
    def __init__(self, total: int, reserved: int, used: int) -> None:
        self.version = pynvml.nvmlMemory_v2
        self.total = total
        self.reserved = reserved
        self.used = used
        self.free = total - reserved - used


class _EventSet:
    """An event set of one NVML session: registered handles and the events
    waiting to be taken."""

    def __init__(self, session: int) -> None:
        self.session = session
        self.registered: dict[int, int] = {}  # GPU index -> event type mask
        self.pending: list[_EventData] = []
        self.freed = False


class _EventData:
    def __init__(self, device: "_Handle", event_type: int, data: int) -> None:
        self.device = device
        self.eventType = event_type
        self.eventData = data
        self.gpuInstanceId = 0xFFFFFFFF
        self.computeInstanceId = 0xFFFFFFFF


class _PciInfo:
    def __init__(self, bus_id: str) -> None:
        # pynvml hands back the ctypes char array: bytes, not str
        self.busId = bus_id.encode()
        domain, bus, rest = bus_id.split(":")
        device = rest.split(".")[0]
        self.domain = int(domain, 16)
        self.bus = int(bus, 16)
        self.device = int(device, 16)


class _ProcessInfo:
    def __init__(self, pid: int, used: int | None) -> None:
        self.pid = pid
        self.usedGpuMemory = used


class FakeNvml:
    """Module-like fake of pynvml. ``gpus`` in index order; ``topology`` maps
    an index pair (either order) to an ``NVML_TOPOLOGY_*`` level (default
    ``NVML_TOPOLOGY_HOSTBRIDGE``); ``init_error`` makes ``nvmlInit`` raise
    that NVML code (tests may change it between calls). ``calls`` counts
    every function called, by name (the backend reads GPUs on threads of
    their own: counting is locked). ``hang`` makes a function block as it
    does under a wedged driver, ``hung`` counts the calls that blocked."""

    NVMLError = pynvml.NVMLError
    nvmlMemory_v2 = pynvml.nvmlMemory_v2
    nvmlEventTypeXidCriticalError = pynvml.nvmlEventTypeXidCriticalError

    def __init__(
        self,
        gpus: list[FakeGpu],
        topology: dict[tuple[int, int], int] | None = None,
        init_error: int | None = None,
        driver_version: str | None = "580.159.04",
        cuda_driver_version: int | None = 13000,
    ) -> None:
        self.gpus = gpus
        # None: the call fails as a library that predates it would
        self.driver_version = driver_version
        self.cuda_driver_version = cuda_driver_version
        self.topology = dict(topology or {})
        self.init_error = init_error
        self.calls: Counter[str] = Counter()
        #: calls that blocked in a hang, by function name
        self.hung: Counter[str] = Counter()
        self._calls_lock = threading.Lock()
        #: (function name, GPU index or None for any) -> its release
        self._hangs: dict[tuple[str, int | None], threading.Event] = {}
        self.event_sets: list[_EventSet] = []
        self._initialized = False
        self._session = 0

    def __getattr__(self, name: str) -> Any:
        # Constants (NVML_*) come from the real module, so values match.
        if name.startswith("NVML_"):
            return getattr(pynvml, name)
        raise AttributeError(name)

    # --- plumbing -------------------------------------------------------------

    @property
    def init_calls(self) -> int:
        return self.calls["nvmlInit"]

    @property
    def shutdown_calls(self) -> int:
        return self.calls["nvmlShutdown"]

    @property
    def initialized(self) -> bool:
        return self._initialized

    def hang(self, fn: str, gpu: int | None = None) -> threading.Event:
        """From now on every call of ``fn`` (only on GPU ``gpu``'s handle,
        if given) blocks, as under a wedged driver, until the returned event
        is set; then it carries on as usual. Call again for a new hang."""
        release = threading.Event()
        self._hangs[(fn, gpu)] = release
        return release

    def _hang(self, fn: str, gpu: int | None) -> None:
        release = self._hangs.get((fn, gpu))
        if release is None or release.is_set():
            return
        with self._calls_lock:
            self.hung[fn] += 1
        release.wait()

    def _count(self, fn: str, n: int = 1) -> None:
        with self._calls_lock:
            self.calls[fn] += n
        if self._hangs:
            self._hang(fn, None)

    @staticmethod
    def _raise(code: int) -> None:
        raise pynvml.NVMLError(code)

    def _gpu(self, fn: str, handle: _Handle) -> FakeGpu:
        self._count(fn)
        if self._hangs and isinstance(handle, _Handle):
            self._hang(fn, handle.index)
        if not self._initialized:
            self._raise(pynvml.NVML_ERROR_UNINITIALIZED)
        if not isinstance(handle, _Handle) or handle.session != self._session:
            # a handle from before a shutdown: NVML no longer knows it
            self._raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gpu = self.gpus[handle.index]
        if gpu.lost:
            self._raise(pynvml.NVML_ERROR_GPU_IS_LOST)
        if fn in gpu.errors:
            self._raise(gpu.errors[fn])
        return gpu

    # --- library ----------------------------------------------------------------

    def nvmlInit(self) -> None:
        self._count("nvmlInit")
        if self.init_error is not None:
            self._raise(self.init_error)
        self._initialized = True
        self._session += 1

    def nvmlShutdown(self) -> None:
        self._count("nvmlShutdown")
        if not self._initialized:
            self._raise(pynvml.NVML_ERROR_UNINITIALIZED)
        self._initialized = False

    def _system(self, fn: str, value: Any) -> Any:
        """A system-wide read: ``value``, or FUNCTION_NOT_FOUND where it is None."""
        self._count(fn)
        if not self._initialized:
            self._raise(pynvml.NVML_ERROR_UNINITIALIZED)
        if value is None:
            self._raise(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        return value

    def nvmlSystemGetDriverVersion(self) -> str:
        return self._system("nvmlSystemGetDriverVersion", self.driver_version)

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        return self._system("nvmlSystemGetCudaDriverVersion_v2", self.cuda_driver_version)

    def nvmlDeviceGetCount(self) -> int:
        self._count("nvmlDeviceGetCount")
        if not self._initialized:
            self._raise(pynvml.NVML_ERROR_UNINITIALIZED)
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        self._count("nvmlDeviceGetHandleByIndex")
        if not self._initialized:
            self._raise(pynvml.NVML_ERROR_UNINITIALIZED)
        if not 0 <= index < len(self.gpus):
            self._raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if self._hangs:
            self._hang("nvmlDeviceGetHandleByIndex", index)
        gpu = self.gpus[index]
        if gpu.lost:
            self._raise(pynvml.NVML_ERROR_GPU_IS_LOST)
        if "nvmlDeviceGetHandleByIndex" in gpu.errors:
            self._raise(gpu.errors["nvmlDeviceGetHandleByIndex"])
        return _Handle(index, self._session)

    # --- device reads -------------------------------------------------------------

    def nvmlDeviceGetName(self, handle: _Handle) -> str:
        return self._gpu("nvmlDeviceGetName", handle).name

    def nvmlDeviceGetUUID(self, handle: _Handle) -> str:
        return self._gpu("nvmlDeviceGetUUID", handle).uuid

    def nvmlDeviceGetPciInfo(self, handle: _Handle) -> _PciInfo:
        return _PciInfo(self._gpu("nvmlDeviceGetPciInfo", handle).bus_id)

    def nvmlDeviceGetUtilizationRates(self, handle: _Handle) -> _Utilization:
        gpu = self._gpu("nvmlDeviceGetUtilizationRates", handle)
        if gpu.mig_mode == pynvml.NVML_DEVICE_MIG_ENABLE:
            self._raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return _Utilization(gpu.util_gpu, gpu.util_memory)

    def nvmlDeviceGetMigMode(self, handle: _Handle) -> list[int]:
        """[current, pending], as pynvml returns them."""
        gpu = self._gpu("nvmlDeviceGetMigMode", handle)
        if gpu.mig_mode is None:
            self._raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return [gpu.mig_mode, gpu.mig_mode if gpu.mig_pending is None else gpu.mig_pending]

    def nvmlDeviceGetMemoryInfo(self, handle: _Handle, version: int | None = None) -> _Memory:
        gpu = self._gpu("nvmlDeviceGetMemoryInfo", handle)
        if not version:
            return _Memory(gpu.memory_total, gpu.memory_used)
        if gpu.memory_reserved is None:
            self._raise(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        # v2 leaves the driver's reservation out of "used", as nvidia-smi does
        return _MemoryV2(gpu.memory_total, gpu.memory_reserved, gpu.memory_used - gpu.memory_reserved)

    def nvmlDeviceGetTemperature(self, handle: _Handle, sensor: int) -> int:
        gpu = self._gpu("nvmlDeviceGetTemperature", handle)
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            self._raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gpu.temperature

    def nvmlDeviceGetPowerUsage(self, handle: _Handle) -> int:
        return self._gpu("nvmlDeviceGetPowerUsage", handle).power_mw

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: _Handle) -> int:
        return self._gpu("nvmlDeviceGetEnforcedPowerLimit", handle).power_limit_mw

    def nvmlDeviceGetClockInfo(self, handle: _Handle, clock_type: int) -> int:
        gpu = self._gpu("nvmlDeviceGetClockInfo", handle)
        if clock_type != pynvml.NVML_CLOCK_SM:
            self._raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gpu.sm_clock_mhz

    # --- events ---------------------------------------------------------------

    def nvmlEventSetCreate(self) -> _EventSet:
        self._count("nvmlEventSetCreate")
        if not self._initialized:
            self._raise(pynvml.NVML_ERROR_UNINITIALIZED)
        event_set = _EventSet(self._session)
        self.event_sets.append(event_set)
        return event_set

    def nvmlDeviceRegisterEvents(self, handle: _Handle, event_types: int, event_set: _EventSet) -> None:
        gpu = self._gpu("nvmlDeviceRegisterEvents", handle)
        if not gpu.xid_events:
            self._raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        event_set.registered[handle.index] = event_set.registered.get(handle.index, 0) | event_types

    def nvmlEventSetWait_v2(self, event_set: _EventSet, timeout_ms: int) -> _EventData:
        self._count("nvmlEventSetWait_v2")
        if event_set.freed or event_set.session != self._session:
            self._raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if not event_set.pending:
            self._raise(pynvml.NVML_ERROR_TIMEOUT)
        return event_set.pending.pop(0)

    def nvmlEventSetFree(self, event_set: _EventSet) -> None:
        self._count("nvmlEventSetFree")
        event_set.freed = True

    def xid(self, index: int, code: int) -> None:
        """The driver reports Xid ``code`` on GPU ``index``: every live event
        set of this session that registered the GPU for it gets the event."""
        for event_set in self.event_sets:
            mask = event_set.registered.get(index, 0)
            if not event_set.freed and event_set.session == self._session and mask & pynvml.nvmlEventTypeXidCriticalError:
                event_set.pending.append(_EventData(_Handle(index, self._session), pynvml.nvmlEventTypeXidCriticalError, code))

    def nvmlDeviceGetPcieThroughput(self, handle: _Handle, counter: int) -> int:
        gpu = self._gpu("nvmlDeviceGetPcieThroughput", handle)
        if counter == pynvml.NVML_PCIE_UTIL_RX_BYTES:
            return gpu.pcie_rx_kbps
        if counter == pynvml.NVML_PCIE_UTIL_TX_BYTES:
            return gpu.pcie_tx_kbps
        self._raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        raise AssertionError  # unreachable

    def nvmlDeviceGetTotalEccErrors(self, handle: _Handle, error_type: int, counter_type: int) -> int:
        gpu = self._gpu("nvmlDeviceGetTotalEccErrors", handle)
        if counter_type != pynvml.NVML_VOLATILE_ECC:
            self._raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if error_type == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED:
            return gpu.ecc_corrected
        if error_type == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED:
            return gpu.ecc_uncorrected
        self._raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        raise AssertionError  # unreachable

    def nvmlDeviceGetComputeRunningProcesses(self, handle: _Handle) -> list[_ProcessInfo]:
        gpu = self._gpu("nvmlDeviceGetComputeRunningProcesses", handle)
        return [_ProcessInfo(p.pid, p.used_gpu_memory) for p in gpu.processes]

    # --- topology -------------------------------------------------------------------

    def nvmlDeviceGetTopologyCommonAncestor(self, a: _Handle, b: _Handle) -> int:
        self._gpu("nvmlDeviceGetTopologyCommonAncestor", a)
        self._gpu("nvmlDeviceGetTopologyCommonAncestor", b)
        self._count("nvmlDeviceGetTopologyCommonAncestor", -1)  # one call, two handles
        key = (a.index, b.index)
        level = self.topology.get(key, self.topology.get(key[::-1]))
        return pynvml.NVML_TOPOLOGY_HOSTBRIDGE if level is None else level

    def _link(self, fn: str, handle: _Handle, link: int) -> FakeGpu:
        gpu = self._gpu(fn, handle)
        if gpu.nvlink_ports == 0:
            self._raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= link < gpu.nvlink_ports:
            self._raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gpu

    def nvmlDeviceGetNvLinkState(self, handle: _Handle, link: int) -> int:
        gpu = self._link("nvmlDeviceGetNvLinkState", handle, link)
        return pynvml.NVML_FEATURE_ENABLED if link in gpu.nvlinks else pynvml.NVML_FEATURE_DISABLED

    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle: _Handle, link: int) -> _PciInfo:
        gpu = self._link("nvmlDeviceGetNvLinkRemotePciInfo", handle, link)
        remote = gpu.nvlinks.get(link)
        if remote is None:
            self._raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        # An NVSwitch answers with its own PCI address, not a GPU's.
        return _PciInfo("00000000:FF:00.0" if remote == SWITCH else remote)

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: _Handle, link: int) -> int:
        gpu = self._link("nvmlDeviceGetNvLinkRemoteDeviceType", handle, link)
        remote = gpu.nvlinks.get(link)
        if remote is None:
            return pynvml.NVML_NVLINK_DEVICE_TYPE_UNKNOWN
        return pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH if remote == SWITCH else pynvml.NVML_NVLINK_DEVICE_TYPE_GPU

    # --- builders -------------------------------------------------------------------

    @classmethod
    def with_gpus(cls, count: int, **kwargs: Any) -> FakeNvml:
        """``count`` idle RTX 4090s with distinct UUIDs and bus ids."""
        gpus = [
            FakeGpu(uuid=f"GPU-fake-{i:04d}", bus_id=f"00000000:{0x10 + i:02X}:00.0")
            for i in range(count)
        ]
        return cls(gpus, **kwargs)
