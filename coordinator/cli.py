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

from coordinator.convert import UnknownMetric, resolve_metrics
from coordinator.executor import PlanExecutor, move_gpus
from coordinator.tables import fmt, render_table, safe_text, terminal_width, wrap
from coordinator.taskconvert import MAX_VRAM_MIB
from protos import advisor_pb2 as apb
from protos import advisor_pb2_grpc as apb_grpc
from protos import cluster_pb2 as cpb
from protos import cluster_pb2_grpc as cpb_grpc
from protos import tasks_pb2 as tpb
from protos import tasks_pb2_grpc as tpb_grpc
from protos import telemetry_pb2 as pb
from scheduler.policies import POLICIES
from scheduler.task import MAX_GPUS

__all__ = ["main", "build_parser"]

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {}


def command(name: str):
    def register(fn):
        COMMANDS[name] = fn
        return fn

    return register


#: ``gpulb submit``'s exit status when ``--timeout`` ran out with the task still
#: queued (it stays queued; one whose ``--deadline`` passed exits 1: it expires)
EXIT_STILL_QUEUED = 3
#: the status a shell shows for a process that SIGPIPE ended (``gpulb ... | head``)
EXIT_BROKEN_PIPE = 128 + 13


class UsageExit(SystemExit):
    """argparse's exit for a bad invocation (status 2), whose ``str`` is the
    message already written to stderr (argparse's own reads "2")."""

    def __init__(self, message: str, status: int = 2) -> None:
        super().__init__(status)
        self.message = message

    def __str__(self) -> str:
        return self.message


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        self.print_usage(sys.stderr)
        text = f"{self.prog}: error: {message}"
        print(text, file=sys.stderr)
        raise UsageExit(text)


def _fail(message: str, status: int = 2):
    """A bad setting found after parsing (a file named by a flag or an
    environment variable): the message on stderr, no traceback."""
    text = f"gpulb: error: {message}"
    print(text, file=sys.stderr)
    raise UsageExit(text, status)


def _number(kind: type, low: float | None = None, high: float | None = None, *, above: bool = False,
            bounds: str | None = None):
    """An argparse ``type`` for an integer (``kind`` int) or a finite float in
    [low, high] (``above``: low excluded); the error names the range."""
    noun = "an integer" if kind is int else "a finite number"

    def show(x: float) -> str:
        return str(int(x)) if float(x).is_integer() else f"{x:g}"

    if bounds is None:
        if low is not None and high is not None and not above:
            bounds = f"from {show(low)} to {show(high)}"
        else:
            bounds = " and ".join(
                ([f"{'>' if above else '>='} {show(low)}"] if low is not None else []) + ([f"<= {show(high)}"] if high is not None else [])
            )
    wanted = f"must be {noun} {bounds}".rstrip()

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{wanted}, got {text!r}") from None
        if kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{wanted}, got {text!r}")
        if (low is not None and (value < low or (above and value == low))) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{wanted}, got {text!r}")
        return value

    parse.__name__ = "integer" if kind is int else "number"
    return parse


#: an RPC deadline or a command's time limit, s: grpc reads one over ~9e9 s as already passed
_TIMEOUT = _number(float, 0, 604800, above=True, bounds="> 0 and <= 604800 (a week)")


def _key_value(flag_value: str) -> tuple[str, str]:
    """argparse ``type`` of --label and friends: KEY=VALUE, KEY not empty."""
    key, sep, value = flag_value.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"takes KEY=VALUE, got {flag_value!r}")
    return key, value


def _weights(text: str) -> dict[str, float]:
    """argparse ``type`` of --weights: TERM=NUMBER,... (finite, >= 0)."""
    weights = {}
    for pair in text.split(","):
        if not pair:
            continue
        key, sep, value = pair.partition("=")
        try:
            number = float(value)
        except ValueError:
            number = None
        if not sep or not key or number is None:
            raise argparse.ArgumentTypeError(f"takes TERM=NUMBER pairs, e.g. load=1.0,memory=0.5; got {pair!r}")
        if not math.isfinite(number) or number < 0:
            raise argparse.ArgumentTypeError(f"weight {key!r} must be a finite number >= 0, got {value!r}")
        weights[key] = number
    return weights


def _metric_names(text: str) -> str:
    """argparse ``type`` of ``gpus --metrics``: comma-separated names that
    ListGpus resolves (coordinator.convert, the same table), so a typo is a
    usage error here, exit 2, rather than the coordinator's INVALID_ARGUMENT
    after a round trip, exit 1."""
    try:
        resolve_metrics([name for name in text.split(",") if name])
    except UnknownMetric as exc:
        raise argparse.ArgumentTypeError(str(exc).partition(": ")[2]) from None  # without its "metrics[i]: "
    return text


def _policy_name(text: str) -> str:
    """argparse ``type`` of ``policy set NAME``: a policy the coordinator's
    registry holds (scheduler.policies, shipped with this CLI), so a typo is
    a usage error, exit 2, before any RPC."""
    if text not in POLICIES:
        raise argparse.ArgumentTypeError(f"unknown policy {text!r}; available: {', '.join(POLICIES)}")
    return text


def _sizes(text: str) -> str:
    """argparse ``type`` of ``bench --nodes``: comma-separated integers >= 1."""
    sizes = [x for x in text.replace(" ", "").split(",") if x]
    if not sizes or not all(x.isdigit() and int(x) >= 1 for x in sizes):
        raise argparse.ArgumentTypeError(f"takes comma-separated node counts >= 1, e.g. 1000,5000; got {text!r}")
    return text


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
        try:
            with open(args.token_file) as fh:
                token = fh.read().strip()
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) else "not text"
            _fail(f"cannot read the token file {args.token_file!r} ({_source(args.token_file, '--token-file', 'GPULB_TOKEN_FILE')}): {why}")
        from coordinator.security import token_problem

        problem = token_problem(token)  # empty, the coordinator's digest file, bytes gRPC metadata cannot carry
        if problem:
            _fail(f"the token file {args.token_file!r} ({_source(args.token_file, '--token-file', 'GPULB_TOKEN_FILE')}): {problem}")
    if args.ca_file:
        from coordinator.security import SecurityConfigError, channel_credentials

        try:
            credentials = channel_credentials(args.ca_file, token=token or None)
        except SecurityConfigError as exc:
            _fail(f"the CA file ({_source(args.ca_file, '--ca-file', 'GPULB_CA_FILE')}): {exc}")
        return grpc.secure_channel(args.coordinator, credentials)
    channel = grpc.insecure_channel(args.coordinator)
    return grpc.intercept_channel(channel, _TokenCalls(token)) if token else channel


def _source(value: str, flag: str, variable: str) -> str:
    """Which of a flag and its environment variable gave ``value`` (the
    variable when both hold it)."""
    return f"env {variable}" if os.environ.get(variable) == value else flag


def _state_name(state: int) -> str:
    return cpb.NodeState.Name(state).removeprefix("NODE_STATE_").lower()


def _health_name(health: int) -> str:
    return pb.GpuHealth.Name(health).removeprefix("GPU_HEALTH_").lower() if health else "-"


def _to_dict(message) -> dict:
    """``message`` for --json: every field, zero, false and empty ones too (a
    GPU's index 0, a node's 0 active tasks), so that a script reads the same
    keys from every object; fields with presence (a reading a GPU does not
    report) stay absent when unset."""
    try:
        return MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    except TypeError:  # protobuf < 5.26 names it otherwise
        return MessageToDict(message, preserving_proto_field_name=True, including_default_value_fields=True)


def _print_json(messages) -> None:
    print(json.dumps([_to_dict(m) for m in messages], indent=2))


def _table(args: argparse.Namespace, headers, rows, give_way=(), *, width: int | None = -1, note: bool = True) -> str:
    """``render_table`` fitted to the terminal: unless ``--wide``, the columns
    in ``give_way`` are cut or left out, in that order, while the table is
    wider than the terminal (``width``: that width, by default the
    terminal's; a pipe or a file gets the whole table). ``note``: say on
    stderr which columns gave way."""
    if width == -1:
        width = terminal_width()
    if getattr(args, "wide", False):
        width = None
    left_out: list[str] = []
    text = render_table(headers, rows, width=width, give_way=give_way, left_out=left_out)
    if left_out and note:
        print(f"gpulb: {args.command}: {', '.join(left_out)} cut or left out to fit {width} columns "
              "(--wide shows everything)", file=sys.stderr)
    return text


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
#: how the GPU tables (gpus, top) give way on a narrow terminal, least needed
#: first: a bad HEALTH is also a flag (frozen, read_failed, lost)
_GPU_GIVE_WAY = (("FLAGS", "cut"), ("AGE s", "drop"), ("TREND %/min", "drop"), ("HEALTH", "drop"), ("MODEL", "drop"),
                 ("TASKS", "drop"), ("POWER W", "drop"), ("STATE", "drop"), ("FLAGS", "cut", 5))


def _check_node(stub, node_id: str | None, gpus, timeout: float) -> None:
    """A coordinator whose ListGpus filters by node without saying whether it
    exists: an empty answer for a node asks GetNode, whose NOT_FOUND names
    it (a newer ListGpus says NOT_FOUND itself)."""
    if node_id and not gpus:
        stub.GetNode(cpb.GetNodeRequest(node_id=node_id), timeout=timeout)


@command("gpus")
def cmd_gpus(args: argparse.Namespace) -> int:
    request = cpb.ListGpusRequest(
        node_id=args.node or "",
        model=args.model or "",
        values=cpb.VALUE_VIEW_SMOOTHED if args.smoothed else cpb.VALUE_VIEW_RAW,
        metrics=[m for m in (args.metrics or "").split(",") if m],
    )
    with _channel(args) as ch:
        stub = cpb_grpc.ClusterOperatorStub(ch)
        gpus = stub.ListGpus(request, timeout=args.timeout).gpus
        _check_node(stub, args.node, gpus, args.timeout)
    if args.json:
        _print_json(gpus)
        return 0
    headers, rows = _GPU_HEADERS, _gpu_rows(gpus)
    if request.metrics:
        headers, rows = _asked_columns(resolve_metrics(list(request.metrics)), gpus, rows)
    print(_table(args, headers, rows, _GPU_GIVE_WAY))
    return 0


#: the gpus table's reading columns and the fields they show
_GPU_COLUMN_FIELDS = {"UTIL": "util_gpu_pct", "MEM GiB": "memory_used_mib", "TEMP C": "temperature_c", "POWER W": "power_w"}


def _asked_columns(fields: tuple[str, ...], gpus, rows: list[list]) -> tuple[list[str], list[list]]:
    """The gpus table with ``--metrics``: the reading columns of the fields
    asked for, then a column for each other field asked for (QA pass 25:
    TEMP and POWER columns full of "-" when only util and memory were
    asked, and no column at all for clock, pcie or ecc)."""
    keep = [i for i, h in enumerate(_GPU_HEADERS) if h not in _GPU_COLUMN_FIELDS or _GPU_COLUMN_FIELDS[h] in fields]
    shown = set(_GPU_COLUMN_FIELDS.values()) | {"memory_total_mib"}
    extra = [f for f in fields if f not in shown]
    headers = [_GPU_HEADERS[i] for i in keep] + extra
    # whole numbers where the field counts (clocks, throughput, ECC errors, processes)
    places = [0 if f.endswith(("_mhz", "_mbps", "_count", "corrected")) else 1 for f in extra]
    out = [[row[i] for i in keep] + [fmt(_opt(g, f), p) for f, p in zip(extra, places)] for g, row in zip(gpus, rows)]
    return headers, out


@command("processes")
def cmd_processes(args: argparse.Namespace) -> int:
    """Compute processes on every GPU as its agent lists them (nvidia-smi's
    process table, cluster-wide), most memory first, next to the tasks gpulb
    leased there: a GPU whose processes hold memory its leases do not
    account for runs work gpulb did not place."""
    request = cpb.ListGpusRequest(node_id=args.node or "", metrics=["memory"])
    with _channel(args) as ch:
        stub = cpb_grpc.ClusterOperatorStub(ch)
        gpus = stub.ListGpus(request, timeout=args.timeout).gpus
        _check_node(stub, args.node, gpus, args.timeout)
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
                if not shown:
                    _check_node(stub, args.node, raw, args.timeout)
                # only the smoothed util (and its trend, which comes with it) is shown:
                # the coordinator builds every GPU's message on its event loop
                smooth = stub.ListGpus(
                    cpb.ListGpusRequest(node_id=args.node or "", values=cpb.VALUE_VIEW_SMOOTHED, metrics=["util_gpu_pct"]),
                    timeout=args.timeout,
                ).gpus
                pairs = {(g.node_id, g.index): g for g in smooth}
                headers = _GPU_HEADERS[:6] + ["SMOOTHED", "TREND %/min"] + _GPU_HEADERS[6:]
                # a live redraw must never wrap: fitted to the terminal as it is
                # now (resized meanwhile?), less one column (a line that fills
                # the last one wraps early on some terminals)
                width = terminal_width()
                width = None if width is None or args.wide else max(20, width - 1)
                left_out: list[str] = []
                table = render_table(headers, _gpu_rows(raw, pairs), width=width, give_way=_GPU_GIVE_WAY,
                                     left_out=left_out)
                utils = [g.util_gpu_pct for g in raw if g.HasField("util_gpu_pct")]
                spread = f"util mean {sum(utils) / len(utils):.1f}%  max-min {max(utils) - min(utils):.0f}%" if utils else "no readings yet"
                title = f"gpulb top - {args.coordinator} - {len(raw)} GPUs - {spread}"
                if left_out and width is not None and len(title) + 25 <= width:
                    title += " - --wide: every column"
                if live:
                    sys.stdout.write("\x1b[H\x1b[2J")
                print(title if width is None or len(title) <= width else title[: width - 1] + "…")
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


#: how the nodes table gives way on a narrow terminal, least needed first
_NODE_GIVE_WAY = (("LABELS", "cut"), ("ENVELOPES", "drop"), ("RESYNCS", "drop"), ("PERIOD s", "drop"),
                  ("DRIVER", "drop"), ("BACKEND", "drop"), ("LABELS", "drop"), ("MODEL", "cut"))
_NODE_HEADERS = ["NODE", "STATE", "GPUS", "MODEL", "BACKEND", "DRIVER", "AGE s", "PERIOD s", "STALE", "ENVELOPES",
                 "RESYNCS", "LABELS"]


def _node_row(n, now_ns: int) -> list:
    if n.state == cpb.NODE_STATE_REMOVED:
        # out of the view: only the id and when it was last heard of are known
        heard = fmt((now_ns - n.last_heartbeat_ns) / 1e9, 1) if n.last_heartbeat_ns else "-"
        return [n.node_id, "removed", "-", "-", "-", "-", heard, "-", "-", "-", "-", ""]
    return [
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


@command("nodes")
def cmd_nodes(args: argparse.Namespace) -> int:
    """The nodes in the view, then the REMOVED ones (they missed heartbeats
    and left the pool; ``gpulb_nodes{state="removed"}`` counts them until
    they register again or ``gpulb uncordon NODE`` forgets them)."""
    import time

    with _channel(args) as ch:
        stub = cpb_grpc.ClusterOperatorStub(ch)
        nodes = [] if args.removed else list(stub.ListNodes(cpb.ListNodesRequest(), timeout=args.timeout).nodes)
        listed = {n.node_id for n in nodes}
        removed = [n for n in stub.ListNodes(cpb.ListNodesRequest(state=cpb.NODE_STATE_REMOVED), timeout=args.timeout).nodes
                   if n.node_id not in listed]
    nodes += removed
    if args.json:
        _print_json(nodes)
        return 0
    now_ns = time.time_ns()
    print(_table(args, _NODE_HEADERS, [_node_row(n, now_ns) for n in nodes], _NODE_GIVE_WAY))
    if removed:
        # AGE s of a removed node: since its last message
        print(f"gpulb: nodes: {len(removed)} removed (missed heartbeats; counted in gpulb_nodes{{state=\"removed\"}} "
              "until the node registers again): `gpulb uncordon NODE` forgets a decommissioned one", file=sys.stderr)
    return 0


def _task_state(state: int) -> str:
    return tpb.TaskState.Name(state).removeprefix("TASK_STATE_").lower()


def _priority(value: int) -> str:
    return tpb.Priority.Name(value).removeprefix("PRIORITY_") if value else "P2"


#: characters of a reason a table row shows (a waiting task's reason names every
#: filter that refused it: 200 characters wrapped every row on a terminal)
REASON_COLUMN = 80


def _short(reason: str, wide: bool) -> str:
    return reason if wide or len(reason) <= REASON_COLUMN else reason[: REASON_COLUMN - 1] + "…"


def _task_rows(tasks, wide: bool = True) -> list[list]:
    import time

    now = time.time_ns()
    rows = []
    for t in tasks:
        a = t.assignment
        placed = a.node_id and a.placed_at_ns
        # the wait ends when the run first started (a migration is no wait), or
        # when the task ended without a placement (expired, rejected, cancelled)
        ended = (a.run_started_at_ns or a.placed_at_ns) if placed else (t.finished_at_ns or now)
        wait = (ended - t.submitted_at_ns) / 1e9 if t.submitted_at_ns else None
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
            _short(t.reason or "", wide),
        ])
    return rows


_TASK_HEADERS = ["TASK", "TENANT", "PRIO", "EFF", "KIND", "STATE", "GPUS", "GiB/GPU", "PLACED ON", "WAIT s", "REASON"]
#: how the task tables give way on a narrow terminal, least needed first
_TASK_GIVE_WAY = (("REASON", "cut", 30), ("EFF", "drop"), ("TENANT", "drop"), ("GiB/GPU", "drop"), ("KIND", "drop"),
                  ("REASON", "cut"), ("WAIT s", "drop"), ("PLACED ON", "cut", 12), ("TASK", "cut", 12))


def _labels(pairs: list[tuple[str, str]] | None) -> dict[str, str]:
    return dict(pairs or [])  # each checked by _key_value


def _not_placed(tasks, args: argparse.Namespace, waited: float) -> int:
    """The exit status of a waiting ``gpulb submit``: 0 when every task was
    placed; else a line on stderr per task that was not, and 1 when one ended
    without a placement (expired, cancelled...) or reached its deadline, or
    EXIT_STILL_QUEUED when ``--timeout`` ran out with tasks still queued
    (they stay queued)."""
    status = 0
    unplaced = [t for t in tasks if not t.assignment.node_id]
    for shown, t in enumerate(unplaced):
        task_id = t.spec.task_id
        if t.state == tpb.TASK_STATE_QUEUED and t.spec.deadline_s and t.spec.deadline_s <= args.timeout:
            status = 1  # the wait ended at its deadline: the coordinator expires it
            line = f"was not placed by its --deadline {t.spec.deadline_s:g} s (it expires); why: {t.reason or 'no placement yet'}"
        elif t.state == tpb.TASK_STATE_QUEUED:
            status = status or EXIT_STILL_QUEUED
            ended = (f"--timeout {args.timeout:g} s ran out" if waited >= args.timeout - 0.5
                     else f"the coordinator ended the wait after {waited:.1f} s, before --timeout {args.timeout:g} s")
            line = (f"is still queued: {ended}; it stays queued (gpulb watch {task_id}; gpulb cancel {task_id}); "
                    f"why: {t.reason or 'no placement yet'}")
        else:
            status = 1
            line = f"was not placed: {_task_state(t.state)}" + (f", {t.reason}" if t.reason else "")
        if shown < 5:
            print(f"gpulb: submit: {task_id} {line}", file=sys.stderr)
    if len(unplaced) > 5:
        print(f"gpulb: submit: {len(unplaced)} of {len(tasks)} tasks not placed (gpulb tasks lists them)", file=sys.stderr)
    return status


def _lease_line(task, now_ns: int) -> str:
    """What ``gpulb submit`` says of a placed task's lease: the time it has left
    (``now_ns``: the wall clock, as the task's ``*_at_ns`` fields are). A
    resubmitted id returns the task as it is, which may have ended: then its
    state, not a lease it no longer holds."""
    a = task.assignment
    gpus = f"GPU uuids {', '.join(a.gpu_uuid)}"
    if task.state != tpb.TASK_STATE_LEASED:
        ended = f", {(now_ns - task.finished_at_ns) / 1e9:.0f} s ago" if task.finished_at_ns else ""
        reason = f" ({safe_text(task.reason)})" if task.reason else ""
        return f"no lease: the task is {_task_state(task.state)}{ended}{reason}; it ran on {gpus}"
    left = (a.lease_expires_at_ns - now_ns) / 1e9
    expiry = f"expires in {left:.0f} s" if left >= 0 else f"expired {-left:.0f} s ago"
    return f"lease {a.lease_id}, {expiry}; {gpus}"


@command("submit")
def cmd_submit(args: argparse.Namespace) -> int:
    """Submit a task; by default wait for its placement and print the assignment."""
    import time
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
        labels=_labels(args.label),
        required_node_labels=_labels(args.require_label),
        preferred_node_labels=_labels(args.prefer_label),
    )
    if args.array is not None:
        if not 1 <= args.array <= 1000:
            args.usage_error(f"--array takes 1 to 1000 tasks, got {args.array}")
        specs = []
        for i in range(args.array):
            one = tpb.TaskSpec()
            one.CopyFrom(spec)
            one.task_id = f"{spec.task_id}-{i}"
            specs.append(one)
        started = time.monotonic()
        with _channel(args) as ch:
            tasks = tpb_grpc.SchedulerStub(ch).ScheduleTasks(
                tpb.ScheduleTasksRequest(specs=specs, wait=not args.no_wait), timeout=args.timeout
            ).tasks
        _print_tasks(tasks, args.json, args=args)
        return 0 if args.no_wait else _not_placed(tasks, args, time.monotonic() - started)
    started = time.monotonic()
    with _channel(args) as ch:
        task = tpb_grpc.SchedulerStub(ch).ScheduleTask(
            tpb.ScheduleTaskRequest(spec=spec, wait=not args.no_wait), timeout=args.timeout
        ).task
    if args.json:
        _print_json([task])
    else:
        print(_table(args, _TASK_HEADERS, _task_rows([task]), _TASK_GIVE_WAY))
        a = task.assignment
        if a.node_id:
            print(_lease_line(task, time.time_ns()))
            terms = ", ".join(f"{k}={v:.3f}" for k, v in sorted(a.score.terms.items()))
            print(f"chosen by {a.score.policy}: score {a.score.total:.3f} ({terms}) among {a.score.candidates} candidates")
    return 0 if args.no_wait else _not_placed([task], args, time.monotonic() - started)


@command("tasks")
def cmd_tasks(args: argparse.Namespace) -> int:
    state = tpb.TaskState.Value(f"TASK_STATE_{args.state.upper()}") if args.state else 0
    limit = args.limit or 1000  # the coordinator's default
    tasks: list = []
    token = ""
    with _channel(args) as ch:
        stub = tpb_grpc.SchedulerStub(ch)
        # page by page (a reply holds what fits in a message), up to --limit in all
        while True:
            reply = stub.ListTasks(
                tpb.ListTasksRequest(state=state, tenant=args.tenant or "", limit=limit - len(tasks), page_token=token,
                                     paged=True),
                timeout=args.timeout,
            )
            tasks.extend(reply.tasks)
            token = reply.next_page_token
            if not token or len(tasks) >= limit or not reply.tasks:
                break
    _print_tasks(tasks, args.json, wide=args.wide, args=args)
    if token and len(tasks) >= limit and not args.json:
        print(f"gpulb: tasks: the first {limit}; there are more (--limit N, --state, --tenant)", file=sys.stderr)
    elif not token and len(tasks) >= limit and not args.json:
        # a coordinator from before paging sends no token: a full page may not be all
        print(f"gpulb: tasks: the first {limit}; there may be more (--limit N, --state, --tenant)", file=sys.stderr)
    return 0


def _print_tasks(tasks, as_json: bool, wide: bool = False, args: argparse.Namespace | None = None) -> None:
    if as_json:
        _print_json(tasks)
    elif args is None:
        print(render_table(_TASK_HEADERS, _task_rows(tasks, wide)))
    else:
        print(_table(args, _TASK_HEADERS, _task_rows(tasks, wide), _TASK_GIVE_WAY))


def _listed(stub, state: int, timeout: float) -> list:
    """Every task in ``state`` the caller may list (a tenant token: its own),
    page by page."""
    tasks: list = []
    token = ""
    while True:
        reply = stub.ListTasks(tpb.ListTasksRequest(state=state, limit=_TENANT_PAGE, page_token=token, paged=True),
                               timeout=timeout)
        tasks.extend(reply.tasks)
        token = reply.next_page_token
        if not token or not reply.tasks:
            return tasks


#: tasks asked for per ListTasks page by ``gpulb tenants`` (a reply also ends before it outgrows a message)
_TENANT_PAGE = 10_000


def _tenant_rows(queued, leased, gpus_in_view: int, now_ns: int) -> list[dict]:
    """Per tenant, what its queued and leased tasks (``tpb.Task``) hold: the
    rows of ``gpulb tenants``, the most GPUs first (then leased, queued)."""
    rows: dict[str, dict] = {}

    def row(task) -> dict:
        tenant = task.spec.tenant
        if tenant not in rows:
            rows[tenant] = {"tenant": tenant, "queued": 0, "leased": 0, "gpus_leased": 0, "share_of_gpus": 0.0,
                            "vram_mib_leased": 0, "queued_by_class": {p: 0 for p in _CLASSES},
                            "leased_by_class": {p: 0 for p in _CLASSES}, "oldest_wait_s": None}
        return rows[tenant]

    for task in queued:
        r = row(task)
        r["queued"] += 1
        r["queued_by_class"][_priority(task.spec.priority)] += 1
        if task.submitted_at_ns:
            wait = max(0.0, (now_ns - task.submitted_at_ns) / 1e9)
            r["oldest_wait_s"] = wait if r["oldest_wait_s"] is None else max(r["oldest_wait_s"], wait)
    on: dict[str, set[str]] = {}  # tenant -> the GPUs its leases hold (two half-GPU tasks on one: one GPU)
    for task in leased:
        r = row(task)
        gpus = task.spec.num_gpus or 1
        r["leased"] += 1
        r["leased_by_class"][_priority(task.spec.priority)] += 1
        on.setdefault(task.spec.tenant, set()).update(task.assignment.gpu_uuid)
        r["vram_mib_leased"] += task.spec.vram_mib * gpus
    for r in rows.values():
        r["gpus_leased"] = len(on.get(r["tenant"], ()))
        r["share_of_gpus"] = r["gpus_leased"] / gpus_in_view if gpus_in_view else 0.0
    return sorted(rows.values(), key=lambda r: (-r["gpus_leased"], -r["leased"], -r["queued"], r["tenant"]))


_CLASSES = ("P0", "P1", "P2", "P3")
_TENANT_HEADERS = ["TENANT", "QUEUED", "LEASED", "GPUS", "GPU %", "VRAM GiB", "QUEUED P0/P1/P2/P3",
                   "LEASED P0/P1/P2/P3", "OLDEST WAIT s"]
_TENANT_GIVE_WAY = (("LEASED P0/P1/P2/P3", "drop"), ("QUEUED P0/P1/P2/P3", "drop"), ("VRAM GiB", "drop"),
                    ("TENANT", "cut", 16))


@command("tenants")
def cmd_tenants(args: argparse.Namespace) -> int:
    """Who uses what: per tenant, its queued and leased tasks, the GPUs and
    memory its leases hold and its share of the GPUs in the view, read from
    ListTasks (a tenant token sees its own tenant only). Queued and leased
    tasks are two listings, so a task placed between them may count in
    both or neither: /metrics' gpulb_tenant_* gauges are one reading."""
    import time

    with _channel(args) as ch:
        stub = tpb_grpc.SchedulerStub(ch)
        queued = _listed(stub, tpb.TASK_STATE_QUEUED, args.timeout)
        leased = _listed(stub, tpb.TASK_STATE_LEASED, args.timeout)
        nodes = cpb_grpc.ClusterOperatorStub(ch).ListNodes(cpb.ListNodesRequest(), timeout=args.timeout).nodes
    gpus_in_view = sum(n.gpu_count for n in nodes if n.state != cpb.NODE_STATE_REMOVED)
    rows = _tenant_rows(queued, leased, gpus_in_view, time.time_ns())
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(_table(args, _TENANT_HEADERS, [[
        r["tenant"] or "-", r["queued"], r["leased"], r["gpus_leased"], fmt(100.0 * r["share_of_gpus"], 1),
        fmt(r["vram_mib_leased"] / 1024, 1), "/".join(str(n) for n in r["queued_by_class"].values()),
        "/".join(str(n) for n in r["leased_by_class"].values()), fmt(r["oldest_wait_s"], 1),
    ] for r in rows], _TENANT_GIVE_WAY))
    held = len({uuid for task in leased for uuid in task.assignment.gpu_uuid})  # a GPU tenants share: once
    tenants = f"{len(rows)} tenant{'s' if len(rows) != 1 else ''}"
    print(f"{tenants} with queued or leased tasks; {held} of {gpus_in_view} GPUs hold leases")
    return 0


@command("queue")
def cmd_queue(args: argparse.Namespace) -> int:
    with _channel(args) as ch:
        queue = tpb_grpc.SchedulerStub(ch).GetQueue(tpb.GetQueueRequest(), timeout=args.timeout)
    if args.json:
        print(json.dumps(_to_dict(queue), indent=2))
        return 0
    print(render_table(["CLASS", "DEPTH", "OLDEST WAIT s"], [[_priority(c.priority), c.depth, fmt(c.oldest_wait_s, 1)] for c in queue.classes]))
    print(f"placed since start: {queue.placed}; P0 SLA misses: {queue.sla_misses}")
    if queue.head:
        print("\nnext in dispatch order:")
        print(_table(args, _TASK_HEADERS, _task_rows(queue.head), _TASK_GIVE_WAY))
    return 0


@command("policy")
def cmd_policy(args: argparse.Namespace) -> int:
    if args.action == "get" and (args.name or args.weights is not None):
        args.usage_error("policy get takes no NAME or --weights (policy set NAME --weights ...)")
    with _channel(args) as ch:
        stub = tpb_grpc.SchedulerStub(ch)
        if args.action == "set":
            weights = args.weights or {}  # checked by _weights
            policy = stub.SetPolicy(tpb.SetPolicyRequest(name=args.name or "", weights=weights), timeout=args.timeout)
        else:
            policy = stub.GetPolicy(tpb.GetPolicyRequest(), timeout=args.timeout)
    if args.json:
        print(json.dumps(_to_dict(policy), indent=2))
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
        request = tpb.CompleteTaskRequest(task_id=args.task, lease_id=lease, failed=args.failed or args.oom_killed,
                                          oom_killed=args.oom_killed, peak_vram_mib=args.peak_vram_mib or 0)
        task = stub.CompleteTask(request, timeout=args.timeout).task
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
            wanted = [index.strip() for index in indexes.split(",")]  # NODE:0,1 as a plan prints a multi-GPU move
            if not node or not all(index.isdigit() for index in wanted):
                args.usage_error(f"--to-gpu takes a GPU uuid or NODE:INDEX[,INDEX...], got {gpu!r}")
            operator = cpb_grpc.ClusterOperatorStub(ch)
            try:
                gpus = operator.ListGpus(cpb.ListGpusRequest(node_id=node), timeout=args.timeout).gpus
                _check_node(operator, node, gpus, args.timeout)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    raise SystemExit(f"gpulb: --to-gpu {gpu}: no node {node!r}") from None
                raise
            for index in wanted:
                found = [g.uuid for g in gpus if g.index == int(index)]
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
            print(f"{task.spec.task_id}: {_task_state(task.state)}{where} {safe_text(task.reason)}".rstrip(), flush=True)
    return 0


def _ratio_pct(value: float) -> str:
    return "-" if value != value else f"{value * 100:.1f}%"  # NaN: nothing predicted yet


#: how a plan's moves give way on a narrow terminal, least needed first
_MOVE_GIVE_WAY = (("VARIANCE AFTER", "drop"), ("KIND", "drop"), ("LOAD", "drop"), ("TASK", "cut", 12))


def _plan_lines(plan, args: argparse.Namespace | None = None) -> list[str]:
    moves = [
        [m.task_id, m.kind, f"{m.from_node_id}:{','.join(map(str, move_gpus(m, 'from')[0]))}",
         f"{m.to_node_id}:{','.join(map(str, move_gpus(m, 'to')[0]))}",
         fmt(m.load_pct, 1, "%"), fmt(m.from_util_pct, 1, "%"), fmt(m.to_util_pct, 1, "%"), fmt(m.variance_after, 0)]
        for m in plan.moves
    ]
    title = "dry run" if plan.dry_run else f"plan {plan.plan_id}"
    headers = ["TASK", "KIND", "FROM", "TO", "LOAD", "FROM UTIL", "TO UTIL", "VARIANCE AFTER"]
    width = None if args is None or args.wide else terminal_width()
    return [
        wrap(f"{title} ({plan.trigger}): variance {plan.variance_before:.0f} -> {plan.variance_after:.0f} %², "
             f"spread {plan.spread_before:.1f} -> {plan.spread_after:.1f} pp", width, indent="  "),
        render_table(headers, moves) if args is None else _table(args, headers, moves, _MOVE_GIVE_WAY, width=width, note=False),
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
                print(json.dumps(_to_dict(got), indent=2))
                return 0
            print(f"learned from {got.samples} completions; MAPE {_ratio_pct(got.mape_ratio)} over the last {got.error_window}")
            # OVERRUN P90: how many times its prediction a run of the kind may take,
            # the backfill's margin once above backfill_estimate_factor
            print(render_table(["MODEL", "KIND", "SLOWDOWN", "PRIOR", "SAMPLES", "MAPE", "OVERRUN P90"],
                               [[f.model, f.kind or "(all)", f"{f.slowdown:.3f}", f"{f.prior:.3f}", f.samples, _ratio_pct(f.mape_ratio),
                                 "-" if not f.overrun_ratio > 0 else f"{f.overrun_ratio:.2f}x"]
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
                    print(json.dumps(_to_dict(plan)), flush=True)
                else:
                    print("\n".join(_plan_lines(plan, args)), flush=True)
            return 0
        got = stub.GetPlan(apb.GetPlanRequest(evaluate_now=args.now), timeout=args.timeout)
    if args.json:
        print(json.dumps(_to_dict(got), indent=2))
        return 0
    t = got.trigger
    state = "FIRED (" + t.reason + (", held" if t.held else "") + ")" if t.fired else "quiet"
    width = None if args.wide else terminal_width()
    print(wrap(f"trigger {state} over {t.gpus} GPUs: variance {t.variance:.0f} %² (fires above {t.variance_threshold:g}, "
               f"then holds down to {t.release_variance:g}); "
               f"hottest {t.hottest_pct:.1f} % (hot above {t.hot_pct:g}) with {t.rising} rising "
               f"(> {t.rising_pct_per_min:g} %/min; {t.rising_gpus} needed)", width, indent="  "))
    if got.HasField("plan"):
        print("\n".join(_plan_lines(got.plan, args)))
    else:
        print(wrap("no plan" + (" would be made now" if args.now else " yet") + _why_no_move(got.no_move), width, indent="  "))
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


def _operator_command(args: argparse.Namespace, flag: str, text: str | None) -> list[str]:
    """``--checkpoint`` / ``--restart`` as the argv they run as: no shell, so a
    bare name is looked up on PATH only (``ckpt.sh`` in the working directory
    is not found, and under systemd that directory is /). Checked before the
    first plan: found only at a move, it skipped every move."""
    import shlex
    import shutil

    try:
        argv = shlex.split(text or "")
    except ValueError as exc:
        args.usage_error(f"argument {flag}: {exc} in {text!r}")
    if argv and shutil.which(argv[0]) is None:
        where = "is not an executable file" if os.sep in argv[0] else "is not an executable on PATH"
        args.usage_error(f"argument {flag}: {argv[0]!r} {where} (the command runs without a shell: give its path, "
                         f"e.g. ./{os.path.basename(argv[0])} or /usr/local/lib/gpulb/{os.path.basename(argv[0])}, "
                         f"or 'sh -c \"...\"' for shell syntax)")
    return argv


def _execute_plans(args: argparse.Namespace, ch: grpc.Channel, stub: apb_grpc.AdvisorStub) -> int:
    """``gpulb advisor execute``: carry out every plan from now on, or the one
    on stdin (``--stdin``: the coordinator's ``advisor_hook`` runs it per
    plan) (``coordinator.executor``); a line (or a JSON object) per move. Exit 0,
    or 1 when one of the operator's commands failed: a restart (the moved task
    holds a lease on its new GPU and is not running: the operator's turn) or a
    checkpoint (the move was skipped: while that command fails, nothing is
    ever rebalanced), or a move left out because GetTask failed ("unchecked":
    the executor could not ask the coordinator, and nothing moves while it
    cannot). A move the coordinator refused and one of a stale plan (the task
    no longer holds the plan's lease) are not failures: nothing is wrong."""
    executor = PlanExecutor(
        tpb_grpc.SchedulerStub(ch),
        checkpoint=_operator_command(args, "--checkpoint", args.checkpoint),
        restart=_operator_command(args, "--restart", args.restart),
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
            if outcome.outcome in ("restart failed", "skipped", "unchecked"):
                status = 1
            if args.json:
                print(json.dumps(outcome.to_dict()), flush=True)
            else:
                detail = f" ({outcome.detail})" if outcome.detail else ""
                # a task that ended holds no lease
                lease = f"lease {outcome.lease_id}" if outcome.lease_id else "no lease"
                print(f"plan {outcome.plan_id}: {outcome.task_id} {outcome.from_gpu} -> {outcome.to_gpu}: "
                      f"{outcome.outcome}, {lease}{detail}", flush=True)
        seen += 1
        if args.plans and seen >= args.plans:
            break
    return status


@command("demo")
def cmd_demo(args: argparse.Namespace) -> int:
    from coordinator.demo import run_demo

    if not math.isfinite(args.duration):
        args.usage_error(f"argument --duration: must be a finite number >= 4, got {args.duration!r}")

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


class _ShowDefaults(argparse.HelpFormatter):
    """Help that says each option's default, where it has one worth saying
    (not None, not a flag's False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (action.option_strings and "%(default)" not in text
                and action.default is not None and action.default is not False
                and action.default is not argparse.SUPPRESS):
            text += " (default: %(default)s)"
        return text


#: --json of the listings
JSON_HELP = "print JSON instead of a table"
#: --wide of the tables
WIDE_HELP = "every column whole, however wide the terminal (by default a table fits it: some columns are cut or left out)"


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="gpulb",
        description="Operate a gpulb GPU cluster.",
        epilog="Offline: gpulb simulate --trace T --cluster C [--policy ...] (replay a trace under each policy); "
        "gpulb trace convert openb POD_CSV OUT_CSV; gpulb cluster convert openb NODE_CSV OUT_CSV; "
        "gpulb cluster homogeneous --hosts 8 --gpus 4 --model 'RTX 4090' OUT_CSV. Each takes --help.",
    )
    p.add_argument(
        "--coordinator",
        default=os.environ.get("GPULB_COORDINATOR", "127.0.0.1:50051"),
        help="HOST:PORT of the coordinator (env GPULB_COORDINATOR; default 127.0.0.1:50051)",
    )
    p.add_argument("--timeout", type=_TIMEOUT, default=10.0, help="RPC deadline, s (submit waits this long for a placement; default 10)")
    p.add_argument("--ca-file", default=os.environ.get("GPULB_CA_FILE"), help="PEM CA of the coordinator's certificate: use TLS (env GPULB_CA_FILE)")
    p.add_argument("--token", default=os.environ.get("GPULB_TOKEN"), help="bearer token (env GPULB_TOKEN)")
    p.add_argument("--token-file", default=os.environ.get("GPULB_TOKEN_FILE"), help="file holding the bearer token (env GPULB_TOKEN_FILE)")
    sub = p.add_subparsers(dest="command", required=True)

    gpus = sub.add_parser("gpus", help="list GPUs with their latest readings")
    gpus.add_argument("--node", help="only this node")
    gpus.add_argument("--model", help="only models containing this text")
    gpus.add_argument("--metrics", type=_metric_names,
                      help="comma-separated metrics (util,memory,temp,power,clock,pcie,ecc or field names; default all)")
    gpus.add_argument("--smoothed", action="store_true", help="anomaly-filtered EWMA values instead of raw")
    gpus.add_argument("--wide", action="store_true", help=WIDE_HELP)
    gpus.add_argument("--json", action="store_true", help=JSON_HELP)

    procs = sub.add_parser("processes", help="compute processes per GPU, as the agents list them")
    procs.add_argument("--node", help="only this node")
    procs.add_argument("--json", action="store_true", help=JSON_HELP)

    nodes = sub.add_parser("nodes", help="list nodes (those removed for missed heartbeats last)")
    nodes.add_argument("--removed", action="store_true",
                       help="only the removed nodes: they missed heartbeats and left the pool, and count in "
                       "gpulb_nodes{state=\"removed\"} until they register again or `gpulb uncordon NODE` forgets them")
    nodes.add_argument("--wide", action="store_true", help=WIDE_HELP)
    nodes.add_argument("--json", action="store_true", help=JSON_HELP)

    top = sub.add_parser("top", help="a live, refreshing table of every GPU",
                         formatter_class=_ShowDefaults)
    top.add_argument("--node", help="only this node")
    top.add_argument("--interval", type=_number(float, 0, 86400, above=True), default=1.0, help="s between refreshes")
    top.add_argument("--iterations", type=_number(int, 0), default=0, help="stop after N refreshes (0 = until Ctrl-C)")
    top.add_argument("--no-clear", action="store_true", help="append tables instead of redrawing the screen")
    top.add_argument("--wide", action="store_true", help="every column, however wide the terminal (lines may wrap)")

    for name, text in (("cordon", "no new tasks on NODE"), ("drain", "no new tasks on NODE; running ones finish"), ("uncordon", "NODE takes tasks again (a removed node is forgotten: its stored cordon and its count as removed)")):
        action = sub.add_parser(name, help=text)
        action.add_argument("node", metavar="NODE", help="the node's id, as `gpulb nodes` lists it")
        action.add_argument("--reason", help="free text, logged by the coordinator")
        action.add_argument("--json", action="store_true", help="print the node afterwards as JSON")

    submit = sub.add_parser(
        "submit", help="submit a task and wait for its placement",
        description="Submit a task and, unless --no-wait, wait up to --timeout s (default 10) for its placement. "
        f"Exit status: 0 placed (with --no-wait: accepted); {EXIT_STILL_QUEUED} still queued when --timeout ran out "
        "(the task stays queued: gpulb watch or gpulb cancel it); 1 not placed (rejected, expired at its --deadline, "
        "cancelled) or an RPC error; 2 a bad flag.",
    )
    submit.add_argument("--timeout", type=_TIMEOUT, default=argparse.SUPPRESS,
                        help="s to wait for the placement (the RPC deadline; same as gpulb --timeout; default 10)")
    submit.add_argument("--id", help="task id (default: a random one); resubmitting the same id and spec is idempotent")
    submit.add_argument("--tenant", help="tenant to submit for (a tenant token fixes it; an admin token's tenant is the default)")
    submit.add_argument("--priority", default="P2", choices=("P0", "P1", "P2", "P3", "p0", "p1", "p2", "p3"),
                        help="class: P0 real-time inference (waiting past 5 s is an SLA miss), P1 interactive or "
                        "fine-tuning, P2 batch, P3 background (default P2)")
    submit.add_argument("--kind", help="inference, training, batch, background or free text")
    submit.add_argument("--gpus", type=_number(int, 1, MAX_GPUS), default=1, help=f"GPUs on one node, 1..{MAX_GPUS}")
    mem = submit.add_mutually_exclusive_group()
    mem.add_argument("--vram-mib", type=_number(int, 1, MAX_VRAM_MIB), default=1024, help="MiB per GPU")
    mem.add_argument("--vram-gib", type=_number(float, 1 / 1024, MAX_VRAM_MIB / 1024, bounds=f"from 1/1024 (1 MiB) to {MAX_VRAM_MIB // 1024}"),
                     help="GiB per GPU")
    submit.add_argument("--share", type=_number(float, 0, 1), default=0.5, help="expected utilisation share per GPU, 0..1")
    submit.add_argument("--duration", type=_number(float, 0), default=0.0, help="estimated run time, s (0 = unknown)")
    submit.add_argument("--gpu-spec", help="allowed models, e.g. 'V100M16|V100M32' or 'RTX 4090'")
    submit.add_argument("--nvlink", action="store_true", help="needs NVLink-connected GPUs")
    submit.add_argument("--io-heavy", action="store_true", help="storage-bound: avoid nodes with slow disks")
    submit.add_argument("--movable", action="store_true", help="may be migrated by the rebalance advisor")
    submit.add_argument("--deadline", type=_number(float, 0), default=0.0,
                        help="s the task may stay queued before the coordinator expires it (0 = no deadline)")
    submit.add_argument("--label", action="append", type=_key_value, help="task label KEY=VALUE (repeatable)")
    submit.add_argument("--require-label", action="append", type=_key_value, help="node must carry KEY=VALUE (repeatable)")
    submit.add_argument("--prefer-label", action="append", type=_key_value, help="prefer nodes carrying KEY=VALUE (repeatable)")
    submit.add_argument("--no-wait", action="store_true", help="return at once with the queued task (exit 0)")
    submit.add_argument("--array", type=int, metavar="N",
                        help="a job array: N tasks ID-0..ID-N-1 of this spec in one ScheduleTasks call (1..1000)")
    submit.add_argument("--json", action="store_true", help="print the task (or the array's tasks) as JSON")

    tasks = sub.add_parser("tasks", help="list tasks")
    tasks.add_argument("--state", choices=[n.removeprefix("TASK_STATE_").lower() for n in tpb.TaskState.keys()[1:]],
                       help="only tasks in this state (default: every state)")
    tasks.add_argument("--tenant", help="only this tenant's tasks (a tenant token sees its own only)")
    tasks.add_argument("--limit", type=_number(int, 0, 2**32 - 1), default=1000, help="at most this many, oldest submission first, read page by page (0: 1000)")
    tasks.add_argument("--wide", action="store_true",
                       help=f"every column and whole reasons, however wide the terminal (the table cuts reasons at "
                       f"{REASON_COLUMN} characters and fits the terminal; --json has everything)")
    tasks.add_argument("--json", action="store_true", help=JSON_HELP)

    tenants = sub.add_parser("tenants", help="per tenant: queued and leased tasks, leased GPUs and memory, share of the GPUs")
    tenants.add_argument("--wide", action="store_true", help=WIDE_HELP)
    tenants.add_argument("--json", action="store_true", help=JSON_HELP)

    queue = sub.add_parser("queue", help="queue depth per class and the next tasks in dispatch order")
    queue.add_argument("--wide", action="store_true", help=WIDE_HELP)
    queue.add_argument("--json", action="store_true", help=JSON_HELP)

    policy = sub.add_parser("policy", help="show or switch the placement policy (no restart)")
    policy.add_argument("action", choices=("get", "set"),
                        help="get: the policy in force, its weights and the others; set: switch to NAME and/or change --weights")
    policy.add_argument("name", nargs="?", metavar="NAME", type=_policy_name,
                        help=f"set only: {', '.join(POLICIES)} (default: keep the current one)")
    # the terms a policy weighs differ by policy (`policy get` lists them): the coordinator checks them
    policy.add_argument("--weights", type=_weights,
                        help="set only: TERM=NUMBER,... e.g. load=1.0,memory=0.5, for NAME or the current policy")
    policy.add_argument("--json", action="store_true", help=JSON_HELP)

    complete = sub.add_parser("complete", help="report a leased task finished")
    complete.add_argument("task", help="task id")
    complete.add_argument("--lease", help="lease id (default: the task's current lease)")
    complete.add_argument("--failed", action="store_true", help="the task failed (default: it completed)")
    complete.add_argument("--peak-vram-mib", type=_number(float, 0, above=True), metavar="MIB",
                          help="the most GPU memory the task used (MiB): learned per kind for oom_risk and room to grow")
    complete.add_argument("--oom-killed", action="store_true",
                          help="the task was killed for running out of GPU memory (implies --failed; counted in gpulb_oom_kills_total)")

    migrate = sub.add_parser("migrate", help="move a leased task to other GPUs in one step (a rebalance plan's move)")
    migrate.add_argument("task", help="id of the leased task")
    migrate.add_argument("--to-gpu", dest="to", action="append", required=True, metavar="GPU",
                         help="destination GPU, as its UUID or NODE:INDEX[,INDEX...] (as `advisor plan` prints "
                              "a move); every GPU of the task, in one or several --to-gpu")
    migrate.add_argument("--lease", help="lease id (default: the task's current lease)")

    cancel = sub.add_parser("cancel", help="cancel a queued or leased task")
    cancel.add_argument("task", help="task id")
    cancel.add_argument("--reason", help="free text, kept with the task and logged by the coordinator")

    watch = sub.add_parser("watch", help="follow a task's state changes until it ends")
    watch.add_argument("task", help="task id")

    advisor = sub.add_parser("advisor", help="learned GPU speeds and memory growth, rebalance plans (predictions | plan | watch | execute)")
    advisor.add_argument("action", choices=("predictions", "plan", "watch", "execute"),
                         help="predictions: learned speeds and memory growth; plan: the trigger and the latest plan; "
                         "watch: follow plans; execute: carry them out")
    advisor.add_argument("--checkpoint", help="execute: command run before each move, without a shell (a path, or a name on "
                         "PATH), the move in GPULB_* variables (GPULB_TO_*: where the task goes; coordinator/executor.py); "
                         "a failure skips the move and the exit status is 1")
    advisor.add_argument("--restart", help="execute: command run after each move, GPULB_TO_* the GPUs it now holds (or in "
                         "place, GPULB_TO_* its old GPUs, when the move is refused); done when it exits: start the "
                         "workload detached, its output to its own log; a failure: exit status 1")
    advisor.add_argument("--command-timeout", type=_TIMEOUT, default=600.0,
                         help="execute: s a checkpoint or restart may take (default 600; as the coordinator's advisor_hook, "
                         "advisor_hook_timeout_s bounds the whole run)")
    advisor.add_argument("--plans", type=_number(int, 0), default=0, help="execute: stop after this many plans (0: run until stopped)")
    advisor.add_argument("--stdin", action="store_true",
                         help="execute: carry out the one plan on standard input (as the coordinator's advisor_hook gives it) "
                         "instead of watching for plans")
    advisor.add_argument("--now", action="store_true", help="plan: evaluate the cluster now (a dry run that moves nothing)")
    advisor.add_argument("--model", help="predictions: only this GPU model")
    advisor.add_argument("--kind", help="predictions: only this task kind")
    advisor.add_argument("--node", help="predictions: only this node's residual")
    advisor.add_argument("--wide", action="store_true",
                         help="plan, watch, predictions: tables and sentences as wide as they are (by default they fit the terminal)")
    advisor.add_argument("--json", action="store_true",
                         help="print JSON instead of tables (watch and execute: one object per line)")

    from coordinator.demo import add_demo_arguments

    sub.add_parser("set-search", help="build the multi-GPU set search ahead of time (build [--out DIR]), or show how it runs (status)")
    add_demo_arguments(sub.add_parser("demo", help="run a coordinator and simulated agents on loopback, and balance a workload"))

    bench = sub.add_parser("bench", help="benchmarks", formatter_class=_ShowDefaults)
    bench.add_argument(
        "what",
        choices=("wire", "ingest", "schedule"),
        help="wire: bytes per GPU-sample; ingest: telemetry throughput; schedule: placements/s and latency",
    )
    bench.add_argument("--json", action="store_true", help="print the results as JSON")
    bench.add_argument("--samples", type=_number(int, 1, 10**7), default=600, help="wire: sampling rounds per scenario")
    bench.add_argument("--gpus", type=_number(int, 1, MAX_GPUS), default=8, help="GPUs per host")
    bench.add_argument("--hosts", type=_number(int, 1, 10**6), default=2500, help="ingest: simulated hosts (one stream each)")
    bench.add_argument("--interval", type=_number(float, 0, 3600, above=True), default=0.2, help="ingest: s between a host's envelopes")
    # 40 s: over 20 s windows the counters read at the two scrapes were ~0.7 % apart from the
    # generator's count (an offset, gone over 40 s), which read as a shortfall
    bench.add_argument("--duration", type=_number(float, 1, 86400), default=40.0, help="ingest: measured s")
    bench.add_argument("--warmup", type=_number(float, 0, 86400), default=10.0, help="ingest: s before measuring")
    bench.add_argument("--channels", type=_number(int, 1, 10**5), default=25, help="ingest: HTTP/2 connections the generator spreads streams over")
    bench.add_argument("--nodes", type=_sizes, default="1000,5000", help="schedule: comma-separated synthetic cluster sizes (8 GPUs each)")
    bench.add_argument("--clients", type=_number(int, 1, 10**5), default=16, help="schedule: concurrent submitting clients")
    bench.add_argument("--requests", type=_number(int, 1, 10**8), default=3000, help="schedule: ScheduleTask calls per size")
    for parser in sub.choices.values():  # a check after parsing fails the way argparse's own do
        parser.set_defaults(usage_error=parser.error)
    return p


#: commands that run offline, with their own argument parsers
_OFFLINE = {"simulate", "trace", "cluster"}


def _offline(argv: list[str]) -> int:
    if argv[0] in _OFFLINE:
        from scheduler.simulator import simulate_main, trace_main

        return simulate_main(argv[1:]) if argv[0] == "simulate" else trace_main(argv)
    from scheduler.setsearch import main as set_search_main  # the compiled set search: build it ahead of time, or say how it runs

    return set_search_main(argv[1:])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    offline = bool(argv) and (argv[0] in _OFFLINE or argv[0] == "set-search")
    args = None if offline else build_parser().parse_args(argv)
    try:
        status = _offline(argv) if args is None else COMMANDS[args.command](args)
        sys.stdout.flush()  # a closed pipe fails here, not in the interpreter's exit
        return status
    except grpc.RpcError as exc:
        print(f"gpulb: {args.command}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # the reader went away (gpulb ... | head): stop quietly, as a process
        # that SIGPIPE ended does, and keep the interpreter's last flush of
        # stdout from failing too
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass  # stdout is no file (captured): nothing will flush to the pipe
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        return 130  # Ctrl-C (watch, advisor watch/execute, a waiting submit): no traceback


if __name__ == "__main__":
    sys.exit(main())
