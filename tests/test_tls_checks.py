"""TLS credentials and tokens checked where they are read, before anything
listens or connects (QA pass):

* the coordinator refuses a key that is not its certificate's (gRPC said only
  "could not bind"), an expired or not yet valid certificate (every client
  then failed with CERTIFICATE_VERIFY_FAILED), with one line naming the
  options and files, exit 2; it warns of one that expires within 14 days;
* the agent does the same with its client certificate (it retried "Failed to
  create security handshaker" / "Socket closed" forever), naming the flag or
  the --config option, exit 2, and ``--check`` says the same words;
* the token tool refuses an overlong tenant, a tenant on an agent token and
  an empty token, and says what a tenant on an admin token means; the token
  file loader refuses the same;
* ``gpulb`` and ``gpulb-agent`` refuse a token file that holds no token gRPC
  can send (the coordinator's digest file given by mistake, an empty file),
  exit 2, instead of "Illegal metadata" or UNAUTHENTICATED.
"""

from __future__ import annotations

import datetime as dt
import io
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import structlog
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

import certs
from agent import main as agent_main
from coordinator import cli as gpulb_cli
from coordinator import main as coordinator_main
from coordinator import security
from coordinator.security import (
    Security,
    SecurityConfigError,
    ServerCredentialsConfig,
    TokenAuth,
    certificate_validity,
    check_certificate_and_key,
    check_client_credentials,
    hash_token,
    token_problem,
)

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1]
DEAD = "127.0.0.1:1"  # nothing listens: a check that passed would show as UNAVAILABLE, exit 1


@pytest.fixture(autouse=True)
def _keep_logging():
    """The daemons' main() points structlog at this test's captured stderr;
    put back what the tests after these expect."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


@dataclass(frozen=True)
class Creds:
    dir: Path
    ca: Path
    good: certs.CertPair  # valid for 90 days: no warning
    other: certs.CertPair  # another valid pair: its key does not match good's certificate
    expired: certs.CertPair
    future: certs.CertPair  # notBefore tomorrow
    soon: certs.CertPair  # expires in 3 days
    encrypted_key: Path  # good's key under a passphrase
    tokens: Path  # the coordinator's digest file (TOML)
    admin_token: str


@pytest.fixture(scope="module")
def creds(tmp_path_factory) -> Creds:
    d = tmp_path_factory.mktemp("tls")
    now = dt.datetime.now(dt.timezone.utc)
    ca_key, ca_cert = certs._ca("tls-check CA", now)
    ca = d / "ca.pem"
    ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))

    def leaf(stem: str, before: dt.timedelta, after: dt.timedelta) -> certs.CertPair:
        key, cert = certs._leaf(ca_key, ca_cert, "localhost", server=True, dns=["localhost", "node-a"], ips=["127.0.0.1"],
                                not_before=now + before, not_after=now + after)
        return certs._write(d, stem, key, cert)

    good = leaf("good", -dt.timedelta(hours=1), dt.timedelta(days=90))
    encrypted = d / "good-key-encrypted.pem"
    key = serialization.load_pem_private_key(good.key, None)
    encrypted.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                            serialization.BestAvailableEncryption(b"secret")))
    token = "gpulb_admin-token-for-tests"
    tokens = d / "tokens.toml"
    tokens.write_text(f'[tokens."{hash_token(token)}"]\nrole = "admin"\n')
    return Creds(
        dir=d, ca=ca, good=good,
        other=leaf("other", -dt.timedelta(hours=1), dt.timedelta(days=90)),
        expired=leaf("expired", -dt.timedelta(days=30), -dt.timedelta(days=2)),
        future=leaf("future", dt.timedelta(days=1), dt.timedelta(days=90)),
        soon=leaf("soon", -dt.timedelta(days=30), dt.timedelta(days=3)),
        encrypted_key=encrypted, tokens=tokens, admin_token=token,
    )


def _check(cert: Path, key: Path) -> list[str]:
    return check_certificate_and_key(cert, key, cert_option="tls_cert_file", key_option="tls_key_file")


# ---- the checks themselves ----------------------------------------------------------------------


def test_a_matching_valid_pair_passes_without_warnings(creds: Creds) -> None:
    assert _check(creds.good.cert_file, creds.good.key_file) == []
    assert check_client_credentials(creds.ca, creds.good.cert_file, creds.good.key_file) == []


def test_a_key_that_is_not_the_certificates_is_named_with_both_files(creds: Creds) -> None:
    with pytest.raises(SecurityConfigError) as err:
        _check(creds.good.cert_file, creds.other.key_file)
    text = str(err.value)
    assert f"tls_key_file {creds.other.key_file}" in text and f"tls_cert_file {creds.good.cert_file}" in text
    assert "do not match" in text
    # a key of another type (RSA for an EC certificate): OpenSSL words it otherwise, the check does not
    rsa_key = creds.dir / "rsa-key.pem"
    rsa_key.write_bytes(rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    with pytest.raises(SecurityConfigError, match=f"tls_key_file {rsa_key} is not the private key of tls_cert_file"):
        _check(creds.good.cert_file, rsa_key)


def test_expired_and_not_yet_valid_certificates_are_refused_with_their_dates(creds: Creds) -> None:
    with pytest.raises(SecurityConfigError, match=r"expired: notAfter \d{4}-\d\d-\d\d .*UTC \(2\.0 days ago\)") as err:
        _check(creds.expired.cert_file, creds.expired.key_file)
    assert str(creds.expired.cert_file) in str(err.value)
    with pytest.raises(SecurityConfigError, match=r"not valid yet: notBefore \d{4}-\d\d-\d\d") as err:
        _check(creds.future.cert_file, creds.future.key_file)
    assert str(creds.future.cert_file) in str(err.value)


def test_a_certificate_expiring_within_14_days_is_a_warning(creds: Creds) -> None:
    [warning] = _check(creds.soon.cert_file, creds.soon.key_file)
    assert str(creds.soon.cert_file) in warning and "expires in 3.0 days" in warning and "notAfter" in warning


def test_an_encrypted_key_is_refused_without_a_passphrase_prompt(creds: Creds) -> None:
    with pytest.raises(SecurityConfigError, match="encrypted") as err:
        _check(creds.good.cert_file, creds.encrypted_key)
    assert str(creds.encrypted_key) in str(err.value)


def test_unreadable_and_half_given_files_name_the_option(creds: Creds, tmp_path: Path) -> None:
    with pytest.raises(SecurityConfigError, match="cannot read --cert-file"):
        check_client_credentials(None, tmp_path / "nope.pem", creds.good.key_file)
    with pytest.raises(SecurityConfigError, match="--cert-file .* needs --key-file"):
        check_client_credentials(None, creds.good.cert_file, None)
    with pytest.raises(SecurityConfigError, match="not PEM"):
        check_client_credentials(creds.good.key_file, None, None)  # a key given as the CA


def test_the_dates_read_without_cryptography_too(creds: Creds, monkeypatch) -> None:
    with_cryptography = certificate_validity(creds.soon.cert_file)
    monkeypatch.setitem(sys.modules, "cryptography", None)  # `from cryptography import x509` -> ImportError
    without = certificate_validity(creds.soon.cert_file)
    assert [abs((a - b).total_seconds()) < 1 for a, b in zip(with_cryptography, without)] == [True, True]
    with pytest.raises(SecurityConfigError, match="expired"):
        _check(creds.expired.cert_file, creds.expired.key_file)


# ---- the coordinator -----------------------------------------------------------------------------


def _coordinator(creds: Creds, cert: Path, key: Path, capsys) -> tuple[int, str]:
    code = coordinator_main.main(["--listen", "127.0.0.1:0", "--tls-cert-file", str(cert), "--tls-key-file", str(key),
                                  "--token-file", str(creds.tokens), "--log-format", "console"])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("case, needle", [
    ("mismatch", "is not the private key of tls_cert_file"),
    ("expired", "the certificate has expired: notAfter"),
    ("future", "the certificate is not valid yet: notBefore"),
])
def test_the_coordinator_refuses_bad_server_credentials_at_start(creds: Creds, capsys, case: str, needle: str) -> None:
    cert, key = {
        "mismatch": (creds.good.cert_file, creds.other.key_file),
        "expired": (creds.expired.cert_file, creds.expired.key_file),
        "future": (creds.future.cert_file, creds.future.key_file),
    }[case]
    code, err = _coordinator(creds, cert, key, capsys)
    assert code == 2, err
    assert needle in err and str(cert) in err and "could not bind" not in err and "Traceback" not in err
    if case == "mismatch":
        assert f"tls_key_file {key}" in err


def test_the_coordinator_process_says_one_line_not_a_bind_error(creds: Creds) -> None:
    """As the QA pass ran it: a process, gRPC's own stderr included."""
    out = subprocess.run(
        [sys.executable, "-m", "coordinator.main", "--listen", "127.0.0.1:0", "--tls-cert-file", str(creds.good.cert_file),
         "--tls-key-file", str(creds.other.key_file), "--token-file", str(creds.tokens)],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )
    assert out.returncode == 2, out.stderr
    assert "listen_failed" not in out.stderr and "Handshaker" not in out.stderr and "TSI_" not in out.stderr
    [line] = [line for line in out.stderr.splitlines() if line.strip()]
    assert line.startswith("gpulb-coordinator: ") and "tls_key_file" in line and str(creds.good.cert_file) in line


def test_the_coordinator_warns_of_a_certificate_expiring_soon(creds: Creds) -> None:
    tokens = TokenAuth.from_file(creds.tokens)
    with structlog.testing.capture_logs() as logs:
        Security(tokens=tokens, tls=ServerCredentialsConfig(str(creds.soon.cert_file), str(creds.soon.key_file), str(creds.ca)))
    [warning] = [e for e in logs if e["log_level"] == "warning"]
    assert warning["event"] == "tls_certificate_expires_soon" and "expires in 3.0 days" in warning["detail"]
    with structlog.testing.capture_logs() as logs:
        Security(tokens=tokens, tls=ServerCredentialsConfig(str(creds.good.cert_file), str(creds.good.key_file), str(creds.ca)))
    assert [e for e in logs if e["log_level"] == "warning"] == []
    with pytest.raises(SecurityConfigError, match="tls_client_ca_file"):
        Security(tokens=tokens, tls=ServerCredentialsConfig(str(creds.good.cert_file), str(creds.good.key_file),
                                                            str(creds.good.key_file)))


# ---- the agent -----------------------------------------------------------------------------------


def _agent(argv: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as info:
        agent_main.main(["--backend", "sim", "--node-id", "node-a", "--coordinator", DEAD, *argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return info.value.code, err


def _agent_check(argv: list[str], capsys) -> tuple[int, str]:
    code = agent_main.main(["--check", "--check-rounds", "1", "--backend", "sim", "--node-id", "node-a", "--coordinator", DEAD, *argv])
    return code, capsys.readouterr().out


def _agent_tls(creds: Creds, cert: certs.CertPair | Path, key: Path | None = None) -> list[str]:
    cert_file = cert.cert_file if isinstance(cert, certs.CertPair) else cert
    key_file = key if key is not None else cert.key_file
    return ["--ca-file", str(creds.ca), "--cert-file", str(cert_file), "--key-file", str(key_file)]


@pytest.mark.parametrize("case, needle", [
    ("mismatch", "is not the private key of --cert-file"),
    ("expired", "the certificate has expired: notAfter"),
    ("future", "the certificate is not valid yet: notBefore"),
    ("unreadable", "cannot read --key-file"),
])
def test_the_agent_exits_2_naming_the_flag_and_check_says_the_same(creds: Creds, capsys, tmp_path: Path, case: str,
                                                                   needle: str) -> None:
    argv = {
        "mismatch": _agent_tls(creds, creds.good, creds.other.key_file),
        "expired": _agent_tls(creds, creds.expired),
        "future": _agent_tls(creds, creds.future),
        "unreadable": _agent_tls(creds, creds.good, tmp_path / "missing-key.pem"),
    }[case]
    code, err = _agent(argv, capsys)
    assert code == agent_main.EXIT_USAGE == 2
    [line] = err.strip().splitlines()
    assert line.startswith("gpulb-agent: error: ") and needle in line, line
    detail = line.removeprefix("gpulb-agent: error: ")
    code, out = _agent_check(argv, capsys)
    assert code == 1 and f"coordinator: NOT READY: {detail}" in out, out


def test_the_agent_names_the_config_option_and_file(creds: Creds, capsys, tmp_path: Path) -> None:
    config = tmp_path / "agent.toml"
    config.write_text(f'[agent]\nca_file = "{creds.ca}"\ncert_file = "{creds.good.cert_file}"\nkey_file = "{creds.other.key_file}"\n')
    code, err = _agent(["--config", str(config)], capsys)
    assert code == 2
    assert f"{config}: key_file {creds.other.key_file} is not the private key of cert_file {creds.good.cert_file}" in err, err
    config.write_text(f'[agent]\ncert_file = "{creds.good.cert_file}"\n')
    code, err = _agent(["--config", str(config)], capsys)
    assert code == 2 and f"cert_file {creds.good.cert_file} needs key_file" in err, err


def test_the_agent_warns_of_its_certificate_expiring_soon_and_goes_on(creds: Creds) -> None:
    args = agent_main.parse_args(["--backend", "sim", *_agent_tls(creds, creds.soon)])
    problem, warnings = agent_main._credentials(args, agent_main._settings(args))
    assert problem is None
    assert len(warnings) == 1 and "--cert-file" in warnings[0] and "expires in 3.0 days" in warnings[0]


async def test_a_running_agent_says_why_when_its_certificate_goes_bad(creds: Creds) -> None:
    """Checked at start; one that expires while the agent runs is named on each reconnect."""
    from agent.client import Agent, AgentConfig
    from agent.sim import SimBackend

    config = AgentConfig(node_id="node-a", ca_file=str(creds.ca), cert_file=str(creds.expired.cert_file),
                         key_file=str(creds.expired.key_file))
    agent = Agent(config, SimBackend(gpus=1, seed=1, workload="idle", node_id="node-a"))
    with structlog.testing.capture_logs() as logs:
        channel = agent._default_channel(DEAD)
    await channel.close()
    [event] = [e for e in logs if e["event"] == "tls_credentials_unusable"]
    assert f"cert_file {creds.expired.cert_file}: the certificate has expired" in event["error"]
    config.cert_file, config.key_file = str(creds.good.cert_file), str(creds.good.key_file)
    with structlog.testing.capture_logs() as logs:
        channel = agent._default_channel(DEAD)
    await channel.close()
    assert logs == []


@pytest.mark.parametrize("content, needle", [
    ("", "it is empty"),
    (None, "coordinator's token digest file"),  # the coordinator's tokens.toml
    (hash_token("x") + "\n", "holds a token digest"),
    ("tok-a\ntok-b\n", "holds 2 lines"),
    ("tok en\n", "character 4 is ' '"),
])
def test_the_agent_refuses_a_token_file_without_a_token(creds: Creds, capsys, tmp_path: Path, content, needle) -> None:
    path = creds.tokens if content is None else tmp_path / "token"
    if content is not None:
        path.write_text(content)
    code, err = _agent(["--token-file", str(path)], capsys)
    assert code == 2 and f"--token-file {path}: " in err and needle in err, err
    code, out = _agent_check(["--token-file", str(path)], capsys)
    assert code == 1 and "NOT READY: --token-file" in out and needle in out, out


# ---- the CLI's token file -------------------------------------------------------------------------


@pytest.mark.parametrize("content, needle", [
    ("", "it is empty"),
    (None, "looks like the coordinator's token digest file"),
    ('{"tokens": {"sha256:' + "0" * 64 + '": {"role": "admin"}}}', "looks like the coordinator's token digest file"),
    ("tok\u00e9\n", "character 4 is 'é'"),
])
def test_the_cli_refuses_a_token_file_without_a_token(creds: Creds, capsys, tmp_path: Path, monkeypatch, content, needle) -> None:
    path = creds.tokens if content is None else tmp_path / "token"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exc:
        gpulb_cli.main(["--coordinator", DEAD, "--token-file", str(path), "nodes"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and repr(str(path)) in err and "(--token-file)" in err and needle in err, err
    assert "UNAUTHENTICATED" not in err and "metadata" not in err.lower().replace("grpc metadata", "")
    monkeypatch.setenv("GPULB_TOKEN_FILE", str(path))
    with pytest.raises(SystemExit) as exc:
        gpulb_cli.main(["--coordinator", DEAD, "nodes"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "(env GPULB_TOKEN_FILE)" in err and needle in err, err


def test_the_cli_sends_a_good_token_file(capsys, tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("gpulb_Ab-9_x.~+/=\n")  # what base64 and URL-safe tokens hold
    assert gpulb_cli.main(["--coordinator", DEAD, "--token-file", str(path), "nodes"]) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err  # got as far as the RPC


# ---- the token tool and the token file ---------------------------------------------------------------


def test_token_problem() -> None:
    assert token_problem("gpulb_" + "A" * 43) is None
    assert "empty" in token_problem("")
    assert "holds 2 lines" in token_problem("a\nb")
    assert "digest file" in token_problem('[tokens."sha256:' + "a" * 64 + '"]\nrole = "admin"')


def test_new_token_refuses_an_overlong_tenant_and_a_tenant_on_an_agent(capsys) -> None:
    for argv, needle in [
        (["--role", "tenant", "--tenant", "a" * 300], "longer than 128 characters (300)"),
        (["--role", "tenant", "--tenant", "a\tb"], "control characters"),
        (["--role", "agent", "--tenant", "alice"], "an agent token has no tenant"),
    ]:
        with pytest.raises(SystemExit) as exc:
            security.main(["new-token", *argv])
        out, err = capsys.readouterr()
        assert exc.value.code == 2 and needle in err and out == "", err
    assert security.main(["new-token", "--role", "tenant", "--tenant", "a" * 128]) == 0
    capsys.readouterr()


def test_new_token_says_what_a_tenant_on_an_admin_token_means(capsys) -> None:
    assert security.main(["new-token", "--role", "admin", "--tenant", "alice"]) == 0
    out, err = capsys.readouterr()
    assert "not limited to --tenant 'alice'" in err and "default of what it submits" in err
    assert 'role = "admin"' in out and 'tenant = "alice"' in out


def test_hash_token_refuses_an_empty_token(capsys, monkeypatch) -> None:
    for text in ("", "\n", "   \n"):
        monkeypatch.setattr(sys, "stdin", io.StringIO(text))
        assert security.main(["hash-token"]) == 2
        out, err = capsys.readouterr()
        assert out == "" and "empty" in err
    monkeypatch.setattr(sys, "stdin", io.StringIO("tok-a\n"))
    assert security.main(["hash-token"]) == 0
    assert capsys.readouterr().out.strip() == hash_token("tok-a")


def test_the_token_file_loader_refuses_the_same(tmp_path: Path) -> None:
    def load(spec: dict) -> TokenAuth:
        path = tmp_path / "tokens.json"
        path.write_text(json.dumps({"tokens": {hash_token("t"): spec}}))
        return TokenAuth.from_file(path)

    with pytest.raises(SecurityConfigError, match=r"tokens\.'sha256:[0-9a-f]{64}'\.tenant: longer than 128") as err:
        load({"role": "tenant", "tenant": "a" * 129})
    assert str(tmp_path / "tokens.json") in str(err.value)
    with pytest.raises(SecurityConfigError, match="tenant: an agent token has no tenant"):
        load({"role": "agent", "tenant": "alice"})
    with pytest.raises(SecurityConfigError, match="control characters"):
        load({"role": "tenant", "tenant": "al\nice"})
    # an admin's tenant is the default tenant of its submissions: kept
    identity = load({"role": "admin", "tenant": "alice"}).authenticate((("authorization", "Bearer t"),), admin=True)
    assert identity.admin and security.tenant_for_submission(identity, "") == "alice"


def test_an_expired_or_expiring_ca_file_is_checked_like_a_certificate(creds: Creds) -> None:
    """An expired CA fails every handshake it should vouch for, as an expired
    certificate does: refused at start naming the option; one expiring within
    14 days is a warning. (The leaves stand in for CA files: only the dates
    are read.)"""
    from coordinator.security import check_client_credentials

    with pytest.raises(SecurityConfigError, match=r"--ca-file .*: the CA certificate has expired: notAfter"):
        check_client_credentials(creds.expired.cert_file, None, None)
    [warning] = check_client_credentials(creds.soon.cert_file, None, None)
    assert "--ca-file" in warning and "the CA certificate expires in 3.0 days" in warning
    assert check_client_credentials(creds.ca, None, None) == []
    server = ServerCredentialsConfig(str(creds.good.cert_file), str(creds.good.key_file), str(creds.expired.cert_file))
    with pytest.raises(SecurityConfigError, match=r"tls_client_ca_file .*: the CA certificate has expired"):
        server.check()
