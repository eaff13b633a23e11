"""``metrics_auth = "token"``: /metrics is read only with a token of role
metrics (or admin), and a metrics token opens nothing else.

Before it, /metrics answered anyone who reached ``metrics_listen``, and the
exposition names every node, GPU and tenant; the README sent operators to
bind it where only Prometheus reaches. Prometheus sends a bearer token from
``authorization.credentials_file``; these tests make the same requests.
"""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from coordinator import security as security_cli
from coordinator.config import CoordinatorConfig
from coordinator.security import Security, TokenAuth, bearer_metadata
from coordinator.server import Coordinator
from protos import cluster_pb2 as cpb
from protos import cluster_pb2_grpc as cpb_grpc

TOKENS = {
    "prom-token": {"role": "metrics", "name": "prometheus"},
    "admin-token": {"role": "admin"},
    "alice-token": {"role": "tenant", "tenant": "alice"},
    "agent-token": {"role": "agent"},
}


def _get(port: int, path: str, token: str | None = None) -> tuple[int, dict, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, dict(reply.headers), reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read().decode()


@pytest.fixture
async def coordinator():
    cfg = CoordinatorConfig(listen="127.0.0.1:0", metrics_listen="127.0.0.1:0", metrics_auth="token",
                            token_file="(given as tokens below)")
    coord = Coordinator(cfg, security=Security(tokens=TokenAuth.from_tokens(TOKENS), insecure=True))
    await coord.start()
    try:
        yield coord
    finally:
        await coord.stop(grace_s=0.1)


async def test_a_scrape_needs_a_metrics_or_admin_token(coordinator: Coordinator) -> None:
    port = coordinator.metrics_port
    status, headers, body = await asyncio.to_thread(_get, port, "/metrics")
    assert status == 401
    assert headers["WWW-Authenticate"].startswith("Bearer")
    assert "Authorization: Bearer" in body and "gpulb_" not in body

    status, _, body = await asyncio.to_thread(_get, port, "/metrics", "not-a-token")
    assert (status, body.strip()) == (401, "unknown bearer token")

    for token in ("alice-token", "agent-token"):  # known, but not for this
        status, _, body = await asyncio.to_thread(_get, port, "/metrics", token)
        assert status == 403 and "needs metrics" in body and "gpulb_" not in body

    for token in ("prom-token", "admin-token"):
        status, _, body = await asyncio.to_thread(_get, port, "/metrics", token)
        assert status == 200
        assert "gpulb_nodes" in {f.name for f in text_string_to_metric_families(body)}

    # a liveness probe has no token
    assert (await asyncio.to_thread(_get, port, "/healthz"))[0] == 200
    assert coordinator._metrics_server.unauthorized == 4


async def test_a_metrics_token_opens_no_grpc_call(coordinator: Coordinator) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{coordinator.port}") as channel:
        stub = cpb_grpc.ClusterOperatorStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.ListNodes(cpb.ListNodesRequest(), metadata=bearer_metadata("prom-token"), timeout=10)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "role 'metrics'" in refused.value.details()
        await stub.ListNodes(cpb.ListNodesRequest(), metadata=bearer_metadata("alice-token"), timeout=10)


async def test_without_metrics_auth_anyone_may_scrape() -> None:
    """The default (none) is as before: a scrape without a token is served."""
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", metrics_listen="127.0.0.1:0"),
                        security=Security(tokens=TokenAuth.from_tokens(TOKENS), insecure=True))
    await coord.start()
    try:
        assert (await asyncio.to_thread(_get, coord.metrics_port, "/metrics"))[0] == 200
    finally:
        await coord.stop(grace_s=0.1)


def test_metrics_auth_token_needs_a_token_file() -> None:
    with pytest.raises(ValueError, match="^metrics_auth: 'token' needs token_file"):
        CoordinatorConfig(metrics_listen="127.0.0.1:0", metrics_auth="token").validate()


def test_metrics_tokens_are_made_and_loaded_without_a_tenant(capsys) -> None:
    assert security_cli.main(["new-token", "--role", "metrics", "--name", "prometheus"]) == 0
    entry = capsys.readouterr().out
    assert 'role = "metrics"' in entry and "tenant" not in entry
    with pytest.raises(SystemExit):
        security_cli.main(["new-token", "--role", "metrics", "--tenant", "alice"])
    assert "a metrics token has no tenant" in capsys.readouterr().err
    with pytest.raises(security_cli.SecurityConfigError, match=r"\.tenant: a metrics token has no tenant"):
        TokenAuth.from_tokens({"t": {"role": "metrics", "tenant": "alice"}})


@pytest.mark.parametrize("address, warned", [("127.0.0.1:0", False), ("0.0.0.0:0", True)])
async def test_an_open_scrape_off_loopback_is_logged(address: str, warned: bool) -> None:
    import structlog

    saved = structlog.get_config()
    try:
        with structlog.testing.capture_logs() as logs:
            coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", metrics_listen=address),
                                security=Security(tokens=TokenAuth.from_tokens(TOKENS), insecure=True))
            await coord.start()
        await coord.stop(grace_s=0.1)
    finally:
        structlog.configure(**saved)
    assert any(e["event"] == "metrics_unauthenticated" for e in logs) == warned
