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


# --- Supervisor.start_child_soon ---------------------------------------------------------


class Plain(actors.Actor):
    """An inbox-serving actor: records on_start and each message."""

    def __init__(self, fail_start: bool = False, **kw):
        super().__init__(**kw)
        self.log: list[object] = []
        self.fail_start = fail_start

    async def on_start(self):
        self.log.append("on_start")
        if self.fail_start:
            raise Crash("on_start failed")

    async def handle(self, msg):
        self.log.append(msg)
        return ("handled", msg)


async def test_a_child_started_soon_answers_what_was_sent_before_its_task_ran():
    """The ref is there at once; what is sent before the child's task ran waits in its
    inbox and is answered first once `main` begins (in order, in the child's task), what
    comes later in the sender's task; an inbox-serving child handles it after `on_start`."""
    async with actors.open_supervisor("sup", []) as sup:
        ref = sup.start_child_soon(actors.ChildSpec("w", Worker, restart="transient"))
        assert ref is not None and sup.children() == ["w"]
        worker = ref._actor
        ref.cast_nowait(Ask(1))  # before any schedule point: its task has not run yet
        ref.cast_nowait(Ask(2))
        assert worker.log == []
        with trio.fail_after(5):
            assert await ref.call(Ask(3)) == ("answer", 3)  # waits behind them, in the inbox
        assert [what for what, _ in worker.log] == ["on_start", "Ask", "Ask", "Ask", "main"]
        assert {task for _, task in worker.log} == {worker.main_task}  # all in its task
        assert ref.statistics().messages_handled == 3
        assert await ref.call(Ask(4)) == ("answer", 4)  # main waits: in this task
        assert worker.log[-1] == ("Ask", trio.lowlevel.current_task().name)
        worker.go.set()
        await trio.testing.wait_all_tasks_blocked()
        assert sup.children() == [] and ref.restarts == 0  # it returned: transient, removed

        plain_ref = sup.start_child_soon(actors.ChildSpec("p", Plain))
        assert await plain_ref.call("hello") == ("handled", "hello")
        assert plain_ref._actor.log == ["on_start", "hello"]


async def test_a_busy_supervisor_starts_nothing_soon_and_the_waiting_start_still_works():
    """While the supervisor serves another change (here a start whose `on_start` waits),
    start_child_soon does nothing (None): the caller takes `start_child`'s turn."""
    release = trio.Event()

    class Slow(Plain):
        async def on_start(self):
            await release.wait()

    async with actors.open_supervisor("sup", []) as sup:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sup.start_child, actors.ChildSpec("slow", Slow))
            await trio.testing.wait_all_tasks_blocked()
            assert sup.start_child_soon(actors.ChildSpec("p", Plain)) is None
            assert sup.children() == ["slow"]
            release.set()
        assert sup.start_child_soon(actors.ChildSpec("p", Plain)) is not None
        with pytest.raises(ValueError):
            sup.start_child_soon(actors.ChildSpec("p", Plain))
    with pytest.raises(RuntimeError):
        sup.start_child_soon(actors.ChildSpec("q", Plain))


async def test_a_child_of_the_same_name_starts_once_the_ending_one_is_gone():
    """`wait_ended` (stop 59): a transient child that is ending (its main returns) holds its
    name until the loop handles its exit; a start of the same name made after `wait_ended`
    is served behind that exit, so it is not refused as a duplicate. With no such child,
    or after it, `wait_ended` returns at once."""
    async with actors.open_supervisor("sup", []) as sup:
        await sup.wait_ended("w")  # no such child
        first = sup.start_child_soon(actors.ChildSpec("w", Worker, restart="transient"))
        await trio.testing.wait_all_tasks_blocked()
        ended = trio.Event()

        async def wait_then_start():
            await sup.wait_ended("w")
            ended.set()
            await sup.start_child(actors.ChildSpec("w", Worker, restart="transient"))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait_then_start)
            await trio.testing.wait_all_tasks_blocked()
            assert not ended.is_set()  # its main still waits: the waiter with it
            with pytest.raises(actors.DuplicateChild):
                sup.start_child_soon(actors.ChildSpec("w", Worker, restart="transient"))
            first._actor.go.set()
        second = sup.ref("w")
        assert sup.children() == ["w"] and second._actor is not first._actor
        second._actor.go.set()
        await trio.testing.wait_all_tasks_blocked()
        await sup.wait_ended("w")
        assert sup.children() == []


async def test_what_on_start_raises_in_a_child_started_soon_is_a_crash(autojump_clock):
    """Nobody waits for a child started soon, so a failed start is a crash: the restart
    strategy applies (here a transient child, restarted), the supervisor goes on."""
    made = []

    def factory():
        made.append(Plain(fail_start=not made))  # the first incarnation fails its start
        return made[-1]

    async with actors.open_supervisor("sup", [], intensity=5, period=60) as sup:
        ref = sup.start_child_soon(actors.ChildSpec("p", factory, restart="transient"))
        await trio.testing.wait_all_tasks_blocked()
        assert isinstance(sup.last_failure[1], Crash) and len(made) == 2
        assert ref.restarts == 1 and await ref.call("again") == ("handled", "again")


async def test_a_crash_in_a_message_answered_before_main_crashes_the_actor(autojump_clock):
    async with actors.open_supervisor("sup", [], intensity=5, period=60) as sup:
        ref = sup.start_child_soon(actors.ChildSpec("w", Worker, restart="transient"))
        with pytest.raises(Crash):
            await ref.call(Fail(replied=False))
        await trio.testing.wait_all_tasks_blocked()
        assert isinstance(sup.last_failure[1], Crash) and ref.restarts == 1
        first_log = sup.last_failure  # the new incarnation runs main as usual
        assert await ref.call(Ask(5)) == ("answer", 5) and first_log


async def test_a_crash_is_told_from_the_moment_the_child_ended_until_the_loop_handled_it(
        autojump_clock):
    """A health probe that finds a subsystem not running, in the moment between its crash
    and its supervisor's handling of it (not yet restarted, not yet counted against the
    budget), is told the crash: `crashed_unhandled`. Staged: the supervisor's loop is busy
    starting another child while `w` crashes."""
    release = trio.Event()

    class Slow(Plain):
        async def on_start(self):
            await release.wait()

    async with actors.open_supervisor(
            "sup", [actors.ChildSpec("w", Worker)], intensity=5, period=60) as sup:
        ref = sup.ref("w")
        await trio.testing.wait_all_tasks_blocked()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sup.start_child, actors.ChildSpec("slow", Slow))
            await trio.testing.wait_all_tasks_blocked()  # the loop waits in Slow.on_start
            with pytest.raises(Crash):
                await ref.call(Fail(replied=False))
            await trio.testing.wait_all_tasks_blocked()
            crashed = sup.crashed_unhandled()
            assert list(crashed) == ["w"] and isinstance(crashed["w"], Crash)
            assert sup.restarts_in_window() == 0 and not ref.alive
            release.set()
        await trio.testing.wait_all_tasks_blocked()
        assert sup.crashed_unhandled() == {} and sup.restarts_in_window() == 1 and ref.alive
