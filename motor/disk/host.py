"""The disk actor's host side: file-system helpers and the planner's inputs, read from disk.

Moved out of `actor.py` unchanged: the free-space probe, device numbers, the staging / trash
and compile-cache candidates for the planner, the rows of `motor workspaces`, the build-tree
repair, safe deletion and incremental-directory drops. Blocking: the actor calls the walking
ones through its offloader (motor/offload.py). The rules stay in `core.py`.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
from dataclasses import replace
from pathlib import Path
from typing import Any

from . import bundles as bundles_mod
from . import sizes, trash
from .core import CompileCache, DiskSample, PlanInput, Staging, Workspace, protection, under_root

log = logging.getLogger("motor.disk")


def probe_path(path: Path) -> DiskSample:
    usage = shutil.disk_usage(path)
    return DiskSample(free_bytes=usage.free, total_bytes=usage.total)


def device(path: str) -> int | None:
    try:
        return os.stat(path).st_dev
    except OSError:
        return None


def sizes_root(path: str, roots) -> str:
    return under_root(path, roots)


# --- planner input ----------------------------------------------------------------------


def staging(allowed_roots, setting_up, dev: int | None) -> list[Staging]:
    """Bundle-unpack staging and trash entries under the roots on `dev` (None: all), each a
    candidate; those of jobs setting up are active."""
    out = []
    dirs = []
    for root in allowed_roots:
        if dev is not None and device(root) != dev:
            continue
        dirs.append(os.path.join(root, bundles_mod.STAGING))
        dirs.append(os.path.join(root, trash.TRASH))
    for d in dirs:
        try:
            entries = list(os.scandir(d))
        except OSError:
            continue
        for e in entries:
            active = e.name.split(".")[0] in setting_up
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


def workspace(entry: Any, cached: sizes.Sizes, stale_bytes: int, live: Any,
              allowed_roots) -> Workspace:
    """A catalog entry, its measured sizes and the live holds as the planner's Workspace."""
    keys = (entry.name, entry.path)
    return Workspace(
        name=entry.name, path=entry.path,
        root=sizes_root(entry.path, allowed_roots),
        kind=entry.kind, allocated_bytes=cached.allocated_bytes,
        target_bytes=cached.target_bytes, incremental_bytes=cached.incremental_bytes,
        stale_bytes=stale_bytes, complete=cached.complete,
        last_used_ms=entry.last_used_ms, running=any(k in live.running for k in keys),
        reserved=any(k in live.reserved for k in keys),
        referenced_by=tuple(entry.referenced_by))


def plan_input_for(now_ms: int, allowed_roots) -> PlanInput:
    """The planner input `protection` needs for one workspace (no space figures)."""
    return PlanInput(workspaces=(), free_bytes=0, floor_bytes=0, goal_bytes=0,
                     now_ms=now_ms, allowed_roots=allowed_roots)


def complete(ws: Workspace) -> Workspace:
    return replace(ws, complete=True)


# --- listing ----------------------------------------------------------------------------


def listing_row(entry: Any, cached: sizes.Sizes | None, live: Any, now: int, hard: bool,
                allowed_roots) -> dict:
    """One row of `motor workspaces`: catalog entry, cached sizes (None: not measured yet),
    and why it is protected now, if it is."""
    keys = (entry.name, entry.path)
    ws = Workspace(name=entry.name, path=entry.path, root=entry.root, kind=entry.kind,
                   last_used_ms=entry.last_used_ms,
                   running=any(k in live.running for k in keys),
                   reserved=any(k in live.reserved for k in keys))
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


# --- deleting and repairing -------------------------------------------------------------


def safe(fn, *args):
    try:
        return fn(*args)
    except (OSError, trash.UnsafeDelete) as exc:
        log.warning("disk: %s%s failed: %s", fn.__name__, args, exc)
        return None


def drop_incremental(path: str, root: str) -> int:
    n = 0
    for inc in sizes.incremental_dirs(path):
        if safe(trash.delete_tree, inc, root) is not None:
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
