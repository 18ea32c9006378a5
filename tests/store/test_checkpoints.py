"""WAL checkpoints off the event loop (issue 14, stop 26; motor/store/db.py "Checkpoints").

A commit no longer checkpoints the WAL (two fdatasyncs on the thread that commits, which in
the runner is the event loop's); the store actor runs the checkpoints in a worker thread,
one round per CHECKPOINT_EVERY commits or CHECKPOINT_BYTES written: a step while commits
go on and, once the WAL has grown past WAL_RESTART_BYTES without starting over, a second
one with the saves held in its inbox, so that the WAL starts over.

A real store actor on a real SQLite database, on trio's real clock (the checkpoints run in
real threads); the final step is held at a threading barrier to stage saves against it.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading

import pytest
import trio
import trio.testing

from motor.handles import StoreHandle
from motor.records import Accepted, JobRecord, Output
from motor.store import checkpoints, holds
from motor.store.actor import StoreActor
from motor.store.checkpoints import CheckpointPlan
from motor.store.db import Database
from motor.store.hub import ChangeHub


def record(job_id: str, size: int = 3000) -> JobRecord:
    """A record of about `size` bytes (a commit of it writes a page or two)."""
    return JobRecord(job_id=job_id, state="queued", workspace="w", claim=1,
                     command=["true", "x" * size], accepted_at_ms=0)


def wal_frames(path) -> int:
    """Frames in the database's WAL now, as another connection sees them."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        return conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()[1]
    finally:
        conn.close()


def wal_file_frames(path) -> int:
    """Frames the WAL file has room for (its size): the frames written while the WAL was
    never started over (reading it checkpoints nothing, unlike `wal_frames`)."""
    return max(0, (os.path.getsize(f"{path}-wal") - 32) // (4096 + 24))


class ThreadedDatabase(Database):
    """The real database, noting the thread of each checkpoint and holding checkpoint
    number `hold` (1: a round's first step, 2: its final step) until `release` is set."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.threads: list[int] = []
        self.saved: list[str] = []  # job ids in commit order
        self.hold = 0
        self.held, self.release = threading.Event(), threading.Event()

    def checkpoint(self):
        self.threads.append(threading.get_ident())
        if len(self.threads) == self.hold:
            self.held.set()
            assert self.release.wait(30)
        return super().checkpoint()

    def save_many(self, writes, *lock_wait):
        result = super().save_many(writes, *lock_wait)
        self.saved.extend(w[0].job_id for w in writes)
        return result


@contextlib.asynccontextmanager
async def running_store(tmp_path, hold: int = 0):
    """A store actor on a `ThreadedDatabase` (holding its checkpoint number `hold`);
    yields (db, store handle, nursery); stops it and closes the database."""
    db = ThreadedDatabase(tmp_path / "motor.db")
    db.hold = hold
    async with trio.open_nursery() as nursery:
        store = StoreHandle(await nursery.start(StoreActor(db, ChangeHub()).run))
        yield db, store, nursery
        nursery.cancel_scope.cancel()
    db.close()


@contextlib.asynccontextmanager
async def a_held_second_step(tmp_path, monkeypatch):
    """A store actor whose first round (after 4 saves, always in two steps) is held in its
    second step, the writes held; yields (db, store handle, nursery), closes the database."""
    monkeypatch.setattr(checkpoints, "CHECKPOINT_EVERY", 4)
    monkeypatch.setattr(checkpoints, "WAL_RESTART_BYTES", 0)
    async with running_store(tmp_path, hold=2) as (db, store, nursery):
        for i in range(4):
            await store.save(record(f"a{i}"))
        await trio.to_thread.run_sync(db.held.wait, 30)  # the second step, held
        yield db, store, nursery


async def _until(predicate, timeout: float = 30) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.01)


def test_commits_leave_the_checkpoints_to_the_caller(tmp_path):
    """`background_checkpoints`: no commit copies the WAL back (it grows past SQLite's
    1,000-page interval); `checkpoint` does, from another thread, and reports it."""
    db = Database(tmp_path / "motor.db")
    db.background_checkpoints()
    assert db.conn.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 0
    for i in range(700):
        db.save(record(f"j{i}"))
    frames = wal_frames(tmp_path / "motor.db")
    assert frames > 1000  # with the default every commit past 1,000 pages checkpoints

    got = []
    thread = threading.Thread(target=lambda: got.append(db.checkpoint()))
    thread.start()
    thread.join()
    [result] = got
    assert result.busy == 0 and result.wal_frames >= frames and result.complete
    assert db.checkpoint_error is None
    db.close()


def test_a_failed_checkpoint_is_recorded_and_raised(tmp_path):
    db = Database(tmp_path / "motor.db")
    db.path = tmp_path / "gone" / "motor.db"  # its connection cannot be opened
    with pytest.raises(sqlite3.OperationalError):
        db.checkpoint()
    assert "WAL checkpoint of" in db.checkpoint_error and "unable to open" in db.checkpoint_error
    db.path = tmp_path / "motor.db"
    assert db.checkpoint().complete and db.checkpoint_error is None
    db.close()


async def test_a_round_holds_no_write_and_an_idle_moment_starts_the_wal_over(
        tmp_path, monkeypatch):
    """A round after CHECKPOINT_EVERY commits, in a worker thread; below WAL_RESTART_BYTES
    it is one step, no save waits for it, and when no commit came during it the next commit
    starts the WAL over."""
    monkeypatch.setattr(checkpoints, "CHECKPOINT_EVERY", 8)
    async with running_store(tmp_path) as (db, store, nursery):
        for i in range(8):
            await store.save(record(f"j{i}"))
        await _until(lambda: db.checkpoints == 1)
        assert len(db.threads) == 1 and threading.get_ident() not in db.threads
        assert db.last_checkpoint["writes_paused_ms"] == 0 and db.last_checkpoint["complete"]
        assert wal_file_frames(tmp_path / "motor.db") >= 8
        await store.save(record("j8"))
        assert wal_frames(tmp_path / "motor.db") <= 8  # that one commit's pages alone


async def test_a_busy_wal_past_its_bound_is_started_over_with_the_writes_held(
        tmp_path, monkeypatch):
    """Commits go on during a round's first step (held here while 12 more are written):
    they keep the WAL from starting over. Once it holds WAL_RESTART_BYTES (here: always) a
    second step copies them with the saves held, so the round completes and the next
    commit starts the WAL over (without it a busy runner's WAL would only grow)."""
    monkeypatch.setattr(checkpoints, "CHECKPOINT_EVERY", 16)
    monkeypatch.setattr(checkpoints, "WAL_RESTART_BYTES", 0)
    async with running_store(tmp_path, hold=1) as (db, store, nursery):
        for i in range(15):
            await store.save(record(f"j{i}"))
        assert db.threads == [] and wal_file_frames(tmp_path / "motor.db") >= 15
        await store.save(record("j15"))  # the 16th commit: a round
        await trio.to_thread.run_sync(db.held.wait, 30)  # its first step, held
        for i in range(16, 28):  # commits go on meanwhile (fewer than a round's worth)
            await store.save(record(f"j{i}"))
        assert db.commits == 28
        db.release.set()
        await _until(lambda: db.checkpoints == 1)
        assert len(db.threads) == 2 and threading.get_ident() not in db.threads
        assert db.last_checkpoint["complete"] and db.last_checkpoint["wal_frames"] >= 16
        frames = wal_file_frames(tmp_path / "motor.db")
        assert frames >= 28
        await store.save(record("j28"))  # the next commit starts the WAL over
        assert wal_frames(tmp_path / "motor.db") <= 8  # that one commit's pages alone
        assert wal_file_frames(tmp_path / "motor.db") == frames  # (the file is reused)


async def test_saves_during_the_final_step_wait_in_order_and_the_loop_runs_on(
        tmp_path, monkeypatch):
    """While a round's final step runs, saves wait in the store's inbox (nothing is
    committed, the event loop serves other tasks), then are committed in arrival order."""
    async with a_held_second_step(tmp_path, monkeypatch) as (db, store, nursery):
        commits = db.commits
        done = []

        async def save(job_id):
            await store.save(record(job_id), [Accepted(job_id=job_id, claim=1)])
            done.append(job_id)

        for job_id in ("b0", "b1", "b2"):
            nursery.start_soon(save, job_id)
            await trio.testing.wait_all_tasks_blocked()
        ticks = 0
        for _ in range(5):  # the loop is not blocked: other tasks run
            await trio.sleep(0.01)
            ticks += 1
        assert ticks == 5 and done == [] and db.commits == commits
        db.release.set()
        await _until(lambda: len(done) == 3)
        assert db.saved[-3:] == ["b0", "b1", "b2"] and db.checkpoints == 1
        assert db.last_checkpoint["complete"]
        assert all(db.get(j) is not None and len(list(db.events_from(j, 0))) == 1
                   for j in ("b0", "b1", "b2"))
    assert not os.path.exists(tmp_path / "motor.db-wal")  # the last close checkpointed it


async def test_a_round_also_comes_after_as_many_bytes_written(tmp_path, monkeypatch):
    """Large saves (a job's output in batches) checkpoint by the bytes they wrote, long
    before CHECKPOINT_EVERY commits: the WAL stays near CHECKPOINT_BYTES, not 128 batches."""
    monkeypatch.setattr(checkpoints, "CHECKPOINT_BYTES", 1024 * 1024)  # (the default)
    async with running_store(tmp_path) as (db, store, nursery):
        await store.save(record("j", 100), [Output(stream="stdout", data="x" * 400_000)])
        await store.save(record("j", 100), [Output(stream="stdout", data="y" * 400_000)])
        assert db.bytes_written > 800_000 and db.threads == []
        await store.save(record("j", 100), [Output(stream="stdout", data="z" * 400_000)])
        await _until(lambda: db.checkpoints == 1)
        assert db.commits == 3 and db.last_checkpoint["complete"]


def test_the_plan_counts_commits_and_bytes_and_holds_past_the_bound():
    plan = CheckpointPlan(commits_at=10, written_at=1000)
    assert not plan.committed(10 + checkpoints.CHECKPOINT_EVERY - 1, 1000, 0)
    assert plan.committed(10 + checkpoints.CHECKPOINT_EVERY, 1000, 0) and not plan.wal_over
    assert plan.committed(11, 1000 + checkpoints.CHECKPOINT_BYTES, 0)
    assert not plan.committed(11, 1001, checkpoints.WAL_HOLD_BYTES) and not plan.wal_over
    assert plan.committed(11, 1001, checkpoints.WAL_HOLD_BYTES + 1) and plan.wal_over
    assert plan.second_step(0, 4096)  # past the bound: always the second step
    plan.committed(11, 1001, 0)
    plan.begin(11, 1001)
    assert (plan.commits_at, plan.written_at) == (11, 1001)
    assert not plan.second_step(checkpoints.WAL_RESTART_BYTES // 4096 - 1, 4096)
    assert plan.second_step(checkpoints.WAL_RESTART_BYTES // 4096, 4096)


def test_a_wal_past_its_stuck_size_after_an_incomplete_round_is_stuck():
    """Only a WAL far past its bound AND a round that left part of it uncopied (a reader's
    snapshot) reads as held from starting over; a big WAL after a complete round (a burst
    the next commit starts over) or before any round does not."""
    big, small = checkpoints.WAL_STUCK_BYTES + 1, checkpoints.WAL_STUCK_BYTES
    assert checkpoints.wal_stuck(big, {"complete": False})
    assert not checkpoints.wal_stuck(small, {"complete": False})
    assert not checkpoints.wal_stuck(big, {"complete": True})
    assert not checkpoints.wal_stuck(big, None)


async def test_writes_wait_for_a_round_when_the_wal_file_outgrows_its_bound(
        tmp_path, monkeypatch):
    """Rounds that fall behind (here: the first step held) do not let the WAL grow on: a
    commit that finds the WAL file past WAL_HOLD_BYTES holds the writes until a round has
    run in two steps; then they are committed, in order, and the WAL starts over."""
    monkeypatch.setattr(checkpoints, "CHECKPOINT_EVERY", 1000)
    monkeypatch.setattr(checkpoints, "CHECKPOINT_BYTES", 1 << 30)
    monkeypatch.setattr(checkpoints, "WAL_HOLD_BYTES", 256 * 1024)
    async with running_store(tmp_path, hold=1) as (db, store, nursery):
        # the size a WAL started over is truncated back to: the bound (as WAL_SIZE_LIMIT is)
        db.conn.execute(f"PRAGMA journal_size_limit={256 * 1024}")
        i = 0
        while db.wal_bytes() <= 256 * 1024:  # about 80 commits of a 3 kB record
            await store.save(record(f"a{i}"))
            i += 1
        await trio.to_thread.run_sync(db.held.wait, 30)  # the round it asked for, held
        commits, done = db.commits, []

        async def save(job_id):
            await store.save(record(job_id))
            done.append(job_id)

        for job_id in ("b0", "b1"):
            nursery.start_soon(save, job_id)
            await trio.testing.wait_all_tasks_blocked()
        assert done == [] and db.commits == commits  # held, the loop running
        db.release.set()
        await _until(lambda: len(done) == 2)
        assert db.saved[-2:] == ["b0", "b1"] and len(db.threads) == 2
        assert db.last_checkpoint["complete"] and db.last_checkpoint["writes_paused_ms"] > 0
        assert wal_frames(tmp_path / "motor.db") <= 8  # started over by b0's commit
        assert db.wal_bytes() <= 256 * 1024  # and its file truncated back to the bound


async def test_a_hold_lasts_at_most_hold_max_s_however_long_the_checkpoint_takes(
        tmp_path, monkeypatch):
    """A disk whose sync stalls (here: the second step held) holds the writes HOLD_MAX_S at
    most: then they go on while the checkpoint still runs, no new hold comes in that round
    (callers wait for a save with a 30 s timeout), and the round's end counts the hold."""
    monkeypatch.setattr(holds, "HOLD_MAX_S", 0.3)
    async with a_held_second_step(tmp_path, monkeypatch) as (db, store, nursery):
        monkeypatch.setattr(checkpoints, "CHECKPOINT_EVERY", 100)  # no next round
        t0 = trio.current_time()
        for i in range(6):  # held for at most 0.3 s, then written although it is stuck
            await store.save(record(f"b{i}"))
        assert 0.25 <= trio.current_time() - t0 < 5 and db.checkpoints == 0
        assert db.saved[-6:] == [f"b{i}" for i in range(6)]
        db.release.set()
        await _until(lambda: db.checkpoints == 1)
        assert 250 <= db.last_checkpoint["writes_paused_ms"] < 5000
