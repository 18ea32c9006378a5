"""The scheduling rules through the runner (issue 11): the embedded runner's actors with
real job processes, under trio's MockClock where time must be virtual, and on the real
clock where a test stages a race with file barriers and a hooked setup step.

A *hooked setup* replaces the isolation backend's `prepare` (the last setup step before
the keeper is spawned) for the jobs of one workspace: it blocks until a barrier file
exists, or raises, which the job actor reports as a failed start.  Everything else is
the real runner.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import trio

import motor
from motor.isolation.base import Backend, IsolationError
from motor.records import JobRequest, RefusedError
from runner_helpers import barrier_job, embedded_config, terminal_of as _terminal_of


async def terminal_of(runner, job_id: str, timeout: float = 1000) -> dict:
    """The job's terminal record, within `timeout` seconds (virtual under MockClock)."""
    with trio.fail_after(timeout):
        return await _terminal_of(runner, job_id)


async def wait_until(predicate, what: str, timeout: float = 600):
    """Poll an async predicate (virtual seconds under MockClock, real ones otherwise)."""
    with trio.fail_after(timeout):
        while not (value := await predicate()):
            await trio.sleep(0.02)
    return value


async def state_of(runner, job_id: str) -> str:
    return (await runner.get(job_id)).state


def hook_setup(monkeypatch, runner, workspaces: tuple[str, ...], *, barrier: Path | None = None,
               error: str | None = None, times: int | None = None) -> list[str]:
    """Hook the setup of the jobs in `workspaces`: block until `barrier` exists, then raise
    `error` if given (the first `times` attempts only, when given). Returns the ids of the
    hooked attempts."""
    real = Backend.prepare
    hooked: list[str] = []

    def prepare(self, job_id, cpus, memory_max):
        record = runner.db.get(job_id)
        if record is not None and record.workspace in workspaces and (
                times is None or len(hooked) < times):
            hooked.append(job_id)
            if barrier is not None:
                deadline = time.monotonic() + 60
                while not barrier.exists() and time.monotonic() < deadline:
                    time.sleep(0.01)
            if error is not None:
                raise IsolationError(error)
        return real(self, job_id, cpus, memory_max)

    monkeypatch.setattr(Backend, "prepare", prepare)
    return hooked


# --- item 1: runner-enforced budgets fire at their deadline ---------------------------------


async def test_runner_enforced_budgets_fire_at_their_deadline_zero_included(tmp_path, autojump_clock):
    go = tmp_path / "go"
    async with motor.open_runner(embedded_config(tmp_path, max_weight=1)) as runner:
        holder = await runner.submit(barrier_job(go, weight_hint=1, workspace="a"))
        await wait_until(lambda: _is(runner, holder.job_id, "running"), "the holder to run")
        zero = await runner.submit(JobRequest(command=["true"], weight_hint=1, workspace="b",
                                              queue_wait_limit_s=0))
        record = await terminal_of(runner, zero.job_id)
        assert (record["state"], record["reason"]) == ("refused_before_start", "queue_wait_exceeded")
        assert record["ended_at_ms"] - record["accepted_at_ms"] < 1000  # within a tick, not 60 s
        assert record["queue_wait_ms"] < 1000
        # behind an aged head of its own workspace that waits for capacity: the clock advances
        head = await runner.submit(JobRequest(command=["true"], weight_hint=1, workspace="w"))
        await trio.sleep(61)
        behind = await runner.submit(JobRequest(command=["true"], weight_hint=1, workspace="w",
                                                queue_wait_limit_s=30))
        live = await runner.get(behind.job_id)
        assert (live.waiting_on, live.waiting_on_job) == ("workspace_owner", head.job_id)
        record = await terminal_of(runner, behind.job_id)
        assert record["reason"] == "queue_wait_exceeded"
        assert 30_000 <= record["queue_wait_ms"] < 31_000
        assert record["ended_at_ms"] - record["accepted_at_ms"] < 31_000
        await runner.cancel(head.job_id)
        go.write_text("")
        assert (await terminal_of(runner, holder.job_id))["state"] == "succeeded"


async def _is(runner, job_id, state) -> bool:
    return await state_of(runner, job_id) == state


# --- item 4: only the seed's two blockers pause the clock -----------------------------------


async def test_a_busy_own_sibling_spends_queue_wait_while_a_workspace_owner_does_not(
        tmp_path, autojump_clock):
    go = tmp_path / "go"
    async with motor.open_runner(embedded_config(tmp_path, max_weight=4)) as runner:
        holder = await runner.submit(barrier_job(go, weight_hint=1, workspace="lib"))
        await wait_until(lambda: _is(runner, holder.job_id, "running"), "the holder to run")
        needs_lib = await runner.submit(JobRequest(
            command=["true"], weight_hint=1, workspace="app", siblings=["lib"],
            queue_wait_limit_s=20))
        same_ws = await runner.submit(JobRequest(
            command=["true"], weight_hint=1, workspace="lib", queue_wait_limit_s=20))
        live = await runner.get(needs_lib.job_id)
        assert (live.waiting_on, live.waiting_on_job) == ("workspace_owner", holder.job_id)
        record = await terminal_of(runner, needs_lib.job_id)  # its own sibling is busy
        assert record["reason"] == "queue_wait_exceeded" and 20_000 <= record["queue_wait_ms"] < 21_000
        await trio.sleep(100)
        live = await runner.get(same_ws.job_id)  # an earlier owner of its workspace: paused
        assert live.state == "queued" and live.queue_wait_ms == 0
        go.write_text("")
        assert (await terminal_of(runner, same_ws.job_id))["state"] == "succeeded"


# --- item 2: a restart resumes clocks and enforces every budget no live follower holds ----------


async def test_a_restart_resumes_queue_wait_clocks_and_enforces_budgets_of_gone_followers(
        tmp_path, autojump_clock):
    # claims above --max-weight 1 (within the 2-CPU claim limit) wait for capacity forever:
    # their clocks advance with no job running
    cfg = embedded_config(tmp_path, max_weight=1)
    async with motor.open_runner(cfg) as runner:
        followed = await runner.submit(JobRequest(command=["true"], weight_hint=2, workspace="a",
                                                  queue_wait_limit_s=30), follow=True)
        unfollowed = await runner.submit(JobRequest(command=["true"], weight_hint=2, workspace="b",
                                                    queue_wait_limit_s=100))
        await trio.sleep(20)
        assert (await runner.get(followed.job_id)).queue_wait_ms >= 20_000
    async with motor.open_runner(cfg) as runner:
        resumed = await runner.get(unfollowed.job_id)
        assert resumed.state == "queued" and resumed.queue_wait_ms >= 20_000
        record = await terminal_of(runner, followed.job_id)  # its follower is gone
        assert (record["state"], record["reason"]) == ("refused_before_start", "queue_wait_exceeded")
        assert 30_000 <= record["queue_wait_ms"] < 31_000
        assert record["ended_at_ms"] - record["accepted_at_ms"] < 31_000
        record = await terminal_of(runner, unfollowed.job_id)
        assert 100_000 <= record["queue_wait_ms"] < 101_000
        assert record["ended_at_ms"] - record["accepted_at_ms"] < 101_000


async def test_a_restarted_dispatcher_leaves_a_live_followers_budget_to_it(tmp_path, autojump_clock):
    async with motor.open_runner(embedded_config(tmp_path, max_weight=1)) as runner:
        job = await runner.submit(JobRequest(command=["true"], weight_hint=2, workspace="a",
                                             queue_wait_limit_s=5), follow=True)
        async with trio.open_nursery() as nursery:
            async def follow():
                async for _ in runner.follow(job.job_id):
                    pass

            nursery.start_soon(follow)
            await trio.sleep(1)
            with pytest.raises(TypeError):
                await runner.dispatcher.call("not a message")  # the dispatcher restarts
            await wait_until(lambda: _alive_again(runner), "the dispatcher to come back")
            await trio.sleep(30)  # the follower enforces this budget, not the runner
            live = await runner.get(job.job_id)
            assert live.state == "queued" and live.queue_wait_ms >= 30_000
            assert await runner.withdraw(job.job_id) == "withdrawn"  # what its client does
            nursery.cancel_scope.cancel()


async def _alive_again(runner) -> bool:
    return runner.dispatcher.alive and runner.dispatcher.restarts == 1


# --- item 3: queue depth counts jobs in setup -------------------------------------------------


async def test_queue_depth_counts_jobs_still_in_setup(tmp_path, monkeypatch):
    barrier = tmp_path / "setup-go"
    async with motor.open_runner(embedded_config(tmp_path, max_weight=4, max_queue_depth=2)) as runner:
        hooked = hook_setup(monkeypatch, runner, ("s1", "s2"), barrier=barrier)
        jobs = [await runner.submit(JobRequest(command=["true"], weight_hint=1, workspace=ws))
                for ws in ("s1", "s2")]
        await wait_until(lambda: _all_in(runner, jobs, "setup"), "both jobs to be in setup", 60)
        with pytest.raises(RefusedError) as refused:
            await runner.submit(JobRequest(command=["true"], weight_hint=1, workspace="c"))
        assert refused.value.refusal.code == "runner_full"
        assert "2 jobs accepted and not yet running" in refused.value.refusal.detail
        assert (await runner.status())["capacity"]["pending_jobs"] == 2
        assert (await runner.health())["admission_refusals"]["runner_full"] == 1
        barrier.write_text("")
        for job in jobs:
            assert (await terminal_of(runner, job.job_id))["state"] == "succeeded"
        assert sorted(hooked) == sorted(j.job_id for j in jobs)
        third = await runner.submit(JobRequest(command=["true"], weight_hint=1, workspace="c"))
        assert (await terminal_of(runner, third.job_id))["state"] == "succeeded"


async def _all_in(runner, jobs, state: str) -> bool:
    return all([await state_of(runner, j.job_id) == state for j in jobs])


# --- item 5: a failed start keeps its place in the rotation ---------------------------------


async def test_a_failed_start_keeps_its_rotation_place_through_the_runner(
        tmp_path, monkeypatch, mock_clock):
    """The clock runs at real speed and jumps only past the retry delay (the race is staged
    with barriers; it all takes well under 60 s, so no head ages and the rotation decides)."""
    mock_clock.rate = 1.0
    fail_go, x_go, a2_go = tmp_path / "fail-go", tmp_path / "x-go", tmp_path / "a2-go"
    async with motor.open_runner(embedded_config(tmp_path, max_weight=2)) as runner:
        for ws in ("a", "b"):  # a dispatched before b
            job = await runner.submit(JobRequest(command=["true"], weight_hint=1, workspace=ws))
            assert (await terminal_of(runner, job.job_id, 60))["state"] == "succeeded"
        hooked = hook_setup(monkeypatch, runner, ("a",), barrier=fail_go,
                            error="injected: setup failed once", times=1)
        a2 = await runner.submit(barrier_job(a2_go, weight_hint=2, workspace="a"))
        await wait_until(lambda: _is(runner, a2.job_id, "setup"), "a2 in setup", 60)
        x = await runner.submit(barrier_job(x_go, weight_hint=1, workspace="x"))
        b3 = await runner.submit(JobRequest(command=["true"], weight_hint=2, workspace="b"))
        fail_go.write_text("")  # a2's start fails: requeued with a 1 s retry delay
        await wait_until(lambda: _is(runner, x.job_id, "running"), "x to backfill", 60)
        a2_now = await runner.get(a2.job_id)
        assert a2_now.state == "queued" and a2_now.attempts == 1 and hooked == [a2.job_id]
        mock_clock.jump(1.5)  # past a2's 1 s retry delay: now it waits for permits like b3
        await trio.sleep(0)
        x_go.write_text("")  # capacity frees: a2 (a dispatched least recently) goes before b3
        await wait_until(lambda: _left_queue(runner, (a2.job_id, b3.job_id)), "a start", 60)
        assert (await runner.get(a2.job_id)).state in ("setup", "running")
        assert (await runner.get(b3.job_id)).state == "queued"
        a2_go.write_text("")
        for job in (a2, b3):
            assert (await terminal_of(runner, job.job_id, 60))["state"] == "succeeded"
        assert (await runner.get(a2.job_id)).started_at_ms <= (await runner.get(b3.job_id)).started_at_ms


async def _left_queue(runner, ids) -> bool:
    return any([await state_of(runner, j) != "queued" for j in ids])


# --- item 8: budget exhausted after failed starts keeps the failure ---------------------------


async def test_a_budget_exhausted_after_failed_starts_keeps_the_last_start_failure(
        tmp_path, monkeypatch, autojump_clock):
    async with motor.open_runner(embedded_config(tmp_path, max_weight=2)) as runner:
        hook_setup(monkeypatch, runner, ("f",), error="injected: cgroup jobs/f is read-only")
        job = await runner.submit(JobRequest(command=["true"], weight_hint=1, workspace="f",
                                             queue_wait_limit_s=5))
        record = await terminal_of(runner, job.job_id)
        assert (record["state"], record["reason"]) == ("refused_before_start", "queue_wait_exceeded")
        assert record["attempts"] >= 2
        assert "injected: cgroup jobs/f is read-only" in record["detail"], record["detail"]
        assert "start attempts failed" in record["detail"]
        assert 5_000 <= record["queue_wait_ms"] < 6_000


# --- item 7: withdraw answers match the record -----------------------------------------------


async def test_withdraw_of_an_ended_job_answers_what_happened(tmp_path, autojump_clock):
    async with motor.open_runner(embedded_config(tmp_path, max_weight=1)) as runner:
        waiting = await runner.submit(JobRequest(command=["true"], weight_hint=2, workspace="a"),
                                      follow=True)
        await runner.cancel(waiting.job_id)
        with pytest.raises(RefusedError) as refused:
            await runner.withdraw(waiting.job_id)
        assert refused.value.refusal.code == "already_ended"
        assert "cancelled" in refused.value.refusal.detail
        withdrawn = await runner.submit(JobRequest(command=["true"], weight_hint=2, workspace="b"),
                                        follow=True)
        assert await runner.withdraw(withdrawn.job_id) == "withdrawn"
        with pytest.raises(RefusedError) as refused:  # asked again: never "withdrawn" twice
            await runner.withdraw(withdrawn.job_id)
        assert refused.value.refusal.code == "already_ended"
        assert "refused_before_start" in refused.value.refusal.detail
        ran = await runner.submit(JobRequest(command=["true"], weight_hint=1, workspace="c"))
        assert (await terminal_of(runner, ran.job_id))["state"] == "succeeded"
        assert await runner.withdraw(ran.job_id) == "started"  # it ran: too late
