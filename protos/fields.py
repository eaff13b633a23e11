"""The telemetry field table shared by agent and coordinator.

Every GPU signal travels as an integer in one fixed unit; this table says, per
field, the unit, the deadband below which a change is not worth sending, and
the range a valid reading lies in. The column order of every per-GPU array in
the codec and the view is the order of ``FIELDS``.
"""

from __future__ import annotations

from dataclasses import dataclass

from protos import telemetry_pb2 as pb

__all__ = ["FieldSpec", "FIELDS", "FIELD_COUNT", "COLUMN", "BY_NAME", "column_of"]


@dataclass(frozen=True, slots=True)
class FieldSpec:
    field: int  # telemetry_pb2.Field value
    name: str  # attribute name on agent.backend.GpuSample
    unit: str
    deadband: int  # wire units; |new - last sent| below this is not sent
    lo: int  # smallest valid wire value
    hi: int  # largest valid wire value


_MAX_MIB = 4 * 1024 * 1024  # 4 TiB: beyond any GPU that exists
_MAX_MW = 5_000_000  # 5 kW per board
_MAX_COUNT = 2**40

FIELDS: tuple[FieldSpec, ...] = (
    FieldSpec(pb.FIELD_UTIL_GPU_PCT, "util_gpu_pct", "%", 1, 0, 100),
    FieldSpec(pb.FIELD_UTIL_MEMORY_PCT, "util_memory_pct", "%", 1, 0, 100),
    FieldSpec(pb.FIELD_MEMORY_USED_MIB, "memory_used_mib", "MiB", 1, 0, _MAX_MIB),
    FieldSpec(pb.FIELD_MEMORY_TOTAL_MIB, "memory_total_mib", "MiB", 1, 0, _MAX_MIB),
    FieldSpec(pb.FIELD_TEMPERATURE_C, "temperature_c", "°C", 1, -40, 150),
    FieldSpec(pb.FIELD_POWER_MW, "power_mw", "mW", 1000, 0, _MAX_MW),
    FieldSpec(pb.FIELD_POWER_LIMIT_MW, "power_limit_mw", "mW", 1000, 0, _MAX_MW),
    # Clocks step in 15 MHz bins on most cards; a smaller move is noise.
    FieldSpec(pb.FIELD_SM_CLOCK_MHZ, "sm_clock_mhz", "MHz", 15, 0, 10_000),
    # PCIe throughput is jittery; 1 MB/s is the least an operator cares about.
    FieldSpec(pb.FIELD_PCIE_RX_KBPS, "pcie_rx_kbps", "KB/s", 1024, 0, 2**32),
    FieldSpec(pb.FIELD_PCIE_TX_KBPS, "pcie_tx_kbps", "KB/s", 1024, 0, 2**32),
    FieldSpec(pb.FIELD_ECC_CORRECTED, "ecc_corrected", "count", 1, 0, _MAX_COUNT),
    FieldSpec(pb.FIELD_ECC_UNCORRECTED, "ecc_uncorrected", "count", 1, 0, _MAX_COUNT),
    FieldSpec(pb.FIELD_XID_LAST, "xid_last", "code", 1, 0, 2**31),
    FieldSpec(pb.FIELD_HEALTH, "health", "enum", 1, 1, 4),
    FieldSpec(pb.FIELD_PROCESS_COUNT, "process_count", "count", 1, 0, 65_536),
)

FIELD_COUNT = len(FIELDS)
#: telemetry_pb2.Field value -> column index
COLUMN: dict[int, int] = {spec.field: i for i, spec in enumerate(FIELDS)}
#: GpuSample attribute name -> column index
BY_NAME: dict[str, int] = {spec.name: i for i, spec in enumerate(FIELDS)}


def column_of(name: str) -> int:
    """Column index of a field by its sample attribute name."""
    return BY_NAME[name]
