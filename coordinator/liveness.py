"""Node liveness: a pure state machine over an injected clock, and the asyncio
loop that sweeps it.

``NodeLiveness`` decides, from the messages a node sends and the time that
passes, whether the scheduler may place work on it; ``LivenessSweeper``
turns the passing of time into events for the coordinator.

Two independent attributes per node:

* ``liveness`` (what the node's stream says), driven by the agent and time::

      register            -> CONNECTING      (also from any state: a re-register)
      CONNECTING  --keyframe_applied-->  HEALTHY
      CONNECTING / HEALTHY  --silent > interval + grace, or disconnected-->  UNREACHABLE
      UNREACHABLE  --seen (stream still open)-->  HEALTHY (CONNECTING if no keyframe yet)
      UNREACHABLE  --keyframe_applied (stream open)-->  HEALTHY
      any but REMOVED  --silent > remove_after_intervals * interval + grace-->  REMOVED

  "Silent" counts from the last message of any kind, less any time the
  coordinator itself did not run (``coordinator_stalled``). REMOVED is final for
  that registration: messages on the old stream are ignored and the node
  must register again (starting at CONNECTING). A closed stream
  (``disconnected``) is UNREACHABLE at once, since placements travel on that
  stream and could not be delivered; it too needs a new registration, and
  is REMOVED on the same schedule if none comes.

* ``admin`` (what the operator says): ACTIVE, CORDONED (no new tasks,
  running ones stay) or DRAINING (no new tasks, running ones finish). It
  survives every liveness change, re-registration included: a cordoned node
  that goes silent and comes back is still cordoned, until ``uncordon``.
  With a state directory it survives a coordinator restart too
  (``restore_admin``: the node is known as REMOVED, cordoned, until its
  agent registers).
  The latest operator call wins (``cordon`` on a draining node cordons it).

``schedulable`` is ``liveness is HEALTHY and admin is ACTIVE``.
``effective`` folds both into one state for display, named like
``gpulb.v1.NodeState``: a liveness problem outranks an operator state
(REMOVED > UNREACHABLE > CONNECTING > DRAINING > CORDONED > HEALTHY), since
an unreachable cordoned node is first of all unreachable.

The grace (1 s default) keeps a node that heartbeats exactly once per
interval from flapping on network jitter. ``sweep`` returns each liveness
transition exactly once, in order, whether a call (register, keyframe,
disconnect) or the clock caused it; a sweep that finds a node silent past
both deadlines emits HEALTHY -> UNREACHABLE and UNREACHABLE -> REMOVED, so a
consumer never misses the step it keys on. The REMOVED event carries the
node id: the scheduler reports that node's leased tasks lost.

A stall of the coordinator itself (a stopped process, a frozen or migrating
VM, a long GC pause, swapping, a blocked event loop) is not silence from the
agents: their messages wait in the sockets, and after the stall the sweep's
timer may fire before the read loops take them in. ``LivenessSweeper``
notices its own sleep overrunning and tells the tracker, which then leaves
that much time out of every node's silence (``coordinator_stalled``).

``version`` bumps whenever what ``state``/``nodes`` show could have changed
(a liveness transition, a new or forgotten node, an operator state), so a
watcher can tell without comparing snapshots.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import inspect
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Iterator

import structlog

__all__ = [
    "Admin",
    "EffectiveState",
    "Liveness",
    "LivenessEvent",
    "LivenessSweeper",
    "ManualClock",
    "NodeLiveness",
    "NodeState",
    "UnknownNode",
]

log = structlog.get_logger("gpulb.liveness")


class Liveness(enum.Enum):
    """What the node's stream says about it."""

    CONNECTING = "CONNECTING"
    HEALTHY = "HEALTHY"
    UNREACHABLE = "UNREACHABLE"
    REMOVED = "REMOVED"


class Admin(enum.Enum):
    """What the operator says about the node."""

    ACTIVE = "ACTIVE"
    CORDONED = "CORDONED"
    DRAINING = "DRAINING"


class EffectiveState(enum.Enum):
    """Both attributes folded into one, for display; names match ``gpulb.v1.NodeState``."""

    CONNECTING = "CONNECTING"
    HEALTHY = "HEALTHY"
    UNREACHABLE = "UNREACHABLE"
    REMOVED = "REMOVED"
    CORDONED = "CORDONED"
    DRAINING = "DRAINING"


class UnknownNode(KeyError):
    """A call named a node that never registered (or was forgotten)."""


@dataclass(frozen=True, slots=True)
class LivenessEvent:
    """One liveness transition. ``old`` is None for a node's first registration."""

    node_id: str
    old: Liveness | None
    new: Liveness
    at: float  # clock time the transition was observed


@dataclass(frozen=True, slots=True)
class NodeState:
    """A snapshot of one node's liveness and operator state."""

    node_id: str
    liveness: Liveness
    admin: Admin
    effective: EffectiveState
    schedulable: bool
    connected: bool  # its stream is open
    last_seen_s: float  # clock time of its last message
    since_s: float  # clock time of its last liveness transition


class ManualClock:
    """A clock that moves only when told to: for tests and the simulator."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = float(start)

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        if seconds < 0:
            raise ValueError("a clock does not run backwards")
        self.now += seconds
        return self.now


@dataclass(slots=True)
class _Node:
    liveness: Liveness
    admin: Admin
    connected: bool
    keyframed: bool  # a keyframe was applied since the last register
    last_seen_s: float
    since_s: float
    # time since last_seen_s in which the coordinator did not run, so could
    # not have read the node's messages: not counted as silence
    excused_s: float = 0.0


class NodeLiveness:
    """Liveness and operator state of every registered node.

    ``clock`` returns seconds (``time.monotonic`` in the coordinator, a
    ``ManualClock`` in tests and the simulator). Nothing here blocks or
    reads the clock except through it.
    """

    def __init__(
        self,
        clock: Callable[[], float],
        heartbeat_interval_s: float = 10.0,
        remove_after_intervals: int = 3,
        grace_s: float = 1.0,
    ) -> None:
        if heartbeat_interval_s <= 0:
            raise ValueError("heartbeat_interval_s must be > 0")
        if remove_after_intervals < 1:
            raise ValueError("remove_after_intervals must be >= 1")
        if grace_s < 0:
            raise ValueError("grace_s must be >= 0")
        self._clock = clock
        self.heartbeat_interval_s = float(heartbeat_interval_s)
        self.remove_after_intervals = int(remove_after_intervals)
        self.grace_s = float(grace_s)
        self._nodes: dict[str, _Node] = {}
        self._events: list[LivenessEvent] = []
        self.version = 0  # bumps when a node's state as shown may have changed
        #: (when it was measured, s long) of the coordinator's recent stalls
        self._stalls: collections.deque[tuple[float, float]] = collections.deque(maxlen=64)

    # ------------------------------------------------------------ internals
    def _get(self, node_id: str) -> _Node:
        try:
            return self._nodes[node_id]
        except KeyError:
            raise UnknownNode(node_id) from None

    def _move(self, node_id: str, node: _Node, new: Liveness, at: float) -> None:
        if node.liveness is not new:
            self._events.append(LivenessEvent(node_id, node.liveness, new, at))
            node.liveness = new
            node.since_s = at
            self.version += 1

    def _snapshot(self, node_id: str, node: _Node) -> NodeState:
        return NodeState(
            node_id=node_id,
            liveness=node.liveness,
            admin=node.admin,
            effective=_effective(node.liveness, node.admin),
            schedulable=node.liveness is Liveness.HEALTHY and node.admin is Admin.ACTIVE,
            connected=node.connected,
            last_seen_s=node.last_seen_s,
            since_s=node.since_s,
        )

    # ------------------------------------------------------------ the agent
    def register(self, node_id: str) -> NodeState:
        """A node (re)registered on a new stream: CONNECTING until its keyframe."""
        now = self._clock()
        node = self._nodes.get(node_id)
        if node is None:
            node = _Node(Liveness.CONNECTING, Admin.ACTIVE, True, False, now, now)
            self._nodes[node_id] = node
            self._events.append(LivenessEvent(node_id, None, Liveness.CONNECTING, now))
            self.version += 1
        else:
            self._move(node_id, node, Liveness.CONNECTING, now)
            node.connected = True
            node.keyframed = False
            node.last_seen_s = now
            node.excused_s = 0.0
        return self._snapshot(node_id, node)

    def keyframe_applied(self, node_id: str) -> NodeState:
        """The view holds a full picture of the node again: HEALTHY."""
        node = self._get(node_id)
        if node.liveness is Liveness.REMOVED or not node.connected:
            return self._snapshot(node_id, node)  # a stale stream; it must register
        now = self._clock()
        node.keyframed = True
        node.last_seen_s = now
        node.excused_s = 0.0
        self._move(node_id, node, Liveness.HEALTHY, now)
        return self._snapshot(node_id, node)

    def seen(self, node_id: str) -> Liveness:
        """Any message from the node. Returns its liveness afterwards.

        REMOVED (or a closed stream) means the message came on a stream this
        tracker has given up on: the caller should ask the agent to register
        again.
        """
        node = self._get(node_id)
        if node.liveness is Liveness.REMOVED or not node.connected:
            return node.liveness
        now = self._clock()
        node.last_seen_s = now
        node.excused_s = 0.0
        if node.liveness is Liveness.UNREACHABLE:
            self._move(node_id, node, Liveness.HEALTHY if node.keyframed else Liveness.CONNECTING, now)
        return node.liveness

    def disconnected(self, node_id: str) -> NodeState:
        """The node's stream closed: UNREACHABLE now, REMOVED if it does not return."""
        node = self._get(node_id)
        node.connected = False
        if node.liveness in (Liveness.CONNECTING, Liveness.HEALTHY):
            self._move(node_id, node, Liveness.UNREACHABLE, self._clock())
        return self._snapshot(node_id, node)

    # ------------------------------------------------------------ the operator
    def _admin(self, node_id: str, admin: Admin) -> NodeState:
        node = self._get(node_id)
        node.admin = admin
        self.version += 1
        return self._snapshot(node_id, node)

    def cordon(self, node_id: str) -> NodeState:
        """No new tasks; running ones stay. Survives liveness changes."""
        return self._admin(node_id, Admin.CORDONED)

    def drain(self, node_id: str) -> NodeState:
        """No new tasks; running ones finish. Survives liveness changes."""
        return self._admin(node_id, Admin.DRAINING)

    def uncordon(self, node_id: str) -> NodeState:
        """Back to ACTIVE: schedulable again once HEALTHY."""
        return self._admin(node_id, Admin.ACTIVE)

    def restore_admin(self, states: dict[str, str]) -> list[str]:
        """Take up the cordons and drains of a previous run (node id ->
        ``Admin`` value). A node not known yet is recorded as REMOVED with
        that state, as a node that left would be: listed, uncordonable, and
        still cordoned when its agent registers. Values that do not parse
        are skipped and their node ids returned."""
        bad = []
        now = self._clock()
        for node_id, value in states.items():
            try:
                admin = Admin(value)
            except ValueError:
                bad.append(node_id)
                continue
            node = self._nodes.get(node_id)
            if node is not None:
                node.admin = admin
            else:
                self._nodes[node_id] = _Node(Liveness.REMOVED, admin, False, False, now, now)
        self.version += 1
        return bad

    # ------------------------------------------------------------ time
    def coordinator_stalled(self, seconds: float) -> int:
        """The coordinator did not run for ``seconds`` (measured by the
        sweeper): no message could be read in that time, and the ones sent
        wait in the sockets, so it does not count as any node's silence.
        Every deadline moves out by it, but a node is never excused more than
        the whole time since its last message (silence does not go below
        zero and earn credit against the next one). Returns how many nodes it excused (all but the REMOVED)."""
        if seconds <= 0:
            return 0
        now = self._clock()
        self._stalls.append((now, float(seconds)))
        excused = 0
        for node in self._nodes.values():
            if node.liveness is not Liveness.REMOVED:
                node.excused_s = min(node.excused_s + seconds, max(0.0, now - node.last_seen_s))
                excused += 1
        return excused

    def stalled_within(self, window_s: float) -> float:
        """Seconds the coordinator did not run, of stalls measured within the
        last ``window_s`` (a wait that long is not a peer's fault for that
        much: the gateway's not-reading check)."""
        since = self._clock() - window_s
        return sum(seconds for at, seconds in self._stalls if at >= since)

    def sweep(self) -> list[LivenessEvent]:
        """Apply the silence deadlines; return every transition since the last sweep."""
        now = self._clock()
        unreachable_after = self.heartbeat_interval_s + self.grace_s
        remove_after = self.remove_after_intervals * self.heartbeat_interval_s + self.grace_s
        for node_id, node in self._nodes.items():
            if node.liveness is Liveness.REMOVED:
                continue
            silent = now - node.last_seen_s - node.excused_s
            if silent > unreachable_after:
                self._move(node_id, node, Liveness.UNREACHABLE, now)
            if silent > remove_after:
                self._move(node_id, node, Liveness.REMOVED, now)
        events, self._events = self._events, []
        return events

    # ------------------------------------------------------------ queries
    def state(self, node_id: str) -> NodeState:
        """Snapshot of one node; raises UnknownNode."""
        return self._snapshot(node_id, self._get(node_id))

    def schedulable(self, node_id: str) -> bool:
        """May the scheduler place new work here? False for an unknown node."""
        node = self._nodes.get(node_id)
        return node is not None and node.liveness is Liveness.HEALTHY and node.admin is Admin.ACTIVE

    def nodes(self) -> list[NodeState]:
        """Snapshots of every known node, REMOVED ones included, by node id."""
        return [self._snapshot(k, self._nodes[k]) for k in sorted(self._nodes)]

    def removed(self) -> Iterator[str]:
        """Ids of the REMOVED nodes, unordered and without snapshots (a
        metrics scrape counts them)."""
        return (k for k, n in self._nodes.items() if n.liveness is Liveness.REMOVED)

    def forget(self, node_id: str) -> None:
        """Drop a REMOVED node's record (its operator state with it)."""
        node = self._get(node_id)
        if node.liveness is not Liveness.REMOVED:
            raise ValueError(f"{node_id} is {node.liveness.value}; only a REMOVED node is forgotten")
        del self._nodes[node_id]
        self.version += 1


def _effective(liveness: Liveness, admin: Admin) -> EffectiveState:
    if liveness is not Liveness.HEALTHY:
        return EffectiveState(liveness.value)
    if admin is Admin.ACTIVE:
        return EffectiveState.HEALTHY
    return EffectiveState(admin.value)


#: Receives each sweep's events; a plain function or a coroutine function.
EventSink = Callable[[list[LivenessEvent]], Awaitable[None] | None]


class LivenessSweeper:
    """Calls ``liveness.sweep()`` every ``interval_s`` and hands events to ``on_events``.

    Owned and stopped explicitly: ``start()`` inside a running event loop,
    ``await stop()`` on shutdown. ``on_events`` may be a plain function or a
    coroutine function; an exception from it is logged and the loop goes on,
    since one failing consumer must not stop liveness tracking. Events are
    handed over only when there are some.

    Each sweep measures how late it is: the time from the end of the last
    sweep, less ``interval_s``. The agents' read loops run on the same event
    loop, so a sweep that comes more than one interval late means the
    coordinator did not run (stopped, frozen, paused, or its loop blocked)
    and read nothing for that long; that lateness goes to
    ``NodeLiveness.coordinator_stalled`` before the deadlines are applied, and
    is logged once as ``coordinator_stalled``. Lateness up to one interval is
    ordinary scheduling jitter, which the tracker's grace absorbs.
    ``clock`` measures the lateness: real time by default, since a stall is
    real time the process did not run (the tracker's clock may be a manual
    one whose jumps are the passing of time under test, not stalls).
    """

    def __init__(
        self,
        liveness: NodeLiveness,
        on_events: EventSink,
        interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        self.liveness = liveness
        self.on_events = on_events
        self.interval_s = float(interval_s)
        self.clock = clock
        self._last_sweep_end: float | None = None  # on ``clock``
        self.stalls = 0  # stalls detected, for tests and metrics
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("LivenessSweeper already started")
        self._last_sweep_end = None  # time before the start is no stall
        self._task = asyncio.get_running_loop().create_task(self._run(), name="liveness-sweeper")

    async def stop(self) -> None:
        """Cancel the loop and wait for it; a no-op if never started."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            # ours, from the cancel above; re-raise only if the caller itself
            # is being cancelled
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise

    async def sweep_once(self) -> list[LivenessEvent]:
        """One sweep and delivery, as the loop does it (also for tests)."""
        if self._last_sweep_end is not None:
            late_s = self.clock() - self._last_sweep_end - self.interval_s
            if late_s > self.interval_s:
                self.stalls += 1
                excused = self.liveness.coordinator_stalled(late_s)
                log.warning("coordinator_stalled", stalled_s=round(late_s, 3), nodes_excused=excused)
        try:
            events = self.liveness.sweep()
            if events:
                try:
                    result = self.on_events(events)
                    if inspect.isawaitable(result):
                        await result
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("liveness_consumer_failed", events_dropped=len(events))
        finally:
            # from the end of delivery: a consumer that awaits leaves the loop free
            # to read the agents' messages, so its time is no stall
            self._last_sweep_end = self.clock()
        return events

    async def _run(self) -> None:
        while True:
            await self.sweep_once()
            await asyncio.sleep(self.interval_s)
