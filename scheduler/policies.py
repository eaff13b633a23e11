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

Policies are swapped at run time (``Scheduler.set_policy``); weights are
validated by name and value. Stateful policies (round robin's cursor, weighted
round robin's virtual times) keep their state across swaps because the
scheduler keeps one instance per name.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Mapping, Sequence

import numpy as np

from scheduler.errors import InvalidWeight, UnknownPolicy
from scheduler.scoring import LOAD_AWARE_WEIGHTS, load_aware_scores, load_aware_terms
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
        if not candidates.any():
            return None
        scores = self.gpu_scores(view, spec)
        if spec.num_gpus == 1:
            masked = np.where(candidates, scores, np.inf)
            row = int(np.argmin(masked))
            if not masked[row] < np.inf:  # NaN or inf: fall back to the finite ones
                finite = candidates & np.isfinite(scores)
                if not finite.any():
                    return None
                row = int(np.argmin(np.where(finite, scores, np.inf)))
            total = float(scores[row])
            count = int(np.count_nonzero(candidates))
            return self._placement(view, spec, (row,), scores, total, 0.0, count)
        return self._choose_set(view, spec, candidates, scores)

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
        """Best k-set on one node (see module docstring), vectorised over nodes.

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
        full = k * (k - 1) / 2
        bonus = self.weights["nvlink"]
        mean_top = grid[:, :k].mean(axis=1)

        # option A: each node's k best GPUs; links counted in host-local bit space
        top_rows = row_grid[:, :k]
        top_adj = view.adj_bits[top_rows]
        top_set = np.bitwise_or.reduce(np.left_shift(np.int64(1), view.local_bit[top_rows]), axis=1)
        links_top = np.bitwise_count(top_adj & top_set[:, None]).sum(axis=1) / 2
        objective_top = mean_top - bonus * links_top / full
        if needs:
            # k-1 links among k <= 3 GPUs always connect them; larger sets rely on option B
            objective_top = np.where((links_top >= k - 1) & (k <= 3), objective_top, np.inf)
        g = int(np.argmin(objective_top))
        best = (float(objective_top[g]), tuple(int(r) for r in top_rows[g]), float(links_top[g] / full))

        # option B on the few nodes where links could still win
        linked = view.node_has_nvlink[view.node[row_grid[:, 0]]]
        lower = np.where(linked, mean_top - bonus, np.inf)
        hopeful = np.flatnonzero(lower < best[0]) if best[0] < np.inf else np.flatnonzero(linked)
        if hopeful.size and (bonus > 0 or needs):
            if hopeful.size > _SET_SEARCH_NODES:
                part = np.argpartition(lower[hopeful], _SET_SEARCH_NODES - 1)[:_SET_SEARCH_NODES]
                hopeful = hopeful[part]
            found = self._grow_sets(view, grid[hopeful], row_grid[hopeful], k, bonus, needs)
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
        safe = np.where(valid, row_grid, 0)
        local = np.where(valid, view.local_bit[safe], -1)
        adj = np.where(valid, view.adj_bits[safe], 0)
        # (node, rank a, rank b): a and b joined by NVLink
        pair = ((adj[:, :, None] >> np.maximum(local, 0)[:, None, :]) & 1).astype(bool)
        pair &= valid[:, None, :] & (local[:, None, :] >= 0)
        one = np.int64(1)
        adjr = np.bitwise_or.reduce(
            np.where(pair, np.left_shift(one, np.arange(width, dtype=np.int64)), 0), axis=2
        )
        size = valid.sum(axis=1)
        chosen = np.broadcast_to(np.left_shift(one, np.arange(width, dtype=np.int64)), grid.shape).copy()
        neighbours = adjr.copy()
        total = grid.copy()  # padding seeds stay inf
        links = np.zeros(grid.shape, dtype=np.int64)
        fell_back = np.zeros(grid.shape, dtype=bool)
        all_ranks = (np.left_shift(one, size) - 1)[:, None]
        for _ in range(k - 1):
            cand = neighbours & ~chosen
            has = cand != 0
            rest = all_ranks & ~chosen
            pick = np.where(has, cand & -cand, rest & -rest)
            fell_back |= ~has
            at = np.bitwise_count(pick - 1).astype(np.intp)  # lowest set bit -> rank
            peers = np.take_along_axis(adjr, at, axis=1)
            links += np.bitwise_count(peers & chosen)
            chosen |= pick
            neighbours |= peers
            total += np.take_along_axis(grid, at, axis=1)
        full = k * (k - 1) / 2
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


def _bits(mask: int) -> list[int]:
    """Indices of the set bits of ``mask``."""
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


class LoadAware(Policy):
    """The weighted multi-metric score of ``scheduler.scoring`` (the default)."""

    NAME = "load_aware"
    DEFAULT_WEIGHTS = LOAD_AWARE_WEIGHTS

    def gpu_scores(self, view: PlacementView, spec: TaskSpec) -> np.ndarray:
        return load_aware_scores(view, spec, self.weights)

    def terms(
        self, view: PlacementView, spec: TaskSpec, rows: Sequence[int], scores: np.ndarray
    ) -> dict[str, float]:
        return load_aware_terms(view, spec, self.weights, rows)


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


# The one registry (STYLE #5): name -> policy class. Nothing registers itself.
POLICIES: dict[str, type[Policy]] = {
    "round_robin": RoundRobin,
    "weighted_round_robin": WeightedRoundRobin,
    "least_connections": LeastConnections,
    "load_aware": LoadAware,
    "binpack": Binpack,
}


def make_policy(name: str, weights: Mapping[str, float] | None = None) -> Policy:
    """A new policy by registered name; UnknownPolicy / InvalidWeight name the culprit."""
    cls = POLICIES.get(name)
    if cls is None:
        raise UnknownPolicy(name, list(POLICIES))
    return cls.create(weights)
