"""At most one live process tree per job id, across a crash at any point of a job's start.

A job appends its shell's pid to a file (one line per run) and waits for a barrier. The
runner (and sometimes its forkserver) is killed with SIGKILL while the start is paused at
a named point (MOTOR_FAULTS, motor/faults.py), then restarted; the job must run
exactly once, or end in a typed terminal state without running at all, never twice.
"""

from __future__ import annotations

import os
import shutil

import psutil
import pytest

from job_markers import child_named, marked_processes
from polling import json_lines, wait_for
from private_cgroup import private_parent_name, remove_private_parent

pytestmark = pytest.mark.e2e


def _isolation():
    """The strongest backend this host has, under a parent group of the test's own."""
    from motor.isolation import IsolationError
    from motor.isolation.cgroup import detect

    try:
        if os.geteuid() == 0:
            detect()
            return ["--isolation", "cgroup", "--cgroup-parent", private_parent_name()]
    except IsolationError:
        pass
    return ["--isolation", "affinity"]


@pytest.fixture
def isolation():
    args = _isolation()
    yield args
    if "--cgroup-parent" in args:
        remove_private_parent(args[-1])

# (point, also kill the forkserver, release the paused process after the restart, runs)
CASES = [
    ("setup.begin", False, False, 1),  # the record says setup, nothing else exists
    ("forkserver.forked", False, True, 1),  # the keeper is forked, not claimed
    ("forkserver.forked", True, False, 1),
    ("forkserver.claimed", False, True, 1),  # keeper.json (the claim) written, not released
    ("forkserver.claimed", True, False, 0),
    ("keeper.spawned", True, True, 1),  # the job runs, keeper.json lacks its pid
]

# keeperd (one keeper for every job of the state dir, motor/execution/keeperd.py) pauses at the
# same named steps. (point, also kill keeperd, runs, end state): keeperd is shared and serves one
# request at a time, and a starting runner connects to it before it serves: a paused keeperd is
# released as the runner restarts (the restarted runner's requests queue behind the dead
# runner's), and killing keeperd loses what it kept: a claimed job that never ran ends lost, a
# running one ends lost and its processes are killed.
KEEPERD_CASES = [
    ("setup.begin", False, 1, "succeeded"),
    ("forkserver.forked", False, 1, "succeeded"),  # the request is in, no claim yet
    ("forkserver.forked", True, 1, "succeeded"),
    ("forkserver.claimed", False, 1, "succeeded"),  # claimed, the job not spawned
    ("forkserver.claimed", True, 0, "lost"),
    ("keeper.spawned", False, 1, "succeeded"),  # the job runs, keeper.json lacks its pid
    ("keeper.spawned", True, 1, "lost"),
    # the runner has keeperd's answer, its record still says setup (a fresh start's running
    # record waits for the job's next write: execution/core.py, JobRun.unsaved)
    ("setup.spawned", False, 1, "succeeded"),
]


def _submit_paused_at(serve_factory, tmp_path, isolation, point: str, spawner: str):
    """A runner (spawner `spawner`) whose job start waits at fault point `point`, and the
    job submitted: it appends its pid to `runs` when it runs, then waits for `go`.
    (serve, job_id, faults dir, runs file, barrier)."""
    faults = tmp_path / "faults"
    faults.mkdir()
    runs_file, barrier = tmp_path / "runs", tmp_path / "go"
    serve = serve_factory(*isolation)
    serve.env = {"MOTOR_FAULTS": f"{point}=wait:{faults / point}", "MOTOR_SPAWNER": spawner}
    serve.start()
    job_id = serve.cli_json("submit", "--weight", "1", "--", "sh", "-c",
                            f"echo $$ >> {runs_file}; echo started; "
                            f"while [ ! -e {barrier} ]; do sleep 0.02; done; echo done")["job_id"]
    return serve, job_id, faults, runs_file, barrier


@pytest.mark.parametrize("point,kill_forkserver,release_late,runs", CASES,
                         ids=[f"{c[0]}-{'both' if c[1] else 'runner'}" for c in CASES])
def test_kill_9_at_a_start_point_never_runs_the_job_twice(
        serve_factory, tmp_path, isolation, point, kill_forkserver, release_late, runs):
    serve, job_id, faults, runs_file, barrier = _submit_paused_at(
        serve_factory, tmp_path, isolation, point, "forkserver")
    wait_for((faults / f"{point}.reached").exists, what=f"the start to reach {point}")
    forkserver = child_named(serve.proc.pid, "forkserver")
    serve.kill9()
    if kill_forkserver and forkserver is not None and forkserver.is_running():
        forkserver.kill()
        forkserver.wait(10)
    if not release_late:
        (faults / point).touch()

    serve.env = {"MOTOR_SPAWNER": "forkserver"}
    serve.start()
    if release_late:
        if runs:  # the restarted runner's own copy (if any) is running before the old one goes on
            wait_for(lambda: runs_file.exists() or _adopted(serve, job_id),
                     what="the restarted runner to start or adopt the job")
        (faults / point).touch()
        if point.startswith("forkserver."):
            forkserver.wait(30)  # the old forkserver finishes its request, then exits
    # at most one copy of the job exists at any time (its shell carries the marker)
    shells = _shells(job_id)
    assert len(shells) <= 1, shells
    barrier.touch()
    result = serve.cli("attach", "--json", job_id)
    record = json_lines(result.stdout)[-1]["record"]
    lines = runs_file.read_text().split() if runs_file.exists() else []
    assert len(lines) == runs, (lines, record)
    if runs:
        assert result.returncode == 0, (result.stdout, result.stderr, record)
        assert record["state"] == "succeeded"
        assert record["attempts"] == 1
    else:
        assert record["state"] == "failed" and record["reason"] == "spawn_failed", record
    wait_for(lambda: not marked_processes(job_id), what="no process of the job left")


@pytest.mark.parametrize("point,kill_keeperd,runs,end", KEEPERD_CASES,
                         ids=[f"{c[0]}-{'both' if c[1] else 'runner'}" for c in KEEPERD_CASES])
def test_kill_9_at_a_start_point_under_keeperd_never_runs_the_job_twice(
        serve_factory, tmp_path, isolation, point, kill_keeperd, runs, end):
    serve, job_id, faults, runs_file, barrier = _submit_paused_at(
        serve_factory, tmp_path, isolation, point, "keeperd")
    try:
        wait_for((faults / f"{point}.reached").exists, what=f"the start to reach {point}")
        keeperd = _keeperd(serve) if point != "setup.begin" else None
        serve.kill9()
        if kill_keeperd and keeperd is not None:
            keeperd.kill()
            keeperd.wait(10)
    finally:
        (faults / point).touch()  # a paused keeperd goes on (never left paused); a killed
        # one is replaced
    serve.env = {"MOTOR_SPAWNER": "keeperd"}
    serve.start()
    shells = _shells(job_id)
    assert len(shells) <= 1, shells
    barrier.touch()
    result = serve.cli("attach", "--json", job_id)
    record = json_lines(result.stdout)[-1]["record"]
    lines = runs_file.read_text().split() if runs_file.exists() else []
    assert len(lines) == runs, (lines, record)
    assert record["state"] == end, record
    if end == "succeeded":
        assert result.returncode == 0, (result.stdout, result.stderr, record)
        assert record["attempts"] == 1
    else:
        assert record["reason"] == "keeper_lost", record
    wait_for(lambda: not marked_processes(job_id), what="no process of the job left")
    if kill_keeperd and keeperd is not None:  # a new keeperd took over: new jobs run
        result = serve.cli("run", "--weight", "1", "--", "sh", "-c", "echo again")
        assert result.returncode == 0 and result.stdout == b"again\n", result
        assert _keeperd(serve).pid != keeperd.pid


def test_a_job_directory_removed_while_the_runner_is_down_right_after_a_spawn_stops_the_job(
        serve_factory, tmp_path, isolation):
    """The runner is killed with keeperd's answer in hand and the job's record still in
    setup (its running record waits for the job's next write), and the job's directory is
    removed while the job runs. The restarted runner sets the job up again (its record
    says nothing ran) and keeperd refuses the spawn, keeping the job: the claim the runner
    then looks for is gone. The job's processes are stopped, it runs once, and its record
    says why (before stop 60 it ended `lost` saying its keeper "exited without recording
    an exit status", and only its leftovers' kill in the log said more)."""
    point = "setup.spawned"
    serve, job_id, faults, runs_file, barrier = _submit_paused_at(
        serve_factory, tmp_path, isolation, point, "keeperd")
    try:
        wait_for((faults / f"{point}.reached").exists, what=f"the start to reach {point}")
        wait_for(runs_file.exists, what="the job to run")
        serve.kill9()
    finally:
        (faults / point).touch()
    shutil.rmtree(serve.state_dir / "jobs" / job_id)
    assert marked_processes(job_id)  # it runs on under keeperd
    serve.env = {"MOTOR_SPAWNER": "keeperd"}
    serve.start()
    result = serve.cli("attach", "--json", job_id)
    record = json_lines(result.stdout)[-1]["record"]
    assert record["state"] == "lost" or (record["state"], record["signal"]) == ("failed", 9), record
    assert "the runner stopped the job's processes when it adopted the job" in record["detail"]
    assert "the job directory was removed while the job ran" in record["detail"], record
    wait_for(lambda: not marked_processes(job_id), what="no process of the job left")
    assert len(runs_file.read_text().split()) == 1
    barrier.touch()
    assert serve.cli("run", "--weight", "1", "--", "true").returncode == 0  # it serves on


def _keeperd(serve) -> psutil.Process:
    """The state dir's keeperd (its pid is in keeperd.lock, which it holds)."""
    pid = int((serve.state_dir / "keeperd.lock").read_text())
    proc = psutil.Process(pid)
    assert any("keeperd" in part for part in proc.cmdline()), proc.cmdline()
    return proc


def test_kill_9_after_the_status_was_written_ends_the_job_once(serve_factory, tmp_path,
                                                               isolation):
    runs_file = tmp_path / "runs"
    serve = serve_factory(*isolation).start()
    job_id = serve.cli_json("submit", "--weight", "1", "--", "sh", "-c",
                            f"echo $$ >> {runs_file}; exit 3")["job_id"]
    status = serve.state_dir / "jobs" / job_id / "status.json"
    wait_for(status.exists, what="status.json")
    forkserver = child_named(serve.proc.pid, "forkserver")
    serve.kill9()
    if forkserver is not None:
        forkserver.kill()
    serve.start()
    result = serve.cli("attach", "--json", job_id)
    assert result.returncode == 3
    assert len(runs_file.read_text().split()) == 1
    record = json_lines(result.stdout)[-1]["record"]
    assert record["state"] == "failed" and record["exit_code"] == 3


def _shells(job_id: str) -> list:
    """The job's copies: its `sh -c` processes whose parent is not one of them. The shell
    forks for each `sleep` of its loop, and until that child execs it is an `sh -c` with the
    job's marker too (seen once by `.ci/run`: a shell in fork and its child, pids 4 apart);
    it belongs to the same copy. The short-lived `sleep`s may vanish while looked at."""
    found = []
    for p in marked_processes(job_id):
        try:
            if p.cmdline()[:2] == ["sh", "-c"]:
                found.append((p, p.ppid()))
        except psutil.NoSuchProcess:
            continue
    pids = {p.pid for p, _ in found}
    return [p for p, parent in found if parent not in pids]


def _adopted(serve, job_id: str) -> bool:
    return (serve.state_dir / "jobs" / job_id / "keeper.json").exists()
