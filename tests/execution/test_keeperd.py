"""keeperd: one long-lived keeper per state dir (motor/execution/keeperd.py), real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psutil
import pytest
import trio
from keeper_helpers import finish, records, wait_until
from keeper_tracking import tracked_keepers, write_job_dir

from motor.execution import keeperd as keeperd_mod
from motor.execution import process_alive, read_keeper, read_status
from motor.execution.keeperd_client import open_keeperd_spawner


LIST_FDS = ("import json, os\n"
            "fds = {}\n"
            "for fd in os.listdir('/proc/self/fd'):\n"
            "    try: fds[fd] = os.readlink('/proc/self/fd/' + fd)\n"
            "    except OSError: pass\n"
            "print(json.dumps(fds))")


def _keeperds(state) -> list[psutil.Process]:
    """Every live keeperd process serving `state`."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if any(part.endswith("keeperd.py") for part in cmd) and str(state) in cmd:
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    found.append(p)
            except psutil.NoSuchProcess:
                pass
    return found


def test_keeperd_loads_the_d_bus_client_for_its_first_systemd_job_only():
    """Issue 14: keeperd forks once per cgroup-v1 spare, and a smaller process forks faster
    (17.3 -> 15.3 MB, a fork 545 -> 407 us on this host): loaded as it runs (by path,
    scriptboot), it has neither jeepney nor the systemd backend; `Keeperd` makes its scope
    starter, and imports them, for the first job whose spec asks for a scope. (Before,
    keeperd imported both at start.)"""
    here = os.path.dirname(keeperd_mod.__file__)
    code = ("import runpy, sys\n"  # as `python keeperd.py` starts, without running main()
            f"sys.path.insert(0, {here!r})\n"
            "import scriptboot\n"
            f"scriptboot.bootstrap({keeperd_mod.__file__!r})\n"
            f"runpy.run_path({keeperd_mod.__file__!r}, run_name='keeperd')\n"
            "heavy = [m for m in ('jeepney', 'motor.isolation.systemd', 'motor.execution.sdscopes',"
            " 'trio') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    subprocess.run([sys.executable, "-c", code], check=True)


async def test_two_runners_racing_for_one_state_dir_share_one_keeperd(tmp_path, workspace):
    """Two spawners (two runners' worth) connect at the same moment to a state dir with no
    keeperd: exactly one keeperd starts, both keep their jobs in it, every job runs once."""
    state = tmp_path / "state"
    state.mkdir()
    go = trio.Event()
    handles: dict[str, list] = {"a": [], "b": []}

    async def runner(name: str, spawner) -> None:
        await go.wait()
        for i in range(3):
            d = write_job_dir(state / "jobs" / f"{name}{i}", f"{name}{i}",
                              ["sh", "-c", f"echo {name}{i} >> {tmp_path / 'runs'}"], workspace)
            handles[name].append((await spawner.spawn(d), d))

    async with open_keeperd_spawner(state) as a, open_keeperd_spawner(state) as b:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(runner, "a", a)
            nursery.start_soon(runner, "b", b)
            go.set()
        pids = {h.pid for hs in handles.values() for h, _ in hs}
        assert len(pids) == 1, pids  # one keeperd for both
        assert [p.pid for p in _keeperds(state)] == list(pids)
        assert a.keeperd_pid == b.keeperd_pid == pids.pop()
        for hs in handles.values():
            for h, d in hs:
                assert (await finish(h, d))["exit_code"] == 0
    ran = sorted((tmp_path / "runs").read_text().split())
    assert ran == ["a0", "a1", "a2", "b0", "b1", "b2"]


async def test_a_second_keeperd_for_a_state_dir_refuses_to_start(tmp_path, make_job):
    state = tmp_path / "state"
    async with tracked_keepers("keeperd", state) as jobs:
        job_dir = make_job(["true"])
        await jobs.run(job_dir)  # a keeperd runs and this runner is connected to it
        first = jobs.spawner.keeperd_pid
        out = subprocess.run(
            [sys.executable, keeperd_mod.__file__, str(state)], capture_output=True, timeout=30)
        assert out.returncode == 1
        assert "another keeperd holds" in json.loads(out.stdout)["error"]
        assert [p.pid for p in _keeperds(state)] == [first]
        assert int((state / "keeperd.lock").read_text()) == first
        assert oct((state / "keeperd.sock").stat().st_mode & 0o777) == "0o600"  # owner-only


async def test_keeperd_outlives_its_runner_and_a_new_spawner_adopts_through_it(
        tmp_path, make_job, workspace):
    """A runner's spawner goes away (its connection closes) while a job runs: keeperd keeps
    the job; the next spawner waits on it through the same keeperd and sees all output."""
    state = tmp_path / "state"
    job_dir = make_job(["sh", "-c", "echo first; while [ ! -e go ]; do sleep 0.01; done; "
                                    "echo last; exit 3"])  # (creates the state dir)
    async with open_keeperd_spawner(state) as spawner:
        handle = await spawner.spawn(job_dir)
        await wait_until(lambda: ("stdout", b"first\n") in records(job_dir))
    assert process_alive(handle.pid, handle.create_time)  # keeperd stays: it keeps a job
    async with open_keeperd_spawner(state) as spawner:
        (workspace / "go").touch()
        with trio.fail_after(20):
            await spawner.wait_exit(handle.pid, handle.create_time, job_dir)
        assert spawner.keeperd_pid == handle.pid
    status = read_status(job_dir)
    assert status["exit_code"] == 3
    assert records(job_dir) == [("stdout", b"first\n"), ("stdout", b"last\n")]


async def test_keeperd_exits_when_idle_and_the_next_runner_starts_another(tmp_path, make_job):
    state = tmp_path / "state"
    state.mkdir()
    async with open_keeperd_spawner(state) as spawner:
        handle = await spawner.spawn(make_job(["true"]))
    # no job, no runner: it exits (after IDLE_EXIT_S) and removes its socket; the next
    # spawner (a runner starting) starts another
    with trio.fail_after(20):
        while process_alive(handle.pid, handle.create_time):
            await trio.sleep(0.05)
    assert not (state / "keeperd.sock").exists()
    async with open_keeperd_spawner(state) as spawner:
        job_dir = make_job(["true"])
        h2 = await spawner.spawn(job_dir)
        assert h2.pid != handle.pid
        with trio.fail_after(20):
            await spawner.wait_exit(h2.pid, h2.create_time, job_dir)
        assert read_status(job_dir)["exit_code"] == 0


async def test_keeperd_jobs_leave_no_fd_to_other_jobs(tmp_path, make_job, workspace):
    """keeperd holds every job's pipes: none of them may leak into another job."""
    async with tracked_keepers("keeperd", tmp_path / "state") as jobs:
        first = make_job(["sh", "-c", "while [ ! -e go ]; do sleep 0.01; done"])
        h1 = await jobs.spawn(first)
        second = make_job([sys.executable, "-c", LIST_FDS])
        status = await jobs.run(second)
        assert status["exit_code"] == 0
        fds = json.loads(b"".join(data for _, data in records(second)))
        # stdin, stdout, stderr (and the directory the listing itself opened): no pipe,
        # socket or file of keeperd's or of another job's
        assert sorted(fds)[:3] == ["0", "1", "2"], fds
        assert all(t.startswith("/proc/") for fd, t in fds.items() if int(fd) > 2), fds
        assert fds["0"] == "/dev/null" and fds["1"].startswith("pipe:"), fds
        assert fds["1"] != fds["2"]
        (workspace / "go").touch()
        assert (await finish(h1, first))["exit_code"] == 0
        assert read_keeper(first)["kind"] == "keeperd"


async def test_a_job_with_one_v2_group_is_born_in_it(tmp_path, workspace):
    """A job whose spec names one cgroup v2 group is forked straight into it (clone3 with
    CLONE_INTO_CGROUP, motor/isolation/join.py): the job runs inside from its first
    instruction, and keeperd itself stays where it was."""
    from private_cgroup import kill_and_remove, writable_v2_mount

    v2 = writable_v2_mount()
    if os.geteuid() != 0 or v2 is None:
        pytest.skip("needs root and a writable cgroup v2 mount")
    group = os.path.join(v2, f"motor-test-keeperd-{os.getpid()}")
    os.mkdir(group)
    try:
        state = tmp_path / "state"
        state.mkdir()
        job_dir = write_job_dir(state / "jobs" / "v2job", "v2job",
                                ["sh", "-c", "grep '^0::' /proc/self/cgroup"], workspace,
                                cgroup_procs=[os.path.join(group, "cgroup.procs")])
        async with open_keeperd_spawner(state) as spawner:
            handle = await spawner.spawn(job_dir)
            with trio.fail_after(20):
                await spawner.wait_exit(handle.pid, handle.create_time, job_dir)
            with open(f"/proc/{spawner.keeperd_pid}/cgroup") as f:
                keeperd_groups = f.read()
        assert read_status(job_dir)["exit_code"] == 0
        rel = "/" + os.path.relpath(group, v2)
        out = b"".join(data for stream, data in records(job_dir) if stream == "stdout")
        assert out.decode().strip() == f"0::{rel}", out
        assert f"0::{rel}\n" not in keeperd_groups
    finally:
        kill_and_remove(group, strict=True)


async def test_a_spawner_waits_for_its_own_jobs_without_reading_keeper_json_or_proc(
        tmp_path, make_job, workspace, monkeypatch):
    """The spawner knows which keeperd claimed the job dirs it spawned (the spawn's answer)
    and that it lives (its connection is up): waiting for such a job reads neither the
    job's keeper.json nor keeperd's /proc entry (issue 14: they were read per job on the
    event loop). A spawner that did not spawn the job still reads keeper.json to learn who
    keeps it, and finds keeperd through it (the adoption test above)."""
    from motor.execution import keeperd_client

    reads = []
    real_read, real_alive = keeperd_client.joblog.read_keeper, keeperd_client.process_alive
    monkeypatch.setattr(keeperd_client.joblog, "read_keeper",
                        lambda d: reads.append(("keeper.json", d)) or real_read(d))
    monkeypatch.setattr(keeperd_client, "process_alive",
                        lambda *a: reads.append(("proc", a)) or real_alive(*a))
    state = tmp_path / "state"
    job_dir = make_job(["sh", "-c", "while [ ! -e go ]; do sleep 0.01; done; exit 4"])
    async with open_keeperd_spawner(state) as spawner:
        handle = await spawner.spawn(job_dir)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(spawner.wait_exit, handle.pid, handle.create_time, job_dir)
            await trio.testing.wait_all_tasks_blocked()
            assert spawner.cancel(handle.pid, handle.create_time, job_dir) is True
        assert read_status(job_dir)["reason"] == "cancelled"
        assert reads == []
        # after its wait the job dir is forgotten: a wait again reads keeper.json (and
        # returns at once: keeperd no longer keeps it)
        with trio.fail_after(20):
            await spawner.wait_exit(handle.pid, handle.create_time, job_dir)
        assert ("keeper.json", job_dir) in reads


async def test_the_spawn_is_answered_before_keeper_json_gets_the_jobs_pid(
        tmp_path, make_job, workspace, monkeypatch):
    """Issue 14: keeper.json's second write (the job's pid) is off the start's round trip.
    keeperd held at `keeper.spawned` (the job runs, keeper.json names keeperd only) has
    already answered the spawn with the job's pid; released, it writes keeper.json, and
    the job ends as usual. (Before, the answer came after that write: this spawn would
    wait for the barrier.)"""
    barrier = tmp_path / "pid-write"
    monkeypatch.setenv("MOTOR_FAULTS", f"keeper.spawned=wait:{barrier}")
    state = tmp_path / "state"
    job_dir = make_job(["sh", "-c", "while [ ! -e go ]; do sleep 0.01; done; exit 5"])
    async with open_keeperd_spawner(state) as spawner:
        try:
            with trio.fail_after(20):
                handle = await spawner.spawn(job_dir)
            await wait_until((tmp_path / "pid-write.reached").exists)  # right after its answer
            claim = read_keeper(job_dir)
            assert claim["keeper_pid"] == handle.pid and claim.get("job_pid") is None
            (job,) = [c for c in psutil.Process(handle.pid).children() if c.name() == "sh"]
            barrier.touch()
            await wait_until(lambda: read_keeper(job_dir).get("job_pid") == job.pid)
        finally:  # keeperd and the job are let go even when an assertion failed
            barrier.touch()
            (workspace / "go").touch()
        with trio.fail_after(20):
            await spawner.wait_exit(handle.pid, handle.create_time, job_dir)
    assert read_status(job_dir)["exit_code"] == 5


def _allowed_cpus(pid: int) -> set[int]:
    """The CPUs a process's main thread may run on, as /proc says (keeperd's own spawns
    run there)."""
    return set(psutil.Process(pid).cpu_affinity())


async def test_keeperd_leaves_a_pinned_jobs_cpus_once_it_has_spawned_it_alone(
        tmp_path, make_job, workspace):
    """Issue 14: keeperd takes a pinned job's CPUs for the moment of its spawn (the child
    inherits them). A job that starts alone (no other job of keeperd's runs): keeperd then
    goes to its own CPUs less the job's, not back to all of them, so its answer, and the
    runner that answer wakes, run beside the starting job, not on its CPU. A job that
    starts beside others, or is given all of keeperd's CPUs, leaves keeperd on all of them
    (in a burst a move at every start cost more than it gave). (Before, keeperd went back
    to every CPU and so stayed on the job's: the first assertion failed.)"""
    home = sorted(os.sched_getaffinity(0))
    if len(home) < 2:
        pytest.skip("one CPU: keeperd and the job share it whatever keeperd does")
    state = tmp_path / "state"
    hold = ["sh", "-c", "while [ ! -e go ]; do sleep 0.01; done"]
    alone = make_job(hold, cpus=[home[-1]], pin=True)
    beside = make_job(hold, cpus=[home[0]], pin=True)
    every = make_job(hold, cpus=home, pin=True)
    async with open_keeperd_spawner(state) as spawner:
        handles = []
        try:
            with trio.fail_after(20):
                handles.append((await spawner.spawn(alone), alone))
            keeperd = handles[0][0].pid  # answered: its spawn and what follows are done
            assert _allowed_cpus(keeperd) == set(home[:-1])
            (job,) = [c for c in psutil.Process(keeperd).children() if c.name() == "sh"]
            assert job.cpu_affinity() == [home[-1]]  # the job itself stays pinned
            with trio.fail_after(20):
                handles.append((await spawner.spawn(beside), beside))
            assert _allowed_cpus(keeperd) == set(home)  # the first job still runs
            with trio.fail_after(20):
                handles.append((await spawner.spawn(every), every))
            assert _allowed_cpus(keeperd) == set(home)
        finally:
            (workspace / "go").touch()
        for handle, job_dir in handles:
            with trio.fail_after(20):
                await spawner.wait_exit(handle.pid, handle.create_time, job_dir)
            assert read_status(job_dir)["exit_code"] == 0


async def test_a_pin_that_fails_is_the_jobs_spawn_failure_and_keeperd_stays_where_it_was(
        tmp_path, make_job, workspace):
    """A spec whose CPUs cannot be pinned (not a list of CPUs) ends that job `spawn_failed`
    with the reason, and keeperd, which never left its CPUs, stays on all of them and
    serves the next job. (With keeperd's move after an alone start, the failed pin's CPUs
    were read once more on the way back, and the error escaped as a TypeError instead.)"""
    home = set(os.sched_getaffinity(0))
    state = tmp_path / "state"
    bad = make_job(["true"], cpus=5, pin=True)
    good = make_job(["true"])
    async with open_keeperd_spawner(state) as spawner:
        for job_dir in (bad, good):
            with trio.fail_after(20):
                handle = await spawner.spawn(job_dir)
                await spawner.wait_exit(handle.pid, handle.create_time, job_dir)
            assert _allowed_cpus(handle.pid) == home
    status = read_status(bad)
    assert status["reason"] == "spawn_failed" and "cannot pin to cpus 5" in status["detail"]
    assert read_status(good)["exit_code"] == 0


async def test_keeper_json_gets_the_pid_of_a_job_that_runs_on_but_not_of_a_short_one(
        tmp_path, make_job, workspace, monkeypatch):
    """Issue 14: keeper.json's rewrite with the job's pid and create time waits
    `RECORD_PID_AFTER_S` (here 1 s, so that a loaded host cannot make `true` look long): a
    job that has ended by then never gets it (its claim names keeperd, its status.json says
    how it ended); one still running gets its pid and the create time psutil reports.
    (Before, every job got the rewrite right after its spawn.)"""
    monkeypatch.setenv(keeperd_mod.RECORD_PID_AFTER_ENV, "1")
    state = tmp_path / "state"
    short = make_job(["true"])
    long = make_job(["sh", "-c", "while [ ! -e go ]; do sleep 0.01; done"])
    async with open_keeperd_spawner(state) as spawner:
        try:
            with trio.fail_after(20):
                quick = await spawner.spawn(short)
                await spawner.wait_exit(quick.pid, quick.create_time, short)
                handle = await spawner.spawn(long)
            assert read_status(short)["exit_code"] == 0
            claim = read_keeper(short)
            assert claim["keeper_pid"] == quick.pid and claim.get("job_pid") is None, claim
            (job,) = [c for c in psutil.Process(handle.pid).children() if c.name() == "sh"]
            await wait_until(lambda: read_keeper(long).get("job_pid") == job.pid)
            assert read_keeper(long)["job_create_time"] == job.create_time()
        finally:
            (workspace / "go").touch()
        with trio.fail_after(20):
            await spawner.wait_exit(handle.pid, handle.create_time, long)
    assert read_status(long)["exit_code"] == 0


async def test_a_spawn_carries_the_wait_for_its_jobs_end(tmp_path, make_job, monkeypatch):
    """Issue 14: the spawn request reserves the id of the job's end (`"watch"`), so waiting
    for a job this spawner started sends nothing more: one request per job, not two. A
    keeperd whose answer does not say `"watching"` (one from before this change, still
    running after an upgrade) is sent the `wait` as before. The carried wait's event is
    what the job actor waits on (`exit_event`); without a carried wait there is none."""
    from motor.execution import keeperd_client

    ops = []
    real_submit = keeperd_client.KeeperdSpawner._submit
    monkeypatch.setattr(keeperd_client.KeeperdSpawner, "_submit",
                        lambda self, req: ops.append(req.op) or real_submit(self, req))
    state = tmp_path / "state"
    jobs = [make_job(["sh", "-c", f"exit {code}"]) for code in (3, 4, 5)]  # (makes the state dir)
    async with open_keeperd_spawner(state) as spawner:
        for code, job_dir in zip((3, 4), jobs):
            handle = await spawner.spawn(job_dir)
            ended = spawner.exit_event(handle.pid, handle.create_time, job_dir)
            with trio.fail_after(20):
                await ended.wait()  # the job actor's way: keeperd's answer sets it
                assert read_status(job_dir)["exit_code"] == code
                await spawner.wait_exit(handle.pid, handle.create_time, job_dir)
            assert spawner.exit_event(handle.pid, handle.create_time, job_dir) is None
        assert ops == ["spawn", "spawn"]

        real_decode = keeperd_client._decode

        def old_answers(line):  # keeperd's answers without "watching"
            answer = real_decode(line)
            answer.pop("watching", None)
            return answer

        monkeypatch.setattr(keeperd_client, "_decode", old_answers)
        ops.clear()
        job_dir = jobs[2]
        handle = await spawner.spawn(job_dir)
        assert spawner.exit_event(handle.pid, handle.create_time, job_dir) is None
        with trio.fail_after(20):
            await spawner.wait_exit(handle.pid, handle.create_time, job_dir)
        assert read_status(job_dir)["exit_code"] == 5 and ops == ["spawn", "wait"]


async def test_keeperds_answers_say_when_it_read_the_spawn_and_saw_the_jobs_end(
        tmp_path, make_job, monkeypatch):
    """The spawn's answer and the word of the job's end carry keeperd's own times on the
    host's monotonic clock (`"at"`: docs/keeper.md, "Timings in the answers"): when it read
    the request and answered, when it saw the job's main process end and said so. They are
    what bench/slot_cycle.py splits a slot's cycle by, so they must be real, in order, and on
    the clock the runner reads."""
    import time

    from motor.execution import keeperd_client

    answers = {}  # (op, job dir): (keeperd's answer, when the runner's reader took it)
    real_resolve = keeperd_client._Req.resolve
    monkeypatch.setattr(keeperd_client._Req, "resolve", lambda self, resp=None, exc=None: (
        answers.setdefault((self.op, self.job_dir), (resp, time.monotonic())),
        real_resolve(self, resp, exc)))
    first, job_dir = make_job(["true"]), make_job(["sleep", "0.5"])
    async with open_keeperd_spawner(tmp_path / "state") as spawner:
        handle = await spawner.spawn(first)  # keeperd started (the first spawn launches it)
        with trio.fail_after(20):
            await spawner.wait_exit(handle.pid, handle.create_time, first)
        before = time.monotonic()
        handle = await spawner.spawn(job_dir)
        with trio.fail_after(20):
            await spawner.wait_exit(handle.pid, handle.create_time, job_dir)
    path = os.path.abspath(job_dir)
    (spawned, spawn_taken), (ended, end_taken) = answers["spawn", path], answers["wait", path]
    read, answered = spawned["at"]
    seen, said = ended["at"]
    assert before <= read <= answered <= spawn_taken
    assert answered + 0.3 <= seen <= said <= end_taken  # the job slept 0.5 s in between
    assert ended["done"] is True


async def test_a_job_whose_directory_is_removed_is_given_up_and_keeperd_still_exits(
        tmp_path, make_job):
    """The job directory is deleted under a running job (its state dir removed): once the
    job ends keeperd cannot write its status; it says the job is done (a runner would find
    no status: lost), logs why, and exits when idle, instead of retrying for ever."""
    import shutil

    state = tmp_path / "state"
    state.mkdir()
    async with open_keeperd_spawner(state) as spawner:
        job_dir = make_job(["sleep", "60"])
        handle = await spawner.spawn(job_dir)
        shutil.rmtree(job_dir)
        assert spawner.cancel(handle.pid, handle.create_time, job_dir)
        with trio.fail_after(20):
            await spawner.wait_exit(handle.pid, handle.create_time, job_dir)
    assert not job_dir.exists()
    with trio.fail_after(20):
        while process_alive(handle.pid, handle.create_time):
            await trio.sleep(0.05)
    log = (state / "keeperd.log").read_text()
    assert f"job directory {job_dir} is gone" in log, log


@pytest.mark.spawner_itself  # it stages the full socket with wait_all_tasks_blocked
async def test_requests_go_out_from_the_callers_task_and_in_order_behind_a_full_socket(
        tmp_path, make_job, workspace, monkeypatch):
    """Issue 14 (start latency): with the connection up and nothing waiting to be sent, a
    spawn's line is sent from the caller's task (the connection's task is not woken for
    it). While keeperd reads nothing (stopped) the socket fills: the lines it does not take
    (or takes in part) go to the connection's task, which sends them in order once keeperd
    reads again, and every spawn is answered and its job run."""
    import signal
    import socket

    from motor.execution import keeperd_client

    delivered = []
    real_deliver, real_rest = (keeperd_client.KeeperdSpawner._deliver,
                               keeperd_client.KeeperdSpawner._send_rest)

    async def deliver(self, req):
        delivered.append(req.op)
        await real_deliver(self, req)

    async def send_rest(self, rest):
        delivered.append("rest")
        await real_rest(self, rest)

    monkeypatch.setattr(keeperd_client.KeeperdSpawner, "_deliver", deliver)
    monkeypatch.setattr(keeperd_client.KeeperdSpawner, "_send_rest", send_rest)
    state = tmp_path / "state"
    first, second = make_job(["true"]), make_job(["sh", "-c", "exit 2"])
    # long directory names: 80 spawn lines of some 300 bytes are more than the socket takes
    many = [write_job_dir(state / "jobs" / f"{'x' * 200}{i}", f"many{i}", ["sh", "-c", f"exit {i % 7}"],
                          workspace) for i in range(80)]
    async with open_keeperd_spawner(state) as spawner:
        with trio.fail_after(30):
            for job_dir in (first, second):  # connected at the start: sent from this task
                handle = await spawner.spawn(job_dir)
                await spawner.wait_exit(handle.pid, handle.create_time, job_dir)
            assert delivered == [] and read_status(second)["exit_code"] == 2

        keeperd = psutil.Process(handle.pid)
        spawner._conn.raw.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        keeperd.send_signal(signal.SIGSTOP)
        try:
            handles = {}

            async def spawn(job_dir):
                handles[job_dir] = await spawner.spawn(job_dir)

            async with trio.open_nursery() as nursery:
                for job_dir in many:
                    nursery.start_soon(spawn, job_dir)
                await trio.testing.wait_all_tasks_blocked()
                assert delivered, "the socket took every line while keeperd read nothing"
                keeperd.send_signal(signal.SIGCONT)
        finally:
            keeperd.send_signal(signal.SIGCONT)
        with trio.fail_after(60):
            for job_dir in many:
                h = handles[job_dir]
                await spawner.wait_exit(h.pid, h.create_time, job_dir)
    for i, job_dir in enumerate(many):
        assert read_status(job_dir)["exit_code"] == i % 7


async def test_a_line_the_socket_took_in_part_is_finished_before_the_next(
        tmp_path, make_job, workspace):
    """Issue 14: when the socket takes only the start of a spawn's line (sent from the
    caller's task), the rest goes to the connection's task, and a spawn made meanwhile
    waits behind it (sent from this task it would land inside that line: keeperd would
    read neither). Both are answered and both jobs run."""
    state = tmp_path / "state"
    a, b = make_job(["sh", "-c", "exit 3"]), make_job(["sh", "-c", "exit 4"])

    class TakesPart:  # the socket, taking the first 10 bytes of the next line only
        def __init__(self, sock):
            self.sock, self.armed = sock, True

        def send(self, data):
            if self.armed:
                self.armed = False
                return self.sock.send(data[:10])
            return self.sock.send(data)

    async with open_keeperd_spawner(state) as spawner:
        spawner._conn.raw = TakesPart(spawner._conn.raw)
        handles = {}

        async def spawn(job_dir):
            handles[job_dir] = await spawner.spawn(job_dir)

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(spawn, a)
                nursery.start_soon(spawn, b)
            for job_dir, h in handles.items():
                await spawner.wait_exit(h.pid, h.create_time, job_dir)
    assert read_status(a)["exit_code"] == 3 and read_status(b)["exit_code"] == 4
