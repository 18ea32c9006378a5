"""Helpers for the keeper/forkserver tests (imported by conftest and tests)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from keeper_tracking import JOB_TIMEOUT_S, Tracker, finish  # noqa: F401 (re-exported)
from motor.execution import read_records

async def wait_until(predicate: Callable[[], Any], timeout: float = JOB_TIMEOUT_S) -> Any:
    """Bounded polling loop (for files written by other processes)."""
    with trio.fail_after(timeout):
        while True:
            value = predicate()
            if value:
                return value
            await trio.sleep(0.01)


def records(job_dir: Path) -> list[tuple[str, bytes]]:
    """Every complete record of the job's output.log (read batch by batch)."""
    out: list[tuple[str, bytes]] = []
    offset = 0
    while True:
        recs, offset = read_records(job_dir / "output.log", offset)
        if not recs:
            return out
        out += recs


def stream_bytes(job_dir: Path, stream: str) -> bytes:
    return b"".join(data for name, data in records(job_dir) if name == stream)


