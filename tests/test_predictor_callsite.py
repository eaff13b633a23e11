"""Which completions the coordinator's advisor runtime teaches the predictor
(QA pass 25 #3): a task completed before its agent said it started, with no
run time from its client, teaches nothing."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from coordinator.advisor import AdvisorRuntime
from scheduler.config import SchedulerConfig
from scheduler.engine import Scheduler
from scheduler.snapshot import ClusterSnapshot, NodeFacts
from scheduler.task import TaskSpec, TaskState

RTX = "NVIDIA GeForce RTX 4090"


class _Cluster:
    def __init__(self) -> None:
        self.now = 1_000.0
        self.snap = ClusterSnapshot.build([NodeFacts("b-rtx", 1, model=RTX)])
        self.engine = Scheduler(SchedulerConfig(lease_s=1e9), clock=lambda: self.now)
        self.rt = AdvisorRuntime(snapshot=lambda: self.snap, tasks=lambda: self.engine.tasks(state=TaskState.LEASED),
                                 clock=lambda: self.now, unix_ns=lambda s: int(s * 1e9))
        self.engine.add_listener(self.rt.on_task_change)

    def run(self, task_id: str, kind: str, *, estimate_s: float, took_s: float, started: bool = True,
            reported_s: float | None = None) -> None:
        self.engine.submit(TaskSpec(task_id, kind=kind, vram_mib=1_000.0, gpu_share=0.1, duration_s=estimate_s),
                           self.snap)
        (task,) = self.engine.dispatch(replace(self.snap, node_schedulable=np.ones(1, dtype=bool)))
        if started:
            self.rt.task_started(task_id)
        if reported_s is not None:
            self.rt.note_actual_duration(task_id, reported_s)
        self.now += took_s
        self.engine.complete(task_id, task.assignment.lease_id)


def test_a_task_completed_before_it_was_seen_to_start_teaches_nothing():
    c = _Cluster()
    p = c.rt.predictor
    for i in range(25):
        c.run(f"warm-{i}", "", estimate_s=1.0, took_s=1.7)
    before = (p.model_factor(RTX), p.node_factor("b-rtx"), p.samples, p.mape())
    assert p.samples == 25
    # completed at once, no STARTED event, no actual_duration_s: a 4 ms "run" before
    c.run("mg-ok", "mg", estimate_s=1.0, took_s=0.004, started=False)
    assert (p.model_factor(RTX), p.node_factor("b-rtx"), p.samples, p.mape()) == before
    assert "mg" not in p.kinds
    # the client's measure is a run time, STARTED or not
    c.run("mg-2", "mg", estimate_s=1.0, took_s=0.004, started=False, reported_s=1.8)
    assert p.samples == 26 and p.model_factor(RTX, "mg") == pytest.approx(p.model_factor(RTX), rel=0.2)
