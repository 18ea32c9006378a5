"""The disk actor: free-space probe, admission, eviction, catalog, size cache, bundles.

It owns them all and only carries messages (`messages.py`, re-exported here). The rules are in
`core.py`, the bookkeeping in `book.py`, `live.py` and `names.py`, the file-system side in
`host.py` (`Trees`), reached through the injected offloader (motor/offload.py). docs/disk.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable

import trio

import actors
from actors import LATER

from . import host
from ..clock import WallClock
from ..offload import Offload, thread_offload
from .bundles import BundleError, BundleStore
from .catalog import Catalog
from .core import (RECENT_MS, CleanupRun, DiskSample, EvictWorkspace, bundle_gone,
                   maintenance_due, with_problems)
from .host import Trees, probe_path
from .live import Holds, Live, LiveIndex
from .messages import (
    Admit, AdmitUpload, BeginUpload, CommitUpload, GuardDue, HasBundle, JobIdle,
    Listing, MakeRoom, Periodic, PrepareSetup, Register, Reserve, Sample, SetupPlan, Unreserve,
    Walked,
)
from .names import Names
from .room import Room
from .walking import Walks

class DiskActor(actors.Actor):
    #: a bad bundle name or a digest mismatch is the caller's answer, not a crash
    replied_errors = (BundleError,)

    def __init__(self, state_dir: Path, floor_bytes: int, goal_bytes: int,
                 probe: Callable[[Path], DiskSample] = probe_path, *,
                 workspace_roots: Iterable[Path] = (), caller_roots: dict[str, str] | None = None,
                 cap_bytes: int = 64 * 1024**3, clock: Any = None, compile_cache: str | None = None,
                 live_jobs: Callable[[], Iterable[Any]] | None = None,
                 job_recorded: Callable[[str], bool] | None = None,
                 live_index: LiveIndex | None = None, offload: Offload = thread_offload,
                 ended_dirs: Any = None, floors_for: Any = None,
                 reserve: Any = None):  # room.py says what
        super().__init__(name="disk")
        self.state_dir, self.probe, self.clock = Path(state_dir), probe, clock or WallClock()
        self.floor_bytes, self.goal_bytes = floor_bytes, max(goal_bytes, floor_bytes)
        self.cap_bytes, self.compile_cache = cap_bytes, compile_cache
        #: memoized resolution with a live index; without one, every check resolves again
        self.names = Names(self.state_dir, workspace_roots, caller_roots,
                           memo=live_index is not None)
        self.holds = Holds(live_index, live_jobs, job_recorded)
        self.offload, self.ended_dirs = offload, ended_dirs
        self.floors_for, self.reserve = floors_for, reserve
        self.catalog = self.bundles = self.trees = None  # Catalog, BundleStore, Trees: on_start
        self.room: Room | None = None
        self.walks: Walks | None = None  # walks off the actor's turn (walking.py)

    async def on_start(self):
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.catalog = self.names.catalog = Catalog(self.state_dir)
        self.trees = Trees(self.catalog, self.names, self.offload, self.clock)
        self.walks = Walks(self.trees, self.nursery.start_soon, self.cast_self, self._pass, self._live)
        self.room = Room(self)
        self.bundles = BundleStore(self.state_dir)
        # a runner's leftovers, killed mid-unpack: off the start (a workspace root that stopped
        # answering held it, and the runner's), never an unpack in progress (bundles.py)
        self.nursery.start_soon(self.offload, host.sweep_staging, self.names.allowed_roots)
        self.nursery.start_soon(self.room.watch, MakeRoom())  # a job that fills the disk

    async def on_stop(self):
        if self.catalog is not None:
            self.catalog.close()

    #: A job's admission, setup and end, at once when neither file system needs a cleanup
    #: (else LATER: `handle` cleans up first), and the lookups that never wait.
    immediate = (Admit, PrepareSetup, JobIdle, HasBundle, Reserve, Unreserve)
    readers = (Sample,)  # health's free space: not behind a cleanup or a walk

    def read(self, msg):  # Sample: a statvfs of the state dir, and what cannot be saved
        return with_problems(self.probe(self.state_dir), self.bundles and self.bundles.save_error,
                             self.catalog and self.catalog.save_error,
                             self.walks and self.walks.stalled(trio.current_time()))

    def handle_now(self, msg):
        if isinstance(msg, Admit):
            refusal = self.room.check_now(msg.workspace)
            if refusal is not LATER:
                self.holds.admit(msg.job_id, self.names.touched(msg.workspace, msg.siblings),
                                 trio.current_time())
                if refusal is not None:
                    self.holds.release(msg.job_id)
            return refusal
        if isinstance(msg, PrepareSetup):
            refusal = self.room.check_now(msg.workspace)
            return refusal if refusal is LATER else self._plan(msg, refusal)
        if isinstance(msg, JobIdle):
            if self.answering:  # the caller waits for the guard's walk
                return LATER
            self._job_ended(msg)
            self.walks.ended(msg.workspace)
            return []
        if isinstance(msg, HasBundle):  # a presence check is a use: retention restarts
            return self.bundles.use(msg.sha256, self.clock.now_ms()) is not None
        if isinstance(msg, Reserve):
            return self.holds.reserve(msg.token, self.names.touched(None, msg.names))
        if isinstance(msg, Unreserve):
            return self.holds.unreserve(msg.token)
        raise TypeError(f"disk: unknown message {msg!r}")

    async def handle(self, msg):
        if isinstance(msg, Admit):
            return await self._admit(msg)
        if isinstance(msg, PrepareSetup):
            return self._plan(msg, await self.room.check(
                self.names.touched(msg.workspace, msg.siblings), msg.workspace))
        if isinstance(msg, JobIdle):  # a caller waits for the guard (handle_now's LATER)
            self._job_ended(msg)
            return await self.walks.now(self._live, self.cap_bytes, [msg.workspace])
        if isinstance(msg, (AdmitUpload, MakeRoom)):  # room on the state dir's; on each
            return await (self.room.check(frozenset(), None) if isinstance(msg, AdmitUpload)
                          else self.room.make_room())
        if isinstance(msg, BeginUpload):
            return self.bundles.begin(msg.sha256)
        if isinstance(msg, CommitUpload):  # an error is returned for the caller to raise
            return msg.upload.commit_reply(self.clock.now_ms())
        if isinstance(msg, GuardDue):  # walks off this actor's turn (walking.py)
            return self.walks.due(self._live)
        if isinstance(msg, Periodic):  # answered after its walk (`_pass`)
            return self.walks.maintenance(self.defer_reply())
        if isinstance(msg, Listing):
            return self.walks.listing(self.defer_reply(), self._listing)
        if isinstance(msg, Walked):
            return await self.walks.walked(msg, self._live, self.cap_bytes, self._listing)
        if isinstance(msg, Register):
            return self.trees.register(msg)
        raise TypeError(f"disk: unknown message {msg!r}")

    def _live(self) -> Live:
        return self.holds.view(trio.current_time(), self.names)

    async def _admit(self, msg: Admit):
        incoming = self.names.touched(msg.workspace, msg.siblings)
        self.holds.admit(msg.job_id, incoming, trio.current_time())  # until recorded
        refusal = await self.room.check(incoming, msg.workspace)
        if refusal is not None:
            self.holds.release(msg.job_id)
        return refusal

    def _plan(self, msg: PrepareSetup, refusal) -> SetupPlan:
        """The setup plan once the room check answered `refusal`."""
        if refusal is not None:
            return SetupPlan(refusal=refusal)
        path, root = self.trees.prepare(msg.workspace, msg.kind)
        bundle = msg.bundle_sha256 and self.bundles.use(msg.bundle_sha256, self.clock.now_ms())
        if msg.bundle_sha256 and bundle is None:
            return SetupPlan(refusal=bundle_gone(msg.bundle_sha256))
        return SetupPlan(refusal=None, path=path, root=root, bundle=bundle and str(bundle))

    def _job_ended(self, msg: JobIdle) -> None:
        """A job ended (JobIdle): its trees are touched and marked for a walk; the guard
        runs at once when a caller waits for it (`handle`), else `GUARD_DELAY_S` later for
        every workspace a job left meanwhile (`handle_now`: one walk each, however many
        jobs ended in it)."""
        self.holds.release(msg.job_id)  # the job has ended: its protection ends with it
        self.trees.used(msg.workspace, msg.siblings, self.clock.now_ms())

    def _listing(self) -> list[dict]:
        hard = CleanupRun(self.floor_bytes, 0).below_floor(self.probe(self.state_dir))
        return self.trees.listing(self._live(), hard)

    async def _pass(self, found: tuple, trash_left: int, scans: dict) -> dict:
        """A maintenance pass, once its walk (the trash emptied, every tree surveyed) is done."""
        now, roots = self.clock.now_ms(), self.names.allowed_roots
        self.names.rescan()  # resolve names again: symlinks may have changed on disk
        live = self._live()
        summary = {"trash_left": trash_left,
                   "expired_workspaces": [], "swept": [], "bundles_expired": [], "guarded": []}
        for ws in self.trees.surveyed(live, found):
            due = maintenance_due(ws, self.trees.sizes.last_sweep.get(ws.name), now, roots)
            evict = EvictWorkspace(ws.name, ws.path, ws.allocated_bytes or 0, purge=False)
            if due == "expire" and await self.trees.execute(evict):
                summary["expired_workspaces"].append(ws.name)
            elif due == "sweep" and await self.trees.sweep(ws, now, scans.get(ws.name)):
                summary["swept"].append(ws.name)
        summary["guarded"] = await self.walks.now(self._live, self.cap_bytes, walk_later=True)
        summary["bundles_expired"] = self.bundles.expire(now, live.bundles)
        await self.room.make_room()
        return summary


# Re-exported for the runner facade.
__all__ = ["DiskActor", "Admit", "AdmitUpload", "BeginUpload", "CommitUpload", "HasBundle",
           "PrepareSetup", "SetupPlan", "JobIdle", "Register", "Reserve", "Unreserve",
           "Periodic", "Sample", "Listing", "BundleError", "probe_path", "RECENT_MS"]
