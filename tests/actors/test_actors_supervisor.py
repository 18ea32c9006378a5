"""Supervisors: restart strategies, intensity, shutdown order, dynamic children."""

import pytest
import trio
import trio.testing

import actors
from actors import ChildSpec
from actors_helpers import Boom, Echo, Factory


async def test_one_for_one_restarts_crashed_child_and_ref_works_again():
    a, b = Factory(), Factory()
    async with actors.open_supervisor(
        "sup", [ChildSpec("a", a), ChildSpec("b", b)]
    ) as sup:
        ref = sup.ref("a")
        assert await ref.call(1) == 1
        with pytest.raises(Boom) as info:
            await ref.call("crash")
        assert info.value is a.made[0].raised[0]
        await trio.testing.wait_all_tasks_blocked()
        assert sup.ref("a") is ref  # stable across restarts
        assert ref.alive
        assert await ref.call(2) == 2
        assert len(a.made) == 2 and len(b.made) == 1  # sibling untouched
        assert ref.statistics().restarts == 1
        assert sup.ref("b").statistics().restarts == 0
        assert sup.children() == ["a", "b"]


async def test_one_for_all_restarts_siblings():
    log = []
    a, b, c = Factory(log=log), Factory(log=log), Factory(log=log)
    async with actors.open_supervisor(
        "sup",
        [ChildSpec("a", a), ChildSpec("b", b), ChildSpec("c", c)],
        strategy="one_for_all",
    ) as sup:
        log.clear()
        with pytest.raises(Boom):
            await sup.ref("b").call("crash")
        await trio.testing.wait_all_tasks_blocked()
        # siblings stopped in reverse order, then everything restarted in order
        assert log == [("stop", "c"), ("stop", "a"),
                       ("start", "a"), ("start", "b"), ("start", "c")]
        assert [len(f.made) for f in (a, b, c)] == [2, 2, 2]
        for name in "abc":
            assert await sup.ref(name).call(name) == name


async def test_temporary_child_is_not_restarted_and_removed():
    t = Factory()
    async with actors.open_supervisor("sup", [ChildSpec("t", t, restart="temporary")]) as sup:
        ref = sup.ref("t")
        with pytest.raises(Boom):
            await ref.call("crash")
        await trio.testing.wait_all_tasks_blocked()
        assert len(t.made) == 1
        assert sup.children() == []
        assert not ref.alive
        with pytest.raises(actors.ActorDead):
            await ref.call("x")


async def test_transient_child_restarted_only_after_crash():
    t = Factory()
    async with actors.open_supervisor("sup", [ChildSpec("t", t, restart="transient")]) as sup:
        ref = sup.ref("t")
        with pytest.raises(Boom):
            await ref.call("crash")
        await trio.testing.wait_all_tasks_blocked()
        assert len(t.made) == 2 and ref.alive
        assert await ref.call("stop") == "stopping"
        await trio.testing.wait_all_tasks_blocked()
        assert len(t.made) == 2 and not ref.alive
        assert sup.children() == []


async def test_permanent_child_restarted_after_normal_stop():
    p = Factory()
    async with actors.open_supervisor("sup", [ChildSpec("p", p)]) as sup:
        await sup.ref("p").call("stop")
        await trio.testing.wait_all_tasks_blocked()
        assert len(p.made) == 2 and sup.ref("p").alive


async def test_too_many_crashes_in_period_escalate(autojump_clock):
    w = Factory()
    with pytest.raises(actors.SupervisorEscalation) as info:
        async with actors.open_supervisor(
            "top", [ChildSpec("w", w)], intensity=3, period=5.0
        ) as sup:
            ref = sup.ref("w")
            for _ in range(4):
                with pytest.raises(Boom):
                    await ref.call("crash")
                await trio.sleep(1.0)  # 4 crashes within 5s
            await trio.sleep_forever()
    assert info.value.name == "top"
    assert info.value.last_exception is w.made[3].raised[0]
    assert len(w.made) == 4  # 3 restarts, then gave up
    assert not ref.alive


async def test_same_crashes_spread_beyond_period_do_not_escalate(autojump_clock):
    w = Factory()
    async with actors.open_supervisor(
        "top", [ChildSpec("w", w)], intensity=3, period=5.0
    ) as sup:
        ref = sup.ref("w")
        for _ in range(8):
            with pytest.raises(Boom):
                await ref.call("crash")
            await trio.sleep(2.0)  # at most 3 crashes in any 5s window
        assert ref.alive and ref.statistics().restarts == 8


async def test_call_while_restarting_raises_actor_dead_and_pending_call_never_hangs(autojump_clock):
    gate = trio.Event()
    results = []

    class SlowStart(Echo):
        async def on_start(self):
            if self.log:  # second incarnation: slow start
                await gate.wait()
            self.log.append("started")

    f = Factory(SlowStart, log=[])
    async with actors.open_supervisor("sup", [ChildSpec("s", f)]) as sup:
        ref = sup.ref("s")

        async def pending_caller():
            try:
                await ref.call(("sleep", 1000), timeout=None)
            except actors.ActorDead as exc:
                results.append(exc)

        async with trio.open_nursery() as n:
            n.start_soon(pending_caller)
            await trio.testing.wait_all_tasks_blocked()
            # a background crash of the incarnation while the call is pending
            f.made[0].nursery.start_soon(_raise_boom)
        assert len(results) == 1  # got ActorDead, did not hang
        # now the restart is stuck in on_start
        t0 = trio.current_time()
        gate.set()
        await trio.testing.wait_all_tasks_blocked()
        assert await ref.call("back") == "back"
        assert trio.current_time() == t0


async def _raise_boom():
    raise Boom("background")


async def test_call_to_child_between_incarnations_raises_actor_dead(autojump_clock):
    gate = trio.Event()

    class SlowRestart(Echo):
        async def on_start(self):
            if len(f.made) > 1:
                await gate.wait()

    f = Factory(SlowRestart)
    async with actors.open_supervisor("sup", [ChildSpec("n", f)]) as sup:
        ref = sup.ref("n")
        with pytest.raises(Boom):
            await ref.call("crash")
        await trio.testing.wait_all_tasks_blocked()
        # the new incarnation is still in on_start: the child is down
        assert len(f.made) == 2 and not ref.alive
        t0 = trio.current_time()
        with pytest.raises(actors.ActorDead):
            await ref.call("x", timeout=None)
        with pytest.raises(actors.ActorDead):
            ref.cast_nowait("x")
        assert trio.current_time() == t0
        gate.set()
        await trio.testing.wait_all_tasks_blocked()
        assert ref.alive and await ref.call("x") == "x"


async def test_orderly_shutdown_runs_on_stop_in_reverse_start_order():
    log = []
    specs = [ChildSpec(n, Factory(log=log)) for n in ("first", "second", "third")]
    async with actors.open_supervisor("sup", specs) as sup:
        refs = [sup.ref(n) for n in ("first", "second", "third")]
        assert log == [("start", "first"), ("start", "second"), ("start", "third")]
        log.clear()
    assert log == [("stop", "third"), ("stop", "second"), ("stop", "first")]
    assert not any(r.alive for r in refs)


async def test_embedding_with_nursery_start_and_aclose():
    log = []
    sup = actors.Supervisor("emb", [ChildSpec("a", Factory(log=log)), ChildSpec("b", Factory(log=log))])
    async with trio.open_nursery() as nursery:
        started = await nursery.start(sup.run)
        assert started is sup and sup.alive
        assert await sup.ref("b").call("hi") == "hi"
        await sup.aclose()
        assert not sup.alive
    assert log[-2:] == [("stop", "b"), ("stop", "a")]


async def test_dynamic_start_child_and_stop_child():
    log = []
    async with actors.open_supervisor("jobs", []) as sup:
        ref = await sup.start_child(ChildSpec("job-1", Factory(log=log), restart="temporary"))
        assert isinstance(ref, actors.ActorRef) and ref.name == "job-1"
        ref2 = await sup.start_child(ChildSpec("job-2", Factory(log=log), restart="temporary"))
        assert sup.children() == ["job-1", "job-2"]
        assert await ref.call("x") == "x"
        with pytest.raises(ValueError):
            await sup.start_child(ChildSpec("job-1", Factory()))
        await sup.stop_child("job-1")
        assert ("stop", "job-1") in log
        assert sup.children() == ["job-2"]
        with pytest.raises(actors.ActorDead):
            await ref.call("x")
        # a temporary child that stops itself is removed
        await ref2.call("stop")
        await trio.testing.wait_all_tasks_blocked()
        assert sup.children() == []
        with pytest.raises(KeyError):
            await sup.stop_child("nope")


async def test_start_child_failure_is_raised_and_child_not_added():
    class Bad(actors.Actor):
        async def on_start(self):
            raise Boom("no")

        async def handle(self, msg):
            return msg

    async with actors.open_supervisor("jobs", []) as sup:
        with pytest.raises(Boom):
            await sup.start_child(ChildSpec("bad", Bad, restart="temporary"))
        assert sup.children() == []


async def test_nested_supervisor_escalation_is_handled_by_parent(autojump_clock):
    inner_made = []
    workers = Factory()

    def make_inner():
        sup = actors.Supervisor("inner", [ChildSpec("w", workers)], intensity=0)
        inner_made.append(sup)
        return sup

    log = []
    async with actors.open_supervisor(
        "outer",
        [ChildSpec("inner", make_inner), ChildSpec("sibling", Factory(log=log))],
        intensity=3,
    ) as outer:
        inner = outer.ref("inner")
        assert isinstance(inner, actors.Supervisor)
        ref = inner.ref("w")
        with pytest.raises(Boom):
            await ref.call("crash")  # inner has intensity 0: it escalates
        await trio.testing.wait_all_tasks_blocked()
        assert len(inner_made) == 2  # outer restarted the inner supervisor
        new_inner = outer.ref("inner")
        assert new_inner is inner_made[1] and new_inner is not inner
        assert await new_inner.ref("w").call("ok") == "ok"
        assert not ref.alive  # refs belong to the old inner incarnation
        assert log == [("start", "sibling")]  # one_for_one: sibling untouched
    assert log[-1] == ("stop", "sibling")


async def test_nested_escalations_eventually_reach_the_top(autojump_clock):
    workers = Factory()
    with pytest.raises(actors.SupervisorEscalation) as info:
        async with actors.open_supervisor(
            "outer",
            [ChildSpec("inner", lambda: actors.Supervisor("inner", [ChildSpec("w", workers)], intensity=0))],
            intensity=1,
        ) as outer:
            for _ in range(2):
                with pytest.raises(Boom):
                    await outer.ref("inner").ref("w").call("crash")
                await trio.testing.wait_all_tasks_blocked()
            await trio.sleep_forever()
    assert info.value.name == "outer"
    assert isinstance(info.value.last_exception, actors.SupervisorEscalation)
    assert info.value.last_exception.name == "inner"


async def test_restart_failures_count_against_intensity(autojump_clock):
    class FailsAfterFirst(Echo):
        async def on_start(self):
            if len(f.made) > 1:
                raise Boom("cannot start")

    f = Factory(FailsAfterFirst)
    with pytest.raises(actors.SupervisorEscalation) as info:
        async with actors.open_supervisor("sup", [ChildSpec("x", f)], intensity=2) as sup:
            with pytest.raises(Boom):
                await sup.ref("x").call("crash")
            await trio.sleep_forever()
    assert str(info.value.last_exception) == "cannot start"
    assert len(f.made) == 3


async def test_stuck_child_is_cancelled_after_shutdown_grace(autojump_clock):
    class Stuck(Echo):
        async def on_stop(self):
            await trio.sleep_forever()

    t0 = trio.current_time()
    async with actors.open_supervisor("sup", [ChildSpec("s", Stuck, shutdown=2.0)]):
        pass
    assert trio.current_time() - t0 == 2.0


async def test_body_exception_propagates_unwrapped():
    with pytest.raises(KeyError):
        async with actors.open_supervisor("sup", [ChildSpec("a", Factory())]):
            raise KeyError("body")


def test_invalid_specs():
    with pytest.raises(ValueError):
        ChildSpec("x", Echo, restart="sometimes")
    with pytest.raises(ValueError):
        actors.Supervisor("s", [], strategy="rest_for_one")
    with pytest.raises(ValueError):
        actors.Supervisor("s", [ChildSpec("x", Echo), ChildSpec("x", Echo)])


async def test_start_child_on_stopped_supervisor_raises():
    sup = actors.Supervisor("s", [])
    with pytest.raises(RuntimeError):
        await sup.start_child(ChildSpec("x", Echo))
    await sup.aclose()  # never ran: returns immediately


async def test_crash_and_restart_are_logged(caplog):
    import logging

    caplog.set_level(logging.INFO, logger="actors")
    async with actors.open_supervisor("logsup", [ChildSpec("w", Factory())]) as sup:
        with pytest.raises(Boom):
            await sup.ref("w").call("crash")
        await trio.testing.wait_all_tasks_blocked()
    crash = [r for r in caplog.records if r.levelno >= logging.ERROR and "w" in r.getMessage()]
    assert crash and crash[0].exc_info is not None
    assert any(r.levelno == logging.INFO and "restarting child w" in r.getMessage()
               and "logsup" in r.getMessage() for r in caplog.records)


async def test_a_ref_made_before_the_tree_reaches_the_child_and_survives_restarts():
    ref = actors.ActorRef("echo")

    class Echo(actors.Actor):
        async def handle(self, msg):
            if msg == "crash":
                raise RuntimeError("boom")
            return msg

    spec = actors.ChildSpec(name="echo", factory=Echo, ref=ref)
    assert not ref.alive  # nothing runs yet, but siblings can already hold it
    async with actors.open_supervisor("top", [spec]) as sup:
        assert sup.ref("echo") is ref
        assert await ref.call("hi") == "hi"
        with pytest.raises(RuntimeError):
            await ref.call("crash")
        await trio.testing.wait_all_tasks_blocked()
        assert await ref.call("again") == "again" and ref.restarts == 1


# -- one task owns the children: requests and exits are served one at a time, in order ----


class GatedRestart(Echo):
    """Its second incarnation's on_start waits for `gate`: while it waits, the supervisor
    is busy restarting it and serves nothing else (exits and requests queue up)."""

    gate: trio.Event
    made: list

    async def on_start(self):
        await super().on_start()
        if len(self.made) > 1:
            await self.gate.wait()


def gated(log=None):
    factory = Factory(GatedRestart, log=[] if log is None else log)
    GatedRestart.made = factory.made
    GatedRestart.gate = trio.Event()
    return factory


async def _busy_restarting(sup, name):
    """Crash child `name` (a GatedRestart): the supervisor is then stuck in its restart."""
    with pytest.raises(Boom):
        await sup.ref(name).call("crash")
    await trio.testing.wait_all_tasks_blocked()


async def test_start_child_waits_for_a_restart_in_progress_then_both_run(autojump_clock):
    g, b = gated(), Factory()
    async with actors.open_supervisor("sup", [ChildSpec("g", g)]) as sup:
        await _busy_restarting(sup, "g")
        started = []

        async def start_b():
            started.append(await sup.start_child(ChildSpec("b", b, restart="temporary")))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(start_b)
            await trio.testing.wait_all_tasks_blocked()
            assert b.made == [] and started == []  # queued behind the restart
            GatedRestart.gate.set()
        assert started == [sup.ref("b")] and len(b.made) == 1
        assert sup.children() == ["g", "b"]
        assert sup.ref("g").alive and await sup.ref("g").call("g") == "g"
        assert await started[0].call("b") == "b"


async def test_stop_child_racing_that_childs_crash_exit_first(autojump_clock):
    """The crash is queued before the stop: the child is restarted (its exit comes first),
    then the stop stops the new incarnation orderly and removes it."""
    log = []
    g, x = gated(), Factory(log=log)
    async with actors.open_supervisor("sup", [ChildSpec("g", g), ChildSpec("x", x)]) as sup:
        await _busy_restarting(sup, "g")
        with pytest.raises(Boom):
            await sup.ref("x").call("crash")
        stopped = []

        async def stop_x():
            await sup.stop_child("x")
            stopped.append(True)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(stop_x)
            await trio.testing.wait_all_tasks_blocked()
            assert stopped == [] and len(x.made) == 1
            GatedRestart.gate.set()
        assert stopped == [True] and len(x.made) == 2
        assert log == [("start", "x"), ("start", "x"), ("stop", "x")]
        assert sup.children() == ["g"]
        assert sup.restarts_in_window() == 2


async def test_stop_child_racing_that_childs_crash_stop_first(autojump_clock):
    """The stop is queued before the crash: the stop removes the (dead) child, and its
    exit, arriving for a child no longer there, restarts nothing."""
    log = []
    g, x = gated(), Factory(log=log)
    async with actors.open_supervisor("sup", [ChildSpec("g", g), ChildSpec("x", x)]) as sup:
        await _busy_restarting(sup, "g")
        xref = sup.ref("x")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sup.stop_child, "x")
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(Boom):
                await xref.call("crash")
            GatedRestart.gate.set()
        await trio.testing.wait_all_tasks_blocked()
        assert len(x.made) == 1 and not xref.alive
        assert log == [("start", "x")]  # crashed: no on_stop
        assert sup.children() == ["g"]
        assert sup.restarts_in_window() == 1  # g's restart only


async def test_start_child_during_shutdown_is_refused_and_never_started(autojump_clock):
    log = []
    g, late, later = gated(), Factory(), Factory()
    sup = actors.Supervisor("sup", [ChildSpec("g", g), ChildSpec("x", Factory(log=log))])
    errors, stopped = [], []

    async def start(factory, name):
        try:
            await sup.start_child(ChildSpec(name, factory, restart="temporary"))
        except RuntimeError as exc:
            errors.append(str(exc))

    async def stop_x():
        await sup.stop_child("x")
        stopped.append(list(log))

    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        await _busy_restarting(sup, "g")
        nursery.start_soon(start, late, "late")  # queued before the shutdown
        await trio.testing.wait_all_tasks_blocked()
        sup.shutdown()
        await start(later, "later")  # after it: refused at once
        nursery.start_soon(stop_x)  # during it: returns once the tree has stopped
        await trio.testing.wait_all_tasks_blocked()
        assert len(errors) == 1 and "shutting down" in errors[0] and stopped == []
        GatedRestart.gate.set()
    assert late.made == [] and later.made == []
    assert len(errors) == 2 and all("shutting down" in e for e in errors)
    assert stopped == [[("start", "x"), ("stop", "x")]]
    assert sup.children() == [] and not sup.alive


async def test_a_blocked_on_start_holds_back_other_exits_until_it_is_done(autojump_clock):
    """OTP's rule: a supervisor serves one request at a time. While a start_child's
    on_start blocks, a sibling's crash waits in the queue (it is not restarted yet and its
    ref says dead); it is handled as soon as that start is done."""
    gate = trio.Event()

    class SlowStart(Echo):
        async def on_start(self):
            await gate.wait()

    a = Factory()
    async with actors.open_supervisor("sup", [ChildSpec("a", a)]) as sup:
        aref = sup.ref("a")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sup.start_child, ChildSpec("slow", SlowStart, restart="temporary"))
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(Boom):
                await aref.call("crash")
            await trio.testing.wait_all_tasks_blocked()
            assert len(a.made) == 1 and not aref.alive  # its exit waits its turn
            gate.set()
        await trio.testing.wait_all_tasks_blocked()
        assert len(a.made) == 2 and aref.alive
        assert sup.children() == ["a", "slow"]


async def test_start_child_cancelled_by_its_caller_leaves_no_child(autojump_clock):
    gate = trio.Event()
    g = gated()

    class Blocks(Echo):
        async def on_start(self):
            await gate.wait()

    queued, blocked = Factory(), Factory(Blocks)
    async with actors.open_supervisor("sup", [ChildSpec("g", g)]) as sup:
        await _busy_restarting(sup, "g")
        with trio.move_on_after(1):  # still queued behind g's restart when cancelled
            await sup.start_child(ChildSpec("queued", queued))
        GatedRestart.gate.set()
        await trio.testing.wait_all_tasks_blocked()
        assert queued.made == [] and sup.children() == ["g"]
        with trio.move_on_after(1):  # cancelled in the middle of its on_start
            await sup.start_child(ChildSpec("blocked", blocked))
        await trio.testing.wait_all_tasks_blocked()
        assert len(blocked.made) == 1 and sup.children() == ["g"]
        ref = await sup.start_child(ChildSpec("after", Factory()))  # still serving
        assert await ref.call("ok") == "ok"
