"""A throw-away PKI for tests, generated with ``cryptography``.

``make_test_pki(directory, node_ids)`` writes PEM files and returns their paths:

* ``ca``: the trusted CA (``ca.pem``; its key stays in memory only)
* ``server``: a server certificate for ``localhost`` / ``127.0.0.1`` / ``::1``
* ``agents[node_id]``: one client certificate per node, CN = SAN DNS = node id
* ``client``: a plain client certificate (CN ``client``), for token callers
  that also want to present one
* ``expired``: a client certificate for ``node_ids[0]`` that expired yesterday
* ``wrong_ca`` / ``rogue``: a second, untrusted CA and a client certificate it
  issued for ``node_ids[0]``
* ``rogue_server``: a server certificate from the untrusted CA (a client
  pinned to ``ca`` must refuse it)

EC P-256 keys keep generation at a few milliseconds per certificate.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["CertPair", "TestPki", "make_test_pki"]


@dataclass(frozen=True)
class CertPair:
    cert_file: Path
    key_file: Path

    @property
    def cert(self) -> bytes:
        return self.cert_file.read_bytes()

    @property
    def key(self) -> bytes:
        return self.key_file.read_bytes()


@dataclass
class TestPki:
    __test__ = False  # not a pytest class

    directory: Path
    ca_file: Path
    server: CertPair
    client: CertPair
    expired: CertPair
    wrong_ca_file: Path
    rogue: CertPair
    rogue_server: CertPair
    agents: dict[str, CertPair] = field(default_factory=dict)

    @property
    def ca(self) -> bytes:
        return self.ca_file.read_bytes()


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "gpulb-test"), x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _ca(cn: str, now: dt.datetime):
    key = _key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(_name(cn))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=1))
        .not_valid_after(now + dt.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
            decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _leaf(ca_key, ca_cert, cn: str, *, server: bool, dns: list[str], ips: list[str] = (),
          not_before: dt.datetime, not_after: dt.datetime):
    key = _key()
    sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
    sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def _write(directory: Path, stem: str, key, cert) -> CertPair:
    cert_file = directory / f"{stem}.pem"
    key_file = directory / f"{stem}-key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    key_file.chmod(0o600)
    return CertPair(cert_file, key_file)


def make_test_pki(directory: str | Path, node_ids: tuple[str, ...] | list[str] = ("node-a", "node-b")) -> TestPki:
    """Generate the test PKI under ``directory`` (see module docstring)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.timezone.utc)
    valid = dict(not_before=now - dt.timedelta(hours=1), not_after=now + dt.timedelta(days=7))

    ca_key, ca_cert = _ca("gpulb test CA", now)
    ca_file = directory / "ca.pem"
    ca_file.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    server = _write(directory, "server", *_leaf(ca_key, ca_cert, "localhost", server=True, dns=["localhost"], ips=["127.0.0.1", "::1"], **valid))
    client = _write(directory, "client", *_leaf(ca_key, ca_cert, "client", server=False, dns=[], **valid))
    agents = {
        node: _write(directory, f"agent-{i}", *_leaf(ca_key, ca_cert, node, server=False, dns=[node], **valid))
        for i, node in enumerate(node_ids)
    }
    expired = _write(directory, "expired", *_leaf(
        ca_key, ca_cert, node_ids[0], server=False, dns=[node_ids[0]],
        not_before=now - dt.timedelta(days=3), not_after=now - dt.timedelta(days=1)))

    wrong_key, wrong_cert = _ca("gpulb rogue CA", now)
    wrong_ca_file = directory / "wrong-ca.pem"
    wrong_ca_file.write_bytes(wrong_cert.public_bytes(serialization.Encoding.PEM))
    rogue = _write(directory, "rogue", *_leaf(wrong_key, wrong_cert, node_ids[0], server=False, dns=[node_ids[0]], **valid))
    rogue_server = _write(directory, "rogue-server", *_leaf(wrong_key, wrong_cert, "localhost", server=True, dns=["localhost"], ips=["127.0.0.1"], **valid))
    return TestPki(
        directory=directory, ca_file=ca_file, server=server, client=client, expired=expired,
        wrong_ca_file=wrong_ca_file, rogue=rogue, rogue_server=rogue_server, agents=agents,
    )
