"""The job execution actor's message and what it is built with (motor/execution/actor.py
handles the message and re-exports both)."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import trio

import actors
from .. import faults
from ..offload import Offload, thread_offload
from ..isolation.base import Backend
from ..lifecycle import retain_until
from ..records import Terminal, public_record
from ..store.db import StoreFull
from ..store.messages import Save
from . import jobdir

if TYPE_CHECKING:
    from ..handles import (
        AccountingHandle, CpuHandle, DiskHandle, DispatcherHandle, Records, StoreHandle,
    )
    from .core import JobRun

__all__ = ["Cancel", "JobDeps", "STORE_FULL_RETRY_S", "release_isolation", "save_when_room",
           "terminal_save"]

log = logging.getLogger("motor.execution")

_BASE_RELEASE = Backend.release
STORE_FULL_RETRY_S = 1.0  # a save refused for lack of space is retried after this


@dataclass(frozen=True)
class Cancel:
    """Reply: True when a signal was sent (or will be, once the keeper exists)."""


@dataclass(frozen=True)
class JobDeps:
    """What every job actor needs: typed handles of the other actors (motor/handles.py,
    made before the tree starts) and the shared resources. Built once, never filled in."""

    config: Any
    records: "Records"  # read-only view of job records
    store: "StoreHandle"
    dispatcher: "DispatcherHandle"
    cpu: "CpuHandle"
    accounting: "AccountingHandle"
    spawner: Any  # the execution/ports.py Keepers protocol (execution/spawner.py Spawner)
    backend: Any  # the isolation backend (motor/isolation)
    clock: Any
    jobs_dir: Path
    workspace_root: Path
    disk: "DiskHandle | None" = None  # setup admission, bundles, idle workspaces
    #: runs blocking work (execution/jobdir.py, the isolation backend) away from the event
    #: loop: a worker thread, also under the runner's test clock (a blocking setup step must
    #: not stall the event loop: tests/scheduling hold one at a barrier)
    offload: Offload = thread_offload
    #: whether the runner is stopping (its root supervisor shut down or gave up): a
    #: subsystem found stopped then is not one that restarts (execution/actor.py `main`)
    stopping: Callable[[], bool] = lambda: False
    #: the jobs a cancel was told to (scheduling/effects.py `tell_cancel`) whose actor has
    #: not ended them yet: an incarnation made after (a restart after a crash, an actor not
    #: yet started when the cancel came) starts with the cancel pending (stop 52)
    cancels: set[str] = field(default_factory=set)


async def save_when_room(store: "StoreHandle", who: str, run: "JobRun | None", record,
                         events=(), **kw) -> list:
    """`store.save`, retried every STORE_FULL_RETRY_S while the state filesystem is full
    (StoreFull): meanwhile a job's output stays in output.log (its saved offset does not
    advance) and its exit in status.json, so nothing is lost and nothing crashes. (A
    `StoreHandle` method in waiting: motor/handles.py belongs to another change.) What
    `run` deferred goes with it (`JobRun.defer`). `record` may be a whole store `Save`."""
    if isinstance(record, Save):
        record, events, kw = record.record, record.events, dict(
            kw, log_offset=record.log_offset, retain_until_ms=record.retain_until_ms)
    if run is not None:
        events, offset = run.with_unsaved(events, kw.pop("log_offset", None))
        if offset is not None:
            kw["log_offset"] = offset
    waited = False
    while True:
        try:
            return await store.save(record, events, **kw)
        except StoreFull as exc:
            if not waited:
                log.warning("%s: waiting for space to record the job: %s", who, exc)
                waited = True
            if run is not None and kw.get("log_offset") is not None:  # its own output?
                await trio.to_thread.run_sync(jobdir.relieve, run, kw["log_offset"])
            await trio.sleep(STORE_FULL_RETRY_S)


def terminal_save(run: "JobRun", record) -> Save:
    """The job's terminal save: its terminal record and event after what `run` deferred
    (its start, its last output batch), with the log offset after them. The dispatcher
    makes it with its next save when it can (`Finished.ride`), else the job actor."""
    tail = run.output.tail()  # a character the output's end cut short
    events, offset = run.with_unsaved([*tail, Terminal(record=public_record(record))])
    return Save(record=record, events=tuple(events), log_offset=offset,
                retain_until_ms=retain_until(record))


async def release_isolation(deps: JobDeps, job_id: str, who: str,
                            status: dict | None = None) -> None:
    """After the job's terminal record (its CPUs and slot already free): remove its groups
    or units (`backend.release`, offloaded), unless the backend has none or keeperd
    removes them (`status`: the job's status.json, its `isolation_released`). A runner
    that dies before this leaves them to the next start-up sweep (the job is terminal,
    not `known`). What could not be removed is logged."""
    if (status and status.get("isolation_released") is True
            or type(deps.backend).release is _BASE_RELEASE):
        return
    await faults.ahit("release.begin")  # tests: the record is out, the groups not yet removed
    light = getattr(deps.backend, "release_is_light", None)
    if light is not None and light(job_id):  # nothing to remove: no thread hop
        error = deps.backend.release(job_id)
    else:
        error = await deps.offload(deps.backend.release, job_id)
    if error:
        log.warning("%s: isolation cleanup_error: %s", who, error)


@contextmanager
def left_to_the_next_start(deps: JobDeps, who: str):
    """Around a job actor's life: a subsystem it needs found stopped (ActorDead) while the
    runner stops (the dispatcher stops before the job actors) ends the actor quietly, and
    the next start adopts the job; at any other time that subsystem is restarting, and the
    actor crashes so that its own restart adopts the job (docs/actors.md)."""
    try:
        yield
    except actors.ActorDead as exc:
        if not deps.stopping():
            raise
        log.info("%s: %s as the runner stops; its next start adopts the job", who, exc)


@asynccontextmanager
async def awaiting_exit(spawner, keeper: tuple[int, float] | None, job_dir: Path):
    """An event set once the job's keeper is done with it (`wait_exit` returned). Where the
    keeper reports the job's end unasked (keeperd: `exit_event`) it is that report's event
    and `wait_exit` is called on leaving (at once, or it looks again): no task of its own
    (issue 14, a task step less per job); otherwise a task waits in `wait_exit`."""
    done = trio.Event()
    if keeper is None:
        done.set()
        yield done
    elif (reported := spawner.exit_event(*keeper, job_dir)) is not None:
        yield reported
        await spawner.wait_exit(*keeper, job_dir)
    else:
        async def watch_exit():
            await spawner.wait_exit(*keeper, job_dir)
            done.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_exit)
            yield done
