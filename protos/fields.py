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
    name: str  # the field's name in wire units (also the view's and the Gpu message's)
    unit: str
    deadband: int  # wire units; |new - last sent| below this is not sent
    lo: int  # smallest valid wire value
    hi: int  # largest valid wire value
    sample_attr: str = ""  # attribute on agent.backend.GpuSample; default: ``name``
    sample_divisor: int = 1  # wire value = round(sample value / divisor)

    @property
    def attr(self) -> str:
        return self.sample_attr or self.name


_MAX_MIB = 4 * 1024 * 1024  # 4 TiB: beyond any GPU that exists
_MAX_W = 5_000  # 5 kW per board
_MAX_COUNT = 2**40

FIELDS: tuple[FieldSpec, ...] = (
    FieldSpec(pb.FIELD_UTIL_GPU_PCT, "util_gpu_pct", "%", 1, 0, 100),
    FieldSpec(pb.FIELD_UTIL_MEMORY_PCT, "util_memory_pct", "%", 1, 0, 100),
    FieldSpec(pb.FIELD_MEMORY_USED_MIB, "memory_used_mib", "MiB", 1, 0, _MAX_MIB),
    FieldSpec(pb.FIELD_MEMORY_TOTAL_MIB, "memory_total_mib", "MiB", 1, 0, _MAX_MIB),
    FieldSpec(pb.FIELD_TEMPERATURE_C, "temperature_c", "°C", 1, -40, 150),
    # NVML reports mW, but board power sensors are good to a few W: whole watts
    # keep every delta a one-byte varint. The deadband is 2 W because a reading
    # sitting at x.5 W would flip between two whole watts under a 1 W band.
    FieldSpec(pb.FIELD_POWER_W, "power_w", "W", 2, 0, _MAX_W, "power_mw", 1000),
    FieldSpec(pb.FIELD_POWER_LIMIT_W, "power_limit_w", "W", 1, 0, _MAX_W, "power_limit_mw", 1000),
    # Clocks step in 15 MHz bins on most cards; a smaller move is noise.
    FieldSpec(pb.FIELD_SM_CLOCK_MHZ, "sm_clock_mhz", "MHz", 15, 0, 10_000),
    # NVML's PCIe counters average over 20 ms and swing by tens of MB/s from one
    # reading to the next; 32 MB/s (0.1 % of a Gen4 x16 link) is the least
    # movement worth sending.
    FieldSpec(pb.FIELD_PCIE_RX_MBPS, "pcie_rx_mbps", "MB/s", 32, 0, 1 << 22, "pcie_rx_kbps", 1024),
    FieldSpec(pb.FIELD_PCIE_TX_MBPS, "pcie_tx_mbps", "MB/s", 32, 0, 1 << 22, "pcie_tx_kbps", 1024),
    FieldSpec(pb.FIELD_ECC_CORRECTED, "ecc_corrected", "count", 1, 0, _MAX_COUNT),
    FieldSpec(pb.FIELD_ECC_UNCORRECTED, "ecc_uncorrected", "count", 1, 0, _MAX_COUNT),
    FieldSpec(pb.FIELD_XID_LAST, "xid_last", "code", 1, 0, 2**31),
    FieldSpec(pb.FIELD_HEALTH, "health", "enum", 1, 1, 4),
    FieldSpec(pb.FIELD_PROCESS_COUNT, "process_count", "count", 1, 0, 65_536),
)

FIELD_COUNT = len(FIELDS)
#: telemetry_pb2.Field value -> column index
COLUMN: dict[int, int] = {spec.field: i for i, spec in enumerate(FIELDS)}
#: field name (wire units) -> column index
BY_NAME: dict[str, int] = {spec.name: i for i, spec in enumerate(FIELDS)}


def column_of(name: str) -> int:
    """Column index of a field by its sample attribute name."""
    return BY_NAME[name]
