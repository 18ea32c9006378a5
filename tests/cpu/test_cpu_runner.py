"""CPU placement through the whole runner (embedded, fake 32-thread sysfs, MockClock)."""

from __future__ import annotations

import fcntl
import os
import pytest
import trio

import motor
from motor.records import JobRequest, RefusedError

from fakesysfs import write_fake_sysfs
from runner_helpers import barrier_job, event_of, poll_until, terminal_of as terminal


def config(tmp_path, **kw):
    sysfs = write_fake_sysfs(tmp_path / "sys", online="0-31")
    return motor.RunnerConfig(state_dir=str(tmp_path / "state"), isolation="none",
                              free_space_floor_bytes=0, clock=motor.MockWallClock(),
                              sysfs_root=str(sysfs), **kw)


async def started(runner, job_id):
    return (await event_of(runner, job_id, "started")).cpus


async def test_linux_cpu_list_runs_a_long_twelve_vcpu_job_on_the_eight_listed_cpus(
        tmp_path, autojump_clock):
    barrier = tmp_path / "go"
    cfg = config(tmp_path, linux_cpus="12-15,28-31", max_weight=16)
    async with motor.open_runner(cfg) as runner:
        assert runner.host.claim_limit == 16
        job = await runner.submit(barrier_job(barrier, weight_hint=12, timeout_s=6 * 3600))
        assert job.claim == 12
        cpus = await started(runner, job.job_id)
        assert cpus == [12, 13, 14, 15, 28, 29, 30, 31]
        record = await runner.get(job.job_id)
        assert record.state == "running" and record.cpus == cpus and record.claim == 12
        barrier.write_text("")
        assert (await terminal(runner, job.job_id))["state"] == "succeeded"


async def test_linux_cpu_list_refuses_claims_above_max_weight_before_start_without_waiting(
        tmp_path, autojump_clock):
    cfg = config(tmp_path, linux_cpus="12-15,28-31", max_weight=16)
    async with motor.open_runner(cfg) as runner:
        t0 = trio.current_time()
        with pytest.raises(RefusedError) as info:
            await runner.submit(JobRequest(command=["true"], weight_hint=17))
        assert trio.current_time() == t0  # refused at once, never queued
        refusal = info.value.refusal
        assert refusal.code == "runner_full"
        assert "16" in refusal.detail and "12-15,28-31" in refusal.detail
        assert await runner.jobs(all=True) == []


async def test_without_a_linux_cpu_list_claims_above_max_weight_still_wait(tmp_path, autojump_clock):
    barrier = tmp_path / "go"
    async with motor.open_runner(config(tmp_path, max_weight=8)) as runner:
        assert runner.host.claim_limit == 30  # 32 threads less the kept-back first core pair
        small = await runner.submit(barrier_job(barrier, weight_hint=2, workspace="a"))
        await started(runner, small.job_id)
        big = await runner.submit(JobRequest(command=["true"], weight_hint=10, workspace="b",
                                             queue_wait_limit_s=120))
        assert big.state == "queued"  # accepted: within the claim limit
        status = await runner.status()
        [waiting] = status["queued"]
        assert waiting["job_id"] == big.job_id and waiting["waiting_on"] == "permits"
        assert "claim 10 vCPUs exceeds max_weight 8" in waiting["waiting_detail"]
        # it does not block others
        other = await runner.submit(JobRequest(command=["true"], weight_hint=2, workspace="c"))
        assert (await terminal(runner, other.job_id))["state"] == "succeeded"
        # (whether `big` is still queued at this point is not asserted: waiting on real
        # processes lets the autojump clock run on, up to its 120 s budget)
        barrier.write_text("")
        assert (await terminal(runner, small.job_id))["state"] == "succeeded"
        # max_weight is a hard bound: even on an idle host it waits, until its budget ends it
        record = await terminal(runner, big.job_id)
        assert (record["state"], record["reason"]) == ("refused_before_start", "queue_wait_exceeded")
        assert record["cpus"] is None and record["started_at_ms"] is None
        assert record["queue_wait_ms"] >= 120_000  # it waited its whole budget, never ran
        assert "exceeds max_weight 8" in record["detail"]


async def test_placement_avoids_the_windows_cpus_while_their_slot_lock_is_held(
        tmp_path, autojump_clock):
    lock = tmp_path / "windows.lock"
    lock.write_text("")
    cfg = config(tmp_path, linux_cpus="12-15,28-31", max_weight=16,
                 windows_cpus="12,13,28,29", windows_slot_lock=str(lock))
    async with motor.open_runner(cfg) as runner:
        fd = os.open(lock, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # the Windows tenant holds its slot
            job = await runner.submit(JobRequest(command=["true"], weight_hint=4, workspace="a"))
            assert (await terminal(runner, job.job_id))["cpus"] == [14, 15, 30, 31]
        finally:
            os.close(fd)  # slot released
        job = await runner.submit(JobRequest(command=["true"], weight_hint=4, workspace="b"))
        assert (await terminal(runner, job.job_id))["cpus"] == [12, 13, 28, 29]


async def test_a_restarted_dispatcher_keeps_the_cpus_of_the_jobs_that_run(tmp_path, autojump_clock):
    """A restarted dispatcher has the allocator release only placements no recorded start
    holds (tests/scheduling/test_runner_rules.py): a running job keeps its CPUs, and the
    next job is placed beside them, not on them."""
    go = tmp_path / "go"
    async with motor.open_runner(config(tmp_path, max_weight=8)) as runner:
        holder = await runner.submit(barrier_job(go, weight_hint=4, workspace="a"))
        held = await started(runner, holder.job_id)
        with pytest.raises(TypeError):
            await runner.dispatcher.call("not a message")  # the dispatcher restarts
        await poll_until(lambda: runner.dispatcher.alive and runner.dispatcher.restarts == 1, 60)
        assert (await runner.health())["cpus"]["jobs"] == {holder.job_id: held}
        other = await runner.submit(JobRequest(command=["true"], weight_hint=4, workspace="b"))
        assert not set(await started(runner, other.job_id)) & set(held)
        go.write_text("")
        assert (await terminal(runner, holder.job_id))["state"] == "succeeded"
