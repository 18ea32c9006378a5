"""Under affinity isolation (no cgroup), processes that leave the job's process group
(`setsid`, a double-forked daemon) die with the job on cancel and on timeout: the keeper is
a subreaper and ends the whole tree."""

from __future__ import annotations

import pytest

from job_markers import kill_marked, marked_processes
from polling import json_lines, wait_for

pytestmark = pytest.mark.e2e

DAEMON = ("import os, time\n"
          "if os.fork(): os._exit(0)\n"
          "os.setsid()\n"
          "if os.fork(): os._exit(0)\n"
          "os.close(1); os.close(2)\n"
          "time.sleep(1000)\n")
ESCAPING = ["sh", "-c", f"setsid sleep 1000 & python3 -c '{DAEMON}' & echo ready; sleep 1000"]


def _escaped(job_id: str) -> bool:
    """Both escapees run: a `sleep 1000` in a session of its own, and the daemon."""
    procs = _snapshot(job_id)  # (pid, cmdline, ppid, sid) of each marked process
    leader = [p for p in procs if p[1][:2] == ["sh", "-c"]]
    if not leader:
        return False
    lpid, _, _, own = leader[0]
    setsid_sleep = any(cmd == ["sleep", "1000"] and sid != own for _, cmd, _, sid in procs)
    daemon = any("time.sleep(1000)" in " ".join(cmd) and sid != own and ppid != lpid
                 for _, cmd, ppid, sid in procs)
    return setsid_sleep and daemon


def _snapshot(job_id: str) -> list[tuple[int, list[str], int, int]]:
    """The marked processes as read once each; one that exits while it is read (the
    daemon's intermediate forks do) is left out, not an error."""
    import psutil

    rows = []
    for p in marked_processes(job_id):
        try:
            with p.oneshot():
                rows.append((p.pid, p.cmdline(), p.ppid(), _sid(p)))
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return rows


def _sid(p) -> int:
    import os

    try:
        return os.getsid(p.pid)
    except OSError:
        return -1


@pytest.mark.parametrize("how", ["cancel", "timeout"])
def test_setsid_and_double_forked_processes_do_not_outlive_the_job(serve_factory, how):
    serve = serve_factory("--isolation", "affinity").start()
    extra = ["--timeout", "3"] if how == "timeout" else []
    job_id = serve.cli_json("submit", "--weight", "1", *extra, "--", *ESCAPING)["job_id"]
    try:
        wait_for(lambda: _escaped(job_id), what="the job's processes to escape its group")
        if how == "cancel":
            assert serve.cli("cancel", job_id).returncode == 0
        result = serve.cli("attach", "--json", job_id)
        record = json_lines(result.stdout)[-1]["record"]
        assert record["state"] == ("cancelled" if how == "cancel" else "timed_out"), record
        # nothing of the job survives its end (no sleep-and-hope: bounded polling)
        wait_for(lambda: not marked_processes(job_id), timeout=15,
                 what="every process of the job to be gone")
    finally:
        kill_marked(job_id)


def test_setsid_and_double_forked_processes_do_not_outlive_a_job_that_ends_by_itself(
        serve_factory, tmp_path):
    """The job's main process exits 0 while a `setsid` shell (with a `sleep` of its own below
    it) and a double-forked daemon still run: the job succeeds and they die with it, and
    their hold on the job's output does not keep its end waiting. Before stop 56 keeperd
    killed only the escapees re-parented to it when the job ended, not what ran below
    them: the `sleep` outlived the job, and held its stdout for the 5 s drain."""
    barrier = tmp_path / "go"
    escaping = ["sh", "-c", f"setsid sh -c 'sleep 1000; :' & python3 -c '{DAEMON}' & "
                            f"echo ready; while [ ! -e {barrier} ]; do sleep 0.01; done"]
    serve = serve_factory("--isolation", "affinity").start()
    job_id = serve.cli_json("submit", "--weight", "1", "--", *escaping)["job_id"]
    try:
        wait_for(lambda: _escaped(job_id), what="the job's processes to escape its group")
        barrier.write_text("")
        record = json_lines(serve.cli("attach", "--json", job_id).stdout)[-1]["record"]
        assert (record["state"], record["exit_code"]) == ("succeeded", 0), record
        assert record["detail"] is None, record  # no "output pipes still open" after 5 s
        wait_for(lambda: not marked_processes(job_id), timeout=15,
                 what="every process of the job to be gone")
    finally:
        kill_marked(job_id)


def test_a_process_of_the_job_orphaned_after_its_end_dies_too(serve_factory, tmp_path):
    """A process forked by an escapee after keeperd read what runs below the escapees (a
    barrier in keeperd at that point) is missed by the kill at the job's end; once its
    parent is killed it is re-parented to keeperd, which kills it there: its job has ended."""
    go, fork_now, pause = tmp_path / "go", tmp_path / "fork", tmp_path / "pause"
    late = f"while [ ! -e {fork_now} ]; do sleep 0.01; done; sleep 1000 & wait"
    command = ["sh", "-c", f"setsid sh -c '{late}' & "
                           f"while [ ! -e {go} ]; do sleep 0.01; done"]
    serve = serve_factory("--isolation", "affinity")
    serve.env = {"MOTOR_FAULTS": f"keeperd.kill_trees=wait:{pause}"}
    serve.start()
    job_id = serve.cli_json("submit", "--weight", "1", "--", *command)["job_id"]
    try:
        wait_for(lambda: _running(job_id, ["sh", "-c", late]), what="the escapee")
        go.write_text("")  # the job's main process exits: keeperd kills the escapee's tree...
        wait_for(lambda: (tmp_path / "pause.reached").exists(), what="keeperd's read")
        fork_now.write_text("")  # ...as it was before this fork
        wait_for(lambda: _running(job_id, ["sleep", "1000"]), what="the late fork")
        pause.write_text("")
        record = json_lines(serve.cli("attach", "--json", job_id).stdout)[-1]["record"]
        assert record["state"] == "succeeded", record
        wait_for(lambda: not marked_processes(job_id), timeout=15,
                 what="every process of the job to be gone")
    finally:
        kill_marked(job_id)


def _running(job_id: str, cmdline: list[str]) -> bool:
    return any(cmd == cmdline for _, cmd, _, _ in _snapshot(job_id))
