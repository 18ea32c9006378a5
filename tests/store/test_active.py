"""Database.active(): the records start-up needs (setting up or running), from the store's
state column, without decoding the queued ones."""

from __future__ import annotations

from motor.records import JobRecord
from motor.store.db import Database


def test_active_lists_setting_up_and_running_jobs_in_id_order(tmp_path):
    db = Database(tmp_path / "motor.db")
    try:
        for job_id, state in [("j5", "running"), ("j1", "queued"), ("j2", "setup"),
                              ("j3", "succeeded"), ("j4", "running"), ("j6", "cancelled")]:
            db.save(JobRecord(job_id=job_id, state=state, workspace="w", cpus=[0]))
        assert [r.job_id for r in db.active()] == ["j2", "j4", "j5"]
        assert [r.state for r in db.active()] == ["setup", "running", "running"]
        # a job that ends leaves the list; one that starts joins it
        db.save(JobRecord(job_id="j4", state="succeeded", workspace="w"))
        db.save(JobRecord(job_id="j1", state="setup", workspace="w"))
        assert [r.job_id for r in db.active()] == ["j1", "j2", "j5"]
        assert {r.job_id for r in db.live() if r.state in ("setup", "running")} == \
            {r.job_id for r in db.active()}
    finally:
        db.close()


def test_has_says_whether_a_job_is_recorded_whatever_its_state(tmp_path):
    db = Database(tmp_path / "motor.db")
    try:
        assert not db.has("j1")
        db.save(JobRecord(job_id="j1", state="queued", workspace="w"))
        db.save(JobRecord(job_id="j2", state="succeeded", workspace="w"))
        assert db.has("j1") and db.has("j2") and not db.has("j3")
        assert [db.has(j) for j in ("j1", "j2", "j3")] == [db.get(j) is not None
                                                            for j in ("j1", "j2", "j3")]
    finally:
        db.close()
