"""The pure parts moved out of the disk actor's shell (issue 15): one cleanup's decisions
(`core.CleanupRun`), the maintenance choice (`core.maintenance_due`), the size cache and the
planner's view of entries (`book.py`), what admissions and reservations protect
(`live.Holds`), name resolution (`names.Names`). The actor-level behaviour stays tested
through the actor (test_actor.py); these pin each rule on its own."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import pytest

from motor.disk.book import SizeCache, held, listing_row, workspace_of
from motor.disk.catalog import Entry
from motor.disk.core import (
    CleanupRun, DiskSample, EvictWorkspace, Repair, Workspace, admission, inode_floors,
    maintenance_due,
)
from motor.disk.live import INFLIGHT_S, Holds, Live
from motor.disk.names import Names
from motor.disk.sizes import Sizes

GB = 10**9
HOUR = 3600 * 1000
NOW = 10_000_000_000
ROOT = "/srv/ws"


def ws(name, *, idle_ms=2 * HOUR, alloc=GB, **kw) -> Workspace:
    return Workspace(name=name, path=f"{ROOT}/{name}", root=ROOT, allocated_bytes=alloc,
                     target_bytes=0, incremental_bytes=0, last_used_ms=NOW - idle_ms, **kw)


def sample(free: int) -> DiskSample:
    return DiskSample(free_bytes=free, total_bytes=1000 * GB)


def next_action(run: CleanupRun, wss, free: int):
    return run.next_action(wss, (), None, sample(free), NOW, (ROOT,), frozenset())


def test_a_cleanup_run_that_dipped_below_the_floor_stays_hard_until_the_goal():
    recent = [ws("recent", idle_ms=60_000)]
    run = CleanupRun(floor_bytes=100 * GB, goal_bytes=200 * GB)
    assert run.needed(sample(50 * GB)) and run.hard
    # above the floor now, below the goal: the recent workspace stays eligible
    assert run.needed(sample(150 * GB)) and run.hard
    assert next_action(run, recent, 150 * GB) == EvictWorkspace("recent", f"{ROOT}/recent", GB)
    # a run that starts above the floor protects it
    soft = CleanupRun(floor_bytes=100 * GB, goal_bytes=200 * GB)
    assert soft.needed(sample(150 * GB)) and not soft.hard
    assert next_action(soft, recent, 150 * GB) is None
    assert not soft.needed(sample(200 * GB))  # the goal is met: done


def test_a_cleanup_run_skips_failed_deletions_and_takes_repaired_trees_as_complete():
    run = CleanupRun(floor_bytes=100 * GB, goal_bytes=200 * GB)
    run.needed(sample(150 * GB))
    wss = [ws("odd", complete=False), ws("b", idle_ms=HOUR)]
    # the incomplete estimate is repaired before anything is decided for it
    first = next_action(run, wss, 150 * GB)
    assert first == Repair("odd", f"{ROOT}/odd", "incremental")
    run.done(first, True)
    # measured again, still flagged incomplete in the caller's view: taken as complete now;
    # the older one ranks first (bytes x idle)
    second = next_action(run, wss, 150 * GB)
    assert second == EvictWorkspace("odd", f"{ROOT}/odd", GB)
    run.done(second, False)  # the deletion failed: skipped for the rest of this run
    third = next_action(run, wss, 150 * GB)
    assert third == EvictWorkspace("b", f"{ROOT}/b", GB)
    run.done(third, False)
    assert next_action(run, wss, 150 * GB) is None
    assert run.failed == {"odd", "b"}


def test_maintenance_expires_idle_tasks_sweeps_daily_and_leaves_protected_ones():
    day = 24 * HOUR
    assert maintenance_due(ws("t", idle_ms=day + 1), None, NOW, (ROOT,)) == "expire"
    assert maintenance_due(ws("h", idle_ms=day + 1, kind="head"), None, NOW, (ROOT,)) == "sweep"
    assert maintenance_due(ws("h", kind="head"), NOW - HOUR, NOW, (ROOT,)) is None  # swept today
    assert maintenance_due(ws("h", kind="head"), NOW - day, NOW, (ROOT,)) == "sweep"
    assert maintenance_due(ws("t", idle_ms=2 * day, running=True), None, NOW, (ROOT,)) is None
    assert maintenance_due(ws("t", idle_ms=2 * day, reserved=True), None, NOW, (ROOT,)) is None
    assert maintenance_due(ws("t", idle_ms=2 * day), None, NOW, ("/elsewhere",)) is None


def test_the_size_cache_walks_only_unmeasured_or_used_trees():
    cache = SizeCache()
    s = Sizes(10, 5, 1, True, NOW)
    assert cache.wanted(["a", "b"]) == {"a", "b"}
    cache.store("a", s, 3)
    assert cache.wanted(["a", "b"]) == {"b"}
    cache.used("a")
    assert cache.wanted(["a"]) == {"a"}
    cache.store("a", s, 0)
    assert cache.wanted(["a"]) == set()
    cache.forget("a")
    assert cache.wanted(["a"]) == {"a"} and "a" not in cache.stale


def test_the_planner_view_of_an_entry_matches_holds_by_name_or_path():
    entry = Entry(name="w", path=f"{ROOT}/real", root=ROOT, last_used_ms=NOW - HOUR)
    cache = SizeCache()
    cache.store("w", Sizes(100, 40, 10, False, NOW), 7)
    by_path = Live()
    by_path.reserved = by_path.reserved | {f"{ROOT}/real"}
    w = workspace_of(entry, cache, by_path, (ROOT,))
    assert (w.reserved, w.running, w.allocated_bytes, w.stale_bytes, w.complete) == (
        True, False, 100, 7, False)
    assert held(by_path, entry, "running", "reserved") and not held(by_path, entry, "running")
    row = listing_row(entry, None, by_path, NOW, False, (ROOT,))
    assert row["protected"] == "reserved" and row["allocated_bytes"] is None
    row = listing_row(entry, cache.sizes["w"], Live(), NOW, False, (ROOT,))
    assert (row["protected"], row["allocated_bytes"], row["idle_ms"]) == (None, 100, HOUR)
    assert listing_row(entry, None, Live(), NOW - HOUR + 60_000, False, (ROOT,))[
        "protected"] == "used in the last 30 minutes"


class FakeNames:
    """canon: a name's path is /p/<name>; key never changes."""

    def canon(self, name: str) -> str:
        return f"/p/{name}"

    def key(self) -> tuple:
        return ()


@dataclass
class Rec:
    job_id: str
    state: str
    workspace: str
    siblings: tuple = ()


def test_an_admission_protects_until_recorded_released_or_its_deadline():
    recorded: set[str] = set()
    holds = Holds(live_jobs=lambda: [], recorded=recorded.__contains__)
    holds.admit("j1", frozenset({"w", "/p/w"}), now=0.0)
    holds.admit(None, frozenset({"x"}), now=0.0)  # no job id: nothing to hold
    assert "/p/w" in holds.view(1.0, FakeNames()).reserved
    assert "x" not in holds.view(1.0, FakeNames()).reserved
    assert "w" not in holds.view(INFLIGHT_S + 1, FakeNames()).reserved  # deadline passed
    holds.admit("j2", frozenset({"w"}), now=0.0)
    recorded.add("j2")  # its record now decides
    assert "w" not in holds.view(1.0, FakeNames()).reserved
    holds.admit("j3", frozenset({"w"}), now=0.0)
    holds.release("j3")
    assert "w" not in holds.view(1.0, FakeNames()).reserved
    holds.reserve("t", frozenset({"v"}))
    assert "v" in holds.view(1.0, FakeNames()).reserved
    holds.unreserve("t")
    assert "v" not in holds.view(1.0, FakeNames()).reserved


def test_live_jobs_hold_by_name_and_canonical_path_without_an_index():
    live = [Rec("a", "running", "w1", ("s1",)), Rec("b", "queued", "w2")]
    view = Holds(live_jobs=lambda: live).view(0.0, FakeNames())
    assert {"w1", "/p/w1", "s1", "/p/s1"} <= set(view.running)
    assert {"w2", "/p/w2"} <= set(view.reserved) and "w2" not in view.running


def test_names_map_caller_roots_and_refuse_trees_outside_the_roots(tmp_path):
    roots = tmp_path / "ws"
    host = tmp_path / "alice"
    roots.mkdir()
    host.mkdir()
    names = Names(tmp_path / "state", [roots], {"/home/alice/": str(host)})
    assert names.workspace_path("w") == (os.path.join(str(roots), "w"), str(roots))
    assert names.workspace_path("/home/alice/src") == (os.path.join(str(host), "src"), str(host))
    assert names.host_path("/home/alicex/src") is None
    assert names.touched("w", ["/home/alice/src"]) == frozenset(
        {"w", os.path.join(str(roots), "w"), "/home/alice/src", os.path.join(str(host), "src")})
    (roots / "t").mkdir()
    assert names.registered(str(roots / "t")) == (str(roots / "t"), str(roots))
    with pytest.raises(ValueError, match="not under an allowed workspace root"):
        names.registered(str(tmp_path))


def test_names_memo_follows_symlinks_again_after_a_rescan(tmp_path):
    roots = tmp_path / "ws"
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    roots.mkdir()
    (roots / "link").symlink_to(tmp_path / "one")
    names = Names(tmp_path / "state", [roots])
    assert names.canon("link") == str(tmp_path / "one")
    (roots / "link").unlink()
    (roots / "link").symlink_to(tmp_path / "two")
    assert names.canon("link") == str(tmp_path / "one")  # memoized
    names.rescan()
    assert names.canon("link") == str(tmp_path / "two")
    reference = Names(tmp_path / "state", [roots], memo=False)
    assert reference.canon("link") == str(tmp_path / "two")


def test_a_plain_names_one_lstat_path_is_what_realpath_gives(tmp_path):
    """Stop 59: a plain name under a canonical root is resolved with one `lstat` unless it
    is a symlink; whatever it is, the answer is realpath's."""
    from motor.disk.names import _resolved_under

    root = tmp_path / "ws"
    root.mkdir()
    (root / "dir").mkdir()
    (root / "file").write_text("")
    (tmp_path / "elsewhere").mkdir()
    (root / "link").symlink_to(tmp_path / "elsewhere")
    (root / "chain").symlink_to(root / "link")
    (root / "dangling").symlink_to(tmp_path / "nowhere")
    (root / "loop").symlink_to(root / "loop")
    (root / "up").symlink_to("..")
    for name in ("missing", "dir", "file", "link", "chain", "dangling", "loop", "up",
                 "dir/sub", "link/x"):
        assert _resolved_under(str(root), name) == os.path.realpath(root / name), name


def test_the_pure_parts_import_no_trio():
    code = ("import sys; import motor.disk.core, motor.disk.book, motor.disk.live; "
            "print('trio' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "False"


def test_the_disk_actor_shell_stays_under_200_lines():
    """Issue 15: the shell carries messages; rules and I/O live beside it."""
    import motor.disk.actor as shell

    with open(shell.__file__) as f:
        assert len(f.read().splitlines()) < 200


def test_root_of_is_the_root_workspace_path_resolves_to(tmp_path):
    """The room check asks only which allowed root a workspace is under (its file system):
    `Names.root_of` answers what `workspace_path` does, for a plain name, a mapped caller
    path and a catalogued name, without resolving the path."""
    ws_root, host = tmp_path / "ws", tmp_path / "host"
    ws_root.mkdir()
    (host / "proj").mkdir(parents=True)
    names = Names(tmp_path / "state", [ws_root], {"/home/u": str(host)})
    for name in ("plain", "/home/u/proj", "/home/u", "/elsewhere/x"):
        assert names.root_of(name) == names.workspace_path(name)[1], name

    class Catalog:
        def get(self, name):
            return Entry(name=name, path="/srv/cat/x", root="/srv/cat",
                         kind="workspace") if name == "catalogued" else None

    names.catalog = Catalog()
    assert names.root_of("catalogued") == names.workspace_path("catalogued")[1] == "/srv/cat"


def inode_sample(free_bytes: int, free_inodes: int, total_inodes: int = 100_000) -> DiskSample:
    return DiskSample(free_bytes=free_bytes, total_bytes=1000 * GB, free_inodes=free_inodes,
                      total_inodes=total_inodes)


def test_the_inode_floor_is_a_share_of_the_file_systems_inodes_and_none_where_it_counts_none():
    assert inode_floors(inode_sample(0, 0), GB) == (1000, 2000)
    assert inode_floors(inode_sample(0, 0, total_inodes=300), GB) == (64, 128)  # at least 64
    assert inode_floors(inode_sample(0, 0, total_inodes=100), GB) == (25, 50)  # at most 1/4
    assert inode_floors(DiskSample(free_bytes=0, total_bytes=GB), GB) == (0, 0)  # btrfs
    assert inode_floors(inode_sample(0, 0), 0) == (0, 0)  # the byte floor off: this one too


def test_admission_refuses_a_file_system_out_of_inodes_with_bytes_to_spare():
    refusal = admission(inode_sample(500 * GB, 999), 100 * GB)
    assert refusal is not None and refusal.code == "runner_disk_full"
    assert (refusal.free_inodes, refusal.floor_inodes) == (999, 1000)
    assert refusal.free_bytes == 500 * GB and "free inodes 999" in refusal.detail
    assert admission(inode_sample(500 * GB, 1000), 100 * GB) is None
    assert admission(inode_sample(500 * GB, 0), 0) is None  # the floor is off: so is this one
    # a byte refusal says bytes (and the inodes, where counted)
    bytes_short = admission(inode_sample(50 * GB, 50_000), 100 * GB)
    assert "free space" in bytes_short.detail and bytes_short.free_inodes == 50_000


def test_a_cleanup_goes_on_past_the_byte_goal_while_inodes_are_short():
    old = [ws("old", idle_ms=3 * HOUR, alloc=GB), ws("recent", idle_ms=60_000, alloc=GB)]
    run = CleanupRun(floor_bytes=100 * GB, goal_bytes=200 * GB)
    short = inode_sample(500 * GB, 1500)  # bytes well above the goal, inodes below theirs
    assert run.needed(short) and not run.hard  # above the inode floor: recent ones protected
    assert run.next_action(old, (), None, short, NOW, (ROOT,), frozenset()) == EvictWorkspace(
        "old", f"{ROOT}/old", GB)
    below = inode_sample(500 * GB, 10)
    assert run.needed(below) and run.hard  # below the inode floor: hard, until the goal
    assert run.next_action(old[1:], (), None, below, NOW, (ROOT,), frozenset()) == EvictWorkspace(
        "recent", f"{ROOT}/recent", GB)
    assert not run.needed(inode_sample(500 * GB, 2000))  # both goals met
    # with the byte floor off there is no inode goal either
    assert not CleanupRun(floor_bytes=0, goal_bytes=0).needed(inode_sample(500 * GB, 0))


def test_a_refusal_names_the_file_system_it_is_about():
    """Before stop 57 a workspace root's refusal said "the runner's state filesystem"."""
    state = admission(inode_sample(50 * GB, 50_000), 100 * GB)
    assert state.detail.endswith("bytes on the runner's state filesystem")
    root = admission(inode_sample(500 * GB, 10), 100 * GB, "the filesystem of workspace root /w")
    assert "inodes on the filesystem of workspace root /w (it has" in root.detail


def test_a_state_file_system_still_full_after_a_cleanup_gives_up_the_stores_reserve(tmp_path):
    """Stop 58: the disk manager's last resort (room.py). keeperd may hold what it cannot
    write of a running job (its output, its status), with no write of the store's to spend
    the reserve: a cleanup that leaves the state file system full deletes it; one that
    leaves room, or a file system with space, does not."""
    from types import SimpleNamespace

    from motor.disk.room import FULL_BYTES, Room
    from motor.store.reserve import Reserve

    reserve = Reserve(tmp_path / "store.reserve", 1 << 20, 0)
    assert reserve.ensure()
    room = Room(SimpleNamespace(reserve=reserve, state_dir=tmp_path))
    room._last_resort(sample(FULL_BYTES))  # room enough for keeperd's few writes
    assert reserve.held
    room._last_resort(sample(4096))
    assert not reserve.held and reserve.released == 1 and not reserve.path.exists()
    room._last_resort(sample(0))  # gone already: nothing more
    assert reserve.released == 1
    Room(SimpleNamespace(reserve=None, state_dir=tmp_path))._last_resort(sample(0))  # none held
