"""The dispatcher actor on its own, under MockClock: a real store (SQLite on disk) and
recording stand-ins for the other actors (tests/fakes.py Recorder, a disk whose admission
takes as long as the test says, an execution handle that records the job actors started).
Every step is synchronised with `wait_all_tasks_blocked` or virtual time, never with real
processes or polling. The same paths through the whole runner: tests/scheduling/
test_runner_rules.py, tests/runner, tests/e2e."""

from __future__ import annotations

import msgspec
import pytest
import trio
import trio.testing

import actors
from fakes import Recorder
from motor.clock import MockWallClock, uuid7
from motor.config import RunnerConfig
from motor.cpu.actor import KeepOnly, Place, Release
from motor.disk.messages import Admit, HasBundle
from motor.execution.actor import JobDeps
from motor.handles import AccountingHandle, CpuHandle, DiskHandle, Records, StoreHandle
from motor.handles import DispatcherHandle
from motor.records import JobRecord, JobRequest, Terminal, decode_event, public_record
from motor.scheduling.actor import DispatchDeps, Dispatcher
from motor.scheduling.core import retry_delay_s
from motor.store.actor import StoreActor
from motor.store.hub import ChangeHub
from motor.store.messages import Save
from motor.store.db import Database, StoreFull


class SlowDisk(actors.Actor):
    """The disk actor's admission: each Admit takes `admit_s` seconds (a cleanup)."""

    def __init__(self):
        super().__init__(name="disk")
        self.admit_s = 0.0
        self.admitted: list[str] = []

    async def handle(self, msg):
        if isinstance(msg, Admit):
            await trio.sleep(self.admit_s)
            self.admitted.append(msg.job_id)
            return None
        if isinstance(msg, HasBundle):
            return True
        raise TypeError(msg)


class QuickDisk(SlowDisk):
    """SlowDisk that answers an admission at once when no cleanup is due (`admit_s` 0), as
    the real disk actor does (`immediate`); else LATER: through its inbox, `admit_s` long."""

    immediate = (Admit, HasBundle)

    async def on_start(self):
        self.own_task = trio.lowlevel.current_task()
        self.at_once: list[str] = []  # admitted in another task (the dispatcher's)

    def handle_now(self, msg):
        if isinstance(msg, HasBundle):
            return True
        if self.admit_s:
            return actors.LATER
        if trio.lowlevel.current_task() is not self.own_task:
            self.at_once.append(msg.job_id)
        self.admitted.append(msg.job_id)
        return None


class FullDatabase(Database):
    """The real database, except that while `full_for` holds a state, a transaction that
    saves a record in that state is refused as the state filesystem being full (nothing
    written, as SQLite rolls it back)."""

    full_for: str | None = None

    def save_many(self, writes, *lock_wait):
        if any(w[0].state == self.full_for for w in writes):
            raise StoreFull("database or disk is full")
        return super().save_many(writes, *lock_wait)


class FakeExecution:
    """The execution supervisor's handle: records the job actors started (never runs them)."""

    def __init__(self, running=()):
        self.started: list[str] = []
        self.running = set(running)
        self.factories: dict[str, object] = {}  # job id -> the factory of its actor

    def jobs(self) -> set[str]:
        return set(self.running)

    def job(self, job_id):
        return None

    async def start_job(self, job_id, factory) -> None:
        self.start_job_now(job_id, factory)

    def start_job_now(self, job_id, factory) -> bool:
        self.started.append(job_id)
        self.running.add(job_id)
        self.factories[job_id] = factory
        return True

    def call_job_now(self, job_id, msg):
        return None  # (`job` finds no actor)


class World:
    def __init__(self, tmp_path, nursery, *, max_weight=2, disk=SlowDisk):
        self.tmp_path, self.nursery = tmp_path, nursery
        self.clock = MockWallClock()
        self.config = RunnerConfig(state_dir=str(tmp_path), max_weight=max_weight,
                                   free_space_floor_bytes=0)
        self.db = FullDatabase(tmp_path / "motor.db")
        self.store = StoreActor(self.db, ChangeHub())
        self.disk = disk()
        self.cpu = Recorder("cpu", reply=lambda msg: [0] if isinstance(msg, Place) else None)
        self.accounting = Recorder("accounting")
        self.execution = FakeExecution()
        self.records = Records(self.db)  # what the job actors read
        self.dispatcher: Dispatcher | None = None

    async def start(self) -> DispatcherHandle:
        n = self.nursery
        self.job_deps = JobDeps(
            config=self.config, records=self.records,
            store=StoreHandle(await n.start(self.store.run)), dispatcher=None,
            cpu=CpuHandle(await n.start(self.cpu.run)),
            accounting=AccountingHandle(await n.start(self.accounting.run)),
            spawner=None, backend=None, clock=self.clock, jobs_dir=self.tmp_path / "jobs",
            workspace_root=self.tmp_path / "ws")
        self.disk_handle = DiskHandle(await n.start(self.disk.run))
        return await self.start_dispatcher()

    async def start_dispatcher(self) -> DispatcherHandle:
        """A (new) incarnation of the dispatcher, on the same store and neighbours."""
        self.dispatcher = Dispatcher(DispatchDeps(
            job=self.job_deps, execution=self.execution, disk=self.disk_handle,
            claim_limit=self.config.max_weight, capabilities=()))
        handle = DispatcherHandle(await self.nursery.start(self.dispatcher.run))
        await trio.testing.wait_all_tasks_blocked()
        # each incarnation first has the allocator keep only the recorded starts' CPUs
        # (tests/scheduling/test_runner_rules.py); the tests below look at what follows
        [keep] = [msg for msg in self.cpu.seen if isinstance(msg, KeepOnly)]
        self.cpu.seen.remove(keep)
        return handle

    def state(self, job_id: str) -> str | None:
        record = self.db.get(job_id)
        return None if record is None else record.state


def request(workspace="ws", weight=2) -> JobRequest:
    return JobRequest(command=["make"], workspace=workspace, weight_hint=weight)


def hold_capacity(world: World) -> JobRecord:
    """A running job (recorded, its actor running) that holds max_weight 2 at start-up."""
    running = JobRecord(job_id=uuid7(world.clock.now_ms()), state="running", workspace="old",
                        claim=2, cpus=[0], command=["make"], accepted_at_ms=world.clock.now_ms())
    world.db.save(running)
    world.execution.running.add(running.job_id)
    return running


async def test_a_long_disk_admission_does_not_block_the_dispatcher(tmp_path, autojump_clock):
    """The disk cleans up for 60 s before admitting a submit (twice the dispatcher's
    call timeout): meanwhile the dispatcher serves a status view and a Finished, and the
    submit then gets its record and starts. (Before the disk answered as a message, the
    dispatcher awaited the disk inside the Submit: it crashed at 30 s with CallTimeout.)"""
    async with trio.open_nursery() as nursery:
        world = World(tmp_path, nursery)
        running = hold_capacity(world)
        dispatcher = await world.start()
        world.disk.admit_s = 60.0
        t0 = trio.current_time()
        got = {}

        async def submit():
            got["record"] = await dispatcher.submit(request())
            got["at"] = trio.current_time() - t0

        nursery.start_soon(submit)
        await trio.testing.wait_all_tasks_blocked()  # the disk is cleaning up
        status = await dispatcher.status_view()
        assert status["active"] == [running.job_id] and status["capacity"]["held_permits"] == 2
        await dispatcher.finished(running.job_id)
        assert (await dispatcher.capacity())["held_permits"] == 0
        assert trio.current_time() - t0 < 1.0 and got == {}  # served while the disk works

        await trio.sleep(61)
        record = got["record"]
        assert abs(got["at"] - 60.0) < 1e-6 and record.state == "queued" and world.disk.admitted == [
            record.job_id]
        await trio.testing.wait_all_tasks_blocked()
        assert world.state(record.job_id) == "setup" and world.execution.started == [
            record.job_id]
        assert world.cpu.kinds() == ["Place"]
        nursery.cancel_scope.cancel()


async def test_the_views_are_read_while_a_start_waits_on_the_store(tmp_path, autojump_clock):
    """A job's start is being saved and the store does not answer (a slow disk, another
    process's lock): the status view, a queued job's wait fields and the capacity are read
    at once, the job being started among the active ones (stop 51; before, a status view
    waited in the inbox behind the save)."""
    from tests.store_helpers import GatedStore

    async with trio.open_nursery() as nursery:
        world = World(tmp_path, nursery)
        world.store = GatedStore(world.db, ChangeHub())
        world.store.go.set()
        running = hold_capacity(world)
        dispatcher = await world.start()
        first = await dispatcher.submit(request(workspace="a"))  # waits for capacity
        second = await dispatcher.submit(request(workspace="b"))
        world.store.go = trio.Event()  # from here the store holds what it gets
        nursery.start_soon(dispatcher.finished, running.job_id)
        await trio.testing.wait_all_tasks_blocked()  # the first's start: its save is held
        with trio.fail_after(5):
            status = await dispatcher.status_view()
            views = await dispatcher.queued_views((first.job_id, second.job_id))
            capacity = await dispatcher.capacity()
        assert status["active"] == [first.job_id]  # being started: neither list lost it
        assert [r["job_id"] for r in status["queued"]] == [second.job_id]
        assert list(views) == [second.job_id] and capacity["held_permits"] == 2
        assert world.state(first.job_id) == "queued"  # its start not yet recorded
        world.store.go.set()
        await trio.testing.wait_all_tasks_blocked()
        assert world.state(first.job_id) == "setup" and world.execution.started == [first.job_id]
        status = await dispatcher.status_view()
        assert status["active"] == [first.job_id]
        assert [r["job_id"] for r in status["queued"]] == [second.job_id]
        nursery.cancel_scope.cancel()


class TellingExecution(FakeExecution):
    """FakeExecution whose job actors take what they are told at once (`call_job_now`)."""

    def __init__(self, running=()):
        super().__init__(running)
        self.told: list[tuple[str, object]] = []

    def call_job_now(self, job_id, msg):
        if job_id not in self.running:
            return None
        self.told.append((job_id, msg))
        return True


async def test_a_running_jobs_cancel_is_answered_while_a_save_waits_on_the_store(
        tmp_path, autojump_clock):
    """A cancel of a running job only tells its actor: it is answered, and the actor told,
    at once, also while the dispatcher waits on a save the store holds. A queued job's
    cancel changes the queue: it waits for the save, then ends the job."""
    from motor.execution.actor import Cancel
    from tests.store_helpers import GatedStore

    async with trio.open_nursery() as nursery:
        world = World(tmp_path, nursery)
        world.store = GatedStore(world.db, ChangeHub())
        world.store.go.set()
        world.execution = TellingExecution()
        running = hold_capacity(world)
        dispatcher = await world.start()
        queued = await dispatcher.submit(request(workspace="b"))  # waits for capacity
        world.store.go = trio.Event()  # from here the store holds what it gets
        nursery.start_soon(dispatcher.submit, request(workspace="c"))  # its save is held
        await trio.testing.wait_all_tasks_blocked()
        with trio.fail_after(5):
            assert await dispatcher.cancel(running.job_id) == "signalled"
        assert [(job_id, type(msg)) for job_id, msg in world.execution.told] == [
            (running.job_id, Cancel)]
        answers = []

        async def cancel_queued():
            answers.append(await dispatcher.cancel(queued.job_id))

        nursery.start_soon(cancel_queued)
        await trio.testing.wait_all_tasks_blocked()
        assert answers == [] and world.state(queued.job_id) == "queued"  # behind the save
        world.store.go.set()
        await trio.testing.wait_all_tasks_blocked()
        assert answers == ["cancelled"] and world.state(queued.job_id) == "cancelled"
        assert len(world.execution.told) == 1  # told once
        nursery.cancel_scope.cancel()


async def test_concurrent_submits_join_the_queue_in_arrival_order(tmp_path, autojump_clock):
    """Three submits arrive while the disk works; each is answered once the disk admitted
    it, and the queue holds them in job-id (arrival) order."""
    async with trio.open_nursery() as nursery:
        world = World(tmp_path, nursery, max_weight=2)
        dispatcher = await world.start()
        world.disk.admit_s = 10.0
        records = {}

        async def submit(i):
            records[i] = await dispatcher.submit(request(weight=2))

        for i in range(3):
            nursery.start_soon(submit, i)
            await trio.testing.wait_all_tasks_blocked()
        assert records == {}
        await trio.sleep(31)
        ids = [records[i].job_id for i in range(3)]
        assert ids == sorted(ids) and world.disk.admitted == ids
        status = await dispatcher.status_view()
        assert status["active"] == ids[:1]
        assert [r["job_id"] for r in status["queued"]] == ids[1:]
        nursery.cancel_scope.cancel()


async def test_an_idle_disk_admits_a_submit_within_the_dispatchers_own_turn(
        tmp_path, autojump_clock):
    """An idle disk with no cleanup due answers the admission at once (`admit_now`): the
    dispatcher handles the submit in one message (no `DiskAnswered` back from its asker),
    and the disk's own task ran nothing."""
    async with trio.open_nursery() as nursery:
        world = World(tmp_path, nursery, disk=QuickDisk)
        dispatcher = await world.start()
        ref = world.dispatcher.ref
        before = ref.statistics().messages_handled
        record = await dispatcher.submit(request())
        await trio.testing.wait_all_tasks_blocked()
        assert world.state(record.job_id) == "setup"
        assert ref.statistics().messages_handled - before == 1
        assert world.disk.at_once == world.disk.admitted == [record.job_id]
        nursery.cancel_scope.cancel()


async def test_a_submit_behind_an_admission_in_cleanup_waits_for_it_in_arrival_order(
        tmp_path, autojump_clock):
    """The first admission needs a 10 s cleanup (LATER: the disk's inbox); a submit that
    arrives meanwhile, when a cleanup is no longer due, is not answered at once past it:
    the disk admits them in arrival order and both join the queue in job-id order."""
    async with trio.open_nursery() as nursery:
        world = World(tmp_path, nursery, disk=QuickDisk)
        dispatcher = await world.start()
        world.disk.admit_s = 10.0
        records = {}

        async def submit(i):
            records[i] = await dispatcher.submit(request(weight=2))

        nursery.start_soon(submit, 0)
        await trio.testing.wait_all_tasks_blocked()  # the disk cleans up for the first
        world.disk.admit_s = 0
        nursery.start_soon(submit, 1)
        await trio.testing.wait_all_tasks_blocked()
        assert records == {}
        await trio.sleep(11)
        ids = [records[0].job_id, records[1].job_id]
        assert ids == sorted(ids) and world.disk.admitted == ids  # the second not before
        status = await dispatcher.status_view()
        assert status["active"] == ids[:1] and [r["job_id"] for r in status["queued"]] == ids[1:]
        nursery.cancel_scope.cancel()


async def test_a_start_the_store_cannot_record_goes_back_to_its_queue(tmp_path, autojump_clock):
    """The store refuses the `setup` save of a queued job (state fs full): nothing runs
    unrecorded, the CPUs placed are released and the job waits in its queue; it starts once
    the store has room."""
    async with trio.open_nursery() as nursery:
        world = World(tmp_path, nursery)
        running = hold_capacity(world)
        dispatcher = await world.start()
        record = await dispatcher.submit(request())  # it waits: accepted, recorded
        assert world.state(record.job_id) == "queued"
        world.db.full_for = "setup"
        await dispatcher.finished(running.job_id)
        await trio.testing.wait_all_tasks_blocked()
        assert world.cpu.kinds() == ["Place", "Release"]
        assert world.state(record.job_id) == "queued" and world.execution.started == []
        status = await dispatcher.status_view()
        assert status["active"] == [] and [r["job_id"] for r in status["queued"]] == [record.job_id]
        assert status["capacity"]["held_permits"] == 0

        world.db.full_for = None
        await trio.sleep(retry_delay_s(1) + 0.5)  # its retry delay passes: it starts
        assert world.state(record.job_id) == "setup"
        assert world.execution.started == [record.job_id]
        assert world.cpu.kinds() == ["Place", "Release", "Place"]
        nursery.cancel_scope.cancel()


async def test_a_job_that_starts_at_its_admission_is_accepted_and_started_in_one_save(
        tmp_path, autojump_clock):
    """Issue 14: on an idle runner a submit's accept and its start are one commit (the
    record is saved as `setup`, with the accept's events), answered with the record as
    accepted. If the store refuses that save (state fs full), the submit is refused
    runner_disk_full and nothing is left of it: no record, no CPUs, no permits, no actor;
    the next submit, once there is room, starts."""
    async with trio.open_nursery() as nursery:
        world = World(tmp_path, nursery)
        dispatcher = await world.start()
        commits = world.db.commits
        record = await dispatcher.submit(request())
        await trio.testing.wait_all_tasks_blocked()
        assert record.state == "queued" and world.state(record.job_id) == "setup"
        assert world.db.commits == commits + 1 and world.execution.started == [record.job_id]
        events = world.db.events_from(record.job_id, 0)
        assert [type(decode_event(e)).__name__ for e in events] == ["Accepted", "Queued"]
        await dispatcher.finished(record.job_id)

        world.db.full_for = "setup"
        refusal = await dispatcher.submit(request())
        await trio.testing.wait_all_tasks_blocked()
        assert refusal.code == "runner_disk_full" and "full" in refusal.detail
        assert [r.job_id for r in world.db.live()] == [record.job_id]  # (its actor is fake)
        assert world.execution.started == [record.job_id]
        assert world.cpu.kinds() == ["Place", "Place", "Release"]  # (the first: its actor's)
        status = await dispatcher.status_view()
        assert status["queued"] == [] and status["active"] == []
        assert status["capacity"]["held_permits"] == 0 and status["capacity"]["pending_jobs"] == 0

        world.db.full_for = None
        again = await dispatcher.submit(request())
        await trio.testing.wait_all_tasks_blocked()
        assert world.state(again.job_id) == "setup"
        assert world.execution.started == [record.job_id, again.job_id]
        nursery.cancel_scope.cancel()


async def test_a_submit_the_store_cannot_record_is_refused_disk_full(tmp_path, autojump_clock):
    """A submit that would wait (its accept saved alone, as `queued`) and the store full."""
    async with trio.open_nursery() as nursery:
        world = World(tmp_path, nursery)
        running = hold_capacity(world)
        dispatcher = await world.start()
        world.db.full_for = "queued"
        refusal = await dispatcher.submit(request())
        assert refusal.code == "runner_disk_full" and refusal.floor_bytes == 0
        assert "full" in refusal.detail and world.db.live() == [world.db.get(running.job_id)]
        assert (await dispatcher.capacity())["pending_jobs"] == 0
        await trio.testing.wait_all_tasks_blocked()
        assert "AdmissionRefused" in world.accounting.kinds()
        nursery.cancel_scope.cancel()


async def test_a_restarted_dispatcher_recovers_queued_and_running_jobs(tmp_path, autojump_clock):
    async with trio.open_nursery() as nursery:
        world = World(tmp_path, nursery, max_weight=3)
        dispatcher = await world.start()
        first = await dispatcher.submit(request(workspace="a"))
        second = await dispatcher.submit(request(workspace="b"))
        await trio.testing.wait_all_tasks_blocked()
        assert world.state(first.job_id) == "setup" and world.state(second.job_id) == "queued"
        orphan = JobRecord(job_id=uuid7(world.clock.now_ms()), state="running", workspace="c",
                           claim=1, cpus=[1], command=["make"],
                           accepted_at_ms=world.clock.now_ms())
        world.db.save(orphan)  # recorded running, but its actor is gone
        old = world.dispatcher
        old.stop()
        await trio.testing.wait_all_tasks_blocked()
        assert not dispatcher.ref.alive

        dispatcher = await world.start_dispatcher()
        status = await dispatcher.status_view()
        assert status["active"] == sorted([first.job_id, orphan.job_id])
        assert [r["job_id"] for r in status["queued"]] == [second.job_id]
        assert world.execution.started == [first.job_id, orphan.job_id]  # only the orphan anew
        assert status["capacity"]["held_permits"] == 3

        await dispatcher.finished(first.job_id)  # its permits return: the queued job starts
        await trio.testing.wait_all_tasks_blocked()
        assert world.state(second.job_id) == "setup"
        assert world.execution.started[-1] == second.job_id
        assert msgspec.structs.asdict(world.db.get(second.job_id))["attempts"] == 1
        nursery.cancel_scope.cancel()


async def test_a_disk_admission_past_its_limit_is_refused_and_nothing_recorded(
        tmp_path, autojump_clock):
    """The disk's cleanup outlasts DISK_ADMIT_TIMEOUT_S: the submit is refused
    runner_disk_full before its submitter's own timeout, and the dispatcher goes on."""
    from motor.scheduling.messages import DISK_ADMIT_TIMEOUT_S, SUBMIT_TIMEOUT_S

    async with trio.open_nursery() as nursery:
        world = World(tmp_path, nursery)
        dispatcher = await world.start()
        world.disk.admit_s = DISK_ADMIT_TIMEOUT_S + 100
        t0 = trio.current_time()
        refusal = await dispatcher.submit(request())
        waited = trio.current_time() - t0
        assert abs(waited - DISK_ADMIT_TIMEOUT_S) < 1e-6 and waited < SUBMIT_TIMEOUT_S
        assert refusal.code == "runner_disk_full" and "did not complete" in refusal.detail
        assert world.db.live() == [] and dispatcher.ref.alive
        assert (await dispatcher.capacity())["pending_jobs"] == 0
        world.disk.admit_s = 0
        await trio.sleep(101)  # the disk finishes the abandoned cleanup
        record = await dispatcher.submit(request())
        assert record.state == "queued"
        nursery.cancel_scope.cancel()


async def test_an_orderly_stop_saves_the_clocks_still_waiting_for_their_save(
        tmp_path, autojump_clock):
    """Stop 23: clocks that changed within CLOCK_SAVE_S of the last clock save wait for the
    end of that time; a dispatcher that stops before then saves them on its way out, so a
    restart after an orderly stop resumes every clock exactly. A job waits for capacity
    (advancing): its change is staged as one still waiting, and the store has it after
    the stop, with the value at the stop."""
    async with trio.open_nursery() as nursery:
        world = World(tmp_path, nursery, max_weight=2)
        dispatcher = await world.start()
        running = await dispatcher.submit(request(weight=2))
        waiting = await dispatcher.submit(request(workspace="other", weight=2))
        await trio.testing.wait_all_tasks_blocked()
        assert world.state(running.job_id) == "setup"
        stored = world.db.get(waiting.job_id)
        assert stored.queue_clock_running and stored.queue_wait_ms == 0
        await trio.sleep(7)
        machine = world.dispatcher.machine
        machine.clock_saved.pop(waiting.job_id)  # changed, and a clock save was just made:
        machine.clock_check.add(waiting.job_id)
        machine.clock_save_at = trio.current_time() + 3600  # it waits (far longer than it does)
        world.dispatcher.stop()
        await trio.testing.wait_all_tasks_blocked()
        assert not dispatcher.ref.alive
        stored = world.db.get(waiting.job_id)
        assert stored.queue_clock_running and stored.queue_wait_ms == 7000
        nursery.cancel_scope.cancel()


async def test_after_a_save_of_many_clocks_the_next_waits_longer(
        tmp_path, autojump_clock, monkeypatch):
    """Stop 43, through the dispatcher and its store: a save of N clocks holds off the next
    clock save for N / CLOCK_SAVE_ROWS_PER_S seconds when that is longer than CLOCK_SAVE_S
    (here 4 clocks a second, so three clocks hold it off 0.75 s). Real flips: a workspace
    freed resumes the three clocks queued behind its job; taken again 0.4 s later, two of
    them pause, and that change is stored only once the 0.75 s are up."""
    from motor.scheduling import machine as m

    monkeypatch.setattr(m, "CLOCK_SAVE_ROWS_PER_S", 4)
    async with trio.open_nursery() as nursery:
        world = World(tmp_path, nursery, max_weight=1)
        dispatcher = await world.start()
        a1 = await dispatcher.submit(request("a", 1))
        behind = [await dispatcher.submit(request("a", 1)) for _ in range(3)]
        b1 = await dispatcher.submit(request("b", 1))
        await trio.testing.wait_all_tasks_blocked()
        assert world.state(a1.job_id) == "setup"
        assert [world.db.get(r.job_id).queue_clock_running for r in behind] == [False] * 3
        await trio.sleep(5)  # (every clock saved long ago)
        await dispatcher.finished(a1.job_id)  # b's turn: a is free, its three clocks run
        await trio.testing.wait_all_tasks_blocked()
        t0 = trio.current_time()
        assert world.state(b1.job_id) == "setup"
        assert [world.db.get(r.job_id).queue_clock_running for r in behind] == [True] * 3
        await trio.sleep(0.4)
        await dispatcher.finished(b1.job_id)  # a's next job starts: the other two pause
        await trio.testing.wait_all_tasks_blocked()
        assert world.state(behind[0].job_id) == "setup"
        rest = behind[1:]
        await trio.sleep(t0 + 0.7 - trio.current_time())  # past CLOCK_SAVE_S: not yet saved
        assert [world.db.get(r.job_id).queue_clock_running for r in rest] == [True, True]
        await trio.sleep(t0 + 0.76 - trio.current_time())
        assert [world.db.get(r.job_id).queue_clock_running for r in rest] == [False, False]
        assert [world.db.get(r.job_id).queue_wait_ms for r in rest] == [400, 400]
        nursery.cancel_scope.cancel()


class CountingRecords(Records):
    """The records view the job actors read, counting the reads of one record."""

    def __init__(self, db):
        super().__init__(db)
        self.gets: list[str] = []

    def get(self, job_id):
        self.gets.append(job_id)
        return super().get(job_id)


async def test_a_started_job_actor_gets_its_record_from_the_dispatcher(tmp_path, autojump_clock):
    """The record the dispatcher saved at a job's start is the one its actor starts from:
    no read of it back from the store on the start path (issue 14); an incarnation made
    later (the supervisor restarting a crashed job actor) reads the record as stored then."""
    async with trio.open_nursery() as nursery:
        world = World(tmp_path, nursery)
        world.records = counting = CountingRecords(world.db)
        dispatcher = await world.start()
        record = await dispatcher.submit(request())
        await trio.testing.wait_all_tasks_blocked()
        assert world.execution.started == [record.job_id]
        factory = world.execution.factories[record.job_id]
        first = factory()
        assert first.record.job_id == record.job_id and first.record.state == "setup"
        assert first.record == world.db.get(record.job_id) and counting.gets == []
        world.db.save(msgspec.structs.replace(world.db.get(record.job_id), state="running"))
        again = factory()
        assert counting.gets == [record.job_id] and again.record.state == "running"
        nursery.cancel_scope.cancel()


class HeldCpu(Recorder):
    """An allocator that answers at once (immediate) unless `gate` is set: then it waits
    for it in its own task (a busy allocator)."""

    immediate = (Place, Release)

    def __init__(self):
        super().__init__("cpu", reply=lambda msg: [0] if isinstance(msg, Place) else None)
        self.gate: trio.Event | None = None

    def handle_now(self, msg):
        if self.gate is not None:
            return actors.LATER
        self.seen.append(msg)
        return self._reply(msg)

    async def handle(self, msg):
        if self.gate is not None:
            await self.gate.wait()
        self.seen.append(msg)
        return self._reply(msg)


async def _one_running_one_queued(world: World):
    running = JobRecord(job_id=uuid7(world.clock.now_ms()), state="running", workspace="old",
                        claim=2, cpus=[0], command=["make"], accepted_at_ms=world.clock.now_ms())
    world.db.save(running)
    world.execution.running.add(running.job_id)
    dispatcher = await world.start()
    queued = await dispatcher.submit(request())
    await trio.testing.wait_all_tasks_blocked()
    assert world.state(queued.job_id) == "queued" and world.execution.started == []
    return dispatcher, running, queued


def _terminal_save(world: World, job_id: str) -> Save:
    """A job actor's terminal save of `job_id` (succeeded), as `terminal_save` makes it."""
    ended = msgspec.structs.replace(world.db.get(job_id), state="succeeded", exit_code=0)
    return Save(record=ended, events=(Terminal(record=public_record(ended)),))


@pytest.mark.parametrize("store", ["room", "full"])
async def test_a_jobs_terminal_save_rides_with_the_next_jobs_start(tmp_path, autojump_clock,
                                                                    store):
    """Issue 14 (stop 29): a job actor's Finished brings its terminal save (`ride`); the
    dispatcher writes it in the transaction of the next job's `setup` record (one commit
    for both) and answers True. When the store refuses that transaction (the state fs is
    full: here for terminal records), neither is written: the next job goes back to its
    queue (its clock's save, which the ride joins too, fails the same), the answer is
    False and the terminal save is the job actor's again."""
    async with trio.open_nursery() as nursery:
        world = World(tmp_path, nursery)
        dispatcher, running, queued = await _one_running_one_queued(world)
        commits = world.db.commits
        world.db.full_for = "succeeded" if store == "full" else None
        saved = await dispatcher.finished(running.job_id, _terminal_save(world, running.job_id))
        if store == "room":
            assert saved is True and world.db.commits == commits + 1
            assert world.state(running.job_id) == "succeeded"
            assert world.state(queued.job_id) == "setup"
            assert world.execution.started == [queued.job_id]
        else:
            assert saved is False and world.db.commits == commits
            assert world.state(running.job_id) == "running"
            assert world.state(queued.job_id) == "queued" and world.execution.started == []
        nursery.cancel_scope.cancel()


async def test_a_terminal_save_with_no_start_to_ride_with_is_left_to_its_job_actor(
        tmp_path, autojump_clock):
    """Nothing waits to start: the dispatcher makes no save while handling the Finished,
    so it writes none for the ride either, and answers False."""
    async with trio.open_nursery() as nursery:
        world = World(tmp_path, nursery)
        dispatcher, running, queued = await _one_running_one_queued(world)
        await dispatcher.cancel(queued.job_id)  # the queue is empty now
        commits = world.db.commits
        saved = await dispatcher.finished(running.job_id, _terminal_save(world, running.job_id))
        assert saved is False and world.db.commits == commits
        assert world.state(running.job_id) == "running"
        nursery.cancel_scope.cancel()


async def test_a_jobs_end_is_handled_in_the_job_actors_task_when_the_dispatcher_is_idle(
        tmp_path, autojump_clock):
    """Issue 14: a job actor's Finished (and SetupDone) finds the dispatcher idle: the
    machine and every effect (the next job's CPUs, its `setup` record, its actor) are
    carried out in the job actor's task, with no task switch to the dispatcher and back."""
    async with trio.open_nursery() as nursery:
        world = World(tmp_path, nursery)
        world.cpu = HeldCpu()
        dispatcher, running, queued = await _one_running_one_queued(world)
        handled = dispatcher.ref.statistics().messages_handled
        where = []
        start_now = world.execution.start_job_now
        world.execution.start_job_now = lambda *a: where.append(
            trio.lowlevel.current_task()) or start_now(*a)
        await dispatcher.finished(running.job_id)
        assert where == [trio.lowlevel.current_task()]  # the next start, in this task
        assert world.execution.started == [queued.job_id]
        assert world.state(queued.job_id) == "setup" and world.cpu.kinds() == ["Place"]
        assert dispatcher.ref.statistics().messages_handled == handled + 1
        nursery.cancel_scope.cancel()


async def test_what_a_jobs_end_cannot_finish_at_once_is_finished_before_the_next_message(
        tmp_path, autojump_clock):
    """Issue 14: when an effect of a Finished handled in the job actor's task would wait
    (here the allocator is busy), the rest is carried out by the dispatcher's own task
    before any message that came after (a cancel of the job being started finds it
    started, not half-way), and the Finished is answered only then."""
    async with trio.open_nursery() as nursery:
        world = World(tmp_path, nursery)
        world.cpu = HeldCpu()
        dispatcher, running, queued = await _one_running_one_queued(world)
        world.cpu.gate = gate = trio.Event()
        got = {}

        async def finished():
            await dispatcher.finished(running.job_id)
            got["finished"] = world.execution.started[:]

        async def cancel():
            got["cancel"] = await dispatcher.cancel(queued.job_id)

        nursery.start_soon(finished)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(cancel)
        await trio.testing.wait_all_tasks_blocked()
        assert got == {} and world.execution.started == []  # the CPUs are being placed
        gate.set()
        await trio.testing.wait_all_tasks_blocked()
        assert got == {"finished": [queued.job_id], "cancel": "signalled"}
        assert world.state(queued.job_id) == "setup"
        nursery.cancel_scope.cancel()


async def test_a_jobs_end_from_the_inbox_finishes_before_the_messages_queued_behind_it(
        tmp_path, autojump_clock):
    """The same when the Finished waited in the dispatcher's inbox (it was busy) and the
    dispatcher's own task finds an effect that must wait: the rest (the CPUs placed, the
    start) comes next, ahead of the cancel already queued behind the Finished."""
    from motor.scheduling import machine as m
    from motor.scheduling.messages import CancelJob, Finished

    async with trio.open_nursery() as nursery:
        world = World(tmp_path, nursery)
        world.cpu = HeldCpu()
        dispatcher, running, queued = await _one_running_one_queued(world)
        world.cpu.gate = gate = trio.Event()
        machine, events = world.dispatcher.machine, []
        real_handle = machine.handle
        machine.handle = lambda event, *a: events.append(type(event).__name__) or real_handle(
            event, *a)
        dispatcher.ref.cast_nowait(m.TimerFired())  # not immediate: queued, the actor busy
        dispatcher.ref.cast_nowait(Finished(running.job_id))  # so these wait in its inbox
        dispatcher.ref.cast_nowait(CancelJob(queued.job_id))
        await trio.testing.wait_all_tasks_blocked()
        assert world.execution.started == []  # the CPUs are being placed
        gate.set()
        await trio.testing.wait_all_tasks_blocked()
        assert [e for e in events if e in ("Finished", "Placed", "CancelJob")] == [
            "Finished", "Placed", "CancelJob"]
        assert world.execution.started == [queued.job_id]
        nursery.cancel_scope.cancel()


async def test_a_submit_goes_through_the_dispatchers_inbox_and_yields(tmp_path, autojump_clock):
    """Unlike the job actors' messages, a submit is handled in the dispatcher's own task
    even when it is idle: the submitter waits for it, so a client submitting in a loop
    lets the jobs it starts run between its submits (docs/scheduling.md: handled in the
    submitter's task, a loop queued everything first and the deeper queues cost more)."""
    async with trio.open_nursery() as nursery:
        world = World(tmp_path, nursery, disk=QuickDisk)
        dispatcher = await world.start()
        ran = []

        async def other():
            ran.append(trio.current_time())

        nursery.start_soon(other)
        record = await dispatcher.submit(request())
        assert ran and record.state == "queued"
        nursery.cancel_scope.cancel()
