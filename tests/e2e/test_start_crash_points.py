"""At most one live process tree per job id, across a crash at any point of a job's start.

A job appends its shell's pid to a file (one line per run) and waits for a barrier. The
runner (and sometimes its forkserver) is killed with SIGKILL while the start is paused at
a named point (MOTOR_FAULTS, motor/faults.py), then restarted; the job must run
exactly once, or end in a typed terminal state without running at all, never twice.
"""

from __future__ import annotations

import os

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


@pytest.mark.parametrize("point,kill_forkserver,release_late,runs", CASES,
                         ids=[f"{c[0]}-{'both' if c[1] else 'runner'}" for c in CASES])
def test_kill_9_at_a_start_point_never_runs_the_job_twice(
        serve_factory, tmp_path, isolation, point, kill_forkserver, release_late, runs):
    faults = tmp_path / "faults"
    faults.mkdir()
    runs_file, barrier = tmp_path / "runs", tmp_path / "go"
    serve = serve_factory(*isolation)
    serve.env = {"MOTOR_FAULTS": f"{point}=wait:{faults / point}"}
    serve.start()
    job_id = serve.cli_json("submit", "--weight", "1", "--", "sh", "-c",
                            f"echo $$ >> {runs_file}; echo started; "
                            f"while [ ! -e {barrier} ]; do sleep 0.02; done; echo done")["job_id"]
    reached = faults / f"{point}.reached"
    wait_for(reached.exists, what=f"the start to reach {point}")
    forkserver = child_named(serve.proc.pid, "forkserver")
    serve.kill9()
    if kill_forkserver and forkserver is not None and forkserver.is_running():
        forkserver.kill()
        forkserver.wait(10)
    if not release_late:
        (faults / point).touch()

    serve.env = {}
    serve.start()
    if release_late:
        if runs:  # the restarted runner's own copy (if any) is running before the old one goes on
            wait_for(lambda: runs_file.exists() or _adopted(serve, job_id),
                     what="the restarted runner to start or adopt the job")
        (faults / point).touch()
        if point.startswith("forkserver."):
            forkserver.wait(30)  # the old forkserver finishes its request, then exits
    # at most one copy of the job exists at any time (its shell carries the marker)
    shells = [p for p in marked_processes(job_id) if p.cmdline()[:2] == ["sh", "-c"]]
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


def _adopted(serve, job_id: str) -> bool:
    return (serve.state_dir / "jobs" / job_id / "keeper.json").exists()
