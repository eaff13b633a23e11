"""Speed factors learned from completions (scheduler.predictor)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from scheduler.predictor import (
    ANY_KIND,
    OVERRUN_MIN_SAMPLES,
    Completion,
    PredictorConfig,
    SpeedPredictor,
    completion_term,
    model_speeds,
)
from scheduler.snapshot import ClusterSnapshot, NodeFacts

RTX = "NVIDIA GeForce RTX 4090"
M40 = "Tesla M40 24GB"
K20 = "Tesla K20c"

# truth: slowdown (actual / expected) per (model, kind), and node residuals
TRUE_MODEL = {
    (RTX, "training"): 1.0,
    (RTX, "inference"): 1.0,
    (M40, "training"): 1 / 0.12,
    (M40, "inference"): 5.0,  # small requests lose less on an old card
    (K20, "training"): 20.0,
    (K20, "inference"): 12.0,
}
NODES = {"rtx-0": RTX, "rtx-1": RTX, "m40-0": M40, "m40-1": M40, "k20-0": K20, "k20-1": K20}
TRUE_NODE = {"m40-1": 1.3}  # a throttled host


def synthetic(n: int, seed: int, noise: float = 0.1) -> list[Completion]:
    rng = np.random.default_rng(seed)
    nodes = sorted(NODES)
    out = []
    for _ in range(n):
        node = nodes[rng.integers(len(nodes))]
        model = NODES[node]
        kind = ("training", "inference")[rng.integers(2)]
        expected = float(rng.uniform(10, 1000))
        truth = TRUE_MODEL[(model, kind)] * TRUE_NODE.get(node, 1.0)
        out.append(Completion(node, model, kind, expected, expected * truth * float(rng.lognormal(0.0, noise))))
    return out


def test_factors_converge_on_a_heterogeneous_cluster():
    p = SpeedPredictor({RTX: 1.0, M40: 0.12, K20: 0.05})
    train = synthetic(3000, seed=1)
    for c in train:
        p.observe_completion(c)
    for node, model in NODES.items():
        for kind in ("training", "inference"):
            truth = TRUE_MODEL[(model, kind)] * TRUE_NODE.get(node, 1.0)
            assert p.factor(node, model, kind) == pytest.approx(truth, rel=0.1), (node, kind)
    # the throttled host is told apart from its healthy twin
    assert p.node_factor("m40-1") / p.node_factor("m40-0") == pytest.approx(1.3, rel=0.1)
    # held-out completions, never learned from: error close to the noise (10 % lognormal)
    held_out = synthetic(1000, seed=2)
    assert p.evaluate(held_out) < 0.12
    assert p.mape() < 0.12
    assert p.samples == len(train)


def test_learning_beats_the_prior_when_the_prior_is_wrong():
    # no priors at all: every model starts at 1.0 and is learned
    p = SpeedPredictor(use_known_models=False)
    held_out = synthetic(500, seed=4)
    before = p.evaluate(held_out)
    for c in synthetic(600, seed=3):
        p.observe_completion(c)
    after = p.evaluate(held_out)
    assert before > 0.5 and after < 0.15


def test_prior_from_the_cluster_file_and_the_model_table():
    facts = [NodeFacts("a", 2, model=M40, speed=0.12), NodeFacts("b", 1, model="Mystery X1", speed=0.5)]
    snap = ClusterSnapshot.build(facts)
    speeds = model_speeds(snap)
    assert speeds == {M40: 0.12, "Mystery X1": 0.5}
    p = SpeedPredictor(speeds)
    assert p.factor("a", M40, "training") == pytest.approx(1 / 0.12)
    assert p.predict("b", "Mystery X1", "inference", 10.0) == pytest.approx(20.0)
    # not in the cluster file: the known-model table (K20c 0.05), else 1.0
    assert p.prior(K20) == pytest.approx(20.0)
    assert p.prior("never heard of it") == 1.0
    assert SpeedPredictor(use_known_models=False).prior(K20) == 1.0


def test_first_completion_moves_a_bad_prior_halfway():
    p = SpeedPredictor({M40: 1.0}, PredictorConfig(alpha=0.1, prior_weight=1.0))
    ape = p.observe("n", M40, "training", 100.0, 1600.0)
    assert ape == pytest.approx(abs(100 - 1600) / 1600)  # predicted with the prior, before learning
    # log space: halfway from 1 to 16 is 4; the node residual learns nothing
    # while the model factor is cold (the error is the prior's, not the node's)
    assert p.model_factor(M40, "training") == pytest.approx(4.0)
    assert p.node_factor("n") == pytest.approx(1.0)
    # a new kind on a known model starts from the model's all-kinds factor
    assert p.model_factor(M40, "inference") == pytest.approx(p.model_factor(M40))


@pytest.mark.parametrize(
    "expected, actual",
    [(0.0, 10.0), (10.0, 0.0), (-1.0, 5.0), (math.nan, 5.0), (5.0, math.inf)],
)
def test_unusable_samples_are_ignored(expected, actual):
    p = SpeedPredictor()
    assert p.observe("n", RTX, "training", expected, actual) is None
    assert p.samples == 0 and math.isnan(p.mape())


def test_one_absurd_report_cannot_poison_a_model():
    p = SpeedPredictor()
    for _ in range(20):
        p.observe("n", RTX, "training", 100.0, 100.0)
    p.observe("n", RTX, "training", 1e-9, 1e9)  # a broken report: 10^18 times too slow
    assert p.factor("n", RTX, "training") < 2.0


def test_slowdown_columns_per_kind_and_node():
    facts = [NodeFacts("fast", 2, model=RTX), NodeFacts("slow", 2, model=M40, speed=0.12)]
    snap = ClusterSnapshot.build(facts)
    p = SpeedPredictor(model_speeds(snap))
    for _ in range(30):
        p.observe("slow", M40, "inference", 10.0, 50.0)
    cols = p.slowdown_columns(snap)
    assert set(cols) == {ANY_KIND, "inference"}
    assert cols["inference"][:2].tolist() == [1.0, 1.0]
    assert cols["inference"][2:] == pytest.approx([5.0, 5.0], rel=0.01)
    # the same object while nothing was learned (cheap per snapshot)
    assert p.slowdown_columns(snap) is cols
    times = p.completion_times(snap, "inference", 2.0)
    assert times == pytest.approx([2.0, 2.0, 10.0, 10.0], rel=0.01)
    annotated = p.annotate(snap)
    assert annotated is not snap and annotated.gpu_slowdown is cols
    assert p.annotate(annotated) is annotated


def test_overrun_is_the_scatter_left_after_the_learned_bias():
    """Clients that estimate every training run at a third: the slowdown
    learns the 3, and what is left to overrun is ~1; clients that misjudge
    inference by a log-normal factor (sigma 1): its 90th percentile of
    actual / predicted is near exp(1.28) = 3.6. NaN until enough completions."""
    facts = [NodeFacts("a", 2, model=RTX), NodeFacts("b", 2, model=M40, speed=0.12)]
    snap = ClusterSnapshot.build(facts)
    p = SpeedPredictor(model_speeds(snap))
    rng = np.random.default_rng(3)
    for i in range(400):
        p.observe("a", RTX, "training", 100.0, 300.0 * float(rng.lognormal(0.0, 0.05)))
        p.observe("a", RTX, "inference", 10.0, 10.0 * float(rng.lognormal(0.0, 1.0)))
        if i == OVERRUN_MIN_SAMPLES - 2:
            assert math.isnan(p.overrun(RTX, "training"))
    assert p.factor("a", RTX, "training") == pytest.approx(3.0, rel=0.2)
    assert 1.0 < p.overrun(RTX, "training") < 1.3
    assert 2.5 < p.overrun(RTX, "inference") < 5.0
    assert math.isnan(p.overrun(M40, "training"))  # nothing learned on the M40s
    cols = p.overrun_columns(snap)
    assert set(cols) == {"training", "inference"}
    assert cols["inference"][:2] == pytest.approx([p.overrun(RTX, "inference")] * 2)
    assert np.isnan(cols["inference"][2:]).all()
    assert p.overrun_columns(snap) is cols  # cached while nothing is learned
    annotated = p.annotate(snap)
    assert annotated.gpu_overrun is cols and annotated.gpu_slowdown is p.slowdown_columns(snap)


def test_columns_kept_current_between_completions_equal_columns_built_afresh():
    """The layout (models, codes, node residuals) is built once and patched
    for the nodes learned from since: after every completion the columns
    equal those of a predictor that computes them from scratch (to rounding:
    each model's mean residual is kept as a running sum, summed afresh on
    loading)."""
    facts = [NodeFacts(n, 2, model=m, speed=0.12 if m == M40 else 1.0) for n, m in sorted(NODES.items())]
    facts.append(NodeFacts("idle-0", 2, model=RTX))  # never completes anything
    snap = ClusterSnapshot.build(facts)
    p = SpeedPredictor(model_speeds(snap))
    p.slowdown_columns(snap)
    for c in synthetic(60, seed=7):
        p.observe_completion(c)
        fresh = SpeedPredictor(model_speeds(snap))
        fresh.load_state(p.to_state())
        kept, built = p.slowdown_columns(snap), fresh.slowdown_columns(snap)
        assert set(kept) == set(built)
        for kind in built:
            np.testing.assert_allclose(kept[kind], built[kind], rtol=1e-12, err_msg=kind)
    # a snapshot with another layout (a node joined) is built afresh too
    bigger = ClusterSnapshot.build([*facts, NodeFacts("new-0", 1, model=K20)])
    cols = p.slowdown_columns(bigger)
    assert cols[""].shape == (bigger.gpu_count,) and cols[""][-1] == pytest.approx(p.factor("new-0", K20))


@pytest.mark.parametrize(
    "name, slowdown, load, share, fastest, expected",
    [
        ("equal GPUs", [1.0, 1.0], [0.0, 0.0], 0.5, None, [0.0, 0.0]),
        ("20x slower", [1.0, 20.0], [0.0, 0.0], 0.5, None, [0.0, 0.95]),
        ("a shared fast GPU loses time too", [1.0, 2.0], [100.0, 0.0], 1.0, None, [0.5, 0.5]),
        ("overcommit stretches", [1.0, 1.0], [150.0, 0.0], 0.5, None, [0.5, 0.0]),
        ("NaN slowdown is 1", [np.nan, 2.0], [0.0, 0.0], 0.0, None, [0.0, 0.5]),
        ("NaN load is 100 %", [1.0, 1.0], [np.nan, 0.0], 1.0, None, [0.5, 0.0]),
        ("fastest GPU elsewhere", [2.0, 4.0], [0.0, 0.0], 0.5, 1.0, [0.5, 0.75]),
        ("empty", [], [], 0.5, None, []),
    ],
)
def test_completion_term(name, slowdown, load, share, fastest, expected):
    got = completion_term(np.asarray(slowdown), np.asarray(load), share, fastest)
    assert got.tolist() == pytest.approx(expected)


def test_config_is_validated():
    with pytest.raises(ValueError, match="alpha"):
        PredictorConfig(alpha=0).validate()
    with pytest.raises(ValueError, match="prior speed"):
        SpeedPredictor({RTX: 0.0})


# ---- the load-aware "completion" term -------------------------------------------------------------


def _place(snap, spec, weights=None):
    from scheduler.config import SchedulerConfig
    from scheduler.engine import Scheduler

    sched = Scheduler(SchedulerConfig(weights=weights or {}), clock=lambda: 0.0)
    sched.submit(spec, snap)
    (task,) = sched.dispatch(snap)
    return task.assignment


def test_scoring_prefers_the_gpu_that_finishes_sooner_when_load_is_equal():
    from scheduler.task import Priority, TaskSpec

    # the slow node comes first, so without predictions it wins the tie
    facts = [NodeFacts("k20", 1, model=K20, memory_total_mib=24_576.0, speed=0.05), NodeFacts("rtx", 1, model=RTX)]
    snap = ClusterSnapshot.build(facts, util_pct=[20.0, 20.0])
    spec = TaskSpec("p0", priority=Priority.P0, kind="inference", vram_mib=1_000.0, gpu_share=0.3, duration_s=0.1)
    assert _place(snap, spec).node_id == "k20"
    p = SpeedPredictor(model_speeds(snap))
    a = _place(p.annotate(snap), spec)
    assert a.node_id == "rtx"
    assert a.score.terms["completion"] == pytest.approx(0.0)
    # the term is a weight like any other: 0 turns it off
    assert _place(p.annotate(snap), spec, {"completion": 0.0}).node_id == "k20"


def test_completion_term_trades_against_load_and_agrees_with_the_breakdown():
    from scheduler.task import TaskSpec

    facts = [NodeFacts("rtx", 1, model=RTX), NodeFacts("m40", 1, model=M40, speed=0.12)]
    spec = TaskSpec("t", kind="training", vram_mib=1_000.0, gpu_share=0.5)
    p = SpeedPredictor({RTX: 1.0, M40: 0.12})
    w = {"completion": 1.0}
    # a busy RTX (60 % + 50 % = 110 %: 1.1x) beats an idle M40 (8.3x) ...
    busy = p.annotate(ClusterSnapshot.build(facts, util_pct=[60.0, 0.0]))
    a = _place(busy, spec, w)
    assert a.node_id == "rtx"
    assert a.score.total == pytest.approx(sum(a.score.terms.values()))
    assert a.score.terms["completion"] == pytest.approx(1.0 - 1.0 / 1.1)
    # ... but not a very busy one: the load term weighs the harm to its tenants
    assert _place(p.annotate(ClusterSnapshot.build(facts, util_pct=[90.0, 0.0])), spec, w).node_id == "m40"
    # (at the default weight 2 finishing sooner still wins there)
    assert _place(p.annotate(ClusterSnapshot.build(facts, util_pct=[90.0, 0.0])), spec).node_id == "rtx"
    # and not once the M40 is known to run this kind nearly as fast
    for _ in range(40):
        p.observe("m40", M40, "training", 100.0, 110.0)
    assert _place(p.annotate(ClusterSnapshot.build(facts, util_pct=[60.0, 0.0])), spec, w).node_id == "m40"


def test_state_round_trips_through_json_and_predicts_the_same():
    import json

    learned = SpeedPredictor()
    for c in synthetic(300, seed=3):
        learned.observe_completion(c)
    copy = SpeedPredictor()
    copy.load_state(json.loads(json.dumps(learned.to_state())))
    assert copy.samples == learned.samples == 300
    assert copy.mape() == pytest.approx(learned.mape())
    assert copy.kinds == learned.kinds
    for node, model in NODES.items():
        for kind in ("training", "inference", "never-seen"):
            assert copy.factor(node, model, kind) == pytest.approx(learned.factor(node, model, kind))
    # factors, priors and counts come back; per-factor error windows start afresh (not stored:
    # a large cluster's would be megabytes every save)
    strip = lambda stats: [(f.model, f.kind, f.node_id, f.prior, f.samples) for f in stats[0] + stats[1]]  # noqa: E731
    assert strip(copy.stats()) == strip(learned.stats())
    factors = lambda stats: [f.factor for f in stats[0] + stats[1]]  # noqa: E731
    assert factors(copy.stats()) == pytest.approx(factors(learned.stats()), rel=1e-12)
    # and it keeps learning from there exactly as the original does
    for c in synthetic(20, seed=4):
        assert copy.observe_completion(c) == pytest.approx(learned.observe_completion(c))


@pytest.mark.parametrize(
    "mangle",
    [
        lambda s: s.update(version=99),
        lambda s: s.pop("nodes"),
        lambda s: s["models"].append(["X", "not a number", 1, 1.0]),
        lambda s: s["models"].append(["X", 0.0, 1, -1.0]),
    ],
)
def test_unreadable_state_is_refused_and_changes_nothing(mangle):
    learned = SpeedPredictor()
    for c in synthetic(50, seed=5):
        learned.observe_completion(c)
    state = learned.to_state()
    mangle(state)
    fresh = SpeedPredictor()
    with pytest.raises(ValueError, match="predictor state cannot be read"):
        fresh.load_state(state)
    assert fresh.samples == 0 and fresh.factor("m40-0", M40, "training") == pytest.approx(fresh.prior(M40))
