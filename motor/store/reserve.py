"""The store's reserve: a file of a few MiB held on the state file system, so that the job
database can still record what it must (a job's end) once that file system is full.

Why (stop 58, a fault probe): a job filled the state file system from its workspace (the
default layout keeps the workspaces under the state directory) and ended. Its terminal
record could not be saved ("waiting for space to record the job"), so the job stayed
running in the store, its workspace stayed a running job's, and the disk manager, which
never evicts a running job's workspace, had nothing to free: the runner was wedged, its
`motor run` waiting for good. A runner restarted on that file system could not open its
database ("disk I/O error") and exited.

Now a write of a job that has started (its start, a batch of its output, its end) that
finds the file system full deletes the reserve and is tried once more
(`Database.save_many`); so does the disk manager when a cleanup leaves the file system
full (`Room._last_resort`: keeperd may hold the job's output and status, unwritten, with no
write of the store's to make room). The job's output and end land, its workspace is idle,
and the disk manager's cleanup (below the floor every idle workspace may go, the youngest
too) frees the space. Accepts and queue clocks never spend it: admission answers for
those. Not covered: a job that still has more to record than the reserve freed (it
printed that much after the disk filled), or a second job that fills the disk before the
reserve is back; the runner says so in health and goes on once space is freed by hand
(docs/operations.md).

The reserve is made again once the file system is back at its goal, looked at no more
than every RESTORE_EVERY_S, after a commit. A database that cannot be opened on a file
system with less free than the reserve's size deletes it and is opened again
(`open_database`). The store's writes and the disk manager's last resort delete it; only
the store makes it again (one at a time: its lock). Its size: a quarter of the state file
system's floor, at most 8 MiB; none where the floor is off (`--free-space-floor-bytes 0`)."""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from pathlib import Path

log = logging.getLogger("motor.store")

RESERVE_MAX_BYTES = 8 << 20
RESTORE_EVERY_S = 1.0
FILE_NAME = "store.reserve"


def reserve_bytes(floor_bytes: int) -> int:
    """The reserve's size for a state file system whose floor is `floor_bytes`."""
    return min(RESERVE_MAX_BYTES, max(0, floor_bytes) // 4)


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


class Reserve:
    """The reserve file at `path`, of `size` bytes, made only while the file system has
    `restore_at` bytes free beside it (its goal). `held`: the file is there, whole, as far
    as this process knows; `released`: how often it was deleted to make room."""

    def __init__(self, path: Path, size: int, restore_at: int, *, clock=time.monotonic):
        self.path, self.size, self.restore_at = Path(path), size, restore_at
        self.held = False
        self.released = 0
        self._clock = clock
        self._next_try = 0.0
        #: its two releasers (the store's writes, maybe in a worker thread, and the disk
        #: manager's last resort) and its maker go one at a time
        self._lock = threading.Lock()

    def ensure(self) -> bool:
        """Hold the reserve: keep a whole one that is there, else make it when the file
        system has room for it above its goal. Never raises; whether it is held."""
        with self._lock:
            return self._ensure()

    def _ensure(self) -> bool:
        try:
            if os.stat(self.path).st_blocks * 512 >= self.size:
                self.held = True
                return True
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("store reserve %s cannot be read (%s): not held", self.path, exc)
            return False
        try:
            if free_bytes(self.path.parent) < self.restore_at + self.size:
                return False
            self._make()
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                log.warning("store reserve %s cannot be made (%s): not held", self.path, exc)
            return False
        self.held = True
        return True

    def _make(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, self.size)
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                chunk = bytes(1 << 20)  # a file system without fallocate: written out
                for offset in range(0, self.size, len(chunk)):
                    os.pwrite(fd, chunk[:self.size - offset], offset)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        os.replace(tmp, self.path)

    def release(self) -> bool:
        """Delete the reserve (the file system is full and the store must write): whether
        there was one to delete."""
        with self._lock:
            return self._release()

    def _release(self) -> bool:
        self.held = False
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            return False
        except OSError as exc:
            log.warning("store reserve %s cannot be deleted: %s", self.path, exc)
            return False
        self.released += 1
        self._next_try = self._clock() + RESTORE_EVERY_S
        log.warning("the state file system is full: the store's reserve (%d bytes, %s) is "
                    "deleted to record what it must; it is made again once the file system "
                    "is back at %d bytes free", self.size, self.path, self.restore_at)
        return True

    def release_if_full(self) -> bool:
        """`release`, when the file system has less free than the reserve's size (a
        database that could not be opened there): whether it was released."""
        try:
            if free_bytes(self.path.parent) >= max(self.size, 1 << 20):
                return False
        except OSError:
            return False
        return self.release()

    def restore_later(self) -> None:
        """After a commit while the reserve is not held: `ensure`, at most every
        RESTORE_EVERY_S."""
        if self._clock() < self._next_try:
            return
        self._next_try = self._clock() + RESTORE_EVERY_S
        if self.ensure():
            log.info("the store's reserve (%d bytes, %s) is made again", self.size, self.path)

    def describe(self) -> dict:
        """For health: its size, whether it is held, how often it was deleted."""
        return {"bytes": self.size, "held": self.held, "released": self.released}
