"""The disk actor's live workspace index, maintained from committed records, against the same
sets recomputed from the live records (the reference: `LiveIndex.from_records`, what the actor
computed on every check before); and the actor's protection answers with either source."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import trio
from hypothesis import given, settings, strategies as st

from motor.disk.actor import DiskActor, JobIdle, PrepareSetup, Register
from motor.disk.live import LiveIndex
from motor.records import TERMINAL_STATES

STATES = ["queued", "setup", "running", "succeeded", "failed", "cancelled", "timed_out",
          "refused_before_start", "lost"]
NAMES = ["a", "b", "c", "d", "/caller/x"]


@dataclass
class Rec:
    job_id: str
    state: str
    workspace: str
    siblings: list = field(default_factory=list)
    kind: str = "job"
    bundle_sha256: str | None = None


records = st.builds(
    Rec, job_id=st.sampled_from([f"j{i}" for i in range(6)]), state=st.sampled_from(STATES),
    workspace=st.sampled_from(NAMES), siblings=st.lists(st.sampled_from(NAMES), max_size=3),
    kind=st.sampled_from(["job", "warm_build", "cache_fill"]),
    bundle_sha256=st.sampled_from([None, "b1", "b2"]))


class Db:
    """What the store holds: the latest record per job; `live()` as Database.live."""

    def __init__(self):
        self.rows: dict[str, Rec] = {}

    def save(self, r: Rec):
        self.rows[r.job_id] = r

    def live(self):
        return [r for _, r in sorted(self.rows.items()) if r.state not in TERMINAL_STATES]


@settings(max_examples=300, deadline=None)
@given(before=st.lists(records, max_size=8), after=st.lists(records, max_size=40),
       load_at=st.integers(min_value=0, max_value=40))
def test_the_index_kept_from_commits_equals_the_one_recomputed_from_live_records(
        before, after, load_at):
    db = Db()
    for r in before:  # committed before the runner (re)started
        db.save(r)
    index = LiveIndex(db.live)
    for i, r in enumerate(after):
        if i == load_at:
            index.ensure_loaded()  # first use: a disk check
        db.save(r)  # the store commits, then tells the index
        index.apply(r)
        if index.loaded:
            assert index.view() == LiveIndex.from_records(db.live()).view(), (i, r)
    index.ensure_loaded()
    assert index.view() == LiveIndex.from_records(db.live()).view()
    assert all(n > 0 for n in (*index.running.values(), *index.reserved.values(),
                               *index.bundles.values()))
    assert index.filling >= 0


async def test_the_actor_protects_the_same_workspaces_with_the_index_as_with_records(tmp_path):
    """Random commits, new catalogue entries (names whose canonical path changes) and job ends:
    after each step the actor fed by the index sees exactly what the reference actor, which
    reads every live record, sees: running and reserved names and paths, bundles, setup."""
    rng = random.Random(14)
    roots = [tmp_path / "ws"]
    roots[0].mkdir()
    (tmp_path / "elsewhere").mkdir()
    db = Db()
    index = LiveIndex(db.live)
    common = dict(floor_bytes=0, goal_bytes=0, workspace_roots=roots)
    ref_actor = DiskActor(tmp_path / "s1", live_jobs=db.live,
                          job_recorded=lambda j: j in db.rows, **common)
    idx_actor = DiskActor(tmp_path / "s2", live_jobs=lambda: [], live_index=index,
                          job_recorded=lambda j: j in db.rows, **common)
    names = ["a", "b", "c", "alias"]
    async with trio.open_nursery() as n:
        refs = [await n.start(a.run) for a in (ref_actor, idx_actor)]
        for step in range(400):
            roll = rng.random()
            if roll < 0.05:  # a workspace gets catalogued: its name now means its tree
                name = rng.choice(names)
                path = tmp_path / "ws" / rng.choice(["a", "b", "tree"])
                path.mkdir(exist_ok=True)
                for ref in refs:
                    await ref.call(Register(name, str(path)))
            elif roll < 0.15:
                job = f"j{rng.randrange(12)}"
                for ref in refs:
                    await ref.call(JobIdle(job, rng.choice(names)))
            elif roll < 0.2:
                for ref in refs:
                    await ref.call(PrepareSetup(f"j{rng.randrange(12)}", rng.choice(names)))
            else:
                r = Rec(job_id=f"j{rng.randrange(12)}", state=rng.choice(STATES),
                        workspace=rng.choice(names),
                        siblings=rng.sample(names, rng.randrange(3)),
                        kind=rng.choice(["job", "cache_fill"]),
                        bundle_sha256=rng.choice([None, "b1"]))
                db.save(r)
                index.apply(r)
            a, b = ref_actor._live(), idx_actor._live()
            assert (set(a.running), set(a.reserved), a.bundles, a.in_setup, a.filling) == (
                set(b.running), set(b.reserved), b.bundles, b.in_setup, b.filling), step
        for a in (ref_actor, idx_actor):
            a.stop()


async def test_the_runner_keeps_the_index_equal_to_its_live_records(tmp_path, autojump_clock):
    """Through the embedded runner: jobs running, queued behind them and ended; after each
    step the index the store's commits feed equals the one read from the database."""
    import motor
    from runner_helpers import barrier_job, embedded_config, event_of, terminal_of

    from motor.records import JobRequest

    async with motor.open_runner(embedded_config(tmp_path)) as runner:
        index = next(w.__self__ for w in runner.hub.watchers
                     if isinstance(getattr(w, "__self__", None), LiveIndex))

        def check():
            index.ensure_loaded()
            assert index.view() == LiveIndex.from_records(runner.db.live()).view()

        gate = tmp_path / "go"
        held = await runner.submit(barrier_job(gate, workspace="a", siblings=["b"]))
        await event_of(runner, held.job_id, "started")
        check()
        queued = [await runner.submit(JobRequest(command=["true"], workspace=w))
                  for w in ("a", "b", "c")]
        check()
        assert "a" in index.running and "b" in index.running
        gate.touch()
        for job in (held, *queued):
            assert (await terminal_of(runner, job.job_id))["state"] == "succeeded"
        check()
        assert not index.jobs and not index.running and not index.reserved


def test_a_new_catalogue_entry_re_resolves_only_its_own_name():
    """Cataloguing a new workspace (every job's setup in a fresh workspace does) re-resolves
    that one held name, not every name the live jobs hold (at 10,000 queued over 2,000
    workspaces a full pass per job start was the drain's main cost)."""
    from motor.disk.live import HeldPaths

    db = Db()
    for i in range(1000):
        r = Rec(job_id=f"j{i}", state="queued", workspace=f"w{i}")
        db.save(r)
    index = LiveIndex(db.live)
    index.ensure_loaded()
    paths = {f"w{i}": f"/ws/w{i}" for i in range(1000)}
    calls = []

    def canon(name):
        calls.append(name)
        return paths[name]

    held = HeldPaths()
    held.follow(index, (0, 0), canon)  # first view: everything once
    assert len(calls) == 1000
    calls.clear()
    paths["w7"] = "/elsewhere/tree"  # its catalogue entry now names another tree
    held.follow(index, (0, 0), canon, added=["w7", "not-held"])
    assert calls == ["w7"]
    assert held.count["reserved"]["/elsewhere/tree"] == 1 and "/ws/w7" not in held.count["reserved"]
    assert held.path_of["reserved"]["w7"] == "/elsewhere/tree"
