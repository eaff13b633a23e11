"""Scheduling inside the coordinator: the dispatcher that runs the scheduler
library over the live view, and the thin ``gpulb.v1.Scheduler`` servicer.

Dispatch runs on the coordinator's event loop whenever something may have
freed or added work - a submission, a completion or release, new readings -
and at least every ``dispatch_interval_s``. A request schedules one pass as a
plain callback at the end of the loop's current turn (no task, no wake-up of
a waiting coroutine), so every submission whose handler runs in the same turn
is placed by that one pass: a burst of 100 submissions is placed in one pass
whose reservations keep any two placements off the same free memory. Placed tasks are sent to their node's
agent over its stream, with a request for fast sampling so the reservation
gives way to real readings quickly.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import math
import secrets
import time
from collections import Counter
from dataclasses import replace
from typing import TYPE_CHECKING, Callable

import grpc
import structlog
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from coordinator.shutdown import or_shutdown
from coordinator.snapshots import SnapshotBuilder
from coordinator.state import StateError
from coordinator.taskconvert import WallClock, priority_to_proto, spec_from_proto, task_to_proto
from protos import tasks_pb2 as tpb
from protos import tasks_pb2_grpc as tpb_grpc
from protos import telemetry_pb2 as pb
from scheduler.config import SchedulerConfig
from scheduler.engine import GPU_GONE, Scheduler
from scheduler.errors import (
    InvalidArgument,
    InvalidTask,
    NotLeaseHolder,
    SchedulerError,
    TaskConflict,
    TaskFinished,
    UnknownTask,
)
from scheduler.scoring import big_card_sizes
from scheduler.snapshot import ClusterSnapshot
from scheduler.task import MAX_REASON_LEN, Task, TaskState

if TYPE_CHECKING:
    from coordinator.server import Coordinator

__all__ = ["Dispatcher", "SchedulerService", "status_of", "MAX_BATCH"]

#: most tasks one ScheduleTasks call may carry (bounds the work of one call)
MAX_BATCH = 1_000

#: bytes a gRPC client accepts in one reply unless told otherwise (grpcio's,
#: grpc-go's and grpcurl's default receive limit): a ListTasks page stays
#: under it even where the coordinator's max_message_bytes is larger
CLIENT_RECEIVE_BYTES = 4 * 1024 * 1024

log = structlog.get_logger("gpulb.scheduler")

_CODES: list[tuple[type, grpc.StatusCode]] = [
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (TaskConflict, grpc.StatusCode.ALREADY_EXISTS),
    (UnknownTask, grpc.StatusCode.NOT_FOUND),
    (NotLeaseHolder, grpc.StatusCode.FAILED_PRECONDITION),
    (TaskFinished, grpc.StatusCode.FAILED_PRECONDITION),
]


def status_of(exc: SchedulerError) -> tuple[grpc.StatusCode, str]:
    """The gRPC status for a scheduler error, its message naming the field."""
    if isinstance(exc, UnknownTask):
        if not exc.task_id:  # malformed, not a task that is not there
            return grpc.StatusCode.INVALID_ARGUMENT, "task_id: required (the id the task was submitted with)"
        return grpc.StatusCode.NOT_FOUND, f"task_id: {exc}"
    for cls, code in _CODES:
        if isinstance(exc, cls):
            message = str(exc)
            if isinstance(exc, InvalidTask):
                message = f"spec.{message}"
            return code, message
    return grpc.StatusCode.FAILED_PRECONDITION, str(exc)


class Dispatcher:
    """Owns the scheduler engine inside the coordinator."""

    def __init__(self, coordinator: "Coordinator", config: SchedulerConfig, clock: Callable[[], float]) -> None:
        self.c = coordinator
        self.clock = clock
        self.wall = WallClock(clock)
        self.engine = Scheduler(config, clock=clock)
        self.snapshots = SnapshotBuilder(
            coordinator.view,
            schedulable=coordinator.liveness.schedulable,
            staleness_s=coordinator.config.staleness_s,
            clock=clock,
        )
        self.engine.add_listener(self._on_change)
        self._waiters: dict[str, list[asyncio.Future]] = {}
        self._watchers: dict[str, set[asyncio.Queue]] = {}
        self._last_state: dict[str, TaskState] = {}
        self._pass_handle: asyncio.Handle | None = None  # a pass scheduled for the end of this turn
        self._loop_task: asyncio.Task | None = None
        self.interval_s = coordinator.config.dispatch_interval_s
        # ListTasks page tokens name this run: a token from before a restart
        # (Task.seq numbers start over) resumes after its task by id
        self.page_epoch = secrets.token_hex(4)
        self._last_view_dispatch = 0.0
        #: the last pass's length and end (time.perf_counter), for pass_pause_s
        self._last_pass_s = 0.0
        self._last_pass_end = 0.0
        self._sla_misses_seen = 0
        self._gpu_facts_key: tuple[int, int] | None = None  # gpu_facts' cache: (reservations, version)
        self._gpu_facts_snapshot: ClusterSnapshot | None = None  # and the snapshot its readings are of
        self._gpu_facts: dict[str, tuple[float, int]] = {}
        self._row_of: tuple[list[str], dict[str, int]] | None = None  # (snapshot.gpu_uuid, uuid -> row)
        # runs that ended with their task QUEUED again at once, by cause: not finished
        self.requeued: Counter[str] = Counter()
        self._big_cards_key: tuple[int, float] | None = None  # big_cards' cache: (membership version, share)
        self._big_cards: tuple[int, float] = (0, 0.0)
        #: adds learned per-node/model slowdowns to the snapshot (the advisor runtime sets it)
        self.annotate: Callable[[ClusterSnapshot], ClusterSnapshot] = lambda snapshot: snapshot

    def restored(self, tasks) -> None:
        """Tasks restored from durable state: remember their states so later
        transitions (a restored lease completing) are reported to agents."""
        for task in tasks:
            if not task.terminal:
                self._last_state[task.task_id] = task.state

    # ---- lifecycle ---------------------------------------------------------
    def start(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.create_task(self._loop(), name="gpulb-dispatch")

    async def stop(self) -> None:
        handle, self._pass_handle = self._pass_handle, None
        if handle is not None:
            handle.cancel()
        task, self._loop_task = self._loop_task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    def request(self) -> None:
        """Ask for a dispatch pass at the end of this event-loop turn; requests
        until then coalesce into that one pass. Without a running loop (tests,
        set-up) the pass waits for the periodic one. After a long pass the
        next waits (``pass_pause_s``)."""
        if self._pass_handle is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return
            pause = self.pass_pause_s()
            if pause > 0:
                self._pass_handle = loop.call_later(pause, self._requested_pass)
            else:
                self._pass_handle = loop.call_soon(self._requested_pass)

    #: after a pass longer than this (s) the next one waits (``pass_pause_s``)
    PACE_ABOVE_S = 0.01
    #: ... for this many times the pass's length after its end, so passes take
    #: at most a third of the event loop
    PACE_FACTOR = 2.0

    def pass_pause_s(self) -> float:
        """How long the next pass must still wait. A pass walks the whole
        queue (~10 µs per queued task here), and one is asked for at every
        submission and up to every 100 ms of readings: with 10^5 tasks
        queued (a pass over a second) passes ran back to back, every RPC and
        agent stream waited seconds behind them, and agents lost their
        streams (QA pass 24). A pass of more than ``PACE_ABOVE_S`` is
        followed by ``PACE_FACTOR`` times its length in which the loop serves
        everyone else; a short pass (a queue of hundreds) changes nothing."""
        last = self._last_pass_s
        if last <= self.PACE_ABOVE_S:
            return 0.0
        return max(0.0, self._last_pass_end + self.PACE_FACTOR * last - time.perf_counter())

    def _requested_pass(self) -> None:
        self._pass_handle = None
        self._run_pass()

    def _run_pass(self) -> None:
        started = time.perf_counter()
        try:
            self.dispatch_now()
        except Exception:  # a bad pass must not stop scheduling for good
            log.exception("dispatch_failed")
        finally:
            self._last_pass_end = time.perf_counter()
            self._last_pass_s = self._last_pass_end - started

    def view_changed(self) -> None:
        # New readings may free room, but a pass per envelope would be wasted:
        # at most every 100 ms, and only when something waits.
        now = self.clock()
        if now - self._last_view_dispatch >= 0.1 and self.engine.queued() > 0:
            self._last_view_dispatch = now
            self.request()

    async def _loop(self) -> None:
        """The periodic pass (aging, deadlines, lease expiry, placements the
        readings alone made possible)."""
        while True:
            await asyncio.sleep(max(self.interval_s, self.pass_pause_s()))
            if self.engine.queued() == 0:
                # Nothing waits: only leases can expire. Building the snapshot
                # (2-7 ms at 2,500 nodes, 100 ms while nodes join) would buy
                # nothing; the next submission asks for a pass of its own.
                try:
                    self.engine.expire_leases()
                except Exception:
                    log.exception("lease_expiry_failed")
                continue
            self._run_pass()

    def dispatch_now(self) -> list[Task]:
        started = time.perf_counter()
        snapshot = self.annotate(self.snapshots.snapshot())
        if snapshot.gpu_count == 0:
            # No node yet (a fresh start, or a restart before agents are back):
            # nothing can be placed, and judging "never fits" against an empty
            # cluster would reject every queued task. Deadlines still pass: a
            # client waiting with deadline_s gets EXPIRED at it, nodes or not.
            self.engine.expire_leases()
            self.engine.expire_deadlines()
            return []
        placed = self.engine.dispatch(snapshot)
        self.engine.expire_leases()
        self.c.metrics.decision_seconds.observe(time.perf_counter() - started)
        misses = self.engine.sla_misses
        if misses > self._sla_misses_seen:
            self.c.metrics.sla_misses.inc(misses - self._sla_misses_seen)
            self._sla_misses_seen = misses
        return placed

    # ---- listener: every task change ---------------------------------------
    def _on_change(self, task: Task) -> None:
        previous = self._last_state.get(task.task_id)
        state = task.state
        if state != previous:
            self._transition(task, previous)
        if task.terminal:
            self._last_state.pop(task.task_id, None)
        else:
            self._last_state[task.task_id] = state
        for queue in list(self._watchers.get(task.task_id, ())):
            try:
                queue.put_nowait(task)
            except asyncio.QueueFull:
                pass
        if state != TaskState.QUEUED:
            for future in self._waiters.pop(task.task_id, []):
                if not future.done():
                    future.set_result(task)

    def _transition(self, task: Task, previous: TaskState | None) -> None:
        metrics = self.c.metrics
        a = task.assignment
        if task.state == TaskState.LEASED and a is not None:
            metrics.tasks_placed.labels(a.score.policy, task.spec.priority.name).inc()
            metrics.queue_wait.labels(task.spec.priority.name).observe(max(0.0, a.placed_at - task.queued_at))
            self._send_placement(task)
            log.info("task_placed", task_id=task.task_id, lease_id=a.lease_id, node_id=a.node_id,
                     gpus=list(a.gpu_indices), priority=task.spec.priority.name, tenant=task.spec.tenant,
                     policy=a.score.policy, score=round(a.score.total, 4))
        if task.terminal:
            metrics.tasks_finished.labels(task.state.name.lower()).inc()
        elif task.state == TaskState.LOST:  # Task.requeued: its node or GPU went, it waits again
            self.requeued["gpu_gone" if task.reason.startswith(GPU_GONE) else "node_removed"] += 1
        elif task.state == TaskState.PREEMPTED:
            self.requeued["preempted"] += 1
        if previous == TaskState.LEASED and task.state != TaskState.LEASED and a is not None:
            # this coordinator ended the lease: the GPUs' readings will drop, and
            # a drop it caused is the new level, not an anomaly (QA pass 25)
            self.c.view.expect_release(a.node_id, a.gpu_uuids, self.clock())
            session = self.c.gateway.sessions.get(a.node_id)
            preempted = task.state == TaskState.PREEMPTED
            if session is not None and task.state != TaskState.LOST:
                session.send(pb.CoordinatorMessage(release=pb.TaskRelease(task_id=task.task_id, reason=task.state.name.lower())))
                if preempted:
                    # a P0 task waits for these readings to show the memory free: sample fast
                    session.send(pb.CoordinatorMessage(sampling_hint=pb.SamplingHint(interval_ms=200, duration_ms=10_000)))
            if preempted:
                # the task's reason does not name the P0 task (its owner may be
                # another tenant); the operator's log does
                for_task = next((p0 for p0, kept in self.engine.nominations().items() if task.task_id in kept.victims), "")
                # info: evicting for a P0 task is the designed-for behaviour
                log.info("task_preempted", task_id=task.task_id, lease_id=a.lease_id, node_id=a.node_id,
                         gpus=list(a.gpu_indices), priority=task.spec.priority.name, reason=task.reason,
                         for_task_id=for_task)
            self.request()  # room was freed

    def reconcile_node(self, node_id: str, running: set[str], *, runs_tasks: bool) -> tuple[int, int]:
        """Right after a node (re)registered: release what its host runs that
        is not leased there now (a release sent while its stream was down),
        and, on a host that runs the tasks placed on it (``runs_tasks``: the
        simulated backend; an NVML host's workloads are its clients'), place
        again what is leased there but not running (a placement lost, or a
        restarted host). Returns (released, placed again)."""
        session = self.c.gateway.sessions.get(node_id)
        if session is None:
            return 0, 0
        node = self.c.view.nodes.get(node_id)
        if node is not None:
            # leases on GPUs the host came back without are lost runs, not
            # runs to place again on GPUs that are not there (QA pass 24)
            before = {t.task_id: t.assignment.lease_id for t in self.engine.leased_on(node_id) if t.assignment}
            gone = self.engine.gpus_gone(node_id, [g.uuid for g in node.gpus])
            if gone:
                log.warning("tasks_lost", node_id=node_id, tasks=[t.task_id for t in gone],
                            lease_ids=[before.get(t.task_id, "") for t in gone],
                            reason="their GPUs are not among those the node registered",
                            requeued=[t.task_id for t in gone if t.state == TaskState.QUEUED])
                self.request()
        leased = {t.task_id: t for t in self.engine.leased_on(node_id)}
        released = sorted(running - leased.keys())
        for task_id in released:
            session.send(pb.CoordinatorMessage(release=pb.TaskRelease(task_id=task_id, reason="not leased on this node")))
        missing = [t for task_id, t in leased.items() if task_id not in running] if runs_tasks else []
        for task in missing:
            # starting from nothing: its memory is in no reading yet (a lease
            # restored as running, or one whose run the host lost, had faded)
            self.engine.start_again(task.task_id)
            self._send_placement(task)
        if released or missing:
            log.info("node_tasks_reconciled", node_id=node_id, released=released,
                     placed_again=[t.task_id for t in missing])
        return len(released), len(missing)

    def migrate(self, task_id: str, lease_id: str, to_gpu_uuids: list[str]) -> Task:
        """MigrateTask: the engine moves the lease (``Scheduler.migrate``, on the
        current view); then the old node's agent stops the task and the new
        one's starts it. A LEASED task that stays LEASED is no state change, so
        this is the one place that knows where the task came from."""
        before = self.engine.get(task_id).assignment  # None unless leased: migrate then refuses it
        snapshot = self.snapshots.snapshot()
        task = self.engine.migrate(task_id, lease_id, to_gpu_uuids, snapshot if snapshot.gpu_count else None)
        a = task.assignment
        from_node_id = before.node_id if before is not None else ""
        if before is not None:
            left = set(before.gpu_uuids) - set(a.gpu_uuids) if before.node_id == a.node_id else before.gpu_uuids
            self.c.view.expect_release(from_node_id, left, self.clock())
        session = self.c.gateway.sessions.get(from_node_id)
        if session is not None:
            session.send(pb.CoordinatorMessage(release=pb.TaskRelease(task_id=task.task_id, reason="migrated")))
        self._send_placement(task)
        self.c.advisor.task_migrated(task.task_id)
        self.c.metrics.tasks_migrated.inc()
        log.info("task_migrated", task_id=task.task_id, from_node_id=from_node_id, node_id=a.node_id,
                 gpus=list(a.gpu_indices))
        self.request()  # room was freed on the old GPUs
        return task

    def _send_placement(self, task: Task) -> None:
        a = task.assignment
        session = self.c.gateway.sessions.get(a.node_id)
        if session is None:
            return
        spec = task.spec
        session.send(
            pb.CoordinatorMessage(
                place=pb.TaskPlacement(
                    task_id=spec.task_id,
                    gpu_index=list(a.gpu_indices),
                    vram_mib=int(spec.vram_mib),
                    gpu_share=spec.gpu_share,
                    duration_s=spec.duration_s,
                    kind=spec.kind,
                )
            )
        )
        # Sample fast for a while so the reservation meets real readings soon.
        session.send(pb.CoordinatorMessage(sampling_hint=pb.SamplingHint(interval_ms=200, duration_ms=10_000)))

    # ---- agent events --------------------------------------------------------
    def task_event(self, node_id: str, event: pb.TaskEvent) -> None:
        try:
            task = self.engine.get(event.task_id)
        except UnknownTask:
            return
        a = task.assignment
        if a is None or a.node_id != node_id or task.state != TaskState.LEASED:
            return  # a late event for a task that moved on, or from the wrong node
        # when the agent says it happened, not when it arrived: an event held
        # across a stream outage or a coordinator restart arrives late (QA pass 24)
        at = self.event_time(node_id, event, since=a.placed_at)
        if event.kind == pb.TASK_EVENT_KIND_STARTED:
            self.c.advisor.task_started(task.task_id, at)
            observed = at - a.placed_at
            old = self.snapshots.response_time_s.get(node_id)
            self.snapshots.response_time_s[node_id] = observed if old is None else 0.8 * old + 0.2 * observed
            self.snapshots.facts_changed()
        elif event.kind in (pb.TASK_EVENT_KIND_FINISHED, pb.TASK_EVENT_KIND_FAILED, pb.TASK_EVENT_KIND_OOM_KILLED):
            failed = event.kind != pb.TASK_EVENT_KIND_FINISHED
            if event.peak_vram_mib and event.kind != pb.TASK_EVENT_KIND_FAILED:
                self.c.advisor.note_peak_memory(
                    task.task_id, event.peak_vram_mib, oom_killed=event.kind == pb.TASK_EVENT_KIND_OOM_KILLED
                )
            try:
                self.engine.complete(task.task_id, a.lease_id, failed=failed, at=at)
            except SchedulerError as exc:  # its lease ran out just now (judged as of now)
                self.c.advisor.forget_reports(task.task_id)
                log.info("task_event_not_applied", task_id=task.task_id, node_id=node_id, lease_id=a.lease_id,
                         kind=pb.TaskEventKind.Name(event.kind), reason=str(exc))
                return
            oom = event.kind == pb.TASK_EVENT_KIND_OOM_KILLED
            if oom:
                self.oom_kills += 1
            late_s = self.clock() - at
            (log.warning if oom else log.info)(
                "task_ended_on_node", task_id=task.task_id, node_id=node_id, lease_id=a.lease_id,
                kind=pb.TaskEventKind.Name(event.kind), detail=event.detail,
                **({"reported_late_s": round(late_s, 3)} if late_s >= 1.0 else {}))

    oom_kills = 0

    def event_time(self, node_id: str, event: pb.TaskEvent, *, since: float) -> float:
        """When ``event`` happened on this coordinator's (monotonic) clock,
        clamped to [``since``, now]. ``at_ns`` is the agent's wall clock: it
        is mapped through the offset its stream's first live batch measured
        (``NodeRecord.clock_offset_s``: right whatever the agent's clock is
        set to), else as if the agent's clock were this host's. An event
        without a time (0), or one that says it is from the future or from
        before ``since`` (a skewed clock), is timed by the bound."""
        now = self.clock()
        if event.at_ns <= 0:
            return now
        node = self.c.view.nodes.get(node_id)
        offset_s = node.clock_offset_s if node is not None else None
        if offset_s is not None:
            at = event.at_ns * 1e-9 + offset_s
        else:
            at = (event.at_ns - self.wall.offset_ns) * 1e-9
        if not math.isfinite(at):
            return now
        return min(max(at, since), now)

    def node_removed(self, node_id: str) -> None:
        # the leases, before the engine drops them (a re-queued task has none after)
        leases = {t.task_id: t.assignment.lease_id for t in self.engine.leased_on(node_id) if t.assignment is not None}
        lost = self.engine.node_removed(node_id)
        if lost:
            log.warning("tasks_lost", node_id=node_id, tasks=[t.task_id for t in lost],
                        lease_ids=[leases.get(t.task_id, "") for t in lost])
        self.request()

    # ---- waiting and watching ------------------------------------------------
    async def wait_placed(self, task_id: str, timeout_s: float | None) -> Task:
        """The task once it leaves the queue, or as it is after ``timeout_s``."""
        task = self.engine.get(task_id)
        if task.state != TaskState.QUEUED:
            return task
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._waiters.setdefault(task_id, []).append(future)
        # one timer on the future itself (cheaper than wait_for + shield; a
        # cancelled caller cancels only its own future)
        timer = None if timeout_s is None else loop.call_later(max(0.0, timeout_s), _time_out, future)
        try:
            placed = await future
            return placed if placed is not None else self.engine.get(task_id)
        finally:
            if timer is not None:
                timer.cancel()
            waiters = self._waiters.get(task_id)
            if waiters is not None and future in waiters:
                waiters.remove(future)
                if not waiters:
                    del self._waiters[task_id]

    def release_waiters(self) -> None:
        """The coordinator stops: every ScheduleTask waiting for a placement
        returns the task as it is (coordinator.shutdown)."""
        for futures in list(self._waiters.values()):
            for future in futures:
                if not future.done():
                    future.set_result(None)

    def watch(self, task_id: str) -> tuple[asyncio.Queue, Callable[[], None]]:
        queue: asyncio.Queue = asyncio.Queue(maxsize=256)
        self._watchers.setdefault(task_id, set()).add(queue)

        def unsubscribe() -> None:
            watchers = self._watchers.get(task_id)
            if watchers is not None:
                watchers.discard(queue)
                if not watchers:
                    del self._watchers[task_id]

        return queue, unsubscribe

    # ---- facts for the operator API and metrics ------------------------------
    def gpu_facts(self) -> dict[str, tuple[float, int]]:
        """GPU uuid -> (reserved MiB, leases on it), for GPUs holding leases; do
        not change it.

        The reserved MiB are those the scheduler places with now: the part of
        the leases' asks that the GPU's memory reading in the current
        snapshot does not show yet (``GpuReservation.effective``, as a
        placement view built now has it; the whole ask at a stale or unknown
        reading), not the whole ask, which the reading shows once the tasks
        allocate (ListGpus had a card 18.7 GiB used and 18 GiB reserved,
        152 %, long after its readings showed the task).

        Rebuilt only when a reservation was added or released or a new
        snapshot was taken: ListGpus and ListNodes ask once per GPU or node,
        and rebuilding it each time made them quadratic (3,200 GPUs, all
        leased: 627 ms)."""
        reservations = self.engine.reservations
        snapshot = self.snapshots.snapshot()
        key = (id(reservations), reservations.version)
        if self._gpu_facts_key == key and self._gpu_facts_snapshot is snapshot:
            return self._gpu_facts
        uuids = snapshot.gpu_uuid
        if self._row_of is None or self._row_of[0] is not uuids:  # nodes came or went
            self._row_of = (uuids, {uuid: row for row, uuid in enumerate(uuids)})
        row_of = self._row_of[1]
        out: dict[str, tuple[float, int]] = {}
        if len(reservations):
            # as Python values at once: per-row numpy scalars cost more than the rest
            used = snapshot.memory_used_mib.tolist()
            fresh = (~snapshot.node_stale[snapshot.gpu_node]).tolist() if snapshot.gpu_count else []
            for uuid in reservations.reserved_gpus():
                gpu = reservations.gpu(uuid)
                if gpu is None or not gpu.members:
                    continue
                row = row_of.get(uuid)
                if row is None:
                    reserved = gpu.vram_mib  # its node left the view: no reading shows it
                else:
                    # on a copy: effective() folds the reading into the stack (lowers
                    # its baselines), which only the scheduler's own views may do
                    reserved, _ = replace(gpu).effective(used[row], fresh[row])
                out[uuid] = (reserved, len(gpu.members))
        self._gpu_facts_key, self._gpu_facts_snapshot, self._gpu_facts = key, snapshot, out
        return out

    def big_cards(self) -> tuple[int, float]:
        """(GPUs the load-aware ``big_cards`` term keeps for work that needs
        their memory, the largest memory in MiB of the other cards): ``(0,
        0.0)`` when no card is big. Capacities change only as nodes join or
        leave, so it is worked out again only then (or on a new share)."""
        key = (self.c.view.membership_version, self.engine.config.big_card_share)
        if self._big_cards_key != key:
            total = self.snapshots.snapshot().memory_total_mib
            sizes = big_card_sizes(total, key[1])
            self._big_cards = (0, 0.0) if sizes is None else (int((total >= sizes[0]).sum()), sizes[1])
            self._big_cards_key = key
        return self._big_cards

    def metric_families(self):
        summary = self.engine.queue_summary()
        depth = GaugeMetricFamily("gpulb_queue_depth", "Queued tasks by priority class", labels=["priority"])
        oldest = GaugeMetricFamily("gpulb_queue_oldest_wait_seconds", "Wait of the oldest queued task by class", labels=["priority"])
        for cls in summary.classes:
            depth.add_metric([cls.priority.name], cls.depth)
            oldest.add_metric([cls.priority.name], cls.oldest_wait_s if cls.depth else 0.0)
        known = self.engine.state_counts()
        # PREEMPTED is a passage (QUEUED again in the same step): never a count
        counts = {state.name.lower(): known.get(state, 0) for state in TaskState if state != TaskState.PREEMPTED}
        tasks = GaugeMetricFamily("gpulb_tasks", "Tasks the coordinator knows, by state", labels=["state"])
        for state, count in counts.items():
            tasks.add_metric([state], count)
        # what the fgd policy packs for (at most 64 shapes: a bounded label set)
        mix = GaugeMetricFamily(
            "gpulb_workload_mix_share",
            "Share of recently queued tasks by shape (GPUs, memory ask rounded up to 128 MiB, "
            "GPU share rounded up to 0.01), fading with a half-life of 2,000 arrivals",
            labels=["gpus", "vram_mib", "gpu_share"],
        )
        for (gpus, vram, share), p in self.engine.workload_mix.probabilities().items():
            mix.add_metric([str(gpus), f"{vram:g}", f"{share:g}"], p)
        # how often tasks waited for a GPU with room for their kind's growth, and how it ended
        room = CounterMetricFamily(
            "gpulb_growth_room_waits",
            "Tasks that waited for a GPU with room for their kind's largest learned memory growth "
            "(outcome=waited), then were placed with that room (found) or, the wait over, without it (gave_up)",
            labels=["outcome"],
        )
        for outcome in ("waited", "found", "gave_up"):
            room.add_metric([outcome], self.engine.room_wait_counts[outcome])
        requeued = CounterMetricFamily(
            "gpulb_tasks_requeued",
            "Runs that ended with their task queued again at once, so not finished, by cause: its node was "
            "removed (node_removed: the task's update says LOST, then QUEUED), its GPU is gone from the node's "
            "registration (gpu_gone) or it was evicted for a P0 task (preempted)",
            labels=["cause"],
        )
        for cause in ("node_removed", "gpu_gone", "preempted"):
            requeued.add_metric([cause], self.requeued[cause])
        preempt = CounterMetricFamily(
            "gpulb_preemptions",
            "Preemption for P0 tasks that fit nowhere: P0 tasks that evicted lower-priority leases "
            "(outcome=nominated; for_growth: of those, P0 tasks that fit but evicted for room for their kind's "
            "learned memory growth; for_compute: of those, P0 tasks that fit but evicted for their share of a "
            "GPU's compute), the leases evicted (evicted), and how the kept GPUs ended: the P0 task "
            "placed on them (placed_there) or elsewhere (placed_elsewhere), or the victims' memory never "
            "shown free within preempt_grace_s (lapsed: a lease holder that does not stop its task)",
            labels=["outcome"],
        )
        for outcome in ("nominated", "for_growth", "for_compute", "evicted", "placed_there", "placed_elsewhere", "lapsed"):
            preempt.add_metric([outcome], self.engine.preemption_counts[outcome])
        # so an operator who sees an 80 GiB card idle beside loaded small ones can tell it is kept
        big_count, small_mib = self.big_cards()
        big = GaugeMetricFamily(
            "gpulb_big_cards",
            "GPUs the load-aware big_cards term keeps for work that needs their memory: the largest-memory "
            "cards, at most [scheduler] big_card_share of the GPUs (0: no card is big, e.g. all one size)",
        )
        big.add_metric([], big_count)
        limit = GaugeMetricFamily(
            "gpulb_big_cards_need_limit_bytes",
            "Largest memory of the other cards: a task whose ask times its kind's largest learned memory growth "
            "is at most this pays the big_cards term on the big cards (0 when no card is big)",
        )
        limit.add_metric([], small_mib * 1024 * 1024)
        oom = CounterMetricFamily(
            "gpulb_oom_kills",
            "Tasks killed for running out of GPU memory, as their agent (a task event) or lease holder "
            "(CompleteTask oom_killed) reported; also counted in gpulb_tasks_finished_total{state=\"failed\"}",
            value=self.oom_kills,
        )
        return [depth, oldest, tasks, mix, room, requeued, preempt, big, limit, oom]


def _time_out(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def _status_for(exc: SchedulerError, identity) -> tuple[grpc.StatusCode, str]:
    """``status_of`` for the caller ``identity``: task ids are one namespace
    across tenants, so a tenant whose id another tenant's task holds learns
    only that the id is taken, not what that task's spec holds (its
    tenant, labels...: QA pass 24). The same tenant, and an admin, get the
    fields that differ."""
    code, message = status_of(exc)
    if (isinstance(exc, TaskConflict) and "tenant" in exc.fields
            and identity is not None and not getattr(identity, "admin", False)):
        message = (f"task {exc.task_id!r} is taken: task ids are shared by every tenant; "
                   "choose another id")
    return code, message


def _varint_len(value: int) -> int:
    """Bytes of ``value`` as a protobuf varint."""
    return max(1, (value.bit_length() + 6) // 7)


def _page_budget(max_message_bytes: int) -> int:
    """Bytes of tasks one ListTasks reply may carry: under the coordinator's
    ``max_message_bytes`` and a client's default receive limit, with room
    to spare for the rest of the reply."""
    cap = min(int(max_message_bytes), CLIENT_RECEIVE_BYTES)
    return cap - max(cap // 10, 16 * 1024)


class SchedulerService(tpb_grpc.SchedulerServicer):
    """gpulb.v1.Scheduler: decode, call the dispatcher's engine, encode."""

    def __init__(self, coordinator: "Coordinator") -> None:
        self.c = coordinator

    @property
    def d(self) -> Dispatcher:
        return self.c.dispatcher

    def _proto(self, task: Task) -> tpb.Task:
        return task_to_proto(task, self.d.wall)

    async def _durable(self, context, commit) -> None:
        """Acknowledge only what is durable; a failed commit is UNAVAILABLE
        (retrying is safe: submission is idempotent)."""
        try:
            await commit
        except StateError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"state: could not persist ({exc}); retry")

    async def _fail(self, context, exc: SchedulerError, identity=None):
        code, message = _status_for(exc, identity)
        await context.abort(code, message)

    async def _fail_at(self, context, exc: SchedulerError, index: int | None, identity=None):
        """``_fail`` for the spec at ``index`` of a ScheduleTasks call:
        "spec.vram_mib: ..." becomes "specs[3].vram_mib: ..."; other errors
        are prefixed with "specs[3]: "."""
        code, message = _status_for(exc, identity)
        if index is not None:
            message = f"specs[{index}].{message.removeprefix('spec.')}" if isinstance(exc, InvalidTask) else f"specs[{index}]: {message}"
        await context.abort(code, message)

    async def ScheduleTask(self, request: tpb.ScheduleTaskRequest, context) -> tpb.ScheduleTaskResponse:
        identity = self.c.authorize(context, admin=False)
        try:
            spec = spec_from_proto(request.spec)
            spec = self.c.tenant_spec(identity, spec)
            self.c.admit_submission(identity, spec)
            snapshot = self.d.snapshots.snapshot()
            # Against an empty cluster every task would "never fit": wait for nodes instead.
            task = self.d.engine.submit(spec, snapshot if snapshot.gpu_count else None)
        except SchedulerError as exc:
            await self._fail(context, exc, identity)
        if task.state == TaskState.REJECTED:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"spec: rejected, {task.reason}")
        await self._durable(context, self.c.task_accepted(task))
        self.d.request()
        wait = request.wait if request.HasField("wait") else True
        if wait and task.state == TaskState.QUEUED:
            remaining = context.time_remaining()
            timeout = None if remaining is None else max(0.0, remaining - 0.05)
            if spec.deadline_s > 0:
                timeout = spec.deadline_s + 0.05 if timeout is None else min(timeout, spec.deadline_s + 0.05)
            task = await self.d.wait_placed(spec.task_id, timeout)
        if task.state == TaskState.QUEUED:
            task = self._as_now([task])[0]
        return tpb.ScheduleTaskResponse(task=self._proto(task))

    def _as_now(self, tasks: list[Task]) -> list[Task]:
        """``tasks`` as they are now, for a reply: queue deadlines that have
        passed are applied first (the dispatch pass applies them only every
        ``dispatch_interval_s``; a wait bounded by a task's ``deadline_s``
        ends right after it), so a task whose deadline passed is EXPIRED in
        the reply, not QUEUED (QA pass 24)."""
        engine = self.d.engine
        engine.expire_deadlines()
        out = []
        for task in tasks:
            try:
                out.append(engine.get(task.task_id))
            except UnknownTask:  # forgotten meanwhile (retain_finished): as it was last seen
                out.append(task)
        return out

    async def ScheduleTasks(self, request: tpb.ScheduleTasksRequest, context) -> tpb.ScheduleTasksResponse:
        identity = self.c.authorize(context, admin=False)
        count = len(request.specs)
        if not 1 <= count <= MAX_BATCH:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"specs: 1 to {MAX_BATCH} tasks per call, got {count}")
        specs = []
        first: dict[str, int] = {}
        for index, proto in enumerate(request.specs):
            try:
                specs.append(self.c.tenant_spec(identity, spec_from_proto(proto)))
            except SchedulerError as exc:
                await self._fail_at(context, exc, index, identity)
            earlier = first.setdefault(specs[-1].task_id, index)
            if earlier != index and specs[earlier] != specs[-1]:
                # within one call: "already exists" would send the client looking
                # for a task that was never queued (the call queues nothing)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"specs[{index}].task_id: {specs[-1].task_id!r} repeats specs[{earlier}] with "
                                    "different values; ids must be distinct within a call (an identical repeat is "
                                    "one task)")
        try:
            self.c.admit_submissions(identity, specs)
            snapshot = self.d.snapshots.snapshot()
            tasks = self.d.engine.submit_many(specs, snapshot if snapshot.gpu_count else None)
        except SchedulerError as exc:
            await self._fail_at(context, exc, getattr(exc, "index", None), identity)
        await self._durable(context, self.c.task_accepted(tasks[-1]))
        self.d.request()
        wait = request.wait if request.HasField("wait") else True
        if wait and any(t.state == TaskState.QUEUED for t in tasks):
            remaining = context.time_remaining()
            timeout = None if remaining is None else max(0.0, remaining - 0.05)
            waits = []
            for t in tasks:
                limit = timeout
                if t.spec.deadline_s > 0:
                    limit = t.spec.deadline_s + 0.05 if limit is None else min(limit, t.spec.deadline_s + 0.05)
                waits.append(self.d.wait_placed(t.task_id, limit))
            tasks = await asyncio.gather(*waits)
        if wait or any(t.state == TaskState.QUEUED for t in tasks):
            # each waiter's task is as it was when that wait ended, the
            # slowest ending last: the reply shows every task as it is now
            tasks = self._as_now(tasks)
        return tpb.ScheduleTasksResponse(tasks=[self._proto(t) for t in tasks])

    async def GetTask(self, request: tpb.GetTaskRequest, context) -> tpb.Task:
        identity = self.c.authorize(context, admin=False)
        try:
            task = self.d.engine.get(request.task_id)
        except SchedulerError as exc:
            await self._fail(context, exc)
        await self.c.check_owner(identity, task, context)
        return self._proto(task)

    async def ListTasks(self, request: tpb.ListTasksRequest, context) -> tpb.ListTasksResponse:
        identity = self.c.authorize(context, admin=False)
        if request.state not in tpb.TaskState.values():
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"state: unknown task state {request.state}")
        state = TaskState(request.state) if request.state else None
        tenant = self.c.visible_tenant(identity, request.tenant)
        after = 0
        if request.page_token:
            after = self._page_start(request.page_token, tenant)
            if after is None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    "page_token: not a next_page_token of this coordinator's for a task still known "
                                    "(pass it as it came; a coordinator restart can end one): list again without it")
        limit = request.limit or 1000
        tasks = self.d.engine.tasks(state=state, tenant=tenant, limit=limit + 1, after_seq=after)
        more = len(tasks) > limit
        # a page also ends before it would outgrow what a client accepts, so
        # that no listing fails on its size (600 tasks with 8 KiB of labels each
        # made 4.6 MiB): the rest are on the next page
        budget = _page_budget(self.c.config.max_message_bytes)
        page: list[tpb.Task] = []
        size = 0
        last: Task | None = None
        for task in tasks[:limit]:
            proto = self._proto(task)
            n = proto.ByteSize()
            n += 1 + _varint_len(n)  # the field's tag and length
            if page and size + n > budget:
                if not (request.paged or request.page_token):
                    # a client that does not page would take the short page
                    # for the whole listing (QA pass 24: 479 of 1,100 tasks,
                    # exit 0): say so, as the size limit did before paging
                    await context.abort(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"paged: the matching tasks do not fit one reply ({budget:,} bytes after {len(page)} of "
                        "them): set paged and follow next_page_token (gpulb tasks does), or narrow the listing "
                        "with state, tenant or limit")
                more = True
                break
            page.append(proto)
            size += n
            last = task
        reply = tpb.ListTasksResponse(tasks=page)
        if more and last is not None:
            reply.next_page_token = self._page_token(last)
        return reply

    def _page_token(self, last: Task) -> str:
        """An opaque next_page_token: this run's epoch, the last task's
        ``seq`` and its id (base64url)."""
        text = f"{self.d.page_epoch}.{last.seq}.{last.task_id}"
        return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")

    def _page_start(self, token: str, tenant: str) -> int | None:
        """The ``after_seq`` a page token stands for, None when it is not one.

        In the run that made it, its ``seq``; after a restart (another
        epoch: ``seq`` numbers started over), the current ``seq`` of the task
        it names, if that task is still known and one the caller may list."""
        try:
            text = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode()
            epoch, seq, task_id = text.split(".", 2)
            after = int(seq) if seq.isdigit() else -1
        except (ValueError, binascii.Error, UnicodeDecodeError):
            return None
        if after < 0 or not task_id:
            return None
        if epoch == self.d.page_epoch:
            return after
        try:
            task = self.d.engine.get(task_id)
        except SchedulerError:
            return None
        if tenant and task.spec.tenant != tenant:
            return None  # another tenant's: said as of a task not known
        return task.seq

    async def WatchTask(self, request: tpb.WatchTaskRequest, context):
        identity = self.c.authorize(context, admin=False)
        try:
            task = self.d.engine.get(request.task_id)
        except SchedulerError as exc:
            await self._fail(context, exc)
        await self.c.check_owner(identity, task, context)
        # admitted once the request is known good (a refused one holds no
        # slot); the slot goes back however the stream ends: the task ends,
        # the client cancels, the coordinator stops (or_shutdown aborts)
        with self.c.security.admit_watch(context, self.c.config) as slot:
            queue, unsubscribe = self.d.watch(request.task_id)
            try:
                yield self._proto(self.d.engine.get(request.task_id))
                if task.terminal:
                    return
                while True:
                    update = await or_shutdown(queue.get(), self.c.stopping, context, slot.revoked)
                    yield self._proto(update)
                    if update.terminal:
                        return
            finally:
                unsubscribe()

    async def _owned(self, identity, task_id: str, context) -> Task:
        try:
            task = self.d.engine.get(task_id)
        except SchedulerError as exc:
            await self._fail(context, exc)
        await self.c.check_owner(identity, task, context)
        return task

    async def CompleteTask(self, request: tpb.CompleteTaskRequest, context) -> tpb.CompleteTaskResponse:
        identity = self.c.authorize(context, admin=False)
        owned = await self._owned(identity, request.task_id, context)
        for name in ("actual_duration_s", "peak_vram_mib"):
            value = getattr(request, name)
            if not (math.isfinite(value) and value >= 0):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: must be a finite number >= 0 (0 = unknown), got {value!r}")
        held = self._gpu_memory_mib(owned)
        if request.peak_vram_mib and held and request.peak_vram_mib > held:
            # one such report would teach the memory-growth learner a growth no
            # card allows, and every placement of its kind would plan for it
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"peak_vram_mib: {request.peak_vram_mib:g} MiB is more than the task's GPU holds "
                                f"({held:g} MiB); it is the most the task used on any one of its GPUs")
        if request.actual_duration_s:
            self.c.advisor.note_actual_duration(request.task_id, request.actual_duration_s)
        if request.peak_vram_mib:
            self.c.advisor.note_peak_memory(request.task_id, request.peak_vram_mib, oom_killed=request.oom_killed)
        try:
            # an OOM kill is a failure, whatever `failed` says
            task = self.d.engine.complete(request.task_id, request.lease_id, failed=request.failed,
                                          oom_killed=request.oom_killed)
        except SchedulerError as exc:
            # a refused completion (a stale lease, say) reports nothing
            self.c.advisor.forget_reports(request.task_id)
            await self._fail(context, exc)
        if request.oom_killed and owned.state == TaskState.LEASED:  # not a retry's
            self.d.oom_kills += 1
            log.warning("task_oom_killed", task_id=task.task_id, lease_id=request.lease_id,
                        peak_vram_mib=request.peak_vram_mib, reported_by="lease_holder")
        await self._durable(context, self.c.task_changed_durably(task))
        return tpb.CompleteTaskResponse(task=self._proto(task))

    def _gpu_memory_mib(self, task: Task) -> float:
        """The largest memory of the GPUs ``task`` was placed on, as their
        agent registered them; 0 when not known (never placed, node gone)."""
        a = task.assignment
        node = self.c.view.nodes.get(a.node_id) if a is not None else None
        if node is None:
            return 0.0
        uuids = set(a.gpu_uuids)
        return float(max((g.memory_total_mib for g in node.gpus if g.uuid in uuids), default=0))

    async def CancelTask(self, request: tpb.CancelTaskRequest, context) -> tpb.CancelTaskResponse:
        identity = self.c.authorize(context, admin=False)
        if len(request.reason) > MAX_REASON_LEN:
            # kept as Task.reason in memory and state, and in every ListTasks reply
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"reason: {len(request.reason):,} characters; at most {MAX_REASON_LEN:,}")
        await self._owned(identity, request.task_id, context)
        try:
            task = self.d.engine.cancel(request.task_id, request.reason)
        except SchedulerError as exc:
            await self._fail(context, exc)
        await self._durable(context, self.c.task_changed_durably(task))
        return tpb.CancelTaskResponse(task=self._proto(task))

    async def RenewLease(self, request: tpb.RenewLeaseRequest, context) -> tpb.RenewLeaseResponse:
        identity = self.c.authorize(context, admin=False)
        await self._owned(identity, request.task_id, context)
        try:
            task = self.d.engine.renew(request.task_id, request.lease_id, request.extend_s)
        except SchedulerError as exc:
            await self._fail(context, exc)
        await self._durable(context, self.c.task_changed_durably(task))
        return tpb.RenewLeaseResponse(task=self._proto(task))

    async def MigrateTask(self, request: tpb.MigrateTaskRequest, context) -> tpb.MigrateTaskResponse:
        identity = self.c.authorize(context, admin=False)
        await self._owned(identity, request.task_id, context)
        try:
            task = self.d.migrate(request.task_id, request.lease_id, list(request.to_gpu_uuid))
        except SchedulerError as exc:
            await self._fail(context, exc)
        await self._durable(context, self.c.task_changed_durably(task))
        return tpb.MigrateTaskResponse(task=self._proto(task))

    async def GetQueue(self, request: tpb.GetQueueRequest, context) -> tpb.GetQueueResponse:
        identity = self.c.authorize(context, admin=False)
        # the class depths and waits are every tenant's; the head, whole
        # tasks, only the caller's own for a tenant token (QA pass 24)
        admin = identity is None or getattr(identity, "admin", False)
        summary = self.d.engine.queue_summary(tenant=None if admin else identity.tenant)
        return tpb.GetQueueResponse(
            classes=[
                tpb.QueueClass(priority=priority_to_proto(c.priority), depth=c.depth, oldest_wait_s=c.oldest_wait_s if c.depth else 0.0)
                for c in summary.classes
            ],
            head=[self._proto(t) for t in summary.head],
            sla_misses=summary.sla_misses,
            placed=summary.placed,
        )

    async def GetPolicy(self, request: tpb.GetPolicyRequest, context) -> tpb.Policy:
        self.c.authorize(context, admin=False)
        info = self.d.engine.get_policy()
        return tpb.Policy(name=info.name, weights=dict(info.weights), available=list(info.available))

    async def SetPolicy(self, request: tpb.SetPolicyRequest, context) -> tpb.Policy:
        self.c.authorize(context, admin=True)
        try:
            info = self.d.engine.set_policy(request.name, dict(request.weights))
        except SchedulerError as exc:
            await self._fail(context, exc)
        await self._durable(context, self.c.policy_changed(info))
        log.info("policy_set", policy=info.name, weights=dict(info.weights))
        self.d.request()
        return tpb.Policy(name=info.name, weights=dict(info.weights), available=list(info.available))
