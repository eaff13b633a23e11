"""Streaming and waiting calls end promptly when the coordinator stops.

``grpc.aio.Server.stop(grace)`` lets calls in flight run for ``grace``
seconds, then cancels them. A call that waits for something that will not
come (ScheduleTask waiting for a placement, WatchTask, WatchView, WatchPlans)
held every stop for the whole grace (5 s by default: systemd's stop, and every
restart, took that long) and its client then saw "Cancelling all calls".
``Coordinator.stop`` sets ``stopping`` first: a waiting ScheduleTask returns
the task as it is (QUEUED: it is stored and will be placed after the
restart), and a watch ends with UNAVAILABLE and a message that says to watch
again, which gRPC clients treat as retryable.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

import grpc

__all__ = ["SHUTTING_DOWN", "TOKEN_REVOKED", "or_shutdown"]

T = TypeVar("T")

SHUTTING_DOWN = "coordinator is shutting down; call again once it is back (queued tasks and leases are kept)"
TOKEN_REVOKED = "the token this stream was opened with was revoked (the token file was reloaded); call again with a valid one"


async def or_shutdown(awaitable: Awaitable[T], stopping: asyncio.Event, context,
                      revoked: asyncio.Event | None = None) -> T:
    """``await awaitable``, unless ``stopping`` is set first: then the call
    ends UNAVAILABLE (``SHUTTING_DOWN``); or unless ``revoked`` (the watch's
    ``StreamSlot.revoked``: its token left the token file at a reload) is set:
    then it ends UNAUTHENTICATED (``TOKEN_REVOKED``)."""
    for event, code, message in ((stopping, grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN),
                                 (revoked, grpc.StatusCode.UNAUTHENTICATED, TOKEN_REVOKED)):
        if event is not None and event.is_set():
            if asyncio.iscoroutine(awaitable):
                awaitable.close()  # never awaited: no "coroutine was never awaited" warning
            await context.abort(code, message)
    work = asyncio.ensure_future(awaitable)
    stop = asyncio.ensure_future(stopping.wait())
    waits = {work, stop}
    if revoked is not None:
        waits.add(asyncio.ensure_future(revoked.wait()))
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits - {work}:
            wait.cancel()
        if not work.done():
            work.cancel()  # the coordinator stops, the token was revoked, or the caller went away
    if not work.done() or work.cancelled():  # cancel() above takes a turn of the loop to land
        if revoked is not None and revoked.is_set() and not stopping.is_set():
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, TOKEN_REVOKED)
        await context.abort(grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN)
    return work.result()
