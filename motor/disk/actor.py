"""The disk actor: free-space probe, admission, eviction, catalog, size cache, bundles.

It owns the workspace catalog, the in-memory size cache, the bundle store and the probe.
Which workspaces are running or reserved is read from the job records (`live_jobs`: jobs
queued or awaiting bundles reserve their workspace and siblings; jobs setting up or running
use them), plus in-flight admissions: from `Admit` until the job is recorded (or a minute
later, if it never is), the incoming workspace and its siblings are protected. Once the job
is recorded its record decides; a job that has ended (even before any disk check saw it
live) protects nothing.

Cleanup (`_cleanup`): plan with the pure core, carry out the first action, probe free space
again for real, re-plan; until the plan is empty. A cleanup that starts below the hard floor
stays hard until the soft goal is met. A deletion that fails keeps its catalog entry and is
skipped for the rest of that cleanup; the next cleanup or maintenance pass retries it. Heavy work (walks, deletions, unpacking
checks) runs in worker threads; messages still go one at a time.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path
from collections import Counter
from typing import Any, Callable, Iterable

import trio

import actors

from . import bundles as bundles_mod
from . import cargo, sizes, trash
from .bundles import BundleError, BundleStore
from ..offload import Offload, thread_offload
from .catalog import Catalog
from .live import LiveIndex
from .core import (
    CompileCache, DiskSample, DropIncremental, DropStaleUnits, EvictCompileCache, EvictWorkspace,
    RECENT_MS, RemoveStaging,
    Repair, Staging, Workspace, PlanInput, admission, guard_action, idle_expired, plan_cleanup,
    protection, sweep_due,
)

log = logging.getLogger("motor.disk")

INFLIGHT_S = 60.0  # an admission protects its workspaces until recorded, at most this long
MAX_STEPS = 10_000


def probe_path(path: Path) -> DiskSample:
    usage = shutil.disk_usage(path)
    return DiskSample(free_bytes=usage.free, total_bytes=usage.total)


# --- messages --------------------------------------------------------------------------


@dataclass(frozen=True)
class Admit:
    """Reply: a Refusal, or None when there is room (after cleanup)."""

    job_id: str | None = None
    workspace: str | None = None
    siblings: tuple[str, ...] = ()


@dataclass(frozen=True)
class AdmitUpload:
    """Before an upload's body is read. Reply: a Refusal, or None."""

    sha256: str


@dataclass(frozen=True)
class BeginUpload:
    """Reply: a bundles.Upload to write chunks into (raises BundleError on a bad name)."""

    sha256: str


@dataclass(frozen=True)
class CommitUpload:
    """Reply: the bundle size; or the BundleError (digest mismatch, nothing kept) or OSError
    to raise: returned, not raised, so a bad upload does not restart the disk actor."""

    upload: Any


@dataclass(frozen=True)
class HasBundle:
    """Reply: True when the verified bundle is stored (its retention clock restarts)."""

    sha256: str


@dataclass(frozen=True)
class PrepareSetup:
    """Before a job's setup: floor check again, catalog its workspace.
    Reply: SetupPlan."""

    job_id: str
    workspace: str
    siblings: tuple[str, ...] = ()
    kind: str = "task"
    bundle_sha256: str | None = None


@dataclass(frozen=True)
class SetupPlan:
    refusal: Any  # Refusal | None
    path: str = ""
    root: str = ""
    bundle: str | None = None


@dataclass(frozen=True)
class JobIdle:
    """A job left its workspace: touch it, measure it, apply the build-folder cap."""

    job_id: str
    workspace: str
    siblings: tuple[str, ...] = ()


@dataclass(frozen=True)
class Register:
    """Catalog a workspace (caller-root trees and snapshots). Reply: the entry."""

    name: str
    path: str
    kind: str = "task"
    caller_path: str | None = None
    referenced_by: tuple[str, ...] = ()


@dataclass(frozen=True)
class Reserve:
    """Protect workspaces (by name or path) under `token` until `Unreserve(token)`."""

    token: str
    names: tuple[str, ...]


@dataclass(frozen=True)
class Unreserve:
    token: str


@dataclass(frozen=True)
class Periodic:
    """Maintenance: trash, idle expiry, daily sweep, guard, bundle retention, cleanup.
    Reply: a summary dict."""


@dataclass(frozen=True)
class Sample:
    """Reply: the current DiskSample of the state filesystem."""


@dataclass(frozen=True)
class Listing:
    """Reply: the catalog as rows for `motor workspaces`."""


class _Held:
    """Membership in held names or their canonical paths (containers kept by the index and
    the actor, not copied), plus extra keys (admissions in flight, reservations)."""

    __slots__ = ("names", "paths", "extra")

    def __init__(self, names=frozenset(), paths=frozenset(), extra: frozenset = frozenset()):
        self.names, self.paths, self.extra = names, paths, extra

    def __contains__(self, key: str) -> bool:
        return key in self.names or key in self.paths or key in self.extra

    def __or__(self, keys) -> "_Held":
        return _Held(self.names, self.paths, self.extra | frozenset(keys))

    def __iter__(self):
        return iter({*self.names, *self.paths, *self.extra})


@dataclass
class _Live:
    running: _Held = field(default_factory=_Held)
    reserved: _Held = field(default_factory=_Held)
    bundles: set[str] = field(default_factory=set)
    setting_up: set[str] = field(default_factory=set)  # job ids
    filling: bool = False  # a cache_fill job is setting up or running


class DiskActor(actors.Actor):
    #: a bad bundle name or a digest mismatch is the caller's answer, not a crash
    replied_errors = (BundleError,)

    def __init__(self, state_dir: Path, floor_bytes: int, goal_bytes: int,
                 probe: Callable[[Path], DiskSample] = probe_path, *,
                 workspace_roots: Iterable[Path] = (), caller_roots: dict[str, str] | None = None,
                 cap_bytes: int = 64 * 1024**3, clock: Any = None,
                 live_jobs: Callable[[], Iterable[Any]] | None = None,
                 compile_cache: str | None = None,
                 job_recorded: Callable[[str], bool] | None = None,
                 live_index: LiveIndex | None = None, offload: Offload = thread_offload):
        super().__init__(name="disk")
        self.state_dir = Path(state_dir)
        self.floor_bytes = floor_bytes
        self.goal_bytes = max(goal_bytes, floor_bytes)
        self.probe = probe
        roots = [Path(r) for r in workspace_roots] or [self.state_dir / "workspaces"]
        self.workspace_roots = [os.path.realpath(r) for r in roots]
        self.caller_roots = {c.rstrip("/"): os.path.realpath(h)
                             for c, h in (caller_roots or {}).items()}
        self.allowed_roots = tuple(dict.fromkeys(
            [*self.workspace_roots, *self.caller_roots.values()]))
        self.cap_bytes = cap_bytes
        self.clock = clock
        #: Blocking file-system work (walks, deletions, unpacking checks) goes through it:
        #: a worker thread by default; the runner passes its clock's (motor/clock.py).
        self.offload = offload
        self.live_jobs = live_jobs or (lambda: ())
        #: Maintained from committed records (the runner's); without it, `live_jobs()` is
        #: read and indexed on every check (the reference way, kept for embedded use).
        self.live_index = live_index
        self._canon_memo: dict[str, str] = {}
        self._canon_key: tuple = ()
        # Canonical paths of the names the index holds, kept from its changes:
        # {which: {name: path}} and {which: Counter(path)}; recomputed when `_paths_key`
        # (catalog generation, canon epoch) changes.
        self._path_of: dict[str, dict[str, str]] = {"running": {}, "reserved": {}}
        self._path_count: dict[str, Counter] = {"running": Counter(), "reserved": Counter()}
        self._paths_key: tuple = ()
        #: Whether a job id has a record at all (live or ended): ends its in-flight protection.
        self.job_recorded = job_recorded or (lambda job_id: False)
        self.compile_cache = compile_cache
        self.catalog: Catalog | None = None
        self.bundles: BundleStore | None = None
        self.cache: dict[str, sizes.Sizes] = {}  # in memory only: a restart starts empty
        self.stale: dict[str, int] = {}
        #: Workspaces used since their last walk (a job ended in them): walked when next
        #: needed (the guard, a cleanup or maintenance pass, a listing), once however many
        #: jobs ended in between.
        self.dirty: set[str] = set()
        self.last_sweep: dict[str, int] = {}
        self.guard_pending: set[str] = set()
        self.inflight: dict[str, tuple[frozenset[str], float]] = {}
        self.reservations: dict[str, frozenset[str]] = {}

    # -- life -------------------------------------------------------------------------

    async def on_start(self):
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.catalog = Catalog(self.state_dir)
        self.bundles = BundleStore(self.state_dir)
        for root in self.allowed_roots:  # leftovers of a runner killed mid-unpack
            removed, left = await self.offload(bundles_mod.sweep_staging, root)
            if removed or left:
                log.info("disk: swept %d staging leftovers under %s (%d stay)", removed, root, left)

    async def on_stop(self):
        if self.catalog is not None:
            self.catalog.close()

    def now_ms(self) -> int:
        if self.clock is not None:
            return self.clock.now_ms()
        import time
        return time.time_ns() // 1_000_000

    async def handle(self, msg):
        if isinstance(msg, Admit):
            return await self._admit(msg)
        if isinstance(msg, AdmitUpload):
            return await self._admit_upload()
        if isinstance(msg, BeginUpload):
            return self.bundles.begin(msg.sha256)
        if isinstance(msg, CommitUpload):
            try:
                return msg.upload.commit(self.now_ms())
            except (BundleError, OSError) as exc:  # the client's fault or a full disk:
                return exc  # the caller raises it; the actor (and its state) carries on
        if isinstance(msg, HasBundle):
            if self.bundles.has(msg.sha256):
                self.bundles.touch(msg.sha256, self.now_ms())
                return True
            return False
        if isinstance(msg, PrepareSetup):
            return await self._prepare(msg)
        if isinstance(msg, JobIdle):
            return await self._idle(msg)
        if isinstance(msg, Register):
            return self._register(msg)
        if isinstance(msg, Reserve):
            self.reservations[msg.token] = frozenset(
                self._canon(n) for n in msg.names) | frozenset(msg.names)
            return None
        if isinstance(msg, Unreserve):
            self.reservations.pop(msg.token, None)
            return None
        if isinstance(msg, Periodic):
            return await self._periodic()
        if isinstance(msg, Sample):
            return self.probe(self.state_dir)
        if isinstance(msg, Listing):
            return await self._listing()
        raise TypeError(f"disk: unknown message {msg!r}")

    # -- names and paths ----------------------------------------------------------------

    def workspace_path(self, name: str) -> tuple[str, str]:
        """(canonical host path, allowed root) of a workspace name or caller path."""
        entry = self.catalog.get(name) if self.catalog else None
        if entry is not None:
            return entry.path, entry.root
        host = self.host_path(name)
        if host is not None:
            return host
        root = self.workspace_roots[0]
        return os.path.realpath(os.path.join(root, name)), root

    def host_path(self, caller_path: str) -> tuple[str, str] | None:
        """A caller's path mapped through --caller-root to (host path, host root)."""
        if not caller_path.startswith("/"):
            return None
        for caller, host in self.caller_roots.items():
            if caller_path == caller or caller_path.startswith(caller + "/"):
                rest = caller_path[len(caller):].lstrip("/")
                return os.path.realpath(os.path.join(host, rest)), host
        return None

    def _canon(self, name: str) -> str:
        """A name's canonical host path, memoized until the catalog's names or paths change
        (or the next maintenance pass, which also picks up symlinks changed on disk)."""
        if self.live_index is None:  # the reference way: resolve on every check
            return self.workspace_path(name)[0]
        key = (self.catalog.generation if self.catalog else -1, self._canon_epoch)
        if key != self._canon_key:
            self._canon_memo.clear()
            self._canon_key = key
        path = self._canon_memo.get(name)
        if path is None:
            path = self._canon_memo[name] = self.workspace_path(name)[0]
        return path

    _canon_epoch = 0

    def _touched(self, workspace: str | None, siblings: Iterable[str]) -> frozenset[str]:
        names = [n for n in (workspace, *siblings) if n]
        return frozenset(names) | frozenset(self._canon(n) for n in names)

    def _live(self) -> _Live:
        now = trio.current_time()
        for job_id, (touched, until) in list(self.inflight.items()):
            if until < now:
                del self.inflight[job_id]
        if self.live_index is not None:
            index = self.live_index
            index.ensure_loaded()
            self._follow(index)
            running = _Held(index.running, self._path_count["running"])
            reserved = _Held(index.reserved, self._path_count["reserved"])
        else:
            index = LiveIndex.from_records(self.live_jobs())
            running = _Held(index.running, self._keys(index.running))
            reserved = _Held(index.reserved, self._keys(index.reserved))
        live = _Live(running=running, reserved=reserved,  # `|=` below makes a new view
                     bundles=set(index.bundles), setting_up=set(index.setting_up),
                     filling=index.filling > 0)
        for job_id in [j for j in self.inflight if j in index or self.job_recorded(j)]:
            del self.inflight[job_id]
        for touched, _ in self.inflight.values():
            live.reserved |= touched
        for touched in self.reservations.values():
            live.reserved |= touched
        return live

    # -- planner input ----------------------------------------------------------------

    def _keys(self, names: Iterable[str]) -> frozenset[str]:
        """The canonical paths of names (a workspace is matched by name or path)."""
        return frozenset(self._canon(n) for n in names)

    def _follow(self, index: LiveIndex) -> None:
        """Bring the held paths up to date with the index: the names that became held or
        free since the last check (work per change, not per live job); all of them again
        after the catalog renamed something, at maintenance, or after a flood of changes."""
        key = (self.catalog.generation if self.catalog else -1, self._canon_epoch)
        changes = index.take_changes()
        if changes is None or key != self._paths_key:
            self._paths_key = key
            for which, names in (("running", index.running), ("reserved", index.reserved)):
                self._path_of[which] = {n: self._canon(n) for n in names}
                self._path_count[which] = Counter(self._path_of[which].values())
            return
        for which, name, held in changes:
            path_of, count = self._path_of[which], self._path_count[which]
            if held:
                path = path_of[name] = self._canon(name)
                count[path] += 1
            else:
                path = path_of.pop(name, None)
                if path is None:
                    continue
                left = count[path] - 1
                if left <= 0:
                    del count[path]
                else:
                    count[path] = left

    def _dev(self, path: str) -> int | None:
        try:
            return os.stat(path).st_dev
        except OSError:
            return None

    async def _measure(self, name: str, path: str) -> sizes.Sizes:
        now = self.now_ms()
        result = await self.offload(lambda: sizes.measure(path, now_ms=now))
        self.cache[name] = result
        self.dirty.discard(name)
        try:
            self.stale[name] = await self.offload(lambda: cargo.stale_bytes(path, now))
        except OSError:
            self.stale[name] = 0
        return result

    async def _workspaces(self, live: _Live, dev: int | None,
                          names: Iterable[str] | None = None) -> list[Workspace]:
        if names is None:
            entries = list(self.catalog.entries.values())
        else:
            entries = [e for e in map(self.catalog.get, names) if e is not None]
        out = []
        for entry in entries:
            if dev is not None and self._dev(entry.root) != dev:
                continue
            if not os.path.lexists(entry.path):
                self.catalog.forget(entry.name)
                self.cache.pop(entry.name, None)
                self.dirty.discard(entry.name)
                continue
            cached = self.cache.get(entry.name)
            if cached is None or entry.name in self.dirty:  # lazily, for ranking
                cached = await self._measure(entry.name, entry.path)
            keys = (entry.name, entry.path)
            out.append(Workspace(
                name=entry.name, path=entry.path,
                root=sizes_root(entry.path, self.allowed_roots),
                kind=entry.kind, allocated_bytes=cached.allocated_bytes,
                target_bytes=cached.target_bytes, incremental_bytes=cached.incremental_bytes,
                stale_bytes=self.stale.get(entry.name, 0), complete=cached.complete,
                last_used_ms=entry.last_used_ms, running=any(k in live.running for k in keys),
                reserved=any(k in live.reserved for k in keys),
                referenced_by=tuple(entry.referenced_by)))
        return out

    def _staging(self, live: _Live, dev: int | None) -> list[Staging]:
        out = []
        dirs = []
        for root in self.allowed_roots:
            if dev is not None and self._dev(root) != dev:
                continue
            dirs.append(os.path.join(root, bundles_mod.STAGING))
            dirs.append(os.path.join(root, trash.TRASH))
        for d in dirs:
            try:
                entries = list(os.scandir(d))
            except OSError:
                continue
            for e in entries:
                active = e.name.split(".")[0] in live.setting_up
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                measured = sizes.measure(e.path)
                out.append(Staging(path=e.path, allocated_bytes=measured.allocated_bytes,
                                   last_used_ms=int(st.st_mtime * 1000), active=active))
        return out

    def _compile_cache(self, live: _Live, dev: int | None) -> CompileCache | None:
        """The compile cache as one candidate (measured on each pass, like staging)."""
        path = self.compile_cache
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
                            last_used_ms=int(st.st_mtime * 1000), filling=live.filling)

    # -- cleanup ------------------------------------------------------------------------

    async def _cleanup(self, where: str, incoming: frozenset[str]) -> DiskSample:
        dev = self._dev(where)
        repaired: set[str] = set()
        failed: set[str] = set()  # deletions that failed: retried by the next cleanup
        hard = False  # once below the floor, recent workspaces stay eligible until the goal
        sample = self.probe(Path(where))
        for _ in range(MAX_STEPS):
            sample = self.probe(Path(where))
            if sample.free_bytes >= self.goal_bytes:
                return sample
            hard = hard or sample.free_bytes < self.floor_bytes
            live = self._live()
            wss = await self._workspaces(live, dev)
            wss = [w if w.name not in repaired else _complete(w) for w in wss]
            staging = await self.offload(lambda: self._staging(live, dev))
            cache = await self.offload(lambda: self._compile_cache(live, dev))
            actions = plan_cleanup(PlanInput(
                workspaces=tuple(wss), staging=tuple(staging), compile_cache=cache,
                free_bytes=sample.free_bytes,
                floor_bytes=self.floor_bytes, goal_bytes=self.goal_bytes, now_ms=self.now_ms(),
                allowed_roots=self.allowed_roots, incoming=incoming, hard=hard,
                skip=frozenset(failed)))
            if not actions:
                return sample
            action = actions[0]
            if isinstance(action, Repair):
                repaired.add(action.workspace)
            if not await self._execute(action):
                failed.add(getattr(action, "workspace", None) or action.path)
        return self.probe(Path(where))

    async def _execute(self, action) -> bool:
        """Carry out one action; False when a deletion failed (the tree is still there)."""
        log.info("disk: %s", action)
        entry = self.catalog.get(getattr(action, "workspace", "")) if hasattr(action, "workspace") else None
        root = entry.root if entry is not None else ""
        if isinstance(action, EvictWorkspace):
            await self.offload(lambda: _safe(trash.delete_tree, action.path, root))
            if os.path.lexists(action.path):  # not moved out: keep the entry, retry later
                log.warning("disk: evicting %s failed; its catalog entry stays for a retry",
                            action.workspace)
                return False
            self.catalog.forget(action.workspace)
            self.cache.pop(action.workspace, None)
            self.dirty.discard(action.workspace)
            self.stale.pop(action.workspace, None)
        elif isinstance(action, DropIncremental):
            await self.offload(lambda: drop_incremental(action.path, root))
            await self._measure(action.workspace, action.path)
        elif isinstance(action, DropStaleUnits):
            now = self.now_ms()
            await self.offload(lambda: cargo.sweep(action.path, root, now))
            await self._measure(action.workspace, action.path)
            self.stale[action.workspace] = 0
        elif isinstance(action, RemoveStaging):
            await self.offload(lambda: _safe(trash.purge, action.path))
            if os.path.lexists(action.path):
                return False
        elif isinstance(action, EvictCompileCache):  # the whole cache, then an empty one
            await self.offload(lambda: _safe(trash.delete_tree, action.path, os.path.dirname(action.path)))
            os.makedirs(action.path, exist_ok=True)
        elif isinstance(action, Repair):
            await self.offload(lambda: repair(action.path))
            await self._measure(action.workspace, action.path)
        return True

    # -- admission ----------------------------------------------------------------------

    async def _admit(self, msg: Admit):
        incoming = self._touched(msg.workspace, msg.siblings)
        if msg.job_id is not None:
            self.inflight[msg.job_id] = (incoming, trio.current_time() + INFLIGHT_S)
        sample = await self._cleanup(str(self.state_dir), incoming)
        refusal = admission(sample, self.floor_bytes)
        if refusal is None and msg.workspace:
            path, root = self.workspace_path(msg.workspace)
            if self._dev(root) not in (None, self._dev(str(self.state_dir))):
                refusal = admission(await self._cleanup(root, incoming), self.floor_bytes)
        if refusal is not None and msg.job_id is not None:
            self.inflight.pop(msg.job_id, None)
        return refusal

    async def _admit_upload(self):
        sample = await self._cleanup(str(self.state_dir), frozenset())
        return admission(sample, self.floor_bytes)

    async def _prepare(self, msg: PrepareSetup) -> SetupPlan:
        incoming = self._touched(msg.workspace, msg.siblings)
        sample = await self._cleanup(str(self.state_dir), incoming)
        refusal = admission(sample, self.floor_bytes)
        path, root = self.workspace_path(msg.workspace)
        if refusal is None and self._dev(root) not in (None, self._dev(str(self.state_dir))):
            refusal = admission(await self._cleanup(root, incoming), self.floor_bytes)
        if refusal is not None:
            return SetupPlan(refusal=refusal)
        now = self.now_ms()
        caller = msg.workspace if msg.workspace.startswith("/") else None
        self.catalog.record(msg.workspace, path, root, kind=msg.kind, now_ms=now,
                            caller_path=caller)
        bundle = None
        if msg.bundle_sha256:
            if not self.bundles.has(msg.bundle_sha256):
                from ..records import Refusal
                return SetupPlan(refusal=Refusal(
                    code="workspace_setup_failed",
                    detail=f"bundle {msg.bundle_sha256} is no longer stored on the runner"))
            self.bundles.touch(msg.bundle_sha256, now)
            bundle = str(self.bundles.path(msg.bundle_sha256))
        return SetupPlan(refusal=None, path=path, root=root, bundle=bundle)

    # -- idle, guard, maintenance -------------------------------------------------------

    async def _idle(self, msg: JobIdle):
        """Touch the workspace and siblings (one journal line each) and mark them for a walk;
        the guard walks the workspace now unless another job holds it (then the walk waits
        for the guard's retry, a cleanup, maintenance or a listing: one walk however many
        jobs end there meanwhile)."""
        now = self.now_ms()
        self.inflight.pop(msg.job_id, None)  # the job has ended: its protection ends with it
        for name in (msg.workspace, *msg.siblings):
            if self.catalog.get(name) is None:
                continue
            self.catalog.touch(name, now)
            self.dirty.add(name)
        self.guard_pending.add(msg.workspace)
        return await self._guard([msg.workspace])

    async def _guard(self, names: Iterable[str] | None = None) -> list[str]:
        """Build-folder cap for idle workspaces; deferred while a job is queued for them.
        `names`: only those (a job end); None: every pending one (maintenance)."""
        pending = self.guard_pending if names is None else self.guard_pending.intersection(names)
        if not pending:
            return []
        live = self._live()
        dropped = []
        for name in sorted(pending):
            entry = self.catalog.get(name)
            if entry is None:
                self.guard_pending.discard(name)
                continue
            keys = (name, entry.path)
            if any(k in live.running or k in live.reserved for k in keys):
                continue  # deferred, unmeasured: stays pending
            ws = (await self._workspaces_named(live, [name]) or [None])[0]
            if ws is None:
                self.guard_pending.discard(name)
                continue
            action = guard_action(ws, self.cap_bytes)
            if ws.running or ws.reserved:
                continue  # deferred: stays pending
            self.guard_pending.discard(name)
            if isinstance(action, Repair):
                await self._execute(action)
                ws = (await self._workspaces_named(self._live(), [name]))[0]
                action = guard_action(_complete(ws), self.cap_bytes)
            if isinstance(action, DropIncremental):
                await self._execute(action)
                dropped.append(name)
        return dropped

    async def _workspaces_named(self, live: _Live, names: list[str]) -> list[Workspace]:
        return await self._workspaces(live, None, names)

    async def _periodic(self) -> dict:
        now = self.now_ms()
        self._canon_epoch += 1  # resolve names again: symlinks may have changed on disk
        live = self._live()
        summary = {"trash_left": 0, "expired_workspaces": [], "swept": [], "bundles_expired": [],
                   "guarded": []}
        for root in self.allowed_roots:
            summary["trash_left"] += await self.offload(lambda: trash.collect_trash(root))
        for ws in await self._workspaces(live, None):
            if protection(ws, _input_for(self, ws), hard=True) is not None:
                continue
            if idle_expired(ws, now):
                if await self._execute(EvictWorkspace(ws.name, ws.path, ws.allocated_bytes or 0)):
                    summary["expired_workspaces"].append(ws.name)
                continue
            if sweep_due(ws, self.last_sweep.get(ws.name), now):
                self.last_sweep[ws.name] = now
                if not ws.complete:  # claim and repair, measure again, then decide
                    await self._execute(Repair(ws.name, ws.path, "sweep"))
                result = await self.offload(lambda: cargo.sweep(ws.path, ws.root, now))
                if result["units"] or result["incremental"]:
                    summary["swept"].append(ws.name)
                    await self._measure(ws.name, ws.path)
                self.stale[ws.name] = 0
        summary["guarded"] = await self._guard()
        summary["bundles_expired"] = self.bundles.expire(now, live.bundles)
        for root in {str(self.state_dir), *self.allowed_roots}:
            await self._cleanup(root, frozenset())
        return summary

    def _register(self, msg: Register):
        path = os.path.realpath(msg.path)
        root = sizes_root(path, self.allowed_roots)
        if not root:
            raise ValueError(f"{msg.path} is not under an allowed workspace root")
        entry = self.catalog.record(msg.name, path, root, kind=msg.kind, now_ms=self.now_ms(),
                                    caller_path=msg.caller_path)
        if msg.referenced_by:
            self.catalog.set_references(msg.name, list(msg.referenced_by))
        return entry

    async def _listing(self) -> list[dict]:
        for name in sorted(self.dirty):  # sizes as of the last job end, as before
            entry = self.catalog.get(name)
            if entry is None:
                self.dirty.discard(name)
            else:
                await self._measure(name, entry.path)
        now = self.now_ms()
        live = self._live()
        rows = []
        hard = self.probe(self.state_dir).free_bytes < self.floor_bytes
        for entry in sorted(self.catalog.entries.values(), key=lambda e: e.name):
            cached = self.cache.get(entry.name)
            keys = (entry.name, entry.path)
            ws = Workspace(name=entry.name, path=entry.path, root=entry.root, kind=entry.kind,
                           last_used_ms=entry.last_used_ms,
                           running=any(k in live.running for k in keys),
                           reserved=any(k in live.reserved for k in keys))
            why = protection(ws, PlanInput(workspaces=(), free_bytes=0, floor_bytes=0,
                                           goal_bytes=0, now_ms=now,
                                           allowed_roots=self.allowed_roots), hard=hard)
            rows.append({
                "name": entry.name, "kind": entry.kind, "root": entry.root, "path": entry.path,
                "caller_path": entry.caller_path,
                "allocated_bytes": cached.allocated_bytes if cached else None,
                "target_bytes": cached.target_bytes if cached else None,
                "incremental_bytes": cached.incremental_bytes if cached else None,
                "complete": cached.complete if cached else None,
                "measured_ms": cached.measured_ms if cached else None,  # wall time
                "measured_age_ms": max(0, now - cached.measured_ms) if cached else None,
                "idle_ms": max(0, now - entry.last_used_ms),
                "protected": why,
            })
        return rows


def _input_for(actor: DiskActor, ws: Workspace) -> PlanInput:
    return PlanInput(workspaces=(), free_bytes=0, floor_bytes=0, goal_bytes=0,
                     now_ms=actor.now_ms(), allowed_roots=actor.allowed_roots)


def _complete(ws: Workspace) -> Workspace:
    from dataclasses import replace
    return replace(ws, complete=True)


def _safe(fn, *args):
    try:
        return fn(*args)
    except (OSError, trash.UnsafeDelete) as exc:
        log.warning("disk: %s%s failed: %s", fn.__name__, args, exc)
        return None


def sizes_root(path: str, roots) -> str:
    from .core import under_root
    return under_root(path, roots)


def drop_incremental(path: str, root: str) -> int:
    n = 0
    for inc in sizes.incremental_dirs(path):
        if _safe(trash.delete_tree, inc, root) is not None:
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


# Re-exported for the runner facade.
__all__ = ["DiskActor", "Admit", "AdmitUpload", "BeginUpload", "CommitUpload", "HasBundle",
           "PrepareSetup", "SetupPlan", "JobIdle", "Register", "Reserve", "Unreserve",
           "Periodic", "Sample", "Listing", "BundleError", "probe_path", "RECENT_MS"]
