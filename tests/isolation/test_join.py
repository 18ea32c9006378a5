"""The join step (motor/isolation/join.py) for real on this host: a process joins a job's
v1/v2 groups by writing cgroup.procs; on a cgroup v2 hierarchy a child is born in a group
with clone3(CLONE_INTO_CGROUP), without any migration.

The v2 test needs a writable cgroup v2 mount: /sys/fs/cgroup itself, or a hybrid host's
/sys/fs/cgroup/unified (this build machine); it skips with the reason elsewhere.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from isolation_helpers import needs_cgroups
from private_cgroup import kill_and_remove, writable_v2_mount

from motor.isolation.join import JoinError, fork_into_cgroup, join_cgroups, join_confinement


V2 = writable_v2_mount()
needs_v2 = pytest.mark.skipif(os.geteuid() != 0 or V2 is None,
                              reason="needs root and a writable cgroup v2 mount")


def _child_group(pid_fn) -> tuple[str, int]:
    """Run pid_fn() -> pid of a child that writes its /proc/self/cgroup v2 line to fd w."""
    r, w = os.pipe()
    pid = pid_fn(w)
    os.close(w)
    with os.fdopen(r) as f:
        line = f.read()
    _, status = os.waitpid(pid, 0)
    return line, status


def _joined_child(fields: dict) -> tuple[str, int]:
    """A forked child joins the spec's confinement (join_confinement) and reports its
    /proc/self/cgroup: (that text, its wait status)."""
    def spawn(w):
        pid = os.fork()
        if pid == 0:
            try:
                assert join_confinement(fields) is True
                os.write(w, Path("/proc/self/cgroup").read_text().encode())
            finally:
                os._exit(0)
        return pid

    return _child_group(spawn)


#: run in a process of its own: clone3 through libc.syscall runs none of glibc's fork
#: handlers, so a child forked while another thread holds a lock (malloc's) waits for it
#: forever; keeperd, its one user, has no other thread, and pytest's process may (a test's
#: server thread: this test hung once in a full run of the suite)
_BORN_INSIDE = """
import os, sys
from pathlib import Path
from motor.isolation.join import fork_into_cgroup

def line():
    return [ln for ln in Path("/proc/self/cgroup").read_text().splitlines()
            if ln.startswith("0::")][0]

r, w = os.pipe()
pid = fork_into_cgroup(sys.argv[1])
if pid == 0:
    try:
        os.write(w, line().encode())
    finally:
        os._exit(0)
os.close(w)
with os.fdopen(r) as f:
    child = f.read()
_, status = os.waitpid(pid, 0)
print(child)
print(line())
print(os.waitstatus_to_exitcode(status))
"""


@needs_v2
def test_a_child_is_born_in_the_v2_group_and_the_parent_stays_put(tmp_path):
    import subprocess
    import sys

    group = os.path.join(V2, f"motor-test-join-{os.getpid()}")
    os.mkdir(group)
    try:
        out = subprocess.run([sys.executable, "-c", _BORN_INSIDE, group], check=True,
                             capture_output=True, text=True, timeout=60).stdout
        child, parent, code = out.splitlines()
        rel = "/" + os.path.relpath(group, V2)
        assert child.endswith(rel), child
        assert code == "0"
        assert not parent.endswith(rel), parent
    finally:
        kill_and_remove(group, strict=True)


def test_clone3_is_refused_in_a_process_with_other_threads(tmp_path):
    """fork_into_cgroup bypasses glibc's fork(): no fork handler runs, so a lock another
    thread holds stays held in the child. With a second thread running it refuses
    (EDEADLK) before forking; keeperd then forks and joins."""
    import errno
    import threading

    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        with pytest.raises(OSError) as refused:
            pid = fork_into_cgroup(V2 or str(tmp_path))
            if pid == 0:  # (never, with the refusal): the child must not return into pytest
                os._exit(0)
            os.waitpid(pid, 0)
        assert refused.value.errno == errno.EDEADLK
    finally:
        stop.set()
        other.join()


def test_clone_into_a_directory_that_is_no_v2_group_forks_nothing(tmp_path):
    """In a process of its own (no other thread, so clone3 itself is tried): a plain
    directory is refused by the kernel (EBADF or EINVAL), and nothing is forked."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", (
        "import errno, os, sys\n"
        "from motor.isolation.join import fork_into_cgroup\n"
        "try:\n"
        "    pid = fork_into_cgroup(sys.argv[1])\n"
        "except OSError as exc:\n"
        "    print(errno.errorcode[exc.errno])\n"
        "else:\n"
        "    print('forked', pid)\n"
        "    os._exit(0)\n"), str(tmp_path)], check=True, capture_output=True, text=True,
        timeout=60).stdout.split()
    assert out[0] in ("EBADF", "EINVAL", "EOPNOTSUPP", "ENOSYS"), out


@needs_cgroups
def test_join_writes_the_callers_pid_into_every_group_and_names_a_bad_one(cgroup_backend):
    jid = f"t{os.getpid()}-join"
    fields = cgroup_backend.prepare(jid, None, None)
    try:
        text, status = _joined_child(fields)
        assert os.waitstatus_to_exitcode(status) == 0
        assert text.count(f"/job-{jid}") == len(fields["cgroup_procs"]), text
        assert join_confinement({"cgroup_procs": []}) is False
        with pytest.raises(JoinError, match="cannot join cgroup via .*nothing-here"):
            join_cgroups(["/sys/fs/cgroup/nothing-here/cgroup.procs"])
    finally:
        assert cgroup_backend.finish(jid)["cleanup_error"] is None


@needs_cgroups
def test_a_keeper_makes_the_v1_groups_the_spec_names_then_joins_them(cgroup_backend):
    """In the runner's mode on v1 (`keeper_makes_groups`) `prepare` makes no group: the
    spec's `cgroup_make` names them and their limits, and the keeper's join makes them
    (the per-job keeper, and keeperd when it has no spare) before joining."""
    import dataclasses

    backend = dataclasses.replace(cgroup_backend, keeper_makes_groups=True)
    if backend.version != 1:
        pytest.skip("the keeper makes the groups on cgroup v1 only")
    jid = f"t{os.getpid()}-make"
    cpu = sorted(os.sched_getaffinity(0))[-1]
    fields = backend.prepare(jid, [cpu], 48 << 20)
    dirs = [os.path.dirname(p) for p in fields["cgroup_procs"]]
    try:
        assert not any(os.path.exists(d) for d in dirs)

        text, status = _joined_child(fields)
        assert os.waitstatus_to_exitcode(status) == 0
        assert text.count(f"/job-{jid}") == 3, text
        job = backend.flavour.job_dirs(jid)
        assert Path(job["cpuset"], "cpuset.cpus").read_text().strip() == str(cpu)
        assert int(Path(job["memory"], "memory.limit_in_bytes").read_text()) == 48 << 20
    finally:
        assert backend.finish(jid)["cleanup_error"] is None
        assert not any(os.path.exists(d) for d in dirs)
