"""The runner's actors in-process (the embedding API) under trio's MockClock.

Jobs are real processes; everything the runner decides in time (heartbeats, queue-wait
budgets, retention) runs on the virtual clock, so these tests order things with file
barriers and events, never with sleeps.
"""

from __future__ import annotations

import os

import pytest
import trio

import motor
from motor.records import JobRequest, RefusedError
from motor.maintenance import RunPass
from runner_helpers import (PATIENT_S, barrier_job as _barrier_job, embedded_config, poll_until,
                            terminal_of)


def config(tmp_path, **kw) -> motor.RunnerConfig:
    return embedded_config(tmp_path, **kw)


def barrier_job(path, **kw) -> JobRequest:
    return _barrier_job(path, say=True, **kw)


async def wait_until(predicate, what: str):
    await poll_until(predicate, 600, interval=0.05)  # virtual seconds under MockClock


async def test_embedded_runner_streams_output_and_ends_with_the_exit_status(tmp_path, autojump_clock):
    async with motor.open_runner(config(tmp_path)) as runner:
        job = await runner.submit(JobRequest(
            command=["sh", "-c", "echo one; echo two >&2; exit 4"], weight_hint=1))
        assert job.state == "queued" and job.claim == 1
        events = [e async for e in runner.events(job.job_id)]
        tags = [e.__struct_config__.tag for e in events]
        assert tags[:3] == ["accepted", "queued", "started"]
        assert tags[-1] == "terminal"
        seqs = [e.seq for e in events]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
        out = [(e.stream, e.data) for e in events if e.__struct_config__.tag == "output"]
        assert "".join(d for s, d in out if s == "stdout") == "one\n"
        assert "".join(d for s, d in out if s == "stderr") == "two\n"
        record = events[-1].record
        assert record["state"] == "failed" and record["exit_code"] == 4
        assert record["cpus"] is not None and len(record["cpus"]) == 1


async def test_runner_enforces_the_queue_wait_budget_of_an_unfollowed_job(tmp_path, autojump_clock):
    barrier = tmp_path / "go"
    async with motor.open_runner(config(tmp_path, max_weight=1)) as runner:
        holder = await runner.submit(barrier_job(barrier, weight_hint=1, workspace="a"))
        waiter = await runner.submit(JobRequest(command=["true"], weight_hint=1, workspace="b",
                                                queue_wait_limit_s=30))
        record = await terminal_of(runner, waiter.job_id)
        assert record["state"] == "refused_before_start"
        assert record["reason"] == "queue_wait_exceeded"
        assert record["queue_wait_ms"] >= 30_000
        assert record["started_at_ms"] is None
        barrier.write_text("")
        assert (await terminal_of(runner, holder.job_id))["state"] == "succeeded"


async def test_a_crashed_dispatcher_restarts_and_rebuilds_its_queue_from_the_store(
        tmp_path, autojump_clock):
    barrier = tmp_path / "go"
    async with motor.open_runner(config(tmp_path, max_weight=1)) as runner:
        holder = await runner.submit(barrier_job(barrier, weight_hint=1, workspace="a"))
        queued = await runner.submit(JobRequest(command=["sh", "-c", "echo after"],
                                                weight_hint=1, workspace="b",
                                                queue_wait_limit_s=PATIENT_S))
        with pytest.raises(TypeError):
            await runner.dispatcher.call("not a message")  # the actor's error reaches us
        await wait_until(lambda: _restarted(runner.dispatcher), "the dispatcher to come back")
        status = await runner.status()
        assert [r["job_id"] for r in status["queued"]] == [queued.job_id]
        assert [r["job_id"] for r in status["running"]] == [holder.job_id]
        assert status["capacity"]["held_permits"] == 1
        barrier.write_text("")
        assert (await terminal_of(runner, holder.job_id))["state"] == "succeeded"
        assert (await terminal_of(runner, queued.job_id))["state"] == "succeeded"


async def _restarted(ref) -> bool:
    return ref.alive and ref.restarts == 1


async def test_records_survive_reopening_the_runner(tmp_path, autojump_clock):
    cfg = config(tmp_path)
    async with motor.open_runner(cfg) as runner:
        job = await runner.submit(JobRequest(command=["sh", "-c", "echo kept"]))
        await terminal_of(runner, job.job_id)
    async with motor.open_runner(cfg) as runner:
        record = await runner.get(job.job_id)
        assert record.state == "succeeded"
        data = [e.data for e in [e async for e in runner.events(job.job_id)]
                if e.__struct_config__.tag == "output"]
        assert data == ["kept\n"]


async def test_a_second_runner_on_the_same_state_dir_is_refused(tmp_path, autojump_clock):
    cfg = config(tmp_path)
    async with motor.open_runner(cfg):
        with pytest.raises(motor.StartupError, match="in use by another runner"):
            async with motor.open_runner(cfg):
                pass  # pragma: no cover
        (tmp_path / "state" / "runner.lock").unlink()  # a "stale lock" removed by hand
        with pytest.raises(motor.StartupError, match=f"another runner \\(pid {os.getpid()}\\)"):
            async with motor.open_runner(cfg):
                pass  # pragma: no cover


async def test_gate_is_recorded_only_when_the_client_negotiated_gate_jobs(tmp_path, autojump_clock):
    async with motor.open_runner(config(tmp_path, max_weight=1)) as runner:
        plain = await runner.submit(JobRequest(command=["true"], gate=True, workspace="a"))
        negotiated = await runner.submit(JobRequest(command=["true"], gate=True, workspace="b",
                                                    capabilities=["gate_jobs"]))
        assert plain.gate is False
        assert negotiated.gate is True
        for job in (plain, negotiated):
            await terminal_of(runner, job.job_id)


async def test_refusals_are_typed_and_leave_no_record(tmp_path, autojump_clock):
    async with motor.open_runner(config(tmp_path)) as runner:
        for weight in (0, 10_000):
            with pytest.raises(RefusedError) as info:
                await runner.submit(JobRequest(command=["true"], weight_hint=weight))
            assert info.value.refusal.code == "runner_full"
            assert "claim limit" in info.value.refusal.detail
        with pytest.raises(RefusedError) as info:
            await runner.submit(JobRequest(command=["true"], workspace=".."))
        assert info.value.refusal.code == "bad_request"
        assert await runner.jobs(all=True) == []
        health = await runner.health()
        # malformed requests are not admission decisions: only capacity refusals count
        assert health["admission_refusals"] == {"runner_full": 2}


#: requests built in Python that no decoder has checked: each breaks a field's type
MISTYPED = [
    (dict(command=["true"], kind="background"), "`$.kind`"),
    (dict(command=["true"], workspace_kind="scratch"), "`$.workspace_kind`"),
    (dict(command="true"), "`$.command`"),
    (dict(command=["true"], weight_hint="2"), "`$.weight_hint`"),
    (dict(command=["true"], weight_hint=True), "`$.weight_hint`"),
    (dict(command=["true"], env={"A": 1}), "`$.env"),
    (dict(command=["true", __import__("pathlib").Path("/tmp")]), "PosixPath"),
]


async def test_a_mistyped_request_is_refused_not_accepted_and_unreadable(tmp_path, autojump_clock):
    """The embedding API takes `JobRequest`s built in Python, which msgspec does not check
    when they are made (only when it decodes one). A field of the wrong type was accepted,
    stored, and then broke every read of its record (`get`, `events`); in one run with
    10,000 of them queued the execution supervisor escalated and the runner stopped. Now it is `bad_request`, naming the field, before anything is recorded; the
    batch submit refuses just that item."""
    async with motor.open_runner(config(tmp_path)) as runner:
        for fields, named in MISTYPED:
            with pytest.raises(RefusedError) as info:
                await runner.submit(JobRequest(**fields))
            assert info.value.refusal.code == "bad_request", fields
            assert named in info.value.refusal.detail, (fields, info.value.refusal.detail)
        assert await runner.jobs(all=True) == []
        good, bad = await runner.submit_many([JobRequest(command=["true"], workspace="ok"),
                                              JobRequest(command=["true"], kind="background")])
        assert bad.code == "bad_request" and "`$.kind`" in bad.detail
        assert [r.job_id for r in await runner.jobs(all=True)] == [good.job_id]
        assert (await terminal_of(runner, good.job_id))["state"] == "succeeded"
        # not a JobRequest at all: refused too (it crashed the dispatcher until its
        # supervisor gave up); a dict of the fields is read as one, as motor.client reads it
        for wrong in (None, "true", ["true"]):
            with pytest.raises(RefusedError) as info:
                await runner.submit(wrong)
            assert info.value.refusal.code == "bad_request", wrong
        with pytest.raises(RefusedError, match="`\\$.command`"):
            await runner.submit({"command": "true"})
        as_dict = await runner.submit({"command": ["true"], "workspace": "fields"})
        assert (await terminal_of(runner, as_dict.job_id))["state"] == "succeeded"
        assert runner.root.ref("dispatcher").restarts_in_window() == 0
        health = await runner.health()
        assert "bad_request" not in health["admission_refusals"]

async def test_cancel_of_a_queued_job_is_idempotent(tmp_path, autojump_clock):
    barrier = tmp_path / "go"
    async with motor.open_runner(config(tmp_path, max_weight=1)) as runner:
        holder = await runner.submit(barrier_job(barrier, weight_hint=1, workspace="w"))
        behind = await runner.submit(JobRequest(command=["true"], weight_hint=1, workspace="w"))
        first = await runner.cancel(behind.job_id)
        second = await runner.cancel(behind.job_id)
        assert first.state == second.state == "cancelled"
        cancelled_running = await runner.cancel(holder.job_id)
        assert cancelled_running.state in ("setup", "running", "cancelled")
        record = await terminal_of(runner, holder.job_id)
        assert record["state"] == "cancelled"


async def test_jobs_ending_in_one_workspace_get_one_guard_walk_after_the_delay(
        tmp_path, autojump_clock, monkeypatch):
    """Issue 14, through the runner: the build-folder guard runs `GUARD_DELAY_S` after a
    job's end and walks a workspace once for every job that ended in it meanwhile; the jobs
    after the first start and end without waiting for it. (Before, each job's end walked
    its workspace at once.) The delay is 10^6 virtual seconds and maintenance (whose pass
    guards every pending workspace) is off: autojump moves the virtual clock on while the
    real jobs run."""
    from motor.disk import host

    monkeypatch.setattr(host, "GUARD_DELAY_S", 1e6, raising=False)  # (absent before)
    walked = []
    real_survey = host.survey

    def survey(entries, dev, wanted, now_ms, scans=None):
        walked.extend(sorted(wanted))
        return real_survey(entries, dev, wanted, now_ms, scans)

    monkeypatch.setattr(host, "survey", survey)
    async with motor.open_runner(config(tmp_path, maintenance_interval_s=1e8)) as runner:
        # the start-up pass's disk part comes right after the start (stop 61): done before
        # the jobs (a pass asked for now is handled after it), it has nothing to walk
        await runner.actor("maintenance").call(RunPass())
        for _ in range(3):
            job = await runner.submit(JobRequest(command=["true"], weight_hint=1, workspace="w"))
            assert (await terminal_of(runner, job.job_id))["state"] == "succeeded"
        assert "w" not in walked
        # a jump, not a sleep: autojump through 10^6 s stepped through each 2 s tick of the
        # disk actor's probe, half a million of them (60 s of the suite's time, stop 59)
        autojump_clock.jump(1e6)

        async def guarded():
            return "w" in walked

        await wait_until(guarded, "the guard's walk")
        await trio.sleep(60)
        assert walked.count("w") == 1, walked


async def test_a_submit_is_a_schedule_point_so_a_submitting_loop_lets_the_runner_work(
        tmp_path, autojump_clock):
    """Issue 14 (stop 28): the dispatcher answers most messages in the sender's task, but
    not a submit: `runner.submit` yields, so a program submitting in a loop lets the
    runner's other tasks (the job actors its submits started) run between its submits:
    a task started just before a submit has run by the time the submit returns."""
    async with motor.open_runner(config(tmp_path)) as runner:
        ran = []

        async def other():
            ran.append(True)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(other)
            first = await runner.submit(JobRequest(command=["true"], weight_hint=1,
                                                   workspace="a"))
            assert ran == [True]
        assert (await terminal_of(runner, first.job_id))["state"] == "succeeded"


async def test_each_job_gets_the_runners_environment_as_it_is_at_the_jobs_start(
        tmp_path, autojump_clock, monkeypatch):
    """The runner's environment is decoded once and again only when it changed (jobdir
    `runner_environ`): a variable set, changed or removed between jobs reaches the next job
    as it is then, and a request's `env` still overrides it."""
    async def seen(**request) -> str:
        job = await runner.submit(JobRequest(
            command=["sh", "-c", 'echo "[${MOTOR_TEST_VAR-unset}]"'], weight_hint=1, **request))
        events = [e async for e in runner.events(job.job_id)]
        return "".join(e.data for e in events if e.__struct_config__.tag == "output")

    monkeypatch.setenv("MOTOR_TEST_VAR", "one")
    async with motor.open_runner(config(tmp_path)) as runner:
        assert await seen() == "[one]\n"
        monkeypatch.setenv("MOTOR_TEST_VAR", "two")
        assert await seen() == "[two]\n"
        assert await seen(env={"MOTOR_TEST_VAR": "mine"}) == "[mine]\n"
        monkeypatch.delenv("MOTOR_TEST_VAR")
        assert await seen() == "[unset]\n"
