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
import threading
from dataclasses import dataclass
from itertools import repeat

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


# --- the walk ----------------------------------------------------------------------------

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_AT_FDCWD = -100
_AT_SYMLINK_NOFOLLOW = 0x100
_TARGET, _INCREMENTAL = b"target", INCREMENTAL.encode()

#: `struct stat` as the kernel fills it, per machine: its size and (byte offset, width) of
#: each field the walk reads. x86_64 has its own layout; the generic one
#: (include/uapi/asm-generic/stat.h) serves arm64, riscv64 and loongarch64. Little-endian
#: machines only (the walk reads the file-type bits from the mode's second byte).
_LAYOUTS = {
    "x86_64": (144, {"dev": (0, 8), "ino": (8, 8), "nlink": (16, 8), "mode": (24, 4),
                     "blocks": (64, 8)}),
}
for _m in ("aarch64", "arm64", "riscv64", "loongarch64"):
    _LAYOUTS[_m] = (128, {"dev": (0, 8), "ino": (8, 8), "mode": (16, 4), "nlink": (20, 4),
                          "blocks": (64, 8)})
#: a mode's second byte -> 1 for a directory (S_IFDIR in bits 12-15), else 0
_IS_DIR = bytes(1 if b & 0xF0 == 0x40 else 0 for b in range(256))


class _Fstatat:
    """libc's `fstatat(2)` through ctypes, a whole directory at a time.

    Why: `os.stat` builds a `stat_result` per call (about 20 objects: three float and three
    nanosecond times among them), which is most of a Python walk's CPU time; the walk needs
    five integers. Here one directory's names are `fstatat`ed by `map` (no Python bytecode
    per entry) into consecutive `struct stat` slots of one buffer, and the sizes are summed
    from strided memoryviews of it; entries need Python code only when they are directories,
    have other than one link, or failed. Only used when the machine's layout is known *and*
    a check at first use (`native()`) agrees with the `os.stat` walk on a small tree of
    every kind of entry; otherwise the walk uses `os.stat` (same results, slower). Each walk
    gets its own buffer (`Slots`): the call releases the GIL, so two walks in two threads
    must not share one."""

    def __init__(self) -> None:
        import ctypes
        import platform
        import sys

        if sys.byteorder != "little":
            raise KeyError(sys.byteorder)
        self.size, self.fields = _LAYOUTS[platform.machine()]  # KeyError: unknown machine
        self.call = ctypes.CDLL(None).fstatat  # OSError/AttributeError: no such symbol
        self.ctypes = ctypes

    def agrees(self) -> bool:
        """The fast walk and the `os.stat` walk agree on a small tree with a file, a hard
        link, a symlink, directories (target/ and incremental ones) and an empty directory;
        and single reads agree with `os.lstat` field by field."""
        import sys
        import tempfile

        with tempfile.TemporaryDirectory(prefix="motor-fstatat-") as d:
            inc = os.path.join(d, "target", "debug", "incremental")
            os.makedirs(inc)
            os.mkdir(os.path.join(d, "empty"))
            for i, where in enumerate((d, inc, os.path.join(d, "target"))):
                with open(os.path.join(where, f"f{i}"), "wb") as f:
                    f.write(b"x" * (5000 * i + 1))
            os.link(os.path.join(d, "f0"), os.path.join(inc, "hard"))
            os.symlink(sys.executable, os.path.join(d, "link"))
            top = os.fsencode(d) + b"/"
            dev = os.lstat(d).st_dev
            if _walk_native(top, dev, frozenset(), self) != _walk_portable(top, dev, frozenset()):
                return False
            slots = Slots(self, 1)
            for path in (d, os.path.join(d, "link"), os.path.join(inc, "hard")):
                st = os.lstat(path)
                if (self.call(_AT_FDCWD, os.fsencode(path), slots.ptrs[0], _AT_SYMLINK_NOFOLLOW)
                        or slots.read(0) != (st.st_dev, st.st_ino, st.st_nlink, st.st_mode,
                                             st.st_blocks)):
                    return False
        return True


class Slots:
    """One walk's buffer of `struct stat` slots and its views (grown for large directories):
    `ptrs[i]` is slot i's address for the call; `view[name]` is (memoryview, first index,
    stride) of a field, so slot i's value is view[first + i * stride] and the column of all
    slots is view[first::stride]."""

    def __init__(self, at: _Fstatat, count: int) -> None:
        ctypes, size = at.ctypes, at.size
        self.at, self.count = at, count
        self.buf = ctypes.create_string_buffer(size * count)
        base = ctypes.addressof(self.buf)
        self.ptrs = [ctypes.c_void_p(base + i * size) for i in range(count)]
        raw = memoryview(self.buf).cast("B")
        views = {8: raw.cast("Q"), 4: raw.cast("I"), 1: raw}
        self.view = {name: (views[width], off // width, size // width)
                     for name, (off, width) in at.fields.items()}
        self.mode_type = (raw, at.fields["mode"][0] + 1, size)  # the byte with S_IFMT

    def read(self, i: int) -> tuple[int, ...]:
        """(dev, ino, nlink, mode, blocks) of slot i."""
        return tuple(v[first + i * stride] for v, first, stride in map(
            self.view.__getitem__, ("dev", "ino", "nlink", "mode", "blocks")))


_native: _Fstatat | None | bool = False  # False: not tried yet
_per_thread = threading.local()  # each thread's Slots, kept between walks
KEEP_SLOTS = 8192


def native() -> _Fstatat | None:
    """The ctypes `fstatat`, when usable here (checked once per process)."""
    global _native
    if _native is False:
        try:
            candidate = _Fstatat()
            _native = candidate if candidate.agrees() else None
        except (ImportError, KeyError, OSError, AttributeError, ValueError, TypeError):
            _native = None
        if _native is None:
            log.info("disk: the size walk uses os.stat (no native fstatat layout here)")
    return _native


def measure(path: str, *, now_ms: int = 0, mounts: frozenset[str] | None = None,
            fast: bool | None = None) -> Sizes:
    """Walk `path` read-only; sizes of the whole tree, `target/` and its incremental dirs.

    Each directory is opened once (`O_NOFOLLOW`) and listed once (`os.listdir`, bytes
    names); each entry gets one `lstat` relative to the directory's fd (`fstatat`: the kernel
    does not resolve the full path again; a name the listing gave that the fd's directory
    lacks, after a concurrent rename, counts as unreadable). No per-entry Python object is
    kept beyond one directory's names: only directories still to visit sit on the stack, as
    (path + "/", depth, class) with class 0 (plain), 1 (under `target/`) or 2 (under an
    incremental dir). Hard links are remembered only for files with more than one link.
    `fast`: use the ctypes `fstatat` (None: when `native()` has it; False: `os.stat`)."""
    mounts = mount_points() if mounts is None else mounts
    try:
        top = os.lstat(path)
    except OSError as exc:
        log.warning("disk: cannot measure %s: %s", path, exc.strerror)
        return Sizes(0, 0, 0, False, now_ms, 1)
    if not stat.S_ISDIR(top.st_mode):
        return Sizes(top.st_blocks * 512, 0, 0, True, now_ms)
    stat_at = native() if fast is None or fast else None
    if fast and stat_at is None:
        raise RuntimeError("no native fstatat on this machine")
    prefix = os.fsencode(path).rstrip(b"/") + b"/"
    bmounts = frozenset(os.fsencode(m) for m in mounts)
    walk = _walk_native if stat_at is not None else _walk_portable
    total, target, incremental, unreadable, first_error = walk(
        prefix, top.st_dev, bmounts, stat_at)
    total += top.st_blocks
    if first_error is not None:
        log.warning("disk: size of %s is incomplete: %d unreadable subtrees (first: %s)",
                    path, unreadable, first_error)
    return Sizes(total * 512, target * 512, incremental * 512, unreadable == 0, now_ms,
                 unreadable)


def _open_and_list(d: bytes) -> tuple[int, list[bytes]]:
    fd = os.open(d, _DIR_FLAGS)
    try:
        return fd, os.listdir(d)
    except BaseException:
        os.close(fd)
        raise


class _Walk:
    """One walk's running totals (in 512-byte blocks), the hard links seen, the stack of
    directories still to visit as (path + "/", depth, class) with class 0 (plain),
    1 (under `target/`) or 2 (under an incremental dir), and the unreadable count."""

    def __init__(self, top: bytes, dev: int, mounts: frozenset[bytes]) -> None:
        self.dev, self.mounts = dev, mounts
        self.total = self.target = self.incremental = self.unreadable = 0
        self.first_error: str | None = None
        self.seen: set[tuple[int, int]] = set()
        self.stack: list[tuple[bytes, int, int]] = [(top, 0, 0)]

    def fail(self, what: bytes, exc: OSError) -> None:
        self.unreadable += 1
        if self.first_error is None:
            self.first_error = f"{os.fsdecode(what)}: {exc.strerror}"

    def result(self):
        return self.total, self.target, self.incremental, self.unreadable, self.first_error

    def entries(self, d: bytes, fd: int, names: list[bytes], depth: int, cls: int) -> None:
        """One directory, entry by entry with `os.stat(name, dir_fd=fd)`."""
        lstat_at, isdir, push = os.stat, stat.S_ISDIR, self.stack.append
        dev, mounts, seen = self.dev, self.mounts, self.seen
        total = target = incremental = 0
        child_depth = depth + 1
        for name in names:
            try:
                st = lstat_at(name, dir_fd=fd, follow_symlinks=False)
            except OSError as exc:
                self.fail(d + name, exc)
                continue
            blocks = st.st_blocks
            if isdir(st.st_mode):
                child = d + name
                if st.st_dev != dev or child in mounts:
                    continue  # another mount: not ours to count
                c = _class(cls, child_depth, name)
                push((child + b"/", child_depth, c))
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
        self.total += total
        self.target += target
        self.incremental += incremental


def _class(cls: int, depth: int, name: bytes) -> int:
    """A directory's class from its parent's: `target` at depth 1 starts class 1, an
    `incremental` directory at depth 3 or 4 under it class 2 (target/<profile>/incremental
    or target/<triple>/<profile>/incremental)."""
    if cls == 0:
        return 1 if depth == 1 and name == _TARGET else 0
    if cls == 1 and name == _INCREMENTAL and depth in (3, 4):
        return 2
    return cls


def _walk_portable(top: bytes, dev: int, mounts: frozenset[bytes], _at=None):
    """The walk with `os.stat` per entry: (total, target, incremental blocks, unreadable,
    first error)."""
    w = _Walk(top, dev, mounts)
    while w.stack:
        d, depth, cls = w.stack.pop()
        try:
            fd, names = _open_and_list(d)
        except OSError as exc:
            w.fail(d, exc)
            continue
        try:
            w.entries(d, fd, names, depth, cls)
        finally:
            os.close(fd)
    return w.result()


def _walk_native(top: bytes, dev: int, mounts: frozenset[bytes], at: _Fstatat):
    """The same walk with the ctypes `fstatat`, a directory at a time: every name is
    `fstatat`ed into its slot, then the slots' blocks are summed at once. A directory where
    a call failed or a file has other than one link goes entry by entry (`_Walk.entries`);
    so does nothing else. Same results as `_walk_portable` (test_walk_reference.py)."""
    w = _Walk(top, dev, mounts)
    call, nofollow = at.call, _AT_SYMLINK_NOFOLLOW
    slots = getattr(_per_thread, "slots", None)  # reused: making the slots costs ~1 us each
    if slots is None or slots.at is not at:
        slots = Slots(at, 1024)
    pop, push = w.stack.pop, w.stack.append
    total = target = incremental = 0
    while w.stack:
        d, depth, cls = pop()
        try:
            fd, names = _open_and_list(d)
        except OSError as exc:
            w.fail(d, exc)
            continue
        try:
            n = len(names)
            if not n:
                continue
            if n > slots.count:
                slots = Slots(at, max(n, 2 * slots.count))
            if any(map(call, repeat(fd, n), names, slots.ptrs, repeat(nofollow, n))):
                w.entries(d, fd, names, depth, cls)  # a call failed: say which, and why
                continue
            raw, type_0, type_s = slots.mode_type
            types = raw[type_0:type_0 + n * type_s:type_s].tobytes()
            dirs = list(_ones(types.translate(_IS_DIR)))
            nl_v, nl_0, nl_s = slots.view["nlink"]
            # every non-directory has exactly one link? (directories may have 1 too: btrfs)
            single = nl_v[nl_0:nl_0 + n * nl_s:nl_s].tolist().count(1)
            single -= sum(1 for i in dirs if nl_v[nl_0 + i * nl_s] == 1)
            if single != n - len(dirs):
                w.entries(d, fd, names, depth, cls)  # hard links: remembered one by one
                continue
        finally:
            os.close(fd)
        dev_v, dev_0, dev_s = slots.view["dev"]
        blk_v, blk_0, blk_s = slots.view["blocks"]
        blocks = sum(blk_v[blk_0:blk_0 + n * blk_s:blk_s])
        child_depth = depth + 1
        for i in dirs:
            name = names[i]
            child = d + name
            b = blk_v[blk_0 + i * blk_s]
            if dev_v[dev_0 + i * dev_s] != dev or child in mounts:
                blocks -= b  # another mount: not ours to count
                continue
            c = _class(cls, child_depth, name)
            push((child + b"/", child_depth, c))
            if c != cls:  # its own blocks count in its class, the rest in ours
                blocks -= b
                total += b
                target += b
                if c == 2:
                    incremental += b
        total += blocks
        if cls:
            target += blocks
            if cls == 2:
                incremental += blocks
    w.total += total
    w.target += target
    w.incremental += incremental
    if slots.count <= KEEP_SLOTS:  # a huge directory's slots are not kept for the next walk
        _per_thread.slots = slots
    return w.result()


def _ones(flags: bytes):
    """The indices of the 1 bytes in `flags`."""
    i = flags.find(1)
    while i >= 0:
        yield i
        i = flags.find(1, i + 1)


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
