"""systemd's service notification protocol (sd_notify) and a watchdog pinger.

A daemon started as ``Type=notify`` tells systemd it is ready, reloading or
stopping, and pings the watchdog, by sending newline-separated ``KEY=VALUE``
datagrams to the AF_UNIX socket named in ``$NOTIFY_SOCKET``. The protocol is
a dozen lines, so it is ours rather than a dependency; with no socket
configured (a terminal, a test, a container) every call is a no-op.

``WatchdogPinger`` pings from the asyncio event loop itself: when the loop is
stuck, the pings stop and systemd restarts the service after ``WatchdogSec=``,
which a pinger thread would hide. ``NotifyListener`` is systemd's end of the
socket, shipped for tests and demos that run a daemon under a fake systemd.
"""

from __future__ import annotations

import array
import asyncio
import math
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping

import structlog

__all__ = ["Notifier", "NotifyListener", "NotifyMessage", "WatchdogPinger", "notify_address"]

log = structlog.get_logger("gpulb.sdnotify")

# systemd reads one datagram per message; status lines longer than this are of
# no use in `systemctl status` and would only risk EMSGSIZE.
_MAX_STATUS_CHARS = 1024


def notify_address(value: str) -> str:
    """The ``sendto`` address of a ``$NOTIFY_SOCKET`` value.

    ``/run/systemd/notify`` is a filesystem socket; ``@name`` is a Linux
    abstract socket, whose address starts with a NUL byte. systemd ≥ 254 may
    also hand out ``vsock:`` addresses, but only to guests of a VM manager,
    never to a host service, so they are refused rather than half supported.
    """
    if value.startswith("@"):
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    raise ValueError(
        f"NOTIFY_SOCKET={value!r}: expected an absolute socket path or an @abstract name"
    )


def _watchdog_interval(usec: str | None, pid: str | None, own_pid: int) -> float | None:
    # Same rules as sd_watchdog_enabled(3): WATCHDOG_PID, when set, names the
    # one process the watchdog is meant for (a child that inherited the
    # variables must not ping on its parent's behalf).
    if not usec:
        return None
    try:
        value = int(usec)
    except ValueError:
        raise ValueError(f"WATCHDOG_USEC={usec!r}: expected whole microseconds") from None
    if value <= 0:
        return None
    if pid:
        try:
            if int(pid) != own_pid:
                return None
        except ValueError:
            raise ValueError(f"WATCHDOG_PID={pid!r}: expected a process id") from None
    return value / 1e6


class Notifier:
    """Sends sd_notify messages to one socket; every method is a no-op when disabled.

    ``socket_path`` is ``$NOTIFY_SOCKET`` as systemd sets it (None or empty:
    disabled). ``watchdog_usec``/``watchdog_pid`` are ``$WATCHDOG_USEC`` and
    ``$WATCHDOG_PID``. ``Notifier.from_environ(os.environ)`` reads all three.
    Send failures raise ``OSError``: a service that cannot reach systemd is
    about to be killed for it, and the caller should say why first.
    """

    def __init__(
        self,
        socket_path: str | None = None,
        *,
        watchdog_usec: str | None = None,
        watchdog_pid: str | None = None,
        pid: int | None = None,
    ) -> None:
        self.socket_path = socket_path or None
        self._address = notify_address(socket_path) if socket_path else None
        self._pid = os.getpid() if pid is None else pid
        self._watchdog_s = _watchdog_interval(watchdog_usec, watchdog_pid, self._pid)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> "Notifier":
        return cls(
            environ.get("NOTIFY_SOCKET"),
            watchdog_usec=environ.get("WATCHDOG_USEC"),
            watchdog_pid=environ.get("WATCHDOG_PID"),
        )

    @property
    def enabled(self) -> bool:
        """True when messages go somewhere (``$NOTIFY_SOCKET`` was set)."""
        return self._address is not None

    def watchdog_interval_s(self) -> float | None:
        """systemd's ``WatchdogSec=`` in seconds, or None when no watchdog is armed for us.

        Ping at half of it (``WatchdogPinger`` does), so one late tick is not a restart.
        """
        if not self.enabled:
            return None
        return self._watchdog_s

    def send(self, *assignments: str) -> bool:
        """Send ``KEY=VALUE`` lines as one datagram; False when disabled."""
        if self._address is None:
            return False
        payload = "\n".join(assignments).encode("utf-8")
        # A fresh socket per message: nothing to open at start or close at stop,
        # and a few messages a minute cost nothing.
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(payload, self._address)
        return True

    def ready(self, status: str | None = None) -> bool:
        """Startup (or a reload) finished: systemd starts dependents and ``systemctl start`` returns."""
        lines = ["READY=1"]
        if status is not None:
            lines.append(_status_line(status))
        return self.send(*lines)

    def reloading(self) -> bool:
        """A reload began; send ``ready()`` when it is done.

        systemd ≥ 253 wants ``MONOTONIC_USEC`` (CLOCK_MONOTONIC) alongside
        ``RELOADING=1`` to tell this reload from a stale one; older ones ignore it.
        """
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.send("RELOADING=1", f"MONOTONIC_USEC={usec}")

    def stopping(self, status: str | None = None) -> bool:
        """A graceful stop began (the unit shows 'deactivating')."""
        lines = ["STOPPING=1"]
        if status is not None:
            lines.append(_status_line(status))
        return self.send(*lines)

    def status(self, text: str) -> bool:
        """A one-line summary shown by ``systemctl status``."""
        return self.send(_status_line(text))

    def watchdog(self) -> bool:
        """Keep-alive: systemd restarts the service when these stop for ``WatchdogSec=``."""
        return self.send("WATCHDOG=1")


def _status_line(text: str) -> str:
    # A newline would end the STATUS= assignment and start a bogus one.
    one_line = " ".join(text.split())
    return "STATUS=" + one_line[:_MAX_STATUS_CHARS]


class WatchdogPinger:
    """Pings ``WATCHDOG=1`` from the running event loop until stopped.

    ``interval_s`` is the ping period; by default half of the notifier's
    watchdog interval. When the notifier has no watchdog (or is disabled) and
    no period is given, ``start()`` does nothing. The owner calls ``start()``
    once the service is ready and ``await stop()`` on shutdown.
    """

    def __init__(self, notifier: Notifier, interval_s: float | None = None) -> None:
        if interval_s is not None and not (math.isfinite(interval_s) and interval_s > 0):
            raise ValueError(f"interval_s must be a finite number > 0, got {interval_s!r}")
        self.notifier = notifier
        timeout = notifier.watchdog_interval_s()
        self.interval_s = interval_s if interval_s is not None else (timeout / 2 if timeout else None)
        self.pings = 0
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        """Start pinging on the running loop (call from inside it)."""
        if self._task is not None:
            raise RuntimeError("WatchdogPinger already started")
        if self.interval_s is None or not self.notifier.enabled:
            return
        self._task = asyncio.get_running_loop().create_task(self._run(), name="sd-watchdog")

    async def stop(self) -> None:
        """Stop pinging; safe to call when never started or already stopped."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass

    async def _run(self) -> None:
        assert self.interval_s is not None
        while True:
            try:
                self.notifier.watchdog()
                self.pings += 1
            except OSError as exc:
                # Keep trying: if systemd stays unreachable it restarts us anyway,
                # and a transient error (ENOBUFS) must not end the pings for good.
                log.warning("watchdog_ping_failed", error=str(exc))
            await asyncio.sleep(self.interval_s)


@dataclass(frozen=True)
class NotifyMessage:
    """One datagram as systemd would see it."""

    #: ``time.monotonic()`` when it was read
    at: float
    #: the sender's pid from SCM_CREDENTIALS (what ``NotifyAccess=main`` checks)
    pid: int
    text: str

    @property
    def fields(self) -> dict[str, str]:
        """``{"READY": "1", "STATUS": "..."}``."""
        return dict(line.partition("=")[::2] for line in self.text.split("\n") if line)


class NotifyListener:
    """systemd's end of the protocol: a bound datagram socket and a reader thread.

    Point a daemon's ``NOTIFY_SOCKET`` at ``address`` (``/path`` or ``@name``),
    ``start()`` before it runs and ``stop()`` after; ``messages`` holds what
    arrived, with arrival times and sender pids. A thread, not the event loop,
    reads the socket, so a test can block its loop and still see the timing.
    """

    def __init__(self, address: str) -> None:
        self.address = address
        self.messages: list[NotifyMessage] = []
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._sock.bind(notify_address(address))
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self._sock.settimeout(0.05)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, name="notify-listener", daemon=True)

    def start(self) -> "NotifyListener":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._sock.close()

    def __enter__(self) -> "NotifyListener":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _read(self) -> None:
        creds = struct.calcsize("3i")  # struct ucred: pid, uid, gid
        while not self._stop.is_set():
            try:
                data, ancdata, _flags, _addr = self._sock.recvmsg(65536, socket.CMSG_SPACE(creds))
            except TimeoutError:
                continue
            except OSError:
                return  # closed under us by stop()
            pid = -1
            for level, kind, payload in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    pid = array.array("i", payload[:creds])[0]
            with self._lock:
                self.messages.append(NotifyMessage(time.monotonic(), pid, data.decode("utf-8", "replace")))

    def snapshot(self) -> list[NotifyMessage]:
        with self._lock:
            return list(self.messages)

    def texts(self) -> list[str]:
        return [m.text for m in self.snapshot()]

    def times_of(self, text: str) -> list[float]:
        return [m.at for m in self.snapshot() if m.text == text]

    def wait_for(self, predicate: Callable[[list[NotifyMessage]], bool], timeout: float = 10.0) -> list[NotifyMessage]:
        """Block until ``predicate(messages)`` holds; AssertionError after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            got = self.snapshot()
            if predicate(got):
                return got
            if time.monotonic() > deadline:
                raise AssertionError(f"notify messages never matched; got {[m.text for m in got]!r}")
            time.sleep(0.01)

    async def until(self, predicate: Callable[[list[NotifyMessage]], bool], timeout: float = 10.0) -> list[NotifyMessage]:
        """``wait_for`` that keeps the event loop running meanwhile."""
        deadline = time.monotonic() + timeout
        while True:
            got = self.snapshot()
            if predicate(got):
                return got
            if time.monotonic() > deadline:
                raise AssertionError(f"notify messages never matched; got {[m.text for m in got]!r}")
            await asyncio.sleep(0.01)
