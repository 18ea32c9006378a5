"""The disk actor's host side: everything that reads or changes the file system.

The free-space probe, device numbers, the planner's inputs read from disk (the survey of
catalogued trees with their walks, the staging / trash and compile-cache candidates), carrying
out the planner's actions (safe deletion, incremental-directory drops, the stale-unit sweep,
the build-tree repair). Blocking: the actor calls the walking and deleting ones through its
offloader (motor/offload.py). The rules stay in `core.py`, the bookkeeping in `book.py`.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
from pathlib import Path
from typing import Any

from .. import faults
from ..offload import abandonable
from . import bundles as bundles_mod
from . import cargo, sizes, trash
from .book import SizeCache, held, listing_row, workspace_of
from .core import (
    CompileCache, DiskSample, DropIncremental, DropStaleUnits, EvictCompileCache, EvictWorkspace,
    RemoveStaging, Repair, Staging, Workspace, complete, guard_action, sweep_time,
)

log = logging.getLogger("motor.disk")

#: A job's end (a `JobIdle` cast) has the build-folder guard of its workspace run this long
#: after, together with every other workspace a job left meanwhile (issue 14): one walk per
#: workspace however many jobs ended in it, and a job's start (`PrepareSetup`, answered by
#: the same actor) does not wait behind a walk per job end. A `JobIdle` call guards at once.
GUARD_DELAY_S = 0.25


def probe_path(path: Path) -> DiskSample:
    """Free and total bytes (as `shutil.disk_usage`) and inodes of `path`'s file system."""
    st = os.statvfs(path)
    return DiskSample(free_bytes=st.f_bavail * st.f_frsize, total_bytes=st.f_blocks * st.f_frsize,
                      free_inodes=st.f_favail, total_inodes=st.f_files)


def free_bytes(path) -> int | None:
    """Free bytes on `path`'s file system; None when it cannot be read."""
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def device(path: str) -> int | None:
    try:
        return os.stat(path).st_dev
    except OSError:
        return None


# --- planner input ----------------------------------------------------------------------


def staging(allowed_roots, in_setup, dev: int | None) -> list[Staging]:
    """Bundle-unpack staging and trash entries under the roots on `dev` (None: all), and what
    a deletion on a full file system left beside the trash (`trash.move_to_trash`), each a
    candidate; those of jobs setting up are active."""
    out, entries = [], []
    for root in allowed_roots:
        if dev is not None and device(root) != dev:
            continue
        for d, beside in ((os.path.join(root, bundles_mod.STAGING), None),
                          (os.path.join(root, trash.TRASH), None), (root, trash.TRASH + "-")):
            try:
                with os.scandir(d) as found:
                    entries += [e for e in found if beside is None or e.name.startswith(beside)]
            except OSError:
                continue
    for e in entries:
        active = e.name.split(".")[0] in in_setup
        try:
            st = e.stat(follow_symlinks=False)
        except OSError:
            continue
        measured = sizes.measure(e.path)
        out.append(Staging(path=e.path, allocated_bytes=measured.allocated_bytes,
                           last_used_ms=int(st.st_mtime * 1000), active=active))
    return out


def compile_cache(path: str | None, filling: bool, dev: int | None) -> CompileCache | None:
    """The compile cache as one candidate (measured on each pass, like staging)."""
    if not path:
        return None
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    if dev is not None and st.st_dev != dev:
        return None
    try:
        if not os.listdir(path):
            return None  # empty: nothing to reclaim
    except OSError:
        return None
    return CompileCache(path=path, allocated_bytes=sizes.measure(path).allocated_bytes,
                        last_used_ms=int(st.st_mtime * 1000), filling=filling)


def measure(path: str, now_ms: int, found: cargo.Stale | None = None
            ) -> tuple[sizes.Sizes, int]:
    """A workspace's sizes and its stale Cargo bytes (0 when the unit scan fails): one walk
    and one unit scan (`found`: one made already), together in one offloaded call."""
    result = sizes.measure(path, now_ms=now_ms)
    try:
        stale = (found or cargo.stale(path, now_ms)).bytes
    except OSError:
        stale = 0
    return result, stale


@abandonable
def measure_all(items, now_ms: int, scans=None) -> dict[str, tuple[sizes.Sizes, int]]:
    """`measure` for each (name, path), in order (`scans`: unit scans made already, by name)."""
    faults.hit("disk.walk")  # tests: a walk held (the disk actor busy, waiting for it)
    return {name: measure(path, now_ms, (scans or {}).get(name)) for name, path in items}


@abandonable
def survey(entries, dev: int | None, wanted: set[str], now_ms: int, scans=None):
    """For the planner: of the catalog `entries`, the names on device `dev` (None: all)
    whose tree still exists, the names whose tree is gone (to forget), and the sizes of the
    `wanted` ones among those present (walked now: never measured, or used since; `scans`:
    `stale_scans` made already). Returns (present, gone, measured)."""
    present, gone, walk = [], [], []
    for entry in entries:
        if dev is not None and device(entry.root) != dev:
            continue
        if not os.path.lexists(entry.path):
            gone.append(entry.name)
            continue
        present.append(entry.name)
        if entry.name in wanted:
            walk.append((entry.name, entry.path))
    return present, gone, measure_all(walk, now_ms, scans)


@abandonable
def stale_scans(items, now_ms: int) -> dict[str, cargo.Stale]:
    """The daily sweep's unit scan of each (name, path) whose tree exists: what it would
    remove (a maintenance pass's walk makes them off the disk actor's turn)."""
    found = {}
    for name, path in items:
        faults.hit("disk.sweep")  # tests: a scan held (a big target/, a slow file system)
        if os.path.lexists(path):
            try:
                found[name] = cargo.stale(path, now_ms)
            except OSError:
                continue
    return found


@abandonable
def sweep_staging(roots) -> None:
    """At start: remove staging leftovers of a runner killed mid-unpack under every root
    (never an unpack in progress: bundles.sweep_staging)."""
    faults.hit("disk.staging")  # tests: a sweep held (a file system that stopped answering)
    for root in roots:
        removed, left = bundles_mod.sweep_staging(root)
        if removed or left:
            log.info("disk: swept %d staging leftovers under %s (%d stay)", removed, root, left)


@abandonable
def collect_trash(roots) -> int:
    """Empty each root's trash; the number of entries that stay (see trash.collect_trash)."""
    return sum(trash.collect_trash(root) for root in roots)


# --- deleting and repairing -------------------------------------------------------------


def safe(fn, *args):
    try:
        return fn(*args)
    except (OSError, trash.UnsafeDelete) as exc:
        log.warning("disk: %s%s failed: %s", fn.__name__, args, exc)
        return None


def drop_incremental(path: str, root: str, purge: bool = True) -> int:
    n = 0
    for inc in sizes.incremental_dirs(path):
        if safe(trash.remove, inc, root, purge) is not None:
            n += 1
    return n


def repair(path: str) -> int:
    """Claim a workspace for the runner: make every directory readable and searchable by
    us (never through symlinks, never across mounts). Only used before deleting from it."""
    fixed = 0
    try:
        top = os.lstat(path)
    except OSError:
        return 0
    if not stat.S_ISDIR(top.st_mode):
        return 0
    mounts = sizes.mount_points()
    uid = os.geteuid()
    stack = [path]
    while stack:
        d = stack.pop()
        try:
            st = os.lstat(d)
            if st.st_uid != uid and uid == 0:
                os.lchown(d, uid, -1)
            if st.st_mode & 0o700 != 0o700:
                os.chmod(d, stat.S_IMODE(st.st_mode) | 0o700)
                fixed += 1
            with os.scandir(d) as it:
                for e in it:
                    if e.is_dir(follow_symlinks=False):
                        est = e.stat(follow_symlinks=False)
                        if est.st_dev == top.st_dev and e.path not in mounts:
                            stack.append(e.path)
        except OSError:
            continue
    return fixed


def carry_out(action, root: str, now_ms: int) -> bool:
    """Carry out one planner action on disk; False when a deletion failed (the tree is still
    there: its catalog entry stays for a retry). `root`: the workspace's allowed root."""
    if isinstance(action, EvictWorkspace):
        safe(trash.remove, action.path, root, action.purge)
        return not os.path.lexists(action.path)  # not moved out: keep the entry
    if isinstance(action, DropIncremental):
        drop_incremental(action.path, root, action.purge)
    elif isinstance(action, DropStaleUnits):
        cargo.sweep(action.path, root, now_ms)
    elif isinstance(action, RemoveStaging):
        safe(trash.purge, action.path)
        return not os.path.lexists(action.path)
    elif isinstance(action, EvictCompileCache):  # the whole cache, then an empty one
        safe(trash.delete_tree, action.path, os.path.dirname(action.path))
        os.makedirs(action.path, exist_ok=True)
    elif isinstance(action, Repair):
        repair(action.path)
    return True


@abandonable
def candidates(entries, dev: int | None, wanted: set[str], now_ms: int, allowed_roots,
               in_setup, cache_dir: str | None, filling: bool):
    """Everything one cleanup round ranks on device `dev`, read in one offloaded call:
    `survey`'s (present, gone, measured), then the staging entries and the compile cache."""
    return (*survey(entries, dev, wanted, now_ms), staging(allowed_roots, in_setup, dev),
            compile_cache(cache_dir, filling, dev))


# --- the catalogued trees, as the disk actor sees them -----------------------------------


class Trees:
    """The disk actor's file-system side: the catalog, the size cache (book.SizeCache) and
    the work on the trees (surveys and walks for the planner and the listing, carrying out
    actions), every blocking call through the injected offloader. Used by the disk actor
    only, one message at a time; `live` arguments are its live.Live view."""

    def __init__(self, catalog, names, offload, clock):
        self.catalog, self.names, self.offload, self.clock = catalog, names, offload, clock
        self.sizes = SizeCache()
        #: the walk in flight off the actor's turn (walking.py): each walked name's sizes
        #: when it began (`keep_walk` keeps the walk only where nothing stored newer ones)
        self.walk_before: dict[str, Any] = {}

    def register(self, msg) -> Any:
        """Catalog a tree (a `Register` message: caller-root trees, snapshots)."""
        entry = self.catalog.record(msg.name, *self.names.registered(msg.path), kind=msg.kind,
                                    now_ms=self.clock.now_ms(), caller_path=msg.caller_path)
        if msg.referenced_by:
            self.catalog.set_references(msg.name, list(msg.referenced_by))
        return entry

    def prepare(self, workspace: str, kind: str) -> tuple[str, str]:
        """Catalog a job's workspace before its setup: (canonical path, allowed root)."""
        path, root = self.names.workspace_path(workspace)
        self.catalog.record(workspace, path, root, kind=kind, now_ms=self.clock.now_ms(),
                            caller_path=workspace if workspace.startswith("/") else None)
        return path, root

    def used(self, workspace: str, siblings, now_ms: int) -> None:
        """A job left its workspace and siblings: touch each catalogued one (one journal line)
        and mark it for a walk; the workspace waits for the build-folder guard."""
        for name in (workspace, *siblings):
            if self.catalog.get(name) is not None:
                self.catalog.touch(name, now_ms)
                self.sizes.used(name)
        self.sizes.guard_pending.add(workspace)

    async def guard(self, live_view, cap_bytes: int, names=None) -> list[str]:
        """The build-folder cap for idle workspaces (`names`; None: every pending one),
        deferred while a job is queued for or runs in them; the names whose incremental
        directories were dropped. `live_view()`: what live jobs hold, now. Here in one
        piece; the disk actor runs the walk between `guard_survey` and `guard_finish` off
        its own turn (walking.py)."""
        looked, wanted = self.guard_survey(live_view, names)
        if not looked:
            return []
        if wanted:
            await faults.ahit("disk.guard")  # tests: the guard's walk held (in this turn)
        found = await self.offload(survey, looked, None, wanted, self.clock.now_ms())
        return await self.guard_finish(live_view, cap_bytes, looked, found)

    def guard_survey(self, live_view, names=None) -> tuple[list, set[str]]:
        """The guard's first half: the catalogued pending workspaces it looks at now (none
        a live job holds: those stay pending) and which of them to walk. Those are taken
        out of `dirty` now: a job that ends in one during the walk marks it again, and its
        walk is then not kept (`guard_finish`)."""
        pending = self.sizes.guard_pending
        todo = sorted(pending if names is None else pending.intersection(names))
        live = live_view() if todo else None
        looked = []
        for name in todo:
            entry = self.catalog.get(name)
            if entry is not None and held(live, entry, "running", "reserved"):
                continue  # deferred, unmeasured: stays pending
            pending.discard(name)
            if entry is not None:
                looked.append(entry)
        return looked, self.begin_walk(looked)

    def begin_walk(self, looked: list) -> set[str]:
        """A walk off the actor's turn begins: which of the entries `looked` to walk (never
        measured, or used since). Those are taken out of `dirty` now: a job that ends in
        one during the walk marks it again, and its walk is then not kept (`keep_walk`)."""
        wanted = self.sizes.wanted(e.name for e in looked)
        self.sizes.dirty.difference_update(wanted)
        self.walk_before = {name: self.sizes.sizes.get(name) for name in wanted}
        return wanted

    def keep_walk(self, live, found) -> None:
        """A walk off the actor's turn is done, `found` its survey (present, gone,
        measured): forget the trees found gone that no live job holds now (one admitted
        meanwhile makes its tree again); store each walk, unless a job used that workspace
        during the walk (walked again later) or a walk in the actor's turn stored newer
        sizes meanwhile (a cleanup's)."""
        _, gone, measured = found
        for name in gone:
            entry = self.catalog.get(name)
            if entry is None:
                continue
            if held(live, entry, "running", "reserved"):
                log.warning("disk: the tree of workspace %s was gone (removed outside motor?); "
                            "a job was admitted to it meanwhile: it stays catalogued", name)
            else:
                log.warning("disk: the tree of workspace %s is gone (removed outside motor?): "
                            "forgotten", name)
                self.forget(name)
        before, self.walk_before = self.walk_before, {}
        for name, (result, stale) in measured.items():
            if name not in self.sizes.dirty and self.sizes.sizes.get(name) is before.get(name):
                self.sizes.store(name, result, stale)

    def surveyed(self, live, found) -> list[Workspace]:
        """`keep_walk`, then the planner's view of the trees present (those measured)."""
        self.keep_walk(live, found)
        entries = self.entries(found[0])
        return [workspace_of(e, self.sizes, live, self.names.allowed_roots)
                for e in entries if e.name in self.sizes.sizes]

    async def guard_finish(self, live_view, cap_bytes: int, looked: list, found) -> list[str]:
        """The guard's second half, with the `survey` of `looked` (present, gone, measured):
        each workspace's action, decided on what live jobs hold now. One a job used or
        was admitted to during the walk is left for a later guard (it is pending again)."""
        dropped, live = [], live_view()
        self.keep_walk(live, found)
        present = found[0]
        for entry in looked:
            name = entry.name
            if name not in present or name in self.sizes.dirty or name not in self.sizes.sizes \
                    or self.catalog.get(name) is None:
                continue
            if held(live, entry, "running", "reserved"):  # admitted during the walk
                self.sizes.guard_pending.add(name)
                continue
            ws = workspace_of(self.catalog.get(name), self.sizes, live, self.names.allowed_roots)
            action = guard_action(ws, cap_bytes)
            if isinstance(action, Repair):  # repaired, measured again, then decided
                await self.execute(action)
                ws = (await self.workspaces(live_view(), [name]))[0]
                action = guard_action(complete(ws), cap_bytes)
            if isinstance(action, DropIncremental):
                await self.execute(action)
                dropped.append(name)
        return dropped

    async def walk(self, items: list[tuple[str, str]]) -> None:
        """Walk each (name, path) and store its sizes."""
        measured = await self.offload(measure_all, items, self.clock.now_ms())
        for name, (result, stale) in measured.items():
            self.sizes.store(name, result, stale)

    def forget(self, name: str) -> None:
        self.catalog.forget(name)
        self.sizes.forget(name)

    def _kept(self, live, present, gone, measured) -> list[Workspace]:
        """Apply a survey: forget gone trees, store the walks; the planner's view."""
        for name in gone:
            self.forget(name)
        for name, (result, stale) in measured.items():
            self.sizes.store(name, result, stale)
        return [workspace_of(self.catalog.get(n), self.sizes, live, self.names.allowed_roots)
                for n in present]

    def entries(self, names=None) -> list:
        """The catalog entries of `names` (None: all), those still catalogued."""
        keys = self.catalog.entries if names is None else names
        return [e for e in map(self.catalog.get, keys) if e is not None]

    async def workspaces(self, live, names=None) -> list[Workspace]:
        """The planner's view of the named catalogued trees (None: all); gone ones are
        forgotten, unmeasured or used ones walked first."""
        entries = self.entries(names)
        wanted = self.sizes.wanted(e.name for e in entries)
        return self._kept(live, *await self.offload(survey, entries, None, wanted,
                                                    self.clock.now_ms()))

    async def candidates(self, live, dev: int | None, cache_dir: str | None):
        """What one cleanup round ranks on `dev`: (workspaces, staging, compile cache)."""
        entries = self.entries()
        *found, staged, cache = await self.offload(
            candidates, entries, dev, self.sizes.wanted(e.name for e in entries),
            self.clock.now_ms(), self.names.allowed_roots, live.in_setup, cache_dir,
            live.filling)
        return self._kept(live, *found), staged, cache

    async def execute(self, action) -> bool:
        """Carry out one action and update the catalog and cache; False when a deletion
        failed (the tree is still there: its entry stays for a retry)."""
        log.info("disk: %s", action)
        entry = self.catalog.get(getattr(action, "workspace", ""))
        ok = await self.offload(carry_out, action, entry.root if entry else "",
                                self.clock.now_ms())
        if isinstance(action, EvictWorkspace) and ok:
            self.forget(action.workspace)
        elif isinstance(action, EvictWorkspace):
            log.warning("disk: evicting %s failed; its catalog entry stays for a retry",
                        action.workspace)
        elif isinstance(action, DropIncremental) and not action.purge:
            self.sizes.used(action.workspace)  # walked when next wanted, off this turn if it can
        elif isinstance(action, (DropIncremental, DropStaleUnits, Repair)):
            await self.walk([(action.workspace, action.path)])
            if isinstance(action, DropStaleUnits):
                self.sizes.stale[action.workspace] = 0
        return ok

    def sweep_candidates(self, live, looked: list, now_ms: int) -> list[tuple[str, str]]:
        """(name, path) of the entries `looked` whose daily sweep is due by its time and
        that no live job holds: a maintenance pass's walk scans them (`stale_scans`)."""
        last = self.sizes.last_sweep
        return [(e.name, e.path) for e in looked
                if not held(live, e, "running", "reserved")
                and sweep_time(last.get(e.name), now_ms)]

    async def sweep(self, ws: Workspace, now_ms: int, found: cargo.Stale | None) -> bool:
        """The daily stale-unit sweep of one idle workspace, with what this pass's walk
        found stale off the actor's turn (`found`); True when it removed something. What it
        removes goes into the trash (deleted by the next pass's walk). Not now when the walk
        did not scan it or a job used it since the walk began (the next pass sweeps it); an
        incomplete estimate (unreadable parts) is repaired and scanned again here first."""
        if found is None or ws.name in self.sizes.dirty:
            return False
        self.sizes.last_sweep[ws.name] = now_ms
        if not ws.complete:
            await self.execute(Repair(ws.name, ws.path, "sweep"))
            found = (await self.offload(stale_scans, [(ws.name, ws.path)], now_ms)).get(ws.name)
            if found is None:
                return False
        result = await self.offload(cargo.remove, found, ws.root, False)
        swept = bool(result["units"] or result["incremental"])
        if swept:  # walked when next wanted, off this turn if it can
            self.sizes.used(ws.name)
        self.sizes.stale[ws.name] = 0
        return swept

    def listing(self, live, hard: bool) -> list[dict]:
        """The rows of `motor workspaces`, from the sizes known (walking.py walks those used
        since their last walk first, unless a walk is in flight)."""
        self.sizes.dirty.intersection_update(self.catalog.entries)
        now = self.clock.now_ms()
        return [listing_row(e, self.sizes.sizes.get(e.name), live, now, hard,
                            self.names.allowed_roots)
                for e in sorted(self.catalog.entries.values(), key=lambda e: e.name)]
