"""Another connection holding the database's write lock (docs/operations.md, "When another
process locks the database"; through `motor serve`: tests/e2e/test_locked_database_serve.py).

The rule, pure (`CommitPace`), then a real store actor on a real SQLite database on trio's
real clock: a second connection runs `BEGIN EXCLUSIVE`, as an sqlite3 shell left in a write
transaction does. A write on the event loop never waits for that lock: it goes to a worker
thread and waits there, saves arriving meanwhile wait with it, and each is answered once
the lock is free.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading

import pytest
import trio
import trio.testing

import actors
import motor
from motor import handles
from motor.handles import DispatcherHandle, StoreHandle
from motor.records import Accepted, JobRecord, JobRequest, RefusedError
from motor.store import actor as store_actor
from motor.store.actor import StoreActor
from motor.store.db import Database, StoreLocked
from motor.store.grouping import commit_group
from motor.store.hub import ChangeHub
from motor.store.pace import CALM_S, CommitPace
from tests.store_helpers import GatedStore


def record(job_id: str) -> JobRecord:
    return JobRecord(job_id=job_id, state="queued", workspace="w", claim=1, command=["true"],
                     accepted_at_ms=0)


# -- the rule ------------------------------------------------------------------------------


def test_a_held_write_lock_keeps_the_commits_off_the_loop_until_calm_after_it_is_free():
    pace = CommitPace()
    pace.locked(5.0)
    assert pace.off_loop and pace.locked_since == 5.0 and pace.moves_off_loop == 1
    assert pace.place(5.0 + 3 * CALM_S) is True  # held for longer than the calm: still off
    pace.locked(5.0 + 3 * CALM_S)
    assert pace.locked_since == 5.0 and pace.locked_writes == 2 and pace.moves_off_loop == 1
    assert pace.unlocked() == 5.0 and pace.locked_since is None
    assert pace.unlocked() is None
    assert pace.place(5.0 + 4 * CALM_S - 0.001) is True  # the calm counts from the last one
    assert pace.place(5.0 + 4 * CALM_S) is False


async def test_a_locked_group_is_raised_whole_and_no_waiting_save_is_answered():
    """One attempt, the group whole: not written again message by message (each would find
    the same lock), and no waiting save answered (the store writes them all again, off the
    loop)."""
    answered, attempts = [], []

    class Token:
        def reply(self, answer):
            answered.append(answer)

        def fail(self, exc):
            answered.append(exc)

    async def commit(msgs):
        attempts.append(list(msgs))
        raise StoreLocked("another connection holds the database's write lock")

    with pytest.raises(StoreLocked):
        await commit_group(commit, "a", [("b", Token()), ("c", None)], store_actor.log)
    assert attempts == [["a", "b", "c"]] and answered == []


# -- a real store actor --------------------------------------------------------------------


class ThreadNotingDatabase(Database):
    """The real database; notes the thread of each write attempt."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.threads: list[int] = []

    def save_many(self, writes, *lock_wait):
        self.threads.append(threading.get_ident())
        return super().save_many(writes, *lock_wait)


@contextlib.contextmanager
def write_lock_held(db: Database):
    """Another connection holding the database's write lock for the block."""
    other = sqlite3.connect(db.path, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    try:
        yield
    finally:
        other.execute("COMMIT")
        other.close()


async def until(predicate, what: str) -> None:
    """Bounded polling of what threads and a real clock move (fails naming `what`)."""
    with trio.move_on_after(10):
        while not predicate():
            await trio.sleep(0.005)
        return
    raise AssertionError(f"timed out waiting for {what}")


async def test_a_write_that_finds_the_lock_held_waits_for_it_in_a_thread(tmp_path, monkeypatch):
    monkeypatch.setattr(store_actor, "LOCK_WAIT_MS", 50)  # each attempt in the thread
    loop_thread = threading.get_ident()
    db = ThreadNotingDatabase(tmp_path / "motor.db")
    async with trio.open_nursery() as nursery:
        store = StoreHandle(await nursery.start(StoreActor(db, ChangeHub()).run))
        await store.save(record("a0"))
        done = []

        async def save(job_id):
            events = await store.save(record(job_id), [Accepted(job_id=job_id, claim=1)])
            done.append((job_id, [e.seq for e in events]))

        with write_lock_held(db):
            nursery.start_soon(save, "a1")
            await until(lambda: db.pace.locked_since is not None, "a1 to find the lock")
            nursery.start_soon(save, "a2")
            await until(lambda: len(db.threads) >= 4, "attempts in the thread")
            # the loop runs (this task does), nothing is answered, reads see what was there
            assert done == [] and db.get("a0") is not None and db.get("a1") is None
            assert db.pace.off_loop and db.pace.waiting_s(trio.current_time()) > 0
        await until(lambda: len(done) == 2, "both saves to be answered")
        assert done == [("a1", [1]), ("a2", [1])]
        assert db.get("a1") is not None and db.get("a2") is not None
        assert db.threads[1] == loop_thread  # a1's first attempt, on the loop, did not wait
        assert all(t != loop_thread for t in db.threads[2:])
        assert db.pace.locked_since is None and db.pace.locked_writes >= 2
        nursery.cancel_scope.cancel()
    db.close()


async def test_saves_taken_with_a_write_that_found_the_lock_are_written_with_it(
        tmp_path, monkeypatch):
    monkeypatch.setattr(store_actor, "LOCK_WAIT_MS", 50)
    db = ThreadNotingDatabase(tmp_path / "motor.db")
    async with trio.open_nursery() as nursery:
        actor = GatedStore(db, ChangeHub())
        store = StoreHandle(await nursery.start(actor.run))
        answers = {}

        async def save(job_id):
            events = await store.save(record(job_id), [Accepted(job_id=job_id, claim=1)])
            answers[job_id] = [e.seq for e in events]

        with write_lock_held(db):
            for job_id in ("b0", "b1", "b2"):  # b0 held at `go`, b1 and b2 in the inbox
                nursery.start_soon(save, job_id)
                await trio.testing.wait_all_tasks_blocked()
            actor.go.set()
            await until(lambda: len(db.threads) >= 2, "the group to wait in the thread")
            assert answers == {}
        await until(lambda: len(answers) == 3, "every save to be answered")
        assert answers == {"b0": [1], "b1": [1], "b2": [1]}
        assert db.commits == 1  # the three together, in one transaction
        assert [r.job_id for r in db.live()] == ["b0", "b1", "b2"]
        nursery.cancel_scope.cancel()
    db.close()


async def test_an_expiry_that_finds_the_lock_held_deletes_nothing_and_the_store_serves_on(
        tmp_path):
    db = Database(tmp_path / "motor.db")
    async with trio.open_nursery() as nursery:
        store = StoreHandle(await nursery.start(StoreActor(db, ChangeHub()).run))
        ended = JobRecord(job_id="c0", state="succeeded", workspace="w", claim=1,
                          command=["true"], accepted_at_ms=0)
        await store.save(ended, retain_until_ms=5)
        with write_lock_held(db):
            assert await store.expire(10) == []  # the next round deletes it
            assert db.pace.locked_since is not None and db.get("c0") is not None
        assert await store.expire(10) == ["c0"]
        assert db.get("c0") is None and db.pace.locked_since is None
        nursery.cancel_scope.cancel()
    db.close()


def test_an_expiry_whose_page_reclaim_finds_the_lock_keeps_its_deletions(tmp_path, monkeypatch):
    db = Database(tmp_path / "motor.db")
    ended = JobRecord(job_id="d0", state="succeeded", workspace="w", claim=1,
                      command=["true"], accepted_at_ms=0)
    db.save(ended, retain_until_ms=5)

    def reclaim():
        raise StoreLocked("cannot hand free pages back: another connection holds the lock")

    monkeypatch.setattr(db, "reclaim", reclaim)
    assert db.expire(10) == ["d0"]  # committed before the reclaim: reported, not lost
    assert db.get("d0") is None
    db.close()


class Waiting(actors.Actor):
    """Answers each call (True) once `go` is set: a store or dispatcher at work on it."""

    def __init__(self):
        super().__init__(name="waiting")
        self.go = trio.Event()

    async def handle(self, msg):
        await self.go.wait()
        return True


@pytest.mark.parametrize("call", [
    lambda ref: StoreHandle(ref).save(record("e0")),
    lambda ref: StoreHandle(ref).save_many([(record("e0"), (), None, None)]),
    lambda ref: DispatcherHandle(ref).finished("e0"),
], ids=["save", "save_many", "finished"])
async def test_a_save_or_a_jobs_end_waits_as_long_as_its_actor_works_on_it(autojump_clock, call):
    """No timeout: the call is being carried out (a write waiting for the lock, a dispatcher
    waiting on that write), and a caller that gave up would act as if it were not (before
    stop 50 these gave up after 30 s: a dispatcher restarted without a job accepted after,
    a job actor ended its job twice)."""
    async with trio.open_nursery() as nursery:
        actor = Waiting()
        ref = await nursery.start(actor.run)
        answered = []

        async def caller():
            answered.append(await call(ref))

        nursery.start_soon(caller)
        await trio.sleep(3600)  # virtual: an hour of a held lock
        assert answered == []
        actor.go.set()
        await trio.testing.wait_all_tasks_blocked()
        assert answered == [True]
        nursery.cancel_scope.cancel()


async def test_a_submit_not_confirmed_in_time_says_it_may_still_be_accepted_and_it_runs(
        tmp_path, monkeypatch):
    """A submit whose acceptance waits past its caller's wait (SUBMIT_TIMEOUT_S, 330 s in
    production; here 0.5 s) is answered `submit_unconfirmed`, not `internal_error`, and the
    job is accepted once the lock is free and runs (an embedded runner, real time)."""
    monkeypatch.setattr(handles, "SUBMIT_TIMEOUT_S", 0.5)
    monkeypatch.setattr(store_actor, "LOCK_WAIT_MS", 50)
    config = motor.RunnerConfig(state_dir=str(tmp_path / "state"), isolation="none",
                                free_space_floor_bytes=0)
    async with motor.open_runner(config) as runner:
        with write_lock_held(runner.db):
            with pytest.raises(RefusedError) as refused:
                await runner.submit(JobRequest(command=["echo", "late"], workspace="w"))
            assert refused.value.refusal.code == "submit_unconfirmed"
            assert "may still be accepted" in refused.value.refusal.detail
        await until(lambda: [r.state for r in runner.db.listing()] == ["succeeded"],
                    "the job accepted after the lock to run")
