"""A fleet of simulated agents in one process: the shipped fake of a GPU
cluster that tests, benchmarks and examples run against a real coordinator.

Each member is a real ``Agent`` with a ``SimBackend``, streaming over its own
gRPC channel, so everything the coordinator sees went through the production
code path; only the GPUs are simulated.
"""

from __future__ import annotations

import asyncio
from typing import Mapping

from agent.client import Agent, AgentConfig
from agent.sim import SimBackend

__all__ = ["SimFleet"]


class SimFleet:
    """``async with SimFleet(target, hosts=3, gpus=4) as fleet:`` - started,
    connected and streaming on entry, stopped on exit."""

    def __init__(
        self,
        target: str,
        *,
        hosts: int = 2,
        gpus: int = 4,
        workload: str = "idle",
        seed: int = 1,
        interval_s: float = 0.05,
        prefix: str = "sim",
        labels: Mapping[str, Mapping[str, str]] | None = None,
        heartbeat_interval_s: float = 10.0,
        outage_buffer_rounds: int = 300,
        agent_options: Mapping[str, object] | None = None,
        backend_options: Mapping[str, Mapping[str, object]] | None = None,
    ) -> None:
        """``agent_options`` are extra ``AgentConfig`` fields for every member
        (TLS files, token); ``{node_id}`` in a string value is replaced by the
        member's node id. ``backend_options``: per node id, extra ``SimBackend``
        arguments (``model``, ``memory_total_mib``: a cluster of mixed cards)."""
        self.agents: list[Agent] = []
        self._tasks: list[asyncio.Task] = []
        for h in range(hosts):
            node_id = f"{prefix}-{h + 1:02d}"
            config = AgentConfig(
                node_id=node_id,
                coordinator=target,
                labels=dict((labels or {}).get(node_id, {})),
                interval_min_s=interval_s,
                interval_max_s=interval_s * 2,
                backoff_initial_s=0.05,
                backoff_max_s=0.5,
                heartbeat_interval_s=heartbeat_interval_s,
                outage_buffer_rounds=outage_buffer_rounds,
                **{k: (v.format(node_id=node_id) if isinstance(v, str) else v) for k, v in (agent_options or {}).items()},
            )
            backend = SimBackend(gpus=gpus, seed=seed * 1000 + h, workload=workload, node_id=node_id,
                                 **dict((backend_options or {}).get(node_id, {})))
            self.agents.append(Agent(config, backend, seed=seed * 1000 + h))

    def agent(self, node_id: str) -> Agent:
        return next(a for a in self.agents if a.config.node_id == node_id)

    async def start(self, timeout_s: float = 10.0) -> None:
        self._tasks = [asyncio.create_task(a.run(), name=f"agent-{a.config.node_id}") for a in self.agents]
        await asyncio.wait_for(asyncio.gather(*(a.connected.wait() for a in self.agents)), timeout_s)

    async def stop_agent(self, node_id: str) -> None:
        """Stop one member (its stream closes), as if the host went down."""
        for agent, task in zip(self.agents, self._tasks):
            if agent.config.node_id == node_id:
                await agent.stop()
                await task

    async def stop(self) -> None:
        for agent in self.agents:
            await agent.stop()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for agent in self.agents:
            agent.backend.close()

    async def __aenter__(self) -> "SimFleet":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()
