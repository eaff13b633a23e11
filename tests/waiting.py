"""Polling helper shared by the tests that drive real servers."""

from __future__ import annotations

import asyncio
import time

import grpc


async def until(predicate, timeout: float = 15.0, what: str = "condition", every: float = 0.05):
    """Poll ``predicate`` (a function, possibly returning a coroutine) until it
    returns something truthy; return that. An RPC error counts as "not yet"."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            value = predicate()
            if asyncio.iscoroutine(value):
                value = await value
        except grpc.aio.AioRpcError:
            value = None
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(every)


def wait_until(predicate, what: str, seconds: float = 30.0, every: float = 0.1):
    """``until`` for plain code: poll ``predicate`` until it returns something
    truthy and return that; an exception from it counts as "not yet" (a
    server not serving yet, a process not started)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            got = predicate()
        except Exception:
            got = None
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


class CoordinatorProcess:
    """A real ``gpulb-coordinator`` process on ``config`` with its JSON log in
    ``log_path``, for tests that signal it (SIGHUP) and read its events."""

    def __init__(self, config, log_path, env: dict | None = None) -> None:
        import os
        import subprocess
        import sys

        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "coordinator.main", "--config", str(config)],
                                         env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                         stdout=log, stderr=subprocess.STDOUT)

    def events(self, name: str) -> list[dict]:
        """The log's JSON events named ``name``, oldest first."""
        import json

        return [json.loads(line) for line in self.log_path.read_text().splitlines()
                if line.startswith("{") and f'"event": "{name}"' in line]

    def wait_for(self, predicate, what: str, seconds: float = 30.0) -> None:
        """Poll ``predicate``; fail with the log's tail if the process ends or time runs out."""
        deadline = time.monotonic() + seconds
        while not predicate():
            assert self.proc.poll() is None, self.log_path.read_text()
            assert time.monotonic() < deadline, f"{what}: {self.log_path.read_text()[-2000:]}"
            time.sleep(0.1)

    def stop(self) -> None:
        import signal
        import subprocess

        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
