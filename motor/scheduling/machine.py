"""The dispatcher's state machine: `handle(event, now, wall_ms) -> [effects]`, no I/O.

In the manner of distributed's worker state machine: the actor shell (actor.py) turns each
message into an event, hands it here, and carries out the effects returned, in order. Some
effects have an answer the decision depends on (the CPUs placed, a save the store refused
for lack of space): the shell hands that answer back as an event (`Placed`, `SaveDone`,
`SaveFailed`) before it carries out the next effect, so a decision and its consequences
stay in one message. `Continue(event)` asks the shell to hand `event` back once the effects
before it (and theirs) are done.

The machine owns the Scheduler core, the records of queued jobs, the set of active jobs
(setting up or running: their records belong to their job actors), the admissions waiting
for the disk, the saves the store refused for lack of space (retried), and which queue-wait
clocks are persisted.

Disk admission is an effect (`AskDisk`) whose answer comes back as an event (`DiskAnswered`)
in a later message: the dispatcher serves other messages meanwhile, and the submitter's
reply is deferred until then. Admissions complete in job-id (arrival) order whatever order
their answers come in, so queue order stays job-id order, as recovery rebuilds it.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec

from ..lifecycle import CANCEL, PLACE, QUEUED, SETUP, START_FAILED, WITHDRAW, advance, retain_until
from ..memory.core import MemoryCeiling
from ..records import JobRecord, JobRequest, Queued, Terminal, public_record
from .admission import (
    AdmissionSettings, accepted_events, as_refusal, build_record, disk_full_refusal, resume_clock,
    check_capacity, check_form, key_reused, same_submit, spec_of, withdraw_answer,
)
from .core import AWAITING_BUNDLES, Scheduler, queue_wait_budget_s
from .messages import (
    BundleArrived, CancelJob, CapacityView, CeilingChanged, Finished, Heartbeat, QueuedViews,
    SetupDone, StatusView, Unfollowed,
)
from .view import Journaled, QueuedJson, public_form, row_form, row_parts

#: how long the dispatcher waits before retrying saves the store refused for lack of space
STORE_FULL_RETRY_S = 1.0
#: Queue-wait clocks that change course within this many seconds of the last clock save
#: are saved together at its end (stop 23): a burst of starts and ends flips the clocks of
#: every job queued in their workspaces each time, and saving each flip cost more than
#: the job. A crash loses at most this much of their courses; an orderly stop none.
CLOCK_SAVE_S = 0.25
#: ... and a save of many clocks holds off the next one for one second per this many
#: clocks it wrote (stop 43): a few deep workspaces taken and freed in turn flip thousands
#: of clocks at each start and end, and saving them every CLOCK_SAVE_S was most of the
#: dispatcher's work (10,000 queued over 4 workspaces drained at 7-9 jobs/s). A crash then
#: loses at most that longer time of their courses (2.5 s for 10,000 clocks).
CLOCK_SAVE_ROWS_PER_S = 4000
#: events that only read: they change no record and nothing in the core but its time
_VIEWS = (StatusView, QueuedViews, Heartbeat)

# --- events: what the shell hands in ------------------------------------------------------
# The dispatcher's messages (messages.py) are events as they are, except Submit, StartFailed
# and Withdraw, which the shell completes (a deferred reply and a job id; the stored record).


@dataclass(frozen=True)
class Recover:
    """Start-up: the live records, the jobs that still have an actor, the bundles present
    (of the queued jobs that name one), the jobs a client follows."""

    records: tuple[JobRecord, ...]
    with_actor: Collection[str] = ()
    bundles_present: Collection[str] = ()
    followers: Collection[str] = ()


@dataclass(frozen=True)
class SubmitReceived:
    token: Any  # where the answer goes (a deferred reply)
    request: JobRequest
    follow: bool
    job_id: str  # minted on arrival: ids follow arrival order
    #: the retained job accepted with the request's idempotency key (the shell reads it
    #: from the store), or None
    existing: JobRecord | None = None


@dataclass(frozen=True)
class DiskAnswered:
    job_id: str
    refusal: Any  # a Refusal, or None: admitted
    bundle_present: bool = True


@dataclass(frozen=True)
class Placed:
    job_id: str
    cpus: list


@dataclass(frozen=True)
class SaveDone:
    save: "SaveRecord"


@dataclass(frozen=True)
class SaveFailed:
    """The store refused `save` for lack of space (StoreFull): nothing was written."""

    save: "SaveRecord"
    detail: str
    free_bytes: int | None = None


@dataclass(frozen=True)
class JobStartFailed:
    job_id: str
    detail: str
    cleanup_pending: bool
    record: JobRecord  # as the job actor left it (state setup)


@dataclass(frozen=True)
class WithdrawJob:
    job_id: str
    stored: JobRecord | None  # its record in the store, for a job no longer queued here


@dataclass(frozen=True)
class TimerFired:
    pass


@dataclass(frozen=True)
class FlushUnsaved:
    pass


@dataclass(frozen=True)
class FlushClocks:
    """Save every changed clock now (the dispatcher's orderly stop)."""


@dataclass(frozen=True)
class AdmitNext:
    """Internal: the previous admission is done (saved or refused); complete the next."""


@dataclass(frozen=True)
class Settle:
    """Internal: the starts are carried out; arm the timer and persist the clocks."""


# --- effects: what the shell carries out --------------------------------------------------


@dataclass(frozen=True)
class Reply:
    token: Any  # None: the answer to the message being handled
    value: Any


@dataclass(frozen=True)
class AskDisk:
    """Disk admission (cleanup if needed); answer: DiskAnswered, in a later message."""

    job_id: str
    workspace: str
    siblings: tuple[str, ...]
    bundle_sha256: str | None


@dataclass(frozen=True)
class SaveRecord:
    """Save a record (and events); answer: SaveDone, or SaveFailed on StoreFull."""

    record: JobRecord
    events: tuple = ()
    retain_until_ms: int | None = None
    #: "accept" | "admit" (accept and start in one save) | "start" | "defer" | "flush" | "clock"
    purpose: str = "defer"
    token: Any = None  # accept, admit: the submitter's deferred reply
    #: clock, accept: the clock's course saved (accept: None while it awaits its bundles)
    running: bool | None = None
    #: clock: write the clock alone, not the record (the store's `ClockSave`, issue 14)
    clock_only: bool = False
    #: clock, accept: the clock's value saved and the core time of that value
    clock_at: tuple[float, float] | None = None
    #: accept: the starts were decided with the job in its queue (no decision after it)
    decided: bool = False
    #: admit: the record as accepted (queued), the submitter's answer; `record` is its start
    accepted: Any = field(default=None, compare=False, repr=False)

    @property
    def store_write(self) -> tuple:
        """This save as `StoreHandle.save_many` takes it."""
        return (self.record, self.events, self.retain_until_ms, self.clock_only)


@dataclass(frozen=True)
class SaveClocks:
    """Save the queue-wait clocks of these queued jobs (`SaveRecord`s of purpose "clock",
    no events) in ONE transaction, all or none; answer: SaveDone, or SaveFailed on StoreFull."""

    saves: tuple[SaveRecord, ...]
    purpose = "clock"


@dataclass(frozen=True)
class PlaceCpus:
    """Answer: Placed (its CPUs)."""

    job_id: str
    claim: int


@dataclass(frozen=True)
class ReleaseCpus:
    job_id: str


@dataclass(frozen=True)
class StartJobActor:
    job_id: str
    #: the job's record as just saved (its start) or recovered: the job actor's first
    #: incarnation starts from it without reading it back from the store (issue 14)
    record: Any = field(default=None, compare=False, repr=False)
    #: accepted by this dispatcher and never placed before (an "admit", its id minted just
    #: now, or a job from its queue: `unplaced`), so nothing of it can be on disk yet: the
    #: first incarnation need not look in its job directory before the set-up (issue 14:
    #: three stats off a start)
    fresh: bool = False


@dataclass(frozen=True)
class CancelJobActor:
    job_id: str


@dataclass(frozen=True)
class NoteRefused:
    code: str


@dataclass(frozen=True)
class NoteEnded:
    record: JobRecord


@dataclass(frozen=True)
class ArmTimer:
    deadline: float | None  # None: nothing to wake up for


@dataclass(frozen=True)
class ArmFlush:
    delay_s: float


@dataclass(frozen=True)
class Continue:
    event: Any


@dataclass
class _Admission:
    token: Any
    request: JobRequest
    follow: bool
    claim: int
    answer: DiskAnswered | None = None
    bundle_arrived: bool = False


@dataclass
class DispatchMachine:
    settings: AdmissionSettings
    core: Scheduler
    ceiling: MemoryCeiling = MemoryCeiling()
    #: jobs waiting (owned here); journaled for the status view (view.QueuedJson.patch)
    queued: dict[str, JobRecord] = field(default_factory=Journaled)
    active: set[str] = field(default_factory=set)  # setting up or running
    #: admissions waiting for the disk, in job-id order
    admitting: dict[str, _Admission] = field(default_factory=dict)
    #: {idempotency key: (job id, request)} of admissions not yet answered: a submit with
    #: the same key waits for that answer (`key_waiters`) rather than being admitted again
    keyed: dict[str, tuple[str, JobRequest]] = field(default_factory=dict)
    #: {job id: the tokens of the submits that wait for its admission's answer}
    key_waiters: dict[str, list] = field(default_factory=dict)
    #: {job_id: the queued record} of jobs being placed and saved as `setup`
    starting: dict[str, JobRecord] = field(default_factory=dict)
    #: jobs this machine accepted into a queue and has not started yet (queued, or placed
    #: and their start not saved): nothing of them can be on disk, so their first start is
    #: `fresh` like an admit's (issue 14: a queued job's set-up looked in a job directory
    #: that cannot exist); a recovered job is never in it
    unplaced: set[str] = field(default_factory=set)
    #: {job_id: its accept's SaveRecord} of jobs in `starting` accepted in this message: their
    #: accept is saved with their start ("admit"), once placed
    admitted: dict[str, "SaveRecord"] = field(default_factory=dict)
    #: {job_id: (queue_clock_running, value s, core time of the value)} as last persisted
    clock_saved: dict[str, tuple[bool, float, float]] = field(default_factory=dict)
    #: queued jobs whose clock may differ from what was persisted
    clock_check: set[str] = field(default_factory=set)
    #: core time before which changed clocks wait (clock_save_s after the last clock save)
    clock_save_at: float = float("-inf")
    clock_save_s: float = CLOCK_SAVE_S  # RunnerConfig.clock_save_s
    #: {job_id: SaveRecord} decided here, refused by the store for lack of space: retried
    #: every STORE_FULL_RETRY_S; a later save of the same job supersedes it
    unsaved: dict[str, SaveRecord] = field(default_factory=dict)
    flush_armed: bool = False
    #: events handled that may change a record or the core (all but _VIEWS): with the
    #: core's version, what says a status view may be the one before with time moved on
    events: int = 0
    #: the encoded status rows of the queued jobs, kept across status views (view.py)
    queued_rows: QueuedJson = field(default_factory=lambda: QueuedJson(row_parts))
    #: the same for their whole public records (`GET /v1/status?full=1`)
    queued_json: QueuedJson = field(default_factory=QueuedJson)
    #: job starts that failed since the last one that succeeded, and the latest's
    #: {at_ms, detail}: the health report's sign of a runner that starts nothing
    failed_starts: int = 0
    last_start_failure: dict | None = None

    @classmethod
    def new(cls, settings: AdmissionSettings, *, confined_cpu_list=None,
            ceiling: MemoryCeiling = MemoryCeiling(),
            clock_save_s: float = CLOCK_SAVE_S) -> "DispatchMachine":
        core = Scheduler(max_weight=settings.max_weight, max_queue_depth=settings.max_queue_depth,
                         claim_limit=settings.claim_limit, confined_cpu_list=confined_cpu_list,
                         default_spill_s=settings.default_spill_s)
        return cls(settings=settings, core=core, ceiling=ceiling, clock_save_s=clock_save_s)

    # -- the one entry point -----------------------------------------------------------------

    def handle(self, event: Any, now: float, wall_ms: int) -> list:
        method = getattr(self, "_on_" + type(event).__name__, None)
        if method is None:
            raise TypeError(f"dispatcher: unknown event {event!r}")
        if type(event) not in _VIEWS:
            self.events += 1
        return method(event, now, wall_ms)

    def _after(self, now: float) -> list:
        """After every event that may change the core: start the heads that can start."""
        return [*self._place(self.core.decide(now)), Continue(Settle())]

    def _place(self, starts: list, accept: "SaveRecord | None" = None) -> list:
        """Place the CPUs of `starts` (decided), in order; `accept`: the job being admitted,
        not queued yet, which may be one of them."""
        effects: list = []
        for start in starts:
            if accept is not None and start.job_id == accept.record.job_id:
                self.starting[start.job_id] = accept.record
                self.admitted[start.job_id] = accept
            else:
                self.starting[start.job_id] = self.queued.pop(start.job_id)
            effects.append(PlaceCpus(start.job_id, start.claim))
        return effects

    def _on_Settle(self, event, now, wall_ms):
        wakeup = self.core.next_wakeup(now)
        if now < self.clock_save_at:  # clocks saved < clock_save_s ago: these wait for then
            self.clock_check |= self.core.take_clock_changes(now)
            if self.clock_check and (wakeup is None or self.clock_save_at < wakeup):
                wakeup = self.clock_save_at
            return [ArmTimer(wakeup)]
        return [ArmTimer(wakeup), *self._clock_saves(now, wall_ms)]

    def _on_FlushClocks(self, event, now, wall_ms):
        return self._clock_saves(now, wall_ms)

    # -- start-up --------------------------------------------------------------------------

    def _on_Recover(self, event: Recover, now, wall_ms):
        effects: list = []
        for record in event.records:
            spec = spec_of(record)
            if record.state == QUEUED:
                if spec.runner_enforces_budget or record.job_id not in event.followers:
                    # no live follower holds this budget (none survives a process restart)
                    record = msgspec.structs.replace(record, budget_enforced_by="runner")
                    spec = spec_of(record)
                self.core.accept(spec, now, force=True)
                # ready with its bundle stored, or ready before (its bundle was there then:
                # gone now, its setup ends it `workspace_setup_failed`, as without a restart;
                # before stop 55 it waited for an upload no client would send, unseen)
                if (record.bundle_sha256 is None or record.bundle_sha256 in event.bundles_present
                        or record.ready_at_ms is not None):
                    waited_s, age_s = resume_clock(record, wall_ms)
                    self.core.ready(record.job_id, now, waited_s=waited_s, ready_age_s=age_s)
                    if record.ready_at_ms is not None and record.queue_clock_at_ms is not None:
                        # The stored clock (value at a wall time, course) stays exact while
                        # its course is the same: saved again only if the course changed
                        # (issue 14: not 10,000 commits before the first answer). The
                        # enforcer set above is derived again at every recovery.
                        self.clock_saved[record.job_id] = (
                            record.queue_clock_running, waited_s, now)
                self.queued[record.job_id] = record
                continue
            self.core.adopt_running(spec, now)
            self.active.add(record.job_id)
            if record.job_id not in event.with_actor:
                effects.append(StartJobActor(record.job_id, record))
        return effects + self._after(now)

    # -- admission ---------------------------------------------------------------------------

    def _on_SubmitReceived(self, event: SubmitReceived, now, wall_ms):
        req = event.request
        refusal = check_form(req, self.settings)
        if refusal is not None:
            return [Reply(event.token, refusal)]
        key = req.idempotency_key
        if key is not None and (event.existing is not None or key in self.keyed):
            return self._keyed_again(event)
        claim, refusal = check_capacity(req, self.settings, self.core, self.ceiling)
        if refusal is not None:
            return [NoteRefused(refusal.code), Reply(event.token, refusal)]
        if key is not None:
            self.keyed[key] = (event.job_id, req)
        self.admitting[event.job_id] = _Admission(event.token, req, event.follow, claim)
        return [AskDisk(event.job_id, req.workspace, tuple(req.siblings), req.bundle_sha256)]

    def _keyed_again(self, event: SubmitReceived) -> list:
        """A submit whose idempotency key a job was accepted with (`existing`, from the
        store) or is being admitted with: answered with that job, or with the same answer
        once it has one; idempotency_key_reused if the request differs from that job's."""
        req = event.request
        if event.existing is not None:
            job_id, first = event.existing.job_id, event.existing
        else:
            job_id, first = self.keyed[req.idempotency_key]
        if not same_submit(req, first):
            return [Reply(event.token, key_reused(req.idempotency_key, job_id))]
        if event.existing is not None:
            return [Reply(event.token, event.existing)]
        self.key_waiters.setdefault(job_id, []).append(event.token)
        return []

    def _answer(self, job_id: str, key: str | None, token, value) -> list:
        """An admission's answer (its accepted record or its refusal) to its submit and to
        the submits with the same idempotency key that wait for it."""
        if key is not None:
            self.keyed.pop(key, None)
        return [Reply(t, value) for t in (token, *self.key_waiters.pop(job_id, ()))]

    def _on_DiskAnswered(self, event: DiskAnswered, now, wall_ms):
        pending = self.admitting.get(event.job_id)
        if pending is None:
            return []
        pending.answer = event
        return self._on_AdmitNext(None, now, wall_ms)

    def _on_AdmitNext(self, event, now, wall_ms):
        """Complete the first admission if its disk answer is in: admissions complete in
        job-id order (queue order is arrival order), ONE at a time: the next is admitted
        once this one's record is saved (or it is refused), so at most one accepted job is
        in the core and not yet recorded, and the only starts decided while it is are those
        of its own admission (`_admit`)."""
        effects: list = []
        while self.admitting:
            job_id, first = next(iter(self.admitting.items()))
            if first.answer is None:
                break
            del self.admitting[job_id]
            effects += self._admit(job_id, first, now, wall_ms)
            if job_id in self.admitted or isinstance(effects[-1], SaveRecord):
                break  # the next after its save (with its start, or alone)
        return effects

    def _admit(self, job_id: str, pending: _Admission, now, wall_ms) -> list:
        refusal = pending.answer.refusal
        record = build_record(pending.request, job_id=job_id, follow=pending.follow,
                              claim=pending.claim, settings=self.settings,
                              ceiling=self.ceiling, now_ms=wall_ms)
        if refusal is None:
            refusal = self.core.accept(spec_of(record), now)
        if refusal is not None:
            refusal = as_refusal(refusal)
            return [NoteRefused(refusal.code),
                    *self._answer(job_id, pending.request.idempotency_key, pending.token, refusal)]
        # Bundle present (verified, pinned): it joins its queue now and its clock starts,
        # saved with its record (issue 14: not a second save of the same record right after
        # it). Missing: it waits, accepted and counted in max_queue_depth, until the upload
        # arrives (BundleArrived); its clock starts then; no start is decided before its
        # record is saved (`_after` runs after SaveDone). A refused save cancels it.
        running = None
        if pending.answer.bundle_present or pending.bundle_arrived:
            self.core.ready(job_id, now)
            running = self.core.clock_state(job_id, now)[1]
            record = msgspec.structs.replace(record, queue_wait_ms=0, queue_clock_at_ms=wall_ms,
                                             queue_clock_running=running, ready_at_ms=wall_ms)
        accept = SaveRecord(record, tuple(accepted_events(record, self.settings)),
                            purpose="accept", token=pending.token, running=running,
                            clock_at=None if running is None else (0.0, now))
        if running is None:
            return [accept]
        # In its queue: the starts are decided now, not after the save (issue 14). If it is
        # one of them, its accept is saved with its start, once placed ("admit": one commit
        # on an idle runner's start path, not two); a refused save undoes both. Otherwise
        # its accept is saved after the other starts' placements, with nothing more to
        # decide after it. (Another job can only be among them if it could start before
        # this one came: a job joining a queue frees nothing.)
        effects = self._place(self.core.decide(now), accept)
        if job_id in self.admitted:
            return [*effects, Continue(Settle()), Continue(AdmitNext())]
        return [*effects, replace(accept, decided=True)]

    def _accept_saved(self, save: SaveRecord, now) -> list:
        record = save.record
        self.queued[record.job_id] = record
        self.unplaced.add(record.job_id)
        if save.running is not None:  # its clock, as saved with it
            self.clock_saved[record.job_id] = (save.running, *save.clock_at)
        after = [Continue(Settle())] if save.decided else self._after(now)
        return [*self._answer(record.job_id, record.idempotency_key, save.token, record), *after,
                Continue(AdmitNext())]

    def _accept_failed(self, failed: SaveFailed, now) -> list:
        # not recorded, so not accepted: undo the core's accept (and its joining a queue)
        save = failed.save
        job_id = save.record.job_id
        effects: list = [NoteRefused("runner_disk_full"), *self._answer(
            job_id, save.record.idempotency_key, save.token,
            disk_full_refusal(failed.detail, self.settings, failed.free_bytes))]
        if save.purpose == "admit":  # its start too: Settle and AdmitNext follow already
            del self.starting[job_id]
            self.core.start_failed(job_id, now)
            self.core.cancel(job_id, now)
            return [ReleaseCpus(job_id), *effects, *self._place(self.core.decide(now))]
        self.core.cancel(job_id, now)
        # decided before its save (`_admit`): decide again without it, and settle
        after = self._after(now) if save.decided else []
        return [*effects, *after, Continue(AdmitNext())]

    # -- answers of the shell's effects -----------------------------------------------------------

    def _on_Placed(self, event: Placed, now, wall_ms):
        record = self.starting[event.job_id]
        status = self.core.wait_status(event.job_id, now)
        setup = advance(
            record, PLACE, who="dispatcher", cpus=event.cpus, attempts=record.attempts + 1,
            queue_wait_ms=status.queue_wait_ms, waiting_on=None, waiting_on_job=None,
            waiting_detail=None, queue_clock_running=False, detail=None)  # (a failed start's)
        self.clock_saved.pop(event.job_id, None)
        accept = self.admitted.pop(event.job_id, None)
        if accept is not None:  # accepted in this message: its accept goes with its start
            return [SaveRecord(setup, accept.events, purpose="admit", token=accept.token,
                               accepted=accept.record)]
        return [SaveRecord(setup, purpose="start")]

    def _on_SaveDone(self, event: SaveDone, now, wall_ms):
        save = event.save
        if isinstance(save, SaveClocks):
            for clock in save.saves:
                job_id = clock.record.job_id
                old = self.queued.get(job_id)
                self.queued[job_id] = clock.record  # from `old`: nothing else ran since
                if old is not None:
                    self._carry(old, clock.record)
                self.clock_saved[job_id] = (clock.running, *clock.clock_at)
                self.clock_check.discard(job_id)
            return []
        job_id = save.record.job_id
        if save.purpose == "accept":
            return self._accept_saved(save, now)
        if save.purpose in ("start", "admit"):
            del self.starting[job_id]
            self.unsaved.pop(job_id, None)  # superseded (a deferred requeue)
            self.active.add(job_id)
            first = job_id in self.unplaced
            self.unplaced.discard(job_id)
            started = StartJobActor(job_id, save.record, fresh=save.purpose == "admit" or first)
            return [*self._answer(job_id, save.accepted.idempotency_key, save.token, save.accepted),
                    started] if save.purpose == "admit" \
                else [started]
        if save.purpose == "flush":
            current = self.unsaved.get(job_id)
            if current is not None and current.record is save.record:  # not superseded
                del self.unsaved[job_id]
            return self._next_flush()
        return []

    def _on_SaveFailed(self, event: SaveFailed, now, wall_ms):
        save = event.save
        if isinstance(save, SaveClocks):  # a full state fs: the clocks are persisted next time
            return []
        job_id = save.record.job_id
        if save.purpose in ("accept", "admit"):
            return self._accept_failed(event, now)
        if save.purpose == "start":  # nothing runs unrecorded: back to its queue, retry later
            record = self.starting.pop(job_id)
            self.unplaced.discard(job_id)  # its next start looks (it is rare)
            self.core.start_failed(job_id, now)
            self.queued[job_id] = record
            return [ReleaseCpus(job_id)]  # Settle, after the other starts, re-arms the timer
        if save.purpose == "defer":
            self.unsaved[job_id] = save
        return self._arm_flush()  # "flush": it stays unsaved; stop and retry later

    # -- job actors ----------------------------------------------------------------------------

    def _on_SetupDone(self, event: SetupDone, now, wall_ms):
        if self.core.job_state(event.job_id) == SETUP:  # adopted after a restart: running
            self.core.setup_done(event.job_id, now)
        self.failed_starts = 0
        return self._after(now)

    def _on_JobStartFailed(self, event: JobStartFailed, now, wall_ms):
        job_id = event.job_id
        self.active.discard(job_id)
        self.core.start_failed(job_id, now, cleanup_pending=event.cleanup_pending)
        self.failed_starts += 1
        self.last_start_failure = {"at_ms": wall_ms, "detail": f"job {job_id}: {event.detail}"}
        record = advance(event.record, START_FAILED, who="dispatcher", cpus=None,
                         detail=event.detail)
        self.queued[job_id] = record
        self.clock_saved.pop(job_id, None)  # its clock resumes: persist that
        self.clock_check.add(job_id)
        return [*self._save_or_defer(SaveRecord(record, (Queued(
            **self._wait_fields(job_id, now), queue_wait_budget_ms=self._budget_ms(job_id)),))),
            *self._after(now)]

    def _on_Finished(self, event: Finished, now, wall_ms):
        if event.job_id not in self.active:  # asked again (its actor restarted after the
            return [Reply(None, None)]  # first): its permits are back, its ride not taken
        self.active.discard(event.job_id)
        self.core.finished(event.job_id, now)
        return [*self._after(now), Reply(None, None)]

    # -- clients -------------------------------------------------------------------------------

    def _on_CancelJob(self, event: CancelJob, now, wall_ms):
        job_id = event.job_id
        if job_id in self.queued:
            waited_ms = self.core.wait_status(job_id, now).queue_wait_ms  # its clock's end
            self.core.cancel(job_id, now)
            effects = self._end_queued(job_id, wall_ms, CANCEL, reason="cancelled",
                                       detail="cancelled before start", queue_wait_ms=waited_ms)
            return [*effects, *self._after(now), Reply(None, "cancelled")]
        if self.cancel_only_signals(job_id):
            return [CancelJobActor(job_id), *self._after(now), Reply(None, "signalled")]
        return [*self._after(now), Reply(None, "unknown")]

    def cancel_only_signals(self, job_id: str) -> bool:
        """Whether a CancelJob of `job_id` changes nothing here, only tells its actor (it
        runs): the shell may then answer it while a save waits (scheduling/actor.py)."""
        return job_id in self.active

    def _on_WithdrawJob(self, event: WithdrawJob, now, wall_ms):
        answer, effects = self._withdraw(event.job_id, event.stored, now, wall_ms)
        return [*effects, *self._after(now), Reply(None, answer)]

    def _withdraw(self, job_id: str, stored: JobRecord | None, now, wall_ms):
        """"withdrawn", "started" (setting up, running, or it ran: too late), "unknown", or
        an `already_ended` refusal naming the state of a job that ended before it started
        (cancelled, or withdrawn already): never "withdrawn" twice."""
        if job_id not in self.queued:
            if job_id in self.active or job_id in self.starting:
                return "started", []
            if stored is None or not stored.terminal:
                return "unknown", []
            return withdraw_answer(stored), []
        status = self.core.wait_status(job_id, now)
        budget_s = self._budget_s(job_id)
        record = self.queued[job_id]
        answer = self.core.withdraw(job_id, now)
        if answer != "withdrawn":
            return answer, []
        waited = f"waited {status.queue_wait_ms} ms"
        if status.waiting_detail:
            waited += f"; {status.waiting_detail}"
        elif status.waiting_on:
            waited += f", last waiting on {status.waiting_on}"
        detail = f"queue wait budget of {budget_s:g} s exhausted before start ({waited})"
        if record.detail and record.attempts:  # its starts failed: keep the last failure
            detail += (f"; {record.attempts} start attempt"
                       f"{'s' if record.attempts != 1 else ''} failed, the last: {record.detail}")
        return answer, self._end_queued(job_id, wall_ms, WITHDRAW, reason="queue_wait_exceeded",
                                        detail=detail, queue_wait_ms=status.queue_wait_ms)

    def _end_queued(self, job_id, wall_ms, event, *, reason, detail, queue_wait_ms: int) -> list:
        """End a job that never started; `queue_wait_ms` is its clock at the end (the core's,
        read before the job left it: the stored record holds only the last saved value)."""
        record = self.queued.pop(job_id)
        self.clock_saved.pop(job_id, None)
        self.unplaced.discard(job_id)
        record = advance(
            record, event, who="dispatcher", reason=reason, detail=detail, ended_at_ms=wall_ms,
            waiting_on=None, waiting_on_job=None, waiting_detail=None, queue_clock_running=False,
            queue_wait_ms=queue_wait_ms)
        save = SaveRecord(record, (Terminal(record=public_record(record)),),
                          retain_until_ms=retain_until(record))
        return [*self._save_or_defer(save), NoteEnded(record)]

    def _on_Unfollowed(self, event: Unfollowed, now, wall_ms):
        job_id = event.job_id
        if job_id in self.queued:
            self.core.set_runner_enforced(job_id, True)
            old = self.queued[job_id]
            self.queued[job_id] = msgspec.structs.replace(old, budget_enforced_by="runner")
            self._carry(old, self.queued[job_id])  # an internal field only
            self.clock_saved.pop(job_id, None)  # persist the new enforcer
            self.clock_check.add(job_id)
        return self._after(now)

    def _on_CeilingChanged(self, event: CeilingChanged, now, wall_ms):
        self.ceiling = event.ceiling
        return self._after(now)

    def _on_BundleArrived(self, event: BundleArrived, now, wall_ms):
        for pending in self.admitting.values():  # answered "missing" before it arrived
            if pending.request.bundle_sha256 == event.sha256:
                pending.bundle_arrived = True
        for job_id, record in list(self.queued.items()):
            if (record.bundle_sha256 == event.sha256
                    and self.core.job_state(job_id) == AWAITING_BUNDLES):
                self.core.ready(job_id, now)
        return self._after(now)

    def _on_TimerFired(self, event, now, wall_ms):
        effects = self._after(now)[:-1]  # a head that can start now starts before its budget ends
        for job_id in self.core.expired(now):
            effects += self._withdraw(job_id, None, now, wall_ms)[1]
        return effects + self._after(now)

    # -- saves refused for lack of space ------------------------------------------------------------

    def _save_or_defer(self, save: SaveRecord) -> list:
        """Record a decision already taken here (requeue, cancel, withdraw). If the state
        filesystem is full, the decision stands in memory and the save is retried every
        STORE_FULL_RETRY_S until it succeeds (health shows the store degraded meanwhile)."""
        self.unsaved.pop(save.record.job_id, None)  # superseded by this newer save
        return [save]

    def _arm_flush(self) -> list:
        if self.flush_armed or not self.unsaved:
            return []
        self.flush_armed = True
        return [ArmFlush(STORE_FULL_RETRY_S)]

    def _on_FlushUnsaved(self, event, now, wall_ms):
        self.flush_armed = False
        return self._next_flush()

    def _next_flush(self) -> list:
        for save in self.unsaved.values():  # one at a time: the first refusal stops the round
            return [SaveRecord(save.record, save.events, save.retain_until_ms, purpose="flush")]
        return []

    # -- queue-wait clocks ---------------------------------------------------------------------------

    def _clock_saves(self, now: float, wall_ms: int) -> list:
        """The saves of the queued jobs' clocks that changed course (started, paused,
        resumed) or whose enforcer changed, as ONE effect (one transaction, issue 14: a job
        starting or ending flips the clocks of every job queued in its workspace): for each,
        its value then, the wall time, whether it advances, and when the job became ready.
        Between such changes the clock is linear in time, so that is enough for a restart to
        resume it (and the 60 s aging) exactly. Only the jobs whose clock changed are looked
        at (the core reports them), and one whose stored clock still tells its value (the
        same course; the stored value, plus the time since if it advances) is skipped. They
        are saved before the message that changed them is done (the shell carries the
        effect out before the next message) when no clock was saved in the last
        `clock_save_s`; else together once that time is up (`_on_Settle` arms the timer),
        so a crash loses at most that much of their courses (an orderly stop: `FlushClocks`).
        A refusal (a full state fs) writes none of them; they are persisted later."""
        self.clock_check |= self.core.take_clock_changes(now)
        saves = []
        ids = sorted(self.clock_check)  # job-id (arrival) order
        for job_id, state in zip(ids, self.core.clock_states(ids, now)):
            record = self.queued.get(job_id)
            if record is None or state is None:
                self.clock_check.discard(job_id)
                continue  # ended, started, or still awaiting its bundles: no clock yet
            waited_s, running, age_s = state
            saved = self.clock_saved.get(job_id)
            if saved is not None and saved[0] is running and abs(
                    saved[1] + (now - saved[2] if running else 0.0) - waited_s) < 1e-6:
                self.clock_check.discard(job_id)  # the stored clock still tells it
                continue
            record = msgspec.structs.replace(
                record, queue_wait_ms=int(waited_s * 1000), queue_clock_at_ms=wall_ms,
                queue_clock_running=running,
                ready_at_ms=record.ready_at_ms if record.ready_at_ms is not None
                else wall_ms - int(age_s * 1000))
            # The stored record is the one held here but for its clock and enforcer (the
            # only fields changed without a save), so the clock alone is written; unless
            # a save of this job was refused and awaits its retry (a requeue): then the
            # whole record, as before.
            saves.append(SaveRecord(record, purpose="clock", running=running,
                                    clock_only=job_id not in self.unsaved,
                                    clock_at=(waited_s, now)))
        if not saves:
            return []
        spacing = self.clock_save_s  # 0: every change at once, however many
        if spacing > 0:
            spacing = max(spacing, len(saves) / CLOCK_SAVE_ROWS_PER_S)
        self.clock_save_at = now + spacing
        return [SaveClocks(tuple(saves))]

    # -- views ------------------------------------------------------------------------------

    def view(self, event: Any, now: float, wall_ms: int) -> Any:
        """The answer to a view (a CapacityView, StatusView, QueuedViews or Heartbeat),
        read at any point the machine is whole: between two events, or while the shell
        waits on an effect (scheduling/actor.py, `readers`)."""
        if isinstance(event, CapacityView):
            return self.capacity()
        [reply] = self.handle(event, now, wall_ms)
        return reply.value

    def _on_QueuedViews(self, event: QueuedViews, now, wall_ms):
        ids = [job_id for job_id in event.job_ids if job_id in self.queued]
        return [Reply(None, dict(zip(ids, self.core.wait_statuses(ids, now))))]

    def _on_Heartbeat(self, event: Heartbeat, now, wall_ms):
        if event.job_id not in self.queued:
            return [Reply(None, None)]
        return [Reply(None, Queued(**self._wait_fields(event.job_id, now),
                                   queue_wait_budget_ms=self._budget_ms(event.job_id)))]

    def _carry(self, old: JobRecord, new: JobRecord) -> None:
        """`new` replaced `old`, only clock or internal fields changed (QueuedJson.carry)."""
        self.queued_rows.carry(old, new)
        self.queued_json.carry(old, new)

    def _on_StatusView(self, event: StatusView, now, wall_ms):
        # One refresh of the core for the whole view (issue 14: 10,000 queued). Each queued
        # job is a status row, or its whole public record with `full`. Encoded: "queued"
        # holds each one's JSON, kept from the view before while the record is the same
        # (view.QueuedJson), only the live wait fields encoded now. Else each is built once,
        # with its live wait fields set on the result.
        cache, form = ((self.queued_json, public_form) if event.full
                       else (self.queued_rows, row_form))
        if event.encoded:
            # the view before, if nothing but time happened since (view.QueuedJson.again);
            # else that view with the jobs that moved since changed (QueuedJson.patch)
            t = self.core.refresh(now)
            key = (self.events, self.core.version, self.queued.mark())
            queued = cache.again(key, t)
            if queued is None:
                queued = cache.patch(self.queued, self.core, now, key)
            if queued is None:
                marks = (self.core.moved_mark(), self.queued.mark())
                clocks: tuple[list, list] = ([], [])
                waits_ms, waits = self.core.wait_columns(self.queued, now, clocks)
                queued = cache.encode(self.queued, waits_ms, waits, clocks, key, marks)
        else:
            statuses = self.core.wait_statuses(self.queued, now)
            queued = [form(record, *status)
                      for record, status in zip(self.queued.values(), statuses)]
        return [Reply(None, {
            "queued": queued,
            # (with those being placed and saved as starting: a view read while the save
            # of a start waits on the store has each job in one of the two lists)
            "active": sorted(self.active.union(self.starting)),
            "capacity": self.capacity(),
        })]

    def _budget_s(self, job_id: str) -> float:
        return queue_wait_budget_s(spec_of(self.queued[job_id]),
                                   default_spill_s=self.settings.default_spill_s)

    def _budget_ms(self, job_id: str) -> int:
        return int(self._budget_s(job_id) * 1000)

    def _wait_fields(self, job_id: str, now: float) -> dict:
        status = self.core.wait_status(job_id, now)
        return {"queue_wait_ms": status.queue_wait_ms, "waiting_on": status.waiting_on,
                "waiting_on_job": status.waiting_on_job, "waiting_detail": status.waiting_detail}

    def capacity(self) -> dict:
        stats = self.core.statistics()
        return {
            "max_weight": self.settings.max_weight,
            "claim_limit": self.settings.claim_limit,
            "held_permits": stats.held_permits,
            "setup_permits": stats.setup_permits,
            "max_queue_depth": self.settings.max_queue_depth,
            "pending_jobs": stats.pending,
            **({"failed_starts": self.failed_starts, "last_start_failure": self.last_start_failure}
               if self.failed_starts else {}),
        }
