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
from itertools import chain
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
    "check_columns",
    "extract_columns",
    "batch_cells",
    "column_cells",
    "Columns",
    "DEADBANDS",
    "LOWER",
    "UPPER",
]

#: Bound on a decompressed MetricBatch. A batch of 64 GPUs with every field and
#: a long process list is a few KiB; 1 MiB leaves room and stops a zip bomb.
MAX_RAW_BATCH_BYTES = 1 << 20
#: Sequence numbers stay far below uint64's end, so seq + 1 never overflows the
#: coordinator's replies (at 5 envelopes/s, 2**62 lasts longer than the universe).
_MAX_SEQ = 1 << 62

DEADBANDS = np.array([spec.deadband for spec in FIELDS], dtype=np.int64)
LOWER = np.array([spec.lo for spec in FIELDS], dtype=np.int64)
UPPER = np.array([spec.hi for spec in FIELDS], dtype=np.int64)
_WIRE_FIELDS = [spec.field for spec in FIELDS]
#: distinct gpu_index lists a decoder remembers the rows of
_ROWS_CACHE_SIZE = 64

#: a checked batch's columns: (column indices, presence bitmaps, value lists)
Columns = tuple[list[int], list[bytes], list]


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
        refresh_interval_s: float = 5.0,
    ) -> None:
        self.gpu_indices = np.asarray(gpu_indices, dtype=np.uint32)
        self.keyframe_interval_s = keyframe_interval_s
        # an empty delta still goes out after this long without an envelope:
        # it tells the coordinator the readings it holds are still current
        self.refresh_interval_s = refresh_interval_s
        self._last_sent_s = -np.inf
        self.compress = compress
        gpus = len(self.gpu_indices)
        self._last = np.zeros((gpus, FIELD_COUNT), dtype=np.int64)
        self._known = np.zeros((gpus, FIELD_COUNT), dtype=bool)
        # The period last told to the coordinator: a change goes out even in
        # an otherwise empty delta, or a host that calmed down would be shown
        # (and re-read by the view) at 200 ms until the next keyframe.
        self._sent_interval_ms = 0
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
        number, unless the period changed or nothing went out for
        ``refresh_interval_s`` (then the empty delta vouches for the readings).
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
        if (
            skip_empty
            and not keyframe
            and not batch.columns
            and not batch.processes
            and host_io is None
            and sample_interval_ms == self._sent_interval_ms
            and now_s - self._last_sent_s < self.refresh_interval_s
        ):
            return None, batch
        self._sent_interval_ms = sample_interval_ms
        self._last_sent_s = now_s
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
    #: the batch's columns as checked by ``admit``: (column indices, presence
    #: bitmaps, value containers), so the tick need not walk the batch again
    columns: "Columns | None" = None


class TelemetryDecoder:
    """Coordinator side: Envelopes in, reconstructed per-GPU values out.

    ``values`` (float64, GPUs x FIELDS, NaN = unknown) is what the agent last
    sent. The first envelope of a stream must be a keyframe.
    """

    def __init__(self, gpu_indices: Sequence[int], *, max_raw_bytes: int = MAX_RAW_BATCH_BYTES) -> None:
        self.gpu_indices = list(gpu_indices)
        self._row_of = {idx: row for row, idx in enumerate(self.gpu_indices)}
        #: gpu_index lists seen before -> their rows (read-only arrays); an
        #: agent sends the same few lists over and over
        self._rows_cache: dict[tuple[int, ...], np.ndarray] = {}
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

    def _sequence(self, env: pb.Envelope, batch: pb.MetricBatch) -> DecodeResult | None:
        """The sequence check. Returns a result for an envelope that must not be
        applied (and updates the gap state), None for one that is in order."""
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
        return None

    def _commit_sequence(self, env: pb.Envelope, batch: pb.MetricBatch) -> None:
        self.expected_seq = env.seq + 1
        self.applied += 1
        if batch.keyframe:
            self.awaiting_keyframe = False
            self.keyframes += 1

    def admit(self, env: pb.Envelope) -> DecodeResult:
        """Parse, check the sequence and the batch's structure, and advance the
        sequence - without applying values. The coordinator applies the values
        of many admitted envelopes at once (``coordinator.ingest``); range
        checks happen there. Raises CodecError on malformed input."""
        if not 0 < env.seq < _MAX_SEQ:
            raise CorruptEnvelope("seq", f"{env.seq} is not a sequence number (1..{_MAX_SEQ - 1})")
        batch = self.parse(env)
        result = self._sequence(env, batch)
        if result is not None:
            return result
        rows = self._rows_of(batch)
        columns = extract_columns(batch, len(rows))
        self._commit_sequence(env, batch)
        return DecodeResult(DecodeOutcome.APPLIED, batch, rows=rows, columns=columns)

    def apply(self, env: pb.Envelope) -> DecodeResult:
        """Admit and apply one envelope to this decoder's own state. Raises
        CodecError without changing state on bad input."""
        if not 0 < env.seq < _MAX_SEQ:
            raise CorruptEnvelope("seq", f"{env.seq} is not a sequence number (1..{_MAX_SEQ - 1})")
        batch = self.parse(env)
        result = self._sequence(env, batch)
        if result is not None:
            return result
        rows = self._rows_of(batch)
        check_columns(batch, len(rows))
        target_rows, target_cols, values = batch_cells([(rows, batch)])[:3]
        if batch.keyframe:
            new = values
        else:
            # A delta for a field the coordinator never had is an absolute value
            # (the encoder sends it against zero).
            base = np.where(self._known[target_rows, target_cols], self._state[target_rows, target_cols], 0)
            new = base + values
        bad = (new < LOWER[target_cols]) | (new > UPPER[target_cols])
        if bad.any():
            first = int(np.flatnonzero(bad)[0])
            spec = FIELDS[int(target_cols[first])]
            gpu = self.gpu_indices[int(target_rows[first])]
            raise InvalidReading(spec.name, f"GPU {gpu}: {int(new[first])} {spec.unit} outside {spec.lo}..{spec.hi}")
        # Validated: only now does the state change.
        if batch.keyframe:
            self._state[:] = 0
            self._known[:] = False
        self._state[target_rows, target_cols] = new
        self._known[target_rows, target_cols] = True
        self._commit_sequence(env, batch)
        return DecodeResult(DecodeOutcome.APPLIED, batch, rows=rows)

    def _rows_of(self, batch: pb.MetricBatch) -> np.ndarray:
        key = tuple(batch.gpu_index)
        rows = self._rows_cache.get(key)
        if rows is not None:
            return rows
        rows = self._rows_uncached(batch)
        if len(self._rows_cache) < _ROWS_CACHE_SIZE:
            rows.flags.writeable = False
            self._rows_cache[key] = rows
        return rows

    def _rows_uncached(self, batch: pb.MetricBatch) -> np.ndarray:
        row_of = self._row_of
        try:
            rows = [row_of[index] for index in batch.gpu_index]
        except KeyError:
            first = next(i for i, index in enumerate(batch.gpu_index) if index not in row_of)
            raise InvalidReading(f"gpu_index[{first}]", f"GPU {batch.gpu_index[first]} was never registered") from None
        if len(set(rows)) != len(rows):
            raise CorruptEnvelope("gpu_index", "a GPU appears twice in one batch")
        return np.asarray(rows, dtype=np.intp)


def check_columns(batch: pb.MetricBatch, count: int) -> None:
    """Structural checks of a batch's columns, in plain Python (a handful of
    columns per batch): known and unique fields, presence bitmaps of the right
    width with no bits past the last GPU, one value per set bit."""
    extract_columns(batch, count)


def extract_columns(batch: pb.MetricBatch, count: int) -> Columns:
    """``check_columns``, returning what it walked: each column's index,
    presence bitmap and values, in wire order (what ``batch_cells`` needs)."""
    width = (count + 7) // 8
    limit = 1 << count
    columns: list[int] = []
    presences: list[bytes] = []
    values: list = []
    column_of = COLUMN.get
    for col in batch.columns:
        presence = col.presence
        bits = int.from_bytes(presence, "little")
        vals = col.values
        column = column_of(col.field)
        if column is None or len(presence) != width or bits >= limit or bits.bit_count() != len(vals):
            _column_error(batch, count)
        columns.append(column)
        presences.append(presence)
        values.append(vals)
    if len(set(columns)) != len(columns):
        _column_error(batch, count)
    return columns, presences, values


def _column_error(batch: pb.MetricBatch, count: int) -> None:
    """Find and report the first structural fault (the slow path)."""
    width = (count + 7) // 8
    seen: set[int] = set()
    for position, col in enumerate(batch.columns):
        column = COLUMN.get(col.field)
        if column is None:
            raise CorruptEnvelope(f"columns[{position}].field", f"unknown field {col.field}")
        if column in seen:
            raise CorruptEnvelope(f"columns[{position}].field", f"{FIELDS[column].name} appears twice")
        seen.add(column)
        if len(col.presence) != width:
            raise CorruptEnvelope(
                f"columns[{position}].presence", f"presence has {len(col.presence)} bytes, expected {width} for {count} GPUs"
            )
        bits = int.from_bytes(col.presence, "little")
        if bits >> count:
            raise CorruptEnvelope(f"columns[{position}].presence", f"bits set past the {count} GPUs of the batch")
        if bits.bit_count() != len(col.values):
            raise CorruptEnvelope(
                f"columns[{position}].values", f"{len(col.values)} values for {bits.bit_count()} present GPUs"
            )


def batch_cells(
    items: Sequence[tuple[np.ndarray, pb.MetricBatch]],
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every (row, column, value, item) cell carried by checked batches.

    ``items`` pairs each batch with the rows its ``gpu_index`` entries map to.
    However many batches and columns there are, this is a fixed number of
    numpy operations: all presence bitmaps are unpacked in one call. Cells come
    out in wire order: batch by batch, column by column, GPU by GPU.
    """
    return column_cells([(rows, _columns_unchecked(batch)) for rows, batch in items])


def _columns_unchecked(batch: pb.MetricBatch) -> Columns:
    cols = batch.columns
    return [COLUMN[c.field] for c in cols], [c.presence for c in cols], [c.values for c in cols]


def column_cells(
    items: Sequence[tuple[np.ndarray, Columns]],
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``batch_cells`` for columns already extracted (``extract_columns``)."""
    presence: list[bytes] = []
    seg_column: list[int] = []
    seg_item: list[int] = []
    seg_count: list[int] = []
    value_lists: list = []
    row_parts: list[np.ndarray] = []
    for item, (rows, (columns, presences, values)) in enumerate(items):
        row_parts.append(rows)
        n = len(columns)
        if n:
            seg_column += columns
            presence += presences
            value_lists += values
            seg_item += [item] * n
            seg_count += [len(rows)] * n
    if not presence:
        empty = np.zeros(0, dtype=np.intp)
        return empty, empty, np.zeros(0, dtype=np.int64), empty
    counts = np.asarray(seg_count, dtype=np.intp)
    widths = (counts + 7) // 8
    bits = np.unpackbits(np.frombuffer(b"".join(presence), dtype=np.uint8), bitorder="little")
    seg_bit_start = np.cumsum(widths * 8) - widths * 8
    total = int(counts.sum())
    seg_of = np.repeat(np.arange(len(counts)), counts)
    gpu_pos = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
    present = bits[seg_bit_start[seg_of] + gpu_pos].astype(bool)
    item_lengths = np.asarray([len(r) for r in row_parts], dtype=np.intp)
    item_offset = np.cumsum(item_lengths) - item_lengths
    all_rows = np.concatenate(row_parts) if len(row_parts) > 1 else np.asarray(row_parts[0], dtype=np.intp)
    seg_item_arr = np.asarray(seg_item, dtype=np.intp)
    rows = all_rows[item_offset[seg_item_arr[seg_of]] + gpu_pos][present]
    columns = np.asarray(seg_column, dtype=np.intp)[seg_of][present]
    items_of = seg_item_arr[seg_of][present]
    values = np.fromiter(chain.from_iterable(value_lists), dtype=np.int64, count=len(rows))
    return rows, columns, values, items_of
