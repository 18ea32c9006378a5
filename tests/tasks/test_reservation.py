"""Seed 000 (runner slot reservation): every named test of the `tasks` group.

Races are staged with process-identity fixtures whose liveness the test controls
(tests/tasks/conftest.py) and, across "processes", with two independent QueueLock holders
on one real queue file and explicit barriers.  No sleeps."""

from __future__ import annotations

import fcntl
import json
import os
import stat
import threading
import time
import uuid

import msgspec
import pytest
import trio

from motor import locks
from motor.tasks import core
from motor.tasks.client import TaskClient
from motor.tasks.detached import take_over_reserved_slot
from motor.tasks.queue import open_queue
from motor.tasks.records import (
    NIL_TOKEN,
    ProcessIdentity,
    QueueFile,
    RunnerRecord,
    RunnerSlotReservation,
    decode,
    encode,
)
from motor.tasks.store import ClientDir
from motor.tasks.workers import Fleet, WorkerSpec


def fleet(n: int) -> Fleet:
    return Fleet(tuple(WorkerSpec(f"mini-{i + 1}", f"unix:/nonexistent/mini-{i + 1}.sock") for i in range(n)))


def queue_with(*keys, owner: ProcessIdentity, now: int = 1000) -> QueueFile:
    q = QueueFile()
    for task_id, turn_id in keys:
        core.enqueue(q, task_id=task_id, turn_id=turn_id, owner=owner, now_ms=now)
    return q


def reserve(q, runners, procs, tokens, key, reserver, cap, **kw):
    return core.reserve_runner_slot(q, runners, procs, task_id=key[0], turn_id=key[1], reserver=reserver,
                                    cap=cap, new_token=tokens, **kw)


# --- pure core ---------------------------------------------------------------------------


def test_same_reserver_two_jobs_cap_one_grants_exactly_one_acquired(procs, tokens):
    """One process reserving for two jobs under cap 1: its first reservation counts against
    the cap even though both share its pid (one count per reservation, not per pid)."""
    r = procs.spawn()
    q = queue_with(("a", "1"), ("b", "1"), owner=r)
    first = reserve(q, {}, procs, tokens, ("a", "1"), r, cap=1)
    second = reserve(q, {}, procs, tokens, ("b", "1"), r, cap=1)
    assert (first.kind, first.step) == ("acquired", 5)
    assert (second.kind, second.step) == ("saturated", 4)
    assert core.occupied_runner_slots_locked(q, {}, procs) == 1
    assert [e.slot_reservation is not None for e in core.fifo(q)] == [True, False]
    # one count per reservation, not per reserver pid: at cap 2 the same reserver's two
    # outstanding reservations fill it
    q = queue_with(("a", "1"), ("b", "1"), ("c", "1"), owner=r)
    kinds = [reserve(q, {}, procs, tokens, (t, "1"), r, cap=2).kind for t in "abc"]
    assert kinds == ["acquired", "acquired", "saturated"]
    assert core.occupied_runner_slots_locked(q, {}, procs) == 2


def test_same_reserver_same_job_starts_executor_once(procs, tokens):
    """Reserving the same job twice (a retried submit in one process) spawns once: the
    second answer is Pending with the live reservation's token."""
    r = procs.spawn()
    q = queue_with(("a", "1"), owner=r)
    spawns = []
    for _ in range(3):
        out = reserve(q, {}, procs, tokens, ("a", "1"), r, cap=4)
        if out.acquired:
            spawns.append(out.token)
    assert len(spawns) == 1
    again = reserve(q, {}, procs, tokens, ("a", "1"), r, cap=4)
    assert (again.kind, again.step, again.token) == ("pending", 1, spawns[0])


def test_same_job_after_adoption_does_not_spawn_again(procs, tokens):
    """After the child adopted the row and the handoff completed (token cleared), another
    reserve of that job finds the live same-turn runner / holder: Pending(nil), no spawn."""
    r, reconciler = procs.spawn(), procs.spawn()
    q = queue_with(("a", "1"), owner=r)
    got = reserve(q, {}, procs, tokens, ("a", "1"), r, cap=2)
    child = procs.spawn()
    assert core.complete_bind(q, procs, task_id="a", turn_id="1", token=got.token, child=child)
    runners = {"a": RunnerRecord(identity=child, turn_id="1")}
    assert core.complete_clear(q, task_id="a", turn_id="1", token=got.token)
    for who in (r, reconciler):
        again = reserve(q, runners, procs, tokens, ("a", "1"), who, cap=2)
        assert (again.kind, again.step, again.token) == ("pending", 3, NIL_TOKEN)
    assert core.find_row(q, "a", "1").slot_reservation is None
    # the nil token is never installable
    with pytest.raises(core.QueueError) as err:
        core.bind_runner_slot_child(q, task_id="a", turn_id="1", token=NIL_TOKEN, child=child)
    assert err.value.code == core.QUEUE_SLOT_TOKEN_MISMATCH


def test_exclude_reserver_still_counts_that_pid_reservations_against_cap(procs, tokens):
    """A finishing runner R (task.runner of its finished task) passes exclude_reserver: its
    own identity no longer counts, but a reservation R holds still does."""
    runner = procs.spawn()
    q = queue_with(("done", "1"), ("b", "1"), ("c", "1"), owner=procs.spawn())
    q.entries.remove(core.find_row(q, "done", "1"))     # R's turn finished, R still alive
    for row in q.entries:
        core.park(q, task_id=row.task_id, turn_id=row.turn_id)
    runners = {"done": RunnerRecord(identity=runner, turn_id="1")}
    # without the exclusion R's own slot fills cap 1
    assert reserve(q, runners, procs, tokens, ("b", "1"), runner, cap=1).kind == "saturated"
    # with it, R may replace its own slot
    got = reserve(q, runners, procs, tokens, ("b", "1"), runner, cap=1, exclude_reserver=True)
    assert got.acquired
    # R's outstanding reservation on b still counts: c cannot start even with the exclusion
    assert core.occupied_runner_slots_locked(q, runners, procs, exclude_reserver=runner) == 1
    out = reserve(q, runners, procs, tokens, ("c", "1"), runner, cap=1, exclude_reserver=True)
    assert (out.kind, out.step) == ("saturated", 4)


def test_queue_publish_before_runner_record_does_not_free_the_slot(tmp_path, procs, tokens):
    """complete_runner_spawn crashes between its two publishes: the first publish (child
    bound, reservation still present) is on disk, task.runner is not.  A fresh process
    reading the file still sees the slot occupied through the bound reservation."""
    parent, child, other = procs.spawn(), procs.spawn(), procs.spawn()
    cdir = ClientDir(tmp_path / "c", observe=procs)

    def first(L):
        core.enqueue(L.queue, task_id="a", turn_id="1", owner=parent, now_ms=1)
        core.enqueue(L.queue, task_id="b", turn_id="1", owner=other, now_ms=2)
        return reserve(L.queue, L.runners, L.observe, tokens, ("a", "1"), parent, cap=1)

    got = cdir.critical(first)

    class Crash(Exception):
        pass

    def complete_then_crash(L):
        core.complete_bind(L.queue, L.observe, task_id="a", turn_id="1", token=got.token, child=child)
        L.publish()                                    # publish 1
        raise Crash                                    # dies before task.runner is written

    with pytest.raises(Crash):
        cdir.critical(complete_then_crash)
    on_disk = decode((tmp_path / "c" / "queue.json").read_bytes(), QueueFile)
    res = core.find_row(on_disk, "a", "1").slot_reservation
    assert res is not None and res.token == got.token and res.child == child
    assert cdir.read_runners() == {}
    out = cdir.critical(lambda L: reserve(L.queue, L.runners, L.observe, tokens, ("b", "1"), other, cap=1))
    assert (out.kind, out.step) == ("saturated", 4)
    procs.kill(child)  # even a dead bound child's reservation counts until it is cleared or stolen
    out = cdir.critical(lambda L: reserve(L.queue, L.runners, L.observe, tokens, ("b", "1"), other, cap=1))
    assert out.kind == "saturated"


def test_stale_complete_after_steal_does_not_clear_the_new_child(procs, tokens):
    """Parent 1 reserved and died before binding; a reconciler stole the row (a new token)
    and bound its own child.  A late complete/release with the old token changes nothing."""
    p1, p2 = procs.spawn(), procs.spawn()
    q = queue_with(("a", "1"), owner=p1)
    old = reserve(q, {}, procs, tokens, ("a", "1"), p1, cap=2)
    procs.kill(p1)
    stolen = reserve(q, {}, procs, tokens, ("a", "1"), p2, cap=2)
    assert (stolen.kind, stolen.step) == ("acquired", 2) and stolen.token != old.token
    child2 = procs.spawn()
    assert core.complete_bind(q, procs, task_id="a", turn_id="1", token=stolen.token, child=child2)
    stale_child = procs.spawn()
    before = encode(q)
    with pytest.raises(core.QueueError) as err:
        core.complete_bind(q, procs, task_id="a", turn_id="1", token=old.token, child=stale_child)
    assert err.value.code == core.QUEUE_SLOT_TOKEN_MISMATCH
    assert not core.complete_clear(q, task_id="a", turn_id="1", token=old.token)
    assert not core.release_runner_slot(q, task_id="a", turn_id="1", token=old.token, reserver=p1)
    assert encode(q) == before
    res = core.find_row(q, "a", "1").slot_reservation
    assert res.token == stolen.token and res.child == child2
    # and the stale child cannot take the slot over either
    with pytest.raises(core.QueueError):
        core.take_over_reserved_slot(q, {}, procs, task_id="a", turn_id="1", token=old.token, me=stale_child)


async def test_token_current_child_takes_over_dead_parent_without_a_second_spawn(tmp_path, procs, tokens):
    """The parent spawned the child and died before complete_runner_spawn.  The child, with
    the current token, takes the slot over and finishes the handoff itself; a reconcile that
    follows spawns nothing."""
    parent, child, reconciler = procs.spawn(), procs.spawn(), procs.spawn()
    cdir = ClientDir(tmp_path / "c", observe=procs)
    spawned = []
    async with trio.open_nursery() as n:
        queue = await open_queue(n, cdir)
        tc_parent = TaskClient(cdir, queue, fleet(1), me=parent, spawner=lambda *a: spawned.append(a) or child,
                               token_source=tokens)
        task_id, turn_id = await tc_parent.create_task(str(tmp_path), ["true"])
        got = await queue.locked(lambda L: reserve(L.queue, L.runners, L.observe, tokens, (task_id, turn_id),
                                                   parent, cap=1))
        procs.kill(parent)
        tc_child = TaskClient(cdir, queue, fleet(1), me=child, token_source=tokens)
        await take_over_reserved_slot(tc_child, task_id, turn_id, got.token)
        row = core.find_row(cdir.read_queue(), task_id, turn_id)
        assert row.owner == child and row.slot_reservation is None
        assert cdir.read_runners()[task_id].identity == child
        tc_rec = TaskClient(cdir, queue, fleet(1), me=reconciler, spawner=lambda *a: spawned.append(a) or child,
                            token_source=tokens)
        assert await tc_rec.reconcile() == []
        assert spawned == []
        n.cancel_scope.cancel()


def test_released_then_reused_job_rejects_the_old_token(procs, tokens):
    """A failed spawn releases its reservation; the next reservation of the same job has a
    new token and the old one can neither bind, complete, nor take over."""
    r = procs.spawn()
    q = queue_with(("a", "1"), owner=r)
    first = reserve(q, {}, procs, tokens, ("a", "1"), r, cap=1)
    assert core.release_runner_slot(q, task_id="a", turn_id="1", token=first.token, reserver=r)
    assert core.find_row(q, "a", "1").slot_reservation is None
    second = reserve(q, {}, procs, tokens, ("a", "1"), r, cap=1)
    assert second.acquired and second.token != first.token
    child = procs.spawn()
    with pytest.raises(core.QueueError) as err:
        core.bind_runner_slot_child(q, task_id="a", turn_id="1", token=first.token, child=child)
    assert err.value.code == core.QUEUE_SLOT_TOKEN_MISMATCH
    with pytest.raises(core.QueueError):
        core.take_over_reserved_slot(q, {}, procs, task_id="a", turn_id="1", token=first.token, me=child)
    # after bind, release is a no-op (a failed complete never drops a live child)
    core.bind_runner_slot_child(q, task_id="a", turn_id="1", token=second.token, child=child)
    assert not core.release_runner_slot(q, task_id="a", turn_id="1", token=second.token, reserver=r)
    assert core.find_row(q, "a", "1").slot_reservation.child == child
    assert len(set(tokens.issued)) == len(tokens.issued) == 2


def test_old_queue_snapshot_without_slot_reservation_deserializes():
    """Queue JSON from before the field loads; canonical output omits it when None and
    writes it exactly as the seed's JSON when present; a nil token is refused."""
    old = b'{"version":1,"next_queue_id":2,"entries":[{"queue_id":1,"task_id":"a","turn_id":"1",' \
          b'"enqueued_at_millis":5,"state":"parked"}]}'
    q = decode(old, QueueFile)
    assert q.entries[0].slot_reservation is None
    assert b"slot_reservation" not in encode(q)
    seed = {"reserver": {"pid": 1, "start_time_micros": 1},
            "token": "018f0f4a-6b5c-7d8e-9f00-112233445566",
            "child": {"pid": 2, "start_time_micros": 2}}
    res = msgspec.json.decode(json.dumps(seed).encode(), type=RunnerSlotReservation)
    assert res.token == uuid.UUID("018f0f4a-6b5c-7d8e-9f00-112233445566")
    assert json.loads(msgspec.json.encode(res)) == seed
    unbound = RunnerSlotReservation.new(ProcessIdentity(pid=1, start_time_micros=1), res.token)
    assert json.loads(msgspec.json.encode(unbound)) == {k: v for k, v in seed.items() if k != "child"}
    with pytest.raises(ValueError):
        RunnerSlotReservation.new(ProcessIdentity(pid=1, start_time_micros=1), NIL_TOKEN)
    nil = dict(seed, token="00000000-0000-0000-0000-000000000000")
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(json.dumps(nil).encode(), type=RunnerSlotReservation)


def test_recovered_dispatch_owner_without_token_or_runner_may_acquire(procs, tokens):
    """Reconcile adopted a row onto the controller before spawning (a Dispatching owner that
    is not a runner): reserving that row as that controller does not count its own holder,
    while any other process sees a live foreign holder (Pending nil)."""
    controller, other = procs.spawn(), procs.spawn()
    q = queue_with(("a", "1"), owner=procs.spawn())
    core.begin_dispatch(q, task_id="a", turn_id="1", me=core.find_row(q, "a", "1").owner, worker="mini-1")
    row = core.find_row(q, "a", "1")
    row.dispatch_owner = controller
    assert core.occupied_runner_slots_locked(q, {}, procs) == 1
    out = reserve(q, {}, procs, tokens, ("a", "1"), other, cap=1)
    assert (out.kind, out.step) == ("pending", 3)
    got = reserve(q, {}, procs, tokens, ("a", "1"), controller, cap=1)
    assert (got.kind, got.step) == ("acquired", 5)
    # the exception is per reserving row only: another row still counts the controller
    q2 = queue_with(("a", "1"), ("b", "1"), owner=procs.spawn())
    core.find_row(q2, "a", "1").state = "dispatching"
    core.find_row(q2, "a", "1").dispatch_owner = controller
    assert reserve(q2, {}, procs, tokens, ("b", "1"), controller, cap=1).kind == "saturated"


def test_duplicate_enqueue_and_backwards_time_do_not_mutate_fifo_state(procs):
    owner = procs.spawn()
    q = QueueFile()
    a = core.enqueue(q, task_id="a", turn_id="1", owner=owner, now_ms=2000)
    before = encode(q)
    again = core.enqueue(q, task_id="a", turn_id="1", owner=procs.spawn(), now_ms=9999)
    assert again is a and encode(q) == before
    b = core.enqueue(q, task_id="b", turn_id="1", owner=owner, now_ms=1500)   # the clock went back
    assert (b.queue_id, b.enqueued_at_millis) == (2, 2000)
    q.entries.remove(a)
    q.entries.remove(b)                               # rows leave; the clock does not go back
    c = core.enqueue(q, task_id="c", turn_id="1", owner=owner, now_ms=100)
    assert (c.queue_id, c.enqueued_at_millis) == (3, 2000)
    assert [e.queue_id for e in core.fifo(q)] == [3]


def test_concurrent_enqueue_coalesces_inverted_clocks(tmp_path, procs):
    """Two processes enqueue at once with inverted clocks: the one whose clock reads later
    takes the QueueLock first (barrier), the other blocks on the lock and then enqueues with
    an earlier clock.  FIFO (queue_id) follows the lock order, enqueued_at_millis never
    decreases along it."""
    root = tmp_path / "c"
    first_holds = threading.Event()
    release_first = threading.Event()
    results = {}

    def late_clock():
        cdir = ClientDir(root, observe=procs)

        def fn(L):
            row = core.enqueue(L.queue, task_id="late", turn_id="1", owner=procs.spawn(), now_ms=5000)
            first_holds.set()
            assert release_first.wait(30)
            return row.queue_id, row.enqueued_at_millis

        results["late"] = cdir.critical(fn)

    def early_clock():
        cdir = ClientDir(root, observe=procs)
        assert first_holds.wait(30)
        results["early"] = cdir.critical(lambda L: (
            lambda r: (r.queue_id, r.enqueued_at_millis))(
            core.enqueue(L.queue, task_id="early", turn_id="1", owner=procs.spawn(), now_ms=3000)))

    ClientDir(root).ensure()
    t1 = threading.Thread(target=late_clock)
    t2 = threading.Thread(target=early_clock)
    t1.start()
    t2.start()
    assert first_holds.wait(30)
    assert "early" not in results       # the second holder is blocked on the lock
    release_first.set()
    t1.join(30)
    t2.join(30)
    assert results == {"late": (1, 5000), "early": (2, 5000)}
    q = ClientDir(root).read_queue()
    assert [(e.task_id, e.enqueued_at_millis) for e in core.fifo(q)] == [("late", 5000), ("early", 5000)]


# --- through the task client's shell -----------------------------------------------------


async def test_submit_completes_handoff_after_bind_records_the_child(tmp_path, procs, tokens):
    """Submit: reserve, spawn (outside the lock), then complete_runner_spawn: the child is
    bound and published while the reservation is still there (observed by a spawner that
    reads the file as the child would), then task.runner is the child and the token is gone."""
    me = procs.spawn()
    cdir = ClientDir(tmp_path / "c", observe=procs)
    child = procs.spawn()
    seen = {}

    def spawner(task_id, turn_id, token):
        row = core.find_row(cdir.read_queue(), task_id, turn_id)
        seen["during_spawn"] = (row.slot_reservation.token, row.slot_reservation.child)
        return child

    async with trio.open_nursery() as n:
        queue = await open_queue(n, cdir)
        tc = TaskClient(cdir, queue, fleet(2), me=me, spawner=spawner, token_source=tokens)
        task_id, turn_id = await tc.create_task(str(tmp_path), ["true"])
        result = await tc.start_turn(task_id, turn_id)
        n.cancel_scope.cancel()
    assert result.outcome == "spawned" and result.child == child
    assert seen["during_spawn"] == (tokens.issued[0], None)   # spawned before bind, outside the lock
    row = core.find_row(cdir.read_queue(), task_id, turn_id)
    assert row.state == "waiting" and row.owner == child and row.enqueue_owner == me
    assert row.slot_reservation is None
    assert cdir.read_runners()[task_id] == RunnerRecord(identity=child, turn_id=turn_id)
    assert core.occupied_runner_slots_locked(cdir.read_queue(), cdir.read_runners(), procs) == 1


async def test_interrupted_legacy_reassignment_recovers_from_an_unrelated_working_directory(
        tmp_path, procs, tokens, monkeypatch):
    """Seed 001: a waiting runner donates its process to a LEGACY parked task (no saved
    context, its record's project relative to the runner's cwd) of the same worktree: the
    donor's saved context is inherited (made durable before the queue moves), the queue
    publishes, and the runner is interrupted before its runner metadata moves.  Reconcile,
    run from an unrelated working directory (which holds a decoy `project`), spawns nothing
    while the interrupted owner lives (also not when the interrupted process reconciles
    itself: exclude_reserver false), and exactly one runner once it is gone; the recovered
    turn executes the inherited worktree, never the reconciler's cwd."""
    from motor.tasks import context, sections
    from motor.tasks.host import resolve_project
    from motor.tasks.sections import claim_locked

    base = tmp_path / "base"
    project = base / "project"
    project.mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "project").mkdir(parents=True)      # a decoy with the legacy relative name
    monkeypatch.chdir(base)
    busy, interrupted = procs.spawn(), procs.spawn()
    cdir = ClientDir(tmp_path / "c", observe=procs)
    fl = Fleet((WorkerSpec("mini-1", "unix:/nonexistent/1.sock"), WorkerSpec("mini-2", "unix:/nonexistent/2.sock")))
    async with trio.open_nursery() as n:
        queue = await open_queue(n, cdir)
        submitter = TaskClient(cdir, queue, fl, me=procs.spawn(), token_source=tokens)
        active, _ = await submitter.create_task(str(project), ["sleep", "1"], pin="mini-1")
        donor, _ = await submitter.create_task(str(project), ["true"], pin="mini-1")
        legacy, _ = await submitter.create_task("project", ["make"], pin="mini-2")
        n.cancel_scope.cancel()
    context.remove_task_context(cdir.turns_dir, legacy)             # a record from before contexts

    def place(L):
        a = core.require_row(L.queue, active, "1")
        a.state, a.dispatch_owner, a.worker = "dispatching", busy, "mini-1"
        d = core.require_row(L.queue, donor, "1")
        d.owner = interrupted
        L.set_runner(donor, RunnerRecord(identity=interrupted, turn_id="1"))
        core.park(L.queue, task_id=legacy, turn_id="1")
    cdir.critical(place)
    monkeypatch.setenv("MOTOR_TASK_FAULT", "reassign_after_publish:raise")
    ok = {"capacity": {}}
    with pytest.raises(OSError):
        cdir.critical(lambda L: claim_locked(L, fl, donor, "1", interrupted, {"mini-1": ok, "mini-2": ok},
                                             reassign=True))
    monkeypatch.delenv("MOTOR_TASK_FAULT")
    q = cdir.read_queue()
    assert core.find_row(q, donor, "1").state == "parked"
    assert core.find_row(q, legacy, "1").dispatch_owner == interrupted
    assert context.task_project_path(cdir.turns_dir, legacy, "project") == project   # inherited, durable
    monkeypatch.chdir(elsewhere)
    assert cdir.critical(lambda L: sections.reconcile_plan(L, interrupted, 2, {}, tokens)) == []
    assert cdir.critical(lambda L: sections.reconcile_plan(L, procs.spawn(), 2, {}, tokens)) == []
    procs.kill(interrupted)
    starts = cdir.critical(lambda L: sections.reconcile_plan(L, procs.spawn(), 2, {}, tokens))
    assert [(t, u) for t, u, _ in starts] == [(legacy, "1")]
    assert resolve_project(cdir, cdir.read_task(legacy)) == project                  # not elsewhere/
    assert cdir.read_task(legacy).project == "project"      # the record keeps its opaque legacy value
    assert donor not in cdir.read_runners()                  # the dead runner's record was cleared


async def test_reconcile_replaces_a_dead_runner_for_an_active_task_turn(tmp_path, procs, tokens):
    """The runner of a dispatched turn dies (its job id known); reconcile reserves, spawns
    exactly one replacement and hands the row to it; the row keeps its worker and job id
    (the replacement re-attaches instead of running the command again)."""
    cdir = ClientDir(tmp_path / "c", observe=procs)
    dead_runner, replacement = procs.spawn(), procs.spawn()
    spawned = []
    async with trio.open_nursery() as n:
        queue = await open_queue(n, cdir)
        sub = TaskClient(cdir, queue, fleet(2), me=procs.spawn(), token_source=tokens)
        task_id, turn_id = await sub.create_task(str(tmp_path), ["make"])

        def dispatched(L):
            row = core.find_row(L.queue, task_id, turn_id)
            row.owner = dead_runner
            core.begin_dispatch(L.queue, task_id=task_id, turn_id=turn_id, me=dead_runner, worker="mini-2")
            row.job_id = "job-1"
            L.set_runner(task_id, RunnerRecord(identity=dead_runner, turn_id=turn_id))

        await queue.locked(dispatched)
        rec = TaskClient(cdir, queue, fleet(2), me=procs.spawn(),
                         spawner=lambda t, u, tok: spawned.append((t, u, tok)) or replacement, token_source=tokens)
        assert await rec.reconcile() == []          # runner alive: nothing to replace
        procs.kill(dead_runner)
        results = await rec.reconcile()
        assert [r.outcome for r in results] == ["spawned"]
        assert await rec.reconcile() == []          # replaced once, never twice
        n.cancel_scope.cancel()
    assert [(t, u) for t, u, _ in spawned] == [(task_id, turn_id)]
    row = core.find_row(cdir.read_queue(), task_id, turn_id)
    assert (row.worker, row.job_id, row.owner, row.slot_reservation) == ("mini-2", "job-1", replacement, None)
    assert cdir.read_runners()[task_id].identity == replacement


def test_a_critical_section_that_publishes_twice_excludes_other_processes_in_between(tmp_path, procs):
    """complete_runner_spawn publishes twice inside one QueueLock hold.  A second process
    (its own open file and lock) must not get in between the two publishes, or one of the
    two updates would be lost."""
    root = tmp_path / "c"
    ClientDir(root).ensure()
    between = threading.Event()
    go_on = threading.Event()
    done = {}

    def twice():
        def fn(L):
            core.enqueue(L.queue, task_id="a", turn_id="1", owner=procs.spawn(), now_ms=1)
            L.publish()                                   # first publish
            between.set()
            assert go_on.wait(30)
            core.enqueue(L.queue, task_id="b", turn_id="1", owner=procs.spawn(), now_ms=2)

        ClientDir(root, observe=procs).critical(fn)

    def other():
        assert between.wait(30)
        ClientDir(root, observe=procs).critical(
            lambda L: core.enqueue(L.queue, task_id="c", turn_id="1", owner=procs.spawn(), now_ms=3))
        done["other"] = True

    t1, t2 = threading.Thread(target=twice), threading.Thread(target=other)
    t1.start()
    t2.start()
    assert between.wait(30)
    t2.join(0.5)                    # bounded: it must still be blocked on the lock
    blocked = t2.is_alive() and "other" not in done
    go_on.set()
    t1.join(30)
    t2.join(30)
    assert blocked
    assert sorted(e.task_id for e in ClientDir(root).read_queue().entries) == ["a", "b", "c"]


def _flock_waiters(path) -> int:
    """Processes blocked in flock on the file or directory at `path` (/proc/locks)."""
    wanted = locks.proc_locks_id(path)
    with open("/proc/locks") as proc_locks:
        return sum(1 for line in proc_locks if "->" in line and line.split()[6] == wanted)


def test_a_removed_lock_file_lets_no_second_critical_section_in(tmp_path, procs):
    """`rm queue.json.lock` while a critical section runs (a "stale lock" cleaned by hand):
    a second section, which opens a new lock file, must still wait for the first; the
    client dir's own lock keeps it out (docs/tasks.md, "Client state")."""
    root = tmp_path / "c"
    ClientDir(root).ensure()
    inside, go_on, order = threading.Event(), threading.Event(), []

    def first(L):
        order.append("first in")
        inside.set()
        assert go_on.wait(30)
        core.enqueue(L.queue, task_id="a", turn_id="1", owner=procs.spawn(), now_ms=1)
        order.append("first out")

    def second(L):
        order.append("second in")
        core.enqueue(L.queue, task_id="b", turn_id="1", owner=procs.spawn(), now_ms=2)

    t1 = threading.Thread(target=ClientDir(root, observe=procs).critical, args=(first,))
    t1.start()
    assert inside.wait(30)
    (root / "queue.json.lock").unlink()
    t2 = threading.Thread(target=ClientDir(root, observe=procs).critical, args=(second,))
    t2.start()
    deadline = time.monotonic() + 30
    while not _flock_waiters(root) and "second in" not in order and time.monotonic() < deadline:
        time.sleep(0.005)
    assert order == ["first in"]  # the second waits on the client dir's lock
    go_on.set()
    t1.join(30)
    t2.join(30)
    assert order == ["first in", "first out", "second in"]
    assert sorted(e.task_id for e in ClientDir(root).read_queue().entries) == ["a", "b"]


def test_where_the_client_dir_cannot_be_locked_the_lock_file_alone_holds(tmp_path, procs,
                                                                        monkeypatch):
    real, dirs = fcntl.flock, []

    def flock(fd, op):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            dirs.append(fd)
            raise OSError(95, "Operation not supported")  # as NFS answers for a directory
        return real(fd, op)

    monkeypatch.setattr(locks.fcntl, "flock", flock)
    cdir = ClientDir(tmp_path / "c", observe=procs)
    cdir.critical(lambda L: core.enqueue(L.queue, task_id="a", turn_id="1", owner=procs.spawn(),
                                         now_ms=1))
    assert dirs and [e.task_id for e in cdir.read_queue().entries] == ["a"]
