"""The job execution actor on its own, under MockClock: the outside world is the in-process
fakes of tests/fakes.py (keepers, offload) and recording stand-ins for the other actors;
every step is synchronised with `wait_all_tasks_blocked`, never with real processes or
polling. The same paths with real keepers are covered through the runner
(tests/runner, tests/e2e)."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest
import trio
import trio.testing

import actors
from fakes import FakeKeepers, Recorder, inline_offload
from motor.clock import MockWallClock, uuid7
from motor.config import OUTPUT_POLL_S, RunnerConfig
from motor.disk.messages import PrepareSetup, SetupPlan
from motor.execution import jobdir
from motor.execution.actor import Cancel, JobDeps, JobExecution
from motor.execution.messages import STORE_FULL_RETRY_S
from motor.handles import (
    AccountingHandle, CpuHandle, DiskHandle, DispatcherHandle, Records, StoreHandle,
)
from motor.execution.spawner import JobDirClaimed, KeeperNotStarted, SpawnerError
from motor.isolation import NONE
from motor.isolation.base import Backend
from motor.records import JobRecord, Refusal, Terminal
from motor.store.actor import StoreActor
from motor.store.hub import ChangeHub
from motor.store.db import Database, StoreFull


@dataclasses.dataclass(frozen=True)
class Grouped(Backend):
    """A backend with groups to make and remove (as cgroup and systemd have): its steps are
    not known to be light, so the actor offloads them."""

    def prepare(self, job_id, cpus, memory_max):
        return super().prepare(job_id, cpus, memory_max)

    def settle(self, job_id, signal=None):
        return {"oom_killed": False, "cpu_time_ms": 1}

    def release(self, job_id):
        return None


GROUPED = Grouped(name="grouped", enforces=())


class World:
    """One job in state `setup` (as the dispatcher saves it) and its actor's neighbours."""

    def __init__(self, tmp_path, nursery, offload=inline_offload, disk=None, db=Database,
                 backend=NONE, config=None):
        self.clock = MockWallClock()
        self.db = db(tmp_path / "motor.db")
        now = self.clock.now_ms()
        self.record = JobRecord(job_id=uuid7(now), state="setup", workspace="ws", claim=1,
                                cpus=[0], command=["make"], accepted_at_ms=now)
        self.db.save(self.record)
        self.nursery, self.tmp_path, self.offload = nursery, tmp_path, offload
        self.backend = backend
        self.keepers = FakeKeepers()
        self.cpu, self.dispatcher, self.accounting = (
            Recorder("cpu"), Recorder("dispatcher"), Recorder("accounting"))
        self.disk = disk  # an actor answering PrepareSetup, or None: no disk manager
        self.config = config  # the runner's, or None: the defaults
        self.job_dir = tmp_path / "jobs" / self.record.job_id

    async def start(self) -> tuple[JobExecution, object]:
        n = self.nursery
        deps = JobDeps(
            config=self.config, records=Records(self.db),
            store=StoreHandle(await n.start(StoreActor(self.db, ChangeHub()).run)),
            dispatcher=DispatcherHandle(await n.start(self.dispatcher.run)),
            cpu=CpuHandle(await n.start(self.cpu.run)),
            accounting=AccountingHandle(await n.start(self.accounting.run)),
            spawner=self.keepers, backend=self.backend,
            clock=self.clock, jobs_dir=self.tmp_path / "jobs",
            workspace_root=self.tmp_path / "ws", offload=self.offload,
            disk=None if self.disk is None else DiskHandle(await n.start(self.disk.run)))
        job = JobExecution(self.record, deps)
        ref = await n.start(job.run)
        await trio.testing.wait_all_tasks_blocked()
        return job, ref

    def state(self) -> JobRecord:
        return self.db.get(self.record.job_id)


def recording_offload(calls: list[str]):
    """An offloader that runs each call inline and records its function's name in `calls`."""
    async def offload(fn, *args):
        calls.append(getattr(fn, "__name__", repr(fn)))
        return fn(*args)

    return offload


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
        assert world.dispatcher.kinds() == ["SetupDone"] and world.cpu.seen == []
        # issue 14: the start is saved with the job's next write, or once it has run for
        # an output poll (OUTPUT_POLL_S) without output (a job that ends sooner saves it
        # with its end: below)
        assert world.state().state == "setup" and tags(world) == []
        await trio.sleep(OUTPUT_POLL_S)
        await trio.testing.wait_all_tasks_blocked()
        assert world.state().state == "running" and tags(world) == ["started"]
        assert ref.alive  # it follows the keeper until the keeper exits

        world.keepers.exit(job.keeper[0], exit_code=0)
        await trio.testing.wait_all_tasks_blocked()
        assert world.state().state == "succeeded" and tags(world) == ["started", "terminal"]
        assert world.cpu.kinds() == ["Release"]
        assert world.dispatcher.kinds() == ["SetupDone", "Finished"]
        assert "JobEnded" in world.accounting.kinds() and not ref.alive
        nursery.cancel_scope.cancel()


async def test_the_output_poll_is_the_runners_setting(tmp_path, autojump_clock):
    """`output_poll_s` sets how long a running job's actor waits between reads of its
    output: its quiet start is saved alone only after that long, and output written
    meanwhile is read at the poll, not before."""
    from motor.execution import joblog

    async with trio.open_nursery() as nursery:
        world = World(tmp_path, nursery, config=RunnerConfig(output_poll_s=5.0))
        job, _ref = await world.start()
        await trio.sleep(4.9)
        await trio.testing.wait_all_tasks_blocked()
        assert world.state().state == "setup" and tags(world) == []
        with open(world.job_dir / joblog.OUTPUT_FILE, "ab") as f:
            f.write(joblog.encode_record(joblog.STDOUT, b"hello\n"))
        await trio.sleep(0.05)
        await trio.testing.wait_all_tasks_blocked()
        assert tags(world) == []  # not read before the poll
        await trio.sleep(0.1)
        await trio.testing.wait_all_tasks_blocked()
        assert world.state().state == "running" and tags(world) == ["started", "output"]
        world.keepers.exit(job.keeper[0], exit_code=0)
        await trio.testing.wait_all_tasks_blocked()
        assert tags(world) == ["started", "output", "terminal"]
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("output", ["none", "while_running", "at_the_end"])
async def test_a_job_start_is_saved_with_its_next_write(tmp_path, autojump_clock, output):
    """Issue 14 (a commit less per job): the `running` record and its Started event are not
    a transaction of their own; they go with the job's first output batch, or with its end
    when it ends first, in that write, the Started event first. The last output batch,
    read after the job's exit, goes with the terminal record, its log offset too."""
    from motor.execution import joblog

    def write_output():
        with open(world.job_dir / joblog.OUTPUT_FILE, "ab") as f:
            f.write(joblog.encode_record(joblog.STDOUT, b"hello\n"))

    async with trio.open_nursery() as nursery:
        world = World(tmp_path, nursery)
        job, ref = await world.start()
        assert world.state().state == "setup" and world.dispatcher.kinds() == ["SetupDone"]
        commits = world.db.commits
        if output == "while_running":
            write_output()
            await trio.sleep(OUTPUT_POLL_S)  # read at the first poll: the start goes with it
            await trio.testing.wait_all_tasks_blocked()
            assert world.db.commits == commits + 1
            assert world.state().state == "running" and tags(world) == ["started", "output"]
        elif output == "at_the_end":
            write_output()
        world.keepers.exit(job.keeper[0], exit_code=0)
        await trio.testing.wait_all_tasks_blocked()
        assert world.db.commits == commits + 1 + (output == "while_running")
        assert tags(world) == ["started", *([] if output == "none" else ["output"]), "terminal"]
        size = (world.job_dir / joblog.OUTPUT_FILE).stat().st_size if output != "none" else 0
        assert world.db.log_offset(world.record.job_id) == size
        rows = world.db.conn.execute("SELECT seq FROM events WHERE job_id=? ORDER BY seq",
                                     (world.record.job_id,)).fetchall()
        assert [seq for (seq,) in rows] == list(range(1, len(rows) + 1))
        assert world.state().state == "succeeded" and not ref.alive
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("reports_ends", [True, False])
async def test_output_is_tailed_until_the_keepers_end_however_the_end_is_waited_for(
        tmp_path, autojump_clock, reports_ends):
    """Issue 14 (a task step less per job): a keeper that reports the job's end unasked
    (keeperd, `exit_event`) is waited for by the job actor's own task between output
    batches, `wait_exit` called only once that has come; a keeper without it (a per-job
    keeper's process) is waited for in `wait_exit` by a task of its own. Either way the
    output written while the job runs arrives batch by batch, and the end after the last
    of it."""
    from motor.execution import joblog

    waits = []
    async with trio.open_nursery() as nursery:
        world = World(tmp_path, nursery)
        world.keepers.reports_ends = reports_ends
        real_wait = world.keepers.wait_exit

        async def wait_exit(pid, create_time, job_dir=None):
            waits.append(world.keepers._exits[pid].is_set())
            await real_wait(pid, create_time, job_dir)

        world.keepers.wait_exit = wait_exit
        job, ref = await world.start()
        assert waits == ([] if reports_ends else [False])
        for text in (b"one\n", b"two\n"):
            with open(world.job_dir / joblog.OUTPUT_FILE, "ab") as f:
                f.write(joblog.encode_record(joblog.STDOUT, text))
            autojump_clock.jump(1.0)
            await trio.testing.wait_all_tasks_blocked()
        assert tags(world) == ["started", "output", "output"] and ref.alive
        with open(world.job_dir / joblog.OUTPUT_FILE, "ab") as f:
            f.write(joblog.encode_record(joblog.STDOUT, b"last\n"))
        world.keepers.exit(job.keeper[0], exit_code=0)
        await trio.testing.wait_all_tasks_blocked()
        assert tags(world) == ["started", "output", "output", "output", "terminal"]
        assert world.state().state == "succeeded" and not ref.alive
        assert waits == ([True] if reports_ends else [False])
        nursery.cancel_scope.cancel()


async def test_a_cancel_sent_before_a_job_actor_started_soon_ran_ends_it_before_any_keeper(
        tmp_path, autojump_clock):
    """Issue 14: the dispatcher's start of a job actor does not wait for the actor's task
    (`Supervisor.start_child_soon`), so its Cancel can come first: it waits in the
    actor's inbox and is answered before the job's life begins, which then ends the job
    cancelled in setup, with no keeper spawned."""
    from motor.handles import ExecutionHandle

    async with trio.open_nursery() as nursery:
        world = World(tmp_path, nursery)
        job, _ = await world.start()  # (the deps; this first actor runs as usual)
        world.keepers.exit(job.keeper[0], exit_code=0)
        await trio.testing.wait_all_tasks_blocked()
        spawned = list(world.keepers.spawned)
        record = msgspec.structs.replace(world.record, job_id=uuid7(world.clock.now_ms()))
        world.db.save(record)
        async with actors.open_supervisor("execution", []) as sup:
            execution = ExecutionHandle(lambda: sup)
            await execution.start_job(record.job_id, lambda: JobExecution(record, job.deps))
            assert sup.children() == [f"job-{record.job_id}"]
            await execution.call_job(record.job_id, Cancel())
            await trio.testing.wait_all_tasks_blocked()
            assert world.db.get(record.job_id).state == "cancelled"
            assert world.keepers.spawned == spawned and sup.children() == []
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

    async def gated_offload(fn, *args):  # the setup step (workspace, backend's groups,
        if fn is jobdir.set_up:  # spec.json: one offloaded call) holds until the test says
            prepared.set()
            await release.wait()
        return fn(*args)

    async with trio.open_nursery() as nursery:
        world = World(tmp_path, nursery, offload=gated_offload, backend=GROUPED)
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


class GatedDisk(actors.Actor):
    """The disk manager's setup check, answered when the test opens `gate`."""

    def __init__(self, plan: SetupPlan):
        super().__init__(name="disk")
        self.plan, self.gate, self.seen = plan, trio.Event(), []

    async def handle(self, msg):
        self.seen.append(msg)
        if isinstance(msg, PrepareSetup):
            await self.gate.wait()
            return self.plan


async def test_a_start_refused_by_the_disk_ends_the_job_before_any_keeper(
        tmp_path, autojump_clock):
    refusal = Refusal(code="runner_disk_full", detail="free 1 MiB below the floor 2 GiB")
    async with trio.open_nursery() as nursery:
        disk = Recorder("disk", reply=lambda msg: SetupPlan(refusal=refusal))
        world = World(tmp_path, nursery, disk=disk)
        _, ref = await world.start()
        record = world.state()
        assert (record.state, record.reason, record.detail) == (
            "refused_before_start", "runner_disk_full", "free 1 MiB below the floor 2 GiB")
        assert world.keepers.spawned == [] and tags(world) == ["terminal"]
        assert not world.job_dir.exists()  # nothing of the job was made
        assert world.cpu.kinds() == ["Release"] and world.dispatcher.kinds() == ["Finished"]
        assert world.accounting.kinds() == ["JobEnded"] and not ref.alive
        nursery.cancel_scope.cancel()


async def test_a_bundle_that_cannot_be_unpacked_refuses_the_job(tmp_path, autojump_clock):
    bundle = tmp_path / "bad.tar"
    bundle.write_bytes(b"not a tar at all" * 64)
    root = tmp_path / "ws"
    plan = SetupPlan(refusal=None, path=str(root / "ws"), root=str(root), bundle=str(bundle))
    async with trio.open_nursery() as nursery:
        world = World(tmp_path, nursery, disk=Recorder("disk", reply=lambda msg: plan))
        await world.start()
        record = world.state()
        assert (record.state, record.reason) == ("refused_before_start", "workspace_setup_failed")
        assert "not a readable tar" in record.detail
        assert world.keepers.spawned == [] and tags(world) == ["terminal"]
        nursery.cancel_scope.cancel()


async def test_a_cancel_during_the_disk_check_ends_the_job_before_its_workspace(
        tmp_path, autojump_clock):
    workspace = tmp_path / "ws" / "ws"
    async with trio.open_nursery() as nursery:
        disk = GatedDisk(SetupPlan(refusal=None, path=str(workspace), root=str(tmp_path / "ws")))
        world = World(tmp_path, nursery, disk=disk)
        _, ref = await world.start()
        assert [type(m).__name__ for m in disk.seen] == ["PrepareSetup"]  # held there
        assert await ref.call(Cancel()) is True  # no keeper yet: it will never start
        disk.gate.set()
        await trio.testing.wait_all_tasks_blocked()
        record = world.state()
        assert (record.state, record.detail) == ("cancelled", "cancelled during setup")
        assert not workspace.exists() and not world.job_dir.exists()
        assert world.keepers.spawned == [] and tags(world) == ["terminal"]
        assert world.cpu.kinds() == ["Release"] and world.dispatcher.kinds() == ["Finished"]
        assert not ref.alive
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("state", ["setup", "running"])
async def test_a_restarted_actor_adopts_the_keeper_that_claimed_the_directory(
        tmp_path, autojump_clock, state):
    """The runner (or this actor) went down after the claim: the keeper the claim names is
    followed, never a second one spawned; a job still recorded in `setup` is marked running
    once, from the keeper's own start time."""
    async with trio.open_nursery() as nursery:
        world = World(tmp_path, nursery)
        world.record.state = state
        world.db.save(world.record)
        world.job_dir.mkdir(parents=True)
        keeper = await world.keepers.spawn(world.job_dir)  # the claim, before the restart
        job, ref = await world.start()
        assert job.keeper == (keeper.pid, keeper.create_time)
        assert len(world.keepers.spawned) == 1  # only the claim: nothing spawned again
        assert not (world.job_dir / "spec.json").exists()
        assert world.dispatcher.kinds() == (["SetupDone"] if state == "setup" else [])
        await trio.sleep(OUTPUT_POLL_S)  # an adopted start: saved with its next write too
        await trio.testing.wait_all_tasks_blocked()
        assert world.state().state == "running"
        assert tags(world) == (["started"] if state == "setup" else [])
        world.keepers.exit(keeper.pid, exit_code=3)
        await trio.testing.wait_all_tasks_blocked()
        record = world.state()
        assert (record.state, record.exit_code) == ("failed", 3) and not ref.alive
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("error", [JobDirClaimed("claimed"), SpawnerError("forkserver died")])
async def test_a_spawn_that_finds_the_directory_claimed_adopts_that_keeper(
        tmp_path, autojump_clock, error):
    """Another forkserver's keeper claims the directory between spec.json and the spawn:
    the spawn answers `claimed` (or the forkserver fails after the claim) and the actor
    adopts the keeper the claim names instead of requeueing the job."""
    claims = []

    async def offload(fn, *args):
        result = fn(*args)
        if fn is jobdir.set_up:  # spec.json is written: the other claim comes before the spawn
            claims.append(await world.keepers.spawn(args[2]))  # the other claim wins
            world.keepers.fail = error
        return result

    async with trio.open_nursery() as nursery:
        world = World(tmp_path, nursery, offload=offload, backend=GROUPED)
        job, ref = await world.start()
        [other] = claims
        assert job.keeper == (other.pid, other.create_time)
        assert world.dispatcher.kinds() == ["SetupDone"] and world.cpu.seen == []
        world.keepers.exit(other.pid, exit_code=0)
        await trio.testing.wait_all_tasks_blocked()
        assert world.state().state == "succeeded" and not ref.alive
        assert tags(world) == ["started", "terminal"]  # its start saved with its end
        nursery.cancel_scope.cancel()


class FullDatabase(Database):
    """A state filesystem that is full for terminal records while `full` is set."""

    full = False
    refused = 0

    def save_many(self, writes, *lock_wait):  # every save goes through it (store group commit)
        if self.full and any(isinstance(e, Terminal) for w in writes for e in w[1]):
            self.refused += 1
            raise StoreFull("database or disk is full")
        return super().save_many(writes, *lock_wait)


async def test_a_full_store_holds_the_terminal_record_until_there_is_room(
        tmp_path, autojump_clock):
    async with trio.open_nursery() as nursery:
        world = World(tmp_path, nursery, db=FullDatabase)
        job, ref = await world.start()
        await trio.sleep(OUTPUT_POLL_S)  # its start is saved
        await trio.testing.wait_all_tasks_blocked()
        world.db.full = True
        world.keepers.exit(job.keeper[0], exit_code=0)
        await trio.testing.wait_all_tasks_blocked()
        assert world.db.refused == 1 and world.state().state == "running"
        assert world.cpu.kinds() == ["Release"]  # capacity first: already free
        assert world.dispatcher.kinds() == ["SetupDone", "Finished"]
        assert "JobEnded" not in world.accounting.kinds() and ref.alive  # waiting, not crashed
        await trio.sleep(10 * STORE_FULL_RETRY_S + STORE_FULL_RETRY_S / 2)
        assert world.db.refused == 11 and world.state().state == "running"
        world.db.full = False
        await trio.sleep(STORE_FULL_RETRY_S)
        assert world.state().state == "succeeded" and tags(world) == ["started", "terminal"]
        assert world.accounting.kinds().count("JobEnded") == 1 and not ref.alive
        nursery.cancel_scope.cancel()


async def test_a_cancel_during_a_spawn_that_fails_ends_the_job_cancelled(tmp_path, autojump_clock):
    """The cancel came while the forkserver was asked for a keeper, and the spawn failed
    with nothing started: the job ends `cancelled`, it does not go back to the queue (the
    client was told it was signalled; a requeued job would run later all the same)."""
    async with trio.open_nursery() as nursery:
        world = World(tmp_path, nursery)
        world.keepers.gate = trio.Event()
        world.keepers.fail = SpawnerError("forkserver exited")
        job, ref = await world.start()
        assert len(world.keepers.spawned) == 1 and job.keeper is None  # spawn in flight
        assert await ref.call(Cancel()) is True
        world.keepers.gate.set()
        await trio.testing.wait_all_tasks_blocked()
        record = world.state()
        assert (record.state, record.reason, record.detail) == (
            "cancelled", "cancelled", "cancelled during setup")
        assert world.dispatcher.kinds() == ["Finished"]  # not StartFailed: never requeued
        assert world.cpu.kinds() == ["Release"] and tags(world) == ["terminal"]
        assert not ref.alive
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("backend,setup,end", [(NONE, [], []),
                                               (GROUPED, ["set_up"], ["close", "release"])])
async def test_a_quiet_job_costs_no_thread_hop_without_groups_and_output_is_still_read(
        tmp_path, autojump_clock, backend, setup, end):
    """Issue 14: the job directory is looked at inline; the start's steps (workspace, the
    backend's groups, spec.json) are one offloaded call, or inline when the backend has no
    groups to make (affinity, none) and there is no bundle; output.log is read only when it
    has grown (an inline stat says so), inline when it grew by at most INLINE_READ_BYTES;
    the end (status.json, the backend's finish) is inline when the backend has nothing to
    remove. So a job with no output, or a little, costs no thread hop under `none` and two
    with groups; more output goes to a thread, still batch by batch."""
    from motor.execution import joblog

    calls: list[str] = []
    counting_offload = recording_offload(calls)

    async with trio.open_nursery() as nursery:
        world = World(tmp_path, nursery, offload=counting_offload, backend=backend)
        job, ref = await world.start()
        assert (world.job_dir / "spec.json").exists()
        autojump_clock.jump(1.0)  # many output polls go by
        await trio.testing.wait_all_tasks_blocked()
        assert world.state().state == "running"
        await trio.testing.wait_all_tasks_blocked()
        assert calls == setup
        with open(world.job_dir / joblog.OUTPUT_FILE, "ab") as f:
            f.write(joblog.encode_record(joblog.STDOUT, b"hello\n"))
        autojump_clock.jump(1.0)
        await trio.testing.wait_all_tasks_blocked()
        assert calls == setup and tags(world) == ["started", "output"]  # read inline
        with open(world.job_dir / joblog.OUTPUT_FILE, "ab") as f:
            f.write(joblog.encode_record(joblog.STDOUT, b"x" * jobdir.INLINE_READ_BYTES))
        autojump_clock.jump(1.0)
        await trio.testing.wait_all_tasks_blocked()
        assert calls == [*setup, "read_output"]  # one batch: all the log had grown by
        world.keepers.exit(job.keeper[0], exit_code=0)
        await trio.testing.wait_all_tasks_blocked()
        assert calls == [*setup, "read_output", *end]
        assert tags(world) == ["started", "output", "output", "terminal"]
        assert world.state().state == "succeeded" and not ref.alive
        nursery.cancel_scope.cancel()


def test_only_steps_known_to_touch_nothing_run_inline():
    """`close` runs on the event loop only when status.json is in hand and the backend's
    `settle` is the base one, `set_up` only without a bundle and with the base `prepare`;
    a lost keeper (its leftovers are looked for in /proc), a bundle to unpack or a backend
    with groups to make, read and remove (cgroup, systemd) goes to the offloader."""
    from motor.isolation.cgroup import CgroupBackend
    from motor.isolation.systemd import SystemdBackend

    status = {"exit_code": 0}
    assert jobdir.close_is_light(NONE, status) and not jobdir.close_is_light(NONE, None)
    assert not jobdir.close_is_light(GROUPED, status)
    assert jobdir.set_up_is_light(NONE, None) and not jobdir.set_up_is_light(NONE, "b.tar")
    assert not jobdir.set_up_is_light(GROUPED, None)
    from types import SimpleNamespace
    for version, makes in ((1, True), (1, False), (2, True)):  # only a v1 plan is light
        cgroup = CgroupBackend(flavour=SimpleNamespace(version=version), keeper_makes_groups=makes)
        assert jobdir.set_up_is_light(cgroup, None) is (version == 1 and makes)
        assert not jobdir.set_up_is_light(cgroup, "b.tar") and not jobdir.close_is_light(cgroup, status)
    for cls in (CgroupBackend, SystemdBackend):  # groups to make and remove: offloaded
        assert cls.settle is not Backend.settle and cls.prepare is not Backend.prepare
        assert cls.release is not Backend.release


def test_a_replaced_base_prepare_is_not_light(monkeypatch):
    """A `prepare` replaced on the base class (tests/scheduling hold one at a barrier) is
    not the one known to touch nothing: the start goes to the offloader."""
    monkeypatch.setattr(Backend, "prepare", lambda self, job_id, cpus, memory_max: {})
    assert not jobdir.set_up_is_light(NONE, None)


def test_a_cgroup_end_settles_on_the_event_loop_only_when_its_groups_are_empty(caplog):
    """`settle_quick` (issue 14): the counters read inline when no process is left in the
    job's groups; a process left, or counters that cannot be read, mean None: the full
    `settle` (which kills and waits) goes to the offloader. `close_quick` needs the status
    in hand."""
    from types import SimpleNamespace

    from motor.isolation.cgroup import CgroupBackend

    facts = {"oom_killed": False, "cpu_time_ms": 12, "collect_error": "memory.peak: gone"}
    seen: list = []

    def backend(pids, collect):
        return CgroupBackend(flavour=SimpleNamespace(version=1, pids=pids, collect=collect))

    def collect(job_id, signal):
        seen.append((job_id, signal))
        return dict(facts)

    def broken(job_id, signal):
        raise OSError("read failed")

    job = uuid7(1_000)
    empty = backend(lambda job_id: [], collect)
    assert empty.settle_quick(job, 9) == facts and seen == [(job, 9)]
    assert backend(lambda job_id: [4242], collect).settle_quick(job) is None
    assert backend(lambda job_id: [], broken).settle_quick(job) is None
    assert empty.settle_quick("../not-a-job-id") is None
    assert NONE.settle_quick(job) is None  # the base backend: `settle` itself is light

    with caplog.at_level("WARNING", logger="motor.execution"):
        assert jobdir.close_quick(empty, job, {"exit_code": 0, "signal": None}, "job x") == facts
    assert "job x: isolation" in caplog.text and "memory.peak: gone" in caplog.text
    assert jobdir.close_quick(empty, job, None) is None  # lost keeper: /proc, offloaded
    assert jobdir.close_quick(object(), job, {"exit_code": 0}) is None  # a stand-in backend


@pytest.mark.parametrize("backend,end", [(NONE, []), (GROUPED, ["release"])])
async def test_an_actor_restarted_after_its_jobs_end_was_recorded_just_ends(
        tmp_path, autojump_clock, backend, end):
    """A job actor crashed after its job's terminal record was written (its own save, or
    the dispatcher's with the next start: `Finished.ride`, when the dispatcher then failed):
    its next incarnation starts from that terminal record and ends at once, releasing the
    job's isolation (groups or units) if any, with no transition out of a terminal state
    (which used to crash it again, incarnation after incarnation), no message to the
    dispatcher and nothing saved."""
    import json

    calls: list[str] = []
    counting_offload = recording_offload(calls)

    async with trio.open_nursery() as nursery:
        world = World(tmp_path, nursery, offload=counting_offload, backend=backend)
        world.record.state = "succeeded"
        world.db.save(world.record)
        world.job_dir.mkdir(parents=True)
        (world.job_dir / "status.json").write_text(json.dumps({"exit_code": 0}))
        commits = world.db.commits
        job, ref = await world.start()
        await trio.testing.wait_all_tasks_blocked()
        assert not ref.alive  # ended (a crash would fail this test's nursery)
        assert world.state().state == "succeeded" and world.db.commits == commits
        assert world.dispatcher.kinds() == [] and world.keepers.spawned == []
        assert calls == end
        nursery.cancel_scope.cancel()


def test_keeperds_facts_in_the_status_are_taken_only_when_they_have_their_shape():
    """A v1 job's facts as keeperd read them (status.json's `isolation_facts`, issue 14)
    spare the runner its 8 reads of the groups; a status.json is a file on disk, so facts
    of another shape (a key missing or added, a wrong type, a bool for a count) are not
    trusted: the groups are read as without them. Only v1 takes them."""
    from types import SimpleNamespace

    from motor.isolation.cgroup import CgroupBackend

    read = {"oom_killed": False, "oom_kills": 0, "cpu_time_ms": 3, "memory_max": None,
            "memory_peak": 1 << 20}
    own = {"oom_killed": True, "cpu_time_ms": 99}
    seen: list = []

    def backend(version):
        return CgroupBackend(flavour=SimpleNamespace(
            version=version, pids=lambda job_id: [],
            collect=lambda job_id, signal: seen.append(job_id) or dict(own)))

    job, v1 = uuid7(2_000), backend(1)
    assert v1.settle_quick(job, None, dict(read)) == read and seen == []
    status = {"exit_code": 0, "signal": None, "isolation_facts": dict(read)}
    assert jobdir.close_quick(v1, job, status) == read and seen == []
    for bad in ({**read, "cpu_time_ms": "3"}, {**read, "oom_kills": True},
                {**read, "oom_killed": 1}, {k: v for k, v in read.items() if k != "memory_peak"},
                {**read, "extra": 1}, [read], "facts"):
        seen.clear()
        assert v1.settle_quick(job, None, bad) == own and seen == [job], bad
    seen.clear()
    assert backend(2).settle_quick(job, None, dict(read)) == own and seen == [job]


def test_keeperd_reads_the_facts_of_the_groups_it_made_only():
    """keeperd collects at a job's end only for a spec whose `cgroup_make` names the v1
    groups (controller -> directory); any other spec, or dirs of another shape, none."""
    from motor.execution.keeperd import _cgroup_dirs

    dirs = {"cpuset": "/c/cpuset/p/job-x", "memory": "/c/memory/p/job-x",
            "cpuacct": "/c/cpuacct/p/job-x"}
    assert _cgroup_dirs({"cgroup_make": {"dirs": dirs, "writes": []}}) == dirs
    for spec in ({}, {"cgroup_make": None}, {"cgroup_make": {"dirs": ["x"]}},
                 {"cgroup_make": {"dirs": {"cpuset": "/c"}}},
                 {"cgroup_make": {"dirs": {**dirs, "memory": 7}}}):
        assert _cgroup_dirs(spec) is None, spec


class CountingDatabase(Database):
    """A Database that counts the job actor's questions for a saved log offset."""

    offsets_asked = 0

    def log_offset(self, job_id: str) -> int:
        CountingDatabase.offsets_asked += 1
        return super().log_offset(job_id)


@pytest.mark.parametrize("attempts", [1, 2])
async def test_a_first_start_reads_its_log_from_0_and_a_later_one_from_the_saved_offset(
        tmp_path, autojump_clock, attempts, monkeypatch):
    """Issue 14: on the job's first start (spawned by this actor) nothing read its log
    before, so the actor reads it from 0 without asking the store; a later start resumes
    after what the store says was read (an earlier start's output, left in the log)."""
    from motor.execution import joblog
    from motor.records import decode_event

    monkeypatch.setattr(CountingDatabase, "offsets_asked", 0)
    async with trio.open_nursery() as nursery:
        world = World(tmp_path, nursery, db=CountingDatabase)
        world.record = msgspec.structs.replace(world.record, attempts=attempts)
        log = world.job_dir / joblog.OUTPUT_FILE
        earlier = joblog.encode_record(joblog.STDOUT, b"an earlier start's\n")
        if attempts > 1:  # that start's output, read and saved with its offset
            log.parent.mkdir(parents=True)
            log.write_bytes(earlier)
        world.db.save(world.record, log_offset=len(earlier) if attempts > 1 else None)
        job, ref = await world.start()
        with open(log, "ab") as f:
            f.write(joblog.encode_record(joblog.STDOUT, b"this start's\n"))
        world.keepers.exit(job.keeper[0], exit_code=0)
        await trio.testing.wait_all_tasks_blocked()
        output = [e.data for e in map(decode_event, world.db.events_from(world.record.job_id, 0))
                  if e.__struct_config__.tag == "output"]
        assert output == ["this start's\n"]
        assert CountingDatabase.offsets_asked == (attempts > 1)
        assert world.db.log_offset(world.record.job_id) == log.stat().st_size
        nursery.cancel_scope.cancel()
