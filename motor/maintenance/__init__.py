"""The maintenance actor: periodic work that must happen without any request.

Each pass (at start-up and then every `interval_s`, at least once a minute; the start-up
pass's disk part right after the start, not in it):
- retention: deletes job records, events and job directories 24 hours after the later of
  the job's end and its UUIDv7 time (scheduling.md, "Retention");
- ended jobs' files: empties the job directory of each job whose end was saved at least
  EMPTY_AFTER_MS ago (its output is in the store; operations.md, "Retention"), not at the
  start-up pass (a start does not wait on thousands of directories);
- memory ceiling: re-reads the capacity file's declared `jobs_min_bytes` and the jobs
  group's live memory limit, and tells the dispatcher when either changed, so the next
  job is decided with the new figures (scheduling.md: "at startup and at each maintenance
  pass (at least once a minute), not on every admission");
- the disk manager's pass (`DiskHandle.periodic`): trash, idle expiry, the daily sweep, the
  build-folder guard, bundle retention, pressure. Not in the start-up pass: after a
  restart its size cache is empty and it walks every catalogued workspace, which on big
  trees (or a file system that stopped answering) held the runner's start, its socket
  not yet open (stop 61); it runs as the actor's first message after the start instead.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import trio

import actors

from ..execution.jobdir import EndedDirs
from ..offload import Offload, thread_offload
from ..memory.core import MemoryCeiling
from ..store.db import StoreFull

if TYPE_CHECKING:
    from ..handles import DiskHandle, DispatcherHandle, StoreHandle

log = logging.getLogger("motor.maintenance")

#: an ended job's directory keeps its files this long after its end was saved (a look at
#: them right after the end; the job's actor is done with them well before), unless the
#: disk manager needs the room first
EMPTY_AFTER_MS = 60_000


def remove_job_dirs(jobs_dir: Path, ids: list[str]) -> None:
    """The expired jobs' directories, in a worker thread: emptied a minute after each end,
    they hold whatever that could not remove (stop 63: before, on the event loop)."""
    for job_id in ids:
        shutil.rmtree(jobs_dir / job_id, ignore_errors=True)


@dataclass(frozen=True)
class _DiskPass:
    """The maintenance actor's own: the disk's part of the start-up pass, after the start."""


@dataclass(frozen=True)
class RunPass:
    """Reply: {"expired": n} once the pass is done (tests and `motor` use it to force a pass)."""


class Maintenance(actors.Actor):
    def __init__(self, *, store: "StoreHandle", clock: Any, jobs_dir: Path,
                 interval_s: float = 60.0,
                 read_ceiling: Callable[[], MemoryCeiling] | None = None,
                 dispatcher: "DispatcherHandle | None" = None,
                 ceiling: MemoryCeiling | None = None,
                 disk: "DiskHandle | None" = None, offload: Offload = thread_offload,
                 ended_dirs: EndedDirs | None = None):
        super().__init__(name="maintenance")
        self.ended_dirs = ended_dirs  # emptied at each pass but the start-up one
        #: runs the ceiling read (a file, and under systemd a blocking D-Bus call) off the loop
        self.offload = offload
        self.disk = disk  # its periodic work runs in each pass
        self.read_ceiling = read_ceiling
        self.dispatcher = dispatcher
        self.ceiling = ceiling
        self.store = store
        self.clock = clock
        self.jobs_dir = jobs_dir
        self.interval_s = interval_s
        self.passes = 0

    async def on_start(self):
        await self._pass(start=True)
        await self.cast_self(_DiskPass())  # the start-up pass's disk part, right after it
        self.nursery.start_soon(self._periodic)

    async def _periodic(self):
        while True:
            await trio.sleep(self.interval_s)
            await self.cast_self(RunPass())

    async def handle(self, msg):
        if isinstance(msg, RunPass):
            return await self._pass()
        if isinstance(msg, _DiskPass):
            return await self._disk_pass()
        raise TypeError(f"maintenance: unknown message {msg!r}")

    async def _pass(self, start: bool = False) -> dict:
        expired = emptied = 0
        while True:
            try:
                ids = await self.store.expire(self.clock.now_ms())
            except StoreFull as exc:  # deleting needs room in the WAL too: next pass
                log.warning("maintenance: retention pass skipped: %s", exc)
                break
            if ids:
                await self.offload(remove_job_dirs, self.jobs_dir, ids)
            expired += len(ids)
            if not ids:
                break
        if self.ended_dirs is not None and not start:
            emptied = await self.offload(self.ended_dirs.empty_ended, self.clock.now_ms(),
                                         EMPTY_AFTER_MS)
        changed = False
        if self.read_ceiling is not None:
            ceiling = await self.offload(self.read_ceiling)
            if ceiling != self.ceiling:
                log.info("maintenance: memory ceiling now %s", ceiling)
                self.ceiling = ceiling
                await self.dispatcher.ceiling_changed(ceiling)
                changed = True
        if not start:
            await self._disk_pass()
        self.passes += 1
        if expired:
            log.info("maintenance: expired %d job records", expired)
        return {"expired": expired, "ceiling_changed": changed, "emptied": emptied}

    async def _disk_pass(self) -> None:
        """The disk manager's part: trash, idle expiry, the daily sweep, the guard, bundle
        retention, pressure."""
        if self.disk is not None:
            try:
                await self.disk.periodic(timeout=600)
            except (actors.ActorDead, actors.CallTimeout) as exc:
                log.warning("maintenance: disk pass failed: %s", exc)
