"""The executor's checkpoint and restart commands (``coordinator.executor``):
done when they exit, each in a session of its own, so that a restart that
starts the workload in the background is neither "ran past" its timeout nor
killed with the coordinator's hook (QA pass 25, item 1)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap
from pathlib import Path

import pytest

from coordinator.advisor import CommandHook
from coordinator.executor import PlanExecutor
from protos import advisor_pb2 as apb
from protos import tasks_pb2 as tpb
from scheduler.advisor import Move, Plan

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parent.parent

_MOVE = dict(task_id="t1", lease_id="L1", from_node_id="a", from_gpu_index=0, from_gpu_uuid="GPU-a",
             to_node_id="b", to_gpu_index=1, to_gpu_uuid="GPU-b")


class _Scheduler:
    """GetTask: the task holds the plan's lease on the plan's GPU; MigrateTask
    moves it (a new lease on the destination)."""

    def GetTask(self, request, timeout):
        return tpb.Task(spec=tpb.TaskSpec(task_id="t1"), state=tpb.TASK_STATE_LEASED,
                        assignment=tpb.Assignment(node_id="a", gpu_index=[0], gpu_uuid=["GPU-a"], lease_id="L1"))

    def MigrateTask(self, request, timeout):
        moved = tpb.Task(spec=tpb.TaskSpec(task_id="t1"), state=tpb.TASK_STATE_LEASED,
                         assignment=tpb.Assignment(node_id="b", gpu_index=[1], gpu_uuid=["GPU-b"], lease_id="L2"))
        return tpb.MigrateTaskResponse(task=moved)


def _script(path: Path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + textwrap.dedent(body))
    path.chmod(0o755)
    return str(path)


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie no one reaped yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _kill(pid_file: Path) -> None:
    if pid_file.exists():
        try:
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def test_a_restart_that_starts_the_workload_in_the_background_and_exits_0_is_a_move(tmp_path):
    """resume_bg.sh starts the workload with `&` and exits 0 at once; the
    workload holds the command's pipes. The executor waited for the pipes,
    not the exit: "restart failed ... ran past 5 s", exit status 1. Now the
    move is "moved", and the workload runs on, in a session other than the
    executor's."""
    workload = tmp_path / "workload.pid"
    restart = _script(tmp_path / "resume_bg.sh", f"""\
        echo "resume task=$GPULB_TASK_ID lease=$GPULB_LEASE_ID at=$GPULB_TO_NODE:$GPULB_TO_GPU_INDEXES"
        sleep 300 &
        echo $! > {workload}
        exit 0
        """)
    try:
        plan = apb.RebalancePlan(plan_id=99, moves=[apb.Migration(**_MOVE)])
        (outcome,) = PlanExecutor(_Scheduler(), restart=[restart], command_timeout_s=5).execute(plan)
        assert (outcome.outcome, outcome.lease_id, outcome.detail) == ("moved", "L2", ""), outcome
        pid = int(workload.read_text())
        assert _alive(pid)
        assert os.getsid(pid) != os.getsid(0)  # a hook timeout ends the executor's group, not this
    finally:
        _kill(workload)


def test_a_failing_command_still_reports_its_last_line(tmp_path):
    ckpt = _script(tmp_path / "ckpt.sh", "echo saving; echo 'disk full' >&2; exit 3\n")
    plan = apb.RebalancePlan(plan_id=1, moves=[apb.Migration(**_MOVE)])
    (outcome,) = PlanExecutor(_Scheduler(), checkpoint=[ckpt], command_timeout_s=30).execute(plan)
    assert outcome.outcome == "skipped" and outcome.detail == f"checkpoint: {ckpt} exited 3: disk full"


def test_a_command_past_its_timeout_is_killed_with_what_it_started(tmp_path):
    """Its own timeout ends the command's whole group: before, only the shell
    was killed and the child it started ran on."""
    child = tmp_path / "child.pid"
    ckpt = _script(tmp_path / "ckpt.sh", f"""\
        sleep 300 &
        echo $! > {child}
        wait
        """)
    try:
        plan = apb.RebalancePlan(plan_id=1, moves=[apb.Migration(**_MOVE)])
        (outcome,) = PlanExecutor(_Scheduler(), checkpoint=[ckpt], command_timeout_s=6).execute(plan)
        assert outcome.outcome == "skipped" and outcome.detail == f"checkpoint: {ckpt} ran past 6 s", outcome
        assert child.exists() and not _alive(int(child.read_text()))
    finally:
        _kill(child)


# ---- under the coordinator's hook ------------------------------------------------------------------------

_HOOK = """\
import sys, time
sys.path.insert(0, {root!r})
from test_advisor_executor import _Scheduler
from coordinator.executor import PlanExecutor
from protos import advisor_pb2 as apb
plan = apb.RebalancePlan(plan_id=1, moves=[apb.Migration(**{move!r})])
ckpt = {ckpt!r}
for o in PlanExecutor(_Scheduler(), checkpoint=[ckpt] if ckpt else [], restart=[{restart!r}],
                      command_timeout_s=60).execute(plan):
    print(o.outcome, flush=True)
open({marker!r}, "w").write("done")
time.sleep(300)  # the rest of a long plan, past advisor_hook_timeout_s
"""


def _hook(tmp_path: Path, *, restart: str, ckpt: str = "") -> tuple[CommandHook, Path]:
    marker = tmp_path / "executed"
    source = _HOOK.format(root=str(Path(__file__).resolve().parent), move=_MOVE, ckpt=ckpt, restart=restart,
                          marker=str(marker))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return CommandHook([sys.executable, "-c", source], timeout_s=300, env=env), marker


_PLAN = Plan(1, 0.0, "variance", 900.0, 0.0, 60.0, 0.0, (Move("t1", "L1", "training", "a", 0, "GPU-a", "b", 1, "GPU-b",
                                                              40.0, 95.0, 0.0, 0.0),))


async def _run_until(hook: CommandHook, ready) -> asyncio.Task:
    running = asyncio.ensure_future(hook.run(_PLAN))
    for _ in range(1200):  # no timing: the hook is stopped once it got that far
        if ready() or running.done():
            break
        await asyncio.sleep(0.05)
    assert not running.done(), running.result()
    return running


async def test_the_hook_ending_does_not_kill_the_workload_a_restart_started(tmp_path):
    """The executor as the coordinator's hook: the move is made and the
    restart started the workload; then the hook is ended (timeout, or the
    coordinator stopping: the same group kill). The workload was in the
    hook's process group and went with it, leaving a lease with nothing
    running; now it runs on."""
    workload = tmp_path / "workload.pid"
    restart = _script(tmp_path / "resume_bg.sh", f"""\
        sleep 300 &
        echo $! > {workload}
        """)
    hook, marker = _hook(tmp_path, restart=restart)
    try:
        running = await _run_until(hook, marker.exists)
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        pid = int(workload.read_text())
        assert _alive(pid), "the restarted workload was killed with the hook"
    finally:
        _kill(workload)


async def test_a_checkpoint_still_running_when_the_hook_is_ended_goes_with_it(tmp_path):
    """Commands run in sessions of their own now, so the hook's group kill
    alone would leave a hung checkpoint behind: the hook gets SIGTERM first,
    and the executor ends the command's group before it goes."""
    pid_file = tmp_path / "ckpt.pid"
    child = tmp_path / "child.pid"
    ckpt = _script(tmp_path / "ckpt.sh", f"""\
        echo $$ > {pid_file}.tmp && mv {pid_file}.tmp {pid_file}
        sleep 300 &
        echo $! > {child}
        wait
        """)
    hook, _ = _hook(tmp_path, ckpt=ckpt, restart="/bin/true")
    try:
        running = await _run_until(hook, lambda: pid_file.exists() and child.exists())
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        for pid in (int(pid_file.read_text()), int(child.read_text())):
            for _ in range(200):  # reparented to init, which reaps it when it gets to it
                if not _alive(pid):
                    break
                await asyncio.sleep(0.05)
            assert not _alive(pid)
    finally:
        _kill(pid_file)
        _kill(child)


async def test_the_hook_ended_while_a_restart_s_output_is_still_read_spares_the_workload(tmp_path):
    """Review of round 25: a restart whose workload keeps its output open
    leaves the executor reading it for a second after the restart exits; a
    SIGTERM then killed the restart's process group, the workload with it."""
    workload = tmp_path / "workload.pid"
    restart = _script(tmp_path / "resume_bg.sh", f"""\
        sleep 300 &
        echo $! > {workload}.tmp && mv {workload}.tmp {workload}
        """)  # the workload's output is the restart's: the executor reads it on
    hook, _ = _hook(tmp_path, restart=restart)
    try:
        running = await _run_until(hook, workload.exists)
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        assert _alive(int(workload.read_text())), "the restarted workload was killed with the hook"
    finally:
        _kill(workload)
