"""benchmarks/real_gpu.py, rehearsed without a GPU (simulated backend, a load
that only sleeps): the script a GPU host runs must not rot between the
sessions that have one. Real processes on loopback, as on the GPU."""

from __future__ import annotations

import csv
import json
import os
import pwd
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.demo import ProcessGroup, can_deny_write_execute, popen_as

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_real_gpu_script_runs_end_to_end_on_the_simulator(tmp_path: Path) -> None:
    out = tmp_path / "rg"
    # and the unit's system-call filter, where systemd here can resolve it
    spec = tmp_path / "agent-seccomp.json"
    resolved = subprocess.run([sys.executable, "-m", "coordinator.sandbox", "--out", str(spec)], cwd=ROOT).returncode == 0
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "real_gpu.py"), "--rehearse", "--out", str(out),
         "--calm-s", "1", "--load-s", "2", "--load-gib", "16",
         # the User= path (the agent and its own --check as a named user); the
         # current one here, so the privilege drop itself is tested below
         "--agent-user", pwd.getpwuid(os.getuid()).pw_name,
         # and MemoryDenyWriteExecute=, where this kernel can enforce it
         *(["--agent-wx"] if can_deny_write_execute() else []),
         *(["--agent-seccomp", str(spec)] if resolved else [])],
        capture_output=True, text=True, timeout=110, cwd=ROOT,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads((out / "real_gpu.json").read_text())
    assert summary["check"]["ok"] is True and summary["check"]["backend"] == "sim"
    assert summary["user_check"]["exit_code"] == 0 and "check: PASS" in summary["user_check"]["output"]
    assert summary["agent_write_xor_execute"] is can_deny_write_execute()
    if resolved:  # the agent's own check ran under the filter and saw it
        assert "gpulb-agent.service" in summary["agent_seccomp"]
        assert ", seccomp filter" in summary["user_check"]["output"]
    # gpulb processes was asked during the load and answered (the sim lists the processes of the tasks it leased)
    listed = summary["processes"]["gpulb"]
    assert summary["processes"]["load_pid"] > 0 and isinstance(listed, list), listed
    assert all(p["gpu"] == 0 and p["used_memory_mib"] > 0 for p in listed)
    assert [p["phase"] for p in summary["phases"]] == ["calm", "load", "calm after"]
    assert all(p["period_ms_last"] in range(200, 2001) for p in summary["phases"])
    assert all(p["reading_age_s_max"] is not None and p["reading_age_s_max"] < 10 for p in summary["phases"])
    fits = summary["tasks"]["fits-beside-load"]
    assert fits["state"] == "TASK_STATE_LEASED" and fits["gpu"] == "gpu-host/[0]"
    assert summary["exit_codes"] == {"coordinator": 0, "agent": 0}
    with open(out / "timeline.csv") as fh:
        sources = {row["source"] for row in csv.DictReader(fh)}
    assert "coordinator" in sources
    assert (out / "coordinator.log").exists() and (out / "agent.log").exists()
    assert "PERIOD ms" in run.stdout and "READING AGE MAX s" in run.stdout


def test_popen_as_no_user_changes_nothing() -> None:
    assert popen_as(None) == {} and popen_as("") == {}


def test_popen_as_unknown_user_is_refused_before_anything_starts() -> None:
    with pytest.raises(KeyError):
        popen_as("no-such-gpulb-user-x")


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can start a process as another user")
@pytest.mark.skipif(not os.path.exists("/usr/bin/python3"), reason="needs a system Python every user can run")
def test_process_group_starts_a_child_as_the_named_user_with_its_groups(tmp_path: Path) -> None:
    """What real_gpu.py --agent-user relies on: the agent runs as the unit's
    User= would, that user's uid, primary group and supplementary groups, not
    root's."""
    entry = pwd.getpwnam("nobody")
    group = ProcessGroup(tmp_path)
    proc = group.start("who", ["/usr/bin/python3", "-c", "import os; print(os.getuid(), os.getgid(), sorted(os.getgroups()))"],
                       user="nobody")
    assert proc.wait(timeout=30) == 0
    uid, gid, groups = (tmp_path / "who.log").read_text().split(" ", 2)
    assert (int(uid), int(gid)) == (entry.pw_uid, entry.pw_gid)
    assert [int(g) for g in groups.strip("[]\n").split(",") if g.strip()] == sorted(os.getgrouplist("nobody", entry.pw_gid))  # root's groups dropped


@pytest.mark.skipif(not can_deny_write_execute(), reason="the kernel cannot enforce W^X on a process (PR_SET_MDWE, Linux < 6.3)")
def test_process_group_starts_a_child_under_write_xor_execute(tmp_path: Path) -> None:
    """What real_gpu.py --agent-wx relies on: the child (after exec) may not
    map writable+executable memory, as under MemoryDenyWriteExecute=yes; a
    child started without it may."""
    probe = ("import mmap\ntry:\n    mmap.mmap(-1, 4096, prot=7).close(); print('allowed')\n"
             "except OSError as exc:\n    print('refused', exc.errno)")
    group = ProcessGroup(tmp_path)
    assert group.start("wx", [sys.executable, "-c", probe], write_xor_execute=True).wait(timeout=30) == 0
    assert group.start("plain", [sys.executable, "-c", probe]).wait(timeout=30) == 0
    assert (tmp_path / "wx.log").read_text().split() == ["refused", "13"]  # EACCES
    assert (tmp_path / "plain.log").read_text().split() == ["allowed"]
