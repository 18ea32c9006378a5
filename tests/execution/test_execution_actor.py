"""The job execution actor on its own, under MockClock: the outside world is the in-process
fakes of tests/fakes.py (keepers, offload) and recording stand-ins for the other actors;
every step is synchronised with `wait_all_tasks_blocked`, never with real processes or
polling. The same paths with real keepers are covered through the runner
(tests/runner, tests/e2e)."""

from __future__ import annotations

import trio
import trio.testing

from fakes import FakeKeepers, Recorder, inline_offload
from motor.clock import MockWallClock, uuid7
from motor.execution.actor import Cancel, JobDeps, JobExecution
from motor.handles import (
    AccountingHandle, CpuHandle, DispatcherHandle, Records, StoreHandle,
)
from motor.execution.spawner import KeeperNotStarted, SpawnerError
from motor.isolation import NONE
from motor.records import JobRecord
from motor.store.actor import ChangeHub, StoreActor
from motor.store.db import Database


class World:
    """One job in state `setup` (as the dispatcher saves it) and its actor's neighbours."""

    def __init__(self, tmp_path, nursery, offload=inline_offload):
        self.clock = MockWallClock()
        self.db = Database(tmp_path / "motor.db")
        now = self.clock.now_ms()
        self.record = JobRecord(job_id=uuid7(now), state="setup", workspace="ws", claim=1,
                                cpus=[0], command=["make"], accepted_at_ms=now)
        self.db.save(self.record)
        self.nursery, self.tmp_path, self.offload = nursery, tmp_path, offload
        self.keepers = FakeKeepers()
        self.cpu, self.dispatcher, self.accounting = (
            Recorder("cpu"), Recorder("dispatcher"), Recorder("accounting"))

    async def start(self) -> tuple[JobExecution, object]:
        n = self.nursery
        deps = JobDeps(
            config=None, records=Records(self.db),
            store=StoreHandle(await n.start(StoreActor(self.db, ChangeHub()).run)),
            dispatcher=DispatcherHandle(await n.start(self.dispatcher.run)),
            cpu=CpuHandle(await n.start(self.cpu.run)),
            accounting=AccountingHandle(await n.start(self.accounting.run)),
            spawner=self.keepers, backend=NONE,
            clock=self.clock, jobs_dir=self.tmp_path / "jobs",
            workspace_root=self.tmp_path / "ws", offload=self.offload)
        job = JobExecution(self.record, deps)
        ref = await n.start(job.run)
        await trio.testing.wait_all_tasks_blocked()
        return job, ref

    def state(self) -> JobRecord:
        return self.db.get(self.record.job_id)


def tags(world: World) -> list[str]:
    from motor.records import decode_event

    return [decode_event(raw).__struct_config__.tag
            for raw in world.db.events_from(world.record.job_id, 0)]


async def test_a_started_job_runs_until_its_keeper_exits(tmp_path, autojump_clock):
    async with trio.open_nursery() as nursery:
        world = World(tmp_path, nursery)
        job, ref = await world.start()
        [job_dir] = world.keepers.spawned
        assert (job_dir / "spec.json").exists() and job.keeper is not None
        assert world.state().state == "running" and tags(world) == ["started"]
        assert world.dispatcher.kinds() == ["SetupDone"] and world.cpu.seen == []
        assert ref.alive  # it follows the keeper until the keeper exits

        world.keepers.exit(job.keeper[0], exit_code=0)
        await trio.testing.wait_all_tasks_blocked()
        assert world.state().state == "succeeded" and tags(world) == ["started", "terminal"]
        assert world.cpu.kinds() == ["Release"]
        assert world.dispatcher.kinds() == ["SetupDone", "Finished"]
        assert "JobEnded" in world.accounting.kinds() and not ref.alive
        nursery.cancel_scope.cancel()


async def test_a_failed_start_goes_back_to_the_dispatcher_with_its_cpus_released(
        tmp_path, autojump_clock):
    async with trio.open_nursery() as nursery:
        world = World(tmp_path, nursery)
        world.keepers.fail = SpawnerError("forkserver exited")
        _, ref = await world.start()
        [failed] = world.dispatcher.seen
        assert type(failed).__name__ == "StartFailed" and "forkserver exited" in failed.detail
        assert world.cpu.kinds() == ["Release"]
        assert world.state().state == "setup" and tags(world) == []  # requeued, never started
        assert not ref.alive
        nursery.cancel_scope.cancel()


async def test_a_keeper_that_cannot_start_ends_the_job_spawn_failed(tmp_path, autojump_clock):
    async with trio.open_nursery() as nursery:
        world = World(tmp_path, nursery)
        world.keepers.fail = KeeperNotStarted("exec failed: no such file")
        await world.start()
        record = world.state()
        assert (record.state, record.reason) == ("failed", "spawn_failed")
        assert tags(world) == ["terminal"] and world.dispatcher.kinds() == ["Finished"]
        nursery.cancel_scope.cancel()


async def test_a_cancel_during_setup_ends_the_job_before_any_keeper(tmp_path, autojump_clock):
    prepared = trio.Event()
    release = trio.Event()

    async def gated_offload(fn, *args):  # the backend's prepare holds until the test says
        if fn == NONE.prepare:
            prepared.set()
            await release.wait()
        return fn(*args)

    async with trio.open_nursery() as nursery:
        world = World(tmp_path, nursery, offload=gated_offload)
        _, ref = await world.start()
        assert prepared.is_set() and world.state().state == "setup"
        assert await ref.call(Cancel()) is True  # no keeper yet: it will never start
        release.set()
        await trio.testing.wait_all_tasks_blocked()
        record = world.state()
        assert (record.state, record.reason, record.detail) == (
            "cancelled", "cancelled", "cancelled during setup")
        assert world.keepers.spawned == [] and tags(world) == ["terminal"]
        assert world.cpu.kinds() == ["Release"] and world.dispatcher.kinds() == ["Finished"]
        assert not ref.alive
        nursery.cancel_scope.cancel()


async def test_a_cancel_while_the_keeper_is_spawned_cancels_the_keeper(tmp_path, autojump_clock):
    async with trio.open_nursery() as nursery:
        world = World(tmp_path, nursery)
        world.keepers.gate = trio.Event()
        job, ref = await world.start()
        assert len(world.keepers.spawned) == 1 and job.keeper is None  # spawn in flight
        assert await ref.call(Cancel()) is True
        world.keepers.gate.set()
        await trio.testing.wait_all_tasks_blocked()
        assert world.keepers.cancelled == [job.keeper[0]]
        record = world.state()
        assert (record.state, record.reason) == ("cancelled", "cancelled")
        assert tags(world) == ["started", "terminal"] and not ref.alive
        nursery.cancel_scope.cancel()


async def test_a_keeper_that_times_out_ends_the_job_timed_out(tmp_path, autojump_clock):
    async with trio.open_nursery() as nursery:
        world = World(tmp_path, nursery)
        world.record.timeout_s = 60.0
        job, ref = await world.start()
        await trio.sleep(61)  # virtual: the keeper owns the timeout and reports it
        world.keepers.exit(job.keeper[0], exit_code=None, signal=9, reason="timed_out",
                           detail="timed out after 60 s")
        await trio.testing.wait_all_tasks_blocked()
        record = world.state()
        assert (record.state, record.reason, record.signal) == ("timed_out", "timed_out", 9)
        assert record.detail == "timed out after 60 s" and not ref.alive
        nursery.cancel_scope.cancel()
