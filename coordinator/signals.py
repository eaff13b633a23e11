"""Columnar signal processing for the coordinator's global view.

A ``SignalBank`` keeps, for every GPU row and every signal, a rolling window
of readings and turns each new reading into a raw value, an
anomaly-filtered EWMA, a forecast and a trend. ``update`` handles a whole batch
of rows with a fixed number of numpy operations, so the coordinator applies it
in one periodic tick over all rows that received readings, never per reading.

Per (row, signal), with ``W`` the window, ``n`` the readings in it
(``n <= W``), ``x`` a new reading:

* **Fences** (only when ``n >= min_window``; smaller windows accept
  everything): with ``Q1``, ``Q3`` the window's quartiles (linear
  interpolation, as ``np.percentile``), ``mu`` its mean and ``sigma`` its
  population standard deviation, and ``f`` the signal's ``min_spread``::

      IQR band = [Q1 - max(k * (Q3 - Q1), f),  Q3 + max(k * (Q3 - Q1), f)]
      z band   = [mu - max(z_max * sigma, f),  mu + max(z_max * sigma, f)]

  ``x`` is an anomaly when it lies outside **either** band: the two are
  filters in series, each able to reject. The IQR test ignores the window's
  own outliers; the z test catches spikes off a window too small or too
  lumpy for stable quartiles. The floor ``f`` keeps a perfectly flat window
  (IQR = sigma = 0) from turning the next one-unit wiggle into an anomaly
  forever; it also means a mostly idle duty cycle (Q1 = Q3 = 0) rejects a
  lone burst but accepts a burst that lasts ``persist`` readings.
* **Anomaly**: does not move the smoothed value or the trend; counted in
  ``anomaly_counts[signal]`` and flagged in ``flagged[row, signal]`` until
  the next accepted reading; still the ``raw`` value. It does enter the
  window: the quartiles shrug off a few spikes, while leaving them out would
  cut the window's tails and narrow the fence reading by reading (measured on
  Gaussian noise: 3.7 % of readings rejected instead of 2.5 %, and 8x the
  spurious shifts).
* **Level shift**: ``persist`` anomalies in a row on the same side of the
  fence are a real change, not a glitch. The window is re-seeded with those
  ``persist`` readings, the EWMA snaps to their median (one spike inside the
  run cannot become the new level), the flag clears and
  ``shift_counts[signal]`` grows. The reading that completes the run is not
  counted as an anomaly; the ``persist - 1`` before it stay counted (they
  were rejected when they arrived). ``persist = 3`` by default: the agent
  samples every 0.2-2 s, so a real change is followed within 0.6-6 s, well
  inside the scheduler's staleness bound, while a one-sample spike and a
  two-sample glitch (a bad NVML read and the delta that undoes it) are both
  rejected. On Gaussian noise 2.5 % of readings fall outside the fence
  (quartiles and sigma of 30 readings are noisy estimates) but three in a
  row on one side happen about 4 times in 100,000 readings. After a shift
  the window holds ``persist`` readings, so no fence applies until
  ``min_window`` (5) have arrived: a spike in those few readings gets
  through.
* **Expected drop** (``expect_drop``): the coordinator ended a lease on the
  GPU, so its readings are about to fall, and a fall it caused is no
  anomaly. Until ``until_s`` (reading time) the first reading below the
  fence is a level shift at once, without waiting for ``persist`` readings:
  the window is re-seeded with the run it ends (usually that one reading),
  the EWMA snaps to the run's median and the flag clears
  (``expected_shift_counts``, not ``shift_counts``). Until the window holds
  ``min(persist, min_window)`` readings again the level is the median of
  the readings since the change, not the EWMA seeded by the first one (a
  reading taken while the task was stopping, 40 % between 88 % and 0 %,
  would otherwise hold the EWMA up for several readings); from then on it
  is exactly the state an ordinary shift would have left. A fall that
  arrived *before* the lease ended (the task's process exited, then its
  worker said so) is flagged as usual; ``expect_drop`` accepts that run at
  once. One expected shift per cell and release; a reading *above* the
  fence is judged as always, so a spike still is one.
* **Smoothing** (accepted readings only): ``s = x`` for the first reading,
  then ``s <- alpha * x + (1 - alpha) * s``.
* **Forecast**: simple exponential smoothing's one-step-ahead forecast is the
  level, ``forecast = s``. With ``forecast_horizon_s = h > 0`` the trend is
  added, ``forecast = s + trend_per_min * h / 60`` (a linear extrapolation
  with the least-squares slope; 0 by default).
* **Trend**: least-squares slope, per minute, of the accepted readings in the
  ring taken in the last ``trend_window_s`` (60 s)::

      trend_per_min = 60 * sum((t - t_bar) * (v - v_bar)) / sum((t - t_bar)**2)

  The ring holds ``window`` readings, so at the agent's fastest rate (5 per
  second) the trend spans the last 6 s, not 60. NaN while fewer than two
  readings (or a single instant) are in the span: unknown, not flat.

Real-trace figures (``tests/test_signals.py``, Alibaba GenAI, one reading a
minute, 40 pods): +10 GiB memory spikes, 79 % removed from the smoothed
series (98 % of those far outside what the pod just did); +60 % duty-cycle
spikes, 82 % (92 %); 6.6 % and 5.7 % of the clean readings flagged; memory
steps between plateaus followed within 2-5 readings.

Speed: state is per (row, signal) *cell* in flat arrays, so a batch is a
``take`` of its cells' rings, a fixed number of numpy calls over a
``(cells, W)`` block in reusable scratch, and a scatter back. Quartiles come
from sorting the block along the last axis: on the 2-core dev box, for 1,000
rows x 5 signals x 30, 0.35 us per row with fixed quartile columns for full
windows (0.63 us with ``take_along_axis`` at each partial window's count),
against 2.9 us for ``np.partition``, 4.0 us for ``np.percentile`` and 157 us
for ``np.nanpercentile`` (a Python loop over rows). A whole ``update`` costs
about 2 us per row for 300-1,000-row batches with all 5 signals (0.65-1 us
when a delta carries one), 15-20 us per row for 8-row batches (fixed numpy
call overhead): apply it in a periodic tick over every row that has readings.
``benchmarks/bench_signals.py`` re-measures all of this.

NaN in ``update``'s values means "no reading for that signal" and leaves that
cell's state untouched. Outputs use NaN for "unknown", never 0.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import numpy.typing as npt

from protos import fields as _fields

__all__ = ["SignalBank", "MIN_SPREAD", "min_spread_for", "quartiles"]

#: Fence floor per telemetry field, in the field's wire unit (see
#: ``protos.fields``): the smallest move that can be a real change rather than
#: sensor noise, so a flat window does not reject a one-unit wiggle.
MIN_SPREAD: dict[str, float] = {
    "util_gpu_pct": 2.0,
    "util_memory_pct": 2.0,
    "memory_used_mib": 64.0,
    "temperature_c": 1.0,
    "power_w": 5.0,
    "sm_clock_mhz": 30.0,  # two 15 MHz clock bins
    "pcie_rx_mbps": 64.0,  # two wire deadbands
    "pcie_tx_mbps": 64.0,
}


def min_spread_for(names: Sequence[str]) -> np.ndarray:
    """Fence floors for the view's signal columns, in order.

    A field without an entry in ``MIN_SPREAD`` falls back to its wire
    deadband: the agent never reports a smaller change, so a smaller fence
    could only reject the first change that it does report.
    """
    out = np.empty(len(names), dtype=np.float64)
    for i, name in enumerate(names):
        if name in MIN_SPREAD:
            out[i] = MIN_SPREAD[name]
        else:
            out[i] = float(_fields.FIELDS[_fields.column_of(name)].deadband)
    return out


def quartiles(
    sorted_windows: np.ndarray, counts: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Q1 and Q3 of each window whose first ``counts`` entries are valid.

    ``sorted_windows`` is ``(..., W)`` sorted along the last axis; ``counts``
    has the leading shape. Linear interpolation at ``h = (n - 1) * q``, the
    same as ``np.percentile``'s default, so that the two can be compared. A
    cell with ``n = 0`` yields NaN.
    """
    n = counts[..., None]
    h = (np.maximum(n, 1) - 1) * _QUARTS  # (..., 2)
    lo = h.astype(np.intp)  # floor: h >= 0
    frac = h - lo
    hi = np.minimum(lo + 1, np.maximum(n, 1) - 1)
    a = np.take_along_axis(sorted_windows, lo, axis=-1)
    b = np.take_along_axis(sorted_windows, hi, axis=-1)
    with np.errstate(invalid="ignore"):  # an empty window's padding: inf - inf
        q = a + frac * (b - a)
    q = np.where(n > 0, q, np.nan)
    return q[..., 0], q[..., 1]


_QUARTS = np.array([0.25, 0.75])


def _median_first(vals: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Median of the first ``counts[i]`` entries of each row of ``vals``
    (``counts >= 1``), as ``np.median`` of those entries."""
    s = np.sort(np.where(np.arange(vals.shape[1]) < counts[:, None], vals, np.inf), axis=-1)
    r = np.arange(counts.size)
    return 0.5 * (s[r, (counts - 1) // 2] + s[r, counts // 2])


def _readonly(a: np.ndarray) -> np.ndarray:
    v = a.view()
    v.flags.writeable = False
    return v


# Empty ring slots hold value 0 and this time: finite, so masked products
# stay 0 instead of turning NaN, and older than any trend window can reach.
_EMPTY_T = -1e30

# Cells per pass. Each pass works in preallocated (cells, W) scratch arrays:
# fresh ~1 MB temporaries per numpy call were trimmed back to the OS by glibc
# and page-faulted in again on every call, which tripled the time per row
# (measured: 9.0 ms vs 3.0 ms per 1,000-row batch). The cap bounds the
# scratch at about 5 x 8192 x W x 8 bytes (10 MB for W = 30).
_CHUNK_CELLS = 8192


class _Scratch:
    """Reusable (cells, W) work arrays for one ``SignalBank``."""

    def __init__(self, cells: int, window: int) -> None:
        self.win = np.empty((cells, window))
        self.ts = np.empty((cells, window))
        self.a = np.empty((cells, window))
        self.b = np.empty((cells, window))
        self.c = np.empty((cells, window))
        self.mask = np.empty((cells, window), dtype=np.bool_)


class SignalBank:
    """Rolling windows, fences, EWMA, forecast and trend for GPU rows.

    ``capacity_rows`` rows (GPUs) by ``signals`` columns (the view's signal
    columns, in its order). Rows are indices the view assigns; ``grow`` adds
    rows, ``reset_rows`` empties rows whose GPU went away or re-registered.

    State is stored per *cell*, one (row, signal) pair, at flat index
    ``row * signals + signal``: per-cell scalars in ``(capacity * signals,)``
    arrays, rings in ``(capacity * signals, window)`` arrays, so a batch of
    cells is one ``take`` away. Accessors reshape to ``(capacity, signals)``.
    """

    def __init__(
        self,
        capacity_rows: int,
        signals: int,
        window: int = 30,
        alpha: float = 0.3,
        iqr_k: float = 1.5,
        z_max: float = 3.0,
        persist: int = 3,
        min_window: int = 5,
        min_spread: float | npt.ArrayLike = 1.0,
        trend_window_s: float = 60.0,
        forecast_horizon_s: float = 0.0,
    ) -> None:
        if capacity_rows < 0 or signals < 1:
            raise ValueError("capacity_rows must be >= 0 and signals >= 1")
        if window < 4:
            # quartiles of fewer than 4 readings are not a spread estimate
            raise ValueError("window must be >= 4")
        if not 0.0 < alpha <= 1.0:
            raise ValueError("alpha must be in (0, 1]")
        if iqr_k <= 0 or z_max <= 0:
            raise ValueError("iqr_k and z_max must be > 0")
        if not 2 <= persist <= window:
            # persist 1 would accept every spike at once
            raise ValueError("persist must be in [2, window]")
        if not 4 <= min_window <= window:
            raise ValueError("min_window must be in [4, window]")
        spread = np.broadcast_to(np.asarray(min_spread, dtype=np.float64), (signals,))
        if not np.all(np.isfinite(spread)) or np.any(spread < 0):
            raise ValueError("min_spread must be finite and >= 0")
        if trend_window_s <= 0 or forecast_horizon_s < 0:
            raise ValueError("trend_window_s must be > 0 and forecast_horizon_s >= 0")

        self.signals = signals
        self.window = window
        self.alpha = float(alpha)
        self.iqr_k = float(iqr_k)
        self.z_max = float(z_max)
        self.persist = persist
        self.min_window = min_window
        self.min_spread = _readonly(spread.copy())
        self.trend_window_s = float(trend_window_s)
        self.forecast_horizon_s = float(forecast_horizon_s)

        self._slot = np.arange(window)
        self._ones = np.ones(window)
        self._sig = np.arange(signals)
        # quartile positions of a full window: h = (W - 1) * q
        h1, h3 = (window - 1) * 0.25, (window - 1) * 0.75
        self._q1i, self._q1f = int(h1), h1 - int(h1)
        self._q3i, self._q3f = int(h3), h3 - int(h3)
        self._anomaly_counts = np.zeros(signals, dtype=np.int64)
        self._shift_counts = np.zeros(signals, dtype=np.int64)
        self._expected_shift_counts = np.zeros(signals, dtype=np.int64)
        # readings after an expected shift whose level is their median
        self._settle_len = min(persist, min_window)
        self._pslot = np.arange(persist)
        # latest until_s of any expect_drop and cells settling: update()
        # skips both tests while no expectation can apply
        self._expect_latest = -np.inf
        self._settling_cells = 0
        self._capacity = 0
        self._alloc(capacity_rows)
        self._scratch = _Scratch(0, window)

    # ----------------------------------------------------------- storage
    def _alloc(self, capacity: int) -> None:
        old_cells = self._capacity * self.signals
        cells = capacity * self.signals
        w, p = self.window, self.persist

        def grown(name: str, shape: tuple[int, ...], fill: float, dtype: type) -> None:
            a = np.full(shape, fill, dtype=dtype)
            if old_cells:
                old = getattr(self, name)
                a[: old.shape[0]] = old
            setattr(self, name, a)

        nan = np.nan
        # ring of readings and their times (an anomaly's time is _EMPTY_T, so
        # the trend skips it); empty slots always sit
        # at indices >= count (a ring fills from slot 0 after a reset or a
        # re-seed), so `slot < count` is the valid mask
        grown("_win", (cells, w), 0.0, np.float64)
        grown("_ts", (cells, w), _EMPTY_T, np.float64)
        grown("_pos", (cells,), 0, np.intp)
        grown("_count", (cells,), 0, np.intp)
        # the current out-of-fence run: its length, side (+1 / -1), readings
        grown("_run_len", (cells,), 0, np.intp)
        grown("_run_side", (cells,), 0, np.int8)
        grown("_run_vals", (cells, p), nan, np.float64)
        grown("_run_ts", (cells, p), nan, np.float64)
        grown("_raw", (cells,), nan, np.float64)
        grown("_smoothed", (cells,), nan, np.float64)
        grown("_forecast", (cells,), nan, np.float64)
        grown("_trend", (cells,), nan, np.float64)
        grown("_flagged", (cells,), False, np.bool_)
        grown("_last_reading_s", (cells,), nan, np.float64)
        # expect_drop: a drop is accepted at once until this reading time
        grown("_expect_until", (cells,), nan, np.float64)
        # after an expected shift, until the window holds _settle_len readings
        grown("_settling", (cells,), False, np.bool_)
        # per row
        grown("_last_update_s", (capacity,), nan, np.float64)
        # scratch for the O(B) duplicate-row check in update()
        grown("_mark", (capacity,), -1, np.intp)
        self._capacity = capacity

    @property
    def capacity(self) -> int:
        """Rows the bank holds."""
        return self._capacity

    def grow(self, capacity: int) -> None:
        """Make room for ``capacity`` rows; existing rows keep their state."""
        if capacity < self._capacity:
            raise ValueError(f"capacity {capacity} < current {self._capacity}: rows never shrink")
        if capacity > self._capacity:
            self._alloc(capacity)

    def reset_rows(self, rows: npt.ArrayLike) -> None:
        """Forget everything about ``rows`` (GPU removed, node re-registered).

        The per-signal counters are totals since start and keep their values.
        """
        r = self._check_rows(rows)
        c = (r[:, None] * self.signals + self._sig).ravel()
        self._win[c] = 0.0
        self._ts[c] = _EMPTY_T
        for name in ("_run_vals", "_run_ts", "_raw", "_smoothed", "_forecast",
                     "_trend", "_last_reading_s", "_expect_until"):
            getattr(self, name)[c] = np.nan
        for name in ("_pos", "_count", "_run_len", "_run_side"):
            getattr(self, name)[c] = 0
        self._flagged[c] = False
        self._settling_cells -= int(np.count_nonzero(self._settling[np.unique(c)]))
        self._settling[c] = False
        self._last_update_s[r] = np.nan

    # ----------------------------------------------------------- accessors
    def _column(self, a: np.ndarray) -> np.ndarray:
        return _readonly(a.reshape(self._capacity, self.signals))

    @property
    def raw(self) -> np.ndarray:
        """Last reading per (row, signal), anomalies included; NaN if none."""
        return self._column(self._raw)

    @property
    def smoothed(self) -> np.ndarray:
        """EWMA of accepted readings per (row, signal); NaN if none."""
        return self._column(self._smoothed)

    @property
    def forecast(self) -> np.ndarray:
        """One-step forecast per (row, signal); see the module docstring."""
        return self._column(self._forecast)

    @property
    def trend_per_min(self) -> np.ndarray:
        """Least-squares slope per minute over the trend window; NaN if unknown."""
        return self._column(self._trend)

    @property
    def flagged(self) -> np.ndarray:
        """True while the last reading of (row, signal) was an anomaly."""
        return self._column(self._flagged)

    @property
    def last_reading_s(self) -> np.ndarray:
        """Per (row, signal): time of the last reading, anomaly or not."""
        return self._column(self._last_reading_s)

    @property
    def window_counts(self) -> np.ndarray:
        """Readings currently in each (row, signal) window."""
        return self._column(self._count)

    @property
    def last_update_s(self) -> np.ndarray:
        """Per row: time of the last update that carried any reading."""
        return _readonly(self._last_update_s)

    @property
    def anomaly_counts(self) -> np.ndarray:
        """Rejected readings per signal since start."""
        return _readonly(self._anomaly_counts)

    @property
    def shift_counts(self) -> np.ndarray:
        """Level shifts accepted per signal since start (after ``persist``
        readings; expected drops are in ``expected_shift_counts``)."""
        return _readonly(self._shift_counts)

    @property
    def expected_shift_counts(self) -> np.ndarray:
        """Drops accepted at once per signal since start (``expect_drop``)."""
        return _readonly(self._expected_shift_counts)

    @property
    def expecting_drop_until(self) -> np.ndarray:
        """Per (row, signal): the reading time until which a drop is accepted
        at once (``expect_drop``); NaN when none is expected."""
        return self._column(self._expect_until)

    # ----------------------------------------------------------- expectations
    def expect_drop(
        self,
        rows: npt.ArrayLike,
        until_s: float,
        signals: npt.ArrayLike | None = None,
    ) -> int:
        """The caller (the coordinator, ending a lease) knows the readings of
        ``rows`` are about to fall: until ``until_s`` (reading time) the first
        reading of each listed signal (default: all) below the fence is a
        level shift at once, not an anomaly (module docstring, "Expected
        drop"). A drop already flagged (a run below the fence, readings
        that came before the call) becomes the level now. Returns how many
        cells that changed at once (their smoothed values moved)."""
        r = self._check_rows(rows)
        sig = self._sig if signals is None else np.asarray(signals, dtype=np.intp).ravel()
        if sig.size and (sig.min() < 0 or sig.max() >= self.signals):
            raise IndexError(f"signal out of range [0, {self.signals})")
        if not np.isfinite(until_s):
            raise ValueError("until_s must be finite")
        c = np.unique((r[:, None] * self.signals + sig).ravel())
        if c.size == 0:
            return 0
        self._expect_until[c] = np.fmax(self._expect_until[c], float(until_s))
        self._expect_latest = max(self._expect_latest, float(until_s))
        j = c[(self._run_side[c] < 0) & (self._run_len[c] > 0)]
        if j.size:
            self._promote(j)
        return int(j.size)

    def _promote(self, c: np.ndarray) -> None:
        """Accept the current below-fence run of cells ``c`` as their level
        now (an expected drop whose first readings came before the call)."""
        w, p = self.window, self.persist
        k = self._run_len[c]
        valid = self._pslot < k[:, None]
        vals, ts = self._run_vals[c], self._run_ts[c]
        win = np.zeros((c.size, w))
        tsw = np.full((c.size, w), _EMPTY_T)
        win[:, :p] = np.where(valid, vals, 0.0)
        tsw[:, :p] = np.where(valid, ts, _EMPTY_T)
        level = _median_first(vals, k)
        trend = self._trend_of(win, tsw, self._last_reading_s[c], _Scratch(c.size, w))
        self._win[c] = win
        self._ts[c] = tsw
        self._count[c] = k
        self._pos[c] = k % w
        self._run_len[c] = 0
        self._run_side[c] = 0
        self._smoothed[c] = level
        self._trend[c] = trend
        self._forecast[c] = self._forecast_of(level, trend)
        self._flagged[c] = False
        self._expect_until[c] = np.nan  # one expected shift per release
        settle = k < self._settle_len
        self._settling_cells += int(np.count_nonzero(settle)) - int(np.count_nonzero(self._settling[c]))
        self._settling[c] = settle
        self._expected_shift_counts += np.bincount(c % self.signals, minlength=self.signals)

    def _forecast_of(self, level: np.ndarray, trend: np.ndarray) -> np.ndarray:
        if self.forecast_horizon_s > 0:
            return level + np.where(np.isnan(trend), 0.0, trend) * (self.forecast_horizon_s / 60.0)
        return level

    # ----------------------------------------------------------- update
    def _check_rows(self, rows: npt.ArrayLike) -> np.ndarray:
        r = np.asarray(rows)
        if r.ndim != 1 or (r.size and not np.issubdtype(r.dtype, np.integer)):
            raise ValueError("rows must be a 1-D integer array")
        r = r.astype(np.intp, copy=False)
        if r.size and (r.min() < 0 or r.max() >= self._capacity):
            raise IndexError(f"row out of range [0, {self._capacity})")
        return r

    def update(
        self,
        rows: npt.ArrayLike,
        values: npt.ArrayLike,
        now_s: float | npt.ArrayLike,
    ) -> None:
        """Apply one reading per listed row (NaN: no reading for that signal).

        ``values`` is ``(len(rows), signals)``; ``now_s`` is the readings'
        time, one float for the batch or one per row. A row listed more than
        once is applied in the order given, one occurrence per pass.
        """
        r = self._check_rows(rows)
        v = np.asarray(values, dtype=np.float64)
        if v.shape != (r.size, self.signals):
            raise ValueError(f"values must be {(r.size, self.signals)}, got {v.shape}")
        if np.isinf(v).any():
            raise ValueError("values must be finite or NaN (no reading)")
        t = np.broadcast_to(np.asarray(now_s, dtype=np.float64), (r.size,))
        if not np.isfinite(t).all():
            raise ValueError("now_s must be finite")
        if r.size == 0:
            return
        idx = np.arange(r.size)
        self._mark[r] = idx
        if (self._mark[r] == idx).all():
            self._apply_chunked(r, v, t)
            return
        # duplicates: the k-th occurrence of each row goes in pass k, which
        # keeps every row's readings in order and each pass's rows unique
        order = np.argsort(r, kind="stable")
        sr = r[order]
        first = np.r_[True, sr[1:] != sr[:-1]]
        start = np.maximum.accumulate(np.where(first, idx, 0))
        occ = np.empty(r.size, dtype=np.intp)
        occ[order] = idx - start
        for k in range(int(occ.max()) + 1):
            sel = occ == k
            self._apply_chunked(r[sel], v[sel], t[sel])

    def _apply_chunked(self, rows: np.ndarray, x: np.ndarray, t: np.ndarray) -> None:
        step = max(1, _CHUNK_CELLS // self.signals)
        for i in range(0, rows.size, step):
            self._apply(rows[i : i + step], x[i : i + step], t[i : i + step])

    def _apply(self, rows: np.ndarray, x: np.ndarray, t: np.ndarray) -> None:
        """One pass over unique ``rows``.

        Works on the cells that carry a reading, so a delta batch that moved
        one signal of a GPU costs one cell, not ``signals``.
        """
        has = ~np.isnan(x)
        bi, si = np.nonzero(has)
        if bi.size == 0:
            return
        w, p = self.window, self.persist
        c = rows[bi] * self.signals + si
        xv = x[bi, si]
        tv = t[bi]
        k = c.size
        ws = self._scratch
        if ws.win.shape[0] < k:
            # doubling, but never past one chunk: k <= _CHUNK_CELLS
            ws = self._scratch = _Scratch(min(max(k, 2 * ws.win.shape[0]), max(k, _CHUNK_CELLS)), w)
        # (K, W) copies in scratch, written back at the end; 'clip' because
        # 'raise' would buffer the output, and c is in range by construction
        win = self._win.take(c, axis=0, out=ws.win[:k], mode="clip")
        tsw = self._ts.take(c, axis=0, out=ws.ts[:k], mode="clip")
        n = self._count[c]

        # --- fences from the window as it was before this reading
        q1, q3, mu, sigma = self._fence_stats(win, n, ws)
        f = self.min_spread[si]
        iqr_half = np.maximum(self.iqr_k * (q3 - q1), f)
        z_half = np.maximum(self.z_max * sigma, f)
        lo = np.maximum(q1 - iqr_half, mu - z_half)
        hi = np.minimum(q3 + iqr_half, mu + z_half)
        fenced = n >= self.min_window
        side = (fenced & (xv > hi)).astype(np.int8) - (fenced & (xv < lo)).astype(np.int8)
        out = side != 0

        # --- runs of out-of-fence readings on one side
        grown_run = np.where(self._run_side[c] == side, self._run_len[c] + 1, 1)
        new_len = np.where(out, grown_run, 0)
        j = np.flatnonzero(out)
        if j.size:
            self._run_vals[c[j], new_len[j] - 1] = xv[j]
            self._run_ts[c[j], new_len[j] - 1] = tv[j]
        shift = out & (new_len >= p)
        # a drop the coordinator caused (expect_drop) does not wait for persist
        expected = None
        if j.size and tv.min() <= self._expect_latest:
            expected = (side < 0) & (tv <= self._expect_until[c])  # NaN: none expected
            shift |= expected
        anomaly = out & ~shift
        accept = ~out

        # --- every reading goes into the ring, anomalies included: the
        # quartiles shrug off a few spikes, while leaving them out would cut
        # the window's tails and narrow the fence reading by reading (on
        # Gaussian noise: 3.7 % rejected instead of 2.5 %, 8x the spurious
        # shifts). An anomaly's slot gets the empty time, so the trend skips it.
        pos = self._pos[c]
        idx = np.arange(c.size)
        win[idx, pos] = xv
        tsw[idx, pos] = np.where(accept, tv, _EMPTY_T)
        pos = (pos + 1) % w
        n = np.minimum(n + 1, w)
        # --- a shift re-seeds the window with its run (persist readings, or
        # fewer for an expected drop) and snaps to the run's median
        j = np.flatnonzero(shift)
        snap = xv.copy()
        if j.size:
            k_run = new_len[j]
            vals, ts = self._run_vals[c[j]], self._run_ts[c[j]]
            valid = self._pslot < k_run[:, None]
            snap[j] = _median_first(vals, k_run)
            win[j] = 0.0
            tsw[j] = _EMPTY_T
            win[j, :p] = np.where(valid, vals, 0.0)
            tsw[j, :p] = np.where(valid, ts, _EMPTY_T)
            pos[j] = k_run % w
            n[j] = k_run
            new_len[j] = 0
            if expected is None:
                self._shift_counts += np.bincount(si[j], minlength=self.signals)
            else:
                e = expected[j]
                self._shift_counts += np.bincount(si[j[~e]], minlength=self.signals)
                self._expected_shift_counts += np.bincount(si[j[e]], minlength=self.signals)
                ce = c[j[e]]
                self._expect_until[ce] = np.nan  # one expected shift per release
                settle = k_run[e] < self._settle_len
                self._settling_cells += int(np.count_nonzero(settle))
                self._settling[ce] = settle
        if j.size < out.sum():
            self._anomaly_counts += np.bincount(si[anomaly], minlength=self.signals)

        # --- EWMA: accepted readings move it, a shift snaps it
        sm = self._smoothed[c]
        ewma = np.where(np.isnan(sm), xv, self.alpha * xv + (1.0 - self.alpha) * sm)
        sm = np.where(accept, ewma, np.where(shift, snap, sm))
        if self._settling_cells:
            # after an expected shift: the median of the readings since it
            # (no fence applies yet, so every one of them was accepted)
            s = np.flatnonzero(self._settling[c] & accept)
            if s.size:
                sm[s] = _median_first(win[s, : self._settle_len], n[s])
                done = c[s[n[s] >= self._settle_len]]
                self._settling[done] = False
                self._settling_cells -= done.size

        trend = self._trend_of(win, tsw, tv, ws)
        fc = self._forecast_of(sm, trend)

        # --- write back
        self._win[c] = win
        self._ts[c] = tsw
        self._count[c] = n
        self._pos[c] = pos
        self._run_len[c] = new_len
        self._run_side[c] = np.where(shift, 0, side)
        self._smoothed[c] = sm
        self._forecast[c] = fc
        self._trend[c] = trend
        self._raw[c] = xv
        self._flagged[c] = anomaly
        self._last_reading_s[c] = tv
        any_has = has.any(axis=1)
        self._last_update_s[rows[any_has]] = t[any_has]

    def _fence_stats(
        self, win: np.ndarray, n: np.ndarray, ws: _Scratch
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Q1, Q3, mean and population std of each (K, W) window.

        Full windows (the steady state) take a mask-free path with fixed
        quartile positions; partial ones (the first readings after a start,
        reset or shift) pad their empty slots for the sort.
        """
        # the full-window path runs on every cell (it allocates nothing big);
        # the few partial cells are then recomputed and overwritten
        out = self._stats_full(win, ws)
        j = np.flatnonzero(n != self.window)
        if j.size:
            for o, v in zip(out, self._stats_partial(win[j], n[j])):
                o[j] = v
        return out[0], out[1], out[2], out[3]

    def _stats_full(self, win: np.ndarray, ws: _Scratch) -> tuple[np.ndarray, ...]:
        k = win.shape[0]
        s = ws.a[:k]
        np.copyto(s, win)
        s.sort(axis=-1)
        a, b = s[:, self._q1i], s[:, min(self._q1i + 1, self.window - 1)]
        q1 = a + self._q1f * (b - a)
        a, b = s[:, self._q3i], s[:, min(self._q3i + 1, self.window - 1)]
        q3 = a + self._q3f * (b - a)
        mu = (win @ self._ones) / self.window
        # two-pass variance: E[x^2] - mu^2 cancels badly on byte-sized values
        dev = np.subtract(win, mu[:, None], out=ws.b[:k])
        return q1, q3, mu, np.sqrt(np.einsum("kw,kw->k", dev, dev) / self.window)

    def _stats_partial(self, win: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, ...]:
        valid = self._slot < n[:, None]
        q1, q3 = quartiles(np.sort(np.where(valid, win, np.inf), axis=-1), n)
        nz = np.maximum(n, 1)
        mu = (win @ self._ones) / nz  # empty slots hold 0
        dev = (win - mu[:, None]) * valid
        return q1, q3, mu, np.sqrt(np.einsum("kw,kw->k", dev, dev) / nz)

    def _trend_of(
        self, win: np.ndarray, tsw: np.ndarray, tv: np.ndarray, ws: _Scratch
    ) -> np.ndarray:
        """Least-squares slope per minute of each window's recent readings.

        With weights ``m`` (1 for a reading inside the trend window, else 0)
        and ``d = t - now`` (bounded by the window, so these raw moments lose
        no precision to large epoch times)::

            k = sum(m),  sxx = sum(m d^2) - sum(m d)^2 / k
            sxy = sum(m d v) - sum(m d) * sum(m v) / k
        """
        n = win.shape[0]
        d = np.subtract(tsw, tv[:, None], out=ws.a[:n])
        mb = np.greater_equal(d, -self.trend_window_s, out=ws.mask[:n])  # empty: -1e30
        m = ws.b[:n]
        np.copyto(m, mb)
        md = np.multiply(d, m, out=d)
        mv = np.multiply(win, m, out=ws.c[:n])
        ones = self._ones
        k = m @ ones
        sd = md @ ones
        sv = mv @ ones
        sdd = np.einsum("kw,kw->k", md, md)
        sdv = np.einsum("kw,kw->k", md, mv)
        kz = np.maximum(k, 1.0)
        sxx = sdd - sd * sd / kz
        sxy = sdv - sd * sv / kz
        # sxx is 0 when all readings share one instant; a rounding residue
        # of the subtraction above is not a time spread either
        ok = (k >= 2) & (sxx > 1e-9 * np.maximum(sdd, 1.0))
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(ok, 60.0 * sxy / sxx, np.nan)
