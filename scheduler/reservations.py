"""Reservations (the "assume" step) and leases.

A placement reserves its VRAM and utilisation share on each chosen GPU at once,
so two placements made before the next metrics arrive cannot both take the
last free memory. The reservation fades as the agent's readings show the task
and ends with the lease.

Per GPU the reservations form a stack on top of a baseline: ``B`` (MiB of
memory used when the stack was started, see below), ``R`` (MiB reserved, the
sum over live leases) and ``U`` (% util reserved). Given the GPU's current
memory reading ``u``::

    effective VRAM  e = clip(B + R - u, 0, R)    (fresh, finite reading)
                    e = R                        (stale node or NaN reading)
    effective util    = min(U * e / R, clip(Bu + U - x, 0, U))   (0 when R = 0)

with ``x`` the GPU's util reading and ``Bu`` its util baseline (kept as ``B``
is; ``U * e / R`` alone with no fresh, finite util reading), i.e. the part of
the stack that the readings do not show yet. Compute counts as shown when
either reading shows it: a task that uses less memory than it asked never
raises the memory reading by its ask, and with the memory rule alone its
compute stayed reserved for its whole run on top of the util reading that
already showed it (openb replays: a third of the GPUs whose leases had all
run 30 s or more read 11-17 % more load than they carried). It is the
brief's ``max(0, reserved - (used_now - used_at_reservation))`` for one
reservation, and attributes growth first-come-first-served when several
reservations share a GPU, so one task showing up does not fade another's.

Keeping ``e`` right as things change (``Bu`` and ``U`` alike, against the
util reading):

* adding ``r`` at reading ``u``: ``B <- max(B, u - R)``, ``R <- R + r``, so
  ``e`` grows by exactly ``r`` even if something else grew the reading;
* a finite fresh reading below ``B`` lowers ``B`` to it (memory was freed under
  the stack; the stack still has to show up in full);
* releasing a lease removes its ``r`` from ``R``; the stack above it moves down,
  which is right because the finished task's memory is free whatever the last
  reading says. When the last lease on a GPU ends, its stack is forgotten.

The engine turns the per-GPU state into columns once per snapshot (a Python
pass over the reserved GPUs only) and then patches single rows per placement.
"""

from __future__ import annotations

import heapq
import itertools
import math
import os
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

__all__ = ["GpuReservation", "Reservations", "ReservedColumns", "Lease", "LeaseBook"]


@dataclass(slots=True)
class GpuReservation:
    """The reservation stack of one GPU (see module docstring for B, R, U).

    Its fields are part of the interface: ``scheduler.simulator`` mirrors them
    into arrays of its own.
    """

    baseline_mib: float
    vram_mib: float = 0.0
    util_pct: float = 0.0
    members: dict[str, tuple[float, float]] = field(default_factory=dict)  # key -> (MiB, %)
    baseline_util_pct: float = math.inf  # Bu: inf until a fresh util reading is known
    # MiB and % of the stack added, at an unknown reading, on top of leases
    # "shown" (restored: B = -inf): not in any reading yet, so the first
    # fresh reading sets B (Bu) to it less the rest of the stack (settle)
    pending_mib: float = 0.0
    pending_util_pct: float = 0.0

    def settle(self, used_mib: float, util_now: float = math.nan) -> None:
        """At a fresh, finite reading: the pending part is what it does not
        show yet, the rest of the stack is what it shows."""
        if self.pending_mib > 0 or self.pending_util_pct > 0:
            self.baseline_mib = used_mib - (self.vram_mib - self.pending_mib)
            self.pending_mib = 0.0
            if self.pending_util_pct > 0 and math.isfinite(util_now):
                self.baseline_util_pct = util_now - (self.util_pct - self.pending_util_pct)
                self.pending_util_pct = 0.0

    def effective(self, used_mib: float, fresh: bool, util_now: float = math.nan) -> tuple[float, float]:
        """(effective VRAM MiB, effective util %) at readings ``used_mib`` and
        ``util_now`` (%, NaN: unknown); lowers B and Bu."""
        if self.vram_mib <= 0:
            return 0.0, 0.0
        if not fresh or not math.isfinite(used_mib):
            return self.vram_mib, self.util_pct
        self.settle(used_mib, util_now)
        if used_mib < self.baseline_mib:
            self.baseline_mib = used_mib
        eff = min(self.vram_mib, max(0.0, self.baseline_mib + self.vram_mib - used_mib))
        util = self.util_pct * eff / self.vram_mib
        if math.isfinite(util_now):
            if util_now < self.baseline_util_pct:
                self.baseline_util_pct = util_now
            util = min(util, max(0.0, self.baseline_util_pct + self.util_pct - util_now))
        return eff, util


@dataclass(slots=True)
class ReservedColumns:
    """Per-GPU columns of effective reservations for one snapshot."""

    vram_mib: np.ndarray  # float64
    util_pct: np.ndarray  # float64
    leases: np.ndarray  # int32, live leases holding the GPU
    # float64, the whole asks of those leases (R, not faded): what leaves the
    # GPU when gpulb's leases on it end
    asked_mib: np.ndarray

    @classmethod
    def empty(cls, count: int) -> "ReservedColumns":
        return cls(np.zeros(count), np.zeros(count), np.zeros(count, dtype=np.int32), np.zeros(count))


class Reservations:
    """Live reservations by GPU uuid and by key (the lease id)."""

    def __init__(self) -> None:
        self._gpus: dict[str, GpuReservation] = {}
        self._keys: dict[str, tuple[str, ...]] = {}
        # +1 on every add and release: what each GPU holds (vram, util,
        # members) changes only there, so readers may cache by it
        self.version = 0

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def gpu(self, gpu_uuid: str) -> GpuReservation | None:
        return self._gpus.get(gpu_uuid)

    def reserved_gpus(self) -> Iterable[str]:
        return self._gpus.keys()

    def asked_util_pct(self, gpu_uuid: str) -> float:
        """% of the GPU's compute its live leases asked for (their shares
        summed, not faded), read without ``gpu()``: the simulator's mirror
        takes a stack handed out by ``gpu()`` as changed."""
        gpu = self._gpus.get(gpu_uuid)
        return gpu.util_pct if gpu is not None else 0.0

    def add(
        self,
        key: str,
        gpu_uuids: Sequence[str],
        vram_mib: float,
        util_pct: float,
        used_mib: Sequence[float],
        util_now: Sequence[float] | None = None,
        *,
        shown: bool = False,
    ) -> None:
        """Reserve ``vram_mib`` and ``util_pct`` on each GPU; ``used_mib`` and
        ``util_now`` are their memory and util readings.

        Pass NaN for a reading that is unknown or stale (``util_now`` None: all).
        ``shown``: the task already runs, its memory and load are in whatever
        the GPUs read once their agent reports (a lease restored after a
        coordinator restart): nothing is reserved beyond the readings, and a
        stale or unknown reading still reserves it all.
        """
        if key in self._keys:
            raise ValueError(f"reservation {key!r} exists")
        utils = util_now if util_now is not None else [math.nan] * len(gpu_uuids)
        for gpu_uuid, used, util in zip(gpu_uuids, used_mib, utils, strict=True):
            gpu = self._gpus.get(gpu_uuid)
            if gpu is None and shown:
                # B = -inf: e = 0 from the first fresh reading on. B = inf, then
                # lowered to that reading, which already holds the task, had
                # reserved its memory a second time for as long as it ran
                # (after a restart: GPUs with room refused work as full).
                gpu = GpuReservation(baseline_mib=-math.inf, baseline_util_pct=-math.inf)
                self._gpus[gpu_uuid] = gpu
            elif gpu is None:
                # Unknown reading: B = inf keeps e = R until a fresh reading lowers B (Bu alike).
                gpu = GpuReservation(baseline_mib=used if math.isfinite(used) else math.inf,
                                     baseline_util_pct=util if math.isfinite(util) else math.inf)
                self._gpus[gpu_uuid] = gpu
            elif shown:
                pass  # its memory and load are in the readings the stack's baseline is of
            else:
                if math.isfinite(used):
                    gpu.baseline_mib = max(gpu.baseline_mib, used - gpu.vram_mib)
                elif gpu.baseline_mib == -math.inf or gpu.pending_mib > 0:
                    # on shown leases (B = -inf) a reading unknown now: B stayed
                    # -inf and this ask faded at once; it counts until a reading settles it
                    gpu.pending_mib += vram_mib
                if math.isfinite(util):
                    gpu.baseline_util_pct = max(gpu.baseline_util_pct, util - gpu.util_pct)
                elif gpu.baseline_util_pct == -math.inf or gpu.pending_util_pct > 0:
                    gpu.pending_util_pct += util_pct
            gpu.vram_mib += vram_mib
            gpu.util_pct += util_pct
            gpu.members[key] = (vram_mib, util_pct)
        self._keys[key] = tuple(gpu_uuids)
        self.version += 1

    def release(self, key: str) -> tuple[str, ...]:
        """End a reservation; returns the GPU uuids it held (empty if unknown)."""
        uuids = self._keys.pop(key, ())
        if uuids:
            self.version += 1
        for gpu_uuid in uuids:
            gpu = self._gpus[gpu_uuid]
            vram, util = gpu.members.pop(key)
            if not gpu.members:
                del self._gpus[gpu_uuid]
                continue
            gpu.vram_mib = max(0.0, gpu.vram_mib - vram)
            gpu.util_pct = max(0.0, gpu.util_pct - util)
            gpu.pending_mib = min(gpu.pending_mib, gpu.vram_mib)
            gpu.pending_util_pct = min(gpu.pending_util_pct, gpu.util_pct)
        return uuids

    def start_again(self, key: str, used_mib: Sequence[float], util_now: Sequence[float] | None = None) -> bool:
        """The task of reservation ``key`` is to start again, from nothing
        (placed again on a host that had not started it, or had lost it):
        its ask counts in full on top of what the GPUs read, until a reading
        shows it, whatever the reservation was (restored ``shown``, or faded
        against the run that ended). False when ``key`` is unknown."""
        uuids = self._keys.get(key)
        if uuids is None:
            return False
        vram, util = self._gpus[uuids[0]].members[key]
        self.release(key)
        self.add(key, uuids, vram, util, used_mib, util_now)
        return True

    def columns(
        self,
        row_of: Mapping[str, int],
        used_mib: np.ndarray,
        fresh: np.ndarray,
        util_now: np.ndarray | None = None,
    ) -> ReservedColumns:
        """Effective reservations as columns aligned to a snapshot's GPU rows
        (``util_now``: the util readings, %, NaN where unknown; None: none).

        ``row_of`` maps GPU uuid to row; reserved GPUs absent from the snapshot
        are skipped (their node is gone; ``node_removed`` ends their leases).
        One Python pass gathers the reserved GPUs' stacks, the formula runs as
        vector operations, and lowered baselines are written back.
        """
        cols = ReservedColumns.empty(used_mib.shape[0])
        rows: list[int] = []
        stacks: list[GpuReservation] = []
        pending: list[int] = []  # stacks with asks made on shown leases at an unknown reading (rare)
        for gpu_uuid, gpu in self._gpus.items():
            row = row_of.get(gpu_uuid)
            if row is not None:
                if gpu.pending_mib > 0 or gpu.pending_util_pct > 0:
                    pending.append(len(rows))
                rows.append(row)
                stacks.append(gpu)
        if not rows:
            return cols
        n = len(rows)
        r = np.asarray(rows, dtype=np.intp)
        base = np.fromiter((g.baseline_mib for g in stacks), dtype=np.float64, count=n)
        vram = np.fromiter((g.vram_mib for g in stacks), dtype=np.float64, count=n)
        util = np.fromiter((g.util_pct for g in stacks), dtype=np.float64, count=n)
        leases = np.fromiter((len(g.members) for g in stacks), dtype=np.int32, count=n)
        used = np.asarray(used_mib, dtype=np.float64)[r]
        seen = np.asarray(fresh, dtype=bool)[r] & np.isfinite(used)
        x_all = np.asarray(util_now, dtype=np.float64)[r] if util_now is not None else None
        for i in pending:
            if seen[i]:
                stacks[i].settle(float(used[i]), float(x_all[i]) if x_all is not None else math.nan)
                base[i] = stacks[i].baseline_mib
        lower = seen & (used < base)
        for i in np.flatnonzero(lower):
            stacks[i].baseline_mib = float(used[i])
        base = np.where(lower, used, base)
        with np.errstate(invalid="ignore"):
            eff = np.where(seen, np.minimum(vram, np.maximum(0.0, base + vram - used)), vram)
            eff = np.where(vram > 0, eff, 0.0)
            eff_util = np.where(vram > 0, util * eff / np.where(vram > 0, vram, 1.0), 0.0)
        if util_now is not None:
            x = x_all
            known = seen & np.isfinite(x)
            ubase = np.fromiter((g.baseline_util_pct for g in stacks), dtype=np.float64, count=n)
            lower_u = known & (x < ubase)
            for i in np.flatnonzero(lower_u):
                stacks[i].baseline_util_pct = float(x[i])
            ubase = np.where(lower_u, x, ubase)
            with np.errstate(invalid="ignore"):
                shown = np.minimum(util, np.maximum(0.0, ubase + util - x))
            eff_util = np.where(known & (vram > 0), np.minimum(eff_util, shown), eff_util)
        cols.util_pct[r] = eff_util
        cols.vram_mib[r] = eff
        cols.leases[r] = leases
        cols.asked_mib[r] = vram
        return cols


@dataclass(frozen=True, slots=True)
class Lease:
    """The right to run a placed task until ``expires_at`` (monotonic s)."""

    lease_id: str
    task_id: str
    expires_at: float


def _random_id() -> str:
    # 128 random bits as 32 hex digits, like uuid4().hex without building a UUID
    return os.urandom(16).hex()


class LeaseBook:
    """Live leases with renewal and a clock-driven expiry sweep.

    A lease is expired once ``now >= expires_at``. Lease ids come from
    ``new_id`` (random by default; the simulator passes a counter to be
    deterministic).
    """

    def __init__(self, new_id: Callable[[], str] | None = None) -> None:
        self._new_id = new_id or _random_id
        self._leases: dict[str, Lease] = {}
        self._heap: list[tuple[float, int, str]] = []
        self._seq = itertools.count()
        self._dead = 0  # heap entries of released or renewed leases

    def __len__(self) -> int:
        return len(self._leases)

    def get(self, lease_id: str) -> Lease | None:
        return self._leases.get(lease_id)

    def grant(self, task_id: str, now: float, length_s: float) -> Lease:
        lease_id = self._new_id()
        if lease_id in self._leases:
            raise ValueError(f"lease id {lease_id!r} reused")
        return self._put(Lease(lease_id, task_id, now + length_s))

    def renew(self, lease_id: str, now: float, extend_s: float) -> Lease:
        """Move the expiry to ``now + extend_s``; KeyError if the lease is not live."""
        lease = self._leases[lease_id]
        if now + extend_s == lease.expires_at:
            return lease  # the same expiry: its heap entry stands
        self._dead += 1  # its old heap entry
        renewed = self._put(Lease(lease.lease_id, lease.task_id, now + extend_s))
        self._maybe_compact()
        return renewed

    def release(self, lease_id: str) -> Lease | None:
        lease = self._leases.pop(lease_id, None)
        if lease is not None:
            self._dead += 1
            self._maybe_compact()
        return lease

    def _maybe_compact(self) -> None:
        # Released and renewed leases stay in the heap until their old expiry
        # (lazy deletion); at hundreds of placements a second and 300 s leases
        # that is ~200k dead entries: rebuild once they are most of the heap.
        if self._dead > 1024 and 2 * self._dead > len(self._heap):
            leases = self._leases
            live: dict[str, tuple[float, int, str]] = {}
            for item in self._heap:  # one entry per live lease, at its current expiry
                lease = leases.get(item[2])
                if lease is not None and lease.expires_at == item[0]:
                    live.setdefault(item[2], item)
            self._heap = list(live.values())
            heapq.heapify(self._heap)
            self._dead = 0

    def expired(self, now: float) -> list[Lease]:
        """Remove and return every lease with ``expires_at <= now``, soonest first."""
        out: list[Lease] = []
        while self._heap and self._heap[0][0] <= now:
            expires_at, _, lease_id = heapq.heappop(self._heap)
            lease = self._leases.get(lease_id)
            if lease is None or lease.expires_at != expires_at:
                self._dead = max(0, self._dead - 1)
                continue  # released or renewed since: lazy heap deletion
            del self._leases[lease_id]
            out.append(lease)
        return out

    def _put(self, lease: Lease) -> Lease:
        self._leases[lease.lease_id] = lease
        heapq.heappush(self._heap, (lease.expires_at, next(self._seq), lease.lease_id))
        return lease
