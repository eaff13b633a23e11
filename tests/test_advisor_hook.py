"""The coordinator's advisor hook (QA pass 25): no plan while the hook still
carries out the last one, every outcome checked against where the tasks are,
and a hook that cannot run refused at configuration load, by name."""

from __future__ import annotations

import asyncio
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import structlog.testing

from coordinator.advisor import CommandHook
from coordinator.config import CoordinatorConfig
from scheduler.advisor import AdvisorConfig
from scheduler.task import Priority, TaskSpec
from test_advisor_rpc import Cluster, runtime_for

pytestmark = pytest.mark.timeout(60)

HOT = ("GPU-rtx-a-0", "GPU-rtx-a-1")


def place_on(cluster: Cluster, task_id: str, uuid: str):
    """A training task placed by the scheduler on GPU ``uuid`` (the others unhealthy for the moment)."""
    spec = TaskSpec(task_id, kind="training", priority=Priority.P1, vram_mib=2_000.0, gpu_share=0.4,
                    duration_s=10.0, movable=True)
    cluster.engine.submit(spec, cluster.snap)
    only = replace(cluster.snap, healthy=np.asarray([u == uuid for u in cluster.snap.gpu_uuid]))
    (task,) = cluster.engine.dispatch(only)
    assert task.assignment.gpu_uuids == (uuid,)
    return task


def two_hot_gpus(cluster: Cluster) -> None:
    """Two training tasks on each of rtx-a's GPUs, both at 95 %, the rest idle:
    one move per hot GPU, so a second plan has work of its own."""
    for i, uuid in enumerate((HOT[0], HOT[0], HOT[1], HOT[1])):
        place_on(cluster, f"t{i}", uuid)
    cluster.readings([95.0 if u in HOT else 0.0 for u in cluster.snap.gpu_uuid])


def gated_hook(tmp_path: Path) -> tuple[CommandHook, Path]:
    """A hook that exits 0 once ``gate`` exists (the test says when it is done)."""
    gate = tmp_path / "gate"
    script = f"import os, time\nwhile not os.path.exists({str(gate)!r}): time.sleep(0.02)"
    return CommandHook([sys.executable, "-c", script], timeout_s=50), gate


CONFIG = AdvisorConfig(persist=2, min_age_s=0.0, max_moves=1, window_s=1.0, smoothing_alpha=1.0)


async def test_no_plan_is_made_while_the_hook_runs(tmp_path):
    """A plan made while the hook still ran was not handed over ("skipped"),
    yet kept its task and GPUs in the cool-down and used the move window:
    `plan --now` said "moved within cooldown_s" of a task no executor saw,
    and watchers were shown a move no one made. Now the advisor makes no
    plan until the hook has ended, and then goes on."""
    c = Cluster()
    hook, gate = gated_hook(tmp_path)
    rt = runtime_for(c, hook=hook, advisor_config=CONFIG)
    try:
        two_hot_gpus(c)
        rt.evaluate_now()
        c.now += 30.0
        first = rt.evaluate_now()
        assert first is not None and [m.task_id for m in first.moves] == ["t0"]
        watch, _ = rt.watch()
        for _ in range(4):  # persist is 2: the second hot GPU's move would come now
            c.now += 30.0
            assert rt.evaluate_now() is None
            assert not rt._hook_task.done()  # the gate is shut: the hook runs on
        assert rt.hook_runs == {} and watch.empty()
        assert set(rt.advisor.state.moved_at) == {"t0"}
        assert rt.last_trigger.fired  # the trigger is still evaluated meanwhile
        move = first.moves[0]
        c.engine.migrate(move.task_id, move.lease_id, move.to_gpu_uuids, c.snap)  # the executor's move
        gate.touch()
        await rt.hook_idle()
        assert rt.hook_runs == {"ok": 1}
        plans = []
        for _ in range(2):
            c.now += 30.0
            plans.append(rt.evaluate_now())
        assert plans[-1] is not None and [m.task_id for m in plans[-1].moves] == ["t2"]
        assert "skipped" not in rt.hook_runs
    finally:  # the hook ends with the test, whatever it found
        gate.touch()
        await asyncio.wait_for(rt.hook_idle(), 30)


async def test_moves_an_ok_hook_did_not_make_leave_the_cool_down(tmp_path):
    """A hook that exits 0 having moved nothing (or an executor whose moves
    were refused or stale, which is no failure) was trusted: the task stayed
    "moved within cooldown_s". Now, whatever the outcome, a move whose task
    still holds a lease on the plan's source GPUs was not made; one that was
    made keeps its cool-down."""
    c = Cluster()
    hook, gate = gated_hook(tmp_path)
    rt = runtime_for(c, hook=hook, advisor_config=replace(CONFIG, max_moves=2, window_s=60.0))
    two_hot_gpus(c)
    rt.evaluate_now()
    c.now += 30.0
    plan = rt.evaluate_now()
    try:
        assert plan is not None and [m.task_id for m in plan.moves] == ["t0", "t2"]
        assert set(rt.advisor.state.moved_at) == {"t0", "t2"} and len(rt.advisor.state.move_times) == 2
        # the executor makes the first move and not the second
        made = plan.moves[0]
        c.engine.migrate(made.task_id, made.lease_id, made.to_gpu_uuids, c.snap)
    finally:
        with structlog.testing.capture_logs() as logs:
            gate.touch()
            await asyncio.wait_for(rt.hook_idle(), 30)
    assert rt.last_hook.outcome == "ok"
    assert set(rt.advisor.state.moved_at) == {"t0"}
    assert rt.advisor.state.move_times == (plan.created_at_s,)
    assert set(rt.advisor.state.touched_at) == {*made.from_gpu_uuids, *made.to_gpu_uuids}
    (said,) = [e for e in logs if e["event"] == "advisor_moves_not_made"]
    assert (said["plan_id"], said["hook_outcome"], said["tasks"]) == (plan.plan_id, "ok", ["t2"])


# ---- a hook that cannot run --------------------------------------------------------------------------------


def test_a_hook_that_is_not_executable_is_refused_at_load_by_name(tmp_path, monkeypatch, capsys):
    """It was accepted at start and by --print-config; the first plan's
    outcome was "error", "[Errno 13] Permission denied", naming no file."""
    from coordinator.main import main

    hook = tmp_path / "notexec.sh"
    hook.write_text("#!/bin/sh\nexit 0\n")
    hook.chmod(0o644)
    with pytest.raises(ValueError, match=rf"advisor_hook: '{hook}' is not an executable file"):
        CoordinatorConfig(advisor_hook=f"{hook} --stdin").validate()
    with pytest.raises(ValueError, match=r"advisor_hook: 'hook.sh' is not an executable on PATH"):
        CoordinatorConfig(advisor_hook="hook.sh").validate()  # under systemd the working directory is /
    CoordinatorConfig(advisor_hook=f"{sys.executable} -m coordinator.cli advisor execute --stdin").validate()
    config = tmp_path / "coord.toml"
    config.write_text(f'[coordinator]\nadvisor_hook = "{hook}"\ninsecure = true\n')
    monkeypatch.delenv("GPULB_ADVISOR_HOOK", raising=False)
    assert main(["--config", str(config), "--print-config"]) == 2
    err = capsys.readouterr().err
    assert "advisor_hook" in err and str(hook) in err and "is not an executable file" in err, err


async def test_a_hook_that_cannot_start_is_named_in_its_error(tmp_path):
    hook = tmp_path / "notexec.sh"
    hook.write_text("#!/bin/sh\nexit 0\n")
    hook.chmod(0o644)
    c = Cluster()
    rt = runtime_for(c, advisor_config=CONFIG)
    two_hot_gpus(c)
    rt.evaluate_now()
    c.now += 30.0
    plan = rt.evaluate_now()
    result = await CommandHook([str(hook), "--stdin"]).run(plan)
    # uvloop (the coordinator's event loop when installed) said "[Errno 13] Permission denied" alone
    assert (result.outcome, result.stderr_tail) == ("error", f"{hook}: Permission denied")
