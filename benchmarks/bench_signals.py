"""Throughput of ``coordinator.signals.SignalBank.update``: GPU rows per second.

Plain script: fills a bank's windows, then times ``update`` on batches of rows
(5 signals, window 30 by default) with realistic readings (noise around a
per-row level, 1 % single-sample spikes, 5 % of rows shifting level now and
then), for full rows and for delta batches where only one signal of each row
moved. Also times the ways to get the fences' quartiles for the same batch,
which is how the sort-based form in ``coordinator.signals`` was chosen.
Prints a table, or JSON with ``--json``.

The bar: the view must take 100,000 GPU-samples/s in total on the 2-core dev
box, so the filter must cost well under 10 us per row when the coordinator
applies it in a periodic tick over a few hundred rows at once.

    python benchmarks/bench_signals.py [--batches 8 300 1000] [--seconds 1.0] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coordinator.signals import SignalBank, quartiles  # noqa: E402

TARGET_ROWS_PER_S = 100_000


def readings(rng: np.random.Generator, level: np.ndarray, rows: int, signals: int, delta: bool) -> np.ndarray:
    """One batch of readings: noise around ``level``, rare spikes, NaN where a delta sent nothing."""
    x = level[:rows] + rng.normal(0.0, 1.0, size=(rows, signals))
    spikes = rng.random((rows, signals)) < 0.01
    x[spikes] += 50.0
    if delta:
        keep = rng.integers(0, signals, size=rows)
        masked = np.full_like(x, np.nan)
        masked[np.arange(rows), keep] = x[np.arange(rows), keep]
        x = masked
    return x


def bench_update(batch: int, signals: int, window: int, seconds: float, delta: bool, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    capacity = max(batch, 1000)
    bank = SignalBank(capacity, signals, window=window, min_spread=1.0)
    level = rng.uniform(20.0, 80.0, size=(capacity, signals))
    rows = np.arange(batch)
    t = 0.0
    for _ in range(window + 5):  # full windows: the steady state
        bank.update(rows, readings(rng, level, batch, signals, False), t)
        t += 1.0
    # pre-generate so the timing is the bank's alone
    pool = [readings(rng, level, batch, signals, delta) for _ in range(64)]
    calls = 0
    start = time.perf_counter()
    elapsed = 0.0
    while elapsed < seconds:
        if calls % 50 == 49:  # now and then 5 % of rows move to a new level
            moved = rng.random(capacity) < 0.05
            level[moved] += rng.choice([-15.0, 15.0], size=(int(moved.sum()), 1))
        bank.update(rows, pool[calls % len(pool)], t)
        t += 0.5
        calls += 1
        elapsed = time.perf_counter() - start
    per_call = elapsed / calls
    return {
        "batch_rows": batch,
        "signals": signals,
        "window": window,
        "readings": "delta (1 signal/row)" if delta else "full",
        "calls": calls,
        "us_per_call": per_call * 1e6,
        "us_per_row": per_call * 1e6 / batch,
        "rows_per_s": batch / per_call,
        "anomalies": int(bank.anomaly_counts.sum()),
        "shifts": int(bank.shift_counts.sum()),
    }


def bench_quartiles(batch: int, signals: int, window: int, seed: int = 0) -> list[dict]:
    """The candidate ways to get Q1/Q3 of ``batch * signals`` windows."""
    rng = np.random.default_rng(seed)
    win = rng.normal(size=(batch * signals, window))
    n = np.full(batch * signals, window)

    def sort_columns() -> object:
        s = np.sort(win, axis=-1)
        h1, h3 = (window - 1) * 0.25, (window - 1) * 0.75
        i1, i3 = int(h1), int(h3)
        return (s[:, i1] + (h1 - i1) * (s[:, i1 + 1] - s[:, i1]),
                s[:, i3] + (h3 - i3) * (s[:, min(i3 + 1, window - 1)] - s[:, i3]))

    def sort_based() -> object:
        return quartiles(np.sort(win, axis=-1), n)

    def percentile() -> object:
        return np.percentile(win, [25, 75], axis=-1)

    def nanpercentile() -> object:
        return np.nanpercentile(win, [25, 75], axis=-1)

    def partition() -> object:
        h1, h3 = (window - 1) * 0.25, (window - 1) * 0.75
        kth = sorted({int(h1), int(h1) + 1, int(h3), min(int(h3) + 1, window - 1)})
        return np.partition(win, kth, axis=-1)

    out = []
    for name, fn in (("sort, fixed columns (kept: full)", sort_columns),
                     ("sort + take_along_axis (partial)", sort_based), ("np.percentile", percentile),
                     ("np.partition", partition), ("np.nanpercentile", nanpercentile)):
        fn()
        reps, start = 0, time.perf_counter()
        while time.perf_counter() - start < 0.3 or reps < 2:
            fn()
            reps += 1
        dt = (time.perf_counter() - start) / reps
        out.append({"method": name, "batch_rows": batch, "us_per_row": dt * 1e6 / batch})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 300, 1000])
    ap.add_argument("--signals", type=int, default=5)
    ap.add_argument("--window", type=int, default=30)
    ap.add_argument("--seconds", type=float, default=1.0, help="time per measurement")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    updates = [bench_update(b, args.signals, args.window, args.seconds, delta)
               for delta in (False, True) for b in args.batches]
    fences = [r for b in (8, 1000) for r in bench_quartiles(b, args.signals, args.window)]
    if args.json:
        print(json.dumps({"target_rows_per_s": TARGET_ROWS_PER_S, "update": updates, "quartiles": fences}, indent=2))
        return 0
    print(f"SignalBank.update, {args.signals} signals, window {args.window} "
          f"(target: {TARGET_ROWS_PER_S:,} rows/s in total)")
    print(f"{'readings':<22}{'batch':>7}{'us/call':>11}{'us/row':>9}{'rows/s':>12}")
    for r in updates:
        print(f"{r['readings']:<22}{r['batch_rows']:>7}{r['us_per_call']:>11.1f}"
              f"{r['us_per_row']:>9.2f}{r['rows_per_s']:>12,.0f}")
    print()
    print(f"fence quartiles, {args.signals} windows of {args.window} per row")
    print(f"{'method':<34}{'batch':>7}{'us/row':>10}")
    for r in fences:
        print(f"{r['method']:<34}{r['batch_rows']:>7}{r['us_per_row']:>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
