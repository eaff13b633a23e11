"""The demo's workload: a seeded, reproducible mix of the four scenarios gpulb
is built for, sized to the cluster and to one phase of the demo.

A pure function of (seed, window, cluster shape): both policy phases replay
the same list, so their figures compare like with like. Times are compressed
for a demo that lasts about a minute: LoRA fine-tunes that take minutes on a
real cluster run for a third to a half of the phase's window here.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

from scheduler.task import Priority

__all__ = ["DemoTask", "SCENARIOS", "build_workload"]

GIB = 1024

#: scenario -> (client / tenant name, label for people)
SCENARIOS: dict[str, tuple[str, str]] = {
    "sd-inference": ("sd-serving", "P0 Stable Diffusion inference"),
    "lora-finetune": ("ml-research", "P1 LLaMA LoRA fine-tune"),
    "video-transcode": ("media", "P2 video transcode"),
    "analysis": ("analytics", "P3 background analysis"),
}


@dataclass(frozen=True, slots=True)
class DemoTask:
    """One submission of the workload; units as in ``gpulb.v1.TaskSpec``."""

    name: str  # unique within the workload, e.g. "p0-sd-0007"
    scenario: str  # key of SCENARIOS
    submit_s: float  # s from the start of the phase
    priority: Priority
    kind: str
    num_gpus: int
    vram_mib: int  # per GPU
    gpu_share: float  # 0..1 of each GPU
    run_s: float  # s it runs once placed
    # The client holds the lease and calls CompleteTask after run_s (the spec
    # says duration 0: the agent runs it until released).
    client_completes: bool = False

    @property
    def tenant(self) -> str:
        return SCENARIOS[self.scenario][0]


def build_workload(seed: int, window_s: float, agents: int, gpus_per_agent: int) -> list[DemoTask]:
    """The tasks of one phase, ordered by submit time.

    Arrival rates scale with the GPU count, so a 4-GPU and a 24-GPU cluster
    are about as busy; a task is submitted early enough that it would finish
    inside the window if it were placed at once (runs are cut to fit):

    * P0 SD inference: bursts every 1.5-4 s of 1..max(2, gpus/4) requests,
      2-6 GiB, 0.3-1.2 s, gpu_share 0.3-0.6;
    * P1 LoRA fine-tune: max(1, gpus/4) jobs on 2-4 GPUs of one host (at most
      gpus_per_agent), 16-19.5 GiB per GPU, gpu_share 0.8-0.95, running
      0.3-0.5 of the window (standing for minutes);
    * P2 video transcode: Poisson arrivals, gpus/8 a second, 2 GiB,
      gpu_share 0.2-0.4 (NVENC does most of the work), 0.1-0.25 of the window;
    * P3 background analysis: Poisson arrivals, gpus/24 a second, 1-4 GiB,
      gpu_share 0.1-0.3, held by the client
      for 0.1-0.3 of the window and completed with CompleteTask.
    """
    if window_s <= 0:
        raise ValueError("window_s must be > 0")
    if agents < 1 or gpus_per_agent < 1:
        raise ValueError("agents and gpus_per_agent must be >= 1")
    gpus = agents * gpus_per_agent
    rng = random.Random(f"gpulb-demo:{seed}")
    tasks: list[DemoTask] = []
    last_submit = 0.9 * window_s

    # P0: bursts of SD requests, as when a front end fans out a batch of prompts.
    t = rng.uniform(0.2, 1.0)
    n = 0
    while t < last_submit:
        for _ in range(rng.randint(1, max(2, gpus // 4))):
            n += 1
            tasks.append(
                DemoTask(
                    name=f"p0-sd-{n:04d}",
                    scenario="sd-inference",
                    submit_s=round(t + rng.uniform(0.0, 0.05), 3),
                    priority=Priority.P0,
                    kind="inference",
                    num_gpus=1,
                    vram_mib=rng.randint(2 * GIB, 6 * GIB),
                    gpu_share=round(rng.uniform(0.3, 0.6), 2),
                    run_s=round(rng.uniform(0.3, 1.2), 2),
                )
            )
        t += rng.uniform(1.5, 4.0)

    # P1: LoRA fine-tunes on several GPUs of one host.
    if gpus_per_agent >= 2:
        for n in range(1, max(1, gpus // 4) + 1):
            run = round(window_s * rng.uniform(0.3, 0.5), 1)
            tasks.append(
                DemoTask(
                    name=f"p1-lora-{n:04d}",
                    scenario="lora-finetune",
                    submit_s=round(rng.uniform(0.0, max(0.0, window_s - run) * 0.8), 3),
                    priority=Priority.P1,
                    kind="training",
                    num_gpus=rng.randint(2, min(4, gpus_per_agent)),
                    vram_mib=rng.randint(16 * GIB, int(19.5 * GIB)),
                    gpu_share=round(rng.uniform(0.8, 0.95), 2),
                    run_s=run,
                )
            )

    # P2: a steady trickle of transcodes.
    t = rng.uniform(0.0, 1.0)
    n = 0
    rate = max(0.25, gpus / 8.0)  # per s
    while t < 0.8 * window_s:
        n += 1
        tasks.append(
            DemoTask(
                name=f"p2-video-{n:04d}",
                scenario="video-transcode",
                submit_s=round(t, 3),
                priority=Priority.P2,
                kind="batch",
                num_gpus=1,
                vram_mib=2 * GIB,
                gpu_share=round(rng.uniform(0.2, 0.4), 2),
                run_s=round(window_s * rng.uniform(0.1, 0.25), 1),
            )
        )
        t += rng.expovariate(rate)

    # P3: analysis jobs the client holds and completes itself.
    t = rng.uniform(0.0, 2.0)
    n = 0
    rate = max(0.1, gpus / 24.0)
    while t < 0.7 * window_s:
        n += 1
        tasks.append(
            DemoTask(
                name=f"p3-analysis-{n:04d}",
                scenario="analysis",
                submit_s=round(t, 3),
                priority=Priority.P3,
                kind="background",
                num_gpus=1,
                vram_mib=rng.randint(1 * GIB, 4 * GIB),
                gpu_share=round(rng.uniform(0.1, 0.3), 2),
                run_s=round(window_s * rng.uniform(0.1, 0.3), 1),
                client_completes=True,
            )
        )
        t += rng.expovariate(rate)

    # The phase's window bounds every run, so a phase drains soon after it.
    tasks = [replace(t, run_s=min(t.run_s, math.floor((window_s - t.submit_s) * 100) / 100)) for t in tasks]
    tasks.sort(key=lambda x: (x.submit_s, x.name))
    return tasks
