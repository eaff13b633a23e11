"""Operations and observability fixes of QA pass 24 ("running it for a
month"): task ends timed by the agent's event, removed nodes listable,
summary counters that never go down, --json with zero fields, log levels
and ids, and CLI tables that fit the terminal."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
import structlog
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from waiting import until
from agent.fleet import SimFleet
from coordinator import cli
from coordinator.config import CoordinatorConfig
from coordinator.gateway import AgentSession
from coordinator.liveness import Liveness, LivenessEvent, ManualClock
from coordinator.server import Coordinator
from coordinator import tables
from coordinator.tables import render_table
from coordinator.taskconvert import task_to_proto
from protos import cluster_pb2 as cpb
from protos import cluster_pb2_grpc as cpb_grpc
from protos import telemetry_pb2 as pb
from protos.codec import LOWER, TelemetryEncoder
from protos.fields import BY_NAME
from scheduler.memgrowth import MemoryGrowth, MemoryGrowthConfig
from scheduler.task import Priority, TaskSpec, TaskState

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _keep_logging():
    """capture_logs reconfigures structlog; put back what the tests after these expect."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


# ---- a coordinator on a manual clock with one fake node ---------------------------------------------


class _Node:
    """A coordinator (ManualClock at 1000 s) and one registered node with one
    24 GB GPU, its stream's clock offset fixed by a live keyframe sampled at
    ``agent_s`` on the agent's wall clock."""

    def __init__(self, agent_s: float = 1.7e9, **config) -> None:
        self.clock = ManualClock(1000.0)
        self.coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", **config), clock=self.clock)
        reg = pb.Register(node_id="n1", backend="sim",
                          gpus=[pb.GpuInfo(index=0, uuid="GPU-n1", model="M", memory_total_mib=24_000)])
        self.session = AgentSession(node_id="n1", peer="test")
        self.coord.gateway.sessions["n1"] = self.session
        self.node = self.coord.node_registered(reg, self.session)
        encoder = TelemetryEncoder([0])
        values = np.maximum(LOWER, 1)[None, :].copy()
        values[0, BY_NAME["memory_total_mib"]] = 24_000
        env, _ = encoder.encode(values, np.ones_like(values, bool), now_s=agent_s,
                                sampled_at_ns=int(agent_s * 1e9), sample_interval_ms=200)
        self.coord.gateway._telemetry(env, self.session, self.node, self.clock())  # live: fixes the offset
        self.coord.smooth_now()
        #: the agent's wall clock (s) at coordinator clock 1000 s
        self.agent_at_1000 = agent_s
        self.engine = self.coord.dispatcher.engine

    def place(self, task_id: str, **spec) -> object:
        base = dict(kind="training", vram_mib=1024, gpu_share=0.2, duration_s=10.0)
        base.update(spec)
        self.engine.submit(TaskSpec(task_id=task_id, **base))
        self.coord.dispatcher.dispatch_now()
        task = self.engine.get(task_id)
        assert task.state is TaskState.LEASED, task
        return task

    def agent_ns(self, coordinator_s: float) -> int:
        """The agent's wall-clock ns at a coordinator clock time."""
        return int((self.agent_at_1000 + coordinator_s - 1000.0) * 1e9)

    def event(self, task_id: str, kind: int, at_ns: int, **fields) -> None:
        self.coord.task_event("n1", pb.TaskEvent(task_id=task_id, kind=kind, at_ns=at_ns, **fields))


# ---- 1. a task's end is timed by the agent's event, not by its arrival --------------------------------


@pytest.mark.parametrize("agent_s", [1.7e9, 5.0, 1.7e9 + 86_400], ids=["agent-clock-set", "agent-near-1970", "agent-a-day-fast"])
def test_an_end_reported_after_an_outage_is_timed_when_the_agent_says_it_happened(agent_s, monkeypatch):
    """A 10 s training task starts 0.5 s after its placement and ends 10 s
    later, while the coordinator hears nothing (a restart, a stream outage);
    the agent's FINISHED arrives 40 s after the placement. The task finished
    at 1010.5 on the coordinator's clock, the predictor learns 10 s of run
    time and the node's response time is 0.5 s, whatever the agent's clock
    is set to (mapped through its stream's offset). Before, the end was the
    arrival: 40 s recorded and learned (QA pass 24: 3 s asked, 25.9 s
    recorded, slowdown 2.94)."""
    n = _Node(agent_s)
    learned = []
    predictor = n.coord.advisor.predictor
    real_observe = predictor.observe
    monkeypatch.setattr(predictor, "observe", lambda *a: learned.append(a[-1]) or real_observe(*a))
    task = n.place("train")
    assert task.assignment.placed_at == 1000.0
    n.clock.advance(2.0)  # STARTED buffered 1.5 s
    n.event("train", pb.TASK_EVENT_KIND_STARTED, n.agent_ns(1000.5))
    assert n.coord.dispatcher.snapshots.response_time_s["n1"] == pytest.approx(0.5)
    n.clock.advance(38.0)
    n.event("train", pb.TASK_EVENT_KIND_FINISHED, n.agent_ns(1010.5), detail="after 10 s", peak_vram_mib=1024)
    done = n.engine.get("train")
    assert done.state is TaskState.COMPLETED
    assert done.finished_at == pytest.approx(1010.5, abs=1e-3)
    assert learned == [pytest.approx(10.0, abs=1e-3)]
    # the client reads the same end
    proto = task_to_proto(done, n.coord.dispatcher.wall)
    assert (proto.finished_at_ns - proto.assignment.placed_at_ns) / 1e9 == pytest.approx(10.5, abs=1e-3)


@pytest.mark.parametrize(
    "said, expected",
    [
        (lambda n: n.coord.dispatcher.wall.ns(1003.0), 1003.0),  # no stream offset: the coordinator's wall clock
        (lambda n: n.coord.dispatcher.wall.ns(1000.0 + 3600), 1020.0),  # in the future: now
        (lambda n: n.coord.dispatcher.wall.ns(1000.0 - 3600), 1000.0),  # before its placement: the placement
        (lambda n: 0, 1020.0),  # no time said: its arrival
    ],
    ids=["wall", "future", "before-placement", "unset"],
)
def test_an_event_time_from_a_skewed_clock_is_clamped_to_the_lease(said, expected):
    """Without a stream offset (no live batch yet) at_ns is read as this
    host's wall clock; whatever it says, the end lies between the placement
    and now."""
    n = _Node()
    n.place("t")
    n.node.clock_offset_s = None
    n.clock.advance(20.0)
    n.event("t", pb.TASK_EVENT_KIND_FINISHED, said(n))
    assert n.engine.get("t").finished_at == pytest.approx(expected, abs=1e-3)


def test_engine_complete_takes_the_time_the_task_ended():
    n = _Node()
    lease = n.place("t").assignment.lease_id
    n.clock.advance(30.0)
    assert n.engine.complete("t", lease, at=1012.0).finished_at == 1012.0
    lease = n.place("u").assignment.lease_id
    assert n.engine.complete("u", lease, at=float("nan")).finished_at == n.clock()


# ---- 2. removed nodes can be listed ---------------------------------------------------------------


async def _gpulb(target: str, *argv: str, columns: int | None = None) -> tuple[int, str, str]:
    """Run the CLI with stdout a pipe, or with ``columns`` a pseudo-terminal
    that many columns wide (as an operator's; COLUMNS unset)."""
    env = dict(os.environ)
    env.pop("COLUMNS", None)
    args = [sys.executable, "-m", "coordinator.cli", "--coordinator", target, *argv]
    if columns is None:
        proc = await asyncio.create_subprocess_exec(*args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                                                    cwd=ROOT, env=env)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        return proc.returncode, out.decode(), err.decode()
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    try:
        proc = await asyncio.create_subprocess_exec(*args, stdout=slave, stderr=asyncio.subprocess.PIPE, cwd=ROOT, env=env)
    finally:
        os.close(slave)

    def read_all() -> bytes:
        chunks = []
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        out, (_, err) = await asyncio.wait_for(
            asyncio.gather(asyncio.get_running_loop().run_in_executor(None, read_all), proc.communicate()), 60)
    finally:
        os.close(master)
    return proc.returncode, out.decode().replace("\r\n", "\n"), err.decode()


def _samples(coord: Coordinator) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(coord.metrics.exposition().decode()) for s in family.samples}


async def test_removed_nodes_are_listed_by_listnodes_and_gpulb_nodes_until_uncordon_forgets_them():
    """A node whose agent stopped is REMOVED: gpulb_nodes{state="removed"}
    counted it (and GpulbNodeUnreachable fired) but ListNodes(state=REMOVED)
    returned nothing and `gpulb nodes` did not show it: the on-call operator
    had to grep the logs for its name to clear the alert."""
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", heartbeat_interval_s=0.3, remove_after_intervals=2))
    port = await coord.start()
    target = f"127.0.0.1:{port}"
    try:
        async with SimFleet(target, hosts=2, gpus=1, workload="idle", heartbeat_interval_s=0.1) as fleet:
            await until(lambda: coord.dispatcher.snapshots.snapshot().healthy.sum() == 2, what="2 GPUs")
            await fleet.stop_agent("sim-02")
            await until(lambda: "sim-02" in set(coord.liveness.removed()) and "sim-02" not in coord.view.nodes,
                        what="sim-02 removed")
            assert _samples(coord)[("gpulb_nodes", (("state", "removed"),))] == 1
            async with grpc.aio.insecure_channel(target) as ch:
                stub = cpb_grpc.ClusterOperatorStub(ch)
                removed = (await stub.ListNodes(cpb.ListNodesRequest(state=cpb.NODE_STATE_REMOVED))).nodes
                assert [(n.node_id, n.state) for n in removed] == [("sim-02", cpb.NODE_STATE_REMOVED)]
                assert removed[0].last_heartbeat_ns > 0
                # unfiltered: the nodes in the view, as before
                assert [n.node_id for n in (await stub.ListNodes(cpb.ListNodesRequest())).nodes] == ["sim-01"]
            rc, out, err = await _gpulb(target, "nodes")
            assert rc == 0, err
            rows = [line.split() for line in out.splitlines()[2:]]
            assert [r[:2] for r in rows] == [["sim-01", "healthy"], ["sim-02", "removed"]]
            assert "gpulb uncordon NODE" in err and "1 removed" in err
            rc, out, err = await _gpulb(target, "nodes", "--removed", "--json")
            assert rc == 0 and [n["node_id"] for n in json.loads(out)] == ["sim-02"], (out, err)
            # forgotten: no longer counted nor listed
            assert (await _gpulb(target, "uncordon", "sim-02"))[0] == 0
            rc, out, err = await _gpulb(target, "nodes")
            assert "sim-02" not in out and "removed" not in err
            assert _samples(coord)[("gpulb_nodes", (("state", "removed"),))] == 0
    finally:
        await coord.stop(grace_s=0.1)


def test_the_unreachable_alert_names_how_to_list_and_clear_removed_nodes():
    text = (ROOT / "systemd" / "alerts.yml").read_text()
    rule = text[text.index("alert: GpulbNodeUnreachable"):text.index("alert: GpulbNodesRemoved")]
    assert "gpulb nodes --removed" in rule and "gpulb uncordon NODE" in rule
    assert "node_state log lines" not in rule


# ---- 3. the memory growth summary's _count and _sum never go down -----------------------------------


def test_the_memory_growth_summary_counts_every_ratio_and_never_goes_down():
    """window 20: 20 tasks at 2x, then 20 at 1x. The summary's _sum fell from
    40 to 20 and its _count froze at 20 (a counter reset to Prometheus); they
    count every ratio now, and the quantiles stay the window's."""
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0"), growth_config=MemoryGrowthConfig(window=20))
    growth = coord.advisor.growth
    seen = []
    for ratio in [2.0] * 20 + [1.0] * 20:
        growth.observe("batch", 1000.0, 1000.0 * ratio)
        s = _samples(coord)
        seen.append((s[("gpulb_memory_growth_ratio_count", (("kind", "batch"),))],
                     s[("gpulb_memory_growth_ratio_sum", (("kind", "batch"),))]))
    assert all(b[0] >= a[0] and b[1] >= a[1] for a, b in zip(seen, seen[1:])), seen
    assert seen[-1] == (40, pytest.approx(60.0))
    s = _samples(coord)
    assert s[("gpulb_memory_growth_ratio", (("kind", "batch"), ("quantile", "1")))] == 1.0  # the window's
    assert s[("gpulb_memory_growth_samples", (("kind", "batch"),))] == 20
    assert s[("gpulb_memory_growth_ratio_count", (("kind", ""),))] == 40


def test_the_growth_totals_survive_a_restart_with_the_learner_state():
    growth = MemoryGrowth(MemoryGrowthConfig(window=4, min_samples=1))
    for ratio in (1.5, 1.5, 1.0, 1.0, 1.0, 1.0):
        growth.observe("t", 100.0, 100.0 * ratio)
    state = json.loads(json.dumps(growth.to_state()))
    again = MemoryGrowth(MemoryGrowthConfig(window=4, min_samples=1))
    again.load_state(state)
    stats = {g.kind: g for g in again.stats()}
    assert (stats["t"].samples, stats["t"].count, stats["t"].total) == (4, 6, pytest.approx(7.0))
    again.observe("t", 100.0, 200.0)
    assert {g.kind: g for g in again.stats()}["t"].count == 7
    # a state saved before the totals were kept: the window's, as before
    del state["t"]["count"], state["t"]["sum"]
    old = MemoryGrowth(MemoryGrowthConfig(window=4, min_samples=1))
    old.load_state(state)
    assert {g.kind: g for g in old.stats()}["t"].count == 4


# ---- 4. --json prints zero, false and empty fields ----------------------------------------------------


def test_json_listings_print_zero_false_and_empty_fields(capsys):
    """GPU 0 had no "index", a node with no tasks no "active_tasks": the same
    script worked on one object and failed on the next (QA pass 24)."""
    cli._print_json([cpb.Gpu(node_id="n", index=0, uuid="GPU-0", model="M"), cpb.Node(node_id="n")])
    gpu, node = json.loads(capsys.readouterr().out)
    assert gpu["index"] == 0 and gpu["active_tasks"] == 0 and gpu["stale"] is False and gpu["flags"] == []
    assert "util_gpu_pct" not in gpu  # a reading the GPU does not report stays absent (optional)
    assert node["resyncs"] == "0" and node["labels"] == {} and node["active_tasks"] == 0 and node["driver_version"] == ""
    assert "disk_await_ms" not in node


# ---- 5. log levels and ids ----------------------------------------------------------------------------


def _by_event(logs: list[dict], event: str) -> list[dict]:
    return [entry for entry in logs if entry["event"] == event]


def test_placement_end_and_loss_log_the_lease_and_an_end_is_logged_once():
    n = _Node()
    with capture_logs() as logs:
        task = n.place("t", tenant="team-a", priority=Priority.P1)
    lease = task.assignment.lease_id
    placed = _by_event(logs, "task_placed")[0]
    assert (placed["lease_id"], placed["priority"], placed["tenant"], placed["log_level"]) == (lease, "P1", "team-a", "info")
    with capture_logs() as logs:
        n.event("t", pb.TASK_EVENT_KIND_STARTED, n.agent_ns(1000.0))
        n.event("t", pb.TASK_EVENT_KIND_FINISHED, n.agent_ns(1000.0))
    loud = [e for e in logs if e["log_level"] != "debug"]
    assert [e["event"] for e in loud] == ["task_event", "task_ended_on_node"]  # STARTED, then the end once
    ended = loud[-1]
    assert (ended["lease_id"], ended["kind"], ended["log_level"]) == (lease, "TASK_EVENT_KIND_FINISHED", "info")
    # an OOM kill is on-call news
    lease = n.place("oom").assignment.lease_id
    with capture_logs() as logs:
        n.event("oom", pb.TASK_EVENT_KIND_OOM_KILLED, n.agent_ns(1000.0), peak_vram_mib=2048)
    ended = _by_event(logs, "task_ended_on_node")[0]
    assert (ended["log_level"], ended["lease_id"]) == ("warning", lease)
    # a node lost with a lease
    lease = n.place("lost").assignment.lease_id
    with capture_logs() as logs:
        n.coord.dispatcher.node_removed("n1")
    lost = _by_event(logs, "tasks_lost")[0]
    assert lost["tasks"] == ["lost"] and lost["lease_ids"] == [lease] and lost["log_level"] == "warning"


def test_a_preemption_is_info_with_its_lease():
    n = _Node()
    victim = n.place("bg", kind="background", priority=Priority.P3, vram_mib=14_000, duration_s=0.0)
    with capture_logs() as logs:
        n.engine.submit(TaskSpec(task_id="urgent", kind="inference", priority=Priority.P0, vram_mib=14_000, gpu_share=0.5))
        n.coord.dispatcher.dispatch_now()
        n.clock.advance(1.5)  # preempt_after_s
        n.coord.dispatcher.dispatch_now()
    preempted = _by_event(logs, "task_preempted")
    assert preempted, [e["event"] for e in logs]
    assert (preempted[0]["log_level"], preempted[0]["lease_id"], preempted[0]["for_task_id"]) == \
        ("info", victim.assignment.lease_id, "urgent")


async def test_a_node_lost_is_a_warning_and_its_return_is_info():
    n = _Node()
    with capture_logs() as logs:
        await n.coord._on_liveness_events([
            LivenessEvent("n1", Liveness.HEALTHY, Liveness.UNREACHABLE, 1000.0),
            LivenessEvent("n1", Liveness.UNREACHABLE, Liveness.HEALTHY, 1001.0),
            LivenessEvent("n1", Liveness.HEALTHY, Liveness.REMOVED, 1002.0),
        ])
    states = [(e["new"], e["log_level"]) for e in _by_event(logs, "node_state")]
    assert states == [("UNREACHABLE", "warning"), ("HEALTHY", "info"), ("REMOVED", "warning")]
    removed = _by_event(logs, "node_state")[-1]
    assert "gpulb uncordon n1" in removed["hint"] and "gpulb nodes --removed" in removed["hint"]


async def test_state_restored_logs_its_report_as_fields(tmp_path):
    from coordinator.state import TaskStore

    store = TaskStore(tmp_path / "state.db")
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0"), store=store)
    try:
        with capture_logs() as logs:
            coord._restore()
    finally:
        store.close()
    restored = _by_event(logs, "state_restored")[0]
    assert (restored["queued"], restored["leased"], restored["finished"], restored["dropped"]) == (0, 0, 0, 0)
    assert "report" not in restored


# ---- 6. tables fit the terminal -----------------------------------------------------------------------


def test_render_table_gives_way_in_order_and_never_passes_the_width():
    headers = ["NODE", "STATE", "LABELS", "ENVELOPES"]
    rows = [["n1", "healthy", "rack=a,zone=b,something=long", 12345], ["n2", "removed", "", 0]]
    whole = render_table(headers, rows)
    assert render_table(headers, rows, width=None, give_way=[("LABELS", "drop")]) == whole  # no width: as before
    assert render_table(headers, rows, width=200, give_way=[("LABELS", "drop")]) == whole  # fits: untouched
    left_out: list[str] = []
    narrow = render_table(headers, rows, width=40, give_way=[("LABELS", "cut"), ("ENVELOPES", "drop")], left_out=left_out)
    assert max(map(len, narrow.splitlines())) <= 40 and "ENVELOPES" in narrow and "rack=a,zone=b…" in narrow
    assert left_out == ["LABELS"]
    left_out = []
    narrower = render_table(headers, rows, width=25, give_way=[("LABELS", "cut"), ("ENVELOPES", "drop")], left_out=left_out)
    assert "ENVELOPES" not in narrower and left_out == ["LABELS", "ENVELOPES"]
    assert max(map(len, narrower.splitlines())) == 25  # the cut column took back the dropped one's room
    # nothing left to give: the lines are cut, never wrapped
    assert max(map(len, render_table(headers, rows, width=12).splitlines())) <= 12
    assert tables.wrap("word " * 40, 30, indent="  ").count("\n") >= 5
    assert max(map(len, tables.wrap("word " * 40, 30).splitlines())) <= 30


def test_the_terminal_width_is_the_terminals_or_columns_and_none_for_a_pipe(monkeypatch):
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 91, 0, 0))
    read_end, write_end = os.pipe()
    try:
        with open(slave, "w", closefd=False) as terminal, open(write_end, "w", closefd=False) as pipe:
            monkeypatch.delenv("COLUMNS", raising=False)
            assert tables.terminal_width(terminal) == 91
            assert tables.terminal_width(pipe) is None  # what a script reads is never cut
            monkeypatch.setenv("COLUMNS", "77")
            assert tables.terminal_width(terminal) == 77  # as shutil.get_terminal_size
            assert tables.terminal_width(pipe) is None  # a leaked COLUMNS does not cut a pipe
    finally:
        for fd in (master, slave, read_end, write_end):
            os.close(fd)


async def test_cli_tables_fit_an_80_column_terminal_and_wide_shows_everything():
    """On an 80-column terminal `gpulb nodes` was 99 columns, `gpulb gpus` 113, `gpulb
    tasks` 138, `gpulb top` 138 (a live redraw: every line wrapped) and the
    advisor's trigger sentence 163 (QA pass 24)."""
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", dispatch_interval_s=0.1))
    port = await coord.start()
    target = f"127.0.0.1:{port}"
    labels = {"sim-01": {"rack": "r" * 20, "zone": "eu-west-1a", "owner": "platform-team"}}
    try:
        async with SimFleet(target, hosts=1, gpus=2, workload="idle", labels=labels):
            await until(lambda: coord.dispatcher.snapshots.snapshot().healthy.sum() == 2, what="2 GPUs")
            rc, out, err = await _gpulb(target, "submit", "--id", "a-rather-long-task-name", "--tenant", "team-a",
                                        "--kind", "training", "--vram-gib", "1")
            assert rc == 0, err
            assert (await _gpulb(target, "cordon", "sim-01"))[0] == 0
            rc, out, err = await _gpulb(target, "submit", "--id", "waits", "--vram-gib", "1", "--no-wait")
            assert rc == 0, err
            await until(lambda: coord.dispatcher.engine.get("waits").reason, what="a reason for the waiting task")
            for argv in (["nodes"], ["gpus"], ["tasks"], ["top", "--iterations", "1", "--no-clear"],
                         ["advisor", "plan", "--now"], ["queue"]):
                rc, narrow, err = await _gpulb(target, *argv, columns=80)
                assert rc == 0, (argv, err)
                assert max(map(len, narrow.splitlines())) <= 80, (argv, narrow)
                if argv[0] in ("nodes", "gpus", "tasks", "top"):
                    rc, wide, err = await _gpulb(target, *argv, "--wide", columns=80)
                    assert rc == 0, (argv, err)
                    assert max(map(len, wide.splitlines())) > 80, (argv, wide)
                    rc, piped, err = await _gpulb(target, *argv)  # no COLUMNS, a pipe: the whole table
                    assert max(map(len, piped.splitlines())) > 80, (argv, piped)
            rc, out, err = await _gpulb(target, "nodes", columns=80)
            assert "--wide" in err  # says that columns gave way
            rc, out, err = await _gpulb(target, "gpus", "--json", columns=40)
            out = out[out.index("["):]
            assert rc == 0 and [g["index"] for g in json.loads(out)] == [0, 1]  # --json is never fitted
    finally:
        await coord.stop(grace_s=0.1)


def test_the_help_names_wide_and_removed(capsys):
    for argv in (["nodes", "--help"], ["gpus", "--help"], ["top", "--help"]):
        with pytest.raises(SystemExit):
            cli.main(argv)
        assert "--wide" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["nodes", "--help"])
    assert "--removed" in capsys.readouterr().out


def test_no_line_of_a_fitted_top_table_passes_the_width():
    """``gpulb top``'s headers with every column filled, at several widths."""
    headers = cli._GPU_HEADERS[:6] + ["SMOOTHED", "TREND %/min"] + cli._GPU_HEADERS[6:]
    gpus = [cpb.Gpu(node_id=f"a-long-node-name-{i:02d}", index=i, model="NVIDIA H200 NVL", node_state=cpb.NODE_STATE_HEALTHY,
                    health=pb.GPU_HEALTH_OK, util_gpu_pct=50.0, memory_used_mib=1024.0, memory_total_mib=141_000.0,
                    temperature_c=60.0, power_w=400.0, reading_age_s=0.2, flags=["util_anomaly", "power_anomaly", "stale"])
            for i in range(4)]
    rows = cli._gpu_rows(gpus, {})
    for width in (60, 80, 100, 120):
        table = render_table(headers, rows, width=width, give_way=cli._GPU_GIVE_WAY)
        assert max(map(len, table.splitlines())) <= width, (width, table)
        assert re.search(r"^NODE\s+GPU", table)


def test_gpus_with_metrics_shows_the_columns_asked_for_and_no_empty_ones():
    """QA pass 25: `gpulb gpus --metrics util,memory` printed TEMP C and POWER W
    columns of "-", and --metrics clock showed no clock at all."""
    from coordinator.cli import _GPU_HEADERS, _asked_columns, _gpu_rows
    from coordinator.convert import resolve_metrics
    from protos import cluster_pb2 as cpb

    reply = cpb.ListGpusResponse()
    gpu = reply.gpus.add(node_id="n1", index=0, model="NVIDIA GeForce RTX 4090")
    gpu.util_gpu_pct, gpu.memory_used_mib, gpu.memory_total_mib, gpu.sm_clock_mhz = 40.0, 2048.0, 24564.0, 2520.0
    rows = _gpu_rows(reply.gpus)
    headers, out = _asked_columns(resolve_metrics(["util", "memory"]), reply.gpus, rows)
    assert "TEMP C" not in headers and "POWER W" not in headers
    assert headers[:7] == _GPU_HEADERS[:7] and out[0][headers.index("UTIL")] == "40%"
    headers, out = _asked_columns(resolve_metrics(["clock"]), reply.gpus, rows)
    assert "UTIL" not in headers and "MEM GiB" not in headers and headers[-1] == "sm_clock_mhz"
    assert out[0][-1] == "2,520" and len(out[0]) == len(headers)
