"""The hybrid priority queue: classes P0..P3, FIFO inside a class, drained in
smooth weighted rounds (8:4:2:1 by default), with aging, a P0 SLA watch and a
bounded backfill.

Dispatch order
    Classes take turns by smooth weighted round robin (nginx's SWRR) over the
    non-empty classes: every turn each non-empty class ``c`` gains ``w[c]``,
    the class with the most credit (ties: the more urgent class) goes next and
    pays ``sum(w)`` of the classes that took part. The credits persist across
    dispatches and only *placements* are charged, so when every class is
    backlogged the long-run placement shares are exactly ``w[c] / sum(w)``, and a
    class that keeps losing its turn to backfill accumulates credit until it
    comes first again.

Aging
    A task in P1, P2 or P3 is promoted one class up once it has waited
    ``promote_after_s[c]`` in its *current* class: it is due at
    ``entered_at + threshold`` and promoted when ``now >= due`` (never earlier).
    Its new class counts from that due instant, not from when ``promote_due``
    happened to run, so promotions do not drift with the dispatch rate and a
    long jump of a virtual clock promotes through several classes at once.
    A promoted task joins the tail of its new class.

P0 SLA
    A task whose *spec* priority is P0 and that is still queued ``sla_s`` after
    it entered the queue is marked ``sla_missed``, counted once.

Backfill rule (no starvation)
    ``drain`` tries tasks in dispatch order; a task that does not fit is
    *blocked* and the tasks behind it may still go (backfill). A blocked task
    becomes a *barrier* once it has been blocked for ``backfill_max_head_wait_s``
    (since it first failed) or has failed ``backfill_max_skips`` times. After a
    barrier of class ``c`` has been tried in a drain, the tasks of class ``c``
    and every less urgent class are still offered, but *fenced*: ``try_place``
    receives the id of the most urgent barrier met so far and must keep them
    off the resources it holds for it (the engine holds one node the barrier
    fits once gpulb's leases there end: EASY-style backfill, where only the
    head has a reservation; a fenced task whose duration estimate ends before
    that node's leases are expected to may still use it, see the engine's
    ``backfill_estimate_factor``). More urgent classes are not fenced. A
    barrier for which nothing can be held (``can_hold``: other tenants'
    memory blocks it on every node) does not become the head: fencing others
    could not make it fit, and the next barrier may hold instead. The blocked
    state survives promotion, so a barrier stays one, and when the head is
    placed the next barrier becomes the head.

    Why no task starves, given finite lease durations and a task that fits an
    empty node (the engine rejects the rest at submission), and memory gpulb
    did not place that is freed in the end: a blocked task
    becomes a barrier within a bounded time; from then on fenced tasks never
    land on its reserved node, aging lifts it to P0 within
    ``sum(promote_after_s)``, after which only the finitely many P0 tasks queued
    before it can still take that node; running leases there end, and it fits.
    Unlike closing every class behind a barrier, the rest of the cluster keeps
    working meanwhile.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Iterator, Sequence

from scheduler.config import SchedulerConfig
from scheduler.task import Priority, Task

__all__ = ["AgingQueue", "Outcome", "CLASSES"]

CLASSES = 4


class Outcome(Enum):
    """What ``drain``'s callback did with a task."""

    PLACED = "placed"
    BLOCKED = "blocked"  # did not fit; later tasks may still fit
    EXHAUSTED = "exhausted"  # did not fit, and nothing else can fit this drain


# dead promotion-heap entries tolerated before a rebuild is considered
_COMPACT_AT = 1024
#: the fence of a task with no barrier ahead of it
_NO_FENCE: frozenset[str] = frozenset()


@dataclass(slots=True, eq=False)
class _Entry:
    task: Task
    task_id: str  # the task's (read on every offer of a deep queue)
    cls: int
    due_at: float  # promotion due instant (inf in P0)
    blocked_since: float | None = None
    skips: int = 0


class AgingQueue:
    """Priority classes with aging, weighted draining and bounded backfill (see module)."""

    def __init__(
        self,
        *,
        weights: Sequence[int] = (8, 4, 2, 1),
        promote_after_s: Sequence[float] = (30.0, 300.0, 600.0),
        sla_s: float = 5.0,
        backfill_max_head_wait_s: float = 60.0,
        backfill_max_skips: int = 100,
    ) -> None:
        if len(weights) != CLASSES or any(w < 1 for w in weights):
            raise ValueError("weights: one integer >= 1 per class P0..P3")
        if len(promote_after_s) != CLASSES - 1 or any(not t > 0 for t in promote_after_s):
            raise ValueError("promote_after_s: one threshold > 0 for each of P1, P2, P3")
        self._weights = tuple(int(w) for w in weights)
        #: the barrier that held a node at the end of the last drain (only the
        #: most urgent one met does), None when none did
        self.head_barrier: str | None = None
        # index = class; P0 never promotes
        self._promote_after = (math.inf, *(float(t) for t in promote_after_s))
        self._sla_s = float(sla_s)
        self._max_wait = float(backfill_max_head_wait_s)
        self._max_skips = int(backfill_max_skips)
        # dicts keep insertion order: FIFO per class with O(1) removal by id
        self._classes: list[dict[str, _Entry]] = [{} for _ in range(CLASSES)]
        self._index: dict[str, _Entry] = {}
        self._credit = [0] * CLASSES  # persistent SWRR credits
        self._due: list[tuple[float, int, _Entry]] = []  # promotion heap
        # entries in _due whose task left the queue (lazy deletion); the heap is
        # rebuilt once they are the larger part, or every placed task would stay
        # referenced until its class threshold passed (10 minutes for P3)
        self._dead_due = 0
        self._seq = itertools.count()
        self._sla_watch: deque[_Entry] = deque()
        self.sla_misses = 0

    @classmethod
    def from_config(cls, config: SchedulerConfig) -> "AgingQueue":
        return cls(
            weights=config.class_weights,
            promote_after_s=config.promote_after_s,
            sla_s=config.p0_sla_s,
            backfill_max_head_wait_s=config.backfill_max_head_wait_s,
            backfill_max_skips=config.backfill_max_skips,
        )

    def reconfigure(self, config: SchedulerConfig) -> None:
        """New class weights and thresholds from now on. Tasks already waiting
        keep the promotion time they were given when they entered their class."""
        self._weights = tuple(int(w) for w in config.class_weights)
        self._promote_after = (math.inf, *(float(t) for t in config.promote_after_s))
        self._sla_s = float(config.p0_sla_s)
        self._max_wait = float(config.backfill_max_head_wait_s)
        self._max_skips = int(config.backfill_max_skips)

    # ---- membership -------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, task_id: object) -> bool:
        return task_id in self._index

    def get(self, task_id: str) -> Task | None:
        entry = self._index.get(task_id)
        return entry.task if entry is not None else None

    def push(self, task: Task, now: float) -> None:
        """Append ``task`` to the tail of class ``task.priority``; it enters now."""
        if task.task_id in self._index:
            raise ValueError(f"task {task.task_id!r} is already queued")
        self._enter(task, int(task.priority), now)
        if int(task.spec.priority) == Priority.P0 and not task.sla_missed:
            self._sla_watch.append(self._index[task.task_id])

    def push_front(self, tasks: Sequence[Task], now: float) -> None:
        """Put ``tasks`` at the head of their classes, in the order given; they
        enter now. For tasks that lost their place through no doing of their
        own (leases evicted for a P0 task): at the tail, an evicted batch task
        waited behind every task that arrived while it ran, and one evicted in
        the dispatch that had just placed it lost its turn altogether."""
        heads: dict[int, list[str]] = {}
        for task in tasks:
            self.push(task, now)
            heads.setdefault(int(task.priority), []).append(task.task_id)
        for cls, ids in heads.items():
            old = self._classes[cls]
            front = {task_id: old[task_id] for task_id in ids}
            front.update((k, v) for k, v in old.items() if k not in front)
            self._classes[cls] = front

    def remove(self, task_id: str) -> Task | None:
        """Take a task out of the queue (cancelled, expired); None if not queued."""
        entry = self._index.get(task_id)
        if entry is None:
            return None
        self._drop(entry)
        return entry.task

    def _enter(self, task: Task, cls: int, entered_at: float) -> None:
        task.priority = Priority(cls)
        task.enqueued_at = entered_at
        entry = _Entry(task=task, task_id=task.task_id, cls=cls, due_at=entered_at + self._promote_after[cls])
        self._classes[cls][task.task_id] = entry
        self._index[task.task_id] = entry
        if cls > 0:
            heapq.heappush(self._due, (entry.due_at, next(self._seq), entry))

    def _drop(self, entry: _Entry) -> None:
        del self._classes[entry.cls][entry.task_id]
        del self._index[entry.task_id]
        if not self._classes[entry.cls]:
            # an emptied class leaves the rotation; it must not come back with old credit
            self._credit[entry.cls] = 0
        if entry.cls > 0:
            self._dead_due += 1
            if self._dead_due > _COMPACT_AT and 2 * self._dead_due > len(self._due):
                self._compact_due()

    def _compact_due(self) -> None:
        """Rebuild the promotion heap from its live entries (amortised O(1) a drop)."""
        self._due = [item for item in self._due if self._live(item[2]) and item[2].due_at == item[0]]
        heapq.heapify(self._due)
        self._dead_due = 0

    def _live(self, entry: _Entry) -> bool:
        return self._index.get(entry.task_id) is entry

    # ---- aging and SLA ------------------------------------------------------------
    def promote_due(self, now: float) -> list[Task]:
        """Promote every task whose class threshold has passed; mark P0 SLA misses.

        Returns the promoted tasks (a task promoted twice appears once).
        """
        promoted: dict[str, Task] = {}
        while self._due and self._due[0][0] <= now:
            due_at, _, entry = heapq.heappop(self._due)
            if not self._live(entry) or entry.due_at != due_at:
                self._dead_due = max(0, self._dead_due - 1)
                continue  # placed, cancelled or already moved: lazy heap deletion
            del self._classes[entry.cls][entry.task_id]
            if not self._classes[entry.cls]:
                self._credit[entry.cls] = 0
            del self._index[entry.task_id]
            self._enter(entry.task, entry.cls - 1, due_at)
            # promotion does not unblock it: it stays as close to a barrier as it was
            moved = self._index[entry.task_id]
            moved.blocked_since, moved.skips = entry.blocked_since, entry.skips
            promoted[entry.task_id] = entry.task
        self._check_sla(now)
        return list(promoted.values())

    def _check_sla(self, now: float) -> None:
        watch = self._sla_watch
        while watch:
            entry = watch[0]
            task = entry.task
            if not self._live(entry) or task.sla_missed:
                watch.popleft()
                continue
            if now < task.queued_at + self._sla_s:
                break  # the watch is in queue order: later ones are younger
            watch.popleft()
            self.mark_sla(task, now)

    def mark_sla(self, task: Task, now: float) -> None:
        """Mark a spec-P0 task that waited ``sla_s`` or more (counted once)."""
        if (
            int(task.spec.priority) == Priority.P0
            and not task.sla_missed
            and now >= task.queued_at + self._sla_s
        ):
            task.sla_missed = True
            self.sla_misses += 1

    # ---- order ----------------------------------------------------------------------
    def _pick(self, credit: list[int], active: Sequence[int]) -> int:
        """One SWRR turn over ``active`` classes, mutating ``credit``."""
        best = active[0]
        total = 0
        for c in active:
            credit[c] += self._weights[c]
            total += self._weights[c]
            if credit[c] > credit[best]:
                best = c
        credit[best] -= total
        return best

    def _charge(self, cls: int) -> None:
        """Persistent SWRR turn forced to ``cls`` (a placement of that class)."""
        total = 0
        for c in range(CLASSES):
            if self._classes[c]:
                self._credit[c] += self._weights[c]
                total += self._weights[c]
        self._credit[cls] -= total

    def ordered(self) -> Iterator[Task]:
        """Queued tasks in the order ``drain`` tries them when nothing blocks."""
        lists = [list(d.values()) for d in self._classes]
        pos = [0] * CLASSES
        credit = list(self._credit)
        while True:
            active = [c for c in range(CLASSES) if pos[c] < len(lists[c])]
            if not active:
                return
            c = self._pick(credit, active)
            yield lists[c][pos[c]].task
            pos[c] += 1

    def drain(
        self,
        try_place: Callable[[Task, frozenset[str]], Outcome],
        now: float,
        can_hold: Callable[[Task], bool] | None = None,
        urgent: Callable[[Task], bool] | None = None,
    ) -> list[Task]:
        """Offer queued tasks to ``try_place(task, fenced_by)`` in dispatch order;
        return those placed.

        ``fenced_by`` holds the ids of the barriers ahead of the task whose
        reserved resources it must not take (empty: no fence). Placed tasks
        leave the queue. ``try_place`` must not push or remove tasks itself.
        ``can_hold(task)``: whether anything can be reserved for a barrier
        (the engine: a node it could run on once gpulb's leases there end);
        one that cannot does not become the head, so the next barrier may.
        ``urgent(task)``: P0 tasks offered first, before the weighted rounds
        (the engine: those stuck long enough to preempt that may evict, so
        that work of other classes does not take, in the same pass, the room
        they would otherwise evict it from), with the class-0 tasks queued
        before them. See the module docstring for the backfill rule.
        """
        self.promote_due(now)
        placed: list[Task] = []
        # The most urgent barrier met so far in this drain (class, task id): only
        # it holds a node. Holding one per barrier would, with many blocked
        # tasks, hold every node and stall the cluster as a global barrier did.
        head: tuple[int, str] | None = None
        head_fence: frozenset[str] = _NO_FENCE

        def offer(entry: _Entry) -> Outcome:
            nonlocal head, head_fence
            fenced = head_fence if head is not None and head[0] <= entry.cls else _NO_FENCE
            outcome = try_place(entry.task, fenced)
            if outcome is Outcome.PLACED:
                self._charge(entry.cls)
                self._drop(entry)
                self.mark_sla(entry.task, now)
                placed.append(entry.task)
                return outcome
            entry.skips += 1
            if entry.blocked_since is None:
                entry.blocked_since = now
            if (
                (head is None or entry.cls < head[0])
                and self._is_barrier(entry, now)
                and (can_hold is None or can_hold(entry.task))
            ):
                head = (entry.cls, entry.task_id)
                head_fence = frozenset((head[1],))
            return outcome

        offered: set[str] = set()
        if urgent is not None:
            # class 0 in its own order up to the last urgent task: ahead of the
            # other classes, not of the class-0 tasks queued before them (tasks
            # aged into P0 included: only the P0 work queued before an aged
            # task may still go first, as the aging bound promises)
            entries = list(self._classes[0].values())
            last = max((i for i, e in enumerate(entries) if urgent(e.task)), default=-1)
            for entry in entries[:last + 1]:
                offered.add(entry.task_id)
                if offer(entry) is Outcome.EXHAUSTED:
                    self.head_barrier = head[1] if head is not None else None
                    return placed
        lists = [list(d.values()) for d in self._classes]
        index = self._index
        pos = [0] * CLASSES
        credit = list(self._credit)
        # classes with tasks left to offer, in class order (kept as classes run
        # out rather than rebuilt per task: a deep queue is walked every dispatch)
        active = [c for c in range(CLASSES) if lists[c]]
        while active:
            c = self._pick(credit, active)
            entry = lists[c][pos[c]]
            pos[c] += 1
            if pos[c] == len(lists[c]):
                active.remove(c)
            if index.get(entry.task_id) is not entry or entry.task_id in offered:
                continue  # not _live(): inlined, a deep queue is walked every dispatch
            if offer(entry) is Outcome.EXHAUSTED:
                break
        self.head_barrier = head[1] if head is not None else None
        return placed

    def is_barrier(self, task_id: str, now: float) -> bool:
        """Whether a queued task has been blocked past the backfill bound."""
        entry = self._index.get(task_id)
        return entry is not None and self._is_barrier(entry, now)

    def _is_barrier(self, entry: _Entry, now: float) -> bool:
        if entry.blocked_since is None:
            return False
        return entry.skips >= self._max_skips or now - entry.blocked_since >= self._max_wait

    # ---- summaries ------------------------------------------------------------------
    def depths(self) -> tuple[int, int, int, int]:
        d = self._classes
        return (len(d[0]), len(d[1]), len(d[2]), len(d[3]))

    def oldest_wait(self, now: float) -> tuple[float, ...]:
        """s since the longest-waiting task of each class entered the queue (0 if empty)."""
        return tuple(
            max((now - e.task.queued_at for e in d.values()), default=0.0) for d in self._classes
        )

    def tasks(self) -> Iterator[Task]:
        """Every queued task, class by class, FIFO inside a class."""
        for d in self._classes:
            for entry in d.values():
                yield entry.task
