"""``gpulb bench ingest``: how many GPU-samples per second one coordinator
takes through the full path (gRPC stream, envelope decode, deltas, anomaly
filter, EWMA, view columns), and how long a reading takes to reach the
smoothed view.

Set-up, all on this machine over loopback:
- the coordinator runs as its own process (``python -m coordinator.main``),
  exactly as deployed;
- a load generator process opens one bidirectional stream per simulated host
  and sends, every ``--interval`` seconds per host, the next envelope of a
  pre-recorded sim-backend sequence (8 GPUs, volatile synthetic load: a
  keyframe, then deltas), with its own sequence numbers. Pre-recording keeps
  the generator's CPU for sending, so the coordinator is what is measured.
- throughput = applied envelopes x GPUs per envelope over the measurement
  window, read from the coordinator's own Prometheus counters; delay = the
  coordinator's ``gpulb_ingest_latency_seconds`` histogram (handler receipt
  to smoothed view), p50/p99 interpolated within buckets.

The two processes share the machine's cores; the table says how many.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
import tracemalloc
import urllib.request

import numpy as np

from coordinator.tables import render_table

__all__ = ["run_ingest_bench", "view_memory_per_gpu"]

_TEMPLATE_ROUNDS = 150  # 30 s at 200 ms, then the sequence restarts with a keyframe


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _templates(gpus: int, count: int) -> list[list[bytes]]:
    """Serialized Envelope bodies without their seq field, one list per template."""
    from agent.sim import SimBackend
    from agent.telemetry import samples_to_matrix
    from protos.codec import TelemetryEncoder

    out = []
    for t in range(count):
        clock = [1000.0]
        backend = SimBackend(gpus=gpus, seed=100 + t, clock=lambda: clock[0])
        order = [i.index for i in backend.inventory()]
        enc = TelemetryEncoder(order, keyframe_interval_s=1e9)
        bodies = []
        for _ in range(_TEMPLATE_ROUNDS):
            values, present = samples_to_matrix(backend.sample(), order)
            env, _ = enc.encode(values, present, now_s=clock[0], sampled_at_ns=int(clock[0] * 1e9), sample_interval_ms=200)
            env.seq = 0  # omitted from the encoding; each host prepends its own
            bodies.append(env.SerializeToString())
            clock[0] += 0.2
        out.append(bodies)
    return out


async def _generate(target: str, hosts: int, gpus: int, interval: float, duration: float, channels: int) -> None:
    import grpc

    from protos import telemetry_pb2 as pb

    templates = _templates(gpus, 8)
    chans = [grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(channels)]
    identity = lambda b: b  # noqa: E731 - messages are pre-serialized
    sent = [0]
    failures: list[str] = []
    stop_at = time.monotonic() + duration

    async def host(h: int) -> None:
        ch = chans[h % channels]
        connect = ch.stream_stream("/gpulb.v1.AgentGateway/Connect", request_serializer=identity, response_deserializer=identity)
        call = connect()
        reg = pb.AgentMessage(
            register=pb.Register(
                node_id=f"bench-{h:05d}",
                backend="sim",
                gpus=[pb.GpuInfo(index=i, uuid=f"GPU-bench-{h}-{i}", model="NVIDIA GeForce RTX 4090", memory_total_mib=24564) for i in range(gpus)],
            )
        )
        await call.write(reg.SerializeToString())

        async def drain() -> None:
            async for _ in call:
                pass

        reader = asyncio.create_task(drain())
        bodies = templates[h % len(templates)]
        seq = 0
        # spread hosts over the interval so the load is smooth
        await asyncio.sleep(interval * (h / hosts))
        next_at = time.monotonic()
        try:
            while time.monotonic() < stop_at:
                body = bodies[seq % len(bodies)]
                seq += 1
                env = b"\x08" + _varint(seq) + body
                await call.write(b"\x12" + _varint(len(env)) + env)
                sent[0] += 1
                next_at += interval
                delay = next_at - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
            await call.done_writing()
        except Exception as exc:  # a refused stream: report it, keep the others going
            failures.append(f"{type(exc).__name__}: {getattr(exc, 'details', lambda: exc)()}")
        finally:
            reader.cancel()

    async def report() -> None:
        last = 0
        while time.monotonic() < stop_at:
            await asyncio.sleep(5)
            print(f"generator: {(sent[0] - last) / 5 * gpus:,.0f} GPU-samples/s sent, {len(failures)} streams failed"
                  + (f" (first: {failures[0]})" if failures else ""), file=sys.stderr, flush=True)
            last = sent[0]

    await asyncio.gather(report(), *(host(h) for h in range(hosts)), return_exceptions=True)
    for ch in chans:
        await ch.close()


def _scrape(port: int) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics?per_gpu=0", timeout=10).read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items())) + "}" if sample.labels else "")
            out[key] = sample.value
    return out


def _quantile(before: dict, after: dict, name: str, q: float) -> float:
    buckets = []
    for key, value in after.items():
        if key.startswith(name + "_bucket{"):
            le = key.split("le=")[1].rstrip("}")
            bound = float("inf") if le == "+Inf" else float(le)
            buckets.append((bound, value - before.get(key, 0.0)))
    buckets.sort()
    total = buckets[-1][1] if buckets else 0
    if total <= 0:
        return float("nan")
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return prev_bound
            span = count - prev_count
            return prev_bound + (bound - prev_bound) * ((rank - prev_count) / span if span else 1.0)
        prev_bound, prev_count = bound, count
    return prev_bound


def view_memory_per_gpu(gpus: int = 20_000, per_node: int = 8) -> dict[str, float]:
    """Bytes per GPU of the coordinator's view: numpy columns + signal windows
    + node records and decoders, measured with tracemalloc."""
    from coordinator.view import ClusterView
    from protos import telemetry_pb2 as pb

    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    view = ClusterView()
    for n in range(gpus // per_node):
        reg = pb.Register(
            node_id=f"mem-{n:05d}",
            gpus=[pb.GpuInfo(index=i, uuid=f"GPU-{n}-{i}", model="NVIDIA GeForce RTX 4090", memory_total_mib=24564) for i in range(per_node)],
        )
        view.register(reg, 0.0)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return {"gpus": gpus, "bytes_per_gpu": (after - before) / gpus, "capacity_rows": view.capacity}


def _rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def run_ingest_bench(args: argparse.Namespace) -> int:
    from coordinator.demo import free_port

    port, mport = free_port(), free_port()
    py = sys.executable
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    coord = subprocess.Popen(
        [py, "-m", "coordinator.main", "--listen", f"127.0.0.1:{port}", "--metrics-listen", f"127.0.0.1:{mport}",
         "--log-level", "warning", "--log-format", "json", "--insecure"],
        env=env,
    )
    gen = None
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                _scrape(mport)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        total = args.warmup + args.duration + 5
        print(f"load: {args.hosts} hosts x {args.gpus} GPUs every {args.interval} s "
              f"= {args.hosts * args.gpus / args.interval:,.0f} GPU-samples/s offered; warm-up {args.warmup} s, measured {args.duration} s",
              file=sys.stderr)
        gen = subprocess.Popen(
            [py, "-m", "coordinator.ingestbench", "--generate", f"127.0.0.1:{port}", str(args.hosts), str(args.gpus),
             str(args.interval), str(total), str(args.channels)],
            env=env,
        )
        time.sleep(args.warmup)
        before = _scrape(mport)
        t0 = time.monotonic()
        rss = []
        for i in range(int(args.duration)):
            time.sleep(1)
            rss.append(_rss_mib(coord.pid))
            if (i + 1) % 5 == 0:
                print(f"  {i + 1}/{int(args.duration)} s measured", file=sys.stderr)
        after = _scrape(mport)
        elapsed = time.monotonic() - t0
    finally:
        if gen is not None:
            gen.terminate()
            gen.wait(timeout=30)
        coord.terminate()
        coord.wait(timeout=30)
    envelopes = after.get("gpulb_envelopes_received_total", 0) - before.get("gpulb_envelopes_received_total", 0)
    rate = envelopes * args.gpus / elapsed
    p50 = _quantile(before, after, "gpulb_ingest_latency_seconds", 0.50)
    p99 = _quantile(before, after, "gpulb_ingest_latency_seconds", 0.99)
    streams = after.get("gpulb_agent_streams", float("nan"))
    memory = view_memory_per_gpu()
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_implementation()} {platform.python_version()}",
        "hosts": args.hosts,
        "gpus_per_host": args.gpus,
        "interval_s": args.interval,
        "offered_gpu_samples_per_s": args.hosts * args.gpus / args.interval,
        "applied_gpu_samples_per_s": round(rate, 1),
        "ingest_delay_p50_ms": round(p50 * 1000, 2),
        "ingest_delay_p99_ms": round(p99 * 1000, 2),
        "open_streams": streams,
        "coordinator_rss_mib_max": round(float(np.nanmax(rss)), 1) if rss else None,
        "view_bytes_per_gpu": round(memory["bytes_per_gpu"], 1),
        "load_generator": "separate process on the same machine",
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        rows = [[k, v] for k, v in result.items()]
        print(render_table(["MEASURE", "VALUE"], rows, align="lr"))
    return 0


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--generate":
    _, _, target, hosts, gpus, interval, duration, channels = sys.argv
    asyncio.run(_generate(target, int(hosts), int(gpus), float(interval), float(duration), int(channels)))
