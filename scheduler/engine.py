"""The scheduler: the one stateful object tying queue, filters, policies,
reservations and leases together.

Synchronous and single-threaded: the coordinator calls it from its event loop,
the simulator from its virtual-time loop; every time comes from the injected
``clock`` (monotonic seconds). Public methods return *copies* of task records
and tell listeners (``add_listener``) about every change, after the call's own
work is done, so a listener may call back into the scheduler.

Life cycle::

    submit --> QUEUED --dispatch--> LEASED --complete--> COMPLETED / FAILED
       |         |  \\--deadline--> EXPIRED      |--lease runs out--> EXPIRED
       |         \\--cancel--> CANCELLED          |--cancel--> CANCELLED
       \\--never fits--> REJECTED                 |--node_removed--> LOST (--> QUEUED if retryable)
                                                  \\--a P0 task evicts it--> PREEMPTED --> QUEUED

Preemption (``_preempt``): urgent work is never stuck behind batch work. A
P0 task (by spec) that has fit nowhere for ``config.preempt_after_s`` evicts
leases of ``config.preempt_min_victim_priority`` and below from the GPU (or,
for a multi-GPU task, the node) where that costs least, and those GPUs are
kept for it (no other task may take them) until their memory shows free in
the readings or ``config.preempt_grace_s`` passes. Its victims are re-queued
at once at their spec priority, at the head of their class; their lease
holders hear of it as the state PREEMPTED, the agents as a release. Such a
stuck P0 task is offered before the queue's weighted rounds. A P0 task that
fits now, but only where its kind's learned memory growth would not, may
evict for room to grow within its SLA (``_urgent_room``).

Retry rule for lost tasks: a task whose node is removed is re-queued (at its
spec priority, aging restarting) when ``spec.movable`` is set or its ``kind``
is one of ``config.retry_kinds`` (training, batch, background by default;
inference is not retried because its caller has long given up), and it has
had fewer than ``config.max_attempts`` placements: its listeners see the
run end as LOST with ``Task.requeued`` set (a passage, not an end, like
PREEMPTED), then QUEUED. Otherwise it stays LOST, and that is its end.

Never-fits rule: a task is REJECTED at submission when it cannot fit any node
of the latest snapshot even if that node were empty (``filters.never_fits``).
Tasks submitted before the scheduler has seen any snapshot are checked at the
next dispatch. A rejection keeps no id: the same tenant's next submission
under a REJECTED task's id (its spec fixed, or the cluster changed) is judged
again as a new task, whose record replaces the rejected one
(``_retries_rejected``).
"""

from __future__ import annotations

import bisect
import copy
import heapq
import itertools
import logging
import math
from collections import Counter, deque
from dataclasses import dataclass, replace
from operator import attrgetter
from typing import Callable, Collection, Mapping, Sequence

import numpy as np

from scheduler.config import SchedulerConfig
from scheduler.errors import (
    InvalidArgument,
    NotLeaseHolder,
    SchedulerError,
    TaskConflict,
    TaskFinished,
    UnknownPolicy,
    UnknownTask,
    Unplaceable,
)
from scheduler.filters import describe, explain, feasible, first_failure, never_fits, nvlink_groups
from scheduler.fragmentation import WorkloadMix
from scheduler.memgrowth import largest_growth
from scheduler.policies import POLICIES, Placement, Policy, make_policy
from scheduler.predictor import ANY_KIND
from scheduler.queue import AgingQueue, Outcome
from scheduler.reservations import LeaseBook, Reservations
from scheduler.snapshot import ClusterSnapshot
from scheduler.task import Assignment, Priority, ScoreBreakdown, Task, TaskSpec, TaskState
from scheduler.view import PlacementView

__all__ = ["Scheduler", "SchedulerConfig", "ClassSummary", "QueueSummary", "PolicyInfo", "GPU_GONE"]

#: how the reason of a run lost because its GPU left the node begins (``gpus_gone``)
GPU_GONE = "GPU "

_SEQ = attrgetter("seq")

log = logging.getLogger(__name__)

#: s a held node may stay unreachable before the hold moves (``_held_node``):
#: a calm agent's 2 s period plus the reading's way through the coordinator
_HOLD_GRACE_S = 5.0
#: multi-GPU tasks that keep less urgent work off a node from their first
#: failure (``_urgent_sets``)
_KEPT_FREE_SETS = 4
#: s a P0 task must have left of its SLA to evict for room to grow
#: (``_urgent_room``): the victims' memory takes a sampling round or two to show free
_MIN_GROWTH_WAIT_S = 2.0
#: s before its SLA runs out that a P0 task waiting for room to grow gives up
#: the wait and takes the GPU it fits (the next dispatch places it)
_SLA_MARGIN_S = 0.5
#: s after gpulb's last lease on a GPU ended during which its compute reading
#: may still show that task: the agent's 2 s calm period, then the anomaly
#: filter's confirmation (2.4 s in all by default), with room to spare
_RELEASE_SHOWS_S = 10.0
#: the held nodes of a task no barrier fences
_NOTHING_HELD: frozenset[int] = frozenset()

Listener = Callable[[Task], None]


@dataclass(frozen=True, slots=True)
class Nomination:
    """GPUs whose lower-priority leases were evicted for a P0 task, kept for
    it until it is placed or ``until`` (the clock's time) passes."""

    node_id: str
    gpu_uuids: tuple[str, ...]
    victims: tuple[str, ...]  # task ids evicted for it
    until: float
    # per kept GPU, the memory reading (MiB) at or under which the victims'
    # memory shows gone: half of what they asked there below the reading at
    # the eviction (a task that fits already waits for it, ``_urgent_compute``)
    gone_below_mib: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class ClassSummary:
    priority: Priority
    depth: int
    oldest_wait_s: float  # s since the longest-waiting task of the class was queued


@dataclass(frozen=True, slots=True)
class QueueSummary:
    classes: tuple[ClassSummary, ...]
    head: tuple[Task, ...]  # first tasks in dispatch order
    sla_misses: int  # P0 tasks that waited past the SLA bound, since start
    placed: int  # placements since start


@dataclass(frozen=True, slots=True)
class PolicyInfo:
    name: str
    weights: Mapping[str, float]
    available: tuple[str, ...]



def _kept_reason(node_id: str) -> str:
    """The end of a barrier's reason while its node is held for it."""
    return f"; node {node_id} is kept for it while gpulb's tasks there end"


def _waits_reason(node_id: str) -> str:
    """The end of a barrier's reason while a more urgent barrier holds a node."""
    return f"; node {node_id} is chosen for it, to be kept once no more urgent task is waiting for a node"

class Scheduler:
    """Queue, place, lease and track tasks (see module docstring)."""

    def __init__(
        self,
        config: SchedulerConfig | None = None,
        *,
        clock: Callable[[], float],
        lease_ids: Callable[[], str] | None = None,
        on_change: Listener | None = None,
        reservations: Reservations | None = None,
    ) -> None:
        """``clock``: monotonic seconds; ``lease_ids``: lease id factory (random by
        default); ``on_change``: a first listener; ``reservations``: an empty
        ``Reservations`` (or subclass, e.g. the simulator's columnar one) to use."""
        self.config = (config or SchedulerConfig()).validate()
        self._clock = clock
        self._queue = AgingQueue.from_config(self.config)
        if reservations is not None and len(reservations):
            raise ValueError("reservations must start empty")
        self._reservations = reservations if reservations is not None else Reservations()
        self._leases = LeaseBook(lease_ids)
        self._tasks: dict[str, Task] = {}
        self._finished: deque[str] = deque()
        self._by_node: dict[str, set[str]] = {}
        self._deadlines: list[tuple[float, str]] = []
        self._unchecked: set[str] = set()
        self._policies: dict[str, Policy] = {}
        # task shapes as they arrive, for the policies that place against the
        # mix (fgd); one for the scheduler, so a policy swapped in knows it
        self.workload_mix = WorkloadMix()
        self._policy = self._make_policy(self.config.policy, self.config.weights)
        self._policies[self._policy.NAME] = self._policy
        self._view: PlacementView | None = None
        self._last_snapshot: ClusterSnapshot | None = None
        self._listeners: list[Listener] = [on_change] if on_change else []
        self._pending: list[Task] = []
        self._held_nodes: dict[str, str] = {}  # barrier task id -> node held for it
        self._room_waits: dict[str, float] = {}  # task id -> when it stops waiting for room to grow
        # tasks that waited for room to grow, and how the waits ended: placed
        # with the room ("found") or, the wait over, without it ("gave_up")
        self.room_wait_counts: Counter[str] = Counter()
        self._hold_lost: dict[str, float] = {}  # barrier task id -> since when its node is not reachable
        # preemption: P0 task id -> the GPUs evicted for it; the rows they are
        # in the current view (None: none kept); P0 tasks that fit nowhere ->
        # when they may evict; victims evicted in this dispatch, re-queued
        # once the queue's drain is done (it must not change under its walk)
        self._nominations: dict[str, Nomination] = {}
        self._nominated_rows: np.ndarray | None = None
        self._preempt_due: dict[str, float] = {}
        # P0 task id -> _victim_version when an eviction for it found no victim
        # that would make room: until lower-priority work is placed again it
        # cannot evict, so it is not offered ahead of the other classes
        # (``stuck``): a P0 backlog with nothing to evict had taken every
        # freed GPU before the weighted rounds, starving P1-P3
        self._no_victims: dict[str, int] = {}
        self._victim_version = 0  # +1 per lease granted to work preemption may evict
        self._evicted: list[Task] = []
        self._evicted_at: float | None = None  # when the last eviction was (next_decision_at)
        self._evicted_for_growth: set[str] = set()  # queued P0 tasks that evicted for room to grow
        self._evicted_for_compute: set[str] = set()  # queued P0 tasks that evicted for compute
        # queued P0 task -> when it stops waiting for a lease expected to end (_room_before)
        self._room_expected: dict[str, float] = {}
        self.p0_leases_on: dict[str, int] = {}  # GPU uuid -> live leases of P0 tasks (by spec) on it
        self._times_evicted: Counter[str] = Counter()  # live task id -> leases of it evicted so far
        # GPU uuid -> when gpulb's last lease on it ended (kept _RELEASE_SHOWS_S)
        self._emptied_at: dict[str, float] = {}
        # "evicted" (victims), "nominated" (P0 tasks that evicted), and how the
        # nominations ended: "placed_there", "placed_elsewhere", "lapsed"
        self.preemption_counts: Counter[str] = Counter()
        # per class, the queued multi-GPU tasks that failed to fit, in the order
        # they first did (``_urgent_sets``; stale ids are dropped as met)
        self._blocked_sets: list[dict[str, None]] = [{} for _ in Priority]
        self.placed = 0
        self.migrated = 0  # leases moved to other GPUs (migrate)
        # queued task id -> the part of its shape key that depends on its spec
        # alone (``_try_place``): a deep queue is walked at every dispatch
        self._spec_shapes: dict[str, tuple] = {}

    # ---- listeners --------------------------------------------------------------------
    def add_listener(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(task_copy)`` after every change; returns an unsubscribe function."""
        self._listeners.append(listener)

        def remove() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return remove

    def _changed(self, task: Task) -> None:
        self._pending.append(copy.copy(task))

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        for task in pending:
            for listener in list(self._listeners):
                try:
                    listener(task)
                except Exception:  # one broken listener must not break scheduling
                    log.exception("task listener failed for %s", task.task_id)

    # ---- lookups ------------------------------------------------------------------------
    def _get(self, task_id: str) -> Task:
        task = self._tasks.get(task_id)
        if task is None:
            raise UnknownTask(task_id)
        return task

    def _is_queued(self, task_id: str) -> bool:
        """Whether ``task_id`` is a task waiting in the queue (not placed, ended or forgotten)."""
        task = self._tasks.get(task_id)
        return task is not None and task.state == TaskState.QUEUED

    def get(self, task_id: str) -> Task:
        """A copy of the task's record; UnknownTask if never seen (or forgotten)."""
        return copy.copy(self._get(task_id))

    def held_spec(self, spec: TaskSpec) -> TaskSpec | None:
        """The spec of the task a submission of ``spec`` would be answered
        with (that task, or ALREADY_EXISTS when the specs differ) instead of
        queueing anything; None when it would make a new task (an unknown
        id, or a REJECTED task's id its tenant submits again). No copy and
        no exception: a quota check asks it of every spec of a job array."""
        existing = self._tasks.get(spec.task_id)
        if existing is None or self._retries_rejected(existing, spec):
            return None
        return existing.spec

    def tasks(
        self, state: TaskState | None = None, tenant: str = "", limit: int = 1000, after_seq: int = 0
    ) -> list[Task]:
        """Copies of tasks, oldest submission first, filtered by state and
        tenant; with ``after_seq``, only those submitted after the task whose
        ``Task.seq`` it is (the next page of a listing: the table holds its
        tasks in ``seq`` order, and a task forgotten since does not move the
        place)."""
        out: list[Task] = []
        tasks = list(self._tasks.values())
        # the table is in seq order: a later page starts by bisection, not by
        # walking past every task of the pages before it
        start = bisect.bisect_right(tasks, after_seq, key=_SEQ) if after_seq else 0
        for task in itertools.islice(tasks, start, None):
            if state is not None and task.state != state:
                continue
            if tenant and task.spec.tenant != tenant:
                continue
            out.append(copy.copy(task))
            if len(out) >= limit:
                break
        return out

    def leased(self) -> list[Task]:
        """The leased tasks themselves, not copies, oldest submission first.
        For a reader that runs to completion between two calls of this
        scheduler and changes nothing: the coordinator's advisor reads every
        lease on the event loop every 30 s, where copying 16,000 of them
        (``tasks``) took ~22 ms, about what the plan itself takes."""
        leased = TaskState.LEASED
        return [task for task in self._tasks.values() if task.state == leased]

    def state_counts(self) -> Counter[TaskState]:
        """Tasks the scheduler knows (finished ones until forgotten), by
        state, without copying them: a metrics scrape on the coordinator's
        event loop counted through 16,000-80,000 copies."""
        return Counter(task.state for task in self._tasks.values())

    @property
    def last_snapshot(self) -> ClusterSnapshot | None:
        return self._last_snapshot

    @property
    def reservations(self) -> Reservations:
        """The live reservation stack (read it; change it only through the scheduler)."""
        return self._reservations

    def queued(self) -> int:
        """Tasks waiting in the queue, all classes."""
        return sum(self._queue.depths())

    @property
    def sla_misses(self) -> int:
        """P0 tasks that waited past the SLA bound, since start."""
        return self._queue.sla_misses

    # ---- submit -------------------------------------------------------------------------
    def submit(self, spec: TaskSpec, snapshot: ClusterSnapshot | None = None) -> Task:
        """Queue a task, or return the existing one for a repeat of the same spec.

        Raises InvalidTask (bad field) or TaskConflict (same id, other spec). A
        task that can never fit the cluster (``snapshot``, else the latest
        dispatched) comes back REJECTED with the reason. An id whose task was
        REJECTED is not a repeat: the spec is judged again as a new task
        (``_retries_rejected``).
        """
        spec.validate()
        existing = self._tasks.get(spec.task_id)
        if existing is not None:
            if self._retries_rejected(existing, spec):
                self._drop_rejected(existing)
                return self._enqueue(spec, snapshot)
            if existing.spec != spec:
                raise TaskConflict(spec.task_id, existing.spec.differing_fields(spec))
            return copy.copy(existing)
        return self._enqueue(spec, snapshot)

    @staticmethod
    def _retries_rejected(existing: Task, spec: TaskSpec) -> bool:
        """Whether ``spec`` is a new try of the REJECTED task ``existing``
        (the same tenant's; same spec or not): a rejection created nothing to
        keep the id for, and the cluster or the spec may have changed since,
        so the spec is judged again as a new task, whose record replaces the
        rejected one. Another tenant's rejected id stays taken (its owner's
        record is not replaced)."""
        return existing.state == TaskState.REJECTED and existing.spec.tenant == spec.tenant

    def _drop_rejected(self, task: Task) -> None:
        """Forget the REJECTED ``task`` before a new try of its id (``_retries_rejected``)."""
        task_id = task.task_id
        del self._tasks[task_id]  # the new record is the newest submission: it goes at the end
        try:
            self._finished.remove(task_id)  # else the retention would count (and drop) the new one
        except ValueError:
            pass
        if task.spec.deadline_s > 0 and any(t == task_id for _, t in self._deadlines):
            # rejected at its first dispatch, after its deadline was noted: that
            # deadline must not expire the new record
            self._deadlines = [d for d in self._deadlines if d[1] != task_id]
            heapq.heapify(self._deadlines)

    def _enqueue(self, spec: TaskSpec, snapshot: ClusterSnapshot | None) -> Task:
        """A new task for a validated ``spec`` whose id is not known yet."""
        now = self._clock()
        if snapshot is not None:
            self._last_snapshot = snapshot
        task = Task(
            spec=spec,
            state=TaskState.QUEUED,
            priority=Priority(spec.priority),
            submitted_at=now,
            queued_at=now,
            enqueued_at=now,
        )
        self._tasks[spec.task_id] = task
        reference = snapshot or self._last_snapshot
        reason = never_fits(reference, spec, self.config) if reference is not None else None
        if reason is not None:
            self._finish(task, TaskState.REJECTED, reason, now)
        else:
            if reference is None:
                self._unchecked.add(spec.task_id)
            self._queue.push(task, now)
            self.workload_mix.observe(spec)
            if spec.deadline_s > 0:
                heapq.heappush(self._deadlines, (now + spec.deadline_s, spec.task_id))
            self._changed(task)
        self._flush()
        return copy.copy(task)

    def submit_many(self, specs: Sequence[TaskSpec], snapshot: ClusterSnapshot | None = None) -> list[Task]:
        """``submit`` for each of ``specs``, all or nothing: every spec is
        validated and checked against the known tasks and the others of the
        batch before any is queued, so an error queues nothing. The error
        raised is ``submit``'s, with ``index`` set to the failing spec's
        position. A spec repeated within the batch (same id, same spec) is
        one task, as a resubmission is."""
        seen: dict[str, TaskSpec] = {}
        for i, spec in enumerate(specs):
            try:
                spec.validate()
                earlier = seen.get(spec.task_id)
                if earlier is None:
                    earlier = seen[spec.task_id] = spec
                    existing = self._tasks.get(spec.task_id)
                    if existing is not None and not self._retries_rejected(existing, spec):
                        earlier = existing.spec
                if earlier != spec:
                    raise TaskConflict(spec.task_id, earlier.differing_fields(spec))
            except SchedulerError as exc:
                exc.index = i  # type: ignore[attr-defined]
                raise
        # checked above: a known id is a resubmission (or a new try of a
        # rejected task), anything else is new; an id repeated in the batch
        # is the task its first occurrence made
        out = []
        made: set[str] = set()
        for spec in specs:
            existing = self._tasks.get(spec.task_id)
            if existing is not None and (spec.task_id in made or not self._retries_rejected(existing, spec)):
                out.append(copy.copy(existing))
                continue
            if existing is not None:
                self._drop_rejected(existing)
            out.append(self._enqueue(spec, snapshot))
            made.add(spec.task_id)
        return out

    # ---- dispatch -----------------------------------------------------------------------
    def _view_for(self, snapshot: ClusterSnapshot) -> PlacementView:
        # One view per snapshot: the reservation columns stay current through
        # refresh() on every reserve and release, so they are never rebuilt
        # while the snapshot stays the same.
        if self._view is None or self._view.snapshot is not snapshot:
            self._view = PlacementView(snapshot, self._reservations, self.config)
            self._view.attach(self._reservations)
        return self._view

    def dispatch(self, snapshot: ClusterSnapshot) -> list[Task]:
        """Place as many queued tasks as fit on ``snapshot``; return copies of those placed.

        Placements within one call reserve at once, so they never double-book;
        expired queue deadlines and aging are applied first.
        """
        now = self._clock()
        self._last_snapshot = snapshot
        view = self._view_for(snapshot)
        self._expire_deadlines(now)
        for task_id in self._unchecked:
            task = self._tasks.get(task_id)
            if task is None or task.state != TaskState.QUEUED:
                continue
            reason = never_fits(snapshot, task.spec, self.config)
            if reason is not None:
                self._queue.remove(task_id)
                self._finish(task, TaskState.REJECTED, reason, now)
        self._unchecked.clear()
        for task in self._queue.promote_due(now):
            self._changed(task)
        failed: dict[tuple, str] = {}
        for task_id in [t for t in self._held_nodes if not self._is_queued(t)]:
            del self._held_nodes[task_id]
            self._hold_lost.pop(task_id, None)
        if self._room_waits:
            self._forget_room_waits()
        self._forget_nominations(now)
        self._evicted_at = None
        self._nominated_rows = self._nomination_rows(view) if self._nominations else None
        held: dict[str, int | None] = {}  # barrier -> held node index, once per dispatch
        fences: dict[frozenset, np.ndarray] = {}  # held node set -> GPUs fenced tasks may use
        # held node index -> when its leases are expected to end; "lease_ends" ->
        # per node, the earliest expected lease end (_finish_by_waiting)
        drains: dict = {}
        fence_held: dict[frozenset[str], frozenset[int]] = {}  # fence -> the nodes its barriers hold

        def can_hold(task: Task) -> bool:
            task_id = task.spec.task_id
            index = held.get(task_id, held)  # held itself: not asked yet this dispatch
            if index is held:
                index = held[task_id] = self._held_node(task_id, view, now)
            return index is not None

        urgent: list[Task] | None = None
        # class -> GPUs off the nodes its tasks keep off if they can (None: no such node)
        kept: dict[int, np.ndarray | None] = {0: None}  # nothing is more urgent than P0

        def kept_off(cls: int) -> np.ndarray | None:
            nonlocal urgent
            if cls not in kept:
                if urgent is None:
                    urgent = self._urgent_sets()
                nodes = [held[t.task_id] for t in urgent if int(t.priority) < cls and can_hold(t)]
                kept[cls] = ~np.isin(view.node, nodes) if nodes else None
            return kept[cls]

        due = self._preempt_due

        no_victims, version = self._no_victims, self._victim_version

        def stuck(task: Task) -> bool:  # a P0 task that may evict, or has: offered before the rounds
            task_id = task.task_id
            return task_id in self._nominations or (
                task_id in due and due[task_id] <= now and no_victims.get(task_id) != version)

        placed = self._queue.drain(
            lambda t, fenced: self._try_place(t, view, now, failed, fenced, held, fences, drains, kept_off, fence_held),
            now,
            can_hold,
            stuck if self.config.preemption and (due or self._nominations) else None,
        )
        self._say_which_node_is_kept()
        # at the head of their classes, in the order they were first submitted
        # (as Kubernetes re-queues a preempted pod by its first attempt)
        self._queue.push_front(sorted(self._evicted, key=lambda t: t.submitted_at), now)
        if self._evicted:
            self._evicted_at = now
        self._evicted.clear()
        self._flush()
        # a task placed early in the drain may have been evicted for a P0 task later in it
        return [copy.copy(t) for t in placed if t.state == TaskState.LEASED]

    def _held_node(self, task_id: str, view: PlacementView, now: float) -> int | None:
        """The node held for a barrier task: fenced tasks may not take it (but
        those expected to end before its leases do, ``_drain_time``), so its
        leases drain and the barrier fits there (EASY-style backfill).

        Only a node the task could run on once gpulb's own leases there end
        (``_reachable``) is held; among them, and away from nodes other tasks
        hold where it can, the one with the most GPUs that fit it now, then
        the one where it is expected to finish first (``_expected_start``
        plus its estimate times the node's run factor, ``_run_factors``),
        then the one with the fewest leases. Kept while it stays reachable,
        and for ``_HOLD_GRACE_S`` after it does not (a lease that ended still
        shows in the memory readings for a round or two; without the grace
        the hold hopped away from a node just as it drained).

        None when no node is reachable: memory gpulb did not place (other
        tenants' jobs) blocks the task everywhere, and holding a node would
        only fence others off it for nothing. The demo's 4-GPU LoRA
        fine-tunes held a node for a whole phase that way, while the 2-GPU
        ones of the same class, fenced off it, waited behind them.
        """
        task = self._tasks.get(task_id)
        if task is None:
            return None
        spec = task.spec
        s = view.snapshot
        if not view.gpu_count:
            return None
        node_id = self._held_nodes.get(task_id)
        if node_id is None and not view.memo(
            (self._spec_shape(spec), "reachable_any"), lambda: bool(self._reachable(spec, view)[1].any())
        ):
            # the common answer for a deep queue's barriers, once per shape (below, in short)
            self._hold_lost.pop(task_id, None)
            return None
        usable, candidates = self._reachable(spec, view)
        index_of = _node_index(view)
        if node_id is not None:
            index = index_of.get(node_id)
            if index is not None and candidates[index]:
                self._hold_lost.pop(task_id, None)
                return index
            lost = self._hold_lost.setdefault(task_id, now)
            if index is not None and now - lost < _HOLD_GRACE_S and self._could_host(spec, view)[index]:
                return index
        self._hold_lost.pop(task_id, None)
        if not candidates.any():
            self._held_nodes.pop(task_id, None)
            return None
        fits = feasible(view, spec, self.config)
        fits_now = np.bincount(view.node, weights=fits, minlength=view.node_count)
        leases = np.bincount(view.node, weights=view.leases, minlength=view.node_count)
        nodes = np.flatnonzero(candidates)
        # another task's hold: a second one there would only queue behind it
        taken = {index_of.get(n) for t, n in self._held_nodes.items() if t != task_id}
        free = [i for i in nodes if int(i) not in taken]
        if free:
            nodes = np.asarray(free)
        rows = np.flatnonzero(usable & np.isin(view.node, nodes))
        rows = rows[np.argsort(view.node[rows], kind="stable")]
        rows_of = np.split(rows, np.flatnonzero(np.diff(view.node[rows])) + 1)  # in the order of nodes
        start = np.array([
            self._expected_start(spec, view, int(i), r, fits, now) for i, r in zip(nodes, rows_of)
        ])
        if spec.duration_s > 0:
            start = start + spec.duration_s * _run_factors(view, spec.kind)[nodes]  # when it would finish
        # most GPUs fitting now, then the earliest expected finish (start,
        # then its predicted run there: a fast node that frees later can
        # finish it sooner), then the fewest leases. Start first was tried: it
        # trusts estimates that processor sharing stretches (openb gpushare40
        # on 8 x 4 RTX 4090, load_aware: mean response 8.6 -> 16.3 h, a 4-GPU
        # P0 task held a node 427 h instead of 14 h); fits-now first: 8.4 h
        best = np.lexsort((leases[nodes], start, -fits_now[nodes]))[0]
        index = int(nodes[best])
        self._held_nodes[task_id] = s.node_ids[index]
        return index

    def _urgent_sets(self) -> list[Task]:
        """The most urgent queued multi-GPU tasks that did not fit (at most
        ``_KEPT_FREE_SETS``, by class, then by when they first failed): from
        the moment they fail, each softly holds the node ``_held_node`` picks
        for it, which tasks of less urgent classes avoid when they fit
        elsewhere (``_try_place``). Without it a P1 fine-tune on 2-4 GPUs
        waited on load_aware while P2 and P3 work, sent to the idlest GPUs,
        kept taking the very GPUs it needed, until it had failed long enough
        to become a barrier (``backfill_max_skips``)."""
        out: list[Task] = []
        for cls, ids in enumerate(self._blocked_sets):
            gone: list[str] = []  # left the queue
            promoted: list[Task] = []  # rank with their new class
            for task_id in ids:
                task = self._tasks.get(task_id)
                if task is None or task.state != TaskState.QUEUED:
                    gone.append(task_id)
                elif int(task.priority) != cls:
                    promoted.append(task)
                else:
                    out.append(task)
                    if len(out) == _KEPT_FREE_SETS:
                        break
            for task_id in gone:
                del ids[task_id]
            for task in promoted:
                del ids[task.task_id]
                self._blocked_sets[int(task.priority)][task.task_id] = None
            if len(out) == _KEPT_FREE_SETS:
                break
        return out

    def _unblocked(self, task_id: str) -> None:
        """``task_id`` left the queue: it no longer keeps work off a node."""
        for ids in self._blocked_sets:
            ids.pop(task_id, None)

    def _expected_start(
        self, spec: TaskSpec, view: PlacementView, index: int, rows: np.ndarray, fits: np.ndarray,
        now: float, *, estimates_only: bool = False,
    ) -> float:
        """When ``spec`` is expected to fit on node ``index`` if nothing new
        went there: the ``num_gpus``-th earliest time one of its ``rows`` (the
        GPUs that could be free of gpulb's leases) is free: now where it fits
        now, else when the last lease on it is expected to end at the node's
        run factor (a lease without an estimate, or past it, as long again as
        it has run; ``estimates_only``: never, so that only a lease's own
        estimate can make it end soon); ``inf`` with too few rows."""
        free_at = {int(r): now for r in rows}
        for other_id in self._by_node.get(view.snapshot.node_ids[index], ()):
            other = self._tasks.get(other_id)
            if other is None or other.assignment is None:
                continue
            started = other.assignment.run_start
            end = _expected_end(other, view, index)
            if other.spec.duration_s <= 0 or end <= now:
                # no estimate, or past it: expect it to run as long again as
                # it has run (the age estimate of heavy-tailed runs), >= 1 s
                end = math.inf if estimates_only else now + max(now - started, 1.0)
            for gpu_uuid in other.assignment.gpu_uuids:
                row = view.row_of.get(gpu_uuid)
                if row in free_at and not fits[row]:
                    free_at[row] = max(free_at[row], end)
        times = sorted(free_at.values())
        return times[spec.num_gpus - 1] if len(times) >= spec.num_gpus else math.inf

    def _reachable(self, spec: TaskSpec, view: PlacementView) -> tuple[np.ndarray, np.ndarray]:
        """``(per GPU, per node)``: whether ``spec`` would fit the GPU, and
        the node, once gpulb's leases there have ended (``_could_host``'s
        static checks, counting as free what those leases asked for). What
        stays is memory gpulb did not place, or a task's use beyond its ask,
        which only its owners can free. The same per shape until a
        reservation changes (``PlacementView.memo``): every blocked barrier
        asks it at every dispatch, so a deep queue of one shape paid it per
        task (QA: 6.1 million calls, most of a 1.3 s pass at 10^5 queued)."""
        reject = self.config.memory_reject_for(spec.tenant)
        key = ("reachable", spec.num_gpus, spec.vram_mib, reject, spec.gpu_spec,
               frozenset(spec.required_node_labels.items()))

        def compute() -> tuple[np.ndarray, np.ndarray]:
            rows = self._static_ok(spec, view)
            bound = view.total * (reject / 100.0)
            stays = np.maximum(view.committed - view.res_asked, 0.0)
            rows &= bound - stays > spec.vram_mib
            nodes = np.bincount(view.node, weights=rows, minlength=view.node_count) >= spec.num_gpus
            rows.flags.writeable = nodes.flags.writeable = False  # shared by every task of the shape
            return rows, nodes

        return view.memo(key, compute)  # type: ignore[return-value]

    def _static_ok(self, spec: TaskSpec, view: PlacementView) -> np.ndarray:
        """Per GPU: schedulable, and of the models and labels ``spec`` asks for."""
        static = view.node_ok.copy()
        if spec.gpu_spec:
            static &= view.spec_mask(spec.gpu_spec)
        if spec.required_node_labels:
            static &= view.label_mask(spec.required_node_labels)
        return static

    def _could_host(self, spec: TaskSpec, view: PlacementView) -> np.ndarray:
        """Per node: whether it could run ``spec`` once empty (schedulable,
        models, labels, enough GPUs with the memory)."""
        static = self._static_ok(spec, view)
        static &= view.total * (self.config.memory_reject_for(spec.tenant) / 100.0) >= spec.vram_mib
        return np.bincount(view.node, weights=static, minlength=view.node_count) >= spec.num_gpus

    def _drain_time(self, index: int, view: PlacementView, now: float) -> float:
        """When the leases on node ``index`` are expected to
        have ended, the latest ``_expected_end`` among them
        (``now`` with none; -inf when one has no estimate, as nothing can be
        known to end before it)."""
        s = view.snapshot
        end = now
        for task_id in self._by_node.get(s.node_ids[index], ()):
            task = self._tasks.get(task_id)
            if task is None or task.assignment is None:
                continue
            if task.spec.duration_s <= 0:
                return -math.inf
            end = max(end, _expected_end(task, view, index))
        return end

    def _finish_by_waiting(
        self,
        spec: TaskSpec,
        view: PlacementView,
        now: float,
        held: frozenset[int],
        feasible_now: np.ndarray,
        cache: dict,
    ) -> float:
        """When ``spec`` would be expected to finish if it kept off the held
        nodes: on a node where it fits now, ``now`` plus its estimate times the
        node's run factor (``_run_factors``); else
        where a lease is expected to end first, that end plus its run there
        (``inf`` with no such node). Optimistic (the first lease to end may
        not free room enough), so it errs towards waiting for a fast GPU."""
        ends = cache.get("lease_ends")
        if ends is None:
            # per node, the earliest expected end of a lease with an estimate
            # (an overrun one "ends" now); inf where none has one
            ends = np.full(view.node_count, math.inf)
            for index, node_id in enumerate(view.snapshot.node_ids):
                for task_id in self._by_node.get(node_id, ()):
                    task = self._tasks.get(task_id)
                    if task is None or task.assignment is None or task.spec.duration_s <= 0:
                        continue
                    end = _expected_end(task, view, index)
                    ends[index] = min(ends[index], max(now, end))
            cache["lease_ends"] = ends
        could = self._could_host(spec, view)
        fits = np.bincount(view.node, weights=feasible_now, minlength=view.node_count) >= spec.num_gpus
        start = np.where(fits, now, ends)
        could[list(held)] = False
        if not could.any():
            return math.inf
        return float(np.min((start + spec.duration_s * _run_factors(view, spec.kind))[could]))

    def _spec_shape(self, spec: TaskSpec) -> tuple:
        """What of ``spec`` decides where it fits (kept per task while it is queued)."""
        of_spec = self._spec_shapes.get(spec.task_id)
        if of_spec is None:
            of_spec = self._spec_shapes[spec.task_id] = (
                spec.num_gpus,
                spec.vram_mib,
                spec.gpu_share,  # GPUs running P0 work take a share up to 100 % (_p0_guarded)...
                spec.priority == Priority.P0,  # ...of tasks below P0 only
                self.config.memory_reject_for(spec.tenant),
                spec.gpu_spec,
                spec.needs_nvlink,
                spec.io_heavy,
                frozenset(spec.required_node_labels.items()),
            )
        return of_spec

    def _try_place(
        self,
        task: Task,
        view: PlacementView,
        now: float,
        failed: dict[tuple, str],
        fenced: frozenset[str] = frozenset(),
        held_cache: dict[str, int | None] | None = None,
        fences: dict[frozenset, np.ndarray] | None = None,
        drains: dict | None = None,
        kept_off: Callable[[int], np.ndarray | None] | None = None,
        fence_held: dict[frozenset[str], frozenset[int]] | None = None,
    ) -> Outcome:
        spec = task.spec
        held: frozenset[int] = _NOTHING_HELD
        if fenced:
            # a barrier's node is chosen once a dispatch, so a fence holds the
            # same nodes for every task behind it (thousands in a deep queue)
            known = fence_held.get(fenced) if fence_held is not None else None
            if known is None:
                held_cache = {} if held_cache is None else held_cache
                for barrier in fenced:
                    if barrier not in held_cache:
                        held_cache[barrier] = self._held_node(barrier, view, now)
                known = frozenset(held_cache[b] for b in fenced if held_cache[b] is not None)
                if fence_held is not None:
                    fence_held[fenced] = known
            held = known
        # Within one dispatch free resources only shrink, so a shape that did not
        # fit once will not fit later in the same dispatch: skip the work.
        of_spec = self._spec_shape(spec)
        nominated = self._nominated_rows
        own = self._nominations.get(spec.task_id) if nominated is not None else None
        shape = of_spec + (
            held,
            # with estimates, whether a held node is open to it depends on how long
            # it runs (its estimate, and its kind's learned run factor)
            (spec.duration_s, spec.kind) if held and self.config.backfill_estimate_factor > 0 else 0.0,
            # GPUs evicted for a P0 task are open to it alone
            spec.task_id if own is not None else None,
        )
        reason = failed.get(shape)
        if reason is None:
            mask = feasible(view, spec, self.config)
            guarded = self._p0_guarded(view, spec)
            if guarded is not None:
                guarded &= mask  # the GPUs it would fit but for the guard
                mask &= ~guarded
            mine = None  # the GPUs evicted for this task, where it passes the filters
            if nominated is not None:
                if own is None:
                    mask &= ~nominated
                else:
                    mine = mask & _rows_mask(view, own.gpu_uuids)
                    mask &= ~nominated
            if held:
                fences = {} if fences is None else fences
                allowed = fences.get(held)
                if allowed is None:
                    allowed = fences[held] = ~np.isin(view.node, list(held))
                factor = self.config.backfill_estimate_factor
                if spec.duration_s > 0 and factor > 0:
                    # EASY backfill: a held node stays open to a task expected to end
                    # before its leases do, so the barrier starts no later for it
                    drains = {} if drains is None else drains
                    waiting: float | None = None
                    for index in held:
                        drain = drains.get(index)
                        if drain is None:
                            drain = drains[index] = self._drain_time(index, view, now)
                        run = spec.duration_s * float(_run_factors(view, spec.kind)[index])
                        margin = max(factor, float(_overruns(view, spec.kind)[index]))
                        if now + margin * run > drain:
                            continue
                        if waiting is None:
                            waiting = self._finish_by_waiting(spec, view, now, held, mask, drains)
                        # ...and would not finish sooner by waiting for a faster node
                        # (a slow held node drains slowly, so it is open to much)
                        if now + run <= waiting:
                            allowed = allowed | (view.node == index)
                mask = mask & allowed
            if mine is not None:
                mask = mask | mine  # evicted for it: no barrier's fence keeps it off them
            away = kept_off(int(task.priority)) if kept_off is not None else None

            def choose(candidates: np.ndarray) -> Placement | None:
                if away is not None:
                    elsewhere = candidates & away
                    if elsewhere.any():
                        chosen = self._policy.choose(view, spec, elsewhere)
                        if chosen is not None:
                            return chosen
                return self._policy.choose(view, spec, candidates)

            room = self._growth_room(task, view, now)
            with_room = False  # placed where its kind's largest growth fits
            if room is None:
                placement = choose(mask)
                if placement is not None and spec.priority == Priority.P0:
                    placement, reason = self._urgent_room(task, view, now, held, mask, choose, placement)
                    if placement is not None:
                        placement, reason = self._urgent_compute(task, view, now, held, mask, choose, placement)
                    if placement is None:
                        if task.reason != reason:
                            task.reason = reason
                            self._changed(task)
                        return Outcome.BLOCKED
            else:
                # within one dispatch free room only shrinks: a shape and kind that
                # waited once waits again (an array of 200 such tasks pays once)
                room_key = shape + ("growth_room", spec.kind)
                reason = failed.get(room_key) if room[2] else None
                placement = None
                if reason is None:
                    placement = choose(mask & (view.headroom >= room[0]))
                    with_room = placement is not None
                    if placement is None and not room[2]:
                        placement = choose(mask)  # the wait is over: the best GPU it fits
                    elif placement is None and choose(mask) is not None:
                        reason = failed[room_key] = (
                            f"waiting up to {self.config.growth_room_wait_s:g} s for a GPU with "
                            f"{room[0]:,.0f} MiB free: room for the largest memory growth "
                            f"{spec.kind or 'its'} tasks have shown ({room[1]:.2f}x the ask)")
                if reason is not None:
                    # it fits now only where it could outgrow the memory left: wait a little
                    if spec.task_id not in self._room_waits:
                        self.room_wait_counts["waited"] += 1
                    self._room_waits[spec.task_id] = task.queued_at + self.config.growth_room_wait_s
                    if task.reason != reason:
                        task.reason = reason
                        self._changed(task)
                    return Outcome.BLOCKED
            if placement is not None:
                if self._room_waits.pop(spec.task_id, None) is not None:
                    self.room_wait_counts["found" if with_room else "gave_up"] += 1
                self._preempt_due.pop(spec.task_id, None)
                self._no_victims.pop(spec.task_id, None)
                kept = self._nominations.pop(spec.task_id, None)
                if kept is not None:
                    there = set(placement.gpu_uuids) <= set(kept.gpu_uuids)
                    self.preemption_counts["placed_there" if there else "placed_elsewhere"] += 1
                    # what it does not take is open to the rest of this dispatch
                    self._nominated_rows = self._nomination_rows(view)
                self._apply(task, view, placement, now)
                self._held_nodes.pop(task.task_id, None)
                if spec.num_gpus > 1:
                    self._unblocked(task.task_id)
                return Outcome.PLACED
            if guarded is not None and guarded.any():
                # (the filters' account would count those GPUs as passing)
                reason = (f"waiting: the {int(guarded.sum())} GPU(s) it would fit run P0 work that keeps their "
                          f"compute (its {spec.gpu_share:.0%} would take them over 100 %: preempt_for_compute)")
            else:
                reason = self._why_not(view, spec)
            if not self._reachable(spec, view)[1].any() and self._could_host(spec, view).any():
                # the operator's next question: would it fit once gpulb's own work ends?
                # (not where no node may take it at all: cordoned, unhealthy, the wrong model)
                reason += "; no node can take it until other processes there free memory (gpulb processes lists them)"
            failed[shape] = reason
        if spec.num_gpus > 1:
            self._blocked_sets[int(task.priority)][task.task_id] = None
        if spec.priority == Priority.P0 and self.config.preemption:
            evicted = self._nominations.get(spec.task_id)
            if evicted is None:
                due = self._preempt_due.setdefault(spec.task_id, task.queued_at + self.config.preempt_after_s)
                # a lease expected to end before its SLA runs out frees room for it:
                # wait for that rather than evict (QA: half of the evictions of a P0
                # run were for a task placed at once on a GPU another P0 lease freed,
                # its victim placed back where it had been)
                soon = self._room_before(task, view, now) if now >= due else None
                # within one dispatch victims only go: a shape no eviction made room for once won't later
                if now >= due and soon is None and shape + ("preempt",) not in failed:
                    evicted = self._preempt(task, view, now, held)
                    if evicted is None:
                        failed[shape + ("preempt",)] = reason
                if soon is not None:
                    # look again when the lease should have ended, or when it is time to evict
                    self._room_expected[spec.task_id] = soon[1]
                    reason += (f"; node {view.snapshot.node_ids[soon[0]]}'s leases are expected to free room for it "
                               f"in {max(soon[1] - now, 0.0):.1f} s, within its SLA: waiting for that, not evicting")
                if now >= due and evicted is None and soon is None:
                    self._no_victims[spec.task_id] = self._victim_version
                if now >= due and evicted is None and soon is None:
                    # the operator's next question: why did it not evict?
                    linked = " NVLink-connected" if spec.needs_nvlink and spec.num_gpus > 1 else ""
                    classes = "/".join(f"P{p}" for p in range(self.config.preempt_min_victim_priority, 4))
                    room = "a GPU" if spec.num_gpus == 1 else f"{spec.num_gpus}{linked} GPUs on one node"
                    reason += f"; evicting {classes} work would not free {room} for it"
            if evicted is not None:
                reason = (f"{reason}; {len(evicted.victims)} lower-priority task(s) evicted for it from node "
                          f"{evicted.node_id}: placing it there once their memory shows free")
        kept_for_it = self._held_nodes.get(task.task_id)
        if kept_for_it is not None:
            # why that node is quiet, for the operator reading the queue
            # as the last drain left it (_say_which_node_is_kept puts it right after this one)
            last_head = self._queue.head_barrier
            held = _kept_reason if last_head is None or last_head == task.task_id else _waits_reason
            reason = f"{reason}{held(kept_for_it)}"
        if task.reason != reason:
            task.reason = reason
            self._changed(task)
        return Outcome.BLOCKED if view.any_room() else Outcome.EXHAUSTED

    def _say_which_node_is_kept(self) -> None:
        """Only the most urgent barrier of a drain holds its node; the others
        keep their choice for when they are the most urgent. Their reasons,
        written when offered, said "is kept for it" of a node another task was
        then placed on (QA): say it of the head alone."""
        head = self._queue.head_barrier
        for task_id, node_id in self._held_nodes.items():
            task = self._tasks.get(task_id)
            if task is None or task.state is not TaskState.QUEUED:
                continue
            kept, waits = _kept_reason(node_id), _waits_reason(node_id)
            base = task.reason
            for said in (kept, waits):
                base = base.removesuffix(said)
            reason = base + (kept if task_id == head else waits)
            if reason != task.reason:
                task.reason = reason
                self._changed(task)

    def next_decision_at(self) -> float | None:
        """When the next decision that waits on time alone falls due (the
        clock's time), or None: a task waiting for room to grow stops waiting,
        a P0 task that fits nowhere may evict (``preempt_after_s``), GPUs
        kept for one lapse (``preempt_grace_s``), or, right after an eviction,
        its P0 task may fit already. A caller that dispatches
        only on events (the simulator) dispatches then, as the coordinator's
        periodic pass would."""
        self._forget_room_waits()
        now = self._clock()
        if self._evicted_at == now:
            # the victims' room may be free in the view already (one placed but
            # not yet running): try their P0 tasks again at once
            return now
        times = [end for end in self._room_waits.values() if end > now]
        times += [due for t, due in self._preempt_due.items()
                  if due > now and t not in self._nominations and self._is_queued(t)]
        times += [kept.until for kept in self._nominations.values() if kept.until > now]
        for task_id, at in list(self._room_expected.items()):
            if at > now and self._is_queued(task_id):
                times.append(at)
            else:
                del self._room_expected[task_id]  # due (the next pass judges it again), placed or gone
        return min(times, default=None)

    def _forget_room_waits(self) -> None:
        """Drop the waits of tasks that left the queue unplaced (cancelled,
        expired, rejected): no outcome to count."""
        for task_id in [t for t in self._room_waits if not self._is_queued(t)]:
            del self._room_waits[task_id]

    def _urgent_room(
        self, task: Task, view: PlacementView, now: float, fenced: frozenset[int], mask: np.ndarray,
        choose: Callable[[np.ndarray], Placement | None], placement: Placement,
    ) -> tuple[Placement | None, str]:
        """Where a P0 task that fits now goes when its kind's memory growth
        would not fit there (``preempt_for_growth``): ``(placement, "")`` to
        place it, ``(None, reason)`` to wait for GPUs evicted for it.

        Below P0 a task may wait a few seconds for a card with room to grow
        (``_growth_room``); a P0 task may not, and what was left of the OOM
        kills on the openb cluster were P0 inference tasks placed, with every
        card big enough busy, on one they outgrew. So a P0 task goes to a GPU
        with room for the largest growth its kind has shown when one can take
        it; when none can, it evicts lower-priority work from one that could
        (``_preempt``, the same choice of victims) and waits for it, but only
        until its SLA runs out (``p0_sla_s`` from when it was queued): if the
        victims' memory has not shown free by then, or nothing could be
        evicted, it takes ``placement``, the best GPU it fits. It evicts for
        growth once: after that it takes the GPU it fits."""
        cfg = self.config
        if not (cfg.preemption and cfg.preempt_for_growth):
            return placement, ""
        kept = self._nominations.get(task.task_id)
        if kept is None and task.task_id in self._evicted_for_growth:
            return placement, ""  # it evicted once and the wait lapsed
        grown = self._growth_need(task.spec, view)
        if grown is None:
            return placement, ""
        need, ratio = grown
        if min(float(view.headroom[r]) for r in placement.rows) >= need:
            return placement, ""
        with_memory = mask & (view.headroom >= need)
        if kept is not None:
            # the GPUs evicted for it, once their memory shows free: their
            # compute is free too (the smoothed load falls behind the readings)
            there = choose(with_memory & _rows_mask(view, kept.gpu_uuids))
            if there is not None:
                return there, ""
        # with compute to spare too: stacked onto a busy big card, urgent work
        # ran slower (openb cluster: slowdown p95 0.98 -> 1.74, README). A GPU
        # whose last lease just ended has it: its reading still shows that task
        roomy = choose(with_memory & ((view.load + 100.0 * task.spec.gpu_share <= 100.0) | self._just_emptied(view, now)))
        if roomy is not None:
            return roomy, ""
        if kept is None:
            until = task.queued_at + cfg.p0_sla_s - _SLA_MARGIN_S
            if until - now >= _MIN_GROWTH_WAIT_S:
                kept = self._preempt(task, view, now, fenced, want_mib=need, want_compute=True, until=until)
            if kept is None:
                # nothing to evict, or no time: the best GPU it fits (sharing a
                # big card's compute instead saved 3 of 12 kills on the openb
                # cluster but slowed P0 work: slowdown p95 0.98 -> 1.62)
                return placement, ""
            self._evicted_for_growth.add(task.task_id)
            self.preemption_counts["for_growth"] += 1
        return None, (f"waiting: {len(kept.victims)} lower-priority task(s) evicted for it from node "
                      f"{kept.node_id}, for room to grow ({need:,.0f} MiB: {ratio:.2f}x the ask, the largest "
                      f"growth {task.spec.kind or 'its'} tasks have shown); placing it there once their memory "
                      f"shows free, or at {kept.until - task.queued_at:g} s where it fits")

    def _urgent_compute(
        self, task: Task, view: PlacementView, now: float, fenced: frozenset[int], mask: np.ndarray,
        choose: Callable[[np.ndarray], Placement | None], placement: Placement,
    ) -> tuple[Placement | None, str]:
        """Where a P0 task that fits now goes when ``placement`` would
        oversubscribe its GPUs' compute (``preempt_for_compute``):
        ``(placement, "")`` to place it, ``(None, reason)`` to wait for GPUs
        evicted for it.

        Memory decides where a task fits, and a saturated cluster's big cards
        fit several batch tasks at once: QA (round 25) saw every P0 inference
        task placed at once on an A100 already running three batch tasks of
        a whole GPU's compute each, where it got about a quarter of the SMs,
        with no preemption and no SLA miss counted: urgent work stuck behind
        batch work on the GPU instead of in the queue. So a P0 task goes to a
        GPU with its share of compute to spare (``_compute_demand``) when one
        can take it; when none can, it evicts lower-priority work from one
        (``_preempt`` for compute, the same choice of victims) and waits for
        it until its SLA runs out, as for room to grow (``_urgent_room``);
        then, or when nothing could be evicted, it takes ``placement``. It
        evicts for compute once."""
        cfg = self.config
        share = 100.0 * task.spec.gpu_share
        if not (cfg.preemption and cfg.preempt_for_compute) or share <= 0:
            return placement, ""
        demand = self._compute_demand(view)
        spare = demand + share <= 100.0 + 1e-9
        if all(spare[r] for r in placement.rows):
            return placement, ""
        # not where its kind's memory growth would not fit (_urgent_room chose for that first)
        grown = self._growth_need(task.spec, view) if cfg.preempt_for_growth else None
        room = (view.headroom >= grown[0]) if grown is not None else True
        kept = self._nominations.get(task.task_id)
        if kept is not None:
            # the GPUs evicted for it, once their memory shows free: their
            # compute is free too (the readings fall behind, as for growth).
            # It fits there already, but placed before the victims' memory
            # shows gone its reservation's baseline would include them, and
            # it would count twice for as long as it runs (QA pass 25)
            there = choose(mask & _rows_mask(view, kept.gpu_uuids) & self._victims_gone(view, kept))
            if there is not None:
                return there, ""
        else:
            # only where it runs no slower than sharing the chosen GPU would let
            # it: a whole slow card loses to half a fast one (the mixed cluster's
            # M40 and K20c run 8-20x slower: P0 response +12-23 % sent there)
            factor = _run_factors(view, task.spec.kind)[view.node]
            shared = max(float(demand[r]) + share for r in placement.rows) / 100.0
            bound = max(float(factor[r]) for r in placement.rows) * shared
            roomy = choose(mask & (spare | self._just_emptied(view, now)) & room & (factor <= bound))
            if roomy is not None:
                return roomy, ""
            if task.task_id in self._evicted_for_compute:
                return placement, ""  # it evicted once and the wait lapsed
            until = task.queued_at + cfg.p0_sla_s - _SLA_MARGIN_S
            if until - now >= _MIN_GROWTH_WAIT_S:
                kept = self._preempt(task, view, now, fenced, want_compute=True, until=until, demand=demand,
                                     want_mib=grown[0] if grown is not None else None)
            if kept is None:
                return placement, ""  # nothing to evict, or no time: the best GPU it fits
            self._evicted_for_compute.add(task.task_id)
            self.preemption_counts["for_compute"] += 1
        why = (f", for compute (every GPU it fits has less than its {task.spec.gpu_share:.0%} to spare)"
               if task.task_id in self._evicted_for_compute else "")  # else evicted for memory, before
        return None, (f"waiting: {len(kept.victims)} lower-priority task(s) evicted for it from node "
                      f"{kept.node_id}{why}; placing it there once their memory shows free, "
                      f"or at {kept.until - task.queued_at:g} s where it fits")

    def _room_before(self, task: Task, view: PlacementView, now: float) -> tuple[int, float] | None:
        """``(node index, when)``: the node where the blocked P0 ``task`` is
        expected to fit soonest, if gpulb's leases there are expected to have
        ended (``_expected_start``: their own estimates at the node's run
        factor; a lease without one, or past it, is not expected to end)
        before its SLA runs out; None when none is, or it has no time left.
        An eviction costs its victim its run; waiting for a lease that ends
        anyway costs the P0 task no SLA miss."""
        # the latest a lease may end and still leave time to evict if it overruns
        # (the victims' memory shows free a couple of seconds after an eviction)
        until = task.queued_at + self.config.p0_sla_s - _SLA_MARGIN_S - _MIN_GROWTH_WAIT_S
        if until <= now or not view.gpu_count:
            return None
        spec = task.spec

        def soonest() -> tuple[int, float] | None:  # per shape and instant: a burst of P0 tasks asks alike
            usable, candidates = self._reachable(spec, view)
            if not candidates.any():
                return None
            fits = feasible(view, spec, self.config)
            best: tuple[int, float] | None = None
            for index in np.flatnonzero(candidates):
                rows = np.flatnonzero(usable & (view.node == index))
                start = self._expected_start(spec, view, int(index), rows, fits, now, estimates_only=True)
                if best is None or start < best[1]:
                    best = (int(index), start)
            return best

        best = view.memo((self._spec_shape(spec), "room_before", now), soonest)
        return best if best is not None and best[1] <= until else None  # type: ignore[return-value,index]

    def _p0_guarded(self, view: PlacementView, spec: TaskSpec) -> np.ndarray | None:
        """Per GPU, for a task below P0: whether it runs P0 work whose
        compute ``spec``'s share would oversubscribe (``_compute_demand`` plus
        the share over 100 %), which it may then not take; None when no GPU
        is so guarded (``preempt_for_compute`` off, a P0 task, no P0 lease).
        Without it the batch work evicted for a P0 task's compute came back
        to the same GPU as soon as the P0 task was placed there."""
        cfg = self.config
        if not self.p0_leases_on or spec.priority == Priority.P0 or not (cfg.preemption and cfg.preempt_for_compute):
            return None

        def rows_and_demand() -> tuple[np.ndarray, np.ndarray]:
            rows = [view.row_of[u] for u in self.p0_leases_on if u in view.row_of]
            index = np.asarray(rows, dtype=np.int64)
            return index, self._compute_demand(view)[index]

        rows, demand = view.memo("p0_compute", rows_and_demand)  # type: ignore[misc]
        over = demand + 100.0 * spec.gpu_share > 100.0 + 1e-9
        if not over.any():
            return None
        guarded = np.zeros(view.gpu_count, dtype=bool)
        guarded[rows[over]] = True
        return guarded

    def _victims_gone(self, view: PlacementView, kept: Nomination) -> np.ndarray:
        """Per GPU: not one of ``kept``'s, or its fresh reading shows the
        victims' memory gone (``Nomination.gone_below_mib``)."""
        gone = np.ones(view.gpu_count, dtype=bool)
        for uuid, below in zip(kept.gpu_uuids, kept.gone_below_mib):
            row = view.row_of.get(uuid)
            if row is not None:
                gone[row] = bool(view.fresh[row]) and float(view.used[row]) <= below
        return gone

    def _compute_demand(self, view: PlacementView) -> np.ndarray:
        """Per GPU, % of its compute asked for: gpulb's leases there by their
        shares, or the load (the reading and the reservations it does not
        show yet), whichever is higher. The reading stops at 100 %, so three
        batch tasks of a whole GPU each read as one. Do not modify it."""

        def compute() -> np.ndarray:
            demand = view.load.copy()
            res = self._reservations
            for gpu_uuid in res.reserved_gpus():
                row = view.row_of.get(gpu_uuid)
                if row is not None:
                    demand[row] = max(float(demand[row]), res.asked_util_pct(gpu_uuid))
            demand.flags.writeable = False  # shared until the next refresh
            return demand

        return view.memo("compute_demand", compute)  # type: ignore[return-value]

    def _just_emptied(self, view: PlacementView, now: float) -> np.ndarray:
        """Per GPU: gpulb's last lease on it ended under ``_RELEASE_SHOWS_S``
        ago and none has come since, so its compute reading may still show
        the task that left (on the openb cluster, P0 tasks that needed room
        to grow passed over such 80 GiB cards for a 24 GiB one they outgrew)."""
        for gpu_uuid in [u for u, t in self._emptied_at.items() if now - t > _RELEASE_SHOWS_S]:
            del self._emptied_at[gpu_uuid]
        if not self._emptied_at:
            return np.zeros(view.gpu_count, dtype=bool)
        return _rows_mask(view, list(self._emptied_at)) & (view.leases == 0)

    def _growth_room(self, task: Task, view: PlacementView, now: float) -> tuple[float, float, bool] | None:
        """(MiB, growth ratio, may wait): the memory free on a GPU that holds
        ``task`` grown by the largest peak-over-ask ratio its kind has shown,
        and whether it may still wait for one (``growth_room_wait_s`` since it
        was queued); None when it does not look for one.

        A task's memory grows past its ask, by a ratio learned from ended tasks
        (``scheduler.memgrowth``). The ``oom_risk`` score weighs the learned
        chance of outgrowing each GPU, but a chance of a few in a thousand
        loses to a faster card, and those few are OOM kills: on the openb
        cluster, whole-GPU asks of 13,107 MiB that grew 1.9-2.1x on a 24 GiB
        card. A task goes to a GPU with room for that growth when one can
        take it, and one that fits now only where its growth would not waits
        a few seconds for such a GPU. It looks only where GPUs
        differ in size: some GPU that may take it (healthy, open, its gpu_spec
        and labels, on one node for a multi-GPU task) is that big and some
        other GPU is not, so on a cluster of one card size nothing changes.
        Urgent work (P0 by spec) never waits, and only policies that score the
        learned risk (``oom_risk``: load_aware, fgd) do."""
        spec = task.spec
        wait = self.config.growth_room_wait_s
        if wait <= 0 or spec.priority == Priority.P0:
            return None
        grown = self._growth_need(spec, view)
        if grown is None:
            return None
        return grown[0], grown[1], now - task.queued_at < wait

    def _growth_need(self, spec: TaskSpec, view: PlacementView) -> tuple[float, float] | None:
        """(MiB, ratio): ``spec``'s ask grown by the largest peak-over-ask
        ratio its kind has shown, where some GPU that may take the task could
        hold that and some other could not (``_growth_room``); else None."""
        if spec.vram_mib <= 0 or not self._policy.weights.get("oom_risk"):
            return None  # a policy blind to memory growth (round_robin, binpack) or told to be
        ratio = largest_growth(view.snapshot.memory_growth, spec.kind)
        if ratio <= 1.0:
            return None
        need = float(spec.vram_mib) * ratio
        smallest = view.static_cache.get("growth_room.smallest")
        if smallest is None:  # per layout: the check below is all a cluster of one card size pays
            sized = view.total[view.total > 0]
            smallest = view.static_cache["growth_room.smallest"] = float(sized.min()) if sized.size else math.inf
        if need <= smallest:
            return None  # no card it could outgrow
        could = view.node_ok & view.healthy & (view.total >= need)
        if spec.gpu_spec:
            could &= view.spec_mask(spec.gpu_spec)
        if spec.required_node_labels:
            could &= view.label_mask(spec.required_node_labels)
        if spec.num_gpus > 1:
            if np.bincount(view.node, weights=could, minlength=view.node_count).max(initial=0) < spec.num_gpus:
                return None
        elif not could.any():
            return None
        return need, ratio

    # ---- preemption ---------------------------------------------------------------------
    def _forget_nominations(self, now: float) -> None:
        """Drop what preemption keeps for tasks that left the queue (cancelled,
        expired: placed ones were counted when placed), and the GPUs kept past
        ``preempt_grace_s`` (counted as lapsed: their task may evict again)."""
        for task_id in [t for t in self._preempt_due if not self._is_queued(t)]:
            del self._preempt_due[task_id]
            self._no_victims.pop(task_id, None)
        self._evicted_for_growth = {t for t in self._evicted_for_growth if self._is_queued(t)}
        self._evicted_for_compute = {t for t in self._evicted_for_compute if self._is_queued(t)}
        for task_id, kept in list(self._nominations.items()):
            if not self._is_queued(task_id):
                del self._nominations[task_id]
            elif kept.until <= now:
                del self._nominations[task_id]
                self._preempt_due[task_id] = now  # it may evict again, now
                self._no_victims.pop(task_id, None)
                self.preemption_counts["lapsed"] += 1
                log.warning("preemption lapsed for %s: the memory of %s on node %s did not show free in time",
                            task_id, ", ".join(kept.victims), kept.node_id)

    def _nomination_rows(self, view: PlacementView) -> np.ndarray | None:
        kept = [u for n in self._nominations.values() for u in n.gpu_uuids]
        return _rows_mask(view, kept) if kept else None

    def _preempt(
        self, task: Task, view: PlacementView, now: float, fenced: frozenset[int] = frozenset(),
        *, want_mib: float | None = None, want_compute: bool = False, until: float | None = None,
        demand: np.ndarray | None = None,
    ) -> Nomination | None:
        """Evict lower-priority leases for the P0 ``task``, which fits nowhere,
        from where that costs least, and keep those GPUs for it; the
        ``Nomination``, or None when no eviction would make room.

        Victims are leases of ``preempt_min_victim_priority`` and below (by
        spec), at most ``preempt_max_victims``. Each frees what it asked for
        (the memory of a task is not known apart from its GPU's reading); a
        GPU is a candidate when it passes every filter but memory (and is not
        kept for another P0 task) and its victims free enough that the task
        would pass the memory filters too. On each GPU the victims are taken
        in the order P3 before P2, movable (checkpointed, so they lose only a
        restart) before not; among movable ones the one evicted least often
        so far, among the others the most recently placed (the least work
        lost); until the task fits. Among GPUs (for a task of k GPUs, nodes
        with their k cheapest GPUs) the one the policy scores best for the
        task wins (its load, memory and predicted completion there: on a
        mixed cluster a cheap eviction on a slow card is a slow P0 task);
        among equals the cheapest eviction, as Kubernetes chooses: the least
        urgent most-urgent victim, then the fewest victims, then the fewest
        that are not movable, then the least GPU time lost. Nodes held for a blocked multi-GPU task ahead of it
        (``fenced``: indices) are not cleared for it: that task waits for them
        to drain. An NVLink task of several GPUs (tensor-parallel serving of
        a model too big for one card) clears GPUs that form one
        NVLink-connected group, the cheapest such group on each node
        (``_cheapest_linked``): the k cheapest GPUs of a node with NVLink in
        pairs are often in different pairs, and the task could not use them.

        ``want_mib``: memory each GPU must also have free for the task (room
        to grow, ``_urgent_room``); ``want_compute``: the victims must also
        free the compute its share needs (its GPU's load plus the share under
        100 %, each victim freeing its own share), the load taken from
        ``demand`` when given (``_compute_demand``); ``until``: when the kept
        GPUs lapse (default ``preempt_grace_s`` from now).
        """
        spec = task.spec
        cfg = self.config
        ok = self._static_ok(spec, view) & view.avail
        if spec.needs_nvlink:
            ok &= view.nvlink_ok  # as the placement's nvlink filter: a peer, competition under the limit
        if spec.io_heavy:
            ok &= view.io_ok
        if self._nominated_rows is not None:
            ok &= ~self._nominated_rows
        if fenced:
            ok &= ~np.isin(view.node, list(fenced))
        if not ok.any():
            return None
        # MiB the task still lacks per GPU under both memory filters (the VRAM
        # left, and the reject threshold, which it must stay under)
        pct = cfg.memory_reject_for(spec.tenant)
        room = np.minimum(view.headroom, view.total * (pct / 100.0) - view.committed - 1.0)
        lack = float(spec.vram_mib) - room
        if want_mib is not None:
            lack = np.maximum(lack, want_mib - view.headroom)
        # % of compute to free per GPU (none unless asked)
        busy = (view.load if demand is None else demand) + 100.0 * spec.gpu_share - 100.0 if want_compute else None
        min_victim = cfg.preempt_min_victim_priority
        on_row: dict[int, list[Task]] = {}
        for node_id, ids in self._by_node.items():
            for task_id in ids:
                victim = self._tasks.get(task_id)
                if victim is None or victim.assignment is None or int(victim.spec.priority) < min_victim:
                    continue
                if now - victim.assignment.placed_at < cfg.preempt_min_run_s:
                    continue  # exempt while it has run less than preempt_min_run_s
                for gpu_uuid in victim.assignment.gpu_uuids:
                    row = view.row_of.get(gpu_uuid)
                    if row is not None and ok[row]:
                        on_row.setdefault(row, []).append(victim)

        def lost(victim: Task) -> float:  # GPU-seconds its run so far is worth
            return (now - victim.assignment.placed_at) * victim.spec.num_gpus  # type: ignore[union-attr]

        def victims_for(row: int) -> tuple[Task, ...] | None:
            need = float(lack[row])
            need_util = float(busy[row]) if busy is not None else 0.0
            if need <= 0 and need_util <= 0:
                return ()
            chosen: list[Task] = []
            freed = freed_util = 0.0
            # a task that checkpoints loses a restart whenever it goes, so among
            # those the one evicted least often goes (the most recently placed
            # was the same batch task over and over: 152 evictions of one on the
            # 8 x 4 openb replay); one that starts over loses its run so far.
            # The task id last: _by_node holds sets, whose order changes from
            # one process to the next.
            def order_key(v: Task) -> tuple:
                times = self._times_evicted.get(v.task_id, 0)
                spent = (times, lost(v)) if v.spec.movable else (lost(v), times)
                return (-int(v.spec.priority), not v.spec.movable, spent, v.task_id)

            order = sorted(on_row.get(row, ()), key=order_key)
            for victim in order:
                if len(chosen) == cfg.preempt_max_victims:
                    return None
                chosen.append(victim)
                freed += float(victim.spec.vram_mib)
                # the load counts a task's compute once: the part its GPU's reading
                # shows and the part still reserved (Reservations) add up to its share
                freed_util += 100.0 * victim.spec.gpu_share
                if freed >= need and freed_util >= need_util:
                    return tuple(chosen)
            return None

        def cost(victims: Sequence[Task]) -> tuple:
            return (-min(int(v.spec.priority) for v in victims), len(victims),
                    sum(not v.spec.movable for v in victims), sum(lost(v) for v in victims))

        # where the task would rather run, as the policy scores it (load, memory,
        # predicted completion): on a mixed cluster, clearing the GPU whose
        # victims cost least sent urgent work to cards 20x slower (openb default,
        # prediction on: mean P0 response 25,725 -> 27,795 s)
        scores = np.nan_to_num(np.asarray(self._policy.gpu_scores(view, spec), dtype=np.float64), nan=np.inf)
        best: tuple | None = None
        if spec.num_gpus == 1:
            for row in sorted(on_row):
                victims = victims_for(row)
                if victims:
                    key = (float(scores[row]),) + cost(victims) + (row,)
                    if best is None or key < best[0]:
                        best = (key, (row,), victims)
        else:
            rows_of: dict[int, list[int]] = {}
            for row in np.flatnonzero(ok):
                rows_of.setdefault(int(view.node[row]), []).append(int(row))
            for node, rows in sorted(rows_of.items()):
                if len(rows) < spec.num_gpus or not any(r in on_row for r in rows):
                    continue
                options = []
                for row in rows:
                    victims = victims_for(row)
                    if victims is not None:
                        options.append((cost(victims) if victims else (), row, victims))
                if len(options) < spec.num_gpus:
                    continue
                options.sort(key=lambda o: (o[0] != (), o[0], o[1]))
                if spec.needs_nvlink:
                    picked = _cheapest_linked(options, spec.num_gpus, view, cost)
                    if picked is None:
                        continue
                else:
                    picked = options[: spec.num_gpus]
                union = {v.task_id: v for _, _, vs in picked for v in vs}
                if not union or len(union) > cfg.preempt_max_victims:
                    continue
                key = (float(np.mean(scores[[r for _, r, _ in picked]])),) + cost(list(union.values())) + (node,)
                if best is None or key < best[0]:
                    best = (key, tuple(r for _, r, _ in picked), tuple(union.values()))
        if best is None:
            return None
        _, rows, victims = best
        s = view.snapshot
        node_id = s.node_ids[int(view.node[rows[0]])]
        gone_below = []
        for r in rows:
            uuid = str(s.gpu_uuid[r])
            asked = sum(float(v.spec.vram_mib) for v in victims if uuid in v.assignment.gpu_uuids)  # type: ignore[union-attr]
            gone_below.append(float(view.used[r]) - 0.5 * asked)
        for victim in victims:
            self._evict(victim, task, node_id, now)
        kept = Nomination(
            node_id=node_id,
            gpu_uuids=tuple(str(s.gpu_uuid[r]) for r in rows),
            victims=tuple(v.task_id for v in victims),
            until=until if until is not None else now + cfg.preempt_grace_s,
            gone_below_mib=tuple(gone_below),
        )
        self._nominations[task.task_id] = kept
        self._preempt_due.pop(task.task_id, None)
        self._nominated_rows = self._nomination_rows(view)
        self.preemption_counts["nominated"] += 1
        self.preemption_counts["evicted"] += len(victims)
        log.info("preempted %s on node %s for P0 task %s", ", ".join(kept.victims), node_id, task.task_id)
        return kept

    def _evict(self, victim: Task, by: Task, node_id: str, now: float) -> None:
        """End ``victim``'s lease for the P0 task ``by``: PREEMPTED (its lease
        holder and its agent stop it), then QUEUED at its spec priority, at
        the head of its class once the dispatch's drain is done."""
        self._release(victim)
        self._times_evicted[victim.task_id] += 1
        victim.state = TaskState.PREEMPTED
        # the victim's owner reads these: the P0 task may be another tenant's,
        # so it is not named here (the log names it: _preempt, and the
        # coordinator's task_preempted line)
        victim.reason = f"preempted for a P0 task on node {node_id}"
        self._changed(victim)  # watchers see the eviction, with the GPUs it left, before the re-queue
        victim.state = TaskState.QUEUED
        victim.assignment = None
        victim.reason = "re-queued after it was preempted for a P0 task"
        victim.priority = Priority(victim.spec.priority)
        victim.queued_at = now
        self._evicted.append(victim)
        self._changed(victim)

    def nominations(self) -> dict[str, Nomination]:
        """P0 task id -> the GPUs evicted for it and kept for it now."""
        return dict(self._nominations)

    def _why_not(self, view: PlacementView, spec: TaskSpec) -> str:
        result = explain(view, spec, self.config)
        if result.passed:
            linked = " NVLink-connected" if spec.needs_nvlink else ""
            return (
                f"waiting: {result.passed} GPU{'s pass' if result.passed != 1 else ' passes'} the filters but no node "
                f"has {spec.num_gpus}{linked} of them"
            )
        return "waiting: " + describe(result.rejected, result.total)

    def _apply(self, task: Task, view: PlacementView, placement: Placement, now: float, *, moved: bool = False) -> None:
        """Lease ``placement`` to ``task`` (``moved``: a migration, which is
        neither a new placement nor an attempt: the retry rule counts attempts)."""
        spec = task.spec
        self._spec_shapes.pop(spec.task_id, None)
        if int(spec.priority) >= self.config.preempt_min_victim_priority:
            self._victim_version += 1  # a victim P0 tasks that found none may evict
        lease = self._leases.grant(spec.task_id, now, self.config.lease_s)
        # the readings the reservation fades against (stale ones too: see Reservations)
        used = [float(view.used[r]) for r in placement.rows]
        util = [float(view.util_reading[r]) for r in placement.rows]
        self._reservations.add(
            lease.lease_id, placement.gpu_uuids, float(spec.vram_mib), 100.0 * spec.gpu_share, used, util
        )
        if spec.priority == Priority.P0:  # before the refresh clears what the view remembers of them
            for gpu_uuid in placement.gpu_uuids:
                self.p0_leases_on[gpu_uuid] = self.p0_leases_on.get(gpu_uuid, 0) + 1
        view.refresh(placement.gpu_uuids)
        self._policy.commit(view, placement)
        task.state = TaskState.LEASED
        task.reason = ""
        if not moved:
            task.attempts += 1
        task.assignment = Assignment(
            node_id=placement.node_id,
            gpu_indices=placement.gpu_indices,
            gpu_uuids=placement.gpu_uuids,
            lease_id=lease.lease_id,
            lease_expires_at=lease.expires_at,
            score=placement.score,
            placed_at=now,
            run_started_at=task.assignment.run_start if moved and task.assignment is not None else None,
        )
        self._by_node.setdefault(placement.node_id, set()).add(spec.task_id)
        if moved:
            self.migrated += 1
        else:
            self.placed += 1
        self._changed(task)

    # ---- leases -------------------------------------------------------------------------
    def _release(self, task: Task) -> None:
        """End the task's lease and reservation (task stays in its current state)."""
        assignment = task.assignment
        if assignment is None:
            return
        self.count_p0_lease(task, -1)
        self._leases.release(assignment.lease_id)
        uuids = self._reservations.release(assignment.lease_id)
        now = self._clock()
        reserved = self._reservations.reserved_gpus()  # a key view: gpu() would mark the simulator's mirror dirty
        for gpu_uuid in uuids:
            if gpu_uuid not in reserved:
                self._emptied_at[gpu_uuid] = now
        if self._view is not None:
            self._view.refresh(uuids)
        on_node = self._by_node.get(assignment.node_id)
        if on_node is not None:
            on_node.discard(task.task_id)
            if not on_node:
                del self._by_node[assignment.node_id]

    def count_p0_lease(self, task: Task, delta: int) -> None:
        """Keep ``p0_leases_on`` (``_p0_guarded``) as ``task``'s lease comes
        (1) or goes (-1); the state's restore calls it for restored leases."""
        if task.spec.priority != Priority.P0 or task.assignment is None:
            return
        on = self.p0_leases_on
        for gpu_uuid in task.assignment.gpu_uuids:
            count = on.get(gpu_uuid, 0) + delta
            if count > 0:
                on[gpu_uuid] = count
            else:
                on.pop(gpu_uuid, None)

    def _finish(self, task: Task, state: TaskState, reason: str, now: float) -> None:
        self._spec_shapes.pop(task.task_id, None)
        self._times_evicted.pop(task.task_id, None)
        task.state = state
        task.reason = reason
        task.finished_at = now
        if task.spec.num_gpus > 1:
            self._unblocked(task.task_id)
        self._finished.append(task.task_id)
        while len(self._finished) > self.config.retain_finished:
            old = self._finished.popleft()
            record = self._tasks.get(old)
            if record is not None and record.terminal:
                del self._tasks[old]
        self._changed(task)

    def prune_finished(self, older_than_s: float, *, now: float | None = None, limit: int | None = None) -> int:
        """Forget finished tasks that finished more than ``older_than_s``
        before ``now`` (default: the clock), oldest first: GetTask no longer
        finds them and their ids may be submitted anew, as after a restart
        whose store dropped them by the same rule (the coordinator's
        ``finished_retention_s``). ``retain_finished`` bounds their count
        besides. Returns how many were forgotten.

        Incremental: tasks finish in clock order, so the walk stops at the
        first one young enough to keep (one finished later at an earlier
        ``now`` given to ``expire_leases`` waits for the ones before it) and
        costs only what it drops. ``limit``: look at most at this many, so a
        caller on an event loop can drop a backlog in slices.
        """
        cutoff = (self._clock() if now is None else now) - older_than_s
        finished, tasks = self._finished, self._tasks
        looked = forgotten = 0
        while finished and (limit is None or looked < limit):
            looked += 1
            record = tasks.get(finished[0])
            if record is not None and record.terminal:
                # no finish time (never, from _finish): the oldest, as the restore orders them
                if record.finished_at is not None and record.finished_at >= cutoff:
                    break
                del tasks[finished[0]]
                forgotten += 1
            finished.popleft()
        return forgotten

    def _leased(self, task_id: str, lease_id: str, now: float) -> Task:
        """The task if ``lease_id`` is its live lease, else NotLeaseHolder."""
        self._expire_leases(now)
        task = self._get(task_id)
        assignment = task.assignment
        if task.state != TaskState.LEASED or assignment is None:
            if task.state == TaskState.EXPIRED and assignment and assignment.lease_id == lease_id:
                raise NotLeaseHolder(task_id, lease_id, "the lease expired")
            raise NotLeaseHolder(task_id, lease_id, f"task is {task.state.name}, not LEASED")
        if assignment.lease_id != lease_id:
            raise NotLeaseHolder(task_id, lease_id, "not the task's current lease")
        return task

    def complete(
        self, task_id: str, lease_id: str, failed: bool = False, *, at: float | None = None, oom_killed: bool = False,
    ) -> Task:
        """The lease holder reports the end: COMPLETED, or FAILED when ``failed``
        (or ``oom_killed``: killed for running out of GPU memory, which its
        reason says: an operator reading one task could not tell, QA pass 25).

        ``at``: when the task ended, on this scheduler's clock, for a report
        that arrives after the fact (an agent's task event held across a
        coordinator restart or a stream outage): it becomes ``finished_at``,
        so the run time learned from the task is its own, not the outage's.
        Clamped to [the lease's ``placed_at``, now] (an agent's clock may be
        off); None or NaN: now. The lease is judged as of now.

        Repeating the call for an already completed/failed task with the same
        lease returns it unchanged (an RPC retry).
        """
        now = self._clock()
        task = self._get(task_id)
        if (
            task.state in (TaskState.COMPLETED, TaskState.FAILED)
            and task.assignment is not None
            and task.assignment.lease_id == lease_id
        ):
            return copy.copy(task)
        try:
            task = self._leased(task_id, lease_id, now)
        finally:
            self._flush()
        self._release(task)
        ended = now
        if at is not None and math.isfinite(at) and task.assignment is not None:
            ended = min(max(float(at), task.assignment.placed_at), now)
        if oom_killed:
            self._finish(task, TaskState.FAILED, "killed for running out of GPU memory (reported by the lease holder)",
                         ended)
        elif failed:
            self._finish(task, TaskState.FAILED, "the lease holder reported failure", ended)
        else:
            self._finish(task, TaskState.COMPLETED, "", ended)
        self._flush()
        return copy.copy(task)

    def start_again(self, task_id: str) -> bool:
        """The leased task ``task_id`` is placed again on its GPUs because its
        host does not run it (a placement lost while its stream was down, a
        restarted host, or a lease restored after a coordinator restart whose
        task had not started): its reservation counts in full until a
        reading shows it, not as a running task's would (already in the
        readings). False when the task holds no lease."""
        task = self._tasks.get(task_id)
        if task is None or task.state is not TaskState.LEASED or task.assignment is None:
            return False
        uuids = task.assignment.gpu_uuids
        nan = [math.nan] * len(uuids)  # not in any reading yet, and those at hand may be from before
        if not self._reservations.start_again(task.assignment.lease_id, nan, nan):
            return False
        if self._view is not None:
            self._view.refresh(uuids)
        return True

    def leased_on(self, node_id: str) -> list[Task]:
        """Copies of the tasks holding a lease on ``node_id``, by task id."""
        return [copy.copy(self._tasks[t]) for t in sorted(self._by_node.get(node_id, ()))]

    def migrate(
        self, task_id: str, lease_id: str, to_gpu_uuids: Sequence[str], snapshot: ClusterSnapshot | None = None
    ) -> Task:
        """Move a leased task to other GPUs in one step: the old lease and its
        reservation end and a new lease on ``to_gpu_uuids`` begins, in the
        same call, so no queued task can take the destination between the
        two (a rebalance plan's move, carried out by an executor that
        checkpoints the task and restarts it there). The destination must be
        on one node, none of the task's current GPUs, and pass every filter
        for the task's spec as the cluster is now (``snapshot``, else the
        last one dispatched on). The task keeps its id, priority, queue time
        and attempts; its assignment, lease id and ``placed_at`` are new
        (``run_started_at`` keeps the run's first placement, which is what
        the backfill's estimates of when it ends count from).

        Raises NotLeaseHolder (not the live lease), InvalidArgument
        (``to_gpu_uuid``: wrong count, repeated, unknown, on two nodes, or
        one the task already has) and Unplaceable (the destination fails a
        filter, named; an NVLink task's GPUs are not one NVLink-connected
        group; its node is kept for a blocked multi-GPU task; or no cluster
        view yet). Nothing changes on error.
        """
        now = self._clock()
        try:
            task = self._leased(task_id, lease_id, now)
        finally:
            self._flush()
        spec = task.spec
        uuids = tuple(to_gpu_uuids)
        field = "to_gpu_uuid"
        if len(uuids) != spec.num_gpus:
            raise InvalidArgument(field, f"the task runs on {spec.num_gpus} GPU(s); {len(uuids)} given")
        if len(set(uuids)) != len(uuids):
            raise InvalidArgument(field, "a GPU is named twice")
        current = set(task.assignment.gpu_uuids)  # type: ignore[union-attr]
        mine = [u for u in uuids if u in current]
        if mine:
            raise InvalidArgument(field, f"{mine[0]} is already one of the task's GPUs")
        snap = snapshot if snapshot is not None else self._last_snapshot
        if snap is None:
            raise Unplaceable("no cluster view yet: no dispatch has run")
        view = self._view_for(snap)
        rows = []
        for u in uuids:
            row = view.row_of.get(u)
            if row is None:
                raise InvalidArgument(field, f"unknown GPU {u!r}")
            rows.append(row)
        nodes = {int(snap.gpu_node[r]) for r in rows}
        if len(nodes) != 1:
            raise InvalidArgument(field, "the GPUs are on more than one node")
        node = nodes.pop()
        node_id = snap.node_ids[node]
        if spec.needs_nvlink and spec.num_gpus > 1:
            indices = [int(snap.gpu_index[r]) for r in rows]
            if len(nvlink_groups(snap.node_nvlink[node], indices)) != 1:
                raise Unplaceable(f"{field}: the task needs NVLink and GPUs {indices} of node {node_id} "
                                  "are not one NVLink-connected group")
        # the caller may be a tenant, and the task the GPUs are kept for
        # another tenant's: the messages do not name it
        for blocked, held in self._held_nodes.items():
            if held == node_id and self._is_queued(blocked):
                raise Unplaceable(f"{field}: node {node_id} is kept for a blocked multi-GPU task while "
                                  "gpulb's tasks there end")
        for p0_id, kept in self._nominations.items():
            taken = set(kept.gpu_uuids) & set(uuids)
            if taken and self._is_queued(p0_id):
                raise Unplaceable(f"{field}: {sorted(taken)[0]} is kept for a P0 task: lower-priority "
                                  "tasks were evicted from it to make room")
        for u, row in zip(uuids, rows):
            failed = first_failure(view, spec, row, self.config)
            if failed is not None:
                raise Unplaceable(f"{field}: {u} on node {node_id} fails the {failed} filter for this task",
                                  {failed: 1})
        self._release(task)
        placement = Placement(
            node=node,
            node_id=node_id,
            rows=tuple(rows),
            gpu_indices=tuple(int(snap.gpu_index[r]) for r in rows),
            gpu_uuids=uuids,
            score=ScoreBreakdown(policy="migration", total=0.0, terms={}, candidates=len(uuids)),
        )
        self._apply(task, view, placement, now, moved=True)
        self._flush()
        return copy.copy(task)

    def renew(self, task_id: str, lease_id: str, extend_s: float = 0.0) -> Task:
        """Move the lease's expiry to now + ``extend_s`` (0 = the configured
        lease length) when that is later than it is: a renewal never shortens
        a lease (a small ``extend_s``, or milliseconds sent as seconds, leaves
        it as it is); the task shows the expiry in force."""
        if not (
            isinstance(extend_s, (int, float))
            and math.isfinite(extend_s)
            and 0 <= extend_s <= self.config.max_lease_extend_s
        ):
            raise InvalidArgument(
                "extend_s", f"must be in 0..{self.config.max_lease_extend_s:g} s, got {extend_s!r}"
            )
        now = self._clock()
        try:
            task = self._leased(task_id, lease_id, now)
        finally:
            self._flush()
        extend = extend_s or self.config.lease_s
        current = self._leases.get(lease_id)
        if current is None or now + extend > current.expires_at:
            lease = self._leases.renew(lease_id, now, extend)
            task.assignment = replace(task.assignment, lease_expires_at=lease.expires_at)
            self._changed(task)
        self._flush()
        return copy.copy(task)

    def cancel(self, task_id: str, reason: str = "") -> Task:
        """Cancel a queued or leased task; cancelling a cancelled task returns it."""
        now = self._clock()
        task = self._get(task_id)
        if task.state == TaskState.CANCELLED:
            return copy.copy(task)
        if task.terminal:
            raise TaskFinished(task_id, task.state.name)
        if task.state == TaskState.QUEUED:
            self._queue.remove(task_id)
        else:
            self._release(task)
        self._finish(task, TaskState.CANCELLED, reason or "cancelled", now)
        self._flush()
        return copy.copy(task)

    def _expire_leases(self, now: float) -> list[Task]:
        out: list[Task] = []
        for lease in self._leases.expired(now):
            task = self._tasks.get(lease.task_id)
            if task is None or task.state != TaskState.LEASED:
                continue
            self._release(task)
            self._finish(task, TaskState.EXPIRED, "the lease ran out without renewal", now)
            out.append(task)
        return out

    def expire_leases(self, now: float | None = None) -> list[Task]:
        """EXPIRE every lease with ``expires_at <= now`` (default: the clock); copies of the tasks."""
        expired = self._expire_leases(self._clock() if now is None else now)
        self._flush()
        return [copy.copy(t) for t in expired]

    def _expire_deadlines(self, now: float) -> list[Task]:
        out: list[Task] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, task_id = heapq.heappop(self._deadlines)
            task = self._tasks.get(task_id)
            if task is None or task.state != TaskState.QUEUED:
                continue
            self._queue.remove(task_id)
            self._finish(
                task,
                TaskState.EXPIRED,
                f"deadline_s {task.spec.deadline_s:g} passed while queued",
                now,
            )
            out.append(task)
        return out

    def expire_deadlines(self, now: float | None = None) -> list[Task]:
        """EXPIRE queued tasks whose ``deadline_s`` since submission has passed."""
        expired = self._expire_deadlines(self._clock() if now is None else now)
        self._flush()
        return [copy.copy(t) for t in expired]

    # ---- nodes ----------------------------------------------------------------------------
    def node_removed(self, node_id: str) -> list[Task]:
        """Tasks leased on the node become LOST, and QUEUED again when retryable.

        A retryable task's listeners see its run end as LOST with
        ``requeued`` set (not terminal: it has not ended, a watch goes on and
        it is not counted as finished), then QUEUED; the others end LOST.
        Returns copies of the affected tasks in their final state.
        """
        now = self._clock()
        affected: list[Task] = []
        for task_id in sorted(self._by_node.get(node_id, ())):
            task = self._tasks[task_id]
            self._lose(task, f"node {node_id} was removed while the task ran",
                       f"re-queued after node {node_id} was removed", now)
            affected.append(task)
        self._flush()
        return [copy.copy(t) for t in affected]

    def gpus_gone(self, node_id: str, present_uuids: Collection[str]) -> list[Task]:
        """Tasks leased on GPUs of ``node_id`` that the node no longer has
        (its host registered again without them: a card off the bus, a host
        back with fewer GPUs) are lost as on a removed node, and QUEUED
        again when retryable; their reason starts with ``GPU_GONE``. Without
        this their leases stayed on GPUs that do not exist until they ran
        out, or (placed again on a simulated host) ended FAILED as if the
        task had failed. Returns copies of the affected tasks."""
        present = set(present_uuids)
        now = self._clock()
        affected: list[Task] = []
        for task_id in sorted(self._by_node.get(node_id, ())):
            task = self._tasks[task_id]
            a = task.assignment
            gone = [u for u in (a.gpu_uuids if a is not None else ()) if u not in present]
            if not gone:
                continue
            self._lose(task, f"{GPU_GONE}{gone[0]} of node {node_id} is not among the GPUs its host registered",
                       f"re-queued after {gone[0]} of node {node_id} was gone", now)
            affected.append(task)
        self._flush()
        return [copy.copy(t) for t in affected]

    def _lose(self, task: Task, lost_reason: str, requeued_reason: str, now: float) -> None:
        """The run of the leased ``task`` is lost: LOST for good, or (a
        retryable kind with attempts left) LOST with ``requeued`` set, then
        QUEUED again. A retryable task's listeners see its run end as LOST
        (not terminal: it has not ended, a watch goes on and it is not
        counted as finished), then QUEUED."""
        self._release(task)
        spec = task.spec
        retry = (spec.movable or spec.kind.lower() in self.config.retry_kinds) and (
            task.attempts < self.config.max_attempts
        )
        if not retry:
            self._finish(task, TaskState.LOST, lost_reason, now)
            return
        task.state = TaskState.LOST
        task.reason = lost_reason
        task.requeued = True  # the run ended, the task did not: listeners must not take it as final
        self._changed(task)  # watchers see the loss before the re-queue
        task.requeued = False
        task.state = TaskState.QUEUED
        task.assignment = None
        task.reason = requeued_reason
        task.priority = Priority(spec.priority)
        task.queued_at = now
        self._queue.push(task, now)
        self._changed(task)

    # ---- policy -----------------------------------------------------------------------------
    def _make_policy(self, name: str, weights: Mapping[str, float] | None = None) -> Policy:
        policy = make_policy(name, weights)
        policy.workload_mix = self.workload_mix
        return policy

    def set_policy(self, name: str = "", weights: Mapping[str, float] | None = None) -> PolicyInfo:
        """Switch policy (empty name keeps the current one) and change the given weights.

        Nothing changes when the name or a weight is invalid.
        """
        name = name or self._policy.NAME
        if name not in POLICIES:
            raise UnknownPolicy(name, list(POLICIES))
        policy = self._policies.get(name) or self._make_policy(name)
        policy.update_weights(weights or {})  # raises before anything switches
        self._policies[name] = policy
        self._policy = policy
        return self.get_policy()

    def reconfigure(self, config: SchedulerConfig) -> PolicyInfo:
        """Apply a new configuration live (SIGHUP): thresholds and weights hold
        from the next decision on; the policy switches as with ``set_policy``.
        Nothing changes when the configuration or its policy is invalid."""
        config = config.validate()
        if config.policy not in POLICIES:
            raise UnknownPolicy(config.policy, list(POLICIES))
        policy = self._make_policy(config.policy, config.weights)  # raises before anything changes
        old, self.config = self.config, config
        self._queue.reconfigure(config)
        self._policies[policy.NAME] = policy
        self._policy = policy
        self._view = None  # per-snapshot caches read thresholds from the config
        self._spec_shapes.clear()  # per-tenant memory thresholds are part of them
        self._recheck_lowered_thresholds(old)
        return self.get_policy()

    def _recheck_lowered_thresholds(self, old: SchedulerConfig) -> None:
        """Judge again the queued tasks whose tenant's memory reject % the
        new configuration lowers: one that can no longer fit any node even
        when empty would otherwise wait for ever (QA pass 25), while the same
        spec submitted now is rejected at once. Against the last snapshot
        dispatched they are REJECTED now with the reason (the listeners hear
        it: a waiting ScheduleTask returns, the reload can say which); without
        one they are left to the first dispatch, as tasks submitted before
        any node are (``_unchecked``)."""
        lowered = {
            task.task_id: task for task in self._tasks.values()
            if task.state == TaskState.QUEUED
            and self.config.memory_reject_for(task.spec.tenant) < old.memory_reject_for(task.spec.tenant)
        }
        if not lowered:
            return
        snapshot = self._last_snapshot
        if snapshot is None or snapshot.gpu_count == 0:
            self._unchecked.update(lowered)
            return
        now = self._clock()
        for task_id, task in lowered.items():
            reason = never_fits(snapshot, task.spec, self.config)
            if reason is not None:
                self._queue.remove(task_id)
                self._finish(task, TaskState.REJECTED, reason, now)
        self._flush()

    def get_policy(self) -> PolicyInfo:
        return PolicyInfo(
            name=self._policy.NAME,
            weights=dict(self._policy.weights),
            available=tuple(POLICIES),
        )

    # ---- summaries -----------------------------------------------------------------------------
    def queue_summary(self, tenant: str | None = None) -> QueueSummary:
        """Depth and oldest wait per class, the head in dispatch order, counters.

        ``tenant``: the head holds only that tenant's tasks (the first
        ``queue_head_limit`` of them in dispatch order); the depths, waits
        and counters stay those of every tenant."""
        now = self._clock()
        for task in self._queue.promote_due(now):
            self._changed(task)
        self._flush()
        depths = self._queue.depths()
        waits = self._queue.oldest_wait(now)
        head: list[Task] = []
        for task in self._queue.ordered():
            if len(head) >= self.config.queue_head_limit:
                break
            if tenant is not None and task.spec.tenant != tenant:
                continue
            head.append(copy.copy(task))
        return QueueSummary(
            classes=tuple(
                ClassSummary(Priority(c), depths[c], waits[c]) for c in range(len(depths))
            ),
            head=tuple(head),
            sla_misses=self._queue.sla_misses,
            placed=self.placed,
        )


def _cheapest_linked(
    options: list[tuple[tuple, int, tuple]], k: int, view: PlacementView,
    cost: Callable[[Sequence[Task]], tuple],
) -> list[tuple[tuple, int, tuple]] | None:
    """Of one node's eviction ``options`` (``(cost, row, victims)``, cheapest
    first; cost ``()`` for a GPU with room already), ``k`` that form one
    NVLink-connected group, or None when none do: the ``k`` cheapest when
    they are connected (on an NVSwitch host always), else the best of the
    groups grown from each GPU along NVLink, adding the cheapest linked GPU
    at each step, as the policies' set search grows a set (by the fewest
    GPUs to clear, then the cost of their victims together, a victim on two
    of them counted once, then the lowest rows). Host-local bit masks, so a
    fully busy cluster of 1,000 8-GPU hosts pays about what a task without
    NVLink does (an exhaustive search over every k-set took 0.1-0.6 s)."""
    bits = [1 << int(view.local_bit[row]) for _, row, _ in options]
    peers = [int(view.adj_bits[row]) for _, row, _ in options]

    def grown_from(first: int) -> list[int] | None:
        chosen, members, reach = [first], bits[first], peers[first]
        while len(chosen) < k:
            step = next((j for j in range(len(options)) if bits[j] & reach and not bits[j] & members), None)
            if step is None:
                return None
            chosen.append(step)
            members |= bits[step]
            reach |= peers[step]
        return chosen

    cheapest = list(range(k))
    members = 0
    for j in cheapest:
        members |= bits[j]
    reach = bits[0]
    for _ in range(k):  # k rounds of spreading along links reach every member of a connected set
        for j in cheapest:
            if bits[j] & reach:
                reach |= peers[j] & members
    if reach == members:
        return options[:k]
    best: tuple | None = None
    for first in range(len(options) - k + 1):
        group = grown_from(first)
        if group is None:
            continue
        picked = [options[j] for j in group]
        union = {v.task_id: v for _, _, vs in picked for v in vs}
        key = (sum(c != () for c, _, _ in picked), cost(list(union.values())) if union else (),
               sorted(row for _, row, _ in picked))
        if best is None or key < best[0]:
            best = (key, picked)
    return best[1] if best is not None else None


def _rows_mask(view: PlacementView, gpu_uuids: Sequence[str]) -> np.ndarray:
    """Per GPU of ``view``: whether it is one of ``gpu_uuids`` (unknown ones are ignored)."""
    mask = np.zeros(view.gpu_count, dtype=bool)
    rows = [view.row_of[u] for u in gpu_uuids if u in view.row_of]
    mask[rows] = True
    return mask


def _node_index(view: PlacementView) -> dict[str, int]:
    """Node id -> node index of the view's snapshot, built once per view."""
    index = view.static_cache.get("engine.node_index")
    if index is None:
        index = view.static_cache["engine.node_index"] = {n: i for i, n in enumerate(view.snapshot.node_ids)}
    return index  # type: ignore[return-value]


def _expected_end(task: Task, view: PlacementView, index: int) -> float:
    """When a leased task's run on node ``index`` is expected to end: its
    estimate times the node's run factor for its kind (``_run_factors``),
    from the run's first placement (a migrated run resumes from its
    checkpoint; it does not start over)."""
    factor = float(_run_factors(view, task.spec.kind)[index])
    return task.assignment.run_start + task.spec.duration_s * factor  # type: ignore[union-attr]


def _learned_by_node(
    view: PlacementView, columns: Mapping[str, np.ndarray], kind: str, name: str, every_kind: bool = False
) -> np.ndarray:
    """Per node, the largest finite positive value over its GPUs of a learned
    per-kind column of the snapshot (``columns[kind]``; with ``every_kind``,
    else the every-kind column), 0 where nothing is learned; cached per view
    as ``(name, kind)``."""
    key = (name, kind)
    cached = view.static_cache.get(key)
    if cached is not None:
        return cached
    out = np.zeros(view.node_count)
    column = columns.get(kind) if columns else None
    if column is None and every_kind and columns:
        column = columns.get(ANY_KIND)
    if column is not None and column.size == view.gpu_count:
        known = np.isfinite(column) & (column > 0)
        np.maximum.at(out, view.node[known], column[known])
    view.static_cache[key] = out
    return out


def _overruns(view: PlacementView, kind: str) -> np.ndarray:
    """Per node, how many times its predicted run a task of ``kind`` may
    take there (the snapshot's learned ``gpu_overrun``, the node's largest;
    0 where nothing is learned): where clients misjudge a kind's run times,
    the backfill's margin widens from ``backfill_estimate_factor`` to it."""
    return _learned_by_node(view, view.snapshot.gpu_overrun, kind, "backfill.overrun")


def _run_factors(view: PlacementView, kind: str) -> np.ndarray:
    """Per node, how many times its ``duration_s`` estimate a task of
    ``kind`` is expected to run there, for the backfill's arithmetic: the
    learned slowdown (actual over estimated run time, ``SpeedPredictor``)
    of the node's slowest GPU for that kind where the snapshot carries it,
    else ``1 / speed`` (1.0 where the speed is unknown). Learned, it also
    corrects clients that estimate short, and runs stretched by GPU sharing:
    the predictor learns from each completion against the estimate the
    client gave. Cached per view and kind."""
    key = ("backfill.run_factor", kind)
    cached = view.static_cache.get(key)
    if cached is not None:
        return cached
    speeds = view.snapshot.node_speed
    learned = _learned_by_node(view, view.snapshot.gpu_slowdown, kind, "backfill.slowdown", every_kind=True)
    factors = np.where(learned > 0, learned, 1.0 / np.where(np.isfinite(speeds) & (speeds > 0), speeds, 1.0))
    view.static_cache[key] = factors
    return factors
