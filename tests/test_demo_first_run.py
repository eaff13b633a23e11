"""``gpulb demo`` as a first-time operator meets it (the first-run QA pass):
the caller's GPULB_* settings do not reach its cluster, a child that dies is
told at once, bad flags are usage errors, the live table fits an 80x24
terminal, and Ctrl-C, SIGTERM and SIGHUP stop it cleanly with the signal's
exit status and a summary labelled partial. Each real run is one simulated
GPU for a few seconds."""

from __future__ import annotations

import hashlib
import io
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from coordinator.demo import ProcessGroup, _Display, _gpu_table, free_port
from coordinator.demo_workload import build_workload
from protos import cluster_pb2 as cpb
from test_demo import _assert_nothing_left, _pids_with_marker

#: the checkout these tests belong to: its code is the code under test in every child
ROOT = Path(__file__).resolve().parents[1]
#: the smallest real demo: one simulated GPU, two 2 s phases, no other tenants' load
SMALL = ["--no-live", "--agents", "1", "--gpus-per-agent", "1", "--duration", "4", "--background", "idle"]


def _env(marker: str, **extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "DEMO_TEST_RUN_MARKER": marker, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path, **extra}


class _Demo:
    """A demo started in the background, its output read as it comes."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path | None = None) -> None:
        self.marker = env["DEMO_TEST_RUN_MARKER"]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd)
        self.lines: list[str] = []
        self._seen = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._seen:
                self.lines.append(line)
                self._seen.notify_all()
        with self._seen:
            self.lines.append("")  # end of output
            self._seen.notify_all()

    @property
    def out(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout_s: float = 20.0) -> None:
        with self._seen:
            if not self._seen.wait_for(lambda: text in self.out or (self.lines and self.lines[-1] == ""), timeout_s):
                pytest.fail(f"no {text!r} within {timeout_s:g} s:\n{self.out}")
        assert text in self.out, self.out

    def finish(self, timeout_s: float = 30.0) -> tuple[int, str]:
        rc = self.proc.wait(timeout=timeout_s)
        with self._seen:
            self._seen.wait_for(lambda: self.lines and self.lines[-1] == "", 5)
        return rc, self.out

    def close(self) -> None:
        """Whatever happened: the demo and its children gone (stopped ones too)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in _pids_with_marker(self.marker):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def demo(tmp_path):
    started: list[_Demo] = []
    scratch = tmp_path / "demo-tmp"  # TMPDIR: a demo killed on a failure leaves its temporary directory here
    scratch.mkdir()

    def start(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None, argv0: list[str] | None = None):
        env = {"TMPDIR": str(scratch), **(env or _env(f"gpulb-demo-test-{uuid.uuid4().hex}"))}
        run = _Demo([*(argv0 or [sys.executable, "-m", "coordinator.cli", "demo"]), *args], env, cwd)
        started.append(run)
        return run

    yield start
    for run in started:
        run.close()


# ---- 1: the caller's environment --------------------------------------------------------------


def test_child_environment_leaves_out_gpulb_and_systemd_service_variables():
    from coordinator.demo import child_environment

    env, ignored = child_environment({"PATH": "/usr/bin", "HOME": "/root", "PYTHONPATH": "/src", "GPULB_TOKEN_FILE": "/t",
                                      "GPULB_SCHEDULER_POLICY": "binpack", "NOTIFY_SOCKET": "/run/n", "LANG": "C.UTF-8"})
    assert env == {"PATH": "/usr/bin", "HOME": "/root", "PYTHONPATH": "/src", "LANG": "C.UTF-8"}
    assert ignored == ["GPULB_SCHEDULER_POLICY", "GPULB_TOKEN_FILE"]


@pytest.mark.timeout(60)
def test_the_callers_gpulb_settings_do_not_reach_the_demos_cluster(demo, tmp_path):
    """The README has operators export GPULB_TOKEN_FILE for the CLI; a
    coordinator that read it refused to start and the demo hung for 60 s."""
    token = tmp_path / "token"
    token.write_text("s3cr3t-token-value\n")
    env = _env(f"gpulb-demo-test-{uuid.uuid4().hex}", GPULB_TOKEN_FILE=str(token), GPULB_METRICS_LISTEN="not-an-address")
    run = demo(*SMALL, env=env)
    run.wait_for("1 of 1 GPU", timeout_s=20)
    # the names set here among those ignored (CI exports GPULB_TRACES besides)
    said = re.search(r"ignoring (\S.*) from the environment", run.out)
    assert said and {"GPULB_METRICS_LISTEN", "GPULB_TOKEN_FILE"} <= set(said.group(1).split(", ")), run.out
    run.proc.send_signal(signal.SIGTERM)
    rc, out = run.finish()
    assert rc == 128 + signal.SIGTERM, out
    _assert_nothing_left(run.marker, None)


def test_a_child_that_exits_early_is_told_at_once_with_its_status_and_log(tmp_path, capsys):
    from coordinator.demo import ChildExited, _tell_early_exit, _wait_for_gpus

    group = ProcessGroup(tmp_path)
    group.start("agent-1", [sys.executable, "-c", "print('usage: gpulb-agent ...'); print('error: refused'); raise SystemExit(2)"])
    started = time.monotonic()
    try:
        with pytest.raises(ChildExited) as exc:
            _wait_for_gpus(f"127.0.0.1:{free_port()}", 1, timeout_s=60, check_children=group.raise_if_exited)
    finally:
        group.stop_all()
    assert time.monotonic() - started < 10
    assert (exc.value.name, exc.value.status) == ("agent-1", 2)
    _tell_early_exit(group, tmp_path, reported := set())
    said = capsys.readouterr().out
    assert "agent-1 exited with status 2 before the demo stopped it" in said and "  error: refused" in said
    assert reported == {"agent-1"}


# ---- 2, 10, 12: flags ------------------------------------------------------------------------


@pytest.mark.parametrize("flag,value", [
    ("--gpus-per-agent", "65"),  # the agent's own bound: it refused 65 and the demo hung
    ("--gpus-per-agent", "0"),
    ("--agents", "65"),  # each agent is a process of about 75 MiB
    ("--agents", "0"),
    ("--duration", "3"),
    ("--duration", "3601"),  # the whole workload is built up front
    ("--duration", "nan"),
])
def test_flags_out_of_range_are_usage_errors_naming_the_flag(flag, value, capsys):
    from coordinator.cli import build_parser

    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["demo", flag, value])
    assert exc.value.code == 2
    assert f"gpulb demo: error: argument {flag}: must be " in capsys.readouterr().err


@pytest.mark.parametrize("where", ["a-file", "a-file/logs"])
def test_a_log_dir_that_cannot_be_made_is_a_usage_error(tmp_path, where):
    (tmp_path / "a-file").write_text("not a directory\n")
    run = subprocess.run([sys.executable, "-m", "coordinator.cli", "demo", "--log-dir", str(tmp_path / where)],
                         capture_output=True, text=True, env=_env("unused"), timeout=60)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "gpulb demo: error: argument --log-dir: " in run.stderr and "Traceback" not in run.stderr
    assert run.stdout == ""  # nothing started


# ---- 3: the live table -----------------------------------------------------------------------


def _gpus(nodes: int, per_node: int) -> list[cpb.Gpu]:
    return [cpb.Gpu(node_id=f"sim-{n:02d}", index=i, util_gpu_pct=float((n * 7 + i * 13) % 101), memory_used_mib=10240,
                    memory_total_mib=24564, temperature_c=45.0, active_tasks=1)
            for n in range(1, nodes + 1) for i in range(per_node)]


@pytest.mark.parametrize("nodes,per_node,lines,width", [
    (6, 4, 21, 79),  # the default cluster in 80x24
    (16, 4, 21, 119),  # 64 GPUs in 120x24
    (2, 64, 21, 79),  # the most GPUs a host
    (64, 64, 21, 79),  # the most of both: cut, with a line for the rest
    (3, 4, 10, 30),
])
def test_gpu_table_fits_the_terminal_it_is_given(nodes, per_node, lines, width):
    table = _gpu_table(_gpus(nodes, per_node), max_lines=lines, max_width=width).splitlines()
    assert len(table) <= lines and max(map(len, table)) <= width, "\n".join(table)
    shown = {n for n in range(1, nodes + 1) if any(f"sim-{n:02d}" in row for row in table)}
    assert len(shown) == nodes or f"{nodes - len(shown)} more nodes" in table[-1]


def test_live_frame_fits_an_80x24_terminal_and_is_redrawn_over_itself(monkeypatch):
    """Every frame line shorter than the terminal (a wrapped one moved the
    redraw off by a row) and the frame no taller than it."""
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setenv("LINES", "24")
    out = io.StringIO()
    display = _Display(out, io.StringIO(), live=True, log_every_s=1.0)
    status = ["[round_robin draining, 12 left]", "submitted 133  queued 3  running 20  completed 110  failed 0",
              "util mean 54% std 36 max-min 100"]
    display.update(1.0, "round_robin", 0.5, status, _gpus(6, 4))
    display.update(2.0, "round_robin", 0.6, status, _gpus(6, 4))
    first, up, second = re.match(r"(.*)\x1b\[(\d+)F\x1b\[J(.*)", out.getvalue(), re.S).groups()
    assert int(up) == first.count("\n")  # back over exactly the frame drawn before
    rows = second.splitlines()
    assert len(rows) <= 24 - 2  # the progress bar's line and one spare
    assert max(map(len, rows)) < 80, second
    assert "submitted 133" in second and "sim-06" in second


# ---- 6, 7, 9: stopping -----------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_sigterm_in_phase_two_gives_a_labelled_partial_summary_and_exit_143(demo):
    run = demo(*SMALL)
    run.wait_for("phase 2/2", timeout_s=30)
    run.proc.send_signal(signal.SIGTERM)
    rc, out = run.finish()
    assert rc == 143, out
    assert "SIGTERM during phase 2 of 2 (load_aware): stopping the cluster" in out
    summary = out[out.index("partial summary: interrupted during phase 2 of 2 (load_aware)"):].splitlines()
    assert summary[1].split() == ["round_robin"]  # the finished phase only
    assert "log ends" not in out and "temperatures carry over" not in out  # no raw log, no second phase
    assert out.rstrip().endswith("all processes stopped")
    # 12: messages that fit what ran
    assert "1 simulated host x 1 RTX 4090" in out
    clients = len({t.scenario for t in build_workload(0, 2.0, 1, 1)})  # no LoRA on a 1-GPU host
    assert f"from {clients} concurrent clients" in out
    assert "LoRA fine-tunes that take minutes" not in out and "coordinator state in" not in out
    assert "other tenants' load" not in out  # --background idle
    _assert_nothing_left(run.marker, None)


@pytest.mark.timeout(60)
def test_second_interrupt_while_stopping_kills_at_once_without_a_traceback(demo):
    run = demo(*SMALL)
    run.wait_for("1 of 1 GPU")
    # an agent that will not stop on SIGTERM (only SIGKILL ends a stopped
    # process); the coordinator keeps serving the demo
    agents = [pid for pid in _pids_with_marker(run.marker) if b"agent.main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(agents) == 1, agents
    os.kill(agents[0], signal.SIGSTOP)
    run.proc.send_signal(signal.SIGINT)
    run.wait_for("stopping the cluster")
    asked = time.monotonic()
    run.proc.send_signal(signal.SIGINT)
    rc, out = run.finish()
    assert "Traceback" not in out
    assert time.monotonic() - asked < 4, out  # not the 8 s grace
    assert rc == 130, out
    assert re.search(r"^SIGINT again: killed (coordinator, )?agent-1 instead of waiting for a clean stop$", out, re.M), out
    assert out.rstrip().endswith("all processes stopped")
    _assert_nothing_left(run.marker, None)


@pytest.mark.timeout(60)
def test_sighup_stops_the_demo_and_removes_its_temporary_directory(demo, tmp_path):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    run = demo(*SMALL, env=_env(f"gpulb-demo-test-{uuid.uuid4().hex}", TMPDIR=str(scratch)))
    run.wait_for("1 of 1 GPU")
    assert [p.name for p in scratch.iterdir()][0].startswith("gpulb-demo-")
    run.proc.send_signal(signal.SIGHUP)
    rc, out = run.finish()
    assert list(scratch.iterdir()) == [], out
    assert rc == 128 + signal.SIGHUP, out
    _assert_nothing_left(run.marker, None)


# ---- 8: scripts/demo and a relative --log-dir ------------------------------------------------


@pytest.mark.timeout(60)
def test_scripts_demo_takes_a_relative_log_dir_from_the_callers_directory(demo, tmp_path):
    # a ready virtual environment of this Python, so scripts/demo installs nothing
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    gpulb = venv / "bin" / "gpulb"
    gpulb.write_text(f'#!/bin/sh\nexec {sys.executable} -m coordinator.cli "$@"\n')
    gpulb.chmod(0o755)
    (venv / ".gpulb-installed").write_text(hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest() + "\n")
    caller = tmp_path / "caller"
    (caller / "rel").mkdir(parents=True)
    (caller / "rel" / "agent-7.log").write_text("an earlier run's, with more agents\n")
    env = _env(f"gpulb-demo-test-{uuid.uuid4().hex}", GPULB_VENV=str(venv))
    run = demo(*SMALL, "--log-dir", "rel", env=env, cwd=caller, argv0=["bash", str(ROOT / "scripts" / "demo")])
    run.wait_for("1 of 1 GPU")
    run.proc.send_signal(signal.SIGTERM)
    rc, out = run.finish()
    assert not (ROOT / "rel").exists()
    assert sorted(p.name for p in (caller / "rel").iterdir()) == ["agent-1.log", "coordinator.log"]  # agent-7's gone
    assert f"logs kept in {caller / 'rel'}" in out
    assert rc == 143, out
    _assert_nothing_left(run.marker, None)
