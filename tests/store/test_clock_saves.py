"""Queue-wait clocks saved alone (issue 14, docs/scheduling.md "Store cost per job").

The dispatcher persists the clock of every job queued in a workspace each time one starts
or ends there. Such a save writes only the clock fields into the `clocks` table
(store/db.py); every read of a record overlays them, and a full save of the job deletes
them in the same transaction. These tests read the real database file: the stale record
blob next to the newer clock row, the restart that resumes from the row, the full save
that wins, and a database made before the table existed.
"""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import msgspec
import pytest
import trio

import motor
from motor.records import JobRecord, JobRequest
from motor.store.db import Database
from runner_helpers import barrier_job, embedded_config, poll_until, terminal_of

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "state_v1"


async def _wait_until(predicate, what: str, timeout: float = 600):
    await poll_until(predicate, timeout)  # virtual seconds under MockClock


def _blob(db: Database, job_id: str) -> JobRecord:
    """The record as its last full save wrote it (no clock row overlaid)."""
    (raw,) = db.conn.execute("SELECT record FROM jobs WHERE job_id=?", (job_id,)).fetchone()
    return msgspec.json.decode(raw, type=JobRecord)


def _clock_row(db: Database, job_id: str):
    return db.conn.execute(
        "SELECT queue_wait_ms, queue_clock_at_ms, queue_clock_running, ready_at_ms,"
        " budget_enforced_by FROM clocks WHERE job_id=?", (job_id,)).fetchone()


async def test_a_clock_saved_alone_survives_a_restart_and_resumes_exactly(tmp_path, autojump_clock):
    """x and y of workspace `a` wait for capacity (max_weight 1) behind a job of `blk`:
    their clocks advance. When `blk` ends, x starts and y's clock pauses behind its
    workspace's owner: that pause is written as a clock row, the record blob still says
    advancing since acceptance. The runner stops for 30 s with x running; the restarted
    one adopts x and resumes y paused at exactly the saved value (read from the blob it
    would have resumed advancing, downtime included), then y ends with that value."""
    go_blk, go_x = tmp_path / "go-blk", tmp_path / "go-x"
    cfg = embedded_config(tmp_path, max_weight=1)
    async with motor.open_runner(cfg) as runner:
        blk = await runner.submit(barrier_job(go_blk, weight_hint=1, workspace="blk"))
        await _wait_until(lambda: runner.db.get(blk.job_id).state == "running", "blk to run")
        x = await runner.submit(barrier_job(go_x, weight_hint=1, workspace="a"))
        y = await runner.submit(JobRequest(command=["true"], weight_hint=1, workspace="a"))
        await trio.sleep(20)
        assert runner.db.get(y.job_id).queue_clock_running
        go_blk.write_text("")  # x starts; y's clock pauses behind x
        await _wait_until(lambda: not runner.db.get(y.job_id).queue_clock_running,
                          "y's pause to be persisted")
        saved = runner.db.get(y.job_id)
        assert saved.state == "queued" and saved.queue_wait_ms >= 20_000
        blob = _blob(runner.db, y.job_id)  # the cheap path left the record as accepted
        assert blob.queue_clock_running and blob.queue_wait_ms == 0
        assert _clock_row(runner.db, y.job_id) == (
            saved.queue_wait_ms, saved.queue_clock_at_ms, 0, saved.ready_at_ms, "runner")
        assert saved.ready_at_ms == saved.accepted_at_ms == blob.ready_at_ms
        await _wait_until(lambda: runner.db.get(x.job_id).state == "running", "x to run")
        value = saved.queue_wait_ms
    await trio.sleep(30)  # the runner is down
    async with motor.open_runner(cfg) as runner:
        resumed = await runner.get(y.job_id)
        assert resumed.state == "queued" and resumed.queue_wait_ms == value
        stored = runner.db.get(y.job_id)  # the course held: recovery rewrote nothing
        assert (stored.queue_wait_ms, stored.queue_clock_at_ms, stored.queue_clock_running) \
            == (value, saved.queue_clock_at_ms, False)
        await trio.sleep(10)
        assert (await runner.get(y.job_id)).queue_wait_ms == value  # still paused
        go_x.write_text("")
        record = await terminal_of(runner, y.job_id)
        assert record["state"] == "succeeded" and record["queue_wait_ms"] == value
        assert (await terminal_of(runner, x.job_id))["state"] == "succeeded"
        assert runner.db.conn.execute("SELECT count(*) FROM clocks").fetchone() == (0,)


def _queued(job_id: str = "01a22f82-0000-7000-8000-000000000001", **kw) -> JobRecord:
    base = dict(job_id=job_id, state="queued", command=["true"], workspace="a", claim=1,
                accepted_at_ms=1_000, queued_at_ms=1_000, ready_at_ms=1_000,
                queue_clock_at_ms=1_000, queue_clock_running=True, queue_wait_ms=0)
    base.update(kw)
    return JobRecord(**base)


def test_a_full_save_after_a_clock_save_wins(tmp_path):
    db = Database(tmp_path / "motor.db")
    record = _queued()
    db.save(record)
    paused = msgspec.structs.replace(record, queue_wait_ms=4_000, queue_clock_at_ms=5_000,
                                     queue_clock_running=False, budget_enforced_by="runner")
    assert db.save_many([(paused, (), None, None, True)]) == [[]]
    assert db.get(record.job_id) == paused
    assert _blob(db, record.job_id) == record  # the record itself was not written
    assert db.live() == [paused] and db.listing() == [paused]
    assert db.listing(terminal=False) == [paused]

    # a full save (the requeue of a failed start, say) carries its own clock: it wins, in
    # the same transaction as a later clock of another job
    other = _queued("01a22f82-0000-7000-8000-000000000002")
    db.save(other)
    requeued = msgspec.structs.replace(record, queue_wait_ms=6_000, queue_clock_at_ms=9_000,
                                       queue_clock_running=True, attempts=1)
    other_clock = msgspec.structs.replace(other, queue_wait_ms=1, queue_clock_at_ms=9_000)
    db.save_many([(requeued, (), None, None), (other_clock, (), None, None, True)])
    assert db.get(record.job_id) == requeued and _clock_row(db, record.job_id) is None
    assert db.get(other.job_id) == other_clock
    db.close()

    db = Database(tmp_path / "motor.db")  # what a restart reads
    assert db.live() == [requeued, other_clock]
    # a clock then a record of the same job in one transaction: the record, written last
    ended = msgspec.structs.replace(other, state="cancelled", queue_clock_running=False,
                                    ended_at_ms=10_000)
    clock = msgspec.structs.replace(other, queue_wait_ms=7, queue_clock_at_ms=9_500)
    db.save_many([(clock, (), None, None, True), (ended, (), None, 20_000)])
    assert db.get(other.job_id) == ended and _clock_row(db, other.job_id) is None
    assert list(db.iter_terminal()) == [ended] and db.live() == [requeued]
    assert db.expire(20_000) == [other.job_id]
    db.close()


def test_a_refused_transaction_writes_no_clock(tmp_path):
    """All or none: a clock in a transaction that fails is not written."""
    db = Database(tmp_path / "motor.db")
    record = _queued()
    db.save(record)
    clock = msgspec.structs.replace(record, queue_wait_ms=3, queue_clock_running=False)
    clash = _queued("01a22f82-0000-7000-8000-000000000002")
    db.conn.execute("CREATE TRIGGER refuse BEFORE INSERT ON jobs"
                    " BEGIN SELECT RAISE(ABORT, 'refused'); END")
    try:
        db.save_many([(clock, (), None, None, True), (clash, (), None, None)])
    except sqlite3.IntegrityError:
        pass
    else:
        raise AssertionError("the trigger did not refuse the save")
    assert db.get(record.job_id) == record and _clock_row(db, record.job_id) is None
    assert not db.conn.in_transaction
    db.close()


def test_an_old_database_without_the_clocks_table_opens_and_takes_clocks(tmp_path):
    """tests/fixtures/state_v1 (schema 1, made before the clocks table) opens: the table
    is created, its records read as they were, and its queued job takes a clock save."""
    path = tmp_path / "motor.db"
    shutil.copy(FIXTURE / "motor.db", path)
    with sqlite3.connect(path) as conn:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    conn.close()
    assert "clocks" not in tables and "jobs" in tables
    db = Database(path, check=True)
    before = {r.job_id: r for r in db.listing()}
    assert len(before) == 3
    [queued] = [r for r in before.values() if r.state == "queued"]
    assert _blob(db, queued.job_id) == queued  # no clock row: the record as stored
    clock = msgspec.structs.replace(queued, queue_wait_ms=2_500, queue_clock_at_ms=7,
                                    queue_clock_running=False, ready_at_ms=5)
    db.save_many([(clock, (), None, None, True)])
    db.close()
    db = Database(path, check=True)
    assert db.get(queued.job_id) == clock
    assert {r.job_id: r for r in db.listing()} == {**before, queued.job_id: clock}
    assert db.conn.execute("SELECT value FROM meta WHERE key='schema'").fetchone() == ("1",)
    db.close()


def test_a_record_save_deletes_a_clock_row_only_where_one_may_be(tmp_path):
    """A record save deletes the job's `clocks` row only when the job may have one (issue
    14: one statement less per save for the others); after a rolled-back transaction, and
    after a restart, the row is still known and deleted by the next save."""
    db = Database(tmp_path / "motor.db")
    statements: list[str] = []
    db.conn.set_trace_callback(statements.append)

    def deletes() -> int:
        n = sum(s.startswith("DELETE FROM clocks") for s in statements)
        statements.clear()
        return n

    record = _queued()
    db.save(record)
    record = msgspec.structs.replace(record, attempts=1)
    db.save(record)
    assert deletes() == 0
    clock = msgspec.structs.replace(record, queue_wait_ms=5, queue_clock_running=False)
    db.save_many([(clock, (), None, None, True)])
    assert _clock_row(db, record.job_id) is not None and deletes() == 0

    # the save that would delete the row is rolled back: the row stays, and stays known
    full = msgspec.structs.replace(record, attempts=2)
    clash = _queued("01a22f82-0000-7000-8000-000000000002")
    db.conn.execute("CREATE TRIGGER refuse BEFORE INSERT ON jobs"
                    " BEGIN SELECT RAISE(ABORT, 'refused'); END")
    with pytest.raises(sqlite3.IntegrityError):
        db.save_many([(full, (), None, None), (clash, (), None, None)])
    db.conn.execute("DROP TRIGGER refuse")
    assert deletes() == 1 and _clock_row(db, record.job_id) is not None
    assert db.get(record.job_id) == clock
    db.save(full)
    assert deletes() == 1 and _clock_row(db, record.job_id) is None
    assert db.get(record.job_id) == full
    third = msgspec.structs.replace(full, attempts=3)
    db.save(third)
    assert deletes() == 0

    # a clock row left by an earlier runner: the next runner's first save deletes it
    paused = msgspec.structs.replace(third, queue_wait_ms=9, queue_clock_running=False)
    db.save_many([(paused, (), None, None, True)])
    db.close()
    db = Database(tmp_path / "motor.db")
    statements.clear()
    db.conn.set_trace_callback(statements.append)
    assert db.get(record.job_id) == paused
    db.save(third)
    assert deletes() == 1 and db.get(record.job_id) == third
    assert _clock_row(db, record.job_id) is None
    db.close()
