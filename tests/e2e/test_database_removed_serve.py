"""The job database removed, or another file put in its place, under a real `motor serve`
(docs/operations.md, "When motor.db is removed or replaced"; motor/store/fileguard.py).

Before stop 52 the runner went on writing into a file no path named: it accepted and ran
jobs, health said ok, and at its next start every record was gone and the start refused
(`motor.db is missing but jobs/ holds job directories`). Now the first commit (or health)
that finds the path changed stops it in order (exit status 5), its records saved: back at
the path when nothing is there, beside it when another file is."""

from __future__ import annotations

import os
import sqlite3

import pytest

from polling import wait_for

pytestmark = pytest.mark.e2e


def _running_gate_job(serve, gate) -> str:
    serve.cli_popen("run", "--weight", "1", "--", "sh", "-c",
                    f"while [ ! -e {gate} ]; do sleep 0.02; done; echo first")
    wait_for(lambda: [j["state"] for j in serve.cli_json("jobs")] == ["running"],
             what="the first job's record to say running")
    return serve.cli_json("jobs")[0]["job_id"]


def _remove_database(state) -> None:
    for name in ("motor.db", "motor.db-wal", "motor.db-shm"):
        (state / name).unlink(missing_ok=True)


def _job_ids(path) -> set[str]:
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        return {row[0] for row in conn.execute("SELECT job_id FROM jobs")}


def test_a_removed_database_stops_the_runner_with_its_records_saved_back(serve_factory,
                                                                         tmp_path):
    gate = tmp_path / "gate"
    serve = serve_factory("--isolation", "none").start()
    first = _running_gate_job(serve, gate)
    _remove_database(serve.state_dir)
    # its acceptance is the first commit after: written to the open file, the runner stops
    submitted = serve.cli("submit", "--weight", "1", "--", "echo", "second")
    assert serve.proc.wait(30) == 5
    log = serve.log.read_text()
    assert "motor.db was removed while the runner had it open" in log
    assert f"saved to {serve.state_dir / 'motor.db'}" in log and "Traceback" not in log
    saved = _job_ids(serve.state_dir / "motor.db")
    assert first in saved
    if submitted.returncode == 0:  # answered before the stop: it is among them
        assert submitted.stdout.decode().split()[0] in saved
    serve.start()  # on the saved records: the first job adopted, the second run
    gate.touch()
    wait_for(lambda: {j["state"] for j in serve.cli_json("jobs")} == {"succeeded"},
             what="every job to end")
    assert {j["job_id"] for j in serve.cli_json("jobs")} == saved
    assert serve.stop() == 0


def test_a_database_replaced_by_another_file_is_kept_and_the_runners_saved_beside_it(
        serve_factory, tmp_path):
    gate = tmp_path / "gate"
    serve = serve_factory("--isolation", "none").start()
    first = _running_gate_job(serve, gate)
    db = serve.state_dir / "motor.db"
    backup = tmp_path / "backup.db"  # an operator's copy, put back while the runner runs
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as src, sqlite3.connect(backup) as dst:
        src.backup(dst)
    os.replace(backup, db)
    theirs = os.stat(db).st_ino
    health = serve.cli_json("health", timeout=10)  # health finds it too
    assert any("replaced by another file" in d["cause"] for d in health["degraded"])
    assert serve.proc.wait(30) == 5
    assert os.stat(db).st_ino == theirs  # not overwritten
    [displaced] = [p for p in serve.state_dir.iterdir()
                   if p.name.startswith("motor.db.displaced-") and not p.name.endswith(".saving")]
    assert first in _job_ids(displaced)
    assert f"saved to {displaced}" in serve.log.read_text()
    gate.touch()


def test_a_database_removed_while_idle_is_saved_back_by_an_orderly_stop(serve_factory):
    serve = serve_factory("--isolation", "none").start()
    out = serve.cli("run", "--", "echo", "kept")
    assert out.returncode == 0
    _remove_database(serve.state_dir)  # no commit follows: found as the database closes
    assert serve.stop() == 0
    assert len(_job_ids(serve.state_dir / "motor.db")) == 1
    serve.start()
    assert [j["state"] for j in serve.cli_json("jobs")] == ["succeeded"]
    assert serve.stop() == 0
