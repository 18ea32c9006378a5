"""Seed 001 (waiting runner reassignment): one test per Acceptance bullet.

Every decision is one QueueLock critical section (`claim_locked`, run through a real
ClientDir: real flock, real files).  Process identities are the conftest fixture whose
liveness the test controls; worker observations are health-report dicts handed to the claim
(what the runner's /v1/health probes return); where the runner itself is driven, the probe is
injected (TaskClient(probe=...)) as such an observation fixture.  Races are staged with a
threading.Barrier; no sleeps.  The saturated pool end to end, with real `motor serve`
workers, is in test_fleet_e2e.py."""

from __future__ import annotations

import base64
import os
import stat
import subprocess
import sys
import threading

import pytest

from motor.tasks import context, core, host
from motor.tasks.client import TaskClient
from motor.tasks.detached import detached_runner, host_turn
from motor.tasks.queue import open_queue
from motor.tasks.records import RunnerRecord, encode
from motor.tasks.sections import claim_locked, reconcile_plan
from motor.tasks.store import ClientDir
from motor.tasks.workers import Fleet, WorkerSpec
from tests.conftest import ROOT, motor_env

OK = {"capacity": {"pending_jobs": 0, "held_permits": 0}}


def fleet(caps: dict[str, tuple[str, ...]] | None = None, **max_parallel) -> Fleet:
    caps = caps or {}
    return Fleet(tuple(WorkerSpec(n, f"unix:/nonexistent/{n}.sock", capabilities=caps.get(n, ()))
                       for n in ("mini-1", "mini-2")), dict(max_parallel))


class Pool:
    """A client dir with tasks created by the real TaskClient (context, record, row), then
    placed in the states a scenario needs, each placement one critical section."""

    def __init__(self, cdir: ClientDir, tc: TaskClient, fl: Fleet):
        self.cdir, self.tc, self.fleet = cdir, tc, fl

    async def task(self, project, *, pin=None, run=None, caps=None) -> str:
        t, _ = await self.tc.create_task(str(project), ["true"], pin=pin, run=run, capabilities=caps)
        return t

    def set(self, task_id, *, state, owner=None, worker=None, runner=None):
        def fn(L):
            row = core.require_row(L.queue, task_id, "1")
            row.state = state
            row.owner = owner if state == "waiting" else None
            row.dispatch_owner = owner if state == "dispatching" else None
            row.worker = worker
            if runner is not None:
                L.set_runner(task_id, RunnerRecord(identity=runner, turn_id="1"))
        self.cdir.critical(fn)

    def claim(self, task_id, me, observations, *, reassign=True):
        return self.cdir.critical(lambda L: claim_locked(L, self.fleet, task_id, "1", me, observations,
                                                          reassign=reassign))

    def row(self, task_id):
        return core.find_row(self.cdir.read_queue(), task_id, "1")


@pytest.fixture
async def pool(tmp_path, procs, tokens, nursery):
    cdir = ClientDir(tmp_path / "c", observe=procs)
    queue = await open_queue(nursery, cdir)
    fl = fleet()
    tc = TaskClient(cdir, queue, fl, me=procs.spawn(), token_source=tokens,
                    spawner=lambda t, u, tok: procs.spawn())
    (tmp_path / "project").mkdir()
    return Pool(cdir, tc, fl)


async def saturated(pool: Pool, procs, project):
    """Active mini-1 turn (runner ra), a mini-1 waiter adopted by runner rb, a parked mini-1
    task and a parked mini-2 task."""
    ra, rb = procs.spawn(), procs.spawn()
    a = await pool.task(project, pin="mini-1")
    b = await pool.task(project, pin="mini-1")
    c = await pool.task(project, pin="mini-1")
    d = await pool.task(project, pin="mini-2")
    pool.set(a, state="dispatching", owner=ra, worker="mini-1", runner=ra)
    pool.set(b, state="waiting", owner=rb, runner=rb)
    pool.set(c, state="parked")
    pool.set(d, state="parked")
    return ra, rb, a, b, c, d


async def test_saturated_pool_runs_a_parked_mini2_task_with_a_donor_pid(pool, procs, tmp_path):
    ra, rb, a, b, c, d = await saturated(pool, procs, tmp_path / "project")
    # the pinned runner first tries its own worker: busy, so nothing moves
    assert pool.claim(b, rb, {"mini-1": OK}).kind == "wait"
    assert pool.row(b).state == "waiting" and pool.row(d).state == "parked"
    # parked work exists: it observes the rest of the fleet, keeping mini-1's observation
    got = pool.claim(b, rb, {"mini-1": OK, "mini-2": OK})
    assert (got.kind, got.task_id, got.worker) == ("move", d, "mini-2")
    q = pool.cdir.read_queue()
    donor, rec = core.find_row(q, b, "1"), core.find_row(q, d, "1")
    assert donor.state == "parked" and donor.owner is None and donor.pin == "mini-1"
    assert (rec.state, rec.dispatch_owner, rec.owner, rec.worker) == ("dispatching", rb, rb, "mini-2")
    assert [e.queue_id for e in q.entries] == sorted(e.queue_id for e in q.entries)  # ids unchanged
    runners = pool.cdir.read_runners()
    assert runners[d] == RunnerRecord(identity=rb, turn_id="1") and b not in runners
    assert core.occupied_runner_slots_locked(q, runners, procs) == 2      # no process was added
    assert core.find_row(q, c, "1").state == "parked"
    turn = pool.cdir.read_task(d).turns[0]
    assert turn.donated_from == b and turn.worker == "mini-2"
    shown = subprocess.run([sys.executable, "-m", "motor", "task", "--client-dir", str(pool.cdir.root), "show", d],
                           capture_output=True, env=motor_env(), cwd=ROOT, timeout=60)
    assert shown.returncode == 0, shown.stderr.decode()
    assert f"ran on the runner process donated by task {b}" in shown.stdout.decode()


async def test_displaced_older_task_regains_priority_when_its_worker_frees(pool, procs, tmp_path):
    ra, rb, a, b, c, d = await saturated(pool, procs, tmp_path / "project")
    assert pool.claim(b, rb, {"mini-1": OK, "mini-2": OK}).kind == "move"   # b displaced by d
    # a's turn ends; a runner rc now owns the YOUNGER mini-1 task c and mini-1 is free:
    # b (older, parked, runnable on mini-1) is a FIFO barrier, so rc runs b, not c
    rc = procs.spawn()
    pool.cdir.critical(lambda L: (core.drop_rows(L.queue, a), L.set_runner(a, None)))
    pool.set(c, state="waiting", owner=rc, runner=rc)
    got = pool.claim(c, rc, {"mini-1": OK})
    assert (got.kind, got.task_id, got.worker) == ("move", b, "mini-1")
    assert pool.row(b).dispatch_owner == rc and pool.row(c).state == "parked"
    # and a finishing runner's next parked turn is the oldest: c now waits behind nobody
    assert core.oldest_parked(pool.cdir.read_queue()).task_id == c
    # b's runner is back in the wait for mini-1 beside a younger waiter: the older goes first
    rx = procs.spawn()
    pool.set(b, state="waiting", owner=rc, runner=rc)
    pool.set(c, state="waiting", owner=rx, runner=rx)
    assert pool.claim(c, rx, {"mini-1": OK}).kind == "wait"
    got = pool.claim(b, rc, {"mini-1": OK})
    assert (got.kind, got.worker) == ("keep", "mini-1")
    procs.kill(rx)
    pool.cdir.critical(lambda L: L.set_runner(c, None))
    # an eligible donor with no older runnable turn keeps its own turn
    rd = procs.spawn()
    e = await pool.task(tmp_path / "project", pin="mini-2")
    pool.cdir.critical(lambda L: (core.drop_rows(L.queue, d), core.drop_rows(L.queue, c)))
    pool.set(e, state="waiting", owner=rd, runner=rd)
    got = pool.claim(e, rd, {"mini-2": OK})
    assert (got.kind, got.worker) == ("keep", "mini-2") and pool.row(e).state == "dispatching"


async def test_ineligible_recipients_never_block_an_unrelated_eligible_task(tmp_path, procs, tokens, nursery):
    fl = fleet({"mini-1": ("gpu",)}, nightly=1)
    cdir = ClientDir(tmp_path / "c", observe=procs)
    queue = await open_queue(nursery, cdir)
    tc = TaskClient(cdir, queue, fl, me=procs.spawn(), token_source=tokens)
    pool = Pool(cdir, tc, fl)
    project, other = tmp_path / "project", tmp_path / "other"
    project.mkdir(), other.mkdir()
    ra, rb, enqueuer = procs.spawn(), procs.spawn(), procs.spawn()
    busy = await pool.task(project, pin="mini-1", run="nightly")
    donor = await pool.task(project, pin="mini-1")
    head = await pool.task(project)                        # incomplete submission head ...
    later = await tc.add_turn(head, ["make"])              # ... its turn 2 is parked behind it
    gpu = await pool.task(project, caps=["gpu"])           # incompatible with mini-2
    reserved = await pool.task(project)                    # a spawn is in progress for it
    capped = await pool.task(project, run="nightly")       # run cap 1 already in flight
    legacy = await pool.task(other)                        # legacy, another worktree
    context.remove_task_context(cdir.turns_dir, legacy)
    young = await pool.task(project)                       # the unrelated eligible task
    pool.set(busy, state="dispatching", owner=ra, worker="mini-1", runner=ra)
    pool.set(donor, state="waiting", owner=rb, runner=rb)

    def place(L):
        core.require_row(L.queue, head, "1").owner = enqueuer
        core.require_row(L.queue, head, "1").enqueue_owner = enqueuer
        core.park(L.queue, task_id=head, turn_id=later)
        for t in (gpu, reserved, capped, legacy, young):
            core.park(L.queue, task_id=t, turn_id="1")
        r = core.reserve_runner_slot(L.queue, L.runners, L.observe, task_id=reserved, turn_id="1",
                                     reserver=procs.spawn(), cap=99, new_token=tokens)
        assert r.acquired
    cdir.critical(place)
    before = {e.key: encode(e) for e in cdir.read_queue().entries if e.task_id != young and e.task_id != donor}
    got = pool.claim(donor, rb, {"mini-1": OK, "mini-2": OK})
    assert (got.kind, got.task_id, got.worker) == ("move", young, "mini-2")
    after = {e.key: encode(e) for e in cdir.read_queue().entries if e.key in before}
    assert after == before                                 # nothing ineligible was touched
    assert core.find_row(cdir.read_queue(), reserved, "1").slot_reservation is not None


async def test_concurrent_donors_select_a_recipient_once(pool, procs, tmp_path):
    ra, rb, a, b, c, d = await saturated(pool, procs, tmp_path / "project")
    rc = procs.spawn()
    pool.set(c, state="waiting", owner=rc, runner=rc)
    barrier = threading.Barrier(2)
    results = {}

    def donor(task_id, me):
        cdir = ClientDir(pool.cdir.root, observe=procs)       # its own lock fd: another "process"
        barrier.wait(timeout=30)
        results[task_id] = cdir.critical(
            lambda L: claim_locked(L, pool.fleet, task_id, "1", me, {"mini-1": OK, "mini-2": OK}, reassign=True))

    threads = [threading.Thread(target=donor, args=args) for args in ((b, rb), (c, rc))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    kinds = sorted(r.kind for r in results.values())
    assert kinds == ["move", "wait"], results
    winner = next(k for k, r in results.items() if r.kind == "move")
    loser = c if winner == b else b
    q = pool.cdir.read_queue()
    assert core.find_row(q, d, "1").dispatch_owner == (rb if winner == b else rc)
    assert core.find_row(q, loser, "1").state == "waiting"
    assert core.find_row(q, winner, "1").state == "parked"
    assert len(core.unique_live_identities(q, pool.cdir.read_runners(), procs)) == 3


async def test_stale_owners_and_cancellation_cannot_move_another_owners_work(pool, procs, tmp_path):
    ra, rb, a, b, c, d = await saturated(pool, procs, tmp_path / "project")
    snapshot = pool.cdir.queue_path.read_bytes()
    obs = {"mini-1": OK, "mini-2": OK}
    stale = procs.recycle(rb)                   # the same pid, another process: not the owner
    procs.alive.add(rb)
    for who, task_id in ((stale, b), (ra, b), (rb, a), (pool.tc.me, b)):
        # a recycled pid, another runner, a dispatching turn, the enqueuer of an adopted row
        with pytest.raises(core.QueueError) as err:
            pool.claim(task_id, who, obs)
        assert err.value.code == core.QUEUE_NOT_OWNER
    assert pool.cdir.queue_path.read_bytes() == snapshot
    # the parked recipient is cancelled: it leaves the queue, nothing moves to it
    await pool.tc.cancel(d)
    assert pool.row(d) is None and pool.claim(b, rb, obs).kind == "wait"
    # a donor whose own task is being cancelled does not donate
    e = await pool.task(tmp_path / "project", pin="mini-2")
    pool.set(e, state="parked")
    await pool.tc.cancel(b)
    assert pool.row(b).cancel_requested
    assert pool.claim(b, rb, obs).kind == "wait" and pool.row(e).state == "parked"


async def test_failed_post_publication_update_keeps_recoverable_ownership(pool, procs, tmp_path, tokens,
                                                                         monkeypatch):
    ra, rb, a, b, c, d = await saturated(pool, procs, tmp_path / "project")

    async def observed(spec, timeout=5.0):   # the workers' health reports (an observation fixture)
        return OK
    monkeypatch.setenv("MOTOR_TASK_FAULT", "reassign_after_publish:raise")
    # rb is the detached runner of b (it took b over on a reserved slot)
    pool.set(b, state="parked")
    pool.cdir.critical(lambda L: L.set_runner(b, None))
    token = pool.cdir.critical(lambda L: core.reserve_runner_slot(
        L.queue, L.runners, L.observe, task_id=b, turn_id="1", reserver=pool.tc.me, cap=99,
        new_token=tokens).token)
    runner_tc = TaskClient(pool.cdir, pool.tc.queue, pool.fleet, me=rb, token_source=tokens, probe=observed)
    assert await detached_runner(runner_tc, b, "1", token) == 1           # it exits with an error
    q = pool.cdir.read_queue()
    assert core.find_row(q, b, "1").state == "parked"                     # published ...
    assert core.find_row(q, d, "1").dispatch_owner == rb                  # ... and durable
    runners = pool.cdir.read_runners()
    assert d not in runners and runners[b].identity == rb                 # metadata not moved
    monkeypatch.delenv("MOTOR_TASK_FAULT")
    # while rb lives: a live queue owner with missing runner metadata, counted once
    assert core.occupied_runner_slots_locked(q, runners, procs) == 2
    assert pool.cdir.critical(lambda L: reconcile_plan(L, procs.spawn(), 2, {}, tokens)) == []
    procs.kill(rb)                                                        # the process exited
    starts = pool.cdir.critical(lambda L: reconcile_plan(L, procs.spawn(), 2, {}, tokens))
    assert [(t, u) for t, u, _ in starts] == [(d, "1")]                    # one replacement, for d
    assert b not in pool.cdir.read_runners()


def git(*args, cwd):
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                   env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
                        "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"})


async def test_cross_project_and_linked_worktree_use_the_recipients_context(pool, procs, tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    repo.mkdir()
    git("init", "-q", "-b", "main", cwd=repo)
    (repo / "file").write_text("main\n")
    git("add", "file", cwd=repo)
    git("commit", "-qm", "one", cwd=repo)
    linked = tmp_path / "linked"
    git("worktree", "add", "-q", "-b", "side", str(linked), cwd=repo)
    (linked / "file").write_text("linked worktree\n")
    unrelated = tmp_path / "elsewhere"
    unrelated.mkdir()
    (unrelated / "file").write_text("decoy\n")
    monkeypatch.chdir(unrelated)
    ra, rb = procs.spawn(), procs.spawn()
    a = await pool.task(tmp_path / "project", pin="mini-1")
    b = await pool.task(tmp_path / "project", pin="mini-1")
    d = await pool.task(linked, pin="mini-2")                 # another project: a linked worktree
    pool.set(a, state="dispatching", owner=ra, worker="mini-1", runner=ra)
    pool.set(b, state="waiting", owner=rb, runner=rb)
    pool.set(d, state="parked")
    # the owner-only context: 0600 in 0700, Unix path bytes as base64, bound to its ids
    ctx_file = pool.cdir.turns_dir / d / "project.json"
    assert stat.S_IMODE(ctx_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(ctx_file.parent.stat().st_mode) == 0o700
    ctx = context.read_task_context(pool.cdir.turns_dir, d)
    assert base64.b64decode(ctx.path_b64) == os.fsencode(str(linked.resolve()))
    main_ctx = context.make_context("x", "", repo.resolve())
    assert ctx.repository_id == main_ctx.repository_id and ctx.worktree_id != main_ctx.worktree_id
    assert str(linked) not in pool.cdir.queue_path.read_text()   # public JSON: opaque ids only
    assert pool.claim(b, rb, {"mini-1": OK, "mini-2": OK}).task_id == d
    # execution (and the bundle it uploads) use the recipient's saved worktree, not the cwd
    project = host.resolve_project(pool.cdir, pool.cdir.read_task(d))
    assert project == linked.resolve()
    bundle, _ = host.make_bundle(project, tmp_path / "bundles")
    import tarfile
    with tarfile.open(bundle) as tf:
        assert tf.extractfile("file").read() == b"linked worktree\n"
    # a redirected worktree (now a symlink) or a tampered/redirected context is refused
    moved = tmp_path / "moved"
    linked.rename(moved)
    linked.symlink_to(moved)
    with pytest.raises(context.ContextError) as err:
        host.resolve_project(pool.cdir, pool.cdir.read_task(d))
    assert err.value.code == context.CONTEXT_REDIRECTED
    ctx_file.write_bytes(ctx_file.read_bytes().replace(b'{"version"', b'{ "version"'))
    with pytest.raises(context.ContextError) as err:
        context.read_task_context(pool.cdir.turns_dir, d)
    assert err.value.code == context.CONTEXT_INVALID
    elsewhere_dir = tmp_path / "ctxdir"
    (pool.cdir.turns_dir / b).rename(elsewhere_dir)
    (pool.cdir.turns_dir / b).symlink_to(elsewhere_dir)
    with pytest.raises(context.ContextError) as err:
        context.read_task_context(pool.cdir.turns_dir, b)
    assert err.value.code == context.CONTEXT_REDIRECTED


async def test_submission_rollback_removes_the_context(pool, procs, tmp_path, monkeypatch):
    monkeypatch.setenv("MOTOR_TASK_FAULT", "submit_after_context:raise")
    with pytest.raises(OSError):
        await pool.task(tmp_path / "project")
    assert list(pool.cdir.turns_dir.iterdir()) == [] and pool.cdir.list_tasks() == []
    assert pool.cdir.read_queue().entries == []


async def test_attached_execution_never_changes_tasks(pool, procs, tmp_path, monkeypatch):
    ra = procs.spawn()
    a = await pool.task(tmp_path / "project", pin="mini-1")
    d = await pool.task(tmp_path / "project", pin="mini-2")
    mine, _ = await pool.tc.create_task(str(tmp_path / "project"), ["true"], pin="mini-1", attached=True)
    pool.set(a, state="dispatching", owner=ra, worker="mini-1", runner=ra)
    pool.set(d, state="parked")
    pool.cdir.critical(lambda L: core.require_row(L.queue, mine, "1").__setattr__("owner", pool.tc.me))

    async def observed(spec, timeout=5.0):
        return OK
    monkeypatch.setattr(pool.tc, "probe", observed)
    before_d = encode(pool.row(d))
    # the claim itself refuses an attached donor, and without opt-in it never moves
    with pytest.raises(core.QueueError):
        pool.claim(mine, pool.tc.me, {"mini-1": OK, "mini-2": OK})
    runner = await host_turn(pool.tc, mine, "1", reassign=False)   # what run_turn does
    assert (runner.task_id, runner.donations) == (mine, [])
    turn = pool.cdir.read_task(mine).turns[0]
    assert turn.worker == "mini-1" and turn.donated_from is None  # dispatched to its own (busy) worker
    assert encode(pool.row(d)) == before_d                         # the parked task was not touched


async def test_partial_metadata_update_counts_one_process_once(pool, procs, tmp_path, monkeypatch, tokens):
    """Interrupted between the recipient's runner record and clearing the donor's: one process
    appears in two records and is counted once; no slot is freed or doubled."""
    ra, rb, a, b, c, d = await saturated(pool, procs, tmp_path / "project")
    monkeypatch.setenv("MOTOR_TASK_FAULT", "reassign_between_metadata:raise")
    with pytest.raises(OSError):
        pool.claim(b, rb, {"mini-1": OK, "mini-2": OK})
    runners = pool.cdir.read_runners()
    assert runners[b].identity == rb and runners[d].identity == rb
    q = pool.cdir.read_queue()
    assert core.unique_live_identities(q, runners, procs) == {ra, rb}
    assert core.occupied_runner_slots_locked(q, runners, procs) == 2
    monkeypatch.delenv("MOTOR_TASK_FAULT")
    assert pool.cdir.critical(lambda L: reconcile_plan(L, procs.spawn(), 2, {}, tokens)) == []
