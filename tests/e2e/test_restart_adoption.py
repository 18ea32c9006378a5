"""Jobs outlive the runner: kill -9 of `serve` while a job runs, then a restart."""

from __future__ import annotations

import json
import select
import shutil
import signal
import socket
import sqlite3

import psutil
import pytest

from motor.client import Client
from job_markers import marked_processes
from polling import json_lines, wait_for

pytestmark = pytest.mark.e2e


def test_kill_9_then_restart_readopts_the_running_job(serve_factory, tmp_path):
    barrier = tmp_path / "go"
    serve = serve_factory().start()
    job_id, _ = _ended_while_down(serve, barrier, "echo after; exit 7")  # it printed more
    serve.start()
    result = serve.cli("attach", "--json", job_id, "--from-seq", "0")
    events = json_lines(result.stdout)
    output = "".join(e["data"] for e in events if e["event"] == "output")
    assert output == "before\nafter\n"
    assert events[-1]["record"]["exit_code"] == 7
    assert result.returncode == 7


def test_restarted_runner_counts_a_still_running_jobs_cpus(serve_factory, tmp_path):
    barrier = tmp_path / "go"
    serve = serve_factory().start()
    job_id = _held_job(serve, barrier, "echo after; exit 5")
    cpus = serve.cli_json("status")["running"][0]["cpus"]
    serve.kill9()
    serve.start()

    health = serve.cli_json("health")
    assert health["cpus"]["jobs"] == {job_id: cpus}
    assert health["capacity"]["held_permits"] == 1
    status = serve.cli_json("status")
    assert [r["job_id"] for r in status["running"]] == [job_id]
    assert "reservation_use" not in status["running"][0]  # absent until measured, never null

    barrier.write_text("")
    result = serve.cli("attach", job_id, "--from-seq", "0")
    assert result.returncode == 5
    assert result.stdout == b"before\nafter\n"
    wait_for(lambda: serve.cli_json("health")["capacity"]["held_permits"] == 0,
             what="permits to be released")


@pytest.mark.parametrize("claim", [b"{not json", b"[1, 2]", b'{"keeper_pid": "12"}', None])
def test_a_running_jobs_damaged_keeper_claim_stops_its_processes_and_it_ends(
        serve_factory, tmp_path, claim):
    """keeper.json of a job that still runs, damaged while the runner was down: the runner
    cannot follow a keeper it cannot name. Before stop 48 the job's actor crashed at every
    start until the execution supervisor gave up and `serve` stopped. Now the job's
    processes (its marker) are stopped, it ends (lost, or failed by the kill when keeperd
    recorded it first), and the runner serves on. A claim removed (None) is the same: before
    stop 49 the job was spawned a second time and its actor then crashed, the second run
    left running unfollowed and the job shown running for good."""
    serve = serve_factory().start()
    job = serve.cli_json("submit", "--weight", "1", "--",
                         "sh", "-c", "echo before; while :; do echo tick; sleep 0.05; done")
    job_id = job["job_id"]
    claim_file = serve.state_dir / "jobs" / job_id / "keeper.json"
    # keeperd completes the claim with the job's pid once the job has run 0.1 s (the claim
    # at the spawn has "job_pid": null): the damage comes after that, or it is overwritten.
    # The submit is answered once the job is accepted: the claim may not be there yet (it
    # appears whole, linked: keeper.claim_job_dir)
    wait_for(lambda: claim_file.exists() and b'"job_pid":null' not in claim_file.read_bytes(),
             what="keeperd's full claim")
    serve.kill9()
    assert marked_processes(job_id)  # it runs on under its keeper
    if claim is None:
        claim_file.unlink()
    else:
        claim_file.write_bytes(claim)
    serve.start()
    record = json_lines(serve.cli("attach", "--json", job_id, "--from-seq", "0").stdout)[-1]["record"]
    assert record["state"] == "lost" or (record["state"], record["signal"]) == ("failed", 9), record
    # the record says why (before stop 59 a job ended by the kill had no detail: only the log)
    assert "the runner stopped the job's processes when it adopted the job: its keeper's claim " \
           "names no keeper (" in record["detail"], record
    wait_for(lambda: not marked_processes(job_id), what="its processes to be stopped")
    assert "claim cannot be read" in serve.log.read_text()
    assert "crashed" not in serve.log.read_text()  # (a claim removed: spawned again, then this)
    assert serve.cli("run", "--", "true").returncode == 0  # it serves on


def test_a_running_job_whose_record_cannot_be_read_is_stopped_at_a_restart(serve_factory):
    """A job that runs on under its keeper while the runner is down, its record damaged
    meanwhile (its command not a list): the runner cannot adopt what it cannot read
    (motor/store/salvage.py), so at start-up it stops the job's processes by their marker
    (with affinity no group holds them), shows the job lost, and serves on."""
    serve = serve_factory("--isolation", "affinity").start()
    job_id = serve.cli_json("submit", "--weight", "1", "--",
                            "sh", "-c", "echo before; exec sleep 600")["job_id"]
    wait_for(lambda: _has_output(serve, job_id, "before"), what="first line")
    serve.kill9()
    assert marked_processes(job_id)
    conn = sqlite3.connect(serve.state_dir / "motor.db")
    [(raw,)] = conn.execute("SELECT record FROM jobs WHERE job_id=?", (job_id,))
    conn.execute("UPDATE jobs SET record=? WHERE job_id=?",
                 (json.dumps({**json.loads(raw), "command": "sleep 600"}).encode(), job_id))
    conn.commit()
    conn.close()
    serve.start()
    wait_for(lambda: not marked_processes(job_id), what="its processes to be stopped")
    record = next(r for r in serve.cli_json("jobs", "--all") if r["job_id"] == job_id)
    assert (record["state"], record["reason"]) == ("lost", "record_unreadable")
    assert "whose record cannot be read, left processes" in serve.log.read_text()
    assert serve.cli("run", "--", "true").returncode == 0


def _has_output(serve, job_id: str, text: str) -> bool:
    record_dir = serve.state_dir / "jobs" / job_id / "output.log"
    return record_dir.exists() and text.encode() in record_dir.read_bytes()


def _held_job(serve, barrier, then: str) -> str:
    """A job that prints `before`, waits for `barrier` to exist, then runs `then`: its id,
    once `before` is in its output."""
    job_id = serve.cli_json(
        "submit", "--weight", "1", "--",
        "sh", "-c", f"echo before; while [ ! -e {barrier} ]; do sleep 0.01; done; {then}",
    )["job_id"]
    wait_for(lambda: _has_output(serve, job_id, "before"), what="first line")
    return job_id


def _ended_while_down(serve, barrier, then: str):
    """`_held_job`, the runner killed (-9), then the job let go: (its id, its status.json),
    once its keeper recorded its end with no runner watching."""
    job_id = _held_job(serve, barrier, then)
    serve.kill9()
    barrier.write_text("")  # the runner is gone: the job goes on under its keeper
    status = serve.state_dir / "jobs" / job_id / "status.json"
    wait_for(status.exists, what="the keeper to record the exit status")
    return job_id, status


# -- keeperd: one keeper per state dir that outlives the runner (motor/execution/keeperd.py) --


def _keeperd(serve):
    """The state dir's keeperd (its pid is written into keeperd.lock, which it holds)."""
    import psutil

    pid = int((serve.state_dir / "keeperd.lock").read_text())
    proc = psutil.Process(pid)
    assert any("keeperd" in part for part in proc.cmdline()), proc.cmdline()
    return proc


def test_keeperd_survives_a_runner_kill_9_and_the_restarted_runner_reconnects(
        serve_factory, tmp_path):
    barrier = tmp_path / "go"
    serve = serve_factory()
    serve.env = {"MOTOR_SPAWNER": "keeperd"}
    serve.start()
    job_id = _held_job(serve, barrier, "seq 1 20000; echo after; exit 4")
    keeperd = _keeperd(serve)
    kept = json.loads((serve.state_dir / "jobs" / job_id / "keeper.json").read_text())
    assert (kept["keeper_pid"], kept["kind"]) == (keeperd.pid, "keeperd")
    assert keeperd.pid not in {c.pid for c in psutil.Process(serve.proc.pid).children()}
    serve.kill9()
    assert keeperd.is_running()

    serve.start()  # reconnects to the same keeperd and adopts the job while it runs
    assert serve.cli_json("status")["running"][0]["job_id"] == job_id
    barrier.write_text("")
    result = serve.cli("attach", job_id, "--from-seq", "0")
    assert result.returncode == 4
    expected = "before\n" + "".join(f"{i}\n" for i in range(1, 20001)) + "after\n"
    assert result.stdout.decode() == expected  # output complete across the restart
    # new jobs go to the same keeperd: there is one per state dir
    again = serve.cli("run", "--weight", "1", "--", "sh", "-c", "echo again")
    assert again.returncode == 0 and again.stdout == b"again\n"
    assert _keeperd(serve).pid == keeperd.pid


def test_a_keeperd_that_does_not_answer_makes_health_degraded_until_it_does(serve_factory):
    """keeperd stopped (SIGSTOP: a hang) while a job waits for its spawn: before stop 59
    health said `ok` while jobs stayed in set-up, 30 s at a time, then were retried. Now,
    once a spawn has waited SPAWN_STALLED_S, health is `degraded` under `execution`, naming
    keeperd's pid; resumed, keeperd spawns the job, it runs once, and health is `ok`."""
    from motor.execution.spawner import SPAWN_STALLED_S

    serve = serve_factory().start()
    assert serve.cli("run", "--", "true").returncode == 0  # keeperd up
    keeperd = _keeperd(serve)
    keeperd.suspend()
    try:
        run = serve.cli_popen("run", "--", "echo", "spawned")

        def stalled():
            health = serve.cli_json("health")
            return [d["cause"] for d in health.get("degraded", [])
                    if d["subsystem"] == "execution" and "spawn has waited" in d["cause"]]
        causes = wait_for(stalled, timeout=SPAWN_STALLED_S + 20, what="health to name the wait")
        assert f"keeperd, pid {keeperd.pid}" in causes[0], causes
        assert run.poll() is None
    finally:
        keeperd.resume()
    out, err = run.communicate(timeout=60)
    assert (run.returncode, out) == (0, b"spawned\n"), err
    wait_for(lambda: serve.cli_json("health")["status"] == "ok", what="health ok again")


def test_keeperd_whose_socket_was_removed_is_asked_to_listen_again_at_a_restart(
        serve_factory, tmp_path):
    """keeperd.sock removed while the runner is down (a clean-up of old files), keeperd and
    its job still running: before stop 49 the restarted runner found nothing on the socket,
    started a second keeperd, which could not take the lock, and `serve` exited 1 at every
    start. Now the runner asks the lock holder to listen again (SIGUSR1), adopts its job
    and serves on; the job's output is whole."""
    barrier = tmp_path / "go"
    serve = serve_factory().start()
    job_id = _held_job(serve, barrier, "echo after; exit 4")
    keeperd = _keeperd(serve)
    serve.kill9()
    (serve.state_dir / "keeperd.sock").unlink()
    serve.start()
    assert serve.cli_json("status")["running"][0]["job_id"] == job_id
    barrier.write_text("")
    result = serve.cli("attach", job_id, "--from-seq", "0")
    assert (result.returncode, result.stdout) == (4, b"before\nafter\n")
    assert _keeperd(serve).pid == keeperd.pid  # the same keeperd, listening again
    assert "listening on it again" in (serve.state_dir / "keeperd.log").read_text()
    assert serve.cli("run", "--weight", "1", "--", "true").returncode == 0


def test_keeperd_killed_its_jobs_end_lost_and_a_new_keeperd_runs_new_jobs(serve_factory):
    serve = serve_factory()
    serve.env = {"MOTOR_SPAWNER": "keeperd"}
    serve.start()
    job_id = serve.cli_json("submit", "--weight", "1", "--",
                            "sh", "-c", "echo up; exec sleep 1000")["job_id"]
    wait_for(lambda: _has_output(serve, job_id, "up"), what="the job to run")
    keeperd = _keeperd(serve)
    keeperd.kill()
    keeperd.wait(10)

    result = serve.cli("attach", "--json", job_id)
    record = json_lines(result.stdout)[-1]["record"]
    assert (record["state"], record["reason"]) == ("lost", "keeper_lost"), record
    wait_for(lambda: not marked_processes(job_id), what="the lost job's processes to be killed")
    # the runner starts a new keeperd for the next job
    again = serve.cli("run", "--weight", "1", "--", "sh", "-c", "echo again")
    assert again.returncode == 0 and again.stdout == b"again\n", again
    assert _keeperd(serve).pid != keeperd.pid


def test_a_runner_switched_to_per_job_keepers_adopts_and_cancels_keeperd_jobs(
        serve_factory, tmp_path):
    barrier = tmp_path / "go"
    serve = serve_factory()
    serve.env = {"MOTOR_SPAWNER": "keeperd"}
    serve.start()
    waits = serve.cli_json("submit", "--weight", "1", "--workspace", "w1", "--", "sh", "-c",
                           f"echo before; while [ ! -e {barrier} ]; do sleep 0.01; done; "
                           "echo after; exit 6")["job_id"]
    sleeps = serve.cli_json("submit", "--weight", "1", "--workspace", "w2", "--",
                            "sh", "-c", "echo up; exec sleep 1000")["job_id"]
    wait_for(lambda: _has_output(serve, waits, "before") and _has_output(serve, sleeps, "up"),
             what="both jobs to run")
    serve.kill9()

    serve.env = {"MOTOR_SPAWNER": "forkserver"}
    serve.start()
    assert serve.cli("cancel", sleeps).returncode == 0  # through keeperd, for that job only
    record = json_lines(serve.cli("attach", "--json", sleeps).stdout)[-1]["record"]
    assert record["state"] == "cancelled", record
    barrier.write_text("")
    result = serve.cli("attach", waits, "--from-seq", "0")
    assert result.returncode == 6 and result.stdout == b"before\nafter\n"


def test_motor_run_across_a_restart_names_its_job_and_attach_follows_it_to_the_end(
        serve_factory, tmp_path):
    """`motor serve` stopped (SIGTERM: an upgrade) while `motor run` follows a job: the
    runner ends the stream cleanly and the client exits 69, naming the job, which keeps
    running; after the restart `motor attach` with that id replays it and ends with its
    exit status. The runner is stopped once `motor run` has printed the job's first line:
    output the job wrote since its actor's last read (`output_poll_s`) is not in the stream
    that the stop ends (a slowed keeperd, stop 83, put the stop in that window)."""
    barrier = tmp_path / "go"
    serve = serve_factory().start()
    run = serve.cli_popen(
        "run", "--weight", "1", "--",
        "sh", "-c", f"echo before; while [ ! -e {barrier} ]; do sleep 0.01; done; echo after; exit 7")
    wait_for(lambda: len(serve.cli_json("status")["running"]) == 1, what="the job to run")
    job_id = serve.cli_json("status")["running"][0]["job_id"]
    ready, _, _ = select.select([run.stdout], [], [], 30)
    assert ready, "motor run printed nothing in 30 s"
    assert run.stdout.readline() == b"before\n"
    assert serve.stop() == 0
    out, err = run.communicate(timeout=30)
    assert run.returncode == 69, err.decode()
    assert out == b""  # nothing more: the job waits at its barrier
    assert "the runner closed the stream before the job ended" in err.decode()
    assert f"follow it again with: motor attach {job_id}" in err.decode()

    serve.start()
    barrier.write_text("")
    result = serve.cli("attach", job_id, "--from-seq", "0")
    assert result.returncode == 7, result.stderr.decode()
    assert result.stdout == b"before\nafter\n"


def _submit_head(body: bytes) -> bytes:
    return (b"POST /v1/jobs HTTP/1.1\r\nhost: motor\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % len(body))


def _answer(sock: socket.socket) -> tuple[bytes, bytes]:
    """The whole answer until the runner closes the connection: (head, body)."""
    answer = b""
    while chunk := sock.recv(65536):
        answer += chunk
    sock.close()
    head, _, rest = answer.partition(b"\r\n\r\n")
    return head, rest


def _job_kept(serve, job_id: str) -> bool:
    with Client(serve.socket) as client:
        return client.get(job_id).job_id == job_id


def test_a_submit_in_flight_at_sigterm_is_answered_and_its_job_kept(serve_factory, request):
    """SIGTERM while a submit's body is still arriving: the runner stops accepting (its
    socket file goes first), but answers the request in flight (202, `connection: close`)
    before its dispatcher and store stop, and the job it accepted is there after the
    restart. Before: the request was cut (a reset, or a 500 with no body)."""
    serve = serve_factory().start()
    body = json.dumps({"command": ["true"], "workspace": "w", "weight_hint": 1}).encode()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    request.addfinalizer(sock.close)
    sock.settimeout(30)
    sock.connect(str(serve.socket))
    # the connection is the runner's (a first request answered on it), then a submit whose
    # body is cut short
    sock.sendall(b"GET /v1/health HTTP/1.1\r\nhost: motor\r\n\r\n")
    first = b""
    while b"\r\n\r\n" not in first:
        first += sock.recv(65536)
    length = int(first.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    while len(first.partition(b"\r\n\r\n")[2]) < length:
        first += sock.recv(65536)
    sock.sendall(_submit_head(body) + body[:10])
    serve.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: not serve.socket.exists(), what="the runner to stop accepting")
    assert serve.proc.poll() is None  # still answering what it has
    sock.sendall(body[10:])
    head, rest = _answer(sock)
    assert head.startswith(b"HTTP/1.1 202"), head + rest
    assert b"connection: close" in head.lower(), head
    job_id = json.loads(rest)["job_id"]
    assert serve.proc.wait(timeout=30) == 0
    serve.start()
    assert _job_kept(serve, job_id)


def test_a_connection_queued_at_sigterm_is_served_not_reset(serve_factory, request, tmp_path):
    """A client connects and sends its submit just after the stopping runner's accept loop
    stopped (a barrier there: `api.accepting_stopped`), so the connection waits in the
    kernel's queue with nothing left to accept it: the runner takes it from the queue and
    answers it, and the job it accepted is there after the restart. Before: trio's accept
    loop had closed the listener already (the connect refused; had the client connected
    sooner, a reset)."""
    gate = tmp_path / "accepting-stopped"
    request.addfinalizer(gate.touch)  # a failure here must not leave the runner at the barrier
    serve = serve_factory()
    serve.env = {"MOTOR_FAULTS": f"api.accepting_stopped=wait:{gate}"}
    serve.start()
    body = json.dumps({"command": ["true"], "workspace": "w", "weight_hint": 1}).encode()
    serve.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: gate.with_name(gate.name + ".reached").exists(),
             what="the runner's accept loop to stop")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    request.addfinalizer(sock.close)
    sock.settimeout(30)
    sock.connect(str(serve.socket))  # queued: nothing accepts any more
    sock.sendall(_submit_head(body) + body)
    gate.touch()
    head, rest = _answer(sock)
    assert head.startswith(b"HTTP/1.1 202"), head + rest
    job_id = json.loads(rest)["job_id"]
    assert serve.proc.wait(timeout=30) == 0
    serve.env = {}
    serve.start()
    assert _job_kept(serve, job_id)


def test_a_status_file_that_cannot_be_read_ends_the_job_lost_and_says_why(serve_factory, tmp_path):
    """A job that ended while the runner was down, its status.json then damaged (a disk
    fault, a hand edit): the restarted runner ends it `lost` (`keeper_lost`) with a detail
    that names the file and what is wrong with it, not "exited without recording an exit
    status", and serves on."""
    barrier = tmp_path / "go"
    serve = serve_factory().start()
    job_id, status = _ended_while_down(serve, barrier, "exit 4")
    status.write_text('{"exit_code": 4, ')
    serve.start()
    result = serve.cli("attach", "--json", job_id)
    record = json_lines(result.stdout)[-1]["record"]
    assert (record["state"], record["reason"]) == ("lost", "keeper_lost"), record
    assert record["detail"].startswith("the job's exit status cannot be read: "), record
    assert str(status) in record["detail"] and "corrupt JSON" in record["detail"], record
    assert serve.cli("run", "--weight", "1", "--", "true").returncode == 0


def test_a_job_directory_removed_while_its_job_runs_ends_it_lost_and_says_so(serve_factory, tmp_path):
    """`rm -rf <state>/jobs/<id>` while the job runs (a clean-up script gone wrong): keeperd
    cannot write the job's status there (it logs the exit status in keeperd.log), so the
    job ends `lost`; the detail says the directory was removed, not that the keeper
    "exited without recording an exit status". The runner serves on."""
    barrier = tmp_path / "go"
    serve = serve_factory().start()
    job_id = _held_job(serve, barrier, "exit 3")
    job_dir = serve.state_dir / "jobs" / job_id
    shutil.rmtree(job_dir)
    barrier.write_text("")
    record = json_lines(serve.cli("attach", "--json", job_id).stdout)[-1]["record"]
    assert (record["state"], record["reason"]) == ("lost", "keeper_lost"), record
    assert record["detail"] == (f"the job's exit status cannot be read: {job_dir} was removed "
                                "while the job ran, so its keeper could not record the job's "
                                "exit status there"), record
    wait_for(lambda: "is gone: its status is not written (exit status 3)"
             in (serve.state_dir / "keeperd.log").read_text(), what="keeperd's log line")
    assert serve.cli("run", "--weight", "1", "--", "true").returncode == 0
