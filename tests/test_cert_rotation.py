"""Certificates that change under running daemons (coordinator/certwatch.py):
renewed server files served at the next handshake without a restart, a
half-done renewal refused while the old certificate keeps serving, and
expiry said ahead of time (logs once a day, metrics) for the coordinator's
own certificates, each connected agent's, and an agent's own. The alert
rules over those metrics are tested in systemd/alerts_test.yml."""

from __future__ import annotations

import asyncio
import datetime as dt
import shutil
import socket
import ssl
from pathlib import Path

import pytest
import structlog
from prometheus_client.parser import text_string_to_metric_families

certs = pytest.importorskip("certs", reason="tests/certs.py needs the cryptography package")
from cryptography import x509  # noqa: E402
from cryptography.hazmat.primitives import serialization  # noqa: E402

from agent import main as agent_main  # noqa: E402
from agent.client import Agent, AgentConfig  # noqa: E402
from agent.sim import SimBackend  # noqa: E402
from coordinator.certwatch import ExpiryReminder, ServerTlsFiles, expiry_problem, pem_not_after  # noqa: E402
from coordinator.config import CoordinatorConfig  # noqa: E402
from coordinator.security import Security, ServerCredentialsConfig, TokenAuth  # noqa: E402
from coordinator.server import Coordinator  # noqa: E402
from waiting import until  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DAY = 86_400.0


@pytest.fixture(autouse=True)
def _keep_logging():
    """capture_logs reconfigures structlog; put back what the tests after these expect."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


class Pki:
    """One CA; server and agent certificates issued on demand with given lifetimes."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.now = dt.datetime.now(dt.timezone.utc)
        self.ca_key, self.ca_cert = certs._ca("rotation CA", self.now)
        self.ca_file = directory / "ca.pem"
        self.ca_file.write_bytes(self.ca_cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, stem: str, *, days: float, server: bool = True, node: str = "node-a") -> certs.CertPair:
        names = dict(dns=["localhost"], ips=["127.0.0.1"]) if server else dict(dns=[node])
        key, cert = certs._leaf(self.ca_key, self.ca_cert, "localhost" if server else node, server=server,
                                not_before=self.now - dt.timedelta(hours=1), not_after=self.now + dt.timedelta(days=days), **names)
        return certs._write(self.dir, stem, key, cert)


def _install(pair: certs.CertPair, cert_file: Path, key_file: Path, *, key: bool = True) -> None:
    """Replace the served files as a renewal tool does: write aside, rename over."""
    for source, target in ((pair.cert_file, cert_file), (pair.key_file, key_file) if key else (None, None)):
        if source is None:
            continue
        aside = target.with_suffix(".new")
        shutil.copyfile(source, aside)
        aside.replace(target)


def _served_serial(port: int, ca_file: Path) -> int:
    """The serial number of the certificate a new TLS handshake gets (as a
    gRPC client would see it: ALPN h2, verified against the CA)."""
    context = ssl.create_default_context(cafile=str(ca_file))
    context.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with context.wrap_socket(raw, server_hostname="localhost") as tls:
            der = tls.getpeercert(binary_form=True)
    return x509.load_der_x509_certificate(der).serial_number


def _serial(pair: certs.CertPair) -> int:
    return x509.load_pem_x509_certificate(pair.cert).serial_number


def _not_after(pair: certs.CertPair) -> float:
    return x509.load_pem_x509_certificate(pair.cert).not_valid_after_utc.timestamp()


def _families(coord: Coordinator) -> dict:
    return {f.name: f for f in text_string_to_metric_families(coord.metrics.exposition().decode())}


def _security(pki: Pki, cert_file: Path, key_file: Path) -> Security:
    return Security(tokens=TokenAuth.from_tokens({"admin-token": {"role": "admin"}}),
                    tls=ServerCredentialsConfig(str(cert_file), str(key_file), str(pki.ca_file)))


# ---- the pieces ------------------------------------------------------------------------------------


def test_expiry_problem_and_the_daily_reminder() -> None:
    now = 1_000_000_000.0
    assert expiry_problem(now + 15 * DAY, now) is None
    assert expiry_problem(now + 3 * DAY, now).startswith("expires in 3.0 days (notAfter 2001-09-12")
    assert expiry_problem(now - 2 * DAY, now).startswith("expired 2.0 days ago")
    reminder = ExpiryReminder()
    assert reminder.due("tls_cert_file", now + 3 * DAY, now) is not None
    assert reminder.due("tls_cert_file", now + 3 * DAY, now + 3600) is None  # said an hour ago
    assert reminder.due("other", now + 3 * DAY, now + 3600) is not None  # each certificate its own
    assert "2.0 days" in reminder.due("tls_cert_file", now + 3 * DAY, now + DAY)
    # renewed: nothing, and a later renewal nearing its end is said of at once
    assert reminder.due("tls_cert_file", now + 90 * DAY, now + DAY + 60) is None
    assert reminder.due("tls_cert_file", now + DAY + 120 + 5 * DAY, now + DAY + 120) is not None


def test_pem_not_after_reads_a_peer_certificate_with_and_without_cryptography(tmp_path: Path, monkeypatch) -> None:
    pki = Pki(tmp_path)
    pair = pki.issue("agent", days=3, server=False)
    assert pem_not_after(pair.cert) == pytest.approx(_not_after(pair))
    assert pem_not_after(pair.cert.decode()) == pytest.approx(_not_after(pair))
    assert pem_not_after(b"not a certificate") is None
    import builtins

    real_import = builtins.__import__

    def no_cryptography(name, *args, **kwargs):
        if name.startswith("cryptography"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_cryptography)
    assert pem_not_after(pair.cert) == pytest.approx(_not_after(pair))


def test_renewed_files_are_taken_once_they_check_out(tmp_path: Path) -> None:
    pki = Pki(tmp_path)
    first, second = pki.issue("first", days=5), pki.issue("second", days=90)
    cert_file, key_file = tmp_path / "served.pem", tmp_path / "served-key.pem"
    _install(first, cert_file, key_file)
    clock = [0.0]
    files = ServerTlsFiles(ServerCredentialsConfig(str(cert_file), str(key_file), str(pki.ca_file)), clock=lambda: clock[0])
    assert files.not_after["tls_cert_file"] == pytest.approx(_not_after(first))
    assert files.not_after["tls_client_ca_file"] == pytest.approx(pki.ca_cert.not_valid_after_utc.timestamp())
    assert not files.refresh(force=True)  # nothing changed
    _install(second, cert_file, key_file, key=False)  # the certificate, not yet its key
    with structlog.testing.capture_logs() as logs:
        assert not files.refresh(force=True)
        assert not files.refresh(force=True)  # the same half-done files: said once
    [refused] = [e for e in logs if e["event"] == "tls_reload_refused"]
    assert "is not the private key of tls_cert_file" in refused["error"]
    assert files.generation == 0 and files.refusals == 1
    assert files.not_after["tls_cert_file"] == pytest.approx(_not_after(first))
    _install(second, cert_file, key_file)
    clock[0] += 0.5
    assert not files.refresh()  # stat'ed at most once a second whatever the handshake rate
    clock[0] += 1.0
    with structlog.testing.capture_logs() as logs:
        assert files.refresh()
    assert [e["event"] for e in logs] == ["tls_reloaded"]
    assert files.generation == 1 and files.reloads == 1
    assert files.not_after["tls_cert_file"] == pytest.approx(_not_after(second))


# ---- a running coordinator -------------------------------------------------------------------------


@pytest.mark.timeout(60)
async def test_a_running_coordinator_serves_renewed_files_without_a_restart(tmp_path: Path) -> None:
    pki = Pki(tmp_path)
    old, new = pki.issue("old", days=5), pki.issue("new", days=90)
    cert_file, key_file = tmp_path / "server.pem", tmp_path / "server-key.pem"
    _install(old, cert_file, key_file)
    with structlog.testing.capture_logs() as logs:
        coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", agent_listen="127.0.0.1:0"),
                            security=_security(pki, cert_file, key_file))
        port = await coord.start()
    try:
        assert any(e["event"] == "tls_certificate_expires_soon" for e in logs)  # at start, as before
        for p in (port, coord.agent_port):
            assert await asyncio.to_thread(_served_serial, p, pki.ca_file) == _serial(old)
        expiry = {s.labels["option"]: s.value for s in _families(coord)["gpulb_tls_certificate_expiry_timestamp_seconds"].samples}
        assert expiry["tls_cert_file"] == pytest.approx(_not_after(old))

        # the renewal tool writes the certificate first: new handshakes keep the old pair meanwhile
        _install(new, cert_file, key_file, key=False)
        await asyncio.sleep(1.1)
        assert await asyncio.to_thread(_served_serial, port, pki.ca_file) == _serial(old)
        _install(new, cert_file, key_file)
        await asyncio.sleep(1.1)
        for p in (port, coord.agent_port):  # each listener follows the files
            assert await asyncio.to_thread(_served_serial, p, pki.ca_file) == _serial(new)
        families = _families(coord)
        expiry = {s.labels["option"]: s.value for s in families["gpulb_tls_certificate_expiry_timestamp_seconds"].samples}
        assert expiry["tls_cert_file"] == pytest.approx(_not_after(new))
        reloads = {s.labels["result"]: s.value for s in families["gpulb_tls_reloads"].samples}
        assert reloads == {"loaded": 1.0, "refused": 1.0}
        # and the hourly check has nothing left to say of it
        assert coord.check_certificates() == []
    finally:
        await coord.stop(grace_s=0.1)


@pytest.mark.timeout(60)
async def test_the_hourly_check_names_expiring_certificates_once_a_day(tmp_path: Path) -> None:
    """The coordinator's own certificate and a connected agent's (its stream
    outlives it, its next handshake does not), each said once a day; the
    agent's expiry is a metric per node."""
    pki = Pki(tmp_path)
    server = pki.issue("server", days=60)
    agent_pair = pki.issue("agent", days=4, server=False, node="node-a")
    coord = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", agent_listen="127.0.0.1:0"),
                        security=_security(pki, server.cert_file, server.key_file))
    await coord.start()
    agent = Agent(AgentConfig(node_id="node-a", coordinator=f"127.0.0.1:{coord.agent_port}", ca_file=str(pki.ca_file),
                              cert_file=str(agent_pair.cert_file), key_file=str(agent_pair.key_file),
                              interval_min_s=0.05, interval_max_s=0.2, backoff_initial_s=0.05, backoff_max_s=0.2),
                  SimBackend(gpus=1, seed=1, workload="idle", node_id="node-a"))
    running = asyncio.create_task(agent.run())
    try:
        await asyncio.wait_for(agent.connected.wait(), 15)
        await until(lambda: "node-a" in coord.gateway.sessions, what="node-a's stream")
        agents = _families(coord)["gpulb_agent_certificate_expiry_timestamp_seconds"].samples
        assert [(s.labels["node"], s.value) for s in agents] == [("node-a", pytest.approx(_not_after(agent_pair)))]

        now = pki.now.timestamp()
        with structlog.testing.capture_logs() as logs:
            said = coord.check_certificates(now_s=now)
        assert [what for what, _ in said] == ["agent:node-a"]  # the server's 60 days are fine
        [event] = [e for e in logs if e["event"] == "agent_certificate_expires_soon"]
        assert event["node_id"] == "node-a" and event["detail"].startswith("expires in 4.0 days")
        assert coord.check_certificates(now_s=now + 3600) == []  # an hour later: said already today
        # 50 days on, the coordinator's own is in its last 10 days too, and the agent's has expired
        said = dict(coord.check_certificates(now_s=now + 50 * DAY))
        assert said["tls_cert_file"].startswith("expires in 10.0 days")
        assert said["agent:node-a"].startswith("expired 46.0 days ago")
    finally:
        await agent.stop()
        await running
        await coord.stop(grace_s=0.1)


# ---- an agent's own files ----------------------------------------------------------------------------


def test_a_running_agent_reminds_of_its_own_certificate_from_the_files_on_disk(tmp_path: Path) -> None:
    pki = Pki(tmp_path)
    soon, renewed = pki.issue("soon", days=3, server=False), pki.issue("renewed", days=90, server=False)
    cert_file = tmp_path / "agent.pem"
    shutil.copyfile(soon.cert_file, cert_file)
    files = [("ca_file", str(pki.ca_file)), ("cert_file", str(cert_file))]
    reminder = ExpiryReminder()
    now = pki.now.timestamp()
    with structlog.testing.capture_logs() as logs:
        said = agent_main.remind_certificates(files, reminder, now)
    assert said == [f"cert_file {cert_file}: the certificate expires in 3.0 days "
                    f"(notAfter {dt.datetime.fromtimestamp(_not_after(soon), dt.timezone.utc):%Y-%m-%d %H:%M:%S} UTC): renew it"]
    assert [e["event"] for e in logs] == ["tls_certificate_expires_soon"]
    assert agent_main.remind_certificates(files, reminder, now + 3600) == []
    assert len(agent_main.remind_certificates(files, reminder, now + DAY)) == 1
    shutil.copyfile(renewed.cert_file, cert_file)  # renewed on disk: taken at the next connection, and quiet
    assert agent_main.remind_certificates(files, reminder, now + 2 * DAY) == []
    cert_file.write_text("garbage")
    with structlog.testing.capture_logs() as logs:
        [said] = agent_main.remind_certificates(files, reminder, now + 2 * DAY)
    assert "cannot read the certificate" in said and logs[0]["event"] == "tls_credentials_unusable"


def _https_get(port: int, ca_file: Path, path: str = "/metrics") -> tuple[int, int, bytes]:
    """(status, serial of the certificate served, body) of one HTTPS GET, as
    Prometheus with ``scheme: https`` and ``tls_config.ca_file`` makes it."""
    context = ssl.create_default_context(cafile=str(ca_file))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with context.wrap_socket(raw, server_hostname="localhost") as tls:
            serial = x509.load_der_x509_certificate(tls.getpeercert(binary_form=True)).serial_number
            tls.sendall(f"GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode())
            reply = b""
            while chunk := tls.recv(65536):
                reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), serial, body


async def test_https_metrics_follow_renewed_files_and_refuse_plain_http(tmp_path: Path) -> None:
    """metrics_tls: /metrics is served over TLS with the coordinator's pair,
    and a renewal reaches it at the next handshake as it reaches the gRPC
    ports (one ServerTlsFiles); a plaintext scrape gets no exposition."""
    pki = Pki(tmp_path)
    old, new = pki.issue("old", days=30), pki.issue("new", days=90)
    cert_file, key_file = tmp_path / "server.pem", tmp_path / "server-key.pem"
    _install(old, cert_file, key_file)
    cfg = CoordinatorConfig(listen="127.0.0.1:0", metrics_listen="127.0.0.1:0", metrics_tls=True,
                            tls_cert_file=str(cert_file), tls_key_file=str(key_file))
    with structlog.testing.capture_logs() as logs:
        coord = Coordinator(cfg, security=_security(pki, cert_file, key_file))
        port = await coord.start()
    try:
        listening = next(e for e in logs if e["event"] == "metrics_listening")
        assert listening["scheme"] == "https"
        status, serial, body = await asyncio.to_thread(_https_get, coord.metrics_port, pki.ca_file)
        assert (status, serial) == (200, _serial(old))
        assert "gpulb_nodes" in {f.name for f in text_string_to_metric_families(body.decode())}

        def plain() -> bytes:
            with socket.create_connection(("127.0.0.1", coord.metrics_port), timeout=10) as raw:
                raw.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
                try:
                    return raw.recv(65536)
                except ConnectionError:
                    return b""

        assert b"gpulb_" not in await asyncio.to_thread(plain)

        _install(new, cert_file, key_file)
        await asyncio.sleep(1.1)
        _, serial, _ = await asyncio.to_thread(_https_get, coord.metrics_port, pki.ca_file)
        assert serial == _serial(new)
        assert await asyncio.to_thread(_served_serial, port, pki.ca_file) == _serial(new)  # one set of renewals
        assert coord.security.tls_files.reloads == 1
    finally:
        await coord.stop(grace_s=0.1)


def test_metrics_tls_needs_the_coordinator_certificate() -> None:
    with pytest.raises(ValueError, match="^metrics_tls: needs tls_cert_file"):
        CoordinatorConfig(metrics_listen="127.0.0.1:0", metrics_tls=True).validate()
