"""Decision latency of the scheduler: filter + score + reserve for one task.

Plain script: builds a cluster snapshot of N nodes x 8 GPUs with random
readings, then times single decisions (the path ``Scheduler.dispatch`` takes
per task: ``filters.feasible``, ``Policy.choose``, ``Reservations.add`` and the
incremental ``PlacementView.refresh``) and whole dispatches, and prints p50/p99
per size and policy. ``--json`` prints the same numbers as JSON.

The ``mixed`` rows replay a mix of shapes against a cluster of mixed NVLink
topologies (a half of the nodes with NVLink pairs, a quarter fully connected,
a quarter without NVLink): 70 % 1-GPU, 20 % 2-GPU (a third of them
needs_nvlink), 10 % 4-GPU; 10 % of the tasks require a zone label and 10 %
prefer a rack. Live leases are capped (the oldest is released, untimed, as in
a steady state), so the cluster never fills. ``mixed`` is every decision,
``mixed kN`` the N-GPU decisions of the same run. ``submit(never_fits)`` times
the never-fits check of the same specs, with a new snapshot object (same
static columns, as the coordinator makes them) every 200 submits;
``view rebuild`` is building the view of such a new snapshot.

    python benchmarks/bench_decision.py [--nodes 1000 5000] [--decisions 2000] [--json]
    python benchmarks/bench_decision.py --only-mixed   # just the mixed rows
    python benchmarks/bench_decision.py --clock cpu --repeat 3   # on a busy machine
    python benchmarks/bench_decision.py --clock cpu --only-mixed --baseline HEAD~1   # choose, old vs new

``--baseline REV`` times ``Policy.choose`` of ``scheduler/policies.py`` at git
revision REV and today's on the same mixed decisions, in turns, and checks
they place alike: a comparison that the machine's load skews alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler.config import SchedulerConfig  # noqa: E402
from scheduler.engine import Scheduler  # noqa: E402
from scheduler.filters import feasible, never_fits  # noqa: E402
from scheduler.policies import make_policy  # noqa: E402
from scheduler.reservations import Reservations  # noqa: E402
from scheduler.snapshot import ClusterSnapshot, NodeFacts  # noqa: E402
from scheduler.task import TaskSpec  # noqa: E402
from scheduler.view import PlacementView  # noqa: E402

GPUS_PER_NODE = 8
# time.perf_counter (wall) or time.thread_time (--clock cpu: this thread's CPU
# time, which leaves out the time other processes hold the core; for a shared
# machine, where wall-clock p99 measures the neighbours)
timer = time.perf_counter


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


def make_mixed_snapshot(nodes: int, seed: int = 11) -> ClusterSnapshot:
    """N nodes x 8 GPUs, mixed NVLink topologies, zone and rack labels."""
    rng = np.random.default_rng(seed)
    pairs = [(g, g + 1) for g in range(0, GPUS_PER_NODE, 2)]
    mesh = [(a, b) for a in range(GPUS_PER_NODE) for b in range(a + 1, GPUS_PER_NODE)]
    topologies = [pairs, pairs, mesh, []]
    facts = [
        NodeFacts(
            f"node-{i:05d}",
            GPUS_PER_NODE,
            labels={"zone": f"z{i % 4}", "rack": f"r{i % 64}"},
            response_time_s=float(rng.uniform(0.1, 3.0)),
            disk_await_ms=float(rng.uniform(1, 100)),
            nvlink_pairs=topologies[int(rng.integers(0, 4))],
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
    linked = np.asarray([bool(f.nvlink_pairs) for f in facts])[snap.gpu_node]
    snap.nvlink_competition[:] = np.where(linked, rng.uniform(0, 1, count), np.nan)
    snap.active_tasks[:] = rng.integers(0, 4, count)
    return snap


def mixed_specs(count: int, seed: int = 3) -> list[TaskSpec]:
    """70 % 1-GPU, 20 % 2-GPU (a third needs_nvlink), 10 % 4-GPU; some label affinity."""
    rng = np.random.default_rng(seed)
    specs = []
    for i in range(count):
        draw = rng.random()
        k = 1 if draw < 0.7 else 2 if draw < 0.9 else 4
        labels = rng.random()
        specs.append(
            TaskSpec(
                f"mixed-{i}",
                num_gpus=k,
                vram_mib=float(rng.choice([1024.0, 2048.0, 4096.0, 8192.0])),
                gpu_share=float(rng.uniform(0.05, 0.3)),
                needs_nvlink=k == 2 and rng.random() < 1 / 3,
                required_node_labels={"zone": f"z{int(rng.integers(0, 4))}"} if labels < 0.1 else {},
                preferred_node_labels={"rack": f"r{int(rng.integers(0, 64))}"} if 0.1 <= labels < 0.2 else {},
            )
        )
    return specs


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
        t0 = timer()
        mask = feasible(view, spec, config)
        placement = policy.choose(view, spec, mask)
        if placement is not None:
            used = [float(view.used[r]) for r in placement.rows]
            reservations.add(f"l{i}", placement.gpu_uuids, spec.vram_mib, 100 * spec.gpu_share, used)
            view.refresh(placement.gpu_uuids)
            policy.commit(view, placement)
            placed += 1
        times.append(timer() - t0)
    p50, p99, worst = percentiles(times)
    return {"p50_us": p50, "p99_us": p99, "max_us": worst, "placed": placed}


def baseline_policies(rev: str) -> ModuleType:
    """``scheduler/policies.py`` as of git revision ``rev``, loaded as a module
    of its own (it imports today's ``scheduler.scoring`` and view)."""
    root = Path(__file__).resolve().parents[1]
    source = subprocess.run(["git", "show", f"{rev}:scheduler/policies.py"], cwd=root, check=True,
                            capture_output=True, text=True).stdout
    name = f"_baseline_policies_{len(sys.modules)}"
    module = ModuleType(name)
    module.__file__ = f"{rev}:scheduler/policies.py"
    sys.modules[name] = module  # dataclasses look their module up
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


def bench_mixed(
    snap: ClusterSnapshot, specs: list[TaskSpec], live_cap: int, baseline: ModuleType | None = None,
    label: str = "",
) -> dict[str, dict]:
    """Mixed-shape decisions with load_aware; percentiles overall and per GPU
    count. ``baseline``: a policies module (``baseline_policies``) whose
    ``choose`` is timed on the same decisions as today's, in turns (first one,
    then the other), with the same placement checked; rows ``kN choose`` and
    ``kN choose @label``."""
    config = SchedulerConfig()
    reservations = Reservations()
    view = PlacementView(snap, reservations, config)
    policy = make_policy("load_aware")
    old = baseline.make_policy("load_aware") if baseline is not None else None
    times: dict[int, list[float]] = {1: [], 2: [], 4: []}
    chosen: dict[tuple[int, bool], list[float]] = {}
    placed = {1: 0, 2: 0, 4: 0}
    live: list[str] = []
    for i, spec in enumerate(specs):
        if len(live) >= live_cap:  # steady state: the oldest lease ends (untimed)
            view.refresh(reservations.release(live.pop(0)))
        if old is not None:
            mask = feasible(view, spec, config)
            turns = [(False, policy), (True, old)] if i % 2 else [(True, old), (False, policy)]
            found = {}
            for is_old, p in turns:
                t0 = timer()
                found[is_old] = p.choose(view, spec, mask)
                chosen.setdefault((spec.num_gpus, is_old), []).append(timer() - t0)
            same = lambda p: None if p is None else (p.rows, p.score)  # noqa: E731 (two Placement classes)
            if same(found[True]) != same(found[False]):
                raise AssertionError(f"decision {i}: {found[False]} != baseline {found[True]}")
        t0 = timer()
        mask = feasible(view, spec, config)
        placement = policy.choose(view, spec, mask)
        if placement is not None:
            used = [float(view.used[r]) for r in placement.rows]
            reservations.add(f"l{i}", placement.gpu_uuids, spec.vram_mib, 100 * spec.gpu_share, used)
            view.refresh(placement.gpu_uuids)
            policy.commit(view, placement)
        elapsed = timer() - t0
        if placement is not None:
            live.append(f"l{i}")
            placed[spec.num_gpus] += 1
        times[spec.num_gpus].append(elapsed)
    out: dict[str, dict] = {}
    every = [t for ts in times.values() for t in ts]
    p50, p99, worst = percentiles(every)
    out["mixed"] = {"p50_us": p50, "p99_us": p99, "max_us": worst, "placed": sum(placed.values())}
    for k, ts in times.items():
        if ts:
            p50, p99, worst = percentiles(ts)
            out[f"mixed k{k}"] = {"p50_us": p50, "p99_us": p99, "max_us": worst, "placed": placed[k]}
    for (k, is_old), ts in sorted(chosen.items()):
        p50, p99, worst = percentiles(ts)
        name = f"k{k} choose @{label}" if is_old else f"k{k} choose"
        out[name] = {"p50_us": p50, "p99_us": p99, "max_us": worst, "placed": placed[k]}
    return out


def bench_never_fits(snap: ClusterSnapshot, specs: list[TaskSpec], every: int = 200) -> dict:
    """never_fits per submit; a new snapshot object (same static columns) every ``every``."""
    config = SchedulerConfig()
    times = []
    current = snap
    for i, spec in enumerate(specs):
        if i % every == 0:
            current = dataclasses.replace(snap, taken_at_s=float(i))
        t0 = timer()
        never_fits(current, spec, config)
        times.append(timer() - t0)
    p50, p99, worst = percentiles(times)
    return {"p50_us": p50, "p99_us": p99, "max_us": worst, "placed": 0}


def bench_view_rebuild(snap: ClusterSnapshot, repeats: int = 5) -> float:
    """ms to build the view of a new snapshot sharing the static columns (a metrics tick)."""
    config = SchedulerConfig()
    PlacementView(snap, Reservations(), config)
    times = []
    for i in range(repeats):
        fresh = dataclasses.replace(snap, taken_at_s=float(i + 1))
        t0 = timer()
        view = PlacementView(fresh, Reservations(), config)
        view.label_mask({"zone": "z1"})  # what the first labelled task then pays
        times.append(timer() - t0)
    return float(np.median(times) * 1e3)


def bench_dispatch(snap: ClusterSnapshot, tasks: int) -> dict:
    clock = [0.0]
    sched = Scheduler(clock=lambda: clock[0])
    sched.dispatch(snap)  # builds the view once, like a metrics tick would
    for i in range(tasks):
        sched.submit(TaskSpec(f"t{i}", vram_mib=2048, gpu_share=0.1, priority=i % 4))
    t0 = timer()
    placed = sched.dispatch(snap)
    elapsed = timer() - t0
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
        t0 = timer()
        PlacementView(snap, reservations, config)
        times.append(timer() - t0)
    return float(np.median(times) * 1e3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1000, 5000])
    parser.add_argument("--decisions", type=int, default=2000)
    parser.add_argument("--dispatch-tasks", type=int, default=1000)
    parser.add_argument("--policies", nargs="+", default=["load_aware", "binpack", "round_robin",
                                                          "least_connections", "weighted_round_robin"])
    parser.add_argument("--mixed-decisions", type=int, default=4000)
    parser.add_argument("--live-leases", type=int, default=1000, help="mixed: live leases kept")
    parser.add_argument("--only-mixed", action="store_true", help="skip the per-policy rows")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="wall: perf_counter; cpu: thread CPU time (ignores preemption)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run everything N times; report per row the run with the lowest p99")
    parser.add_argument("--baseline", metavar="REV",
                        help="mixed: also time Policy.choose of scheduler/policies.py at git REV on the same "
                             "decisions (rows 'kN choose' and 'kN choose @REV')")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    global timer
    timer = time.thread_time if args.clock == "cpu" else time.perf_counter
    from scheduler import setsearch

    jit_s = setsearch.warm()  # compiling is not a decision
    runs = [measure(args) for _ in range(max(args.repeat, 1))]
    rows = []
    for same in zip(*runs):
        rows.append(min(same, key=lambda r: (r["p99_us"] if r["p99_us"] is not None else r["p50_us"])))
    for r in rows:
        r["clock"] = args.clock
        r["repeat"] = max(args.repeat, 1)
        r["set_search"] = "compiled" if jit_s is not None else "numpy"

    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    report(rows, args)
    return 0


def measure(args: argparse.Namespace) -> list[dict]:
    single = TaskSpec("bench", vram_mib=2048, gpu_share=0.1)
    multi = TaskSpec("bench4", vram_mib=2048, gpu_share=0.1, num_gpus=4)
    rows = []
    specs = mixed_specs(args.mixed_decisions)
    for nodes in args.nodes:
        mixed_snap = make_mixed_snapshot(nodes)
        view_ms = bench_view(mixed_snap, reserved=False)
        view_reserved_ms = bench_view(mixed_snap, reserved=True)
        rebuild_ms = bench_view_rebuild(mixed_snap)
        base = {"nodes": nodes, "gpus": mixed_snap.gpu_count, "policy": "load_aware",
                "view_build_ms": view_ms, "view_build_reserved_ms": view_reserved_ms}
        baseline = baseline_policies(args.baseline) if args.baseline else None
        for shape, result in bench_mixed(mixed_snap, specs, args.live_leases, baseline, args.baseline).items():
            k = re.search(r"\bk(\d+)\b", shape)
            rows.append({**base, "shape": shape, "num_gpus": int(k.group(1)) if k else 0,
                         **result})
        rows.append({**base, "policy": "-", "shape": "submit(never_fits)", "num_gpus": 0,
                     **bench_never_fits(mixed_snap, specs)})
        rows.append({**base, "policy": "-", "shape": "view rebuild", "num_gpus": 0,
                     "p50_us": rebuild_ms * 1e3, "p99_us": None, "max_us": None, "placed": 0})
        if args.only_mixed:
            continue
        snap = make_snapshot(nodes)
        view_ms = bench_view(snap, reserved=False)
        view_reserved_ms = bench_view(snap, reserved=True)
        for name in args.policies:
            result = bench_decisions(snap, name, args.decisions, single)
            rows.append({"nodes": nodes, "gpus": snap.gpu_count, "policy": name, "shape": "k1",
                         "num_gpus": 1, "view_build_ms": view_ms, "view_build_reserved_ms": view_reserved_ms, **result})
        result = bench_decisions(snap, "load_aware", max(args.decisions // 4, 50), multi)
        rows.append({"nodes": nodes, "gpus": snap.gpu_count, "policy": "load_aware", "shape": "k4",
                     "num_gpus": 4,
                     "view_build_ms": view_ms, "view_build_reserved_ms": view_reserved_ms, **result})
        dispatch = bench_dispatch(snap, args.dispatch_tasks)
        rows.append({"nodes": nodes, "gpus": snap.gpu_count, "policy": "dispatch(load_aware)",
                     "shape": "k1", "num_gpus": 1, "view_build_ms": view_ms, "view_build_reserved_ms": view_reserved_ms,
                     "p50_us": dispatch["per_task_us"],
                     "p99_us": None, "max_us": None, "placed": dispatch["placed"]})
    return rows


def report(rows: list[dict], args: argparse.Namespace) -> None:
    header = (
        f"{'nodes':>6} {'gpus':>6} {'policy':<22} {'shape':<19} {'p50 us':>8} {'p99 us':>8} "
        f"{'max us':>8} {'placed':>6} {'view ms':>8} {'view+res ms':>11}"
    )
    print(header)
    print("-" * len(header))
    def us(value: float | None) -> str:
        return f"{value:>8.1f}" if value is not None else f"{'-':>8}"

    for r in rows:
        print(f"{r['nodes']:>6} {r['gpus']:>6} {r['policy']:<22} {r['shape']:<19} {us(r['p50_us'])} "
              f"{us(r['p99_us'])} {us(r['max_us'])} {r['placed']:>6} {r['view_build_ms']:>8.2f} "
              f"{r['view_build_reserved_ms']:>11.2f}")
    print("decision = filters.feasible + Policy.choose + Reservations.add + PlacementView.refresh")
    print("dispatch(load_aware): p50 column = wall time of one dispatch / tasks placed")
    print("view ms: building the per-snapshot view; view+res ms: the same with every GPU leased")
    print("mixed: 70 % k1, 20 % k2 (1/3 needs_nvlink), 10 % k4, 10 % required zone, 10 % preferred rack")
    print("submit(never_fits): the never-fits check per submit; view rebuild: p50 column = us to build")
    print("the view of a new snapshot sharing the static columns, plus one label mask")
    if args.baseline:
        print(f"kN choose: Policy.choose alone, today's and @{args.baseline}'s in turns on the same decisions")
    print(f"clock: {args.clock}; repeat: {max(args.repeat, 1)} (per row the run with the lowest p99); "
          f"multi-GPU set search: {rows[0]['set_search'] if rows else '-'} (GPULB_NO_JIT=1: numpy)")


if __name__ == "__main__":
    raise SystemExit(main())
