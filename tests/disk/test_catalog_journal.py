"""The catalog's batching: each change is one journal append, the snapshot is rewritten
rarely, and nothing the actor was told is lost when the process dies without stopping."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict
from pathlib import Path

import pytest
import trio

import actors
import motor
from motor.disk.actor import DiskActor, JobIdle, PrepareSetup
from motor.disk.catalog import COMPACT_MIN, Catalog
from motor.records import JobRequest
from runner_helpers import embedded_config, terminal_of
from tmpfs_helpers import Filler, needs_tmpfs, tmpfs


def _crashed(state) -> dict:
    """What a process starting after a crash reads: the files as they are (no close())."""
    return {k: asdict(v) for k, v in Catalog(state).entries.items()}


def _entries(catalog: Catalog) -> dict:
    return {k: asdict(v) for k, v in catalog.entries.items()}


def test_every_change_is_on_disk_without_a_snapshot_rewrite(tmp_path):
    c = Catalog(tmp_path)
    c.record("a", "/w/a", "/w", kind="task", now_ms=1)
    c.record("b", "/w/b", "/w", kind="task", now_ms=2)
    c.record("c", "/w/c", "/w", kind="head", now_ms=3, caller_path=None)
    c.touch("a", 10)
    c.forget("b")
    c.set_references("c", ["a"])
    assert c.compactions == 0 and not c.path.exists()  # no whole-catalog rewrite yet
    assert c.journal_lines == 6
    assert _crashed(tmp_path) == _entries(c)
    assert _crashed(tmp_path)["a"]["last_used_ms"] == 10


def test_paths_that_are_not_utf_8_or_not_ascii_are_journalled_and_read_back(tmp_path):
    """A root whose name is not UTF-8 (decoded with surrogate escapes, as os.fsdecode does)
    and a caller's path in another script: each change is on disk and reads back the same.
    (A journal line written by msgspec refused the first, stop 75: the json module's
    escapes take both, in ASCII whatever the locale.)"""
    odd_root = os.fsdecode(b"/w/caf\xe9")
    c = Catalog(tmp_path)
    c.record("a", f"{odd_root}/a", odd_root, kind="task", now_ms=1)
    c.record("b", "/w/b", "/w", kind="task", now_ms=2, caller_path="/home/\u0436\u00e9/b")
    c.touch("a", 5)
    assert c.save_error is None and c.compactions == 0
    assert c.journal_path.read_bytes().isascii()
    assert _crashed(tmp_path) == _entries(c)
    assert _crashed(tmp_path)["a"]["root"] == odd_root


def test_a_torn_last_line_is_ignored(tmp_path):
    c = Catalog(tmp_path)
    c.record("a", "/w/a", "/w", kind="task", now_ms=1)
    with open(c.journal_path, "a") as f:
        f.write('{"put": {"name": "b", "pa')  # the crash cut this append short
    assert _crashed(tmp_path) == _entries(c)


def test_a_crash_between_snapshot_and_journal_truncation_replays_harmlessly(tmp_path):
    c = Catalog(tmp_path)
    for i in range(5):
        c.record(f"w{i}", f"/w/{i}", "/w", kind="task", now_ms=i)
    c.touch("w1", 99)
    c.forget("w3")
    journal = c.journal_path.read_bytes()
    c.save()
    c.journal_path.write_bytes(journal)  # as if the process died right after the rename
    assert _crashed(tmp_path) == _entries(c)


@needs_tmpfs
def test_a_full_state_file_system_keeps_the_catalog_in_memory_until_it_can_be_written(
        tmp_path, caplog):
    """On a real full tmpfs: a change that cannot be journalled, and a snapshot (a stop's
    compaction) that cannot be written, never raise (before stop 55 they crashed the disk
    actor); the entries stay in memory, the catalog says why (`save_error`, logged once),
    no partial snapshot is left, and once there is room the next change writes the whole
    snapshot, so a restart reads every entry."""
    with tmpfs(tmp_path / "state", size="1m") as state:
        c = Catalog(state)
        c.record("a", "/w/a", "/w", kind="task", now_ms=1)
        filler = Filler(state)
        filler.blocks()
        with caplog.at_level(logging.WARNING, logger="motor.disk"):
            c.record("b", "/w/b", "/w", kind="task", now_ms=2)
            c.touch("a", 5)
            c.close()
        assert c.save_error is not None and "cannot be written" in c.save_error
        assert [r.getMessage() for r in caplog.records].count("disk: " + c.save_error) == 1
        assert set(_entries(c)) == {"a", "b"} and c.entries["a"].last_used_ms == 5
        assert sorted(os.listdir(c.dir)) == ["catalog.journal"]  # no partial snapshot
        filler.free()
        c.touch("b", 7)  # the next change: the whole snapshot
        assert c.save_error is None and _crashed(state) == _entries(c)
        assert _crashed(state)["b"]["last_used_ms"] == 7


def test_snapshot_rewrites_are_amortized_over_many_changes(tmp_path):
    c = Catalog(tmp_path)
    for i in range(10):
        c.record(f"w{i}", f"/w/{i}", "/w", kind="task", now_ms=i)
    for t in range(2000):
        c.touch(f"w{t % 10}", 100 + t)
    # one snapshot per COMPACT_MIN + 1 changes (the catalog is smaller than COMPACT_MIN)
    assert c.compactions == 2010 // (COMPACT_MIN + 1)
    assert c.journal_lines <= COMPACT_MIN
    assert _crashed(tmp_path) == _entries(c)
    c.close()  # an orderly stop: everything in the snapshot, the journal empty
    assert c.journal_path.read_bytes() == b""
    body = json.loads(c.path.read_text())
    assert {w["name"]: w["last_used_ms"] for w in body["workspaces"]}["w9"] == 100 + 1999


async def test_a_job_end_is_on_disk_when_the_actor_has_handled_it(tmp_path):
    """The actor's answer to JobIdle (or PrepareSetup) means the catalog files hold it."""
    state = tmp_path / "state"
    ms = [1_800_000_000_000]

    class Clock:
        def now_ms(self):
            return ms[0]

    actor = DiskActor(state, 0, 0, workspace_roots=[tmp_path / "ws"], clock=Clock())
    sup = actors.Supervisor("t", [actors.ChildSpec(name="disk", factory=lambda: actor)])
    async with trio.open_nursery() as n:
        await n.start(sup.run)
        ref = sup.ref("disk")
        for i in range(30):
            name = f"w{i % 4}"
            plan = await ref.call(PrepareSetup(f"job{i}", name))
            assert plan.refusal is None
            os.makedirs(plan.path, exist_ok=True)  # the job's setup makes the tree
            ms[0] += 1000
            await ref.call(JobIdle(f"job{i}", name))
            on_disk = _crashed(state)
            assert on_disk == _entries(actor.catalog), i
            assert on_disk[name]["last_used_ms"] == ms[0]
        assert actor.catalog.compactions == 0  # 34 changes, not 34 catalog rewrites
        sup.shutdown()


@pytest.mark.e2e
def test_runner_killed_right_after_job_ends_still_has_their_workspaces(serve_factory):
    serve = serve_factory().start()
    for i in range(4):
        result = serve.cli("run", "--workspace", f"w{i % 3}", "--", "true")
        assert result.returncode == 0, result.stderr.decode()
    serve.kill9()  # no orderly stop: no compaction
    serve = serve_factory().start()
    rows = {row["name"]: row for row in serve.cli_json("workspaces")}
    assert set(rows) == {"w0", "w1", "w2"}
    assert all(row["path"].endswith("/" + name) for name, row in rows.items())


@pytest.mark.parametrize("snapshot", [
    "[1, 2]",  # JSON, not an object
    '{"workspaces": 5}',
    '{"workspaces": [{"name": 5, "path": 6, "root": null, "last_used_ms": "x"}, 7]}',
])
async def test_a_damaged_catalog_is_read_as_far_as_it_goes_and_the_runner_serves(
        tmp_path, autojump_clock, snapshot, caplog):
    """Before stop 48 a snapshot that was JSON but not an object, or an entry with a number
    for its path, crashed the disk (or maintenance) actor at each start until the runner
    stopped. Now what is not an entry is left out, said once, and the good entries stay."""
    config = embedded_config(tmp_path)
    state = Path(config.state_dir)
    disk, kept = state / "disk", state / "workspaces" / "kept"
    disk.mkdir(parents=True)
    kept.mkdir(parents=True)  # a workspace an earlier run made, in the journal's good entry
    (disk / "catalog.json").write_text(snapshot)
    now_ms = config.clock.now_ms()  # used just now: no idle expiry removes it
    good = {"name": "kept", "path": str(kept), "root": str(kept.parent), "kind": "task",
            "caller_path": None, "created_ms": now_ms, "last_used_ms": now_ms,
            "referenced_by": []}
    (disk / "catalog.journal").write_text(
        '{"put": 7}\n[1]\n{"del": 3}\n' + json.dumps({"put": good}) + "\n")
    caplog.set_level(logging.WARNING, logger="motor.disk")
    async with motor.open_runner(config) as runner:
        job = await runner.submit(JobRequest(command=["true"], workspace="w"))
        assert (await terminal_of(runner, job.job_id))["state"] == "succeeded"
        names = {w["name"] for w in await runner.workspaces()}
        assert {"kept", "w"} <= names
        assert runner.root.ref("disk").restarts_in_window() == 0
        assert runner.root.ref("maintenance").restarts_in_window() == 0
    assert any("could not be read and were left out" in r.getMessage() for r in caplog.records)
