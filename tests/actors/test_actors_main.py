"""`Actor.main` (issue 14): an actor whose incarnation is a piece of work runs it in its
own task instead of serving an inbox; its messages are all immediate, answered in the
sender's task whenever `main` waits. Each case staged with explicit barriers."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import trio
import trio.testing

import actors


@dataclass(frozen=True)
class Ask:
    value: object = None


@dataclass(frozen=True)
class Later:
    pass


@dataclass(frozen=True)
class Fail:
    replied: bool


@dataclass(frozen=True)
class Other:  # not immediate
    pass


class Refused(Exception):
    pass


class Crash(Exception):
    pass


class Worker(actors.Actor):
    """Its main waits for `go`, then returns (or raises `fail`)."""

    immediate = (Ask, Later, Fail)
    replied_errors = (Refused,)

    def __init__(self, **kw):
        super().__init__(**kw)
        self.go, self.fail = trio.Event(), None
        self.log: list[tuple[str, str]] = []  # (what, task name)
        self.main_task: str | None = None

    def _task(self) -> str:
        return trio.lowlevel.current_task().name

    async def on_start(self):
        self.log.append(("on_start", self._task()))

    async def main(self):
        self.main_task = self._task()
        self.log.append(("main", self.main_task))
        try:
            await self.go.wait()
        except trio.Cancelled:
            self.log.append(("main cancelled", self._task()))
            raise
        if self.fail is not None:
            raise self.fail
        self.log.append(("main returns", self._task()))

    def handle_now(self, msg):
        self.log.append((type(msg).__name__, self._task()))
        if isinstance(msg, Later):
            return actors.LATER
        if isinstance(msg, Fail):
            raise Refused("no") if msg.replied else Crash("boom")
        return ("answer", msg.value)

    async def on_stop(self):
        self.log.append(("on_stop", self._task()))


async def test_main_runs_in_the_actors_task_and_its_return_stops_the_actor():
    async with trio.open_nursery() as nursery:
        worker = Worker()
        ref = await nursery.start(worker.run)
        await trio.testing.wait_all_tasks_blocked()
        assert worker.log == [("on_start", worker.main_task), ("main", worker.main_task)]
        me = trio.lowlevel.current_task().name
        assert await ref.call(Ask(1)) == ("answer", 1)  # answered in this task while main waits
        await ref.cast(Ask(2))
        assert worker.log[2:] == [("Ask", me), ("Ask", me)] and ref.alive
        assert ref.statistics().messages_handled == 2
        worker.go.set()
        await trio.testing.wait_all_tasks_blocked()
        assert worker.log[4:] == [("main returns", worker.main_task), ("on_stop", worker.main_task)]
        assert not ref.alive
        with pytest.raises(actors.ActorDead):
            await ref.call(Ask(3))


async def test_a_message_main_cannot_take_at_once_is_refused():
    async with trio.open_nursery() as nursery:
        worker = Worker()
        ref = await nursery.start(worker.run)
        with pytest.raises(TypeError, match="runs main"):
            await ref.call(Other())
        with pytest.raises(TypeError, match="runs main"):
            await ref.call(Later())  # handle_now said LATER: nothing would handle it
        with pytest.raises(TypeError, match="runs main"):
            ref.cast_nowait(Other())
        assert ref.alive and await ref.call(Ask()) == ("answer", None)
        worker.go.set()


async def test_stop_cancels_main_and_the_actor_stops_orderly(autojump_clock):
    async with actors.open_supervisor("sup", [actors.ChildSpec("w", Worker)]) as sup:
        ref = sup.ref("w")
        await trio.testing.wait_all_tasks_blocked()
        worker = ref._actor
        await sup.stop_child("w")
        assert [what for what, _ in worker.log] == ["on_start", "main", "main cancelled", "on_stop"]
        assert not ref.alive and sup.children() == []


async def test_a_replied_error_goes_to_the_caller_and_main_goes_on():
    async with trio.open_nursery() as nursery:
        worker = Worker()
        ref = await nursery.start(worker.run)
        with pytest.raises(Refused):
            await ref.call(Fail(replied=True))
        await trio.testing.wait_all_tasks_blocked()
        assert ref.alive and ("main cancelled", worker.main_task) not in worker.log
        worker.go.set()


async def test_a_crash_in_handle_now_cancels_main_and_crashes_the_actor(autojump_clock):
    async with actors.open_supervisor(
            "sup", [actors.ChildSpec("w", Worker)], intensity=5, period=60) as sup:
        ref = sup.ref("w")
        await trio.testing.wait_all_tasks_blocked()
        first = ref._actor
        with pytest.raises(Crash):  # the caller gets it, as from handle
            await ref.call(Fail(replied=False))
        await trio.testing.wait_all_tasks_blocked()
        assert ("main cancelled", first.main_task) in first.log
        assert ("on_stop", first.main_task) not in first.log  # a crash: no orderly stop
        assert ref.restarts == 1 and ref._actor is not first  # restarted, as any crash
        assert isinstance(sup.last_failure[1], Crash)


async def test_main_raising_crashes_the_actor(autojump_clock):
    async with actors.open_supervisor(
            "sup", [actors.ChildSpec("w", Worker, restart="transient")], intensity=5, period=60) as sup:
        ref = sup.ref("w")
        await trio.testing.wait_all_tasks_blocked()
        first = ref._actor
        first.fail = Crash("main failed")
        first.go.set()
        await trio.testing.wait_all_tasks_blocked()
        assert ref.restarts == 1 and isinstance(sup.last_failure[1], Crash)
        second = ref._actor
        second.go.set()  # a normal return: a transient child is not restarted
        await trio.testing.wait_all_tasks_blocked()
        assert sup.children() == []
