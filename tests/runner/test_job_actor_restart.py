"""A job actor that crashes after its job's end was recorded, through the embedded runner
(issue 14, stop 29): the execution supervisor restarts it from the stored record, which is
terminal, and the new incarnation ends at once. Before, it tried to mark the job running
again (a transition out of a terminal state), crashed, and was restarted until the
supervisor gave up. Real processes, a real store, trio's real clock."""

from __future__ import annotations

import trio

import motor
from motor.handles import AccountingHandle
from motor.records import JobRequest
from runner_helpers import embedded_config, terminal_of


async def test_a_job_actor_crashing_after_its_end_is_recorded_is_restarted_and_just_ends(
        tmp_path, monkeypatch):
    ended = AccountingHandle.ended
    crashed = []

    def ended_then_crash(self, record):  # the step right after the terminal save
        if not crashed:
            crashed.append(record.job_id)
            raise RuntimeError("injected: a job actor's crash after its terminal record")
        return ended(self, record)

    monkeypatch.setattr(AccountingHandle, "ended", ended_then_crash)
    async with motor.open_runner(embedded_config(tmp_path, max_weight=2)) as runner:
        job = await runner.submit(JobRequest(command=["true"], weight_hint=1, workspace="w"))
        assert (await terminal_of(runner, job.job_id))["state"] == "succeeded"
        with trio.fail_after(30):
            while job.job_id in runner.handles.execution.jobs():
                await trio.sleep(0.02)
        assert crashed == [job.job_id]
        tags = [e.__struct_config__.tag async for e in runner.events(job.job_id)]
        assert tags.count("terminal") == 1 and tags.count("started") == 1, tags
        again = await runner.submit(JobRequest(command=["true"], weight_hint=1, workspace="w"))
        assert (await terminal_of(runner, again.job_id))["state"] == "succeeded"
        # health names the one crash (restarts in the last 10 s), not a restart loop
        [execution] = [d for d in (await runner.health())["degraded"]
                       if d["subsystem"] == "execution"]
        assert execution["restarts"] == 1 and "injected" in execution["cause"], execution
