"""The agent's run loop: sample, encode, stream; reconnect when the stream breaks.

One long-lived bidirectional gRPC stream per host carries registration,
telemetry envelopes, heartbeats and task events up, and acks, resync requests,
sampling hints and task placements down. A broken stream is retried with
jittered exponential backoff, and every new stream starts with a keyframe.

A registration the coordinator refuses is not retried blindly: INVALID_ARGUMENT,
UNAUTHENTICATED or PERMISSION_DENIED before the RegisterAck (a bad node id or
label, a wrong token or certificate) end ``run`` with ``refused`` set, since
retrying cannot fix them; ALREADY_EXISTS (the node id or a GPU is held by
another live agent) and INVALID_ARGUMENT about the GPUs themselves (what NVML
reads of a GPU that fell off the bus, or before the driver is up: hardware
can recover) are logged as errors each time and retried with the backoff
growing to its cap; the GPUs are read once, at start, so after
``HARDWARE_RETRIES`` such refusals ``run`` returns with ``reread_wanted`` set
and the agent exits for a new process to read them again.

While a round is being sampled (an NVML call can hang for tens of seconds on
a wedged driver) the stream still heartbeats on schedule: the round runs as a
task of its own, and the node stays alive to the coordinator. While no stream
is registered (connecting, registering, waiting out the backoff) rounds are
sampled into the outage buffer, sent first on the next stream. A stream that
is silently dead (a network partition, the coordinator's host gone) is found
by gRPC keepalive pings and by the coordinator's acks: an envelope that the
coordinator owes an ack for and that none follows within the heartbeat
timeout ends the stream, and the agent reconnects.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections import deque
import socket
import time
from dataclasses import dataclass, field
from typing import Callable

import grpc
import numpy as np
import structlog

from agent.backend import GpuBackend, GpuProcess, InventoryChanged, driver_version_of
from agent.sampler import AdaptiveInterval
from agent.telemetry import movement, process_lists, register_message, samples_to_matrix
from protos.runtime import release
from protos import telemetry_pb2 as pb
from protos import telemetry_pb2_grpc as pb_grpc
from protos.codec import DEADBANDS, TelemetryEncoder

__all__ = ["AgentConfig", "Agent", "AgentStats", "Backoff", "AGENT_VERSION", "FATAL_AT_REGISTRATION"]

AGENT_VERSION = release()  # the package version, and its commit when run from a checkout
log = structlog.get_logger("gpulb.agent")

# host IO deadbands: 1 ms of await, 1 % of busy time
_AWAIT_DEADBAND_US = 1000
_UTIL_DEADBAND_PERMILLE = 10


@dataclass
class AgentConfig:
    node_id: str
    coordinator: str = "127.0.0.1:50051"
    labels: dict[str, str] = field(default_factory=dict)
    interval_min_s: float = 0.2
    interval_max_s: float = 2.0
    heartbeat_interval_s: float = 10.0
    keyframe_interval_s: float = 30.0
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    hostname: str = field(default_factory=socket.gethostname)
    #: sampling rounds kept while the coordinator is unreachable (oldest dropped first)
    outage_buffer_rounds: int = 300
    #: TLS: CA to trust, and the agent's client certificate and key (mutual TLS)
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    #: bearer token (agent role), when the coordinator authenticates agents by token
    token: str = ""
    #: the file ``token`` was read from: read again at each connection (a
    #: rotated token is taken without a restart; one that cannot be read
    #: leaves the last good token in use)
    token_file: str = ""


@dataclass
class AgentStats:
    envelopes: int = 0
    bytes_sent: int = 0
    keyframes: int = 0
    heartbeats: int = 0
    sessions: int = 0
    resyncs_requested: int = 0
    samples: int = 0
    buffered_rounds: int = 0  # rounds sampled while disconnected, sent on reconnect
    dropped_rounds: int = 0  # rounds dropped because the outage buffer was full
    task_events_dropped: int = 0  # task events dropped because TASK_EVENTS_KEPT waited unsent
    last_error: str = ""  # status of the last stream that ended with an error


class Backoff:
    """Equal-jitter exponential backoff: with bound = min(cap, base * 2**n),
    the n-th wait (n from 0, back to 0 on ``reset``) is uniform in
    [bound / 2, bound]. The random half spreads the agents, so a restarted
    coordinator is not hit by every agent at the same instant; the fixed
    half keeps a wait from coming out near zero, so an agent does not retry
    a coordinator that is down in a tight loop. Once at the cap, a wait is
    cap / 2 to cap (15-30 s with the defaults), however short the outage
    that preceded it."""

    def __init__(self, base_s: float, cap_s: float, rng: random.Random) -> None:
        self.base_s, self.cap_s, self.rng = base_s, cap_s, rng
        self.attempt = 0

    def next_delay(self) -> float:
        bound = min(self.cap_s, self.base_s * (2**self.attempt))
        self.attempt += 1
        return self.rng.uniform(bound / 2, bound)

    def reset(self) -> None:
        self.attempt = 0


class _SessionEnded(Exception):
    pass


_REGISTER_TIMEOUT_S = 10.0

#: task events kept unsent while the coordinator is away (each is one
#: task's start or end: a host runs far fewer at once)
TASK_EVENTS_KEPT = 10_000

#: gRPC keepalive of the agent's channel (plaintext and TLS alike): a ping
#: once nothing came from the coordinator for 10 s, the connection dropped
#: when its answer takes over 5 s, so a silently dead connection (a partition, the coordinator's host
#: gone) ends within about 15 s rather than when TCP gives up (~15 min). The
#: coordinator lets pings through down to 10 s apart
#: (``grpc.http2.min_recv_ping_interval_without_data_ms``, coordinator/server.py);
#: more often and it would end the connection with GOAWAY too_many_pings.
#: grpcio 1.85 waits for a keepalive ping's answer for the ping timeout
#: (``ping_timeout_ms``, 1 min by default), not ``keepalive_timeout_ms``, so
#: both are set: the connection then ends "Stream removed (ping timeout)".
KEEPALIVE_OPTIONS = (
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.ping_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
)

#: the coordinator acks an applied envelope at most this often per stream
#: (coordinator.gateway._ACK_EVERY_S, held equal by a test): an envelope
#: sent at least this long after the last ack arrived is owed one at once
COORDINATOR_ACK_EVERY_S = 5.0
#: the coordinator's heartbeat timeout is its heartbeat interval plus a grace
#: (1 s): an owed ack missing that long ends the stream (never under the floor)
_ACK_GRACE_S = 1.0
_ACK_TIMEOUT_FLOOR_S = 2.0

#: statuses of a refused registration that retrying cannot fix: the agent stops
FATAL_AT_REGISTRATION = {
    grpc.StatusCode.INVALID_ARGUMENT: "fix the option the coordinator names (flags or --config) and restart the agent",
    grpc.StatusCode.UNAUTHENTICATED: "give the agent a valid credential: --token-file with an agent token, or --cert-file/--key-file",
    grpc.StatusCode.PERMISSION_DENIED: "the credential does not allow this node id: the certificate's CN or SAN, or the token, must be this node's",
}


#: refusals of what the GPUs read as (``_from_hardware``) in a row before the
#: agent stops so that a new process reads them again (gpulb-agent exits 75)
HARDWARE_RETRIES = 5


def _from_hardware(code: grpc.StatusCode, detail: str) -> bool:
    """An INVALID_ARGUMENT about what NVML reported of the GPUs (a GPU that
    fell off the bus reads as uuid "" and 0 MiB, NVML not ready at boot, a
    topology link to it): the hardware may recover, so the agent retries,
    logging it, rather than exit for good as for its own configuration."""
    return code == grpc.StatusCode.INVALID_ARGUMENT and detail.startswith(("register.gpus", "register.topology"))


def _conflict_hint(detail: str) -> str:
    """What to do about a refusal that is retried, by the field it names."""
    if detail.startswith(("register.gpus", "register.topology")) and "held by node" not in detail:
        return ("a GPU of this host reads wrong through NVML (an unreadable GPU lists as uuid '' and 0 MiB): check "
                "nvidia-smi and the kernel log for Xid errors; the agent registers once it reads right")
    if detail.startswith("register.node_id"):
        return ("another agent is streaming under this node id: give each host its own --node-id / node_id, "
                "or stop the other agent; a restarted agent takes over once the old stream closes or goes silent")
    return ("a GPU of this host is registered by another node: this host under another node id (a renamed node keeps its "
            "GPUs until it is removed after its missed heartbeats), or two agents on one host; stop the other agent")


async def _reader_status(reader: asyncio.Task) -> grpc.aio.AioRpcError | None:
    try:
        await asyncio.wait_for(asyncio.shield(reader), timeout=1.0)
    except grpc.aio.AioRpcError as exc:
        return exc
    except (asyncio.TimeoutError, asyncio.CancelledError, Exception):
        return None
    return None


class Agent:
    """Streams one host's GPU telemetry to the coordinator until stopped."""

    def __init__(
        self,
        config: AgentConfig,
        backend: GpuBackend,
        *,
        io_monitor=None,
        clock: Callable[[], float] = time.monotonic,
        wall_ns: Callable[[], int] = time.time_ns,
        channel_factory: Callable[[str], grpc.aio.Channel] | None = None,
        seed: int | None = None,
    ) -> None:
        self.config = config
        self.backend = backend
        self.io_monitor = io_monitor
        self.clock = clock
        self.wall_ns = wall_ns
        self._channel_factory = channel_factory or self._default_channel
        self._call_metadata = self._metadata()
        self._outage: deque = deque(maxlen=max(1, config.outage_buffer_rounds))
        self._rng = random.Random(seed)
        self.session_id = self._rng.getrandbits(63)
        self.inventory = backend.inventory()
        self.gpu_order = [info.index for info in self.inventory]
        self.topology = backend.topology()
        self.encoder = TelemetryEncoder(self.gpu_order, keyframe_interval_s=config.keyframe_interval_s)
        self.sampler = AdaptiveInterval(config.interval_min_s, config.interval_max_s)
        self.stats = AgentStats()
        #: (status code name, detail) when the coordinator refused the
        #: registration for good (FATAL_AT_REGISTRATION); ``run`` then returned
        self.refused: tuple[str, str] | None = None
        #: (status code name, detail) when ``run`` returned because the GPUs
        #: read wrong HARDWARE_RETRIES times in a row: the backend reads them
        #: once, at start, so only a new process (systemd's restart) reads again
        self.reread_wanted: tuple[str, str] | None = None
        self.connected = asyncio.Event()
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()
        self._previous: np.ndarray | None = None
        self._sent_processes: dict[int, tuple[GpuProcess, ...]] = {}
        self._sent_host_io: tuple[int | None, int | None] | None = None
        self._last_ack = 0
        #: clock() when the last ack arrived, and when an envelope went out
        #: that the coordinator owes an ack for (None: none owed)
        self._last_ack_at = -math.inf
        self._ack_owed_since: float | None = None
        #: the backend read in progress (``_sampling``), shared by the stream
        #: and the outage sampler: never two reads at once
        self._inflight: asyncio.Future | None = None
        #: (wall ns when taken from the backend, event) not written yet: kept
        #: across a stream's end and sent on the next one, with that time
        self._task_events: deque = deque(maxlen=TASK_EVENTS_KEPT)
        self._log = log.bind(node_id=config.node_id)

    def _metadata(self):
        cfg = self.config
        if cfg.token and not (cfg.ca_file or cfg.cert_file):
            # plaintext with a token: only against a coordinator in insecure mode
            from coordinator.security import bearer_metadata

            return bearer_metadata(cfg.token)
        return None

    def _refresh_token(self) -> None:
        """Read the token file again before a connection, so that a token
        rotated on disk is sent from the next connection on; one that cannot
        be read (or holds no token) is logged and the last good one kept."""
        cfg = self.config
        if not cfg.token_file:
            return
        from coordinator.security import read_token_file

        try:
            token = read_token_file(cfg.token_file)
        except (OSError, ValueError) as exc:  # UnicodeDecodeError, SecurityConfigError
            self._log.error("token_file_unreadable", path=cfg.token_file, error=str(exc),
                            detail="connecting with the token read before")
            return
        if token != cfg.token:
            self._log.info("token_file_changed", path=cfg.token_file)
            cfg.token = token
        self._call_metadata = self._metadata()

    def _default_channel(self, target: str) -> grpc.aio.Channel:
        cfg = self.config
        if cfg.ca_file or cfg.cert_file:
            from coordinator.security import SecurityConfigError, channel_credentials, check_client_credentials

            # gpulb-agent checked them at start; a certificate can expire (or be
            # replaced by a wrong one) while the agent runs, and the handshake
            # would then say only "Socket closed": say why on every reconnect
            try:
                check_client_credentials(cfg.ca_file or None, cfg.cert_file or None, cfg.key_file or None,
                                         options=("ca_file", "cert_file", "key_file"))
            except SecurityConfigError as exc:
                self._log.error("tls_credentials_unusable", error=str(exc), detail="the coordinator will refuse this connection")
            creds = channel_credentials(cfg.ca_file or None, cfg.cert_file or None, cfg.key_file or None, cfg.token or None)
            return grpc.aio.secure_channel(target, creds, options=list(KEEPALIVE_OPTIONS))
        return grpc.aio.insecure_channel(target, options=list(KEEPALIVE_OPTIONS))

    @property
    def outage_buffer_len(self) -> int:
        return len(self._outage)

    # ---- lifecycle -------------------------------------------------------
    async def run(self) -> None:
        away = asyncio.create_task(self._sample_while_away())
        try:
            await self._reconnecting()
        finally:
            away.cancel()
            await asyncio.gather(away, return_exceptions=True)
            # the caller closes the backend next (gpulb-agent): no read of it
            # may still be going on in a thread then
            inflight = self._inflight
            if inflight is not None and not inflight.done():
                await asyncio.wait({inflight})

    async def _reconnecting(self) -> None:
        backoff = Backoff(self.config.backoff_initial_s, self.config.backoff_max_s, self._rng)
        hardware_refusals = 0
        while not self._stop.is_set():
            conflict = None
            try:
                await self._session(backoff)
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as exc:
                code, detail = exc.code(), exc.details() or ""
                self.stats.last_error = f"{code.name}: {detail}"
                registered = self.connected.is_set()  # the coordinator had accepted this stream
                if registered:
                    hardware_refusals = 0  # the GPUs read right last time
                if not registered and code in FATAL_AT_REGISTRATION and not _from_hardware(code, detail):
                    self.refused = (code.name, detail)
                    self._log.error("registration_refused", code=code.name, detail=detail,
                                    fix=FATAL_AT_REGISTRATION[code], retrying=False)
                    break
                if not registered and _from_hardware(code, detail):
                    hardware_refusals += 1
                    if hardware_refusals >= HARDWARE_RETRIES:
                        self.reread_wanted = (code.name, detail)
                        self._log.error("registration_refused", code=code.name, detail=detail,
                                        fix=_conflict_hint(detail), retrying=False, reread="a new agent process")
                        break
                if not registered and (code == grpc.StatusCode.ALREADY_EXISTS or _from_hardware(code, detail)):
                    conflict = (code.name, detail)
                else:
                    self._log.warning("stream_ended", code=code.name, detail=detail)
            except _SessionEnded as exc:
                self._log.warning("stream_ended", reason=str(exc))
            except Exception:  # never let one bad round kill the daemon
                self._log.exception("session_failed")
            finally:
                self.connected.clear()
            if self._stop.is_set():
                break
            # A refused registration never streamed, so the backoff was not
            # reset: a conflict is retried ever more slowly, up to the cap.
            delay = backoff.next_delay()
            if conflict is not None:
                self._log.error("registration_refused", code=conflict[0], detail=conflict[1], fix=_conflict_hint(conflict[1]),
                                retrying=True, in_s=round(delay, 2), attempt=backoff.attempt)
            else:
                self._log.info("reconnecting", in_s=round(delay, 2), attempt=backoff.attempt, buffered=len(self._outage))
            await self._stopped_within(delay)

    async def _stopped_within(self, seconds: float) -> bool:
        """Wait ``seconds`` or until stopped; True when stopped."""
        try:
            await asyncio.wait_for(self._stop.wait(), timeout=max(0.0, seconds))
        except asyncio.TimeoutError:
            pass
        return self._stop.is_set()

    def _sampling(self) -> asyncio.Future:
        """The backend read in progress, else a new one. One read at a time:
        a round a stream left behind (it ended while NVML hung) is taken over
        by the outage sampler, and the outage sampler's by the next stream's
        first round, rather than a second thread reading alongside the first.
        Await it through ``asyncio.shield`` or ``asyncio.wait``: it is never
        cancelled, so that it says when the read is over."""
        if self._inflight is None or self._inflight.done():
            self._inflight = asyncio.ensure_future(self._read_backend())
            # a failure no one waited for is not "never retrieved"
            self._inflight.add_done_callback(lambda f: f.cancelled() or f.exception())
        return self._inflight

    async def _read_backend(self) -> list | None:
        """A round's samples; None once the host's GPUs are no longer the
        ones registered (``InventoryChanged``): ``run`` then returns with
        ``reread_wanted`` set and ``gpulb-agent`` exits 75, having logged
        why and closed its stream and backend as at any stop."""
        try:
            if self.backend.name == "nvml":
                # NVML calls block for up to milliseconds per GPU (and hang on a
                # wedged driver); keep the loop free.
                return await asyncio.to_thread(self.backend.sample)
            return self.backend.sample()
        except InventoryChanged as exc:
            if self.reread_wanted is None:
                self.reread_wanted = ("GPU_INVENTORY_CHANGED", str(exc))
            self._stop.set()
            self._wake.set()
            return None

    async def _sample_while_away(self) -> None:
        """Runs as long as ``run``: while no stream is registered (the agent
        connecting, waiting for the registration's ack, or waiting out its
        backoff), a round every ``interval_max`` into a bounded buffer sent
        first on the next stream (oldest rounds dropped first, and counted).
        A round that ends after a stream registered meanwhile is not kept:
        the buffer went out already, and the stream reads on live."""
        while not await self._stopped_within(self.config.interval_max_s):
            if self.connected.is_set():
                continue
            now = self.clock()
            try:
                samples = await asyncio.shield(self._sampling())
            except asyncio.CancelledError:
                raise
            except Exception:
                self._log.exception("sample_failed")
                continue
            self._collect_task_events()
            if samples and not self.connected.is_set():
                values, present = samples_to_matrix(samples, self.gpu_order)
                if len(self._outage) == self._outage.maxlen:
                    self.stats.dropped_rounds += 1
                self._outage.append((now, self.wall_ns(), values, present))
                self.stats.buffered_rounds += 1

    async def _send_outage_buffer(self, call) -> None:
        """The rounds sampled while away, oldest first: a keyframe, then deltas."""
        while self._outage:
            at, wall_ns, values, present = self._outage.popleft()
            env, batch = self.encoder.encode(values, present, now_s=at, sampled_at_ns=wall_ns, skip_empty=True)
            if env is None:
                continue
            msg = pb.AgentMessage(telemetry=env)
            self._envelope_sent()
            await call.write(msg)
            self.stats.envelopes += 1
            self.stats.bytes_sent += msg.ByteSize()
            self.stats.keyframes += int(batch.keyframe)

    def _envelope_sent(self) -> None:
        """Before an envelope is written: the coordinator acks the first
        envelope it applies at least ``COORDINATOR_ACK_EVERY_S`` after its
        last ack, so one sent that long after the last ack arrived is owed
        an ack (``_watch_acks``)."""
        now = self.clock()
        if self._ack_owed_since is None and now - self._last_ack_at >= COORDINATOR_ACK_EVERY_S:
            self._ack_owed_since = now

    def ack_timeout_s(self) -> float:
        """How long an owed ack may be missing before the stream is taken
        for dead: the heartbeat timeout (the coordinator's heartbeat
        interval, which it sends, plus its grace)."""
        return max(_ACK_TIMEOUT_FLOOR_S, self.config.heartbeat_interval_s + _ACK_GRACE_S)

    async def _watch_acks(self) -> str:
        """Returns (why) once an owed ack is missing past ``ack_timeout_s``:
        the connection is silently dead (packets vanish: a partition, the
        coordinator's host lost power), though writes into it still succeed
        until TCP gives up, ~15 min on Linux. Heartbeats are not acked, so a
        stream that sends only heartbeats (a round that hangs) owes none."""
        while True:
            timeout = self.ack_timeout_s()
            owed = self._ack_owed_since
            waited = 0.0 if owed is None else self.clock() - owed
            if waited >= timeout:
                return (f"no ack from the coordinator {waited:.1f} s after an envelope it acks (bound {timeout:g} s, "
                        f"the heartbeat timeout): the connection is taken for dead (a network partition, or the "
                        f"coordinator's host gone)")
            await asyncio.sleep(min(1.0, timeout - waited))

    async def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    # ---- one stream ------------------------------------------------------
    async def _session(self, backoff: Backoff) -> None:
        cfg = self.config
        self._refresh_token()
        async with self._channel_factory(cfg.coordinator) as channel:
            stub = pb_grpc.AgentGatewayStub(channel)
            call = stub.Connect(metadata=self._call_metadata)
            self.stats.sessions += 1
            self.encoder.restart_stream()
            self._sent_processes.clear()
            self._sent_host_io = None
            self._last_ack_at, self._ack_owed_since = -math.inf, None  # the stream's first envelope is acked
            register = register_message(
                node_id=cfg.node_id,
                hostname=cfg.hostname,
                backend=self.backend.name,
                inventory=self.inventory,
                topology=self.topology,
                labels=cfg.labels,
                session_id=self.session_id,
                version=AGENT_VERSION,
                interval_min_ms=int(cfg.interval_min_s * 1000),
                interval_max_ms=int(cfg.interval_max_s * 1000),
                driver_version=driver_version_of(self.backend),
                running_task_ids=self._running_task_ids(),
            )
            # The write waits for the connection (gRPC gives a coordinator
            # that accepts TCP but says nothing 20 s): a stop does not.
            stopped = asyncio.ensure_future(self._stop.wait())
            writing = asyncio.ensure_future(call.write(pb.AgentMessage(register=register)))
            try:
                await asyncio.wait({writing, stopped}, return_when=asyncio.FIRST_COMPLETED)
                if not writing.done():
                    writing.cancel()
                    await asyncio.gather(writing, return_exceptions=True)
                    call.cancel()
                    return  # stopped while connecting
                writing.result()
            finally:
                writing.cancel()
                stopped.cancel()
            reader = asyncio.create_task(self._read_loop(call))
            try:
                # Stream nothing until the coordinator accepted the registration:
                # a refused stream then ends with the coordinator's status, not a
                # local error from writing into a closed stream.
                accepted = asyncio.create_task(self.connected.wait())
                stopped = asyncio.ensure_future(self._stop.wait())
                await asyncio.wait({accepted, reader, stopped}, timeout=_REGISTER_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
                accepted.cancel()
                stopped.cancel()
                if self._stop.is_set() and not self.connected.is_set() and not reader.done():
                    return  # stopped while waiting for the registration's ack
                if reader.done():
                    reader.result()  # raises the coordinator's status
                    raise _SessionEnded("coordinator closed the stream before accepting the registration")
                if not self.connected.is_set():
                    raise _SessionEnded(f"no registration ack within {_REGISTER_TIMEOUT_S:g} s")
                # The stream, watched for acks: a write into a dead connection
                # can block for good (HTTP/2 flow control), so the watch is a
                # task of its own that ends the stream from outside.
                streaming = asyncio.create_task(self._stream(call, reader, backoff))
                watch = asyncio.create_task(self._watch_acks())
                try:
                    done, _ = await asyncio.wait({streaming, watch}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    watch.cancel()
                    streaming.cancel()
                    await asyncio.gather(streaming, watch, return_exceptions=True)
                if streaming in done:
                    streaming.result()  # raises the stream's error
                else:
                    raise _SessionEnded(watch.result())
            except grpc.aio.AioRpcError as exc:
                # A write into a stream the coordinator already closed fails
                # locally (INTERNAL); the reader sees the coordinator's real status.
                real = await _reader_status(reader)
                raise (real or exc) from None
            finally:
                reader.cancel()
                try:
                    await reader
                except (asyncio.CancelledError, grpc.aio.AioRpcError, _SessionEnded):
                    pass
                call.cancel()

    async def _stream(self, call, reader: asyncio.Task, backoff: Backoff) -> None:
        """A registered stream until stopped or broken: the outage buffer,
        then a round per sampling period and a heartbeat whenever nothing
        else went out for the heartbeat interval. A round is sampled in a
        task of its own (``_sampling``), and heartbeats and task events go
        out while it is in flight: an NVML call that hangs for a minute
        leaves the node's readings stale, but the node alive and its tasks
        leased, not declared lost and placed a second time."""
        cfg = self.config
        if self._outage:
            self._log.info("sending_outage_buffer", rounds=len(self._outage), dropped=self.stats.dropped_rounds)
            await self._send_outage_buffer(call)
        first = True
        last_sent = self.clock()
        next_round = last_sent  # the first round at once
        woken = False
        sampling: asyncio.Future | None = None  # this stream's round being read
        round_at = 0.0
        while not self._stop.is_set():
            if reader.done():
                reader.result()  # raises the stream's error
                raise _SessionEnded("coordinator closed the stream")
            now = self.clock()
            # A wake (a resync request, a hint, a reload's ack) while a round
            # is in flight is served by that round: it is encoded after.
            if sampling is None and (woken or now >= next_round):
                sampling, round_at = self._sampling(), now
            if sampling is not None and sampling.done():
                samples = sampling.result()  # the backend's error ends the stream, as it always did
                sampling = None
                if samples is None:
                    continue  # the GPUs changed: the agent stops (reread_wanted)
                sent = await self._send_round(call, round_at, samples)
                next_round = round_at + self._period
                if first and self.connected.is_set():
                    first = False
                    backoff.reset()
                    self._log.info("streaming", coordinator=cfg.coordinator, gpus=len(self.gpu_order))
                if sent:
                    last_sent = self.clock()
            now = self.clock()
            if now - last_sent >= cfg.heartbeat_interval_s:
                await call.write(
                    pb.AgentMessage(heartbeat=pb.Heartbeat(sent_at_ns=self.wall_ns(), last_seq=self.encoder.seq))
                )
                self.stats.heartbeats += 1
                last_sent = now
            await self._send_task_events(call)
            self._wake.clear()
            # until the next heartbeat, the next round (none while one is in
            # flight: until it ends), a wake, or the stream's end: a sampling
            # period above the heartbeat interval (interval_max may be 60 s),
            # or a round that hangs, had left the node UNREACHABLE
            due = last_sent + cfg.heartbeat_interval_s
            if sampling is None:
                due = min(due, next_round)
            woken = await self._wait(due - self.clock(), reader, sampling)
        await call.done_writing()

    async def _wait(self, timeout_s: float, *futures: asyncio.Future | None) -> bool:
        """Until ``timeout_s`` passed, one of ``futures`` is done (never
        cancelling them) or the loop is woken; True when woken."""
        wake = asyncio.ensure_future(self._wake.wait())
        try:
            await asyncio.wait({wake, *(f for f in futures if f is not None)}, timeout=max(0.0, timeout_s),
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            wake.cancel()
        return self._wake.is_set()

    _period: float = 2.0

    async def _send_round(self, call, now: float, samples) -> bool:
        """Encode and send one round sampled from ``now``; True when an envelope went out."""
        self.stats.samples += len(samples)
        values, present = samples_to_matrix(samples, self.gpu_order)
        keyframe = self.encoder.keyframe_due(now)
        host_io = self._host_io(keyframe)
        processes = self._changed_processes(samples, keyframe)
        moved = movement(self._previous, values, present, DEADBANDS)
        self._previous = values
        self._period = self.sampler.next(moved, now)
        env, batch = self.encoder.encode(
            values,
            present,
            now_s=now,
            sampled_at_ns=self.wall_ns(),
            host_io=host_io,
            processes=processes,
            sample_interval_ms=int(self._period * 1000),
            skip_empty=True,
        )
        if env is None:
            return False
        msg = pb.AgentMessage(telemetry=env)
        self._envelope_sent()
        await call.write(msg)
        self.stats.envelopes += 1
        self.stats.bytes_sent += msg.ByteSize()
        self.stats.keyframes += int(batch.keyframe)
        return True

    def _host_io(self, keyframe: bool) -> pb.HostIo | None:
        if self.io_monitor is None:
            return None
        sample = self.io_monitor.sample()
        current = (sample.disk_await_us, sample.disk_util_permille)
        previous = self._sent_host_io
        if not keyframe and previous is not None:
            def moved(new, old, band):
                if new is None or old is None:
                    return new != old
                return abs(new - old) >= band
            if not (moved(current[0], previous[0], _AWAIT_DEADBAND_US) or moved(current[1], previous[1], _UTIL_DEADBAND_PERMILLE)):
                return None
        self._sent_host_io = current
        msg = pb.HostIo()
        if current[0] is not None:
            msg.disk_await_us = int(current[0])
        if current[1] is not None:
            msg.disk_util_permille = int(current[1])
        return msg

    def _changed_processes(self, samples, keyframe: bool) -> list[pb.GpuProcesses]:
        out = []
        for index, procs in process_lists(samples).items():
            if keyframe or self._sent_processes.get(index) != procs:
                self._sent_processes[index] = procs
                out.append(
                    pb.GpuProcesses(
                        gpu_index=index,
                        processes=[pb.GpuProcess(pid=p.pid, used_memory_mib=p.used_memory_mib) for p in procs],
                    )
                )
        return out

    def _collect_task_events(self) -> None:
        """Take the backend's task events, each stamped with the wall time now
        (within a round of when it happened), whether or not a stream is up:
        the coordinator times a task's start and end by it (``at_ns``), so a
        task that ended during an outage is not recorded as ending at the
        reconnect, its run time stretched by the outage (QA pass 24)."""
        drain = getattr(self.backend, "drain_events", None)
        if drain is None:
            return
        events = drain()
        if not events:
            return
        now_ns = self.wall_ns()
        for event in events:
            if len(self._task_events) == self._task_events.maxlen:
                self.stats.task_events_dropped += 1
            self._task_events.append((now_ns, event))

    _EVENT_KINDS = {
        "started": pb.TASK_EVENT_KIND_STARTED,
        "finished": pb.TASK_EVENT_KIND_FINISHED,
        "failed": pb.TASK_EVENT_KIND_FAILED,
        "oom_killed": pb.TASK_EVENT_KIND_OOM_KILLED,
    }

    async def _send_task_events(self, call) -> None:
        """Write the task events not sent yet, oldest first; one is dropped
        from the queue only once written, so a stream that breaks mid-way
        loses none (the next stream sends them)."""
        self._collect_task_events()
        while self._task_events:
            at_ns, event = self._task_events[0]
            await call.write(
                pb.AgentMessage(
                    task_event=pb.TaskEvent(
                        task_id=event.task_id,
                        kind=self._EVENT_KINDS.get(event.kind, pb.TASK_EVENT_KIND_UNSPECIFIED),
                        at_ns=at_ns,
                        detail=event.detail,
                        peak_vram_mib=getattr(event, "peak_vram_mib", 0.0),
                    )
                )
            )
            self._task_events.popleft()

    def _running_task_ids(self) -> list[str]:
        """Tasks the backend runs for the coordinator (a simulated host), for
        the registration; none for a backend that runs no tasks itself."""
        running = getattr(self.backend, "running_task_ids", None)
        return list(running()) if running is not None else []

    async def _read_loop(self, call) -> None:
        async for msg in call:
            body = msg.WhichOneof("body")
            if body == "ack":
                self._last_ack = msg.ack.seq
                self._last_ack_at, self._ack_owed_since = self.clock(), None
            elif body == "resync":
                # an answer to an envelope too: the coordinator reads the stream
                self._ack_owed_since = None
                self.stats.resyncs_requested += 1
                self._log.info("keyframe_requested", expected_seq=msg.resync.expected_seq, reason=msg.resync.reason)
                self.encoder.request_keyframe()
                self._wake.set()
            elif body == "sampling_hint":
                hint = msg.sampling_hint
                self.sampler.hint(hint.interval_ms / 1000, hint.duration_ms / 1000, self.clock())
                self._period = min(self._period, hint.interval_ms / 1000)
                self._wake.set()
            elif body == "register_ack":
                # The coordinator accepted this node's identity and registration.
                self.connected.set()
                ack = msg.register_ack
                if ack.keyframe_interval_ms:
                    self.encoder.keyframe_interval_s = ack.keyframe_interval_ms / 1000
                if ack.heartbeat_interval_ms:
                    self.config.heartbeat_interval_s = ack.heartbeat_interval_ms / 1000
                if ack.refresh_interval_ms:
                    self.encoder.refresh_interval_s = ack.refresh_interval_ms / 1000
                # One comes again when a reload changes the intervals: a round
                # now sends the refresh or heartbeat the new ones make due,
                # rather than after the rest of a wait timed by the old ones.
                self._wake.set()
            elif body == "place":
                place = getattr(self.backend, "place", None)
                p = msg.place
                if place is not None:
                    place(p.task_id, list(p.gpu_index), p.vram_mib, p.gpu_share, p.duration_s, p.kind)
                self._log.info("task_placed", task_id=p.task_id, gpus=list(p.gpu_index))
                self._wake.set()
            elif body == "release":
                release = getattr(self.backend, "release", None)
                if release is not None:
                    release(msg.release.task_id)
                self._wake.set()
