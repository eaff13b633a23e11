"""Who may register what: a GPU uuid belongs to one node, a node id to one live
agent instance, and a registration the coordinator refuses for good stops the
agent with its own exit code. A real coordinator on a loopback port, real
agents on the sim backend, and raw streams for what no shipped agent sends."""

from __future__ import annotations

import asyncio
import sys

import grpc
import pytest
from structlog.testing import capture_logs

from waiting import until
from agent.client import Agent, AgentConfig
from agent.sim import SimBackend
from coordinator.config import CoordinatorConfig
from coordinator.liveness import ManualClock
from coordinator.server import Coordinator
from coordinator.view import RegistrationError, validate_register
from protos import telemetry_pb2 as pb
from protos import telemetry_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(60)


def _agent(node_id: str, port: int, *, seed: int, agent_seed: int, gpus: int = 1, **config) -> Agent:
    """A sim agent; ``agent_seed`` fixes its instance id (Register.session_id)."""
    config = {"interval_min_s": 0.05, "interval_max_s": 0.1, "backoff_initial_s": 0.05, "backoff_max_s": 0.2, **config}
    cfg = AgentConfig(node_id=node_id, coordinator=f"127.0.0.1:{port}", **config)
    return Agent(cfg, SimBackend(gpus=gpus, seed=seed, workload="idle", node_id=node_id), seed=agent_seed)


def _register(node_id: str, uuids: list[str], session_id: int = 0, **fields) -> pb.AgentMessage:
    return pb.AgentMessage(register=pb.Register(
        node_id=node_id, backend="sim", session_id=session_id,
        gpus=[pb.GpuInfo(index=i, uuid=u, model="X", memory_total_mib=1000) for i, u in enumerate(uuids)], **fields))


class _Stream:
    """A raw agent stream: register, then read what the coordinator says."""

    def __init__(self, port: int) -> None:
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self.call = pb_grpc.AgentGatewayStub(self.channel).Connect()

    async def register(self, msg: pb.AgentMessage) -> tuple[grpc.StatusCode, str]:
        """OK and "" once acked, else the status that ended the stream."""
        await self.call.write(msg)
        try:
            reply = await asyncio.wait_for(self.call.read(), 10)
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details()
        if reply is grpc.aio.EOF:
            return await self.call.code(), await self.call.details()
        assert reply.WhichOneof("body") == "register_ack"
        return grpc.StatusCode.OK, ""

    async def ended(self) -> tuple[grpc.StatusCode, str]:
        """The status the coordinator closes this stream with."""
        try:
            while (await asyncio.wait_for(self.call.read(), 10)) is not grpc.aio.EOF:
                pass
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details()
        return await self.call.code(), await self.call.details()

    async def close(self) -> None:
        self.call.cancel()
        await self.channel.close()


async def _refused(port: int, msg: pb.AgentMessage) -> tuple[grpc.StatusCode, str]:
    stream = _Stream(port)
    try:
        return await stream.register(msg)
    finally:
        await stream.close()


@pytest.fixture
async def coord():
    coordinator = Coordinator(CoordinatorConfig(listen="127.0.0.1:0"))
    coordinator.port = await coordinator.start()
    yield coordinator
    await coordinator.stop(grace_s=0.1)


async def _run(*agents: Agent) -> list[asyncio.Task]:
    return [asyncio.create_task(a.run()) for a in agents]


async def _stop(agents: list[Agent], tasks: list[asyncio.Task]) -> None:
    for a in agents:
        await a.stop()
    await asyncio.gather(*tasks, return_exceptions=True)


# ---- GPU uuids ------------------------------------------------------------------------------------


def test_sim_gpu_uuids_are_per_node_and_deterministic():
    one = [g.uuid for g in SimBackend(gpus=2, seed=7, node_id="dup-1").inventory()]
    assert one == [g.uuid for g in SimBackend(gpus=2, seed=7, node_id="dup-1").inventory()]
    two = [g.uuid for g in SimBackend(gpus=2, seed=7, node_id="dup-2").inventory()]
    assert len(set(one) | set(two)) == 4
    assert all(u.startswith("GPU-") and len(u) == 40 for u in one + two)


async def test_a_gpu_uuid_another_node_holds_is_refused_and_that_node_never_registers(coord):
    # two sim hosts given the same seed (the QA case): both register, with their own GPUs
    agents = [_agent("dup-1", coord.port, seed=7, agent_seed=1), _agent("dup-2", coord.port, seed=7, agent_seed=2)]
    tasks = await _run(*agents)
    try:
        await until(lambda: all(a.connected.is_set() for a in agents), what="both sim hosts streaming")
        held = agents[0].inventory[0].uuid
        assert held != agents[1].inventory[0].uuid
        assert coord.view.gpu_owner[held] == "dup-1"

        code, detail = await _refused(coord.port, _register("dup-3", [held]))
        assert code == grpc.StatusCode.ALREADY_EXISTS, (code, detail)
        assert detail.startswith("register.gpus[0].uuid") and "dup-1" in detail and held in detail
        # the second GPU is the stolen one: the index in the field is its own
        code, detail = await _refused(coord.port, _register("dup-3", ["GPU-free", held]))
        assert code == grpc.StatusCode.ALREADY_EXISTS and detail.startswith("register.gpus[1].uuid"), detail
        assert "dup-3" not in coord.view.nodes and "dup-3" not in coord.gateway.sessions
        assert "GPU-free" not in coord.view.gpu_owner
        assert all(a.stats.sessions == 1 for a in agents)  # nobody was disturbed
    finally:
        await _stop(agents, tasks)
    await until(lambda: "dup-1" not in coord.gateway.sessions, what="dup-1's stream closed")
    # once dup-1 has registered other GPUs (its host lost the card), the uuid is free
    assert (await _refused(coord.port, _register("dup-1", ["GPU-other"], session_id=9)))[0] == grpc.StatusCode.OK
    await until(lambda: "dup-1" not in coord.gateway.sessions, what="raw stream closed")
    assert (await _refused(coord.port, _register("dup-3", [held])))[0] == grpc.StatusCode.OK


def _with_gpu(uuids: list[str], **gpu_fields) -> pb.AgentMessage:
    """A register whose first GPU also carries ``gpu_fields``."""
    msg = _register("n", uuids)
    for name, value in gpu_fields.items():
        field = getattr(msg.register.gpus[0], name)
        field.extend(value) if isinstance(value, list) else setattr(msg.register.gpus[0], name, value)
    return msg


def _backend(name: str) -> pb.AgentMessage:
    msg = _register("n", ["GPU-a"])
    msg.register.backend = name
    return msg


def _linked(gpus: int, pairs: list[tuple[int, int]]) -> pb.AgentMessage:
    return _register("n", [f"GPU-{i}" for i in range(gpus)],
                     topology=[pb.TopologyLink(gpu_a=a, gpu_b=b, kind=pb.LINK_KIND_NVLINK, nvlink_count=4) for a, b in pairs])


@pytest.mark.parametrize(
    "msg, field",
    [
        (_register("n", [""]), "register.gpus[0].uuid"),
        (_register("n", ["GPU-a", ""]), "register.gpus[1].uuid"),
        (_register("n", ["GPU-a", "GPU-b", "GPU-a"]), "register.gpus[2].uuid"),
        (_register("n", ["GPU-a"], sample_interval_min_ms=5000, sample_interval_max_ms=10), "register.sample_interval_min_ms"),
        # shown by ListNodes/ListGpus, logged, and (backend) a label of every scrape: bounded
        (_backend("b" * 33), "register.backend"),
        (_with_gpu(["GPU-" + "u" * 125]), "register.gpus[0].uuid"),
        (_with_gpu(["GPU-a"], model="m" * 129), "register.gpus[0].model"),
        (_with_gpu(["GPU-a"], pci_bus_id="0" * 65), "register.gpus[0].pci_bus_id"),
        (_with_gpu(["GPU-a"], supported_fields=[pb.FIELD_UTIL_GPU_PCT] * 65), "register.gpus[0].supported_fields"),
        # one link per GPU pair: 10,000 repeats of one link (the QA sent 380,000: +100 MiB)
        (_linked(4, [(0, 1)] * 10_000), "register.topology"),
        (_linked(4, [(0, 1), (2, 3), (0, 1)]), "register.topology[2]"),
    ],
    ids=["empty", "empty-second", "twice-in-one-register", "min-above-max", "backend", "uuid", "model", "pci-bus-id",
         "supported-fields", "links-past-pairs", "link-repeated"],
)
async def test_a_malformed_registration_is_invalid_argument_naming_the_field(coord, msg, field):
    code, detail = await _refused(coord.port, msg)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and detail.startswith(field), (code, detail)
    assert "n" not in coord.view.nodes
    with pytest.raises(RegistrationError, match=field.replace("[", r"\[").replace("]", r"\]")):
        validate_register(msg.register)


def test_registers_at_the_bounds_are_accepted():
    validate_register(_backend("b" * 32).register)
    validate_register(_with_gpu(["GPU-" + "u" * 124]).register)
    validate_register(_with_gpu(["GPU-a"], model="m" * 128, pci_bus_id="0" * 64,
                                supported_fields=[pb.FIELD_UTIL_GPU_PCT] * 64).register)
    # every GPU pair, in both orders (the agent sends a < b; another client may not)
    validate_register(_linked(4, [(a, b) for a in range(4) for b in range(4) if a != b]).register)


def test_sampling_bounds_in_order_or_unsaid_are_accepted():
    for low, high in ((10, 5000), (200, 200), (0, 0), (0, 2000), (200, 0)):
        validate_register(_register("n", ["GPU-a"], sample_interval_min_ms=low, sample_interval_max_ms=high).register)


async def test_the_same_node_registering_again_keeps_its_gpus(coord):
    agent = _agent("again", coord.port, seed=3, agent_seed=3, gpus=2)
    tasks = await _run(agent)
    try:
        await until(lambda: agent.connected.is_set(), what="streaming")
        rows = coord.view.nodes["again"].rows.copy()
    finally:
        await _stop([agent], tasks)
    # the same host back (a restart: a new instance, the same GPUs)
    back = _agent("again", coord.port, seed=3, agent_seed=4, gpus=2)
    tasks = await _run(back)
    try:
        await until(lambda: back.connected.is_set(), what="streaming again")
        assert back.stats.sessions == 1 and not back.stats.last_error
        assert list(coord.view.nodes["again"].rows) == list(rows)
        assert {coord.view.gpu_owner[g.uuid] for g in back.inventory} == {"again"}
    finally:
        await _stop([back], tasks)


# ---- one live agent per node id ---------------------------------------------------------------------


async def test_another_instance_cannot_take_a_live_node_and_backs_off_until_it_is_gone(coord):
    owner = _agent("host-a", coord.port, seed=1, agent_seed=1)
    impostor = None
    tasks = await _run(owner)
    try:
        await until(lambda: owner.connected.is_set(), what="host-a streaming")
        uuids = [g.uuid for g in owner.inventory]

        # a raw impostor with the same GPUs: refused, naming the live instance
        code, detail = await _refused(coord.port, _register("host-a", uuids, session_id=12345))
        assert code == grpc.StatusCode.ALREADY_EXISTS, (code, detail)
        assert detail.startswith("register.node_id") and f"{owner.session_id:#x}" in detail and "heard from" in detail

        # a real impostor agent: refused each time, never streaming, retrying ever more slowly
        with capture_logs() as logs:
            impostor = _agent("host-a", coord.port, seed=1, agent_seed=2, backoff_max_s=0.4)
            tasks += await _run(impostor)
            await asyncio.sleep(2.0)
            assert not impostor.connected.is_set() and impostor.refused is None
            assert impostor.stats.last_error.startswith("ALREADY_EXISTS: register.node_id")
            refusals = [e for e in logs if e["event"] == "registration_refused"]
            assert refusals and all(e["log_level"] == "error" and e["retrying"] and "--node-id" in e["fix"] for e in refusals)
            waits = [e["in_s"] for e in refusals]
            assert waits[0] <= 0.05 and max(waits) >= 0.2, waits  # the backoff grew towards its cap (0.4 s)
            assert 3 <= impostor.stats.sessions <= 12, impostor.stats.sessions
        assert owner.stats.sessions == 1 and owner.connected.is_set()  # never aborted
        assert coord.gateway.sessions["host-a"].session_id == owner.session_id
        assert not [e for e in logs if e["event"] == "stream_ended" and e.get("node_id") == "host-a"]

        # the owner goes away: the impostor's next try takes the node
        await owner.stop()
        await until(lambda: impostor.connected.is_set(), what="the other instance takes over once the first is gone")
        assert coord.gateway.sessions["host-a"].session_id == impostor.session_id
    finally:
        await _stop([a for a in (owner, impostor) if a is not None], tasks)


async def test_a_silent_stream_is_taken_over_by_a_new_instance_and_the_same_instance_always_wins():
    clock = ManualClock(1000.0)
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", heartbeat_interval_s=10.0), clock=clock)
    port = await coord.start()
    streams: list[_Stream] = []
    try:
        def stream() -> _Stream:
            streams.append(_Stream(port))
            return streams[-1]

        first = stream()
        assert (await first.register(_register("host-b", ["GPU-b0"], session_id=1))) == (grpc.StatusCode.OK, "")
        # the same instance reconnecting (its old stream not seen dead yet): the newer stream wins at once
        second = stream()
        assert (await second.register(_register("host-b", ["GPU-b0"], session_id=1)))[0] == grpc.StatusCode.OK
        code, detail = await first.ended()
        assert code == grpc.StatusCode.ABORTED and "newer stream" in detail
        # another instance while that stream is alive (heard from 10 s ago, within 10 s + 1 s grace): refused
        clock.advance(10.0)
        code, detail = await stream().register(_register("host-b", ["GPU-b0"], session_id=2))
        assert code == grpc.StatusCode.ALREADY_EXISTS and "heard from 10.0 s ago" in detail, detail
        # past the heartbeat timeout the silent stream's agent is taken for gone: the new instance takes over
        clock.advance(1.5)
        third = stream()
        assert (await third.register(_register("host-b", ["GPU-b0"], session_id=2)))[0] == grpc.StatusCode.OK
        code, detail = await second.ended()
        assert code == grpc.StatusCode.ABORTED and "0x2 took over" in detail and "silent for 11.5 s" in detail, detail
        assert coord.gateway.sessions["host-b"].session_id == 2 and "host-b" in coord.view.nodes
    finally:
        for s in streams:
            await s.close()
        await coord.stop(grace_s=0.1)


# ---- refusals the agent cannot fix by retrying ----------------------------------------------------------


async def test_an_agent_refused_with_invalid_argument_stops_instead_of_retrying(coord):
    with capture_logs() as logs:
        agent = _agent("bad id!", coord.port, seed=1, agent_seed=1)
        await asyncio.wait_for(agent.run(), 10)  # returns by itself
    assert agent.refused is not None and agent.refused[0] == "INVALID_ARGUMENT" and agent.refused[1].startswith("register.node_id")
    assert agent.stats.sessions == 1
    refused = [e for e in logs if e["event"] == "registration_refused"]
    assert len(refused) == 1 and refused[0]["log_level"] == "error" and refused[0]["retrying"] is False


async def test_gpulb_agent_exits_78_naming_the_refused_field(tmp_path):
    """A token the coordinator does not know (a bad node id or label is
    refused at start: exit 2, test_agent_flags.py)."""
    import json

    from coordinator.security import Security, TokenAuth, hash_token

    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"tokens": {hash_token("agent-tok"): {"role": "agent", "name": "gpu-hosts"}}}))
    token_file = tmp_path / "agent.token"
    token_file.write_text("not-a-known-token\n")
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0"), security=Security(tokens=TokenAuth.from_file(tokens), insecure=True))
    port = await coord.start()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agent.main", "--coordinator", f"127.0.0.1:{port}", "--node-id", "good-id",
        "--token-file", str(token_file), "--backend", "sim", "--sim-gpus", "1", "--log-format", "json",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), 30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await coord.stop(grace_s=0.1)
    text = out.decode()
    assert proc.returncode == 78, text
    assert '"event": "registration_refused"' in text and "UNAUTHENTICATED" in text
    assert '"exit_code": 78' in text


class _OneGpuUnreadable(SimBackend):
    """What the NVML backend lists for a GPU it cannot read (fallen off the
    bus, driver not up yet): uuid "" and 0 MiB."""

    def inventory(self):
        from dataclasses import replace as _replace

        return [_replace(g, uuid="", memory_total_mib=0) if g.index == 1 else g for g in super().inventory()]


async def test_gpus_that_read_wrong_are_retried_then_reread_by_a_new_process_not_refused_for_good(coord):
    """The coordinator refuses such a registration (INVALID_ARGUMENT,
    register.gpus[1]...). That is not the agent's configuration: exiting 78
    (never restarted) would leave the host out after one flaky boot. The agent
    logs an error and retries; the backend reads the GPUs once, so after
    HARDWARE_RETRIES refusals run returns asking for a new process."""
    from agent.client import HARDWARE_RETRIES

    backend = _OneGpuUnreadable(gpus=2, seed=3, workload="idle", node_id="flaky")
    agent = Agent(AgentConfig(node_id="flaky", coordinator=f"127.0.0.1:{coord.port}", interval_min_s=0.05,
                              interval_max_s=0.1, backoff_initial_s=0.02, backoff_max_s=0.05), backend, seed=9)
    with capture_logs() as logs:
        await asyncio.wait_for(agent.run(), 20)  # returns by itself
    assert agent.refused is None  # not for good
    assert agent.reread_wanted is not None and agent.reread_wanted[1].startswith("register.gpus[1]")
    assert agent.stats.sessions == HARDWARE_RETRIES
    refused = [e for e in logs if e["event"] == "registration_refused"]
    assert [e["retrying"] for e in refused] == [True] * (HARDWARE_RETRIES - 1) + [False]
    assert all("nvidia-smi" in e["fix"] for e in refused)
    assert "flaky" not in coord.view.nodes


async def test_a_sampling_period_longer_than_the_heartbeat_keeps_the_node_healthy():
    """interval_max may be 60 s, the heartbeat interval 10 s: between rounds
    the agent must still heartbeat, or its node goes UNREACHABLE and back
    every round. Here: rounds every 3 s of idle (unchanging) readings, a
    heartbeat interval of 0.3 s."""
    from coordinator.liveness import Liveness

    coordinator = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", heartbeat_interval_s=0.3))
    port = await coordinator.start()
    agent = _agent("slow", port, seed=4, agent_seed=4, interval_min_s=3.0, interval_max_s=3.0)
    run = asyncio.ensure_future(agent.run())
    try:
        await until(lambda: coordinator.liveness.state("slow").liveness is Liveness.HEALTHY
                    if "slow" in coordinator.view.nodes else False, what="healthy")
        seen = set()
        for _ in range(25):  # 2.5 s: most of a round's wait
            seen.add(coordinator.liveness.state("slow").liveness)
            await asyncio.sleep(0.1)
        assert seen == {Liveness.HEALTHY}
        assert agent.stats.heartbeats >= 4
    finally:
        await agent.stop()
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)
        await coordinator.stop(grace_s=0.1)
