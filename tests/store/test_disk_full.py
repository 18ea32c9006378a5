"""A full state filesystem while the store saves: a typed refusal, and the store lives on.

Issue 10 part 2: the store actor crashed on ENOSPC (`cannot rollback - no transaction is
active`), never came back, and every later submit got `500 internal_error ActorDead`.
"""

from __future__ import annotations

import errno
import os
import sqlite3
import subprocess

import httpx
import pytest

from motor.records import JobRecord
from motor.store.db import Database, StoreFull
from polling import wait_for

MiB = 1024 * 1024


@pytest.fixture
def small_tmpfs(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)],
            capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a tmpfs")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _fill(path) -> None:
    """Write `path` until the filesystem refuses even one more byte (ENOSPC)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for size in (256 * 1024, 4096, 1):
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)


def _http(socket) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(socket)), base_url="http://motor",
                        timeout=30)


def _ended(http, job_id) -> dict:
    def ended():
        record = http.get(f"/v1/jobs/{job_id}").json()
        return record if record["state"] in ("succeeded", "failed", "lost", "cancelled") else None

    return wait_for(ended, timeout=60, what=f"job {job_id} to end")


def _job(big: int = 0) -> dict:
    # a large env makes the record bigger than any WAL space SQLite may reuse
    return {"command": ["sh", "-c", "echo hello"], "weight_hint": 1,
            "env": {f"PAD{i}": "x" * 100_000 for i in range(big // 100_000)}}


def test_store_writes_on_a_full_filesystem_raise_store_full_and_the_store_keeps_working(
        small_tmpfs):
    db = Database(small_tmpfs / "motor.db")
    done = JobRecord(job_id="01900000-0000-7000-8000-000000000001", state="succeeded",
                     workspace="w", command=["true"], claim=1, ended_at_ms=1)
    db.save(done, retain_until_ms=1000)
    record = JobRecord(job_id="01900000-0000-7000-8000-000000000002", state="queued",
                       workspace="w", command=["true"], claim=1, env={"PAD": "x" * 600_000})
    filler = small_tmpfs / "filler"
    _fill(filler)
    with pytest.raises(StoreFull) as info:  # today: "cannot rollback - no transaction is active"
        db.save(record)
    assert "full" in str(info.value) and db.full_error == str(info.value)
    assert not db.conn.in_transaction and db.get(record.job_id) is None
    with pytest.raises(StoreFull):  # retention deletes need room in the WAL too
        db.expire(now_ms=2000)
    assert db.get(done.job_id) is not None
    filler.unlink()
    db.save(record)  # the same connection works once space is back
    assert db.get(record.job_id).env == record.env and db.full_error is None
    assert db.expire(now_ms=2000) == [done.job_id]
    db.close()


def test_submit_on_a_full_state_fs_is_refused_runner_disk_full_then_works_once_freed(
        small_tmpfs, serve_factory):
    # the state dir is the tmpfs itself (the serve log lives beside it, on the disk);
    # floor 0: the store, not admission, meets ENOSPC
    serve = serve_factory(state_dir=small_tmpfs).start()
    with _http(serve.socket) as http:
        first = http.post("/v1/jobs", json=_job())
        assert first.status_code == 202, first.text
        assert _ended(http, first.json()["job_id"])["state"] == "succeeded"
        filler = small_tmpfs / "filler"
        _fill(filler)
        for _ in range(3):  # repeated refusals: the store never crashes, never escalates
            resp = http.post("/v1/jobs", json=_job(big=600_000))
            assert resp.status_code == 503, resp.text
            body = resp.json()
            assert body["refused"] is True and body["code"] == "runner_disk_full"
            assert "full" in body["detail"]
        # on this idle runner each was accepted and started in one save (docs/scheduling.md,
        # "Admission and the disk"): refused, nothing of them is left, CPUs and permits free
        status = http.get("/v1/status").json()
        assert status["queued"] == [] and status["running"] == []
        assert status["capacity"]["held_permits"] == 0 and status["capacity"]["pending_jobs"] == 0
        assert [j["job_id"] for j in http.get("/v1/jobs?all=1").json()] == [
            first.json()["job_id"]]
        health = http.get("/v1/health")
        assert health.json()["cpus"]["jobs"] == {}  # the refused starts' CPUs went back
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        assert any(d["subsystem"] == "store" and "full" in d["cause"]
                   for d in health.json()["degraded"]), health.text
        metrics = http.get("/metrics").text
        assert "motor_degraded 1.0" in metrics
        assert 'motor_degraded_subsystem{subsystem="store"} 1.0' in metrics
        shown = serve.cli("health")
        assert shown.returncode == 0 and b"status: DEGRADED" in shown.stdout
        assert b"store: cannot save job" in shown.stdout
        filler.unlink()
        resp = http.post("/v1/jobs", json=_job(big=600_000))
        assert resp.status_code == 202, resp.text
        assert _ended(http, resp.json()["job_id"])["state"] == "succeeded"
        health = http.get("/v1/health")
        assert health.status_code == 200 and health.json()["status"] == "ok", health.text
        assert health.json()["degraded"] == [] and "motor_degraded 0.0" in http.get("/metrics").text
    assert serve.proc.poll() is None  # no restart was needed
    log = serve.log.read_text()
    assert "ActorDead" not in log and "crashed" not in log, log


def test_a_job_ending_while_the_state_fs_is_full_is_recorded_once_space_is_back(
        small_tmpfs, serve_factory, tmp_path):
    serve = serve_factory(state_dir=small_tmpfs).start()
    barrier = tmp_path / "go"  # on the disk, not on the tmpfs
    # its terminal record (200 kB of env) needs more room than will be left; every save
    # appends to the WAL (5 saves stay below SQLite's 1000-page autocheckpoint, after which
    # the WAL would be reused from its start and need no new space)
    job = _job(big=200_000)
    # silent: no output save may take the last free bytes before the keeper's status.json
    job["command"] = ["sh", "-c", f"while [ ! -e {barrier} ]; do sleep 0.02; done"]
    with _http(serve.socket) as http:
        resp = http.post("/v1/jobs", json=job)
        assert resp.status_code == 202, resp.text
        job_id = resp.json()["job_id"]
        wait_for(lambda: http.get(f"/v1/jobs/{job_id}").json()["state"] == "running",
                 what="the job to run")
        filler = small_tmpfs / "filler"
        _fill(filler)
        os.truncate(filler, filler.stat().st_size - 32 * 1024)  # room for status.json only
        barrier.touch()
        status = small_tmpfs / "jobs" / job_id / "status.json"
        wait_for(status.exists, what="the keeper to record the exit")

        def store_full():
            return any(d["subsystem"] == "store" and "full" in d["cause"]
                       for d in http.get("/v1/health").json()["degraded"])

        wait_for(store_full, what="the terminal save to meet the full disk")
        assert http.get(f"/v1/jobs/{job_id}").json()["state"] == "running"  # not yet recorded
        filler.unlink()
        assert _ended(http, job_id)["state"] == "succeeded"
        assert http.get("/v1/health").json()["status"] == "ok"
    assert serve.proc.poll() is None  # the runner never stopped
    log = serve.log.read_text()
    assert "crashed" not in log and "gave up" not in log, log


def test_cancelling_a_queued_job_on_a_full_state_fs_is_recorded_once_space_is_back(
        small_tmpfs, serve_factory, tmp_path):
    serve = serve_factory("--max-weight", "1", state_dir=small_tmpfs).start()
    barrier = tmp_path / "go"
    holder = _job()
    holder["command"] = ["sh", "-c", f"while [ ! -e {barrier} ]; do sleep 0.02; done"]
    with _http(serve.socket) as http:
        assert http.post("/v1/jobs", json=holder).status_code == 202
        resp = http.post("/v1/jobs", json=_job(big=600_000))  # waits behind the holder
        assert resp.status_code == 202, resp.text
        job_id = resp.json()["job_id"]
        filler = small_tmpfs / "filler"
        _fill(filler)
        resp = http.post(f"/v1/jobs/{job_id}/cancel")
        assert resp.status_code == 200, resp.text
        assert http.get("/v1/health").json()["status"] == "degraded"
        filler.unlink()
        record = _ended(http, job_id)
        assert record["state"] == "cancelled" and record["reason"] == "cancelled"
        barrier.touch()
        wait_for(lambda: http.get("/v1/health").json()["capacity"]["held_permits"] == 0,
                 what="the holder to end")
    assert serve.proc.poll() is None
    log = serve.log.read_text()
    assert "crashed" not in log, log
