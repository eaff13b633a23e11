"""Preemption on versus off: the openb traces on an overloaded homogeneous
cluster (8 hosts x 4 RTX 4090, arrivals at their own pace), per seed.

Urgent work must not wait behind batch work. With preemption off, a P0 task
that fits nowhere waits for running work to end, whatever its class; on (the
default), it evicts P2/P3 leases (``scheduler.engine``, ``_preempt``). The
table shows, per trace and seed, the P0 wait, the P0 SLA misses and the mean
response time with it off and on, and what the batch classes pay: the P2
wait, the evictions and the GPU-hours their runs redo (a checkpointing task
its restart cost, any other its run so far).

    python benchmarks/bench_preemption.py                 # 3 traces x 3 seeds, ~5 min here
    python benchmarks/bench_preemption.py --traces default --seeds 0 --policy round_robin
    python benchmarks/bench_preemption.py --hosts 4 --gpus 8 --nvlink all   # NVSwitch hosts, NVLink tasks

``--nvlink`` gives every host that NVLink (the cluster format's ``nvlink``:
``all``, ``pairs`` or ``0-1;2-3``) and marks every multi-GPU task
``needs_nvlink``, as tensor-parallel serving and training ask; the table
then also shows the multi-GPU P0 tasks' mean wait.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler.cluster import homogeneous  # noqa: E402
from scheduler.config import SchedulerConfig  # noqa: E402
from scheduler.simreport import figures  # noqa: E402
from scheduler.simulator import SimConfig, Simulation  # noqa: E402
from coordinator.tables import render_table  # noqa: E402
from scheduler.traces import convert_openb  # noqa: E402

OPENB = Path(__file__).resolve().parents[2] / "shared" / "traces" / "alibaba-openb"


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--traces", default="default,gpushare40,multigpu50")
    p.add_argument("--seeds", default="0,1,2", help="comma list of simulator seeds (memory draws)")
    p.add_argument("--policy", default="load_aware")
    p.add_argument("--hosts", type=int, default=8)
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument("--nvlink", default="", metavar="all|pairs|0-1;2-3",
                   help="every host's NVLink, and every multi-GPU task needs it (default: none)")
    p.add_argument("--backfill-estimate-factor", type=float, default=SchedulerConfig().backfill_estimate_factor,
                   metavar="F", help="the scheduler's backfill_estimate_factor in both arms (default: the scheduler's, 2; "
                   "0 turns it off)")
    args = p.parse_args(argv)
    logging.disable(logging.WARNING)  # one line per lapsed preemption would drown the table
    nodes = homogeneous(args.hosts, args.gpus, nvlink=args.nvlink)
    linked = bool(nodes[0].nvlink_pairs)
    seeds = [int(s) for s in args.seeds.split(",") if s]
    traces = [t for t in args.traces.split(",") if t]
    rows: list[list[str]] = []
    started = time.perf_counter()
    runs = len(traces) * len(seeds) * 2
    done = 0
    with tempfile.TemporaryDirectory(prefix="gpulb-bench-") as tmp:
        for name in traces:
            tasks, _ = convert_openb(OPENB / f"openb_pod_list_{name}.csv", Path(tmp) / f"{name}.csv")
            if linked:
                tasks = [replace(t, needs_nvlink=t.num_gpus > 1) for t in tasks]
            for seed in seeds:
                figs, multi = {}, {}
                for on in (False, True):
                    cfg = SimConfig(seed=seed, scheduler=SchedulerConfig(
                        preemption=on, backfill_estimate_factor=args.backfill_estimate_factor))
                    result = Simulation(tasks, nodes, args.policy, cfg).run()
                    figs[on] = figures(result)
                    waits = [r.wait_s for r in result.records
                             if r.priority == 0 and r.num_gpus > 1 and r.state == "completed"]
                    multi[on] = sum(waits) / len(waits) if waits else float("nan")
                    done += 1
                    print(f"[{done}/{runs}] {name} seed {seed} preemption {'on' if on else 'off'} "
                          f"({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
                off, on_ = figs[False], figs[True]

                def pair(key, fmt) -> str:
                    return f"{fmt(_get(off, key))} -> {fmt(_get(on_, key))}"

                rows.append([
                    name, str(seed),
                    pair(("wait_s", "P0", "mean"), _hours),
                    *([f"{_hours(multi[False])} -> {_hours(multi[True])}"] if linked else []),
                    pair(("sla_misses",), lambda v: f"{v:,}"),
                    pair(("jct_mean_s",), _hours),
                    pair(("wait_s", "P2", "mean"), _hours),
                    f"{on_['preemptions']:,} / {on_['preempted_work_h']:.1f}",
                ])
    topology = f", NVLink {args.nvlink}, multi-GPU tasks need it" if linked else ""
    if args.backfill_estimate_factor != SchedulerConfig().backfill_estimate_factor:
        topology += f", backfill_estimate_factor {args.backfill_estimate_factor:g}"
    print(f"\n{args.hosts} x {args.gpus} RTX 4090{topology}, {args.policy}, preemption off -> on "
          f"({time.perf_counter() - started:.0f} s)\n")
    print(render_table(["trace", "seed", "mean P0 wait", *(["multi-GPU P0 wait"] if linked else []),
                        "P0 SLA misses", "mean response", "mean P2 wait", "evictions / GPU-h redone"], rows))
    return 0


def _get(fig: dict, key: tuple):
    value = fig
    for k in key:
        value = value[k]
    return value


if __name__ == "__main__":
    sys.exit(main())
