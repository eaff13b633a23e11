"""Tests for ``coordinator.liveness``: every transition on a manual clock,
operator state across liveness changes, flapping, removal, and the sweeper's
start/stop on a real event loop.
"""

from __future__ import annotations

import asyncio

import pytest

from coordinator.liveness import (
    Admin,
    EffectiveState,
    Liveness,
    LivenessEvent,
    LivenessSweeper,
    ManualClock,
    NodeLiveness,
    UnknownNode,
)

C, H, U, R = Liveness.CONNECTING, Liveness.HEALTHY, Liveness.UNREACHABLE, Liveness.REMOVED


def make(grace_s: float = 0.0) -> tuple[ManualClock, NodeLiveness]:
    clock = ManualClock(1000.0)
    return clock, NodeLiveness(clock, heartbeat_interval_s=10.0, remove_after_intervals=3, grace_s=grace_s)


def moves(events: list[LivenessEvent]) -> list[tuple[str, Liveness | None, Liveness]]:
    return [(e.node_id, e.old, e.new) for e in events]


def healthy_node(lv: NodeLiveness, node_id: str = "n1") -> None:
    lv.register(node_id)
    lv.keyframe_applied(node_id)
    lv.sweep()


def test_register_then_keyframe_makes_healthy_and_schedulable() -> None:
    clock, lv = make()
    st = lv.register("n1")
    assert st.liveness is C and st.effective is EffectiveState.CONNECTING and not st.schedulable
    assert not lv.schedulable("n1")
    clock.advance(2)
    st = lv.keyframe_applied("n1")
    assert st.liveness is H and st.schedulable and lv.schedulable("n1")
    assert st.since_s == 1002.0 and st.last_seen_s == 1002.0
    events = lv.sweep()
    assert moves(events) == [("n1", None, C), ("n1", C, H)]
    assert [e.at for e in events] == [1000.0, 1002.0]
    assert lv.sweep() == []  # each transition exactly once


def test_silence_of_one_interval_is_unreachable_and_three_is_removed() -> None:
    clock, lv = make()
    healthy_node(lv)
    clock.advance(10.0)
    assert lv.sweep() == [] and lv.state("n1").liveness is H  # exactly one interval: not yet
    clock.advance(0.5)
    events = lv.sweep()
    assert moves(events) == [("n1", H, U)] and events[0].at == 1010.5
    assert not lv.schedulable("n1")
    clock.advance(19.5)  # 30 s silent: exactly three intervals, still there
    assert lv.sweep() == []
    clock.advance(0.5)
    events = lv.sweep()
    assert moves(events) == [("n1", U, R)]
    assert events[0].node_id == "n1"  # the scheduler reports n1's leased tasks lost
    assert lv.state("n1").effective is EffectiveState.REMOVED
    clock.advance(100)
    assert lv.sweep() == []  # removed once, not again


def test_grace_delays_both_deadlines() -> None:
    clock, lv = make(grace_s=1.0)
    healthy_node(lv)
    clock.advance(10.9)
    assert lv.sweep() == []
    clock.advance(0.2)
    assert moves(lv.sweep()) == [("n1", H, U)]
    clock.advance(19.8)  # 30.9 s silent
    assert lv.sweep() == []
    clock.advance(0.2)
    assert moves(lv.sweep()) == [("n1", U, R)]


def test_messages_keep_a_node_healthy() -> None:
    clock, lv = make()
    healthy_node(lv)
    for _ in range(20):
        clock.advance(9.9)
        assert lv.seen("n1") is H
        assert lv.sweep() == []


def test_late_sweep_emits_both_steps_in_order() -> None:
    clock, lv = make()
    healthy_node(lv)
    clock.advance(45)
    events = lv.sweep()
    assert moves(events) == [("n1", H, U), ("n1", U, R)]
    assert events[0].at == events[1].at == 1045.0


def test_unreachable_node_comes_back_on_any_message() -> None:
    clock, lv = make()
    healthy_node(lv)
    clock.advance(15)
    lv.sweep()
    clock.advance(1)
    assert lv.seen("n1") is H
    assert lv.schedulable("n1")
    assert moves(lv.sweep()) == [("n1", U, H)]


def test_silent_before_keyframe_returns_to_connecting_not_healthy() -> None:
    clock, lv = make()
    lv.register("n1")
    clock.advance(11)
    assert moves(lv.sweep()) == [("n1", None, C), ("n1", C, U)]
    assert lv.seen("n1") is C  # no keyframe yet
    lv.keyframe_applied("n1")
    assert moves(lv.sweep()) == [("n1", U, C), ("n1", C, H)]


def test_flapping_node_emits_every_transition_exactly_once() -> None:
    clock, lv = make()
    healthy_node(lv)
    got: list[LivenessEvent] = []
    for _ in range(5):
        clock.advance(12)  # silent past one interval
        got += lv.sweep()
        got += lv.sweep()  # a second sweep adds nothing
        clock.advance(1)
        lv.seen("n1")
        got += lv.sweep()
    assert moves(got) == [("n1", H, U), ("n1", U, H)] * 5
    assert lv.state("n1").liveness is H


def test_flapping_between_sweeps_is_reported_not_collapsed() -> None:
    # a node that drops and re-registers between two sweeps still shows both
    # steps, so a consumer that keys on UNREACHABLE sees it
    clock, lv = make()
    healthy_node(lv)
    lv.disconnected("n1")
    clock.advance(1)
    lv.register("n1")
    lv.keyframe_applied("n1")
    assert moves(lv.sweep()) == [("n1", H, U), ("n1", U, C), ("n1", C, H)]


def test_disconnect_is_unreachable_at_once_and_needs_a_new_registration() -> None:
    clock, lv = make()
    healthy_node(lv)
    clock.advance(2)
    st = lv.disconnected("n1")
    assert st.liveness is U and not st.connected
    # a straggler message or keyframe on the closed stream changes nothing
    assert lv.seen("n1") is U
    assert lv.keyframe_applied("n1").liveness is U
    assert moves(lv.sweep()) == [("n1", H, U)]
    # removal counts from the last message, not from the disconnect
    clock.advance(28.5)
    assert moves(lv.sweep()) == [("n1", U, R)]


def test_reconnect_after_disconnect_is_healthy_after_keyframe() -> None:
    clock, lv = make()
    healthy_node(lv)
    lv.disconnected("n1")
    clock.advance(5)
    assert lv.register("n1").liveness is C
    assert not lv.schedulable("n1")
    assert lv.keyframe_applied("n1").liveness is H
    assert moves(lv.sweep()) == [("n1", H, U), ("n1", U, C), ("n1", C, H)]


def test_removed_node_ignores_old_stream_and_reregisters_as_connecting() -> None:
    clock, lv = make()
    healthy_node(lv)
    clock.advance(31)
    lv.sweep()
    assert lv.seen("n1") is R  # the caller asks the agent to register again
    assert lv.keyframe_applied("n1").liveness is R
    assert lv.sweep() == []
    assert lv.register("n1").liveness is C
    lv.keyframe_applied("n1")
    assert moves(lv.sweep()) == [("n1", R, C), ("n1", C, H)]


def test_reregister_of_a_healthy_node_goes_back_to_connecting() -> None:
    clock, lv = make()
    healthy_node(lv)
    lv.register("n1")  # agent restarted: its view rows must be rebuilt from a keyframe
    assert not lv.schedulable("n1")
    assert moves(lv.sweep()) == [("n1", H, C)]


@pytest.mark.parametrize(
    "op, admin, effective",
    [("cordon", Admin.CORDONED, EffectiveState.CORDONED), ("drain", Admin.DRAINING, EffectiveState.DRAINING)],
)
def test_operator_state_survives_silence_removal_and_reregistration(op, admin, effective) -> None:
    clock, lv = make()
    healthy_node(lv)
    st = getattr(lv, op)("n1")
    assert st.admin is admin and st.effective is effective and not st.schedulable
    assert lv.sweep() == []  # operator changes are not liveness events
    clock.advance(15)
    lv.sweep()
    st = lv.state("n1")
    assert st.effective is EffectiveState.UNREACHABLE and st.admin is admin  # liveness outranks
    lv.seen("n1")
    assert lv.state("n1").effective is effective and not lv.schedulable("n1")
    clock.advance(40)
    lv.sweep()
    lv.register("n1")
    lv.keyframe_applied("n1")
    st = lv.state("n1")
    assert st.liveness is H and st.admin is admin and not st.schedulable
    st = lv.uncordon("n1")
    assert st.admin is Admin.ACTIVE and st.effective is EffectiveState.HEALTHY and st.schedulable


def test_latest_operator_call_wins() -> None:
    clock, lv = make()
    healthy_node(lv)
    lv.drain("n1")
    assert lv.cordon("n1").admin is Admin.CORDONED
    assert lv.drain("n1").admin is Admin.DRAINING


@pytest.mark.parametrize("call", ["keyframe_applied", "seen", "disconnected", "cordon", "drain", "uncordon", "state", "forget"])
def test_unknown_node_raises(call) -> None:
    _, lv = make()
    with pytest.raises(UnknownNode):
        getattr(lv, call)("ghost")
    assert lv.schedulable("ghost") is False


def test_nodes_lists_everyone_by_id_and_forget_drops_only_removed() -> None:
    clock, lv = make()
    for n in ("b", "a", "c"):
        healthy_node(lv, n)
    clock.advance(20)
    lv.seen("a")
    lv.seen("b")
    clock.advance(15)
    lv.sweep()
    assert [(s.node_id, s.liveness) for s in lv.nodes()] == [("a", U), ("b", U), ("c", R)]
    with pytest.raises(ValueError):
        lv.forget("a")
    lv.forget("c")
    assert [s.node_id for s in lv.nodes()] == ["a", "b"]


def test_independent_nodes_time_out_independently() -> None:
    clock, lv = make()
    healthy_node(lv, "quiet")
    healthy_node(lv, "chatty")
    for _ in range(4):
        clock.advance(8)
        lv.seen("chatty")
    assert moves(lv.sweep()) == [("quiet", H, U), ("quiet", U, R)]
    assert lv.schedulable("chatty")


@pytest.mark.parametrize(
    "kwargs", [dict(heartbeat_interval_s=0), dict(remove_after_intervals=0), dict(grace_s=-1)]
)
def test_bad_configuration_is_rejected(kwargs) -> None:
    with pytest.raises(ValueError):
        NodeLiveness(ManualClock(), **kwargs)


def test_manual_clock_only_moves_forward() -> None:
    clock = ManualClock(5.0)
    assert clock() == 5.0 and clock.advance(2.5) == 7.5
    with pytest.raises(ValueError):
        clock.advance(-1)


# ------------------------------------------------------------------ sweeper
async def until(predicate, timeout_s: float = 5.0) -> None:
    """Wait for the sweeper to catch up; polls, so a slow machine only waits longer."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < deadline, "sweeper did not deliver in time"
        await asyncio.sleep(0.002)


def test_sweeper_delivers_events_to_sync_and_async_consumers() -> None:
    async def scenario() -> tuple[list, list]:
        clock, lv = make()
        sync_got: list[LivenessEvent] = []
        async_got: list[LivenessEvent] = []

        async def consume(events: list[LivenessEvent]) -> None:
            await asyncio.sleep(0)
            async_got.extend(events)

        lv.register("n1")
        sweeper = LivenessSweeper(lv, sync_got.extend, interval_s=0.005)
        sweeper.start()
        await until(lambda: len(sync_got) == 1)
        clock.advance(31)
        await until(lambda: len(sync_got) == 3)
        await asyncio.sleep(0.02)  # more sweeps: nothing new
        await sweeper.stop()
        assert not sweeper.running

        lv2 = NodeLiveness(clock)
        lv2.register("n2")
        s2 = LivenessSweeper(lv2, consume, interval_s=0.005)
        s2.start()
        await until(lambda: len(async_got) == 1)
        await s2.stop()
        return sync_got, async_got

    sync_got, async_got = asyncio.run(scenario())
    assert moves(sync_got) == [("n1", None, C), ("n1", C, U), ("n1", U, R)]
    assert moves(async_got) == [("n2", None, C)]


def test_sweeper_survives_a_failing_consumer() -> None:
    async def scenario() -> list[int]:
        clock, lv = make()
        calls: list[int] = []

        def consume(events: list[LivenessEvent]) -> None:
            calls.append(len(events))
            raise RuntimeError("consumer bug")

        sweeper = LivenessSweeper(lv, consume, interval_s=0.005)
        sweeper.start()
        lv.register("a")
        await until(lambda: len(calls) == 1)
        lv.register("b")
        await until(lambda: len(calls) == 2)
        assert sweeper.running
        await sweeper.stop()
        return calls

    assert asyncio.run(scenario()) == [1, 1]


def test_sweeper_start_stop_rules() -> None:
    async def scenario() -> None:
        _, lv = make()
        sweeper = LivenessSweeper(lv, lambda events: None, interval_s=10.0)
        await sweeper.stop()  # never started: a no-op
        sweeper.start()
        with pytest.raises(RuntimeError):
            sweeper.start()
        assert sweeper.running
        await asyncio.wait_for(sweeper.stop(), 1.0)  # cancels the long sleep at once
        assert not sweeper.running
        await sweeper.stop()

    asyncio.run(scenario())
    _, lv = make()
    with pytest.raises(RuntimeError):  # no running loop
        LivenessSweeper(lv, lambda events: None).start()
    with pytest.raises(ValueError):
        LivenessSweeper(lv, lambda events: None, interval_s=0)


def test_sweep_once_returns_what_it_delivered() -> None:
    async def scenario() -> tuple[list, list]:
        _, lv = make()
        got: list[LivenessEvent] = []
        sweeper = LivenessSweeper(lv, got.extend)
        lv.register("n1")
        return await sweeper.sweep_once(), got

    returned, got = asyncio.run(scenario())
    assert moves(returned) == moves(got) == [("n1", None, C)]


# ------------------------------------------------------------------ coordinator stalls
def test_a_coordinator_stall_is_not_silence_and_the_deadlines_resume_after_it() -> None:
    """Time the coordinator did not run moves every deadline out by as much:
    a node heard just before a 35 s stall stays HEALTHY, and goes
    UNREACHABLE only once it has been silent for an interval plus grace of
    time the coordinator did run."""
    clock, lv = make(grace_s=1.0)
    healthy_node(lv, "n1")
    clock.advance(35.0)
    assert lv.coordinator_stalled(35.0) == 1
    assert lv.sweep() == [] and lv.state("n1").liveness is H
    clock.advance(11.0)  # 11 s of running time: exactly interval + grace
    assert lv.sweep() == []
    clock.advance(0.5)
    assert moves(lv.sweep()) == [("n1", H, U)]


def test_a_stall_excuses_no_more_than_a_nodes_silence_and_a_message_ends_the_excuse() -> None:
    """An excuse is never credit against later silence: a node silent 5 s
    when a 100 s stall is reported is owed 5 s, and a message clears it."""
    clock, lv = make(grace_s=1.0)
    healthy_node(lv, "short")
    healthy_node(lv, "spoke")
    clock.advance(5.0)
    lv.coordinator_stalled(100.0)
    clock.advance(11.5)
    assert moves(lv.sweep()) == [("short", H, U), ("spoke", H, U)]
    lv.seen("spoke")  # back to HEALTHY; its excuse is spent
    assert [(e.node_id, e.new) for e in lv.sweep()] == [("spoke", H)]
    clock.advance(11.5)
    assert moves(lv.sweep()) == [("spoke", H, U)]


def test_removed_nodes_are_not_excused_and_an_empty_stall_changes_nothing() -> None:
    clock, lv = make()
    healthy_node(lv, "gone")
    clock.advance(31.0)
    lv.sweep()
    assert lv.coordinator_stalled(10.0) == 0 and lv.coordinator_stalled(0.0) == 0
    assert lv.state("gone").liveness is R


def test_sweeper_takes_its_own_lateness_for_a_stall_and_logs_it_once() -> None:
    """The sweeper's sleep overran by 34 s (the process was stopped): the
    node's messages wait in its socket, so the sweep on waking must not
    find it silent. The stall is logged once; sweeps on time after it are
    not stalls, and a node that really went quiet still times out."""
    from structlog.testing import capture_logs

    async def scenario() -> tuple[list, list, LivenessSweeper]:
        clock, lv = make(grace_s=1.0)
        got: list[LivenessEvent] = []
        sweeper = LivenessSweeper(lv, got.extend, interval_s=1.0, clock=clock)
        lv.register("n1")
        lv.keyframe_applied("n1")
        await sweeper.sweep_once()  # at 1000.0
        got.clear()
        with capture_logs() as logs:
            clock.advance(35.0)  # stopped from 1001 to 1035: 34 s late
            await sweeper.sweep_once()
            assert got == [] and lv.state("n1").liveness is H
            clock.advance(2.0)  # one interval late: scheduling jitter, no stall
            await sweeper.sweep_once()
            # no message after all: 1 s before the stall, 2 s after it so far
            while not got:
                clock.advance(1.0)
                await sweeper.sweep_once()
        return logs, got, sweeper

    logs, got, sweeper = asyncio.run(scenario())
    stalls = [entry for entry in logs if entry["event"] == "coordinator_stalled"]
    assert [(s["stalled_s"], s["nodes_excused"], s["log_level"]) for s in stalls] == [(34.0, 1, "warning")]
    assert sweeper.stalls == 1
    # 1 + 2 s silent before the loop, then 9 s more: 12 s > interval + grace
    assert moves(got) == [("n1", H, U)] and got[0].at == 1000.0 + 35.0 + 2.0 + 9.0
