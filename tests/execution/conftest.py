"""Fixtures for the keeper/forkserver tests: real processes, no sleep-and-hope."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from keeper_tracking import tracked_keepers

from motor.execution import write_json_atomic


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir()
    return ws


@pytest.fixture
def make_job(tmp_path: Path, workspace: Path) -> Callable[..., Path]:
    """make_job(command, **spec_overrides) -> job dir with spec.json written."""
    counter = 0

    def make(command: list[str], **overrides: Any) -> Path:
        nonlocal counter
        counter += 1
        job_id = f"job{counter}"
        job_dir = tmp_path / "state" / "jobs" / job_id
        job_dir.mkdir(parents=True)
        spec = {
            "job_id": job_id,
            "command": command,
            "cwd": str(workspace),
            "env": dict(os.environ),
            "cpus": None,
            "pin": False,
            "cgroup_procs": [],
            "timeout_s": 60.0,  # safety net: no test job may linger
            "kill_grace_s": 1.0,
        }
        spec.update(overrides)
        write_json_atomic(job_dir / "spec.json", spec)
        return job_dir

    return make


@pytest.fixture
async def jobs():
    async with tracked_keepers() as tracker:
        yield tracker
