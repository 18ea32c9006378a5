"""Scheduling: the pure core (claims, capacity, queue order, queue wait) and the
dispatcher's message types.  See docs/scheduling.md."""

from .core import (
    BACKGROUND_KINDS,
    DEFAULT_QUEUE_WAIT_S,
    GATE_QUEUE_WAIT_S,
    GRACE_S,
    JobSpec,
    LocalDeadline,
    Refusal,
    Scheduler,
    SchedulerStats,
    Start,
    WaitStatus,
    claim_for,
    gate_honoured,
    queue_wait_budget_s,
    retry_delay_s,
)

__all__ = [
    "BACKGROUND_KINDS",
    "DEFAULT_QUEUE_WAIT_S",
    "GATE_QUEUE_WAIT_S",
    "GRACE_S",
    "JobSpec",
    "LocalDeadline",
    "Refusal",
    "Scheduler",
    "SchedulerStats",
    "Start",
    "WaitStatus",
    "claim_for",
    "gate_honoured",
    "queue_wait_budget_s",
    "retry_delay_s",
]
