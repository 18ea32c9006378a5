"""keeperd's pre-placed processes on cgroup v1 (motor/execution/spares.py), for real: a
job started from a spare is in its groups from its first instruction (it is the spare
process, renamed groups and all, with the job's limits), the pool refills, a keeperd that
exits or is killed leaves no spare group or process behind (the killed one's are removed
by the next keeperd as it starts).

Needs root and writable cgroup v1 cpuset/memory/cpuacct hierarchies (this build host);
skips with the reason elsewhere. Every group lives under a parent of the test's own
(tests/private_cgroup.py)."""

from __future__ import annotations

import dataclasses
from contextlib import asynccontextmanager
import os
import signal

import psutil
import pytest
import trio
from keeper_helpers import records, wait_until
from keeper_tracking import ask_keeperd, blocked_in_recvmsg, write_job_dir
from private_cgroup import private_parent_name, remove_private_parent

from motor import faults
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


async def _ready_spares(state, n: int) -> list[int]:
    """Wait until keeperd has n spares that joined their groups; their pids."""
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
    first job's dir, the ready spares' pids)."""
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
    parent; keeperd then keeps 2 spares there. The next job is one of those spare
    processes: `cat /proc/self/cgroup` exec'd straight away shows the job's own groups in
    every hierarchy, the groups carry the job's CPUs and memory limit (a second job with
    other needs gets its own), the job's CPU counter started at zero, and the pool refills."""
    cpus = sorted(os.sched_getaffinity(0))
    parent = v1.flavour.parent
    async with _pool(tmp_path, workspace, v1, monkeypatch, 2,
                     command=("cat", "/proc/self/cgroup")) as (spawner, state, first, waiting):
        assert {c: _group_lines(first)[c] for c in V1_CONTROLLERS} == \
            {c: f"/{parent}/job-first" for c in V1_CONTROLLERS}
        assert len(_spare_dirs(v1)) == 2 * len(V1_CONTROLLERS)

        ran = []
        for job_id, cpu, memory in (("second", cpus[-1], 64 << 20), ("third", cpus[0], 96 << 20)):
            job_dir = _job(state, v1, workspace, job_id, ["cat", "/proc/self/cgroup"],
                           [cpu], memory)
            assert (await _run(spawner, job_dir))["exit_code"] == 0
            job_pid = read_keeper(job_dir)["job_pid"]
            assert job_pid in waiting, (job_pid, waiting)  # it was a pre-placed process
            ran.append(job_pid)
            assert {c: _group_lines(job_dir)[c] for c in V1_CONTROLLERS} == \
                {c: f"/{parent}/job-{job_id}" for c in V1_CONTROLLERS}
            dirs = v1.flavour.job_dirs(job_id)
            with open(os.path.join(dirs["cpuset"], "cpuset.cpus")) as f:
                assert f.read().strip() == str(cpu)
            with open(os.path.join(dirs["memory"], "memory.limit_in_bytes")) as f:
                assert int(f.read()) == memory
            waiting = await _ready_spares(state, 2)  # refilled: two new spares
            assert job_pid not in waiting
        assert ran[0] != ran[1]
        for job_id in ("first", "second", "third"):
            assert v1.finish(job_id)["cleanup_error"] is None
        keeperd_pid = spawner.keeperd_pid
    # idle keeperd exits, and takes its spares (processes and groups) with it
    await wait_until(lambda: _gone(keeperd_pid), 30)
    assert _spare_dirs(v1) == []
    assert all(_gone(pid) for pid in waiting)


async def test_a_killed_keeperds_spares_are_gone_once_the_next_one_started(
        tmp_path, workspace, v1, monkeypatch):
    """SIGKILL keeperd with 2 spares ready: its spares read EOF and exit; the groups stay
    until the next keeperd of the state dir starts and removes them (it reads the parents
    from keeperd.spares) before it says it is ready."""
    async with _pool(tmp_path, workspace, v1, monkeypatch, 2, first="only") as (
            spawner, state, _, waiting):
        assert len(_spare_dirs(v1)) == 2 * len(V1_CONTROLLERS)
        dead = spawner.keeperd_pid
        os.kill(dead, signal.SIGKILL)
        await wait_until(lambda: _gone(dead))
    assert v1.finish("only")["cleanup_error"] is None
    async with open_keeperd_spawner(state) as spawner:
        assert spawner.keeperd_pid != dead
        assert _spare_dirs(v1) == []
        assert all(_gone(pid) for pid in waiting)
        # and the new keeperd makes spares of its own with the next job
        again = _job(state, v1, workspace, "again", ["true"])
        assert (await _run(spawner, again))["exit_code"] == 0
        await _ready_spares(state, 2)
        assert v1.finish("again")["cleanup_error"] is None


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
                "id": 1, "size": 0, "parents": {}, "taken": 0, "missed": 0, "ready": [],
                "joining": []}
            assert _spare_dirs(v1) == []
            assert v1.finish(job_id)["cleanup_error"] is None


async def test_a_spare_that_cannot_exec_the_job_ends_it_spawn_failed(
        tmp_path, workspace, v1, monkeypatch):
    """A job from a spare whose cwd does not exist: the spare says why over its socket and
    exits; the job ends spawn_failed with the same detail as the fork+exec path."""
    from motor.execution.keeper import SPAWN_FAILED_EXIT_CODE

    async with _pool(tmp_path, workspace, v1, monkeypatch, 1) as (spawner, state, _, waiting):
        fields = v1.prepare("nocwd", None, None)
        bad = write_job_dir(state / "jobs" / "nocwd", "nocwd", ["true"], workspace, **fields)
        spec = (bad / "spec.json").read_text().replace(str(workspace), str(tmp_path / "gone"))
        (bad / "spec.json").write_text(spec)
        status = await _run(spawner, bad)
        assert status["reason"] == "spawn_failed" and status["exit_code"] == SPAWN_FAILED_EXIT_CODE
        assert "cannot use cwd" in status["detail"], status
        assert _gone(waiting[0])
        await _ready_spares(state, 1)  # and a new spare took its place
        for job_id in ("first", "nocwd"):
            assert v1.finish(job_id)["cleanup_error"] is None


def test_a_claimed_spare_starts_the_jobs_cpu_counter_at_zero(tmp_path, v1):
    """The pool on its own (in this process): a spare joins its groups and runs a little
    there (its cpuacct.usage grows above 0); the claim gives the groups the job's name and
    limit and zeroes the counters, so the job's CPU time is only the job's (the spare is
    idle in recvmsg until its order); the order makes it exec the job in those groups."""
    import selectors

    from polling import wait_for

    from motor.execution.spares import SparePool

    sel = selectors.DefaultSelector()
    log: list[str] = []
    pool = SparePool(str(tmp_path), sel, 1, log.append)
    spare = None
    make = v1.prepare("acct", None, 64 << 20)["cgroup_make"]
    pool.learn(make)
    pool.fill_one()

    def pump():
        for key, events in sel.select(0.05):
            key.data(events)
        return pool.describe()["ready"]

    try:
        [pid] = wait_for(pump, what="the spare ready")
        spare_dirs = pool.spares[pid].dirs

        def usage(dirs) -> int:
            with open(os.path.join(dirs["cpuacct"], "cpuacct.usage")) as f:
                return int(f.read())

        assert wait_for(lambda: usage(spare_dirs) > 0, what="the spare's own CPU charged")
        # It said ready before it reached its recvmsg: claim it only once it sleeps there,
        # or the few instructions in between are charged after the claim's reset.
        wait_for(lambda: blocked_in_recvmsg(pid), what="the spare asleep in recvmsg")
        spare = pool.take(make)
        assert pool.claim(spare, make)
        job = v1.flavour.job_dirs("acct")
        assert not any(os.path.exists(d) for d in spare_dirs.values())
        assert usage(job) == 0
        with open(os.path.join(job["memory"], "memory.limit_in_bytes")) as f:
            assert int(f.read()) == 64 << 20
        r, w = os.pipe()
        fd = pool.order(spare, spares_mod.orders_of(
            {"cwd": str(tmp_path)}, "/bin/cat", ["cat", "/proc/self/cgroup"], {}), [w, w])
        os.close(w)
        with os.fdopen(r) as f:
            out = f.read()
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert os.read(fd, 100) == b""  # exec'd: nothing said on the socket
        os.close(fd)
        assert out.count("/job-acct\n") == 3, out
        assert usage(job) > 0  # the job's own exec and run
    finally:
        pool.close()
        if spare is not None and spare.sock.fileno() >= 0:  # taken, never ordered: ours
            spare.sock.close()
            try:
                os.kill(spare.pid, signal.SIGKILL)
                os.waitpid(spare.pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
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
        assert read_keeper(lone)["job_pid"] in full
        assert len(after["ready"]) == 3 and after["joining"] == [], after  # not refilled
        burst = _job(state, v1, workspace, "burst", ["true"])
        assert (await _run(spawner, burst))["exit_code"] == 0
        refilled = await _ready_spares(state, 4)  # two new spares, made together
        assert len(set(refilled) - set(full)) == 2
        assert ask_keeperd(state, "spares")["taken"] == 2
        for job_id in ("first", "lone", "burst"):
            assert v1.finish(job_id)["cleanup_error"] is None


async def test_starts_waiting_for_their_exec_are_answered_before_the_pool_refills(
        tmp_path, workspace, v1, monkeypatch):
    """Issue 14: keeperd makes a spare (a fork of itself, 1-2 ms) while a job's start waits
    for its exec only when fewer than two spares are left, so the answer to a start from a
    spare is not held behind a refill. Two starts within the refill idle time (a burst: the
    pool is due for its refill at once) take two of four spares and are held at
    `spare.ordered` (each spare has its job's orders and has not exec'd): keeperd makes no
    spare meanwhile, though it keeps serving requests. Once they go on, both starts are
    answered and the pool is topped up again."""
    gate = tmp_path / "exec-gate"
    monkeypatch.setenv(faults.ENV, f"spare.ordered=wait:{gate}")
    monkeypatch.setenv(spares_mod.REFILL_IDLE_ENV, "30")
    async with _pool(tmp_path, workspace, v1, monkeypatch, 4) as (spawner, state, _, full):
        held = [_job(state, v1, workspace, name, ["true"]) for name in ("a", "b")]
        statuses = []

        async def start(job_dir):
            statuses.append(await _run(spawner, job_dir))

        async with trio.open_nursery() as nursery:
            for job_dir in held:
                nursery.start_soon(start, job_dir)
            await wait_until(lambda: ask_keeperd(state, "spares")["taken"] == 2)
            taken = set(full) - set(ask_keeperd(state, "spares")["ready"])
            assert len(taken) == 2
            # both have their orders: keeperd, which sent them, has turned its loop since
            await wait_until(lambda: not any(blocked_in_recvmsg(pid) for pid in taken))
            pool = ask_keeperd(state, "spares")
            assert len(pool["ready"]) + len(pool["joining"]) == 2, pool
            assert statuses == []
            gate.touch()
        assert [s["exit_code"] for s in statuses] == [0, 0]
        assert {read_keeper(job_dir)["job_pid"] for job_dir in held} == taken
        refilled = await _ready_spares(state, 4)
        assert len(set(refilled) - set(full)) == 2
        for job_id in ("first", "a", "b"):
            assert v1.finish(job_id)["cleanup_error"] is None


async def test_a_pool_down_to_one_spare_refills_even_while_a_start_waits(
        tmp_path, workspace, v1, monkeypatch):
    """The exception to the rule above: with fewer than two spares left, the next start
    would likely find none ready and fork and join its groups the slow way, so keeperd
    refills though a start waits for its exec (a pool of 2, one taken and held)."""
    gate = tmp_path / "exec-gate"
    monkeypatch.setenv(faults.ENV, f"spare.ordered=wait:{gate}")
    monkeypatch.setenv(spares_mod.REFILL_IDLE_ENV, "30")
    async with _pool(tmp_path, workspace, v1, monkeypatch, 2) as (spawner, state, _, full):
        held = _job(state, v1, workspace, "held", ["true"])
        statuses = []

        async def start():
            statuses.append(await _run(spawner, held))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(start)
            pool = await wait_until(lambda: (lambda a: a if len(a["ready"]) + len(a["joining"]) == 2
                                             and a["taken"] == 1 else None)(ask_keeperd(state, "spares")))
            assert len(set(pool["ready"] + pool["joining"]) - set(full)) == 1
            assert statuses == []
            gate.touch()
        assert statuses[0]["exit_code"] == 0
        for job_id in ("first", "held"):
            assert v1.finish(job_id)["cleanup_error"] is None
