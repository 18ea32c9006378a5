"""The runner's store checkpoints its WAL in a worker thread (issue 14, stop 26): through
the embedded runner with real jobs, its health report and /metrics show the rounds, and a
round that fails makes health degraded until one succeeds again.

Real processes, a real SQLite database, trio's real clock. The embedded test runner's wall
clock (`MockWallClock`) runs the checkpoints inline, as it runs every offload (motor/clock.py:
a thread would let virtual time jump); tests/store/test_checkpoints.py runs them in threads.
"""

from __future__ import annotations

import trio

import motor
from motor.records import JobRequest
from motor.store import checkpoints
from runner_helpers import embedded_config, terminal_of


async def _run_jobs(runner, n: int) -> None:
    for _ in range(n):
        job = await runner.submit(JobRequest(command=["true"], workspace="w", weight_hint=1))
        assert (await terminal_of(runner, job.job_id))["state"] == "succeeded"


async def _until(predicate, timeout: float = 60) -> None:
    with trio.fail_after(timeout):
        while not await predicate():
            await trio.sleep(0.02)


async def test_the_runner_checkpoints_off_its_commits_and_reports_it(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoints, "CHECKPOINT_EVERY", 8)
    monkeypatch.setattr(checkpoints, "WAL_RESTART_BYTES", 0)  # every round in two steps
    async with motor.open_runner(embedded_config(tmp_path, max_weight=2)) as runner:
        db = runner.db
        assert db.conn.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 0
        real_path = db.path
        db.path = tmp_path / "no-such-dir" / "motor.db"  # the first round cannot open its connection
        await _run_jobs(runner, 4)

        async def degraded():
            health = await runner.health()
            return any("WAL checkpoint" in d["cause"] for d in health["degraded"])

        await _until(degraded)
        health = await runner.health()
        assert health["status"] == "degraded" and health["store"]["checkpoints"] == 0
        [cause] = [d for d in health["degraded"] if d["subsystem"] == "store"]
        assert "unable to open database file" in cause["cause"]
        assert "the WAL grows until a checkpoint succeeds" in cause["cause"]
        metrics = (await runner.metrics_text()).decode()
        assert 'motor_degraded_subsystem{subsystem="store"} 1.0' in metrics

        db.path = real_path  # the next round (after as many commits) succeeds
        await _run_jobs(runner, 4)

        async def checkpointed():
            return (await runner.health())["store"]["checkpoints"] >= 1

        await _until(checkpointed)
        health = await runner.health()
        assert health["status"] == "ok", health["degraded"]
        store = health["store"]
        # two commits per `true` job on an idle runner: its accept with its start (`setup`),
        # and its `running` record with its end
        assert store["commits"] >= 16 and store["last_checkpoint"]["complete"] is True
        assert store["last_checkpoint"]["ms"] > 0 and store["last_checkpoint"]["writes_paused_ms"] > 0
        metrics = (await runner.metrics_text()).decode()
        assert f"motor_store_checkpoints_total {float(store['checkpoints'])}" in metrics
        assert "motor_store_last_checkpoint_writes_paused_seconds " in metrics
