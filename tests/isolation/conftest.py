"""Fixtures for the cgroup tests: a real cgroup backend under a parent of its own.

The host tests use a parent group named `motor-test-<pid>-<n>` (never the real
`motor-jobs`), and remove every job group and the parent at teardown, even on failure.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from isolation_helpers import counter, remove_parent
from keeper_tracking import tracked_keepers, write_job_dir
from systemd_ns import SystemdNamespace

from motor.isolation.cgroup import open_cgroup_backend


@pytest.fixture
def cgroup_backend():
    """A real cgroup backend under a throw-away parent group, removed afterwards."""
    parent = f"motor-test-{os.getpid()}-{next(counter)}"
    backend = open_cgroup_backend(parent=parent)
    try:
        yield backend
    finally:
        remove_parent(backend)
        for path in backend.flavour.parent_paths():
            assert not os.path.exists(path), f"left behind: {path}"


@pytest.fixture
def make_job_dir(tmp_path: Path):
    """make_job_dir(job_id, command, **spec) -> job dir with spec.json written."""

    def make(job_id: str, command: list[str], **fields) -> Path:
        return write_job_dir(tmp_path / "jobs" / job_id, job_id, command, tmp_path, **fields)

    return make


@pytest.fixture
async def keepers():
    async with tracked_keepers() as tracker:
        yield tracker


@pytest.fixture
def systemd_ns(tmp_path):
    """A real systemd as PID 1 of its own namespaces (tests/isolation/systemd_ns.py), stopped
    afterwards; the test fails if it does not start."""
    ns = SystemdNamespace(tmp_path)
    try:
        ns.start()
    except RuntimeError as exc:
        ns.stop()
        pytest.fail(f"the systemd namespace did not start: {exc}")
    yield ns
    ns.stop()
