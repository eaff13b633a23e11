"""sd_notify against real datagram sockets the test binds (a filesystem one and
an abstract one), and the watchdog pinger's timing on a real event loop."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from coordinator.sdnotify import Notifier, NotifyListener, NotifyMessage, WatchdogPinger, notify_address

pytestmark = pytest.mark.timeout(30)


def _count(n: int):
    return lambda messages: len(messages) >= n


def _texts(messages: list[NotifyMessage]) -> list[str]:
    return [m.text for m in messages]


def _filesystem(tmp_path: Path) -> str:
    path = str(tmp_path / "notify")
    if len(path.encode()) >= 108:  # sun_path limit; pytest's tmp_path can be deep
        pytest.skip(f"tmp path too long for an AF_UNIX address: {path}")
    return path


@pytest.fixture(params=["filesystem", "abstract"])
def listener(request, tmp_path: Path) -> Iterator[NotifyListener]:
    if request.param == "filesystem":
        value = _filesystem(tmp_path)
    else:
        value = f"@gpulb-test-{uuid.uuid4().hex}"
    lst = NotifyListener(value).start()
    try:
        yield lst
    finally:
        lst.stop()


# ---- addresses and the watchdog variables ---------------------------------------


@pytest.mark.parametrize(
    "value, expected",
    [
        ("/run/systemd/notify", "/run/systemd/notify"),
        ("@/org/freedesktop/systemd1/notify/42", "\0/org/freedesktop/systemd1/notify/42"),
        ("@x", "\0x"),
    ],
)
def test_notify_address(value: str, expected: str) -> None:
    assert notify_address(value) == expected


@pytest.mark.parametrize("value", ["relative/notify", "vsock:2:1234", "notify"])
def test_unsupported_address_is_refused_naming_the_variable(value: str) -> None:
    with pytest.raises(ValueError, match="NOTIFY_SOCKET"):
        Notifier(value)


@pytest.mark.parametrize(
    "usec, pid, expected",
    [
        ("30000000", None, 30.0),
        ("30000000", "4242", 30.0),  # the watchdog names us
        ("30000000", "4243", None),  # meant for another process (we inherited it)
        ("0", None, None),
        ("", None, None),
        (None, None, None),
        ("500000", "", 0.5),
    ],
)
def test_watchdog_interval(usec: str | None, pid: str | None, expected: float | None) -> None:
    n = Notifier("/run/systemd/notify", watchdog_usec=usec, watchdog_pid=pid, pid=4242)
    assert n.watchdog_interval_s() == expected


@pytest.mark.parametrize("usec, pid, name", [("30s", None, "WATCHDOG_USEC"), ("1000", "me", "WATCHDOG_PID")])
def test_malformed_watchdog_variables_are_errors(usec: str, pid: str | None, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        Notifier("/run/systemd/notify", watchdog_usec=usec, watchdog_pid=pid, pid=1)


def test_from_environ_reads_all_three_variables() -> None:
    env = {"NOTIFY_SOCKET": "@n", "WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid())}
    n = Notifier.from_environ(env)
    assert n.enabled and n.socket_path == "@n"
    assert n.watchdog_interval_s() == 2.0


def test_disabled_notifier_is_a_no_op() -> None:
    n = Notifier.from_environ({"WATCHDOG_USEC": "1000000"})
    assert not n.enabled
    # No socket, so no watchdog either, whatever WATCHDOG_USEC says.
    assert n.watchdog_interval_s() is None
    assert [n.ready(), n.status("x"), n.watchdog(), n.reloading(), n.stopping()] == [False] * 5


# ---- messages on a real socket ---------------------------------------------------


def test_lifecycle_messages_arrive_from_this_process(listener: NotifyListener) -> None:
    n = Notifier(listener.address)
    assert n.enabled
    assert n.ready(status="listening on 127.0.0.1:50051")
    assert n.status("3 nodes, 12 GPUs, queue 0")
    assert n.watchdog()
    assert n.stopping()
    texts = _texts(listener.wait_for(_count(4)))
    assert texts == [
        "READY=1\nSTATUS=listening on 127.0.0.1:50051",
        "STATUS=3 nodes, 12 GPUs, queue 0",
        "WATCHDOG=1",
        "STOPPING=1",
    ]
    # NotifyAccess=main only accepts datagrams whose sender is the main pid.
    assert {m.pid for m in listener.snapshot()} == {os.getpid()}


def test_listener_sees_which_process_sent(listener: NotifyListener) -> None:
    # What a daemon test relies on: another process's READY=1 arrives with its pid.
    child = subprocess.run(
        [sys.executable, "-c", f"import os; from coordinator.sdnotify import Notifier; Notifier({listener.address!r}).ready(); print(os.getpid())"],
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert child.returncode == 0, child.stderr
    (msg,) = listener.wait_for(_count(1))
    assert msg.fields == {"READY": "1"}
    assert msg.pid == int(child.stdout) != os.getpid()


def test_message_fields() -> None:
    msg = NotifyMessage(0.0, 1, "READY=1\nSTATUS=a=b c")
    assert msg.fields == {"READY": "1", "STATUS": "a=b c"}


def test_status_is_one_line_and_bounded(listener: NotifyListener) -> None:
    n = Notifier(listener.address)
    n.status("draining\nnode-1\r\n  and   node-2")
    n.status("x" * 5000)
    first, second = _texts(listener.wait_for(_count(2)))
    assert first == "STATUS=draining node-1 and node-2"
    assert second.startswith("STATUS=x") and "\n" not in second and len(second) == len("STATUS=") + 1024


def test_reloading_carries_monotonic_usec(listener: NotifyListener) -> None:
    n = Notifier(listener.address)
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    n.reloading()
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    n.ready()
    reload_msg, ready_msg = _texts(listener.wait_for(_count(2)))
    lines = reload_msg.split("\n")
    assert lines[0] == "RELOADING=1"
    key, _, value = lines[1].partition("=")
    assert key == "MONOTONIC_USEC" and before <= int(value) <= after
    assert ready_msg == "READY=1"


def test_send_to_a_missing_socket_raises(tmp_path: Path) -> None:
    n = Notifier(_filesystem(tmp_path))
    with pytest.raises(OSError):
        n.ready()


# ---- the watchdog pinger -----------------------------------------------------------


async def test_pinger_pings_at_half_the_watchdog_interval(listener: NotifyListener) -> None:
    # WatchdogSec=0.4s -> a ping every 0.2 s.
    n = Notifier(listener.address, watchdog_usec="400000", watchdog_pid=str(os.getpid()))
    pinger = WatchdogPinger(n)
    assert pinger.interval_s == pytest.approx(0.2)
    pinger.start()
    assert pinger.running
    await asyncio.sleep(1.1)
    await pinger.stop()
    assert not pinger.running
    stopped_at = time.monotonic()
    times = listener.times_of("WATCHDOG=1")
    assert 4 <= len(times) <= 7, times
    gaps = [b - a for a, b in zip(times, times[1:])]
    # Well inside the 0.4 s timeout; never a burst either.
    assert max(gaps) < 0.35 and min(gaps) > 0.1, gaps
    # After stop() nothing more arrives.
    await asyncio.sleep(0.3)
    assert all(t <= stopped_at for t in listener.times_of("WATCHDOG=1"))
    assert pinger.pings == len(listener.times_of("WATCHDOG=1"))


async def test_a_stuck_event_loop_stops_the_pings(listener: NotifyListener) -> None:
    n = Notifier(listener.address)
    pinger = WatchdogPinger(n, interval_s=0.05)
    pinger.start()
    await asyncio.sleep(0.2)
    blocked_from = time.monotonic()
    time.sleep(0.5)  # the whole loop is stuck: this is what the watchdog must see
    blocked_until = time.monotonic()
    await asyncio.sleep(0.2)
    await pinger.stop()
    times = listener.times_of("WATCHDOG=1")
    during = [t for t in times if blocked_from + 0.02 < t < blocked_until]
    assert during == [], "a ping was sent while the event loop was blocked"
    assert any(t < blocked_from for t in times) and any(t >= blocked_until for t in times)


async def test_pinger_without_a_watchdog_does_nothing(listener: NotifyListener) -> None:
    pinger = WatchdogPinger(Notifier(listener.address))  # no WATCHDOG_USEC
    assert pinger.interval_s is None
    pinger.start()
    assert not pinger.running
    await pinger.stop()
    disabled = WatchdogPinger(Notifier(None), interval_s=0.01)
    disabled.start()
    assert not disabled.running
    await asyncio.sleep(0.05)
    assert listener.texts() == []


async def test_pinger_start_twice_is_an_error_and_stop_is_idempotent(listener: NotifyListener) -> None:
    pinger = WatchdogPinger(Notifier(listener.address), interval_s=1.0)
    await pinger.stop()  # never started
    pinger.start()
    with pytest.raises(RuntimeError):
        pinger.start()
    assert _texts(await listener.until(_count(1))) == ["WATCHDOG=1"]
    await pinger.stop()
    await pinger.stop()
    assert not pinger.running


async def test_pinger_survives_a_vanished_socket(tmp_path: Path) -> None:
    path = _filesystem(tmp_path)
    lst = NotifyListener(path).start()
    pinger = WatchdogPinger(Notifier(path), interval_s=0.05)
    pinger.start()
    await lst.until(_count(1))
    lst.stop()
    os.unlink(path)  # systemd's socket gone: sendto fails with ENOENT
    await asyncio.sleep(0.15)
    assert pinger.running, "a send error must not end the ping loop"
    again = NotifyListener(path).start()
    try:
        await again.until(_count(1))
    finally:
        await pinger.stop()
        again.stop()


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_pinger_rejects_a_bad_interval(bad: float) -> None:
    with pytest.raises(ValueError, match="interval_s"):
        WatchdogPinger(Notifier(None), interval_s=bad)
