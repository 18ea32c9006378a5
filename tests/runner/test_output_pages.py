"""Output is kept in pages; replay after evicted pages starts with a `truncated` event."""

from __future__ import annotations

from contextlib import aclosing

import motor
from motor.records import JobRequest
from motor.store.db import PAGE_EVENTS, RECLAIM_MAX_PAGES, Database

from runner_helpers import embedded_config


async def test_replay_after_evicted_pages_starts_with_truncated_before_seq(tmp_path, autojump_clock):
    lines = 3000
    config = embedded_config(tmp_path, max_output_bytes_per_job=20_000)
    # many small writes, flushed one by one and paced, so output arrives as many events
    script = (f"import sys, time\nfor i in range({lines}):\n    sys.stdout.write(f'line-{{i}}\\n')\n"
              "    sys.stdout.flush()\n    time.sleep(0.0002)\n")
    async with motor.open_runner(config) as runner:
        job = await runner.submit(JobRequest(command=["python3", "-c", script]))
        async with aclosing(runner.events(job.job_id)) as events:
            async for event in events:
                pass
        truncated_before = runner.db.truncated_before(job.job_id)
        assert truncated_before > 1 and (truncated_before - 1) % PAGE_EVENTS == 0  # whole pages

        async with aclosing(runner.events(job.job_id, 0)) as events:
            replay = [e async for e in events]
        first = replay[0]
        assert first.__struct_config__.tag == "truncated"
        assert first.truncated_before_seq == truncated_before
        seqs = [e.seq for e in replay]
        assert seqs == sorted(seqs)
        # the lifecycle events below the boundary are never evicted and still replayed
        tags = [e.__struct_config__.tag for e in replay]
        assert tags[1:4] == ["accepted", "queued", "started"], tags[:6]
        assert all(e.seq < truncated_before for e in replay[1:4])
        assert all(e.seq >= truncated_before for e in replay[4:])
        text = "".join(e.data for e in replay if e.__struct_config__.tag == "output")
        assert text.endswith(f"line-{lines - 1}\n")  # the newest output is all there
        assert 0 < len(text.encode()) <= 20_000
        assert replay[-1].__struct_config__.tag == "terminal"

        # replay from after the evicted pages: no truncated event
        async with aclosing(runner.events(job.job_id, truncated_before)) as events:
            later = [e async for e in events]
        assert later[0].__struct_config__.tag != "truncated"


def test_pages_are_evicted_oldest_first_and_non_output_events_stay(tmp_path):
    from motor.records import Accepted, JobRecord, Output

    db = Database(tmp_path / "motor.db", max_output_bytes=1000)
    record = JobRecord(job_id="j", state="running", workspace="w")
    db.save(record, [Accepted(job_id="j", claim=2)])
    for i in range(300):
        db.save(record, [Output(stream="stdout", data=f"{i:09d}\n")])
    cut = db.truncated_before("j")
    assert cut > 1
    kept = db.events_from("j", 0, limit=10_000)
    assert kept[0].startswith(b'{"event":"accepted"')  # never evicted
    outputs = [r for r in kept if r.startswith(b'{"event":"output"')]
    assert len(outputs) * 10 <= 1000 and outputs[-1].endswith(b'"000000299\\n","seq":301}')


def _db_bytes(path) -> int:
    """motor.db plus its WAL on disk."""
    wal = path.with_name(path.name + "-wal")
    return path.stat().st_size + (wal.stat().st_size if wal.exists() else 0)


def test_the_cap_counts_stored_bytes_so_escaped_output_cannot_overrun_it(tmp_path):
    """Coloured output (ANSI escapes) is stored JSON-escaped, 6 bytes per ESC: the cap is
    on what is stored, not on the text."""
    from motor.records import JobRecord, Output

    cap = 1024 * 1024
    db = Database(tmp_path / "motor.db", max_output_bytes=cap)
    record = JobRecord(job_id="j", state="running", workspace="w")
    for i in range(1500):  # 1.5 MB of text, about 4.5 MB once escaped
        db.save(record, [Output(stream="stdout", data="\x1b[31m" * 200 + f"{i}\n")])
    stored = db.conn.execute(
        "SELECT sum(length(data)) FROM events WHERE job_id='j'").fetchone()[0]
    assert stored <= cap
    assert db.events_from("j", 0, limit=10_000)[-1].endswith(b'1499\\n","seq":1500}')


def test_a_new_database_gives_expired_space_back(tmp_path):
    """New databases use incremental auto-vacuum: expiring a big job shrinks the file, by
    at most RECLAIM_MAX_PAGES per call (each maintenance pass calls until nothing is left to
    expire, and once more)."""
    from motor.records import JobRecord, Output

    path = tmp_path / "motor.db"
    db = Database(path, max_output_bytes=None)
    assert db.conn.execute("PRAGMA auto_vacuum").fetchone()[0] == 2  # incremental
    record = JobRecord(job_id="j", state="running", workspace="w")
    chunk = "x" * 60_000 + "\n"
    for _ in range(30):
        db.save(record, [Output(stream="stdout", data=chunk) for _ in range(8)])
    db.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    full = _db_bytes(path)
    assert full > 14_000_000
    done = JobRecord(job_id="j", state="succeeded", workspace="w", ended_at_ms=1)
    db.save(done, retain_until_ms=10)
    assert db.expire(now_ms=20) == ["j"]
    db.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    after_one = _db_bytes(path)
    assert after_one <= full - RECLAIM_MAX_PAGES * 4096
    for _ in range(3):  # later calls (passes) hand the rest back
        assert db.expire(now_ms=20) == []
    db.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    assert _db_bytes(path) < 2_000_000 < after_one
    db.close()


def test_an_existing_database_without_auto_vacuum_still_opens_and_reuses_space(tmp_path):
    """A database made before incremental auto-vacuum keeps working; evicted pages are reused."""
    import sqlite3

    from motor.records import JobRecord, Output

    path = tmp_path / "motor.db"
    sqlite3.connect(path).execute("CREATE TABLE old (x)").connection.close()  # auto_vacuum NONE
    cap = 1024 * 1024
    db = Database(path, max_output_bytes=cap)
    assert db.conn.execute("PRAGMA auto_vacuum").fetchone()[0] == 0  # left as it was
    record = JobRecord(job_id="j", state="running", workspace="w")
    chunk = "y" * 60_000 + "\n"
    for _ in range(200):  # 12 MB through a 1 MiB cap
        db.save(record, [Output(stream="stdout", data=chunk)])
    db.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    # the cap, plus the page being filled (64 events of 60 kB), plus slack; not the 12 MB written
    assert _db_bytes(path) < cap + PAGE_EVENTS * 60_100 + 1024 * 1024
    db.close()


def test_large_output_events_never_leak_below_the_truncation_point(tmp_path):
    """Pages of big events: a page still being filled is never evicted, so no output event
    is left behind (stored but unreachable) below truncated_before_seq."""
    from motor.records import Accepted, JobRecord, Output

    cap = 1024 * 1024
    db = Database(tmp_path / "motor.db", max_output_bytes=cap)
    record = JobRecord(job_id="j", state="running", workspace="w")
    db.save(record, [Accepted(job_id="j", claim=1)])
    chunk = "z" * 60_000 + "\n"  # a page of 64 such events is ~3.8 MB, above the cap
    for _ in range(300):
        db.save(record, [Output(stream="stdout", data=chunk)])
    cut = db.truncated_before("j")
    assert cut > 1 and (cut - 1) % PAGE_EVENTS == 0
    below = db.conn.execute("SELECT seq, substr(data, 1, 17) FROM events WHERE job_id='j' AND seq < ?",
                            (cut,)).fetchall()
    assert below == [(1, b'{"event":"accepte')]  # only the non-output event stays
    stored = db.conn.execute("SELECT sum(length(data)) FROM events WHERE job_id='j'").fetchone()[0]
    assert stored <= cap + PAGE_EVENTS * 60_100  # the cap plus the page being filled
    db.close()


def test_event_reads_are_bounded_in_bytes(tmp_path):
    """A replay slice stops after a few MiB however big the stored events are."""
    from motor.records import JobRecord, Output
    from motor.store import db as store_db

    EVENTS_READ_BYTES = getattr(store_db, "EVENTS_READ_BYTES", 4 * 1024 * 1024)
    db = Database(tmp_path / "motor.db")
    record = JobRecord(job_id="j", state="running", workspace="w")
    for _ in range(10):
        db.save(record, [Output(stream="stdout", data="q" * 100_000) for _ in range(10)])
    first = db.events_from("j", 0)
    assert 0 < len(first) < 100
    assert sum(map(len, first)) - len(first[-1]) < EVENTS_READ_BYTES
    everything, seq = [], 0
    while rows := db.events_from("j", seq):
        everything += rows
        seq += len(rows) + (1 if seq == 0 else 0)  # seqs start at 1
    assert len(everything) == 100


async def test_output_written_while_the_runner_was_down_is_stored_in_bounded_batches(
        tmp_path, autojump_clock, monkeypatch):
    """The restarted runner saves a large log batch by batch, each batch's offset saved
    with its events, and ends at the end of the log."""
    import trio

    from motor.execution import joblog
    from polling import wait_for
    from runner_helpers import barrier_job, terminal_of

    READ_MAX_BYTES = getattr(joblog, "READ_MAX_BYTES", 1024 * 1024)
    barrier = tmp_path / "go"
    config = embedded_config(tmp_path, max_output_bytes_per_job=2 * 1024 * 1024)
    request = barrier_job(barrier)
    size = 6 * 1024 * 1024
    request = JobRequest(command=["sh", "-c", request.command[2].replace(
        "exit 0", f"yes 0123456789abcdef | head -c {size}; exit 0")])
    async with motor.open_runner(config) as runner:
        job = await runner.submit(request)
        job_dir = tmp_path / "state" / "jobs" / job.job_id
        while runner.db.get(job.job_id).state != "running":
            await trio.sleep(0.05)
    barrier.write_text("")  # the runner is gone; the keeper writes the whole log
    wait_for((job_dir / "status.json").exists, timeout=60, what="the job to end")
    log_size = (job_dir / "output.log").stat().st_size

    offsets = []
    real_save_many = Database.save_many  # every save of the store actor (group commit)

    def spy(self, writes, *lock_wait):
        offsets.extend(log_offset for record, _, log_offset, _ in writes
                       if log_offset is not None and record.job_id == job.job_id)
        return real_save_many(self, writes, *lock_wait)

    monkeypatch.setattr(Database, "save_many", spy)
    async with motor.open_runner(config) as runner:
        assert (await terminal_of(runner, job.job_id))["state"] == "succeeded"
        assert runner.db.log_offset(job.job_id) == log_size
    steps = [b - a for a, b in zip([0] + offsets, offsets)]
    assert offsets[-1] == log_size and len(offsets) >= size // READ_MAX_BYTES
    assert all(0 < step <= READ_MAX_BYTES for step in steps), steps
