"""Retention: 24 h from the later of the job's end and its UUIDv7 time (MockClock)."""

from __future__ import annotations

from contextlib import aclosing

import pytest
import trio

import motor
from motor.clock import uuid7_ms
from motor.maintenance import RunPass
from motor.records import JobRequest, RefusedError

DAY_MS = 24 * 3600 * 1000


async def test_expired_history_never_becomes_before_start_refusal(tmp_path, autojump_clock):
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

        await trio.sleep(max(0, expires_ms - 60_000 - clock.now_ms()) / 1000)
        await runner.actor("maintenance").call(RunPass())
        assert (await runner.get(job.job_id)).state == "succeeded"  # just inside 24 h

        await trio.sleep(max(0, expires_ms + 60_000 - clock.now_ms()) / 1000)
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
