"""Heterogeneity-aware response-time prediction: how long a task will really
take on a given GPU, learned from the tasks that completed there.

A task's ``duration_s`` is its run time alone on a speed-1.0 GPU (RTX 4090).
What it really takes elsewhere is ``duration_s * f``, where the *slowdown*
``f = actual / expected`` depends on the GPU model, on the kind of work (an
old card may be 20x slower at training but only 5x at small inference) and on
the node itself (a throttled host, a slow PCIe link). ``SpeedPredictor``
learns ``f`` as a product of two factors::

    f(node, model, kind) = m(model, kind) * r(node)

    m(model, kind)  learned slowdown of that kind of work on that model;
                    before its first completion, the model's factor over all
                    kinds; before any, the prior 1 / speed(model), speed from
                    the cluster file (``scheduler.cluster``) or the table of
                    known models, 1.0 when neither knows the model
    r(node)         the node's residual: what its completions show beyond
                    m(model, kind); 1.0 before its first completion

Both are EWMAs of the ratio actual / expected, kept in log space because
slowdowns are multiplicative (2x too slow and 2x too fast are equal errors;
the average of 1 and 20 should be about 4.5, not 10.5). A completion's error
``e = log(actual / expected) - log(m * r)`` moves ``log m`` by ``alpha_m * e``
and ``log r`` by ``alpha_r`` times what is left of it, where a factor with n
samples so far uses ``alpha_n = max(alpha, 1 / (n + 1 + prior_weight))``: the
first samples move it quickly away from a poor prior, later ones average
noise with weight ``alpha``. Robustness: ratios are clipped to [1e-3, 1e3],
and once a factor has ``warmup`` samples, one completion may move its sample
at most ``max_step``-fold from the current value (a killed or hung task's
report cannot poison a model; a real change still arrives within a few
completions). A run shorter than 1e-3 of its estimate is not learned at all
(no GPU is that much faster: the report is wrong); ``run_time_s`` says which
run time a completion teaches (none for a task that completed before it was
seen to start and whose client reported no run time).

Model or node? Only the product ``m * r`` is seen on a node, so the split is
fixed by two rules. Residuals are kept with a geometric mean of 1 over the
nodes of each model (a model's mean residual is moved into all of its
factors after every completion, which leaves every prediction for a node
already learned unchanged): a model on one node has all of its slowdown in
``m``, and a new node of the model is predicted like the average of its
peers. And a node's residual learns only from completions whose model
factor (of the kind, or over all kinds for a task of no kind) has had
``warmup`` samples: until then the error is the model's or the kind's (a
poor prior, a new kind), not the node's.

Kinds. Each of at most ``MAX_LEARNED_KINDS`` kinds gets its own factor per
model; a new kind past that takes the place of the kind that completed least
recently (whose factors are dropped; one with fewer than ``warmup``
completions first), so one tenant's kinds never lock another's out for
good, and one-off kinds do not push out the kinds placement relies on. A
task of no kind (``""``) is learned into, and predicted by, the model's
all-kinds factor.

Accuracy. Every completion is predicted *before* the predictor learns from it,
so each one is held out at the time it is predicted (prequential evaluation);
the absolute percentage error ``|predicted - actual| / actual``, at most
``APE_MAX`` (so one near-zero run cannot swamp the mean of hundreds), is
kept over the last ``error_window`` completions, overall, per model (every
kind), per (model, kind) and per node, and its mean is the MAPE.
``evaluate`` scores a separate held-out set without learning from it.

For placement, ``slowdown_columns`` turns the factors into one per-GPU column
per task kind over a ``ClusterSnapshot``; ``annotate`` returns the snapshot
carrying them (``ClusterSnapshot.gpu_slowdown``), which the ``completion``
term of the load-aware score reads (``completion_term``).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass, replace
from typing import Iterable, Mapping, Sequence

import numpy as np

from scheduler.cluster import lookup_model
from scheduler.snapshot import ClusterSnapshot
from scheduler.task import MAX_LEARNED_KINDS

__all__ = [
    "ANY_KIND",
    "APE_MAX",
    "PredictorConfig",
    "Completion",
    "FactorStats",
    "SpeedPredictor",
    "completion_term",
    "model_speeds",
    "run_time_s",
]

#: the key of the kind-independent column in ``slowdown_columns``
ANY_KIND = ""

_RATIO_MIN = 1e-3
_RATIO_MAX = 1e3
#: the most one completion's absolute percentage error counts: a prediction
#: 11 times the actual run (or a run near 0 s) is wrong by an order of
#: magnitude, which is all the figure can say; unbounded, one run reported at
#: a microsecond read as 10^6 and held a 500-completion MAPE in the thousands
#: of percent until it left the window (QA pass 25). Under-predictions are
#: below 1 anyway. One completion moves a window's mean by at most APE_MAX / n.
APE_MAX = 10.0
#: ``overrun``: the quantile of actual / predicted, and the completions it needs
OVERRUN_QUANTILE = 0.9
OVERRUN_MIN_SAMPLES = 20


@dataclass(frozen=True)
class PredictorConfig:
    """Learning rates and windows of ``SpeedPredictor`` (unitless unless named)."""

    # EWMA weight of a new sample once the prior's influence has worn off.
    alpha: float = 0.1
    # The prior counts as this many samples (0: the first completion replaces it).
    prior_weight: float = 1.0
    # Completions over which the (prequential) MAPE is computed.
    error_window: int = 500
    # Node residuals are kept within [1 / max_node_residual, max_node_residual].
    max_node_residual: float = 10.0
    # Samples a factor takes unclipped before max_step applies.
    warmup: int = 3
    # Once warm, one sample counts as at most this many times (or 1/this) the current value.
    max_step: float = 4.0

    def validate(self) -> "PredictorConfig":
        if not (0.0 < self.alpha <= 1.0):
            raise ValueError(f"alpha: must be in (0, 1], got {self.alpha!r}")
        if not (math.isfinite(self.prior_weight) and self.prior_weight >= 0):
            raise ValueError(f"prior_weight: must be a finite number >= 0, got {self.prior_weight!r}")
        if self.error_window < 1:
            raise ValueError(f"error_window: must be >= 1, got {self.error_window!r}")
        if not (math.isfinite(self.max_node_residual) and self.max_node_residual >= 1.0):
            raise ValueError(f"max_node_residual: must be >= 1, got {self.max_node_residual!r}")
        if not (math.isfinite(self.max_step) and self.max_step > 1.0):
            raise ValueError(f"max_step: must be > 1, got {self.max_step!r}")
        if self.warmup < 0:
            raise ValueError(f"warmup: must be >= 0, got {self.warmup!r}")
        return self


@dataclass(frozen=True, slots=True)
class Completion:
    """One completed task as the predictor sees it (also a held-out sample)."""

    node_id: str
    model: str  # GPU model name as the snapshot reports it
    kind: str
    expected_s: float  # s on a speed-1.0 GPU alone (the task's duration_s)
    actual_s: float  # s it really ran


@dataclass(frozen=True, slots=True)
class FactorStats:
    """A learned factor: where it applies, its value and how good it has been."""

    model: str  # empty for a node factor
    kind: str  # empty for a model's all-kinds factor and for node factors
    node_id: str  # empty for model factors
    factor: float  # slowdown: actual / expected (model factors) or residual (node factors)
    prior: float  # the value before any completion
    samples: int  # completions learned from
    mape: float  # mean absolute percentage error (ratio) of its recent predictions; NaN if none
    overrun: float = math.nan  # model-and-kind factors: ``SpeedPredictor.overrun``; NaN otherwise


class _Ewma:
    """A multiplicative factor learned in log space (module docstring)."""

    __slots__ = ("log", "n", "prior")

    def __init__(self, prior: float) -> None:
        self.log = math.log(prior)
        self.prior = prior
        self.n = 0

    @property
    def value(self) -> float:
        return math.exp(self.log)

    def rate(self, cfg: PredictorConfig) -> float:
        return max(cfg.alpha, 1.0 / (self.n + 1.0 + cfg.prior_weight))

    def step(self, error: float, cfg: PredictorConfig) -> float:
        """Move by a share of ``error`` (log units, clipped once warm); returns the move."""
        if self.n >= cfg.warmup:
            bound = math.log(cfg.max_step)
            error = min(max(error, -bound), bound)
        move = self.rate(cfg) * error
        self.log += move
        self.n += 1
        return move


class _Errors:
    """Absolute percentage errors of the last ``size`` predictions."""

    __slots__ = ("values", "total")

    def __init__(self, size: int) -> None:
        self.values: deque[float] = deque(maxlen=size)
        self.total = 0  # predictions ever scored

    def add(self, ape: float) -> None:
        self.values.append(ape)
        self.total += 1

    def mape(self) -> float:
        return float(np.mean(self.values)) if self.values else math.nan


def _ape(predicted: float, actual: float) -> float:
    """Absolute percentage error (ratio) of one prediction, at most ``APE_MAX``."""
    return min(abs(predicted - actual) / actual, APE_MAX)


def model_speeds(snapshot: ClusterSnapshot) -> dict[str, float]:
    """Relative speed per GPU model from a snapshot's ``node_speed`` (the
    cluster file's), the median over the nodes carrying the model. A node
    with GPUs of more than one model says nothing about either (its one
    speed cannot be both), nor does a non-finite or non-positive speed."""
    speeds: dict[str, list[float]] = {}
    node_of = snapshot.gpu_node
    rows_of: dict[int, list[str]] = {}  # node -> the model of each of its GPUs
    for row in range(snapshot.gpu_count):
        rows_of.setdefault(int(node_of[row]), []).append(str(snapshot.gpu_model[row]))
    for node, models in rows_of.items():
        speed = float(snapshot.node_speed[node])
        if len(set(models)) == 1 and math.isfinite(speed) and speed > 0:
            speeds.setdefault(models[0], []).extend([speed] * len(models))
    return {model: float(np.median(v)) for model, v in speeds.items()}


def run_time_s(
    *, reported_s: float | None, started_at: float | None, ended_at: float | None
) -> float | None:
    """The run time a completed task teaches the predictor, or None.

    ``reported_s``: what its client measured (CompleteTask's
    ``actual_duration_s``), taken first; else from ``started_at`` (its
    agent's STARTED event) to ``ended_at``. A task that completed before it
    was seen to start and whose client said nothing teaches nothing: the
    time since its placement is no run time (completed at once, it read as
    a run of a few ms and dropped a new kind's factor 33-fold, QA pass 25).
    ``SpeedPredictor.observe`` then refuses a run implausibly short against
    its estimate."""
    if reported_s is not None:
        return float(reported_s)
    if started_at is None or ended_at is None:
        return None
    return float(ended_at) - float(started_at)


def completion_term(
    slowdown: np.ndarray, load_pct: np.ndarray, share: float, fastest: float | None = None
) -> np.ndarray:
    """C_g = 1 - fastest / t_g, with t_g = slowdown_g * max(1, (load_g + 100 * share) / 100).

    ``t_g`` is the task's predicted run time on GPU g relative to its
    ``duration_s``: the learned slowdown of the GPU, stretched by processor
    sharing when the GPU would be asked for more than 100 %. ``fastest`` is
    the smallest slowdown in the cluster (default: of ``slowdown``), so ``C``
    is the share of the run time lost against the fastest GPU running the
    task alone: 0 there, towards 1 on GPUs many times slower or shared. It is
    unitless, row-local (a row's value needs only its own columns and the
    constant ``fastest``) and independent of ``duration_s``, so it weighs the
    same for a 100 ms request and a day-long job. NaN or non-positive
    slowdowns count as 1.0, NaN load as 100 %.
    """
    s = np.asarray(slowdown, dtype=np.float64)
    s = np.where(np.isfinite(s) & (s > 0), s, 1.0)
    if s.size == 0:
        return s
    if fastest is None:
        fastest = float(s.min())
    load = np.asarray(load_pct, dtype=np.float64)
    stretch = np.maximum(1.0, (np.where(np.isfinite(load), load, 100.0) + 100.0 * share) / 100.0)
    return 1.0 - fastest / (s * stretch)


class SpeedPredictor:
    """Learns per-(model, kind) and per-node slowdowns from completions (module docstring).

    ``prior_speeds``: model name -> relative speed (RTX 4090 = 1.0), e.g.
    ``model_speeds(snapshot)``; models it does not name fall back to the
    table of known models (``scheduler.cluster.KNOWN_MODELS``), then 1.0.
    ``use_known_models=False`` skips the table (a cluster whose speeds are
    unknown: everything starts at 1.0 and is learned).

    Stored, a node's residual is kept in raw form, with its *home* model (the
    model of its first completion) and each model's sum of its home nodes'
    raw logs: ``r(node) = raw - mean(home)`` and ``m(model, kind) = stored +
    mean(model)``. The renormalisation (module docstring) is then one
    addition per completion, however many nodes carry the model.
    """

    def __init__(
        self,
        prior_speeds: Mapping[str, float] | None = None,
        config: PredictorConfig | None = None,
        *,
        use_known_models: bool = True,
    ) -> None:
        self.config = (config or PredictorConfig()).validate()
        self._prior_speeds: dict[str, float] = {}
        self._use_known = use_known_models
        self._models: dict[str, _Ewma] = {}  # model -> all kinds (stored: without the model's mean residual)
        self._model_kinds: dict[tuple[str, str], _Ewma] = {}
        self._nodes: dict[str, _Ewma] = {}  # node -> raw residual (log includes its home's mean)
        self._home: dict[str, str] = {}  # node -> the model its residual belongs to
        self._home_sum: dict[str, float] = {}  # model -> sum of its home nodes' raw logs
        self._home_count: dict[str, int] = {}  # model -> its home nodes
        self._errors = _Errors(self.config.error_window)
        self._model_errors: dict[str, _Errors] = {}  # per model, every kind's completions
        self._model_kind_errors: dict[tuple[str, str], _Errors] = {}
        # per (model, kind), actual / predicted of the last completions: how far
        # runs overrun what is predicted for them (``overrun``)
        self._model_kind_overruns: dict[tuple[str, str], deque[float]] = {}
        self._node_errors: dict[str, _Errors] = {}
        # kinds learned apart -> their completions, least recently completed first
        self._kinds: OrderedDict[str, int] = OrderedDict()
        #: bumped on every change that can move a prediction
        self.version = 0
        self._columns_cache: tuple | None = None
        self._overrun_cache: tuple | None = None
        # per GPU layout (the snapshot's gpu_model and node_ids objects): the
        # distinct models, each row's model code, node id -> node index, each
        # node's raw residual log and home code, patched for the nodes learned
        # from since
        self._layout: tuple | None = None
        self._dirty_nodes: set[str] = set()
        self._home_codes: dict[str, int] = {}  # home model -> its index in the layout's table of means
        self._annotated: tuple | None = None  # (snapshot, columns, overrun columns, annotated snapshot)
        if prior_speeds:
            self.set_priors(prior_speeds)

    # ---- priors ------------------------------------------------------------------
    def set_priors(self, speeds: Mapping[str, float]) -> None:
        """Set model speeds (RTX 4090 = 1.0); factors not yet learned start from them."""
        for model, speed in speeds.items():
            if not (isinstance(speed, (int, float)) and math.isfinite(speed) and speed > 0):
                raise ValueError(f"prior speed of {model!r}: must be a finite number > 0, got {speed!r}")
            self._prior_speeds[str(model)] = float(speed)
            stat = self._models.get(model)
            if stat is not None and stat.n == 0:
                stat.prior = 1.0 / float(speed)
                stat.log = math.log(stat.prior)
        self.version += 1

    def prior(self, model: str) -> float:
        """Prior slowdown of ``model``: 1 / its speed, 1.0 when unknown."""
        speed = self._prior_speeds.get(model)
        if speed is None and self._use_known:
            known = lookup_model(model)
            speed = known.speed if known is not None else None
        return 1.0 / speed if speed else 1.0

    # ---- factors -------------------------------------------------------------------
    def _mean(self, model: str | None) -> float:
        """The mean raw residual log of ``model``'s home nodes (0 without any)."""
        count = self._home_count.get(model, 0) if model is not None else 0
        return self._home_sum[model] / count if count else 0.0

    def model_factor(self, model: str, kind: str = ANY_KIND) -> float:
        """m(model, kind): the learned slowdown, falling back as the docstring says."""
        mean = self._mean(model)
        if kind:
            stat = self._model_kinds.get((model, kind))
            if stat is not None:
                return math.exp(stat.log + mean)
        stat = self._models.get(model)
        return math.exp((stat.log if stat is not None else math.log(self.prior(model))) + mean)

    def node_factor(self, node_id: str, model: str | None = None) -> float:
        """r(node): the node's residual against its model, 1.0 until learned.
        A node restored from a state without homes (before round 25) is
        taken against ``model``, the one it is predicted for: its raw
        residual was relative to that model's whole factor, so once another
        node of the model is homed (the model's mean moves into the model's
        factor) it must lose that mean too, or it is predicted off by it."""
        stat = self._nodes.get(node_id)
        if stat is None:
            return 1.0
        return math.exp(stat.log - self._mean(self._home.get(node_id, model)))

    def factor(self, node_id: str, model: str, kind: str = ANY_KIND) -> float:
        """Predicted slowdown f = actual / expected for this node, model and kind."""
        return self.model_factor(model, kind) * self.node_factor(node_id, model)

    def predict(self, node_id: str, model: str, kind: str, expected_s: float) -> float:
        """Predicted seconds for a task of ``expected_s`` (on a speed-1.0 GPU)."""
        return float(expected_s) * self.factor(node_id, model, kind)

    # ---- learning ------------------------------------------------------------------------
    @staticmethod
    def usable(expected_s: float, actual_s: float) -> bool:
        """Whether a completion can be learned from (and scored): finite
        positive durations, the run not below ``_RATIO_MIN`` of its estimate."""
        return (
            isinstance(expected_s, (int, float))
            and isinstance(actual_s, (int, float))
            and math.isfinite(expected_s)
            and math.isfinite(actual_s)
            and expected_s > 0
            and actual_s >= _RATIO_MIN * expected_s
        )

    def _admit_kind(self, kind: str) -> None:
        """``kind`` completed: it becomes the most recent learned kind, past
        ``MAX_LEARNED_KINDS`` in place of the least recent (its factors go).
        Kinds with fewer than ``warmup`` completions make way first: their
        factors hold little yet, while a warm kind's is what placement
        relies on (a flood of one-off kinds then churns among itself instead
        of pushing out every kind learned before it)."""
        if kind in self._kinds:
            self._kinds.move_to_end(kind)
            self._kinds[kind] += 1
            return
        while len(self._kinds) >= MAX_LEARNED_KINDS:
            old = next((k for k, n in self._kinds.items() if n < self.config.warmup), None)
            if old is None:
                old = next(iter(self._kinds))
            del self._kinds[old]
            for key in [k for k in self._model_kinds if k[1] == old]:
                del self._model_kinds[key]
                self._model_kind_errors.pop(key, None)
                self._model_kind_overruns.pop(key, None)
        self._kinds[kind] = 1

    def _node_entry(self, node_id: str, model: str) -> _Ewma:
        """The node's residual, made (at its model's mean: r = 1) on its first completion."""
        node = self._nodes.get(node_id)
        if node is None:
            node = self._nodes[node_id] = _Ewma(1.0)
            node.log = self._mean(model)
        if node_id not in self._home:  # new, or restored from a state without homes
            self._home[node_id] = model
            self._home_sum[model] = self._home_sum.get(model, 0.0) + node.log
            self._home_count[model] = self._home_count.get(model, 0) + 1
        return node

    def observe(self, node_id: str, model: str, kind: str, expected_s: float, actual_s: float) -> float | None:
        """Learn from one completion; returns its absolute percentage error as
        predicted before learning (None when the sample is unusable: a
        non-positive or non-finite duration, or a run below 1e-3 of its
        estimate)."""
        if not self.usable(expected_s, actual_s):
            return None
        cfg = self.config
        predicted = self.predict(node_id, model, kind, expected_s)
        ape = _ape(predicted, actual_s)
        self._errors.add(ape)
        self._model_errors.setdefault(model, _Errors(cfg.error_window)).add(ape)
        # a task of no kind is learned into (and predicted by) the all-kinds factor
        per_kind = bool(kind)
        key = (model, kind)
        if per_kind:
            self._admit_kind(kind)
            self._model_kind_errors.setdefault(key, _Errors(cfg.error_window)).add(ape)
            overruns = self._model_kind_overruns.get(key)
            if overruns is None:
                overruns = self._model_kind_overruns[key] = deque(maxlen=cfg.error_window)
            overruns.append(actual_s / predicted)
        self._node_errors.setdefault(node_id, _Errors(cfg.error_window)).add(ape)

        log_ratio = math.log(min(actual_s / expected_s, _RATIO_MAX))
        node = self._node_entry(node_id, model)
        home = self._home[node_id]
        home_mean = self._mean(home)
        residual = node.log - home_mean
        mean = self._mean(model)
        all_kinds = self._models.get(model)
        if all_kinds is None:
            all_kinds = self._models[model] = _Ewma(self.prior(model))
            all_kinds.log -= mean  # stored without the model's mean residual
        if per_kind:
            mk = self._model_kinds.get(key)
            if mk is None:
                # a new kind on a known model starts from the model's all-kinds factor
                mk = self._model_kinds[key] = _Ewma(math.exp(all_kinds.log + mean))
                mk.log = all_kinds.log
            # the model (kind) factor takes its share of the error, the node
            # residual a share of what is left; the all-kinds factor follows too
            error = log_ratio - (mk.log + mean + residual)
            all_kinds.step(log_ratio - (all_kinds.log + mean + residual), cfg)
            learner = mk
        else:
            error = log_ratio - (all_kinds.log + mean + residual)
            learner = all_kinds
        warm = learner.n >= cfg.warmup
        moved = learner.step(error, cfg)
        if warm:
            # until its model factor is warm, the error is the model's or the
            # kind's (a poor prior, a kind just seen), not the node's
            before = node.log
            node.step(error - moved, cfg)
            bound = math.log(cfg.max_node_residual)
            node.log = min(max(node.log, home_mean - bound), home_mean + bound)
            self._home_sum[home] += node.log - before
        self._dirty_nodes.add(node_id)
        self.version += 1
        return ape

    def observe_completion(self, c: Completion) -> float | None:
        return self.observe(c.node_id, c.model, c.kind, c.expected_s, c.actual_s)

    def forget_node(self, node_id: str) -> bool:
        """Drop a node's residual and errors (it left the cluster for good:
        ``gpulb uncordon`` of a REMOVED node); True when there were any. Its
        model's residuals are renormalised over the nodes left: their
        predictions do not change, and a new node of the model is predicted
        like the average of them."""
        node = self._nodes.pop(node_id, None)
        errors = self._node_errors.pop(node_id, None)
        home = self._home.pop(node_id, None)
        if home is not None and node is not None:
            self._home_count[home] -= 1
            self._home_sum[home] = self._home_sum[home] - node.log if self._home_count[home] else 0.0
            if not self._home_count[home]:
                del self._home_count[home], self._home_sum[home]
        if node is None and errors is None:
            return False
        self._dirty_nodes.add(node_id)
        self.version += 1
        return True

    # ---- accuracy ------------------------------------------------------------------------
    def mape(self) -> float:
        """MAPE (ratio) of the last ``error_window`` completions, each predicted
        before it was learned from; NaN before the first."""
        return self._errors.mape()

    @property
    def samples(self) -> int:
        """Completions learned from: since the first, restored from the saved state after a restart."""
        return self._errors.total

    def evaluate(self, held_out: Iterable[Completion]) -> float:
        """MAPE (ratio) on completions the predictor does not learn from (each
        error at most ``APE_MAX``); NaN if none usable."""
        errors = [
            _ape(self.predict(c.node_id, c.model, c.kind, c.expected_s), c.actual_s)
            for c in held_out
            if self.usable(c.expected_s, c.actual_s)
        ]
        return float(np.mean(errors)) if errors else math.nan

    def stats(self) -> tuple[list[FactorStats], list[FactorStats]]:
        """(model factors, node factors): per model its all-kinds factor
        (kind "", its MAPE over every completion on the model) and one per
        learned kind; per node its residual."""
        models: list[FactorStats] = []
        for model in sorted(self._models):
            stat = self._models[model]
            errors = self._model_errors.get(model)
            models.append(FactorStats(model, ANY_KIND, "", self.model_factor(model), stat.prior, stat.n,
                                      errors.mape() if errors else math.nan))
            for (m, kind), mk in sorted(self._model_kinds.items()):
                if m == model:
                    err = self._model_kind_errors.get((m, kind))
                    models.append(FactorStats(model, kind, "", self.model_factor(model, kind), mk.prior, mk.n,
                                              err.mape() if err else math.nan, self.overrun(model, kind)))
        nodes = [
            FactorStats("", "", node_id, self.node_factor(node_id), stat.prior, stat.n,
                        self._node_errors[node_id].mape() if node_id in self._node_errors else math.nan)
            for node_id, stat in sorted(self._nodes.items())
        ]
        return models, nodes

    @property
    def kinds(self) -> frozenset[str]:
        """Task kinds learned apart now (at most ``MAX_LEARNED_KINDS``)."""
        return frozenset(self._kinds)

    # ---- durability ---------------------------------------------------------------------------------
    STATE_VERSION = 1

    def to_state(self) -> dict:
        """What was learned, as plain JSON-able data (``load_state`` reads it
        back): every factor's log value (stored form, class docstring),
        sample count and prior, each node's home model, the learned kinds
        least recently completed first, and the recent errors behind the
        overall MAPE. Per-factor error windows are
        left out, the overrun windows too (a large cluster's would be
        megabytes per save; they refill with the next completions, and until
        a kind has 20 again the backfill's margin is the factor alone), and
        so are the cluster's priors (they come from the cluster again after a
        restart). ``node_models`` and ``kinds`` are new in round 25: a
        release before reads the rest and ignores them."""
        return {
            "version": self.STATE_VERSION,
            "models": [[m, e.log, e.n, e.prior] for m, e in sorted(self._models.items())],
            "model_kinds": [[m, k, e.log, e.n, e.prior] for (m, k), e in sorted(self._model_kinds.items())],
            "nodes": [[n, e.log, e.n] for n, e in sorted(self._nodes.items())],
            "node_models": {n: m for n, m in sorted(self._home.items())},
            "kinds": list(self._kinds),
            "errors": list(self._errors.values),
            "samples": self._errors.total,
        }

    def load_state(self, state: Mapping) -> None:
        """Continue from ``to_state``'s output: replaces every learned factor.
        Raises ValueError (nothing changed) on data this version cannot read.
        Rows of the empty kind (an older release learned tasks of no kind
        as a kind of their own) are dropped, and errors are bounded by
        ``APE_MAX`` as if scored now. A state without ``node_models`` (before
        round 25) gives each node its home model at its next completion."""
        try:
            if state.get("version") != self.STATE_VERSION:
                raise ValueError(f"version {state.get('version')!r}, expected {self.STATE_VERSION}")

            def ewma(log: float, n: int, prior: float) -> _Ewma:
                log, n, prior = float(log), int(n), float(prior)
                if not (math.isfinite(log) and math.isfinite(prior) and prior > 0 and n >= 0):
                    raise ValueError(f"bad factor {log!r}, {n!r}, {prior!r}")
                e = _Ewma(prior)
                e.log, e.n = log, n
                return e

            models = {str(m): ewma(log, n, prior) for m, log, n, prior in state["models"]}
            model_kinds = {(str(m), str(k)): ewma(log, n, prior) for m, k, log, n, prior in state["model_kinds"]
                           if str(k)}
            nodes = {str(node): ewma(log, n, 1.0) for node, log, n in state["nodes"]}
            homes = {str(n): str(m) for n, m in dict(state.get("node_models") or {}).items() if str(n) in nodes}
            order = [str(k) for k in state.get("kinds") or ()]
            errors = [float(e) for e in state["errors"]]
            samples = int(state["samples"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"predictor state cannot be read: {exc}") from None
        # the learned kinds, least recent first (an older state's in name order),
        # at most MAX_LEARNED_KINDS: the most recent kept
        present = {k for _, k in model_kinds}
        kinds = [k for k in dict.fromkeys(order) if k in present]
        kinds += sorted(present - set(kinds))
        kinds = kinds[-MAX_LEARNED_KINDS:] if len(kinds) > MAX_LEARNED_KINDS else kinds
        kept = set(kinds)
        self._models, self._nodes = models, nodes
        self._model_kinds = {key: e for key, e in model_kinds.items() if key[1] in kept}
        self._kinds = OrderedDict((k, 0) for k in kinds)
        for (_, k), e in self._model_kinds.items():
            self._kinds[k] += e.n
        self._home, self._home_sum, self._home_count = homes, {}, {}
        for node_id, model in homes.items():
            self._home_sum[model] = self._home_sum.get(model, 0.0) + nodes[node_id].log
            self._home_count[model] = self._home_count.get(model, 0) + 1
        self._model_errors, self._model_kind_errors, self._model_kind_overruns, self._node_errors = {}, {}, {}, {}
        self._errors = _Errors(self.config.error_window)
        self._errors.values.extend(min(e, APE_MAX) for e in errors if math.isfinite(e) and e >= 0)
        self._errors.total = samples
        self._layout = None  # every residual may have changed
        self.version += 1

    # ---- per-GPU columns for placement ------------------------------------------------------------
    def slowdown_columns(
        self, snapshot: ClusterSnapshot, kinds: Sequence[str] | None = None
    ) -> dict[str, np.ndarray]:
        """Per task kind (``ANY_KIND`` always included), the predicted slowdown
        of every GPU row of ``snapshot``: ``m(model_g, kind) * r(node_g)``.

        Cached for the last snapshot layout and predictor version, so calling
        it per snapshot costs nothing while nothing was learned."""
        wanted = tuple(sorted({ANY_KIND, *(self._kinds if kinds is None else kinds)}))
        key = (id(snapshot.gpu_model), id(snapshot.node_ids), self.version, wanted)
        cached = self._columns_cache
        if cached is not None and cached[0] == key and cached[1] is snapshot.gpu_model and cached[2] is snapshot.node_ids:
            return cached[3]
        models, codes, residual = self._layout_for(snapshot)
        per_gpu_residual = residual[snapshot.gpu_node] if snapshot.gpu_count else np.zeros(0)
        out: dict[str, np.ndarray] = {}
        for kind in wanted:
            table = np.asarray([self.model_factor(str(m), kind) for m in models], dtype=np.float64)
            column = table[codes] * per_gpu_residual if snapshot.gpu_count else np.zeros(0)
            column.flags.writeable = False
            out[kind] = column
        self._columns_cache = (key, snapshot.gpu_model, snapshot.node_ids, out)
        return out

    def _home_code(self, node_id: str) -> int:
        """The node's home model as an index into the layout's means (-1: none)."""
        home = self._home.get(node_id)
        if home is None:
            return -1
        code = self._home_codes.get(home)
        if code is None:
            code = self._home_codes[home] = len(self._home_codes)
        return code

    def _layout_for(self, snapshot: ClusterSnapshot) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(distinct models, each row's model code, residual per node) of the
        snapshot's layout: built once per layout (np.unique over the model
        names and a residual per node cost ~1 ms on 6,000 GPUs, and the
        simulator asks per snapshot), then only the raw residuals of the
        nodes learned from since are refreshed; each is then taken from its
        home model's mean (one subtraction over the nodes)."""
        layout = self._layout
        if layout is None or layout[0] is not snapshot.gpu_model or layout[1] is not snapshot.node_ids:
            models, codes = np.unique(np.asarray(snapshot.gpu_model, dtype=str), return_inverse=True)
            node_index = {n: i for i, n in enumerate(snapshot.node_ids)}
            raw = np.asarray([self._nodes[n].log if n in self._nodes else 0.0 for n in snapshot.node_ids],
                             dtype=np.float64)
            home = np.asarray([self._home_code(n) for n in snapshot.node_ids], dtype=np.intp)
            # each node's model (its first GPU's): a homeless node is taken against it (node_factor)
            first = {}
            for row, n in enumerate(snapshot.gpu_node.tolist()):
                first.setdefault(n, row)
            node_model = [str(snapshot.gpu_model[first[i]]) if i in first else "" for i in range(len(snapshot.node_ids))]
            layout = self._layout = (snapshot.gpu_model, snapshot.node_ids, models, codes, node_index, raw, home,
                                     node_model)
        else:
            node_index, raw, home = layout[4], layout[5], layout[6]
            for node_id in self._dirty_nodes:
                i = node_index.get(node_id)
                if i is not None:
                    stat = self._nodes.get(node_id)
                    raw[i] = stat.log if stat is not None else 0.0
                    home[i] = self._home_code(node_id)
        self._dirty_nodes.clear()
        means = np.zeros(len(self._home_codes) + 1)  # the last: no home (-1), mean 0
        for model, code in self._home_codes.items():
            means[code] = self._mean(model)
        if self._home_codes and (home < 0).any():
            # homeless (restored without homes): against the model it runs, as node_factor
            home = home.copy()
            node_ids = layout[1]
            for i in np.flatnonzero(home < 0):
                if node_ids[i] in self._nodes:  # a node never learned from has no residual: 1.0
                    home[i] = self._home_codes.get(layout[7][i], -1)
        residual = np.exp(raw - means[home]) if raw.size else np.zeros(0)
        return layout[2], layout[3], residual

    def overrun(self, model: str, kind: str) -> float:
        """How many times its prediction a run of ``kind`` on ``model`` may
        take: the ``OVERRUN_QUANTILE`` of actual / predicted over its last
        completions (``error_window``), each predicted before it was learned
        from. NaN with fewer than ``OVERRUN_MIN_SAMPLES``. Near 1 where
        clients' estimates are good (what the learned slowdown corrects is a
        bias; this is the scatter left around it); 3 or more where they
        misjudge run times by factors. The backfill widens its margin to it."""
        values = self._model_kind_overruns.get((model, kind))
        if values is None or len(values) < OVERRUN_MIN_SAMPLES:
            return math.nan
        return float(np.quantile(np.fromiter(values, dtype=np.float64, count=len(values)), OVERRUN_QUANTILE))

    def overrun_columns(self, snapshot: ClusterSnapshot) -> dict[str, np.ndarray]:
        """Per task kind learned, ``overrun(model_g, kind)`` of every GPU row
        of ``snapshot`` (NaN where too few completions). Cached per snapshot
        layout and predictor version, as ``slowdown_columns``."""
        key = (id(snapshot.gpu_model), id(snapshot.node_ids), self.version)
        cached = self._overrun_cache
        if cached is not None and cached[0] == key and cached[1] is snapshot.gpu_model and cached[2] is snapshot.node_ids:
            return cached[3]
        models, codes, _ = self._layout_for(snapshot)
        out: dict[str, np.ndarray] = {}
        for kind in sorted(self._kinds):
            table = np.asarray([self.overrun(str(m), kind) for m in models], dtype=np.float64)
            if np.isnan(table).all():
                continue
            column = table[codes] if snapshot.gpu_count else np.zeros(0)
            column.flags.writeable = False
            out[kind] = column
        self._overrun_cache = (key, snapshot.gpu_model, snapshot.node_ids, out)
        return out

    def completion_times(self, snapshot: ClusterSnapshot, kind: str, expected_s: float) -> np.ndarray:
        """Predicted seconds a task of ``expected_s`` would run on each GPU row, alone."""
        columns = self.slowdown_columns(snapshot, kinds=(kind,))
        return float(expected_s) * columns.get(kind, columns[ANY_KIND])

    def annotate(self, snapshot: ClusterSnapshot) -> ClusterSnapshot:
        """``snapshot`` carrying the current slowdown columns (a new object
        when they differ from what it carries, so views and caches keyed by
        the snapshot stay correct)."""
        columns = self.slowdown_columns(snapshot)
        overruns = self.overrun_columns(snapshot)
        if snapshot.gpu_slowdown is columns and snapshot.gpu_overrun is overruns:
            return snapshot
        last = self._annotated
        if last is not None and last[0] is snapshot and last[1] is columns and last[2] is overruns:
            return last[3]  # the same snapshot again: the same annotated object (the scheduler's view stays warm)
        annotated = replace(snapshot, gpu_slowdown=columns, gpu_overrun=overruns)
        self._annotated = (snapshot, columns, overruns, annotated)
        return annotated
