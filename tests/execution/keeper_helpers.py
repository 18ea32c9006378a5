"""Helpers for the keeper/forkserver tests (imported by conftest and tests)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from motor.execution import KeeperHandle, Spawner, read_records, read_status, wait_process_exit

JOB_TIMEOUT_S = 20.0


class Tracker:
    """Remembers spawned keepers so teardown can cancel leftovers."""

    def __init__(self, spawner: Spawner) -> None:
        self.spawner = spawner
        self.handles: list[KeeperHandle] = []

    async def spawn(self, job_dir: Path) -> KeeperHandle:
        handle = await self.spawner.spawn(job_dir)
        self.handles.append(handle)
        return handle

    async def run(self, job_dir: Path, timeout: float = JOB_TIMEOUT_S) -> dict:
        handle = await self.spawn(job_dir)
        return await finish(handle, job_dir, timeout)


async def finish(handle: KeeperHandle, job_dir: Path, timeout: float = JOB_TIMEOUT_S) -> dict:
    """Wait for the keeper to exit and return its status.json."""
    with trio.fail_after(timeout):
        await wait_process_exit(handle.pid, handle.create_time)
    status = read_status(job_dir)
    assert status is not None, f"keeper exited without status.json in {job_dir}"
    return status


async def wait_until(predicate: Callable[[], Any], timeout: float = JOB_TIMEOUT_S) -> Any:
    """Bounded polling loop (for files written by other processes)."""
    with trio.fail_after(timeout):
        while True:
            value = predicate()
            if value:
                return value
            await trio.sleep(0.01)


def records(job_dir: Path) -> list[tuple[str, bytes]]:
    recs, _ = read_records(job_dir / "output.log", 0)
    return recs


def stream_bytes(job_dir: Path, stream: str) -> bytes:
    return b"".join(data for name, data in records(job_dir) if name == stream)


