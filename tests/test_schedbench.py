"""``gpulb bench schedule`` end to end at a tiny size: a real coordinator
process over a synthetic view, real gRPC clients. No timing assertions: only
that every request was placed and completed and the JSON has its shape."""

from __future__ import annotations

import argparse
import json

import numpy as np

from coordinator.schedbench import run_sched_bench, synthetic_node, task_shapes


def test_tiny_run_places_and_completes_everything(capsys):
    args = argparse.Namespace(nodes="50", clients=2, requests=40, json=True)
    assert run_sched_bench(args) == 0
    result = json.loads(capsys.readouterr().out)

    assert set(result) >= {"benchmark", "machine", "config", "sizes", "targets"}
    assert set(result["machine"]) >= {"cpu_model", "cores", "python"}
    assert result["config"]["clients"] == 2 and result["config"]["requests"] == 40
    assert result["config"]["burst_clients"] == 64
    (size,) = result["sizes"]
    assert size["nodes"] == 50 and size["gpus"] == 400
    for phase in ("churn", "latency"):
        run = size[phase]
        assert run["requests"] == 40
        assert run["placed"] == 40, run["first_errors"]
        assert run["completed"] == 40
        assert run["errors"] == 0
        assert {"schedule_p50_us", "schedule_p90_us", "schedule_p99_us"} <= set(run)
    assert size["churn"]["clients"] == 2
    # the headline phase completes nothing while measured, everything afterwards
    burst = size["throughput"]
    assert burst["clients"] == 64 and burst["requests"] == 40
    assert burst["placed"] == 40 and burst["completed"] is None and burst["completed_after"] == 40
    assert burst["errors"] == 0
    # job arrays: the same count in ScheduleTasks calls of 50, nothing completed while measured
    batched = size["batched"]
    assert batched["batch"] == 50 and batched["requests"] == 40
    assert batched["placed"] == 40 and batched["errors"] == 0 and batched["completed_after"] == 40
    for phase in ("throughput", "churn", "batched"):
        assert {"placements_per_s", "wall_s", "server_cpu_us_per_placement", "placed_per_pass_mean"} <= set(size[phase])
        assert size[phase]["dispatch_passes"] >= 1
    # 40 tasks in one call: one pass places them all (a pass per call, not per task)
    assert batched["dispatch_passes"] < 40
    # every measured placement was timed inside the server (latency, churn, throughput)
    assert size["decision"]["count"] == 120
    assert {"p50_us", "p99_us"} <= set(size["decision"]) and size["decision_wall"]["count"] == 120
    assert size["no_rpc"]["placed"] == 40
    # nothing left behind: every lease completed, every reservation released
    assert size["leftover"] == {"queued": 0, "leased": 0, "reservations": 0}
    targets = {t["target"]: t for t in result["targets"]}
    assert set(targets) == {"placements_per_s", "placements_per_s_vs_kube_scheduler", "batched_placements_per_s",
                            "schedule_p99_us", "decision_p99_us"}
    # the targets are set at 1,000 and 5,000 nodes: not measured here
    assert all(t["measured"] is None and t["met"] is None for t in targets.values())


def test_the_headline_phase_places_at_most_two_tasks_per_node(capsys):
    args = argparse.Namespace(nodes="10", clients=2, requests=30, burst_clients=4, json=True)
    assert run_sched_bench(args) == 0
    (size,) = json.loads(capsys.readouterr().out)["sizes"]
    assert size["throughput"]["requests"] == 20 and size["throughput"]["placed"] == 20
    assert size["churn"]["requests"] == 30


def test_tiny_run_prints_a_table(capsys):
    args = argparse.Namespace(nodes="20", clients=3, requests=12, json=False)
    assert run_sched_bench(args) == 0
    out = capsys.readouterr().out
    assert "PLACED/S" in out and "DECIDE p99" in out and "CHURN/S" in out
    assert "machine:" in out and "cores" in out


def test_synthetic_nodes_are_varied_and_seeded():
    a = [synthetic_node(i, np.random.default_rng(1)) for i in range(3)]
    b = [synthetic_node(i, np.random.default_rng(1)) for i in range(3)]
    assert [x[0] for x in a] == [x[0] for x in b]
    assert all((x[1] == y[1]).all() for x, y in zip(a, b))
    rng = np.random.default_rng(7)
    nodes = [synthetic_node(i, rng) for i in range(200)]
    assert all(len(reg.gpus) == 8 and reg.gpus[0].memory_total_mib == 24_564 for reg, *_ in nodes)
    assert any(reg.topology for reg, *_ in nodes) and not all(reg.topology for reg, *_ in nodes)


def test_task_shapes_are_mixed():
    shapes = task_shapes(500)
    sizes = {s["num_gpus"] for s in shapes}
    assert sizes == {1, 2, 4}
    assert sum(s["num_gpus"] == 1 for s in shapes) > 250
    assert len({s["vram_mib"] for s in shapes}) >= 5
    assert any(s.get("needs_nvlink") for s in shapes)
