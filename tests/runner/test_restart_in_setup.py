"""A job recorded in `setup` when the runner stopped (its keeper never spawned): after a
restart it is adopted, its setup is redone, and a failing setup requeues it like any
failed start. Before, the dispatcher crashed on it (`job ... is not setting_up`), was
restarted, adopted it again and crashed again until its supervisor gave up.
"""

from __future__ import annotations

from pathlib import Path

import motor
from motor.clock import uuid7
from motor.records import Accepted, JobRecord, Queued
from motor.store.db import Database
from tests.conftest import read_only_tmpfs
from runner_helpers import embedded_config, in_state, poll_until, terminal_of


async def test_a_job_left_in_setup_whose_setup_fails_after_a_restart_is_requeued_then_runs(
        tmp_path, autojump_clock):
    config = embedded_config(tmp_path)
    state = Path(config.state_dir)
    state.mkdir(parents=True)
    now_ms = config.clock.now_ms()
    job_id = uuid7(now_ms)
    db = Database(state / "motor.db")  # what the stopped runner left behind
    db.save(JobRecord(job_id=job_id, state="setup", workspace="w", command=["sh", "-c", "echo ran"],
                      claim=1, cpus=[0], accepted_at_ms=now_ms, queued_at_ms=now_ms, attempts=1),
            [Accepted(job_id=job_id, claim=1), Queued(queue_wait_budget_ms=600_000)])
    db.close()
    # the workspace cannot be made, for now: its root is read-only (a file in its place
    # would refuse the job since stop 49: that does not pass)
    with read_only_tmpfs(state / "workspaces") as writable:
        async with motor.open_runner(config) as runner:
            await poll_until(lambda: in_state(runner, job_id, "queued"), 60, interval=0.05)
            writable()
            record = await terminal_of(runner, job_id)
            assert record["state"] == "succeeded" and record["attempts"] == 2
            assert runner.root.ref("dispatcher").restarts_in_window() == 0
