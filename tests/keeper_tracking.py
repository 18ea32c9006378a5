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
        self.dirs: list[Path] = []

    async def spawn(self, job_dir: Path) -> KeeperHandle:
        handle = await self.spawner.spawn(job_dir)
        self.handles.append(handle)
        self.dirs.append(Path(job_dir))
        return handle

    def cancel(self, handle: KeeperHandle, job_dir: Path) -> bool:
        """Cancel the job through its keeper (a per-job keeper or keeperd)."""
        return self.spawner.cancel(handle.pid, handle.create_time, job_dir)

    async def run(self, job_dir: Path, timeout: float = JOB_TIMEOUT_S) -> dict:
        handle = await self.spawn(job_dir)
        return await finish(handle, job_dir, timeout)


async def finish(handle: KeeperHandle, job_dir: Path, timeout: float = JOB_TIMEOUT_S) -> dict:
    """Wait for the keeper to be done with the job and return its status.json: a per-job
    keeper exits; keeperd (which outlives its jobs) writes status.json, or dies."""
    from motor.execution.keeperd_client import is_keeperd_claim

    with trio.fail_after(timeout):
        if is_keeperd_claim(job_dir):
            while read_status(job_dir) is None and process_alive(handle.pid, handle.create_time):
                await trio.sleep(0.01)
        else:
            await wait_process_exit(handle.pid, handle.create_time)
    status = read_status(job_dir)
    assert status is not None, f"keeper exited without status.json in {job_dir}"
    return status


@asynccontextmanager
async def tracked_keepers(mode: str = "forkserver", state_dir: Path | None = None):
    """A spawner and its Tracker; keepers still alive at the end are cancelled. `mode`
    "keeperd" keeps the jobs of `state_dir` in its keeperd (motor/execution/keeperd.py)."""
    if mode == "keeperd":
        assert state_dir is not None
        state_dir.mkdir(parents=True, exist_ok=True)
    async with open_spawner(mode=mode, state_dir=state_dir) as spawner:
        tracker = Tracker(spawner)
        try:
            yield tracker
        finally:
            for h, d in zip(tracker.handles, tracker.dirs):
                if process_alive(h.pid, h.create_time) and read_status(d) is None:
                    tracker.cancel(h, d)


def ask_keeperd(state_dir: Path, op: str) -> dict:
    """One request without a job dir (e.g. "spares") on the state dir's keeperd socket:
    its answer (blocking; keeperd answers at once)."""
    import json
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(Path(state_dir) / "keeperd.sock"))
        f = s.makefile("rb")
        json.loads(f.readline())  # the greeting
        s.sendall(json.dumps({"id": 1, "op": op}).encode() + b"\n")
        return json.loads(f.readline())


#: recvmsg's number in /proc/<pid>/syscall
_RECVMSG = {"x86_64": 47, "aarch64": 212}


def blocked_in_recvmsg(pid: int) -> bool:
    """The process sleeps in recvmsg(2) (/proc/<pid>/syscall names the syscall it is
    blocked in); on an architecture not listed, asleep at all."""
    import platform

    with open(f"/proc/{pid}/stat") as f:
        asleep = f.read().rsplit(")", 1)[1].split()[0] == "S"
    number = _RECVMSG.get(platform.machine())
    if number is None:
        return asleep
    with open(f"/proc/{pid}/syscall") as f:
        return asleep and f.read().split()[0] == str(number)
