"""reservation_use from the OS's own figures: real jobs on the real clock, and the job
actor's terminal path fed a long job's status.json."""

from __future__ import annotations

import os
import sys

import msgspec
import trio
from runner_helpers import terminal_of

import motor
from motor.accounting.actor import AccountingActor, Report
from motor.clock import MockWallClock, uuid7
from motor.execution import joblog
from motor.execution.actor import JobDeps, JobExecution
from motor.handles import AccountingHandle, CpuHandle, DispatcherHandle, Records, StoreHandle
from motor.isolation import NONE
from motor.records import JobRecord, JobRequest
from motor.store.db import Database

BUSY = "import time\nend = time.process_time() + 1.5\nwhile time.process_time() < end: pass\n"


async def test_busy_job_uses_its_cpu_and_sleeping_job_does_not(tmp_path):
    config = motor.RunnerConfig(state_dir=str(tmp_path / "state"), isolation="none",
                                free_space_floor_bytes=0)
    async with motor.open_runner(config) as runner:
        with trio.fail_after(300):  # real seconds; generous for a loaded host
            busy = await runner.submit(JobRequest(command=[sys.executable, "-c", BUSY],
                                                  weight_hint=1, workspace="busy"))
            busy_rec = await terminal_of(runner, busy.job_id)
            idle = await runner.submit(JobRequest(command=["sleep", "1.5"], weight_hint=1,
                                                  workspace="idle"))
            idle_rec = await terminal_of(runner, idle.job_id)
    assert busy_rec["state"] == "succeeded" and idle_rec["state"] == "succeeded"
    use = busy_rec["reservation_use"]
    assert use["cpu_time_ms"] >= 1400 and use["wall_time_ms"] >= 1400  # rusage of the tree
    assert use["average_use_ppm"] == round(use["cpu_time_ms"] / use["wall_time_ms"] * 1e6)
    # On an oversubscribed host (load above its CPU count) the busy loop gets only a share
    # of a CPU, so its wall time stretches: the ~100% figure only holds when CPU is there.
    if os.getloadavg()[0] < (os.cpu_count() or 1):
        assert use["average_use_ppm"] > 700_000, use
    assert idle_rec["reservation_use"]["average_use_ppm"] < 100_000, idle_rec["reservation_use"]
    assert idle_rec["reservation_use"]["wall_time_ms"] >= 1400


class _Ref:
    """Stands in for an actor ref: records calls and casts."""

    def __init__(self, on_call=None):
        self.calls = []
        self.on_call = on_call

    async def call(self, msg, timeout=None):
        self.calls.append(msg)
        return self.on_call(msg) if self.on_call else None

    async def cast(self, msg):
        self.calls.append(msg)

    def cast_nowait(self, msg):
        self.calls.append(msg)


async def test_long_eight_vcpu_job_under_one_core_is_persisted_and_reported(tmp_path):
    """An eight-vCPU claim on a two-CPU list (--linux-cpus 0-1 --max-weight 8) that keeps one
    core busy: the terminal record's reservation_use comes from the backend's own figures
    (the cgroup's CPU time where the host has cgroups, else the keeper's rusage of the job
    tree), is persisted, survives a restart, and the accounting report counts it. (The
    underused list needs over ten minutes of wall time; the core test below feeds that path.)"""
    base = dict(state_dir=str(tmp_path / "state"), free_space_floor_bytes=0,
                linux_cpus="0-1", max_weight=8)
    isolation = os.environ.get("MOTOR_TEST_ISOLATION", "none")
    config = motor.RunnerConfig(isolation=isolation, **base)
    async with motor.open_runner(config) as runner:
        with trio.fail_after(300):  # real seconds; generous for a loaded host
            job = await runner.submit(JobRequest(
                command=[sys.executable, "-c", BUSY], weight_hint=8, workspace="big",
                repository="/src/app/.git/worktrees/feature"))
            record = await terminal_of(runner, job.job_id)
        assert record["state"] == "succeeded" and record["claim"] == 8, (record["reason"], record["detail"])
        assert 1 <= len(record["cpus"]) <= 2
        use = record["reservation_use"]
        assert use["cpu_time_ms"] >= 1400  # the busy loop's 1.5 s of CPU, measured
        assert use["cpu_time_ms"] <= use["wall_time_ms"] + 100  # one thread: under one core
        assert use["average_use_ppm"] == round(use["cpu_time_ms"] / (use["wall_time_ms"] * 8) * 1e6)
        assert use["average_use_ppm"] <= 1_000_000 // 8 + 20_000
        report = await runner.health()
        app = report["repositories"]["app"]
        assert app["reserved_vcpu_seconds"] == round(8 * use["wall_time_ms"] / 1000, 3)
        assert report["underused"] == []  # under ten minutes of wall time
    async with motor.open_runner(config) as runner:  # persisted: the same figures after a restart
        again = await runner.get(job.job_id)
        assert msgspec.to_builtins(again.reservation_use) == use
        assert (await runner.health())["repositories"]["app"]["reserved_vcpu_seconds"] == \
            app["reserved_vcpu_seconds"]


async def test_long_job_status_figures_feed_the_underused_index_core(tmp_path, autojump_clock):
    clock = MockWallClock()
    db = Database(tmp_path / "motor.db")
    now = clock.now_ms()
    record = JobRecord(job_id=uuid7(now), state="running", workspace="big", claim=8,
                       cpus=list(range(8)), repository="/src/app/.git/worktrees/feature",
                       accepted_at_ms=now, started_at_ms=now)
    db.save(record)
    wall = 12 * 60 * 1000  # twelve minutes at 60% of one core: 7.5% of eight
    job_dir = tmp_path / "jobs" / record.job_id
    job_dir.mkdir(parents=True)
    joblog.write_json_atomic(job_dir / "status.json", {  # what the keeper writes
        "exit_code": 0, "signal": None, "reason": None, "detail": None, "started_at_ms": now,
        "ended_at_ms": now + wall, "wall_time_ms": wall, "cpu_time_ms": int(wall * 0.6)})
    async with trio.open_nursery() as nursery:
        accounting = await nursery.start(AccountingActor(db, clock).run)
        store = _Ref(lambda msg: db.save(msg.record, msg.events,
                                         retain_until_ms=msg.retain_until_ms))
        deps = JobDeps(config=None, records=Records(db), store=StoreHandle(store),
                       dispatcher=DispatcherHandle(_Ref()), cpu=CpuHandle(_Ref()),
                       accounting=AccountingHandle(accounting), spawner=None, backend=NONE,
                       clock=clock,
                       jobs_dir=tmp_path / "jobs", workspace_root=tmp_path / "ws")
        with trio.fail_after(5):
            await JobExecution(record, deps)._finish()
        saved = db.get(record.job_id)
        assert saved.state == "succeeded" and saved.exit_code == 0
        assert saved.reservation_use is not None
        assert (saved.reservation_use.cpu_time_ms, saved.reservation_use.wall_time_ms,
                saved.reservation_use.average_use_ppm) == (int(wall * 0.6), wall, 75_000)
        report = await accounting.call(Report())
        [row] = report["underused"]
        assert row["job_id"] == record.job_id and row["claim"] == 8
        assert row["average_use_ppm"] == 75_000 and row["repository"] == "app"
        assert report["repositories"]["app"]["reserved_vcpu_seconds"] == 8 * wall / 1000
        # after a restart the index is rebuilt from the retained record
        again = await nursery.start(AccountingActor(db, clock).run)
        assert [u["job_id"] for u in (await again.call(Report()))["underused"]] == [record.job_id]
        nursery.cancel_scope.cancel()
    db.close()
