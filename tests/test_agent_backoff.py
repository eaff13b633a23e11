"""``agent.client.Backoff`` does what its docstring says: equal jitter, the
n-th wait uniform in [bound / 2, bound] with bound = min(cap, base * 2**n)."""

from __future__ import annotations

import random

from agent.client import Backoff


def test_each_wait_is_between_half_its_bound_and_its_bound_and_reset_starts_over() -> None:
    backoff = Backoff(0.5, 30.0, random.Random(7))
    for attempt in range(12):
        bound = min(30.0, 0.5 * 2**attempt)
        waits = []
        for _ in range(200):
            backoff.attempt = attempt
            waits.append(backoff.next_delay())
        assert all(bound / 2 <= w <= bound for w in waits)
        # both halves of the jitter range are drawn: uniform, not pinned to an end
        assert min(waits) < bound * 0.6 and max(waits) > bound * 0.9
    backoff.reset()
    assert 0.25 <= backoff.next_delay() <= 0.5 and backoff.attempt == 1
