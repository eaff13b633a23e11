"""The ingest hot path's shortcuts give the same answers as the long way:
bulk histogram counts, the decoder's cache of gpu_index rows, columns
extracted once at admission, a keyframe of a healthy node that asks for no
dispatch pass, and the benchmark's own HTTP/2 load generator speaking to a
real coordinator."""

from __future__ import annotations

import asyncio
import contextlib
import io

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Histogram

from coordinator.config import CoordinatorConfig
from coordinator.ingestbench import _frame, _generate_h2, _templates
from coordinator.server import Coordinator, observe_many
from protos import telemetry_pb2 as pb
from protos.codec import CorruptEnvelope, InvalidReading, TelemetryDecoder, batch_cells, column_cells, extract_columns
from protos.fields import FIELDS

pytestmark = pytest.mark.timeout(60)


def _samples(h: Histogram) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for m in h.collect() for s in m.samples if not s.name.endswith("_created")}


def test_observe_many_counts_like_observe():
    bounds = (0.005, 0.01, 0.025, 0.05, 0.1)
    one = Histogram("one", "x", buckets=bounds, registry=CollectorRegistry())
    many = Histogram("many", "x", buckets=bounds, registry=CollectorRegistry())
    values = np.array([0.0, 0.005, 0.0051, 0.01, 0.02, 0.05, 0.07, 0.1, 0.2, 3.0])
    for v in values:
        one.observe(float(v))
    observe_many(many, values)
    a = {(k[0].replace("one", "h"), k[1]): v for k, v in _samples(one).items()}
    b = {(k[0].replace("many", "h"), k[1]): v for k, v in _samples(many).items()}
    assert a.keys() == b.keys()
    for key in a:
        assert a[key] == pytest.approx(b[key])


def _batch(gpu_index: list[int], columns: dict[int, list[int]], gpus: int) -> pb.MetricBatch:
    batch = pb.MetricBatch(gpu_index=gpu_index, keyframe=True)
    width = (len(gpu_index) + 7) // 8
    for col, vals in columns.items():
        mask = np.zeros(width * 8, dtype=bool)
        mask[: len(vals)] = True
        batch.columns.add(field=FIELDS[col].field, presence=np.packbits(mask, bitorder="little").tobytes(), values=vals)
    return batch


def _envelope(seq: int, batch: pb.MetricBatch) -> pb.Envelope:
    raw = batch.SerializeToString()
    return pb.Envelope(seq=seq, compression=pb.COMPRESSION_NONE, raw_size=len(raw), payload=raw)


def test_decoder_rows_cache_keeps_every_check():
    dec = TelemetryDecoder([0, 1, 2, 3])
    first = dec.admit(_envelope(1, _batch([2, 0], {0: [10, 20]}, 4)))
    again = dec.admit(_envelope(2, _batch([2, 0], {0: [11, 21]}, 4)))
    assert list(first.rows) == [2, 0] and again.rows is first.rows
    assert not again.rows.flags.writeable  # shared: nobody may change it
    with pytest.raises(CorruptEnvelope, match="gpu_index"):
        dec.admit(_envelope(3, _batch([1, 1], {0: [1, 2]}, 4)))
    with pytest.raises(CorruptEnvelope, match="gpu_index"):  # a refused list is never cached
        dec.admit(_envelope(3, _batch([1, 1], {0: [1, 2]}, 4)))
    with pytest.raises(InvalidReading, match=r"gpu_index\[1\]"):
        dec.admit(_envelope(3, _batch([0, 9], {0: [1, 2]}, 4)))
    assert dec.expected_seq == 3  # refused envelopes advanced nothing


def test_extracted_columns_give_the_same_cells_as_the_batch():
    bodies = _templates(8, 1)[0][:40]  # a keyframe, then deltas
    dec = TelemetryDecoder(list(range(8)))
    items_batch, items_cols = [], []
    for seq, body in enumerate(bodies, start=1):
        result = dec.admit(pb.AgentMessage.FromString(_frame(seq, body)).telemetry)
        rows = np.asarray(result.rows) + 8 * (seq % 3)
        items_batch.append((rows, result.batch))
        items_cols.append((rows, result.columns))
        assert result.columns == extract_columns(result.batch, len(result.rows))
    for a, b in zip(batch_cells(items_batch), column_cells(items_cols)):
        assert np.array_equal(a, b)


async def test_periodic_keyframe_of_a_healthy_node_asks_for_no_dispatch_pass():
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0"))
    requests = []
    coord.dispatcher.request = lambda: requests.append(1)
    from coordinator.gateway import AgentSession

    reg = pb.Register(node_id="n1", gpus=[pb.GpuInfo(index=i, uuid=f"GPU-{i}", model="RTX 4090", memory_total_mib=24564) for i in range(8)])
    session = AgentSession(node_id="n1", peer="test")
    coord.gateway.sessions["n1"] = session
    node = coord.node_registered(reg, session)
    templates = _templates(8, 1)[0]
    for seq in (1, 2, 3):  # two keyframes in a row, then a delta
        body = templates[0] if seq < 3 else templates[1]
        coord.gateway._telemetry(pb.AgentMessage.FromString(_frame(seq, body)).telemetry, session, node, coord.clock())
    coord.smooth_now()
    assert coord.liveness.schedulable("n1")
    assert requests == []  # nothing queued: no pass was asked for
    assert coord._envelopes_applied == 0 and coord.rejected_envelopes == 0


async def test_h2_load_generator_streams_through_a_real_coordinator():
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0"))
    port = await coord.start()
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            await asyncio.wait_for(_generate_h2(f"127.0.0.1:{port}", 3, 8, 0.05, 1.5, 2), 30)
        coord.smooth_now()
        assert sorted(coord.view.nodes) == ["bench-00000", "bench-00001", "bench-00002"]
        assert all(n.decoder.expected_seq > 2 for n in coord.view.nodes.values())  # keyframe and deltas, in order
        assert coord.rejected_envelopes == 0 and coord.resync_requests == 0
    finally:
        await coord.stop(grace_s=0.5)
    first = next(line for line in out.getvalue().splitlines() if line.startswith('{"connected"'))
    assert '"connected": 3' in first and '"failed": 0' in first


def test_a_step_that_goes_quiet_is_read_again_until_accepted_and_a_lone_spike_is_not():
    """The view feeds a silent signal's value again (once per two sampling
    periods) while its filter lags it: a real step that arrives once is
    accepted after ``persist`` readings; a spike undone by the next reading
    never is. Checked through ClusterView with its own clock values."""
    import numpy as np

    from coordinator.view import SIGNALS, ClusterView
    from protos import telemetry_pb2 as pb
    from protos.fields import BY_NAME

    view = ClusterView(capacity=4)
    reg = pb.Register(node_id="n", gpus=[pb.GpuInfo(index=i, uuid=f"GPU-{i}", model="M", memory_total_mib=24_000)
                                         for i in range(2)])
    node = view.register(reg, 0.0)
    view.set_sample_interval(node, 200)
    mem = BY_NAME["memory_used_mib"]
    sig = SIGNALS.index("memory_used_mib")
    rows = node.rows
    t = 0.0

    def reading(values_mib):
        nonlocal t
        t += 0.2
        view.raw[rows, mem] = values_mib
        values = np.full((rows.size, len(view.signal_field_columns)), np.nan)  # every signal but disk await
        values[:, sig] = values_mib
        view.queue_signals(rows, values, t)
        view.flush_signals(t)

    for _ in range(30):  # a steady level fills the window
        reading([1_000.0, 1_000.0])
    # GPU 0: a real 20 GiB step, sent once (deltas go quiet); GPU 1: a spike, undone at once
    reading([21_480.0, 21_480.0])
    reading([21_480.0, 1_000.0])
    for _ in range(40):  # 8 s of silence: only the view's re-reads feed the filter
        t += 0.2
        view.flush_signals(t)
    smoothed = view.smoothed("memory_used_mib")[rows]
    assert abs(smoothed[0] - 21_480.0) < 0.05 * 20_480, smoothed  # followed the step
    assert abs(smoothed[1] - 1_000.0) < 50.0, smoothed  # the spike stayed out
