"""TLS certificates that change under a running daemon.

Certificates are renewed while daemons run: certbot, cert-manager or an
internal CA's short-lived certificates replace the PEM files in place, weeks
into a coordinator's uptime. Two things follow, and this module does both.

* **Renewed files are served without a restart.** ``ServerTlsFiles`` hands
  gRPC *dynamic* server credentials: gRPC asks it for the certificate at each
  new handshake, and it answers from the files on disk when they changed
  (stat'ed at most once a second, whatever the handshake rate). A new pair is
  checked first as the start checks it (the key is the certificate's, the
  dates are valid): a half-written renewal (the certificate replaced, the key
  not yet) is refused, logged once, and the certificate served before stays
  until the files are right. Established connections keep the certificate
  they were made with (TLS checks dates only at the handshake), so an agent
  stream opened weeks ago is not cut by a renewal, nor by an expiry.
* **Expiry is said ahead of time, not at the first failed handshake.** A
  certificate that expires while a daemon runs fails nothing until the next
  handshake: with streams open for weeks that can be the day a network blip
  makes every agent reconnect at once. ``ExpiryReminder`` logs
  ``tls_certificate_expires_soon`` once a day per certificate in its last
  ``CERT_EXPIRY_WARNING_DAYS``; the coordinator exports every expiry date as a
  metric (its own certificates, and each connected agent's client
  certificate) for the ``GpulbCertificateExpiresSoon`` alert.
"""

from __future__ import annotations

import datetime as dt
import os
import ssl
import threading
import time
from pathlib import Path
from typing import Callable

import grpc
import structlog

from coordinator.security import (
    CERT_EXPIRY_WARNING_DAYS,
    SecurityConfigError,
    ServerCredentialsConfig,
    certificate_validity,
)

__all__ = ["RECHECK_S", "REMIND_EVERY_S", "ExpiryReminder", "HttpsContext", "ServerTlsFiles", "expiry_problem", "pem_not_after"]

log = structlog.get_logger("gpulb.security")

#: the files are stat'ed at most this often (s), however many handshakes ask
RECHECK_S = 1.0
#: a certificate in its last days is logged about at most this often (s)
REMIND_EVERY_S = 86_400.0


def _utc(epoch_s: float) -> str:
    return dt.datetime.fromtimestamp(epoch_s, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def expiry_problem(not_after_s: float, now_s: float, *, warn_days: float = CERT_EXPIRY_WARNING_DAYS) -> str | None:
    """What to say of a certificate whose notAfter is ``not_after_s`` (epoch
    s) at ``now_s``: None while more than ``warn_days`` are left."""
    left_days = (not_after_s - now_s) / 86_400.0
    if left_days >= warn_days:
        return None
    if left_days <= 0:
        return f"expired {-left_days:.1f} days ago (notAfter {_utc(not_after_s)}): the next handshake with it fails"
    return f"expires in {left_days:.1f} days (notAfter {_utc(not_after_s)}): renew it"


def pem_not_after(pem: bytes | str) -> float | None:
    """notAfter (epoch s) of the first certificate of a PEM text (a peer's
    certificate as gRPC's auth context gives it); None when it cannot be read."""
    data = pem.encode() if isinstance(pem, str) else pem
    try:
        validity = certificate_validity(pem=data)
        return None if validity is None else validity[1].timestamp()
    except (ValueError, OSError):
        return None


class ExpiryReminder:
    """Says of each certificate in its last days once per ``every_s``, not at
    every check (the checks run hourly; a daily line is what an operator reads)."""

    def __init__(self, every_s: float = REMIND_EVERY_S, *, warn_days: float = CERT_EXPIRY_WARNING_DAYS) -> None:
        self.every_s = every_s
        self.warn_days = warn_days
        self._said: dict[str, float] = {}

    def due(self, key: str, not_after_s: float, now_s: float) -> str | None:
        """The warning to log now for certificate ``key``, or None (fine, or
        said less than ``every_s`` ago). A renewed certificate (a later
        notAfter) is said of afresh when it too nears its end."""
        problem = expiry_problem(not_after_s, now_s, warn_days=self.warn_days)
        if problem is None:
            self._said.pop(key, None)
            return None
        last = self._said.get(key)
        if last is not None and now_s - last < self.every_s:
            return None
        self._said[key] = now_s
        return problem

    def keys(self) -> list[str]:
        return list(self._said)

    def forget(self, key: str) -> None:
        self._said.pop(key, None)


class ServerTlsFiles:
    """The coordinator's certificate, key and client CA, served to gRPC as
    dynamic credentials that follow the files (module docstring).

    ``not_after`` holds the served certificates' expiry (epoch s) by option
    name (``tls_cert_file``, ``tls_client_ca_file``); ``reloads`` and
    ``refusals`` count renewals taken and refused."""

    def __init__(self, config: ServerCredentialsConfig, *, clock: Callable[[], float] = time.monotonic,
                 recheck_s: float = RECHECK_S) -> None:
        self.config = config
        self.clock = clock
        self.recheck_s = recheck_s
        self._lock = threading.Lock()
        self._checked_at = clock()
        self._signature = self._stat()
        self._refused: tuple | None = None
        cert, key, ca = config.read()
        self._configuration = grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)
        #: bumped at each renewal taken; each credentials object serves the newest
        self.generation = 0
        self.reloads = 0
        self.refusals = 0
        self.not_after: dict[str, float] = {}
        self._read_expiry()

    def _paths(self) -> list[tuple[str, str]]:
        paths = [("tls_cert_file", self.config.cert_file), ("tls_key_file", self.config.key_file)]
        if self.config.client_ca_file:
            paths.append(("tls_client_ca_file", self.config.client_ca_file))
        return paths

    def _stat(self) -> tuple:
        """What changes when a file is replaced: renamed over (inode), written
        in place (mtime, size); None for a file missing mid-rotation."""
        signature = []
        for _, path in self._paths():
            try:
                st = os.stat(path)
                signature.append((st.st_ino, st.st_mtime_ns, st.st_size))
            except OSError:
                signature.append(None)
        return tuple(signature)

    def _read_expiry(self) -> None:
        expiry = {}
        for option, path in self._paths():
            if option == "tls_key_file":
                continue
            try:
                validity = certificate_validity(path)
            except (ValueError, OSError):
                continue
            if validity is not None:
                expiry[option] = validity[1].timestamp()
        self.not_after = expiry

    def refresh(self, *, force: bool = False) -> bool:
        """Take renewed files when they changed and check out; True when a
        renewal was taken now. Called by gRPC at each handshake (from its own
        threads), and by the coordinator's hourly certificate check."""
        with self._lock:
            now = self.clock()
            if not force and now - self._checked_at < self.recheck_s:
                return False
            self._checked_at = now
            signature = self._stat()
            if signature == self._signature or signature == self._refused:
                return False
            try:
                warnings = self.config.check()
                cert, key, ca = self.config.read()
            except SecurityConfigError as exc:
                # a half-done renewal (certificate replaced, key not yet) or a
                # bad one: keep serving what worked; said once per change
                self._refused = signature
                self.refusals += 1
                log.error("tls_reload_refused", error=str(exc), kept="the certificate served before",
                          hint="the files are read again when they next change")
                return False
            self._configuration = grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)
            self._signature = signature
            self._refused = None
            self.generation += 1
            self.reloads += 1
            self._read_expiry()
        log.info("tls_reloaded", files={option: path for option, path in self._paths()},
                 not_after={option: _utc(when) for option, when in self.not_after.items()},
                 detail="new handshakes get the renewed certificate; open connections keep theirs")
        for warning in warnings:
            log.warning("tls_certificate_expires_soon", detail=warning)
        return True

    def credentials(self, *, require_client_auth: bool) -> grpc.ServerCredentials:
        """Dynamic server credentials: each new handshake is served the newest
        files that checked out."""
        if require_client_auth and not self.config.client_ca_file:
            raise SecurityConfigError("require_client_auth needs client_ca_file")
        served = self.generation

        def fetch():
            nonlocal served
            try:
                self.refresh()
            except Exception:  # never fail a handshake over the check itself
                log.exception("tls_reload_failed")
            if served == self.generation:
                return None  # gRPC keeps what it has
            served = self.generation
            return self._configuration

        return grpc.dynamic_ssl_server_credentials(self._configuration, fetch,
                                                   require_client_authentication=require_client_auth)

    def files(self) -> dict[str, Path]:
        return {option: Path(path) for option, path in self._paths()}


class HttpsContext:
    """The ``ssl.SSLContext`` of an HTTPS listener (``metrics_tls``) that
    follows ``ServerTlsFiles``' renewals as gRPC's dynamic credentials do.

    asyncio's server takes one context for good; OpenSSL asks the context's
    SNI callback at every ClientHello (with or without a server name), and
    the callback may hand the connection another context. So at each
    handshake the files are checked (``ServerTlsFiles.refresh``, stat'ed at
    most once a second), and after a renewal that checked out a context of
    the new pair serves the next connections. A pair that does not load
    (replaced again, half-written, since it checked out) keeps the one before.
    """

    def __init__(self, files: ServerTlsFiles) -> None:
        self.files = files
        self._generation = files.generation
        #: the context given to the server (its callback swaps in ``current``)
        self.context = self._load()
        self.current = self.context
        self._refused_generation: int | None = None

    def _load(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.files.config.cert_file, self.files.config.key_file)
        context.sni_callback = self._on_client_hello
        return context

    def _on_client_hello(self, connection, server_name, context) -> None:
        try:
            self.files.refresh()
            generation = self.files.generation
            if generation != self._generation and generation != self._refused_generation:
                try:
                    self.current = self._load()
                    self._generation = generation
                except (ssl.SSLError, OSError) as exc:
                    self._refused_generation = generation
                    log.error("tls_reload_refused", listener="metrics_listen", error=str(exc),
                              kept="the certificate served before")
            if connection.context is not self.current:
                connection.context = self.current
        except Exception:  # never fail a handshake over the check itself
            log.exception("tls_reload_failed", listener="metrics_listen")
        return None
