"""``gpulb demo``: the workload is reproducible and sized to the cluster, the
summary figures are right on hand-worked literals, and the real demo (a
coordinator and sim agents as processes) balances in both phases, prints a
readable summary and leaves no process behind, also when interrupted."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

import pytest

from coordinator.demo import GpuReading, PhaseFigures, TaskOutcome, _gpu_table, phase_figures, render_summary
from coordinator.demo_workload import SCENARIOS, build_workload
from protos import cluster_pb2 as cpb
from protos import tasks_pb2 as tpb
from scheduler.task import Priority

GIB = 1024


# ---- the workload -----------------------------------------------------------------------------


def test_workload_is_a_function_of_the_seed():
    assert build_workload(7, 30, 6, 4) == build_workload(7, 30, 6, 4)
    assert build_workload(7, 30, 6, 4) != build_workload(8, 30, 6, 4)


@pytest.mark.parametrize("agents,gpus_per_agent,window", [(6, 4, 30.0), (2, 2, 6.0), (1, 1, 5.0), (3, 8, 20.0)])
def test_workload_keeps_to_its_scenarios(agents, gpus_per_agent, window):
    tasks = build_workload(0, window, agents, gpus_per_agent)
    assert [t.submit_s for t in tasks] == sorted(t.submit_s for t in tasks)
    assert len({t.name for t in tasks}) == len(tasks)
    for t in tasks:
        assert 0 <= t.submit_s < window
        assert 1 <= t.num_gpus <= gpus_per_agent
        assert 0 < t.gpu_share <= 1
        # every task would end inside the window if it were placed at once
        assert 0 < t.run_s and t.submit_s + t.run_s <= window
        if t.scenario == "sd-inference":
            assert (t.priority, t.num_gpus) == (Priority.P0, 1)
            assert 2 * GIB <= t.vram_mib <= 6 * GIB and 0 < t.run_s <= 1.2 and 0.3 <= t.gpu_share <= 0.6
        elif t.scenario == "lora-finetune":
            assert t.priority == Priority.P1 and 2 <= t.num_gpus <= 4
            assert 16 * GIB <= t.vram_mib <= 19.5 * GIB
        elif t.scenario == "video-transcode":
            assert t.priority == Priority.P2 and t.vram_mib == 2 * GIB
        else:
            assert t.scenario == "analysis" and t.priority == Priority.P3 and t.client_completes
    scenarios = {t.scenario for t in tasks}
    assert {"sd-inference", "video-transcode"} <= scenarios
    # LoRA needs two GPUs on one host
    assert ("lora-finetune" in scenarios) == (gpus_per_agent >= 2)


def test_workload_scales_with_the_cluster():
    small = build_workload(0, 30, 1, 4)
    large = build_workload(0, 30, 6, 4)
    assert 3 * len(small) < len(large)


@pytest.mark.parametrize("bad", [dict(window_s=0), dict(agents=0), dict(gpus_per_agent=0)])
def test_workload_refuses_empty_shapes(bad):
    args = dict(seed=0, window_s=10.0, agents=1, gpus_per_agent=1) | bad
    with pytest.raises(ValueError):
        build_workload(**args)


# ---- the figures ------------------------------------------------------------------------------

DONE, FAILED, CANCELLED = tpb.TASK_STATE_COMPLETED, tpb.TASK_STATE_FAILED, tpb.TASK_STATE_CANCELLED


def test_phase_figures_hand_worked():
    outcomes = [
        TaskOutcome("sd-inference", DONE, 0.1, True),
        TaskOutcome("sd-inference", DONE, 0.3, True),
        TaskOutcome("sd-inference", FAILED, 6.0, True),  # OOM-killed after a long wait
        TaskOutcome("lora-finetune", CANCELLED, None, False),  # never placed
        TaskOutcome("video-transcode", CANCELLED, 1.0, True),  # running at the end
    ]
    samples = [
        [GpuReading("a", 0, 10.0, 40.0), GpuReading("a", 1, 30.0, 55.0)],  # mean 20, std 10, range 20
        [GpuReading("a", 0, 50.0, 41.0), GpuReading("a", 1, None, None)],  # one reading: std 0, range 0
    ]
    f = phase_figures("round_robin", outcomes, samples, sla_misses=1, refused=2)
    assert (f.submitted, f.placed, f.completed, f.failed) == (7, 4, 2, 1)
    assert (f.cancelled_queued, f.cancelled_running, f.refused, f.sla_misses) == (1, 1, 2, 1)
    mean, p95, n = f.waits["sd-inference"]
    assert (round(mean, 6), p95, n) == (2.133333, 6.0, 3)
    assert f.waits["video-transcode"] == (1.0, 1.0, 1)
    assert "lora-finetune" not in f.waits
    assert (f.util_mean, f.util_std, f.util_range) == (35.0, 5.0, 10.0)
    assert f.hottest == "a/1 55 C"


def test_phase_figures_with_nothing_measured():
    f = phase_figures("load_aware", [], [], sla_misses=0)
    assert (f.submitted, f.placed, f.waits, f.hottest) == (0, 0, {}, "-")
    assert f.util_mean != f.util_mean  # NaN, shown as "-"


def test_p95_is_nearest_rank():
    outcomes = [TaskOutcome("sd-inference", DONE, float(w), True) for w in range(1, 21)]
    assert phase_figures("x", outcomes, [], 0).waits["sd-inference"][1] == 19.0


def _figures(policy: str, placed: int) -> PhaseFigures:
    return PhaseFigures(
        policy=policy, submitted=10, placed=placed, completed=placed, failed=0, cancelled_queued=10 - placed,
        cancelled_running=0, refused=0, waits={"sd-inference": (0.25, 1.5, placed)}, sla_misses=0,
        util_mean=50.0, util_std=12.5, util_range=40.0, hottest="sim-01/0 71 C",
    )


def test_summary_is_a_readable_side_by_side_table():
    text = render_summary([_figures("round_robin", 9), _figures("load_aware", 10)])
    lines = text.splitlines()
    header, rule, *rows = lines
    assert header.split() == ["round_robin", "load_aware"]
    # one column per policy: every row's values end where the header's names end
    ends = [m.end() for m in re.finditer(r"\S+", header)]
    for line in [rule, *rows]:
        assert len(line) == ends[-1], line
    labels = [row[: rule.index(" ")].strip() for row in rows]
    for _, label in SCENARIOS.values():
        assert f"wait s, mean / p95: {label}" in labels
    placed = next(r for r in rows if r.startswith("tasks placed")).split()[-2:]
    assert placed == ["9", "10"]
    assert "0.25 / 1.50" in text and "sim-01/0 71 C" in text and "12.5" in text


def test_live_table_folds_into_two_halves_when_too_tall():
    gpus = [
        cpb.Gpu(node_id=f"sim-{n:02d}", index=i, util_gpu_pct=45.0, memory_used_mib=2048, memory_total_mib=24564,
                temperature_c=50.0, active_tasks=1)
        for n in range(1, 4) for i in range(4)
    ]
    tall = _gpu_table(gpus)
    assert len(tall.splitlines()) == 2 + 12 and "####." in tall
    folded = _gpu_table(gpus, max_lines=10)
    assert len(folded.splitlines()) == 2 + 6
    assert folded.splitlines()[0].count("NODE") == 2 and "sim-03" in folded.splitlines()[-1]


# ---- the real demo ----------------------------------------------------------------------------


def _gpulb() -> list[str]:
    script = Path(sys.executable).with_name("gpulb")
    return [str(script)] if script.exists() else [sys.executable, "-m", "coordinator.cli"]


def _pids_with_marker(marker: str) -> list[int]:
    """Processes whose environment carries the demo run's marker (the demo's
    children inherit it, whatever they start too)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker.encode() in (entry / "environ").read_bytes():
                stat = (entry / "stat").read_text()
                if stat.rsplit(")", 1)[1].split()[0] != "Z":
                    found.append(int(entry.name))
        except OSError:
            pass  # gone, or not ours
    return found


def _pgrep(pattern: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split() if int(p) != os.getpid()]


def _assert_nothing_left(marker: str, port: str | None) -> None:
    deadline = time.monotonic() + 5  # an exiting child may still be reaped
    while True:
        left = _pids_with_marker(marker) + (_pgrep(f"127.0.0.1:{port}") if port else [])
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not left, f"processes left behind: {left}"


def _demo_env(marker: str, tmp: Path | None = None) -> dict[str, str]:
    """``tmp``: the demo's TMPDIR (a killed demo leaves its temporary directory behind)."""
    return {**os.environ, "DEMO_TEST_RUN_MARKER": marker, "PYTHONUNBUFFERED": "1", **({"TMPDIR": str(tmp)} if tmp else {})}



@pytest.mark.slow
@pytest.mark.timeout(180)
def test_demo_balances_in_both_phases_and_leaves_nothing_behind(tmp_path):
    marker = f"gpulb-demo-test-{uuid.uuid4().hex}"
    started = time.monotonic()
    run = subprocess.run(
        [*_gpulb(), "demo", "--no-live", "--agents", "2", "--gpus-per-agent", "2", "--duration", "12",
         "--log-dir", str(tmp_path)],
        capture_output=True, text=True, env=_demo_env(marker), timeout=150,
    )
    wall = time.monotonic() - started
    out = run.stdout
    assert run.returncode == 0, out + run.stderr
    assert wall < 60, f"took {wall:.0f} s"
    port = re.search(r"coordinator on 127\.0\.0\.1:(\d+)", out).group(1)
    assert "4 of 4 GPUs reporting" in out
    assert "policy round_robin (SetPolicy, no restart)" in out and "policy load_aware (SetPolicy, no restart)" in out

    summary = out[out.index("summary"):].splitlines()
    header = summary[1].split()
    assert header == ["round_robin", "load_aware"]
    rows = {line[: summary[2].index(" ")].strip(): line.split()[-2:] for line in summary[3:] if line and not line.startswith("all ")}
    submitted = [int(x) for x in rows["tasks submitted"]]
    placed = [int(x) for x in rows["tasks placed"]]
    assert submitted[0] == submitted[1] > 0  # the same workload in both phases
    assert all(p > 0 for p in placed), placed
    for label in ("tasks completed", "tasks failed (OOM-killed)", "P0 SLA misses (waited > 5 s)", "GPU util mean %",
                  "util std across GPUs, pp", "util max - min across GPUs, pp"):
        assert label in rows, label
    assert "wait s, mean / p95: P0 Stable Diffusion inference" in rows
    # every task left in the queue is named, with the scheduler's reason
    never = sum(int(x) for x in rows["never placed (cancelled at end)"])
    named = [line for line in out.splitlines() if line.startswith("  never placed: ")]
    assert len(named) == never and all(line.split(": ", 2)[2] for line in named), named
    assert out.rstrip().endswith("all processes stopped")
    # each policy met the other tenants' load from its start: every agent
    # rewound its synthetic background once per phase
    for agent in ("agent-1", "agent-2"):
        events = [json.loads(line).get("event") for line in (tmp_path / f"{agent}.log").read_text().splitlines()
                  if line.startswith("{")]
        assert events.count("sim_background_rewound") == 2, events
    # other tenants refused memory: counted from the agents' logs, within the phases
    refusals = sum(
        1 for agent in ("agent-1", "agent-2")
        for line in (tmp_path / f"{agent}.log").read_text().splitlines() if '"sim_tenant_oom"' in line
    )
    per_phase = [int(x) for x in rows["other tenants refused memory"]]
    assert all(n >= 0 for n in per_phase) and sum(per_phase) <= refusals
    _assert_nothing_left(marker, port)


def _start_and_wait_for_phase(marker: str, tmp: Path | None = None) -> tuple[subprocess.Popen, str, list[str]]:
    proc = subprocess.Popen(
        [*_gpulb(), "demo", "--no-live", "--agents", "2", "--gpus-per-agent", "2", "--duration", "40"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_demo_env(marker, tmp),
    )
    lines: list[str] = []
    port = ""
    for line in proc.stdout:
        lines.append(line)
        m = re.search(r"coordinator on 127\.0\.0\.1:(\d+)", line)
        if m:
            port = m.group(1)
        if line.startswith("[round_robin"):
            break  # tasks are flowing
    assert port and _pids_with_marker(marker), "".join(lines)
    return proc, port, lines


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_demo_stops_its_cluster(sig):
    marker = f"gpulb-demo-test-{uuid.uuid4().hex}"
    proc, port, lines = _start_and_wait_for_phase(marker)
    proc.send_signal(sig)
    rest, _ = proc.communicate(timeout=60)
    out = "".join(lines) + rest
    assert proc.returncode == 128 + sig, out  # the signal's conventional status: 130 Ctrl-C, 143 SIGTERM
    assert f"{sig.name} during phase 1 of 2 (round_robin): stopping the cluster" in out, out
    assert "log ends" not in out, out  # asked for: nothing to diagnose
    assert out.rstrip().endswith("all processes stopped"), out
    _assert_nothing_left(marker, port)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_killed_demo_takes_its_cluster_with_it(tmp_path):
    marker = f"gpulb-demo-test-{uuid.uuid4().hex}"
    proc, port, _ = _start_and_wait_for_phase(marker, tmp_path)  # its temporary directory stays: in tmp_path
    proc.kill()  # no chance to clean up: the children's parent-death signal must do it
    proc.communicate(timeout=30)
    deadline = time.monotonic() + 15  # SIGTERM, then each child's graceful stop
    while _pids_with_marker(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    _assert_nothing_left(marker, port)


def test_tenant_refusals_are_counted_into_the_phase_they_happened_in(tmp_path):
    from coordinator.demo import _PhaseRecord, count_tenant_ooms

    def line(event: str, at: str) -> str:
        return json.dumps({"gpu": 0, "event": event, "level": "info", "timestamp": at})

    (tmp_path / "agent-1.log").write_text("\n".join([
        line("sim_tenant_oom", "2026-11-30T10:00:05.000000Z"),  # phase 1
        line("sim_tenant_oom", "2026-11-30T10:00:09.500000Z"),  # phase 1
        line("streaming", "2026-11-30T10:00:06.000000Z"),  # another event
        line("sim_tenant_oom", "2026-11-30T10:00:12.000000Z"),  # between the phases
    ]) + "\n")
    (tmp_path / "agent-2.log").write_text(
        line("sim_tenant_oom", "2026-11-30T10:00:21.000000Z") + "\n" + '{"event": "sim_tenant_oom", "timest'  # torn
    )
    t0 = datetime(2026, 11, 30, 10, 0, 0, tzinfo=timezone.utc).timestamp()
    phases = [_PhaseRecord("round_robin", started_at=t0, ended_at=t0 + 10),
              _PhaseRecord("load_aware", started_at=t0 + 15, ended_at=t0 + 25),
              _PhaseRecord("binpack")]  # never ran: not counted
    count_tenant_ooms(phases, sorted(tmp_path.glob("agent-*.log")))
    assert [p.tenant_ooms for p in phases] == [2, 1, None]


def test_preemptions_are_counted_from_the_coordinators_log_into_their_phase(tmp_path):
    from coordinator.demo import _PhaseRecord, count_preemptions, phase_figures, render_summary

    def line(event: str, at: str) -> str:
        return json.dumps({"event": event, "task_id": "bg-1", "level": "warning", "timestamp": at})

    log = tmp_path / "coordinator.log"
    log.write_text("\n".join([
        line("task_preempted", "2026-11-30T10:00:03.000000Z"),  # phase 1
        line("task_placed", "2026-11-30T10:00:04.000000Z"),  # another event
        json.dumps({"event": "task_placed", "reason": "task_preempted", "timestamp": "2026-11-30T10:00:05Z"}),
        line("task_preempted", "2026-11-30T10:00:20.000000Z"),  # phase 2
        line("task_preempted", "2026-11-30T10:00:21.000000Z"),  # phase 2
    ]) + "\n")
    t0 = datetime(2026, 11, 30, 10, 0, 0, tzinfo=timezone.utc).timestamp()
    phases = [_PhaseRecord("round_robin", started_at=t0, ended_at=t0 + 10),
              _PhaseRecord("load_aware", started_at=t0 + 15, ended_at=t0 + 25)]
    count_preemptions(phases, log)
    assert [p.preempted for p in phases] == [1, 2]
    table = render_summary([phase_figures(p.policy, [], [], 0, preempted=p.preempted) for p in phases])
    row = next(r for r in table.splitlines() if "preempted for P0" in r)
    assert row.split()[-2:] == ["1", "2"]
    # no preemption in any phase: no row
    assert "preempted" not in render_summary([phase_figures("load_aware", [], [], 0, preempted=0)])
