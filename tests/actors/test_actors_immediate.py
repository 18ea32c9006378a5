"""Immediate messages (issue 14): a `call` or `cast` of a type in `Actor.immediate` that finds
the actor idle runs `handle_now` at once in the sender's task; otherwise it is queued and
the actor's own task handles it in turn. Each case staged with explicit barriers."""

from __future__ import annotations

from contextlib import asynccontextmanager
from dataclasses import dataclass

import pytest
import trio
import trio.testing

import actors


@dataclass(frozen=True)
class Now:
    value: object = None


@dataclass(frozen=True)
class Fail:
    replied: bool


@dataclass(frozen=True)
class Defer:
    pass


@dataclass(frozen=True)
class Poke:  # cast to itself from inside handle_now
    pass


class Refused(Exception):
    pass


class Crash(Exception):
    pass


class Clerk(actors.Actor):
    """`Now` answers at once (or LATER while `later` holds); ("wait", ev) waits in `handle`."""

    immediate = (Now, Fail, Defer, Poke)
    replied_errors = (Refused,)

    def __init__(self, **kw):
        super().__init__(**kw)
        self.log: list[tuple[str, object, str]] = []  # (how, message value, task name)
        self.later = False
        self.deferred: actors.DeferredReply | None = None
        self.own_task: str | None = None

    async def on_start(self):
        self.own_task = trio.lowlevel.current_task().name

    def handle_now(self, msg):
        task = trio.lowlevel.current_task().name
        if isinstance(msg, Fail):
            raise Refused("no") if msg.replied else Crash("broken")
        if isinstance(msg, Defer):
            self.deferred = self.defer_reply()
            return None
        if isinstance(msg, Poke):
            self.ref.cast_nowait(Now("from-inside"))  # queued: the actor is busy, not idle
            self.log.append(("now", "poke", task))
            return "poked"
        if self.later:
            return actors.LATER
        self.log.append(("now", msg.value, task))
        return ("now", msg.value)

    async def handle(self, msg):
        task = trio.lowlevel.current_task().name
        if isinstance(msg, Now):  # handle_now said LATER
            self.log.append(("later", msg.value, task))
            return ("later", msg.value)
        await msg[1].wait()
        self.log.append(("handle", msg[0], task))
        return msg[0]


@asynccontextmanager
async def running(clerk: "Clerk"):
    """`clerk` running standalone in a nursery: its ref, and the nursery (cancelled after)."""
    async with trio.open_nursery() as nursery:
        yield await nursery.start(clerk.run), nursery
        nursery.cancel_scope.cancel()


async def test_an_idle_actor_answers_an_immediate_call_in_the_callers_task():
    clerk = Clerk(name="clerk")
    async with running(clerk) as (ref, nursery):
        me = trio.lowlevel.current_task().name
        assert await ref.call(Now(1)) == ("now", 1)
        ref.cast_nowait(Now(2))  # handled before cast_nowait returns
        await ref.cast(Now(3))
        assert clerk.log == [("now", 1, me), ("now", 2, me), ("now", 3, me)]
        assert ref.statistics().messages_handled == 3


async def test_a_busy_actor_queues_an_immediate_message_behind_the_one_it_handles():
    clerk = Clerk(name="clerk")
    async with running(clerk) as (ref, nursery):
        go = trio.Event()
        got = {}

        async def call(key, msg):
            got[key] = await ref.call(msg)

        nursery.start_soon(call, "slow", ("slow", go))
        await trio.testing.wait_all_tasks_blocked()  # the actor waits inside `handle`
        nursery.start_soon(call, "now", Now("queued"))
        await trio.testing.wait_all_tasks_blocked()
        assert got == {} and clerk.log == []  # not run in the caller's task meanwhile
        go.set()
        await trio.testing.wait_all_tasks_blocked()
        assert got == {"slow": "slow", "now": ("now", "queued")}
        assert clerk.log == [("handle", "slow", clerk.own_task),
                             ("now", "queued", clerk.own_task)]


async def test_an_immediate_call_never_overtakes_a_message_already_queued():
    clerk = Clerk(name="clerk")
    async with running(clerk) as (ref, nursery):
        go = trio.Event()
        go.set()
        ref.cast_nowait(("first", go))  # queued, the actor has not run yet
        assert await ref.call(Now("second")) == ("now", "second")
        assert [entry[:2] for entry in clerk.log] == [("handle", "first"), ("now", "second")]
        assert {entry[2] for entry in clerk.log} == {clerk.own_task}


async def test_later_sends_an_immediate_message_through_the_inbox_to_handle():
    clerk = Clerk(name="clerk")
    clerk.later = True
    async with running(clerk) as (ref, nursery):
        assert await ref.call(Now("x")) == ("later", "x")
        ref.cast_nowait(Now("y"))
        await trio.testing.wait_all_tasks_blocked()
        assert clerk.log == [("later", "x", clerk.own_task), ("later", "y", clerk.own_task)]


async def test_a_replied_error_at_once_reaches_the_caller_and_the_actor_goes_on():
    clerk = Clerk(name="clerk")
    async with running(clerk) as (ref, nursery):
        with pytest.raises(Refused):
            await ref.call(Fail(replied=True))
        ref.cast_nowait(Fail(replied=True))  # logged, not raised to the caster
        assert await ref.call(Now("after")) == ("now", "after") and ref.alive


async def test_a_crash_at_once_reaches_the_caller_and_crashes_the_actor_in_its_own_task():
    clerk = Clerk(name="clerk")
    with pytest.RaisesGroup(Crash):
        async with trio.open_nursery() as nursery:
            ref = await nursery.start(clerk.run)
            with pytest.raises(Crash) as info:
                await ref.call(Fail(replied=False))
            raised = info.value
            with pytest.raises(actors.ActorDead):  # queued behind the crash: never handled
                await ref.call(Now("too late"))
            await trio.sleep_forever()  # the actor's crash cancels us
    assert not ref.alive and clerk.log == []
    assert raised.args == ("broken",)


async def test_a_crash_at_once_under_a_supervisor_restarts_the_actor(autojump_clock):
    made: list[Clerk] = []

    def factory():
        made.append(Clerk(name="clerk"))
        return made[-1]

    async with actors.open_supervisor("sup", [actors.ChildSpec("clerk", factory)]) as sup:
        ref = sup.ref("clerk")
        ref.cast_nowait(Fail(replied=False))  # the caster goes on; the actor crashes
        while len(made) < 2 or not ref.alive:
            await trio.sleep(0.01)
        assert ref.restarts == 1
        assert await ref.call(Now("again")) == ("now", "again")
        assert made[1].log[0][2] != made[0].own_task


async def test_a_deferred_answer_at_once_is_waited_for():
    clerk = Clerk(name="clerk")
    async with running(clerk) as (ref, nursery):
        got = []

        async def call():
            got.append(await ref.call(Defer()))

        nursery.start_soon(call)
        await trio.testing.wait_all_tasks_blocked()
        assert got == [] and clerk.deferred is not None
        clerk.deferred.reply("later answer")
        await trio.testing.wait_all_tasks_blocked()
        assert got == ["later answer"]


async def test_a_cast_to_itself_from_handle_now_is_queued_not_nested():
    clerk = Clerk(name="clerk")
    async with running(clerk) as (ref, nursery):
        me = trio.lowlevel.current_task().name
        assert await ref.call(Poke()) == "poked"
        await trio.testing.wait_all_tasks_blocked()
        assert clerk.log == [("now", "poke", me), ("now", "from-inside", clerk.own_task)]


async def test_a_cancelled_caller_runs_nothing_at_once():
    clerk = Clerk(name="clerk")
    async with running(clerk) as (ref, nursery):
        with trio.CancelScope() as scope:
            scope.cancel()
            await ref.call(Now("never"))
        assert scope.cancelled_caught and clerk.log == []


async def test_try_now_answers_at_once_or_says_later():
    clerk = Clerk(name="clerk")
    assert clerk.ref.try_now(Now("before start")) is actors.LATER  # not running
    async with running(clerk) as (ref, nursery):
        me = trio.lowlevel.current_task().name
        assert ref.try_now(Now(1)) == ("now", 1)
        assert ref.try_now(("not immediate", None)) is actors.LATER
        go = trio.Event()
        ref.cast_nowait(("slow", go))  # queued: not idle
        assert ref.try_now(Now(2)) is actors.LATER
        await trio.testing.wait_all_tasks_blocked()  # the actor waits inside `handle`
        assert ref.try_now(Now(3)) is actors.LATER
        go.set()
        await trio.testing.wait_all_tasks_blocked()
        clerk.later = True
        assert ref.try_now(Now(4)) is actors.LATER  # handle_now said LATER: nothing queued
        with pytest.raises(RuntimeError):
            ref.try_now(Defer())
        with pytest.raises(Refused):
            ref.try_now(Fail(replied=True))
        assert clerk.log == [("now", 1, me), ("handle", "slow", clerk.own_task)]


@dataclass(frozen=True)
class Split:  # handle_now does the first half and leaves the rest for the actor's task
    value: object = None


@dataclass(frozen=True)
class Rest:
    value: object
    token: object


class Splitter(actors.Actor):
    immediate = (Split,)

    def __init__(self):
        super().__init__()
        self.log: list[tuple[str, object]] = []
        self.gate = trio.Event()

    def handle_now(self, msg):
        self.log.append(("first half", msg.value))
        token = self.defer_reply() if self.answering else None
        self.handle_next(Rest(msg.value, token))
        return None

    async def handle(self, msg):
        if isinstance(msg, Rest):
            await self.gate.wait()
            self.log.append(("rest", msg.value))
            if msg.token is not None:
                msg.token.reply(("done", msg.value))
            return None
        self.log.append(("other", msg))
        return msg


async def test_handle_next_finishes_a_message_before_anything_queued_behind_it():
    """`handle_next` (issue 14: the dispatcher's end of a job): what `handle_now` cannot
    finish at once is the actor's very next message, in its own task, ahead of the
    messages already queued or sent meanwhile; the call is answered when it is done. From
    a sender's task (the actor idle) it wakes the actor; from the actor's own task (the
    message came through the inbox) it goes ahead of the inbox."""
    async with trio.open_nursery() as nursery:
        splitter = Splitter()
        ref = await nursery.start(splitter.run)
        got = []

        async def call(msg):
            got.append(await ref.call(msg))

        nursery.start_soon(call, Split(1))  # idle: the first half in that task
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(call, "after 1")
        await trio.testing.wait_all_tasks_blocked()
        assert splitter.log == [("first half", 1)] and got == []
        splitter.gate.set()
        await trio.testing.wait_all_tasks_blocked()
        assert splitter.log == [("first half", 1), ("rest", 1), ("other", "after 1")]
        assert len(got) == 2 and ("done", 1) in got and "after 1" in got  # (woken in any order)
        assert ref.statistics().messages_handled == 2  # the rest is not another message

        splitter.log.clear()
        got.clear()
        ref.cast_nowait("busy")  # queued: the actor is not idle for what follows
        ref.cast_nowait(Split(2))  # through the inbox: handle_now in the actor's task
        ref.cast_nowait("after 2")
        await trio.testing.wait_all_tasks_blocked()
        assert splitter.log == [("other", "busy"), ("first half", 2), ("rest", 2),
                                ("other", "after 2")]
        with pytest.raises(RuntimeError):
            splitter.handle_next("outside a handler")
        nursery.cancel_scope.cancel()
