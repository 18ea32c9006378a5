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


async def test_a_cancel_told_while_the_jobs_actor_restarts_after_a_crash_is_not_lost(
        tmp_path, monkeypatch):
    """A running job's actor crashes; before its supervisor restarts it, a cancel comes.
    Before stop 52 the cancel found no live actor, was answered "signalled" and dropped:
    the restarted actor adopted the job and followed it to its natural end. Now the
    runner keeps the cancel (`JobDeps.cancels`), and the new incarnation signals the job
    once it has adopted it."""
    from actors import Supervisor
    from motor.execution.actor import JobExecution

    gate, crashed = trio.Event(), []
    follow, handle_exit = JobExecution._follow, Supervisor._handle_exit

    async def follow_or_crash(self, first):
        if not crashed:
            crashed.append(self.record.job_id)
            raise RuntimeError("injected: a job actor's crash while its job runs")
        return await follow(self, first)

    async def restart_at_the_gate(self, child, instance, exc):
        if exc is not None and child.spec.name.startswith("job-"):
            await gate.wait()
        return await handle_exit(self, child, instance, exc)

    monkeypatch.setattr(JobExecution, "_follow", follow_or_crash)
    monkeypatch.setattr(Supervisor, "_handle_exit", restart_at_the_gate)
    go = tmp_path / "go"
    async with motor.open_runner(embedded_config(tmp_path, max_weight=2)) as runner:
        job = await runner.submit(JobRequest(
            command=["sh", "-c", f"while [ ! -e {go} ]; do sleep 0.02; done"],
            weight_hint=1, workspace="w"))
        with trio.fail_after(30):  # crashed, not yet restarted
            while not crashed or runner.handles.execution.job(job.job_id).alive:
                await trio.sleep(0.01)
        assert not (await runner.cancel(job.job_id)).terminal  # its end comes later
        gate.set()
        with trio.move_on_after(15):
            record = await terminal_of(runner, job.job_id)
        go.write_text("")  # (a lost cancel: the job ends here, succeeded)
        record = await terminal_of(runner, job.job_id)
        assert (record["state"], record["reason"]) == ("cancelled", "cancelled"), record
