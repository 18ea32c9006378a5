"""Pure health aggregation: counters folded from job events, no clock reads."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class Ledger:
    """What accounting has seen since start-up.

    admission_refusals: {code: count} of requests refused before any record was accepted.
    finished: {terminal state: count} of jobs that ended while this runner was up.
    """

    admission_refusals: Counter = field(default_factory=Counter)
    finished: Counter = field(default_factory=Counter)

    def refused(self, code: str) -> None:
        self.admission_refusals[code] += 1

    def ended(self, state: str) -> None:
        self.finished[state] += 1
