"""The telemetry wire codec: deadband deltas, keyframes, snappy, sequence numbers.

The agent's ``TelemetryEncoder`` turns a sampling round (a GPU x field integer
matrix plus a presence mask) into an ``Envelope``: only values that moved past
their field's deadband are sent, as differences from the last value sent, laid
out by column so the coordinator decodes a whole batch with a few numpy
operations. A keyframe (absolute values of everything) goes out on connect, on
request and at least every ``keyframe_interval_s``.

The coordinator's ``TelemetryDecoder`` holds the last values the agent sent and
applies envelopes in sequence. A gap or reordering makes it ignore deltas
until a keyframe arrives (and ask for one), so the view never drifts silently.
Malformed input raises ``CodecError`` subclasses that name the offending field;
the decoder's state is untouched by an envelope that fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Sequence

import numpy as np
import snappy
from google.protobuf.message import DecodeError

from protos import telemetry_pb2 as pb
from protos.fields import COLUMN, FIELD_COUNT, FIELDS

__all__ = [
    "CodecError",
    "CorruptEnvelope",
    "PayloadTooLarge",
    "InvalidReading",
    "DecodeOutcome",
    "DecodeResult",
    "TelemetryEncoder",
    "TelemetryDecoder",
    "MAX_RAW_BATCH_BYTES",
    "DEADBANDS",
    "LOWER",
    "UPPER",
]

#: Bound on a decompressed MetricBatch. A batch of 64 GPUs with every field and
#: a long process list is a few KiB; 1 MiB leaves room and stops a zip bomb.
MAX_RAW_BATCH_BYTES = 1 << 20

DEADBANDS = np.array([spec.deadband for spec in FIELDS], dtype=np.int64)
LOWER = np.array([spec.lo for spec in FIELDS], dtype=np.int64)
UPPER = np.array([spec.hi for spec in FIELDS], dtype=np.int64)
_WIRE_FIELDS = [spec.field for spec in FIELDS]


class CodecError(Exception):
    """Base of the telemetry codec's errors. ``field`` names what was wrong."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class CorruptEnvelope(CodecError):
    """The envelope or its payload cannot be decoded (maps to INVALID_ARGUMENT)."""


class PayloadTooLarge(CodecError):
    """The payload would decompress beyond the bound (RESOURCE_EXHAUSTED)."""


class InvalidReading(CodecError):
    """A decoded value is out of range or names an unregistered GPU (INVALID_ARGUMENT)."""


def _pack_mask(mask: np.ndarray) -> bytes:
    return np.packbits(mask, bitorder="little").tobytes()


def _unpack_mask(data: bytes, count: int, where: str) -> np.ndarray:
    needed = (count + 7) // 8
    if len(data) != needed:
        raise CorruptEnvelope(where, f"presence has {len(data)} bytes, expected {needed} for {count} GPUs")
    return np.unpackbits(np.frombuffer(data, dtype=np.uint8), count=count, bitorder="little").astype(bool)


def _snappy_declared_length(data: bytes) -> int:
    """The uncompressed length a raw snappy block declares in its varint header."""
    result = 0
    for shift_index, byte in enumerate(data[:5]):
        result |= (byte & 0x7F) << (7 * shift_index)
        if byte < 0x80:
            return result
    raise CorruptEnvelope("payload", "snappy header is not a valid length varint")


class TelemetryEncoder:
    """Agent side: sampling rounds in, Envelopes out.

    ``gpu_indices`` are the registered GPU indices in row order. The encoder
    keeps the last value it sent per GPU and field; ``encode`` sends a field
    when |new - last sent| >= its deadband, so the coordinator's copy never
    differs from the truth by a deadband or more.
    """

    def __init__(
        self,
        gpu_indices: Sequence[int],
        *,
        keyframe_interval_s: float = 30.0,
        compress: bool = True,
    ) -> None:
        self.gpu_indices = np.asarray(gpu_indices, dtype=np.uint32)
        self.keyframe_interval_s = keyframe_interval_s
        self.compress = compress
        gpus = len(self.gpu_indices)
        self._last = np.zeros((gpus, FIELD_COUNT), dtype=np.int64)
        self._known = np.zeros((gpus, FIELD_COUNT), dtype=bool)
        self._seq = 0
        self._last_keyframe_s: float | None = None
        self._keyframe_requested = True

    @property
    def seq(self) -> int:
        """Sequence number of the last envelope produced."""
        return self._seq

    @property
    def last_sent(self) -> tuple[np.ndarray, np.ndarray]:
        """(values, known): what the coordinator holds if it applied everything."""
        return self._last.copy(), self._known.copy()

    def keyframe_due(self, now_s: float) -> bool:
        """Whether the next ``encode`` at ``now_s`` will be a keyframe."""
        return (
            self._keyframe_requested
            or self._last_keyframe_s is None
            or now_s - self._last_keyframe_s >= self.keyframe_interval_s
        )

    def request_keyframe(self) -> None:
        """The next ``encode`` sends absolute values (coordinator asked, or reconnect)."""
        self._keyframe_requested = True

    def restart_stream(self) -> None:
        """A new stream starts at sequence 1 with a keyframe."""
        self._seq = 0
        self._keyframe_requested = True

    def encode(
        self,
        values: np.ndarray,
        present: np.ndarray,
        *,
        now_s: float,
        sampled_at_ns: int,
        host_io: pb.HostIo | None = None,
        processes: Sequence[pb.GpuProcesses] = (),
        sample_interval_ms: int = 0,
        skip_empty: bool = False,
    ) -> tuple[pb.Envelope | None, pb.MetricBatch]:
        """One envelope for one sampling round.

        ``values`` is an int64 (GPUs x FIELDS) matrix in wire units, ``present``
        says which entries were read this round. Returns the envelope and the
        batch inside it (for tests and byte accounting). With ``skip_empty`` a
        delta that carries nothing returns no envelope and uses no sequence
        number (heartbeats keep the stream alive instead).
        """
        keyframe = self.keyframe_due(now_s)
        batch = pb.MetricBatch(
            sampled_at_ns=sampled_at_ns,
            keyframe=keyframe,
            sample_interval_ms=sample_interval_ms,
        )
        if keyframe:
            send = present
            wire = values
        else:
            # A field never sent before (came back after a failure) goes absolute
            # through the same delta path: its "last" is zero and it is unknown,
            # so force it out.
            moved = np.abs(values - self._last) >= DEADBANDS
            send = present & (moved | ~self._known)
            wire = values - self._last
        rows_with_data = send.any(axis=1)
        if keyframe:
            rows_with_data = np.ones(len(self.gpu_indices), dtype=bool)
        row_ids = np.flatnonzero(rows_with_data)
        batch.gpu_index.extend(self.gpu_indices[row_ids].tolist())
        if row_ids.size:
            sub_send = send[row_ids]
            sub_wire = wire[row_ids]
            for col in np.flatnonzero(sub_send.any(axis=0)):
                mask = sub_send[:, col]
                batch.columns.add(
                    field=_WIRE_FIELDS[col],
                    presence=_pack_mask(mask),
                    values=sub_wire[mask, col].tolist(),
                )
        if keyframe:
            self._last = np.where(present, values, 0)
            self._known = present.copy()
            self._last_keyframe_s = now_s
            self._keyframe_requested = False
        else:
            self._last = np.where(send, values, self._last)
            self._known |= send
        if host_io is not None:
            batch.host_io.CopyFrom(host_io)
        batch.processes.extend(processes)
        if skip_empty and not keyframe and not batch.columns and not batch.processes and host_io is None:
            return None, batch
        raw = batch.SerializeToString()
        self._seq += 1
        packed = snappy.compress(raw) if self.compress else raw
        if self.compress and len(packed) < len(raw):
            env = pb.Envelope(seq=self._seq, compression=pb.COMPRESSION_SNAPPY, raw_size=len(raw), payload=packed)
        else:
            # Small deltas do not compress; snappy's header would only add bytes.
            env = pb.Envelope(seq=self._seq, compression=pb.COMPRESSION_NONE, raw_size=len(raw), payload=raw)
        return env, batch


class DecodeOutcome(Enum):
    APPLIED = "applied"
    #: a gap or reordering: the decoder asks for a keyframe and ignores deltas
    RESYNC_NEEDED = "resync_needed"
    #: a delta while waiting for a keyframe, or a stale keyframe
    IGNORED = "ignored"


@dataclass(slots=True)
class DecodeResult:
    outcome: DecodeOutcome
    batch: pb.MetricBatch | None = None
    #: rows (into the decoder's GPU order) that received at least one value
    rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.intp))
    #: the decoder expected this sequence number (for RESYNC_NEEDED)
    expected_seq: int = 0


class TelemetryDecoder:
    """Coordinator side: Envelopes in, reconstructed per-GPU values out.

    ``values`` (float64, GPUs x FIELDS, NaN = unknown) is what the agent last
    sent. The first envelope of a stream must be a keyframe.
    """

    def __init__(self, gpu_indices: Sequence[int], *, max_raw_bytes: int = MAX_RAW_BATCH_BYTES) -> None:
        self.gpu_indices = list(gpu_indices)
        self._row_of = {idx: row for row, idx in enumerate(self.gpu_indices)}
        self._max_index = max(self.gpu_indices, default=-1)
        # index -> row lookup as an array for vectorised mapping
        self._row_lookup = np.full(self._max_index + 2, -1, dtype=np.intp)
        for idx, row in self._row_of.items():
            self._row_lookup[idx] = row
        self.max_raw_bytes = max_raw_bytes
        gpus = len(self.gpu_indices)
        self._state = np.zeros((gpus, FIELD_COUNT), dtype=np.int64)
        self._known = np.zeros((gpus, FIELD_COUNT), dtype=bool)
        self.expected_seq = 1
        self.awaiting_keyframe = True
        self.keyframes = 0
        self.applied = 0
        self.gaps = 0

    @property
    def values(self) -> np.ndarray:
        """Last values sent by the agent (float64, NaN where unknown)."""
        out = self._state.astype(np.float64)
        out[~self._known] = np.nan
        return out

    @property
    def known(self) -> np.ndarray:
        return self._known

    @property
    def ints(self) -> np.ndarray:
        return self._state

    def parse(self, env: pb.Envelope) -> pb.MetricBatch:
        """Decompress and parse an envelope's payload, within the size bound."""
        if env.raw_size > self.max_raw_bytes:
            raise PayloadTooLarge("raw_size", f"declared {env.raw_size} bytes, bound is {self.max_raw_bytes}")
        payload = env.payload
        if env.compression == pb.COMPRESSION_SNAPPY:
            declared = _snappy_declared_length(payload)
            if declared > self.max_raw_bytes:
                raise PayloadTooLarge("payload", f"snappy block declares {declared} bytes, bound is {self.max_raw_bytes}")
            if declared != env.raw_size:
                raise CorruptEnvelope("raw_size", f"says {env.raw_size} bytes but the snappy block declares {declared}")
            try:
                raw = snappy.uncompress(payload)
            except Exception as exc:  # the snappy binding raises several types
                raise CorruptEnvelope("payload", f"snappy decompression failed ({type(exc).__name__})") from None
        elif env.compression == pb.COMPRESSION_NONE:
            if len(payload) > self.max_raw_bytes:
                raise PayloadTooLarge("payload", f"{len(payload)} bytes, bound is {self.max_raw_bytes}")
            raw = payload
        else:
            raise CorruptEnvelope("compression", f"unknown compression {env.compression}")
        if len(raw) != env.raw_size:
            raise CorruptEnvelope("raw_size", f"says {env.raw_size} bytes, payload holds {len(raw)}")
        batch = pb.MetricBatch()
        try:
            batch.ParseFromString(raw)
        except DecodeError:
            raise CorruptEnvelope("payload", "not a valid MetricBatch") from None
        return batch

    def apply(self, env: pb.Envelope) -> DecodeResult:
        """Apply one envelope. Raises CodecError without changing state on bad input."""
        if env.seq == 0:
            raise CorruptEnvelope("seq", "sequence numbers start at 1")
        batch = self.parse(env)
        if env.seq != self.expected_seq and not (batch.keyframe and env.seq > self.expected_seq):
            if env.seq < self.expected_seq:
                # An old envelope (duplicate or reordered): its content is
                # already superseded; applying it would move values backwards.
                if self.awaiting_keyframe:
                    return DecodeResult(DecodeOutcome.IGNORED, batch, expected_seq=self.expected_seq)
                self.awaiting_keyframe = True
                self.gaps += 1
                return DecodeResult(DecodeOutcome.RESYNC_NEEDED, batch, expected_seq=self.expected_seq)
            # A gap: envelopes went missing. Deltas after it are unusable.
            first_gap = not self.awaiting_keyframe
            self.awaiting_keyframe = True
            self.gaps += int(first_gap)
            expected = self.expected_seq
            return DecodeResult(
                DecodeOutcome.RESYNC_NEEDED if first_gap else DecodeOutcome.IGNORED, batch, expected_seq=expected
            )
        if self.awaiting_keyframe and not batch.keyframe:
            self.expected_seq = env.seq + 1
            return DecodeResult(DecodeOutcome.IGNORED, batch, expected_seq=self.expected_seq)
        rows = self._rows_of(batch)
        if batch.keyframe:
            state = np.zeros_like(self._state)
            known = np.zeros_like(self._known)
        else:
            state = self._state.copy()
            known = self._known.copy()
        count = len(rows)
        seen_fields: set[int] = set()
        for position, col in enumerate(batch.columns):
            where = f"columns[{position}]"
            column = COLUMN.get(col.field)
            if column is None:
                raise CorruptEnvelope(f"{where}.field", f"unknown field {col.field}")
            if column in seen_fields:
                raise CorruptEnvelope(f"{where}.field", f"{FIELDS[column].name} appears twice")
            seen_fields.add(column)
            mask = _unpack_mask(col.presence, count, f"{where}.presence")
            vals = np.asarray(col.values, dtype=np.int64)
            if vals.shape[0] != int(mask.sum()):
                raise CorruptEnvelope(
                    f"{where}.values", f"{vals.shape[0]} values for {int(mask.sum())} present GPUs"
                )
            target = rows[mask]
            if batch.keyframe:
                state[target, column] = vals
            else:
                # A delta for a field the coordinator never had is an absolute value
                # (the encoder sends it against zero).
                state[target, column] = np.where(known[target, column], state[target, column], 0) + vals
            known[target, column] = True
            got = state[target, column]
            bad = (got < LOWER[column]) | (got > UPPER[column])
            if bad.any():
                first = int(np.flatnonzero(bad)[0])
                gpu = self.gpu_indices[int(target[first])]
                spec = FIELDS[column]
                raise InvalidReading(
                    spec.name,
                    f"GPU {gpu}: {int(got[first])} {spec.unit} outside {spec.lo}..{spec.hi}",
                )
        self._state = state
        self._known = known
        self.expected_seq = env.seq + 1
        self.applied += 1
        if batch.keyframe:
            self.awaiting_keyframe = False
            self.keyframes += 1
        return DecodeResult(DecodeOutcome.APPLIED, batch, rows=rows)

    def _rows_of(self, batch: pb.MetricBatch) -> np.ndarray:
        idx = np.asarray(batch.gpu_index, dtype=np.int64)
        if idx.size == 0:
            return np.zeros(0, dtype=np.intp)
        out_of_range = (idx < 0) | (idx > self._max_index)
        rows = np.full(idx.shape, -1, dtype=np.intp)
        in_range = ~out_of_range
        rows[in_range] = self._row_lookup[idx[in_range]]
        if (rows < 0).any():
            first = int(np.flatnonzero(rows < 0)[0])
            raise InvalidReading(f"gpu_index[{first}]", f"GPU {int(idx[first])} was never registered")
        if np.unique(rows).size != rows.size:
            raise CorruptEnvelope("gpu_index", "a GPU appears twice in one batch")
        return rows
