"""Fixtures for the cgroup tests: a real cgroup backend under a parent of its own.

The host tests use a parent group named `motor-test-<pid>-<n>` (never the real
`motor-jobs`), and remove every job group and the parent at teardown, even on failure.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from isolation_helpers import counter, remove_parent
from keeper_tracking import tracked_keepers

from motor.execution import write_json_atomic
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
        job_dir = tmp_path / "jobs" / job_id
        job_dir.mkdir(parents=True)
        spec = {"job_id": job_id, "command": command, "cwd": str(tmp_path),
                "env": dict(os.environ), "cpus": None, "pin": False, "cgroup_procs": [],
                "timeout_s": 60.0, "kill_grace_s": 1.0}
        spec.update(fields)
        write_json_atomic(job_dir / "spec.json", spec)
        return job_dir

    return make


@pytest.fixture
async def keepers():
    async with tracked_keepers() as tracker:
        yield tracker


