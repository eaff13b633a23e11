"""``gpulb-coordinator``: the cluster daemon. Serves agents, clients and
operators on one gRPC port until SIGTERM, then stops gracefully."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

import structlog

from coordinator.config import CoordinatorConfig
from coordinator.server import Coordinator
from protos.runtime import LOG_LEVELS, configure_logging

__all__ = ["main"]

log = structlog.get_logger("gpulb.coordinator")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpulb-coordinator", description="The gpulb coordinator: global GPU view and scheduler.")
    p.add_argument("--listen", default="127.0.0.1:50051", help="HOST:PORT for gRPC; port 0 picks a free one (logged)")
    p.add_argument("--metrics-listen", default="", help="HOST:PORT for Prometheus metrics over HTTP (default off)")
    p.add_argument("--heartbeat-interval", type=float, default=10.0, help="s of silence before a node is UNREACHABLE")
    p.add_argument("--staleness", type=float, default=10.0, help="s after which readings are stale")
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info")
    p.add_argument("--log-format", choices=("auto", "json", "console"), default="auto")
    return p.parse_args(argv)


async def _run(config: CoordinatorConfig) -> int:
    coordinator = Coordinator(config)
    await coordinator.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("coordinator_stopping", grace_s=config.grace_s)
    await coordinator.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    config = CoordinatorConfig(
        listen=args.listen,
        metrics_listen=args.metrics_listen,
        heartbeat_interval_s=args.heartbeat_interval,
        staleness_s=args.staleness,
    )
    return asyncio.run(_run(config))


if __name__ == "__main__":
    sys.exit(main())
