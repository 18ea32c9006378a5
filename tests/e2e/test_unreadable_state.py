"""`motor serve` started on a state dir holding what this version cannot read (stop 48):
a record with a value of another version, a record whose command cannot be read, an
event of an unknown type, a damaged saved clock, a catalog that is not one. Before, each
of these stopped `serve` at start-up (or broke the job's replay); now `serve` starts, runs
what it can read, shows what it set aside, and says so in its log.
"""

from __future__ import annotations

import json
import sqlite3
import time

import pytest

from tests.conftest import read_only_tmpfs
from motor.clock import uuid7
from motor.records import Accepted, JobRecord, Queued, Terminal, public_record
from motor.store.db import Database
from polling import json_lines, wait_for

pytestmark = pytest.mark.e2e


def _rewrite(conn, job_id: str, change) -> None:
    [(raw,)] = conn.execute("SELECT record FROM jobs WHERE job_id=?", (job_id,))
    conn.execute("UPDATE jobs SET record=? WHERE job_id=?",
                 (json.dumps(change(json.loads(raw))).encode(), job_id))


def test_serve_starts_on_state_it_cannot_fully_read_and_says_what_it_set_aside(serve_factory):
    serve = serve_factory()
    state = serve.state_dir
    state.mkdir(parents=True)
    now_ms = int(time.time() * 1000)
    later_kind, no_command, old_done, bad_clock = (uuid7(now_ms + i) for i in range(4))
    db = Database(state / "motor.db")  # what a stopped runner of another version left
    for job_id, ws in ((later_kind, "a"), (no_command, "b"), (bad_clock, "c")):
        db.save(JobRecord(job_id=job_id, state="queued", workspace=ws,
                          command=["sh", "-c", f"echo ran {ws}"], claim=1,
                          accepted_at_ms=now_ms, queued_at_ms=now_ms, ready_at_ms=now_ms,
                          queue_clock_at_ms=now_ms, queue_clock_running=True),
                [Accepted(job_id=job_id, claim=1), Queued(queue_wait_budget_ms=600_000)])
    done = JobRecord(job_id=old_done, state="succeeded", workspace="d", command=["true"],
                     claim=1, accepted_at_ms=now_ms, ended_at_ms=now_ms, exit_code=0)
    db.save(done, [Accepted(job_id=old_done, claim=1), Terminal(record=public_record(done))],
            retain_until_ms=now_ms + 86_400_000)
    db.close()
    conn = sqlite3.connect(state / "motor.db")
    _rewrite(conn, later_kind, lambda r: {**r, "kind": "background"})
    _rewrite(conn, no_command, lambda r: {**r, "command": "echo ran b"})
    conn.execute("UPDATE events SET data=? WHERE job_id=? AND seq=1",
                 (b'{"event":"hologram","seq":1}', old_done))
    conn.execute("INSERT INTO clocks VALUES (?, 'abc', ?, 1, ?, 'runner')",
                 (bad_clock, now_ms, now_ms))
    conn.commit()
    conn.close()
    (state / "disk").mkdir()
    (state / "disk" / "catalog.json").write_text("[1, 2]")

    serve.start()
    for job_id, ws in ((later_kind, "a"), (bad_clock, "c")):  # read as far as they go: run
        result = serve.cli("attach", job_id, "--from-seq", "0")
        assert result.returncode == 0 and result.stdout == f"ran {ws}\n".encode(), result
    records = {r["job_id"]: r for r in serve.cli_json("jobs", "--all")}
    assert records[later_kind]["kind"] == "job"
    assert (records[no_command]["state"], records[no_command]["reason"]) == ("lost", "record_unreadable")
    assert "`$.command`" in records[no_command]["detail"]
    assert no_command not in {r["job_id"] for r in serve.cli_json("status")["queued"]}
    replay = json_lines(serve.cli("attach", "--json", old_done, "--from-seq", "0").stdout)
    assert [e["event"] for e in replay] == ["terminal"]  # the unknown event left out
    assert serve.cli("run", "--workspace", "e", "--", "true").returncode == 0
    wait_for(lambda: "disk: 1 entries of the workspace catalog" in serve.log.read_text(),
             what="the catalog's warning")
    log = serve.log.read_text()
    for said in ("kind='background'", "set it aside", "a stored event this runner cannot read",
                 "saved queue-wait clock cannot be read"):
        assert said in log, said


def test_a_workspace_path_that_is_a_file_refuses_its_job_and_the_rest_run(serve_factory):
    """A file where a job's workspace should be is not a failure that passes: before stop 49
    the job was started again every 60 s for as long as the file stayed, its client waiting.
    Now it ends refused (workspace_setup_failed) with a detail naming the path, and the
    runner serves on."""
    serve = serve_factory().start()
    (serve.state_dir / "workspaces").mkdir(exist_ok=True)
    (serve.state_dir / "workspaces" / "wf").write_text("not a directory")
    result = serve.cli("run", "--weight", "1", "--workspace", "wf", "--", "echo", "no")
    assert result.returncode == 75 and b"no\n" not in result.stdout
    assert b"motor: refused: workspace_setup_failed: the workspace " in result.stderr
    [record] = [r for r in serve.cli_json("jobs", "--all") if r["workspace"] == "wf"]
    assert (record["state"], record["reason"]) == ("refused_before_start", "workspace_setup_failed")
    assert "workspaces/wf cannot be a directory" in record["detail"], record
    assert serve.cli("run", "--weight", "1", "--workspace", "w", "--", "true").returncode == 0


@pytest.mark.parametrize("pins", ['{"%s": null}' % ("a" * 64), '[1]', '{"%s": [5], "%s": 7}' % ("b" * 64, "c" * 64)])
def test_serve_starts_with_bundle_pins_it_cannot_read(serve_factory, pins):
    """bundles/pins.json, the bundles' retention clocks, with a value that is not a number:
    before stop 49 the disk actor stopped at every start, and `serve` with it. Now what
    cannot be read is left out (that bundle's retention starts again) and said."""
    serve = serve_factory()
    (serve.state_dir / "bundles").mkdir(parents=True)
    (serve.state_dir / "bundles" / "pins.json").write_text(pins)
    serve.start()
    assert serve.cli("run", "--weight", "1", "--", "true").returncode == 0
    assert "not {sha256: milliseconds}, left out" in serve.log.read_text()


def test_bundle_pins_that_cannot_be_saved_leave_the_runner_serving_and_health_says_so(
        serve_factory):
    """Something not a file where bundles/pins.json goes (the state file system full does
    the same to a save): before stop 55 the disk actor crashed on the save at every
    maintenance pass, from the first one at start-up, until its supervisor gave up and
    `serve` stopped. Now the clocks are kept in memory, health is degraded naming the file,
    and jobs run."""
    serve = serve_factory()
    store = serve.state_dir / "bundles"
    (store / "pins.json").mkdir(parents=True)
    (store / ("c" * 64)).write_bytes(b"a bundle with no pin: its clock starts, and is saved")
    serve.start()
    assert serve.cli("run", "--weight", "1", "--", "true").returncode == 0

    def disk_trouble():
        return [d["cause"] for d in serve.cli_json("health").get("degraded", [])
                if d["subsystem"] == "disk"]
    [cause] = wait_for(disk_trouble, what="health to name the pins")
    assert str(store / "pins.json") in cause and "cannot be saved" in cause, cause
    for _ in range(3):  # past the start-up pass: still serving, nothing restarted
        assert serve.cli("run", "--weight", "1", "--", "true").returncode == 0
    assert "crashed" not in serve.log.read_text()


def test_starts_that_keep_failing_make_the_health_report_degraded(serve_factory, tmp_path):
    """A runner whose every start fails (here its workspace root a read-only file system, so
    no workspace can be made) retries each job, 1 s doubling to 60 s apart. Before stop 49
    its health said ok all along while nothing started. Now after three failed starts in a
    row it says `degraded` (execution, naming the latest failure); the first start that
    succeeds clears it."""
    root = tmp_path / "ro"
    with read_only_tmpfs(root) as writable:
        serve = serve_factory("--workspace-root", str(root)).start()
        job_id = serve.cli_json("submit", "--weight", "1", "--", "echo", "at last")["job_id"]

        def degraded():
            health = serve.cli_json("health")
            return [d for d in health.get("degraded", []) if d["subsystem"] == "execution"]
        [trouble] = wait_for(degraded, what="three failed starts", timeout=30)
        assert "job starts failed and none has succeeded since" in trouble["cause"]
        assert job_id in trouble["cause"] and "Read-only file system" in trouble["cause"], trouble
        assert serve.cli_json("health")["capacity"]["failed_starts"] >= 3
        writable()
        result = serve.cli("attach", job_id)
        assert (result.returncode, result.stdout) == (0, b"at last\n")
        health = serve.cli_json("health")
        assert health["status"] == "ok" and "failed_starts" not in health["capacity"], health
        serve.stop()


def test_a_workspace_root_removed_under_serve_leaves_the_disk_manager_up(serve_factory, tmp_path):
    """The workspace root removed while `motor serve` runs: the disk manager's probe every
    2 s passes it over (before stop 55's fix of that probe it crashed the disk actor at each
    probe, "restarted 5 time(s) in the last 10 s"; on stop 54's code, at each maintenance
    pass). Health stays free of a disk crash over three probe periods, and the next job's
    setup makes the root again."""
    root = tmp_path / "ws"
    serve = serve_factory("--workspace-root", str(root)).start()
    assert serve.cli("run", "--weight", "1", "--", "true").returncode == 0
    for entry in root.iterdir():
        entry.rename(tmp_path / entry.name)
    root.rmdir()
    deadline = time.monotonic() + 6.5  # three PRESSURE_POLL_S periods and a margin
    while time.monotonic() < deadline:
        troubles = [d for d in serve.cli_json("health").get("degraded", [])
                    if d["subsystem"] == "disk"]
        assert troubles == [], troubles
        time.sleep(0.5)
    assert "crashed" not in serve.log.read_text()
    assert serve.cli("run", "--weight", "1", "--", "true").returncode == 0
    assert root.is_dir()
