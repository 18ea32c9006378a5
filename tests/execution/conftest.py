"""Fixtures for the keeper/forkserver tests: real processes, no sleep-and-hope."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from keeper_tracking import tracked_keepers, write_job_dir


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
        return write_job_dir(tmp_path / "state" / "jobs" / job_id, job_id, command,
                             workspace, **overrides)

    return make


@pytest.fixture
async def jobs():
    async with tracked_keepers() as tracker:
        yield tracker
