"""The advisor inside the coordinator: speed prediction from completed tasks,
memory growth from ended ones, the periodic rebalance advisor, its optional
command hook, its metrics, and the thin ``gpulb.v1.Advisor`` servicer.

``AdvisorRuntime`` owns a ``SpeedPredictor``, a ``MemoryGrowth`` and an
``Advisor`` and reads the cluster through three callables (the snapshot, the
leased tasks, the live reservations), so it runs on the coordinator's event
loop without touching its internals and tests drive it with fakes. It learns
through ``on_task_change`` (a scheduler listener): run times of completed
tasks for the predictor, and the peak GPU memory of completed or failed ones
(reported by the agent's task event or the client's CompleteTask,
``note_peak_memory``) for memory growth; ``annotate`` hands both to the
scheduler's scores. It evaluates the advisor every ``interval_s``
(``start``/``stop``), publishes plans to watchers and, when configured, hands
each plan to a ``CommandHook``.

The hook runs an operator-chosen executor: ``argv`` with the plan as JSON on
stdin (``Plan.to_dict``, one object) and ``GPULB_PLAN_ID`` in its environment,
at most ``timeout_s`` (then its process group gets SIGTERM, and SIGKILL
``_TERM_GRACE_S`` later), one at a time: while a hook runs the advisor makes
no plan (it still evaluates the trigger), for a plan no one carries out would
keep its tasks and GPUs in the cool-down and use the move window for nothing,
and show watchers moves that never happen. Its exit status and output tails
are logged. Whatever the outcome, the moves whose task still holds a lease on
the GPUs the plan moves it from were not made (a failed or lying hook, a
refused or stale move): they leave the cool-down and the move window.

After a restart (``start``), what the advisor learned about recent moves is
taken from the leases restored from ``state_dir``: a lease that came of a
migration (``run_started_at`` set, ``placed_at`` the move; a plan's or one
by hand, which a lease does not tell apart) puts its task and the GPUs it
holds in the cool-down and its move in the window, from ``placed_at``.
The GPUs it came from, the averages, the trigger's streak and hold and the
plan ids are not kept. Nor does the advisor plan until every node that holds
a restored lease reports again (or no longer holds one), for at most
``reconnect_grace_s``: a plan on half the cluster is a plan on the wrong
readings.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import time
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Sequence

import grpc
import numpy as np
import structlog
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from coordinator.config import CoordinatorConfig
from coordinator.executor import signal_group
from coordinator.security import StreamSlot, StreamSlots, client_key
from coordinator.shutdown import or_shutdown
from protos import advisor_pb2 as apb
from protos import advisor_pb2_grpc as apb_grpc
from scheduler.advisor import Advisor, AdvisorConfig, Move, Plan, Trigger
from scheduler.config import SchedulerConfig
from scheduler.fragmentation import WorkloadMix
from scheduler.memgrowth import MemoryGrowth, MemoryGrowthConfig
from scheduler.predictor import PredictorConfig, SpeedPredictor, model_speeds, run_time_s
from scheduler.reservations import Reservations
from scheduler.snapshot import ClusterSnapshot
from scheduler.task import Task, TaskState

__all__ = [
    "AdvisorRuntime",
    "AdvisorService",
    "CommandHook",
    "HookResult",
    "ADVISOR_METRIC_NAMES",
    "ADVISOR_SERVICE_NAME",
    "plan_to_proto",
    "add_to_server",
]

log = structlog.get_logger("gpulb.advisor")

ADVISOR_SERVICE_NAME = apb.DESCRIPTOR.services_by_name["Advisor"].full_name

#: metric families the runtime's collector exports
ADVISOR_METRIC_NAMES = (
    "gpulb_predictor_mape_ratio",
    "gpulb_predictor_completions_total",
    "gpulb_predictor_slowdown_ratio",
    "gpulb_predictor_overrun_ratio",
    "gpulb_memory_growth_ratio",
    "gpulb_memory_growth_samples",
    "gpulb_gpu_utilization_variance",
    "gpulb_rebalance_holding",
    "gpulb_rebalance_plans_total",
    "gpulb_rebalance_moves_total",
    "gpulb_rebalance_hook_runs_total",
    "gpulb_rebalance_last_evaluation_seconds",
    "gpulb_rebalance_evaluation_seconds_total",
)

_OUTPUT_TAIL = 2_000  # bytes of hook stdout/stderr kept for the log
#: GetPredictions for a tenant token: the task kinds remembered per tenant
#: (the most recent first kept) and the tenants remembered (likewise); a
#: kind past the learners' MAX_LEARNED_KINDS has no rows of its own anyway
_KINDS_PER_TENANT = 256
_TENANTS_WITH_KINDS = 10_000


# ---- the command hook ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HookResult:
    outcome: str  # "ok", "failed" (non-zero exit), "timeout" or "error" (could not start)
    returncode: int | None
    duration_s: float
    stdout_tail: str
    stderr_tail: str


class CommandHook:
    """Runs ``argv`` with a plan as JSON on stdin, for at most ``timeout_s``."""

    def __init__(self, argv: Sequence[str], timeout_s: float = 60.0, *, env: dict[str, str] | None = None) -> None:
        if not argv:
            raise ValueError("advisor hook: the command is empty")
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"advisor hook: timeout_s must be > 0, got {timeout_s!r}")
        self.argv = list(argv)
        self.timeout_s = float(timeout_s)
        self.env = env

    async def run(self, plan: Plan) -> HookResult:
        started = time.perf_counter()
        payload = json.dumps(plan.to_dict()).encode()
        env = {**(self.env if self.env is not None else os.environ), "GPULB_PLAN_ID": str(plan.plan_id)}
        try:
            # its own process group: the executor it runs (gpulb advisor execute
            # runs the checkpoint command) goes with it on a timeout
            proc = await asyncio.create_subprocess_exec(
                *self.argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=env,
                start_new_session=True,
            )
        except OSError as exc:  # which file: under uvloop, "[Errno 13] Permission denied" alone
            return HookResult("error", None, time.perf_counter() - started, "", f"{self.argv[0]}: {exc.strerror or exc}")
        out, err = bytearray(), bytearray()
        # read as it comes, so that what a hook said before its timeout is kept
        pumps = [asyncio.ensure_future(_keep_tail(proc.stdout, out)), asyncio.ensure_future(_keep_tail(proc.stderr, err)),
                 asyncio.ensure_future(_feed(proc.stdin, payload))]
        outcome = ""
        try:
            await asyncio.wait_for(proc.wait(), timeout=self.timeout_s)
        except asyncio.TimeoutError:
            # proc.kill() alone killed the shell and left its children holding
            # the pipes: the "timeout" came when they ended (20 s for a 3 s limit)
            await _end_group(proc)
            outcome = "timeout"
        except asyncio.CancelledError:
            await _end_group(proc)
            for pump in pumps:
                pump.cancel()
            raise
        # a child that left the group may still hold the pipes: do not wait for it
        await asyncio.wait(pumps, timeout=_PIPE_GRACE_S)
        for pump in pumps:
            pump.cancel()
        outcome = outcome or ("ok" if proc.returncode == 0 else "failed")
        return HookResult(outcome, proc.returncode, time.perf_counter() - started, _tail(out), _tail(err))


#: s a hook's pipes are read after it ended (its output is in them by then)
_PIPE_GRACE_S = 1.0


#: s a hook has between SIGTERM and SIGKILL: the executor uses it to end the
#: checkpoint or restart command it is running, which runs in a session of its
#: own (so that the workload a restart started is not the hook's to kill)
_TERM_GRACE_S = 1.0


async def _end_group(proc: asyncio.subprocess.Process) -> None:
    """SIGTERM the hook's process group, SIGKILL it ``_TERM_GRACE_S`` later
    (or at once once the hook has ended), and reap the hook."""
    signal_group(proc, signal.SIGTERM)
    try:
        await asyncio.wait_for(asyncio.shield(proc.wait()), _TERM_GRACE_S)
    except asyncio.TimeoutError:
        pass
    finally:
        signal_group(proc, signal.SIGKILL)  # what ignored the SIGTERM
        await proc.wait()


async def _keep_tail(stream: asyncio.StreamReader | None, into: bytearray) -> None:
    if stream is None:
        return
    while chunk := await stream.read(65536):
        into += chunk
        if len(into) > 2 * _OUTPUT_TAIL:
            del into[:-_OUTPUT_TAIL]


async def _feed(stdin: asyncio.StreamWriter | None, payload: bytes) -> None:
    if stdin is None:
        return
    try:
        stdin.write(payload)
        await stdin.drain()
    except (BrokenPipeError, ConnectionResetError):
        pass  # a hook that does not read its plan
    finally:
        stdin.close()


def _tail(data: bytes | bytearray | None) -> str:
    return bytes(data or b"")[-_OUTPUT_TAIL:].decode("utf-8", "replace")


# ---- the runtime ---------------------------------------------------------------------------------


class AdvisorRuntime:
    """Predictor + advisor over the live cluster (module docstring)."""

    def __init__(
        self,
        *,
        snapshot: Callable[[], ClusterSnapshot],
        tasks: Callable[[], Sequence[Task]],
        clock: Callable[[], float],
        reservations: Callable[[], Reservations | None] | None = None,
        queued: Callable[[], int] | None = None,
        workload_mix: Callable[[], WorkloadMix | None] | None = None,
        advisor_config: AdvisorConfig | None = None,
        predictor_config: PredictorConfig | None = None,
        growth_config: MemoryGrowthConfig | None = None,
        scheduler_config: SchedulerConfig | None = None,
        interval_s: float = 30.0,
        hook: CommandHook | None = None,
        unix_ns: Callable[[float], int] | None = None,
        reconnect_grace_s: float = 30.0,
    ) -> None:
        """``snapshot``: the current ``ClusterSnapshot``; ``tasks``: the leased
        tasks; ``queued``: tasks waiting in the scheduler's queue (the advisor
        pauses while any wait); ``workload_mix``: the scheduler's arrivals (they
        size the advisor's reserve); ``clock``: monotonic seconds (the scheduler's); ``unix_ns``:
        clock seconds -> Unix ns for the wire (default: offset taken now);
        ``reconnect_grace_s``: how long after ``start`` the advisor waits at
        most for the nodes of the leases it found to report (module docstring;
        30 s is the coordinator's default heartbeat_interval_s ×
        remove_after_intervals, after which it gives such a node up)."""
        if not (math.isfinite(interval_s) and interval_s > 0):
            raise ValueError(f"advisor interval_s must be > 0, got {interval_s!r}")
        if not (math.isfinite(reconnect_grace_s) and reconnect_grace_s >= 0):
            raise ValueError(f"advisor reconnect_grace_s must be >= 0, got {reconnect_grace_s!r}")
        self._snapshot = snapshot
        self._tasks = tasks
        self._reservations = reservations or (lambda: None)
        self._queued = queued or (lambda: 0)
        self._workload_mix = workload_mix or (lambda: None)
        self.clock = clock
        if unix_ns is None:
            offset = time.time_ns() - int(clock() * 1e9)
            unix_ns = lambda s: int(s * 1e9) + offset  # noqa: E731
        self.unix_ns = unix_ns
        self.predictor = SpeedPredictor(config=predictor_config)
        self.growth = MemoryGrowth(growth_config)
        self._peaks: dict[str, tuple[float, bool]] = {}  # task id -> (peak MiB, killed for memory) reported
        self._grown: tuple | None = None  # (annotated snapshot, growth tables, snapshot carrying both)
        self.advisor = Advisor(advisor_config, scheduler_config)
        self.interval_s = float(interval_s)
        self.hook = hook
        self._priors_from: object = None  # the snapshot layout the priors were read from
        self._columns_at: tuple | None = None  # (snapshot, clock s, annotated snapshot) of the last refresh
        self._started: dict[str, float] = {}  # task id -> clock s of its agent's STARTED event
        # tasks moved to other GPUs while running (MigrateTask): their run time
        # spans two GPUs and a restart, so it teaches no GPU's speed
        self._migrated: set[str] = set()
        self._actual: dict[str, float] = {}  # task id -> s of run time its client reported
        # tenant -> the task kinds it submitted (since the start), oldest first:
        # GetPredictions shows a tenant token the rows of those kinds only
        self._tenant_kinds: dict[str, dict[str, None]] = {}
        self._gpus: tuple[object, dict[str, tuple[str, str]]] | None = None  # uuid -> (node, model)
        self._watchers: set[asyncio.Queue] = set()
        self._loop_task: asyncio.Task | None = None
        self._hook_task: asyncio.Task | None = None
        self.last_evaluated_at: float | None = None
        # counters for the metrics
        self.plans_by_trigger: dict[str, int] = {}
        self.moves = 0
        # s the evaluations took on the event loop (the last one; all): the
        # coordinator neither ingests nor schedules meanwhile
        self.last_evaluation_s = math.nan
        self.evaluation_s_total = 0.0
        self.hook_runs: dict[str, int] = {}
        self.last_hook: HookResult | None = None
        self.reconnect_grace_s = float(reconnect_grace_s)
        # nodes that held leases at start() and have not reported since, and
        # until when (clock s) the advisor waits for them
        self._awaited: set[str] = set()
        self._awaited_until = -math.inf

    def reconfigure(self, advisor_config: AdvisorConfig | None = None, scheduler_config: SchedulerConfig | None = None) -> None:
        """New thresholds (validated first) and/or the scheduler's new rules,
        from the next evaluation on; averages, cool-downs and the move window
        carry over."""
        if advisor_config is not None:
            self.advisor.config = advisor_config.validate()
        if scheduler_config is not None:
            self.advisor.scheduler_config = scheduler_config

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        """Take the recent moves from the leases there are (restored ones after
        a restart) and start evaluating every ``interval_s``."""
        if self._loop_task is None:
            self._resume()
            self._loop_task = asyncio.create_task(self._loop(), name="gpulb-advisor")

    def _resume(self) -> None:
        """What the leases say of the advisor's state before a restart (module
        docstring): the cool-downs and move window of migrated tasks, and the
        nodes to wait for."""
        now = self.clock()
        leased = [t for t in self._tasks() if t.state == TaskState.LEASED and t.assignment is not None]
        self._awaited = {t.assignment.node_id for t in leased}  # type: ignore[union-attr]
        self._awaited_until = now + self.reconnect_grace_s
        moved = {t.task_id: (min(t.assignment.placed_at, now), t.assignment.gpu_uuids)  # type: ignore[union-attr]
                 for t in leased if t.assignment.run_started_at is not None}  # type: ignore[union-attr]
        if moved:
            self.advisor.moved_before(moved, now)
            log.info("advisor_moves_restored", tasks=sorted(moved),
                     detail="migrated leases keep their tasks and GPUs in the cool-down from the move")
        if self._awaited:
            log.info("advisor_waiting_for_nodes", nodes=sorted(self._awaited), up_to_s=self.reconnect_grace_s)

    def _waiting_for_nodes(self, snap: ClusterSnapshot, now: float) -> bool:
        """Whether nodes that held leases at ``start`` have yet to report (for
        at most ``reconnect_grace_s``); a node that holds no lease any more
        (the coordinator gave it up) is not waited for."""
        if not self._awaited:
            return False
        stale = np.asarray(snap.node_stale, dtype=bool)
        self._awaited -= {node for node, old in zip(snap.node_ids, stale) if not old}
        if self._awaited:
            held = {t.assignment.node_id for t in self._tasks() if t.assignment is not None}
            self._awaited &= held
        if self._awaited and now < self._awaited_until:
            return True
        if self._awaited:
            log.warning("advisor_nodes_missing", nodes=sorted(self._awaited), waited_s=self.reconnect_grace_s,
                        detail="planning on the nodes that reported")
        else:
            log.info("advisor_nodes_back")
        self._awaited = set()
        return False

    async def stop(self) -> None:
        for attr in ("_loop_task", "_hook_task"):
            task = getattr(self, attr)
            setattr(self, attr, None)
            if task is not None and not task.done():
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.evaluate_now()
            except Exception:  # one bad evaluation must not stop the advisor for good
                log.exception("advisor_evaluation_failed")

    # ---- the cluster ------------------------------------------------------------------------
    def _current(self) -> ClusterSnapshot:
        snap = self._snapshot()
        self._priors(snap)
        return snap

    def _priors(self, snap: ClusterSnapshot) -> None:
        """The cluster's speeds (``node_speed``) are the priors of models not yet learned."""
        if self._priors_from is not snap.gpu_model:
            speeds = model_speeds(snap)
            if speeds:
                self.predictor.set_priors(speeds)
            self._priors_from = snap.gpu_model

    def _leased(self) -> Sequence[Task]:
        # ``tasks`` hands over the leased tasks (the coordinator's, in place), and the
        # advisor passes over any without a lease itself (task_loads): a second
        # filtering pass here was 2-3 ms of the event loop at 16,000 leases
        return self._tasks()

    #: s between refreshes of the slowdown columns the scheduler scores with:
    #: every refresh makes a new snapshot object and so a new placement view
    columns_refresh_s = 1.0

    def annotate(self, snapshot: ClusterSnapshot) -> ClusterSnapshot:
        """``snapshot`` with the predictor's slowdown columns, for the scheduler's
        ``completion`` score term: the same object for the same snapshot, and
        what was learned since reaches the columns at most every
        ``columns_refresh_s``."""
        self._priors(snapshot)
        now = self.clock()
        last = self._columns_at
        if last is not None and last[0] is snapshot and now - last[1] < self.columns_refresh_s:
            return last[2]
        annotated = self._with_growth(self.predictor.annotate(snapshot))
        if last is None or last[0] is not snapshot or annotated is not last[2]:
            self._columns_at = (snapshot, now, annotated)
        return annotated

    def _with_growth(self, snapshot: ClusterSnapshot) -> ClusterSnapshot:
        """``snapshot`` carrying the learned memory growth (the same object for
        the same snapshot and tables)."""
        tables = self.growth.tables()
        if snapshot.memory_growth is tables or (not tables and not snapshot.memory_growth):
            return snapshot
        last = self._grown
        if last is not None and last[0] is snapshot and last[1] is tables:
            return last[2]
        grown = replace(snapshot, memory_growth=tables)
        self._grown = (snapshot, tables, grown)
        return grown

    # ---- learning from completions ------------------------------------------------------------
    def task_started(self, task_id: str, at: float | None = None) -> None:
        """The agent reported the task running: its run time counts from
        ``at`` (clock s, when the agent says it started; default now)."""
        self._started[task_id] = self.clock() if at is None else float(at)

    def task_migrated(self, task_id: str) -> None:
        """The task's lease moved to other GPUs: its completion is not a speed sample."""
        self._migrated.add(task_id)

    def note_actual_duration(self, task_id: str, actual_s: float) -> None:
        """The client reported the task's measured run time (CompleteTask.actual_duration_s)."""
        if isinstance(actual_s, (int, float)) and math.isfinite(actual_s) and actual_s > 0:
            self._actual[task_id] = float(actual_s)

    def note_peak_memory(self, task_id: str, peak_mib: float, *, oom_killed: bool = False) -> None:
        """The agent (task event) or the client (CompleteTask) reported the most
        GPU memory the task used; learned from when the task ends."""
        if isinstance(peak_mib, (int, float)) and math.isfinite(peak_mib) and peak_mib > 0:
            self._peaks[task_id] = (float(peak_mib), bool(oom_killed))

    def forget_reports(self, task_id: str) -> None:
        """Drop what a refused CompleteTask reported (run time, peak memory)."""
        self._actual.pop(task_id, None)
        self._peaks.pop(task_id, None)

    def kinds_of(self, tenant: str) -> frozenset[str]:
        """The task kinds ``tenant`` submitted since the coordinator started
        (the most recent ``_KINDS_PER_TENANT``)."""
        return frozenset(self._tenant_kinds.get(tenant, ()))

    def _note_kind(self, tenant: str, kind: str) -> None:
        kinds = self._tenant_kinds.get(tenant)
        if kinds is None:
            if len(self._tenant_kinds) >= _TENANTS_WITH_KINDS:
                del self._tenant_kinds[next(iter(self._tenant_kinds))]
            kinds = self._tenant_kinds[tenant] = {}
        if kind not in kinds:
            if len(kinds) >= _KINDS_PER_TENANT:
                del kinds[next(iter(kinds))]
            kinds[kind] = None

    def on_task_change(self, task: Task) -> None:
        """Scheduler listener: learn from every COMPLETED task that says how long
        it was expected to run (``spec.duration_s``), and from every ended task
        whose peak memory was reported; note which tenant submits which kinds
        (those of tasks it accepted: a submission rejected at once, never
        queued, gives no right to the kind's rows in GetPredictions, QA pass 25)."""
        if task.spec.kind and task.state != TaskState.REJECTED:
            self._note_kind(task.spec.tenant, task.spec.kind)
        if not task.terminal:
            if task.state in (TaskState.LOST, TaskState.PREEMPTED):
                # that run ended and the task waits again (a re-queued LOST is
                # not terminal): its start is not the next run's
                self._started.pop(task.task_id, None)
                self._actual.pop(task.task_id, None)
            return
        started = self._started.pop(task.task_id, None)
        actual = self._actual.pop(task.task_id, None)
        peak = self._peaks.pop(task.task_id, None)
        migrated = task.task_id in self._migrated
        self._migrated.discard(task.task_id)
        if peak is not None and task.state in (TaskState.COMPLETED, TaskState.FAILED):
            ratio = self.growth.observe(task.spec.kind, task.spec.vram_mib, peak[0], oom_killed=peak[1])
            if ratio is not None:
                log.debug("memory_growth_learned", task_id=task.task_id, kind=task.spec.kind,
                          asked_mib=task.spec.vram_mib, peak_mib=peak[0], ratio=round(ratio, 4), oom_killed=peak[1])
        a = task.assignment
        if task.state != TaskState.COMPLETED or a is None or task.spec.duration_s <= 0 or migrated:
            return
        end = task.finished_at if task.finished_at is not None else self.clock()
        actual = run_time_s(reported_s=actual, started_at=started, ended_at=end)
        if actual is None:
            # completed before its agent said it started, and its client said no
            # run time: the time since placement is none (QA pass 25)
            log.debug("prediction_skipped", task_id=task.task_id, reason="no run time")
            return
        node_model = self._gpu(a.gpu_uuids[0]) if a.gpu_uuids else None
        if node_model is None:
            return  # its GPU left the view: nothing to attribute it to
        node_id, model = node_model
        ape = self.predictor.observe(node_id, model, task.spec.kind, task.spec.duration_s, actual)
        if ape is not None:
            log.debug("prediction_scored", task_id=task.task_id, node_id=node_id, model=model,
                      kind=task.spec.kind, actual_s=round(actual, 3), error=round(ape, 4))

    def _gpu(self, uuid: str) -> tuple[str, str] | None:
        snap = self._current()
        cached = self._gpus
        if cached is None or cached[0] is not snap.gpu_uuid:
            table = {
                u: (snap.node_ids[int(snap.gpu_node[r])], str(snap.gpu_model[r])) for r, u in enumerate(snap.gpu_uuid)
            }
            self._gpus = cached = (snap.gpu_uuid, table)
        return cached[1].get(uuid)

    # ---- advising -----------------------------------------------------------------------------
    def evaluate_now(self) -> Plan | None:
        """One advisor evaluation (what the loop runs); publishes a plan when made."""
        started = time.perf_counter()
        try:
            snap = self.annotate(self._current())
            now = self.clock()
            self.last_evaluated_at = now
            if snap.gpu_count == 0:
                return None
            # no plan while the hook still carries out the last one, or while
            # nodes of the restored leases have not reported (module docstring)
            busy = self.hook is not None and self._hook_task is not None and not self._hook_task.done()
            paused = self._waiting_for_nodes(snap, now) or busy
            plan = self.advisor.evaluate(snap, self._leased(), now, reservations=self._reservations(),
                                         queued=self._queued(), workload_mix=self._workload_mix(), paused=paused)
        finally:
            self.last_evaluation_s = time.perf_counter() - started
            self.evaluation_s_total += self.last_evaluation_s
        if plan is None:
            return None
        self.plans_by_trigger[plan.trigger] = self.plans_by_trigger.get(plan.trigger, 0) + 1
        self.moves += len(plan.moves)
        log.info(
            "rebalance_plan",
            plan_id=plan.plan_id,
            trigger=plan.trigger,
            variance_before=round(plan.variance_before, 1),
            variance_after=round(plan.variance_after, 1),
            moves=[f"{m.task_id}: {m.from_node_id}/{','.join(map(str, m.from_gpu_indexes))} -> "
                   f"{m.to_node_id}/{','.join(map(str, m.to_gpu_indexes))}" for m in plan.moves],
        )
        for queue in list(self._watchers):
            try:
                queue.put_nowait(plan)
            except asyncio.QueueFull:
                log.warning("advisor_watcher_behind", plan_id=plan.plan_id)
        self._run_hook(plan)
        return plan

    def dry_run(self) -> tuple[Trigger, Plan | None, dict[str, int]]:
        """What a plan would be now (``Advisor.dry_run``), and when there is
        none, why (``WHY_NO_MOVE`` reason -> tasks, or 1); changes nothing."""
        snap = self.annotate(self._current())
        why: dict[str, int] = {}
        trigger, plan = self.advisor.dry_run(snap, self._leased(), self.clock(), reservations=self._reservations(),
                                             queued=self._queued(), workload_mix=self._workload_mix(), why=why)
        return trigger, plan, ({} if plan is not None else why)

    @property
    def last_plan(self) -> Plan | None:
        return self.advisor.last_plan

    @property
    def last_trigger(self) -> Trigger | None:
        return self.advisor.state.last_trigger

    def watch(self, size: int = 64) -> tuple[asyncio.Queue, Callable[[], None]]:
        queue: asyncio.Queue = asyncio.Queue(maxsize=size)
        self._watchers.add(queue)
        return queue, lambda: self._watchers.discard(queue)

    # ---- the hook ---------------------------------------------------------------------------------
    def _run_hook(self, plan: Plan) -> None:
        if self.hook is None:
            return
        if self._hook_task is not None and not self._hook_task.done():
            # evaluate_now makes no plan while the hook runs; should one come
            # anyway, nothing carries it out: out of the cool-down and the window
            self.hook_runs["skipped"] = self.hook_runs.get("skipped", 0) + 1
            self.advisor.not_carried_out(plan.moves, plan.created_at_s)
            log.warning("advisor_hook_busy", plan_id=plan.plan_id)
            return
        self._hook_task = asyncio.get_running_loop().create_task(self._hook_run(plan), name="gpulb-advisor-hook")

    async def _hook_run(self, plan: Plan) -> None:
        assert self.hook is not None
        result = await self.hook.run(plan)
        self.last_hook = result
        self.hook_runs[result.outcome] = self.hook_runs.get(result.outcome, 0) + 1
        # the moves whose task is still where the plan found it were not made,
        # whatever the hook says (an "ok" executor also refuses stale and
        # refused moves, and a hook may exit 0 having moved nothing): they leave
        # the cool-down (else `plan --now` said "moved within cooldown_s")
        leased = {t.task_id: t for t in self._tasks()}
        unmade = [m for m in plan.moves if (t := leased.get(m.task_id)) is not None and t.assignment is not None
                  and set(t.assignment.gpu_uuids) == set(m.from_gpu_uuids)]
        self.advisor.not_carried_out(unmade, plan.created_at_s)
        if unmade:
            log.warning("advisor_moves_not_made", plan_id=plan.plan_id, hook_outcome=result.outcome,
                        tasks=[m.task_id for m in unmade],
                        detail="still on the plan's source GPUs after the hook: out of the cool-down and the move window")
        event = log.info if result.outcome == "ok" else log.warning
        event(
            "advisor_hook_ran",
            plan_id=plan.plan_id,
            outcome=result.outcome,
            returncode=result.returncode,
            duration_s=round(result.duration_s, 3),
            stdout=result.stdout_tail,
            stderr=result.stderr_tail,
        )

    async def hook_idle(self) -> None:
        """Wait for a running hook to finish (tests, graceful stop)."""
        if self._hook_task is not None:
            await asyncio.shield(self._hook_task)

    # ---- metrics ------------------------------------------------------------------------------------
    def collector(self) -> "_AdvisorCollector":
        """A prometheus collector to ``register`` in the coordinator's registry."""
        return _AdvisorCollector(self)


class _AdvisorCollector:
    def __init__(self, runtime: AdvisorRuntime) -> None:
        self.r = runtime

    def describe(self):
        return []

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        r = self.r
        p = r.predictor
        mape = GaugeMetricFamily(
            "gpulb_predictor_mape_ratio",
            "Mean absolute percentage error of run-time predictions over the last completions, each predicted before it was learned from (ratio)",
        )
        if not math.isnan(p.mape()):
            mape.add_metric([], p.mape())
        yield mape
        yield CounterMetricFamily("gpulb_predictor_completions", "Completed tasks the predictor learned from", value=p.samples)
        slowdown = GaugeMetricFamily(
            "gpulb_predictor_slowdown_ratio",
            "Learned slowdown (actual / expected run time) per GPU model and task kind; kind empty = every kind",
            labels=["model", "kind"],
        )
        overrun = GaugeMetricFamily(
            "gpulb_predictor_overrun_ratio",
            "90th percentile of actual / predicted run time over a GPU model and task kind's recent completions "
            "(from 20 of them): the backfill's margin where above backfill_estimate_factor",
            labels=["model", "kind"],
        )
        models, _ = p.stats()
        for f in models:
            slowdown.add_metric([f.model, f.kind], f.factor)
            if not math.isnan(f.overrun):
                overrun.add_metric([f.model, f.kind], f.overrun)
        yield slowdown
        yield overrun
        # a summary: the quantiles over the learner's window, _count and _sum
        # (counters) over every ratio since the first; a gauge may not carry a
        # quantile label (promtool check metrics refuses it)
        growth = Metric(
            "gpulb_memory_growth_ratio",
            "Peak over asked GPU memory of ended tasks, per task kind (empty = every kind): the quantiles over "
            "the last window of them, _count and _sum over every one since the first",
            "summary",
        )
        held = GaugeMetricFamily(
            "gpulb_memory_growth_samples",
            "Peak/asked memory ratios held per task kind (empty = every kind); the oom_risk score uses a kind's from min_samples on",
            labels=["kind"],
        )
        for g in r.growth.stats():
            held.add_metric([g.kind], g.samples)
            for quantile, value in (("0.5", g.p50), ("0.95", g.p95), ("0.99", g.p99), ("1", g.max)):
                growth.add_sample("gpulb_memory_growth_ratio", {"kind": g.kind, "quantile": quantile}, value)
            # counters: every ratio learned, not the window's (which forgets:
            # its _sum fell and its _count froze once full, QA pass 24)
            growth.add_sample("gpulb_memory_growth_ratio_count", {"kind": g.kind}, g.count)
            growth.add_sample("gpulb_memory_growth_ratio_sum", {"kind": g.kind}, g.total)
        yield growth
        yield held
        variance = GaugeMetricFamily(
            "gpulb_gpu_utilization_variance",
            "Variance of GPU utilisation across GPUs at the last advisor evaluation (ratio squared; 0.04 = 400 %²)",
        )
        trigger = r.last_trigger
        if trigger is not None:
            variance.add_metric([], trigger.variance / 10_000.0)
        yield variance
        yield GaugeMetricFamily(
            "gpulb_rebalance_holding",
            "1 while the variance rule holds after a plan came of it (until the variance falls to release_variance)",
            value=1.0 if r.advisor.state.armed else 0.0,
        )
        plans = CounterMetricFamily("gpulb_rebalance_plans", "Rebalance plans proposed, by trigger", labels=["trigger"])
        for name in ("variance", "hot_rising"):
            plans.add_metric([name], r.plans_by_trigger.get(name, 0))
        yield plans
        yield CounterMetricFamily("gpulb_rebalance_moves", "Migrations proposed in rebalance plans", value=r.moves)
        last = GaugeMetricFamily("gpulb_rebalance_last_evaluation_seconds",
                                 "Time the last advisor evaluation held the event loop (no ingest, no scheduling)")
        if not math.isnan(r.last_evaluation_s):
            last.add_metric([], r.last_evaluation_s)
        yield last
        yield CounterMetricFamily("gpulb_rebalance_evaluation_seconds",
                                  "Time advisor evaluations held the event loop, all of them",
                                  value=r.evaluation_s_total)
        hooks = CounterMetricFamily("gpulb_rebalance_hook_runs", "Advisor command hook runs, by outcome", labels=["outcome"])
        for name in ("ok", "failed", "timeout", "error", "skipped"):
            hooks.add_metric([name], r.hook_runs.get(name, 0))
        yield hooks


# ---- proto conversion and the servicer -------------------------------------------------------------


def plan_to_proto(plan: Plan, unix_ns: Callable[[float], int], *, dry_run: bool = False) -> apb.RebalancePlan:
    return apb.RebalancePlan(
        plan_id=0 if dry_run else plan.plan_id,
        created_at_ns=unix_ns(plan.created_at_s),
        trigger=plan.trigger,
        variance_before=plan.variance_before,
        variance_after=plan.variance_after,
        spread_before=plan.spread_before,
        spread_after=plan.spread_after,
        moves=[_move_to_proto(m) for m in plan.moves],
        dry_run=dry_run,
    )


def _move_to_proto(m: Move) -> apb.Migration:
    return apb.Migration(
        task_id=m.task_id,
        lease_id=m.lease_id,
        kind=m.kind,
        from_node_id=m.from_node_id,
        from_gpu_index=m.from_gpu_index,
        from_gpu_uuid=m.from_gpu_uuid,
        to_node_id=m.to_node_id,
        to_gpu_index=m.to_gpu_index,
        to_gpu_uuid=m.to_gpu_uuid,
        load_pct=m.load_pct,
        from_util_pct=m.from_util_pct,
        to_util_pct=m.to_util_pct,
        variance_after=m.variance_after,
        from_gpu_indexes=m.from_gpu_indexes,
        from_gpu_uuids=m.from_gpu_uuids,
        to_gpu_indexes=m.to_gpu_indexes,
        to_gpu_uuids=m.to_gpu_uuids,
    )


def _trigger_to_proto(t: Trigger | None, config: AdvisorConfig) -> apb.TriggerState:
    """The figures of ``t`` (none before the first evaluation) next to the
    thresholds in force."""
    out = apb.TriggerState(
        variance_threshold=config.variance_threshold,
        hot_pct=config.hot_pct,
        rising_pct_per_min=config.rising_pct_per_min,
        rising_gpus=config.rising_gpus,
        release_variance=config.release_level,
    )
    if t is not None:
        out.fired, out.reason, out.variance, out.held = t.fired, t.reason, t.variance, t.held
        out.hottest_pct = t.hottest_pct if math.isfinite(t.hottest_pct) else 0.0
        out.rising, out.gpus = t.rising, t.gpus
    return out


class AdvisorService(apb_grpc.AdvisorServicer):
    """gpulb.v1.Advisor: decode, ask the runtime, encode.

    ``authorize(context, admin=...)`` is the coordinator's check (tokens);
    predictions are open to every caller with a token (a tenant's: of the
    kinds its tenant submitted), plans (which name every tenant's tasks) to
    admins."""

    def __init__(self, runtime: AdvisorRuntime, authorize: Callable[..., object] | None = None,
                 stopping: asyncio.Event | None = None, admit_watch: Callable[..., StreamSlot] | None = None) -> None:
        self.r = runtime
        self._authorize = authorize or (lambda context, admin: None)
        self.stopping = stopping if stopping is not None else asyncio.Event()  # set: watches end (coordinator.shutdown)
        # a WatchPlans stream's slot among the coordinator's watch streams
        # (``Security.admit_watch`` with its configuration, shared with
        # WatchTask and WatchView); given none, plan watches are capped on
        # their own at the options' defaults, so they are never unbounded
        if admit_watch is None:
            own, limits = StreamSlots(), CoordinatorConfig()
            admit_watch = lambda context: own.admit(  # noqa: E731
                client_key(context), per_client=limits.max_watch_streams_per_client, total=limits.max_watch_streams)
        self.admit_watch = admit_watch

    async def GetPredictions(self, request: apb.GetPredictionsRequest, context) -> apb.GetPredictionsResponse:
        identity = self._authorize(context, admin=False)
        p = self.r.predictor
        models, nodes = p.stats()
        # Kinds are free text that can name a project or a customer: a tenant
        # token sees the rows of the kinds its tenant submitted, and those of
        # no kind (per model, every kind), not another tenant's (QA pass 24)
        shown: frozenset[str] | None = None
        if identity is not None and not getattr(identity, "admin", True):
            shown = self.r.kinds_of(identity.tenant) | {""}

        def kind_ok(kind: str) -> bool:
            return (shown is None or kind in shown) and (not request.kind or kind in ("", request.kind))

        return apb.GetPredictionsResponse(
            models=[
                apb.SpeedFactor(model=f.model, kind=f.kind, slowdown=f.factor, prior=f.prior, samples=f.samples,
                                mape_ratio=f.mape, overrun_ratio=f.overrun)
                for f in models
                if (not request.model or f.model == request.model) and kind_ok(f.kind)
            ],
            nodes=[
                apb.NodeFactor(node_id=f.node_id, residual=f.factor, samples=f.samples, mape_ratio=f.mape)
                for f in nodes
                if not request.node_id or f.node_id == request.node_id
            ],
            mape_ratio=p.mape(),
            samples=p.samples,
            error_window=p.config.error_window,
            memory_growth=[
                apb.MemoryGrowth(kind=g.kind, samples=g.samples, oom_kills=g.oom_kills, p50=g.p50, p95=g.p95,
                                 p99=g.p99, max=g.max)
                for g in self.r.growth.stats()
                if kind_ok(g.kind)
            ],
        )

    async def GetPlan(self, request: apb.GetPlanRequest, context) -> apb.GetPlanResponse:
        self._authorize(context, admin=True)
        r = self.r
        if request.evaluate_now:
            trigger, plan, why = r.dry_run()
            out = apb.GetPlanResponse(trigger=_trigger_to_proto(trigger, r.advisor.config), evaluated_at_ns=r.unix_ns(r.clock()),
                                      no_move=why)
            if plan is not None:
                out.plan.CopyFrom(plan_to_proto(plan, r.unix_ns, dry_run=True))
            return out
        # the thresholds are always there; the figures once evaluated
        out = apb.GetPlanResponse(trigger=_trigger_to_proto(r.last_trigger, r.advisor.config))
        if r.last_evaluated_at is not None:
            out.evaluated_at_ns = r.unix_ns(r.last_evaluated_at)
        if r.last_plan is not None:
            out.plan.CopyFrom(plan_to_proto(r.last_plan, r.unix_ns))
        return out

    async def WatchPlans(self, request: apb.WatchPlansRequest, context):
        self._authorize(context, admin=True)
        # the slot goes back however the stream ends: the client cancels,
        # the coordinator stops (or_shutdown aborts), an error
        with self.admit_watch(context) as slot:
            queue, unsubscribe = self.r.watch()
            try:
                if request.include_latest and self.r.last_plan is not None:
                    yield plan_to_proto(self.r.last_plan, self.r.unix_ns)
                while True:
                    plan = await or_shutdown(queue.get(), self.stopping, context, slot.revoked)
                    yield plan_to_proto(plan, self.r.unix_ns)
            finally:
                unsubscribe()


def add_to_server(service: AdvisorService, server: grpc.aio.Server) -> None:
    """Register the servicer (the coordinator adds ``ADVISOR_SERVICE_NAME`` to reflection)."""
    apb_grpc.add_AdvisorServicer_to_server(service, server)
