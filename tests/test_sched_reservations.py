"""Reservations fade as readings show the task, stack fairly on one GPU, end with
the lease; the incrementally patched view equals a rebuilt one; leases expire."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.reservations import GpuReservation, LeaseBook, Reservations
from scheduler.scoring import LOAD_AWARE_WEIGHTS, load_aware_scores
from scheduler.snapshot import ClusterSnapshot, NodeFacts
from scheduler.task import TaskSpec
from scheduler.view import PlacementView

NAN = math.nan


@pytest.mark.parametrize(
    "baseline, reserved, used, fresh, expected",
    [
        (1_000.0, 8_000.0, 1_000.0, True, 8_000.0),  # nothing shown yet
        (1_000.0, 8_000.0, 5_000.0, True, 4_000.0),  # half shown
        (1_000.0, 8_000.0, 9_000.0, True, 0.0),  # fully shown
        (1_000.0, 8_000.0, 12_000.0, True, 0.0),  # more than reserved: never negative
        (1_000.0, 8_000.0, NAN, True, 8_000.0),  # unknown reading: keep it all
        (1_000.0, 8_000.0, 9_000.0, False, 8_000.0),  # stale node: keep it all
        (math.inf, 8_000.0, 3_000.0, True, 8_000.0),  # reserved blind: first fresh reading is the base
    ],
)
def test_effective_vram_fades_with_the_reading(
    baseline: float, reserved: float, used: float, fresh: bool, expected: float
) -> None:
    gpu = GpuReservation(baseline_mib=baseline, vram_mib=reserved, util_pct=40.0, members={"a": (reserved, 40.0)})
    eff, util = gpu.effective(used, fresh)
    assert eff == pytest.approx(expected)
    assert util == pytest.approx(40.0 * expected / reserved)


@pytest.mark.parametrize(
    "used, util_now, fresh, expected_util",
    [
        (2_000.0, 10.0, True, 100.0),  # neither reading shows it yet
        (2_000.0, 60.0, True, 50.0),  # half its compute shows, its memory does not
        (2_000.0, 110.0, True, 0.0),  # its compute shows: a task using 1 GiB of the 8 GiB it asked
        (6_000.0, 60.0, True, 50.0),  # memory and compute half shown
        (10_000.0, 10.0, True, 0.0),  # its memory shows (its compute may sit idle): faded as before
        (2_000.0, NAN, True, 100.0),  # no util reading: the memory rule alone
        (2_000.0, 110.0, False, 100.0),  # stale node: keep it all
    ],
)
def test_effective_util_fades_when_either_reading_shows_the_task(
    used: float, util_now: float, fresh: bool, expected_util: float
) -> None:
    res = Reservations()
    res.add("a", ["g"], 8_000.0, 100.0, [2_000.0], [10.0])  # at 2 GiB and 10 % util
    eff, util = res.gpu("g").effective(used, fresh, util_now)
    assert util == pytest.approx(expected_util)
    assert eff == pytest.approx(8_000.0 if not fresh else min(8_000.0, max(0.0, 10_000.0 - used)))


def test_a_lower_util_reading_lowers_the_util_baseline_and_columns_agree() -> None:
    res = Reservations()
    res.add("a", ["g"], 8_000.0, 80.0, [0.0], [30.0])
    # the other work on the GPU went idle: the task's 80 % has still to show in full
    cols = res.columns({"g": 0}, np.array([0.0]), np.array([True]), np.array([5.0]))
    assert cols.util_pct[0] == pytest.approx(80.0)
    assert res.gpu("g").baseline_util_pct == 5.0
    cols = res.columns({"g": 0}, np.array([500.0]), np.array([True]), np.array([65.0]))
    assert cols.util_pct[0] == pytest.approx(20.0)  # its memory shows 1/16: 75 % by that rule
    assert res.gpu("g").effective(500.0, True, 65.0)[1] == pytest.approx(cols.util_pct[0])
    # a second task stacked at a reading of 65 %: its 50 % shows above that
    res.add("b", ["g"], 1_000.0, 50.0, [500.0], [65.0])
    assert res.gpu("g").effective(500.0, True, 100.0)[1] == pytest.approx(130.0 - 100.0 + 5.0)


def test_two_reservations_on_one_gpu_fade_first_come_first_served() -> None:
    res = Reservations()
    res.add("a", ["g"], 10_000.0, 30.0, [2_000.0])
    res.add("b", ["g"], 6_000.0, 20.0, [2_000.0])  # before the readings show "a"
    gpu = res.gpu("g")
    assert gpu.effective(2_000.0, True) == (16_000.0, 50.0)
    # "a" shows up: only its part fades, "b" keeps its full reservation
    assert gpu.effective(12_000.0, True)[0] == 6_000.0
    assert gpu.effective(18_000.0, True)[0] == 0.0


def test_release_moves_the_stack_down() -> None:
    res = Reservations()
    res.add("a", ["g"], 10_000.0, 0.0, [0.0])
    res.add("b", ["g"], 10_000.0, 0.0, [0.0])
    assert res.release("a") == ("g",)
    # "a" finished before it ever showed: "b" is still fully reserved
    assert res.gpu("g").effective(0.0, True)[0] == 10_000.0
    # "b" shows while "a"'s stale memory is still read: nothing is double-counted
    assert res.gpu("g").effective(10_000.0, True)[0] == 0.0
    assert res.release("b") == ("g",)
    assert res.gpu("g") is None and len(res) == 0
    assert res.release("b") == ()


def test_version_moves_on_every_add_and_release_and_nothing_else() -> None:
    res = Reservations()
    assert res.version == 0
    res.add("a", ["g", "h"], 10_000.0, 50.0, [0.0, 0.0])
    res.add("b", ["g"], 2_000.0, 10.0, [0.0])
    assert res.version == 2
    res.columns({"g": 0, "h": 1}, np.array([500.0, 0.0]), np.array([True, True]))  # lowers a baseline only
    assert res.release("nope") == () and res.version == 2
    res.release("a")
    assert res.version == 3


def test_adding_after_outside_growth_still_reserves_in_full() -> None:
    res = Reservations()
    res.add("a", ["g"], 4_000.0, 0.0, [1_000.0])
    # a process we did not place grew the reading by 9 GB; "a" looks shown (faded)
    assert res.gpu("g").effective(10_000.0, True)[0] == 0.0
    res.add("b", ["g"], 3_000.0, 0.0, [10_000.0])
    assert res.gpu("g").effective(10_000.0, True)[0] == 3_000.0


def test_a_reading_below_the_baseline_lowers_it() -> None:
    res = Reservations()
    res.add("a", ["g"], 4_000.0, 0.0, [8_000.0])
    gpu = res.gpu("g")
    assert gpu.effective(2_000.0, True)[0] == 4_000.0  # something else freed 6 GB
    assert gpu.baseline_mib == 2_000.0
    assert gpu.effective(6_000.0, True)[0] == 0.0  # now "a" shows in full


def test_a_restored_lease_that_must_start_again_counts_in_full_until_it_shows() -> None:
    """A lease restored after a coordinator restart is taken as running
    (``shown``); one whose host turns out not to run it starts again: its ask
    counts in full above what the GPU reads, alone on its GPU or next to a
    restored lease that does run, until the reading shows it. Before, on a
    GPU with a running restored lease, it faded at the first reading."""
    for running_neighbour in (False, True):
        res = Reservations()
        res.add("waits", ["g"], 6_000.0, 40.0, [NAN], shown=True)
        if running_neighbour:
            res.add("runs", ["g"], 4_000.0, 30.0, [NAN], shown=True)
        assert res.gpu("g").effective(4_000.0 if running_neighbour else 0.0, True, 30.0)[0] == 0.0  # as restored
        assert res.start_again("waits", [NAN], [NAN]) and not res.start_again("nope", [NAN])
        reading = 4_000.0 if running_neighbour else 0.0  # the neighbour's 4 GB and 30 % only
        util = 30.0 if running_neighbour else 0.0
        assert res.gpu("g").effective(reading, False)[0] == 6_000.0 + (4_000.0 if running_neighbour else 0.0)  # stale: all
        cols = res.columns({"g": 0}, np.array([reading]), np.array([True]), np.array([util]))
        assert cols.vram_mib[0] == pytest.approx(6_000.0) and cols.util_pct[0] == pytest.approx(40.0)
        assert cols.asked_mib[0] == (10_000.0 if running_neighbour else 6_000.0)
        # the task starts: half, then all of it shows
        assert res.gpu("g").effective(reading + 3_000.0, True, util + 20.0) == pytest.approx((3_000.0, 20.0))
        assert res.gpu("g").effective(reading + 6_000.0, True, util + 40.0) == pytest.approx((0.0, 0.0))
        # the scalar path settles as columns do
        again = Reservations()
        again.add("runs", ["g"], 4_000.0, 30.0, [NAN], shown=True)
        again.add("new", ["g"], 6_000.0, 40.0, [NAN])
        assert again.gpu("g").effective(4_000.0, True, 30.0) == pytest.approx((6_000.0, 40.0))


def test_duplicate_key_is_refused() -> None:
    res = Reservations()
    res.add("a", ["g"], 1.0, 0.0, [0.0])
    with pytest.raises(ValueError):
        res.add("a", ["h"], 1.0, 0.0, [0.0])


# ---- incremental view == rebuilt view ------------------------------------------------------------

NODES = [NodeFacts("n0", 4), NodeFacts("n1", 4, stale=True), NodeFacts("n2", 2)]
COUNT = 10
UUIDS = [f"GPU-{n.node_id}-{g}" for n in NODES for g in range(n.gpus)]


@settings(max_examples=60, deadline=None)
@given(
    used=st.lists(
        st.one_of(st.floats(0, 20_000), st.just(NAN)), min_size=COUNT, max_size=COUNT
    ),
    ops=st.lists(
        st.tuples(
            st.booleans(),
            st.lists(st.integers(0, COUNT - 1), min_size=1, max_size=3, unique=True),
            st.floats(100, 8_000),
        ),
        min_size=1,
        max_size=25,
    ),
)
def test_incremental_refresh_equals_a_rebuilt_view(used: list[float], ops: list) -> None:
    snap = ClusterSnapshot.build(NODES, memory_used_mib=used)
    res = Reservations()
    view = PlacementView(snap, res)
    view.attach(res)
    task = TaskSpec("t", vram_mib=1_000.0, gpu_share=0.3)
    load_aware_scores(view, task, LOAD_AWARE_WEIGHTS)  # its derived columns are patched from here on
    live: list[str] = []
    for n, (add, rows, vram) in enumerate(ops):
        if add or not live:
            key = f"k{n}"
            uuids = [UUIDS[r] for r in rows]
            res.add(key, uuids, vram, vram / 100.0, [used[r] for r in rows])
            live.append(key)
            view.refresh(uuids)
        else:
            view.refresh(res.release(live.pop(0)))
    rebuilt = PlacementView(snap, res)
    for column in ("res_vram", "res_util", "leases", "active", "committed", "headroom", "load", "avail", "stale_busy"):
        np.testing.assert_allclose(
            getattr(view, column).astype(float), getattr(rebuilt, column).astype(float), err_msg=column
        )
    np.testing.assert_allclose(
        load_aware_scores(view, task, LOAD_AWARE_WEIGHTS), load_aware_scores(rebuilt, task, LOAD_AWARE_WEIGHTS)
    )


def test_a_memo_holds_until_a_reservation_changes_the_view() -> None:
    """A dispatch asks the same question of every queued task of a shape; the
    answer is kept until a placement (or release) refreshes the view, and
    never outlives it: a stale answer would place on memory just taken."""
    snap = ClusterSnapshot.build(NODES, memory_used_mib=[0.0] * COUNT)
    res = Reservations()
    view = PlacementView(snap, res)
    view.attach(res)
    calls = []

    def free_on_first_gpu() -> float:
        calls.append(1)
        return float(view.headroom[0])

    full = view.memo("free", free_on_first_gpu)
    assert view.memo("free", free_on_first_gpu) == full and len(calls) == 1
    res.add("a", [UUIDS[0]], 6_000.0, 50.0, [0.0])
    view.refresh([UUIDS[0]])
    assert view.memo("free", free_on_first_gpu) == full - 6_000.0 and len(calls) == 2
    view.refresh(res.release("a"))
    assert view.memo("free", free_on_first_gpu) == full and len(calls) == 3
    assert PlacementView(snap, res).memo("free", lambda: -1.0) == -1.0  # a new view starts empty


# ---- leases ----------------------------------------------------------------------------------------------


def test_leases_expire_at_their_instant_and_renewal_moves_it() -> None:
    ids = iter(f"L{i}" for i in range(100))
    book = LeaseBook(lambda: next(ids))
    a = book.grant("task-a", now=0.0, length_s=10.0)
    b = book.grant("task-b", now=0.0, length_s=20.0)
    assert (a.lease_id, a.expires_at) == ("L0", 10.0)
    assert book.expired(9.999) == []
    renewed = book.renew("L0", now=9.0, extend_s=30.0)
    assert renewed.expires_at == 39.0 and book.get("L0") == renewed
    assert book.expired(20.0) == [b]  # the old expiry of L0 is skipped, L1 is due
    assert book.release("L0") == renewed and book.release("L0") is None
    assert book.expired(1e9) == [] and len(book) == 0
    with pytest.raises(KeyError):
        book.renew("L0", now=50.0, extend_s=1.0)


def test_lease_ids_must_be_unique() -> None:
    book = LeaseBook(lambda: "same")
    book.grant("a", 0.0, 1.0)
    with pytest.raises(ValueError):
        book.grant("b", 0.0, 1.0)


def test_released_and_renewed_leases_do_not_pile_up_in_the_expiry_heap() -> None:
    book = LeaseBook()
    keep = [book.grant(f"keep-{i}", 0.0, 100.0) for i in range(3)]
    for i in range(10_000):  # placed and completed long before their 300 s expiry
        book.release(book.grant(f"t-{i}", 1.0, 300.0).lease_id)
    renewed = book.renew(keep[0].lease_id, 2.0, 500.0)
    for i in range(3_000):  # renewals keep moving the expiry; the last one is at 502 s
        renewed = book.renew(renewed.lease_id, 2.0 - (i + 1) / 10_000, 500.0 + (i + 1) / 10_000)
    assert len(book._heap) <= 2 * 1024 + 4
    # expiry is unchanged: the two untouched leases at 100 s, the renewed one at 502 s
    assert [lease.task_id for lease in book.expired(100.0)] == ["keep-1", "keep-2"]
    assert book.expired(501.0) == [] and [lease.task_id for lease in book.expired(502.0)] == ["keep-0"]
