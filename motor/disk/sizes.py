"""Read-only size walks: allocated bytes of a workspace, its target/ and incremental dirs.

A walk never follows symlinks, never crosses into another mount (a different st_dev, or a
mount point listed in /proc/self/mountinfo, which catches bind mounts of the same
filesystem), never claims a workspace and never changes permissions. Allocated bytes are
st_blocks x 512, each (dev, inode) counted once, like `du`. An unreadable subtree marks the
estimate incomplete and logs one warning per walk.
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass

log = logging.getLogger("motor.disk")

#: Cargo profile directories hold incremental state in `<profile>/incremental`.
INCREMENTAL = "incremental"


@dataclass(frozen=True)
class Sizes:
    allocated_bytes: int
    target_bytes: int
    incremental_bytes: int
    complete: bool
    measured_ms: int = 0
    unreadable: int = 0  # subtrees the walk could not read


def _unescape(field: str) -> str:
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mount_points(mountinfo: str = "/proc/self/mountinfo") -> frozenset[str]:
    """Every mount point of this mount namespace (empty when unreadable)."""
    try:
        with open(mountinfo) as f:
            return frozenset(_unescape(line.split()[4]) for line in f if len(line.split()) > 4)
    except OSError:
        return frozenset()


def mounts_under(path: str, mounts: frozenset[str] | None = None) -> list[str]:
    mounts = mount_points() if mounts is None else mounts
    prefix = path.rstrip("/") + "/"
    return sorted(m for m in mounts if m.startswith(prefix))


def _is_incremental(rel_parts: tuple[str, ...]) -> bool:
    """target/<profile>/incremental or target/<triple>/<profile>/incremental."""
    return (len(rel_parts) in (3, 4) and rel_parts[0] == "target"
            and rel_parts[-1] == INCREMENTAL)


def measure(path: str, *, now_ms: int = 0, mounts: frozenset[str] | None = None) -> Sizes:
    """Walk `path` read-only; sizes of the whole tree, `target/` and its incremental dirs.

    One `lstat` per entry, made relative to the directory's fd (`fstatat`: the kernel does
    not resolve the full path again; a name the listing gave that the fd's directory lacks,
    after a concurrent rename, counts as unreadable), and no per-entry Python object kept
    beyond one directory's names: only directories still to visit sit on the stack, as (path, depth, class) with
    class 0 (plain), 1 (under `target/`) or 2 (under an incremental dir). Hard links are
    remembered only for files with more than one link."""
    mounts = mount_points() if mounts is None else mounts
    seen: set[tuple[int, int]] = set()
    total = target = incremental = 0  # in 512-byte blocks
    unreadable = 0
    first_error: str | None = None
    try:
        top = os.lstat(path)
    except OSError as exc:
        log.warning("disk: cannot measure %s: %s", path, exc.strerror)
        return Sizes(0, 0, 0, False, now_ms, 1)
    if not stat.S_ISDIR(top.st_mode):
        return Sizes(top.st_blocks * 512, 0, 0, True, now_ms)
    dev = top.st_dev
    total += top.st_blocks
    lstat_at = os.stat
    isdir = stat.S_ISDIR
    join = os.path.join
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    stack: list[tuple[str, int, int]] = [(path, 0, 0)]
    pop, push = stack.pop, stack.append
    while stack:
        d, depth, cls = pop()
        try:
            fd = os.open(d, flags)
            try:
                with os.scandir(d) as it:
                    names = [e.name for e in it]
            except BaseException:
                os.close(fd)
                raise
        except OSError as exc:
            unreadable += 1
            if first_error is None:
                first_error = f"{d}: {exc.strerror}"
            continue
        try:
            child_depth = depth + 1
            for name in names:
                try:
                    st = lstat_at(name, dir_fd=fd, follow_symlinks=False)
                except OSError as exc:
                    unreadable += 1
                    if first_error is None:
                        first_error = f"{join(d, name)}: {exc.strerror}"
                    continue
                blocks = st.st_blocks
                if isdir(st.st_mode):
                    child = join(d, name)
                    if st.st_dev != dev or child in mounts:
                        continue  # another mount: not ours to count
                    c = cls
                    if c == 0:
                        if child_depth == 1 and name == "target":
                            c = 1
                    elif c == 1 and name == INCREMENTAL and child_depth in (3, 4):
                        c = 2
                    push((child, child_depth, c))
                    total += blocks
                    if c:
                        target += blocks
                        if c == 2:
                            incremental += blocks
                    continue
                if st.st_nlink > 1:
                    key = (st.st_dev, st.st_ino)
                    if key in seen:
                        continue
                    seen.add(key)
                total += blocks
                if cls:
                    target += blocks
                    if cls == 2:
                        incremental += blocks
        finally:
            os.close(fd)
    if first_error is not None:
        log.warning("disk: size of %s is incomplete: %d unreadable subtrees (first: %s)",
                    path, unreadable, first_error)
    return Sizes(total * 512, target * 512, incremental * 512, unreadable == 0, now_ms,
                 unreadable)


def incremental_dirs(path: str) -> list[str]:
    """The incremental directories of a workspace's target/ (never through symlinks)."""
    out = []
    target = os.path.join(path, "target")
    if not _real_dir(target):
        return out
    for a in _subdirs(target):
        cand = os.path.join(a, INCREMENTAL)
        if _real_dir(cand):
            out.append(cand)
        for b in _subdirs(a):
            cand = os.path.join(b, INCREMENTAL)
            if _real_dir(cand):
                out.append(cand)
    return out


def _real_dir(path: str) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _subdirs(path: str) -> list[str]:
    try:
        with os.scandir(path) as it:
            return [e.path for e in it if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []
