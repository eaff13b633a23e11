"""Backfill with estimates on versus off, with clients' estimates exact,
scattered, or short: the openb traces on an overloaded homogeneous cluster
(8 hosts x 4 RTX 4090 unless told), per seed.

A multi-GPU task blocked past the queue's bound holds a node, which takes no
other task until it drains (off: ``backfill_estimate_factor = 0``). On, a
fenced task may still take the held node when ``backfill_estimate_factor``
times its predicted run ends before the node's leases are expected to (EASY
backfill). Its predicted run is its client's estimate times what the
predictor has learned its kind really takes against its estimates, and the
margin widens to the kind's learned overrun (the 90th percentile of actual /
predicted) where that is larger: the risk is an estimate that is too short,
delaying the task the node is held for. So each trace runs with estimates

- ``exact``: the trace's run time (a client that knows, or a time limit
  that fits);
- ``scattered``: misjudged by a log-normal factor, sigma 1 (a third of the
  estimates more than 2.7 times off, half of them short);
- ``short``: every estimate a third of the run time (clients that
  estimate short across the board).

Each mode is run with the backfill off and on; noise moves placements with it
off too (the held node is chosen by expected finish), so each pair shares its
estimates.

    python benchmarks/bench_backfill.py                     # 3 traces x 3 seeds x 3 modes, 29 min here (sharing the 2 cores)
    python benchmarks/bench_backfill.py --traces default --seeds 0 --modes exact
    python benchmarks/bench_backfill.py --hosts 4 --gpus 8 --traces gpushare40,default
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coordinator.tables import render_table  # noqa: E402
from scheduler.cluster import homogeneous  # noqa: E402
from scheduler.config import SchedulerConfig  # noqa: E402
from scheduler.simreport import figures  # noqa: E402
from scheduler.simulator import SimConfig, Simulation  # noqa: E402
from scheduler.traces import convert_openb, misestimate  # noqa: E402

OPENB = Path(__file__).resolve().parents[2] / "shared" / "traces" / "alibaba-openb"

#: estimate mode -> (scale, log-normal sigma) for ``misestimate``
MODES = {"exact": (1.0, 0.0), "scattered": (1.0, 1.0), "short": (1.0 / 3.0, 0.0)}


def _hours(seconds: float) -> str:
    if math.isnan(seconds):
        return "-"
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--traces", default="default,gpushare40,multigpu50")
    p.add_argument("--seeds", default="0,1,2", help="comma list of simulator seeds (memory draws, estimate noise)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list of estimate modes ({', '.join(MODES)})")
    p.add_argument("--policy", default="load_aware")
    p.add_argument("--hosts", type=int, default=8)
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument("--factor", type=float, default=SchedulerConfig().backfill_estimate_factor or 2.0,
                   help="backfill_estimate_factor of the 'on' arm (default: the scheduler's default)")
    args = p.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"--modes: unknown {unknown[0]!r}; expected {', '.join(MODES)}")
    logging.disable(logging.WARNING)  # one line per lapsed preemption would drown the table
    nodes = homogeneous(args.hosts, args.gpus)
    seeds = [int(s) for s in args.seeds.split(",") if s]
    traces = [t for t in args.traces.split(",") if t]
    rows: list[list[str]] = []
    totals: dict[str, dict[bool, list[float]]] = {m: {False: [0.0, 0.0, 0], True: [0.0, 0.0, 0]} for m in modes}
    started = time.perf_counter()
    runs = len(traces) * len(seeds) * len(modes) * 2
    done = 0
    with tempfile.TemporaryDirectory(prefix="gpulb-bench-") as tmp:
        for name in traces:
            tasks, _ = convert_openb(OPENB / f"openb_pod_list_{name}.csv", Path(tmp) / f"{name}.csv")
            for seed in seeds:
                for mode in modes:
                    scale, noise = MODES[mode]
                    told = misestimate(tasks, scale, noise, seed)
                    figs, multi = {}, {}
                    for on in (False, True):
                        cfg = SimConfig(seed=seed, scheduler=SchedulerConfig(
                            backfill_estimate_factor=args.factor if on else 0.0))
                        result = Simulation(told, nodes, args.policy, cfg).run()
                        figs[on] = figures(result)
                        waits = [r.wait_s for r in result.records
                                 if r.priority == 0 and r.num_gpus > 1 and r.state == "completed"]
                        multi[on] = sum(waits) / len(waits) if waits else math.nan
                        total = totals[mode][on]
                        total[0] += figs[on]["wait_s"]["P0"]["mean"]
                        total[1] += figs[on]["jct_mean_s"]
                        total[2] += figs[on]["sla_misses"]
                        done += 1
                        print(f"[{done}/{runs}] {name} seed {seed} estimates {mode} backfill {'on' if on else 'off'} "
                              f"({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
                    off, on_ = figs[False], figs[True]
                    rows.append([
                        name, str(seed), mode,
                        f"{_hours(off['wait_s']['P0']['mean'])} -> {_hours(on_['wait_s']['P0']['mean'])}",
                        f"{_hours(multi[False])} -> {_hours(multi[True])}",
                        f"{off['sla_misses']:,} -> {on_['sla_misses']:,}",
                        f"{_hours(off['jct_mean_s'])} -> {_hours(on_['jct_mean_s'])}",
                    ])
    n = len(traces) * len(seeds)
    for mode in modes:
        off, on_ = totals[mode][False], totals[mode][True]
        rows.append([
            "all", f"mean of {n}" if n > 1 else "", mode,
            f"{_hours(off[0] / n)} -> {_hours(on_[0] / n)}", "",
            f"{int(off[2]):,} -> {int(on_[2]):,} (sum)",
            f"{_hours(off[1] / n)} -> {_hours(on_[1] / n)}",
        ])
    print(f"\n{args.hosts} x {args.gpus} RTX 4090, {args.policy}, backfill off -> on "
          f"(backfill_estimate_factor 0 -> {args.factor:g}; {time.perf_counter() - started:.0f} s)\n")
    print(render_table(["trace", "seed", "estimates", "mean P0 wait", "multi-GPU P0 wait", "P0 SLA misses",
                        "mean response"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
