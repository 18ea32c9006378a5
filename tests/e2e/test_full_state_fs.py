"""A full state filesystem (a real tiny tmpfs) at a job's start and at its end."""

from __future__ import annotations

import json
import os
import sys

import pytest

from job_markers import marked_processes
from motor.execution import process_alive
from polling import json_lines, wait_for
from tmpfs_helpers import Filler, needs_tmpfs, tmpfs

pytestmark = [pytest.mark.e2e, needs_tmpfs]


def test_no_free_inodes_for_keeper_json_means_the_job_never_starts(serve_factory, tmp_path):
    faults = tmp_path / "faults"
    faults.mkdir()
    runs = tmp_path / "runs"
    with tmpfs(tmp_path / "state", size="64m", nr_inodes=2000) as state:
        serve = serve_factory("--workspace-root", str(tmp_path / "ws"), "--isolation", "affinity",
                              state_dir=state)
        serve.env = {"MOTOR_FAULTS": f"forkserver.forked=wait:{faults / 'forked'}"}
        serve.start()
        filler = Filler(state)
        try:
            job_id = serve.cli_json("submit", "--weight", "1", "--", "sh", "-c",
                                    f"echo $$ >> {runs}; echo hi")["job_id"]
            wait_for((faults / "forked.reached").exists, what="the fork")
            assert filler.inodes() > 0
            (faults / "forked").touch()
            result = serve.cli("attach", "--json", job_id)
            record = json_lines(result.stdout)[-1]["record"]
            assert record["state"] == "failed", record
            assert record["reason"] == "spawn_failed", record
            assert "keeper.json" in record["detail"] and "No space left" in record["detail"]
            assert not runs.exists()  # the job never ran
            assert not marked_processes(job_id)
            assert serve.cli_json("health")["capacity"]["held_permits"] == 0
        finally:
            filler.free()
            serve.stop()


def test_no_free_inodes_for_status_json_the_keeper_retries_until_it_lands(serve_factory, tmp_path):
    barrier = tmp_path / "go"
    with tmpfs(tmp_path / "state", size="64m", nr_inodes=2000) as state:
        serve = serve_factory("--workspace-root", str(tmp_path / "ws"), "--isolation", "affinity",
                              state_dir=state).start()
        filler = Filler(state)
        try:
            job_id = serve.cli_json("submit", "--weight", "1", "--", "sh", "-c",
                                    f"echo start; while [ ! -e {barrier} ]; do sleep 0.02; done; "
                                    "echo end; exit 0")["job_id"]
            job_dir = state / "jobs" / job_id
            kept = wait_for(lambda: _job_started(job_dir), what="the keeper to record the job")
            # (keeperd makes output.log at the job's first output, after keeper.json's pid)
            log = job_dir / "output.log"
            wait_for(lambda: log.exists() and b"start" in log.read_bytes(), what="output")
            assert filler.inodes() > 0
            barrier.touch()
            # the job's main process exits and is reaped; its keeper cannot write status.json
            wait_for(lambda: not process_alive(kept["job_pid"], kept["job_create_time"]),
                     what="the job to exit")
            assert process_alive(kept["keeper_pid"], kept["keeper_create_time"])
            assert not (job_dir / "status.json").exists()
            running = serve.cli_json("status")["running"]
            assert [r["job_id"] for r in running] == [job_id]
            filler.free()  # space is back: the status lands, the job ends as it did
            result = serve.cli("attach", "--json", job_id)
            events = json_lines(result.stdout)
            record = events[-1]["record"]
            assert record["state"] == "succeeded", record
            assert record["exit_code"] == 0 and result.returncode == 0
            assert "".join(e["data"] for e in events if e["event"] == "output") == "start\nend\n"
        finally:
            filler.free()
            serve.stop()


def _job_started(job_dir):
    try:
        kept = json.loads((job_dir / "keeper.json").read_text())
    except (OSError, ValueError):
        return None
    return kept if kept.get("job_pid") else None


def test_a_full_state_filesystem_at_the_stop_leaves_the_catalog_for_the_next_start(
        serve_factory, tmp_path):
    """The stop's compaction of the workspace catalog on a full state filesystem: before stop
    55 the disk actor crashed in its stop (a traceback in the log, its supervisor's report);
    now the catalog says why once and the journal it could not fold stays, so the next
    start still knows the workspace the runner made."""
    with tmpfs(tmp_path / "state", size="64m", nr_inodes=2000) as state:
        serve = serve_factory("--workspace-root", str(tmp_path / "ws"), "--isolation", "affinity",
                              state_dir=state).start()
        filler = Filler(state)
        try:
            assert serve.cli("run", "--weight", "1", "--workspace", "made", "--",
                             "true").returncode == 0
            filler.blocks()
            assert serve.stop() == 0
            log = serve.log.read_text()
            assert "crashed" not in log and "Traceback" not in log, log[-2000:]
            assert "the workspace catalog in" in log and "cannot be written" in log
            filler.free()
            serve.start()
            names = [w["name"] for w in serve.cli_json("workspaces")]
            assert "made" in names, names
        finally:
            filler.free()
            serve.stop()


def test_a_job_that_fills_the_disk_has_an_idle_workspace_evicted_without_waiting_for_a_pass(
        serve_factory, tmp_path):
    """A job fills the state file system (its workspace is on it) and ends: keeperd cannot
    write its status until there is room. Before stop 55 nothing asked the disk manager
    for room until the next admission or maintenance pass (a minute), so the job stayed
    `running` that long; now the manager's own probe (every 2 s) finds the file system
    below its floor and evicts an idle workspace. (Since stop 58 the job's end itself lands
    at once, on the store's reserve: the eviction comes after it, well before a pass.)"""
    with tmpfs(tmp_path / "state", size="40m") as state:
        serve = serve_factory("--free-space-floor-bytes", str(4_000_000), "--isolation",
                              "affinity", state_dir=state).start()
        try:
            assert serve.cli("run", "--weight", "1", "--workspace", "old", "--", "sh", "-c",
                             "dd if=/dev/zero of=blob bs=1M count=10 2>/dev/null").returncode == 0
            job_id = serve.cli_json("submit", "--weight", "1", "--workspace", "fill", "--",
                                    "sh", "-c", "dd if=/dev/zero of=big bs=1M 2>/dev/null; "
                                    "echo filled")["job_id"]
            result = serve.cli("attach", "--json", job_id, timeout=30)
            record = json_lines(result.stdout)[-1]["record"]
            assert record["state"] == "succeeded", record
            wait_for(lambda: serve.cli_json("health")["disk"]["free_bytes"] >= 4_000_000,
                     timeout=15, what="an idle workspace evicted (a pass comes once a minute)")
            names = [w["name"] for w in serve.cli_json("workspaces")]
            assert len(names) == 1, names
        finally:
            serve.stop()


def test_a_state_file_system_out_of_inodes_refuses_jobs_rather_than_queueing_them_for_ever(
        serve_factory, tmp_path):
    """Free bytes but no free inodes: before this, admission looked at bytes only, so each
    job was accepted and then queued for good, its start failing ENOSPC and retried (a
    probe: 23 of 80 `motor run`s waited out their timeout). Now a file system below its
    inode floor refuses `runner_disk_full` with the inode figures (after emptying the ended
    jobs' directories, which did not free enough here), and admits again once inodes are
    free."""
    with tmpfs(tmp_path / "state", size="64m", nr_inodes=2000) as state:
        serve = serve_factory("--workspace-root", str(tmp_path / "ws"), "--isolation", "affinity",
                              "--free-space-floor-bytes", "1000000", state_dir=state).start()
        filler = Filler(state)
        try:
            assert serve.cli("run", "--weight", "1", "--", "true").returncode == 0
            assert filler.inodes() > 0
            refused = serve.cli("run", "--json", "--weight", "1", "--", "true", timeout=30)
            assert refused.returncode == 75, refused
            record = json_lines(refused.stdout)[-1]["record"]
            assert record["state"] == "refused_before_start", record
            assert record["reason"] == "runner_disk_full" and record["floor_inodes"] == 64, record
            free = record["free_inodes"]
            assert free < 64 and f"free inodes {free} " in record["detail"], record
            assert serve.cli_json("status")["queued"] == []  # nothing accepted to wait
            # the ended job's files (a copy of what the store holds) went first, to make room
            [ended] = (state / "jobs").iterdir()
            assert list(ended.iterdir()) == []
            disk = serve.cli_json("health")["disk"]
            assert (disk["free_inodes"], disk["total_inodes"], disk["floor_inodes"],
                    disk["goal_inodes"]) == (free, 2000, 64, 128), disk
            filler.free()
            assert serve.cli("run", "--weight", "1", "--", "true", timeout=30).returncode == 0
        finally:
            filler.free()
            serve.stop()


def test_job_after_job_on_a_state_file_system_whose_inodes_their_directories_would_fill(
        serve_factory, tmp_path):
    """Each job leaves its directory; before this its files stayed a day (the output a copy of
    the store's), so on a file system of 250 inodes the 48th job could not start and every
    later one queued for ever (a probe with 300: 23 of 80 `motor run`s timed out). Now the
    disk manager empties the ended jobs' directories when inodes run short: all 60 run."""
    with tmpfs(tmp_path / "state", size="64m", nr_inodes=250) as state:
        serve = serve_factory("--workspace-root", str(tmp_path / "ws"), "--isolation", "affinity",
                              "--free-space-floor-bytes", "1000000", state_dir=state).start()
        try:
            for i in range(60):
                result = serve.cli("run", "--weight", "1", "--", "echo", str(i), timeout=30)
                assert (result.returncode, result.stdout) == (0, f"{i}\n".encode()), (i, result)
            assert len(list((state / "jobs").iterdir())) == 60  # each kept until retention
            assert serve.cli_json("health")["status"] == "ok"
        finally:
            serve.stop()


def test_a_job_that_uses_up_its_workspace_roots_inodes_has_it_evicted_for_the_next_job(
        serve_factory, tmp_path):
    """The workspace root on its own file system (500 inodes), a job in workspace `big` that
    creates files until none is left. Before stop 57 the next job in another workspace was
    admitted (bytes only), then its set-up failed ENOSPC, and the eviction that could have
    made room failed too, at the trash directory's `mkdir`: it queued for good. Now the root
    below its inode floor is cleaned up (`big` deleted in place, recent as it is, the
    pressure being hard) and the next job runs."""
    with tmpfs(tmp_path / "ws", size="64m", nr_inodes=500) as ws:
        serve = serve_factory("--workspace-root", str(ws), "--isolation", "affinity",
                              "--free-space-floor-bytes", "1000000").start()
        try:
            made = serve.cli("run", "--weight", "1", "--workspace", "big", "--", "sh", "-c",
                             "i=0; while touch f$i 2>/dev/null; do i=$((i+1)); done; echo $i")
            assert made.returncode == 0 and int(made.stdout) > 400, made
            other = serve.cli("run", "--weight", "1", "--workspace", "other", "--", "sh", "-c",
                              "touch a; echo ran", timeout=30)
            assert (other.returncode, other.stdout) == (0, b"ran\n"), other
            names = [w["name"] for w in serve.cli_json("workspaces")]
            assert names == ["other"], names
            assert "deleting" in serve.log.read_text() and not (ws / "big").exists()
        finally:
            serve.stop()


def test_a_workspace_root_on_a_small_file_system_has_a_default_floor_of_its_own(
        serve_factory, tmp_path):
    """A 64 MB workspace root beside a 1 GB state file system, no floor configured: before
    stop 57 the root was held to the state file system's default floor (100 MB, more than
    it holds) and every job was refused. Now its default floor is 10% of its own size, and
    once a job has filled it below that, the next admission evicts the idle workspace.""" 
    with tmpfs(tmp_path / "state", size="1g") as state, tmpfs(tmp_path / "ws", size="64m") as ws:
        serve = serve_factory("--workspace-root", str(ws), "--isolation", "affinity",
                              state_dir=state)
        serve.args.remove("--free-space-floor-bytes")
        serve.args.remove("0")  # the default floors, as a host without a configured floor has
        serve.start()
        try:
            first = serve.cli("run", "--weight", "1", "--workspace", "old", "--", "sh", "-c",
                              "head -c 40000000 /dev/zero > blob; echo ok", timeout=30)
            assert (first.returncode, first.stdout) == (0, b"ok\n"), first
            second = serve.cli("run", "--weight", "1", "--workspace", "new", "--", "sh", "-c",
                               "head -c 24000000 /dev/zero > blob; echo ok", timeout=30)
            assert (second.returncode, second.stdout) == (0, b"ok\n"), second
            # the root is below its floor now: the next admission evicts the idle one first
            third = serve.cli("run", "--weight", "1", "--workspace", "new", "--", "true")
            assert third.returncode == 0, third
            assert [w["name"] for w in serve.cli_json("workspaces")] == ["new"]
        finally:
            serve.stop()


def test_a_workspace_holding_a_tree_thousands_of_levels_deep_is_evicted(serve_factory, tmp_path):
    """A job leaves a 3,000-level tree (and fills its root below the floor): before stop 57
    the eviction's purge raised RecursionError, which crashed the disk actor at each try,
    and the tree stayed. Now it is deleted and the next job runs."""
    deep = ("import os\n"
            "os.makedirs('keep', exist_ok=True); fd = os.open('.', os.O_RDONLY)\n"
            "for _ in range(3000):\n"
            "    os.mkdir('d', dir_fd=fd); n = os.open('d', os.O_RDONLY, dir_fd=fd)\n"
            "    os.close(fd); fd = n\n"
            "open('/dev/null').close()\n"
            "with open('keep/blob', 'wb') as f: f.write(bytes(62_000_000))\n")
    with tmpfs(tmp_path / "ws", size="64m") as ws:
        serve = serve_factory("--workspace-root", str(ws), "--isolation", "affinity",
                              "--free-space-floor-bytes", "6000000").start()
        try:
            made = serve.cli("run", "--weight", "1", "--workspace", "deep", "--", sys.executable,
                             "-c", deep, timeout=60)
            assert made.returncode == 0, made
            other = serve.cli("run", "--weight", "1", "--workspace", "other", "--", "true",
                              timeout=60)
            assert other.returncode == 0, other
            assert [w["name"] for w in serve.cli_json("workspaces")] == ["other"]
            left = sorted(set(os.listdir(ws)) - {".motor-root.lock"})  # the root's lock
            assert left in (["other"], [".motor-trash", "other"])
            assert "Traceback" not in serve.log.read_text()
        finally:
            serve.stop()


def test_a_job_that_fills_the_state_file_system_from_its_own_workspace_ends_and_the_next_runs(
        serve_factory, tmp_path):
    """Stop 58 (a fault probe): the job that fills the state file system has the only
    workspace worth evicting. Before, its end could not be recorded ("waiting for space to
    record the job"), so its workspace stayed a running job's, which the disk manager never
    evicts, and nothing freed the space: `motor run` waited for good. Now the write deletes
    the store's reserve (store/reserve.py) and lands; the workspace, idle, is evicted."""
    with tmpfs(tmp_path / "state", size="40m") as state:
        serve = serve_factory("--free-space-floor-bytes", str(4 << 20), "--isolation", "affinity",
                              state_dir=state).start()
        try:
            assert (state / "store.reserve").stat().st_size == 1 << 20  # a quarter of the floor
            result = serve.cli("run", "--workspace", "fill", "--", "sh", "-c",
                               "dd if=/dev/zero of=big bs=1M 2>/dev/null; exit 3", timeout=30)
            assert result.returncode == 3, result.stderr
            assert serve.cli("run", "--workspace", "next", "--", "true", timeout=30).returncode == 0
            assert serve.cli_json("health")["store"]["reserve"]["released"] == 1
            assert "fill" not in [w["name"] for w in serve.cli_json("workspaces")]
        finally:
            serve.stop()


def test_a_runner_started_on_a_full_state_file_system_serves_and_refuses_jobs_until_there_is_room(
        serve_factory, tmp_path):
    """Stop 58 (a fault probe): a runner started on a state file system with no byte free
    could not open its database ("disk I/O error") and exited, so its disk manager never
    ran. Now the open deletes the store's reserve first: the runner serves, refuses jobs
    `runner_disk_full`, and runs them once there is room."""
    with tmpfs(tmp_path / "state", size="40m") as state:
        serve = serve_factory("--free-space-floor-bytes", str(4 << 20), "--isolation", "affinity",
                              state_dir=state).start()
        filler = Filler(state)
        try:
            assert serve.cli("run", "--", "true").returncode == 0
            assert serve.stop() == 0
            filler.blocks()
            serve.start()
            refused = serve.cli("run", "--", "true")
            assert refused.returncode == 75 and b"runner_disk_full" in refused.stderr, refused.stderr
            health = serve.cli_json("health")  # said so (it was `ok`)
            assert health["status"] == "degraded", health
            assert [d["subsystem"] for d in health["degraded"]] == ["disk"], health["degraded"]
            assert "below the floor of 4194304 bytes" in health["degraded"][0]["cause"]
            filler.free()
            assert serve.cli("run", "--", "true").returncode == 0
            assert serve.cli_json("health")["status"] == "ok"
        finally:
            filler.free()
            serve.stop()


def test_a_job_that_prints_while_it_fills_the_state_file_system_has_its_output_and_end_recorded(
        serve_factory, tmp_path):
    """Stop 58: output printed around the moment the job filled the disk waits to be stored
    (a batch of a running job's output), or is held by keeperd, which cannot write it: the
    store's reserve (8 MiB here) is spent on it, by the store's write or by the disk
    manager's last resort, so all 2 MB of it and the exit come back, and the next job runs
    once the job's workspace is evicted. (More than the reserve after the disk filled is
    not covered: docs/operations.md.)"""
    with tmpfs(tmp_path / "state", size="100m") as state:
        serve = serve_factory("--free-space-floor-bytes", str(32 << 20), "--isolation",
                              "affinity", state_dir=state).start()
        try:
            script = ('head -c 1000000 /dev/zero | tr "\\0" y; dd if=/dev/zero of=blob bs=1M '
                      '2>/dev/null; head -c 1000000 /dev/zero | tr "\\0" z; exit 4')
            result = serve.cli("run", "--workspace", "fill", "--", "sh", "-c", script, timeout=60)
            assert result.returncode == 4, result.stderr
            assert result.stdout == b"y" * 1_000_000 + b"z" * 1_000_000
            assert serve.cli_json("health")["store"]["reserve"]["released"] == 1
            assert serve.cli("run", "--workspace", "next", "--", "true", timeout=30).returncode == 0
        finally:
            serve.stop()
