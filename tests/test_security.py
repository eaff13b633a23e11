"""TLS, mutual TLS, tokens and limits (coordinator.security) against a real
grpc.aio server on 127.0.0.1 with certificates generated in the test: wrong CA,
expired certificate, node id mismatch, missing or wrong token, a tenant acting
on another tenant's task, non-admin SetPolicy - each refused with the right
status - and the rate limiters on a fake clock."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path

import grpc
import pytest
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from coordinator.security import (
    INSECURE_IDENTITY,
    AuthError,
    Identity,
    MessageRateLimit,
    RateLimiter,
    Security,
    SecurityConfigError,
    ServerCredentialsConfig,
    TenantQuota,
    TokenAuth,
    TokenBucket,
    bearer_token,
    check_tenant,
    hash_token,
    node_identity_matches,
    require_admin,
    tenant_for_submission,
    visible_tenant,
)
from protos import tasks_pb2 as tpb
from protos import tasks_pb2_grpc as tpb_grpc
from protos import telemetry_pb2 as pb
from protos import telemetry_pb2_grpc as pb_grpc
from scheduler.engine import Scheduler
from scheduler.task import Task, TaskSpec, TaskState
from certs import TestPki, make_test_pki  # tests/certs.py (tests/ is on sys.path under pytest)

Code = grpc.StatusCode

TOKENS = {
    "tok-admin": {"role": "admin", "name": "ops"},
    "tok-a": {"role": "tenant", "tenant": "a", "name": "alice"},
    "tok-b": {"role": "tenant", "tenant": "b", "name": "bob"},
    "tok-agent": {"role": "agent", "name": "agents", "nodes": ["node-a"]},
}


class FakeClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> TestPki:
    return make_test_pki(tmp_path_factory.mktemp("pki"), ("node-a", "node-b"))


@pytest.fixture(scope="module")
def token_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tokens") / "tokens.toml"
    lines = []
    for token, spec in TOKENS.items():
        lines.append(f'[tokens."{hash_token(token)}"]')
        for key, value in spec.items():
            lines.append(f"{key} = {json.dumps(value)}")
    path.write_text("\n".join(lines) + "\n")
    return path


def md(token: str | None) -> tuple:
    return () if token is None else (("authorization", f"Bearer {token}"),)


# ---- servicers that call the hooks the way server.py will --------------------------------------


class MiniScheduler(tpb_grpc.SchedulerServicer):
    """ScheduleTask / CancelTask / ListTasks / WatchTask / SetPolicy over a
    real engine, through the Security hooks; hooks just raise AuthError."""

    def __init__(self, security: Security) -> None:
        self.s = security
        self.engine = Scheduler(clock=time.monotonic)
        if security.quota is not None:
            self.engine.add_listener(security.quota.changed)

    def _task(self, task: Task) -> tpb.Task:
        return tpb.Task(spec=tpb.TaskSpec(task_id=task.task_id, tenant=task.spec.tenant), state=int(task.state))

    async def ScheduleTask(self, request, context):
        identity = self.s.authorize(context, admin=False)
        spec = TaskSpec(task_id=request.spec.task_id, tenant=request.spec.tenant, vram_mib=float(request.spec.vram_mib or 1024))
        spec = self.s.tenant_spec(identity, spec)
        self.s.admit_submission(identity, spec)
        return tpb.ScheduleTaskResponse(task=self._task(self.engine.submit(spec)))

    async def CancelTask(self, request, context):
        identity = self.s.authorize(context, admin=False)
        self.s.check_owner(identity, self.engine.get(request.task_id))
        return tpb.CancelTaskResponse(task=self._task(self.engine.cancel(request.task_id, request.reason)))

    async def ListTasks(self, request, context):
        identity = self.s.authorize(context, admin=False)
        tenant = self.s.visible_tenant(identity, request.tenant)
        return tpb.ListTasksResponse(tasks=[self._task(t) for t in self.engine.tasks(tenant=tenant)])

    async def WatchTask(self, request, context):
        identity = self.s.authorize(context, admin=False)
        task = self.engine.get(request.task_id)
        self.s.check_owner(identity, task)  # raised inside an async generator
        yield self._task(task)

    async def SetPolicy(self, request, context):
        self.s.authorize(context, admin=True)
        info = self.engine.set_policy(request.name)
        return tpb.Policy(name=info.name)


class MiniGateway(pb_grpc.AgentGatewayServicer):
    """Register, then one Ack per later message (seq = count)."""

    def __init__(self, security: Security) -> None:
        self.s = security
        self.registered: list[str] = []
        self.attempts = 0

    async def Connect(self, request_iterator, context):
        self.attempts += 1
        first = await anext(aiter(request_iterator))
        self.s.authorize_node(first.register.node_id, context)
        self.registered.append(first.register.node_id)
        await context.write(pb.CoordinatorMessage(register_ack=pb.RegisterAck(heartbeat_interval_ms=1000)))
        n = 0
        async for _ in request_iterator:
            n += 1
            await context.write(pb.CoordinatorMessage(ack=pb.Ack(seq=n)))


@contextlib.asynccontextmanager
async def serve(security: Security, *, agent_port: bool = True):
    server = grpc.aio.server(interceptors=[security.interceptor()])
    scheduler, gateway = MiniScheduler(security), MiniGateway(security)
    tpb_grpc.add_SchedulerServicer_to_server(scheduler, server)
    pb_grpc.add_AgentGatewayServicer_to_server(gateway, server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    ports = security.add_ports(server, "127.0.0.1:0", "127.0.0.1:0" if agent_port else None)
    await server.start()
    try:
        yield ports, scheduler, gateway
    finally:
        await server.stop(0)


def secure_security(pki: TestPki, token_file: Path, **kw) -> Security:
    tls = ServerCredentialsConfig(str(pki.server.cert_file), str(pki.server.key_file), str(pki.ca_file))
    return Security(tokens=TokenAuth.from_file(token_file), tls=tls, **kw)


def tls_channel(port: int, pki: TestPki, pair=None, root: bytes | None = None) -> grpc.aio.Channel:
    creds = grpc.ssl_channel_credentials(
        root_certificates=root or pki.ca, private_key=pair.key if pair else None, certificate_chain=pair.cert if pair else None
    )
    return grpc.aio.secure_channel(f"127.0.0.1:{port}", creds)


async def status_of(call) -> Code:
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return Code.OK


async def register(channel: grpc.aio.Channel, node_id: str, token: str | None = None) -> tuple[Code, str]:
    stub = pb_grpc.AgentGatewayStub(channel)

    async def messages():
        yield pb.AgentMessage(register=pb.Register(node_id=node_id))
        await asyncio.sleep(3600)

    call = stub.Connect(messages(), metadata=md(token), timeout=5)
    try:
        reply = await call.read()
        call.cancel()
        return Code.OK, reply.WhichOneof("body")
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details()


# ---- end to end ---------------------------------------------------------------------------------


async def test_tokens_and_tenants_over_tls(pki: TestPki, token_file: Path) -> None:
    async with serve(secure_security(pki, token_file)) as (ports, sched, _):
        async with tls_channel(ports["listen"], pki) as channel:
            stub = tpb_grpc.SchedulerStub(channel)
            submit = lambda token, task_id, tenant="": stub.ScheduleTask(  # noqa: E731
                tpb.ScheduleTaskRequest(spec=tpb.TaskSpec(task_id=task_id, tenant=tenant, vram_mib=1024)), metadata=md(token), timeout=5
            )

            # health stays open to probes
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            # missing and wrong tokens
            assert await status_of(submit(None, "x")) == Code.UNAUTHENTICATED
            assert await status_of(submit("tok-nope", "x")) == Code.UNAUTHENTICATED
            # an agent token is no client
            assert await status_of(submit("tok-agent", "x")) == Code.PERMISSION_DENIED
            # a tenant token fixes the tenant
            task = (await submit("tok-a", "a-1")).task
            assert task.spec.tenant == "a"
            assert await status_of(submit("tok-a", "a-2", tenant="b")) == Code.PERMISSION_DENIED
            await submit("tok-b", "b-1")
            await submit("tok-admin", "c-1", tenant="c")

            # tenant B cancelling A's task, and watching it
            cancel = lambda token, task_id: stub.CancelTask(tpb.CancelTaskRequest(task_id=task_id), metadata=md(token), timeout=5)  # noqa: E731
            assert await status_of(cancel("tok-b", "a-1")) == Code.PERMISSION_DENIED
            assert sched.engine.get("a-1").state == TaskState.QUEUED
            watch = stub.WatchTask(tpb.WatchTaskRequest(task_id="a-1"), metadata=md("tok-b"), timeout=5)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in watch:
                    pass
            assert err.value.code() == Code.PERMISSION_DENIED and "tenant 'b'" in err.value.details()
            # the owner and an admin may
            assert (await cancel("tok-a", "a-1")).task.state == TaskState.CANCELLED
            assert (await cancel("tok-admin", "b-1")).task.state == TaskState.CANCELLED

            # listings: a tenant sees its own tasks only
            listed = await stub.ListTasks(tpb.ListTasksRequest(), metadata=md("tok-b"), timeout=5)
            assert {t.spec.task_id for t in listed.tasks} == {"b-1"}
            assert await status_of(stub.ListTasks(tpb.ListTasksRequest(tenant="a"), metadata=md("tok-b"), timeout=5)) == Code.PERMISSION_DENIED
            listed = await stub.ListTasks(tpb.ListTasksRequest(), metadata=md("tok-admin"), timeout=5)
            assert {t.spec.task_id for t in listed.tasks} == {"a-1", "b-1", "c-1"}

            # SetPolicy needs an admin
            set_policy = lambda token: stub.SetPolicy(tpb.SetPolicyRequest(name="binpack"), metadata=md(token), timeout=5)  # noqa: E731
            assert await status_of(set_policy("tok-a")) == Code.PERMISSION_DENIED
            assert await status_of(set_policy(None)) == Code.UNAUTHENTICATED
            assert (await set_policy("tok-admin")).name == "binpack"

        # a client that does not trust the server's CA never gets to send anything
        async with tls_channel(ports["listen"], pki, root=pki.wrong_ca_file.read_bytes()) as channel:
            stub = tpb_grpc.SchedulerStub(channel)
            assert await status_of(stub.ListTasks(tpb.ListTasksRequest(), metadata=md("tok-admin"), timeout=5)) == Code.UNAVAILABLE


async def test_agents_need_a_certificate_naming_their_node(pki: TestPki, token_file: Path) -> None:
    async with serve(secure_security(pki, token_file)) as (ports, _, gateway):
        agent_port = ports["agent_listen"]
        async with tls_channel(agent_port, pki, pki.agents["node-a"]) as channel:
            assert await register(channel, "node-a") == (Code.OK, "register_ack")
            # node id mismatch: node-a's certificate claiming node-b
            code, detail = await register(channel, "node-b")
            assert code == Code.PERMISSION_DENIED and "node-a" in detail and "node-b" in detail
        # wrong CA, expired, none: the handshake fails, the servicer never runs
        before = gateway.attempts
        for pair in (pki.rogue, pki.expired, None):
            async with tls_channel(agent_port, pki, pair) as channel:
                code, _ = await register(channel, "node-a")
                assert code == Code.UNAVAILABLE, pair
        assert gateway.attempts == before
        # on the client port no certificate is requested: an agent stream there is refused
        async with tls_channel(ports["listen"], pki, pki.agents["node-a"]) as channel:
            code, detail = await register(channel, "node-a", token="tok-admin")
            assert code == Code.UNAUTHENTICATED and "client certificate" in detail
        assert gateway.registered == ["node-a"]


async def test_single_port_requires_client_certificates_from_everyone(pki: TestPki, token_file: Path) -> None:
    async with serve(secure_security(pki, token_file), agent_port=False) as (ports, _, _):
        async with tls_channel(ports["listen"], pki, pki.agents["node-b"]) as channel:
            assert await register(channel, "node-b") == (Code.OK, "register_ack")
            stub = tpb_grpc.SchedulerStub(channel)
            assert await status_of(stub.ListTasks(tpb.ListTasksRequest(), metadata=md("tok-a"), timeout=5)) == Code.OK
        async with tls_channel(ports["listen"], pki) as channel:
            stub = tpb_grpc.SchedulerStub(channel)
            assert await status_of(stub.ListTasks(tpb.ListTasksRequest(), metadata=md("tok-a"), timeout=5)) == Code.UNAVAILABLE


async def test_agent_tokens_when_certificates_are_optional(pki: TestPki, token_file: Path) -> None:
    tls = ServerCredentialsConfig(str(pki.server.cert_file), str(pki.server.key_file), require_client_cert_for_agents=False)
    security = Security(tokens=TokenAuth.from_file(token_file), tls=tls)
    async with serve(security, agent_port=False) as (ports, _, _):
        async with tls_channel(ports["listen"], pki) as channel:
            assert await register(channel, "node-a", token="tok-agent") == (Code.OK, "register_ack")
            assert (await register(channel, "node-b", token="tok-agent"))[0] == Code.PERMISSION_DENIED  # not its node
            assert (await register(channel, "node-a", token="tok-a"))[0] == Code.PERMISSION_DENIED  # not an agent
            assert (await register(channel, "node-a"))[0] == Code.UNAUTHENTICATED


async def test_per_client_rate_limit_and_quota_through_the_interceptor(pki: TestPki, token_file: Path) -> None:
    clock = FakeClock()
    security = secure_security(pki, token_file, rate_limit=RateLimiter(1.0, 3, clock=clock), quota=TenantQuota(2))
    async with serve(security) as (ports, _, _):
        async with tls_channel(ports["listen"], pki) as channel:
            stub = tpb_grpc.SchedulerStub(channel)
            submit = lambda token, task_id: stub.ScheduleTask(  # noqa: E731
                tpb.ScheduleTaskRequest(spec=tpb.TaskSpec(task_id=task_id, vram_mib=1024)), metadata=md(token), timeout=5
            )
            assert [await status_of(submit("tok-a", f"a{i}")) for i in range(3)] == [Code.OK, Code.OK, Code.RESOURCE_EXHAUSTED]
            clock.now += 1.0  # one token back
            # the rate allows it, but tenant a already has 2 queued tasks
            assert await status_of(submit("tok-a", "a9")) == Code.RESOURCE_EXHAUSTED
            assert await status_of(submit("tok-a", "a9")) == Code.RESOURCE_EXHAUSTED  # rate again
            clock.now += 1.0
            assert await status_of(submit("tok-a", "a0")) == Code.OK  # a repeat of a queued task passes the quota
            # another client has its own bucket; unauthenticated peers share their address's
            assert await status_of(submit("tok-b", "b0")) == Code.OK
            assert [await status_of(submit(None, "x")) for _ in range(4)][-1] == Code.RESOURCE_EXHAUSTED


async def test_stream_messages_are_throttled_then_a_flood_is_cut(pki: TestPki, token_file: Path) -> None:
    security = secure_security(pki, token_file, stream_rate=(40.0, 5), stream_max_throttled_s=0.4)
    async with serve(security) as (ports, _, _):
        async with tls_channel(ports["agent_listen"], pki, pki.agents["node-a"]) as channel:
            stub = pb_grpc.AgentGatewayStub(channel)

            async def messages(count: int):
                yield pb.AgentMessage(register=pb.Register(node_id="node-a"))
                for _ in range(count):
                    yield pb.AgentMessage(heartbeat=pb.Heartbeat())
                await asyncio.sleep(3600)

            # 15 messages at once: 5 (burst, less the register) pass, the rest at 40/s
            call = stub.Connect(messages(15), timeout=10)
            assert (await call.read()).WhichOneof("body") == "register_ack"
            started = time.monotonic()
            for _ in range(15):
                await call.read()
            elapsed = time.monotonic() - started
            call.cancel()
            assert 0.2 <= elapsed < 2.0, elapsed
            # a sustained flood: throttled for longer than 0.4 s -> cut
            call = stub.Connect(messages(1000), timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in call:
                    pass
            assert err.value.code() == Code.RESOURCE_EXHAUSTED


async def test_insecure_mode_is_explicit_and_loud() -> None:
    with pytest.raises(SecurityConfigError, match="insecure"):
        Security()
    with structlog.testing.capture_logs() as logs:
        security = Security(insecure=True)
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["INSECURE_MODE"]
    assert "no authentication" in logs[0]["detail"]
    async with serve(security) as (ports, _, gateway):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{ports['listen']}") as channel:
            stub = tpb_grpc.SchedulerStub(channel)
            await stub.ScheduleTask(tpb.ScheduleTaskRequest(spec=tpb.TaskSpec(task_id="t", tenant="x", vram_mib=1)), timeout=5)
            assert (await stub.SetPolicy(tpb.SetPolicyRequest(name="binpack"), timeout=5)).name == "binpack"
            assert await register(channel, "any-node") == (Code.OK, "register_ack")
    assert security.authorize(None, admin=True) is INSECURE_IDENTITY


# ---- units --------------------------------------------------------------------------------------


def test_token_file_formats_and_errors(tmp_path: Path, token_file: Path) -> None:
    auth = TokenAuth.from_file(token_file)
    assert len(auth) == 4
    assert auth.authenticate(md("tok-a")) == Identity(tenant="a", admin=False, name="alice", role="tenant")
    assert auth.authenticate(md("tok-admin"), admin=True).admin
    # JSON works the same
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps({"tokens": {hash_token("t1"): {"role": "tenant", "tenant": "z"}}}))
    ident = TokenAuth.from_file(path).authenticate((("Authorization", "bearer t1"),))
    assert (ident.tenant, ident.name) == ("z", f"tenant:z:{hash_token('t1')[7:15]}")
    # errors name the file and the field
    bad = {
        "plain.json": {"tokens": {"my-secret-token": {"role": "admin"}}},
        "role.json": {"tokens": {hash_token("t"): {"role": "root"}}},
        "tenant.json": {"tokens": {hash_token("t"): {"role": "tenant"}}},
        "extra.json": {"tokens": {hash_token("t"): {"role": "admin", "password": "x"}}},
        "top.json": {"users": {}},
    }
    for name, data in bad.items():
        (tmp_path / name).write_text(json.dumps(data))
        with pytest.raises(SecurityConfigError, match=name.split(".")[0] if name != "top.json" else "tokens") as err:
            TokenAuth.from_file(tmp_path / name)
        assert str(tmp_path / name) in str(err.value)
    (tmp_path / "broken.toml").write_text("[tokens\n")
    with pytest.raises(SecurityConfigError, match="TOML"):
        TokenAuth.from_file(tmp_path / "broken.toml")
    with pytest.raises(SecurityConfigError, match="cannot read"):
        TokenAuth.from_file(tmp_path / "missing.toml")


def test_authenticate_statuses() -> None:
    auth = TokenAuth.from_tokens(TOKENS)
    cases = [
        (md(None), {}, Code.UNAUTHENTICATED),
        ((("authorization", "Basic dXNlcg=="),), {}, Code.UNAUTHENTICATED),
        (md("tok-wrong"), {}, Code.UNAUTHENTICATED),
        (md("tok-a"), {"admin": True}, Code.PERMISSION_DENIED),
        (md("tok-agent"), {}, Code.PERMISSION_DENIED),
    ]
    for metadata, kw, code in cases:
        with pytest.raises(AuthError) as err:
            auth.authenticate(metadata, **kw)
        assert err.value.code == code, (metadata, kw)
    assert bearer_token([(b"x", b"y"), ("authorization", b"Bearer  abc ")]) == "abc"


def test_tenant_rules() -> None:
    a = Identity(tenant="a", admin=False, name="alice")
    admin = Identity(tenant="", admin=True, name="ops", role="admin")
    check_tenant(a, "a")
    check_tenant(admin, "anything")
    for call in (lambda: check_tenant(a, "b"), lambda: require_admin(a), lambda: tenant_for_submission(a, "b"), lambda: visible_tenant(a, "b")):
        with pytest.raises(AuthError) as err:
            call()
        assert err.value.code == Code.PERMISSION_DENIED
    assert tenant_for_submission(a, "") == "a" and tenant_for_submission(admin, "x") == "x"
    assert visible_tenant(a, "") == "a" and visible_tenant(admin, "") == ""
    security = Security(insecure=True, tokens=TokenAuth.from_tokens(TOKENS))
    spec = security.tenant_spec(a, TaskSpec(task_id="t", vram_mib=1.0, labels={"k": "v"}))
    assert spec.tenant == "a" and spec.labels == {"k": "v"}


def test_node_identity_from_auth_context() -> None:
    ctx = {
        "transport_security_type": [b"ssl"],
        "x509_common_name": [b"node-a"],
        "x509_subject_alternative_name": [b"node-a.dc1", b"10.0.0.1"],
        "peer_dns": [b"node-a.dc1"],
        "x509_pem_cert": [b"-----BEGIN CERTIFICATE-----..."],
    }
    assert node_identity_matches(ctx, "node-a")
    assert node_identity_matches(ctx, "node-a.dc1")
    assert not node_identity_matches(ctx, "10.0.0.1")  # DNS names only when gRPC lists them
    assert not node_identity_matches(ctx, "node-b")
    assert not node_identity_matches({"transport_security_type": [b"ssl"]}, "node-a")
    assert not node_identity_matches({**ctx, "transport_security_type": [b"insecure"]}, "node-a")
    assert not node_identity_matches(ctx, "")


def test_credentials_config_errors(pki: TestPki, tmp_path: Path) -> None:
    with pytest.raises(SecurityConfigError, match="client_ca_file"):
        ServerCredentialsConfig(str(pki.server.cert_file), str(pki.server.key_file))
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(SecurityConfigError, match="junk.pem.*not PEM"):
        ServerCredentialsConfig(str(tmp_path / "junk.pem"), str(pki.server.key_file), str(pki.ca_file)).read()
    with pytest.raises(SecurityConfigError, match="cannot read"):
        ServerCredentialsConfig(str(pki.server.cert_file), str(tmp_path / "nope.pem"), str(pki.ca_file)).read()
    with pytest.raises(SecurityConfigError, match="token file"):
        Security(tls=ServerCredentialsConfig(str(pki.server.cert_file), str(pki.server.key_file), str(pki.ca_file)))


def test_token_bucket_and_rate_limiter_on_a_fake_clock() -> None:
    clock = FakeClock()
    limiter = RateLimiter(rate_per_s=2.0, burst=4, clock=clock, max_keys=3)
    assert [limiter.allow("a") for _ in range(5)] == [True] * 4 + [False]
    assert limiter.wait_time("a") == pytest.approx(0.5)
    assert limiter.allow("b")  # keys are independent
    clock.now += 0.25
    assert not limiter.allow("a")  # half a token
    clock.now += 0.25
    assert limiter.allow("a") and not limiter.allow("a")
    clock.now += 100
    assert [limiter.allow("a") for _ in range(5)] == [True] * 4 + [False]  # capped at the burst
    with pytest.raises(AuthError) as err:
        limiter.check("a")
    assert err.value.code == Code.RESOURCE_EXHAUSTED and "retry in 0.50 s" in err.value.message
    assert limiter.refused == 5
    # LRU bound: the least recently used key goes
    for key in ("c", "d", "e"):
        limiter.allow(key)
    assert len(limiter) == 3 and "a" not in limiter._buckets
    bucket = TokenBucket(10.0, 1, clock=clock)
    assert bucket.reserve() == 0.0 and bucket.reserve() == pytest.approx(0.1) and bucket.reserve() == pytest.approx(0.2)
    with pytest.raises(ValueError):
        TokenBucket(0, 1)


async def test_message_rate_limit_delays_then_refuses_a_flood() -> None:
    clock = FakeClock()
    slept: list[float] = []

    async def sleep(s: float) -> None:
        slept.append(s)
        clock.now += s

    limit = MessageRateLimit(10.0, 3, max_throttled_s=1.0, clock=clock, sleep=sleep)
    for _ in range(3):
        await limit.admit()
    assert slept == []
    for _ in range(10):  # one second at the rate: delayed, not refused
        await limit.admit()
    assert len(slept) == 10 and all(s == pytest.approx(0.1) for s in slept)
    with pytest.raises(AuthError) as err:  # throttled without a break for more than 1 s
        for _ in range(5):
            await limit.admit()
    assert err.value.code == Code.RESOURCE_EXHAUSTED
    # a pause resets it
    clock.now += 10
    limit2 = MessageRateLimit(10.0, 3, max_throttled_s=1.0, clock=clock, sleep=sleep)
    for _ in range(3):
        await limit2.admit()


def test_tenant_quota_follows_the_scheduler() -> None:
    quota = TenantQuota(2)
    engine = Scheduler(clock=FakeClock())
    engine.add_listener(quota.changed)
    for i in range(2):
        engine.submit(TaskSpec(task_id=f"a{i}", tenant="a", vram_mib=1.0))
    with pytest.raises(AuthError) as err:
        quota.check(TaskSpec(task_id="a2", tenant="a", vram_mib=1.0))
    assert err.value.code == Code.RESOURCE_EXHAUSTED
    quota.check(TaskSpec(task_id="a0", tenant="a", vram_mib=1.0))  # a repeat
    quota.check(TaskSpec(task_id="b0", tenant="b", vram_mib=1.0))
    engine.cancel("a0")
    assert quota.queued("a") == 1
    quota.check(TaskSpec(task_id="a2", tenant="a", vram_mib=1.0))
    quota.rebuild(engine.tasks())
    assert quota.queued("a") == 1 and quota.queued("b") == 0
    TenantQuota(None).check(TaskSpec(task_id="x", tenant="a", vram_mib=1.0))


def test_new_token_cli_round_trip(capsys, tmp_path: Path) -> None:
    from coordinator.security import main

    assert main(["new-token", "--role", "tenant", "--tenant", "acme", "--name", "ci"]) == 0
    out, err = capsys.readouterr()
    token = err.strip().rsplit(" ", 1)[-1]
    (tmp_path / "t.toml").write_text(out)
    identity = TokenAuth.from_file(tmp_path / "t.toml").authenticate(md(token))
    assert (identity.tenant, identity.name, identity.role) == ("acme", "ci", "tenant")
