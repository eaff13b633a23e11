"""``gpulb`` on bad input: every mistyped flag is argparse's error (the flag,
the allowed range, exit 2, no traceback) before any RPC; unreadable token
and CA files are named; and, against a real coordinator, a waiting submit
that runs out of time exits non-zero, the WAIT column of ended tasks stops
growing, unknown nodes are errors, and a closed pipe ends the CLI quietly."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

import pytest

from waiting import until
from agent.fleet import SimFleet
from coordinator.cli import EXIT_BROKEN_PIPE, EXIT_STILL_QUEUED, _check_node, _not_placed, _task_rows, main
from coordinator.config import CoordinatorConfig
from coordinator.server import Coordinator
from protos import tasks_pb2 as tpb

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1]
#: nothing listens here: a check that did not happen shows as an RPC error (exit 1), not exit 2
DEAD = "127.0.0.1:1"

# (argv after --coordinator, text the error must contain)
BAD_INPUT = [
    (["submit", "--vram-gib", "-1"], "argument --vram-gib: must be a finite number from 1/1024 (1 MiB) to 4096, got '-1'"),
    (["submit", "--vram-gib", "nan"], "argument --vram-gib: must be a finite number"),
    (["submit", "--vram-gib", "inf"], "argument --vram-gib:"),
    (["submit", "--vram-gib", "1e400"], "argument --vram-gib:"),
    (["submit", "--vram-gib", "0.0001"], "argument --vram-gib:"),  # 0 MiB once rounded
    (["submit", "--vram-gib", "5000"], "argument --vram-gib:"),
    (["submit", "--vram-mib", "0"], "argument --vram-mib: must be an integer from 1 to 4194304, got '0'"),
    (["submit", "--vram-mib", "-5"], "argument --vram-mib:"),
    (["submit", "--vram-mib", str(10**30)], "argument --vram-mib:"),
    (["submit", "--gpus", "-1"], "argument --gpus: must be an integer from 1 to 64, got '-1'"),
    (["submit", "--gpus", "0"], "argument --gpus: must be an integer from 1 to 64, got '0'"),
    (["submit", "--gpus", "65"], "argument --gpus:"),
    (["submit", "--gpus", "nan"], "argument --gpus:"),
    (["submit", "--share", "1.5"], "argument --share: must be a finite number from 0 to 1"),
    (["submit", "--share", "nan"], "argument --share:"),
    (["submit", "--share", "-0.1"], "argument --share:"),
    (["submit", "--duration", "-1"], "argument --duration: must be a finite number >= 0"),
    (["submit", "--duration", "inf"], "argument --duration:"),
    (["submit", "--deadline", "nan"], "argument --deadline: must be a finite number >= 0"),
    (["submit", "--deadline", "-3"], "argument --deadline:"),
    (["submit", "--timeout", "-1"], "argument --timeout: must be a finite number > 0"),
    (["submit", "--array", "0"], "--array takes 1 to 1000 tasks, got 0"),
    (["submit", "--array", "1001"], "--array takes 1 to 1000 tasks"),
    (["submit", "--label", "novalue"], "argument --label: takes KEY=VALUE, got 'novalue'"),
    (["submit", "--require-label", "=x"], "argument --require-label: takes KEY=VALUE"),
    (["submit", "--priority", "P9"], "argument --priority: invalid choice"),
    (["--timeout", "nan", "nodes"], "argument --timeout: must be a finite number > 0 and <= 604800"),
    (["--timeout", "0", "nodes"], "argument --timeout:"),
    (["--timeout", "1e20", "nodes"], "argument --timeout:"),  # grpc reads it as already passed
    (["tasks", "--limit", "-1"], "argument --limit: must be an integer from 0 to 4294967295"),
    (["tasks", "--limit", str(2**32)], "argument --limit:"),
    (["tasks", "--state", "bogus"], "argument --state: invalid choice"),
    (["top", "--interval", "-1"], "argument --interval: must be a finite number > 0"),
    (["top", "--interval", "nan"], "argument --interval:"),
    (["top", "--interval", "1e300"], "argument --interval:"),
    (["top", "--iterations", "-1"], "argument --iterations: must be an integer >= 0"),
    (["policy", "set", "load_aware", "--weights", "load"], "argument --weights: takes TERM=NUMBER pairs"),
    (["policy", "set", "load_aware", "--weights", "=1"], "argument --weights: takes TERM=NUMBER pairs"),
    (["policy", "set", "load_aware", "--weights", "load=nan"], "argument --weights: weight 'load' must be a finite number >= 0"),
    (["policy", "set", "load_aware", "--weights", "load=-1"], "argument --weights:"),
    (["policy", "bogus"], "argument action: invalid choice"),
    (["policy", "get", "--weights", "load=1"], "policy get takes no NAME or --weights"),
    (["advisor", "execute", "--plans", "-1"], "argument --plans: must be an integer >= 0"),
    (["advisor", "execute", "--command-timeout", "nan"], "argument --command-timeout:"),
    (["advisor", "bogus"], "argument action: invalid choice"),
    (["migrate", "t", "--to-gpu", ":0"], "--to-gpu takes a GPU uuid or NODE:INDEX[,INDEX...], got ':0'"),
    (["migrate", "t", "--to-gpu", "host-a:"], "--to-gpu takes a GPU uuid or NODE:INDEX"),
    (["migrate", "t", "--to-gpu", "host-a:0,x"], "--to-gpu takes a GPU uuid or NODE:INDEX"),
    (["bench", "schedule", "--nodes", "abc"], "argument --nodes: takes comma-separated node counts >= 1"),
    (["bench", "schedule", "--nodes", "1000,0"], "argument --nodes:"),
    (["bench", "schedule", "--clients", "0"], "argument --clients:"),
    (["bench", "schedule", "--requests", "-1"], "argument --requests:"),
    (["bench", "wire", "--gpus", "0"], "argument --gpus: must be an integer from 1 to 64"),
    (["bench", "wire", "--samples", "0"], "argument --samples:"),
    (["bench", "ingest", "--hosts", "-1"], "argument --hosts:"),
    (["bench", "ingest", "--hosts", str(10**400)], "argument --hosts:"),
    (["bench", "ingest", "--interval", "0"], "argument --interval: must be a finite number > 0"),
    (["bench", "ingest", "--duration", "nan"], "argument --duration:"),
    (["bench", "ingest", "--warmup", "-1"], "argument --warmup:"),
    (["bench", "ingest", "--channels", "0"], "argument --channels:"),
    (["demo", "--duration", "inf"], "argument --duration: must be a number from 4 to 3600"),
    # names the CLI knows as the coordinator does: usage errors, not INVALID_ARGUMENT refusals (exit 1)
    (["gpus", "--metrics", "bogus"], "argument --metrics: unknown metric 'bogus'; known: clock, ecc"),
    (["gpus", "--metrics", "util,,tmp"], "argument --metrics: unknown metric 'tmp'"),
    (["policy", "set", "bogus"], "argument NAME: unknown policy 'bogus'; available: round_robin, weighted_round_robin"),
    (["policy", "set", "Load_Aware"], "argument NAME: unknown policy 'Load_Aware'"),
]


@pytest.mark.parametrize("argv,needle", BAD_INPUT, ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_a_bad_flag_is_an_argparse_error_naming_it_and_its_range(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--coordinator", DEAD, *argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    assert needle in err
    assert "Traceback" not in err and "usage: gpulb" in err


def test_known_metric_and_policy_names_go_to_the_coordinator(capsys):
    """The local checks take what the coordinator takes (aliases, field
    names, any case and spacing for metrics): nothing listens at DEAD, so a
    name that passed shows as the RPC error, exit 1."""
    for argv in (["gpus", "--metrics", " Util,memory,temperature_c"], ["policy", "set", "fgd"],
                 ["policy", "set", "--weights", "load=1"]):
        assert main(["--coordinator", DEAD, "--timeout", "2", *argv]) == 1, argv
        assert "UNAVAILABLE" in capsys.readouterr().err


def test_every_argument_says_what_it_is():
    """--json had no help text in gpus, nodes, policy, advisor, bench and
    others, nor did policy's get/set, task ids or submit's --priority."""
    undocumented = []

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{path} {name}")
            elif not action.help and not isinstance(action, argparse._HelpAction):
                undocumented.append(f"{path} {'/'.join(action.option_strings) or action.dest}")

    from coordinator.cli import build_parser

    walk(build_parser(), "gpulb")
    assert undocumented == [], undocumented


def test_policy_help_says_what_set_alone_takes(capsys):
    with pytest.raises(SystemExit):
        main(["policy", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--weights WEIGHTS set only:" in out and "set only: round_robin, weighted_round_robin" in out


def test_executor_commands_are_checked_before_the_first_plan(tmp_path, monkeypatch, capsys):
    """`--checkpoint ckpt.sh` (the README's old example) runs without a shell,
    so a script in the working directory is not found: it skipped every move
    with exit 0. Now exit 2 before any plan, naming the flag and the fix; a
    path works."""
    script = tmp_path / "ckpt.sh"
    script.write_text("#!/bin/sh\nexit 0\n")
    script.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    for flag, value, needle in (("--checkpoint", "ckpt.sh", "'ckpt.sh' is not an executable on PATH (the command runs without "
                                 "a shell: give its path, e.g. ./ckpt.sh"),
                                ("--restart", "./missing.sh --now", "'./missing.sh' is not an executable file"),
                                ("--checkpoint", "sh -c 'unbalanced", "No closing quotation")):
        with pytest.raises(SystemExit) as exc:
            main(["--coordinator", DEAD, "advisor", "execute", "--stdin", flag, value])
        err = capsys.readouterr().err
        assert exc.value.code == 2, err
        assert f"argument {flag}:" in err and needle in err, err


class _Scheduler:
    """A Scheduler stub: GetTask answers ``task``; MigrateTask is not expected."""

    def __init__(self, task) -> None:
        self.task = task

    def GetTask(self, request, timeout):
        return self.task

    def MigrateTask(self, request, timeout):
        raise AssertionError("MigrateTask of a move that should not have been tried")


_PLAN = {"plan_id": 7, "moves": [{"task_id": "t1", "lease_id": "L1", "from_node_id": "a", "from_gpu_index": 0,
                                  "from_gpu_uuid": "GPU-a", "to_node_id": "b", "to_gpu_index": 1, "to_gpu_uuid": "GPU-b"}]}


def test_a_failing_checkpoint_skips_the_move_and_exits_1(tmp_path, monkeypatch, capsys):
    """A checkpoint command that fails leaves the task where it is: no
    MigrateTask is made, and the exit status says a command failed, so the
    coordinator's hook outcome (and GpulbRebalanceExecutorFailing) sees it;
    before, exit 0 hid a rebalancer that never moved anything."""
    import io
    import json

    from coordinator import cli

    leased = tpb.Task(spec=tpb.TaskSpec(task_id="t1"), state=tpb.TASK_STATE_LEASED,
                      assignment=tpb.Assignment(node_id="a", gpu_index=[0], gpu_uuid=["GPU-a"], lease_id="L1"))
    monkeypatch.setattr(cli.tpb_grpc, "SchedulerStub", lambda channel: _Scheduler(leased))
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(_PLAN)))
    code = main(["--coordinator", DEAD, "advisor", "execute", "--stdin",
                 "--checkpoint", f"{sys.executable} -c \"raise SystemExit('disk full')\""])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "plan 7: t1 a:0 -> b:1: skipped" in out and "disk full" in out


def test_a_stale_plan_runs_nothing_and_is_no_failure(tmp_path, monkeypatch, capsys):
    """A plan whose task completed since it was made: no checkpoint (it would
    stop nothing gpulb runs), no MigrateTask, no restart; exit 0, for no
    command failed."""
    import io
    import json

    from coordinator import cli

    done = tpb.Task(spec=tpb.TaskSpec(task_id="t1"), state=tpb.TASK_STATE_COMPLETED,
                    assignment=tpb.Assignment(node_id="a", gpu_index=[0], gpu_uuid=["GPU-a"], lease_id="L1"))
    monkeypatch.setattr(cli.tpb_grpc, "SchedulerStub", lambda channel: _Scheduler(done))
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(_PLAN)))
    ran = tmp_path / "ran"
    touch = f"{sys.executable} -c \"open({str(ran)!r}, 'a').write('x')\""
    code = main(["--coordinator", DEAD, "advisor", "execute", "--stdin", "--checkpoint", touch, "--restart", touch])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "plan 7: t1 a:0 -> b:1: stale, no lease (stale plan: the task is completed; nothing was run)" in out
    assert not ran.exists()


def test_a_move_the_executor_cannot_check_runs_nothing_and_exits_1(tmp_path, monkeypatch, capsys):
    """Nothing listens at DEAD: GetTask fails, so whether the task still holds
    the plan's lease is unknown; nothing runs ("unchecked"), and the exit
    status says the executor is not working (as the hook, its outcome is
    failed), where a stale plan is no failure."""
    import io
    import json

    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(_PLAN)))
    ran = tmp_path / "ran"
    touch = f"{sys.executable} -c \"open({str(ran)!r}, 'a').write('x')\""
    code = main(["--coordinator", DEAD, "--timeout", "2", "advisor", "execute", "--stdin", "--checkpoint", touch,
                 "--restart", touch])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "plan 7: t1 a:0 -> b:1: unchecked" in out and "GetTask failed (UNAVAILABLE" in out
    assert not ran.exists()


def test_submit_says_the_time_a_lease_has_left_or_the_state_of_a_task_that_ended(monkeypatch, capsys):
    """`gpulb submit` printed "expires in 300 s" from lease_expires_at_ns -
    placed_at_ns (the lease's length), also for a resubmitted id whose task
    had long completed: now the time left from the wall clock, and the state
    of a task that holds no lease."""
    from coordinator import cli

    now = time.time_ns()

    class Stub:
        def __init__(self, channel) -> None:
            pass

        def ScheduleTask(self, request, timeout):
            return tpb.ScheduleTaskResponse(task=answer)

    def submitted(task) -> str:
        nonlocal answer
        answer = task
        assert main(["--coordinator", DEAD, "submit", "--id", "t", "--vram-gib", "1"]) == 0
        return capsys.readouterr().out

    answer = None
    monkeypatch.setattr(cli.tpb_grpc, "SchedulerStub", Stub)
    placed = tpb.Assignment(node_id="n", gpu_index=[0], gpu_uuid=["GPU-0"], lease_id="L1",
                            placed_at_ns=now - 200 * 10**9, lease_expires_at_ns=now + 100 * 10**9)
    out = submitted(tpb.Task(spec=tpb.TaskSpec(task_id="t"), state=tpb.TASK_STATE_LEASED, assignment=placed))
    assert "lease L1, expires in 100 s; GPU uuids GPU-0" in out or "lease L1, expires in 99 s" in out, out
    out = submitted(tpb.Task(spec=tpb.TaskSpec(task_id="t"), state=tpb.TASK_STATE_COMPLETED, assignment=placed,
                             finished_at_ns=now - 60 * 10**9))
    assert "no lease: the task is completed, 60 s ago; it ran on GPU uuids GPU-0" in out, out
    assert "expires" not in out and "lease L1" not in out


def test_the_entry_point_exits_2_without_a_traceback():
    import subprocess

    for argv, needle in ((["submit", "--vram-gib", "nan"], "argument --vram-gib"),
                         (["submit", "--gpus", "-1"], "argument --gpus")):
        done = subprocess.run([sys.executable, "-m", "coordinator.cli", "--coordinator", DEAD, *argv],
                              capture_output=True, text=True, cwd=ROOT, timeout=30)
        assert done.returncode == 2, done.stderr
        assert needle in done.stderr and "Traceback" not in done.stderr


def test_an_unreadable_token_or_ca_file_is_named_with_its_variable(tmp_path, monkeypatch, capsys):
    missing = str(tmp_path / "nonexistent")
    monkeypatch.setenv("GPULB_TOKEN_FILE", missing)
    with pytest.raises(SystemExit) as exc:
        main(["--coordinator", DEAD, "nodes"])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert "GPULB_TOKEN_FILE" in err and missing in err and "No such file" in err and "Traceback" not in err
    monkeypatch.delenv("GPULB_TOKEN_FILE")

    with pytest.raises(SystemExit) as exc:
        main(["--coordinator", DEAD, "--token-file", str(tmp_path), "nodes"])  # a directory
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--token-file" in err and str(tmp_path) in err

    monkeypatch.setenv("GPULB_CA_FILE", missing)
    with pytest.raises(SystemExit) as exc:
        main(["--coordinator", DEAD, "nodes"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "GPULB_CA_FILE" in err and missing in err


def _task(state: int, submitted_s_ago: float, finished_s_ago: float | None = None, placed_s_ago: float | None = None):
    now = time.time_ns()
    task = tpb.Task(spec=tpb.TaskSpec(task_id="t", num_gpus=1, vram_mib=1024), state=state,
                    submitted_at_ns=now - int(submitted_s_ago * 1e9))
    if finished_s_ago is not None:
        task.finished_at_ns = now - int(finished_s_ago * 1e9)
    if placed_s_ago is not None:
        task.assignment.node_id = "n"
        task.assignment.gpu_index.append(0)
        task.assignment.placed_at_ns = task.assignment.run_started_at_ns = now - int(placed_s_ago * 1e9)
    return task


def test_the_wait_of_a_task_that_ended_unplaced_ends_when_it_ended():
    wait = 9  # the WAIT s column
    rows = _task_rows([
        _task(tpb.TASK_STATE_EXPIRED, 10, finished_s_ago=8),
        _task(tpb.TASK_STATE_CANCELLED, 60, finished_s_ago=59.5),
        _task(tpb.TASK_STATE_REJECTED, 30, finished_s_ago=30),
        _task(tpb.TASK_STATE_COMPLETED, 20, finished_s_ago=1, placed_s_ago=17),
        _task(tpb.TASK_STATE_QUEUED, 3),
    ])
    assert [r[wait] for r in rows[:4]] == ["2.00", "0.50", "0.00", "3.00"]
    assert 3.0 <= float(rows[4][wait]) < 4.0  # still queued: until now


def test_submits_exit_status_says_whether_every_task_was_placed(capsys):
    args = argparse.Namespace(timeout=10.0)
    placed = _task(tpb.TASK_STATE_LEASED, 1, placed_s_ago=0.5)
    queued = _task(tpb.TASK_STATE_QUEUED, 10)
    expired = _task(tpb.TASK_STATE_EXPIRED, 10, finished_s_ago=5)
    assert _not_placed([placed], args, 0.5) == 0
    assert capsys.readouterr().err == ""
    assert _not_placed([placed, queued], args, 10.0) == EXIT_STILL_QUEUED
    assert "still queued: --timeout 10 s ran out; it stays queued" in capsys.readouterr().err
    assert _not_placed([queued, expired], args, 10.0) == 1
    assert _not_placed([expired, queued], args, 10.0) == 1
    queued.spec.deadline_s = 2.0  # the wait ended at its deadline: it expires, it does not stay
    assert _not_placed([queued], args, 2.0) == 1
    assert "was not placed by its --deadline 2 s" in capsys.readouterr().err


def test_an_empty_gpu_list_for_a_node_asks_whether_the_node_exists():
    class Stub:
        asked: list = []

        def GetNode(self, request, timeout):
            self.asked.append(request.node_id)

    stub = Stub()
    _check_node(stub, "nope", [], 1.0)
    _check_node(stub, "busy", ["a gpu"], 1.0)
    _check_node(stub, None, [], 1.0)
    assert stub.asked == ["nope"]


async def _gpulb(target: str, *argv: str, stdout=asyncio.subprocess.PIPE) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "coordinator.cli", "--coordinator", target, *argv,
        stdout=stdout, stderr=asyncio.subprocess.PIPE, cwd=ROOT,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    return proc.returncode, (out or b"").decode(), err.decode()


def _wait_column(table: str, task_id: str) -> str:
    row = next(line.split() for line in table.splitlines() if line.split()[:1] == [task_id])
    return row[9]  # TASK TENANT PRIO EFF KIND STATE GPUS GiB/GPU PLACED-ON WAIT


async def test_against_a_real_coordinator_timeouts_waits_unknown_nodes_and_pipes():
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", dispatch_interval_s=0.1))
    port = await coord.start()
    target = f"127.0.0.1:{port}"
    try:
        async with SimFleet(target, hosts=1, gpus=2, workload="idle"):
            await until(lambda: coord.dispatcher.snapshots.snapshot().healthy.sum() == 2, what="2 healthy GPUs")

            # 7: an unknown node is NOT_FOUND, as for the node actions; a known one lists
            for argv in (["gpus", "--node", "nope"], ["processes", "--node", "nope"],
                         ["top", "--node", "nope", "--iterations", "1", "--no-clear"]):
                rc, out, err = await _gpulb(target, *argv)
                assert rc == 1 and "no node 'nope'" in err, (argv, rc, out, err)
            rc, out, err = await _gpulb(target, "gpus", "--node", "sim-01")
            assert rc == 0 and out.count("sim-01") == 2, err

            # 5: a waiting submit that runs out of --timeout exits EXIT_STILL_QUEUED and says why
            assert (await _gpulb(target, "cordon", "sim-01"))[0] == 0
            rc, out, err = await _gpulb(target, "--timeout", "1", "submit", "--id", "q", "--vram-gib", "1")
            assert rc == EXIT_STILL_QUEUED, (out, err)
            assert "q is still queued: --timeout 1 s ran out; it stays queued" in err
            assert "node_unschedulable" in err  # the task's reason: why it waits
            # ... and one whose --deadline passes first is not placed (exit 1); submit takes --timeout too
            rc, out, err = await _gpulb(target, "submit", "--id", "dl", "--vram-gib", "1", "--deadline", "0.3", "--timeout", "5")
            assert rc == 1 and "dl" in err and "deadline" in err, (out, err)
            assert (await _gpulb(target, "cancel", "q"))[0] == 0
            await until(lambda: coord.dispatcher.engine.get("dl").state.name == "EXPIRED", what="dl expired")

            # 6: the WAIT of tasks that ended unplaced stays what it was when they ended
            rc, first, err = await _gpulb(target, "tasks")
            assert rc == 0, err
            await asyncio.sleep(1.0)
            rc, second, err = await _gpulb(target, "tasks")
            for task_id in ("q", "dl"):
                assert _wait_column(first, task_id) == _wait_column(second, task_id), (first, second)
            assert 0.25 <= float(_wait_column(second, "dl")) < 1.0  # expired ~0.3 s after it was queued

            # 8: migrate to a node that does not exist says so
            assert (await _gpulb(target, "uncordon", "sim-01"))[0] == 0
            rc, out, err = await _gpulb(target, "submit", "--id", "run", "--vram-gib", "1")
            assert rc == 0 and "chosen by" in out, err
            rc, out, err = await _gpulb(target, "migrate", "run", "--to-gpu", "nohost:0")
            assert rc == 1 and "--to-gpu nohost:0: no node 'nohost'" in err and "has no GPU" not in err, err
            rc, out, err = await _gpulb(target, "migrate", "run", "--to-gpu", "sim-01:7")
            assert rc == 1 and "node 'sim-01' has no GPU 7" in err, err

            # 4: a reader that went away (gpulb ... | head) ends the CLI quietly
            read_end, write_end = os.pipe()
            os.close(read_end)
            try:
                rc, _, err = await _gpulb(target, "policy", "get", stdout=write_end)
            finally:
                os.close(write_end)
            assert rc == EXIT_BROKEN_PIPE and err == "", err
    finally:
        await coord.stop(grace_s=0.1)


def test_the_tasks_table_cuts_long_reasons_unless_wide():
    """A waiting task's reason names every filter that refused it (~200
    characters): every row wrapped on a terminal. The table shows the first
    REASON_COLUMN characters; --wide and --json show it whole."""
    from coordinator import cli
    from protos import tasks_pb2 as tpb

    reason = "waiting: no GPU fits (14 GPUs; rejected by: " + ", ".join(f"filter_{i} 1" for i in range(30)) + ")"
    task = tpb.Task(spec=tpb.TaskSpec(task_id="t", vram_mib=1024), state=tpb.TASK_STATE_QUEUED, reason=reason)
    short = cli._task_rows([task], wide=False)[0][-1]
    assert len(short) == cli.REASON_COLUMN and short.endswith("…") and reason.startswith(short[:-1])
    assert cli._task_rows([task], wide=True)[0][-1] == reason


def test_help_says_the_defaults_of_top_and_bench(capsys):
    """`gpulb bench --help` listed --samples, --hosts, --duration... with no
    default, and `gpulb cluster homogeneous` wrote 8 x 4 RTX 4090 unasked."""
    for argv, needles in ((["top", "--help"], ["(default: 1.0)", "(default: 0)"]),
                          (["bench", "--help"], ["(default: 600)", "(default: 2500)", "(default: 40.0)"]),
                          (["--help"], ["default 10", "default 127.0.0.1:50051"]),
                          (["cluster", "homogeneous", "--help"], ["(default 8)", "(default 4)", "(default RTX 4090)"])):
        with pytest.raises(SystemExit):
            main(argv)
        out = " ".join(capsys.readouterr().out.split())
        for needle in needles:
            assert needle in out, (argv, needle)
        assert "(default: None)" not in out and "(default: False)" not in out


def test_what_agents_and_tenants_write_cannot_drive_the_operators_terminal():
    """A GPU model, label or driver string an agent reports and a reason a
    tenant gives were printed raw: an ESC sequence set the window title or
    cleared the screen, a newline added a fake row (QA pass 23). Tables and
    the watch line write such characters as escapes; ordinary text, emoji
    included, is untouched."""
    from coordinator.tables import render_table, safe_text

    hostile = "\x1b]0;PWNED\x07\x1b[2J\x1b[31mRED\nfake-node  HEALTHY\x00\u202eevil\u200f"
    table = render_table(["NODE", "LABELS"], [["gpu-01", hostile], ["gpu-02", "rack=r2 🚀"]])
    assert "\x1b" not in table and "\x00" not in table and "\u202e" not in table and "\u200f" not in table
    assert len(table.splitlines()) == 4  # header, rule, two rows: no injected row
    assert "\\x1b]0;PWNED\\x07" in table and "\\n" in table and "\\u202e" in table
    assert "rack=r2 🚀" in table and safe_text("plain text, é") == "plain text, é"


def test_the_cli_against_a_coordinator_from_before_paging_and_the_overrun_column(capsys):
    """QA pass 24 (upgrades): a coordinator from before ListTasks paging
    sends no next_page_token, so a full page ended the listing without the
    'may be more' the CLI said before; and one from before overrun_ratio
    sends 0, which read as '0.00x' (a run taking none of its predicted time)."""
    from concurrent import futures

    import grpc

    from protos import advisor_pb2 as apb
    from protos import advisor_pb2_grpc as apb_grpc
    from protos import tasks_pb2_grpc as tpb_grpc

    class OldScheduler(tpb_grpc.SchedulerServicer):
        def ListTasks(self, request, context):  # ignores page_token and paged, as an old one does
            return tpb.ListTasksResponse(tasks=[tpb.Task(spec=tpb.TaskSpec(task_id=f"t{i}")) for i in range(request.limit)])

    class OldAdvisor(apb_grpc.AdvisorServicer):
        def GetPredictions(self, request, context):
            return apb.GetPredictionsResponse(samples=3, models=[
                apb.SpeedFactor(model="RTX 4090", kind="training", slowdown=1.1, prior=1.0, samples=3)])

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    tpb_grpc.add_SchedulerServicer_to_server(OldScheduler(), server)
    apb_grpc.add_AdvisorServicer_to_server(OldAdvisor(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        argv = ["--coordinator", f"127.0.0.1:{port}"]
        assert main(argv + ["tasks", "--limit", "3"]) == 0
        captured = capsys.readouterr()
        assert "t2" in captured.out and "the first 3; there may be more" in captured.err
        assert main(argv + ["advisor", "predictions"]) == 0
        row = next(line for line in capsys.readouterr().out.splitlines() if "training" in line)
        assert row.rstrip().endswith("-") and "0.00x" not in row
    finally:
        server.stop(0)
