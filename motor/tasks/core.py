"""The task client's pure core: occupancy and the runner slot reservation protocol (seed 000).

Theory of operation
-------------------
Every function here runs inside ONE QueueLock critical section (one message to the queue
actor, motor.tasks.queue; the bodies are in motor.tasks.sections): it gets the decoded
queue (`QueueFile`, mutated in place), the task.runner records (`runners`: {task_id:
RunnerRecord}) and a liveness oracle `observe(identity) -> "matching" | "ambiguous" |
"mismatch" | "gone"`, and decides.  No trio, no files, no clock: times, fresh tokens and the
oracle are arguments.  The shell writes what changed.

Occupancy (`occupied_runner_slots_locked`) counts, per the seed:
  unique live identities among task.runner records and acting queue holders
  + one per outstanding reservation (not per unique reserver pid).
A process that is both a task.runner and a row's dispatch owner counts once (it is one
runner).  `exclude_reserver` drops that pid from the identities, never from reservations.

Reserve outcomes, in the seed's order (`reserve_runner_slot`):
  1 pending  (an existing reservation still counts: its live token)     -> do not spawn
  2 acquired (stolen: dead reserver, no live child/holder; fresh token) -> spawn
  3 pending  (no reservation, but a live same-turn runner or other live queue owner: nil)
  4 saturated (occupancy >= cap)                                        -> caller parks
  5 acquired (installed: fresh token, no child yet)                     -> spawn
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Callable, Literal, Mapping

from motor.tasks.records import (
    NIL_TOKEN,
    ProcessIdentity,
    QueueEntry,
    QueueFile,
    RunnerRecord,
    RunnerSlotReservation,
)

Observation = Literal["matching", "ambiguous", "mismatch", "gone"]
Observe = Callable[[ProcessIdentity], Observation]
Runners = Mapping[str, RunnerRecord]

UNCAPPED = 2**63 - 1  # attached start (the seed's usize::MAX)

QUEUE_SLOT_TOKEN_MISMATCH = "QUEUE_SLOT_TOKEN_MISMATCH"
QUEUE_TURN_NOT_FOUND = "QUEUE_TURN_NOT_FOUND"
QUEUE_NOT_OWNER = "QUEUE_NOT_OWNER"


class QueueError(Exception):
    """A refused queue operation: `code` (e.g. QUEUE_SLOT_TOKEN_MISMATCH) and a detail."""

    def __init__(self, code: str, detail: str):
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail


@dataclass(frozen=True)
class Reserve:
    """The answer of reserve_runner_slot.  `kind` is pending / acquired / saturated;
    `step` is the seed's rule (1-5) that decided; `token` is the token to act with
    (acquired), the live reservation's token (step 1) or the nil UUID (step 3)."""

    kind: Literal["pending", "acquired", "saturated"]
    step: int
    token: uuid.UUID | None = None

    @property
    def acquired(self) -> bool:
        return self.kind == "acquired"


def is_live(observe: Observe, ident: ProcessIdentity | None) -> bool:
    return ident is not None and observe(ident) in ("matching", "ambiguous")


def find_row(q: QueueFile, task_id: str, turn_id: str) -> QueueEntry | None:
    for e in q.entries:
        if e.task_id == task_id and e.turn_id == turn_id:
            return e
    return None


def require_row(q: QueueFile, task_id: str, turn_id: str) -> QueueEntry:
    row = find_row(q, task_id, turn_id)
    if row is None:
        raise QueueError(QUEUE_TURN_NOT_FOUND, f"no queue row for task {task_id} turn {turn_id}")
    return row


def acting_queue_holder(row: QueueEntry) -> ProcessIdentity | None:
    """A Dispatching row's dispatch owner, or a Waiting row's owner once it is not the
    enqueue owner (an adopted waiter).  Enqueue owners and parked rows hold nothing."""
    if row.state == "dispatching":
        return row.dispatch_owner
    if row.state == "waiting" and row.owner is not None and row.owner != row.enqueue_owner:
        return row.owner
    return None


def live_runner_for_current_turn(row: QueueEntry, runners: Runners, observe: Observe) -> ProcessIdentity | None:
    """The live task.runner of this row's task when it runs this very turn: one lookup by
    task id, never a scan of the task's turns."""
    rec = runners.get(row.task_id)
    if rec is not None and rec.turn_id == row.turn_id and is_live(observe, rec.identity):
        return rec.identity
    return None


def occupied_runner_slots_locked(
    q: QueueFile,
    runners: Runners,
    observe: Observe,
    *,
    exclude_reserver: ProcessIdentity | None = None,
    reserving: QueueEntry | None = None,
    reserver: ProcessIdentity | None = None,
) -> int:
    """Slots in use.  `exclude_reserver` (only a finishing runner starting the next parked
    turn passes it) drops that pid from identities and holders, never from reservations.
    `reserving`/`reserver`: the recovered-controller exception for that one row."""
    excluded_pid = exclude_reserver.pid if exclude_reserver is not None else None
    identities: set[ProcessIdentity] = set()
    for rec in runners.values():
        if rec.identity.pid != excluded_pid and is_live(observe, rec.identity):
            identities.add(rec.identity)
    for row in q.entries:
        holder = acting_queue_holder(row)
        if holder is None or holder.pid == excluded_pid or not is_live(observe, holder):
            continue
        if (reserving is not None and row is reserving and holder == reserver
                and row.slot_reservation is None
                and live_runner_for_current_turn(row, runners, observe) is None):
            continue  # a recovered controller adopted the row before spawning: not a runner
        identities.add(holder)
    reservations = sum(1 for row in q.entries if row.slot_reservation is not None)
    return len(identities) + reservations


def reserve_runner_slot(
    q: QueueFile,
    runners: Runners,
    observe: Observe,
    *,
    task_id: str,
    turn_id: str,
    reserver: ProcessIdentity,
    cap: int,
    new_token: Callable[[], uuid.UUID],
    exclude_reserver: bool = False,
) -> Reserve:
    """The five outcomes, in order.  Spawn outside the lock only for `acquired`."""
    row = require_row(q, task_id, turn_id)
    same_turn = live_runner_for_current_turn(row, runners, observe)
    holder = acting_queue_holder(row)
    foreign_holder = holder if (holder is not None and holder != reserver and is_live(observe, holder)) else None
    res = row.slot_reservation
    if res is not None:
        if (is_live(observe, res.reserver) or is_live(observe, res.child)
                or same_turn is not None or foreign_holder is not None):
            return Reserve("pending", 1, res.token)
        token = _fresh(new_token)
        row.slot_reservation = RunnerSlotReservation.new(reserver, token)
        return Reserve("acquired", 2, token)
    if same_turn is not None or foreign_holder is not None:
        return Reserve("pending", 3, NIL_TOKEN)
    occupied = occupied_runner_slots_locked(
        q, runners, observe, exclude_reserver=reserver if exclude_reserver else None,
        reserving=row, reserver=reserver)
    if occupied >= cap:
        return Reserve("saturated", 4)
    token = _fresh(new_token)
    row.slot_reservation = RunnerSlotReservation.new(reserver, token)
    return Reserve("acquired", 5, token)


def _fresh(new_token: Callable[[], uuid.UUID]) -> uuid.UUID:
    token = new_token()
    if token.int == 0:
        raise ValueError("token source returned the nil UUID")
    return token


def _current(row: QueueEntry, token: uuid.UUID) -> RunnerSlotReservation:
    res = row.slot_reservation
    if token.int == 0 or res is None or res.token != token:
        have = "none" if res is None else str(res.token)
        raise QueueError(QUEUE_SLOT_TOKEN_MISMATCH,
                         f"task {row.task_id} turn {row.turn_id}: token {token} is not the current "
                         f"reservation ({have})")
    return res


def bind_runner_slot_child(q: QueueFile, *, task_id: str, turn_id: str, token: uuid.UUID,
                           child: ProcessIdentity) -> None:
    """Record the spawned child on the reservation; needs the current token."""
    row = require_row(q, task_id, turn_id)
    res = _current(row, token)
    if res.child is not None and res.child != child:
        raise QueueError(QUEUE_SLOT_TOKEN_MISMATCH,
                         f"task {task_id} turn {turn_id}: reservation {token} is bound to {res.child}")
    res.child = child


def msgspec_copy(row: QueueEntry) -> QueueEntry:
    import msgspec

    return msgspec.convert(msgspec.to_builtins(row), QueueEntry)


def _adopt(row: QueueEntry, child: ProcessIdentity, observe: Observe) -> None:
    """Make `child` the row's waiting owner, unless another live process acts for it."""
    if row.state == "dispatching":
        if row.dispatch_owner == child:
            return  # the child already moved on to dispatching it
        if not is_live(observe, row.dispatch_owner):
            # its runner died: the child takes it over (worker and job id stay, so the
            # child re-attaches to the job instead of running the command again)
            row.state = "waiting"
            row.owner = child
            row.dispatch_owner = None
            return
        raise QueueError(QUEUE_NOT_OWNER, f"task {row.task_id} turn {row.turn_id} is dispatched by "
                                          f"{row.dispatch_owner}")
    holder = acting_queue_holder(row)
    if holder is not None and holder != child and is_live(observe, holder):
        raise QueueError(QUEUE_NOT_OWNER, f"task {row.task_id} turn {row.turn_id} is held by {holder}")
    row.state = "waiting"
    row.owner = child


def complete_bind(q: QueueFile, observe: Observe, *, task_id: str, turn_id: str, token: uuid.UUID,
                  child: ProcessIdentity) -> bool:
    """complete_runner_spawn, first publish: adopt the child if needed and bind it on the
    reservation (which stays).  False when the handoff already completed (the token was
    cleared by the child itself and the row is the child's); QueueError when the token was
    stolen or released (a stale complete never touches the new child)."""
    row = require_row(q, task_id, turn_id)
    res = row.slot_reservation
    if res is None or res.token != token:
        if child in (row.owner, row.dispatch_owner):
            return False
        _current(row, token)  # raises QUEUE_SLOT_TOKEN_MISMATCH
    _adopt(row, child, observe)
    bind_runner_slot_child(q, task_id=task_id, turn_id=turn_id, token=token, child=child)
    return True


def complete_clear(q: QueueFile, *, task_id: str, turn_id: str, token: uuid.UUID) -> bool:
    """complete_runner_spawn, second publish: clear that token (only that one)."""
    row = find_row(q, task_id, turn_id)
    if row is None or row.slot_reservation is None or row.slot_reservation.token != token:
        return False
    row.slot_reservation = None
    return True


def release_runner_slot(q: QueueFile, *, task_id: str, turn_id: str, token: uuid.UUID,
                        reserver: ProcessIdentity) -> bool:
    """Give a reservation back (spawn failed).  Only the same token and reserver, and only
    while no child is bound: after bind it is a no-op, so a failed complete never drops a
    live child."""
    row = find_row(q, task_id, turn_id)
    if row is None or row.slot_reservation is None:
        return False
    res = row.slot_reservation
    if res.token != token or res.reserver != reserver or res.child is not None:
        return False
    row.slot_reservation = None
    return True


def take_over_reserved_slot(q: QueueFile, runners: Runners, observe: Observe, *, task_id: str,
                            turn_id: str, token: uuid.UUID, me: ProcessIdentity) -> bool:
    """A detached child (`worker runner ... --slot-token T`) takes its reserved slot.

    True: the row is now this process's (adopted; the reservation bound to it).  Refused
    (QueueError) when the token is not current and the row is not already ours, when a live
    bound child that is not us holds it, or when a live waiting owner holds it.  A
    token-current child may adopt past a dead parent: nothing is adopted unconditionally."""
    row = require_row(q, task_id, turn_id)
    res = row.slot_reservation
    if res is None or res.token != token:
        rec = runners.get(task_id)
        if me in (row.owner, row.dispatch_owner) or (rec is not None and rec.identity == me
                                                      and rec.turn_id == turn_id):
            return True  # the parent completed the handoff already
        _current(row, token)
    assert res is not None
    if res.child is not None and res.child != me and is_live(observe, res.child):
        raise QueueError(QUEUE_SLOT_TOKEN_MISMATCH, f"reservation {token} is bound to live {res.child}")
    _adopt(row, me, observe)
    res.child = me
    return True


def park(q: QueueFile, *, task_id: str, turn_id: str) -> bool:
    """No slot: the row waits without an owner.  Clears any reservation."""
    row = find_row(q, task_id, turn_id)
    if row is None:
        return False
    row.state = "parked"
    row.owner = None
    row.dispatch_owner = None
    row.slot_reservation = None
    return True


def enqueue(q: QueueFile, *, task_id: str, turn_id: str, owner: ProcessIdentity, now_ms: int,
            pin: str | None = None, run: str | None = None, attached: bool = False) -> QueueEntry:
    """Append a Waiting row owned by its enqueuer.  Coalesced: `enqueued_at_millis =
    max(caller clock, last entry)`; FIFO is `queue_id`.  A duplicate enqueue of the same
    turn returns the existing row and changes nothing."""
    existing = find_row(q, task_id, turn_id)
    if existing is not None:
        return existing
    last = q.last_enqueued_at_millis
    if q.entries:
        last = max(last, max(e.enqueued_at_millis for e in q.entries))
    at = max(now_ms, last)
    row = QueueEntry(queue_id=q.next_queue_id, task_id=task_id, turn_id=turn_id, enqueued_at_millis=at,
                     owner=owner, enqueue_owner=owner, pin=pin, run=run, attached=attached)
    q.next_queue_id += 1
    q.last_enqueued_at_millis = at
    q.entries.append(row)
    return row


def fifo(q: QueueFile) -> list[QueueEntry]:
    return sorted(q.entries, key=lambda e: e.queue_id)


def eligible(q: QueueFile, row: QueueEntry, max_parallel: Mapping[str, int] | None = None) -> bool:
    """May this row start now?  Not while an earlier turn of its task is queued (turns of a
    task run in order), nor when its run already has `max_parallel` turns in flight."""
    for other in q.entries:
        if other.task_id == row.task_id and other.queue_id < row.queue_id:
            return False
    if row.run is not None and max_parallel and row.run in max_parallel:
        in_flight = sum(1 for o in q.entries if o.run == row.run and o is not row
                        and (o.state == "dispatching" or acting_queue_holder(o) is not None
                             or o.slot_reservation is not None))
        if in_flight >= max_parallel[row.run]:
            return False
    return True


def oldest_parked(q: QueueFile, max_parallel: Mapping[str, int] | None = None,
                  observe: Observe | None = None) -> QueueEntry | None:
    """The oldest startable row: parked, without a reservation, eligible.  With `observe`,
    also a waiting row abandoned by its enqueuer before it reserved or parked (its owner is
    gone, no reservation): it is treated as parked."""
    for row in fifo(q):
        if row.attached or row.cancel_requested or row.slot_reservation is not None:
            continue
        startable = row.state == "parked" or (
            observe is not None and row.state == "waiting" and not is_live(observe, row.owner))
        if startable and eligible(q, row, max_parallel):
            return row
    return None


def begin_dispatch(q: QueueFile, *, task_id: str, turn_id: str, me: ProcessIdentity, worker: str) -> QueueEntry:
    """The row's owner sends it to `worker`: Waiting(owner=me) -> Dispatching(me, worker)."""
    row = require_row(q, task_id, turn_id)
    if row.state == "dispatching" and row.dispatch_owner == me:
        row.worker = worker
        return row
    if row.state != "waiting" or row.owner != me:
        raise QueueError(QUEUE_NOT_OWNER, f"task {task_id} turn {turn_id} is {row.state}, not owned by {me}")
    row.state = "dispatching"
    row.dispatch_owner = me
    row.worker = worker
    return row


def finish_turn(q: QueueFile, *, task_id: str, turn_id: str, me: ProcessIdentity) -> bool:
    """The turn ended: its row leaves the queue (only its dispatch owner removes it)."""
    row = find_row(q, task_id, turn_id)
    if row is None:
        return False
    if row.dispatch_owner != me and row.owner != me:
        raise QueueError(QUEUE_NOT_OWNER, f"task {task_id} turn {turn_id} is not owned by {me}")
    q.entries.remove(row)
    return True


def pick_worker(q: QueueFile, candidates: Mapping[str, dict]) -> str | None:
    """Worker choice: the fewest turns this client has in flight there, then the runner's
    own queue (pending jobs), then the fewest held permits; ties by name.  `candidates` maps
    reachable, eligible worker names to their health reports."""
    if not candidates:
        return None

    def score(name: str):
        inflight = sum(1 for e in q.entries if e.state == "dispatching" and e.worker == name)
        cap = candidates[name].get("capacity", {}) if isinstance(candidates[name], dict) else {}
        return (inflight, int(cap.get("pending_jobs", 0) or 0), int(cap.get("held_permits", 0) or 0), name)

    return min(candidates, key=score)


def needs_runner(row: QueueEntry, runners: Runners, observe: Observe) -> bool:
    """Reconcile: an active (waiting/dispatching) row whose responsible process is gone and
    that no live runner of the turn, reservation or holder covers."""
    if row.state == "parked" or row.attached:
        return False
    if live_runner_for_current_turn(row, runners, observe) is not None:
        return False
    res = row.slot_reservation
    if res is not None and (is_live(observe, res.reserver) or is_live(observe, res.child)):
        return False
    if row.state == "dispatching":
        return not is_live(observe, row.dispatch_owner)
    return not is_live(observe, row.owner)


# --- seed 001: a waiting runner donates its process (claim_parked_for_waiting_runner) ------


@dataclass(frozen=True)
class TaskFacts:
    """What the shell read about one task for a claim decision (pure data).

    `workers`: the workers its pin/capabilities allow; `context`: the canonical worktree of
    its saved project context (None: a legacy task without one); `worktree`: the canonical
    path of its task record's project (what a legacy task runs in); `terminal`: the task's
    current turn has ended (a stale row)."""

    workers: frozenset[str]
    context: str | None
    worktree: str | None = None
    terminal: bool = False


@dataclass(frozen=True)
class Claim:
    """keep: dispatch the donor's own turn on `worker`.  move: the donor's process takes
    `recipient` on `worker` (`inherit`: a legacy recipient inherits the donor's saved
    context).  wait: nothing can run now."""

    kind: Literal["keep", "move", "wait"]
    worker: str | None = None
    recipient: tuple[str, str] | None = None
    inherit: bool = False


def worker_busy(q: QueueFile, name: str, *, ignore: QueueEntry | None = None) -> bool:
    """Readiness under the lock: a worker runs one of this client's turns at a time.  It is
    busy while a row is dispatching there, is waiting to re-attach there, or has a spawn
    (reservation) in progress for it."""
    for row in q.entries:
        if row is ignore or row.worker != name:
            continue
        if row.state in ("dispatching", "waiting") or row.slot_reservation is not None:
            return True
    return False


def ready_workers(q: QueueFile, observations: Mapping[str, dict], *,
                  ignore: QueueEntry | None = None) -> set[str]:
    """The observed workers (answered /v1/health) that are not busy (see worker_busy)."""
    return {n for n, rep in observations.items() if isinstance(rep, dict)
            and not worker_busy(q, n, ignore=ignore)}


def _usable(row: QueueEntry, facts: TaskFacts, ready: set[str]) -> set[str]:
    allowed = set(facts.workers) & ready
    if row.pin is not None:
        allowed &= {row.pin}
    if row.worker is not None:          # a dispatched turn re-attaches on its own worker only
        allowed &= {row.worker}
    return allowed


def _pick(q: QueueFile, usable: set[str], observations: Mapping[str, dict]) -> str:
    return pick_worker(q, {n: observations[n] for n in usable})  # type: ignore[return-value]


def claim_parked_for_waiting_runner(
    q: QueueFile,
    *,
    task_id: str,
    turn_id: str,
    owner: ProcessIdentity,
    observations: Mapping[str, dict],
    facts: Mapping[str, TaskFacts],
    max_parallel: Mapping[str, int] | None = None,
    reassign: bool = True,
    observe: Observe | None = None,
) -> Claim:
    """One decision of a waiting runner, under the QueueLock (seed 001, contracts 1-3).

    Only the exact owner (same pid AND start time) of a Waiting, unaccepted row may act; a
    dispatching or accepted turn cannot donate (QueueError QUEUE_NOT_OWNER otherwise).
    Candidates in FIFO order (queue_id): the donor's own row and runnable parked rows.  A
    parked row is runnable when it is committed (parked, no reservation, not attached, not
    cancelled, its task not terminal), `eligible` (task turn order, run cap, computed as if
    the donor were parked) and has a context the runner can supply (its own saved one, or a
    legacy row inheriting the donor's saved context of the same worktree).  The first
    candidate with a usable ready worker wins: that is the per-worker FIFO barrier (an older
    runnable parked turn goes first on every worker it can use; a younger task that needs a
    different worker still proceeds).  Ineligible rows are skipped, never barriers.  With
    `observe`, an older eligible Waiting row adopted by another LIVE runner (it is in this same
    wait and will claim at its next look) is a barrier on its usable ready workers too, so a
    displaced older task that got its runner back keeps its place."""
    donor = require_row(q, task_id, turn_id)
    if donor.state != "waiting" or donor.owner != owner or donor.attached:
        raise QueueError(QUEUE_NOT_OWNER, f"task {task_id} turn {turn_id} is {donor.state}, "
                                          f"not a waiting turn owned by {owner}")
    can_donate = reassign and donor.job_id is None and not donor.cancel_requested
    ready = ready_workers(q, observations, ignore=donor)
    donor_facts = facts.get(task_id)
    if not can_donate:
        if donor_facts is not None and eligible(q, donor, max_parallel):
            usable = _usable(donor, donor_facts, ready)
            if usable:
                return Claim("keep", _pick(q, usable, observations))
        return Claim("wait")
    hypo = QueueFile(next_queue_id=q.next_queue_id, last_enqueued_at_millis=q.last_enqueued_at_millis,
                     entries=[msgspec_copy(e) for e in q.entries])
    for e in hypo.entries:
        if e.key == donor.key:
            e.state, e.owner = "parked", None
    by_key = {e.key: e for e in hypo.entries}
    blocked: set[str] = set()
    for row in fifo(q):
        f = facts.get(row.task_id)
        if row is not donor and observe is not None and row.state == "waiting" and f is not None:
            holder = acting_queue_holder(row)
            if (holder is not None and is_live(observe, holder) and not row.cancel_requested
                    and eligible(q, row, max_parallel)):
                blocked |= _usable(row, f, ready)
            continue
        if f is None:
            continue
        if row is donor:
            if eligible(q, donor, max_parallel):
                usable = _usable(donor, f, ready) - blocked
                if usable:
                    return Claim("keep", _pick(q, usable, observations))
            continue
        if (row.state != "parked" or row.slot_reservation is not None or row.attached
                or row.cancel_requested or f.terminal):
            continue
        inherit = False
        if f.context is None:
            if (donor_facts is None or donor_facts.context is None or f.worktree is None
                    or f.worktree != donor_facts.context):
                continue  # a legacy row whose context we cannot supply: not runnable, no barrier
            inherit = True
        if not eligible(hypo, by_key[row.key], max_parallel):
            continue
        usable = _usable(row, f, ready) - blocked
        if usable:
            return Claim("move", _pick(q, usable, observations), row.key, inherit)
    return Claim("wait")


def apply_reassignment(q: QueueFile, *, donor: tuple[str, str], recipient: tuple[str, str],
                       owner: ProcessIdentity, worker: str) -> QueueEntry:
    """The one queue publication of a donation: donor Waiting -> Parked; recipient
    Parked -> Waiting -> Dispatching, both with the same process identity, on `worker`.
    Ids, commands, run membership and pins never change."""
    d = require_row(q, *donor)
    r = require_row(q, *recipient)
    if d.state != "waiting" or d.owner != owner:
        raise QueueError(QUEUE_NOT_OWNER, f"task {donor[0]} turn {donor[1]} is not waiting for {owner}")
    if r.state != "parked" or r.slot_reservation is not None:
        raise QueueError(QUEUE_NOT_OWNER, f"task {recipient[0]} turn {recipient[1]} is not parked")
    d.state, d.owner, d.dispatch_owner, d.slot_reservation = "parked", None, None, None
    r.state, r.owner = "waiting", owner
    r.state, r.dispatch_owner, r.worker = "dispatching", owner, worker
    return r


def unique_live_identities(q: QueueFile, runners: Runners, observe: Observe) -> set[ProcessIdentity]:
    """Live runner processes, once each: task.runner records and acting queue holders.  During
    a donation's partial metadata update one process may appear in two records; it is one."""
    out = {rec.identity for rec in runners.values() if is_live(observe, rec.identity)}
    for row in q.entries:
        holder = acting_queue_holder(row)
        if holder is not None and is_live(observe, holder):
            out.add(holder)
    return out


def drop_rows(q: QueueFile, task_id: str) -> None:
    """Submission rollback: the task's rows leave the queue."""
    q.entries[:] = [e for e in q.entries if e.task_id != task_id]
