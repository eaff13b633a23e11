"""TLS, mutual TLS for agents, bearer tokens for clients, and limits.

Transport
    ``ServerCredentialsConfig`` reads PEM files into ``grpc.ServerCredentials``.
    grpcio's Python API has exactly two client-certificate modes:
    ``require_client_auth=True`` (request, require and verify a client
    certificate) and ``False``, which maps to "don't request" - the client then
    never sends a certificate and ``auth_context()`` holds none. There is no
    "request and verify if present" mode in Python. So agents, which must prove
    their node id with a certificate, and token clients, which may have no
    certificate, are served on two ports of the same server:

    * the client port (``client_credentials()``): TLS, no client certificate,
      every call carries ``authorization: Bearer <token>``;
    * the agent port (``agent_credentials()``): TLS that requires a client
      certificate from ``client_ca_file`` (wrong CA, expired, none: the
      handshake fails, the caller sees UNAVAILABLE).

    ``Security.add_ports`` does this. With one port only, that port requires
    client certificates from every caller when agent certificates are required.
    An agent stream is accepted only when the peer's verified certificate names
    the node it registers as (CN or a SAN DNS name), so a stream on the client
    port - no certificate - or with another node's certificate is refused.

Tokens
    A token file (TOML or JSON) maps SHA-256 digests of tokens to a role and a
    tenant; the file never holds a token itself (``python -m
    coordinator.security new-token`` makes one)::

        [tokens."sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"]
        name = "alice-ci"        # for logs and rate limits; default: role:tenant
        tenant = "alice"         # required for role "tenant"
        role = "tenant"          # "admin" | "tenant" | "agent" | "metrics"
        # nodes = ["gpu-01"]     # agent tokens: node ids it may register as (default any)

    Roles: ``admin`` may do everything, for every tenant (SetPolicy, cordon,
    drain need it); ``tenant`` may submit, see, complete, renew and cancel the
    tasks of its own tenant and read the cluster view; ``agent`` may only open
    agent streams (used when agent certificates are not required); ``metrics``
    may only read ``/metrics`` (with ``metrics_auth = "token"``: Prometheus'
    ``authorization.credentials_file``), no gRPC call.

Errors
    Checks raise ``AuthError(code, message)``. ``SecurityInterceptor`` turns an
    ``AuthError`` raised anywhere in a handler - including from synchronous
    hooks, which cannot ``await context.abort`` - into that status, and applies
    the per-client RPC rate limit and the per-stream message rate limit.

Insecure mode (plaintext, no authentication) exists only when asked for with
``insecure=True`` and is logged as a warning at start.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import datetime as dt
import hashlib
import hmac
import inspect
import json
import math
import re
import secrets
import ssl
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterable, Mapping, Sequence

import grpc
import structlog

from scheduler.task import MAX_TENANT_LEN, Task, TaskSpec, TaskState

__all__ = [
    "AuthError",
    "TenantRefusal",
    "SecurityConfigError",
    "Identity",
    "ROLES",
    "INSECURE_IDENTITY",
    "hash_token",
    "generate_token",
    "token_problem",
    "bearer_token",
    "bearer_metadata",
    "TokenAuth",
    "require_admin",
    "check_tenant",
    "check_priority",
    "tenant_for_submission",
    "visible_tenant",
    "has_client_certificate",
    "certificate_names",
    "node_identity_matches",
    "check_node_certificate",
    "ServerCredentialsConfig",
    "CERT_EXPIRY_WARNING_DAYS",
    "certificate_validity",
    "check_certificate_and_key",
    "check_client_credentials",
    "channel_credentials",
    "TokenBucket",
    "RateLimiter",
    "MessageRateLimit",
    "TenantQuota",
    "check_queued_limit",
    "StreamSlots",
    "StreamSlot",
    "client_key",
    "Security",
    "SecurityInterceptor",
]

log = structlog.get_logger("gpulb.security")

ROLES = ("admin", "tenant", "agent", "metrics")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class AuthError(Exception):
    """A refused call: ``code`` is the gRPC status to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    async def abort(self, context) -> None:
        await context.abort(self.code, self.message)

    def __repr__(self) -> str:
        return f"AuthError({self.code.name}, {self.message!r})"


class TenantRefusal(AuthError):
    """A submission refused by a per-tenant limit: ``tenant`` is the tenant
    it was for and ``limit`` the option that refused it
    (``max_queued_per_tenant``, ``tenant_max_priority``), for the
    per-tenant refusal counts (``gpulb_tenant_quota_refusals_total``)."""

    def __init__(self, code: grpc.StatusCode, message: str, *, tenant: str, limit: str) -> None:
        super().__init__(code, message)
        self.tenant = tenant
        self.limit = limit


class SecurityConfigError(ValueError):
    """A bad security file or setting; the message names the file and field."""


@dataclass(frozen=True, slots=True)
class Identity:
    """Who is calling. ``tenant`` is empty for an admin not bound to a tenant."""

    tenant: str
    admin: bool
    name: str
    role: str = "tenant"
    nodes: frozenset[str] | None = None  # agent tokens: allowed node ids (None: any)


INSECURE_IDENTITY = Identity(tenant="", admin=True, name="insecure", role="admin")


def _unauthenticated(message: str) -> AuthError:
    return AuthError(grpc.StatusCode.UNAUTHENTICATED, message)


def _denied(message: str) -> AuthError:
    return AuthError(grpc.StatusCode.PERMISSION_DENIED, message)


def _exhausted(message: str) -> AuthError:
    return AuthError(grpc.StatusCode.RESOURCE_EXHAUSTED, message)


# ---- tokens ------------------------------------------------------------------------------------


def hash_token(token: str) -> str:
    """The file form of a token: ``sha256:<hex digest of its UTF-8 bytes>``."""
    return "sha256:" + hashlib.sha256(token.encode("utf-8")).hexdigest()


def generate_token() -> str:
    """A new random token (256 bits, URL-safe)."""
    return "gpulb_" + secrets.token_urlsafe(32)


#: what a bearer token may hold: one line of printable ASCII without spaces
#: (gRPC refuses other header bytes as "Illegal metadata")
_TOKEN_TEXT = re.compile(r"[\x21-\x7e]+")
#: the marks of a coordinator token file (TOML or JSON of digests), not a token
_DIGEST_FILE = re.compile(r"sha256:[0-9a-fA-F]{16}|\[\s*tokens|\"tokens\"\s*:|^\s*(role|tenant|name|nodes)\s*=", re.MULTILINE)


def token_problem(text: str) -> str | None:
    """Why ``text`` (a token file's contents, surrounding whitespace
    stripped) cannot be sent as a bearer token, else None: empty, the
    coordinator's digest file given by mistake, a digest instead of the token,
    or bytes a gRPC header cannot carry."""
    if not text:
        return "it is empty: it should hold the bearer token on one line"
    if _DIGEST_FILE.search(text):
        if re.fullmatch(r"sha256:[0-9a-fA-F]{64}", text):
            return ("it holds a token digest (sha256:...), not the token: give the token that "
                    "`python -m coordinator.security new-token` printed")
        return ("it looks like the coordinator's token digest file ([tokens.\"sha256:...\"] entries), not a token: "
                "give the file holding the token that `python -m coordinator.security new-token` printed")
    if not _TOKEN_TEXT.fullmatch(text):
        rule = "a token is one line of printable ASCII without spaces (what a gRPC header carries)"
        lines = text.count("\n") + 1
        if lines > 1:
            return f"it holds {lines} lines: {rule}"
        column = next(i for i, char in enumerate(text, 1) if not "\x21" <= char <= "\x7e")
        return f"character {column} is {text[column - 1]!r}: {rule}"
    return None


def read_token_file(path: str | Path) -> str:
    """The bearer token a client's token file holds (its first line, stripped):
    OSError if unreadable, ValueError (SecurityConfigError, UnicodeDecodeError)
    when it holds no token gRPC can send (empty, the coordinator's digest file)."""
    with open(path) as fh:
        token = fh.read().strip()
    problem = token_problem(token)
    if problem:
        raise SecurityConfigError(problem)
    return token


def _tenant_problem(tenant: str) -> str | None:
    """Why ``tenant`` cannot be a task tenant (the limits TaskSpec applies), else None."""
    if len(tenant) > MAX_TENANT_LEN:
        return f"longer than {MAX_TENANT_LEN} characters ({len(tenant)}), the most a task's tenant may be"
    if not tenant.isprintable():
        return "contains control characters"
    return None


def _metadata_items(metadata) -> Iterable[tuple[str, Any]]:
    for item in metadata or ():
        key, value = item[0], item[1]
        yield key, value


def bearer_token(metadata) -> str | None:
    """The token of an ``authorization: Bearer <token>`` entry, else None."""
    for key, value in _metadata_items(metadata):
        if key.lower() != "authorization":
            continue
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        scheme, _, token = value.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    return None


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying ``token`` (for plaintext channels in insecure mode
    and tests; over TLS prefer ``channel_credentials(token=...)``)."""
    return (("authorization", f"Bearer {token}"),)


@dataclass(frozen=True, slots=True)
class _Entry:
    digest: bytes
    identity: Identity


class TokenAuth:
    """Bearer tokens -> identities, from digests only (see module docstring)."""

    def __init__(self, entries: Iterable[_Entry], source: str = "<memory>") -> None:
        self._entries = tuple(entries)
        self._entry_set = frozenset(self._entries)
        self.source = source
        seen: set[bytes] = set()
        for entry in self._entries:
            if entry.digest in seen:
                raise SecurityConfigError(f"{source}: a token digest appears twice")
            seen.add(entry.digest)

    def __len__(self) -> int:
        return len(self._entries)

    # ---- loading -------------------------------------------------------------------
    @classmethod
    def from_file(cls, path: str | Path) -> "TokenAuth":
        """Read a TOML (``.toml``) or JSON file ``{"tokens": {"sha256:...": {...}}}``."""
        path = Path(path)
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise SecurityConfigError(f"{path}: cannot read token file: {exc.strerror}") from None
        try:
            if path.suffix.lower() == ".json":
                data = json.loads(raw)
            else:
                data = tomllib.loads(raw.decode("utf-8"))
        except (ValueError, UnicodeDecodeError) as exc:
            raise SecurityConfigError(f"{path}: not valid {'JSON' if path.suffix.lower() == '.json' else 'TOML'}: {exc}") from None
        return cls.from_mapping(data, source=str(path))

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], source: str = "<memory>") -> "TokenAuth":
        if not isinstance(data, Mapping) or not isinstance(data.get("tokens"), Mapping):
            raise SecurityConfigError(f"{source}: expected a 'tokens' table of digest -> {{tenant, role}}")
        unknown = set(data) - {"tokens"}
        if unknown:
            raise SecurityConfigError(f"{source}: unknown top-level keys {sorted(unknown)}")
        entries = []
        for key, spec in data["tokens"].items():
            where = f"{source}: tokens.{key!r}"
            digest = key.lower().removeprefix("sha256:")
            if not _HEX64.match(digest):
                raise SecurityConfigError(f"{where}: key must be 'sha256:' + 64 hex digits of the token's SHA-256 (never the token itself)")
            if not isinstance(spec, Mapping):
                raise SecurityConfigError(f"{where}: expected a table with role and tenant")
            extra = set(spec) - {"role", "tenant", "name", "nodes"}
            if extra:
                raise SecurityConfigError(f"{where}: unknown fields {sorted(extra)}")
            role = spec.get("role", "tenant")
            if role not in ROLES:
                raise SecurityConfigError(f"{where}.role: must be one of {ROLES}, got {role!r}")
            tenant = spec.get("tenant", "")
            if not isinstance(tenant, str) or (role == "tenant" and not tenant):
                raise SecurityConfigError(f"{where}.tenant: a non-empty string is required for role 'tenant'")
            problem = _tenant_problem(tenant)
            if problem:
                raise SecurityConfigError(f"{where}.tenant: {problem}")
            if role == "agent" and tenant:
                raise SecurityConfigError(f"{where}.tenant: an agent token has no tenant (it may only open agent streams); remove the field")
            if role == "metrics" and tenant:
                raise SecurityConfigError(f"{where}.tenant: a metrics token has no tenant (it may only read /metrics); remove the field")
            nodes = spec.get("nodes")
            if nodes is not None:
                if role != "agent" or not isinstance(nodes, list) or not all(isinstance(n, str) and n for n in nodes):
                    raise SecurityConfigError(f"{where}.nodes: a list of node ids, for role 'agent' only")
                nodes = frozenset(nodes)
            name = spec.get("name") or f"{role}:{tenant or '*'}:{digest[:8]}"
            if not isinstance(name, str):
                raise SecurityConfigError(f"{where}.name: must be a string")
            identity = Identity(tenant=tenant, admin=role == "admin", name=name, role=role, nodes=nodes)
            entries.append(_Entry(bytes.fromhex(digest), identity))
        return cls(entries, source)

    @classmethod
    def from_tokens(cls, tokens: Mapping[str, Mapping[str, Any]]) -> "TokenAuth":
        """From plaintext tokens (tests, tooling): token -> {tenant, role, name}."""
        return cls.from_mapping({"tokens": {hash_token(t): dict(v) for t, v in tokens.items()}})

    # ---- checking ------------------------------------------------------------------
    def credential(self, metadata) -> _Entry | None:
        """The entry of the call's token (its digest and identity), or None
        (missing or unknown): what a stream opened with it is checked against
        when the token file is reloaded (``holds``)."""
        token = bearer_token(metadata)
        if token is None:
            return None
        digest = hashlib.sha256(token.encode("utf-8")).digest()
        found = None
        for entry in self._entries:  # no early exit: the time does not depend on which entry matched
            if hmac.compare_digest(digest, entry.digest):
                found = entry
        return found

    def identify(self, metadata) -> Identity | None:
        """The identity of the call's token, or None (missing or unknown)."""
        entry = self.credential(metadata)
        return None if entry is None else entry.identity

    def holds(self, credential: _Entry) -> bool:
        """Whether this file still grants ``credential`` as it was (the same
        token with the same role, tenant, name and nodes)."""
        return credential in self._entry_set

    def names_not_in(self, other: "TokenAuth") -> list[str]:
        """The names of this file's tokens that ``other`` does not grant as
        they were (removed, or their role, tenant or nodes changed)."""
        return sorted(entry.identity.name for entry in self._entries if not other.holds(entry))

    def authenticate(self, metadata, *, admin: bool = False, roles: Sequence[str] = ("admin", "tenant")) -> Identity:
        """The caller's identity; ``AuthError`` UNAUTHENTICATED (no token, unknown
        token) or PERMISSION_DENIED (role not in ``roles``, or not admin when
        ``admin``)."""
        if bearer_token(metadata) is None:
            raise _unauthenticated("missing credentials: send metadata 'authorization: Bearer <token>'")
        identity = self.identify(metadata)
        if identity is None:
            raise _unauthenticated("unknown bearer token")
        if identity.role not in roles and not identity.admin:
            raise _denied(f"token {identity.name!r} has role {identity.role!r}; this call needs {' or '.join(roles)}")
        if admin:
            require_admin(identity)
        return identity


def require_admin(identity: Identity) -> None:
    if not identity.admin:
        raise _denied(f"this call needs an admin token; {identity.name!r} has role {identity.role!r}")


def check_tenant(identity: Identity, task_tenant: str, task_id: str = "") -> None:
    """PERMISSION_DENIED unless ``identity`` may act on tasks of ``task_tenant``.

    The message names the caller and the task, never the tenant that owns
    it: ids are one namespace across tenants, and a tenant who guesses
    another's id learns that it is taken (as ScheduleTask's ALREADY_EXISTS
    "taken" says) but not whose it is (QA pass 25). PERMISSION_DENIED, not
    NOT_FOUND: with one id namespace the id does exist (a ScheduleTask of it
    says so), so NOT_FOUND would hide nothing and tell a client that its
    retry may make the id its own."""
    if identity.admin or (identity.tenant and hmac.compare_digest(identity.tenant.encode(), task_tenant.encode())):
        return
    task = f"task {task_id!r}" if task_id else "this task"
    raise _denied(f"token {identity.name!r} (tenant {identity.tenant!r}) cannot act on {task}: it belongs to another "
                  "tenant (task ids are shared by every tenant)")


def check_priority(identity: Identity, spec: TaskSpec, most_urgent: int | None, field: str = "spec.priority") -> None:
    """PERMISSION_DENIED (a ``TenantRefusal``) when a tenant token submits
    ``spec`` in a class more urgent than ``most_urgent`` (0 = P0), its
    tenant's ``tenant_max_priority``; admins are not limited. ``field``
    names the priority in the request (``specs[3].priority`` in a batch)."""
    if identity.admin or most_urgent is None or int(spec.priority) >= most_urgent:
        return
    allowed = "P3 only" if most_urgent == 3 else f"P{most_urgent} to P3"
    raise TenantRefusal(
        grpc.StatusCode.PERMISSION_DENIED,
        f"{field}: tenant {spec.tenant!r} may submit {allowed} (tenant_max_priority), got P{int(spec.priority)}; "
        "submit it in an allowed class, or ask an operator",
        tenant=spec.tenant, limit="tenant_max_priority",
    )


def tenant_for_submission(identity: Identity, requested: str) -> str:
    """The tenant a submission runs as: a tenant token fixes it (an empty spec
    tenant becomes the token's, another tenant is refused); an admin's spec
    tenant is kept, defaulting to the admin's own tenant."""
    if identity.admin:
        return requested or identity.tenant
    if requested and requested != identity.tenant:
        raise _denied(f"token {identity.name!r} (tenant {identity.tenant!r}) cannot submit for tenant {requested!r}")
    return identity.tenant


def visible_tenant(identity: Identity, requested: str) -> str:
    """The tenant filter of a listing: admins see what they ask for (empty: all),
    a tenant sees its own tasks only."""
    if identity.admin:
        return requested
    if requested and requested != identity.tenant:
        raise _denied(f"token {identity.name!r} (tenant {identity.tenant!r}) cannot list tenant {requested!r}")
    return identity.tenant


# ---- certificates ------------------------------------------------------------------------------


def _values(auth_context: Mapping[str, Sequence[bytes]] | None, key: str) -> list[str]:
    if not auth_context:
        return []
    return [v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in auth_context.get(key, ())]


def has_client_certificate(auth_context) -> bool:
    """Whether the peer presented a (verified) certificate over TLS."""
    return "ssl" in _values(auth_context, "transport_security_type") and bool(
        _values(auth_context, "x509_pem_cert") or _values(auth_context, "x509_common_name")
    )


def certificate_names(auth_context) -> tuple[list[str], list[str]]:
    """(common names, SAN DNS names) of the peer certificate. gRPC lists DNS
    SANs under ``peer_dns``; older builds only under ``x509_subject_alternative_name``."""
    cns = _values(auth_context, "x509_common_name")
    if auth_context and "peer_dns" in auth_context:
        dns = _values(auth_context, "peer_dns")
    else:
        dns = _values(auth_context, "x509_subject_alternative_name")
    return cns, dns


def node_identity_matches(auth_context, node_id: str) -> bool:
    """True when the peer's certificate names ``node_id`` (CN or SAN DNS)."""
    if not node_id or not has_client_certificate(auth_context):
        return False
    cns, dns = certificate_names(auth_context)
    return any(hmac.compare_digest(n.encode(), node_id.encode()) for n in (*cns, *dns))


def check_node_certificate(auth_context, node_id: str) -> None:
    """UNAUTHENTICATED without a client certificate, PERMISSION_DENIED when the
    certificate names another node."""
    if not has_client_certificate(auth_context):
        raise _unauthenticated(
            f"agent streams need a client certificate naming the node (node {node_id!r} presented none; connect to the agent port with mTLS)"
        )
    if not node_identity_matches(auth_context, node_id):
        cns, dns = certificate_names(auth_context)
        names = sorted(set(cns) | set(dns))
        raise _denied(f"the client certificate is for {', '.join(names) or 'no name'}; the stream claims node {node_id!r}")


def _read_pem(path: str | Path, what: str, marker: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise SecurityConfigError(f"{path}: cannot read {what}: {exc.strerror}") from None
    if marker.encode() not in data:
        raise SecurityConfigError(f"{path}: {what} is not PEM (no '{marker}' block)")
    return data


#: a certificate that expires within this many days is warned about at start
CERT_EXPIRY_WARNING_DAYS = 14
_CERT_MARKER = "-----BEGIN CERTIFICATE-----"
_KEY_MARKER = "PRIVATE KEY-----"


def certificate_validity(path: str | Path | None = None, pem: bytes | None = None) -> tuple[dt.datetime, dt.datetime] | None:
    """(notBefore, notAfter), in UTC, of the first certificate of the PEM file
    ``path`` (a chain's leaf), or of the PEM text ``pem`` when given (a peer's
    certificate), read with ``cryptography`` when installed, else with
    CPython's own decoder (``ssl._ssl._test_decode_cert``, which reads files
    only: ``pem`` then goes through a scratch file, made only then); None when
    neither is there. ValueError or OSError when it cannot be decoded."""
    try:
        from cryptography import x509
    except ImportError:
        x509 = None
    if x509 is not None:
        cert = x509.load_pem_x509_certificate(Path(path).read_bytes() if pem is None else pem)
        if hasattr(cert, "not_valid_after_utc"):  # cryptography >= 42
            return cert.not_valid_before_utc, cert.not_valid_after_utc
        return (cert.not_valid_before.replace(tzinfo=dt.timezone.utc),  # pragma: no cover
                cert.not_valid_after.replace(tzinfo=dt.timezone.utc))
    decode = getattr(getattr(ssl, "_ssl", None), "_test_decode_cert", None)
    if decode is None:  # pragma: no cover - a Python without it, and no cryptography
        return None
    if pem is not None:
        import tempfile

        with tempfile.NamedTemporaryFile(suffix=".pem") as scratch:  # a peer certificate is public
            scratch.write(pem)
            scratch.flush()
            fields = decode(scratch.name)
    else:
        fields = decode(str(path))

    def when(text: str) -> dt.datetime:
        return dt.datetime.fromtimestamp(ssl.cert_time_to_seconds(text), dt.timezone.utc)

    return when(fields["notBefore"]), when(fields["notAfter"])


def _utc_text(when: dt.datetime) -> str:
    return when.astimezone(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


class _EncryptedKey(Exception):
    pass


def _no_passphrase() -> bytes:
    raise _EncryptedKey  # OpenSSL asks only for an encrypted key (never prompt on a terminal)


def check_certificate_and_key(
    cert_file: str | Path,
    key_file: str | Path,
    *,
    cert_option: str,
    key_option: str,
    now: dt.datetime | None = None,
    warn_days: float = CERT_EXPIRY_WARNING_DAYS,
) -> list[str]:
    """Check, before anything listens or connects, what a TLS handshake would
    otherwise find (or, with gRPC, hide): both files readable PEM, the key
    unencrypted and the certificate's own, the certificate valid now.
    ``SecurityConfigError`` naming ``cert_option``/``key_option`` and the files
    when not; returns warnings (a certificate that expires within
    ``warn_days``)."""
    _read_pem(cert_file, f"{cert_option} (certificate)", _CERT_MARKER)
    _read_pem(key_file, f"{key_option} (private key)", _KEY_MARKER)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_cert_chain(str(cert_file), str(key_file), password=_no_passphrase)
    except _EncryptedKey:
        raise SecurityConfigError(
            f"{key_option} {key_file}: the key is encrypted (passphrase-protected); gRPC needs an unencrypted PEM key "
            f"(openssl pkey -in {key_file} -out PLAIN.pem, then keep PLAIN.pem readable by the daemon only)"
        ) from None
    except ssl.SSLError as exc:
        # OpenSSL 3 says NO_CERTIFICATE_ASSIGNED for a key of another type (an RSA key, an EC certificate)
        if exc.reason in ("KEY_VALUES_MISMATCH", "KEY_TYPE_MISMATCH", "NO_CERTIFICATE_ASSIGNED"):
            raise SecurityConfigError(
                f"{key_option} {key_file} is not the private key of {cert_option} {cert_file}: "
                "the key and the certificate do not match (give the key the certificate was issued for)"
            ) from None
        raise SecurityConfigError(
            f"{cert_option} {cert_file} and {key_option} {key_file}: OpenSSL cannot load them as a certificate and its key "
            f"({exc.reason or exc})"
        ) from None
    except OSError as exc:  # pragma: no cover - the files were just read
        raise SecurityConfigError(f"{cert_option} {cert_file} / {key_option} {key_file}: cannot read: {exc.strerror}") from None
    return _check_validity(cert_file, cert_option, now=now, warn_days=warn_days)


def _check_validity(path: str | Path, option: str, *, now: dt.datetime | None, warn_days: float,
                    what: str = "the certificate") -> list[str]:
    """SecurityConfigError when the (first) certificate of ``path`` is expired
    or not valid yet; a warning when it expires within ``warn_days``."""
    try:
        validity = certificate_validity(path)
    except (ValueError, OSError) as exc:
        raise SecurityConfigError(f"{option} {path}: cannot read the certificate's validity: {exc}") from None
    if validity is None:  # pragma: no cover
        return []
    not_before, not_after = validity
    now = now or dt.datetime.now(dt.timezone.utc)
    if now < not_before:
        raise SecurityConfigError(
            f"{option} {path}: {what} is not valid yet: notBefore {_utc_text(not_before)}, now "
            f"{_utc_text(now)} (a certificate from the future: check this host's clock, or the certificate's dates)"
        )
    if now >= not_after:
        days = (now - not_after).total_seconds() / 86400
        raise SecurityConfigError(
            f"{option} {path}: {what} has expired: notAfter {_utc_text(not_after)} "
            f"({days:.1f} days ago); every TLS peer would refuse it: renew it"
        )
    left = (not_after - now).total_seconds() / 86400
    if left < warn_days:
        return [f"{option} {path}: {what} expires in {left:.1f} days (notAfter {_utc_text(not_after)}): renew it"]
    return []


@dataclass(frozen=True)
class ServerCredentialsConfig:
    """PEM files for the server's TLS (see module docstring for the two ports)."""

    cert_file: str
    key_file: str
    client_ca_file: str | None = None
    require_client_cert_for_agents: bool = True

    def __post_init__(self) -> None:
        if self.require_client_cert_for_agents and not self.client_ca_file:
            raise SecurityConfigError("client_ca_file is required when agents must present client certificates")

    def read(self) -> tuple[bytes, bytes, bytes | None]:
        """(certificate chain, private key, client CA bundle or None), checked to be PEM."""
        cert = _read_pem(self.cert_file, "server certificate", "-----BEGIN CERTIFICATE-----")
        key = _read_pem(self.key_file, "server private key", "PRIVATE KEY-----")
        ca = _read_pem(self.client_ca_file, "client CA", "-----BEGIN CERTIFICATE-----") if self.client_ca_file else None
        return cert, key, ca

    def check(self, *, now: dt.datetime | None = None) -> list[str]:
        """At start, what gRPC would report only as a port it "could not bind"
        or as handshakes failing on every client: ``SecurityConfigError``
        naming the option and file for a key that is not the certificate's,
        an expired or not yet valid certificate, an unreadable file; returns
        warnings (the certificate expires within CERT_EXPIRY_WARNING_DAYS)."""
        warnings = check_certificate_and_key(self.cert_file, self.key_file, cert_option="tls_cert_file",
                                             key_option="tls_key_file", now=now)
        if self.client_ca_file:
            _read_pem(self.client_ca_file, "tls_client_ca_file (client CA)", _CERT_MARKER)
            # an expired CA fails every agent's handshake, as an expired certificate would
            warnings += _check_validity(self.client_ca_file, "tls_client_ca_file", now=now,
                                        warn_days=CERT_EXPIRY_WARNING_DAYS, what="the CA certificate")
        return warnings

    def credentials(self, *, require_client_auth: bool) -> grpc.ServerCredentials:
        cert, key, ca = self.read()
        if require_client_auth and ca is None:
            raise SecurityConfigError("require_client_auth needs client_ca_file")
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=require_client_auth)

    def client_credentials(self) -> grpc.ServerCredentials:
        """TLS without client certificates: the token port."""
        return self.credentials(require_client_auth=False)

    def agent_credentials(self) -> grpc.ServerCredentials:
        """TLS requiring a client certificate signed by ``client_ca_file``: the agent port."""
        return self.credentials(require_client_auth=True)


def channel_credentials(
    ca_file: str | Path | None = None,
    cert_file: str | Path | None = None,
    key_file: str | Path | None = None,
    token: str | None = None,
) -> grpc.ChannelCredentials:
    """Client side: trust ``ca_file`` (system roots when None), present
    ``cert_file``/``key_file`` (agents), and send ``token`` on every call."""
    ca = _read_pem(ca_file, "CA", "-----BEGIN CERTIFICATE-----") if ca_file else None
    cert = _read_pem(cert_file, "client certificate", "-----BEGIN CERTIFICATE-----") if cert_file else None
    key = _read_pem(key_file, "client private key", "PRIVATE KEY-----") if key_file else None
    if (cert is None) != (key is None):
        raise SecurityConfigError("a client certificate needs its key and the other way round")
    creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
    if token:
        creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(token))
    return creds


def check_client_credentials(
    ca_file: str | Path | None,
    cert_file: str | Path | None,
    key_file: str | Path | None,
    *,
    options: tuple[str, str, str] = ("--ca-file", "--cert-file", "--key-file"),
    now: dt.datetime | None = None,
) -> list[str]:
    """A client's (an agent's) TLS files checked at start, as
    ``ServerCredentialsConfig.check`` does the server's: ``SecurityConfigError``
    naming the option (``options``: how the caller names ca, cert and key) and
    the file; returns warnings (the client certificate expires soon)."""
    ca_option, cert_option, key_option = options
    warnings: list[str] = []
    if ca_file:
        _read_pem(ca_file, f"{ca_option} (CA)", _CERT_MARKER)
        warnings += _check_validity(ca_file, ca_option, now=now, warn_days=CERT_EXPIRY_WARNING_DAYS,
                                    what="the CA certificate")
    if bool(cert_file) != bool(key_file):
        given, missing = (cert_option, key_option) if cert_file else (key_option, cert_option)
        raise SecurityConfigError(f"{given} {cert_file or key_file} needs {missing} too: a client certificate and its key go together")
    if cert_file and key_file:
        warnings += check_certificate_and_key(cert_file, key_file, cert_option=cert_option, key_option=key_option, now=now)
    return warnings


# ---- limits ------------------------------------------------------------------------------------


class TokenBucket:
    """``burst`` tokens, refilled at ``rate_per_s``; starts full."""

    __slots__ = ("rate", "burst", "tokens", "stamp", "clock")

    def __init__(self, rate_per_s: float, burst: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        if not (rate_per_s > 0 and math.isfinite(rate_per_s)) or not burst >= 1:
            raise ValueError("rate_per_s must be > 0 and burst >= 1")
        self.rate = float(rate_per_s)
        self.burst = float(burst)
        self.clock = clock
        self.tokens = self.burst
        self.stamp = clock()

    def _refill(self) -> None:
        now = self.clock()
        if now > self.stamp:
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now

    def allow(self, cost: float = 1.0) -> bool:
        """Take ``cost`` tokens if there are that many."""
        self._refill()
        if self.tokens >= cost:
            self.tokens -= cost
            return True
        return False

    def reserve(self, cost: float = 1.0) -> float:
        """Take ``cost`` tokens, going into debt if needed; the seconds to wait
        before acting (0 when there were enough)."""
        self._refill()
        self.tokens -= cost
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate

    def wait_time(self, cost: float = 1.0) -> float:
        self._refill()
        return max(0.0, (cost - self.tokens) / self.rate)


class RateLimiter:
    """One token bucket per key (a client identity or peer address).

    At most ``max_keys`` buckets are kept; the least recently used goes first
    (a forgotten key comes back with a full bucket).
    """

    def __init__(self, rate_per_s: float, burst: float, *, clock: Callable[[], float] = time.monotonic, max_keys: int = 10_000) -> None:
        TokenBucket(rate_per_s, burst, clock=clock)  # validates
        self.rate = float(rate_per_s)
        self.burst = float(burst)
        self.clock = clock
        self.max_keys = max_keys
        self._buckets: collections.OrderedDict[str, TokenBucket] = collections.OrderedDict()
        self.refused = 0

    def __len__(self) -> int:
        return len(self._buckets)

    def _bucket(self, key: str) -> TokenBucket:
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = TokenBucket(self.rate, self.burst, clock=self.clock)
            while len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(key)
        return bucket

    def allow(self, key: str, cost: float = 1.0) -> bool:
        ok = self._bucket(key).allow(cost)
        self.refused += not ok
        return ok

    def wait_time(self, key: str, cost: float = 1.0) -> float:
        return self._bucket(key).wait_time(cost)

    def check(self, key: str, cost: float = 1.0) -> None:
        """RESOURCE_EXHAUSTED when ``key`` is over its rate."""
        if not self.allow(key, cost):
            raise _exhausted(f"rate limit: {key} exceeds {self.rate:g} requests/s (burst {self.burst:g}); retry in {self.wait_time(key, cost):.2f} s")


class MessageRateLimit:
    """Per-stream message rate. Messages beyond ``rate_per_s`` (after a burst
    of ``burst``) are delayed: the stream is not read meanwhile, so HTTP/2 flow
    control pushes back on the sender and nothing piles up here. A sender kept
    over the rate for longer than ``max_throttled_s`` without a break (a
    sustained flood, not a burst) is refused with RESOURCE_EXHAUSTED."""

    def __init__(self, rate_per_s: float, burst: float, *, max_throttled_s: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Any] = asyncio.sleep) -> None:
        self.bucket = TokenBucket(rate_per_s, burst, clock=clock)
        self.max_throttled_s = max_throttled_s
        self.clock = clock
        self.sleep = sleep
        self.delayed = 0
        self._throttled_since: float | None = None

    async def admit(self) -> None:
        wait = self.bucket.reserve()
        if wait <= 0:
            self._throttled_since = None
            return
        now = self.clock()
        if self._throttled_since is None:
            self._throttled_since = now
        elif now - self._throttled_since > self.max_throttled_s:
            raise _exhausted(
                f"stream message rate above {self.bucket.rate:g}/s (burst {self.bucket.burst:g}) for more than {self.max_throttled_s:g} s"
            )
        self.delayed += 1
        await self.sleep(wait)

    async def throttle(self, messages: AsyncIterator) -> AsyncIterator:
        """``messages``, admitted one at a time."""
        async for message in messages:
            await self.admit()
            yield message


def check_queued_limit(tenant: str, queued: int, limit: int | None, new: int = 1, *, batch: bool = False) -> None:
    """RESOURCE_EXHAUSTED (a ``TenantRefusal``) when ``tenant``'s ``queued``
    tasks and the ``new`` ones a call would queue are more than ``limit``.
    The message gives the two apart: a ScheduleTasks call alone may be
    larger than the limit (``batch``), and its tenant then has no queued
    tasks to look for (QA pass 25)."""
    if limit is None or queued + new <= limit:
        return
    if not batch:
        message = f"tenant {tenant!r} has {queued} queued tasks, the most allowed is {limit} (max_queued_per_tenant)"
    else:
        room = max(0, limit - queued)
        message = (f"tenant {tenant!r} has {queued} queued tasks and this call would queue {new} more, the most "
                   f"allowed is {limit} (max_queued_per_tenant): a call may add {room} now; split a larger job "
                   f"array into calls of at most {limit} tasks, each once the tasks before it have left the queue")
    raise TenantRefusal(grpc.StatusCode.RESOURCE_EXHAUSTED, message, tenant=tenant, limit="max_queued_per_tenant")


class TenantQuota:
    """Queued tasks per tenant, kept current as a scheduler listener
    (``changed``), and the ``max_queued_per_tenant`` check for submissions.

    A resubmission of a task the scheduler already holds (queued, leased
    or ended: ``known``) queues nothing and passes the check even at the
    limit: it is answered with that task (or ALREADY_EXISTS for another
    spec), as idempotent submission promises.
    """

    def __init__(self, max_queued_per_tenant: int | None) -> None:
        self.limit = max_queued_per_tenant
        self._queued: dict[str, str] = {}  # task id -> tenant
        self._counts: collections.Counter[str] = collections.Counter()

    def changed(self, task: Task) -> None:
        task_id, tenant = task.task_id, task.spec.tenant
        was = self._queued.get(task_id)
        if task.state == TaskState.QUEUED:
            if was is None:
                self._queued[task_id] = tenant
                self._counts[tenant] += 1
        elif was is not None:
            del self._queued[task_id]
            self._counts[was] -= 1
            if self._counts[was] <= 0:
                del self._counts[was]

    def rebuild(self, tasks: Iterable[Task]) -> None:
        """Start over from ``tasks`` (after a restore)."""
        self._queued.clear()
        self._counts.clear()
        for task in tasks:
            self.changed(task)

    def queued(self, tenant: str) -> int:
        return self._counts.get(tenant, 0)

    def _queues_nothing(self, spec: TaskSpec, known: Callable[[TaskSpec], TaskSpec | None] | None) -> bool:
        return spec.task_id in self._queued or (known is not None and known(spec) is not None)

    def check(self, spec: TaskSpec, known: Callable[[TaskSpec], TaskSpec | None] | None = None) -> None:
        """``known(spec)``: the spec of the task the scheduler holds under
        ``spec``'s id that a submission of ``spec`` would be answered with
        (None: it would make a new task)."""
        if self.limit is None or self._queues_nothing(spec, known):
            return
        check_queued_limit(spec.tenant, self.queued(spec.tenant), self.limit)

    def check_many(self, specs: Iterable[TaskSpec], known: Callable[[TaskSpec], TaskSpec | None] | None = None) -> None:
        """``check`` for a batch as a whole: each tenant's queued tasks plus
        its new ones in the batch must stay within the limit."""
        if self.limit is None:
            return
        new: collections.Counter[str] = collections.Counter()  # in the order tenants first appear
        ids: set[str] = set()
        for spec in specs:
            if spec.task_id in ids or self._queues_nothing(spec, known):
                continue
            ids.add(spec.task_id)
            new[spec.tenant] += 1
        for tenant, count in new.items():
            check_queued_limit(tenant, self.queued(tenant), self.limit, count, batch=True)


class StreamSlot:
    """One admitted stream's place in its ``StreamSlots``; ``release()`` (or
    leaving it as a context manager) gives it back, once however often it is
    called, so every way a stream ends may call it."""

    __slots__ = ("_slots", "key", "credential", "revoked")

    def __init__(self, slots: "StreamSlots", key: str, credential: _Entry | None = None) -> None:
        self._slots: StreamSlots | None = slots
        self.key = key
        #: the token the stream was opened with (None: certificate or insecure)
        self.credential = credential
        #: set when that token is revoked (``Security.reload_tokens``): the
        #: stream ends UNAUTHENTICATED at its next wait (``or_shutdown``)
        self.revoked = asyncio.Event()

    def release(self) -> None:
        slots, self._slots = self._slots, None
        if slots is not None:
            slots._release(self)

    def __enter__(self) -> "StreamSlot":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class StreamSlots:
    """Long-lived server-streaming calls (the watches: WatchTask, WatchView,
    WatchPlans) open per client and in all, and the caps on them.

    Each open watch holds ~27 KiB of coordinator memory for as long as its
    client keeps it; without a cap one client opened 15,000 (QA pass 23, +400
    MiB). The limits are given at each admission (the coordinator passes its
    configuration's), so the counts are the only state here.
    """

    PER_CLIENT_OPTION = "max_watch_streams_per_client"
    TOTAL_OPTION = "max_watch_streams"

    def __init__(self) -> None:
        self._per_client: collections.Counter[str] = collections.Counter()
        self._streams: set[StreamSlot] = set()
        self.open = 0
        self.refused = 0

    def __len__(self) -> int:
        """Clients with a stream open (a client's count goes when its last stream ends)."""
        return len(self._per_client)

    def open_by(self, key: str) -> int:
        return self._per_client[key]

    def admit(self, key: str, *, per_client: int, total: int, credential: _Entry | None = None) -> StreamSlot:
        """A slot for one more stream of client ``key``, or RESOURCE_EXHAUSTED
        (``AuthError``) naming the limit reached and the option that sets it."""
        held = self._per_client[key]
        if held >= per_client:
            self.refused += 1
            raise _exhausted(
                f"watch streams: {key} has {held} open, the most one client may have is {per_client} "
                f"({self.PER_CLIENT_OPTION}); end one before opening another"
            )
        if self.open >= total:
            self.refused += 1
            raise _exhausted(
                f"watch streams: {self.open} open, the most the coordinator serves is {total} "
                f"({self.TOTAL_OPTION}); retry later"
            )
        self._per_client[key] = held + 1
        self.open += 1
        slot = StreamSlot(self, key, credential)
        self._streams.add(slot)
        return slot

    def _release(self, slot: StreamSlot) -> None:
        self._streams.discard(slot)
        left = self._per_client[slot.key] - 1
        if left > 0:
            self._per_client[slot.key] = left
        else:
            del self._per_client[slot.key]  # a client that has gone leaves no entry behind
        self.open -= 1

    def revoke(self, tokens: "TokenAuth") -> int:
        """End the open streams whose token ``tokens`` no longer grants; how many."""
        ended = 0
        for slot in self._streams:
            if slot.credential is not None and not tokens.holds(slot.credential) and not slot.revoked.is_set():
                slot.revoked.set()
                ended += 1
        return ended


def _peer_host(peer: str) -> str:
    # "ipv4:10.0.0.1:5555", "ipv6:[::1]:5555", "unix:/path"
    if peer.startswith(("ipv4:", "ipv6:")):
        return peer.rsplit(":", 1)[0]
    return peer


def client_key(context, tokens: TokenAuth | None = None) -> str:
    """The rate-limit key of a call: its token's name when valid, else the
    name in its verified client certificate, else the peer's address without
    the port (a client cannot dodge it by reconnecting)."""
    if tokens is not None:
        identity = tokens.identify(context.invocation_metadata())
        if identity is not None:
            return "token:" + identity.name
    auth_context = context.auth_context()
    if has_client_certificate(auth_context):
        cns, dns = certificate_names(auth_context)
        if cns or dns:
            return "cert:" + (cns or dns)[0]
    return "peer:" + _peer_host(context.peer() or "")


# ---- the facade the coordinator's hooks call --------------------------------------------------


class Security:
    """Everything the coordinator's security hooks need, in one object.

    ``Security(insecure=True)`` (or ``Security.insecure_mode()``) is the only
    way to run without TLS or without tokens, and logs a warning saying what
    is open; otherwise TLS credentials and a token file are required.
    """

    def __init__(
        self,
        *,
        tokens: TokenAuth | None = None,
        tls: ServerCredentialsConfig | None = None,
        insecure: bool = False,
        rate_limit: RateLimiter | None = None,
        stream_rate: tuple[float, float] | None = None,
        stream_max_throttled_s: float = 10.0,
        quota: TenantQuota | None = None,
        public_methods: Sequence[str] = ("/grpc.health.v1.Health/", "/grpc.reflection."),
    ) -> None:
        if not insecure:
            if tls is None:
                raise SecurityConfigError("TLS certificate and key are required (or ask for insecure mode explicitly)")
            if tokens is None:
                raise SecurityConfigError("a token file is required (or ask for insecure mode explicitly)")
        if tls is not None:
            for warning in tls.check():
                log.warning("tls_certificate_expires_soon", detail=warning)
        self.tokens = tokens
        self.tls = tls
        #: the TLS files as served (coordinator.certwatch), once the ports are bound
        self.tls_files = None
        self.insecure = insecure
        self.require_client_cert_for_agents = bool(tls and tls.require_client_cert_for_agents) and not insecure
        self.rate_limit = rate_limit
        self.stream_rate = stream_rate
        self.stream_max_throttled_s = stream_max_throttled_s
        self.quota = quota
        #: open watch streams, per client and in all (admit_watch)
        self.watch_streams = StreamSlots()
        self.public_methods = tuple(public_methods)
        if insecure:
            gaps = []
            if tls is None:
                gaps.append("no TLS: traffic (and any token) travels in plaintext")
            if tokens is None:
                gaps.append("no authentication: anyone who can reach the port can report GPUs, submit, cancel and change policy")
            gaps.append("agent streams are not bound to certificates")
            log.warning("INSECURE_MODE", tls=tls is not None, tokens=tokens is not None, detail="insecure mode was asked for; " + "; ".join(gaps))

    @classmethod
    def insecure_mode(cls, **kw) -> "Security":
        return cls(insecure=True, **kw)

    # ---- listeners -------------------------------------------------------------
    def add_ports(self, server: grpc.aio.Server, listen: str, agent_listen: str | None = None) -> dict[str, int]:
        """Bind ``listen`` (clients; agents too when ``agent_listen`` is None)
        and ``agent_listen``; returns {"listen": port, "agent_listen": port}."""
        ports: dict[str, int] = {}

        def bind(address: str, creds: grpc.ServerCredentials | None) -> int:
            port = server.add_insecure_port(address) if creds is None else server.add_secure_port(address, creds)
            if port == 0:
                raise OSError(f"cannot bind {address}")
            return port

        if self.tls is None:
            ports["listen"] = bind(listen, None)
            if agent_listen:
                ports["agent_listen"] = bind(agent_listen, None)
            return ports
        # dynamic credentials: renewed files are served at the next handshake, no restart
        files = self.server_tls_files()
        if agent_listen:
            ports["listen"] = bind(listen, files.credentials(require_client_auth=False))
            ports["agent_listen"] = bind(agent_listen, files.credentials(require_client_auth=bool(self.tls.client_ca_file)))
        elif self.require_client_cert_for_agents:
            log.info("tls_single_port", detail="one port for agents and clients: every caller needs a client certificate")
            ports["listen"] = bind(listen, files.credentials(require_client_auth=True))
        else:
            ports["listen"] = bind(listen, files.credentials(require_client_auth=False))
        return ports

    def server_tls_files(self):
        """The TLS files as served (``coordinator.certwatch.ServerTlsFiles``),
        made at the first listener that needs them: the gRPC ports and the
        metrics port follow one set of renewals."""
        if self.tls_files is None:
            from coordinator.certwatch import ServerTlsFiles

            self.tls_files = ServerTlsFiles(self.tls)
        return self.tls_files

    def authorize_scrape(self, authorization: str | None) -> None:
        """A ``GET /metrics`` under ``metrics_auth = "token"``: its
        ``Authorization`` header must carry a token of role ``metrics`` or
        ``admin``; ``AuthError`` UNAUTHENTICATED (none, unknown) or
        PERMISSION_DENIED (another role) otherwise. The tokens are read when
        asked, so a token file reloaded by SIGHUP applies to the next scrape."""
        if self.tokens is None:
            raise _unauthenticated("metrics_auth is 'token' but the coordinator has no token_file")
        if authorization is None:
            raise _unauthenticated("missing credentials: send the header 'Authorization: Bearer <token>' "
                                   "(a token_file token of role metrics or admin)")
        self.tokens.authenticate((("authorization", authorization),), roles=("metrics",))

    def interceptor(self) -> "SecurityInterceptor":
        return SecurityInterceptor(self)

    # ---- hooks ------------------------------------------------------------------
    def authorize(self, context, *, admin: bool) -> Identity:
        if self.tokens is None:
            return INSECURE_IDENTITY
        return self.tokens.authenticate(context.invocation_metadata(), admin=admin)

    def authorize_node(self, node_id: str, context) -> Identity | None:
        """Accept an agent stream registering as ``node_id`` or raise ``AuthError``."""
        if self.insecure and self.tokens is None:
            return None
        auth_context = context.auth_context()
        if self.require_client_cert_for_agents or has_client_certificate(auth_context):
            check_node_certificate(auth_context, node_id)
            return None
        identity = self.tokens.authenticate(context.invocation_metadata(), roles=("agent",))
        if identity.nodes is not None and node_id not in identity.nodes:
            raise _denied(f"token {identity.name!r} may not register as node {node_id!r}")
        return identity

    @staticmethod
    def peer_certificate_not_after(context) -> float | None:
        """notAfter (epoch s) of the client certificate the peer presented
        (an agent's, over mTLS), None without one."""
        pems = _values(context.auth_context(), "x509_pem_cert")
        if not pems:
            return None
        from coordinator.certwatch import pem_not_after

        return pem_not_after(pems[0])

    def tenant_spec(self, identity: Identity | None, spec: TaskSpec) -> TaskSpec:
        if identity is None:
            return spec
        tenant = tenant_for_submission(identity, spec.tenant)
        return spec if tenant == spec.tenant else dataclasses.replace(spec, tenant=tenant)

    def admit_submission(self, identity: Identity | None, spec: TaskSpec, *,
                         max_priority: Callable[[str], int | None] | None = None,
                         known: Callable[[TaskSpec], TaskSpec | None] | None = None) -> None:
        """The per-tenant limits on a ScheduleTask of ``spec`` (its tenant
        already fixed by ``tenant_spec``): ``max_priority(tenant)``, the
        most urgent class a tenant token may submit
        (``SchedulerConfig.max_priority_for``), and the queue limit.
        ``known``: as ``TenantQuota.check``; an identical repeat of a task
        the scheduler holds asks for nothing new and passes both."""
        self._check_priorities(identity, [spec], max_priority, known, batch=False)
        if self.quota is not None:
            self.quota.check(spec, known)

    def admit_submissions(self, identity: Identity | None, specs: Sequence[TaskSpec], *,
                          max_priority: Callable[[str], int | None] | None = None,
                          known: Callable[[TaskSpec], TaskSpec | None] | None = None) -> None:
        """``admit_submission`` for a ScheduleTasks call: a class above its
        tenant's names ``specs[i].priority``; the queue limit is the call's."""
        self._check_priorities(identity, specs, max_priority, known, batch=True)
        if self.quota is not None:
            self.quota.check_many(specs, known)

    @staticmethod
    def _check_priorities(identity: Identity | None, specs: Sequence[TaskSpec],
                          max_priority: Callable[[str], int | None] | None,
                          known: Callable[[TaskSpec], TaskSpec | None] | None, *, batch: bool) -> None:
        if identity is None or identity.admin or max_priority is None:
            return
        for index, spec in enumerate(specs):
            most_urgent = max_priority(spec.tenant)
            if most_urgent is None or int(spec.priority) >= most_urgent:
                continue
            if known is not None and known(spec) == spec:
                continue  # the task it was accepted as (before a reload lowered the cap): nothing new
            check_priority(identity, spec, most_urgent, f"specs[{index}].priority" if batch else "spec.priority")

    def check_owner(self, identity: Identity | None, task: Task) -> None:
        if identity is not None:
            check_tenant(identity, task.spec.tenant, task.task_id)

    def visible_tenant(self, identity: Identity | None, requested: str) -> str:
        return requested if identity is None else visible_tenant(identity, requested)

    def client_key(self, context) -> str:
        return client_key(context, self.tokens)

    def admit_watch(self, context, config) -> StreamSlot:
        """A slot for one more watch stream of the caller, within ``config``'s
        ``max_watch_streams_per_client`` and ``max_watch_streams`` (the
        coordinator's configuration), or ``AuthError`` RESOURCE_EXHAUSTED.
        The caller releases it however its stream ends."""
        return self.watch_streams.admit(
            self.client_key(context), per_client=config.max_watch_streams_per_client, total=config.max_watch_streams,
            credential=self.credential(context),
        )

    def credential(self, context) -> _Entry | None:
        """The token entry a call was made with (None without token auth)."""
        return None if self.tokens is None else self.tokens.credential(context.invocation_metadata())

    def reload_tokens(self, tokens: TokenAuth) -> tuple[list[str], int]:
        """Serve ``tokens`` (the token file read again, SIGHUP) from the next
        call on, and end the watch streams opened with a token it no longer
        grants. Returns (names of the tokens revoked, watch streams ended);
        the coordinator ends the agent streams (``AgentSession.credential``)."""
        revoked = self.tokens.names_not_in(tokens) if self.tokens is not None else []
        self.tokens = tokens
        return revoked, self.watch_streams.revoke(tokens)


# ---- interceptor -------------------------------------------------------------------------------


class SecurityInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every handler outside ``Security.public_methods``:

    * per-client RPC rate limit (``Security.rate_limit``) -> RESOURCE_EXHAUSTED;
    * per-stream message rate (``Security.stream_rate``) on client streams;
    * an ``AuthError`` raised by the handler becomes its status (instead of
      UNKNOWN), so synchronous hooks can simply raise.
    """

    def __init__(self, security: Security) -> None:
        self.security = security

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(self.security.public_methods):
            return handler
        return self._wrap(handler, handler_call_details.method)

    async def _admit(self, context) -> None:
        limiter = self.security.rate_limit
        if limiter is not None:
            key = self.security.client_key(context)
            if not limiter.allow(key):
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"rate limit: {key} exceeds {limiter.rate:g} requests/s (burst {limiter.burst:g})",
                )

    def _requests(self, request_iterator):
        if self.security.stream_rate is None:
            return request_iterator
        rate, burst = self.security.stream_rate
        return MessageRateLimit(rate, burst, max_throttled_s=self.security.stream_max_throttled_s).throttle(request_iterator)

    @staticmethod
    def _parser(handler, method: str):
        """The handler's request deserializer, run by the wrapper instead of by
        grpc: bytes that are not the request message then end
        INVALID_ARGUMENT naming the request, not UNKNOWN (found by
        benchmarks/fuzz.py as ``undecodable_request``)."""
        deserialize = handler.request_deserializer

        async def parse(raw, context):
            if deserialize is None:
                return raw
            try:
                return deserialize(raw)
            except Exception as exc:  # protobuf's DecodeError, or whatever a deserializer raises on bytes it cannot read
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: not a valid request message of {method} ({exc})")

        return parse

    def _wrap(self, handler, method: str = ""):
        admit = self._admit
        options = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
        # unary requests arrive as bytes and are parsed inside the wrapper (_parser)
        raw_options = dict(request_deserializer=None, response_serializer=handler.response_serializer)
        parse = self._parser(handler, method)
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary_unary(raw, context):
                await admit(context)
                request = await parse(raw, context)
                try:
                    return await inner(request, context)
                except AuthError as exc:
                    await context.abort(exc.code, exc.message)

            return grpc.unary_unary_rpc_method_handler(unary_unary, **raw_options)
        if handler.stream_unary is not None:
            inner = handler.stream_unary

            async def stream_unary(request_iterator, context):
                await admit(context)
                try:
                    return await inner(self._requests(request_iterator), context)
                except AuthError as exc:
                    await context.abort(exc.code, exc.message)

            return grpc.stream_unary_rpc_method_handler(stream_unary, **options)
        streaming_request = handler.stream_stream is not None
        inner = handler.stream_stream if streaming_request else handler.unary_stream
        make = grpc.stream_stream_rpc_method_handler if streaming_request else grpc.unary_stream_rpc_method_handler
        # a request stream keeps grpc's deserializer (its handler may read it with context.read())
        prepare = self._requests if streaming_request else None
        stream_options = options if streaming_request else raw_options
        if inspect.isasyncgenfunction(inner):

            async def streaming_gen(request, context):
                await admit(context)
                request = prepare(request) if prepare else await parse(request, context)
                try:
                    async for response in inner(request, context):
                        yield response
                except AuthError as exc:
                    await context.abort(exc.code, exc.message)

            return make(streaming_gen, **stream_options)
        if inspect.iscoroutinefunction(inner):

            async def streaming_coro(request, context):
                await admit(context)
                request = prepare(request) if prepare else await parse(request, context)
                try:
                    return await inner(request, context)
                except AuthError as exc:
                    await context.abort(exc.code, exc.message)

            return make(streaming_coro, **stream_options)
        log.warning("interceptor_skipped", detail="a synchronous streaming handler is served unwrapped")
        return handler


# ---- command line ------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m coordinator.security", description="gpulb token tooling")
    sub = parser.add_subparsers(dest="cmd", required=True)
    new = sub.add_parser("new-token", help="make a token; print it once and the token-file entry holding its digest")
    new.add_argument("--role", choices=ROLES, default="tenant",
                     help="admin: everything; tenant: its own tasks; agent: agent streams only; metrics: GET /metrics only "
                          "(default: %(default)s)")
    new.add_argument("--tenant", default="", help="the tenant of a tenant token (required for it), or an admin's default")
    new.add_argument("--name", default="", help="a name for logs and rate limits (default: role:tenant:digest prefix)")
    sub.add_parser("hash-token", help="read a token on stdin, print its digest")
    args = parser.parse_args(argv)
    if args.cmd == "hash-token":
        token = sys.stdin.readline().strip()
        problem = token_problem(token)
        if problem:
            print(f"{parser.prog} hash-token: the token on stdin: {problem}", file=sys.stderr)
            return 2
        print(hash_token(token))
        return 0
    if args.role == "tenant" and not args.tenant:
        parser.error("--tenant is required for role tenant")
    problem = _tenant_problem(args.tenant)
    if problem:
        parser.error(f"--tenant: {problem}")
    if args.role == "agent" and args.tenant:
        parser.error("--tenant: an agent token has no tenant (it may only open agent streams)")
    if args.role == "metrics" and args.tenant:
        parser.error("--tenant: a metrics token has no tenant (it may only read /metrics)")
    if args.role == "admin" and args.tenant:
        print(f"# note: an admin token is not limited to --tenant {args.tenant!r}; the tenant is only the default of what "
              "it submits without one", file=sys.stderr)
    token = generate_token()
    print(f"# token (give it to the client; it is not stored anywhere): {token}", file=sys.stderr)
    print(f'[tokens."{hash_token(token)}"]')
    if args.name:
        print(f"name = {json.dumps(args.name)}")
    print(f"role = {json.dumps(args.role)}")
    if args.tenant:
        print(f"tenant = {json.dumps(args.tenant)}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
