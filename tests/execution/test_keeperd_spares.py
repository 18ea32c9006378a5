"""keeperd's pre-placed threads on cgroup v1 (motor/execution/spares.py), for real: a job
started from a spare is in its groups from its first instruction (spawned by a thread of
keeperd that joined the renamed groups ahead of time, with the job's limits), the groups
hold the job alone once keeperd answers, the pool refills, a keeperd that exits or is
killed leaves no spare group behind (the killed one's are removed by the next keeperd as
it starts).

Needs root and writable cgroup v1 cpuset/memory/cpuacct hierarchies (this build host);
skips with the reason elsewhere. Every group lives under a parent of the test's own
(tests/private_cgroup.py)."""

from __future__ import annotations

import dataclasses
from contextlib import asynccontextmanager
import os
import sys
import signal

import psutil
import pytest
import trio
from keeper_helpers import records, wait_until
from keeper_tracking import ask_keeperd, write_job_dir
from private_cgroup import private_parent_name, remove_private_parent

from motor.execution import read_keeper, read_status
from motor.execution import keeperd as keeperd_mod
from motor.execution import spares as spares_mod
from motor.execution.keeperd_client import open_keeperd_spawner
from motor.isolation import IsolationError
from motor.isolation.cgroup import V1_CONTROLLERS, open_cgroup_backend


def _v1_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root"
    name = private_parent_name()
    try:
        backend = open_cgroup_backend(parent=name)
    except IsolationError as exc:
        return f"no writable cgroups: {exc}"
    finally:
        remove_private_parent(name)
    if backend.version != 1:
        return "the spares are for cgroup v1 hierarchies"
    return None


pytestmark = pytest.mark.skipif(_v1_unavailable() is not None, reason=_v1_unavailable() or "")


@pytest.fixture
def v1():
    """A v1 backend in the runner's mode (the keeper makes the groups), own parent."""
    name = private_parent_name()
    backend = dataclasses.replace(open_cgroup_backend(parent=name), keeper_makes_groups=True)
    try:
        yield backend
    finally:
        remove_private_parent(name)


async def _ready_spares(state, n: int) -> list[str]:
    """Wait until keeperd has n spares that joined their groups; their names."""
    return await wait_until(lambda: (lambda a: a["ready"] if len(a["ready"]) == n else None)(
        ask_keeperd(state, "spares")))


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _spare_dirs(backend) -> list[str]:
    out = []
    for parent in backend.flavour.parent_paths():
        out += [os.path.join(parent, n) for n in os.listdir(parent) if n.startswith("spare-")]
    return sorted(out)


def _group_lines(job_dir) -> dict[str, str]:
    """controller -> group path, from the job's own /proc/self/cgroup (its stdout)."""
    out = b"".join(data for stream, data in records(job_dir) if stream == "stdout").decode()
    lines = {}
    for line in out.splitlines():
        _, names, path = line.split(":", 2)
        for name in names.split(","):
            lines[name] = path
    return lines


def _job(state, backend, workspace, job_id: str, command: list[str], cpus=None, memory=None):
    fields = backend.prepare(job_id, cpus, memory)
    return write_job_dir(state / "jobs" / job_id, job_id, command, workspace, **fields)


async def _run(spawner, job_dir) -> dict:
    handle = await spawner.spawn(job_dir)
    with trio.fail_after(20):
        await spawner.wait_exit(handle.pid, handle.create_time, job_dir)
    return read_status(job_dir)


@asynccontextmanager
async def _pool(tmp_path, workspace, v1, monkeypatch, size: int, first: str = "first",
                command: tuple[str, ...] = ("true",)):
    """keeperd on a new state dir keeping `size` spares: its first job (`first`, which
    forks and joins: no pool yet) teaches it v1's parent. Yields (spawner, state dir, the
    first job's dir, the ready spares' names)."""
    monkeypatch.setenv(spares_mod.SIZE_ENV, str(size))
    monkeypatch.setenv(keeperd_mod.RECORD_PID_AFTER_ENV, "0")  # short jobs' pids looked up
    state = tmp_path / "state"
    state.mkdir()
    async with open_keeperd_spawner(state) as spawner:
        job_dir = _job(state, v1, workspace, first, list(command))
        assert (await _run(spawner, job_dir))["exit_code"] == 0
        yield spawner, state, job_dir, await _ready_spares(state, size)


async def test_a_job_from_a_spare_is_in_its_groups_from_its_first_instruction(
        tmp_path, workspace, v1, monkeypatch):
    """The first job of a parent forks and joins (no spare yet) and teaches keeperd the
    parent; keeperd then keeps 2 spares there. The next job comes from one of them: `cat
    /proc/self/cgroup` exec'd straight away shows the job's own groups in every hierarchy,
    the groups carry the job's CPUs and memory limit (a second job with other needs gets
    its own), and the pool refills with new spares. A job from a spare is keeperd's child
    and, once keeperd has answered its start, the only task in its groups (the spare's
    thread has left them)."""
    cpus = sorted(os.sched_getaffinity(0))
    parent = v1.flavour.parent
    async with _pool(tmp_path, workspace, v1, monkeypatch, 2,
                     command=("cat", "/proc/self/cgroup")) as (spawner, state, first, waiting):
        assert {c: _group_lines(first)[c] for c in V1_CONTROLLERS} == \
            {c: f"/{parent}/job-first" for c in V1_CONTROLLERS}
        kept = ask_keeperd(state, "spares")["kept"]  # ("first"'s groups, for the next spare)
        assert len(_spare_dirs(v1)) == (2 + kept) * len(V1_CONTROLLERS)

        for taken, (job_id, cpu, memory) in enumerate(
                (("second", cpus[-1], 64 << 20), ("third", cpus[0], 96 << 20)), 1):
            dirs = v1.flavour.job_dirs(job_id)  # the job reads its limits (stderr): keeperd
            # removes its groups, empty, at its end
            job_dir = _job(state, v1, workspace, job_id, [
                "sh", "-c", 'cat /proc/self/cgroup; cat "$0/cpuset.cpus" "$1/memory.limit_in_bytes" >&2',
                dirs["cpuset"], dirs["memory"]], [cpu], memory)
            assert (await _run(spawner, job_dir))["exit_code"] == 0
            pool = ask_keeperd(state, "spares")
            assert pool["taken"] == taken and pool["missed"] == 1, pool  # 1: the first job
            assert {c: _group_lines(job_dir)[c] for c in V1_CONTROLLERS} == \
                {c: f"/{parent}/job-{job_id}" for c in V1_CONTROLLERS}
            limits = b"".join(data for stream, data in records(job_dir) if stream == "stderr")
            assert limits.decode().split() == [str(cpu), str(memory)]
            assert read_status(job_dir)["isolation_released"] is True  # keeperd removes them:
            await wait_until(lambda: not any(os.path.isdir(d) for d in dirs.values()))
            refilled = await _ready_spares(state, 2)
            assert len(set(refilled) - set(waiting)) == 1  # one taken, one new in its place
            waiting = refilled

        held = _job(state, v1, workspace, "held", ["sleep", "30"])
        handle = await spawner.spawn(held)
        assert ask_keeperd(state, "spares")["taken"] == 3
        job_pid = await wait_until(lambda: (read_keeper(held) or {}).get("job_pid"))
        assert psutil.Process(job_pid).ppid() == spawner.keeperd_pid
        for d in v1.flavour.job_dirs("held").values():
            for listing in ("tasks", "cgroup.procs"):
                with open(os.path.join(d, listing)) as f:
                    assert f.read().split() == [str(job_pid)], (d, listing)
        os.kill(job_pid, signal.SIGKILL)
        with trio.fail_after(20):
            await spawner.wait_exit(handle.pid, handle.create_time, held)
        for job_id in ("first", "second", "third", "held"):
            assert v1.finish(job_id)["cleanup_error"] is None
        keeperd_pid = spawner.keeperd_pid
    # idle keeperd exits, and takes its spares (threads and groups) with it
    await wait_until(lambda: _gone(keeperd_pid), 30)
    assert _spare_dirs(v1) == []


async def test_a_killed_keeperds_spares_are_gone_once_the_next_one_started(
        tmp_path, workspace, v1, monkeypatch):
    """SIGKILL keeperd with 2 spares ready (and maybe "only"'s groups kept for the next one):
    its spare threads die with it; the groups stay until the next keeperd of the state dir
    starts and removes them (it reads the parents from keeperd.spares) before it says it is
    ready."""
    async with _pool(tmp_path, workspace, v1, monkeypatch, 2, first="only") as (
            spawner, state, _, _ready):
        kept = ask_keeperd(state, "spares")["kept"]  # ("only"'s groups, for the next spare)
        assert len(_spare_dirs(v1)) == (2 + kept) * len(V1_CONTROLLERS)
        dead = spawner.keeperd_pid
        os.kill(dead, signal.SIGKILL)
        await wait_until(lambda: _gone(dead))
    assert v1.finish("only")["cleanup_error"] is None
    async with open_keeperd_spawner(state) as spawner:
        assert spawner.keeperd_pid != dead
        assert _spare_dirs(v1) == []
        # and the new keeperd makes spares of its own with the next job
        again = _job(state, v1, workspace, "again", ["true"])
        assert (await _run(spawner, again))["exit_code"] == 0
        await _ready_spares(state, 2)
        assert v1.finish("again")["cleanup_error"] is None


async def test_a_runners_start_fills_the_pool_before_its_first_job(
        tmp_path, workspace, v1, monkeypatch):
    """A runner's start names its parent groups in keeperd's "prepare" (stop 64), whose
    answer the spawner awaits: the pool is full of spares that joined by then, and the
    first job comes from one of them (it forked and joined its groups itself before). A
    restarted runner's prepare is answered at once when the pool a lone start left short
    is not due for its refill (it does not wait for it)."""
    monkeypatch.setenv(spares_mod.SIZE_ENV, "4")
    monkeypatch.setenv(spares_mod.REFILL_IDLE_ENV, "30")  # keeperd's: no refill by the clock
    state = tmp_path / "state"
    state.mkdir()
    prepare = {"spare_parents": v1.spare_parents()}
    async with open_keeperd_spawner(state, prepare=prepare) as spawner:
        assert spawner.prepared.resp["prepared"] == ["cgroup"], spawner.prepared.resp
        assert spawner.prepared.resp["spare_pool"] == 4, spawner.prepared.resp
        pool = ask_keeperd(state, "spares")
        assert len(pool["ready"]) == 4 and pool["joining"] == [], pool
        assert pool["parents"] == v1.spare_parents(), pool
        job_dir = _job(state, v1, workspace, "first", ["cat", "/proc/self/cgroup"], None, 64 << 20)
        assert (await _run(spawner, job_dir))["exit_code"] == 0
        pool = ask_keeperd(state, "spares")
        assert pool["taken"] == 1 and pool["missed"] == 0, pool
        assert {c: _group_lines(job_dir)[c] for c in V1_CONTROLLERS} == \
            {c: f"/{v1.flavour.parent}/job-first" for c in V1_CONTROLLERS}
        assert v1.finish("first")["cleanup_error"] is None
    async with open_keeperd_spawner(state, prepare=prepare) as spawner:  # a restart
        assert spawner.prepared.resp is not None, "the start waited out PREPARE_WAIT_S"
        # three: a lone start above half the pool refills only after 30 s here
        assert spawner.prepared.resp["spare_pool"] == 3, spawner.prepared.resp


async def test_without_spares_a_v1_job_makes_and_joins_its_groups(
        tmp_path, workspace, v1, monkeypatch):
    """MOTOR_KEEPERD_SPARES=0: no spare is ever made; every job forks, makes its groups
    from the spec and joins them before exec (the old way)."""
    monkeypatch.setenv(spares_mod.SIZE_ENV, "0")
    state = tmp_path / "state"
    state.mkdir()
    async with open_keeperd_spawner(state) as spawner:
        for job_id in ("a", "b"):
            job_dir = _job(state, v1, workspace, job_id, ["cat", "/proc/self/cgroup"], None, 64 << 20)
            assert (await _run(spawner, job_dir))["exit_code"] == 0
            assert {c: _group_lines(job_dir)[c] for c in V1_CONTROLLERS} == \
                {c: f"/{v1.flavour.parent}/job-{job_id}" for c in V1_CONTROLLERS}
            assert ask_keeperd(state, "spares") == {
                "id": 1, "size": 0, "parents": {}, "taken": 0, "missed": 0, "made": 0,
                "reused": 0, "kept": 0, "skipped_writes": 0, "ready": [], "joining": []}
            assert _spare_dirs(v1) == []
            assert v1.finish(job_id)["cleanup_error"] is None


async def test_a_spare_that_cannot_exec_the_job_ends_it_spawn_failed(
        tmp_path, workspace, v1, monkeypatch):
    """A job from a spare whose cwd does not exist: the spare's thread says why and ends;
    the job ends spawn_failed with the same detail as the fork+exec path, its groups
    empty, and a new spare takes the used one's place."""
    from motor.execution.keeper import SPAWN_FAILED_EXIT_CODE

    async with _pool(tmp_path, workspace, v1, monkeypatch, 1) as (spawner, state, _, waiting):
        fields = v1.prepare("nocwd", None, None)
        bad = write_job_dir(state / "jobs" / "nocwd", "nocwd", ["true"], workspace, **fields)
        spec = (bad / "spec.json").read_text().replace(str(workspace), str(tmp_path / "gone"))
        (bad / "spec.json").write_text(spec)
        status = await _run(spawner, bad)
        assert status["reason"] == "spawn_failed" and status["exit_code"] == SPAWN_FAILED_EXIT_CODE
        assert "cannot use cwd" in status["detail"], status
        assert ask_keeperd(state, "spares")["taken"] == 1
        assert v1.flavour.pids("nocwd") == []
        assert await _ready_spares(state, 1) != waiting  # a new spare took its place
        for job_id in ("first", "nocwd"):
            assert v1.finish(job_id)["cleanup_error"] is None


def _asleep_in_futex(tid: int) -> bool:
    """A thread of this process sleeps in futex(2) (a threading.Event's wait); on an
    architecture other than x86_64, asleep at all."""
    import platform

    with open(f"/proc/self/task/{tid}/stat") as f:
        asleep = f.read().rsplit(")", 1)[1].split()[0] == "S"
    if platform.machine() != "x86_64":
        return asleep
    with open(f"/proc/self/task/{tid}/syscall") as f:
        return asleep and f.read().split()[0] == "202"


def test_a_claimed_spare_starts_the_jobs_cpu_counter_at_zero(tmp_path, v1):
    """The pool on its own (in this process): a spare's thread joins its groups (it alone:
    this process's other threads stay where they are) and runs a little there (its
    cpuacct.usage grows above 0); the claim gives the groups the job's name and limit and
    zeroes the counters, so the job's CPU time is only the job's (the thread is asleep
    until its order); the order makes it spawn the job in those groups and end, so the
    job, this process's child, is then alone in them."""
    import selectors

    from polling import wait_for

    from motor.execution.spares import SparePool

    sel = selectors.DefaultSelector()
    log: list[str] = []
    pool = SparePool(str(tmp_path), sel, 1, log.append)
    job_pid = None
    make = v1.prepare("acct", None, 64 << 20)["cgroup_make"]
    pool.learn(make)
    pool.fill_one()

    def pump():
        for key, events in sel.select(0.05):
            key.data(events)
        return pool.describe()["ready"]

    def listed(d: str, name: str) -> list[str]:
        with open(os.path.join(d, name)) as f:
            return f.read().split()

    try:
        [name] = wait_for(pump, what="the spare ready")
        spare = pool.spares[name]
        spare_dirs = spare.dirs
        assert all(listed(d, "tasks") == [str(spare.tid)] for d in spare_dirs.values())
        with open("/proc/self/cgroup") as f:
            own = f.read()
        assert f"/{name}" not in own

        def usage(dirs) -> int:
            with open(os.path.join(dirs["cpuacct"], "cpuacct.usage")) as f:
                return int(f.read())

        assert wait_for(lambda: usage(spare_dirs) > 0, what="the spare's own CPU charged")
        # It said ready before it reached its wait: claim it only once it sleeps there, or
        # the few instructions in between are charged after the claim's reset.
        wait_for(lambda: _asleep_in_futex(spare.tid), what="the spare asleep in its wait")
        assert pool.take(make) is spare
        assert pool.claim(spare, make)
        job = v1.flavour.job_dirs("acct")
        assert not any(os.path.exists(d) for d in spare_dirs.values())
        assert usage(job) == 0
        with open(os.path.join(job["memory"], "memory.limit_in_bytes")) as f:
            assert int(f.read()) == 64 << 20
        r, w = os.pipe()
        job_pid = pool.order(spare, spares_mod.orders_of(
            {"cwd": str(tmp_path)}, "/bin/sh", ["sh", "-c", "cat /proc/self/cgroup; exec sleep 30"],
            {}), w, w)
        os.close(w)
        assert not os.path.exists(f"/proc/self/task/{spare.tid}")
        for d in job.values():  # the spare's thread is out, this process is in none of them
            assert str(spare.tid) not in listed(d, "tasks")
            assert str(os.getpid()) not in listed(d, "cgroup.procs")
        with os.fdopen(r) as f:
            out = "".join(f.readline() for _ in own.splitlines())
        assert out.count("/job-acct\n") == 3, out
        # once its `cat` is gone, the job alone
        wait_for(lambda: all(listed(d, "tasks") == listed(d, "cgroup.procs") == [str(job_pid)]
                             for d in job.values()), what="the job alone in its groups")
        os.kill(job_pid, signal.SIGKILL)
        _, status = os.waitpid(job_pid, 0)  # this process's child
        job_pid = None
        assert os.waitstatus_to_exitcode(status) == -signal.SIGKILL
        assert usage(job) > 0  # the job's own exec and run
    finally:
        if job_pid is not None:
            os.kill(job_pid, signal.SIGKILL)
            os.waitpid(job_pid, 0)
        pool.close()
        assert v1.finish("acct")["cleanup_error"] is None
    assert log == []


async def test_after_a_lone_start_the_pool_waits_to_refill_and_a_burst_refills_at_once(
        tmp_path, workspace, v1, monkeypatch):
    """Issue 14: a spare's join stalls forks and exits host-wide for an RCU grace period
    unless another migration came shortly before. After a lone job's start (no other start
    within `MOTOR_KEEPERD_REFILL_IDLE_S`, here made 30 s so nothing refills by the clock) a
    pool above half its size is not topped up: the job just started runs without that
    stall. A second start within that time is a burst: the pool is topped up at once,
    every missing spare together (their joins close together)."""
    monkeypatch.setenv(spares_mod.REFILL_IDLE_ENV, "30")
    async with _pool(tmp_path, workspace, v1, monkeypatch, 4) as (spawner, state, _, full):
        lone = _job(state, v1, workspace, "lone", ["true"])
        assert (await _run(spawner, lone))["exit_code"] == 0
        after = ask_keeperd(state, "spares")
        assert after["taken"] == 1 and set(after["ready"]) < set(full)  # one used
        assert len(after["ready"]) == 3 and after["joining"] == [], after  # not refilled
        burst = _job(state, v1, workspace, "burst", ["true"])
        assert (await _run(spawner, burst))["exit_code"] == 0
        refilled = await _ready_spares(state, 4)  # two new spares, made together
        assert len(set(refilled) - set(full)) == 2
        assert ask_keeperd(state, "spares")["taken"] == 2
        for job_id in ("first", "lone", "burst"):
            assert v1.finish(job_id)["cleanup_error"] is None


def _knob(d: str, name: str) -> str:
    with open(os.path.join(d, name)) as f:
        return f.read().strip()


async def test_an_ended_jobs_groups_become_a_spare_and_a_job_with_its_limits_writes_none(
        tmp_path, workspace, v1, monkeypatch):
    """Issue 14: the groups of a job that ended with nothing left in them, no OOM kill and
    little memory still charged are not removed: keeperd renames them to a spare's at once
    (`kept`) and at the pool's next refill a thread joins them (no mkdir and no rmdir: the
    costly part of a v1 group). A job with the same CPUs and memory limit as the one that
    ended there is given such a spare when one is ready, and its claim writes no limit at
    all (they are there already). Three such jobs in a row on a pool of one, each held
    until the refill that follows its start is done (else, on a loaded host, a short job can
    end first, find "first"'s groups still waiting and have its own removed: at most the
    pool's size of them wait): "a" and "b" get new groups or "first"'s, "c" gets "a"'s
    (three writes left out, against one, the memory nodes, for each of the others), and
    each finds its own name and limits. A fourth job with no memory limit, from "b"'s
    groups, gets none: its claim writes that limit."""
    cpu = sorted(os.sched_getaffinity(0))[-1]
    async with _pool(tmp_path, workspace, v1, monkeypatch, 1) as (spawner, state, _, _ready):
        before = ask_keeperd(state, "spares")
        for job_id in ("a", "b", "c"):
            gate = tmp_path / f"{job_id}.go"
            dirs = v1.flavour.job_dirs(job_id)
            job = _job(state, v1, workspace, job_id, [
                "sh", "-c", 'while [ ! -e "$2" ]; do :; done; cat /proc/self/cgroup; '
                'cat "$0/cpuset.cpus" "$1/memory.limit_in_bytes" >&2',
                dirs["cpuset"], dirs["memory"], str(gate)], [cpu], 64 << 20)
            handle = await spawner.spawn(job)
            # the refill after this start took the waiting groups: the job's own get room
            await wait_until(lambda: (lambda a: len(a["ready"]) == 1 and a["kept"] == 0)(
                ask_keeperd(state, "spares")))
            gate.touch()
            with trio.fail_after(20):
                await spawner.wait_exit(handle.pid, handle.create_time, job)
            assert read_status(job)["exit_code"] == 0
            assert {c: _group_lines(job)[c] for c in V1_CONTROLLERS} == \
                {c: f"/{v1.flavour.parent}/job-{job_id}" for c in V1_CONTROLLERS}
            limits = b"".join(data for stream, data in records(job) if stream == "stderr")
            assert limits.decode().split() == [str(cpu), str(64 << 20)]
            facts = read_status(job)["isolation_facts"]
            assert facts["oom_killed"] is False and facts["memory_max"] == 64 << 20
            # its groups renamed (kept) or removed: not under the job's name
            await wait_until(lambda: not any(os.path.isdir(d) for d in dirs.values()))
        after = ask_keeperd(state, "spares")
        assert after["taken"] - before["taken"] == 3
        # "a"'s and "b"'s, and "first"'s when they waited
        assert after["reused"] - before["reused"] == 2 + before["kept"], after
        assert after["skipped_writes"] - before["skipped_writes"] == 5, after
        # a job with the same CPU and no memory limit, from an ended job's groups (they
        # carry 64 MiB): its claim leaves out the memory nodes and the CPU (2 writes) and
        # writes the memory limit, which is then unlimited, not the earlier job's
        await _ready_spares(state, 1)
        dirs = v1.flavour.job_dirs("d")
        job = _job(state, v1, workspace, "d", [
            "sh", "-c", 'cat "$0/memory.limit_in_bytes"', dirs["memory"]], [cpu], None)
        assert (await _run(spawner, job))["exit_code"] == 0
        last = ask_keeperd(state, "spares")
        assert (last["taken"], last["skipped_writes"]) == (
            after["taken"] + 1, after["skipped_writes"] + 2), last
        limit = b"".join(data for stream, data in records(job) if stream == "stdout")
        assert int(limit) >= 1 << 62, limit  # v1's "no limit" (the largest page multiple)
        for job_id in ("first", "a", "b", "c", "d"):
            assert v1.finish(job_id)["cleanup_error"] is None


HOG = "import sys; sys.stdout.write(str(len(b'x' * (256 << 20))))"


@pytest.mark.parametrize("command, why", [
    ([sys.executable, "-c", HOG], "killed by the OOM killer (its count stays)"),
    (["dd", "if=/dev/zero", "of=held", "bs=1M", "count=4", "status=none"],
     "4 MiB of page cache still charged to it"),
], ids=["oom", "charged"])
async def test_an_ended_jobs_groups_are_removed_when_they_would_mislead_the_next_job(
        tmp_path, workspace, v1, monkeypatch, command, why):
    """Groups whose counters the next job would inherit are not kept for a spare: a job
    OOM-killed in them (v1's `oom_kill` cannot be zeroed) or one that left more than
    `RECYCLE_MAX_USAGE` charged there. They are removed; no spare gets them. (A pool of two:
    at most "first"'s groups wait for a spare when "j" ends, so there is room for "j"'s;
    it is the rule that turns them away.)"""
    async with _pool(tmp_path, workspace, v1, monkeypatch, 2) as (spawner, state, _, _ready):
        job = _job(state, v1, workspace, "j", command, None, 32 << 20)
        status = await _run(spawner, job)
        assert status["isolation_facts"]["oom_killed"] is why.startswith("killed"), status
        assert ask_keeperd(state, "spares")["kept"] <= 1
        await wait_until(lambda: not any(os.path.isdir(d)
                                         for d in v1.flavour.job_dirs("j").values()))
        memory = v1.flavour.parent_dir("memory")
        limits = [int(_knob(os.path.join(memory, n), "memory.limit_in_bytes"))
                  for n in os.listdir(memory) if n.startswith("spare-")]
        assert limits and 32 << 20 not in limits  # neither kept nor a spare's: removed
        for job_id in ("first", "j"):
            assert v1.finish(job_id)["cleanup_error"] is None
