"""Another connection's write lock on the job database, as the store actor's writes find it
(docs/operations.md, "When another process locks the database").

A write on the event loop never waits for that lock (`StoreLocked`, db.py): the store actor
then writes in a worker thread, where each attempt waits up to LOCK_WAIT_MS for the lock,
and tries again for as long as it is held. `LockWait` keeps what the runner says of it:
the pace's record (health, /metrics) and one log line when the lock is first found and one
when it is free again.
"""

from __future__ import annotations

import logging
from typing import Awaitable, Callable, TypeVar

import trio

from .db import StoreLocked
from .pace import CommitPace

__all__ = ["LockWait"]

T = TypeVar("T")


class LockWait:
    def __init__(self, pace: CommitPace, log: logging.Logger):
        self.pace = pace
        self.log = log

    def found(self, exc: StoreLocked) -> None:
        """A write found the lock held (nothing of it written)."""
        if self.pace.locked_since is None:
            self.log.warning("store: %s; the writes wait for it in a worker thread, and "
                             "health says so", exc)
        self.pace.locked(trio.current_time())

    def freed(self) -> None:
        """A write got the lock."""
        if (since := self.pace.unlocked()) is not None:
            self.log.warning("store: the database's write lock is free again after %.1f s",
                             trio.current_time() - since)

    async def until_free(self, attempt: Callable[[], Awaitable[T]]) -> T:
        """`attempt()` (a write in a worker thread that waits for the lock a while), again
        for as long as it finds the lock held."""
        while True:
            try:
                return await attempt()
            except StoreLocked as exc:
                self.found(exc)
