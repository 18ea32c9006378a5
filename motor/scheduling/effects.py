"""The dispatcher machine's effects on the other actors (store, CPU allocator, execution
supervisor, accounting), carried out through their handles: at once where the other actor
can answer in the caller's task (`now`), else waited for (`wait`). The dispatcher's shell
(actor.py) carries out the effects on itself (replies, timers, the disk's asker)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import actors

from ..disk.host import free_bytes
from ..execution.actor import Cancel, JobDeps, JobExecution
from ..memory.core import MemoryCeiling
from ..store.db import StoreFull
from . import machine as m

if TYPE_CHECKING:
    from ..handles import DiskHandle, ExecutionHandle

log = logging.getLogger("motor.dispatcher")


@dataclass
class DispatchDeps:
    """The dispatcher's neighbours."""
    job: JobDeps
    execution: ExecutionHandle  # one transient job actor per job setting up or running
    disk: DiskHandle
    claim_limit: int
    capabilities: tuple[str, ...]
    ceiling: MemoryCeiling = MemoryCeiling()  # as read at start-up; maintenance sends changes
    #: ids of followed jobs (the Runner's, kept across restarts): the others' budgets are ours
    followers: set = field(default_factory=set)

NOT_NOW = object()  # `now`: this effect would wait
NOT_HERS = object()  # `now`: not an effect on another actor (the shell's own)


@dataclass
class Resume:
    """The effects `Dispatcher.handle_now` could not carry out at once: the dispatcher's
    next message (`Actor.handle_next`), with the deferred answer of the message, if any."""
    pending: list
    token: actors.DeferredReply | None


def now(effect, job, execution, ride: list | None = None):
    """Carry `effect` out without waiting: its answer for the machine (None: none);
    NOT_NOW when that would wait (the store's commits off the loop, an actor busy);
    NOT_HERS for an effect the shell carries out itself. `ride`: saves the message being
    handled brought along (`Finished.ride`): written with this save, then emptied."""
    if isinstance(effect, (m.SaveRecord, m.SaveClocks)):
        saves = _saves(effect)
        try:
            if job.store.save_many_now(*_writes(saves, ride)) is actors.LATER:
                return NOT_NOW
        except StoreFull as exc:
            return _save_failed(effect, saves, exc, job)
        return _saved(effect, ride)
    if isinstance(effect, m.PlaceCpus):
        cpus = job.cpu.place_now(effect.job_id, effect.claim)
        return NOT_NOW if cpus is actors.LATER else m.Placed(effect.job_id, cpus)
    if isinstance(effect, m.ReleaseCpus):
        return NOT_NOW if job.cpu.release_now(effect.job_id) is actors.LATER else None
    if isinstance(effect, m.StartJobActor):
        return None if execution.start_job_now(effect.job_id, _job_factory(effect, job)) \
            else NOT_NOW
    if isinstance(effect, m.CancelJobActor):
        return NOT_NOW if tell_cancel(effect.job_id, job, execution) is actors.LATER else None
    if isinstance(effect, m.NoteRefused):
        job.accounting.refused(effect.code)
    elif isinstance(effect, m.NoteEnded):
        job.accounting.ended(effect.record)
    else:
        return NOT_HERS
    return None


def tell_cancel(job_id: str, job, execution):
    """Tell the job's actor to cancel it, at once (`call_job_now`: its answer, None when it
    has no live actor, actors.LATER when it cannot take it now), the cancel kept in
    `JobDeps.cancels` for an incarnation of the actor made after (a restart after a crash:
    before stop 52 a cancel that found none was dropped)."""
    job.cancels.add(job_id)
    return execution.call_job_now(job_id, Cancel())


def cancel_running(machine: "m.DispatchMachine", job_id: str, job, execution):
    """A running job's cancel, which changes nothing of the machine's (only the job's actor
    is told), answered in the caller's task, also while the dispatcher waits on a save
    (another process's lock, a slow disk): "signalled" (an actor that is not there now,
    restarting or not yet started, finds it pending: `tell_cancel`). actors.LATER, the
    ordinary way through the machine, for any other job, or when its actor cannot take
    it now."""
    if not machine.cancel_only_signals(job_id):
        return actors.LATER
    told = tell_cancel(job_id, job, execution)  # None: no live actor (kept for the next)
    return actors.LATER if told is actors.LATER else "signalled"


async def wait(effect, job, execution, ride: list | None = None):
    """An effect `now` found would wait, waited for: its answer for the machine."""
    if isinstance(effect, (m.SaveRecord, m.SaveClocks)):
        saves = _saves(effect)
        try:
            await job.store.save_many(*_writes(saves, ride))
        except StoreFull as exc:
            return _save_failed(effect, saves, exc, job)
        return _saved(effect, ride)
    if isinstance(effect, m.PlaceCpus):
        return m.Placed(effect.job_id, await job.cpu.place(effect.job_id, effect.claim))
    if isinstance(effect, m.ReleaseCpus):
        await job.cpu.release(effect.job_id)
    elif isinstance(effect, m.StartJobActor):
        await execution.start_job(effect.job_id, _job_factory(effect, job))
    elif isinstance(effect, m.CancelJobActor):
        job.cancels.add(effect.job_id)
        await execution.call_job(effect.job_id, Cancel())
    else:
        raise TypeError(f"dispatcher: {effect!r} does not wait")
    return None


def _saves(effect) -> tuple:
    return effect.saves if isinstance(effect, m.SaveClocks) else (effect,)


def _writes(saves: tuple, ride: list | None) -> tuple:
    """`StoreHandle.save_many(_now)`'s arguments for `saves`, with the ride taken along."""
    return (s.store_write for s in saves), tuple(ride or ())


def _saved(effect, ride: list | None):
    """The save is done: the ride went with it (emptied: the Finished answers True)."""
    if ride:
        ride.clear()
    return m.SaveDone(effect)


def _save_failed(effect, saves, exc: StoreFull, job):
    if effect.purpose not in ("accept", "admit"):  # a refused submit: its answer says it
        log.warning("dispatcher: %s %s (%s%s) not recorded yet: %s",
                    saves[0].record.job_id, saves[0].record.state, effect.purpose,
                    f", {len(saves)} jobs" if len(saves) > 1 else "", exc)
    return m.SaveFailed(effect, str(exc), free_bytes(job.config.state_path))


def _job_factory(effect, job):
    """The job's actor: the record the dispatcher saved at its start; an incarnation made
    later (a restart of a crashed job actor) reads the record as stored then."""
    job_id, first = effect.job_id, [effect.record]

    def incarnation() -> JobExecution:
        fresh = effect.fresh and bool(first)  # a later incarnation looks: it may have set up
        return JobExecution((first.pop() if first else None) or job.records.get(job_id), job,
                            fresh=fresh)

    return incarnation
