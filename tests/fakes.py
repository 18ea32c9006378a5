"""In-process fakes of the outside world (motor/execution/ports.py) for actor-level tests
under trio's MockClock: no process, no thread, every step staged by the test."""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any, Callable

import trio

import actors
from motor.execution import joblog
from motor.execution.spawner import KeeperHandle


async def inline_offload(fn: Callable[..., Any], *args: Any) -> Any:
    """Offload that runs the function inline: virtual time cannot jump during it."""
    return fn(*args)


class FakeKeepers:
    """A spawner whose keepers are in-process: `spawn` claims the job directory
    (keeper.json) and returns a made-up handle; the test ends a keeper with `exit`.

    Stage points: set `gate` to a trio.Event and `spawn` waits on it (a spawn in flight);
    set `fail` to an exception and the next `spawn` raises it (a failed start).
    `reports_ends`: `exit_event` gives the keeper's exit event (keeperd's way: the job
    actor waits on it); False: None (a per-job keeper's: waited for in `wait_exit`)."""

    def __init__(self) -> None:
        self.spawned: list[Path] = []
        self.cancelled: list[int] = []
        self.gate: trio.Event | None = None
        self.fail: BaseException | None = None
        self._pids = itertools.count(4_000_000)
        self._exits: dict[int, trio.Event] = {}
        self._dirs: dict[int, Path] = {}
        self.reports_ends = True

    async def spawn(self, job_dir: os.PathLike[str] | str) -> KeeperHandle:
        path = Path(job_dir)
        self.spawned.append(path)
        if self.gate is not None:
            await self.gate.wait()
        if self.fail is not None:
            exc, self.fail = self.fail, None
            raise exc
        pid = next(self._pids)
        joblog.write_json_atomic(path / "keeper.json", {
            "keeper_pid": pid, "keeper_create_time": 1.0, "started_at_ms": None})
        self._exits[pid] = trio.Event()
        self._dirs[pid] = path
        return KeeperHandle(pid=pid, create_time=1.0)

    def exit(self, pid: int, *, exit_code: int | None = 0, signal: int | None = None,
             reason: str | None = None, detail: str | None = None) -> None:
        """The keeper writes its status.json and exits."""
        joblog.write_json_atomic(self._dirs[pid] / "status.json", {
            "exit_code": exit_code, "signal": signal, "reason": reason, "detail": detail,
            "started_at_ms": None, "ended_at_ms": None})
        self._exits[pid].set()

    def exit_event(self, pid: int, create_time: float, job_dir) -> trio.Event | None:
        return self._exits[pid] if self.reports_ends else None

    async def wait_exit(self, pid: int, create_time: float, job_dir=None) -> None:
        await self._exits[pid].wait()

    def cancel(self, pid: int, create_time: float, job_dir=None) -> bool:
        self.cancelled.append(pid)
        if not self._exits[pid].is_set():  # the keeper stops its job and records why
            self.exit(pid, exit_code=None, signal=15, reason="cancelled")
        return True

    def kill_marked(self, job_id: str) -> list[int]:
        return []


class Recorder(actors.Actor):
    """A stand-in for another actor: records every message, answers with `reply(msg)`."""

    def __init__(self, name: str, reply: Callable[[Any], Any] = lambda msg: None):
        super().__init__(name=name)
        self.seen: list[Any] = []
        self._reply = reply

    async def handle(self, msg: Any) -> Any:
        self.seen.append(msg)
        return self._reply(msg)

    def kinds(self) -> list[str]:
        return [type(m).__name__ for m in self.seen]
