"""The runner stops while a job actor is between its spawn and its `running` record, and
the dispatcher's timer fires as it stops. The dispatcher stops before the job actors (it
starts them), so the job actor finds it stopped: it ends quietly (no crash logged, no
restart of it during the stop), and the next start adopts the job, which ran, with its
exit status; the timer's follow-up is dropped. Before: "actor job-... crashed:
ActorDead('dispatcher')" for each such job, and "actor dispatcher crashed" when its timer
fired (stop 41's doubt)."""

from __future__ import annotations

import logging

import trio
import trio.testing

import motor
from motor import faults
from motor.execution import actor as job_actor
from motor.scheduling import actor as dispatcher_actor
from runner_helpers import embedded_config, terminal_of


async def test_a_job_actor_that_finds_the_dispatcher_stopped_ends_quietly_and_is_adopted(
        tmp_path, monkeypatch, caplog):
    gate = tmp_path / "spawned"
    monkeypatch.setenv(faults.ENV, f"setup.spawned=wait:{gate}")
    # the barrier: the job actor waits after its spawn; the dispatcher, stopping, lets it
    # go on and waits until it is done (so it meets the stopped dispatcher, not a cancel)
    ended = trio.Event()
    real_main = job_actor.JobExecution.main

    async def main(self):
        try:
            await real_main(self)
        finally:
            ended.set()

    monkeypatch.setattr(job_actor.JobExecution, "main", main)
    dispatcher = dispatcher_actor.Dispatcher
    real_on_stop = dispatcher.on_stop

    async def on_stop(self):
        # the dispatcher's own timer fires while it stops (its inbox closed): its follow-up
        # is dropped (`cast_self`), not a crash of the dispatcher
        self._wakeup = trio.current_time()
        if self._timer is not None:
            self._timer.deadline = self._wakeup
        gate.touch()
        with trio.fail_after(30):
            await ended.wait()
        await trio.testing.wait_all_tasks_blocked()  # (the timer has fired)
        await real_on_stop(self)

    monkeypatch.setattr(dispatcher, "on_stop", on_stop)
    config = embedded_config(tmp_path)
    caplog.set_level(logging.INFO)
    async with motor.open_runner(config) as runner:
        job_id = (await runner.submit(motor.JobRequest(command=["sh", "-c", "exit 3"]))).job_id
        with trio.fail_after(30):
            while not (tmp_path / "spawned.reached").exists():
                await trio.sleep(0.01)
    assert ended.is_set()
    crashes = [r.getMessage() for r in caplog.records if "crashed" in r.getMessage()]
    assert crashes == [], crashes
    assert any("as the runner stops; its next start adopts the job" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]

    monkeypatch.delenv(faults.ENV)
    monkeypatch.setattr(dispatcher, "on_stop", real_on_stop)
    async with motor.open_runner(config) as runner:
        with trio.fail_after(60):
            record = await terminal_of(runner, job_id)
    assert record["state"] == "failed" and record["exit_code"] == 3, record
