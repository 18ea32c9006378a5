"""Group commit in the store actor (issue 14): the saves waiting in its inbox are written
in ONE transaction and each caller gets its own answer; if that transaction fails, each
message is written alone, so only the callers whose write failed get the error.

A real store actor on a real SQLite database; the saves are staged in its inbox in a
known order while the actor holds its first message until the test sets `go`."""

from __future__ import annotations

import trio
import trio.testing

from motor.handles import StoreHandle
from motor.records import Accepted, JobRecord
from motor.store.hub import ChangeHub
from motor.store.db import Database, StoreFull
from tests.store_helpers import GatedStore


class RefusingDatabase(Database):
    """The real database, except that a transaction saving job `refuse` fails as a full
    state filesystem would (nothing of it written)."""

    refuse: str | None = None

    def save_many(self, writes, *lock_wait):
        if any(w[0].job_id == self.refuse for w in writes):
            raise StoreFull("database or disk is full")
        return super().save_many(writes, *lock_wait)


def record(job_id: str) -> JobRecord:
    return JobRecord(job_id=job_id, state="queued", workspace="w", claim=1, command=["true"],
                     accepted_at_ms=0)


async def _save_all(actor: GatedStore, store: StoreHandle, ids) -> dict:
    """Each id's answer (`(id, index)` for an id saved twice): its stamped events or the
    StoreFull raised. They reach the inbox in the order of `ids` (the first is being
    handled, held until `go`)."""
    answers: dict = {}

    async def save(job_id, key):
        try:
            answers[key] = await store.save(record(job_id), [Accepted(job_id=job_id, claim=1)])
        except StoreFull as exc:
            answers[key] = exc

    actor.go = trio.Event()
    async with trio.open_nursery() as nursery:
        for i, job_id in enumerate(ids):
            nursery.start_soon(save, job_id, job_id if ids.count(job_id) == 1 else (job_id, i))
            await trio.testing.wait_all_tasks_blocked()
        actor.go.set()
    return answers


async def test_saves_waiting_together_are_committed_in_one_transaction(tmp_path):
    db = RefusingDatabase(tmp_path / "motor.db")
    async with trio.open_nursery() as nursery:
        actor = GatedStore(db, ChangeHub())
        store = StoreHandle(await nursery.start(actor.run))
        ids = [f"j{i}" for i in range(5)]
        answers = await _save_all(actor, store, ids)
        assert db.commits == 1
        assert all([e.seq for e in answers[j]] == [1] for j in ids)
        assert [r.job_id for r in db.live()] == ids
        answers = await _save_all(actor, store, ["j0", "j1", "j0"])  # j0 twice in one group
        assert db.commits == 2
        assert [e.seq for e in answers["j0", 0]] == [2]
        assert [e.seq for e in answers["j0", 2]] == [3]  # the later one: seqs follow on
        assert len(db.events_from("j0", 1)) == 3
        actor.stop()


async def test_a_failed_group_is_written_message_by_message(tmp_path):
    db = RefusingDatabase(tmp_path / "motor.db")
    async with trio.open_nursery() as nursery:
        actor = GatedStore(db, ChangeHub())
        store = StoreHandle(await nursery.start(actor.run))
        # the refused save is a taken message (a2), then the message handled first (b1)
        for ids, refused in ((["a1", "a2", "a3"], "a2"), (["b1", "b2", "b3"], "b1")):
            db.refuse = refused
            before = db.commits
            answers = await _save_all(actor, store, ids)
            assert isinstance(answers[refused], StoreFull)
            assert all([e.seq for e in answers[j]] == [1] for j in ids if j != refused)
            assert db.commits == before + 2  # the two others, each alone
        assert [r.job_id for r in db.live()] == ["a1", "a3", "b2", "b3"]
        actor.stop()
