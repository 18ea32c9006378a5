"""Deletion that never follows a symlink and never crosses a mount.

A tree is first renamed into a trash directory on its own filesystem (`<root>/.motor-trash`,
so a caller root's host directory has its private trash), which takes it out of every
path at once, then emptied through directory file descriptors: `O_NOFOLLOW | O_DIRECTORY`
opens, an fstat check that the opened directory is the one that was listed, and no descent
into a directory on another device or listed as a mount point. A symlink is removed as a
link (its target is never touched); a mount point and whatever leads to it are left in the
trash and reported, and a later collection tries again.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import uuid

from .. import faults
from .sizes import mount_points

log = logging.getLogger("motor.disk")

TRASH = ".motor-trash"


class UnsafeDelete(Exception):
    """The path is not a plain directory or file we may delete."""


def trash_dir(root: str) -> str:
    path = os.path.join(root, TRASH)
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def move_to_trash(path: str, root: str) -> str:
    """Rename `path` (not following it if it is a symlink) into `root`'s trash. On a file
    system with no inode (or block) left for the trash directory itself, beside it in the
    root instead, as `.motor-trash-<name>.<id>` (a rename in place takes none; no workspace
    name starts with a dot): before stop 57 such a file system could never be cleaned up,
    its eviction failing ENOSPC at the trash's `mkdir`."""
    st = os.lstat(path)
    tag = f"{os.path.basename(path)}.{uuid.uuid4().hex[:12]}"
    try:
        trash = trash_dir(root)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        log.warning("disk: no room for %s on a full file system: deleting %s in place", TRASH,
                    path)
        dest = os.path.join(root, f"{TRASH}-{tag}")
    else:
        if os.lstat(trash).st_dev != st.st_dev:
            raise UnsafeDelete(f"{path} is not on the filesystem of its root {root}")
        dest = os.path.join(trash, tag)
    os.rename(path, dest)
    return dest


def beside_trash(root: str) -> list[str]:
    """What a deletion on a full file system renamed beside the trash (`move_to_trash`)."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    return [os.path.join(root, n) for n in names if n.startswith(TRASH + "-")]


#: how deep `purge` descends with a directory fd per level before it moves what is below
#: up beside the tree (`_Purge`): a tree of any depth is deleted with at most this many fds
#: and this much recursion (before stop 57 a 3,000-deep tree raised RecursionError, and the
#: disk actor with it)
MAX_DEPTH = 64


def purge(path: str, *, mounts: frozenset[str] | None = None) -> int:
    """Delete `path` (already in a trash dir). Returns how many entries were left behind
    because they are (or lead to) another mount or could not be removed. A subtree deeper
    than MAX_DEPTH is moved up beside `path` (into the same trash) and deleted after it."""
    faults.hit("disk.purge")  # tests: a deletion held (a big tree, a slow file system)
    mounts = mount_points() if mounts is None else mounts
    work, left = _Purge(path, mounts), 0
    try:
        while work.pending:
            left += work.one(work.pending.pop())
    finally:
        work.close()
    return left


class _Purge:
    """One purge: the trees still to delete (the first, and what was moved up from deep
    inside it) and the trash directory they sit in (an fd: moves go there)."""

    def __init__(self, path: str, mounts: frozenset[str]) -> None:
        self.pending, self.mounts = [path], mounts
        self.parent = os.path.dirname(path)
        self.parent_fd: int | None = None

    def close(self) -> None:
        if self.parent_fd is not None:
            os.close(self.parent_fd)

    def one(self, path: str) -> int:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(path)
            return 0
        if path in self.mounts:
            return 1
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            if not _same(os.fstat(fd), st):
                raise UnsafeDelete(f"{path} changed while it was opened")
            left = self._purge_fd(fd, path, st.st_dev, 1)
        finally:
            os.close(fd)
        if left == 0:
            try:
                os.rmdir(path)
            except OSError:
                left += 1
        return left

    def _move_up(self, dir_fd: int, name: str) -> bool:
        """Move the directory `name` (in `dir_fd`) up beside the tree, to be deleted next."""
        if self.parent_fd is None:
            self.parent_fd = os.open(self.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        # beside the trash (a full file system's, in the root) named so its collection
        # finds it; in the trash, any name
        beside = os.path.basename(self.parent) != TRASH
        dest = f"{TRASH + '-' if beside else ''}deep.{uuid.uuid4().hex[:12]}"
        try:
            os.rename(name, dest, src_dir_fd=dir_fd, dst_dir_fd=self.parent_fd)
        except OSError:
            return False
        self.pending.append(os.path.join(self.parent, dest))
        return True

    def _purge_fd(self, dir_fd: int, path: str, dev: int, depth: int) -> int:
        left = 0
        try:
            with os.scandir(dir_fd) as it:
                names = [e.name for e in it]
        except OSError:
            # an unreadable directory inside the trash: make it ours and try again once
            try:
                os.chmod(dir_fd, 0o700)
                with os.scandir(dir_fd) as it:
                    names = [e.name for e in it]
            except OSError:
                return 1
        for name in names:
            child = os.path.join(path, name)
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            except OSError:
                left += 1
                continue
            if not stat.S_ISDIR(st.st_mode):
                try:
                    os.unlink(name, dir_fd=dir_fd)
                except FileNotFoundError:
                    pass
                except OSError:
                    left += 1
                continue
            if st.st_dev != dev or child in self.mounts:
                log.warning("disk: not crossing into the mount at %s", child)
                left += 1
                continue
            if depth >= MAX_DEPTH:
                if not self._move_up(dir_fd, name):
                    left += 1
                continue
            try:
                fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
            except OSError:
                left += 1
                continue
            try:
                if not _same(os.fstat(fd), st):
                    left += 1
                    continue
                sub = self._purge_fd(fd, child, dev, depth + 1)
            finally:
                os.close(fd)
            if sub:
                left += sub
                continue
            try:
                os.rmdir(name, dir_fd=dir_fd)
            except OSError:
                left += 1
        return left


def _same(a: os.stat_result, b: os.stat_result) -> bool:
    return a.st_dev == b.st_dev and a.st_ino == b.st_ino


def delete_tree(path: str, root: str) -> int:
    """Evict `path` (a tree under `root`): rename into root's trash, then purge it."""
    dest = move_to_trash(path, root)
    left = purge(dest)
    if left:
        log.warning("disk: %d entries of %s stay in the trash (mounts or unremovable)", left, path)
    return left


def remove(path: str, root: str, purge: bool) -> int | str:
    """`delete_tree` (`purge`), or only `move_to_trash`, whose next collection deletes it
    (a deletion that frees nothing urgent, off the disk actor's turn: docs/disk.md)."""
    return delete_tree(path, root) if purge else move_to_trash(path, root)


def delete_inside(path: str, root: str) -> int:
    """Delete a subtree (an incremental dir, a Cargo unit dir) of a workspace the same way."""
    return delete_tree(path, root)


def collect_trash(root: str) -> int:
    """Empty what earlier deletions left in `root`'s trash, and beside it (never crossing
    mounts)."""
    trash = os.path.join(root, TRASH)
    try:
        paths = [os.path.join(trash, name) for name in os.listdir(trash)]
    except OSError:
        paths = []
    paths += beside_trash(root)
    left = 0
    mounts = mount_points()
    for path in paths:
        try:
            left += purge(path, mounts=mounts)
        except OSError:
            left += 1
    return left
