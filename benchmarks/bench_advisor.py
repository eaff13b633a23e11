"""Advisor evaluation time at cluster scale.

The coordinator evaluates the rebalance advisor on its event loop every
``[advisor] interval_s`` (30 s): while a plan is computed no agent batch is
decoded and no ScheduleTask answered, so its time is a stall of the whole
coordinator. This measures ``plan_moves`` (the moves, with the reserve's
GPUs and nodes) and one ``Advisor.evaluate`` (the trigger, the averages and
the moves) on synthetic clusters of 8-GPU nodes with two movable tasks per
GPU, readings spread uniformly over 0-100 % (the trigger fires, every GPU
above the mean is a source; each evaluation is a fresh advisor's first, the
one that plans), and an arriving mix with 1-, 2-, 4- and 8-GPU
shapes (so both parts of the reserve are computed).

Before it plans, the coordinator hands the advisor the leased tasks. It
also times that hand-over on a real ``Scheduler`` holding as many leases
(placed by its own dispatch): as copies (``Scheduler.tasks``, what the
coordinator did until round 14) and in place (``Scheduler.leased``, what it
does now).

Run from the repository root::

    .venv/bin/python benchmarks/bench_advisor.py [--nodes 125,500,1000] [--repeat 7] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler.advisor import Advisor, AdvisorConfig, plan_moves  # noqa: E402
from scheduler.engine import Scheduler  # noqa: E402
from scheduler.fragmentation import WorkloadMix  # noqa: E402
from scheduler.snapshot import ClusterSnapshot, NodeFacts  # noqa: E402
from scheduler.task import Assignment, Priority, ScoreBreakdown, Task, TaskSpec, TaskState  # noqa: E402

GPUS_PER_NODE = 8
TASKS_PER_GPU = 2
NOW = 1_000.0


def cluster(nodes: int, seed: int = 0) -> tuple[ClusterSnapshot, list[Task]]:
    rng = np.random.default_rng(seed)
    facts = [NodeFacts(f"node-{i:04d}", GPUS_PER_NODE) for i in range(nodes)]
    g = nodes * GPUS_PER_NODE
    snap = ClusterSnapshot.build(facts, util_pct=rng.uniform(0.0, 100.0, g),
                                 memory_used_mib=rng.uniform(0.0, 16_000.0, g))
    tasks = []
    for row in range(g):
        for j in range(TASKS_PER_GPU):
            task_id = f"train-{row}-{j}"
            spec = TaskSpec(task_id=task_id, kind="training", priority=Priority.P2, vram_mib=2_000.0,
                            gpu_share=0.5, movable=True)
            a = Assignment(snap.node_ids[int(snap.gpu_node[row])], (int(snap.gpu_index[row]),),
                           (snap.gpu_uuid[row],), f"lease-{task_id}", 1e12,
                           ScoreBreakdown("load_aware", 0.0, {}, 1), 0.0)
            tasks.append(Task(spec, TaskState.LEASED, Priority.P2, 0.0, 0.0, 0.0, assignment=a))
    return snap, tasks


def handover(nodes: int, repeat: int) -> tuple[float, float]:
    """Median ms to hand a scheduler's leases over as copies and in place,
    on a ``Scheduler`` that placed ``TASKS_PER_GPU`` tasks per GPU itself."""
    facts = [NodeFacts(f"node-{i:04d}", GPUS_PER_NODE) for i in range(nodes)]
    g = nodes * GPUS_PER_NODE
    snap = ClusterSnapshot.build(facts, util_pct=np.zeros(g), memory_used_mib=np.zeros(g))
    sched = Scheduler(clock=time.monotonic)
    sched.submit_many([TaskSpec(task_id=f"train-{i}", kind="training", vram_mib=2_000.0, gpu_share=0.5, movable=True)
                       for i in range(g * TASKS_PER_GPU)], snap)
    placed = len(sched.dispatch(snap))
    assert placed == g * TASKS_PER_GPU, placed
    copies = timed(lambda: sched.tasks(state=TaskState.LEASED, limit=10**9), repeat)
    in_place = timed(sched.leased, repeat)
    return statistics.median(copies), statistics.median(in_place)


def arriving_mix() -> WorkloadMix:
    mix = WorkloadMix()
    for num_gpus, vram in [(1, 2_000.0)] * 8 + [(1, 12_000.0), (2, 10_000.0), (4, 10_000.0), (8, 10_000.0)]:
        mix.observe_shape(num_gpus, vram, 0.5)
    return mix


def timed(fn, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000.0)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="125,500,1000", help="cluster sizes, in 8-GPU nodes (comma list)")
    p.add_argument("--repeat", type=int, default=7, help="timed runs per figure (median and max reported)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = p.parse_args(argv)
    mix = arriving_mix()
    cfg = AdvisorConfig()
    rows = []
    for nodes in (int(n) for n in args.nodes.split(",")):
        print(f"# {nodes} nodes: building {nodes * GPUS_PER_NODE * TASKS_PER_GPU:,} leased tasks ...",
              file=sys.stderr, flush=True)
        snap, tasks = cluster(nodes)
        plan = timed(lambda: plan_moves(snap, tasks, cfg, now=NOW, workload_mix=mix), args.repeat)
        # a fresh advisor each time: a kept one would find its window full
        # after its first plan and return at once
        evaluate = timed(lambda: Advisor(cfg).evaluate(snap, tasks, NOW, workload_mix=mix), args.repeat)
        moves = len(plan_moves(snap, tasks, cfg, now=NOW, workload_mix=mix)[0])
        copies, in_place = handover(nodes, args.repeat)
        rows.append({"nodes": nodes, "gpus": snap.gpu_count, "tasks": len(tasks), "moves": moves,
                     "plan_moves_ms_median": statistics.median(plan), "plan_moves_ms_max": max(plan),
                     "evaluate_ms_median": statistics.median(evaluate), "evaluate_ms_max": max(evaluate),
                     "handover_copies_ms_median": copies, "handover_in_place_ms_median": in_place})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    head = (f"{'nodes':>6} {'GPUs':>6} {'tasks':>7} {'moves':>5} {'plan_moves ms':>14} {'(max)':>7} {'evaluate ms':>12} "
            f"{'(max)':>7} {'hand-over ms: copies':>21} {'in place':>9}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['nodes']:>6} {r['gpus']:>6} {r['tasks']:>7,} {r['moves']:>5} {r['plan_moves_ms_median']:>14.1f} "
              f"{r['plan_moves_ms_max']:>7.1f} {r['evaluate_ms_median']:>12.1f} {r['evaluate_ms_max']:>7.1f} "
              f"{r['handover_copies_ms_median']:>21.1f} {r['handover_in_place_ms_median']:>9.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
