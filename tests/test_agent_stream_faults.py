"""The agent's stream when things go wrong below it: a sampling round that
hangs (a wedged NVML call), a connection that silently stops carrying
packets (a partition, the coordinator's host lost power), a coordinator that
accepts TCP but never answers, and a SIGHUP. A real coordinator on a loopback
port, a TCP proxy in the test's loop that can stop forwarding, and backend
doubles whose reads block the way NVML's do."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from structlog.testing import capture_logs

from agent import client as agent_client
from agent.client import Agent, AgentConfig
from agent.sim import SimBackend
from coordinator.config import CoordinatorConfig
from coordinator.liveness import Liveness
from coordinator.server import Coordinator
from protos import telemetry_pb2 as pb
from protos import telemetry_pb2_grpc as pb_grpc
from protos.codec import LOWER, TelemetryEncoder
from protos.fields import BY_NAME
from waiting import until

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent


class _HangingNvml(SimBackend):
    """Simulated GPUs read the way NVML is (``name`` "nvml": in a thread),
    whose reads block once ``hang`` is set, until ``release`` is: a call into
    a wedged driver. Counts reads in flight at once (never more than one)."""

    name = "nvml"

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.hang = threading.Event()
        self.release = threading.Event()
        self.hanging = threading.Event()
        self._lock = threading.Lock()
        self.in_flight = 0
        self.most_in_flight = 0
        self.reads = 0

    def sample(self):
        with self._lock:
            self.in_flight += 1
            self.reads += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if self.hang.is_set():
                self.hanging.set()
                self.release.wait(30)
            return super().sample()
        finally:
            with self._lock:
                self.in_flight -= 1


def _liveness(coord: Coordinator, node_id: str):
    return coord.liveness.state(node_id).liveness if node_id in coord.view.nodes else None


# ---- a round that hangs ---------------------------------------------------------------------------


async def test_a_round_that_hangs_three_heartbeat_intervals_leaves_the_node_healthy():
    """A read of the GPUs blocked for 3.5 heartbeat intervals (an NVML call
    into a wedged driver; QA: 15-40 s). The stream heartbeats while the round
    is in flight: the node stays HEALTHY, on the same stream, and is neither
    UNREACHABLE (after 1 s + 1 s of silence here) nor REMOVED (after 3 s + 1 s)
    with its tasks declared lost and placed again. Before, no heartbeat went
    out until the round returned."""
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", heartbeat_interval_s=1.0))
    port = await coord.start()
    backend = _HangingNvml(gpus=2, seed=5, workload="idle", node_id="wedged")
    agent = Agent(AgentConfig(node_id="wedged", coordinator=f"127.0.0.1:{port}", interval_min_s=0.1, interval_max_s=0.1,
                              backoff_initial_s=0.05, backoff_max_s=0.2), backend, seed=5)
    run = asyncio.create_task(agent.run())
    try:
        await until(lambda: _liveness(coord, "wedged") is Liveness.HEALTHY and agent.stats.envelopes > 0, what="streaming")
        backend.hang.set()
        await until(lambda: backend.hanging.is_set(), what="a round hanging", every=0.01)
        envelopes, heartbeats = agent.stats.envelopes, agent.stats.heartbeats
        seen = set()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 3.5:
            seen.add(_liveness(coord, "wedged"))
            await asyncio.sleep(0.1)
        assert seen == {Liveness.HEALTHY}, seen
        assert agent.stats.heartbeats - heartbeats >= 2
        assert agent.stats.envelopes == envelopes  # the round is still in flight: nothing to send
        assert agent.stats.sessions == 1 and agent.connected.is_set()
        reads = backend.reads
        backend.hang.clear()
        backend.release.set()
        await until(lambda: backend.reads > reads + 3, what="rounds again once the read returned")
        assert backend.most_in_flight == 1  # no second read beside the hung one
        assert _liveness(coord, "wedged") is Liveness.HEALTHY
    finally:
        backend.release.set()
        await agent.stop()
        await asyncio.wait_for(run, 10)
        await coord.stop(grace_s=0.1)


async def test_a_stream_that_ends_while_a_round_hangs_hands_the_read_on_and_stop_waits_for_it():
    """The coordinator restarts while a read hangs: the read in flight is
    taken over (into the outage buffer, then the next stream), never doubled
    by a second thread reading the GPUs alongside it; ``run`` returns only
    once no read is in flight, since gpulb-agent closes the backend next."""
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0"))
    port = await coord.start()
    backend = _HangingNvml(gpus=1, seed=6, workload="idle", node_id="handover")
    agent = Agent(AgentConfig(node_id="handover", coordinator=f"127.0.0.1:{port}", interval_min_s=0.05, interval_max_s=0.05,
                              backoff_initial_s=0.05, backoff_max_s=0.1), backend, seed=6)
    run = asyncio.create_task(agent.run())
    try:
        await until(lambda: agent.connected.is_set() and agent.stats.envelopes > 0, what="streaming")
        backend.hang.set()
        await until(lambda: backend.hanging.is_set(), what="a round hanging", every=0.01)
        await coord.stop(grace_s=0.1)
        await until(lambda: not agent.connected.is_set(), what="the stream ended")
        await asyncio.sleep(0.5)  # the outage sampler's ticks: all join the read in flight
        assert backend.in_flight == 1 and backend.most_in_flight == 1
        backend.hang.clear()
        backend.release.set()
        await until(lambda: agent.outage_buffer_len >= 3, what="rounds into the outage buffer")
        coord = Coordinator(CoordinatorConfig(listen=f"127.0.0.1:{port}"))
        await coord.start()
        await until(lambda: agent.connected.is_set() and agent.outage_buffer_len == 0, what="the buffer sent")
        backend.release.clear()
        backend.hanging.clear()
        backend.hang.set()
        await until(lambda: backend.hanging.is_set(), what="a round hanging again", every=0.01)
        await agent.stop()
        await asyncio.sleep(0.3)
        assert not run.done()  # the read is still going on: the backend may not be closed yet
        backend.release.set()
        await asyncio.wait_for(run, 10)
        assert backend.in_flight == 0 and backend.most_in_flight == 1
    finally:
        backend.release.set()
        await agent.stop()
        await asyncio.wait_for(run, 10)
        await coord.stop(grace_s=0.1)


# ---- a connection that silently dies ---------------------------------------------------------------


class _Proxy:
    """A TCP proxy to ``upstream`` on a loopback port of its own. ``cut()``
    stops forwarding on the connections it holds, both ways, without closing
    them (packets vanish, as when the peer's host dies); with
    ``new_too`` the connections it accepts from then on are held silent as
    well (the coordinator's host is gone for good)."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.dead = False
        self.new_dead = False
        self.accepted = 0
        self._conns: list[dict] = []
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self._server.sockets[0].getsockname()[1]

    def cut(self, new_too: bool = False) -> None:
        for conn in self._conns:
            conn["dead"] = True
        self.new_dead = new_too

    async def _pipe(self, reader, writer, conn) -> None:
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                if conn["dead"]:
                    continue  # swallowed: the packets go nowhere
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            if not conn["dead"]:
                writer.close()

    async def _handle(self, client_reader, client_writer) -> None:
        self.accepted += 1
        self._writers.append(client_writer)
        conn = {"dead": self.new_dead}
        self._conns.append(conn)
        if conn["dead"]:  # accepted, and never a byte back: no HTTP/2 SETTINGS
            try:
                while await client_reader.read(65536):
                    pass
            except (ConnectionError, asyncio.CancelledError):
                pass
            return
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream)
        self._writers.append(up_writer)
        pipes = [asyncio.ensure_future(self._pipe(client_reader, up_writer, conn)),
                 asyncio.ensure_future(self._pipe(up_reader, client_writer, conn))]
        self._tasks.update(pipes)
        await asyncio.gather(*pipes, return_exceptions=True)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in self._tasks:
            task.cancel()
        for writer in self._writers:
            writer.close()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def test_a_blackholed_stream_ends_for_want_of_acks_and_readings_go_to_the_outage_buffer(monkeypatch):
    """The connection stops carrying packets both ways, without closing, and
    new connections are accepted but never answered (the coordinator's host
    lost power). Writes into the dead connection still succeed, so the
    agent sampled on into it for good (QA: still "connected", 379 envelopes
    into nowhere, an empty outage buffer after 120 s). Now the coordinator's
    missing acks end the stream within the heartbeat timeout of an envelope
    it acks (1 s + 1 s grace here, so this is not keepalive's 10 s + 5 s),
    and the readings from then on go to the outage buffer. The channel's
    pings (which find it too, test_keepalive_alone...) are left out here."""
    monkeypatch.setattr(agent_client, "KEEPALIVE_OPTIONS", (), raising=False)
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", heartbeat_interval_s=1.0))
    port = await coord.start()
    proxy = _Proxy(port)
    proxy_port = await proxy.start()
    agent = Agent(AgentConfig(node_id="cut-off", coordinator=f"127.0.0.1:{proxy_port}", interval_min_s=0.05,
                              interval_max_s=0.1, backoff_initial_s=0.05, backoff_max_s=0.2),
                  SimBackend(gpus=2, seed=8, node_id="cut-off"), seed=8)
    with capture_logs() as logs:
        run = asyncio.create_task(agent.run())
        try:
            await until(lambda: agent.connected.is_set() and agent._last_ack > 0, what="streaming and acked")
            proxy.cut(new_too=True)
            t0 = time.monotonic()
            await until(lambda: not agent.connected.is_set(), timeout=12, what="the dead stream ended", every=0.1)
            noticed_s = time.monotonic() - t0
            # at most: the next envelope owed an ack (5 s after the last ack) + 2 s; keepalive needs 10 s + 5 s
            assert noticed_s < 9.0, noticed_s
            ended = [e for e in logs if e["event"] == "stream_ended"]
            assert ended and "no ack from the coordinator" in ended[0].get("reason", ""), ended
            await until(lambda: agent.outage_buffer_len >= 5, what="readings into the outage buffer")
            assert agent.stats.sessions >= 2 and proxy.accepted >= 2  # it is trying again
        finally:
            await agent.stop()
            await asyncio.wait_for(run, 30)
            await proxy.close()
            await coord.stop(grace_s=0.1)


@pytest.mark.timeout(90)
async def test_keepalive_alone_ends_a_blackholed_stream(monkeypatch):
    """The agent's channel pings the coordinator (keepalive, and gRPC's own
    flow-control pings): with the ack watch out of the way, a connection
    that stops carrying packets is dropped by gRPC itself once a ping goes
    unanswered for 5 s (a keepalive ping goes out 10 s after the last bytes
    came in), where it had been kept until TCP gave up (~15 min)."""
    monkeypatch.setattr(agent_client, "_ACK_TIMEOUT_FLOOR_S", 3600.0, raising=False)
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0"))
    port = await coord.start()
    proxy = _Proxy(port)
    proxy_port = await proxy.start()
    agent = Agent(AgentConfig(node_id="pinged", coordinator=f"127.0.0.1:{proxy_port}", interval_min_s=0.2,
                              interval_max_s=0.5, backoff_initial_s=0.05, backoff_max_s=0.2),
                  SimBackend(gpus=1, seed=9, workload="idle", node_id="pinged"), seed=9)
    run = asyncio.create_task(agent.run())
    try:
        await until(lambda: agent.connected.is_set(), what="streaming")
        proxy.cut()  # new connections are forwarded: the agent comes back
        t0 = time.monotonic()
        await until(lambda: agent.stats.sessions >= 2, timeout=40, what="the dead connection dropped", every=0.2)
        assert time.monotonic() - t0 < 30  # a ping 10 s after the last bytes came in, 5 s for its answer, plus slack
        assert agent.stats.last_error.startswith("UNAVAILABLE") and "ping" in agent.stats.last_error, agent.stats.last_error
        await until(lambda: agent.connected.is_set(), what="streaming again")
    finally:
        await agent.stop()
        await asyncio.wait_for(run, 30)
        await proxy.close()
        await coord.stop(grace_s=0.1)


async def test_both_channels_keep_alive_no_faster_than_the_coordinator_lets_pings_through(monkeypatch, tmp_path):
    """Plaintext and TLS channels alike get gRPC keepalive (they had no
    options at all), at a period the coordinator's server accepts: pings
    more often than its ``min_recv_ping_interval_without_data_ms`` would end
    the connection with GOAWAY too_many_pings."""
    from certs import make_test_pki

    server_options: dict = {}
    real_server = grpc.aio.server

    def server_spy(*args, **kwargs):
        server_options.update(dict(kwargs.get("options") or []))
        return real_server(*args, **kwargs)

    monkeypatch.setattr(grpc.aio, "server", server_spy)
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0"))
    await coord.start()
    await coord.stop(grace_s=0.1)

    made: list[tuple[str, dict]] = []
    monkeypatch.setattr(grpc.aio, "insecure_channel",
                        lambda target, options=None, **kw: made.append(("plaintext", dict(options or []))))
    monkeypatch.setattr(grpc.aio, "secure_channel",
                        lambda target, creds, options=None, **kw: made.append(("tls", dict(options or []))))
    pki = make_test_pki(tmp_path, ["n1"])
    backend = SimBackend(gpus=1, seed=1)
    Agent(AgentConfig(node_id="n1"), backend)._default_channel("127.0.0.1:50051")
    Agent(AgentConfig(node_id="n1", ca_file=str(pki.ca_file), cert_file=str(pki.agents["n1"].cert_file),
                      key_file=str(pki.agents["n1"].key_file)), backend)._default_channel("127.0.0.1:50051")
    assert [kind for kind, _ in made] == ["plaintext", "tls"]
    for kind, options in made:
        assert options.get("grpc.keepalive_time_ms", 0) >= server_options["grpc.http2.min_recv_ping_interval_without_data_ms"], kind
        assert options["grpc.keepalive_time_ms"] <= 15_000 and 0 < options["grpc.keepalive_timeout_ms"] <= 10_000, kind
        # grpcio waits for a keepalive ping's answer as long as for any ping's (1 min unless set)
        assert 0 < options["grpc.http2.ping_timeout_ms"] <= 10_000, kind
        assert options["grpc.keepalive_permit_without_calls"] == 1 and server_options["grpc.keepalive_permit_without_calls"] == 1


def test_the_agent_knows_how_often_the_coordinator_acks():
    """The ack watch counts on an ack for an envelope sent this long after
    the last one: the coordinator's own constant."""
    from coordinator.gateway import _ACK_EVERY_S

    assert agent_client.COORDINATOR_ACK_EVERY_S == _ACK_EVERY_S


async def test_a_stream_that_only_heartbeats_owes_no_ack():
    """Heartbeats are not acked: a round hanging for several ack timeouts
    must not end the stream as dead (the ack watch counts envelopes only)."""
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", heartbeat_interval_s=0.5))
    port = await coord.start()
    backend = _HangingNvml(gpus=1, seed=2, workload="idle", node_id="quiet")
    agent = Agent(AgentConfig(node_id="quiet", coordinator=f"127.0.0.1:{port}", interval_min_s=0.1, interval_max_s=0.1),
                  backend, seed=2)
    run = asyncio.create_task(agent.run())
    try:
        await until(lambda: agent.connected.is_set() and agent._last_ack > 0, what="streaming and acked")
        backend.hang.set()
        await until(lambda: backend.hanging.is_set(), what="a round hanging", every=0.01)
        await asyncio.sleep(7.0)  # the ack timeout: 0.5 s + 1 s, at least 2 s; thrice, and some
        assert agent.stats.sessions == 1 and agent.connected.is_set()
        assert _liveness(coord, "quiet") is Liveness.HEALTHY
    finally:
        backend.release.set()
        await agent.stop()
        await asyncio.wait_for(run, 10)
        await coord.stop(grace_s=0.1)


# ---- connecting and registering that hang -----------------------------------------------------------


class _NeverAcks(pb_grpc.AgentGatewayServicer):
    """A gateway that takes the stream and never acks the registration."""

    async def Connect(self, request_iterator, context):
        async for _ in request_iterator:
            pass
        if False:  # pragma: no cover - a stream handler that never yields
            yield


@pytest.mark.parametrize("coordinator", ["accepts TCP and says nothing", "never acks the registration"])
async def test_rounds_go_to_the_outage_buffer_while_connecting_or_registering_hangs(coordinator):
    """A stopped coordinator (SIGSTOP: the kernel accepts TCP, nothing speaks
    HTTP/2; gRPC waits 20 s for it) or one that never acks a registration
    (up to 10 s): the agent samples into its outage buffer all along, where
    it had buffered only during the backoff between attempts (QA: one round
    for 30 s away)."""
    server = None
    proxy = None
    if coordinator == "never acks the registration":
        server = grpc.aio.server()
        pb_grpc.add_AgentGatewayServicer_to_server(_NeverAcks(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
    else:
        proxy = _Proxy(1)
        proxy.cut(new_too=True)
        port = await proxy.start()
    agent = Agent(AgentConfig(node_id="waiting", coordinator=f"127.0.0.1:{port}", interval_min_s=0.05, interval_max_s=0.1),
                  SimBackend(gpus=1, seed=3, node_id="waiting"), seed=3)
    run = asyncio.create_task(agent.run())
    try:
        await asyncio.sleep(2.5)
        assert agent.stats.sessions == 1  # still the first attempt
        assert agent.outage_buffer_len >= 12, agent.outage_buffer_len  # a round each 0.1 s
        assert agent.stats.buffered_rounds == agent.outage_buffer_len
    finally:
        await agent.stop()
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)
        if server is not None:
            await server.stop(0)
        if proxy is not None:
            await proxy.close()


async def test_a_prompt_connection_buffers_nothing():
    """The outage sampler waits a period before its first round: an agent
    that registers at once sends no outage buffer of one round at start."""
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0"))
    port = await coord.start()
    agent = Agent(AgentConfig(node_id="prompt", coordinator=f"127.0.0.1:{port}", interval_min_s=0.5, interval_max_s=1.0),
                  SimBackend(gpus=1, seed=4, node_id="prompt"), seed=4)
    with capture_logs() as logs:
        run = asyncio.create_task(agent.run())
        try:
            await until(lambda: agent.stats.envelopes > 0, what="streaming")
            await asyncio.sleep(1.2)
        finally:
            await agent.stop()
            await asyncio.wait_for(run, 10)
            await coord.stop(grace_s=0.1)
    assert agent.stats.buffered_rounds == 0
    assert not [e for e in logs if e["event"] == "sending_outage_buffer"]


# ---- the token file, read at each connection -----------------------------------------------------------


async def test_the_token_file_is_read_again_at_each_connection(tmp_path):
    """What the sighup log line tells the operator: a token rotated on disk
    is sent from the next connection on, without a restart; a file that
    cannot be read then keeps the last good token."""
    from coordinator.security import Security, TokenAuth, hash_token

    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"tokens": {hash_token("old-tok"): {"role": "agent", "name": "old"},
                                             hash_token("new-tok"): {"role": "agent", "name": "new"}}}))
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0"), security=Security(tokens=TokenAuth.from_file(tokens), insecure=True))
    port = await coord.start()
    token_file = tmp_path / "agent.token"
    token_file.write_text("old-tok\n")
    agent = Agent(AgentConfig(node_id="rotating", coordinator=f"127.0.0.1:{port}", token="old-tok", token_file=str(token_file),
                              interval_min_s=0.05, interval_max_s=0.1, backoff_initial_s=0.05, backoff_max_s=0.1),
                  SimBackend(gpus=1, seed=5, node_id="rotating"), seed=5)
    run = asyncio.create_task(agent.run())
    try:
        await until(lambda: agent.connected.is_set(), what="streaming with the old token")
        token_file.write_text("new-tok\n")
        tokens.write_text(json.dumps({"tokens": {hash_token("new-tok"): {"role": "agent", "name": "new"}}}))
        coord.reload_tokens(TokenAuth.from_file(tokens))  # the old token revoked: its stream ends
        await until(lambda: agent.stats.sessions >= 2 and agent.connected.is_set(), what="streaming with the new token")
        assert agent.config.token == "new-tok" and agent.refused is None
        token_file.unlink()
        with capture_logs() as logs:
            agent._refresh_token()
        assert agent.config.token == "new-tok"
        assert [e["event"] for e in logs] == ["token_file_unreadable"]
    finally:
        await agent.stop()
        await asyncio.wait_for(run, 10)
        await coord.stop(grace_s=0.1)


# ---- SIGHUP ---------------------------------------------------------------------------------------------


async def _line_with(stream: asyncio.StreamReader, needle: str, timeout: float, seen: list[str]) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        line = await asyncio.wait_for(stream.readline(), max(0.1, deadline - time.monotonic()))
        if not line:
            raise AssertionError(f"the agent's output ended before {needle!r}: {''.join(seen)[-3000:]}")
        text = line.decode()
        seen.append(text)
        if needle in text:
            return json.loads(text)


async def test_sighup_is_logged_and_the_agent_keeps_streaming():
    """SIGHUP had ended the agent (status 129, no log line, no clean close):
    a clean exit to systemd, so Restart=on-failure left the host silent.
    Now it logs `sighup` (what is read again at each connection; anything
    else needs a restart) and streams on; SIGTERM still stops it, exit 0."""
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0"))
    port = await coord.start()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPULB_", "NOTIFY_SOCKET", "WATCHDOG_"))}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agent.main", "--coordinator", f"127.0.0.1:{port}", "--node-id", "hup-1", "--backend", "sim",
        "--sim-gpus", "1", "--interval-max", "0.2", "--log-format", "json",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, cwd=ROOT, env=env)
    seen: list[str] = []
    try:
        await _line_with(proc.stdout, '"streaming"', 30, seen)
        proc.send_signal(signal.SIGHUP)
        said = await _line_with(proc.stdout, '"sighup"', 10, seen)
        assert said["level"] == "info"
        assert "token" in said["detail"] and "certificate" in said["detail"]
        assert "systemctl restart gpulb-agent" in said["detail"]
        envelopes = coord.view.nodes["hup-1"].envelopes
        await until(lambda: coord.view.nodes["hup-1"].envelopes > envelopes + 3, what="still streaming after SIGHUP")
        assert proc.returncode is None and coord.gateway.sessions.get("hup-1") is not None
        proc.send_signal(signal.SIGTERM)
        rest, _ = await asyncio.wait_for(proc.communicate(), 20)
        assert proc.returncode == 0, "".join(seen) + rest.decode()
        assert '"agent_stopped"' in rest.decode()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await coord.stop(grace_s=0.1)


def test_the_agent_unit_has_no_reload_that_would_do_nothing():
    """A reload that changes nothing would look to `systemctl reload` as
    though it had applied agent.toml; without ExecReload= systemd says
    reload is not applicable, and `reload-or-restart` restarts."""
    text = (ROOT / "systemd" / "gpulb-agent.service").read_text()
    assert not [line for line in text.splitlines() if line.strip().startswith("ExecReload")]


# ---- the coordinator's refusal of an out-of-range reading ---------------------------------------------


async def test_an_out_of_range_reading_is_quoted_as_read_not_as_its_change():
    """util 10 -> 255 on GPU 1: the refusal said "245 % outside 0..100" (the
    delta), a reading the operator will not find anywhere; now 255 %."""
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0"))
    port = await coord.start()
    encoder = TelemetryEncoder([0, 1])
    values = np.tile(np.maximum(LOWER, 1), (2, 1))
    present = np.ones_like(values, dtype=bool)
    util = BY_NAME["util_gpu_pct"]
    values[:, util] = 10
    keyframe, _ = encoder.encode(values.copy(), present, now_s=0.0, sampled_at_ns=1, sample_interval_ms=200)
    values[1, util] = 255
    delta, batch = encoder.encode(values.copy(), present, now_s=0.2, sampled_at_ns=2, sample_interval_ms=200)
    assert not batch.keyframe
    register = pb.AgentMessage(register=pb.Register(
        node_id="hot", backend="sim", gpus=[pb.GpuInfo(index=i, uuid=f"GPU-hot-{i}", model="X", memory_total_mib=1000) for i in range(2)]))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = pb_grpc.AgentGatewayStub(channel).Connect()
            await call.write(register)
            await call.write(pb.AgentMessage(telemetry=keyframe))
            await call.write(pb.AgentMessage(telemetry=delta))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                while (await asyncio.wait_for(call.read(), 10)) is not grpc.aio.EOF:
                    pass
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "GPU 1: 255 % outside 0..100" in info.value.details(), info.value.details()
    finally:
        await coord.stop(grace_s=0.1)


class _Events(SimBackend):
    """A simulated host whose task events the test hands in."""

    def __init__(self) -> None:
        super().__init__(gpus=1, seed=1, workload="idle")
        self.pending: list = []

    def drain_events(self):
        events, self.pending = self.pending, []
        return events


class _Call:
    """A stream's write end that records what is written, or breaks."""

    def __init__(self, broken: bool = False) -> None:
        self.written: list[pb.AgentMessage] = []
        self.broken = broken

    async def write(self, msg: pb.AgentMessage) -> None:
        if self.broken:
            raise grpc.aio.UsageError("the stream is closed")
        self.written.append(msg)


async def test_a_task_event_is_timed_when_it_was_taken_from_the_host_not_when_a_stream_carried_it():
    """QA pass 24 (ops): an event was stamped at_ns when it was written, and
    events wait while the coordinator is away, so a task that ended 3 s into
    a 20 s outage was recorded (and learned) as running 25.9 s. Events are
    taken from the backend at every round, away or not, stamped then, and
    kept until a stream has written them."""
    from agent.sim import SimTaskEvent

    wall = [1_000_000_000_000]
    backend = _Events()
    agent = Agent(AgentConfig(node_id="ev", coordinator="127.0.0.1:1"), backend, wall_ns=lambda: wall[0])
    backend.pending.append(SimTaskEvent("t1", "finished", "after 3 s"))
    agent._collect_task_events()  # a round while the coordinator is away
    wall[0] += 20 * 10**9  # the outage goes on

    with pytest.raises(grpc.aio.UsageError):
        await agent._send_task_events(_Call(broken=True))  # a stream that breaks: nothing is lost
    call = _Call()
    await agent._send_task_events(call)
    assert [(m.task_event.task_id, m.task_event.at_ns) for m in call.written] == [("t1", 1_000_000_000_000)]
    await agent._send_task_events(call)
    assert len(call.written) == 1  # sent once
