"""Reader messages (issue 14, stop 27): a `call` of a type in `Actor.readers` is answered by
`read` at once in the caller's task, also while the actor is busy inside `handle` (a probe
that must not wait behind a slow message). Staged with explicit barriers."""

from __future__ import annotations

from contextlib import asynccontextmanager
from dataclasses import dataclass

import pytest
import trio
import trio.testing

import actors


@dataclass(frozen=True)
class Peek:
    broken: bool = False


@dataclass(frozen=True)
class Add:
    n: int
    go: trio.Event | None = None


class Counter(actors.Actor):
    """`Add` adds n, then (given an event) waits for it and adds n again."""

    readers = (Peek,)

    def __init__(self):
        super().__init__(name="counter")
        self.total = 0
        self.reads: list[str] = []  # the task each read ran in

    async def handle(self, msg):
        self.total += msg.n
        if msg.go is not None:
            await msg.go.wait()
            self.total += msg.n
        return self.total

    def read(self, msg):
        self.reads.append(trio.lowlevel.current_task().name)
        if msg.broken:
            raise LookupError("nothing to read")
        return self.total


@asynccontextmanager
async def running(actor):
    async with trio.open_nursery() as nursery:
        yield await nursery.start(actor.run), nursery
        nursery.cancel_scope.cancel()


async def test_a_reader_is_answered_while_the_actor_waits_inside_handle():
    counter = Counter()
    async with running(counter) as (ref, nursery):
        go = trio.Event()
        got = {}

        async def call(key, msg):
            got[key] = await ref.call(msg)

        nursery.start_soon(call, "slow", Add(1, go))
        await trio.testing.wait_all_tasks_blocked()  # inside `handle`, waiting for go
        nursery.start_soon(call, "queued", Add(10))  # waits in the inbox behind it
        await trio.testing.wait_all_tasks_blocked()
        assert await ref.call(Peek()) == 1  # the state as it is: not behind either message
        assert counter.reads == [trio.lowlevel.current_task().name]
        assert got == {}
        go.set()
        await trio.testing.wait_all_tasks_blocked()
        assert got == {"slow": 2, "queued": 12}
        assert await ref.call(Peek()) == 12
        assert ref.statistics().messages_handled == 2  # reads are not messages it handled


async def test_what_read_raises_goes_to_the_caller_and_the_actor_goes_on():
    counter = Counter()
    async with running(counter) as (ref, nursery):
        with pytest.raises(LookupError):
            await ref.call(Peek(broken=True))
        assert await ref.call(Add(5)) == 5
        assert ref.alive and ref.restarts == 0


async def test_a_reader_of_a_stopped_actor_is_actor_dead():
    counter = Counter()
    async with running(counter) as (ref, nursery):
        counter.stop()
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(actors.ActorDead):
            await ref.call(Peek())


@dataclass(frozen=True)
class PeekWhenReady:
    pass


class Warming(Counter):
    """A reader that answers LATER until `on_start` has filled the state."""

    readers = (Peek, PeekWhenReady)

    def __init__(self, ready: trio.Event):
        super().__init__()
        self.ready = ready
        self.filled = False

    async def on_start(self):
        await self.ready.wait()
        self.total, self.filled = 100, True

    async def handle(self, msg):
        if isinstance(msg, PeekWhenReady):
            return ("handled", self.total)
        return await super().handle(msg)

    def read(self, msg):
        if isinstance(msg, PeekWhenReady) and not self.filled:
            return actors.LATER
        return ("read", self.total)


async def test_a_reader_that_answers_later_goes_the_ordinary_way():
    ready = trio.Event()
    warming = Warming(ready)
    warming._open(attach=True)  # as Supervisor.start_child_soon: reached before on_start ends
    async with trio.open_nursery() as nursery:
        nursery.start_soon(warming.run)
        await trio.testing.wait_all_tasks_blocked()  # in on_start, waiting for ready
        ref = warming.ref
        got = []

        async def peek():
            got.append(await ref.call(PeekWhenReady()))

        nursery.start_soon(peek)
        await trio.testing.wait_all_tasks_blocked()
        assert got == []  # LATER: queued for `handle`, which runs after on_start
        assert await ref.call(Peek()) == ("read", 0)  # another reader: at once, as it is
        ready.set()
        await trio.testing.wait_all_tasks_blocked()
        assert got == [("handled", 100)]
        assert await ref.call(PeekWhenReady()) == ("read", 100)  # whole now: read at once
        nursery.cancel_scope.cancel()
