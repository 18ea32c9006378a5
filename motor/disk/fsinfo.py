"""What file system the state directory lives on, and whether it keeps a journal (issue 14).

Every job creates a handful of files in its job directory (the directory, spec.json,
keeper.json, status.json, output.log) and retention deletes them a day later. On ext4
*without a journal*, the inode allocator skips every inode freed in the last 60 seconds (300
while its inode table block is dirty: `recently_deleted()` in fs/ext4/ialloc.c, which only a
journal-less file system calls), reading the inode table for each one it passes. After many
deletions (a retention pass, a workspace eviction, a test suite's temporary directories)
creating a file there costs hundreds of microseconds of kernel CPU instead of tens, for
minutes: measured on the development host, whose root file system has no journal, creates
of 12-45 us in one minute and 540-690 us in another, and a sixth of the runner's CPU (30% in
the kernel) in ext4's inode search while it lasted (docs/performance.md, "The host's file
system").

`state_filesystem` reads it from /proc and /sys, without privileges, so start-up can say so
(a warning naming the cure) and `GET /v1/health` can show it (`disk.state_filesystem`).
"""

from __future__ import annotations

import os

#: file systems whose journal may be missing: ext2 never has one, ext3/ext4 may be made or
#: tuned without (`mkfs.ext4 -O ^has_journal`, `tune2fs -O ^has_journal`)
_EXT = ("ext2", "ext3", "ext4")


def mount_of(path: str, mountinfo: str = "/proc/self/mountinfo") -> tuple[str, str, str] | None:
    """(file system type, mount point, source) of the mount that holds `path`: the entry
    with its device numbers whose mount point is the longest prefix of the path."""
    try:
        st = os.stat(path)
        real = os.path.realpath(path)
        with open(mountinfo, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    want = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    best: tuple[str, str, str] | None = None
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 2 or fields[2] != want:
            continue
        point = fields[4].replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) > len(best[1])):
            best = (tail[0], point, tail[1])
    return best


def block_device_name(path: str, sys_root: str = "/sys") -> str | None:
    """The kernel's name of the block device that holds `path` (`vda`, `dm-0`, `loop3`),
    as /proc/fs/ext4 and /proc/fs/jbd2 name it; None when it is not a block device's."""
    try:
        st = os.stat(path)
        target = os.path.realpath(
            os.path.join(sys_root, "dev", "block", f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"))
    except OSError:
        return None
    if not os.path.isdir(target):
        return None
    return os.path.basename(target)


def state_filesystem(path: str, proc_root: str = "/proc", sys_root: str = "/sys") -> dict | None:
    """`{"type", "mount_point", "source", "device"?, "journal"?}` of the file system that
    holds `path`, None when /proc cannot tell. `journal` is given for ext2/3/4 on a block
    device: true when jbd2 runs for it (/proc/fs/jbd2/<device>-<inode>)."""
    found = mount_of(path, os.path.join(proc_root, "self", "mountinfo"))
    if found is None:
        return None
    fstype, point, source = found
    info: dict = {"type": fstype, "mount_point": point, "source": source}
    name = block_device_name(path, sys_root)
    if name is not None:
        info["device"] = name
        if fstype in _EXT:
            try:
                journals = os.listdir(os.path.join(proc_root, "fs", "jbd2"))
            except FileNotFoundError:  # no jbd2 at all: no journal runs on this host
                journals = []
            except OSError:
                return info
            info["journal"] = any(j.rpartition("-")[0] == name for j in journals)
    return info


def journal_warning(path: str, info: dict | None) -> str | None:
    """The start-up warning for a state directory on ext4 (or ext2/3) without a journal."""
    if not info or info.get("journal") is not False:
        return None
    return (f"state directory {path} is on {info['type']} without a journal"
            f" ({info.get('source')}, mounted on {info.get('mount_point')}): creating a file there"
            " skips every inode deleted in the last 60-300 s, so after jobs or workspaces are"
            " removed each job's start and end costs up to milliseconds more;"
            " a journaled file system avoids it (docs/operations.md, \"The state directory\")")
