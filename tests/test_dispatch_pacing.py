"""A deep queue must not starve everything else the coordinator serves.

QA pass 24 (scale): a dispatch pass walks the whole queue (~10 µs per queued
task), and one was asked for at every submission and up to every 100 ms of
readings; with 10^5 tasks queued the passes (1.3 s each) ran back to back,
ScheduleTask took 3.9 s, ListNodes 2.6 s, and agents lost their streams,
closed as "not reading" while it was the coordinator's loop that was held.
Now a long pass is followed by twice its length in which the loop serves
everyone else, and the coordinator's own stalls are not counted against an
agent's reading. (How long passes take is measured by the scale benchmark,
not asserted here: the machines are shared.)
"""

from __future__ import annotations

import asyncio
import time

import pytest

from coordinator.config import CoordinatorConfig
from coordinator.gateway import AgentSession, StreamRefused
from coordinator.server import Coordinator
from protos import telemetry_pb2 as pb

pytestmark = pytest.mark.timeout(60)


async def test_a_long_pass_spaces_the_next_and_a_short_one_does_not() -> None:
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", insecure=True))
    await coord.start()
    d = coord.dispatcher
    loop = asyncio.get_running_loop()
    try:
        def slow_pass():
            time.sleep(0.2)
            return []

        d.dispatch_now = slow_pass  # a pass over a deep queue
        d._run_pass()
        assert d._last_pass_s >= 0.2
        assert 0.3 < d.pass_pause_s() <= 2 * d._last_pass_s
        d.request()
        handle = d._pass_handle
        assert isinstance(handle, asyncio.TimerHandle)
        assert 0.3 < handle.when() - loop.time() <= 2 * d._last_pass_s
        handle.cancel()
        d._pass_handle = None

        d.dispatch_now = lambda: []  # a pass over a queue of hundreds
        d._run_pass()
        assert d.pass_pause_s() == 0.0
        d.request()
        assert d._pass_handle is not None and not isinstance(d._pass_handle, asyncio.TimerHandle)
    finally:
        await coord.stop(grace_s=0.1)


def test_the_coordinators_own_stall_is_not_an_agent_not_reading() -> None:
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", insecure=True, heartbeat_interval_s=1.0))
    now = [100.0]
    session = AgentSession(node_id="n1", peer="ipv4:127.0.0.1:1", clock=lambda: now[0])
    session.send(pb.CoordinatorMessage(release=pb.TaskRelease(task_id="t", reason="x")))
    now[0] += 5.0  # unwritten for 5 s, past the 2 s bound...
    coord.liveness.coordinator_stalled(4.0)  # ...4 of them with the coordinator's loop held
    coord.gateway._check_reading(session, now[0])  # 1 s is the agent's: not closed
    assert coord.gateway.closed_not_reading == 0
    now[0] += 2.0  # 3 s of its own now
    with pytest.raises(StreamRefused, match="not reading its stream"):
        coord.gateway._check_reading(session, now[0])
