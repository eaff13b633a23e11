"""Soft scores: how good each feasible GPU is for a task; lower is better.

Pure vector functions over a ``PlacementView``. Each term is unitless and
mostly in 0..1 so weights (configuration, ``LOAD_AWARE_WEIGHTS``) compare like
with like. The load-aware score of GPU g on a fresh node::

    S_g =  w_load             * (util_g + reserved_util_g + 100 * share) / 100
         + w_memory           * P((used_g + reserved_g + vram) / total_g)
         + w_temperature      * T(temperature_g)
         + w_jitter           * active_g
         + w_response_time    * RT(response_time_node(g))
         - w_preferred_labels * F(node(g))
         + w_completion       * C(g)             (only with predicted slowdowns)
         + w_spread           * R(g)             (the policy's placement history)
         + w_oom_risk         * O(g)             (only with learned memory growth)
         + w_big_cards        * B(g)             (only where some cards are big)

    P(x)  = clip((x - warn) / (reject - warn), 0, 1)   warn 70 %, reject 85 %
    T(t)  = clip((t - 60 °C) / (85 °C - 60 °C), 0, 1)  (NaN -> 1)
    RT(r) = clip(r / response_time_ref_s, 0, 1)        (NaN -> median of known)
    F     = fraction of preferred_node_labels the node carries
    C(g)  = 1 - fastest / (slowdown_g * max(1, (util_g + reserved_util_g + 100 * share) / 100))

``C`` (``scheduler.predictor.completion_term``) is the share of the task's
run time lost on GPU g against the fastest GPU of the cluster running it
alone; ``slowdown`` is the snapshot's learned column for the task's kind
(``ClusterSnapshot.gpu_slowdown``), so among equally loaded GPUs the one that
finishes the task soonest wins. A snapshot without slowdowns has no such term.
(It is computed as ``w_completion - (w_completion * fastest / slowdown_g) /
stretch_g`` with the first product cached per view: equal up to rounding.)

``O(g)`` (``scheduler.memgrowth.GrowthTable``) is the share of the peak-over-ask
memory ratios learned from ended tasks of the task's kind for which ``vram *
r`` would exceed the GPU's free memory ``total - committed``: the empirical
chance that the task outgrows that GPU and is killed. 0 where even the largest
learned growth fits; a snapshot without learned growth has no such term. On
the openb replays it is what keeps whole-GPU tasks (13,107 MiB asks) off the
16 GiB cards while 24 and 80 GiB ones are free (README, "OOM kills").

``R(g) = max(0, 1 - (placements since g was last chosen) / GPUs)``: 1 on
the GPU just chosen, 0 on one not chosen in the last G placements (or ever).
Without it (the default, ``w_spread = 0``), equally idle GPUs tie and the
lowest row wins every time, which packs work into the first nodes: on the
openb replay load_aware ran about half the GPUs of the cluster and left the
rest idle for the whole trace (time-mean util by row quarter 64 / 19 / 0 / 0 %,
51 % of GPUs never busy). ``w_spread = 0.05`` (5 % of util) spreads work over
equals (1 % never busy; time-mean util std across GPUs 0.87-0.98x round-robin's
instead of 1.17-1.27x) but fragments nodes, and multi-GPU tasks wait longer
(mean response 0.654-0.717x round-robin's instead of 0.632-0.699x), measured
with the completion term off; with it on (the coordinator's way, and the
simulator's since), load_aware also favours the fast models and spread
takes util std from 1.13-1.27x to 1.03-1.20x round-robin's at about the same
response. A choice between wear and thermal balance over time and room for
big tasks, so it is a weight, off by default.

``B(g)`` keeps the few big-memory cards for the work that needs them. The
*big* cards are the largest-memory ones that together make up at most
``big_card_share`` of the GPUs (``SchedulerConfig``, 10 %), counted from the
largest size down, and hold at least 1.2 times (``BIG_CARD_STEP``) the
memory of the largest other card, ``small`` (a few MiB more is the same
card as reported by another SKU or driver, not a bigger one). A
task whose need, its ask times the largest growth learned for its kind
(all kinds' before its own; its ask alone before anything is learned),
fits in ``small`` scores ``B = 1`` on a big card and 0 elsewhere; a task
that needs more, or has no ask, scores 0.
Where the largest cards are more than that share (every card one size, say)
no card is big and there is no such term. On the openb cluster
(312 G3s of 80 GiB and 204 V100s of 32 GiB among 6,212 GPUs, 8.3 %) the
fractional and small work took the big cards for their speed (a G3 is
2.45x a G2), and P0 tasks whose kind grows past 24 GiB then evicted batch
work from them: with the term, evictions for P0 work fell by half over
three seeds (4,809 -> 2,778) at a mean response 1-2 % shorter; the OOM
kills stayed within their noise (README, "OOM kills"). Weight 1 is about
what the completion term gives a G3 over a G2, so small work still takes a
big card when the others are loaded; at 2 it leaves the G3s idle (mean
response 4.4 -> 7.7 h on openb default).

``util`` is the EWMA forecast (or smoothed util, see config; NaN -> 100 %),
``reserved_*`` the effective reservations, ``active`` the tasks on the GPU
(max of the snapshot's count and our live leases: the jitter term spreads
tasks so one GPU does not carry many small co-tenants).

A GPU on a stale node is scored by its node's free GPU count only::

    S_g = w_stale * (1 + busy_node(g)),   busy = 1 - free GPUs / GPUs on the node

so among stale nodes the emptiest wins, and the ``w_stale`` floor makes fresh
GPUs win ties (and win outright unless they are loaded beyond ``w_stale``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import numpy as np

from scheduler.memgrowth import GrowthTable, largest_growth, table_for
from scheduler.predictor import ANY_KIND
from scheduler.task import TaskSpec

if TYPE_CHECKING:  # the view imports the term functions below
    from scheduler.view import PlacementView

__all__ = [
    "LOAD_AWARE_WEIGHTS",
    "big_card_column",
    "big_card_sizes",
    "big_card_need",
    "speed_loss_scores",
    "memory_pressure",
    "temperature_penalty",
    "response_time_term",
    "predicted_load",
    "stale_score",
    "load_aware_scores",
    "load_aware_terms",
    "load_aware_bounds",
    "load_aware_node_bounds",
]

LOAD_AWARE_WEIGHTS: Mapping[str, float] = {
    "load": 1.0,
    "memory": 1.0,
    "temperature": 0.5,
    "jitter": 0.1,
    "response_time": 0.2,
    "preferred_labels": 0.3,
    "completion": 2.0,  # predicted completion time; needs the snapshot's slowdown columns
    "stale": 1.0,
    "nvlink": 0.5,  # bonus for a fully NVLink-connected multi-GPU set (see policies)
    "spread": 0.0,  # > 0: recently chosen GPUs yield to equally good others (R above; off by default)
    "oom_risk": 2.0,  # learned chance of outgrowing the GPU's free memory (O above); needs learned growth
    "big_cards": 1.0,  # a task the other cards can hold keeps off the few big-memory ones (B above)
}


def memory_pressure(used_frac: np.ndarray, warn_frac: float, reject_frac: float) -> np.ndarray:
    """P(x) = clip((x - warn) / (reject - warn), 0, 1): 0 below warn, 1 at reject."""
    return np.clip((np.asarray(used_frac, dtype=np.float64) - warn_frac) / (reject_frac - warn_frac), 0.0, 1.0)


def temperature_penalty(temp_c: np.ndarray, start_c: float, limit_c: float) -> np.ndarray:
    """T(t) = clip((t - start) / (limit - start), 0, 1); NaN (unknown) -> 1."""
    t = np.clip((np.asarray(temp_c, dtype=np.float64) - start_c) / (limit_c - start_c), 0.0, 1.0)
    return np.where(np.isnan(t), 1.0, t)


def response_time_term(response_s: np.ndarray, ref_s: float) -> np.ndarray:
    """RT(r) = clip(r / ref, 0, 1); NaN -> the median of the known values (0 if none)."""
    r = np.asarray(response_s, dtype=np.float64)
    known = r[np.isfinite(r)]
    r = np.where(np.isfinite(r), r, float(np.median(known)) if known.size else 0.0)
    return np.clip(r / ref_s, 0.0, 1.0)


def predicted_load(util_pct: np.ndarray, reserved_util_pct: np.ndarray, share: float) -> np.ndarray:
    """(util + reserved util + 100 * share) / 100; NaN util counts as 100 %."""
    u = np.asarray(util_pct, dtype=np.float64)
    u = np.where(np.isnan(u), 100.0, u)
    return (u + np.asarray(reserved_util_pct, dtype=np.float64) + 100.0 * share) / 100.0


def stale_score(free_gpus: np.ndarray, node_gpus: np.ndarray, weight: float) -> np.ndarray:
    """w_stale * (1 + 1 - free / gpus) per node: fewer free GPUs is worse."""
    free = np.asarray(free_gpus, dtype=np.float64)
    gpus = np.maximum(np.asarray(node_gpus, dtype=np.float64), 1.0)
    return weight * (2.0 - free / gpus)


def _static(view: PlacementView, w: Mapping[str, float]) -> np.ndarray:
    """w_temperature * T + w_response_time * RT, cached on the view per weights."""
    key = ("load_aware", w["temperature"], w["response_time"])
    static = view.static_cache.get(key)
    if static is None:
        static = w["temperature"] * view.temp_term + w["response_time"] * view.rt_term
        view.static_cache[key] = static
    return static


def _weighted_speed(view: PlacementView, kind: str, weight: float) -> np.ndarray | None:
    """Per GPU ``w_completion * fastest / slowdown`` for ``kind`` (else any
    kind): the completion term's task-independent part, ``w_completion`` on
    the fastest GPU, from the snapshot's slowdown column cleaned as
    ``completion_term`` does (NaN or non-positive: 1.0); cached per view, so
    a decision neither cleans nor divides the column again. None without
    slowdowns. The term is then ``w_completion - this / stretch``."""
    columns = view.snapshot.gpu_slowdown
    if not columns:
        return None
    key = ("load_aware.completion", kind, weight)
    cached = view.static_cache.get(key)
    if cached is None:
        column = columns.get(kind)
        if column is None:
            column = columns.get(ANY_KIND)
        if column is None or column.size == 0:
            return None
        known = np.isfinite(column) & (column > 0)
        fastest = float(column[known].min()) if known.any() else 1.0
        cached = weight * (fastest / np.where(known, column, 1.0))
        view.static_cache[key] = cached
    return cached


def speed_loss_scores(view: PlacementView, spec: TaskSpec, weight: float, rows: np.ndarray | None = None) -> np.ndarray | None:
    """``weight * (1 - fastest / slowdown_g)`` of every GPU (or of ``rows``):
    the share of the task's speed lost on GPU g against the fastest for its
    kind, from the learned slowdown columns; the completion term without its
    load stretch, for a policy that counts shared compute by itself (fgd's
    overcommit). 0 everywhere on a homogeneous cluster; None without learned
    slowdowns or with ``weight`` 0. For all rows it is the view's cached
    column: read it, do not write to it."""
    if not weight:
        return None
    floor = _completion_floor(view, spec.kind, weight)
    if floor is None or rows is None:
        return floor
    return floor[rows]


def _weighted_load(view: PlacementView, rows: object, weight: float) -> np.ndarray:
    return view.load[rows] * (weight / 100.0)


def _weighted_active(view: PlacementView, rows: object, weight: float) -> np.ndarray:
    return weight * view.active[rows]


def load_aware_scores(
    view: PlacementView,
    spec: TaskSpec,
    weights: Mapping[str, float],
    rows: np.ndarray | None = None,
    spread: np.ndarray | None = None,
) -> np.ndarray:
    """S_g for every GPU row (module docstring), or for ``rows`` only, in their order.

    ``spread``: ``w_spread * R`` for every row (the policy keeps the history),
    or None when it is 0 everywhere.

    Callers mask out infeasible rows. The task-independent products
    (``w_load * load / 100``, ``w_jitter * active``) are columns the view keeps
    current (``PlacementView.derived``), so a decision starts from them; the
    arithmetic per row is the same, so the scores are the same to the bit
    whether computed for all rows or some.
    """
    w = weights
    cfg = view.config
    warn = cfg.memory_warn_pct / 100.0
    band = cfg.memory_reject_pct / 100.0 - warn
    w_load, w_jitter = w["load"], w["jitter"]
    load = view.derived(("load_aware.load", w_load), lambda v, r: _weighted_load(v, r, w_load))

    def take(column: np.ndarray) -> np.ndarray:
        return column if rows is None else column[rows]

    speed = _weighted_speed(view, spec.kind, w["completion"]) if w["completion"] else None
    # w_completion * C = w_completion - speed / stretch: the constant joins the load's
    shift = w_load * spec.gpu_share + (w["completion"] if speed is not None else 0.0)
    score = np.add(take(load), shift)
    # memory pressure after placement, in place to spare temporaries
    pressure = take(view.committed) + spec.vram_mib
    pressure *= take(view.inv_total)
    pressure -= warn
    pressure *= w["memory"] / band
    # maximum and minimum: np.clip's dispatch costs more than the arithmetic at 8,000 rows
    np.maximum(pressure, 0.0, out=pressure)
    np.minimum(pressure, w["memory"], out=pressure)
    score += pressure
    table = growth_table(view, spec, w["oom_risk"])
    if table is not None:
        table.add_risk(score, take(view.headroom), spec.vram_mib, w["oom_risk"])
    score += take(_static(view, w))
    big = _big_card_penalty(view, spec, w["big_cards"])
    if big is not None:
        score += take(big)
    if w_jitter:
        jitter = view.derived(("load_aware.jitter", w_jitter), lambda v, r: _weighted_active(v, r, w_jitter))
        score += take(jitter)
    if spec.preferred_node_labels and w["preferred_labels"]:
        score -= w["preferred_labels"] * take(view.preferred_fraction(spec.preferred_node_labels))
    if speed is not None:
        # stretch = max(1, (load + 100 * share) / 100): processor sharing past 100 %
        stretch = np.add(take(view.load), 100.0 * spec.gpu_share)
        stretch /= 100.0
        np.maximum(stretch, 1.0, out=stretch)
        np.divide(take(speed), stretch, out=stretch)
        score -= stretch
    if spread is not None:
        score += take(spread)
    if view.any_stale:
        stale = w["stale"] * (1.0 + view.stale_busy)
        score = np.where(take(view.stale), stale[take(view.node)], score)
    return score


#: big cards hold at least this many times the memory of the largest other card
BIG_CARD_STEP = 1.2

#: [share, capacities, big_card_sizes' answer] of the last call
_LAST_BIG_CARDS: list = []


def big_card_sizes(total_mib: np.ndarray, share: float) -> tuple[float, float] | None:
    """``(threshold, small)`` MiB: cards with at least ``threshold`` are big,
    ``small`` is the largest memory of the others; None when no card is big
    (module docstring). Zero or unknown capacities count for nothing. The
    last answer is kept: capacities seldom change between snapshots, and a
    compare costs less than the sort (8,000 GPUs: ~5 vs ~40 us; the
    simulator asks once per snapshot)."""
    total = np.asarray(total_mib, dtype=np.float64)
    last = _LAST_BIG_CARDS
    if last and last[0] == share and np.array_equal(last[1], total, equal_nan=True):
        return last[2]
    answer = _big_card_sizes(total, share)
    _LAST_BIG_CARDS[:] = [share, total.copy(), answer]
    return answer


def _big_card_sizes(total: np.ndarray, share: float) -> tuple[float, float] | None:
    known = np.sort(total[np.isfinite(total) & (total > 0)])
    if not share > 0 or not known.size:
        return None
    sizes = np.unique(known)[::-1]  # largest first
    # share of the known GPUs with at least each size
    at_least = (known.size - np.searchsorted(known, sizes, side="left")) / known.size
    big = int(np.count_nonzero(at_least <= share))  # a prefix: at_least only grows
    # the split must be a real step in size: the same card reports a few MiB
    # more or less by SKU and driver (RTX 4090 24,564, M40 24,472, 24,576 MiB)
    for k in range(min(big, sizes.size - 1), 0, -1):
        if sizes[k - 1] >= BIG_CARD_STEP * sizes[k]:
            return float(sizes[k - 1]), float(sizes[k])
    return None


def big_card_column(view: PlacementView) -> tuple[np.ndarray, float] | None:
    """``(B, small)``: 1.0 on the big cards and 0.0 elsewhere, and the largest
    memory (MiB) of the other cards; None when no card is big (module
    docstring). Cached per view: capacities do not change within one."""
    share = view.config.big_card_share
    key = ("big_cards", share)
    if key in view.static_cache:
        return view.static_cache[key]  # type: ignore[return-value]
    sizes = big_card_sizes(view.total, share)
    result = None if sizes is None else (np.where(view.total >= sizes[0], 1.0, 0.0), sizes[1])
    view.static_cache[key] = result  # type: ignore[assignment]
    return result


def big_card_need(view: PlacementView, spec: TaskSpec) -> float:
    """The memory (MiB per GPU) the big_cards term judges ``spec`` by: its
    ask times the largest growth learned for its kind (all kinds' before its
    own), its ask alone before anything is learned; 0 without an ask."""
    if spec.vram_mib <= 0:
        return 0.0
    return spec.vram_mib * largest_growth(view.snapshot.memory_growth, spec.kind)


def _big_card_penalty(view: PlacementView, spec: TaskSpec, weight: float) -> np.ndarray | None:
    """``w_big_cards * B`` for every row when the term applies to ``spec``, else None."""
    if not weight:
        return None
    big = big_card_column(view)
    if big is None:
        return None
    column, small = big
    need = big_card_need(view, spec)
    if not 0 < need <= small:
        return None
    key = ("load_aware.big_cards", view.config.big_card_share, weight)
    weighted = view.static_cache.get(key)
    if weighted is None:
        weighted = column * weight
        view.static_cache[key] = weighted
    return weighted


def growth_table(view: PlacementView, spec: TaskSpec, weight: float) -> GrowthTable | None:
    """The learned growth ratios the ``oom_risk`` term uses for ``spec``, or
    None when the term is off (no weight, no ask, nothing learned)."""
    growth = view.snapshot.memory_growth
    if not growth or not weight or spec.vram_mib <= 0:
        return None
    return table_for(growth, spec.kind)


def _completion_floor(view: PlacementView, kind: str, weight: float) -> np.ndarray | None:
    """Per GPU ``w_completion - w_completion * fastest / slowdown``, the
    completion term with no stretch: never above the term itself up to
    rounding (cached per view); None without slowdowns."""
    speed = _weighted_speed(view, kind, weight)
    if speed is None:
        return None
    key = ("load_aware.completion_floor", kind, weight)
    floor = view.static_cache.get(key)
    if floor is None:
        floor = weight - speed
        view.static_cache[key] = floor
    return floor


def load_aware_bounds(
    view: PlacementView, spec: TaskSpec, weights: Mapping[str, float]
) -> tuple[np.ndarray, float] | None:
    """A lower bound of ``load_aware_scores`` per GPU, as ``(column, shift)``:
    ``column + shift`` is at most S_g up to rounding (compare with a margin).

    The column is what does not depend on the task (load, static terms,
    jitter, the completion term with no stretch), kept current by
    ``PlacementView.derived``, minus the preferred-label bonus; ``shift`` is
    ``w_load * share``. What is left out is never negative: memory pressure
    (clipped at 0), the completion term's stretch (at least 1), the learned
    OOM risk and the big-cards term. Policies use
    it to score exactly only the GPUs that can win. None when some node is
    stale (stale GPUs are scored otherwise).
    """
    if view.any_stale:
        return None
    w = weights
    column = view.derived(*_bound_column(view, spec, w))
    if spec.preferred_node_labels and w["preferred_labels"]:
        column = column - w["preferred_labels"] * view.preferred_fraction(spec.preferred_node_labels)
    return column, w["load"] * spec.gpu_share


def _bound_column(
    view: PlacementView, spec: TaskSpec, w: Mapping[str, float]
) -> tuple[object, Callable[[PlacementView, object], np.ndarray]]:
    """Key and row-local ``compute`` of ``load_aware_bounds``' task-independent
    column (a ``PlacementView.derived`` column)."""
    w_load, w_jitter, w_completion = w["load"], w["jitter"], w["completion"]
    static = _static(view, w)
    floor = _completion_floor(view, spec.kind, w_completion) if w_completion else None

    def compute(v: PlacementView, rows: object) -> np.ndarray:
        out = v.load[rows] * (w_load / 100.0) + static[rows]
        if w_jitter:
            out = out + w_jitter * v.active[rows]
        if floor is not None:
            out = out + floor[rows]
        return out

    key = ("load_aware.bound", w_load, w_jitter, w["temperature"], w["response_time"],
           spec.kind if floor is not None else None, w_completion if floor is not None else 0.0)
    return key, compute


def load_aware_node_bounds(
    view: PlacementView, spec: TaskSpec, weights: Mapping[str, float], k: int
) -> np.ndarray | None:
    """Per node (uniform layouts), a lower bound of the mean of ``load_aware_scores``
    over any ``k`` of its GPUs, up to rounding (compare with a margin): the
    mean of its ``k`` lowest ``load_aware_bounds``, from running sums the view
    keeps sorted per node (``PlacementView.node_sorted_sums``), so it costs a
    few operations per node and no sort. None where ``load_aware_bounds`` is.
    """
    if view.any_stale or not 0 < k <= view.uniform_width:
        return None
    w = weights
    sums = view.node_sorted_sums(*_bound_column(view, spec, w))
    if sums is None:
        return None
    mean = sums[:, k - 1] / k
    mean += w["load"] * spec.gpu_share
    if spec.preferred_node_labels and w["preferred_labels"]:
        # the preferred fraction is per node: the same for every GPU of a node
        mean -= w["preferred_labels"] * view.labels.preferred(spec.preferred_node_labels)
    return mean


def load_aware_terms(
    view: PlacementView, spec: TaskSpec, weights: Mapping[str, float], rows: Sequence[int],
    spread: np.ndarray | None = None,
) -> dict[str, float]:
    """Weighted term contributions at ``rows`` (mean over a multi-GPU set).

    Scalar arithmetic on the few chosen rows (cheaper than vector calls on
    1-element arrays); it must agree with ``load_aware_scores`` term by term.
    """
    w = weights
    cfg = view.config
    warn = cfg.memory_warn_pct / 100.0
    band = cfg.memory_reject_pct / 100.0 - warn
    pref = view.preferred_fraction(spec.preferred_node_labels) if spec.preferred_node_labels else None
    speed = _weighted_speed(view, spec.kind, w["completion"]) if w["completion"] else None
    names = ["load", "memory", "temperature", "jitter", "response_time"]
    if pref is not None:
        names.append("preferred_labels")
    if speed is not None:
        names.append("completion")
    if spread is not None:
        names.append("spread")
    table = growth_table(view, spec, w["oom_risk"])
    if table is not None:
        names.append("oom_risk")
    big = _big_card_penalty(view, spec, w["big_cards"])
    if big is not None:
        names.append("big_cards")
    w_load, w_memory, w_temp, w_jitter, w_rt = (w[n] for n in names[:5])
    share_pct = 100.0 * spec.gpu_share
    totals: list[float] | None = None  # per name, summed over the fresh rows in order
    stale_total: float | None = None
    for r in rows:
        r = int(r)
        if view.stale[r]:
            value = w["stale"] * (1.0 + float(view.stale_busy[view.node[r]]))
            stale_total = value if stale_total is None else stale_total + value
            continue
        load = float(view.load[r])
        frac = (float(view.committed[r]) + spec.vram_mib) * float(view.inv_total[r])
        values = [
            w_load * (load + share_pct) / 100.0,
            w_memory * min(max((frac - warn) / band, 0.0), 1.0),
            w_temp * float(view.temp_term[r]),
            w_jitter * float(view.active[r]),
            w_rt * float(view.rt_term[r]),
        ]
        if pref is not None:
            values.append(-w["preferred_labels"] * float(pref[r]))
        if speed is not None:
            values.append(w["completion"] - float(speed[r]) / max(1.0, (load + share_pct) / 100.0))
        if spread is not None:
            values.append(float(spread[r]))
        if table is not None:
            values.append(w["oom_risk"] * table.risk_at(float(view.headroom[r]), spec.vram_mib))
        if big is not None:
            values.append(float(big[r]))
        totals = values if totals is None else [t + v for t, v in zip(totals, values)]
    count = len(rows)
    out = {} if totals is None else {name: total / count for name, total in zip(names, totals)}
    if stale_total is not None:
        out["stale"] = stale_total / count
    return out
