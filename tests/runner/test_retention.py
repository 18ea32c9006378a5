"""Retention: 24 h from the later of the job's end and its UUIDv7 time (MockClock)."""

from __future__ import annotations

from contextlib import aclosing

import pytest

import motor
from motor.clock import uuid7_ms
from motor.maintenance import RunPass
from motor.records import JobRequest, Output, RefusedError

DAY_MS = 24 * 3600 * 1000


async def test_expired_history_never_becomes_before_start_refusal(tmp_path, autojump_clock,
                                                                  monkeypatch):
    offloaded, real = [], motor.MockWallClock.offload

    async def offload(self, fn, *args):  # inline under a test's clock; a thread in production
        offloaded.append(getattr(fn, "__name__", fn))
        return await real(self, fn, *args)

    monkeypatch.setattr(motor.MockWallClock, "offload", offload)
    clock = motor.MockWallClock()
    config = motor.RunnerConfig(state_dir=str(tmp_path / "state"), isolation="none",
                                free_space_floor_bytes=0, clock=clock)
    async with motor.open_runner(config) as runner:
        job = await runner.submit(JobRequest(command=["sh", "-c", "echo done"]))
        async with aclosing(runner.events(job.job_id)) as events:
            async for event in events:
                pass
        record = await runner.get(job.job_id)
        assert record.state == "succeeded"
        expires_ms = max(record.ended_at_ms, uuid7_ms(job.job_id)) + DAY_MS
        # jumps, not sleeps: autojump through a day stepped through each 2 s tick of the
        # disk actor's probe (6 s of the suite's time)

        autojump_clock.jump(max(0, expires_ms - 60_000 - clock.now_ms()) / 1000)
        await runner.actor("maintenance").call(RunPass())
        assert (await runner.get(job.job_id)).state == "succeeded"  # just inside 24 h

        autojump_clock.jump(max(0, expires_ms + 60_000 - clock.now_ms()) / 1000)
        await runner.actor("maintenance").call(RunPass())
        with pytest.raises(RefusedError) as info:
            await runner.get(job.job_id)
        assert info.value.refusal.code == "history_expired"
        with pytest.raises(RefusedError) as info:
            async with aclosing(runner.events(job.job_id)) as events:
                async for event in events:
                    pass
        # history_expired: never turned into a before-start refusal of the job
        assert info.value.refusal.code == "history_expired"
        assert await runner.jobs(all=True) == []
        assert not (tmp_path / "state" / "jobs" / job.job_id).exists()
        # its directory removed through the runner's offload, off the event loop (stop 63)
        assert "remove_job_dirs" in offloaded


async def _ended(runner, job_id: str):
    """The job's record once it has ended, and when its end counts for retention (the later
    of its end and its id's time: under a test's wall clock the keeper's end can read
    earlier)."""
    async with aclosing(runner.events(job_id)) as events:
        async for _ in events:
            pass
    record = await runner.get(job_id)
    return record, max(record.ended_at_ms, uuid7_ms(job_id))


async def test_an_ended_jobs_directory_is_emptied_a_minute_after_its_end_and_kept_until_retention(
        tmp_path, mock_clock):
    """Its output is in the store: the files are a copy that held inodes and bytes for a day
    (a state file system out of inodes stopped every start). The directory stays until
    retention; a running job's files are not touched.

    The clock runs at real speed and jumps only where the test says, once the second job
    runs: under autojump, its set-up (real work: keeperd's spawn) let the virtual clock run
    past both minutes on a loaded host, and it was still in `setup` at the check (CI, stop
    80)."""
    mock_clock.rate = 1.0
    clock = motor.MockWallClock()
    barrier = tmp_path / "go"
    # only the test's passes count: a periodic one (every 60 s of the virtual time, which
    # jumps while the jobs run) that fell between the end's 60th and 61st second emptied
    # the directory first, and the test's pass found none to empty (CI, stop 59)
    config = motor.RunnerConfig(state_dir=str(tmp_path / "state"), isolation="none",
                                free_space_floor_bytes=0, clock=clock,
                                maintenance_interval_s=10**6)
    jobs = tmp_path / "state" / "jobs"
    async with motor.open_runner(config) as runner:
        done = await runner.submit(JobRequest(command=["sh", "-c", "echo done"]))
        record, end_ms = await _ended(runner, done.job_id)
        assert record.state == "succeeded"
        running = await runner.submit(JobRequest(command=[
            "sh", "-c", f"echo started; while [ ! -e {barrier} ]; do sleep 0.01; done"]))
        async with aclosing(runner.events(running.job_id)) as events:
            async for event in events:  # it runs before the minute passes
                if isinstance(event, Output) and "started" in event.data:
                    break
        files = {"output.log", "spec.json", "status.json", "keeper.json"}
        assert files <= {p.name for p in (jobs / done.job_id).iterdir()}

        maintenance = runner.actor("maintenance")
        mock_clock.jump(max(0, end_ms + 50_000 - clock.now_ms()) / 1000)
        assert (await maintenance.call(RunPass()))["emptied"] == 0  # not a minute yet
        assert files <= {p.name for p in (jobs / done.job_id).iterdir()}

        mock_clock.jump(max(0, end_ms + 61_000 - clock.now_ms()) / 1000)
        assert (await maintenance.call(RunPass()))["emptied"] == 1
        assert (jobs / done.job_id).is_dir() and not list((jobs / done.job_id).iterdir())
        assert (await runner.get(running.job_id)).state == "running"
        assert {"spec.json", "keeper.json"} <= {p.name for p in (jobs / running.job_id).iterdir()}
        # the output is the store's: still served in full
        async with aclosing(runner.events(done.job_id)) as events:
            assert "".join([e.data async for e in events if isinstance(e, Output)]) == "done\n"

        barrier.touch()
        ended, end_ms = await _ended(runner, running.job_id)
        assert ended.state == "succeeded"
        mock_clock.jump(max(0, end_ms + 61_000 - clock.now_ms()) / 1000)
        assert (await maintenance.call(RunPass()))["emptied"] == 1  # the next one only
        assert not list((jobs / running.job_id).iterdir())
        assert (await maintenance.call(RunPass()))["emptied"] == 0



async def test_a_pass_deletes_expired_verbose_jobs_in_batches_bounded_by_their_output(
        tmp_path, autojump_clock, monkeypatch):
    """Through the runner (maintenance -> store): two expired jobs of 3 MB of output each
    go in two store calls of one job each, since both together pass EXPIRE_BATCH_BYTES
    (4 MiB); the saves waiting meanwhile are written between them (stop 63: one call of up
    to 1,000 jobs before, on the event loop)."""
    from motor.store.db import EXPIRE_BATCH_BYTES, Database

    calls, real = [], Database.expire
    monkeypatch.setattr(Database, "expire", lambda self, *a, **kw: (
        calls.append(ids := real(self, *a, **kw)), ids)[1])
    clock = motor.MockWallClock()
    config = motor.RunnerConfig(state_dir=str(tmp_path / "state"), isolation="none",
                                free_space_floor_bytes=0, clock=clock,
                                maintenance_interval_s=10**9)
    async with motor.open_runner(config) as runner:
        ends = []
        for _ in range(2):
            job = await runner.submit(JobRequest(command=[
                "sh", "-c", "head -c 3000000 /dev/zero | tr '\\0' x"]))
            ends.append((await _ended(runner, job.job_id))[1])
        assert 2 * 3_000_000 > EXPIRE_BATCH_BYTES > 3_000_000
        autojump_clock.jump(max(0, max(ends) + DAY_MS + 60_000 - clock.now_ms()) / 1000)
        calls.clear()
        assert (await runner.actor("maintenance").call(RunPass()))["expired"] == 2
        assert [len(ids) for ids in calls] == [1, 1, 0], calls
        assert await runner.jobs(all=True) == []
