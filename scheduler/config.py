"""Every threshold and weight of the scheduler, with its unit, in one dataclass.

The coordinator fills it from its configuration file; tests and the simulator
construct it directly. ``validate()`` raises ``InvalidArgument`` naming the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

from scheduler.errors import InvalidArgument

__all__ = ["SchedulerConfig"]


#: s, the longest lease or lease extension a coordinator takes (its settings
#: refuse more): an expiry goes out as int64 Unix nanoseconds, ~1e10 s overflows
#: it and every RPC returning the task fails; 1e8 s is over three years. Not
#: checked here: the simulator leases for 1e12 s (never expiring) and sends no RPC.
LEASE_S_MAX = 1e8

#: the classes' names, most urgent first (``scheduler.task.Priority``)
_PRIORITY_NAMES = ("P0", "P1", "P2", "P3")


@dataclass(frozen=True)
class SchedulerConfig:
    # ---- queue ----------------------------------------------------------------
    # Dispatch share of P0..P3 when every class is backlogged (smooth weighted
    # round robin over the non-empty classes).
    class_weights: tuple[int, int, int, int] = (8, 4, 2, 1)
    # s a task waits in P1, P2, P3 before it is promoted one class up.
    promote_after_s: tuple[float, float, float] = (30.0, 300.0, 600.0)
    # s a P0 task (by spec) may wait in the queue before it counts as an SLA miss.
    p0_sla_s: float = 5.0
    # Backfill bound: once a task that did not fit has been blocked this many s
    # (since it was first tried and failed) or skipped this many dispatches, it
    # holds one node: tasks of its class and below may still pass it, but not
    # onto that node (EASY-style backfill; see AgingQueue). The coordinator
    # dispatches up to ~10 times a second, so 100 skips is about the 10 s bound.
    backfill_max_head_wait_s: float = 10.0
    backfill_max_skips: int = 100
    # EASY backfill with runtime estimates: a fenced task with a duration_s
    # estimate may still take the held node when this many times its predicted
    # run (the estimate times what its kind has been learned to take against
    # its estimates on that node; at the node's speed before anything is
    # learned) ends before every lease already there is expected to; a lease
    # there without an estimate closes the node to all of them. 2 allows for
    # runs stretched by GPU sharing; where a kind's runs overrun their
    # predictions by more (the learned 90th percentile of actual / predicted),
    # that is the margin. A task never takes a slow held node when it would
    # finish sooner by waiting for a faster one. 0: the held node takes no
    # fenced task (the default until round 19: estimates are not enforced
    # limits, and a lease that overruns delays the task the node is held for;
    # learning each kind's bias and scatter bounds that, README "Scheduling
    # quality").
    backfill_estimate_factor: float = 2.0

    # A task below P0 (by spec) goes to a GPU with room for the largest memory
    # growth its kind has shown (the learned peak-over-ask ratios of ended
    # tasks, scheduler.memgrowth) when one can take it, and waits up to this
    # many s for one when it fits now only where that growth would not; then
    # it takes the best GPU it fits. Only where GPUs differ in size and some
    # that may take it are that big: on a cluster of one card size nothing
    # changes. On the openb cluster it took load_aware's OOM kills 8 / 9 / 12
    # -> 6 / 5 / 11 at the same mean response and slowdown (README,
    # "Scheduling quality"). P0 never waits: its SLA is seconds. Keep it below
    # backfill_max_head_wait_s, or a waiting task holds a node. 0: off
    # (placement as before).
    growth_room_wait_s: float = 5.0

    # ---- preemption ------------------------------------------------------------
    # Urgent work is never stuck behind batch work: a P0 task (by spec) that
    # fits no GPU for this many s evicts lower-priority leases (see
    # preempt_min_victim_priority) from the GPU where that costs least, and
    # that GPU is kept for it until the victims' memory shows free in the
    # readings. The victims go back to the queue (state PREEMPTED, then
    # QUEUED: their lease holders stop them; checkpoint-and-restart work
    # resumes, the rest starts over). 1 s: the fewest P0 SLA misses on the 8 x 4
    # openb replays (0 / 1 / 3 s: 1,204 / 857 / 1,740 on default, 84 / 79 / 320
    # on gpushare40): at 0 a P0 task that a lease ending now makes room for
    # evicts anyway, at 3 s the victims' memory shows free past the 5 s SLA.
    # It waits instead while a lease's own estimate says room frees soon
    # enough to evict still within its SLA if that lease overruns.
    preemption: bool = True
    preempt_after_s: float = 1.0
    # The most urgent class a victim may be (by spec): 2 = P2 batch and P3
    # background may be evicted, P1 never; 3: P3 only; 1: P1 too. P0 never is.
    preempt_min_victim_priority: int = 2
    # A P0 task that fits now only where its kind's largest learned memory
    # growth would not (see growth_room_wait_s) goes to a GPU with room for
    # that growth when one can take it, and otherwise evicts lower-priority
    # work from one that could, waiting for it at most until its SLA runs
    # out; then it takes the best GPU it fits. Needs preemption.
    preempt_for_growth: bool = True
    # A P0 task (by spec) that fits only on GPUs whose compute its share
    # would oversubscribe (gpulb's leases there by their shares, or the
    # reading, whichever is higher, plus its own share over 100 %) goes to a
    # GPU with that compute to spare when one can take it, and otherwise
    # evicts lower-priority work from one, waiting for it at most until its
    # SLA runs out; then it takes the best GPU it fits. While it runs, work
    # below P0 may not take that GPU's compute past 100 %. Needs preemption.
    # Off by default: on the openb mixed-cluster benchmark it raised mean P0
    # response with prediction off (README, "Compute for urgent work").
    preempt_for_compute: bool = False
    # s a lease must have run before it may be evicted (Slurm's
    # PreemptExemptTime): a task just restarted after an eviction is not the
    # victim again at once. 0 (the default): any lease of a victim class may go.
    preempt_min_run_s: float = 0.0
    # Most leases one P0 task may evict; a GPU that needs more is not chosen.
    preempt_max_victims: int = 4
    # s the evicted GPU stays kept for its P0 task: long enough for the
    # victims to stop and the agent's readings to show their memory free. A
    # P0 task still waiting then may evict again, elsewhere.
    preempt_grace_s: float = 30.0

    # ---- filters (hard) -----------------------------------------------------
    # % of GPU memory that memory used + reservations + the task must stay under.
    memory_reject_pct: float = 85.0
    # tenant -> % override of memory_reject_pct.
    tenant_memory_reject_pct: Mapping[str, float] = field(default_factory=dict)
    # tenant -> the most urgent class its tenant tokens may submit (P0..P3):
    # {interns = "P2"} lets interns submit P2 and P3 only, so their tasks never
    # evict other tenants' leases (only tasks submitted as P0 evict). A
    # submission above it is refused PERMISSION_DENIED naming priority and the
    # classes allowed. Admin tokens are not limited; tasks already queued keep
    # their class, and aging promotes them as any task (promote_after_s).
    # Unlisted tenants may submit any class.
    tenant_max_priority: Mapping[str, str] = field(default_factory=dict)
    # °C at or above which a GPU takes no new task.
    temperature_reject_c: float = 85.0
    # NVLink competition (0..1) at or above which needs_nvlink tasks avoid a GPU.
    nvlink_competition_max: float = 0.6
    # ms of node disk await at or above which io_heavy tasks avoid the node.
    disk_await_max_ms: float = 70.0

    # ---- scores (soft) --------------------------------------------------------
    # % memory use where the memory-pressure term starts rising (0 below, 1 at reject).
    memory_warn_pct: float = 70.0
    # °C above which the temperature term starts rising (1 at temperature_reject_c).
    temperature_penalty_start_c: float = 60.0
    # s of node response time that maps to a response-time term of 1 (capped there).
    response_time_ref_s: float = 5.0
    # Predicted load reads the one-step EWMA forecast (True) or the smoothed util.
    use_forecast: bool = True
    # Share of the GPUs (0..1) that the largest-memory cards may make up and still
    # count as "big": the load-aware big_cards term keeps them for work whose
    # memory (its ask times its kind's largest learned growth) the other cards
    # cannot hold. Counted from the largest card down, and only cards with 1.2x
    # the memory of the largest other one count; where the largest cards alone
    # are more than this share (every card one size, say), none is big.
    big_card_share: float = 0.1

    # ---- policy -----------------------------------------------------------------
    policy: str = "load_aware"
    # Overrides of the policy's default weights (term -> weight, unitless).
    weights: Mapping[str, float] = field(default_factory=dict)

    # ---- leases and retries -----------------------------------------------------
    # s a lease lasts when granted, and a renewal with extend_s = 0 extends by.
    lease_s: float = 300.0
    # s: the longest single extension a renewal may ask for.
    max_lease_extend_s: float = 7 * 24 * 3600.0
    # Lost tasks of these kinds (or with spec.movable) are re-queued.
    retry_kinds: frozenset[str] = frozenset({"training", "batch", "background"})
    # Placements a task may have in all; a lost task at the limit stays LOST.
    max_attempts: int = 3

    # ---- bookkeeping ------------------------------------------------------------
    # Finished tasks kept for GetTask / idempotent resubmission (oldest dropped first).
    retain_finished: int = 100_000
    # Tasks listed in queue_summary().head.
    queue_head_limit: int = 50

    def memory_reject_for(self, tenant: str) -> float:
        """% memory reject threshold that applies to ``tenant``."""
        return self.tenant_memory_reject_pct.get(tenant, self.memory_reject_pct)

    def max_priority_for(self, tenant: str) -> int | None:
        """The most urgent class (0 = P0) ``tenant``'s tokens may submit,
        None when ``tenant_max_priority`` does not limit it."""
        value = self.tenant_max_priority.get(tenant)
        return None if value is None else _PRIORITY_NAMES.index(value.upper())

    def __post_init__(self) -> None:
        # task kinds are free text kept as submitted and compared in lower case
        # (the advisor's movable_kinds and pinned_kinds alike): "Training" as
        # written by an operator never matched, and lost training tasks stayed LOST
        value = self.retry_kinds
        if not isinstance(value, str) and all(isinstance(k, str) for k in value):
            object.__setattr__(self, "retry_kinds", frozenset(k.lower() for k in value))

    def validate(self) -> "SchedulerConfig":
        def positive(name: str, value: float) -> None:
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise InvalidArgument(name, f"must be a finite number > 0, got {value!r}")

        if len(self.class_weights) != 4:
            raise InvalidArgument("class_weights", "needs one weight per class P0..P3")
        for i, w in enumerate(self.class_weights):
            if isinstance(w, bool) or not isinstance(w, int) or w < 1:
                raise InvalidArgument(f"class_weights[{i}]", f"must be an integer >= 1, got {w!r}")
        if len(self.promote_after_s) != 3:
            raise InvalidArgument("promote_after_s", "needs one threshold for each of P1, P2, P3")
        for i, s in enumerate(self.promote_after_s):
            positive(f"promote_after_s[{i}]", s)
        positive("p0_sla_s", self.p0_sla_s)
        positive("backfill_max_head_wait_s", self.backfill_max_head_wait_s)
        if self.backfill_max_skips < 1:
            raise InvalidArgument("backfill_max_skips", "must be >= 1")
        if not (math.isfinite(self.growth_room_wait_s) and self.growth_room_wait_s >= 0):
            raise InvalidArgument("growth_room_wait_s", f"must be a finite number >= 0, got {self.growth_room_wait_s!r}")
        if not (math.isfinite(self.preempt_after_s) and self.preempt_after_s >= 0):
            raise InvalidArgument("preempt_after_s", f"must be a finite number >= 0, got {self.preempt_after_s!r}")
        if isinstance(self.preempt_min_victim_priority, bool) or self.preempt_min_victim_priority not in (1, 2, 3):
            raise InvalidArgument("preempt_min_victim_priority",
                                  f"must be 1, 2 or 3 (P1, P2 or P3), got {self.preempt_min_victim_priority!r}")
        if isinstance(self.preempt_max_victims, bool) or not isinstance(self.preempt_max_victims, int) \
                or self.preempt_max_victims < 1:
            raise InvalidArgument("preempt_max_victims", f"must be an integer >= 1, got {self.preempt_max_victims!r}")
        positive("preempt_grace_s", self.preempt_grace_s)
        if not (math.isfinite(self.preempt_min_run_s) and self.preempt_min_run_s >= 0):
            raise InvalidArgument("preempt_min_run_s", f"must be a finite number >= 0, got {self.preempt_min_run_s!r}")
        if not (math.isfinite(self.backfill_estimate_factor) and self.backfill_estimate_factor >= 0):
            raise InvalidArgument("backfill_estimate_factor", "must be a finite number >= 0")
        if not (math.isfinite(self.big_card_share) and 0 <= self.big_card_share < 1):
            raise InvalidArgument("big_card_share", f"must be in [0, 1), got {self.big_card_share!r}")
        for name in ("memory_reject_pct", "memory_warn_pct"):
            value = getattr(self, name)
            if not (math.isfinite(value) and 0 < value <= 100):
                raise InvalidArgument(name, f"must be in (0, 100], got {value!r}")
        for tenant, value in self.tenant_memory_reject_pct.items():
            if not (math.isfinite(value) and 0 < value <= 100):
                raise InvalidArgument(
                    f"tenant_memory_reject_pct[{tenant}]", f"must be in (0, 100], got {value!r}"
                )
            if value <= self.memory_warn_pct:
                raise InvalidArgument(
                    f"tenant_memory_reject_pct[{tenant}]", "must be above memory_warn_pct"
                )
        for tenant, value in self.tenant_max_priority.items():
            if not (isinstance(value, str) and value.upper() in _PRIORITY_NAMES):
                raise InvalidArgument(
                    f"tenant_max_priority[{tenant}]",
                    f"must be one of {', '.join(_PRIORITY_NAMES)} (the most urgent class the tenant may submit), "
                    f"got {value!r}",
                )
        if self.memory_warn_pct >= self.memory_reject_pct:
            raise InvalidArgument("memory_warn_pct", "must be below memory_reject_pct")
        if self.temperature_penalty_start_c >= self.temperature_reject_c:
            raise InvalidArgument(
                "temperature_penalty_start_c", "must be below temperature_reject_c"
            )
        positive("nvlink_competition_max", self.nvlink_competition_max)
        positive("disk_await_max_ms", self.disk_await_max_ms)
        positive("response_time_ref_s", self.response_time_ref_s)
        positive("lease_s", self.lease_s)
        positive("max_lease_extend_s", self.max_lease_extend_s)
        if self.queue_head_limit < 0:
            raise InvalidArgument("queue_head_limit", f"must be >= 0, got {self.queue_head_limit!r}")
        if self.max_attempts < 1:
            raise InvalidArgument("max_attempts", "must be >= 1")
        if self.retain_finished < 0:
            raise InvalidArgument("retain_finished", "must be >= 0")
        return self
