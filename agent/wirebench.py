"""``gpulb bench wire``: bytes per GPU-sample on the wire, three encodings side
by side, measured in one run on the same samples.

- JSON: every sampling round as a JSON list of full per-GPU objects (what a
  naive agent posting readings would send).
- protobuf: every round as an absolute MetricBatch (a keyframe each time),
  uncompressed, in an AgentMessage.
- delta+snappy: gpulb's encoder - deadband deltas, keyframes every 30 s,
  snappy, skipped empty rounds and heartbeats, counted as whole AgentMessages.

Scenarios (virtual clock, sampling every 500 ms, one 8-GPU host):
- genai-replay: the measured GenAI telemetry (one pod per GPU) at real speed
  (the trace has one reading a minute, so most rounds carry little news);
- genai-replay-60x: the same compressed 60x, so nearly every round carries a
  new trace reading - the hard case for deltas;
- synthetic-volatile: the sim backend's bursty synthetic load.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from dataclasses import dataclass

from agent.backend import BackendUnavailable
from agent.sim import SimBackend
from agent.telemetry import samples_to_matrix
from coordinator.tables import render_table
from protos import telemetry_pb2 as pb
from protos.codec import TelemetryEncoder
from protos.fields import FIELDS

__all__ = ["run_bench", "measure_scenario", "WireResult"]

_INTERVAL_S = 0.5
_HEARTBEAT_S = 10.0


@dataclass
class WireResult:
    scenario: str
    gpu_samples: int
    json_bytes: int
    proto_bytes: int
    delta_bytes: int

    def per_sample(self, total: int) -> float:
        return total / self.gpu_samples

    def as_dict(self) -> dict:
        return {
            "scenario": self.scenario,
            "gpu_samples": self.gpu_samples,
            "bytes_per_gpu_sample": {
                "json": round(self.per_sample(self.json_bytes), 2),
                "protobuf": round(self.per_sample(self.proto_bytes), 2),
                "delta_snappy": round(self.per_sample(self.delta_bytes), 2),
            },
            "delta_snappy_saving_vs_json_pct": round(100 * (1 - self.delta_bytes / self.json_bytes), 2),
            "delta_snappy_saving_vs_protobuf_pct": round(100 * (1 - self.delta_bytes / self.proto_bytes), 2),
        }


def _json_round(node_id: str, ts_ns: int, samples) -> bytes:
    rows = []
    for s in samples:
        row = {"node": node_id, "gpu": s.index, "ts": ts_ns}
        for spec in FIELDS:
            value = getattr(s, spec.attr)
            if value is not None:
                row[spec.attr] = value
        rows.append(row)
    return json.dumps(rows, separators=(",", ":")).encode()


def measure_scenario(name: str, backend_factory, *, rounds: int, gpus: int) -> WireResult:
    clock = [1000.0]
    backend = backend_factory(lambda: clock[0])
    order = [info.index for info in backend.inventory()]
    encoder = TelemetryEncoder(order, keyframe_interval_s=30.0)
    full = TelemetryEncoder(order, compress=False)
    json_bytes = proto_bytes = delta_bytes = 0
    last_sent = clock[0]
    for step in range(rounds):
        now = clock[0]
        ts_ns = int(now * 1e9)
        samples = backend.sample()
        values, present = samples_to_matrix(samples, order)
        json_bytes += len(_json_round("node-0001", ts_ns, samples))
        full.request_keyframe()
        env_full, _ = full.encode(values, present, now_s=now, sampled_at_ns=ts_ns)
        proto_bytes += pb.AgentMessage(telemetry=env_full).ByteSize()
        env, _ = encoder.encode(values, present, now_s=now, sampled_at_ns=ts_ns, sample_interval_ms=500, skip_empty=True)
        if env is not None:
            delta_bytes += pb.AgentMessage(telemetry=env).ByteSize()
            last_sent = now
        elif now - last_sent >= _HEARTBEAT_S:
            delta_bytes += pb.AgentMessage(heartbeat=pb.Heartbeat(sent_at_ns=ts_ns, last_seq=encoder.seq)).ByteSize()
            last_sent = now
        clock[0] += _INTERVAL_S
    backend.close()
    return WireResult(name, rounds * len(order), json_bytes, proto_bytes, delta_bytes)


def scenarios(gpus: int):
    yield "synthetic-volatile", lambda clock: SimBackend(gpus=gpus, seed=11, clock=clock, workload="synthetic")
    for speed, label in ((1.0, "genai-replay"), (60.0, "genai-replay-60x")):
        yield label, (lambda s: lambda clock: SimBackend(gpus=gpus, seed=12, clock=clock, workload="replay", replay_speed=s))(speed)


def run_bench(args: argparse.Namespace) -> int:
    results: list[WireResult] = []
    for name, factory in scenarios(args.gpus):
        try:
            results.append(measure_scenario(name, factory, rounds=args.samples, gpus=args.gpus))
        except BackendUnavailable as exc:
            print(f"skipping {name}: {exc}", file=sys.stderr)
        print(f"  measured {name}", file=sys.stderr)
    machine = f"{platform.machine()}, {platform.python_implementation()} {platform.python_version()}"
    if args.json:
        print(json.dumps({"machine": machine, "interval_s": _INTERVAL_S, "gpus_per_host": args.gpus,
                          "rounds": args.samples, "results": [r.as_dict() for r in results]}, indent=2))
        return 0
    rows = []
    for r in results:
        d = r.as_dict()
        b = d["bytes_per_gpu_sample"]
        rows.append([r.scenario, r.gpu_samples, f"{b['json']:.1f}", f"{b['protobuf']:.1f}", f"{b['delta_snappy']:.2f}",
                     f"{d['delta_snappy_saving_vs_json_pct']:.1f}%", f"{d['delta_snappy_saving_vs_protobuf_pct']:.1f}%"])
    print(f"bytes per GPU-sample on the wire; {args.gpus} GPUs per host, one round every {_INTERVAL_S} s, {args.samples} rounds ({machine})")
    print(render_table(["SCENARIO", "GPU-SAMPLES", "JSON", "PROTOBUF", "DELTA+SNAPPY", "SAVED VS JSON", "SAVED VS PROTOBUF"], rows))
    return 0
