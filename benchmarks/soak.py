"""Soak run (a script, not CI): many simulated agents and submitting clients
against one coordinator on loopback for minutes, reporting the coordinator's
memory over time and accounting for every submitted task.

    python benchmarks/soak.py --agents 500 --clients 32 --minutes 10 [--json]

- The coordinator runs as its own process with durable state (``--state-dir``
  in a temporary directory), as deployed.
- The agents come from ``gpulb bench ingest``'s load generator (one stream per
  host, 8 GPUs, pre-recorded sim telemetry every ``--interval`` s).
- Each client loops: ScheduleTask (wait) of a small task, then CompleteTask;
  every ``--cancel-every``-th submission is cancelled instead, and failures are
  counted by status code.
- ``--watchers N`` keeps N WatchView streams of the whole view open (1 s),
  as dashboards do: the updates each gets, and how old they are on arrival.
- Every 10 s the coordinator's RSS is sampled from /proc; at the end every task
  id a client was acknowledged for is looked up (exactly once, in the state
  the client left it in).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from coordinator.demo import free_port  # noqa: E402
from coordinator.ingestbench import _rss_mib  # noqa: E402
from coordinator.tables import render_table  # noqa: E402
from scheduler.config import SchedulerConfig  # noqa: E402
from protos import cluster_pb2 as cpb  # noqa: E402
from protos import cluster_pb2_grpc as cpb_grpc  # noqa: E402
from protos import tasks_pb2 as tpb  # noqa: E402
from protos import tasks_pb2_grpc as tpb_grpc  # noqa: E402


async def _client(n: int, target: str, stop: asyncio.Event, expected: dict[str, int], errors: Counter, cancel_every: int) -> None:
    async with grpc.aio.insecure_channel(target) as ch:
        stub = tpb_grpc.SchedulerStub(ch)
        i = 0
        while not stop.is_set():
            i += 1
            task_id = f"soak-{n:02d}-{i:06d}"
            spec = tpb.TaskSpec(task_id=task_id, priority=1 + (i % 4), kind="batch", vram_mib=512 + 256 * (i % 8), gpu_share=0.1)
            try:
                cancel = cancel_every and i % cancel_every == 0
                reply = await stub.ScheduleTask(tpb.ScheduleTaskRequest(spec=spec, wait=not cancel), timeout=30)
                if cancel:
                    expected[task_id] = tpb.TASK_STATE_CANCELLED
                    await stub.CancelTask(tpb.CancelTaskRequest(task_id=task_id, reason="soak"), timeout=30)
                elif reply.task.state == tpb.TASK_STATE_LEASED:
                    expected[task_id] = tpb.TASK_STATE_COMPLETED
                    await stub.CompleteTask(tpb.CompleteTaskRequest(task_id=task_id, lease_id=reply.task.assignment.lease_id), timeout=30)
                else:
                    expected[task_id] = reply.task.state  # still queued at the deadline: left as it is
            except grpc.aio.AioRpcError as exc:
                errors[exc.code().name] += 1
                expected.pop(task_id, None) if task_id not in expected else None


async def _watcher(target: str, stop: asyncio.Event, got: list[int], lag: list[float], errors: Counter) -> None:
    """One WatchView client of the whole view, as a dashboard keeps one open:
    counts the updates it gets and how old each is when it arrives."""
    async with grpc.aio.insecure_channel(target, options=[("grpc.max_receive_message_length", 64 << 20)]) as ch:
        call = cpb_grpc.ClusterOperatorStub(ch).WatchView(cpb.WatchViewRequest(min_interval_ms=1000))
        index = len(got)
        got.append(0)
        try:
            while not stop.is_set():
                update = await call.read()
                if update is grpc.aio.EOF:
                    break
                got[index] += 1
                lag.append(time.time() - update.at_ns / 1e9)
        except grpc.aio.AioRpcError as exc:
            if not stop.is_set():
                errors[f"WatchView {exc.code().name}"] += 1
        finally:
            call.cancel()


async def _run(args: argparse.Namespace) -> dict:
    port = free_port()
    target = f"127.0.0.1:{port}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with tempfile.TemporaryDirectory(prefix="gpulb-soak-") as tmp:
        coord = subprocess.Popen(
            [sys.executable, "-m", "coordinator.main", "--listen", target, "--state-dir", f"{tmp}/state", "--insecure",
             "--log-level", "warning", "--log-format", "json"],
            env=env, stdout=open(f"{tmp}/coordinator.log", "wb"), stderr=subprocess.STDOUT, cwd=ROOT,
        )
        duration = args.minutes * 60
        # the HTTP/2 generator connects once, without retrying: wait for the port
        up = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > up:
                    raise SystemExit("the coordinator did not listen within 30 s")
                await asyncio.sleep(0.2)
        gen = subprocess.Popen(
            [sys.executable, "-m", "coordinator.ingestbench", "--generate", target, str(args.agents), "8", str(args.interval),
             str(duration + 30), str(max(1, args.agents // 20)), "h2"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT,
        )
        expected: dict[str, int] = {}
        errors: Counter = Counter()
        rss: list[tuple[float, float]] = []
        try:
            async with grpc.aio.insecure_channel(target) as ch:
                op = cpb_grpc.ClusterOperatorStub(ch)
                deadline = time.monotonic() + 60
                while True:
                    try:
                        nodes = (await op.ListNodes(cpb.ListNodesRequest(state=cpb.NODE_STATE_HEALTHY), timeout=5)).nodes
                        if len(nodes) >= args.agents * 0.95:
                            break
                    except grpc.aio.AioRpcError:
                        pass
                    if time.monotonic() > deadline:
                        raise SystemExit("agents did not connect within 60 s")
                    await asyncio.sleep(1)
                print(f"{len(nodes)} agents streaming; {args.clients} clients submitting for {args.minutes:g} min", file=sys.stderr)
                stop = asyncio.Event()
                clients = [asyncio.create_task(_client(n, target, stop, expected, errors, args.cancel_every)) for n in range(args.clients)]
                watch_updates: list[int] = []
                watch_lag: list[float] = []
                clients += [asyncio.create_task(_watcher(target, stop, watch_updates, watch_lag, errors))
                            for _ in range(args.watchers)]
                start = time.monotonic()
                while time.monotonic() - start < duration:
                    await asyncio.sleep(10)
                    elapsed = time.monotonic() - start
                    rss.append((round(elapsed), _rss_mib(coord.pid)))
                    print(f"  {elapsed:5.0f} s  RSS {rss[-1][1]:7.1f} MiB  submitted {len(expected):,}  errors {sum(errors.values())}", file=sys.stderr)
                stop.set()
                await asyncio.gather(*clients)
                # every acknowledged task, in the state its client left it: one
                # GetTask each (a single ListTasks of tens of thousands of tasks
                # would exceed the 4 MiB message bound)
                # the streams are still up now; the checks below take a while
                nodes = (await op.ListNodes(cpb.ListNodesRequest(state=cpb.NODE_STATE_HEALTHY), timeout=10)).nodes
                stub = tpb_grpc.SchedulerStub(ch)
                states: dict[str, int] = {}
                missing: list[str] = []
                gate = asyncio.Semaphore(64)

                async def look(task_id: str) -> None:
                    async with gate:
                        try:
                            states[task_id] = (await stub.GetTask(tpb.GetTaskRequest(task_id=task_id), timeout=30)).state
                        except grpc.aio.AioRpcError:
                            missing.append(task_id)

                await asyncio.gather(*(look(t) for t in list(expected)))
                # ids are unique per task record by construction; the listing
                # counts the queued and leased ones to show none is there twice
                live = (await stub.ListTasks(tpb.ListTasksRequest(state=tpb.TASK_STATE_QUEUED, limit=100_000), timeout=60)).tasks
                ids = Counter(t.spec.task_id for t in live)
                duplicated = [t for t, c in ids.items() if c > 1]
                wrong = [t for t, s in expected.items() if t in states and s != tpb.TASK_STATE_QUEUED and states[t] != s]
        finally:
            gen.terminate()
            gen.wait(timeout=30)
            coord.terminate()
            coord.wait(timeout=30)
    warm = [m for t, m in rss if t >= 60] or [m for _, m in rss]
    # The coordinator keeps the newest retain_finished finished tasks for
    # GetTask (oldest dropped first): beyond that, finished tasks are gone by
    # design. Only a task that was not finished, or more finished ones than
    # the retention explains, is missing.
    retain = SchedulerConfig().retain_finished
    finished = [t for t, state in expected.items() if state in _FINISHED]
    beyond_retention = max(0, len(finished) - retain)
    finished_missing = [t for t in missing if expected[t] in _FINISHED]
    evicted = min(len(finished_missing), beyond_retention)
    return {
        "agents": args.agents,
        "clients": args.clients,
        "minutes": args.minutes,
        "tasks_acknowledged": len(expected),
        "tasks_missing": len(missing) - evicted,
        "tasks_dropped_by_retention": evicted,
        "retain_finished": retain,
        "tasks_duplicated": len(duplicated),
        "tasks_in_wrong_state": len(wrong),
        "rpc_errors": dict(errors),
        "healthy_nodes_at_end": len(nodes),
        "watchers": args.watchers,
        "watch_updates_min_max": [min(watch_updates), max(watch_updates)] if watch_updates else None,
        "watch_update_age_p99_s": round(float(sorted(watch_lag)[int(0.99 * (len(watch_lag) - 1))]), 3) if watch_lag else None,
        "rss_mib_over_time": rss,
        "rss_growth_after_warmup_mib": round(max(warm) - min(warm), 1) if warm else None,
    }


_FINISHED = frozenset({tpb.TASK_STATE_COMPLETED, tpb.TASK_STATE_CANCELLED, tpb.TASK_STATE_EXPIRED,
                       tpb.TASK_STATE_LOST, tpb.TASK_STATE_REJECTED, tpb.TASK_STATE_FAILED})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--agents", type=int, default=500)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--interval", type=float, default=1.0, help="s between an agent's envelopes")
    p.add_argument("--cancel-every", type=int, default=10)
    p.add_argument("--watchers", type=int, default=0, help="WatchView clients of the whole view (1 s interval)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    result = asyncio.run(_run(args))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        rows = [[k, v] for k, v in result.items() if k != "rss_mib_over_time"]
        print(render_table(["MEASURE", "VALUE"], rows, align="lr"))
        print("coordinator RSS over time (s, MiB): " + ", ".join(f"{t}:{m:.0f}" for t, m in result["rss_mib_over_time"]))
    ok = not (result["tasks_missing"] or result["tasks_duplicated"] or result["tasks_in_wrong_state"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
