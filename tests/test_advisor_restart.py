"""The advisor after a coordinator restart (QA pass 25, item 3): the cool-downs
and move window of recent moves come back from the migrated leases restored
from state_dir, and no plan is made before the nodes of those leases report.
The clock is the test's: nothing here waits on real time."""

from __future__ import annotations

from dataclasses import replace

import pytest

from scheduler.advisor import AdvisorConfig
from scheduler.snapshot import ClusterSnapshot, NodeFacts
from test_advisor_hook import place_on
from test_advisor_rpc import M40, RTX, Cluster, runtime_for

pytestmark = pytest.mark.timeout(60)

CONFIG = AdvisorConfig(persist=2, min_age_s=0.0, smoothing_alpha=1.0, cooldown_s=600.0, window_s=60.0, max_moves=2)


async def test_a_move_before_the_restart_keeps_its_task_and_gpus_cooling_down():
    """Moved 30 s before the restart with cooldown_s = 600: the next run
    moved the same task again within seconds, the cool-down gone."""
    c = Cluster()
    for task_id in ("t0", "t1", "t2"):
        place_on(c, task_id, "GPU-rtx-a-0")
    c.now += 100.0
    moved = c.engine.get("t0")
    c.engine.migrate("t0", moved.assignment.lease_id, ("GPU-rtx-b-0",), c.snap)
    place_on(c, "t3", "GPU-rtx-b-0")
    c.now += 30.0  # the coordinator restarts: a new runtime over the same (restored) leases
    # t0's destination is hot now, with t3 beside it; t1 and t2's GPU is below the mean
    c.readings([10.0 if u == "GPU-rtx-a-0" else 95.0 if u == "GPU-rtx-b-0" else 0.0 for u in c.snap.gpu_uuid])
    rt = runtime_for(c, advisor_config=CONFIG, interval_s=1e6)
    rt.start()
    try:
        state = rt.advisor.state
        assert dict(state.moved_at) == {"t0": c.now - 30.0}
        assert dict(state.touched_at) == {"GPU-rtx-b-0": c.now - 30.0}
        assert state.move_times == (c.now - 30.0,)  # inside window_s: it counts against max_moves
        plans = []
        for _ in range(3):
            c.now += 10.0
            plans.append(rt.evaluate_now())
        assert plans == [None, None, None]
        _, plan, why = rt.dry_run()
        assert plan is None and why.get("cooling_down") == 1, why
        # once the cool-down is over, the hot GPU is evened out as before
        c.now += 600.0
        for _ in range(2):
            c.now += 10.0
            plans.append(rt.evaluate_now())
        assert plans[-1] is not None and plans[-1].moves[0].from_gpu_uuid == "GPU-rtx-b-0"
    finally:
        await rt.stop()


def _without(cluster: Cluster, node_id: str) -> ClusterSnapshot:
    """The cluster as the coordinator sees it before ``node_id``'s agent has reconnected."""
    snap = cluster.snap
    keep = [i for i, u in enumerate(snap.gpu_uuid) if not u.startswith(f"GPU-{node_id}-")]
    facts = [f for f in _facts() if f.node_id != node_id]
    part = ClusterSnapshot.build(facts)
    return replace(part, util_pct=snap.util_pct[keep].copy(), util_forecast_pct=snap.util_pct[keep].copy())


def _facts() -> list[NodeFacts]:
    """Cluster's nodes."""
    return [NodeFacts("rtx-a", 2, model=RTX, labels={"name": "rtx-a"}),
            NodeFacts("rtx-b", 2, model=RTX, labels={"name": "rtx-b"}),
            NodeFacts("m40", 2, model=M40, memory_total_mib=24_472.0, speed=0.12, labels={"name": "m40"})]


async def test_no_plan_before_the_nodes_of_the_restored_leases_report():
    """The first plan after a restart was made over 2 of 4 GPUs: one host's
    agent had not reconnected. Now the advisor waits for every node that
    holds a restored lease (at most reconnect_grace_s, 30 s by default)."""
    c = Cluster()
    for task_id in ("t0", "t1"):
        place_on(c, task_id, "GPU-rtx-a-0")
    place_on(c, "t2", "GPU-rtx-b-0")
    c.readings([95.0 if u == "GPU-rtx-a-0" else 0.0 for u in c.snap.gpu_uuid])
    seen = {"snap": _without(c, "rtx-b")}
    rt = runtime_for(c, advisor_config=CONFIG, interval_s=1e6)
    rt._snapshot = lambda: seen["snap"]
    rt.start()
    try:
        plans = []
        for _ in range(3):  # persist is 2: without the wait the second made a plan
            c.now += 5.0
            plans.append(rt.evaluate_now())
        assert plans == [None, None, None]
        assert rt.last_trigger.fired and rt.last_trigger.gpus == 4
        seen["snap"] = c.snap  # rtx-b's agent is back
        for _ in range(2):
            c.now += 5.0
            plans.append(rt.evaluate_now())
        assert plans[-1] is not None and plans[-1].moves[0].task_id in ("t0", "t1")
    finally:
        await rt.stop()


@pytest.mark.parametrize("gone", ["grace", "lease"])
async def test_a_node_that_does_not_come_back_is_waited_for_only_so_long(gone):
    """After reconnect_grace_s, or once the node holds no lease (the
    coordinator gave it up: its tasks were lost), the advisor plans on the
    nodes that reported."""
    c = Cluster()
    for task_id in ("t0", "t1"):
        place_on(c, task_id, "GPU-rtx-a-0")
    place_on(c, "t2", "GPU-rtx-b-0")
    c.readings([95.0 if u == "GPU-rtx-a-0" else 0.0 for u in c.snap.gpu_uuid])
    partial = _without(c, "rtx-b")
    rt = runtime_for(c, advisor_config=CONFIG, interval_s=1e6, reconnect_grace_s=30.0)
    rt._snapshot = lambda: partial
    rt.start()
    try:
        c.now += 5.0
        assert rt.evaluate_now() is None
        if gone == "grace":
            c.now += 30.0
        else:
            c.engine.node_removed("rtx-b")
            c.engine.cancel("t2")  # lost and queued again: a queued task would pause the advisor anyway
        plans = []
        for _ in range(2):
            c.now += 5.0
            plans.append(rt.evaluate_now())
        assert plans[-1] is not None
    finally:
        await rt.stop()
