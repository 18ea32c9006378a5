"""Actors and the references callers hold to them."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable

import outcome
import trio

from ._errors import ActorDead, CallTimeout, InboxFull
from ._util import single_leaf

__all__ = ["Actor", "ActorRef", "ActorStatistics", "DeferredReply", "LATER"]

logger = logging.getLogger("actors")


@dataclass(frozen=True)
class ActorStatistics:
    name: str
    inbox_used: int
    inbox_size: float
    messages_handled: int
    restarts: int
    alive: bool


class _Reply:
    """One-shot reply slot for a ``call``: the caller's task parks on it and ``set``
    reschedules it (no Event, no cancel scope per call: a call's timeout is kept by the
    run's `_Timeouts`, issue 14)."""

    __slots__ = ("result", "task", "keeper", "timeout")

    def __init__(self) -> None:
        self.result: outcome.Outcome | None = None
        self.task: Any = None  # the caller, while it waits
        self.keeper: _Timeouts | None = None  # holds its deadline, while it waits
        self.timeout = 0.0

    def set(self, result: outcome.Outcome) -> None:
        if self.result is None:
            self.result = result
            self._leave_keeper()
            task, self.task = self.task, None
            if task is not None:
                trio.lowlevel.reschedule(task)

    def _leave_keeper(self) -> None:
        keeper, self.keeper = self.keeper, None
        if keeper is not None:
            keeper.drop(self)

    async def wait(self, name: str, timeout: float | None) -> None:
        """Park until `set`; CallTimeout's outcome after `timeout` seconds."""
        if self.result is not None:
            return
        if timeout is not None:
            _timeouts().add(self, name, timeout)
        self.task = trio.lowlevel.current_task()

        def abort(_raise_cancel):
            self.task = None
            self._leave_keeper()
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)


class _Timeouts:
    """The deadlines of the calls waiting in one trio run, and one system task that fails
    the calls whose deadline passed. One insertion-ordered dict per timeout value: a later
    call of the same timeout has a later deadline, so each dict's first entry is its
    earliest. Adding and answering a call are dict operations; the task's own deadline is
    the earliest waiting call's, so trio holds a deadline only while a call waits for it
    (as with a cancel scope per call: MockClock's autojump sees the same deadlines)."""

    def __init__(self) -> None:
        self.buckets: dict[float, dict[_Reply, tuple[float, str]]] = {}
        self.wakeup = math.inf
        self.scope: trio.CancelScope | None = None
        trio.lowlevel.spawn_system_task(self._watch, name="actors.call-timeouts")

    def add(self, reply: _Reply, name: str, timeout: float) -> None:
        bucket = self.buckets.get(timeout)
        if bucket is None:
            bucket = self.buckets[timeout] = {}
        deadline = trio.current_time() + timeout
        bucket[reply] = (deadline, name)
        reply.keeper, reply.timeout = self, timeout
        if deadline < self.wakeup:
            self._arm(deadline)

    def drop(self, reply: _Reply) -> None:
        deadline, _ = self.buckets[reply.timeout].pop(reply)
        if deadline <= self.wakeup:  # it was the earliest: the next one is now
            wakeup = math.inf
            for bucket in self.buckets.values():
                for first, _ in bucket.values():  # each bucket's first entry is its earliest
                    if first < wakeup:
                        wakeup = first
                    break
            if wakeup != self.wakeup:
                self._arm(wakeup)

    def _arm(self, wakeup: float) -> None:
        self.wakeup = wakeup
        if self.scope is not None:
            self.scope.deadline = wakeup

    async def _watch(self) -> None:
        while True:
            with trio.CancelScope(deadline=self.wakeup) as self.scope:
                await trio.sleep_forever()
            self.scope = None
            now = trio.current_time()
            for timeout, bucket in self.buckets.items():
                while bucket:
                    reply = next(iter(bucket))
                    deadline, name = bucket[reply]
                    if deadline > now:
                        break
                    reply.set(outcome.Error(CallTimeout(name, timeout)))  # drops it


_TIMEOUTS: trio.lowlevel.RunVar = trio.lowlevel.RunVar("actors._TIMEOUTS")


def _timeouts() -> _Timeouts:
    try:
        return _TIMEOUTS.get()
    except LookupError:
        keeper = _Timeouts()
        _TIMEOUTS.set(keeper)
        return keeper


class _Later:
    __slots__ = ()

    def __repr__(self) -> str:
        return "actors.LATER"


#: What ``handle_now`` returns for a message it cannot finish without waiting (nothing
#: changed yet): the message then goes through the inbox to ``handle``.
LATER: Any = _Later()


class _Crash:
    """Queued by a ``handle_now`` that failed in a sender's task: the actor raises it."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException):
        self.exc = exc


class _Envelope:
    __slots__ = ("msg", "reply", "deferred", "counted")

    def __init__(self, msg: Any, reply: _Reply | None, counted: bool = True):
        self.msg = msg
        self.reply = reply
        self.deferred = False
        self.counted = counted  # False: the rest of a message handled already (handle_next)


#: `stop`'s word to an actor waiting for a message: wake up and see that it stops
_WAKE = _Envelope(None, None)


class DeferredReply:
    """The answer to one ``call``, owed later (OTP's ``{noreply, State}`` and
    ``gen_server:reply/2``): from ``Actor.defer_reply()`` inside ``handle``. Answer it once,
    from any later message or task of the same incarnation, with ``reply(value)`` or
    ``fail(exc)``; later answers are ignored. If the actor stops or crashes first, the
    caller gets ``ActorDead``; if the caller gave up (``CallTimeout``), the answer is dropped."""

    __slots__ = ("_reply", "_actor")

    def __init__(self, reply: _Reply, actor: "Actor"):
        self._reply, self._actor = reply, actor

    @property
    def answered(self) -> bool:
        return self._reply.result is not None

    def reply(self, value: Any) -> None:
        self._answer(outcome.Value(value))

    def fail(self, exc: BaseException) -> None:
        self._answer(outcome.Error(exc))

    def _answer(self, result: outcome.Outcome) -> None:
        self._actor._pending.discard(self._reply)
        self._reply.set(result)


class ActorRef:
    """What callers hold. Stable across supervisor restarts of the actor."""

    def __init__(self, name: str):
        self.name = name
        self._actor: Actor | None = None
        self._incarnations = 0
        self._messages_handled = 0
        self._inbox_size: float = 0

    def __repr__(self) -> str:
        state = "alive" if self.alive else "dead"
        return f"<ActorRef {self.name!r} {state}>"

    # -- incarnation management (used by Actor.run) -------------------------
    def _attach(self, actor: Actor) -> None:
        self._actor = actor
        self._incarnations += 1
        self._inbox_size = actor.inbox_size

    def _detach(self, actor: Actor) -> None:
        if self._actor is actor:
            self._actor = None

    def _live(self) -> Actor:
        actor = self._actor
        if actor is None or actor._stopping:
            raise ActorDead(self.name)
        return actor

    # -- public API ---------------------------------------------------------
    @property
    def alive(self) -> bool:
        actor = self._actor
        return actor is not None and not actor._stopping

    @property
    def restarts(self) -> int:
        return max(0, self._incarnations - 1)

    def statistics(self) -> ActorStatistics:
        actor = self._actor
        used = actor._send.statistics().current_buffer_used if actor is not None else 0
        return ActorStatistics(
            name=self.name,
            inbox_used=used,
            inbox_size=self._inbox_size,
            messages_handled=self._messages_handled,
            restarts=self.restarts,
            alive=self.alive,
        )

    async def call(self, msg: Any, timeout: float | None = 30.0) -> Any:
        """Send ``msg`` and wait for ``handle``'s return value.

        Raises the exception ``handle`` raised (same object), ``CallTimeout``
        after ``timeout`` seconds (None: wait forever), or ``ActorDead`` if
        the actor is not running or dies before replying.
        """
        actor = self._live()
        if isinstance(msg, actor.readers):
            await trio.lowlevel.checkpoint_if_cancelled()  # yields only when cancelled
            result = actor.read(msg)
            if result is not LATER:
                return result  # (LATER: not now; the message goes the ordinary way)
        reply = _Reply()
        actor._pending.add(reply)
        try:
            env = _Envelope(msg, reply)
            if isinstance(msg, actor.immediate) and actor._at_rest():
                await trio.lowlevel.checkpoint_if_cancelled()  # yields only when cancelled
                result = actor._handle_here(env)
                if env.deferred:
                    await reply.wait(self.name, timeout)
                    return reply.result.unwrap()  # type: ignore[union-attr]
                if result is not LATER:
                    return result
            if _offer(actor, env, self.name):
                await reply.wait(self.name, timeout)  # the checkpoint: the actor has yet to run
            else:  # a full inbox: the wait for room counts in the timeout
                deadline = math.inf if timeout is None else trio.current_time() + timeout
                with trio.move_on_at(deadline):
                    await _put(actor, env, self.name)
                    await reply.wait(self.name, None)
                if reply.result is None:
                    raise CallTimeout(self.name, timeout)  # type: ignore[arg-type]
        finally:
            actor._pending.discard(reply)
        return reply.result.unwrap()

    def try_now(self, msg: Any) -> Any:
        """``handle_now``'s answer at once, in the caller's task, when ``msg`` is of an
        ``immediate`` type and the actor is idle (as a ``call`` would take it); ``LATER``
        when not (also when the actor is not running, or ``handle_now`` said LATER).
        Raises what ``handle_now`` raised (``RuntimeError`` if it deferred its answer:
        nothing would wait for it). For a caller that must not wait (an actor's handler)
        and has a way to ask later."""
        actor = self._actor
        if actor is None or not isinstance(msg, actor.immediate) or not actor._at_rest():
            return LATER
        env = _Envelope(msg, _Reply())  # answering, as for a call
        result = actor._handle_here(env)
        if env.deferred:
            raise RuntimeError(f"{self.name}: try_now of {msg!r}, whose handle_now deferred")
        return result

    async def cast(self, msg: Any) -> None:
        """Fire-and-forget; waits for inbox room (backpressure). With room it returns at once,
        without a schedule point (a cancellation already due is still raised); an
        ``immediate`` message to an idle actor is handled before it returns."""
        await trio.lowlevel.checkpoint_if_cancelled()
        actor, env = self._live(), _Envelope(msg, None)
        if not actor._cast_here(env):
            await _put(actor, env, self.name)

    def cast_nowait(self, msg: Any) -> None:
        """Fire-and-forget; raises ``InboxFull`` instead of waiting."""
        actor, env = self._live(), _Envelope(msg, None)
        if not actor._cast_here(env) and not _offer(actor, env, self.name):
            raise InboxFull(self.name)


def _offer(actor: "Actor", env: _Envelope, name: str) -> bool:
    """Into the actor's inbox if it has room (True), without a schedule point; False when
    it is full; ActorDead when it is closed. An actor running ``main`` serves no inbox: a
    crash cancels its ``main``; any other message is refused (TypeError, or ActorDead
    while it stops)."""
    if actor._main_scope is not None:
        if isinstance(env.msg, _Crash):
            actor._main_crash = env.msg.exc
            actor._main_scope.cancel()
            return True
        if actor._stopping or actor._crashing:
            raise ActorDead(name)
        raise TypeError(f"actor {name} runs main(): it takes only its immediate messages, "
                        f"which handle_now answers at once, not {env.msg!r}")
    try:
        actor._send.send_nowait(env)
    except trio.WouldBlock:
        return False
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        raise ActorDead(name) from None
    actor._inflight += 1
    return True


async def _put(actor: "Actor", env: _Envelope, name: str) -> None:
    """Into the actor's inbox: at once when there is room (issue 14: the channel's `send`
    yields to the scheduler even then, a task switch per message), else waiting for room."""
    if not _offer(actor, env, name):
        actor._inflight += 1  # counted while it waits for room: the actor is not idle
        try:
            await actor._send.send(env)
        except BaseException as exc:
            actor._inflight -= 1
            if isinstance(exc, (trio.BrokenResourceError, trio.ClosedResourceError)):
                raise ActorDead(name) from None
            raise


class Actor:
    """Base class: override ``handle`` (and optionally ``on_start`` / ``on_stop``).

    One instance is one incarnation: supervisors call the child factory again
    for every restart. Run standalone with ``ref = await nursery.start(actor.run)``.
    """

    inbox_size: float = 16
    #: Exceptions ``handle`` raises as an answer, not as a crash: a ``call`` gets them
    #: raised (same object) and the actor goes on with its next message (a ``cast`` that
    #: raises one is logged). Only list errors after which the actor's state is intact,
    #: e.g. a write that failed whole and was rolled back.
    replied_errors: tuple[type[Exception], ...] = ()
    #: Message types handled by ``handle_now``, a plain function (issue 14). A ``call`` or
    #: ``cast`` of one that finds this incarnation idle (waiting for a message, none
    #: queued) runs ``handle_now`` at once in the sender's task: no task switch, and the
    #: actor is still the only one changing its state (trio runs one task at a time, and
    #: ``handle_now`` cannot wait). Otherwise the message is queued and the actor's task
    #: calls ``handle_now`` for it in turn. ``handle_now`` may return ``LATER`` when the
    #: message needs waiting (having changed nothing): it then goes to ``handle``.
    immediate: tuple[type, ...] = ()
    #: Message types that only read the actor's state, answered by ``read``, a plain
    #: function, at once in the caller's task, also while the actor is busy (inside
    #: ``handle``, waiting on another actor or a thread): a probe that must not wait
    #: behind a slow message. Only for state that is whole at every point ``handle`` waits
    #: (e.g. a pure core's, changed only between those points). It sees that state as it
    #: is, before any message still queued; ``read`` must change nothing, and what it
    #: raises goes to the caller (the actor is not affected). Only ``call`` takes them.
    #: ``read`` may answer ``LATER`` (its state is not whole yet, e.g. before ``on_start``
    #: has filled it): the message then goes the ordinary way (``immediate``, or the
    #: inbox and ``handle``).
    readers: tuple[type, ...] = ()

    def __init__(self, *, name: str | None = None, inbox_size: float | None = None):
        self._explicit_name = name is not None
        self.name: str = name if name is not None else type(self).__name__
        if inbox_size is not None:
            self.inbox_size = inbox_size
        if self.inbox_size < 0:
            raise ValueError("inbox_size must be >= 0")
        self.nursery: trio.Nursery | None = None
        self._ref = ActorRef(self.name)
        self._ran = False
        self._stopping = False
        self._closed = False
        self._pending: set[_Reply] = set()
        self._waiting = False  # in `_serve`, waiting for a message (`stop` wakes it)
        self._current: _Envelope | None = None  # the message ``handle`` is working on
        self._held: _Envelope | None = None  # looked at by take_waiting, not taken: next
        self._inflight = 0  # messages put into the inbox and not yet taken out
        self._crashing = False  # a handle_now failed in a sender's task: _Crash is queued
        self._main_scope: trio.CancelScope | None = None  # while `main` runs
        self._opened = False  # its inbox exists (`_open`)
        self._main_crash: BaseException | None = None  # what a handle_now raised meanwhile

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"

    # -- hooks ----------------------------------------------------------------
    async def on_start(self) -> None:
        """Runs before the actor is reported started; ``self.nursery`` is available."""

    async def handle(self, msg: Any) -> Any:
        """Handle one message; the return value is the reply to ``call``. The default hands
        it to ``handle_now`` (an actor whose messages are all immediate needs no other)."""
        result = self.handle_now(msg)
        if result is LATER:
            raise NotImplementedError(f"{type(self).__name__}.handle")
        return result

    def handle_now(self, msg: Any) -> Any:
        """Handle one message of an ``immediate`` type without waiting (see there); the
        return value is the reply to ``call``, or ``LATER``."""
        return LATER

    def read(self, msg: Any) -> Any:
        """Answer a message of a ``readers`` type (see there) from the state as it is."""
        raise NotImplementedError(f"{type(self).__name__}.read")

    async def main(self) -> None:
        """Optional: the incarnation's own work, for an actor that is a piece of work more
        than a server of messages (e.g. one job's life). When a subclass defines it, the
        actor's task runs it after ``on_start`` instead of serving an inbox, and the actor
        stops when it returns (it crashes when it raises). Its messages are then all of
        ``immediate`` types, each answered by ``handle_now`` at once in the sender's task
        whenever ``main`` waits (``handle`` is never called; a message of another type, or
        one ``handle_now`` answers ``LATER``, is refused with TypeError). ``stop()``
        cancels ``main``. No task and no inbox wait of its own: a task step or two less
        per incarnation than ``on_start`` starting the work in ``self.nursery``."""

    async def on_stop(self) -> None:
        """Runs on orderly shutdown (not after a crash)."""

    # -- public ---------------------------------------------------------------
    @property
    def ref(self) -> ActorRef:
        return self._ref

    async def cast_self(self, msg: Any) -> None:
        """Queue ``msg`` in this incarnation's own inbox (waiting for room), also while
        ``on_start`` still runs and the ref does not reach it yet: for an actor's own
        timers and follow-ups. Handled after ``on_start``, in order with other messages.
        As ``cast``: with room, no schedule point (a cancellation already due is raised).
        Once the incarnation is stopping (``stop()``), ``msg`` is dropped: it would never be
        handled, and a timer of the actor's that fires during ``on_stop`` is no crash."""
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._stopping:
            return
        await _put(self, _Envelope(msg, None), self.name)

    def cast_self_nowait(self, msg: Any) -> None:
        """``cast_self`` that raises ``InboxFull`` instead of waiting."""
        if not _offer(self, _Envelope(msg, None), self.name):
            raise InboxFull(self.name)

    @property
    def answering(self) -> bool:
        """Inside ``handle``: whether a caller waits for this message's answer (a ``call``,
        not a ``cast``)."""
        return self._current is not None and self._current.reply is not None

    def defer_reply(self) -> DeferredReply:
        """Inside ``handle`` of a ``call``: do not answer when ``handle`` returns (its return
        value is dropped); answer later through the returned token, while this actor goes on
        serving other messages. The caller keeps waiting up to its own timeout. Raises
        ``RuntimeError`` outside ``handle`` or for a ``cast`` (nobody waits for an answer)."""
        env = self._current
        if env is None or env.reply is None:
            raise RuntimeError(f"{self!r}: defer_reply() outside handle() of a call")
        env.deferred = True
        return DeferredReply(env.reply, self)

    def take_waiting(self, accept: Callable[[Any], bool], limit: int = 64,
                     ) -> list[tuple[Any, DeferredReply | None]]:
        """Inside ``handle``: take the messages already waiting in the inbox, in order, while
        ``accept(msg)`` holds (at most ``limit``), to handle them together with the current
        one (group work: e.g. several writes in one transaction). Each comes with the token
        of its answer (None for a cast), which the actor owes as for ``defer_reply``: answer
        each (``reply`` / ``fail``); a crash answers the rest ``ActorDead``. The first waiting
        message not accepted is not taken: it is the next one ``handle`` gets. Never waits."""
        taken: list[tuple[Any, DeferredReply | None]] = []
        while len(taken) < limit and self._held is None:
            try:
                env = self._recv.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
            self._inflight -= 1
            if not accept(env.msg):
                self._held = env
                break
            self._ref._messages_handled += 1
            taken.append((env.msg, None if env.reply is None else DeferredReply(env.reply, self)))
        return taken

    def handle_next(self, msg: Any) -> None:
        """Inside ``handle`` or ``handle_now``: make ``msg`` (a cast) this actor's very next
        message, ahead of everything in its inbox, handled in its own task: the rest of
        the current message's work when ``handle_now`` finds it cannot finish at once
        (with ``defer_reply`` for the answer). The actor is not idle until it is handled;
        it is not counted as another message handled.
        One at a time; RuntimeError outside a handler or while one is pending."""
        if self._current is None or self._held is not None:
            raise RuntimeError(f"{self!r}: handle_next() outside a handler, or twice")
        self._held = _Envelope(msg, None, counted=False)  # the same message, continued
        if self._waiting:  # handle_now in a sender's task: the actor's task waits, wake it
            self._send.send_nowait(_WAKE)
            self._inflight += 1

    def stop(self) -> None:
        """Finish the current message, then stop normally (``main``: cancel it)."""
        self._stopping = True
        if self._main_scope is not None:
            self._main_scope.cancel()
            return
        if self._waiting:  # an empty inbox: a word wakes it (no cancel scope per wait)
            try:
                self._send.send_nowait(_WAKE)
            except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            else:
                self._inflight += 1

    async def run(self, *, task_status: trio.TaskStatus[ActorRef] = trio.TASK_STATUS_IGNORED) -> None:
        """Run this incarnation until it stops (returns) or crashes (raises)."""
        if self._ran:
            raise RuntimeError(f"{self!r} already ran; create a new instance per incarnation")
        self._ran = True
        if not self._opened:
            self._open()
        ref = self._ref
        crash: BaseException | None = None
        try:
            try:
                async with trio.open_nursery() as nursery:
                    self.nursery = nursery
                    await self.on_start()
                    if ref._actor is not self:  # (a child started soon has it already)
                        ref._attach(self)  # from here on the ref reaches this incarnation
                    logger.debug("actor %s started", self.name)
                    task_status.started(ref)
                    if type(self).main is not Actor.main:
                        await self._run_main()
                    else:
                        await self._serve()
                    self._close_inbox()
                    await self.on_stop()
                    logger.debug("actor %s stopped", self.name)
                    nursery.cancel_scope.cancel()
            except BaseExceptionGroup as eg:
                crash = single_leaf(eg)
                if crash is None:
                    if eg.split(trio.Cancelled)[1] is not None:
                        logger.error("actor %s crashed", self.name, exc_info=eg)
                    raise
        finally:
            self._close_inbox()
        if crash is not None:
            logger.error("actor %s crashed: %r", self.name, crash, exc_info=crash)
            raise crash

    # -- internals ------------------------------------------------------------
    def _open(self, attach: bool = False) -> None:
        """Make the inbox; `attach`: the ref reaches this incarnation from now on, before its
        task runs (`Supervisor.start_child_soon`): messages wait in the inbox until then."""
        self._send, self._recv = trio.open_memory_channel[_Envelope](self.inbox_size)
        self._opened = True
        if attach:
            self._ref._attach(self)

    async def _run_main(self) -> None:
        if self._stopping:  # stopped during on_start
            return
        while True:  # what came before main began (a child started soon): first, in order
            try:
                env = self._recv.receive_nowait()
            except trio.WouldBlock:
                break
            self._inflight -= 1
            if isinstance(env.msg, _Crash):  # a handle_now below failed: queued by it
                raise env.msg.exc
            if not (self._stopping or self._crashing):  # (else: ActorDead at the close)
                self._answer_early(env)
        if self._stopping:
            return
        self._waiting = True  # between messages whenever main waits: handled in the sender's task
        try:
            with trio.CancelScope() as self._main_scope:
                await self.main()
        finally:
            self._waiting, self._main_scope = False, None
        if self._main_crash is not None:
            raise self._main_crash

    async def _serve(self) -> None:
        while not self._stopping:
            env, self._held = self._held, None
            if env is None:  # else left waiting by take_waiting: first in line
                try:  # a message already waiting: no schedule point (issue 14)
                    env = self._recv.receive_nowait()
                except trio.WouldBlock:
                    self._waiting = True
                    try:
                        env = await self._recv.receive()
                    finally:
                        self._waiting = False
                self._inflight -= 1
            if isinstance(env.msg, _Crash):
                raise env.msg.exc
            if env is not _WAKE:
                await self._dispatch(env)

    def _at_rest(self) -> bool:
        """Waiting for a message with none queued, nor one handed over and not yet taken."""
        return (self._waiting and not self._inflight and self._current is None
                and self._held is None and not self._stopping and not self._crashing)

    def _handle_here(self, env: _Envelope) -> Any:
        """``handle_now`` in the sender's task (the caller checked `_at_rest`). An error is
        raised to the sender as ``handle`` would answer it; one not in ``replied_errors``
        also crashes the actor, as in its own task (a queued `_Crash`)."""
        self._current = env
        try:
            result = self.handle_now(env.msg)
        except Exception as exc:
            self._ref._messages_handled += 1
            if not isinstance(exc, self.replied_errors):
                self._crashing = True
                _offer(self, _Envelope(_Crash(exc), None), self.name)
            raise
        finally:
            self._current = None
        if result is not LATER:
            self._ref._messages_handled += 1
        return result

    def _answer_early(self, env: _Envelope) -> None:
        """A message queued for an actor running `main` before main began: `handle_now`
        answers it, as it would have in the sender's task (LATER: refused)."""
        reply = env.reply
        try:
            result = self._handle_here(env)
            if result is LATER:
                raise TypeError(f"actor {self.name} runs main(): {env.msg!r} cannot be "
                                "answered at once")
        except Exception as exc:
            if reply is not None:
                reply.set(outcome.Error(exc))
            elif isinstance(exc, self.replied_errors):
                logger.warning("actor %s: cast %r failed: %r", self.name, env.msg, exc)
            return
        if reply is not None and not env.deferred:
            reply.set(outcome.Value(result))

    def _cast_here(self, env: _Envelope) -> bool:
        """A cast handled at once (True) if its type is immediate and the actor idle;
        False: queue it."""
        if not (isinstance(env.msg, self.immediate) and self._at_rest()):
            return False
        try:
            return self._handle_here(env) is not LATER
        except Exception as exc:
            if isinstance(exc, self.replied_errors):
                logger.warning("actor %s: cast %r failed: %r", self.name, env.msg, exc)
            return True

    async def _dispatch(self, env: _Envelope) -> None:
        reply = env.reply
        self._current = env
        try:
            msg = env.msg
            result = self.handle_now(msg) if isinstance(msg, self.immediate) else LATER
            if result is LATER:
                result = await self.handle(msg)
        except Exception as exc:
            if reply is not None:
                self._pending.discard(reply)
                reply.set(outcome.Error(exc))
            if not isinstance(exc, self.replied_errors):
                raise
            if reply is None:
                logger.warning("actor %s: cast %r failed: %r", self.name, env.msg, exc)
            return
        finally:
            self._current = None
            self._ref._messages_handled += env.counted
        if reply is not None and not env.deferred:
            reply.set(outcome.Value(result))

    def _close_inbox(self) -> None:
        """Detach from the ref, close the inbox and fail every pending call."""
        if self._closed:
            return
        self._closed = True
        self._stopping = True
        self._ref._detach(self)
        self._recv.close()
        pending, self._pending = self._pending, set()
        for reply in pending:
            reply.set(outcome.Error(ActorDead(self.name)))
