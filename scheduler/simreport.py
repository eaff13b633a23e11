"""Figures of simulation runs, per policy and side by side: a plain-text table,
a JSON dict, and PNG plots when matplotlib is installed.

Definitions (every figure is computed from ``SimResult`` alone):

* **wait**: time a task spent queued, summed over its runs (a task killed for
  memory queues again); over every task placed at least once, per spec
  priority class and overall: mean, p50, p95, p99.
* **response time / JCT**: completion minus submission, completed tasks only.
* **slowdown**: max(JCT, 10 s) / max(duration_s, 10 s), the reference
  duration being the task alone on a speed-1.0 GPU: the bounded slowdown,
  whose 10 s floor keeps a 4-second task that waited a minute from
  dominating the mean, and applied to both terms, so a task shorter than it
  that neither waited nor shared reads 1 (it read duration / 10 s), while
  a task that a faster card finished sooner still reads below 1.
* **utilisation**: true per-GPU utilisation, time-weighted over the run's
  window (``SimResult.window_s``, see ``scheduler.simulator``). ``util_mean``
  is the mean over GPUs; ``util_var`` / ``util_std`` the variance and standard
  deviation across GPUs of their window means; ``util_std_inst`` the
  time-mean of the instantaneous standard deviation across GPUs (imbalance
  at each moment, which per-GPU means average away).
* **hottest**: the GPU (node) with the highest window-mean utilisation, and
  the share of the window that GPU spent at 90 % or more.
* **spread**: the largest load difference between GPUs, hottest minus
  coolest at each heat-map sample (``SimConfig.heatmap_samples`` evenly over
  the window); ``util_spread`` its mean over the samples, ``util_spread_p95``
  its 95th percentile; ``util_spread_means`` the same difference between
  the GPUs' window means (how ``util_std`` reads the std: it averages away
  the imbalance of each moment).
* **learning** (when on): rebalance ``plans`` and ``migrations`` carried
  out, and the predictor's ``prediction_mape`` (each completion predicted
  before it was learned from, over its last completions).
* **oom_kills** (``oom_kills_alone``: of those, tasks alone on their GPUs,
  which outgrew the card by themselves: no placement among the cards they
  fit on avoids those, only a bigger card; ``oom_kills_idle_room``: of
  runs that outgrew their own GPU by themselves (a co-tenant's memory not
  counted), those for which, when they were placed, some idle GPU had the
  memory they went on to reach: the kills a placement knowing each task's
  peak could have avoided without sharing a GPU; ``room_waits``:
  tasks that waited for a GPU with room for their kind's largest growth,
  ``room_waits_found``: of those, placed with it), **sla_misses** (P0
  tasks queued past the SLA, from the scheduler's own counter),
  **preemptions** (leases evicted for P0 tasks; ``preempted_work_h``: the
  GPU-hours, at reference speed, their runs redo),
  **throughput** (completed tasks per hour of makespan), **makespan** (last
  completion).
* **saturation** (when run): share of GPU capacity left unallocated when the
  first task does not fit, and when the arrived demand equals the GPU count.
* **floors** (``hottest_node_floor``, ``util_std_floor``, ``attach_floors``):
  the least hottest-node load and util std across GPUs that any placement of
  the run's tasks, started when that run started them, can reach (the
  second also without two whole-GPU tasks on one GPU): how far a policy is
  from the best its work allows, and which targets no policy can meet.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

import numpy as np

from coordinator.tables import fmt, render_table
from scheduler.simulator import SimResult

if TYPE_CHECKING:
    from scheduler.cluster import ClusterNode
    from scheduler.traces import TraceTask

__all__ = ["figures", "to_json", "json_safe", "render", "ratios", "plot", "hottest_node_floor", "NodeFloor",
           "util_std_floor", "attach_floors",
           "RATIO_KEYS", "SEED_CLAIMS"]

_CLASSES = ("P0", "P1", "P2", "P3")

# The seeds' reported load_aware vs round_robin results, as (round_robin, load_aware).
SEED_CLAIMS: dict[str, tuple[float, float]] = {
    "jct_mean_s": (1.0, 0.66),  # mean response time -34 %
    "oom_kills": (1.0, 0.14),  # -86 %
    "util_mean": (1.0, 1.28),  # +28 %
    "hottest_node_util": (98.0, 67.0),
    "util_std": (38.2, 12.7),
    "util_std_inst": (38.2, 12.7),  # the seeds do not say which std they meant
}
# figure -> (label, lower is better)
RATIO_KEYS: dict[str, tuple[str, bool]] = {
    "jct_mean_s": ("mean response time", True),
    "oom_kills": ("OOM kills", True),
    "util_mean": ("mean GPU util", False),
    "hottest_node_util": ("hottest node load", True),
    "util_std": ("GPU util std across GPUs", True),
    "util_std_inst": ("GPU util std, instantaneous", True),
}


def _pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if values.size else math.nan


def _stats(values: Sequence[float]) -> dict[str, float]:
    a = np.asarray(values, dtype=np.float64)
    return {
        "n": int(a.size),
        "mean": float(a.mean()) if a.size else math.nan,
        "p50": _pct(a, 50),
        "p95": _pct(a, 95),
        "p99": _pct(a, 99),
    }


#: s: the bounded slowdown's floor on both terms (module docstring)
_SLOWDOWN_FLOOR_S = 10.0


def figures(r: SimResult) -> dict[str, Any]:
    """Every figure of one run as a flat-ish dict (see the module docstring)."""
    recs = r.records
    placed = [x for x in recs if x.runs > 0]
    done = [x for x in recs if x.state == "completed"]
    wait = {"all": _stats([x.wait_s for x in placed])}
    for c, name in enumerate(_CLASSES):
        wait[name] = _stats([x.wait_s for x in placed if x.priority == c])
    jct = _stats([x.jct_s for x in done])
    slowdown = _stats([max(x.jct_s, _SLOWDOWN_FLOOR_S) / max(x.duration_s, _SLOWDOWN_FLOOR_S) for x in done])
    util = np.asarray(r.gpu_mean_util, dtype=np.float64)
    node_util = (
        np.bincount(r.gpu_node, weights=util, minlength=r.nodes) / np.maximum(np.bincount(r.gpu_node, minlength=r.nodes), 1)
        if util.size
        else np.zeros(0)
    )
    makespan = r.makespan_s
    heat = np.asarray(r.heatmap, dtype=np.float64)
    spread = heat.max(axis=1) - heat.min(axis=1) if heat.ndim == 2 and heat.size else np.zeros(0)
    out: dict[str, Any] = {
        "policy": r.policy,
        "tasks": len(recs),
        "completed": len(done),
        "dropped": sum(1 for x in recs if x.state == "dropped"),
        "rejected": sum(1 for x in recs if x.state == "rejected"),
        "unfinished": sum(1 for x in recs if x.state in ("unfinished", "pending")),
        "wait_s": wait,
        "jct_s": jct,
        "jct_mean_s": jct["mean"],
        "slowdown": slowdown,
        "window_s": r.window_s,
        "util_mean": float(util.mean()) if util.size else math.nan,
        "util_var": float(util.var()) if util.size else math.nan,
        "util_std": float(util.std()) if util.size else math.nan,
        "util_std_inst": r.util_std_time_mean,
        "hottest_gpu_util": float(util.max()) if util.size else math.nan,
        "hottest_node_util": float(node_util.max()) if node_util.size else math.nan,
        # the hottest GPU's (by its mean), as the row under it says, not any GPU's largest
        "hottest_gpu_time_above_90": float(r.gpu_hot_share[int(np.argmax(util))]) if util.size and r.gpu_hot_share.size
        else math.nan,
        "util_spread": float(spread.mean()) if spread.size else math.nan,
        "util_spread_p95": _pct(spread, 95),
        "util_spread_means": float(util.max() - util.min()) if util.size else math.nan,
        "plans": r.plans,
        "migrations": r.migrations,
        "prediction_mape": r.prediction_mape,
        "prediction_samples": r.prediction_samples,
        "memory_growth_samples": r.memory_growth_samples,
        "oom_kills": r.oom_kills,
        "oom_kills_alone": r.oom_kills_alone,
        "oom_kills_idle_room": r.oom_kills_idle_room,
        "room_waits": r.room_waits,
        "room_waits_found": r.room_waits_found,
        "preemptions": r.preemptions,
        "preempted_work_h": r.preempted_work_s / 3600.0,
        "sla_misses": r.sla_misses,
        "throughput_per_h": len(done) / (makespan / 3600.0) if makespan > 0 else math.nan,
        "makespan_s": makespan,
        "sim": {
            "wall_s": r.wall_s,
            "tasks_per_min": len(recs) / r.wall_s * 60.0 if r.wall_s > 0 else math.nan,
            "events": r.events,
            "dispatches": r.dispatches,
            "snapshots": r.snapshots,
        },
    }
    floors = r.meta.get("floors")
    if floors is not None:
        out["floors"] = dict(floors)
    if r.saturation is not None:
        s = r.saturation
        out["saturation"] = {
            "arrived_at_first_failure": s.arrived_at_first_failure,
            "unallocated_at_first_failure": s.unallocated_at_first_failure,
            "unallocated_at_full": s.unallocated_at_full,
            "idle_gpus_at_full": s.idle_gpus_at_full,
            "placed": s.placed,
            "failed": s.failed,
            "rejected": s.rejected,
            "first_failure_task": s.first_failure_task,
        }
    return out


def ratios(
    figs: Sequence[dict[str, Any]], base: str = "round_robin", other: str = "load_aware"
) -> dict[str, dict[str, float]]:
    """``other`` against ``base`` for the headline figures, next to the seeds' claim.

    ``ratio`` is other / base; ``seed_ratio`` what the seeds reported;
    ``beats_seed`` whether ours is the better of the two in the figure's
    direction (lower or higher is better). Empty if a policy is missing.
    """
    by = {f["policy"]: f for f in figs}
    if base not in by or other not in by:
        return {}
    out: dict[str, dict[str, float]] = {}
    for key, (label, lower_better) in RATIO_KEYS.items():
        b, o = by[base][key], by[other][key]
        ratio = o / b if b not in (0, 0.0) and b == b and o == o else math.nan
        entry: dict[str, Any] = {"label": label, base: b, other: o, "ratio": ratio}
        claim = SEED_CLAIMS.get(key)
        if claim is not None:
            seed = claim[1] / claim[0]
            entry["seed_ratio"] = seed
            if ratio == ratio:
                entry["beats_seed"] = ratio < seed if lower_better else ratio > seed
        out[key] = entry
    return out


@dataclass(frozen=True)
class NodeFloor:
    """The least window-mean utilisation the hottest node can have (``hottest_node_floor``)."""

    pct: float  # % of the node's GPU capacity over the window
    task_id: str  # the task that sets it ("" when none does)
    num_gpus: int
    node_gpus: int  # GPUs of the node shape that gives the least
    coverage: float  # share of the window the task runs there at the least


# task id -> (when it started, whether it ran once only): a run's own timeline
Starts = Mapping[str, "tuple[float, bool]"]


def _timeline(tasks: Sequence["TraceTask"], starts: Starts | None) -> Iterator[tuple["TraceTask", float, bool]]:
    """(task, start, ran once) for the tasks that ran: at submission without ``starts``."""
    for t in tasks:
        if starts is None:
            yield t, t.submit_s, True
            continue
        got = starts.get(t.task_id)
        if got is not None and math.isfinite(got[0]):
            yield t, got[0], got[1]


def _overlap(start: float, run_s: float, window_start: float, window_end: float) -> float:
    """Share of the window that [start, start + run_s] overlaps."""
    return max(0.0, min(start + run_s, window_end) - max(start, window_start)) / (window_end - window_start)


def hottest_node_floor(
    tasks: Sequence["TraceTask"],
    nodes: Sequence["ClusterNode"],
    window_start_s: float,
    window_s: float,
    starts: Starts | None = None,
) -> NodeFloor:
    """A floor under ``hottest_node_util`` that no placement can beat, when
    each task starts at its submission (any policy that starts work once it
    fits, on a cluster that is not full), or, with ``starts``, when a run
    started it (that run's own timeline; tasks that ran more than once are
    left out, which only lowers the result).

    A task on ``n`` GPUs runs on one node of ``G >= n`` GPUs, each of its GPUs
    at ``min(100, util)`` % or more (a co-tenant only adds) for at least
    ``duration / speed``: so that node's window mean is at least ``n / G *
    min(100, util) * coverage``, coverage being the share of the window that
    overlaps. Each task is given the node shape (GPUs, speed) that makes this
    least, every other constraint (memory, ``gpu_spec``, other tasks) ignored,
    which only lowers the result; the floor is the largest of these over the
    tasks. On the openb traces it is set by whole-node 8-GPU tasks that run
    through the window: a node at 100 % under any policy (README)."""
    end = window_start_s + window_s
    shapes = sorted({(n.gpus, n.speed) for n in nodes if n.gpus > 0 and n.speed > 0})
    best = NodeFloor(0.0, "", 0, 0, 0.0)
    if window_s <= 0 or not shapes:
        return best
    for t, start, once in _timeline(tasks, starts):
        if not once:
            continue
        util = min(100.0, t.util_pct)
        least: tuple[float, int, float] | None = None
        for gpus, speed in shapes:
            if gpus < t.num_gpus:
                continue
            coverage = _overlap(start, t.duration_s / speed, window_start_s, end)
            pct = t.num_gpus / gpus * util * coverage
            if least is None or pct < least[0]:
                least = (pct, gpus, coverage)
        if least is not None and least[0] > best.pct:
            best = NodeFloor(least[0], t.task_id, t.num_gpus, least[1], least[2])
    return best


def util_std_floor(
    tasks: Sequence["TraceTask"],
    nodes: Sequence["ClusterNode"],
    window_start_s: float,
    window_s: float,
    starts: Starts | None = None,
) -> float:
    """A floor (%) under ``util_std`` (the standard deviation across GPUs of
    their window-mean utilisation) for any placement that never runs two
    whole-GPU tasks on one GPU at once (none of gpulb's policies does while a
    GPU is free; stacking would slow both), each task started at its
    submission or, with ``starts``, when a run started it.

    Each GPU of a whole-GPU task (``gpu_share`` 1) that ran once carries a
    lump of ``min(100, util) * coverage`` on a GPU of its own, coverage taken
    at the fastest speed (the smallest lump). All other work is treated as
    divisible and poured where it evens the GPUs most (water-filling), at
    the most it can put in the window: ``util * min(duration / slowest speed,
    time left in the window)`` (a task's util-seconds are ``util * duration /
    speed`` whatever it shares), as are the lumps beyond one per GPU. Each
    relaxation only lowers the spread, so the result is a floor. On the openb
    traces whole-GPU tasks that run through the window keep it at
    0.64-0.71x round-robin's (README)."""
    gpus = sum(n.gpus for n in nodes)
    speeds = [n.speed for n in nodes if n.gpus > 0 and n.speed > 0]
    if window_s <= 0 or gpus == 0 or not speeds:
        return math.nan
    begin, end = window_start_s, window_start_s + window_s
    fastest, slowest = max(speeds), min(speeds)
    lumps: list[float] = []
    poured = 0.0
    for t, start, once in _timeline(tasks, starts):
        util = min(100.0, t.util_pct)
        if once and t.gpu_share >= 1.0:
            lumps.extend([util * _overlap(start, t.duration_s / fastest, begin, end)] * t.num_gpus)
        else:
            in_window = max(0.0, min(t.duration_s / slowest, end - max(start, begin)))
            poured += util * in_window / window_s * t.num_gpus
    lumps.sort(reverse=True)
    poured += sum(lumps[gpus:])
    floors = np.zeros(gpus)
    floors[: min(len(lumps), gpus)] = lumps[:gpus]
    # water-filling: the level lam with sum(max(0, lam - floor)) = poured
    f = np.sort(floors)
    cum = np.cumsum(f)
    level = f[-1]
    for k in range(1, gpus + 1):
        level = (poured + cum[k - 1]) / k
        if k == gpus or level <= f[k]:
            break
    return float(np.std(np.maximum(floors, level)))


def attach_floors(results: Sequence[SimResult], tasks: Sequence["TraceTask"], nodes: Sequence["ClusterNode"]) -> None:
    """Put each run's floors (``hottest_node_floor``, ``util_std_floor`` for
    its own window and timeline: when it started each task) in its ``meta``,
    where ``figures`` and ``render`` find them."""
    for r in results:
        start = float(r.meta.get("window_start_s", 0.0))
        starts = {x.task_id: (x.first_start_s, x.runs == 1) for x in r.records if x.runs > 0}
        node = hottest_node_floor(tasks, nodes, start, r.window_s, starts)
        r.meta["floors"] = {
            "hottest_node_util": node.pct,
            "hottest_node_task": node.task_id,
            "util_std": util_std_floor(tasks, nodes, start, r.window_s, starts),
        }


def to_json(results: Sequence[SimResult], meta: dict | None = None) -> dict[str, Any]:
    """The figures of every run, plus ratios and run metadata; JSON-safe (NaN -> None)."""
    figs = [figures(r) for r in results]
    doc = {"meta": dict(meta or {}), "policies": figs, "load_aware_vs_round_robin": ratios(figs)}
    return json_safe(doc)


def json_safe(value: Any) -> Any:
    """``value`` with numpy scalars made plain and NaN/inf as None, for json.dump."""
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, (float, np.floating)):
        v = float(value)
        return v if math.isfinite(v) else None
    if isinstance(value, np.integer):
        return int(value)
    return value


def _dur(seconds: float) -> str:
    if seconds != seconds:
        return "-"
    if abs(seconds) < 120:
        return f"{seconds:,.1f}s"
    if abs(seconds) < 7200:
        return f"{seconds / 60:,.1f}m"
    if abs(seconds) < 172_800:
        return f"{seconds / 3600:,.1f}h"
    return f"{seconds / 86400:,.1f}d"


def render(results: Sequence[SimResult], meta: dict | None = None) -> str:
    """A side-by-side table (one column per policy), then load_aware vs round_robin."""
    figs = [figures(r) for r in results]
    headers = ["figure", *[f["policy"] for f in figs]]
    rows: list[list[str]] = []

    def row(label: str, cells: Sequence[str]) -> None:
        rows.append([label, *cells])

    row("tasks completed", [f"{f['completed']:,}/{f['tasks']:,}" for f in figs])
    row("dropped / rejected / unfinished", [f"{f['dropped']}/{f['rejected']}/{f['unfinished']}" for f in figs])
    for cls in ("all", *_CLASSES):
        if all(f["wait_s"][cls]["n"] == 0 for f in figs):
            continue
        for q in ("mean", "p50", "p95", "p99"):
            row(f"wait {cls} {q}", [_dur(f["wait_s"][cls][q]) for f in figs])
    for q in ("mean", "p50", "p95", "p99"):
        row(f"response time (JCT) {q}", [_dur(f["jct_s"][q]) for f in figs])
    row("slowdown mean", [fmt(f["slowdown"]["mean"], 2) for f in figs])
    row("slowdown p95", [fmt(f["slowdown"]["p95"], 2) for f in figs])
    row("GPU util mean %", [fmt(f["util_mean"], 2) for f in figs])
    row("GPU util var across GPUs", [fmt(f["util_var"], 1) for f in figs])
    row("GPU util std across GPUs %", [fmt(f["util_std"], 2) for f in figs])
    floored = any("floors" in f for f in figs)
    if floored:
        row("  floor: no placement below", [fmt(f["floors"]["util_std"], 2) if "floors" in f else "-" for f in figs])
    row("GPU util std, instantaneous %", [fmt(f["util_std_inst"], 2) for f in figs])
    row("largest load difference, mean %", [fmt(f["util_spread"], 1) for f in figs])
    row("largest difference of GPU means %", [fmt(f["util_spread_means"], 1) for f in figs])
    row("hottest GPU mean util %", [fmt(f["hottest_gpu_util"], 1) for f in figs])
    row("hottest node mean util %", [fmt(f["hottest_node_util"], 1) for f in figs])
    if floored:
        row("  floor: no placement below",
            [fmt(f["floors"]["hottest_node_util"], 1) if "floors" in f else "-" for f in figs])
    row("hottest GPU time >= 90 %", [fmt(100 * f["hottest_gpu_time_above_90"], 1, "%") for f in figs])
    row("OOM kills", [fmt(f["oom_kills"]) for f in figs])
    row("  of which alone on the GPU", [fmt(f["oom_kills_alone"]) for f in figs])
    row("  outgrew its GPU, an idle one had room", [fmt(f["oom_kills_idle_room"]) for f in figs])
    if any(f["room_waits"] for f in figs):
        row("waits for room to grow / found it", [f"{f['room_waits']}/{f['room_waits_found']}" for f in figs])
    row("P0 SLA misses", [fmt(f["sla_misses"]) for f in figs])
    if any(f["preemptions"] for f in figs):
        row("preempted for P0 / GPU-h redone",
            [f"{f['preemptions']:,}/{f['preempted_work_h']:,.1f}" for f in figs])
    if any(f["plans"] for f in figs):
        row("rebalance plans / migrations", [f"{f['plans']}/{f['migrations']}" for f in figs])
    row("throughput tasks/h", [fmt(f["throughput_per_h"], 1) for f in figs])
    row("makespan", [_dur(f["makespan_s"]) for f in figs])
    if any("saturation" in f for f in figs):
        row(
            "saturation: unallocated at 1st failure",
            [fmt(100 * f["saturation"]["unallocated_at_first_failure"], 1, "%") if "saturation" in f else "-" for f in figs],
        )
        row(
            "saturation: arrived at 1st failure",
            [fmt(100 * f["saturation"]["arrived_at_first_failure"], 1, "%") if "saturation" in f else "-" for f in figs],
        )
        row(
            "saturation: unallocated at 100% arrived",
            [fmt(100 * f["saturation"]["unallocated_at_full"], 1, "%") if "saturation" in f else "-" for f in figs],
        )
    row("sim wall time", [f"{f['sim']['wall_s']:.1f}s" for f in figs])
    row("sim tasks/min", [fmt(f["sim"]["tasks_per_min"], 0) for f in figs])
    parts = []
    if meta:
        parts.append("  ".join(f"{k}={v}" for k, v in meta.items()))
    if figs:
        parts.append(f"utilisation window: {_dur(figs[0]['window_s'])}")
    parts.append(render_table(headers, rows, align="l" + "r" * len(figs)))
    rat = ratios(figs)
    if rat:
        rrows = []
        for key, e in rat.items():
            rrows.append(
                [
                    e["label"],
                    fmt(e["round_robin"], 2),
                    fmt(e["load_aware"], 2),
                    fmt(e["ratio"], 3),
                    fmt(e.get("seed_ratio"), 3) if "seed_ratio" in e else "-",
                    {True: "yes", False: "no"}.get(e.get("beats_seed"), "-"),
                ]
            )
        # "target": the ratio gpulb's design set out to beat on each figure
        # (the load-aware placement it replaces reported these; README "Simulator")
        parts.append("load_aware vs round_robin (ratio = load_aware / round_robin; target = the ratio gpulb aims to beat)")
        parts.append(
            render_table(
                ["figure", "round_robin", "load_aware", "ratio", "target ratio", "beats target"],
                rrows,
                align="lrrrrl",
            )
        )
    return "\n\n".join(parts)


def plot(results: Sequence[SimResult], out_dir: str | os.PathLike[str]) -> list[str]:
    """Heat maps of per-GPU utilisation over time (one per policy) and wait-time
    CDFs; returns the files written, [] when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    os.makedirs(out_dir, exist_ok=True)
    written: list[str] = []
    for r in results:
        if r.heatmap.size == 0:
            continue
        heat = r.heatmap.T  # GPUs x time
        if heat.shape[0] > 400:
            # average neighbouring GPUs (same or adjacent nodes) into 400 bands
            edges = np.linspace(0, heat.shape[0], 401).astype(int)
            heat = np.add.reduceat(heat, edges[:-1], axis=0) / np.diff(edges)[:, None]
        fig, ax = plt.subplots(figsize=(10, 5))
        t0, t1 = float(r.heatmap_t[0]), float(r.heatmap_t[-1])
        im = ax.imshow(
            heat, aspect="auto", origin="lower", cmap="inferno", vmin=0, vmax=100,
            extent=(t0 / 3600.0, max(t1, t0 + 1.0) / 3600.0, 0, r.gpus), interpolation="nearest",
        )
        ax.set_xlabel("virtual time (h)")
        ax.set_ylabel("GPU (in cluster order)")
        ax.set_title(f"GPU utilisation - {r.policy}")
        fig.colorbar(im, ax=ax, label="util %")
        path = os.path.join(out_dir, f"heatmap_{r.policy}.png")
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in results:
        waits = np.sort([x.wait_s for x in r.records if x.runs > 0])
        if waits.size == 0:
            continue
        y = np.arange(1, waits.size + 1) / waits.size
        ax.step(np.maximum(waits, 1e-2), y, where="post", label=r.policy)
    ax.set_xscale("log")
    ax.set_xlabel("wait (s, log)")
    ax.set_ylabel("share of tasks")
    ax.set_title("Wait time CDF")
    ax.grid(True, alpha=0.3)
    ax.legend()
    path = os.path.join(out_dir, "wait_cdf.png")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    written.append(path)
    return written
