"""A simulated GPU host: RTX 4090-like cards whose readings move like real ones.

``SimBackend`` is the agent's ``--backend sim`` and the fake the tests and the
demo run on (STYLE.md #8). Load comes from a synthetic background workload,
from a real trace (``workload="replay"``), and from tasks the coordinator
placed (``place``/``release``); the readings follow from the load through a
small physical model, so adaptive sampling, deadbands, smoothing and the
scheduler all see plausible signals. Everything is a function of the seed and
of the readings of the injected clock: the same seed and the same clock
readings give the same samples.
"""

from __future__ import annotations

import math
import random
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import structlog

from agent.backend import (
    BackendUnavailable,
    GpuInfo,
    GpuProcess,
    GpuSample,
    Health,
    TopologyLink,
)
from agent.replay import ReplaySeries, load_genai
from protos import telemetry_pb2 as pb

log = structlog.get_logger("gpulb.agent.sim")

__all__ = ["SimBackend", "SimTaskEvent", "Workload", "TaskEventKind", "sim_gpu_uuid"]

Workload = Literal["synthetic", "idle", "replay"]
TaskEventKind = Literal["started", "finished", "oom_killed", "failed"]

# --- the physical model (an RTX 4090 on an open bench, roughly) -------------
AMBIENT_C = 30.0
#: °C above ambient per watt at steady state: ~75 °C at 400 W
C_PER_W = 0.11
#: first-order thermal time constant of die + heatsink
THERMAL_TAU_S = 40.0
IDLE_POWER_W = 30.0
#: a card at 100 % util draws ~90 % of the headroom above idle
POWER_HEADROOM_USE = 0.9
#: memory the driver and context hold on every card
DRIVER_BASE_MIB = 300
SM_IDLE_MHZ = 210
SM_BOOST_MHZ = 2520
#: GPU Boost reaches full clock at modest load, then holds it
SM_FULL_BOOST_AT_PCT = 25.0
#: above this the card sheds clock to stay cool
THROTTLE_AT_C = 83.0
THROTTLE_MHZ_PER_C = 30.0
#: integration step; the load is piecewise constant well above this
_MAX_STEP_S = 1.0
#: beyond this many time constants the past no longer shows in temperature
_FORGET_AFTER_S = 10 * THERMAL_TAU_S
_UTIL_NOISE_PCT = 1.5
_POWER_NOISE = 0.01
_PCIE_RX_KBPS_PER_PCT = 12_000
_PCIE_TX_KBPS_PER_PCT = 5_000
#: share of util that shows as memory-controller util, by task kind
_MEM_UTIL_RATIO = {"training": 0.6, "inference": 0.4, "io": 0.3, "background": 0.35}
_DEFAULT_MEM_UTIL_RATIO = 0.45
_NVLINK_PAIR_LINKS = 4
_BACKGROUND_PID = 30_000
_TASK_PID = 50_000


def sim_gpu_uuid(node_id: str, seed: int, index: int) -> str:
    """The UUID of a simulated GPU: a function of the host's node id, its
    seed and the GPU's index, in NVML's form ("GPU-" and a version-4 UUID)."""
    bits = random.Random(f"gpulb-sim-uuid:{node_id}:{seed}:{index}").getrandbits(128)
    return f"GPU-{uuid.UUID(int=bits, version=4)}"


@dataclass(frozen=True, slots=True)
class SimTaskEvent:
    """Something that happened to a placed task, for the agent to report."""

    task_id: str
    kind: TaskEventKind
    detail: str = ""
    # MiB: finished, the most the task used on one GPU; oom_killed, the use
    # that killed it; 0 unknown (the coordinator learns memory growth from it)
    peak_vram_mib: float = 0.0


@dataclass(slots=True)
class _Task:
    task_id: str
    gpus: tuple[int, ...]
    vram_mib: int  # on each of its GPUs
    share_pct: float  # util it adds on each of its GPUs
    kind: str
    started_s: float
    ends_s: float | None  # None: runs until released
    pid: int
    seq: int  # placement order


@dataclass(frozen=True, slots=True)
class _Segment:
    start_s: float
    end_s: float
    util_pct: float
    vram_mib: int


@dataclass(slots=True)
class _Load:
    util_pct: float
    mem_util_pct: float
    vram_mib: int
    processes: tuple[GpuProcess, ...]


class _SyntheticLoad:
    """One GPU's background job: a level that holds for a while, then steps,
    with occasional short bursts. A function of time only, so the workload
    does not depend on how often anyone samples."""

    _LEVELS = (
        # weight, util range, vram range (MiB)
        (0.35, (0.0, 0.0), (0, 0)),
        (0.25, (10.0, 35.0), (1024, 4096)),
        (0.30, (45.0, 85.0), (4096, 12288)),
        (0.10, (90.0, 100.0), (8192, 16384)),
    )
    _MEAN_HOLD_S = 45.0
    _BURST_CHANCE = 0.15

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self._segments: list[_Segment] = []
        self._i = 0

    def _next(self, start: float, prev: _Segment | None) -> _Segment:
        rng = self._rng
        if prev is not None and rng.random() < self._BURST_CHANCE:
            # A burst: the same job briefly at full tilt.
            return _Segment(start, start + rng.uniform(2.0, 8.0), rng.uniform(95.0, 100.0), prev.vram_mib)
        r = rng.random()
        for weight, (ulo, uhi), (vlo, vhi) in self._LEVELS:
            if r < weight:
                break
            r -= weight
        hold = max(5.0, rng.expovariate(1.0 / self._MEAN_HOLD_S))
        return _Segment(start, start + hold, rng.uniform(ulo, uhi), rng.randint(vlo, vhi))

    def at(self, t: float) -> _Segment:
        if not self._segments:
            self._segments.append(self._next(0.0, None))
        # Callers move forward in time; step the cursor, generating lazily.
        while self._i > 0 and t < self._segments[self._i].start_s:
            self._i -= 1
        while t >= self._segments[self._i].end_s:
            if self._i + 1 == len(self._segments):
                last = self._segments[-1]
                self._segments.append(self._next(last.end_s, last))
            self._i += 1
        if self._i > 4096:
            # Old history is never asked for again; keep memory flat.
            del self._segments[: self._i - 16]
            self._i = 16
        return self._segments[self._i]


class SimBackend:
    """``gpus`` simulated cards of one model. See the module docstring.

    Physics per GPU, from the load (background + placed tasks, util capped at
    100 %)::

        util      = load + noise (0 when idle)
        memory    = 300 MiB driver + background VRAM + tasks' VRAM
        power     = min(limit, 30 W + util/100 * (limit - 30 W) * 0.9)
        temp      -> 30 °C + 0.11 °C/W * power, first-order lag, tau 40 s
        sm clock  = 210 MHz idle, boosting to 2520 MHz by 25 % util, minus
                    30 MHz/°C above 83 °C; 15 MHz bins
        processes = one per placed task, plus the background job when busy

    Topology: GPUs (0, 1), (2, 3), ... are NVLink pairs; every other pair
    shares a PCIe switch. Placed tasks: a task whose VRAM does not fit next to
    what the GPU holds is OOM-killed (it never starts); a task past its
    duration finishes. Other tenants' memory: when the background job grows
    past what gpulb's tasks left free, *its* allocation is refused, as CUDA
    refuses the process that asks for memory the card no longer has, not the
    ones already holding theirs: the background gets what is free, runs on
    with it (as a framework that catches the error and retries would), and
    each such episode is counted (``tenant_ooms``, per GPU) and logged
    (``sim_tenant_oom``): harm gpulb's placements did to a co-tenant. GPU
    UUIDs derive from ``node_id``, the seed and the GPU index, so two hosts
    given the same seed still report different GPUs (the coordinator refuses
    a GPU uuid another node holds); the readings derive from the seed alone.
    """

    name = "sim"

    def __init__(
        self,
        gpus: int = 4,
        seed: int = 0,
        clock: Callable[[], float] = time.monotonic,
        model: str = "NVIDIA GeForce RTX 4090",
        memory_total_mib: int = 24564,
        power_limit_mw: int = 450_000,
        workload: Workload = "synthetic",
        replay: Sequence[ReplaySeries] | ReplaySeries | None = None,
        replay_speed: float = 1.0,
        ecc: bool = False,
        node_id: str = "",
    ) -> None:
        if gpus < 1:
            raise ValueError("gpus must be >= 1")
        if memory_total_mib <= DRIVER_BASE_MIB:
            raise ValueError(f"memory_total_mib must exceed the {DRIVER_BASE_MIB} MiB driver base")
        if power_limit_mw <= IDLE_POWER_W * 1000:
            raise ValueError("power_limit_mw must exceed idle power")
        if workload not in ("synthetic", "idle", "replay"):
            raise ValueError(f"unknown workload {workload!r}")
        if not (math.isfinite(replay_speed) and replay_speed > 0):
            raise ValueError("replay_speed must be > 0")
        self._n = gpus
        self._clock = clock
        self._model = model
        self._total_mib = memory_total_mib
        self._limit_w = power_limit_mw / 1000.0
        self._workload = workload
        self._speed = replay_speed
        self._ecc = ecc
        self._replay: list[ReplaySeries] = []
        if workload == "replay":
            if replay is None:
                try:
                    replay = load_genai(max_pods=gpus)
                except FileNotFoundError as exc:
                    raise BackendUnavailable(f"replay traces not found: {exc}") from exc
            self._replay = [replay] if isinstance(replay, ReplaySeries) else list(replay)
            if not self._replay:
                raise ValueError("replay workload needs at least one series")

        self._inventory = [
            GpuInfo(
                index=i,
                uuid=sim_gpu_uuid(node_id, seed, i),
                model=model,
                memory_total_mib=memory_total_mib,
                power_limit_mw=power_limit_mw,
                pci_bus_id=f"00000000:{0x01 + i:02X}:00.0",
            )
            for i in range(gpus)
        ]
        self._background = [_SyntheticLoad(random.Random(f"gpulb-sim-load:{seed}:{i}")) for i in range(gpus)]
        self._noise = [random.Random(f"gpulb-sim-noise:{seed}:{i}") for i in range(gpus)]
        self._t0 = clock()
        self._t = 0.0  # virtual seconds since construction
        # virtual time at which the background workload's timeline starts
        # (rewind_background moves it, so a comparison replays the same load)
        self._background_origin = 0.0
        self._temp_c = [self._target_temp(IDLE_POWER_W)] * gpus
        self._tasks: dict[str, _Task] = {}
        self._events: list[SimTaskEvent] = []
        self._seq = 0
        self._closed = False
        #: per GPU: episodes of the background job refused memory gpulb's tasks held
        self.tenant_ooms = [0] * gpus
        self._tenant_refused = [False] * gpus

    # --- the GpuBackend seam ------------------------------------------------

    def inventory(self) -> list[GpuInfo]:
        return list(self._inventory)

    def topology(self) -> list[TopologyLink]:
        links = []
        for a in range(self._n):
            for b in range(a + 1, self._n):
                if a // 2 == b // 2:
                    links.append(TopologyLink(a, b, pb.LINK_KIND_NVLINK, _NVLINK_PAIR_LINKS))
                else:
                    links.append(TopologyLink(a, b, pb.LINK_KIND_PCIE_SWITCH, 0))
        return links

    def sample(self) -> list[GpuSample]:
        self._advance()
        return [self._read(i) for i in range(self._n)]

    def close(self) -> None:
        self._closed = True

    # --- placed tasks -------------------------------------------------------

    def place(
        self,
        task_id: str,
        gpu_indices: Sequence[int],
        vram_mib: int,
        gpu_share: float,
        duration_s: float,
        kind: str,
    ) -> None:
        """Start a task on ``gpu_indices``: ``vram_mib`` and ``gpu_share``
        (0..1 of one GPU's compute) on each of them, for ``duration_s``
        seconds (0: until released). The outcome arrives through
        ``drain_events``: "started", "oom_killed" if it does not fit, or
        "failed" if the placement itself is invalid (bad index or value).

        The arguments come off the network, so nothing here raises: an agent
        must not fall over on one bad placement. Placing a task id that is
        already running does nothing, so a placement re-sent after a
        reconnect neither restarts nor fails the task.
        """
        self._advance()
        if task_id in self._tasks:
            return
        gpus = tuple(gpu_indices)
        problem = _placement_problem(gpus, self._n, vram_mib, gpu_share, duration_s)
        if problem:
            self._events.append(SimTaskEvent(task_id, "failed", problem))
            return
        for g in gpus:
            used = self._load_at(g, self._t).vram_mib
            if used + vram_mib > self._total_mib:
                self._events.append(
                    SimTaskEvent(
                        task_id,
                        "oom_killed",
                        f"GPU {g}: needs {vram_mib} MiB, {self._total_mib - used} MiB free",
                        float(vram_mib),
                    )
                )
                return
        self._seq += 1
        self._tasks[task_id] = _Task(
            task_id=task_id,
            gpus=gpus,
            vram_mib=int(vram_mib),
            share_pct=100.0 * gpu_share,
            kind=kind,
            started_s=self._t,
            ends_s=self._t + duration_s if duration_s > 0 else None,
            pid=_TASK_PID + self._seq,
            seq=self._seq,
        )
        self._events.append(SimTaskEvent(task_id, "started", f"GPUs {list(gpus)}"))

    def running_task_ids(self) -> list[str]:
        """Ids of the placed tasks running now, sorted (the agent's registration
        carries them, so the coordinator can set right what a dropped stream lost)."""
        self._advance()
        return sorted(self._tasks)

    def release(self, task_id: str) -> bool:
        """Stop a running task (the coordinator cancelled or completed it).
        True if it was running. No event: the caller already knows."""
        self._advance()
        return self._tasks.pop(task_id, None) is not None

    def drain_events(self) -> list[SimTaskEvent]:
        """Task events since the last call, oldest first."""
        self._advance()
        events, self._events = self._events, []
        return events

    # --- the model ----------------------------------------------------------

    @staticmethod
    def _target_temp(power_w: float) -> float:
        return AMBIENT_C + C_PER_W * power_w

    def _power_w(self, util_pct: float) -> float:
        return min(self._limit_w, IDLE_POWER_W + util_pct / 100.0 * (self._limit_w - IDLE_POWER_W) * POWER_HEADROOM_USE)

    def rewind_background(self) -> None:
        """Start the background workload's timeline over from now: the other
        tenants' jobs replay as they ran since construction. Placed tasks,
        temperatures and clocks carry on. For comparisons (the demo runs one
        phase per policy): without it the second phase meets other tenants'
        load the first never saw, and the figures compare luck as well."""
        self._advance()
        self._background_origin = self._t

    def _background_at(self, gpu: int, t: float) -> tuple[float, int]:
        """(util %, VRAM MiB) of the GPU's own workload at virtual time t."""
        t = max(0.0, t - self._background_origin)
        if self._workload == "synthetic":
            seg = self._background[gpu].at(t)
            return seg.util_pct, seg.vram_mib
        if self._workload == "replay":
            series = self._replay[gpu % len(self._replay)]
            util = series.duty_pct_at(t, speed=self._speed)
            vram = series.memory_mib_at(t, capacity_mib=self._total_mib - DRIVER_BASE_MIB, speed=self._speed)
            return (util or 0.0), (vram or 0)
        return 0.0, 0

    def _load_at(self, gpu: int, t: float) -> _Load:
        return self._load_and_refused(gpu, t)[0]

    def _load_and_refused(self, gpu: int, t: float) -> tuple[_Load, int]:
        """The GPU's load at ``t``, and the MiB the background job asked for
        beyond what gpulb's tasks left free (refused: 0 when it all fit)."""
        bg_util, bg_asked = self._background_at(gpu, t)
        util = bg_util
        mem_util = bg_util * _MEM_UTIL_RATIO["background"]
        tasks_vram = 0
        procs = []
        for task in self._tasks.values():
            if gpu in task.gpus and task.started_s <= t and (task.ends_s is None or t < task.ends_s):
                util += task.share_pct
                mem_util += task.share_pct * _MEM_UTIL_RATIO.get(task.kind, _DEFAULT_MEM_UTIL_RATIO)
                tasks_vram += task.vram_mib
                procs.append(GpuProcess(task.pid, task.vram_mib))
        refused = 0
        bg_vram = bg_asked
        if tasks_vram:
            # the tasks hold theirs; the background gets what is left of the card
            bg_vram = min(bg_asked, max(0, self._total_mib - DRIVER_BASE_MIB - tasks_vram))
            refused = bg_asked - bg_vram
        if bg_util > 0 or bg_vram > 0:
            procs.insert(0, GpuProcess(_BACKGROUND_PID + gpu, bg_vram))
        vram = DRIVER_BASE_MIB + bg_vram + tasks_vram
        return _Load(min(100.0, util), min(100.0, mem_util), vram, tuple(procs)), refused

    def _advance(self) -> None:
        """Move the model to the clock's now: temperatures, finished tasks,
        OOM kills."""
        now = max(self._t, self._clock() - self._t0)
        t = self._t
        if now - t > _FORGET_AFTER_S:
            t = now - _FORGET_AFTER_S
        while t < now:
            dt = min(_MAX_STEP_S, now - t)
            decay = 1.0 - math.exp(-dt / THERMAL_TAU_S)
            for g in range(self._n):
                target = self._target_temp(self._power_w(self._load_at(g, t).util_pct))
                self._temp_c[g] += (target - self._temp_c[g]) * decay
            t += dt
        self._t = now

        for task in sorted(
            (x for x in self._tasks.values() if x.ends_s is not None and x.ends_s <= now),
            key=lambda x: (x.ends_s, x.seq),
        ):
            del self._tasks[task.task_id]
            # a simulated task holds its ask from start to end: that is its peak
            self._events.append(
                SimTaskEvent(task.task_id, "finished", f"after {task.ends_s - task.started_s:g} s", float(task.vram_mib))
            )

        for g in range(self._n):
            load, refused = self._load_and_refused(g, now)
            if refused and not self._tenant_refused[g]:
                # one episode: counted when the refusal starts, not at every sample of it
                self.tenant_ooms[g] += 1
                log.info("sim_tenant_oom", gpu=g, refused_mib=refused, used_mib=min(self._total_mib, load.vram_mib),
                         gpulb_tasks=sum(1 for x in self._tasks.values() if g in x.gpus))
            self._tenant_refused[g] = refused > 0

    def _read(self, gpu: int) -> GpuSample:
        load = self._load_at(gpu, self._t)
        rng = self._noise[gpu]
        busy = load.util_pct > 0
        # Noise is drawn for every GPU every sample, busy or not, so one GPU's
        # load never shifts another GPU's random stream.
        n_util, n_mem, n_pow, n_rx, n_tx = (rng.gauss(0.0, 1.0) for _ in range(5))
        util = _clamp_pct(load.util_pct + _UTIL_NOISE_PCT * n_util) if busy else 0
        mem_util = _clamp_pct(load.mem_util_pct + _UTIL_NOISE_PCT * n_mem) if busy else 0
        power_w = min(self._limit_w, self._power_w(load.util_pct) * (1.0 + _POWER_NOISE * n_pow))
        temp = self._temp_c[gpu]
        clock = SM_IDLE_MHZ
        if busy:
            boost = SM_IDLE_MHZ + (SM_BOOST_MHZ - SM_IDLE_MHZ) * min(1.0, load.util_pct / SM_FULL_BOOST_AT_PCT)
            boost -= THROTTLE_MHZ_PER_C * max(0.0, temp - THROTTLE_AT_C)
            clock = max(SM_IDLE_MHZ, int(round(boost / 15.0)) * 15)
        rx = max(0, round(load.util_pct * _PCIE_RX_KBPS_PER_PCT * (1.0 + 0.05 * n_rx)))
        tx = max(0, round(load.util_pct * _PCIE_TX_KBPS_PER_PCT * (1.0 + 0.05 * n_tx)))
        return GpuSample(
            index=gpu,
            health=Health.OK,
            util_gpu_pct=util,
            util_memory_pct=mem_util,
            memory_used_mib=min(self._total_mib, load.vram_mib),
            memory_total_mib=self._total_mib,
            temperature_c=int(round(temp)),
            power_mw=int(round(power_w * 1000)),
            power_limit_mw=int(round(self._limit_w * 1000)),
            sm_clock_mhz=clock,
            pcie_rx_kbps=rx,
            pcie_tx_kbps=tx,
            ecc_corrected=0 if self._ecc else None,
            ecc_uncorrected=0 if self._ecc else None,
            process_count=len(load.processes),
            processes=load.processes,
        )


def _placement_problem(gpus: tuple[int, ...], n: int, vram_mib: float, gpu_share: float, duration_s: float) -> str:
    """Why a placement cannot run, or "" when it can."""
    if not gpus or len(set(gpus)) != len(gpus) or any(not 0 <= g < n for g in gpus):
        return f"gpu_indices {list(gpus)} must be distinct indices in 0..{n - 1}"
    if not (math.isfinite(vram_mib) and vram_mib >= 0):
        return f"vram_mib {vram_mib!r} must be >= 0"
    if not (math.isfinite(gpu_share) and 0.0 <= gpu_share <= 1.0):
        return f"gpu_share {gpu_share!r} must be within 0..1"
    if not (math.isfinite(duration_s) and duration_s >= 0):
        return f"duration_s {duration_s!r} must be >= 0"
    return ""


def _clamp_pct(v: float) -> int:
    return max(0, min(100, int(round(v))))
