"""Caps on what a client can make a live coordinator hold (QA pass 23, items 4
and 8), against a real Coordinator on 127.0.0.1: the metrics endpoint serves at
most ``metrics_max_connections`` at once and aborts a client that does not take
its reply within ``metrics_timeout_s``; watch streams (WatchTask, WatchView,
WatchPlans) are capped per client and in all, and every way a stream ends
gives its slot back.

What the server side holds is read from the kernel (this process's connected
sockets on the metrics port, /proc), not from the server's own counters, so
these tests say the same thing of the code before the caps."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import urllib.error
import urllib.request

import grpc
import pytest

from waiting import until
from coordinator.config import CoordinatorConfig
from coordinator.security import Security, TokenAuth
from coordinator.server import Coordinator
from protos import advisor_pb2 as apb
from protos import advisor_pb2_grpc as apb_grpc
from protos import cluster_pb2 as cpb
from protos import cluster_pb2_grpc as cpb_grpc
from protos import tasks_pb2 as tpb
from protos import tasks_pb2_grpc as tpb_grpc

pytestmark = pytest.mark.timeout(120)

_LISTEN = "0A"  # TCP state in /proc/net/tcp


def _sockets_served(port: int) -> int:
    """Connections this process holds open on local port ``port``: the metrics
    server's side of its connections (the tests' clients run in this process
    too, but their local port is another). A socket the server has closed is
    no longer any descriptor's, whatever the kernel still does with it."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(table) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if int(local.rsplit(":", 1)[1], 16) == port and state != _LISTEN:
                    inodes.add(inode)
    held = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            held += target.startswith("socket:[") and target[len("socket:["):-1] in inodes
    return held


def _read_to_end(sock: socket.socket) -> tuple[bytes, bool]:
    """Everything the peer sent until it closed; (bytes, whether it reset)."""
    sock.settimeout(30)  # a bound for a hung test, not a timing assertion
    chunks = []
    try:
        while chunk := sock.recv(1 << 16):
            chunks.append(chunk)
    except ConnectionResetError:
        return b"".join(chunks), True
    return b"".join(chunks), False


def _scrape(port: int) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics?per_gpu=0", timeout=30) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


# ---- the metrics endpoint -----------------------------------------------------------------------


async def test_metrics_connections_beyond_the_cap_are_answered_503_and_closed_at_once():
    # metrics_timeout_s long: the idle clients below keep their places until they close
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", metrics_listen="127.0.0.1:0",
                                          metrics_max_connections=2, metrics_timeout_s=600))
    await coord.start()
    port = coord.metrics_port
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
    try:
        await until(lambda: _sockets_served(port) == 2, what="both idle connections accepted")
        # 50 more that send nothing: each is told at once why, then closed,
        # and holds no descriptor (the code before the cap kept every one
        # open until its request timed out, and 1,000 used up the process's)
        for _ in range(50):
            with socket.create_connection(("127.0.0.1", port)) as extra:
                reply, _ = await asyncio.to_thread(_read_to_end, extra)
                assert reply.startswith(b"HTTP/1.1 503 "), reply
                assert b"metrics_max_connections" in reply
        assert _sockets_served(port) == 2
    finally:
        for sock in idle:
            sock.close()
    try:
        # the idle clients gone, their places are free again, and each scrape gives its place back
        await until(lambda: _sockets_served(port) == 0, what="idle connections released")
        for _ in range(5):
            status, body = await asyncio.to_thread(_scrape, port)
            assert status == 200 and b"gpulb_nodes" in body
    finally:
        await coord.stop(grace_s=0.1)


async def test_a_metrics_reader_that_never_reads_is_aborted_and_its_reply_dropped():
    from coordinator.schedbench import populate

    # metrics_timeout_s injected short; what is checked does not depend on it
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", metrics_listen="127.0.0.1:0", metrics_timeout_s=1.0))
    # ~13 MB of exposition: more than the kernel's socket buffers take
    # (tcp_wmem's 4 MiB at most), so most of the reply waits in the process
    populate(coord, 1_500)
    await coord.start()
    port = coord.metrics_port
    reader = socket.socket()
    try:
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        reader.connect(("127.0.0.1", port))
        reader.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        await until(lambda: _sockets_served(port) == 1, what="the reader's connection accepted")
        # not read: the coordinator gives up on it and lets its descriptor and
        # buffered reply go (the code before held both until the reader read)
        await until(lambda: _sockets_served(port) == 0, timeout=60, what="the never-reading connection closed")
        got, _ = await asyncio.to_thread(_read_to_end, reader)
    finally:
        reader.close()
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK"), head[:200]
    length = int(next(line.split(b":", 1)[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")))
    assert length > 8_000_000
    assert len(body) < length  # the rest was dropped, not kept for it
    try:
        status, body = await asyncio.to_thread(_scrape, port)  # a scrape that reads is served as before
        assert status == 200 and b"gpulb_nodes" in body
    finally:
        await coord.stop(grace_s=0.1)


# ---- watch streams ------------------------------------------------------------------------------

TOKENS = {
    "tok-admin": {"role": "admin", "name": "ops"},
    "tok-a": {"role": "tenant", "tenant": "a", "name": "alice"},
    "tok-b": {"role": "tenant", "tenant": "b", "name": "bob"},
}


def md(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


async def _refusal(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call.read()
    return info.value


@contextlib.asynccontextmanager
async def _coordinator(**limits):
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", **limits),
                        security=Security(insecure=True, tokens=TokenAuth.from_tokens(TOKENS)))
    port = await coord.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield coord, channel
    finally:
        await coord.stop(grace_s=0.5)


async def test_watch_streams_are_capped_per_client_and_in_all_with_the_option_named():
    async with _coordinator(max_watch_streams_per_client=2, max_watch_streams=3) as (coord, ch):
        sched, op = tpb_grpc.SchedulerStub(ch), cpb_grpc.ClusterOperatorStub(ch)
        for token, task_id in (("tok-a", "a-1"), ("tok-b", "b-1")):  # no agents: they stay queued
            await sched.ScheduleTask(tpb.ScheduleTaskRequest(spec=tpb.TaskSpec(task_id=task_id, vram_mib=256), wait=False),
                                     metadata=md(token))
        alice = [sched.WatchTask(tpb.WatchTaskRequest(task_id="a-1"), metadata=md("tok-a")),
                 op.WatchView(cpb.WatchViewRequest(), metadata=md("tok-a"))]
        for call in alice:
            await call.read()
        refused = await _refusal(op.WatchView(cpb.WatchViewRequest(), metadata=md("tok-a")))
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "token:alice has 2 open" in refused.details() and "(max_watch_streams_per_client)" in refused.details()
        refused = await _refusal(sched.WatchTask(tpb.WatchTaskRequest(task_id="a-1"), metadata=md("tok-a")))
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

        # another client has places of its own, up to the total
        bob = sched.WatchTask(tpb.WatchTaskRequest(task_id="b-1"), metadata=md("tok-b"))
        await bob.read()
        refused = await _refusal(op.WatchView(cpb.WatchViewRequest(), metadata=md("tok-b")))
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "3 open" in refused.details() and "(max_watch_streams)" in refused.details()

        # WatchPlans counts among them too (server.py hands the advisor's
        # service the coordinator's admission; set here as it does)
        coord.advisor_service.admit_watch = lambda context: coord.security.admit_watch(context, coord.config)
        refused = await _refusal(apb_grpc.AdvisorStub(ch).WatchPlans(apb.WatchPlansRequest(), metadata=md("tok-admin")))
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "(max_watch_streams)" in refused.details()

        # a refused request held no place: one ended stream lets the next in
        alice[1].cancel()
        await until(lambda: coord.security.watch_streams.open == 2, what="the cancelled watch released")
        plans = apb_grpc.AdvisorStub(ch).WatchPlans(apb.WatchPlansRequest(), metadata=md("tok-admin"))
        await until(lambda: coord.security.watch_streams.open == 3, what="the plan watch admitted")
        for call in (plans, bob, alice[0]):
            call.cancel()
        await until(lambda: coord.security.watch_streams.open == 0, what="every cancelled watch released")


async def test_every_way_a_watch_ends_gives_its_place_back():
    async with _coordinator(max_watch_streams_per_client=2, max_watch_streams=2) as (coord, ch):
        sched, op = tpb_grpc.SchedulerStub(ch), cpb_grpc.ClusterOperatorStub(ch)
        slots = coord.security.watch_streams
        await sched.ScheduleTask(tpb.ScheduleTaskRequest(spec=tpb.TaskSpec(task_id="t-1", vram_mib=256), wait=False),
                                 metadata=md("tok-a"))

        async def admitted(call) -> bool:
            await call.read()
            return True

        # the client cancels
        for _ in range(5):
            calls = [op.WatchView(cpb.WatchViewRequest(), metadata=md("tok-a")) for _ in range(2)]
            for call in calls:
                await call.read()
            assert slots.open == 2
            for call in calls:
                call.cancel()
            await until(lambda: slots.open == 0, what="cancelled watches released")

        # the client's deadline passes (an error status, not a cancel by hand)
        late = op.WatchView(cpb.WatchViewRequest(min_interval_ms=60_000), metadata=md("tok-a"), timeout=1)
        await late.read()
        assert slots.open == 1
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await late.read()
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await until(lambda: slots.open == 0, what="the watch past its deadline released")

        # the task ends: its watch ends normally
        task_watch = sched.WatchTask(tpb.WatchTaskRequest(task_id="t-1"), metadata=md("tok-a"))
        await task_watch.read()
        assert slots.open == 1
        await sched.CancelTask(tpb.CancelTaskRequest(task_id="t-1"), metadata=md("tok-a"))
        assert (await task_watch.read()).state == tpb.TASK_STATE_CANCELLED
        await until(lambda: slots.open == 0, what="the ended task's watch released")

        # the coordinator stops: open watches end UNAVAILABLE and give theirs back
        open_calls = [op.WatchView(cpb.WatchViewRequest(), metadata=md("tok-a")),
                      op.WatchView(cpb.WatchViewRequest(), metadata=md("tok-b"))]
        for call in open_calls:
            assert await admitted(call)
        assert slots.open == 2 and slots.open_by("token:alice") == slots.open_by("token:bob") == 1
        await coord.stop(grace_s=5)
        for call in open_calls:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call.read()
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert slots.open == 0 and len(slots) == 0  # no client left behind with a count


def test_a_released_slot_is_given_back_once_however_often_it_is_released():
    from coordinator.security import AuthError, StreamSlots

    slots = StreamSlots()
    first = slots.admit("token:alice", per_client=1, total=2)
    with pytest.raises(AuthError) as info:
        slots.admit("token:alice", per_client=1, total=2)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    with slots.admit("token:bob", per_client=1, total=2):
        assert slots.open == 2 and len(slots) == 2
    first.release()
    first.release()  # a stream's endings may overlap (an abort, then the generator's close)
    assert slots.open == 0 and len(slots) == 0 and slots.refused == 1
    slots.admit("token:alice", per_client=1, total=1)  # the counts did not go below zero
    with pytest.raises(AuthError):
        slots.admit("token:bob", per_client=1, total=1)
