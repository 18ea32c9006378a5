"""Exceptions raised by the actor runtime."""

from __future__ import annotations

import trio

__all__ = ["ActorDead", "CallTimeout", "InboxFull", "SupervisorEscalation"]


class ActorDead(Exception):
    """The target actor is not running (never started, stopped, crashed or restarting)."""

    def __init__(self, name: str):
        super().__init__(f"actor {name!r} is not running")
        self.name = name


class CallTimeout(trio.TooSlowError):
    """``ActorRef.call`` did not get a reply within its timeout."""

    def __init__(self, name: str, timeout: float):
        super().__init__(f"call to actor {name!r} timed out after {timeout}s")
        self.name = name
        self.timeout = timeout


class InboxFull(Exception):
    """``ActorRef.cast_nowait`` found the actor's bounded inbox full."""

    def __init__(self, name: str):
        super().__init__(f"inbox of actor {name!r} is full")
        self.name = name


class SupervisorEscalation(Exception):
    """A supervisor exceeded its restart intensity and gave up."""

    def __init__(self, name: str, last_exception: BaseException | None):
        super().__init__(
            f"supervisor {name!r} exceeded its restart intensity; "
            f"last failure: {last_exception!r}"
        )
        self.name = name
        self.last_exception = last_exception
