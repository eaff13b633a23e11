"""Decision latency of the scheduler: filter + score + reserve for one task.

Plain script: builds a cluster snapshot of N nodes x 8 GPUs with random
readings, then times single decisions (the path ``Scheduler.dispatch`` takes
per task: ``filters.feasible``, ``Policy.choose``, ``Reservations.add`` and the
incremental ``PlacementView.refresh``) and whole dispatches, and prints p50/p99
per size and policy. ``--json`` prints the same numbers as JSON.

    python benchmarks/bench_decision.py [--nodes 1000 5000] [--decisions 2000] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler.config import SchedulerConfig  # noqa: E402
from scheduler.engine import Scheduler  # noqa: E402
from scheduler.filters import feasible  # noqa: E402
from scheduler.policies import make_policy  # noqa: E402
from scheduler.reservations import Reservations  # noqa: E402
from scheduler.snapshot import ClusterSnapshot, NodeFacts  # noqa: E402
from scheduler.task import TaskSpec  # noqa: E402
from scheduler.view import PlacementView  # noqa: E402

GPUS_PER_NODE = 8


def make_snapshot(nodes: int, seed: int = 7) -> ClusterSnapshot:
    rng = np.random.default_rng(seed)
    facts = [
        NodeFacts(
            f"node-{i:05d}",
            GPUS_PER_NODE,
            labels={"zone": f"z{i % 4}"},
            response_time_s=float(rng.uniform(0.1, 3.0)),
            disk_await_ms=float(rng.uniform(1, 100)),
            nvlink_pairs=[(g, g + 1) for g in range(0, GPUS_PER_NODE, 2)],
        )
        for i in range(nodes)
    ]
    count = nodes * GPUS_PER_NODE
    snap = ClusterSnapshot.build(
        facts,
        util_pct=rng.uniform(0, 100, count),
        memory_used_mib=rng.uniform(0, 12_000, count),
        temperature_c=rng.uniform(30, 80, count),
    )
    snap.nvlink_competition[:] = rng.uniform(0, 1, count)
    snap.active_tasks[:] = rng.integers(0, 4, count)
    return snap


def percentiles(samples: list[float]) -> tuple[float, float, float]:
    arr = np.asarray(samples) * 1e6
    return float(np.percentile(arr, 50)), float(np.percentile(arr, 99)), float(arr.max())


def bench_decisions(snap: ClusterSnapshot, policy_name: str, decisions: int, spec: TaskSpec) -> dict:
    config = SchedulerConfig()
    reservations = Reservations()
    view = PlacementView(snap, reservations, config)
    policy = make_policy(policy_name)
    times: list[float] = []
    placed = 0
    for i in range(decisions):
        t0 = time.perf_counter()
        mask = feasible(view, spec, config)
        placement = policy.choose(view, spec, mask)
        if placement is not None:
            used = [float(view.used[r]) for r in placement.rows]
            reservations.add(f"l{i}", placement.gpu_uuids, spec.vram_mib, 100 * spec.gpu_share, used)
            view.refresh(placement.gpu_uuids)
            policy.commit(view, placement)
            placed += 1
        times.append(time.perf_counter() - t0)
    p50, p99, worst = percentiles(times)
    return {"p50_us": p50, "p99_us": p99, "max_us": worst, "placed": placed}


def bench_dispatch(snap: ClusterSnapshot, tasks: int) -> dict:
    clock = [0.0]
    sched = Scheduler(clock=lambda: clock[0])
    sched.dispatch(snap)  # builds the view once, like a metrics tick would
    for i in range(tasks):
        sched.submit(TaskSpec(f"t{i}", vram_mib=2048, gpu_share=0.1, priority=i % 4))
    t0 = time.perf_counter()
    placed = sched.dispatch(snap)
    elapsed = time.perf_counter() - t0
    return {"tasks": tasks, "placed": len(placed), "per_task_us": elapsed / max(len(placed), 1) * 1e6}


def bench_view(snap: ClusterSnapshot, reserved: bool, repeats: int = 5) -> float:
    """ms to build the per-snapshot view (once per new snapshot, not per decision)."""
    reservations = Reservations()
    if reserved:  # every GPU holds a lease: the reservation columns are rebuilt too
        for i, gpu_uuid in enumerate(snap.gpu_uuid):
            reservations.add(f"lease-{i}", [gpu_uuid], 1_000.0, 10.0, [float(snap.memory_used_mib[i])])
    config = SchedulerConfig()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        PlacementView(snap, reservations, config)
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1000, 5000])
    parser.add_argument("--decisions", type=int, default=2000)
    parser.add_argument("--dispatch-tasks", type=int, default=1000)
    parser.add_argument("--policies", nargs="+", default=["load_aware", "binpack", "round_robin",
                                                          "least_connections", "weighted_round_robin"])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    single = TaskSpec("bench", vram_mib=2048, gpu_share=0.1)
    multi = TaskSpec("bench4", vram_mib=2048, gpu_share=0.1, num_gpus=4)
    rows = []
    for nodes in args.nodes:
        snap = make_snapshot(nodes)
        view_ms = bench_view(snap, reserved=False)
        view_reserved_ms = bench_view(snap, reserved=True)
        for name in args.policies:
            result = bench_decisions(snap, name, args.decisions, single)
            rows.append({"nodes": nodes, "gpus": snap.gpu_count, "policy": name, "num_gpus": 1,
                         "view_build_ms": view_ms, "view_build_reserved_ms": view_reserved_ms, **result})
        result = bench_decisions(snap, "load_aware", max(args.decisions // 4, 50), multi)
        rows.append({"nodes": nodes, "gpus": snap.gpu_count, "policy": "load_aware", "num_gpus": 4,
                     "view_build_ms": view_ms, "view_build_reserved_ms": view_reserved_ms, **result})
        dispatch = bench_dispatch(snap, args.dispatch_tasks)
        rows.append({"nodes": nodes, "gpus": snap.gpu_count, "policy": "dispatch(load_aware)",
                     "num_gpus": 1, "view_build_ms": view_ms, "view_build_reserved_ms": view_reserved_ms,
                     "p50_us": dispatch["per_task_us"],
                     "p99_us": None, "max_us": None, "placed": dispatch["placed"]})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    header = (
        f"{'nodes':>6} {'gpus':>6} {'policy':<22} {'k':>2} {'p50 us':>8} {'p99 us':>8} "
        f"{'max us':>8} {'placed':>6} {'view ms':>8} {'view+res ms':>11}"
    )
    print(header)
    print("-" * len(header))
    def us(value: float | None) -> str:
        return f"{value:>8.1f}" if value is not None else f"{'-':>8}"

    for r in rows:
        print(f"{r['nodes']:>6} {r['gpus']:>6} {r['policy']:<22} {r['num_gpus']:>2} {us(r['p50_us'])} "
              f"{us(r['p99_us'])} {us(r['max_us'])} {r['placed']:>6} {r['view_build_ms']:>8.2f} "
              f"{r['view_build_reserved_ms']:>11.2f}")
    print("decision = filters.feasible + Policy.choose + Reservations.add + PlacementView.refresh")
    print("dispatch(load_aware): p50 column = wall time of one dispatch / tasks placed")
    print("view ms: building the per-snapshot view; view+res ms: the same with every GPU leased")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
