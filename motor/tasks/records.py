"""The task client's durable records (seed 000: runner slot reservation).

Everything here is plain msgspec data plus the canonical JSON codec and the atomic write.
Canonical JSON omits defaults, so `QueueEntry.slot_reservation` is absent when None and
`RunnerSlotReservation.child` is absent until bound; files written before either field
existed still load (missing -> default).

    C/queue.json                 QueueFile: the queue rows (QueueEntry), FIFO by queue_id
    C/tasks/<task>.json          TaskRecord (its turns, newest last)
    C/runners/<task>.json        RunnerRecord: task.runner (the process running its turn)
    C/turns/<task>/<turn>/       output.log, events.jsonl, record.json (the worker's terminal record)
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Literal

import msgspec

__all__ = [
    "ProcessIdentity", "RunnerSlotReservation", "QueueEntry", "QueueFile", "RunnerRecord",
    "TurnRecord", "TaskRecord", "encode", "decode", "atomic_write", "RowState", "TurnState",
    "NIL_TOKEN",
]

NIL_TOKEN = uuid.UUID(int=0)

RowState = Literal["waiting", "parked", "dispatching"]
TurnState = Literal["queued", "parked", "dispatching", "running", "succeeded", "failed",
                    "cancelled", "timed_out", "refused", "lost"]
TERMINAL_TURN_STATES = frozenset({"succeeded", "failed", "cancelled", "timed_out", "refused", "lost"})


class ProcessIdentity(msgspec.Struct, frozen=True, kw_only=True):
    """A process: pid plus its start time (psutil create time, microseconds), so a
    recycled pid never passes for the process that was recorded."""

    pid: int
    start_time_micros: int

    def __str__(self) -> str:
        return f"pid {self.pid}@{self.start_time_micros}"


class RunnerSlotReservation(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One outstanding spawn attempt for a queue row (seed 000, "Record").

    `token` is a fresh non-nil UUID per attempt, serialized as a hyphenated string;
    `child` is absent until `bind_runner_slot_child`.  A nil token is rejected both when
    built in code and when decoded from a file."""

    reserver: ProcessIdentity
    token: uuid.UUID
    child: ProcessIdentity | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.token, uuid.UUID) or self.token.int == 0:
            raise ValueError("a runner slot reservation needs a non-nil token")

    @classmethod
    def new(cls, reserver: ProcessIdentity, token: uuid.UUID) -> "RunnerSlotReservation":
        return cls(reserver=reserver, token=token)


class QueueEntry(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One queued turn.  States and owners:

    - `waiting`: `owner` is responsible for it now.  Right after enqueue that is the
      enqueuing process (`owner == enqueue_owner`), which does not occupy a runner slot;
      once a runner adopts the row (`owner != enqueue_owner`) the owner is an acting holder.
    - `parked`: no slot was free (or an earlier turn of its task is still queued); no owner.
      A finishing runner or reconcile starts it later.  Parking clears `slot_reservation`.
    - `dispatching`: `dispatch_owner` runs it on `worker` (as runner job `job_id` once accepted).
    Task, turn and queue ids, pins and run membership never change once enqueued."""

    queue_id: int
    task_id: str
    turn_id: str
    enqueued_at_millis: int
    state: RowState = "waiting"
    owner: ProcessIdentity | None = None
    enqueue_owner: ProcessIdentity | None = None
    dispatch_owner: ProcessIdentity | None = None
    pin: str | None = None
    run: str | None = None
    worker: str | None = None
    job_id: str | None = None
    attached: bool = False
    cancel_requested: bool = False
    slot_reservation: RunnerSlotReservation | None = None

    @property
    def key(self) -> tuple[str, str]:
        return (self.task_id, self.turn_id)


class QueueFile(msgspec.Struct, kw_only=True, omit_defaults=True):
    """`C/queue.json`.  `next_queue_id` only grows; `last_enqueued_at_millis` is the
    coalesced enqueue clock (never goes backwards, even after rows leave)."""

    version: int = 1
    next_queue_id: int = 1
    last_enqueued_at_millis: int = 0
    entries: list[QueueEntry] = []


class RunnerRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    """task.runner: the process that runs (or last ran) the task's current turn."""

    identity: ProcessIdentity
    turn_id: str
    mode: Literal["detached", "attached"] = "detached"


class TurnRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    turn_id: str
    command: list[str]
    state: TurnState = "queued"
    submitted_at_ms: int = 0
    started_at_ms: int | None = None
    ended_at_ms: int | None = None
    worker: str | None = None
    job_id: str | None = None
    exit_code: int | None = None
    signal: int | None = None
    reason: str | None = None
    detail: str | None = None
    donated_from: str | None = None   # seed 001: ran on the runner process donated by this task


class TaskRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    task_id: str
    project: str
    created_at_ms: int
    pin: str | None = None
    run: str | None = None
    capabilities: list[str] = []
    workspace: str = ""
    turns: list[TurnRecord] = []

    @property
    def current(self) -> TurnRecord | None:
        return self.turns[-1] if self.turns else None

    @property
    def state(self) -> str:
        return self.turns[-1].state if self.turns else "queued"


_encoder = msgspec.json.Encoder()


def encode(obj) -> bytes:
    """Canonical JSON (defaults omitted) with a trailing newline."""
    return _encoder.encode(obj) + b"\n"


def decode(data: bytes, type_):
    return msgspec.json.decode(data, type=type_)


def atomic_write(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write `data` to `path` so that readers see the old or the new file, never a part:
    a temporary file beside it, fsync, rename over, fsync of the directory."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    os.close(fd)
    try:
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
