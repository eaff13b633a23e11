"""The agent gateway: the servicer end of each agent's telemetry stream.

One coroutine per stream reads the agent's messages and applies them to the
view; a writer drains the stream's outbox. Bad input ends only that stream,
with a status that names the field; every other stream keeps flowing and
nothing already applied is touched.

The outbox has two parts. What the agent must act on - task placements and
releases, and RegisterAcks - is never dropped: a ScheduleTasks call of 1,000
tasks for one host queues 1,000 placements at once, and each that went
missing would be a lease whose task never runs. Their number is bounded by
the node's leases (a place and a release per lease), and by time: an agent
that leaves a message unwritten past the heartbeat timeout is not reading its
stream, and the stream is closed (RESOURCE_EXHAUSTED) so that it reconnects
and ``Dispatcher.reconcile_node`` sets its tasks right. What only helps -
Acks, resync requests (asked again after 2 s), sampling hints (an identical
one waiting already covers a new one) - is kept up to ``CHATTER_KEPT`` and
dropped past that, counted and logged.

A node id is held by one agent at a time. A second stream for a connected node
id wins, and the older one is closed with ABORTED, when it comes from the same
agent instance (``Register.session_id``: the agent reconnected) or when the
older stream has been silent past the heartbeat timeout (a restarted agent
whose old stream the coordinator has not seen die). A different instance
while the older stream is alive is refused with ALREADY_EXISTS: two agents
with one node id would otherwise take the node from each other forever. A GPU
uuid another node holds is refused the same way.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import grpc
import structlog

from coordinator.view import RegistrationConflict, RegistrationError, validate_register
from protos import telemetry_pb2 as pb
from protos import telemetry_pb2_grpc as pb_grpc
from protos.codec import CodecError, CorruptEnvelope, DecodeOutcome, InvalidReading, PayloadTooLarge
from scheduler.task import MAX_REASON_LEN, MAX_TASK_ID_LEN

if TYPE_CHECKING:
    from coordinator.server import Coordinator

__all__ = ["AgentGateway", "AgentSession", "StreamRefused"]

log = structlog.get_logger("gpulb.gateway")

#: how long to wait for a requested keyframe before asking again
_RESYNC_RETRY_S = 2.0
#: how long closing a stream waits for its status to go out: a reading agent
#: takes it at once; one that does not read has it wait behind what it left
#: unread, and its stream ends without waiting longer
_ABORT_WAIT_S = 2.0
#: send an Ack at most this often per stream (each write costs the loop ~60 us)
_ACK_EVERY_S = 5.0
#: messages the agent must act on, never dropped (AgentSession.send)
CONTROL_BODIES = frozenset({"register_ack", "place", "release"})
#: Acks, resync requests and sampling hints a stream may have waiting; past
#: this they are dropped: an Ack every 5 s, a resync request every 2 s and a
#: hint per distinct interval fill it only when the agent stopped reading
CHATTER_KEPT = 256
#: TaskEvent.detail: free text for humans, logged with the event (the
#: bound of CancelTaskRequest.reason, the other free text about a task)
MAX_EVENT_DETAIL = MAX_REASON_LEN


def register_ack(config) -> pb.CoordinatorMessage:
    """The intervals an agent runs by, from the coordinator's configuration
    (``heartbeat_interval_s``, ``keyframe_interval_s``, ``staleness_s``): sent
    when a stream registers and again on every open stream when a reload
    changes one (``AgentGateway.send_register_acks``), so that what agents do
    and the deadlines the coordinator holds them to come from one place."""
    return pb.CoordinatorMessage(
        register_ack=pb.RegisterAck(
            heartbeat_interval_ms=int(config.heartbeat_interval_s * 1000),
            keyframe_interval_ms=int(config.keyframe_interval_s * 1000),
            # twice per staleness bound, so one late envelope is not "stale"
            refresh_interval_ms=max(100, int(config.staleness_s * 500)),
        )
    )


async def _cancel(task: asyncio.Task | None) -> None:
    if task is None or task.done():
        return
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass


async def _finish_writer(writer: asyncio.Task | None, session: AgentSession | None) -> None:
    """Stop the writer *between* writes before the call is aborted: cancelling
    it mid-write leaves the write running in gRPC's core, and an abort then
    fails (too many operations) and the agent gets no status at all."""
    if writer is None or writer.done() or session is None:
        await _cancel(writer)
        return
    # jump the queue: what is pending is dropped (the stream is ending; a
    # registration sets the node's tasks right), then the writer stops
    session.stop_writing()
    if session.not_reading:
        # its write waits for an agent that does not read: no use waiting
        await _cancel(writer)
        return
    try:
        await asyncio.wait_for(asyncio.shield(writer), timeout=2.0)
    except (asyncio.TimeoutError, Exception):
        await _cancel(writer)


class StreamRefused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class AgentSession:
    """One live stream of one node."""

    node_id: str
    peer: str
    #: the agent instance (Register.session_id, random per agent process)
    session_id: int = 0
    #: gateway clock time of the stream's last message (its register first)
    last_seen_s: float = 0.0
    superseded: asyncio.Event = field(default_factory=asyncio.Event)
    #: why a newer stream took over ("" until one did)
    superseded_by: str = ""
    closing: asyncio.Event = field(default_factory=asyncio.Event)
    last_ack_s: float = 0.0
    close_status: tuple[grpc.StatusCode, str] | None = None
    #: notAfter (epoch s) of the client certificate the agent connected with
    #: (mTLS), None without one: the stream outlives it, its next handshake not
    certificate_not_after: float | None = None
    #: the agent token the stream was opened with (None: a certificate, or
    #: insecure): a token file reload that revokes it ends the stream
    credential: object | None = None
    #: the gateway's clock: when each waiting message was queued
    clock: Callable[[], float] = time.monotonic
    #: (queued at, message) of placements, releases and RegisterAcks not yet
    #: written: never dropped, written before any chatter
    control: deque = field(default_factory=deque)
    #: (queued at, message) of Acks, resync requests and sampling hints not
    #: yet written: at most CHATTER_KEPT
    chatter: deque = field(default_factory=deque)
    #: set when something was queued: wakes the writer
    pending: asyncio.Event = field(default_factory=asyncio.Event)
    #: when the message being written was queued (None between writes): a
    #: write blocks while the agent does not read, so this ages with it
    writing_since: float | None = None
    #: chatter dropped on this stream, by message kind
    dropped: Counter = field(default_factory=Counter)
    #: (interval_ms, duration_ms) -> sampling hints waiting with those values
    _hints_waiting: Counter = field(default_factory=Counter)
    #: the stream is ending: nothing more is queued or written
    writer_stopped: bool = False
    #: closed because the agent left a message unread past the bound
    not_reading: bool = False

    def close(self, code: grpc.StatusCode, message: str) -> None:
        """End the stream from the coordinator's side with this status."""
        self.close_status = (code, message)
        self.closing.set()

    def send(self, msg: pb.CoordinatorMessage) -> bool:
        """Queue a message for the agent. Placements, releases and
        RegisterAcks are always queued; other messages are dropped (counted,
        False) when CHATTER_KEPT wait already. False as well once the stream
        is ending: the agent registers again, and the registration sets its
        tasks right (``Dispatcher.reconcile_node``)."""
        if self.writer_stopped:
            return False
        body = msg.WhichOneof("body")
        if body in CONTROL_BODIES:
            self.control.append((self.clock(), msg))
        else:
            if body == "sampling_hint":
                hint = (msg.sampling_hint.interval_ms, msg.sampling_hint.duration_ms)
                if self._hints_waiting[hint]:
                    # one waiting with these values starts the same fast
                    # sampling when it arrives: a burst of placements asks once
                    return True
            if len(self.chatter) >= CHATTER_KEPT:
                self.dropped[body] += 1
                if sum(self.dropped.values()) == 1:  # once a stream; the total when it ends
                    log.warning("agent_messages_dropped", node_id=self.node_id, kind=body, waiting=len(self.chatter),
                                unread_s=round(self.unread_s(self.clock()), 1))
                return False
            if body == "sampling_hint":
                self._hints_waiting[hint] += 1
            self.chatter.append((self.clock(), msg))
        self.pending.set()
        return True

    def next_message(self) -> pb.CoordinatorMessage | None:
        """The next message to write, control first; None when none waits."""
        if self.writer_stopped:
            return None
        if self.control:
            queued_at, msg = self.control.popleft()
        elif self.chatter:
            queued_at, msg = self.chatter.popleft()
            if msg.WhichOneof("body") == "sampling_hint":
                self._hints_waiting[(msg.sampling_hint.interval_ms, msg.sampling_hint.duration_ms)] -= 1
        else:
            return None
        self.writing_since = queued_at
        return msg

    def unread_s(self, now: float) -> float:
        """How long the oldest message not yet written has waited (0 when
        none): a reading agent keeps this near 0, one that does not read
        blocks the writer and lets it grow."""
        # per agent message on the read path: no allocation
        oldest = self.writing_since
        if self.control and (oldest is None or self.control[0][0] < oldest):
            oldest = self.control[0][0]
        if self.chatter and (oldest is None or self.chatter[0][0] < oldest):
            oldest = self.chatter[0][0]
        return 0.0 if oldest is None else max(0.0, now - oldest)

    def stop_writing(self) -> None:
        """The stream is ending: drop what waits and let the writer return
        after the write it is in."""
        self.writer_stopped = True
        self.control.clear()
        self.chatter.clear()
        self._hints_waiting.clear()
        self.pending.set()


_CODES = {
    CorruptEnvelope: grpc.StatusCode.INVALID_ARGUMENT,
    InvalidReading: grpc.StatusCode.INVALID_ARGUMENT,
    PayloadTooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


class AgentGateway(pb_grpc.AgentGatewayServicer):
    def __init__(self, coordinator: "Coordinator", clock: Callable[[], float] = time.monotonic) -> None:
        self.coordinator = coordinator
        self.clock = clock
        self.sessions: dict[str, AgentSession] = {}
        #: chatter dropped on streams that have ended, by message kind
        self.dropped_messages: Counter[str] = Counter()
        #: streams closed because their agent did not read them
        self.closed_not_reading = 0

    async def Connect(self, request_iterator, context: grpc.aio.ServicerContext):
        session: AgentSession | None = None
        writer: asyncio.Task | None = None
        stopper: asyncio.Task | None = None
        reader: asyncio.Task | None = None
        claimed: str | None = None  # the node id a refused register asked for, for the log
        try:
            try:
                first = await anext(aiter(request_iterator))
            except StopAsyncIteration:
                return
            if first.WhichOneof("body") != "register":
                raise StreamRefused(grpc.StatusCode.FAILED_PRECONDITION, "the first message of a stream must be a register")
            claimed = first.register.node_id[:128]
            try:
                validate_register(first.register)
            except RegistrationError as exc:
                raise StreamRefused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
            certificate_not_after, credential = self.coordinator.authorize_node(first.register.node_id, context)
            node_id = first.register.node_id
            now = self.clock()
            try:
                self.coordinator.view.check_gpu_uuids(first.register)
            except RegistrationConflict as exc:
                raise StreamRefused(grpc.StatusCode.ALREADY_EXISTS, str(exc)) from None
            previous = self.sessions.get(node_id)
            takeover = self._may_take_over(previous, first.register, now)
            session = AgentSession(node_id=node_id, peer=context.peer(), session_id=first.register.session_id, last_seen_s=now,
                                   certificate_not_after=certificate_not_after, credential=credential, clock=self.clock)
            if previous is not None:
                previous.superseded_by = takeover
                previous.superseded.set()
            self.sessions[node_id] = session
            node = self.coordinator.node_registered(first.register, session)
            session.send(register_ack(self.coordinator.config))
            # what the host runs against what is leased there: a release or
            # placement sent while its stream was down is not lost
            self.coordinator.dispatcher.reconcile_node(node_id, set(first.register.running_task_ids),
                                                       runs_tasks=first.register.backend == "sim")
            writer = asyncio.create_task(self._write_loop(session, context))
            reader = asyncio.create_task(self._read_loop(request_iterator, session, node))
            stopper = asyncio.create_task(self._wait_stop(session))
            done, _ = await asyncio.wait({reader, stopper, writer}, return_when=asyncio.FIRST_COMPLETED)
            if reader in done:
                reader.result()  # raises StreamRefused for bad input
                return
            if session.superseded.is_set():
                raise StreamRefused(grpc.StatusCode.ABORTED, f"node {node_id} opened a newer stream{session.superseded_by}; this one is closed")
            if session.close_status is not None:
                raise StreamRefused(*session.close_status)
        except StreamRefused as exc:
            # A shutdown closes every stream at once: one line for it is enough (server.stop logs it).
            if exc.code != grpc.StatusCode.UNAVAILABLE:
                log.warning("stream_refused", node_id=session.node_id if session else claimed, code=exc.code.name, detail=exc.message,
                            **({} if session else {"peer": context.peer()}))
            # A write in flight while the call is aborted turns the status into
            # INTERNAL; stop the writer first so the agent sees the real reason.
            await _finish_writer(writer, session)
            try:
                await asyncio.wait_for(context.abort(exc.code, exc.message), timeout=_ABORT_WAIT_S)
            except asyncio.TimeoutError:
                # An agent that does not read: the status waits behind the
                # messages it left unread (it gets it when it reads). The call
                # is aborted all the same; the stream ends here, not when the
                # agent next reads.
                pass
        finally:
            if session is not None and session.dropped:
                dropped = dict(session.dropped)
                self.dropped_messages.update(session.dropped)
                log.warning("agent_messages_dropped_total", node_id=session.node_id, dropped=dropped)
            for task in (reader, stopper, writer):
                if task is None:
                    continue
                if task.done():
                    if not task.cancelled():
                        task.exception()  # already handled above; mark it retrieved
                else:
                    task.cancel()
            if session is not None and self.sessions.get(session.node_id) is session:
                del self.sessions[session.node_id]
                self.coordinator.node_disconnected(session.node_id)

    def dropped_counts(self) -> Counter[str]:
        """Acks, resync requests and sampling hints dropped since start, by
        kind, on every stream (open or ended): for a metric. Placements and
        releases are never among them."""
        total = Counter(self.dropped_messages)
        for session in self.sessions.values():
            total.update(session.dropped)
        return total

    def send_register_acks(self) -> int:
        """Tell every open stream the intervals of the configuration as it is
        now (a reload changed one): an agent applies a RegisterAck whenever
        one comes, not only at registration. Returns the streams told: every
        open one (a RegisterAck is never dropped; a stream that does not read
        it is closed as not reading, and its agent is told the intervals when
        it registers again), less any that is ending."""
        message = register_ack(self.coordinator.config)
        return sum(session.send(message) for session in list(self.sessions.values()))

    def alive_window_s(self) -> float:
        """A stream heard from within this long is alive: the heartbeat
        timeout after which its node turns UNREACHABLE."""
        liveness = self.coordinator.liveness
        return liveness.heartbeat_interval_s + liveness.grace_s

    def _check_reading(self, session: AgentSession, now: float) -> None:
        """Close a stream whose agent writes but does not read: the oldest
        message waiting to be written has waited past the heartbeat timeout.
        The same bound as for an agent that stops writing: a reading agent
        takes a message in milliseconds (1,000 placements in well under a
        second), and its event loop stalled that long would have missed a
        heartbeat too. Its placements and releases are not dropped while it
        waits; closing makes it reconnect, and its registration sets its
        tasks right (``Dispatcher.reconcile_node``)."""
        unread = session.unread_s(now)
        if not unread:
            return
        bound = self.alive_window_s()
        if unread <= bound:
            return
        # time the coordinator itself did not run (its event loop held by a
        # long dispatch pass, a GC pause, SIGSTOP) is not the agent's: it
        # could not write then (QA pass 24: a 100k-task queue's passes closed
        # every agent's stream as "not reading" while the loop was the one stuck)
        unread -= self.coordinator.liveness.stalled_within(unread)
        if unread <= bound:
            return
        self.closed_not_reading += 1
        session.not_reading = True
        waiting = len(session.control) + len(session.chatter) + (session.writing_since is not None)
        log.warning("stream_not_reading", node_id=session.node_id, unread_s=round(unread, 1), bound_s=bound,
                    waiting=waiting, placements_and_releases=len(session.control))
        raise StreamRefused(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"node {session.node_id} is not reading its stream: a message has waited {unread:.1f} s to be written "
            f"(bound {bound:g} s, the heartbeat timeout), {waiting} waiting; reconnect: registering again sets "
            f"its tasks right",
        )

    def _may_take_over(self, previous: AgentSession | None, reg: pb.Register, now: float) -> str:
        """Whether a new stream may replace the node's current one: the same
        agent instance reconnecting always may; another instance only once
        the current stream is silent past the heartbeat timeout (its agent is
        gone though the coordinator has not seen the stream close). Returns
        what the older stream is told; raises StreamRefused (ALREADY_EXISTS)
        while the current stream is alive."""
        if previous is None or previous.session_id == reg.session_id:
            return ""
        silent = now - previous.last_seen_s
        window = self.alive_window_s()
        if silent <= window:
            raise StreamRefused(
                grpc.StatusCode.ALREADY_EXISTS,
                f"register.node_id: node {reg.node_id} is held by a live agent, instance {previous.session_id:#x} "
                f"at {previous.peer}, heard from {silent:.1f} s ago (this agent is instance {reg.session_id:#x}); "
                f"give each host its own node id, or stop the other agent: a new instance takes a node over "
                f"only once the old one's stream closes or is silent for {window:g} s",
            )
        log.warning("node_taken_over", node_id=reg.node_id, old_instance=f"{previous.session_id:#x}", old_peer=previous.peer,
                    new_instance=f"{reg.session_id:#x}", silent_s=round(silent, 1))
        return f" (agent instance {reg.session_id:#x} took over: this stream was silent for {silent:.1f} s)"

    async def _wait_stop(self, session: AgentSession) -> None:
        superseded = asyncio.create_task(session.superseded.wait())
        closing = asyncio.create_task(session.closing.wait())
        try:
            await asyncio.wait({superseded, closing}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            superseded.cancel()
            closing.cancel()

    async def _write_loop(self, session: AgentSession, context) -> None:
        while True:
            msg = session.next_message()
            if msg is None:
                if session.writer_stopped:  # asked to stop: the write before this is complete
                    return
                session.pending.clear()
                await session.pending.wait()
                continue
            await context.write(msg)
            session.writing_since = None

    async def _read_loop(self, request_iterator, session: AgentSession, node) -> None:
        coordinator = self.coordinator
        async for msg in request_iterator:
            now = self.clock()
            node.last_seen_s = now
            session.last_seen_s = now
            if not coordinator.node_seen(node.node_id):
                raise StreamRefused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"node {node.node_id} was removed after missing heartbeats; reconnect and register again",
                )
            # Any message is a sign of life, as liveness counts it: the agent
            # sends a Heartbeat only after an interval with nothing else to
            # send, which its refresh deltas (every staleness_s / 2) forestall.
            node.last_heartbeat_ns = time.time_ns()
            # ... but only of writing: one that does not read is closed here
            self._check_reading(session, now)
            body = msg.WhichOneof("body")
            if body == "telemetry":
                self._telemetry(msg.telemetry, session, node, now)
            elif body == "heartbeat":
                pass  # its whole content is the time it arrived, taken above
            elif body == "task_event":
                if msg.task_event.kind not in pb.TaskEventKind.values():
                    raise StreamRefused(grpc.StatusCode.INVALID_ARGUMENT, f"task_event.kind: unknown kind {msg.task_event.kind}")
                # both are logged with the event (before the id is looked up):
                # unbounded, one agent could write the log full
                task_id, detail = msg.task_event.task_id, msg.task_event.detail
                if not 0 < len(task_id) <= MAX_TASK_ID_LEN:
                    raise StreamRefused(grpc.StatusCode.INVALID_ARGUMENT,
                                        f"task_event.task_id: {len(task_id)} characters; a task id has 1-{MAX_TASK_ID_LEN}")
                if len(detail) > MAX_EVENT_DETAIL:
                    raise StreamRefused(grpc.StatusCode.INVALID_ARGUMENT,
                                        f"task_event.detail: {len(detail)} characters; at most {MAX_EVENT_DETAIL}")
                peak = msg.task_event.peak_vram_mib
                if not (math.isfinite(peak) and peak >= 0):
                    raise StreamRefused(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"task_event.peak_vram_mib: must be a finite number >= 0 (0 = unknown), got {peak!r}",
                    )
                coordinator.task_event(node.node_id, msg.task_event)
            elif body == "register":
                raise StreamRefused(grpc.StatusCode.FAILED_PRECONDITION, "register: a stream registers once")
            else:
                raise StreamRefused(grpc.StatusCode.INVALID_ARGUMENT, "body: empty agent message")

    def _telemetry(self, env: pb.Envelope, session: AgentSession, node, now: float) -> None:
        coordinator = self.coordinator
        size = env.ByteSize()
        node.bytes_received += size
        coordinator.envelope_bytes(size)
        try:
            result = node.decoder.admit(env)
        except CodecError as exc:
            coordinator.metrics_envelope_rejected(node.node_id, exc.field)
            raise StreamRefused(_CODES.get(type(exc), grpc.StatusCode.INVALID_ARGUMENT), f"telemetry.{exc}") from None
        if result.outcome is DecodeOutcome.APPLIED:
            node.envelopes += 1
            batch = result.batch
            coordinator.batch_applied(node, result, batch, now)
            if now - session.last_ack_s >= _ACK_EVERY_S:
                session.last_ack_s = now
                session.send(pb.CoordinatorMessage(ack=pb.Ack(seq=env.seq)))
            return
        # A gap, a reordering or deltas while waiting for a keyframe: ask for one,
        # again if the first request seems lost.
        if result.outcome is DecodeOutcome.RESYNC_NEEDED or now - node.last_resync_request_s >= _RESYNC_RETRY_S:
            node.resyncs += int(result.outcome is DecodeOutcome.RESYNC_NEEDED)
            node.last_resync_request_s = now
            coordinator.metrics_resync(node.node_id)
            session.send(
                pb.CoordinatorMessage(
                    resync=pb.ResyncRequest(
                        expected_seq=result.expected_seq,
                        reason=f"envelope {env.seq} arrived while {result.expected_seq} was expected",
                    )
                )
            )
