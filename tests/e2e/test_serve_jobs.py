"""End to end: a real `python -m motor serve` on a temporary socket, driven by the CLI."""

from __future__ import annotations

import os
import stat
import time

import pytest
from polling import json_lines, wait_for

pytestmark = pytest.mark.e2e


def test_run_exits_with_the_jobs_exit_status(serve):
    result = serve.cli("run", "--", "sh", "-c", "echo to-out; echo to-err >&2; exit 3")
    assert result.returncode == 3, result.stderr
    assert result.stdout == b"to-out\n"
    assert result.stderr == b"to-err\n"


def test_run_writes_out_exactly_the_bytes_the_job_wrote(serve, tmp_path):
    """Stop 58: bytes that are not UTF-8 (a tar, a compressed log, a binary; a character
    the output's end cuts short) came out of `motor run` and `motor attach` as U+FFFD, and
    the cut character not at all: `motor run -- cat some.tar > copy` was not a copy. Now
    they come in `data_b64` beside the text, and the CLI writes them out as they were."""
    blob = tmp_path / "blob"
    blob.write_bytes(os.urandom(300_000) + "é".encode()[:1])
    result = serve.cli("run", "--", "sh", "-c", f"cat {blob}; cat {blob} >&2")
    assert result.returncode == 0
    assert result.stdout == result.stderr == blob.read_bytes()
    events = json_lines(serve.cli("run", "--json", "--", "printf", "ok \\377\\n").stdout)
    [out] = [e for e in events if e["event"] == "output"]
    assert out["data"] == "ok \ufffd\n" and out["data_b64"] == "b2sg/wo="
    job_id = events[0]["job_id"]
    assert serve.cli("attach", job_id).stdout == b"ok \xff\n"


def test_signal_death_exits_128_plus_n(serve):
    result = serve.cli("run", "--", "sh", "-c", "kill -TERM $$")
    assert result.returncode == 128 + 15


def test_socket_is_private(serve):
    mode = stat.S_IMODE(os.stat(serve.socket).st_mode)
    assert mode == 0o600


def test_job_affinity_equals_the_cpus_in_its_record(serve):
    result = serve.cli("run", "--json", "--weight", "1", "--",
                       "sh", "-c", "grep Cpus_allowed_list /proc/self/status")
    assert result.returncode == 0, result.stderr
    events = json_lines(result.stdout)
    started = next(e for e in events if e["event"] == "started")
    output = "".join(e["data"] for e in events if e["event"] == "output")
    terminal = events[-1]
    assert terminal["event"] == "terminal"
    assert terminal["record"]["cpus"] == started["cpus"]
    assert len(started["cpus"]) == 1
    allowed = output.split(":", 1)[1].strip()
    assert allowed == str(started["cpus"][0])


def test_keeperd_runs_beside_a_started_affinity_job_not_on_its_cpu(serve_factory, tmp_path):
    """Issue 14, through `motor serve` with affinity: once a job is recorded running
    (keeperd has answered its spawn), keeperd may run only on the CPUs the job was not
    given, and the job only on its own (docs/keeper.md, "Leaving the job's CPUs")."""
    import psutil

    cpus = set(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("one CPU: keeperd and the job share it whatever keeperd does")
    barrier = tmp_path / "go"
    serve = serve_factory("--isolation", "affinity").start()
    job_id = serve.cli_json("submit", "--weight", "1", "--", "sh", "-c",
                            f"while [ ! -e {barrier} ]; do sleep 0.01; done")["job_id"]
    try:
        record = wait_for(lambda: next((r for r in serve.cli_json("jobs", "--all")
                                        if r["job_id"] == job_id and r["state"] == "running"),
                                       None), what="the job recorded running")
        keeperd = psutil.Process(int((serve.state_dir / "keeperd.lock").read_text()))
        assert set(keeperd.cpu_affinity()) == cpus - set(record["cpus"])
        (job,) = [c for c in keeperd.children() if c.name() == "sh"]
        assert job.cpu_affinity() == record["cpus"]
    finally:
        barrier.touch()
    assert serve.cli("attach", job_id).returncode == 0  # it ends as it should


def test_claims_are_exact_and_unsized_jobs_always_claim_two(serve):
    """The claim is exactly weight_hint, else 2; the command's -j and env never change it."""
    unsized = serve.cli_json("submit", "--env", "CARGO_BUILD_JOBS=16", "--", "make", "-j16")
    assert unsized["claim"] == 2
    sized = serve.cli_json("submit", "--weight", "1", "--workspace", "w2", "--", "make", "-j8")
    assert sized["claim"] == 1
    for job in (unsized, sized):
        serve.cli("cancel", job["job_id"])


def test_oversized_and_zero_claims_are_refused_before_start_with_limit_detail(serve):
    limit = len(os.sched_getaffinity(0)) if len(os.sched_getaffinity(0)) < 8 else None
    for weight in ("0", "999"):
        result = serve.cli("submit", "--weight", weight, "--", "true")
        assert result.returncode == 75, result
        line = result.stderr.decode().strip()
        assert line.startswith("motor: refused: runner_full: "), line
        assert "limit" in line
        if limit is not None:
            assert f"{limit} vCPUs" in line or f"limit of {limit}" in line, line
    assert serve.cli_json("jobs", "--all") == []  # refused before any record was accepted
    health = serve.cli_json("health")
    assert health["admission_refusals"]["runner_full"] == 2


def test_oversized_vcpu_refusal_detail_reaches_the_run_terminal(serve):
    result = serve.cli("run", "--weight", "999", "--", "true")
    assert result.returncode == 75
    assert result.stderr.decode().startswith("motor: refused: runner_full: ")
    assert "999" in result.stderr.decode() and "limit" in result.stderr.decode()
    as_json = serve.cli("run", "--json", "--weight", "999", "--", "true")
    assert as_json.returncode == 75
    last = json_lines(as_json.stdout)[-1]
    assert last["event"] == "terminal"
    assert last["record"]["state"] == "refused_before_start"
    assert last["record"]["reason"] == "runner_full"
    assert "limit" in last["record"]["detail"]


def test_records_and_output_survive_a_restart(serve_factory):
    serve = serve_factory().start()
    result = serve.cli("run", "--json", "--", "sh", "-c", "echo kept")
    job_id = json_lines(result.stdout)[-1]["record"]["job_id"]
    assert serve.stop() == 0
    serve.start()
    record = serve.cli_json("jobs", "--all")
    assert [r["job_id"] for r in record] == [job_id]
    replay = serve.cli("attach", job_id, "--from-seq", "0")
    assert replay.returncode == 0
    assert replay.stdout == b"kept\n"


def test_only_one_runner_per_state_dir(serve, serve_factory):
    second = serve_factory(state_dir=serve.state_dir)
    second.args += ["--socket", str(serve.state_dir / "other.sock")]
    with pytest.raises(RuntimeError, match="in use by another runner"):
        second.start()
    assert second.proc.returncode == 2


def test_a_second_runner_is_refused_even_after_runner_lock_was_removed(serve, serve_factory):
    """`rm runner.lock` (a "stale lock" cleaned by hand) used to let a second runner start
    beside the live one: the state dir itself is locked too."""
    (serve.state_dir / "runner.lock").unlink()
    second = serve_factory(state_dir=serve.state_dir)
    second.args += ["--socket", str(serve.state_dir / "other.sock")]
    with pytest.raises(RuntimeError, match=f"in use by another runner \\(pid {serve.proc.pid}\\)"):
        second.start()
    assert second.proc.returncode == 2
    assert serve.cli("run", "--", "echo", "still").stdout == b"still\n"


def test_bad_serve_options_print_one_line_and_exit_2(serve_factory, tmp_path):
    for args in (["--max-weight", "x"], ["--isolation", "bogus"], ["--no-such-option"],
                 ["--linux-cpus", ""], ["--linux-cpus", "0", "--max-weight", "0"],
                 ["--linux-cpus", "4096"], ["--config", str(tmp_path / "missing.toml")]):
        s = serve_factory(state_dir=tmp_path / "bad")
        s.args += args
        with pytest.raises(RuntimeError):
            s.start()
        assert s.proc.returncode == 2, args
        lines = [l for l in s.log.read_text().splitlines() if l.strip()]
        assert len(lines) == 1, (args, lines)
        assert lines[0].startswith("motor: error:") or "usage" not in lines[0], lines
        s.log.unlink()


@pytest.mark.parametrize("lock", ["keeperd.lock", "keeperd.start.lock"])
def test_a_keeperd_lock_that_cannot_be_used_stops_serve_with_one_line_and_exit_4(
        serve_factory, tmp_path, lock):
    """Before stop 49: a traceback and status 1."""
    s = serve_factory(state_dir=tmp_path / "state")
    (s.state_dir / lock).mkdir(parents=True)
    with pytest.raises(RuntimeError):
        s.start()
    assert s.proc.returncode == 4
    lines = [l for l in s.log.read_text().splitlines() if l.strip() and "without a journal" not in l
             and not l.startswith("start-up sweep: left alone:")]  # another runner's groups
    assert lines == [lines[0]] and lines[0].startswith("motor: error: the jobs' keeper: "), lines
    assert "[Errno 21] Is a directory" in lines[0] and lines[0].endswith(f"{lock}'")


def test_a_socket_file_removed_under_serve_is_bound_again_and_serves(serve):
    """Through `motor serve` (its check every SOCKET_CHECK_S, 2 s): the CLI reaches the
    runner again without a restart, with the socket's mode; the log says so."""
    os.unlink(serve.socket)
    assert serve.cli("health").returncode == 69  # no runner answers there now
    wait_for(serve.socket.exists, timeout=30, what="the socket file bound again")
    assert stat.S_IMODE(os.stat(serve.socket).st_mode) == 0o600
    assert serve.cli("run", "--weight", "1", "--", "true").returncode == 0
    assert "motor.sock was removed: listening on it again" in serve.log.read_text()


def test_cancel_and_withdraw(serve):
    running = serve.cli_json("submit", "--workspace", "c1", "--", "sleep", "60")
    queued = serve.cli_json("submit", "--workspace", "c1", "--", "true")  # behind its owner
    assert serve.cli("withdraw", queued["job_id"]).stdout.strip() == b"withdrawn"
    withdrawn = json_lines(serve.cli("attach", "--json", queued["job_id"]).stdout)[-1]["record"]
    assert withdrawn["state"] == "refused_before_start"
    assert withdrawn["reason"] == "queue_wait_exceeded"
    wait_for(lambda: serve.cli_json("status")["running"], what="the sleeper to run")
    assert serve.cli("withdraw", running["job_id"]).stdout.strip() == b"started"
    assert serve.cli("cancel", running["job_id"]).returncode == 0
    result = serve.cli("attach", running["job_id"])
    assert result.returncode == 130
    assert serve.cli("cancel", running["job_id"]).returncode == 0  # idempotent


def test_every_job_through_serve_starts_from_the_runners_environment_and_a_request_env_stays_its_own(
        serve_factory):
    """The runner's environment is decoded once and shared by every job's start (jobdir
    `runner_environ`): each job sees the runner's variable, a request's `--env` overrides it
    for that job only, and the next job sees the runner's value again."""
    runner = serve_factory()
    runner.env = {"MOTOR_TEST_VAR": "from-serve"}
    runner.start()
    show = ["--", "sh", "-c", 'echo "[${MOTOR_TEST_VAR-unset}]"']
    assert runner.cli("run", *show).stdout == b"[from-serve]\n"
    assert runner.cli("run", "--env", "MOTOR_TEST_VAR=mine", *show).stdout == b"[mine]\n"
    assert runner.cli("run", *show).stdout == b"[from-serve]\n"


def test_only_one_runner_per_workspace_root(serve_factory, tmp_path):
    """Two runners with their own state dirs on one --workspace-root: each evicts and caps
    the workspaces it finds idle there, so the second is refused (before stop 60 it started,
    and could delete a workspace under the first one's running job). Each on a root of its
    own, both run."""
    shared = tmp_path / "shared-root"
    first = serve_factory("--workspace-root", str(shared), state_dir=tmp_path / "one").start()
    second = serve_factory("--workspace-root", str(shared), state_dir=tmp_path / "two")
    with pytest.raises(RuntimeError, match=rf"workspace root {shared} is in use by another "
                                           rf"runner \(pid {first.proc.pid}\)"):
        second.start()
    assert second.proc.returncode == 2
    assert (shared / ".motor-root.lock").read_text() == f"{first.proc.pid}\n"
    third = serve_factory("--workspace-root", str(tmp_path / "own-root"),
                          state_dir=tmp_path / "three").start()
    assert third.cli("run", "--", "true").returncode == 0
    assert first.cli("run", "--", "true").returncode == 0
    assert first.stop() == 0
    second.start()  # free once the first has stopped
    assert second.cli("run", "--", "true").returncode == 0


def test_serve_logs_each_jobs_end_at_info_and_only_warnings_at_warning(serve_factory):
    """`motor serve` writes its log to standard error (the journal under systemd). Before
    stop 62 it configured no logging: only warnings came out (Python's last-resort
    handler), and each job's end, recoveries, adoptions and the disk manager's deletions
    (info) were written nowhere. `--log-level` (default info) says what is written."""
    serve = serve_factory("--isolation", "none").start()
    result = serve.cli("run", "--json", "--", "sh", "-c", "exit 3")
    assert result.returncode == 3
    job_id = json_lines(result.stdout)[0]["job_id"]
    assert serve.stop() == 0
    log = serve.log.read_text()
    assert f"job-{job_id}: failed (exit 3)\n" in log, log
    assert "runner: SIGTERM, stopping (running jobs keep running)" in log
    assert "exited normally" not in log  # the supervisors' own bookkeeping: debug
    serve.args += ["--log-level", "warning"]
    seen = len(serve.log.read_bytes())
    serve.start()
    assert serve.cli("run", "--", "true").returncode == 0
    assert serve.stop() == 0
    quiet = serve.log.read_text()[seen:]
    assert "listening on" in quiet and "succeeded" not in quiet and "SIGTERM" not in quiet


def test_serve_a_deep_workspaces_clocks_pause_then_advance_to_their_budget(serve_factory, tmp_path):
    """A workspace queue longer than the core's LAZY_RUN_MIN (32) has its queue-wait clocks
    changed as one entry of its run log (stop 62, docs/scheduling.md "Long runs of clocks
    are logged"), through `motor serve` and its HTTP API: 40 runner-enforced jobs queued in
    D stay paused while hD owns D; when hD ends, e1 (waiting for permits, first in the
    rotation) takes the permit, D is free, and their clocks advance until each budget
    (3 s) runs out: each ends queue_wait_exceeded about 3 s after hD's end, not before."""
    from motor.client import Client

    go = {name: tmp_path / f"go-{name}" for name in ("hX", "hD", "e1")}

    def barrier(name, ws):
        return {"command": ["sh", "-c", f"while [ ! -e {go[name]} ]; do sleep 0.02; done"],
                "workspace": ws, "weight_hint": 1}

    serve = serve_factory("--isolation", "none", "--max-weight", "2",
                          "--max-queue-depth", "100").start()
    try:
        with Client(serve.socket, timeout=30) as client:
            hX, hD = client.submit(barrier("hX", "X")), client.submit(barrier("hD", "D"))
            wait_for(lambda: {client.get(j.job_id).state for j in (hX, hD)} == {"running"},
                     timeout=30, what="the holders to run")
            e1 = client.submit(barrier("e1", "E"))
            deep = [client.submit({"command": ["true"], "workspace": "D", "weight_hint": 1,
                                   "queue_wait_limit_s": 3}) for _ in range(40)]
            time.sleep(1.5)
            assert {client.get(j.job_id).queue_wait_ms for j in deep} == {0}  # paused
            go["hD"].touch()
            wait_for(lambda: client.get(e1.job_id).state == "running", timeout=30,
                     what="e1 to take the permit")
            freed_at_ms = client.get(hD.job_id).ended_at_ms
            ends = [wait_for(lambda j=j: (r := client.get(j.job_id)).state != "queued" and r,
                             timeout=30, what="a deep job to end") for j in deep]
        for record in ends:
            assert (record.state, record.reason) == ("refused_before_start",
                                                     "queue_wait_exceeded"), record
            assert 3_000 <= record.queue_wait_ms < 3_500, record
            assert 2_900 <= record.ended_at_ms - freed_at_ms < 3_800, record
    finally:
        for path in go.values():
            path.touch()
    assert serve.stop() == 0
