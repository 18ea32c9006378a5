"""A cgroup parent of a test's own (`motor-test-<pid>-<n>`), so a runner under test never
sweeps or touches the groups of any other runner on the host (the real `motor-jobs`)."""

from __future__ import annotations

import itertools
import os
import signal
import time

_counter = itertools.count()


def private_parent_name() -> str:
    return f"motor-test-{os.getpid()}-p{next(_counter)}"


def remove_private_parent(parent: str) -> None:
    """Kill what is left in the parent's groups and remove them (best effort, bounded)."""
    from motor.isolation import IsolationError
    from motor.isolation.cgroup import detect

    try:
        paths = detect(parent=parent).parent_paths()
    except IsolationError:
        return
    for path in paths:
        kill_and_remove(path)


def kill_and_remove(path: str, *, strict: bool = False) -> None:
    """Best-effort removal of one group directory tree (children first): SIGKILL what is
    in it until rmdir succeeds, for at most 5 s (then raise when `strict`)."""
    if not os.path.isdir(path):
        return
    deadline = time.monotonic() + 5
    while True:
        try:  # again on every pass: a keeperd still running may have made a spare group
            with os.scandir(path) as entries:  # closed even when a child vanishes mid-walk
                children = [e.path for e in entries if e.is_dir(follow_symlinks=False)]
        except FileNotFoundError:
            return
        for child in children:
            kill_and_remove(child, strict=strict)
        try:
            with open(os.path.join(path, "cgroup.procs")) as f:
                pids = [int(p) for p in f.read().split()]
        except OSError:
            pids = []
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                if strict:
                    raise
                return
            time.sleep(0.02)


def writable_v2_mount() -> str | None:
    """A cgroup v2 mount this process may write (e.g. a hybrid host's
    /sys/fs/cgroup/unified), or None."""
    with open("/proc/self/mounts") as f:
        for line in f:
            fields = line.split()
            if fields[2] == "cgroup2" and os.access(fields[1], os.W_OK):
                return fields[1]
    return None


def remove_job_groups(state_dir, parent: str = "motor-jobs") -> None:
    """Remove the job groups a test runner's jobs left under the host's `parent` (a job that
    ended while its runner was stopping keeps its groups until the next runner of that
    state dir finishes it; a test's state dir has no next runner). Only the groups of this
    state dir's jobs (its jobs/ entries) are touched."""
    from motor.isolation.cgroup import group_name

    jobs = os.path.join(str(state_dir), "jobs")
    try:
        ids = os.listdir(jobs)
    except OSError:
        return
    root = "/sys/fs/cgroup"
    try:
        hierarchies = [e.path for e in os.scandir(root) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return
    for job_id in ids:
        try:
            name = group_name(job_id)
        except Exception:  # noqa: BLE001 - not a job's dir
            continue
        for hierarchy in hierarchies:
            kill_and_remove(os.path.join(hierarchy, parent, name))
