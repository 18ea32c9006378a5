"""The client side of the queue-wait rule (scheduling.md): `LocalDeadline`.

Standard library only, so the `motor run` client can keep its deadline without importing
the scheduling core (which re-exports it as `motor.scheduling.core.LocalDeadline`).
"""

from __future__ import annotations

__all__ = ["LocalDeadline"]


class LocalDeadline:
    """The client's local queue-wait deadline, kept from the streamed ``queue_wait_ms``.

    Only the runner's observed queue wait counts, never the time elapsed since acceptance
    (upload, fetch and setup are not queue wait).  A deadline is extrapolated only from an
    observation that shows the clock *advancing* (``queue_wait_ms`` larger than the
    previous observation, or a first observation above zero): while the runner reports a
    paused clock (a workspace owner or sibling user), there is no deadline.  When
    `should_withdraw` says so, the client asks the runner to withdraw; the runner's answer
    ("withdrawn" or "started") decides.
    """

    def __init__(self, budget_s: float):
        self.budget_ms = max(0.0, float(budget_s) * 1000.0)
        self.queue_wait_ms: int | None = None
        self.observed_at: float | None = None
        self.deadline: float | None = None

    def observe(self, queue_wait_ms: int, now: float) -> None:
        """Record a heartbeat's queue_wait_ms received at local time ``now``."""
        prev = self.queue_wait_ms
        if prev is not None and queue_wait_ms < prev:
            return  # stale or reordered heartbeat: the runner's clock never goes back
        advancing = queue_wait_ms > (prev if prev is not None else 0)
        self.queue_wait_ms = queue_wait_ms
        self.observed_at = now
        if advancing:
            self.deadline = now + (self.budget_ms - queue_wait_ms) / 1000.0
        else:
            self.deadline = None  # paused (or not started yet): no extrapolation

    def remaining_s(self, now: float) -> float | None:
        if self.queue_wait_ms is not None and self.queue_wait_ms >= self.budget_ms:
            return 0.0
        if self.deadline is None:
            return None
        return max(0.0, self.deadline - now)

    def should_withdraw(self, now: float) -> bool:
        if self.queue_wait_ms is None:
            return False  # the clock has not been seen to start: acceptance time never counts
        if self.queue_wait_ms >= self.budget_ms:
            return True
        return self.deadline is not None and now >= self.deadline
