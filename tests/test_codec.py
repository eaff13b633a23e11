"""Property and table tests of the telemetry wire codec (protos.codec)."""

from __future__ import annotations

import numpy as np
import pytest
import snappy
from hypothesis import given, settings
from hypothesis import strategies as st

from protos import telemetry_pb2 as pb
from protos.codec import (
    DEADBANDS,
    LOWER,
    UPPER,
    CorruptEnvelope,
    DecodeOutcome,
    InvalidReading,
    PayloadTooLarge,
    TelemetryDecoder,
    TelemetryEncoder,
)
from protos.fields import BY_NAME, FIELD_COUNT

GPU_INDICES = [0, 1, 2, 5]


def _round(draw_values: list[list[int]], draw_present: list[list[bool]]):
    values = np.clip(np.asarray(draw_values, dtype=np.int64), LOWER, np.minimum(UPPER, 10**9))
    return values, np.asarray(draw_present, dtype=bool)


row_values = st.lists(
    st.integers(min_value=-40, max_value=200_000), min_size=FIELD_COUNT, max_size=FIELD_COUNT
)
row_present = st.lists(st.booleans(), min_size=FIELD_COUNT, max_size=FIELD_COUNT)
round_strategy = st.tuples(
    st.lists(row_values, min_size=len(GPU_INDICES), max_size=len(GPU_INDICES)),
    st.lists(row_present, min_size=len(GPU_INDICES), max_size=len(GPU_INDICES)),
    st.booleans(),  # force a keyframe this round
)


@settings(max_examples=80, deadline=None)
@given(st.lists(round_strategy, min_size=1, max_size=12))
def test_reconstruction_matches_last_sent_within_deadband(rounds):
    """For any sequence of samples the decoded state is within the deadband of
    the truth, and exact after every keyframe."""
    enc = TelemetryEncoder(GPU_INDICES, keyframe_interval_s=1e9)
    dec = TelemetryDecoder(GPU_INDICES)
    truth = np.zeros((len(GPU_INDICES), FIELD_COUNT), dtype=np.int64)
    truth_known = np.zeros_like(truth, dtype=bool)
    for step, (vals, pres, force) in enumerate(rounds):
        values, present = _round(vals, pres)
        if force:
            enc.request_keyframe()
        env, batch = enc.encode(values, present, now_s=float(step), sampled_at_ns=step)
        result = dec.apply(env)
        assert result.outcome is DecodeOutcome.APPLIED
        if batch.keyframe:
            truth = np.where(present, values, 0)
            truth_known = present.copy()
            np.testing.assert_array_equal(dec.known, present)
            np.testing.assert_array_equal(dec.ints[present], values[present])
        else:
            truth = np.where(present, values, truth)
            truth_known |= present
            np.testing.assert_array_equal(dec.known, truth_known)
            err = np.abs(dec.ints - truth)
            assert (err[truth_known] < np.broadcast_to(DEADBANDS, truth.shape)[truth_known]).all()


@settings(max_examples=60, deadline=None)
@given(
    st.lists(round_strategy, min_size=3, max_size=10),
    st.data(),
)
def test_dropped_or_reordered_envelope_forces_resync_never_drift(rounds, data):
    enc = TelemetryEncoder(GPU_INDICES, keyframe_interval_s=1e9)
    envelopes = []
    for step, (vals, pres, _force) in enumerate(rounds):
        values, present = _round(vals, pres)
        envelopes.append(enc.encode(values, present, now_s=float(step), sampled_at_ns=step)[0])
    victim = data.draw(st.integers(min_value=1, max_value=len(envelopes) - 2), label="victim")
    reorder = data.draw(st.booleans(), label="reorder")
    stream = list(envelopes)
    if reorder and victim + 1 < len(stream):
        stream[victim], stream[victim + 1] = stream[victim + 1], stream[victim]
    else:
        del stream[victim]
    dec = TelemetryDecoder(GPU_INDICES)
    outcomes = [dec.apply(env).outcome for env in stream]
    # Everything after the disturbance (that is not the first keyframe) is either
    # a resync request or ignored: never applied on top of a hole.
    assert outcomes[victim] is DecodeOutcome.RESYNC_NEEDED
    assert all(o is not DecodeOutcome.APPLIED for o in outcomes[victim + 1 :])
    assert dec.awaiting_keyframe
    # The keyframe the coordinator asks for restores the exact truth.
    enc.request_keyframe()
    values, present = _round(*rounds[-1][:2])
    env, _ = enc.encode(values, present, now_s=100.0, sampled_at_ns=100)
    assert dec.apply(env).outcome is DecodeOutcome.APPLIED
    np.testing.assert_array_equal(dec.ints[present], values[present])
    assert not dec.awaiting_keyframe


def _keyframe(values: np.ndarray | None = None) -> tuple[TelemetryEncoder, pb.Envelope]:
    enc = TelemetryEncoder(GPU_INDICES)
    if values is None:
        values = np.tile(np.maximum(LOWER, 1), (len(GPU_INDICES), 1))
    env, _ = enc.encode(values, np.ones(values.shape, bool), now_s=0.0, sampled_at_ns=0)
    return enc, env


def test_unchanged_readings_send_nothing_but_the_envelope():
    enc, env = _keyframe()
    values = np.tile(np.maximum(LOWER, 1), (len(GPU_INDICES), 1))
    env2, batch = enc.encode(values, np.ones(values.shape, bool), now_s=1.0, sampled_at_ns=1)
    assert not batch.keyframe
    assert len(batch.columns) == 0 and len(batch.gpu_index) == 0
    assert env2.compression == pb.COMPRESSION_NONE
    assert len(env2.SerializeToString()) <= 12


def test_an_empty_delta_is_skipped_unless_the_sampling_period_changed():
    """The agent skips envelopes that carry nothing, but not one that tells
    the coordinator its period changed: a host that calmed down must not be
    shown at 200 ms until the next keyframe."""
    values = np.tile(np.maximum(LOWER, 1), (len(GPU_INDICES), 1))
    present = np.ones(values.shape, bool)
    enc = TelemetryEncoder(GPU_INDICES)
    env, _ = enc.encode(values, present, now_s=0.0, sampled_at_ns=0, sample_interval_ms=200, skip_empty=True)
    assert env is not None  # the keyframe
    sent = []
    for t, period in ((0.2, 200), (0.4, 300), (0.7, 300), (1.0, 450), (1.5, 450)):
        env, batch = enc.encode(values, present, now_s=t, sampled_at_ns=0, sample_interval_ms=period, skip_empty=True)
        sent.append(None if env is None else batch.sample_interval_ms)
        assert len(batch.columns) == 0
    assert sent == [None, 300, None, 450, None]


def test_a_quiet_host_still_sends_an_empty_delta_every_refresh_interval():
    """Nothing moved for a refresh interval: an empty delta goes out anyway,
    vouching to the coordinator that the readings it holds are current."""
    values = np.tile(np.maximum(LOWER, 1), (len(GPU_INDICES), 1))
    present = np.ones(values.shape, bool)
    enc = TelemetryEncoder(GPU_INDICES, refresh_interval_s=1.0)
    enc.encode(values, present, now_s=0.0, sampled_at_ns=0, skip_empty=True)
    sent = [
        t for t in (0.5, 0.9, 1.0, 1.5, 1.99, 2.0, 2.5)
        if enc.encode(values, present, now_s=t, sampled_at_ns=0, skip_empty=True)[0] is not None
    ]
    assert sent == [1.0, 2.0]


def test_keyframe_at_least_every_interval():
    enc = TelemetryEncoder(GPU_INDICES, keyframe_interval_s=30.0)
    v = np.tile(np.maximum(LOWER, 1), (len(GPU_INDICES), 1))
    p = np.ones_like(v, bool)
    flags = [enc.encode(v, p, now_s=t, sampled_at_ns=0)[1].keyframe for t in (0.0, 10.0, 29.9, 30.0, 45.0, 60.1)]
    assert flags == [True, False, False, True, False, True]


def test_absent_field_is_absent_not_zero():
    v = np.tile(np.maximum(LOWER, 1), (len(GPU_INDICES), 1))
    v[:, BY_NAME["power_w"]] = 7
    p = np.ones_like(v, bool)
    p[1, BY_NAME["power_w"]] = False
    v[1, BY_NAME["power_w"]] = 0
    enc = TelemetryEncoder(GPU_INDICES)
    dec = TelemetryDecoder(GPU_INDICES)
    dec.apply(enc.encode(v, p, now_s=0, sampled_at_ns=0)[0])
    assert np.isnan(dec.values[1, BY_NAME["power_w"]])
    assert dec.values[0, BY_NAME["power_w"]] == 7


def _env_with(batch: pb.MetricBatch, seq: int = 1) -> pb.Envelope:
    raw = batch.SerializeToString()
    return pb.Envelope(seq=seq, compression=pb.COMPRESSION_SNAPPY, raw_size=len(raw), payload=snappy.compress(raw))


@pytest.mark.parametrize(
    "make, error, field",
    [
        (lambda: pb.Envelope(seq=1, compression=pb.COMPRESSION_SNAPPY, raw_size=5, payload=b"\xff\xff"), CorruptEnvelope, "payload"),
        (lambda: pb.Envelope(seq=1, compression=pb.COMPRESSION_SNAPPY, raw_size=3, payload=snappy.compress(b"abcd")), CorruptEnvelope, "raw_size"),
        (lambda: pb.Envelope(seq=1, compression=pb.COMPRESSION_SNAPPY, raw_size=10, payload=b"\x80\x80\x80\x80\x08rest"), PayloadTooLarge, "payload"),
        (lambda: pb.Envelope(seq=1, compression=pb.COMPRESSION_NONE, raw_size=1 << 30, payload=b""), PayloadTooLarge, "raw_size"),
        (lambda: pb.Envelope(seq=1, compression=pb.COMPRESSION_NONE, raw_size=3, payload=b"\x0a\xff\xff"), CorruptEnvelope, "payload"),
        (lambda: pb.Envelope(seq=1, compression=7, raw_size=0, payload=b""), CorruptEnvelope, "compression"),
        (lambda: pb.Envelope(seq=0, compression=pb.COMPRESSION_NONE, raw_size=0, payload=b""), CorruptEnvelope, "seq"),
        (
            lambda: _env_with(pb.MetricBatch(keyframe=True, gpu_index=[9], columns=[pb.FieldColumn(field=pb.FIELD_UTIL_GPU_PCT, presence=b"\x01", values=[5])])),
            InvalidReading,
            "gpu_index[0]",
        ),
        (
            lambda: _env_with(pb.MetricBatch(keyframe=True, gpu_index=[0], columns=[pb.FieldColumn(field=pb.FIELD_UTIL_GPU_PCT, presence=b"\x01", values=[101])])),
            InvalidReading,
            "util_gpu_pct",
        ),
        (
            lambda: _env_with(pb.MetricBatch(keyframe=True, gpu_index=[0], columns=[pb.FieldColumn(field=pb.FIELD_TEMPERATURE_C, presence=b"\x01", values=[-300])])),
            InvalidReading,
            "temperature_c",
        ),
        (
            lambda: _env_with(pb.MetricBatch(keyframe=True, gpu_index=[0, 1], columns=[pb.FieldColumn(field=pb.FIELD_UTIL_GPU_PCT, presence=b"\x03", values=[1])])),
            CorruptEnvelope,
            "columns[0].values",
        ),
        (
            lambda: _env_with(pb.MetricBatch(keyframe=True, gpu_index=[0], columns=[pb.FieldColumn(field=pb.FIELD_UTIL_GPU_PCT, presence=b"\x01\x00", values=[1])])),
            CorruptEnvelope,
            "columns[0].presence",
        ),
        (
            lambda: _env_with(pb.MetricBatch(keyframe=True, gpu_index=[0], columns=[pb.FieldColumn(field=99, presence=b"\x01", values=[1])])),
            CorruptEnvelope,
            "columns[0].field",
        ),
        (
            lambda: _env_with(pb.MetricBatch(keyframe=True, gpu_index=[0, 0])),
            CorruptEnvelope,
            "gpu_index",
        ),
    ],
)
def test_bad_envelopes_name_the_field_and_leave_state_untouched(make, error, field):
    enc, first = _keyframe()
    dec = TelemetryDecoder(GPU_INDICES)
    dec.apply(first)
    before = dec.ints.copy()
    env = make()
    env.seq = env.seq and 2  # next in sequence, so only the content is at fault
    with pytest.raises(error) as info:
        dec.apply(env)
    assert info.value.field == field
    np.testing.assert_array_equal(dec.ints, before)
    assert dec.expected_seq == 2


def test_delta_before_first_keyframe_is_ignored():
    enc = TelemetryEncoder(GPU_INDICES)
    v = np.tile(np.maximum(LOWER, 1), (len(GPU_INDICES), 1))
    enc.encode(v, np.ones_like(v, bool), now_s=0, sampled_at_ns=0)
    env, batch = enc.encode(v + 5, np.ones_like(v, bool), now_s=1, sampled_at_ns=0)
    assert not batch.keyframe
    dec = TelemetryDecoder(GPU_INDICES)
    env.seq = 1
    assert dec.apply(env).outcome is DecodeOutcome.IGNORED
    assert not dec.known.any()
