"""A state file system that cannot be written any more (ext4 after an error, mounted
`errors=remount-ro`, as a failing disk leaves it): a typed refusal, health says why, and
the runner serves on.

Found by a probe in stop 60: every write raised SQLite's "disk I/O error", which crashed
the store and the dispatcher actors (restarted by their supervisors, which give up after
five crashes in ten seconds) and answered each submit `internal_error`.
"""

from __future__ import annotations

import pytest

from motor.records import JobRecord
from motor.store.db import Database, StoreFull, StoreUnwritable
from tmpfs_helpers import ext4, ext4_error, needs_ext4

pytestmark = [pytest.mark.e2e, needs_ext4]


def _record(n: int, state: str = "queued") -> JobRecord:
    return JobRecord(job_id=f"01900000-0000-7000-8000-{n:012d}", state=state, workspace="w",
                     command=["true"], claim=1)


def test_store_writes_on_a_read_only_state_fs_raise_store_unwritable(tmp_path):
    with ext4(tmp_path / "state", journal=True, options="errors=remount-ro") as state:
        db = Database(state / "motor.db")
        db.save(_record(1))
        ext4_error(state)
        with pytest.raises(StoreUnwritable) as info:
            db.save(_record(2))
        assert isinstance(info.value, StoreFull)  # its callers wait and refuse as for a full one
        assert "cannot be written" in str(info.value) and db.full_error == str(info.value)
        assert not db.conn.in_transaction
        with pytest.raises(StoreUnwritable):
            db.save(_record(3, "running"))  # a started job's write: no reserve to delete
        assert db.get(_record(1).job_id) is not None  # what was saved reads as before
        db.close()


def test_a_state_fs_that_turns_read_only_refuses_submits_says_why_and_serves_on(
        serve_factory, tmp_path):
    with ext4(tmp_path / "state", journal=True, size_mb=64, options="errors=remount-ro") as state:
        serve = serve_factory("--workspace-root", str(tmp_path / "ws"), "--isolation",
                              "affinity", state_dir=state).start()
        try:
            assert serve.cli("run", "--weight", "1", "--", "true").returncode == 0
            ext4_error(state)
            for _ in range(8):  # more than a supervisor's budget of crashes, had they crashed
                result = serve.cli("submit", "--weight", "1", "--", "true")
                assert result.returncode == 75, result  # refused before start
                said = result.stderr.decode()
                assert "runner_disk_full" in said and "cannot be written" in said, said
            health = serve.cli_json("health")
            assert health["status"] == "degraded", health
            assert any(d["subsystem"] == "store" and "cannot be written" in d["cause"]
                       for d in health["degraded"]), health
            assert serve.proc.poll() is None
            assert "crashed" not in serve.log.read_text()
        finally:
            serve.stop()
