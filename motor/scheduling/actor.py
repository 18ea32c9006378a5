"""The dispatcher actor: the seed's "state lock", as one serializing actor.

It owns the Scheduler core (queue, heads, permits, backfill, retry delays, queue-wait
clocks) and the records of queued jobs. Every admission, start, end, cancel and withdraw
passes through its inbox one message at a time; after each message it asks the core which
heads start now and carries that out: place CPUs (cpu actor), record the CPUs and the
`setup` state (store) before anything runs, then start the job's actor (execution).

Once a job is setting up, its record belongs to its job actor; the dispatcher keeps only
the core's view (permits and workspace held) until the job actor reports `Finished`.

On start (runner start-up, or a restart of this actor) it rebuilds the core from the
store: queued jobs rejoin their workspace queues in id (arrival) order; jobs recorded as
setting up or running are adopted, and a job actor is started for each that has none.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import trio

import actors

from ..clock import uuid7
from ..config import parse_size
from ..execution.actor import Cancel, JobDeps, JobExecution
from ..lifecycle import CANCEL, PLACE, QUEUED, START_FAILED, WITHDRAW, advance, retain_until
from ..memory.core import MemoryCeiling, admission as memory_admission, unit_limit
from ..records import (
    Accepted, JobRecord, JobRequest, Queued, Refusal, RequestError, Terminal, caller_root_for,
    public_record,
    validate_request,
)
from ..store.actor import Save
from ..store.db import StoreFull
from .core import JobSpec, Scheduler, claim_for, gate_honoured, queue_wait_budget_s
from .messages import (
    BundleArrived, CancelJob, CapacityView, CeilingChanged, Finished, Heartbeat, QueuedView, SetupDone, StartFailed, StatusView, Submit, Tick,
    Unfollowed, Withdraw,
)

if TYPE_CHECKING:
    from ..handles import DiskHandle, ExecutionHandle

log = logging.getLogger("motor.dispatcher")


@dataclass
class DispatchDeps:
    job: JobDeps
    execution: "ExecutionHandle"  # one transient job actor per job setting up or running
    disk: "DiskHandle"
    claim_limit: int
    capabilities: tuple[str, ...]
    ceiling: MemoryCeiling = MemoryCeiling()  # as read at start-up; maintenance sends changes
    #: Ids of jobs a client follows right now (kept by the Runner; it outlives a restart of
    #: this actor but not of the process): a recovered queued job not in it has no live
    #: follower, so the runner enforces its budget.
    followers: set = field(default_factory=set)


def spec_of(record: JobRecord) -> JobSpec:
    enforcer = record.budget_enforced_by or ("client" if record.follow else "runner")
    return JobSpec(
        job_id=record.job_id, workspace=record.workspace, siblings=tuple(record.siblings),
        claim=record.claim, gate=record.gate, kind=record.kind,
        queue_wait_limit_s=record.queue_wait_limit_s, timeout_s=record.timeout_s,
        spill_eligible=record.spill_eligible, runner_enforces_budget=enforcer == "runner",
    )


def _disk_full_refusal(deps: DispatchDeps, detail: str) -> Refusal:
    """`runner_disk_full` for a job the store could not record (the state fs is full)."""
    state_dir = deps.job.config.state_path
    try:
        free = os.statvfs(state_dir)
        free_bytes = free.f_bavail * free.f_frsize
    except OSError:
        free_bytes = None
    return Refusal(code="runner_disk_full", detail=detail, free_bytes=free_bytes,
                   floor_bytes=deps.job.config.floor_bytes())


#: how long the dispatcher waits before retrying saves the store refused for lack of space
STORE_FULL_RETRY_S = 1.0


@dataclass(frozen=True)
class _FlushUnsaved:
    """Internal: retry the saves the store refused for lack of space."""


@dataclass(frozen=True)
class _Dispatch:
    """Internal: run the start decision (queued by a submit, after its reply)."""


class Dispatcher(actors.Actor):
    inbox_size = 512

    def __init__(self, deps: DispatchDeps):
        super().__init__(name="dispatcher")
        self.deps = deps
        config = deps.job.config
        self.core = Scheduler(
            max_weight=config.max_weight, max_queue_depth=config.max_queue_depth,
            claim_limit=deps.claim_limit, confined_cpu_list=config.linux_cpus,
            default_spill_s=config.queue_wait_default_s,
        )
        self.ceiling = deps.ceiling  # the memory ceiling admission decides with
        self.caller_roots = config.caller_roots  # parsed once, as the disk actor's
        self.per_vcpu_bytes = parse_size(config.memory_per_vcpu_bytes)  # a claim's default memory
        self.queued: dict[str, JobRecord] = {}  # {job_id: record} jobs waiting (owned here)
        self.active: set[str] = set()  # job ids setting up or running (records owned by job actors)
        self._dispatch_pending = False  # a _Dispatch message is in our inbox
        self._timer: trio.CancelScope | None = None
        self._wakeup = math.inf
        #: {job_id: queue_clock_running} as last persisted for each queued job
        self._clock_saved: dict[str, bool] = {}
        #: {job_id: Save} decided here but refused by the store for lack of space (StoreFull):
        #: retried every STORE_FULL_RETRY_S; a later save of the same job supersedes it
        self._unsaved: dict[str, Save] = {}
        self._flush_armed = False
        #: queued jobs whose clock may differ from what was persisted (the core reports
        #: clock changes; an enforcer change or a requeue adds the job here)
        self._clock_check: set[str] = set()

    # -- life ---------------------------------------------------------------------------

    async def on_start(self):
        await self._recover()
        self.nursery.start_soon(self._timer_loop)
        await self._start_heads()

    async def _recover(self):
        deps = self.deps
        now = trio.current_time()
        wall = deps.job.clock.now_ms()
        children = deps.execution.jobs()
        for record in deps.job.records.live():
            spec = spec_of(record)
            if record.state == QUEUED:
                if spec.runner_enforces_budget or record.job_id not in deps.followers:
                    # no live follower holds this budget (none survives a process restart)
                    record = msgspec.structs.replace(record, budget_enforced_by="runner")
                    spec = spec_of(record)
                self.core.accept(spec, now, force=True)
                if record.bundle_sha256 is None or await deps.disk.has_bundle(record.bundle_sha256):
                    waited_s, age_s = _resume_clock(record, wall)
                    self.core.ready(record.job_id, now, waited_s=waited_s, ready_age_s=age_s)
                self.queued[record.job_id] = record
                continue
            self.core.adopt_running(spec, now)
            self.active.add(record.job_id)
            if record.job_id not in children:
                await self._start_job_actor(record.job_id)
        if self.queued or self.active:
            log.info("dispatcher: recovered %d queued and %d running jobs",
                     len(self.queued), len(self.active))

    async def _timer_loop(self):
        while True:
            with trio.CancelScope(deadline=self._wakeup) as scope:
                self._timer = scope
                await trio.sleep_forever()
            self._timer = None
            if trio.current_time() >= self._wakeup:
                self._wakeup = math.inf
                await self.cast_self(Tick())  # also while on_start still runs

    def _rearm(self):
        wakeup = self.core.next_wakeup(trio.current_time())
        self._wakeup = math.inf if wakeup is None else wakeup
        if self._timer is not None:
            self._timer.deadline = self._wakeup

    # -- messages -----------------------------------------------------------------------

    async def handle(self, msg):
        now = trio.current_time()
        reply = None
        if isinstance(msg, Submit):
            reply = await self._submit(msg.request, msg.follow, now)
        elif isinstance(msg, SetupDone):
            if self.core.job_state(msg.job_id) == "setting_up":  # adopted after a restart: running
                self.core.setup_done(msg.job_id, now)
        elif isinstance(msg, StartFailed):
            await self._start_failed(msg, now)
        elif isinstance(msg, Finished):
            self.active.discard(msg.job_id)
            self.core.finished(msg.job_id, now)
        elif isinstance(msg, CancelJob):
            reply = await self._cancel(msg.job_id, now)
        elif isinstance(msg, Withdraw):
            reply = await self._withdraw(msg.job_id, now, reason="queue_wait_exceeded")
        elif isinstance(msg, QueuedView):
            record = self.queued.get(msg.job_id)
            reply = None if record is None else self._live_view(record, now)
        elif isinstance(msg, BundleArrived):
            self._bundle_arrived(msg.sha256, now)
        elif isinstance(msg, CeilingChanged):
            self.ceiling = self.deps.ceiling = msg.ceiling
        elif isinstance(msg, Heartbeat):
            if msg.job_id in self.queued:
                reply = Queued(**self._wait_fields(msg.job_id, now),
                               queue_wait_budget_ms=int(self._budget_s(msg.job_id) * 1000))
        elif isinstance(msg, Unfollowed):
            if msg.job_id in self.queued:
                self.core.set_runner_enforced(msg.job_id, True)
                self.queued[msg.job_id] = msgspec.structs.replace(
                    self.queued[msg.job_id], budget_enforced_by="runner")
                self._clock_saved.pop(msg.job_id, None)  # persist the new enforcer
                self._clock_check.add(msg.job_id)
        elif isinstance(msg, StatusView):
            reply = self._status(now)
        elif isinstance(msg, CapacityView):
            reply = self._capacity()
        elif isinstance(msg, Tick):
            await self._start_heads()  # a head that can start now starts before its budget ends
            for job_id in self.core.expired(now):
                await self._withdraw(job_id, now, reason="queue_wait_exceeded")
        elif isinstance(msg, _Dispatch):
            self._dispatch_pending = False
        elif isinstance(msg, _FlushUnsaved):
            self._flush_armed = False
            await self._flush_unsaved()
        else:
            raise TypeError(f"dispatcher: unknown message {msg!r}")
        if isinstance(msg, (QueuedView, Heartbeat, StatusView, CapacityView)):
            return reply  # read-only: nothing to decide
        if isinstance(msg, Submit):
            # Answer the submitter first; the start decision follows as the next message.
            if not self._dispatch_pending:
                try:
                    self.cast_self_nowait(_Dispatch())
                    self._dispatch_pending = True
                except actors.InboxFull:
                    await self._start_heads()
            return reply  # its clock is persisted after the _Dispatch that follows
        await self._start_heads()
        await self._persist_clocks(trio.current_time())
        return reply

    async def _submit(self, req: JobRequest, follow: bool, now: float):
        deps = self.deps
        try:
            validate_request(req)
        except RequestError as exc:
            return Refusal(code="bad_request", detail=str(exc))
        for name in (req.workspace, *req.siblings):
            if name.startswith("/") and caller_root_for(name, self.caller_roots) is None:
                return Refusal(code="bad_request", detail=(
                    f"workspace {name!r} is not a plain name and no --caller-root serves it"))
        claim = claim_for(req.weight_hint, req.kind, deps.claim_limit)
        refusal = self.core.check_claim(claim)
        if refusal is None:
            refusal = memory_admission(self.ceiling)
        job_id = uuid7(deps.job.clock.now_ms())
        if refusal is None:  # protects the job's workspace and siblings from cleanup from now on
            refusal = await deps.disk.admit(job_id, req.workspace, req.siblings)
        gate = gate_honoured(req.gate, req.capabilities) and "gate_jobs" in deps.capabilities
        record = JobRecord(
            job_id=job_id, state=QUEUED, workspace=req.workspace,
            workspace_kind=req.workspace_kind, siblings=list(req.siblings),
            repository=req.repository, command=list(req.command), kind=req.kind, gate=gate,
            claim=claim,
            memory_max_bytes=unit_limit(req.memory_max_bytes or claim * self.per_vcpu_bytes, self.ceiling),
            accepted_at_ms=deps.job.clock.now_ms(), timeout_s=req.timeout_s,
            queue_wait_limit_s=req.queue_wait_limit_s, spill_eligible=req.spill_eligible,
            follow=follow, env=dict(req.env), bundle_sha256=req.bundle_sha256,
            budget_enforced_by="client" if follow else "runner",
        )
        if refusal is None:
            core_refusal = self.core.accept(spec_of(record), now)
            if core_refusal is not None:
                refusal = Refusal(code=core_refusal.code, detail=core_refusal.detail)
        if refusal is not None:
            deps.job.accounting.refused(refusal.code)
            return refusal if isinstance(refusal, Refusal) else Refusal(
                code=refusal.code, detail=refusal.detail)
        record = msgspec.structs.replace(record, queued_at_ms=record.accepted_at_ms)
        budget_ms = int(queue_wait_budget_s(spec_of(record),
                                            default_spill_s=deps.job.config.queue_wait_default_s) * 1000)
        try:
            await deps.job.store.save(record, [
                Accepted(job_id=job_id, claim=claim, capabilities=list(deps.capabilities)),
                Queued(queue_wait_budget_ms=budget_ms),
            ])
        except StoreFull as exc:  # not recorded, so not accepted: undo the core's accept
            self.core.cancel(job_id, now)
            deps.job.accounting.refused("runner_disk_full")
            return _disk_full_refusal(deps, str(exc))
        self.queued[job_id] = record
        # Bundle present (verified, pinned): ready now. Missing: it waits, accepted and counted
        # in max_queue_depth, until the upload arrives (BundleArrived); its clock starts then.
        if req.bundle_sha256 is None or await deps.disk.has_bundle(req.bundle_sha256):
            self.core.ready(job_id, now)
        return record

    def _bundle_arrived(self, sha256: str, now: float) -> None:
        for job_id, record in list(self.queued.items()):
            if (record.bundle_sha256 == sha256
                    and self.core.job_state(job_id) == "awaiting_bundles"):
                self.core.ready(job_id, now)

    async def _start_heads(self):
        deps = self.deps
        now = trio.current_time()
        for start in self.core.decide(now):
            record = self.queued.pop(start.job_id)
            status = self.core.wait_status(start.job_id, now)
            cpus = await deps.job.cpu.place(start.job_id, start.claim)
            setup = advance(
                record, PLACE, who=self.name, cpus=cpus, attempts=record.attempts + 1,
                queue_wait_ms=status.queue_wait_ms, waiting_on=None, waiting_on_job=None,
                waiting_detail=None, queue_clock_running=False)
            self._clock_saved.pop(start.job_id, None)
            try:
                await deps.job.store.save(setup)
            except StoreFull as exc:  # nothing runs unrecorded: back to its queue, retry later
                log.warning("dispatcher: cannot start %s: %s", start.job_id, exc)
                await deps.job.cpu.release(start.job_id)
                self.core.start_failed(start.job_id, now)
                self.queued[start.job_id] = record
                continue
            self._unsaved.pop(start.job_id, None)  # superseded (a deferred requeue)
            self.active.add(start.job_id)
            await self._start_job_actor(start.job_id)
        self._rearm()

    async def _start_job_actor(self, job_id: str):
        deps = self.deps

        def factory():
            return JobExecution(deps.job.records.get(job_id), deps.job)

        await deps.execution.start_job(job_id, factory)

    async def _start_failed(self, msg: StartFailed, now: float):
        self.active.discard(msg.job_id)
        self.core.start_failed(msg.job_id, now, cleanup_pending=msg.cleanup_pending)
        record = self.deps.job.records.get(msg.job_id)
        record = advance(record, START_FAILED, who=self.name, cpus=None, detail=msg.detail)
        self.queued[msg.job_id] = record
        self._clock_saved.pop(msg.job_id, None)  # its clock resumes: persist that
        self._clock_check.add(msg.job_id)
        await self._save_or_defer(Save(record=record, events=[
            Queued(**self._wait_fields(msg.job_id, now),
                   queue_wait_budget_ms=int(self._budget_s(msg.job_id) * 1000))]))

    async def _cancel(self, job_id: str, now: float) -> str:
        if job_id in self.queued:
            self.core.cancel(job_id, now)
            await self._end_queued(job_id, now, CANCEL, reason="cancelled",
                                   detail="cancelled before start")
            return "cancelled"
        if job_id in self.active:
            ref = self.deps.execution.job(job_id)
            if ref is not None:
                try:
                    await ref.call(Cancel(), timeout=10)
                except actors.ActorDead:
                    pass
            return "signalled"
        return "unknown"

    async def _withdraw(self, job_id: str, now: float, *, reason: str) -> str | Refusal:
        """"withdrawn", "started" (setting up, running, or it ran: too late), "unknown", or
        an `already_ended` refusal naming the state of a job that ended before it started
        (cancelled, or withdrawn already): never "withdrawn" twice."""
        if job_id not in self.queued:
            if job_id in self.active:
                return "started"
            record = self.deps.job.records.get(job_id)
            if record is None or not record.terminal:
                return "unknown"
            return withdraw_answer(record)
        status = self.core.wait_status(job_id, now)
        waited_ms = status.queue_wait_ms
        budget_s = self._budget_s(job_id)
        record = self.queued[job_id]
        answer = self.core.withdraw(job_id, now)
        if answer == "withdrawn":
            waited = f"waited {waited_ms} ms"
            if status.waiting_detail:
                waited += f"; {status.waiting_detail}"
            elif status.waiting_on:
                waited += f", last waiting on {status.waiting_on}"
            detail = f"queue wait budget of {budget_s:g} s exhausted before start ({waited})"
            if record.detail and record.attempts:  # its starts failed: keep the last failure
                detail += (f"; {record.attempts} start attempt"
                           f"{'s' if record.attempts != 1 else ''} failed, the last: {record.detail}")
            await self._end_queued(
                job_id, now, WITHDRAW, reason=reason,
                detail=detail, queue_wait_ms=waited_ms)
        return answer

    async def _end_queued(self, job_id, now, event, *, reason, detail, queue_wait_ms=None):
        record = self.queued.pop(job_id)
        self._clock_saved.pop(job_id, None)
        ended = self.deps.job.clock.now_ms()
        record = advance(
            record, event, who=self.name, reason=reason, detail=detail, ended_at_ms=ended,
            waiting_on=None, waiting_on_job=None, waiting_detail=None, queue_clock_running=False,
            queue_wait_ms=record.queue_wait_ms if queue_wait_ms is None else queue_wait_ms)
        await self._save_or_defer(Save(
            record=record, events=[Terminal(record=public_record(record))],
            retain_until_ms=retain_until(record)))
        self.deps.job.accounting.ended(record)

    async def _persist_clocks(self, now: float) -> None:
        """Persist each queued job's clock when it changes course (starts, pauses, resumes)
        or its enforcer changes: its value then, the wall time, whether it advances, and
        when the job became ready.  Between such changes the clock is linear in time, so
        that is enough for a restart to resume it (and the 60 s aging) exactly.  Only the
        jobs whose clock changed since the last call are looked at (the core reports them)."""
        wall = None
        self._clock_check |= self.core.take_clock_changes(now)
        for job_id in list(self._clock_check):
            record = self.queued.get(job_id)
            if record is None or self.core.job_state(job_id) != "queued":
                self._clock_check.discard(job_id)
                continue  # ended, started, or still awaiting its bundles: no clock yet
            waited_s, running, age_s = self.core.clock_state(job_id, now)
            if self._clock_saved.get(job_id) is running:
                self._clock_check.discard(job_id)
                continue
            wall = self.deps.job.clock.now_ms() if wall is None else wall
            record = msgspec.structs.replace(
                record, queue_wait_ms=int(waited_s * 1000), queue_clock_at_ms=wall,
                queue_clock_running=running,
                ready_at_ms=record.ready_at_ms if record.ready_at_ms is not None
                else wall - int(age_s * 1000))
            try:
                await self.deps.job.store.save(record)
            except StoreFull as exc:  # a full state fs: the clocks are persisted next time
                log.warning("dispatcher: queue-wait clocks not persisted yet: %s", exc)
                return
            self.queued[job_id] = record
            self._clock_saved[job_id] = running
            self._clock_check.discard(job_id)

    async def _save_or_defer(self, msg: Save) -> None:
        """Record a decision already taken here (requeue, cancel, withdraw). If the state
        filesystem is full, the decision stands in memory and the save is retried every
        STORE_FULL_RETRY_S until it succeeds (health shows the store degraded meanwhile)."""
        job_id = msg.record.job_id
        self._unsaved.pop(job_id, None)  # superseded by this newer save
        try:
            await _save(self.deps.job.store, msg)
        except StoreFull as exc:
            log.warning("dispatcher: %s %s, not recorded yet (retrying): %s",
                        job_id, msg.record.state, exc)
            self._unsaved[job_id] = msg
            self._arm_flush()

    def _arm_flush(self) -> None:
        if self._flush_armed or not self._unsaved:
            return
        self._flush_armed = True

        async def later():
            await trio.sleep(STORE_FULL_RETRY_S)
            await self.cast_self(_FlushUnsaved())

        self.nursery.start_soon(later)

    async def _flush_unsaved(self) -> None:
        for job_id, msg in list(self._unsaved.items()):
            try:
                await _save(self.deps.job.store, msg)
            except StoreFull:
                break
            if self._unsaved.get(job_id) is msg:
                del self._unsaved[job_id]
        self._arm_flush()

    # -- views ---------------------------------------------------------------------------

    def _budget_s(self, job_id: str) -> float:
        return queue_wait_budget_s(spec_of(self.queued[job_id]),
                                   default_spill_s=self.deps.job.config.queue_wait_default_s)

    def _wait_fields(self, job_id: str, now: float) -> dict:
        status = self.core.wait_status(job_id, now)
        return {"queue_wait_ms": status.queue_wait_ms, "waiting_on": status.waiting_on,
                "waiting_on_job": status.waiting_on_job, "waiting_detail": status.waiting_detail}

    def _live_view(self, record: JobRecord, now: float) -> JobRecord:
        return msgspec.structs.replace(record, **self._wait_fields(record.job_id, now))

    def _status(self, now: float) -> dict:
        return {
            "queued": [public_record(self._live_view(r, now)) for r in self.queued.values()],
            "active": sorted(self.active),
            "capacity": self._capacity(),
        }

    def _capacity(self) -> dict:
        stats = self.core.statistics()
        return {
            "max_weight": self.deps.job.config.max_weight,
            "claim_limit": self.deps.claim_limit,
            "held_permits": stats.held_permits,
            "setup_permits": stats.setup_permits,
            "max_queue_depth": self.deps.job.config.max_queue_depth,
            "pending_jobs": stats.pending,
        }


async def _save(store, msg: Save) -> None:
    await store.save(msg.record, msg.events, retain_until_ms=msg.retain_until_ms)


def withdraw_answer(record: JobRecord) -> str | Refusal:
    """The answer to withdrawing a job that already ended: "started" if it ran (too late),
    else an `already_ended` refusal naming its state (never "withdrawn" a second time)."""
    if record.started_at_ms is not None:
        return "started"
    return Refusal(code="already_ended", job_id=record.job_id, detail=(
        f"job {record.job_id} already ended before it started: {record.state}"
        + (f" ({record.reason})" if record.reason else "")))


def _resume_clock(record: JobRecord, wall_ms: int) -> tuple[float, float]:
    """(queue wait so far, seconds since ready) of a queued job recovered after a restart,
    from its persisted clock. A clock that was advancing kept advancing while the runner
    was down (that wait was not for a workspace); a paused one resumes at its value.
    Records from before these fields resume at their stored queue_wait_ms."""
    waited_ms = record.queue_wait_ms
    if record.queue_clock_running and record.queue_clock_at_ms is not None:
        waited_ms += max(0, wall_ms - record.queue_clock_at_ms)
    ready_at = record.ready_at_ms
    if ready_at is None and record.bundle_sha256 is None:
        ready_at = record.queued_at_ms
    age_ms = 0 if ready_at is None else max(0, wall_ms - ready_at)
    return waited_ms / 1000.0, age_ms / 1000.0
