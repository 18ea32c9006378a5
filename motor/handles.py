"""Typed handles: what one actor may ask of another, as methods (OTP's API functions).

Each handle wraps the `ActorRef` of one subsystem (made before the tree starts, see
motor/runner/tree.py) and hides its message protocol: callers write
`await store.save(record, events)` or `await cpu.place(job_id, claim)`, never build
message objects, and a protocol change stays inside the subsystem and this file.
Handles are plain objects, stable across restarts of the actor they point at, and cheap
to fake in tests (any object with the same methods will do).

Calls raise what the ref raises: the replied error of the callee (e.g. `StoreFull`),
`actors.ActorDead` while it is down, `actors.CallTimeout` past the timeout.
"""

from __future__ import annotations

import contextlib
import logging

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import actors

from .accounting.actor import AdmissionRefused, JobEnded, JobStarted, Report, notify
from .cpu.actor import KeepOnly, Place, Release, Snapshot
from .disk.messages import (
    Admit, AdmitUpload, BeginUpload, CommitUpload, HasBundle, JobIdle, Listing, Periodic,
    PrepareSetup, Register, Reserve, Sample, SetupPlan, Unreserve,
)
from .lifecycle import ACTIVE_STATES
from .memory.core import MemoryCeiling
from .records import Event, JobRecord, JobRequest
from .scheduling.messages import (
    BundleArrived, CancelJob, CapacityView, CeilingChanged, Finished, Heartbeat, QueuedViews,
    SUBMIT_TIMEOUT_S, SetupDone, StartFailed, StatusView, Submit, Unfollowed, Withdraw,
)
from .store.messages import Expire, Save, SaveMany
from .wire import CHANGE_TIMEOUT_S

log = logging.getLogger("motor.cpu")

__all__ = [
    "AccountingHandle", "CpuHandle", "DiskHandle", "DispatcherHandle", "ExecutionHandle",
    "Records", "StoreHandle",
]


def _save_many(writes: Iterable[tuple], also: tuple[Save, ...] = ()) -> SaveMany:
    return SaveMany((*also, *(Save(record=w[0], events=tuple(w[1]), retain_until_ms=w[2],
                                   clock_only=len(w) > 3 and w[3]) for w in writes)))


class _Handle:
    __slots__ = ("ref",)

    def __init__(self, ref: Any):
        self.ref = ref

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.ref!r}>"


class StoreHandle(_Handle):
    """The store actor: every write of a job record or event."""

    async def save(self, record: JobRecord, events: Sequence[Event] = (), *,
                   log_offset: int | None = None, retain_until_ms: int | None = None,
                   timeout: float | None = None) -> list:
        """Upsert `record` and append `events` in one commit; the events with their seqs.
        Raises `StoreFull` when the state filesystem is full (nothing written).

        No timeout by default: a save the store has taken is written, however long it waits
        (a stalled disk, another process's write lock: health says so), and a caller that
        gave up would go on as if it were not (stop 50: a dispatcher that gave up after 30 s
        restarted without a job whose acceptance was written after, and never started it)."""
        return await self.ref.call(Save(record=record, events=tuple(events), log_offset=log_offset,
                                        retain_until_ms=retain_until_ms), timeout=timeout)

    async def save_many(self, writes: Iterable[tuple], also: tuple[Save, ...] = (), *,
                        timeout: float | None = None) -> list[list]:
        """Several `(record, events, retain_until_ms)` saves in ONE commit, all or none;
        each one's events with their seqs. Raises `StoreFull` (nothing written). A write
        `(record, (), None, True)` saves only the record's queue-wait clock (store/db.py,
        `ClockSave`). `also`: `Save`s written first in the same commit (another actor's,
        taken along: `Finished.ride`). No timeout by default, as `save`."""
        return await self.ref.call(_save_many(writes, also), timeout=timeout)

    def save_many_now(self, writes: Iterable[tuple], also: tuple[Save, ...] = ()):
        """`save_many` done at once when the store is idle and commits on the event loop
        (for a caller that must not wait); actors.LATER otherwise, nothing written."""
        return self.ref.try_now(_save_many(writes, also))

    async def expire(self, now_ms: int) -> list[str]:
        """Delete records past their retention; the ids deleted."""
        return await self.ref.call(Expire(now_ms))


class CpuHandle(_Handle):
    """The CPU allocator."""

    async def place(self, job_id: str, claim: int) -> list[int]:
        return await self.ref.call(Place(job_id, claim))

    def place_now(self, job_id: str, claim: int):
        """`place` at once when the allocator is idle; actors.LATER otherwise."""
        return self.ref.try_now(Place(job_id, claim))

    def release_now(self, job_id: str):
        """`release` at once when the allocator is idle; actors.LATER otherwise."""
        return self.ref.try_now(Release(job_id))

    async def release(self, job_id: str) -> None:
        """A cast (issue 14: one call less per job): the allocator's inbox is first in,
        first out, so whatever the caller asks after it (the dispatcher's next `place`)
        finds the CPUs free; nothing waits for an answer it does not need."""
        await self.ref.cast(Release(job_id))

    async def keep_only_recorded(self, records) -> list[str]:
        """Release the placements of every job not setting up or running in `records`
        (what the store holds), logged; the ids released. A restarted dispatcher's first
        step: its predecessor may have crashed between a start's placement and its save,
        and no job actor will release those CPUs (docs/cpu.md, "A restarted
        dispatcher"). An allocator between two incarnations: nothing to do (it
        re-registers only the recorded jobs itself)."""
        active = frozenset(r.job_id for r in records if r.state in ACTIVE_STATES)
        try:
            dropped = await self.ref.call(KeepOnly(active))
        except actors.ActorDead:
            return []
        if dropped:
            log.warning("cpu: released the CPUs of %d start(s) placed and never recorded: %s",
                        len(dropped), ", ".join(dropped))
        return dropped

    async def snapshot(self) -> dict:
        return await self.ref.call(Snapshot())


class DiskHandle(_Handle):
    """The disk manager."""

    async def admit(self, job_id: str | None = None, workspace: str | None = None,
                    siblings: Iterable[str] = (), *, timeout: float | None = 30.0):
        """A Refusal, or None when there is room (after cleanup)."""
        return await self.ref.call(Admit(job_id, workspace, tuple(siblings)), timeout=timeout)

    def admit_now(self, job_id: str, workspace: str | None, siblings: Iterable[str] = ()):
        """`admit`'s answer at once when the disk is idle and needs no cleanup (it never
        waits: for the dispatcher's own task); actors.LATER otherwise."""
        return self.ref.try_now(Admit(job_id, workspace, tuple(siblings)))

    async def has_bundle(self, sha256: str) -> bool:
        return await self.ref.call(HasBundle(sha256))

    async def prepare_setup(self, job_id: str, workspace: str, siblings: Iterable[str] = (), *,
                            kind: str = "task", bundle_sha256: str | None = None) -> SetupPlan:
        return await self.ref.call(PrepareSetup(job_id, workspace, tuple(siblings), kind,
                                                bundle_sha256))

    async def job_idle(self, job_id: str, workspace: str, siblings: Iterable[str] = ()) -> None:
        await self.ref.cast(JobIdle(job_id, workspace, tuple(siblings)))

    async def register(self, msg: Register):
        return await self.ref.call(msg)

    async def reserve(self, token: str, names: Iterable[str]) -> None:
        await self.ref.call(Reserve(token, tuple(names)))

    async def unreserve(self, token: str) -> None:
        await self.ref.call(Unreserve(token))

    async def admit_upload(self, sha256: str):
        return await self.ref.call(AdmitUpload(sha256))

    async def begin_upload(self, sha256: str):
        return await self.ref.call(BeginUpload(sha256))

    async def commit_upload(self, upload: Any):
        return await self.ref.call(CommitUpload(upload))

    async def periodic(self, *, timeout: float | None = 600) -> dict:
        return await self.ref.call(Periodic(), timeout=timeout)

    async def sample(self):
        return await self.ref.call(Sample())

    async def listing(self) -> list:
        return await self.ref.call(Listing())


class AccountingHandle(_Handle):
    """Accounting: told, never waited for (a dropped note is logged, never costs a job)."""

    def refused(self, code: str) -> bool:
        return notify(self.ref, AdmissionRefused(code))

    def started(self, msg: JobStarted) -> bool:
        return notify(self.ref, msg)

    def ended(self, record: JobRecord) -> bool:
        return notify(self.ref, JobEnded(record))

    async def report(self, now_ms: int | None = None) -> dict:
        return await self.ref.call(Report(now_ms))


class DispatcherHandle(_Handle):
    """The dispatcher (the seed's state lock). `change_timeout_s`: how long a cancel or a
    withdraw waits for it (RunnerConfig.change_timeout_s)."""

    __slots__ = ("change_timeout_s",)

    def __init__(self, ref, change_timeout_s: float = CHANGE_TIMEOUT_S):
        super().__init__(ref)
        self.change_timeout_s = change_timeout_s

    async def submit(self, request: JobRequest, follow: bool = False):
        """The accepted JobRecord, or a Refusal."""
        return await self.ref.call(Submit(request, follow), timeout=SUBMIT_TIMEOUT_S)

    async def cancel(self, job_id: str) -> str:
        return await self.ref.call(CancelJob(job_id), timeout=self.change_timeout_s)

    async def withdraw(self, job_id: str):
        return await self.ref.call(Withdraw(job_id), timeout=self.change_timeout_s)

    async def queued_views(self, job_ids: tuple[str, ...]) -> dict[str, tuple]:
        return await self.ref.call(QueuedViews(job_ids))

    async def heartbeat(self, job_id: str):
        return await self.ref.call(Heartbeat(job_id))

    async def status_view(self, encoded: bool = False, full: bool = False) -> dict:
        return await self.ref.call(StatusView(encoded, full))

    async def capacity(self) -> dict:
        return await self.ref.call(CapacityView())

    async def unfollowed(self, job_id: str) -> None:
        await self.ref.cast(Unfollowed(job_id))

    async def bundle_arrived(self, sha256: str) -> None:
        await self.ref.cast(BundleArrived(sha256))

    async def ceiling_changed(self, ceiling: MemoryCeiling) -> None:
        await self.ref.cast(CeilingChanged(ceiling))

    # from the job actors
    async def setup_done(self, job_id: str) -> None:
        await self.ref.cast(SetupDone(job_id))

    async def start_failed(self, job_id: str, detail: str, *, cleanup_pending: bool = False) -> None:
        await self.ref.cast(StartFailed(job_id, detail, cleanup_pending))

    async def finished(self, job_id: str, ride: Save | None = None) -> bool:
        """Waits until the dispatcher has returned the job's permits. `ride`: the job's
        terminal save, made with the dispatcher's next save while it handles this (the
        next job's start); whether it was (if not, the caller saves it). No timeout: the
        dispatcher may be waiting on the store (as `StoreHandle.save`), and a caller that
        gave up and asked again would end the job twice."""
        return await self.ref.call(Finished(job_id, ride), timeout=None) is True


class ExecutionHandle:
    """The execution supervisor: one transient child actor per job setting up or running.

    It holds a function returning the supervisor, not the supervisor itself: a nested
    supervisor is a new object after each restart of its own supervisor."""

    __slots__ = ("_supervisor",)

    def __init__(self, supervisor: Callable[[], Any]):
        self._supervisor = supervisor

    def jobs(self) -> set[str]:
        """Ids of the jobs that have an actor now."""
        return {name.removeprefix("job-") for name in self._supervisor().children()}

    def job(self, job_id: str):
        """The job actor's ref, or None."""
        try:
            return self._supervisor().ref(f"job-{job_id}")
        except KeyError:
            return None

    async def call_job(self, job_id: str, msg: Any, timeout: float = 10) -> None:
        """Call the job's actor with `msg`, if it has one (none, or it ended: nothing)."""
        ref = self.job(job_id)
        if ref is not None:
            with contextlib.suppress(actors.ActorDead):
                await ref.call(msg, timeout=timeout)

    async def start_job(self, job_id: str, factory: Callable[[], Any]) -> None:
        """The job's actor, started: at once when the supervisor is idle (its task runs
        soon; a Cancel sent meanwhile waits for it), else in the supervisor's turn.

        An actor of the job's that is still ending (one whose start failed told the
        dispatcher so, then returns) is waited for first: the job's retry may come due
        before that actor's exit is handled (CI, stop 59: a 60 s clock jump). A new actor
        of its name then crashed the dispatcher. If the old one crashed and was restarted,
        that incarnation is the job's actor and none is added (one actor per job)."""
        if self.start_job_now(job_id, factory):
            return
        supervisor, spec = self._supervisor(), _job_spec(job_id, factory)
        await supervisor.wait_ended(spec.name)
        try:
            await supervisor.start_child(spec)
        except actors.DuplicateChild:
            logging.getLogger("motor.scheduling").warning(
                "dispatcher: %s still has an actor (restarted after a crash): it goes on "
                "with the job", job_id)

    def start_job_now(self, job_id: str, factory: Callable[[], Any]) -> bool:
        """`start_job` at once when the supervisor is idle and no actor of the job's is
        there (True); False: nothing done."""
        try:
            return self._supervisor().start_child_soon(_job_spec(job_id, factory)) is not None
        except actors.DuplicateChild:  # `start_job` waits for that actor's end
            return False

    def call_job_now(self, job_id: str, msg: Any):
        """`call_job` answered at once (the job's actor answers its messages in the
        sender's task while its life waits), None when it has no actor; actors.LATER
        when it cannot answer now."""
        ref = self.job(job_id)
        if ref is None or not ref.alive:
            return None
        return ref.try_now(msg)


def _job_spec(job_id: str, factory: Callable[[], Any]) -> actors.ChildSpec:
    return actors.ChildSpec(name=f"job-{job_id}", factory=factory, restart="transient")


class Records:
    """Read-only view of job records for actors that read what the store wrote (the
    dispatcher's recovery, job actors, accounting): not the `Database`, which only the
    store actor writes through. SQLite in WAL mode gives each read a consistent snapshot."""

    __slots__ = ("_db",)

    def __init__(self, db: Any):
        self._db = db

    def get(self, job_id: str) -> JobRecord | None:
        return self._db.get(job_id)

    def live(self) -> list[JobRecord]:
        """Records not yet terminal (queued, setting up, running)."""
        return self._db.live()

    def log_offset(self, job_id: str) -> int:
        return self._db.log_offset(job_id)

    def keyed(self, request: Any) -> JobRecord | None:
        """The retained job accepted with the idempotency key of `request` (a JobRequest, or
        anything an embedder passed: admission refuses that), if it has one."""
        key = getattr(request, "idempotency_key", None)
        return self._db.keyed(key) if isinstance(key, str) else None

    def iter_terminal(self, *args, **kwargs):
        return self._db.iter_terminal(*args, **kwargs)
