"""The simulator on small hand-made traces whose right answers are worked out
by hand, its engine adapter, its figures and its command line.

Timing rules used below (SimConfig defaults): a change on a GPU is sampled
2.0 s later and, being a level shift, shows in the view after two more
readings 0.2 s apart, i.e. 2.4 s after it happened; the simulator dispatches
on submission, on completion and when a release becomes visible.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace

import numpy as np
import pytest

from scheduler.advisor import AdvisorConfig
from scheduler.cluster import ClusterNode, homogeneous
from scheduler.config import SchedulerConfig
from scheduler.reservations import Reservations
from scheduler.simreport import figures, ratios, render, to_json
from scheduler.simulator import (
    AskedMemory,
    ColumnarReservations,
    GenAIMemory,
    RatioMemory,
    SimConfig,
    Simulation,
    saturate,
    simulate,
    policy_weights,
    simulate_main,
    trace_main,
)
from scheduler.snapshot import NodeFacts
from scheduler.task import Priority
from scheduler.traces import TraceTask, convert_openb, read_trace, scale_trace, write_trace

VISIBLE = 2.4  # s from a release to the view showing it (see the module docstring)


def task(task_id, submit, duration, vram, share=1.0, priority=Priority.P2, kind="batch", gpus=1, util=None):
    return TraceTask(task_id, float(submit), float(duration), gpus, float(vram), share, priority, kind, util=util)


def run(tasks, nodes, policy="load_aware", memory=None, **cfg):
    config = SimConfig(memory=memory or AskedMemory(), **cfg)
    return Simulation(tasks, nodes, policy, config).run()


def rec(result, task_id):
    return next(r for r in result.records if r.task_id == task_id)


ONE_4090 = homogeneous(1, 1)  # 24,564 MiB; the filter admits up to 85 % = 20,879 MiB
TWO_4090 = homogeneous(1, 2)


# ---- hand-worked cases ---------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["round_robin", "load_aware", "binpack", "least_connections", "weighted_round_robin"])
def test_a_task_that_must_wait(policy):
    # A (15,000 MiB) holds the only GPU from 0 to 100; B (15,000 MiB) arrives at
    # 10 and cannot fit beside it (30,000 > 20,879). A's end is visible at 102.4,
    # so B starts then and ends 50 s later.
    tasks = [task("A", 0, 100, 15_000), task("B", 10, 50, 15_000)]
    r = run(tasks, ONE_4090, policy)
    a, b = rec(r, "A"), rec(r, "B")
    assert (a.first_start_s, a.finish_s, a.wait_s) == (0.0, 100.0, 0.0)
    assert b.first_start_s == pytest.approx(100 + VISIBLE)
    assert b.wait_s == pytest.approx(100 + VISIBLE - 10)
    assert b.finish_s == pytest.approx(100 + VISIBLE + 50)
    assert r.oom_kills == 0 and all(x.state == "completed" for x in r.records)
    assert r.makespan_s == pytest.approx(152.4)


@pytest.mark.parametrize("needs_nvlink", [True, False])
def test_an_nvlink_task_waits_for_a_linked_pair(needs_nvlink):
    # One host of four RTX 4090 with NVLink in pairs (0-1, 2-3: the cluster
    # file's nvlink = pairs). round_robin deals A..D to GPUs 0..3 in turn;
    # they end at 100, 400, 200 and 300. N (two GPUs, 15,000 MiB each) arrives
    # at 1. Free GPUs: {0} from 102.4, {0, 2} from 202.4 (not linked), {0, 2, 3}
    # from 302.4, where 2-3 is a linked pair. Without needs_nvlink, N takes 0
    # and 2 at 202.4.
    host = homogeneous(1, 4, nvlink="pairs")
    tasks = [task(name, 0, end, 15_000) for name, end in zip("ABCD", (100, 400, 200, 300))]
    tasks.append(replace(task("N", 1, 50, 15_000, gpus=2), needs_nvlink=needs_nvlink))
    r = run(tasks, host, "round_robin")
    n = rec(r, "N")
    start = (300 if needs_nvlink else 200) + VISIBLE
    assert n.first_start_s == pytest.approx(start) and n.wait_s == pytest.approx(start - 1)
    assert n.state == "completed" and n.finish_s == pytest.approx(start + 50)


def test_exact_telemetry_removes_the_lag():
    cfg = dict(sample_delay_s=0.0, persist=1)
    r = run([task("A", 0, 100, 15_000), task("B", 10, 50, 15_000)], ONE_4090, **cfg)
    assert rec(r, "B").first_start_s == 100.0 and rec(r, "B").wait_s == 90.0


def test_oom_under_round_robin_but_not_load_aware():
    # Two GPUs. A (8,000 MiB, 50 %) doubles... to 1.9x its ask halfway through
    # (15,200 MiB). B (8,000 MiB, 20 %) is light. C (10,000 MiB, 30 %) arrives third.
    # round_robin: A -> GPU0, B -> GPU1, C -> GPU0 (its turn); at t = 500 A grows
    #   to 15,200 + 10,000 = 25,200 > 24,564 MiB: A is killed, resubmitted asking
    #   15,200, which fits nowhere (GPU0: 10,000 + 15,200; GPU1: 8,000 + 15,200 >
    #   20,879) until B ends at 1,010 and that shows at 1,012.4.
    # load_aware: C goes to the lighter GPU1 (20 % + 30 % < 50 % + 30 %); A grows
    #   alone on GPU0 (15,200 MiB): no kill.
    tasks = [
        task("A", 0, 1000, 8_000, share=0.5),
        task("B", 10, 1000, 8_000, share=0.2),
        task("C", 20, 1000, 10_000, share=0.3),
    ]
    memory = RatioMemory({"A": (1.0, 1.9)})
    rr = run(tasks, TWO_4090, "round_robin", memory)
    la = run(tasks, TWO_4090, "load_aware", memory)
    assert rr.oom_kills == 1 and la.oom_kills == 0
    assert rr.oom_kills_alone == 0  # C shared GPU0 when A grew
    a = rec(rr, "A")
    assert (a.oom_kills, a.runs, a.state) == (1, 2, "completed")
    assert a.first_start_s == 0.0
    # queued from 500 to 1,012.4, then the whole 1,000 s again
    assert a.wait_s == pytest.approx(1010 + VISIBLE - 500)
    assert a.finish_s == pytest.approx(1010 + VISIBLE + 1000)
    assert all(x.state == "completed" and x.runs == 1 for x in la.records)
    assert rec(la, "A").finish_s == 1000.0


def test_without_telemetry_placement_goes_by_asks_and_repeats_the_oom():
    # One GPU. A asks 6,000 MiB but uses 19,000 from the start; B (6,000, uses
    # 6,000) arrives at 10. With readings, B sees 19,000 + 6,000 > 20,879 (85 %)
    # and waits for A's end (visible at 102.4). Placing by asks only
    # ("@requests"), 6,000 + 6,000 fits on paper: B starts at 10, the GPU needs
    # 25,000 > 24,564 MiB, and B is killed; re-asking what it used (6,000) it
    # is placed and killed again, until its third run is its last.
    tasks = [task("A", 0, 100, 6_000), task("B", 10, 50, 6_000)]
    memory = RatioMemory({"A": (19_000 / 6_000,)})
    seeing = run(tasks, ONE_4090, "round_robin", memory)
    assert seeing.oom_kills == 0 and rec(seeing, "B").first_start_s == pytest.approx(100 + VISIBLE)
    for policy in ("round_robin@requests", "load_aware@requests"):
        blind = run(tasks, ONE_4090, policy, memory)
        assert blind.policy == policy
        b = rec(blind, "B")
        assert (blind.oom_kills, b.oom_kills, b.runs, b.state) == (3, 3, 3, "dropped")
        assert b.first_start_s == 10.0 and rec(blind, "A").finish_s == 100.0
    with pytest.raises(ValueError, match="unknown policy 'round_robin@guess'"):
        Simulation(tasks, ONE_4090, "round_robin@guess")


def test_aging_lets_an_old_background_task_pass_a_new_interactive_one():
    # X fills the GPU until 2,000. L (P3) waits from 1; H (P1) arrives at 1,500.
    # Only one of them fits at a time. By 2,002.4 L has aged P3 -> P2 (600 s)
    # -> P1 (300 s) -> P0 (30 s): it goes first, and H waits for L's end.
    tasks = [
        task("X", 0, 2000, 15_000, priority=Priority.P0),
        task("L", 1, 100, 15_000, priority=Priority.P3),
        task("H", 1500, 100, 15_000, priority=Priority.P1),
    ]
    aged = run(tasks, ONE_4090)
    assert rec(aged, "L").first_start_s == pytest.approx(2000 + VISIBLE)
    assert rec(aged, "H").first_start_s == pytest.approx(2000 + VISIBLE + 100 + VISIBLE)
    # without aging (thresholds out of reach), the weighted rounds favour P1
    frozen = run(tasks, ONE_4090, scheduler=SchedulerConfig(promote_after_s=(1e9, 1e9, 1e9)))
    assert rec(frozen, "H").first_start_s == pytest.approx(2000 + VISIBLE)
    assert rec(frozen, "L").first_start_s == pytest.approx(2000 + VISIBLE + 100 + VISIBLE)


def test_p0_sla_miss_is_counted_once():
    # P waits from 10 to 102.4 > 5 s: one SLA miss; the P0 blocker did not wait.
    tasks = [task("X", 0, 100, 15_000, priority=Priority.P0), task("P", 10, 10, 15_000, priority=Priority.P0)]
    r = run(tasks, ONE_4090)
    assert r.sla_misses == 1
    assert figures(r)["sla_misses"] == 1


def test_speed_and_sharing_stretch_durations():
    slow = [NodeFacts("slow", 1, model="X", memory_total_mib=24_000, speed=0.5)]
    r = run([task("A", 0, 100, 1_000)], slow)
    assert rec(r, "A").finish_s == 200.0
    # two tasks asking 100 % each share one GPU: both progress at half rate
    r = run([task("A", 0, 100, 1_000), task("B", 0, 100, 1_000)], ONE_4090)
    assert rec(r, "A").finish_s == 200.0 and rec(r, "B").finish_s == 200.0
    # 60 % + 40 % fits in 100 %: no slowdown
    r = run([task("A", 0, 100, 1_000, share=0.6), task("B", 0, 100, 1_000, share=0.4)], ONE_4090)
    assert rec(r, "A").finish_s == 100.0 and rec(r, "B").finish_s == 100.0


def test_the_predictor_learns_against_the_clients_estimate_as_the_coordinator_does():
    """Tasks estimated at a third of what they run: the learned slowdown of
    their kind is ~3 (actual over estimate), what the backfill then trusts
    their estimates by; exact estimates learn ~1. The run times themselves
    do not depend on the estimate."""
    short = [replace(task(f"t{i}", 200 * i, 150, 1_000, kind="training"), estimate_s=50.0) for i in range(30)]
    sim = Simulation(short, ONE_4090, "load_aware", SimConfig(memory=AskedMemory()))
    r = sim.run()
    assert all(x.jct_s == pytest.approx(150.0) for x in r.records)
    assert sim.predictor.factor("node-00", ONE_4090[0].model, "training") == pytest.approx(3.0, rel=0.05)
    exact = Simulation([replace(t, estimate_s=None) for t in short], ONE_4090, "load_aware", SimConfig(memory=AskedMemory()))
    exact.run()
    assert exact.predictor.factor("node-00", ONE_4090[0].model, "training") == pytest.approx(1.0, rel=0.05)


def test_oom_at_start_raises_the_ask_until_it_cannot_fit():
    # A really uses 1.25 x 20,000 = 25,000 MiB > 24,564: it dies the moment it
    # starts; resubmitted asking 25,000 MiB it can fit no GPU (REJECTED): dropped.
    r = run([task("A", 0, 100, 20_000)], ONE_4090, "load_aware", RatioMemory({"A": (1.25,)}))
    a = rec(r, "A")
    assert (r.oom_kills, a.oom_kills, a.state) == (1, 1, "dropped")
    assert r.oom_kills_alone == 1 and figures(r)["oom_kills_alone"] == 1  # it outgrew the card alone
    assert "vram_mib" in a.reason
    assert r.oom_kills_idle_room == 0  # no GPU anywhere had 25,000 MiB


def test_oom_kills_that_an_idle_bigger_gpu_could_have_held_are_told_apart():
    # round-robin puts A (really 25,000 MiB) on the 24 GiB card while the 80 GiB one idles
    nodes = [NodeFacts("small", 1), NodeFacts("big", 1, model="NVIDIA A100-SXM4-80GB", memory_total_mib=81_920.0)]
    r = run([task("A", 0, 100, 20_000)], nodes, "round_robin", RatioMemory({"A": (1.25,)}))
    assert (r.oom_kills, r.oom_kills_alone, r.oom_kills_idle_room) == (1, 1, 1)
    assert figures(r)["oom_kills_idle_room"] == 1 and rec(r, "A").state == "completed"  # the retry fits the big one
    # the big card busy with B when A is placed: A's kill was not avoidable without sharing
    busy = run([task("B", 0, 1_000, 30_000), task("A", 1, 100, 20_000)], nodes, "round_robin",
               RatioMemory({"A": (1.25,), "B": (1.0,)}))
    assert (busy.oom_kills, busy.oom_kills_idle_room) == (1, 0)


def test_oom_kills_stop_at_max_attempts():
    # the round-robin case above with one run allowed: A is dropped at its kill
    tasks = [
        task("A", 0, 1000, 8_000, share=0.5),
        task("B", 10, 1000, 8_000, share=0.2),
        task("C", 20, 1000, 10_000, share=0.3),
    ]
    r = run(tasks, TWO_4090, "round_robin", RatioMemory({"A": (1.0, 1.9)}), max_attempts=1)
    a = rec(r, "A")
    assert (a.state, a.oom_kills, a.runs, a.reason) == ("dropped", 1, 1, "out of memory 1 times")
    assert math.isnan(a.finish_s)
    assert figures(r)["dropped"] == 1 and figures(r)["completed"] == 2


def test_unplaceable_task_is_rejected():
    r = run([task("big", 0, 10, 1_000, gpus=8)], homogeneous(2, 4))
    assert rec(r, "big").state == "rejected"
    assert figures(r)["rejected"] == 1


def test_utilisation_figures_by_hand():
    # Two GPUs, one task at 50 % for 100 s, all submitted at 0: window [0, 100].
    r = run([task("A", 0, 100, 1_000, share=0.5)], TWO_4090)
    f = figures(r)
    assert r.window_s == 100.0
    assert f["util_mean"] == pytest.approx(25.0)
    assert f["util_std"] == pytest.approx(25.0) and f["util_var"] == pytest.approx(625.0)
    assert f["util_std_inst"] == pytest.approx(25.0)
    assert f["hottest_gpu_util"] == pytest.approx(50.0)
    assert f["hottest_node_util"] == pytest.approx(25.0)
    assert f["hottest_gpu_time_above_90"] == 0.0
    assert f["util_spread_means"] == pytest.approx(50.0)
    r = run([task("A", 0, 100, 1_000, share=1.0)], TWO_4090)
    assert figures(r)["hottest_gpu_time_above_90"] == 1.0


def test_largest_difference_at_each_moment_and_between_window_means():
    # Round-robin: A (100 %, 0-50 s) on GPU 0, then B (100 %, 50-100 s) on GPU 1; C's
    # submission at 100 s closes the window. At every moment one GPU is full and the
    # other idle; over the window both average 50 %.
    tasks = [task("A", 0, 50, 1_000), task("B", 50, 50, 1_000), task("C", 100, 1, 1_000)]
    r = run(tasks, TWO_4090, policy="round_robin")
    f = figures(r)
    assert f["util_spread"] == pytest.approx(100.0, abs=5.0)  # samples in the 2.4 s changeover may read less
    assert f["util_spread_means"] == pytest.approx(0.0, abs=3.0)
    assert f["util_std"] < 2.0 < 45.0 < f["util_std_inst"]


def test_window_runs_from_first_percentile_to_last_submission():
    # 200 tasks: the window opens at the 2nd task's submission (index 200 // 100)
    tasks = [task(f"t{i}", 10 * i, 5, 1_000, share=1.0) for i in range(200)]
    r = run(tasks, ONE_4090)
    assert r.window_s == pytest.approx(1990 - 20)
    # busy 5 s of every 10 s
    assert figures(r)["util_mean"] == pytest.approx(50.0, abs=0.3)


def test_wait_figures_by_class():
    tasks = [task("A", 0, 100, 15_000), task("B", 10, 50, 15_000, priority=Priority.P0)]
    # without preemption, so the P0 task waits for the batch one (with it: the test above)
    f = figures(run(tasks, ONE_4090, scheduler=SchedulerConfig(preemption=False)))
    assert f["wait_s"]["P0"]["n"] == 1 and f["wait_s"]["P0"]["mean"] == pytest.approx(92.4)
    assert f["wait_s"]["P2"]["mean"] == 0.0
    assert f["wait_s"]["all"]["p50"] == pytest.approx(46.2)
    assert f["jct_s"]["mean"] == pytest.approx((100 + 142.4) / 2)
    assert f["slowdown"]["mean"] == pytest.approx((1 + 142.4 / 50) / 2)


# ---- determinism and the memory model --------------------------------------------------------


def _openb_like(n=300, seed=3):
    rng = random.Random(seed)
    out = []
    t = 0.0
    for i in range(n):
        t += rng.expovariate(1 / 20)
        share = rng.choice([1.0, 1.0, 0.46, 0.25, 0.81])
        out.append(task(f"t{i}", t, rng.choice([30, 300, 3000]), 13_107.2 * share, share=share,
                        priority=Priority(rng.randrange(4))))
    return out


@pytest.fixture(scope="module")
def genai():
    try:
        return GenAIMemory()
    except FileNotFoundError:
        pytest.skip("GenAI trace not available")


def test_genai_ratios_are_seeded_and_plausible(genai):
    t = task("x", 0, 3600, 10_000)
    a = [genai.ratios(t, 0, np.random.default_rng(7)) for _ in range(3)]
    assert a[0] == a[1] == a[2] and len(a[0]) == 4
    short = genai.ratios(task("y", 0, 30, 10_000), 0, np.random.default_rng(1))
    assert len(short) == 1
    pooled = np.concatenate(genai.pods)
    assert np.median(pooled) == pytest.approx(1.0, abs=0.01)
    assert 1.05 < np.percentile(pooled, 95) < 1.3


def test_same_seed_same_result_other_seed_other_draws(genai):
    tasks = _openb_like()
    nodes = homogeneous(2, 4)

    def outcome(seed):
        r = simulate(tasks, nodes, ["load_aware"], SimConfig(seed=seed, memory=genai))[0]
        return [(x.task_id, x.first_start_s, x.finish_s, x.oom_kills) for x in r.records], r.oom_kills

    assert outcome(1) == outcome(1)
    assert outcome(1)[0] != outcome(2)[0]


def test_same_seed_same_result_to_the_bit_within_one_process(tmp_path):
    """Replayed twice in one process, a busy shared cluster with load drift and
    the advisor ends the same to the last bit. The simulator once kept each
    GPU's runs in a set, iterated in the order of the runs' memory addresses:
    same-time events then came in another order from one run to the next, the
    GPUs' demand was summed in another order, and the learning benchmark's
    advisor runs differed from one invocation to the next."""
    from agent.replay import default_trace_dir

    pods = default_trace_dir() / "alibaba-openb" / "openb_pod_list_gpushare40.csv"
    if not pods.exists():
        pytest.skip("openb trace not available")
    tasks, _ = convert_openb(pods, tmp_path / "gpushare40.csv")
    ordered = sorted(tasks, key=lambda t: t.submit_s)[len(tasks) // 100:][:2_000]
    busy = scale_trace([replace(t, submit_s=t.submit_s - ordered[0].submit_s) for t in ordered], 1.0, 6.0)
    cfg = SimConfig(heatmap_samples=600, util_drift=0.5, prediction=False, advisor=AdvisorConfig(), seed=0)

    def outcome():
        r = Simulation(busy, homogeneous(8, 4), "load_aware", cfg).run()
        assert r.migrations > 0
        return (repr([(x.task_id, x.state, x.wait_s, x.jct_s, x.migrations) for x in r.records]),
                r.util_std_time_mean, np.asarray(r.gpu_mean_util).tobytes(), np.asarray(r.heatmap).tobytes())

    first = outcome()
    assert outcome() == first


def test_every_policy_replays_the_same_memory_draws(genai):
    tasks = _openb_like(100)
    results = simulate(tasks, homogeneous(2, 4), ["round_robin", "load_aware"], SimConfig(memory=genai))
    assert [r.policy for r in results] == ["round_robin", "load_aware"]
    assert all(len(r.records) == 100 for r in results)


# ---- the engine adapter -----------------------------------------------------------------------------


def test_columnar_reservations_match_the_engine_on_random_sequences():
    rng = random.Random(11)
    uuids = [f"GPU-{i}" for i in range(12)]
    base, fast = Reservations(), ColumnarReservations(uuids)
    row_of = {u: i for i, u in enumerate(uuids)}
    live: list[str] = []
    for step in range(3000):
        op = rng.random()
        if op < 0.4 or not live:
            key = f"k{step}"
            gpus = rng.sample(uuids, rng.choice([1, 1, 2, 4]))
            used = [rng.choice([math.nan, rng.uniform(0, 20_000)]) for _ in gpus]
            util_now = [rng.choice([math.nan, rng.uniform(0, 100)]) for _ in gpus]
            vram, util = rng.uniform(100, 8_000), rng.uniform(0, 100)
            base.add(key, gpus, vram, util, used, util_now)
            fast.add(key, gpus, vram, util, used, util_now)
            live.append(key)
        elif op < 0.7:
            key = live.pop(rng.randrange(len(live)))
            assert base.release(key) == fast.release(key)
        elif op < 0.85:
            # what the view's refresh does: effective() on one GPU
            u = rng.choice(uuids)
            reading, fresh = rng.uniform(0, 20_000), rng.random() < 0.8
            util_reading = rng.choice([math.nan, rng.uniform(0, 100)])
            gb, gf = base.gpu(u), fast.gpu(u)
            assert (gb is None) == (gf is None)
            if gb is not None:
                assert gb.effective(reading, fresh, util_reading) == gf.effective(reading, fresh, util_reading)
        else:
            used = np.array([rng.choice([math.nan, rng.uniform(0, 20_000)]) for _ in uuids])
            fresh = np.array([rng.random() < 0.8 for _ in uuids])
            # the util readings too, some of the time (as the view passes them)
            util_now = np.array([rng.choice([math.nan, rng.uniform(0, 100)]) for _ in uuids]) if rng.random() < 0.7 else None
            a, b = base.columns(row_of, used, fresh, util_now), fast.columns(row_of, used, fresh, util_now)
            np.testing.assert_allclose(a.vram_mib, b.vram_mib, rtol=1e-12, atol=1e-9)
            np.testing.assert_allclose(a.util_pct, b.util_pct, rtol=1e-12, atol=1e-9)
            np.testing.assert_array_equal(a.leases, b.leases)
            np.testing.assert_allclose(a.asked_mib, b.asked_mib, rtol=1e-12, atol=1e-9)
    # a snapshot in another row order falls back to the base class's gather
    shuffled = list(reversed(uuids))
    other = {u: i for i, u in enumerate(shuffled)}
    used = np.full(len(uuids), 1_000.0)
    fresh = np.ones(len(uuids), dtype=bool)
    np.testing.assert_allclose(base.columns(other, used, fresh).vram_mib, fast.columns(other, used, fresh).vram_mib)


def test_adapter_does_not_change_the_outcome():
    tasks = _openb_like(150)
    nodes = homogeneous(2, 4)
    a = simulate(tasks, nodes, ["load_aware"], SimConfig(memory="asked"))[0]
    b = simulate(tasks, nodes, ["load_aware"], SimConfig(memory="asked", columnar_reservations=False))[0]
    assert [(x.first_start_s, x.finish_s) for x in a.records] == [(x.first_start_s, x.finish_s) for x in b.records]


# ---- saturation --------------------------------------------------------------------------------------


def test_saturation_by_hand():
    # Two 4090s; half-GPU tasks of 10,000 MiB: two fit a GPU (20,000 < 20,879),
    # so four are placed and the fifth fails with 100 % arrived, nothing left over.
    tasks = [task(f"h{i}", i, 10, 10_000, share=0.5) for i in range(3)]
    s = saturate(tasks, TWO_4090, "binpack")
    assert (s.placed, s.first_failure_task) == (4, "h1~c1")
    assert s.arrived_at_first_failure == pytest.approx(1.0)
    assert s.unallocated_at_first_failure == pytest.approx(0.0)
    # 0.3-share tasks of 9,000 MiB: two a GPU (memory), 0.6 allocated: 40 % left unallocated
    tasks = [task(f"s{i}", i, 10, 9_000, share=0.3) for i in range(5)]
    s = saturate(tasks, TWO_4090, "load_aware")
    assert s.placed == 4 and s.unallocated_at_first_failure == pytest.approx(0.4)
    assert s.arrived_at_first_failure == pytest.approx(0.6)


# ---- report and command line -----------------------------------------------------------------------


def test_report_table_json_and_ratios():
    tasks = [
        task("A", 0, 1000, 8_000, share=0.5),
        task("B", 10, 1000, 8_000, share=0.2),
        task("C", 20, 1000, 10_000, share=0.3),
    ]
    results = simulate(tasks, TWO_4090, ["round_robin", "load_aware"], SimConfig(memory=RatioMemory({"A": (1.0, 1.9)})))
    text = render(results, {"trace": "hand-made"})
    assert "round_robin" in text and "load_aware" in text and "OOM kills" in text
    means = next(line for line in text.splitlines() if line.startswith("largest difference of GPU means"))
    assert means.split()[-2:] == [f"{figures(r)['util_spread_means']:.1f}" for r in results]
    doc = to_json(results, {"trace": "hand-made"})
    json.dumps(doc, allow_nan=False)  # strictly valid JSON
    rat = ratios([figures(r) for r in results])
    assert rat["oom_kills"]["round_robin"] == 1 and rat["oom_kills"]["load_aware"] == 0
    assert rat["oom_kills"]["beats_seed"] is True


def test_command_line(tmp_path, capsys):
    trace = tmp_path / "trace.csv"
    write_trace([task("A", 0, 100, 15_000), task("B", 10, 50, 15_000)], trace)
    cluster = tmp_path / "cluster.csv"
    assert trace_main(["cluster", "homogeneous", "--hosts", "1", "--gpus", "1", str(cluster)]) == 0
    linked = tmp_path / "dgx.csv"
    assert trace_main(["cluster", "homogeneous", "--hosts", "2", "--gpus", "8", "--model", "H100", "--nvlink", "all",
                       str(linked)]) == 0
    assert "2 hosts x 8 NVIDIA H100 80GB HBM3, NVLink all" in capsys.readouterr().out
    assert linked.read_text().splitlines()[:2] == ["node_id,gpus,model,vram_mib_per_gpu,speed,nvlink",
                                                   "node-00,8,H100,81559,2.2,all"]
    assert trace_main(["cluster", "homogeneous", "--nvlink", "ring", str(linked)]) == 2
    assert "like 0-1;2-3, got 'ring'" in capsys.readouterr().err
    code = simulate_main(["--trace", str(trace), "--cluster", str(cluster), "--policy", "round_robin,load_aware,round_robin@requests",
                          "--memory", "asked", "--json", "--no-progress", "--saturate"])
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    assert [p["policy"] for p in doc["policies"]] == ["round_robin", "load_aware", "round_robin@requests"]
    assert doc["policies"][0]["wait_s"]["all"]["mean"] == pytest.approx(92.4 / 2)
    assert "saturation" in doc["policies"][0]
    # the floors: A holds the one GPU through the whole window [0, 10 s]
    floors = doc["policies"][0]["floors"]
    assert (floors["hottest_node_util"], floors["hottest_node_task"], floors["util_std"]) == (100.0, "A", 0.0)
    # both learners run by default, as in the coordinator; the switches turn them off
    assert doc["policies"][1]["prediction_samples"] == 2 and doc["policies"][1]["memory_growth_samples"] == 2
    code = simulate_main(["--trace", str(trace), "--cluster", str(cluster), "--policy", "load_aware", "--memory", "asked",
                          "--json", "--no-progress", "--no-prediction", "--no-memory-learning"])
    doc = json.loads(capsys.readouterr().out)
    assert (doc["policies"][0]["prediction_samples"], doc["policies"][0]["memory_growth_samples"]) == (0, 0)
    # time scale halves every time
    code = simulate_main(["--trace", str(trace), "--cluster", str(cluster), "--policy", "load_aware",
                          "--memory", "asked", "--json", "--no-progress", "--time-scale", "2"])
    doc = json.loads(capsys.readouterr().out)
    assert doc["policies"][0]["makespan_s"] == pytest.approx(50 + VISIBLE + 25)
    # clients that estimate short: the scheduler is told less, the tasks run as long
    code = simulate_main(["--trace", str(trace), "--cluster", str(cluster), "--policy", "load_aware",
                          "--memory", "asked", "--json", "--no-progress", "--estimate-scale", "0.5", "--estimate-noise", "0.3"])
    doc = json.loads(capsys.readouterr().out)
    assert (doc["meta"]["estimate_scale"], doc["meta"]["estimate_noise"]) == (0.5, 0.3)
    assert doc["policies"][0]["makespan_s"] == pytest.approx(100 + VISIBLE + 50)
    code = simulate_main(["--trace", str(trace), "--cluster", str(cluster), "--policy", "load_aware",
                          "--memory", "asked", "--no-progress"])
    assert "  floor: no placement below" in capsys.readouterr().out
    # bad input: a precise message, exit 2
    bad = tmp_path / "bad.csv"
    bad.write_text("task_id,submit_s\n")
    assert simulate_main(["--trace", str(bad), "--cluster", str(cluster), "--no-progress"]) == 2
    assert "required column is missing" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        simulate_main(["--trace", str(trace), "--cluster", str(cluster), "--policy", "fastest"])


def test_plots(tmp_path):
    pytest.importorskip("matplotlib")
    from scheduler.simreport import plot

    tasks = [task(f"t{i}", 5 * i, 20, 6_000, share=0.3) for i in range(20)]
    # binpack stacks the tasks on the first GPU, load_aware spreads them
    results = simulate(tasks, TWO_4090, ["binpack", "load_aware"], SimConfig(memory="asked"))
    written = plot(results, tmp_path / "plots")
    assert sorted(p.split("/")[-1] for p in written) == ["heatmap_binpack.png", "heatmap_load_aware.png", "wait_cdf.png"]
    from matplotlib.image import imread

    images = {}
    for path in written:
        with open(path, "rb") as fh:
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
        image = imread(path)
        assert image.shape[0] > 100 and image.shape[1] > 100
        assert len(np.unique(image.reshape(-1, image.shape[-1]), axis=0)) > 10  # drawn on, not blank
        images[path.split("/")[-1]] = image
    # the two policies loaded the GPUs differently, and the heat maps show it
    assert not np.allclose(results[0].heatmap, results[1].heatmap)
    a, b = images["heatmap_binpack.png"], images["heatmap_load_aware.png"]
    assert a.shape != b.shape or not np.array_equal(a, b)


def test_cluster_convert_and_trace_convert_commands(tmp_path):
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("sn,cpu_milli,memory_mib,gpu,model\nn0,1,1,2,T4\nn1,1,1,8,G2\n")
    out = tmp_path / "cluster.csv"
    assert trace_main(["cluster", "convert", "openb", str(nodes), str(out)]) == 0
    assert out.read_text().startswith("node_id,gpus,model,vram_mib_per_gpu,speed\nn0,2,T4,15360,")
    pods = tmp_path / "pods.csv"
    pods.write_text(
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n"
        "p0,1,1,1,500,,LS,Succeeded,10,110,20\n"
    )
    trace = tmp_path / "trace.csv"
    assert trace_main(["trace", "convert", "openb", str(pods), str(trace), "--time-scale", "10"]) == 0
    assert trace.read_text().splitlines()[1] == "p0,0,9,1,6144,0.5,P0,inference"  # 0.5 x 0.8 x 15,360 MiB (a T4)
    assert trace_main(["trace", "convert", "openb", str(tmp_path / "missing.csv"), str(trace)]) == 2


def test_a_policy_label_carries_weights_and_spread_rotates_idle_gpus():
    # One task at a time on 4 idle GPUs, each done before the next arrives:
    # plain load_aware sends every one to the first GPU (ties go to the lowest
    # row); "load_aware:spread=0.05" takes each GPU in turn.
    tasks = [task(f"t{i}", 100.0 * i, 50.0, 1_000, share=0.5) for i in range(8)]
    plain = run(tasks, homogeneous(1, 4), "load_aware")
    spread = run(tasks, homogeneous(1, 4), "load_aware:spread=0.05")
    assert spread.policy == "load_aware:spread=0.05" and figures(spread)["policy"] == "load_aware:spread=0.05"
    assert np.count_nonzero(plain.gpu_mean_util) == 1
    assert np.count_nonzero(spread.gpu_mean_util) == 4
    assert [rec(spread, f"t{i}").first_start_s for i in range(8)] == [100.0 * i for i in range(8)]
    assert figures(spread)["util_std"] < figures(plain)["util_std"]
    assert policy_weights("load_aware:spread=0.05+jitter=0.2") == {"spread": 0.05, "jitter": 0.2}
    with pytest.raises(ValueError, match="expected NAME:weight=value"):
        policy_weights("load_aware:spread")


def test_hottest_node_floor_by_hand():
    from scheduler.simreport import hottest_node_floor

    def t(task_id, submit, duration, gpus, share=1.0):
        return TraceTask(task_id, submit, duration, gpus, 1_000.0, share, Priority.P1, "training")

    nodes = [ClusterNode("big", 8, "RTX 4090", 24_564.0, 1.0), ClusterNode("small", 2, "RTX 4090", 24_564.0, 2.0)]
    window = (100.0, 1_000.0)  # [100, 1,100]
    # a 2-GPU task running through the window: on the 8-GPU node it loads 2/8 of it (25 %),
    # on the fast 2-GPU node it runs 5,000 s, still the whole window (100 %): floor 25 %
    floor = hottest_node_floor([t("pair", 0.0, 10_000.0, 2)], nodes, *window)
    assert floor.pct == pytest.approx(25.0) and (floor.node_gpus, floor.coverage) == (8, 1.0)
    # an 8-GPU task only fits the big node: from 600 s for 300 s is 30 % of the window
    floor = hottest_node_floor([t("pair", 0.0, 10_000.0, 2), t("whole", 600.0, 300.0, 8)], nodes, *window)
    assert (floor.task_id, floor.pct) == ("whole", pytest.approx(30.0))
    # a half-share single-GPU task from 200 s for 800 s: on the small node twice as fast
    # (400 s, 40 % of the window), half of its 2 GPUs at 50 %: 10 %; on the big one 1/8 * 50 * 0.8 = 5 %
    floor = hottest_node_floor([t("half", 200.0, 800.0, 1, share=0.5)], nodes, *window)
    assert floor.pct == pytest.approx(5.0) and floor.node_gpus == 8
    # a run's own timeline: started at 600 s instead, the pair covers half the window (12.5 %);
    # a task that ran twice (killed, moved) is left out
    floor = hottest_node_floor([t("pair", 0.0, 10_000.0, 2)], nodes, *window, starts={"pair": (600.0, True)})
    assert floor.pct == pytest.approx(12.5)
    assert hottest_node_floor([t("pair", 0.0, 10_000.0, 2)], nodes, *window, starts={"pair": (0.0, False)}).pct == 0.0
    # what no placement can beat, it does not: round-robin's and load_aware's hottest node are above it
    tasks = [t("whole", 100.0, 2_000.0, 8), t("a", 150.0, 300.0, 1), t("b", 160.0, 300.0, 2)]
    for r in simulate(tasks, [n.facts() for n in nodes], ["round_robin", "load_aware"], SimConfig(memory="asked")):
        got = figures(r)["hottest_node_util"]
        assert got >= hottest_node_floor(tasks, nodes, r.meta["window_start_s"], r.window_s).pct - 1e-9


def test_util_std_floor_by_hand():
    from scheduler.simreport import attach_floors, util_std_floor

    def t(task_id, submit, duration, gpus=1, share=1.0):
        return TraceTask(task_id, submit, duration, gpus, 1_000.0, share, Priority.P1, "training")

    nodes = [n for n in homogeneous(2, 2)]  # 4 GPUs, speed 1.0
    # a whole-GPU task through the window pins one GPU at 100 %; a half-share one (50 % of
    # a GPU over the window) is poured over the other three: [100, 16.7, 16.7, 16.7], std 36.08
    tasks = [t("whole", 0.0, 1_000.0), t("half", 0.0, 1_000.0, share=0.5)]
    floor = util_std_floor(tasks, nodes, 0.0, 100.0)
    assert floor == pytest.approx(math.sqrt(np.var([100.0, 50 / 3, 50 / 3, 50 / 3])))
    # more whole-GPU lumps than GPUs: the extra ones are poured too (3 x 33 % on 2 GPUs: level 50, std 0)
    three = [t(f"w{i}", 100.0 * i, 100.0) for i in range(3)]
    assert util_std_floor(three, homogeneous(1, 2), 0.0, 300.0) == pytest.approx(0.0)
    # a run's own timeline: "whole" started at 50 s covers half the window [0, 100]; a task
    # that ran twice is poured: [50, 16.7, 16.7, 16.7] -> level of the rest rises
    late = util_std_floor(tasks[:2], nodes, 0.0, 100.0, starts={"whole": (50.0, True), "half": (0.0, True)})
    assert late == pytest.approx(math.sqrt(np.var([50.0, 50 / 3, 50 / 3, 50 / 3])))
    twice = util_std_floor(tasks[:2], nodes, 0.0, 100.0, starts={"whole": (0.0, False), "half": (0.0, True)})
    assert twice == pytest.approx(0.0)  # 150 % of a GPU poured evenly over 4
    # no placement of these tasks beats it, started at submission or when each run started them,
    # on a cluster with room and on one where tasks wait (one GPU for six tasks)
    tasks = [t("whole", 0.0, 5_000.0), t("a", 10.0, 600.0, share=0.5), t("b", 20.0, 900.0, share=0.3),
             t("pair", 30.0, 400.0, gpus=2), t("c", 40.0, 700.0), t("d", 50.0, 300.0, share=0.6)]
    for cluster in (nodes, homogeneous(1, 2)):
        results = simulate(tasks, [n.facts() for n in cluster], ["round_robin", "load_aware", "binpack"],
                           SimConfig(memory="asked"))
        attach_floors(results, tasks, cluster)
        for r in results:
            f = figures(r)
            assert f["util_std"] >= f["floors"]["util_std"] - 1e-9
            assert f["hottest_node_util"] >= f["floors"]["hottest_node_util"] - 1e-9
            if cluster is nodes:
                assert f["util_std"] >= util_std_floor(tasks, nodes, r.meta["window_start_s"], r.window_s) - 1e-9


def test_command_line_runs_each_policy_with_and_without_the_advisor(tmp_path, capsys):
    # A, B, C one per GPU; D joins A (the lowest row on the tie); B and C end at
    # 100 s, leaving [90 %, 0, 0]: with the advisor one of A and D moves to an
    # idle GPU and redoes --migration-cost s of work there; without it nothing moves
    from scheduler.traces import TraceTask

    def train(task_id, submit, duration, share):
        return TraceTask(task_id, submit, duration, 1, 4_000.0, share, Priority.P1, "training")

    trace = tmp_path / "trace.csv"
    write_trace([train("A", 0.0, 20_000.0, 0.5), train("B", 0.0, 100.0, 0.5), train("C", 0.0, 100.0, 0.5),
                 train("D", 1.0, 20_000.0, 0.4)], trace)
    cluster = tmp_path / "cluster.csv"
    assert trace_main(["cluster", "homogeneous", "--hosts", "3", "--gpus", "1", str(cluster)]) == 0
    capsys.readouterr()
    base = ["--trace", str(trace), "--cluster", str(cluster), "--policy", "round_robin,load_aware", "--memory", "asked",
            "--no-progress"]
    assert simulate_main(base + ["--json", "--advisor", "--migration-cost", "300", "--advisor-set", "cooldown_s=600"]) == 0
    doc = json.loads(capsys.readouterr().out)
    names = [p["policy"] for p in doc["policies"]]
    assert names == ["round_robin", "round_robin+advisor", "load_aware", "load_aware+advisor"]
    by = {p["policy"]: p for p in doc["policies"]}
    assert (by["load_aware"]["plans"], by["load_aware"]["migrations"]) == (0, 0)
    assert (by["load_aware+advisor"]["plans"], by["load_aware+advisor"]["migrations"]) == (1, 1)
    # the move's cost is redone on the new GPU: makespan 20,000 s + 300 s (+ the start's visibility delay)
    assert by["load_aware+advisor"]["makespan_s"] - by["load_aware"]["makespan_s"] == pytest.approx(300.0, abs=2.0)
    assert doc["meta"]["migration_cost_s"] == 300.0 and doc["meta"]["advisor.cooldown_s"] == "600"
    assert simulate_main(base + ["--advisor"]) == 0
    text = capsys.readouterr().out
    assert "load_aware+advisor" in text and "rebalance plans / migrations" in text and "largest load difference" in text
    # bad options: exit 2 naming the option
    assert simulate_main(base + ["--advisor", "--advisor-set", "nonsense=1"]) == 2
    assert "'nonsense=1': expected OPTION=VALUE" in capsys.readouterr().err
    assert simulate_main(base + ["--advisor", "--advisor-set", "hot_pct=200"]) == 2
    assert "hot_pct: must be in [0, 100]" in capsys.readouterr().err
    assert simulate_main(base + ["--advisor", "--advisor-set", "persist=two"]) == 2
    assert "persist: 'two'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        simulate_main(base + ["--load-drift", "-1"])
    # [scheduler] options reach every run: 4,000 MiB asks under a 10 % memory ceiling never fit
    assert simulate_main(base + ["--json", "--scheduler-set", "memory_warn_pct=5",
                                 "--scheduler-set", "memory_reject_pct=10"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [p["rejected"] for p in doc["policies"]] == [4, 4]
    assert doc["meta"]["scheduler.memory_reject_pct"] == "10"
    assert simulate_main(base + ["--scheduler-set", "nonsense=1"]) == 2
    assert "--scheduler-set: 'nonsense=1': expected OPTION=VALUE" in capsys.readouterr().err
    assert simulate_main(base + ["--scheduler-set", "growth_room_wait_s=-1"]) == 2
    assert "growth_room_wait_s" in capsys.readouterr().err
    assert simulate_main(base + ["--scheduler-set", "policy=fgd"]) == 2
    assert "set by the simulator (use --policy)" in capsys.readouterr().err


def test_a_p0_task_preempts_a_background_task_which_resumes_after_it():
    # B (P3, movable) holds the only GPU from 0; U (P0) arrives at 10 and fits
    # nowhere. At 11 (preempt_after_s 1 s) B is evicted; its memory shows free
    # 2.4 s later, when U starts: 13.4, done at 63.4. B, re-queued at 11, starts
    # again when U's end is visible (65.8) and does what was left (1000 - 11 s)
    # plus the 30 s restart: done at 65.8 + 989 + 30 = 1084.8.
    tasks = [task("B", 0, 1000, 15_000, priority=Priority.P3, kind="background"),
             task("U", 10, 50, 15_000, priority=Priority.P0, kind="inference")]
    r = run(tasks, ONE_4090)
    b, u = rec(r, "B"), rec(r, "U")
    assert u.first_start_s == pytest.approx(11 + VISIBLE) and u.finish_s == pytest.approx(61 + VISIBLE)
    assert b.preemptions == 1 and b.runs == 2
    assert b.finish_s == pytest.approx(61 + 2 * VISIBLE + 989 + 30)
    assert b.wait_s == pytest.approx(61 + 2 * VISIBLE - 11)
    assert (r.preemptions, r.preempted_work_s, r.sla_misses) == (1, 30.0, 0)
    f = figures(r)
    assert (f["preemptions"], f["preempted_work_h"]) == (1, 30.0 / 3600)
    assert "preempted for P0 / GPU-h redone" in render([r])
    # a task that cannot checkpoint starts over: its 11 s are redone
    tasks[0] = replace(tasks[0], movable=False)
    r = run(tasks, ONE_4090)
    assert rec(r, "B").finish_s == pytest.approx(61 + 2 * VISIBLE + 1000) and r.preempted_work_s == 11.0
    # preemption off: U waits for B's end
    r = run(tasks, ONE_4090, scheduler=SchedulerConfig(preemption=False))
    assert rec(r, "U").first_start_s == pytest.approx(1000 + VISIBLE) and r.preemptions == 0 and r.sla_misses == 1


# ---- QA pass 23: figures checked against hand calculations ---------------------------------------


def test_a_burst_after_time_zero_is_measured_from_its_submission_to_the_makespan():
    """Both tasks at 5 s (a job array): the window was [0, 5], when nothing
    ran, and every utilisation figure read 0. Now [5, 105]: GPU 0 at 50 % for
    100 s, GPU 1 at 100 % for 50 s, both means 50 %; the heat map is sampled
    over the run (the largest difference at each moment: 50 then 50 points)."""
    tasks = [task("a", 5, 100, 1_000, share=0.5), task("b", 5, 50, 1_000, share=1.0)]
    r = run(tasks, TWO_4090, policy="round_robin")
    f = figures(r)
    assert r.window_s == pytest.approx(100.0)
    assert f["util_mean"] == pytest.approx(50.0, abs=0.5) and f["hottest_gpu_util"] == pytest.approx(50.0, abs=0.5)
    assert f["makespan_s"] == pytest.approx(100.0)  # from the first submission, not from 0
    assert f["throughput_per_h"] == pytest.approx(2 / (100.0 / 3600))
    assert f["util_spread"] == pytest.approx(50.0, abs=3.0)  # was "-": no samples when every task came at once
    assert len(r.heatmap) >= 10


def test_the_hottest_gpus_time_above_90_is_that_gpus():
    """GPU 0: 95 % for 50 s then idle (mean 47.5); GPU 1: 80 % for 100 s (mean
    80, the hottest). The row under "hottest GPU mean util" is GPU 1's time at
    90 % or more, 0; it printed GPU 0's 50 %."""
    tasks = [task("u", 0, 50, 1_000, util=95.0), task("v", 0, 100, 1_000, util=80.0)]
    r = run(tasks, TWO_4090, policy="round_robin")
    f = figures(r)
    assert f["hottest_gpu_util"] == pytest.approx(80.0, abs=0.5)
    assert f["hottest_gpu_time_above_90"] == pytest.approx(0.0)


def test_bounded_slowdown_is_1_for_a_short_task_that_neither_waited_nor_shared():
    """A 4 s task alone on a speed-1 GPU read 0.4 (4 / max(4, 10)); a 60 s one
    that waited 30 s behind another on the only GPU still reads (60 + 30 + the
    2.4 s the view takes to see the GPU free) / 60."""
    r = run([task("short", 0, 4, 1_000)], ONE_4090)
    assert figures(r)["slowdown"]["mean"] == pytest.approx(1.0)
    r = run([task("first", 0, 30, 15_000), task("then", 0, 60, 15_000)], ONE_4090, policy="round_robin")
    waited = rec(r, "then")
    assert waited.jct_s == pytest.approx(90 + VISIBLE)
    assert figures(r)["slowdown"]["p95"] > 1.4


def test_the_work_a_checkpointed_victim_redoes_is_in_reference_seconds():
    """On a speed-2 GPU the 30 s restart redoes 60 reference-seconds of work
    (as the run's own timing charges it); the figure said 30."""
    fast = [ClusterNode("fast", 1, "NVIDIA GeForce RTX 4090", 24_564.0, 2.0)]
    tasks = [task("B", 0, 1000, 15_000, priority=Priority.P3, kind="background"),
             task("U", 10, 50, 15_000, priority=Priority.P0, kind="inference")]
    r = run(tasks, fast)
    assert r.preemptions == 1 and r.preempted_work_s == pytest.approx(60.0)


def test_an_openb_whole_gpu_task_fits_every_openb_card_the_t4_too(tmp_path):
    """The conversion's reference card is the smallest of the openb cluster,
    the T4 (15,360 MiB): a whole-GPU ask is 12,288 MiB, 80 %, under the 85 %
    memory threshold. At 16 GiB it was 13,107 MiB, 85.3 % of a T4: the 808 T4s
    took only fractional tasks."""
    pods = tmp_path / "pods.csv"
    pods.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n"
                    "p0,1000,1000,1,1000,,BE,Succeeded,0,100,0\n")
    out = tmp_path / "trace.csv"
    convert_openb(pods, out)
    [converted] = read_trace(out)
    assert converted.vram_mib == pytest.approx(12_288.0)
    r = run([converted], homogeneous(1, 1, "T4"), policy="round_robin")
    assert rec(r, "p0").state == "completed"
