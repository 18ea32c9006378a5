"""The task client's directory and its QueueLock critical section (blocking I/O; the queue
actor runs it in a worker thread, one message = one critical section).

The lock is an fcntl lock (flock) on `C/queue.json.lock`, the queue file's lock file, held
for the whole message.  (Not on `queue.json` itself: every publish replaces that file by
rename, and one critical section may publish twice, so a lock on its inode would not
exclude a second process between the two publishes.)  The client dir itself is flocked
first (motor/locks.py: a removed lock file cannot let a second section in).  Task and
runner records are also written under this lock.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Callable, TypeVar

import msgspec
import psutil

from motor.locks import lock_dir_and_file, release
from motor.tasks.core import Observation
from motor.tasks.records import (
    ProcessIdentity,
    QueueFile,
    RunnerRecord,
    TaskRecord,
    atomic_write,
    decode,
    encode,
)

T = TypeVar("T")


class ClientDirError(Exception):
    """A file of the client dir that exists but cannot be read as what it holds: one line
    naming it. Nothing was changed (never a guess at the queue: a wrong one could start more
    runner processes than the slots allow)."""


def _read(path: Path, type_, empty=None):
    """`path` decoded as `type_` (`empty` for a file with nothing in it, when given: a crash
    before the first publish); FileNotFoundError as it is; ClientDirError if damaged."""
    try:
        data = path.read_bytes()
        if empty is not None and not data.strip():
            return empty
        return decode(data, type_)
    except FileNotFoundError:
        raise
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ClientDirError(f"{path} cannot be read ({exc}); nothing was changed: restore it, "
                             "or move it aside to start without it (docs/tasks.md)") from None


def _unusable(root: Path, exc: OSError) -> ClientDirError:
    return ClientDirError(f"client dir {root} cannot be used ({exc}): it must be a writable "
                          "directory (docs/tasks.md, \"Client state\")")


def default_client_dir() -> Path:
    return Path(os.path.expanduser("~/.local/state/motor-client"))


def identity_of(pid: int) -> ProcessIdentity:
    """(pid, start time in microseconds) of a running process."""
    return ProcessIdentity(pid=pid, start_time_micros=int(round(psutil.Process(pid).create_time() * 1_000_000)))


def my_identity() -> ProcessIdentity:
    return identity_of(os.getpid())


def observe_process(ident: ProcessIdentity) -> Observation:
    """The real liveness oracle: psutil.  A pid whose start time differs (recycled) is a
    mismatch; a zombie counts as gone; an unreadable process is ambiguous (counted live:
    prefer overcount to overspawn)."""
    try:
        proc = psutil.Process(ident.pid)
        created = int(round(proc.create_time() * 1_000_000))
        if abs(created - ident.start_time_micros) > 20_000:  # create_time has ~10 ms resolution
            return "mismatch"
        if proc.status() == psutil.STATUS_ZOMBIE:
            return "gone"
        return "matching"
    except psutil.NoSuchProcess:
        return "gone"
    except (psutil.AccessDenied, OSError):
        return "ambiguous"


class Locked:
    """What one critical section sees: the queue, task.runner records, the oracle, and
    the writes (each atomic)."""

    def __init__(self, cdir: "ClientDir", queue: QueueFile, runners: dict[str, RunnerRecord],
                 observe: Callable[[ProcessIdentity], Observation]):
        self.cdir = cdir
        self.queue = queue
        self.runners = runners
        self.observe = observe
        self._published = encode(queue)

    def publish(self) -> None:
        """Write the queue now if it changed (used between the two publishes of a handoff)."""
        data = encode(self.queue)
        if data != self._published:
            atomic_write(self.cdir.queue_path, data)
            self._published = data

    def set_runner(self, task_id: str, record: RunnerRecord | None) -> None:
        path = self.cdir.runner_path(task_id)
        if record is None:
            self.runners.pop(task_id, None)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        else:
            self.runners[task_id] = record
            atomic_write(path, encode(record))

    def read_task(self, task_id: str) -> TaskRecord | None:
        return self.cdir.read_task(task_id)

    def write_task(self, task: TaskRecord) -> None:
        self.cdir.write_task(task)


class ClientDir:
    """`C/`: paths, reads, and `critical(fn)` (the QueueLock)."""

    def __init__(self, root: str | os.PathLike,
                 observe: Callable[[ProcessIdentity], Observation] = observe_process):
        self.root = Path(root).expanduser().absolute()
        self.observe = observe
        self.queue_path = self.root / "queue.json"
        self.lock_path = self.root / "queue.json.lock"
        self.tasks_dir = self.root / "tasks"
        self.runners_dir = self.root / "runners"
        self.turns_dir = self.root / "turns"
        self.logs_dir = self.root / "logs"

    def ensure(self) -> None:
        """The client dir's directories and an empty queue, made when missing;
        ClientDirError when the dir cannot be used (read-only, not permitted, full)."""
        try:
            for d in (self.root, self.tasks_dir, self.runners_dir, self.turns_dir, self.logs_dir):
                d.mkdir(parents=True, exist_ok=True)
            if not self.queue_path.exists():
                try:
                    fd = os.open(self.queue_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                except FileExistsError:
                    return
                try:
                    os.write(fd, encode(QueueFile()))
                    os.fsync(fd)
                finally:
                    os.close(fd)
        except OSError as exc:
            raise _unusable(self.root, exc) from None

    def task_path(self, task_id: str) -> Path:
        return self.tasks_dir / f"{task_id}.json"

    def runner_path(self, task_id: str) -> Path:
        return self.runners_dir / f"{task_id}.json"

    def turn_dir(self, task_id: str, turn_id: str) -> Path:
        return self.turns_dir / task_id / turn_id

    def read_task(self, task_id: str) -> TaskRecord | None:
        try:
            return _read(self.task_path(task_id), TaskRecord)
        except FileNotFoundError:
            return None

    def write_task(self, task: TaskRecord) -> None:
        atomic_write(self.task_path(task.task_id), encode(task))

    def list_tasks(self) -> list[TaskRecord]:
        out = []
        for p in sorted(self.tasks_dir.glob("*.json")):
            try:
                out.append(decode(p.read_bytes(), TaskRecord))
            except (OSError, msgspec.DecodeError, msgspec.ValidationError):
                continue
        return sorted(out, key=lambda t: (t.created_at_ms, t.task_id))

    def read_runners(self) -> dict[str, RunnerRecord]:
        """Every task.runner record; ClientDirError for one that cannot be read. Never
        skipped: a runner left out would read as no runner, and reconcile would start a
        second one for its turn while it still runs."""
        runners = {}
        for p in self.runners_dir.glob("*.json"):
            try:
                runners[p.stem] = _read(p, RunnerRecord)
            except FileNotFoundError:
                continue  # cleared between the listing and the read (an unlocked reader)
        return runners

    def read_queue(self) -> QueueFile:
        """An unlocked snapshot (for list/show); never for read-modify-write."""
        try:
            return _read(self.queue_path, QueueFile, QueueFile())
        except FileNotFoundError:
            return QueueFile()

    def critical(self, fn: Callable[[Locked], T]) -> T:
        """Run `fn` holding the QueueLock; publish the queue if `fn` changed it.

        The lock is flock on `C/queue.json.lock`, a file that is never replaced: the queue
        file itself is replaced by rename on every publish, and a critical section may
        publish twice (complete_runner_spawn), so a lock on the queue file's inode would let
        a second holder in between those publishes."""
        self.ensure()
        try:  # the client dir, then the file (motor/locks.py); a dir that cannot be
            # written stops here (the file opened O_RDWR), before any section runs
            fds = lock_dir_and_file(self.root, self.lock_path, blocking=True, mode=0o644)
        except OSError as exc:
            raise _unusable(self.root, exc) from None
        try:
            try:
                queue = _read(self.queue_path, QueueFile, QueueFile())
            except FileNotFoundError:
                queue = QueueFile()
            locked = Locked(self, queue, self.read_runners(), self.observe)
            result = fn(locked)
            locked.publish()
            return result
        finally:
            release(fds)


def new_token() -> uuid.UUID:
    """A fresh random (v4) token: never max+1, never reused."""
    while True:
        token = uuid.uuid4()
        if token.int:
            return token


def now_ms() -> int:
    return time.time_ns() // 1_000_000
