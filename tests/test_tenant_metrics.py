"""Per-tenant figures for the operator (QA pass 25: /metrics named no tenant
although the README says it does, and no CLI table said who uses what):

* ``gpulb_tenant_tasks{tenant,state}`` (queued, leased),
  ``gpulb_tenant_gpus_leased{tenant}`` and
  ``gpulb_tenant_quota_refusals_total{tenant,limit}``, counted as tasks change
  (a scrape reads counts, not tasks), bounded: the top tenants by use plus
  ``tenant="other"``, and counters whose series never move;
* ``gpulb tenants``: the same per tenant from ListTasks, as a table or JSON.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent.fleet import SimFleet
from coordinator.config import CoordinatorConfig
from coordinator.security import Security, TenantQuota, TokenAuth, bearer_metadata
from coordinator.server import Coordinator
from protos import tasks_pb2 as tpb
from protos import tasks_pb2_grpc as tpb_grpc
from scheduler.config import SchedulerConfig
from scheduler.task import Priority, Task, TaskSpec, TaskState
from test_tenant_limits import listen_address  # tests/ is on sys.path under pytest
from waiting import until

pytestmark = pytest.mark.timeout(120)

GIB = 1024
TOKENS = {
    "ops-tok": {"role": "admin", "name": "ops"},
    "interns-tok": {"role": "tenant", "tenant": "interns", "name": "interns"},
    "research-tok": {"role": "tenant", "tenant": "research", "name": "research"},
    "agent-tok": {"role": "agent", "name": "gpu-hosts"},
}


def samples(text: str) -> dict[tuple, float]:
    """(sample name, sorted labels) -> value, for the tenant families."""
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith("gpulb_tenant_"):
            for s in family.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def task(task_id: str, tenant: str, state: TaskState, gpus: int = 1, on: tuple[str, ...] = ()) -> Task:
    """A leased task holds ``on`` (default: GPUs of its own)."""
    from scheduler.task import Assignment, ScoreBreakdown

    uuids = on or tuple(f"GPU-{task_id}-{i}" for i in range(gpus))
    held = Assignment("n", tuple(range(len(uuids))), uuids, f"L-{task_id}", 0.0, ScoreBreakdown("p", 0.0, {}, 1), 0.0)
    return Task(spec=TaskSpec(task_id=task_id, tenant=tenant, vram_mib=1.0, num_gpus=gpus), state=state,
                priority=Priority.P2, submitted_at=0.0, queued_at=0.0, enqueued_at=0.0,
                assignment=held if state == TaskState.LEASED else None)


def test_tenant_usage_names_the_top_tenants_and_sums_the_rest_as_other() -> None:
    from coordinator.metrics import TenantUsage

    usage = TenantUsage(named=2)
    for t in (task("a1", "a", TaskState.LEASED, 4), task("b1", "b", TaskState.LEASED, 2), task("b2", "b", TaskState.QUEUED),
              task("c1", "c", TaskState.LEASED, 1), task("c2", "c", TaskState.QUEUED),
              task("o1", "other", TaskState.LEASED, 8)):  # a tenant named "other" is summed there, never twice
        usage.changed(t)
    usage.changed(task("a2", "a", TaskState.QUEUED))
    usage.changed(task("a2", "a", TaskState.CANCELLED))  # ended: no longer counted
    families = {f.name: f for f in usage.families()}
    tasks = {(s.labels["tenant"], s.labels["state"]): s.value for s in families["gpulb_tenant_tasks"].samples}
    assert tasks == {("a", "queued"): 0, ("a", "leased"): 1, ("b", "queued"): 1, ("b", "leased"): 1,
                     ("other", "queued"): 1, ("other", "leased"): 2}
    gpus = {s.labels["tenant"]: s.value for s in families["gpulb_tenant_gpus_leased"].samples}
    assert gpus == {"a": 4, "b": 2, "other": 9}
    # two of a tenant's half-GPU tasks on one GPU hold one GPU (QA pass 25: 9 of 4 GPUs leased)
    usage.changed(task("b3", "b", TaskState.LEASED, 1, on=("GPU-b1-0",)))
    assert usage.gpus["b"] == 2 and usage.leased["b"] == 2
    usage.changed(task("b3", "b", TaskState.COMPLETED))
    assert usage.gpus["b"] == 2 and usage.leased["b"] == 1
    # a task that leaves its lease gives its GPUs back; a tenant holding nothing is gone
    usage.changed(task("a1", "a", TaskState.COMPLETED, 4))
    assert [r[0] for r in usage.holding()] == ["other", "b", "c"] and "a" not in usage.leased and "a" not in usage.gpus
    usage.rebuild([task("z1", "z", TaskState.QUEUED)])
    assert usage.holding() == [("z", 1, 0, 0)]

    # refusals: the first two tenants refused keep their series, the rest count as other
    for tenant, limit in (("a", "max_queued_per_tenant"), ("b", "tenant_max_priority"), ("c", "max_queued_per_tenant"),
                          ("a", "max_queued_per_tenant")):
        usage.refused(tenant, limit)
    refusals = {(s.labels["tenant"], s.labels["limit"]): s.value
                for s in {f.name: f for f in usage.families()}["gpulb_tenant_quota_refusals"].samples}
    assert refusals == {("a", "max_queued_per_tenant"): 2, ("a", "tenant_max_priority"): 0,
                        ("b", "max_queued_per_tenant"): 0, ("b", "tenant_max_priority"): 1,
                        ("other", "max_queued_per_tenant"): 1, ("other", "tenant_max_priority"): 0}


async def test_metrics_and_gpulb_tenants_say_who_uses_what(capsys) -> None:
    from coordinator.cli import main as gpulb

    coord = Coordinator(CoordinatorConfig(listen=listen_address(), metrics_listen=listen_address(), dispatch_interval_s=0.1),
                        scheduler_config=SchedulerConfig(tenant_max_priority={"interns": "P2"}),
                        security=Security(tokens=TokenAuth.from_tokens(TOKENS), insecure=True, quota=TenantQuota(2)))
    port = await coord.start()
    try:
        async with SimFleet(f"127.0.0.1:{port}", hosts=1, gpus=2, workload="idle", agent_options={"token": "agent-tok"}):
            await until(lambda: coord.dispatcher.snapshots.snapshot().healthy.sum() == 2, what="2 healthy GPUs")
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = tpb_grpc.SchedulerStub(channel)

                async def submit(token: str, task_id: str, wait: bool = True, **kw):
                    spec = tpb.TaskSpec(task_id=task_id, vram_mib=kw.pop("vram_mib", 16 * GIB), gpu_share=0.3,
                                        kind="batch", **kw)
                    try:
                        return await stub.ScheduleTask(tpb.ScheduleTaskRequest(spec=spec, wait=wait),
                                                       metadata=bearer_metadata(token), timeout=20)
                    except grpc.aio.AioRpcError as exc:
                        return exc.code()

                # research holds both GPUs with one 2-GPU task; interns wait with two (their limit)
                assert (await submit("research-tok", "train", num_gpus=2)).task.state == tpb.TASK_STATE_LEASED
                for i in range(2):
                    assert (await submit("interns-tok", f"i-{i}", wait=False)).task.state == tpb.TASK_STATE_QUEUED
                assert await submit("interns-tok", "i-2", wait=False) == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert await submit("interns-tok", "i-p0", wait=False,
                                    priority=tpb.PRIORITY_P0) == grpc.StatusCode.PERMISSION_DENIED

            body = await asyncio.to_thread(
                lambda: urllib.request.urlopen(f"http://127.0.0.1:{coord.metrics_port}/metrics", timeout=5).read().decode())
            got = samples(body)
            tenant = lambda name, **labels: got[(name, tuple(sorted(labels.items())))]  # noqa: E731
            assert tenant("gpulb_tenant_tasks", tenant="research", state="leased") == 1
            assert tenant("gpulb_tenant_tasks", tenant="research", state="queued") == 0
            assert tenant("gpulb_tenant_tasks", tenant="interns", state="queued") == 2
            assert tenant("gpulb_tenant_gpus_leased", tenant="research") == 2
            assert tenant("gpulb_tenant_gpus_leased", tenant="interns") == 0
            assert tenant("gpulb_tenant_gpus_leased", tenant="other") == 0
            assert tenant("gpulb_tenant_quota_refusals_total", tenant="interns", limit="max_queued_per_tenant") == 1
            assert tenant("gpulb_tenant_quota_refusals_total", tenant="interns", limit="tenant_max_priority") == 1
            if shutil.which("promtool"):
                check = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True, text=True)
                assert check.returncode == 0, check.stdout + check.stderr

            # gpulb tenants: an admin sees every tenant, a tenant token its own
            capsys.readouterr()
            base = ["--coordinator", f"127.0.0.1:{port}"]
            assert await asyncio.to_thread(gpulb, base + ["--token", "ops-tok", "tenants", "--json"]) == 0
            out = capsys.readouterr().out
            rows, _ = json.JSONDecoder().raw_decode(out[out.index("[\n"):])
            by_tenant = {r["tenant"]: r for r in rows}
            assert [r["tenant"] for r in rows] == ["research", "interns"]  # the most GPUs first
            assert (by_tenant["research"]["leased"], by_tenant["research"]["gpus_leased"],
                    by_tenant["research"]["share_of_gpus"], by_tenant["research"]["vram_mib_leased"]) == (1, 2, 1.0, 32 * GIB)
            assert by_tenant["interns"]["queued"] == 2 and by_tenant["interns"]["queued_by_class"]["P2"] == 2
            assert by_tenant["interns"]["oldest_wait_s"] >= 0
            assert await asyncio.to_thread(gpulb, base + ["--token", "ops-tok", "tenants"]) == 0
            lines = capsys.readouterr().out.splitlines()
            start = next(i for i, line in enumerate(lines) if line.startswith("TENANT"))
            assert lines[start].split()[:4] == ["TENANT", "QUEUED", "LEASED", "GPUS"]
            assert lines[start + 2].split()[:5] == ["research", "0", "1", "2", "100.0"]
            assert lines[start + 3].split()[:4] == ["interns", "2", "0", "0"]
            assert lines[start + 4] == "2 tenants with queued or leased tasks; 2 of 2 GPUs hold leases"
            assert await asyncio.to_thread(gpulb, base + ["--token", "interns-tok", "tenants", "--json"]) == 0
            out = capsys.readouterr().out
            rows, _ = json.JSONDecoder().raw_decode(out[out.index("[\n"):])
            assert [r["tenant"] for r in rows] == ["interns"]
    finally:
        await coord.stop(grace_s=0.1)
