"""The disk actor on real trees with a fake free-space probe and a fake wall clock."""

from __future__ import annotations

import hashlib
import os
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import trio
import trio.testing

import actors
from fakes import inline_offload
from motor.disk import host, room, trash
from motor.disk.walking import WALK_STALLED_S
from motor.disk.actor import (
    Admit, AdmitUpload, BeginUpload, CommitUpload, DiskActor, HasBundle, JobIdle, Listing,
    Periodic, PrepareSetup, Register, Reserve, Sample, Unreserve,
)
from motor.disk.core import DiskSample

from .test_trees import H1, make_target

HOUR = 3600 * 1000
MB = 1024 * 1024


class Clock:
    def __init__(self, ms: int):
        self.ms = ms

    def now_ms(self) -> int:
        return self.ms


class Probe:
    """Free bytes = base - allocated bytes of the watched roots (+ a reflink discount)."""

    def __init__(self, free: int):
        self.free = free
        self.calls = 0

    def __call__(self, path) -> DiskSample:
        self.calls += 1
        return DiskSample(free_bytes=self.free, total_bytes=10**12)


@dataclass
class Rec:
    job_id: str
    state: str
    workspace: str
    siblings: list = field(default_factory=list)
    bundle_sha256: str | None = None


@asynccontextmanager
async def disk_actor(tmp_path, *, floor=100 * MB, goal=None, probe=None, clock=None, live=None,
                     roots=None, caller_roots=None, cap=64 * 1024**3, ended=None):
    """`live`: the live job records; `ended`: ids of jobs whose records have ended."""
    state = tmp_path / "state"
    roots = roots or [state / "workspaces"]
    for r in roots:
        Path(r).mkdir(parents=True, exist_ok=True)
    probe = probe or Probe(10**12)
    clock = clock or Clock(1_800_000_000_000)
    live = live if live is not None else []
    actor = DiskActor(state, floor, goal if goal is not None else 2 * floor, probe,
                      workspace_roots=roots, caller_roots=caller_roots or {}, cap_bytes=cap,
                      clock=clock, live_jobs=lambda: list(live),
                      job_recorded=lambda job_id: job_id in (ended or ()) or any(
                          r.job_id == job_id for r in live))
    sup = actors.Supervisor("t", [actors.ChildSpec(name="disk", factory=lambda: actor)])
    async with trio.open_nursery() as n:
        await n.start(sup.run)
        try:
            yield sup.ref("disk"), actor, probe, clock, live
        finally:
            sup.shutdown()


def fill(path: Path, nbytes: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "blob").write_bytes(b"\1" * nbytes)


async def setup_ws(ref, name, *, clock, nbytes=MB, kind="task", idle_ms=0, bundle=None):
    """A workspace whose job set it up and went idle `idle_ms` ago."""
    clock.ms -= idle_ms
    plan = await ref.call(PrepareSetup(f"job-{name}", name, kind=kind, bundle_sha256=bundle))
    assert plan.refusal is None, plan.refusal
    fill(Path(plan.path), nbytes)
    await ref.call(JobIdle(f"job-{name}", name))
    clock.ms += idle_ms
    return Path(plan.path)


class Shrinking(Probe):
    """free space grows by what is really deleted, scaled (reflinks: 10% of the estimate)."""

    def __init__(self, base, roots, share=1.0):
        super().__init__(base)
        self.base, self.roots, self.share = base, roots, share
        self.start = None

    def used(self):
        total = 0
        for r in self.roots:
            for dirpath, dirs, files in os.walk(r):
                for f in files:
                    try:
                        total += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
                    except OSError:
                        pass
        return total

    def __call__(self, path):
        used = self.used()
        if self.start is None:
            self.start = used
        self.calls += 1
        return DiskSample(free_bytes=self.base + int((self.start - used) * self.share),
                          total_bytes=10**12)


async def test_disk_admission_refuses_typed_when_reflinks_reclaim_too_little(tmp_path):
    root = tmp_path / "state" / "workspaces"
    probe = Shrinking(10**12, [root], share=0.1)  # each eviction frees 10% of its estimate
    async with disk_actor(tmp_path, probe=probe, floor=100 * MB) as (ref, actor, _, clock, live):
        for i in range(5):
            await setup_ws(ref, f"w{i}", clock=clock, nbytes=20 * MB, idle_ms=(i + 1) * HOUR)
        probe.base, probe.start = 50 * MB, None
        refusal = await ref.call(Admit("job-new", "new"))
        assert refusal is not None and refusal.code == "runner_disk_full"
        assert refusal.floor_bytes == 100 * MB
        assert 50 * MB < refusal.free_bytes < 100 * MB
        assert os.listdir(root) in ([".motor-trash"], [".motor-trash", ".motor-staging"], [])
        assert probe.calls > 5  # probed again after every action


async def test_disk_admission_protects_canonical_alias_through_job_insertion(tmp_path):
    state = tmp_path / "state"
    real_root = tmp_path / "real-ws"
    alias_root = state / "workspaces"
    real_root.mkdir(parents=True)
    state.mkdir()
    alias_root.symlink_to(real_root)  # the configured root is an alias of the real directory
    probe = Probe(10**12)
    ended = set()
    async with disk_actor(tmp_path, probe=probe, roots=[alias_root], ended=ended) as (
            ref, actor, _, clock, live):
        app = await setup_ws(ref, "app", clock=clock, nbytes=MB, idle_ms=48 * HOUR)
        assert str(app).startswith(str(real_root))
        probe.free = 10 * MB  # hard pressure
        assert (await ref.call(Admit("job-1", "app")))  # refused, but app is kept
        assert app.exists()
        # admitted (free space fine), then pressure before the job is recorded: still kept
        probe.free = 10**12
        assert await ref.call(Admit("job-2", "app")) is None
        probe.free = 10 * MB
        await ref.call(Periodic())
        assert app.exists()
        # recorded as queued: protected by the record
        live.append(Rec("job-2", "queued", "app"))
        await ref.call(Periodic())
        assert app.exists()
        # the job ends (its record is terminal): its protection ends with it
        live.clear()
        ended.add("job-2")
        await ref.call(Periodic())
        assert not app.exists()


async def test_disk_size_guard_drops_only_incremental_and_defers_queued_workspace(tmp_path):
    async with disk_actor(tmp_path, cap=64 * 1024) as (ref, actor, _, clock, live):
        plan = await ref.call(PrepareSetup("j1", "ws"))
        ws = Path(plan.path)
        make_target(ws, old_ms=clock.ms)
        (ws / "target" / "debug" / "deps" / "big").write_bytes(b"b" * 200_000)
        live.append(Rec("j2", "queued", "ws"))  # a queued job will use it: deferred
        assert await ref.call(JobIdle("j1", "ws")) == []
        inc = ws / "target" / "debug" / "incremental"
        assert os.listdir(inc)
        live.clear()
        result = await ref.call(Periodic())
        # the pass swept ws first (the test's clock is days ahead of the files' atimes), so
        # its guard walks it again, off the turn, after the pass
        assert result["swept"] == ["ws"] and result["guarded"] == []
        await guards_done(actor)
        assert not inc.exists()
        assert (ws / "target" / "debug" / "deps" / "big").exists()
        assert (ws / "target" / "debug" / "deps" / f"libserde-{H1}.rlib").exists()


async def test_job_ends_guard_their_workspace_once_after_a_delay_and_starts_do_not_wait(
        tmp_path, autojump_clock, monkeypatch):
    """Issue 14: a job's end (a `JobIdle` cast, as the job actor sends it) does not walk its
    workspace at once: `GUARD_DELAY_S` later the guard walks each workspace jobs left
    meanwhile once, however many jobs ended in it, and applies the cap. Meanwhile the
    actor answers a start's `PrepareSetup` without a walk. (Before, each cast walked at
    once, and a start waited behind it.)"""
    async with disk_actor(tmp_path, cap=64 * 1024) as (ref, actor, _, clock, live):
        ws = Path((await ref.call(PrepareSetup("j1", "ws"))).path)
        make_target(ws, old_ms=clock.ms)
        (ws / "target" / "debug" / "deps" / "big").write_bytes(b"b" * 200_000)
        walks = []
        real = host.survey

        def counted(entries, dev, wanted, now_ms, scans=None):  # the guard's survey (its walk)
            walks.append(sorted(wanted))
            return real(entries, dev, wanted, now_ms, scans)

        monkeypatch.setattr(host, "survey", counted)
        for job in ("j1", "j2", "j3"):
            await ref.cast(JobIdle(job, "ws"))
        assert (await ref.call(PrepareSetup("j4", "other"))).refusal is None
        assert walks == []
        inc = ws / "target" / "debug" / "incremental"
        assert os.listdir(inc)
        await trio.sleep(host.GUARD_DELAY_S)
        while inc.exists():
            await trio.sleep(0.01)
        await trio.sleep(1)
        assert walks == [["ws"]]
        assert (ws / "target" / "debug" / "deps" / "big").exists()


async def guard_walk_held_over_the_cap(ref, actor, clock):
    """Workspace `ws` over the cap, its job's end sent, and the guard's walk of it held
    (`hold_the_first_survey`): (ws's path, walks, release)."""
    ws = Path((await ref.call(PrepareSetup("j1", "ws"))).path)
    make_target(ws, old_ms=clock.ms)
    (ws / "target" / "debug" / "deps" / "big").write_bytes(b"b" * 200_000)
    walks, walking, release = hold_the_first_survey(actor)
    await ref.cast(JobIdle("j1", "ws"))
    await walking.wait()
    return ws, walks, release


def hold_the_first_survey(actor):
    """The disk actor's first survey (the guard's walk, off its turn) waits for `release`;
    each survey's walked names go into `walks`: (walks, walking, release)."""
    walks, walking, release = [], trio.Event(), trio.Event()
    real = actor.trees.offload

    async def held(fn, *args):
        if fn is host.survey:
            walks.append(sorted(args[2]))
            if len(walks) == 1:
                walking.set()
                await release.wait()
        return await real(fn, *args)

    actor.trees.offload = held
    return walks, walking, release


async def test_a_workspace_a_job_is_queued_for_during_the_guards_walk_is_left_for_later(
        tmp_path):
    """Stop 60: the guard's walk runs off the actor's turn (guarding.py), so a job may be
    admitted to the walked workspace meanwhile: the cap is then not applied to it (its
    incremental directories stay), the workspace stays pending, and the guard applies it
    once the job has gone. Meanwhile the actor answers admissions and set-ups."""
    async with disk_actor(tmp_path, cap=64 * 1024) as (ref, actor, _, clock, live):
        ws, walks, release = await guard_walk_held_over_the_cap(ref, actor, clock)
        assert await ref.call(Admit("j2", "ws")) is None  # answered during the walk
        assert (await ref.call(PrepareSetup("j3", "other"))).refusal is None
        live.append(Rec("j2", "queued", "ws"))
        release.set()
        while actor.walks.walking:  # the walk, in a worker thread, and its decision
            await trio.sleep(0.01)
        inc = ws / "target" / "debug" / "incremental"
        assert os.listdir(inc)  # deferred: a job is queued for it
        assert "ws" in actor.trees.sizes.guard_pending
        live.clear()
        assert await ref.call(Periodic()) is not None
        await guards_done(actor)
        assert not inc.exists()


async def test_a_maintenance_pass_during_the_guards_walk_waits_for_it_and_admissions_do_not(
        tmp_path):
    """A maintenance pass while the guard's walk runs off the turn: its own walk (off the
    turn too, since stop 61) waits for that one instead of walking the workspace a second
    time at once (before b480696 two guard walks of one workspace could run at once, the
    older landing last), while admissions are answered; then it walks the workspace used
    meanwhile and applies the guard."""
    async with disk_actor(tmp_path, cap=64 * 1024) as (ref, actor, _, clock, live):
        ws, walks, release = await guard_walk_held_over_the_cap(ref, actor, clock)
        await ref.cast(JobIdle("j2", "ws"))  # used again during the walk
        summaries = []
        async with trio.open_nursery() as n:
            n.start_soon(lambda: call_into(summaries, ref, Periodic()))
            while not actor.walks.passes:
                await trio.sleep(0.01)
            assert await ref.call(Admit("j3", "other")) is None  # not behind the pass
            assert walks == [["ws"]] and not summaries
            release.set()
        (summary,) = summaries
        # the pass's walk, then the guard's own, off the turn, after the pass: the pass swept
        # ws first (the test's clock is days ahead of the files' atimes)
        assert summary["swept"] == ["ws"] and summary["guarded"] == []
        await guards_done(actor)
        assert not (ws / "target" / "debug" / "incremental").exists()  # the guard applied it
        assert walks == [["ws"]] * 3, walks


async def test_a_listing_during_a_walk_answers_at_once_from_the_sizes_known(tmp_path):
    """`motor workspaces` walks the workspaces used since their last walk off the actor's
    turn too (stop 61), but not while another walk runs: then it answers at once, from
    the sizes known (the held walk's workspace as it was before that walk)."""
    async with disk_actor(tmp_path, cap=64 * 1024) as (ref, actor, _, clock, live):
        ws, walks, release = await guard_walk_held_over_the_cap(ref, actor, clock)
        with trio.fail_after(5):
            rows = await ref.call(Listing())
        assert [r["name"] for r in rows] == ["ws"] and walks == [["ws"]]
        release.set()
        while actor.walks.walking:
            await trio.sleep(0.01)
        await ref.cast(JobIdle("j2", "ws"))  # used again: the next listing walks it first
        rows = await ref.call(Listing())
        assert walks == [["ws"], ["ws"]] and rows[0]["allocated_bytes"] > 0, rows


async def test_a_walk_off_the_turn_keeps_a_gone_tree_a_job_was_admitted_to_meanwhile(
        tmp_path):
    """A survey off the actor's turn found a workspace's tree gone; a job admitted to it
    meanwhile makes it again, so its catalog entry stays (`Trees.keep_walk`); with no job
    holding it, it is forgotten."""
    async with disk_actor(tmp_path) as (ref, actor, _, clock, live):
        trees = actor.trees
        for name in ("kept", "gone"):
            await ref.call(PrepareSetup(f"j-{name}", name))  # catalogued, no tree made
        looked = trees.entries()
        found = host.survey(looked, None, trees.begin_walk(looked), clock.ms)
        assert sorted(found[1]) == ["gone", "kept"]
        assert await ref.call(Admit("j-again", "kept")) is None
        trees.keep_walk(actor._live(), found)
        assert trees.catalog.get("kept") is not None and trees.catalog.get("gone") is None


async def guards_done(actor) -> None:
    """Until the guard's walks a pass left for after it (`Walks.next`) are done, and the
    turn that decided on the last of them too: `walking` is None from the start of the
    `Walked` message's turn, whose drop of `incremental` (`Trees.execute`, off the loop)
    comes after (stop 80: under load the test looked before the drop). A call (an
    `Unreserve` of no reservation, which changes nothing) is served after that turn."""
    while True:
        while actor.walks.walking or actor.walks.next:
            await trio.sleep(0.01)
        await actor.ref.call(Unreserve("guards-done"))
        if not (actor.walks.walking or actor.walks.next):  # (that turn began none)
            return


async def call_into(results: list, ref, msg, timeout: float = 30) -> None:
    results.append(await ref.call(msg, timeout=timeout))


async def test_the_guards_walk_does_not_overwrite_sizes_stored_while_it_ran(tmp_path):
    async with disk_actor(tmp_path) as (ref, actor, _, clock, live):
        (Path((await ref.call(PrepareSetup("j1", "ws"))).path) / "src").mkdir(parents=True)
        trees = actor.trees
        trees.used("ws", [], clock.ms)  # pending and dirty, as a job's end leaves it
        looked, wanted = trees.guard_survey(actor._live, {"ws"})
        found = host.survey(looked, None, wanted, clock.ms)  # the walk, off the turn
        newer = host.measure_all([("ws", looked[0].path)], clock.ms)["ws"]
        trees.sizes.store("ws", *newer)  # a maintenance pass's walk, stored meanwhile
        assert await trees.guard_finish(actor._live, actor.cap_bytes, looked, found) == []
        assert trees.sizes.sizes["ws"] is newer[0]
        trees.used("ws", [], clock.ms)
        looked, wanted = trees.guard_survey(actor._live, {"ws"})
        found = host.survey(looked, None, wanted, clock.ms)
        await trees.guard_finish(actor._live, actor.cap_bytes, looked, found)
        assert trees.sizes.sizes["ws"] is found[2]["ws"][0]  # nothing meanwhile: kept


async def test_a_guard_walk_that_runs_a_minute_is_a_health_problem_until_it_ends(
        tmp_path, autojump_clock):
    """A walk that hangs (a file system that stopped answering) no longer holds the actor,
    so nothing else would say it: health's disk sample names it after WALK_STALLED_S."""
    async with disk_actor(tmp_path) as (ref, actor, _, clock, live):
        await ref.call(PrepareSetup("j1", "ws"))
        walks, walking, release = hold_the_first_survey(actor)
        await ref.cast(JobIdle("j1", "ws"))
        await trio.sleep(WALK_STALLED_S - 1)
        assert actor.walks.walking and not actor.read(Sample()).problems
        await trio.sleep(2)
        (problem,) = actor.read(Sample()).problems
        assert "guard's walk of ws has run 6" in problem and "does not answer" in problem
        release.set()
        while actor.walks.walking:
            await trio.sleep(0.01)
        assert not actor.read(Sample()).problems


async def test_a_maintenance_pass_whose_walk_hangs_is_said_in_health_and_holds_no_admission(
        tmp_path, autojump_clock):
    """A maintenance pass's walk off the actor's turn (stop 61) that hangs: admissions
    and set-ups are answered meanwhile, health names the walk after WALK_STALLED_S (the
    first five workspaces and how many more), and the pass answers once the walk ends."""
    async with disk_actor(tmp_path) as (ref, actor, _, clock, live):
        names = [f"ws{i}" for i in range(7)]
        for name in names:
            await ref.call(PrepareSetup(f"j-{name}", name))  # catalogued, never measured
        # inline: virtual time jumps while a real worker thread runs (the trash's deletion
        # before the survey); only the held survey waits, on `release`
        actor.trees.offload = inline_offload
        walks, walking, release = hold_the_first_survey(actor)
        summaries = []
        async with trio.open_nursery() as n:
            n.start_soon(lambda: call_into(summaries, ref, Periodic(), 600))  # as maintenance
            await walking.wait()
            assert await ref.call(Admit("j-new", "new")) is None
            assert (await ref.call(PrepareSetup("j-new", "new"))).refusal is None
            await trio.sleep(WALK_STALLED_S + 1)
            (problem,) = actor.read(Sample()).problems
            assert ("the maintenance pass's walk of ws0, ws1, ws2, ws3, ws4 and 2 more has "
                    "run 6") in problem, problem
            assert not summaries
            release.set()
        assert summaries and walks[0] == names
        assert not actor.read(Sample()).problems


async def test_disk_stale_unit_maintenance_deletes_whole_units_and_runs_once_daily(tmp_path):
    now_ms = time.time_ns() // 1_000_000
    async with disk_actor(tmp_path, clock=Clock(now_ms)) as (ref, actor, _, clock, live):
        plan = await ref.call(PrepareSetup("j1", "ws"))
        ws = Path(plan.path)
        ws.mkdir(parents=True)
        await ref.call(JobIdle("j1", "ws"))
        make_target(ws, old_ms=now_ms - 72 * HOUR)
        deps = ws / "target" / "debug" / "deps"
        first = await ref.call(Periodic())
        assert first["swept"] == ["ws"], (first, actor.sizes.last_sweep, await ref.call(Listing()))
        assert not (deps / f"libserde-{H1}.rlib").exists()
        assert not (ws / "target" / "debug" / "build" / f"serde-{H1}").exists()
        assert (deps / "README-not-a-unit").exists() and (deps / f"libfresh-{'00112233aabbccdd'}.rlib").exists()
        # the same day: no second sweep, even with new stale units
        make_target(ws, old_ms=now_ms - 72 * HOUR)
        clock.ms += 23 * HOUR
        assert (await ref.call(Periodic()))["swept"] == []
        assert (deps / f"libserde-{H1}.rlib").exists()
        clock.ms += 2 * HOUR
        # keep the workspace from idle expiry (24 h) for this check
        actor.catalog.touch("ws", clock.ms)
        assert (await ref.call(Periodic()))["swept"] == ["ws"]


async def test_a_sweep_scanned_off_the_turn_skips_a_workspace_used_during_its_walk(tmp_path):
    """The daily sweep's scan runs in the pass's walk, off the actor's turn (stop 63), and
    its removals are moved into the trash in the turn. A job that used the workspace while
    the scan ran may have read a unit the scan found stale: that pass does not sweep it
    (nor count it swept today), the next one scans it again and does. Meanwhile the actor
    answers admissions and set-ups."""
    now_ms = time.time_ns() // 1_000_000
    async with disk_actor(tmp_path, clock=Clock(now_ms)) as (ref, actor, _, clock, live):
        ws = Path((await ref.call(PrepareSetup("j1", "ws"))).path)
        ws.mkdir(parents=True)
        await ref.call(JobIdle("j1", "ws"))
        make_target(ws, old_ms=now_ms - 72 * HOUR)
        rlib = ws / "target" / "debug" / "deps" / f"libserde-{H1}.rlib"
        scanning, release, real = trio.Event(), trio.Event(), actor.trees.offload

        async def held(fn, *args):
            if fn is host.stale_scans and not release.is_set():
                scanning.set()
                await release.wait()
            return await real(fn, *args)

        actor.trees.offload = held
        summaries = []
        async with trio.open_nursery() as n:
            n.start_soon(lambda: call_into(summaries, ref, Periodic()))
            await scanning.wait()
            assert await ref.call(Admit("j2", "ws")) is None  # not behind the scan
            assert (await ref.call(PrepareSetup("j2", "ws"))).refusal is None
            await ref.call(JobIdle("j2", "ws"))  # j2 ran in ws during the scan
            release.set()
        assert summaries[0]["swept"] == [] and rlib.exists()
        assert "ws" not in actor.trees.sizes.last_sweep
        assert (await ref.call(Periodic()))["swept"] == ["ws"] and not rlib.exists()
        await ref.call(Periodic())  # the next pass's walk empties the trash
        assert not [p for p in (ws.parent / ".motor-trash").iterdir()
                    if p.name.startswith(f"serde-{H1}")]


async def test_head_workspace_survives_idle_expiry_and_task_defaults_expire(tmp_path):
    async with disk_actor(tmp_path) as (ref, actor, _, clock, live):
        task = await setup_ws(ref, "t", clock=clock)
        head = await setup_ws(ref, "h", clock=clock, kind="head")
        clock.ms += 23 * HOUR
        assert (await ref.call(Periodic()))["expired_workspaces"] == []
        clock.ms += 2 * HOUR
        assert (await ref.call(Periodic()))["expired_workspaces"] == ["t"]
        assert not task.exists() and head.exists()
        rows = {r["name"]: r for r in await ref.call(Listing())}
        assert list(rows) == ["h"] and rows["h"]["kind"] == "head"


async def test_head_workspace_is_lru_evictable_outside_task_roots(tmp_path):
    heads = tmp_path / "heads"
    roots = [tmp_path / "state" / "workspaces", heads]
    probe = Probe(10**12)
    async with disk_actor(tmp_path, probe=probe, roots=roots) as (ref, actor, _, clock, live):
        old = heads / "old-head"
        new = heads / "new-head"
        fill(old, MB)
        fill(new, MB)
        await ref.call(Register("old-head", str(old), kind="head"))
        clock.ms += HOUR
        await ref.call(Register("new-head", str(new), kind="head"))
        clock.ms += 2 * HOUR
        stray = heads / "not-catalogued"
        fill(stray, 50 * MB)
        probe.free = 150 * MB  # soft pressure (floor 100, goal 200): both are candidates
        calls = []
        orig = actor.trees.execute

        async def record(action):
            calls.append(action)
            if len(calls) == 1:
                probe.free = 250 * MB  # the first eviction reached the goal
            await orig(action)

        actor.trees.execute = record
        await ref.call(Periodic())
        assert [c.workspace for c in calls] == ["old-head"]
        assert not old.exists() and new.exists() and stray.exists()


async def test_mapped_expiry_and_pressure_use_host_paths_and_private_trash(tmp_path):
    host = tmp_path / "host-home"
    host.mkdir()
    probe = Probe(10**12)
    async with disk_actor(tmp_path, probe=probe, caller_roots={"/home/alice": str(host)}) as (
            ref, actor, _, clock, live):
        tree = host / "proj"
        fill(tree, MB)
        entry = await ref.call(Register("/home/alice/proj", str(tree), caller_path="/home/alice/proj"))
        assert entry.path == str(tree.resolve()) and entry.root == str(host.resolve())
        rows = await ref.call(Listing())
        assert rows[0]["name"] == "/home/alice/proj" and rows[0]["path"] == str(tree.resolve())
        seen = []
        orig = trash.move_to_trash

        def spy(path, root):
            seen.append((path, root))
            return orig(path, root)

        trash.move_to_trash = spy
        try:
            clock.ms += 25 * HOUR
            assert (await ref.call(Periodic()))["expired_workspaces"] == ["/home/alice/proj"]
        finally:
            trash.move_to_trash = orig
        assert seen == [(str(tree.resolve()), str(host.resolve()))]
        assert not tree.exists()
        assert (host / ".motor-trash").is_dir()
        assert not (tmp_path / "state" / "workspaces" / ".motor-trash").exists()

        # pressure: mapped workspaces are evicted by host path into the host's private trash,
        # and the host directory's filesystem is probed (not only the state filesystem)
        old, fresh = host / "old", host / "fresh"
        fill(old, 2 * MB)
        fill(fresh, MB)
        await ref.call(Register("/home/alice/old", str(old), caller_path="/home/alice/old"))
        clock.ms += HOUR
        await ref.call(Register("/home/alice/fresh", str(fresh), caller_path="/home/alice/fresh"))
        clock.ms += 2 * HOUR
        probed = []
        real_probe = actor.probe

        def probe_spy(path):
            probed.append(os.path.realpath(path))
            # below the floor until the old workspace is gone
            free = 10 * MB if old.exists() else 10**12
            return real_probe(path).__class__(free_bytes=free, total_bytes=10**12)

        actor.probe = probe_spy
        seen.clear()
        trash.move_to_trash = spy
        try:
            await ref.call(Periodic())
        finally:
            trash.move_to_trash = orig
            actor.probe = real_probe
        assert seen == [(str(old.resolve()), str(host.resolve()))]  # old first; goal then met
        assert not old.exists() and fresh.exists()
        assert str(host.resolve()) in probed
        assert not (tmp_path / "state" / "workspaces" / ".motor-trash").exists()
        names = [r["name"] for r in await ref.call(Listing())]
        assert names == ["/home/alice/fresh"]


async def test_mapped_pressure_protects_active_host_claims_and_collects_fresh_trash_garbage(tmp_path):
    host = tmp_path / "host-home"
    host.mkdir()
    probe = Probe(10**12)
    async with disk_actor(tmp_path, probe=probe, caller_roots={"/home/bob": str(host)}) as (
            ref, actor, _, clock, live):
        busy, idle = host / "busy", host / "idle"
        fill(busy, 5 * MB)
        fill(idle, MB)
        await ref.call(Register("/home/bob/busy", str(busy), caller_path="/home/bob/busy"))
        await ref.call(Register("/home/bob/idle", str(idle), caller_path="/home/bob/idle"))
        garbage = host / ".motor-trash" / "left.123"
        fill(garbage, MB)  # what a crash left in the private trash
        await ref.call(Reserve("claim-1", ("/home/bob/busy",)))
        clock.ms += 2 * HOUR
        probe.free = 10 * MB  # hard pressure
        await ref.call(Periodic())
        assert busy.exists()
        assert not idle.exists()
        assert not garbage.exists()
        await ref.call(Unreserve("claim-1"))
        await ref.call(Periodic())
        assert not busy.exists()


async def test_refused_transfer_survives_maintenance_and_restart_until_retention_expires(tmp_path):
    data = b"source bundle bytes"
    sha = hashlib.sha256(data).hexdigest()
    clock = Clock(1_800_000_000_000)
    bundle = tmp_path / "state" / "bundles" / sha
    async with disk_actor(tmp_path, clock=clock) as (ref, actor, _, _, live):
        assert await ref.call(AdmitUpload(sha)) is None
        upload = await ref.call(BeginUpload(sha))
        upload.write(data)
        await ref.call(CommitUpload(upload))  # the upload is a use
        # the job that wanted it was refused (never recorded): nothing needs the bundle, but
        # it stays pinned through maintenance for 24 h after its last use
        clock.ms += 12 * HOUR
        assert (await ref.call(Periodic()))["bundles_expired"] == []
        assert bundle.exists()
        # a later submit's presence check finds it and counts as a use (12 h after upload)
        assert await ref.call(HasBundle(sha)) is True
    async with disk_actor(tmp_path, clock=clock) as (ref, actor, _, _, live):  # a restart
        assert (await ref.call(Periodic()))["bundles_expired"] == []
        assert bundle.exists()
        clock.ms += 24 * HOUR - 1  # 36 h after the upload, 24 h less 1 ms after the last use
        assert (await ref.call(Periodic()))["bundles_expired"] == []
        assert bundle.exists()
        clock.ms += 1  # exactly 24 h after the last use
        assert (await ref.call(Periodic()))["bundles_expired"] == [sha]
        assert not bundle.exists()
        assert await ref.call(HasBundle(sha)) is False


async def test_bundle_needed_by_a_live_job_is_kept_past_retention(tmp_path):
    data = b"kept while needed"
    sha = hashlib.sha256(data).hexdigest()
    async with disk_actor(tmp_path) as (ref, actor, _, clock, live):
        upload = await ref.call(BeginUpload(sha))
        upload.write(data)
        await ref.call(CommitUpload(upload))
        live.append(Rec("j", "queued", "w", bundle_sha256=sha))
        clock.ms += 48 * HOUR
        assert (await ref.call(Periodic()))["bundles_expired"] == []
        live.clear()
        assert (await ref.call(Periodic()))["bundles_expired"] == [sha]


async def test_disk_full_setup_check_refuses_with_bytes(tmp_path):
    probe = Probe(10 * MB)
    async with disk_actor(tmp_path, probe=probe) as (ref, actor, _, clock, live):
        plan = await ref.call(PrepareSetup("j", "w"))
        assert plan.refusal.code == "runner_disk_full"
        assert (plan.refusal.free_bytes, plan.refusal.floor_bytes) == (10 * MB, 100 * MB)


# --- the seed's pressure tests, through the actor's plan / act / re-probe loop -------------


def _age(path: Path, ms: int) -> None:
    for p in [path, *path.rglob("*")]:
        os.utime(p, ns=(ms * 1_000_000, ms * 1_000_000), follow_symlinks=False)


async def cargo_ws(ref, name, *, clock, idle_ms, stale=0, inc=0, other=0) -> Path:
    """A workspace with a stale Cargo unit (72 h old), fresh incremental state and other
    bytes, measured by its job going idle `idle_ms` ago."""
    clock.ms -= idle_ms
    plan = await ref.call(PrepareSetup(f"job-{name}", name))
    ws = Path(plan.path)
    prof = ws / "target" / "debug"
    if stale:
        (prof / "deps").mkdir(parents=True)
        unit = prof / "deps" / f"lib{name}-{H1}.rlib"
        unit.write_bytes(b"s" * stale)
        _age(unit, clock.ms + idle_ms - 72 * HOUR)
    if inc:
        (prof / "incremental" / f"{name}-{H1}").mkdir(parents=True)
        (prof / "incremental" / f"{name}-{H1}" / "s-1").write_bytes(b"i" * inc)
    fill(ws, other)
    await ref.call(JobIdle(f"job-{name}", name))
    clock.ms += idle_ms
    return ws


def _spy(actor) -> list:
    done = []
    orig = actor.trees.execute

    async def record(action):
        done.append((type(action).__name__, getattr(action, "workspace", None)))
        return await orig(action)

    actor.trees.execute = record
    return done


def _pressure(probe: Shrinking, free: int) -> None:
    """From now on free space is `free` plus whatever is really deleted."""
    probe.base, probe.start = free, None


async def test_disk_pressure_stale_pass_reaches_goal_without_dropping_incremental(tmp_path):
    root = tmp_path / "state" / "workspaces"
    probe = Shrinking(10**12, [root])
    clock = Clock(time.time_ns() // 1_000_000)
    async with disk_actor(tmp_path, probe=probe, clock=clock, floor=100 * MB) as (
            ref, actor, _, _, live):
        a = await cargo_ws(ref, "a", clock=clock, idle_ms=2 * HOUR, stale=3 * MB, inc=2 * MB)
        b = await cargo_ws(ref, "b", clock=clock, idle_ms=2 * HOUR, stale=MB, inc=4 * MB)
        done = _spy(actor)
        _pressure(probe, 200 * MB - 3 * MB - MB // 2)  # soft: a's 3 MB alone is not enough
        assert await ref.call(Admit("job-new", "new")) is None
        # largest stale first; the probe after it was still short, so b's unit went too
        assert done == [("DropStaleUnits", "a"), ("DropStaleUnits", "b")]
        assert probe.calls >= 3  # probed after each action
        for ws in (a, b):
            assert not list((ws / "target" / "debug" / "deps").iterdir())
            assert (ws / "target" / "debug" / "incremental").is_dir()
            assert list((ws / "target" / "debug" / "incremental").iterdir())
        # a pass stops as soon as the probe reaches the goal
        c = await cargo_ws(ref, "c", clock=clock, idle_ms=2 * HOUR, stale=3 * MB, inc=2 * MB)
        d = await cargo_ws(ref, "d", clock=clock, idle_ms=2 * HOUR, stale=MB, inc=4 * MB)
        done.clear()
        _pressure(probe, 200 * MB - 2 * MB)
        assert await ref.call(Admit("job-new2", "new")) is None
        assert done == [("DropStaleUnits", "c")]
        assert list((d / "target" / "debug" / "deps").iterdir())
        assert c.exists() and d.exists()


async def test_disk_pressure_incremental_pass_prefers_largest_and_retains_workspaces(tmp_path):
    root = tmp_path / "state" / "workspaces"
    probe = Shrinking(10**12, [root])
    clock = Clock(time.time_ns() // 1_000_000)
    async with disk_actor(tmp_path, probe=probe, clock=clock, floor=100 * MB) as (
            ref, actor, _, _, live):
        wss = {n: await cargo_ws(ref, n, clock=clock, idle_ms=2 * HOUR, inc=size, other=8 * MB)
               for n, size in (("small", MB), ("large", 6 * MB), ("mid", 2 * MB))}
        done = _spy(actor)
        _pressure(probe, 200 * MB - 7 * MB)  # large (6 MB) then mid (2 MB) reach the goal
        assert await ref.call(Admit("job-new", "new")) is None
        assert done == [("DropIncremental", "large"), ("DropIncremental", "mid")]
        for name, ws in wss.items():
            assert (ws / "blob").exists()  # every workspace is retained
            inc = ws / "target" / "debug" / "incremental"
            assert inc.exists() == (name == "small")
        assert probe(root).free_bytes >= 200 * MB


async def test_disk_soft_pressure_evicts_only_candidates_used_over_30_minutes_ago(tmp_path):
    root = tmp_path / "state" / "workspaces"
    probe = Shrinking(10**12, [root])
    async with disk_actor(tmp_path, probe=probe, floor=100 * MB) as (ref, actor, _, clock, live):
        recent = await setup_ws(ref, "recent", clock=clock, nbytes=9 * MB, idle_ms=29 * 60 * 1000)
        old = await setup_ws(ref, "old", clock=clock, nbytes=MB, idle_ms=31 * 60 * 1000)
        older = await setup_ws(ref, "older", clock=clock, nbytes=MB, idle_ms=3 * HOUR)
        done = _spy(actor)
        _pressure(probe, 150 * MB)  # above the floor, 50 MB short of the goal
        assert await ref.call(Admit("job-new", "new")) is None
        assert sorted(done) == [("EvictWorkspace", "old"), ("EvictWorkspace", "older")]
        assert recent.exists() and not old.exists() and not older.exists()
        rows = {r["name"]: r for r in await ref.call(Listing())}
        assert rows["recent"]["protected"] == "used in the last 30 minutes"
        # another maintenance pass: still above the floor, the recent one still stays
        await ref.call(Periodic())
        assert recent.exists()


async def test_disk_hard_pressure_evicts_recent_candidates_in_lru_order_until_soft_goal(tmp_path):
    root = tmp_path / "state" / "workspaces"
    probe = Shrinking(10**12, [root])
    async with disk_actor(tmp_path, probe=probe, floor=4 * MB, goal=9 * MB) as (
            ref, actor, _, clock, live):
        paths = {}
        for name, nbytes, idle in (("old", MB, 5 * HOUR), ("r1", 3 * MB, 10 * 60 * 1000),
                                   ("r2", 3 * MB, 20 * 60 * 1000), ("r3", 3 * MB, 5 * 60 * 1000)):
            paths[name] = await setup_ws(ref, name, clock=clock, nbytes=nbytes, idle_ms=idle)
        done = _spy(actor)
        _pressure(probe, 4 * MB - MB // 2)  # below the floor
        assert await ref.call(Admit("job-new", "new")) is None
        # the old one first (free space then crosses the floor), then the recent ones least
        # recently used first, re-probing after each, until the soft goal (9 MB)
        assert done == [("EvictWorkspace", "old"), ("EvictWorkspace", "r2"),
                        ("EvictWorkspace", "r1")]
        assert [n for n, p in paths.items() if p.exists()] == ["r3"]
        assert probe(root).free_bytes >= 9 * MB


async def test_a_file_system_below_its_floor_is_cleaned_up_with_no_admission_or_pass(
        tmp_path, monkeypatch):
    """A job that fills the disk asks nothing of the disk manager: before stop 55 the space
    stayed taken until the next admission or maintenance pass (up to a minute), the job's
    own status and output waiting for it. Now the manager probes every PRESSURE_POLL_S and
    cleans up at once when below its floor; above it, a probe does nothing."""
    monkeypatch.setattr(room, "PRESSURE_POLL_S", 0.02)
    root = tmp_path / "state" / "workspaces"
    probe = Shrinking(10**12, [root])
    async with disk_actor(tmp_path, probe=probe, floor=4 * MB, goal=9 * MB) as (
            ref, actor, _, clock, live):
        old = await setup_ws(ref, "old", clock=clock, nbytes=MB, idle_ms=5 * HOUR)
        done = _spy(actor)
        calls = probe.calls
        with trio.fail_after(10):
            while probe.calls < calls + 5:  # probed, above the floor: nothing done
                await trio.sleep(0.01)
        assert done == [] and old.exists()
        _pressure(probe, 4 * MB - MB // 2)  # filled by a job: below the floor
        with trio.fail_after(10):
            while old.exists():  # (the spy notes an action as it begins)
                await trio.sleep(0.01)
        assert done == [("EvictWorkspace", "old")]


async def test_a_workspace_root_that_is_gone_is_passed_over_not_a_crash(
        tmp_path, monkeypatch, caplog):
    """A workspace root removed (or unmounted) under the runner, on the real file system's
    probe: the maintenance pass's cleanup and the 2 s probe pass it over, said once. Before
    stop 55 the probe's FileNotFoundError crashed the disk actor at each pass (and, with
    the 2 s probe, every 2 s, until its supervisor gave up)."""
    monkeypatch.setattr(room, "PRESSURE_POLL_S", 0.02)
    root = tmp_path / "gone"
    probed = []

    def probe(path):
        probed.append(str(path))
        return host.probe_path(path)
    async with disk_actor(tmp_path, probe=probe, roots=[root], floor=MB) as (ref, actor, *_):
        root.rmdir()
        with caplog.at_level("WARNING", logger="motor.disk"):
            summary = await ref.call(Periodic())
            await ref.call(Periodic())
            assert summary["expired_workspaces"] == []
            with trio.fail_after(10):
                while probed.count(str(root)) < 5:  # the 2 s probe, passing it over
                    await trio.sleep(0.01)
            assert (await ref.call(Sample())).free_bytes > 0  # the same actor, serving
        said = [r.getMessage() for r in caplog.records if "cannot be probed" in r.getMessage()]
        assert said == [f"disk: {root} cannot be probed (No such file or directory): no "
                        "cleanup there until it can"], said


async def test_a_job_that_ends_before_any_disk_check_saw_it_reserves_nothing(tmp_path):
    ended = set()
    probe = Probe(10**12)
    async with disk_actor(tmp_path, probe=probe, ended=ended) as (ref, actor, _, clock, live):
        # cancelled while queued: admitted, recorded and ended between two disk checks
        assert await ref.call(Admit("job-1", "w")) is None
        w = await setup_ws(ref, "w", clock=clock, idle_ms=2 * HOUR)
        ended.add("job-1")
        probe.free = 10 * MB  # hard pressure
        await ref.call(Periodic())
        assert not w.exists()
        # ended after setup: JobIdle ends the admission's protection as well
        probe.free = 10**12
        assert await ref.call(Admit("job-2", "v")) is None
        v = await setup_ws(ref, "v", clock=clock, idle_ms=2 * HOUR)  # JobIdle("job-v")
        await ref.call(JobIdle("job-2", "v"))
        probe.free = 10 * MB
        await ref.call(Periodic())
        assert not v.exists()


async def test_health_s_sample_is_answered_while_the_disk_actor_is_busy(tmp_path):
    """`Sample` is a reader (stop 27): a probe of the free space does not wait behind a
    message the disk actor is working on (a cleanup, a walk)."""
    async with disk_actor(tmp_path, probe=Probe(123 * MB)) as (ref, actor, probe, clock, live):
        go = trio.Event()
        real = actor.handle

        async def handle(msg):  # a Listing that takes until `go`
            if isinstance(msg, Listing):
                await go.wait()
            return await real(msg)

        actor.handle = handle
        async with trio.open_nursery() as n:
            n.start_soon(ref.call, Listing())
            await trio.testing.wait_all_tasks_blocked()
            calls = probe.calls
            assert (await ref.call(Sample())).free_bytes == 123 * MB  # not behind the Listing
            assert probe.calls == calls + 1
            go.set()
