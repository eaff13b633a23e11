"""Placement policies behind one interface, registered by name in ``POLICIES``.

A policy turns the feasible GPUs (a mask from ``scheduler.filters``) into one
``Placement``. Each policy defines a per-GPU score, lower is better; the shared
``Policy.choose`` picks the best GPU, or for a multi-GPU task the best set of
``num_gpus`` GPUs on one node:

* candidate nodes are those with at least ``k`` feasible GPUs (and, for
  needs_nvlink, some NVLink topology);
* a set's objective is ``mean(score over the set) - w_nvlink * links / (k(k-1)/2)``
  where ``links`` counts NVLink-joined pairs inside the set, so connected sets
  are preferred; for needs_nvlink the set must be connected (every GPU reachable
  from every other over NVLink inside the set);
* on every node the set of its ``k`` best GPUs is scored (vectorised over nodes);
* on nodes where NVLink could still win (``mean of k best - w_nvlink`` below the
  best so far; at most 32 of them, lowest first), every feasible GPU also seeds
  a set grown greedily by the best-scoring NVLink neighbour (exact for k = 2);
  all growths run in lock-step as vector operations.

When every node has the same number of GPUs in consecutive rows (the usual
fleet), the same decision is reached on a (node x GPU) view of the scores that
sorts GPU identities only for the nodes a bound says can matter
(``_choose_set_uniform``), and grows sets only on hopeful nodes whose best
possible set (most links; for pairs, the best linked pair) beats option A; a
single-GPU decision takes the overall minimum when it is a candidate, and
scores only the candidates when they are few.

Policies are swapped at run time (``Scheduler.set_policy``); weights are
validated by name and value. Stateful policies (round robin's cursor, weighted
round robin's virtual times) keep their state across swaps because the
scheduler keeps one instance per name.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, ClassVar, Mapping, Sequence

import numpy as np

from scheduler import setsearch
from scheduler.errors import InvalidWeight, UnknownPolicy
from scheduler.fragmentation import WorkloadMix, fragmentation_delta, free_resources
from scheduler.scoring import (
    LOAD_AWARE_WEIGHTS,
    growth_table,
    load_aware_bounds,
    load_aware_node_bounds,
    load_aware_scores,
    load_aware_terms,
    memory_pressure,
    speed_loss_scores,
)
from scheduler.task import ScoreBreakdown, TaskSpec
from scheduler.view import PlacementView

__all__ = [
    "Placement",
    "Policy",
    "RoundRobin",
    "WeightedRoundRobin",
    "LeastConnections",
    "LoadAware",
    "Binpack",
    "Fragmentation",
    "POLICIES",
    "make_policy",
]

# GiB of the reference GPU (RTX 4090) for weighted round robin's memory weight.
_REF_MEMORY_MIB = 24_576.0


@dataclass(frozen=True, slots=True)
class Placement:
    """A policy's decision: node, GPU rows of the view, and why."""

    node: int  # index into the snapshot's per-node arrays
    node_id: str
    rows: tuple[int, ...]  # GPU rows of the snapshot
    gpu_indices: tuple[int, ...]  # host-local GPU indices
    gpu_uuids: tuple[str, ...]
    score: ScoreBreakdown


class Policy(ABC):
    """Interface: per-GPU scores (lower is better) plus the shared set selection."""

    NAME: ClassVar[str]
    DEFAULT_WEIGHTS: ClassVar[Mapping[str, float]]
    SCORES_SOME_ROWS: ClassVar[bool] = False  # gpu_scores_at is cheaper than gpu_scores
    # what the scheduler has seen arrive (the engine sets its own on every
    # policy it makes); read by the fragmentation policy
    workload_mix: WorkloadMix | None = None

    def __init__(self, weights: Mapping[str, float] | None = None) -> None:
        self.weights: dict[str, float] = dict(self.DEFAULT_WEIGHTS)
        self.update_weights(weights or {})

    @classmethod
    def create(cls, weights: Mapping[str, float] | None = None) -> "Policy":
        """Factory: a policy with its default weights overridden by ``weights``."""
        return cls(weights)

    def update_weights(self, updates: Mapping[str, float]) -> None:
        """Change only the given weights; InvalidWeight names the first bad one."""
        merged = dict(self.weights)
        for name, value in updates.items():
            if name not in self.DEFAULT_WEIGHTS:
                known = ", ".join(sorted(self.DEFAULT_WEIGHTS))
                raise InvalidWeight(name, f"policy {self.NAME} has no weight {name!r}; known: {known}")
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value < 0
            ):
                raise InvalidWeight(name, f"must be a finite number >= 0, got {value!r}")
            merged[name] = float(value)
        self._check(merged)
        self.weights = merged

    def _check(self, weights: Mapping[str, float]) -> None:
        """Cross-weight validation hook."""

    # ---- per policy -----------------------------------------------------------------
    @abstractmethod
    def gpu_scores(self, view: PlacementView, spec: TaskSpec) -> np.ndarray:
        """Score of every GPU row for ``spec``; only feasible rows are read."""

    def terms(
        self, view: PlacementView, spec: TaskSpec, rows: Sequence[int], scores: np.ndarray
    ) -> dict[str, float]:
        """Weighted term contributions of the chosen rows (mean over a set)."""
        return {"score": float(np.mean(scores[np.asarray(rows, dtype=np.intp)]))}

    def commit(self, view: PlacementView, placement: Placement) -> None:
        """Called once a placement is applied (stateful policies advance here)."""

    # ---- shared selection ---------------------------------------------------------------
    def choose(
        self, view: PlacementView, spec: TaskSpec, candidates: np.ndarray
    ) -> Placement | None:
        """The best GPU (or GPU set) among ``candidates``; None when nothing fits."""
        if spec.num_gpus == 1:
            return self._choose_one(view, spec, candidates)
        if not candidates.any():
            return None
        width = view.uniform_width
        if 0 < width <= _MAX_RANK:
            if _compiled_set_search(spec):
                # every node in one compiled loop: 2x cheaper than the numpy
                # paths below where scores tie (bounds prune little there); where
                # they prune well (random readings, 5,000 nodes) ~20 % dearer at
                # p50, alike at p99 (benchmarks/bench_decision.py, README)
                return self._choose_set_compiled(view, spec, candidates, self.gpu_scores(view, spec), width)
            node_low = None
            if view.gpu_count >= _NODE_BOUNDS_MIN_GPUS:
                node_low = self.node_bounds(view, spec, spec.num_gpus)
            if view.gpu_count >= _BOUNDS_MIN_GPUS:
                bounds = self.gpu_bounds(view, spec)
                if bounds is not None:
                    exact = _ExactScores(self, view, spec, candidates, bounds[0] + bounds[1], width)
                    try:
                        return self._choose_set_uniform(
                            view, spec, candidates, exact.values, width, exact.fill, node_low
                        )
                    except _NotExact:
                        pass
                    if node_low is not None:  # the try changed it in place
                        node_low = self.node_bounds(view, spec, spec.num_gpus)
            return self._choose_set_uniform(view, spec, candidates, self.gpu_scores(view, spec), width, None, node_low)
        return self._choose_set(view, spec, candidates, self.gpu_scores(view, spec))

    def _choose_set_compiled(
        self, view: PlacementView, spec: TaskSpec, candidates: np.ndarray, scores: np.ndarray, width: int
    ) -> Placement | None:
        """``_choose_set_general`` on a uniform layout in one compiled loop
        (``scheduler.setsearch``): the same placement, a fraction of the time."""
        objective, rows, frac, groups = setsearch.best_set(
            scores, candidates, view.adj_bits, view.local_bit, view.node_has_nvlink, int(width),
            int(spec.num_gpus), bool(spec.needs_nvlink), float(self.weights["nvlink"]), _SET_SEARCH_NODES,
        )
        if not objective < np.inf:
            return None
        return self._placement(view, spec, rows, scores, objective, frac, groups)

    def gpu_scores_at(self, view: PlacementView, spec: TaskSpec, rows: np.ndarray) -> np.ndarray | None:
        """``gpu_scores(view, spec)[rows]``, computed for those rows only; None
        when the policy has no cheaper way than scoring every row. A policy
        that has one gets ``scores=None`` in ``terms`` for such decisions."""
        return None

    def gpu_bounds(self, view: PlacementView, spec: TaskSpec) -> tuple[np.ndarray, float] | None:
        """A lower bound of ``gpu_scores`` per row as ``(column, shift)``
        (``column + shift``, up to rounding), cheap to get; with it a decision
        scores exactly only the rows that can win. None: no such bound."""
        return None

    def node_bounds(self, view: PlacementView, spec: TaskSpec, k: int) -> np.ndarray | None:
        """Per node (uniform layouts), a new array: a lower bound of the mean
        score of any ``k`` of its GPUs, up to rounding, cheap to get; with it
        a set decision sorts only the nodes that can matter. None: no such bound."""
        return None

    def _choose_one(self, view: PlacementView, spec: TaskSpec, candidates: np.ndarray) -> Placement | None:
        """The candidate with the lowest score, the lowest row on ties; the
        finite ones when some score is NaN."""
        count = int(np.count_nonzero(candidates))
        if not count:
            return None
        if self.SCORES_SOME_ROWS and count * _SPARSE <= view.gpu_count:
            # few candidates (labels, models, a big task): score only those
            rows = np.flatnonzero(candidates)
            some = self.gpu_scores_at(view, spec, rows)
            if some is not None:
                at = int(np.argmin(some))
                if not some[at] < np.inf:  # NaN or inf: fall back to the finite ones
                    finite = np.isfinite(some)
                    if not finite.any():
                        return None
                    at = int(np.argmin(np.where(finite, some, np.inf)))
                return self._placement(view, spec, (int(rows[at]),), None, float(some[at]), 0.0, count)
        if self.SCORES_SOME_ROWS and view.gpu_count >= _ONE_BOUNDS_MIN_GPUS:
            bounds = self.gpu_bounds(view, spec)
            if bounds is not None:
                found = self._choose_one_bounded(view, spec, candidates, *bounds)
                if found is not None:
                    return self._placement(view, spec, (found[0],), None, found[1], 0.0, count)
        scores = self.gpu_scores(view, spec)
        row = int(np.argmin(scores))
        # the first overall minimum, when it is a candidate, is the first
        # candidate minimum too (argmin finds a NaN first, if there is one)
        if not (candidates[row] and scores[row] < np.inf):
            masked = np.where(candidates, scores, np.inf)
            row = int(np.argmin(masked))
            if not masked[row] < np.inf:  # NaN or inf: fall back to the finite ones
                finite = candidates & np.isfinite(scores)
                if not finite.any():
                    return None
                row = int(np.argmin(np.where(finite, scores, np.inf)))
        return self._placement(view, spec, (row,), scores, float(scores[row]), 0.0, count)

    def _choose_one_bounded(
        self, view: PlacementView, spec: TaskSpec, candidates: np.ndarray, bound: np.ndarray, shift: float
    ) -> tuple[int, float] | None:
        """(row, score) of the first candidate with the lowest score, scoring
        exactly only the candidates whose bound is at most U, the lowest score
        of a few probes (the lowest bound of each of ``_SET_SEARCH_NODES``
        blocks of rows); None when that is not few of them or some score is
        NaN (the caller scores every row)."""
        masked = np.where(candidates, bound, np.inf)
        first = int(np.argmin(masked))
        if not masked[first] < np.inf:  # NaN bound, or no candidate
            return None
        probe = _block_argmins(masked, _SET_SEARCH_NODES)
        upper = float(np.min(self.gpu_scores_at(view, spec, probe)))
        if not upper < np.inf:
            return None
        rows = np.flatnonzero(masked <= _with_margin(upper) - shift)
        if rows.size * _SPARSE > view.gpu_count:
            return None
        some = self.gpu_scores_at(view, spec, rows)
        at = int(np.argmin(some))  # the first minimum, a NaN first if there is one
        if not some[at] < np.inf:
            return None
        return int(rows[at]), float(some[at])

    def _placement(
        self,
        view: PlacementView,
        spec: TaskSpec,
        rows: Sequence[int],
        scores: np.ndarray | None,
        total: float,
        link_frac: float,
        candidates: int,
    ) -> Placement:
        s = view.snapshot
        rows = tuple(int(r) for r in rows)
        terms = self.terms(view, spec, rows, scores)
        if len(rows) > 1:
            terms["nvlink"] = -self.weights["nvlink"] * link_frac
        node = int(view.node[rows[0]])
        return Placement(
            node=node,
            node_id=s.node_ids[node],
            rows=rows,
            gpu_indices=tuple(int(s.gpu_index[r]) for r in rows),
            gpu_uuids=tuple(s.gpu_uuid[r] for r in rows),
            score=ScoreBreakdown(policy=self.NAME, total=total, terms=terms, candidates=candidates),
        )

    def _choose_set(
        self, view: PlacementView, spec: TaskSpec, candidates: np.ndarray, scores: np.ndarray
    ) -> Placement | None:
        """Best k-set on one node (see module docstring)."""
        width = view.uniform_width
        if 0 < width <= _MAX_RANK:
            if _compiled_set_search(spec):
                return self._choose_set_compiled(view, spec, candidates, scores, width)
            return self._choose_set_uniform(view, spec, candidates, scores, width)
        return self._choose_set_general(view, spec, candidates, scores)

    def _choose_set_general(
        self, view: PlacementView, spec: TaskSpec, candidates: np.ndarray, scores: np.ndarray
    ) -> Placement | None:
        """``_choose_set`` for any layout, vectorised over nodes; the reference.

        Works on a (node x rank) grid: row n holds node n's feasible GPUs
        sorted by score. Option A, each node's k best GPUs, is scored for every
        node. Option B, greedy growth along NVLink from every GPU as a seed, can
        only win by its link bonus, so it runs only on nodes whose bound
        ``mean of k best - w_nvlink`` beats option A's best, at most
        ``_SET_SEARCH_NODES`` of them (lowest bound first).
        """
        k = spec.num_gpus
        needs = spec.needs_nvlink
        rows = np.flatnonzero(candidates & np.isfinite(scores))
        nodes = view.node[rows]
        ok = np.bincount(nodes, minlength=view.node_count) >= k
        if needs:
            ok &= view.node_has_nvlink
        keep = ok[nodes]
        rows, nodes = rows[keep], nodes[keep]
        if rows.size == 0:
            return None
        if not view.nodes_contiguous:
            by_node = np.argsort(nodes, kind="stable")
            rows, nodes = rows[by_node], nodes[by_node]
        new = np.empty(rows.size, dtype=bool)
        new[0] = True
        np.not_equal(nodes[1:], nodes[:-1], out=new[1:])
        starts = np.flatnonzero(new)
        group = np.cumsum(new) - 1
        pos = np.arange(rows.size) - starts[group]
        if int(pos.max()) >= _MAX_RANK:
            # rank bit masks hold 62 GPUs per node; no node has more in practice
            inside = pos < _MAX_RANK
            rows, group, pos = rows[inside], group[inside], pos[inside]
        groups = starts.size
        width = int(pos.max()) + 1

        # scores and rows by (node, rank); padding is inf / -1 and sorts last
        if rows.size == groups * width:
            # every node offers the same number of GPUs (the common case): no padding
            grid = scores[rows].reshape(groups, width)
            row_grid = rows.reshape(groups, width)
        else:
            grid = np.full((groups, width), np.inf)
            grid[group, pos] = scores[rows]
            row_grid = np.full((groups, width), -1, dtype=np.intp)
            row_grid[group, pos] = rows
        order = np.argsort(grid, axis=1, kind="stable")  # ties: lower row first
        grid = np.take_along_axis(grid, order, axis=1)
        row_grid = np.take_along_axis(row_grid, order, axis=1)
        return self._best_set(view, spec, scores, grid, row_grid, groups)

    def _choose_set_uniform(
        self,
        view: PlacementView,
        spec: TaskSpec,
        candidates: np.ndarray,
        scores: np.ndarray,
        width: int,
        fill: Callable[[np.ndarray], None] | None = None,
        node_low: np.ndarray | None = None,
    ) -> Placement | None:
        """``_choose_set_general`` when every node has ``width`` GPUs in consecutive rows.

        Same decision, less work: the scores reshape to (node x GPU) with
        unusable GPUs at inf, and only the nodes that can matter are sorted.
        A node's objective, and its option B bound, are at least ``mean of
        its k best - w_nvlink`` (no ``- w_nvlink`` without NVLink), hence at
        least ``its best - w_nvlink``. Option A's objective on a probe (the
        node with the lowest such bound in each of ``_SET_SEARCH_NODES``
        blocks of nodes) is an upper bound U of option A's best; a node whose
        bound exceeds U can neither be option A's best nor hopeful for option
        B. ``_best_set`` then runs on the remaining nodes, in node order,
        exactly as the general path runs on all of them (nodes that cannot
        matter change nothing there). ``test_sched_policies`` checks both
        paths give the same placements, to the bit, on random fleets.

        With ``fill``, ``scores`` holds lower bounds of the scores, and
        ``fill(nodes)`` makes the rows of those nodes exact in place: node
        bounds come from the lower bounds (still lower bounds), and every node
        whose GPUs are sorted, probed or chosen is filled first, so only the
        nodes that can matter are scored exactly. ``node_low`` (a new array,
        changed in place): per node a lower bound of the mean score of any k
        of its GPUs (``Policy.node_bounds``), tighter than the best GPU; it
        bounds the nodes and picks the probes (by their ceiling, see
        ``_choose_set_sorted``). With exact scores and not too many nodes,
        ``_choose_set_sorted`` sorts every node instead of probing.
        """
        k = spec.num_gpus
        count = view.node_count
        fill = fill or _no_fill
        usable = candidates & np.isfinite(scores)
        ok = _row_counts(usable.reshape(count, width)) >= k
        if spec.needs_nvlink:
            ok &= view.node_has_nvlink
        nodes = np.flatnonzero(ok)
        groups = int(nodes.size)
        if not groups:
            return None
        grid = _UsableGrid(scores.reshape(count, width), usable.reshape(count, width))
        if groups <= _SET_SEARCH_NODES:
            fill(nodes)
            return self._best_set(view, spec, scores, *grid.sorted_rows(nodes), groups)
        if spec.needs_nvlink and k > 3:
            # option A has no connected set: option B over every linked node
            fill(nodes)
            return self._best_of(view, spec, scores, grid, nodes, grid.sorted_values(nodes), None, np.inf, groups)
        if fill is _no_fill and groups <= _SORT_EVERY_NODE:
            found = self._choose_set_sorted(view, spec, scores, grid, nodes)
            if found is not _UNBOUNDED:
                return found
        bonus = self.weights["nvlink"]
        penalty = _nvlink_penalty(view, bonus)
        if node_low is None:
            # over every GPU of the node, usable or not: a lower bound all the same
            low = _row_min(grid.scores)
            if penalty is not None:
                low -= penalty
            low[~ok] = np.inf
            # probe: the lowest bound of each of _SET_SEARCH_NODES blocks of
            # nodes (the lowest overall among them); their option A gives U
            probe = _block_argmins(low, _SET_SEARCH_NODES)
        else:
            # the mean of k: a tighter bound of the node's objective; probes
            # (which only need to be good guesses; more cost little) by it,
            # by the node's best GPU and by a bound of its ceiling
            node_low[~ok] = np.inf
            low = node_low - penalty if penalty is not None else node_low
            probe = _block_argmins(low, _SET_SEARCH_NODES)
            best_one = self.node_bounds(view, spec, 1)  # as many by their best GPU
            if best_one is not None:
                if penalty is not None:
                    best_one -= penalty
                best_one[~ok] = np.inf
                probe = np.concatenate([probe, _block_argmins(best_one, _SET_SEARCH_NODES)])
            if bonus:
                # and as many by the bound of their ceiling (the fewest links
                # any k of their GPUs have): nodes whose objective is surely low
                fewest = view.min_links(k)
                guess = node_low - bonus * fewest / (k * (k - 1) / 2)
                if spec.needs_nvlink:  # prefer nodes whose every k-set is connected
                    guess[fewest < k - 1] += bonus
                probe = np.concatenate([probe, _block_argmins(guess, _SET_SEARCH_NODES)])
        fill(probe)
        upper = float(self._option_a(view, spec, *grid.sorted_rows(probe))[0].min())
        if not upper < np.inf:  # no probe has a connected option A set (needs_nvlink)
            fill(nodes)
            return self._best_of(view, spec, scores, grid, nodes, grid.sorted_values(nodes), None, upper, groups)
        return self._best_of(view, spec, scores, grid, *grid.at_most(low, upper, penalty, k, fill), upper, groups)

    def _choose_set_sorted(
        self, view: PlacementView, spec: TaskSpec, scores: np.ndarray, grid: "_UsableGrid", nodes: np.ndarray
    ) -> Placement | None | object:
        """``_choose_set_uniform`` with exact scores, sorting the scores of
        every candidate node ``nodes`` once (one sort of a few thousand short
        rows costs less than the steps that would spare it).

        With every node's mean of k best known, its option A objective lies
        between its floor ``mean - w_nvlink * most links among any k of its
        GPUs / (k(k-1)/2)`` and its ceiling (the same with the fewest links;
        inf for needs_nvlink unless any k of its GPUs are connected), in the
        same float operations as the objective itself, so exactly. The lowest
        ceiling U (first node p; without a finite one, option A's best on the
        nodes of lowest floor) bounds option A's best: only the nodes whose
        floor is below U, or equal to it and not after p (the first node wins
        ties), can be option A's best; their GPUs are sorted and option A
        runs on them. The hopeful nodes are exactly those of the general path
        (every candidate node's ``mean - w_nvlink`` is known), in node order,
        so option B runs on the same nodes. ``_UNBOUNDED`` when U is inf (the
        caller takes the probing route).
        """
        k = spec.num_gpus
        full = k * (k - 1) / 2
        bonus = self.weights["nvlink"]
        if nodes.size * 2 > view.node_count:  # most nodes: sort them all, no gathers
            mean_top = _mean_first(np.sort(np.where(grid.usable, grid.scores, np.inf), axis=1), k)[nodes]
        else:
            mean_top = _mean_first(grid.sorted_values(nodes), k)
        if bonus:
            most_off, fewest_off = _link_discounts(view, bonus, k)
            every = nodes.size == view.node_count  # nodes is then arange: no gathers
            floor = mean_top - (most_off if every else most_off[nodes])
            fewest = view.min_links(k) if every else view.min_links(k)[nodes]
            ceiling = mean_top - (fewest_off if every else fewest_off[nodes])
        else:
            floor = ceiling = mean_top
            fewest = view.min_links(k)[nodes] if spec.needs_nvlink else None
        if spec.needs_nvlink:
            # k-1 links among k <= 3 GPUs connect them (k > 3 never comes here)
            ceiling = np.where(fewest >= k - 1, ceiling, np.inf)
        first = int(np.argmin(ceiling))
        upper = float(ceiling[first])
        if not upper < np.inf:
            # needs_nvlink and no node has every k-set connected: option A
            # on the nodes of lowest floor (the first lowest among them)
            probe = np.argpartition(floor, _SET_SEARCH_NODES - 1)[:_SET_SEARCH_NODES]
            probe = np.sort(np.append(probe[probe != np.argmin(floor)], np.argmin(floor)))
            ids = nodes[probe]
            order = np.argsort(grid.masked(ids), axis=1, kind="stable")[:, :k]
            objective, _ = self._objective_of(view, spec, mean_top[probe], order + (ids * grid.width)[:, None])
            g = int(np.argmin(objective))
            first, upper = int(probe[g]), float(objective[g])
            if not upper < np.inf:
                return _UNBOUNDED
        contenders = np.flatnonzero(floor <= upper)
        if contenders.size > 1:
            contenders = contenders[(floor[contenders] < upper) | (contenders <= first)]
        # option A on the contenders: their means are known, their k best GPUs are not
        ids = nodes[contenders]
        order = np.argsort(grid.masked(ids), axis=1, kind="stable")[:, :k]  # ties: lower row first
        top_rows = order + (ids * grid.width)[:, None]
        objective, links = self._objective_of(view, spec, mean_top[contenders], top_rows)
        g = int(np.argmin(objective))
        best = (float(objective[g]), tuple(int(r) for r in top_rows[g]), float(links[g] / full))
        lower = np.where(view.node_has_nvlink[nodes], mean_top - bonus, np.inf)
        return self._finish_set(
            view, spec, scores, nodes.size, best, lower, lambda h: grid.sorted_rows(nodes[h]), floor,
            lambda h: (grid.masked(nodes[h]), nodes[h]),
        )

    def _best_of(
        self,
        view: PlacementView,
        spec: TaskSpec,
        scores: np.ndarray,
        grid: "_UsableGrid",
        keep: np.ndarray,
        values: np.ndarray,
        rows: np.ndarray | None,
        upper: float,
        groups: int,
    ) -> Placement | None:
        """``_best_set`` over the nodes ``keep`` (ascending; every node that can
        be option A's best or hopeful), their scores sorted (``values``), their
        sorted rows when known (``rows``, else None) and U >= option A's best
        (``upper``), sorting GPU rows only where needed.

        ``lower`` needs every kept node's mean of k best, which the sorted
        scores give; GPU identities (a stable sort) are needed only for
        option A's contenders, whose objective floor ``mean - w_nvlink * most
        links among k of the node's GPUs / (k(k-1)/2)`` is <= U, and for the
        hopeful nodes option B grows sets on.
        """
        k = spec.num_gpus
        full = k * (k - 1) / 2
        bonus = self.weights["nvlink"]
        mean_top = _mean_first(values, k)
        lower = np.where(view.node_has_nvlink[keep], mean_top - bonus, np.inf)
        best: tuple[float, tuple[int, ...], float] = (np.inf, (), 0.0)
        floor = None
        if not (spec.needs_nvlink and k > 3):  # else option A has no connected set
            contenders = keep  # or positions in keep
            if upper < np.inf:
                floor = mean_top - bonus * view.max_links(k)[keep] / full if bonus else mean_top
                contenders = np.flatnonzero(floor <= _with_margin(upper))
                if contenders.size > _SET_SEARCH_NODES:
                    # the kept nodes' ceilings (see _choose_set_sorted) may bound
                    # option A's best closer than U: the first lowest one, p,
                    # and ties after p cannot come first
                    ceiling = mean_top - bonus * view.min_links(k)[keep] / full if bonus else mean_top
                    if spec.needs_nvlink:
                        ceiling = np.where(view.min_links(k)[keep] >= k - 1, ceiling, np.inf)
                    first = int(np.argmin(ceiling))
                    if ceiling[first] < upper:
                        top = float(ceiling[first])
                        contenders = contenders[(floor[contenders] < top)
                                                | ((floor[contenders] == top) & (contenders <= first))]
            if contenders is keep:
                contenders = np.arange(keep.size)
            if rows is None:  # the contenders' k best GPUs (ties: lower row first)
                ids = keep[contenders]
                order = np.argsort(grid.masked(ids), axis=1, kind="stable")[:, :k]
                top_rows = order + (ids * grid.width)[:, None]
            else:
                top_rows = rows[contenders, :k]
            objective_top, links_top = self._objective_of(view, spec, mean_top[contenders], top_rows)
            g = int(np.argmin(objective_top))
            best = (float(objective_top[g]), tuple(int(r) for r in top_rows[g]), float(links_top[g] / full))
        by_position = lambda h: (grid.masked(keep[h]), keep[h])  # noqa: E731
        if rows is None:
            return self._finish_set(
                view, spec, scores, groups, best, lower, lambda h: grid.sorted_rows(keep[h]), floor, by_position
            )
        return self._finish_set(
            view, spec, scores, groups, best, lower, lambda h: (values[h], rows[h]), floor, by_position
        )

    def _option_a(
        self, view: PlacementView, spec: TaskSpec, grid: np.ndarray, row_grid: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per node of a sorted grid: option A's objective, the mean of its k
        best scores, their rows and the NVLink links among them."""
        k = spec.num_gpus
        mean_top = _mean_first(grid, k)
        # option A: each node's k best GPUs
        top_rows = row_grid[:, :k]
        objective_top, links_top = self._objective_of(view, spec, mean_top, top_rows)
        return objective_top, mean_top, top_rows, links_top

    def _objective_of(
        self, view: PlacementView, spec: TaskSpec, mean: np.ndarray, sets: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Per set of GPU rows (one per line of ``sets``, mean score ``mean``):
        the objective and the NVLink links inside it (counted in host-local
        bit space); inf where needs_nvlink and the set is not connected."""
        k = spec.num_gpus
        full = k * (k - 1) / 2
        # column by column: numpy's per-row reductions are slow for rows of k <= 8
        bits = np.left_shift(np.int64(1), view.local_bit[sets])
        top_set = bits[:, 0].copy()
        for j in range(1, k):
            top_set |= bits[:, j]
        top_adj = view.adj_bits[sets]
        count = np.bitwise_count(top_adj[:, 0] & top_set).astype(np.int64)
        for j in range(1, k):
            count += np.bitwise_count(top_adj[:, j] & top_set)
        links = count / 2
        objective = mean - self.weights["nvlink"] * links / full
        if spec.needs_nvlink:
            # k-1 links among k <= 3 GPUs always connect them; larger sets rely on option B
            objective = np.where((links >= k - 1) & (k <= 3), objective, np.inf)
        return objective, links

    def _best_set(
        self,
        view: PlacementView,
        spec: TaskSpec,
        scores: np.ndarray,
        grid: np.ndarray,
        row_grid: np.ndarray,
        groups: int,
        option_a: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None,
    ) -> Placement | None:
        """Option A, then option B on the hopeful nodes, over a grid sorted per node.

        ``grid`` / ``row_grid``: per candidate node (in node order) its usable
        GPUs' scores and rows, ascending by score, lower row first on ties,
        then padding (inf / -1). ``groups``: candidate nodes in all.
        ``option_a``: ``_option_a`` of this grid, when already known.
        """
        k = spec.num_gpus
        full = k * (k - 1) / 2
        bonus = self.weights["nvlink"]
        if option_a is None:
            option_a = self._option_a(view, spec, grid, row_grid)
        objective_top, mean_top, top_rows, links_top = option_a
        g = int(np.argmin(objective_top))
        best = (float(objective_top[g]), tuple(int(r) for r in top_rows[g]), float(links_top[g] / full))
        linked = view.node_has_nvlink[view.node[row_grid[:, 0]]]
        lower = np.where(linked, mean_top - bonus, np.inf)
        return self._finish_set(view, spec, scores, groups, best, lower, lambda h: (grid[h], row_grid[h]))

    def _finish_set(
        self,
        view: PlacementView,
        spec: TaskSpec,
        scores: np.ndarray | None,
        groups: int,
        best: tuple[float, tuple[int, ...], float],
        lower: np.ndarray,
        sorted_of: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]],
        floor: np.ndarray | None = None,
        by_position: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]] | None = None,
    ) -> Placement | None:
        """Option B on the hopeful nodes, then the placement of the best set.

        ``best``: option A's best (objective, rows, link fraction); ``lower``:
        per node, in node order, ``mean of k best - w_nvlink`` (inf without
        NVLink), over a list of nodes that holds every hopeful one;
        ``sorted_of(i)``: the sorted grid and rows of the nodes at positions i.
        ``floor``, when given, per node of the same list: ``mean of k best -
        w_nvlink * most links among k of its GPUs / (k(k-1)/2)``, at most
        (up to rounding) the objective of any set on it. A hopeful node whose
        floor is above option A's best cannot hold a better set, so it is left
        out of the growth, which changes no result: option B replaces option
        A only with a set below it, found first on the same nodes in the
        same order. ``by_position(i)`` (uniform layouts): the usable scores
        (else inf) of the nodes at positions i by GPU position, and their
        node numbers; for pairs it gives each node's best linked pair, which
        is what option B finds there, so option B's result is read from them:
        the first node at the lowest pair, searched in scalars
        (``_best_linked_pair``), with no greedy growth at all.
        """
        k = spec.num_gpus
        needs = spec.needs_nvlink
        bonus = self.weights["nvlink"]
        # option B on the few nodes where links could still win
        hopeful = np.flatnonzero(lower < best[0]) if best[0] < np.inf else np.flatnonzero(lower < np.inf)
        if hopeful.size and (bonus > 0 or needs):
            if hopeful.size > _SET_SEARCH_NODES:
                # the lowest bounds, lower node first on ties (a stable sort:
                # argpartition's choice among ties is its own), in that order
                part = np.argsort(lower[hopeful], kind="stable")[:_SET_SEARCH_NODES]
                hopeful = hopeful[part]
            if floor is not None and best[0] < np.inf:
                hopeful = hopeful[floor[hopeful] <= _with_margin(best[0])]
            if k == 2 and by_position is not None and best[0] < np.inf and hopeful.size:
                # the best NVLink-joined pair of usable GPUs, (a + b) / 2 -
                # w_nvlink as option B computes it: what option B finds there
                sub, ids = by_position(hopeful)
                sums = np.where(view.nvlink_matrix[ids], sub[:, None, :] + sub[:, :, None], np.inf)
                pair = sums.min(axis=(1, 2)) / 2 - bonus  # (a + b) / 2 - bonus is monotone in a + b
                keep = np.flatnonzero(pair <= _with_margin(best[0]))
                if keep.size:
                    # option B's value on a node is its pair value to the bit
                    # (the same float operations), so it is the first node at
                    # the lowest one, in this order, that option B takes
                    at = int(keep[np.argmin(pair[keep])])
                    found = _best_linked_pair(sub[at], view.nvlink_matrix[ids[at]], int(ids[at]) * sub.shape[1], bonus)
                    if found is not None and found[0] < best[0]:
                        best = found
                hopeful = hopeful[:0]
            if hopeful.size:
                found = self._grow_sets(view, *sorted_of(hopeful), k, bonus, needs)
                if found is not None and found[0] < best[0]:
                    best = found

        value, picked, frac = best
        if value == np.inf:
            return None
        return self._placement(view, spec, tuple(sorted(picked)), scores, value, frac, groups)

    @staticmethod
    def _grow_sets(
        view: PlacementView,
        grid: np.ndarray,
        row_grid: np.ndarray,
        k: int,
        bonus: float,
        needs: bool,
    ) -> tuple[float, tuple[int, ...], float] | None:
        """Greedy NVLink growth from every GPU of the given nodes, in lock-step.

        With GPUs numbered by score rank inside each node, "the best-scoring
        NVLink neighbour of the set" is the lowest set bit of (neighbours &
        ~set), and the links a new GPU adds are popcount(its neighbours & set).
        Without a neighbour the set takes the best remaining GPU (and is then
        not a connected set, which needs_nvlink rejects).
        """
        groups, width = grid.shape
        valid = row_grid >= 0
        # padding gets no links and bit 63, which no peer mask holds (row -1
        # reads the last GPU's columns, masked right away)
        local = np.where(valid, view.local_bit[row_grid], 63)
        adj = np.where(valid, view.adj_bits[row_grid], 0)
        # (node, rank a, rank b): 1 when a and b are joined by NVLink; then per
        # (node, rank) the bit mask of its NVLink neighbours' ranks
        pair = (adj[:, :, None] >> local[:, None, :]) & 1
        ranks = np.left_shift(np.int64(1), np.arange(width, dtype=np.int64))
        adjr = np.matmul(pair, ranks)
        # (node, rank) -> flat index, for gathers without take_along_axis
        base = np.arange(0, groups * width, width)[:, None]
        grid_flat = grid.reshape(-1)
        full = k * (k - 1) / 2
        lowest = _LOWEST_BIT if width <= _LOWEST_BIT_WIDTH else None
        if k == 2 and lowest is not None:
            # one step: the best-ranked neighbour, else the best other GPU (rank
            # 0, or 1 for seed 0), which is then no neighbour: links = has
            has = adjr != 0
            at = np.where(has, lowest[adjr], _OTHER_RANK[:width])
            total = grid + grid_flat[base + at]
            links = has.astype(np.int64)
            objective = total / k - bonus * links / full
            if needs:
                objective = np.where(has, objective, np.inf)
            flat = int(np.argmin(objective))
            g, r = divmod(flat, width)
            if not objective[g, r] < np.inf:
                return None
            picked = tuple(int(row_grid[g, b]) for b in sorted((r, int(at[g, r]))))
            return float(objective[g, r]), picked, float(links[g, r] / full)
        all_ranks = (np.left_shift(np.int64(1), _row_counts(valid)) - 1)[:, None]
        chosen = np.repeat(ranks[None, :], groups, axis=0)
        neighbours = adjr.copy()
        total = grid.copy()  # padding seeds stay inf
        links = np.zeros(grid.shape, dtype=np.int64)
        fell_back = np.zeros(grid.shape, dtype=bool)
        adjr_flat = adjr.reshape(-1)
        for _ in range(k - 1):
            free = ~chosen
            cand = neighbours & free
            has = cand != 0
            pick = np.where(has, cand, all_ranks & free)
            if needs:
                fell_back |= ~has
            if lowest is not None:
                rank = lowest[pick]  # the lowest set bit: the best-ranked
                pick = np.left_shift(np.int64(1), rank)
            else:
                pick &= -pick
                rank = np.bitwise_count(pick - 1)
            at = base + rank
            peers = adjr_flat[at]
            links += np.bitwise_count(peers & chosen)
            chosen |= pick
            neighbours |= peers
            total += grid_flat[at]
        objective = total / k - bonus * links / full
        if needs:
            objective = np.where(fell_back, np.inf, objective)
        flat = int(np.argmin(objective))
        g, r = divmod(flat, width)
        if not objective[g, r] < np.inf:
            return None
        picked = tuple(int(row_grid[g, b]) for b in _bits(int(chosen[g, r])))
        return float(objective[g, r]), picked, float(links[g, r] / full)


# Rank bit masks are int64 with the sign bit unused and one spare bit for
# "all ranks" masks: a node offers at most its first 62 feasible GPUs.
_MAX_RANK = 62
# Nodes that get the NVLink greedy search in one decision (lowest bound first).
_SET_SEARCH_NODES = 32
# Set choice bounds nodes by their mean of k (``Policy.node_bounds``) from this many GPUs.
_NODE_BOUNDS_MIN_GPUS = 16_384
# With exact scores, set choice sorts the scores of every candidate node when
# there are at most this many (else it sorts only those a bound keeps).
_SORT_EVERY_NODE = 4096
# Set choice sorts the GPUs of up to this many kept nodes once, by score and
# GPU, rather than by score for all and by GPU for some.
_SORT_ALL_NODES = 256
# A single-GPU decision scores only the candidates when at most 1/_SPARSE of
# the GPUs are (gathering the columns of more costs more than scoring all).
_SPARSE = 5


# Lower bounds of the scores (``Policy.gpu_bounds``) are used from this many
# GPUs by the numpy set choice: below, the columns fit in cache and scoring
# every row is cheaper than the extra steps (on the mixed benchmark fleet:
# 8,000 GPUs slower, 40,000 2-5x faster).
_BOUNDS_MIN_GPUS = 16_384
# ... and from this many by a single-GPU decision, which needs one argmin
# after scoring: with the completion term's cached factor, scoring every row
# costs less up to ~80,000 GPUs (bench_decision.py mixed k1 at 5,000 nodes:
# 149 µs p50 scoring all, 172 µs bounded; at 10,000: 273 and 246 µs).
_ONE_BOUNDS_MIN_GPUS = 65_536

# Rank of the lowest set bit of every mask of up to 8 ranks (0 for 0, never read).
_LOWEST_BIT_WIDTH = 8
_LOWEST_BIT = np.asarray(
    [((m & -m).bit_length() - 1) if m else 0 for m in range(1 << _LOWEST_BIT_WIDTH)], dtype=np.intp
)
# The best GPU other than the seed, by seed rank: rank 1 for seed 0, else rank 0.
_OTHER_RANK = np.asarray([1] + [0] * (_MAX_RANK - 1), dtype=np.intp)


def _bits(mask: int) -> list[int]:
    """Indices of the set bits of ``mask``."""
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


def _compiled_set_search(spec: TaskSpec) -> bool:
    """Whether ``spec``'s set choice runs in ``scheduler.setsearch`` (loaded, and k it covers)."""
    return spec.num_gpus <= setsearch.MAX_K and setsearch.ready()


def _best_linked_pair(
    scores: np.ndarray, linked: np.ndarray, first_row: int, bonus: float
) -> tuple[float, tuple[int, int], float] | None:
    """``Policy._grow_sets`` for k = 2 on one node, in scalars: what it returns
    there when that node's best NVLink-joined pair beats option A (the only
    call site), to the bit and with the same ties.

    ``scores``: the node's usable scores by GPU position (inf: unusable);
    ``linked``: its NVLink matrix by position; ``first_row``: the row of
    position 0. Seeds go in rank order (score, then position: the stable
    sort ``_grow_sets`` gets), each with its best-ranked linked partner; the
    first seed reaching the lowest ``(a + b) / 2 - bonus`` wins. Seeds
    without a partner are left out: their sets (option A's kind, no link)
    never beat option A, so they change nothing where this is used.
    """
    values = scores.tolist()
    ranked = sorted((v, p) for p, v in enumerate(values) if v < math.inf)
    links = linked.tolist()
    best: tuple[float, tuple[int, int], float] | None = None
    for value, p in ranked:
        row = links[p]
        for other, q in ranked:
            if q != p and row[q]:
                objective = (value + other) / 2 - bonus * 1 / 1.0
                if best is None or objective < best[0]:
                    best = (objective, (first_row + min(p, q), first_row + max(p, q)), 1.0)
                break
    return best


def _no_fill(nodes: np.ndarray) -> None:
    """Scores already exact: nothing to fill."""


# ``_choose_set_sorted``: no probe bounds option A (the caller takes another route).
_UNBOUNDED = object()


class _NotExact(Exception):
    """A bound was finite where the exact score is not (the caller scores every row)."""


class _ExactScores:
    """A policy's lower bounds of its scores (uniform layout), made exact node
    by node (``fill``); the values of filled nodes are ``gpu_scores`` to the bit.
    A candidate whose bound is finite must have a finite score (else
    ``_NotExact``): which candidates are usable is read from the bounds."""

    def __init__(
        self, policy: "Policy", view: PlacementView, spec: TaskSpec, candidates: np.ndarray,
        bounds: np.ndarray, width: int,
    ) -> None:
        self.policy, self.view, self.spec, self.width = policy, view, spec, width
        self.candidates = candidates
        self.values = bounds  # a new array (column + shift): filled in place
        self.known = np.zeros(view.node_count, dtype=bool)
        self.complete = False

    def fill(self, nodes: np.ndarray) -> None:
        if self.complete:
            return
        nodes = nodes[~self.known[nodes]]
        if not nodes.size:
            return
        view, width = self.view, self.width
        if nodes.size * width * _SPARSE > view.gpu_count:  # many: score every row at once
            exact = self.policy.gpu_scores(view, self.spec)
            if np.any(self.candidates & np.isfinite(self.values) & ~np.isfinite(exact)):
                raise _NotExact
            self.values[:] = exact
            self.complete = True
            return
        rows = (nodes[:, None] * width + np.arange(width)).reshape(-1)
        exact = self.policy.gpu_scores_at(view, self.spec, rows)
        if exact is None or np.any(self.candidates[rows] & np.isfinite(self.values[rows]) & ~np.isfinite(exact)):
            raise _NotExact
        self.values[rows] = exact
        self.known[nodes] = True


def _row_counts(mask: np.ndarray) -> np.ndarray:
    """True values per row of a C-contiguous 2-D bool array."""
    width = mask.shape[1]
    if width in (1, 2, 4, 8):
        # a row of 1, 2, 4 or 8 bools is one unsigned integer: popcount it
        return np.bitwise_count(mask.view(f"u{width}").reshape(-1))
    return np.count_nonzero(mask, axis=1)


def _nvlink_penalty(view: PlacementView, bonus: float) -> np.ndarray | None:
    """Per node: ``bonus`` if it has NVLink, else 0 (None when ``bonus`` is 0); cached per view."""
    if not bonus:
        return None
    key = ("nvlink_penalty", bonus)
    penalty = view.static_cache.get(key)
    if penalty is None:
        penalty = np.where(view.node_has_nvlink, bonus, 0.0)
        view.static_cache[key] = penalty
    return penalty


def _link_discounts(view: PlacementView, bonus: float, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per node ``bonus * links / (k(k-1)/2)`` for the most and the fewest
    links among any k of its GPUs (the same float operations per node as
    computed in place; cached per view)."""
    key = ("link_discounts", bonus, k)
    cached = view.static_cache.get(key)
    if cached is None:
        full = k * (k - 1) / 2
        cached = (bonus * view.max_links(k) / full, bonus * view.min_links(k) / full)
        view.static_cache[key] = cached
    return cached


def _block_argmins(values: np.ndarray, blocks: int) -> np.ndarray:
    """Ascending indices of the minimum of each of ``blocks`` consecutive
    blocks of ``values`` (first on ties), finite ones only; the overall
    minimum is among them."""
    size = -(-values.size // blocks)
    padded = np.full(blocks * size, np.inf)
    padded[: values.size] = values
    at = padded.reshape(blocks, size).argmin(axis=1) + np.arange(0, blocks * size, size)
    return at[padded[at] < np.inf]


def _with_margin(bound: float) -> float:
    """``bound`` plus a margin for rounding in means and bonuses (bounds are exact in reals)."""
    return bound + 1e-9 * max(1.0, abs(bound))


def _mean_first(grid: np.ndarray, k: int) -> np.ndarray:
    """Mean of the first ``k`` columns per row, as ``grid[:, :k].mean(axis=1)``
    computes it (bit for bit: numpy adds fewer than 8 terms in order, then
    divides), without its per-row reduction overhead."""
    if k >= 8 or grid.shape[1] < k:
        return grid[:, :k].mean(axis=1)
    total = grid[:, 0].copy()
    for j in range(1, k):
        total += grid[:, j]
    total /= k
    return total


def _row_min(grid: np.ndarray) -> np.ndarray:
    """Minimum per row, NaN ignored (NaN only for an all-NaN row); column by
    column for narrow grids (numpy's per-row reduction is slow for short rows)."""
    width = grid.shape[1]
    if width > 16:
        with np.errstate(invalid="ignore"):
            return np.fmin.reduce(grid, axis=1)
    low = grid[:, 0].copy()
    for j in range(1, width):
        np.fmin(low, grid[:, j], out=low)
    return low


class _UsableGrid:
    """A policy's scores as (node x GPU), with the usable GPUs (candidates,
    finite score) marked; unusable ones count as inf where it matters."""

    def __init__(self, scores: np.ndarray, usable: np.ndarray) -> None:
        self.scores = scores
        self.usable = usable
        self.width = scores.shape[1]

    def masked(self, nodes: np.ndarray) -> np.ndarray:
        """Rows of ``nodes``, unusable GPUs at inf."""
        return np.where(self.usable[nodes], self.scores[nodes], np.inf)

    def sorted_rows(self, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(scores, rows) of ``nodes``, each row ascending by score (lower
        row first on ties); unusable GPUs become padding: inf / -1."""
        sub = self.masked(nodes)
        order = np.argsort(sub, axis=1, kind="stable")
        width = self.width
        sub = sub.reshape(-1)[order + np.arange(0, sub.size, width)[:, None]]
        rows = order + (nodes * width)[:, None]
        rows[sub == np.inf] = -1
        return sub, rows

    def sorted_values(self, nodes: np.ndarray) -> np.ndarray:
        """Scores of ``nodes``, each row ascending, unusable GPUs (inf) last."""
        return np.sort(self.masked(nodes), axis=1)

    def at_most(
        self,
        low: np.ndarray,
        bound: float,
        penalty: np.ndarray | None,
        k: int,
        fill: Callable[[np.ndarray], None] | None = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Ascending nodes whose objective bound may be <= ``bound`` (first by
        ``low``, then by the mean of their k best - bonus), their sorted
        scores and, when they are few (one sort of them all is cheaper than
        two of some), their sorted rows (else None). ``fill``: see
        ``Policy._choose_set_uniform``; the nodes kept by ``low`` are filled."""
        limit = _with_margin(bound)
        keep = np.flatnonzero(low <= limit)
        if fill is not None and fill is not _no_fill:
            # the mean of the k lowest bounds is a bound of the mean of the k best
            mean = _mean_first(self.sorted_values(keep), k)
            if penalty is not None:
                mean -= penalty[keep]
            keep = keep[mean <= limit]
            fill(keep)
        rows = None
        if keep.size <= _SORT_ALL_NODES:
            values, rows = self.sorted_rows(keep)
        else:
            values = self.sorted_values(keep)
        mean = _mean_first(values, k)
        if penalty is not None:
            mean -= penalty[keep]
        sel = mean <= limit
        return keep[sel], values[sel], None if rows is None else rows[sel]


class LoadAware(Policy):
    """The weighted multi-metric score of ``scheduler.scoring`` (the default).

    Stateful for the ``spread`` term: the number of the placement that last
    chose each GPU (by uuid, so it survives snapshots), kept as a column per
    GPU layout (the snapshot's ``gpu_uuid`` object, shared while the nodes do
    not change) and rebuilt from the uuids when the layout changes.
    """

    NAME = "load_aware"
    DEFAULT_WEIGHTS = LOAD_AWARE_WEIGHTS
    SCORES_SOME_ROWS = True

    def __init__(self, weights: Mapping[str, float] | None = None) -> None:
        super().__init__(weights)
        self._placements = 0  # placements committed through this policy
        self._chosen_at: dict[str, int] = {}  # gpu uuid -> the placement that last chose it
        self._layout: tuple[object, np.ndarray] | None = None  # (gpu_uuid column, _chosen_at by row)
        self._spread: tuple[int, int, float, np.ndarray | None] | None = None  # (layout id, placements, w, column)

    def _chosen_column(self, view: PlacementView) -> np.ndarray:
        uuids = view.snapshot.gpu_uuid
        if self._layout is None or self._layout[0] is not uuids:
            column = np.full(view.gpu_count, -np.inf)  # never chosen
            row_of = view.row_of
            for gpu_uuid, number in self._chosen_at.items():
                row = row_of.get(gpu_uuid)
                if row is not None:
                    column[row] = number
            self._layout = (uuids, column)
            self._spread = None
        return self._layout[1]

    def _spread_column(self, view: PlacementView) -> np.ndarray | None:
        """``w_spread * R`` per row (``scheduler.scoring``), None when all 0;
        computed once per placement count and layout."""
        w = self.weights["spread"]
        if not w or not self._placements or not view.gpu_count:
            return None
        chosen = self._chosen_column(view)
        key = (id(self._layout[0]), self._placements, w)
        if self._spread is None or self._spread[:3] != key:
            recent = np.subtract(self._placements, chosen)  # placements since; inf if never
            recent /= view.gpu_count
            np.subtract(1.0, recent, out=recent)
            np.maximum(recent, 0.0, out=recent)
            recent *= w
            self._spread = (*key, recent)
        return self._spread[3]

    def commit(self, view: PlacementView, placement: Placement) -> None:
        self._placements += 1
        for gpu_uuid in placement.gpu_uuids:
            self._chosen_at[gpu_uuid] = self._placements
        # the column, if built for this layout, follows; else it is built when
        # a spread weight first asks for it
        if self._layout is not None and self._layout[0] is view.snapshot.gpu_uuid:
            for row in placement.rows:
                self._layout[1][row] = self._placements

    def gpu_scores(self, view: PlacementView, spec: TaskSpec) -> np.ndarray:
        return load_aware_scores(view, spec, self.weights, spread=self._spread_column(view))

    def gpu_scores_at(self, view: PlacementView, spec: TaskSpec, rows: np.ndarray) -> np.ndarray:
        return load_aware_scores(view, spec, self.weights, rows, spread=self._spread_column(view))

    def gpu_bounds(self, view: PlacementView, spec: TaskSpec) -> tuple[np.ndarray, float] | None:
        return load_aware_bounds(view, spec, self.weights)

    def node_bounds(self, view: PlacementView, spec: TaskSpec, k: int) -> np.ndarray | None:
        return load_aware_node_bounds(view, spec, self.weights, k)

    def terms(
        self, view: PlacementView, spec: TaskSpec, rows: Sequence[int], scores: np.ndarray
    ) -> dict[str, float]:
        return load_aware_terms(view, spec, self.weights, rows, self._spread_column(view))


class RoundRobin(Policy):
    """Next feasible GPU after the last one picked, cycling over the snapshot's rows.

    score_g = ((g - cursor - 1) mod G) / G, cursor = row of the last GPU picked
    (found by uuid, so it survives rows moving between snapshots).
    """

    NAME = "round_robin"
    DEFAULT_WEIGHTS = {"nvlink": 0.5}

    def __init__(self, weights: Mapping[str, float] | None = None) -> None:
        super().__init__(weights)
        self._last_uuid: str | None = None
        self._last_row = -1

    def _cursor(self, view: PlacementView) -> int:
        if self._last_uuid is not None:
            row = view.row_of.get(self._last_uuid)
            if row is not None:
                return row
        return self._last_row % max(view.gpu_count, 1) if self._last_row >= 0 else -1

    def _distance(self, view: PlacementView) -> np.ndarray:
        count = max(view.gpu_count, 1)
        arange = view.static_cache.get("arange")
        if arange is None:
            arange = np.arange(view.gpu_count, dtype=np.float64)
            view.static_cache["arange"] = arange
        return ((arange - (self._cursor(view) + 1)) % count) / count

    def gpu_scores(self, view: PlacementView, spec: TaskSpec) -> np.ndarray:
        return self._distance(view)

    def choose(
        self, view: PlacementView, spec: TaskSpec, candidates: np.ndarray
    ) -> Placement | None:
        if spec.num_gpus > 1:
            return super().choose(view, spec, candidates)
        # One GPU: the first candidate after the cursor, found without scoring every row.
        start = self._cursor(view) + 1
        after = candidates[start:]
        if after.any():
            row = start + int(after.argmax())
        elif candidates.any():
            row = int(candidates.argmax())
        else:
            return None
        distance = self._distance_of(view, (row,))
        return self._placement(view, spec, (row,), None, distance, 0.0, int(np.count_nonzero(candidates)))

    def _distance_of(self, view: PlacementView, rows: Sequence[int]) -> float:
        """Mean distance of ``rows`` from the cursor, without a full column."""
        start = self._cursor(view) + 1
        count = max(view.gpu_count, 1)
        return float(np.mean([((r - start) % count) / count for r in rows]))

    def terms(
        self, view: PlacementView, spec: TaskSpec, rows: Sequence[int], scores: np.ndarray | None
    ) -> dict[str, float]:
        return {"distance": self._distance_of(view, rows)}

    def commit(self, view: PlacementView, placement: Placement) -> None:
        last = max(placement.rows, key=lambda r: self._distance_of(view, (r,)))
        self._last_row = int(last)
        self._last_uuid = view.snapshot.gpu_uuid[last]


class WeightedRoundRobin(Policy):
    """Stride scheduling: GPU g gets placements in proportion to its weight.

    weight_g = w_speed * node_speed + w_memory * memory_total / 24 GiB
    score_g  = pass_g + 1 / weight_g     (virtual finish time; the pick adds the stride)

    A GPU seen for the first time starts at the virtual time of the last pick,
    so a new node does not take a burst of catch-up placements.
    """

    NAME = "weighted_round_robin"
    DEFAULT_WEIGHTS = {"speed": 1.0, "memory": 0.0, "nvlink": 0.5}

    def __init__(self, weights: Mapping[str, float] | None = None) -> None:
        super().__init__(weights)
        self._pass: dict[str, float] = {}
        self._vt = 0.0

    def _check(self, weights: Mapping[str, float]) -> None:
        if weights["speed"] == 0 and weights["memory"] == 0:
            raise InvalidWeight("speed", "speed and memory weights cannot both be 0")

    def _arrays(self, view: PlacementView) -> tuple[np.ndarray, np.ndarray]:
        key = ("wrr", id(self), self.weights["speed"], self.weights["memory"])
        cached = view.static_cache.get(key)
        if cached is None:
            s = view.snapshot
            weight = self.weights["speed"] * s.node_speed[view.node] + self.weights[
                "memory"
            ] * (view.total / _REF_MEMORY_MIB)
            stride = 1.0 / np.maximum(weight, 1e-9)
            passes = np.full(view.gpu_count, self._vt)
            for gpu_uuid, value in self._pass.items():
                row = view.row_of.get(gpu_uuid)
                if row is not None:
                    passes[row] = value
            cached = np.stack([passes, stride])
            view.static_cache[key] = cached
        return cached[0], cached[1]

    def gpu_scores(self, view: PlacementView, spec: TaskSpec) -> np.ndarray:
        passes, stride = self._arrays(view)
        return passes + stride

    def terms(
        self, view: PlacementView, spec: TaskSpec, rows: Sequence[int], scores: np.ndarray
    ) -> dict[str, float]:
        return {"virtual_finish": float(np.mean(scores[np.asarray(rows, dtype=np.intp)]))}

    def commit(self, view: PlacementView, placement: Placement) -> None:
        passes, stride = self._arrays(view)
        for row, gpu_uuid in zip(placement.rows, placement.gpu_uuids):
            self._vt = max(self._vt, float(passes[row]))
            passes[row] += stride[row]
            self._pass[gpu_uuid] = float(passes[row])


class LeastConnections(Policy):
    """Fewest active tasks; predicted load breaks ties.

    score_g = active_g + 0.001 * (util_g + reserved_util_g) / 100
    (the tie-break stays below one task for any load up to 1000 %).
    """

    NAME = "least_connections"
    DEFAULT_WEIGHTS = {"nvlink": 0.5}

    def gpu_scores(self, view: PlacementView, spec: TaskSpec) -> np.ndarray:
        return view.active + view.load * 1e-5

    def terms(
        self, view: PlacementView, spec: TaskSpec, rows: Sequence[int], scores: np.ndarray
    ) -> dict[str, float]:
        r = np.asarray(rows, dtype=np.intp)
        return {
            "active": float(view.active[r].mean()),
            "load_tiebreak": float((view.load[r] * 1e-5).mean()),
        }


class Binpack(Policy):
    """Tightest fit: the GPU left with the least free memory, busiest first on ties.

    score_g = (total_g - committed_g - vram) / total_g - 0.001 * (util_g + reserved_util_g) / 100
    Filling GPUs before starting fresh ones keeps whole GPUs (and nodes) free
    for large tasks.
    """

    NAME = "binpack"
    DEFAULT_WEIGHTS = {"nvlink": 0.5}

    def gpu_scores(self, view: PlacementView, spec: TaskSpec) -> np.ndarray:
        left = (view.headroom - spec.vram_mib) * view.inv_total
        left -= view.load * 1e-5
        return left

    def terms(
        self, view: PlacementView, spec: TaskSpec, rows: Sequence[int], scores: np.ndarray
    ) -> dict[str, float]:
        r = np.asarray(rows, dtype=np.intp)
        return {
            "free_after": float(((view.headroom[r] - spec.vram_mib) * view.inv_total[r]).mean()),
            "load_tiebreak": float((-view.load[r] * 1e-5).mean()),
        }


class Fragmentation(Policy):
    """Fragmentation gradient descent (FGD; ``scheduler.fragmentation``):
    the GPU (or set) whose node's expected fragment over the arriving task
    shapes grows least, compute demand past a GPU's capacity counted
    against it, the tightest memory fit on ties.

    score_g = dF_node(g) + w_overcommit * max(0, load_g / 100 + share - 1)
              + w_pack * (free_memory_g - vram) / total_g + w_oom_risk * O(g)
              + w_speed * (1 - fastest / slowdown_g)      (with learned speeds)
              + w_fill * P(vram / total_g)                (with learned memory growth)

    ``dF`` and the overcommit are in GPUs (compute shares), so with the
    default ``w_overcommit = 1`` sharing a busy GPU's compute costs as much
    as leaving that much compute unusable elsewhere; on a GPU already past
    100 % the whole excess counts, so work goes to the least overloaded.
    ``O(g)`` is load_aware's learned chance of outgrowing the GPU
    (``scheduler.scoring``): packing fills the small cards first, which
    whole-GPU tasks then outgrow (on the openb replays fgd lost ~100 runs
    to OOM without it, 46 with it, load_aware 8). The speed term is the share
    of the task's speed lost on g against the fastest GPU for its kind (the
    predictor's slowdown column, as load_aware's completion term but without
    its load stretch, which the overcommit term already counts): at weight 4
    a card 2.4x slower costs 2.3 GPUs of fragment, so fgd sends work to the
    GPUs that finish it soonest and packs among equally fast ones (on the
    openb cluster mean response 11.6 -> 4.3 h, as load_aware's; 0 on a
    homogeneous cluster but for learned per-node residuals). ``P`` is
    load_aware's memory pressure (0 below the 70 % warn level, 1 at the 85 %
    reject level) of the task's own ask on an otherwise empty card: a task
    that alone nearly fills a card has no room left for the growth its next
    phase may bring, and co-tenants do not matter to it (packing them is
    fgd's point; their risk is ``O``). It takes whole-GPU tasks off the small
    cards they would outgrow (on the openb cluster fgd's OOM kills 31 / 18 /
    30 -> 8 / 12 / 17; load_aware 8 / 9 / 12); no openb ask fills 70 % of a
    24 GiB card, so on RTX 4090 clusters it is 0. Like ``O`` it applies once
    memory growth has been learned: it guards against growth, and where
    none is known (the saturation runs) packing is all there is. The mix is the engine's
    ``WorkloadMix`` (every queued task); without one, or before anything
    arrived, the task being placed stands for the mix.
    """

    NAME = "fgd"
    DEFAULT_WEIGHTS = {"overcommit": 1.0, "pack": 0.01, "oom_risk": 2.0, "speed": 4.0, "fill": 2.0, "nvlink": 0.5}

    def _shapes(self, spec: TaskSpec):
        mix = self.workload_mix
        if mix is None or not mix.arrivals:
            alone = WorkloadMix()
            alone.observe(spec)
            return alone.shapes()
        return mix.shapes()

    def _side_terms(
        self, view: PlacementView, spec: TaskSpec, memory: np.ndarray, rows: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(overcommit, pack) terms, weighted, of every GPU or of ``rows``.
        Overcommit is the compute asked beyond the GPU's capacity once the
        task is there, all of it, not only the task's part: on a GPU already
        past 100 % every task runs slower, and more so the further past.
        ``memory``: the free memory of every GPU, or of ``rows``."""
        every = slice(None) if rows is None else rows
        over = view.load[every] / 100.0
        over += spec.gpu_share - 1.0
        np.maximum(over, 0.0, out=over)
        over *= self.weights["overcommit"]
        pack = memory - spec.vram_mib
        pack *= view.inv_total[every]
        pack *= self.weights["pack"]
        return over, pack

    def _fill(self, view: PlacementView, spec: TaskSpec, rows: np.ndarray | None = None) -> np.ndarray | None:
        """``w_fill * P(vram / total)`` of every GPU or of ``rows``; None when
        it is 0 everywhere (no weight, no learned growth, or, as for most
        tasks, an ask under the warn level of the smallest card)."""
        weight = self.weights["fill"]
        if not weight:
            return None
        cfg = view.config
        warn = cfg.memory_warn_pct / 100.0
        # against the smallest card, so a decision's breakdown shows the term
        # (as 0 on a big card) whenever it took part in the choice
        smallest = view.static_cache.get("fgd.inv_total_max")
        if smallest is None:
            smallest = view.static_cache["fgd.inv_total_max"] = float(view.inv_total.max()) if view.inv_total.size else 0.0
        if spec.vram_mib * smallest <= warn or growth_table(view, spec, weight) is None:
            return None
        own = spec.vram_mib * (view.inv_total if rows is None else view.inv_total[rows])
        return weight * memory_pressure(own, warn, cfg.memory_reject_pct / 100.0)

    def gpu_scores(self, view: PlacementView, spec: TaskSpec) -> np.ndarray:
        free = free_resources(view)
        scores = fragmentation_delta(view, spec, self._shapes(spec), free)
        over, pack = self._side_terms(view, spec, free[0])
        scores += over
        scores += pack
        table = growth_table(view, spec, self.weights["oom_risk"])
        if table is not None:
            table.add_risk(scores, view.headroom, spec.vram_mib, self.weights["oom_risk"])
        speed_loss = speed_loss_scores(view, spec, self.weights["speed"])
        if speed_loss is not None:
            scores += speed_loss
        fill = self._fill(view, spec)
        if fill is not None:
            scores += fill
        return scores

    def terms(
        self, view: PlacementView, spec: TaskSpec, rows: Sequence[int], scores: np.ndarray
    ) -> dict[str, float]:
        r = np.asarray(rows, dtype=np.intp)
        # the view is as it was when scored (terms come before the placement is applied)
        over, pack = self._side_terms(view, spec, free_resources(view, r)[0], r)
        terms = {"overcommit": float(over.mean()), "pack": float(pack.mean())}
        risk = np.zeros(len(r))
        table = growth_table(view, spec, self.weights["oom_risk"])
        if table is not None:
            risk[:] = [self.weights["oom_risk"] * table.risk_at(float(view.headroom[i]), spec.vram_mib) for i in r]
            terms["oom_risk"] = float(risk.mean())
        speed_loss = speed_loss_scores(view, spec, self.weights["speed"], r)
        if speed_loss is not None:
            terms["speed"] = float(speed_loss.mean())
        fill = self._fill(view, spec, r)
        if fill is not None:
            terms["fill"] = float(fill.mean())
        rest = scores[r] - over - pack - risk
        for term in (speed_loss, fill):
            if term is not None:
                rest -= term
        terms["fragmentation"] = float(rest.mean())
        return terms


# The one registry (STYLE #5): name -> policy class. Nothing registers itself.
POLICIES: dict[str, type[Policy]] = {
    "round_robin": RoundRobin,
    "weighted_round_robin": WeightedRoundRobin,
    "least_connections": LeastConnections,
    "load_aware": LoadAware,
    "binpack": Binpack,
    "fgd": Fragmentation,
}


def make_policy(name: str, weights: Mapping[str, float] | None = None) -> Policy:
    """A new policy by registered name; UnknownPolicy / InvalidWeight name the culprit."""
    cls = POLICIES.get(name)
    if cls is None:
        raise UnknownPolicy(name, list(POLICIES))
    return cls.create(weights)
