"""A SIGHUP reads the token file again: a tenant's token is added, or a
leaked one revoked, without a restart.

Before, tokens were read once at start: revoking a leaked token meant a
restart, which drops every agent stream and waiting call, and until then the
token kept working. Now new calls are checked against the file as reloaded,
and streams opened with a token it no longer grants end UNAUTHENTICATED:
watches (WatchTask, WatchView, WatchPlans) at once, agent streams too (the
agent then finds itself refused and stops). A file that does not load keeps
the tokens served before. The daemon test sends a real SIGHUP.
"""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import grpc
import pytest

from agent.client import Agent, AgentConfig
from agent.sim import SimBackend
from coordinator.config import CoordinatorConfig
from coordinator.demo import free_port
from coordinator.security import Security, TokenAuth, bearer_metadata, hash_token
from coordinator.server import Coordinator
from coordinator.shutdown import TOKEN_REVOKED
from protos import cluster_pb2 as cpb
from protos import cluster_pb2_grpc as cpb_grpc
from protos import tasks_pb2 as tpb
from protos import tasks_pb2_grpc as tpb_grpc
from waiting import CoordinatorProcess, until

pytestmark = pytest.mark.timeout(90)


def _write(path: Path, tokens: dict[str, dict]) -> None:
    path.write_text(json.dumps({"tokens": {hash_token(t): spec for t, spec in tokens.items()}}))


ALL = {
    "alice-tok": {"role": "tenant", "tenant": "alice", "name": "alice"},
    "bob-tok": {"role": "tenant", "tenant": "bob", "name": "bob"},
    "agent-tok": {"role": "agent", "name": "gpu-hosts"},
}


async def test_revoked_tokens_end_their_streams_and_calls_and_the_rest_go_on(tmp_path: Path) -> None:
    token_file = tmp_path / "tokens.json"
    _write(token_file, ALL)
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", heartbeat_interval_s=1.0),
                        security=Security(tokens=TokenAuth.from_file(token_file), insecure=True))
    port = await coord.start()
    agent = Agent(AgentConfig(node_id="host-1", coordinator=f"127.0.0.1:{port}", token="agent-tok", interval_min_s=0.05,
                              interval_max_s=0.2, backoff_initial_s=0.05, backoff_max_s=0.2),
                  SimBackend(gpus=1, seed=1), seed=1)
    agent_run = asyncio.create_task(agent.run())
    try:
        await until(lambda: "host-1" in coord.gateway.sessions, what="the agent registered")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            sched, op = tpb_grpc.SchedulerStub(channel), cpb_grpc.ClusterOperatorStub(channel)
            # alice's task is placed and runs until she completes it; she watches it
            await sched.ScheduleTask(tpb.ScheduleTaskRequest(spec=tpb.TaskSpec(task_id="big", vram_mib=1024), wait=True),
                                     metadata=bearer_metadata("alice-tok"), timeout=10)
            alice_watch = sched.WatchTask(tpb.WatchTaskRequest(task_id="big"), metadata=bearer_metadata("alice-tok"))
            assert (await alice_watch.read()).spec.task_id == "big"
            bob_view = op.WatchView(cpb.WatchViewRequest(), metadata=bearer_metadata("bob-tok"))
            await bob_view.read()

            kept = {t: ALL[t] for t in ("bob-tok",)}
            kept["carol-tok"] = {"role": "tenant", "tenant": "carol", "name": "carol"}
            _write(token_file, kept)
            outcome = coord.reload_tokens(TokenAuth.from_file(token_file))
            assert outcome == {"tokens": 2, "revoked": ["alice", "gpu-hosts"], "watch_streams_ended": 1,
                               "agent_streams_ended": ["host-1"]}

            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await asyncio.wait_for(alice_watch.read(), 10)
            assert (ended.value.code(), ended.value.details()) == (grpc.StatusCode.UNAUTHENTICATED, TOKEN_REVOKED)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await sched.GetTask(tpb.GetTaskRequest(task_id="big"), metadata=bearer_metadata("alice-tok"), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED

            # the revoked agent's stream ends, and its reconnection is refused: it stops
            await asyncio.wait_for(agent_run, 20)
            assert agent.refused is not None and agent.refused[0] == "UNAUTHENTICATED"

            # bob's watch goes on, and carol's new token works at once
            assert await asyncio.wait_for(bob_view.read(), 10) is not grpc.aio.EOF
            assert coord.security.watch_streams.open == 1
            await sched.ListTasks(tpb.ListTasksRequest(), metadata=bearer_metadata("carol-tok"), timeout=10)
            bob_view.cancel()
    finally:
        agent_run.cancel()
        await coord.stop(grace_s=0.1)


def test_a_sighup_reloads_the_token_file_and_keeps_the_old_one_when_the_new_does_not_load(tmp_path: Path) -> None:
    token_file = tmp_path / "tokens.json"
    _write(token_file, {"alice-tok": ALL["alice-tok"], "admin-tok": {"role": "admin"}})
    port = free_port()
    config = tmp_path / "coordinator.toml"
    config.write_text(f'[coordinator]\nlisten = "127.0.0.1:{port}"\nlog_format = "json"\ninsecure = true\n'
                      f'token_file = "{token_file}"\n')
    daemon = CoordinatorProcess(config, tmp_path / "coordinator.log")
    coord, events, wait_for = daemon.proc, daemon.events, daemon.wait_for

    def status(token: str) -> grpc.StatusCode:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                tpb_grpc.SchedulerStub(channel).ListTasks(tpb.ListTasksRequest(), metadata=bearer_metadata(token), timeout=5)
            except grpc.RpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK

    try:
        wait_for(lambda: events("coordinator_listening"), "the coordinator started")
        assert status("alice-tok") == grpc.StatusCode.OK
        assert status("bob-tok") == grpc.StatusCode.UNAUTHENTICATED

        _write(token_file, {"bob-tok": ALL["bob-tok"], "admin-tok": {"role": "admin"}})
        coord.send_signal(signal.SIGHUP)
        wait_for(lambda: events("tokens_reloaded"), "tokens reloaded")
        reloaded = events("tokens_reloaded")[0]
        assert (reloaded["added"], reloaded["revoked"]) == (["bob"], ["alice"])
        assert status("bob-tok") == grpc.StatusCode.OK
        assert status("alice-tok") == grpc.StatusCode.UNAUTHENTICATED

        token_file.write_text("{ half written")
        coord.send_signal(signal.SIGHUP)
        wait_for(lambda: events("token_file_reload_refused"), "a bad file refused")
        assert "not valid JSON" in events("token_file_reload_refused")[0]["error"]
        assert status("bob-tok") == grpc.StatusCode.OK  # the tokens served before
        assert coord.poll() is None
    finally:
        daemon.stop()
