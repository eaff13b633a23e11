"""Host storage signals: parsing real /proc/diskstats lines and the await /
util arithmetic across two reads of a temporary proc root."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.diskstats import (
    DiskCounters,
    DiskIoMonitor,
    HostIoSample,
    is_whole_disk,
    parse_diskstats,
)

# Captured from a 6.x kernel (17 counters: with discard and flush fields), plus
# an old 4.x style 11-counter line and garbage that must be skipped.
REAL = """\
   7       0 loop0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0
 254       0 vda 10715 4568 1431946 8114 1369 9906 696136 2564 0 2596 10995 3819 51 48920 313 56 2
 254       1 vda1 10501 4568 1422202 8060 1369 9906 696136 2564 0 2520 10624 3819 51 48920 313 0 0
 259       0 nvme0n1 5000 10 800000 2500 7000 20 900000 14000 3 6000 16500
 259       1 nvme0n1p1 4000 10 700000 2000 6000 20 800000 13000 0 5000 15000
 253       0 zram0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0
 252       0 dm-0 300 0 2400 90 100 0 800 30 0 100 120 0 0 0 0
   8       0 sda 1 2 3
 this is not a diskstats line at all really no numbers here x y z
"""


def test_parse_reads_the_first_eleven_counters_of_every_format() -> None:
    stats = parse_diskstats(REAL)
    assert stats["vda"] == DiskCounters(10715, 4568, 1431946, 8114, 1369, 9906, 696136, 2564, 0, 2596, 10995)
    # 11-counter (pre-4.18) line
    assert stats["nvme0n1"].ms_writing == 14000
    assert stats["nvme0n1"].ios_in_progress == 3
    assert stats["dm-0"].reads_completed == 300
    assert "sda" not in stats  # too short
    assert len(stats) == 7


@pytest.mark.parametrize(
    ("name", "whole"),
    [
        ("sda", True),
        ("sda1", False),
        ("vda", True),
        ("vda3", False),
        ("xvdb", True),
        ("xvdb1", False),
        ("nvme0n1", True),
        ("nvme0n1p2", False),
        ("mmcblk0", True),
        ("mmcblk0p1", False),
        ("dm-0", True),
        ("md127", True),
        ("loop7", False),
        ("ram0", False),
        ("zram0", False),
        ("sdaa", True),
        ("sdaa12", False),
    ],
)
def test_whole_disk_classification(name: str, whole: bool) -> None:
    assert is_whole_disk(name) is whole


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _line(name: str, reads: int, ms_r: int, writes: int, ms_w: int, busy_ms: int) -> str:
    # major minor name rd rd_merged sectors_rd ms_rd wr wr_merged sectors_wr ms_wr in_flight ms_io weighted
    return f"   8 0 {name} {reads} 0 0 {ms_r} {writes} 0 0 {ms_w} 0 {busy_ms} 0 0 0 0 0 0 0\n"


def _write(root: Path, *lines: str) -> None:
    (root / "diskstats").write_text("".join(lines))


def test_await_and_util_between_two_reads(tmp_path: Path) -> None:
    clock = FakeClock()
    mon = DiskIoMonitor(proc_root=str(tmp_path), clock=clock)
    _write(
        tmp_path,
        _line("sda", 1000, 5000, 1000, 5000, 10_000),
        _line("sda1", 1000, 5000, 1000, 5000, 10_000),
        _line("nvme0n1", 50, 10, 50, 10, 500),
    )
    assert mon.sample() == HostIoSample(None, None)  # first read: no interval yet

    clock.now += 2.0  # 2000 ms of wall time
    _write(
        tmp_path,
        # sda: 100 IOs took 8000 ms in total -> 80 ms each; busy 1500/2000 ms
        _line("sda", 1060, 7000, 1040, 11000, 11_500),
        # its partition is far worse, but it only repeats the disk's IO
        _line("sda1", 1060, 9_000_000, 1040, 11000, 12_000),
        # nvme: 200 IOs took 100 ms -> 0.5 ms each; busy 1900/2000 ms
        _line("nvme0n1", 150, 60, 150, 60, 2_400),
    )
    s = mon.sample()
    assert s.disk_await_us == 80_000  # worst await: sda
    assert s.disk_util_permille == 950  # worst util: nvme0n1


def test_idle_disks_wait_zero_and_no_disks_is_no_data(tmp_path: Path) -> None:
    clock = FakeClock()
    mon = DiskIoMonitor(proc_root=str(tmp_path), clock=clock)
    _write(tmp_path, _line("sda", 10, 10, 10, 10, 10), _line("loop0", 5, 5, 5, 5, 5))
    mon.sample()
    clock.now += 1.0
    _write(tmp_path, _line("sda", 10, 10, 10, 10, 10), _line("loop0", 9, 900, 9, 900, 900))
    assert mon.sample() == HostIoSample(disk_await_us=0, disk_util_permille=0)

    only_loops = DiskIoMonitor(proc_root=str(tmp_path), clock=clock)
    _write(tmp_path, _line("loop0", 5, 5, 5, 5, 5))
    only_loops.sample()
    clock.now += 1.0
    _write(tmp_path, _line("loop0", 50, 500, 5, 5, 700))
    assert only_loops.sample() == HostIoSample(None, None)


def test_stuck_io_shows_as_busy_without_an_await(tmp_path: Path) -> None:
    clock = FakeClock()
    mon = DiskIoMonitor(proc_root=str(tmp_path), clock=clock)
    _write(tmp_path, _line("sdb", 10, 10, 10, 10, 100))
    mon.sample()
    clock.now += 1.0
    _write(tmp_path, _line("sdb", 10, 10, 10, 10, 1_100))  # nothing completed, busy all second
    assert mon.sample() == HostIoSample(disk_await_us=None, disk_util_permille=1000)


def test_counter_going_backwards_drops_the_device_for_one_interval(tmp_path: Path) -> None:
    clock = FakeClock()
    mon = DiskIoMonitor(proc_root=str(tmp_path), clock=clock)
    _write(tmp_path, _line("sda", 1000, 1000, 0, 0, 1000), _line("sdb", 10, 10, 0, 0, 10))
    mon.sample()
    clock.now += 1.0
    # sda was replaced (counters restart); sdb did 10 IOs of 3 ms each
    _write(tmp_path, _line("sda", 5, 9000, 0, 0, 10), _line("sdb", 20, 40, 0, 0, 110))
    assert mon.sample() == HostIoSample(disk_await_us=3000, disk_util_permille=100)


def test_unreadable_file_is_no_data_and_resets_the_baseline(tmp_path: Path) -> None:
    clock = FakeClock()
    mon = DiskIoMonitor(proc_root=str(tmp_path), clock=clock)
    assert mon.sample() == HostIoSample(None, None)  # no file at all
    _write(tmp_path, _line("sda", 10, 10, 0, 0, 10))
    assert mon.sample() == HostIoSample(None, None)  # first readable read
    (tmp_path / "diskstats").unlink()
    clock.now += 1.0
    assert mon.sample() == HostIoSample(None, None)
    clock.now += 1.0
    _write(tmp_path, _line("sda", 20, 20, 0, 0, 20))
    # a fresh baseline, not a delta across the gap
    assert mon.sample() == HostIoSample(None, None)
    clock.now += 1.0
    _write(tmp_path, _line("sda", 30, 30, 0, 0, 520))
    assert mon.sample() == HostIoSample(disk_await_us=1000, disk_util_permille=500)


def test_reads_the_real_proc_when_present() -> None:
    if not Path("/proc/diskstats").exists():
        pytest.skip("no /proc/diskstats on this host")
    mon = DiskIoMonitor()
    assert mon.sample() == HostIoSample(None, None)
    s = mon.sample()
    for v in (s.disk_await_us, s.disk_util_permille):
        assert v is None or v >= 0
