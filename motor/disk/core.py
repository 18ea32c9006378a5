"""Pure disk rules: admission and the eviction planner.

Nothing here does I/O or reads a clock: the actor (`disk/actor.py`) passes plain data in
(catalogued workspaces with their cached sizes, staging entries, the free-space probe's
answer, the floor and goal, `now_ms`) and carries out the actions that come back, probing
free space for real between actions and asking again (scheduling.md, "Disk admission").

The planner, `plan_cleanup`, runs the seed's three passes in order, each stopping as soon as
the *simulated* free space (probe + bytes of the actions chosen so far) reaches the goal:

1. stale Cargo units (`DropStaleUnits`), largest stale total first;
2. incremental state (`DropIncremental`), largest cached incremental size first;
3. whole workspaces and staging (`EvictWorkspace`, `RemoveStaging`), by allocated bytes x
   idle milliseconds, descending; unreferenced sibling snapshots come first.

Eligibility (`protection`): a workspace is never touched while running or reserved (a job
is queued or awaiting bundles for it), when it is the incoming job's workspace or one of its
siblings (compared by canonical host path, so an alias cannot slip through), when it is not
catalogued or not under an allowed root. Workspaces used in the last 30 minutes are
protected while free space is at or above the hard floor; below it they become eligible, and
go after the older candidates, least recently used first. A cleanup that started below the
floor stays "hard" until the soft goal is reached (`PlanInput.hard`): crossing the floor
part-way does not make the remaining recent workspaces protected again.

Incomplete estimates (an unreadable subtree hid part of the size): the incremental pass and
the whole-workspace pass return `Repair(ws)` instead of guessing. The actor then claims and
repairs that workspace, measures it again and re-plans; the whole-workspace pass tries every
eligible complete estimate first, then repairs incomplete ones one at a time, oldest first,
and never repairs another once the goal is met.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Union

from ..records import Refusal

RECENT_MS = 30 * 60 * 1000  # "used in the last 30 minutes"
STALE_UNIT_MS = 48 * 3600 * 1000  # stale Cargo unit: every output's atime older than 48 h
SWEEP_EVERY_MS = 24 * 3600 * 1000  # daily stale-unit sweep, once per workspace per day
TASK_IDLE_MS = 24 * 3600 * 1000  # task workspaces are deleted after 24 h idle
BUNDLE_RETENTION_MS = 24 * 3600 * 1000  # bundles pinned 24 h after their last use
MAX_STEPS = 10_000  # actions in one cleanup, at most


#: The inode floor and goal of a file system that counts its inodes (issue 14's probes: a
#: state file system out of inodes with bytes to spare left every accepted job queued for
#: ever, its start failing ENOSPC): fractions of its inodes, at least INODE_FLOOR_MIN, at
#: most a quarter of them; the goal twice the floor. Applied where the byte floor is on.
INODE_FLOOR_FRACTION = 0.01
INODE_FLOOR_MIN = 64


@dataclass(frozen=True)
class DiskSample:
    free_bytes: int
    total_bytes: int
    #: what the disk manager cannot do now (health lists each under "disk")
    problems: tuple[str, ...] = ()
    #: inodes free to unprivileged users, and in all; 0 in all: the file system does not
    #: count them (btrfs, many FUSE file systems), and no inode floor applies
    free_inodes: int = 0
    total_inodes: int = 0


def inode_floors(sample: DiskSample, floor_bytes: int) -> tuple[int, int]:
    """The free-inode floor (jobs are refused below it) and goal (a cleanup goes on until it
    is met, with `goal_bytes`) of the sample's file system; (0, 0), no inode floor, where it
    counts no inodes or the byte floor is off."""
    total = sample.total_inodes
    if floor_bytes <= 0 or total <= 0:
        return 0, 0
    floor = min(max(int(total * INODE_FLOOR_FRACTION), INODE_FLOOR_MIN), total // 4)
    return floor, 2 * floor


def with_problems(sample: DiskSample, *problems: str | None) -> DiskSample:
    """`sample` with the problems that are there (None: none) added."""
    found = tuple(p for p in problems if p)
    return replace(sample, problems=sample.problems + found) if found else sample


STATE_FS = "the runner's state filesystem"


def admission(sample: DiskSample, floor_bytes: int, where: str = STATE_FS) -> Refusal | None:
    """`runner_disk_full` with free_bytes and floor_bytes (and free_inodes and floor_inodes)
    when below the floor of bytes or of inodes on `where` (named in the detail), else None.
    No floor when floor_bytes <= 0."""
    if floor_bytes <= 0:
        return None
    floor_inodes = inode_floors(sample, floor_bytes)[0]
    if sample.free_bytes < floor_bytes:
        detail = (f"free space {sample.free_bytes} bytes is below the floor of {floor_bytes} "
                  f"bytes on {where}")
    elif sample.free_inodes < floor_inodes:
        detail = (f"free inodes {sample.free_inodes} are below the floor of {floor_inodes} "
                  f"inodes on {where} (it has {sample.free_bytes} bytes free, but no file can "
                  "be created without an inode)")
    else:
        return None
    inodes = {"free_inodes": sample.free_inodes, "floor_inodes": floor_inodes} \
        if sample.total_inodes else {}
    return Refusal(code="runner_disk_full", detail=detail, free_bytes=sample.free_bytes,
                   floor_bytes=floor_bytes, **inodes)


def bundle_gone(sha256: str) -> Refusal:
    """A job's bundle went missing between its admission and its setup."""
    return Refusal(code="workspace_setup_failed",
                   detail=f"bundle {sha256} is no longer stored on the runner")


# --- planner inputs ----------------------------------------------------------------------


@dataclass(frozen=True)
class Workspace:
    """A catalogued workspace as the planner sees it (sizes from the in-memory cache)."""

    name: str  # catalog key (the caller's path for a caller-root workspace)
    path: str  # canonical host path of the tree
    root: str = ""  # the allowed root it lives under ("" = none)
    kind: str = "task"  # "task" | "head" | "snapshot" (a sibling snapshot)
    allocated_bytes: int | None = None  # None: never measured
    target_bytes: int | None = None
    incremental_bytes: int | None = None
    stale_bytes: int = 0  # bytes in stale Cargo units (from the last unit scan)
    complete: bool = True  # False: an unreadable subtree hid part of the size
    last_used_ms: int = 0
    running: bool = False
    reserved: bool = False
    catalogued: bool = True
    referenced_by: tuple[str, ...] = ()  # for snapshots: workspaces that still use it


@dataclass(frozen=True)
class Staging:
    """A staging entry (unpack leftovers, stale partial uploads, trash garbage)."""

    path: str
    allocated_bytes: int
    last_used_ms: int
    active: bool = False  # an upload or unpack in progress: never touched


@dataclass(frozen=True)
class CompileCache:
    """The shared compile cache (`--compile-cache DIR`): evicted only as a whole, never
    entry by entry, and never while a cache fill runs (scheduling.md)."""

    path: str
    allocated_bytes: int
    last_used_ms: int
    filling: bool = False


@dataclass(frozen=True)
class PlanInput:
    workspaces: tuple[Workspace, ...]
    free_bytes: int
    floor_bytes: int
    goal_bytes: int
    now_ms: int
    staging: tuple[Staging, ...] = ()
    compile_cache: CompileCache | None = None
    allowed_roots: tuple[str, ...] = ()
    incoming: frozenset[str] = frozenset()  # canonical paths (and names) of the incoming job's
    # workspace and its siblings
    #: Hard pressure: None decides from `free_bytes < floor_bytes`. The actor passes True for
    #: every round of a cleanup that started below the floor, so that recent idle workspaces
    #: stay eligible until the soft goal is reached (not only until the floor).
    hard: bool | None = None
    #: Workspaces (names) and staging paths the planner must skip this round, e.g. a failed
    #: deletion the actor retries in a later cleanup rather than again and again in this one.
    skip: frozenset[str] = frozenset()
    #: Inodes: while fewer than `goal_inodes` are free the plan goes on past the byte goal.
    #: What an action frees in inodes is not estimated: the actor carries out the first
    #: action and probes again for real (`CleanupRun`), so the plan is only its order.
    free_inodes: int = 0
    goal_inodes: int = 0


# --- actions -----------------------------------------------------------------------------


@dataclass(frozen=True)
class DropStaleUnits:
    workspace: str
    path: str
    bytes: int
    pass_name: str = "stale"


@dataclass(frozen=True)
class DropIncremental:
    workspace: str
    path: str
    bytes: int
    pass_name: str = "incremental"
    #: False: only moved into the trash, as EvictWorkspace's; the build-folder guard's,
    #: which frees nothing urgent (a cleanup's frees room now)
    purge: bool = True


@dataclass(frozen=True)
class EvictWorkspace:
    workspace: str
    path: str
    bytes: int
    pass_name: str = "whole"
    #: False: only moved into the trash, whose next collection (off the disk actor's turn)
    #: deletes it; a maintenance pass's expiry, which frees nothing urgent (host.carry_out)
    purge: bool = True


@dataclass(frozen=True)
class RemoveStaging:
    path: str
    bytes: int
    pass_name: str = "whole"


@dataclass(frozen=True)
class EvictCompileCache:
    path: str
    bytes: int
    pass_name: str = "whole"


@dataclass(frozen=True)
class Repair:
    """Claim and repair this workspace's permissions, measure it again, then re-plan."""

    workspace: str
    path: str
    pass_name: str
    bytes: int = 0


Action = Union[DropStaleUnits, DropIncremental, EvictWorkspace, RemoveStaging, EvictCompileCache,
               Repair]


# --- eligibility -------------------------------------------------------------------------


def under_root(path: str, roots) -> str:
    """The allowed root `path` lies strictly under ("" when none). Paths are canonical."""
    for root in roots:
        r = root.rstrip("/") or "/"
        if path != r and path.startswith(r if r.endswith("/") else r + "/"):
            return root
    return ""


def protection(ws: Workspace, inp: PlanInput, *, hard: bool) -> str | None:
    """Why `ws` may not be touched now (None: eligible)."""
    if not ws.catalogued:
        return "not catalogued"
    if not under_root(ws.path, inp.allowed_roots):
        return "outside the allowed roots"
    if ws.running:
        return "running"
    if ws.reserved:
        return "reserved"
    if ws.path in inp.incoming or ws.name in inp.incoming:
        return "incoming job"
    if not hard and inp.now_ms - ws.last_used_ms < RECENT_MS:
        return "used in the last 30 minutes"
    return None


def _idle_ms(last_used_ms: int, now_ms: int) -> int:
    return max(0, now_ms - last_used_ms)


# --- the planner -------------------------------------------------------------------------


@dataclass
class _Sim:
    free: int
    goal: int
    inodes_met: bool = True  # no action's inodes are estimated: met or not, as probed
    actions: list = field(default_factory=list)

    @property
    def met(self) -> bool:
        return self.free >= self.goal and self.inodes_met

    def take(self, action) -> None:
        self.actions.append(action)
        self.free += max(0, action.bytes)


def plan_cleanup(inp: PlanInput) -> list[Action]:
    """The actions to run in order. A `Repair` is always last: re-plan after it."""
    sim = _Sim(free=inp.free_bytes, goal=inp.goal_bytes,
               inodes_met=inp.free_inodes >= inp.goal_inodes)
    if sim.met:
        return []
    hard = inp.free_bytes < inp.floor_bytes if inp.hard is None else inp.hard
    eligible = [ws for ws in inp.workspaces
                if ws.name not in inp.skip and protection(ws, inp, hard=hard) is None]
    recent = {ws.name for ws in eligible if inp.now_ms - ws.last_used_ms < RECENT_MS}

    # 1. stale Cargo units, largest first (recent workspaces only below the floor, last).
    for ws in sorted(eligible, key=lambda w: (w.name in recent, -w.stale_bytes, w.name)):
        if sim.met:
            return sim.actions
        if ws.stale_bytes > 0:
            sim.take(DropStaleUnits(ws.name, ws.path, ws.stale_bytes))
    if sim.met:
        return sim.actions
    # 2. incremental state, largest cached incremental size first; incomplete estimates are
    #    repaired and measured before anything is decided for them.
    for ws in sorted(eligible, key=lambda w: (w.name in recent, not w.complete,
                                              -(w.incremental_bytes or 0), w.name)):
        if sim.met:
            return sim.actions
        if not ws.complete:
            sim.actions.append(Repair(ws.name, ws.path, "incremental"))
            return sim.actions
        if ws.incremental_bytes:
            sim.take(DropIncremental(ws.name, ws.path, ws.incremental_bytes))
    if sim.met:
        return sim.actions
    # 3. whole workspaces and staging: unreferenced snapshots first, then bytes x idle desc;
    #    recent workspaces (eligible only below the floor) after them in LRU order;
    #    incomplete estimates last, repaired one at a time, oldest first.
    live = {w.name for w in inp.workspaces}

    def score(alloc, last):
        return (alloc or 0) * _idle_ms(last, inp.now_ms)

    ranked: list[tuple[tuple, object]] = []
    for ws in eligible:
        if not ws.complete:
            continue
        snapshot_free = ws.kind == "snapshot" and not (set(ws.referenced_by) & live)
        if ws.name in recent:
            key = (2, ws.last_used_ms, ws.name)
        else:
            key = (0 if snapshot_free else 1, -score(ws.allocated_bytes, ws.last_used_ms), ws.name)
        ranked.append((key, ws))
    for st in inp.staging:
        if st.active or st.path in inp.skip:
            continue
        ranked.append(((1, -score(st.allocated_bytes, st.last_used_ms), st.path), st))
    cache = inp.compile_cache
    if cache is not None and not cache.filling and cache.allocated_bytes > 0:
        ranked.append(((1, -score(cache.allocated_bytes, cache.last_used_ms), cache.path), cache))
    ranked.sort(key=lambda kv: kv[0])
    for _, item in ranked:
        if sim.met:
            return sim.actions
        if isinstance(item, Staging):
            sim.take(RemoveStaging(item.path, item.allocated_bytes))
        elif isinstance(item, CompileCache):
            sim.take(EvictCompileCache(item.path, item.allocated_bytes))
        else:
            sim.take(EvictWorkspace(item.name, item.path, item.allocated_bytes or 0))
    if sim.met:
        return sim.actions
    for ws in sorted((w for w in eligible if not w.complete), key=lambda w: (w.last_used_ms, w.name)):
        sim.actions.append(Repair(ws.name, ws.path, "whole"))
        return sim.actions
    return sim.actions


# --- the build-folder guard, the daily sweep and idle expiry ------------------------------


def guard_action(ws: Workspace, cap_bytes: int) -> Action | None:
    """After a job goes idle: drop only incremental dirs when target/ exceeds the cap.

    Deferred (None) while the workspace is running or reserved (a queued job will use it).
    An incomplete estimate is repaired and measured first."""
    if ws.running or ws.reserved or cap_bytes <= 0:
        return None
    if not ws.complete:
        return Repair(ws.name, ws.path, "guard")
    if (ws.target_bytes or 0) > cap_bytes and ws.incremental_bytes:
        return DropIncremental(ws.name, ws.path, ws.incremental_bytes, pass_name="guard",
                               purge=False)
    return None


def sweep_due(ws: Workspace, last_sweep_ms: int | None, now_ms: int) -> bool:
    """The daily stale-unit sweep: idle workspaces, at most once per day per runner lifetime."""
    if ws.running or ws.reserved:
        return False
    return sweep_time(last_sweep_ms, now_ms)


def sweep_time(last_sweep_ms: int | None, now_ms: int) -> bool:
    """Whether a workspace last swept at `last_sweep_ms` (None: not in this runner's
    lifetime) is due for its daily sweep by the time alone."""
    return last_sweep_ms is None or now_ms - last_sweep_ms >= SWEEP_EVERY_MS


def idle_expired(ws: Workspace, now_ms: int) -> bool:
    """Task workspaces are deleted after 24 h idle; head workspaces survive idle expiry."""
    if ws.kind != "task" or ws.running or ws.reserved or not ws.catalogued:
        return False
    return now_ms - ws.last_used_ms >= TASK_IDLE_MS


def bundle_pinned(last_used_ms: int, needed: bool, now_ms: int) -> bool:
    """A bundle stays while a job or transfer needs it and 24 h after its last use."""
    return needed or now_ms - last_used_ms < BUNDLE_RETENTION_MS


# --- one cleanup, step by step (the actor probes, gathers and carries out) -----------------


@dataclass
class CleanupRun:
    """The decisions of one cleanup: plan with `plan_cleanup`, carry out the first action,
    probe again for real, re-plan, until the plan is empty. Once below the hard floor the
    run stays hard until the soft goal is met; a deletion that fails is skipped for the rest
    of the run (the next cleanup retries it); a repaired workspace counts as complete."""

    floor_bytes: int
    goal_bytes: int
    hard: bool = False
    repaired: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)

    def needed(self, sample: DiskSample) -> bool:
        """False once the goal is met (bytes, and inodes where the file system counts them
        and the byte floor is on); else go on (and remember a dip below either floor)."""
        if sample.free_bytes >= self.goal_bytes and (
                sample.free_inodes >= inode_floors(sample, self.floor_bytes)[1]):
            return False
        self.hard = self.hard or self.below_floor(sample)
        return True

    def below_floor(self, sample: DiskSample) -> bool:
        """Hard pressure: below the floor of bytes, or of inodes (where one applies)."""
        return sample.free_bytes < self.floor_bytes or (
            sample.free_inodes < inode_floors(sample, self.floor_bytes)[0])

    def next_action(self, workspaces, staging, compile_cache, sample: DiskSample, now_ms: int,
                    allowed_roots, incoming: frozenset[str]) -> Action | None:
        wss = tuple(w if w.name not in self.repaired else complete(w) for w in workspaces)
        actions = plan_cleanup(PlanInput(
            workspaces=wss, staging=tuple(staging), compile_cache=compile_cache,
            free_bytes=sample.free_bytes, floor_bytes=self.floor_bytes,
            goal_bytes=self.goal_bytes, now_ms=now_ms, allowed_roots=tuple(allowed_roots),
            incoming=incoming, hard=self.hard, skip=frozenset(self.failed),
            free_inodes=sample.free_inodes,
            goal_inodes=inode_floors(sample, self.floor_bytes)[1]))
        if not actions:
            return None
        if isinstance(actions[0], Repair):
            self.repaired.add(actions[0].workspace)
        return actions[0]

    def done(self, action: Action, ok: bool) -> None:
        if not ok:
            self.failed.add(getattr(action, "workspace", None) or action.path)


def complete(ws: Workspace) -> Workspace:
    """The workspace as a complete estimate (after its repair)."""
    return replace(ws, complete=True)


def maintenance_due(ws: Workspace, last_sweep_ms: int | None, now_ms: int,
                    allowed_roots) -> str | None:
    """What a maintenance pass does to one workspace: "expire" (idle too long), "sweep"
    (the daily stale-unit sweep) or None (nothing, or protected even under hard pressure)."""
    inp = PlanInput(workspaces=(), free_bytes=0, floor_bytes=0, goal_bytes=0, now_ms=now_ms,
                    allowed_roots=tuple(allowed_roots))
    if protection(ws, inp, hard=True) is not None:
        return None
    if idle_expired(ws, now_ms):
        return "expire"
    if sweep_due(ws, last_sweep_ms, now_ms):
        return "sweep"
    return None
