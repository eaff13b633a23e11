"""Learning benchmark: speed prediction on versus off, and the rebalance
advisor on versus off, in the simulator on the openb traces.

Run from the repository root::

    .venv/bin/python benchmarks/bench_learning.py [--seeds 3] [--quick] [--json]

What it does (all on a virtual clock, see ``scheduler/simulator.py``):

1. converts the openb pod lists (default, gpushare40) from
   ``../shared/traces/alibaba-openb`` into a temporary folder and keeps the
   tasks from the first percentile of submissions on (openb's first 1 %
   trickle in over 115 days before the 34 busy ones);
2. **prediction** on the *mixed cluster*: 12 nodes x 4 GPUs, RTX 4090 (speed
   1.0), M40 (0.12) and K20c-class (0.05, with 24 GiB so that memory is not
   what sets it apart) interleaved node by node (no model is favoured by the
   scheduler's lowest-row tie-break), each trace at its own pace. Three arms,
   policy load_aware: prediction off; on with the cluster file's speeds as
   priors; on with no priors at all (every model starts at 1.0 and is
   learned from completions). Figure: mean P0 response time (submission to
   completion of real-time inference tasks);
3. **the advisor** on 8 x 4 RTX 4090 and on the mixed cluster, the first
   2,000 busy tasks of the gpushare40 trace (GPU sharing, so a GPU carries
   several tasks and load can be evened out by moving some; the whole trace
   compressed onto 32 GPUs queues for days and takes many minutes a run),
   arrivals compressed (x6 on 8x4, x3 on the mixed cluster) so that GPUs are
   busy, and load drifting after placement
   (``SimConfig.util_drift`` 0.5: each task's utilisation walks over its
   phases of work). Arms: advisor off; on with its defaults (variance above
   400 %², then held down to 100 %² once a plan came of it, 2 moves a
   minute, 30 s checkpoint-and-restart cost per migration); on with a
   tighter trigger (variance above 100 %²). On the mixed cluster prediction
   is on in every arm. A third, synthetic scenario
   shows the advisor where the work allows it: a training cluster (8 x 4 RTX
   4090, 320 single-GPU training tasks sharing GPUs, 20-50 % each, 2-8 h,
   Poisson arrivals over a day, about 65 % mean load, the same drift): in the
   openb traces most hot GPUs hold only work that may not move (P0 inference
   is 58 % of openb's tasks) or one whole-GPU task (moving it moves the hot
   spot). Every scenario places with load_aware, which already evens the
   GPUs as it places; the training cluster is replayed twice more, placed
   by round_robin (blind to load) and by binpack (consolidating, as an
   operator keeping whole GPUs free would), because how much the advisor
   can remove depends on how uneven placement left the GPUs (the seeds'
   "before", 38.2 %, is about as uneven as binpack leaves them). Figures: standard deviation of
   GPU utilisation (across GPUs, at each moment, averaged over the window),
   the largest load difference between GPUs (hottest minus coolest, averaged
   over 600 samples of the window), the share of the window with the
   variance above 400 %², and mean response times as the cost side; next to
   them, what a free and instant rebalancer could reach with the same work
   at each sample (``BoundProbe``: the movable single-GPU tasks re-dealt by
   greedy LPT within each GPU's real memory), the reference for how much of the imbalance
   moving tasks can remove at all;
4. **the advisor beside big cards** (``bigcards``): the openb default trace
   (``--big-card-traces`` for others) on the openb cluster itself (its 6,212 GPUs, 516 of them the G3 and
   V100M32 cards with 32-80 GiB against 24 GiB or less elsewhere), arrivals
   x1000 as ``bench_simulate`` replays it, load drifting as above. Arms:
   advisor off; on (defaults, so rule 8 ``keep_big_cards`` on); on with
   ``keep_big_cards`` off. Placement keeps work that the other cards hold
   off the big ones (load_aware's ``big_cards`` term), so those are often
   the coolest GPUs and a rebalancer without rule 8 fills them. Figures:
   migrations, how many landed on a big card, how many of those moved work
   whose need (its ask times its kind's largest learned growth, what the
   rule judges by) the other cards hold, OOM kills, evictions for P0 work,
   mean response;
5. prints each table, then our figures next to the seeds' claims.

Every figure is the mean over ``--seeds`` runs (seeds 0, 1, ...: the memory
draws and the load drift); the per-seed values are in the JSON. Placement on a
busy mixed cluster is chaotic (one early placement changes everything after
it), so single runs swing by 10-20 %: use at least 3 seeds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from coordinator.tables import fmt, render_table  # noqa: E402
from scheduler.advisor import AdvisorConfig, is_movable  # noqa: E402
from scheduler.cluster import ClusterNode, convert_openb_nodes, homogeneous, lookup_model  # noqa: E402
from scheduler.config import SchedulerConfig  # noqa: E402
from scheduler.memgrowth import largest_growth  # noqa: E402
from scheduler.scoring import big_card_sizes  # noqa: E402
from scheduler.simreport import figures, json_safe  # noqa: E402
from scheduler.simulator import SimConfig, Simulation  # noqa: E402
from scheduler.task import Priority  # noqa: E402
from scheduler.traces import TraceTask, convert_openb, scale_trace  # noqa: E402

# busy tasks of the gpushare40 trace the advisor scenarios replay
ADVISOR_TASKS = 2_000

# arrivals of the openb trace on the openb cluster, as bench_simulate replays it
OPENB_ARRIVAL_SCALE = 1000.0

# Placements that leave the load uneven, under which the training cluster is
# replayed too: round_robin ignores load, binpack consolidates (the advisor
# is judged against what placement left it, module docstring)
PLACEMENTS_WITHOUT_LOAD = ("round_robin", "binpack")

# The seeds' reported figures (before, after).
SEED_P0_RESPONSE_MS = (142.0, 89.0)
SEED_UTIL_STD_PCT = (38.2, 12.7)
SEED_LARGEST_DIFF_PCT = (70.0, 20.0)


def _openb_dir() -> Path:
    env = os.environ.get("GPULB_TRACES")
    base = Path(env) if env else ROOT.parent / "shared" / "traces"
    return base / "alibaba-openb"


def mixed_cluster(groups: int = 4, gpus: int = 4) -> list[ClusterNode]:
    """RTX 4090, M40 and K20c-class nodes, interleaved: node-00 4090, node-01 M40, node-02 K20c, ..."""
    nodes = []
    for i in range(groups):
        for j, key in enumerate(("RTX 4090", "M40", "K20c")):
            m = lookup_model(key)
            assert m is not None
            # a K20c has 4.8 GB: give the class 24 GiB so only speed sets it apart
            vram = 24_576.0 if key == "K20c" else m.memory_mib
            nodes.append(ClusterNode(f"node-{3 * i + j:02d}", gpus, m.name, vram, m.speed, key))
    return nodes


def busy_part(tasks: list[TraceTask], limit: int = 0) -> list[TraceTask]:
    """Tasks from the first percentile of submissions on, times from 0; the first ``limit``."""
    ordered = sorted(tasks, key=lambda t: t.submit_s)
    part = ordered[len(ordered) // 100 :]
    if limit:
        part = part[:limit]
    t0 = part[0].submit_s
    return [replace(t, submit_s=t.submit_s - t0) for t in part]


def training_cluster(count: int = 320, seed: int = 5) -> list[TraceTask]:
    """The synthetic training workload of the advisor's third scenario (module docstring)."""
    rng = np.random.default_rng(seed)
    tasks = []
    t = 0.0
    for i in range(count):
        t += float(rng.exponential(3600.0 / 13.4))  # 13.4 arrivals an hour
        share = float(rng.choice([0.2, 0.25, 0.3, 0.4, 0.5]))
        tasks.append(TraceTask(f"train-{i:04d}", t, float(rng.uniform(2, 8)) * 3600.0, 1, share * 0.8 * 16_384,
                               share, Priority.P1, "training"))
    return tasks


def p0_response(r) -> float:
    done = [x.jct_s for x in r.records if x.priority == 0 and x.state == "completed"]
    return float(np.mean(done)) if done else math.nan


class BoundProbe(Simulation):
    """The simulation, plus at each utilisation sample what a free, instant
    rebalancer could reach at that moment: every movable single-GPU run (the
    advisor's rules: ``is_movable`` by kind and flag) re-dealt over the GPUs
    by greedy longest-processing-time (largest load onto the least-loaded
    GPU that has real memory left for it), every other run left where it is,
    utilisation capped at 100 %. Greedy LPT is within 4/3 of the best
    possible largest load, so this is a reference for how even the current
    work *could* be, not a hard floor; the advisor pays a restart per move,
    keeps the scheduler's 85 % memory headroom and only moves what its rules
    allow."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.bound_std: list[float] = []
        self.bound_spread: list[float] = []
        self._rules = AdvisorConfig()

    def _sample(self) -> None:
        super()._sample()
        fixed = np.zeros(len(self._util))
        room = np.asarray(self._cap, dtype=np.float64)  # MiB of real memory left per GPU
        movable: list[tuple[float, float, int]] = []  # (load %, real MiB, GPU it is on)
        for run in self._running.values():
            load = run.utils[run.phase] if run.utils else run.util
            mem = run.mem[min(run.phase, len(run.mem) - 1)]
            task = self.sched.get(run.run_id)
            if len(run.rows) == 1 and task is not None and is_movable(task, self._rules):
                movable.append((load, mem, run.rows[0]))
            else:
                fixed[list(run.rows)] += load
                room[list(run.rows)] -= mem
        load_now = fixed.copy()
        # largest first onto the least-loaded GPU with memory room for it
        # (where it is, if no GPU has: then it stays, as a move could not happen)
        for load, mem, home in sorted(movable, reverse=True):
            fits = np.flatnonzero(room >= mem)
            i = int(fits[np.argmin(load_now[fits])]) if fits.size else home
            load_now[i] += load
            room[i] -= mem
        util = np.minimum(load_now, 100.0)
        self.bound_std.append(float(np.std(util)))
        self.bound_spread.append(float(util.max() - util.min()))


class BigCardMoves(Simulation):
    """The simulation, counting the advisor's migrations that land on a big
    card (``scheduler.scoring.big_card_sizes`` over the real capacities,
    the scheduler's ``big_card_share``) and, of those, the ones whose task
    the other cards hold: its ask times its kind's largest learned growth
    in the snapshot the plan came of, as rule 8 judges it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.onto_big = 0
        self.onto_big_needless = 0
        self._sizes = big_card_sizes(np.asarray(self._cap, dtype=np.float64), self.sched.config.big_card_share)

    def _migrate(self, run, to_gpu_uuids, snap) -> bool:
        moved = super()._migrate(run, to_gpu_uuids, snap)
        if moved and self._sizes is not None and self._cap[self._row_of[to_gpu_uuids[0]]] >= self._sizes[0]:
            self.onto_big += 1
            task = self.tasks[run.idx]
            if run.ask * largest_growth(snap.memory_growth, task.kind) <= self._sizes[1]:
                self.onto_big_needless += 1
        return moved


def run_arm(tasks, nodes, cfg: SimConfig, seeds: int, variance_bound: float, *, bound: bool = False,
            policy: str = "load_aware", big_cards: bool = False) -> dict:
    """One arm over ``seeds`` seeds, placing with ``policy``: per-seed figures
    and their means (with ``bound``, also ``BoundProbe``'s free-rebalancer
    figures; with ``big_cards``, ``BigCardMoves``' counts)."""
    per_seed = []
    for seed in range(seeds):
        probe = BoundProbe if bound else BigCardMoves if big_cards else Simulation
        sim = probe(tasks, nodes, policy, replace(cfg, seed=seed))
        r = sim.run()
        f = figures(r)
        heat = np.asarray(r.heatmap, dtype=np.float64)
        over = float(np.mean(heat.var(axis=1) > variance_bound)) if heat.size else math.nan
        per_seed.append(
            {
                "seed": seed,
                "p0_response_s": p0_response(r),
                "jct_mean_s": f["jct_mean_s"],
                "slowdown_mean": f["slowdown"]["mean"],
                "wait_mean_s": f["wait_s"]["all"]["mean"],
                "p0_wait_s": f["wait_s"]["P0"]["mean"],
                "util_mean": f["util_mean"],
                "util_std": f["util_std"],
                "util_std_inst": f["util_std_inst"],
                "util_spread": f["util_spread"],
                "util_spread_p95": f["util_spread_p95"],
                "util_spread_means": f["util_spread_means"],
                "time_over_variance_bound": over,
                "plans": f["plans"],
                "migrations": f["migrations"],
                "prediction_mape": f["prediction_mape"],
                "oom_kills": f["oom_kills"],
                "preemptions": f["preemptions"],
                "sla_misses": f["sla_misses"],
                "completed": f["completed"],
                "wall_s": r.wall_s,
            }
        )
        if bound:
            per_seed[-1]["bound_util_std"] = float(np.mean(sim.bound_std)) if sim.bound_std else math.nan
            per_seed[-1]["bound_util_spread"] = float(np.mean(sim.bound_spread)) if sim.bound_spread else math.nan
        if big_cards:
            per_seed[-1]["onto_big_cards"] = sim.onto_big
            per_seed[-1]["onto_big_cards_needless"] = sim.onto_big_needless
    keys = [k for k in per_seed[0] if k != "seed"]
    mean = {k: float(np.nanmean([s[k] for s in per_seed])) if any(s[k] == s[k] for s in per_seed) else math.nan for k in keys}
    return {"mean": mean, "per_seed": per_seed}


def _change(before: float, after: float) -> str:
    if not (before and before == before and after == after):
        return "-"
    return f"{(after / before - 1) * 100:+.0f}%"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=3, help="runs per arm, seeds 0..N-1 (default 3)")
    p.add_argument("--quick", action="store_true", help="one seed, the first 2,000 busy tasks of each trace")
    p.add_argument("--json", action="store_true", help="print the figures as JSON (tables go to stderr)")
    p.add_argument("--json-out", help="also write the JSON here")
    p.add_argument("--skip", default="", help="comma list of parts to skip: prediction,advisor,bigcards")
    p.add_argument("--big-card-traces", default="default",
                   help="comma list of openb traces the bigcards part replays on the openb cluster "
                        "(default: default; each costs 3 arms x seeds runs of ~25 s)")
    p.add_argument(
        "--backfill-estimate-factor", type=float, default=SchedulerConfig().backfill_estimate_factor,
        help="the scheduler's backfill_estimate_factor in every arm (default: the scheduler's, 2; 0 turns it off)",
    )
    args = p.parse_args(argv)
    seeds = 1 if args.quick else max(1, args.seeds)
    limit = 2_000 if args.quick else 0
    skip = set(filter(None, args.skip.split(",")))
    sched_cfg = SchedulerConfig(backfill_estimate_factor=args.backfill_estimate_factor)
    sched_cfg.validate()
    out = sys.stderr if args.json else sys.stdout
    started = time.perf_counter()
    doc: dict = {"seeds": seeds, "quick": args.quick, "backfill_estimate_factor": args.backfill_estimate_factor,
                 "prediction": [], "advisor": [], "big_cards": []}
    src = _openb_dir()

    def say(text: str = "") -> None:
        print(text, file=out, flush=True)

    with tempfile.TemporaryDirectory(prefix="gpulb-learning-") as tmp:
        traces = {}
        for name in ("default", "gpushare40"):
            tasks, stats = convert_openb(src / f"openb_pod_list_{name}.csv", Path(tmp) / f"{name}.csv")
            traces[name] = busy_part(tasks, limit)
            say(f"# {name}: {stats.summary()}; {len(traces[name]):,} tasks from the first percentile on")
        mixed = mixed_cluster()
        say(f"# mixed cluster: {len(mixed)} nodes x 4 GPUs: RTX 4090 (1.0), M40 (0.12), K20c-class (0.05), interleaved")
        say()

        pred_rows = []
        if "prediction" not in skip:
            arms = [
                ("off", SimConfig(prediction=False, scheduler=sched_cfg)),
                ("on, cluster-file priors", SimConfig(prediction=True, scheduler=sched_cfg)),
                ("on, learned from scratch", SimConfig(prediction=True, prediction_prior="none", scheduler=sched_cfg)),
            ]
            for trace in ("default", "gpushare40"):
                title = f"openb {trace} on the mixed cluster, own pace"
                say(f"## prediction: {title}")
                results = {}
                for arm, cfg in arms:
                    results[arm] = run_arm(traces[trace], mixed, cfg, seeds, 400.0)
                base = results["off"]["mean"]
                rows = []
                for arm, res in results.items():
                    m = res["mean"]
                    rows.append([
                        arm, fmt(m["p0_response_s"], 0, " s"), _change(base["p0_response_s"], m["p0_response_s"]),
                        fmt(m["jct_mean_s"], 0, " s"), _change(base["jct_mean_s"], m["jct_mean_s"]),
                        fmt(m["p0_wait_s"], 0, " s"), fmt(100 * m["prediction_mape"], 1, "%"),
                        fmt(sum(s["wall_s"] for s in res["per_seed"]), 0, " s"),
                    ])
                say(render_table(
                    ["prediction", "mean P0 response", "change", "mean response (all)", "change", "mean P0 wait",
                     "MAPE", "wall"],
                    rows, align="lrrrrrrr",
                ))
                say()
                doc["prediction"].append({"title": title, "trace": trace, "arms": results})
                on = results["on, cluster-file priors"]["mean"]
                learned = results["on, learned from scratch"]["mean"]
                pred_rows.append((title, base["p0_response_s"], on["p0_response_s"], learned["p0_response_s"]))

        adv_rows = []
        if "advisor" not in skip:
            advisor_default = AdvisorConfig()
            advisor_tight = AdvisorConfig(variance_threshold=100.0)
            default_arm = (f"on (variance > {advisor_default.variance_threshold:g} %², "
                           f"held to {advisor_default.release_level:g})")
            share = traces["gpushare40"][:ADVISOR_TASKS]
            training = training_cluster()  # one workload, replayed under each placement
            # (title, tasks, cluster, arrival scale, prediction, placement policy)
            scenarios = [
                ("openb gpushare40 on 8x4 RTX 4090, arrivals x6, load drift 0.5", share, homogeneous(8, 4), 6.0, False,
                 "load_aware"),
                ("openb gpushare40 on the mixed cluster, arrivals x3, load drift 0.5, prediction on", share, mixed, 3.0,
                 True, "load_aware"),
                ("synthetic training cluster on 8x4 RTX 4090, load drift 0.5", training, homogeneous(8, 4),
                 1.0, False, "load_aware"),
            ] + [
                (f"synthetic training cluster on 8x4 RTX 4090, load drift 0.5, placed by {policy}", training,
                 homogeneous(8, 4), 1.0, False, policy)
                for policy in PLACEMENTS_WITHOUT_LOAD
            ]
            for title, trace_tasks, nodes, arrival, prediction, policy in scenarios:
                say(f"## advisor: {title}")
                tasks = scale_trace(trace_tasks, 1.0, arrival)
                base_cfg = SimConfig(heatmap_samples=600, util_drift=0.5, prediction=prediction, scheduler=sched_cfg)
                arms = [
                    ("off", base_cfg),
                    (default_arm, replace(base_cfg, advisor=advisor_default)),
                    ("on (variance > 100 %²)", replace(base_cfg, advisor=advisor_tight)),
                ]
                results = {arm: run_arm(tasks, nodes, cfg, seeds, advisor_default.variance_threshold, bound=arm == "off",
                                        policy=policy)
                           for arm, cfg in arms}
                base = results["off"]["mean"]
                rows = []
                for arm, res in results.items():
                    m = res["mean"]
                    rows.append([
                        arm, fmt(m["util_std_inst"], 1, "%"), _change(base["util_std_inst"], m["util_std_inst"]),
                        fmt(m["util_spread"], 1, "%"), _change(base["util_spread"], m["util_spread"]),
                        fmt(100 * m["time_over_variance_bound"], 0, "%"), fmt(m["util_std"], 1, "%"),
                        fmt(m["migrations"], 0), fmt(m["jct_mean_s"], 0, " s"), fmt(m["slowdown_mean"], 2),
                        fmt(m["wait_mean_s"], 0, " s"), fmt(m["p0_response_s"], 0, " s"),
                        fmt(sum(s["wall_s"] for s in res["per_seed"]), 0, " s"),
                    ])
                rows.append([
                    "bound: free, instant re-deal", fmt(base["bound_util_std"], 1, "%"),
                    _change(base["util_std_inst"], base["bound_util_std"]), fmt(base["bound_util_spread"], 1, "%"),
                    _change(base["util_spread"], base["bound_util_spread"]), "-", "-", "-", "-", "-", "-", "-", "-",
                ])
                # mean response is ruled by the few multi-day tasks and where they land (one run
                # swings it by half); mean slowdown and wait say what moving work costs
                say(render_table(
                    ["advisor", "util std", "change", "largest difference", "change", "time var > 400",
                     "std of GPU means", "migrations", "mean response", "mean slowdown", "mean wait",
                     "mean P0 response", "wall"],
                    rows, align="lrrrrrrrrrrrr",
                ))
                say()
                doc["advisor"].append({"title": title, "arrival_scale": arrival, "policy": policy, "arms": results})
                on = results[default_arm]["mean"]
                tight = results["on (variance > 100 %²)"]["mean"]
                adv_rows.append((title, base, on, tight))

        if "bigcards" not in skip:
            openb_nodes = convert_openb_nodes(src / "openb_node_list_gpu_node.csv", Path(tmp) / "openb_cluster.csv")
            gpus = sum(n.gpus for n in openb_nodes)
            for trace in filter(None, args.big_card_traces.split(",")):
                tasks, _ = convert_openb(src / f"openb_pod_list_{trace}.csv", Path(tmp) / f"{trace}-all.csv")
                if limit:
                    tasks = busy_part(tasks, limit)
                tasks = scale_trace(tasks, 1.0, OPENB_ARRIVAL_SCALE)
                title = f"openb {trace} on the openb cluster ({gpus:,} GPUs), arrivals x{OPENB_ARRIVAL_SCALE:g}, load drift 0.5"
                say(f"## advisor beside big cards: {title}")
                base_cfg = SimConfig(util_drift=0.5, scheduler=sched_cfg)
                arms = [
                    ("off", base_cfg),
                    ("on (keep_big_cards, the default)", replace(base_cfg, advisor=AdvisorConfig())),
                    ("on, keep_big_cards = false", replace(base_cfg, advisor=AdvisorConfig(keep_big_cards=False))),
                ]
                results = {arm: run_arm(tasks, openb_nodes, cfg, seeds, AdvisorConfig().variance_threshold,
                                        big_cards=True)
                           for arm, cfg in arms}
                rows = []
                for arm, res in results.items():
                    m = res["mean"]
                    rows.append([
                        arm, fmt(m["migrations"], 1), fmt(m["onto_big_cards"], 1),
                        fmt(m["onto_big_cards_needless"], 1), fmt(m["oom_kills"], 1), fmt(m["preemptions"], 0),
                        fmt(sum(s["sla_misses"] for s in res["per_seed"])), fmt(m["jct_mean_s"] / 3600, 3, " h"),
                        fmt(m["util_std"], 2, "%"), fmt(sum(s["wall_s"] for s in res["per_seed"]), 0, " s"),
                    ])
                say(render_table(
                    ["advisor", "migrations", "onto a big card", "of which the other cards hold it", "OOM kills",
                     "evicted for P0", "P0 SLA misses", "mean response", "std of GPU means", "wall"],
                    rows, align="lrrrrrrrrr",
                ))
                say()
                doc["big_cards"].append({"title": title, "trace": trace, "arrival_scale": OPENB_ARRIVAL_SCALE,
                                         "arms": results})

    say("## side by side with the seeds (ours: mean over seeds)")
    rows = [["mean P0 response time", "seeds", fmt(SEED_P0_RESPONSE_MS[0], 0, " ms"), fmt(SEED_P0_RESPONSE_MS[1], 0, " ms"),
             _change(*SEED_P0_RESPONSE_MS)]]
    for title, off, on, learned in pred_rows:
        rows.append(["", title + " (cluster-file priors)", fmt(off, 0, " s"), fmt(on, 0, " s"), _change(off, on)])
        rows.append(["", title + " (learned from scratch)", fmt(off, 0, " s"), fmt(learned, 0, " s"), _change(off, learned)])
    # per advisor figure: its label, the seeds' (before, after) and digits, its key and its bound's key
    # (the std of GPU means is how bench_simulate reads the same seeds' figure, and the
    # difference of GPU means reads the largest difference the same way; both average
    # away the imbalance of each moment the advisor is for, so the instantaneous ones lead)
    advisor_figures = (
        ("std of GPU utilisation", SEED_UTIL_STD_PCT, 1, "util_std_inst", "bound_util_std"),
        ("largest load difference", SEED_LARGEST_DIFF_PCT, 0, "util_spread", "bound_util_spread"),
        ("std of GPU means", SEED_UTIL_STD_PCT, 1, "util_std", None),
        ("largest difference of GPU means", SEED_LARGEST_DIFF_PCT, 0, "util_spread_means", None),
    )
    for label, seed, digits, key, bound_key in advisor_figures:
        rows.append([label, "seeds", fmt(seed[0], digits, "%"), fmt(seed[1], digits, "%"), _change(*seed)])
        for title, off, on, tight in adv_rows:
            arms = [("", on[key]), (" (variance > 100)", tight[key])]
            if bound_key is not None:
                arms.append((" (bound: free, instant re-deal)", off[bound_key]))
            for suffix, value in arms:
                rows.append(["", title + suffix, fmt(off[key], 1, "%"), fmt(value, 1, "%"), _change(off[key], value)])
    say(render_table(["figure", "run", "off", "on", "change"], rows, align="llrrr"))
    say(f"\ntotal wall time {time.perf_counter() - started:.0f}s")
    clean = json_safe(doc)
    if args.json:
        json.dump(clean, sys.stdout, indent=1)
        sys.stdout.write("\n")
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump(clean, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
