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
