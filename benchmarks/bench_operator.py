"""Operator API cost at cluster scale: ListGpus, gpulb top, WatchView, ListNodes and a metrics scrape.

``gpulb top`` asks ListGpus twice a second, WatchView sends every GPU
each interval and Prometheus scrapes ``/metrics`` every 15-60 s; all run on
the coordinator's event loop, where their time is a stall of ingest and
scheduling alike. This builds a coordinator with N
synthetic 8-GPU nodes (``coordinator.schedbench.populate``: registration
and one keyframe each, through the calls an agent stream makes), places
one task per GPU through its own scheduler (load_aware: about half the
GPUs end up holding leases), and times the two handlers' work (the
messages, as the servicer builds them, and their serialisation; no network)
and the exposition a scrape gets, with and without the per-GPU families.

Until round 14 every GPU's message rebuilt the map of leased GPUs, so a
listing was quadratic in the GPUs (3,200 GPUs: 627 ms), and the per-GPU
families were built as one prometheus-client sample per GPU and family.
Until round 15 each GPU's message was filled one numpy scalar and field at
a time and copied into its response, ``gpulb top`` asked for every field
smoothed as well as raw, and each WatchView client built its own update.

"top refresh" is one ``gpulb top`` refresh (ListGpus of the fields it
shows, raw, then the smoothed util); "WatchView 1 / 4" one interval of one and of four
watchers of the whole view after a reading moved it (one build, shared,
and each watcher's serialisation). The collector runs with the daemon's
threshold (``gc_gen0_threshold``).

Run from the repository root::

    .venv/bin/python benchmarks/bench_operator.py [--nodes 125,500,1000] [--repeat 7] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coordinator.cli import _TOP_METRICS  # noqa: E402
from coordinator.config import CoordinatorConfig  # noqa: E402
from coordinator.convert import resolve_metrics  # noqa: E402
from coordinator.schedbench import populate  # noqa: E402
from coordinator.server import Coordinator  # noqa: E402
from coordinator.tables import fmt, render_table  # noqa: E402
from protos import cluster_pb2 as cpb  # noqa: E402
from scheduler.task import TaskSpec  # noqa: E402


def timed(fn, repeat: int) -> float:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000.0)
    return statistics.median(out)


async def measure(nodes: int, repeat: int) -> dict:
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0"))
    populate(coord, nodes)
    engine = coord.dispatcher.engine
    snap = coord.dispatcher.snapshots.snapshot()
    engine.submit_many([TaskSpec(task_id=f"t{i}", kind="batch", vram_mib=1_000.0, gpu_share=0.1)
                        for i in range(snap.gpu_count)], snap)
    leases = len(engine.dispatch(snap))
    metrics = resolve_metrics([])

    def list_gpus() -> bytes:
        response = cpb.ListGpusResponse()
        coord.gpu_messages(metrics=metrics, into=response.gpus)
        return response.SerializeToString()

    def top_refresh() -> None:
        """What one ``gpulb top`` refresh asks: the fields it shows raw, util smoothed."""
        raw = cpb.ListGpusResponse()
        coord.gpu_messages(metrics=resolve_metrics(_TOP_METRICS), into=raw.gpus)
        raw.SerializeToString()
        smoothed = cpb.ListGpusResponse()
        coord.gpu_messages(metrics=("util_gpu_pct",), smoothed=True, into=smoothed.gpus)
        smoothed.SerializeToString()

    op = coord.operator

    def watchers(count: int):
        """One interval of ``count`` watchers after a reading moved the view:
        the first builds the update, the others take it; each is serialised."""
        def interval() -> None:
            coord.view.version += 1
            op._updates.clear()
            for _ in range(count):
                op.view_update("", False)[1].SerializeToString()
        return interval

    def list_nodes() -> bytes:
        ordered = sorted(coord.view.nodes.values(), key=lambda n: n.node_id)
        return cpb.ListNodesResponse(nodes=[coord.node_message(n) for n in ordered]).SerializeToString()

    gpus = cpb.ListGpusResponse.FromString(list_gpus()).gpus
    return {
        "nodes": nodes,
        "gpus": snap.gpu_count,
        "leases": leases,
        "gpus_with_leases": sum(1 for g in gpus if g.active_tasks),
        "list_gpus_ms": timed(list_gpus, repeat),
        "list_gpus_bytes": len(list_gpus()),
        "top_refresh_ms": timed(top_refresh, repeat),
        "watch_1_ms": timed(watchers(1), repeat),
        "watch_4_ms": timed(watchers(4), repeat),
        "list_nodes_ms": timed(list_nodes, repeat),
        "scrape_ms": timed(coord.metrics.exposition, repeat),
        "scrape_bytes": len(coord.metrics.exposition()),
        "scrape_fleet_ms": timed(lambda: coord.metrics.exposition(per_gpu=False), repeat),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="125,500,1000", help="cluster sizes, in 8-GPU nodes (comma list)")
    p.add_argument("--repeat", type=int, default=7, help="timed calls per figure (median reported)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = p.parse_args(argv)
    from coordinator.main import tune_gc

    tune_gc(CoordinatorConfig().gc_gen0_threshold)  # the daemon's collector, as it runs these handlers
    logging.disable(logging.INFO)  # the placements' log lines
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    rows = []
    for nodes in (int(n) for n in args.nodes.split(",")):
        print(f"# {nodes} nodes ...", file=sys.stderr, flush=True)
        rows.append(asyncio.run(measure(nodes, args.repeat)))
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(render_table(
        ["nodes", "GPUs", "leases", "GPUs leased", "ListGpus ms", "KiB", "top refresh ms", "WatchView 1 / 4 ms",
         "ListNodes ms", "scrape ms", "KiB", "per_gpu=0 ms"],
        [[r["nodes"], r["gpus"], r["leases"], r["gpus_with_leases"], fmt(r["list_gpus_ms"]),
          fmt(r["list_gpus_bytes"] / 1024, 0), fmt(r["top_refresh_ms"]),
          f"{fmt(r['watch_1_ms'])} / {fmt(r['watch_4_ms'])}", fmt(r["list_nodes_ms"]), fmt(r["scrape_ms"]),
          fmt(r["scrape_bytes"] / 1024, 0), fmt(r["scrape_fleet_ms"])] for r in rows],
    ))
    return 0


if __name__ == "__main__":
    sys.exit(main())
