"""Spawning real keepers in tests, with every leftover cancelled at teardown."""

from __future__ import annotations

import os
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from motor.execution import (
    KeeperHandle, Spawner, cancel_keeper, open_spawner, process_alive, read_status,
    wait_process_exit, write_json_atomic,
)

JOB_TIMEOUT_S = 20.0


def write_job_dir(job_dir: Path, job_id: str, command: list[str], workdir: Path,
                  **fields: Any) -> Path:
    """Create a job dir with the spec.json a keeper reads: the job runs in `workdir`,
    unpinned, with a 60 s safety timeout; `fields` override any of that."""
    job_dir.mkdir(parents=True)
    spec = {"job_id": job_id, "command": command, "cwd": str(workdir), "env": dict(os.environ),
            "cpus": None, "pin": False, "cgroup_procs": [],
            "timeout_s": 60.0,  # safety net: no test job may linger
            "kill_grace_s": 1.0}
    spec.update(fields)
    write_json_atomic(job_dir / "spec.json", spec)
    return job_dir


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


@asynccontextmanager
async def tracked_keepers():
    """A spawner and its Tracker; keepers still alive at the end are cancelled."""
    async with open_spawner() as spawner:
        tracker = Tracker(spawner)
        try:
            yield tracker
        finally:
            for h in tracker.handles:
                if process_alive(h.pid, h.create_time):
                    cancel_keeper(h.pid, h.create_time)
