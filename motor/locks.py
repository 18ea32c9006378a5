"""Locks that a removed file cannot lose: an flock on a directory and on a lock file in it.

The runner's state dir (`runner.lock`, motor/runner/host.py), its workspace roots outside
it (`.motor-root.lock`, `WorkspaceRootLocks` there) and the task client's dir (the
QueueLock, `queue.json.lock`, motor/tasks/store.py) are each locked twice: the directory
itself, which `rm <lock file>` (a "stale lock" cleaned by hand) cannot unlock, and the lock
file, which keeps out a holder of an older motor that locks only the file. Where a
directory cannot be locked (NFS answers an flock on one with an error), the file's lock
alone holds, as before stop 50.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

__all__ = ["flock_holder", "lock_dir_and_file", "proc_locks_id", "release", "write_pid"]


def lock_dir_and_file(directory: Path, file: Path, *, blocking: bool, mode: int,
                      file_optional: bool = False) -> list[int]:
    """An exclusive flock on `directory`, then on `file` (made with `mode` when missing), in
    that order; the fds that hold them (`release`), the file's last. BlockingIOError when
    not `blocking` and either is held elsewhere; on any error nothing stays open or locked.
    `file_optional`: a file that cannot be made or locked (a read-only file system) leaves
    the directory's lock alone, when it has one."""
    op = fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB)
    fds: list[int] = []
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        fds.append(dir_fd)
        try:
            fcntl.flock(dir_fd, op)
        except BlockingIOError:
            raise
        except OSError:  # a file system that cannot lock a directory (NFS): the file alone
            fds.remove(dir_fd)
            os.close(dir_fd)
        try:
            fds.append(os.open(file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, mode))
            fcntl.flock(fds[-1], op)
        except BlockingIOError:
            raise
        except OSError:
            if not (file_optional and fds and fds[0] == dir_fd):
                raise
            if fds[-1] != dir_fd:
                os.close(fds.pop())
    except BaseException:
        release(fds)
        raise
    return fds


def write_pid(fds: list[int], file: Path) -> None:
    """Write our pid into the lock file among `fds` (the last), if it is held."""
    if fds and os.path.isfile(file) and os.fstat(fds[-1]).st_ino == os.stat(file).st_ino:
        os.ftruncate(fds[-1], 0)
        os.pwrite(fds[-1], f"{os.getpid()}\n".encode(), 0)


def release(fds: list[int]) -> None:
    """Unlock and close `fds` (unlocked first: a forked child may share one), last first."""
    for fd in reversed(fds):
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError:
            pass
        os.close(fd)
    fds.clear()


def proc_locks_id(path: Path) -> str:
    """How /proc/locks names the file at `path`: `MAJOR:MINOR:INODE` (hex device numbers)."""
    st = os.stat(path)
    return f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"


def flock_holder(path: Path) -> str | None:
    """The pid /proc/locks names for an flock held on the file at `path` (None: none seen)."""
    try:
        wanted = proc_locks_id(path)
        with open("/proc/locks") as locks:
            for line in locks:
                parts = line.split()
                if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == wanted:
                    return parts[4]
    except OSError:
        pass
    return None
