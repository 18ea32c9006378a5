"""Whether `motor.db` is still the file the runner has open (stop 52).

An operator's `rm motor.db*` (a clean-up gone wide, a "reset" while it runs) or a backup
copied over it left the runner writing into a file no path names any more: every job it
accepted from then on ran and was recorded, health said ok, and at the next start all of
it was gone (the start refused: "motor.db is missing but jobs/ holds job directories").

The database checks its path (`FileGuard.check`: one `stat`) before each commit, when health
asks, and every `DATABASE_CHECK_S` (motor/runner/tree.py); the first time the path no longer
names the file it has open, it says so once (`on_lost`: the runner stops,
motor/runner/tree.py) and, when it closes, saves what the open file holds (every commit up
to the last one, WAL included) with SQLite's backup API: back at its path when nothing is
there, beside it as `motor.db.displaced-<ms>` when another file took its place (it is not
overwritten). The other connections of the database open the path with `mode=rw` (`uri`),
never creating a file there.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import time
import urllib.parse
from pathlib import Path
from typing import Callable

log = logging.getLogger("motor.store")


class DatabaseLost(RuntimeError):
    """The runner stopped because its job database's path no longer names the file it had
    open (`motor serve` exit status 5); the message says where its records were saved."""


def uri(path: Path | str) -> str:
    """An SQLite URI that opens `path` read-write and never creates it."""
    return f"file:{urllib.parse.quote(os.fspath(path))}?mode=rw"


def _identity(path: Path | str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _fsync(path: str) -> None:
    """fsync a file, or a directory (its entries: a rename in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FileGuard:
    """The identity of the database file as opened, and what became of its path."""

    def __init__(self, path: Path, conn: sqlite3.Connection):
        self.path = path
        self.identity = _identity(path)
        self._conn = conn
        #: why the path no longer names the open file (None: it does)
        self.lost: str | None = None
        #: told once, when `lost` is first found (from any thread)
        self.on_lost: Callable[[], None] | None = None
        #: where `save_copy` put the open file's records (None: nowhere yet)
        self.saved_to: str | None = None

    def check(self) -> str | None:
        """None while the path names the open file; else why not (found once, then kept)."""
        if self.lost is None and self.identity is not None:
            try:
                now = _identity(self.path)
            except OSError:  # cannot tell (a directory not searchable now): not lost
                return None
            if now == self.identity:
                return None
            how = "removed" if now is None else "replaced by another file"
            self.lost = (f"the job database {self.path} was {how} while the runner had it "
                         "open: what it records from here on is kept only in the open file")
            log.error("store: %s", self.lost)
            if self.on_lost is not None:
                self.on_lost()
        return self.lost

    def save_copy(self) -> str | None:
        """When lost: the open file's records, saved at the path (nothing there) or beside
        it (another file there), whole or not at all (a temporary file renamed); where.
        Called as the database closes; an error is logged and returned as None."""
        if self.check() is None or self.saved_to is not None:
            return self.saved_to
        target = str(self.path)
        if _identity(target) is not None:
            target = f"{self.path}.displaced-{time.time_ns() // 1_000_000}"
        tmp = f"{target}.saving"
        try:
            with contextlib.closing(sqlite3.connect(tmp)) as copy:
                self._conn.backup(copy)
            _fsync(tmp)
            os.rename(tmp, target)
            _fsync(os.path.dirname(target) or ".")
        except (OSError, sqlite3.Error) as exc:
            log.error("store: cannot save the open job database to %s: %s", target, exc)
            with contextlib.suppress(OSError):
                os.unlink(tmp)  # a part of a copy is no copy
            return None
        self.saved_to = target
        log.error("store: the open job database's records are saved to %s", target)
        return target

