"""``gpulb``: the operator and client command line.

Every listing prints a table for people and, with ``--json``, JSON for
scripts. The coordinator address comes from ``--coordinator`` or
``GPULB_COORDINATOR`` (default 127.0.0.1:50051).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Callable

import grpc
from google.protobuf.json_format import MessageToDict

from coordinator.executor import PlanExecutor, move_gpus
from coordinator.tables import fmt, render_table
from protos import advisor_pb2 as apb
from protos import advisor_pb2_grpc as apb_grpc
from protos import cluster_pb2 as cpb
from protos import cluster_pb2_grpc as cpb_grpc
from protos import tasks_pb2 as tpb
from protos import tasks_pb2_grpc as tpb_grpc
from protos import telemetry_pb2 as pb

__all__ = ["main", "build_parser"]

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {}


def command(name: str):
    def register(fn):
        COMMANDS[name] = fn
        return fn

    return register


class _TokenCalls(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds ``authorization: Bearer`` to every call (plaintext channels only:
    over TLS the token travels as call credentials)."""

    def __init__(self, token: str) -> None:
        self.metadata = (("authorization", f"Bearer {token}"),)

    def _details(self, details):
        return details._replace(metadata=tuple(details.metadata or ()) + self.metadata)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)


def _channel(args: argparse.Namespace) -> grpc.Channel:
    token = args.token or ""
    if args.token_file:
        with open(args.token_file) as fh:
            token = fh.read().strip()
    if args.ca_file:
        from coordinator.security import channel_credentials

        return grpc.secure_channel(args.coordinator, channel_credentials(args.ca_file, token=token or None))
    channel = grpc.insecure_channel(args.coordinator)
    return grpc.intercept_channel(channel, _TokenCalls(token)) if token else channel


def _state_name(state: int) -> str:
    return cpb.NodeState.Name(state).removeprefix("NODE_STATE_").lower()


def _health_name(health: int) -> str:
    return pb.GpuHealth.Name(health).removeprefix("GPU_HEALTH_").lower() if health else "-"


def _print_json(messages) -> None:
    print(json.dumps([MessageToDict(m, preserving_proto_field_name=True) for m in messages], indent=2))


def _opt(msg, name: str):
    return getattr(msg, name) if msg.HasField(name) else None


def _gpu_rows(gpus, smoothed_pairs: dict | None = None) -> list[list]:
    rows = []
    for g in gpus:
        mem = "-"
        if g.HasField("memory_used_mib") and g.HasField("memory_total_mib"):
            mem = f"{g.memory_used_mib / 1024:.1f}/{g.memory_total_mib / 1024:.1f}"
        row = [
            g.node_id,
            g.index,
            g.model.removeprefix("NVIDIA ").removeprefix("GeForce "),
            _state_name(g.node_state),
            _health_name(g.health),
            fmt(_opt(g, "util_gpu_pct"), 0, "%"),
        ]
        if smoothed_pairs is not None:
            s = smoothed_pairs.get((g.node_id, g.index))
            row.append(fmt(_opt(s, "util_gpu_pct"), 1, "%") if s is not None else "-")
            row.append(fmt(_opt(s, "util_trend_pct_per_min"), 1) if s is not None else "-")
        row += [
            mem,
            fmt(_opt(g, "temperature_c"), 0),
            fmt(_opt(g, "power_w"), 0),
            g.active_tasks,
            fmt(g.reading_age_s, 1) if g.reading_age_s >= 0 else "-",
            ",".join(g.flags),
        ]
        rows.append(row)
    return rows


_GPU_HEADERS = ["NODE", "GPU", "MODEL", "STATE", "HEALTH", "UTIL", "MEM GiB", "TEMP C", "POWER W", "TASKS", "AGE s", "FLAGS"]


@command("gpus")
def cmd_gpus(args: argparse.Namespace) -> int:
    request = cpb.ListGpusRequest(
        node_id=args.node or "",
        model=args.model or "",
        values=cpb.VALUE_VIEW_SMOOTHED if args.smoothed else cpb.VALUE_VIEW_RAW,
        metrics=[m for m in (args.metrics or "").split(",") if m],
    )
    with _channel(args) as ch:
        gpus = cpb_grpc.ClusterOperatorStub(ch).ListGpus(request, timeout=args.timeout).gpus
    if args.json:
        _print_json(gpus)
        return 0
    print(render_table(_GPU_HEADERS, _gpu_rows(gpus)))
    return 0


@command("processes")
def cmd_processes(args: argparse.Namespace) -> int:
    """Compute processes on every GPU as its agent lists them (nvidia-smi's
    process table, cluster-wide), most memory first, next to the tasks gpulb
    leased there: a GPU whose processes hold memory its leases do not
    account for runs work gpulb did not place."""
    request = cpb.ListGpusRequest(node_id=args.node or "", metrics=["memory"])
    with _channel(args) as ch:
        gpus = cpb_grpc.ClusterOperatorStub(ch).ListGpus(request, timeout=args.timeout).gpus
    listed = [(g, p) for g in gpus for p in g.processes]
    if args.json:
        print(json.dumps([{"node_id": g.node_id, "gpu_index": g.index, "gpu_uuid": g.uuid, "pid": p.pid,
                           "used_memory_mib": p.used_memory_mib, "gpulb_tasks_on_gpu": g.active_tasks}
                          for g, p in listed], indent=2))
        return 0
    if not listed:
        print(f"no compute processes listed on {len(gpus)} GPU(s)")
        return 0
    rows = [[g.node_id, g.index, p.pid, f"{p.used_memory_mib:,}", g.active_tasks,
             fmt(_opt(g, "memory_used_mib"), 0)] for g, p in listed]
    print(render_table(["NODE", "GPU", "PID", "MEM MiB", "GPULB TASKS", "GPU MEM USED MiB"], rows))
    return 0


#: the raw fields ``gpulb top`` shows (xid_last for its flag); the
#: coordinator builds each GPU's message on its event loop, half of them fewer
_TOP_METRICS = ["util_gpu_pct", "memory_used_mib", "memory_total_mib", "temperature_c", "power_w", "xid_last"]


@command("top")
def cmd_top(args: argparse.Namespace) -> int:
    """A live table of every GPU: raw and smoothed util, memory, temperature,
    power, state and flags, refreshed every ``--interval`` seconds."""
    import time

    live = sys.stdout.isatty() and not args.no_clear
    shown = 0
    with _channel(args) as ch:
        stub = cpb_grpc.ClusterOperatorStub(ch)
        try:
            while args.iterations <= 0 or shown < args.iterations:
                raw = stub.ListGpus(cpb.ListGpusRequest(node_id=args.node or "", metrics=_TOP_METRICS),
                                    timeout=args.timeout).gpus
                # only the smoothed util (and its trend, which comes with it) is shown:
                # the coordinator builds every GPU's message on its event loop
                smooth = stub.ListGpus(
                    cpb.ListGpusRequest(node_id=args.node or "", values=cpb.VALUE_VIEW_SMOOTHED, metrics=["util_gpu_pct"]),
                    timeout=args.timeout,
                ).gpus
                pairs = {(g.node_id, g.index): g for g in smooth}
                headers = _GPU_HEADERS[:6] + ["SMOOTHED", "TREND %/min"] + _GPU_HEADERS[6:]
                table = render_table(headers, _gpu_rows(raw, pairs))
                utils = [g.util_gpu_pct for g in raw if g.HasField("util_gpu_pct")]
                spread = f"util mean {sum(utils) / len(utils):.1f}%  max-min {max(utils) - min(utils):.0f}%" if utils else "no readings yet"
                if live:
                    sys.stdout.write("\x1b[H\x1b[2J")
                print(f"gpulb top - {args.coordinator} - {len(raw)} GPUs - {spread}")
                print(table)
                sys.stdout.flush()
                shown += 1
                if args.iterations <= 0 or shown < args.iterations:
                    time.sleep(args.interval)
        except KeyboardInterrupt:
            pass
    return 0


def _node_action(args: argparse.Namespace, rpc: str) -> int:
    with _channel(args) as ch:
        stub = cpb_grpc.ClusterOperatorStub(ch)
        node = getattr(stub, rpc)(cpb.NodeActionRequest(node_id=args.node, reason=args.reason or ""), timeout=args.timeout).node
    if args.json:
        _print_json([node])
    else:
        print(f"{node.node_id}: {_state_name(node.state)}")
    return 0


for _name, _rpc in (("cordon", "CordonNode"), ("drain", "DrainNode"), ("uncordon", "UncordonNode")):
    COMMANDS[_name] = (lambda rpc: lambda args: _node_action(args, rpc))(_rpc)


@command("nodes")
def cmd_nodes(args: argparse.Namespace) -> int:
    with _channel(args) as ch:
        nodes = cpb_grpc.ClusterOperatorStub(ch).ListNodes(cpb.ListNodesRequest(), timeout=args.timeout).nodes
    if args.json:
        _print_json(nodes)
        return 0
    rows = [
        [
            n.node_id,
            _state_name(n.state),
            n.gpu_count,
            n.model.removeprefix("NVIDIA ").removeprefix("GeForce "),
            n.backend,
            n.driver_version.split(",")[0] or "-",  # the driver; its CUDA version is in --json
            fmt(n.reading_age_s, 1) if n.reading_age_s >= 0 else "-",
            fmt(n.sample_interval_ms / 1000, 1) if n.sample_interval_ms else "-",
            "yes" if n.stale else "no",
            n.envelopes,
            n.resyncs,
            ",".join(f"{k}={v}" for k, v in sorted(n.labels.items())),
        ]
        for n in nodes
    ]
    print(render_table(["NODE", "STATE", "GPUS", "MODEL", "BACKEND", "DRIVER", "AGE s", "PERIOD s", "STALE", "ENVELOPES", "RESYNCS", "LABELS"], rows))
    return 0


def _task_state(state: int) -> str:
    return tpb.TaskState.Name(state).removeprefix("TASK_STATE_").lower()


def _priority(value: int) -> str:
    return tpb.Priority.Name(value).removeprefix("PRIORITY_") if value else "P2"


def _task_rows(tasks) -> list[list]:
    import time

    now = time.time_ns()
    rows = []
    for t in tasks:
        a = t.assignment
        placed = a.node_id and a.placed_at_ns
        # the wait ends when the run first started (a migration is no wait)
        started = (a.run_started_at_ns or a.placed_at_ns) if placed else now
        wait = (started - t.submitted_at_ns) / 1e9 if t.submitted_at_ns else None
        rows.append([
            t.spec.task_id,
            t.spec.tenant or "-",
            _priority(t.spec.priority),
            _priority(t.effective_priority),
            t.spec.kind or "-",
            _task_state(t.state),
            t.spec.num_gpus,
            f"{t.spec.vram_mib / 1024:.1f}",
            f"{a.node_id}:{','.join(map(str, a.gpu_index))}" if a.node_id else "-",
            fmt(wait, 2),
            t.reason or "",
        ])
    return rows


_TASK_HEADERS = ["TASK", "TENANT", "PRIO", "EFF", "KIND", "STATE", "GPUS", "GiB/GPU", "PLACED ON", "WAIT s", "REASON"]


def _labels(pairs: list[str] | None, flag: str) -> dict[str, str]:
    out = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"gpulb: {flag} takes KEY=VALUE, got {pair!r}")
        out[key] = value
    return out


@command("submit")
def cmd_submit(args: argparse.Namespace) -> int:
    """Submit a task; by default wait for its placement and print the assignment."""
    import uuid

    spec = tpb.TaskSpec(
        task_id=args.id or f"task-{uuid.uuid4().hex[:12]}",
        tenant=args.tenant or "",
        priority=tpb.Priority.Value(f"PRIORITY_{args.priority.upper()}"),
        kind=args.kind or "",
        num_gpus=args.gpus,
        vram_mib=int(round(args.vram_gib * 1024)) if args.vram_gib is not None else args.vram_mib,
        gpu_share=args.share,
        duration_s=args.duration,
        gpu_spec=args.gpu_spec or "",
        needs_nvlink=args.nvlink,
        io_heavy=args.io_heavy,
        movable=args.movable,
        deadline_s=args.deadline,
        labels=_labels(args.label, "--label"),
        required_node_labels=_labels(args.require_label, "--require-label"),
        preferred_node_labels=_labels(args.prefer_label, "--prefer-label"),
    )
    if args.array is not None:
        if not 1 <= args.array <= 1000:
            raise SystemExit("gpulb: --array takes 1 to 1000 tasks")
        specs = []
        for i in range(args.array):
            one = tpb.TaskSpec()
            one.CopyFrom(spec)
            one.task_id = f"{spec.task_id}-{i}"
            specs.append(one)
        with _channel(args) as ch:
            tasks = tpb_grpc.SchedulerStub(ch).ScheduleTasks(
                tpb.ScheduleTasksRequest(specs=specs, wait=not args.no_wait), timeout=args.timeout
            ).tasks
        _print_tasks(tasks, args.json)
        return 0
    with _channel(args) as ch:
        task = tpb_grpc.SchedulerStub(ch).ScheduleTask(
            tpb.ScheduleTaskRequest(spec=spec, wait=not args.no_wait), timeout=args.timeout
        ).task
    if args.json:
        _print_json([task])
        return 0
    print(render_table(_TASK_HEADERS, _task_rows([task])))
    a = task.assignment
    if a.node_id:
        print(f"lease {a.lease_id}, expires in {(a.lease_expires_at_ns - a.placed_at_ns) / 1e9:.0f} s; "
              f"GPU uuids {', '.join(a.gpu_uuid)}")
        terms = ", ".join(f"{k}={v:.3f}" for k, v in sorted(a.score.terms.items()))
        print(f"chosen by {a.score.policy}: score {a.score.total:.3f} ({terms}) among {a.score.candidates} candidates")
    return 0


@command("tasks")
def cmd_tasks(args: argparse.Namespace) -> int:
    state = tpb.TaskState.Value(f"TASK_STATE_{args.state.upper()}") if args.state else 0
    with _channel(args) as ch:
        tasks = tpb_grpc.SchedulerStub(ch).ListTasks(
            tpb.ListTasksRequest(state=state, tenant=args.tenant or "", limit=args.limit), timeout=args.timeout
        ).tasks
    _print_tasks(tasks, args.json)
    return 0


def _print_tasks(tasks, as_json: bool) -> None:
    if as_json:
        _print_json(tasks)
    else:
        print(render_table(_TASK_HEADERS, _task_rows(tasks)))


@command("queue")
def cmd_queue(args: argparse.Namespace) -> int:
    with _channel(args) as ch:
        queue = tpb_grpc.SchedulerStub(ch).GetQueue(tpb.GetQueueRequest(), timeout=args.timeout)
    if args.json:
        print(json.dumps(MessageToDict(queue, preserving_proto_field_name=True), indent=2))
        return 0
    print(render_table(["CLASS", "DEPTH", "OLDEST WAIT s"], [[_priority(c.priority), c.depth, fmt(c.oldest_wait_s, 1)] for c in queue.classes]))
    print(f"placed since start: {queue.placed}; P0 SLA misses: {queue.sla_misses}")
    if queue.head:
        print("\nnext in dispatch order:")
        print(render_table(_TASK_HEADERS, _task_rows(queue.head)))
    return 0


@command("policy")
def cmd_policy(args: argparse.Namespace) -> int:
    with _channel(args) as ch:
        stub = tpb_grpc.SchedulerStub(ch)
        if args.action == "set":
            weights = {}
            for pair in (args.weights or "").split(","):
                if not pair:
                    continue
                key, sep, value = pair.partition("=")
                try:
                    weights[key] = float(value)
                except ValueError:
                    raise SystemExit(f"gpulb: --weights takes TERM=NUMBER pairs, got {pair!r}") from None
            policy = stub.SetPolicy(tpb.SetPolicyRequest(name=args.name or "", weights=weights), timeout=args.timeout)
        else:
            policy = stub.GetPolicy(tpb.GetPolicyRequest(), timeout=args.timeout)
    if args.json:
        print(json.dumps(MessageToDict(policy, preserving_proto_field_name=True), indent=2))
        return 0
    print(f"policy: {policy.name}   (available: {', '.join(policy.available)})")
    if policy.weights:
        print(render_table(["TERM", "WEIGHT"], [[k, f"{v:g}"] for k, v in sorted(policy.weights.items())]))
    return 0


@command("complete")
def cmd_complete(args: argparse.Namespace) -> int:
    with _channel(args) as ch:
        stub = tpb_grpc.SchedulerStub(ch)
        lease = args.lease or stub.GetTask(tpb.GetTaskRequest(task_id=args.task), timeout=args.timeout).assignment.lease_id
        task = stub.CompleteTask(tpb.CompleteTaskRequest(task_id=args.task, lease_id=lease, failed=args.failed), timeout=args.timeout).task
    print(f"{task.spec.task_id}: {_task_state(task.state)}")
    return 0


@command("migrate")
def cmd_migrate(args: argparse.Namespace) -> int:
    """Move a leased task's lease to other GPUs (a rebalance plan's move)."""
    with _channel(args) as ch:
        stub = tpb_grpc.SchedulerStub(ch)
        uuids = []
        for gpu in args.to:
            node, sep, indexes = gpu.rpartition(":")
            if gpu.startswith("GPU-") or not sep:
                uuids.append(gpu)
                continue
            gpus = cpb_grpc.ClusterOperatorStub(ch).ListGpus(cpb.ListGpusRequest(node_id=node), timeout=args.timeout).gpus
            for index in indexes.split(","):  # NODE:0,1 as a plan prints a multi-GPU move
                found = [g.uuid for g in gpus if str(g.index) == index.strip()]
                if not found:
                    raise SystemExit(f"gpulb: --to-gpu {gpu}: node {node!r} has no GPU {index}")
                uuids.append(found[0])
        lease = args.lease or stub.GetTask(tpb.GetTaskRequest(task_id=args.task), timeout=args.timeout).assignment.lease_id
        task = stub.MigrateTask(tpb.MigrateTaskRequest(task_id=args.task, lease_id=lease, to_gpu_uuid=uuids), timeout=args.timeout).task
    a = task.assignment
    print(f"{task.spec.task_id}: {_task_state(task.state)} on {a.node_id}:{','.join(map(str, a.gpu_index))}, lease {a.lease_id}")
    return 0


@command("cancel")
def cmd_cancel(args: argparse.Namespace) -> int:
    with _channel(args) as ch:
        task = tpb_grpc.SchedulerStub(ch).CancelTask(tpb.CancelTaskRequest(task_id=args.task, reason=args.reason or ""), timeout=args.timeout).task
    print(f"{task.spec.task_id}: {_task_state(task.state)}")
    return 0


@command("watch")
def cmd_watch(args: argparse.Namespace) -> int:
    """Print a task's state changes until it ends."""
    with _channel(args) as ch:
        for task in tpb_grpc.SchedulerStub(ch).WatchTask(tpb.WatchTaskRequest(task_id=args.task)):
            where = f" on {task.assignment.node_id}:{','.join(map(str, task.assignment.gpu_index))}" if task.assignment.node_id else ""
            print(f"{task.spec.task_id}: {_task_state(task.state)}{where} {task.reason}".rstrip(), flush=True)
    return 0


def _ratio_pct(value: float) -> str:
    return "-" if value != value else f"{value * 100:.1f}%"  # NaN: nothing predicted yet


def _plan_lines(plan) -> list[str]:
    moves = [
        [m.task_id, m.kind, f"{m.from_node_id}:{','.join(map(str, move_gpus(m, 'from')[0]))}",
         f"{m.to_node_id}:{','.join(map(str, move_gpus(m, 'to')[0]))}",
         fmt(m.load_pct, 1, "%"), fmt(m.from_util_pct, 1, "%"), fmt(m.to_util_pct, 1, "%"), fmt(m.variance_after, 0)]
        for m in plan.moves
    ]
    title = "dry run" if plan.dry_run else f"plan {plan.plan_id}"
    return [
        f"{title} ({plan.trigger}): variance {plan.variance_before:.0f} -> {plan.variance_after:.0f} %², "
        f"spread {plan.spread_before:.1f} -> {plan.spread_after:.1f} pp",
        render_table(["TASK", "KIND", "FROM", "TO", "LOAD", "FROM UTIL", "TO UTIL", "VARIANCE AFTER"], moves),
    ]


@command("advisor")
def cmd_advisor(args: argparse.Namespace) -> int:
    """What the predictor has learned, and the rebalance advisor's plans."""
    with _channel(args) as ch:
        stub = apb_grpc.AdvisorStub(ch)
        if args.action == "predictions":
            got = stub.GetPredictions(apb.GetPredictionsRequest(model=args.model or "", kind=args.kind or "", node_id=args.node or ""),
                                      timeout=args.timeout)
            if args.json:
                print(json.dumps(MessageToDict(got, preserving_proto_field_name=True), indent=2))
                return 0
            print(f"learned from {got.samples} completions; MAPE {_ratio_pct(got.mape_ratio)} over the last {got.error_window}")
            # OVERRUN P90: how many times its prediction a run of the kind may take,
            # the backfill's margin once above backfill_estimate_factor
            print(render_table(["MODEL", "KIND", "SLOWDOWN", "PRIOR", "SAMPLES", "MAPE", "OVERRUN P90"],
                               [[f.model, f.kind or "(all)", f"{f.slowdown:.3f}", f"{f.prior:.3f}", f.samples, _ratio_pct(f.mape_ratio),
                                 "-" if math.isnan(f.overrun_ratio) else f"{f.overrun_ratio:.2f}x"]
                                for f in got.models]))
            if got.nodes:
                print(render_table(["NODE", "RESIDUAL", "SAMPLES", "MAPE"],
                                   [[n.node_id, f"{n.residual:.3f}", n.samples, _ratio_pct(n.mape_ratio)] for n in got.nodes]))
            if got.memory_growth:
                print("GPU memory used at peak / asked (vram_mib), from ended tasks; the oom_risk score reads it")
                print(render_table(["KIND", "SAMPLES", "OOM KILLS", "P50", "P95", "P99", "MAX"],
                                   [[g.kind or "(all)", g.samples, g.oom_kills, f"{g.p50:.3f}", f"{g.p95:.3f}",
                                     f"{g.p99:.3f}", f"{g.max:.3f}"] for g in got.memory_growth]))
            return 0
        if args.action == "execute":
            return _execute_plans(args, ch, stub)
        if args.action == "watch":
            for plan in stub.WatchPlans(apb.WatchPlansRequest(include_latest=True)):
                if args.json:
                    print(json.dumps(MessageToDict(plan, preserving_proto_field_name=True)), flush=True)
                else:
                    print("\n".join(_plan_lines(plan)), flush=True)
            return 0
        got = stub.GetPlan(apb.GetPlanRequest(evaluate_now=args.now), timeout=args.timeout)
    if args.json:
        print(json.dumps(MessageToDict(got, preserving_proto_field_name=True), indent=2))
        return 0
    t = got.trigger
    state = "FIRED (" + t.reason + (", held" if t.held else "") + ")" if t.fired else "quiet"
    print(f"trigger {state} over {t.gpus} GPUs: variance {t.variance:.0f} %² (fires above {t.variance_threshold:g}, "
          f"then holds down to {t.release_variance:g}); "
          f"hottest {t.hottest_pct:.1f} % (hot above {t.hot_pct:g}) with {t.rising} rising "
          f"(> {t.rising_pct_per_min:g} %/min; {t.rising_gpus} needed)")
    if got.HasField("plan"):
        print("\n".join(_plan_lines(got.plan)))
    else:
        print("no plan" + (" would be made now" if args.now else " yet") + _why_no_move(got.no_move))
    return 0


# reason (scheduler.advisor.WHY_NO_MOVE) -> how to say it; a count of tasks follows where one applies
_NO_MOVE_WORDS = {
    "not_fired": "the trigger has not fired",
    "window_full": "this window's moves are used (max_moves)",
    "tasks_queued": "wait in the queue (pause_when_queued)",
    "too_few_gpus": "fewer than 2 GPUs are counted",
    "pinned": "of kinds that may not move",
    "cooling_down": "moved within cooldown_s",
    "too_young": "placed under min_age_s ago",
    "not_on_a_hot_gpu": "not on a GPU hotter than the mean",
    "load_not_in_the_gap": "with no GPU cool enough to narrow the gap by margin_pct",
    "no_gpu_takes_it": "that no other GPU passes the filters for",
    "reserve": "that only GPUs or nodes kept with room for a large task would take (reserve_share)",
}


def _why_no_move(why) -> str:
    if not why:
        return ""
    parts = []
    for reason, count in sorted(why.items(), key=lambda kv: -kv[1]):
        words = _NO_MOVE_WORDS.get(reason, reason)
        per_task = reason not in ("not_fired", "window_full", "too_few_gpus")
        parts.append(f"{count} task{'s' if count != 1 else ''} {words}" if per_task else words)
    return ": " + "; ".join(parts)


def _execute_plans(args: argparse.Namespace, ch: grpc.Channel, stub: apb_grpc.AdvisorStub) -> int:
    """``gpulb advisor execute``: carry out every plan from now on, or the one
    on stdin (``--stdin``: the coordinator's ``advisor_hook`` runs it per
    plan) (``coordinator.executor``); a line (or a JSON object) per move. Exit 0,
    or 1 when a moved task's restart command failed (it holds a lease on its
    new GPU and is not running: the operator's turn)."""
    import shlex

    executor = PlanExecutor(
        tpb_grpc.SchedulerStub(ch),
        checkpoint=shlex.split(args.checkpoint or ""),
        restart=shlex.split(args.restart or ""),
        command_timeout_s=args.command_timeout,
        rpc_timeout_s=args.timeout,
    )
    if args.stdin:
        # one plan as the coordinator's advisor_hook writes it (Plan.to_dict)
        from google.protobuf import json_format

        try:
            plans = [json_format.ParseDict(json.load(sys.stdin), apb.RebalancePlan(), ignore_unknown_fields=True)]
        except (ValueError, json_format.ParseError) as exc:
            raise SystemExit(f"gpulb: advisor execute --stdin: not a plan: {exc}") from None
    else:
        plans = stub.WatchPlans(apb.WatchPlansRequest(include_latest=False))
    status = 0
    seen = 0
    for plan in plans:
        for outcome in executor.execute(plan):
            if outcome.outcome == "restart failed":
                status = 1
            if args.json:
                print(json.dumps(outcome.to_dict()), flush=True)
            else:
                detail = f" ({outcome.detail})" if outcome.detail else ""
                print(f"plan {outcome.plan_id}: {outcome.task_id} {outcome.from_gpu} -> {outcome.to_gpu}: "
                      f"{outcome.outcome}, lease {outcome.lease_id}{detail}", flush=True)
        seen += 1
        if args.plans and seen >= args.plans:
            break
    return status


@command("demo")
def cmd_demo(args: argparse.Namespace) -> int:
    from coordinator.demo import run_demo

    return run_demo(args)


@command("bench")
def cmd_bench(args: argparse.Namespace) -> int:
    if args.what == "schedule":
        from coordinator.schedbench import run_sched_bench

        return run_sched_bench(args)
    if args.what == "ingest":
        from coordinator.ingestbench import run_ingest_bench

        return run_ingest_bench(args)
    from agent.wirebench import run_bench

    return run_bench(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpulb",
        description="Operate a gpulb GPU cluster.",
        epilog="Offline: gpulb simulate --trace T --cluster C [--policy ...] (replay a trace under each policy); "
        "gpulb trace convert openb POD_CSV OUT_CSV; gpulb cluster convert openb NODE_CSV OUT_CSV; "
        "gpulb cluster homogeneous --hosts 8 --gpus 4 --model 'RTX 4090' OUT_CSV. Each takes --help.",
    )
    p.add_argument(
        "--coordinator",
        default=os.environ.get("GPULB_COORDINATOR", "127.0.0.1:50051"),
        help="HOST:PORT of the coordinator (env GPULB_COORDINATOR)",
    )
    p.add_argument("--timeout", type=float, default=10.0, help="RPC deadline, s")
    p.add_argument("--ca-file", default=os.environ.get("GPULB_CA_FILE"), help="PEM CA of the coordinator's certificate: use TLS (env GPULB_CA_FILE)")
    p.add_argument("--token", default=os.environ.get("GPULB_TOKEN"), help="bearer token (env GPULB_TOKEN)")
    p.add_argument("--token-file", default=os.environ.get("GPULB_TOKEN_FILE"), help="file holding the bearer token (env GPULB_TOKEN_FILE)")
    sub = p.add_subparsers(dest="command", required=True)

    gpus = sub.add_parser("gpus", help="list GPUs with their latest readings")
    gpus.add_argument("--node", help="only this node")
    gpus.add_argument("--model", help="only models containing this text")
    gpus.add_argument("--metrics", help="comma-separated metrics (util,memory,temp,power,...)")
    gpus.add_argument("--smoothed", action="store_true", help="anomaly-filtered EWMA values instead of raw")
    gpus.add_argument("--json", action="store_true")

    procs = sub.add_parser("processes", help="compute processes per GPU, as the agents list them")
    procs.add_argument("--node", help="only this node")
    procs.add_argument("--json", action="store_true")

    nodes = sub.add_parser("nodes", help="list nodes")
    nodes.add_argument("--json", action="store_true")

    top = sub.add_parser("top", help="a live, refreshing table of every GPU")
    top.add_argument("--node", help="only this node")
    top.add_argument("--interval", type=float, default=1.0, help="s between refreshes")
    top.add_argument("--iterations", type=int, default=0, help="stop after N refreshes (0 = until Ctrl-C)")
    top.add_argument("--no-clear", action="store_true", help="append tables instead of redrawing the screen")

    for name, text in (("cordon", "no new tasks on NODE"), ("drain", "no new tasks on NODE; running ones finish"), ("uncordon", "NODE takes tasks again")):
        action = sub.add_parser(name, help=text)
        action.add_argument("node", metavar="NODE")
        action.add_argument("--reason", help="free text, logged by the coordinator")
        action.add_argument("--json", action="store_true")

    submit = sub.add_parser("submit", help="submit a task and wait for its placement")
    submit.add_argument("--id", help="task id (default: a random one); resubmitting the same id and spec is idempotent")
    submit.add_argument("--tenant")
    submit.add_argument("--priority", default="P2", choices=("P0", "P1", "P2", "P3", "p0", "p1", "p2", "p3"))
    submit.add_argument("--kind", help="inference, training, batch, background or free text")
    submit.add_argument("--gpus", type=int, default=1, help="GPUs on one node")
    mem = submit.add_mutually_exclusive_group()
    mem.add_argument("--vram-mib", type=int, default=1024, help="MiB per GPU")
    mem.add_argument("--vram-gib", type=float, help="GiB per GPU")
    submit.add_argument("--share", type=float, default=0.5, help="expected utilisation share per GPU, 0..1")
    submit.add_argument("--duration", type=float, default=0.0, help="estimated run time, s (0 = unknown)")
    submit.add_argument("--gpu-spec", help="allowed models, e.g. 'V100M16|V100M32' or 'RTX 4090'")
    submit.add_argument("--nvlink", action="store_true", help="needs NVLink-connected GPUs")
    submit.add_argument("--io-heavy", action="store_true", help="storage-bound: avoid nodes with slow disks")
    submit.add_argument("--movable", action="store_true", help="may be migrated by the rebalance advisor")
    submit.add_argument("--deadline", type=float, default=0.0, help="s to wait for a placement (0 = no deadline)")
    submit.add_argument("--label", action="append", help="task label KEY=VALUE (repeatable)")
    submit.add_argument("--require-label", action="append", help="node must carry KEY=VALUE (repeatable)")
    submit.add_argument("--prefer-label", action="append", help="prefer nodes carrying KEY=VALUE (repeatable)")
    submit.add_argument("--no-wait", action="store_true", help="return at once with the queued task")
    submit.add_argument("--array", type=int, metavar="N",
                        help="a job array: N tasks ID-0..ID-N-1 of this spec in one ScheduleTasks call (1..1000)")
    submit.add_argument("--json", action="store_true")

    tasks = sub.add_parser("tasks", help="list tasks")
    tasks.add_argument("--state", choices=[n.removeprefix("TASK_STATE_").lower() for n in tpb.TaskState.keys()[1:]])
    tasks.add_argument("--tenant")
    tasks.add_argument("--limit", type=int, default=1000)
    tasks.add_argument("--json", action="store_true")

    queue = sub.add_parser("queue", help="queue depth per class and the next tasks in dispatch order")
    queue.add_argument("--json", action="store_true")

    policy = sub.add_parser("policy", help="show or switch the placement policy (no restart)")
    policy.add_argument("action", choices=("get", "set"))
    policy.add_argument("name", nargs="?", help="round_robin, weighted_round_robin, least_connections, load_aware, binpack, fgd")
    policy.add_argument("--weights", help="TERM=NUMBER,... e.g. load=1.0,memory=0.5")
    policy.add_argument("--json", action="store_true")

    complete = sub.add_parser("complete", help="report a leased task finished")
    complete.add_argument("task")
    complete.add_argument("--lease", help="lease id (default: the task's current lease)")
    complete.add_argument("--failed", action="store_true")

    migrate = sub.add_parser("migrate", help="move a leased task to other GPUs in one step (a rebalance plan's move)")
    migrate.add_argument("task")
    migrate.add_argument("--to-gpu", dest="to", action="append", required=True, metavar="GPU",
                         help="destination GPU, as its UUID or NODE:INDEX[,INDEX...] (as `advisor plan` prints "
                              "a move); every GPU of the task, in one or several --to-gpu")
    migrate.add_argument("--lease", help="lease id (default: the task's current lease)")

    cancel = sub.add_parser("cancel", help="cancel a queued or leased task")
    cancel.add_argument("task")
    cancel.add_argument("--reason")

    watch = sub.add_parser("watch", help="follow a task's state changes until it ends")
    watch.add_argument("task")

    advisor = sub.add_parser("advisor", help="learned GPU speeds and memory growth, rebalance plans (predictions | plan | watch | execute)")
    advisor.add_argument("action", choices=("predictions", "plan", "watch", "execute"))
    advisor.add_argument("--checkpoint", help="execute: command run before each move, the move in GPULB_* variables "
                         "(coordinator/executor.py); a failure skips the move")
    advisor.add_argument("--restart", help="execute: command run after each move (or in place when the move is refused)")
    advisor.add_argument("--command-timeout", type=float, default=600.0, help="execute: s a checkpoint or restart may take")
    advisor.add_argument("--plans", type=int, default=0, help="execute: stop after this many plans (0: run until stopped)")
    advisor.add_argument("--stdin", action="store_true",
                         help="execute: carry out the one plan on standard input (as the coordinator's advisor_hook gives it) "
                         "instead of watching for plans")
    advisor.add_argument("--now", action="store_true", help="plan: evaluate the cluster now (a dry run that moves nothing)")
    advisor.add_argument("--model", help="predictions: only this GPU model")
    advisor.add_argument("--kind", help="predictions: only this task kind")
    advisor.add_argument("--node", help="predictions: only this node's residual")
    advisor.add_argument("--json", action="store_true")

    from coordinator.demo import add_demo_arguments

    sub.add_parser("set-search", help="build the multi-GPU set search ahead of time (build [--out DIR]), or show how it runs (status)")
    add_demo_arguments(sub.add_parser("demo", help="run a coordinator and simulated agents on loopback, and balance a workload"))

    bench = sub.add_parser("bench", help="benchmarks")
    bench.add_argument(
        "what",
        choices=("wire", "ingest", "schedule"),
        help="wire: bytes per GPU-sample; ingest: telemetry throughput; schedule: placements/s and latency",
    )
    bench.add_argument("--json", action="store_true")
    bench.add_argument("--samples", type=int, default=600, help="wire: sampling rounds per scenario")
    bench.add_argument("--gpus", type=int, default=8, help="GPUs per host")
    bench.add_argument("--hosts", type=int, default=2500, help="ingest: simulated hosts (one stream each)")
    bench.add_argument("--interval", type=float, default=0.2, help="ingest: s between a host's envelopes")
    # 40 s: over 20 s windows the counters read at the two scrapes were ~0.7 % apart from the
    # generator's count (an offset, gone over 40 s), which read as a shortfall
    bench.add_argument("--duration", type=float, default=40.0, help="ingest: measured s")
    bench.add_argument("--warmup", type=float, default=10.0, help="ingest: s before measuring")
    bench.add_argument("--channels", type=int, default=25, help="ingest: HTTP/2 connections the generator spreads streams over")
    bench.add_argument("--nodes", default="1000,5000", help="schedule: comma-separated synthetic cluster sizes (8 GPUs each)")
    bench.add_argument("--clients", type=int, default=16, help="schedule: concurrent submitting clients")
    bench.add_argument("--requests", type=int, default=3000, help="schedule: ScheduleTask calls per size")
    return p


#: commands that run offline, with their own argument parsers
_OFFLINE = {"simulate", "trace", "cluster"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _OFFLINE:
        from scheduler.simulator import simulate_main, trace_main

        return simulate_main(argv[1:]) if argv[0] == "simulate" else trace_main(argv)
    if argv and argv[0] == "set-search":  # the compiled set search: build it ahead of time, or say how it runs
        from scheduler.setsearch import main as set_search_main

        return set_search_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except grpc.RpcError as exc:
        print(f"gpulb: {args.command}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
