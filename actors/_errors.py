"""Exceptions raised by the actor runtime."""

from __future__ import annotations

import trio

__all__ = ["ActorDead", "CallTimeout", "DuplicateChild", "InboxFull", "SupervisorEscalation"]


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


class DuplicateChild(ValueError):
    """A supervisor was asked to start a child under a name one of its children has."""

    def __init__(self, supervisor: str, name: str):
        super().__init__(f"supervisor {supervisor!r} already has a child {name!r}")
        self.name = name


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
