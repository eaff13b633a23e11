"""Scheduling-quality benchmark: every policy side by side on the openb traces.

Run from the repository root::

    .venv/bin/python benchmarks/bench_simulate.py [--quick] [--json-out FILE] [--plot DIR]

What it does (all on a virtual clock, see ``scheduler/simulator.py``):

1. converts the openb pod lists (default, gpushare40, multigpu50) and the
   openb node list from ``../shared/traces/alibaba-openb`` into a temporary
   folder (nothing is copied into the repository);
2. **homogeneous RTX 4090 cluster**, 8 hosts x 4 GPUs (the issue's example)
   and 16 x 4, each trace at its own pace (no compression): the trace's busy
   34 days offer 30-65 GPUs of demand, so 32 GPUs are overloaded at the peaks
   and 64 are not; and 8 x 4 once more with the queue's backfill barrier out
   of reach (``backfill_max_head_wait_s`` / ``_skips`` huge), which isolates
   placement quality from the barrier's head-of-line blocking;
3. **the openb cluster** (1,213 nodes, 6,212 GPUs of 7 models, speeds scaled
   to a GPU-weighted mean of 1.0), arrivals compressed 1,000x with durations
   kept (``--arrival-scale``): the default trace's whole GPU demand is 5,485
   GPUs, less than the cluster, so at the trace's own pace it would use 1 % of
   it; compressed, its peak demand reaches about 40 % (multigpu50: 77 %);
4. **saturation** (the FGD paper's measure) on the openb cluster: tasks in
   trace order, never ending, until one does not fit;
5. **speed**: the openb default trace at its own pace on the openb cluster,
   tasks per minute of wall time per policy;
6. **OOM kills over seeds** on the openb cluster: round_robin and load_aware
   once per memory-draw seed (``--kill-seeds``, 3: seeds 0, 1, 2), because
   a single replay's kill count is a handful that moves by +-2 with any
   change in which task goes where, and the seeds' -86 % is a ratio of such
   counts;
7. prints each table, then load_aware / round_robin ratios next to the seeds'
   claims, and the unallocated-GPU shares next to the FGD paper's baselines.

Besides the six policies, ``round_robin@requests`` runs round-robin with no
telemetry at all (every GPU reads idle, so it places by the tasks' asks only:
a scheduler without a metrics pipeline, which is what the seeds' round-robin
baseline ignores too). Plain ``round_robin`` uses gpulb's readings in its
filters like every policy here; the summary gives load_aware's ratios against
both.

The runs are sequential (2 cores shared with other work); ``--quick`` runs
only the default trace.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dataclasses import replace  # noqa: E402

from coordinator.tables import fmt, render_table  # noqa: E402
from scheduler.cluster import convert_openb_nodes, homogeneous  # noqa: E402
from scheduler.config import SchedulerConfig  # noqa: E402
from scheduler.policies import POLICIES  # noqa: E402
from scheduler.simreport import (  # noqa: E402
    RATIO_KEYS,
    SEED_CLAIMS,
    attach_floors,
    figures,
    json_safe,
    plot,
    ratios,
    render,
)
from scheduler.simulator import REQUESTS_ONLY, SimConfig, saturate, simulate  # noqa: E402
from scheduler.traces import convert_openb, scale_trace  # noqa: E402

# Unallocated GPU share at arrived workload = 100 % of the cluster's GPUs, openb
# default trace, from the FGD artifact (hkust-adsl/kubernetes-scheduler-simulator,
# experiments/analysis/expected_results/analysis_allo_discrete.csv, tune 1.3,
# one seed each: 100 - allocation rate at column 100). Their allocation is by
# GPU share (no compute overcommit) and also bounded by CPU and host memory.
FGD_BASELINES = {
    "Random": 14.1,
    "DotProd": 9.5,
    "GpuClustering": 8.7,
    "BestFit": 7.3,
    "FGD": 4.9,
}
TRACES = ("default", "gpushare40", "multigpu50")


def _openb_dir() -> Path:
    env = os.environ.get("GPULB_TRACES")
    base = Path(env) if env else ROOT.parent / "shared" / "traces"
    return base / "alibaba-openb"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="only the default trace")
    p.add_argument("--policies", default=",".join([*POLICIES, "round_robin" + REQUESTS_ONLY]),
                   help="comma list; NAME@requests runs NAME without telemetry (placement by asks only)")
    p.add_argument("--arrival-scale", type=float, default=1000.0, help="openb cluster arrival compression")
    p.add_argument("--json-out", help="write every figure here as JSON")
    p.add_argument("--plot", help="write PNG plots per scenario under this folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip", default="",
                   help="comma list of parts to skip: 4090,barrier,openb,saturation,speed,kills")
    p.add_argument("--kill-seeds", type=int, default=3,
                   help="seeds (0..N-1) of the OOM-kill count on the openb cluster (the 'kills' part)")
    args = p.parse_args(argv)
    policies = [x for x in args.policies.split(",") if x]
    skip = set(filter(None, args.skip.split(",")))
    src = _openb_dir()
    traces = TRACES[:1] if args.quick else TRACES
    cfg = SimConfig(seed=args.seed)
    started = time.perf_counter()
    doc: dict = {"scenarios": [], "saturation": [], "speed": {}, "kills": []}
    summary_rows: list[list[str]] = []

    with tempfile.TemporaryDirectory(prefix="gpulb-bench-") as tmp:
        trace_tasks = {}
        for name in traces:
            tasks, stats = convert_openb(src / f"openb_pod_list_{name}.csv", Path(tmp) / f"{name}.csv")
            trace_tasks[name] = tasks
            print(f"# {name}: {stats.summary()}")
        openb_nodes = convert_openb_nodes(src / "openb_node_list_gpu_node.csv", Path(tmp) / "openb_cluster.csv")
        print(f"# openb cluster: {len(openb_nodes)} nodes, {sum(n.gpus for n in openb_nodes)} GPUs\n")

        scenarios = []
        if "4090" not in skip:
            for hosts in (8, 16):
                for name in traces:
                    scenarios.append((f"{name} on {hosts}x4 RTX 4090, own pace", name, homogeneous(hosts, 4), 1.0, cfg))
        if "barrier" not in skip:
            # the queue's backfill barrier out of reach: placement quality alone
            no_barrier = replace(cfg, scheduler=SchedulerConfig(backfill_max_head_wait_s=1e12, backfill_max_skips=10**9))
            for name in traces:
                scenarios.append(
                    (f"{name} on 8x4 RTX 4090, own pace, no backfill barrier", name, homogeneous(8, 4), 1.0, no_barrier)
                )
        if "openb" not in skip:
            for name in traces:
                scenarios.append(
                    (f"{name} on the openb cluster, arrivals x{args.arrival_scale:g}", name, openb_nodes,
                     args.arrival_scale, cfg)
                )
        openb_runs: dict[str, dict[str, object]] = {}  # trace -> policy -> its openb-cluster run (the kills part reuses them)
        for title, name, nodes, arrival, config in scenarios:
            tasks = scale_trace(trace_tasks[name], 1.0, arrival)
            print(f"## {title}")
            results = simulate(tasks, nodes, policies, config, progress=sys.stderr.isatty())
            if nodes is openb_nodes:
                openb_runs[name] = dict(zip(policies, results))
            attach_floors(results, tasks, nodes)
            meta = {"trace": name, "gpus": sum(n.gpus for n in nodes), "arrival_scale": arrival, "seed": args.seed}
            print(render(results, meta))
            print()
            figs = [figures(r) for r in results]
            doc["scenarios"].append({"title": title, "meta": meta, "policies": figs, "ratios": ratios(figs)})
            rat = ratios(figs)
            if rat:
                summary_rows.append([title, *[fmt(rat[k]["ratio"], 3) for k in RATIO_KEYS]])
                # what no placement of load_aware's tasks, started when it started them, can beat
                # (scheduler.simreport), as a ratio to round-robin's figure
                base = next(f for f in figs if f["policy"] == "round_robin")
                ours = next(f for f in figs if f["policy"] == "load_aware")
                floors = ours["floors"]
                print(f"floors for load_aware's timeline: hottest node {floors['hottest_node_util']:.1f} % "
                      f"({floors['hottest_node_task']}; round_robin {base['hottest_node_util']:.1f} %), util std "
                      f"across GPUs {floors['util_std']:.2f} % without two whole-GPU tasks on one GPU "
                      f"(round_robin {base['util_std']:.2f} %)\n")
                summary_rows.append(["  floor: no placement goes below",
                                     *[fmt(floors[k] / base[k] if base[k] else math.nan, 3)
                                       if k in floors else "-" for k in RATIO_KEYS]])
            blind = ratios(figs, base="round_robin" + REQUESTS_ONLY)
            if blind:
                doc["scenarios"][-1]["ratios_vs_requests_only"] = blind
                summary_rows.append(["  vs round_robin placing by asks only (no telemetry)",
                                     *[fmt(blind[k]["ratio"], 3) for k in RATIO_KEYS]])
            if args.plot:
                slug = title.replace(",", "").replace(" ", "_").replace("x4_RTX_4090", "x4")
                plot(results, Path(args.plot) / slug)

        if "saturation" not in skip:
            print("## saturation (FGD measure) on the openb cluster: tasks in trace order, never ending")
            rows = []
            for name in traces:
                for pol in [x for x in policies if not x.endswith(REQUESTS_ONLY)]:  # no readings there anyway
                    s = saturate(trace_tasks[name], openb_nodes, pol, config=cfg)
                    doc["saturation"].append({"trace": name, **s.__dict__})
                    rows.append(
                        [name, pol, fmt(100 * s.arrived_at_first_failure, 1, "%"),
                         fmt(100 * s.unallocated_at_first_failure, 1, "%"), fmt(100 * s.unallocated_at_full, 1, "%"),
                         fmt(100 * s.idle_gpus_at_full, 1, "%"), f"{s.wall_s:.1f}s"]
                    )
            print(render_table(
                ["trace", "policy", "arrived at 1st failure", "unallocated then", "unallocated at 100% arrived",
                 "idle GPUs at 100%", "wall"],
                rows, align="llrrrrr",
            ))
            print("\nFGD paper (openb default, arrived = 100 %, GPU-share allocation, unallocated GPU %): "
                  + ", ".join(f"{k} {v:g}%" for k, v in FGD_BASELINES.items()))
            print()

        if "speed" not in skip:
            print("## speed: openb default at its own pace on the openb cluster (6,212 GPUs)")
            tasks = trace_tasks["default"]
            rows = []
            for pol in [x for x in policies if not x.endswith(REQUESTS_ONLY)]:
                (r,) = simulate(tasks, openb_nodes, [pol], cfg)
                rate = len(tasks) / r.wall_s * 60
                doc["speed"][pol] = {"tasks": len(tasks), "wall_s": r.wall_s, "tasks_per_min": rate,
                                     "snapshots": r.snapshots, "dispatches": r.dispatches}
                rows.append([pol, f"{len(tasks):,}", f"{r.wall_s:.1f}s", fmt(rate, 0), f"{r.snapshots:,}"])
            print(render_table(["policy", "tasks", "wall", "tasks/min", "snapshots"], rows, align="lrrrr"))
            print()

        if "kills" not in skip and args.kill_seeds > 0:
            seeds = list(range(args.kill_seeds))
            print(f"## OOM kills on the openb cluster, arrivals x{args.arrival_scale:g}, memory-draw seeds "
                  f"{', '.join(map(str, seeds))}")
            rows = []
            for name in traces:
                tasks = scale_trace(trace_tasks[name], 1.0, args.arrival_scale)
                kills: dict[str, list[int]] = {"round_robin": [], "load_aware": []}
                evictions: list[int] = []
                for seed in seeds:
                    done = openb_runs.get(name, {}) if seed == args.seed else {}
                    if "round_robin" in done and "load_aware" in done:  # the openb part ran this seed
                        rr, la = done["round_robin"], done["load_aware"]
                    else:
                        rr, la = simulate(tasks, openb_nodes, ["round_robin", "load_aware"], replace(cfg, seed=seed))
                    kills["round_robin"].append(rr.oom_kills)
                    kills["load_aware"].append(la.oom_kills)
                    evictions.append(la.preemptions)
                    print(f"  {name} seed {seed}: OOM kills round_robin {rr.oom_kills}, load_aware {la.oom_kills}",
                          file=sys.stderr, flush=True)
                rr_sum, la_sum = sum(kills["round_robin"]), sum(kills["load_aware"])
                ratio = la_sum / rr_sum if rr_sum else math.nan
                doc["kills"].append({"trace": name, "seeds": seeds, "kills": kills, "load_aware_evictions": evictions,
                                     "ratio": ratio})
                rows.append([name, " / ".join(map(str, kills["round_robin"])) + f" ({rr_sum})",
                             " / ".join(map(str, kills["load_aware"])) + f" ({la_sum})", fmt(ratio, 3),
                             fmt(SEED_CLAIMS["oom_kills"][1] / SEED_CLAIMS["oom_kills"][0], 3),
                             " / ".join(f"{e:,}" for e in evictions)])
            print(render_table(["trace", "round_robin kills (sum)", "load_aware kills (sum)", "ratio of sums",
                                "seeds' ratio", "load_aware evictions for P0"], rows, align="lrrrrr"))
            print()

    if summary_rows:
        print("## load_aware / round_robin, every scenario (lower is better except mean GPU util)")
        seeds = ["seeds' claim", *[fmt(SEED_CLAIMS[k][1] / SEED_CLAIMS[k][0], 3) if k in SEED_CLAIMS else "-" for k in RATIO_KEYS]]
        print(render_table(["scenario", *[RATIO_KEYS[k][0] for k in RATIO_KEYS]], [*summary_rows, seeds],
                           align="l" + "r" * len(RATIO_KEYS)))
    print(f"\ntotal wall time {time.perf_counter() - started:.0f}s")
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump(json_safe(doc), fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
