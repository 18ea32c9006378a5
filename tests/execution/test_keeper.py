"""Keeper behaviour, end to end with real processes: every test runs against a per-job keeper
forked by the forkserver and against keeperd (one keeper for the whole state dir)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import psutil
import pytest
import trio
from keeper_helpers import finish, records, stream_bytes, wait_until
from keeper_tracking import tracked_keepers

from motor.execution import cancel_keeper, process_alive, read_keeper

# Writes to alternating streams; before each write it waits until the previous
# one has been recorded in output.log, so the cross-stream order is fixed.
ALTERNATE = r"""
import os, sys, time
log = sys.argv[1]
for i, stream in enumerate([sys.stdout, sys.stderr, sys.stdout, sys.stderr]):
    size = os.path.getsize(log) if os.path.exists(log) else 0
    stream.write(("out" if stream is sys.stdout else "err") + str(i) + "\n")
    stream.flush()
    while (os.path.getsize(log) if os.path.exists(log) else 0) <= size:
        time.sleep(0.001)
sys.exit(7)
"""


@pytest.fixture(params=["forkserver", "keeperd"])
async def jobs(request, tmp_path):
    async with tracked_keepers(request.param, tmp_path / "state") as tracker:
        tracker.mode = request.param
        yield tracker


def wait_for_file_cmd(name: str, first: str, last: str) -> list[str]:
    return ["sh", "-c", f"echo {first}; while [ ! -e {name} ]; do sleep 0.01; done; echo {last}"]


async def test_records_in_order_and_exit_code(jobs, make_job):
    job_dir = make_job([sys.executable, "-c", ALTERNATE, "PLACEHOLDER"])
    # the script needs its own output.log path
    spec = (job_dir / "spec.json").read_text().replace("PLACEHOLDER", str(job_dir / "output.log"))
    (job_dir / "spec.json").write_text(spec)
    status = await jobs.run(job_dir)
    assert records(job_dir) == [
        ("stdout", b"out0\n"),
        ("stderr", b"err1\n"),
        ("stdout", b"out2\n"),
        ("stderr", b"err3\n"),
    ]
    assert status["exit_code"] == 7
    assert status["signal"] is None
    assert status["reason"] is None
    assert status["detail"] is None
    assert status["ended_at_ms"] >= status["started_at_ms"]
    assert status["wall_time_ms"] == status["ended_at_ms"] - status["started_at_ms"]


async def test_large_output_is_complete(jobs, make_job):
    job_dir = make_job(["sh", "-c", "head -c 1000000 /dev/zero; echo done >&2"])
    status = await jobs.run(job_dir)
    assert status["exit_code"] == 0
    assert stream_bytes(job_dir, "stdout") == b"\0" * 1_000_000
    assert stream_bytes(job_dir, "stderr") == b"done\n"


async def test_stdin_is_dev_null_and_env_cwd_applied(jobs, make_job, workspace):
    job_dir = make_job(
        ["sh", "-c", 'cat; echo "$MOTOR_TEST_VAR"; pwd'],
        env={"PATH": os.environ["PATH"], "MOTOR_TEST_VAR": "hello"},
    )
    status = await jobs.run(job_dir)
    assert status["exit_code"] == 0
    assert stream_bytes(job_dir, "stdout") == f"hello\n{workspace}\n".encode()


async def test_signal_death_recorded(jobs, make_job):
    status = await jobs.run(make_job(["sh", "-c", "kill -9 $$"]))
    assert status["signal"] == 9
    assert status["exit_code"] is None
    assert status["reason"] is None


async def test_cpu_time_recorded(jobs, make_job):
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.2: pass"
    status = await jobs.run(make_job([sys.executable, "-c", burn]))
    assert status["exit_code"] == 0
    assert status["cpu_time_ms"] >= 150


@pytest.mark.parametrize(
    "cmd0", ["motor-no-such-command-xyz", "/nonexistent/motor-cmd", "./not-executable"]
)
async def test_spawn_failed(jobs, make_job, workspace, cmd0):
    (workspace / "not-executable").write_text("#!/bin/sh\necho hi\n")
    job_dir = make_job([cmd0, "arg"])
    status = await jobs.run(job_dir)
    assert status["reason"] == "spawn_failed"
    assert status["exit_code"] == 127
    assert status["signal"] is None
    assert cmd0 in status["detail"]
    err = stream_bytes(job_dir, "stderr")
    assert cmd0.encode() in err
    assert read_keeper(job_dir)["job_pid"] is None  # claimed by the keeper, no job spawned


async def test_bad_cwd_is_spawn_failed(jobs, make_job, tmp_path):
    status = await jobs.run(make_job(["true"], cwd=str(tmp_path / "missing")))
    assert status["reason"] == "spawn_failed"
    assert status["exit_code"] == 127
    assert "missing" in status["detail"]


async def test_timeout_sigterm(jobs, make_job):
    status = await jobs.run(make_job(["sleep", "30"], timeout_s=0.2))
    assert status["reason"] == "timed_out"
    assert status["signal"] == signal.SIGTERM
    assert status["exit_code"] is None


async def test_timeout_escalates_to_sigkill_after_grace(jobs, make_job):
    job_dir = make_job(["sh", "-c", 'trap "" TERM; sleep 30'], timeout_s=0.2, kill_grace_s=0.3)
    status = await jobs.run(job_dir)
    assert status["reason"] == "timed_out"
    assert status["signal"] == signal.SIGKILL
    assert status["wall_time_ms"] >= 400


async def test_cancel(jobs, make_job):
    job_dir = make_job(["sh", "-c", "echo ready; exec sleep 30"])
    handle = await jobs.spawn(job_dir)
    await wait_until(lambda: ("stdout", b"ready\n") in records(job_dir))
    await wait_until(lambda: read_keeper(job_dir).get("job_pid"))  # keeperd: 0.1 s after the spawn
    info = read_keeper(job_dir)
    assert info["keeper_pid"] == handle.pid
    # identity floats are exactly psutil's
    assert info["keeper_create_time"] == psutil.Process(handle.pid).create_time()
    assert info["keeper_create_time"] == handle.create_time
    assert info["job_create_time"] == psutil.Process(info["job_pid"]).create_time()
    assert os.getpgid(info["job_pid"]) == info["job_pid"]  # own process group
    if jobs.mode == "forkserver":
        assert os.getsid(handle.pid) == handle.pid  # keeper is setsid'd
    else:  # keeperd detached: a session of its own, not ours
        assert os.getsid(handle.pid) != os.getsid(0)
        assert info["kind"] == "keeperd"
    assert jobs.cancel(handle, job_dir)
    status = await finish(handle, job_dir)
    assert status["reason"] == "cancelled"
    assert status["signal"] == signal.SIGTERM
    assert not jobs.cancel(handle, job_dir)


async def test_keeper_ignores_sigint_sighup(jobs, make_job, workspace):
    job_dir = make_job(wait_for_file_cmd("go", "first", "last"))
    handle = await jobs.spawn(job_dir)
    await wait_until(lambda: read_keeper(job_dir))
    os.kill(handle.pid, signal.SIGINT)
    os.kill(handle.pid, signal.SIGHUP)
    await wait_until(lambda: ("stdout", b"first\n") in records(job_dir))
    assert process_alive(handle.pid, handle.create_time)
    (workspace / "go").touch()
    status = await finish(handle, job_dir)
    assert status["exit_code"] == 0 and status["reason"] is None
    assert stream_bytes(job_dir, "stdout") == b"first\nlast\n"


@pytest.mark.parametrize("cpus", [[1], [0]])
async def test_pinned_affinity(jobs, make_job, cpus):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs")
    job_dir = make_job(["grep", "Cpus_allowed_list", "/proc/self/status"], cpus=cpus, pin=True)
    status = await jobs.run(job_dir)
    assert status["exit_code"] == 0
    assert stream_bytes(job_dir, "stdout") == f"Cpus_allowed_list:\t{cpus[0]}\n".encode()


async def test_unpinned_affinity_is_inherited(jobs, make_job):
    job_dir = make_job(
        [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
        cpus=[1],
        pin=False,
    )
    status = await jobs.run(job_dir)
    assert status["exit_code"] == 0
    assert stream_bytes(job_dir, "stdout") == f"{sorted(os.sched_getaffinity(0))}\n".encode()


@pytest.fixture
def pid_at_once(monkeypatch):
    """keeperd writes a job's pid into keeper.json right after the spawn (by default only
    for a job still running 0.1 s later): tests that look a short job's pid up there."""
    from motor.execution import keeperd

    monkeypatch.setenv(keeperd.RECORD_PID_AFTER_ENV, "0")


async def test_cgroup_procs_gets_keeper_pid(pid_at_once, jobs, make_job, tmp_path):
    procs = tmp_path / "fake.cgroup.procs"
    procs.write_text("")
    job_dir = make_job(["true"], cgroup_procs=[str(procs)])
    handle = await jobs.spawn(job_dir)
    status = await finish(handle, job_dir)
    assert status["exit_code"] == 0
    # the process that joins is the one the job is spawned from: the per-job keeper itself;
    # under keeperd the job's own process (forked, it joins before exec), never keeperd
    joined = handle.pid if jobs.mode == "forkserver" else read_keeper(job_dir)["job_pid"]
    assert procs.read_text().strip() == str(joined)


async def test_leftover_background_process_killed(jobs, make_job):
    job_dir = make_job(["sh", "-c", "sleep 300 & echo $!"])
    status = await jobs.run(job_dir)
    assert status["exit_code"] == 0
    assert status["detail"] is None  # pipes closed promptly: the group was killed
    bg = int(stream_bytes(job_dir, "stdout"))

    def gone() -> bool:
        try:
            return psutil.Process(bg).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    await wait_until(gone)
