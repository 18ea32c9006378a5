"""Expired jobs are deleted in batches bounded by their stored output (stop 63): a day's
verbose jobs go in many short transactions, not one that holds the store for seconds."""

from __future__ import annotations

from motor.records import JobRecord, Output
from motor.store.db import EXPIRE_BATCH_BYTES, Database

MiB = 1024 * 1024


def ended_with_output(db: Database, job_id: str, nbytes: int, retain_until_ms: int) -> None:
    record = JobRecord(job_id=job_id, state="running", workspace="w")
    chunk = "x" * (64 * 1024 - 1) + "\n"
    events = [Output(stream="stdout", data=chunk) for _ in range(nbytes // len(chunk))]
    for i in range(0, len(events), 16):
        db.save(record, events[i:i + 16])
    db.save(JobRecord(job_id=job_id, state="succeeded", workspace="w", ended_at_ms=1),
            retain_until_ms=retain_until_ms)


def test_an_expiry_call_deletes_up_to_its_byte_budget_and_always_one_job(tmp_path):
    db = Database(tmp_path / "motor.db", max_output_bytes=None)
    for i, size in enumerate([3 * MiB // 2, 3 * MiB // 2, 3 * MiB // 2, 10 * MiB, MiB // 2]):
        ended_with_output(db, f"j{i}", size, retain_until_ms=10 + i)
    ended_with_output(db, "kept", MiB // 2, retain_until_ms=10**9)  # its day is not over
    budget = 4 * MiB
    assert db.expire(now_ms=100, max_bytes=budget) == ["j0", "j1"]  # a third would pass it
    assert db.expire(now_ms=100, max_bytes=budget) == ["j2"]  # j3 alone is more
    assert db.expire(now_ms=100, max_bytes=budget) == ["j3"]  # more than the budget: alone
    assert db.expire(now_ms=100, max_bytes=budget) == ["j4"]
    assert db.expire(now_ms=100, max_bytes=budget) == []
    assert [r.job_id for r in db.listing(limit=10)] == ["kept"]
    assert not db.conn.execute(
        "SELECT 1 FROM events WHERE job_id != 'kept' LIMIT 1").fetchone()
    db.close()


def test_the_default_budget_takes_many_small_jobs_in_one_call(tmp_path):
    db = Database(tmp_path / "motor.db", max_output_bytes=None)
    for i in range(20):
        db.save(JobRecord(job_id=f"s{i:02d}", state="succeeded", workspace="w", ended_at_ms=1),
                retain_until_ms=5)
    assert EXPIRE_BATCH_BYTES >= MiB
    assert len(db.expire(now_ms=10)) == 20  # no output: one transaction, as before
    db.close()
