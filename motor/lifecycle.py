"""A job's lifecycle: its states, the events that move it, the table of legal moves.

Theory of operation
-------------------
Every change of a job record's `state` goes through `advance(record, event, who=...)`,
which looks the move up in `TRANSITIONS` and raises `LifecycleError` (naming the state, the
event, the job and the actor) for any move the table does not hold, in the manner of
h11's `_state.py`. Saving a record in the state it already has (the dispatcher persisting
a queued job's clock, a job actor saving output) is not a move and needs no event.

    (accept) --> queued --place--> setup --spawn--> running --exit_ok--> succeeded
                   ^                 |                      --fail-----> failed
                   +--start_failed---+                      --time_out-> timed_out
                                                            --cancel---> cancelled
                                                            --lose-----> lost
    queued --cancel--> cancelled        setup --cancel--> cancelled (never started)
    queued --withdraw--> refused_before_start
    setup --refuse--> refused_before_start   setup --fail--> failed (keeper never started)

Who moves what: the dispatcher (its decisions in scheduling/machine.py) accepts, places,
requeues after `start_failed`, cancels and withdraws queued jobs; the job's actor
(execution/actor.py) owns the record from `setup` on. docs/lifecycle.md draws the table; a test checks that
drawing against `TRANSITIONS`.

`terminal_from_status` turns a keeper's status.json into the terminal record, and
`retain_until` is the one retention rule (the seed's scheduling.md, "Retention"): a terminal job
is kept 24 hours after it ended (or after it was accepted, if later).
"""

from __future__ import annotations

from typing import Any

import msgspec

from .clock import uuid7_ms
from .records import TERMINAL_STATES, JobRecord

# --- states (records.JobState spells the same names for the wire) -----------------------

QUEUED = "queued"
SETUP = "setup"
RUNNING = "running"
SUCCEEDED = "succeeded"
FAILED = "failed"
CANCELLED = "cancelled"
TIMED_OUT = "timed_out"
REFUSED_BEFORE_START = "refused_before_start"
LOST = "lost"

STATES: tuple[str, ...] = (QUEUED, SETUP, RUNNING, SUCCEEDED, FAILED, CANCELLED, TIMED_OUT,
                           REFUSED_BEFORE_START, LOST)
#: A job in one of these holds (or is about to hold) its CPUs: a live process tree may exist.
ACTIVE_STATES: frozenset[str] = frozenset({SETUP, RUNNING})

# --- events -------------------------------------------------------------------------------

PLACE = "place"  # the dispatcher placed the job's CPUs: it sets up
START_FAILED = "start_failed"  # setup failed before a keeper existed: back to its queue
SPAWN = "spawn"  # a keeper holds the job (spawned, or adopted after a restart)
EXIT_OK = "exit_ok"  # the command exited 0
FAIL = "fail"  # non-zero exit, signal, OOM kill, or a keeper that never started
TIME_OUT = "time_out"  # the keeper killed it at its timeout
CANCEL = "cancel"  # cancelled (queued, in setup, or the keeper ended it)
LOSE = "lose"  # the keeper exited without an exit status
WITHDRAW = "withdraw"  # its queue-wait budget ran out before it started
REFUSE = "refuse"  # refused at the setup check (e.g. runner_disk_full, a bad bundle)

EVENTS: tuple[str, ...] = (PLACE, START_FAILED, SPAWN, EXIT_OK, FAIL, TIME_OUT, CANCEL, LOSE,
                           WITHDRAW, REFUSE)

#: {state: {event: next state}}: every legal move, and nothing else.
TRANSITIONS: dict[str, dict[str, str]] = {
    QUEUED: {PLACE: SETUP, CANCEL: CANCELLED, WITHDRAW: REFUSED_BEFORE_START},
    SETUP: {SPAWN: RUNNING, START_FAILED: QUEUED, CANCEL: CANCELLED,
            REFUSE: REFUSED_BEFORE_START, FAIL: FAILED},
    RUNNING: {EXIT_OK: SUCCEEDED, FAIL: FAILED, TIME_OUT: TIMED_OUT, CANCEL: CANCELLED,
              LOSE: LOST},
    SUCCEEDED: {}, FAILED: {}, CANCELLED: {}, TIMED_OUT: {}, REFUSED_BEFORE_START: {},
    LOST: {},
}
INITIAL = QUEUED  # a job is accepted (recorded) in this state

assert set(TRANSITIONS) == set(STATES)
assert {s for s, moves in TRANSITIONS.items() if not moves} == TERMINAL_STATES


class LifecycleError(Exception):
    """An illegal move: the job's state does not take this event."""

    def __init__(self, state: str, event: str, *, job_id: str | None = None,
                 who: str | None = None):
        self.state, self.event, self.job_id, self.who = state, event, job_id, who
        legal = ", ".join(TRANSITIONS.get(state, {})) or "none: it is terminal"
        where = f" (job {job_id}" if job_id else ""
        where += (f", in {who})" if who else ")") if job_id else (f" (in {who})" if who else "")
        super().__init__(f"can't handle event {event!r} in job state {state!r}{where}; "
                         f"legal events: {legal}")


def next_state(state: str, event: str, *, job_id: str | None = None,
               who: str | None = None) -> str:
    """The state `event` moves a job in `state` to, or LifecycleError."""
    try:
        return TRANSITIONS[state][event]
    except KeyError:
        raise LifecycleError(state, event, job_id=job_id, who=who) from None


def advance(record: JobRecord, event: str, *, who: str | None = None, **changes: Any) -> JobRecord:
    """`record` moved by `event` (its new state from the table), with `changes` applied."""
    state = next_state(record.state, event, job_id=record.job_id, who=who)
    return msgspec.structs.replace(record, state=state, **changes)


# --- retention ------------------------------------------------------------------------------

RETENTION_MS = 24 * 3600 * 1000  # the seed's scheduling.md, "Retention": 24 hours


def retain_until(record: JobRecord) -> int:
    """When a terminal record may be dropped: 24 h after it ended (or was accepted, if later)."""
    return max(record.ended_at_ms or 0, uuid7_ms(record.job_id)) + RETENTION_MS


def history_expired(job_id: str, now_ms: int) -> bool:
    """A job id (born at its uuid7 time) whose history is certainly past retention."""
    born = uuid7_ms(job_id)
    return bool(born) and born + RETENTION_MS <= now_ms


# --- the end of a job ------------------------------------------------------------------------


def terminal_from_status(record: JobRecord, status: dict | None, now_ms: int,
                         facts: dict | None = None, unreadable: str | None = None) -> JobRecord:
    """The terminal record for a job whose keeper has exited (status None: lost; with
    `unreadable`, why its status could not be read, which the detail says: a damaged
    status.json, a job directory removed while the job ran).

    `facts` are the isolation backend's findings (`oom_killed`, `memory_max`, `start_error`):
    an OOM kill ends the job `failed` with reason `oom_killed`, and a job the backend never
    got into its unit (`start_error`) with reason `spawn_failed`, unless the keeper gave a
    reason of its own (timed out, cancelled, its own spawn failure); the exit code or signal
    stay what the keeper saw (the victim may have been a child of the job's main process).
    """
    oom = bool(facts and facts.get("oom_killed"))
    oom_detail = (f"killed by the kernel OOM killer (memory limit "
                  f"{(facts or {}).get('memory_max') or record.memory_max_bytes} bytes)")
    if status is None:
        return advance(
            record, LOSE, who="terminal_from_status", ended_at_ms=now_ms, reason="keeper_lost",
            detail=("the job's keeper exited without recording an exit status" if unreadable
                    is None else f"the job's exit status cannot be read: {unreadable}")
                   + (f"; {oom_detail}" if oom else ""),
            waiting_on=None, waiting_on_job=None)
    reason = status.get("reason")
    exit_code, signal = status.get("exit_code"), status.get("signal")
    start_error = (facts or {}).get("start_error")
    if start_error and reason is None:
        # the backend never got the job into its unit (e.g. systemd refused the scope); the
        # keeper's own verdicts (spawn_failed, timed_out, cancelled) come first
        reason, status = "spawn_failed", {**status, "detail": start_error}
    elif oom and reason not in ("timed_out", "cancelled"):
        reason = "oom_killed"
        status = {**status, "detail": oom_detail}
    if reason == "oom_killed":
        event = FAIL
    elif reason == "timed_out":
        event = TIME_OUT
    elif reason == "cancelled":
        event = CANCEL
    elif exit_code == 0 and signal is None:
        event = EXIT_OK
    else:
        event = FAIL
    return advance(
        record, event, who="terminal_from_status", exit_code=exit_code, signal=signal,
        reason=reason, detail=status.get("detail"),
        ended_at_ms=status.get("ended_at_ms") or now_ms,
        started_at_ms=record.started_at_ms or status.get("started_at_ms"),
        waiting_on=None, waiting_on_job=None)
