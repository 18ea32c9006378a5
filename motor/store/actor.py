"""The store actor: every write of a job record or event goes through its inbox.

Group commit: when several saves (`Save`, `SaveMany`) wait in its inbox, the actor writes
them in order in ONE transaction and then answers each (one commit instead of one per save,
issue 14). If that transaction fails, it writes them again one message at a time, so each
caller gets its own answer (a `StoreFull` goes to the callers whose write did not fit).

Readers (event replay, listings) read the database directly: they never write, and
SQLite in WAL mode gives them a consistent snapshot. Followers of a job wait on
`ChangeHub.changed(job_id)`, which the actor fires after each commit for that job; the hub
also keeps the events committed for a followed job, so a follower that has read the
database to its end takes the next ones from the hub (`ChangeHub.recent`).
"""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

import trio

import actors

from ..offload import Offload, thread_offload
from .checkpoints import CheckpointPlan
from .db import Database, StoreFull
from .holds import WriteHold
from .hub import ChangeHub
from .messages import Expire, Save, SaveMany, is_save, writes_of

__all__ = ["GROUP_MAX", "Expire", "Save", "SaveMany", "StoreActor", "open_database"]

log = logging.getLogger("motor.store")


#: at most this many waiting save messages are committed together with the current one
GROUP_MAX = 64


class StoreActor(actors.Actor):
    inbox_size = 256
    #: a write refused for lack of space was rolled back whole: the caller is told
    #: (and answers `runner_disk_full`), the store goes on serving
    replied_errors = (StoreFull,)

    def __init__(self, db: Database, hub: ChangeHub, offload: Offload = thread_offload):
        super().__init__(name="store")
        self.db = db
        self.hub = hub
        self.offload = offload  # for the checkpoints (the runner's clock's: see offload.py)
        self.saves = 0
        self._checkpoint_due = trio.Event()
        self._plan = CheckpointPlan(db.commits, db.bytes_written)
        self._hold = WriteHold()  # while held, writes wait in the inbox (holds.py)

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
        return self._group(msg, self.take_waiting(is_save, GROUP_MAX))

    async def handle(self, msg):
        if (held := self._hold.event) is not None:  # every message here writes
            await held.wait()
        if is_save(msg):
            return self._group(msg, self.take_waiting(is_save, GROUP_MAX))
        if isinstance(msg, Expire):
            ids = self.db.expire(msg.now_ms)
            for job_id in ids:
                self.hub.fire(job_id)
            if ids:  # deletions (and pages handed back) the byte count does not see
                self._checkpoint_due.set()
            return ids
        raise TypeError(f"store: unknown message {msg!r}")

    def _group(self, msg, waiting: list):
        """Commit `msg` and the save messages taken from the inbox in one transaction, then
        answer the taken ones; return the answer to `msg`. If it fails, one at a time."""
        if not waiting:
            return self._commit([msg])[0]
        try:
            answers = self._commit([msg, *(m for m, _ in waiting)])
        except Exception:
            return self._one_by_one(msg, waiting)
        for (_, token), answer in zip(waiting, answers[1:]):
            if token is not None:
                token.reply(answer)
        return answers[0]

    def _one_by_one(self, msg, waiting: list):
        """The group failed (nothing of it was written): each message in its own
        transaction, in order, so each caller gets its own answer."""
        try:
            own, refused = self._commit([msg])[0], None
        except StoreFull as exc:
            own, refused = None, exc
        for other, token in waiting:
            try:
                answer = self._commit([other])[0]
            except StoreFull as exc:
                if token is not None:
                    token.fail(exc)
                else:
                    log.warning("store: cast %r failed: %r", other, exc)
                continue
            if token is not None:
                token.reply(answer)
        if refused is not None:
            raise refused
        return own

    def _commit(self, msgs: list) -> list:
        """Write the saves of `msgs` in one transaction; each message's answer."""
        writes = [w for msg in msgs for w in writes_of(msg)]
        stamped = self.db.save_many(writes)
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
        answers, at = [], 0
        for msg in msgs:
            if isinstance(msg, SaveMany):
                answers.append(stamped[at:at + len(msg.saves)])
                at += len(msg.saves)
            else:
                answers.append(stamped[at])
                at += 1
        return answers


def open_database(state_dir: Path, *, max_output_bytes: int | None = None,
                  check: bool = True) -> Database:
    return Database(state_dir / "motor.db", max_output_bytes=max_output_bytes, check=check)
