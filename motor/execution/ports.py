"""The outside world the job execution actor talks to, as two small protocols.

Production passes the real ones (`Spawner`, whose keepers are real processes, and
`thread_offload` from motor/offload.py, a worker thread); actor-level tests pass in-process fakes
(tests/fakes.py) and run in virtual time (`autojump_clock`) with no process and no thread.
"""

from __future__ import annotations

import os
from typing import Protocol

import trio

from ..offload import Offload, thread_offload
from .spawner import KeeperHandle

__all__ = ["Keepers", "KeeperHandle", "Offload", "thread_offload"]


class Keepers(Protocol):
    """Starts a job's keeper and watches it (motor.execution.spawner.Spawner)."""

    async def spawn(self, job_dir: os.PathLike[str] | str) -> KeeperHandle:
        """Fork a keeper for the job directory (raises JobDirClaimed, KeeperNotStarted,
        SpawnerError)."""

    async def wait_exit(self, pid: int, create_time: float,
                        job_dir: os.PathLike[str] | str | None = None) -> None:
        """Return once that keeper is done with the job in `job_dir` (a per-job keeper: its
        process exited; keeperd: the job's status is written, or keeperd is gone)."""

    def exit_event(self, pid: int, create_time: float,
                   job_dir: os.PathLike[str] | str) -> trio.Event | None:
        """An event set when `wait_exit` would return at once (or has to look again: it
        is still called after it), for a job whose end the keeper reports unasked; None
        when the only way is to wait in `wait_exit`. Lets the job actor tail the output
        while waiting, without a task of its own for the wait."""

    def cancel(self, pid: int, create_time: float,
               job_dir: os.PathLike[str] | str | None = None) -> bool:
        """Ask that keeper to cancel the job in `job_dir`; True when a request was sent."""

    def kill_marked(self, job_id: str) -> list[int]:
        """Kill what is left of the job's process tree (blocking: call it offloaded)."""

