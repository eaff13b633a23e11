"""Fuzzing of every input gpulb takes from the network (issue 7), with a small
count; ``benchmarks/fuzz.py`` runs the same targets with 10,000 inputs each.

* the telemetry decoder with state, and the coordinator's admit + ingest path:
  applied, or a CodecError naming a field with the state unchanged;
* every RPC of every service the coordinator serves (ClusterOperator,
  Scheduler, Advisor), and the agent stream, against a real coordinator on
  loopback with two sim hosts: OK or a precise status with a detail
  (INVALID_ARGUMENT names a field of the request), never UNKNOWN, INTERNAL or
  a hang; afterwards the server still serves.

Bugs the fuzzer found are reproduced by the ``test_known_bug_*`` tests: an
open one is ``xfail(strict=True)``, a fixed one guards against its return
(and the strategies generate its inputs like any others). Set
GPULB_FUZZ_EXAMPLES to run more examples per target, and GPULB_FUZZ_EXPLORE=1
to draw new ones (by default every run draws the same fixed sequence: the
tests also check that the strategies reach each kind of outcome, and a
random draw of 120 missed one now and then).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest

from protos import cluster_pb2 as cpb
from protos import tasks_pb2 as tpb
from protos import telemetry_pb2 as pb
from protos.codec import TelemetryDecoder, TelemetryEncoder

pytestmark = pytest.mark.timeout(180)


def _load_fuzz():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "fuzz.py"
    spec = importlib.util.spec_from_file_location("gpulb_benchmarks_fuzz", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


fuzz = _load_fuzz()

#: examples per RPC target (the pure decoder targets run twice as many)
EXAMPLES = int(os.environ.get("GPULB_FUZZ_EXAMPLES", "60"))
#: a fixed sequence of examples unless asked to explore (module docstring)
DERANDOMIZE = not os.environ.get("GPULB_FUZZ_EXPLORE")


def _run(name: str, count: int, live=None, **kw):
    cluster, client = live if live is not None else (None, None)
    return fuzz.run_target(name, count, cluster, client, derandomize=DERANDOMIZE, raise_on_unexpected=True, **kw)


# ---- the judge itself -------------------------------------------------------------------
def test_status_judge_accepts_precise_statuses_only():
    roots = frozenset({"spec", "wait"})
    ok = fuzz.classify_status
    assert ok(grpc.StatusCode.OK, "", roots).ok
    assert ok(grpc.StatusCode.INVALID_ARGUMENT, "spec.vram_mib: must be > 0", roots).kind == "INVALID_ARGUMENT"
    assert ok(grpc.StatusCode.INVALID_ARGUMENT, "spec.labels[a]b]: bad", roots).kind == "INVALID_ARGUMENT"
    assert ok(grpc.StatusCode.NOT_FOUND, "task_id: unknown task 'x'", roots).kind == "NOT_FOUND"
    for code, details in [
        (grpc.StatusCode.UNKNOWN, "Unexpected <class 'ValueError'>"),
        (grpc.StatusCode.INTERNAL, "boom"),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"),
        (grpc.StatusCode.UNAVAILABLE, "gone"),
        (grpc.StatusCode.NOT_FOUND, ""),
        (grpc.StatusCode.INVALID_ARGUMENT, "something is wrong"),  # names no field
        (grpc.StatusCode.INVALID_ARGUMENT, "node_id: no such field in this request"),
    ]:
        assert ok(code, details, roots).unexpected, (code, details)


def test_every_rpc_has_a_target():
    methods = {
        f"{service}.{m.name}"
        for module, service in ((cpb, "ClusterOperator"), (tpb, "Scheduler"))
        for m in module.DESCRIPTOR.services_by_name[service].methods
    }
    assert methods <= set(fuzz.RPC_TARGETS)
    # and every method of any other service the coordinator serves (but the agent stream's)
    served = {f"{s.name}.{m.name}" for s in fuzz.served_services() for m in s.methods}
    assert served == set(fuzz.RPC_TARGETS)
    assert set(fuzz.TARGETS) >= methods | {"decoder.apply", "decoder.admit+ingest", "AgentGateway.Connect"}


# ---- the telemetry decoder (pure, fast) -----------------------------------------------
def test_decoder_applies_or_raises_a_codec_error_naming_a_field_and_keeps_its_state():
    tally = _run("decoder.apply", EXAMPLES * 2)
    assert tally.unexpected == 0
    # the strategies reach every outcome: applied values and each kind of error
    assert tally.ok > 0
    assert {"CorruptEnvelope", "InvalidReading", "PayloadTooLarge"} <= set(tally.errors)


def test_admit_and_ingest_reject_only_the_broken_node():
    tally = _run("decoder.admit+ingest", EXAMPLES * 2)
    assert tally.unexpected == 0
    assert tally.ok > 0 and tally.errors


def test_snappy_bombs_are_refused_before_inflating():
    for what, raw_size, payload in fuzz.BOMBS:
        case = fuzz.DecoderCase([0], None, [fuzz.EnvelopeSpec(payload, pb.COMPRESSION_SNAPPY, raw_size, what=what)])
        (outcome,) = fuzz.run_decoder_case(case)
        assert outcome.kind in ("PayloadTooLarge", "CorruptEnvelope"), (what, outcome)


# ---- a real coordinator on loopback ----------------------------------------------------
@pytest.fixture(scope="module")
def live():
    cluster = fuzz.LiveCluster(hosts=2, gpus=4).start()
    client = fuzz.Client(cluster.port)
    cluster.policy = client.unary("gpulb.v1.Scheduler", "GetPolicy", tpb.GetPolicyRequest(), tpb.Policy)
    try:
        yield cluster, client
    finally:
        client.close()
        cluster.stop()


@pytest.mark.parametrize("target", list(fuzz.RPC_TARGETS))
def test_rpc_answers_ok_or_a_precise_status(live, target):
    cluster, client = live
    rpc = fuzz.RPC_TARGETS[target]
    # a watch that waits for events takes OPEN_STREAM_S an input: fewer of them
    count = EXAMPLES if not rpc.streaming or rpc.immediate else max(8, EXAMPLES // 6)
    try:
        tally = _run(target, count, live)
    finally:
        fuzz.restore_cluster(cluster, client, cluster.policy)
    assert tally.unexpected == 0
    assert tally.inputs >= count
    assert client.health() == fuzz.health_pb2.HealthCheckResponse.SERVING


def test_agent_streams_end_ok_or_with_a_precise_status(live):
    tally = _run("AgentGateway.Connect", EXAMPLES, live)
    assert tally.unexpected == 0
    assert tally.ok > 0  # well-behaved streams get through


def test_server_still_serves_after_fuzzing(live):
    """Runs after the targets above (file order): health, the fleet HEALTHY,
    open tasks cancellable, a normal task placed on the fleet and completed,
    and nothing logged at error level or raised on the server's loop."""
    cluster, client = live
    fuzz.restore_cluster(cluster, client, cluster.policy)
    assert fuzz.still_serves(cluster, client) == []


# ---- bugs the fuzzer found (reproductions: fixed ones now guard against a return) --------
# These run last: huge_vram_task leaves a task on the server that breaks ListTasks.
def test_known_bug_seq_max_decoder_never_expects_past_uint64():
    decoder = TelemetryDecoder([0])
    encoder = TelemetryEncoder([0])
    values = np.zeros((1, len(fuzz.FIELDS)), dtype=np.int64)
    values[0, [s.name for s in fuzz.FIELDS].index("health")] = 1
    env, _ = encoder.encode(values, np.ones_like(values, dtype=bool), now_s=0.0, sampled_at_ns=1)
    env.seq = 2**64 - 1
    try:
        decoder.apply(env)
    except fuzz.CodecError:
        return  # refusing the sequence number is a fix too
    assert decoder.expected_seq <= 2**64 - 1


def test_known_bug_seq_max_stream_gets_a_precise_status(live):
    _, client = live
    reproduces, what = fuzz.KNOWN_BUGS["seq_max"].reproduce(client)
    assert not reproduces, what


def test_known_bug_task_event_kind_gets_a_precise_status(live):
    _, client = live
    reproduces, what = fuzz.KNOWN_BUGS["task_event_kind"].reproduce(client)
    assert not reproduces, what


@pytest.mark.parametrize("peak", [-1.0, float("nan"), float("inf")])
def test_task_event_with_a_bad_peak_gets_a_precise_status(live, peak):
    """A peak memory an agent could not have seen ends its stream with
    INVALID_ARGUMENT naming the field, and the coordinator keeps serving."""
    cluster, client = live
    code, details, _ = client.stream([
        pb.AgentMessage(register=fuzz._register("fz-peak", [0])),
        pb.AgentMessage(task_event=pb.TaskEvent(task_id="x", kind=pb.TASK_EVENT_KIND_FINISHED, peak_vram_mib=peak)),
    ])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "task_event.peak_vram_mib" in details, (code, details)
    assert fuzz.still_serves(cluster, client) == []


# KNOWN_BUGS["abort_during_write"] (a stream aborted while a write is in flight
# gets no status) is a race, seen about once in 300 such streams: it has no
# test here, where a strict xfail would flake; the agent-stream target sends a
# stream that hung once again and counts it apart, and benchmarks/fuzz.py
# reproduces it.


def test_known_bug_ingest_cancellation_good_node_unharmed():
    rejected, good_value = fuzz.ingest_cancellation_case()
    assert [node for node, _, _ in rejected] == ["broken"]
    assert good_value == 100.0


def test_known_bug_undecodable_request_gets_a_precise_status(live):
    _run("wire.undecodable", EXAMPLES, live)
    _, client = live
    reproduces, what = fuzz.KNOWN_BUGS["undecodable_request"].reproduce(client)
    assert not reproduces, what
    assert what.startswith("INVALID_ARGUMENT: request: not a valid request message of /gpulb.v1.Scheduler/GetTask"), what


def test_known_bug_huge_vram_task_can_be_read_back(live):
    _, client = live
    reproduces, what = fuzz.KNOWN_BUGS["huge_vram_task"].reproduce(client)
    assert not reproduces, what
