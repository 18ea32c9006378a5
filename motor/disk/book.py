"""The disk actor's bookkeeping: the size cache and the planner's view of catalog entries.

Pure: no I/O, no clock, no trio. The actor (`disk/actor.py`) walks trees through its
offloader (`host.py`) and stores the results here; `workspace_of` and `listing_row` turn a
catalog entry, its cached sizes and what live jobs hold into the planner's `Workspace` and
a row of `motor workspaces` (moved from host.py: they decide, they read nothing).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from .core import PlanInput, Workspace, protection, under_root
from .sizes import Sizes


@dataclass
class SizeCache:
    """In memory only (a restart starts empty).

    `dirty`: workspaces used since their last walk (a job ended in them), walked when next
    needed (the guard, a cleanup or maintenance pass, a listing), once however many jobs
    ended in between. `guard_pending`: idle workspaces the build-folder guard has still to
    look at; `last_sweep`: when each was last swept (the daily stale-unit sweep)."""

    sizes: dict[str, Sizes] = field(default_factory=dict)
    stale: dict[str, int] = field(default_factory=dict)
    dirty: set[str] = field(default_factory=set)
    last_sweep: dict[str, int] = field(default_factory=dict)
    guard_pending: set[str] = field(default_factory=set)

    def store(self, name: str, sizes: Sizes, stale_bytes: int) -> None:
        self.sizes[name] = sizes
        self.stale[name] = stale_bytes
        self.dirty.discard(name)

    def forget(self, name: str) -> None:
        """The tree is gone (evicted, or found missing)."""
        self.sizes.pop(name, None)
        self.stale.pop(name, None)
        self.dirty.discard(name)

    def used(self, name: str) -> None:
        self.dirty.add(name)

    def wanted(self, names: Iterable[str]) -> set[str]:
        """Which of `names` need a walk: never measured, or used since."""
        return {n for n in names if n not in self.sizes or n in self.dirty}


def held(live: Any, entry: Any, *which: str) -> bool:
    """Whether live jobs hold the entry (by name or canonical path) as any of `which`
    ("running", "reserved")."""
    return any(entry.name in h or entry.path in h for h in (getattr(live, w) for w in which))


def workspace_of(entry: Any, cache: SizeCache, live: Any, allowed_roots) -> Workspace:
    """A catalog entry, its cached sizes and the live holds as the planner's Workspace."""
    cached = cache.sizes[entry.name]
    return Workspace(
        name=entry.name, path=entry.path,
        root=under_root(entry.path, allowed_roots),
        kind=entry.kind, allocated_bytes=cached.allocated_bytes,
        target_bytes=cached.target_bytes, incremental_bytes=cached.incremental_bytes,
        stale_bytes=cache.stale.get(entry.name, 0), complete=cached.complete,
        last_used_ms=entry.last_used_ms, running=held(live, entry, "running"),
        reserved=held(live, entry, "reserved"),
        referenced_by=tuple(entry.referenced_by))


def listing_row(entry: Any, cached: Sizes | None, live: Any, now: int, hard: bool,
                allowed_roots) -> dict:
    """One row of `motor workspaces`: catalog entry, cached sizes (None: not measured yet),
    and why it is protected now, if it is."""
    ws = Workspace(name=entry.name, path=entry.path, root=entry.root, kind=entry.kind,
                   last_used_ms=entry.last_used_ms,
                   running=held(live, entry, "running"), reserved=held(live, entry, "reserved"))
    why = protection(ws, PlanInput(workspaces=(), free_bytes=0, floor_bytes=0,
                                   goal_bytes=0, now_ms=now,
                                   allowed_roots=allowed_roots), hard=hard)
    return {
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
    }
