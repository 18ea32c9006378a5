"""OTP-style supervisors built from trio nurseries.

One task owns a supervisor's children: the task running ``Supervisor.run``. Everything
that changes the children list reaches it as an event on one channel, handled one at a
time in arrival order: a child's exit, a ``start_child`` or ``stop_child`` request (whose
caller waits for the answer), the shutdown. No lock: the channel serializes, as an OTP
supervisor's mailbox does.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Literal, Union

import trio

from ._actor import Actor, ActorRef
from ._budget import RestartBudget
from ._errors import DuplicateChild, SupervisorEscalation
from ._util import single_leaf

__all__ = ["ChildSpec", "Supervisor", "open_supervisor"]

logger = logging.getLogger("actors")

Restart = Literal["permanent", "transient", "temporary"]
Strategy = Literal["one_for_one", "one_for_all"]

#: Orderly-stop grace period for actor children when ChildSpec.shutdown is None.
DEFAULT_ACTOR_SHUTDOWN = 5.0


@dataclass(frozen=True)
class ChildSpec:
    """How a supervisor starts and restarts one child.

    ``factory`` is called for every (re)start and returns a fresh ``Actor`` or
    ``Supervisor``. ``restart``: "permanent" (always restarted), "transient"
    (restarted only after a crash) or "temporary" (never restarted; removed
    when it ends). ``shutdown``: seconds to wait for an orderly stop before
    cancelling the child (None: 5s for actors, forever for supervisors).
    ``ref``: for an actor child, the ``ActorRef`` it answers on, made by whoever wires the
    tree before anything starts (so siblings can be handed it at construction); None: the
    supervisor makes one when the child first starts.
    """

    name: str
    factory: Callable[[], Union[Actor, "Supervisor"]]
    restart: Restart = "permanent"
    shutdown: float | None = None
    ref: ActorRef | None = None

    def __post_init__(self) -> None:
        if self.restart not in ("permanent", "transient", "temporary"):
            raise ValueError(f"invalid restart type {self.restart!r}")


class _Child:
    __slots__ = ("spec", "ref", "instance", "done", "scope")

    def __init__(self, spec: ChildSpec):
        self.spec = spec
        self.ref: ActorRef | None = spec.ref
        self.instance: Actor | Supervisor | None = None
        self.done: trio.Event | None = None
        self.scope: trio.CancelScope | None = None


class _StartedProxy:
    """Forwards task_status.started() and remembers that it happened."""

    def __init__(self, task_status: trio.TaskStatus):
        self._task_status = task_status
        self.started_called = False

    def started(self, value=None) -> None:
        self.started_called = True
        self._task_status.started(value)


_SHUTDOWN = object()


class _Request:
    """A start_child / stop_child request on the supervisor's event channel; its caller
    waits on ``done`` for ``result`` or ``error``."""

    __slots__ = ("kind", "arg", "done", "result", "error", "abandoned", "scope")

    def __init__(self, kind: Literal["start", "stop"], arg):
        self.kind = kind
        self.arg = arg
        self.done = trio.Event()
        self.result = None
        self.error: BaseException | None = None
        self.abandoned = False  # its caller was cancelled before it was served: skip it
        self.scope: trio.CancelScope | None = None  # a start being served: its caller's cancel

    def answer(self, result=None, error: BaseException | None = None) -> None:
        if not self.done.is_set():
            self.result, self.error = result, error
            self.done.set()


class Supervisor:
    """Starts children in order, restarts them per ``strategy``, stops them in reverse."""

    def __init__(
        self,
        name: str,
        children: Sequence[ChildSpec] = (),
        *,
        strategy: Strategy = "one_for_one",
        intensity: int = 3,
        period: float = 5.0,
    ):
        if strategy not in ("one_for_one", "one_for_all"):
            raise ValueError(f"invalid strategy {strategy!r}")
        names = [spec.name for spec in children]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate child names in supervisor {name!r}: {names}")
        self.name = name
        self.strategy = strategy
        self._specs = list(children)
        self._budget = RestartBudget(intensity, period)
        self._children: list[_Child] = []
        self._nursery: trio.Nursery | None = None
        self._events_send: trio.MemorySendChannel | None = None
        self._events_recv: trio.MemoryReceiveChannel | None = None
        self._ran = False
        self._running = False  # initial children started, not stopping yet
        self._stopping = False  # run() is stopping the children (shutdown, escalation, cancel)
        self._shutdown_requested = False
        self._busy = False  # the loop is serving an event (a change may be under way)
        self._done = trio.Event()
        #: (child name, exception) of the latest crash or failed start, for health reports
        self.last_failure: tuple[str, BaseException] | None = None
        #: child name -> its crash, from the moment its task ended until the loop handled
        #: the exit (restarted it, or gave up): a health probe in between names the crash
        self._crashed: dict[str, BaseException] = {}

    def __repr__(self) -> str:
        return f"<Supervisor {self.name!r} children={self.children()}>"

    # -- introspection --------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._running and not self._shutdown_requested

    @property
    def intensity(self) -> int:
        return self._budget.intensity

    @property
    def period(self) -> float:
        return self._budget.period

    def restarts_in_window(self) -> int:
        """Restarts counted against the budget now (more than ``intensity``: it gives up)."""
        return self._budget.used(trio.current_time())

    def crashed_unhandled(self) -> dict[str, BaseException]:
        """Children whose crash the loop has not handled yet (not yet restarted, not yet
        counted against the budget): what a caller that found one not running is told."""
        return dict(self._crashed)

    def children(self) -> list[str]:
        return [child.spec.name for child in self._children]

    async def wait_ended(self, name: str) -> None:
        """Return once the child `name` has no incarnation running (at once when there is
        no such child). Its exit is then queued to the loop ahead of any request made after,
        so a `start_child` of the same name waits behind it (a transient child that ended
        normally is removed first; one that crashed is restarted first)."""
        done = next((child.done for child in self._children if child.spec.name == name), None)
        if done is not None:
            await done.wait()

    def ref(self, name: str) -> ActorRef | Supervisor:
        """The child's ActorRef (stable across restarts), or the nested Supervisor."""
        child = self._find(name)
        if child.ref is not None:
            return child.ref
        if child.instance is not None:
            return child.instance  # a nested Supervisor
        raise KeyError(f"child {name!r} of supervisor {self.name!r} is not running")

    def _find(self, name: str) -> _Child:
        for child in self._children:
            if child.spec.name == name:
                return child
        raise KeyError(f"supervisor {self.name!r} has no child {name!r}")

    # -- lifecycle ------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[Supervisor] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the tree until shutdown (returns) or escalation (raises SupervisorEscalation)."""
        if self._ran:
            raise RuntimeError(f"{self!r} already ran; create a new instance per incarnation")
        self._ran = True
        self._events_send, self._events_recv = trio.open_memory_channel(math.inf)
        escalation: SupervisorEscalation | None = None
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                try:
                    for spec in self._specs:
                        child = _Child(spec)
                        self._children.append(child)
                        try:
                            await self._start_instance(child)
                        except Exception as exc:
                            logger.warning(
                                "supervisor %s: child %s failed to start: %r",
                                self.name, spec.name, exc,
                            )
                            await self._handle_exit(child, None, exc)
                    self._running = True
                    logger.debug("supervisor %s started", self.name)
                    task_status.started(self)
                    await self._loop()
                except SupervisorEscalation as exc:
                    escalation = exc
                finally:
                    self._running = False
                    self._stopping = True
                    try:
                        await self._stop_all()
                    finally:
                        self._answer_pending()
                        nursery.cancel_scope.cancel()
        finally:
            self._running = False
            self._stopping = True
            self._done.set()
        if escalation is not None:
            raise escalation
        logger.debug("supervisor %s stopped", self.name)

    def shutdown(self) -> None:
        """Request an orderly shutdown (children stop in reverse start order)."""
        self._shutdown_requested = True
        if self._events_send is not None:
            self._events_send.send_nowait(_SHUTDOWN)

    async def aclose(self) -> None:
        """Orderly shutdown; returns once the supervisor has stopped."""
        self.shutdown()
        if self._ran:
            await self._done.wait()

    async def start_child(self, spec: ChildSpec) -> ActorRef | Supervisor:
        """Add and start a child; returns its ref once it is started (its ``on_start``
        done). A start failure is raised here and the child is not added.

        The request waits its turn behind the exits and requests before it (one at a
        time, as in OTP). Raises RuntimeError when the supervisor is not running or is
        shutting down; a request still queued when a shutdown begins is refused the same
        way, its factory never called."""
        if not self._running or self._shutdown_requested:
            raise RuntimeError(self._not_running())
        return await self._request(_Request("start", spec))

    def start_child_soon(self, spec: ChildSpec) -> ActorRef | None:
        """Add a child actor and start its task without waiting for it: its ref, which
        reaches the incarnation at once (messages sent meanwhile wait in its inbox; an actor
        running ``main`` answers them first, in order). None, and nothing done, when the
        supervisor is busy with another change (then ``start_child`` waits its turn). What
        ``on_start`` raises is a crash, to the restart strategy, not an error to the caller.
        For actors started often whose start cannot fail in a way the starter must see (one
        per job: a task step or two less per start than ``start_child``). RuntimeError when
        the supervisor is not running or shuts down; DuplicateChild for a name in use."""
        if not self._running or self._shutdown_requested:
            raise RuntimeError(self._not_running())
        assert self._events_recv is not None and self._nursery is not None
        if self._busy or self._events_recv.statistics().current_buffer_used:
            return None
        if any(child.spec.name == spec.name for child in self._children):
            raise DuplicateChild(self.name, spec.name)
        child = _Child(spec)
        instance = self._instance(child)
        if not isinstance(instance, Actor):
            raise TypeError(f"start_child_soon of {spec.name!r}: {instance!r} is not an Actor")
        self._children.append(child)
        child.instance, child.done = instance, trio.Event()
        instance._open(attach=True)
        self._nursery.start_soon(self._child_task, child, instance, child.done,
                                 trio.TASK_STATUS_IGNORED, True)
        return child.ref

    async def stop_child(self, name: str) -> None:
        """Stop a child orderly (on_stop runs) and remove it; KeyError if there is no
        such child when the request is served. While the supervisor shuts down (or after),
        returns once the tree has stopped: every child is stopped then."""
        if not self._ran or (not self._running and not self._stopping):
            raise RuntimeError(self._not_running())
        if self._stopping or self._shutdown_requested:
            await self._done.wait()
            return
        await self._request(_Request("stop", name))

    def _not_running(self) -> str:
        if self._shutdown_requested or self._stopping:
            return f"supervisor {self.name!r} is shutting down"
        return f"supervisor {self.name!r} is not running"

    # -- internals ------------------------------------------------------------
    async def _request(self, req: _Request):
        assert self._events_send is not None
        self._events_send.send_nowait(req)  # unbounded: never blocks, never fails
        try:
            await req.done.wait()
        except BaseException:
            # cancelled: a request not yet served is skipped; a start being served is
            # cancelled (its child is removed, as if it never started); a stop goes on
            req.abandoned = True
            if req.kind == "start" and req.scope is not None:
                req.scope.cancel()
            raise
        if req.error is not None:
            raise req.error
        return req.result

    async def _loop(self) -> None:
        """The one task that changes the children: exits, requests, shutdown, in order."""
        assert self._events_recv is not None
        if self._shutdown_requested:
            return
        while True:
            try:
                try:  # an event already waiting: no schedule point (a task step per job)
                    event = self._events_recv.receive_nowait()
                except trio.WouldBlock:
                    event = await self._events_recv.receive()
            except trio.EndOfChannel:
                return
            if event is _SHUTDOWN:
                return
            self._busy = True
            try:
                if isinstance(event, _Request):
                    await self._serve(event)
                else:
                    await self._handle_exit(*event)
            finally:
                self._busy = False

    async def _serve(self, req: _Request) -> None:
        if req.abandoned:
            return
        if req.kind == "start" and self._shutdown_requested:
            req.answer(error=RuntimeError(self._not_running()))
            return
        req.scope = trio.CancelScope()
        try:
            with req.scope:
                if req.kind == "start":
                    result = await self._add(req.arg)
                else:
                    result = await self._remove(req.arg)
        except Exception as exc:
            req.answer(error=exc)
            return
        except BaseException:  # cancelled with the tree: _answer_pending cannot see it
            self._answer_stopped(req)
            raise
        if not req.scope.cancelled_caught:  # else its caller is gone and no child was left
            req.answer(result)

    async def _add(self, spec: ChildSpec) -> ActorRef | Supervisor:
        if any(child.spec.name == spec.name for child in self._children):
            raise DuplicateChild(self.name, spec.name)
        child = _Child(spec)
        self._children.append(child)
        try:
            await self._start_instance(child)
        except BaseException:
            self._children.remove(child)
            raise
        return self.ref(spec.name)

    async def _remove(self, name: str) -> None:
        child = self._find(name)
        await self._stop_instance(child)
        self._children.remove(child)

    def _answer_stopped(self, req: _Request) -> None:
        """Answer a request the stopped supervisor will never serve."""
        if req.kind == "start":
            req.answer(error=RuntimeError(f"supervisor {self.name!r} stopped before "
                                          f"starting child {req.arg.name!r}"))
        else:
            req.answer(None)  # the child is stopped with the rest of the tree

    def _answer_pending(self) -> None:
        assert self._events_recv is not None
        while True:
            try:
                event = self._events_recv.receive_nowait()
            except trio.WouldBlock:
                return
            if isinstance(event, _Request):
                self._answer_stopped(event)

    def _instance(self, child: _Child) -> Actor | Supervisor:
        """A new incarnation from the child's factory (an actor gets the child's ref)."""
        instance = child.spec.factory()
        if isinstance(instance, Actor):
            if child.ref is None:
                child.ref = ActorRef(child.spec.name)
            if not instance._explicit_name:
                instance.name = child.spec.name
            instance._ref = child.ref
        elif not isinstance(instance, Supervisor):
            raise TypeError(
                f"factory of child {child.spec.name!r} returned {instance!r}, "
                "expected an Actor or Supervisor"
            )
        return instance

    async def _start_instance(self, child: _Child) -> None:
        assert self._nursery is not None
        instance = self._instance(child)
        child.instance = instance
        child.done = trio.Event()
        try:
            await self._nursery.start(self._child_task, child, instance, child.done)
        except BaseException:
            child.instance = None
            raise

    async def _child_task(self, child: _Child, instance, done: trio.Event, task_status,
                          soon: bool = False) -> None:
        proxy = _StartedProxy(task_status)
        exc: Exception | None = None
        try:
            with trio.CancelScope() as scope:
                child.scope = scope
                await instance.run(task_status=proxy)
        except Exception as e:
            if not proxy.started_called and not soon:
                raise  # reported to whoever called nursery.start()
            exc = e
        finally:
            done.set()
        assert self._events_send is not None
        if exc is not None:
            self._crashed[child.spec.name] = exc
        self._events_send.send_nowait((child, instance, exc))

    async def _handle_exit(self, child: _Child, instance, exc: Exception | None) -> None:
        """A child ended (instance None: it failed to start). Apply the restart strategy."""
        self._crashed.pop(child.spec.name, None)
        if child not in self._children or (instance is not None and child.instance is not instance):
            return  # stale event: we stopped this incarnation deliberately
        child.instance = None
        name = child.spec.name
        if exc is None:
            logger.debug("supervisor %s: child %s exited normally", self.name, name)
        else:
            self.last_failure = (name, exc)
            logger.warning("supervisor %s: child %s crashed: %r", self.name, name, exc)
        restart = child.spec.restart
        if restart == "temporary" or (restart == "transient" and exc is None):
            self._children.remove(child)
            return
        while True:
            if not self._budget.record(trio.current_time()):
                logger.error(
                    "supervisor %s: more than %d restarts within %ss, giving up",
                    self.name, self._budget.intensity, self._budget.period,
                )
                raise SupervisorEscalation(self.name, exc) from exc
            try:
                if self.strategy == "one_for_one":
                    logger.info("supervisor %s: restarting child %s", self.name, name)
                    await self._start_instance(child)
                else:
                    logger.info(
                        "supervisor %s: restarting all children (one_for_all, after %s)",
                        self.name, name,
                    )
                    for other in reversed(list(self._children)):
                        if other is not child:
                            await self._stop_instance(other)
                    self._children = [
                        c for c in self._children
                        if c is child or c.spec.restart != "temporary"
                    ]
                    for c in list(self._children):
                        if c.instance is None:
                            await self._start_instance(c)
                return
            except Exception as start_exc:
                logger.warning(
                    "supervisor %s: restart of %s failed: %r", self.name, name, start_exc
                )
                exc = start_exc
                self.last_failure = (name, exc)

    async def _stop_instance(self, child: _Child) -> None:
        instance, done = child.instance, child.done
        if instance is None or done is None:
            return
        child.instance = None  # marks the coming exit event as expected
        if isinstance(instance, Actor):
            instance.stop()
            grace = DEFAULT_ACTOR_SHUTDOWN if child.spec.shutdown is None else child.spec.shutdown
        else:
            instance.shutdown()
            grace = math.inf if child.spec.shutdown is None else child.spec.shutdown
        with trio.move_on_after(grace):
            await done.wait()
        if not done.is_set():
            logger.warning(
                "supervisor %s: child %s did not stop within %ss; cancelling it",
                self.name, child.spec.name, grace,
            )
            if child.scope is not None:
                child.scope.cancel()
            await done.wait()

    async def _stop_all(self) -> None:
        for child in reversed(list(self._children)):
            await self._stop_instance(child)
        self._children.clear()


@asynccontextmanager
async def open_supervisor(
    name: str,
    children: Sequence[ChildSpec] = (),
    *,
    strategy: Strategy = "one_for_one",
    intensity: int = 3,
    period: float = 5.0,
) -> AsyncIterator[Supervisor]:
    """Start a supervision tree for the duration of the ``async with`` block.

    Leaving the block normally shuts the tree down in order (reverse start
    order, on_stop runs). A single failure (e.g. ``SupervisorEscalation`` or
    an exception from the block) is raised as itself, not wrapped in an
    ExceptionGroup.
    """
    sup = Supervisor(name, children, strategy=strategy, intensity=intensity, period=period)
    leaf: BaseException | None = None
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(sup.run)
            yield sup
            sup.shutdown()
    except BaseExceptionGroup as eg:
        leaf = single_leaf(eg)
        if leaf is None:
            raise
    if leaf is not None:
        raise leaf
