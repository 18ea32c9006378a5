"""The task client's critical sections: each function is the body of ONE QueueLock hold
(`fn(L: Locked)`, one message to the queue actor, or `ClientDir.critical` directly in tests).

A body applies the pure decisions (motor.tasks.core, motor.tasks.rules) to the locked state
and writes what changed through `Locked` (task records, task.runner records, the queue's
publications) in the order the protocol needs.  No trio: the queue actor runs a body in a
worker thread holding the flock.  Fault points (host.fault) mark the crash windows tests
stage.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from motor.tasks import context, core, rules
from motor.tasks.host import fault
from motor.tasks.records import (
    TERMINAL_TURN_STATES,
    ProcessIdentity,
    QueueEntry,
    RunnerRecord,
    TaskRecord,
    TurnRecord,
)
from motor.tasks.store import Locked
from motor.tasks.workers import Fleet

Tokens = Callable[[], uuid.UUID]


def update_turn(L: Locked, task_id: str, turn_id: str, **changes) -> TurnRecord | None:
    task = L.read_task(task_id)
    if task is None:
        return None
    for turn in task.turns:
        if turn.turn_id == turn_id:
            for k, v in changes.items():
                setattr(turn, k, v)
            L.write_task(task)
            return turn
    return None


# --- creating work -----------------------------------------------------------------------


def submit_locked(L: Locked, task: TaskRecord, me: ProcessIdentity, now: int, attached: bool) -> None:
    """Rollback-protected submission: the owner-only context, then the record (no row without
    a task), then the row; a failure removes what was written (context directory included)."""
    task_id = task.task_id
    try:
        context.write_task_project_path(L.cdir.turns_dir, task_id, task.project, Path(task.project))
        fault("submit_after_context")
        L.write_task(task)
        core.enqueue(L.queue, task_id=task_id, turn_id="1", owner=me, now_ms=now, pin=task.pin, run=task.run,
                     attached=attached)
    except BaseException:
        core.drop_rows(L.queue, task_id)
        L.cdir.task_path(task_id).unlink(missing_ok=True)
        context.remove_task_context(L.cdir.turns_dir, task_id)
        raise


def add_turn_locked(L: Locked, task_id: str, command: list[str], me: ProcessIdentity, now: int) -> str:
    task = L.read_task(task_id)
    if task is None:
        raise core.QueueError("TASK_UNKNOWN", f"no task {task_id}")
    if any(row.task_id == task_id and row.cancel_requested for row in L.queue.entries):
        raise core.QueueError("TASK_CANCELLING", f"task {task_id} is being cancelled")
    turn_id = str(len(task.turns) + 1)
    task.turns.append(TurnRecord(turn_id=turn_id, command=command, submitted_at_ms=now))
    L.write_task(task)
    core.enqueue(L.queue, task_id=task_id, turn_id=turn_id, owner=me, now_ms=now, pin=task.pin, run=task.run)
    return turn_id


def cancel_locked(L: Locked, task_id: str, now: int) -> list[tuple[str, str]]:
    task = L.read_task(task_id)
    if task is None:
        raise core.QueueError("TASK_UNKNOWN", f"no task {task_id}")
    remote = rules.cancel_task(L.queue, task, L.observe, now)
    L.write_task(task)
    return remote


# --- reserve -> spawn -> bind -> complete -------------------------------------------------


def start_locked(L: Locked, task_id: str, turn_id: str, me: ProcessIdentity, cap: int,
                 max_parallel: Mapping[str, int] | None, new_token: Tokens) -> core.Reserve:
    r = rules.reserve_or_park(L.queue, L.runners, L.observe, task_id=task_id, turn_id=turn_id, reserver=me,
                              cap=cap, max_parallel=max_parallel, new_token=new_token)
    if r.kind == "saturated":
        update_turn(L, task_id, turn_id, state="parked")
    return r


def complete_locked(L: Locked, task_id: str, turn_id: str, token: uuid.UUID, child: ProcessIdentity,
                    mode: str = "detached") -> bool:
    """complete_runner_spawn: adopt the child if needed and bind it on the reservation,
    publish (reservation still present), persist task.runner, clear that token, publish."""
    if not core.complete_bind(L.queue, L.observe, task_id=task_id, turn_id=turn_id, token=token, child=child):
        return False  # the child completed the handoff itself
    L.publish()                                                       # publish 1
    fault("complete_between_publishes")
    L.set_runner(task_id, RunnerRecord(identity=child, turn_id=turn_id, mode=mode))
    core.complete_clear(L.queue, task_id=task_id, turn_id=turn_id, token=token)
    return True                                                       # publish 2 on return


def take_over_locked(L: Locked, task_id: str, turn_id: str, token: uuid.UUID, me: ProcessIdentity) -> None:
    """The detached child takes its reserved slot and finishes the handoff itself
    (idempotent with the parent's complete)."""
    core.take_over_reserved_slot(L.queue, L.runners, L.observe, task_id=task_id, turn_id=turn_id,
                                 token=token, me=me)
    L.publish()
    L.set_runner(task_id, RunnerRecord(identity=me, turn_id=turn_id))
    core.complete_clear(L.queue, task_id=task_id, turn_id=turn_id, token=token)


def reconcile_plan(L: Locked, me: ProcessIdentity, cap: int, max_parallel, new_token) -> list:
    """Reconcile under one lock hold (rules.reconcile): drop dead task.runner records; reserve
    for active rows whose runner is gone (park them when saturated); then reserve the oldest
    parked turns while slots are free, with exclude_reserver FALSE.  [(task, turn, token)]."""
    dead, parked, starts = rules.reconcile(L.queue, L.runners, L.observe, me=me, cap=cap,
                                           max_parallel=max_parallel, new_token=new_token)
    for task_id in dead:
        L.set_runner(task_id, None)
    for task_id, turn_id in parked:
        update_turn(L, task_id, turn_id, state="parked")
    return starts


def next_parked_locked(L: Locked, me: ProcessIdentity, cap: int, max_parallel, new_token,
                       finished_task: str) -> tuple[str, str] | None:
    """A finishing runner replaces its own slot (exclude_reserver TRUE) with the oldest
    parked turn, taking it over in-process; otherwise its task.runner record is cleared."""
    nxt = None
    row = core.oldest_parked(L.queue, max_parallel, L.observe)
    if row is not None:
        r = core.reserve_runner_slot(L.queue, L.runners, L.observe, task_id=row.task_id, turn_id=row.turn_id,
                                     reserver=me, cap=cap, new_token=new_token, exclude_reserver=True)
        if r.acquired:
            complete_locked(L, row.task_id, row.turn_id, r.token, me)
            nxt = row.key
    if nxt is None or nxt[0] != finished_task:
        retire_locked(L, finished_task, me)
    return nxt


def retire_locked(L: Locked, task_id: str, me: ProcessIdentity) -> None:
    """Clear task.runner when it is still `me`."""
    rec = L.runners.get(task_id)
    if rec is not None and rec.identity == me:
        L.set_runner(task_id, None)


# --- a turn runner's sections --------------------------------------------------------------


def row_copy(L: Locked, task_id: str, turn_id: str) -> QueueEntry | None:
    row = core.find_row(L.queue, task_id, turn_id)
    return core.msgspec_copy(row) if row is not None else None


def parked_exists(L: Locked) -> bool:
    return any(e.state == "parked" for e in L.queue.entries)


def park_back_locked(L: Locked, task_id: str, turn_id: str, me: ProcessIdentity, detail: str, *,
                     dispatched: bool) -> None:
    """The turn goes back to the queue (no worker answered) when this process still holds
    it: as its dispatch owner (`dispatched`), else as its owner or dispatch owner."""
    r = core.find_row(L.queue, task_id, turn_id)
    if r is None or me not in ((r.dispatch_owner,) if dispatched else (r.owner, r.dispatch_owner)):
        return
    core.park(L.queue, task_id=task_id, turn_id=turn_id)
    update_turn(L, task_id, turn_id, state="parked", detail=detail)


def dispatch_locked(L: Locked, task_id: str, turn_id: str, me: ProcessIdentity, reports: dict) -> QueueEntry:
    """Dispatch at once on the row's worker when it answered, else the best answering one."""
    r = core.require_row(L.queue, task_id, turn_id)
    worker = r.worker if r.worker in reports else core.pick_worker(L.queue, reports)
    r = core.begin_dispatch(L.queue, task_id=task_id, turn_id=turn_id, me=me, worker=worker)
    update_turn(L, task_id, turn_id, state="dispatching", worker=worker)
    return core.msgspec_copy(r)


def record_job_locked(L: Locked, task_id: str, turn_id: str, me: ProcessIdentity, job_id: str) -> bool:
    """The worker accepted the turn's job: record its id (when still ours); True when a
    cancel was asked meanwhile (the caller cancels the job)."""
    r = core.find_row(L.queue, task_id, turn_id)
    if r is not None and r.dispatch_owner == me:
        r.job_id = job_id
        update_turn(L, task_id, turn_id, job_id=job_id)
    return r is not None and r.cancel_requested


def finish_locked(L: Locked, task_id: str, turn_id: str, me: ProcessIdentity, now: int,
                  changes: dict) -> TurnRecord | None:
    """The turn ended: its row leaves the queue and its record gets the outcome."""
    if core.find_row(L.queue, task_id, turn_id) is not None:
        core.finish_turn(L.queue, task_id=task_id, turn_id=turn_id, me=me)
    return update_turn(L, task_id, turn_id, ended_at_ms=now, **rules.finish_changes(changes))


# --- seed 001: the claim of a waiting runner ----------------------------------------------


def task_facts(L: Locked, fleet: Fleet, task_id: str, turn_id: str) -> core.TaskFacts | None:
    """What a claim decision needs about one task, read under the lock (task record and its
    saved context; a context that fails its checks is one the runner cannot supply)."""
    task = L.read_task(task_id)
    if task is None:
        return None
    names = {w.name for w in fleet.capable(task.capabilities)}
    if task.pin is not None:
        names &= {task.pin}
    turn = next((t for t in task.turns if t.turn_id == turn_id), None)
    terminal = turn is None or turn.state in TERMINAL_TURN_STATES
    try:
        ctx = context.read_task_context(L.cdir.turns_dir, task_id)
        saved = str(ctx.path) if ctx is not None else None
    except context.ContextError:
        return core.TaskFacts(frozenset(names), None, None, terminal)
    worktree = os.path.realpath(task.project) if saved is None else saved
    return core.TaskFacts(frozenset(names), saved, worktree, terminal)


@dataclass
class Claimed:
    kind: str                      # keep | move | wait
    worker: str | None = None
    task_id: str | None = None     # move: the recipient
    turn_id: str | None = None
    row: QueueEntry | None = None


def claim_locked(L: Locked, fleet: Fleet, task_id: str, turn_id: str, me: ProcessIdentity,
                 observations: dict, *, reassign: bool) -> Claimed:
    """One claim of a waiting runner, one QueueLock hold (seed 001, contracts 1-5).

    keep: Waiting -> Dispatching on the chosen worker.  move: (a legacy recipient's inherited
    context written first, still under the lock) ONE queue publication: donor Waiting ->
    Parked, recipient Parked -> Waiting -> Dispatching(me, worker); then the runner metadata
    moves (recipient's task.runner = me, then the donor's cleared).  A failure after the
    publication leaves recoverable rows: the recipient's dispatch owner is this process,
    which then exits with an error; reconcile replaces it once it is dead."""
    keys = [(task_id, turn_id)] + [e.key for e in L.queue.entries if e.state in ("parked", "waiting")]
    facts = {}
    for t, u in keys:
        f = task_facts(L, fleet, t, u)
        if f is not None:
            facts.setdefault(t, f)
    c = core.claim_parked_for_waiting_runner(
        L.queue, task_id=task_id, turn_id=turn_id, owner=me, observations=observations, facts=facts,
        max_parallel=fleet.max_parallel, reassign=reassign, observe=L.observe)
    if c.kind == "wait":
        return Claimed("wait")
    if c.kind == "keep":
        r = core.begin_dispatch(L.queue, task_id=task_id, turn_id=turn_id, me=me, worker=c.worker)
        update_turn(L, task_id, turn_id, state="dispatching", worker=c.worker)
        return Claimed("keep", c.worker, task_id, turn_id, core.msgspec_copy(r))
    rt, ru = c.recipient
    if c.inherit:  # contract 4: the inherited context is durable before the queue moves
        donor_task = L.read_task(task_id)
        src = context.task_project_path(L.cdir.turns_dir, task_id, donor_task.project)
        context.write_task_project_path(L.cdir.turns_dir, rt, L.read_task(rt).project, src)
    r = core.apply_reassignment(L.queue, donor=(task_id, turn_id), recipient=(rt, ru), owner=me, worker=c.worker)
    row = core.msgspec_copy(r)
    L.publish()                                                      # the one queue publication
    update_turn(L, task_id, turn_id, state="parked", detail=f"donated its runner process to task {rt}")
    update_turn(L, rt, ru, state="dispatching", worker=c.worker, donated_from=task_id, detail=None)
    fault("reassign_after_publish")
    L.set_runner(rt, RunnerRecord(identity=me, turn_id=ru))
    fault("reassign_between_metadata")
    retire_locked(L, task_id, me)
    return Claimed("move", c.worker, rt, ru, row)


__all__ = ["update_turn", "submit_locked", "add_turn_locked", "cancel_locked", "start_locked", "complete_locked",
           "take_over_locked", "reconcile_plan", "next_parked_locked", "retire_locked", "row_copy",
           "parked_exists", "park_back_locked", "dispatch_locked", "record_job_locked", "finish_locked",
           "task_facts", "Claimed", "claim_locked"]
