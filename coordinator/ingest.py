"""Applies admitted telemetry to the view's columns, many envelopes at a time.

Per envelope the stream handler does only what must happen at once: parse,
sequence check, structural checks (``TelemetryDecoder.admit``). Delta values
wait here until the next tick, when every pending envelope of every node is
applied with a fixed number of numpy operations (``protos.codec.batch_cells``
plus a grouped cumulative sum), so ingest costs a few microseconds of Python
per envelope instead of dozens of numpy calls.

Deltas are differences from the last value sent, so several envelopes for the
same GPU field in one tick add up in order: value after envelope k = the value
before the tick + the sum of that cell's deltas up to k (a cumulative sum
within each (row, field) group, in arrival order). Every intermediate value is
a reading the anomaly filter sees in order.

A value out of its field's range rejects its envelope and every later one of
the same node in the tick; the node's stream is closed with a status naming
the field, and nothing of those envelopes is applied. Keyframes are applied
at once (after flushing what is pending, to keep order), validated before
they replace anything.

A round replayed from an agent's outage buffer (``sampled_s`` given) updates
values like any other, but its readings go to the filter at the time it was
sampled (``ClusterView.queue_replayed``), and it vouches for its node only as
of that time, once the stream's clock is known (``ClusterView.settle_replay``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from protos import telemetry_pb2 as pb
from protos.codec import LOWER, UPPER, Columns, batch_cells, column_cells, extract_columns
from protos.fields import FIELD_COUNT, FIELDS

if TYPE_CHECKING:
    from coordinator.view import ClusterView, NodeRecord

__all__ = ["TelemetryIngest", "Rejection"]


@dataclass(frozen=True)
class Rejection:
    node_id: str
    field: str
    message: str


@dataclass
class _Pending:
    node: "NodeRecord"
    rows: np.ndarray  # view rows, in the batch's gpu_index order
    columns: Columns  # the batch's checked columns (``extract_columns``)
    arrived_s: float
    sampled_s: float | None = None  # agent wall clock, s: a replayed round; None: live


@dataclass
class FlushResult:
    arrivals: list[float] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)


class TelemetryIngest:
    def __init__(self, view: "ClusterView") -> None:
        self.view = view
        self._pending: list[_Pending] = []
        self._replayed = 0  # replayed rounds queued since the last flush (an upper bound)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def add_delta(
        self,
        node: "NodeRecord",
        decoder_rows: np.ndarray,
        batch: pb.MetricBatch,
        arrived_s: float,
        columns: Columns | None = None,
        sampled_s: float | None = None,
    ) -> None:
        """Queue an admitted delta for the next flush. ``columns`` are the
        batch's columns as ``TelemetryDecoder.admit`` extracted them (walked
        here again when not given); ``sampled_s`` is given for a replayed round."""
        if columns is None:
            columns = extract_columns(batch, len(decoder_rows))
        if columns[0]:
            self._pending.append(_Pending(node, node.rows[decoder_rows], columns, arrived_s, sampled_s))
            if sampled_s is not None:
                self._replayed += 1
        elif sampled_s is None:
            # nothing moved: it vouches for the node's readings (``_vouch``)
            self._vouch([node.rows], np.asarray([arrived_s]))
        # (an empty replayed round vouches with the rest of its replay: ClusterView.settle_replay)

    def forget_node(self, node_id: str) -> None:
        self._pending = [p for p in self._pending if p.node.node_id != node_id]

    def apply_keyframe(
        self, node: "NodeRecord", decoder_rows: np.ndarray, batch: pb.MetricBatch, arrived_s: float, sampled_s: float | None = None
    ) -> FlushResult:
        """Flush what is pending (it came first), then replace the node's
        values with the keyframe's. Raises ValueError-free: an out-of-range
        keyframe comes back as a rejection and changes nothing. ``sampled_s``
        is given for a replayed round."""
        result = self.flush()
        rows = node.rows[decoder_rows]
        cell_rows, cell_cols, values, _ = batch_cells([(rows, batch)])
        bad = (values < LOWER[cell_cols]) | (values > UPPER[cell_cols])
        if bad.any():
            first = int(np.flatnonzero(bad)[0])
            result.rejected.append(self._rejection(node, int(cell_rows[first]), int(cell_cols[first]), float(values[first])))
            return result
        view = self.view
        view.raw[node.rows] = np.nan
        view.raw[cell_rows, cell_cols] = values
        view.version += 1
        readings = view.raw[node.rows][:, view.signal_field_columns]
        if sampled_s is None:
            view.reading_at_s[node.rows] = arrived_s
            # everything in a keyframe is a fresh reading
            view.queue_signals(node.rows, readings, arrived_s)
        else:
            # values from before the stream: not fresh, readings of their own time
            view.queue_replayed(node, node.rows, readings, sampled_s, arrived_s)
        result.arrivals.append(arrived_s)
        return result

    def flush(self) -> FlushResult:
        result = FlushResult()
        while self._pending:
            pending, self._pending = self._pending, []
            rejected = self._apply(pending, result)
            if not rejected:
                break
            # Drop every envelope of a failing node from its first bad one on,
            # then apply the rest again (rare: only malformed agents get here).
            result.rejected.extend(rejected)
            bad_nodes = {r.node_id for r in rejected}
            self._pending = [p for p in pending if p.node.node_id not in bad_nodes]
            result.arrivals.clear()
        self._replayed = 0
        return result

    def _vouch(self, node_rows: list[np.ndarray], arrived: np.ndarray) -> None:
        """A delta means the agent read every GPU of its node and found
        nothing else past its deadband: all of the node's readings are
        current as of its arrival, not only the cells it carries (or a quiet
        GPU, an inference server waiting with its memory held, would turn
        stale and be taken out of placement). This is the only place reading
        times of deltas are set. Never moved back: an empty delta may have
        vouched since. ``node_rows[i]`` arrived at ``arrived[i]``."""
        view = self.view
        rows = np.concatenate(node_rows)
        at = np.repeat(arrived, [r.size for r in node_rows])
        # a row repeated: the last (latest) assignment wins
        view.reading_at_s[rows] = np.fmax(view.reading_at_s[rows], at)

    def _queue_with_replayed(self, pending: list[_Pending], replayed: np.ndarray, pair_rows: np.ndarray, pair_items: np.ndarray,
                             matrix: np.ndarray, arrived: np.ndarray) -> None:
        """``queue_signals`` for a flush that holds replayed rounds. Their
        readings go first: a node's replay precedes its live batches, so a
        row's readings stay in order. ``pair_items`` is sorted."""
        view = self.view
        items = np.flatnonzero(replayed)
        starts = np.searchsorted(pair_items, items, "left")
        ends = np.searchsorted(pair_items, items, "right")
        for item, start, end in zip(items.tolist(), starts.tolist(), ends.tolist()):
            if start < end:
                p = pending[item]
                view.queue_replayed(p.node, pair_rows[start:end], matrix[start:end], p.sampled_s, p.arrived_s)
        live = ~replayed[pair_items]
        if live.any():
            view.queue_signals(pair_rows[live], matrix[live], arrived[pair_items[live]])

    def _rejection(self, node: "NodeRecord", row: int, column: int, value: float) -> Rejection:
        spec = FIELDS[column]
        gpu = int(self.view.row_gpu_index[row])
        return Rejection(node.node_id, spec.name, f"GPU {gpu}: {value:.0f} {spec.unit} outside {spec.lo}..{spec.hi}")

    def _apply(self, pending: list[_Pending], result: FlushResult) -> list[Rejection]:
        view = self.view
        rows, cols, deltas, items = column_cells([(p.rows, p.columns) for p in pending])
        # replayed rounds (rare: after a reconnect) vouch and reach the filter apart
        replayed = np.asarray([p.sampled_s is not None for p in pending]) if self._replayed else None
        if replayed is not None and not replayed.any():
            replayed = None
        if rows.size == 0:
            live = pending if replayed is None else [p for p, r in zip(pending, replayed) if not r]
            if live:
                self._vouch([p.node.rows for p in live], np.asarray([p.arrived_s for p in live]))
            result.arrivals.extend(p.arrived_s for p in pending)
            return []
        key = rows * FIELD_COUNT + cols
        order = np.argsort(key, kind="stable")  # stable: arrival order inside a cell
        ks = key[order]
        ds = deltas[order]
        col_sorted = cols[order]
        # No valid delta (from a valid value, or from zero for a first value, to
        # a valid value) exceeds |hi| + |lo|; one that does is refused before it
        # enters the sums, which stay exact int64
        # arithmetic (a float cumsum would let a huge bogus delta of one node
        # wash out the precision of every other node's values).
        too_big = np.abs(ds) > (np.abs(UPPER) + np.abs(LOWER))[col_sorted]
        start = np.ones(ks.size, dtype=bool)
        start[1:] = ks[1:] != ks[:-1]
        group = np.cumsum(start) - 1
        firsts = np.flatnonzero(start)
        clean = np.where(too_big, 0, ds)
        csum = np.cumsum(clean)
        running = csum - (csum[firsts] - clean[firsts])[group]
        flat = view.raw.reshape(-1)
        base = flat[ks]
        # An unknown value (NaN) is zero for a delta: the encoder sends a field's
        # first value against zero.
        new = np.where(np.isnan(base), 0, base).astype(np.int64) + running
        bad = too_big | (new < LOWER[col_sorted]) | (new > UPPER[col_sorted])
        if bad.any():
            out: dict[str, Rejection] = {}
            for i in np.flatnonzero(bad):
                p = pending[int(items[order[i]])]
                if p.node.node_id not in out:
                    # the reading: a delta too big to sum was left out of new
                    value = float(int(new[i]) + int(ds[i])) if too_big[i] else float(new[i])
                    out[p.node.node_id] = self._rejection(p.node, int(rows[order[i]]), int(col_sorted[i]), value)
            return list(out.values())
        lasts = np.append(firsts[1:] - 1, ks.size - 1)
        flat[ks[lasts]] = new[lasts]
        new = new.astype(np.float64)
        arrived = np.asarray([p.arrived_s for p in pending])
        # every envelope vouches for its whole node (covers the rows it carries)
        if replayed is None:
            self._vouch([p.node.rows for p in pending], arrived)
        else:
            live = np.flatnonzero(~replayed)
            if live.size:
                self._vouch([pending[i].node.rows for i in live], arrived[live])
        view.version += 1
        # Readings for the anomaly filter: one row of signals per (envelope, GPU),
        # holding the value after that envelope.
        signal_index = view.signal_index_of_field[cols]
        selected = signal_index >= 0
        if selected.any():
            new_in_order = np.empty_like(new)
            new_in_order[order] = new
            capacity = view.capacity
            pair = items[selected].astype(np.int64) * capacity + rows[selected]
            pairs, inverse = np.unique(pair, return_inverse=True)
            matrix = np.full((pairs.size, view.signal_field_columns.size), np.nan)
            matrix[inverse, signal_index[selected]] = new_in_order[selected]
            pair_rows = (pairs % capacity).astype(np.intp)
            pair_items = pairs // capacity
            if replayed is None:
                view.queue_signals(pair_rows, matrix, arrived[pair_items])
            else:
                self._queue_with_replayed(pending, replayed, pair_rows, pair_items, matrix, arrived)
        result.arrivals.extend(arrived.tolist())
        return []
