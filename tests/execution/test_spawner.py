"""Forkserver client, keeper survival, identity helpers."""

from __future__ import annotations

import os
import signal
import subprocess

import psutil
import pytest
import trio
import trio.testing
from keeper_helpers import finish, records, stream_bytes, wait_until

from motor.execution import (
    SpawnerError,
    cancel_keeper,
    open_spawner,
    process_alive,
    read_keeper,
    read_status,
    wait_process_exit,
)
from motor.execution import spawner as spawner_mod


def wait_for_file_cmd(name: str) -> list[str]:
    return ["sh", "-c", f"echo first; while [ ! -e {name} ]; do sleep 0.01; done; echo last"]


async def test_keeper_survives_forkserver_sigkill(jobs, make_job, workspace):
    """Jobs outlive the runner: the keeper still records output and status."""
    job_dir = make_job(wait_for_file_cmd("go"))
    handle = await jobs.spawn(job_dir)
    await wait_until(lambda: ("stdout", b"first\n") in records(job_dir))

    fs_pid = jobs.spawner.forkserver_pid
    fs_proc = psutil.Process(fs_pid)
    assert handle.pid in [c.pid for c in fs_proc.children()]
    os.kill(fs_pid, signal.SIGKILL)
    with trio.fail_after(10):
        await wait_process_exit(fs_pid, fs_proc.create_time())

    assert process_alive(handle.pid, handle.create_time)
    assert read_status(job_dir) is None
    (workspace / "go").touch()
    status = await finish(handle, job_dir)
    assert status["exit_code"] == 0
    assert status["reason"] is None
    assert records(job_dir) == [("stdout", b"first\n"), ("stdout", b"last\n")]

    # the spawner transparently starts a new forkserver for the next spawn
    status = await jobs.run(make_job(["true"]))
    assert status["exit_code"] == 0
    assert jobs.spawner.forkserver_pid not in (None, fs_pid)


async def test_keeper_survives_spawner_close(make_job, workspace):
    job_dir = make_job(wait_for_file_cmd("go"))
    async with open_spawner() as spawner:
        handle = await spawner.spawn(job_dir)
        fs_pid = spawner.forkserver_pid
    assert spawner.forkserver_pid is None
    assert not psutil.pid_exists(fs_pid) or psutil.Process(fs_pid).status() == psutil.STATUS_ZOMBIE
    try:
        assert process_alive(handle.pid, handle.create_time)
        await wait_until(lambda: ("stdout", b"first\n") in records(job_dir))
        (workspace / "go").touch()
        status = await finish(handle, job_dir)
        assert status["exit_code"] == 0
        assert stream_bytes(job_dir, "stdout") == b"first\nlast\n"
    finally:
        cancel_keeper(handle.pid, handle.create_time)


async def test_many_concurrent_spawns(jobs, make_job):
    dirs = [make_job(["true"]) for _ in range(100)]
    statuses: dict[int, dict] = {}

    async def one(i):
        statuses[i] = await jobs.run(dirs[i], timeout=60)

    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            for i in range(len(dirs)):
                nursery.start_soon(one, i)
    assert len(statuses) == 100
    assert all(s["exit_code"] == 0 and s["reason"] is None for s in statuses.values())
    assert len({h.pid for h in jobs.handles}) == 100
    # the forkserver reaps its keepers: no zombie children pile up
    fs = psutil.Process(jobs.spawner.forkserver_pid)

    def zombie(child: psutil.Process) -> bool:
        try:
            return child.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:  # reaped between children() and status(): no zombie
            return False

    def no_zombies():
        return not [c for c in fs.children() if zombie(c)]

    await wait_until(no_zombies)


async def test_forkserver_death_mid_request_raises_then_recovers(jobs, make_job):
    fs_pid = jobs.spawner.forkserver_pid
    os.kill(fs_pid, signal.SIGSTOP)  # request is written to the pipe, never answered
    errors = []

    async def spawn():
        try:
            await jobs.spawn(make_job(["true"]))
        except SpawnerError as exc:
            errors.append(exc)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(spawn)
            await trio.testing.wait_all_tasks_blocked()
            os.kill(fs_pid, signal.SIGKILL)
    assert len(errors) == 1
    status = await jobs.run(make_job(["true"]))
    assert status["exit_code"] == 0


async def test_missing_spec_is_spawn_failed(jobs, tmp_path):
    job_dir = tmp_path / "nospec"
    job_dir.mkdir()
    status = await jobs.run(job_dir)
    assert status["reason"] == "spawn_failed"
    assert "spec.json" in status["detail"]


async def test_cancelled_caller_does_not_lose_the_keeper(jobs, make_job):
    """Cancelling a spawn whose request is in flight still yields the handle."""
    job_dir = make_job(["true"])
    fs_pid = jobs.spawner.forkserver_pid
    os.kill(fs_pid, signal.SIGSTOP)
    got = []
    try:
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:

                async def spawn(task_status=trio.TASK_STATUS_IGNORED):
                    with trio.CancelScope() as scope:
                        task_status.started(scope)
                        got.append(await jobs.spawn(job_dir))
                        await trio.lowlevel.checkpoint()
                        got.append("not cancelled?")

                scope = await nursery.start(spawn)
                await trio.testing.wait_all_tasks_blocked()
                scope.cancel()
                await trio.testing.wait_all_tasks_blocked()
                assert got == []  # still waiting for the (stopped) forkserver
                os.kill(fs_pid, signal.SIGCONT)
    finally:
        os.kill(fs_pid, signal.SIGCONT)
    assert len(got) == 1
    status = await finish(got[0], job_dir)
    assert status["exit_code"] == 0
    assert read_keeper(job_dir)["keeper_pid"] == got[0].pid


# -- identity helpers --------------------------------------------------------


@pytest.mark.parametrize("use_pidfd", [True, False])
async def test_wait_process_exit(monkeypatch, use_pidfd):
    if not use_pidfd:

        def no_pidfd(pid, flags=0):
            raise OSError(38, "pidfd_open not available")

        monkeypatch.setattr(spawner_mod.os, "pidfd_open", no_pidfd)
    proc = await trio.lowlevel.open_process(["sleep", "30"], stdin=subprocess.DEVNULL)
    try:
        ct = psutil.Process(proc.pid).create_time()
        assert process_alive(proc.pid, ct)
        done = trio.Event()

        async def waiter():
            await wait_process_exit(proc.pid, ct)
            done.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter)
            await trio.testing.wait_all_tasks_blocked()
            assert not done.is_set()
            proc.kill()  # stays a zombie until proc.wait(): counts as exited
            with trio.fail_after(10):
                await done.wait()
        assert not process_alive(proc.pid, ct)
    finally:
        proc.kill()
        await proc.wait()


async def test_identity_mismatch_returns_at_once():
    me = psutil.Process()
    ct = me.create_time()
    assert process_alive(me.pid, ct)
    assert not process_alive(me.pid, ct - 3600)
    with trio.fail_after(5):
        await wait_process_exit(me.pid, ct - 3600)  # pid "reused": not ours
    assert not cancel_keeper(me.pid, ct - 3600)  # and must not be signalled


async def test_gone_pid():
    proc = await trio.lowlevel.open_process(["true"])
    await proc.wait()
    assert not process_alive(proc.pid, 0.0)
    with trio.fail_after(5):
        await wait_process_exit(proc.pid, 0.0)
    assert not cancel_keeper(proc.pid, 0.0)


async def test_spawn_after_close_raises(make_job):
    async with open_spawner() as spawner:
        pass
    with pytest.raises(SpawnerError):
        await spawner.spawn(make_job(["true"]))


async def test_a_stopped_forkserver_leaves_its_spawn_counted_as_waiting_until_it_answers(
        jobs, make_job):
    """Stop 59 (health's "a job's spawn has waited N s"): the forkserver spawner counts a
    spawn in flight from the request until its answer, and names its process; the same
    bookkeeping as keeperd's, which tests/e2e/test_restart_adoption.py checks through serve."""
    first = make_job(["true"])
    await jobs.run(first, timeout=60)  # the forkserver is up
    spawner = jobs.spawner
    pid = spawner.forkserver_pid
    assert spawner.keeper_process == f"the forkserver, pid {pid}"
    assert spawner.waits.longest_s(trio.current_time()) == 0.0
    os.kill(pid, signal.SIGSTOP)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(spawner.spawn, make_job(["true"]))
            await trio.sleep(0.3)  # real time passes while it cannot answer
            assert spawner.waits.longest_s(trio.current_time()) >= 0.3
            os.kill(pid, signal.SIGCONT)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert spawner.waits.longest_s(trio.current_time()) == 0.0
