"""The GPU backend seam: one method that samples every GPU of the host.

Two implementations choose themselves by configuration: ``agent.nvml`` (real
GPUs through pynvml) and ``agent.sim`` (simulated RTX 4090s). Both return the
project's own types below; NVML's structs and errors never cross this line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from protos import telemetry_pb2 as pb

__all__ = [
    "GpuBackend",
    "GpuInfo",
    "GpuProcess",
    "GpuSample",
    "Health",
    "TopologyLink",
    "BackendError",
    "BackendUnavailable",
    "DeviceLost",
    "InventoryChanged",
    "EXIT_REREAD",
    "driver_version_of",
]


class Health:
    """GPU health as the agent reports it (values of telemetry_pb2.GpuHealth)."""

    OK = pb.GPU_HEALTH_OK
    READ_FAILED = pb.GPU_HEALTH_READ_FAILED
    FROZEN = pb.GPU_HEALTH_FROZEN
    LOST = pb.GPU_HEALTH_LOST


@dataclass(frozen=True, slots=True)
class GpuInfo:
    """Static facts about one GPU, read once at start."""

    index: int
    uuid: str
    model: str
    memory_total_mib: int
    power_limit_mw: int | None = None
    pci_bus_id: str = ""
    #: MiB the driver holds back (NVML memory info v2); counted in
    #: ``memory_used_mib``, never allocatable. None: the driver cannot say
    memory_reserved_mib: int | None = None


@dataclass(frozen=True, slots=True)
class TopologyLink:
    gpu_a: int
    gpu_b: int
    kind: int  # telemetry_pb2.LinkKind
    nvlink_count: int = 0


@dataclass(frozen=True, slots=True)
class GpuProcess:
    pid: int
    used_memory_mib: int


@dataclass(slots=True)
class GpuSample:
    """One reading of one GPU. ``None`` means the GPU does not report the field
    (or reading it failed this round) - never a stand-in for zero."""

    index: int
    health: int = Health.OK
    util_gpu_pct: int | None = None
    util_memory_pct: int | None = None
    memory_used_mib: int | None = None
    memory_total_mib: int | None = None
    temperature_c: int | None = None
    power_mw: int | None = None
    power_limit_mw: int | None = None
    sm_clock_mhz: int | None = None
    pcie_rx_kbps: int | None = None
    pcie_tx_kbps: int | None = None
    ecc_corrected: int | None = None
    ecc_uncorrected: int | None = None
    xid_last: int | None = None
    process_count: int | None = None
    processes: tuple[GpuProcess, ...] | None = None
    #: fields that raised this round (name -> short reason), for logs
    errors: dict[str, str] = field(default_factory=dict)


class BackendError(Exception):
    """Base of every error a GPU backend raises."""


class BackendUnavailable(BackendError):
    """The backend cannot start here (no driver, no GPU)."""


class DeviceLost(BackendError):
    """The whole backend lost its devices (driver reset); re-initialise."""


#: ``gpulb-agent``'s exit status for "the GPUs must be read again by a new
#: process" (``agent.main.EXIT_REREAD``, sysexits' EX_TEMPFAIL: systemd's
#: ``Restart=on-failure`` starts a new one). Here, not imported from
#: ``agent.main``, because the backends sit below it.
EXIT_REREAD = 75


class InventoryChanged(SystemExit):
    """The host's set of GPUs is no longer the one this process registered
    (a GPU gone after a driver reload, the others renumbered; a GPU added).

    Readings cannot be mapped onto the registered inventory any more, and
    the agent registers its inventory once, at start, so the process ends
    with ``EXIT_REREAD`` and a new one registers the GPUs as they are. A
    ``SystemExit`` on purpose: no ``except Exception`` on the way (a round
    that fails is logged and retried) swallows it, every ``finally`` on the
    way runs (the stream is cancelled, the backend closed), and
    ``gpulb-agent`` exits 75. A caller that wants to end otherwise (log its
    own line, say) catches it by this type.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(EXIT_REREAD)
        self.reason = reason

    def __str__(self) -> str:
        return self.reason


@runtime_checkable
class GpuBackend(Protocol):
    """What the agent needs from a source of GPU readings."""

    name: str

    def inventory(self) -> list[GpuInfo]:
        """The host's GPUs, read once at start."""
        ...

    def topology(self) -> list[TopologyLink]:
        """How the host's GPUs are connected, read once at start."""
        ...

    def sample(self) -> list[GpuSample]:
        """A reading of every GPU. One failing GPU or field never stops the
        others: it comes back with ``health`` READ_FAILED or a ``None`` field."""
        ...

    def close(self) -> None: ...


def driver_version_of(backend: GpuBackend) -> str:
    """The NVIDIA driver and CUDA version a backend reads ("580.159.04, CUDA
    13.0"): an optional ``driver_version`` attribute, which the NVML backend
    has and the simulator does not; "" when not known."""
    return str(getattr(backend, "driver_version", "") or "")
