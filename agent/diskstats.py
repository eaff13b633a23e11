"""Host storage signals from ``/proc/diskstats`` for placing IO-heavy tasks.

The scheduler keeps IO-bound work off hosts whose disks are already slow
(storage await above 70 ms). This module reads the kernel's per-device
counters, parses them with a pure function, and turns two reads into the
average wait per IO and the share of time the disk was busy.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "DiskCounters",
    "HostIoSample",
    "DiskIoMonitor",
    "read_diskstats",
    "parse_diskstats",
    "is_whole_disk",
    "io_between",
]

# Partitions (sda1, nvme0n1p2, mmcblk0p1, vda3, xvdb1) would count their disk's
# IO twice; ram, zram, loop and floppy devices are not storage a task waits on.
# Same idea as node_exporter's default ignored-devices pattern. Device-mapper
# (dm-N) and md devices stay: their latency is what the filesystem sees.
_NOT_WHOLE_DISK = re.compile(
    r"^(?:"
    r"z?ram\d+|loop\d+|fd\d+"
    r"|(?:h|s|v|xv)d[a-z]+\d+"
    r"|nvme\d+n\d+p\d+"
    r"|mmcblk\d+p\d+"
    r")$"
)


@dataclass(frozen=True, slots=True)
class DiskCounters:
    """The first eleven counters of one ``/proc/diskstats`` line.

    All are cumulative since boot except ``ios_in_progress``; times are in
    milliseconds. Later kernels append discard and flush counters, which the
    await and util signals do not need.
    """

    reads_completed: int
    reads_merged: int
    sectors_read: int
    ms_reading: int
    writes_completed: int
    writes_merged: int
    sectors_written: int
    ms_writing: int
    ios_in_progress: int
    ms_doing_io: int
    weighted_ms_doing_io: int


@dataclass(frozen=True, slots=True)
class HostIoSample:
    """Storage signals of the host over the last interval.

    ``None`` means no data (first read, unreadable file, no disk), which is
    not a failure and must not be read as an idle disk.
    """

    #: mean time an IO completed in the interval took, worst disk, microseconds
    disk_await_us: int | None = None
    #: share of wall time a disk had IO in flight, worst disk, 0..1000
    disk_util_permille: int | None = None


def is_whole_disk(name: str) -> bool:
    """Whether ``name`` is a whole block device worth watching (not a
    partition, loop, ram or floppy device)."""
    return _NOT_WHOLE_DISK.match(name) is None


def read_diskstats(proc_root: str = "/proc") -> str:
    """The text of ``<proc_root>/diskstats``. Raises ``OSError`` when it cannot
    be read (no such file in a container, permissions)."""
    with open(os.path.join(proc_root, "diskstats"), encoding="ascii", errors="replace") as fh:
        return fh.read()


def parse_diskstats(text: str) -> dict[str, DiskCounters]:
    """Device name -> counters for every well-formed line of ``text``.

    Lines are ``major minor name`` followed by at least eleven counters
    (kernels since 4.18 add four discard counters, since 5.5 two flush
    counters). Shorter or non-numeric lines are skipped rather than failing
    the whole read: one odd device must not hide the others.
    """
    out: dict[str, DiskCounters] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 14:
            continue
        try:
            values = [int(v) for v in parts[3:14]]
        except ValueError:
            continue
        out[parts[2]] = DiskCounters(*values)
    return out


class DiskIoMonitor:
    """Turns successive reads of ``/proc/diskstats`` into a ``HostIoSample``.

    Between two reads, per whole-disk device::

        await_us      = 1000 * d(ms_reading + ms_writing) / d(reads + writes completed)
        util_permille = 1000 * d(ms_doing_io) / d(wall ms)

    and each signal reports its worst (largest) device, so the two may come
    from different disks. Devices with no completed IO in the interval give
    no await (there is nothing to average); a disk with IO stuck in flight
    still shows as busy through util. A counter that went backwards (device
    replaced, 32-bit wrap) drops that device for one interval.
    """

    def __init__(
        self,
        proc_root: str = "/proc",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._proc_root = proc_root
        self._clock = clock
        self._last: dict[str, DiskCounters] | None = None
        self._last_at: float = 0.0

    def sample(self) -> HostIoSample:
        """Signals since the previous call; ``None`` values on the first call
        or when the file cannot be read."""
        now = self._clock()
        try:
            current = {
                name: c
                for name, c in parse_diskstats(read_diskstats(self._proc_root)).items()
                if is_whole_disk(name)
            }
        except OSError:
            # Forget the baseline: a delta across an unreadable gap would
            # smear an unknown interval into one reading.
            self._last = None
            return HostIoSample()
        previous, previous_at = self._last, self._last_at
        self._last, self._last_at = current, now
        if previous is None:
            return HostIoSample()
        return io_between(previous, current, (now - previous_at) * 1000.0)


def io_between(
    previous: dict[str, DiskCounters],
    current: dict[str, DiskCounters],
    wall_ms: float,
) -> HostIoSample:
    """The worst await and util over devices present in both reads, across
    ``wall_ms`` milliseconds (pure; see ``DiskIoMonitor``)."""
    if wall_ms <= 0:
        return HostIoSample()
    worst_await: int | None = None
    worst_util: int | None = None
    for name, now in current.items():
        before = previous.get(name)
        if before is None:
            continue
        d_ios = (now.reads_completed + now.writes_completed) - (
            before.reads_completed + before.writes_completed
        )
        d_wait = (now.ms_reading + now.ms_writing) - (before.ms_reading + before.ms_writing)
        d_busy = now.ms_doing_io - before.ms_doing_io
        if d_ios < 0 or d_wait < 0 or d_busy < 0:
            continue
        if d_ios == 0 and d_busy == 0:
            # An idle (or never used) device says nothing about the host.
            continue
        util = min(1000, round(1000.0 * d_busy / wall_ms))
        worst_util = util if worst_util is None else max(worst_util, util)
        if d_ios > 0:
            wait = round(1000.0 * d_wait / d_ios)
            worst_await = wait if worst_await is None else max(worst_await, wait)
    if worst_util is not None and worst_await is None:
        # Busy but nothing completed: the await is not measurable this round.
        return HostIoSample(disk_await_us=None, disk_util_permille=worst_util)
    if worst_util is None and previous and current:
        # Disks exist and were idle all interval: nothing waited.
        return HostIoSample(disk_await_us=0, disk_util_permille=0)
    return HostIoSample(disk_await_us=worst_await, disk_util_permille=worst_util)
