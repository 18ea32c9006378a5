"""The cgroup backend for real on this host: groups, a keeper-run job inside, OOM, CPU time.

Skipped (with the reason) where cgroups are not writable. Every group is created under a
throw-away parent (`cgroup_backend` fixture) and removed, even on failure.
"""

from __future__ import annotations

import os
import signal
import sys

from isolation_helpers import job_id, needs_cgroups

from motor.execution import read_records
from motor.isolation import choose_backend
from motor.isolation.cgroup import PARENT

pytestmark = needs_cgroups

MiB = 1024 * 1024


def read(path) -> str:
    with open(path) as f:
        return f.read()


def stdout_of(job_dir) -> str:
    recs, _ = read_records(job_dir / "output.log", 0)
    return b"".join(d for s, d in recs if s == "stdout").decode()


def group_paths(backend, jid) -> list[str]:
    return [os.path.dirname(p) for p in backend.prepare(jid, None, None)["cgroup_procs"]]


def last_cpu() -> int:
    return max(os.sched_getaffinity(0))


def test_prepare_creates_the_group_with_the_limits_and_finish_removes_it(cgroup_backend):
    jid = job_id("limits")
    fields = cgroup_backend.prepare(jid, [last_cpu()], 64 * MiB)
    assert fields["pin"] is True
    dirs = [os.path.dirname(p) for p in fields["cgroup_procs"]]
    assert all(os.path.isdir(d) for d in dirs) and all(d.endswith(f"/job-{jid}") for d in dirs)
    if cgroup_backend.version == 1:
        cpuset, memory, cpuacct = dirs
        assert read(f"{cpuset}/cpuset.cpus").strip() == str(last_cpu())
        assert read(f"{cpuset}/cpuset.mems").strip() != ""
        assert int(read(f"{memory}/memory.limit_in_bytes")) == 64 * MiB
    else:
        assert int(read(f"{dirs[0]}/memory.max")) == 64 * MiB
    assert cgroup_backend.adopt(jid) is True
    result = cgroup_backend.finish(jid)
    assert result["oom_killed"] is False and result["cleanup_error"] is None
    assert not any(os.path.exists(d) for d in dirs)
    assert cgroup_backend.adopt(jid) is False


def test_prepare_is_idempotent_and_clamps_to_the_parent_limit(cgroup_backend):
    parent_mem = [p for p in cgroup_backend.flavour.parent_paths() if "memory" in p or
                  cgroup_backend.version == 2][0]
    knob = "memory.limit_in_bytes" if cgroup_backend.version == 1 else "memory.max"
    with open(os.path.join(parent_mem, knob), "w") as f:
        f.write(str(128 * MiB))
    assert cgroup_backend.parent_memory_limit() == 128 * MiB
    assert cgroup_backend.health()["memory_max"] == 128 * MiB
    jid = job_id("clamp")
    try:
        first = cgroup_backend.prepare(jid, None, 1 << 40)
        again = cgroup_backend.prepare(jid, None, None)
        assert first == again
        mem_dir = [os.path.dirname(p) for p in again["cgroup_procs"] if "/memory/" in p
                   or cgroup_backend.version == 2][0]
        assert int(read(os.path.join(mem_dir, knob))) == 128 * MiB
    finally:
        assert cgroup_backend.finish(jid)["cleanup_error"] is None


def test_a_bad_cpu_set_is_a_clear_error_and_leaves_no_group(cgroup_backend):
    jid = job_id("badcpu")
    try:
        cgroup_backend.prepare(jid, [4096], None)
    except Exception as exc:
        assert "cpuset.cpus" in str(exc) and "4096" in str(exc)
    else:
        raise AssertionError("prepare accepted CPU 4096")
    assert cgroup_backend.adopt(jid) is False
    for parent in cgroup_backend.flavour.parent_paths():
        assert not os.path.exists(os.path.join(parent, f"job-{jid}"))


async def test_the_job_runs_inside_the_group_on_its_cpus(cgroup_backend, keepers, make_job_dir):
    jid = job_id("inside")
    cpu = last_cpu()
    fields = cgroup_backend.prepare(jid, [cpu], 256 * MiB)
    job_dir = make_job_dir(jid, ["sh", "-c", "cat /proc/self/cgroup; "
                                 "grep Cpus_allowed_list /proc/self/status"],
                           cpus=[cpu], **fields)
    status = await keepers.run(job_dir)
    result = cgroup_backend.finish(jid, status["signal"])
    out = stdout_of(job_dir)
    assert status["exit_code"] == 0, (status, out)
    rel = f"/{cgroup_backend.flavour.parent}/job-{jid}"
    lines = out.splitlines()
    if cgroup_backend.version == 1:
        for controller in ("cpuset", "memory", "cpuacct"):
            assert any(f":{controller}:{rel}" in line or
                       (f"{controller}" in line.split(":")[1].split(",") and line.endswith(rel))
                       for line in lines), (controller, out)
    else:
        assert f"0::{rel}" in lines, out
    assert f"Cpus_allowed_list:\t{cpu}" in out
    assert result["oom_killed"] is False and result["cleanup_error"] is None
    assert not cgroup_backend.adopt(jid)


async def test_a_job_over_its_memory_limit_is_oom_killed(cgroup_backend, keepers, make_job_dir):
    jid = job_id("oom")
    fields = cgroup_backend.prepare(jid, None, 64 * MiB)
    job_dir = make_job_dir(jid, [sys.executable, "-c", "b = b'x' * (512 * 1024 * 1024)"],
                           **fields)
    status = await keepers.run(job_dir)
    result = cgroup_backend.finish(jid, status["signal"])
    assert status["signal"] == signal.SIGKILL, status
    assert result["oom_killed"] is True and result["oom_kills"] >= 1, result
    assert result["memory_max"] == 64 * MiB
    assert result["cleanup_error"] is None
    assert not cgroup_backend.adopt(jid)


async def test_many_small_processes_over_the_limit_never_kill_the_keeper(
        cgroup_backend, keepers, make_job_dir):
    # Each child is smaller than the keeper (a forked Python): the OOM killer must still
    # pick a job process, never the keeper that records the status.
    jid = job_id("oomkeeper")
    fields = cgroup_backend.prepare(jid, None, 48 * MiB)
    script = ("for i in $(seq 24); do "
              "sh -c 'x=$(head -c 3000000 /dev/zero | tr \"\\\\0\" a); sleep 1' & done; wait")
    job_dir = make_job_dir(jid, ["sh", "-c", script], timeout_s=20.0, **fields)
    status = await keepers.run(job_dir)  # asserts status.json exists: the keeper survived
    result = cgroup_backend.finish(jid, status["signal"])
    assert result["oom_killed"] is True, (status, result)
    assert result["cleanup_error"] is None


async def test_finish_reports_cpu_time_for_a_busy_loop(cgroup_backend, keepers, make_job_dir):
    jid = job_id("busy")
    fields = cgroup_backend.prepare(jid, [last_cpu()], None)
    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass"
    job_dir = make_job_dir(jid, [sys.executable, "-c", busy], cpus=[last_cpu()], **fields)
    status = await keepers.run(job_dir)
    result = cgroup_backend.finish(jid, status["signal"])
    assert status["exit_code"] == 0
    assert result["oom_killed"] is False
    assert 350 <= result["cpu_time_ms"] <= 5000, result
    assert result["cpu_time_ms"] >= status["cpu_time_ms"] - 5  # the group sees the whole tree


async def test_finish_kills_processes_that_escaped_the_process_group(
        cgroup_backend, keepers, make_job_dir):
    """The keeper (a subreaper) already ends a `setsid` escapee with the job; `finish`
    still drains whatever else is in the group (here a process that joined it from
    outside the keeper's tree) before removing it."""
    import subprocess

    jid = job_id("escape")
    fields = cgroup_backend.prepare(jid, None, None)
    job_dir = make_job_dir(jid, ["sh", "-c", "setsid sleep 300 >/dev/null 2>&1 </dev/null & "
                                 "echo $!"], **fields)
    status = await keepers.run(job_dir)
    escaped = int(stdout_of(job_dir).split()[0])
    assert status["exit_code"] == 0
    assert _dead(escaped), "the setsid escapee outlived its job"
    outsider = subprocess.Popen(["sleep", "300"])
    try:
        for procs in fields["cgroup_procs"]:
            with open(procs, "w") as f:
                f.write(str(outsider.pid))
        result = cgroup_backend.finish(jid, status["signal"])
        assert result["cleanup_error"] is None
        assert outsider.wait(10) == -signal.SIGKILL
    finally:
        outsider.kill()
        outsider.wait()
    assert not cgroup_backend.adopt(jid)


def _dead(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_auto_chooses_cgroup_on_this_host():
    existed = {c: os.path.exists(f"/sys/fs/cgroup/{c}/{PARENT}")
               for c in ("cpuset", "memory", "cpuacct", "")}
    try:
        backend = choose_backend("auto")
        assert backend.name == "cgroup"
        health = backend.health()
        assert health["backend"] == "cgroup" and health["enforces"] == ["cpus", "memory"]
        assert health["version"] in (1, 2) and PARENT in health["parent"]
        assert any("systemd" in n for n in health["notes"])
        assert choose_backend("cgroup").name == "cgroup"
    finally:
        for c, was in existed.items():  # leave the host as we found it
            path = f"/sys/fs/cgroup/{c}/{PARENT}" if c else f"/sys/fs/cgroup/{PARENT}"
            if not was and os.path.isdir(path):
                try:
                    os.rmdir(path)
                except OSError:
                    pass  # a runner started meanwhile uses it


def test_sweep_removes_unknown_job_groups_and_keeps_known_ones(cgroup_backend):
    import subprocess

    known, leftover = job_id("known"), job_id("leftover")
    known_paths = group_paths(cgroup_backend, known)
    leftover_paths = group_paths(cgroup_backend, leftover)
    sleeper = subprocess.Popen(["sleep", "1000"])
    try:
        for path in leftover_paths:  # a process of the forgotten job, in its group(s)
            with open(os.path.join(path, "cgroup.procs"), "w") as f:
                f.write(str(sleeper.pid))
        swept = cgroup_backend.sweep({known})
        assert sleeper.wait(10) == -signal.SIGKILL
        assert not any(os.path.exists(p) for p in leftover_paths)
        assert all(os.path.isdir(p) for p in known_paths)
        assert len(swept) == 1 and f"job-{leftover}" in swept[0] and str(sleeper.pid) in swept[0]
        assert cgroup_backend.sweep({known}) == []  # nothing left to sweep
    finally:
        sleeper.kill()
        sleeper.wait()
        cgroup_backend.finish(known)


def test_prepare_creates_only_the_jobs_groups_never_the_parent(cgroup_backend, monkeypatch):
    """The parent group is made once, when the backend opens (the probe); a job's
    prepare makes exactly its own group(s) and nothing else (issue 14: it used to try
    the parent again for every job, one failing mkdir per hierarchy)."""
    from motor.isolation import cgroup as cg

    made: list[str] = []
    real_mkdir = os.mkdir

    def counting_mkdir(path, *args, **kw):
        made.append(str(path))
        return real_mkdir(path, *args, **kw)

    monkeypatch.setattr(cg.os, "mkdir", counting_mkdir)
    jid = job_id("once")
    try:
        fields = cgroup_backend.prepare(jid, [last_cpu()], 32 * MiB)
    finally:
        monkeypatch.setattr(cg.os, "mkdir", real_mkdir)
        result = cgroup_backend.finish(jid)
    assert sorted(made) == sorted(os.path.dirname(p) for p in fields["cgroup_procs"]), made
    assert all(p.endswith(f"/job-{jid}") for p in made)
    assert result["cleanup_error"] is None


def test_a_parent_removed_while_running_is_made_again_by_the_next_prepare(cgroup_backend):
    """An operator (or a cleanup script) removed the empty parent group while the runner
    runs: the next job's prepare re-creates and re-initialises it instead of failing."""
    for path in cgroup_backend.flavour.parent_paths():
        os.rmdir(path)
    jid = job_id("regrow")
    fields = cgroup_backend.prepare(jid, [last_cpu()], 32 * MiB)
    try:
        dirs = [os.path.dirname(p) for p in fields["cgroup_procs"]]
        assert all(os.path.isdir(d) for d in dirs)
        if cgroup_backend.version == 1:
            assert read(f"{dirs[0]}/cpuset.cpus").strip() == str(last_cpu())
            assert read(f"{dirs[0]}/cpuset.mems").strip() != ""
    finally:
        assert cgroup_backend.finish(jid)["cleanup_error"] is None


def _nest(paths, depth: int = 3) -> list[str]:
    """Groups a job made inside its own (child/child/...): the deepest of each."""
    deepest = []
    for path in paths:
        sub = path
        for _ in range(depth):
            sub = os.path.join(sub, "child")
            os.mkdir(sub)
        deepest.append(sub)
    return deepest


def test_groups_a_job_made_inside_its_own_are_removed_with_them(cgroup_backend):
    """A job running as root may make groups inside its own (a test harness, a container
    tool). Before stop 57 their EBUSY left the job's groups behind for good, at its end and
    at every start-up sweep."""
    import subprocess

    ended, forgotten = job_id("nested"), job_id("nested-sweep")
    ended_paths = group_paths(cgroup_backend, ended)
    _nest(ended_paths)
    result = cgroup_backend.finish(ended)
    assert result["cleanup_error"] is None, result
    assert not any(os.path.exists(p) for p in ended_paths)

    forgotten_paths = group_paths(cgroup_backend, forgotten)
    deepest = _nest(forgotten_paths)
    if cgroup_backend.version == 1:  # a cpuset group takes a task once it has cpus and mems
        parent_cpuset = next(p for p in forgotten_paths if "/cpuset/" in p)
        for level in range(1, 4):
            sub = parent_cpuset + "/child" * level
            for knob in ("cpuset.cpus", "cpuset.mems"):
                with open(os.path.join(sub, knob), "w") as f:
                    f.write(read(os.path.join(os.path.dirname(sub), knob)))
    sleeper = subprocess.Popen(["sleep", "1000"])
    try:
        for path in deepest:  # a process of the forgotten job in its deepest group(s)
            with open(os.path.join(path, "cgroup.procs"), "w") as f:
                f.write(str(sleeper.pid))
        swept = cgroup_backend.sweep(set())
        assert sleeper.wait(10) == -signal.SIGKILL
        assert not any(os.path.exists(p) for p in forgotten_paths), swept
    finally:
        sleeper.kill()
        sleeper.wait()
