"""Adaptive sampling period: fast while readings move, slow while they settle.

A round whose readings moved past twice their deadband drops the period to the
minimum (200 ms default); each calm round stretches it by ``backoff`` up to the
maximum (2 s default). The coordinator can ask for fast sampling for a while
(a SamplingHint), e.g. right after it placed a task on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AdaptiveInterval"]


@dataclass
class AdaptiveInterval:
    min_s: float = 0.2
    max_s: float = 2.0
    backoff: float = 1.5

    def __post_init__(self) -> None:
        if not 0 < self.min_s <= self.max_s:
            raise ValueError(f"sampling interval bounds must satisfy 0 < min ({self.min_s}) <= max ({self.max_s})")
        if self.backoff <= 1.0:
            raise ValueError(f"backoff must be > 1, got {self.backoff}")
        self.current_s = self.max_s
        self._hint_s: float | None = None
        self._hint_until = 0.0

    def hint(self, interval_s: float, duration_s: float, now_s: float) -> None:
        """Sample at most ``interval_s`` apart until ``now_s + duration_s``."""
        self._hint_s = max(self.min_s, min(self.max_s, interval_s))
        self._hint_until = now_s + duration_s

    def next(self, moved: bool, now_s: float) -> float:
        """The period until the next round, given whether this round moved."""
        if moved:
            self.current_s = self.min_s
        else:
            self.current_s = min(self.max_s, self.current_s * self.backoff)
        if self._hint_s is not None and now_s < self._hint_until:
            return min(self.current_s, self._hint_s)
        return self.current_s
