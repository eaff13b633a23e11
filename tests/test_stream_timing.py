"""Time on the telemetry stream: the intervals agents run by follow a reload
of the coordinator's deadlines, and rounds an agent replays from its outage
buffer reach the anomaly filter, EWMA and trend at the time they were
sampled, whatever the agent's clock is set to, not all at their arrival."""

from __future__ import annotations

import asyncio
import dataclasses
import math

import grpc
import numpy as np
import pytest

from waiting import until
from agent.client import Agent, AgentConfig
from agent.sim import SimBackend
from coordinator.config import CoordinatorConfig
from coordinator.gateway import AgentSession
from coordinator.liveness import ManualClock
from coordinator.server import Coordinator
from coordinator.view import REPLAY_HOLD_S, SIGNALS
from protos import cluster_pb2 as cpb
from protos import cluster_pb2_grpc as cpb_grpc
from protos import telemetry_pb2 as pb
from protos.codec import LOWER, TelemetryEncoder
from protos.fields import BY_NAME
from scheduler.config import SchedulerConfig

pytestmark = pytest.mark.timeout(60)

UTIL = BY_NAME["util_gpu_pct"]
UTIL_SIGNAL = SIGNALS.index("util_gpu_pct")


# ---- a reload of the agents' deadlines ---------------------------------------


async def test_a_reload_that_shortens_the_deadlines_reaches_connected_agents_before_it_bites():
    """Lowering heartbeat_interval_s and staleness_s by SIGHUP: a connected,
    idle agent is told the new intervals (a RegisterAck on its open stream)
    and the coordinator holds it to the shorter deadlines only after one old
    interval; its node stays HEALTHY and fresh across several new intervals.
    Before, the agent kept refreshing at half the old staleness bound (2.5 s
    here) against a new heartbeat deadline of 1.5 s and a staleness bound of
    2 s: UNREACHABLE and stale, then back, over and over."""
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", heartbeat_interval_s=2.0, staleness_s=5.0))
    port = await coord.start()
    agent = Agent(AgentConfig(node_id="idle", coordinator=f"127.0.0.1:{port}", interval_min_s=0.05, interval_max_s=0.2),
                  SimBackend(gpus=1, seed=3, workload="idle"), seed=3)
    task = asyncio.create_task(agent.run())
    snapshots = coord.dispatcher.snapshots

    def unreachable_transitions() -> float:
        return coord.metrics.registry.get_sample_value("gpulb_node_transitions_total", {"state": "unreachable"}) or 0.0

    try:
        await until(lambda: coord.node_state("idle") == cpb.NODE_STATE_HEALTHY, what="the node HEALTHY")
        assert (agent.config.heartbeat_interval_s, agent.encoder.refresh_interval_s) == (2.0, 2.5)
        shorter = dataclasses.replace(coord.config, heartbeat_interval_s=0.5, staleness_s=2.0)
        coord.apply_settings(shorter, SchedulerConfig(), ["coordinator.heartbeat_interval_s", "coordinator.staleness_s"])
        # ListNodes and ListGpus say stale by the bound placement holds to, not the
        # file's new one yet: a reading 3 s old is fresh while 5 s still applies
        node = coord.view.nodes["idle"]
        coord.view.reading_at_s[node.rows] = coord.clock() - 3.0  # no await in between: nothing refreshes it
        assert not coord.node_message(node).stale
        # the old deadlines hold until the agents could have adapted
        assert (coord.liveness.heartbeat_interval_s, snapshots.staleness_s) == (2.0, 5.0)
        await until(lambda: (agent.config.heartbeat_interval_s, agent.encoder.refresh_interval_s) == (0.5, 1.0),
                    what="the agent running by the reloaded intervals")
        await until(lambda: (coord.liveness.heartbeat_interval_s, snapshots.staleness_s) == (0.5, 2.0), timeout=20,
                    what="the shorter deadlines in force, one old interval later")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = cpb_grpc.ClusterOperatorStub(ch)
            # 3 s: two heartbeat deadlines (0.5 s + 1 s grace), one and a half staleness bounds
            for _ in range(30):
                node = (await stub.ListNodes(cpb.ListNodesRequest())).nodes[0]
                assert (node.state, node.stale) == (cpb.NODE_STATE_HEALTHY, False), (node.state, node.reading_age_s)
                await asyncio.sleep(0.1)
        assert unreachable_transitions() == 0
        # a longer deadline applies at once, and cancels a shorter one still waiting
        coord.apply_settings(dataclasses.replace(coord.config, heartbeat_interval_s=0.2), SchedulerConfig(),
                             ["coordinator.heartbeat_interval_s"])
        coord.apply_settings(dataclasses.replace(coord.config, heartbeat_interval_s=3.0), SchedulerConfig(),
                             ["coordinator.heartbeat_interval_s"])
        assert coord.liveness.heartbeat_interval_s == 3.0 and not coord._deadline_changes
        await until(lambda: agent.config.heartbeat_interval_s == 3.0, what="the agent told the longer interval")
    finally:
        await agent.stop()
        await asyncio.gather(task, return_exceptions=True)
        await coord.stop(grace_s=0.1)


# ---- rounds replayed from an agent's outage buffer ---------------------------


def _registered(coord: Coordinator, node_id: str = "replayer") -> tuple:
    reg = pb.Register(node_id=node_id, backend="sim",
                      gpus=[pb.GpuInfo(index=0, uuid=f"GPU-{node_id}", model="M", memory_total_mib=24_000)])
    session = AgentSession(node_id=node_id, peer="test")
    coord.gateway.sessions[node_id] = session
    return coord.node_registered(reg, session), session


class _Rounds:
    """An agent's encoder: one GPU whose util is given per round, sampled at
    a given second of the agent's wall clock."""

    def __init__(self) -> None:
        self.encoder = TelemetryEncoder([0])
        self.values = np.maximum(LOWER, 1)[None, :].copy()

    def envelope(self, util: int, agent_s: float, period_ms: int) -> pb.Envelope:
        self.values[0, UTIL] = util
        env, _ = self.encoder.encode(self.values, np.ones_like(self.values, bool), now_s=agent_s,
                                     sampled_at_ns=int(agent_s * 1e9), sample_interval_ms=period_ms)
        return env


@pytest.mark.parametrize("agent_clock_s", [1.7e9, 1.7e9 - 3600, 1.7e9 + 86_400, 5.0])
async def test_a_replayed_outage_keeps_its_sample_times_whatever_the_agent_clock(agent_clock_s):
    """A util ramp of exactly 60 %/min, sampled every 2 s for 30 s while the
    agent had no stream, arrives in one burst, then the live round. The
    trend must be the ramp's, with the readings at their sample times on the
    coordinator's clock; whether the agent's clock is right, an hour slow, a
    day fast or near 1970 does not matter (only its live round's arrival
    anchors it). Before, all 16 readings sat at the burst's instant: no
    trend at all here (one instant), 1390 %/min in the QA run (a few ms
    apart). Until the live round the replayed values are not fresh."""
    clock = ManualClock(1000.0)
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0"), clock=clock)
    node, session = _registered(coord)
    row = node.rows[0]
    rounds = _Rounds()
    utils = [10 + 2 * i for i in range(16)]
    for i, util in enumerate(utils[:-1]):  # the outage buffer: no period said
        coord.gateway._telemetry(rounds.envelope(util, agent_clock_s + 2.0 * i, 0), session, node, clock())
    coord.smooth_now()
    signals = coord.view.signals
    assert signals.window_counts[row, UTIL_SIGNAL] == 0  # waiting for the stream's clock, not fed as "now"
    assert coord.view.raw[row, UTIL] == utils[-2]  # the values are applied at once
    assert math.isinf(coord.view.node_reading_age_s(node, clock()))  # but they are not fresh news
    clock.advance(0.05)
    coord.gateway._telemetry(rounds.envelope(utils[-1], agent_clock_s + 30.0, 200), session, node, clock())  # live
    coord.smooth_now()
    assert signals.window_counts[row, UTIL_SIGNAL] == 16
    assert signals.trend_per_min[row, UTIL_SIGNAL] == pytest.approx(60.0)
    assert signals.last_reading_s[row, UTIL_SIGNAL] == pytest.approx(1000.05)
    assert coord.view.node_reading_age_s(node, clock()) == 0.0
    ewma = utils[0]
    for util in utils[1:]:
        ewma = 0.3 * util + 0.7 * ewma
    assert signals.smoothed[row, UTIL_SIGNAL] == pytest.approx(ewma)  # every reading, in order
    assert not signals.flagged[row, UTIL_SIGNAL] and signals.anomaly_counts.sum() == 0


async def test_an_agent_clock_stepped_during_the_outage_cannot_reorder_or_postdate_readings():
    """The agent's clock stepped back an hour between its outage samples and
    its live round (an NTP correction): mapped through the live round, the
    replay would lie an hour in the future. It is capped at its arrival and
    never before the GPU's last reading of the previous stream."""
    clock = ManualClock(1000.0)
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0"), clock=clock)
    node, session = _registered(coord)
    row = node.rows[0]
    rounds = _Rounds()
    coord.gateway._telemetry(rounds.envelope(20, 1.7e9, 200), session, node, clock())  # live, first stream
    coord.smooth_now()
    clock.advance(10.0)
    node, session = _registered(coord)  # the reconnect, same GPU: its history is kept
    assert node.rows[0] == row
    rounds = _Rounds()
    for i in range(3):
        coord.gateway._telemetry(rounds.envelope(30 + i, 1.7e9 + 3600 + i, 0), session, node, clock())
    clock.advance(0.05)
    coord.gateway._telemetry(rounds.envelope(40, 1.7e9 + 5, 200), session, node, clock())
    coord.smooth_now()
    signals = coord.view.signals
    count = signals.window_counts[row, UTIL_SIGNAL]
    assert count >= 5  # the first stream's, the replay's 3, the live one (and the view's re-read of it)
    times = signals._ts[row * signals.signals + UTIL_SIGNAL][:count]  # the ring's reading times
    times = times[times > -1e29]  # (an anomaly's slot holds no time)
    assert times.min() == 1000.0 and times.max() == clock()
    assert list(times[1:4]) == [1010.0] * 3  # the replay, capped at its arrival 0.05 s before the live round
    assert coord.view.reading_at_s[row] == clock()


async def test_batches_that_never_say_a_period_are_held_at_most_briefly():
    """A client that sends sample times but never a sampling period: its
    first rounds wait for a live one at most REPLAY_HOLD_S, are then timed
    as if the newest were live, and every later batch is live."""
    clock = ManualClock(1000.0)
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0"), clock=clock)
    node, session = _registered(coord)
    row = node.rows[0]
    rounds = _Rounds()
    for i in range(3):
        coord.gateway._telemetry(rounds.envelope(10 + 10 * i, 1.7e9 + i, 0), session, node, clock())
    coord.smooth_now()
    signals = coord.view.signals
    assert signals.window_counts[row, UTIL_SIGNAL] == 0
    clock.advance(REPLAY_HOLD_S)
    coord.smooth_now()
    assert signals.window_counts[row, UTIL_SIGNAL] == 3
    assert signals.last_reading_s[row, UTIL_SIGNAL] == 1000.0  # the newest taken as live at its arrival
    assert signals.trend_per_min[row, UTIL_SIGNAL] == pytest.approx(600.0)  # 10 % a second
    assert not node.replaying
    coord.gateway._telemetry(rounds.envelope(50, 1.7e9 + 3, 0), session, node, clock())
    coord.smooth_now()
    assert signals.window_counts[row, UTIL_SIGNAL] == 4 and signals.last_reading_s[row, UTIL_SIGNAL] == clock()
    assert coord.view.reading_at_s[row] == clock()


class _RampWhileAway:
    """One sim GPU whose util climbs 2 % a sample while its agent has no
    stream and holds still while it has one. Its wall clock (the agent's
    ``wall_ns``) moves one second per sample, so each reading's true time
    is exact however fast the machine runs."""

    name = "sim"

    def __init__(self) -> None:
        self.inner = SimBackend(gpus=1, seed=1, workload="idle")
        self.agent: Agent | None = None
        self.samples = 0
        self.util = 10

    def inventory(self):
        return self.inner.inventory()

    def topology(self):
        return self.inner.topology()

    def sample(self):
        self.samples += 1
        if not self.agent.connected.is_set():
            self.util = min(100, self.util + 2)
        return [dataclasses.replace(s, util_gpu_pct=self.util) for s in self.inner.sample()]

    def wall_ns(self) -> int:
        return 1_700_000_000_000_000_000 + self.samples * 1_000_000_000


async def test_a_real_agent_replaying_its_outage_buffer_to_a_restarted_coordinator_gives_the_true_trend():
    """End to end with the agent's own outage buffer: the coordinator stops,
    the agent samples a 120 %/min ramp into its buffer, a new coordinator
    starts (on a clock of its own, which does not move: every arrival is one
    instant) and the agent replays the buffer, then streams live. The trend
    is the ramp's: the replay is told apart by the period it does not say,
    and timed through the live round."""
    first = Coordinator(CoordinatorConfig(listen="127.0.0.1:0"))
    port = await first.start()
    backend = _RampWhileAway()
    agent = Agent(AgentConfig(node_id="ramp", coordinator=f"127.0.0.1:{port}", interval_min_s=0.05, interval_max_s=0.05,
                              backoff_initial_s=0.05, backoff_max_s=0.1), backend, wall_ns=backend.wall_ns, seed=1)
    backend.agent = agent
    task = asyncio.create_task(agent.run())
    second = None
    try:
        await until(lambda: "ramp" in first.view.nodes and first.view.nodes["ramp"].sample_interval_ms, what="streaming live")
        await first.stop(grace_s=0.1)
        await until(lambda: agent.outage_buffer_len >= 12, what="12 rounds in the outage buffer")
        second = Coordinator(CoordinatorConfig(listen=f"127.0.0.1:{port}"), clock=ManualClock(5000.0))
        await second.start()
        await until(lambda: agent.outage_buffer_len == 0 and "ramp" in second.view.nodes
                    and second.view.nodes["ramp"].sample_interval_ms, what="the buffer replayed and a live round in")
        second.smooth_now()
        row = second.view.nodes["ramp"].rows[0]
        signals = second.view.signals
        assert signals.window_counts[row, UTIL_SIGNAL] >= 12
        assert signals.trend_per_min[row, UTIL_SIGNAL] == pytest.approx(120.0, rel=0.15)
        assert signals.last_reading_s[row, UTIL_SIGNAL] <= 5000.0
    finally:
        await agent.stop()
        await asyncio.gather(task, return_exceptions=True)
        await first.stop(grace_s=0.1)
        if second is not None:
            await second.stop(grace_s=0.1)
