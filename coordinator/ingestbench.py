"""``gpulb bench ingest``: how many GPU-samples per second one coordinator
takes through the full path (gRPC stream, envelope decode, deltas, anomaly
filter, EWMA, view columns), and how long a reading takes to reach the
smoothed view.

Set-up, all on this machine over loopback:
- the coordinator runs as its own process (``python -m coordinator.main``),
  exactly as deployed;
- a load-generator process opens one gRPC stream (``AgentGateway/Connect``)
  per simulated host, multiplexed over ``--channels`` HTTP/2 connections
  (real agents have one connection each; connections cost the coordinator
  some kernel and gRPC-core time, the per-message Python path is the same).
  It speaks HTTP/2 itself (``_generate_h2``): grpc.aio's client costs ~65 us
  of CPU per message, on the cores the coordinator needs; the grpc.aio
  generator (``_generate``) stays for comparison (``--generate ... grpc``).
- phase 1: every stream registers and sends its keyframe; the generator
  waits for each stream's RegisterAck (the coordinator accepts about one new
  stream per event-loop turn, so streams are opened 100 at a time, and wait
  with heartbeats until all are open). Phase 2 starts only then: every host
  sends, every ``--interval`` seconds, the next envelope of a pre-recorded
  sim-backend sequence (8 GPUs, volatile synthetic load, a keyframe every
  30 s), at its own phase, a seeded uniform random offset within the
  interval (as agents started at independent times), not all at once.
- the measurement window starts ``--warmup`` seconds into phase 2, after
  every stream is open and has sent its keyframe.
- throughput = applied envelopes x GPUs per envelope over the window, from
  the coordinator's own Prometheus counters; delay = the coordinator's
  ``gpulb_ingest_latency_seconds`` histogram (handler receipt to smoothed
  view; p50/p99 interpolated within buckets). CPU of both processes comes
  from /proc, load average from the OS: the machine is shared.
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


def _frame(seq: int, body: bytes) -> bytes:
    """A serialized AgentMessage{telemetry: Envelope{seq, ...body}}."""
    env = b"\x08" + _varint(seq) + body
    return b"\x12" + _varint(len(env)) + env


def _register(h: int, gpus: int) -> bytes:
    """Simulated host ``h``'s Register message (8 x RTX 4090 by default), serialized."""
    from protos import telemetry_pb2 as pb

    return pb.AgentMessage(
        register=pb.Register(
            node_id=f"bench-{h:05d}",
            backend="sim",
            gpus=[pb.GpuInfo(index=i, uuid=f"GPU-bench-{h}-{i}", model="NVIDIA GeForce RTX 4090", memory_total_mib=24564)
                  for i in range(gpus)],
        )
    ).SerializeToString()


def _heartbeat() -> bytes:
    """What keeps a stream alive while the others open (after the keyframe, seq 1)."""
    from protos import telemetry_pb2 as pb

    return pb.AgentMessage(heartbeat=pb.Heartbeat(last_seq=1)).SerializeToString()


def _failure(exc: BaseException) -> str:
    """One refused stream, as the summary lists it: a gRPC error's details, else the exception."""
    details = getattr(exc, "details", None)
    return f"{type(exc).__name__}: {details() if callable(details) else exc}"


async def _generate(target: str, hosts: int, gpus: int, interval: float, duration: float, channels: int, seed: int = 1) -> None:
    """The load generator. Phase 1 opens every stream (register, then the
    keyframe) and waits for each stream's RegisterAck, so the coordinator's
    handler for it is running; it prints ``{"connected": ...}`` on stdout.
    Phase 2 starts all hosts at once on a common clock, each at its own
    phase: a uniform random offset within the interval (seeded), as real
    agents that started at independent times would be. It prints one JSON
    line per second: envelopes sent so far and how late the sends ran."""
    import random

    import grpc

    templates = _templates(gpus, 8)
    chans = [grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(channels)]
    identity = lambda b: b  # noqa: E731 - messages are pre-serialized
    calls: list = [None] * hosts
    failures: list[str] = []
    t_connect = time.monotonic()
    opening = asyncio.Semaphore(100)  # the coordinator accepts one new stream per loop turn

    async def connect(h: int) -> None:
        async with opening:
            ch = chans[h % channels]
            call = ch.stream_stream("/gpulb.v1.AgentGateway/Connect", request_serializer=identity, response_deserializer=identity)()
            try:
                await call.write(_register(h, gpus))
                await call.write(_frame(1, templates[h % len(templates)][0]))  # the keyframe
                await call.read()  # the RegisterAck: the coordinator's handler runs
                calls[h] = call
            except Exception as exc:
                failures.append(_failure(exc))

    rng = random.Random(seed)
    offsets = [rng.uniform(0.0, interval) for _ in range(hosts)]
    sent = [0]
    late: list[float] = []
    go = asyncio.Event()
    start = [0.0]
    stop_at = [float("inf")]

    async def host(h: int) -> None:
        await connect(h)
        call = calls[h]
        if call is None:
            return
        await go.wait()
        bodies = templates[h % len(templates)]
        seq = 1
        monotonic = time.monotonic
        next_at = start[0] + offsets[h]
        try:
            while next_at < stop_at[0]:
                delay = next_at - monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                else:
                    late.append(-delay)
                seq += 1
                await call.write(_frame(seq, bodies[(seq - 1) % len(bodies)]))
                sent[0] += 1
                next_at += interval
            await call.done_writing()
        except Exception as exc:  # a refused stream: report it, keep the others going
            failures.append(_failure(exc))

    async def connected() -> None:
        heartbeat = _heartbeat()
        last_beat = time.monotonic()
        while sum(c is not None for c in calls) + len(failures) < hosts:
            await asyncio.sleep(0.1)
            if time.monotonic() - last_beat > 5.0:  # streams that wait for the others stay alive
                last_beat = time.monotonic()
                for call in calls:
                    if call is not None:
                        await call.write(heartbeat)
        print(json.dumps({"connected": sum(c is not None for c in calls), "failed": len(failures),
                          "connect_s": round(time.monotonic() - t_connect, 2),
                          "first_failure": failures[0] if failures else None}), flush=True)
        start[0] = time.monotonic() + 0.05
        stop_at[0] = start[0] + duration
        go.set()

    async def report() -> None:
        await go.wait()
        while time.monotonic() < stop_at[0]:
            await asyncio.sleep(1.0)
            lateness = np.asarray(late) if late else np.zeros(1)
            print(json.dumps({"t": round(time.monotonic() - start[0], 2), "sent": sent[0], "late_sends": len(late),
                              "late_p99_ms": round(float(np.percentile(lateness, 99)) * 1000, 1), "failed": len(failures)}), flush=True)

    await asyncio.gather(connected(), report(), *(host(h) for h in range(hosts)), return_exceptions=True)
    for ch in chans:
        await ch.close()


# ---- the raw HTTP/2 load generator --------------------------------------------
#
# grpc.aio costs its client ~65 us of CPU per message sent, on the same two
# cores as the coordinator it measures. This generator speaks the few parts of
# HTTP/2 a gRPC client stream needs (preface, SETTINGS, HEADERS with literal
# HPACK fields, DATA, PING and SETTINGS acks, WINDOW_UPDATE flow control) and
# writes pre-encoded frames: a few us per message. The coordinator sees
# ordinary gRPC streams; what it does with them is what is measured.

_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_DATA, _HEADERS, _RST_STREAM, _SETTINGS, _PING, _GOAWAY, _WINDOW_UPDATE = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7, 0x8
_END_STREAM, _ACK, _END_HEADERS = 0x1, 0x1, 0x4
_BIG_WINDOW = (1 << 31) - 1


def _h2_frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream.to_bytes(4, "big") + payload


def _hpack_literal(name_index: int, value: bytes) -> bytes:
    """A header field without indexing, its name from the static table (index < 15)."""
    return bytes((name_index,)) + bytes((len(value),)) + value


def _connect_headers(authority: str) -> bytes:
    return (
        b"\x83"  # :method POST
        + b"\x86"  # :scheme http
        + _hpack_literal(4, b"/gpulb.v1.AgentGateway/Connect")  # :path
        + _hpack_literal(1, authority.encode())  # :authority
        + b"\x0f\x10" + bytes((16,)) + b"application/grpc"  # content-type (static index 31)
        + b"\x00\x02te\x08trailers"
    )


def _grpc_message(message: bytes) -> bytes:
    return b"\x00" + len(message).to_bytes(4, "big") + message


class _H2Connection(asyncio.Protocol):
    """One HTTP/2 connection carrying many Connect streams."""

    def __init__(self, authority: str) -> None:
        self.headers = _connect_headers(authority)
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.next_stream = 1
        self.window = 65535  # what the coordinator lets us send on the connection
        self.stream_initial = 65535
        self.stream_window: dict[int, int] = {}
        self.out = bytearray()  # frames waiting for this turn's single write
        self.blocked: list[tuple[int, bytes]] = []  # frames waiting for flow-control window
        self.answered: dict[int, asyncio.Future] = {}
        self.failed: dict[int, str] = {}
        self.blocked_count = 0
        self.closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport) -> None:
        self.transport = transport
        settings = (2).to_bytes(2, "big") + (0).to_bytes(4, "big") + (4).to_bytes(2, "big") + _BIG_WINDOW.to_bytes(4, "big")
        transport.write(_PREFACE + _h2_frame(_SETTINGS, 0, 0, settings)
                        + _h2_frame(_WINDOW_UPDATE, 0, 0, (_BIG_WINDOW - 65535).to_bytes(4, "big")))

    def connection_lost(self, exc) -> None:
        for sid, fut in self.answered.items():
            if not fut.done():
                fut.set_exception(ConnectionError("connection lost"))
            self.failed.setdefault(sid, "connection lost")
        if not self.closed.done():
            self.closed.set_result(None)

    def open_stream(self, first_messages: list[bytes]) -> tuple[int, asyncio.Future]:
        sid = self.next_stream
        self.next_stream += 2
        self.stream_window[sid] = self.stream_initial
        fut = asyncio.get_running_loop().create_future()
        self.answered[sid] = fut
        self.out += _h2_frame(_HEADERS, _END_HEADERS, sid, self.headers)
        for message in first_messages:
            self.send(sid, message)
        return sid, fut

    def send(self, sid: int, message: bytes) -> None:
        """Queue one gRPC message on a stream (written at ``flush``)."""
        data = _grpc_message(message)
        n = len(data)
        if self.blocked or self.window < n or self.stream_window[sid] < n:
            self.blocked.append((sid, data))
            self.blocked_count += 1
            return
        self.window -= n
        self.stream_window[sid] -= n
        self.out += _h2_frame(_DATA, 0, sid, data)

    def flush(self) -> None:
        if self.out and self.transport is not None:
            self.transport.write(bytes(self.out))
            self.out.clear()

    def _unblock(self) -> None:
        waiting, self.blocked = self.blocked, []
        for i, (sid, data) in enumerate(waiting):
            n = len(data)
            if self.window < n or self.stream_window[sid] < n:
                self.blocked = waiting[i:]
                break
            self.window -= n
            self.stream_window[sid] -= n
            self.out += _h2_frame(_DATA, 0, sid, data)
        self.flush()

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        pos = 0
        while len(buf) - pos >= 9:
            length = int.from_bytes(buf[pos:pos + 3], "big")
            if len(buf) - pos < 9 + length:
                break
            kind, flags = buf[pos + 3], buf[pos + 4]
            sid = int.from_bytes(buf[pos + 5:pos + 9], "big") & 0x7FFFFFFF
            payload = bytes(buf[pos + 9:pos + 9 + length])
            pos += 9 + length
            self._frame(kind, flags, sid, payload)
        del buf[:pos]
        self.flush()

    def _frame(self, kind: int, flags: int, sid: int, payload: bytes) -> None:
        if kind == _DATA:
            fut = self.answered.get(sid)
            if fut is not None and not fut.done():
                fut.set_result(None)
            if flags & _END_STREAM:
                self._ended(sid, "the coordinator ended the stream")
        elif kind == _HEADERS:
            if flags & _END_STREAM:  # trailers: the stream is over (refused or closed)
                self._ended(sid, "the coordinator closed the stream with a status")
        elif kind == _RST_STREAM:
            self._ended(sid, f"RST_STREAM {int.from_bytes(payload[:4], 'big')}")
        elif kind == _SETTINGS and not flags & _ACK:
            for i in range(0, len(payload) - 5, 6):
                ident, value = int.from_bytes(payload[i:i + 2], "big"), int.from_bytes(payload[i + 2:i + 6], "big")
                if ident == 4:  # INITIAL_WINDOW_SIZE applies to every stream, open or not
                    delta = value - self.stream_initial
                    self.stream_initial = value
                    for k in self.stream_window:
                        self.stream_window[k] += delta
            self.out += _h2_frame(_SETTINGS, _ACK, 0, b"")
            self._unblock()
        elif kind == _PING and not flags & _ACK:
            self.out += _h2_frame(_PING, _ACK, 0, payload)
        elif kind == _WINDOW_UPDATE:
            increment = int.from_bytes(payload[:4], "big") & 0x7FFFFFFF
            if sid == 0:
                self.window += increment
            elif sid in self.stream_window:
                self.stream_window[sid] += increment
            if self.blocked:
                self._unblock()
        elif kind == _GOAWAY:
            for k in list(self.answered):
                self._ended(k, "GOAWAY")

    def _ended(self, sid: int, why: str) -> None:
        self.failed.setdefault(sid, why)
        fut = self.answered.get(sid)
        if fut is not None and not fut.done():
            fut.set_exception(ConnectionError(why))


async def _generate_h2(target: str, hosts: int, gpus: int, interval: float, duration: float, connections: int, seed: int = 1) -> None:
    """The load generator over raw HTTP/2: as ``_generate`` (same phases,
    same JSON lines), with every due host's frame of one loop turn written to
    its connection in one write."""
    import random

    loop = asyncio.get_running_loop()
    templates = _templates(gpus, 8)
    host_name, _, port = target.rpartition(":")
    conns: list[_H2Connection] = []
    for _ in range(connections):
        _, proto = await loop.create_connection(lambda: _H2Connection(target), host_name, int(port))
        conns.append(proto)
    streams: list[tuple[_H2Connection, int] | None] = [None] * hosts
    failures: list[str] = []
    t_connect = time.monotonic()
    opening = asyncio.Semaphore(100)  # the coordinator accepts one new stream per loop turn

    async def connect(h: int) -> None:
        async with opening:
            conn = conns[h % connections]
            sid, answered = conn.open_stream([_register(h, gpus), _frame(1, templates[h % len(templates)][0])])
            conn.flush()
            try:
                await asyncio.wait_for(answered, 60)  # the RegisterAck: the coordinator's handler runs
                streams[h] = (conn, sid)
            except Exception as exc:
                failures.append(f"{type(exc).__name__}: {exc}")

    heartbeat = _heartbeat()

    async def keep_alive() -> None:
        while True:  # streams that wait for the others stay alive
            await asyncio.sleep(5.0)
            for stream in streams:
                if stream is not None:
                    stream[0].send(stream[1], heartbeat)
            for conn in conns:
                conn.flush()

    beats = asyncio.create_task(keep_alive())
    await asyncio.gather(*(connect(h) for h in range(hosts)))
    beats.cancel()
    connected = [h for h in range(hosts) if streams[h] is not None]
    print(json.dumps({"connected": len(connected), "failed": len(failures), "connect_s": round(time.monotonic() - t_connect, 2),
                      "first_failure": failures[0] if failures else None}), flush=True)

    rng = random.Random(seed)
    offsets = {h: rng.uniform(0.0, interval) for h in range(hosts)}
    order = sorted(connected, key=offsets.__getitem__)
    due_offsets = [offsets[h] for h in order]
    seqs = [1] * hosts
    bodies = [templates[h % len(templates)] for h in range(hosts)]
    start = time.monotonic() + 0.05
    stop_at = start + duration
    sent = 0
    late_sends = 0
    lateness: list[float] = []
    i, cycle, next_report = 0, 0, start + 1.0
    monotonic = time.monotonic
    while order:
        now = monotonic()
        if now >= stop_at:
            break
        dirty = set()
        while True:
            due = start + cycle * interval + due_offsets[i]
            if due > now:
                break
            h = order[i]
            conn, sid = streams[h]
            seq = seqs[h] = seqs[h] + 1
            conn.send(sid, _frame(seq, bodies[h][(seq - 1) % _TEMPLATE_ROUNDS]))
            dirty.add(conn)
            sent += 1
            behind = now - due
            if behind > 0.002:
                late_sends += 1
                lateness.append(behind)
            i += 1
            if i == len(order):
                i, cycle = 0, cycle + 1
        for conn in dirty:
            conn.flush()
        if now >= next_report:
            next_report += 1.0
            lost = sum(len(c.failed) for c in conns)
            print(json.dumps({"t": round(now - start, 2), "sent": sent, "late_sends": late_sends,
                              "late_p99_ms": round(float(np.percentile(lateness, 99)) * 1000, 1) if lateness else 0.0,
                              "blocked": sum(c.blocked_count for c in conns), "failed": lost}), flush=True)
        await asyncio.sleep(max(0.0, min(due, next_report) - monotonic()))
    for conn in conns:
        if conn.transport is not None:
            conn.transport.close()


def scrape_metrics(port: int) -> dict[str, float]:
    """The coordinator's exposition (cluster families only), by series
    (name{label=value,...}) -> value, parsed by prometheus-client."""
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


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return float("nan")


def run_ingest_bench(args: argparse.Namespace) -> int:
    import queue
    import threading

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
    lines: queue.Queue = queue.Queue()
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                scrape_metrics(mport)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        print(f"load: {args.hosts} hosts x {args.gpus} GPUs every {args.interval} s "
              f"= {args.hosts * args.gpus / args.interval:,.0f} GPU-samples/s offered; warm-up {args.warmup} s, measured {args.duration} s",
              file=sys.stderr)
        gen = subprocess.Popen(
            [py, "-m", "coordinator.ingestbench", "--generate", f"127.0.0.1:{port}", str(args.hosts), str(args.gpus),
             str(args.interval), str(args.warmup + args.duration + 2), str(args.channels), getattr(args, "generator", "h2")],
            env=env, stdout=subprocess.PIPE, text=True,
        )
        threading.Thread(target=lambda: [lines.put(json.loads(line)) for line in gen.stdout], daemon=True).start()
        connect_deadline = time.monotonic() + max(120.0, args.hosts / 10)
        while True:  # progress lines come while streams open; wait for the one that says all are open
            connect = lines.get(timeout=max(1.0, connect_deadline - time.monotonic()))
            if "connected" in connect:
                break
        streams_ready = scrape_metrics(mport).get("gpulb_agent_streams", float("nan"))
        print(f"connected: {connect['connected']} of {args.hosts} streams in {connect['connect_s']} s "
              f"(coordinator counts {streams_ready:.0f}); sending", file=sys.stderr)
        time.sleep(args.warmup + 0.5)
        # the window runs between the two scrapes' midpoints (a scrape reads
        # the counters somewhere inside its own round trip)
        s0 = time.monotonic()
        before = scrape_metrics(mport)
        t0 = (s0 + time.monotonic()) / 2
        gen_before = _latest(lines)
        cpu_before = (process_cpu_s(coord.pid), process_cpu_s(gen.pid))
        load_before = os.getloadavg()[0]
        rss = []
        for i in range(int(args.duration)):
            time.sleep(1)
            rss.append(_rss_mib(coord.pid))
            if (i + 1) % 5 == 0:
                print(f"  {i + 1}/{int(args.duration)} s measured", file=sys.stderr)
        s1 = time.monotonic()
        after = scrape_metrics(mport)
        elapsed = (s1 + time.monotonic()) / 2 - t0
        gen_after = _latest(lines)
        cpu_after = (process_cpu_s(coord.pid), process_cpu_s(gen.pid))
        load_after = os.getloadavg()[0]
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
    memory = view_memory_per_gpu()
    # the generator's own rate, over its own progress lines' clock (they come once a second)
    gen_span = (gen_after.get("t", 0.0) - gen_before.get("t", 0.0)) if gen_after and gen_before else 0.0
    sent = (gen_after["sent"] - gen_before["sent"]) * args.gpus / gen_span if gen_span > 0 else float("nan")
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_implementation()} {platform.python_version()}",
        "load_average_1m": [round(load_before, 2), round(load_after, 2)],
        "hosts": args.hosts,
        "gpus_per_host": args.gpus,
        "interval_s": args.interval,
        "offered_gpu_samples_per_s": args.hosts * args.gpus / args.interval,
        "sent_gpu_samples_per_s": round(sent, 1),
        "applied_gpu_samples_per_s": round(rate, 1),
        "applied_of_sent": round(rate / sent, 4) if sent == sent and sent > 0 else None,
        "ingest_delay_p50_ms": round(p50 * 1000, 2),
        "ingest_delay_p99_ms": round(p99 * 1000, 2),
        "streams_connected_before_window": connect["connected"],
        "streams_open_at_start": before.get("gpulb_agent_streams", float("nan")),
        "streams_open_at_end": after.get("gpulb_agent_streams", float("nan")),
        "connect_s": connect["connect_s"],
        "generator_late_p99_ms": gen_after.get("late_p99_ms"),
        # sends that found an HTTP/2 flow-control window shut (the coordinator not reading)
        "generator_flow_blocked": gen_after.get("blocked"),
        "coordinator_cpu_cores": round((cpu_after[0] - cpu_before[0]) / elapsed, 2),
        "generator_cpu_cores": round((cpu_after[1] - cpu_before[1]) / elapsed, 2),
        "coordinator_rss_mib_max": round(float(np.nanmax(rss)), 1) if rss else None,
        "view_bytes_per_gpu": round(memory["bytes_per_gpu"], 1),
        "load_generator": f"one process on the same machine ({getattr(args, 'generator', 'h2')}), {args.hosts} streams over "
                          f"{args.channels} HTTP/2 connections, seeded random phases",
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        rows = [[k, v] for k, v in result.items()]
        print(render_table(["MEASURE", "VALUE"], rows, align="lr"))
    return 0


def _latest(lines) -> dict:
    """The newest progress line of the generator (drains the queue)."""
    import queue

    last: dict = {}
    while True:
        try:
            last = lines.get_nowait()
        except queue.Empty:
            return last


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--generate":
    _, _, target, hosts, gpus, interval, duration, channels, *rest = sys.argv
    kind = rest[0] if rest else "h2"
    generate = _generate_h2 if kind == "h2" else _generate
    asyncio.run(generate(target, int(hosts), int(gpus), float(interval), float(duration), int(channels)))
