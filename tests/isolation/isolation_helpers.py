"""Helpers for the isolation tests (imported by conftest and the tests)."""

from __future__ import annotations

import itertools
import os
import signal
import time

import pytest

from motor.isolation import IsolationError
from motor.isolation.cgroup import detect

counter = itertools.count()


def cgroup_unavailable() -> str | None:
    """Why the host tests cannot run here (None: they can)."""
    if os.geteuid() != 0:
        return "cgroup host tests need root"
    try:
        detect()
    except IsolationError as exc:
        return f"no writable cgroups on this host: {exc}"
    return None


needs_cgroups = pytest.mark.skipif(
    cgroup_unavailable() is not None, reason=cgroup_unavailable() or "")


def _kill_and_remove(path: str) -> None:
    """Best-effort removal of one group directory tree (children first)."""
    if not os.path.isdir(path):
        return
    for entry in os.scandir(path):
        if entry.is_dir(follow_symlinks=False):
            _kill_and_remove(entry.path)
    deadline = time.monotonic() + 5
    while True:
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
                raise
            time.sleep(0.02)


def remove_parent(backend) -> None:
    for path in backend.flavour.parent_paths():
        _kill_and_remove(path)



def job_id(tag: str) -> str:
    return f"t{os.getpid()}-{tag}-{next(counter)}"
