"""Restart intensity bookkeeping (a small pure value object)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

__all__ = ["RestartBudget"]


@dataclass
class RestartBudget:
    """Allows at most ``intensity`` restarts within any window of ``period`` seconds.

    ``record(now)`` registers one restart at time ``now`` and returns True if it
    is within budget, False if this restart makes more than ``intensity``
    restarts within the last ``period`` seconds (the supervisor must give up).
    A restart at time ``t`` still counts at ``now`` while ``now - t < period``.
    Time is whatever clock the caller passes (the runtime uses
    ``trio.current_time()``), so it is deterministic under ``MockClock``.
    """

    intensity: int = 3
    period: float = 5.0
    _times: deque[float] = field(default_factory=deque, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.intensity < 0:
            raise ValueError("intensity must be >= 0")
        if self.period <= 0:
            raise ValueError("period must be > 0")

    def _expire(self, now: float) -> None:
        while self._times and now - self._times[0] >= self.period:
            self._times.popleft()

    def record(self, now: float) -> bool:
        self._expire(now)
        self._times.append(now)
        return len(self._times) <= self.intensity

    def used(self, now: float) -> int:
        """Number of restarts counted in the window ending at ``now``."""
        self._expire(now)
        return len(self._times)

    def reset(self) -> None:
        self._times.clear()
