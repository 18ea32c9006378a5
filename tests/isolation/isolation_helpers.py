"""Helpers for the isolation tests (imported by conftest and the tests)."""

from __future__ import annotations

import itertools
import os

import pytest

from motor.isolation import IsolationError
from motor.isolation.cgroup import detect
from private_cgroup import kill_and_remove

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


def remove_parent(backend) -> None:
    for path in backend.flavour.parent_paths():
        kill_and_remove(path, strict=True)



def job_id(tag: str) -> str:
    return f"t{os.getpid()}-{tag}-{next(counter)}"
