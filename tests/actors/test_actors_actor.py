"""Standalone actors and ActorRef semantics."""

import math

import pytest
import trio
import trio.testing

import actors
from actors_helpers import Boom, Echo


async def test_call_returns_reply():
    async with trio.open_nursery() as nursery:
        ref = await nursery.start(Echo(name="echo").run)
        assert isinstance(ref, actors.ActorRef)
        assert ref.name == "echo" and ref.alive
        assert await ref.call("hello") == "hello"
        assert await ref.call({"x": 1}, timeout=None) == {"x": 1}
        assert await ref.call("stop") == "stopping"
    assert not ref.alive


async def test_exception_in_handle_reaches_caller_as_same_object():
    actor = Echo(name="e")
    with pytest.RaisesGroup(Boom):
        async with trio.open_nursery() as nursery:
            ref = await nursery.start(actor.run)
            with pytest.raises(Boom) as info:
                await ref.call("crash")
            assert info.value is actor.raised[0]
            await trio.sleep_forever()  # the actor crash cancels us
    assert not ref.alive


async def test_call_to_never_started_actor_is_dead():
    ref = Echo(name="idle").ref
    assert not ref.alive
    with pytest.raises(actors.ActorDead) as info:
        await ref.call("x")
    assert info.value.name == "idle"
    with pytest.raises(actors.ActorDead):
        await ref.cast("x")
    with pytest.raises(actors.ActorDead):
        ref.cast_nowait("x")


async def test_call_to_stopped_actor_raises_fast(autojump_clock):
    log = []
    async with trio.open_nursery() as nursery:
        ref = await nursery.start(Echo(name="s", log=log).run)
        await ref.call("stop")
    assert log == [("start", "s"), ("stop", "s")]
    t0 = trio.current_time()
    with pytest.raises(actors.ActorDead):
        await ref.call("x", timeout=None)
    assert trio.current_time() == t0


async def test_stop_fails_queued_calls_with_actor_dead():
    gate = trio.Event()
    results = {}
    async with trio.open_nursery() as nursery:
        actor = Echo(name="q")
        ref = await nursery.start(actor.run)

        async def caller(key, msg):
            try:
                results[key] = await ref.call(msg)
            except actors.ActorDead as exc:
                results[key] = exc

        nursery.start_soon(caller, "first", ("wait", gate))
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(caller, "stopper", "stop")
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(caller, "queued", "late")
        await trio.testing.wait_all_tasks_blocked()
        gate.set()
    assert results["first"] == "waited"
    assert results["stopper"] == "stopping"
    assert isinstance(results["queued"], actors.ActorDead)


async def test_crash_gives_failing_caller_the_exception_and_queued_callers_actor_dead():
    gate = trio.Event()
    results = {}
    actor = Echo(name="c")

    async def caller(ref, key, msg):
        try:
            results[key] = await ref.call(msg)
        except Exception as exc:
            results[key] = exc

    with pytest.RaisesGroup(Boom):
        async with trio.open_nursery() as nursery:
            ref = await nursery.start(actor.run)
            nursery.start_soon(caller, ref, "first", ("wait", gate))
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(caller, ref, "crasher", "crash")
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(caller, ref, "queued", "late")
            await trio.testing.wait_all_tasks_blocked()
            gate.set()
    assert results["first"] == "waited"
    assert results["crasher"] is actor.raised[0]
    assert isinstance(results["queued"], actors.ActorDead)


class Watcher(actors.Actor):
    """Owns a background task in self.nursery that crashes on demand."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.trigger = trio.Event()

    async def on_start(self):
        self.nursery.start_soon(self._watch)

    async def _watch(self):
        await self.trigger.wait()
        raise Boom("watcher")

    async def handle(self, msg):
        if msg == "hang":
            await trio.sleep_forever()
        if msg == "self-cast":
            await self.ref.cast("from-self")
            return "ok"
        return msg


async def test_pending_call_gets_actor_dead_when_background_task_crashes():
    actor = Watcher(name="w")
    outcome = []

    async def caller(ref):
        try:
            await ref.call("hang", timeout=None)
        except actors.ActorDead as exc:
            outcome.append(exc)

    with pytest.RaisesGroup(pytest.RaisesExc(Boom, match="watcher")):
        async with trio.open_nursery() as nursery:
            ref = await nursery.start(actor.run)
            # shield the caller from the nursery's crash-cancel to see what it gets
            async def shielded():
                with trio.CancelScope(shield=True):
                    await caller(ref)
            nursery.start_soon(shielded)
            await trio.testing.wait_all_tasks_blocked()
            actor.trigger.set()
    assert len(outcome) == 1 and outcome[0].name == "w"


async def test_call_timeout_at_exact_virtual_time(autojump_clock):
    async with trio.open_nursery() as nursery:
        actor = Echo(name="slow")
        ref = await nursery.start(actor.run)
        t0 = trio.current_time()
        with pytest.raises(actors.CallTimeout) as info:
            await ref.call(("sleep", 100), timeout=2.5)
        assert isinstance(info.value, trio.TooSlowError)
        assert trio.current_time() - t0 == 2.5
        actor.stop()


def _waiting_deadlines() -> int:
    """Calls whose deadline the run's timeout keeper still holds (actors._actor)."""
    from actors import _actor
    try:
        keeper = _actor._TIMEOUTS.get()
    except LookupError:
        return 0
    return sum(len(bucket) for bucket in keeper.buckets.values())


async def test_calls_with_different_timeouts_each_time_out_at_their_own_deadline(autojump_clock):
    """A call's timeout is kept without a cancel scope per call (issue 14): one keeper per
    run holds the deadlines; a shorter timeout asked after a longer one still fires first."""
    gate = trio.Event()
    ended = {}
    async with trio.open_nursery() as nursery:
        ref = await nursery.start(Echo(name="busy").run)
        ref.cast_nowait(("wait", gate))  # the actor is busy: the calls below wait in its inbox
        t0 = trio.current_time()

        async def caller(label, timeout):
            with pytest.raises(actors.CallTimeout) as info:
                await ref.call(label, timeout=timeout)
            assert info.value.name == "busy" and info.value.timeout == timeout
            ended[label] = trio.current_time() - t0

        nursery.start_soon(caller, "long", 10.0)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(caller, "short", 2.0)
        await trio.sleep(11)
        assert ended == {"short": 2.0, "long": 10.0}
        assert _waiting_deadlines() == 0
        gate.set()  # the queued calls' answers find no caller: dropped
        assert await ref.call("after", timeout=1.0) == "after"
        assert _waiting_deadlines() == 0
        assert await ref.call("stop") == "stopping"


async def test_calls_answered_in_time_or_cancelled_leave_no_deadline_behind(autojump_clock):
    gate = trio.Event()
    async with trio.open_nursery() as nursery:
        ref = await nursery.start(Echo(name="e").run)
        for i in range(100):
            assert await ref.call(i, timeout=5.0) == i
        assert _waiting_deadlines() == 0
        # and trio holds no deadline for them (autojump would stop at it)
        assert trio.lowlevel.current_statistics().seconds_to_next_deadline == math.inf
        with trio.move_on_after(1.0) as scope:  # the caller is cancelled while it waits
            await ref.call(("wait", gate), timeout=30.0)
        assert scope.cancelled_caught and _waiting_deadlines() == 0
        gate.set()  # its late answer is dropped
        await trio.sleep(60)  # no timeout fires for the cancelled call
        assert await ref.call("still", timeout=1.0) == "still"
        with pytest.raises(actors.CallTimeout):  # and timeouts still fire after all that
            await ref.call(("sleep", 5), timeout=0.5)
        assert _waiting_deadlines() == 0
        assert await ref.call("stop") == "stopping"


async def test_a_call_waiting_for_inbox_room_times_out_at_its_timeout(autojump_clock):
    """The timeout counts from the call, also while it waits for room in a full inbox."""
    gate = trio.Event()
    async with trio.open_nursery() as nursery:
        ref = await nursery.start(Echo(name="full", inbox_size=1).run)
        ref.cast_nowait(("wait", gate))  # taken into handle: the actor is busy
        await trio.testing.wait_all_tasks_blocked()
        ref.cast_nowait("fills the inbox")
        t0 = trio.current_time()
        with pytest.raises(actors.CallTimeout) as info:
            await ref.call("no room", timeout=2.0)
        assert trio.current_time() - t0 == 2.0 and info.value.timeout == 2.0
        gate.set()
        assert await ref.call("room again", timeout=2.0) == "room again"
        assert _waiting_deadlines() == 0
        assert await ref.call("stop") == "stopping"


async def test_bounded_inbox_cast_nowait_raises_inbox_full():
    gate = trio.Event()
    async with trio.open_nursery() as nursery:
        actor = Echo(name="small", inbox_size=2)
        ref = await nursery.start(actor.run)
        ref.cast_nowait(("wait", gate))  # taken straight into handle
        await trio.testing.wait_all_tasks_blocked()
        ref.cast_nowait(1)
        ref.cast_nowait(2)
        with pytest.raises(actors.InboxFull):
            ref.cast_nowait(3)
        stats = ref.statistics()
        assert stats.inbox_used == 2 and stats.inbox_size == 2

        # cast waits for room (backpressure)
        sent = trio.Event()

        async def blocked_cast():
            await ref.cast(4)
            sent.set()

        nursery.start_soon(blocked_cast)
        await trio.testing.wait_all_tasks_blocked()
        assert not sent.is_set()
        gate.set()
        await sent.wait()
        assert await ref.call("done") == "done"
        actor.stop()


async def test_inbox_size_class_attribute_and_override():
    class Big(Echo):
        inbox_size = 100

    assert Big().inbox_size == 100
    assert Big(inbox_size=3).inbox_size == 3
    assert Echo().inbox_size == 16
    with pytest.raises(ValueError):
        Echo(inbox_size=-1)


async def test_self_ref_and_statistics():
    async with trio.open_nursery() as nursery:
        actor = Watcher(name="me")
        ref = await nursery.start(actor.run)
        assert actor.ref is ref
        assert await ref.call("self-cast") == "ok"
        assert await ref.call("x") == "x"
        stats = ref.statistics()
        assert stats == actors.ActorStatistics(
            name="me", inbox_used=0, inbox_size=16, messages_handled=3, restarts=0, alive=True
        )
        with pytest.raises(Exception):
            stats.name = "other"  # frozen
        actor.stop()


async def test_actor_instance_runs_once():
    actor = Echo()
    async with trio.open_nursery() as nursery:
        await nursery.start(actor.run)
        actor.stop()
    with pytest.raises(RuntimeError):
        await actor.run()


class FailingStart(actors.Actor):
    async def on_start(self):
        raise Boom("start")

    async def handle(self, msg):
        return msg


async def test_on_start_failure_is_raised_from_start():
    actor = FailingStart(name="fs")
    async with trio.open_nursery() as nursery:
        with pytest.raises(Boom, match="start"):
            await nursery.start(actor.run)
    assert not actor.ref.alive


async def test_ref_not_alive_during_on_start_and_stop_from_on_start():
    seen = []

    class Quits(actors.Actor):
        async def on_start(self):
            seen.append(self.ref.alive)
            self.stop()

        async def handle(self, msg):
            return msg

        async def on_stop(self):
            seen.append("on_stop")

    async with trio.open_nursery() as nursery:
        ref = await nursery.start(Quits().run)
    assert seen == [False, "on_stop"]
    assert not ref.alive


class _Refused(Exception):
    pass


class _Answering(actors.Actor):
    """Raises `_Refused` as an answer (a replied error) and `Boom` as a crash."""

    replied_errors = (_Refused,)

    def __init__(self):
        super().__init__(name="answering")
        self.handled = 0

    async def handle(self, msg):
        self.handled += 1
        if msg == "refuse":
            raise _Refused("no room")
        if msg == "crash":
            raise Boom("crash")
        return msg


async def test_replied_error_reaches_the_caller_and_the_actor_keeps_serving():
    actor = _Answering()
    async with trio.open_nursery() as nursery:
        ref = await nursery.start(actor.run)
        with pytest.raises(_Refused):
            await ref.call("refuse")
        await ref.cast("refuse")  # nobody to answer: logged, not a crash
        assert ref.alive
        assert await ref.call("still here") == "still here"
        assert actor.handled == 3 and ref.restarts == 0
        actor.stop()
    assert not ref.alive


async def test_an_error_not_listed_as_replied_still_crashes_the_actor():
    actor = _Answering()
    with pytest.RaisesGroup(Boom):
        async with trio.open_nursery() as nursery:
            ref = await nursery.start(actor.run)
            with pytest.raises(Boom):
                await ref.call("crash")
            await trio.sleep_forever()  # the actor crash cancels us
    assert not ref.alive


async def test_cast_self_during_on_start_is_handled_after_it_without_polling():
    seen = []

    class Timer(actors.Actor):
        async def on_start(self):
            self.nursery.start_soon(self._fire)
            await trio.testing.wait_all_tasks_blocked()  # _fire has queued its message
            seen.append(("on_start done", self.ref.alive))

        async def _fire(self):
            await self.cast_self("tick")

        async def handle(self, msg):
            seen.append(msg)

    async with trio.open_nursery() as nursery:
        actor = Timer(name="timer")
        await nursery.start(actor.run)
        await trio.testing.wait_all_tasks_blocked()
        assert seen == [("on_start done", False), "tick"]
        actor.stop()


async def test_cast_self_while_stopping_is_dropped_not_a_crash():
    """A timer of the actor's fires while its on_stop runs (its inbox closed): the follow-up
    is dropped, and the actor stops normally. Before: ActorDead crashed the actor."""
    seen = []
    fire = trio.Event()

    class Timer(actors.Actor):
        async def on_start(self):
            self.nursery.start_soon(self._fire)

        async def _fire(self):
            await fire.wait()
            await self.cast_self("tick")
            seen.append("cast")

        async def handle(self, msg):
            seen.append(msg)

        async def on_stop(self):
            fire.set()
            await trio.testing.wait_all_tasks_blocked()  # _fire has cast
            seen.append("stopped")

    async with trio.open_nursery() as nursery:
        actor = Timer(name="timer")
        ref = await nursery.start(actor.run)
        actor.stop()
    assert seen == ["cast", "stopped"] and not ref.alive


class _Gatekeeper(actors.Actor):
    """Defers every ("ask", key) call; ("answer", key, value) answers it from another
    message; ("fail", key) answers it with an error; anything else is answered at once."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.owed: dict = {}

    async def handle(self, msg):
        if msg[0] == "ask":
            self.owed[msg[1]] = self.defer_reply()
            return "dropped: the reply is deferred"
        if msg[0] == "answer":
            self.owed.pop(msg[1]).reply(msg[2])
            return "answered"
        if msg[0] == "fail":
            self.owed.pop(msg[1]).fail(Boom(msg[1]))
            return "failed"
        if msg[0] == "defer-on-cast":
            self.defer_reply()
        return msg


async def test_a_deferred_reply_is_answered_later_while_the_actor_serves_others(autojump_clock):
    got = {}

    async def ask(ref, key):
        got[key] = await ref.call(("ask", key), timeout=None)

    async with trio.open_nursery() as nursery:
        actor = _Gatekeeper(name="gate")
        ref = await nursery.start(actor.run)
        nursery.start_soon(ask, ref, "a")
        nursery.start_soon(ask, ref, "b")
        await trio.testing.wait_all_tasks_blocked()
        assert got == {} and set(actor.owed) == {"a", "b"}
        assert await ref.call(("status",)) == ("status",)  # not blocked by the owed answers
        assert await ref.call(("answer", "b", 2)) == "answered"
        await trio.testing.wait_all_tasks_blocked()
        assert got == {"b": 2}  # answered out of order; the return value of handle is dropped
        await ref.call(("answer", "a", 1))
        await trio.testing.wait_all_tasks_blocked()
        assert got == {"a": 1, "b": 2}
        assert ref.statistics().messages_handled == 5
        actor.stop()


async def test_a_deferred_reply_can_fail_and_answers_once():
    async with trio.open_nursery() as nursery:
        actor = _Gatekeeper(name="gate")
        ref = await nursery.start(actor.run)
        result = []

        async def ask():
            try:
                await ref.call(("ask", "x"))
            except Boom as exc:
                result.append(exc.args)

        nursery.start_soon(ask)
        await trio.testing.wait_all_tasks_blocked()
        token = actor.owed["x"]
        await ref.call(("fail", "x"))
        token.reply("too late")  # a second answer is ignored
        await trio.testing.wait_all_tasks_blocked()
        assert result == [("x",)] and token.answered
        actor.stop()


async def test_an_owed_reply_becomes_actor_dead_when_the_actor_stops_or_crashes():
    async with trio.open_nursery() as nursery:
        actor = _Gatekeeper(name="gate")
        ref = await nursery.start(actor.run)
        outcomes = []

        async def ask():
            try:
                await ref.call(("ask", "x"))
            except actors.ActorDead:
                outcomes.append("dead")

        nursery.start_soon(ask)
        await trio.testing.wait_all_tasks_blocked()
        actor.stop()
        await trio.testing.wait_all_tasks_blocked()
        assert outcomes == ["dead"]
        actor.owed["x"].reply("after death")  # harmless


async def test_defer_reply_outside_a_call_is_an_error():
    actor = _Gatekeeper(name="gate")
    with pytest.raises(RuntimeError, match="outside handle"):
        actor.defer_reply()
    with pytest.raises(BaseExceptionGroup) as info:  # nobody waits for a cast's answer
        async with trio.open_nursery() as nursery:
            ref = await nursery.start(actor.run)
            await ref.cast(("defer-on-cast",))
    assert "of a call" in str(info.value.exceptions[0]) and not ref.alive


class _Grouper(actors.Actor):
    """Handles ("add", n) messages in groups: the first waits for `go`, then takes the
    ("add", ...) messages waiting behind it and answers each with the group's members."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.go = trio.Event()
        self.groups: list = []

    async def handle(self, msg):
        if msg[0] != "add":
            self.groups.append([msg])
            return "alone"
        await self.go.wait()
        taken = self.take_waiting(lambda m: m[0] == "add", limit=3)
        group = [msg[1], *(m[1] for m, _ in taken)]
        self.groups.append(group)
        for other, token in taken:
            if token is not None:
                token.reply((other[1], group))
        return (msg[1], group)


async def test_take_waiting_groups_waiting_messages_and_stops_at_the_first_it_does_not_accept(
        autojump_clock):
    got = {}

    async def add(ref, n):
        got[n] = await ref.call(("add", n))

    async with trio.open_nursery() as nursery:
        actor = _Grouper(name="grouper")
        ref = await nursery.start(actor.run)
        nursery.start_soon(add, ref, 1)
        await trio.testing.wait_all_tasks_blocked()  # 1 is being handled (waits for go)
        for n in (2, 3):
            nursery.start_soon(add, ref, n)
            await trio.testing.wait_all_tasks_blocked()
        await ref.cast(("add", 4))  # a cast: taken too, nobody to answer
        nursery.start_soon(ref.call, ("other",))
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(add, ref, 5)  # behind "other": not taken
        await trio.testing.wait_all_tasks_blocked()
        actor.go.set()
        await trio.testing.wait_all_tasks_blocked()
        assert actor.groups == [[1, 2, 3, 4], [("other",)], [5]]
        assert got == {1: (1, [1, 2, 3, 4]), 2: (2, [1, 2, 3, 4]), 3: (3, [1, 2, 3, 4]),
                       5: (5, [5])}
        assert ref.statistics().messages_handled == 6
        actor.stop()


async def test_take_waiting_respects_its_limit_and_a_crash_answers_the_taken_actor_dead(
        autojump_clock):
    outcomes = {}

    class Crasher(_Grouper):
        async def handle(self, msg):
            await self.go.wait()
            taken = self.take_waiting(lambda m: True, limit=1)
            self.groups.append([msg, *(m for m, _ in taken)])
            raise RuntimeError("crash with taken messages unanswered")

    async def add(ref, n):
        try:
            outcomes[n] = await ref.call(("add", n))
        except BaseException as exc:  # noqa: BLE001 (what the caller sees)
            outcomes[n] = type(exc).__name__

    crashed = []

    async def run(actor, task_status=trio.TASK_STATUS_IGNORED):
        try:
            await actor.run(task_status=task_status)
        except RuntimeError as exc:
            crashed.append(str(exc))

    async with trio.open_nursery() as nursery:
        actor = Crasher(name="crasher")
        ref = await nursery.start(run, actor)
        for n in (1, 2, 3):
            nursery.start_soon(add, ref, n)
            await trio.testing.wait_all_tasks_blocked()
        actor.go.set()
    assert crashed == ["crash with taken messages unanswered"]
    assert actor.groups == [[("add", 1), ("add", 2)]]  # the limit: one taken
    assert outcomes == {1: "RuntimeError", 2: "ActorDead", 3: "ActorDead"}
