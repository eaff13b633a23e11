"""``gpulb``: the operator and client command line.

Every listing prints a table for people and, with ``--json``, JSON for
scripts. The coordinator address comes from ``--coordinator`` or
``GPULB_COORDINATOR`` (default 127.0.0.1:50051).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable

import grpc
from google.protobuf.json_format import MessageToDict

from coordinator.tables import fmt, render_table
from protos import cluster_pb2 as cpb
from protos import cluster_pb2_grpc as cpb_grpc
from protos import telemetry_pb2 as pb

__all__ = ["main", "build_parser"]

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {}


def command(name: str):
    def register(fn):
        COMMANDS[name] = fn
        return fn

    return register


def _channel(args: argparse.Namespace) -> grpc.Channel:
    return grpc.insecure_channel(args.coordinator)


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
                raw = stub.ListGpus(cpb.ListGpusRequest(node_id=args.node or ""), timeout=args.timeout).gpus
                smooth = stub.ListGpus(
                    cpb.ListGpusRequest(node_id=args.node or "", values=cpb.VALUE_VIEW_SMOOTHED), timeout=args.timeout
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
            fmt(n.reading_age_s, 1) if n.reading_age_s >= 0 else "-",
            "yes" if n.stale else "no",
            n.envelopes,
            n.resyncs,
            ",".join(f"{k}={v}" for k, v in sorted(n.labels.items())),
        ]
        for n in nodes
    ]
    print(render_table(["NODE", "STATE", "GPUS", "MODEL", "BACKEND", "AGE s", "STALE", "ENVELOPES", "RESYNCS", "LABELS"], rows))
    return 0


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
    p = argparse.ArgumentParser(prog="gpulb", description="Operate a gpulb GPU cluster.")
    p.add_argument(
        "--coordinator",
        default=os.environ.get("GPULB_COORDINATOR", "127.0.0.1:50051"),
        help="HOST:PORT of the coordinator (env GPULB_COORDINATOR)",
    )
    p.add_argument("--timeout", type=float, default=10.0, help="RPC deadline, s")
    sub = p.add_subparsers(dest="command", required=True)

    gpus = sub.add_parser("gpus", help="list GPUs with their latest readings")
    gpus.add_argument("--node", help="only this node")
    gpus.add_argument("--model", help="only models containing this text")
    gpus.add_argument("--metrics", help="comma-separated metrics (util,memory,temp,power,...)")
    gpus.add_argument("--smoothed", action="store_true", help="anomaly-filtered EWMA values instead of raw")
    gpus.add_argument("--json", action="store_true")

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

    from coordinator.demo import add_demo_arguments

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
    bench.add_argument("--duration", type=float, default=20.0, help="ingest: measured s")
    bench.add_argument("--warmup", type=float, default=10.0, help="ingest: s before measuring")
    bench.add_argument("--channels", type=int, default=25, help="ingest: HTTP/2 connections the generator spreads streams over")
    bench.add_argument("--nodes", default="1000,5000", help="schedule: comma-separated synthetic cluster sizes (8 GPUs each)")
    bench.add_argument("--clients", type=int, default=16, help="schedule: concurrent submitting clients")
    bench.add_argument("--requests", type=int, default=3000, help="schedule: ScheduleTask calls per size")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except grpc.RpcError as exc:
        print(f"gpulb: {args.command}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
