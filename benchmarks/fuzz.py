"""Fuzzing of everything gpulb accepts from the network (issue 7, "Fuzzing").

Targets, each fed by hypothesis:

* ``decoder.apply``: the coordinator's ``TelemetryDecoder`` with state (a
  primed keyframe, sequence position), fed arbitrary and structured-but-wrong
  envelopes: random bytes, random compression values and sizes, valid snappy
  around random protobuf, snappy bombs, MetricBatches with random columns,
  presence bitmaps, values and GPU indexes. Property: applied, or a
  ``CodecError`` subclass with a non-empty ``field``; nothing else raised, no
  hang, and on error the decoder's state is unchanged.
* ``decoder.admit+ingest``: the coordinator's path (``admit`` then
  ``coordinator.ingest``) for a fuzzed node next to a well-behaved one: only
  CodecErrors from admit, rejections name a field, the well-behaved node's
  view is exactly what its encoder sent and it is never rejected.
* one target per RPC of ``ClusterOperator`` and ``Scheduler``, through a real
  coordinator on loopback with a SimFleet of sim hosts: every request is
  generated from the request's protobuf descriptor (NaN, inf, negative, huge,
  unicode, empty, unknown enum values, random maps, unknown fields), with
  hints that reach the deep paths (real node, task and lease ids, policy and
  weight names). Property: OK, or one of the precise codes with a non-empty
  detail; INVALID_ARGUMENT names a field of the request; never UNKNOWN,
  INTERNAL or a deadline (a hang).
* ``AgentGateway.Connect``: generated agent streams (register, telemetry,
  heartbeats, task events, a second register, empty messages), same property.
* ``wire.undecodable``: bytes that are not a valid request message, sent to
  every unary method.

Run ``python benchmarks/fuzz.py`` (10,000 inputs per target, a progress line
per target and a final table; ``--count N``, ``--json``, ``--only PATTERN``).
``tests/test_fuzz.py`` runs the same targets with a small count.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import re
import sys
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import grpc
import numpy as np
import snappy
import structlog
from google.protobuf import descriptor_pool, message_factory
from google.protobuf.descriptor import FieldDescriptor as FD
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.fleet import SimFleet  # noqa: E402
from coordinator.config import CoordinatorConfig  # noqa: E402
from coordinator.convert import _GPU_FIELDS, METRIC_ALIASES  # noqa: E402
from coordinator.ingest import TelemetryIngest  # noqa: E402
from coordinator.server import Coordinator  # noqa: E402
from coordinator.view import ClusterView  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402
from protos import cluster_pb2 as cpb  # noqa: E402
from protos import tasks_pb2 as tpb  # noqa: E402
from protos import telemetry_pb2 as pb  # noqa: E402
from protos.codec import (  # noqa: E402
    MAX_RAW_BATCH_BYTES,
    CodecError,
    CorruptEnvelope,
    DecodeOutcome,
    InvalidReading,
    PayloadTooLarge,
    TelemetryDecoder,
    TelemetryEncoder,
)
from protos.fields import FIELD_COUNT, FIELDS  # noqa: E402

__all__ = [
    "ALLOWED_CODES",
    "Outcome",
    "Tally",
    "LiveCluster",
    "Client",
    "RPC_TARGETS",
    "KNOWN_BUGS",
    "classify_status",
    "decoder_case",
    "ingest_case",
    "agent_stream",
    "run_decoder_case",
    "run_ingest_case",
    "run_target",
    "fuzz_settings",
]

#: the statuses a request may fail with: each says precisely what was wrong
ALLOWED_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.OUT_OF_RANGE,
    }
)

#: a detail that names a field starts with its path: ``spec.vram_mib:``,
#: ``metrics[2]:``, ``weights[x]:``, ``telemetry.columns[0].presence:``
_FIELD_PATH = re.compile(r"([a-z_][a-z0-9_]*)(?:\[.*?\]|\.[a-z_][a-z0-9_]*)*:", re.S)

#: per-call deadline: a call still running after this long is a hang
CALL_TIMEOUT_S = 5.0
#: a watch that may wait for events: still open this long without a status = accepted
OPEN_STREAM_S = 0.25
STREAM_TIMEOUT_S = 5.0

_CODEC_STATUS = {CorruptEnvelope: "INVALID_ARGUMENT", InvalidReading: "INVALID_ARGUMENT", PayloadTooLarge: "RESOURCE_EXHAUSTED"}


# =====================================================================================
# outcomes
# =====================================================================================
@dataclass(frozen=True)
class Outcome:
    """One input's result: ``ok``, an error ``kind`` (status code or CodecError
    class), or ``unexpected`` with why."""

    kind: str  # "OK", a status code name, a CodecError class name, or "UNEXPECTED"
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.kind == "OK"

    @property
    def unexpected(self) -> bool:
        return self.kind == "UNEXPECTED"


def classify_status(code: grpc.StatusCode, details: str | None, roots: frozenset[str]) -> Outcome:
    """Judge a final status against the property. ``roots`` are the names an
    INVALID_ARGUMENT detail may start with (the request's fields)."""
    details = details or ""
    if code == grpc.StatusCode.OK:
        return Outcome("OK")
    if code not in ALLOWED_CODES:
        what = "a hang (deadline exceeded)" if code == grpc.StatusCode.DEADLINE_EXCEEDED else "imprecise status"
        return Outcome("UNEXPECTED", f"{what}: {code.name}: {details}")
    if not details.strip():
        return Outcome("UNEXPECTED", f"{code.name} with an empty detail")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        match = _FIELD_PATH.match(details)
        if match is None or match.group(1) not in roots:
            return Outcome("UNEXPECTED", f"INVALID_ARGUMENT detail names no field of the request: {details!r}")
    return Outcome(code.name)


@dataclass
class Tally:
    """Counts of one target's outcomes, with the first unexpected inputs kept."""

    target: str
    inputs: int = 0
    ok: int = 0
    errors: Counter = field(default_factory=Counter)
    unexpected: int = 0
    examples: list[tuple[str, str]] = field(default_factory=list)  # (input repr, why)
    known_examples: list[tuple[str, str]] = field(default_factory=list)  # inputs that met a known bug
    seconds: float = 0.0
    keep: int = 5

    def add(self, outcome: Outcome, shown: Callable[[], str]) -> None:
        self.inputs += 1
        if outcome.ok:
            self.ok += 1
        elif outcome.unexpected:
            self.unexpected += 1
            if len(self.examples) < self.keep:
                self.examples.append((shown()[:2000], outcome.detail[:2000]))
        else:
            self.errors[outcome.kind] += 1
            if outcome.kind.startswith("KNOWN_BUG") and len(self.known_examples) < self.keep:
                self.known_examples.append((shown()[:4000], outcome.detail[:500]))

    def row(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "inputs": self.inputs,
            "ok": self.ok,
            "errors": dict(sorted(self.errors.items())),
            "unexpected": self.unexpected,
            "seconds": round(self.seconds, 2),
            "unexpected_examples": [{"input": i, "why": w} for i, w in self.examples],
            "known_bug_examples": [{"input": i, "why": w} for i, w in self.known_examples],
        }


# =====================================================================================
# generic protobuf strategies (from descriptors)
# =====================================================================================
_INT_RANGES = {
    FD.TYPE_INT32: (-(2**31), 2**31 - 1),
    FD.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FD.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FD.TYPE_UINT32: (0, 2**32 - 1),
    FD.TYPE_FIXED32: (0, 2**32 - 1),
    FD.TYPE_INT64: (-(2**63), 2**63 - 1),
    FD.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FD.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FD.TYPE_UINT64: (0, 2**64 - 1),
    FD.TYPE_FIXED64: (0, 2**64 - 1),
}
_EDGE_INTS = (0, 1, -1, 2, 7, 8, 64, 65, 100, 127, 128, 200, 1024, 65535, 2**31 - 1, 2**31, 2**32 - 1, 2**53 + 1, 2**63 - 1)


def ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    """Integers in ``lo..hi`` biased to the edges and to small values."""
    candidates = _EDGE_INTS + tuple(-v for v in _EDGE_INTS) + (lo, hi, lo + 1, hi - 1)
    edges = sorted({v for v in candidates if lo <= v <= hi})
    return st.one_of(st.sampled_from(edges), st.integers(max(lo, -300), min(hi, 300)), st.integers(lo, hi))


#: doubles: NaN, infinities, negative zero, huge, subnormal, plausible
DOUBLES = st.one_of(
    st.sampled_from([0.0, -0.0, math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324, 1.0, 0.5, -1.0, 2.0**63, 2.0**64, 1e-9]),
    st.floats(min_value=-10.0, max_value=1e5),
    st.floats(allow_nan=True, allow_infinity=True),
)
#: strings: empty, unicode, control characters, long, look-alikes
TEXT = st.one_of(
    st.sampled_from(["", " ", "\x00", "\t\n", "a" * 200, "é", "🎉", "\u202e", "../..", "%s%n", "NaN", "-1", "sim-01 "]),
    st.text(max_size=24),
    st.text(st.characters(codec="ascii"), max_size=12),
)
BYTES = st.one_of(st.binary(max_size=40), st.sampled_from([b"", b"\x00", b"\xff" * 9]))


def _scalar(f) -> st.SearchStrategy:
    if f.type in _INT_RANGES:
        return ints(*_INT_RANGES[f.type])
    if f.type == FD.TYPE_DOUBLE:
        return DOUBLES
    if f.type == FD.TYPE_FLOAT:
        return st.floats(width=32, allow_nan=True, allow_infinity=True)
    if f.type == FD.TYPE_BOOL:
        return st.booleans()
    if f.type == FD.TYPE_STRING:
        return TEXT
    if f.type == FD.TYPE_BYTES:
        return BYTES
    if f.type == FD.TYPE_ENUM:
        known = sorted(v.number for v in f.enum_type.values)
        return st.one_of(st.sampled_from(known), ints(-(2**31), 2**31 - 1))
    raise TypeError(f"no strategy for {f.full_name}")


Hints = dict[str, st.SearchStrategy]


def _value(f, hints: Hints, replace: frozenset[str], depth: int) -> st.SearchStrategy:
    """A strategy for one (non-repeated) value of field ``f``."""
    if f.type == FD.TYPE_MESSAGE:
        generic = messages(f.message_type, hints, replace, depth + 1)
    else:
        generic = _scalar(f)
    hint = hints.get(f.full_name)
    if hint is None:
        return generic
    return hint if f.full_name in replace else st.one_of(hint, generic)


def messages(desc, hints: Hints | None = None, replace: frozenset[str] = frozenset(), depth: int = 0) -> st.SearchStrategy:
    """Any message of type ``desc``: each field absent or a generated value,
    maps and repeated fields of 0..5 entries; ``hints`` (field full name ->
    strategy) are mixed into the generic values, or replace them for names in
    ``replace``."""
    hints = hints or {}
    cls = message_factory.GetMessageClass(desc)
    if depth > 3:
        return st.builds(cls)
    parts = {}
    for f in desc.fields:
        strategy = field_values(f, hints, replace, depth)
        parts[f.name] = st.none() | strategy if f.full_name not in replace else strategy
    return st.fixed_dictionaries(parts).map(lambda values: _fill(cls(), desc, values))


def field_values(f, hints: Hints | None = None, replace: frozenset[str] = frozenset(), depth: int = 0) -> st.SearchStrategy:
    """Values for field ``f`` as ``_fill`` takes them: a dict for a map, a
    list for a repeated field, else one value."""
    hints = hints or {}
    if f.type == FD.TYPE_MESSAGE and f.message_type.GetOptions().map_entry:
        key = _value(f.message_type.fields_by_name["key"], hints, replace, depth)
        val = _value(f.message_type.fields_by_name["value"], hints, replace, depth)
        strategy = st.dictionaries(key, val, max_size=5)
        if f.full_name in hints:
            strategy = hints[f.full_name] if f.full_name in replace else st.one_of(hints[f.full_name], strategy)
        return strategy
    if f.is_repeated:
        return st.lists(_value(f, hints, replace, depth), max_size=5)
    return _value(f, hints, replace, depth)


@st.composite
def mutated(draw, valid: st.SearchStrategy, hints: Hints | None = None, replace: frozenset[str] = frozenset()):
    """A valid message with one field (of it, or of a message field of it)
    replaced by a generated value: the inputs that test one check at a time."""
    original = draw(valid)
    msg = type(original)()
    msg.CopyFrom(original)  # st.just() hands out one object: never change it
    target = msg
    desc = msg.DESCRIPTOR
    if not desc.fields:
        return msg
    while True:
        f = draw(st.sampled_from(list(desc.fields)))
        nested = f.type == FD.TYPE_MESSAGE and not f.is_repeated and not f.message_type.GetOptions().map_entry
        if nested and draw(st.booleans()):
            target = getattr(target, f.name)
            desc = f.message_type
            continue
        break
    target.ClearField(f.name)
    _fill(target, desc, {f.name: draw(field_values(f, hints, replace))})
    return msg


def _fill(msg, desc, values: dict[str, Any]):
    for name, value in values.items():
        if value is None:
            continue
        f = desc.fields_by_name[name]
        if f.type == FD.TYPE_MESSAGE and f.message_type.GetOptions().map_entry:
            target = getattr(msg, name)
            message_values = f.message_type.fields_by_name["value"].type == FD.TYPE_MESSAGE
            for k, v in value.items():
                if message_values:
                    target[k].CopyFrom(v)
                else:
                    target[k] = v
        elif f.is_repeated:
            getattr(msg, name).extend(value)
        elif f.type == FD.TYPE_MESSAGE:
            getattr(msg, name).CopyFrom(value)
            getattr(msg, name).SetInParent()
        else:
            setattr(msg, name, value)
    return msg


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _unknown_field(number: int, wire: int, num: int, blob: bytes) -> bytes:
    tag = _varint((number << 3) | wire)
    if wire == 0:
        return tag + _varint(num)
    if wire == 1:
        return tag + num.to_bytes(8, "little")
    if wire == 5:
        return tag + (num & 0xFFFFFFFF).to_bytes(4, "little")
    return tag + _varint(len(blob)) + blob


#: well-formed fields with numbers no request uses: a server must ignore them
UNKNOWN_FIELDS = st.lists(
    st.builds(_unknown_field, st.integers(1000, 2**29 - 1), st.sampled_from([0, 1, 2, 5]), st.integers(0, 2**64 - 1), st.binary(max_size=16)),
    max_size=3,
).map(b"".join)


# =====================================================================================
# telemetry envelopes: arbitrary and structured-but-wrong
# =====================================================================================
_VALID_FIELDS = [spec.field for spec in FIELDS]


def _reading(column: int) -> st.SearchStrategy[int]:
    spec = FIELDS[column]
    return st.integers(spec.lo, spec.hi)


SINT64 = ints(-(2**63), 2**63 - 1)


@st.composite
def field_columns(draw, count: int, valid: bool) -> list[pb.FieldColumn]:
    """Columns for a batch of ``count`` GPU entries; ``valid`` keeps them
    structurally right (right width, one value per bit, known unique fields)."""
    out = []
    if valid:
        chosen = draw(st.lists(st.integers(0, FIELD_COUNT - 1), unique=True, max_size=FIELD_COUNT))
        for column in chosen:
            bits = draw(st.lists(st.booleans(), min_size=count, max_size=count))
            presence = np.packbits(np.asarray(bits, dtype=bool), bitorder="little").tobytes() if count else b""
            values = [draw(st.one_of(_reading(column), ints(-3, 3), SINT64)) for bit in bits if bit]
            out.append(pb.FieldColumn(field=_VALID_FIELDS[column], presence=presence, values=values))
        return out
    for _ in range(draw(st.integers(0, 5))):
        fld = draw(st.one_of(st.sampled_from(_VALID_FIELDS), ints(-(2**31), 2**31 - 1)))
        width = (count + 7) // 8
        presence = draw(
            st.one_of(
                st.binary(min_size=width, max_size=width),
                st.binary(max_size=width + 2),
                st.just(b"\xff" * width),
            )
        )
        values = draw(st.lists(SINT64, max_size=count + 2))
        out.append(pb.FieldColumn(field=fld, presence=presence, values=values))
    return out


@st.composite
def metric_batches(draw, gpus: list[int]) -> pb.MetricBatch:
    """A MetricBatch for a host that registered ``gpus``: usually structurally
    valid with random (often out-of-range) values, sometimes wrong in GPU
    indexes (unregistered, repeated) or columns."""
    registered = draw(st.permutations(gpus)) if gpus else []
    subset = registered[: draw(st.integers(0, len(registered)))]
    index_shape = draw(st.sampled_from(["registered", "registered", "registered", "foreign", "duplicate", "random"]))
    if index_shape == "foreign":
        subset = subset + [draw(ints(0, 2**32 - 1))]
    elif index_shape == "duplicate" and subset:
        subset = subset + [subset[0]]
    elif index_shape == "random":
        subset = draw(st.lists(ints(0, 2**32 - 1), max_size=6))
    valid_columns = draw(st.booleans()) or draw(st.booleans())
    batch = pb.MetricBatch(
        sampled_at_ns=draw(ints(-(2**63), 2**63 - 1)),
        keyframe=draw(st.booleans()),
        gpu_index=subset,
        columns=draw(field_columns(len(subset), valid_columns)),
        sample_interval_ms=draw(ints(0, 2**32 - 1)),
    )
    if draw(st.booleans()):
        io = batch.host_io
        io.SetInParent()
        if draw(st.booleans()):
            io.disk_await_us = draw(ints(0, 2**32 - 1))
        if draw(st.booleans()):
            io.disk_util_permille = draw(ints(0, 2**32 - 1))
    for _ in range(draw(st.integers(0, 2))):
        entry = batch.processes.add(gpu_index=draw(st.one_of(st.sampled_from(gpus or [0]), ints(0, 2**32 - 1))))
        for _ in range(draw(st.integers(0, 2))):
            entry.processes.add(pid=draw(ints(0, 2**32 - 1)), used_memory_mib=draw(ints(0, 2**64 - 1)))
    return batch


def _bomb_payloads() -> list[tuple[str, int, bytes]]:
    """(what, raw_size, payload) of snappy payloads that must not be inflated."""
    over = MAX_RAW_BATCH_BYTES + 1
    zeros = snappy.compress(b"\x00" * over)
    return [
        ("declares 4 GiB", 2**32 - 1, _varint(2**32 - 1) + b"\x00" * 16),
        ("declares 2**35 (5-byte varint)", 0, _varint(2**35 - 1) + b"\x00" * 8),
        ("unterminated varint", 0, b"\xff" * 6),
        ("real 1 MiB + 1 of zeros, honest raw_size", over, zeros),
        ("real 1 MiB + 1 of zeros, raw_size says 10", 10, zeros),
        ("declares the bound, payload short", MAX_RAW_BATCH_BYTES, _varint(MAX_RAW_BATCH_BYTES) + b"\x00\x01"),
        ("declares the bound, honest raw_size, copy ops past the output", MAX_RAW_BATCH_BYTES, _varint(MAX_RAW_BATCH_BYTES) + b"\x02" * 40),
    ]


BOMBS = _bomb_payloads()


@dataclass(frozen=True)
class EnvelopeSpec:
    """An envelope to build against the receiver's sequence position:
    ``seq_offset`` from the expected sequence number, or ``seq`` absolute."""

    payload: bytes
    compression: int
    raw_size: int
    seq_offset: int | None = 0
    seq: int = 0
    what: str = ""

    def build(self, expected_seq: int) -> pb.Envelope:
        seq = self.seq if self.seq_offset is None else min(max(0, expected_seq + self.seq_offset), 2**64 - 1)
        return pb.Envelope(seq=seq, compression=self.compression, raw_size=self.raw_size, payload=self.payload)


def seqs() -> st.SearchStrategy[tuple[int | None, int]]:
    """(offset from the expected sequence number, or None and an absolute one)."""
    return st.one_of(
        st.just((0, 0)),
        st.just((0, 0)),
        st.sampled_from([(1, 0), (5, 0), (-1, 0), (-3, 0)]),
        ints(0, 2**64 - 1).map(lambda s: (None, s)),
    )


@st.composite
def wrapped(draw, raw: bytes, what: str) -> EnvelopeSpec:
    """``raw`` as an envelope payload: honest, or with wrong sizes, unknown
    compression or damaged snappy."""
    offset, seq = draw(seqs())
    way = draw(st.sampled_from(["snappy", "snappy", "none", "none", "bad_size", "corrupt", "unknown_compression"]))
    if way == "none":
        return EnvelopeSpec(raw, pb.COMPRESSION_NONE, len(raw), offset, seq, what + "/none")
    packed = snappy.compress(raw)
    if way == "snappy":
        return EnvelopeSpec(packed, pb.COMPRESSION_SNAPPY, len(raw), offset, seq, what + "/snappy")
    if way == "bad_size":
        size = draw(st.one_of(ints(0, 2**32 - 1), st.integers(max(0, len(raw) - 2), len(raw) + 2)))
        compression = draw(st.sampled_from([pb.COMPRESSION_NONE, pb.COMPRESSION_SNAPPY]))
        return EnvelopeSpec(packed if compression else raw, compression, size, offset, seq, what + "/bad_size")
    if way == "corrupt":
        data = bytearray(packed)
        position = draw(st.integers(0, max(0, len(data) - 1)))
        if data and draw(st.booleans()):
            data[position] ^= draw(st.integers(1, 255))
        else:
            data = data[: position]
        return EnvelopeSpec(bytes(data), pb.COMPRESSION_SNAPPY, len(raw), offset, seq, what + "/corrupt")
    compression = draw(ints(-(2**31), 2**31 - 1).filter(lambda c: c not in (0, 1)))
    return EnvelopeSpec(raw, compression, len(raw), offset, seq, what + "/unknown_compression")


@st.composite
def envelopes(draw, gpus: list[int]) -> EnvelopeSpec:
    """An envelope for a host that registered ``gpus``."""
    kind = draw(st.sampled_from(["batch"] * 6 + ["random_protobuf", "random_bytes", "arbitrary", "bomb"]))
    if kind == "batch":
        return draw(wrapped(draw(metric_batches(gpus)).SerializeToString(), "batch"))
    if kind == "random_protobuf":
        return draw(wrapped(draw(UNKNOWN_FIELDS | st.binary(max_size=64)), "random_protobuf"))
    if kind == "random_bytes":
        return draw(wrapped(draw(st.binary(max_size=64)), "random_bytes"))
    if kind == "bomb":
        what, size, payload = draw(st.sampled_from(BOMBS))
        offset, seq = draw(seqs())
        return EnvelopeSpec(payload, pb.COMPRESSION_SNAPPY, size, offset, seq, "bomb: " + what)
    # every field arbitrary
    return EnvelopeSpec(
        payload=draw(st.binary(max_size=64)),
        compression=draw(st.one_of(st.sampled_from([0, 1]), ints(-(2**31), 2**31 - 1))),
        raw_size=draw(ints(0, 2**32 - 1)),
        seq_offset=None,
        seq=draw(ints(0, 2**64 - 1)),
        what="arbitrary",
    )


GPU_SETS = st.lists(st.one_of(st.integers(0, 9), st.integers(0, 1023)), min_size=1, max_size=9, unique=True)


@dataclass
class DecoderCase:
    gpus: list[int]
    prime_seed: int | None  # a valid keyframe first (the decoder has state)
    steps: list[EnvelopeSpec]


@st.composite
def decoder_case(draw) -> DecoderCase:
    gpus = draw(GPU_SETS)
    prime = draw(st.none() | st.integers(0, 2**32 - 1))
    steps = draw(st.lists(envelopes(gpus), min_size=1, max_size=4))
    return DecoderCase(gpus, prime, steps)


def _valid_round(rng: np.random.Generator, gpus: int) -> tuple[np.ndarray, np.ndarray]:
    """In-range readings (int64, GPUs x FIELDS) and a presence mask."""
    lo = np.array([s.lo for s in FIELDS], dtype=np.int64)
    hi = np.array([min(s.hi, s.lo + 10_000) for s in FIELDS], dtype=np.int64)
    values = rng.integers(lo, hi + 1, size=(gpus, FIELD_COUNT), dtype=np.int64)
    present = rng.random((gpus, FIELD_COUNT)) < 0.8
    return values, present


def _decoder_state(dec: TelemetryDecoder) -> tuple:
    return (dec.ints.copy(), dec.known.copy(), dec.expected_seq, dec.awaiting_keyframe, dec.applied, dec.keyframes, dec.gaps)


def _same_state(a: tuple, b: tuple) -> bool:
    return all(np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y for x, y in zip(a, b))


_LOWER = np.array([s.lo for s in FIELDS], dtype=np.int64)
_UPPER = np.array([s.hi for s in FIELDS], dtype=np.int64)

#: a single envelope taking longer than this to apply counts as a hang
HANG_S = 2.0


def _codec_outcome(exc: CodecError) -> Outcome | None:
    """None when the CodecError is as promised, else what is wrong with it."""
    if type(exc) not in _CODEC_STATUS:
        return Outcome("UNEXPECTED", f"{type(exc).__name__} is not a known CodecError subclass")
    if not isinstance(exc.field, str) or not exc.field.strip():
        return Outcome("UNEXPECTED", f"{type(exc).__name__} with an empty field: {exc}")
    return None


def run_decoder_case(case: DecoderCase) -> list[Outcome]:
    """Apply the case's envelopes to a decoder with state; one outcome each."""
    dec = TelemetryDecoder(case.gpus)
    if case.prime_seed is not None:
        values, present = _valid_round(np.random.default_rng(case.prime_seed), len(case.gpus))
        enc = TelemetryEncoder(case.gpus)
        env, _ = enc.encode(values, present, now_s=0.0, sampled_at_ns=1)
        dec.apply(env)
    out = []
    for spec in case.steps:
        env = spec.build(dec.expected_seq)
        before = _decoder_state(dec)
        started = time.perf_counter()
        try:
            result = dec.apply(env)
        except CodecError as exc:
            bad = _codec_outcome(exc)
            if bad is not None:
                out.append(bad)
            elif not _same_state(before, _decoder_state(dec)):
                out.append(Outcome("UNEXPECTED", f"{type(exc).__name__}({exc.field}) changed the decoder's state"))
            else:
                out.append(Outcome(type(exc).__name__, exc.field))
        except Exception as exc:  # the property: nothing but CodecError
            out.append(Outcome("UNEXPECTED", f"{type(exc).__name__}: {exc}"))
        else:
            known = dec.known
            ints_ = dec.ints
            if not isinstance(result.outcome, DecodeOutcome):
                out.append(Outcome("UNEXPECTED", f"outcome {result.outcome!r}"))
            elif ((ints_ < _LOWER) | (ints_ > _UPPER))[known].any():
                out.append(Outcome("UNEXPECTED", "a value out of its field's range was applied"))
            elif dec.expected_seq > 2**64 - 1 or result.expected_seq > 2**64 - 1:
                # ResyncRequest.expected_seq is a uint64: the gateway cannot even say what it waits for
                out.append(Outcome("UNEXPECTED", f"the decoder now expects seq {dec.expected_seq}, past uint64 (seq {env.seq} accepted)"))
            else:
                out.append(Outcome("OK", result.outcome.value))
        elapsed = time.perf_counter() - started
        if elapsed > HANG_S:
            out[-1] = Outcome("UNEXPECTED", f"apply took {elapsed:.1f} s ({out[-1].kind})")
    return out


# ---- admit + ingest ------------------------------------------------------------------
@dataclass
class IngestCase:
    fuzz_gpus: list[int]
    good_gpus: int
    fuzz_first: bool  # the fuzzed node's view rows come before the good node's
    seed: int
    #: ("good", None) a round of the well-behaved agent; ("fuzz", spec); ("tick", None)
    steps: list[tuple[str, EnvelopeSpec | None]]


@st.composite
def ingest_case(draw) -> IngestCase:
    gpus = draw(GPU_SETS)
    step = st.one_of(
        st.just(("good", None)),
        st.just(("tick", None)),
        envelopes(gpus).map(lambda e: ("fuzz", e)),
        envelopes(gpus).map(lambda e: ("fuzz", e)),
    )
    fuzz_first = draw(st.booleans())  # KNOWN_BUGS["ingest_cancellation"] needs the broken node's rows first
    return IngestCase(gpus, draw(st.integers(1, 4)), fuzz_first, draw(st.integers(0, 2**32 - 1)), draw(st.lists(step, min_size=1, max_size=10)))


def _register(node_id: str, gpus: list[int]) -> pb.Register:
    return pb.Register(
        node_id=node_id,
        backend="sim",
        gpus=[pb.GpuInfo(index=i, uuid=f"GPU-{node_id}-{i}", model="X", memory_total_mib=1000) for i in gpus],
    )


def run_ingest_case(case: IngestCase) -> list[Outcome]:
    """The coordinator's telemetry path without the network: admit each
    envelope, apply keyframes at once and deltas at the next tick (as
    ``Coordinator.batch_applied`` and ``smooth_now`` do)."""
    view = ClusterView(capacity=8)
    ingest = TelemetryIngest(view)
    rng = np.random.default_rng(case.seed)
    good_gpus = list(range(case.good_gpus))
    now = [1.0]

    def register(node_id: str, gpus: list[int]):
        ingest.forget_node(node_id)
        return view.register(_register(node_id, gpus), now[0])

    if case.fuzz_first:
        fuzz = register("fuzz", case.fuzz_gpus)
        good = register("good", good_gpus)
    else:
        good = register("good", good_gpus)
        fuzz = register("fuzz", case.fuzz_gpus)
    encoder = TelemetryEncoder(good_gpus, compress=True)
    out: list[Outcome] = []

    def rejections(result) -> Outcome | None:
        for r in result.rejected:
            if r.node_id == "good":
                return Outcome("UNEXPECTED", f"the well-behaved node was rejected: {r.field}: {r.message}")
            if r.field not in {s.name for s in FIELDS} or not r.message:
                return Outcome("UNEXPECTED", f"a rejection names no field: {r}")
        return None

    def reconnect_if_rejected(result) -> None:
        nonlocal fuzz
        if any(r.node_id == "fuzz" for r in result.rejected):
            fuzz = register("fuzz", case.fuzz_gpus)  # its stream is closed; the agent comes back

    def good_matches() -> bool:
        values, known = encoder.last_sent
        expect = np.where(known, values.astype(np.float64), np.nan)
        return np.array_equal(view.raw[good.rows], expect, equal_nan=True)

    def tick() -> Outcome | None:
        result = ingest.flush()
        view.flush_signals(now[0])
        bad = rejections(result)
        reconnect_if_rejected(result)
        if bad is not None:
            return bad
        if good.decoder.applied and not good_matches():
            return Outcome("UNEXPECTED", "the well-behaved node's view differs from what its agent sent")
        return None

    def deliver(node, env: pb.Envelope) -> Outcome:
        before = _decoder_state(node.decoder)
        try:
            result = node.decoder.admit(env)
        except CodecError as exc:
            bad = _codec_outcome(exc)
            if bad is not None:
                return bad
            if not _same_state(before, _decoder_state(node.decoder)):
                return Outcome("UNEXPECTED", f"admit raised {type(exc).__name__} and changed the sequence state")
            return Outcome(type(exc).__name__, exc.field)
        if result.outcome is not DecodeOutcome.APPLIED:
            return Outcome("OK", result.outcome.value)
        if result.batch.keyframe:
            flushed = ingest.apply_keyframe(node, result.rows, result.batch, now[0])
            bad = rejections(flushed)
            reconnect_if_rejected(flushed)
            if bad is not None:
                return bad
        else:
            ingest.add_delta(node, result.rows, result.batch, now[0])
        return Outcome("OK", "applied")

    for kind, spec in case.steps:
        now[0] += 0.01
        try:
            if kind == "tick":
                bad = tick()
                if bad is not None:
                    out.append(bad)
                continue
            if kind == "good":
                values, present = _valid_round(rng, len(good_gpus))
                env, _ = encoder.encode(values, present, now_s=now[0], sampled_at_ns=int(now[0] * 1e9))
                outcome = deliver(good, env)
                if not outcome.ok:
                    out.append(Outcome("UNEXPECTED", f"the well-behaved node's envelope failed: {outcome.kind} {outcome.detail}"))
                continue
            out.append(deliver(fuzz, spec.build(fuzz.decoder.expected_seq)))
        except Exception as exc:  # the property: nothing but CodecError, from admit only
            out.append(Outcome("UNEXPECTED", f"{kind}: {type(exc).__name__}: {exc}"))
            return out
    try:
        bad = tick()
    except Exception as exc:
        bad = Outcome("UNEXPECTED", f"final tick: {type(exc).__name__}: {exc}")
    if bad is not None:
        out.append(bad)
    return out


# =====================================================================================
# a real coordinator on loopback, with sim hosts
# =====================================================================================
class _LogSink:
    """structlog processor: keep error-level events (crashes in background
    loops are logged, not raised), drop the rest (the fuzzer makes a lot)."""

    def __init__(self) -> None:
        self.errors: list[dict] = []

    def __call__(self, logger, method_name, event_dict):
        if method_name in ("error", "critical", "exception"):
            self.errors.append({k: str(v)[:500] for k, v in event_dict.items()})
        raise structlog.DropEvent


class _GrpcErrors(logging.Handler):
    """grpc's own error log lines (an exception raised by a servicer, a failed
    batch in the core), counted by their first line."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.counts: Counter = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage().splitlines()[0][:160]
        self.counts[re.sub(r"\[/[^\]]*\]", "[method]", message)] += 1


class LiveCluster:
    """A Coordinator on 127.0.0.1:0 and a SimFleet, on an event loop in a
    thread of their own, so a plain (synchronous) gRPC client can drive them."""

    def __init__(self, hosts: int = 2, gpus: int = 4, prefix: str = "fleet") -> None:
        self.hosts = hosts
        self.gpus = gpus
        self.prefix = prefix
        self.node_ids = [f"{prefix}-{h + 1:02d}" for h in range(hosts)]
        self.port: int = 0
        self.coordinator: Coordinator | None = None
        self.loop_errors: list[str] = []
        self.log = _LogSink()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._stop: asyncio.Event | None = None
        self._saved_log_config: dict | None = None
        self.grpc_errors = _GrpcErrors()
        self._grpc_logger = logging.getLogger("grpc._cython.cygrpc")
        self._grpc_propagate = True

    def start(self, timeout_s: float = 30.0) -> "LiveCluster":
        self._saved_log_config = structlog.get_config()
        structlog.configure(processors=[self.log], cache_logger_on_first_use=False)
        self._grpc_logger.addHandler(self.grpc_errors)
        self._grpc_propagate, self._grpc_logger.propagate = self._grpc_logger.propagate, False
        self._thread = threading.Thread(target=self._run, name="fuzz-coordinator", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s) or self._failure is not None:
            raise RuntimeError(f"the coordinator and its fleet did not start: {self._failure!r}")
        return self

    def _run(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        loop.set_exception_handler(self._loop_exception)
        try:
            loop.run_until_complete(self._main())
        except BaseException as exc:  # reported by start()
            self._failure = exc
            self._ready.set()
        finally:
            loop.close()

    def _loop_exception(self, loop, context) -> None:
        self.loop_errors.append(str(context.get("exception") or context.get("message"))[:500])

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        coord = self.coordinator = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", dispatch_interval_s=0.2))
        self.port = await coord.start()
        labels = {node: {"pool": "fleet"} for node in self.node_ids}
        fleet = SimFleet(f"127.0.0.1:{self.port}", hosts=self.hosts, gpus=self.gpus, interval_s=0.1, prefix=self.prefix, labels=labels)
        try:
            await fleet.start()
            deadline = time.monotonic() + 20
            while not all(coord.node_state(n) == cpb.NODE_STATE_HEALTHY for n in self.node_ids):
                if time.monotonic() > deadline:
                    raise RuntimeError("fleet nodes never became HEALTHY")
                await asyncio.sleep(0.05)
            self._ready.set()
            await self._stop.wait()
        finally:
            await fleet.stop()
            await coord.stop(grace_s=0.2)

    def call(self, fn: Callable[[], Any], timeout_s: float = 10.0) -> Any:
        """Run ``fn()`` on the coordinator's loop (to read its state safely)."""

        async def run():
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout_s)

    def gpu_uuids(self) -> list[str]:
        return self.call(lambda: [g.uuid for n in self.node_ids if n in self.coordinator.view.nodes for g in self.coordinator.view.nodes[n].gpus])

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(30)
        if self._saved_log_config is not None:
            structlog.configure(**self._saved_log_config)
            self._saved_log_config = None
            self._grpc_logger.removeHandler(self.grpc_errors)
            self._grpc_logger.propagate = self._grpc_propagate

    def __enter__(self) -> "LiveCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class Client:
    """A synchronous gRPC client that sends request *bytes* (so unknown fields
    and undecodable messages can be sent too)."""

    def __init__(self, port: int) -> None:
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self._methods: dict[str, Any] = {}

    def close(self) -> None:
        self.channel.close()

    def method(self, target: "RpcTarget"):
        fn = self._methods.get(target.name)
        if fn is None:
            path = f"/{target.service}/{target.method}"
            make = self.channel.unary_stream if target.streaming else self.channel.unary_unary
            fn = self._methods[target.name] = make(path, request_serializer=None, response_deserializer=target.response.FromString)
        return fn

    def invoke(self, target: "RpcTarget", request: bytes) -> tuple[grpc.StatusCode, str, Any]:
        """(code, details, the response or the first streamed message)."""
        fn = self.method(target)
        try:
            if target.streaming:
                call = fn(request, timeout=CALL_TIMEOUT_S if target.immediate else OPEN_STREAM_S)
                try:
                    first = next(call, None)
                    if first is None:
                        return call.code(), call.details() or "", None
                    return grpc.StatusCode.OK, "", first
                except grpc.RpcError as exc:
                    if not target.immediate and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                        return grpc.StatusCode.OK, "", None  # open and waiting for events: accepted
                    raise
                finally:
                    call.cancel()
            return grpc.StatusCode.OK, "", fn(request, timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or "", None

    def open_stream(self, target: "RpcTarget", request: bytes):
        """Start a server-streaming call that may wait for events."""
        return self.method(target)(request, timeout=OPEN_STREAM_S)

    @staticmethod
    def open_status(call) -> tuple[grpc.StatusCode, str]:
        """OK when a first message came or the call was still open (waiting
        for events) at its deadline; else the status it ended with."""
        try:
            first = next(call, None)
            if first is None:
                return call.code(), call.details() or ""
            return grpc.StatusCode.OK, ""
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return grpc.StatusCode.OK, ""
            return exc.code(), exc.details() or ""
        finally:
            call.cancel()

    def stream(self, messages: list[pb.AgentMessage]) -> tuple[grpc.StatusCode, str, list]:
        fn = self._methods.get("connect")
        if fn is None:
            fn = self._methods["connect"] = self.channel.stream_stream(
                "/gpulb.v1.AgentGateway/Connect",
                request_serializer=pb.AgentMessage.SerializeToString,
                response_deserializer=pb.CoordinatorMessage.FromString,
            )
        call = fn(iter(messages), timeout=STREAM_TIMEOUT_S)
        replies = []
        try:
            for reply in call:
                replies.append(reply)
            return call.code(), call.details() or "", replies
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or "", replies

    # ---- plain calls for set-up and checks --------------------------------------------
    def unary(self, service: str, method: str, request, response):
        fn = self.channel.unary_unary(
            f"/{service}/{method}", request_serializer=type(request).SerializeToString, response_deserializer=response.FromString
        )
        return fn(request, timeout=CALL_TIMEOUT_S * 4)

    def schedule(self, spec: tpb.TaskSpec, wait: bool = True) -> tpb.Task:
        return self.unary("gpulb.v1.Scheduler", "ScheduleTask", tpb.ScheduleTaskRequest(spec=spec, wait=wait), tpb.ScheduleTaskResponse).task

    def tasks(self, state: int = 0, limit: int = 1000) -> list[tpb.Task]:
        return list(self.unary("gpulb.v1.Scheduler", "ListTasks", tpb.ListTasksRequest(state=state, limit=limit), tpb.ListTasksResponse).tasks)

    def nodes(self) -> list[cpb.Node]:
        return list(self.unary("gpulb.v1.ClusterOperator", "ListNodes", cpb.ListNodesRequest(), cpb.ListNodesResponse).nodes)

    def health(self) -> int:
        stub = health_pb2_grpc.HealthStub(self.channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=CALL_TIMEOUT_S).status


# =====================================================================================
# pools: real ids the fuzzer mixes in, so requests reach past "not found"
# =====================================================================================
class Pools:
    """Values known to the live server, read at draw time."""

    def __init__(self) -> None:
        self.values: dict[str, list] = {
            "node_ids": ["fleet-01"],
            "gpu_uuids": ["GPU-none"],
            "task_ids": ["none"],
            "lease_ids": ["0" * 32],
            "leases": [("none", "0" * 32)],
            "policies": ["load_aware"],
            "weights": ["util"],
        }

    def strategy(self, name: str) -> st.SearchStrategy:
        return st.integers(0, 2**16).map(lambda i: (values := self.values[name])[i % len(values)])

    def refresh(self, cluster: LiveCluster, client: Client, fresh_leases: int = 0) -> None:
        """Read node, task and lease ids from the server; lease ``fresh_leases``
        new tasks on the fleet first (CompleteTask and RenewLease need live ones)."""
        for i in range(fresh_leases):
            client.schedule(fleet_spec(f"pool-{time.monotonic_ns()}-{i}", vram_mib=64), wait=False)
        if fresh_leases:
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and not any(t.state == tpb.TASK_STATE_LEASED for t in client.tasks(limit=10_000)):
                time.sleep(0.05)
        tasks = client.tasks(limit=10_000)
        policy = client.unary("gpulb.v1.Scheduler", "GetPolicy", tpb.GetPolicyRequest(), tpb.Policy)
        self.values["node_ids"] = list(cluster.node_ids)
        self.values["gpu_uuids"] = cluster.gpu_uuids() or ["GPU-none"]
        ids = [t.spec.task_id for t in tasks]
        leased = [t.spec.task_id for t in tasks if t.state == tpb.TASK_STATE_LEASED]
        self.values["task_ids"] = (leased * 4 + ids[-200:]) or ["none"]
        self.values["lease_ids"] = [t.assignment.lease_id for t in tasks if t.assignment.lease_id][-200:] or ["0" * 32]
        live = [(t.spec.task_id, t.assignment.lease_id) for t in tasks if t.state == tpb.TASK_STATE_LEASED]
        stale = [(t.spec.task_id, t.assignment.lease_id) for t in tasks if t.assignment.lease_id and t.state != tpb.TASK_STATE_LEASED]
        self.values["leases"] = (live * 4 + stale[-50:]) or [("none", "0" * 32)]
        self.values["policies"] = list(policy.available) or ["load_aware"]
        self.values["weights"] = sorted(policy.weights) or ["util"]


POOLS = Pools()


def fleet_spec(task_id: str, **kw) -> tpb.TaskSpec:
    """A well-formed task that only the fleet's nodes take."""
    base = dict(task_id=task_id, num_gpus=1, vram_mib=256, gpu_share=0.1, kind="batch", required_node_labels={"pool": "fleet"})
    base.update(kw)
    return tpb.TaskSpec(**base)


# =====================================================================================
# known bugs: inputs the generic strategies leave out, with their reproductions
# =====================================================================================
#: the smallest uint64 vram_mib that float() rounds up to 2**64
HUGE_VRAM = 2**64 - 1024


@dataclass(frozen=True)
class KnownBug:
    """A bug the fuzzer found, as a reproduction: ``reproduce`` returns
    (still reproduces, what happened); the benchmark reports each one.
    The strategies generate the inputs of fixed ones like any others."""

    name: str
    summary: str
    reproduce: Callable[["Client | None"], tuple[bool, str]]
    needs_server: bool = True


def _status_bug(code: grpc.StatusCode, details: str) -> tuple[bool, str]:
    return code not in ALLOWED_CODES, f"{code.name}: {details}"


def _huge_vram_task(client: "Client") -> tuple[bool, str]:
    """A task whose vram_mib float() rounds to 2**64 is stored (REJECTED);
    converting it back to a proto fails, so GetTask on it - and every
    ListTasks that includes it - ends UNKNOWN."""
    task_id = f"bug-huge-vram-{time.monotonic_ns()}"
    spec = tpb.TaskSpec(task_id=task_id, vram_mib=HUGE_VRAM)
    code, details, _ = client.invoke(RPC_TARGETS["Scheduler.ScheduleTask"], tpb.ScheduleTaskRequest(spec=spec, wait=False).SerializeToString())
    if code != grpc.StatusCode.FAILED_PRECONDITION:
        return _status_bug(code, details)
    code, details, _ = client.invoke(RPC_TARGETS["Scheduler.GetTask"], tpb.GetTaskRequest(task_id=task_id).SerializeToString())
    return _status_bug(code, details)


def _undecodable_request(client: "Client") -> tuple[bool, str]:
    """Bytes that are not a GetTaskRequest (a truncated length-delimited field)."""
    code, details, _ = client.invoke(RPC_TARGETS["Scheduler.GetTask"], b"\x0a\x05ab")
    return _status_bug(code, details)


def seq_max_stream() -> list[pb.AgentMessage]:
    """Register, a valid keyframe with seq 2**64-1, then the next keyframe."""
    enc = TelemetryEncoder([0])
    values, present = _valid_round(np.random.default_rng(1), 1)
    first, _ = enc.encode(values, present, now_s=0.0, sampled_at_ns=1)
    first.seq = 2**64 - 1
    enc.request_keyframe()
    second, _ = enc.encode(values, present, now_s=1.0, sampled_at_ns=2)
    return [pb.AgentMessage(register=_register("fz-seq-max", [0])), pb.AgentMessage(telemetry=first), pb.AgentMessage(telemetry=second)]


def _seq_max_bug(client: "Client") -> tuple[bool, str]:
    """A keyframe with seq 2**64-1 is accepted and the decoder then expects
    2**64: no envelope can carry it, and the gateway's ResyncRequest for it
    raises ValueError, so the stream ends UNKNOWN."""
    code, details, _ = client.stream(seq_max_stream())
    return _status_bug(code, details)


def _task_event_kind(client: "Client") -> tuple[bool, str]:
    """Register, then a TaskEvent whose kind is not (yet) in TaskEventKind: the
    coordinator logs it with TaskEventKind.Name(), which raises ValueError, and
    the stream ends UNKNOWN (a newer agent with a new kind would be cut off)."""
    code, details, _ = client.stream([pb.AgentMessage(register=_register("fz-event-kind", [0])),
                                      pb.AgentMessage(task_event=pb.TaskEvent(task_id="x", kind=99))])
    return _status_bug(code, details)


def _abort_during_write(client: "Client", attempts: int = 3000) -> tuple[bool, str]:
    """Register (4 GPUs) and at once a bad message (an empty one, or a second
    register), many times: about once in 1,000 streams on an idle machine (more
    under load) the stream gets no status at all; the client waits for its
    deadline, an agent without one for good. Each time the server logs
    ExecuteBatchError GRPC_CALL_ERROR_TOO_MANY_OPERATIONS from context.abort in
    AgentGateway.Connect: the RegisterAck write is still in flight in the core
    when the call is aborted (cancelling the writer task does not cancel it)."""
    reg = pb.Register(node_id="fz-race", backend="sim", gpus=[
        pb.GpuInfo(index=i, uuid=f"GPU-fz-race-{i}", model="X", memory_total_mib=24564, supported_fields=_VALID_FIELDS) for i in range(4)])
    patterns = [[pb.AgentMessage(register=reg), pb.AgentMessage()], [pb.AgentMessage(register=reg), pb.AgentMessage(register=reg)]]
    fn = client.channel.stream_stream("/gpulb.v1.AgentGateway/Connect", request_serializer=pb.AgentMessage.SerializeToString,
                                      response_deserializer=pb.CoordinatorMessage.FromString)
    for attempt in range(1, attempts + 1):
        msgs = patterns[attempt % 2]
        call = fn(iter(msgs), timeout=2.0)
        try:
            for _ in call:
                pass
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                second = "an empty message" if attempt % 2 == 0 else "a second register"
                return True, f"attempt {attempt} (register, then {second}): no status within 2 s (DEADLINE_EXCEEDED)"
    return False, f"{attempts} attempts, every one ended with a status"


def ingest_cancellation_case() -> tuple[list[tuple[str, str, str]], float]:
    """Two nodes' deltas in one ingest tick: a broken agent's memory_used_mib
    delta of 2**62 (rejected, rightly) and a good agent's -900 MiB from 1000
    MiB. The float64 cumulative sum over every cell of the tick loses the good
    delta's low bits to the huge one, its value comes out as -24 MiB, and the
    good node is rejected too. Returns (rejections, good node's value)."""
    view = ClusterView(capacity=8)
    ingest = TelemetryIngest(view)
    nodes = {name: view.register(_register(name, [0]), 1.0) for name in ("broken", "good")}
    col = [s.name for s in FIELDS].index("memory_used_mib")
    for node in nodes.values():
        values = np.zeros((1, FIELD_COUNT), dtype=np.int64)
        present = np.zeros((1, FIELD_COUNT), dtype=bool)
        values[0, col], present[0, col] = 1000, True
        env, _ = TelemetryEncoder([0]).encode(values, present, now_s=0.0, sampled_at_ns=1)
        result = node.decoder.admit(env)
        ingest.apply_keyframe(node, result.rows, result.batch, 1.0)
    for name, delta in (("broken", 2**62), ("good", -900)):
        column = pb.FieldColumn(field=FIELDS[col].field, presence=b"\x01", values=[delta])
        raw = pb.MetricBatch(gpu_index=[0], columns=[column]).SerializeToString()
        result = nodes[name].decoder.admit(pb.Envelope(seq=2, compression=pb.COMPRESSION_NONE, raw_size=len(raw), payload=raw))
        ingest.add_delta(nodes[name], result.rows, result.batch, 1.1)
    flushed = ingest.flush()
    return [(r.node_id, r.field, r.message) for r in flushed.rejected], float(view.raw[nodes["good"].rows[0], col])


def _ingest_cancellation(client: "Client | None") -> tuple[bool, str]:
    rejected, good_value = ingest_cancellation_case()
    wrong = any(node == "good" for node, _, _ in rejected) or good_value != 100.0
    return wrong, f"rejections {rejected}; the good node's memory_used_mib is {good_value:g} (sent: 100)"


KNOWN_BUGS = {
    bug.name: bug
    for bug in (
        KnownBug(
            "huge_vram_task",
            "ScheduleTask(vram_mib >= 2**64-1024) is REJECTED but stored; GetTask/ListTasks/WatchTask on it end UNKNOWN "
            "(ValueError: Value out of range: 18446744073709551616, from taskconvert.spec_to_proto's int(float(vram_mib)))",
            _huge_vram_task,
        ),
        KnownBug(
            "undecodable_request",
            "a request that is not a valid protobuf of the method's type ends UNKNOWN ('Unexpected <class DecodeError>') instead of INVALID_ARGUMENT",
            _undecodable_request,
        ),
        KnownBug(
            "seq_max",
            "a keyframe with seq 2**64-1 is accepted; the decoder then expects 2**64, the next envelope's ResyncRequest(expected_seq=2**64) "
            "raises ValueError in the gateway and the stream ends UNKNOWN",
            _seq_max_bug,
        ),
        KnownBug(
            "task_event_kind",
            "an agent's TaskEvent with a kind outside TaskEventKind (e.g. 99) ends its stream UNKNOWN "
            "(ValueError from pb.TaskEventKind.Name in Coordinator.task_event)",
            _task_event_kind,
        ),
        KnownBug(
            "abort_during_write",
            "race: a stream aborted while a write is in flight (register, then a bad message at once) gets no status: "
            "the client hangs until its deadline (ExecuteBatchError TOO_MANY_OPERATIONS from context.abort in the gateway)",
            _abort_during_write,
        ),
        KnownBug(
            "ingest_cancellation",
            "coordinator.ingest: a broken agent's out-of-range delta in the same tick makes a good agent's valid delta come out wrong "
            "(float64 cumulative sum across all nodes' cells), and the good agent is rejected (its stream closed INVALID_ARGUMENT)",
            _ingest_cancellation,
            needs_server=False,
        ),
    )
}


# =====================================================================================
# RPC targets
# =====================================================================================
@dataclass
class RpcTarget:
    name: str  # "Scheduler.ScheduleTask"
    service: str  # full service name
    method: str
    request: Any  # request message class
    response: Any
    streaming: bool
    hints: Hints = field(default_factory=dict)
    replace: frozenset[str] = frozenset()
    fixup: Callable[[Any], None] | None = None
    #: well-formed requests that reach the handler's deep paths (real ids)
    valid: st.SearchStrategy | None = None
    #: a streaming method whose contract is a first message at once (WatchView's
    #: snapshot, WatchTask's task now); other streams may wait for events, so
    #: one still open after OPEN_STREAM_S without a status accepted the request
    immediate: bool = True

    @property
    def roots(self) -> frozenset[str]:
        return frozenset(f.name for f in self.request.DESCRIPTOR.fields)

    def strategy(self) -> st.SearchStrategy[bytes]:
        """A third well-formed, a third well-formed but for one field, a third
        generated from the descriptor (with hints); unknown fields appended
        to some."""
        hints = dict(self.hints)
        # every uint64, and plausible sizes (KNOWN_BUGS["huge_vram_task"] was the top 1024)
        hints[_VRAM] = st.one_of(ints(0, 2**64 - 1), st.sampled_from(range(HUGE_VRAM, HUGE_VRAM + 1024, 97)), st.integers(1, 30_000))
        replace = frozenset(self.replace | {_VRAM})
        body = messages(self.request.DESCRIPTOR, hints, replace)
        if self.valid is not None:
            body = st.one_of(self.valid, mutated(self.valid, hints, replace), body)

        def encode(parts):
            msg, extra = parts
            if self.fixup is not None:
                self.fixup(msg)
            return msg.SerializeToString() + extra

        return st.tuples(body, st.one_of(st.just(b""), UNKNOWN_FIELDS)).map(encode)


_VRAM = "gpulb.v1.TaskSpec.vram_mib"


def _metric_names() -> st.SearchStrategy[str]:
    names = sorted(set(_GPU_FIELDS) | set(METRIC_ALIASES))
    return st.one_of(st.sampled_from(names), st.sampled_from(names).map(lambda n: f"  {n.upper()} "))


def _task_ids() -> st.SearchStrategy[str]:
    return st.one_of(POOLS.strategy("task_ids"), st.from_regex(r"fz-[a-z0-9]{1,4}", fullmatch=True))


def _lease_ids() -> st.SearchStrategy[str]:
    return st.one_of(POOLS.strategy("lease_ids"), st.from_regex(r"[0-9a-f]{32}", fullmatch=True))


def _no_wait(msg: tpb.ScheduleTaskRequest | tpb.ScheduleTasksRequest) -> None:
    msg.wait = False  # never block on placement: the property is about validation


_LABELS = st.dictionaries(st.from_regex(r"[a-z][a-z0-9_]{0,6}", fullmatch=True), st.text(max_size=8), max_size=3)
_FINITE = st.floats(0, 600, allow_nan=False)


def valid_specs() -> st.SearchStrategy[tpb.TaskSpec]:
    """Task specs that pass validation; most fit the fleet (or queue for it)."""
    return st.builds(
        tpb.TaskSpec,
        task_id=st.one_of(st.from_regex(r"fz-[a-z0-9]{4,10}", fullmatch=True), st.uuids().map(lambda u: f"fz-{u.hex[:12]}"), POOLS.strategy("task_ids")),
        tenant=st.sampled_from(["", "a", "b"]),
        priority=st.integers(0, 4),
        kind=st.sampled_from(["", "inference", "training", "batch", "background", "other"]),
        num_gpus=st.integers(0, 4),
        vram_mib=st.integers(1, 20_000),
        gpu_share=st.floats(0, 1),
        duration_s=st.floats(0, 5),
        gpu_spec=st.sampled_from(["", "RTX 4090", "4090", "geforce|A100"]),
        needs_nvlink=st.booleans(),
        io_heavy=st.booleans(),
        movable=st.booleans(),
        deadline_s=st.one_of(st.just(0.0), st.floats(0.05, 20)),
        labels=_LABELS,
        required_node_labels=st.sampled_from([{}, {"pool": "fleet"}, {"pool": "fleet"}]),
        preferred_node_labels=st.sampled_from([{}, {"pool": "fleet"}, {"zone": "z"}]),
    )


def _pool_dicts(pool: str, values: st.SearchStrategy, max_size: int = 4) -> st.SearchStrategy[dict]:
    """Dicts keyed from a pool. Not st.dictionaries: its unique-key retries
    would make what is drawn depend on the pool's current content, which
    hypothesis reports as a flaky strategy."""
    return st.lists(st.tuples(POOLS.strategy(pool), values), max_size=max_size).map(dict)


def _leased_pair(cls, **more) -> st.SearchStrategy:
    """A request naming a live lease (task id and its lease id), or a stale one."""
    return st.builds(lambda pair, kw: cls(task_id=pair[0], lease_id=pair[1], **kw), POOLS.strategy("leases"), st.fixed_dictionaries(more))


def _build_targets() -> dict[str, RpcTarget]:
    node = POOLS.strategy("node_ids")
    node_or_all = st.one_of(st.just(""), node)
    node_states = st.sampled_from(sorted(cpb.NodeState.values()))
    views = st.sampled_from(sorted(cpb.ValueView.values()))
    reason = st.text(max_size=16)
    hints: dict[str, Hints] = {
        "GetNode": {"gpulb.v1.GetNodeRequest.node_id": node},
        "ListGpus": {"gpulb.v1.ListGpusRequest.node_id": node, "gpulb.v1.ListGpusRequest.metrics": _metric_names(),
                     "gpulb.v1.ListGpusRequest.model": st.sampled_from(["4090", "rtx", "NVIDIA GeForce RTX 4090"])},
        "WatchView": {"gpulb.v1.WatchViewRequest.node_id": node, "gpulb.v1.WatchViewRequest.min_interval_ms": ints(190, 2000)},
        "CordonNode": {"gpulb.v1.NodeActionRequest.node_id": node},
        "DrainNode": {"gpulb.v1.NodeActionRequest.node_id": node},
        "UncordonNode": {"gpulb.v1.NodeActionRequest.node_id": node},
        "ScheduleTask": {
            "gpulb.v1.TaskSpec.task_id": _task_ids(),
            "gpulb.v1.TaskSpec.num_gpus": ints(0, 70),
            "gpulb.v1.TaskSpec.gpu_share": st.floats(0, 1),
            "gpulb.v1.TaskSpec.priority": st.integers(0, 5),
            "gpulb.v1.TaskSpec.gpu_spec": st.sampled_from(["RTX 4090", "4090|A100", "V100M16", "M16", "|", "a||b", "A100M0", "X" * 300]),
            "gpulb.v1.TaskSpec.required_node_labels": st.just({"pool": "fleet"}),
        },
        "GetTask": {"gpulb.v1.GetTaskRequest.task_id": _task_ids()},
        "ListTasks": {"gpulb.v1.ListTasksRequest.state": st.integers(0, 9), "gpulb.v1.ListTasksRequest.limit": ints(0, 50)},
        "WatchTask": {"gpulb.v1.WatchTaskRequest.task_id": _task_ids()},
        "CompleteTask": {"gpulb.v1.CompleteTaskRequest.task_id": _task_ids(), "gpulb.v1.CompleteTaskRequest.lease_id": _lease_ids()},
        "CancelTask": {"gpulb.v1.CancelTaskRequest.task_id": _task_ids()},
        "RenewLease": {"gpulb.v1.RenewLeaseRequest.task_id": _task_ids(), "gpulb.v1.RenewLeaseRequest.lease_id": _lease_ids()},
        "MigrateTask": {"gpulb.v1.MigrateTaskRequest.task_id": _task_ids(), "gpulb.v1.MigrateTaskRequest.lease_id": _lease_ids(),
                        "gpulb.v1.MigrateTaskRequest.to_gpu_uuid": POOLS.strategy("gpu_uuids")},
        "SetPolicy": {"gpulb.v1.SetPolicyRequest.name": POOLS.strategy("policies"),
                      "gpulb.v1.SetPolicyRequest.weights": _pool_dicts("weights", DOUBLES)},
    }
    hints["ScheduleTasks"] = hints["ScheduleTask"]  # the same TaskSpec, repeated
    valid: dict[str, st.SearchStrategy] = {
        "ListNodes": st.builds(cpb.ListNodesRequest, state=node_states),
        "GetNode": st.builds(cpb.GetNodeRequest, node_id=node),
        "ListGpus": st.builds(cpb.ListGpusRequest, node_id=node_or_all, model=st.sampled_from(["", "4090", "rtx"]),
                              node_state=node_states, values=views, metrics=st.lists(_metric_names(), max_size=3)),
        "WatchView": st.builds(cpb.WatchViewRequest, node_id=node_or_all, min_interval_ms=st.one_of(st.just(0), st.integers(200, 5000)), values=views),
        "CordonNode": st.builds(cpb.NodeActionRequest, node_id=node, reason=reason),
        "DrainNode": st.builds(cpb.NodeActionRequest, node_id=node, reason=reason),
        "UncordonNode": st.builds(cpb.NodeActionRequest, node_id=node, reason=reason),
        "ScheduleTask": st.builds(tpb.ScheduleTaskRequest, spec=valid_specs(), wait=st.just(False)),
        "ScheduleTasks": st.builds(tpb.ScheduleTasksRequest, specs=st.lists(valid_specs(), min_size=1, max_size=4), wait=st.just(False)),
        "GetTask": st.builds(tpb.GetTaskRequest, task_id=POOLS.strategy("task_ids")),
        "ListTasks": st.builds(tpb.ListTasksRequest, state=st.sampled_from(sorted(tpb.TaskState.values())),
                               tenant=st.sampled_from(["", "a", "b"]), limit=st.integers(0, 100)),
        "WatchTask": st.builds(tpb.WatchTaskRequest, task_id=POOLS.strategy("task_ids")),
        "CompleteTask": _leased_pair(tpb.CompleteTaskRequest, failed=st.booleans(), actual_duration_s=_FINITE),
        "CancelTask": st.builds(tpb.CancelTaskRequest, task_id=POOLS.strategy("task_ids"), reason=reason),
        "RenewLease": _leased_pair(tpb.RenewLeaseRequest, extend_s=_FINITE),
        "MigrateTask": _leased_pair(tpb.MigrateTaskRequest, to_gpu_uuid=st.lists(POOLS.strategy("gpu_uuids"), min_size=1, max_size=2)),
        "GetQueue": st.just(tpb.GetQueueRequest()),
        "GetPolicy": st.just(tpb.GetPolicyRequest()),
        "SetPolicy": st.builds(tpb.SetPolicyRequest, name=st.one_of(st.just(""), POOLS.strategy("policies")),
                               weights=_pool_dicts("weights", st.floats(0, 10))),
    }
    # ids by field name, for any request (services added later included)
    by_name = {"node_id": node, "task_id": _task_ids(), "lease_id": _lease_ids()}
    targets: dict[str, RpcTarget] = {}
    for sdesc in served_services():
        service = sdesc.name
        for m in sdesc.methods:
            method_hints = {f.full_name: by_name[f.name] for f in m.input_type.fields if f.name in by_name}
            method_hints.update(hints.get(m.name, {}) if service in ("ClusterOperator", "Scheduler") else {})
            targets[f"{service}.{m.name}"] = RpcTarget(
                name=f"{service}.{m.name}",
                service=sdesc.full_name,
                method=m.name,
                request=message_factory.GetMessageClass(m.input_type),
                response=message_factory.GetMessageClass(m.output_type),
                streaming=m.server_streaming,
                hints=method_hints,
                fixup=_no_wait if m.full_name in ("gpulb.v1.Scheduler.ScheduleTask", "gpulb.v1.Scheduler.ScheduleTasks") else None,
                valid=valid.get(m.name) if service in ("ClusterOperator", "Scheduler") else None,
                immediate=m.full_name in _IMMEDIATE_STREAMS,
            )
    return targets


_IMMEDIATE_STREAMS = frozenset({"gpulb.v1.ClusterOperator.WatchView", "gpulb.v1.Scheduler.WatchTask"})


def served_services() -> list:
    """Descriptors of every request/response service the coordinator serves
    (the agent stream has a target of its own)."""
    names = Coordinator.service_names(object.__new__(Coordinator))  # the method reads no state
    pool = descriptor_pool.Default()
    gateway = pb.DESCRIPTOR.services_by_name["AgentGateway"].full_name
    return [pool.FindServiceByName(name) for name in names if name != gateway]


RPC_TARGETS = _build_targets()


# =====================================================================================
# agent streams
# =====================================================================================
_FUZZ_NODES = [f"fz-{i}" for i in range(6)]


@st.composite
def gpu_infos(draw, uuids: st.SearchStrategy[str]) -> list[pb.GpuInfo]:
    """A host's GPUs: usually valid (unique small indexes, plausible memory),
    sometimes anything."""
    if draw(st.integers(0, 4)) == 0:
        return draw(st.lists(messages(pb.GpuInfo.DESCRIPTOR), max_size=4))
    indexes = draw(st.lists(st.integers(0, 15), min_size=1, max_size=4, unique=True))
    return [
        pb.GpuInfo(
            index=i,
            uuid=draw(st.one_of(st.just(f"GPU-fz-{i}"), uuids, TEXT)),
            model=draw(st.one_of(st.just("NVIDIA GeForce RTX 4090"), TEXT)),
            memory_total_mib=draw(st.one_of(st.integers(1, 100_000), ints(0, 2**64 - 1))),
            power_limit_mw=draw(ints(0, 2**64 - 1)),
            supported_fields=draw(st.lists(st.one_of(st.sampled_from(_VALID_FIELDS), ints(-(2**31), 2**31 - 1)), max_size=3)),
        )
        for i in indexes
    ]


@st.composite
def agent_stream(draw, fleet_ids: tuple[str, ...] = ("fleet-01", "fleet-02")) -> list[pb.AgentMessage]:
    """A whole agent stream: a well-behaved agent's, the same with one
    message replaced by a fuzzed one, or anything (``chaos_stream``)."""
    mode = draw(st.sampled_from(["valid", "one_fault", "one_fault", "chaos", "chaos"]))
    if mode == "chaos":
        return draw(chaos_stream(fleet_ids))
    node_id = draw(st.sampled_from(_FUZZ_NODES))
    indexes = sorted(draw(st.lists(st.integers(0, 15), min_size=1, max_size=4, unique=True)))
    reg = pb.Register(
        node_id=node_id,
        hostname="fuzz-host",
        agent_version="0.1.0",
        backend="sim",
        labels=draw(st.dictionaries(st.from_regex(r"[a-z][a-z0-9._/-]{0,8}", fullmatch=True), st.text(max_size=8), max_size=3)),
        gpus=[pb.GpuInfo(index=i, uuid=f"GPU-{node_id}-{i}", model="NVIDIA GeForce RTX 4090", memory_total_mib=24564,
                         power_limit_mw=450_000, supported_fields=_VALID_FIELDS) for i in indexes],
        session_id=draw(st.integers(0, 2**64 - 1)),
        sample_interval_min_ms=100,
        sample_interval_max_ms=1000,
    )
    encoder = TelemetryEncoder(indexes, keyframe_interval_s=draw(st.sampled_from([0.0, 30.0])))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    out = [pb.AgentMessage(register=reg)]
    for round_ in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from(["telemetry", "telemetry", "telemetry", "heartbeat", "task_event"]))
        if kind == "telemetry":
            values, present = _valid_round(rng, len(indexes))
            env, _ = encoder.encode(values, present, now_s=float(round_), sampled_at_ns=time.time_ns())
            out.append(pb.AgentMessage(telemetry=env))
        elif kind == "heartbeat":
            out.append(pb.AgentMessage(heartbeat=pb.Heartbeat(sent_at_ns=time.time_ns(), last_seq=encoder.seq)))
        else:
            out.append(pb.AgentMessage(task_event=pb.TaskEvent(
                task_id=draw(POOLS.strategy("task_ids")), kind=draw(st.integers(0, 4)), at_ns=time.time_ns(), detail="fuzz")))
    if mode == "one_fault":
        position = draw(st.integers(0, len(out)))
        fault = draw(st.sampled_from(["register", "telemetry", "message"]))
        if fault == "register":
            bad = pb.AgentMessage(register=draw(mutated(st.just(reg))))
        elif fault == "telemetry":
            bad = pb.AgentMessage(telemetry=draw(envelopes(indexes)).build(max(1, encoder.seq)))
        else:
            bad = draw(messages(pb.AgentMessage.DESCRIPTOR, *_stream_hints()))
        if draw(st.booleans()) and position < len(out):
            out[position] = bad
        else:
            out.insert(position, bad)
    return out


@st.composite
def chaos_stream(draw, fleet_ids: tuple[str, ...] = ("fleet-01", "fleet-02")) -> list[pb.AgentMessage]:
    """Any agent stream: a Register (or not), then telemetry, heartbeats, task
    events, a second register or empty messages, mostly wrong."""
    node_id = draw(st.one_of(st.sampled_from(_FUZZ_NODES), st.from_regex(r"fz-[A-Za-z0-9._-]{0,8}", fullmatch=True), TEXT).filter(lambda n: n not in fleet_ids))
    gpus = draw(gpu_infos(POOLS.strategy("gpu_uuids")))
    reg = pb.Register(
        node_id=node_id,
        hostname=draw(TEXT),
        agent_version="0.1.0",
        backend=draw(st.sampled_from(["sim", "nvml", ""])),
        gpus=gpus,
        session_id=draw(ints(0, 2**64 - 1)),
        sample_interval_min_ms=draw(ints(0, 2**32 - 1)),
        sample_interval_max_ms=draw(ints(0, 2**32 - 1)),
    )
    indexes = [g.index for g in gpus]
    links = draw(st.lists(st.tuples(st.one_of(st.sampled_from(indexes or [0]), ints(0, 2**32 - 1)),
                                    st.one_of(st.sampled_from(indexes or [0]), ints(0, 2**32 - 1)),
                                    ints(-(2**31), 2**31 - 1), ints(0, 2**32 - 1)), max_size=2))
    for a, b, kind, count in links:
        reg.topology.add(gpu_a=a, gpu_b=b, kind=kind, nvlink_count=count)
    for key, value in draw(st.dictionaries(st.one_of(st.from_regex(r"[a-z][a-z0-9._/-]{0,8}", fullmatch=True), TEXT), TEXT, max_size=3)).items():
        reg.labels[key] = value
    first = draw(st.one_of(st.just(pb.AgentMessage(register=reg)), st.just(pb.AgentMessage(register=reg)),
                           st.just(pb.AgentMessage(register=reg)), messages(pb.AgentMessage.DESCRIPTOR, *_stream_hints())))
    out = [first]
    seq = 1
    keyframe_sent = False
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from(["telemetry"] * 5 + ["good_keyframe", "heartbeat", "task_event", "register", "empty"]))
        if kind == "good_keyframe" or (kind == "telemetry" and not keyframe_sent and draw(st.booleans())):
            valid_gpus = sorted(set(indexes))
            values, present = _valid_round(np.random.default_rng(draw(st.integers(0, 2**16))), len(valid_gpus))
            env, _ = TelemetryEncoder(valid_gpus).encode(values, present, now_s=0.0, sampled_at_ns=time.time_ns())
            env.seq = seq
            out.append(pb.AgentMessage(telemetry=env))
            keyframe_sent = True
            seq += 1
        elif kind == "telemetry":
            env = draw(envelopes(indexes)).build(seq)
            out.append(pb.AgentMessage(telemetry=env))
            seq = max(seq, env.seq) + 1 if env.seq < 2**63 else seq + 1
        elif kind == "heartbeat":
            out.append(pb.AgentMessage(heartbeat=draw(messages(pb.Heartbeat.DESCRIPTOR))))
        elif kind == "task_event":
            event = draw(messages(pb.TaskEvent.DESCRIPTOR, *_stream_hints()))
            out.append(pb.AgentMessage(task_event=event))
        elif kind == "register":
            out.append(pb.AgentMessage(register=reg))
        else:
            out.append(pb.AgentMessage())
    return out


_STREAM_ROOTS = frozenset({"register", "telemetry", "heartbeat", "task_event", "body"})


def _stream_hints() -> tuple[Hints, frozenset[str]]:
    """Hints for generated agent messages; leaves out known-bug inputs."""
    hints: Hints = {"gpulb.v1.TaskEvent.task_id": POOLS.strategy("task_ids"),
                    # known kinds, and others (KNOWN_BUGS["task_event_kind"]: a newer agent's)
                    "gpulb.v1.TaskEvent.kind": st.one_of(st.sampled_from(sorted(pb.TaskEventKind.values())), ints(-(2**31), 2**31 - 1))}
    return hints, frozenset({"gpulb.v1.TaskEvent.kind"})


#: outcome kind of a stream that hung once and got its precise status when sent again
ABORT_RACE = "KNOWN_BUG:abort_during_write"


def run_agent_stream(client: Client, messages_: list[pb.AgentMessage]) -> Outcome:
    code, details, _ = client.stream(messages_)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        # KNOWN_BUGS["abort_during_write"] is a race: the same stream sent again
        # must end with its precise status, else the hang is a bug of its own
        again, details_again, _ = client.stream(messages_)
        if not classify_status(again, details_again, _STREAM_ROOTS).unexpected:
            return Outcome(ABORT_RACE, f"hung once, then {again.name}: {details_again}")
    return classify_status(code, details, _STREAM_ROOTS)


# =====================================================================================
# running targets under hypothesis
# =====================================================================================
def fuzz_settings(count: int, *, derandomize: bool = False, shrink: bool = False) -> settings:
    phases = [Phase.explicit, Phase.generate] + ([Phase.shrink] if shrink else [])
    return settings(
        max_examples=count,
        deadline=None,
        derandomize=derandomize,
        database=None,
        phases=phases,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )


def run_target(name: str, count: int, cluster: LiveCluster | None = None, client: Client | None = None, *,
               derandomize: bool = False, raise_on_unexpected: bool = False,
               refresh_every: int = 0) -> Tally:
    """Run one target on ``count`` generated inputs. With ``raise_on_unexpected``
    the first unexpected outcome fails (and hypothesis shrinks it): the tests'
    mode. Otherwise every outcome is counted: the benchmark's mode. With
    ``refresh_every`` the id pools are re-read (and new leases made) every so
    many inputs, so long runs keep reaching live tasks."""
    tally = Tally(name)
    drain: Callable[[], None] | None = None  # settles calls still open at the end
    if cluster is not None and not name.startswith("decoder."):
        POOLS.refresh(cluster, client, fresh_leases=3 if name.split(".")[-1] in _LEASE_USERS else 0)

    def record(outcomes: list[Outcome], shown: Callable[[], str]) -> None:
        if refresh_every and tally.inputs and tally.inputs % refresh_every == 0 and cluster is not None:
            POOLS.refresh(cluster, client, fresh_leases=3 if name.split(".")[-1] in _LEASE_USERS else 0)
        for outcome in outcomes:
            tally.add(outcome, shown)
            if raise_on_unexpected and outcome.unexpected:
                raise AssertionError(f"{name}: {outcome.detail}\ninput: {shown()[:3000]}")

    if name == "decoder.apply":
        strategy = decoder_case()

        def one(case):
            record(run_decoder_case(case), lambda: repr(case))
    elif name == "decoder.admit+ingest":
        strategy = ingest_case()

        def one(case):
            record(run_ingest_case(case), lambda: repr(case))
    elif name == "AgentGateway.Connect":
        strategy = agent_stream(tuple(cluster.node_ids))

        def one(msgs):
            record([run_agent_stream(client, msgs)], lambda: repr([str(m) for m in msgs]))
    elif name == "wire.undecodable":
        unary = [t for t in RPC_TARGETS.values() if not t.streaming]
        strategy = st.tuples(st.sampled_from(unary), st.binary(min_size=1, max_size=48))

        def one(pair):
            target, data = pair
            code, details, _ = client.invoke(target, data)
            # bytes that do not parse have no field to name: "request: ..." names the message itself
            record([classify_status(code, details, target.roots | {"request"})], lambda: f"{target.name} {data!r}")
    else:
        target = RPC_TARGETS[name]
        strategy = target.strategy()

        def shown_for(data: bytes) -> Callable[[], str]:
            return lambda: f"{target.name} {target.request.FromString(data)!r} + {len(data)} bytes"

        if target.streaming and not target.immediate:
            # A watch that waits for events is judged after OPEN_STREAM_S; the
            # benchmark keeps many open at once (the tests one, so a failure
            # is charged to its own input).
            window = 1 if raise_on_unexpected else 64
            open_calls: deque = deque()

            def settle() -> None:
                call, data = open_calls.popleft()
                code, details = Client.open_status(call)
                record([classify_status(code, details, target.roots)], shown_for(data))

            def one(data):
                open_calls.append((client.open_stream(target, data), data))
                while len(open_calls) >= window:
                    settle()

            def settle_all() -> None:
                while open_calls:
                    settle()

            drain = settle_all
        else:

            def one(data):
                code, details, _ = client.invoke(target, data)
                record([classify_status(code, details, target.roots)], shown_for(data))

    test = fuzz_settings(count, derandomize=derandomize, shrink=raise_on_unexpected)(given(strategy)(one))
    started = time.perf_counter()
    try:
        test()
        if drain is not None:
            drain()
    finally:
        tally.seconds = time.perf_counter() - started
    return tally


_LEASE_USERS = frozenset({"CompleteTask", "RenewLease", "MigrateTask", "CancelTask", "WatchTask", "GetTask"})

TARGETS = ["decoder.apply", "decoder.admit+ingest", *RPC_TARGETS, "AgentGateway.Connect", "wire.undecodable"]


def restore_cluster(cluster: LiveCluster, client: Client, policy: tpb.Policy | None = None) -> None:
    """Undo the levers the fuzzer pulled: uncordon the fleet, put the policy back."""
    for node in cluster.node_ids:
        client.unary("gpulb.v1.ClusterOperator", "UncordonNode", cpb.NodeActionRequest(node_id=node, reason="fuzz done"), cpb.NodeActionResponse)
    if policy is not None:
        client.unary("gpulb.v1.Scheduler", "SetPolicy", tpb.SetPolicyRequest(name=policy.name, weights=dict(policy.weights)), tpb.Policy)


def still_serves(cluster: LiveCluster, client: Client) -> list[str]:
    """After fuzzing: what is wrong with the server (empty = healthy): the
    health check, the fleet's nodes HEALTHY, open fuzz tasks cancellable, and a
    normal task placed on the fleet and completed."""
    problems = []
    try:
        if client.health() != health_pb2.HealthCheckResponse.SERVING:
            problems.append("health check is not SERVING")
        states = {n.node_id: n.state for n in client.nodes()}
        for node in cluster.node_ids:
            if states.get(node) != cpb.NODE_STATE_HEALTHY:
                problems.append(f"{node} is {cpb.NodeState.Name(states.get(node, 0))}, not HEALTHY")
        for task in client.tasks(limit=100_000):
            if task.state in (tpb.TASK_STATE_QUEUED, tpb.TASK_STATE_LEASED):
                client.unary("gpulb.v1.Scheduler", "CancelTask", tpb.CancelTaskRequest(task_id=task.spec.task_id, reason="fuzz done"), tpb.CancelTaskResponse)
        task = client.schedule(fleet_spec(f"after-fuzz-{time.monotonic_ns()}"), wait=True)
        if task.state != tpb.TASK_STATE_LEASED or task.assignment.node_id not in cluster.node_ids:
            problems.append(f"a normal task was not placed on the fleet: {tpb.TaskState.Name(task.state)} {task.reason}")
        else:
            done = client.unary("gpulb.v1.Scheduler", "CompleteTask",
                                tpb.CompleteTaskRequest(task_id=task.spec.task_id, lease_id=task.assignment.lease_id), tpb.CompleteTaskResponse)
            if done.task.state != tpb.TASK_STATE_COMPLETED:
                problems.append(f"completing a normal task left it {tpb.TaskState.Name(done.task.state)}")
    except grpc.RpcError as exc:
        problems.append(f"a normal call failed: {exc.code().name}: {exc.details()}")
    problems += [f"loop: {e}" for e in cluster.loop_errors]
    problems += [f"logged error: {e.get('event')}: {e}" for e in cluster.log.errors]
    return problems


# =====================================================================================
# the benchmark
# =====================================================================================
def _format_table(rows: list[dict]) -> str:
    codes = sorted({code for r in rows for code in r["errors"]})
    head = ["target", "inputs", "ok", *codes, "unexpected", "seconds"]
    lines = [[r["target"], r["inputs"], r["ok"], *[r["errors"].get(c, 0) for c in codes], r["unexpected"], f"{r['seconds']:.1f}"] for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]
    out = ["  ".join(str(h).ljust(w) for h, w in zip(head, widths))]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(str(x).rjust(w) if i else str(x).ljust(w) for i, (x, w) in enumerate(zip(line, widths))) for line in lines]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=10_000, help="generated inputs per target (default 10000)")
    parser.add_argument("--only", nargs="*", default=[], help="run the targets whose name contains one of these")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--json-out", metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument("--derandomize", action="store_true", help="fixed hypothesis seed (repeatable runs)")
    args = parser.parse_args(argv)
    chosen = [t for t in TARGETS if not args.only or any(p in t for p in args.only)]
    rows = []
    progress = sys.stderr
    cluster = client = None
    needs_server = any(not t.startswith("decoder.") for t in chosen)
    if needs_server:
        cluster = LiveCluster().start()
        client = Client(cluster.port)
        policy = client.unary("gpulb.v1.Scheduler", "GetPolicy", tpb.GetPolicyRequest(), tpb.Policy)
    server_problems: list[str] = []
    bugs = {}
    try:
        for i, name in enumerate(chosen, 1):
            try:
                tally = run_target(name, args.count, cluster, client, derandomize=args.derandomize, refresh_every=500)
            except Exception as exc:  # a harness failure ends this target, not the run
                tally = Tally(name)
                tally.unexpected = 1
                tally.examples.append(("(the fuzzer itself)", f"harness error: {type(exc).__name__}: {str(exc)[:500]}"))
            if cluster is not None and not name.startswith("decoder."):
                restore_cluster(cluster, client, policy)
            row = tally.row()
            rows.append(row)
            errs = ", ".join(f"{k} {v}" for k, v in row["errors"].items())
            print(f"[{i}/{len(chosen)}] {name}: {row['inputs']} inputs, {row['ok']} ok, {errs or 'no errors'}, "
                  f"{row['unexpected']} unexpected, {row['seconds']:.1f} s", file=progress, flush=True)
            for example in row["unexpected_examples"][:2]:
                print(f"    unexpected: {example['why'][:300]}\n      input: {example['input'][:300]}", file=progress, flush=True)
        if cluster is not None:
            restore_cluster(cluster, client, policy)
            server_problems = still_serves(cluster, client)
        # last: a reproduction may leave the server worse (huge_vram_task poisons ListTasks)
        for bug in KNOWN_BUGS.values():
            if bug.needs_server and cluster is None:
                continue
            reproduces, what = bug.reproduce(client)
            bugs[bug.name] = {"summary": bug.summary, "reproduces": reproduces, "observed": what[:300]}
    finally:
        if client is not None:
            client.close()
        if cluster is not None:
            cluster.stop()
    grpc_errors = dict(cluster.grpc_errors.counts.most_common()) if cluster is not None else {}
    report = json.dumps({"count": args.count, "targets": rows, "known_bugs": bugs, "grpc_error_log": grpc_errors,
                         "server_still_serves": not server_problems, "server_problems": server_problems}, indent=2)
    if args.json_out:
        Path(args.json_out).write_text(report + "\n")
    if args.json:
        print(report)
    else:
        print(_format_table(rows))
        for name, bug in bugs.items():
            print(f"known bug {name}: {'REPRODUCES' if bug['reproduces'] else 'fixed'}: {bug['observed'][:160]}")
        for line, n in grpc_errors.items():
            print(f"grpc error log x{n}: {line}")
        if needs_server:
            print("server after fuzzing: " + ("serves (health SERVING, fleet HEALTHY, a normal task placed and completed)" if not server_problems else "; ".join(server_problems)))
    unexpected = sum(r["unexpected"] for r in rows if r["target"] != "wire.undecodable")
    return 1 if unexpected or server_problems else 0


if __name__ == "__main__":
    sys.exit(main())
