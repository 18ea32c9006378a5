"""Cargo `target/` units: group outputs by name/hash, age them, delete whole units.

A profile directory (`target/<profile>` or `target/<triple>/<profile>`) holds, per unit
(crate name + 16-hex-digit hash):
- `deps/` files: `lib<name>-<hash>.rlib|.rmeta|.so|.a|.dylib`, `<name>-<hash>` (a binary or
  test), `<name>-<hash>.d` and other `<name>-<hash>.<ext>` outputs;
- `build/<name>-<hash>/` directories (a build script's compiled program, or its run output);
- `.fingerprint/<name>-<hash>/` directories.
`incremental/<name>-<hash>/` directories are aged independently (they are not unit outputs).
Symlinks are never followed, never counted and never deleted; files whose names do not parse
are unknown and left alone. A unit is stale only when every known output (every file inside
its directories too) has an atime older than 48 hours.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field

from . import trash
from .core import STALE_UNIT_MS

_HASH = r"(?P<hash>[0-9a-f]{16})"
_DEPS_FILE = re.compile(r"^(?P<name>[A-Za-z0-9_][A-Za-z0-9_.-]*?)-" + _HASH + r"(?P<ext>\..+)?$")
_UNIT_DIR = re.compile(r"^(?P<name>[A-Za-z0-9_][A-Za-z0-9_.-]*?)-" + _HASH + "$")
_LIB_EXT = {".rlib", ".rmeta", ".so", ".a", ".dylib", ".dll", ".lib"}


@dataclass
class Unit:
    name: str
    hash: str
    profile: str  # the profile directory it lives in
    files: list[str] = field(default_factory=list)  # deps/ files
    dirs: list[str] = field(default_factory=list)  # build/ and .fingerprint/ dirs
    bytes: int = 0
    newest_atime_ms: int = 0

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.profile, self.name, self.hash)


@dataclass
class Incremental:
    path: str
    bytes: int
    newest_atime_ms: int


def _lstat(path: str):
    try:
        return os.lstat(path)
    except OSError:
        return None


def _is_dir(st) -> bool:
    return st is not None and stat.S_ISDIR(st.st_mode)


def _entries(path: str):
    try:
        with os.scandir(path) as it:
            return list(it)
    except OSError:
        return []


def profiles(workspace: str) -> list[str]:
    """Profile directories under `<workspace>/target`, reached without following symlinks."""
    target = os.path.join(workspace, "target")
    if not _is_dir(_lstat(target)):
        return []
    out = []
    for a in _entries(target):
        if not a.is_dir(follow_symlinks=False):
            continue
        if _looks_like_profile(a.path):
            out.append(a.path)
            continue
        for b in _entries(a.path):
            if b.is_dir(follow_symlinks=False) and _looks_like_profile(b.path):
                out.append(b.path)
    return sorted(out)


def _looks_like_profile(path: str) -> bool:
    return any(_is_dir(_lstat(os.path.join(path, d))) for d in ("deps", ".fingerprint", "build"))


def _tree_usage(path: str) -> tuple[int, int]:
    """(allocated bytes, newest atime ms) of a real directory, never through links or mounts."""
    st0 = _lstat(path)
    if st0 is None:
        return 0, 0
    total, newest = st0.st_blocks * 512, 0
    stack = [path]
    while stack:
        d = stack.pop()
        for e in _entries(d):
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISLNK(st.st_mode):
                continue
            if stat.S_ISDIR(st.st_mode):
                if st.st_dev == st0.st_dev:
                    total += st.st_blocks * 512
                    stack.append(e.path)
                continue
            total += st.st_blocks * 512
            newest = max(newest, st.st_atime_ns // 1_000_000)
    if newest == 0:  # an empty unit dir: its own atime
        newest = st0.st_atime_ns // 1_000_000
    return total, newest


def scan(workspace: str) -> tuple[list[Unit], list[Incremental]]:
    """Group the Cargo outputs of a workspace into units; list its incremental dirs."""
    units: dict[tuple[str, str, str], Unit] = {}
    incrementals: list[Incremental] = []

    def unit(profile, name, h) -> Unit:
        key = (profile, name, h)
        if key not in units:
            units[key] = Unit(name=name, hash=h, profile=profile)
        return units[key]

    for profile in profiles(workspace):
        deps = os.path.join(profile, "deps")
        if _is_dir(_lstat(deps)):
            for e in _entries(deps):
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                if not stat.S_ISREG(st.st_mode):
                    continue  # symlinks and anything odd: left alone
                m = _DEPS_FILE.match(e.name)
                if m is None:
                    continue
                name, ext = m["name"], m["ext"] or ""
                if name.startswith("lib") and ext in _LIB_EXT:
                    name = name[3:]
                u = unit(profile, name.replace("-", "_"), m["hash"])
                u.files.append(e.path)
                u.bytes += st.st_blocks * 512
                u.newest_atime_ms = max(u.newest_atime_ms, st.st_atime_ns // 1_000_000)
        for sub in ("build", ".fingerprint"):
            base = os.path.join(profile, sub)
            if not _is_dir(_lstat(base)):
                continue
            for e in _entries(base):
                if not e.is_dir(follow_symlinks=False):
                    continue
                m = _UNIT_DIR.match(e.name)
                if m is None:
                    continue
                u = unit(profile, m["name"].replace("-", "_"), m["hash"])
                size, newest = _tree_usage(e.path)
                u.dirs.append(e.path)
                u.bytes += size
                u.newest_atime_ms = max(u.newest_atime_ms, newest)
        inc = os.path.join(profile, "incremental")
        if _is_dir(_lstat(inc)):
            for e in _entries(inc):
                if e.is_dir(follow_symlinks=False):
                    size, newest = _tree_usage(e.path)
                    incrementals.append(Incremental(e.path, size, newest))
    return sorted(units.values(), key=lambda u: u.key), incrementals


def stale_units(units: list[Unit], now_ms: int) -> list[Unit]:
    return [u for u in units if now_ms - u.newest_atime_ms > STALE_UNIT_MS]


@dataclass
class Stale:
    """What a workspace's daily sweep would remove, as one scan found it: whole stale units
    and incremental dirs aged on their own."""
    units: list[Unit]
    incremental: list[Incremental]

    @property
    def bytes(self) -> int:
        return sum(u.bytes for u in self.units) + sum(i.bytes for i in self.incremental)


def stale(workspace: str, now_ms: int) -> Stale:
    units, incs = scan(workspace)
    return Stale(stale_units(units, now_ms),
                 [i for i in incs if now_ms - i.newest_atime_ms > STALE_UNIT_MS])


def delete_units(units: list[Unit], root: str, purge: bool = True) -> int:
    """Delete whole units: their deps files (as files, never through links) and dirs (with
    `purge` false only moved into the trash, whose next collection deletes them)."""
    freed = 0
    for u in units:
        for path in u.files:
            st = _lstat(path)
            if st is not None and stat.S_ISREG(st.st_mode):
                try:
                    os.unlink(path)
                except OSError:
                    continue
        for path in u.dirs:
            if _is_dir(_lstat(path)):
                try:
                    trash.remove(path, root, purge)
                except (OSError, trash.UnsafeDelete):
                    continue
        freed += u.bytes
    return freed


def remove(found: Stale, root: str, purge: bool = True) -> dict:
    """Remove what a scan found stale (`stale`); `purge` false: its directories are only
    moved into the trash (`delete_units`)."""
    freed, dropped = delete_units(found.units, root, purge), 0
    for inc in found.incremental:
        try:
            trash.remove(inc.path, root, purge)
        except (OSError, trash.UnsafeDelete):
            continue
        freed += inc.bytes
        dropped += 1
    return {"units": len(found.units), "incremental": dropped, "freed_bytes": freed}


def sweep(workspace: str, root: str, now_ms: int, purge: bool = True) -> dict:
    """The daily sweep: whole stale units, and incremental crate dirs aged on their own."""
    return remove(stale(workspace, now_ms), root, purge)
