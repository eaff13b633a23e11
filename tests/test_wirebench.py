"""The wire benchmark's accounting: on the same samples, delta+snappy must be
smaller than full protobuf, which must be smaller than JSON."""

from __future__ import annotations

from agent.sim import SimBackend
from agent.wirebench import measure_scenario


def test_delta_snappy_beats_protobuf_beats_json_on_volatile_load():
    result = measure_scenario(
        "synthetic", lambda clock: SimBackend(gpus=4, seed=3, clock=clock), rounds=120, gpus=4
    )
    assert result.gpu_samples == 480
    assert result.delta_bytes < result.proto_bytes < result.json_bytes
    # a quiet stretch must cost almost nothing: most rounds carry few changes
    assert result.per_sample(result.delta_bytes) < result.per_sample(result.proto_bytes) / 2


def test_idle_host_costs_only_keyframes_and_heartbeats():
    result = measure_scenario("idle", lambda clock: SimBackend(gpus=4, seed=3, clock=clock, workload="idle"), rounds=240, gpus=4)
    # 120 s of an idle host at 0.5 s: 4 keyframes + a few deltas/heartbeats
    assert result.per_sample(result.delta_bytes) < 3.0
