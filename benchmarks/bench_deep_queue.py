"""What one dispatch pass costs as the queue grows: the engine alone, no RPC.

A pass offers every queued task in dispatch order (the hybrid queue's
weighted rounds), so its cost grows with the queue's depth; what a queued
task costs when its shape already failed in the pass is what this measures.
The cluster is 4 nodes x 8 RTX 4090 (24 GiB); every task asks for all 8 GPUs
of the one node labelled ``zone=busy`` (20,000 MiB each, P0-P3 in turn, ten
tenants), like QA's scale run of round 24, so none can be placed and the
other three nodes stay idle (the cluster is never "exhausted"). Scenarios:

- ``waiting``: the node runs a gpulb lease of the same shape: the tasks wait
  for it, the most urgent barrier holds the node (EASY backfill);
- ``foreign``: the node's memory is taken by processes gpulb did not place:
  no node can be held for any barrier, so every barrier asks whether one
  could (``Scheduler._held_node``) at every pass: QA's restart case;
- ``shapes``: as ``foreign`` with 50 distinct memory asks.

The clock is moved past ``backfill_max_head_wait_s`` first, so blocked tasks
are barriers; then 5 passes, 0.5 s apart, are timed (median reported).

    python benchmarks/bench_deep_queue.py                         # 1k, 10k, 100k: about a minute here
    python benchmarks/bench_deep_queue.py --depths 30000 --scenarios foreign
    python benchmarks/bench_deep_queue.py --repo /tmp/old-checkout  # the same run on another checkout's scheduler
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

SCENARIOS = ("waiting", "foreign", "shapes")
GIB = 1024.0


def _args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depths", default="1000,10000,100000", help="queued tasks, comma-separated")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"some of {', '.join(SCENARIOS)}")
    parser.add_argument("--passes", type=int, default=5, help="timed passes per depth (median reported)")
    parser.add_argument("--repo", default=str(Path(__file__).resolve().parents[1]),
                        help="the checkout whose scheduler/ to time (default: this one)")
    parser.add_argument("--json", action="store_true", help="one JSON document instead of the table")
    args = parser.parse_args(argv)
    args.depth_list = [int(d) for d in args.depths.split(",") if d]
    args.scenario_list = [s for s in args.scenarios.split(",") if s]
    unknown = sorted(set(args.scenario_list) - set(SCENARIOS))
    if unknown or not args.scenario_list:
        parser.error(f"--scenarios: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(SCENARIOS)}")
    if not args.depth_list or min(args.depth_list) < 1 or args.passes < 1:
        parser.error("--depths and --passes: positive integers")
    return args


def run_one(scenario: str, depth: int, passes: int) -> dict:
    from scheduler.config import SchedulerConfig
    from scheduler.engine import Scheduler
    from scheduler.snapshot import ClusterSnapshot, NodeFacts
    from scheduler.task import TaskSpec

    class Clock:
        now = 1000.0

        def __call__(self) -> float:
            return self.now

    clock = Clock()
    lease_ids = (f"lease-{i}" for i in itertools.count())
    config = SchedulerConfig()
    sched = Scheduler(config, clock=clock, lease_ids=lambda: next(lease_ids))
    nodes = [NodeFacts(f"n{i}", 8, memory_total_mib=24 * GIB, labels={"zone": "busy"} if i == 0 else {})
             for i in range(4)]
    foreign = scenario != "waiting"
    used = ([20 * GIB] * 8 if foreign else [0.0] * 8) + [0.0] * 24
    snap = ClusterSnapshot.build(nodes, memory_used_mib=used)

    def spec(i: int) -> TaskSpec:
        vram = 20000 + (i % 50 if scenario == "shapes" else 0)
        return TaskSpec(task_id=f"q{i:07d}", tenant=f"t{i % 10}", priority=i % 4, kind="batch",
                        vram_mib=vram, num_gpus=8, gpu_share=0.9, required_node_labels={"zone": "busy"})

    sched.submit_many([spec(i) for i in range(depth + (0 if foreign else 1))], snap)
    first = len(sched.dispatch(snap))  # the waiting scenario's running lease
    clock.now += config.backfill_max_head_wait_s + 10.0
    times = []
    placed = 0
    for _ in range(passes):
        clock.now += 0.5
        start = time.perf_counter()
        placed += len(sched.dispatch(snap))
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    return {
        "scenario": scenario, "queued": sched.queued(), "leased_first": first, "placed_timed": placed,
        "pass_ms": median * 1e3, "pass_ms_max": max(times) * 1e3, "us_per_task": median / max(sched.queued(), 1) * 1e6,
    }


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    sys.path.insert(0, str(Path(args.repo).resolve()))
    rows = []
    for depth in args.depth_list:
        for scenario in args.scenario_list:
            print(f"  {scenario:8} {depth:>7,} queued ...", end="", file=sys.stderr, flush=True)
            row = run_one(scenario, depth, args.passes)
            print(f" {row['pass_ms']:.1f} ms a pass", file=sys.stderr, flush=True)
            rows.append(row)
    machine = f"{platform.machine()}, {os.cpu_count()} cores, CPython {platform.python_version()}"
    if args.json:
        print(json.dumps({"repo": args.repo, "machine": machine, "rows": rows}, indent=2))
        return 0
    from coordinator.tables import render_table

    print(f"scheduler from {args.repo} ({machine}); median of {args.passes} passes")
    print(render_table(
        ["scenario", "queued", "pass (median)", "pass (max)", "per queued task"],
        [[r["scenario"], f"{r['queued']:,}", f"{r['pass_ms']:,.1f} ms", f"{r['pass_ms_max']:,.1f} ms",
          f"{r['us_per_task']:.2f} µs"] for r in rows],
    ))
    return 0


if __name__ == "__main__":
    sys.exit(main())
