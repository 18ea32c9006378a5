"""Reads from several threads each see the last commit (CI of stop 37: a job accepted a
moment before was "not found" by the event loop while a worker thread's read was open).

Statements of two threads on one SQLite connection share its read transaction, so the
store gives each reading thread a connection of its own (motor/store/db.py, `reader`).
"""

from __future__ import annotations

import gc
import sqlite3
import threading

import msgspec
import pytest

from motor.records import JobRecord
from motor.store.db import Database


def _queued(n: int) -> JobRecord:
    return JobRecord(job_id=f"01a22f82-0000-7000-8000-{n:012d}", state="queued",
                     command=["true"], workspace="w", accepted_at_ms=1_000)


def test_a_read_sees_the_last_commit_while_another_threads_read_is_open(tmp_path):
    db = Database(tmp_path / "motor.db")
    for n in (1, 2, 3):  # terminal records, so the other thread's statement has rows left
        ended = msgspec.structs.replace(_queued(n), state="succeeded", ended_at_ms=2_000)
        db.save(ended)
    opened, release, done = threading.Event(), threading.Event(), threading.Event()
    seen: list[JobRecord] = []

    def hold_a_read_open():  # a worker thread's read, its statement not yet at its end
        rows = db.iter_terminal()
        seen.append(next(rows))
        opened.set()
        release.wait(30)
        seen.extend(rows)
        done.set()

    thread = threading.Thread(target=hold_a_read_open)
    thread.start()
    try:
        assert opened.wait(30)
        new = _queued(4)
        db.save(new)  # committed after the other thread's read began
        assert db.get(new.job_id) == new
        assert [r.job_id for r in db.live()] == [new.job_id]
    finally:
        release.set()
        thread.join(30)
    assert done.is_set() and len(seen) == 3  # the open read saw its own snapshot, whole
    db.close()


def test_each_reading_thread_has_its_own_connection_closed_with_the_database(tmp_path):
    db = Database(tmp_path / "motor.db")
    db.save(_queued(1))
    found: dict[str, object] = {}

    def read():
        found["conn"] = db.reader
        found["record"] = db.get(_queued(1).job_id)

    thread = threading.Thread(target=read)
    thread.start()
    thread.join(30)
    assert found["record"] == _queued(1)
    assert found["conn"] is not db.reader  # not the opening thread's
    db.close()
    with pytest.raises(sqlite3.ProgrammingError, match="closed"):
        found["conn"].execute("SELECT 1")


def test_a_reading_threads_connection_goes_with_the_thread(tmp_path):
    db = Database(tmp_path / "motor.db")
    db.save(_queued(1))
    for _ in range(3):  # threads come and go (trio's worker threads do)
        thread = threading.Thread(target=lambda: db.get(_queued(1).job_id))
        thread.start()
        thread.join(30)
    gc.collect()
    assert len(db._other_readers) == 0  # none kept for a thread that ended
    db.close()
