"""Joining a job's confinement: one call, made by the process that then spawns (or becomes)
the job, so that the job and all its descendants are born inside (docs/isolation.md).

`join_confinement(spec)` reads the spec fields an isolation backend's `prepare()` returned:

- `cgroup_make` (the cgroup backend on v1, when the runner leaves the job's groups to the
  keeper): the groups to make and the limits to write in them (`make_groups`), before
  the join. keeperd makes them from a spare group instead where it has one
  (motor/execution/spares.py).
- `cgroup_procs` (the cgroup backend): the caller writes its own pid into each
  `cgroup.procs` file (one per v1 hierarchy, or the one v2 group).
- `systemd_scope` (the systemd backend): the caller asks systemd, over the manager's D-Bus
  API, for a transient scope in the job's (slot) slice with itself as its process
  (`StartTransientUnit`, `PIDs=[own pid]`), and waits for the start job to finish: what
  `systemd-run --scope` does for itself before it execs, without a second program.

Light to import (stdlib; the D-Bus client, jeepney via motor/isolation/systemd.py, only
when a scope is asked for): the per-job keeper is forked from a small forkserver that
imports this module once (motor/execution/forkserver.py).
"""

from __future__ import annotations

import errno
import os
import struct
import time

__all__ = ["JoinError", "fork_into_cgroup", "join_cgroups", "join_confinement", "make_groups",
           "start_scope", "write_knob"]

#: How long the caller waits for systemd to answer and to move it into the scope.
SCOPE_TIMEOUT_S = 10.0


class JoinError(RuntimeError):
    """The caller could not be put into the job's confinement (the job must not run)."""


def join_confinement(spec: dict) -> bool:
    """Put the calling process into the job's confinement named by `spec`; True when it
    joined something (then it shares the job's groups, e.g. its memory limit)."""
    joined = False
    make = spec.get("cgroup_make")
    if make:
        make_groups(make)
    procs = spec.get("cgroup_procs") or ()
    if procs:
        join_cgroups(procs)
        joined = True
    scope = spec.get("systemd_scope")
    if scope:
        start_scope(scope["address"], scope["scope"], scope["slice"],
                    description=scope.get("description", ""))
        joined = True
    return joined


def join_cgroups(procs, pid: int | None = None) -> None:
    """Write `pid` (default: our own) into every `cgroup.procs` path."""
    me = str(os.getpid() if pid is None else pid).encode()
    for path in procs:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.write(fd, me)
            finally:
                os.close(fd)
        except OSError as exc:
            raise JoinError(f"cannot join cgroup via {path!r}: {exc.strerror}") from None


def rmdir_retry(path: str, deadline: float, interval: float = 0.01) -> str | None:
    """rmdir a group, retrying EBUSY (tasks still exiting) until the monotonic `deadline`:
    None when it is gone, else why not. A group the job made inside its own (a job running
    as root may: a test harness, a container tool) is removed first, deepest first; before
    stop 57 its EBUSY left the job's groups behind for good, the start-up sweep's too.
    Shared by the cgroup backend, keeperd's removals and its spares."""
    while True:
        try:
            os.rmdir(path)
            return None
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.EBUSY and remove_subgroups(path):
                continue  # the job's own groups are gone: this one may go now
            if exc.errno != errno.EBUSY or time.monotonic() >= deadline:
                return f"cannot remove {path}: {exc.strerror or exc}"
        time.sleep(interval)


def remove_subgroups(path: str) -> bool:
    """Remove the groups below `path`, deepest first (each empty of tasks by now, or its
    rmdir fails and it stays); whether any was removed. Iterative: a job can nest them
    deeper than Python recurses."""
    found, stack = [], [path]
    while stack:
        try:
            with os.scandir(stack.pop()) as entries:
                subs = [e.path for e in entries if e.is_dir(follow_symlinks=False)]
        except OSError:
            continue
        found += subs
        stack += subs
    removed = False
    for sub in reversed(found):  # a group is listed after its parent: children go first
        try:
            os.rmdir(sub)
            removed = True
        except OSError:
            pass
    return removed


def write_knob(path: str, value: str) -> None:
    """One write(2) to a cgroup control file; JoinError naming the file and the value."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, value.encode())
        finally:
            os.close(fd)
    except OSError as exc:
        raise JoinError(f"cannot write {value!r} to {path}: {exc.strerror or exc}") from None


def make_groups(make: dict) -> None:
    """Make the job's groups named by the spec's `cgroup_make` and write its limits:
    `{"dirs": {controller: dir}, "writes": [[controller, knob, value], ...]}` (written in
    that order: cpuset.mems before cpuset.cpus). A group that exists already is reused
    and its limits rewritten (a retried start), as the runner's `prepare` did."""
    dirs = make["dirs"]
    for d in dirs.values():
        try:
            os.mkdir(d)
        except FileExistsError:
            pass
        except OSError as exc:
            raise JoinError(f"cannot create cgroup {d}: {exc.strerror or exc}") from None
    for controller, knob, value in make.get("writes", ()):
        write_knob(os.path.join(dirs[controller], knob), value)


# -- the systemd scope -----------------------------------------------------------------------------


def start_scope(address: str, scope: str, slice_name: str, *, pid: int | None = None,
                description: str = "", timeout: float = SCOPE_TIMEOUT_S) -> None:
    """Ask systemd for the transient scope `scope` in `slice_name` holding `pid` (default:
    the caller), and wait until its start job finished. Raises JoinError with systemd's
    own words when it refuses (e.g. the name is taken) or does not answer in time.

    The D-Bus client is the runner's (jeepney, motor/isolation/systemd.py), imported here
    only when a scope is asked for: the forkserver imports it once, each keeper inherits it."""
    from .systemd import SystemdError, SystemdManager

    pid = os.getpid() if pid is None else pid
    properties = [("Description", ("s", description or f"motor job scope {scope}")),
                  ("Slice", ("s", slice_name)),
                  ("CollectMode", ("s", "inactive-or-failed")),
                  ("PIDs", ("au", [pid]))]
    try:
        with SystemdManager(address, timeout=timeout) as manager:
            job = manager.start_transient(scope, properties)
            result = manager.wait_job(job, timeout)
    except SystemdError as exc:
        raise JoinError(str(exc)) from None
    if result != "done":
        raise JoinError(f"systemd: the start of scope {scope} in {slice_name} "
                        + ("did not finish in time" if result is None else f"ended {result!r}"))


# -- cgroup v2: born inside (clone3 with CLONE_INTO_CGROUP) -----------------------------------------

#: clone3(2) (Linux 5.3; CLONE_INTO_CGROUP since 5.7). 435 on every architecture that
#: uses the generic syscall table, x86_64 included.
SYS_CLONE3 = 435
CLONE_INTO_CGROUP = 0x200000000
_CLONE_ARGS = struct.Struct("<11Q")  # struct clone_args up to .cgroup (CLONE_ARGS_SIZE_VER2)


def fork_into_cgroup(cgroup_dir: str) -> int:
    """fork(), with the child born in the cgroup v2 group `cgroup_dir`: 0 in the child, the
    child's pid in the parent (as os.fork). No migration happens, so the child never waits
    for the kernel's cgroup_threadgroup_rwsem write side (on a host without favordynmods
    the first migration after an idle spell waits an RCU grace period, 10-20 ms here).

    For a spawner that fork+execs a job (motor/execution): the child sets up its fds and
    execs. Raises OSError (ENOSYS: kernel before 5.7 or a seccomp filter; EOPNOTSUPP, EBADF:
    `cgroup_dir` is not on a cgroup v2 hierarchy; EBUSY: a group with controllers enabled
    for its children; EDEADLK: this process runs other threads) with nothing forked; the
    caller may fall back to fork + join_cgroups.

    The syscall goes around glibc's fork(), so none of glibc's fork handlers run: a lock
    another thread holds at that moment (malloc's) stays held in the child for ever. So a
    process running other threads (any kind: /proc/self/task counts them all) is refused.
    keeperd, the one caller, runs other threads only on cgroup v1, for its spares, where
    it never asks for this; a test's pytest process with a leftover server thread once hung
    its child so.
    """
    import ctypes  # the forkserver has it loaded already

    if len(os.listdir("/proc/self/task")) > 1:
        raise OSError(errno.EDEADLK, "clone3 into a cgroup from a process with other threads "
                      "(its child could wait for ever on a lock one of them held): fork and join")
    fd = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        args = ctypes.create_string_buffer(_CLONE_ARGS.pack(
            CLONE_INTO_CGROUP, 0, 0, 0, 17,  # flags, pidfd, child_tid, parent_tid, SIGCHLD
            0, 0, 0, 0, 0, fd), _CLONE_ARGS.size)  # stack, stack_size, tls, set_tid(_size)
        api = ctypes.pythonapi  # holds the GIL across the call, as os.fork does
        libc = ctypes.PyDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        api.PyOS_BeforeFork()
        pid = libc.syscall(ctypes.c_long(SYS_CLONE3), args, ctypes.c_size_t(_CLONE_ARGS.size))
        if pid == 0:
            api.PyOS_AfterFork_Child()
            return 0
        err = ctypes.get_errno()
        api.PyOS_AfterFork_Parent()
        if pid < 0:
            raise OSError(err, f"clone3 into {cgroup_dir}: {os.strerror(err)}")
        return pid
    finally:
        os.close(fd)  # in the child too (it is close-on-exec anyway)
