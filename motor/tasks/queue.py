"""The queue actor: the one serializing owner of the task client's queue in a process.

Inside a process every queue critical section is one message to the `QueueActor`; the
actor runs it in a worker thread holding the fcntl QueueLock (motor.tasks.store), so across
processes too there is exactly one read-modify-write of the queue at a time.  The bodies
are in motor.tasks.sections.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import msgspec
import trio

import actors
from motor.tasks import core
from motor.tasks.store import ClientDir, ClientDirError, Locked

T = TypeVar("T")


class _Ok:
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


class QueueActor(actors.Actor):
    """One message = one QueueLock critical section: `fn(locked) -> result`."""

    inbox_size = 64

    def __init__(self, cdir: ClientDir, **kw):
        super().__init__(name="task-queue", **kw)
        self.cdir = cdir

    async def handle(self, msg: Callable[[Locked], Any]) -> Any:
        try:
            return _Ok(await trio.to_thread.run_sync(self.cdir.critical, msg))
        except (core.QueueError, ClientDirError, OSError, msgspec.DecodeError, msgspec.ValidationError,
                ValueError) as exc:
            return exc  # the caller raises it; the actor keeps serving


class QueueHandle:
    """Client handle of the queue actor: `await queue.locked(fn)`."""

    def __init__(self, ref: actors.ActorRef):
        self.ref = ref

    async def locked(self, fn: Callable[[Locked], T]) -> T:
        result = await self.ref.call(fn, timeout=None)
        if isinstance(result, _Ok):
            return result.value
        raise result


async def open_queue(nursery: trio.Nursery, cdir: ClientDir) -> QueueHandle:
    await trio.to_thread.run_sync(cdir.ensure)
    return QueueHandle(await nursery.start(QueueActor(cdir).run))


__all__ = ["QueueActor", "QueueHandle", "open_queue"]
