"""The compile cache: evicted only as a whole, and never while a cache fill runs."""

from __future__ import annotations

import os

import trio

from fakes import inline_offload
from motor.disk.actor import DiskActor
from motor.disk.core import (
    CompileCache, DiskSample, EvictCompileCache, PlanInput, plan_cleanup,
)

GB = 10**9
NOW = 10_000_000_000
HOUR = 3600 * 1000


def plan(cache, *, free=150 * GB, floor=100 * GB):
    return plan_cleanup(PlanInput(workspaces=(), compile_cache=cache, free_bytes=free,
                                  floor_bytes=floor, goal_bytes=2 * floor, now_ms=NOW))


def test_the_compile_cache_is_evicted_as_a_whole_by_bytes_times_idle():
    cache = CompileCache(path="/srv/cache", allocated_bytes=80 * GB, last_used_ms=NOW - 5 * HOUR)
    assert plan(cache) == [EvictCompileCache("/srv/cache", 80 * GB)]


def test_the_compile_cache_is_not_evicted_while_a_fill_runs():
    cache = CompileCache(path="/srv/cache", allocated_bytes=80 * GB, last_used_ms=NOW - 5 * HOUR,
                         filling=True)
    assert plan(cache) == []
    assert plan(cache, free=10 * GB) == []  # not even below the hard floor


def test_the_compile_cache_ranks_with_workspaces_by_bytes_times_idle():
    from motor.disk.core import Workspace

    small_old = Workspace(name="old", path="/srv/ws/old", root="/srv/ws", allocated_bytes=GB,
                          last_used_ms=NOW - 10 * HOUR)
    cache = CompileCache(path="/srv/cache", allocated_bytes=60 * GB, last_used_ms=NOW - 2 * HOUR)
    actions = plan_cleanup(PlanInput(workspaces=(small_old,), compile_cache=cache,
                                     free_bytes=150 * GB, floor_bytes=100 * GB,
                                     goal_bytes=200 * GB, now_ms=NOW, allowed_roots=("/srv/ws",)))
    # 60 GB x 2 h ranks before 1 GB x 10 h, and the goal is met once the cache is gone
    assert actions == [EvictCompileCache("/srv/cache", 60 * GB)]


class _Record:
    def __init__(self, kind, state="running"):
        self.job_id, self.workspace, self.siblings = f"j-{kind}", f"w-{kind}", []
        self.kind, self.state, self.bundle_sha256 = kind, state, None


async def test_the_disk_actor_empties_the_whole_cache_only_without_a_fill(tmp_path, autojump_clock):
    cache = tmp_path / "cache"
    (cache / "ab" / "cd").mkdir(parents=True)
    (cache / "ab" / "cd" / "entry").write_bytes(b"x" * 100_000)
    jobs = [_Record("cache_fill")]
    free = {"bytes": 10}  # always below the floor: cleanup runs every time it is asked

    def probe(path):
        return DiskSample(free_bytes=free["bytes"], total_bytes=10**12)

    actor = DiskActor(tmp_path / "state", floor_bytes=1000, goal_bytes=2000, probe=probe,
                      offload=inline_offload,  # virtual time: no worker thread
                      workspace_roots=[tmp_path / "ws"], live_jobs=lambda: jobs,
                      compile_cache=str(cache))
    (tmp_path / "state").mkdir()
    async with trio.open_nursery() as nursery:
        await nursery.start(actor.run)
        await actor.room.cleanup(str(tmp_path / "state"), frozenset())
        assert (cache / "ab" / "cd" / "entry").exists()  # a fill runs: untouched
        jobs.clear()
        await actor.room.cleanup(str(tmp_path / "state"), frozenset())
        assert cache.is_dir() and os.listdir(cache) == []  # evicted whole, recreated empty
        nursery.cancel_scope.cancel()
