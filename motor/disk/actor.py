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
skipped for the rest of that cleanup; the next cleanup or maintenance pass retries it. Heavy
work (walks, deletions, unpacking checks) goes through the injected offloader (motor/offload.py:
worker threads in production); messages still go one at a time.

This file holds the message handling only: the messages are in `messages.py` (re-exported
here), the file-system helpers, planner inputs and listing rows in `host.py`, the view of
what live jobs hold in `live.py`, the rules in `core.py`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Callable, Iterable

import trio

import actors

from . import bundles as bundles_mod
from . import cargo, sizes, trash
from . import host as hostio
from ..offload import Offload, thread_offload
from .bundles import BundleError, BundleStore
from .catalog import Catalog
from .core import (
    DiskSample, DropIncremental, DropStaleUnits, EvictCompileCache, EvictWorkspace, RECENT_MS,
    RemoveStaging, Repair, Workspace, PlanInput, admission, guard_action, idle_expired,
    plan_cleanup, protection, sweep_due,
)
from .host import device, drop_incremental, probe_path, repair, safe, sizes_root
from .live import HeldPaths, Live, LiveIndex, live_view
from .messages import (
    Admit, AdmitUpload, BeginUpload, CommitUpload, HasBundle, JobIdle, Listing, Periodic,
    PrepareSetup, Register, Reserve, Sample, SetupPlan, Unreserve,
)

log = logging.getLogger("motor.disk")

INFLIGHT_S = 60.0  # an admission protects its workspaces until recorded, at most this long
MAX_STEPS = 10_000


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
        #: canonical paths of the names the index holds, kept from its changes
        self.held_paths = HeldPaths()
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

    def _live(self) -> Live:
        now = trio.current_time()
        for job_id, (touched, until) in list(self.inflight.items()):
            if until < now:
                del self.inflight[job_id]
        if self.live_index is not None:
            index = self.live_index
            index.ensure_loaded()
            key = (self.catalog.generation if self.catalog else -1, self._canon_epoch)
            self.held_paths.follow(index, key, self._canon)
            running, reserved = self.held_paths.count["running"], self.held_paths.count["reserved"]
        else:
            index = LiveIndex.from_records(self.live_jobs())
            running, reserved = self._keys(index.running), self._keys(index.reserved)
        for job_id in [j for j in self.inflight if j in index or self.job_recorded(j)]:
            del self.inflight[job_id]
        return live_view(index, running, reserved,
                         [*(t for t, _ in self.inflight.values()), *self.reservations.values()])

    # -- planner input ----------------------------------------------------------------

    def _keys(self, names: Iterable[str]) -> frozenset[str]:
        """The canonical paths of names (a workspace is matched by name or path)."""
        return frozenset(self._canon(n) for n in names)

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

    async def _workspaces(self, live: Live, dev: int | None,
                          names: Iterable[str] | None = None) -> list[Workspace]:
        if names is None:
            entries = list(self.catalog.entries.values())
        else:
            entries = [e for e in map(self.catalog.get, names) if e is not None]
        out = []
        for entry in entries:
            if dev is not None and device(entry.root) != dev:
                continue
            if not os.path.lexists(entry.path):
                self.catalog.forget(entry.name)
                self.cache.pop(entry.name, None)
                self.dirty.discard(entry.name)
                continue
            cached = self.cache.get(entry.name)
            if cached is None or entry.name in self.dirty:  # lazily, for ranking
                cached = await self._measure(entry.name, entry.path)
            out.append(hostio.workspace(entry, cached, self.stale.get(entry.name, 0), live,
                                      self.allowed_roots))
        return out

    # -- cleanup ------------------------------------------------------------------------

    async def _cleanup(self, where: str, incoming: frozenset[str]) -> DiskSample:
        dev = device(where)
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
            wss = [w if w.name not in repaired else hostio.complete(w) for w in wss]
            staging = await self.offload(hostio.staging, self.allowed_roots, live.setting_up, dev)
            cache = await self.offload(hostio.compile_cache, self.compile_cache, live.filling, dev)
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
            await self.offload(lambda: safe(trash.delete_tree, action.path, root))
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
            await self.offload(lambda: safe(trash.purge, action.path))
            if os.path.lexists(action.path):
                return False
        elif isinstance(action, EvictCompileCache):  # the whole cache, then an empty one
            await self.offload(lambda: safe(trash.delete_tree, action.path, os.path.dirname(action.path)))
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
            if device(root) not in (None, device(str(self.state_dir))):
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
        if refusal is None and device(root) not in (None, device(str(self.state_dir))):
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
                action = guard_action(hostio.complete(ws), self.cap_bytes)
            if isinstance(action, DropIncremental):
                await self._execute(action)
                dropped.append(name)
        return dropped

    async def _workspaces_named(self, live: Live, names: list[str]) -> list[Workspace]:
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
            if protection(ws, hostio.plan_input_for(self.now_ms(), self.allowed_roots),
                          hard=True) is not None:
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
            rows.append(hostio.listing_row(entry, self.cache.get(entry.name), live, now, hard,
                                         self.allowed_roots))
        return rows


# Re-exported for the runner facade.
__all__ = ["DiskActor", "Admit", "AdmitUpload", "BeginUpload", "CommitUpload", "HasBundle",
           "PrepareSetup", "SetupPlan", "JobIdle", "Register", "Reserve", "Unreserve",
           "Periodic", "Sample", "Listing", "BundleError", "probe_path", "RECENT_MS"]
