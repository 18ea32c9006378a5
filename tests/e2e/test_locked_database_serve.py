"""Another process holding the job database's write lock, through a real `motor serve`
(docs/operations.md, "When another process locks the database").

An operator's `sqlite3 motor.db` left inside a write transaction (here: a second process
that runs `BEGIN EXCLUSIVE` and waits for a line on its stdin) holds the lock every write
needs. The runner's writes then wait for it in a worker thread, health answers at once and
says so, nothing accepted is lost, and once the lock is free every job ends as it would
have. The runner also starts while the lock is held (it opens an existing database without
taking it).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import psutil
import pytest

from motor.config import ConfigError, RunnerConfig, build_config
from motor.wire import CHANGE_TIMEOUT_S
from tests.polling import wait_for

pytestmark = pytest.mark.e2e

HOLD = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
sys.stdin.readline()
conn.execute("COMMIT")
"""


def hold_write_lock(db) -> subprocess.Popen:
    """Another process holding the database's write lock until a line on its stdin."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(db)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def release(holder: subprocess.Popen) -> None:
    holder.communicate("\n", timeout=10)
    assert holder.returncode == 0


def lock_causes(serve) -> list[str]:
    health = serve.cli_json("health", timeout=5)  # it answers while the writes wait
    return [d["cause"] for d in health["degraded"]
            if d["subsystem"] == "store" and "write lock" in d["cause"]]


def short_change_timeout(tmp_path) -> tuple[str, str]:
    """`motor serve` options for a runner whose cancels and withdraws wait 2 s for a busy
    dispatcher (`change_timeout_s`, a config-file setting; 30 s by default)."""
    config = tmp_path / "motor.toml"
    config.write_text("change_timeout_s = 2\n")
    return "--config", str(config)


def running_and_queued(serve_factory, gate, *options: str):
    """A runner of one slot (and `options`), a job running in it until `gate` exists (it
    prints "first"), and a job queued behind it in a workspace of its own (so its queue-wait
    clock runs, docs/scheduling.md): (serve, the first job's `motor run`, the queued job's
    id)."""
    serve = serve_factory("--isolation", "none", "--max-weight", "1", *options).start()
    first = serve.cli_popen("run", "--weight", "1", "--", "sh", "-c",
                            f"while [ ! -e {gate} ]; do sleep 0.02; done; echo first")
    wait_for(lambda: [j["state"] for j in serve.cli_json("jobs")] == ["running"],
             what="the first job's record to say running")
    queued_id = serve.cli("submit", "--weight", "1", "--workspace", "b", "--",
                          "echo", "queued").stdout.decode().split()[0]
    return serve, first, queued_id


def test_a_database_locked_by_another_process_makes_writes_wait_and_health_say_so(
        serve_factory, tmp_path):
    gate = tmp_path / "gate"
    serve = serve_factory("--isolation", "none", *short_change_timeout(tmp_path)).start()
    first = serve.cli_popen("run", "--", "sh", "-c",
                            f"while [ ! -e {gate} ]; do sleep 0.02; done; echo first")
    # its record says running (the status lists a job still in set-up among the running)
    wait_for(lambda: [j["state"] for j in serve.cli_json("jobs")] == ["running"],
             what="the first job's record to say running")
    holder = hold_write_lock(serve.state_dir / "motor.db")
    try:
        gate.touch()  # the first job ends while the lock is held: its end waits
        second = serve.cli_popen("run", "--", "echo", "second")  # its acceptance waits
        wait_for(lambda: lock_causes(serve), what="health to name the held write lock")
        # held past the runner's bound on a cancel (2 s here): before stop 50 a save or a
        # job's end gave up after 30 s, and a dispatcher that gave up restarted without the
        # second job, written after it. That no such call has a bound is held for a
        # virtual hour in tests/store/test_locked_database.py; here, through the runner,
        # for three times the bound it has (until stop 77 for 31 s, a test of 33 s)
        wait_for(lambda: serve.cli_json("health", timeout=5)["store"]["locked_ms"] > 6_000,
                 timeout=60, interval=0.5, what="the lock to be held for over 6 s")
        assert first.poll() is None and second.poll() is None
        assert serve.proc.poll() is None
        # the views are read while the dispatcher waits on the lock (stop 51; before, each
        # waited 30 s and was answered 503 runner_busy): the first job's end not yet
        # written (its record still says running), the second not yet accepted; the status
        # lists the first among the running until the dispatcher has taken its end
        [job] = serve.cli_json("jobs", timeout=5)
        assert job["state"] == "running"
        status = serve.cli_json("status", timeout=5)
        assert [r["job_id"] for r in status["running"]] in ([], [job["job_id"]])
        assert status["queued"] == []
    finally:
        release(holder)
    out1, err1 = first.communicate(timeout=60)
    out2, err2 = second.communicate(timeout=60)
    assert (first.returncode, out1) == (0, b"first\n"), err1
    assert (second.returncode, out2) == (0, b"second\n"), err2
    wait_for(lambda: serve.cli_json("health")["status"] == "ok", what="health ok again")
    store = serve.cli_json("health")["store"]
    assert store["locked_writes"] >= 1 and store["locked_ms"] == 0
    jobs = serve.cli_json("jobs")
    states = {j["state"] for j in (jobs["jobs"] if isinstance(jobs, dict) else jobs)}
    assert states == {"succeeded"}
    assert serve.stop() == 0
    log = serve.log.read_text()
    assert "write lock is free again" in log and "Traceback" not in log
    assert "crashed" not in log, log


def test_serve_starts_while_another_process_holds_the_database_write_lock(serve_factory):
    serve = serve_factory("--isolation", "none").start()
    assert serve.stop() == 0  # the database exists
    holder = hold_write_lock(serve.state_dir / "motor.db")
    try:
        serve.start()
        run = serve.cli_popen("run", "--", "echo", "accepted")
        wait_for(lambda: lock_causes(serve), what="health to name the held write lock")
        assert run.poll() is None
    finally:
        release(holder)
    out, err = run.communicate(timeout=60)
    assert (run.returncode, out) == (0, b"accepted\n"), err
    assert serve.stop() == 0


def test_a_running_job_is_cancelled_at_once_while_the_dispatcher_waits_on_the_lock(
        serve_factory, tmp_path):
    """A cancel of a running job changes nothing of the queue: only the job's actor is told.
    So it is answered, and the job signalled, also while the dispatcher waits on a save
    under another process's lock (before: the cancel waited 30 s behind that save, was
    answered 503 runner_busy, and the job ran on). Its end is written once the lock is free."""
    seconds = f"600.{os.getpid()}1"  # its process is `sleep <seconds>`: none other here

    def job_processes() -> list:
        return [p for p in psutil.process_iter(["cmdline"])
                if p.info["cmdline"] == ["sleep", seconds]]

    serve = serve_factory("--isolation", "none").start()
    first = serve.cli_popen("run", "--", "sh", "-c", f"exec sleep {seconds}")
    wait_for(lambda: [j["state"] for j in serve.cli_json("jobs")] == ["running"],
             what="the first job's record to say running")
    [job] = serve.cli_json("jobs")
    wait_for(job_processes, what="the job's process")
    holder = hold_write_lock(serve.state_dir / "motor.db")
    try:
        second = serve.cli_popen("run", "--", "echo", "second")  # its acceptance waits
        wait_for(lambda: lock_causes(serve), what="health to name the held write lock")
        assert second.poll() is None
        started = time.monotonic()
        cancel = serve.cli("cancel", job["job_id"], timeout=20)
        assert cancel.returncode == 0, cancel.stderr.decode()
        assert time.monotonic() - started < 10
        wait_for(lambda: not job_processes(), timeout=10, what="the job's process to be gone")
        assert first.poll() is None  # its end is not written yet
    finally:
        release(holder)
    out1, err1 = first.communicate(timeout=60)
    out2, err2 = second.communicate(timeout=60)
    assert first.returncode == 130, err1
    assert (second.returncode, out2) == (0, b"second\n"), err2
    states = {j["job_id"]: j["state"] for j in serve.cli_json("jobs")}
    assert states[job["job_id"]] == "cancelled"
    assert serve.stop() == 0
    assert "Traceback" not in serve.log.read_text()


def test_a_queued_jobs_live_wait_and_heartbeats_go_on_while_the_dispatcher_waits_on_the_lock(
        serve_factory, tmp_path):
    """The queued job's wait fields in `motor jobs` and its follower's heartbeats are read
    from the dispatcher's machine (readers, stop 51) while it waits on a save under another
    process's lock: the wait goes on counting in both, every heartbeat_s (1 s)."""
    from motor.client import Client

    gate = tmp_path / "gate"
    serve, first, queued_id = running_and_queued(serve_factory, gate)
    holder = hold_write_lock(serve.state_dir / "motor.db")
    beats: list[dict] = []
    try:
        third = serve.cli_popen("run", "--weight", "1", "--", "echo", "third")  # its acceptance waits
        wait_for(lambda: lock_causes(serve), what="health to name the held write lock")

        def follow():
            with Client(socket_path=serve.socket) as client:
                for event in client.events(queued_id, raw=True):
                    beats.append(event)
                    if event["event"] == "terminal":
                        return

        threading.Thread(target=follow, daemon=True).start()
        waits = []
        for _ in range(2):
            jobs = {j["job_id"]: j for j in serve.cli_json("jobs", timeout=5)}
            assert jobs[queued_id]["state"] == "queued"
            waits.append(jobs[queued_id]["queue_wait_ms"])
            time.sleep(1.2)
        assert waits[1] - waits[0] >= 1000, waits  # counted live, not the stored value
        # the stored `queued` event, then a heartbeat each second, its wait counted on
        wait_for(lambda: sum(e["event"] == "queued" for e in beats) >= 3, timeout=10,
                 what="the follower's heartbeats while the lock is held")
        [_, *heartbeats] = [e["queue_wait_ms"] for e in beats if e["event"] == "queued"]
        assert heartbeats == sorted(heartbeats) and heartbeats[-1] - heartbeats[0] >= 900
        assert third.poll() is None and lock_causes(serve)  # all of it under the held lock
    finally:
        release(holder)
        gate.touch()
    for proc, out in ((first, b"first\n"), (third, b"third\n")):
        stdout, stderr = proc.communicate(timeout=60)
        assert (proc.returncode, stdout) == (0, out), stderr
    wait_for(lambda: beats and beats[-1]["event"] == "terminal", timeout=30,
             what="the queued job's end")
    assert beats[-1]["record"]["state"] == "succeeded"
    assert serve.stop() == 0


def test_a_queued_jobs_cancel_under_the_lock_is_answered_busy_and_carried_out_after(
        serve_factory, tmp_path):
    """A queued job's cancel changes the queue: under another process's lock it waits for
    the dispatcher, which waits on a save. After its bound (CHANGE_TIMEOUT_S) the runner
    answers 503 `runner_busy` saying it is queued, the client waiting longer for that
    answer (before stop 52 the answer did not say so, and `motor cancel`, bound by the
    same 30 s, got it or exited 69, "no runner answered"), and once the lock is free the
    job ends cancelled. The runner's bound is set to 2 s here (`change_timeout_s`); the
    client waits as it always does (CHANGE_ANSWER_S, 45 s)."""
    change_under_the_lock(serve_factory, tmp_path, "cancel", "cancelled")


def test_a_queued_jobs_withdraw_under_the_lock_is_answered_busy_and_carried_out_after(
        serve_factory, tmp_path):
    """The same for a withdraw, which `change_timeout_s` bounds too: answered 503
    `runner_busy` after 2 s, and once the lock is free the job ends withdrawn
    (`refused_before_start`)."""
    change_under_the_lock(serve_factory, tmp_path, "withdraw", "refused_before_start")


def change_under_the_lock(serve_factory, tmp_path, command: str, ended: str) -> None:
    """`motor <command>` of a queued job while another process holds the write lock, on a
    runner whose `change_timeout_s` is 2 s: answered busy after that bound, and carried
    out (the job ends `ended`) once the lock is free."""
    gate = tmp_path / "gate"
    serve, first, queued_id = running_and_queued(serve_factory, gate,
                                                 *short_change_timeout(tmp_path))
    holder = hold_write_lock(serve.state_dir / "motor.db")
    try:
        third = serve.cli_popen("run", "--weight", "1", "--workspace", "c", "--", "true")
        wait_for(lambda: lock_causes(serve), what="health to name the held write lock")
        started = time.monotonic()
        change = serve.cli(command, queued_id, timeout=90)
        waited = time.monotonic() - started
        err = change.stderr.decode()
        assert change.returncode == 1, err
        assert "runner_busy" in err and f"this {command} waits in its queue" in err, err
        assert 2 <= waited < 25, waited  # at the runner's bound of 2 s, not its default 30
    finally:
        release(holder)
        gate.touch()
    wait_for(lambda: {j["job_id"]: j["state"] for j in serve.cli_json("jobs")}[queued_id]
             == ended, what=f"the queued job to end {ended}")
    for proc in (first, third):
        assert proc.wait(60) == 0
    assert serve.stop() == 0


@pytest.mark.parametrize("seconds", [0, -1, 31, float("inf"), float("nan")])
def test_a_change_timeout_outside_its_range_is_refused(seconds):
    """`change_timeout_s` is above 0 and at most wire.CHANGE_TIMEOUT_S: the clients wait
    CHANGE_ANSWER_S for a cancel's answer, so a longer bound would be cut off by them."""
    assert RunnerConfig().change_timeout_s == CHANGE_TIMEOUT_S == 30
    assert build_config({"change_timeout_s": 0.5}, {}).change_timeout_s == 0.5
    with pytest.raises(ConfigError, match="change_timeout_s must be above 0 and at most 30"):
        build_config({"change_timeout_s": seconds}, {})


READ = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN")
conn.execute("SELECT count(*) FROM jobs").fetchone()  # a snapshot, held until a line comes
print("reading", flush=True)
sys.stdin.readline()
conn.execute("COMMIT")
"""


def test_a_read_transaction_held_elsewhere_makes_health_say_why_the_wal_grows(serve_factory):
    """Another process inside a read transaction keeps the WAL from starting over: it grows
    with every write (stop 60's probe: 137 MiB over 2,000 jobs, health `ok`). Health now says
    so, with the WAL's size; once the reader ends, the WAL goes back to its 8 MiB and health
    to `ok`."""
    serve = serve_factory("--isolation", "none").start()
    assert serve.cli("run", "--", "true").returncode == 0
    reader = subprocess.Popen([sys.executable, "-c", READ, str(serve.state_dir / "motor.db")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout.readline().strip() == "reading"
        for _ in range(5):  # 8 MB of output each, stored as it comes
            result = serve.cli("run", "--", "sh", "-c", "head -c 8000000 /dev/zero | tr '\\0' x",
                               timeout=60)
            assert result.returncode == 0
        health = serve.cli_json("health")
        assert health["store"]["wal_bytes"] > 32 * 2**20, health["store"]
        causes = [d["cause"] for d in health["degraded"] if d["subsystem"] == "store"]
        assert any("cannot start over" in c and "read transaction" in c for c in causes), health
    finally:
        reader.communicate("\n", timeout=10)
    assert reader.returncode == 0

    def back():
        serve.cli("run", "--", "true")  # a commit after a complete round starts it over
        health = serve.cli_json("health")
        return health["status"] == "ok" and health["store"]["wal_bytes"] <= 8 * 2**20

    wait_for(back, timeout=30, what="the WAL to start over and health to be ok")
