"""Tests for ``coordinator.signals``: the fences, runs, EWMA and trend on
literals, and the whole filter replayed over real GPU telemetry from the
Alibaba GenAI trace (``alibaba-genai`` under ``agent.replay.default_trace_dir()``:
``$GPULB_TRACES``, else ``../shared/traces``; read at run time).
"""

from __future__ import annotations

import csv
import io
import math
import tarfile

import numpy as np
import pytest

from agent.replay import default_trace_dir
from coordinator.signals import MIN_SPREAD, SignalBank, min_spread_for, quartiles
from protos.fields import FIELDS

TRACES = default_trace_dir() / "alibaba-genai"
MIB = 2**20


# --------------------------------------------------------------------- helpers
def feed(bank: SignalBank, row: int, values, t0: float = 0.0, dt: float = 1.0) -> float:
    """Feed one row a series of readings of signal 0, one per ``dt``; returns the next time."""
    t = t0
    for v in values:
        x = np.full((1, bank.signals), np.nan)
        x[0, 0] = v
        bank.update([row], x, t)
        t += dt
    return t


# --------------------------------------------------------------------- literals
def test_quartiles_match_numpy_percentile_on_partial_windows() -> None:
    rng = np.random.default_rng(1)
    w = rng.normal(size=(50, 12))
    n = rng.integers(1, 13, size=50)
    padded = np.where(np.arange(12) < n[:, None], w, np.inf)
    q1, q3 = quartiles(np.sort(padded, axis=-1), n)
    for i in range(50):
        e1, e3 = np.percentile(w[i, : n[i]], [25, 75])
        assert q1[i] == pytest.approx(e1) and q3[i] == pytest.approx(e3)
    q1, q3 = quartiles(np.sort(padded[:1], axis=-1), np.array([0]))
    assert np.isnan(q1[0]) and np.isnan(q3[0])


def test_first_reading_sets_level_and_no_fence_before_min_window() -> None:
    bank = SignalBank(2, 1, min_window=5, min_spread=1.0)
    feed(bank, 0, [10.0, 10.0, 10.0, 500.0])  # 4 readings < min_window: all accepted
    assert bank.anomaly_counts[0] == 0
    assert bank.smoothed[0, 0] == pytest.approx(0.3 * 500 + 0.7 * 10)
    assert np.isnan(bank.smoothed[1, 0])  # untouched row stays unknown


def test_single_spike_is_counted_flagged_kept_raw_and_not_smoothed() -> None:
    bank = SignalBank(1, 2, min_spread=[1.0, 1.0])
    for i in range(30):
        bank.update([0], [[50.0 + (i % 3), 7.0]], float(i))
    level = bank.smoothed[0, 0]
    bank.update([0], [[95.0, np.nan]], 30.0)
    assert bank.raw[0, 0] == 95.0
    assert bank.smoothed[0, 0] == level
    assert bank.flagged[0].tolist() == [True, False]
    assert bank.anomaly_counts.tolist() == [1, 0]
    # a normal reading clears the flag and moves the level again
    bank.update([0], [[51.0, np.nan]], 31.0)
    assert not bank.flagged[0, 0]
    assert bank.smoothed[0, 0] == pytest.approx(0.3 * 51 + 0.7 * level)
    assert bank.anomaly_counts.tolist() == [1, 0]


def test_persisting_shift_is_accepted_after_persist_readings() -> None:
    bank = SignalBank(1, 1, persist=3, min_spread=1.0)
    t = feed(bank, 0, [20.0, 21.0, 22.0] * 10)
    t = feed(bank, 0, [80.0, 81.0], t)
    assert bank.flagged[0, 0] and bank.smoothed[0, 0] < 25
    feed(bank, 0, [82.0], t)
    assert bank.smoothed[0, 0] == 81.0  # snapped to the run's median
    assert not bank.flagged[0, 0]
    assert bank.anomaly_counts[0] == 2 and bank.shift_counts[0] == 1
    assert bank.window_counts[0, 0] == 3  # re-seeded with the run


def test_alternating_sides_never_make_a_shift() -> None:
    bank = SignalBank(1, 1, persist=3, min_spread=1.0)
    t = feed(bank, 0, [50.0, 51.0] * 15)
    feed(bank, 0, [90.0, 10.0, 90.0, 10.0, 90.0, 10.0], t)
    assert bank.shift_counts[0] == 0
    assert bank.anomaly_counts[0] == 6
    assert bank.smoothed[0, 0] == pytest.approx(50.5, abs=0.5)


def test_flat_window_accepts_a_wiggle_within_min_spread() -> None:
    # IQR and std are both 0: without the floor, 31 °C after thirty 30s
    # would be an anomaly, and so would every later reading that is not 30
    bank = SignalBank(1, 1, min_spread=1.0)
    t = feed(bank, 0, [30.0] * 30)
    feed(bank, 0, [31.0, 30.0, 31.0], t)
    assert bank.anomaly_counts[0] == 0
    t = feed(bank, 0, [35.0], t + 3)
    assert bank.anomaly_counts[0] == 1


def test_nan_means_no_reading_and_leaves_the_cell_alone() -> None:
    bank = SignalBank(1, 2, min_spread=1.0)
    bank.update([0], [[10.0, 20.0]], 0.0)
    bank.update([0], [[np.nan, 25.0]], 5.0)
    assert bank.raw[0].tolist() == [10.0, 25.0]
    assert bank.last_reading_s[0].tolist() == [0.0, 5.0]
    assert bank.window_counts[0].tolist() == [1, 2]
    assert bank.last_update_s[0] == 5.0
    bank.update([0], [[np.nan, np.nan]], 9.0)
    assert bank.last_update_s[0] == 5.0


def test_trend_is_least_squares_slope_per_minute_over_last_60_s() -> None:
    bank = SignalBank(1, 1, window=30, min_spread=1.0)
    # 1 unit per 2 s = 30 per minute, then readings older than 60 s drop out
    feed(bank, 0, [float(i) for i in range(30)], t0=0.0, dt=2.0)
    assert bank.trend_per_min[0, 0] == pytest.approx(30.0)
    # noisy line: compare with numpy's least squares over the last 60 s only
    bank = SignalBank(1, 1, window=30, min_spread=100.0)
    rng = np.random.default_rng(3)
    ts = np.cumsum(rng.uniform(3.0, 6.0, size=25))
    vs = 2.0 * ts + rng.normal(0, 5, size=25)
    for t, v in zip(ts, vs):
        bank.update([0], [[v]], t)
    recent = ts >= ts[-1] - 60.0
    expected = np.polyfit(ts[recent], vs[recent], 1)[0] * 60.0
    assert bank.trend_per_min[0, 0] == pytest.approx(expected, rel=1e-9)


def test_trend_skips_anomalies() -> None:
    bank = SignalBank(1, 1, min_spread=1.0)
    t = feed(bank, 0, [10.0 + 0.1 * i for i in range(20)], dt=1.0)
    before = bank.trend_per_min[0, 0]
    feed(bank, 0, [500.0], t)
    assert bank.flagged[0, 0]
    # one reading later than before, same line: the slope is unchanged
    assert bank.trend_per_min[0, 0] == pytest.approx(before)


def test_false_positives_on_gaussian_noise_are_rare_and_never_shift_far() -> None:
    rng = np.random.default_rng(11)
    rows, steps = 100, 1000
    bank = SignalBank(rows, 1, min_spread=0.01)
    x = rng.normal(50.0, 2.0, size=(steps, rows, 1))
    for i in range(steps):
        bank.update(np.arange(rows), x[i], float(i))
    rate = bank.anomaly_counts[0] / (rows * steps)
    shifts = bank.shift_counts[0] / (rows * steps)
    # Tukey's 1.5 IQR fence alone rejects 0.7 % of a normal law; quartiles
    # and sigma from 30 readings are noisy estimates, so more: 2.5 % measured
    assert rate < 0.035, f"false-positive rate on N(50, 2): {rate:.4f}"
    assert shifts < 0.0005, f"spurious shifts per reading: {shifts:.5f}"
    dev = np.abs(bank.smoothed[:, 0] - 50.0)
    # EWMA noise is 2 * sqrt(alpha / (2 - alpha)) = 0.84; a rare spurious
    # shift snaps to the median of three same-side readings, within 4 sigma
    assert dev.mean() < 1.0 and dev.max() < 8.0, dev


def test_trend_unknown_with_one_reading_in_the_trend_window() -> None:
    bank = SignalBank(1, 1, min_spread=1.0)
    feed(bank, 0, [1.0, 2.0], t0=0.0, dt=100.0)
    assert np.isnan(bank.trend_per_min[0, 0])


def test_trend_keeps_full_precision_at_epoch_times() -> None:
    bank = SignalBank(1, 1, min_spread=1.0)
    feed(bank, 0, [100.0 + 0.5 * i for i in range(20)], t0=1.7e9, dt=0.2)
    assert bank.trend_per_min[0, 0] == pytest.approx(150.0, rel=1e-6)


def test_forecast_is_level_or_level_plus_trend_with_a_horizon() -> None:
    flat = SignalBank(1, 1, min_spread=1.0)
    ahead = SignalBank(1, 1, min_spread=1.0, forecast_horizon_s=30.0)
    for b in (flat, ahead):
        feed(b, 0, [float(i) for i in range(10)], dt=1.0)
    assert flat.forecast[0, 0] == flat.smoothed[0, 0]
    assert ahead.forecast[0, 0] == pytest.approx(ahead.smoothed[0, 0] + 60.0 * 0.5)


def test_batch_equals_row_by_row() -> None:
    rng = np.random.default_rng(7)
    rows, sig, steps = 40, 3, 60
    vals = rng.normal(50, 3, size=(steps, rows, sig))
    vals[rng.random(vals.shape) < 0.05] += 40  # spikes
    vals[rng.random(vals.shape) < 0.2] = np.nan  # missing readings
    vals[30:, :10, 0] += 25  # a real shift
    batched = SignalBank(rows, sig, min_spread=1.0)
    single = SignalBank(rows, sig, min_spread=1.0)
    for i in range(steps):
        batched.update(np.arange(rows)[::-1], vals[i][::-1], float(i))
        for r in range(rows):
            single.update([r], vals[i, r : r + 1], float(i))
    for name in ("raw", "flagged", "window_counts"):
        np.testing.assert_array_equal(getattr(batched, name), getattr(single, name), err_msg=name)
    # BLAS sums in a different order for a different batch size
    for name in ("smoothed", "forecast", "trend_per_min"):
        np.testing.assert_allclose(getattr(batched, name), getattr(single, name), rtol=1e-9, err_msg=name)
    np.testing.assert_array_equal(batched.anomaly_counts, single.anomaly_counts)
    assert batched.shift_counts[0] >= 10  # the shift was followed on every shifted row


def test_repeated_row_in_one_batch_is_applied_in_order() -> None:
    a = SignalBank(2, 1, min_spread=1.0)
    b = SignalBank(2, 1, min_spread=1.0)
    a.update([0, 1, 0, 0], [[1.0], [5.0], [2.0], [3.0]], [0.0, 0.0, 1.0, 2.0])
    for r, v, t in ((0, 1.0, 0.0), (1, 5.0, 0.0), (0, 2.0, 1.0), (0, 3.0, 2.0)):
        b.update([r], [[v]], t)
    np.testing.assert_array_equal(a.smoothed, b.smoothed)
    assert a.raw[0, 0] == 3.0 and a.window_counts[0, 0] == 3


def test_reset_rows_forgets_state_but_keeps_totals() -> None:
    bank = SignalBank(3, 1, min_spread=1.0)
    for r in (0, 1):
        t = feed(bank, r, [10.0] * 30)
        feed(bank, r, [99.0], t)
    assert bank.anomaly_counts[0] == 2
    bank.reset_rows([1])
    assert np.isnan(bank.smoothed[1, 0]) and np.isnan(bank.raw[1, 0])
    assert not bank.flagged[1, 0] and bank.window_counts[1, 0] == 0
    assert np.isnan(bank.last_update_s[1])
    assert bank.smoothed[0, 0] == 10.0 and bank.flagged[0, 0]
    assert bank.anomaly_counts[0] == 2
    feed(bank, 1, [99.0])  # a fresh row accepts its first reading
    assert bank.smoothed[1, 0] == 99.0


def test_grow_keeps_rows_and_adds_empty_ones() -> None:
    bank = SignalBank(2, 2, min_spread=1.0)
    bank.update([0, 1], [[1.0, 2.0], [3.0, 4.0]], 0.0)
    bank.grow(5)
    assert bank.capacity == 5 and bank.smoothed.shape == (5, 2)
    assert bank.smoothed[:2].tolist() == [[1.0, 2.0], [3.0, 4.0]]
    assert np.isnan(bank.smoothed[2:]).all()
    bank.update([4], [[7.0, 8.0]], 1.0)
    assert bank.raw[4].tolist() == [7.0, 8.0]
    with pytest.raises(ValueError):
        bank.grow(3)


def test_accessors_are_read_only() -> None:
    bank = SignalBank(1, 1)
    for name in ("raw", "smoothed", "forecast", "trend_per_min", "flagged",
                 "anomaly_counts", "shift_counts", "last_update_s", "last_reading_s"):
        with pytest.raises(ValueError):
            getattr(bank, name)[0] = 1


@pytest.mark.parametrize(
    "rows, values, now, error",
    [
        ([0], [[1.0, 2.0]], 0.0, ValueError),  # wrong width
        ([5], [[1.0]], 0.0, IndexError),  # row out of range
        ([-1], [[1.0]], 0.0, IndexError),
        ([0.5], [[1.0]], 0.0, ValueError),  # not an integer row
        ([0], [[math.inf]], 0.0, ValueError),
        ([0], [[1.0]], math.nan, ValueError),
    ],
)
def test_bad_input_is_rejected(rows, values, now, error) -> None:
    bank = SignalBank(2, 1)
    with pytest.raises(error):
        bank.update(rows, values, now)


@pytest.mark.parametrize(
    "kwargs",
    [dict(window=3), dict(alpha=0.0), dict(persist=1), dict(persist=31),
     dict(min_window=3), dict(min_spread=-1.0), dict(min_spread=[1.0, 2.0, 3.0])],
)
def test_bad_configuration_is_rejected(kwargs) -> None:
    with pytest.raises(ValueError):
        SignalBank(1, 2, **kwargs)


def test_min_spread_for_uses_table_then_deadband() -> None:
    out = min_spread_for(["util_gpu_pct", "memory_used_mib", "temperature_c", "power_w", "process_count"])
    assert out.tolist() == [2.0, 64.0, 1.0, 5.0, 1.0]
    # the table follows the wire field names, so a rename cannot orphan a floor
    assert set(MIN_SPREAD) <= {spec.name for spec in FIELDS}
    with pytest.raises(KeyError):
        min_spread_for(["no_such_field"])


# --------------------------------------------------------------- real traces
# Stable Diffusion serving pods, one reading a minute (see traces/README.md).
# The bank is built for the agent's 0.2-2 s readings; a minute apart, the
# trace's own readings are far noisier from one to the next, so these are
# the hard case for telling a spike from the series' own moves.
MEMORY_TAR = "pod_gpu_memory_used_bytes_anon.tar.gz"
DUTY_TAR = "pod_gpu_duty_cycle_anon.tar.gz"
PODS = 40  # the first 40 pod ids in sorted order: ~57k readings per signal
SPIKE_EVERY, SPIKE_FIRST, SPIKE_LOOK = 40, 20, 10


def load_pods(archive: str, pods: int = PODS, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Times and values of the first ``pods`` pods (sorted ids) of a trace CSV.

    Returns ``(times, values)``, each ``(pods, longest series)``, in time
    order, NaN-padded after a shorter pod's last reading.
    """
    path = TRACES / archive
    if not path.exists():
        pytest.skip(f"trace {path} not available")
    with tarfile.open(path) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith(".csv"))
        text = tar.extractfile(member).read().decode()  # type: ignore[union-attr]
    lines = text.splitlines()
    header = lines[0].split(",")
    col_t, col_v, col_pod = (header.index(c) for c in ("timestamp_anon", "value", "container_ip"))
    wanted = sorted({ln.rsplit(",", 1)[1] for ln in lines[1:]} if col_pod == 2 else
                    {ln.split(",")[col_pod] for ln in lines[1:]})[:pods]
    index = {pod: i for i, pod in enumerate(wanted)}
    series: list[list[tuple[float, float]]] = [[] for _ in wanted]
    for row in csv.reader(io.StringIO("\n".join(lines[1:]))):
        i = index.get(row[col_pod])
        if i is not None:
            series[i].append((float(row[col_t]), float(row[col_v]) / scale))
    longest = max(len(s) for s in series)
    times = np.full((len(wanted), longest), np.nan)
    values = np.full((len(wanted), longest), np.nan)
    for i, s in enumerate(series):
        s.sort()
        times[i, : len(s)] = [t for t, _ in s]
        values[i, : len(s)] = [v for _, v in s]
    return times, values


def replay(times: np.ndarray, values: np.ndarray, min_spread: float) -> tuple[np.ndarray, np.ndarray]:
    """Replay every row's series through one bank, one batch per sample index.

    Returns the smoothed value and the anomaly flag after each reading.
    """
    rows, steps = values.shape
    bank = SignalBank(rows, 1, min_spread=min_spread)
    all_rows = np.arange(rows)
    smoothed = np.full((rows, steps), np.nan)
    flagged = np.zeros((rows, steps), dtype=bool)
    for i in range(steps):
        live = ~np.isnan(times[:, i])
        bank.update(all_rows[live], values[live, i : i + 1], times[live, i])
        smoothed[:, i] = bank.smoothed[:, 0]
        flagged[:, i] = bank.flagged[:, 0] & live & ~np.isnan(values[:, i])
    return smoothed, flagged


@pytest.fixture(scope="module")
def memory_mib() -> tuple[np.ndarray, np.ndarray]:
    return load_pods(MEMORY_TAR, scale=MIB)


@pytest.fixture(scope="module")
def duty_pct() -> tuple[np.ndarray, np.ndarray]:
    return load_pods(DUTY_TAR)


def spike_figures(times, values, spike, cap, spread, tol):
    """Inject one-sample spikes and measure what reaches the smoothed series.

    Spikes go every ``SPIKE_EVERY`` readings, where the reading leaves room
    for the whole spike below ``cap``. A spike replaces a real reading, so
    the reference is the same series with that reading missing (NaN); the
    spike is *removed* when the smoothed series at and for ``SPIKE_LOOK``
    readings after it stays within ``tol`` of the reference. Lacking one
    reading, the reference follows a real step that starts next to the
    spike one reading later, so each point may match the reference's point
    or the one after it. Also returns the clean series' own anomaly rate.
    """
    pods, steps = values.shape
    pos = np.zeros_like(values, dtype=bool)
    pos[:, SPIKE_FIRST::SPIKE_EVERY] = True
    pos &= ~np.isnan(values) & (values + spike <= cap)
    spiked = np.where(pos, values + spike, values)
    dropped = np.where(pos, np.nan, values)
    sm, fl = replay(np.vstack([times] * 3), np.vstack([values, dropped, spiked]), spread)
    clean_fl = fl[:pods]
    ref, got = sm[pods : 2 * pods], sm[2 * pods :]
    errors = []
    for p, i in zip(*np.nonzero(pos)):
        g = got[p, i : i + SPIKE_LOOK]
        r0 = ref[p, i : i + SPIKE_LOOK]
        r1 = ref[p, i + 1 : i + SPIKE_LOOK + 1]
        k = min(g.size, r1.size)
        err = np.minimum(np.abs(g[:k] - r0[:k]), np.abs(g[:k] - r1[:k]))
        errors.append(np.nanmax(np.r_[err, np.abs(g[k:] - r0[k:])]))
    errors = np.array(errors)
    # "clear" spikes, judged on the clean trace alone: the 30 readings before
    # span less than half the spike, so the spike is far outside anything the
    # pod just did
    clear = np.array([np.ptp(values[p, max(0, i - 30) : i]) < spike / 2 if i else False
                      for p, i in zip(*np.nonzero(pos))])
    readings = int((~np.isnan(values)).sum())
    return {
        "spikes": errors.size,
        "removed": float(np.mean(errors <= tol)),
        "flagged": float(fl[2 * pods :][pos].mean()),
        "clear_spikes": int(clear.sum()),
        "clear_removed": float(np.mean(errors[clear] <= tol)),
        "err_p50_p90_p99": np.round(np.percentile(errors, [50, 90, 99]), 1).tolist(),
        "clean_anomaly_rate": clean_fl.sum() / readings,
        "readings": readings,
    }


def check_spike_figures(fig: dict) -> None:
    """Thresholds for ``spike_figures`` on the 1-minute GenAI trace.

    Measured (40 pods): memory +10 GiB, 79 % of all spikes and 98 % of clear
    ones removed, 6.6 % of clean readings flagged; duty cycle +60 %, 82 % and
    92 %, 5.7 %. What gets through: a spike on a pod whose minute-to-minute
    swings are as large as the spike (inside the fence: no filter could
    tell them apart), a spike in the few readings after a level shift (no
    fence yet), and a spike next to a real two-reading excursion on the
    same side, which together make a ``persist`` run and are taken as a
    shift. The "clean" anomaly rate counts the trace's own one-minute
    excursions (restarts, lone bursts), which the filter is meant to hold
    back; it is reported, and bounded so that a looser or tighter filter is
    noticed.
    """
    assert fig["spikes"] > 1000 and fig["clear_spikes"] > 300, fig
    assert fig["clear_removed"] >= 0.9, f"clear spikes removed: {fig}"
    assert fig["removed"] >= 0.75, f"spikes removed: {fig}"
    assert 0.01 <= fig["clean_anomaly_rate"] <= 0.12, f"clean-series anomaly rate: {fig}"


def test_memory_spikes_are_kept_out_of_the_smoothed_series(memory_mib) -> None:
    fig = spike_figures(*memory_mib, spike=10 * 1024.0, cap=np.inf, spread=64.0, tol=64.0)
    print("memory +10 GiB spikes:", fig)
    check_spike_figures(fig)


def test_duty_cycle_spikes_are_kept_out_of_the_smoothed_series(duty_pct) -> None:
    fig = spike_figures(*duty_pct, spike=60.0, cap=100.0, spread=2.0, tol=2.0)
    print("duty +60 % spikes:", fig)
    check_spike_figures(fig)


def level_steps(v: np.ndarray, span: int = 10, jump: float = 0.2, flat: float = 0.05) -> list[tuple[int, float]]:
    """Real level changes in one series: ``(first reading, new level)``.

    A step is a move of more than ``jump`` (relative) between two plateaus
    of ``span`` readings that each stay within ``flat`` of their median, so
    the "new level" is unambiguous. Found on the clean trace, without the
    filter.
    """
    v = v[~np.isnan(v)]
    if v.size < 2 * span:
        return []
    win = np.lib.stride_tricks.sliding_window_view(v, span)  # win[i] = v[i : i + span]
    med = np.median(win, axis=1)
    plateau = (med > 0) & np.all(np.abs(win - med[:, None]) <= flat * med[:, None], axis=1)
    before, after = slice(0, -span), slice(span, None)  # plateaus ending at i, starting at i
    hit = plateau[before] & plateau[after] & (np.abs(med[after] - med[before]) > jump * med[before])
    out: list[tuple[int, float]] = []
    for k in np.flatnonzero(hit):
        i = int(k) + span
        if not out or i >= out[-1][0] + span:
            out.append((i, float(med[i])))
    return out


def test_memory_level_changes_are_followed_within_a_bound(memory_mib) -> None:
    """The bound: a step outside the fence is taken once ``persist`` (3)
    readings agree, snapping to their median (within 5 % of the plateau by
    construction). A step the fence lets in (a wide, noisy window, or a
    window refilling after a shift) moves the EWMA by ``alpha`` of the gap
    per reading: from a gap of up to 100 % of the level down to 5 % takes
    ``ceil(ln 0.05 / ln 0.7) = 9`` readings. So every step is followed
    within ``3 + 9 = 12`` readings, and most within ``persist``.
    """
    times, values = memory_mib
    smoothed, _ = replay(times, values, 64.0)
    lags = []
    for p in range(values.shape[0]):
        for i, level in level_steps(values[p]):
            close = np.abs(smoothed[p, i : i + 12] - level) <= 0.05 * level
            lags.append(int(np.argmax(close)) + 1 if close.any() else 99)
    lags_arr = np.array(lags)
    hist = np.bincount(np.minimum(lags_arr, 13)).tolist()
    print(f"memory steps: {lags_arr.size}, readings to follow (histogram from 0): {hist}")
    assert lags_arr.size >= 10, "the trace sample has too few clean steps to judge"
    bound = 3 + math.ceil(math.log(0.05) / math.log(0.7))
    assert lags_arr.max() <= bound, f"a step took {lags_arr.max()} > {bound} readings: {hist}"
    assert np.mean(lags_arr <= 3) >= 0.8, f"steps followed within persist: {np.mean(lags_arr <= 3):.2f}, {hist}"
