"""The task client's turn rules: the pure decisions its shells ask before they act.

`motor.tasks.core` holds the queue state machine (occupancy, the reservation protocol, FIFO,
the donation decision); this module holds the turn-level rules built on it: which way a
turn runner goes (`route`, `after_miss`), which workers it asks (`own_candidates`,
`rest_of_fleet`), the start of a submitted turn (`reserve_or_park`), reconcile's plan
(`reconcile`), cancel (`cancel_task`), which job a re-attaching turn follows (`orphan_job`)
and what a job's terminal record makes of the turn (`turn_outcome`).

Like the core: no trio, no files, no processes, no clock.  The queue, the records, the
liveness oracle, times and fresh tokens are arguments; the queue and records passed in are
mutated in place and the shell (motor.tasks.sections, under the QueueLock) writes them.
"""

from __future__ import annotations

import uuid
from typing import Callable, Iterable, Literal, Mapping, Sequence

from motor.tasks import core
from motor.tasks.records import ProcessIdentity, QueueEntry, QueueFile, RunnerRecord, TaskRecord
from motor.tasks.workers import Fleet, WorkerSpec

#: the runner job's terminal state -> the turn's state (any other state: failed)
JOB_TO_TURN_STATE = {"succeeded": "succeeded", "failed": "failed", "cancelled": "cancelled",
                     "timed_out": "timed_out", "refused_before_start": "refused", "lost": "lost"}

#: a turn in one of these states may own a job its dead runner never recorded
ORPHAN_TURN_STATES = frozenset({"dispatching", "running", "parked"})

Route = Literal["gone", "cancelled", "claim", "dispatch"]


def route(row: QueueEntry | None, me: ProcessIdentity, *, wait_for_worker: bool) -> Route:
    """How a TurnRunner takes its turn: gone (no row: nothing to do), cancelled (cancel was
    asked before any job was accepted), claim (a detached runner owning a waiting,
    unaccepted row waits for a ready worker and may donate), dispatch (at once: attached
    execution, library runs, re-attaching to a recorded or orphan job)."""
    if row is None:
        return "gone"
    if row.cancel_requested and not row.job_id:
        return "cancelled"
    if wait_for_worker and row.state == "waiting" and row.owner == me and not row.job_id:
        return "claim"
    return "dispatch"


def after_miss(row: QueueEntry | None, me: ProcessIdentity) -> Literal["gone", "cancelled", "wait"]:
    """After a claim that found no ready worker: gone (the row left the queue or is no
    longer this runner's waiting row), cancelled (cancel was asked), wait (try again)."""
    if row is None or row.state != "waiting" or row.owner != me:
        return "gone"
    if row.cancel_requested:
        return "cancelled"
    return "wait"


def own_candidates(fleet: Fleet, task: TaskRecord, row: QueueEntry) -> list[WorkerSpec]:
    """The workers a turn may use itself: its row's worker when it has one (re-attach), else
    its pin, else the whole fleet; only those listing every capability of the task."""
    if row.worker:
        candidates = [fleet.get(row.worker)]
    elif task.pin:
        candidates = [fleet.get(task.pin)]
    else:
        candidates = list(fleet.workers)
    return [c for c in candidates if c is not None and set(task.capabilities) <= set(c.capabilities)]


def rest_of_fleet(fleet: Fleet, own: Sequence[WorkerSpec], observed: Iterable[str]) -> list[WorkerSpec]:
    """The workers a waiting runner observes after a miss (for a donation): not its own
    candidates, not already observed this iteration."""
    seen = set(observed)
    return [w for w in fleet.workers if w.name not in seen and w not in own]


def unreachable_detail(errors: Iterable[str]) -> str:
    """The detail a turn parked for want of an answering worker gets."""
    return "; ".join(sorted(errors)) or "no worker is configured for this turn"


def reserve_or_park(q: QueueFile, runners: Mapping[str, RunnerRecord], observe: core.Observe, *,
                    task_id: str, turn_id: str, reserver: ProcessIdentity, cap: int,
                    max_parallel: Mapping[str, int] | None, new_token: Callable[[], uuid.UUID]) -> core.Reserve:
    """Submit's start of a queued turn: a turn that is not eligible yet (an earlier turn of its
    task queued, its run at max_parallel) parks; otherwise reserve, and park on saturation.
    The caller spawns on acquired and leaves a pending turn to whoever covers it."""
    row = core.require_row(q, task_id, turn_id)
    if not core.eligible(q, row, max_parallel):
        core.park(q, task_id=task_id, turn_id=turn_id)
        return core.Reserve("saturated", 0)
    r = core.reserve_runner_slot(q, runners, observe, task_id=task_id, turn_id=turn_id, reserver=reserver,
                                 cap=cap, new_token=new_token)
    if r.kind == "saturated":
        core.park(q, task_id=task_id, turn_id=turn_id)
    return r


def reconcile(q: QueueFile, runners: dict[str, RunnerRecord], observe: core.Observe, *, me: ProcessIdentity,
              cap: int, max_parallel: Mapping[str, int] | None, new_token: Callable[[], uuid.UUID],
              ) -> tuple[list[str], list[tuple[str, str]], list[tuple[str, str, uuid.UUID]]]:
    """Reconcile's plan (one lock hold): drop task.runner records of dead processes (removed
    from `runners`); reserve, as `me` with exclude_reserver FALSE, for every active row whose
    responsible process is gone (park it when saturated); then reserve the oldest parked
    turns while slots are free.  Returns (tasks whose runner record is dropped, turns parked,
    [(task, turn, token)] to spawn)."""
    dead = [t for t, rec in runners.items() if not core.is_live(observe, rec.identity)]
    for task_id in dead:
        del runners[task_id]
    parked: list[tuple[str, str]] = []
    starts: list[tuple[str, str, uuid.UUID]] = []
    for row in core.fifo(q):
        if not core.needs_runner(row, runners, observe):
            continue
        r = core.reserve_runner_slot(q, runners, observe, task_id=row.task_id, turn_id=row.turn_id,
                                     reserver=me, cap=cap, new_token=new_token)
        if r.acquired:
            starts.append((row.task_id, row.turn_id, r.token))
        elif r.kind == "saturated":
            core.park(q, task_id=row.task_id, turn_id=row.turn_id)
            parked.append(row.key)
    while (row := core.oldest_parked(q, max_parallel, observe)) is not None:
        r = core.reserve_runner_slot(q, runners, observe, task_id=row.task_id, turn_id=row.turn_id,
                                     reserver=me, cap=cap, new_token=new_token)
        if not r.acquired:
            break
        starts.append((row.task_id, row.turn_id, r.token))
    return dead, parked, starts


def cancel_task(q: QueueFile, task: TaskRecord, observe: core.Observe, now_ms: int) -> list[tuple[str, str]]:
    """Cancel a task: a row some live process acts for (holder, reserver or bound child) is
    marked `cancel_requested` (its runner ends the turn as cancelled); any other row leaves
    the queue and its turn ends `cancelled` at `now_ms`.  Returns [(worker, job_id)] of the
    accepted jobs to cancel on their workers."""
    remote = []
    for row in list(q.entries):
        if row.task_id != task.task_id:
            continue
        if row.worker and row.job_id:
            remote.append((row.worker, row.job_id))
        holder = core.acting_queue_holder(row)
        res = row.slot_reservation
        if core.is_live(observe, holder) or (res is not None and (
                core.is_live(observe, res.reserver) or core.is_live(observe, res.child))):
            row.cancel_requested = True
        else:
            q.entries.remove(row)
            for turn in task.turns:
                if turn.turn_id == row.turn_id:
                    turn.state = "cancelled"
                    turn.ended_at_ms = now_ms
                    turn.reason = "cancelled"
    return remote


def may_own_orphan(task: TaskRecord, turn_id: str) -> bool:
    """Whether the turn may have a job on its worker that its dead runner never recorded."""
    turn = next((t for t in task.turns if t.turn_id == turn_id), None)
    return turn is not None and turn.state in ORPHAN_TURN_STATES


def orphan_job(jobs: Iterable, task: TaskRecord, turn_id: str) -> str | None:
    """The job a re-attaching turn follows when its dead runner never recorded the id: the
    newest job in the task's workspace that no turn of the task owns and that is not marked
    (MOTOR_TURN) as another turn's.  `jobs`: the worker's job records."""
    known = {t.job_id for t in task.turns if t.job_id}
    mine = [j for j in jobs if j.workspace == task.workspace and j.job_id not in known
            and j.env.get("MOTOR_TURN", turn_id) == turn_id]
    return max(mine, key=lambda j: j.accepted_at_ms).job_id if mine else None


def turn_outcome(record: Mapping) -> dict:
    """The turn's changes from its job's terminal record (a plain dict as the API sends it)."""
    return dict(state=JOB_TO_TURN_STATE.get(record.get("state"), "failed"), exit_code=record.get("exit_code"),
                signal=record.get("signal"), reason=record.get("reason"), detail=record.get("detail"),
                job_id=record.get("job_id"))


def finish_changes(changes: Mapping) -> dict:
    """The fields a finished turn records: every given value but None (exit_code is kept
    even when None: a turn that never exited says so)."""
    return {k: v for k, v in changes.items() if v is not None or k == "exit_code"}


__all__ = ["JOB_TO_TURN_STATE", "ORPHAN_TURN_STATES", "route", "after_miss", "own_candidates", "rest_of_fleet",
           "unreachable_detail", "reserve_or_park", "reconcile", "cancel_task", "may_own_orphan", "orphan_job",
           "turn_outcome", "finish_changes"]
