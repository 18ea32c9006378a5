"""The store actor: every write of a job record or event goes through its inbox.

Group commit: when several saves (`Save`, `SaveMany`) wait in its inbox, the actor writes
them in order in ONE transaction and then answers each (one commit instead of one per save,
issue 14). If that transaction fails, it writes them again one message at a time, so each
caller gets its own answer (a `StoreFull` goes to the callers whose write did not fit).

Commits run on the event loop while the disk keeps up, in a worker thread while it does not
(`CommitPace`, motor/store/pace.py): once slow commits held the loop for 0.1 s within a
second, until none has been slow for 10 s. The loop then runs on while a commit waits on
the disk; saves arriving meanwhile wait in the inbox and are committed together after it.
A write that finds the database's write lock held by another connection (another process)
goes there too, at once, and waits for the lock (`StoreLocked`, db.py; docs/operations.md,
"When another process locks the database").

Readers (event replay, listings) read the database directly, each thread on a read
connection of its own (`Database.reader`): they never write, and SQLite in WAL mode gives
them a consistent snapshot of what was committed.
Followers of a job wait on `ChangeHub.changed(job_id)`, which the actor fires after each
commit for that job; the hub also keeps the events committed for a followed job, so a
follower that has read the database to its end takes the next ones from the hub
(`ChangeHub.recent`).
"""

from __future__ import annotations

import functools
import logging
import sqlite3
import time

import trio

import actors

from .. import faults
from ..offload import Offload, thread_offload
from .checkpoints import CheckpointPlan
from .db import LOCK_WAIT_MS, Database, StoreFull, StoreLocked, open_database
from .grouping import commit_group, run_inline
from .holds import WriteHold
from .hub import ChangeHub
from .lockwait import LockWait
from .messages import Expire, Save, SaveMany, answers_of, is_save, writes_of

__all__ = ["GROUP_MAX", "Expire", "Save", "SaveMany", "StoreActor", "open_database"]

log = logging.getLogger("motor.store")


#: at most this many waiting save messages are committed together with the current one
GROUP_MAX = 64


class StoreActor(actors.Actor):
    inbox_size = 256
    #: a write refused for lack of space was rolled back whole: the caller is told
    #: (and answers `runner_disk_full`), the store goes on serving
    replied_errors = (StoreFull, StoreLocked)

    def __init__(self, db: Database, hub: ChangeHub, offload: Offload = thread_offload):
        super().__init__(name="store")
        self.db = db
        self.hub = hub
        # for the checkpoints, and the commits while the disk is slow (the runner's clock's
        # offloader: see offload.py)
        self.offload = offload
        self.saves = 0
        self.pace = db.pace  # on the database: it outlives an incarnation of this actor
        self._checkpoint_due = trio.Event()
        self._plan = CheckpointPlan(db.commits, db.bytes_written)
        self._hold = WriteHold()  # while held, writes wait in the inbox (holds.py)
        #: saves taken from the inbox with a write that found the database locked on the
        #: loop (`handle_now` said LATER): `handle`, which runs next, writes them too
        self._retaken: list = []
        self._lock = LockWait(self.pace, log)  # another connection's write lock (lockwait.py)

    async def on_start(self):
        self.db.background_checkpoints()
        self.nursery.start_soon(self._checkpointer)

    async def _checkpointer(self):
        """The WAL's checkpoint rounds (checkpoints.py), through `offload` (a worker thread,
        off the event loop). A failed round is logged once until one succeeds (health shows
        it); the next is due after as many commits or bytes."""
        db, plan = self.db, self._plan
        while True:
            await self._checkpoint_due.wait()
            self._checkpoint_due = trio.Event()
            plan.begin(db.commits, db.bytes_written)
            failing = db.checkpoint_error is not None
            try:
                first = done = await self.offload(db.checkpoint)
                if plan.second_step(first.wal_frames, db.page_size):
                    self._hold.hold(self.nursery)
                    done = await self.offload(db.checkpoint)
            except sqlite3.Error:
                if not failing:
                    log.warning("store: %s", db.checkpoint_error)
                continue
            finally:
                held_s = self._hold.round_ended()
            db.checkpoints += 1
            db.last_checkpoint = {
                "ms": round((first.seconds + (done.seconds if done is not first else 0.0))
                            * 1000.0, 3),
                "writes_paused_ms": round(held_s * 1000.0, 3), "wal_frames": first.wal_frames,
                "complete": done.complete}

    #: a save to an idle store is written in the sender's task (no task switch)
    immediate = (Save, SaveMany)

    def handle_now(self, msg):
        if self._hold.event is not None:  # held for a checkpoint: wait in the inbox
            return actors.LATER
        if self.pace.place(trio.current_time()):  # the disk is slow: commit in a thread
            return actors.LATER
        waiting = self.take_waiting(is_save, GROUP_MAX)
        try:
            return run_inline(self._group(msg, waiting, False))
        except StoreLocked as exc:  # nothing written, nobody answered: in a thread, waiting
            self._lock.found(exc)
            self._retaken = waiting
            return actors.LATER

    async def handle(self, msg):
        if (held := self._hold.event) is not None:  # every message here writes
            await held.wait()
        off_loop = self.pace.place(trio.current_time())
        if is_save(msg):
            waiting, self._retaken = self._retaken, []
            waiting += self.take_waiting(is_save, GROUP_MAX - len(waiting))
            return await self._group(msg, waiting, off_loop)
        if isinstance(msg, Expire):  # in a worker thread: deletions are the disk's work
            expire = functools.partial(self.db.expire, lock_wait_ms=LOCK_WAIT_MS if off_loop else 0)
            try:
                ids = await self.offload(expire, msg.now_ms)
            except StoreLocked as exc:  # the next round deletes them
                self._lock.found(exc)
                return []
            self._lock.freed()
            for job_id in ids:
                self.hub.fire(job_id)
            if ids:  # deletions (and pages handed back) the byte count does not see
                self._checkpoint_due.set()
            return ids
        raise TypeError(f"store: unknown message {msg!r}")

    def _group(self, msg, waiting: list, off_loop: bool):
        """`msg` and the saves taken from the inbox in one transaction (grouping.py): a
        coroutine that, on the loop (`off_loop` false), never suspends."""
        return commit_group(lambda msgs: self._commit(msgs, off_loop), msg, waiting, log)

    async def _commit(self, msgs: list, off_loop: bool) -> list:
        """Write the saves of `msgs` in one transaction, in a worker thread when `off_loop`;
        each message's answer."""
        writes = [w for msg in msgs for w in writes_of(msg)]
        # on the loop timed on the runner's clock (real time in production; under a test's
        # clock a blocking commit takes none: the host's load moves no test off the loop),
        # in a thread timed there (not the hop back to a busy loop)
        self.pace.waiting_since = t0 = trio.current_time()
        try:
            if off_loop:  # waiting there for another connection's write lock, if held
                stamped, took = await self._lock.until_free(
                    lambda: self.offload(self._save_timed, writes))
            else:
                stamped, took = self._save(writes), None
        finally:
            self.pace.waiting_since = None
        self._lock.freed()
        now = trio.current_time()
        self.pace.took(now - t0 if took is None else took, now, off_loop)
        self.saves += len(writes)
        db = self.db
        if self._plan.committed(db.commits, db.bytes_written, db.wal_bytes()):
            if self._plan.wal_over:  # the rounds fall behind: the writes wait for one
                self._hold.hold(self.nursery)
            self._checkpoint_due.set()
        for write, events in zip(writes, stamped):
            if len(write) == 4:  # watchers index records; a clock alone changes none of that
                self.hub.saved(write[0])
            self.hub.committed(write[0].job_id, events)
            self.hub.fire(write[0].job_id)
        return answers_of(msgs, stamped)

    def _save(self, writes: list, lock_wait_ms: int = 0) -> list:
        """`Database.save_many`, on the loop or in a worker thread."""
        faults.hit("store.commit")  # tests: a commit held (a disk that stalls)
        return self.db.save_many(writes, lock_wait_ms)

    def _save_timed(self, writes: list) -> tuple[list, float]:
        t0 = time.perf_counter()
        return self._save(writes, LOCK_WAIT_MS), time.perf_counter() - t0
